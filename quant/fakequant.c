/* fakequant.c - fake quantization with given (static) scales, learned
 * ranges (TQT, LSQ) and the QType-backed CalibQuant. Calibrated (dynamic)
 * scales are in fakequant_dynamic.c. */
#include "fakequant.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fakequant_internal.h"
#include "nn/ops.h"
#include "qarray_plan.h"

#define LN2 0.69314718055994530942

#define SHAPE_STR(v, buf) tensor_shape_str(&(v)->value, (buf), sizeof(buf))

/* ---- names --------------------------------------------------------------------------------- */

static const char *const STE_NAMES[] = {[FQ_STE_CLIPPED] = "clipped", [FQ_STE_PASS] = "pass"};
static const char *const RANGE_NAMES[] = {[FQ_RANGE_TQT] = "tqt", [FQ_RANGE_LSQ] = "lsq"};

const char *fq_ste_name(FqSte ste) { return (int)ste >= 0 && ste < FQ_STE_COUNT ? STE_NAMES[ste] : "unknown"; }

QtStatus fq_ste_parse(const char *name, FqSte *out, QtError *err) {
    int k = 0;
    QtStatus st = qt_name_lookup("straight-through estimator", name, STE_NAMES, FQ_STE_COUNT, &k, err);
    if (st == QT_OK) *out = (FqSte)k;
    return st;
}

const char *fq_range_kind_name(FqRangeKind kind) {
    return (int)kind >= 0 && kind < FQ_RANGE_COUNT ? RANGE_NAMES[kind] : "unknown";
}

QtStatus fq_range_kind_parse(const char *name, FqRangeKind *out, QtError *err) {
    int k = 0;
    QtStatus st = qt_name_lookup("learned range", name, RANGE_NAMES, FQ_RANGE_COUNT, &k, err);
    if (st == QT_OK) *out = (FqRangeKind)k;
    return st;
}

/* ---- channels and random draws --------------------------------------------------------------- */

/* x seen as (outer, C, inner); per tensor C = 1. */
typedef struct {
    size_t outer, inner;
    int C;
} Geo;

static bool geo_make(QtError *err, const char *op, const Var *x, bool per_channel, int axis, Geo *g) {
    const Tensor *v = &x->value;
    size_t n = tensor_numel(v);
    *g = (Geo){.outer = 1, .inner = n, .C = 1};
    if (!per_channel) return true;
    int a = axis < 0 ? axis + v->ndim : axis;
    if (a < 0 || a >= v->ndim) {
        char sx[64];
        qt_error_set(err, QT_ERR_ARG, "%s: axis %d is out of range for input %s (valid: %d..%d)", op, axis,
                     SHAPE_STR(x, sx), -v->ndim, v->ndim - 1);
        return false;
    }
    g->C = v->shape[a];
    g->inner = 1;
    for (int d = a + 1; d < v->ndim; d++) g->inner *= (size_t)v->shape[d];
    g->outer = n / ((size_t)g->C * g->inner);
    return true;
}

/* A per-channel Var must be (C,); a per-tensor one (1,). */
static bool geo_check_var(Tape *t, const char *op, const char *what, const Var *x, const Var *v, const Geo *g,
                          bool per_channel, int axis) {
    if (v->value.ndim == 1 && v->value.shape[0] == g->C) return true;
    char sx[64], sv[64], how[64] = "one for the tensor";
    if (per_channel) snprintf(how, sizeof how, "one per index along axis %d", axis);
    qt_error_set(&t->err, QT_ERR_SHAPE, "%s: %s %s does not fit input %s: want (%d,), %s", op, what, SHAPE_STR(v, sv),
                 SHAPE_STR(x, sx), g->C, how);
    return false;
}

/* Whether x[0..n) are all finite: a branch-free scan (it vectorises; a NaN fails every comparison, an infinity
 * the bound), run on every fake-quantized input. */
NN_SIMD_CLONES static bool fq_all_finite(const float *x, size_t n) {
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad |= !(x[i] >= -FLT_MAX && x[i] <= FLT_MAX);
    return !bad;
}

bool fq_check_finite(Tape *t, const char *op, const Var *x) {
    if (fq_all_finite(x->value.data, var_numel(x))) return true;
    for (size_t i = 0, n = var_numel(x); i < n; i++) { /* only to name the first one */
        if (isfinite(x->value.data[i])) continue;
        char sx[64];
        qt_error_set(&t->err, QT_ERR_VALUE, "%s: input %s holds %g at flat index %zu; fake quantization needs finite "
                     "values", op, SHAPE_STR(x, sx), (double)x->value.data[i], i);
        return false;
    }
    return true;
}

