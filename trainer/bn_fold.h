/* bn_fold.h - batch norm folding for a PTQ model: each batch norm that
 * alone reads a conv2d's or dense layer's output becomes part of that layer
 * (eval form, running statistics), so the folded weight is what gets
 * quantized, per output channel. */
#ifndef QTRAIN_TRAINER_BN_FOLD_H
#define QTRAIN_TRAINER_BN_FOLD_H

#include <stdbool.h>
#include <stddef.h>

#include "nn/model.h"

#define BN_NOTE_MAX 128 /* a batch norm's cell of the rules table */

typedef struct Net Net;

/* Folds batch norm `bn` into `producer` (a conv2d or dense whose output bn
 * normalises, weight held in float): with s = gamma / sqrt(var + eps) per
 * output channel, w' = w * s and b' = (b - mean) * s + beta (b = 0 without a
 * bias). b' goes to the producer's bias, or, when it has none, to bn's own
 * bias (bn then adds it: BN_FOLD_BIAS); bn passes its input on from then on,
 * in training and eval alike. bn's statistics become mean 0, var 1 and its
 * weight 1, so the folded model's checkpoint holds no stale normalisation.
 * Needs producer->bias or bn->bias (bn_fold_check). Arithmetic in double. */
void bn_fold_into(Module *producer, Module *bn);

/* Whether batch norm module `bn` of m can fold by the model alone: it reads
 * one conv2d or dense whose output nothing else reads, and the shift has a
 * bias to live in. If not, why[cap] says so ("conv1's output also feeds
 * add1"). */
bool bn_fold_check(const Model *m, int bn, char *why, size_t cap);

/* Whether the run folds batch norm module i (quant.fold_bn, bn_fold_check,
 * and the run keeping neither it nor its producer as they are: trained in
 * full, under a LoRA adapter, or held quantized by model.init_from); if
 * not, note[BN_NOTE_MAX] says why, starting "<path>: ". Shared by ptq
 * (net_fold_batchnorms) and qat (the folded QAT form, hook_qat.c). */
bool net_bn_foldable(const Net *n, int i, char *note);

/* quant.fold_bn in a ptq run: folds every batch norm that can fold whose
 * producer still holds its float weight (before the PTQ base quantizes it),
 * and notes per batch norm in n->bn_note what happened (for the rules
 * table). A batch norm already folded (read so from a checkpoint) stays so. */
void net_fold_batchnorms(Net *n);

#endif
