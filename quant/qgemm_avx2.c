/* qgemm_avx2.c - the 256-bit kernels of qgemm.h: AVX2 + FMA, and AVX-VNNI
 * (vpdpbusd on ymm registers: Intel client chips from Alder Lake on, without AVX-512).
 *
 * Every function carries a target attribute instead of a compiler flag, so
 * this file builds with the project's flags and the binary still runs on
 * any x86-64; qgemm.c calls these only when qgemm_isa() is their family.
 * The AVX2 functions' target has no AVX-VNNI, so nothing the compiler makes
 * of them needs more than AVX2 and FMA (AMD Zen 1 to 3, Intel Haswell on).
 *
 * AVX2 has no byte dot product that is exact for these codes: vpmaddubsw
 * saturates its int16 pair sums (255 * 127 * 2 > 32767). Splitting each
 * activation code a = 128 (a >> 7) + (a & 127) avoids the saturation at the
 * price of two vpmaddubsw and two vpmaddwd per 32 products; widening both
 * operands to int16 and multiplying by vpmaddwd (two products per int32
 * lane, |sum| <= 2 * 255 * 128) is exact with one multiply per 16 products,
 * 1.5 to 2 times faster measured (bench/README.md), and that is what the
 * kernels here do. Each int32 lane then holds two of a
 * group's four products; lanes are added pairwise (vphaddd) once a tile's
 * sums are complete. The int32 sums wrap modulo 2^32 like vpdpbusd's and the
 * portable loop's, the corrections are the same, and each float output is
 * one fused multiply-add: the results equal the portable kernels bit for bit.
 *
 * Dense (AVX2): tiles of 6 rows x 8 columns (half a packed panel): per group
 * of 4 k, the half panel's 32 weight bytes sign-extended into two vectors of
 * 4 columns, each row's 4 codes broadcast and zero-extended; 12 accumulators.
 * Dense (AVX-VNNI): tiles of 6 rows x 16 columns, one vpdpbusd per row and
 * half panel, as the AVX-512 kernel with two 32-byte halves per group.
 * Depthwise (both families): vpmaddwd of codes against kernel-row weight
 * pairs over padded rows widened to int16 once in scratch, strides 1 and 2
 * across (others portable), see qgemm_dw_avx2.
 * Taps (AVX2): the codes a call reads widened to int16 once (act_wide), then
 * per row block and vector 6 + 6 + 4 pixels x 8 rows: the tap's 8 rows of 4
 * weights as two vectors, each pixel's 4 codes one broadcast, a transpose
 * into the int32 block (fewer loads per multiply than the rows as broadcasts
 * against 4 pixels' codes; the loads bound this loop, not the multiplies:
 * docs/BENCHMARKS.md, "Int8 on AVX2"). Taps (AVX-VNNI): 8 rows x 8 pixels.
 * Both then run the epilogue on the block, which stores a partial vector's
 * outputs as two compressed halves under masks; relu + 2x2 max pool always
 * goes through the pool buffer.
 * The int8 x int8 products of quantized training are in qgemm_s8_avx2.c. */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_internal.h"
#include "fqt.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "qgemm_avx2_inline.h"

#define QA_ROWS 6 /* rows of a dense tile */

static inline uint32_t load_u32(const uint8_t *p, int n) {
    uint32_t v = 0; /* bytes past n stay 0 */
    memcpy(&v, p, (size_t)n);
    return v;
}

/* ---- dense ----------------------------------------------------------------------------------------------------- */

/* Row i0 + r's 8 columns j0 .. j0 + 7 (n of them in the problem) from its sums: c_i32 or the float outputs. */
QA_TARGET QA_INLINE void dense_store8(const QGemmDense *d, __m256i sum, int i, int j0, int n) {
    const __m256i corr = _mm256_mullo_epi32(_mm256_set1_epi32(d->a_zero),
                                            _mm256_loadu_si256((const __m256i *)(d->b->col_sum + j0)));
    const __m256i s = _mm256_sub_epi32(sum, corr), m = lane_mask8(n);
    const size_t at = (size_t)i * d->ldc + j0;
    if (d->c_f32) {
        const __m256 sc = _mm256_maskload_ps(d->scale + j0, m);
        const __m256 bi = d->bias ? _mm256_maskload_ps(d->bias + j0, m) : _mm256_setzero_ps();
        const __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, bi);
        if (n >= 8) _mm256_storeu_ps(d->c_f32 + at, y);
        else _mm256_maskstore_ps(d->c_f32 + at, m, y);
    } else if (n >= 8) {
        _mm256_storeu_si256((__m256i *)(d->c_i32 + at), s);
    } else {
        _mm256_maskstore_epi32(d->c_i32 + at, m, s);
    }
}

/* acc[r] += rows[r][4g .. 4g + n) times group g of a half panel (8 columns): the half's 32 weight bytes
 * sign-extended into two vectors of 4 columns (0, 1 | 2, 3 and 4, 5 | 6, 7), each row's 4 codes zero-extended
 * and repeated twice per 128-bit lane, so vpmaddwd leaves a column's four products in two adjacent lanes. */
QA_TARGET QA_INLINE void dense_group_avx2(__m256i acc[QA_ROWS][2], const uint8_t *const *rows, const int8_t *half,
                                          int g, const int n) {
    const __m128i *src = (const __m128i *)(half + (size_t)g * 64);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_load_si128(src)), w1 = _mm256_cvtepi8_epi16(_mm_load_si128(src + 1));
#pragma GCC unroll 6
    for (int r = 0; r < QA_ROWS; r++) {
        const __m256i a = _mm256_unpacklo_epi8(_mm256_set1_epi32((int)load_u32(rows[r] + 4 * (size_t)g, n)),
                                               _mm256_setzero_si256());
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(a, w0));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(a, w1));
    }
}

