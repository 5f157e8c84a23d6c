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
 * pairs over padded rows in scratch, strides 1 and 2 across (others
 * portable), see qgemm_dw_avx2.
 * Taps: 8 rows (the packed row block) x 4 pixels (AVX2: each pixel's 4 codes
 * zero-extended, each row's 4 weights broadcast from the packed weight's
 * int16 copy) or x 8 pixels (AVX-VNNI), the sums of a 16-pixel vector
 * gathered in an int32 block, then the epilogue; relu + 2x2 max pool always
 * goes through the pool buffer. */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_internal.h"
#include "fqt.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define QA_TARGET __attribute__((target("avx2,fma")))
#define QV_TARGET __attribute__((target("avx2,fma,avxvnni")))
#define QA_INLINE static inline __attribute__((always_inline))
#define QA_ROWS 6 /* rows of a dense tile */

static inline uint32_t load_u32(const uint8_t *p, int n) {
    uint32_t v = 0; /* bytes past n stay 0 */
    memcpy(&v, p, (size_t)n);
    return v;
}

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

/* sums [8][16] = the uncorrected wrapped sums of row block rb (all 8 rows, padding rows' weights 0), vector v. */
QA_TARGET static void taps_sums_avx2(int32_t (*sums)[QGEMM_LANES], const QGemmTaps *g, int rb, int v) {
    const int T = g->w->taps;
    const int16_t *wb = g->w->wide + (size_t)rb * T * QGEMM_ROWS * 4; /* [T][8][4] int16 */
    const uint8_t *base = g->act + (size_t)v * 64;
    for (int quarter = 0; quarter < 4; quarter++) { /* pixels 4 quarter .. + 3 */
        __m256i acc[QGEMM_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < QGEMM_ROWS; r++) acc[r] = _mm256_setzero_si256();
        for (int t = 0; t < T; t++) {
            /* 4 pixels' 4 codes as int16: pixels 0, 1 | 2, 3 */
            const __m128i raw = _mm_loadu_si128((const __m128i *)(base + 4 * (size_t)g->tap_off[t] + 16 * quarter));
            const __m256i a = _mm256_cvtepu8_epi16(raw);
#pragma GCC unroll 8
            for (int r = 0; r < QGEMM_ROWS; r++)
                acc[r] = _mm256_add_epi32(
                    acc[r], _mm256_madd_epi16(a, _mm256_set1_epi64x(load_i64(wb + (t * QGEMM_ROWS + r) * 4))));
        }
#pragma GCC unroll 8
        for (int r = 0; r < QGEMM_ROWS; r++) /* lanes 2i, 2i + 1 the halves of pixel i: 0 1 | 2 3 after the add */
            _mm_storeu_si128((__m128i *)(sums[r] + 4 * quarter),
                             _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r], acc[r]), 0x08)));
    }
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

/* Row block rb's outputs of vector v from its sums: y = fmaf((float)(sum - corr), scale, bias), relu'd
 * (max(y, 0): 0 unless y > 0, a NaN included, as nn's relu) for the relu epilogues; stored to the vector's output
 * lanes, or whole to the pool buffer. */
