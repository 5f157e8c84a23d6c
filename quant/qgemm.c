/* qgemm.c - the int8 x int8 -> int32 GEMM of the QT layer's forward.
 *
 * Both operands keep K contiguous (X rows and W rows), so every output is a
 * dot product of two int8 rows. The fast kernel widens a block of b rows
 * (QG_NB x QG_KB) and one a row to int16 on the stack, then computes four
 * dot products at a time, sharing each load of the a row. On int16 operands
 * of unknown range the int32 sum of products is the pattern GCC turns into
 * pmaddwd (vpmaddwd) reductions; multiplying the int8 values directly, GCC
 * proves the products fit in int16 and emits pmullw plus widening adds,
 * about three times slower. Integer sums are exact, so any blocking gives
 * the _ref loop's results bit for bit. |a b| <= 2^14, so K < 2^17 keeps
 * every sum inside int32. */
#include <string.h>

#include "qt.h"

#define QG_KB 256 /* K per block */
#define QG_NB 32  /* rows of b per block: 16 KiB of int16, in L1 with the a row */

void qgemm_s8_ref(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            int32_t acc = 0;
            for (int k = 0; k < K; k++) acc += (int32_t)a[(size_t)i * K + k] * (int32_t)b[(size_t)j * K + k];
            c[(size_t)i * N + j] = acc;
        }
}

/* a [n] . b [n]. */
static int32_t dot1_s16(const int16_t *restrict a, const int16_t *restrict b, int n) {
    int32_t s = 0;
    for (int k = 0; k < n; k++) s += (int32_t)a[k] * b[k];
    return s;
}

/* out [4] += a [n] . the four rows of b, QG_KB apart. */
static void dot4_s16(int32_t *restrict out, const int16_t *restrict a, const int16_t *restrict b, int n) {
    const int16_t *restrict b0 = b, *restrict b1 = b + QG_KB;
    const int16_t *restrict b2 = b + 2 * QG_KB, *restrict b3 = b + 3 * QG_KB;
    int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int k = 0; k < n; k++) {
        int32_t x = a[k];
        s0 += x * b0[k];
        s1 += x * b1[k];
        s2 += x * b2[k];
        s3 += x * b3[k];
    }
    out[0] += s0, out[1] += s1, out[2] += s2, out[3] += s3;
}

/* dst (rows, QG_KB) int16 = src (rows, ld) int8, columns [0, n). */
static void widen_rows(int16_t *restrict dst, const int8_t *restrict src, size_t ld, int rows, int n) {
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < n; k++) dst[(size_t)r * QG_KB + k] = src[(size_t)r * ld + k];
}

void qgemm_s8(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K) {
    if (M <= 0 || N <= 0) return;
    _Alignas(64) int16_t bw[QG_NB * QG_KB]; /* (QG_NB, QG_KB) the current block of b */
    _Alignas(64) int16_t aw[QG_KB];         /* one row of a over the block's K */
    memset(c, 0, (size_t)M * (size_t)N * sizeof *c);
    for (int k0 = 0; k0 < K; k0 += QG_KB) {
        int kn = K - k0 < QG_KB ? K - k0 : QG_KB;
        for (int j0 = 0; j0 < N; j0 += QG_NB) {
            int jn = N - j0 < QG_NB ? N - j0 : QG_NB;
            widen_rows(bw, b + (size_t)j0 * K + k0, (size_t)K, jn, kn);
            for (int i = 0; i < M; i++) {
                const int8_t *ar = a + (size_t)i * K + k0; /* [kn] */
                for (int k = 0; k < kn; k++) aw[k] = ar[k];
                int32_t *cr = c + (size_t)i * N + j0; /* [jn] */
                int j = 0;
                for (; j + 4 <= jn; j += 4) dot4_s16(cr + j, aw, bw + (size_t)j * QG_KB, kn);
                for (; j < jn; j++) cr[j] += dot1_s16(aw, bw + (size_t)j * QG_KB, kn);
            }
        }
    }
}