/* Rows rows[0 .. R) (past nrows the first again, never stored) times columns 8 h .. 8 h + 7 of panel p. */
QA_TARGET QA_INLINE void dense_tile_avx2(const QGemmDense *d, const uint8_t *const *rows, int i0, int nrows, int p,
                                         int h) {
    const QGemmPackedB *b = d->b;
    const int8_t *half = b->data + (size_t)p * b->k_groups * 64 + 32 * h; /* [k_groups] 32 of 64 bytes */
    __m256i acc[QA_ROWS][2];
#pragma GCC unroll 6
    for (int r = 0; r < QA_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int full = b->k / 4;
    for (int g = 0; g < full; g++) dense_group_avx2(acc, rows, half, g, 4); /* constant-size loads */
    if (b->k % 4) dense_group_avx2(acc, rows, half, full, b->k % 4);  /* without reading past a row's end */
    const int j0 = p * QGEMM_LANES + 8 * h;
#pragma GCC unroll 6
    for (int r = 0; r < QA_ROWS; r++)
        if (r < nrows) dense_store8(d, pair_sums(acc[r][0], acc[r][1]), i0 + r, j0, b->n - j0);
}

/* The same with vpdpbusd: both halves of panel p at once. */
QV_TARGET QA_INLINE void dense_group_avxvnni(__m256i acc[QA_ROWS][2], const uint8_t *const *rows, const int8_t *panel,
                                             int g, const int n) {
    const __m256i w0 = _mm256_load_si256((const __m256i *)(panel + (size_t)g * 64));
    const __m256i w1 = _mm256_load_si256((const __m256i *)(panel + (size_t)g * 64 + 32));
#pragma GCC unroll 6
    for (int r = 0; r < QA_ROWS; r++) {
        const __m256i a = _mm256_set1_epi32((int)load_u32(rows[r] + 4 * (size_t)g, n));
        acc[r][0] = _mm256_dpbusd_avx_epi32(acc[r][0], a, w0);
        acc[r][1] = _mm256_dpbusd_avx_epi32(acc[r][1], a, w1);
    }
}

QV_TARGET QA_INLINE void dense_tile_avxvnni(const QGemmDense *d, const uint8_t *const *rows, int i0, int nrows,
                                            int p) {
    const QGemmPackedB *b = d->b;
    const int8_t *panel = b->data + (size_t)p * b->k_groups * 64; /* [k_groups][64] */
    __m256i acc[QA_ROWS][2];
#pragma GCC unroll 6
    for (int r = 0; r < QA_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int full = b->k / 4;
    for (int g = 0; g < full; g++) dense_group_avxvnni(acc, rows, panel, g, 4);
    if (b->k % 4) dense_group_avxvnni(acc, rows, panel, full, b->k % 4);
    const int j0 = p * QGEMM_LANES;
#pragma GCC unroll 6
    for (int r = 0; r < QA_ROWS; r++) {
        if (r >= nrows) continue;
        dense_store8(d, acc[r][0], i0 + r, j0, b->n - j0);
        if (b->n > j0 + 8) dense_store8(d, acc[r][1], i0 + r, j0 + 8, b->n - j0 - 8);
    }
}

/* The row pointers of the tile at row i (nr rows): rows past the end repeat the first. */
static void tile_rows(const uint8_t **rows, const QGemmDense *d, int i, int nr) {
    for (int r = 0; r < QA_ROWS; r++) rows[r] = d->a + (size_t)(i + (r < nr ? r : 0)) * d->lda;
}

static int clip(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

QA_TARGET void qgemm_dense_avx2(const QGemmDense *d, int row0, int row1, int p0, int p1) {
    row0 = clip(row0, 0, d->m), row1 = clip(row1, row0, d->m);
    p0 = clip(p0, 0, d->b->panels), p1 = clip(p1, p0, d->b->panels);
    /* a panel stays in L1 while every row of the range passes */
    for (int p = p0; p < p1; p++)
        for (int i = row0; i < row1; i += QA_ROWS) {
            const uint8_t *rows[QA_ROWS];
            const int nr = row1 - i < QA_ROWS ? row1 - i : QA_ROWS;
            tile_rows(rows, d, i, nr);
            dense_tile_avx2(d, rows, i, nr, p, 0);
            if (d->b->n > p * QGEMM_LANES + 8) dense_tile_avx2(d, rows, i, nr, p, 1);
        }
}

QV_TARGET void qgemm_dense_avxvnni(const QGemmDense *d, int row0, int row1, int p0, int p1) {
    row0 = clip(row0, 0, d->m), row1 = clip(row1, row0, d->m);
    p0 = clip(p0, 0, d->b->panels), p1 = clip(p1, p0, d->b->panels);
    for (int p = p0; p < p1; p++)
        for (int i = row0; i < row1; i += QA_ROWS) {
            const uint8_t *rows[QA_ROWS];
            const int nr = row1 - i < QA_ROWS ? row1 - i : QA_ROWS;
            tile_rows(rows, d, i, nr);
            dense_tile_avxvnni(d, rows, i, nr, p);
        }
}

/* 4 int16 weights as one int64 (memcpy: the array is int16_t, read without type punning) */
static inline int64_t load_i64(const int16_t *p) {
    int64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---- taps ------------------------------------------------------------------------------------------------------ */

/* P pixels' sums of row block rb (wb: its [T][8][4] int16 weights), the pixels' int16 codes from a (pixel p of
 * tap t at a[4 (off[t] + p)]): per tap, the 8 rows' weights are two vectors (rows 0-3, 4-7: each row's 4 in two
 * int32 lanes) and each pixel's 4 codes one broadcast, so a tap costs P + 2 loads for 2 P vpmaddwd (the rows as
 * broadcasts against 4 pixels cost 9 for 8). px[p] = pixel p's 8 sums, rows 0 1 4 5 | 2 3 6 7 (vphaddd's order).
 * 2 P accumulators: P = 6 fills the 16 registers, which gcc 12 manages without spilling only in a function of
 * its own and without partial redundancy elimination (the Makefile builds this file with -fno-tree-pre). */
QA_TARGET static inline __attribute__((always_inline)) void taps_group_avx2(__m256i *px, const int16_t *a,
                                                                            const int16_t *wb, const int32_t *off,
                                                                            int T, const int P) {
    __m256i acc[6][2];
#pragma GCC unroll 6
    for (int p = 0; p < P; p++) acc[p][0] = acc[p][1] = _mm256_setzero_si256();
    for (int t = 0; t < T; t++) {
        const int16_t *at = a + 4 * (size_t)off[t];
        const __m256i w0 = _mm256_load_si256((const __m256i *)(wb + 32 * t));
        const __m256i w1 = _mm256_load_si256((const __m256i *)(wb + 32 * t + 16));
#pragma GCC unroll 6
        for (int p = 0; p < P; p++) {
            const __m256i x = _mm256_set1_epi64x(load_i64(at + 4 * p));
            acc[p][0] = _mm256_add_epi32(acc[p][0], _mm256_madd_epi16(x, w0));
            acc[p][1] = _mm256_add_epi32(acc[p][1], _mm256_madd_epi16(x, w1));
        }
    }
#pragma GCC unroll 6
    for (int p = 0; p < P; p++) px[p] = _mm256_hadd_epi32(acc[p][0], acc[p][1]);
}

/* A vector's 16 pixels as 6 + 6 + 4. */
QA_TARGET __attribute__((noinline)) static void taps_group6_avx2(__m256i *px, const int16_t *a, const int16_t *wb,
                                                                 const int32_t *off, int T) {
    taps_group_avx2(px, a, wb, off, T, 6);
}

QA_TARGET __attribute__((noinline)) static void taps_group4_avx2(__m256i *px, const int16_t *a, const int16_t *wb,
                                                                 const int32_t *off, int T) {
    taps_group_avx2(px, a, wb, off, T, 4);
}

/* 8 pixels' sums (px, rows in vphaddd's order) -> sums[row][l0 .. l0 + 7]: an 8 x 8 transpose whose output j is
 * row 0 1 4 5 2 3 6 7 [j]. */
QA_TARGET static void taps_transpose_avx2(int32_t (*sums)[QGEMM_LANES], const __m256i *px, int l0) {
    static const int ROW[8] = {0, 1, 4, 5, 2, 3, 6, 7};
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2)
        t[i] = _mm256_unpacklo_epi32(px[i], px[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(px[i], px[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]), u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_si256((__m256i *)(sums[ROW[j]] + l0), _mm256_permute2x128_si256(u[j], u[j + 4], 0x20));
        _mm256_storeu_si256((__m256i *)(sums[ROW[j + 4]] + l0), _mm256_permute2x128_si256(u[j], u[j + 4], 0x31));
    }
}

/* sums [8][16] = the uncorrected wrapped sums of row block rb (all 8 rows, padding rows' weights 0), vector v,
 * from the widened codes, 6 + 6 + 4 pixels. */
QA_TARGET static void taps_sums_avx2(int32_t (*sums)[QGEMM_LANES], const QGemmTaps *g, int rb, int v) {
    const int T = g->w->taps;
    const int16_t *wb = g->w->wide + (size_t)rb * T * QGEMM_ROWS * 4; /* [T][8][4] int16 */
    const int16_t *a = g->act_wide + (size_t)v * QGEMM_LANES * 4;
    __m256i px[QGEMM_LANES];
    taps_group6_avx2(px, a, wb, g->tap_off, T);
    taps_group6_avx2(px + 6, a + 24, wb, g->tap_off, T);
    taps_group4_avx2(px + 12, a + 48, wb, g->tap_off, T);
    taps_transpose_avx2(sums, px, 0);
    taps_transpose_avx2(sums, px + 8, 8);
}

/* dst[i] = src[i] for i in [i0, i1): the codes as int16. */
QA_TARGET static void widen_codes(int16_t *dst, const uint8_t *src, size_t i0, size_t i1) {
    size_t i = i0;
    for (; i + 16 <= i1; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < i1; i++) dst[i] = src[i];
}

QV_TARGET static void taps_sums_avxvnni(int32_t (*sums)[QGEMM_LANES], const QGemmTaps *g, int rb, int v) {
    const int T = g->w->taps;
    const int32_t *wb = g->w->data + (size_t)rb * T * QGEMM_ROWS; /* [T][8] */
    const uint8_t *base = g->act + (size_t)v * 64;
    for (int half = 0; half < 2; half++) { /* pixels 8 half .. + 7 */
        __m256i acc[QGEMM_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < QGEMM_ROWS; r++) acc[r] = _mm256_setzero_si256();
        for (int t = 0; t < T; t++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(base + 4 * (size_t)g->tap_off[t] + 32 * half));
#pragma GCC unroll 8
            for (int r = 0; r < QGEMM_ROWS; r++)
                acc[r] = _mm256_dpbusd_avx_epi32(acc[r], a, _mm256_set1_epi32(wb[t * QGEMM_ROWS + r]));
        }
#pragma GCC unroll 8
        for (int r = 0; r < QGEMM_ROWS; r++) _mm256_storeu_si256((__m256i *)(sums[r] + 8 * half), acc[r]);
    }
}

/* taps_compress[m]: the lanes set in the 8-bit mask m, in order, then zeros (vpermps indices that move a half's
 * output lanes to its front). Built once: a loop per vector, each row block again, cost as much as the stores. */
static uint8_t taps_compress[256][8];
static pthread_once_t taps_compress_once = PTHREAD_ONCE_INIT;

static void taps_compress_init(void) {
    for (int m = 0; m < 256; m++) {
        int n = 0;
        for (int l = 0; l < 8; l++)
            if (m >> l & 1) taps_compress[m][n++] = (uint8_t)l;
    }
}

/* Row block rb's outputs of vector v from its sums: y = fmaf((float)(sum - corr), scale, bias), relu'd
 * (max(y, 0): 0 unless y > 0, a NaN included, as nn's relu) for the relu epilogues; stored to the vector's output
 * lanes, or whole to the pool buffer. */
QA_TARGET static void taps_out(const QGemmTaps *g, int rb, int v, int32_t (*sums)[QGEMM_LANES]) {
    const bool relu = g->epi != QGEMM_EPI_NONE, pool = g->epi == QGEMM_EPI_RELU_POOL2;
    const unsigned m = pool ? 0xFFFF : g->vec_mask[v];
    if (!m) return;
    /* a partial vector: each half's output lanes moved to its front (vpermps), then stored under a mask of its
     * count, the second half after the first's; once per vector, for its 8 rows */
    __m256i pick[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, keep[2] = {pick[0], pick[0]};
    int n_lo = 0;
    if (m != 0xFFFF)
        for (int h = 0; h < 2; h++) {
            const unsigned mh = m >> (8 * h) & 0xFFu;
            const int n = __builtin_popcount(mh);
            if (!h) n_lo = n;
            pick[h] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)taps_compress[mh]));
            keep[h] = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        }
    for (int s = 0; s < QGEMM_ROWS; s++) {
        const int r = rb * QGEMM_ROWS + s;
        if (r >= g->w->rows) break;
        const __m256i corr = _mm256_set1_epi32((int32_t)((uint32_t)g->a_zero * (uint32_t)g->w->row_sum[r]));
        const __m256 sc = _mm256_set1_ps(g->scale[r]), bi = _mm256_set1_ps(g->bias ? g->bias[r] : 0.0f);
        __m256 y[2];
        for (int h = 0; h < 2; h++) {
            const __m256i x = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(sums[s] + 8 * h)), corr);
            y[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(x), sc, bi);
            if (relu) y[h] = _mm256_max_ps(y[h], _mm256_setzero_ps());
        }
        float *dst = pool ? g->pool_buf + ((size_t)s * g->n_vec + v) * QGEMM_LANES
                          : g->out + (size_t)r * g->ldo + g->vec_pos[v];
        if (m == 0xFFFF) {
            _mm256_storeu_ps(dst, y[0]), _mm256_storeu_ps(dst + 8, y[1]);
        } else { /* the output lanes in order; nothing else written */
            _mm256_maskstore_ps(dst, keep[0], _mm256_permutevar8x32_ps(y[0], pick[0]));
            _mm256_maskstore_ps(dst + n_lo, keep[1], _mm256_permutevar8x32_ps(y[1], pick[1]));
        }
    }
}

