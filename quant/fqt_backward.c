/* fqt_backward.c - QT's backward (fqt.h): the quantized incoming gradient
 * and the two products dX = g W and dW = g^T X, with the clipped
 * straight-through estimator at the forward operands' ranges.
 *
 * g (rows, out) is quantized through QArray's rules with bwd_calib: once
 * per row for dX, once per column for dW, the column cut into tiles of
 * bwd_weight_grad_tile_size rows (the last tile takes what is left, so any
 * batch size works). Stochastic rounding's uniforms come from one draw of
 * the layer's rng per step, in the order of rng_fill_u32: [rows] (rows
 * only), [out] (columns only) or [rows * out] row-major (both); element
 * (r, o) of both quantized copies of g takes the same one. */
#include <limits.h>
#include <string.h>

#include "base/parallel.h"
#include "fqt_internal.h"
#include "fqt_kern.h"
#include "nn/gemm.h"
#include "nn/ops.h"

static const char OP[] = FQT_OP;

/* ---- the backward ------------------------------------------------------------------------------------------------ */

/* g (rows, out): dy (N, out) itself, or regrouped from dy (N, OC, OH, OW) into one row per output pixel; for conv,
 * dbias's column sums db_acc [out] (double) on the way, added in row order as bias_grad adds them. */
typedef struct {
    const FqtCtx *c;
    const float *dy; /* (N, OC, OH, OW) */
    float *g;        /* (N*OH*OW, OC) */
    double *db_acc;  /* [out] or NULL */
} RegroupJob;

/* Blocks [lo, hi) of eight channels, whose eight sums advance side by side. */
static void regroup_part(const void *ctx, int block_lo, int block_hi) {
    const RegroupJob *j = ctx;
    const FqtCtx *c = j->c;
    const int lo = block_lo * 8, hi = block_hi * 8 < c->out ? block_hi * 8 : c->out;
    const size_t plane = (size_t)c->cg.OH * c->cg.OW;
    for (int o0 = lo; o0 < hi; o0 += 8) {
        const int k_n = hi - o0 < 8 ? hi - o0 : 8;
        double acc[8] = {0};
        for (int n = 0; n < c->cg.N; n++) {
            const float *src = j->dy + ((size_t)n * c->out + o0) * plane;
            float *dst = j->g + (size_t)n * plane * c->out + o0; /* stride out */
            for (size_t px = 0; px < plane; px++)
                for (int k = 0; k < k_n; k++) {
                    float v = src[(size_t)k * plane + px];
                    dst[px * c->out + k] = v;
                    acc[k] += v;
                }
        }
        for (int k = 0; j->db_acc && k < k_n; k++) j->db_acc[o0 + k] = acc[k];
    }
}

static const float *grad_rows(Tape *t, const FqtCtx *c, const float *dy, double *db_acc) {
    if (!c->conv) return dy;
    float *g = tape_alloc(t, (size_t)c->rows * c->out * sizeof *g);
    if (!g) return NULL;
    RegroupJob j = {c, dy, g, db_acc};
    fqt_shares_run((c->out + 7) / 8, (size_t)c->rows * c->out, regroup_part, &j);
    return g;
}

/* dbias (out,) += the column sums of g, each in double (conv: summed by grad_rows into acc). */
static bool bias_grad(Tape *t, const FqtCtx *c, Var *bias, const float *g, const double *conv_acc) {
    float *db = tape_grad(t, bias);
    double *acc = tape_alloc(t, (size_t)c->out * sizeof *acc);
    if (!db || !acc) return false;
    if (conv_acc) {
        memcpy(acc, conv_acc, (size_t)c->out * sizeof *acc);
    } else {
        memset(acc, 0, (size_t)c->out * sizeof *acc);
        for (int r = 0; r < c->rows; r++)
            for (int o = 0; o < c->out; o++) acc[o] += g[(size_t)r * c->out + o];
    }
    for (int o = 0; o < c->out; o++) db[o] += (float)acc[o];
    return true;
}

/* ---- quantizing g ------------------------------------------------------------------------------------------------ */

/* Stochastic rounding's uniforms: [rows] (rows only), [out] (columns only) or [rows * out] (both, row-major). */
typedef struct {
    const float *u; /* NULL: round to nearest */
    unsigned axes;
    int out;
} Noise;

static float noise_at(const Noise *z, int r, int o) {
    if (!z->u) return 0.0f;
    switch (z->axes) {
    case FQT_NOISE_COLS: return z->u[o];
    case FQT_NOISE_ROWS | FQT_NOISE_COLS: return z->u[(size_t)r * z->out + o];
    default: return z->u[r];
    }
}

/* Chunks [lo, hi) of NOISE_CHUNK words of a draw: rng_fill_unit_at from the draw's first counter. */
#define NOISE_CHUNK 4096 /* a multiple of 4: chunks start on Philox blocks */

typedef struct {
    const Rng *rng;
    float *u;
    size_t n;
} NoiseJob;

static void noise_part(const void *ctx, int lo, int hi) {
    const NoiseJob *j = ctx;
    const size_t a = (size_t)lo * NOISE_CHUNK, b = (size_t)hi * NOISE_CHUNK < j->n ? (size_t)hi * NOISE_CHUNK : j->n;
    rng_fill_unit_at(j->rng, a, j->u + a, b - a);
}

/* One step's noise from the layer's rng: the same count for the same shape, drawn whichever products need it.
 * The words are RngUniforms' (rng_uniforms_next's order), drawn by the threads in parts, and the rng ends where
 * one sequential draw leaves it. */
