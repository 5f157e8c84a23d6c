/* pool2x2.h - the max of one 2x2 window, for nn/ only (ops_pool.c and the
 * fused epilogue of ops_conv.c): both must pick the same winner.
 *
 * No data-dependent branch: on ReLU outputs a compare goes either way about
 * half the time, and mispredictions made pooling the slowest op of the CNN.
 * The max is a chain of `v > m ? v : m` (one maxss each) and the winner's
 * index in 0..3 (a, b, c, d = row-major window order) is integer arithmetic
 * on the comparison results. Ties go to the first; the first NaN wins, as in
 * the generic pooling loops. */
#ifndef QTRAIN_NN_POOL2X2_H
#define QTRAIN_NN_POOL2X2_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline float pool2x2_window(float a, float b, float c, float d, int *winner) {
    if ((a != a) | (b != b) | (c != c) | (d != d)) {
        *winner = a != a ? 0 : b != b ? 1 : c != c ? 2 : 3; /* rare */
        return NAN;
    }
    int t = b > a;
    float m = b > a ? b : a;
    int k = t;
    t = c > m;
    m = c > m ? c : m;
    k += t * (2 - k);
    t = d > m;
    m = d > m ? d : m;
    k += t * (3 - k);
    *winner = k;
    return m;
}

/* ---- the fused conv epilogue's rows -------------------------------------- */

/* After the relu (v > 0 ? v : 0, which also maps NaN to 0) a window holds no
 * NaN, so pool2x2_window's NaN path never runs here and four windows at a
 * time can take the same compare-and-select chain in SSE2 lanes. A row of PW
 * windows runs in groups of four at 0, 4, ...; the last group is moved back
 * to end at PW, overlapping the one before: it recomputes and rewrites the
 * same values, which is cheaper than a scalar tail. */
#if defined(__SSE2__)
static inline __m128 pool2x2_select(__m128 mask, __m128 a, __m128 b) {
    return _mm_or_ps(_mm_and_ps(mask, a), _mm_andnot_ps(mask, b));
}

/* Windows pw .. pw+3 of one row pair: r0, r1 point at column 2*pw. */
static inline void pool2x2_relu_group4(float *dst, uint8_t *win, const float *r0, const float *r1, __m128 bias) {
    const __m128 zero = _mm_setzero_ps();
    const __m128 lo0 = _mm_loadu_ps(r0), hi0 = _mm_loadu_ps(r0 + 4);
    const __m128 lo1 = _mm_loadu_ps(r1), hi1 = _mm_loadu_ps(r1 + 4);
    __m128 a = _mm_add_ps(_mm_shuffle_ps(lo0, hi0, _MM_SHUFFLE(2, 0, 2, 0)), bias);
    __m128 b = _mm_add_ps(_mm_shuffle_ps(lo0, hi0, _MM_SHUFFLE(3, 1, 3, 1)), bias);
    __m128 c = _mm_add_ps(_mm_shuffle_ps(lo1, hi1, _MM_SHUFFLE(2, 0, 2, 0)), bias);
    __m128 d = _mm_add_ps(_mm_shuffle_ps(lo1, hi1, _MM_SHUFFLE(3, 1, 3, 1)), bias);
    a = _mm_and_ps(_mm_cmpgt_ps(a, zero), a);
    b = _mm_and_ps(_mm_cmpgt_ps(b, zero), b);
    c = _mm_and_ps(_mm_cmpgt_ps(c, zero), c);
    d = _mm_and_ps(_mm_cmpgt_ps(d, zero), d);
    __m128 t = _mm_cmpgt_ps(b, a), m = pool2x2_select(t, b, a);
    __m128 k = _mm_and_ps(t, _mm_castsi128_ps(_mm_set1_epi32(1)));
    t = _mm_cmpgt_ps(c, m), m = pool2x2_select(t, c, m);
    k = pool2x2_select(t, _mm_castsi128_ps(_mm_set1_epi32(2)), k);
    t = _mm_cmpgt_ps(d, m), m = pool2x2_select(t, d, m);
    k = pool2x2_select(t, _mm_castsi128_ps(_mm_set1_epi32(3)), k);
    _mm_storeu_ps(dst, m);
    const __m128i k16 = _mm_packs_epi32(_mm_castps_si128(k), _mm_castps_si128(k));
    const int32_t k8 = _mm_cvtsi128_si32(_mm_packus_epi16(k16, k16));
    memcpy(win, &k8, sizeof k8);
}
#endif

/* dst [PW] and win [PW] (winner 0..3) of the row pair r0, r1 [2*PW] after
 * adding bias and the relu; the same values and winners as relu then
 * pool2x2_window. */
static inline void pool2x2_relu_row(float *dst, uint8_t *win, const float *r0, const float *r1, float bias, int PW) {
    int pw = 0;
#if defined(__SSE2__)
    if (PW >= 4) {
        const __m128 b = _mm_set1_ps(bias);
        for (; pw + 4 <= PW; pw += 4) pool2x2_relu_group4(dst + pw, win + pw, r0 + 2 * pw, r1 + 2 * pw, b);
        if (pw < PW) pool2x2_relu_group4(dst + PW - 4, win + PW - 4, r0 + 2 * (PW - 4), r1 + 2 * (PW - 4), b);
        return;
    }
#endif
    for (; pw < PW; pw++) {
        float v[4] = {r0[2 * pw] + bias, r0[2 * pw + 1] + bias, r1[2 * pw] + bias, r1[2 * pw + 1] + bias};
        for (int i = 0; i < 4; i++) v[i] = v[i] > 0.0f ? v[i] : 0.0f;
        int k;
        dst[pw] = pool2x2_window(v[0], v[1], v[2], v[3], &k);
        win[pw] = (uint8_t)k;
    }
}

