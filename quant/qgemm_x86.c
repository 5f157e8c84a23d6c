/* qgemm_x86.c - the AVX-512 VNNI kernels of qgemm.h (vpdpbusd: 4 unsigned
 * times 4 signed bytes summed into each int32 lane, wrapping).
 *
 * Every function here carries a target attribute instead of a compiler
 * flag, so this file builds with the project's flags and the rest of the
 * binary still runs on CPUs without AVX-512; qgemm.c calls these only after
 * qgemm_use_vnni(). Results equal the portable kernels bit for bit: the
 * same packed operands, wrapping int32 sums, the same corrections and one
 * fused multiply-add per float output.
 *
 * Register tiles: QGEMM_ROWS (8) rows x up to 3 vectors of 16 int32 = 24
 * accumulators, plus 3 vector operands and a broadcast, within the 32 zmm
 * registers. Dense: rows of a (4 bytes broadcast) times panels of the packed
 * weight. Taps: rows of the packed weight (4 bytes broadcast) times vectors
 * of activation dwords at each tap's offset; the accumulators start at minus
 * the zero point's correction. The taps' relu + 2x2 max pool epilogue takes
 * the windows in registers when an output row is 1 to 3 whole vectors: one
 * vector, both rows of a window in one 8 x 2 tile; two or three, a tile a
 * row, the upper row's values held until the lower row's tile ends. */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_internal.h"
#include "fqt.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "qgemm_x86_inline.h"

#define QG_V 3          /* vectors per register tile */
#define S8_KB 512       /* qgemm_s8: K per packed block (a multiple of 4) */

static inline uint32_t load_u32(const uint8_t *p, int n) {
    uint32_t v = 0; /* bytes past n stay 0 */
    memcpy(&v, p, (size_t)n);
    return v;
}

/* ---- dense tiles ----------------------------------------------------------------------------------------------- */

/* acc[r][v] += rows[r][4g .. 4g + n) (flipped to unsigned if flip) x group g of each panel. */
QG_TARGET QG_INLINE void dense_group(__m512i acc[QGEMM_ROWS][QG_V], const uint8_t *const *rows, const int8_t *panel,
                                     size_t pstride, int g, int n, const int V, const bool flip) {
    __m512i b[QG_V];
#pragma GCC unroll 3
    for (int v = 0; v < V; v++) b[v] = _mm512_load_si512((const void *)(panel + v * pstride + (size_t)g * 64));
#pragma GCC unroll 8
    for (int r = 0; r < QGEMM_ROWS; r++) {
        __m512i a = _mm512_set1_epi32((int)load_u32(rows[r] + 4 * (size_t)g, n));
        if (flip) a = _mm512_xor_si512(a, _mm512_set1_epi32((int)0x80808080u));
#pragma GCC unroll 3
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], a, b[v]);
    }
}

/* acc[r][v] = sum over k of rows[r][k] (flipped to unsigned if flip) x panel v. Panels pstride bytes apart,
 * k bytes per row, read 4 at a time, the last group without reading past the row's end. */
QG_TARGET QG_INLINE void dense_acc(__m512i acc[QGEMM_ROWS][QG_V], const uint8_t *const *rows, const int8_t *panel,
                                   size_t pstride, int k, const int V, const bool flip) {
#pragma GCC unroll 8
    for (int r = 0; r < QGEMM_ROWS; r++)
#pragma GCC unroll 3
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_si512();
    const int full = k / 4;
    for (int g = 0; g < full; g++) dense_group(acc, rows, panel, pstride, g, 4, V, flip); /* constant-size loads */
    if (k % 4) dense_group(acc, rows, panel, pstride, full, k % 4, V, flip);
}

/* The tile's outputs: rows i0 .. i0 + nrows - 1, panels p .. p + V - 1. add: c_i32 += instead of =. */
QG_TARGET QG_INLINE void dense_epilogue(const QGemmDense *d, __m512i acc[QGEMM_ROWS][QG_V], const int32_t *col_sum,
                                        int i0, int nrows, int p, const int V, bool add) {
    const int n = d->b->n;
    const __m512i az = _mm512_set1_epi32(d->a_zero);
#pragma GCC unroll 3
    for (int v = 0; v < V; v++) {
        const int j0 = (p + v) * QGEMM_LANES;
        const __mmask16 m = lane_mask(n - j0);
        const __m512i corr = _mm512_mullo_epi32(az, _mm512_load_si512((const void *)(col_sum + j0)));
        __m512 sc = _mm512_setzero_ps(), bi = _mm512_setzero_ps();
        if (d->c_f32) {
            sc = _mm512_maskz_loadu_ps(m, d->scale + j0);
            if (d->bias) bi = _mm512_maskz_loadu_ps(m, d->bias + j0);
        }
#pragma GCC unroll 8
        for (int r = 0; r < QGEMM_ROWS; r++) {
            if (r >= nrows) break;
            const size_t at = (size_t)(i0 + r) * d->ldc + j0;
            __m512i s = _mm512_sub_epi32(acc[r][v], corr);
            if (d->c_f32) {
                _mm512_mask_storeu_ps(d->c_f32 + at, m, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, bi));
            } else {
                if (add) s = _mm512_add_epi32(s, _mm512_maskz_loadu_epi32(m, d->c_i32 + at));
                _mm512_mask_storeu_epi32(d->c_i32 + at, m, s);
            }
        }
    }
}