static bool noise_draw(Tape *t, FqtLayer *q, int rows, int out, Noise *z) {
    unsigned axes = q->spec.noise_axes ? q->spec.noise_axes : FQT_NOISE_ROWS;
    *z = (Noise){.axes = axes, .out = out};
    if (!q->spec.bwd_stochastic) return true;
    size_t n = axes == FQT_NOISE_COLS ? (size_t)out : axes == FQT_NOISE_ROWS ? (size_t)rows : (size_t)rows * out;
    float *u = tape_alloc(t, n * sizeof *u);
    if (!u) return false;
    NoiseJob j = {&q->rng, u, n};
    fqt_shares_run((int)((n + NOISE_CHUNK - 1) / NOISE_CHUNK), 8 * n, noise_part, &j);
    q->rng.counter += rng_blocks(n);
    z->u = u;
    return true;
}

typedef struct {
    QArrayPlan p;      /* bwd_qtype, symmetric, bwd_calib, the rounding */
    float lut[256];    /* the value of every code */
    void *work;        /* calibration workspace for the longest slice */
    size_t work_bytes;
    Noise z;
} GradQuant;

static bool grad_failed(Tape *t, const FqtCtx *c, const char *what, int index, const QtError *inner) {
    qt_error_set(&t->err, inner->status, "%s (%s): quantizing the gradient's %s %d: %s", c->q->module->path, OP, what,
                 index, inner->msg);
    return false;
}

/* gr (rows, out) = g quantized per row, the non-contracting axis of dX = g W. */
static bool quant_rows(Tape *t, const FqtCtx *c, const GradQuant *gq, const float *g, float *gr) {
    const int out = c->out;
    for (int r = 0; r < c->rows; r++) {
        const float *row = g + (size_t)r * out;
        float s;
        QtError inner = {0};
        if (fqt_slice_scale(&gq->p, row, (size_t)out, gq->work, gq->work_bytes, &s, &inner) != QT_OK)
            return grad_failed(t, c, "row", r, &inner);
        for (int o = 0; o < out; o++) {
            uint32_t code = qarray_plan_encode(&gq->p, row[o], s, 0.0f, gq->p.round, noise_at(&gq->z, r, o));
            gr[(size_t)r * out + o] = gq->lut[code] * s;
        }
    }
    return true;
}

/* gc (rows, out) = g quantized per column, the non-contracting axis of dW = g^T X, with one scale per tile of
 * `tile` rows along the contraction (the last tile may be shorter); buf [tile] holds a column's tile. */
static bool quant_cols(Tape *t, const FqtCtx *c, const GradQuant *gq, const float *g, int tile, float *buf,
                       float *gc) {
    const int out = c->out;
    for (int o = 0; o < out; o++)
        for (int r0 = 0; r0 < c->rows; r0 += tile) {
            int n = c->rows - r0 < tile ? c->rows - r0 : tile;
            for (int i = 0; i < n; i++) buf[i] = g[(size_t)(r0 + i) * out + o];
            float s;
            QtError inner = {0};
            if (fqt_slice_scale(&gq->p, buf, (size_t)n, gq->work, gq->work_bytes, &s, &inner) != QT_OK)
                return grad_failed(t, c, "column", o, &inner);
            for (int i = 0; i < n; i++) {
                uint32_t code = qarray_plan_encode(&gq->p, buf[i], s, 0.0f, gq->p.round, noise_at(&gq->z, r0 + i, o));
                gc[(size_t)(r0 + i) * out + o] = gq->lut[code] * s;
            }
        }
    return true;
}

/* The quantized g of each product that is wanted (g_row for dX, g_col for dW; NULL: not wanted). */

/* g's plan: bwd_qtype, symmetric, bwd_calib, the rounding. */
static QtStatus grad_plan(const FqtCtx *c, QArrayPlan *p, QtError *err) {
    FqtLayer *q = c->q;
    const FqtSpec *s = &q->spec;
    bool sr = s->bwd_stochastic;
    QArrayOptions o = {.calib = &s->bwd_calib, .range = QARRAY_RANGE_SYMMETRIC,
                       .round = sr ? QROUND_STOCHASTIC : QROUND_RNE, .rng = sr ? &q->rng : NULL};
    return qarray_plan_make(p, "bwd_qtype", 2, (const int[]){c->rows, c->out}, s->bwd_qtype, &o, err);
}

/* Noise element (r, o) of the draw z as FqtNoise addresses it. */
static FqtNoise noise_steps(const Noise *z, int out) {
    const unsigned ax = z->axes;
    return (FqtNoise){.u = z->u,
                      .row_step = ax & FQT_NOISE_ROWS ? (ax & FQT_NOISE_COLS ? (size_t)out : 1) : 0,
                      .col_step = ax & FQT_NOISE_COLS ? 1 : 0};
}

