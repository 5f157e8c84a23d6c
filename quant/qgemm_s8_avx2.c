/* qgemm_s8_avx2.c - quantized training's int8 x int8 products (qgemm_s8, qgemm_s8_nn) on the 256-bit families:
 * AVX2 + FMA and AVX-VNNI. Target attributes, not compiler flags, as in qgemm_avx2.c; qgemm.c calls these only when
 * qgemm_isa() is their family. The sums are exact int32 (wrapping), so the results equal qgemm_s8_ref's. */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_internal.h"
#include "fqt.h"

#if defined(__x86_64__) || defined(__i386__)
#include "qgemm_avx2_inline.h"

/* c (M, N) = a (M, K) b^T (qgemm_s8: b is (N, K)) or a b (qgemm_s8_nn: b is (K, N), rows ldb apart), both signed.
 * Blocks of 8 columns of b over S8A_KB k are packed into groups of 4 k: 32 bytes, column j's 4 bytes at 4 j (a
 * transpose of dwords for b (N, K), of bytes for b (K, N)). Then tiles of a few rows of a (S8A_R2, S8A_RU, S8A_RV)
 * run over the block, each row's block first copied to scratch in the form the inner loop broadcasts from memory
 * (a load, no shuffle):
 * - AVX2, where a's rows or b's block are all >= 0 (activations after a ReLU): the bytes as they are, vpmaddubsw
 *   with the unsigned side first (exact: that side is at most 127) and vpmaddwd by ones;
 * - AVX2 otherwise: a and the group widened to int16, vpmaddwd (exact products, two per int32 lane, summed
 *   pairwise at the end);
 * - AVX-VNNI: a + 128 (the sign bit flipped) against the group's bytes, vpdpbusd, minus 128 times the block's
 *   column sums.
 * The block's sums go into c (the first k block) or are added to it (wrapping, as the other kernels' sums do). */

#define S8A_KB 512 /* k per packed block: a multiple of 32 */

/* n bytes (n <= 32) at p, the rest 0. */
QA_TARGET QA_INLINE __m256i load32_upto(const int8_t *p, int n) {
    if (n >= 32) return _mm256_loadu_si256((const __m256i *)(const void *)p);
    _Alignas(32) int8_t t[32] = {0};
    if (n > 0) memcpy(t, p, (size_t)n);
    return _mm256_load_si256((const __m256i *)(const void *)t);
}

/* b (N, K): columns [j0, j0 + jn) (jn <= 8) over k [k0, k0 + kn) -> group g's 32 bytes (column j's 4 at 4 j) at
 * pack + g * gstride, 0 past the problem: eight groups at a time as an 8 x 8 transpose of dwords. true: every byte
 * packed is >= 0. */
QA_TARGET bool qgemm_s8_pack8_nt_avx2(int8_t *pack, size_t gstride, const int8_t *b, int K, int j0, int jn, int k0,
                                      int kn, int kg) {
    __m256i any = _mm256_setzero_si256();
    for (int g0 = 0; g0 < kg; g0 += 8) {
        __m256i r[8];
        for (int j = 0; j < 8; j++) {
            r[j] = j < jn ? load32_upto(b + (size_t)(j0 + j) * K + k0 + 4 * g0, kn - 4 * g0) : _mm256_setzero_si256();
            any = _mm256_or_si256(any, r[j]);
        }
        const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
        const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
        const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
        const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
        const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
        const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
        const __m256i grp[8] = {_mm256_permute2x128_si256(u0, u4, 0x20), _mm256_permute2x128_si256(u1, u5, 0x20),
                                _mm256_permute2x128_si256(u2, u6, 0x20), _mm256_permute2x128_si256(u3, u7, 0x20),
                                _mm256_permute2x128_si256(u0, u4, 0x31), _mm256_permute2x128_si256(u1, u5, 0x31),
                                _mm256_permute2x128_si256(u2, u6, 0x31), _mm256_permute2x128_si256(u3, u7, 0x31)};
        for (int g = 0; g < 8 && g0 + g < kg; g++)
            _mm256_storeu_si256((__m256i *)(void *)(pack + (size_t)(g0 + g) * gstride), grp[g]);
    }
    return _mm256_movemask_epi8(any) == 0;
}

