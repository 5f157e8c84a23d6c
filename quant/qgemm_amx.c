/* qgemm_amx.c - quantized training's int8 x int8 products (qgemm_s8, qgemm_s8_nn) on AMX tiles: TDPBSSD multiplies
 * a 16 x 64 tile of a's signed bytes by a 64 x 16 tile of b's (4 k of a column per dword, 16 columns a row) into a
 * 16 x 16 tile of int32, wrapping as the other kernels' sums do; exact integers, so the same bits as the portable
 * kernels. Every AMX CPU also has AVX-512 VNNI, whose kernels the family runs for what the tiles do not take.
 *
 * b is packed as the AVX-512 VNNI kernels pack it (qgemm_s8_pack_vnni, _nn_vnni): panels of 16 columns, 64 bytes
 * a group of 4 k, which is a B tile's row; each panel's groups rounded up to a multiple of 16 with zeros so every
 * tile is whole. a's tiles are read in place (rows K bytes apart) where they lie inside a, else from a zero-padded
 * copy. Tile registers: 0-2 the C tiles of three panels, 3 the A tile, 4-6 the B tiles. C lives in c between k
 * blocks (a partial tile through a copy). The tile configuration is loaded per call and released at its end.
 *
 * PTQ's convolution taps run here where they form one strided operand (qgemm_taps_amx, below); the rest of the
 * family's u8 x s8 layers (other taps, dense, depthwise) are the AVX-512 VNNI kernels. */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_internal.h"
#include "fqt.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

#define QM_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))
#define QM_V 3    /* panels (C tiles) per column block */
#define QM_KB 512 /* k per packed block: 8 tile steps of 64 */

/* ldtilecfg's 64-byte operand, palette 1. */
typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileCfg;
_Static_assert(sizeof(TileCfg) == 64, "the tile configuration is 64 bytes");

QM_TARGET static void amx_config(void) {
    _Alignas(64) TileCfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16; /* every tile 16 rows of 64 bytes */
    _tile_loadconfig(&cfg);
}

/* Rows [i, i + 16) of a over k [k, k + 64) as a tile operand: a itself where whole, else tmp [16][64] with zeros
 * past M and K. *stride: the operand's row stride in bytes. */
static const int8_t *a_tile(int8_t *tmp, size_t *stride, const int8_t *a, int M, int K, int i, int k) {
    if (i + 16 <= M && k + 64 <= K) {
        *stride = (size_t)K;
        return a + (size_t)i * K + k;
    }
    memset(tmp, 0, 16 * 64);
    const int rows = M - i < 16 ? M - i : 16, cols = K - k < 64 ? K - k : 64;
    for (int r = 0; r < rows; r++) memcpy(tmp + r * 64, a + (size_t)(i + r) * K + k, (size_t)cols);
    *stride = 64;
    return tmp;
}

/* One 16-row tile of c over one column block (V panels, jn columns from j0) and one k block: C loaded (or zeroed
 * on the first block), kg16 / 16 steps of TDPBSSD, C stored. */