static bool quantize_grad(Tape *t, const FqtCtx *c, const float *g, const float **g_row, const float **g_col) {
    FqtLayer *q = c->q;
    const FqtSpec *s = &q->spec;
    const int rows = c->rows, out = c->out, tile = fqt_grad_tile(c);
    GradQuant gq;
    QtError inner = {0};
    if (grad_plan(c, &gq.p, &inner) != QT_OK) return fqt_quant_failed(t, q, "the gradient", &inner);
    gq.work_bytes = qarray_plan_work_bytes(&gq.p, (size_t)(out > tile ? out : tile));
    gq.work = gq.work_bytes ? tape_alloc(t, gq.work_bytes) : NULL;
    if ((gq.work_bytes && !gq.work) || !noise_draw(t, q, rows, out, &gq.z)) return false;
    for (uint32_t code = 0; code < (1u << s->bwd_qtype->bits); code++) gq.lut[code] = qtype_decode(s->bwd_qtype, code);
    const bool fast = fqt_plan_fast(&gq.p);
    const FqtNoise nz = noise_steps(&gq.z, out);
    size_t n = (size_t)rows * out;
    if (g_row) {
        float *gr = tape_alloc(t, n * sizeof *gr), *srow = tape_alloc(t, (size_t)rows * sizeof *srow);
        if (!gr || !srow) return false;
        if (!(fast && fqt_quant_rows(NULL, gr, srow, g, rows, out, &gq.p, &nz)) && !quant_rows(t, c, &gq, g, gr))
            return false;
        *g_row = gr;
    }
    if (g_col) {
        const size_t tiles = ((size_t)rows + tile - 1) / tile;
        float *gc = tape_alloc(t, n * sizeof *gc), *buf = tape_alloc(t, (size_t)tile * sizeof *buf);
        float *sc = tape_alloc(t, tiles * out * sizeof *sc);
        float *part = tape_alloc(t, (size_t)parallel_get_threads() * out * sizeof *part);
        if (!gc || !buf || !sc || !part) return false;
        if (!(fast && fqt_quant_cols(NULL, gc, sc, part, g, rows, out, tile, &gq.p, &nz)) &&
            !quant_cols(t, c, &gq, g, tile, buf, gc))
            return false;
        *g_col = gc;
    }
    return true;
}

/* ---- the backward's products ------------------------------------------------------------------------------------- */

/* The clipped straight-through estimator's pass: d[i] += v[i] / s in [lo, hi] ? tmp[i] : 0, over chunks of
 * CLIP_CHUNK elements (the input: one scale) or rows of `row` elements with one scale each (the weight). */
#define CLIP_CHUNK 4096

typedef struct {
    float *d;
    const float *v, *tmp, *s; /* s: [1] (s_step 0) or [rows] */
    size_t n, row;
    int s_step;
    float lo, hi;
    bool write;               /* d not yet written (tape_grad_to_write): = instead of += */
} ClipJob;

static void clip_part(const void *ctx, int lo, int hi) {
    const ClipJob *j = ctx;
    for (int r = lo; r < hi; r++) {
        const size_t a = (size_t)r * j->row, b = a + j->row < j->n ? a + j->row : j->n;
        (j->write ? fqt_ste_clip_write : fqt_ste_clip)(j->d + a, j->v + a, j->tmp + a, b - a,
                                                        j->s[(size_t)r * j->s_step], j->lo, j->hi);
    }
}

static void clip_run(ClipJob *j) {
    fqt_shares_run((int)((j->n + j->row - 1) / j->row), j->n, clip_part, j);
}

/* dx += g_row deq(W), through col2im for conv, where x / sx lies in [x_lo, x_hi]. g_row is (rows, out), or for
 * conv with nchw the layer's output layout (N, OC, OH, OW), whose product is nn_conv2d's own input gradient. */
static bool input_grad(Tape *t, const FqtCtx *c, Var *x, const float *g_row, bool nchw) {
    const size_t nx = var_numel(x);
    const int rows = c->rows, out = c->out, K = c->fan_in;
    bool fresh = false;
    float *dx = tape_grad_to_write(t, x, &fresh), *tmp = tape_alloc(t, nx * sizeof *tmp); /* x's shape */
    if (!dx || !tmp) return false;
    if (!c->conv) {
        gemm_f32(false, false, rows, K, out, 1.0f, g_row, out, c->wd, K, 0.0f, tmp, K);
    } else if (nchw) {
        const FqtConvGeom *g = &c->cg;
        if (!nn_conv2d_input_grad(t, tmp, g_row, c->wd, g->N, g->C, g->H, g->W, out, g->KH, g->KW, g->stride,
                                  g->padding))
            return false;
    } else {
        const FqtConvGeom *g = &c->cg;
        float *dcol = tape_alloc(t, (size_t)K * rows * sizeof *dcol); /* (C*KH*KW, N*OH*OW) */
        if (!dcol) return false;
        gemm_f32(true, true, K, rows, out, 1.0f, c->wd, K, g_row, out, 0.0f, dcol, rows);
        memset(tmp, 0, nx * sizeof *tmp);
        col2im(tmp, dcol, g->N, g->C, g->H, g->W, g->KH, g->KW, g->stride, g->padding, g->OH, g->OW);
    }
    ClipJob j = {.d = dx, .v = x->value.data, .tmp = tmp, .s = &c->sx, .n = nx, .row = CLIP_CHUNK, .s_step = 0,
                 .lo = c->x_lo, .hi = c->x_hi, .write = fresh};
    clip_run(&j);
    return true;
}

/* dw (out, fan_in) += tmp where W / sw[row] lies in [w_lo, w_hi]. */
static void weight_clip(const FqtCtx *c, float *dw, const Var *w, const float *tmp) {
    const size_t nw = (size_t)c->out * c->fan_in;
    ClipJob j = {.d = dw, .v = w->value.data, .tmp = tmp, .s = c->sw, .n = nw, .row = (size_t)c->fan_in, .s_step = 1,
                 .lo = c->w_lo, .hi = c->w_hi};
    clip_run(&j);
}

