/* train.c - a run: data and model from the config, the step loop, eval,
 * checkpoints with exact resume, metrics.csv and summary.json. Its run
 * directories are train_dirs.c's, its JSON files train_json.c's and the
 * evaluation of a checkpoint train_eval.c's. */
#include "trainer/run.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "data/augment.h"
#include "data/dataset.h"
#include "base/arena.h"
#include "base/fsutil.h"
#include "nn/gemm.h"
#include "nn/model.h"
#include "nn/ops.h"
#include "nn/optim.h"
#include "base/rng.h"
#include "nn/schedule.h"
#include "nn/tape.h"
#include "trainer/checkpoint.h"
#include "trainer/guard.h"
#include "trainer/interrupt.h"
#include "trainer/metrics.h"
#include "trainer/net.h"
#include "trainer/version.h"

/* The first step's arena; it grows to the high-water mark once, then stays. */
#define RUN_ARENA_INITIAL (4u << 20)

void run_init(Run *r, const Config *cfg, const TrainOptions *opt) {
    memset(r, 0, sizeof *r);
    r->cfg = cfg, r->opt = opt;
    r->clock.t_start = metrics_now();
    r->dir.saved_step = -1;
    r->log.last_train_loss = NAN;
    r->eval.test_mae = r->eval.val_mae = r->eval.test_auc = NAN;
    r->dist.d = opt->dist;
}

bool run_is_dist(const Run *r) { return dist_is_multi(r->dist.d); }
bool run_is_root(const Run *r) { return !r->dist.d || r->dist.d->rank == 0; }
int run_stop_signal(const Run *r) { return run_is_dist(r) ? r->dist.sig : interrupt_requested(); }

/* Each part's free leaves it zeroed: run_free may follow. */
void run_data_free(RunData *d) {
    dataset_free(&d->train), dataset_free(&d->val), dataset_free(&d->test);
    memset(d, 0, sizeof *d);
}

void run_model_free(RunModel *m) {
    optim_free(&m->optim);
    net_free(&m->net);
    memset(m, 0, sizeof *m);
}

static void run_plan_free(RunPlan *p) {
    batcher_free(&p->batcher);
    memset(p, 0, sizeof *p);
}

void run_work_free(RunWork *w) {
    tape_free(&w->tape);
    arena_free(&w->arena);
    free(w->bx), free(w->by), free(w->ex), free(w->ey);
    free(w->bt), free(w->et), free(w->scores), free(w->auc);
    memset(w, 0, sizeof *w);
}

static void run_log_close(RunLog *l) {
    metrics_close(&l->metrics);
    memset(l, 0, sizeof *l);
}

void run_free(Run *r) {
    run_dist_free(&r->dist);
    run_log_close(&r->log);
    run_plan_free(&r->plan);
    run_model_free(&r->model);
    run_work_free(&r->work);
    run_data_free(&r->data);
    run_dir_close(&r->dir);
}

/* The configured data set's train, test and (an HDF5 file's /val) validation sets, as loaded. */
static QtStatus run_load_sets(Run *r, IdxCache *cache, QtError *err) {
    const DataConfig *dc = &r->cfg->data;
    RunData *d = &r->data;
    if (strcmp(dc->dataset, "hdf5") == 0)
        return dataset_load_hdf5(&d->train, &d->val, &d->test, dc->path, dc->storage,
                                 (size_t)dc->max_memory_mb << 20, err);
    if (strcmp(dc->dataset, "idx") == 0)
        return dataset_load_idx_pairs(&d->train, &d->test, dc->files.train_x, dc->files.train_y, dc->files.test_x,
                                      dc->files.test_y, cache, dc->storage, err);
    if (strcmp(dc->dataset, "npy") == 0)
        return dataset_load_npy(&d->train, &d->test, dc->files.train_x, dc->files.train_y, dc->files.test_x,
                                dc->files.test_y, dc->storage, (size_t)dc->max_memory_mb << 20, err);
    return dataset_load_fashion_mnist_stored(&d->train, &d->test, dc->dir, cache, dc->storage, err);
}

QtStatus run_load_data(Run *r, QtError *err) {
    const DataConfig *dc = &r->cfg->data;
    IdxCache cache;
    idx_cache_init(&cache, dc->cache_dir);
    QtStatus st = run_load_sets(r, &cache, err);
    /* even when quiet, like an unused rule: without the cache every start inflates the data again */
    if (cache.warning[0]) fprintf(stderr, "qtrain: warning: %s\n", cache.warning);
    if (st == QT_OK)
        st = dataset_apply_transforms3(&r->data.train, r->data.val.n > 0 ? &r->data.val : NULL, &r->data.test,
                                       dc->transforms, dc->n_transforms, err);
    if (st == QT_OK && r->data.val.n > 0 && dc->val_fraction > 0.0)
        st = qt_error_set(err, QT_ERR_CONFIG, "%s: data.val_fraction = %g, but '%s' has its own /val split; set "
                          "data.val_fraction: 0 to use it, or remove /val from the file", r->cfg->source,
                          dc->val_fraction, dc->path);
    if (st == QT_OK && r->data.val.n == 0) {
        dataset_free(&r->data.val);
        st = dataset_split_tail(&r->data.train, &r->data.val, dc->val_fraction, err);
    }
    if (st == QT_OK) st = run_drop_anomalies(r, err);
    return st;
}

/* The model's input must be the data's example shape (or its flattening)
 * and its output one logit per class (cross_entropy) or one value per
 * target value (mse). */
static QtStatus run_check_model_fits_data(Run *r, QtError *err) {
    const ModelConfig *mc = &r->cfg->model;
    const Dataset *d = &r->data.train;
    int feat = 1;
    for (int i = 0; i < mc->input_ndim; i++) feat *= mc->input_shape[i];
    bool same = mc->input_ndim == d->ndim && memcmp(mc->input_shape, d->shape, sizeof(int) * (size_t)d->ndim) == 0;
    if (!same && !(mc->input_ndim == 1 && feat == d->feat))
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: model.input has %d values per example but the %s examples are (%d, %d, %d) = %d "
                            "values; set model.input to [%d, %d, %d] or [%d]",
                            r->cfg->source, feat, r->cfg->data.dataset, d->shape[0], d->shape[1], d->shape[2],
                            d->feat, d->shape[0], d->shape[1], d->shape[2], d->feat);
    const Module *last = &r->model.net.model.modules[r->model.net.model.n_modules - 1];
    if (r->cfg->train.loss == LOSS_MSE) return run_check_mse_fits(r, last, err);
    if (!d->labels)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: the %s data set's targets are values (%d per example), not class labels, which "
                            "train.loss: cross_entropy needs; set train.loss: mse (and give the last layer %d units)",
                            r->cfg->source, r->cfg->data.dataset, d->n_targets, d->n_targets);
    if (last->out_ndim != 1 || last->out_shape[0] != d->n_classes)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: the last layer (%s) must give one logit per class: the data has %d classes, the "
                            "model gives %d values per example; set the last dense layer's units to %d",
                            r->cfg->source, last->path, d->n_classes,
                            last->out_ndim == 1 ? last->out_shape[0] : -1, d->n_classes);
    return QT_OK;
}

/* init_from and adapters_from are read only by a fresh run: a resumed run
 * or an evaluation takes every value from its checkpoint (and must not need
 * the base file to still exist). */
