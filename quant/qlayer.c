/* qlayer.c - the post-training-quantized layer's setup: the spec checks,
 * the weight's QArray layout and band size, quantizing or allocating the
 * weight, static activation ranges and the one-line description. The
 * forward and its input gradient are in qlayer_ops.c. */
#include "qlayer.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "qarray_io.h"
#include "qarray_plan.h"

QLayerSpec qlayer_spec_default(void) {
    return (QLayerSpec){.weight_calib = {.kind = CALIB_ABSMAX, .s = 1.0},
                        .symmetric = true,
                        .scale_type = QARRAY_SCALE_F32,
                        .act_calib = {.kind = CALIB_ABSMAX, .s = 1.0},
                        .act_symmetric = true};
}

/* ---- the weight as a matrix ------------------------------------------------------------------- */

/* out, fan_in and numel of m's weight, or a QT_ERR_CONFIG naming the module. */
static QtStatus weight_geometry(const Module *m, int *out, int *fan_in, size_t *numel, QtError *err) {
    if (m->spec.type != LAYER_DENSE && m->spec.type != LAYER_CONV2D)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: a %s module has no weight matrix to quantize; post-training "
                            "quantization applies to dense and conv2d modules (narrow the rule's module_path or "
                            "op_types)", m->path, layer_type_name(m->spec.type));
    const Tensor *w = m->weight ? &m->weight->var.value : NULL;
    int want = m->spec.type == LAYER_DENSE ? 2 : 4;
    if (!w || w->ndim != want)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the %s module has no %d-d weight to quantize", m->path,
                            layer_type_name(m->spec.type), want);
    *numel = tensor_numel(w);
    *out = w->shape[0];
    *fan_in = (int)(*numel / (size_t)*out);
    return QT_OK;
}

/* The largest divisor of n not above t (at least 1): a tile that would fit. */
static size_t divisor_below(size_t n, size_t t) {
    for (size_t d = t < n ? t : n; d > 1; d--)
        if (n % d == 0) return d;
    return 1;
}

/* The checks that decide the layout itself. */
static QtStatus check_tiling(const QLayerSpec *spec, const Module *m, size_t numel, QtError *err) {
    const QType *t = spec->weight_qtype;
    if (!t)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: no weight format (weight_qtype) is given; a quantized layer "
                            "needs one (leave the module float32 instead)", m->path);
    int T = spec->tile_size;
    if (T < 0)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: tile_size %d must be 0 (one scale per output channel) or a "
                            "block size > 0", m->path, T);
    if (spec->per_tensor && T > 0)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: per_tensor and tile_size %d exclude each other: per_tensor is one "
                            "scale for the whole weight, a tile one per block; set one of them", m->path, T);
    if (qtype_is_block(t)) {
        if (T != 0 && T != t->block)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: %s has blocks of %d elements; tile_size %d cannot change "
                                "them (set tile_size 0 or %d)", m->path, t->name, t->block, T, t->block);
        if (spec->per_tensor)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: %s has one scale per block of %d; per_tensor does not "
                                "apply (leave it false)", m->path, t->name, t->block);
        T = t->block;
    }
    if (T > 0 && numel % (size_t)T != 0 && qtype_is_block(t))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the weight's %zu elements are not a multiple of %s's block of "
                            "%d, which cannot change; quantize this module with another format", m->path, numel,
                            t->name, T);
    if (T > 0 && numel % (size_t)T != 0 && t->kind == QTYPE_KIND_LUT && T == QARRAY_NF4_BLOCK)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the weight's %zu elements are not a multiple of tile_size %d "
                            "(%s's default block, bitsandbytes'); set tile_size to one that divides %zu (e.g. %zu), "
                            "or tile_size: 0 for one scale per output channel", m->path, numel, T, t->name, numel,
                            divisor_below(numel, (size_t)T));
    if (T > 0 && numel % (size_t)T != 0)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the weight's %zu elements are not a multiple of tile_size %d; "
                            "choose a tile that divides %zu (e.g. %zu)", m->path, numel, T, numel,
                            divisor_below(numel, (size_t)T));
    if (T > 0 && numel / (size_t)T > INT_MAX)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: %zu blocks of tile_size %d are more than a QArray axis holds; "
                            "choose a larger tile", m->path, numel / (size_t)T, T);
    return QT_OK;
}

