/* qarray.c - QArray quantize / dequantize: options and layout, per-slice
 * scales from calibration, scale types, zero points, element codes and the
 * block formats. Float16/bfloat16 bits and double quantization live in
 * qarray_dq.c. */
#include "qarray.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Codes packed and RNG words drawn per step: a multiple of 8, so a chunk of
 * codes of any width ends on a byte boundary, and of 4, so every refill but
 * the last takes whole Philox blocks. */
#define CHUNK 512
#define BLOCK_MAX 32 /* the largest block of a block format (qtype_block.c's limit too) */

/* ---- names ------------------------------------------------------------------ */

static const char *const SCALE_NAMES[] = {"float32", "float16", "bfloat16", "pof2", "f32", "fp32", "f16", "fp16",
                                          "bf16"};
static const QArrayScaleType SCALE_OF_NAME[] = {QARRAY_SCALE_F32, QARRAY_SCALE_F16, QARRAY_SCALE_BF16,
                                                QARRAY_SCALE_POF2, QARRAY_SCALE_F32, QARRAY_SCALE_F32,
                                                QARRAY_SCALE_F16, QARRAY_SCALE_F16, QARRAY_SCALE_BF16};
static const char *const ZP_NAMES[] = {[QARRAY_ZP_INT32] = "int32", [QARRAY_ZP_FLOAT] = "float"};

const char *qarray_scale_type_name(QArrayScaleType t) {
    return (int)t >= 0 && t < QARRAY_SCALE_COUNT ? SCALE_NAMES[t] : "unknown";
}

QtStatus qarray_scale_type_parse(const char *name, QArrayScaleType *out, QtError *err) {
    int k = 0;
    QtStatus st = qt_name_lookup("scale type", name, SCALE_NAMES, (int)(sizeof SCALE_NAMES / sizeof SCALE_NAMES[0]),
                                 &k, err);
    if (st == QT_OK) *out = SCALE_OF_NAME[k];
    return st;
}

const char *qarray_zp_type_name(QArrayZpType t) { return (int)t >= 0 && t < QARRAY_ZP_COUNT ? ZP_NAMES[t] : "unknown"; }

QtStatus qarray_zp_type_parse(const char *name, QArrayZpType *out, QtError *err) {
    int k = 0;
    QtStatus st = qt_name_lookup("zero-point type", name, ZP_NAMES, QARRAY_ZP_COUNT, &k, err);
    if (st == QT_OK) *out = (QArrayZpType)k;
    return st;
}

/* ---- the resolved options -------------------------------------------------- */

typedef enum { AXIS_SHARED, AXIS_CHANNEL, AXIS_TILED } AxisKind;

/* Everything quantize needs, checked once. */
typedef struct {
    const QType *t;
    int ndim;
    int shape[QARRAY_MAX_DIMS];
    int tile[QARRAY_MAX_DIMS];  /* [ndim] as QArray.tile */
    int sdim[QARRAY_MAX_DIMS];  /* [ndim] as QArray.scale_shape */
    size_t numel, n_scales;
    bool asym, narrow, zp_float;
    float qmin, qmax;           /* INT/UINT/TERNARY: effective code range (narrow applied) */
    QArrayScaleType scale_type;
    QRound round;
    Rng *rng;
    CalibSpec calib;
    bool mean_abs;              /* ternary/binary without a calibration: scale = mean |x| */
    bool dq;
    int dq_block;
} Plan;

static bool is_int_kind(const QType *t) { return t->kind == QTYPE_KIND_INT || t->kind == QTYPE_KIND_UINT; }

/* "(2, 64)" */
static void format_tuple(char *buf, size_t cap, const size_t *v, int n) {
    size_t len = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%zu", i ? ", " : "", v[i]);
    if (len < cap) snprintf(buf + len, cap - len, n == 1 ? ",)" : ")");
}

static void shape_string(char *buf, size_t cap, const int *shape, int ndim) {
    size_t v[QARRAY_MAX_DIMS];
    for (int d = 0; d < ndim; d++) v[d] = (size_t)shape[d];
    format_tuple(buf, cap, v, ndim);
}

/* axis in -ndim..ndim-1 -> 0..ndim-1; -1 if out of range. */
static int normalize_axis(int axis, int ndim) {
    if (axis < -ndim || axis >= ndim) return -1;
    return axis < 0 ? axis + ndim : axis;
}

static QtStatus claim_axis(AxisKind *kind, int axis, int ndim, AxisKind as, const char *option, int *out,
                           QtError *err) {
    int a = normalize_axis(axis, ndim);
    if (a < 0)
        return qt_error_set(err, QT_ERR_ARG, "QArray option %s: axis %d is out of range for a %d-d array (valid: "
                            "%d..%d)", option, axis, ndim, -ndim, ndim - 1);
    if (kind[a] != AXIS_SHARED)
        return qt_error_set(err, QT_ERR_ARG, "QArray option %s: axis %d is listed twice (it is already %s); give "
                            "each axis once, as channelwise or as tiled", option, axis,
                            kind[a] == AXIS_CHANNEL ? "channelwise" : "tiled");
    kind[a] = as;
    *out = a;
    return QT_OK;
}

