/* qarray_io.c - a QArray's buffers as named flat arrays, and an empty
 * QArray laid out exactly as qarray_quantize lays one out, so a checkpoint
 * restores the packed codes by copying them. */
#include "qarray_io.h"

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
