/* conv_taps.c - the plan, padding, packing and plain C definitions of the taps convolution (conv_taps.h); the
 * vector kernels are in conv_taps_x86.c. */
#include "conv_taps.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

ConvTapsLevel conv_taps_max_level = CONV_TAPS_AVX512;

ConvTapsLevel conv_taps_cpu(void) {
    static atomic_int level = -1; /* every thread that races here computes the same answer */
    if (atomic_load(&level) < 0) {
        int l = CONV_TAPS_OFF;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
        __builtin_cpu_init();
        /* libgcc checks that the OS saves the ymm / zmm state (XCR0) before reporting these */
        if (__builtin_cpu_supports("avx512f")) l = CONV_TAPS_AVX512;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) l = CONV_TAPS_AVX2;
#endif
        atomic_store(&level, l);
    }
    return (ConvTapsLevel)atomic_load(&level);
}

ConvTapsLevel conv_taps_level(void) {
    const ConvTapsLevel cpu = conv_taps_cpu();
    return conv_taps_max_level < cpu ? conv_taps_max_level : cpu;
}

QtStatus conv_taps_select(const char *name, const char *what, QtError *err) {
    if (!name || !*name || !strcmp(name, "auto")) {
        conv_taps_max_level = CONV_TAPS_AVX512;
        return QT_OK;
    }
    for (int l = 0; l < CONV_TAPS_LEVEL_COUNT; l++) {
        if (strcmp(name, conv_taps_level_name((ConvTapsLevel)l)) != 0) continue;
        if ((int)conv_taps_cpu() < l)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: %s: this CPU (or OS) has no %s; choose another of avx512, "
                                "avx2, gemm or auto", what, name, l == CONV_TAPS_AVX512 ? "AVX-512F" : "AVX2 with FMA");
        conv_taps_max_level = (ConvTapsLevel)l;
        return QT_OK;
    }
    return qt_error_set(err, QT_ERR_CONFIG, "%s: unknown convolution kernel '%s'; expected avx512, avx2, gemm or auto",
                        what, name);
}

const char *conv_taps_level_name(ConvTapsLevel level) {
    static const char *const names[CONV_TAPS_LEVEL_COUNT] = {"gemm", "avx2", "avx512"};
    return (int)level >= 0 && level < CONV_TAPS_LEVEL_COUNT ? names[level] : "unknown";
}

int conv_taps_lanes(ConvTapsLevel level) { return level == CONV_TAPS_AVX512 ? 16 : 8; }

/* The flat layout where it saves vectors (conv_taps.h): a 3x3 kernel whose plane takes fewer vectors of `lanes`
 * consecutive outputs than rows of whole vectors (at 16 lanes 28x28: 49 against 56, 14x14: 13 against 14; at 8,
 * 98 against 112 and 25 against 28). */
static bool taps_flat(int lanes, int H, int W, int KH, int KW) {
    const long long flat = ((long long)H * W + lanes - 1) / lanes, rows = (long long)H * ((W + lanes - 1) / lanes);
    return KH == 3 && KW == 3 && flat < rows;
}

bool conv_taps_fits(ConvTapsLevel level, int H, int W, int KH, int KW, int stride, int padding) {
    if (level == CONV_TAPS_OFF || stride != 1 || KH < 1 || KW < 1 || !(KH & 1) || !(KW & 1)) return false;
    if (2 * padding != KH - 1 || 2 * padding != KW - 1 || KH * KW < 2 || KH * KW > 49) return false;
    const int lanes = conv_taps_lanes(level), vpr = (W + lanes - 1) / lanes;
    if (H < 1 || W < 1) return false;
    /* the forward's and input gradient's lanes at least 2/3 outputs: rows of whole vectors, or flat planes (7x7 at
     * 16 lanes: 49 outputs in 4 vectors); the weight gradient's lanes are output channels, whatever the plane */
    const long long flat_lanes = ((long long)H * W + lanes - 1) / lanes * lanes;
    return 3 * W >= 2 * vpr * lanes || (taps_flat(lanes, H, W, KH, KW) && 3LL * H * W >= 2 * flat_lanes);
}

size_t conv_taps_table_floats(int H, int W, int lanes) {
    const size_t v = (size_t)H * (size_t)((W + lanes - 1) / lanes);
    const size_t vf = ((size_t)H * W + 15) / 16; /* the flat masks: two uint16 a vector */
    return 2 * v + 49 + (v + 3) / 4 + (vf + 1);
}