/* The tile of axis a from QArrayTiledAxis.tile; `why` explains where a
 * default tile came from, for the message. */
static QtStatus resolve_tile(Plan *p, int a, double tile, const char *why, QtError *err) {
    int dim = p->shape[a];
    long t;
    if (!(tile > 0.0) || isinf(tile) || (tile >= 1.0 && (tile != floor(tile) || tile > INT_MAX)))
        return qt_error_set(err, QT_ERR_ARG, "QArray option tiled_axes: the tile %g of axis %d must be a whole "
                            "number of elements >= 1 or a fraction of the axis in (0, 1)", tile, a);
    if (tile >= 1.0) {
        t = (long)tile;
    } else {
        t = (long)rint(dim * tile); /* Qwix: round(axis_size * fraction), ties to even */
        if (t == 0 && dim > 0)
            return qt_error_set(err, QT_ERR_SHAPE, "QArray: the tile fraction %g of axis %d (size %d) rounds to 0 "
                                "elements; give a larger fraction or a tile size", tile, a, dim);
    }
    if (t > 0 && dim % t != 0) {
        char frac[64] = "";
        if (tile < 1.0) snprintf(frac, sizeof frac, " (the fraction %g of the axis, rounded)", tile);
        return qt_error_set(err, QT_ERR_SHAPE, "QArray: axis %d of size %d is not a multiple of the tile size "
                            "%ld%s%s; choose a tile that divides the axis", a, dim, t, frac, why);
    }
    p->tile[a] = (int)t;
    p->sdim[a] = t > 0 ? dim / (int)t : 0;
    return QT_OK;
}

/* The block formats tile the last axis by their block, and nothing else. */
static QtStatus plan_block_axes(Plan *p, const QArrayOptions *o, AxisKind *kind, QtError *err) {
    const char *nm = p->t->name;
    int last = p->ndim - 1;
    if (p->ndim == 0)
        return qt_error_set(err, QT_ERR_SHAPE, "QArray: %s quantizes blocks of %d along the last axis; a 0-d array "
                            "has none (reshape it to (1,))", nm, p->t->block);
    if (o->n_channelwise > 0)
        return qt_error_set(err, QT_ERR_ARG, "QArray option channelwise_axes: %s has one scale per block of %d "
                            "along the last axis; leave the axes empty", nm, p->t->block);
    if (o->n_tiled > 1 ||
        (o->n_tiled == 1 && (normalize_axis(o->tiled_axes[0].axis, p->ndim) != last ||
                             o->tiled_axes[0].tile != (double)p->t->block)))
        return qt_error_set(err, QT_ERR_ARG, "QArray option tiled_axes: %s's blocks are %d elements along the last "
                            "axis and cannot be changed; leave tiled_axes empty", nm, p->t->block);
    for (int d = 0; d < last; d++) kind[d] = AXIS_CHANNEL, p->tile[d] = 1, p->sdim[d] = p->shape[d];
    kind[last] = AXIS_TILED;
    char why[96];
    snprintf(why, sizeof why, " (the %s block)", nm);
    return resolve_tile(p, last, p->t->block, why, err);
}

static QtStatus plan_axes(Plan *p, const QArrayOptions *o, QtError *err) {
    AxisKind kind[QARRAY_MAX_DIMS] = {AXIS_SHARED, AXIS_SHARED, AXIS_SHARED, AXIS_SHARED};
    if (o->n_channelwise < 0 || o->n_channelwise > QARRAY_MAX_DIMS || o->n_tiled < 0 ||
        o->n_tiled > QARRAY_MAX_DIMS)
        return qt_error_set(err, QT_ERR_ARG, "QArray options: n_channelwise = %d and n_tiled = %d must be in 0..%d",
                            o->n_channelwise, o->n_tiled, QARRAY_MAX_DIMS);
    for (int d = 0; d < p->ndim; d++) p->tile[d] = p->shape[d], p->sdim[d] = 1;
    if (qtype_is_block(p->t)) {
        QtStatus st = plan_block_axes(p, o, kind, err);
        if (st != QT_OK) return st;
    } else if (p->t->kind == QTYPE_KIND_LUT && o->n_channelwise == 0 && o->n_tiled == 0 && p->ndim > 0) {
        /* bitsandbytes' blocks of 64 of the flattened array: each row's own blocks when 64 divides the row */
        char why[160];
        snprintf(why, sizeof why, " (%s's default block of %d along the last axis; give tiled_axes or "
                 "channelwise_axes to choose another)", p->t->name, QARRAY_NF4_BLOCK);
        QtStatus st = resolve_tile(p, p->ndim - 1, QARRAY_NF4_BLOCK, why, err);
        if (st != QT_OK) return st;
        for (int d = 0; d < p->ndim - 1; d++) p->tile[d] = 1, p->sdim[d] = p->shape[d];
    }
    for (int i = 0; i < o->n_channelwise && !qtype_is_block(p->t); i++) {
        int a;
        QtStatus st = claim_axis(kind, o->channelwise_axes[i], p->ndim, AXIS_CHANNEL, "channelwise_axes", &a, err);
        if (st != QT_OK) return st;
        p->tile[a] = 1, p->sdim[a] = p->shape[a];
    }
    for (int i = 0; i < o->n_tiled && !qtype_is_block(p->t); i++) {
        int a;
        QtStatus st = claim_axis(kind, o->tiled_axes[i].axis, p->ndim, AXIS_TILED, "tiled_axes", &a, err);
        if (st == QT_OK) st = resolve_tile(p, a, o->tiled_axes[i].tile, "", err);
        if (st != QT_OK) return st;
    }
    p->n_scales = 1;
    for (int d = 0; d < p->ndim; d++) p->n_scales *= (size_t)p->sdim[d];
    return QT_OK;
}

