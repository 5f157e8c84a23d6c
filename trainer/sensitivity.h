/* sensitivity.h - per-module quantization sensitivity and the choice of a
 * weight format per module under a size budget (`qtrain sensitivity`,
 * `qtrain autoquant`).
 *
 * Measuring. For each quantizable module (dense or conv2d with a weight)
 * and each format, the model of the float checkpoint is built as a PTQ run
 * whose quant.rules quantize that module alone (weight-only, the rule's
 * defaults: per output channel; nf4 in blocks of 64 where 64 divides the
 * weight, else per channel), batch norms folded first as PTQ does
 * (quant.fold_bn), and evaluated; the change of the loss and accuracy
 * against the float model is the module's sensitivity to that format. The
 * split is the validation split (data.val_fraction, or a data file's /val)
 * or, when the config has none, a fixed part of the training set apart
 * from the test split: its last SENS_HOLDOUT_FRACTION (split "holdout",
 * seen in training unless data.val_fraction held it out; the commands
 * warn); the test split only
 * when asked (split "test"), since the choice made from it would otherwise
 * be judged on the examples it was made on.
 *
 * Counting. A module's bits are its quantized weight's storage (codes,
 * scales, zero points) x 8, taken from the quantized layer itself
 * (qarray_bytes): int4 per channel is 4 + 32/fan_in bits per weight, nf4 in
 * blocks of 64 4.5. Weights only: biases and batch-norm parameters stay
 * float32 in every choice and are left out of the budget.
 *
 * Choosing. Each module takes one of the measured formats or stays float32
 * (32 bits per weight, no loss change); the predicted loss change of a
 * choice is the sum of its modules' delta_loss (sensitivities taken as
 * additive), and the budget is the bits of the quantized modules' weights
 * / their weights. sens_knapsack solves that multiple-choice knapsack
 * exactly by dynamic programming over the bits (in units of 8 bits, or
 * coarser for models of more than about a million units, costs rounded up,
 * so the budget always holds). */
#ifndef QTRAIN_TRAINER_SENSITIVITY_H
#define QTRAIN_TRAINER_SENSITIVITY_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "base/error.h"
#include "nn/model.h"
#include "trainer/config.h"

#define SENS_FORMATS_MAX 8
#define SENS_FORMAT_NAME_MAX 32
#define SENS_HOLDOUT_FRACTION 0.1 /* the training set's tail held out when the config has no validation split */
#define SENS_DEFAULT_FORMATS "int8,int4,nf4,int2"

/* A weight format as given on the command line: NAME (a qtype: the quant
 * rule's default layout), NAME/ch (per output channel) or NAME/N (blocks of
 * N). */
typedef struct {
    char name[SENS_FORMAT_NAME_MAX]; /* as given, e.g. "nf4", "nf4/ch", "int4/64" */
    char qtype[SENS_FORMAT_NAME_MAX];
    int tile;                        /* -1: the rule's default; 0: per channel; > 0: blocks */
} SensFormat;

/* A comma-separated list into out[cap]; QT_ERR_ARG for an empty list, an
 * unknown format (listing the names), a bad suffix or a repeat. */
QtStatus sens_parse_formats(const char *list, SensFormat *out, int cap, int *n, QtError *err);

/* One module under one format. */
typedef struct {
    char module[MODULE_NAME_MAX];
    int64_t params;                  /* the weight's elements */
    int fan_in;                      /* its elements per output channel */
    char format[SENS_FORMAT_NAME_MAX]; /* SensFormat.name */
    char layout[SENS_FORMAT_NAME_MAX]; /* what the rule resolved to: "nf4/64", "int4/ch" */
    int tile;                        /* the tile_size the rule is written with (0: per channel) */
    int64_t bits;                    /* the quantized weight's storage x 8; -1: the format does not fit the
                                        module (a block that does not divide it), layout "n/a", the rest NaN */
    double bits_per_param;           /* bits / params */
    double delta_loss, delta_accuracy; /* against the float model on the split */
    char note[160];                  /* bits -1: why (not in the CSV) */
} SensEntry;

/* Every module x format, module-major in model order. */
typedef struct {
    SensEntry *entries;              /* [n_modules * n_formats] */
    int n_modules, n_formats;
    SensFormat formats[SENS_FORMATS_MAX];
    char split[16];                  /* "val", "holdout" or "test" */
    int examples;                    /* the split's */
    double base_loss, base_accuracy; /* the float model's */
    char weights_sha256[65];         /* the float model's parameters (checkpoint_base_sha256) */
    char data_sha256[65];            /* the config's data section as resolved */
} SensTable;

