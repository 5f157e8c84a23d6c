/* test_fqt_ref.c - quant_qt's hand reference of a QT layer (test_fqt.h): the geometry, the gradient quantized per
 * row and per column (round to nearest or stochastic over every noise layout, weight-gradient tiles), dX and dW
 * from the dequantized operands, and the check of a layer's forward and quantized backward against it. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/fqt.h"
#include "test_qarray.h"
#include "test_qat.h"
#include "test_fqt.h"
#include "test_util.h"

/* a and b agree to 1e-5 of b's largest magnitude (and 1e-5 relative): float rounding, nothing more. */
bool fqtest_close_to(const float *a, const float *b, size_t n, const char *what) {
    double amax = 0.0;
    for (size_t i = 0; i < n; i++) amax = fmax(amax, fabs((double)b[i]));
    size_t worst = 0;
    double ratio = test_close_ratio(a, b, n, 1e-5 * amax + 1e-30, 1e-5, &worst);
    if (ratio > 1.0)
        fprintf(stderr, "\n  %s[%zu]: %.9g vs %.9g (ratio %.3g, max |b| %g)\n", what, worst, (double)a[worst],
                (double)b[worst], ratio, amax);
    return ratio <= 1.0;
}

/* ---- geometry and the hand reference ----------------------------------------------------------------------------- */

typedef struct {
    bool conv;
    int N, C, H, W, KH, KW, OH, OW, stride, pad;
    int rows, out, K;
} Geom;

static Geom geom_of(const FqtLayer *q, int N) {
    const Module *m = q->module;
    Geom g = {.conv = m->spec.type == LAYER_CONV2D, .N = N, .out = q->out, .K = q->fan_in, .rows = N};
    if (g.conv) {
        const int *ws = m->weight->var.value.shape;
        g.C = m->in_shape[0], g.H = m->in_shape[1], g.W = m->in_shape[2], g.KH = ws[2], g.KW = ws[3];
        g.stride = m->spec.stride, g.pad = m->spec.padding;
        g.OH = (g.H + 2 * g.pad - g.KH) / g.stride + 1, g.OW = (g.W + 2 * g.pad - g.KW) / g.stride + 1;
        g.rows = N * g.OH * g.OW;
    }
    return g;
}

/* The flat index into x of element k of X's row r (the patch of output pixel r), or -1 for the padding. */
static long x_index(const Geom *g, int r, int k) {
    if (!g->conv) return (long)r * g->K + k;
    int plane = g->OH * g->OW, n = r / plane, oh = r % plane / g->OW, ow = r % g->OW;
    int c = k / (g->KH * g->KW), kh = k % (g->KH * g->KW) / g->KW, kw = k % g->KW;
    int ih = oh * g->stride + kh - g->pad, iw = ow * g->stride + kw - g->pad;
    if (ih < 0 || ih >= g->H || iw < 0 || iw >= g->W) return -1;
    return (((long)n * g->C + c) * g->H + ih) * g->W + iw;
}

/* g (rows, out) from dy: one row per example (dense) or per output pixel (conv). */
static float *grad_rows_of(const Geom *g, const float *dy) {
    float *gr = qa_alloc_floats((size_t)g->rows * g->out);
    int plane = g->conv ? g->OH * g->OW : 1;
    for (int r = 0; r < g->rows; r++)
        for (int o = 0; o < g->out; o++)
            gr[(size_t)r * g->out + o] =
                g->conv ? dy[((size_t)(r / plane) * g->out + o) * plane + r % plane] : dy[(size_t)r * g->out + o];
    return gr;
}

/* Stochastic rounding's uniforms as the layer draws them. */
typedef struct {
    const float *u; /* NULL: round to nearest */
    unsigned axes;
    int out;
} Noise;

static float noise_at(const Noise *z, int r, int o) {
    if (!z || !z->u) return 0.0f;
    if (z->axes == FQT_NOISE_COLS) return z->u[o];
    if (z->axes == (FQT_NOISE_ROWS | FQT_NOISE_COLS)) return z->u[(size_t)r * z->out + o];
    return z->u[r];
}

