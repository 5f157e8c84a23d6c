/* intprog.c - lowering a PTQ model to the integer program of intprog.h,
 * planning its arena, and running it on device/qtrain_rt.c. */
#define _GNU_SOURCE /* qsort_r */
#include "intprog.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant/fakequant_internal.h"
#include "quant/qgemm.h"
#include "quant/qlayer.h"

/* ---- calibration of output ranges ---------------------------------------------------------------------------- */

QtStatus intprog_calibrate(Net *n, const Dataset *train, int batch_size, int batches, Tape *t, float *x,
                           float (*range)[2], QtError *err) {
    Model *m = &n->model;
    const int bs = batch_size < train->n ? batch_size : train->n;
    if ((int64_t)batches * bs > train->n) batches = train->n / bs;
    if (batches < 1) batches = 1;
    for (int i = 0; i < m->n_modules; i++) range[i][0] = FLT_MAX, range[i][1] = -FLT_MAX;
    const bool keep = m->keep_outputs, training = t->training, grad = t->grad_enabled;
    m->keep_outputs = true, t->training = false, t->grad_enabled = false;
    QtStatus st = QT_OK;
    int shape[4] = {bs};
    for (int k = 0; k < m->input_ndim; k++) shape[1 + k] = m->input_shape[k];
    for (int b = 0; b < batches && st == QT_OK; b++) {
        QtError e = {0};
        if (dataset_fill_range(train, b * bs, bs, x, NULL, &e) != QT_OK) {
            st = qt_error_set(err, e.status, "calibrating the integer program's ranges, batch %d: %s", b, e.msg);
            break;
        }
        Var **outs = m->outs;
        outs[0] = tape_wrap(t, x, 1 + m->input_ndim, shape);
        for (int i = 0; i < m->n_modules && st == QT_OK; i++) {
            const Var *y = model_step(m, t, i, outs);
            if (!y) {
                st = qt_error_set(err, t->err.status, "calibrating the integer program's ranges, batch %d, module "
                                  "%s: %s", b, m->modules[i].path, t->err.msg);
                break;
            }
            const float *v = y->value.data;
            const size_t nv = tensor_numel(&y->value);
            for (size_t k = 0; k < nv; k++) {
                if (!isfinite(v[k])) {
                    st = qt_error_set(err, QT_ERR_VALUE, "calibrating the integer program's ranges, batch %d: "
                                      "module %s's output is not finite", b, m->modules[i].path);
                    break;
                }
                if (v[k] < range[i][0]) range[i][0] = v[k];
                if (v[k] > range[i][1]) range[i][1] = v[k];
            }
        }
        tape_reset(t);
    }
    m->keep_outputs = keep, t->training = training, t->grad_enabled = grad;
    return st;
}

/* ---- quantization parameters ----------------------------------------------------------------------------------- */

/* A value's int8 parameters, kept in the form qgemm_quantize_u8 takes (s, lo, hi, zero: the uint8 code of 0) so
 * the input table quantizes exactly as qtrain's int8 path does; the int8 code is the uint8 one - 128. */
typedef struct {
    bool set;
    float s, lo, hi;
    int zero;
    int from;            /* the module whose static input range it is, or -1: a calibrated output range */
} QParams;

static int32_t qp_zp(const QParams *q) { return q->zero - 128; }

/* The static input range of a quantized layer, as qlayer_int8.c's act_codes makes it. */
static QParams qp_of_layer(const QLayer *q, int module) {
    const QType *at = q->spec.act_qtype;
    const float zp = q->spec.act_symmetric ? 0.0f : q->act_zero_point;
    QParams p = {.set = true, .s = fq_effective_scale(q->act_scale), .from = module};
    p.zero = (int)zp + (at->kind == QTYPE_KIND_INT ? 128 : 0);
    fq_int_code_bounds(at, false, zp, &p.lo, &p.hi);
    return p;
}

/* Asymmetric int8 over [lo, hi] widened to hold 0. */
static QParams qp_of_range(float lo, float hi) {
    if (lo > 0.0f) lo = 0.0f;
    if (hi < 0.0f) hi = 0.0f;
    QParams p = {.set = true, .from = -1};
    p.s = hi > lo ? (hi - lo) / 255.0f : 1.0f;
    long z = lrintf(-lo / p.s);
    p.zero = (int)(z < 0 ? 0 : z > 255 ? 255 : z);
    p.lo = (float)-p.zero, p.hi = (float)(255 - p.zero);
    return p;
}

/* real multiplier m >= 0 -> mult in [2^30, 2^31) (or 0) and shift in [1, 62] with m ~ mult / 2^shift. */
static bool quant_multiplier(double m, int32_t *mult, int *shift) {
    if (!(m > 0.0) || !isfinite(m)) {
        *mult = 0, *shift = 1;
        return m == 0.0;
    }
    int e;
    double f = frexp(m, &e); /* m = f 2^e, f in [0.5, 1) */
    long long q = llround(f * 2147483648.0);
    if (q == 2147483648LL) q /= 2, e++;
    int s = 31 - e;
    if (s < 1) return false; /* m >= 2^30: no such scale ratio in a sane model */
    while (s > 62) q = (q + 1) / 2, s--;
    *mult = (int32_t)q, *shift = s;
    return true;
}

