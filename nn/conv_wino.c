/* conv_wino.c - F(2x2, 3x3) (conv_wino.h): which convolutions take it, the weight transform, the definition
 * (conv_wino_forward_ref) and the dispatch to the vector kernels (conv_wino_x86.c). */
#include "conv_wino.h"

#include <math.h>
#include <string.h>

bool conv_wino_enabled = true;

QtStatus conv_wino_select(const char *value, const char *what, QtError *err) {
    if (!value || !*value || !strcmp(value, "auto") || !strcmp(value, "on")) conv_wino_enabled = true;
    else if (!strcmp(value, "off")) conv_wino_enabled = false;
    else
        return qt_error_set(err, QT_ERR_CONFIG, "%s: unknown value '%s'; expected on, off or auto (on)", what, value);
    return QT_OK;
}

bool conv_wino_fits(ConvTapsLevel level, int KH, int KW, int stride, int padding, int channels, int rows) {
    return conv_wino_enabled && level != CONV_TAPS_OFF && KH == 3 && KW == 3 && stride == 1 && padding == 1 &&
           channels >= 8 && rows >= 8;
}

void conv_wino_plan(ConvWino *p, ConvTapsLevel level, int H, int W) {
    const int lanes = conv_taps_lanes(level);
    *p = (ConvWino){.H = H, .W = W, .TH = (H + 1) / 2, .TW = (W + 1) / 2, .lanes = lanes,
                    .rb = lanes == 16 ? 8 : 4};
    p->T = p->TH * p->TW;
    p->tv = (p->T + lanes - 1) / lanes;
    p->ldv = (size_t)(p->tv + 1) * lanes;
    p->ew = (p->TW + 1 + lanes - 1) / lanes * lanes + lanes;
    p->splane = (size_t)(2 * p->TH + 2) * 2 * p->ew;
    p->ldm = conv_wino_stride((size_t)p->rb * p->ldv);
}

size_t conv_wino_stride(size_t n) { return (n + 1023) / 1024 * 1024 + 80; }

size_t conv_wino_packed_floats(const ConvWino *p, int rows, int channels) {
    return 16 * (size_t)((rows + p->rb - 1) / p->rb) * p->rb * channels;
}

size_t conv_wino_scratch_floats(const ConvWino *p, int channels) {
    return (size_t)channels * p->splane + 16 * conv_wino_stride((size_t)channels * p->ldv) + 16 * p->ldm;
}

/* u (16) = G g G^T of one 3x3 kernel g (row-major); the order conv_wino.h gives. */
static void wino_weight(float u[16], const float g[9]) {
    float t[4][3];
    for (int k = 0; k < 3; k++) {
        t[0][k] = g[k];
        t[1][k] = ((g[k] + g[3 + k]) + g[6 + k]) * 0.5f;
        t[2][k] = ((g[k] - g[3 + k]) + g[6 + k]) * 0.5f;
        t[3][k] = g[6 + k];
    }
    for (int a = 0; a < 4; a++) {
        u[4 * a + 0] = t[a][0];
        u[4 * a + 1] = ((t[a][0] + t[a][1]) + t[a][2]) * 0.5f;
        u[4 * a + 2] = ((t[a][0] - t[a][1]) + t[a][2]) * 0.5f;
        u[4 * a + 3] = t[a][2];
    }
}

/* Puts kernel (r, c)'s transform u into dst's layout [16][rows / rb][channels][rb]. */
static void wino_put(const ConvWino *p, float *dst, int rows, int channels, int r, int c, const float u[16]) {
    const size_t blocks = (size_t)(rows + p->rb - 1) / p->rb, per_p = blocks * channels * p->rb;
    for (int q = 0; q < 16; q++)
        dst[q * per_p + ((size_t)(r / p->rb) * channels + c) * p->rb + r % p->rb] = u[q];
}

void conv_wino_pack(const ConvWino *p, float *dst, const float *w, int ldw, int rows, int channels) {
    memset(dst, 0, conv_wino_packed_floats(p, rows, channels) * sizeof *dst);
    float u[16];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < channels; c++) {
            wino_weight(u, w + (size_t)r * ldw + (size_t)c * 9);
            wino_put(p, dst, rows, channels, r, c, u);
        }
}