/* 8 bytes of b's row k from column j (n of them, the rest 0); 0 past the block's kn rows. */
static inline __m128i nn_row8(const int8_t *b, int ldb, int k, int kn, int j, int n) {
    if (k >= kn) return _mm_setzero_si128();
    const int8_t *src = b + (size_t)k * ldb + j;
    uint64_t v = 0;
    memcpy(&v, src, (size_t)(n >= 8 ? 8 : n));
    return _mm_cvtsi64_si128((long long)v);
}

/* b (K, N): the same pack, 4 rows of 8 bytes a group, transposed as bytes. true: every byte packed is >= 0. */
QA_TARGET static bool s8a_pack_nn(int8_t *pack, const int8_t *b, int ldb, int j0, int jn, int k0, int kn, int kg) {
    const int8_t *bk = b + (size_t)k0 * ldb;
    __m128i any = _mm_setzero_si128();
    for (int g = 0; g < kg; g++) {
        __m128i r[4];
        for (int t = 0; t < 4; t++) {
            r[t] = nn_row8(bk, ldb, 4 * g + t, kn, j0, jn);
            any = _mm_or_si128(any, r[t]);
        }
        const __m128i t01 = _mm_unpacklo_epi8(r[0], r[1]), t23 = _mm_unpacklo_epi8(r[2], r[3]);
        __m128i *dst = (__m128i *)(void *)(pack + (size_t)g * 32);
        _mm_store_si128(dst, _mm_unpacklo_epi16(t01, t23));     /* columns 0..3, 4 bytes each */
        _mm_store_si128(dst + 1, _mm_unpackhi_epi16(t01, t23)); /* 4..7 */
    }
    return _mm_movemask_epi8(any) == 0;
}

/* b (K, N): four blocks (32 columns, all inside the problem) at once, 4 rows of 32 bytes a group: pack4 [4][kg][32]
 * holds what s8a_pack_nn gives each of them. true: every byte packed is >= 0. */
QA_TARGET static bool s8a_pack_nn4(int8_t *pack4, const int8_t *b, int ldb, int j0, int k0, int kn, int kg) {
    const int8_t *bk = b + (size_t)k0 * ldb + j0;
    const size_t block = (size_t)kg * 32;
    __m256i any = _mm256_setzero_si256();
    for (int g = 0; g < kg; g++) {
        __m256i r[4];
        for (int t = 0; t < 4; t++) {
            r[t] = 4 * g + t < kn ? _mm256_loadu_si256((const __m256i *)(const void *)(bk + (size_t)(4 * g + t) * ldb))
                                  : _mm256_setzero_si256();
            any = _mm256_or_si256(any, r[t]);
        }
        for (int h = 0; h < 2; h++) { /* columns 16 h .. 16 h + 15: blocks 2 h and 2 h + 1 */
            const __m128i r0 = h ? _mm256_extracti128_si256(r[0], 1) : _mm256_castsi256_si128(r[0]);
            const __m128i r1 = h ? _mm256_extracti128_si256(r[1], 1) : _mm256_castsi256_si128(r[1]);
            const __m128i r2 = h ? _mm256_extracti128_si256(r[2], 1) : _mm256_castsi256_si128(r[2]);
            const __m128i r3 = h ? _mm256_extracti128_si256(r[3], 1) : _mm256_castsi256_si128(r[3]);
            const __m128i t01l = _mm_unpacklo_epi8(r0, r1), t23l = _mm_unpacklo_epi8(r2, r3);
            const __m128i t01h = _mm_unpackhi_epi8(r0, r1), t23h = _mm_unpackhi_epi8(r2, r3);
            __m128i *lo = (__m128i *)(void *)(pack4 + (size_t)(2 * h) * block + (size_t)g * 32);
            __m128i *hi = (__m128i *)(void *)(pack4 + (size_t)(2 * h + 1) * block + (size_t)g * 32);
            _mm_store_si128(lo, _mm_unpacklo_epi16(t01l, t23l));
            _mm_store_si128(lo + 1, _mm_unpackhi_epi16(t01l, t23l));
            _mm_store_si128(hi, _mm_unpacklo_epi16(t01h, t23h));
            _mm_store_si128(hi + 1, _mm_unpackhi_epi16(t01h, t23h));
        }
    }
    return _mm256_movemask_epi8(any) == 0;
}