typedef struct {
    const char *checkpoint;          /* a float checkpoint of cfg's model */
    SensFormat formats[SENS_FORMATS_MAX];
    int n_formats;
    bool use_test;                   /* measure on the test split (labelled "test") */
    FILE *log;                       /* a line per measurement; NULL: quiet */
} SensOptions;

/* Measures t (sens_table_free frees it). cfg is the model's config (no
 * lora; its quant section is replaced). QT_ERR_ARG / QT_ERR_CONFIG for a
 * checkpoint that is quantized or not cfg's model, or a format that cannot
 * quantize some module. */
QtStatus sens_measure(const Config *cfg, const SensOptions *o, SensTable *t, QtError *err);
void sens_table_free(SensTable *t);

/* The table as CSV at path (a header row, then one row per module x format:
 * module, params, fan_in, format, layout, tile, bits_per_param, bits,
 * delta_loss, delta_accuracy, base_loss, base_accuracy, split, examples,
 * weights_sha256, data_sha256), through a temp file renamed onto path (an
 * existing regular file only with force). */
QtStatus sens_write_csv(const SensTable *t, const char *path, bool force, QtError *err);
/* Reads what sens_write_csv wrote; QT_ERR_ARG naming the line for anything else. */
QtStatus sens_read_csv(const char *path, SensTable *t, QtError *err);
/* QT_ERR_ARG unless `csv` (read from `path`) was measured on the same
 * model, weights, data and split as `now` (a table measured with no formats:
 * sens_identify) and holds every format of `formats`. */
QtStatus sens_check_csv(const SensTable *csv, const char *path, const SensTable *now, QtError *err);
/* The identity of cfg's model at checkpoint (modules, weights and data hashes, split) in a table without
 * formats, for sens_check_csv; no evaluation runs. */
QtStatus sens_identify(const Config *cfg, const char *checkpoint, bool use_test, SensTable *t, QtError *err);
/* The table restricted to `formats` (in that order): QT_ERR_ARG naming the first it lacks. */
QtStatus sens_table_select_formats(const SensTable *t, const SensFormat *formats, int n, SensTable *out,
                                   QtError *err);

/* The exact multiple-choice knapsack: module m takes one option j of k,
 * costing bits[m * k + j] (< 0: not available) and adding delta[m * k + j];
 * choice[m] gets the options whose bits sum to at most max_bits with the
 * least delta sum (ties: fewer bits, then lower option indices). Costs are
 * counted in units of `unit` bits (>= 1), each rounded up. QT_ERR_ARG when no
 * choice fits, naming the least bits possible. */
QtStatus sens_knapsack(int n_modules, int k, const int64_t *bits, const double *delta, int64_t max_bits,
                       int64_t unit, int *choice, QtError *err);

/* Choices under `budget` bits per weight: choice[m] is a format index of t,
 * or -1 for float32. QT_ERR_ARG below the least bits the formats reach. */
QtStatus sens_choose(const SensTable *t, double budget, int *choice, QtError *err);

/* The quant.rules of a choice as YAML lines at `indent` (malloc'd; NULL if
 * memory runs out): one rule per quantized module, module_path anchored by
 * the rule itself; a float module gets none. */
char *sens_rules_yaml(const SensTable *t, const int *choice, const char *indent);

/* A whole PTQ config: cfg with its quant section replaced by `rules_yaml`
 * (quant.mode ptq, cfg's fold_bn), model.init_from = checkpoint,
 * train.epochs 0 (evaluate only), run.name and run.out_dir as given. out is
 * the loaded config; *text (may be NULL) its YAML (malloc'd). */
QtStatus sens_ptq_config(const Config *cfg, const char *rules_yaml, const char *checkpoint, const char *name,
                         const char *out_dir, Config *out, char **text, QtError *err);

/* What one PTQ config's model does on the test split (or the split of
 * sens_measure with use_test false). */
typedef struct {
    double loss, accuracy;
    int64_t q_params, q_bits;   /* the quantized modules' weights and their storage bits */
    char formats[256];          /* net_format_summary's weights */
} SensEval;
QtStatus sens_eval_config(const Config *ptq, bool test_split, SensEval *out, QtError *err);
/* The same for cfg's float model at checkpoint (quant none). */
QtStatus sens_eval_float(const Config *cfg, const char *checkpoint, bool test_split, SensEval *out, QtError *err);

#endif