/* The 2x2 windows of row block rb's relu'd outputs in the pool buffer -> out. The values are >= +0 and never
 * NaN, so any order of the maxima gives the bits pool2x2_window picks. 8 windows at a time: the two rows'
 * maximum, then the even and the odd columns'. */
QA_TARGET static void taps_pool_avx2(const QGemmTaps *g, int rb) {
    const int PW = g->pool_w;
    for (int s = 0; s < QGEMM_ROWS && rb * QGEMM_ROWS + s < g->w->rows; s++) {
        const float *src = g->pool_buf + (size_t)s * g->n_vec * QGEMM_LANES; /* (pixels) */
        float *dst = g->out + (size_t)(rb * QGEMM_ROWS + s) * g->ldo;         /* (pool_h, PW) */
        for (int i = 0; i < g->pool_h; i++, dst += PW) {
            const float *a = src + (size_t)2 * i * g->pitch, *b = a + g->pitch;
            int j = 0;
            for (; j + 8 <= PW; j += 8) { /* pixels 2 j .. 2 j + 15 < 2 PW <= pitch: inside the row */
                const __m256 x0 = _mm256_max_ps(_mm256_loadu_ps(a + 2 * j), _mm256_loadu_ps(b + 2 * j));
                const __m256 x1 = _mm256_max_ps(_mm256_loadu_ps(a + 2 * j + 8), _mm256_loadu_ps(b + 2 * j + 8));
                /* windows 0 1 4 5 | 2 3 6 7, then in order */
                const __m256 y = _mm256_max_ps(_mm256_shuffle_ps(x0, x1, 0x88), _mm256_shuffle_ps(x0, x1, 0xDD));
                _mm256_storeu_ps(dst + j, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(y), 0xD8)));
            }
            for (; j < PW; j++) {
                const float x0 = a[2 * j] > a[2 * j + 1] ? a[2 * j] : a[2 * j + 1];
                const float x1 = b[2 * j] > b[2 * j + 1] ? b[2 * j] : b[2 * j + 1];
                dst[j] = x0 > x1 ? x0 : x1;
            }
        }
    }
}

