/* conv_taps_x86.c - the taps convolution's kernels (conv_taps.h): AVX-512F at 16 lanes, AVX2 + FMA at 8. Each
 * output lane is the chain conv_taps_forward_ref / conv_taps_dw_ref define, so every kernel gives their bits.
 *
 * Forward: a block of rb output rows by 3 vectors of columns (24 sums at 16 lanes, 12 at 8) in registers; per
 * channel and tap, 3 loads of the shifted plane and rb broadcast weights. Weight gradient: 3 output rows by up to
 * 9 taps of one input channel (at 8 lanes, 3 by 3) in registers, over every vector of every image; then each sum's
 * lanes as a tree; a 3x3 kernel at 16 lanes, 2 output rows by its 9 taps, walking the padded rows of x once
 * (dw512_k3_block). Padding (both widths, AVX2): each padded row as whole vectors, its source columns through masked
 * loads. */
#include "conv_taps.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)

#include <immintrin.h>

#define T512 __attribute__((target("avx512f,fma")))
#define T256 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

/* ---- AVX-512 --------------------------------------------------------------------------------------------------- */

T512 INLINE __mmask16 mask16(int n) { return (__mmask16)((1u << n) - 1u); }

/* Rows [0, rows) of one block (weights wb [channels][KK][8]) by vectors v0 .. v0 + V - 1. */
T512 INLINE void fwd512_tile(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wb, int rows,
                             int channels, int v0, const int V, bool add) {
    __m512 acc[8][3];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
#pragma GCC unroll 3
        for (int i = 0; i < 3; i++) acc[r][i] = _mm512_setzero_ps();
    const int KK = p->KH * p->KW;
    const float *x0 = xp + p->grid[v0], *x1 = xp + p->grid[V > 1 ? v0 + 1 : v0];
    const float *x2 = xp + p->grid[V > 2 ? v0 + 2 : v0];
    for (int c = 0; c < channels; c++, x0 += p->pplane, x1 += p->pplane, x2 += p->pplane)
        for (int t = 0; t < KK; t++, wb += 8) {
            const int o = p->off[t];
            const __m512 b0 = _mm512_loadu_ps(x0 + o);
            const __m512 b1 = V > 1 ? _mm512_loadu_ps(x1 + o) : b0, b2 = V > 2 ? _mm512_loadu_ps(x2 + o) : b0;
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                const __m512 a = _mm512_set1_ps(wb[r]);
                acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
                if (V > 1) acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
                if (V > 2) acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
            }
        }
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        if (r >= rows) break;
#pragma GCC unroll 3
        for (int i = 0; i < V; i++) {
            const __mmask16 m = mask16(p->n[v0 + i]);
            float *o = y + (size_t)r * ldy + p->out[v0 + i];
            const __m512 v = add ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), acc[r][i]) : acc[r][i];
            _mm512_mask_storeu_ps(o, m, v);
        }
    }
}

/* The flat layout's tile (conv_taps.h): rows [0, rows) of one block by flat vectors v0 .. v0 + V - 1 of a 3x3
 * kernel; taps of column 0 and 2 load zeros where they would read across a row's edge. */
T512 INLINE void fwd512_flat_tile(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wb,
                                  int rows, int channels, int v0, const int V, bool add) {
    __m512 acc[8][3];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
#pragma GCC unroll 3
        for (int i = 0; i < 3; i++) acc[r][i] = _mm512_setzero_ps();
    __mmask16 m0[3], m2[3];
#pragma GCC unroll 3
    for (int i = 0; i < 3; i++) {
        const int v = i < V ? v0 + i : v0;
        m0[i] = (__mmask16)p->fm0[v], m2[i] = (__mmask16)p->fm2[v];
    }
    const size_t W = (size_t)p->W;
    const float *x = xp + (size_t)v0 * 16;
    for (int c = 0; c < channels; c++, x += p->fplane)
#pragma GCC unroll 3
        for (int kh = 0; kh < 3; kh++)
#pragma GCC unroll 3
            for (int kw = 0; kw < 3; kw++, wb += 8) {
                const float *xt = x + kh * W + kw;
                __m512 b[3];
#pragma GCC unroll 3
                for (int i = 0; i < 3; i++) /* an edge tap's lanes across the row's edge: the padding's zero */
                    b[i] = i >= V    ? _mm512_setzero_ps()
                           : kw == 1 ? _mm512_loadu_ps(xt + 16 * i)
                                     : _mm512_maskz_loadu_ps(kw == 0 ? m0[i] : m2[i], xt + 16 * i);
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    const __m512 a = _mm512_set1_ps(wb[r]);
#pragma GCC unroll 3
                    for (int i = 0; i < 3; i++) {
                        if (i >= V) break;
                        acc[r][i] = _mm512_fmadd_ps(a, b[i], acc[r][i]);
                    }
                }
            }
    const int hw = p->H * p->W;
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        if (r >= rows) break;
#pragma GCC unroll 3
        for (int i = 0; i < V; i++) {
            const int q = (v0 + i) * 16;
            const __mmask16 m = mask16(hw - q < 16 ? hw - q : 16);
            float *o = y + (size_t)r * ldy + q;
            const __m512 v = add ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), acc[r][i]) : acc[r][i];
            _mm512_mask_storeu_ps(o, m, v);
        }
    }
}

