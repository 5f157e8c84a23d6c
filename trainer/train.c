/* train.c - a run: data and model from the config, the step loop, eval,
 * checkpoints with exact resume, metrics.csv and summary.json. Its run
 * directories are train_dirs.c's, its JSON files train_json.c's, the
 * evaluation of a checkpoint train_eval.c's, the step plan train_plan.c's,
 * resuming train_resume.c's, the numerical guards train_guard.c's and a run
 * on several ranks train_dist.c's. */
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

double run_epoch(const Run *r) { return (double)r->plan.step / (double)r->plan.steps_per_epoch; }

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
