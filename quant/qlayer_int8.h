/* qlayer_int8.h - the quantized layer's int8 forward (qlayer_int8.c), as
 * qlayer_ops.c calls it. Internal to quant/; qlayer.h describes the path. */
#ifndef QTRAIN_QUANT_QLAYER_INT8_H
#define QTRAIN_QUANT_QLAYER_INT8_H

#include <stdbool.h>

#include "nn/ops.h"
#include "nn/tape.h"
#include "quant/qlayer.h"

/* Layers with fewer multiply-adds run on one thread (default 4e6); tests set 0 to split every layer. */
extern double qlayer_int8_parallel_min_macs;

/* The int8 hand-off (default on; tests turn it off to compare): in a forward without gradients, an int8 conv2d
 * whose output int8 conv2ds of one input quantizer read (Tape.handoff) makes their input codes itself, from its
 * output while it is in cache, instead of a float output each reader quantizes: y's Var.codes, the same codes (a
 * plain conv whose output merges read too keeps its floats as well: VarCodes.floats); one that a globalavgpool
 * alone reads makes the planes' means the same way (Var.means). */
extern bool qlayer_int8_handoff;
/* Stride-2 conv2ds over whole channel quads read the image's four phases, as stride 1 reads its plane (default
 * on; tests turn it off, then qlayer_int8_release each layer, to compare with the columns the others build). */
extern bool qlayer_int8_phases;
/* A conv2d handing its codes to one int8 conv2d runs in one pass with it, image by image (default on; tests turn it
 * off to compare): see qlayer_int8.c, "the chain of hand-offs". */
extern bool qlayer_int8_chain;
/* Padded conv2ds on ch4 planes and conv2ds on ph4 take codes handed to them as channel quads (default on; tests
 * turn it off to reach the bytes that readers of different layouts share). */
extern bool qlayer_int8_handoff_quads;
/* Layers run in chains since start, and the chains (for tests). */
extern unsigned long qlayer_int8_chained, qlayer_int8_chains;
/* Whether q, read in this forward, takes the int8 path from codes (a conv2d, plain or one input channel per
 * group); if so, the codes its input quantizer makes in c (c->data unset), for an input of shape (N, C, H, W)
 * (shape[1..3] read): by channel quads (c->plane) where q is a conv on ch4 or ph4 planes and they fit the value's
 * buffer (an unpadded stride-1 conv's own planes, the others' a 1 x 1 conv's), else bytes. */
bool qlayer_int8_reads_codes(const Tape *t, const QLayer *q, const int *shape, VarCodes *c);

/* Whether this forward of q on x takes the int8 path: supported formats, a
 * calibrated range, not calibrating, and no gradient to record. */
bool qlayer_int8_applies(const Tape *t, const QLayer *q, const Var *x, const Var *bias);

/* y (N, out) from x (N, fan_in), shapes checked by the caller. */
Var *qlayer_int8_dense(Tape *t, QLayer *q, Var *x, Var *bias);
/* y (N, OC, OH, OW) from x (N, C, H, W), shapes checked by the caller. */
Var *qlayer_int8_conv(Tape *t, QLayer *q, Var *x, Var *bias, int OH, int OW);
/* The same with the following relu (and 2x2 max pool) folded in: y (N, OC, OH, OW), or (N, OC, OH/2, OW/2) for
 * CONV_EPI_RELU_MAXPOOL2 (OH, OW >= 2), bit for bit qlayer_int8_conv, then nn_relu (then nn_maxpool2d(2, 2)).
 * res (N, OC, OH, OW) or NULL: a residual summed in before the epilogue (NONE or RELU), bit for bit
 * qlayer_int8_conv, then nn_add(conv, res), then nn_relu; each image's sum made while its output is in cache.
 * hand (or NULL): y as these codes (qlayer_int8_reads_codes of its reader), unless y has fewer than 16 values;
 * means (for a globalavgpool that alone reads y): y's Var.means instead of its values, which stay unwritten.
 * x may be codes handed over (Var.codes), then q's own. */
Var *qlayer_int8_conv_fused(Tape *t, QLayer *q, Var *x, Var *bias, int OH, int OW, ConvEpilogue epi, const Var *res,
                            const VarCodes *hand, bool means);

/* A conv2d that is not plain but takes the int8 path (qlayer_int8_supported): one input channel per output
 * channel, depthwise. y (N, OC, OH, OW) from x (N, C, H, W) under the module's geometry (per-axis stride and
 * padding, 'same'), x's shape checked here; epi, hand and x's codes as qlayer_int8_conv_fused (the max pool needs
 * OH, OW >= 2), except that it hands nothing off when merges read its output too (Tape.handoff_keep). */
Var *qlayer_int8_conv_dw(Tape *t, QLayer *q, Var *x, Var *bias, ConvEpilogue epi, const VarCodes *hand, bool means);

#endif
