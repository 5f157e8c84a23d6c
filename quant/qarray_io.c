/* qarray_io.c - a QArray's buffers as named flat arrays, and an empty
 * QArray laid out exactly as qarray_quantize lays one out, so a checkpoint
 * restores the packed codes by copying them. */
#include "qarray_io.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qarray_plan.h"

int qarray_blobs(const QArray *q, QArrayBlob *out) {
    if (!q || !q->qtype || !out) return 0;
    int n = 0;
    out[n++] = (QArrayBlob){"qvalue", QARRAY_BLOB_U8, q->code_bytes, q->codes};
    if (q->double_quant) {
        out[n++] = (QArrayBlob){"scale", QARRAY_BLOB_U8, q->n_scales, q->dq.codes};
    } else if (!qtype_is_block(q->qtype)) {
        switch (q->scale_type) {
        case QARRAY_SCALE_F16:
        case QARRAY_SCALE_BF16: out[n++] = (QArrayBlob){"scale", QARRAY_BLOB_U16, q->n_scales, q->scale.bits}; break;
        case QARRAY_SCALE_POF2: out[n++] = (QArrayBlob){"scale", QARRAY_BLOB_U8, q->n_scales, q->scale.e8m0}; break;
        default: out[n++] = (QArrayBlob){"scale", QARRAY_BLOB_F32, q->n_scales, q->scale.f32}; break;
        }
    }
    if (q->asymmetric) {
        bool zf = q->zp_type == QARRAY_ZP_FLOAT;
        out[n++] = (QArrayBlob){"zero_point", zf ? QARRAY_BLOB_F32 : QARRAY_BLOB_I32, q->n_scales,
                                zf ? (void *)q->zero_point.f32 : (void *)q->zero_point.i32};
    }
    if (q->double_quant) out[n++] = (QArrayBlob){"scale_absmax", QARRAY_BLOB_F32, q->dq.n_blocks, q->dq.absmax};
    return n;
}

/* The buffers of q for plan p, zeroed; sizes as qarray_quantize and
 * qarray_dq_compress allocate them (at least one element each). */
static bool alloc_buffers(QArray *q, const QArrayPlan *p) {
    size_t n = q->n_scales ? q->n_scales : 1;
    bool ok = (q->codes = calloc(q->code_bytes ? q->code_bytes : 1, 1)) != NULL;
    if (p->dq) {
        q->dq.block = p->dq_block;
        q->dq.n_blocks = (q->n_scales + (size_t)p->dq_block - 1) / (size_t)p->dq_block;
        ok &= (q->dq.codes = calloc(n, 1)) != NULL;
        ok &= (q->dq.absmax = calloc(q->dq.n_blocks ? q->dq.n_blocks : 1, sizeof(float))) != NULL;
    }
    ok &= qarray_alloc_scale_buffers(q, p);
    return ok;
}

QtStatus qarray_alloc(QArray *q, int ndim, const int *shape, const QType *qtype, const QArrayOptions *options,
                      QtError *err) {
    if (!q) return qt_error_set(err, QT_ERR_ARG, "qarray_alloc: no output QArray");
    memset(q, 0, sizeof *q);
    QArrayOptions o = {0};
    if (options) o = *options;
    /* Nothing is drawn here: a stochastic layout is the rne one, and the mode is only recorded. */
    QRound round = o.round;
    if (o.round == QROUND_STOCHASTIC) o.round = QROUND_RNE, o.rng = NULL;
    QArrayPlan p;
    QtStatus st = qarray_plan_make(&p, "QArray", ndim, shape, qtype, &o, err);
    if (st != QT_OK) return st;
    q->qtype = p.t, q->ndim = p.ndim, q->numel = p.numel, q->n_scales = p.n_scales;
    for (int d = 0; d < ndim; d++) q->shape[d] = p.shape[d], q->tile[d] = p.tile[d], q->scale_shape[d] = p.sdim[d];
    q->code_bytes = qtype_packed_bytes(p.t, p.numel);
    q->scale_type = p.scale_type, q->asymmetric = p.asym, q->zp_type = p.zp_float ? QARRAY_ZP_FLOAT : QARRAY_ZP_INT32;
    q->double_quant = p.dq, q->narrow_range = p.narrow, q->round = round;
    if (!alloc_buffers(q, &p)) {
        qarray_free(q);
        return qt_error_set(err, QT_ERR_NOMEM, "QArray: out of memory for %zu elements of %s", p.numel, p.t->name);
    }
    return QT_OK;
}

/* ---- checking stored values -------------------------------------------------------------------------------- */

/* Every absmax qarray_dq_compress stores is at least QARRAY_SCALE_MIN (a block of equal scales gets 1). */
static QtStatus check_dq_absmax(const QArray *q, QtError *err) {
    for (size_t b = 0; b < q->dq.n_blocks; b++) {
        float a = q->dq.absmax[b];
        if (!(a > 0.0f) || isinf(a))
            return qt_error_set(err, QT_ERR_FORMAT, "scale_absmax[%zu] = %g; the absmax of a block of "
                                "double-quantized scales is finite and > 0", b, (double)a);
    }
    return QT_OK;
}

