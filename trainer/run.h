/* run.h - the state of one training run and the steps of its life that
 * `qtrain bench` shares with training (trainer/train.c), and what train.c
 * shares with its parts (train_dirs.c, train_json.c, train_eval.c).
 * Internal to trainer/: the public entry points are in train.h and bench.h. */
#ifndef QTRAIN_TRAINER_RUN_H
#define QTRAIN_TRAINER_RUN_H

#include <stdbool.h>
#include <stdint.h>

#include "data/dataset.h"
#include "base/arena.h"
#include "base/fsutil.h"
#include "nn/optim.h"
#include "base/rng.h"
#include "nn/schedule.h"
#include "nn/tape.h"
#include "trainer/config.h"
#include "trainer/dist.h"
#include "trainer/guard.h"
#include "trainer/metrics.h"
#include "trainer/net.h"
#include "trainer/rundir.h"
#include "trainer/train.h"

/* A run is made of parts, each with one owner: the functions that make and
 * free it. run_init zeroes them all; a training run then makes them in the
 * order dir, data, model, plan, work, log (run_setup), and run_free frees
 * each through its owner (every free accepts a zeroed or half-made part).
 * What a checkpoint stores outlives the process: the model, the plan's
 * position, the dropout generator, the log's window, the clock's totals and
 * the guards are restored into a resumed invocation's parts. */

/* The data: the training, validation and test splits. Owner:
 * run_load_data / run_data_free. Read-only once loaded. */
typedef struct {
    Dataset train, val, test;
} RunData;

/* The model and its optimizer. Owner: run_build_model / run_model_free.
 * Changed by every step, and filled by a resume's checkpoint. */
typedef struct {
    Net net;                /* the model with its quantized base and adapters */
    Optimizer optim;
} RunModel;

/* The step plan and the run's place in it. Owner: run_plan_steps /
 * run_plan_free (training and bench; an evaluation makes no plan and sets
 * steps_per_epoch to 1 itself). step is advanced by run_step and restored
 * with the batcher's position by a resume. */
typedef struct {
    Batcher batcher;        /* the order of the training examples and the position in it */
    LrSchedule sched;
    int64_t total_steps, steps_per_epoch;
    int64_t step;           /* optimizer steps done */
} RunPlan;

/* The working memory of a step and of an evaluation batch. Owner:
 * run_alloc / run_work_free. Allocated once, before the first step: the
 * arena is reset after each step and batch, so the loop allocates nothing. */
typedef struct {
    float *bx;              /* (batch_size, feat) training batch */
    int32_t *by;            /* [batch_size] */
    float *ex;              /* (eval_batch_size, feat) evaluation batch */
    int32_t *ey;            /* [eval_batch_size] */
    float *bt, *et;         /* (batch_size, n_targets), (eval_batch_size, n_targets): a data set's value targets;
                               NULL when it has class labels */
    float *scores;          /* [test n]: each test example's reconstruction error (data.target: input), else NULL */
    AucItem *auc;           /* [test n]: the AUC's work (data.anomaly_classes), else NULL */
    Arena arena;            /* a step's tensors */
    Tape tape;              /* over arena; draws its dropout masks from dropout */
    Rng dropout;            /* stored in checkpoints: a resumed run draws the same masks */
} RunWork;

/* What the run reports. Owner: run_log_open / run_log_close (metrics.csv;
 * run_init starts the window empty and last_train_loss NaN, a resume
 * restores both, and train_run starts the progress bar before the loop). */
typedef struct {
    MetricsLog metrics;
    Progress progress;
    double win_loss_sum;    /* training window since the last log line */
    int64_t win_correct, win_seen, win_steps;
    double last_train_loss; /* mean loss of the last logged window, NaN before the first */
} RunLog;

/* Time and throughput over every invocation of the run. Owner: run_init
 * (this invocation's start); a resume restores the totals; nothing to free. */
typedef struct {
    double t_start;         /* this invocation's start */
    double wall_before;     /* wall seconds of earlier invocations of this run (resume) */
    double train_s;         /* seconds in training steps, over all invocations */
    int64_t trained_examples; /* over all invocations */
} RunClock;

/* The numerical guards (trainer/guard.h). Owner: run_init (zero); a
 * resume restores them; nothing to free. */