QtStatus qlayer_layout(const QLayerSpec *spec, const Module *m, int *ndim, int shape[2], QArrayOptions *options,
                       QtError *err) {
    if (!spec || !m || !ndim || !shape || !options)
        return qt_error_set(err, QT_ERR_ARG, "qlayer_layout: NULL argument");
    int out = 0, fan_in = 0;
    size_t numel = 0;
    QtStatus st = weight_geometry(m, &out, &fan_in, &numel, err);
    if (st == QT_OK) st = check_tiling(spec, m, numel, err);
    if (st != QT_OK) return st;
    const QType *t = spec->weight_qtype;
    bool block = qtype_is_block(t);
    int T = block ? t->block : spec->tile_size;
    QArrayOptions o = {0};
    *ndim = 2;
    if (T > 0) {
        /* blocks of T consecutive elements of the flattened weight: one QArray row per block */
        shape[0] = (int)(numel / (size_t)T), shape[1] = T;
        if (!block) o.n_channelwise = 1, o.channelwise_axes[0] = 0;
    } else {
        shape[0] = out, shape[1] = fan_in;
        if (!spec->per_tensor) {
            o.n_channelwise = 1, o.channelwise_axes[0] = 0;
        } else if (t->kind == QTYPE_KIND_LUT) {
            /* without axes a LUT format falls back to blocks of 64; one tile of the whole row (and axis 0
               shared) is one scale */
            o.n_tiled = 1;
            o.tiled_axes[0] = (QArrayTiledAxis){1, fan_in};
        }
    }
    o.calib = block ? NULL : &spec->weight_calib; /* MX scales come from each block's absmax */
    o.range = spec->symmetric ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC;
    o.narrow_range = spec->narrow_range;
    o.scale_type = spec->scale_type;
    o.zp_type = QARRAY_ZP_INT32;
    o.round = spec->rounding;
    o.rng = NULL;
    o.double_quant = spec->double_quant;
    *options = o;
    return QT_OK;
}

/* ---- the spec's checks ---------------------------------------------------------------------------- */

static bool is_int_kind(const QType *t) { return t->kind == QTYPE_KIND_INT || t->kind == QTYPE_KIND_UINT; }

static bool calib_is_default_absmax(const CalibSpec *c) { return c->kind == CALIB_ABSMAX && c->s == 1.0; }

/* The rules with a message of their own, before QArray's generic ones. */
static QtStatus check_weight_options(const QLayerSpec *spec, const Module *m, QtError *err) {
    const QType *t = spec->weight_qtype;
    if (qtype_is_block(t) && spec->double_quant)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: double_quant compresses float scales, but %s keeps e8m0 scales "
                            "inside its blocks; set double_quant false", m->path, t->name);
    if (qtype_is_block(t) && !spec->symmetric)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: %s is symmetric only (its blocks have no zero point); set "
                            "symmetric true", m->path, t->name);
    if (qtype_is_block(t) && !calib_is_default_absmax(&spec->weight_calib)) {
        char c[64];
        calib_format(&spec->weight_calib, c, sizeof c);
        return qt_error_set(err, QT_ERR_CONFIG, "%s: %s takes each block's scale from its absmax (OCP MX); the "
                            "calibration '%s' cannot apply (use absmax)", m->path, t->name, c);
    }
    if (!spec->symmetric && !is_int_kind(t))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: %s is symmetric only: an asymmetric range (a zero point) needs "
                            "an int or uint format; set symmetric true", m->path, t->name);
    QtError inner = {0};
    if (calib_spec_check(&spec->weight_calib, &inner) != QT_OK)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: weight calibration: %s", m->path, inner.msg);
    return QT_OK;
}

static QtStatus check_act(const QLayerSpec *spec, const Module *m, QtError *err) {
    const QType *t = spec->act_qtype;
    if (!t) return QT_OK;
    if (qtype_is_block(t))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: activations are fake-quantized with one static scale per "
                            "tensor; %s computes a scale per block, so it cannot be an act_qtype (use an int, uint, "
                            "float or nf4 format)", m->path, t->name);
    if (!spec->act_symmetric && !is_int_kind(t))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: act_qtype %s is symmetric only: an asymmetric activation "
                            "range needs an int or uint format; set act_symmetric true", m->path, t->name);
    QtError inner = {0};
    if (calib_spec_check(&spec->act_calib, &inner) != QT_OK)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: activation calibration: %s", m->path, inner.msg);
    return QT_OK;
}

QtStatus qlayer_spec_check(const QLayerSpec *spec, const Module *m, QtError *err) {
    if (!spec || !m) return qt_error_set(err, QT_ERR_ARG, "qlayer_spec_check: NULL spec or module");
    int ndim = 0, shape[2] = {0, 0};
    QArrayOptions o;
    QtStatus st = qlayer_layout(spec, m, &ndim, shape, &o, err);
    if (st == QT_OK) st = check_weight_options(spec, m, err);
    if (st != QT_OK) return st;
    /* whatever else qarray_quantize would refuse, under the module's name */
    char who[MODULE_NAME_MAX + 16];
    snprintf(who, sizeof who, "%s: weight", m->path);
    QArrayPlan p;
    QtError inner = {0};
    Rng any = qlayer_round_rng(0, 0); /* the plan wants a generator for stochastic rounding; none is drawn */
    if (o.round == QROUND_STOCHASTIC) o.rng = &any;
    if (qarray_plan_make(&p, who, ndim, shape, spec->weight_qtype, &o, &inner) != QT_OK)
        return qt_error_set(err, QT_ERR_CONFIG, "%s", inner.msg);
    return check_act(spec, m, err);
}