/* X (rows, fan_in) = xc * sx, rows [lo, hi). */
typedef struct {
    float *X;
    const int8_t *xc;
    float sx;
    int K;
} DeqJob;

static void deq_part(const void *ctx, int lo, int hi) {
    const DeqJob *j = ctx;
    for (size_t i = (size_t)lo * j->K; i < (size_t)hi * j->K; i++) j->X[i] = (float)j->xc[i] * j->sx;
}

/* dW += g_col^T deq(X) where W / sw[row] lies in [w_lo, w_hi]. */
static bool weight_grad(Tape *t, const FqtCtx *c, Var *w, const float *g_col) {
    const int rows = c->rows, out = c->out, K = c->fan_in;
    const size_t nX = (size_t)rows * K, nw = (size_t)out * K;
    const float *X = c->xd; /* (rows, fan_in) */
    if (!X) {
        float *buf = tape_alloc(t, nX * sizeof *buf);
        if (!buf) return false;
        DeqJob dj = {buf, c->xc, c->sx, K};
        fqt_shares_run(rows, nX, deq_part, &dj);
        X = buf;
    }
    float *dw = tape_grad(t, w), *tmp = tape_alloc(t, nw * sizeof *tmp); /* (out, fan_in) */
    if (!dw || !tmp) return false;
    gemm_f32(true, false, out, K, rows, 1.0f, g_col, out, X, K, 0.0f, tmp, K);
    weight_clip(c, dw, w, tmp);
    return true;
}

/* ---- the fused epilogue ------------------------------------------------------------------------------------------ */

/* dpre (N, OC, OH, OW) = the gradient before the fused epilogue, images [lo, hi). */
typedef struct {
    const FqtCtx *c;
    float *dpre;
    const float *dy, *y; /* the node's output gradient and value: the epilogue's shape */
} EpiJob;

/* dst (OH, OW) = plane (n, o) of the gradient before the fused epilogue, from dy and y (the epilogue's shape). */
static void epi_grad_plane(const FqtCtx *c, float *dst, const float *dy, const float *y, int n, int o) {
    const size_t out_plane = c->epi == CONV_EPI_RELU_MAXPOOL2 ? (size_t)(c->cg.OH / 2) * (c->cg.OW / 2)
                                                              : (size_t)c->cg.OH * c->cg.OW;
    const size_t at = ((size_t)n * c->out + o) * out_plane;
    nn_conv_epilogue_grad_plane(dst, dy + at, y + at, c->winner ? c->winner + at : NULL, c->cg.OH, c->cg.OW, c->epi);
}

static void epi_grad_part(const void *ctx, int lo, int hi) {
    const EpiJob *j = ctx;
    const FqtCtx *c = j->c;
    const size_t plane = (size_t)c->cg.OH * c->cg.OW;
    for (int n = lo; n < hi; n++)
        for (int o = 0; o < c->out; o++)
            epi_grad_plane(c, j->dpre + ((size_t)n * c->out + o) * plane, j->dy, j->y, n, o);
}

/* The gradient at the product's output: the node's output gradient, or before the fused epilogue. NULL: no
 * memory (on the tape). */
static const float *product_grad(Tape *t, const TapeNode *node) {
    const FqtCtx *c = node->ctx;
    if (c->epi == CONV_EPI_NONE) return node->out->grad;
    float *dpre = tape_alloc(t, (size_t)c->rows * c->out * sizeof *dpre);
    if (!dpre) return NULL;
    EpiJob j = {c, dpre, node->out->grad, node->out->value.data};
    fqt_shares_run(c->cg.N, (size_t)c->rows * c->out, epi_grad_part, &j);
    return dpre;
}

/* ---- the integer backward --------------------------------------------------------------------------------------- */

/* tmp (out, fan_in) rows [lo, hi) += a tile's integer sums (fan_in, out), or (out, fan_in) with by_rows, times its
 * scales; the first tile writes, the last multiplies by sx after its addition. */
typedef struct {
    float *tmp;
    const int32_t *acc; /* the tile's one chunk, or */
    const int64_t *sum; /* its chunks' sum (NULL: acc) */
    const float *st;    /* [out] */
    float sx;
    int K, out;
    bool first, last, by_rows;
} TileJob;

/* Row o of tmp from the sums laid out as tmp is; the choices fixed, so each instance is one plain loop. */
static inline __attribute__((always_inline)) void tile_row(const TileJob *j, int o, const bool wide, const bool first,
                                                           const bool last) {
    const int K = j->K;
    float *restrict row = j->tmp + (size_t)o * K;
    const int32_t *restrict a = j->acc + (size_t)o * K;
    const int64_t *restrict s = j->sum ? j->sum + (size_t)o * K : NULL;
    const float st = j->st[o], sx = j->sx;
    for (int k = 0; k < K; k++) {
        const float v = (wide ? (float)s[k] : (float)a[k]) * st; /* int32 -> float directly: the same rounding */
        const float r = first ? v : row[k] + v;
        row[k] = last ? r * sx : r;
    }
}