bool fq_pick_rng(Tape *t, const char *op, QRound mode, Rng *given, Rng **out) {
    *out = NULL;
    if ((int)mode < 0 || mode >= QROUND_COUNT) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: rounding mode %d is not rne, half_away, floor or stochastic", op,
                     (int)mode);
        return false;
    }
    if (mode != QROUND_STOCHASTIC) return true;
    *out = given ? given : t->rng;
    if (!*out)
        qt_error_set(&t->err, QT_ERR_ARG, "%s: stochastic rounding needs an Rng: set spec.rng (a stream of its own, "
                     "RNG_STREAM_ROUNDING) or give the tape one", op);
    return *out != NULL;
}

/* ---- the element format ---------------------------------------------------------------------------- */

typedef struct {
    const QType *t;
    bool is_int;       /* INT or UINT: rounded here, not by qtype_encode */
    bool asym, narrow, zp_float;
    float qmin, qmax;  /* int kinds: the code range, narrow applied */
} Fmt;

/* Why t with these options cannot be fake-quantized; NULL if it can. */
static const char *fmt_make(Fmt *f, const QType *t, bool asym, bool narrow, bool zp_float) {
    memset(f, 0, sizeof *f);
    if (!t) return "no qtype given (spec.qtype is NULL)";
    if (qtype_is_block(t))
        return "a block format keeps its scales inside the blocks, so there is no scale to give; "
               "fake-quantize it with fq_fake_quant_dynamic, which computes them";
    bool is_int = t->kind == QTYPE_KIND_INT || t->kind == QTYPE_KIND_UINT;
    if (asym && !is_int) return "only int and uint formats take an asymmetric range (a zero point)";
    if (narrow && t->kind != QTYPE_KIND_INT) return "only signed int formats have a narrow range";
    if (zp_float && !asym) return "float zero points need an asymmetric range";
    *f = (Fmt){.t = t, .is_int = is_int, .asym = asym, .narrow = narrow, .zp_float = zp_float,
               .qmin = (float)t->qmin, .qmax = (float)t->qmax};
    if (narrow) f->qmin = -f->qmax;
    return NULL;
}

/* The representable range [elo, ehi] in units of the scale. */
static void fmt_bounds(const Fmt *f, float zp, float *elo, float *ehi) {
    const QType *t = f->t;
    switch (t->kind) {
    case QTYPE_KIND_INT:
    case QTYPE_KIND_UINT: *elo = f->qmin - zp, *ehi = f->qmax - zp; break;
    case QTYPE_KIND_LUT: *elo = t->lut[0], *ehi = t->lut[(1 << t->bits) - 1]; break;
    case QTYPE_KIND_FLOAT: *elo = -t->max, *ehi = t->max; break;
    default: *elo = -1.0f, *ehi = 1.0f; break; /* ternary, binary */
    }
}

float fq_effective_scale(float s) { return s >= QARRAY_SCALE_MIN ? s : 1.0f; }

void fq_int_code_bounds(const QType *t, bool narrow, float zp, float *lo, float *hi) {
    Fmt f;
    fmt_make(&f, t, zp != 0.0f, narrow, false);
    fmt_bounds(&f, zp, lo, hi);
}

/* QArray's scale and zero-point rules, so both quantize alike. */
static float fmt_scale(const Fmt *f, float lo, float hi) {
    return qarray_scale_for_range(f->t, f->asym, f->narrow, f->qmin, f->qmax, lo, hi);
}

static float fmt_zero_point(const Fmt *f, float lo, float s) {
    return qarray_zero_point_for_range(f->zp_float, f->qmin, f->qmax, lo, s);
}

/* One element's quantize -> dequantize; elo, ehi from fmt_bounds. */
static float fmt_roundtrip(const Fmt *f, float x, float s, float zp, float elo, float ehi, QRound mode, float u,
                           bool skip_rounding) {
    float v = x / s;
    if (skip_rounding) return fminf(fmaxf(v, elo), ehi) * s;
    if (!f->is_int) return qtype_decode(f->t, qtype_encode(f->t, v, mode, u)) * s;
    if (f->zp_float) return (qarray_round_int(fminf(fmaxf(v + zp, f->qmin), f->qmax), mode, u) - zp) * s;
    /* The bounds are whole numbers, so clamping before rounding equals clamping after. + 0 turns a
     * rounded -0 into the +0 an integer code dequantizes to. */
    return (qarray_round_int(fminf(fmaxf(v, elo), ehi), mode, u) + 0.0f) * s;
}

