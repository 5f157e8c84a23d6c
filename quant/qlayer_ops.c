/* qlayer_ops.c - the quantized layer's forward and input gradient.
 *
 * A dense weight up to qlayer_dense_whole_bytes is dequantized whole into
 * the step's arena, once: the forward's GEMM and the backward's read it.
 * Larger dense weights and conv weights over one tile are dequantized in
 * bands of band_rows output channels into one arena buffer and fed to sgemm
 * one after the other, in the forward and again in the backward.
 *   dense  y[:, band] = x (N, in) @ band^T           dx += dy[:, band] @ band
 *   conv   prod[band, :] = band @ col (ckk, N*OH*OW)  dcol = sum of band^T @ dyt[band, :]
 * The convolution lowers to im2col + sgemm as nn_conv2d does, with the same
 * output layout (N, OC, OH, OW). No weight gradient is ever formed.
 * A forward with int8 operands and no gradient to record runs on the
 * integer kernels instead (qlayer_int8.c). */
#include <limits.h>
#include <string.h>

#include "fakequant.h"
#include "nn/gemm.h"
#include "nn/ops.h"
#include "base/parallel.h"
#include "qlayer.h"
#include "qlayer_int8.h"
#include "qlayer_ops.h"

#define SHAPE_STR(v, buf) tensor_shape_str(&(v)->value, (buf), sizeof(buf))

typedef struct {
    int N, C, H, W;  /* input */
    int OC, KH, KW;  /* weight, with C */
    int OH, OW;      /* output */
    int stride, padding;
} QConvDims;

/* ---- bands ---------------------------------------------------------------------------------------- */

/* Weight rows [r0, r0 + n) -> band [n * fan_in]. Bands start on QArray rows (band_rows_for). */
static bool band_load(Tape *t, const QLayer *q, int r0, int n, float *band) {
    size_t row_len = (size_t)q->weight.shape[q->weight.ndim - 1];
    size_t first = (size_t)r0 * (size_t)q->fan_in, count = (size_t)n * (size_t)q->fan_in;
    if (qarray_dequantize_rows(&q->weight, first / row_len, count / row_len, band) == QT_OK) return true;
    qt_error_set(&t->err, QT_ERR_ARG, "%s: weight rows %d..%d do not map to whole rows of its QArray (%d, %d)",
                 q->module->path, r0, r0 + n - 1, q->weight.shape[0], q->weight.shape[1]);
    return false;
}

static int band_len(const QLayer *q, int r0) { return q->out - r0 < q->band_rows ? q->out - r0 : q->band_rows; }

static float *band_alloc(Tape *t, const QLayer *q) {
    return tape_alloc(t, (size_t)q->band_rows * (size_t)q->fan_in * sizeof(float));
}

/* ---- the input: observed or fake-quantized ---------------------------------------------------------- */

static Var *observe_input(Tape *t, QLayer *q, Var *x) {
    size_t n = var_numel(x), bytes = calib_workspace_bytes(&q->act_stats.spec, n);
    void *work = bytes ? tape_alloc(t, bytes) : NULL;
    if (bytes && !work) return NULL;
    CalibQuant cq = fq_calib_quant(q->spec.act_qtype,
                                   q->spec.act_symmetric ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC, false,
                                   QARRAY_ZP_INT32);
    QtError inner = {0};
    QtStatus st = calib_running_observe(&q->act_stats, x->value.data, n, &cq, work, bytes, &inner);
    if (st == QT_OK) return x;
    qt_error_set(&t->err, st, "%s: observing the input for its static range: %s", q->module->path, inner.msg);
    return NULL;
}

/* x as the layer's GEMMs see it. */
static Var *layer_input(Tape *t, QLayer *q, Var *x) {
    if (!q->spec.act_qtype) return x;
    if (q->calibrating) return observe_input(t, q, x);
    if (!q->act_ready) return x;
    Var *s = tape_new_var(t, 1, (const int[]){1});
    Var *zp = q->spec.act_symmetric ? NULL : tape_new_var(t, 1, (const int[]){1});
    if (!s || (!q->spec.act_symmetric && !zp)) return NULL;
    s->value.data[0] = q->act_scale;
    if (zp) zp->value.data[0] = q->act_zero_point;
    FakeQuantSpec fs = {.qtype = q->spec.act_qtype,
                        .range = q->spec.act_symmetric ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC,
                        .zp_type = QARRAY_ZP_INT32, .round = QROUND_RNE, .ste = FQ_STE_CLIPPED};
    return fq_fake_quant(t, x, &fs, s, zp);
}

