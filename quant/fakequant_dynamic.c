/* fakequant_dynamic.c - fake quantization with scales calibrated from x on
 * every call. QArray's plan (qarray_plan.h) checks the options and slices x
 * into its scale groups, and every slice goes through the rules qarray.c
 * uses, so the forward is qarray_quantize -> qarray_dequantize bit for bit:
 * channelwise and tiled (per-block) scales, scale types, zero points,
 * calibration, rounding and the block formats. */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "fakequant.h"
#include "fakequant_internal.h"
#include "qarray_plan.h"

static const char OP[] = "fake_quant_dynamic";

typedef struct {
    size_t numel;
    const uint8_t *inside; /* [ceil(numel / 8)] bit i & 7 of byte i / 8: element i lies in its slice's
                              representable range; NULL passes every gradient (FQ_STE_PASS) */
} DynCtx;

static void dyn_backward(Tape *t, const TapeNode *node) {
    const DynCtx *c = node->ctx;
    float *dx = tape_grad(t, node->in[0]);
    if (!dx) return;
    const float *dy = node->out->grad;
    for (size_t i = 0; i < c->numel; i++) {
        bool pass = !c->inside || ((c->inside[i >> 3] >> (i & 7)) & 1u);
        dx[i] += pass ? dy[i] : 0.0f;
    }
}

/* One call's forward: x -> y, and the mask of elements inside their range. */
typedef struct {
    const QArrayPlan *p;
    const float *x;     /* [numel] */
    float *y;           /* [numel] */
    uint8_t *inside;    /* [ceil(numel / 8)] zeroed, or NULL when no gradient is clipped */
    RngUniforms *u;
    bool skip_rounding; /* clamp x / s to the range without rounding */
} DynRun;

static void mark_inside(uint8_t *m, size_t i) { m[i >> 3] |= (uint8_t)(1u << (i & 7)); }

/* ---- element formats: a scale (and zero point) per slice --------------------------------------- */

/* The representable range [elo, ehi] in units of the scale, for zero point zp. */
static void elem_bounds(const QArrayPlan *p, float zp, float *elo, float *ehi) {
    const QType *t = p->t;
    switch (t->kind) {
    case QTYPE_KIND_INT:
    case QTYPE_KIND_UINT: *elo = p->qmin - zp, *ehi = p->qmax - zp; break;
    case QTYPE_KIND_LUT: *elo = t->lut[0], *ehi = t->lut[(1 << t->bits) - 1]; break;
    case QTYPE_KIND_FLOAT: *elo = -t->max, *ehi = t->max; break;
    default: *elo = -1.0f, *ehi = 1.0f; break; /* ternary, binary */
    }
}

/* Scale s [n_scales] (rounded to the scale type, as QArray stores it) and
 * zero point zp [n_scales] of every slice of x. */
static bool dyn_scales(Tape *t, const QArrayPlan *p, const QArrayLayout *L, const float *x, float *s, float *zp) {
    size_t slice = p->numel / p->n_scales, wb = qarray_plan_work_bytes(p, slice);
    void *work = wb ? tape_alloc(t, wb) : NULL;
    /* one slice is x itself, in the order a gather would give */
    float *buf = p->n_scales > 1 ? tape_alloc(t, slice * sizeof(float)) : NULL;
    if ((wb && !work) || (p->n_scales > 1 && !buf)) return false;
    for (size_t g = 0; g < p->n_scales; g++) {
        if (buf) qarray_layout_gather(L, x, g, buf);
        CalibRange r;
        QtError e = {0};
        if (qarray_plan_slice_range(p, buf ? buf : x, slice, work, wb, &r, &e) != QT_OK) {
            qt_error_set(&t->err, e.status, "%s: calibrating slice %zu of %zu: %s", OP, g, p->n_scales, e.msg);
            return false;
        }
        uint32_t stored;
        if (qarray_plan_round_scale(p, g, qarray_plan_scale(p, r.lo, r.hi), &stored, &s[g], &t->err) != QT_OK)
            return false;
        zp[g] = p->asym ? qarray_plan_zero_point(p, r.lo, s[g]) : 0.0f;
    }
    return true;
}

/* y row by row, slice by slice along the last axis, drawing one uniform per
 * element in flat order as qarray_quantize does. */