/* ---- fake quantization: forward and backward --------------------------------------------------------- */

typedef struct {
    Geo g;
    FqSte ste;
    float *s, *zp, *elo, *ehi; /* [C] each */
} FqCtx;

static void fq_backward(Tape *t, const TapeNode *node) {
    const FqCtx *c = node->ctx;
    Var *x = node->in[0];
    float *dx = tape_grad(t, x);
    if (!dx) return;
    const float *dy = node->out->grad, *xv = x->value.data;
    size_t i = 0;
    for (size_t o = 0; o < c->g.outer; o++)
        for (int ch = 0; ch < c->g.C; ch++) {
            float s = c->s[ch], lo = c->elo[ch], hi = c->ehi[ch];
            for (size_t j = 0; j < c->g.inner; j++, i++) {
                float v = xv[i] / s;
                bool pass = c->ste == FQ_STE_PASS || (v >= lo && v <= hi);
                dx[i] += pass ? dy[i] : 0.0f;
            }
        }
}

/* Arena state of one call: Geo from x, room for C channels. */
static FqCtx *fq_ctx_new(Tape *t, const char *op, const Var *x, const FakeQuantSpec *spec) {
    Geo g;
    if (!geo_make(&t->err, op, x, spec->per_channel, spec->axis, &g)) return NULL;
    FqCtx *c = tape_alloc(t, sizeof *c);
    float *buf = tape_alloc(t, 4 * (size_t)g.C * sizeof(float));
    if (!c || !buf) return NULL;
    *c = (FqCtx){.g = g, .ste = spec->ste, .s = buf, .zp = buf + g.C, .elo = buf + 2 * g.C, .ehi = buf + 3 * g.C};
    return c;
}

/* Checks the spec and fills f; asym as the zero points decide it. */
static bool fq_check_spec(Tape *t, const char *op, const Var *x, const FakeQuantSpec *spec, bool asym, Fmt *f) {
    if (!spec) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: no spec given", op);
        return false;
    }
    if (spec->n_channelwise || spec->n_tiled || spec->scale_type != QARRAY_SCALE_F32) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: given scales are per tensor or per channel (spec.per_channel, "
                     "spec.axis) and used as they are; channelwise_axes, tiled_axes and scale_type describe "
                     "computed scales, so use fq_fake_quant_dynamic for them", op);
        return false;
    }
    if ((int)spec->ste < 0 || spec->ste >= FQ_STE_COUNT || (int)spec->zp_type < 0 ||
        spec->zp_type >= QARRAY_ZP_COUNT || (int)spec->range < 0 || spec->range >= QARRAY_RANGE_COUNT) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: spec.ste = %d, spec.zp_type = %d or spec.range = %d is outside its "
                     "enum", op, (int)spec->ste, (int)spec->zp_type, (int)spec->range);
        return false;
    }
    const char *why = fmt_make(f, spec->qtype, asym, spec->narrow_range, spec->zp_type == QARRAY_ZP_FLOAT);
    if (why) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s of %s: %s", op, qtype_name(spec->qtype), why);
        return false;
    }
    return fq_check_finite(t, op, x);
}

/* fmt_roundtrip of an integer format without float zero points, rounding to nearest even, over one row of a
 * channel: the same operations in the same order (x is finite, fq_check_finite, so the comparisons clamp as fminf
 * and fmaxf do, and -0 leaves as +0 either way), vectorised; the activations of every PTQ layer off the int8
 * kernels pass here each batch. */
NN_SIMD_CLONES static void fq_row_int_rne(float *y, const float *x, size_t n, float s, float lo, float hi) {
    for (size_t j = 0; j < n; j++) {
        float v = x[j] / s;
        v = v < lo ? lo : v;
        v = v > hi ? hi : v;
        y[j] = (rintf(v) + 0.0f) * s;
    }
}