/* ---- dense -------------------------------------------------------------------------------------------- */

/* Whole, the dequantized weight is one GEMM's operand (a band's GEMM packs x
 * again each time) and the backward's too, so the weight is dequantized once
 * per step. The copy lives in the step's arena, like every saved tensor. */
size_t qlayer_dense_whole_bytes = (size_t)16 << 20;

/* The whole-weight products split over the pool when they are worth it (nn/gemm.c's thresholds): the forward by
 * output channels, each part dequantizing its rows and multiplying them at once (one hand-off, and the rows are
 * still in the core's cache); the input gradient by columns of dx. */
#define DENSE_SPLIT_MIN_FLOPS 4.0e6
#define DENSE_SPLIT_MIN_COLS 32

typedef struct {
    const QLayer *q;
    const float *w; /* (out, in) the whole dequantized weight, or NULL: dequantized band by band */
} DenseCtx;

/* The input gradient over the whole weight, split by columns of dx. */
typedef struct {
    const QLayer *q;
    const float *w, *dy; /* (out, in), (N, out) */
    float *dx;           /* (N, in) */
    int N;
} DenseDxJob;

/* dx[:, c0:c1] += dy @ W[:, c0:c1], band by band even over the whole weight: the sum over the output channels
 * is rounded as the bands always rounded it. */
static void dense_dx_cols(const DenseDxJob *j, int c0, int c1) {
    const QLayer *q = j->q;
    const int in = q->fan_in, out = q->out;
    for (int r0 = 0; c1 > c0 && r0 < out; r0 += q->band_rows)
        gemm_f32(false, false, j->N, c1 - c0, band_len(q, r0), 1.0f, j->dy + r0, out, j->w + (size_t)r0 * in + c0,
                 in, 1.0f, j->dx + c0, in);
}

static void dense_dx_part(void *ctx, int task, int n_tasks) {
    const DenseDxJob *j = ctx;
    int lo, hi;
    parallel_range(j->q->fan_in, task, n_tasks, &lo, &hi);
    dense_dx_cols(j, lo, hi);
}

/* Parts a product of N x cols x depth is split into over the pool: nn/gemm.c's thresholds. */
static int dense_parts(int N, int cols, int depth, int unit) {
    int parts = parallel_in_task() ? 1 : parallel_get_threads();
    if (2.0 * N * cols * depth < DENSE_SPLIT_MIN_FLOPS) parts = 1;
    if (unit < DENSE_SPLIT_MIN_COLS) unit = DENSE_SPLIT_MIN_COLS;
    return parts > cols / unit ? cols / unit : parts;
}

static void dense_backward(Tape *t, const TapeNode *node) {
    const DenseCtx *c = node->ctx;
    const QLayer *q = c->q;
    Var *x = node->in[0], *bias = node->in[1];
    const float *dy = node->out->grad; /* (N, out) */
    const int N = x->value.shape[0], in = q->fan_in, out = q->out;
    if (bias && bias->requires_grad) {
        float *db = tape_grad(t, bias); /* (out,) += column sums of dy */
        if (!db) return;
        for (int n = 0; n < N; n++)
            for (int o = 0; o < out; o++) db[o] += dy[(size_t)n * out + o];
    }
    if (!x->requires_grad) return;
    float *dx = tape_grad(t, x); /* (N, in) */
    if (!dx) return;
    if (c->w) {
        /* every band's GEMM split the same way in one hand-off */
        DenseDxJob j = {q, c->w, dy, dx, N};
        int parts = dense_parts(N, in, out, 1);
        if (parts > 1) parallel_run(parts, dense_dx_part, &j);
        else dense_dx_cols(&j, 0, in);
        return;
    }
    float *band = band_alloc(t, q); /* (band_rows, in) */
    if (!band) return;
    for (int r0 = 0; r0 < out; r0 += q->band_rows) {
        int nb = band_len(q, r0);
        if (!band_load(t, q, r0, nb, band)) return;
        gemm_f32(false, false, N, in, nb, 1.0f, dy + r0, out, band, in, 1.0f, dx, in);
    }
}