/* The block's sums of one tile row into c's row i, columns j0 .. j0 + jn. */
QA_TARGET QA_INLINE void s8a_store(int32_t *c, int ldc, int i, int j0, int jn, __m256i v, bool first) {
    int32_t *dst = c + (size_t)i * ldc + j0;
    if (jn >= 8) {
        if (!first) v = _mm256_add_epi32(v, _mm256_loadu_si256((const __m256i *)dst));
        _mm256_storeu_si256((__m256i *)dst, v);
    } else {
        const __m256i m = lane_mask8(jn);
        if (!first) v = _mm256_add_epi32(v, _mm256_maskload_epi32((const int *)dst, m));
        _mm256_maskstore_epi32((int *)dst, m, v);
    }
}

#define S8A_MB 72    /* rows of a prepared at once per k block: a multiple of every tile's height */
#define S8A_R2 4     /* AVX2 tile rows: 8 accumulators, the two weight vectors and a broadcast in 16 registers */
#define S8A_RV 6     /* AVX-VNNI tile rows */
#define S8A_RU 8     /* AVX2 u8 x s8 tile rows: 8 accumulators, the group, the ones and two temporaries */
#define S8A_PACKS 16 /* column blocks of b (N, K) packed once per k block for all of a's rows (N <= 128) */

/* How a tile multiplies: a and b signed (int16 products), a's rows all >= 0 (a unsigned against b's bytes), or
 * b's block all >= 0 (b's bytes unsigned against a's). vpmaddubsw sums two u8 x s8 products in int16 with
 * saturation; with the unsigned side in [0, 127] the sum lies in [-32512, 32512], so it is exact, and half the
 * instructions of the int16 form (the common case: activations after a ReLU). */
typedef enum { S8A_SS, S8A_UA, S8A_UB } S8aMode;

/* a's prepared rows [0, mb) of one k block: the bytes (AVX-VNNI: + 128), zero to 4 kg, and (AVX2, when some byte is
 * negative) the same widened to int16. */
typedef struct {
    _Alignas(32) int16_t w[S8A_MB][S8A_KB];
    _Alignas(32) int8_t b[S8A_MB][S8A_KB];
    bool nonneg; /* every byte of the rows >= 0 */
} S8aRows;

/* n bytes (n <= 16; none if n <= 0) at p, the rest 0. */
static inline __m128i load16_upto(const int8_t *p, int n) {
    if (n >= 16) return _mm_loadu_si128((const __m128i *)(const void *)p);
    _Alignas(16) int8_t t[16] = {0};
    if (n > 0) memcpy(t, p, (size_t)n);
    return _mm_load_si128((const __m128i *)(const void *)t);
}

/* AVX2: rows [i0, i0 + mb) of a's k block [k0, k0 + kn) as bytes, and widened to int16 unless all are >= 0 (the
 * u8 tiles read only the bytes then). */
QA_TARGET static void s8a_prep_avx2(S8aRows *s, const int8_t *a, int K, int i0, int mb, int k0, int kn, int kg) {
    __m128i any = _mm_setzero_si128();
    for (int r = 0; r < mb; r++) {
        const int8_t *row = a + (size_t)(i0 + r) * K + k0;
        for (int k = 0; k < 4 * kg; k += 16) {
            const __m128i v = load16_upto(row + k, kn - k);
            any = _mm_or_si128(any, v);
            _mm_storeu_si128((__m128i *)(void *)(s->b[r] + k), v);
        }
    }
    s->nonneg = _mm_movemask_epi8(any) == 0;
    if (s->nonneg) return;
    for (int r = 0; r < mb; r++)
        for (int k = 0; k < 4 * kg; k += 16)
            _mm256_storeu_si256((__m256i *)(void *)(s->w[r] + k),
                                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(s->b[r] + k))));
}

