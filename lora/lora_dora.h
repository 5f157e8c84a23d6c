/* lora_dora.h - DoRA (weight-decomposed low-rank adaptation, Liu et al.
 * 2024, arXiv 2402.09353): a LoRA adapter with `dora: true` learns a
 * magnitude m per output channel over the direction of the adapted weight:
 *
 *   W' = m * V / |V|_c,   V = W + scale B A,   g = m / |V|_c   (out)
 *
 * |V|_c the L2 norm of output channel c's row over the whole fan-in (dense:
 * a row of (out, in); conv: C/groups * KH * KW). W is the base weight (a
 * quantized base dequantized). m starts at |W|_c, so a fresh adapter
 * (B = 0) leaves the output unchanged. The bias stays outside.
 *
 * The forward is PEFT's (DoraLinearLayer, DoraConv2dLayer): with xd the
 * adapter's input after its dropout,
 *
 *   y = base(x) + (g - 1) * base_nobias(xd) + g * scale * B(A(xd))
 *
 * per output channel; base_nobias is the base's product without the bias.
 * Without dropout (or out of training) xd = x and y = W' x + bias exactly
 * as the merged layer computes it; with dropout base_nobias runs a second
 * time, on xd, as in PEFT.
 *
 * The gradient is the exact one: |V|_c is differentiated too (its path
 * into A and B, and into W when the module's weight trains), which is
 * what finite differences check. PEFT detaches |V|_c (the paper's §4.3
 * memory saving); the two differ in dA and dB, not in the forward, dm or
 * dx. */
#ifndef QTRAIN_LORA_LORA_DORA_H
#define QTRAIN_LORA_LORA_DORA_H

#include "lora.h"

/* v [out * fan_in] = w + scale B A (B A per group for a grouped conv), and
 * norms [out] = |v|_c (summed in double; NULL: not computed); w is the base
 * weight [out * fan_in], and v may be w (in place). */
void lora_dora_direction(const LoraAdapter *a, const float *w, float *v, float *norms);
/* M = |w + scale B A|_c over base weight w [out * fan_in]: |W|_c for a
 * fresh adapter (B = 0), and whatever A and B are, a gain of exactly 1, so
 * the adapter starts at the base's output. */
QtStatus lora_dora_init_magnitude(LoraAdapter *a, const float *w, QtError *err);
/* w [out * fan_in] = m * V / |V|_c with V = w + scale B A: folds the DoRA
 * adapter into the float base weight w. */
void lora_dora_merge(const LoraAdapter *a, float *w);
/* The DoRA forward above, x and y as the module's. */
Var *lora_dora_forward(Tape *t, LoraAdapter *a, Var *x);
/* A conv2d's DoRA forward with its relu (and pooling) folded in, as one
 * convolution on the merged weight; NULL, no error, where that does not
 * apply (adapter dropout in training, a base that does not lend its
 * weight, a general geometry): the layers then run one by one. */
Var *lora_dora_fused(Tape *t, LoraAdapter *a, Var *x, Var *bias, ConvEpilogue epi);
/* lora_adapter_macs of a DoRA adapter (per example; see lora_dora.c). */
void lora_dora_macs(const LoraAdapter *a, bool input_grad, bool weight_grad, StepMacs *macs);
/* Adds to *macs the multiply-adds of a training step that do not grow
 * with the batch, per example of a batch of `batch`: forming V (out r/g
 * fan) and its norms (out fan) forward and, backward, dA and dB through
 * the norms (2 out r/g fan); on the merged weight also scaling it (out
 * fan) and, backward, dg and dV (2 out fan). */
void lora_dora_batch_macs(const LoraAdapter *a, int batch, StepMacs *macs);

#endif