static bool dense_check(Tape *t, const QLayer *q, const Var *x) {
    char sx[64];
    if (x->value.ndim == 2 && x->value.shape[1] == q->fan_in) return true;
    qt_error_set(&t->err, QT_ERR_SHAPE, "%s: input %s does not fit the quantized dense layer (want (N, %d))",
                 q->module->path, SHAPE_STR(x, sx), q->fan_in);
    return false;
}

typedef struct {
    const QLayer *q;
    const float *x;  /* (N, in) */
    float *w;        /* (out, in) the whole weight, filled part by part */
    float *y;        /* (N, out), holding the bias when beta is 1 */
    int N, align;    /* align: output channels that start a QArray row */
    float beta;
    bool ok[PARALLEL_MAX_THREADS]; /* per task */
} DenseJob;

/* y[:, r0:r1] (+)= x @ deq(W[r0:r1])^T; false if the rows do not map to whole QArray rows. */
static bool dense_rows(const DenseJob *j, int r0, int r1) {
    if (r1 <= r0) return true;
    const QLayer *q = j->q;
    const int in = q->fan_in;
    size_t row_len = (size_t)q->weight.shape[q->weight.ndim - 1];
    size_t first = (size_t)r0 * (size_t)in, count = (size_t)(r1 - r0) * (size_t)in;
    if (first % row_len || count % row_len ||
        qarray_dequantize_rows(&q->weight, first / row_len, count / row_len, j->w + first) != QT_OK)
        return false;
    gemm_f32(false, true, j->N, r1 - r0, in, 1.0f, j->x, in, j->w + first, in, j->beta, j->y + r0, q->out);
    return true;
}

static void dense_part(void *ctx, int task, int n_tasks) {
    DenseJob *j = ctx;
    int lo, hi;
    parallel_range(j->q->out / j->align, task, n_tasks, &lo, &hi);
    j->ok[task] = dense_rows(j, lo * j->align, hi * j->align);
}

static size_t gcd_size(size_t a, size_t b) {
    while (b) {
        size_t r = a % b;
        a = b, b = r;
    }
    return a;
}

/* sgemm computes each output as one dot product over in however the outputs are split (which is also why
 * results do not depend on the thread count), so the whole weight gives the bands' bits in any number of parts. */
static bool dense_whole(Tape *t, const QLayer *q, DenseJob *j) {
    const int out = q->out;
    size_t row_len = (size_t)q->weight.shape[q->weight.ndim - 1];
    j->align = (int)(row_len / gcd_size((size_t)q->fan_in, row_len));
    const int parts = dense_parts(j->N, out, q->fan_in, j->align);
    bool ok = true;
    if (parts > 1) {
        parallel_run(parts, dense_part, j);
        for (int i = 0; i < parts; i++) ok &= j->ok[i];
    } else {
        ok = dense_rows(j, 0, out);
    }
    if (!ok)
        qt_error_set(&t->err, QT_ERR_ARG, "%s: weight rows do not map to whole rows of its QArray (%d, %d)",
                     q->module->path, q->weight.shape[0], q->weight.shape[1]);
    return ok;
}

static Var *dense_forward(Tape *t, QLayer *q, Var *x, Var *bias) {
    if (!dense_check(t, q, x)) return NULL;
    const int N = x->value.shape[0], in = q->fan_in, out = q->out;
    const bool whole = (size_t)out * (size_t)in * sizeof(float) <= qlayer_dense_whole_bytes;
    Var *y = tape_new_var(t, 2, (const int[]){N, out});
    DenseCtx *c = tape_alloc(t, sizeof *c);
    float *w = whole ? tape_alloc(t, (size_t)out * (size_t)in * sizeof(float)) : NULL; /* (out, in) */
    float *band = whole ? NULL : band_alloc(t, q); /* (band_rows, in) */
    if (!y || !c || !(whole ? w != NULL : band != NULL)) return NULL;
    *c = (DenseCtx){q, whole ? w : NULL};
    /* the bias first, so every band's GEMM adds onto it (beta = 1) */
    float beta = 0.0f;
    if (bias) {
        for (int n = 0; n < N; n++)
            memcpy(y->value.data + (size_t)n * out, bias->value.data, (size_t)out * sizeof(float));
        beta = 1.0f;
    }
    if (whole) {
        DenseJob j = {.q = q, .x = x->value.data, .w = w, .y = y->value.data, .N = N, .beta = beta};
        if (!dense_whole(t, q, &j)) return NULL;
    }
    for (int r0 = 0; !whole && r0 < out; r0 += q->band_rows) {
        int nb = band_len(q, r0);
        if (!band_load(t, q, r0, nb, band)) return NULL;
        gemm_f32(false, true, N, nb, in, 1.0f, x->value.data, in, band, in, beta, y->value.data + r0, out);
    }
    return tape_record(t, "qlayer_dense", dense_backward, y, (Var *[]){x, bias}, 2, c) ? y : NULL;
}