/* y = roundtrip(x) with c's scales; records the backward. */
static Var *fq_run(Tape *t, const char *op, Var *x, const FakeQuantSpec *spec, const Fmt *f, FqCtx *c) {
    Rng *rng;
    if (!fq_pick_rng(t, op, spec->round, spec->rng, &rng)) return NULL;
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    if (!y) return NULL;
    RngUniforms u; /* drawn as qarray_quantize draws them */
    rng_uniforms_init(&u, spec->skip_rounding ? NULL : rng, var_numel(x));
    const float *xv = x->value.data;
    float *yv = y->value.data;
    const bool fast = f->is_int && !f->zp_float && !spec->skip_rounding && spec->round == QROUND_RNE;
    size_t i = 0;
    for (size_t o = 0; o < c->g.outer; o++)
        for (int ch = 0; ch < c->g.C; ch++) {
            float s = c->s[ch], zp = c->zp[ch], lo = c->elo[ch], hi = c->ehi[ch];
            if (fast) {
                fq_row_int_rne(yv + i, xv + i, c->g.inner, s, lo, hi);
                i += c->g.inner;
                continue;
            }
            for (size_t j = 0; j < c->g.inner; j++, i++)
                yv[i] = fmt_roundtrip(f, xv[i], s, zp, lo, hi, spec->round, rng_uniforms_next(&u), spec->skip_rounding);
        }
    return tape_record(t, op, fq_backward, y, (Var *[]){x}, 1, c) ? y : NULL;
}

/* Copies and checks the given scales and zero points into c. */
static bool fq_take_scales(Tape *t, const char *op, const Fmt *f, const Var *scale, const Var *zero_point,
                           FqCtx *c) {
    for (int ch = 0; ch < c->g.C; ch++) {
        float s = scale->value.data[ch], zp = zero_point ? zero_point->value.data[ch] : 0.0f;
        if (!(s > 0.0f) || isinf(s)) {
            qt_error_set(&t->err, QT_ERR_VALUE, "%s: scale[%d] = %g; a scale must be a finite number > 0", op, ch,
                         (double)s);
            return false;
        }
        if (!(zp >= f->qmin && zp <= f->qmax)) {
            qt_error_set(&t->err, QT_ERR_VALUE, "%s: zero_point[%d] = %g is outside %s's code range %g..%g", op, ch,
                         (double)zp, f->t->name, (double)f->qmin, (double)f->qmax);
            return false;
        }
        if (!f->zp_float && zp != rintf(zp)) {
            qt_error_set(&t->err, QT_ERR_VALUE, "%s: zero_point[%d] = %g is not a whole number; int32 zero points are "
                         "whole code units (set zp_type float for fractional ones)", op, ch, (double)zp);
            return false;
        }
        c->s[ch] = fq_effective_scale(s);
        c->zp[ch] = zp;
        fmt_bounds(f, zp, &c->elo[ch], &c->ehi[ch]);
    }
    return true;
}

Var *fq_fake_quant(Tape *t, Var *x, const FakeQuantSpec *spec, Var *scale, Var *zero_point) {
    static const char op[] = "fake_quant";
    if (!x || !scale) return NULL;
    bool asym = zero_point != NULL;
    if (spec && ((spec->range == QARRAY_RANGE_SYMMETRIC && asym) ||
                 (spec->range == QARRAY_RANGE_ASYMMETRIC && !asym))) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: spec.range is %s, but zero points were%s given; zero points make the "
                     "range asymmetric (leave spec.range at auto to let them decide)", op,
                     asym ? "symmetric" : "asymmetric", asym ? "" : " not");
        return NULL;
    }
    Fmt f;
    if (!fq_check_spec(t, op, x, spec, asym, &f)) return NULL;
    if (scale->requires_grad || (zero_point && zero_point->requires_grad)) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: the scale or zero point requires a gradient, but fake_quant treats them "
                     "as constants; learn a range with fq_learned_quant (tqt, lsq)", op);
        return NULL;
    }
    FqCtx *c = fq_ctx_new(t, op, x, spec);
    if (!c || !geo_check_var(t, op, "scale", x, scale, &c->g, spec->per_channel, spec->axis)) return NULL;
    if (zero_point && !geo_check_var(t, op, "zero_point", x, zero_point, &c->g, spec->per_channel, spec->axis))
        return NULL;
    if (!fq_take_scales(t, op, &f, scale, zero_point, c)) return NULL;
    return fq_run(t, op, x, spec, &f, c);
}

/* Channel ch's elements -> buf; returns buf, or x itself when the tensor is one channel. */
static const float *gather_channel(const float *x, const Geo *g, int ch, float *buf) {
    if (g->C == 1) return x;
    for (size_t o = 0; o < g->outer; o++)
        memcpy(buf + o * g->inner, x + (o * (size_t)g->C + (size_t)ch) * g->inner, g->inner * sizeof(float));
    return buf;
}

