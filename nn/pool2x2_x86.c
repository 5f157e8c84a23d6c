/* pool2x2_x86.c - the fused conv epilogue's bias + relu + 2x2 max pool over a plane's row pairs, and its backward
 * (pool2x2.h), 8 windows at a time in AVX2. nn_conv_epilogue_plane and nn_conv_epilogue_grad_plane run them where
 * conv_taps_level() is AVX2 or AVX-512 and pool2x2_avx2_fits (rows of at least 8 windows, or of 4 to 7 over an
 * even width with two row pairs or more); pool2x2_relu_plane and
 * pool2x2_relu_grad_plane (SSE2, 4 at a time) are their plain twins.
 *
 * Why: a first conv layer (the reference CNN's 1 -> 32 channels on 28x28) has few multiply-adds per output (9) and
 * many outputs, so its epilogue, 4 windows at a time, cost about as much as its products. As in the SSE2 rows, the
 * last group of a row is moved back to end at the row's last window, overlapping the one before: it recomputes and
 * rewrites the same values, with no masked load or store (slow on AMD's AVX2 cores) and nothing read or written
 * past the row pair. Rows of 4 to 7 windows (even OW: the CNN's second conv, 14 wide) take one group a row pair but
 * the last: its lanes past the row read the next row pair's first columns and write garbage into the next row
 * pair's first windows (and, backward, the first 16 - OW columns of its first row), which that row pair's group then
 * rewrites; the last row pair takes the plain row, so nothing past the plane is read or written. (16 windows at a
 * time in AVX-512 would need rows of 16 windows, 32 columns: none of the
 * reference models has them.)
 *
 * The arithmetic is pool2x2_relu_group4's, lane for lane: v + bias, the relu (v > 0 ? v : 0: NaN and -0 give +0),
 * then the compare-and-select chain b > a, c > m, d > m with the winner's index, ties to the first. The backward
 * gives each window's winner the pooled gradient where the pooled output is > 0, 0 everywhere else. */
#include "pool2x2.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)

#include <immintrin.h>

#define T256 __attribute__((target("avx2")))
#define INLINE static inline __attribute__((always_inline))

/* ---- AVX2: 8 windows ------------------------------------------------------------------------------------------- */

T256 INLINE __m256 sel8(__m256 t, __m256 a, __m256 b) { return _mm256_blendv_ps(b, a, t); } /* t ? a : b */

/* The even and odd columns of the 16 floats at r. */
T256 INLINE void split8(__m256 *even, __m256 *odd, const float *r) {
    const __m256 a = _mm256_loadu_ps(r), b = _mm256_loadu_ps(r + 8);
    /* evens 0 2 8 10 | 4 6 12 14 within the lanes, then in order */
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

T256 INLINE __m256 relu8(__m256 v, __m256 bias) {
    v = _mm256_add_ps(v, bias);
    return _mm256_and_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ), v);
}

/* Windows pw .. pw + 7 of one row pair: r0, r1 point at column 2 pw. */
T256 INLINE void relu_group8(float *dst, uint8_t *win, const float *r0, const float *r1, __m256 bias) {
    __m256 a, b, c, d;
    split8(&a, &b, r0);
    split8(&c, &d, r1);
    a = relu8(a, bias), b = relu8(b, bias), c = relu8(c, bias), d = relu8(d, bias);
    __m256 t = _mm256_cmp_ps(b, a, _CMP_GT_OQ), m = sel8(t, b, a);
    __m256 k = _mm256_and_ps(t, _mm256_castsi256_ps(_mm256_set1_epi32(1)));
    t = _mm256_cmp_ps(c, m, _CMP_GT_OQ), m = sel8(t, c, m);
    k = sel8(t, _mm256_castsi256_ps(_mm256_set1_epi32(2)), k);
    t = _mm256_cmp_ps(d, m, _CMP_GT_OQ), m = sel8(t, d, m);
    k = sel8(t, _mm256_castsi256_ps(_mm256_set1_epi32(3)), k);
    _mm256_storeu_ps(dst, m);
    const __m256i ki = _mm256_castps_si256(k);
    const __m128i k16 = _mm_packs_epi32(_mm256_castsi256_si128(ki), _mm256_extracti128_si256(ki, 1));
    _mm_storel_epi64((__m128i *)(void *)win, _mm_packus_epi16(k16, k16));
}