/* ---- conv2d ------------------------------------------------------------------------------------------- */

static QConvDims conv_dims_of(const QLayer *q, const Var *x, const Var *y) {
    const Module *m = q->module;
    return (QConvDims){x->value.shape[0], x->value.shape[1], x->value.shape[2], x->value.shape[3], q->w_shape[0],
                       q->w_shape[2], q->w_shape[3], y->value.shape[2], y->value.shape[3], m->spec.stride,
                       m->spec.padding};
}

/* The output size of x under the layer, or false with the tape error set. */
static bool conv_check(Tape *t, const QLayer *q, const Var *x, int *OH, int *OW) {
    char sx[64];
    const int *ws = q->w_shape, stride = q->module->spec.stride, pad = q->module->spec.padding;
    if (x->value.ndim != 4 || x->value.shape[1] != ws[1]) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "%s: input %s does not fit the quantized conv2d layer (want (N, %d, H, W))",
                     q->module->path, SHAPE_STR(x, sx), ws[1]);
        return false;
    }
    long long ph = (long long)x->value.shape[2] + 2LL * pad, pw = (long long)x->value.shape[3] + 2LL * pad;
    if (stride < 1 || pad < 0 || ph < ws[2] || pw < ws[3]) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "%s: kernel %dx%d (stride %d, padding %d) does not fit input %s",
                     q->module->path, ws[2], ws[3], stride, pad, SHAPE_STR(x, sx));
        return false;
    }
    long long oh = (ph - ws[2]) / stride + 1, ow = (pw - ws[3]) / stride + 1;
    if ((long long)x->value.shape[0] * oh * ow > INT_MAX) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: input %s needs an im2col matrix wider than %d columns", q->module->path,
                     SHAPE_STR(x, sx), INT_MAX);
        return false;
    }
    *OH = (int)oh, *OW = (int)ow;
    return true;
}

/* y: (N, OC, OH*OW) = prod (OC, N*OH*OW) regrouped by image, plus bias (OC,) or NULL; prod may be y when N == 1. */
static void conv_output(float *y, const float *prod, const float *bias, const QConvDims *d) {
    const size_t plane = (size_t)d->OH * d->OW, n_cols = (size_t)d->N * plane;
    for (int n = 0; n < d->N; n++)
        for (int oc = 0; oc < d->OC; oc++) {
            float *dst = y + ((size_t)n * d->OC + oc) * plane;           /* [OH*OW] */
            const float *src = prod + (size_t)oc * n_cols + n * plane;  /* [OH*OW] */
            const float b = bias ? bias[oc] : 0.0f;
            for (size_t p = 0; p < plane; p++) dst[p] = src[p] + b;
        }
}

static void conv_bias_grad(float *db, const float *dy, const QConvDims *d) {
    const size_t plane = (size_t)d->OH * d->OW;
    for (int oc = 0; oc < d->OC; oc++) {
        double acc = 0.0;
        for (int n = 0; n < d->N; n++) {
            const float *g = dy + ((size_t)n * d->OC + oc) * plane;
            for (size_t p = 0; p < plane; p++) acc += g[p];
        }
        db[oc] += (float)acc;
    }
}