/* ---- CalibQuant of a QType ----------------------------------------------------------------------------------- */

static float calib_roundtrip(float x, float lo, float hi, const QType *t, bool asym, bool narrow, bool zp_float) {
    Fmt f;
    fmt_make(&f, t, asym, narrow, zp_float);
    float s = fmt_scale(&f, lo, hi), zp = asym ? fmt_zero_point(&f, lo, s) : 0.0f, elo, ehi;
    fmt_bounds(&f, zp, &elo, &ehi);
    return fmt_roundtrip(&f, x, s, zp, elo, ehi, QROUND_RNE, 0.0f, false);
}

/* The options live in which function is chosen, so the CalibQuant needs no storage but the QType. */
#define CALIB_FN(name, asym, narrow, zpf)                                              \
    static float name(float x, float lo, float hi, const CalibQuant *q) {              \
        return calib_roundtrip(x, lo, hi, (const QType *)q->ctx, asym, narrow, zpf);   \
    }
CALIB_FN(calib_sym, false, false, false)
CALIB_FN(calib_sym_narrow, false, true, false)
CALIB_FN(calib_asym, true, false, false)
CALIB_FN(calib_asym_narrow, true, true, false)
CALIB_FN(calib_asym_zpf, true, false, true)
CALIB_FN(calib_asym_narrow_zpf, true, true, true)

CalibQuant fq_calib_quant(const QType *t, QArrayRange range, bool narrow_range, QArrayZpType zp_type) {
    CalibQuant q = {0};
    if (!t || (int)range < 0 || range >= QARRAY_RANGE_COUNT || (int)zp_type < 0 || zp_type >= QARRAY_ZP_COUNT)
        return q;
    bool asym = range == QARRAY_RANGE_ASYMMETRIC || (range == QARRAY_RANGE_AUTO && t->kind == QTYPE_KIND_UINT);
    bool zpf = zp_type == QARRAY_ZP_FLOAT;
    q.asymmetric = asym;
    Fmt f;
    if (fmt_make(&f, t, asym, narrow_range, zpf)) return q;
    static const CalibQuantFn FNS[2][2][2] = {
        {{calib_sym, NULL}, {calib_sym_narrow, NULL}},
        {{calib_asym, calib_asym_zpf}, {calib_asym_narrow, calib_asym_narrow_zpf}}}; /* [asym][narrow][zp float] */
    q.fn = FNS[asym][narrow_range][zpf];
    q.ctx = t;
    q.levels = qarray_calib_levels(t, asym);
    return q;
}

/* ---- learned ranges: the op --------------------------------------------------------------------------------- */

static const char *learned_op(const FqRangeSpec *spec) {
    return spec && spec->kind == FQ_RANGE_LSQ ? "fake_quant_lsq" : "fake_quant_tqt";
}

/* n, p and TQT's power-of-two shift (b - 1, uint: b) of the spec's format. */
static void learned_levels(const QType *t, int *n, int *p, int *shift) {
    bool u = t->kind == QTYPE_KIND_UINT;
    *n = u ? 0 : t->qmin;
    *p = t->qmax;
    *shift = u ? t->bits : t->bits - 1;
}

/* Why spec cannot be used; NULL if it can. */
static const char *learned_spec_problem(const FqRangeSpec *spec) {
    if (!spec) return "no spec given";
    if ((int)spec->kind < 0 || spec->kind >= FQ_RANGE_COUNT) return "spec.kind is neither tqt nor lsq";
    if ((int)spec->round < 0 || spec->round >= QROUND_COUNT) return "spec.round is not a rounding mode";
    const QType *t = spec->qtype;
    if (!t || (t->kind != QTYPE_KIND_INT && t->kind != QTYPE_KIND_UINT) || t->bits < 2 || t->bits > 16)
        return "a learned range needs an int or uint format of 2..16 bits (int2..int8, uint4, uint8)";
    if (!(spec->lsq_grad_scale >= 0.0f) || isinf(spec->lsq_grad_scale))
        return "spec.lsq_grad_scale must be 0 (1/sqrt(N p)) or a finite number > 0";
    return NULL;
}

float fq_range_scale(const FqRangeSpec *spec, float value) {
    if (learned_spec_problem(spec)) return NAN;
    if (spec->kind == FQ_RANGE_LSQ) return value;
    int n, p, shift;
    learned_levels(spec->qtype, &n, &p, &shift);
    if (!(fabsf(value) < 1e4f)) return NAN;
    double e = spec->tqt_exact_scale ? (double)value : ceil((double)value);
    return (float)exp2(e - shift);
}