/* AVX-VNNI: the same rows as a + 128 (the sign bit flipped; bytes past kn become 128 and meet 0 weights). */
QV_TARGET static void s8a_prep_avxvnni(S8aRows *s, const int8_t *a, int K, int i0, int mb, int k0, int kn, int kg) {
    const __m128i flip = _mm_set1_epi8((char)0x80);
    for (int r = 0; r < mb; r++) {
        const int8_t *row = a + (size_t)(i0 + r) * K + k0;
        for (int k = 0; k < 4 * kg; k += 16) {
            _mm_storeu_si128((__m128i *)(void *)(s->b[r] + k), _mm_xor_si128(load16_upto(row + k, kn - k), flip));
        }
    }
    s->nonneg = false; /* vpdpbusd takes any signs; the mode is not read */
}

/* AVX2, a and b signed: the rows' int16 times the block widened to int16 (vpmaddwd), into c's columns j0 ..
 * j0 + jn. */
QA_TARGET static void s8a_tiles_ss(int32_t *c, int ldc, const S8aRows *s, int i0, int mb, int j0, int jn, bool first,
                                   const int8_t *pack, int kg) {
    _Alignas(32) int16_t w16[S8A_KB / 4 * 32];
    for (int g = 0; g < kg; g++) {
        const __m256i v = _mm256_load_si256((const __m256i *)(const void *)(pack + (size_t)g * 32));
        _mm256_store_si256((__m256i *)(void *)(w16 + (size_t)g * 32), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)));
        _mm256_store_si256((__m256i *)(void *)(w16 + (size_t)g * 32 + 16),
                           _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)));
    }
    for (int i = 0; i < mb; i += S8A_R2) {
        const int nr = mb - i < S8A_R2 ? mb - i : S8A_R2;
        const int16_t *rows[S8A_R2];
        for (int r = 0; r < S8A_R2; r++) rows[r] = s->w[i + (r < nr ? r : 0)]; /* past the end: the first again */
        __m256i acc[S8A_R2][2];
#pragma GCC unroll 4
        for (int r = 0; r < S8A_R2; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int g = 0; g < kg; g++) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(const void *)(w16 + (size_t)g * 32));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(const void *)(w16 + (size_t)g * 32 + 16));
#pragma GCC unroll 4
            for (int r = 0; r < S8A_R2; r++) {
                int64_t q;
                memcpy(&q, rows[r] + 4 * (size_t)g, 8); /* the row's 4 int16, broadcast by a load */
                const __m256i av = _mm256_set1_epi64x(q);
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(av, w0));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(av, w1));
            }
        }
        for (int r = 0; r < nr; r++) s8a_store(c, ldc, i0 + i + r, j0, jn, pair_sums(acc[r][0], acc[r][1]), first);
    }
}

/* AVX2, one side >= 0: a row's 4 bytes broadcast against the group's 32 (column j's 4 at 4 j), vpmaddubsw with the
 * unsigned side first, then vpmaddwd by ones: each lane a column's sum over the group. */
QA_TARGET QA_INLINE void s8a_tiles_u8(int32_t *c, int ldc, const S8aRows *s, int i0, int mb, int j0, int jn,
                                      bool first, const int8_t *pack, int kg, bool a_unsigned) {
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int i = 0; i < mb; i += S8A_RU) {
        const int nr = mb - i < S8A_RU ? mb - i : S8A_RU;
        const int8_t *rows[S8A_RU];
        for (int r = 0; r < S8A_RU; r++) rows[r] = s->b[i + (r < nr ? r : 0)];
        __m256i acc[S8A_RU];
#pragma GCC unroll 8
        for (int r = 0; r < S8A_RU; r++) acc[r] = _mm256_setzero_si256();
        for (int g = 0; g < kg; g++) {
            const __m256i w = _mm256_load_si256((const __m256i *)(const void *)(pack + (size_t)g * 32));
#pragma GCC unroll 8
            for (int r = 0; r < S8A_RU; r++) {
                int32_t q;
                memcpy(&q, rows[r] + 4 * (size_t)g, 4);
                const __m256i av = _mm256_set1_epi32(q);
                const __m256i p = a_unsigned ? _mm256_maddubs_epi16(av, w) : _mm256_maddubs_epi16(w, av);
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones16));
            }
        }
        for (int r = 0; r < nr; r++) s8a_store(c, ldc, i0 + i + r, j0, jn, acc[r], first);
    }
}

