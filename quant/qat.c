/* qat.c - the quantization-aware-training layer: the spec's checks, setup
 * of the learned ranges, the forward with fake-quantized weight and input,
 * input calibration, and the trained layer turned into a QLayer. */
#include "qat.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/ops.h"
#include "nn/ops_chscale.h"
#include "qarray_io.h"
#include "qarray_plan.h"

static const char *const LEARN_NAMES[] = {[QAT_LEARN_NONE] = "none", [QAT_LEARN_TQT] = "tqt",
                                          [QAT_LEARN_LSQ] = "lsq"};

const char *qat_learn_name(QatLearn l) {
    return (int)l >= 0 && l < QAT_LEARN_COUNT ? LEARN_NAMES[l] : "unknown";
}

QtStatus qat_learn_parse(const char *name, QatLearn *out, QtError *err) {
    int k = 0;
    QtStatus st = qt_name_lookup("learn_amax", name, LEARN_NAMES, QAT_LEARN_COUNT, &k, err);
    if (st == QT_OK) *out = (QatLearn)k;
    return st;
}

QatSpec qat_spec_default(void) {
    return (QatSpec){.learn_amax = QAT_LEARN_NONE, .amax_init = {.kind = CALIB_ABSMAX, .s = 1.0},
                     .act_static_scale = false};
}

static bool learned(const QatSpec *qat) { return qat->learn_amax != QAT_LEARN_NONE; }

static bool is_int_kind(const QType *t) {
    return t && (t->kind == QTYPE_KIND_INT || t->kind == QTYPE_KIND_UINT) && t->bits >= 2 && t->bits <= 16;
}

/* ---- checks ------------------------------------------------------------------------------------------------------ */

/* What a learned range needs of the weight's layout and format. */
static QtStatus check_learned_weight(const QLayerSpec *spec, const QatSpec *qat, const Module *m, QtError *err) {
    const char *ln = qat_learn_name(qat->learn_amax), *wt = qtype_name(spec->weight_qtype);
    if (!is_int_kind(spec->weight_qtype))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax: %s learns the range of int or uint codes, but "
                            "weight_qtype is %s (use int2..int8, uint4 or uint8, or learn_amax none)", m->path, ln, wt);
    if (spec->tile_size > 0)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax: %s learns one range per output channel (or per "
                            "tensor), not per block; set tile_size 0 (it is %d) or learn_amax none", m->path, ln,
                            spec->tile_size);
    if (qat->learn_amax == QAT_LEARN_TQT && spec->scale_type != QARRAY_SCALE_POF2)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax: tqt learns power-of-two scales, but scale_type is "
                            "%s; set scale_type pof2 (or learn_amax lsq for float scales)", m->path,
                            qarray_scale_type_name(spec->scale_type));
    if (qat->learn_amax == QAT_LEARN_LSQ && spec->scale_type != QARRAY_SCALE_F32)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax: lsq learns a float32 step size, but scale_type is "
                            "%s; set scale_type float32 (or learn_amax tqt for pof2 scales)", m->path,
                            qarray_scale_type_name(spec->scale_type));
    if (!spec->symmetric)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax: %s learns a symmetric range without a zero point; "
                            "set symmetric true (with a uint format also allow_clip: true) or learn_amax none for "
                            "an asymmetric weight", m->path, ln);
    if (spec->rounding != QROUND_RNE)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax: %s rounds to nearest (its range gradient is "
                            "defined for rne); set rounding rne (or learn_amax none for rounding %s)", m->path, ln,
                            qround_name(spec->rounding));
    if (spec->narrow_range)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax: %s clamps to the format's full code range; "
                            "set narrow_range false (or learn_amax none)", m->path, ln);
    return QT_OK;
}