/* The backward of pool2x2_relu_row: q0, q1 [2*PW] (the row pair's gradient
 * before the relu) from the pooled gradient g [PW], the pooled output y [PW]
 * and the winners win [PW]. Only a window's winner gets its g, and only if
 * the relu let it through (y > 0); every other entry is written 0. */
#if defined(__SSE2__)
static inline void pool2x2_relu_grad_group4(float *q0, float *q1, const float *g, const float *y,
                                            const uint8_t *win) {
    const __m128 v = _mm_and_ps(_mm_cmpgt_ps(_mm_loadu_ps(y), _mm_setzero_ps()), _mm_loadu_ps(g));
    int32_t w4;
    memcpy(&w4, win, sizeof w4);
    const __m128i zero = _mm_setzero_si128();
    const __m128i k = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(w4), zero), zero);
    const __m128 o0 = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(k, _mm_set1_epi32(0))), v);
    const __m128 o1 = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(k, _mm_set1_epi32(1))), v);
    const __m128 o2 = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(k, _mm_set1_epi32(2))), v);
    const __m128 o3 = _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(k, _mm_set1_epi32(3))), v);
    _mm_storeu_ps(q0, _mm_unpacklo_ps(o0, o1));
    _mm_storeu_ps(q0 + 4, _mm_unpackhi_ps(o0, o1));
    _mm_storeu_ps(q1, _mm_unpacklo_ps(o2, o3));
    _mm_storeu_ps(q1 + 4, _mm_unpackhi_ps(o2, o3));
}
#endif

static inline void pool2x2_relu_row_grad(float *q0, float *q1, const float *g, const float *y, const uint8_t *win,
                                         int PW) {
    int pw = 0;
#if defined(__SSE2__)
    if (PW >= 4) {
        for (; pw + 4 <= PW; pw += 4) pool2x2_relu_grad_group4(q0 + 2 * pw, q1 + 2 * pw, g + pw, y + pw, win + pw);
        if (pw < PW)
            pool2x2_relu_grad_group4(q0 + 2 * (PW - 4), q1 + 2 * (PW - 4), g + PW - 4, y + PW - 4, win + PW - 4);
        return;
    }
#endif
    for (; pw < PW; pw++) {
        const float v = y[pw] > 0.0f ? g[pw] : 0.0f;
        const int k = win[pw];
        q0[2 * pw] = k == 0 ? v : 0.0f;
        q0[2 * pw + 1] = k == 1 ? v : 0.0f;
        q1[2 * pw] = k == 2 ? v : 0.0f;
        q1[2 * pw + 1] = k == 3 ? v : 0.0f;
    }
}

/* ---- whole planes ----------------------------------------------------------------------------------------------- */

/* pre (OH, OW) -> y and win (OH / 2, OW / 2): every row pair through pool2x2_relu_row (a last odd row or column
 * belongs to no window). The plain twin of the vector kernels below. */
static inline void pool2x2_relu_plane(float *y, uint8_t *win, const float *pre, float bias, int OH, int OW) {
    const int PH = OH / 2, PW = OW / 2;
    for (int ph = 0; ph < PH; ph++) {
        const float *r0 = pre + (size_t)(2 * ph) * OW;
        pool2x2_relu_row(y + (size_t)ph * PW, win + (size_t)ph * PW, r0, r0 + OW, bias, PW);
    }
}

/* The backward of pool2x2_relu_plane: rows 0 .. 2 (OH / 2) - 1, columns 0 .. 2 (OW / 2) - 1 of dpre (OH, OW) from
 * dy, y and win (OH / 2, OW / 2); a last odd row or column is the caller's. */
static inline void pool2x2_relu_grad_plane(float *dpre, const float *dy, const float *y, const uint8_t *win, int OH,
                                           int OW) {
    const int PH = OH / 2, PW = OW / 2;
    for (int ph = 0; ph < PH; ph++) {
        float *q0 = dpre + (size_t)(2 * ph) * OW;
        pool2x2_relu_row_grad(q0, q0 + OW, dy + (size_t)ph * PW, y + (size_t)ph * PW, win + (size_t)ph * PW, PW);
    }
}

/* The same 8 windows at a time in AVX2 (nn/pool2x2_x86.c), for rows of at least 8 windows (OW >= 16), or of 4 to 7
 * windows over an even OW and at least two row pairs (pool2x2_avx2_fits): the same values and winners. Call them
 * only on a CPU with AVX2 (conv_taps_level() AVX2 or AVX-512). */
#define POOL2X2_AVX2_MIN_OW 16
static inline bool pool2x2_avx2_fits(int OH, int OW) {
    return OW >= POOL2X2_AVX2_MIN_OW || (OW >= 8 && OW % 2 == 0 && OH >= 4);
}
void pool2x2_relu_plane_avx2(float *y, uint8_t *win, const float *pre, float bias, int OH, int OW);
void pool2x2_relu_grad_plane_avx2(float *dpre, const float *dy, const float *y, const uint8_t *win, int OH, int OW);

#endif