/* ---- the program under construction --------------------------------------------------------------------------- */

typedef struct {
    IntProgram *p;
    const Net *n;
    const Model *m;
    const float (*range)[2];
    int *cls;             /* [n_modules + 1] the value whose parameters this value shares (the input: n_modules) */
    QParams *qp;          /* [n_modules + 1] per class representative */
    int *buf;             /* [n_modules + 1] the buffer holding the value, -1 until made */
    int *op_of;           /* [n_modules + 1] the op that wrote the value's buffer last, or -1 */
    int cap_ops, cap_bufs;
    bool low_ram;         /* no scratch for the convs */
    QtError *err;
} Lower;

static int vid(const Lower *L, int module) { return module < 0 ? L->m->n_modules : module; }

static void *own(IntProgram *p, size_t bytes) {
    if (p->n_owned == p->cap_owned) {
        int cap = p->cap_owned ? 2 * p->cap_owned : 32;
        void **o = realloc(p->owned, (size_t)cap * sizeof *o);
        if (!o) return NULL;
        p->owned = o, p->cap_owned = cap;
    }
    void *b = calloc(1, bytes ? bytes : 1);
    if (b) p->owned[p->n_owned++] = b;
    return b;
}

/* A buffer live from op `first` (the op that writes it) on; readers extend it. */
static int new_buf(Lower *L, size_t bytes, int first) {
    IntProgram *p = L->p;
    if (p->n_bufs == L->cap_bufs) {
        int cap = L->cap_bufs ? 2 * L->cap_bufs : 32;
        IntBuf *b = realloc(p->bufs, (size_t)cap * sizeof *b);
        if (!b) return -1;
        p->bufs = b, L->cap_bufs = cap;
    }
    p->bufs[p->n_bufs] = (IntBuf){.bytes = bytes, .first = first, .last = first};
    return p->n_bufs++;
}

static IntOp *new_op(Lower *L, IntOpKind kind, int module) {
    IntProgram *p = L->p;
    if (p->n_ops == L->cap_ops) {
        int cap = L->cap_ops ? 2 * L->cap_ops : 32;
        IntOp *o = realloc(p->ops, (size_t)cap * sizeof *o);
        if (!o) return NULL;
        p->ops = o, L->cap_ops = cap;
    }
    IntOp *o = &p->ops[p->n_ops++];
    *o = (IntOp){.kind = kind, .module = module, .in = {-1, -1}, .out = -1, .scratch = -1};
    return o;
}

static size_t value_size(const Lower *L, int module) {
    const Module *mod = &L->m->modules[module];
    size_t n = 1;
    for (int k = 0; k < mod->out_ndim; k++) n *= (size_t)mod->out_shape[k];
    return n;
}

static const QLayer *qlayer_of(const Net *n, const Module *m) {
    return hook_find(hook_layers_find(&n->hooks, &HOOK_PTQ), m);
}

/* ---- checks and value classes ---------------------------------------------------------------------------------- */

static bool transparent(const Model *m, int i);

/* Whether a relu at module i may clamp its class's values: nothing but the chain leading to it reads any value
 * of the chain back to the op that made them (else a reader of an earlier value would see it clamped). */
static bool relu_owns_chain(const Model *m, int i) {
    for (int v = m->modules[i].inputs[0];; v = m->modules[v].inputs[0]) {
        if (v < 0 || m->modules[v].n_consumers != 1) return false;
        if (!transparent(m, v)) return true;
    }
}

static bool transparent(const Model *m, int i) {
    const Module *mod = &m->modules[i];
    switch (mod->spec.type) {
    case LAYER_MAXPOOL2D:
    case LAYER_FLATTEN:
    case LAYER_DROPOUT: return true;
    case LAYER_RELU: return relu_owns_chain(m, i);
    case LAYER_BATCHNORM1D:
    case LAYER_BATCHNORM2D: return mod->bn_folded != BN_FOLD_NONE;
    default: return false;
    }
}

