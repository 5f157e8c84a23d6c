/* config.h - the run configuration: YAML (libyaml) into typed structs.
 *
 * A config file has the sections run, data, model, train, and optionally
 * quant (a post-training-quantized base) and lora (adapters). Every key has a default except model.input and
 * model.layers. Loading checks everything a run needs before any data is
 * read: types, ranges, names, required layer fields, and that the layers'
 * shapes chain (a dry model_init). Every error is QT_ERR_CONFIG (QT_ERR_IO
 * for an unreadable file) with a message of the form
 *   configs/x.yaml:12:7: train.optimizer.lr: expected a number >= 0, got "fast"
 *   configs/x.yaml:9:3: train: unknown key 'batchsize' (did you mean 'batch_size'?)
 * and, for a --set override, "--set train.lr=...:" in place of file:line:col.
 *
 * config_to_yaml() writes the resolved config (every key, defaults filled
 * in); loading that text gives back the same Config. It is printed at the
 * start of a run and stored in every checkpoint.
 *
 * Every key is one row of the schema (trainer/config_table.c), which the
 * loader, the defaults, config_to_yaml, the resume comparison and
 * docs/CONFIG.md (config_doc_markdown) all follow. */
#ifndef QTRAIN_TRAINER_CONFIG_H
#define QTRAIN_TRAINER_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "data/augment.h"
#include "data/dataset.h"
#include "lora/lora.h"
#include "base/error.h"
#include "nn/model.h"
#include "nn/optim.h"
#include "nn/schedule.h"
#include "quant/qat.h"
#include "quant/qlayer.h"
#include "quant/fqt.h"
#include "trainer/rules.h"

#define CONFIG_PATH_MAX 1024
#define CONFIG_NAME_MAX 64
#define CONFIG_MAX_LAYERS 64
#define CONFIG_MAX_TRANSFORMS 16

typedef struct {
    char name[CONFIG_NAME_MAX];     /* run.name, default "run" */
    char out_dir[CONFIG_PATH_MAX];  /* run.out_dir, default "runs/<name>" */
    uint64_t seed;                  /* run.seed, default 1 */
    int threads;                    /* run.threads, default 0 = all cores */
} RunConfig;

/* data.target: what the model is trained to output. */
typedef enum {
    DATA_TARGET_LABEL = 0, /* the data set's class labels, or its value targets when it has those (the default) */
    DATA_TARGET_INPUT,     /* the (normalized) input itself: an autoencoder */
    DATA_TARGET_COUNT
} DataTarget;

extern const char *const DATA_TARGET_NAMES[DATA_TARGET_COUNT]; /* "label", "input" */

/* data.files: the four files of an npy or idx data set. */
typedef struct {
    char train_x[CONFIG_PATH_MAX], train_y[CONFIG_PATH_MAX], test_x[CONFIG_PATH_MAX], test_y[CONFIG_PATH_MAX];
} DataFiles;

typedef struct {
    char dataset[CONFIG_NAME_MAX];  /* data.dataset: "fashion-mnist" (default), "hdf5", "npy", "idx" */
    char dir[CONFIG_PATH_MAX];      /* data.dir, default /usr/share/datasets/fashion-mnist */
    char path[CONFIG_PATH_MAX];     /* data.path: the HDF5 file of data.dataset: hdf5 */
    DataFiles files;                /* data.files: npy and idx data sets */
    int max_memory_mb;              /* data.max_memory_mb, default 512: an HDF5 data set larger than this is read
                                       per batch (data.storage: auto) */
    char cache_dir[CONFIG_PATH_MAX]; /* data.cache_dir: where inflated copies of gzip'd data files are kept
                                        (idx_cache_init); default "" = $XDG_CACHE_HOME/qtrain, else
                                        ~/.cache/qtrain; "none" = no cache */
    DataStorage storage;            /* data.storage, default auto: images read from the uncompressed file at every
                                       batch when there is one (file), else held in memory */
    Transform transforms[CONFIG_MAX_TRANSFORMS]; /* data.transform, in order */
    int n_transforms;
    AugmentList augment;            /* data.augment: random augmentation of training batches, in order */
    double val_fraction;            /* data.val_fraction in [0, 1), default 0 */
    bool shuffle;                   /* data.shuffle, default true */
    bool drop_last;                 /* data.drop_last, default false */
    DataTarget target;              /* data.target, default label */
    int anomaly_classes[DATASET_MAX_CLASSES]; /* data.anomaly_classes: labels dropped from train and val, kept in
                                                 test as the positives of the AUC (needs data.target: input) */
    int n_anomaly_classes;          /* 0 = none */
} DataConfig;