/* ---- bands ------------------------------------------------------------------------------------------- */

static size_t gcd_size(size_t a, size_t b) {
    while (b) {
        size_t r = a % b;
        a = b, b = r;
    }
    return a;
}

/* Output channels per sgemm. A band is dequantized as whole QArray rows of
 * row_len elements, so weight row r0 (flat element r0 * fan_in) must start
 * one: band sizes are multiples of row_len / gcd(fan_in, row_len). Within
 * that, as many rows as QLAYER_TILE_BYTES holds; if a single aligned band
 * is already larger, the band is that alignment (the budget cannot be met
 * without splitting a block). */
static int band_rows_for(int out, int fan_in, int row_len) {
    size_t align = (size_t)row_len / gcd_size((size_t)fan_in, (size_t)row_len);
    size_t budget = QLAYER_TILE_BYTES / ((size_t)fan_in * sizeof(float));
    size_t rows = budget / align * align;
    if (rows < align) rows = align;
    if (rows > (size_t)out) rows = (size_t)out; /* out is a multiple of align: numel is one of row_len */
    return (int)rows;
}

/* ---- init / free ------------------------------------------------------------------------------------- */

/* Everything but the QArray's data; qlayer_layout checked. */
static QtStatus layer_setup(QLayer *q, Module *m, const QLayerSpec *spec, int *ndim, int shape[2], QtError *err) {
    memset(q, 0, sizeof *q);
    QtStatus st = qlayer_spec_check(spec, m, err);
    if (st != QT_OK) return st;
    q->module = m;
    q->spec = *spec;
    /* options.calib must point into q's own copy of the spec */
    st = qlayer_layout(&q->spec, m, ndim, shape, &q->options, err);
    if (st != QT_OK) return st;
    const Tensor *w = &m->weight->var.value;
    q->w_ndim = w->ndim;
    for (int d = 0; d < 4; d++) q->w_shape[d] = d < w->ndim ? w->shape[d] : 1;
    q->out = w->shape[0];
    q->fan_in = (int)(tensor_numel(w) / (size_t)q->out);
    q->band_rows = band_rows_for(q->out, q->fan_in, shape[1]);
    calib_running_init(&q->act_stats, &q->spec.act_calib);
    return QT_OK;
}

Rng qlayer_round_rng(uint64_t seed, int module) {
    Rng r;
    rng_init(&r, seed, RNG_STREAM_WEIGHT_ROUNDING + ((uint64_t)module << 40));
    return r;
}

QtStatus qlayer_init_quantize(QLayer *q, Module *m, const QLayerSpec *spec, const float *w, QtError *err) {
    return qlayer_init_quantize_rng(q, m, spec, w, NULL, err);
}

QtStatus qlayer_init_quantize_rng(QLayer *q, Module *m, const QLayerSpec *spec, const float *w, const Rng *rng,
                                  QtError *err) {
    if (!q) return qt_error_set(err, QT_ERR_ARG, "qlayer_init_quantize: no QLayer");
    int ndim, shape[2];
    QtStatus st = layer_setup(q, m, spec, &ndim, shape, err);
    if (st == QT_OK && !w)
        st = qt_error_set(err, QT_ERR_ARG, "%s: no float weight to quantize (it was released?)", m->path);
    if (st == QT_OK) {
        QtError inner = {0};
        /* the generator lives for this call only: q->options keeps rng NULL */
        Rng r = rng ? *rng : qlayer_round_rng(0, 0);
        QArrayOptions o = q->options;
        if (o.round == QROUND_STOCHASTIC) o.rng = &r;
        st = qarray_quantize(&q->weight, w, ndim, shape, q->spec.weight_qtype, &o, &inner);
        if (st != QT_OK) qt_error_set(err, st, "%s: quantizing the weight: %s", m->path, inner.msg);
    }
    if (st != QT_OK) memset(q, 0, sizeof *q);
    return st;
}

QtStatus qlayer_init_empty(QLayer *q, Module *m, const QLayerSpec *spec, QtError *err) {
    if (!q) return qt_error_set(err, QT_ERR_ARG, "qlayer_init_empty: no QLayer");
    int ndim, shape[2];
    QtStatus st = layer_setup(q, m, spec, &ndim, shape, err);
    if (st == QT_OK) {
        QtError inner = {0};
        st = qarray_alloc(&q->weight, ndim, shape, q->spec.weight_qtype, &q->options, &inner);
        if (st != QT_OK) qt_error_set(err, st, "%s: allocating the weight: %s", m->path, inner.msg);
    }
    if (st != QT_OK) memset(q, 0, sizeof *q);
    return st;
}