/* Rows [i0, i0 + nrows) with nrows <= 8: rows past the end repeat the first (read, never stored). */
QG_TARGET QG_INLINE void dense_tile(const QGemmDense *d, int i0, int nrows, int p, const int V) {
    const uint8_t *rows[QGEMM_ROWS];
    for (int r = 0; r < QGEMM_ROWS; r++) rows[r] = d->a + (size_t)(i0 + (r < nrows ? r : 0)) * d->lda;
    const QGemmPackedB *b = d->b;
    const size_t pstride = (size_t)b->k_groups * 64;
    __m512i acc[QGEMM_ROWS][QG_V];
    dense_acc(acc, rows, b->data + (size_t)p * pstride, pstride, b->k, V, false);
    dense_epilogue(d, acc, b->col_sum, i0, nrows, p, V, false);
}

QG_TARGET void qgemm_dense_vnni(const QGemmDense *d, int row0, int row1, int p0, int p1) {
    const int panels = d->b->panels;
    row0 = row0 < 0 ? 0 : row0, row1 = row1 > d->m ? d->m : row1;
    p0 = p0 < 0 ? 0 : p0, p1 = p1 > panels ? panels : p1;
    /* a block of 3 panels stays in L1 while every row of the range passes */
    for (int p = p0; p < p1; p += QG_V) {
        const int V = p1 - p < QG_V ? p1 - p : QG_V;
        for (int i = row0; i < row1; i += QGEMM_ROWS) {
            const int nr = row1 - i < QGEMM_ROWS ? row1 - i : QGEMM_ROWS;
            if (V == 3) dense_tile(d, i, nr, p, 3);
            else if (V == 2) dense_tile(d, i, nr, p, 2);
            else dense_tile(d, i, nr, p, 1);
        }
    }
}

/* ---- taps tiles ------------------------------------------------------------------------------------------------ */

/* A row block's epilogue constants, one per row (0 past the last row): the correction a_zero * row_sum (wrapping),
 * the scale and the bias. */
typedef struct {
    int32_t corr[QGEMM_ROWS];
    float scale[QGEMM_ROWS], bias[QGEMM_ROWS];
} TapsRows;

static void taps_rows(TapsRows *k, const QGemmTaps *g, int rb) {
    for (int r = 0; r < QGEMM_ROWS; r++) {
        const int row = rb * QGEMM_ROWS + r;
        const bool in = row < g->w->rows;
        k->corr[r] = in ? (int32_t)((uint32_t)g->a_zero * (uint32_t)g->w->row_sum[row]) : 0;
        k->scale[r] = in ? g->scale[row] : 0.0f;
        k->bias[r] = in && g->bias ? g->bias[row] : 0.0f;
    }
}

/* acc[r][v] = the corrected sums of row block rb, vectors v0 .. v0 + V - 1. The accumulators start at -corr, so
 * they end at the corrected sums (the same wrapped int32). */
QG_TARGET QG_INLINE void taps_acc(__m512i acc[QGEMM_ROWS][QG_V], const QGemmTaps *g, const TapsRows *k, int rb, int v0,
                                  const int V) {
    const int T = g->w->taps;
    const int32_t *wb = g->w->data + (size_t)rb * T * QGEMM_ROWS; /* [T][8] */
    const uint8_t *base = g->act + (size_t)v0 * 64;
#pragma GCC unroll 8
    for (int r = 0; r < QGEMM_ROWS; r++) {
        const __m512i c = _mm512_set1_epi32((int32_t)(0u - (uint32_t)k->corr[r]));
#pragma GCC unroll 3
        for (int v = 0; v < V; v++) acc[r][v] = c;
    }
    for (int t = 0; t < T; t++) {
        const uint8_t *src = base + 4 * (size_t)g->tap_off[t];
        __m512i a[QG_V];
#pragma GCC unroll 3
        for (int v = 0; v < V; v++) a[v] = _mm512_loadu_si512((const void *)(src + 64 * v));
#pragma GCC unroll 8
        for (int r = 0; r < QGEMM_ROWS; r++) {
            const __m512i b = _mm512_set1_epi32(wb[t * QGEMM_ROWS + r]);
#pragma GCC unroll 3
            for (int v = 0; v < V; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], a[v], b);
        }
    }
}

/* y = fmaf((float)sum, scale, bias) of row r, then max(y, 0) if relu: 0 unless y > 0 (the second operand wins
 * ties and NaNs), nn's relu exactly. */
QG_TARGET QG_INLINE __m512 taps_y(const TapsRows *k, int r, __m512i sum, bool relu) {
    const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(k->scale[r]), _mm512_set1_ps(k->bias[r]));
    return relu ? _mm512_max_ps(y, _mm512_setzero_ps()) : y;
}

/* The rows of row block rb that exist. */
static int block_rows(const QGemmTaps *g, int rb) {
    const int n = g->w->rows - rb * QGEMM_ROWS;
    return n < QGEMM_ROWS ? n : QGEMM_ROWS;
}

_Static_assert(QGEMM_ROWS % 4 == 0, "a row block is whole channel quads");

/* Where a tile's outputs go (a constant): floats, or codes plain or by channel quads (QGemmTaps.codes). */
enum { TAPS_FLOATS, TAPS_PLAIN, TAPS_QUADS };

/* The masked lanes m of a vector of 16 dwords (or floats, or int32 codes as bytes), in order, at dst: one store
 * when all are, else packed to the front first (the output lanes of a vector that covers padding columns). */
QG_TARGET QG_INLINE void store_lanes32(uint32_t *dst, __mmask16 m, __m512i x) {
    if (m == 0xFFFF) _mm512_storeu_si512((void *)dst, x);
    else _mm512_mask_storeu_epi32(dst, lane_mask(__builtin_popcount(m)), _mm512_maskz_compress_epi32(m, x));
}

QG_TARGET QG_INLINE void store_lanes_ps(float *dst, __mmask16 m, __m512 y) {
    if (m == 0xFFFF) _mm512_storeu_ps(dst, y);
    else _mm512_mask_storeu_ps(dst, lane_mask(__builtin_popcount(m)), _mm512_maskz_compress_ps(m, y));
}