static QtStatus check_learned_act(const QLayerSpec *spec, const QatSpec *qat, const Module *m, QtError *err) {
    const char *ln = qat_learn_name(qat->learn_amax);
    if (!spec->act_qtype) return QT_OK;
    if (!is_int_kind(spec->act_qtype))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax: %s learns the input's range too, which needs an int "
                            "or uint act_qtype, not %s (use int8 or uint8, or learn_amax none)", m->path, ln,
                            spec->act_qtype->name);
    if (!spec->act_symmetric)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax: %s learns a symmetric input range without a zero "
                            "point; set act_symmetric true (a uint act_qtype then covers [0, t], clipping negative "
                            "inputs: add allow_clip: true)", m->path, ln);
    return QT_OK;
}

QtStatus qat_layer_check(const QLayerSpec *spec, const QatSpec *qat, const Module *m, QtError *err) {
    if (!spec || !qat || !m) return qt_error_set(err, QT_ERR_ARG, "qat_layer_check: NULL spec, QAT spec or module");
    if (spec->double_quant)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: double_quant compresses the scales of a frozen weight, but a QAT "
                            "layer recomputes or learns them every step; set double_quant false", m->path);
    QtStatus st = qlayer_spec_check(spec, m, err);
    if (st != QT_OK) return st;
    if ((int)qat->learn_amax < 0 || qat->learn_amax >= QAT_LEARN_COUNT)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: learn_amax %d is not none, tqt or lsq", m->path,
                            (int)qat->learn_amax);
    if (qat->act_static_scale && learned(qat))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: act_static_scale keeps a running range of the input, but "
                            "learn_amax: %s learns it; set act_static_scale false or learn_amax none", m->path,
                            qat_learn_name(qat->learn_amax));
    if (qat->act_static_scale && !spec->act_qtype)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: act_static_scale is set but there is no act_qtype, so the input "
                            "is not quantized; set act_qtype or act_static_scale false", m->path);
    if (!learned(qat)) return QT_OK;
    QtError inner = {0};
    if (calib_spec_check(&qat->amax_init, &inner) != QT_OK)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: amax_init: %s", m->path, inner.msg);
    st = check_learned_weight(spec, qat, m, err);
    if (st == QT_OK) st = check_learned_act(spec, qat, m, err);
    return st;
}

/* ---- init / free ------------------------------------------------------------------------------------------------- */

static FqRangeSpec range_spec(const QatSpec *qat, const QType *t, bool per_channel) {
    return (FqRangeSpec){.kind = qat->learn_amax == QAT_LEARN_LSQ ? FQ_RANGE_LSQ : FQ_RANGE_TQT,
                         .qtype = t, .per_channel = per_channel, .axis = 0, .round = QROUND_RNE};
}

static QtStatus init_ranges_params(QatLayer *q, QtError *err) {
    const Module *m = q->module;
    char prefix[MODULE_NAME_MAX + 16];
    bool per_channel = !q->spec.per_tensor;
    FqRangeSpec ws = range_spec(&q->qat, q->spec.weight_qtype, per_channel);
    snprintf(prefix, sizeof prefix, "%s/weight", m->path);
    QtStatus st = fq_range_init(&q->w_range, prefix, &ws, per_channel ? q->out : 1, err);
    if (st == QT_OK && q->spec.act_qtype) {
        FqRangeSpec as = range_spec(&q->qat, q->spec.act_qtype, false);
        snprintf(prefix, sizeof prefix, "%s/input", m->path);
        st = fq_range_init(&q->a_range, prefix, &as, 1, err);
    }
    return st;
}