QtStatus run_build_model(Run *r, bool fresh, QtError *err) {
    const Config *c = r->cfg;
    NetInit how = !fresh ? NET_SHELL : r->base_from_seed ? NET_FRESH_TIMING : NET_FRESH;
    QtStatus st = net_build(&r->model.net, c, how, err);
    if (st != QT_OK) return st;
    if ((st = run_check_model_fits_data(r, err)) != QT_OK) return st;
    if (r->model.net.n_trainable == 0) { /* a frozen PTQ model: evaluation only (run_check_trainable) */
        r->model.optim.cfg = c->train.optim;
        return QT_OK;
    }
    st = optim_init(&r->model.optim, &c->train.optim, r->model.net.trainable, r->model.net.n_trainable, err);
    if (st == QT_OK) st = net_set_range_lrs(&r->model.net, &r->model.optim, c->train.optim.lr, err);
    return st;
}

/* Several ranks with batch norms on each rank's own part: a batchnorm1d over one value per channel and example needs
 * two examples on every rank, in every batch (one process needs two in the batch). */
static QtStatus run_check_bn_parts(Run *r, int world, int last, QtError *err) {
    const Model *m = &r->model.net.model;
    const TrainConfig *tc = &r->cfg->train;
    for (int i = 0; i < m->n_modules; i++) {
        const Module *mod = &m->modules[i];
        if (mod->spec.type != LAYER_BATCHNORM1D || mod->in_ndim != 1 || mod->bn.frozen) continue;
        bool small_last = !r->cfg->data.drop_last && last > 0 && last < 2 * world;
        if (tc->batch_size >= 2 * world && !small_last) return QT_OK;
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: batchnorm1d '%s' normalises over each rank's part of the batch, which needs 2 "
                            "examples or more on each of the %d ranks, but %s; raise train.batch_size to at least %d%s, "
                            "set train.sync_bn: true (statistics over the whole batch), or run fewer ranks",
                            r->cfg->source, mod->path, world,
                            small_last ? "the last batch of each epoch is smaller" : "train.batch_size is smaller",
                            2 * world, small_last ? " with data.drop_last: true" : "");
    }
    return QT_OK;
}

static QtStatus run_plan_steps(Run *r, QtError *err) {
    const TrainConfig *tc = &r->cfg->train;
    QtError ae = {0};
    if (augment_check(&r->cfg->data.augment, r->data.train.ndim, r->data.train.shape, &ae) != QT_OK)
        return qt_error_set(err, ae.status, "%s: %s", r->cfg->source, ae.msg);
    QtStatus st = batcher_init(&r->plan.batcher, &r->data.train, tc->batch_size, r->cfg->data.shuffle,
                               r->cfg->data.drop_last, r->cfg->run.seed, err);
    if (st != QT_OK) return st;
    r->plan.steps_per_epoch = batcher_steps_per_epoch(&r->plan.batcher);
    if (r->plan.steps_per_epoch < 1)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: train.batch_size %d is larger than the %d training examples and data.drop_last "
                            "is true, so an epoch has no batch; lower the batch size or set drop_last: false",
                            r->cfg->source, tc->batch_size, r->data.train.n);
    int world = r->dist.d ? r->dist.d->world : 1, last = r->data.train.n % tc->batch_size;
    if (world > 1 && (tc->batch_size < world || (!r->cfg->data.drop_last && last > 0 && last < world)))
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: train.batch_size %d over %d ranks leaves a rank without examples (%s); every rank "
                            "needs a part of every batch: raise train.batch_size to at least %d%s, or run fewer ranks",
                            r->cfg->source, tc->batch_size, world,
                            tc->batch_size < world ? "each batch is smaller than the number of ranks"
                                                   : "the last batch of each epoch is smaller than the number of ranks",
                            world, tc->batch_size < world ? "" : ", or set data.drop_last: true");
    if (world > 1 && !r->cfg->train.sync_bn) {
        QtStatus st = run_check_bn_parts(r, world, last, err);
        if (st != QT_OK) return st;
    }
    /* epochs <= 10^6 and steps per epoch < 2^31: no overflow */
    r->plan.total_steps = tc->steps > 0 ? tc->steps : tc->epochs * r->plan.steps_per_epoch;
    r->plan.sched = tc->schedule;
    r->plan.sched.base_lr = tc->optim.lr;
    r->plan.sched.total_steps = r->plan.total_steps;
    /* A warmup longer than the run (a shipped config on the mini data set) is clamped to the run: the lr rises
       to train.optimizer.lr at the last step. It depends on the config and the data only, so a resumed run
       clamps alike; the stored config keeps the value as written. */
    if (r->plan.total_steps > 0 && r->plan.sched.warmup_steps > r->plan.total_steps) {
        fprintf(stderr, "qtrain: warning: %s: train.schedule.warmup_steps %" PRId64 " is longer than the run's %"
                PRId64 " steps (%s); the warmup is clamped to %" PRId64 " steps\n", r->cfg->source,
                r->plan.sched.warmup_steps, r->plan.total_steps,
                tc->steps > 0 ? "train.steps" : "train.epochs x steps per epoch", r->plan.total_steps);
        r->plan.sched.warmup_steps = r->plan.total_steps;
    }
    QtError e = {0};
    if (r->plan.total_steps > 0 && lr_schedule_validate(&r->plan.sched, &e) != QT_OK)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: train.schedule: %s (the run has %" PRId64 " steps: %s)",
                            r->cfg->source, e.msg, r->plan.total_steps,
                            tc->steps > 0 ? "train.steps" : "train.epochs x steps per epoch");
    return QT_OK;
}

QtStatus run_alloc(Run *r, QtError *err) {
    const TrainConfig *tc = &r->cfg->train;
    size_t feat = (size_t)r->data.train.feat;
    /* No batch is ever larger than its data set. */
    int bs = tc->batch_size < r->data.train.n ? tc->batch_size : r->data.train.n;
    int eval_n = r->data.test.n > r->data.val.n ? r->data.test.n : r->data.val.n;
    int ebs = tc->eval_batch_size < eval_n ? tc->eval_batch_size : eval_n;
    r->work.bx = malloc((size_t)(bs > 0 ? bs : 1) * feat * sizeof(float));
    r->work.by = malloc((size_t)(bs > 0 ? bs : 1) * sizeof(int32_t));
    r->work.ex = malloc((size_t)(ebs > 0 ? ebs : 1) * feat * sizeof(float));
    r->work.ey = malloc((size_t)(ebs > 0 ? ebs : 1) * sizeof(int32_t));
    bool more_ok = true;
    size_t k = (size_t)r->data.train.n_targets;
    if (r->data.train.targets) {
        r->work.bt = malloc((size_t)(bs > 0 ? bs : 1) * k * sizeof(float));
        r->work.et = malloc((size_t)(ebs > 0 ? ebs : 1) * k * sizeof(float));
        more_ok = r->work.bt && r->work.et;
    }
    size_t n_test = (size_t)(r->data.test.n > 0 ? r->data.test.n : 1);
    if (r->cfg->data.target == DATA_TARGET_INPUT && !(r->work.scores = malloc(n_test * sizeof(float))))
        more_ok = false;
    if (r->cfg->data.n_anomaly_classes > 0 && !(r->work.auc = malloc(n_test * sizeof(AucItem)))) more_ok = false;
    if (!r->work.bx || !r->work.by || !r->work.ex || !r->work.ey || !more_ok ||
        arena_init(&r->work.arena, RUN_ARENA_INITIAL) != 0)
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory allocating batches (batch_size %d, eval_batch_size %d)",
                            tc->batch_size, tc->eval_batch_size);
    rng_init(&r->work.dropout, r->cfg->run.seed, RNG_STREAM_DROPOUT);
    return tape_init(&r->work.tape, &r->work.arena, &r->work.dropout, err);
}