static QtStatus check_module(const Lower *L, int i) {
    const Module *mod = &L->m->modules[i];
    QtError *err = L->err;
    switch (mod->spec.type) {
    case LAYER_DENSE:
    case LAYER_CONV2D: {
        const QLayer *q = qlayer_of(L->n, mod);
        if (!q || !q->weight.qtype)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: a float %s layer: the integer program needs every dense "
                                "and conv2d layer quantized; give it a quant rule with weight_qtype int8 (or int4) "
                                "and act_qtype int8 or uint8", mod->path, layer_type_name(mod->spec.type));
        const QType *w = q->weight.qtype;
        if (w->kind != QTYPE_KIND_INT || (w->bits != 8 && w->bits != 4))
            return qt_error_set(err, QT_ERR_CONFIG, "%s: weight format %s: the integer program takes int8 or int4 "
                                "weights; set its rule's weight_qtype to int8 or int4", mod->path, w->name);
        if (q->weight.asymmetric)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: the weight has zero points; the integer program takes "
                                "symmetric weights: drop symmetric: false from its rule", mod->path);
        if (q->spec.tile_size != 0 || (q->weight.n_scales != 1 && q->weight.n_scales != (size_t)q->out) ||
            q->weight.double_quant)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: the weight has block scales; the integer program takes one "
                                "scale per output channel or per tensor: drop tile_size and double_quant from its "
                                "rule", mod->path);
        const QType *a = q->spec.act_qtype;
        if (!a)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: the input has no static range (no act_qtype: the layer "
                                "computes on float inputs); give its rule act_qtype int8 or uint8 and run the PTQ "
                                "with calibration data", mod->path);
        if ((a->kind != QTYPE_KIND_INT && a->kind != QTYPE_KIND_UINT) || a->bits != 8)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: act_qtype %s: the integer program takes int8 or uint8 "
                                "inputs; set its rule's act_qtype to int8 or uint8", mod->path, a->name);
        if (!q->act_ready || !(q->act_scale > 0.0f) || isinf(q->act_scale))
            return qt_error_set(err, QT_ERR_CONFIG, "%s: the input's static range is missing (not calibrated); run "
                                "the PTQ with calibration data (qtrain --config with train.epochs: 0)", mod->path);
        return QT_OK;
    }
    case LAYER_RELU:
    case LAYER_MAXPOOL2D:
    case LAYER_AVGPOOL2D:
    case LAYER_GLOBALAVGPOOL:
    case LAYER_FLATTEN:
    case LAYER_DROPOUT:
    case LAYER_CONCAT: return QT_OK;
    case LAYER_ADD:
        if (mod->n_inputs != 2)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: an add of %d inputs; the integer program adds two: split it "
                                "into adds of two", mod->path, mod->n_inputs);
        return QT_OK;
    case LAYER_BATCHNORM1D:
    case LAYER_BATCHNORM2D:
        if (mod->bn_folded != BN_FOLD_NONE) return QT_OK;
        return qt_error_set(err, QT_ERR_CONFIG, "%s: a batch norm that is not folded; the integer program folds "
                            "every batch norm into the conv2d or dense layer before it: set quant.fold_bn: true and "
                            "place it right after a layer whose output only it reads", mod->path);
    default:
        return qt_error_set(err, QT_ERR_CONFIG, "%s: a %s layer has no integer form; the integer program takes "
                            "conv2d, dense, relu, max/avg/global pools, add, concat, flatten, dropout and folded "
                            "batch norms", mod->path, layer_type_name(mod->spec.type));
    }
}

/* Every value's class, and each class's parameters. */
static QtStatus assign_classes(Lower *L) {
    const Model *m = L->m;
    const int N = m->n_modules;
    L->cls[N] = N;
    for (int i = 0; i < N; i++) L->cls[i] = transparent(m, i) ? L->cls[vid(L, m->modules[i].inputs[0])] : i;
    /* readers that are quantized layers fix their input's class */
    for (int i = 0; i < N; i++) {
        const Module *mod = &m->modules[i];
        if (mod->spec.type != LAYER_DENSE && mod->spec.type != LAYER_CONV2D) continue;
        const int c = L->cls[vid(L, mod->inputs[0])];
        QParams q = qp_of_layer(qlayer_of(L->n, mod), i);
        QParams *have = &L->qp[c];
        if (!have->set) {
            *have = q;
        } else if (have->s != q.s || have->zero != q.zero || have->lo != q.lo || have->hi != q.hi) {
            return qt_error_set(L->err, QT_ERR_CONFIG, "%s and %s read the same values with different static input "
                                "ranges (scale %g zero point %d, scale %g zero point %d); the integer program keeps "
                                "one: give both the same act rule", m->modules[have->from].path, mod->path,
                                (double)have->s, have->zero, (double)q.s, q.zero);
        }
    }
    /* the other classes: the calibrated range of their members (after a relu in the class: from 0) */
    for (int c = 0; c <= N; c++) {
        if (L->cls[c] != c || L->qp[c].set) continue;
        if (c == N)
            return qt_error_set(L->err, QT_ERR_CONFIG, "the model's input is read by no quantized layer, so it has "
                                "no static range; the integer program starts with a conv2d or dense layer");
        float lo = FLT_MAX, hi = -FLT_MAX;
        bool relu = false;
        for (int i = 0; i < N; i++) {
            if (L->cls[i] != c) continue;
            relu |= m->modules[i].spec.type == LAYER_RELU;
            if (L->range[i][0] < lo) lo = L->range[i][0];
            if (L->range[i][1] > hi) hi = L->range[i][1];
        }
        if (!(lo <= hi))
            return qt_error_set(L->err, QT_ERR_CONFIG, "%s: no calibrated output range", m->modules[c].path);
        L->qp[c] = qp_of_range(relu ? 0.0f : lo, hi);
    }
    return QT_OK;
}

/* ---- ops ------------------------------------------------------------------------------------------------------- */

static const QParams *qp_value(const Lower *L, int module) { return &L->qp[L->cls[vid(L, module)]]; }