void conv_wino_pack_t(const ConvWino *p, float *dst, const float *w, int ldw, int C, int OC) {
    memset(dst, 0, conv_wino_packed_floats(p, C, OC) * sizeof *dst);
    float u[16], g[9];
    for (int c = 0; c < C; c++)
        for (int oc = 0; oc < OC; oc++) {
            const float *k = w + (size_t)oc * ldw + (size_t)c * 9;
            for (int t = 0; t < 9; t++) g[t] = k[8 - t];
            wino_weight(u, g);
            wino_put(p, dst, C, OC, c, oc, u);
        }
}

/* x(h, w) of one plane, 0 outside it. */
static float wino_x(const ConvWino *p, const float *x, int h, int w) {
    return h < 0 || w < 0 || h >= p->H || w >= p->W ? 0.0f : x[(size_t)h * p->W + w];
}

/* v (16) = the input transform of tile (i, j) of plane x. */
static void wino_input(const ConvWino *p, float v[16], const float *x, int i, int j) {
    float h[4][4];
    for (int a = 0; a < 4; a++) {
        float d[4];
        for (int b = 0; b < 4; b++) d[b] = wino_x(p, x, 2 * i - 1 + a, 2 * j - 1 + b);
        h[a][0] = d[0] - d[2], h[a][1] = d[1] + d[2], h[a][2] = d[2] - d[1], h[a][3] = d[1] - d[3];
    }
    for (int b = 0; b < 4; b++) {
        v[0 + b] = h[0][b] - h[2][b], v[4 + b] = h[1][b] + h[2][b];
        v[8 + b] = h[2][b] - h[1][b], v[12 + b] = h[1][b] - h[3][b];
    }
}

/* o (2 x 2) = the output transform of m (16). */
static void wino_output(float o[4], const float m[16]) {
    float s[2][4];
    for (int b = 0; b < 4; b++) {
        s[0][b] = (m[b] + m[4 + b]) + m[8 + b];
        s[1][b] = (m[4 + b] - m[8 + b]) - m[12 + b];
    }
    for (int a = 0; a < 2; a++) {
        o[2 * a + 0] = (s[a][0] + s[a][1]) + s[a][2];
        o[2 * a + 1] = (s[a][1] - s[a][2]) - s[a][3];
    }
}

void conv_wino_forward_ref(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                           int rows, int channels, bool add) {
    const size_t per_p = (size_t)(rows + p->rb - 1) / p->rb * channels * p->rb;
    for (int i = 0; i < p->TH; i++)
        for (int j = 0; j < p->TW; j++)
            for (int r = 0; r < rows; r++) {
                float m[16] = {0}, v[16], o[4];
                const float *wr = wp + (size_t)(r / p->rb) * channels * p->rb + r % p->rb;
                for (int c = 0; c < channels; c++) {
                    wino_input(p, v, x + (size_t)c * ldx, i, j);
                    for (int q = 0; q < 16; q++) m[q] = fmaf(wr[q * per_p + (size_t)c * p->rb], v[q], m[q]);
                }
                wino_output(o, m);
                for (int a = 0; a < 2; a++)
                    for (int b = 0; b < 2; b++) {
                        const int h = 2 * i + a, w = 2 * j + b;
                        if (h >= p->H || w >= p->W) continue;
                        float *dst = y + (size_t)r * ldy + (size_t)h * p->W + w;
                        *dst = (add ? *dst : 0.0f) + o[2 * a + b];
                    }
            }
}

size_t conv_wino_dw_scratch_floats(const ConvWino *p, int C, int OC) {
    const size_t ldd = conv_taps_oc_pad(OC);
    return (size_t)C * p->splane + 16 * conv_wino_stride((size_t)C * p->ldv) +
           16 * conv_wino_stride((size_t)p->T * ldd) + 16 * (size_t)C * ldd;
}

bool conv_wino_dw_pays(const ConvWino *p, int C, int OC) {
    return p->lanes == 8 || (p->T >= 32 && (long)C * OC >= 1024);
}