/* The ranges clipped as the portable kernel clips them (the pool epilogue takes every vector). */
static void taps_ranges(const QGemmTaps *g, int *rb0, int *rb1, int *v0, int *v1) {
    const bool pool = g->epi == QGEMM_EPI_RELU_POOL2;
    *rb0 = clip(*rb0, 0, g->w->row_blocks), *rb1 = clip(*rb1, *rb0, g->w->row_blocks);
    *v0 = pool ? 0 : clip(*v0, 0, g->n_vec), *v1 = pool ? g->n_vec : clip(*v1, *v0, g->n_vec);
}

/* The sums of one row block and vector, for the two families. */
typedef void (*TapsSumsFn)(int32_t (*sums)[QGEMM_LANES], const QGemmTaps *g, int rb, int v);

/* Every row block and vector of the clipped ranges through sums_fn, then the epilogue. (A call per block of 8
 * rows x 16 pixels: the kernels, not this loop, carry the target attributes.) */
static void taps_run(const QGemmTaps *g, int rb0, int rb1, int v0, int v1, TapsSumsFn sums_fn) {
    _Alignas(32) int32_t sums[QGEMM_ROWS][QGEMM_LANES];
    pthread_once(&taps_compress_once, taps_compress_init);
    taps_ranges(g, &rb0, &rb1, &v0, &v1);
    for (int rb = rb0; rb < rb1; rb++) {
        for (int v = v0; v < v1; v++) {
            if (g->epi != QGEMM_EPI_RELU_POOL2 && !g->vec_mask[v]) continue;
            sums_fn(sums, g, rb, v);
            taps_out(g, rb, v, sums);
        }
        if (g->epi == QGEMM_EPI_RELU_POOL2) taps_pool_avx2(g, rb);
    }
}

