/* fakequant_internal.h - checks shared by the fake-quantization ops
 * (fakequant.c, fakequant_dynamic.c). Internal to quant/. */
#ifndef QTRAIN_QUANT_FAKEQUANT_INTERNAL_H
#define QTRAIN_QUANT_FAKEQUANT_INTERNAL_H

#include <stdbool.h>

#include "base/rng.h"
#include "nn/tape.h"
#include "quant/qtype.h"

/* False, with the tape error naming op and the first non-finite index, if
 * x holds a NaN or an infinity. */
bool fq_check_finite(Tape *t, const char *op, const Var *x);

/* The rng stochastic rounding draws from (given, else the tape's), or an
 * error if there is none; *out = NULL (no error) for the other modes. False
 * also for a mode outside QRound. */
bool fq_pick_rng(Tape *t, const char *op, QRound mode, Rng *given, Rng **out);

/* The scale fake quantization divides by for a given scale s: s, or 1
 * below QARRAY_SCALE_MIN (an all-zero range). */
float fq_effective_scale(float s);

/* Fake quantization's clamp bounds [*lo, *hi], in units of the scale, for
 * the int or uint format t with zero point zp (and signed narrow range):
 * what a caller computing the same codes another way must use. */
void fq_int_code_bounds(const QType *t, bool narrow, float zp, float *lo, float *hi);

#endif