static void conv_backward(Tape *t, const TapeNode *node) {
    const QLayer *q = node->ctx;
    Var *x = node->in[0], *bias = node->in[1];
    const QConvDims d = conv_dims_of(q, x, node->out);
    const float *dy = node->out->grad; /* (N, OC, OH, OW) */
    const int ckk = q->fan_in, n_cols = d.N * d.OH * d.OW;
    if (bias && bias->requires_grad) {
        float *db = tape_grad(t, bias);
        if (!db) return;
        conv_bias_grad(db, dy, &d);
    }
    if (!x->requires_grad) return;
    const float *dyt = dy; /* (OC, N*OH*OW); dy's own layout when N == 1 */
    if (d.N > 1) {
        float *buf = tape_alloc(t, (size_t)d.OC * n_cols * sizeof *buf);
        if (!buf) return;
        const size_t plane = (size_t)d.OH * d.OW;
        for (int n = 0; n < d.N; n++)
            for (int oc = 0; oc < d.OC; oc++)
                memcpy(buf + (size_t)oc * n_cols + n * plane, dy + ((size_t)n * d.OC + oc) * plane,
                       plane * sizeof *buf);
        dyt = buf;
    }
    float *dx = tape_grad(t, x);                                       /* (N, C, H, W) */
    float *dcol = tape_alloc(t, (size_t)ckk * n_cols * sizeof *dcol);  /* (C*KH*KW, N*OH*OW) */
    float *band = band_alloc(t, q);                                    /* (band_rows, C*KH*KW) */
    if (!dx || !dcol || !band) return;
    for (int r0 = 0; r0 < q->out; r0 += q->band_rows) {
        int nb = band_len(q, r0);
        if (!band_load(t, q, r0, nb, band)) return;
        gemm_f32(true, false, ckk, n_cols, nb, 1.0f, band, ckk, dyt + (size_t)r0 * n_cols, n_cols, r0 ? 1.0f : 0.0f,
                 dcol, n_cols);
    }
    col2im(dx, dcol, d.N, d.C, d.H, d.W, d.KH, d.KW, d.stride, d.padding, d.OH, d.OW);
}

/* The whole weight dequantized, in the module's shape, as a Var of the
 * tape (no gradient), when it fits one tile (QLAYER_TILE_BYTES, so the
 * float copy stays within the layer's budget); NULL otherwise, or on error
 * (set on the tape). */
static Var *qlayer_weight_var(Tape *t, const QLayer *q) {
    if (q->band_rows < q->out) return NULL;
    Var *w = tape_new_var(t, q->w_ndim, q->w_shape);
    return w && band_load(t, q, 0, q->out, w->value.data) ? w : NULL;
}

/* A convolution whose weight fits one tile runs as nn_conv2d on the
 * dequantized weight (chunked, over the thread pool), so it computes
 * exactly what a float layer with that weight computes: a QAT layer's
 * fake-quantized weight gives the same bits as its converted QLayer. */
static Var *conv_forward(Tape *t, QLayer *q, Var *x, Var *bias) {
    int OH = 0, OW = 0;
    if (!q->module->conv_plain) {
        /* grouped, dilated or per-axis geometry: the dequantized weight (OC, C/groups, KH, KW), whole, then the
           module's own convolution */
        Var *w = tape_new_var(t, q->w_ndim, q->w_shape);
        if (!w || !band_load(t, q, 0, q->out, w->value.data)) return NULL;
        return model_conv_forward(t, q->module, x, w, bias);
    }
    if (!conv_check(t, q, x, &OH, &OW)) return NULL;
    Var *w = qlayer_weight_var(t, q);
    if (w) return nn_conv2d(t, x, w, bias, q->module->spec.stride, q->module->spec.padding);
    if (!tape_ok(t)) return NULL;
    Var *y = tape_new_var(t, 4, (const int[]){x->value.shape[0], q->out, OH, OW});
    if (!y) return NULL;
    const QConvDims d = conv_dims_of(q, x, y);
    const int ckk = q->fan_in, n_cols = d.N * OH * OW;
    float *col = tape_alloc(t, (size_t)ckk * n_cols * sizeof *col); /* (C*KH*KW, N*OH*OW) */
    float *band = band_alloc(t, q);                                 /* (band_rows, C*KH*KW) */
    /* the product (OC, N*OH*OW) is y's layout when N == 1 */
    float *prod = d.N == 1 ? y->value.data : tape_alloc(t, (size_t)d.OC * n_cols * sizeof *prod);
    if (!col || !band || !prod) return NULL;
    im2col(col, x->value.data, d.N, d.C, d.H, d.W, d.KH, d.KW, d.stride, d.padding, OH, OW);
    for (int r0 = 0; r0 < q->out; r0 += q->band_rows) {
        int nb = band_len(q, r0);
        if (!band_load(t, q, r0, nb, band)) return NULL;
        gemm_f32(false, false, nb, n_cols, ckk, 1.0f, band, ckk, col, n_cols, 0.0f, prod + (size_t)r0 * n_cols, n_cols);
    }
    conv_output(y->value.data, prod, bias ? bias->value.data : NULL, &d);
    return tape_record(t, "qlayer_conv2d", conv_backward, y, (Var *[]){x, bias}, 2, q) ? y : NULL;
}