static void dyn_elements(const QArrayLayout *L, const float *s, const float *zp, DynRun *r) {
    const QArrayPlan *p = r->p;
    const QType *t = p->t;
    float lut[256];
    for (uint32_t c = 0; c < (1u << t->bits); c++) lut[c] = qtype_decode(t, c);
    size_t d3 = L->dim[3], t3 = L->tile[3], rows = p->numel / d3;
    for (size_t row = 0; row < rows; row++) {
        size_t g0 = qarray_layout_row_group(L, row);
        for (size_t a = 0; a < d3; a += t3) {
            size_t g = g0 + a / t3, i0 = row * d3 + a;
            float sg = s[g], z = zp[g], elo, ehi;
            bool zero = !(sg >= QARRAY_SCALE_MIN); /* as qarray.c: the codes of 0 */
            elem_bounds(p, z, &elo, &ehi);
            for (size_t i = i0; i < i0 + t3; i++) {
                float u = rng_uniforms_next(r->u), v = r->x[i] / sg;
                if (r->skip_rounding) {
                    r->y[i] = fminf(fmaxf(v, elo), ehi) * sg;
                } else {
                    uint32_t code = qarray_plan_encode(p, zero ? 0.0f : r->x[i], zero ? 1.0f : sg, z, p->round, u);
                    r->y[i] = (lut[code] - z) * sg;
                }
                if (r->inside && v >= elo && v <= ehi) mark_inside(r->inside, i);
            }
        }
    }
}

/* ---- block formats: the scale lives in the block ------------------------------------------------- */

/* Bits [off, off + bits) of an MSB-first stream (bits <= 8), as qtype_pack writes them. */
static uint32_t stream_bits(const uint8_t *s, size_t off, int bits) {
    size_t b = off >> 3;
    int end = (int)(off & 7) + bits;
    uint32_t w = end <= 8 ? (uint32_t)s[b] << 8 : ((uint32_t)s[b] << 8) | s[b + 1];
    return (w >> (16 - end)) & ((1u << bits) - 1u);
}

/* k such that element i of the packed block holds x * 2^-k in the element
 * format: the shared scale (MX), or the shared exponent less the element's
 * sub-block micro-exponent (mx6/mx9); qtype.h's block layouts. */
static int block_exponent(const QType *t, const uint8_t *blk, int i) {
    if (t->kind == QTYPE_KIND_MX) return (int)blk[offsetof(QMxBlock8, scale)] - 127 + t->elem_scale_log2;
    size_t off = (size_t)(i / t->sub_block) * (size_t)t->micro_bits;
    int shift = (int)stream_bits(blk + offsetof(QMx9Block, micro_exp), off, t->micro_bits);
    return (int)blk[offsetof(QMx9Block, shared_exp)] - 127 - shift + 1 - t->mant_bits;
}

/* Each block quantized and dequantized with qtype_block_*; inside means
 * |x| 2^-k <= the element format's max, the saturation bound of the block. */
static bool dyn_blocks(Tape *t, DynRun *r) {
    const QType *bt = r->p->t;
    const int B = bt->block;
    float mx = bt->elem->max, uv[QARRAY_BLOCK_MAX];
    uint8_t blk[64];
    _Static_assert(sizeof(QMxBlock8) <= sizeof blk, "the largest packed block fits");
    for (size_t b = 0; b < r->p->numel / (size_t)B; b++) {
        const float *xb = r->x + b * (size_t)B;
        float *yb = r->y + b * (size_t)B;
        for (int i = 0; i < B; i++) uv[i] = rng_uniforms_next(r->u);
        memset(blk, 0, sizeof blk);
        QtStatus st = qtype_block_quantize(bt, xb, B, blk, r->p->round, uv);
        if (st == QT_OK) st = qtype_block_dequantize(bt, blk, B, yb);
        if (st != QT_OK) {
            qt_error_set(&t->err, st, "%s: %s block %zu could not be quantized", OP, bt->name, b);
            return false;
        }
        for (int i = 0; i < B; i++) {
            int k = block_exponent(bt, blk, i);
            float v = ldexpf(xb[i], -k); /* exactly what the element encoder sees */
            if (r->skip_rounding) yb[i] = ldexpf(fminf(fmaxf(v, -mx), mx), k);
            if (r->inside && fabsf(v) <= mx) mark_inside(r->inside, b * (size_t)B + (size_t)i);
        }
    }
    return true;
}