/* The codes the vectors [v0, v1) read widened once (every row block reads them again), then the row blocks. */
void qgemm_taps_avx2(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    if (!g->act_wide) {
        qgemm_taps_portable(g, rb0, rb1, v0, v1);
        return;
    }
    taps_ranges(g, &rb0, &rb1, &v0, &v1);
    if (rb0 == rb1 || v0 == v1) return;
    int32_t lo = g->tap_off[0], hi = lo;
    for (int t = 1; t < g->w->taps; t++)
        lo = g->tap_off[t] < lo ? g->tap_off[t] : lo, hi = g->tap_off[t] > hi ? g->tap_off[t] : hi;
    widen_codes(g->act_wide, g->act, 4 * ((size_t)lo + (size_t)v0 * QGEMM_LANES),
                4 * ((size_t)hi + (size_t)v1 * QGEMM_LANES));
    taps_run(g, rb0, rb1, v0, v1, taps_sums_avx2);
}

void qgemm_taps_avxvnni(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    taps_run(g, rb0, rb1, v0, v1, taps_sums_avxvnni);
}

/* ---- depthwise ------------------------------------------------------------------------------------------------- */

/* The weight pair of kernel row r, columns 2 p and 2 p + 1 (0 past kw) of channel oc: two int16 in an int32, the
 * operand of vpmaddwd against two consecutive codes. */
static inline int32_t dw_pair(const QGemmPackedDw *w, int oc, int r, int p) {
    const uint32_t q = (uint32_t)w->data[((size_t)oc * w->kh + r) * w->kq + (size_t)p / 2] >> (16 * (p % 2));
    const uint32_t lo = (uint16_t)(int16_t)(int8_t)(uint8_t)q, hi = (uint16_t)(int16_t)(int8_t)(uint8_t)(q >> 8);
    return (int32_t)(lo | hi << 16);
}

/* y = fmaf((float)(sum - corr), scale, bias), relu'd if asked, to out [n <= 8]. */
QA_TARGET QA_INLINE void dw_store8(float *out, __m256i sum, __m256i corr, __m256 sc, __m256 bi, bool relu, int n) {
    __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum, corr)), sc, bi);
    if (relu) y = _mm256_max_ps(y, _mm256_setzero_ps()); /* nn's relu: see taps_out */
    if (n >= 8) _mm256_storeu_ps(out, y);
    else if (n > 0) _mm256_maskstore_ps(out, lane_mask8(n), y);
}

/* Chunk j (16 padded columns from 16 j) of every padded row of an input row: lane l takes byte l - lo of a 16-byte
 * load at the chunk's first column inside the input, where lo <= l < hi, else a_zero. */
typedef struct {
    long lo, hi;
    __m128i ctl, outside; /* the shuffle's control (negative: zero); the lanes outside, all ones */
} DwChunk;

QA_TARGET static DwChunk dw_chunk(const QGemmDw *d, size_t j) {
    const long c0 = (long)j - d->pad_l; /* the input column of lane 0 */
    DwChunk k = {.lo = c0 < 0 ? -c0 : 0, .hi = d->in_w - c0 < 16 ? d->in_w - c0 : 16};
    if (k.hi <= k.lo) return k; /* no lane inside: not loaded */
    const __m128i lane = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i in = _mm_andnot_si128(_mm_cmpgt_epi8(_mm_set1_epi8((char)k.lo), lane),
                                        _mm_cmpgt_epi8(_mm_set1_epi8((char)k.hi), lane)); /* lo <= l < hi */
    k.outside = _mm_xor_si128(in, _mm_set1_epi8(-1));
    k.ctl = _mm_or_si128(_mm_and_si128(in, _mm_sub_epi8(lane, _mm_set1_epi8((char)k.lo))), k.outside); /* -1: zero */
    return k;
}

/* The padded rows as int16 (rows, w16), a_zero outside the input, in two parts. The lanes no input code reaches
 * (the rows above and below the input, the chunks of a row past its columns) are the same for every channel of a
 * geometry, so a call writes them once (dw_rows16_pads); then per input channel the chunks that read it
 * (dw_rows16_codes): each chunk of 16 values from one 16-byte load of the input row, a byte shuffle and one
 * widening, stored whole so that the products' loads can follow the stores. ck: the chunks of a row (nc). */
QA_TARGET static void dw_rows16_pads(int16_t *rows16, const QGemmDw *d, size_t rows, size_t w16, const DwChunk *ck,
                                     size_t nc) {
    const __m256i fill = _mm256_set1_epi16((short)d->a_zero);
    for (size_t r = 0; r < rows; r++) {
        const long ih = (long)r - d->pad_t;
        for (size_t c = 0; c < nc; c++)
            if (ih < 0 || ih >= d->in_h || ck[c].hi <= ck[c].lo)
                _mm256_store_si256((__m256i *)(void *)(rows16 + r * w16 + 16 * c), fill);
    }
}

/* The chunks of act's rows (one input channel; n_act: the bytes readable from act on, at least in_h in_w) that
 * read the input, in the rows the outputs reach (rows: a strided conv may leave the input's last rows unread). A
 * load that would pass the readable bytes goes through a copy. */
QA_TARGET static void dw_rows16_codes(int16_t *rows16, const QGemmDw *d, const uint8_t *act, size_t n_act,
                                      size_t rows, size_t w16, const DwChunk *ck, size_t nc) {
    const __m128i fill8 = _mm_set1_epi8((char)d->a_zero);
    for (long ih = 0; ih < d->in_h && (size_t)(ih + d->pad_t) < rows; ih++) {
        int16_t *dst = rows16 + (size_t)(ih + d->pad_t) * w16;
        for (size_t c = 0; c < nc; c++) {
            const DwChunk *k = &ck[c];
            if (k->hi <= k->lo) continue;
            const size_t at = (size_t)ih * d->in_w + (size_t)(16 * (long)c - d->pad_l + k->lo); /* lane lo's byte */
            __m128i x;
            if (at + 16 <= n_act) {
                x = _mm_loadu_si128((const __m128i *)(const void *)(act + at));
            } else {
                uint8_t t[16] = {0};
                memcpy(t, act + at, (size_t)(k->hi - k->lo));
                x = _mm_loadu_si128((const __m128i *)(const void *)t);
            }
            const __m128i b = _mm_or_si128(_mm_shuffle_epi8(x, k->ctl), _mm_and_si128(k->outside, fill8));
            _mm256_store_si256((__m256i *)(void *)(dst + 16 * c), _mm256_cvtepu8_epi16(b));
        }
    }
}