CheckpointState run_checkpoint_state(Run *r) {
    CheckpointState s = {
        .step = r->plan.step, .epochs_done = r->plan.step / r->plan.steps_per_epoch, .epoch = r->plan.batcher.epoch,
        .cursor = r->plan.batcher.cursor, .seed = r->cfg->run.seed,
        .n_train = r->data.train.n, .log_loss_sum = r->log.win_loss_sum, .log_correct = r->log.win_correct,
        .log_seen = r->log.win_seen, .log_steps = r->log.win_steps, .train_s = r->clock.train_s,
        .wall_s = r->clock.wall_before + metrics_now() - r->clock.t_start,
        .trained_examples = r->clock.trained_examples,
        .last_train_loss = r->log.last_train_loss, .nonfinite_skipped = r->guards.nonfinite_skipped,
        .nonfinite_streak = r->guards.nonfinite_streak,
        .loss_watch = r->guards.loss_watch, .n_rngs = 1, .config_text = r->dir.config_text,
        .net = net_checkpoint_parts(&r->model.net),
        .base_sha256 = r->dir.base_sha256[0] ? r->dir.base_sha256 : NULL, .base_init_from = r->cfg->model.init_from,
        .lora_trainable = r->dir.lora_trainable, .mode = net_mode_name(&r->model.net),
        .lora_batchnorm = config_has_lora(r->cfg) ? LORA_BATCHNORM_NAMES[r->cfg->lora.batchnorm] : NULL,
        .bn_trained = r->model.net.bn_trained, .world_size = r->dist.d ? r->dist.d->world : 1,
    };
    s.rngs[0].name = "dropout";
    s.rngs[0].rng = &r->work.dropout;
    return s;
}

/* Refuses a resume whose config would not continue the same run, and
 * reports training keys that changed. */
static QtStatus run_check_resume_config(Run *r, const char *path, QtError *err) {
    char *text = NULL;
    QtStatus st = checkpoint_read_config(path, &text, err);
    if (st != QT_OK) return st;
    Config *stored = malloc(sizeof *stored);
    QtError e = {0};
    char name[CONFIG_PATH_MAX + 16];
    snprintf(name, sizeof name, "%s:/config", path);
    if (!stored) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory reading the config of %s", path);
    else if (config_load_string(stored, text, name, NULL, 0, &e) != QT_OK)
        st = qt_error_set(err, QT_ERR_FORMAT, "cannot resume from %s: its stored config does not load: %s", path,
                          e.msg);
    free(text);
    char fixed[96] = "", changed[512] = "";
    if (st == QT_OK) config_diff_for_resume(stored, r->cfg, fixed, sizeof fixed, changed, sizeof changed);
    free(stored);
    if (st != QT_OK) return st;
    if (fixed[0])
        return qt_error_set(err, QT_ERR_CONFIG,
                            "cannot resume from %s: %s differs from the checkpoint's config, so the resumed run "
                            "would not continue the same run; restore it (`qtrain inspect %s` shows the stored "
                            "config) or start afresh in another run.out_dir",
                            path, fixed, path);
    if (changed[0] && !r->opt->quiet)
        fprintf(stderr, "qtrain: warning: resuming with a changed %s: the run continues, but will not match an "
                "uninterrupted run of either config\n", changed);
    return QT_OK;
}

/* Restores everything that decides the rest of the run from `path`. */
QtStatus run_restore(Run *r, const char *path, QtError *err) {
    CheckpointState s = run_checkpoint_state(r);
    QtStatus st = checkpoint_load(path, &r->model.net.model, &r->model.optim, &s, err);
    if (st != QT_OK) return st;
    if (s.n_train != r->data.train.n)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "cannot resume from %s: it was trained on %" PRId64 " training examples, this config "
                            "loads %d from %s; point data.dir at the same data or start a new run.out_dir",
                            path, s.n_train, r->data.train.n, r->cfg->data.dir);
    if (s.step > r->plan.total_steps)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "cannot resume from %s: it is at step %" PRId64 ", beyond this config's %" PRId64
                            " training steps; raise train.steps or train.epochs",
                            path, s.step, r->plan.total_steps);
    if (s.cursor > r->data.train.n) /* checked here: the int batcher_seek takes would wrap a larger one */
        return qt_error_set(err, QT_ERR_FORMAT,
                            "cannot resume from %s: its data position (cursor %" PRId64 ") is past the %d training "
                            "examples; the checkpoint is damaged",
                            path, s.cursor, r->data.train.n);
    if ((st = batcher_seek(&r->plan.batcher, s.epoch, (int)s.cursor, err)) != QT_OK) return st;
    r->plan.step = r->dir.saved_step = s.step;
    r->log.win_loss_sum = s.log_loss_sum;
    r->log.win_correct = s.log_correct, r->log.win_seen = s.log_seen, r->log.win_steps = s.log_steps;
    r->clock.train_s = s.train_s, r->clock.wall_before = s.wall_s;
    r->clock.trained_examples = s.trained_examples, r->log.last_train_loss = s.last_train_loss;
    r->guards.nonfinite_skipped = s.nonfinite_skipped, r->guards.nonfinite_streak = s.nonfinite_streak;
    r->guards.loss_watch = s.loss_watch;
    r->dist.ckpt_world = s.world_size;
    return QT_OK;
}

/* run_restore, and whether the run it continues is already complete. */
static QtStatus run_resume_from(Run *r, const char *path, QtError *err) {
    QtStatus st = run_restore(r, path, err);
    if (st != QT_OK) return st;
    if (r->opt->stop_at_step > 0 && r->opt->stop_at_step < r->plan.step)
        return qt_error_set(err, QT_ERR_ARG, "--stop-at-step %" PRId64 " is before step %" PRId64 " of %s",
                            r->opt->stop_at_step, r->plan.step, path);
    /* Complete once summary.json is written: a run stopped after its last
     * step (a signal, or a crash during the final save) still owes its final
     * evaluation, final.h5 and summary.json. */
    char summary[CONFIG_PATH_MAX + 32];
    snprintf(summary, sizeof summary, "%s/summary.json", r->cfg->run.out_dir);
    r->dir.already_complete = r->plan.step == r->plan.total_steps && access(summary, F_OK) == 0;
    return QT_OK;
}

/* The checkpoint to resume from into `used` ("" = a fresh start): --resume
 * PATH, or --resume auto = the newest in out_dir if any. A fresh start in an
 * out_dir that holds another run's checkpoints is refused: it would mix two
 * runs' files, and a later --resume auto would pick up the old one. */
static QtStatus run_find_checkpoint(Run *r, char *used, size_t cap, QtError *err) {
    const char *resume = r->opt->resume, *dir = r->cfg->run.out_dir;
    used[0] = '\0';
    if (resume && strcmp(resume, "auto") != 0) {
        snprintf(used, cap, "%s", resume);
        return QT_OK;
    }
    char latest[CONFIG_PATH_MAX + 32];
    QtError none = {0};
    bool have = checkpoint_find_latest(dir, latest, sizeof latest, &none) == QT_OK;
    if (have && resume) snprintf(used, cap, "%s", latest);
    else if (have)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "run.out_dir %s already holds checkpoints of an earlier run (%s); continue it with "
                            "--resume auto, or start afresh with another run.out_dir (or remove the old files)",
                            dir, latest);
    return QT_OK;
}

int run_count_correct(const Var *logits, const int32_t *y, int n) {
    int classes = logits->value.shape[1], correct = 0;
    for (int i = 0; i < n; i++) {
        const float *z = logits->value.data + (size_t)i * (size_t)classes;
        int best = 0;
        for (int c = 1; c < classes; c++) best = z[c] > z[best] ? c : best;
        correct += best == y[i];
    }
    return correct;
}

/* A Var over the first n examples of a batch buffer, shaped (n, input...). */
Var *run_wrap_batch(Run *r, float *x, int n) {
    int shape[4] = {n};
    const Model *m = &r->model.net.model;
    for (int i = 0; i < m->input_ndim; i++) shape[1 + i] = m->input_shape[i];
    return tape_wrap(&r->work.tape, x, 1 + m->input_ndim, shape);
}