QG_TARGET QG_INLINE void store_lanes8(uint8_t *dst, __mmask16 m, __m512i x) {
    if (m == 0xFFFF) _mm512_mask_cvtepi32_storeu_epi8(dst, 0xFFFF, x);
    else _mm512_mask_cvtepi32_storeu_epi8(dst, lane_mask(__builtin_popcount(m)), _mm512_maskz_compress_epi32(m, x));
}

/* y plus the residual's lanes m at res (packed from the front, as the outputs are stored: nn_add's sum, whichever
 * operand comes first), relu'd if res_relu. */
QG_TARGET QG_INLINE __m512 taps_res(__m512 y, const float *res, __mmask16 m, bool res_relu) {
    const __m512 r = m == 0xFFFF ? _mm512_loadu_ps(res) : _mm512_maskz_expandloadu_ps(m, res);
    y = _mm512_add_ps(y, r);
    return res_relu ? _mm512_max_ps(y, _mm512_setzero_ps()) : y; /* nn's relu: see taps_y */
}

/* A tile's outputs as codes: rows r of the block at vector v0 + v, plain (each row's bytes) or by quads (rows
 * 4 q .. 4 q + 3 of the block in one dword; rows past the last take the zero point). */
QG_TARGET QG_INLINE void taps_tile_codes(const QGemmTaps *g, const TapsRows *k, const CodeRegs *cr, __mmask16 *bad,
                                         __m512i acc[QGEMM_ROWS][QG_V], int rb, int v0, const int V, const int epi,
                                         const int out) {
    const QGemmCodesOut *co = g->codes;
    const int rows = block_rows(g, rb);
    /* g's fields in locals: the byte stores below may alias any memory, so fields read through g would be loaded
     * again after every store */
    const float *const res = g->res;
    float *const out_f = g->out;
    uint8_t *const dst = co->dst;
    const size_t ldo = g->ldo, quad_plane = co->quad_plane;
    const bool res_relu = g->res_relu, floats_too = g->floats_too;
#pragma GCC unroll 3
    for (int v = 0; v < V; v++) {
        const __mmask16 m = g->vec_mask[v0 + v];
        if (!m) continue;
        const size_t pos = (size_t)g->vec_pos[v0 + v];
        if (out == TAPS_PLAIN) {
#pragma GCC unroll 8
            for (int r = 0; r < QGEMM_ROWS; r++) {
                if (r >= rows) break;
                const size_t at = (size_t)(rb * QGEMM_ROWS + r) * ldo + pos;
                __m512 y = taps_y(k, r, acc[r][v], epi != QGEMM_EPI_NONE);
                if (res) y = taps_res(y, res + at, m, res_relu);
                if (floats_too) store_lanes_ps(out_f + at, m, y);
                store_lanes8(dst + at, m, codes_fast16(cr, y, m, bad));
            }
            continue;
        }
#pragma GCC unroll 2
        for (int q = 0; q < QGEMM_ROWS / 4; q++) {
            if (4 * q >= rows) break;
            __m512i d = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int b = 0; b < 4; b++) {
                const int r = 4 * q + b;
                __m512i c = cr->zero;
                if (r < rows) {
                    const size_t at = (size_t)(rb * QGEMM_ROWS + r) * ldo + pos;
                    __m512 y = taps_y(k, r, acc[r][v], epi != QGEMM_EPI_NONE);
                    if (res) y = taps_res(y, res + at, m, res_relu);
                    if (floats_too) store_lanes_ps(out_f + at, m, y);
                    c = codes_fast16(cr, y, m, bad);
                }
                d = _mm512_or_si512(d, _mm512_slli_epi32(c, 8 * b));
            }
            store_lanes32((uint32_t *)(void *)dst + (size_t)(rb * (QGEMM_ROWS / 4) + q) * quad_plane + pos, m, d);
        }
    }
}

/* One register tile: row block rb, vectors v0 .. v0 + V - 1, with the epilogue epi and the outputs' form out
 * (constants). */
QG_TARGET QG_INLINE void taps_tile(const QGemmTaps *g, const TapsRows *k, const CodeRegs *cr, __mmask16 *bad, int rb,
                                   int v0, const int V, const int epi, const int out) {
    __m512i acc[QGEMM_ROWS][QG_V];
    taps_acc(acc, g, k, rb, v0, V);
    if (out != TAPS_FLOATS) {
        taps_tile_codes(g, k, cr, bad, acc, rb, v0, V, epi, out);
        return;
    }
#pragma GCC unroll 8
    for (int r = 0; r < QGEMM_ROWS; r++) {
        const int row = rb * QGEMM_ROWS + r;
        if (row >= g->w->rows) break;
        float *dst = g->out + (size_t)row * g->ldo;
#pragma GCC unroll 3
        for (int v = 0; v < V; v++) {
            __m512 y = taps_y(k, r, acc[r][v], epi != QGEMM_EPI_NONE);
            if (epi == QGEMM_EPI_RELU_POOL2) {
                _mm512_store_ps(g->pool_buf + ((size_t)r * g->n_vec + v0 + v) * QGEMM_LANES, y);
                continue;
            }
            const __mmask16 m = g->vec_mask[v0 + v];
            if (!m) continue;
            float *o = dst + g->vec_pos[v0 + v];
            if (g->res) y = taps_res(y, g->res + (o - g->out), m, g->res_relu);
            store_lanes_ps(o, m, y);
        }
    }
}

/* ---- the 2x2 max pool ------------------------------------------------------------------------------------------ */

/* The relu'd outputs are >= +0 and never NaN, so any order of the maxima gives the bits pool2x2_window picks. */