static void tile_part(const void *ctx, int lo, int hi) {
    const TileJob *j = ctx;
    if (j->by_rows) {
        for (int o = lo; o < hi; o++) {
            if (j->sum) tile_row(j, o, true, j->first, j->last);
            else if (j->first && j->last) tile_row(j, o, false, true, true);
            else if (j->first) tile_row(j, o, false, true, false);
            else if (j->last) tile_row(j, o, false, false, true);
            else tile_row(j, o, false, false, false);
        }
        return;
    }
    enum { KB = 16 }; /* the sums' rows a block of k reads stay in cache while the channels pass */
    for (int k0 = 0; k0 < j->K; k0 += KB) {
        const int k1 = j->K - k0 < KB ? j->K : k0 + KB;
        for (int o = lo; o < hi; o++) {
            float *row = j->tmp + (size_t)o * j->K;
            for (int k = k0; k < k1; k++) {
                const size_t i = (size_t)k * j->out + o;
                const float v = (float)(j->sum ? j->sum[i] : (int64_t)j->acc[i]) * j->st[o];
                float r = j->first ? v : row[k] + v;
                row[k] = j->last ? r * j->sx : r;
            }
        }
    }
}

/* dW += (sum over tiles t of A_t s_t) sx where W / sw[row] lies in [w_lo, w_hi]: A_t (out, fan_in) the exact
 * integer product of tile t's codes of g (gq, chunk-major as fqt_quant_grad_cols lays them) with X's codes, s_t
 * [out] its scales. */
static bool weight_grad_int(Tape *t, const FqtCtx *c, Var *w, const int8_t *gq, const float *s_col, int tile) {
    const int rows = c->rows, out = c->out, K = c->fan_in;
    const size_t nw = (size_t)out * K;
    /* conv: X^T's chunk-major blocks (fan_in, L), the forward's or gathered here; dense reads X's rows as they are */
    int8_t *xt = !c->conv || c->xt ? (int8_t *)c->xt : tape_alloc(t, (size_t)rows * K);
    /* The product's orientation: the kernels pack their second operand, once per thread, and run the first past
     * it, so the smaller of X^T and g goes second. by_rows: acc is g X (out, fan_in), dense always, and a conv
     * with fewer patch elements than channels (a first layer: 9 against 32 in the reference CNN); else X^T g
     * (fan_in, out), the output channels the kernel's vector lanes. The sums are exact either way. */
    const bool by_rows = !c->conv || K < out;
    int32_t *acc = tape_alloc(t, nw * sizeof *acc); /* the chunk's product */
    int64_t *sum = tape_alloc(t, nw * sizeof *sum); /* in acc's layout: a tile's chunks so far */
    float *tmp = tape_alloc(t, nw * sizeof *tmp), *dw = tape_grad(t, w); /* (out, fan_in) */
    if ((c->conv && !xt) || !acc || !sum || !tmp || !dw) return false;
    for (int r0 = 0, ti = 0, in_tile = 0; r0 < rows; in_tile++) {
        const int r1 = fqt_dw_chunk_end(r0, rows, tile), L = r1 - r0;
        const bool tile_done = r1 == rows || r1 % tile == 0;
        if (c->conv) {
            if (!c->xt) fqt_gather_xt(xt, c, r0, L);
            if (by_rows) fqt_qgemm_s8(acc, gq + (size_t)r0 * out, xt + (size_t)r0 * K, out, K, L);
            else fqt_qgemm_s8(acc, xt + (size_t)r0 * K, gq + (size_t)r0 * out, K, out, L);
        } else { /* g's block (out, L) times X's rows (L, fan_in), no transposed copy of either */
            fqt_qgemm_s8_nn(acc, K, gq + (size_t)r0 * out, c->xb + (size_t)r0 * K, K, out, K, L);
        }
        if (in_tile > 0 || !tile_done) /* a tile of several chunks: its sum in int64 */
            for (size_t i = 0; i < nw; i++) sum[i] = (in_tile > 0 ? sum[i] : 0) + acc[i];
        if (tile_done) { /* scale the tile (and, after the last, multiply by sx) */
            TileJob tj = {tmp, acc, in_tile > 0 ? sum : NULL, s_col + (size_t)ti * out, c->sx, K, out, ti == 0,
                          r1 == rows, by_rows};
            fqt_shares_run(out, nw, tile_part, &tj);
            ti++, in_tile = -1;
        }
        r0 = r1;
    }
    weight_clip(c, dw, w, tmp);
    return true;
}

/* The backward of an all-integer layer (X's codes kept, g in an int format with absmax ranges): g quantized where
 * it lies, (N, OC, OH, OW) or (N, out), no transposed copy; dX = g_row deq(W) through nn_conv2d's input gradient
 * (conv) or one GEMM (dense); dW from integer products (weight_grad_int). The scales and codes are those of the
 * general path (quantize_grad); the products' sums are exact (dW) or summed in another order (dX). false: the
 * layer is not such a layer, nothing done. */
/* ---- the conv's g in two passes ------------------------------------------------------------------------------
 * Scan: each image's planes of g (made from the epilogue's gradient where one was fused) with their maxima, every
 * row's (pixel's) maximum over the channels and each plane's sum (fqt_plane_stats); encode: each plane into the
 * rows' values for dX and the column codes for dW. The scales, values and codes are those of the row and column
 * drivers (fqt_quant_rows / fqt_quant_grad_cols); g is read twice instead of once per pass. A first layer under a
 * fused 2x2 pool (planes remade, no dX) scans only the pool's gradient at the winners (fqt_masked_absmax: the
 * planes' maxima), and its encode, which remakes each plane anyway, takes the plane's sum. */
/* Where a plane of g comes from: g itself (dy where no epilogue was fused, or g kept whole), or, for a first layer
 * under a fused epilogue, remade from the epilogue's gradient in a thread's scratch plane each time a pass reads
 * it, so that no g of the layer's full size is stored. */