/* Range, narrow range, zero point, scale type: what the format allows. */
static QtStatus plan_range(Plan *p, const QArrayOptions *o, QtError *err) {
    const QType *t = p->t;
    if ((int)o->range < 0 || o->range >= QARRAY_RANGE_COUNT)
        return qt_error_set(err, QT_ERR_ARG, "QArray option range: %d is not auto, symmetric or asymmetric",
                            (int)o->range);
    p->asym = o->range == QARRAY_RANGE_ASYMMETRIC || (o->range == QARRAY_RANGE_AUTO && t->kind == QTYPE_KIND_UINT);
    if (p->asym && !is_int_kind(t))
        return qt_error_set(err, QT_ERR_ARG, "QArray option range = asymmetric: %s has no zero point; only int and "
                            "uint formats take an asymmetric range", t->name);
    if (o->narrow_range && t->kind != QTYPE_KIND_INT)
        return qt_error_set(err, QT_ERR_ARG, "QArray option narrow_range: only signed int formats (int2..int8) have "
                            "a narrow range, %s has not", t->name);
    if ((int)o->zp_type < 0 || o->zp_type >= QARRAY_ZP_COUNT)
        return qt_error_set(err, QT_ERR_ARG, "QArray option zp_type: %d is not int32 or float", (int)o->zp_type);
    if (o->zp_type == QARRAY_ZP_FLOAT && !p->asym)
        return qt_error_set(err, QT_ERR_ARG, "QArray option zp_type = float: a symmetric range has no zero point; "
                            "set range = asymmetric or leave zp_type at int32");
    if ((int)o->scale_type < 0 || o->scale_type >= QARRAY_SCALE_COUNT)
        return qt_error_set(err, QT_ERR_ARG, "QArray option scale_type: %d is not float32, float16, bfloat16 or "
                            "pof2", (int)o->scale_type);
    if (qtype_is_block(t) && (o->scale_type == QARRAY_SCALE_F16 || o->scale_type == QARRAY_SCALE_BF16))
        return qt_error_set(err, QT_ERR_ARG, "QArray option scale_type = %s: %s's scales are e8m0 powers of two; "
                            "leave scale_type at float32 or set pof2", qarray_scale_type_name(o->scale_type),
                            t->name);
    p->narrow = o->narrow_range;
    p->zp_float = o->zp_type == QARRAY_ZP_FLOAT;
    p->scale_type = qtype_is_block(t) ? QARRAY_SCALE_POF2 : o->scale_type;
    p->qmin = (float)t->qmin, p->qmax = (float)t->qmax;
    if (p->narrow) p->qmin = -p->qmax;
    return QT_OK;
}

static QtStatus plan_rest(Plan *p, const QArrayOptions *o, QtError *err) {
    const QType *t = p->t;
    if ((int)o->round < 0 || o->round >= QROUND_COUNT)
        return qt_error_set(err, QT_ERR_ARG, "QArray option round: %d is not a rounding mode (rne, half_away, "
                            "floor, stochastic)", (int)o->round);
    if (o->round == QROUND_STOCHASTIC && !o->rng)
        return qt_error_set(err, QT_ERR_ARG, "QArray option round = stochastic needs an Rng in options.rng (a "
                            "stream of its own, e.g. RNG_STREAM_ROUNDING)");
    if (o->round != QROUND_STOCHASTIC && o->rng)
        return qt_error_set(err, QT_ERR_ARG, "QArray option rng is set but round = %s draws no noise; set round = "
                            "stochastic or leave rng NULL", qround_name(o->round));
    p->round = o->round, p->rng = o->rng;
    if (o->calib && qtype_is_block(t))
        return qt_error_set(err, QT_ERR_ARG, "QArray option calib: %s's block scales come from each block's absmax "
                            "(OCP MX); leave calib NULL", t->name);
    if (o->calib) {
        QtStatus st = calib_spec_check(o->calib, err);
        if (st != QT_OK) return st;
        p->calib = *o->calib;
    } else {
        p->calib = (CalibSpec){.kind = p->asym ? CALIB_MINMAX : CALIB_ABSMAX, .s = 1.0};
        p->mean_abs = t->kind == QTYPE_KIND_TERNARY || t->kind == QTYPE_KIND_BINARY;
    }
    if (o->dq_block < 0 || (o->dq_block > 0 && !o->double_quant))
        return qt_error_set(err, QT_ERR_ARG, "QArray option dq_block = %d: it must be >= 0 (0: %d) and needs "
                            "double_quant", o->dq_block, QARRAY_DQ_BLOCK);
    const char *why = NULL;
    if (o->double_quant && qtype_is_block(t)) why = "block formats carry their own e8m0 scales";
    else if (o->double_quant && p->asym) why = "double quantization needs a symmetric range";
    else if (o->double_quant && o->scale_type != QARRAY_SCALE_F32)
        why = "it replaces the scale storage, so scale_type must stay float32";
    if (why) return qt_error_set(err, QT_ERR_ARG, "QArray option double_quant with %s: %s", t->name, why);
    p->dq = o->double_quant;
    p->dq_block = o->dq_block ? o->dq_block : QARRAY_DQ_BLOCK;
    return QT_OK;
}