static const int32_t POOL_EVEN[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const int32_t POOL_ODD[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

/* m [vr] the two window rows' maximum over vr vectors of a row -> dst [PW] the maxima of its column pairs. */
QG_TARGET QG_INLINE void pool_columns(float *dst, const __m512 *m, const int vr, int PW) {
    const __m512i even = _mm512_loadu_si512((const void *)POOL_EVEN), odd = _mm512_loadu_si512((const void *)POOL_ODD);
#pragma GCC unroll 3
    for (int v = 0; v < vr; v += 2) {
        const bool pair = v + 1 < vr;
        const int j = 8 * v, n = PW - j < (pair ? 16 : 8) ? PW - j : pair ? 16 : 8;
        if (n <= 0) break;
        /* the windows j .. j + 15 from two vectors, or j .. j + 7 from a last single one */
        const __m512 y = pair ? _mm512_max_ps(_mm512_permutex2var_ps(m[v], even, m[v + 1]),
                                              _mm512_permutex2var_ps(m[v], odd, m[v + 1]))
                              : _mm512_max_ps(_mm512_permutexvar_ps(even, m[v]), _mm512_permutexvar_ps(odd, m[v]));
        _mm512_mask_storeu_ps(dst + j, lane_mask(n), y);
    }
}

/* Output rows of vr vectors each (pitch 16 vr): pooled row i of row block rb. One vector a row: both window rows
 * in one tile. Two or three: a tile a row, the upper row's values held (in top) until the lower row's arrive. */
QG_TARGET QG_INLINE void taps_pool_row(const QGemmTaps *g, const TapsRows *k, int rb, int i, const int vr) {
    __m512i acc[QGEMM_ROWS][QG_V];
    __m512 top[QGEMM_ROWS][QG_V];
    const int rows = block_rows(g, rb);
    if (vr > 1) {
        taps_acc(acc, g, k, rb, 2 * i * vr, vr);
#pragma GCC unroll 8
        for (int r = 0; r < QGEMM_ROWS; r++)
#pragma GCC unroll 3
            for (int v = 0; v < vr; v++) top[r][v] = taps_y(k, r, acc[r][v], true);
    }
    taps_acc(acc, g, k, rb, (2 * i + 1) * vr - (vr == 1), vr == 1 ? 2 : vr);
#pragma GCC unroll 8
    for (int r = 0; r < QGEMM_ROWS; r++) {
        if (r >= rows) break;
        __m512 m[QG_V];
        if (vr == 1) {
            m[0] = _mm512_max_ps(taps_y(k, r, acc[r][0], true), taps_y(k, r, acc[r][1], true));
        } else {
#pragma GCC unroll 3
            for (int v = 0; v < vr; v++) m[v] = _mm512_max_ps(top[r][v], taps_y(k, r, acc[r][v], true));
        }
        pool_columns(g->out + (size_t)(rb * QGEMM_ROWS + r) * g->ldo + (size_t)i * g->pool_w, m, vr, g->pool_w);
    }
}

/* Any pitch: the relu'd outputs of row block rb in the pool buffer (taps_tile), then 16 windows of a row at a time
 * from there: the two rows' maximum, then the even and the odd columns'. */
QG_TARGET static void taps_pool_buffer(const QGemmTaps *g, int rb) {
    const __m512i even = _mm512_loadu_si512((const void *)POOL_EVEN), odd = _mm512_loadu_si512((const void *)POOL_ODD);
    const int PW = g->pool_w, rows = block_rows(g, rb);
    const size_t step = 2 * (size_t)g->pitch; /* floats from one window row to the next */
    for (int j = 0; j < PW; j += QGEMM_LANES) {
        const int n = PW - j < QGEMM_LANES ? PW - j : QGEMM_LANES;
        const __mmask16 m0 = lane_mask(2 * n), m1 = n > 8 ? lane_mask(2 * n - 16) : 0, mo = lane_mask(n);
        for (int s = 0; s < rows; s++) {
            const float *a = g->pool_buf + (size_t)s * g->n_vec * QGEMM_LANES + 2 * (size_t)j; /* (pixels) */
            float *dst = g->out + (size_t)(rb * QGEMM_ROWS + s) * g->ldo + j;                  /* (pool_h, PW) */
            for (int i = 0; i < g->pool_h; i++, a += step, dst += PW) {
                const float *b = a + g->pitch;
                const __m512 x0 = _mm512_max_ps(_mm512_maskz_loadu_ps(m0, a), _mm512_maskz_loadu_ps(m0, b));
                const __m512 x1 = _mm512_max_ps(_mm512_maskz_loadu_ps(m1, a + 16), _mm512_maskz_loadu_ps(m1, b + 16));
                const __m512 y = _mm512_max_ps(_mm512_permutex2var_ps(x0, even, x1),
                                               _mm512_permutex2var_ps(x0, odd, x1));
                _mm512_mask_storeu_ps(dst, mo, y);
            }
        }
    }
}

/* ---- dispatch -------------------------------------------------------------------------------------------------- */

/* Vectors [v0, v1) of row block rb, 3 at a time. */
QG_TARGET QG_INLINE void taps_block(const QGemmTaps *g, const TapsRows *k, const CodeRegs *cr, __mmask16 *bad, int rb,
                                    int v0, int v1, const int epi, const int out) {
    for (int v = v0; v < v1; v += QG_V) {
        const int V = v1 - v < QG_V ? v1 - v : QG_V;
        if (V == 3) taps_tile(g, k, cr, bad, rb, v, 3, epi, out);
        else if (V == 2) taps_tile(g, k, cr, bad, rb, v, 2, epi, out);
        else taps_tile(g, k, cr, bad, rb, v, 1, epi, out);
    }
}

/* Row block rb pooled: in registers when a row is whole vectors (up to 3), else through the pool buffer. */
QG_TARGET static void taps_pool(const QGemmTaps *g, const TapsRows *k, int rb) {
    const int vr = g->pitch % QGEMM_LANES ? 0 : g->pitch / QGEMM_LANES;
    if (vr < 1 || vr > QG_V) {
        taps_block(g, k, NULL, NULL, rb, 0, g->n_vec, QGEMM_EPI_RELU_POOL2, TAPS_FLOATS);
        taps_pool_buffer(g, rb);
        return;
    }
    for (int i = 0; i < g->pool_h; i++) {
        if (vr == 1) taps_pool_row(g, k, rb, i, 1);
        else if (vr == 2) taps_pool_row(g, k, rb, i, 2);
        else taps_pool_row(g, k, rb, i, 3);
    }
}

/* Row blocks [rb0, rb1) with the outputs' form out (a constant). */
QG_TARGET QG_INLINE void taps_run(const QGemmTaps *g, const CodeRegs *cr, __mmask16 *bad, int rb0, int rb1, int v0,
                                  int v1, const int out) {
    for (int rb = rb0; rb < rb1; rb++) {
        TapsRows k;
        taps_rows(&k, g, rb);
        if (g->epi == QGEMM_EPI_RELU_POOL2) taps_pool(g, &k, rb);
        else if (g->epi == QGEMM_EPI_RELU) taps_block(g, &k, cr, bad, rb, v0, v1, QGEMM_EPI_RELU, out);
        else taps_block(g, &k, cr, bad, rb, v0, v1, QGEMM_EPI_NONE, out);
    }
}

QG_TARGET bool qgemm_taps_vnni(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    const int rbs = g->w->row_blocks;
    rb0 = rb0 < 0 ? 0 : rb0, rb1 = rb1 > rbs ? rbs : rb1;
    v0 = v0 < 0 ? 0 : v0, v1 = v1 > g->n_vec ? g->n_vec : v1;
    const QGemmCodesOut *co = g->epi == QGEMM_EPI_RELU_POOL2 ? NULL : g->codes;
    if (!co) {
        taps_run(g, NULL, NULL, rb0, rb1, v0, v1, TAPS_FLOATS);
        return true;
    }
    const CodeRegs cr = code_regs(co->q.s, co->q.lo, co->q.hi, co->q.zero);
    __mmask16 bad = 0;
    if (co->quad_plane) taps_run(g, &cr, &bad, rb0, rb1, v0, v1, TAPS_QUADS);
    else taps_run(g, &cr, &bad, rb0, rb1, v0, v1, TAPS_PLAIN);
    return bad == 0;
}

/* ---- depthwise ------------------------------------------------------------------------------------------------- */

/* The dwords of quad q for output columns v .. v + 15 of every padded row: dst[r * cols] = the codes of input
 * columns ow sw + 4 q - pad_l + 0 .. 3 of input row r - pad_t, a_zero outside the input. Stride 1: one masked
 * load of the row's bytes, its dwords spread over the 128-bit lanes (vpermd) and each lane's 4 overlapping
 * windows picked by one byte shuffle; stride 2: two 16-bit lanes (bytes 0, 1
 * and 2, 3 of the dword) from 32-byte masked loads 2 bytes apart; others one byte at a time. The masks (the lanes
 * inside the input's columns) are the same for every row; a masked load reads no byte outside the row. */
QG_TARGET static void dw_gather_cols(uint32_t *dst, size_t cols, size_t rows, const QGemmDw *d, int q, int v) {
    const __m512i fill = _mm512_set1_epi32((int)((uint32_t)d->a_zero * 0x01010101u));
    const __m256i z = _mm256_set1_epi8((char)d->a_zero);
    const int c4 = v * d->sw + 4 * q - d->pad_l; /* the input column of output column v's first byte */
    for (size_t r = 0; r < rows; r++, dst += cols) {
        const int ih = (int)r - d->pad_t;
        if (ih < 0 || ih >= d->in_h) _mm512_store_si512((void *)dst, fill);
    }
    dst -= rows * cols;
    const size_t r0 = d->pad_t < (int)rows ? (size_t)d->pad_t : rows;
    const size_t r1 = (size_t)d->pad_t + (size_t)d->in_h < rows ? (size_t)d->pad_t + (size_t)d->in_h : rows;
    const uint8_t *row = r0 < r1 ? d->act + (r0 - (size_t)d->pad_t) * d->in_w : d->act; /* input row r0 - pad_t */
    if (d->sw == 1) {
        /* the 19 bytes from c4 in one masked load; 128-bit lane j takes dwords j .. j + 3 of them (bytes 4 j ..
         * 4 j + 15, of which the shuffle reads the first 7) and the byte shuffle makes its dword l of bytes l ..
         * l + 3: columns 4 j + l + 0 .. 3 */
        const __mmask64 m = (__mmask64)dw_cols_mask(c4, d->in_w, 32);
        const __m512i fill64 = _mm512_set1_epi8((char)d->a_zero);
        const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5, 3, 4, 5, 6);
        const __m512i win = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5, 3, 4, 5, 6));
        for (size_t r = r0; r < r1; r++, row += d->in_w) {
            const __m512i x = _mm512_mask_loadu_epi8(fill64, m, row + c4);
            _mm512_store_si512((void *)(dst + r * cols),
                               _mm512_shuffle_epi8(_mm512_permutexvar_epi32(lanes, x), win));
        }
    } else if (d->sw == 2) {
        const __mmask32 m0 = dw_cols_mask(c4, d->in_w, 32), m1 = dw_cols_mask(c4 + 2, d->in_w, 32);
        for (size_t r = r0; r < r1; r++, row += d->in_w) {
            const __m256i lo = _mm256_mask_loadu_epi8(z, m0, row + c4);
            const __m256i hi = _mm256_mask_loadu_epi8(z, m1, row + c4 + 2);
            const __m512i x = _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16);
            _mm512_store_si512((void *)(dst + r * cols), _mm512_or_si512(_mm512_cvtepu16_epi32(lo), x));
        }
    } else {
        for (size_t r = r0; r < r1; r++, row += d->in_w)
            for (int l = 0; l < QGEMM_LANES; l++) {
                uint32_t x = 0;
                for (int k = 0; k < 4; k++) {
                    const int c = c4 + l * d->sw + k;
                    x |= (uint32_t)(c >= 0 && c < d->in_w ? row[c] : d->a_zero) << (8 * k);
                }
                dst[r * cols + (size_t)l] = x;
            }
    }
}