typedef struct {
    const FqtCtx *c;
    const float *dy, *y;  /* the node's output gradient and value (the epilogue's shape) */
    float *g;             /* (N, OC, P) kept whole, or NULL: planes remade in scratch */
    float *scratch;       /* (threads, P), with g NULL */
} GradPlanes;

/* Plane (n, o) of g: read from g, or made (in g with make, else in the calling thread's scratch). */
static const float *grad_plane(const GradPlanes *gp, int n, int o, bool make) {
    const size_t P = (size_t)gp->c->cg.OH * gp->c->cg.OW;
    float *dst = gp->g ? gp->g + ((size_t)n * gp->c->out + o) * P : gp->scratch + (size_t)parallel_thread_index() * P;
    if (gp->g && !make) return dst;
    epi_grad_plane(gp->c, dst, gp->dy, gp->y, n, o);
    return dst;
}

typedef struct {
    GradPlanes gp;
    bool make_g;          /* the scan writes g's planes (gp.g) from the epilogue's gradient */
    bool pooled;          /* only the maxima, from the pool's gradient at its winners (fqt_masked_absmax) */
    float *rowmax;        /* (N, P), or NULL when dX is not wanted */
    float *colmax;        /* (N, OC) each plane's maximum */
    double *bsum;         /* (N, OC) each plane's sum (pooled: the encode's) */
    bool *finite;         /* [N] */
} ScanJob;

static void scan_part(const void *ctx, int lo, int hi) {
    const ScanJob *j = ctx;
    const FqtCtx *c = j->gp.c;
    const size_t P = (size_t)c->cg.OH * c->cg.OW, PP = (size_t)(c->cg.OH / 2) * (c->cg.OW / 2);
    for (int n = lo; n < hi; n++) {
        float *rm = j->rowmax ? j->rowmax + (size_t)n * P : NULL;
        if (rm) memset(rm, 0, P * sizeof *rm);
        bool ok = true;
        for (int o = 0; o < c->out && (ok || j->make_g); o++) { /* a kept g is made whole, past a non-finite plane */
            const size_t at = (size_t)n * c->out + o;
            if (j->pooled) {
                ok = fqt_masked_absmax(j->gp.dy + at * PP, j->gp.y + at * PP, PP, &j->colmax[at]);
                continue;
            }
            const float *plane = grad_plane(&j->gp, n, o, j->make_g);
            if (ok) ok = fqt_plane_stats(plane, P, rm, &j->colmax[at], &j->bsum[at]);
        }
        j->finite[n] = ok;
    }
}

typedef struct {
    const FqtCtx *c;
    GradPlanes gp;              /* g's planes */
    const float *s_row, *s_col; /* [N*P], [OC] (one tile) */
    float *g_row;               /* (N, OC, P) or NULL */
    int8_t *codes;              /* chunk-major (OC, L) blocks, or NULL */
    double *bsum;               /* (N, OC) each plane's sum where the scan took only the maxima, or NULL */
    const FqtNoise *z;
    FqtRound r;
} EncodeJob;

static void encode_part(const void *ctx, int lo, int hi) {
    const EncodeJob *j = ctx;
    const FqtCtx *c = j->c;
    const FqtNoise *z = j->z;
    const int P = c->cg.OH * c->cg.OW, rows = c->rows, OC = c->out;
    const size_t ustep = j->r.stochastic ? z->row_step : 0;
    for (int n = lo; n < hi; n++)
        for (int o = 0; o < OC; o++) {
            const size_t at = ((size_t)n * OC + o) * P;
            const float *g = grad_plane(&j->gp, n, o, false);
            if (j->bsum) j->bsum[(size_t)n * OC + o] = fqt_sum_f64(g, (size_t)P); /* fqt_plane_stats's sum */
            const size_t r0 = (size_t)n * P;
            const float *u = j->r.stochastic ? z->u + r0 * z->row_step + o * z->col_step : NULL;
            if (j->g_row) fqt_quant_span(NULL, j->g_row + at, g, (size_t)P, j->s_row + r0, 1, u, ustep, &j->r);
            if (!j->codes) continue;
            for (int a = (int)r0; a < (int)r0 + P;) { /* the plane's rows, cut where a dW chunk ends */
                const int c0 = a / FQT_DW_CHUNK * FQT_DW_CHUNK, c1 = fqt_dw_chunk_end(c0, rows, rows); /* one tile */
                const int b = c1 < (int)r0 + P ? c1 : (int)r0 + P, L = c1 - c0;
                fqt_quant_span(j->codes + (size_t)c0 * OC + (size_t)o * L + (a - c0), NULL, g + (a - r0), (size_t)(b - a),
                               &j->s_col[o], 0, u ? u + (size_t)(a - r0) * z->row_step : NULL, ustep, &j->r);
                a = b;
            }
        }
}

/* All of g for the general rules' error paths: gp's, or made now. NULL: no memory (on the tape). */
static const float *whole_g(Tape *t, const TapeNode *node, const GradPlanes *gp) {
    return gp->g ? gp->g : product_grad(t, node);
}

/* The bias gradient from each plane's sum (N, OC): each channel's sums (fqt_sum_f64's order) added in image
 * order. */
static bool plane_bias_grad(Tape *t, const FqtCtx *c, Var *bias, const double *bsum, double *db_acc) {
    for (int o = 0; o < c->out; o++) {
        double acc = 0.0;
        for (int n = 0; n < c->cg.N; n++) acc += bsum[(size_t)n * c->out + o];
        db_acc[o] = acc;
    }
    return bias_grad(t, c, bias, NULL, db_acc);
}