QtStatus qat_layer_init(QatLayer *q, Module *m, const QLayerSpec *spec, const QatSpec *qat, QtError *err) {
    if (!q) return qt_error_set(err, QT_ERR_ARG, "qat_layer_init: no QatLayer");
    memset(q, 0, sizeof *q);
    QtStatus st = qat_layer_check(spec, qat, m, err);
    if (st != QT_OK) return st;
    q->module = m;
    q->spec = *spec;
    q->qat = *qat;
    const Tensor *w = &m->weight->var.value;
    q->out = w->shape[0];
    q->fan_in = (int)(tensor_numel(w) / (size_t)q->out);
    /* laid out from q's own copy of the spec, so options.calib points into q */
    st = qlayer_layout(&q->spec, m, &q->w_ndim, q->w_shape, &q->w_options, err);
    q->round_rng = qlayer_round_rng(0, 0); /* the trainer gives each layer its run's own stream */
    /* a learned input range gathers its calibration batches with amax_init, a static one with act_calib */
    calib_running_init(&q->act_stats, learned(qat) ? &q->qat.amax_init : &q->spec.act_calib);
    if (st == QT_OK && learned(qat)) st = init_ranges_params(q, err);
    if (st != QT_OK) qat_layer_free(q);
    return st;
}

void qat_layer_free(QatLayer *q) {
    if (!q) return;
    fq_range_free(&q->w_range);
    fq_range_free(&q->a_range);
    memset(q, 0, sizeof *q);
}

static bool has_range(const FqRange *r) { return r->param.var.value.data != NULL; }

QtStatus qat_layer_init_ranges(QatLayer *q, QtError *err) {
    if (!q || !q->module) return qt_error_set(err, QT_ERR_ARG, "qat_layer_init_ranges: the layer is not initialised");
    if (!has_range(&q->w_range)) return QT_OK;
    const float *w = q->module->weight->var.value.data;
    if (!w)
        return qt_error_set(err, QT_ERR_ARG, "%s: the float weight was released, so its range cannot be initialised "
                            "(a QAT layer needs its float weight)", q->module->path);
    float *wf = NULL;
    if (q->bn && q->bn->bn_folded == BN_FOLD_NONE) { /* the weight it quantizes: folded at the running statistics */
        const Module *bn = q->bn;
        wf = malloc((size_t)q->out * (size_t)q->fan_in * sizeof *wf);
        if (!wf) return qt_error_set(err, QT_ERR_NOMEM, "%s: out of memory initialising the weight's range",
                                     q->module->path);
        bn_fold_values(wf, NULL, w, NULL, bn->weight ? bn->weight->var.value.data : NULL, NULL, bn->running_mean,
                       bn->running_var, bn->bn.eps, q->out, (size_t)q->fan_in);
        w = wf;
    }
    QtStatus st = fq_range_calibrate(&q->w_range, w, 2, q->w_shape, &q->qat.amax_init, err);
    free(wf);
    /* a learned input range is set by the calibration batches, which come after this */
    if (st == QT_OK && !has_range(&q->a_range)) q->ranges_ready = true;
    return st;
}

static Var *qat_hook(Tape *t, Module *m, Var *x, void *ctx) {
    (void)m;
    return qat_layer_forward(t, ctx, x);
}

void qat_layer_install(QatLayer *q) {
    if (!q || !q->module) return;
    q->module->forward_hook = qat_hook;
    q->module->fused_hook = NULL; /* no fused form: relu and pooling run as their own ops */
    q->module->fused_residual = false;
    q->module->weight_hook = NULL;
    q->module->hook_ctx = q;
}

int qat_layer_params(QatLayer *q, Param **out) {
    int n = 0;
    if (!q) return 0;
    if (has_range(&q->w_range)) {
        if (out) out[n] = &q->w_range.param;
        n++;
    }
    if (has_range(&q->a_range)) {
        if (out) out[n] = &q->a_range.param;
        n++;
    }
    return n;
}

/* ---- the input --------------------------------------------------------------------------------------------------- */

/* The round trip of a learned quantizer whose threshold is the candidate range, as fq_range_calibrate's
 * calibrations see it: s = t / 2^(b-1) (uint: 2^b) for tqt, without the ceil, and t / p for lsq. */