/* Output channel oc's rows from the gathered dwords (KH and KQ constants where the caller knows them): one
 * vpdpbusd per kernel row and quad for 16 output columns, the channel's weight dwords broadcast once, two chains
 * of sums a vector (exact int32 sums, wrapping alike in any order); the first chain starts at minus the zero
 * point's correction, so the two end at the corrected sums. */
QG_TARGET QG_INLINE void dw_dot(const QGemmDw *d, int oc, float *out, size_t cols, size_t plane, const int KH,
                                const int KQ, const bool relu) {
    const int32_t *wc = d->w->data + (size_t)oc * KH * KQ; /* [KH][KQ] */
    const __m512i c0 = _mm512_set1_epi32((int32_t)(0u - (uint32_t)d->a_zero * (uint32_t)d->w->sum[oc]));
    const __m512 sc = _mm512_set1_ps(d->scale[oc]), bi = _mm512_set1_ps(d->bias ? d->bias[oc] : 0.0f);
    const int oh_n = d->oh_n, ow_n = d->ow_n;
    const size_t step = (size_t)d->sh * cols; /* from one output row's window to the next one's */
    for (size_t v = 0; v < cols; v += QGEMM_LANES) {
        const __mmask16 m = lane_mask(ow_n - (int)v);
        const uint32_t *base = d->scratch + v;
        float *o = out + v;
        for (int oh = 0; oh < oh_n; oh++, base += step, o += ow_n) {
            __m512i acc = c0, acc2 = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int t = 0; t < KH * KQ; t++) {
                const int r = t / KQ, q = t % KQ;
                const __m512i a = _mm512_load_si512((const void *)(base + q * plane + r * cols));
                if (t & 1) acc2 = _mm512_dpbusd_epi32(acc2, a, _mm512_set1_epi32(wc[t]));
                else acc = _mm512_dpbusd_epi32(acc, a, _mm512_set1_epi32(wc[t]));
            }
            __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc, acc2)), sc, bi);
            if (relu) y = _mm512_max_ps(y, _mm512_setzero_ps()); /* nn's relu: see taps_y */
            _mm512_mask_storeu_ps(o, m, y);
        }
    }
}