typedef struct {
    int input_ndim, input_shape[3]; /* model.input: [C, H, W] or [features] */
    LayerSpec layers[CONFIG_MAX_LAYERS]; /* model.layers */
    int n_layers;
    char init_from[CONFIG_PATH_MAX]; /* model.init_from, "" = none: a checkpoint (float, or a PTQ one from
                                        `qtrain quantize`) whose parameters start a fresh run */
    char adapters_from[CONFIG_PATH_MAX]; /* model.adapters_from, "" = none: a checkpoint or adapters.h5 whose
                                            /lora adapters (and lora.trainable modules) start a fresh run */
} ModelConfig;

/* train.on_nonfinite: what a step with a non-finite loss or gradient does. */
typedef enum {
    NONFINITE_STOP = 0, /* stop the run with the step, module and tensor named (the default) */
    NONFINITE_SKIP,     /* drop that step's update, count it and go on */
    NONFINITE_COUNT
} NonfiniteAction;

extern const char *const NONFINITE_ACTION_NAMES[NONFINITE_COUNT]; /* "stop", "skip" */

/* train.loss. */
typedef enum {
    LOSS_CROSS_ENTROPY = 0, /* softmax cross-entropy against class labels (the default) */
    LOSS_MSE,               /* mean squared error against value targets or the input, mean over every value */
    LOSS_COUNT
} LossKind;

extern const char *const LOSS_KIND_NAMES[LOSS_COUNT]; /* "cross_entropy", "mse" */

typedef struct {
    int64_t epochs;                 /* train.epochs, default 1, at most 10^6; 0 = evaluate only */
    int64_t steps;                  /* train.steps, default 0 = from epochs; overrides epochs when > 0; <= 10^12 */
    int batch_size;                 /* train.batch_size, default 64 */
    int eval_batch_size;            /* train.eval_batch_size, default 256 */
    LossKind loss;                  /* train.loss, default cross_entropy */
    OptimConfig optim;              /* train.optimizer: name, lr, weight_decay, betas, eps,
                                       momentum, dampening, nesterov */
    LrSchedule schedule;            /* train.schedule: name, warmup_steps, min_lr, step_size, gamma;
                                       base_lr and total_steps are filled in by the trainer */
    float grad_clip;                /* train.grad_clip, default 0 = off */
    bool sync_bn;                   /* train.sync_bn: batch statistics over every rank's part (dist.h) */
    int64_t eval_every;             /* train.eval_every (steps), default 0 = at the end only */
    int64_t log_every;              /* train.log_every (steps), default 50; 0 = only the last step */
    int64_t checkpoint_every;       /* train.checkpoint_every (steps), default 0 = final only */
    int keep_last;                  /* train.keep_last, default 3; 0 = keep all */
    NonfiniteAction on_nonfinite;   /* train.on_nonfinite, default stop */
    float divergence_factor;        /* train.divergence_factor, default 2; 0 = off, else > 1 (trainer/guard.h) */
} TrainConfig;

typedef enum {
    QUANT_MODE_NONE = 0, /* float32 */
    QUANT_MODE_PTQ,      /* frozen post-training-quantized base (quant/qlayer.h) */
    QUANT_MODE_QAT,      /* fake-quantized weights and inputs in training (quant/qat.h) */
    QUANT_MODE_QT,       /* quantized forward GEMMs and quantized backward (quant/fqt.h) */
    QUANT_MODE_COUNT
} QuantMode;

/* quant.rules[i] */
typedef struct {
    RuleMatch match;    /* module_path, op_types */
    bool skip;          /* skip: true: matching modules stay float (and later rules are not consulted) */
    bool allow_clip;    /* allow_clip: symmetric / act_symmetric true with an unsigned format (negatives clip to 0) */
    QLayerSpec spec;    /* weight_qtype ("none" = NULL: float), tile_size, per_tensor, weight_calibration,
                           symmetric, narrow_range, scale_type, double_quant, rounding, act_qtype, act_calibration,
                           act_symmetric */
    QatSpec qat;        /* qat mode only: learn_amax, amax_init, act_static_scale, lr */
    FqtSpec qt;          /* qt mode only: bwd_qtype, bwd_calibration, bwd_weight_grad_tile_size,
                           bwd_stochastic_rounding, channelwise_noise_axes (formats from spec) */
} QuantRule;