QM_TARGET static void amx_rows(int32_t *c, int ldc, const int8_t *a, int M, int K, int i, int j0, int jn, int V,
                               int k0, int kn, const int8_t *pack, size_t pstride, bool first) {
    _Alignas(64) int32_t ctmp[QM_V][16][16];
    _Alignas(64) int8_t atmp[16][64];
    const int rows = M - i < 16 ? M - i : 16;
    int32_t *cdst[QM_V];
    size_t cstride[QM_V];
    for (int v = 0; v < V; v++) { /* a whole tile in place, else through ctmp */
        const int cols = jn - 16 * v < 16 ? jn - 16 * v : 16;
        if (rows == 16 && cols == 16) {
            cdst[v] = c + (size_t)i * ldc + j0 + 16 * v, cstride[v] = (size_t)ldc * 4;
        } else {
            cdst[v] = &ctmp[v][0][0], cstride[v] = 64;
            memset(ctmp[v], 0, sizeof ctmp[v]);
            if (!first)
                for (int r = 0; r < rows; r++)
                    memcpy(ctmp[v][r], c + (size_t)(i + r) * ldc + j0 + 16 * v, (size_t)cols * 4);
        }
    }
    /* the tile numbers are immediates: one branch per panel count */
#define QM_LOAD_C(t)                                                                                                   \
    do {                                                                                                               \
        if (first) _tile_zero(t);                                                                                      \
        else _tile_loadd(t, cdst[t], cstride[t]);                                                                      \
    } while (0)
    QM_LOAD_C(0);
    if (V > 1) QM_LOAD_C(1);
    if (V > 2) QM_LOAD_C(2);
#undef QM_LOAD_C
    for (int s = 0; s * 64 < kn; s++) {
        size_t astride;
        const int8_t *at = a_tile(&atmp[0][0], &astride, a, M, K, i, k0 + 64 * s);
        _tile_loadd(3, at, astride);
        _tile_loadd(4, pack + (size_t)s * 16 * 64, 64);
        _tile_dpbssd(0, 3, 4);
        if (V > 1) {
            _tile_loadd(5, pack + pstride + (size_t)s * 16 * 64, 64);
            _tile_dpbssd(1, 3, 5);
        }
        if (V > 2) {
            _tile_loadd(6, pack + 2 * pstride + (size_t)s * 16 * 64, 64);
            _tile_dpbssd(2, 3, 6);
        }
    }
    _tile_stored(0, cdst[0], cstride[0]);
    if (V > 1) _tile_stored(1, cdst[1], cstride[1]);
    if (V > 2) _tile_stored(2, cdst[2], cstride[2]);
    for (int v = 0; v < V; v++) {
        const int cols = jn - 16 * v < 16 ? jn - 16 * v : 16;
        if (cdst[v] == &ctmp[v][0][0])
            for (int r = 0; r < rows; r++) memcpy(c + (size_t)(i + r) * ldc + j0 + 16 * v, ctmp[v][r], (size_t)cols * 4);
    }
}

/* c (M, N), rows ldc apart, = a b^T (ldb < 0: b is (N, K)) or a b (b is (K, N), rows ldb apart). */
QM_TARGET static void amx_run(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    _Alignas(64) int8_t pack[QM_V * QM_KB / 4 * 64]; /* 3 panels of 128 groups: 24 KiB */
    amx_config();
    for (int j0 = 0; j0 < N; j0 += QM_V * 16) {
        const int jn = N - j0 < QM_V * 16 ? N - j0 : QM_V * 16, V = (jn + 15) / 16;
        for (int k0 = 0; k0 < K; k0 += QM_KB) {
            const int kn = K - k0 < QM_KB ? K - k0 : QM_KB;
            const int kg16 = (kn + 63) / 64 * 16; /* groups rounded up to whole tiles: the packers zero the rest */
            if (ldb < 0) qgemm_s8_pack_vnni(pack, NULL, b, K, j0, jn, k0, kn, kg16); /* no column sums */
            else qgemm_s8_pack_nn_vnni(pack, NULL, b, ldb, j0, jn, k0, kn, kg16);
            for (int i = 0; i < M; i += 16)
                amx_rows(c, ldc, a, M, K, i, j0, jn, V, k0, kn, pack, (size_t)kg16 * 64, k0 == 0);
        }
    }
    _tile_release();
}

void qgemm_s8_amx(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    amx_run(c, ldc, a, b, -1, M, N, K);
}

void qgemm_s8_nn_amx(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    amx_run(c, ldc, a, b, ldb, M, N, K);
}

/* ---- PTQ taps on tiles ------------------------------------------------------------------------------------------
 * qgemm_taps where tap t's activations lie at off[0] + t d (a 1x1 convolution's channel quads in the ch4 planes):
 * 16 taps of a pixel run are then one B tile in place (rows d dwords apart, 16 pixels of 4 codes a row), and the
 * weight's 16 rows by 16 taps one A tile in place (w->tiles, row-major). TDPBSUD takes A's signed weight bytes
 * against B's unsigned codes, so each C tile holds the wrapped sums the VNNI kernel makes; the epilogue subtracts
 * a_zero times the row sum (the VNNI kernel starts from it: the same int32 modulo 2^32) and applies y = fmaf(sum,
 * scale, bias) and the relu as taps_y does. Rows come 16 at a time; a tile's rows past rb1 or the weight are
 * computed (w->tiles is zero there) and not stored. Tiles 0-3: C of four vectors, 4: A, 5: B. */