QG_TARGET void qgemm_dw_vnni(const QGemmDw *d) {
    const int KH = d->w->kh, KQ = d->w->kq;
    const size_t cols = ((size_t)d->ow_n + QGEMM_LANES - 1) / QGEMM_LANES * QGEMM_LANES;
    const size_t rows = (size_t)(d->oh_n - 1) * d->sh + (size_t)KH, plane = rows * cols;
    for (int q = 0; q < KQ; q++)
        for (size_t v = 0; v < cols; v += QGEMM_LANES)
            dw_gather_cols(d->scratch + q * plane + v, cols, rows, d, q, (int)v);
    const bool k3 = KH == 3 && KQ == 1; /* 3 kernel rows of up to 4 columns (3x3): the loops unrolled */
    for (int i = 0; i < d->n_oc; i++) {
        float *out = d->out + (size_t)i * d->oh_n * d->ow_n; /* (oh_n, ow_n) */
        if (k3 && d->relu) dw_dot(d, d->oc0 + i, out, cols, plane, 3, 1, true);
        else if (k3) dw_dot(d, d->oc0 + i, out, cols, plane, 3, 1, false);
        else if (d->relu) dw_dot(d, d->oc0 + i, out, cols, plane, KH, KQ, true);
        else dw_dot(d, d->oc0 + i, out, cols, plane, KH, KQ, false);
    }
}

/* ---- quantizing ------------------------------------------------------------------------------------------------ */

QG_TARGET bool qgemm_quantize_u8_vnni(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero) {
    const CodeRegs k = code_regs(s, lo, hi, zero);
    /* 64 codes -> bytes in one store: the two packs leave dword 4 j + r holding codes 16 r + 4 j .. + 3 */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __mmask16 bad = 0;
    size_t i = 0;
    for (; i + 4 * QGEMM_LANES <= n; i += 4 * QGEMM_LANES) {
        __m512i c0, c1, c2, c3;
        __mmask16 odd = 0;
        if (k.rcp) { /* one test for the 64 values: where none is odd, no division and no finiteness test */
            const __m512 y0 = rcp16(&k, x + i, 0xFFFF, &odd), y1 = rcp16(&k, x + i + 16, 0xFFFF, &odd);
            const __m512 y2 = rcp16(&k, x + i + 32, 0xFFFF, &odd), y3 = rcp16(&k, x + i + 48, 0xFFFF, &odd);
            c0 = rcp_codes16(&k, y0), c1 = rcp_codes16(&k, y1), c2 = rcp_codes16(&k, y2), c3 = rcp_codes16(&k, y3);
        }
        if (!k.rcp || odd) {
            c0 = codes16(&k, x + i, 0xFFFF, &bad), c1 = codes16(&k, x + i + 16, 0xFFFF, &bad);
            c2 = codes16(&k, x + i + 32, 0xFFFF, &bad), c3 = codes16(&k, x + i + 48, 0xFFFF, &bad);
        }
        const __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
        _mm512_storeu_si512((void *)(dst + i), _mm512_permutexvar_epi32(order, b));
    }
    for (; i < n; i += QGEMM_LANES) {
        const __mmask16 m = n - i >= QGEMM_LANES ? (__mmask16)0xFFFF : lane_mask((int)(n - i));
        _mm512_mask_cvtepi32_storeu_epi8(dst + i, m, codes16(&k, x + i, m, &bad));
    }
    return bad == 0;
}