QA_TARGET static void s8a_tiles_avx2(int32_t *c, int ldc, const S8aRows *s, int i0, int mb, int j0, int jn,
                                     bool first, const int8_t *pack, int kg, S8aMode mode) {
    if (mode == S8A_UA) s8a_tiles_u8(c, ldc, s, i0, mb, j0, jn, first, pack, kg, true);
    else if (mode == S8A_UB) s8a_tiles_u8(c, ldc, s, i0, mb, j0, jn, first, pack, kg, false);
    else s8a_tiles_ss(c, ldc, s, i0, mb, j0, jn, first, pack, kg);
}

/* AVX-VNNI: the same with the group's bytes as packed and the block's column sums (from the pack) as the
 * correction; any signs (the mode is not read). */
QV_TARGET static void s8a_tiles_avxvnni(int32_t *c, int ldc, const S8aRows *s, int i0, int mb, int j0, int jn,
                                        bool first, const int8_t *pack, int kg, S8aMode mode) {
    (void)mode;
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    __m256i sum = _mm256_setzero_si256();
    for (int g = 0; g < kg; g++) { /* a column's 4 bytes: two pairs (vpmaddubsw), then the pairs (vpmaddwd) */
        const __m256i v = _mm256_load_si256((const __m256i *)(const void *)(pack + (size_t)g * 32));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16));
    }
    const __m256i corr = _mm256_slli_epi32(sum, 7); /* 128 times the column sums */
    for (int i = 0; i < mb; i += S8A_RV) {
        const int nr = mb - i < S8A_RV ? mb - i : S8A_RV;
        const uint8_t *rows[S8A_RV];
        for (int r = 0; r < S8A_RV; r++) rows[r] = (const uint8_t *)s->b[i + (r < nr ? r : 0)];
        __m256i acc[S8A_RV];
#pragma GCC unroll 6
        for (int r = 0; r < S8A_RV; r++) acc[r] = _mm256_setzero_si256();
        for (int g = 0; g < kg; g++) {
            const __m256i w = _mm256_load_si256((const __m256i *)(const void *)(pack + (size_t)g * 32));
#pragma GCC unroll 6
            for (int r = 0; r < S8A_RV; r++) {
                int32_t q;
                memcpy(&q, rows[r] + 4 * (size_t)g, 4);
                acc[r] = _mm256_dpbusd_avx_epi32(acc[r], _mm256_set1_epi32(q), w);
            }
        }
        for (int r = 0; r < nr; r++) s8a_store(c, ldc, i0 + i + r, j0, jn, _mm256_sub_epi32(acc[r], corr), first);
    }
}

typedef void (*S8aPrepFn)(S8aRows *s, const int8_t *a, int K, int i0, int mb, int k0, int kn, int kg);
typedef void (*S8aTilesFn)(int32_t *c, int ldc, const S8aRows *s, int i0, int mb, int j0, int jn, bool first,
                           const int8_t *pack, int kg, S8aMode mode);

static S8aMode s8a_mode(bool a_nonneg, bool b_nonneg) {
    return a_nonneg ? S8A_UA : b_nonneg ? S8A_UB : S8A_SS;
}

/* c (M, N) = a b^T (ldb < 0: b is (N, K)) or a b (b is (K, N), rows ldb apart): per k block, S8A_MB rows of a
 * prepared once, then every packed column block against them. A b (N, K) of at most S8A_PACKS blocks (the weight
 * gradient's g, the dense layer's weights) is packed once per k block for all the row blocks. */