/* The loss of a batch's output `out` (n, ...): cross-entropy against the
 * labels y, or the mean squared error against the input x itself
 * (data.target: input) or the value targets t, viewed in out's shape
 * (run_check_mse_fits made the sizes agree). */
Var *run_loss(Run *r, Var *out, float *x, const int32_t *y, float *t) {
    Tape *tp = &r->work.tape;
    if (!out) return NULL;
    if (r->cfg->train.loss == LOSS_CROSS_ENTROPY) return nn_softmax_cross_entropy(tp, out, y);
    float *want = r->cfg->data.target == DATA_TARGET_INPUT ? x : t;
    return nn_mse(tp, out, tape_wrap(tp, want, out->value.ndim, out->value.shape));
}

/* An evaluation's running sums. */
typedef struct {
    double loss_sum;  /* n * each batch's mean loss */
    int64_t correct;  /* cross_entropy: right predictions */
    double abs_sum;   /* mse: sum of |output - target| over every value */
    int64_t values;   /* mse: the values summed */
} EvalSums;

/* mse: the absolute errors, and with scores (n) each example's mean squared error. */
static void run_sum_errors(const Var *out, const float *want, int n, EvalSums *sums, float *scores) {
    size_t k = var_numel(out) / (size_t)n;
    for (int i = 0; i < n; i++) {
        const float *o = out->value.data + (size_t)i * k, *w = want + (size_t)i * k;
        double sq = 0.0, ab = 0.0;
        for (size_t j = 0; j < k; j++) {
            double dlt = (double)o[j] - (double)w[j];
            sq += dlt * dlt, ab += fabs(dlt);
        }
        sums->abs_sum += ab;
        if (scores) scores[i] = (float)(sq / (double)k);
    }
    sums->values += (int64_t)k * n;
}

/* run_eval_batch with every sum; scores (may be NULL): [n] the examples' reconstruction errors; logits (may be
 * NULL): (n, width) the outputs. */
static QtStatus run_eval_batch_sums(Run *r, const Dataset *d, int start, int n, EvalSums *sums, float *scores,
                                    float *logits, QtError *err) {
    Tape *t = &r->work.tape;
    QtError e = {0};
    if (dataset_fill_range(d, start, n, r->work.ex, r->work.ey, &e) != QT_OK)
        return qt_error_set(err, e.status, "evaluation at step %" PRId64 ": %s", r->plan.step, e.msg);
    if (r->work.et && !dataset_fill_targets_range(d, start, n, r->work.et))
        return qt_error_set(err, QT_ERR_FORMAT, "evaluation at step %" PRId64 ": the %s split has no value targets, "
                            "though the training split has; the data set is inconsistent", r->plan.step,
                            d == &r->data.test ? "test" : "validation");
    Var *out = model_forward(&r->model.net.model, t, run_wrap_batch(r, r->work.ex, n));
    Var *l = run_loss(r, out, r->work.ex, r->work.ey, r->work.et);
    QtStatus st = QT_OK;
    if (!l) {
        st = qt_error_set(err, t->err.status, "evaluation at step %" PRId64 ": %s", r->plan.step, t->err.msg);
    } else {
        sums->loss_sum += (double)l->value.data[0] * n;
        if (logits) memcpy(logits, out->value.data, var_numel(out) * sizeof(float));
        if (r->cfg->train.loss == LOSS_CROSS_ENTROPY) sums->correct += run_count_correct(out, r->work.ey, n);
        else run_sum_errors(out, r->cfg->data.target == DATA_TARGET_INPUT ? r->work.ex : r->work.et, n, sums, scores);
    }
    tape_reset(t);
    return st;
}

QtStatus run_eval_batch(Run *r, const Dataset *d, int start, int n, double *loss_sum, int64_t *correct,
                        QtError *err) {
    EvalSums sums = {0};
    QtStatus st = run_eval_batch_sums(r, d, start, n, &sums, NULL, NULL, err);
    *loss_sum += sums.loss_sum, *correct += sums.correct;
    return st;
}

/* Mean loss over a whole data set, forward only, and accuracy
 * (cross_entropy) or the mean absolute error (*mae; mse; accuracy NaN).
 * With data.target: input, the test split's evaluation also records each
 * example's reconstruction error (work.scores) and the AUC. */
static QtStatus run_evaluate(Run *r, const Dataset *d, double *loss, double *accuracy, double *mae, QtError *err) {
    Tape *t = &r->work.tape;
    bool was_training = t->training, had_grad = t->grad_enabled;
    t->training = false, t->grad_enabled = false;
    EvalSums sums = {0};
    float *scores = d == &r->data.test ? r->work.scores : NULL;
    float *logits = d == &r->data.test ? r->eval.logits : NULL;
    QtStatus st = QT_OK;
    int bs = r->cfg->train.eval_batch_size;
    /* Data-parallel: rank k evaluates batches k, k + world, ...; the sums (and each example's score) then go to
       every rank */
    bool split = run_is_dist(r) && r->dist.live;
    int stride = split ? r->dist.d->world : 1, first = split ? r->dist.d->rank : 0;
    if (split && scores) memset(scores, 0, (size_t)d->n * sizeof *scores);
    for (int b = first; (int64_t)b * bs < d->n && st == QT_OK; b += stride) {
        int start = b * bs;
        st = run_eval_batch_sums(r, d, start, d->n - start < bs ? d->n - start : bs, &sums,
                                 scores ? scores + start : NULL,
                                 logits ? logits + (size_t)start * r->eval.logits_width : NULL, err);
    }
    if (split && st == QT_OK) {
        double v[4] = {sums.loss_sum, (double)sums.correct, sums.abs_sum, (double)sums.values};
        st = run_dist_eval_sums(r, v, 4, scores, scores ? d->n : 0, err);
        sums = (EvalSums){v[0], (int64_t)v[1], v[2], (int64_t)v[3]};
    }
    t->training = was_training, t->grad_enabled = had_grad;
    bool mse = r->cfg->train.loss == LOSS_MSE;
    *loss = d->n ? sums.loss_sum / d->n : NAN;
    *accuracy = d->n && !mse ? (double)sums.correct / d->n : NAN;
    *mae = sums.values ? sums.abs_sum / (double)sums.values : NAN;
    if (scores) {
        r->eval.have_scores = st == QT_OK;
        r->eval.test_auc = st == QT_OK ? run_test_auc(r) : NAN;
    }
    return st;
}

static double run_epoch(const Run *r) { return (double)r->plan.step / (double)r->plan.steps_per_epoch; }

