/* qarray_plan.c - QArray's options checked against a shape (axes, tiles,
 * range, scale type, rounding, calibration), the slicing of an array into
 * scale groups and the per-slice rules, shared by qarray.c and the dynamic
 * fake-quantization op. */
#include "qarray_plan.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- the resolved options -------------------------------------------------- */

typedef enum { AXIS_SHARED, AXIS_CHANNEL, AXIS_TILED } AxisKind;

static bool is_int_kind(const QType *t) { return t->kind == QTYPE_KIND_INT || t->kind == QTYPE_KIND_UINT; }

/* axis in -ndim..ndim-1 -> 0..ndim-1; -1 if out of range. */
static int normalize_axis(int axis, int ndim) {
    if (axis < -ndim || axis >= ndim) return -1;
    return axis < 0 ? axis + ndim : axis;
}

static QtStatus claim_axis(const char *who, AxisKind *kind, int axis, int ndim, AxisKind as, const char *option,
                           int *out, QtError *err) {
    int a = normalize_axis(axis, ndim);
    if (a < 0)
        return qt_error_set(err, QT_ERR_ARG, "%s option %s: axis %d is out of range for a %d-d array (valid: "
                            "%d..%d)", who, option, axis, ndim, -ndim, ndim - 1);
    if (kind[a] != AXIS_SHARED)
        return qt_error_set(err, QT_ERR_ARG, "%s option %s: axis %d is listed twice (it is already %s); give "
                            "each axis once, as channelwise or as tiled", who, option, axis,
                            kind[a] == AXIS_CHANNEL ? "channelwise" : "tiled");
    kind[a] = as;
    *out = a;
    return QT_OK;
}

/* The tile of axis a from QArrayTiledAxis.tile; `why` explains where a
 * default tile came from, for the message. */
static QtStatus resolve_tile(QArrayPlan *p, int a, double tile, const char *why, QtError *err) {
    int dim = p->shape[a];
    long t;
    if (!(tile > 0.0) || isinf(tile) || (tile >= 1.0 && (tile != floor(tile) || tile > INT_MAX)))
        return qt_error_set(err, QT_ERR_ARG, "%s option tiled_axes: the tile %g of axis %d must be a whole "
                            "number of elements >= 1 or a fraction of the axis in (0, 1)", p->who, tile, a);
    if (tile >= 1.0) {
        t = (long)tile;
    } else {
        t = (long)rint(dim * tile); /* Qwix: round(axis_size * fraction), ties to even */
        if (t == 0 && dim > 0)
            return qt_error_set(err, QT_ERR_SHAPE, "%s: the tile fraction %g of axis %d (size %d) rounds to 0 "
                                "elements; give a larger fraction or a tile size", p->who, tile, a, dim);
    }
    if (t > 0 && dim % t != 0) {
        char frac[64] = "";
        if (tile < 1.0) snprintf(frac, sizeof frac, " (the fraction %g of the axis, rounded)", tile);
        return qt_error_set(err, QT_ERR_SHAPE, "%s: axis %d of size %d is not a multiple of the tile size "
                            "%ld%s%s; choose a tile that divides the axis", p->who, a, dim, t, frac, why);
    }
    p->tile[a] = (int)t;
    p->sdim[a] = t > 0 ? dim / (int)t : 0;
    return QT_OK;
}

/* The block formats tile the last axis by their block, and nothing else. */
static QtStatus plan_block_axes(QArrayPlan *p, const QArrayOptions *o, AxisKind *kind, QtError *err) {
    const char *nm = p->t->name;
    int last = p->ndim - 1;
    if (p->ndim == 0)
        return qt_error_set(err, QT_ERR_SHAPE, "%s: %s quantizes blocks of %d along the last axis; a 0-d array "
                            "has none (reshape it to (1,))", p->who, nm, p->t->block);
    if (o->n_channelwise > 0)
        return qt_error_set(err, QT_ERR_ARG, "%s option channelwise_axes: %s has one scale per block of %d "
                            "along the last axis; leave the axes empty", p->who, nm, p->t->block);
    if (o->n_tiled > 1 ||
        (o->n_tiled == 1 && (normalize_axis(o->tiled_axes[0].axis, p->ndim) != last ||
                             o->tiled_axes[0].tile != (double)p->t->block)))
        return qt_error_set(err, QT_ERR_ARG, "%s option tiled_axes: %s's blocks are %d elements along the last "
                            "axis and cannot be changed; leave tiled_axes empty", p->who, nm, p->t->block);
    for (int d = 0; d < last; d++) kind[d] = AXIS_CHANNEL, p->tile[d] = 1, p->sdim[d] = p->shape[d];
    kind[last] = AXIS_TILED;
    char why[96];
    snprintf(why, sizeof why, " (the %s block)", nm);
    return resolve_tile(p, last, p->t->block, why, err);
}