static QtStatus plan_make(Plan *p, int ndim, const int *shape, const QType *t, const QArrayOptions *o,
                          QtError *err) {
    memset(p, 0, sizeof *p);
    if (!t) return qt_error_set(err, QT_ERR_ARG, "QArray: no qtype given");
    if (ndim < 0 || ndim > QARRAY_MAX_DIMS || (ndim > 0 && !shape))
        return qt_error_set(err, QT_ERR_ARG, "QArray: %d dimensions (%s); a QArray has 0..%d", ndim,
                            shape ? "with a shape" : "no shape", QARRAY_MAX_DIMS);
    if (!qtype_is_block(t) && (t->bits < 1 || t->bits > 8))
        return qt_error_set(err, QT_ERR_ARG, "QArray: %s has %d-bit codes; QArray handles 1..8", t->name, t->bits);
    if (qtype_is_block(t) && (t->block < 1 || t->block > BLOCK_MAX))
        return qt_error_set(err, QT_ERR_ARG, "QArray: %s has blocks of %d; QArray handles 1..%d", t->name, t->block,
                            BLOCK_MAX);
    p->t = t, p->ndim = ndim, p->numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0) return qt_error_set(err, QT_ERR_SHAPE, "QArray: axis %d has negative size %d", d, shape[d]);
        if (shape[d] > 0 && p->numel > SIZE_MAX / sizeof(float) / (size_t)shape[d])
            return qt_error_set(err, QT_ERR_SHAPE, "QArray: the shape's element count overflows");
        p->shape[d] = shape[d];
        p->numel *= (size_t)shape[d];
    }
    QtStatus st = plan_axes(p, o, err);
    if (st == QT_OK) st = plan_range(p, o, err);
    if (st == QT_OK) st = plan_rest(p, o, err);
    return st;
}

/* ---- the layout, padded to 4 dims -------------------------------------------- */

typedef struct {
    size_t dim[4], tile[4], sdim[4], sstride[4]; /* leading axes of a smaller array are 1 */
} Layout;

static void layout_of(const QArray *q, Layout *L) {
    int off = 4 - q->ndim;
    for (int k = 0; k < 4; k++) {
        int d = k - off;
        L->dim[k] = d >= 0 ? (size_t)q->shape[d] : 1;
        L->tile[k] = d >= 0 ? (size_t)q->tile[d] : 1;
        L->sdim[k] = d >= 0 ? (size_t)q->scale_shape[d] : 1;
    }
    L->sstride[3] = 1;
    for (int k = 2; k >= 0; k--) L->sstride[k] = L->sstride[k + 1] * L->sdim[k + 1];
}

/* Scale index of the first element of row r (all axes but the last), r < numel / dim[3]. */
static size_t row_group(const Layout *L, size_t r) {
    size_t a2 = r % L->dim[2];
    r /= L->dim[2];
    size_t a1 = r % L->dim[1], a0 = r / L->dim[1];
    return a0 / L->tile[0] * L->sstride[0] + a1 / L->tile[1] * L->sstride[1] + a2 / L->tile[2] * L->sstride[2];
}

/* The elements of slice g (a scale index) -> buf; returns their count. */
static size_t gather_slice(const Layout *L, const float *x, size_t g, float *buf) {
    size_t start[4];
    for (int k = 3; k >= 0; k--) {
        start[k] = g % L->sdim[k] * L->tile[k];
        g /= L->sdim[k];
    }
    size_t n = 0;
    for (size_t a0 = start[0]; a0 < start[0] + L->tile[0]; a0++)
        for (size_t a1 = start[1]; a1 < start[1] + L->tile[1]; a1++)
            for (size_t a2 = start[2]; a2 < start[2] + L->tile[2]; a2++) {
                const float *row = x + ((a0 * L->dim[1] + a1) * L->dim[2] + a2) * L->dim[3];
                for (size_t a3 = start[3]; a3 < start[3] + L->tile[3]; a3++) buf[n++] = row[a3];
            }
    return n;
}

/* ---- scalar rules -------------------------------------------------------------- */

/* v rounded to an integer by mode; stochastic: floor(v + u), decided as
 * u >= 1 - frac so that no float addition rounds v + u. */
static float round_int(float v, QRound mode, float u) {
    switch (mode) {
    case QROUND_HALF_AWAY: return roundf(v);
    case QROUND_FLOOR: return floorf(v);
    case QROUND_STOCHASTIC: {
        float lo = floorf(v);
        return lo + (float)(u >= 1.0f - (v - lo));
    }
    default: return rintf(v); /* the default rounding mode: ties to even */
    }
}

