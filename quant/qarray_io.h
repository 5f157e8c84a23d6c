/* qarray_io.h - a QArray's storage as named flat arrays, for checkpoints.
 *
 * Files keep the codes packed exactly as in memory, so loading is a copy
 * into the buffers qarray_alloc lays out; nothing is re-quantized. */
#ifndef QTRAIN_QUANT_QARRAY_IO_H
#define QTRAIN_QUANT_QARRAY_IO_H

#include <stddef.h>

#include "base/error.h"
#include "quant/qarray.h"

typedef enum { QARRAY_BLOB_U8, QARRAY_BLOB_U16, QARRAY_BLOB_I32, QARRAY_BLOB_F32 } QArrayBlobType;

/* One array of a QArray's storage. */
typedef struct {
    const char *name;      /* "qvalue", "scale", "zero_point", "scale_absmax" */
    QArrayBlobType type;
    size_t count;          /* elements */
    void *data;            /* [count], the QArray's own buffer */
} QArrayBlob;

#define QARRAY_MAX_BLOBS 4

/* The buffers holding q's data, by name, in this order, only those that
 * exist:
 *   qvalue       u8  [code_bytes]  the packed codes (block formats: the blocks)
 *   scale        f32 [n_scales] (float32), u16 (float16/bfloat16 bits),
 *                u8 (pof2 e8m0), or u8 (double quantization: the map codes);
 *                absent for block formats
 *   zero_point   i32 or f32 [n_scales], asymmetric only
 *   scale_absmax f32 [dq.n_blocks], double quantization only (q->dq.offset
 *                and q->dq.block are scalars the caller stores itself)
 * Returns the count. Filling the buffers of a qlayer_init_empty QArray and
 * setting dq.offset restores it exactly. */
int qarray_blobs(const QArray *q, QArrayBlob *out);
/* Allocates q for this shape, format and options as qarray_quantize would
 * lay it out, every buffer zeroed. */
QtStatus qarray_alloc(QArray *q, int ndim, const int *shape, const QType *qtype, const QArrayOptions *options,
                      QtError *err);
/* Checks blobs filled from a file for values quantization never stores and
 * that would turn dequantized values into NaN, Inf or nonsense: a scale
 * that is NaN, infinite, zero or negative in whatever form it is stored
 * (float32, float16/bfloat16 bits, an e8m0 code 255; double quantization:
 * a non-finite rebuilt scale, since a rebuilt one may be 0 or negative, or
 * a block absmax that is not finite and > 0), an MX block whose shared
 * scale is the NaN code 255, a zero point outside the format's code range
 * (narrow range applied) or not finite, and an 8-bit float code that is
 * NaN. QT_OK, or QT_ERR_FORMAT for the first such value, with a message
 * that starts with the blob's name and the element index ("scale[3] =
 * nan; ..."), so the caller prefixes where the blobs came from. */
QtStatus qarray_check_stored(const QArray *q, QtError *err);

#endif