QG_TARGET bool qgemm_quantize_u8x4_vnni(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows,
                                        int n, const QGemmCodes *c) {
    const CodeRegs k = code_regs(c->s, c->lo, c->hi, c->zero);
    __mmask16 bad = 0;
    for (int h = 0; h < rows; h++)
        for (int i = 0; i < n; i += QGEMM_LANES) {
            const __mmask16 m = lane_mask(n - i);
            const size_t at = (size_t)h * ldx + (size_t)i;
            __m512i d = _mm512_setzero_si512();
            __mmask16 odd = 0;
            if (k.rcp) { /* as qgemm_quantize_u8_vnni: one test for the four */
#pragma GCC unroll 4
                for (int b = 0; b < 4; b++) {
                    const __m512i u = x[b] ? rcp_codes16(&k, rcp16(&k, x[b] + at, m, &odd)) : k.zero;
                    d = _mm512_or_si512(d, _mm512_slli_epi32(u, 8 * b));
                }
            }
            if (!k.rcp || odd) {
                d = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int b = 0; b < 4; b++) {
                    const __m512i u = x[b] ? codes16(&k, x[b] + at, m, &bad) : k.zero;
                    d = _mm512_or_si512(d, _mm512_slli_epi32(u, 8 * b));
                }
            }
            _mm512_mask_storeu_epi32(dst + (size_t)h * ldd + (size_t)i, m, d);
        }
    return bad == 0;
}

/* ---- int8 x int8 ----------------------------------------------------------------------------------------------- */

/* b's columns [j0, j0 + jn) over k [k0, k0 + kn) (jn <= 48, kn <= S8_KB) -> ceil(jn / 16) panels of kg groups
 * (16 lanes of 4 bytes a group) and each column's sum: each panel's two halves of 8 lanes packed by the AVX2 dword
 * transpose, then the lanes' sums as vpdpbusd of ones against each group. */
QG_TARGET void qgemm_s8_pack_vnni(int8_t *pack, int32_t *sum, const int8_t *b, int K, int j0, int jn, int k0,
                                  int kn, int kg) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int v = 0; v < (jn + QGEMM_LANES - 1) / QGEMM_LANES; v++) { /* the panels the kernels read */
        int8_t *panel = pack + (size_t)v * kg * 64;
        for (int h = 0; h < 2; h++) {
            const int first = v * QGEMM_LANES + 8 * h, n = jn - first;
            qgemm_s8_pack8_nt_avx2(panel + 32 * h, 64, b, K, j0 + first, n < 0 ? 0 : n > 8 ? 8 : n, k0, kn, kg);
        }
        if (!sum) continue; /* the AMX kernels need no sums */
        __m512i cs = _mm512_setzero_si512();
        for (int g = 0; g < kg; g++)
            cs = _mm512_dpbusd_epi32(cs, ones, _mm512_load_si512((const void *)(panel + (size_t)g * 64)));
        _mm512_store_si512((void *)(sum + v * QGEMM_LANES), cs);
    }
}

QG_TARGET QG_INLINE void s8_tile_ld(int32_t *c, int ldc, const int8_t *a, int M, int N, int K, int i0, int j0, int k0,
                                    int kn, const int8_t *pack, const int32_t *sum, int kg, const int V) {
    const int nrows = M - i0 < QGEMM_ROWS ? M - i0 : QGEMM_ROWS;
    const uint8_t *rows[QGEMM_ROWS];
    for (int r = 0; r < QGEMM_ROWS; r++)
        rows[r] = (const uint8_t *)a + (size_t)(i0 + (r < nrows ? r : 0)) * K + k0;
    __m512i acc[QGEMM_ROWS][QG_V];
    dense_acc(acc, rows, pack, (size_t)kg * 64, kn, V, true);
    /* a + 128 was multiplied: subtract 128 * the column sums (a_zero 128 of the dense epilogue) */
    QGemmPackedB pb = {.n = N - j0, .k = kn, .k_groups = kg, .panels = V};
    QGemmDense d = {.a_zero = 128, .b = &pb, .c_i32 = c + j0, .ldc = ldc};
    dense_epilogue(&d, acc, sum, i0, nrows, 0, V, k0 > 0);
}



/* ---- int8 x int8, b as (K, N) ------------------------------------------------------------------------------------
 * qgemm_s8_nn: c (M, N) = a (M, K) b (K, N), b's rows ldb apart, c's ldc. The same tiles as qgemm_s8; only the
 * packing differs: a group's 16 lanes x 4 bytes are 4 rows of b, transposed in registers (qgemm_s8_pack_nn_vnni). */

/* b's row k from its column 0: n <= 64 bytes (the rest 0), all 0 past kn. Masked, so it never reads past n. */
QG_TARGET QG_INLINE __m512i nn_row64(const int8_t *b, int ldb, int k, int kn, int n) {
    if (k >= kn || n <= 0) return _mm512_setzero_si512();
    const __mmask64 m = n >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << n) - 1;
    return _mm512_maskz_loadu_epi8(m, b + (size_t)k * ldb);
}

/* b's columns [j0, j0 + jn) (jn <= 48) over its rows [k0, k0 + kn) -> ceil(jn / 16) panels of kg groups, as
 * qgemm_s8_pack_vnni lays them out, and each column's sum over the rows. A group is 4 rows of up to 64 columns,
 * interleaved within each 128-bit lane (bytes, then pairs: lane l holds columns 16l + 4q .. 16l + 4q + 3 of the
 * q-th result), then the 4 x 4 lanes transposed so that vector v is panel v's 16 columns of 4 bytes. */