QA_TARGET static void taps_out(const QGemmTaps *g, int rb, int v, int32_t (*sums)[QGEMM_LANES]) {
    const bool relu = g->epi != QGEMM_EPI_NONE, pool = g->epi == QGEMM_EPI_RELU_POOL2;
    const unsigned m = pool ? 0xFFFF : g->vec_mask[v];
    if (!m) return;
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
        } else { /* the output lanes in order */
            float tmp[QGEMM_LANES];
            _mm256_storeu_ps(tmp, y[0]), _mm256_storeu_ps(tmp + 8, y[1]);
            for (int l = 0, at = 0; l < QGEMM_LANES; l++)
                if (m >> l & 1) dst[at++] = tmp[l];
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

void qgemm_taps_avx2(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    taps_run(g, rb0, rb1, v0, v1, taps_sums_avx2);
}

void qgemm_taps_avxvnni(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    taps_run(g, rb0, rb1, v0, v1, taps_sums_avxvnni);
}

/* ---- depthwise ------------------------------------------------------------------------------------------------- */

/* Bytes of one padded row in scratch: every column a 16-byte load of qgemm_dw_avx2 reaches. */
static size_t dw_row_bytes(const QGemmDw *d) {
    const size_t cols = ((size_t)d->ow_n + QGEMM_LANES - 1) / QGEMM_LANES * QGEMM_LANES;
    return cols * (size_t)d->sw + 2 * (((size_t)d->w->kw + 1) / 2) + 17;
}

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

/* The depthwise kernel for strides 1 and 2 across (qgemm_dw_avx2 checks): each padded input row once into
 * scratch (a_zero outside the input: its terms cancel in the correction), then per output channel and row,
 * vpmaddwd of 16 codes (as int16) against a kernel row's weight pair (2 p, 2 p + 1) broadcast: lane j sums the
 * codes at 2 j + 2 p and 2 j + 2 p + 1 from the load's start. Stride 2 starts at 2 o0: lane j is output o0 + j,
 * 8 outputs a load. Stride 1 needs two loads a pair, at o0 and o0 + 1, for the even and the odd outputs of 16,
 * interleaved at the end. The sums wrap like the portable kernel's and the correction is a_zero times the
 * channel's weight sum. */
QA_TARGET void qgemm_dw_avx2(const QGemmDw *d) {
    const QGemmPackedDw *w = d->w;
    const int KH = w->kh, KP = (w->kw + 1) / 2;
    const size_t rows = (size_t)(d->oh_n - 1) * d->sh + (size_t)KH, width = dw_row_bytes(d);
    /* past stride 2 the codes of one output's pair are not where a lane meets them; the padded rows fit in
     * qgemm_dw_scratch's bytes for any kernel (16 output columns at least), checked all the same */
    if (d->sw > 2 || rows * width > qgemm_dw_scratch(w, d->oh_n, d->ow_n, d->sh)) {
        qgemm_dw_portable(d);
        return;
    }
    uint8_t *pad = (uint8_t *)d->scratch; /* (rows, width) */
    for (size_t r = 0; r < rows; r++) {
        uint8_t *dst = pad + r * width;
        memset(dst, d->a_zero, width);
        const long ih = (long)r - d->pad_t;
        if (ih < 0 || ih >= d->in_h) continue;
        const long x0 = d->pad_l > 0 ? d->pad_l : 0;
        const long x1 = (long)d->pad_l + d->in_w < (long)width ? (long)d->pad_l + d->in_w : (long)width;
        if (x1 > x0) memcpy(dst + x0, d->act + (size_t)ih * d->in_w + (x0 - d->pad_l), (size_t)(x1 - x0));
    }
    for (int i = 0; i < d->n_oc; i++) {
        const int oc = d->oc0 + i;
        float *out = d->out + (size_t)i * d->oh_n * d->ow_n; /* (oh_n, ow_n) */
        const __m256i corr = _mm256_set1_epi32((int32_t)((uint32_t)d->a_zero * (uint32_t)w->sum[oc]));
        const __m256 sc = _mm256_set1_ps(d->scale[oc]), bi = _mm256_set1_ps(d->bias ? d->bias[oc] : 0.0f);
        for (int oh = 0; oh < d->oh_n; oh++) {
            const uint8_t *top = pad + (size_t)oh * d->sh * width; /* the window's first padded row */
            float *o = out + (size_t)oh * d->ow_n;
            if (d->sw == 2) {
                for (int o0 = 0; o0 < d->ow_n; o0 += 8) {
                    __m256i acc = _mm256_setzero_si256();
                    for (int r = 0; r < KH; r++)
                        for (int p = 0; p < KP; p++) {
                            const __m128i *at = (const __m128i *)(top + (size_t)r * width + 2 * (size_t)o0 + 2 * p);
                            const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128(at));
                            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(a, _mm256_set1_epi32(dw_pair(w, oc, r, p))));
                        }
                    dw_store8(o + o0, acc, corr, sc, bi, d->relu, d->ow_n - o0);
                }
                continue;
            }
            for (int o0 = 0; o0 < d->ow_n; o0 += 16) {
                __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
                for (int r = 0; r < KH; r++)
                    for (int p = 0; p < KP; p++) {
                        const uint8_t *at = top + (size_t)r * width + (size_t)o0 + 2 * p;
                        const __m256i wp = _mm256_set1_epi32(dw_pair(w, oc, r, p));
                        const __m256i a0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)at));
                        const __m256i a1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(at + 1)));
                        even = _mm256_add_epi32(even, _mm256_madd_epi16(a0, wp));
                        odd = _mm256_add_epi32(odd, _mm256_madd_epi16(a1, wp));
                    }
                /* outputs 0 1 2 3 | 8 9 10 11 and 4 5 6 7 | 12 13 14 15, then in order */
                const __m256i lo = _mm256_unpacklo_epi32(even, odd), hi = _mm256_unpackhi_epi32(even, odd);
                dw_store8(o + o0, _mm256_permute2x128_si256(lo, hi, 0x20), corr, sc, bi, d->relu, d->ow_n - o0);
                dw_store8(o + o0 + 8, _mm256_permute2x128_si256(lo, hi, 0x31), corr, sc, bi, d->relu, d->ow_n - o0 - 8);
            }
        }
    }
}