/* ---- the op -------------------------------------------------------------------------------------- */

/* x -> y with QArray's options o (rng already picked for stochastic rounding). */
static Var *dyn_run(Tape *t, Var *x, const QType *qt, const QArrayOptions *o, FqSte ste, bool skip_rounding) {
    if ((int)ste < 0 || ste >= FQ_STE_COUNT) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: straight-through estimator %d is neither clipped nor pass", OP,
                     (int)ste);
        return NULL;
    }
    if (o->double_quant) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s option double_quant: double quantization compresses stored "
                     "scales, which fake quantization does not keep; leave it off", OP);
        return NULL;
    }
    QArrayPlan p;
    if (!fq_check_finite(t, OP, x) ||
        qarray_plan_make(&p, OP, x->value.ndim, x->value.shape, qt, o, &t->err) != QT_OK)
        return NULL;
    bool clip = ste == FQ_STE_CLIPPED && t->grad_enabled && x->requires_grad;
    size_t mask_bytes = (p.numel + 7) / 8;
    DynCtx *c = tape_alloc(t, sizeof *c);
    uint8_t *inside = clip ? tape_alloc(t, mask_bytes) : NULL;
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    if (!c || (clip && !inside) || !y) return NULL;
    if (inside) memset(inside, 0, mask_bytes);
    *c = (DynCtx){.numel = p.numel, .inside = inside};
    RngUniforms u; /* drawn as qarray_quantize draws them */
    rng_uniforms_init(&u, p.round == QROUND_STOCHASTIC && !skip_rounding ? p.rng : NULL, p.numel);
    DynRun r = {.p = &p, .x = x->value.data, .y = y->value.data, .inside = inside, .u = &u,
                .skip_rounding = skip_rounding};
    if (qtype_is_block(p.t)) {
        if (!dyn_blocks(t, &r)) return NULL;
    } else {
        QArrayLayout L;
        qarray_layout_make(&L, p.ndim, p.shape, p.tile, p.sdim);
        float *s = tape_alloc(t, 2 * p.n_scales * sizeof(float));
        if (!s || !dyn_scales(t, &p, &L, r.x, s, s + p.n_scales)) return NULL;
        dyn_elements(&L, s, s + p.n_scales, &r);
    }
    return tape_record(t, OP, dyn_backward, y, (Var *[]){x}, 1, c) ? y : NULL;
}

Var *fq_fake_quant_dynamic(Tape *t, Var *x, const FakeQuantSpec *spec, const CalibSpec *calib) {
    if (!x) return NULL;
    if (!spec) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: no spec given", OP);
        return NULL;
    }
    Rng *rng;
    if (!fq_pick_rng(t, OP, spec->round, spec->rng, &rng)) return NULL;
    QArrayOptions o = {.n_channelwise = spec->n_channelwise, .n_tiled = spec->n_tiled, .calib = calib,
                       .range = spec->range, .narrow_range = spec->narrow_range, .scale_type = spec->scale_type,
                       .zp_type = spec->zp_type, .round = spec->round, .rng = rng};
    memcpy(o.channelwise_axes, spec->channelwise_axes, sizeof o.channelwise_axes);
    memcpy(o.tiled_axes, spec->tiled_axes, sizeof o.tiled_axes);
    if (spec->per_channel) {
        if (o.n_channelwise < 0 || o.n_channelwise >= QARRAY_MAX_DIMS) {
            qt_error_set(&t->err, QT_ERR_ARG, "%s: spec.per_channel adds axis %d to %d channelwise axes; at most "
                         "%d axes fit", OP, spec->axis, o.n_channelwise, QARRAY_MAX_DIMS);
            return NULL;
        }
        o.channelwise_axes[o.n_channelwise++] = spec->axis;
    }
    return dyn_run(t, x, spec->qtype, &o, spec->ste, spec->skip_rounding);
}

Var *fq_fake_quant_qarray(Tape *t, Var *x, const QType *qtype, const QArrayOptions *options, FqSte ste) {
    if (!x) return NULL;
    QArrayOptions o = options ? *options : (QArrayOptions){0};
    if (o.round == QROUND_STOCHASTIC && !o.rng && !fq_pick_rng(t, OP, o.round, NULL, &o.rng)) return NULL;
    return dyn_run(t, x, qtype, &o, ste, false);
}
