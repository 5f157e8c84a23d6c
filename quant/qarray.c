/* qarray.c - QArray quantize: per-slice scales stored in their
 * scale type, zero points, element codes and the block formats. The options,
 * the slicing into scale groups and the per-slice rules live in
 * qarray_plan.c (shared with fake quantization); float16/bfloat16 bits and
 * double quantization in qarray_dq.c; dequantize in qarray_deq.c. */
#include "qarray.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qarray_plan.h"

/* Codes packed per step: a multiple of 8, so a chunk of codes of any width
 * ends on a byte boundary. */
#define CHUNK 512

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

static void layout_of(const QArray *q, QArrayLayout *L) {
    qarray_layout_make(L, q->ndim, q->shape, q->tile, q->scale_shape);
}

/* ---- pass 1: scales and zero points ------------------------------------------- */

/* Rounds s to the scale type, stores it as scale i of q, returns the stored value. */
static QtStatus scale_store(QArray *q, const QArrayPlan *p, size_t i, float s, float *used, QtError *err) {
    uint32_t stored;
    QtStatus st = qarray_plan_round_scale(p, i, s, &stored, used, err);
    if (st != QT_OK) return st;
    switch (q->scale_type) {
    case QARRAY_SCALE_F16:
    case QARRAY_SCALE_BF16: q->scale.bits[i] = (uint16_t)stored; break;
    case QARRAY_SCALE_POF2: q->scale.e8m0[i] = (uint8_t)stored; break;
    default:
        if (q->scale.f32) q->scale.f32[i] = *used;
        break;
    }
    return QT_OK;
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

/* Scales (stored) and zero points of every slice; used [n_scales] gets the
 * scale each slice's codes are computed with. */
static QtStatus compute_scales(QArray *q, const QArrayPlan *p, const float *x, float *used, QtError *err) {
    QArrayLayout L;
    layout_of(q, &L);
    size_t slice = q->n_scales ? p->numel / q->n_scales : 0;
    Scratch sc = {0};
    sc.work_bytes = qarray_plan_work_bytes(p, slice);
    sc.buf = malloc((slice ? slice : 1) * sizeof(float));
    sc.work = sc.work_bytes ? malloc(sc.work_bytes) : NULL;
    sc.lo = p->asym ? malloc((q->n_scales ? q->n_scales : 1) * sizeof(float)) : NULL;
    QtStatus st = QT_OK;
    if (!sc.buf || (sc.work_bytes && !sc.work) || (p->asym && !sc.lo))
        st = qt_error_set(err, QT_ERR_NOMEM, "QArray: out of memory for a slice of %zu values", slice);
    for (size_t g = 0; st == QT_OK && g < q->n_scales; g++) {
        size_t n = p->numel ? qarray_layout_gather(&L, x, g, sc.buf) : 0;
        CalibRange r;
        st = qarray_plan_slice_range(p, sc.buf, n, sc.work, sc.work_bytes, &r, err);
        if (st != QT_OK) break;
        if (sc.lo) sc.lo[g] = r.lo;
        used[g] = qarray_plan_scale(p, r.lo, r.hi);
        if (!p->dq) st = scale_store(q, p, g, used[g], &used[g], err);
    }
    if (st == QT_OK && p->dq) {
        float *raw = malloc((q->n_scales ? q->n_scales : 1) * sizeof *raw);
        if (!raw) st = qt_error_set(err, QT_ERR_NOMEM, "QArray: out of memory for %zu scales", q->n_scales);
        if (raw) memcpy(raw, used, q->n_scales * sizeof *raw);
        if (st == QT_OK) st = qarray_dq_compress(&q->dq, raw, q->n_scales, p->dq_block, used, err);
        free(raw);
    }
    for (size_t g = 0; st == QT_OK && p->asym && g < q->n_scales; g++) {
        float zp = qarray_plan_zero_point(p, sc.lo[g], used[g]);
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

static void encode_elements(QArray *q, const QArrayPlan *p, const float *x, const float *used, RngUniforms *u,
                            Packer *pk) {
    if (!p->numel) return;
    QArrayLayout L;
    layout_of(q, &L);
    *pk = (Packer){.t = p->t, .out = q->codes};
    size_t rows = p->numel / L.dim[3], d3 = L.dim[3], t3 = L.tile[3];
    for (size_t r = 0; r < rows; r++) {
        size_t g0 = qarray_layout_row_group(&L, r);
        const float *xr = x + r * d3;
        for (size_t a = 0; a < d3; a += t3) {
            size_t g = g0 + a / t3;
            float s = used[g], zp = qarray_zero_point_at(q, g);
            bool zero = !(fabsf(s) >= QARRAY_SCALE_MIN); /* only a double-quantized scale can be this small */
            for (size_t j = a; j < a + t3; j++) {
                float uj = rng_uniforms_next(u);
                packer_put(pk, qarray_plan_encode(p, zero ? 0.0f : xr[j], zero ? 1.0f : s, zp, p->round, uj));
            }
        }
    }
    packer_flush(pk);
}

static QtStatus encode_blocks(QArray *q, const QArrayPlan *p, const float *x, RngUniforms *u, QtError *err) {
    const QType *t = p->t;
    size_t nb = p->numel / (size_t)t->block;
    float uv[QARRAY_BLOCK_MAX];
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

bool qarray_alloc_scale_buffers(QArray *q, const QArrayPlan *p) {
    size_t n = q->n_scales ? q->n_scales : 1;
    bool ok = true;
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
    return ok;
}

static QtStatus alloc_storage(QArray *q, const QArrayPlan *p, QtError *err) {
    q->code_bytes = qtype_packed_bytes(p->t, p->numel);
    q->codes = calloc(q->code_bytes ? q->code_bytes : 1, 1);
    bool ok = q->codes != NULL;
    ok &= qarray_alloc_scale_buffers(q, p);
    if (!ok)
        return qt_error_set(err, QT_ERR_NOMEM, "QArray: out of memory for %zu elements of %s", p->numel, p->t->name);
    return QT_OK;
}

QtStatus qarray_quantize(QArray *out, const float *x, int ndim, const int *shape, const QType *qtype,
                         const QArrayOptions *options, QtError *err) {
    if (!out) return qt_error_set(err, QT_ERR_ARG, "qarray_quantize: no output QArray");
    memset(out, 0, sizeof *out);
    const QArrayOptions defaults = {0};
    QArrayPlan p;
    QtStatus st = qarray_plan_make(&p, "QArray", ndim, shape, qtype, options ? options : &defaults, err);
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