static float learned_roundtrip(float x, float lo, float hi, const CalibQuant *cq, bool lsq) {
    const QType *t = cq->ctx;
    bool u = t->kind == QTYPE_KIND_UINT;
    float n = u ? 0.0f : (float)t->qmin, p = (float)t->qmax, thr = fmaxf(-lo, hi);
    float s = lsq ? thr / p : ldexpf(thr, -(u ? t->bits : t->bits - 1));
    if (!(s >= QARRAY_SCALE_MIN)) s = 1.0f;
    return fminf(fmaxf(rintf(x / s), n), p) * s;
}
static float learned_roundtrip_tqt(float x, float lo, float hi, const CalibQuant *cq) {
    return learned_roundtrip(x, lo, hi, cq, false);
}
static float learned_roundtrip_lsq(float x, float lo, float hi, const CalibQuant *cq) {
    return learned_roundtrip(x, lo, hi, cq, true);
}

/* How the input's batches are calibrated: as the learned range or the static format will quantize them. */
static CalibQuant input_calib_quant(const QatLayer *q) {
    const QType *t = q->spec.act_qtype;
    if (has_range(&q->a_range))
        return (CalibQuant){.fn = q->qat.learn_amax == QAT_LEARN_LSQ ? learned_roundtrip_lsq : learned_roundtrip_tqt,
                            .ctx = t, .levels = qarray_calib_levels(t, false)};
    return fq_calib_quant(t, q->spec.act_symmetric ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC, false,
                          QARRAY_ZP_INT32);
}

/* Adds x's range to act_stats; false with the tape error set. */
static bool observe_input(Tape *t, QatLayer *q, const Var *x) {
    size_t n = var_numel(x), bytes = calib_workspace_bytes(&q->act_stats.spec, n);
    void *work = bytes ? tape_alloc(t, bytes) : NULL;
    if (bytes && !work) return false;
    CalibQuant cq = input_calib_quant(q);
    QtError inner = {0};
    QtStatus st = calib_running_observe(&q->act_stats, x->value.data, n, &cq, work, bytes, &inner);
    if (st != QT_OK)
        qt_error_set(&t->err, st, "%s: observing the input for its range: %s", q->module->path, inner.msg);
    return st == QT_OK;
}

/* x fake-quantized with the running statistics' range, the scale and zero point exactly as a QLayer
 * derives them from the same statistics (qlayer_act_from_stats). */
static Var *static_input(Tape *t, QatLayer *q, Var *x) {
    if (t->training && !observe_input(t, q, x)) return NULL;
    QLayer view = {.module = q->module, .spec = q->spec, .act_stats = q->act_stats};
    QtError inner = {0};
    if (qlayer_act_from_stats(&view, &inner) != QT_OK) {
        qt_error_set(&t->err, inner.status, "%s", inner.msg);
        return NULL;
    }
    bool sym = q->spec.act_symmetric;
    Var *s = tape_new_var(t, 1, (const int[]){1});
    Var *zp = sym ? NULL : tape_new_var(t, 1, (const int[]){1});
    if (!s || (!sym && !zp)) return NULL;
    s->value.data[0] = view.act_scale;
    if (zp) zp->value.data[0] = view.act_zero_point;
    FakeQuantSpec fs = {.qtype = q->spec.act_qtype, .range = sym ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC,
                        .zp_type = QARRAY_ZP_INT32, .round = QROUND_RNE, .ste = FQ_STE_CLIPPED};
    return fq_fake_quant(t, x, &fs, s, zp);
}

/* x as the layer's op sees it. */
static Var *layer_input(Tape *t, QatLayer *q, Var *x) {
    if (!q->spec.act_qtype) return x;
    if (q->calibrating) return observe_input(t, q, x) ? x : NULL;
    if (has_range(&q->a_range)) return fq_range_apply(t, x, &q->a_range);
    if (q->qat.act_static_scale) return static_input(t, q, x);
    bool sym = q->spec.act_symmetric;
    FakeQuantSpec fs = {.qtype = q->spec.act_qtype, .range = sym ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC,
                        .zp_type = QARRAY_ZP_INT32, .round = QROUND_RNE, .ste = FQ_STE_CLIPPED};
    return fq_fake_quant_dynamic(t, x, &fs, &q->spec.act_calib);
}