static void run_say(Run *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void run_say(Run *r, const char *fmt, ...) {
    if (r->opt->quiet || !run_is_root(r)) return;
    progress_clear(&r->log.progress);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
}

/* Evaluates val (if any) and test, logs and records both. */
QtStatus run_eval_and_log(Run *r, double *test_loss, double *test_acc, double *val_loss, double *val_acc,
                          QtError *err) {
    double wall = r->clock.wall_before + metrics_now() - r->clock.t_start;
    *val_loss = *val_acc = -1.0;
    r->eval.val_mae = NAN;
    QtStatus st = QT_OK;
    char tail[64];
    if (r->data.val.n > 0 && (st = run_evaluate(r, &r->data.val, val_loss, val_acc, &r->eval.val_mae, err)) == QT_OK) {
        run_eval_tail(r, *val_acc, r->eval.val_mae, false, tail, sizeof tail);
        run_say(r, "eval step:%" PRId64 " epoch:%.2f split:val loss:%.4f %s\n", r->plan.step, run_epoch(r),
                *val_loss, tail);
        if (run_is_root(r))
            st = metrics_write(&r->log.metrics, "val", r->plan.step, run_epoch(r), *val_loss, *val_acc, 0.0, 0.0,
                               wall, err);
    }
    if (st == QT_OK && (st = run_evaluate(r, &r->data.test, test_loss, test_acc, &r->eval.test_mae, err)) == QT_OK) {
        run_eval_tail(r, *test_acc, r->eval.test_mae, true, tail, sizeof tail);
        run_say(r, "eval step:%" PRId64 " epoch:%.2f split:test loss:%.4f %s\n", r->plan.step, run_epoch(r),
                *test_loss, tail);
        if (run_is_root(r))
            st = metrics_write(&r->log.metrics, "test", r->plan.step, run_epoch(r), *test_loss, *test_acc, 0.0, 0.0,
                               wall, err);
    }
    return st;
}

/* The divergence watch: reported once when an occurrence starts. */
void run_watch_loss(Run *r, double loss) {
    double fast, slow, factor = r->cfg->train.divergence_factor;
    if (!loss_watch_feed(&r->guards.loss_watch, loss, factor, &fast, &slow) || !run_is_root(r)) return;
    progress_clear(&r->log.progress);
    fprintf(stderr, "qtrain: warning: step:%" PRId64 " the training loss is diverging: its mean over the last ~10 "
            "steps, %.4f, is %.1fx its running mean %.4f (train.divergence_factor %g; occurrence %" PRId64 "); lower "
            "train.optimizer.lr or set train.grad_clip\n", r->plan.step + 1, fast, fast / slow, slow, factor,
            r->guards.loss_watch.occurrences);
}

/* Where the last good state of the run is, for a message about stopping. */
static void run_last_good(const Run *r, char *buf, size_t cap) {
    if (r->dir.saved_step >= 0)
        snprintf(buf, cap, "the last good checkpoint, step %" PRId64 ", is kept in %s", r->dir.saved_step,
                 r->cfg->run.out_dir);
    else
        snprintf(buf, cap, "no checkpoint had been written yet (set train.checkpoint_every to keep some)");
}

/* A step whose loss or gradients are not finite: stop (naming the step,
 * module and tensor), or with train.on_nonfinite: skip drop its update. */
static QtStatus run_nonfinite(Run *r, Var *x, double loss, const char *grad_where, QtError *err) {
    char where[512];
    if (grad_where) {
        snprintf(where, sizeof where, "%s (the loss %.6g is finite)", grad_where, loss);
    } else {
        /* the step's values are not needed: the forward runs again, module by module, on the batch (a copy of
           its Var: the one the step made lives in the arena the reset hands out again) */
        Var batch = *x;
        tape_reset(&r->work.tape);
        guard_locate_nonfinite_forward(&r->model.net.model, &r->work.tape, &batch, r->model.net.trainable,
                                       r->model.net.n_trainable, where, sizeof where);
    }
    return run_nonfinite_at(r, !grad_where, where, err);
}

QtStatus run_nonfinite_at(Run *r, bool is_loss, const char *where, QtError *err) {
    char good[CONFIG_PATH_MAX + 96];
    int64_t step = r->plan.step + 1;
    run_last_good(r, good, sizeof good);
    if (r->cfg->train.on_nonfinite == NONFINITE_STOP)
        return qt_error_set(err, QT_ERR_VALUE, "step %" PRId64 ": the training %s is not finite: %s. Stopped "
                            "without this step's update; %s. Lower train.optimizer.lr or set train.grad_clip, or set "
                            "train.on_nonfinite: skip to drop such steps", step, is_loss ? "loss" : "gradient",
                            where, good);
    if (r->guards.nonfinite_streak + 1 >= GUARD_MAX_SKIPS_IN_A_ROW)
        return qt_error_set(err, QT_ERR_VALUE, "step %" PRId64 ": the training %s has not been finite for %d steps in "
                            "a row (%" PRId64 " skipped in all): %s. Skipping cannot mend the model; stopped; %s. "
                            "Lower train.optimizer.lr or set train.grad_clip", step,
                            is_loss ? "loss" : "gradient", GUARD_MAX_SKIPS_IN_A_ROW,
                            r->guards.nonfinite_skipped + 1, where, good);
    r->guards.nonfinite_skipped++, r->guards.nonfinite_streak++;
    progress_clear(&r->log.progress);
    if (run_is_root(r))
        fprintf(stderr, "qtrain: warning: step:%" PRId64 " skipped (train.on_nonfinite: skip, %" PRId64 " so far): "
                "the %s is not finite: %s\n", step, r->guards.nonfinite_skipped, is_loss ? "loss" : "gradient",
                where);
    optim_zero_grad(&r->model.optim);
    tape_reset(&r->work.tape);
    r->plan.step++; /* the batch is used up and the schedule moves on; the optimizer's own count does not */
    return QT_OK;
}

/* An update that left a parameter non-finite from a finite loss and finite
 * gradients (an overflowing step, a damaged optimizer state). It always
 * stops, train.on_nonfinite: skip too: the update is applied and cannot be
 * taken back (the optimizer's moments moved with it), and the state is not
 * saved, so the newest checkpoint stays the last good one. */
QtStatus run_nonfinite_update(Run *r, double loss, const char *where, QtError *err) {
    char good[CONFIG_PATH_MAX + 96];
    run_last_good(r, good, sizeof good);
    return qt_error_set(err, QT_ERR_VALUE, "step %" PRId64 ": the optimizer update left a parameter non-finite: %s "
                        "(the loss %.6g and the gradients were finite, so the update overflowed or the optimizer "
                        "state is damaged). Stopped without saving this state (train.on_nonfinite: skip cannot undo "
                        "an applied update); %s. Lower train.optimizer.lr or set train.grad_clip, or resume from an "
                        "earlier checkpoint", r->plan.step + 1, where, loss, good);
}

/* One optimizer step on the next batch. */
QtStatus run_step(Run *r, QtError *err) {
    Tape *t = &r->work.tape;
    QtError e = {0};
    int n = 0;
    if (batcher_next(&r->plan.batcher, r->work.bx, r->work.by, &n, NULL, &e) != QT_OK)
        return qt_error_set(err, e.status, "step %" PRId64 ": %s", r->plan.step + 1, e.msg);
    if (r->cfg->data.augment.n > 0) { /* training batches only: evaluation never augments */
        const uint32_t *idx;
        int64_t epoch;
        batcher_last_batch(&r->plan.batcher, n, &idx, &epoch);
        augment_batch(&r->cfg->data.augment, r->cfg->run.seed, epoch, idx, n, r->data.train.shape, r->work.bx);
    }
    /* the batch's examples are the n before the batcher's cursor */
    if (r->work.bt)
        dataset_fill_targets(&r->data.train, r->plan.batcher.order + r->plan.batcher.cursor - n, n, r->work.bt);
    Var *x = run_wrap_batch(r, r->work.bx, n);
    net_set_step(&r->model.net, r->plan.step);
    Var *logits = model_forward(&r->model.net.model, t, x);
    /* the loss op refuses non-finite logits; they are this guard's to report */
    if (logits && floats_first_nonfinite(logits->value.data, var_numel(logits)) < var_numel(logits))
        return run_nonfinite(r, x, NAN, NULL, err);
    Var *loss = run_loss(r, logits, r->work.bx, r->work.by, r->work.bt);
    if (tape_backward(t, loss) != QT_OK)
        return qt_error_set(err, t->err.status, "step %" PRId64 ": %s", r->plan.step + 1, t->err.msg);
    double l = loss->value.data[0];
    if (!isfinite(l)) return run_nonfinite(r, x, l, NULL, err);
    int64_t correct = r->cfg->train.loss == LOSS_CROSS_ENTROPY ? run_count_correct(logits, r->work.by, n) : 0;
    return run_update(r, l, correct, n, err);
}

QtStatus run_update(Run *r, double l, int64_t correct, int n, QtError *err) {
    char grad_where[384];
    /* With clipping, its norm pass finds a non-finite gradient for free (the
     * norm is then non-finite too); without, one scan of the gradients. */
    float clip = r->cfg->train.grad_clip;
    double gnorm = clip > 0 ? optim_grad_norm(r->model.net.trainable, r->model.net.n_trainable) : 0.0;
    bool finite = clip > 0 ? isfinite(gnorm)
                           : guard_grads_finite(r->model.net.trainable, r->model.net.n_trainable, NULL, 0);
    if (!finite) { /* name the tensor: only on this rare path is the scan repeated for it */
        char where[512];
        guard_grads_finite(r->model.net.trainable, r->model.net.n_trainable, grad_where, sizeof grad_where);
        snprintf(where, sizeof where, "%s (the loss %.6g is finite)", grad_where, l);
        return run_nonfinite_at(r, false, where, err);
    }
    r->guards.nonfinite_streak = 0;
    r->log.win_loss_sum += l;
    r->log.win_correct += correct;
    r->log.win_seen += n, r->log.win_steps++;
    run_watch_loss(r, l);
    if (clip > 0) optim_clip_grads_to_norm(r->model.net.trainable, r->model.net.n_trainable, gnorm, clip);
    optim_step(&r->model.optim, lr_schedule_at(&r->plan.sched, r->plan.step));
    optim_zero_grad(&r->model.optim);
    if (!guard_params_finite(r->model.net.trainable, r->model.net.n_trainable, grad_where, sizeof grad_where))
        return run_nonfinite_update(r, l, grad_where, err);
    QtStatus st = net_check_ranges(&r->model.net, r->plan.step + 1, err);
    if (st != QT_OK) return st;
    tape_reset(&r->work.tape);
    r->plan.step++;
    r->clock.trained_examples += n;
    return QT_OK;
}

static QtStatus run_log_window(Run *r, double samples_per_s, double window_s, QtError *err) {
    double loss = r->log.win_loss_sum / (double)r->log.win_steps;
    bool mse = r->cfg->train.loss == LOSS_MSE; /* no accuracy: an empty metrics cell, none in the line */
    double acc = mse ? NAN : (double)r->log.win_correct / (double)r->log.win_seen;
    double lr = lr_schedule_at(&r->plan.sched, r->plan.step - 1);
    char acc_s[32] = "";
    if (!mse) snprintf(acc_s, sizeof acc_s, " acc:%.4f", acc);
    char skipped[48] = ""; /* train.on_nonfinite: skip: the steps dropped so far, once there are any */
    if (r->guards.nonfinite_skipped > 0)
        snprintf(skipped, sizeof skipped, " skipped:%" PRId64, r->guards.nonfinite_skipped);
    char comm[32] = ""; /* data-parallel: the share of the window's step time spent in the ranks' collectives */
    if (run_is_dist(r)) {
        snprintf(comm, sizeof comm, " comm:%.0f%%", window_s > 0 ? 100.0 * r->dist.step_comm_s / window_s : 0.0);
        r->dist.step_comm_s = 0.0;
    }
    run_say(r, "step:%" PRId64 " epoch:%.2f loss:%.4f%s lr:%.6g samples/s:%.0f%s%s\n", r->plan.step, run_epoch(r),
            loss, acc_s, lr, samples_per_s, comm, skipped);
    r->log.win_loss_sum = 0.0;
    r->log.win_correct = r->log.win_seen = r->log.win_steps = 0;
    if (!run_is_root(r)) return QT_OK;
    return metrics_write(&r->log.metrics, "train", r->plan.step, run_epoch(r), loss, acc, lr, samples_per_s,
                         r->clock.wall_before + metrics_now() - r->clock.t_start, err);
}

/* A checkpoint in out_dir, and for a LoRA run adapters.h5 beside it. */
static QtStatus run_save(Run *r, const char *name, char *saved, size_t cap, QtError *err) {
    r->dir.saved_step = r->plan.step;
    if (run_is_dist(r)) { /* every rank checks; rank 0 alone writes */
        QtStatus st = run_dist_check_replicas(r, err);
        if (st != QT_OK || !run_is_root(r)) return st;
    }
    CheckpointState s = run_checkpoint_state(r);
    QtStatus st = checkpoint_save_in_dir(r->cfg->run.out_dir, name, r->cfg->train.keep_last, &r->model.net.model,
                                         &r->model.optim, &s, saved, cap, err);
    if (st != QT_OK || !config_has_lora(r->cfg)) return st;
    char path[CONFIG_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/adapters.h5", r->cfg->run.out_dir);
    return checkpoint_save_adapters(path, &r->model.net.model, &s, err);
}

/* The step loop, from r->plan.step to total_steps. */
static QtStatus run_loop(Run *r, QtError *err) {
    const TrainConfig *tc = &r->cfg->train;
    double train_window_s = 0.0;
    int64_t window_examples = 0;
    QtStatus st = QT_OK;
    int64_t stop = r->opt->stop_at_step > 0 ? r->opt->stop_at_step : INT64_MAX;
    /* A stop signal ends the loop after the step it lands in (interrupt.h). */
    while (st == QT_OK && r->plan.step < r->plan.total_steps && r->plan.step < stop && !run_stop_signal(r)) {
        double t0 = metrics_now();
        int64_t before = r->clock.trained_examples;
        if ((st = run_is_dist(r) ? run_dist_step(r, err) : run_step(r, err)) != QT_OK) break;
        double dt = metrics_now() - t0;
        r->clock.train_s += dt, train_window_s += dt;
        window_examples += r->clock.trained_examples - before;
        bool last = r->plan.step == r->plan.total_steps;
        if ((tc->log_every > 0 && r->plan.step % tc->log_every == 0) || last) {
            if (r->log.win_steps) /* else all skipped */
                r->log.last_train_loss = r->log.win_loss_sum / (double)r->log.win_steps;
            st = run_log_window(r, window_examples / (train_window_s > 0 ? train_window_s : 1e-9), train_window_s,
                                err);
            window_examples = 0, train_window_s = 0.0;
        }
        /* A stop signal's checkpoint comes right after the loop. A due
         * evaluation still runs first: its rows belong to this step, and
         * the resume starts after it. */
        if (st == QT_OK && tc->eval_every > 0 && r->plan.step % tc->eval_every == 0 && !last) {
            double tl, ta, vl, va;
            st = run_eval_and_log(r, &tl, &ta, &vl, &va, err);
        }
        bool stopping = run_stop_signal(r) != 0;
        if (st == QT_OK && tc->checkpoint_every > 0 && r->plan.step % tc->checkpoint_every == 0 && !last && !stopping)
            st = run_save(r, NULL, NULL, 0, err);
        progress_update(&r->log.progress, r->plan.step, r->plan.total_steps,
                        r->log.win_steps ? r->log.win_loss_sum / (double)r->log.win_steps : r->log.last_train_loss,
                        metrics_now());
    }
    progress_clear(&r->log.progress);
    return st;
}

/* Totals over every invocation of the run (a resumed run carries them in
 * its checkpoint). */
void run_fill_result(const Run *r, TrainResult *res) {
    res->steps = r->plan.step;
    res->epochs = run_epoch(r);
    res->wall_s = r->clock.wall_before + metrics_now() - r->clock.t_start;
    res->samples_per_s = r->clock.train_s > 0 ? (double)r->clock.trained_examples / r->clock.train_s : 0.0;
    res->train_loss = r->log.last_train_loss;
    res->params_trainable = (int64_t)net_params_trainable(&r->model.net);
    res->params_frozen = (int64_t)net_params_frozen(&r->model.net);
    res->model_bytes = (int64_t)net_model_bytes(&r->model.net);
    res->base_bits_per_param = net_base_bits_per_param(&r->model.net);
    res->mode = net_mode_name(&r->model.net);
    struct rusage ru;
    res->peak_rss_mb = getrusage(RUSAGE_SELF, &ru) == 0 ? (double)ru.ru_maxrss / 1024.0 : 0.0;
    res->world_size = r->dist.d ? r->dist.d->world : 1;
    /* the gradients' sum and the step's loss, counts and flags */
    res->allreduce_bytes_per_step = run_is_dist(r) ? (double)(dist_sum_bytes_sent(r->dist.d, r->dist.n_grad) +
                                                     (uint64_t)(r->dist.d->world - 1) * (RUN_DIST_META +
                                                     (uint64_t)r->dist.d->world) * sizeof(double)) : 0.0;
}

static void run_print_plan(Run *r, const char *resumed) {
    if (r->opt->quiet || !run_is_root(r)) return;
    const Config *c = r->cfg;
    printf("qtrain %s: config %s\n--- resolved config ---\n%s--- end of config ---\n", QTRAIN_VERSION, c->source,
           r->dir.config_text);
    const Dataset *tr = &r->data.train;
    const bool files = strcmp(c->data.dataset, "npy") == 0 || strcmp(c->data.dataset, "idx") == 0;
    const char *from = strcmp(c->data.dataset, "hdf5") == 0 ? c->data.path : files ? c->data.files.train_x : c->data.dir;
    char shape[64], what[64];
    if (tr->ndim == 3) snprintf(shape, sizeof shape, "(%d, %d, %d)", tr->shape[0], tr->shape[1], tr->shape[2]);
    else snprintf(shape, sizeof shape, "(%d,)", tr->shape[0]);
    if (tr->labels) snprintf(what, sizeof what, "%d classes", tr->n_classes);
    else snprintf(what, sizeof what, "%d target value%s", tr->n_targets, tr->n_targets == 1 ? "" : "s");
    printf("data: %s from %s: %d train, %d val, %d test examples of %s %s, %s\n", c->data.dataset, from, tr->n,
           r->data.val.n, r->data.test.n, shape, data_elem_name(tr->elem), what);
    const char *images = dataset_image_file(&r->data.train);
    printf("data: examples (data.storage %s) %s%s\n", data_storage_name(c->data.storage),
           images ? "read at every batch from " : "held in memory", images ? images : "");
    printf("blas: OpenBLAS %s kernels, %d threads\n", gemm_blas_core(), gemm_get_threads());
    const char *better = gemm_blas_core_upgrade(), *pinned = getenv("OPENBLAS_CORETYPE");
    if (better && pinned)
        printf("blas: OPENBLAS_CORETYPE=%s pins older kernels than this CPU runs; unset it (or set "
               "OPENBLAS_CORETYPE=%s) for about twice the sgemm throughput\n", pinned, better);
    printf("model:\n");
    model_print(&r->model.net.model, stdout);
    printf("plan: %" PRId64 " steps (%" PRId64 " per epoch, batch %d), %s lr %g, %s schedule, out_dir %s\n",
           r->plan.total_steps, r->plan.steps_per_epoch, c->train.batch_size, optim_kind_name(c->train.optim.kind),
           (double)c->train.optim.lr, sched_kind_name(c->train.schedule.kind), c->run.out_dir);
    if (run_is_dist(r)) {
        const Dist *d = r->dist.d;
        int lo = c->train.batch_size / d->world, hi = (c->train.batch_size + d->world - 1) / d->world;
        char each[32];
        snprintf(each, sizeof each, lo == hi ? "%d" : "%d-%d", lo, hi);
        printf("dist: %d ranks (%s), each takes %s examples of every batch of %d; %zu trainable gradient values "
               "summed per step in rank order (%.1f KB sent per rank); batch norm statistics %s\n", d->world,
               d->ops->name, each, c->train.batch_size, r->dist.n_grad,
               (double)dist_sum_bytes_sent(d, r->dist.n_grad) / 1000.0,
               c->train.sync_bn ? "over every rank (train.sync_bn)" : "per rank");
    }
    net_print_table(&r->model.net, stdout);
    if (c->quant.mode != QUANT_MODE_NONE || config_has_lora(c))
        printf("params: %zu trainable, %zu frozen; base %.3f bits/param; model %.1f KiB\n",
               net_params_trainable(&r->model.net), net_params_frozen(&r->model.net),
               net_base_bits_per_param(&r->model.net), (double)net_model_bytes(&r->model.net) / 1024.0);
    if (c->model.init_from[0] && !resumed[0]) printf("init_from: %s\n", c->model.init_from);
    if (c->model.adapters_from[0] && !resumed[0]) printf("adapters_from: %s\n", c->model.adapters_from);
    if (resumed[0]) printf("resumed from %s at step %" PRId64 " (epoch %.2f)\n", resumed, r->plan.step, run_epoch(r));
    fflush(stdout);
}

/* Static activation ranges of a fresh PTQ base: the first
 * quant.calibration_batches training batches, in file order, forward only. */
static QtStatus run_calibrate(Run *r, QtError *err) {
    if (!net_needs_act_calibration(&r->model.net)) return QT_OK;
    Tape *t = &r->work.tape;
    int bs = r->cfg->train.batch_size < r->data.train.n ? r->cfg->train.batch_size : r->data.train.n;
    int batches = r->cfg->quant.calibration_batches;
    if ((int64_t)batches * bs > r->data.train.n) batches = r->data.train.n / bs;
    t->training = false, t->grad_enabled = false;
    net_calib_begin(&r->model.net);
    QtStatus st = QT_OK;
    for (int b = 0; b < batches && st == QT_OK; b++) {
        QtError e = {0};
        if (dataset_fill_range(&r->data.train, b * bs, bs, r->work.bx, r->work.by, &e) != QT_OK)
            st = qt_error_set(err, e.status, "activation calibration, batch %d: %s", b, e.msg);
        else if (!model_forward(&r->model.net.model, t, run_wrap_batch(r, r->work.bx, bs)))
            st = qt_error_set(err, t->err.status, "activation calibration, batch %d: %s", b, t->err.msg);
        tape_reset(t);
    }
    t->grad_enabled = true;
    if (st == QT_OK) st = net_calib_end(&r->model.net, err);
    if (st == QT_OK && !r->opt->quiet)
        printf("calibrated static activation ranges on %d training batches of %d\n", batches, bs);
    return st;
}

/* A run with steps needs something to train. */
static QtStatus run_check_trainable(Run *r, QtError *err) {
    if (r->plan.total_steps == 0 || r->model.net.n_trainable > 0) return QT_OK;
    return qt_error_set(err, QT_ERR_CONFIG, "%s: nothing to train: quant.mode %s freezes the model and there are no "
                        "LoRA adapters or lora.trainable modules; add lora rules, or set train.epochs: 0 to only "
                        "evaluate the quantized model", r->cfg->source, quant_mode_name(r->cfg->quant.mode));
}

QtStatus run_prepare(Run *r, bool fresh, QtError *err) {
    QtStatus st = QT_OK;
    gemm_set_threads(r->cfg->run.threads);
    if ((st = run_load_data(r, err)) != QT_OK) return st;
    if ((st = run_build_model(r, fresh, err)) != QT_OK) return st;
    if ((st = run_plan_steps(r, err)) != QT_OK) return st;
    if ((st = run_check_trainable(r, err)) != QT_OK) return st;
    if ((st = run_alloc(r, err)) != QT_OK) return st;
    return fresh ? run_calibrate(r, err) : QT_OK;
}

QtStatus run_dir_note(Run *r, QtError *err) {
    RunDir *d = &r->dir;
    d->config_text = config_to_yaml(r->cfg);
    if (!d->config_text) return qt_error_set(err, QT_ERR_NOMEM, "out of memory writing the resolved config");
    if (!config_has_lora(r->cfg)) return QT_OK;
    const LoraConfig *l = &r->cfg->lora;
    d->lora_trainable = calloc((size_t)l->n_trainable + 1, MODULE_NAME_MAX + 1);
    if (!d->lora_trainable) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    for (int i = 0; i < l->n_trainable; i++) {
        if (i) strcat(d->lora_trainable, ",");
        strcat(d->lora_trainable, l->trainable[i]);
    }
    CheckpointNet parts = net_checkpoint_parts(&r->model.net);
    return checkpoint_base_sha256(&r->model.net.model, &parts, d->base_sha256, err);
}

/* metrics.csv in out_dir: a new file, or a resumed run's with its rows
 * through the checkpoint's step. */
static QtStatus run_log_open(Run *r, bool resumed, QtError *err) {
    return metrics_open(&r->log.metrics, r->cfg->run.out_dir, resumed ? r->plan.step : -1, err);
}

/* created: the topmost directory of run.out_dir that this call made ("" if none). */
static QtStatus run_setup(Run *r, char *resumed, size_t cap, char *created, size_t created_cap, QtError *err) {
    QtStatus st = QT_OK;
    if ((st = run_dir_open(r, created, created_cap, err)) != QT_OK) return st;
    if ((st = run_find_checkpoint(r, resumed, cap, err)) != QT_OK) return st;
    if (resumed[0] && (st = run_check_resume_config(r, resumed, err)) != QT_OK) return st;
    if ((st = run_prepare(r, !resumed[0], err)) != QT_OK) return st;
    if (resumed[0] && (st = run_resume_from(r, resumed, err)) != QT_OK) return st;
    int world = r->dist.d ? r->dist.d->world : 1;
    if (resumed[0] && r->dist.ckpt_world != world && !r->dir.already_complete) /* even when quiet: it decides bits */
        fprintf(stderr, "qtrain: warning: %s was written by a run on %" PRId64 " rank%s, this one runs on %d: the "
                "run continues with the same global batches in the same order (no example is lost or repeated), "
                "but not bit for bit as an uninterrupted run would\n", resumed, r->dist.ckpt_world,
                r->dist.ckpt_world == 1 ? "" : "s", world);
    if (r->dir.already_complete) return QT_OK; /* leave every output of the finished run as it is */
    if ((st = run_dir_note(r, err)) != QT_OK) return st;
    if ((st = run_log_open(r, resumed[0], err)) != QT_OK) return st;
    /* A checkpoint at a step whose periodic evaluation left no row (a run
     * of an earlier version stopped by a signal in that step skipped it):
     * the evaluation runs now, so metrics.csv ends as an uninterrupted
     * run's. The last step's evaluation is run_finish's. */
    int64_t every = r->cfg->train.eval_every;
    if (resumed[0] && every > 0 && r->plan.step > 0 && r->plan.step % every == 0 &&
        r->plan.step < r->plan.total_steps && !r->log.metrics.kept_test_row) {
        double tl, ta, vl, va;
        st = run_eval_and_log(r, &tl, &ta, &vl, &va, err);
    }
    return st;
}

/* After the last step: evaluate, write final.h5 and summary.json. */
static QtStatus run_finish(Run *r, TrainResult *res, QtError *err) {
    char final_path[CONFIG_PATH_MAX + 32] = "", path[CONFIG_PATH_MAX + 32];
    QtStatus st = run_eval_and_log(r, &res->test_loss, &res->test_accuracy, &res->val_loss, &res->val_accuracy, err);
    if (st == QT_OK) st = run_save(r, "final.h5", final_path, sizeof final_path, err);
    if (st != QT_OK) return st;
    run_fill_result(r, res);
    run_fill_eval_result(r, res);
    if (!run_is_root(r)) return QT_OK;
    snprintf(path, sizeof path, "%s/summary.json", r->cfg->run.out_dir);
    if ((st = write_json_atomically(path, r, res, final_path, false, FS_REPLACE_ANY, err)) != QT_OK) return st;
    char what[96];
    train_result_format(res, what, sizeof what);
    run_say(r, "done: steps:%" PRId64 " %s wall_s:%.1f samples/s:%.0f checkpoint:%s\n", res->steps, what,
            res->wall_s, res->samples_per_s, final_path);
    return QT_OK;
}

/* Stopped before the end (--stop-at-step, or a stop signal `sig`): a
 * checkpoint to resume from, unless the newest one already holds this step
 * or no step has run. A signal after the last step also stops here: the
 * final evaluation then runs when the run is resumed. */
static QtStatus run_stop_early(Run *r, TrainResult *res, int sig, QtError *err) {
    char path[CONFIG_PATH_MAX + 32] = "";
    QtStatus st = QT_OK;
    if (r->dir.saved_step != r->plan.step && r->plan.step > 0) st = run_save(r, NULL, path, sizeof path, err);
    run_fill_result(r, res);
    res->stopped = true;
    res->interrupted = sig;
    if (st != QT_OK) return st;
    if (sig && r->plan.step == 0)
        run_say(r, "interrupted: %s before the first step; nothing to save\n", interrupt_signal_name(sig));
    else if (sig)
        run_say(r, "interrupted: %s at step:%" PRId64 " of %" PRId64 "; checkpoint of step %" PRId64 " in %s; "
                "continue with --resume auto\n", interrupt_signal_name(sig), r->plan.step, r->plan.total_steps,
                r->plan.step, r->cfg->run.out_dir);
    else
        run_say(r, "stopped: step:%" PRId64 " of %" PRId64 "; continue with --resume auto\n", r->plan.step,
                r->plan.total_steps);
    return QT_OK;
}

QtStatus train_run(const Config *cfg, const TrainOptions *o, TrainResult *res, QtError *err) {
    Run r;
    run_init(&r, cfg, o);
    memset(res, 0, sizeof *res);
    char resumed[CONFIG_PATH_MAX + 32], created[CONFIG_PATH_MAX];
    interrupt_set_phase(INTERRUPT_OUTSIDE); /* a stop signal while setting up ends the process at once */
    QtStatus st = run_is_dist(&r) ? run_dist_setup(&r, run_setup, resumed, sizeof resumed, created, sizeof created, err)
                                  : run_setup(&r, resumed, sizeof resumed, created, sizeof created, err);
    if (st == QT_OK && r.dir.already_complete) {
        if (run_is_root(&r)) run_fill_result(&r, res); /* other ranks hold no model: rank 0 reports */
        res->already_complete = true;
        run_say(&r, "done: the run in %s is already complete (step %" PRId64 " of %" PRId64 ", %s); nothing to do\n",
                cfg->run.out_dir, r.plan.step, r.plan.total_steps, resumed);
    } else if (st == QT_OK) {
        /* even when quiet: a rule that applies nowhere is a likely typo */
        if (run_is_root(&r)) net_print_unused_rules(&r.model.net, stderr);
        run_print_plan(&r, resumed);
        progress_init(&r.log.progress, o->progress && !o->quiet && run_is_root(&r) ? stderr : NULL, r.plan.step,
                      metrics_now());
        r.work.tape.training = true;
        interrupt_set_phase(INTERRUPT_IN_LOOP);
        st = run_loop(&r, err);
        int sig = run_stop_signal(&r);
        if (st == QT_OK && r.plan.step == r.plan.total_steps && !sig) {
            interrupt_set_phase(INTERRUPT_FINISHING);
            st = run_finish(&r, res, err);
        } else if (st == QT_OK) {
            st = run_stop_early(&r, res, sig, err);
        }
    }
    if (st != QT_OK) run_undo_failed_start(&r, created); /* no empty directory left behind */
    run_free(&r);
    return st;
}
