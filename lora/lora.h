/* lora.h - LoRA adapters on dense and conv2d modules.
 *
 *   y = base(x) + scale * B(A(dropout(x))),  scale = alpha / rank
 *                                            (rslora: alpha / sqrt(rank))
 *
 * Dense: A (rank, in), B (out, rank): the adapter path is x A^T B^T.
 * Conv2d: A is a convolution with the base kernel's size, stride and
 * padding from C into rank channels, weight (rank, C, KH, KW); B is a 1x1
 * convolution from rank into OC channels, weight (OC, rank, 1, 1). Neither
 * has a bias. The adapter's weight delta in the base's layout is
 * scale * B A: (out, in), or (OC, C*KH*KW) reshaped to (OC, C, KH, KW)
 * (a 1x1 conv after a conv is one conv with the product kernel), which is
 * what merging adds.
 *
 * Init (Hu et al. 2021; PEFT's defaults): `default` draws A from
 * U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in or C*KH*KW
 * (kaiming-uniform with a = sqrt(5)), and sets B = 0, so a fresh adapter
 * leaves the base's output unchanged. `gaussian` draws A from
 * N(0, (1/rank)^2) (std 1/rank, as PEFT does) and B = 0. `pissa` and
 * `loftq` take A and B from a truncated SVD of the base weight and change
 * the base with them (lora_svd.h); they need the float weight, on a fresh
 * start only (the net's LoRA hook runs them, trainer/hook_lora.c), and are
 * refused on grouped convs (B would have to be block-diagonal).
 *
 * Dropout acts on the adapter's input only, and only in training (the
 * tape's training flag and rng, as nn_dropout).
 *
 * The base is whatever the module computed before the adapter was
 * installed: its own float op (a frozen float weight) or the forward hook
 * already in place (a quantized base, quant/qlayer.h).
 *
 * A spec with dora makes the adapter DoRA's (lora_dora.h): a learned
 * magnitude per output channel over the direction of W + scale B A. */
#ifndef QTRAIN_LORA_LORA_H
#define QTRAIN_LORA_LORA_H

#include <stdbool.h>
#include <stddef.h>

#include "base/error.h"
#include "nn/model.h"
#include "nn/param.h"
#include "base/rng.h"
#include "nn/tape.h"

typedef enum { LORA_INIT_DEFAULT = 0, LORA_INIT_GAUSSIAN, LORA_INIT_LOFTQ, LORA_INIT_PISSA, LORA_INIT_COUNT } LoraInit;

/* pissa, loftq: A and B from an SVD of the base weight, which they change. */
static inline bool lora_init_is_svd(LoraInit init) { return init == LORA_INIT_LOFTQ || init == LORA_INIT_PISSA; }

/* One rule's resolved adapter settings (lora.rules[i] of the config). */
typedef struct {
    int rank;        /* >= 1 and <= min(out, fan_in) of the module */
    float alpha;     /* > 0; default = rank (scale 1) is the config's choice */
    float dropout;   /* in [0, 1) */
    bool rslora;     /* scale alpha / sqrt(rank) */
    LoraInit init;
    bool dora;       /* DoRA (lora_dora.h): a learned magnitude per output channel over the direction of W + scale B A */
} LoraSpec;

/* The base weight as floats (a quantized base dequantized): w [out * fan_in]. */
typedef void (*LoraBaseWeightFn)(const void *ctx, float *w);

typedef struct {
    Module *module;            /* dense or conv2d; not owned */
    LoraSpec spec;
    float scale;               /* alpha / rank, or alpha / sqrt(rank) */
    int out, fan_in;           /* the base weight as a matrix (out, fan_in) */
    Param A;                   /* "<path>/lora_A": dense (rank, in); conv (rank, C/groups, KH, KW) */
    Param B;                   /* "<path>/lora_B": dense (out, rank); conv (OC, rank/groups, 1, 1) */
    ModuleForwardFn base_fn;   /* the base's forward hook when installed, or NULL: the module's own op */
    void *base_ctx;
    bool installed;
    /* pissa / loftq: the init's relative residual ||W - (Q + scale B A)||_F / ||W||_F and the default init's
       (B = 0), lora_svd.h; kept with the adapter in checkpoints */
    bool init_reported;
    double init_rel_error, init_default_rel_error;
    Param M;                   /* DoRA only: "<path>/lora_magnitude" (out); unallocated otherwise */
    LoraBaseWeightFn base_weight; /* DoRA over a quantized base: its dequantized weight; NULL: the module's weight */
    const void *base_weight_ctx;
} LoraAdapter;