/* ---- the forward ------------------------------------------------------------------------------------------------- */

void qat_layer_set_step(QatLayer *q, int64_t step) {
    if (!q) return;
    q->round_step = step;
    /* steps 0 .. freeze_after - 1 update the statistics; from then on they hold (and are never unfrozen here:
       a batch norm frozen for another reason stays so) */
    if (q->bn && q->bn_freeze_after > 0 && step >= q->bn_freeze_after) q->bn->bn.frozen = true;
}

/* The weight fake-quantized in its QArray view (out, fan_in) or (numel / T, T), back in its own shape. The
 * reshapes share the values and pass the gradient through, so the Param's grad receives the STE's. */

static Var *quant_weight(Tape *t, QatLayer *q, Var *w) {
    if (!w) return NULL;
    Var *w2 = nn_reshape(t, w, q->w_ndim, q->w_shape);
    QArrayOptions o = q->w_options;
    Rng r = q->round_rng; /* the step's own noise in training, step 0's elsewhere: see qat_layer_set_step */
    if (o.round == QROUND_STOCHASTIC) {
        r.counter = t->training ? (uint64_t)q->round_step * ((tensor_numel(&w->value) + 3) / 4) : 0;
        o.rng = &r;
    }
    Var *wq2 = has_range(&q->w_range) ? fq_range_apply(t, w2, &q->w_range)
                                      : fq_fake_quant_qarray(t, w2, q->spec.weight_qtype, &o, FQ_STE_CLIPPED);
    return nn_reshape(t, wq2, w->value.ndim, w->value.shape);
}

/* Whether q folds its batch norm: it has one, not already folded into the weights (a checkpoint's BnFold, which
 * the batch norm's own forward then follows). */
static bool folds_bn(const QatLayer *q) { return q->bn && q->bn->bn_folded == BN_FOLD_NONE; }

static Var *layer_op(Tape *t, const Module *m, Var *x, Var *w, Var *bias) {
    return m->spec.type == LAYER_CONV2D ? model_conv_forward(t, m, x, w, bias) : nn_linear(t, x, w, bias);
}

/* ---- a batch norm folded in -------------------------------------------------------------------------------------- */

/* The eval form's folded weight (like the module's) and shift (out,) of q's batch norm at its running statistics
 * (bn_fold_values), as constants on the tape: what `qtrain convert` writes. Either output may be NULL. */
static bool folded_values(Tape *t, const QatLayer *q, Var **wf, Var **shift) {
    const Module *m = q->module, *bn = q->bn;
    const Tensor *w = &m->weight->var.value;
    if (wf && !(*wf = tape_new_var(t, w->ndim, w->shape))) return false;
    if (shift && !(*shift = tape_new_var(t, 1, (const int[]){q->out}))) return false;
    bn_fold_values(wf ? (*wf)->value.data : NULL, shift ? (*shift)->value.data : NULL, w->data,
                   m->bias ? m->bias->var.value.data : NULL, bn->weight ? bn->weight->var.value.data : NULL,
                   bn->bias ? bn->bias->var.value.data : NULL, bn->running_mean, bn->running_var, bn->bn.eps, q->out,
                   (size_t)q->fan_in);
    return true;
}

/* The forward with q's batch norm folded in. Eval: the layer with the folded weight, fake-quantized, and (the
 * layer having a bias) the folded shift as its bias; the batch norm then passes its input on, or adds the shift
 * (bn_hook). Training: torch's ConvBn _forward_approximate: s = gamma / sqrt(running_var + eps) per output channel,
 * y = op(x, fq(w * s)) / s + bias, which the batch norm then normalises with the batch's statistics (or, frozen,
 * the running ones). */