/* The bias (float, [out]) the layer adds: its own, or a batch norm folded after it with BN_FOLD_BIAS. */
static const float *layer_bias(const Model *m, int i) {
    if (m->modules[i].bias) return m->modules[i].bias->var.value.data;
    for (int k = i + 1; k < m->n_modules; k++) {
        const Module *b = &m->modules[k];
        if (b->bn_folded == BN_FOLD_BIAS && b->inputs[0] == i && b->bias) return b->bias->var.value.data;
    }
    return NULL;
}

/* The weight's integer codes ([out * fan_in], each in -128..127 or -8..7) and scales. */
static QtStatus layer_codes(const QLayer *q, int8_t *codes, float *ws, QtError *err) {
    const size_t n = (size_t)q->out * q->fan_in;
    uint32_t *raw = malloc(n * sizeof *raw);
    if (!raw) return qt_error_set(err, QT_ERR_NOMEM, "%s: out of memory", q->module->path);
    QtStatus st = qtype_unpack(q->weight.qtype, q->weight.codes, n, raw);
    if (st != QT_OK) {
        free(raw);
        return qt_error_set(err, st, "%s: the weight's codes do not unpack", q->module->path);
    }
    for (size_t k = 0; k < n; k++) codes[k] = (int8_t)lrintf(qtype_decode(q->weight.qtype, raw[k]));
    free(raw);
    for (int o = 0; o < q->out; o++) ws[o] = qarray_scale_at(&q->weight, q->weight.n_scales == 1 ? 0 : (size_t)o);
    return QT_OK;
}

/* Constants of a conv or dense layer: packed weight, int32 bias, requantization per output channel. */
static QtStatus layer_consts(Lower *L, int i, const void **w, const int32_t **bias, const int32_t **mult,
                             const int8_t **shift, int *w_bits, int32_t *in_zp) {
    const Module *mod = &L->m->modules[i];
    const QLayer *q = qlayer_of(L->n, mod);
    const int out = q->out, K = q->fan_in;
    const QParams *in = qp_value(L, mod->inputs[0]), *o = qp_value(L, i);
    IntProgram *p = L->p;
    const bool four = q->weight.qtype->bits == 4;
    const size_t n = (size_t)out * K, wbytes = four ? (n + 1) / 2 : n;
    int8_t *codes = malloc(n);
    float *ws = malloc((size_t)out * sizeof *ws);
    uint8_t *wp = own(p, wbytes);
    int32_t *b = own(p, (size_t)out * 4), *mu = own(p, (size_t)out * 4);
    int8_t *sh = own(p, (size_t)out);
    QtStatus st = codes && ws && wp && b && mu && sh ? QT_OK
                                                     : qt_error_set(L->err, QT_ERR_NOMEM, "%s: out of memory", mod->path);
    if (st == QT_OK) st = layer_codes(q, codes, ws, L->err);
    const float *bf = layer_bias(L->m, i);
    for (int c = 0; st == QT_OK && c < out; c++) {
        const double sacc = (double)in->s * ws[c];
        double bq = bf ? (double)bf[c] / sacc : 0.0;
        if (!isfinite(bq) || fabs(bq) > 2147483647.0)
            st = qt_error_set(L->err, QT_ERR_CONFIG, "%s: output channel %d's bias %g is %g steps of the product "
                              "scale, beyond int32; its weight scale is degenerate", mod->path, c,
                              bf ? (double)bf[c] : 0.0, bq);
        b[c] = (int32_t)llround(bq);
        double bound = fabs((double)b[c]);
        for (int k = 0; k < K; k++) bound += 255.0 * abs(codes[(size_t)c * K + k]);
        if (st == QT_OK && bound >= 2147483647.0)
            st = qt_error_set(L->err, QT_ERR_CONFIG, "%s: output channel %d's sum may leave int32 (bound %.0f)",
                              mod->path, c, bound);
        int s = 1;
        if (st == QT_OK && !quant_multiplier(sacc / o->s, &mu[c], &s))
            st = qt_error_set(L->err, QT_ERR_CONFIG, "%s: output channel %d's requantization scale %g is out of "
                              "range", mod->path, c, sacc / o->s);
        sh[c] = (int8_t)s;
    }
    if (st == QT_OK) {
        if (four) {
            for (size_t k = 0; k < n; k++)
                wp[k / 2] |= (uint8_t)(((uint8_t)codes[k] & 0xF) << (k % 2 ? 4 : 0));
        } else {
            memcpy(wp, codes, n);
        }
        p->weight_bytes += wbytes, p->const_bytes += (size_t)out * 9;
        p->int4_layers += four;
        *w = wp, *bias = b, *mult = mu, *shift = sh, *w_bits = four ? 4 : 8, *in_zp = qp_zp(in);
    }
    free(codes), free(ws);
    return st;
}

/* The op that made module i's output (through aliases), or NULL. */
static IntOp *producer(Lower *L, int module) {
    const int v = vid(L, module);
    return L->op_of[v] >= 0 ? &L->p->ops[L->op_of[v]] : NULL;
}

static void set_act_min(IntOp *o, int32_t lo) {
    switch (o->kind) {
    case IOP_CONV: o->p.conv.act_min = lo; break;
    case IOP_DENSE: o->p.dense.act_min = lo; break;
    case IOP_AVGPOOL: o->p.avgpool.act_min = lo; break;
    case IOP_ADD: o->p.add.act_min = lo; break;
    case IOP_REQUANT: o->p.requant.act_min = lo; break;
    default: break;
    }
}