static QtStatus plan_axes(QArrayPlan *p, const QArrayOptions *o, QtError *err) {
    AxisKind kind[QARRAY_MAX_DIMS] = {AXIS_SHARED, AXIS_SHARED, AXIS_SHARED, AXIS_SHARED};
    if (o->n_channelwise < 0 || o->n_channelwise > QARRAY_MAX_DIMS || o->n_tiled < 0 ||
        o->n_tiled > QARRAY_MAX_DIMS)
        return qt_error_set(err, QT_ERR_ARG, "%s options: n_channelwise = %d and n_tiled = %d must be in 0..%d", p->who,
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
        QtStatus st =
            claim_axis(p->who, kind, o->channelwise_axes[i], p->ndim, AXIS_CHANNEL, "channelwise_axes", &a, err);
        if (st != QT_OK) return st;
        p->tile[a] = 1, p->sdim[a] = p->shape[a];
    }
    for (int i = 0; i < o->n_tiled && !qtype_is_block(p->t); i++) {
        int a;
        QtStatus st = claim_axis(p->who, kind, o->tiled_axes[i].axis, p->ndim, AXIS_TILED, "tiled_axes", &a, err);
        if (st == QT_OK) st = resolve_tile(p, a, o->tiled_axes[i].tile, "", err);
        if (st != QT_OK) return st;
    }
    p->n_scales = 1;
    for (int d = 0; d < p->ndim; d++) p->n_scales *= (size_t)p->sdim[d];
    return QT_OK;
}

/* Range, narrow range, zero point, scale type: what the format allows. */
static QtStatus plan_range(QArrayPlan *p, const QArrayOptions *o, QtError *err) {
    const QType *t = p->t;
    if ((int)o->range < 0 || o->range >= QARRAY_RANGE_COUNT)
        return qt_error_set(err, QT_ERR_ARG, "%s option range: %d is not auto, symmetric or asymmetric", p->who,
                            (int)o->range);
    p->asym = o->range == QARRAY_RANGE_ASYMMETRIC || (o->range == QARRAY_RANGE_AUTO && t->kind == QTYPE_KIND_UINT);
    if (p->asym && !is_int_kind(t))
        return qt_error_set(err, QT_ERR_ARG, "%s option range = asymmetric: %s has no zero point; only int and "
                            "uint formats take an asymmetric range", p->who, t->name);
    if (o->narrow_range && t->kind != QTYPE_KIND_INT)
        return qt_error_set(err, QT_ERR_ARG, "%s option narrow_range: only signed int formats (int2..int8) have "
                            "a narrow range, %s has not", p->who, t->name);
    if ((int)o->zp_type < 0 || o->zp_type >= QARRAY_ZP_COUNT)
        return qt_error_set(err, QT_ERR_ARG, "%s option zp_type: %d is not int32 or float", p->who, (int)o->zp_type);
    if (o->zp_type == QARRAY_ZP_FLOAT && !p->asym)
        return qt_error_set(err, QT_ERR_ARG, "%s option zp_type = float: a symmetric range has no zero point; "
                            "set range = asymmetric or leave zp_type at int32", p->who);
    if ((int)o->scale_type < 0 || o->scale_type >= QARRAY_SCALE_COUNT)
        return qt_error_set(err, QT_ERR_ARG, "%s option scale_type: %d is not float32, float16, bfloat16 or "
                            "pof2", p->who, (int)o->scale_type);
    if (qtype_is_block(t) && (o->scale_type == QARRAY_SCALE_F16 || o->scale_type == QARRAY_SCALE_BF16))
        return qt_error_set(err, QT_ERR_ARG, "%s option scale_type = %s: %s's scales are e8m0 powers of two; "
                            "leave scale_type at float32 or set pof2", p->who, qarray_scale_type_name(o->scale_type),
                            t->name);
    p->narrow = o->narrow_range;
    p->zp_float = o->zp_type == QARRAY_ZP_FLOAT;
    p->scale_type = qtype_is_block(t) ? QARRAY_SCALE_POF2 : o->scale_type;
    p->qmin = (float)t->qmin, p->qmax = (float)t->qmax;
    if (p->narrow) p->qmin = -p->qmax;
    return QT_OK;
}