float qarray_scale_for_range(const QType *t, bool asym, bool narrow, float qmin, float qmax, float lo, float hi) {
    float s;
    if (asym) {
        double lo0 = fmin(lo, 0.0), hi0 = fmax(hi, 0.0);
        s = (float)((hi0 - lo0) / ((double)qmax - qmin));
    } else {
        float amax = fmaxf(-lo, hi);
        switch (t->kind) {
        case QTYPE_KIND_INT: s = narrow ? amax / qmax : amax / (qmax + 0.5f); break;
        case QTYPE_KIND_UINT: s = amax / qmax; break;
        case QTYPE_KIND_LUT: {
            float top = fmaxf(fabsf(t->lut[0]), fabsf(t->lut[(1 << t->bits) - 1]));
            s = amax / top;
            break;
        }
        case QTYPE_KIND_FLOAT: s = amax / t->max; break;
        default: s = amax; break; /* ternary, binary: the range maps to the code +1 */
        }
    }
    return s >= QARRAY_SCALE_MIN && isfinite(s) ? s : 1.0f;
}

int qarray_calib_levels(const QType *t, bool asym) {
    int levels = t->kind == QTYPE_KIND_UINT && !asym ? 1 << t->bits : 1 << (t->bits - 1);
    return levels < 2 ? 2 : levels;
}

float qarray_zero_point_for_range(bool zp_float, float qmin, float qmax, float lo, float s) {
    float v = fminf(lo, 0.0f) / s;
    float zp = zp_float ? qmin - v : qmin - rintf(v);
    return fminf(fmaxf(zp, qmin), qmax);
}

static float scale_from_range(const Plan *p, float lo, float hi) {
    return qarray_scale_for_range(p->t, p->asym, p->narrow, p->qmin, p->qmax, lo, hi);
}

static float zero_point_of(const Plan *p, float lo, float s) {
    return qarray_zero_point_for_range(p->zp_float, p->qmin, p->qmax, lo, s);
}

/* One element -> its code, x / s on the grid; zp in code units (0 if symmetric). */
static uint32_t encode_elem(const Plan *p, float x, float s, float zp, QRound mode, float u) {
    const QType *t = p->t;
    if (!is_int_kind(t)) return qtype_encode(t, x / s, mode, u);
    float q;
    if (p->zp_float) {
        q = round_int(fminf(fmaxf(x / s + zp, p->qmin), p->qmax), mode, u);
    } else {
        /* clamping before rounding is the same as after: the bounds are integers */
        q = round_int(fminf(fmaxf(x / s, p->qmin - zp), p->qmax - zp), mode, u) + zp;
    }
    return (uint32_t)(int32_t)q & ((1u << t->bits) - 1u);
}

/* What calibration's mse sees: this format's round trip (rne) over the
 * candidate range. */
static float calib_roundtrip(float x, float lo, float hi, const CalibQuant *cq) {
    const Plan *p = cq->ctx;
    float s = scale_from_range(p, lo, hi);
    float zp = p->asym ? zero_point_of(p, lo, s) : 0.0f;
    return (qtype_decode(p->t, encode_elem(p, x, s, zp, QROUND_RNE, 0.0f)) - zp) * s;
}

/* ---- pass 1: scales and zero points ------------------------------------------- */

/* Rounds s to the scale type, stores it as scale i of q, returns the stored value. */
static QtStatus scale_store(QArray *q, size_t i, float s, float *used, QtError *err) {
    switch (q->scale_type) {
    case QARRAY_SCALE_F16: {
        uint16_t h = qarray_f32_to_f16(s);
        if (h == 0x7c00u)
            return qt_error_set(err, QT_ERR_VALUE, "QArray: scale %zu = %g exceeds float16's largest value 65504; "
                                "use bfloat16 or float32 scales", i, (double)s);
        if (h == 0) h = 1; /* 2^-24, the smallest subnormal: a larger scale never clips */
        q->scale.bits[i] = h;
        *used = qarray_f16_to_f32(h);
        return QT_OK;
    }
    case QARRAY_SCALE_BF16: {
        uint16_t b = qarray_f32_to_bf16(s);
        if (b == 0x7f80u)
            return qt_error_set(err, QT_ERR_VALUE, "QArray: scale %zu = %g rounds past bfloat16's largest value; use "
                                "float32 scales", i, (double)s);
        q->scale.bits[i] = b;
        *used = qarray_bf16_to_f32(b);
        return QT_OK;
    }
    case QARRAY_SCALE_POF2: {
        int e;
        float f = frexpf(s, &e); /* s = f * 2^e, f in [0.5, 1) */
        int k = f == 0.5f ? e - 1 : e; /* ceil(log2 s) */
        if (k > 127)
            return qt_error_set(err, QT_ERR_VALUE, "QArray: scale %zu = %g needs the power of two 2^%d, beyond "
                                "float's range; use float32 scales", i, (double)s, k);
        q->scale.e8m0[i] = (uint8_t)(k + 127);
        *used = ldexpf(1.0f, k);
        return QT_OK;
    }
    default:
        if (q->scale.f32) q->scale.f32[i] = s;
        *used = s;
        return QT_OK;
    }
}