typedef struct {
    Geo g;
    FqRangeKind kind;
    float n, p;
    float *s;      /* [C] the scales used */
    double *mult;  /* [2C]: per channel the range gradient's factor, s ln2 (tqt) or g (lsq), then the
                      backward's sums */
    float *r;      /* [numel] round(x / s) before the clamp */
} LearnCtx;

static void learned_backward(Tape *t, const TapeNode *node) {
    const LearnCtx *c = node->ctx;
    Var *x = node->in[0], *range = node->in[1];
    float *dx = x->requires_grad ? tape_grad(t, x) : NULL;
    float *dr = range->requires_grad ? tape_grad(t, range) : NULL;
    if ((x->requires_grad && !dx) || (range->requires_grad && !dr)) return;
    const float *dy = node->out->grad, *xv = x->value.data;
    bool tqt = c->kind == FQ_RANGE_TQT;
    double *acc = c->mult + c->g.C;
    for (int ch = 0; ch < c->g.C; ch++) acc[ch] = 0.0;
    size_t i = 0;
    for (size_t o = 0; o < c->g.outer; o++)
        for (int ch = 0; ch < c->g.C; ch++) {
            float s = c->s[ch];
            double sum = 0.0;
            for (size_t j = 0; j < c->g.inner; j++, i++) {
                float v = xv[i] / s, r = c->r[i], f;
                bool inside;
                if (tqt) { /* TQT decides by the rounded value */
                    inside = r >= c->n && r <= c->p;
                    f = inside ? r - v : r < c->n ? c->n : c->p;
                } else { /* LSQ by x / s */
                    inside = v > c->n && v < c->p;
                    f = inside ? r - v : v <= c->n ? c->n : c->p;
                }
                if (dx && inside) dx[i] += dy[i];
                sum += (double)dy[i] * f;
            }
            acc[ch] += sum;
        }
    for (int ch = 0; dr && ch < c->g.C; ch++) dr[ch] += (float)(acc[ch] * c->mult[ch]);
}

/* The scales from the parameter values, checked. */
static bool learned_scales(Tape *t, const char *op, const FqRangeSpec *spec, const Var *range, LearnCtx *c) {
    size_t N = c->g.outer * c->g.inner;
    for (int ch = 0; ch < c->g.C; ch++) {
        float v = range->value.data[ch], s = fq_range_scale(spec, v);
        if (!(s >= QARRAY_SCALE_MIN) || isinf(s)) {
            qt_error_set(&t->err, QT_ERR_VALUE, "%s: parameter value %g of channel %d gives the scale %g, outside "
                         "[1e-19, 3.4e38]; the range diverged (lower the learning rate or re-initialise it)", op,
                         (double)v, ch, (double)s);
            return false;
        }
        c->s[ch] = s;
        if (spec->kind == FQ_RANGE_TQT) c->mult[ch] = (double)s * LN2;
        else c->mult[ch] = spec->lsq_grad_scale > 0.0f ? spec->lsq_grad_scale : 1.0 / sqrt((double)N * c->p);
    }
    return true;
}