/* Scale i as stored, for a message: "nan", "0x7fc0, the bfloat16 bits of nan", ... */
static void describe_scale(const QArray *q, size_t i, float s, char *buf, size_t cap) {
    if (q->double_quant) {
        size_t b = i / (size_t)q->dq.block;
        snprintf(buf, cap, "%u, the map code that with scale_absmax[%zu] = %g and dq_offset %g gives the scale %g",
                 q->dq.codes[i], b, (double)q->dq.absmax[b], (double)q->dq.offset, (double)s);
        return;
    }
    switch (q->scale_type) {
    case QARRAY_SCALE_F16:
    case QARRAY_SCALE_BF16:
        snprintf(buf, cap, "0x%04x, the %s bits of %g", q->scale.bits[i], qarray_scale_type_name(q->scale_type),
                 (double)s);
        break;
    case QARRAY_SCALE_POF2:
        snprintf(buf, cap, "%u, an e8m0 code (255 is NaN in OCP MX)", q->scale.e8m0[i]);
        break;
    default: snprintf(buf, cap, "%g", (double)s); break;
    }
}

/* Scales of a non-block format, decoded from whichever form holds them. Quantization never stores a scale below
 * QARRAY_SCALE_MIN (an all-zero slice gets 1, float16 rounds up to 2^-24), except that double quantization
 * may rebuild a small slice's scale as 0 or below (qarray.h): there only a non-finite one is damage. */
static QtStatus check_scales(const QArray *q, QtError *err) {
    for (size_t i = 0; i < q->n_scales; i++) {
        float s = qarray_scale_at(q, i);
        bool bad = q->double_quant ? !isfinite(s) : !(s > 0.0f) || isinf(s);
        if (!bad) continue;
        char what[160];
        describe_scale(q, i, s, what, sizeof what);
        return qt_error_set(err, QT_ERR_FORMAT, "scale[%zu] = %s; a %s scale must be finite%s", i, what,
                            q->double_quant ? "double-quantized" : qarray_scale_type_name(q->scale_type),
                            q->double_quant ? "" : " and > 0");
    }
    return QT_OK;
}

/* The shared exponent in byte 0 of every block: 255 is NaN (OCP MX; mx6/mx9 alike), which a block gets only
 * from a NaN or an infinity in the data that quantize refuses. */
static QtStatus check_block_scales(const QArray *q, QtError *err) {
    size_t bb = q->qtype->block_bytes;
    for (size_t b = 0; bb && b < q->code_bytes / bb; b++)
        if (q->codes[b * bb] == 255)
            return qt_error_set(err, QT_ERR_FORMAT, "qvalue[%zu] = 255, the shared e8m0 scale of %s block %zu, is "
                                "the NaN code", b * bb, q->qtype->name, b);
    return QT_OK;
}

/* NaN element codes (fp8_e4m3, fp8_e5m2, and mxfp8_e4m3's elements; the narrower floats have none): encode
 * gives one only for a NaN, which quantize refuses. Only 8-bit elements can hold one, one code a byte. */
static QtStatus check_nan_codes(const QArray *q, QtError *err) {
    bool block = qtype_is_block(q->qtype);
    const QType *e = block ? q->qtype->elem : q->qtype;
    if (!e || e->bits != 8 || !qtype_has_nan(e)) return QT_OK;
    size_t first = block ? 1 : 0, stride = block ? q->qtype->block_bytes : q->code_bytes;
    size_t per = block ? (size_t)q->qtype->block : q->code_bytes;
    for (size_t b0 = 0; stride && b0 < q->code_bytes; b0 += stride)
        for (size_t k = first; k < first + per && b0 + k < q->code_bytes; k++)
            if (qtype_code_is_nan(e, q->codes[b0 + k]))
                return qt_error_set(err, QT_ERR_FORMAT, "qvalue[%zu] = 0x%02x is a NaN code of %s, which "
                                    "quantization never stores", b0 + k, q->codes[b0 + k], e->name);
    return QT_OK;
}

/* Zero points lie in the format's code range, narrow range applied, as qarray_zero_point_for_range clamps
 * them; a float one is also finite. */
static QtStatus check_zero_points(const QArray *q, QtError *err) {
    const QType *t = q->qtype;
    int qmin = q->narrow_range ? -t->qmax : t->qmin, qmax = t->qmax;
    for (size_t i = 0; i < q->n_scales; i++) {
        if (q->zp_type == QARRAY_ZP_FLOAT) {
            float zp = q->zero_point.f32[i];
            if (zp >= (float)qmin && zp <= (float)qmax) continue; /* NaN fails both */
            return qt_error_set(err, QT_ERR_FORMAT, "zero_point[%zu] = %g is %s %s's code range [%d, %d]", i,
                                (double)zp, isfinite(zp) ? "outside" : "not finite, so not within", t->name, qmin,
                                qmax);
        }
        int32_t zp = q->zero_point.i32[i];
        if (zp < qmin || zp > qmax)
            return qt_error_set(err, QT_ERR_FORMAT, "zero_point[%zu] = %ld is outside %s's code range [%d, %d]", i,
                                (long)zp, t->name, qmin, qmax);
    }
    return QT_OK;
}

QtStatus qarray_check_stored(const QArray *q, QtError *err) {
    if (!q || !q->qtype) return qt_error_set(err, QT_ERR_ARG, "qarray_check_stored: no QArray");
    QtStatus st = q->double_quant ? check_dq_absmax(q, err) : QT_OK;
    if (st == QT_OK) st = qtype_is_block(q->qtype) ? check_block_scales(q, err) : check_scales(q, err);
    if (st == QT_OK && q->asymmetric) st = check_zero_points(q, err);
    if (st == QT_OK) st = check_nan_codes(q, err);
    return st;
}