/* Scratch of pass 1, freed by scratch_free. */
typedef struct {
    float *buf;       /* [largest slice] */
    void *work;       /* calibration workspace */
    size_t work_bytes;
    float *lo;        /* [n_scales] each slice's range minimum (asymmetric) */
} Scratch;

static void scratch_free(Scratch *s) {
    free(s->buf);
    free(s->work);
    free(s->lo);
}

static QtStatus slice_range(const Plan *p, Scratch *sc, size_t n, CalibRange *r, QtError *err) {
    if (p->mean_abs) {
        double sum = 0.0;
        for (size_t i = 0; i < n; i++) sum += fabsf(sc->buf[i]);
        float m = n ? (float)(sum / (double)n) : 0.0f;
        *r = (CalibRange){-m, m};
        return QT_OK;
    }
    CalibQuant cq = {.fn = calib_roundtrip, .ctx = p, .levels = qarray_calib_levels(p->t, p->asym),
                     .asymmetric = p->asym};
    return calib_compute(&p->calib, sc->buf, n, &cq, sc->work, sc->work_bytes, r, err);
}

/* Scales (stored) and zero points of every slice; used [n_scales] gets the
 * scale each slice's codes are computed with. */
static QtStatus compute_scales(QArray *q, const Plan *p, const float *x, float *used, QtError *err) {
    Layout L;
    layout_of(q, &L);
    size_t slice = q->n_scales ? p->numel / q->n_scales : 0;
    Scratch sc = {0};
    sc.work_bytes = calib_workspace_bytes(&p->calib, slice);
    sc.buf = malloc((slice ? slice : 1) * sizeof(float));
    sc.work = sc.work_bytes ? malloc(sc.work_bytes) : NULL;
    sc.lo = p->asym ? malloc((q->n_scales ? q->n_scales : 1) * sizeof(float)) : NULL;
    QtStatus st = QT_OK;
    if (!sc.buf || (sc.work_bytes && !sc.work) || (p->asym && !sc.lo))
        st = qt_error_set(err, QT_ERR_NOMEM, "QArray: out of memory for a slice of %zu values", slice);
    for (size_t g = 0; st == QT_OK && g < q->n_scales; g++) {
        size_t n = p->numel ? gather_slice(&L, x, g, sc.buf) : 0;
        CalibRange r;
        st = slice_range(p, &sc, n, &r, err);
        if (st != QT_OK) break;
        if (sc.lo) sc.lo[g] = r.lo;
        used[g] = scale_from_range(p, r.lo, r.hi);
        if (!p->dq) st = scale_store(q, g, used[g], &used[g], err);
    }
    if (st == QT_OK && p->dq) {
        float *raw = malloc((q->n_scales ? q->n_scales : 1) * sizeof *raw);
        if (!raw) st = qt_error_set(err, QT_ERR_NOMEM, "QArray: out of memory for %zu scales", q->n_scales);
        if (raw) memcpy(raw, used, q->n_scales * sizeof *raw);
        if (st == QT_OK) st = qarray_dq_compress(&q->dq, raw, q->n_scales, p->dq_block, used, err);
        free(raw);
    }
    for (size_t g = 0; st == QT_OK && p->asym && g < q->n_scales; g++) {
        float zp = zero_point_of(p, sc.lo[g], used[g]);
        if (p->zp_float) q->zero_point.f32[g] = zp;
        else q->zero_point.i32[g] = (int32_t)zp;
    }
    scratch_free(&sc);
    return st;
}

/* ---- pass 2: codes ---------------------------------------------------------------- */

/* Codes in flat order, packed CHUNK at a time. */
typedef struct {
    const QType *t;
    uint8_t *out;
    size_t done, n;
    uint32_t buf[CHUNK];
} Packer;

static void packer_flush(Packer *pk) {
    if (!pk->n) return;
    qtype_pack(pk->t, pk->buf, pk->n, pk->out + pk->done * (size_t)pk->t->bits / 8);
    pk->done += pk->n;
    pk->n = 0;
}

static void packer_put(Packer *pk, uint32_t code) {
    pk->buf[pk->n++] = code;
    if (pk->n == CHUNK) packer_flush(pk);
}

static void encode_elements(QArray *q, const Plan *p, const float *x, const float *used, RngUniforms *u,
                            Packer *pk) {
    if (!p->numel) return;
    Layout L;
    layout_of(q, &L);
    *pk = (Packer){.t = p->t, .out = q->codes};
    size_t rows = p->numel / L.dim[3], d3 = L.dim[3], t3 = L.tile[3];
    for (size_t r = 0; r < rows; r++) {
        size_t g0 = row_group(&L, r);
        const float *xr = x + r * d3;
        for (size_t a = 0; a < d3; a += t3) {
            size_t g = g0 + a / t3;
            float s = used[g], zp = qarray_zero_point_at(q, g);
            bool zero = !(fabsf(s) >= QARRAY_SCALE_MIN); /* only a double-quantized scale can be this small */
            for (size_t j = a; j < a + t3; j++) {
                float uj = rng_uniforms_next(u);
                packer_put(pk, encode_elem(p, zero ? 0.0f : xr[j], zero ? 1.0f : s, zp, p->round, uj));
            }
        }
    }
    packer_flush(pk);
}

