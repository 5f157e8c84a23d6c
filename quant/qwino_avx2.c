/* qwino_avx2.c - the int8 F(2x2, 3x3)'s AVX2 kernel (qwino.h): 8 tiles of a tile row in a vector's int32 lanes,
 * as nn/conv_wino_kern.h holds floats. Per image: the codes split into even and odd padded columns (int32); each
 * channel's input transform (int32, exact); channel pairs packed into int16 pairs; per block of 4 output rows the
 * 16 products (4 rows by 3 vectors of tiles, vpmaddwd over the channel pairs), then the output transform and the
 * exact division by 4. The same sums as qwino_forward_ref, so the same bits. The passes stay out of line, each
 * its own line in a profile. */
#include "qwino.h"

#include <string.h>

#include "nn/conv_wino.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)

#include <immintrin.h>

#define T256 __attribute__((target("avx2")))
#define INLINE static inline __attribute__((always_inline))

/* Row pr of channel c's split plane: E[j] = x(pr - 1, 2j - 1) at s, O[j] = x(pr - 1, 2j) at s + ew, 0 outside, for
 * every j the input transform reads (j <= jn = ceil(TW / 8) 8). A row's codes, 16 at a time (the bytes past the
 * row masked to 0; the last 16 bytes of the input through a copy, as it has no slack past its end), widened and
 * split into even and odd columns. */
T256 __attribute__((noinline)) static void qw_split(const QWino *p, int32_t *s, const int8_t *x) {
    static const int8_t ones[32] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    const int W = p->W, ew = p->ew, jn = (p->TW + 7) / 8 * 8;
    const size_t n = (size_t)p->C * p->H * W; /* the input's bytes */
    int8_t tail[32] = {0};
    for (int c = 0; c < p->C; c++)
        for (int pr = 0; pr < 2 * p->TH + 2; pr++) {
            int32_t *e = s + (size_t)c * p->splane + (size_t)pr * 2 * ew, *o = e + ew;
            const int h = pr - 1;
            if (h < 0 || h >= p->H) {
                for (int j = 0; j <= jn; j += 8) {
                    _mm256_storeu_si256((__m256i *)(e + j), _mm256_setzero_si256());
                    _mm256_storeu_si256((__m256i *)(o + j), _mm256_setzero_si256());
                }
                continue;
            }
            const size_t at = ((size_t)c * p->H + h) * W;
            e[0] = 0;
            for (int k = 0; k < W; k += 16) { /* columns k .. k + 15: O[k / 2 ..], E[k / 2 + 1 ..] */
                __m128i b;
                if (at + k + 16 <= n) {
                    b = _mm_loadu_si128((const __m128i *)(x + at + k));
                } else {
                    memcpy(tail, x + at + k, n - at - k);
                    b = _mm_loadu_si128((const __m128i *)tail);
                }
                if (W - k < 16) b = _mm_and_si128(b, _mm_loadu_si128((const __m128i *)(ones + 16 - (W - k))));
                const __m256 lo = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(b));
                const __m256 hi = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
                const __m256 ev = _mm256_shuffle_ps(lo, hi, 0x88), od = _mm256_shuffle_ps(lo, hi, 0xdd);
                _mm256_storeu_si256((__m256i *)(o + k / 2), _mm256_permute4x64_epi64(_mm256_castps_si256(ev), 0xd8));
                _mm256_storeu_si256((__m256i *)(e + k / 2 + 1),
                                    _mm256_permute4x64_epi64(_mm256_castps_si256(od), 0xd8));
            }
            o[jn] = 0;
        }
}

/* Channel c's input transform into v32 [16][C][ldv] (tile t at t; lanes past a row: the next row's, written
 * after; past T: 0). */
