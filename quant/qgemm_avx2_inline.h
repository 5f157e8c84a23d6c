/* qgemm_avx2_inline.h - what the 256-bit kernel files (qgemm_avx2.c, qgemm_s8_avx2.c) share: their target
 * attributes and two small vector helpers. x86 only; include inside the files' x86 sections. */
#ifndef QTRAIN_QUANT_QGEMM_AVX2_INLINE_H
#define QTRAIN_QUANT_QGEMM_AVX2_INLINE_H

#include <immintrin.h>

#define QA_TARGET __attribute__((target("avx2,fma")))
#define QV_TARGET __attribute__((target("avx2,fma,avxvnni")))
#define QA_INLINE static inline __attribute__((always_inline))

/* The lanes i < n (of 8) set: masked loads and stores. */
QA_TARGET QA_INLINE __m256i lane_mask8(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Two vectors of pairwise partial sums (lanes 2i, 2i + 1 of x the halves of column i, columns 0..3 in x and 4..7
 * in y, as vpmaddwd leaves them) -> the 8 column sums in order. */
QA_TARGET QA_INLINE __m256i pair_sums(__m256i x, __m256i y) {
    /* vphaddd gives, per 128-bit lane, x's two sums then y's: columns 0 1 4 5 | 2 3 6 7 */
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(x, y), 0xD8);
}

#endif