/* The noise a layer whose rng is at `from` draws for `rows` x `out`: malloc'd. */
static float *draw_noise(Rng from, unsigned axes, int rows, int out) {
    size_t n = axes == FQT_NOISE_COLS ? (size_t)out : axes == FQT_NOISE_ROWS ? (size_t)rows : (size_t)rows * out;
    uint32_t *w = malloc(n * sizeof *w);
    float *u = qa_alloc_floats(n);
    rng_fill_u32(&from, w, n);
    for (size_t i = 0; i < n; i++) u[i] = rng_u32_to_unit(w[i]);
    free(w);
    return u;
}

/* x quantized as one slice of a signed int format of `bits`, absmax (DESIGN: s = amax / (2^(b-1) - 1/2)), codes
 * clamped, then rounded: to nearest, or stochastically with u (up when u >= 1 - frac). */
float fqtest_int_slice_scale(float amax, int bits) {
    float s = amax / ((float)((1 << (bits - 1)) - 1) + 0.5f);
    return s >= 1e-19f ? s : 1.0f;
}

static float int_quant(float x, float s, int bits, bool stochastic, float u) {
    float qmax = (float)((1 << (bits - 1)) - 1), c = fminf(fmaxf(x / s, -qmax - 1.0f), qmax), lo = floorf(c);
    float q = stochastic ? lo + (u >= 1.0f - (c - lo) ? 1.0f : 0.0f) : rintf(c);
    return q * s;
}

/* gr, gc (rows, out): g quantized per row, and per column in tiles of `tile` rows (0: all). */
static void quant_grad_ref(const Geom *G, const float *g, int bits, int tile, const Noise *z, float *gr, float *gc) {
    int rows = G->rows, out = G->out, T = tile > 0 && tile < rows ? tile : rows;
    bool sr = z && z->u;
    for (int r = 0; r < rows; r++) {
        float amax = 0.0f;
        for (int o = 0; o < out; o++) amax = fmaxf(amax, fabsf(g[(size_t)r * out + o]));
        float s = fqtest_int_slice_scale(amax, bits);
        for (int o = 0; o < out; o++)
            gr[(size_t)r * out + o] = int_quant(g[(size_t)r * out + o], s, bits, sr, noise_at(z, r, o));
    }
    for (int o = 0; o < out; o++)
        for (int r0 = 0; r0 < rows; r0 += T) {
            int n = rows - r0 < T ? rows - r0 : T;
            float amax = 0.0f;
            for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(g[(size_t)(r0 + i) * out + o]));
            float s = fqtest_int_slice_scale(amax, bits);
            for (int i = 0; i < n; i++) {
                size_t at = (size_t)(r0 + i) * out + o;
                gc[at] = int_quant(g[at], s, bits, sr, noise_at(z, r0 + i, o));
            }
        }
}

/* dx = mask_x (gr wq) through the patches, dw = mask_w (gc^T xq), both in double. */
static void grads_ref(const Geom *G, const float *gr, const float *gc, const float *wq, const float *xq, size_t nx,
                      float *dx, float *dw) {
    size_t nw = (size_t)G->out * G->K;
    double *ax = calloc(nx, sizeof *ax), *aw = calloc(nw, sizeof *aw);
    CU_ASSERT_FATAL(ax && aw);
    for (int r = 0; r < G->rows; r++)
        for (int k = 0; k < G->K; k++) {
            long i = x_index(G, r, k);
            if (i < 0) continue;
            for (int o = 0; o < G->out; o++) {
                ax[i] += (double)gr[(size_t)r * G->out + o] * wq[(size_t)o * G->K + k];
                aw[(size_t)o * G->K + k] += (double)gc[(size_t)r * G->out + o] * xq[i];
            }
        }
    for (size_t i = 0; i < nx; i++) dx[i] = (float)ax[i];
    for (size_t i = 0; i < nw; i++) dw[i] = (float)aw[i];
    free(ax), free(aw);
}