T256 __attribute__((noinline)) static void qw_input(const QWino *p, int32_t *v32, size_t ldq, const int32_t *sc,
                                                    int c) {
    const int ew = p->ew;
    int32_t *vc = v32 + (size_t)c * p->ldv;
    for (int i = 0; i < p->TH; i++) {
        const int32_t *r0 = sc + (size_t)(2 * i) * 2 * ew;
        for (int j = 0; j < p->TW; j += 8) {
            __m256i h[4][4];
#pragma GCC unroll 4
            for (int a = 0; a < 4; a++) {
                const int32_t *e = r0 + (size_t)a * 2 * ew + j, *o = e + ew;
                const __m256i e0 = _mm256_loadu_si256((const __m256i *)e);
                const __m256i e1 = _mm256_loadu_si256((const __m256i *)(e + 1));
                const __m256i o0 = _mm256_loadu_si256((const __m256i *)o);
                const __m256i o1 = _mm256_loadu_si256((const __m256i *)(o + 1));
                h[a][0] = _mm256_sub_epi32(e0, e1), h[a][1] = _mm256_add_epi32(o0, e1);
                h[a][2] = _mm256_sub_epi32(e1, o0), h[a][3] = _mm256_sub_epi32(o0, o1);
            }
            int32_t *dst = vc + (size_t)i * p->TW + j;
#pragma GCC unroll 4
            for (int b = 0; b < 4; b++) {
                _mm256_storeu_si256((__m256i *)(dst + (0 + b) * ldq), _mm256_sub_epi32(h[0][b], h[2][b]));
                _mm256_storeu_si256((__m256i *)(dst + (4 + b) * ldq), _mm256_add_epi32(h[1][b], h[2][b]));
                _mm256_storeu_si256((__m256i *)(dst + (8 + b) * ldq), _mm256_sub_epi32(h[2][b], h[1][b]));
                _mm256_storeu_si256((__m256i *)(dst + (12 + b) * ldq), _mm256_sub_epi32(h[1][b], h[3][b]));
            }
        }
    }
    for (int q = 0; q < 16; q++)
        for (int t = p->T; t < p->tv * 8; t += 8)
            _mm256_storeu_si256((__m256i *)(vc + q * ldq + t), _mm256_setzero_si256());
}

/* vp [16][C / 2][ldv] = channels 2k and 2k + 1 of v32 as int16 pairs (low, high); a last odd channel with 0. */
T256 __attribute__((noinline)) static void qw_pairs(const QWino *p, int32_t *vp, size_t ldp, const int32_t *v32,
                                                    size_t ldq) {
    const int np = (p->C + 1) / 2;
    for (int q = 0; q < 16; q++)
        for (int k = 0; k < np; k++) {
            const int32_t *lo = v32 + q * ldq + (size_t)(2 * k) * p->ldv, *hi = lo + p->ldv;
            const bool has_hi = 2 * k + 1 < p->C;
            int32_t *d = vp + q * ldp + (size_t)k * p->ldv;
            for (int t = 0; t < p->tv * 8; t += 8) {
                const __m256i l = _mm256_loadu_si256((const __m256i *)(lo + t));
                const __m256i h = has_hi ? _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(hi + t)), 16)
                                         : _mm256_setzero_si256();
                _mm256_storeu_si256((__m256i *)(d + t), _mm256_blend_epi16(l, h, 0xaa));
            }
        }
}

/* m (4 rows ldv apart) tiles t0 .. t0 + NV - 1 vectors: the chains over the np pairs of vq (pairs ldv apart)
 * times the block's broadcast weight pairs wq [np][4]. */
T256 INLINE void qw_gemm_tile(int32_t *m, size_t ldv, const int32_t *vq, const int32_t *wq, int np, int t0,
                              const int NV) {
    __m256i acc[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++) acc[r][n] = _mm256_setzero_si256();
    const int32_t *vt = vq + (size_t)t0 * 8;
    for (int k = 0; k < np; k++, vt += ldv, wq += 4) {
        __m256i b[3];
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++)
            b[n] = n < NV ? _mm256_loadu_si256((const __m256i *)(vt + n * 8)) : _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m256i a = _mm256_set1_epi32(wq[r]);
#pragma GCC unroll 3
            for (int n = 0; n < 3; n++)
                if (n < NV) acc[r][n] = _mm256_add_epi32(acc[r][n], _mm256_madd_epi16(a, b[n]));
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++)
            if (n < NV) _mm256_storeu_si256((__m256i *)(m + (size_t)r * ldv + (size_t)(t0 + n) * 8), acc[r][n]);
}