/* ---- the layer --------------------------------------------------------------------------------------- */

static Var *qlayer_hook(Tape *t, Module *m, Var *x, void *ctx);

/* The int8 hand-off: the codes the readers of this op's output take (Tape.handoff), if each is a quantized layer
 * on the int8 path from codes and all have one quantizer (readers of one value calibrate alike); else NULL. Readers
 * that would take channel-quad planes of different layouts all take bytes, which every reader takes. */
static const VarCodes *handoff_codes(const Tape *t, VarCodes *c) {
    for (int i = 0; i < t->n_handoff; i++) {
        const Module *r = t->handoff[i];
        VarCodes ci;
        if (r->forward_hook != qlayer_hook || r->in_ndim != 3) return NULL;
        const int shape[4] = {0, r->in_shape[0], r->in_shape[1], r->in_shape[2]}; /* its input: this op's output */
        if (!qlayer_int8_reads_codes(t, r->hook_ctx, shape, &ci)) return NULL;
        if (i == 0) *c = ci;
        else if (ci.s != c->s || ci.lo != c->lo || ci.hi != c->hi || ci.zero != c->zero)
            return NULL;
        else if (ci.plane != c->plane)
            c->plane = 0;
    }
    return t->n_handoff ? c : NULL;
}

/* Whether this op's output goes to a globalavgpool alone (Tape.handoff), which then takes its planes' means. */
static bool handoff_means(const Tape *t) {
    const Module *r = t->n_handoff == 1 && !t->handoff_keep ? t->handoff[0] : NULL;
    return qlayer_int8_handoff && r && r->spec.type == LAYER_GLOBALAVGPOOL && !r->forward_hook;
}

/* Codes handed over reach only a layer on the int8 path (the producer asked); false, with the error, otherwise. */
static bool codes_read(Tape *t, const QLayer *q, const Var *x) {
    if (!x->codes || x->codes->floats) return true;
    qt_error_set(&t->err, QT_ERR_ARG, "%s: the input came as int8 codes, but this layer does not take the int8 path "
                 "(set QTRAIN_INT8_KERNEL=float to run without the hand-off)", q->module->path);
    return false;
}

/* Whether q's hook is its module's own rather than the base of another (a LoRA or DoRA adapter's, which reads the
 * output at once): only then are the module's readers (Tape.handoff) this op's readers, to take its output as
 * codes or means or to find it deferred into the int8 chain. */
static bool hook_outermost(const QLayer *q) {
    return q->module->forward_hook == qlayer_hook && q->module->hook_ctx == q;
}

Var *qlayer_forward(Tape *t, QLayer *q, Var *x) {
    if (!t || !x) return NULL;
    if (!q || !q->module || !q->weight.qtype) {
        qt_error_set(&t->err, QT_ERR_ARG, "qlayer_forward: the quantized layer is not initialised");
        return NULL;
    }
    if (!hook_outermost(q) && (t->n_handoff || t->handoff_merges)) { /* a float output, made now, for the adapter */
        const int n = t->n_handoff;
        const bool keep = t->handoff_keep, merges = t->handoff_merges;
        t->n_handoff = 0, t->handoff_keep = false, t->handoff_merges = false;
        Var *y = qlayer_forward(t, q, x);
        t->n_handoff = n, t->handoff_keep = keep, t->handoff_merges = merges;
        return y;
    }
    Var *bias = q->module->bias ? &q->module->bias->var : NULL;
    char sb[64];
    if (bias && (bias->value.ndim != 1 || bias->value.shape[0] != q->out)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "%s: bias %s does not match the %d output channels", q->module->path,
                     SHAPE_STR(bias, sb), q->out);
        return NULL;
    }
    const bool conv = q->module->spec.type == LAYER_CONV2D;
    if (qlayer_int8_applies(t, q, x, bias)) {
        /* nothing to record: the integer kernels (qlayer_int8.c) */
        int OH = 0, OW = 0; /* qlayer_int8_supported: a plain convolution, or one channel per group */
        VarCodes c;
        const VarCodes *hand = conv ? handoff_codes(t, &c) : NULL;
        const bool means = conv && handoff_means(t);
        if (conv && !q->module->conv_plain) return qlayer_int8_conv_dw(t, q, x, bias, CONV_EPI_NONE, hand, means);
        if (conv)
            return conv_check(t, q, x, &OH, &OW)
                       ? qlayer_int8_conv_fused(t, q, x, bias, OH, OW, CONV_EPI_NONE, NULL, hand, means)
                       : NULL;
        return codes_read(t, q, x) && dense_check(t, q, x) ? qlayer_int8_dense(t, q, x, bias) : NULL;
    }
    /* the float path reads x as it is now: what the int8 chain defers runs first (model_forward's rule for ops
       that are not int8 convs) */
    if (!tape_run_deferred(t) || !codes_read(t, q, x)) return NULL;
    Var *xin = layer_input(t, q, x);
    if (!xin) return NULL;
    return conv ? conv_forward(t, q, xin, bias) : dense_forward(t, q, xin, bias);
}