static Var *folded_forward(Tape *t, QatLayer *q, Var *x) {
    Module *m = q->module, *bn = q->bn;
    Var *bias = m->bias ? &m->bias->var : NULL;
    if (!t->training) {
        Var *wf = NULL, *shift = NULL;
        if (!folded_values(t, q, &wf, bias ? &shift : NULL)) return NULL;
        Var *wq = quant_weight(t, q, wf);
        Var *xin = wq ? layer_input(t, q, x) : NULL;
        return xin ? layer_op(t, m, xin, wq, shift) : NULL;
    }
    const int C = q->out;
    Var *sd = tape_new_var(t, 1, &C);
    if (!sd) return NULL;
    for (int c = 0; c < C; c++) sd->value.data[c] = sqrtf(bn->running_var[c] + bn->bn.eps);
    Var *s = bn->weight ? nn_chscale(t, &bn->weight->var, sd, 0, true) : tape_new_var(t, 1, &C);
    if (s && !bn->weight)
        for (int c = 0; c < C; c++) s->value.data[c] = 1.0f / sd->value.data[c];
    Var *wq = quant_weight(t, q, nn_chscale(t, &m->weight->var, s, 0, false));
    Var *xin = wq ? layer_input(t, q, x) : NULL;
    Var *y = nn_chscale(t, xin ? layer_op(t, m, xin, wq, NULL) : NULL, s, 1, true);
    return bias ? nn_bias_add(t, y, bias) : y;
}

/* The batch norm's forward: its own in training (batch statistics, or the running ones once frozen); in eval the
 * layer before it has done its work, but for the shift when that layer has no bias to hold it. */
static Var *bn_hook(Tape *t, Module *bn, Var *x, void *ctx) {
    const QatLayer *q = ctx;
    if (!x) return NULL;
    if (t->training || bn->bn_folded != BN_FOLD_NONE) return model_module_forward(t, bn, x);
    if (q->module->bias) return x;
    Var *shift = NULL;
    return folded_values(t, q, NULL, &shift) ? nn_bias_add(t, x, shift) : NULL;
}

QtStatus qat_layer_fold_bn(QatLayer *q, Module *bn, int64_t freeze_after, QtError *err) {
    if (!q || !q->module || !bn || !bn->running_mean || bn->in_shape[0] != q->out || (!q->module->bias && !bn->bias))
        return qt_error_set(err, QT_ERR_ARG, "qat_layer_fold_bn: %s cannot fold into the QAT layer %s",
                            bn ? bn->path : "(none)", q && q->module ? q->module->path : "(none)");
    q->bn = bn;
    q->bn_freeze_after = freeze_after;
    bn->forward_hook = bn_hook;
    bn->fused_hook = NULL;
    bn->fused_residual = false;
    bn->weight_hook = NULL;
    bn->hook_ctx = q;
    return QT_OK;
}

void qat_layer_unfold_bn(QatLayer *q) {
    if (!q || !q->bn) return;
    Module *bn = q->bn;
    if (bn->hook_ctx == q) bn->forward_hook = NULL, bn->fused_hook = NULL, bn->weight_hook = NULL, bn->hook_ctx = NULL;
    q->bn = NULL;
    q->bn_freeze_after = 0;
}

Var *qat_layer_forward(Tape *t, QatLayer *q, Var *x) {
    if (!t || !x) return NULL;
    if (!q || !q->module || !q->spec.weight_qtype) {
        qt_error_set(&t->err, QT_ERR_ARG, "qat_layer_forward: the QAT layer is not initialised");
        return NULL;
    }
    Module *m = q->module;
    if (!m->weight || !m->weight->var.value.data) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: the float weight was released, but a QAT layer trains it (a module "
                     "takes either PTQ or QAT)", m->path);
        return NULL;
    }
    if (folds_bn(q)) return folded_forward(t, q, x);
    Var *wq = quant_weight(t, q, &m->weight->var);
    Var *xin = wq ? layer_input(t, q, x) : NULL;
    if (!xin) return NULL;
    Var *bias = m->bias ? &m->bias->var : NULL;
    return layer_op(t, m, xin, wq, bias);
}