/* The conv's integer backward (int_backward) with g scanned once: the bias, g_row, the codes for dW. */

static void int_backward_conv(Tape *t, const TapeNode *node, const QArrayPlan *plan) {
    const FqtCtx *c = node->ctx;
    Var *x = node->in[0], *w = node->in[1], *bias = node->in[2];
    const int out = c->out, rows = c->rows, tile = fqt_grad_tile(c), N = c->cg.N, P = c->cg.OH * c->cg.OW;
    const bool want_b = bias && bias->requires_grad, want_x = x->requires_grad, want_w = w->requires_grad;
    if (!want_b && !want_x && !want_w) return;
    /* g whole where dX reads it (the encode makes g_row from it, and remaking every plane twice cost more than it
     * saved) or the tiles' column pass does; else (a first layer) each pass remakes its planes from dy */
    const bool epi = c->epi != CONV_EPI_NONE, keep_g = epi && (want_x || (want_w && tile < rows));
    /* such a layer under a 2x2 pool: the scan reads only the winners for the maxima, the encode (which remakes
     * every plane for the codes) takes the sums */
    const bool pooled = c->epi == CONV_EPI_RELU_MAXPOOL2 && !keep_g && want_w;
    ScanJob sj = {.gp = {.c = c, .dy = node->out->grad, .y = node->out->value.data}, .make_g = keep_g,
                  .pooled = pooled};
    if (!epi) sj.gp.g = node->out->grad;
    else if (keep_g) sj.gp.g = tape_alloc(t, (size_t)rows * out * sizeof(float));
    else sj.gp.scratch = tape_alloc(t, (size_t)parallel_get_threads() * P * sizeof(float));
    sj.rowmax = want_x ? tape_alloc(t, (size_t)rows * sizeof(float)) : NULL;
    sj.colmax = tape_alloc(t, (size_t)N * out * sizeof(float));
    sj.bsum = tape_alloc(t, (size_t)N * out * sizeof(double));
    sj.finite = tape_alloc(t, (size_t)N * sizeof(bool));
    double *db_acc = tape_alloc(t, (size_t)out * sizeof *db_acc);
    if ((!sj.gp.g && !sj.gp.scratch) || (want_x && !sj.rowmax) || !sj.colmax || !sj.bsum || !sj.finite || !db_acc)
        return;
    fqt_shares_run(N, (size_t)rows * out, scan_part, &sj);
    bool finite = true;
    for (int n = 0; n < N; n++) finite &= sj.finite[n];
    if (!finite) { /* the general rules say where */
        const float *g = grad_rows(t, c, whole_g(t, node, &sj.gp), NULL), *unused;
        if (g && quantize_grad(t, c, g, &unused, &unused))
            qt_error_set(&t->err, QT_ERR_VALUE, "%s (%s): the output gradient is not finite", c->q->module->path, OP);
        return;
    }
    if (want_b && !pooled && !plane_bias_grad(t, c, bias, sj.bsum, db_acc)) return;
    Noise z;
    if ((!want_x && !want_w) || !noise_draw(t, c->q, rows, out, &z)) return;
    const FqtNoise nz = noise_steps(&z, out);
    EncodeJob ej = {.c = c, .gp = sj.gp, .z = &nz, .r = {.qmin = plan->qmin, .qmax = plan->qmax,
                                                        .stochastic = nz.u != NULL}};
    float *s_row = NULL, *s_col = NULL;
    int8_t *codes = NULL;
    if (want_x) {
        s_row = tape_alloc(t, (size_t)rows * sizeof *s_row);
        ej.g_row = tape_alloc(t, (size_t)rows * out * sizeof(float));
        if (!s_row || !ej.g_row) return;
        if (!fqt_scales_of_amax(plan, sj.rowmax, s_row, (size_t)rows)) goto range;
    }
    if (want_w) {
        s_col = tape_alloc(t, ((size_t)rows + tile - 1) / tile * out * sizeof *s_col);
        codes = tape_alloc(t, (size_t)rows * out);
        if (!s_col || !codes) return;
        if (tile >= rows) { /* one scale per column: the planes' maxima; the codes in the encode pass */
            for (int o = 0; o < out; o++) {
                float m = 0.0f;
                for (int n = 0; n < N; n++) m = sj.colmax[(size_t)n * out + o] > m ? sj.colmax[(size_t)n * out + o] : m;
                if (!fqt_scale_of_amax(plan, m, &s_col[o])) goto range;
            }
            ej.codes = codes, ej.s_col = s_col;
        } else if (!fqt_quant_grad_cols(codes, s_col, sj.gp.g, N, out, P, tile, plan, &nz)) { /* tiles cut planes */
            goto range;
        }
    }
    ej.s_row = s_row, ej.bsum = pooled && want_b ? sj.bsum : NULL;
    if (ej.g_row || ej.codes) fqt_shares_run(N, (size_t)rows * out, encode_part, &ej);
    if (ej.bsum && !plane_bias_grad(t, c, bias, sj.bsum, db_acc)) return;
    if (want_x && !input_grad(t, c, x, ej.g_row, true)) return;
    if (want_w) weight_grad_int(t, c, w, codes, s_col, tile);
    return;
range: /* a scale beyond float: the general rules say where */
    {
        const float *g = grad_rows(t, c, whole_g(t, node, &sj.gp), NULL), *unused;
        if (g && quantize_grad(t, c, g, &unused, &unused))
            qt_error_set(&t->err, QT_ERR_VALUE, "%s (%s): the gradient's range exceeds float", c->q->module->path, OP);
    }
}

