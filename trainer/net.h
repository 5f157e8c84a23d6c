/* net.h - the model a config describes, with its quantized base layers and
 * LoRA adapters attached by the config's rules.
 *
 * Building resolves, for every dense/conv2d module, the first quant rule and
 * the first lora rule that apply (trainer/rules.h), checks each resolved
 * setting against the module (format, tile, rank), and records rules that
 * applied to nothing. With quant or lora in use, the model's own
 * parameters are frozen, except those of lora.trainable modules and, with
 * lora.batchnorm: train, of batch norms; the optimizer gets the adapters
 * and those modules only. */
#ifndef QTRAIN_TRAINER_NET_H
#define QTRAIN_TRAINER_NET_H

#include <stdbool.h>
#include <stdio.h>

#include "lora/lora.h"
#include "lora/lora_svd.h"
#include "nn/model.h"
#include "nn/optim.h"
#include "quant/qat.h"
#include "quant/fqt.h"
#include "quant/qlayer.h"
#include "trainer/bn_fold.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/hook.h"

typedef enum {
    NET_FRESH,    /* parameters from the seed, then model.init_from (quantized here, or a PTQ base as stored),
                     then model.adapters_from */
    NET_SHELL,    /* layouts only: a checkpoint fills every value (resume, eval, merge) */
    NET_FRESH_TIMING, /* NET_FRESH, but a PTQ base without model.init_from is the seed's initialisation,
                         quantized: for measuring speed only (qtrain bench) */
} NetInit;

/* A fresh start's pissa or loftq init of one module (lora_svd.h): computed
 * where the base is quantized (the PTQ hook, which then releases the float
 * weight) and taken by the LoRA hook, or by the LoRA hook itself on a float
 * base. */
typedef struct {
    float *ab;             /* A [rank * fan_in] then B [out * rank] staged for the adapter; NULL once taken or none */
    bool ran;              /* report holds this module's init */
    LoraInitReport report;
} NetLoraInit;

typedef struct Net {
    const Config *cfg;
    Model model;
    HookLayers hooks;         /* the hook layers the rules attached, a set per kind (trainer/hook.h: ptq quantized
                                 base layers, lora adapters, qat and qt trained quantizers), each in module order */
    bool base_from_seed;      /* NET_FRESH_TIMING: a PTQ base without init_from quantizes the initialisation */
    Param **trainable;        /* [n_trainable] what the optimizer updates: adapters' A, B and lora.trainable
                                 modules' params (all params in a float or qat run, with qat's learned
                                 ranges) */
    int n_trainable;
    int *quant_rule;          /* [n_modules] rule index per module, -1 = none applied */
    int *lora_rule;           /* [n_modules] */
    bool *is_trainable;       /* [n_modules] listed in lora.trainable */
    bool *bn_trained;         /* [n_modules] net_bn_trains: a batch norm whose statistics and affine parameters
                                 train (adapters.h5 keeps them) */
    char (*bn_note)[BN_NOTE_MAX]; /* [n_modules] a batch norm's fold in a ptq run ("bn1: folded into conv1", "bn1: not
                                 folded: conv1's output also feeds add1"), "" until net_fold_batchnorms */
    NetLoraInit *lora_init;   /* [n_modules] pissa / loftq inits of a fresh start (NULL: none ran) */
    int quant_hits[RULES_MAX];
    int lora_hits[RULES_MAX];
} Net;

/* Builds n from c. NET_FRESH needs model.init_from with quant.mode ptq
 * (NET_FRESH_TIMING does not).
 * Every error names the module, the rule or the file. */
QtStatus net_build(Net *n, const Config *c, NetInit how, QtError *err);
/* model.adapters_from `path` against n's base (net_build calls it with
 * stderr before loading the adapters): the file's base_sha256 against
 * checkpoint_base_sha256 of n. Another base is a warning to `warn` naming
 * both hashes and init_from paths (QT_ERR_CONFIG with lora.strict_base); a
 * file without the identity loads with a warning that the base cannot be
 * checked. On a model with batch norms, a file written under another
 * lora.batchnorm is QT_ERR_CONFIG (its batch norms were trained or were the
 * base's). */
QtStatus net_check_adapters_base(const Net *n, const char *path, FILE *warn, QtError *err);
void net_free(Net *n);

/* A fresh start's pissa / loftq init of the module q quantizes (the PTQ
 * hook calls it instead of quantizing W itself): q becomes the init's
 * quantized base (quantized with qlayer_init_quantize_rng from *round_rng,
 * as the hook would), A and B are staged for the LoRA hook. */
