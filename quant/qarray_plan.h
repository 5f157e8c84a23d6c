/* qarray_plan.h - QArray's options resolved against a shape, the slicing
 * of an array into its scale groups and the per-slice rules (calibration,
 * scale, scale type, zero point, element code). Internal to quant/: shared
 * by qarray.c and the dynamic fake-quantization op, so that a tensor
 * fake-quantized with some options and the QArray quantized with the same
 * options agree bit for bit. The numerics are documented in qarray.h. */
#ifndef QTRAIN_QUANT_QARRAY_PLAN_H
#define QTRAIN_QUANT_QARRAY_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/qarray.h"

#define QARRAY_BLOCK_MAX 32 /* the largest block of a block format (qtype_block.c's limit too) */

/* Everything quantize needs, checked once. */
typedef struct {
    const char *who;            /* names the caller in messages: "QArray", or an op's name */
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
} QArrayPlan;

/* Checks the options o against the shape and format. Messages start with
 * `who` ("QArray" for qarray_quantize) and name the option at fault. */
QtStatus qarray_plan_make(QArrayPlan *p, const char *who, int ndim, const int *shape, const QType *t,
                          const QArrayOptions *o, QtError *err);

/* The array padded to 4 dims (leading axes of a smaller array are 1). */
typedef struct {
    size_t dim[4], tile[4], sdim[4], sstride[4];
} QArrayLayout;

/* shape, tile, sdim [ndim] as in QArray. */
void qarray_layout_make(QArrayLayout *L, int ndim, const int *shape, const int *tile, const int *sdim);
/* Scale index of the first element of row r (all axes but the last), r < numel / dim[3]. */
size_t qarray_layout_row_group(const QArrayLayout *L, size_t r);
/* The elements of slice g (a scale index) -> buf [numel / n_scales]; returns their count. */
size_t qarray_layout_gather(const QArrayLayout *L, const float *x, size_t g, float *buf);

/* v rounded to an integer by mode; stochastic: floor(v + u), decided as
 * u >= 1 - frac so that no float addition rounds v + u. */
float qarray_round_int(float v, QRound mode, float u);

/* The scale of the range [lo, hi] before any scale type, and the zero point
 * of lo under the scale s (0 when symmetric). */
float qarray_plan_scale(const QArrayPlan *p, float lo, float hi);
float qarray_plan_zero_point(const QArrayPlan *p, float lo, float s);
/* One element -> its code: x / s on the grid; zp in code units (0 if
 * symmetric). Not for block formats. */
uint32_t qarray_plan_encode(const QArrayPlan *p, float x, float s, float zp, QRound mode, float u);

/* Bytes of calibration workspace for a slice of n values. */
size_t qarray_plan_work_bytes(const QArrayPlan *p, size_t n);
/* The calibrated range of one slice v [n]; work as calib_compute takes it. */
QtStatus qarray_plan_slice_range(const QArrayPlan *p, const float *v, size_t n, void *work, size_t work_bytes,
                                 CalibRange *r, QtError *err);
/* s rounded to the plan's scale type: *stored gets its storage (float32
 * bits, float16/bfloat16 bits, or the e8m0 code), *used the value the codes
 * are computed with. i names the scale in messages. QT_ERR_VALUE if s does
 * not fit the type. */
QtStatus qarray_plan_round_scale(const QArrayPlan *p, size_t i, float s, uint32_t *stored, float *used,
                                 QtError *err);

/* The scale buffer in the plan's scale type (none for block formats or
 * double quantization) and the zero points (asymmetric only) of q, zeroed,
 * q->n_scales (at least 1) each; qarray.c. false if memory runs out. */
bool qarray_alloc_scale_buffers(QArray *q, const QArrayPlan *p);

#endif
