/* optim.h - SGD and AdamW over an array of parameters.
 *
 * The update rules follow PyTorch 1.13's single-tensor path (foreach=False)
 * operation by operation: per-step scalars in double, per-element arithmetic
 * in float, in the same order, so a qtrain run tracks a PyTorch run of the
 * same model to float rounding.
 *
 * All state is allocated by optim_init; optim_step never allocates, so the
 * training loop's steady state stays malloc-free. */
#ifndef QTRAIN_NN_OPTIM_H
#define QTRAIN_NN_OPTIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"
#include "param.h"

typedef enum { OPTIM_SGD, OPTIM_ADAMW } OptimKind;

typedef struct {
    OptimKind kind;
    float lr;                  /* base learning rate; the schedule gives each step's lr */
    float weight_decay;        /* SGD: L2 added to the gradient (PyTorch SGD); AdamW: decoupled p -= lr*wd*p */
    float beta1, beta2, eps;   /* AdamW */
    float momentum, dampening; /* SGD */
    bool nesterov;             /* SGD */
} OptimConfig;

/* PyTorch's defaults: AdamW lr 1e-3, betas 0.9/0.999, eps 1e-8, wd 0.01;
 * SGD lr 0.01, momentum 0, dampening 0, wd 0, no nesterov. */
OptimConfig optim_config_default(OptimKind kind);
/* "sgd", "adamw"; "unknown" for a value outside the enum. */
const char *optim_kind_name(OptimKind kind);
/* Case-insensitive. QT_ERR_ARG, with the valid names in the message, if
 * `name` is not one of them. */
QtStatus optim_kind_parse(const char *name, OptimKind *out, QtError *err);

typedef struct {
    OptimConfig cfg;
    int n_params;       /* trainable params only */
    Param **params;     /* [n_params], not owned */
    float **m;          /* [n_params][numel]: AdamW first moment / SGD momentum buffer;
                           NULL for SGD without momentum (PyTorch keeps no buffer either) */
    float **v;          /* [n_params][numel]: AdamW second moment; NULL for SGD */
    float *lr_scale;    /* [n_params] each param's lr = the step's lr * lr_scale (1 unless set) */
    int64_t step;       /* optimizer steps taken (AdamW bias correction uses step after increment) */
} Optimizer;

/* Checks the config (QT_ERR_CONFIG, message naming the field) and the params
 * (QT_ERR_ARG), keeps the trainable ones, and allocates their state zeroed.
 * Frozen params get no state and are never touched. On failure `o` is left
 * zeroed, so optim_free is always safe. */
QtStatus optim_init(Optimizer *o, const OptimConfig *cfg, Param *const *params, int n_params, QtError *err);
void optim_free(Optimizer *o);

/* One update of every trainable param from its grad, with this step's lr
 * (from the schedule; cfg.lr is not used here). No allocation. */
void optim_step(Optimizer *o, float lr);
/* Gives p its own learning rate, `scale` times the schedule's (e.g. learned
 * quantization ranges with their own lr). QT_ERR_ARG if p is not one of the
 * optimizer's params or scale is not finite and >= 0. */
QtStatus optim_set_lr_scale(Optimizer *o, const Param *p, float scale, QtError *err);
/* Zeroes every trainable param's grad buffer. */
void optim_zero_grad(Optimizer *o);

/* torch.nn.utils.clip_grad_norm_ (L2): the global norm over the grads of the
 * trainable params in `params` (accumulated in double); if max_norm > 0 and
 * max_norm / (norm + 1e-6) < 1, every such grad is scaled by that factor.
 * Returns the norm before clipping (Inf/NaN if a grad is not finite). */
double optim_clip_grad_norm(Param *const *params, int n_params, float max_norm);
/* Its two halves, for a caller that looks at the norm before clipping:
 * the norm (non-finite exactly when a grad is), then the scaling by
 * max_norm / (norm + 1e-6) when that is below 1 (nothing if max_norm <= 0). */
double optim_grad_norm(Param *const *params, int n_params);
void optim_clip_grads_to_norm(Param *const *params, int n_params, double norm, float max_norm);

/* Bytes of moment/momentum buffers held (not counting the pointer arrays). */
size_t optim_state_bytes(const Optimizer *o);

#endif