typedef struct {
    int64_t nonfinite_skipped; /* steps whose update train.on_nonfinite: skip dropped, over all invocations */
    int64_t nonfinite_streak;  /* of them, the latest steps in a row */
    LossWatch loss_watch;   /* train.divergence_factor's running means */
} RunGuards;

/* What the latest evaluation measured besides loss and accuracy. Owner:
 * run_init (NaN); nothing to free. */
typedef struct {
    double test_mae, val_mae; /* train.loss: mse: mean |output - target| over every value; NaN otherwise */
    double test_auc;          /* data.anomaly_classes: the ROC AUC of the test reconstruction errors; NaN otherwise */
    bool have_scores;         /* work.scores holds the test split's reconstruction errors */
    float *logits;            /* (test n, width): the test split's model outputs, when asked for (eval
                                 --dump-logits; owned by the caller); NULL: not kept */
    size_t logits_width;      /* values per example */
} RunEval;

/* run.out_dir and what the run's checkpoints record. Owner: run_dir_open
 * (makes out_dir, takes its lock) and run_dir_note (once the model is final:
 * the config text and a LoRA run's base identity) / run_dir_close. Training
 * only: bench and evaluation never open it. */
typedef struct {
    RunDirLock lock;        /* out_dir's .lock, held from run_dir_open until run_dir_close */
    char *config_text;      /* resolved YAML, stored in checkpoints */
    char base_sha256[SHA256_HEX_CHARS]; /* a LoRA run's frozen base (checkpoint_base_sha256); "" otherwise */
    char *lora_trainable;   /* lora.trainable, comma-separated, for adapters.h5 (malloc'd) */
    int64_t saved_step;     /* step of the newest checkpoint written by this invocation, -1 = none */
    bool already_complete;  /* resumed from a checkpoint at the last step: nothing to do */
} RunDir;

/* A region of state that is not a parameter but changes in a step (batch
 * norms' running statistics, QAT input statistics): rank 0's copy goes to
 * every rank after each step, as PyTorch DDP broadcasts buffers. */
typedef struct {
    void *p;
    size_t bytes;
} RunDistRegion;

#define RUN_DIST_META 5 /* the doubles of a step's sum before the per-rank flags (train_dist.c) */

/* Data-parallel training (train_dist.c). Owner: run_dist_alloc /
 * run_dist_free. Unused (all zero but d) in one process. */
typedef struct {
    Dist *d;                /* borrowed from the options; NULL: one process */
    bool live;              /* every rank holds the run's state: evaluation may split over the ranks */
    float *grads;           /* [n_grad]: the trainable gradients packed for one sum */
    size_t n_grad;
    float *work;            /* [dist_sum_work_floats(n_grad or test n)] */
    size_t work_n;
    double *meta, *meta_work; /* [RUN_DIST_META + world], [world * that]: a step's loss, counts and flags */
    RunDistRegion *regions; /* [n_regions] */
    int n_regions;
    unsigned char *regions_buf; /* [regions_bytes] */
    size_t regions_bytes;
    TapeSync tape_sync;     /* train.sync_bn: batch norm's gather */
    int sig;                /* the stop signal the ranks agreed on after the last step, 0 = none */
    int64_t ckpt_world;     /* the world size of the checkpoint resumed from (0: fresh) */
    double step_comm_s;     /* seconds of the steps spent in collectives since the last log line */
} RunDist;

typedef struct {
    /* The inputs: cfg and opt borrowed from run_init's caller until run_free. */
    const Config *cfg;
    const TrainOptions *opt;
    bool base_from_seed;    /* set by qtrain bench: a PTQ base without init_from is the quantized initialisation */
    RunData data;
    RunModel model;
    RunPlan plan;
    RunWork work;
    RunLog log;
    RunClock clock;
    RunGuards guards;
    RunEval eval;
    RunDir dir;
    RunDist dist;
} Run;

/* Starts a run of cfg with options opt: every part zeroed, the clock
 * started, no checkpoint saved and no window logged yet. */
void run_init(Run *r, const Config *cfg, const TrainOptions *opt);

/* Everything a run needs that does not touch run.out_dir: the thread count,
 * data, model (fresh: from the seed, init_from and adapters_from; else
 * layouts for a checkpoint to fill), optimizer, step plan, batch buffers,
 * arena and tape, and for a fresh model the static activation calibration.
 * r comes from run_init. */