/* One tile in the plan's layout. */
T512 INLINE void fwd512_any_tile(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wb, int rows,
                                 int channels, int v0, const int V, bool add) {
    if (p->flat) fwd512_flat_tile(p, y, ldy, xp, wb, rows, channels, v0, V, add);
    else fwd512_tile(p, y, ldy, xp, wb, rows, channels, v0, V, add);
}

T512 void conv_taps_forward_avx512(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wp,
                                   int rows, int channels, bool add) {
    const int KK = p->KH * p->KW, nv = p->flat ? p->nvf : p->H * p->vpr;
    for (int b = 0; b * 8 < rows; b++) {
        const float *wb = wp + (size_t)b * channels * KK * 8;
        const int rb = rows - b * 8 < 8 ? rows - b * 8 : 8;
        float *yb = y + (size_t)b * 8 * ldy;
        int v = 0;
        for (; v + 3 <= nv; v += 3) fwd512_any_tile(p, yb, ldy, xp, wb, rb, channels, v, 3, add);
        if (nv - v == 2) fwd512_any_tile(p, yb, ldy, xp, wb, rb, channels, v, 2, add);
        else if (nv - v == 1) fwd512_any_tile(p, yb, ldy, xp, wb, rb, channels, v, 1, add);
    }
}

/* The lanes of v as conv_taps_dw_ref's tree: halves added until one is left. */
T512 INLINE float hsum512(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* Output rows oc .. oc + R - 1 (R <= 3: 27 sums, 3 rows of dp and one of x in 31 registers), channel c, taps
 * t0 .. t0 + tb - 1 (tb <= 9; the others computed at tap t0 and dropped); k3: the 3x3 kernel (KK = 9, t0 = 0), its
 * taps as constant shifts of three row pointers. The loops run over a row's vectors j, then the images, then the
 * rows, conv_taps_dw_ref's order; a vector's lanes past W read zeros of dp. */
T512 INLINE void dw512_block(const ConvTaps *p, float *dw, const float *dp, size_t ldp, size_t ldi, const float *xp,
                             int n, bool add, int oc, const int R, int c, int t0, int tb, const bool k3) {
    __m512 acc[3][9];
#pragma GCC unroll 3
    for (int r = 0; r < 3; r++)
#pragma GCC unroll 9
        for (int k = 0; k < 9; k++) acc[r][k] = _mm512_setzero_ps();
    int off[9];
    for (int k = 0; k < 9; k++) off[k] = p->off[k < tb ? t0 + k : t0];
    const size_t pw = (size_t)p->pw;
    for (int j = 0; j < p->vpr; j++) {
        const int col = j * 16;
        const __mmask16 m = mask16(p->W - col < 16 ? p->W - col : 16);
        for (int i = 0; i < n; i++) {
            const float *d0 = dp + (size_t)oc * ldp + (size_t)i * ldi + col, *d1 = R > 1 ? d0 + ldp : d0;
            const float *d2 = R > 2 ? d1 + ldp : d0;
            const float *x = xp + ((size_t)i * p->C + c) * p->pplane + col;
            for (int h = 0; h < p->H; h++, d0 += p->W, d1 += p->W, d2 += p->W, x += pw) {
                const __m512 a0 = _mm512_maskz_loadu_ps(m, d0);
                const __m512 a1 = R > 1 ? _mm512_maskz_loadu_ps(m, d1) : a0;
                const __m512 a2 = R > 2 ? _mm512_maskz_loadu_ps(m, d2) : a0;
#pragma GCC unroll 9
                for (int k = 0; k < 9; k++) {
                    __m512 b = _mm512_loadu_ps(k3 ? x + (size_t)(k / 3) * pw + k % 3 : x + off[k]);
                    __asm__("" : "+v"(b)); /* one load for both rows: gcc would fold it into each FMA */
                    acc[0][k] = _mm512_fmadd_ps(a0, b, acc[0][k]);
                    if (R > 1) acc[1][k] = _mm512_fmadd_ps(a1, b, acc[1][k]);
                    if (R > 2) acc[2][k] = _mm512_fmadd_ps(a2, b, acc[2][k]);
                }
            }
        }
    }
    const int KK = p->KH * p->KW;
#pragma GCC unroll 3
    for (int r = 0; r < R; r++) /* constant indices: acc stays in registers */
#pragma GCC unroll 9
        for (int k = 0; k < 9; k++) {
            if (k >= tb) break;
            float *o = dw + (size_t)(oc + r) * p->C * KK + (size_t)c * KK + t0 + k;
            const float s = hsum512(acc[r][k]);
            *o = add ? *o + s : s;
        }
}

/* One padded row rho of x against the output rows rho - kh for kh in [kh_lo, kh_hi] (those inside the image): its
 * three column shifts x0..x2 times the dp rows a0 (row oc) and a1 (oc + 1) that met it, a0[kh] = row rho - kh. */
T512 INLINE void dw512_k3_row(__m512 (*acc)[9], const __m512 *a0, const __m512 *a1, const int R, __m512 x0,
                              __m512 x1, __m512 x2, const int kh_lo, const int kh_hi) {
#pragma GCC unroll 3
    for (int kh = 0; kh < 3; kh++) {
        if (kh < kh_lo || kh > kh_hi) continue;
        acc[0][3 * kh] = _mm512_fmadd_ps(a0[kh], x0, acc[0][3 * kh]);
        acc[0][3 * kh + 1] = _mm512_fmadd_ps(a0[kh], x1, acc[0][3 * kh + 1]);
        acc[0][3 * kh + 2] = _mm512_fmadd_ps(a0[kh], x2, acc[0][3 * kh + 2]);
        if (R > 1) {
            acc[1][3 * kh] = _mm512_fmadd_ps(a1[kh], x0, acc[1][3 * kh]);
            acc[1][3 * kh + 1] = _mm512_fmadd_ps(a1[kh], x1, acc[1][3 * kh + 1]);
            acc[1][3 * kh + 2] = _mm512_fmadd_ps(a1[kh], x2, acc[1][3 * kh + 2]);
        }
    }
}

/* The 3x3 kernel's weight gradient for output rows oc .. oc + R - 1 (R <= 2: 18 sums, 6 rows of dp and 3 of x in
 * 27 registers), channel c, walking the padded rows of x instead of the output rows: each padded row rho is
 * loaded once at its three column shifts and meets the output rows rho - kh (kh = 0, 1, 2) whose dp rows the last
 * three steps loaded. dw512_block loads all nine shifts for every output row, so each padded row three times;
 * here a step has 3 x loads and R dp loads for 9 R FMAs, where the load ports bounded the other. Each sum still
 * takes its products in conv_taps_dw_ref's order (h ascending is rho ascending for a fixed kh), so the bits are
 * the same. */
T512 INLINE void dw512_k3_block(const ConvTaps *p, float *dw, const float *dp, size_t ldp, size_t ldi, const float *xp,
                                int n, bool add, int oc, const int R, int c) {
    __m512 acc[2][9];
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++)
#pragma GCC unroll 9
        for (int k = 0; k < 9; k++) acc[r][k] = _mm512_setzero_ps();
    const size_t pw = (size_t)p->pw;
    const int H = p->H, W = p->W;
    for (int j = 0; j < p->vpr; j++) {
        const int col = j * 16;
        const __mmask16 m = mask16(W - col < 16 ? W - col : 16);
        for (int i = 0; i < n; i++) {
            const float *d0 = dp + (size_t)oc * ldp + (size_t)i * ldi + col, *d1 = R > 1 ? d0 + ldp : d0;
            const float *x = xp + ((size_t)i * p->C + c) * p->pplane + col;
            __m512 a0[3], a1[3]; /* a0[kh]: dp row rho - kh of output row oc; a1: of oc + 1 */
            a0[0] = _mm512_maskz_loadu_ps(m, d0), a1[0] = R > 1 ? _mm512_maskz_loadu_ps(m, d1) : a0[0];
            dw512_k3_row(acc, a0, a1, R, _mm512_loadu_ps(x), _mm512_loadu_ps(x + 1), _mm512_loadu_ps(x + 2), 0, 0);
            x += pw;
            a0[1] = a0[0], a1[1] = a1[0];
            if (H > 1) {
                a0[0] = _mm512_maskz_loadu_ps(m, d0 + W);
                if (R > 1) a1[0] = _mm512_maskz_loadu_ps(m, d1 + W);
                dw512_k3_row(acc, a0, a1, R, _mm512_loadu_ps(x), _mm512_loadu_ps(x + 1), _mm512_loadu_ps(x + 2), 0,
                             1);
            } else {
                dw512_k3_row(acc, a0, a1, R, _mm512_loadu_ps(x), _mm512_loadu_ps(x + 1), _mm512_loadu_ps(x + 2), 1,
                             1);
            }
            x += pw;
            for (int rho = 2; rho < H; rho++, x += pw) {
                a0[2] = a0[1], a0[1] = a0[0], a1[2] = a1[1], a1[1] = a1[0];
                a0[0] = _mm512_maskz_loadu_ps(m, d0 + (size_t)rho * W);
                if (R > 1) a1[0] = _mm512_maskz_loadu_ps(m, d1 + (size_t)rho * W);
                dw512_k3_row(acc, a0, a1, R, _mm512_loadu_ps(x), _mm512_loadu_ps(x + 1), _mm512_loadu_ps(x + 2), 0,
                             2);
            }
            if (H > 1) { /* rho = H: rows H - 1 (kh 1) and H - 2 (kh 2); rho = H + 1: row H - 1 (kh 2) */
                a0[2] = a0[1], a0[1] = a0[0], a1[2] = a1[1], a1[1] = a1[0];
                dw512_k3_row(acc, a0, a1, R, _mm512_loadu_ps(x), _mm512_loadu_ps(x + 1), _mm512_loadu_ps(x + 2), 1,
                             2);
                x += pw;
                a0[2] = a0[1], a1[2] = a1[1];
                dw512_k3_row(acc, a0, a1, R, _mm512_loadu_ps(x), _mm512_loadu_ps(x + 1), _mm512_loadu_ps(x + 2), 2,
                             2);
            } else { /* H = 1: rho = 2 meets row 0 at kh 2 */
                a0[2] = a0[1], a1[2] = a1[1];
                dw512_k3_row(acc, a0, a1, R, _mm512_loadu_ps(x), _mm512_loadu_ps(x + 1), _mm512_loadu_ps(x + 2), 2,
                             2);
            }
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 9
        for (int k = 0; k < 9; k++) {
            float *o = dw + (size_t)(oc + r) * p->C * 9 + (size_t)c * 9 + k;
            const float s = hsum512(acc[r][k]);
            *o = add ? *o + s : s;
        }
}

T512 void conv_taps_dw_avx512(const ConvTaps *p, float *dw, const float *dp, size_t ldp, size_t ldi, const float *xp,
                              int n, bool add) {
    const int KK = p->KH * p->KW;
    const bool k3 = p->KH == 3 && p->KW == 3;
    if (k3) { /* two output rows a block, x's rows read once (dw512_k3_block) */
        for (int oc = 0; oc < p->OC; oc += 2)
            for (int c = 0; c < p->C; c++) {
                if (p->OC - oc >= 2) dw512_k3_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 2, c);
                else dw512_k3_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 1, c);
            }
        return;
    }
    for (int oc = 0; oc < p->OC; oc += 3)
        for (int c = 0; c < p->C; c++)
            for (int t0 = 0; t0 < KK; t0 += 9) {
                const int tb = KK - t0 < 9 ? KK - t0 : 9, R = p->OC - oc < 3 ? p->OC - oc : 3;
                if (R == 3 && k3) dw512_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 3, c, 0, 9, true);
                else if (R == 3) dw512_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 3, c, t0, tb, false);
                else if (R == 2) dw512_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 2, c, t0, tb, false);
                else dw512_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 1, c, t0, tb, false);
            }
}