/* One output row of channel oc at stride 1 across, 16 outputs from o0: vpmaddwd of 16 codes against a kernel row's
 * weight pair (2 p, 2 p + 1) broadcast, at o0 + 2 p for the even outputs and o0 + 2 p + 1 for the odd ones (lane j
 * sums the codes at 2 j + 2 p and 2 j + 2 p + 1 from the load's start), interleaved at the end. */
QA_TARGET QA_INLINE void dw_s1_16(const int16_t *top, size_t w16, const int32_t *pairs, const int KH, const int KP,
                                  int o0, float *o, int n, __m256i corr, __m256 sc, __m256 bi, bool relu) {
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int t = 0; t < KH * KP; t++) {
        const int16_t *at = top + (size_t)(t / KP) * w16 + o0 + 2 * (t % KP);
        const __m256i wp = _mm256_set1_epi32(pairs[t]);
        even = _mm256_add_epi32(even, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)at), wp));
        odd = _mm256_add_epi32(odd, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(at + 1)), wp));
    }
    /* outputs 0 2 4 6 8 10 12 14 and 1 3 ... 15: unpacking gives 0 1 2 3 | 8 9 10 11 and 4 5 6 7 | 12 13 14 15 */
    const __m256i lo = _mm256_unpacklo_epi32(even, odd), hi = _mm256_unpackhi_epi32(even, odd);
    dw_store8(o, _mm256_permute2x128_si256(lo, hi, 0x20), corr, sc, bi, relu, n);
    dw_store8(o + 8, _mm256_permute2x128_si256(lo, hi, 0x31), corr, sc, bi, relu, n - 8);
}

/* The same at stride 2 across, 8 outputs from o0: lane j is output o0 + j, its codes at 2 (o0 + j) + 2 p. */
QA_TARGET QA_INLINE void dw_s2_8(const int16_t *top, size_t w16, const int32_t *pairs, const int KH, const int KP,
                                 int o0, float *o, int n, __m256i corr, __m256 sc, __m256 bi, bool relu) {
    __m256i acc = _mm256_setzero_si256(), acc2 = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int t = 0; t < KH * KP; t++) {
        const int16_t *at = top + (size_t)(t / KP) * w16 + 2 * (size_t)o0 + 2 * (t % KP);
        const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)at),
                                            _mm256_set1_epi32(pairs[t]));
        if (t & 1) acc2 = _mm256_add_epi32(acc2, m);
        else acc = _mm256_add_epi32(acc, m);
    }
    dw_store8(o, _mm256_add_epi32(acc, acc2), corr, sc, bi, relu, n);
}

/* Channel oc's outputs (KH, KP constants where the caller knows them). */
QA_TARGET QA_INLINE void dw_channel(const QGemmDw *d, const int16_t *rows16, size_t w16, const int32_t *pairs,
                                    int oc, float *out, const int KH, const int KP) {
    const __m256i corr = _mm256_set1_epi32((int32_t)((uint32_t)d->a_zero * (uint32_t)d->w->sum[oc]));
    const __m256 sc = _mm256_set1_ps(d->scale[oc]), bi = _mm256_set1_ps(d->bias ? d->bias[oc] : 0.0f);
    const int oh_n = d->oh_n, ow_n = d->ow_n;
    const bool relu = d->relu;
    const size_t step = (size_t)d->sh * w16;
    const int16_t *top = rows16; /* the window's first padded row */
    for (int oh = 0; oh < oh_n; oh++, top += step, out += ow_n) {
        if (d->sw == 2)
            for (int o0 = 0; o0 < ow_n; o0 += 8) dw_s2_8(top, w16, pairs, KH, KP, o0, out + o0, ow_n - o0, corr, sc, bi,
                                                          relu);
        else
            for (int o0 = 0; o0 < ow_n; o0 += 16) dw_s1_16(top, w16, pairs, KH, KP, o0, out + o0, ow_n - o0, corr, sc,
                                                            bi, relu);
    }
}

/* The depthwise kernel for strides 1 and 2 across: the padded input rows as int16 (a_zero outside the input: its
 * terms cancel in the correction, a_zero times the channel's weight sum; the padding once a call, each input
 * channel's codes once), each channel's weight pairs once, then per output row and 16 (stride 1) or 8 (stride 2)
 * outputs the products above. With in_plane, each output channel reads its own input channel, one after another
 * in the same rows. The sums wrap like the portable kernel's. */
QA_TARGET void qgemm_dw_avx2(const QGemmDw *d) {
    enum { CHUNKS_MAX = 64 };
    const QGemmPackedDw *w = d->w;
    const int KH = w->kh, KP = (w->kw + 1) / 2;
    const size_t rows = (size_t)(d->oh_n - 1) * d->sh + (size_t)KH, w16 = qgemm_dw_avx2_width(w, d->ow_n, d->sw);
    const size_t nc = w16 / 16;
    if (d->sw > 2 || nc > CHUNKS_MAX) { /* past stride 2 the codes of one output's pair are not where a lane meets
                                         * them; rows of over 1000 columns are not worth a path of their own */
        qgemm_dw_portable(d);
        return;
    }
    int16_t *rows16 = (int16_t *)(void *)d->scratch;        /* (rows, w16) */
    int32_t *pairs = (int32_t *)(void *)(rows16 + rows * w16); /* [KH * KP] */
    DwChunk ck[CHUNKS_MAX];
    for (size_t c = 0; c < nc; c++) ck[c] = dw_chunk(d, 16 * c);
    dw_rows16_pads(rows16, d, rows, w16, ck, nc);
    const size_t plane = (size_t)d->in_h * d->in_w, P = (size_t)d->oh_n * d->ow_n;
    const int inputs = d->in_plane ? d->n_oc : 1, per = d->in_plane ? 1 : d->n_oc; /* output channels an input */
    for (int ci = 0; ci < inputs; ci++) {
        const size_t readable = (size_t)(inputs - 1 - ci) * d->in_plane + plane; /* act's bytes from this channel */
        dw_rows16_codes(rows16, d, d->act + (size_t)ci * d->in_plane, readable, rows, w16, ck, nc);
        for (int i = 0; i < per; i++) {
            const int k = ci * per + i, oc = d->oc0 + k;
            for (int r = 0; r < KH; r++)
                for (int p = 0; p < KP; p++) pairs[r * KP + p] = dw_pair(w, oc, r, p);
            float *out = d->out + (size_t)k * P; /* (oh_n, ow_n) */
            if (KH == 3 && KP == 2) dw_channel(d, rows16, w16, pairs, oc, out, 3, 2); /* 3x3: unrolled */
            else dw_channel(d, rows16, w16, pairs, oc, out, KH, KP);
        }
    }
}