static bool read_buf(Lower *L, IntOp *o, int k, int module) {
    const int b = L->buf[vid(L, module)];
    o->in[k] = b;
    if (b >= 0 && L->p->bufs[b].last < L->p->n_ops - 1) L->p->bufs[b].last = L->p->n_ops - 1;
    return b >= 0;
}

static QtStatus lower_layer(Lower *L, int i) {
    const Module *mod = &L->m->modules[i];
    const bool conv = mod->spec.type == LAYER_CONV2D;
    const QParams *o = qp_value(L, i);
    IntOp *op = new_op(L, conv ? IOP_CONV : IOP_DENSE, i);
    if (!op) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
    const int opi = L->p->n_ops - 1;
    read_buf(L, op, 0, mod->inputs[0]);
    const void *w;
    const int32_t *bias, *mult;
    const int8_t *shift;
    int bits;
    int32_t in_zp;
    QtStatus st = layer_consts(L, i, &w, &bias, &mult, &shift, &bits, &in_zp);
    if (st != QT_OK) return st;
    op = &L->p->ops[opi];
    if (conv) {
        const ConvGeom2d *g = &mod->geom;
        qrt_conv2d_t *c = &op->p.conv;
        *c = (qrt_conv2d_t){.in_c = mod->in_shape[0], .in_h = mod->in_shape[1], .in_w = mod->in_shape[2],
                            .out_c = mod->out_shape[0], .out_h = mod->out_shape[1], .out_w = mod->out_shape[2],
                            .k_h = mod->weight->var.value.shape[2], .k_w = mod->weight->var.value.shape[3],
                            .stride_h = g->stride_h, .stride_w = g->stride_w, .pad_t = g->pad_h, .pad_l = g->pad_w,
                            .dil_h = g->dil_h, .dil_w = g->dil_w, .groups = g->groups, .w_bits = bits, .weight = w,
                            .bias = bias, .mult = mult, .shift = shift, .in_zp = in_zp, .out_zp = qp_zp(o),
                            .act_min = -128, .act_max = 127};
        if (c->dil_h < 1) c->dil_h = 1;
        if (c->dil_w < 1) c->dil_w = 1;
        if (c->groups < 1) c->groups = 1;
        op->macs = (double)c->out_c * c->out_h * c->out_w * (c->in_c / c->groups) * c->k_h * c->k_w;
        const size_t scratch = L->low_ram ? 0 : qrt_conv2d_scratch(c);
        if (scratch) {
            op->scratch = new_buf(L, scratch, opi);
            if (op->scratch < 0) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
            op = &L->p->ops[opi];
        }
        L->p->conv_layers++;
    } else {
        qrt_dense_t *d = &op->p.dense;
        *d = (qrt_dense_t){.in = mod->in_shape[0], .out = mod->out_shape[0], .w_bits = bits, .weight = w,
                           .bias = bias, .mult = mult, .shift = shift, .in_zp = in_zp, .out_zp = qp_zp(o),
                           .act_min = -128, .act_max = 127};
        for (int k = 1; k < mod->in_ndim; k++) d->in *= mod->in_shape[k];
        op->macs = (double)d->in * d->out;
        L->p->dense_layers++;
    }
    const int b = new_buf(L, value_size(L, i), opi);
    if (b < 0) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
    L->p->ops[opi].out = b, L->buf[i] = b, L->op_of[i] = opi;
    return QT_OK;
}

/* y's scale over x's, with n values summed (pools), as one multiplier and shift. */
static QtStatus rescale(Lower *L, int i, double m, int32_t *mult, int *shift) {
    if (quant_multiplier(m, mult, shift)) return QT_OK;
    return qt_error_set(L->err, QT_ERR_CONFIG, "%s: the requantization scale %g is out of range",
                        L->m->modules[i].path, m);
}

static QtStatus lower_pool(Lower *L, int i) {
    const Module *mod = &L->m->modules[i];
    const bool avg = mod->spec.type != LAYER_MAXPOOL2D, global = mod->spec.type == LAYER_GLOBALAVGPOOL;
    const int C = mod->in_shape[0], H = mod->in_shape[1], W = mod->in_shape[2];
    const int kh = global ? H : mod->spec.kernel, kw = global ? W : mod->spec.kernel;
    const int sh = global ? 1 : mod->spec.stride, sw = sh;
    const int OH = global ? 1 : mod->out_shape[1], OW = global ? 1 : mod->out_shape[2];
    IntOp *op = new_op(L, avg ? IOP_AVGPOOL : IOP_MAXPOOL, i);
    if (!op) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
    const int opi = L->p->n_ops - 1;
    read_buf(L, op, 0, mod->inputs[0]);
    if (avg) {
        const QParams *in = qp_value(L, mod->inputs[0]), *o = qp_value(L, i);
        qrt_avgpool2d_t *a = &op->p.avgpool;
        *a = (qrt_avgpool2d_t){.c = C, .in_h = H, .in_w = W, .out_h = OH, .out_w = OW, .k_h = kh, .k_w = kw,
                               .stride_h = sh, .stride_w = sw, .in_zp = qp_zp(in), .out_zp = qp_zp(o),
                               .act_min = -128, .act_max = 127};
        QtStatus st = rescale(L, i, (double)in->s / ((double)kh * kw * o->s), &a->mult, &a->shift);
        if (st != QT_OK) return st;
        L->p->const_bytes += 0;
    } else {
        op->p.maxpool = (qrt_maxpool2d_t){.c = C, .in_h = H, .in_w = W, .out_h = OH, .out_w = OW, .k_h = kh,
                                          .k_w = kw, .stride_h = sh, .stride_w = sw};
    }
    const int b = new_buf(L, value_size(L, i), opi);
    if (b < 0) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
    L->p->ops[opi].out = b, L->buf[i] = b;
    /* a max pool keeps the codes: the op that made its input still sets the clamp of a relu after it */
    L->op_of[i] = avg ? opi : L->op_of[vid(L, mod->inputs[0])];
    return QT_OK;
}