/* ---- input calibration ------------------------------------------------------------------------------------------- */

static bool calibrates_input(const QatLayer *q) {
    return q->spec.act_qtype && (has_range(&q->a_range) || q->qat.act_static_scale);
}

void qat_layer_calib_begin(QatLayer *q) {
    if (!q || !calibrates_input(q)) return;
    calib_running_init(&q->act_stats, has_range(&q->a_range) ? &q->qat.amax_init : &q->spec.act_calib);
    q->calibrating = true;
}

QtStatus qat_layer_calib_end(QatLayer *q, QtError *err) {
    if (!q) return qt_error_set(err, QT_ERR_ARG, "qat_layer_calib_end: no QatLayer");
    if (!calibrates_input(q)) return QT_OK;
    q->calibrating = false;
    const char *path = q->module->path;
    if (q->act_stats.count <= 0)
        return qt_error_set(err, QT_ERR_VALUE, "%s: calibration saw no batch, so the input's starting range is "
                            "unknown (run calibration batches through the layer)", path);
    if (!has_range(&q->a_range)) return QT_OK; /* act_static_scale: the statistics are the starting point */
    /* The mean range's threshold t, set as fq_range_calibrate sets it from data whose absmax is t:
     * l = log2 t (tqt) or s = t / p (lsq), a zero range giving the scale 1. */
    CalibRange r = calib_running_range(&q->act_stats);
    float thr = fmaxf(-r.lo, r.hi);
    const float ends[2] = {-thr, thr};
    const CalibSpec absmax = {.kind = CALIB_ABSMAX, .s = 1.0};
    QtStatus st = fq_range_calibrate(&q->a_range, ends, 1, (const int[]){2}, &absmax, err);
    if (st == QT_OK) q->ranges_ready = true;
    return st;
}

/* ---- convert ----------------------------------------------------------------------------------------------------- */

/* The scale of parameter value v, or QT_ERR_VALUE naming the range. */
static QtStatus learned_scale(const FqRange *r, int ch, float *s, QtError *err) {
    float v = r->param.var.value.data[ch];
    *s = fq_range_scale(&r->spec, v);
    if (*s >= QARRAY_SCALE_MIN && !isinf(*s)) return QT_OK;
    return qt_error_set(err, QT_ERR_VALUE, "%s[%d] = %g gives the scale %g, outside [1e-19, 3.4e38]; the range "
                        "diverged, so there is nothing to convert (lower the learning rate or re-initialise it)",
                        r->param.name, ch, (double)v, (double)*s);
}

/* Scale i of a converted QArray, stored as its type holds it: float32 as is, pof2 as the e8m0 code of the exact
 * power of two a tqt range gives. */
static QtStatus store_scale(const QArrayBlob *b, size_t i, float s, const char *name, QtError *err) {
    if (b->type == QARRAY_BLOB_F32) {
        ((float *)b->data)[i] = s;
        return QT_OK;
    }
    int e;
    float f = frexpf(s, &e); /* s = f 2^e */
    int code = e - 1 + 127;
    if (b->type != QARRAY_BLOB_U8 || f != 0.5f || code < 0 || code > 254)
        return qt_error_set(err, QT_ERR_VALUE, "%s: the scale %g is not a power of two an e8m0 scale holds", name,
                            (double)s);
    ((uint8_t *)b->data)[i] = (uint8_t)code;
    return QT_OK;
}

/* out's weight (from qlayer_init_empty): codes clamp(rne(w / s), n, p) of the learned range, packed, and the
 * scales in their type - what fq_learned_quant's forward computes, as a QArray. */