/* A dense layer's g (rows, out) quantized per column over tiles into chunk-major codes (fqt_quant_grad_cols's
 * layout): fqt_quant_cols on the row-major g (its columns' maxima by vector, whole rows encoded), then the codes
 * moved into their (out, L) blocks; part [threads * out] is scratch. false: a non-finite value. */
static bool quant_dense_cols(int8_t *codes, int8_t *rm /* (rows, out) scratch */, float *part, float *s_col,
                             const float *g, int rows, int out, int tile, const QArrayPlan *plan, const FqtNoise *z) {
    if (!fqt_quant_cols(rm, NULL, s_col, part, g, rows, out, tile, plan, z)) return false;
    for (int c0 = 0; c0 < rows;) {
        const int c1 = fqt_dw_chunk_end(c0, rows, tile), L = c1 - c0;
        for (int r = c0; r < c1; r++)
            for (int o = 0; o < out; o++) codes[(size_t)c0 * out + (size_t)o * L + (r - c0)] = rm[(size_t)r * out + o];
        c0 = c1;
    }
    return true;
}

bool fqt_int_backward_applies(const FqtCtx *c) {
    QArrayPlan plan;
    QtError inner = {0};
    return c->q->spec.bwd_qtype && grad_plan(c, &plan, &inner) == QT_OK && fqt_plan_fast(&plan);
}

static bool int_backward(Tape *t, const TapeNode *node, const float *dy) {
    const FqtCtx *c = node->ctx;
    Var *x = node->in[0], *w = node->in[1], *bias = node->in[2];
    QArrayPlan plan;
    QtError inner = {0};
    if (!c->xb || !c->int_bwd || grad_plan(c, &plan, &inner) != QT_OK) return false;
    if (c->conv) {
        int_backward_conv(t, node, &plan);
        return true;
    }
    /* dense: g is dy (rows, out) row-major */
    const int out = c->out, rows = c->rows, tile = fqt_grad_tile(c);
    if (bias && bias->requires_grad && !bias_grad(t, c, bias, dy, NULL)) return true;
    const bool want_x = x->requires_grad, want_w = w->requires_grad;
    Noise z;
    if ((!want_x && !want_w) || !noise_draw(t, c->q, rows, out, &z)) return true;
    const FqtNoise nz = noise_steps(&z, out);
    float *g_row = NULL, *s_col = NULL;
    int8_t *g_codes = NULL;
    if (want_x) {
        float *s_row = tape_alloc(t, (size_t)rows * sizeof *s_row);
        g_row = tape_alloc(t, (size_t)rows * out * sizeof *g_row);
        if (!s_row || !g_row) return true;
        if (!fqt_quant_rows(NULL, g_row, s_row, dy, rows, out, &plan, &nz)) goto not_finite;
    }
    if (want_w) {
        s_col = tape_alloc(t, ((size_t)rows + tile - 1) / tile * out * sizeof *s_col);
        g_codes = tape_alloc(t, (size_t)rows * out);
        if (!s_col || !g_codes) return true;
        int8_t *rm = tape_alloc(t, (size_t)rows * out);
        float *part = tape_alloc(t, (size_t)parallel_get_threads() * out * sizeof *part);
        if (!rm || !part) return true;
        if (!quant_dense_cols(g_codes, rm, part, s_col, dy, rows, out, tile, &plan, &nz)) goto not_finite;
    }
    if (want_x && !input_grad(t, c, x, g_row, true)) return true;
    if (want_w) weight_grad_int(t, c, w, g_codes, s_col, tile);
    return true;
not_finite: { /* the general rules say where */
    const float *g = grad_rows(t, c, dy, NULL), *unused;
    if (g && quantize_grad(t, c, g, &unused, &unused))
        qt_error_set(&t->err, QT_ERR_VALUE, "%s (%s): the output gradient is not finite", c->q->module->path, OP);
    return true;
}
}

void fqt_backward(Tape *t, const TapeNode *node) {
    const FqtCtx *c = node->ctx;
    /* the conv's integer backward makes the epilogue's gradient in its own scan */
    const bool scans = c->conv && c->xb && c->int_bwd;
    const float *dy = scans ? node->out->grad : product_grad(t, node); /* (N, out, OH*OW) or (N, out) */
    if (!dy || int_backward(t, node, dy)) return;
    Var *x = node->in[0], *w = node->in[1], *bias = node->in[2];
    const bool want_b = bias && bias->requires_grad;
    double *db_acc = want_b && c->conv ? tape_alloc(t, (size_t)c->out * sizeof *db_acc) : NULL;
    if (want_b && c->conv && !db_acc) return;
    const float *g = grad_rows(t, c, dy, db_acc); /* (rows, out) */
    if (!g) return;
    if (want_b && !bias_grad(t, c, bias, g, db_acc)) return;
    bool want_x = x->requires_grad, want_w = w->requires_grad;
    if (!want_x && !want_w) return;
    const float *g_row = g, *g_col = g;
    if (c->q->spec.bwd_qtype && !quantize_grad(t, c, g, want_x ? &g_row : NULL, want_w ? &g_col : NULL)) return;
    if (want_x && !input_grad(t, c, x, g_row, false)) return;
    if (want_w) weight_grad(t, c, w, g_col);
}