static QtStatus encode_blocks(QArray *q, const Plan *p, const float *x, RngUniforms *u, QtError *err) {
    const QType *t = p->t;
    size_t nb = p->numel / (size_t)t->block;
    float uv[BLOCK_MAX];
    for (size_t b = 0; b < nb; b++) {
        for (int i = 0; i < t->block; i++) uv[i] = rng_uniforms_next(u);
        QtStatus st = qtype_block_quantize(t, x + b * (size_t)t->block, t->block, q->codes + b * t->block_bytes,
                                           p->round, uv);
        if (st != QT_OK)
            return qt_error_set(err, st, "QArray: %s block %zu could not be quantized", t->name, b);
    }
    return QT_OK;
}

/* ---- quantize ----------------------------------------------------------------------- */

static QtStatus check_finite(const float *x, size_t n, int ndim, const int *shape, QtError *err) {
    for (size_t i = 0; i < n; i++) {
        if (isfinite(x[i])) continue;
        size_t idx[QARRAY_MAX_DIMS] = {0}, r = i;
        for (int d = ndim - 1; d >= 0; d--) {
            idx[d] = r % (size_t)shape[d];
            r /= (size_t)shape[d];
        }
        char at[96], sh[96];
        format_tuple(at, sizeof at, idx, ndim);
        shape_string(sh, sizeof sh, shape, ndim);
        return qt_error_set(err, QT_ERR_VALUE, "QArray: x[%zu] (index %s of shape %s) is %s; only finite values "
                            "can be quantized", i, at, sh, isnan(x[i]) ? "NaN" : x[i] > 0 ? "+Inf" : "-Inf");
    }
    return QT_OK;
}

static QtStatus alloc_storage(QArray *q, const Plan *p, QtError *err) {
    size_t n = q->n_scales ? q->n_scales : 1;
    bool ok = true;
    q->code_bytes = qtype_packed_bytes(p->t, p->numel);
    q->codes = calloc(q->code_bytes ? q->code_bytes : 1, 1);
    ok &= q->codes != NULL;
    if (!qtype_is_block(p->t) && !p->dq) {
        switch (p->scale_type) {
        case QARRAY_SCALE_F16:
        case QARRAY_SCALE_BF16: ok &= (q->scale.bits = calloc(n, sizeof(uint16_t))) != NULL; break;
        case QARRAY_SCALE_POF2: ok &= (q->scale.e8m0 = calloc(n, 1)) != NULL; break;
        default: ok &= (q->scale.f32 = calloc(n, sizeof(float))) != NULL; break;
        }
    }
    if (p->asym && p->zp_float) ok &= (q->zero_point.f32 = calloc(n, sizeof(float))) != NULL;
    else if (p->asym) ok &= (q->zero_point.i32 = calloc(n, sizeof(int32_t))) != NULL;
    if (!ok)
        return qt_error_set(err, QT_ERR_NOMEM, "QArray: out of memory for %zu elements of %s", p->numel, p->t->name);
    return QT_OK;
}

QtStatus qarray_quantize(QArray *out, const float *x, int ndim, const int *shape, const QType *qtype,
                         const QArrayOptions *options, QtError *err) {
    if (!out) return qt_error_set(err, QT_ERR_ARG, "qarray_quantize: no output QArray");
    memset(out, 0, sizeof *out);
    const QArrayOptions defaults = {0};
    Plan p;
    QtStatus st = plan_make(&p, ndim, shape, qtype, options ? options : &defaults, err);
    if (st != QT_OK) return st;
    if (p.numel && !x) return qt_error_set(err, QT_ERR_ARG, "qarray_quantize: x is NULL for %zu elements", p.numel);
    if ((st = check_finite(x, p.numel, ndim, shape, err)) != QT_OK) return st;

    QArray *q = out;
    q->qtype = p.t, q->ndim = p.ndim, q->numel = p.numel, q->n_scales = p.n_scales;
    for (int d = 0; d < ndim; d++) q->shape[d] = p.shape[d], q->tile[d] = p.tile[d], q->scale_shape[d] = p.sdim[d];
    q->scale_type = p.scale_type, q->asymmetric = p.asym, q->zp_type = p.zp_float ? QARRAY_ZP_FLOAT : QARRAY_ZP_INT32;
    q->double_quant = p.dq, q->narrow_range = p.narrow, q->round = p.round;
    if ((st = alloc_storage(q, &p, err)) != QT_OK) {
        qarray_free(q);
        return st;
    }
    /* 4 KiB of chunk buffers: kept off the stack */
    struct {
        RngUniforms u;
        Packer pk;
    } *c = malloc(sizeof *c);
    float *used = qtype_is_block(p.t) ? NULL : malloc((p.n_scales ? p.n_scales : 1) * sizeof *used);
    if (!c || (!qtype_is_block(p.t) && !used)) {
        st = qt_error_set(err, QT_ERR_NOMEM, "QArray: out of memory for the scales of %zu elements", p.numel);
    } else {
        rng_uniforms_init(&c->u, p.round == QROUND_STOCHASTIC ? p.rng : NULL, p.numel);
        if (qtype_is_block(p.t)) {
            st = encode_blocks(q, &p, x, &c->u, err);
        } else if ((st = compute_scales(q, &p, x, used, err)) == QT_OK) {
            encode_elements(q, &p, x, used, &c->u, &c->pk);
        }
    }
    free(c);
    free(used);
    if (st != QT_OK) qarray_free(q);
    return st;
}