static void s8a_run(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K,
                    S8aPrepFn prep, S8aTilesFn tiles) {
    _Alignas(32) int8_t pack[S8A_PACKS * S8A_KB / 4 * 32];
    _Alignas(32) S8aRows rows;
    bool pos[S8A_PACKS]; /* pack block q's bytes all >= 0 */
    const int nblk = (N + 7) / 8;
    const bool once = ldb < 0 && nblk <= S8A_PACKS;
    for (int k0 = 0; k0 < K; k0 += S8A_KB) {
        const int kn = K - k0 < S8A_KB ? K - k0 : S8A_KB, kg = (kn + 3) / 4;
        const size_t block = (size_t)kg * 32;
        if (once)
            for (int q = 0; q < nblk; q++)
                pos[q] = qgemm_s8_pack8_nt_avx2(pack + q * block, 32, b, K, 8 * q, N - 8 * q < 8 ? N - 8 * q : 8, k0,
                                                kn, kg);
        for (int i0 = 0; i0 < M; i0 += S8A_MB) {
            const int mb = M - i0 < S8A_MB ? M - i0 : S8A_MB;
            prep(&rows, a, K, i0, mb, k0, kn, kg);
            if (once) {
                for (int q = 0; q < nblk; q++)
                    tiles(c, ldc, &rows, i0, mb, 8 * q, N - 8 * q < 8 ? N - 8 * q : 8, k0 == 0, pack + q * block, kg,
                          s8a_mode(rows.nonneg, pos[q]));
                continue;
            }
            for (int j0 = 0; j0 < N;) {
                if (ldb >= 0 && N - j0 >= 32) { /* four whole blocks of b (K, N) packed at once */
                    const bool p = s8a_pack_nn4(pack, b, ldb, j0, k0, kn, kg);
                    for (int q = 0; q < 4; q++)
                        tiles(c, ldc, &rows, i0, mb, j0 + 8 * q, 8, k0 == 0, pack + q * block, kg,
                              s8a_mode(rows.nonneg, p));
                    j0 += 32;
                    continue;
                }
                const int jn = N - j0 < 8 ? N - j0 : 8;
                const bool p = ldb < 0 ? qgemm_s8_pack8_nt_avx2(pack, 32, b, K, j0, jn, k0, kn, kg)
                                       : s8a_pack_nn(pack, b, ldb, j0, jn, k0, kn, kg);
                tiles(c, ldc, &rows, i0, mb, j0, jn, k0 == 0, pack, kg, s8a_mode(rows.nonneg, p));
                j0 += 8;
            }
        }
    }
}

void qgemm_s8_avx2(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    s8a_run(c, ldc, a, b, -1, M, N, K, s8a_prep_avx2, s8a_tiles_avx2);
}
void qgemm_s8_avxvnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    s8a_run(c, ldc, a, b, -1, M, N, K, s8a_prep_avxvnni, s8a_tiles_avxvnni);
}
void qgemm_s8_nn_avx2(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    s8a_run(c, ldc, a, b, ldb, M, N, K, s8a_prep_avx2, s8a_tiles_avx2);
}
void qgemm_s8_nn_avxvnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    s8a_run(c, ldc, a, b, ldb, M, N, K, s8a_prep_avxvnni, s8a_tiles_avxvnni);
}

#else /* not x86: qgemm_isa() is always portable, so these are never called */

bool qgemm_s8_pack8_nt_avx2(int8_t *pack, size_t gstride, const int8_t *b, int K, int j0, int jn, int k0, int kn,
                            int kg) {
    (void)pack, (void)gstride, (void)b, (void)K, (void)j0, (void)jn, (void)k0, (void)kn, (void)kg;
    return false;
}

void qgemm_s8_nn_avx2(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    qgemm_s8_nn_ref(c, ldc, a, b, ldb, M, N, K);
}
void qgemm_s8_nn_avxvnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    qgemm_s8_nn_ref(c, ldc, a, b, ldb, M, N, K);
}
void qgemm_s8_avx2(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    qgemm_s8_ref_ldc(c, ldc, a, b, M, N, K);
}
void qgemm_s8_avxvnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    qgemm_s8_ref_ldc(c, ldc, a, b, M, N, K);
}

#endif