static QtStatus lower_add(Lower *L, int i) {
    const Module *mod = &L->m->modules[i];
    const QParams *a = qp_value(L, mod->inputs[0]), *b = qp_value(L, mod->inputs[1]), *o = qp_value(L, i);
    IntOp *op = new_op(L, IOP_ADD, i);
    if (!op) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
    const int opi = L->p->n_ops - 1;
    read_buf(L, op, 0, mod->inputs[0]);
    read_buf(L, op, 1, mod->inputs[1]);
    const double ma = (double)a->s / o->s, mb = (double)b->s / o->s, big = ma > mb ? ma : mb;
    int32_t m0;
    int shift;
    QtStatus st = rescale(L, i, big, &m0, &shift);
    if (st != QT_OK) return st;
    const double two = ldexp(1.0, shift);
    qrt_add_t *ad = &op->p.add;
    *ad = (qrt_add_t){.n = (int)value_size(L, i), .a_zp = qp_zp(a), .b_zp = qp_zp(b),
                      .a_mult = (int32_t)llround(ma * two), .b_mult = (int32_t)llround(mb * two), .shift = shift,
                      .out_zp = qp_zp(o), .act_min = -128, .act_max = 127};
    const int buf = new_buf(L, value_size(L, i), opi);
    if (buf < 0) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
    L->p->ops[opi].out = buf, L->buf[i] = buf, L->op_of[i] = opi;
    return QT_OK;
}

/* x's values into out's range, written at bytes `at` of buffer `buf`; act_min the code of 0 with a relu. */
static QtStatus lower_requant(Lower *L, int i, int input, int buf, size_t at, size_t n, bool relu) {
    const QParams *in = qp_value(L, input), *o = qp_value(L, i);
    IntOp *op = new_op(L, IOP_REQUANT, i);
    if (!op) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
    const int opi = L->p->n_ops - 1;
    read_buf(L, op, 0, input);
    qrt_requant_t *r = &op->p.requant;
    *r = (qrt_requant_t){.n = (int)n, .in_zp = qp_zp(in), .out_zp = qp_zp(o), .act_min = relu ? qp_zp(o) : -128,
                         .act_max = 127};
    QtStatus st = rescale(L, i, (double)in->s / o->s, &r->mult, &r->shift);
    op->out = buf, op->out_at = at;
    (void)opi;
    return st;
}

static QtStatus lower_concat(Lower *L, int i) {
    const Module *mod = &L->m->modules[i];
    const int buf = new_buf(L, value_size(L, i), L->p->n_ops);
    if (buf < 0) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
    size_t at = 0;
    for (int k = 0; k < mod->n_inputs; k++) {
        const int in = mod->inputs[k];
        const size_t n = in < 0 ? L->p->in_size : value_size(L, in);
        QtStatus st = lower_requant(L, i, in, buf, at, n, false);
        if (st != QT_OK) return st;
        at += n;
    }
    L->buf[i] = buf, L->op_of[i] = L->p->n_ops - 1;
    return QT_OK;
}

static QtStatus lower_relu(Lower *L, int i) {
    const Module *mod = &L->m->modules[i];
    const int in = mod->inputs[0];
    const QParams *o = qp_value(L, i);
    if (!transparent(L->m, i)) { /* its input is read elsewhere too: a requantized copy with the clamp */
        const int buf = new_buf(L, value_size(L, i), L->p->n_ops);
        if (buf < 0) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
        QtStatus st = lower_requant(L, i, in, buf, 0, value_size(L, i), true);
        L->buf[i] = buf, L->op_of[i] = L->p->n_ops - 1;
        return st;
    }
    L->buf[i] = L->buf[vid(L, in)];
    IntOp *prod = producer(L, in);
    /* the producer's clamp, when the producer wrote exactly this class's values and nothing else read them */
    bool fuse = prod && prod->kind != IOP_MAXPOOL && prod->kind != IOP_RELU;
    for (int v = in; fuse && v >= 0 && v != prod->module; v = L->m->modules[v].inputs[0])
        fuse = L->m->modules[v].n_consumers == 1;
    fuse = fuse && prod->module >= 0 && L->m->modules[prod->module].n_consumers == 1 && prod->kind != IOP_REQUANT;
    if (fuse) {
        set_act_min(prod, qp_zp(o));
        L->op_of[i] = L->op_of[vid(L, in)];
        return QT_OK;
    }
    IntOp *op = new_op(L, IOP_RELU, i);
    if (!op) return qt_error_set(L->err, QT_ERR_NOMEM, "out of memory");
    read_buf(L, op, 0, in);
    op->out = op->in[0];
    op->p.relu.n = (int)value_size(L, i), op->p.relu.lo = qp_zp(o);
    L->op_of[i] = L->p->n_ops - 1;
    return QT_OK;
}