/* ---- dequantize ---------------------------------------------------------------------- */

/* Code i of an MSB-first stream of `bits`-bit codes (bits <= 8). */
static uint32_t code_get(const uint8_t *p, size_t i, int bits) {
    size_t off = i * (size_t)bits, b = off >> 3;
    int sh = (int)(off & 7), end = sh + bits;
    uint32_t w = end <= 8 ? (uint32_t)p[b] << 8 : ((uint32_t)p[b] << 8) | p[b + 1];
    return (w >> (16 - end)) & ((1u << bits) - 1u);
}

static size_t row_count(const QArray *q) {
    if (q->ndim == 0) return 1;
    size_t last = (size_t)q->shape[q->ndim - 1];
    return last ? q->numel / last : 0;
}

QtStatus qarray_dequantize_rows(const QArray *q, size_t row0, size_t n_rows, float *out) {
    size_t rows = q ? row_count(q) : 0;
    if (!q || !q->qtype || row0 > rows || n_rows > rows - row0 || (n_rows && !out)) return QT_ERR_ARG;
    if (!n_rows || !q->numel) return QT_OK;
    Layout L;
    layout_of(q, &L);
    const QType *t = q->qtype;
    size_t d3 = L.dim[3];
    if (qtype_is_block(t)) {
        size_t per_row = d3 / (size_t)t->block;
        for (size_t b = row0 * per_row; b < (row0 + n_rows) * per_row; b++)
            qtype_block_dequantize(t, q->codes + b * t->block_bytes, t->block,
                                   out + (b - row0 * per_row) * (size_t)t->block);
        return QT_OK;
    }
    float lut[256];
    for (uint32_t c = 0; c < (1u << t->bits); c++) lut[c] = qtype_decode(t, c);
    size_t t3 = L.tile[3];
    for (size_t r = row0; r < row0 + n_rows; r++) {
        size_t g0 = row_group(&L, r);
        float *y = out + (r - row0) * d3;
        for (size_t a = 0; a < d3; a += t3) {
            size_t g = g0 + a / t3;
            float s = qarray_scale_at(q, g), zp = qarray_zero_point_at(q, g);
            for (size_t j = a; j < a + t3; j++) y[j] = (lut[code_get(q->codes, r * d3 + j, t->bits)] - zp) * s;
        }
    }
    return QT_OK;
}

void qarray_dequantize(const QArray *q, float *out) {
    if (q) qarray_dequantize_rows(q, 0, row_count(q), out);
}

void qarray_free(QArray *q) {
    if (!q) return;
    free(q->codes);
    free(q->scale.f32); /* one allocation whichever member holds it */
    free(q->zero_point.f32);
    qarray_dq_free(&q->dq);
    memset(q, 0, sizeof *q);
}

/* ---- scales and sizes ------------------------------------------------------------------ */

float qarray_scale_at(const QArray *q, size_t i) {
    if (!q || !q->qtype || i >= q->n_scales) return NAN;
    if (qtype_is_block(q->qtype)) {
        uint8_t e = q->codes[i * q->qtype->block_bytes]; /* byte 0 of every block layout */
        return e == 255 ? NAN : ldexpf(1.0f, (int)e - 127);
    }
    if (q->double_quant) return qarray_dq_scale(&q->dq, i);
    switch (q->scale_type) {
    case QARRAY_SCALE_F16: return qarray_f16_to_f32(q->scale.bits[i]);
    case QARRAY_SCALE_BF16: return qarray_bf16_to_f32(q->scale.bits[i]);
    case QARRAY_SCALE_POF2: return ldexpf(1.0f, (int)q->scale.e8m0[i] - 127);
    default: return q->scale.f32[i];
    }
}

float qarray_zero_point_at(const QArray *q, size_t i) {
    if (!q || !q->asymmetric || i >= q->n_scales) return 0.0f;
    return q->zp_type == QARRAY_ZP_FLOAT ? q->zero_point.f32[i] : (float)q->zero_point.i32[i];
}

void qarray_scales(const QArray *q, float *out) {
    for (size_t i = 0; q && i < q->n_scales; i++) out[i] = qarray_scale_at(q, i);
}

size_t qarray_bytes(const QArray *q) {
    if (!q || !q->qtype) return 0;
    size_t bytes = q->code_bytes, n = q->n_scales;
    if (q->double_quant) {
        bytes += n + q->dq.n_blocks * sizeof(float) + sizeof(float);
    } else if (!qtype_is_block(q->qtype)) {
        static const size_t SCALE_BYTES[QARRAY_SCALE_COUNT] = {4, 2, 2, 1};
        bytes += n * SCALE_BYTES[q->scale_type];
    }
    if (q->asymmetric) bytes += n * 4;
    return bytes;
}

double qarray_bits_per_element(const QArray *q) {
    return q && q->numel ? (double)qarray_bytes(q) * 8.0 / (double)q->numel : 0.0;
}