/* "default", "gaussian", "loftq", "pissa"; "unknown" outside the enum. */
const char *lora_init_name(LoraInit init);
/* Case-insensitive; QT_ERR_ARG listing the valid names otherwise. */
QtStatus lora_init_parse(const char *name, LoraInit *out, QtError *err);

/* Checks spec against module m (dense or conv2d with a weight; rank in
 * 1..min(out, fan_in) naming both dimensions; alpha > 0; dropout in
 * [0, 1)). Messages start with the module path. */
QtStatus lora_spec_check(const LoraSpec *spec, const Module *m, QtError *err);

/* The adapter's scale: alpha / rank, or alpha / sqrt(rank) with rslora. */
float lora_spec_scale(const LoraSpec *spec);

/* Allocates A and B (trainable, zeroed) for module m after
 * lora_spec_check. On error a is left zeroed. */
QtStatus lora_adapter_init(LoraAdapter *a, Module *m, const LoraSpec *spec, QtError *err);
void lora_adapter_free(LoraAdapter *a);
/* A per spec.init from rng (rank * fan_in draws, in A's row-major order),
 * B = 0; pissa and loftq draw as default (the caller then sets A and B), so
 * the other adapters' draws do not depend on them. */
void lora_adapter_init_params(LoraAdapter *a, Rng *rng);

/* Saves the module's current forward hook as the base and makes the
 * adapter the module's forward. Install at most once. */
void lora_adapter_install(LoraAdapter *a);
/* base(x) + scale * B(A(dropout(x))), x and y as the module's (DoRA:
 * lora_dora_forward). */
Var *lora_adapter_forward(Tape *t, LoraAdapter *a, Var *x);
/* The adapter's branch without the scale: B(A(xd)), xd the adapter's
 * (dropped-out) input, shaped as the module's output. */
Var *lora_adapter_branch(Tape *t, LoraAdapter *a, Var *xd);

/* delta [out * fan_in] = scale * B A, in the base weight's layout (a DoRA
 * adapter's merged weight is no sum: lora_dora_merge). */
void lora_adapter_delta(const LoraAdapter *a, float *delta);
/* w [out * fan_in] += the delta: folds the adapter into a float weight
 * (DoRA: w = its merged weight, lora_dora_merge). */
void lora_adapter_merge(const LoraAdapter *a, float *w);

/* Parameters of A and B (and a DoRA magnitude) together. */
size_t lora_adapter_param_count(const LoraAdapter *a);

/* Adds to *macs the multiply-adds per example the adapter puts into a
 * training step, in the fewest a step needs; products made once per batch
 * (which do not grow with it) are left out. fan = C/groups * KH * KW (conv)
 * or in (dense); r = rank, g = groups (1 for dense); per output position:
 *   conv2d: the forward and the input gradient run on the merged weight
 *     w + scale B A (formed once per batch, ops_conv_lowrank.c), so the
 *     adapter adds A col (r fan, forward: kept for dB), dt = scale B^T dy
 *     (OC r/g, input gradient: for dA), dA (r fan) and dB (OC r/g); or,
 *     when that is more than the module's full weight gradient (OC fan: a
 *     first conv's few input taps), that gradient, from which dA and dB
 *     follow once per batch (nothing more when the weight trains anyway:
 *     weight_grad).
 *   dense: its own products, as lora_adapter_forward runs them: x A^T
 *     (r in) and h B^T (out r) forward, dh = dy B (out r) and, when the
 *     module's input needs a gradient (input_grad), dh A (r in); dA (r in)
 *     and dB (out r). Merging would cost out in r a batch: at batch sizes
 *     near in out / (in + out) as much as it saves. */
void lora_adapter_macs(const LoraAdapter *a, bool input_grad, bool weight_grad, StepMacs *macs);

#endif