static QtStatus lower_module_ops(Lower *L, int i);

/* Module i's ops, each noting the range of the value it writes. */
static QtStatus lower_module(Lower *L, int i) {
    const int first = L->p->n_ops;
    QtStatus st = lower_module_ops(L, i);
    const QParams *o = qp_value(L, i);
    for (int k = first; st == QT_OK && k < L->p->n_ops; k++)
        L->p->ops[k].out_scale = o->s, L->p->ops[k].out_zero_point = qp_zp(o);
    return st;
}

static QtStatus lower_module_ops(Lower *L, int i) {
    const Module *mod = &L->m->modules[i];
    switch (mod->spec.type) {
    case LAYER_DENSE:
    case LAYER_CONV2D: return lower_layer(L, i);
    case LAYER_MAXPOOL2D:
    case LAYER_AVGPOOL2D:
    case LAYER_GLOBALAVGPOOL: return lower_pool(L, i);
    case LAYER_ADD: return lower_add(L, i);
    case LAYER_CONCAT: return lower_concat(L, i);
    case LAYER_RELU: return lower_relu(L, i);
    default: /* flatten, dropout, a folded batch norm: the same codes */
        L->buf[i] = L->buf[vid(L, mod->inputs[0])];
        L->op_of[i] = L->op_of[vid(L, mod->inputs[0])];
        return QT_OK;
    }
}

/* ---- the arena ------------------------------------------------------------------------------------------------- */

static int by_size_desc(const void *a, const void *b, void *ctx) {
    const IntBuf *bufs = ctx;
    const int x = *(const int *)a, y = *(const int *)b;
    if (bufs[x].bytes != bufs[y].bytes) return bufs[x].bytes < bufs[y].bytes ? 1 : -1;
    return x - y;
}

/* Greedy: the largest buffers first, each at the lowest 16-byte-aligned offset clear of every placed buffer whose
 * lifetime meets its own. */
static QtStatus plan_arena(IntProgram *p, QtError *err) {
    int *order = malloc((size_t)p->n_bufs * sizeof *order), n_placed = 0;
    if (!order) return qt_error_set(err, QT_ERR_NOMEM, "out of memory planning the arena");
    for (int k = 0; k < p->n_bufs; k++) order[k] = k;
    qsort_r(order, (size_t)p->n_bufs, sizeof *order, by_size_desc, p->bufs);
    p->arena_bytes = 0;
    for (int k = 0; k < p->n_bufs; k++) {
        IntBuf *b = &p->bufs[order[k]];
        size_t at = 0;
        for (bool moved = true; moved;) {
            moved = false;
            for (int j = 0; j < n_placed; j++) {
                const IntBuf *o = &p->bufs[order[j]];
                const bool live = !(o->last < b->first || b->last < o->first);
                if (live && at < o->offset + o->bytes && o->offset < at + b->bytes) {
                    at = (o->offset + o->bytes + 15) / 16 * 16;
                    moved = true;
                }
            }
        }
        b->offset = at, n_placed++;
        if (at + b->bytes > p->arena_bytes) p->arena_bytes = at + b->bytes;
    }
    p->arena_bytes = (p->arena_bytes + 15) / 16 * 16;
    free(order);
    return QT_OK;
}

/* ---- the input table ------------------------------------------------------------------------------------------- */

static QtStatus build_table(IntProgram *p, const QParams *q, const Dataset *d, QtError *err) {
    if (!d || d->elem != DATA_ELEM_U8) return QT_OK;
    const int C = d->chan_scale ? d->shape[0] : 1;
    int8_t *t = own(p, (size_t)C * 256);
    float x[256];
    uint8_t u[256];
    if (!t) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    for (int c = 0; c < C; c++) {
        const float a = d->chan_scale ? d->chan_scale[c] : d->pixel_scale;
        const float b = d->chan_shift ? d->chan_shift[c] : d->pixel_shift;
        for (int v = 0; v < 256; v++) x[v] = a * (float)v + b;
        if (!qgemm_quantize_u8_portable(u, x, 256, q->s, q->lo, q->hi, q->zero))
            return qt_error_set(err, QT_ERR_VALUE, "the input map of channel %d is not finite", c);
        for (int v = 0; v < 256; v++) t[c * 256 + v] = (int8_t)(u[v] - 128);
    }
    p->in_table = t, p->in_table_c = C;
    p->const_bytes += (size_t)C * 256;
    return QT_OK;
}