QG_TARGET void qgemm_s8_pack_nn_vnni(int8_t *pack, int32_t *sum, const int8_t *b, int ldb, int j0, int jn, int k0,
                                     int kn, int kg) {
    const int V = (jn + QGEMM_LANES - 1) / QGEMM_LANES; /* the panels the kernels read */
    const int8_t *src = b + (size_t)k0 * ldb + j0;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i cs[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                     _mm512_setzero_si512()};
    for (int g = 0; g < kg; g++) {
        const __m512i r0 = nn_row64(src, ldb, 4 * g, kn, jn), r1 = nn_row64(src, ldb, 4 * g + 1, kn, jn);
        const __m512i r2 = nn_row64(src, ldb, 4 * g + 2, kn, jn), r3 = nn_row64(src, ldb, 4 * g + 3, kn, jn);
        const __m512i t01l = _mm512_unpacklo_epi8(r0, r1), t01h = _mm512_unpackhi_epi8(r0, r1);
        const __m512i t23l = _mm512_unpacklo_epi8(r2, r3), t23h = _mm512_unpackhi_epi8(r2, r3);
        const __m512i q0 = _mm512_unpacklo_epi16(t01l, t23l), q1 = _mm512_unpackhi_epi16(t01l, t23l);
        const __m512i q2 = _mm512_unpacklo_epi16(t01h, t23h), q3 = _mm512_unpackhi_epi16(t01h, t23h);
        const __m512i q01l = _mm512_shuffle_i32x4(q0, q1, 0x44), q23l = _mm512_shuffle_i32x4(q2, q3, 0x44);
        const __m512i q01h = _mm512_shuffle_i32x4(q0, q1, 0xEE), q23h = _mm512_shuffle_i32x4(q2, q3, 0xEE);
        const __m512i p[4] = {_mm512_shuffle_i32x4(q01l, q23l, 0x88), _mm512_shuffle_i32x4(q01l, q23l, 0xDD),
                              _mm512_shuffle_i32x4(q01h, q23h, 0x88), _mm512_shuffle_i32x4(q01h, q23h, 0xDD)};
        for (int v = 0; v < V; v++) {
            _mm512_storeu_si512((void *)(pack + ((size_t)v * kg + g) * 64), p[v]);
            if (sum) cs[v] = _mm512_dpbusd_epi32(cs[v], ones, p[v]); /* 1 x each of the column's 4 bytes */
        }
    }
    if (sum)
        for (int v = 0; v < V; v++) _mm512_storeu_si512((void *)(sum + v * QGEMM_LANES), cs[v]);
}

/* c (M, N), rows ldc apart, = a b^T (ldb < 0: b is (N, K)) or a b (b is (K, N), rows ldb apart). */
QG_TARGET static void s8_run(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    _Alignas(64) int8_t pack[QG_V * S8_KB / 4 * 64];   /* 3 panels of the current block: 24 KiB */
    _Alignas(64) int32_t sum[QG_V * QGEMM_LANES];
    for (int j0 = 0; j0 < N; j0 += QG_V * QGEMM_LANES) {
        const int jn = N - j0 < QG_V * QGEMM_LANES ? N - j0 : QG_V * QGEMM_LANES;
        const int V = (jn + QGEMM_LANES - 1) / QGEMM_LANES;
        for (int k0 = 0; k0 < K; k0 += S8_KB) {
            const int kn = K - k0 < S8_KB ? K - k0 : S8_KB, kg = (kn + 3) / 4;
            if (ldb < 0) qgemm_s8_pack_vnni(pack, sum, b, K, j0, jn, k0, kn, kg);
            else qgemm_s8_pack_nn_vnni(pack, sum, b, ldb, j0, jn, k0, kn, kg);
            for (int i = 0; i < M; i += QGEMM_ROWS) {
                if (V == 3) s8_tile_ld(c, ldc, a, M, N, K, i, j0, k0, kn, pack, sum, kg, 3);
                else if (V == 2) s8_tile_ld(c, ldc, a, M, N, K, i, j0, k0, kn, pack, sum, kg, 2);
                else s8_tile_ld(c, ldc, a, M, N, K, i, j0, k0, kn, pack, sum, kg, 1);
            }
        }
    }
}

QG_TARGET void qgemm_s8_vnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    s8_run(c, ldc, a, b, -1, M, N, K);
}

QG_TARGET void qgemm_s8_nn_vnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    s8_run(c, ldc, a, b, ldb, M, N, K);
}

#else /* not x86: qgemm_use_vnni() is always false, so these are never called */

void qgemm_s8_nn_vnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    qgemm_s8_nn_ref(c, ldc, a, b, ldb, M, N, K);
}

void qgemm_dense_vnni(const QGemmDense *d, int row0, int row1, int p0, int p1) {
    qgemm_dense_portable(d, row0, row1, p0, p1);
}
bool qgemm_taps_vnni(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    return qgemm_taps_portable(g, rb0, rb1, v0, v1);
}
void qgemm_dw_vnni(const QGemmDw *d) { qgemm_dw_portable(d); }
bool qgemm_quantize_u8_vnni(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero) {
    return qgemm_quantize_u8_portable(dst, x, n, s, lo, hi, zero);
}
bool qgemm_quantize_u8x4_vnni(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows, int n,
                              const QGemmCodes *c) {
    return qgemm_quantize_u8x4_portable(dst, ldd, x, ldx, rows, n, c);
}
void qgemm_s8_vnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    qgemm_s8_ref_ldc(c, ldc, a, b, M, N, K);
}

#endif