Var *fq_learned_quant(Tape *t, Var *x, Var *range, const FqRangeSpec *spec) {
    const char *op = learned_op(spec);
    if (!x || !range) return NULL;
    const char *why = learned_spec_problem(spec);
    if (why) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s of %s: %s", op, spec ? qtype_name(spec->qtype) : "(none)", why);
        return NULL;
    }
    Geo g;
    Rng *rng;
    if (!geo_make(&t->err, op, x, spec->per_channel, spec->axis, &g) ||
        !geo_check_var(t, op, "parameter", x, range, &g, spec->per_channel, spec->axis) || !fq_check_finite(t, op, x) ||
        !fq_pick_rng(t, op, spec->round, spec->rng, &rng))
        return NULL;
    size_t numel = var_numel(x);
    bool need = t->grad_enabled && (x->requires_grad || range->requires_grad);
    LearnCtx *c = tape_alloc(t, sizeof *c);
    float *s = tape_alloc(t, (size_t)g.C * sizeof(float));
    double *mult = tape_alloc(t, 2 * (size_t)g.C * sizeof(double)); /* factors, then sums */
    float *r = need ? tape_alloc(t, numel * sizeof(float)) : NULL;
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    if (!c || !s || !mult || (need && !r) || !y) return NULL;
    int n, p, shift;
    learned_levels(spec->qtype, &n, &p, &shift);
    *c = (LearnCtx){.g = g, .kind = spec->kind, .n = (float)n, .p = (float)p, .s = s, .mult = mult, .r = r};
    if (!learned_scales(t, op, spec, range, c)) return NULL;
    RngUniforms u; /* drawn as qarray_quantize draws them */
    rng_uniforms_init(&u, spec->skip_rounding ? NULL : rng, numel);
    const float *xv = x->value.data;
    size_t i = 0;
    for (size_t o = 0; o < g.outer; o++)
        for (int ch = 0; ch < g.C; ch++)
            for (size_t j = 0; j < g.inner; j++, i++) {
                float v = xv[i] / s[ch];
                float q = spec->skip_rounding ? v : qarray_round_int(v, spec->round, rng_uniforms_next(&u));
                if (r) r[i] = q;
                y->value.data[i] = (fminf(fmaxf(q, c->n), c->p) + 0.0f) * s[ch]; /* + 0: code 0 is +0 */
            }
    return tape_record(t, op, learned_backward, y, (Var *[]){x, range}, 2, c) ? y : NULL;
}

/* ---- learned ranges: the parameter ------------------------------------------------------------------------ */

/* The parameter value for threshold t (tqt) or step size s (lsq); a zero range gives the scale 1. */
static float learned_value(const FqRangeSpec *spec, double thr, double step) {
    int n, p, shift;
    learned_levels(spec->qtype, &n, &p, &shift);
    if (spec->kind == FQ_RANGE_LSQ) return step >= QARRAY_SCALE_MIN && isfinite(step) ? (float)step : 1.0f;
    double s = thr / ldexp(1.0, shift);
    return s >= QARRAY_SCALE_MIN && isfinite(s) ? (float)log2(thr) : (float)shift;
}

QtStatus fq_range_init(FqRange *r, const char *prefix, const FqRangeSpec *spec, int n_channels, QtError *err) {
    memset(r, 0, sizeof *r);
    const char *why = learned_spec_problem(spec);
    if (why) return qt_error_set(err, QT_ERR_ARG, "learned range '%s': %s", prefix ? prefix : "", why);
    if (!prefix || n_channels < 1 || (!spec->per_channel && n_channels != 1))
        return qt_error_set(err, QT_ERR_ARG, "learned range '%s': %d channels; want 1 per tensor or >= 1 per channel, "
                            "and a name prefix \"<module>/<tensor>\"", prefix ? prefix : "(null)", n_channels);
    const char *leaf = spec->kind == FQ_RANGE_TQT ? "log2_t" : "step_size";
    int len = snprintf(r->param.name, sizeof r->param.name, "%s/%s", prefix, leaf);
    if (len < 0 || len >= (int)sizeof r->param.name)
        return qt_error_set(err, QT_ERR_ARG, "learned range '%s/%s': the name is longer than %d characters", prefix,
                            leaf, PARAM_NAME_MAX - 1);
    tensor_set_shape(&r->param.var.value, 1, (int[]){n_channels});
    r->param.var.value.data = calloc((size_t)n_channels, sizeof(float));
    r->param.var.grad = calloc((size_t)n_channels, sizeof(float));
    if (!r->param.var.value.data || !r->param.var.grad) {
        fq_range_free(r);
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate learned range %s (%d floats)", prefix, n_channels);
    }
    r->param.var.requires_grad = r->param.var.is_param = r->param.trainable = true;
    r->spec = *spec;
    r->n_channels = n_channels;
    int n, p, shift;
    learned_levels(spec->qtype, &n, &p, &shift);
    for (int c = 0; c < n_channels; c++) r->param.var.value.data[c] = learned_value(spec, 1.0, 1.0 / p);
    return QT_OK;
}

void fq_range_free(FqRange *r) {
    if (!r) return;
    free(r->param.var.value.data);
    free(r->param.var.grad);
    memset(r, 0, sizeof *r);
}

/* Calibrates the slice v [n] of one channel into the parameter value *out. */
static QtStatus range_channel(const FqRange *r, const float *v, size_t n, const CalibSpec *calib, float *out,
                              QtError *err);