static QtStatus fill_learned_weight(const QatLayer *q, QLayer *out, const float *w, QtError *err) {
    const FqRange *r = &q->w_range;
    const QType *t = q->spec.weight_qtype;
    QArrayBlob blobs[QARRAY_MAX_BLOBS];
    int nb = qarray_blobs(&out->weight, blobs);
    size_t rows = (size_t)q->w_shape[0], cols = (size_t)q->w_shape[1];
    if (nb != 2 || out->weight.n_scales != (size_t)r->n_channels)
        return qt_error_set(err, QT_ERR_ARG, "%s: the weight's QArray has %zu scales for a learned range of %d "
                            "channels", q->module->path, out->weight.n_scales, r->n_channels);
    uint32_t *codes = malloc(rows * cols * sizeof *codes);
    if (!codes) return qt_error_set(err, QT_ERR_NOMEM, "%s: out of memory converting the weight", q->module->path);
    bool u = t->kind == QTYPE_KIND_UINT;
    float n = u ? 0.0f : (float)t->qmin, p = (float)t->qmax;
    QtStatus st = QT_OK;
    for (size_t row = 0; st == QT_OK && row < rows; row++) {
        int ch = r->n_channels == 1 ? 0 : (int)row;
        float s;
        st = learned_scale(r, ch, &s, err);
        if (st == QT_OK && (r->n_channels > 1 || row == 0))
            st = store_scale(&blobs[1], (size_t)ch, s, r->param.name, err);
        for (size_t j = 0; st == QT_OK && j < cols; j++) {
            float k = fminf(fmaxf(qarray_round_int(w[row * cols + j] / s, QROUND_RNE, 0.0f), n), p);
            codes[row * cols + j] = qtype_encode(t, k, QROUND_RNE, 0.0f);
        }
    }
    if (st == QT_OK && qtype_pack(t, codes, rows * cols, blobs[0].data) != QT_OK)
        st = qt_error_set(err, QT_ERR_ARG, "%s: cannot pack %s codes", q->module->path, t->name);
    free(codes);
    return st;
}

/* The input's static scale: the learned range's, or the running statistics'. */
static QtStatus convert_input(const QatLayer *q, QLayer *out, QtError *err) {
    if (!q->spec.act_qtype) return QT_OK;
    if (q->qat.act_static_scale) {
        out->act_stats = q->act_stats;
        return qlayer_act_from_stats(out, err);
    }
    float s;
    QtStatus st = learned_scale(&q->a_range, 0, &s, err);
    if (st != QT_OK) return st;
    out->act_scale = s;
    out->act_zero_point = 0.0f;
    out->act_ready = true;
    return QT_OK;
}

QtStatus qat_layer_convert(const QatLayer *q, QLayer *out, QtError *err) {
    if (!out) return qt_error_set(err, QT_ERR_ARG, "qat_layer_convert: no output QLayer");
    memset(out, 0, sizeof *out);
    if (!q || !q->module) return qt_error_set(err, QT_ERR_ARG, "qat_layer_convert: the QAT layer is not initialised");
    Module *m = q->module;
    if (q->spec.act_qtype && !has_range(&q->a_range) && !q->qat.act_static_scale)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the input's range is calibrated on every batch (dynamic), which "
                            "a frozen layer cannot reproduce; train with act_static_scale true or learn_amax tqt/lsq "
                            "to convert it", m->path);
    const float *w = m->weight ? m->weight->var.value.data : NULL;
    if (!w)
        return qt_error_set(err, QT_ERR_ARG, "%s: the float weight was released, so there is nothing to convert",
                            m->path);
    QtStatus st;
    if (has_range(&q->w_range)) {
        st = qlayer_init_empty(out, m, &q->spec, err);
        if (st == QT_OK) st = fill_learned_weight(q, out, w, err);
    } else {
        st = qlayer_init_quantize_rng(out, m, &q->spec, w, &q->round_rng, err); /* stochastic: eval's draw */
    }
    if (st == QT_OK) st = convert_input(q, out, err);
    if (st != QT_OK) qlayer_free(out);
    return st;
}