/* ---- AVX2 ------------------------------------------------------------------------------------------------------ */

T256 INLINE __m256i mask8(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* conv_taps_pad for either width (a padded row is whole vectors of 16 or 8): vector j of a row starts at source
 * column 8 j - kw0; its lanes inside [0, W) are loaded, the others are 0. vmaskmovps reads only the lanes its
 * mask selects, so neither the address before the row nor past it faults; the address goes through uintptr_t, as
 * a pointer before the source array would be undefined in C. */
T256 void conv_taps_pad_avx2(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img,
                             size_t ld) {
    const int kh0 = (p->KH - 1) / 2, kw0 = (p->KW - 1) / 2, nv = p->pw / 8, rows = p->H + p->KH - 1;
    for (int i = 0; i < n; i++)
        for (int c = 0; c < channels; c++) {
            const float *s = src + (size_t)i * img + (size_t)c * ld;
            float *d = dst + ((size_t)i * channels + c) * p->pplane;
            for (int r = 0; r < rows; r++, d += p->pw) {
                const int h = r - kh0;
                if (h < 0 || h >= p->H) {
                    for (int j = 0; j < nv; j++) _mm256_storeu_ps(d + 8 * j, _mm256_setzero_ps());
                    continue;
                }
                const uintptr_t row = (uintptr_t)(s + (size_t)h * p->W) - (uintptr_t)kw0 * sizeof(float);
                for (int j = 0; j < nv; j++) {
                    const int lo = 8 * j - kw0; /* lanes l with 0 <= lo + l < W: below W - lo, not below -lo */
                    const __m256i m = _mm256_andnot_si256(mask8(-lo), mask8(p->W - lo));
                    _mm256_storeu_ps(d + 8 * j, _mm256_maskload_ps((const float *)(row + 32 * (uintptr_t)j), m));
                }
            }
        }
    memset(dst + (size_t)n * channels * p->pplane, 0, (size_t)p->lanes * sizeof *dst);
}

T256 INLINE void fwd256_tile(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wb, int rows,
                             int channels, int v0, const int V, bool add) {
    __m256 acc[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int i = 0; i < 3; i++) acc[r][i] = _mm256_setzero_ps();
    const int KK = p->KH * p->KW;
    const float *x0 = xp + p->grid[v0], *x1 = xp + p->grid[V > 1 ? v0 + 1 : v0];
    const float *x2 = xp + p->grid[V > 2 ? v0 + 2 : v0];
    for (int c = 0; c < channels; c++, x0 += p->pplane, x1 += p->pplane, x2 += p->pplane)
        for (int t = 0; t < KK; t++, wb += 4) {
            const int o = p->off[t];
            const __m256 b0 = _mm256_loadu_ps(x0 + o);
            const __m256 b1 = V > 1 ? _mm256_loadu_ps(x1 + o) : b0, b2 = V > 2 ? _mm256_loadu_ps(x2 + o) : b0;
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const __m256 a = _mm256_broadcast_ss(wb + r);
                acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
                if (V > 1) acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
                if (V > 2) acc[r][2] = _mm256_fmadd_ps(a, b2, acc[r][2]);
            }
        }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        if (r >= rows) break;
#pragma GCC unroll 3
        for (int i = 0; i < V; i++) {
            const __m256i m = mask8(p->n[v0 + i]);
            float *o = y + (size_t)r * ldy + p->out[v0 + i];
            const __m256 v = add ? _mm256_add_ps(_mm256_maskload_ps(o, m), acc[r][i]) : acc[r][i];
            _mm256_maskstore_ps(o, m, v);
        }
    }
}