/* ---- quantizing ------------------------------------------------------------------------------------------------ */

typedef struct {
    __m256 s, lo, hi, big, absmask;
    __m256i zero;
} CodeRegs;

QA_TARGET QA_INLINE CodeRegs code_regs(float s, float lo, float hi, int zero) {
    return (CodeRegs){.s = _mm256_set1_ps(s), .lo = _mm256_set1_ps(lo), .hi = _mm256_set1_ps(hi),
                      .big = _mm256_set1_ps(3.40282347e38f), .zero = _mm256_set1_epi32(zero),
                      .absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))};
}

/* The codes (int32 lanes, 0..255) of the lanes m of x (masked-off lanes read as 0); *bad gets a lane that is NaN
 * or infinite. */
QA_TARGET QA_INLINE __m256i codes8(const CodeRegs *k, const float *x, __m256i m, bool full, __m256 *bad) {
    const __m256 v = full ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, m);
    *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(_mm256_and_ps(v, k->absmask), k->big, _CMP_NLE_UQ));
    /* max returns its second operand when one is NaN: NaN -> lo, as the portable loop does */
    const __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v, k->s), k->lo), k->hi);
    return _mm256_add_epi32(_mm256_cvtps_epi32(q), k->zero); /* round to nearest even (MXCSR default) */
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
        const __m256i c0 = codes8(&k, x + i, all, true, &bad), c1 = codes8(&k, x + i + 8, all, true, &bad);
        const __m256i c2 = codes8(&k, x + i + 16, all, true, &bad), c3 = codes8(&k, x + i + 24, all, true, &bad);
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
#pragma GCC unroll 4
            for (int b = 0; b < 4; b++) {
                const __m256i u = x[b] ? codes8(&k, x[b] + at, m, full, &bad) : k.zero;
                d = _mm256_or_si256(d, _mm256_slli_epi32(u, 8 * b));
            }
            uint32_t *o = dst + (size_t)h * ldd + (size_t)i;
            if (full) _mm256_storeu_si256((__m256i *)o, d);
            else _mm256_maskstore_epi32((int *)o, m, d);
        }
    return _mm256_movemask_ps(bad) == 0;
}

/* ---- int8 x int8 (quantized training's qgemm_s8 and qgemm_s8_nn) ---------------------------------------------
 * c (M, N) = a (M, K) b^T (qgemm_s8: b is (N, K)) or a b (qgemm_s8_nn: b is (K, N), rows ldb apart), both signed.
 * Blocks of 8 columns of b over S8A_KB k are packed into groups of 4 k: 32 bytes, column j's 4 bytes at 4 j (a
 * transpose of dwords for b (N, K), of bytes for b (K, N)). Then tiles of QA_ROWS rows of a run over the block,
 * each row's block first copied to scratch in the form the inner loop broadcasts from memory (a load, no shuffle):
 * AVX2: where a's rows or b's block are all >= 0 (activations after a ReLU), the bytes as they are, vpmaddubsw
 * with the unsigned side first and vpmaddwd by ones; otherwise a and the group widened to int16, vpmaddwd (exact
 * products, two per int32 lane, summed pairwise at the end); AVX-VNNI: a + 128 (the sign bit flipped) against the group's bytes, vpdpbusd, minus 128 times the block's
 * column sums. The block's sums go into c (the first k block) or are added to it (wrapping, as the other kernels'
 * sums do). */

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

void qgemm_s8_avx2(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K) {
    s8a_run(c, N, a, b, -1, M, N, K, s8a_prep_avx2, s8a_tiles_avx2);
}
void qgemm_s8_avxvnni(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K) {
    s8a_run(c, N, a, b, -1, M, N, K, s8a_prep_avxvnni, s8a_tiles_avxvnni);
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
void qgemm_s8_avx2(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K) {
    qgemm_s8_ref(c, a, b, M, N, K);
}
void qgemm_s8_avxvnni(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K) {
    qgemm_s8_ref(c, a, b, M, N, K);
}

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

#endif