void qlayer_free(QLayer *q) {
    if (!q) return;
    qlayer_int8_release(q);
    qarray_free(&q->weight);
    memset(q, 0, sizeof *q);
}

void qlayer_dequantize_weight(const QLayer *q, float *w) {
    /* the QArray's rows are a reshape of the flattened weight */
    if (q) qarray_dequantize(&q->weight, w);
}

size_t qlayer_bytes(const QLayer *q) { return q ? qarray_bytes(&q->weight) : 0; }

/* ---- static activation ranges ------------------------------------------------------------------------ */

void qlayer_calib_begin(QLayer *q) {
    if (!q || !q->spec.act_qtype) return;
    calib_running_init(&q->act_stats, &q->spec.act_calib);
    q->calibrating = true;
    q->act_ready = false;
}

QtStatus qlayer_act_from_stats(QLayer *q, QtError *err) {
    if (!q) return qt_error_set(err, QT_ERR_ARG, "qlayer_act_from_stats: no QLayer");
    const QType *t = q->spec.act_qtype;
    if (!t) return QT_OK;
    const char *path = q->module ? q->module->path : "(no module)";
    if (q->act_stats.count <= 0)
        return qt_error_set(err, QT_ERR_VALUE, "%s: no activation statistics: calibration saw no batch, so the "
                            "static range of the input is unknown (run calibration batches through the layer)", path);
    QtError inner = {0};
    if (calib_running_check(&q->act_stats, &inner) != QT_OK)
        return qt_error_set(err, QT_ERR_VALUE, "%s: activation statistics: %s", path, inner.msg);
    CalibRange r = calib_running_range(&q->act_stats);
    bool asym = !q->spec.act_symmetric;
    if (!asym) {
        float a = fmaxf(-r.lo, r.hi);
        r = (CalibRange){-a, a};
    }
    float qmin = (float)t->qmin, qmax = (float)t->qmax;
    float s = qarray_scale_for_range(t, asym, false, qmin, qmax, r.lo, r.hi);
    q->act_scale = s;
    q->act_zero_point = asym ? qarray_zero_point_for_range(false, qmin, qmax, r.lo, s) : 0.0f;
    q->act_ready = true;
    return QT_OK;
}

QtStatus qlayer_calib_end(QLayer *q, QtError *err) {
    if (!q) return qt_error_set(err, QT_ERR_ARG, "qlayer_calib_end: no QLayer");
    if (!q->spec.act_qtype) return QT_OK;
    q->calibrating = false;
    return qlayer_act_from_stats(q, err);
}

/* ---- description -------------------------------------------------------------------------------------- */

void qlayer_describe(const QLayer *q, char *buf, size_t cap) {
    if (!buf || !cap) return;
    buf[0] = '\0';
    if (!q || !q->spec.weight_qtype) return;
    const QLayerSpec *s = &q->spec;
    const QType *t = s->weight_qtype;
    char calib[64] = "", act[128] = "";
    size_t len = (size_t)snprintf(buf, cap, "%s", t->name);
#define APPEND(...)                                                          \
    do {                                                                     \
        if (len < cap) len += (size_t)snprintf(buf + len, cap - len, __VA_ARGS__); \
    } while (0)
    if (qtype_is_block(t)) APPEND(" block %d", t->block);
    else if (s->tile_size > 0) APPEND(" block %d", s->tile_size);
    else APPEND("%s", s->per_tensor ? " per-tensor" : " per-channel");
    if (!s->symmetric) APPEND(" asym");
    if (s->narrow_range) APPEND(" narrow");
    if (!qtype_is_block(t) && s->scale_type != QARRAY_SCALE_F32)
        APPEND(" %s scales", qarray_scale_type_name(s->scale_type));
    if (s->double_quant) APPEND(" +dq");
    if (s->rounding != QROUND_RNE) APPEND(" %s", qround_name(s->rounding));
    if (!qtype_is_block(t)) {
        calib_format(&s->weight_calib, calib, sizeof calib);
        APPEND(" %s", calib);
    }
    if (s->act_qtype) {
        calib_format(&s->act_calib, calib, sizeof calib);
        snprintf(act, sizeof act, ", act %s%s %s", s->act_qtype->name, s->act_symmetric ? "" : " asym", calib);
    }
    APPEND("%s (%.2f bits)", act, qarray_bits_per_element(&q->weight));
#undef APPEND
}