/* ---- build ----------------------------------------------------------------------------------------------------- */

QtStatus intprog_build(IntProgram *p, const Net *n, const float (*range)[2], const Dataset *data, bool low_ram,
                       QtError *err) {
    memset(p, 0, sizeof *p);
    const Model *m = &n->model;
    const int N = m->n_modules;
    Lower L = {.p = p, .n = n, .m = m, .range = range, .low_ram = low_ram, .err = err};
    L.cls = malloc((size_t)(N + 1) * sizeof *L.cls);
    L.qp = calloc((size_t)(N + 1), sizeof *L.qp);
    L.buf = malloc((size_t)(N + 1) * sizeof *L.buf);
    L.op_of = malloc((size_t)(N + 1) * sizeof *L.op_of);
    QtStatus st = L.cls && L.qp && L.buf && L.op_of ? QT_OK : qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    for (int i = 0; st == QT_OK && i < N; i++) st = check_module(&L, i);
    if (st == QT_OK) st = assign_classes(&L);
    if (st == QT_OK) {
        for (int v = 0; v <= N; v++) L.buf[v] = -1, L.op_of[v] = -1;
        p->in_ndim = m->input_ndim;
        p->in_size = 1;
        for (int k = 0; k < m->input_ndim; k++) p->in_shape[k] = m->input_shape[k], p->in_size *= m->input_shape[k];
        const QParams *in = &L.qp[L.cls[N]];
        p->in_scale = in->s, p->in_zp = qp_zp(in);
        p->in_buf = L.buf[N] = new_buf(&L, p->in_size, -1);
        if (p->in_buf < 0) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
        if (st == QT_OK) st = build_table(p, in, data, err);
        p->in_fq_s = in->s, p->in_fq_lo = in->lo, p->in_fq_hi = in->hi, p->in_fq_zero = in->zero;
    }
    for (int i = 0; st == QT_OK && i < N; i++) st = lower_module(&L, i);
    if (st == QT_OK) {
        const Module *last = &m->modules[N - 1];
        const QParams *o = qp_value(&L, N - 1);
        p->out_buf = L.buf[N - 1];
        p->out_ndim = last->out_ndim;
        p->out_size = value_size(&L, N - 1);
        for (int k = 0; k < last->out_ndim; k++) p->out_shape[k] = last->out_shape[k];
        p->out_scale = o->s, p->out_zp = qp_zp(o);
        p->bufs[p->out_buf].last = p->n_ops;
        for (int k = 0; k < p->n_ops; k++) p->macs += p->ops[k].macs;
        st = plan_arena(p, err);
    }
    free(L.cls), free(L.qp), free(L.buf), free(L.op_of);
    if (st != QT_OK) intprog_free(p);
    return st;
}

void intprog_free(IntProgram *p) {
    if (!p) return;
    for (int k = 0; k < p->n_owned; k++) free(p->owned[k]);
    free(p->owned), free(p->ops), free(p->bufs);
    memset(p, 0, sizeof *p);
}

/* ---- running ------------------------------------------------------------------------------------------------------ */

void intprog_run(const IntProgram *p, void *arena, const int8_t *codes, int8_t *out) {
    int8_t *a = arena;
    memcpy(a + p->bufs[p->in_buf].offset, codes, p->in_size);
    for (int k = 0; k < p->n_ops; k++) {
        const IntOp *o = &p->ops[k];
        const int8_t *x = a + p->bufs[o->in[0]].offset;
        int8_t *y = a + p->bufs[o->out].offset + o->out_at;
        switch (o->kind) {
        case IOP_CONV: qrt_conv2d(&o->p.conv, x, y, o->scratch >= 0 ? a + p->bufs[o->scratch].offset : NULL); break;
        case IOP_DENSE: qrt_dense(&o->p.dense, x, y); break;
        case IOP_MAXPOOL: qrt_maxpool2d(&o->p.maxpool, x, y); break;
        case IOP_AVGPOOL: qrt_avgpool2d(&o->p.avgpool, x, y); break;
        case IOP_ADD: qrt_add(&o->p.add, x, a + p->bufs[o->in[1]].offset, y); break;
        case IOP_REQUANT: qrt_requant_n(&o->p.requant, x, y); break;
        case IOP_RELU: qrt_relu(o->p.relu.n, o->p.relu.lo, x, y); break;
        }
    }
    memcpy(out, a + p->bufs[p->out_buf].offset, p->out_size);
}

void intprog_quantize_u8(const IntProgram *p, const uint8_t *bytes, int8_t *codes) {
    qrt_quantize_u8(p->in_table_c, (int)(p->in_size / (size_t)p->in_table_c), p->in_table, bytes, codes);
}

bool intprog_quantize_f32(const IntProgram *p, const float *x, int8_t *codes) {
    uint8_t *u = (uint8_t *)codes;
    if (!qgemm_quantize_u8_portable(u, x, p->in_size, p->in_fq_s, p->in_fq_lo, p->in_fq_hi, p->in_fq_zero))
        return false;
    for (size_t k = 0; k < p->in_size; k++) codes[k] = (int8_t)(u[k] - 128);
    return true;
}