QtStatus net_lora_init_quantized(Net *n, QLayer *q, const Rng *round_rng, QtError *err);
/* One line per module a pissa / loftq init ran on in this process:
 * "lora_init: module=conv1 init=loftq iters=5 rel_error=... default_rel_error=... iter_errors=a,b,..."
 * (the relative Frobenius errors of lora_svd.h); nothing if none ran. */
void net_print_lora_init(const Net *n, FILE *out);

/* Whether module `module` is a batch norm whose statistics and affine
 * parameters train: always in a run without a frozen base (float, qat, qt);
 * under one (ptq, lora) when listed in lora.trainable, or in a LoRA run
 * with lora.batchnorm: train. */
bool net_bn_trains(const Net *n, int module);

/* The hook layers for checkpoints (n->hooks). */
CheckpointNet net_checkpoint_parts(const Net *n);

/* Gives learned quantization ranges with their own `lr` in their rule that
 * lr (as a factor of the optimizer's base lr). */
QtStatus net_set_range_lrs(const Net *n, Optimizer *o, float base_lr, QtError *err);

/* QT_ERR_VALUE naming the module, the range and `step` if a learned
 * quantization range is not finite (NaN/Inf after an update). */
QtStatus net_check_ranges(const Net *n, int64_t step, QtError *err);

/* The training step the next training forward belongs to (QAT's
 * stochastic weight rounding draws that step's noise: qat_layer_set_step). */
void net_set_step(Net *n, int64_t step);

/* "float", "ptq", "lora", "qlora", "qat" (the summary's mode). */
const char *net_mode_name(const Net *n);

/* Counts: parameters the optimizer trains, and the frozen base's (quantized
 * weights counted by element). */
size_t net_params_trainable(const Net *n);
size_t net_params_frozen(const Net *n);
/* Multiply-adds per training example of one training step's products
 * (model_module_macs for dense and conv2d, the adapters' by
 * lora_adapter_macs): the forward of every module; input gradients of the
 * modules whose input needs one, i.e. some trainable parameter (a weight,
 * a bias, an adapter, a learned range) comes before it (none for a first
 * layer reading the data); weight gradients of the weights that train (a
 * frozen base's do not). Counted from the shapes, not timed: qtrain bench
 * divides the measured sgemm rate by it for the step's GEMM-bound limit. */
QtStatus net_step_macs(const Net *n, StepMacs *macs, QtError *err);
/* Bytes held for the model: float params not released + quantized weights +
 * adapters. */
size_t net_model_bytes(const Net *n);
/* Bytes of the frozen base (quantized weights in their storage + frozen
 * float params) * 8 / its parameter count: the base's bits per parameter. */
double net_base_bits_per_param(const Net *n);

/* The distinct formats of the base's weights and of its quantized inputs,
 * comma-separated in module order: e.g. "nf4/32+dq,nf4/64+dq" (a block
 * size, "ch" per output channel, "t" per tensor, "+dq" double-quantized
 * scales), "float32" for a float base, "none" for float inputs. */
void net_format_summary(const Net *n, char *weights, size_t wcap, char *acts, size_t acap);

/* Static activation calibration over `batches` forward passes driven by the
 * caller: begin, then forward passes, then end. */
void net_calib_begin(Net *n);
QtStatus net_calib_end(Net *n, QtError *err);
/* Whether any quantized layer has a static activation range to calibrate. */
bool net_needs_act_calibration(const Net *n);

/* The path the PTQ layers with int8 weights and inputs evaluate on
 * (qlayer_int8_kernel: "amx", "vnni", "avxvnni", "avx2", "portable",
 * "float-emulated"), or "none" when no layer qualifies. QTRAIN_INT8_KERNEL
 * (amx, vnni, avxvnni, avx2, portable, float, auto), read once by the qtrain binary at start, forces the choice
 * (qlayer_int8_kernel_select). */
const char *net_int8_kernel(const Net *n);
/* How many PTQ layers have int8 weights and inputs (*with_int8) and how many of them take the integer kernels
 * (*on_kernel); the others are dilated, grouped (several input channels per group) or per-axis convs, which run
 * on their dequantized weights. */
void net_int8_layers(const Net *n, int *on_kernel, int *with_int8);

/* The per-module table (which rule applied and what it resolved to), and
 * for a PTQ base its int8_kernel line. */
void net_print_table(const Net *n, FILE *out);
/* One warning line per rule that applied to no module, and per rule that
 * lets an unsigned format clip negatives (allow_clip); returns the count. */
int net_print_unused_rules(const Net *n, FILE *out);

#endif