typedef struct {
    QuantMode mode;             /* quant.mode: none | ptq | qat | qt, default none */
    int calibration_batches;    /* quant.calibration_batches, default 16: training batches that calibrate
                                   static activation ranges (act_qtype) */
    bool fold_bn;               /* quant.fold_bn, default true: ptq folds batch norms into the layer before them */
    int freeze_bn_after;        /* quant.freeze_bn_after, default 0 (never): qat's folded batch norms use and stop
                                   updating their running statistics from this training step on */
    QuantRule rules[RULES_MAX]; /* quant.rules, in order; first match wins */
    int n_rules;
} QuantConfig;

/* lora.batchnorm: what a LoRA run (lora.rules or lora.trainable over a frozen base) does with the base's batch
 * norms. A batch norm listed in lora.trainable trains in full either way. */
typedef enum {
    LORA_BN_FROZEN = 0, /* running statistics in training too, never updated; weight and bias frozen */
    LORA_BN_TRAIN,      /* as in a float run: batch statistics, running statistics updated, weight and bias trained
                           (adapters.h5 keeps them) */
    LORA_BN_COUNT
} LoraBatchnorm;
extern const char *const LORA_BATCHNORM_NAMES[LORA_BN_COUNT]; /* "frozen", "train" */

/* lora.rules[i] */
typedef struct {
    RuleMatch match;
    bool skip;          /* skip: true: matching modules get no adapter */
    LoraSpec spec;      /* rank (required), alpha (default = rank), dropout (0), rslora (false), init (lora.init) */
} LoraRule;

typedef struct {
    LoraRule rules[RULES_MAX];  /* lora.rules, in order; first match wins; empty = no adapters */
    int n_rules;
    char trainable[CONFIG_MAX_LAYERS][MODULE_NAME_MAX]; /* lora.trainable: modules trained in full (float,
                                                           unquantized, no adapter), e.g. a new head */
    int n_trainable;
    bool strict_base;           /* lora.strict_base, default false: model.adapters_from over another base (its
                                   stored base_sha256 differs from this run's) is an error, not a warning */
    LoraBatchnorm batchnorm;    /* lora.batchnorm, default frozen: the base's batch norms under adapters */
    LoraInit init;              /* lora.init, default default: the init of the rules that give none */
    int loftq_iters;            /* lora.loftq_iters, default 5: LoftQ's alternations (1..LORA_LOFTQ_ITERS_MAX) */
} LoraConfig;

typedef struct {
    char source[CONFIG_PATH_MAX];   /* the file (or name) it was loaded from, for messages */
    RunConfig run;
    DataConfig data;
    ModelConfig model;
    TrainConfig train;
    QuantConfig quant;
    LoraConfig lora;
} Config;

const char *quant_mode_name(QuantMode mode);
/* Whether the run trains adapters, i.e. has LoRA rules or trainable modules. */
bool config_has_lora(const Config *c);

/* The defaults above. model.input/layers are left empty. */
void config_default(Config *c);

/* Parses the YAML file at path, then applies the overrides in order, each
 * "key.path=value" (list items by index: model.layers.3.units=64; value
 * parsed as a YAML scalar or flow sequence), then validates. */
QtStatus config_load(Config *c, const char *path, const char *const *overrides, int n_overrides, QtError *err);
/* The same from text in memory; `name` stands in for the file in messages. */
QtStatus config_load_string(Config *c, const char *text, const char *name, const char *const *overrides,
                            int n_overrides, QtError *err);

/* The resolved config as YAML text (malloc'd; the caller frees). NULL only
 * if memory runs out. */
char *config_to_yaml(const Config *c);

/* What differs between the config stored in a checkpoint and the one
 * resuming it, as each key's row says. `fixed` gets the first key that must not change (it decides
 * the data order or the model: data.* but dir, model.* but init_from and
 * adapters_from, run.seed, train.batch_size, anything in quant or lora),
 * e.g. "model.layers[3]", or "" if none;
 * `changed` gets a comma-separated list of training keys that differ
 * (optimizer, schedule, epochs/steps, grad_clip), or "". */
void config_diff_for_resume(const Config *stored, const Config *now, char *fixed, size_t fixed_cap, char *changed,
                            size_t changed_cap);

/* The config reference as Markdown (malloc'd; the caller frees; NULL only if
 * memory runs out): every key of the schema with its default, allowed
 * values, what a resume does with it and its meaning. `qtrain config --doc`
 * prints it; docs/CONFIG.md is its output. */
char *config_doc_markdown(void);

/* Levenshtein distance (for "did you mean"); exposed for tests. */
int config_edit_distance(const char *a, const char *b);

#endif