/* dm (16) = the output gradient's transform of tile (i, j) of one channel (its gradients dpt[q ldd]). */
static void wino_grad(const ConvWino *p, float dm[16], const float *dpt, size_t ldd, int i, int j) {
    float d[2][2], r[4][2];
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) {
            const int h = 2 * i + a, w = 2 * j + b;
            d[a][b] = h < p->H && w < p->W ? dpt[((size_t)h * p->W + w) * ldd] : 0.0f;
        }
    for (int b = 0; b < 2; b++)
        r[0][b] = d[0][b], r[1][b] = d[0][b] + d[1][b], r[2][b] = d[0][b] - d[1][b], r[3][b] = -d[1][b];
    for (int a = 0; a < 4; a++) {
        dm[4 * a + 0] = r[a][0], dm[4 * a + 1] = r[a][0] + r[a][1];
        dm[4 * a + 2] = r[a][0] - r[a][1], dm[4 * a + 3] = -r[a][1];
    }
}

/* g (9) = G^T du G of du (16). */
static void wino_weight_grad(float g[9], const float du[16]) {
    float e[3][4];
    for (int b = 0; b < 4; b++) {
        const float h = (du[4 + b] + du[8 + b]) * 0.5f;
        e[0][b] = du[b] + h, e[1][b] = (du[4 + b] - du[8 + b]) * 0.5f, e[2][b] = h + du[12 + b];
    }
    for (int k = 0; k < 3; k++) {
        const float h = (e[k][1] + e[k][2]) * 0.5f;
        g[3 * k + 0] = e[k][0] + h, g[3 * k + 1] = (e[k][1] - e[k][2]) * 0.5f, g[3 * k + 2] = h + e[k][3];
    }
}

void conv_wino_dw_ref(const ConvWino *p, float *dwt, const float *dpt, const float *x, size_t ldx, int C, int OC,
                      bool add) {
    const size_t ldd = conv_taps_oc_pad(OC);
    for (int c = 0; c < C; c++)
        for (size_t oc = 0; oc < ldd; oc++) {
            float du[16] = {0}, v[16], dm[16], g[9];
            for (int i = 0; i < p->TH; i++)
                for (int j = 0; j < p->TW; j++) {
                    wino_input(p, v, x + (size_t)c * ldx, i, j);
                    wino_grad(p, dm, dpt + oc, ldd, i, j);
                    for (int q = 0; q < 16; q++) du[q] = fmaf(v[q], dm[q], du[q]);
                }
            wino_weight_grad(g, du);
            for (int k = 0; k < 9; k++) {
                float *o = dwt + ((size_t)c * 9 + k) * ldd + oc;
                *o = add ? *o + g[k] : g[k];
            }
        }
}

void conv_wino_dw(const ConvWino *p, ConvTapsLevel level, float *dwt, const float *dpt, const float *x, size_t ldx,
                  int C, int OC, bool add, float *scratch) {
    if (level == CONV_TAPS_AVX512) conv_wino_dw_avx512(p, dwt, dpt, x, ldx, C, OC, add, scratch);
    else if (level == CONV_TAPS_AVX2) conv_wino_dw_avx2(p, dwt, dpt, x, ldx, C, OC, add, scratch);
    else conv_wino_dw_ref(p, dwt, dpt, x, ldx, C, OC, add);
}

void conv_wino_forward(const ConvWino *p, ConvTapsLevel level, float *y, size_t ldy, const float *x, size_t ldx,
                       const float *wp, int rows, int channels, bool add, float *scratch) {
    if (level == CONV_TAPS_AVX512) conv_wino_forward_avx512(p, y, ldy, x, ldx, wp, rows, channels, add, scratch);
    else if (level == CONV_TAPS_AVX2) conv_wino_forward_avx2(p, y, ldy, x, ldx, wp, rows, channels, add, scratch);
    else conv_wino_forward_ref(p, y, ldy, x, ldx, wp, rows, channels, add);
}

void conv_wino_forward_again(const ConvWino *p, ConvTapsLevel level, float *y, size_t ldy, const float *x,
                             size_t ldx, const float *wp, int rows, int channels, bool add, float *scratch) {
    if (level == CONV_TAPS_AVX512) conv_wino_products_avx512(p, y, ldy, wp, rows, channels, add, scratch);
    else if (level == CONV_TAPS_AVX2) conv_wino_products_avx2(p, y, ldy, wp, rows, channels, add, scratch);
    else conv_wino_forward_ref(p, y, ldy, x, ldx, wp, rows, channels, add);
}