/* ---- quantizing ------------------------------------------------------------------------------------------------ */

typedef struct {
    __m256 s, r, lo, hi, big, edge, absmask;
    __m256 zf, loz, hiz; /* the zero point, lo + zero and hi + zero as floats (exact: integers under 512) */
    __m256i zero;
    bool rcp; /* quotients through r = 1 / s (qgemm_rcp_ok) */
} CodeRegs;

QA_TARGET QA_INLINE CodeRegs code_regs(float s, float lo, float hi, int zero) {
    return (CodeRegs){.s = _mm256_set1_ps(s), .r = _mm256_set1_ps(1.0f / s), .lo = _mm256_set1_ps(lo),
                      .hi = _mm256_set1_ps(hi), .big = _mm256_set1_ps(3.40282347e38f),
                      .edge = _mm256_set1_ps(QGEMM_RCP_EDGE), .zf = _mm256_set1_ps((float)zero),
                      .loz = _mm256_set1_ps(lo + (float)zero), .hiz = _mm256_set1_ps(hi + (float)zero),
                      .zero = _mm256_set1_epi32(zero),
                      .absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), .rcp = qgemm_rcp_ok(s)};
}

/* The codes (int32 lanes, 0..255) of the lanes m of x (masked-off lanes read as 0); *bad gets a lane that is NaN
 * or infinite. */
QA_TARGET QA_INLINE __m256i codes8(const CodeRegs *k, const float *x, __m256i m, bool full, __m256 *bad) {
    const __m256 v = full ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, m);
    *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(_mm256_and_ps(v, k->absmask), k->big, _CMP_NLE_UQ));
    __m256 y;
    if (k->rcp) { /* x r, unless a lane lies near a half (qgemm_rcp_ok) */
        y = _mm256_mul_ps(v, k->r);
        const __m256 i = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 dist = _mm256_and_ps(_mm256_sub_ps(y, i), k->absmask);
        if (_mm256_movemask_ps(_mm256_cmp_ps(dist, k->edge, _CMP_GT_OQ))) y = _mm256_div_ps(v, k->s);
    } else {
        y = _mm256_div_ps(v, k->s);
    }
    /* max returns its second operand when one is NaN: NaN -> lo, as the portable loop does */
    const __m256 q = _mm256_min_ps(_mm256_max_ps(y, k->lo), k->hi);
    return _mm256_add_epi32(_mm256_cvtps_epi32(q), k->zero); /* round to nearest even (MXCSR default) */
}

/* The fast form of codes8 where k->rcp: t = fl(x r + zero), the code before clamping, in one rounding (the fused
 * multiply-add; QGEMM_RCP_EDGE says why it rounds as x / s + zero does), *odd getting the lanes within 2^-12 of a
 * half or not finite (their distance is NaN), for which the caller runs codes8. */
QA_TARGET QA_INLINE __m256 rcp8(const CodeRegs *k, const float *x, __m256i m, bool full, __m256 *odd) {
    const __m256 t = _mm256_fmadd_ps(full ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, m), k->r, k->zf);
    const __m256 i = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    *odd = _mm256_or_ps(*odd, _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(t, i), k->absmask), k->edge, _CMP_NLE_UQ));
    return t;
}

/* The codes of rcp8's t: clamped to [lo + zero, hi + zero], then rounded (the nearest even, MXCSR's default). */
QA_TARGET QA_INLINE __m256i rcp_codes8(const CodeRegs *k, __m256 t) {
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, k->loz), k->hiz));
}

QA_TARGET bool qgemm_quantize_u8_avx2(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero) {
    const CodeRegs k = code_regs(s, lo, hi, zero);
    const __m256i all = _mm256_set1_epi32(-1);
    /* 32 codes -> bytes in one store: the two packs leave dword 4 j + r (per 128-bit lane j) holding codes
     * 8 r + 4 j .. + 3 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 bad = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i c0, c1, c2, c3;
        __m256 odd = _mm256_setzero_ps();
        if (k.rcp) { /* one test for the 32 values: where none is odd, no division and no finiteness test */
            const __m256 y0 = rcp8(&k, x + i, all, true, &odd), y1 = rcp8(&k, x + i + 8, all, true, &odd);
            const __m256 y2 = rcp8(&k, x + i + 16, all, true, &odd), y3 = rcp8(&k, x + i + 24, all, true, &odd);
            c0 = rcp_codes8(&k, y0), c1 = rcp_codes8(&k, y1), c2 = rcp_codes8(&k, y2), c3 = rcp_codes8(&k, y3);
        }
        if (!k.rcp || _mm256_movemask_ps(odd)) {
            c0 = codes8(&k, x + i, all, true, &bad), c1 = codes8(&k, x + i + 8, all, true, &bad);
            c2 = codes8(&k, x + i + 16, all, true, &bad), c3 = codes8(&k, x + i + 24, all, true, &bad);
        }
        const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_permutevar8x32_epi32(b, order));
    }
    for (; i < n; i += 8) {
        const int left = n - i < 8 ? (int)(n - i) : 8;
        _Alignas(32) int32_t c[8];
        _mm256_store_si256((__m256i *)c, codes8(&k, x + i, lane_mask8(left), false, &bad));
        for (int l = 0; l < left; l++) dst[i + l] = (uint8_t)c[l];
    }
    return _mm256_movemask_ps(bad) == 0;
}

