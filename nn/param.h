/* param.h - a named parameter: lives for the whole run.
 *
 * A trainable parameter owns a grad buffer the same size as its value; a
 * frozen one (e.g. a LoRA base) has grad == NULL and gets no optimizer
 * state. */
#ifndef QTRAIN_NN_PARAM_H
#define QTRAIN_NN_PARAM_H

#include <stdbool.h>

#include "tensor.h"

#define PARAM_NAME_MAX 64

typedef struct {
    char name[PARAM_NAME_MAX]; /* "<module path>/<tensor>", e.g. "conv1/weight" */
    Var var;                   /* value [numel]; grad [numel] or NULL if frozen;
                                  var.is_param = true */
    bool trainable;            /* == var.requires_grad == (var.grad != NULL). Change
                                  all three together, only through param_freeze()
                                  and param_unfreeze() (nn/model.h). */
    bool released;             /* param_release(): the value lives elsewhere (a quantized
                                  base holds the weight as a QArray); value.data == NULL,
                                  the shape stays, checkpoints do not store it here */
} Param;

#endif