/* The output transform of rows [0, rows) of m (positions ldm apart) into acc, divided by 4. */
T256 __attribute__((noinline)) static void qw_output(const QWino *p, int32_t *acc, size_t ldc, const int32_t *m,
                                                     size_t ldm, int rows) {
    const int W = p->W;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < p->TH; i++)
            for (int j = 0; j < p->TW; j += 8) {
                const int32_t *mt = m + (size_t)r * p->ldv + (size_t)i * p->TW + j;
                __m256i s0[4], s1[4];
#pragma GCC unroll 4
                for (int b = 0; b < 4; b++) {
                    const __m256i m0 = _mm256_loadu_si256((const __m256i *)(mt + (0 + b) * ldm));
                    const __m256i m1 = _mm256_loadu_si256((const __m256i *)(mt + (4 + b) * ldm));
                    const __m256i m2 = _mm256_loadu_si256((const __m256i *)(mt + (8 + b) * ldm));
                    const __m256i m3 = _mm256_loadu_si256((const __m256i *)(mt + (12 + b) * ldm));
                    s0[b] = _mm256_add_epi32(_mm256_add_epi32(m0, m1), m2);
                    s1[b] = _mm256_sub_epi32(_mm256_sub_epi32(m1, m2), m3);
                }
                const int cols = W - 2 * j;
                for (int a = 0; a < 2; a++) {
                    if (2 * i + a >= p->H) break;
                    const __m256i *s = a ? s1 : s0;
                    const __m256i ev = _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), s[2]), 2);
                    const __m256i od = _mm256_srai_epi32(_mm256_sub_epi32(_mm256_sub_epi32(s[1], s[2]), s[3]), 2);
                    const __m256i l = _mm256_unpacklo_epi32(ev, od), h = _mm256_unpackhi_epi32(ev, od);
                    const __m256i lo = _mm256_permute2x128_si256(l, h, 0x20);
                    const __m256i hi = _mm256_permute2x128_si256(l, h, 0x31);
                    int32_t *o = acc + (size_t)r * ldc + (size_t)(2 * i + a) * W + 2 * j;
                    if (cols >= 8) _mm256_storeu_si256((__m256i *)o, lo);
                    else _mm256_maskstore_epi32(o, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane), lo);
                    if (cols >= 16) _mm256_storeu_si256((__m256i *)(o + 8), hi);
                    else if (cols > 8)
                        _mm256_maskstore_epi32(o + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane), hi);
                }
            }
}

T256 void qwino_forward_avx2(const QWino *p, int32_t *acc, size_t ldc, const int8_t *x, const int32_t *wp, int out,
                             void *scratch) {
    const int np = (p->C + 1) / 2;
    const size_t ldq = conv_wino_stride((size_t)p->C * p->ldv), ldp = conv_wino_stride((size_t)np * p->ldv);
    const size_t ldm = conv_wino_stride(4 * p->ldv);
    int32_t *s = scratch, *v32 = s + (size_t)p->C * p->splane, *vp = v32 + 16 * ldq, *m = vp + 16 * ldp;
    for (int q = 0; q < 16; q++) /* lanes past the products' vectors, read by the last output vectors */
        for (int r = 0; r < 4; r++)
            _mm256_storeu_si256((__m256i *)(m + q * ldm + (size_t)r * p->ldv + p->tv * 8), _mm256_setzero_si256());
    qw_split(p, s, x);
    for (int c = 0; c < p->C; c++) qw_input(p, v32, ldq, s + (size_t)c * p->splane, c);
    qw_pairs(p, vp, ldp, v32, ldq);
    const int blocks = (out + 3) / 4;
    const size_t per_q = (size_t)blocks * np * 4;
    for (int b = 0; b < blocks; b++) {
        for (int q = 0; q < 16; q++) {
            const int32_t *wq = wp + q * per_q + (size_t)b * np * 4, *vq = vp + q * ldp;
            int32_t *mq = m + q * ldm;
            for (int t = 0; t < p->tv;) { /* tiles of 3 vectors; 4 left as 2 + 2, not 3 + 1 (one vector's 4 chains
                                           * wait on vpmaddwd's latency) */
                const int left = p->tv - t;
                if (left == 4 || left == 2) qw_gemm_tile(mq, p->ldv, vq, wq, np, t, 2), t += 2;
                else if (left == 1) qw_gemm_tile(mq, p->ldv, vq, wq, np, t, 1), t += 1;
                else qw_gemm_tile(mq, p->ldv, vq, wq, np, t, 3), t += 3;
            }
        }
        const int rb = out - 4 * b < 4 ? out - 4 * b : 4;
        qw_output(p, acc + (size_t)b * 4 * ldc, ldc, m, ldm, rb);
    }
}

#else

void qwino_forward_avx2(const QWino *p, int32_t *acc, size_t ldc, const int8_t *x, const int32_t *wp, int out,
                        void *scratch) {
    (void)scratch;
    qwino_forward_ref(p, acc, ldc, x, wp, out);
}

#endif