QA_TARGET bool qgemm_quantize_u8x4_avx2(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows,
                                        int n, const QGemmCodes *c) {
    const CodeRegs k = code_regs(c->s, c->lo, c->hi, c->zero);
    __m256 bad = _mm256_setzero_ps();
    for (int h = 0; h < rows; h++)
        for (int i = 0; i < n; i += 8) {
            const bool full = n - i >= 8;
            const __m256i m = lane_mask8(n - i);
            const size_t at = (size_t)h * ldx + (size_t)i;
            __m256i d = _mm256_setzero_si256();
            __m256 odd = _mm256_setzero_ps();
            if (k.rcp) { /* as qgemm_quantize_u8_avx2: one test for the four */
#pragma GCC unroll 4
                for (int b = 0; b < 4; b++) {
                    const __m256i u = x[b] ? rcp_codes8(&k, rcp8(&k, x[b] + at, m, full, &odd)) : k.zero;
                    d = _mm256_or_si256(d, _mm256_slli_epi32(u, 8 * b));
                }
            }
            if (!k.rcp || _mm256_movemask_ps(odd)) {
                d = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int b = 0; b < 4; b++) {
                    const __m256i u = x[b] ? codes8(&k, x[b] + at, m, full, &bad) : k.zero;
                    d = _mm256_or_si256(d, _mm256_slli_epi32(u, 8 * b));
                }
            }
            uint32_t *o = dst + (size_t)h * ldd + (size_t)i;
            if (full) _mm256_storeu_si256((__m256i *)o, d);
            else _mm256_maskstore_epi32((int *)o, m, d);
        }
    return _mm256_movemask_ps(bad) == 0;
}

/* The 16 even bytes of src[0, 32): each lane's evens to its low half, then the two halves together. */
QA_TARGET QA_INLINE __m128i even16(const uint8_t *src) {
    const __m256i pick = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1, 0, 2, 4, 6, 8,
                                          10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(const void *)src), pick);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(v, 0xd8));
}

/* Sixteen dwords at a time (stride s): each source's 16 bytes (s 1) or its even bytes (s 2), interleaved as
 * qgemm_s8_pack_nn_vnni interleaves its rows; a row's last part of fewer than 16 through masked stores. */
QA_TARGET static inline __attribute__((always_inline)) void gather16(uint32_t *o, int left, const uint8_t *const s[4],
                                                                     size_t at, const int stride) {
    __m128i e[4];
    for (int k = 0; k < 4; k++)
        e[k] = stride == 1 ? _mm_loadu_si128((const __m128i *)(const void *)(s[k] + at)) : even16(s[k] + at);
    const __m128i t01l = _mm_unpacklo_epi8(e[0], e[1]), t01h = _mm_unpackhi_epi8(e[0], e[1]);
    const __m128i t23l = _mm_unpacklo_epi8(e[2], e[3]), t23h = _mm_unpackhi_epi8(e[2], e[3]);
    const __m256i lo = _mm256_set_m128i(_mm_unpackhi_epi16(t01l, t23l), _mm_unpacklo_epi16(t01l, t23l));
    const __m256i hi = _mm256_set_m128i(_mm_unpackhi_epi16(t01h, t23h), _mm_unpacklo_epi16(t01h, t23h));
    if (left >= 16) {
        _mm256_storeu_si256((__m256i *)(void *)o, lo);
        _mm256_storeu_si256((__m256i *)(void *)(o + 8), hi);
    } else {
        _mm256_maskstore_epi32((int *)o, lane_mask8(left), lo);
        if (left > 8) _mm256_maskstore_epi32((int *)(o + 8), lane_mask8(left - 8), hi);
    }
}

QA_TARGET void qgemm_interleave_u8x4_avx2(uint32_t *dst, size_t ldd, const uint8_t *const src[4], size_t lds,
                                          int rows, int n) {
    for (int h = 0; h < rows; h++) {
        const size_t at = (size_t)h * lds;
        const uint8_t *s[4] = {src[0] + at, src[1] + at, src[2] + at, src[3] + at};
        for (int i = 0; i < n; i += 16) gather16(dst + (size_t)h * ldd + i, n - i, s, (size_t)i, 1);
    }
}

QA_TARGET void qgemm_gather_u8x4_s2_avx2(uint32_t *dst, const uint8_t *const src[4], const size_t step[4], int rows,
                                         int n) {
    for (int h = 0; h < rows; h++) {
        const uint8_t *s[4] = {src[0] + h * step[0], src[1] + h * step[1], src[2] + h * step[2], src[3] + h * step[3]};
        for (int i = 0; i < n; i += 16) gather16(dst + (size_t)h * n + i, n - i, s, 2 * (size_t)i, 2);
    }
}

#else /* not x86: qgemm_isa() is always portable, so these are never called */

void qgemm_dense_avx2(const QGemmDense *d, int row0, int row1, int p0, int p1) {
    qgemm_dense_portable(d, row0, row1, p0, p1);
}
void qgemm_dense_avxvnni(const QGemmDense *d, int row0, int row1, int p0, int p1) {
    qgemm_dense_portable(d, row0, row1, p0, p1);
}
void qgemm_taps_avx2(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) { qgemm_taps_portable(g, rb0, rb1, v0, v1); }
void qgemm_taps_avxvnni(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    qgemm_taps_portable(g, rb0, rb1, v0, v1);
}
void qgemm_dw_avx2(const QGemmDw *d) { qgemm_dw_portable(d); }
bool qgemm_quantize_u8_avx2(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero) {
    return qgemm_quantize_u8_portable(dst, x, n, s, lo, hi, zero);
}
bool qgemm_quantize_u8x4_avx2(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows, int n,
                              const QGemmCodes *c) {
    return qgemm_quantize_u8x4_portable(dst, ldd, x, ldx, rows, n, c);
}
void qgemm_gather_u8x4_s2_avx2(uint32_t *dst, const uint8_t *const src[4], const size_t step[4], int rows, int n) {
    qgemm_gather_u8x4_portable(dst, src, step, rows, n, 2);
}
void qgemm_interleave_u8x4_avx2(uint32_t *dst, size_t ldd, const uint8_t *const src[4], size_t lds, int rows, int n) {
    qgemm_interleave_u8x4_portable(dst, ldd, src, lds, rows, n);
}

#endif