QtStatus run_prepare(Run *r, bool fresh, QtError *err);
/* Frees every part through its owner; safe on a partial setup. */
void run_free(Run *r);

/* One optimizer step on the next batch, its loading included. */
QtStatus run_step(Run *r, QtError *err);

/* The forward pass and loss of examples start..start+n-1 of d (n at most
 * the eval batch size), as evaluation runs them; adds n * the mean loss to
 * *loss_sum and the correct predictions to *correct. The caller switches
 * the tape to inference (training and grad_enabled false). */
QtStatus run_eval_batch(Run *r, const Dataset *d, int start, int n, double *loss_sum, int64_t *correct,
                        QtError *err);

/* The parts of run_prepare that evaluating a checkpoint runs too
 * (train_eval.c): the training, validation and test data; the model (fresh:
 * from the seed, init_from and adapters_from; else a layout for a checkpoint
 * to fill) with its optimizer; batch buffers, arena and tape. */
QtStatus run_load_data(Run *r, QtError *err);
QtStatus run_build_model(Run *r, bool fresh, QtError *err);
QtStatus run_alloc(Run *r, QtError *err);
/* Their frees, each of its own part: safe on a part made in part, and
 * each leaves its part zeroed, so run_free may follow. */
void run_data_free(RunData *d);
void run_model_free(RunModel *m);
void run_work_free(RunWork *w);
/* Evaluates val (if any) and test, logs and records both in metrics.csv
 * (once opened); *val_loss and *val_acc are -1 without a validation split. */
QtStatus run_eval_and_log(Run *r, double *test_loss, double *test_acc, double *val_loss, double *val_acc,
                          QtError *err);
/* train_tasks.c: data.anomaly_classes dropped from the training and
 * validation splits once loaded; the test split must keep both kinds. */
QtStatus run_drop_anomalies(Run *r, QtError *err);
/* train_tasks.c: train.loss: mse needs value targets or data.target:
 * input, and `last` (the model's last module) one output per target value. */
QtStatus run_check_mse_fits(Run *r, const Module *last, QtError *err);
/* train_tasks.c: the ROC AUC of work.scores over the test split, the
 * anomaly classes positive (NaN without them). */
double run_test_auc(Run *r);
/* train_tasks.c: an eval line's numbers after "loss:": "acc:A", or for mse
 * "mae:E" (and on the test split with anomaly classes " auc:U"). */
void run_eval_tail(const Run *r, double acc, double mae, bool test, char *buf, size_t cap);
/* res's test and val metrics from run_eval_and_log's results and r->eval:
 * accuracy for cross_entropy, mse and mae (accuracy NaN) for mse. */
void run_fill_eval_result(const Run *r, TrainResult *res);
/* res from the run's totals over all its invocations and the net's sizes. */
void run_fill_result(const Run *r, TrainResult *res);
/* What a checkpoint holds besides parameters and optimizer state, pointing
 * into r (a load fills r's parts through it). */
CheckpointState run_checkpoint_state(Run *r);
/* After run_prepare(r, false): loads the checkpoint at path and restores
 * everything that decides the rest of the run (step, data position, the log
 * window, clock totals, guards, dropout stream); refuses one trained on
 * other data or past r's plan. The library API continues a run with it. */
QtStatus run_restore(Run *r, const char *path, QtError *err);
/* What every checkpoint records of the run, once its model is final
 * (loaded, quantized or resumed): the resolved config and, for a LoRA run,
 * lora.trainable and the base identity (adapters.h5 records them too).
 * Needs no run directory: the library API calls it too. */
QtStatus run_dir_note(Run *r, QtError *err);

/* train_dirs.c: makes run.out_dir with its parents (created: the topmost
 * directory made, "" if none) and takes its lock, before anything in it is
 * read: another run there would mix its files with ours. */
QtStatus run_dir_open(Run *r, char *created, size_t cap, QtError *err);
/* Frees the config text and lora.trainable and releases the lock; leaves d zeroed. */
void run_dir_close(RunDir *d);
/* train_dirs.c: after a failed run, removes the directories of run.out_dir
 * that run_dir_open made (created: the topmost, "" if none), each only if it
 * is empty but for the run's .lock: one the run wrote into stays, with its
 * files. */
void run_undo_failed_start(Run *r, const char *created);

/* train_json.c: summary.json (is_eval false) or eval.json of a run and its
 * result, written atomically onto path as `how` allows; ckpt is the
 * checkpoint it names. */