void conv_taps_plan(ConvTaps *p, ConvTapsLevel level, int C, int OC, int H, int W, int KH, int KW, float *tables) {
    const int lanes = conv_taps_lanes(level), vpr = (W + lanes - 1) / lanes, nv = H * vpr;
    *p = (ConvTaps){.C = C, .OC = OC, .H = H, .W = W, .KH = KH, .KW = KW, .lanes = lanes,
                    .rb = lanes == 16 ? 8 : 4, .vpr = vpr};
    /* rows of whole vectors: a row's first vector (tap column 0) loads aligned, where a 64-byte line holds it */
    p->pw = (W + KW - 1 + lanes - 1) / lanes * lanes;
    p->pplane = (size_t)(H + KH - 1) * (size_t)p->pw;
    p->grid = (int32_t *)(void *)tables;
    p->out = p->grid + nv;
    p->off = p->out + nv;
    p->n = (uint8_t *)(p->off + 49);
    for (int v = 0; v < nv; v++) {
        const int oh = v / vpr, col = v % vpr * lanes;
        p->grid[v] = oh * p->pw + col;
        p->out[v] = oh * W + col;
        p->n[v] = (uint8_t)(W - col < lanes ? W - col : lanes);
    }
    for (int t = 0; t < KH * KW; t++) p->off[t] = t / KW * p->pw + t % KW;
    p->flat = taps_flat(lanes, H, W, KH, KW);
    p->fplane = p->vplane = p->pplane;
    if (!p->flat) return;
    p->nvf = (H * W + lanes - 1) / lanes;
    p->vplane = (size_t)(H + 2) * (size_t)W + 2;
    p->fplane = lanes == 16 ? p->vplane : 3 * p->vplane;
    if (lanes != 16) return; /* 8 lanes read the edge taps' zeros from their own copies of the plane */
    p->fm0 = (uint16_t *)(void *)(p->n + ((nv + 3) / 4) * 4);
    p->fm2 = p->fm0 + p->nvf;
    for (int v = 0; v < p->nvf; v++) {
        unsigned m0 = 0, m2 = 0;
        for (int l = 0; l < 16; l++) {
            const int col = (v * 16 + l) % W;
            m0 |= (unsigned)(col != 0) << l;
            m2 |= (unsigned)(col != W - 1) << l;
        }
        p->fm0[v] = (uint16_t)m0, p->fm2[v] = (uint16_t)m2;
    }
}

size_t conv_taps_padded_floats(const ConvTaps *p, int channels, int n) {
    return (size_t)n * (size_t)channels * p->fplane + (size_t)p->lanes;
}

size_t conv_taps_padded_rows_floats(const ConvTaps *p, int channels, int n) {
    return (size_t)n * (size_t)channels * p->pplane + (size_t)p->lanes;
}

/* The flat layout (conv_taps.h): each plane a guard zero, a row of zeros, the image's rows as they lie (one copy),
 * a row of zeros and a guard zero; at 8 lanes twice more, the copies with column W - 1 and column 0 zeroed. */
static void pad_flat(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img, size_t ld) {
    const size_t hw = (size_t)p->H * p->W, edge = (size_t)p->W + 1, W = (size_t)p->W;
    for (int i = 0; i < n; i++)
        for (int c = 0; c < channels; c++) {
            float *d = dst + ((size_t)i * channels + c) * p->fplane;
            const float *s = src + (size_t)i * img + (size_t)c * ld;
            for (int k = 0; k < (p->lanes == 16 ? 1 : 3); k++, d += p->vplane) {
                memset(d, 0, edge * sizeof *d);
                memcpy(d + edge, s, hw * sizeof *d);
                memset(d + edge + hw, 0, edge * sizeof *d);
                if (k) /* column W - 1 (read across the edge by tap column 0), or column 0 (by tap column 2) */
                    for (size_t h = 0; h < (size_t)p->H; h++) d[edge + h * W + (k == 1 ? W - 1 : 0)] = 0.0f;
            }
        }
    memset(dst + (size_t)n * channels * p->fplane, 0, (size_t)p->lanes * sizeof *dst);
}

void conv_taps_pad(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img, size_t ld) {
    if (p->flat) pad_flat(p, dst, src, channels, n, img, ld);
    else conv_taps_pad_rows(p, dst, src, channels, n, img, ld);
}

void conv_taps_pad_rows(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img,
                        size_t ld) {
    /* a row of 14 or 28 floats took a memcpy call and two small loops; 8 lanes serve both widths (a padded
     * row is whole vectors of either), as fast as 16 here: the pad waits on memory */
    if (conv_taps_cpu() >= CONV_TAPS_AVX2) conv_taps_pad_avx2(p, dst, src, channels, n, img, ld);
    else conv_taps_pad_ref(p, dst, src, channels, n, img, ld);
}