static Var *qlayer_hook(Tape *t, Module *m, Var *x, void *ctx) {
    (void)m;
    return qlayer_forward(t, ctx, x);
}

/* For a hook folded over this layer (a LoRA adapter): the dequantized
 * conv weight, if the input needs no activation quantization and the
 * weight fits one tile. */
static Var *qlayer_weight_hook(Tape *t, Module *m, void *ctx) {
    QLayer *q = ctx;
    (void)m;
    if (q->spec.act_qtype || q->module->spec.type != LAYER_CONV2D || !q->module->conv_plain) return NULL;
    return qlayer_weight_var(t, q);
}

/* conv2d with the following relu (and 2x2 max pool) folded in: on the
 * integer kernels where the int8 path applies, else on the dequantized
 * weight; declines (NULL, no error) for weights over one tile and, on the
 * int8 path, for a bias of the wrong shape, which then run as the layer
 * (which reports the bias) and separate ops. */
static Var *qlayer_fused_hook(Tape *t, Module *m, Var *x, void *ctx, Var *bias, ConvEpilogue epi) {
    QLayer *q = ctx;
    int OH = 0, OW = 0;
    VarCodes c;
    if (t->residual) { /* a residual add: the int8 path of a plain conv alone takes it; the rest declines */
        if (!m->conv_plain || epi == CONV_EPI_RELU_MAXPOOL2 || !qlayer_int8_applies(t, q, x, bias) ||
            (bias && (bias->value.ndim != 1 || bias->value.shape[0] != q->out)) || !conv_check(t, q, x, &OH, &OW))
            return NULL;
        const Var *r = t->residual;
        if ((r->codes && !r->codes->floats) || r->value.ndim != 4 || r->value.shape[0] != x->value.shape[0] ||
            r->value.shape[1] != q->out || r->value.shape[2] != OH || r->value.shape[3] != OW)
            return NULL; /* the add then reports the shapes */
        return qlayer_int8_conv_fused(t, q, x, bias, OH, OW, epi, r, handoff_codes(t, &c), handoff_means(t));
    }
    if (!m->conv_plain) {
        /* one input channel per group on the int8 path: its kernel has the epilogues; any other geometry declines
           (nn_conv2d_fused is plain) */
        if (!qlayer_int8_applies(t, q, x, bias) || (bias && (bias->value.ndim != 1 || bias->value.shape[0] != q->out)))
            return NULL;
        return qlayer_int8_conv_dw(t, q, x, bias, epi, handoff_codes(t, &c), handoff_means(t));
    }
    if (!conv_check(t, q, x, &OH, &OW)) return NULL;
    if (qlayer_int8_applies(t, q, x, bias)) {
        if (bias && (bias->value.ndim != 1 || bias->value.shape[0] != q->out)) return NULL;
        return qlayer_int8_conv_fused(t, q, x, bias, OH, OW, epi, NULL, handoff_codes(t, &c), handoff_means(t));
    }
    if (!tape_run_deferred(t) || !codes_read(t, q, x)) return NULL;
    Var *w = qlayer_weight_var(t, q), *xin = w ? layer_input(t, q, x) : NULL;
    return w && xin ? nn_conv2d_fused(t, xin, w, bias, m->spec.stride, m->spec.padding, epi) : NULL;
}

void qlayer_install(QLayer *q) {
    if (!q || !q->module) return;
    const bool conv = q->module->spec.type == LAYER_CONV2D;
    q->module->forward_hook = qlayer_hook;
    q->module->fused_hook = conv ? qlayer_fused_hook : NULL;
    q->module->fused_residual = conv; /* the int8 path's conv adds it; the others decline */
    q->module->weight_hook = conv ? qlayer_weight_hook : NULL;
    q->module->hook_ctx = q;
}
