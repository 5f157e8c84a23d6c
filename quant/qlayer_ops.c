/* qlayer_ops.c - the quantized layer's forward and input gradient.
 *
 * The weight (out, fan_in) is never dequantized whole: bands of band_rows
 * output channels are dequantized into one arena buffer and fed to sgemm
 * one after the other.
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
#include "qlayer.h"
#include "qlayer_int8.h"

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

static void dense_backward(Tape *t, const TapeNode *node) {
    const QLayer *q = node->ctx;
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
    float *band = band_alloc(t, q); /* (band_rows, in) */
    if (!dx || !band) return;
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

static Var *dense_forward(Tape *t, QLayer *q, Var *x, Var *bias) {
    if (!dense_check(t, q, x)) return NULL;
    const int N = x->value.shape[0], in = q->fan_in, out = q->out;
    Var *y = tape_new_var(t, 2, (const int[]){N, out});
    float *band = band_alloc(t, q); /* (band_rows, in) */
    if (!y || !band) return NULL;
    /* the bias first, so every band's GEMM adds onto it (beta = 1) */
    float beta = 0.0f;
    if (bias) {
        for (int n = 0; n < N; n++)
            memcpy(y->value.data + (size_t)n * out, bias->value.data, (size_t)out * sizeof(float));
        beta = 1.0f;
    }
    for (int r0 = 0; r0 < out; r0 += q->band_rows) {
        int nb = band_len(q, r0);
        if (!band_load(t, q, r0, nb, band)) return NULL;
        gemm_f32(false, true, N, nb, in, 1.0f, x->value.data, in, band, in, beta, y->value.data + r0, out);
    }
    return tape_record(t, "qlayer_dense", dense_backward, y, (Var *[]){x, bias}, 2, q) ? y : NULL;
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

Var *qlayer_forward(Tape *t, QLayer *q, Var *x) {
    if (!t || !x) return NULL;
    if (!q || !q->module || !q->weight.qtype) {
        qt_error_set(&t->err, QT_ERR_ARG, "qlayer_forward: the quantized layer is not initialised");
        return NULL;
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
        int OH = 0, OW = 0;
        if (conv) return conv_check(t, q, x, &OH, &OW) ? qlayer_int8_conv(t, q, x, bias, OH, OW) : NULL;
        return dense_check(t, q, x) ? qlayer_int8_dense(t, q, x, bias) : NULL;
    }
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
    if (q->spec.act_qtype || q->module->spec.type != LAYER_CONV2D) return NULL;
    return qlayer_weight_var(t, q);
}

/* conv2d with the following relu (and 2x2 max pool) folded in: on the
 * integer kernels where the int8 path applies, else on the dequantized
 * weight; declines (NULL, no error) for weights over one tile and, on the
 * int8 path, for a bias of the wrong shape, which then run as the layer
 * (which reports the bias) and separate ops. */
static Var *qlayer_fused_hook(Tape *t, Module *m, Var *x, void *ctx, ConvEpilogue epi) {
    QLayer *q = ctx;
    Var *bias = m->bias ? &m->bias->var : NULL;
    int OH = 0, OW = 0;
    if (!conv_check(t, q, x, &OH, &OW)) return NULL;
    if (qlayer_int8_applies(t, q, x, bias)) {
        if (bias && (bias->value.ndim != 1 || bias->value.shape[0] != q->out)) return NULL;
        return qlayer_int8_conv_fused(t, q, x, bias, OH, OW, epi);
    }
    Var *w = qlayer_weight_var(t, q), *xin = w ? layer_input(t, q, x) : NULL;
    return w && xin ? nn_conv2d_fused(t, xin, w, bias, m->spec.stride, m->spec.padding, epi) : NULL;
}

void qlayer_install(QLayer *q) {
    if (!q || !q->module) return;
    const bool conv = q->module->spec.type == LAYER_CONV2D;
    q->module->forward_hook = qlayer_hook;
    q->module->fused_hook = conv ? qlayer_fused_hook : NULL;
    q->module->weight_hook = conv ? qlayer_weight_hook : NULL;
    q->module->hook_ctx = q;
}
