/* train.h - a training run from a Config: data, model, loop, eval,
 * checkpoints, metrics. What `qtrain --config F` and `qtrain eval` run. */
#ifndef QTRAIN_TRAINER_TRAIN_H
#define QTRAIN_TRAINER_TRAIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"
#include "trainer/config.h"

typedef struct {
    const char *resume;   /* NULL = fresh start; a checkpoint path; "auto" = newest in out_dir
                             (a fresh start if there is none) */
    bool quiet;           /* no config print and no per-step lines; errors and the final line only */
    bool progress;        /* a progress bar with ETA on stderr (the CLI sets it when stderr is a TTY) */
    int64_t stop_at_step; /* > 0: stop after this step with a checkpoint, as an interrupted run would,
                             without the final eval (a later --resume continues); 0 = run to the end */
    struct Dist *dist;    /* data-parallel ranks (trainer/dist.h); NULL = one process */
} TrainOptions;

typedef struct {
    int64_t steps;        /* optimizer steps at the end (counting resumed ones) */
    bool stopped;         /* stopped early (stop_at_step or a stop signal): no final eval, no summary.json */
    int interrupted;      /* the stop signal (SIGINT, SIGTERM) that ended the run early, 0 if none */
    bool already_complete;/* --resume of a finished run: nothing was run or written */
    double epochs;        /* epochs done (fractional) */
    double test_loss, test_accuracy;
    double val_loss, val_accuracy; /* -1 if there is no validation split */
    bool mse;             /* train.loss: mse: the accuracies are NaN; test_mse/test_mae (= test_loss and the mean
                             absolute error over every output value) report the model */
    double test_mse, test_mae, val_mse, val_mae; /* mse runs (val_*: -1 without a validation split); NaN otherwise */
    double test_auc;      /* data.anomaly_classes: ROC AUC of the test reconstruction errors; NaN otherwise */
    char scores_path[4096]; /* `qtrain eval` of a data.target: input model: the scores.csv written, else "" */
    double train_loss;    /* mean over the last logging window; NaN if no step ran */
    double wall_s;        /* wall time of the run, over all its invocations */
    double samples_per_s; /* training examples per second of training time (eval and checkpoints excluded) */
    int64_t params_trainable, params_frozen;
    int64_t model_bytes;  /* bytes held for the model: float params, quantized weights, adapters */
    double base_bits_per_param; /* the frozen base's storage * 8 / its parameters (32 for a float base) */
    const char *mode;     /* net_mode_name: "float", "ptq", "lora", "qlora", "qat", "qat-lora", "qt"; a merged
                             checkpoint's: its base's ("float", "ptq") */
    char merged_from[4096];   /* eval of a `qtrain merge` output: the checkpoint it was merged from, else "" */
    char merged_from_base_sha256[65]; /* ...and that checkpoint's base identity */
    double peak_rss_mb;   /* the process's peak resident set (getrusage) */
    int world_size;       /* ranks that trained (1: one process) */
    double allreduce_bytes_per_step; /* bytes each rank sent per step to sum the gradients (0 in one process) */
} TrainResult;

/* The result's test metrics as `qtrain` prints them: "test_accuracy:A
 * test_loss:L", or for an mse run "test_mse:M test_mae:E" and, with
 * data.anomaly_classes, " test_auc:U". */
void train_result_format(const TrainResult *res, char *buf, size_t cap);

/* Trains per cfg, writing metrics.csv, summary.json and checkpoints into
 * cfg->run.out_dir; every checkpoint stores config_to_yaml(cfg). Returns a
 * status and fills err: QT_ERR_CONFIG for what the config asks that cannot
 * be done (a model whose input does not match the data), other codes for
 * runtime failures. */
QtStatus train_run(const Config *cfg, const TrainOptions *o, TrainResult *r, QtError *err);

/* Evaluates the model of `checkpoint` (parameters, quantized base,
 * adapters) on the test split of cfg's data (and validation split, if
 * any); with write_json, writes eval.json beside the checkpoint (in its
 * directory), never into cfg's run.out_dir. Evaluation does not check the
 * training schedule or batch plan: it never trains. */
QtStatus train_eval_checkpoint(const Config *cfg, const char *checkpoint, bool write_json, TrainResult *r,
                               QtError *err);
/* Where eval.json goes: `out` (a file, or an existing directory to hold
 * eval.json), or with out NULL beside the checkpoint. Never a config's
 * run.out_dir: a checkpoint's stored config does not decide where eval writes. */
QtStatus train_eval_json_path(const char *checkpoint, const char *out, char *path, size_t cap, QtError *err);
/* The same evaluation, writing the JSON to json_path (NULL: none); its directory must exist. */
QtStatus train_eval_checkpoint_to(const Config *cfg, const char *checkpoint, const char *json_path, TrainResult *r,
                                  QtError *err);
/* The same, also writing the test split's outputs (N, values per example) to logits_path as a float32 .npy
 * file (NULL: none; an existing regular file is replaced). */
QtStatus train_eval_checkpoint_dump(const Config *cfg, const char *checkpoint, const char *json_path,
                                    const char *logits_path, TrainResult *r, QtError *err);

/* mkdir -p path. `what` names the setting in messages ("run.out_dir",
 * "--out"). created (cap bytes, may be NULL) receives the topmost directory
 * this call made, "" if every one existed. */
QtStatus train_make_dirs(const char *path, const char *what, char *created, size_t cap, QtError *err);

#endif