/* The input at padded row r (0 .. H + KH - 2) and padded column col (0 .. W + KW - 2) of channel c of a padded
 * image in the forward's layout: the padding's zero outside the image. */
static inline float taps_x_at(const ConvTaps *p, const float *xp, int c, int r, int col) {
    if (!p->flat) return xp[(size_t)c * p->pplane + (size_t)r * p->pw + (size_t)col];
    if (col < 1 || col > p->W) return 0.0f;
    return xp[(size_t)c * p->fplane + (size_t)r * p->W + (size_t)col];
}

void conv_taps_pad_ref(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img, size_t ld) {
    const int kh0 = (p->KH - 1) / 2, kw0 = (p->KW - 1) / 2, right = p->pw - kw0 - p->W;
    for (int i = 0; i < n; i++)
        for (int c = 0; c < channels; c++) {
            const float *s = src + (size_t)i * img + (size_t)c * ld;
            float *d = dst + ((size_t)i * channels + c) * p->pplane;
            /* every float of the plane written once: no memset of the whole buffer first */
            for (int r = 0; r < p->H + p->KH - 1; r++, d += p->pw) {
                const int h = r - kh0;
                if (h < 0 || h >= p->H) {
                    memset(d, 0, (size_t)p->pw * sizeof *d);
                    continue;
                }
                for (int k = 0; k < kw0; k++) d[k] = 0.0f;
                memcpy(d + kw0, s + (size_t)h * p->W, (size_t)p->W * sizeof *d);
                for (int k = 0; k < right; k++) d[kw0 + p->W + k] = 0.0f;
            }
        }
    memset(dst + (size_t)n * channels * p->pplane, 0, (size_t)p->lanes * sizeof *dst);
}

size_t conv_taps_packed_floats(const ConvTaps *p, int rows, int channels) {
    return (size_t)(rows + p->rb - 1) / p->rb * p->rb * channels * p->KH * p->KW;
}

/* dst [rows/rb][channels][KK][rb] = src(row, channel, tap) (0 past rows). */
static void pack_blocks(const ConvTaps *p, float *dst, int rows, int channels, const float *w, int ldw,
                        bool transposed) {
    const int KK = p->KH * p->KW, rb = p->rb;
    for (int b = 0; b < (rows + rb - 1) / rb; b++)
        for (int c = 0; c < channels; c++)
            for (int t = 0; t < KK; t++)
                for (int r = 0; r < rb; r++) {
                    const int row = b * rb + r;
                    float v = 0.0f;
                    if (row < rows) /* transposed: row = an input channel, c = an output channel, taps flipped */
                        v = transposed ? w[(size_t)c * ldw + (size_t)row * KK + (size_t)(KK - 1 - t)]
                                       : w[(size_t)row * ldw + (size_t)c * KK + (size_t)t];
                    *dst++ = v;
                }
}

void conv_taps_pack(const ConvTaps *p, float *dst, const float *w, int ldw, int rows) {
    pack_blocks(p, dst, rows, p->C, w, ldw, false);
}

void conv_taps_pack_t(const ConvTaps *p, float *dst, const float *w, int ldw) {
    pack_blocks(p, dst, p->C, p->OC, w, ldw, true);
}

void conv_taps_forward_ref(const ConvTaps *p, int lanes, float *y, size_t ldy, const float *xp, const float *wp,
                           int rows, int channels, bool add) {
    (void)lanes; /* every lane is its own chain: the same at any width */
    const int KK = p->KH * p->KW, rb = p->rb;
    for (int r = 0; r < rows; r++) {
        const float *wb = wp + (size_t)(r / rb) * channels * KK * rb + r % rb;
        for (int h = 0; h < p->H; h++)
            for (int w = 0; w < p->W; w++) {
                float acc = 0.0f;
                for (int c = 0; c < channels; c++)
                    for (int t = 0; t < KK; t++)
                        acc = fmaf(wb[((size_t)c * KK + t) * rb], taps_x_at(p, xp, c, h + t / p->KW, w + t % p->KW),
                                   acc);
                float *o = y + (size_t)r * ldy + (size_t)h * p->W + w;
                *o = (add ? *o : 0.0f) + acc; /* written: a -0.0f sum stored +0.0f */
            }
    }
}