QtStatus fq_range_calibrate(FqRange *r, const float *x, int ndim, const int *shape, const CalibSpec *calib,
                            QtError *err) {
    const char *name = r && r->param.name[0] ? r->param.name : "(uninitialised)";
    if (!r || !r->param.var.value.data || !x || !shape || ndim < 1 || ndim > TENSOR_MAX_DIMS)
        return qt_error_set(err, QT_ERR_ARG, "learned range %s: calibration needs an initialised range and data of "
                            "1..%d dimensions", name, TENSOR_MAX_DIMS);
    Var xv = {0};
    char sx[64];
    if (!tensor_set_shape(&xv.value, ndim, shape))
        return qt_error_set(err, QT_ERR_SHAPE, "learned range %s: invalid data shape (ndim %d)", name, ndim);
    xv.value.data = (float *)x;
    tensor_shape_str(&xv.value, sx, sizeof sx);
    Geo g;
    QtError e = {0};
    if (!geo_make(&e, name, &xv, r->spec.per_channel, r->spec.axis, &g))
        return qt_error_set(err, e.status, "learned range %s", e.msg);
    if (g.C != r->n_channels)
        return qt_error_set(err, QT_ERR_SHAPE, "learned range %s: data %s has %d channels along axis %d, the range "
                            "%d", name, sx, g.C, r->spec.axis, r->n_channels);
    for (size_t i = 0, n = var_numel(&xv); i < n; i++)
        if (!isfinite(x[i]))
            return qt_error_set(err, QT_ERR_VALUE, "learned range %s: data %s holds %g at flat index %zu", name, sx,
                                (double)x[i], i);
    size_t n = g.outer * g.inner;
    float *buf = malloc((n ? n : 1) * sizeof(float)), *vals = malloc((size_t)g.C * sizeof(float));
    QtStatus st = QT_OK;
    if (!buf || !vals) st = qt_error_set(err, QT_ERR_NOMEM, "learned range %s: out of memory for %zu values", name, n);
    for (int ch = 0; st == QT_OK && ch < g.C; ch++)
        st = range_channel(r, gather_channel(x, &g, ch, buf), n, calib, &vals[ch], err);
    if (st == QT_OK) memcpy(r->param.var.value.data, vals, (size_t)g.C * sizeof(float));
    free(buf);
    free(vals);
    return st;
}

/* What mse sees of a learned quantizer: its round trip with the scale straight from t (no ceil). */
static float learned_roundtrip(float x, float lo, float hi, const CalibQuant *q, bool lsq) {
    const QType *t = q->ctx;
    int n, p, shift;
    learned_levels(t, &n, &p, &shift);
    float thr = fmaxf(-lo, hi);
    float s = lsq ? thr / (float)p : ldexpf(thr, -shift);
    if (!(s >= QARRAY_SCALE_MIN)) s = 1.0f;
    return fminf(fmaxf(rintf(x / s), (float)n), (float)p) * s;
}
static float learned_roundtrip_tqt(float x, float lo, float hi, const CalibQuant *q) {
    return learned_roundtrip(x, lo, hi, q, false);
}
static float learned_roundtrip_lsq(float x, float lo, float hi, const CalibQuant *q) {
    return learned_roundtrip(x, lo, hi, q, true);
}

static QtStatus range_channel(const FqRange *r, const float *v, size_t n, const CalibSpec *calib, float *out,
                              QtError *err) {
    const FqRangeSpec *spec = &r->spec;
    int nn, p, shift;
    learned_levels(spec->qtype, &nn, &p, &shift);
    if (!calib) {
        double amax = 0.0, sum = 0.0;
        for (size_t i = 0; i < n; i++) {
            double a = fabs((double)v[i]);
            amax = a > amax ? a : amax;
            sum += a;
        }
        double step = n ? 2.0 * (sum / (double)n) / sqrt((double)p) : 0.0;
        *out = learned_value(spec, amax, step);
        return QT_OK;
    }
    bool lsq = spec->kind == FQ_RANGE_LSQ;
    CalibQuant q = {.fn = lsq ? learned_roundtrip_lsq : learned_roundtrip_tqt, .ctx = spec->qtype,
                    .levels = qarray_calib_levels(spec->qtype, false)}; /* learned ranges are symmetric */
    CalibRange cr;
    QtError e = {0};
    if (calib_compute(calib, v, n, &q, NULL, 0, &cr, &e) != QT_OK)
        return qt_error_set(err, e.status, "learned range %s: %s", r->param.name, e.msg);
    double thr = fmax(-(double)cr.lo, (double)cr.hi);
    *out = learned_value(spec, thr, thr / p);
    return QT_OK;
}
