/* ops_chscale.h - per-channel scaling, and batch norm folding's arithmetic.
 *
 * Quantization-aware training of a layer followed by a batch norm (torch's
 * ConvBn modules) scales the layer's weight by the batch norm's factor
 * gamma / sqrt(running_var + eps) per output channel and divides the layer's
 * output by it again: nn_chscale. The folded weight and bias the eval form
 * and `qtrain convert` share are bn_fold_values, one arithmetic for both so
 * the two agree bit for bit. */
#ifndef QTRAIN_NN_OPS_CHSCALE_H
#define QTRAIN_NN_OPS_CHSCALE_H

#include <stdbool.h>
#include <stddef.h>

#include "tape.h"

/* y = x * s[c] (divide: x / s[c]), c the index along `axis` of x.
 * x: any shape with axis < ndim; s: (x.shape[axis],); y like x. Gradients
 * to x and s (ds[c] = sum dy * x, divided: -sum dy * y / s[c]). */
Var *nn_chscale(Tape *t, Var *x, Var *s, int axis, bool divide);

/* The kernels on x viewed as (outer, C, inner). */
void chscale_forward(float *restrict y, const float *restrict x, const float *restrict s, size_t outer, int C,
                     size_t inner, bool divide);
/* dx and ds may be NULL (not needed); accumulate. y is the forward's output (divide's ds needs it). */
void chscale_backward(float *dx, float *ds, const float *dy, const float *x, const float *y, const float *s,
                      size_t outer, int C, size_t inner, bool divide);

/* Batch norm folding: with s = gamma[c] / sqrt(var[c] + eps) (gamma NULL: 1)
 * in double per channel, w_out = w * s over the `per` values of channel c
 * (w: (C, per)) and shift_out[c] = (b[c] - mean[c]) * s + beta[c] (b, beta
 * NULL: 0), each rounded once to float. w_out may be w and shift_out b (in
 * place); either output may be NULL (not wanted). */
void bn_fold_values(float *w_out, float *shift_out, const float *w, const float *b, const float *gamma,
                    const float *beta, const float *mean, const float *var, float eps, int C, size_t per);

#endif
