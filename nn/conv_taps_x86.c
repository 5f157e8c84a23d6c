/* conv_taps_x86.c - the taps convolution's forward kernels (conv_taps.h): AVX-512F at 16 lanes, AVX2 + FMA at 8.
 * Each output lane is the chain conv_taps_forward_ref defines, so every kernel gives its bits.
 *
 * Forward: a block of rb output rows by 3 vectors of columns (24 sums at 16 lanes, 12 at 8) in registers; per
 * channel and tap, 3 loads of the shifted plane and rb broadcast weights. Padding (both widths, AVX2): each padded
 * row as whole vectors, its source columns through masked loads. The weight gradient's kernels are in
 * conv_taps_dw_x86.c. */
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
            const __m512 v = _mm512_add_ps(add ? _mm512_maskz_loadu_ps(m, o) : _mm512_setzero_ps(), acc[r][i]);
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
    /* added to, the tile's outputs (8 planes apart) are read at its end: their lines asked for now, while the
     * products run (an input gradient added into memory a whole layer wrote stalled each tile's end) */
    if (add)
        for (int r = 0; r < 8 && r < rows; r++)
            for (int i = 0; i < V; i++) __builtin_prefetch(y + (size_t)r * ldy + (size_t)(v0 + i) * 16, 1, 3);
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
            const __m512 v = _mm512_add_ps(add ? _mm512_maskz_loadu_ps(m, o) : _mm512_setzero_ps(), acc[r][i]);
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
            const __m256 v = _mm256_add_ps(add ? _mm256_maskload_ps(o, m) : _mm256_setzero_ps(), acc[r][i]);
            _mm256_maskstore_ps(o, m, v);
        }
    }
}

/* The flat layout's tile at 8 lanes (conv_taps.h): rows [0, rows) of one block by flat vectors v0 .. v0 + V - 1 of
 * a 3x3 kernel; taps of column 0 and 2 read the plane's copies whose column W - 1 or 0 is zero, so their lanes
 * that cross a row's edge load the padding's zero without a mask. */
T256 INLINE void fwd256_flat_tile(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wb,
                                  int rows, int channels, int v0, const int V, bool add) {
    __m256 acc[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int i = 0; i < 3; i++) acc[r][i] = _mm256_setzero_ps();
    const size_t W = (size_t)p->W, copy[3] = {p->vplane, 0, 2 * p->vplane}; /* tap column kw's copy */
    const float *x = xp + (size_t)v0 * 8;
    if (add) /* as the 16-lane tile: the outputs' lines asked for while the products run */
        for (int r = 0; r < 4 && r < rows; r++)
            for (int i = 0; i < V; i++) __builtin_prefetch(y + (size_t)r * ldy + (size_t)(v0 + i) * 8, 1, 3);
    for (int c = 0; c < channels; c++, x += p->fplane)
#pragma GCC unroll 3
        for (int kh = 0; kh < 3; kh++)
#pragma GCC unroll 3
            for (int kw = 0; kw < 3; kw++, wb += 4) {
                const float *xt = x + copy[kw] + kh * W + kw;
                const __m256 b0 = _mm256_loadu_ps(xt);
                const __m256 b1 = V > 1 ? _mm256_loadu_ps(xt + 8) : b0, b2 = V > 2 ? _mm256_loadu_ps(xt + 16) : b0;
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    const __m256 a = _mm256_broadcast_ss(wb + r);
                    acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
                    if (V > 1) acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
                    if (V > 2) acc[r][2] = _mm256_fmadd_ps(a, b2, acc[r][2]);
                }
            }
    const int hw = p->H * p->W;
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        if (r >= rows) break;
#pragma GCC unroll 3
        for (int i = 0; i < V; i++) {
            const int q = (v0 + i) * 8;
            float *o = y + (size_t)r * ldy + q;
            if (hw - q >= 8) {
                _mm256_storeu_ps(o, _mm256_add_ps(add ? _mm256_loadu_ps(o) : _mm256_setzero_ps(), acc[r][i]));
            } else { /* the plane's last vector: its lanes inside the plane */
                const __m256i m = mask8(hw - q);
                const __m256 in = add ? _mm256_maskload_ps(o, m) : _mm256_setzero_ps();
                _mm256_maskstore_ps(o, m, _mm256_add_ps(in, acc[r][i]));
            }
        }
    }
}

/* One tile in the plan's layout. */
T256 INLINE void fwd256_any_tile(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wb, int rows,
                                 int channels, int v0, const int V, bool add) {
    if (p->flat) fwd256_flat_tile(p, y, ldy, xp, wb, rows, channels, v0, V, add);
    else fwd256_tile(p, y, ldy, xp, wb, rows, channels, v0, V, add);
}

T256 void conv_taps_forward_avx2(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wp,
                                 int rows, int channels, bool add) {
    const int KK = p->KH * p->KW, nv = p->flat ? p->nvf : p->H * p->vpr;
    for (int b = 0; b * 4 < rows; b++) {
        const float *wb = wp + (size_t)b * channels * KK * 4;
        const int rb = rows - b * 4 < 4 ? rows - b * 4 : 4;
        float *yb = y + (size_t)b * 4 * ldy;
        int v = 0;
        for (; v + 3 <= nv; v += 3) fwd256_any_tile(p, yb, ldy, xp, wb, rb, channels, v, 3, add);
        if (nv - v == 2) fwd256_any_tile(p, yb, ldy, xp, wb, rb, channels, v, 2, add);
        else if (nv - v == 1) fwd256_any_tile(p, yb, ldy, xp, wb, rb, channels, v, 1, add);
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
void conv_taps_pad_avx2(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img, size_t ld) {
    conv_taps_pad_ref(p, dst, src, channels, n, img, ld);
}

#endif