QtStatus write_json_atomically(const char *path, const Run *r, const TrainResult *res, const char *ckpt,
                               bool is_eval, FsReplace how, QtError *err);
/* eval.json at path: only over a regular file, and only while no live run
 * holds the lock of the directory it is in. */
QtStatus eval_write_json(const char *path, const Run *r, const TrainResult *res, const char *ckpt, QtError *err);
/* scores.csv at path (index,label,score: each test example's reconstruction
 * error, label empty for a set without class labels), under the same rules
 * as eval_write_json. */
QtStatus eval_write_scores(const char *path, const Run *r, QtError *err);

/* ---- train.c's parts: train_resume.c, train_plan.c, train_guard.c ---- */

/* Refuses a resume whose config would not continue the same run, and reports training keys that changed. */
QtStatus run_check_resume_config(Run *r, const char *path, QtError *err);
/* run_restore, and whether the run it continues is already complete. */
QtStatus run_resume_from(Run *r, const char *path, QtError *err);
/* The checkpoint to resume from into `used` ("" = a fresh start): --resume PATH, or --resume auto. */
QtStatus run_find_checkpoint(Run *r, char *used, size_t cap, QtError *err);
/* The step plan: the batcher, steps per epoch, total steps, the schedule; every rank's part of every batch. */
QtStatus run_plan_steps(Run *r, QtError *err);
/* The resolved config, data, model and plan at the start (rank 0, unless quiet). */
void run_print_plan(Run *r, const char *resumed);
/* Epochs done, fractional. */
double run_epoch(const Run *r);
/* A step whose loss (grad_where NULL: the forward is rerun on x to name the module) or gradient is not finite. */
QtStatus run_nonfinite(Run *r, Var *x, double loss, const char *grad_where, QtError *err);

/* ---- what train.c shares with train_dist.c ---- */

/* Rank 0, or the one process: it alone writes out_dir and prints. */
bool run_is_root(const Run *r);
/* More than one rank. */
bool run_is_dist(const Run *r);
/* The stop signal: the one the ranks agreed on, or this process's. */
int run_stop_signal(const Run *r);
/* A Var over the first n examples of a batch buffer, shaped (n, input...). */
Var *run_wrap_batch(Run *r, float *x, int n);
/* The loss of a batch's output (cross-entropy or mse). */
Var *run_loss(Run *r, Var *out, float *x, const int32_t *y, float *t);
int run_count_correct(const Var *logits, const int32_t *y, int n);
/* The divergence watch on a step's loss. */
void run_watch_loss(Run *r, double loss);
/* A step whose loss (is_loss) or gradient is not finite, at `where`: stop, or skip it (train.on_nonfinite). */
QtStatus run_nonfinite_at(Run *r, bool is_loss, const char *where, QtError *err);
/* An update that left a parameter non-finite: always stops. */
QtStatus run_nonfinite_update(Run *r, double loss, const char *where, QtError *err);
/* After the backward (in a data-parallel run, after the sum over the ranks) of a batch of n with mean loss l and
 * `correct` right predictions: the gradient guard, clipping, the update, the parameter guard; the step is done. */
QtStatus run_update(Run *r, double l, int64_t correct, int n, QtError *err);

/* train_dist.c: the setup of every rank (rank 0 runs run_setup and hands its state to the others), the
 * buffers of the step's sums, a step, the evaluation's sums, and the check that every rank holds the same model. */
typedef QtStatus (*RunSetupFn)(Run *r, char *resumed, size_t cap, char *created, size_t created_cap, QtError *err);
QtStatus run_dist_setup(Run *r, RunSetupFn setup, char *resumed, size_t cap, char *created, size_t created_cap,
                        QtError *err);
void run_dist_free(RunDist *d);
QtStatus run_dist_step(Run *r, QtError *err);
/* The evaluation's sums over the ranks (each evaluated batches rank, rank + world, ...): sums (n) doubles, and
 * scores ([n_scores] or NULL: each rank's own entries, zero elsewhere). */
QtStatus run_dist_eval_sums(Run *r, double *sums, int n, float *scores, int n_scores, QtError *err);
/* Every rank's trainable parameters and buffers against rank 0's: an error (on every rank) naming the first rank
 * that differs. Run before each checkpoint. */
QtStatus run_dist_check_replicas(Run *r, QtError *err);

#endif