static QtStatus plan_rest(QArrayPlan *p, const QArrayOptions *o, QtError *err) {
    const QType *t = p->t;
    if ((int)o->round < 0 || o->round >= QROUND_COUNT)
        return qt_error_set(err, QT_ERR_ARG, "%s option round: %d is not a rounding mode (rne, half_away, "
                            "floor, stochastic)", p->who, (int)o->round);
    if (o->round == QROUND_STOCHASTIC && !o->rng)
        return qt_error_set(err, QT_ERR_ARG, "%s option round = stochastic needs an Rng in options.rng (a "
                            "stream of its own, e.g. RNG_STREAM_ROUNDING)", p->who);
    if (o->round != QROUND_STOCHASTIC && o->rng)
        return qt_error_set(err, QT_ERR_ARG, "%s option rng is set but round = %s draws no noise; set round = "
                            "stochastic or leave rng NULL", p->who, qround_name(o->round));
    p->round = o->round, p->rng = o->rng;
    if (o->calib && qtype_is_block(t))
        return qt_error_set(err, QT_ERR_ARG, "%s option calib: %s's block scales come from each block's absmax "
                            "(OCP MX); leave calib NULL", p->who, t->name);
    if (o->calib) {
        QtStatus st = calib_spec_check(o->calib, err);
        if (st != QT_OK) return st;
        p->calib = *o->calib;
    } else {
        p->calib = (CalibSpec){.kind = p->asym ? CALIB_MINMAX : CALIB_ABSMAX, .s = 1.0};
        p->mean_abs = t->kind == QTYPE_KIND_TERNARY || t->kind == QTYPE_KIND_BINARY;
    }
    if (o->dq_block < 0 || (o->dq_block > 0 && !o->double_quant))
        return qt_error_set(err, QT_ERR_ARG, "%s option dq_block = %d: it must be >= 0 (0: %d) and needs "
                            "double_quant", p->who, o->dq_block, QARRAY_DQ_BLOCK);
    const char *why = NULL;
    if (o->double_quant && qtype_is_block(t)) why = "block formats carry their own e8m0 scales";
    else if (o->double_quant && p->asym) why = "double quantization needs a symmetric range";
    else if (o->double_quant && o->scale_type != QARRAY_SCALE_F32)
        why = "it replaces the scale storage, so scale_type must stay float32";
    if (why) return qt_error_set(err, QT_ERR_ARG, "%s option double_quant with %s: %s", p->who, t->name, why);
    p->dq = o->double_quant;
    p->dq_block = o->dq_block ? o->dq_block : QARRAY_DQ_BLOCK;
    return QT_OK;
}

QtStatus qarray_plan_make(QArrayPlan *p, const char *who, int ndim, const int *shape, const QType *t,
                          const QArrayOptions *o, QtError *err) {
    memset(p, 0, sizeof *p);
    p->who = who;
    if (!t) return qt_error_set(err, QT_ERR_ARG, "%s: no qtype given", p->who);
    if (ndim < 0 || ndim > QARRAY_MAX_DIMS || (ndim > 0 && !shape))
        return qt_error_set(err, QT_ERR_ARG, "%s: %d dimensions (%s); 0..%d are handled", p->who, ndim,
                            shape ? "with a shape" : "no shape", QARRAY_MAX_DIMS);
    if (!qtype_is_block(t) && (t->bits < 1 || t->bits > 8))
        return qt_error_set(err, QT_ERR_ARG, "%s: %s has %d-bit codes; only 1..8 are handled", p->who, t->name,
                            t->bits);
    if (qtype_is_block(t) && (t->block < 1 || t->block > QARRAY_BLOCK_MAX))
        return qt_error_set(err, QT_ERR_ARG, "%s: %s has blocks of %d; only 1..%d are handled", p->who, t->name,
                            t->block, QARRAY_BLOCK_MAX);
    p->t = t, p->ndim = ndim, p->numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return qt_error_set(err, QT_ERR_SHAPE, "%s: axis %d has negative size %d", p->who, d, shape[d]);
        if (shape[d] > 0 && p->numel > SIZE_MAX / sizeof(float) / (size_t)shape[d])
            return qt_error_set(err, QT_ERR_SHAPE, "%s: the shape's element count overflows", p->who);
        p->shape[d] = shape[d];
        p->numel *= (size_t)shape[d];
    }
    QtStatus st = plan_axes(p, o, err);
    if (st == QT_OK) st = plan_range(p, o, err);
    if (st == QT_OK) st = plan_rest(p, o, err);
    return st;
}

/* ---- the layout, padded to 4 dims -------------------------------------------- */

void qarray_layout_make(QArrayLayout *L, int ndim, const int *shape, const int *tile, const int *sdim) {
    int off = 4 - ndim;
    for (int k = 0; k < 4; k++) {
        int d = k - off;
        L->dim[k] = d >= 0 ? (size_t)shape[d] : 1;
        L->tile[k] = d >= 0 ? (size_t)tile[d] : 1;
        L->sdim[k] = d >= 0 ? (size_t)sdim[d] : 1;
    }
    L->sstride[3] = 1;
    for (int k = 2; k >= 0; k--) L->sstride[k] = L->sstride[k + 1] * L->sdim[k + 1];
}