size_t conv_taps_oc_pad(int rows) { return ((size_t)rows + 15) / 16 * 16; }

void conv_taps_dp_t_ref(const ConvTaps *p, float *dpt, const float *dp, size_t ldp, size_t ldi, int rows, int n) {
    const size_t plane = (size_t)p->H * p->W, ldd = conv_taps_oc_pad(rows);
    for (int i = 0; i < n; i++)
        for (size_t q = 0; q < plane; q++) {
            float *o = dpt + ((size_t)i * plane + q) * ldd;
            for (size_t r = 0; r < ldd; r++) o[r] = r < (size_t)rows ? dp[r * ldp + (size_t)i * ldi + q] : 0.0f;
        }
}

void conv_taps_dw_ref(const ConvTaps *p, float *dwt, const float *dpt, const float *xp, int n, bool add) {
    const int KK = p->KH * p->KW;
    const size_t ldd = conv_taps_oc_pad(p->OC), plane = (size_t)p->H * p->W;
    for (int c = 0; c < p->C; c++)
        for (int t = 0; t < KK; t++)
            for (int oc = 0; oc < p->OC; oc++) {
                float *o = dwt + ((size_t)c * KK + t) * ldd + oc;
                for (int i = 0; i < n; i++) {
                    float acc = 0.0f; /* the image's chain, then added (or written by the first of a fresh call) */
                    for (int h = 0; h < p->H; h++)
                        for (int w = 0; w < p->W; w++)
                            acc = fmaf(dpt[((size_t)i * plane + (size_t)h * p->W + w) * ldd + oc],
                                       xp[((size_t)i * p->C + c) * p->pplane + (size_t)h * p->pw + w +
                                          (size_t)p->off[t]],
                                       acc);
                    *o = !add && i == 0 ? acc : *o + acc;
                }
            }
}

void conv_taps_dw_add_parts(const ConvTaps *p, float *grad, const float *parts, int n_parts) {
    conv_taps_dw_add_parts_rows(p, grad, parts, n_parts, 0, p->OC);
}

void conv_taps_dw_add_parts_rows(const ConvTaps *p, float *grad, const float *parts, int n_parts, int oc0, int oc1) {
    conv_dw_t_add_parts_rows(grad, parts, n_parts, p->OC, (size_t)p->C * p->KH * p->KW, oc0, oc1);
}

void conv_dw_t_add_parts_rows(float *grad, const float *parts, int n_parts, int OC, size_t ckk, int oc0, int oc1) {
    const size_t ldd = conv_taps_oc_pad(OC), part = ckk * ldd;
    for (int oc = oc0; oc < oc1; oc++)
        for (size_t ct = 0; ct < ckk; ct++) {
            float g = grad[(size_t)oc * ckk + ct];
            for (int k = 0; k < n_parts; k++) g += parts[(size_t)k * part + ct * ldd + oc];
            grad[(size_t)oc * ckk + ct] = g;
        }
}

void conv_taps_forward(const ConvTaps *p, ConvTapsLevel level, float *y, size_t ldy, const float *xp,
                       const float *wp, int rows, int channels, bool add) {
    if (level == CONV_TAPS_AVX512) conv_taps_forward_avx512(p, y, ldy, xp, wp, rows, channels, add);
    else if (level == CONV_TAPS_AVX2) conv_taps_forward_avx2(p, y, ldy, xp, wp, rows, channels, add);
    else conv_taps_forward_ref(p, p->lanes, y, ldy, xp, wp, rows, channels, add);
}

void conv_taps_dw(const ConvTaps *p, ConvTapsLevel level, float *dwt, const float *dpt, const float *xp, int n,
                  bool add) {
    if (level == CONV_TAPS_AVX512) conv_taps_dw_avx512(p, dwt, dpt, xp, n, add);
    else if (level == CONV_TAPS_AVX2) conv_taps_dw_avx2(p, dwt, dpt, xp, n, add);
    else conv_taps_dw_ref(p, dwt, dpt, xp, n, add);
}

void conv_taps_dp_t(const ConvTaps *p, ConvTapsLevel level, float *dpt, const float *dp, size_t ldp, size_t ldi,
                    int rows, int n) {
    if (level == CONV_TAPS_AVX512) conv_taps_dp_t_avx512(p, dpt, dp, ldp, ldi, rows, n);
    else if (level == CONV_TAPS_AVX2) conv_taps_dp_t_avx2(p, dpt, dp, ldp, ldi, rows, n);
    else conv_taps_dp_t_ref(p, dpt, dp, ldp, ldi, rows, n);
}