/* The outputs of one C tile: rows [r0, r_end) of vector v from its sums ctmp [16 rows][16 lanes]. */
QM_TARGET static void taps_amx_store(const QGemmTaps *g, const int32_t (*ctmp)[16], int r0, int r_end, int v) {
    const __mmask16 m = g->vec_mask[v];
    if (!m) return;
    const bool relu = g->epi == QGEMM_EPI_RELU;
    for (int r = r0; r < r_end; r++) {
        const uint32_t corr = (uint32_t)g->a_zero * (uint32_t)g->w->row_sum[r];
        const __m512i sum = _mm512_sub_epi32(_mm512_load_si512((const void *)ctmp[r - r0]), _mm512_set1_epi32((int)corr));
        __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(g->scale[r]),
                                   _mm512_set1_ps(g->bias ? g->bias[r] : 0.0f));
        if (relu) y = _mm512_max_ps(y, _mm512_setzero_ps()); /* NaN -> 0, as nn's relu */
        float *o = g->out + (size_t)r * g->ldo + g->vec_pos[v];
        if (m == 0xFFFF) {
            _mm512_storeu_ps(o, y);
        } else { /* the output lanes packed to the front, stored as one run */
            y = _mm512_maskz_compress_ps(m, y);
            _mm512_mask_storeu_ps(o, (__mmask16)((1u << __builtin_popcount(m)) - 1), y);
        }
    }
}

QM_TARGET void qgemm_taps_amx(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    const QGemmPackedTaps *w = g->w;
    const int T = w->taps;
    rb0 = rb0 < 0 ? 0 : rb0, rb1 = rb1 > w->row_blocks ? w->row_blocks : rb1;
    v0 = v0 < 0 ? 0 : v0, v1 = v1 > g->n_vec ? g->n_vec : v1;
    if (rb0 >= rb1 || v0 >= v1) return;
    const size_t d = 4 * (size_t)(g->tap_off[1] - g->tap_off[0]); /* bytes from one tap's row to the next */
    const int row_end = rb1 * QGEMM_ROWS < w->rows ? rb1 * QGEMM_ROWS : w->rows;
    _Alignas(64) int32_t ctmp[4][16][16];
    amx_config();
    for (int r0 = rb0 * QGEMM_ROWS; r0 < row_end; r0 += 16) {
        const int r_end = r0 + 16 < row_end ? r0 + 16 : row_end;
        for (int v = v0; v < v1; v += 4) {
            const int nv = v1 - v < 4 ? v1 - v : 4;
            /* the tile numbers are immediates: one branch per vector count */
            _tile_zero(0);
            if (nv > 1) _tile_zero(1);
            if (nv > 2) _tile_zero(2);
            if (nv > 3) _tile_zero(3);
            for (int k = 0; k < T; k += 16) {
                const uint8_t *b = g->act + 4 * ((size_t)g->tap_off[k] + (size_t)QGEMM_LANES * v);
                _tile_loadd(4, w->tiles + (size_t)r0 * T + k, (size_t)T * 4);
                _tile_loadd(5, b, d);
                _tile_dpbsud(0, 4, 5);
                if (nv > 1) {
                    _tile_loadd(5, b + 64, d);
                    _tile_dpbsud(1, 4, 5);
                }
                if (nv > 2) {
                    _tile_loadd(5, b + 128, d);
                    _tile_dpbsud(2, 4, 5);
                }
                if (nv > 3) {
                    _tile_loadd(5, b + 192, d);
                    _tile_dpbsud(3, 4, 5);
                }
            }
            _tile_stored(0, ctmp[0], 64);
            if (nv > 1) _tile_stored(1, ctmp[1], 64);
            if (nv > 2) _tile_stored(2, ctmp[2], 64);
            if (nv > 3) _tile_stored(3, ctmp[3], 64);
            for (int c = 0; c < nv; c++) taps_amx_store(g, (const int32_t (*)[16])ctmp[c], r0, r_end, v + c);
        }
    }
    _tile_release();
}

#else /* no AMX here: qgemm_cpu_has_isa(QGEMM_ISA_AMX) is false, so these are never called */

void qgemm_taps_amx(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) { qgemm_taps_portable(g, rb0, rb1, v0, v1); }

void qgemm_s8_amx(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    qgemm_s8_ref_ldc(c, ldc, a, b, M, N, K);
}

void qgemm_s8_nn_amx(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    qgemm_s8_nn_ref(c, ldc, a, b, ldb, M, N, K);
}

#endif