size_t qarray_layout_row_group(const QArrayLayout *L, size_t r) {
    size_t a2 = r % L->dim[2];
    r /= L->dim[2];
    size_t a1 = r % L->dim[1], a0 = r / L->dim[1];
    return a0 / L->tile[0] * L->sstride[0] + a1 / L->tile[1] * L->sstride[1] + a2 / L->tile[2] * L->sstride[2];
}

size_t qarray_layout_gather(const QArrayLayout *L, const float *x, size_t g, float *buf) {
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

float qarray_round_int(float v, QRound mode, float u) {
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

float qarray_plan_scale(const QArrayPlan *p, float lo, float hi) {
    return qarray_scale_for_range(p->t, p->asym, p->narrow, p->qmin, p->qmax, lo, hi);
}

float qarray_plan_zero_point(const QArrayPlan *p, float lo, float s) {
    return qarray_zero_point_for_range(p->zp_float, p->qmin, p->qmax, lo, s);
}

uint32_t qarray_plan_encode(const QArrayPlan *p, float x, float s, float zp, QRound mode, float u) {
    const QType *t = p->t;
    if (!is_int_kind(t)) return qtype_encode(t, x / s, mode, u);
    float q;
    if (p->zp_float) {
        q = qarray_round_int(fminf(fmaxf(x / s + zp, p->qmin), p->qmax), mode, u);
    } else {
        /* clamping before rounding is the same as after: the bounds are integers */
        q = qarray_round_int(fminf(fmaxf(x / s, p->qmin - zp), p->qmax - zp), mode, u) + zp;
    }
    return (uint32_t)(int32_t)q & ((1u << t->bits) - 1u);
}

/* What calibration's mse sees: this format's round trip (rne) over the
 * candidate range. */
static float calib_roundtrip(float x, float lo, float hi, const CalibQuant *cq) {
    const QArrayPlan *p = cq->ctx;
    float s = qarray_plan_scale(p, lo, hi);
    float zp = p->asym ? qarray_plan_zero_point(p, lo, s) : 0.0f;
    return (qtype_decode(p->t, qarray_plan_encode(p, x, s, zp, QROUND_RNE, 0.0f)) - zp) * s;
}

size_t qarray_plan_work_bytes(const QArrayPlan *p, size_t n) {
    return p->mean_abs ? 0 : calib_workspace_bytes(&p->calib, n);
}

QtStatus qarray_plan_slice_range(const QArrayPlan *p, const float *v, size_t n, void *work, size_t work_bytes,
                                 CalibRange *r, QtError *err) {
    if (p->mean_abs) {
        double sum = 0.0;
        for (size_t i = 0; i < n; i++) sum += fabsf(v[i]);
        float m = n ? (float)(sum / (double)n) : 0.0f;
        *r = (CalibRange){-m, m};
        return QT_OK;
    }
    CalibQuant cq = {.fn = calib_roundtrip, .ctx = p, .levels = qarray_calib_levels(p->t, p->asym),
                     .asymmetric = p->asym};
    return calib_compute(&p->calib, v, n, &cq, work, work_bytes, r, err);
}

QtStatus qarray_plan_round_scale(const QArrayPlan *p, size_t i, float s, uint32_t *stored, float *used,
                                 QtError *err) {
    switch (p->scale_type) {
    case QARRAY_SCALE_F16: {
        uint16_t h = qarray_f32_to_f16(s);
        if (h == 0x7c00u)
            return qt_error_set(err, QT_ERR_VALUE, "%s: scale %zu = %g exceeds float16's largest value 65504; "
                                "use bfloat16 or float32 scales", p->who, i, (double)s);
        if (h == 0) h = 1; /* 2^-24, the smallest subnormal: a larger scale never clips */
        *stored = h;
        *used = qarray_f16_to_f32(h);
        return QT_OK;
    }
    case QARRAY_SCALE_BF16: {
        uint16_t b = qarray_f32_to_bf16(s);
        if (b == 0x7f80u)
            return qt_error_set(err, QT_ERR_VALUE, "%s: scale %zu = %g rounds past bfloat16's largest value; use "
                                "float32 scales", p->who, i, (double)s);
        *stored = b;
        *used = qarray_bf16_to_f32(b);
        return QT_OK;
    }
    case QARRAY_SCALE_POF2: {
        int e;
        float f = frexpf(s, &e); /* s = f * 2^e, f in [0.5, 1) */
        int k = f == 0.5f ? e - 1 : e; /* ceil(log2 s) */
        if (k > 127)
            return qt_error_set(err, QT_ERR_VALUE, "%s: scale %zu = %g needs the power of two 2^%d, beyond "
                                "float's range; use float32 scales", p->who, i, (double)s, k);
        *stored = (uint32_t)(k + 127);
        *used = ldexpf(1.0f, k);
        return QT_OK;
    }
    default:
        memcpy(stored, &s, sizeof s);
        *used = s;
        return QT_OK;
    }
}