void fqtest_operands_of(const FqtLayer *q, const float *x, size_t nx, FqtestOperands *op) {
    const QType *at = q->spec.act_qtype ? q->spec.act_qtype : q->spec.weight_qtype;
    QArrayOptions wo = qa_channelwise(0), xo = {.range = QARRAY_RANGE_SYMMETRIC};
    wo.range = QARRAY_RANGE_SYMMETRIC;
    memset(op, 0, sizeof *op);
    op->wq = qtest_qarray_round_trip(q->module->weight->var.value.data, 2, (const int[]){q->out, q->fan_in},
                                  q->spec.weight_qtype, &wo, &op->qw);
    op->xq = qtest_qarray_round_trip(x, 1, (const int[]){(int)nx}, at, &xo, &op->qx);
}

void fqtest_operands_free(FqtestOperands *op) {
    qarray_free(&op->qw), qarray_free(&op->qx);
    free(op->wq), free(op->xq);
}

/* The layer's quantized backward (int formats of bwd_bits) against the reference for one x and dy; the noise is
 * what the layer's rng draws from its state before the step. */
void fqtest_check_against_ref(FqtLayer *q, int N, uint64_t seed, int bwd_bits, const char *what) {
    Module *mod = q->module;
    Geom G = geom_of(q, N);
    size_t nx = qtest_input_numel(mod, N), nw = (size_t)q->out * q->fan_in, ny = (size_t)G.rows * G.out;
    float *x = qa_normal_sample(seed, nx), *dy = qa_normal_sample(seed + 1, ny);
    FqtestOperands op;
    fqtest_operands_of(q, x, nx, &op);
    unsigned axes = q->spec.noise_axes ? q->spec.noise_axes : FQT_NOISE_ROWS;
    float *u = q->spec.bwd_stochastic ? draw_noise(q->rng, axes, G.rows, G.out) : NULL;
    Noise z = {.u = u, .axes = axes, .out = G.out};
    QtestRun a;
    fqtest_run_qt(q, x, N, dy, &a);
    float *g = grad_rows_of(&G, dy), *gr = qa_alloc_floats(ny), *gc = qa_alloc_floats(ny);
    float *dx = qa_alloc_floats(nx), *dw = qa_alloc_floats(nw), *db = qa_alloc_floats(G.out);
    quant_grad_ref(&G, g, bwd_bits, q->spec.bwd_weight_grad_tile_size, &z, gr, gc);
    grads_ref(&G, gr, gc, op.wq, op.xq, nx, dx, dw);
    qtest_apply_mask(dx, x, nx, &op.qx);
    qtest_apply_mask(dw, mod->weight->var.value.data, nw, &op.qw);
    for (int o = 0; o < G.out; o++) {
        double s = 0.0;
        for (int r = 0; r < G.rows; r++) s += g[(size_t)r * G.out + o];
        db[o] = (float)s;
    }
    /* the forward too: y = deq(X) deq(W)^T + b, every output channel of every pixel */
    float *y_ref = qa_alloc_floats(ny), *y_rows = grad_rows_of(&G, a.y);
    for (int r = 0; r < G.rows; r++)
        for (int o = 0; o < G.out; o++) {
            double acc = mod->bias ? mod->bias->var.value.data[o] : 0.0;
            for (int k = 0; k < G.K; k++) {
                long xi = x_index(&G, r, k);
                if (xi >= 0) acc += (double)op.xq[xi] * op.wq[(size_t)o * G.K + k];
            }
            y_ref[(size_t)r * G.out + o] = (float)acc;
        }
    char label[96];
    snprintf(label, sizeof label, "%s y", what);
    CU_ASSERT(fqtest_close_to(y_rows, y_ref, ny, label));
    free(y_ref), free(y_rows);
    snprintf(label, sizeof label, "%s dx", what);
    CU_ASSERT(fqtest_close_to(a.dx, dx, nx, label));
    snprintf(label, sizeof label, "%s dw", what);
    CU_ASSERT(fqtest_close_to(a.dw, dw, nw, label));
    snprintf(label, sizeof label, "%s db", what);
    CU_ASSERT(fqtest_close_to(a.db, db, (size_t)G.out, label));
    qtest_run_free(&a);
    fqtest_operands_free(&op);
    free(x), free(dy), free(u), free(g), free(gr), free(gc), free(dx), free(dw), free(db);
}