T256 void pool2x2_relu_plane_avx2(float *y, uint8_t *win, const float *pre, float bias, int OH, int OW) {
    const int PH = OH / 2, PW = OW / 2;
    const __m256 bv = _mm256_set1_ps(bias);
    if (PW < 8 && PH < 2) { /* no row pair after the first to take a group's spill (pool2x2_avx2_fits excludes it) */
        pool2x2_relu_plane(y, win, pre, bias, OH, OW);
        return;
    }
    if (PW < 8) { /* short rows (pool2x2_avx2_fits): a group a row pair, its lanes past PW rewritten by the next */
        for (int ph = 0; ph + 1 < PH; ph++) {
            const float *r0 = pre + (size_t)(2 * ph) * OW;
            relu_group8(y + (size_t)ph * PW, win + (size_t)ph * PW, r0, r0 + OW, bv);
        }
        const float *r0 = pre + (size_t)(2 * PH - 2) * OW;
        pool2x2_relu_row(y + (size_t)(PH - 1) * PW, win + (size_t)(PH - 1) * PW, r0, r0 + OW, bias, PW);
        return;
    }
    for (int ph = 0; ph < PH; ph++) {
        const float *r0 = pre + (size_t)(2 * ph) * OW, *r1 = r0 + OW;
        float *dst = y + (size_t)ph * PW;
        uint8_t *w = win + (size_t)ph * PW;
        for (int pw = 0;; pw += 8) {
            if (pw + 8 > PW) pw = PW - 8; /* the last group, moved back */
            relu_group8(dst + pw, w + pw, r0 + 2 * pw, r1 + 2 * pw, bv);
            if (pw + 8 == PW) break;
        }
    }
}

/* The backward of relu_group8: q0, q1 at column 2 pw, g, y and win at window pw. */
T256 INLINE void relu_grad_group8(float *q0, float *q1, const float *g, const float *y, const uint8_t *win) {
    const __m256 v = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(y), _mm256_setzero_ps(), _CMP_GT_OQ),
                                   _mm256_loadu_ps(g));
    const __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)win));
    const __m256 o0 = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(k, _mm256_set1_epi32(0))), v);
    const __m256 o1 = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(k, _mm256_set1_epi32(1))), v);
    const __m256 o2 = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(k, _mm256_set1_epi32(2))), v);
    const __m256 o3 = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(k, _mm256_set1_epi32(3))), v);
    /* the pairs of windows 0 1 4 5 | 2 3 6 7, then the halves in order */
    const __m256 l01 = _mm256_unpacklo_ps(o0, o1), h01 = _mm256_unpackhi_ps(o0, o1);
    const __m256 l23 = _mm256_unpacklo_ps(o2, o3), h23 = _mm256_unpackhi_ps(o2, o3);
    _mm256_storeu_ps(q0, _mm256_permute2f128_ps(l01, h01, 0x20));
    _mm256_storeu_ps(q0 + 8, _mm256_permute2f128_ps(l01, h01, 0x31));
    _mm256_storeu_ps(q1, _mm256_permute2f128_ps(l23, h23, 0x20));
    _mm256_storeu_ps(q1 + 8, _mm256_permute2f128_ps(l23, h23, 0x31));
}

T256 void pool2x2_relu_grad_plane_avx2(float *dpre, const float *dy, const float *y, const uint8_t *win, int OH,
                                       int OW) {
    const int PH = OH / 2, PW = OW / 2;
    if (PW < 8 && PH < 2) {
        pool2x2_relu_grad_plane(dpre, dy, y, win, OH, OW);
        return;
    }
    if (PW < 8) { /* short rows, as in the forward: the next row pair's first columns are rewritten after */
        for (int ph = 0; ph + 1 < PH; ph++) {
            float *q0 = dpre + (size_t)(2 * ph) * OW;
            const size_t at = (size_t)ph * PW;
            relu_grad_group8(q0, q0 + OW, dy + at, y + at, win + at);
        }
        float *q0 = dpre + (size_t)(2 * PH - 2) * OW;
        const size_t at = (size_t)(PH - 1) * PW;
        pool2x2_relu_row_grad(q0, q0 + OW, dy + at, y + at, win + at, PW);
        return;
    }
    for (int ph = 0; ph < PH; ph++) {
        float *q0 = dpre + (size_t)(2 * ph) * OW, *q1 = q0 + OW;
        const size_t at = (size_t)ph * PW;
        for (int pw = 0;; pw += 8) {
            if (pw + 8 > PW) pw = PW - 8;
            relu_grad_group8(q0 + 2 * pw, q1 + 2 * pw, dy + at + pw, y + at + pw, win + at + pw);
            if (pw + 8 == PW) break;
        }
    }
}

#else /* no x86 kernels: conv_taps_level() is never AVX2 or AVX-512 there, so these are never called */

void pool2x2_relu_plane_avx2(float *y, uint8_t *win, const float *pre, float bias, int OH, int OW) {
    pool2x2_relu_plane(y, win, pre, bias, OH, OW);
}
void pool2x2_relu_grad_plane_avx2(float *dpre, const float *dy, const float *y, const uint8_t *win, int OH, int OW) {
    pool2x2_relu_grad_plane(dpre, dy, y, win, OH, OW);
}

#endif