T256 void conv_taps_forward_avx2(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wp,
                                 int rows, int channels, bool add) {
    const int KK = p->KH * p->KW, nv = p->H * p->vpr;
    for (int b = 0; b * 4 < rows; b++) {
        const float *wb = wp + (size_t)b * channels * KK * 4;
        const int rb = rows - b * 4 < 4 ? rows - b * 4 : 4;
        float *yb = y + (size_t)b * 4 * ldy;
        int v = 0;
        for (; v + 3 <= nv; v += 3) fwd256_tile(p, yb, ldy, xp, wb, rb, channels, v, 3, add);
        if (nv - v == 2) fwd256_tile(p, yb, ldy, xp, wb, rb, channels, v, 2, add);
        else if (nv - v == 1) fwd256_tile(p, yb, ldy, xp, wb, rb, channels, v, 1, add);
    }
}

T256 INLINE float hsum256(__m256 v) {
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* Output rows oc .. oc + R - 1 (R <= 3), channel c, taps t0 .. t0 + tb - 1 (tb <= 3), as dw512_block: 16
 * registers hold 3 x 3 sums, 3 rows of dp and one of x; k3: t0 a kernel row of the 3x3 kernel, its columns as
 * constant shifts. */
T256 INLINE void dw256_block(const ConvTaps *p, float *dw, const float *dp, size_t ldp, size_t ldi, const float *xp,
                             int n, bool add, int oc, const int R, int c, int t0, int tb, const bool k3) {
    __m256 acc[3][3];
#pragma GCC unroll 3
    for (int r = 0; r < 3; r++)
#pragma GCC unroll 3
        for (int k = 0; k < 3; k++) acc[r][k] = _mm256_setzero_ps();
    int off[3];
    for (int k = 0; k < 3; k++) off[k] = p->off[k < tb ? t0 + k : t0];
    const size_t pw = (size_t)p->pw;
    for (int j = 0; j < p->vpr; j++) {
        const int col = j * 8;
        const __m256i m = mask8(p->W - col < 8 ? p->W - col : 8);
        const bool whole = p->W - col >= 8; /* vmaskmovps costs more than a load */
        for (int i = 0; i < n; i++) {
            const float *d0 = dp + (size_t)oc * ldp + (size_t)i * ldi + col;
            const float *x = xp + ((size_t)i * p->C + c) * p->pplane + col + (k3 ? off[0] : 0);
            for (int h = 0; h < p->H; h++, d0 += p->W, x += pw) {
                __m256 a[3];
#pragma GCC unroll 3
                for (int r = 0; r < R; r++)
                    a[r] = whole ? _mm256_loadu_ps(d0 + (size_t)r * ldp) : _mm256_maskload_ps(d0 + (size_t)r * ldp, m);
#pragma GCC unroll 3
                for (int k = 0; k < 3; k++) {
                    __m256 b = _mm256_loadu_ps(k3 ? x + k : x + off[k]);
                    __asm__("" : "+x"(b)); /* one load for every row: gcc would fold it into each FMA */
#pragma GCC unroll 3
                    for (int r = 0; r < R; r++) acc[r][k] = _mm256_fmadd_ps(a[r], b, acc[r][k]);
                }
            }
        }
    }
    const int KK = p->KH * p->KW;
#pragma GCC unroll 3
    for (int r = 0; r < R; r++) /* constant indices: acc stays in registers */
#pragma GCC unroll 3
        for (int k = 0; k < 3; k++) {
            if (k >= tb) break;
            float *o = dw + (size_t)(oc + r) * p->C * KK + (size_t)c * KK + t0 + k;
            const float s = hsum256(acc[r][k]);
            *o = add ? *o + s : s;
        }
}

T256 void conv_taps_dw_avx2(const ConvTaps *p, float *dw, const float *dp, size_t ldp, size_t ldi, const float *xp,
                            int n, bool add) {
    const int KK = p->KH * p->KW;
    const bool k3 = p->KH == 3 && p->KW == 3;
    for (int oc = 0; oc < p->OC; oc += 3)
        for (int c = 0; c < p->C; c++)
            for (int t0 = 0; t0 < KK; t0 += 3) {
                const int tb = KK - t0 < 3 ? KK - t0 : 3, R = p->OC - oc < 3 ? p->OC - oc : 3;
                if (R == 3 && k3) dw256_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 3, c, t0, 3, true);
                else if (R == 3) dw256_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 3, c, t0, tb, false);
                else if (R == 2) dw256_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 2, c, t0, tb, false);
                else dw256_block(p, dw, dp, ldp, ldi, xp, n, add, oc, 1, c, t0, tb, false);
            }
}

#else /* no x86 kernels: conv_taps_cpu reports CONV_TAPS_OFF, so these are never called */

void conv_taps_forward_avx512(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wp, int rows,
                              int channels, bool add) {
    conv_taps_forward_ref(p, 16, y, ldy, xp, wp, rows, channels, add);
}
void conv_taps_forward_avx2(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wp, int rows,
                            int channels, bool add) {
    conv_taps_forward_ref(p, 8, y, ldy, xp, wp, rows, channels, add);
}
void conv_taps_dw_avx512(const ConvTaps *p, float *dw, const float *dp, size_t ldp, size_t ldi, const float *xp, int n,
                         bool add) {
    conv_taps_dw_ref(p, 16, dw, dp, ldp, ldi, xp, n, add);
}
void conv_taps_dw_avx2(const ConvTaps *p, float *dw, const float *dp, size_t ldp, size_t ldi, const float *xp, int n,
                       bool add) {
    conv_taps_dw_ref(p, 8, dw, dp, ldp, ldi, xp, n, add);
}
void conv_taps_pad_avx2(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img, size_t ld) {
    conv_taps_pad_ref(p, dst, src, channels, n, img, ld);
}

#endif
