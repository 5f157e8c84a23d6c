/* train_dist.c - a run on several ranks (trainer/dist.h): data-parallel
 * training with the global batch split across the ranks in rank order.
 *
 * Rank 0 sets the run up as one process would (out_dir, resume, init_from,
 * calibration) and hands its whole state to the other ranks as the bytes of
 * a checkpoint, so every rank starts from the same bits whether the run is
 * fresh or resumed. In each step every rank reads and trains on its part of
 * the batch, seeding its backward with part/batch so that the sum of the
 * ranks' gradients is the global batch's mean-loss gradient; the sum runs
 * in rank order (dist.c), so every rank applies the same update to the
 * same parameters and a rerun gives the same bits. Buffers that a forward
 * changes (batch norms' running statistics, QAT input statistics) follow
 * rank 0's after each step. Rank 0 alone writes checkpoints, metrics and
 * summary.json. */
#include "trainer/run.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "data/augment.h"
#include "trainer/checkpoint.h"
#include "trainer/hook.h"
#include "trainer/interrupt.h"

/* The step's doubles summed over the ranks: then one flag per rank (its part was not finite). */
enum { META_LOSS, META_CORRECT, META_BAD, META_STOP, META_SEEN };

void run_dist_free(RunDist *d) {
    free(d->grads), free(d->work), free(d->meta), free(d->meta_work), free(d->regions), free(d->regions_buf);
    Dist *keep = d->d;
    memset(d, 0, sizeof *d);
    d->d = keep;
}

/* ---- setup ---------------------------------------------------------------------------------------------------- */

/* What rank 0 tells the others once its setup is done. */
typedef struct {
    int64_t status;       /* QtStatus of rank 0's setup */
    int64_t image_bytes;  /* its state's checkpoint image that follows */
    int64_t complete;     /* the resumed run is already complete: nothing to do */
    int64_t saved_step;   /* rank 0's newest checkpoint (-1: a fresh run) */
} DistSetupHeader;

/* A rank's state from rank 0's checkpoint image, through a private temporary file (the checkpoint loader reads
 * files: the same checks and the same restore as --resume). */
static QtStatus run_dist_restore_image(Run *r, const void *image, size_t size, QtError *err) {
    const char *tmp = getenv("TMPDIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/qtrain-rank%d-XXXXXX", tmp && tmp[0] ? tmp : "/tmp", r->dist.d->rank);
    int fd = mkstemp(path);
    if (fd < 0)
        return qt_error_set(err, QT_ERR_IO, "cannot create a temporary file %s for rank 0's state: %s; set TMPDIR to "
                            "a writable directory", path, strerror(errno));
    size_t done = 0;
    while (done < size) {
        ssize_t k = write(fd, (const char *)image + done, size - done);
        if (k <= 0) break;
        done += (size_t)k;
    }
    int werr = errno;
    close(fd);
    QtStatus st = done == size ? run_restore(r, path, err)
                               : qt_error_set(err, QT_ERR_IO, "cannot write rank 0's state (%zu bytes) to %s: %s",
                                              size, path, strerror(werr));
    unlink(path);
    return st;
}

static QtStatus run_dist_tape_allgather(void *ctx, const double *mine, size_t n, double *all, QtError *err) {
    return dist_allgather(ctx, mine, n * sizeof(double), all, err);
}

/* The per-step buffers: the packed gradients, the sums' work, the step's doubles, the regions rank 0 hands on. */
static QtStatus run_dist_alloc(Run *r, QtError *err) {
    RunDist *rd = &r->dist;
    Dist *d = rd->d;
    Net *net = &r->model.net;
    for (int i = 0; i < net->n_trainable; i++) rd->n_grad += var_numel(&net->trainable[i]->var);
    size_t eval_n = (size_t)(r->data.test.n > r->data.val.n ? r->data.test.n : r->data.val.n);
    size_t wg = dist_sum_work_floats(d, rd->n_grad), we = dist_sum_work_floats(d, eval_n);
    rd->work_n = wg > we ? wg : we;
    size_t n_meta = RUN_DIST_META + (size_t)d->world;
    const Model *m = &net->model;
    int n_qat = net_hook_count(net, &HOOK_QAT);
    int cap = 3 * m->n_modules + n_qat;
    rd->grads = malloc((rd->n_grad ? rd->n_grad : 1) * sizeof(float));
    rd->work = malloc((rd->work_n ? rd->work_n : 1) * sizeof(float));
    rd->meta = calloc(n_meta, sizeof(double));
    rd->meta_work = calloc(n_meta * (size_t)d->world, sizeof(double));
    rd->regions = calloc((size_t)(cap ? cap : 1), sizeof *rd->regions);
    if (!rd->grads || !rd->work || !rd->meta || !rd->meta_work || !rd->regions)
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory for the gradient sums (%zu values)", rd->n_grad);
    for (int i = 0; i < m->n_modules; i++) {
        Module *mod = &m->modules[i];
        if (!mod->running_mean) continue;
        size_t c = (size_t)mod->in_shape[0] * sizeof(float);
        rd->regions[rd->n_regions++] = (RunDistRegion){mod->running_mean, c};
        rd->regions[rd->n_regions++] = (RunDistRegion){mod->running_var, c};
        rd->regions[rd->n_regions++] = (RunDistRegion){&mod->num_batches_tracked, sizeof mod->num_batches_tracked};
    }
    for (int i = 0; i < n_qat; i++) {
        QatLayer *q = net_qat_layer(net, i);
        rd->regions[rd->n_regions++] = (RunDistRegion){&q->act_stats, sizeof q->act_stats};
    }
    for (int i = 0; i < rd->n_regions; i++) rd->regions_bytes += rd->regions[i].bytes;
    if (rd->regions_bytes && !(rd->regions_buf = malloc(rd->regions_bytes)))
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory for the buffers' copy (%zu bytes)", rd->regions_bytes);
    if (r->cfg->train.sync_bn) {
        rd->tape_sync = (TapeSync){.world = d->world, .allgather = run_dist_tape_allgather, .ctx = d};
        r->work.tape.bn_sync = &rd->tape_sync;
    }
    return QT_OK;
}

/* Every rank's status after a phase of the setup: a failure on any rank fails the run on every rank, each
 * with its own message (the failing rank's says what; the others', that rank k failed). */
static QtStatus run_dist_agree(Run *r, QtStatus mine, QtError *err) {
    Dist *d = r->dist.d;
    int64_t *all = calloc((size_t)d->world, sizeof *all), st64 = mine;
    QtError e = {0};
    if (!all) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    QtStatus st = dist_allgather(d, &st64, sizeof st64, all, &e);
    if (st != QT_OK) {
        free(all);
        return qt_error_set(err, st, "%s", e.msg);
    }
    int first = -1;
    for (int k = 0; k < d->world && first < 0; k++)
        if (all[k] != QT_OK) first = k;
    QtStatus agreed = first < 0 ? QT_OK : (QtStatus)all[first];
    free(all);
    if (first < 0) return QT_OK;
    d->agreed = true;
    if (mine != QT_OK) return mine; /* err holds this rank's message */
    d->said_elsewhere = true;
    return qt_error_set(err, agreed, "rank %d failed (its message above)", first);
}

QtStatus run_dist_setup(Run *r, RunSetupFn setup, char *resumed, size_t cap, char *created, size_t created_cap,
                        QtError *err) {
    Dist *d = r->dist.d;
    DistSetupHeader h = {0};
    void *image = NULL;
    size_t size = 0;
    QtStatus st = QT_OK;
    resumed[0] = created[0] = '\0';
    if (d->rank == 0) {
        st = setup(r, resumed, cap, created, created_cap, err);
        if (st == QT_OK && !r->dir.already_complete) {
            CheckpointState s = run_checkpoint_state(r);
            st = checkpoint_save_image("rank 0's state", &r->model.net.model, &r->model.optim, &s, &image, &size,
                                       err);
        }
        h = (DistSetupHeader){.status = st, .image_bytes = (int64_t)size, .complete = r->dir.already_complete,
                              .saved_step = r->dir.saved_step};
    }
    QtError e = {0};
    if (dist_bcast(d, &h, sizeof h, 0, &e) != QT_OK) {
        free(image);
        return qt_error_set(err, e.status, "%s", e.msg);
    }
    if (h.status != QT_OK) { /* rank 0 says why */
        d->agreed = true;
        if (d->rank == 0) return st;
        d->said_elsewhere = true;
        return qt_error_set(err, (QtStatus)h.status, "rank 0 failed to set the run up (its message above)");
    }
    if (h.complete) {
        r->dir.already_complete = true;
        return QT_OK;
    }
    if (d->rank != 0 && !(image = malloc((size_t)h.image_bytes)))
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory for rank 0's state (%" PRId64 " bytes)",
                            h.image_bytes);
    if (dist_bcast(d, image, (size_t)h.image_bytes, 0, &e) != QT_OK) {
        free(image);
        return qt_error_set(err, e.status, "%s", e.msg);
    }
    if (d->rank != 0) {
        st = run_prepare(r, false, err);
        if (st == QT_OK) st = run_dist_restore_image(r, image, (size_t)h.image_bytes, err);
    }
    free(image);
    if (d->rank != 0) r->dir.saved_step = h.saved_step;
    if ((st = run_dist_agree(r, st, err)) != QT_OK) {
        if (d->rank == 0 && !resumed[0]) { /* a fresh run that never started: no metrics.csv of it stays */
            char path[CONFIG_PATH_MAX + 32];
            metrics_close(&r->log.metrics);
            snprintf(path, sizeof path, "%s/metrics.csv", r->cfg->run.out_dir);
            unlink(path);
        }
        return st;
    }
    if ((st = run_dist_alloc(r, err)) != QT_OK) return st;
    r->dist.live = true;
    return QT_OK;
}

/* ---- a step --------------------------------------------------------------------------------------------------- */

/* Dropout masks and QT's gradient-rounding noise: each rank draws its own for its part, from a counter that is a
 * function of (step, rank) alone, so a rerun and a resumed run at the same world size draw the same numbers. */
static void run_dist_seed_step(Run *r) {
    const Dist *d = r->dist.d;
    uint64_t c = ((uint64_t)(r->plan.step + 1) * (uint64_t)d->world + (uint64_t)d->rank) << 32;
    r->work.dropout.counter = c;
    for (int i = 0, n = net_hook_count(&r->model.net, &HOOK_FQT); i < n; i++) net_fqt_layer(&r->model.net, i)->rng.counter = c;
}

/* Rank 0's buffers on every rank. */
static QtStatus run_dist_sync_buffers(Run *r, QtError *err) {
    RunDist *rd = &r->dist;
    if (!rd->regions_bytes) return QT_OK;
    unsigned char *p = rd->regions_buf;
    if (rd->d->rank == 0)
        for (int i = 0; i < rd->n_regions; p += rd->regions[i].bytes, i++) memcpy(p, rd->regions[i].p, rd->regions[i].bytes);
    QtStatus st = dist_bcast(rd->d, rd->regions_buf, rd->regions_bytes, 0, err);
    if (st != QT_OK || rd->d->rank == 0) return st;
    p = rd->regions_buf;
    for (int i = 0; i < rd->n_regions; p += rd->regions[i].bytes, i++) memcpy(rd->regions[i].p, p, rd->regions[i].bytes);
    return QT_OK;
}

/* The backward of a part whose logits are not finite: a zero gradient through the whole tape, so that a
 * train.sync_bn gather in the backward still meets every rank's. */
static QtStatus run_dist_backward_zero(Run *r, Var *logits) {
    Tape *t = &r->work.tape;
    if (!t->bn_sync) return QT_OK;
    float *zero = tape_alloc(t, var_numel(logits) * sizeof(float));
    if (!zero) return t->err.status;
    memset(zero, 0, var_numel(logits) * sizeof(float));
    return tape_backward_from(t, logits, zero);
}

/* The message of a step whose loss was not finite on some rank: that rank's part, located when it is this one. */
static void run_dist_bad_where(Run *r, Var *x, bool mine, int lo, int n, char *where, size_t cap) {
    const RunDist *rd = &r->dist;
    int first = -1, count = 0;
    for (int k = 0; k < rd->d->world; k++)
        if (rd->meta[RUN_DIST_META + k] > 0) count++, first = first < 0 ? k : first;
    if (mine && !r->work.tape.bn_sync) { /* the located module; a sync_bn forward cannot be rerun on one rank */
        char at[400];
        Var batch = *x;
        tape_reset(&r->work.tape);
        guard_locate_nonfinite_forward(&r->model.net.model, &r->work.tape, &batch, r->model.net.trainable,
                                       r->model.net.n_trainable, at, sizeof at);
        snprintf(where, cap, "on rank %d's part of the batch (examples %d-%d of %d ranks' batch): %s", rd->d->rank,
                 lo, lo + n - 1, rd->d->world, at);
        return;
    }
    snprintf(where, cap, "on %d rank%s' part%s of the batch, rank %d first (each rank's own log locates it when "
             "train.sync_bn is off)", count, count == 1 ? "" : "s", count == 1 ? "" : "s", first);
}

QtStatus run_dist_step(Run *r, QtError *err) {
    RunDist *rd = &r->dist;
    Dist *d = rd->d;
    Tape *t = &r->work.tape;
    QtError e = {0};
    int m = 0, lo = 0, n = 0;
    int64_t step = r->plan.step + 1;
    double comm0 = d->comm_s;
    if (batcher_next_part(&r->plan.batcher, d->rank, d->world, r->work.bx, r->work.by, &m, &lo, &n, &e) != QT_OK)
        return qt_error_set(err, e.status, "step %" PRId64 ": %s", step, e.msg);
    const uint32_t *idx = r->plan.batcher.order + r->plan.batcher.cursor - m + lo;
    if (r->cfg->data.augment.n > 0)
        augment_batch(&r->cfg->data.augment, r->cfg->run.seed, r->plan.batcher.epoch, idx, n, r->data.train.shape,
                      r->work.bx);
    if (r->work.bt) dataset_fill_targets(&r->data.train, idx, n, r->work.bt);
    run_dist_seed_step(r);
    Var *x = run_wrap_batch(r, r->work.bx, n);
    net_set_step(&r->model.net, r->plan.step);
    Var *logits = model_forward(&r->model.net.model, t, x);
    if (!logits) return qt_error_set(err, t->err.status, "step %" PRId64 ": %s", step, t->err.msg);
    bool bad = floats_first_nonfinite(logits->value.data, var_numel(logits)) < var_numel(logits);
    double l = NAN;
    int64_t correct = 0;
    QtStatus st = QT_OK;
    if (bad) {
        st = run_dist_backward_zero(r, logits);
    } else {
        /* the part's mean loss times part/batch: the ranks' gradients add up to the batch's mean-loss gradient */
        Var *loss = run_loss(r, logits, r->work.bx, r->work.by, r->work.bt);
        const float seed = (float)((double)n / (double)m);
        st = loss ? tape_backward_from(t, loss, &seed) : t->err.status;
        if (st == QT_OK) {
            l = loss->value.data[0];
            bad = !isfinite(l);
            if (!bad && r->cfg->train.loss == LOSS_CROSS_ENTROPY) correct = run_count_correct(logits, r->work.by, n);
        }
    }
    if (st != QT_OK) return qt_error_set(err, t->err.status, "step %" PRId64 ": %s", step, t->err.msg);
    float *g = rd->grads;
    for (int i = 0; i < r->model.net.n_trainable; i++) {
        const Var *v = &r->model.net.trainable[i]->var;
        size_t k = var_numel(v);
        if (bad) memset(g, 0, k * sizeof *g);
        else memcpy(g, v->grad, k * sizeof *g);
        g += k;
    }
    double *meta = rd->meta;
    memset(meta, 0, (RUN_DIST_META + (size_t)d->world) * sizeof *meta);
    meta[META_LOSS] = bad ? 0.0 : l * n, meta[META_CORRECT] = (double)correct, meta[META_BAD] = bad;
    meta[META_STOP] = interrupt_requested() != 0, meta[META_SEEN] = n, meta[RUN_DIST_META + d->rank] = bad;
    if ((st = dist_sum_floats(d, rd->grads, rd->n_grad, rd->work, err)) != QT_OK) return st;
    if ((st = dist_sum_doubles(d, meta, RUN_DIST_META + (size_t)d->world, rd->meta_work, err)) != QT_OK) return st;
    rd->step_comm_s += d->comm_s - comm0;
    if (meta[META_STOP] > 0) rd->sig = interrupt_requested() ? interrupt_requested() : SIGTERM;
    g = rd->grads;
    for (int i = 0; i < r->model.net.n_trainable; i++) {
        Var *v = &r->model.net.trainable[i]->var;
        size_t k = var_numel(v);
        memcpy(v->grad, g, k * sizeof *g);
        g += k;
    }
    /* From here on every rank holds the same values: what the guards decide, they decide together. */
    if (meta[META_BAD] > 0) {
        char where[600];
        run_dist_bad_where(r, x, bad, lo, n, where, sizeof where);
        st = run_nonfinite_at(r, true, where, err);
    } else {
        st = run_update(r, meta[META_LOSS] / (double)m, (int64_t)meta[META_CORRECT], m, err);
    }
    if (st != QT_OK) { /* the same error on every rank: rank 0 says it */
        d->agreed = true, d->said_elsewhere = d->rank != 0;
        return st;
    }
    comm0 = d->comm_s;
    st = run_dist_sync_buffers(r, err);
    rd->step_comm_s += d->comm_s - comm0;
    return st;
}

/* ---- evaluation and checks ------------------------------------------------------------------------------------ */

QtStatus run_dist_eval_sums(Run *r, double *sums, int n, float *scores, int n_scores, QtError *err) {
    RunDist *rd = &r->dist;
    QtStatus st = dist_sum_doubles(rd->d, sums, (size_t)n, rd->meta_work, err);
    if (st == QT_OK && scores) st = dist_sum_floats(rd->d, scores, (size_t)n_scores, rd->work, err);
    return st;
}

/* FNV-1a over bytes. */
static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

QtStatus run_dist_check_replicas(Run *r, QtError *err) {
    RunDist *rd = &r->dist;
    Dist *d = rd->d;
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < r->model.net.n_trainable; i++) {
        const Var *v = &r->model.net.trainable[i]->var;
        h = fnv1a(h, v->value.data, var_numel(v) * sizeof(float));
    }
    for (int i = 0; i < rd->n_regions; i++) h = fnv1a(h, rd->regions[i].p, rd->regions[i].bytes);
    uint64_t *all = (uint64_t *)rd->meta_work; /* world doubles' room at least */
    QtStatus st = dist_allgather(d, &h, sizeof h, all, err);
    if (st != QT_OK) return st;
    for (int k = 1; k < d->world; k++)
        if (all[k] != all[0]) {
            d->agreed = true, d->said_elsewhere = d->rank != 0;
            return qt_error_set(err, QT_ERR_VALUE, "step %" PRId64 ": rank %d's parameters differ from rank 0's "
                                "(hash %016" PRIx64 " against %016" PRIx64 "): the ranks no longer train one model, "
                                "so no checkpoint is written; the newest checkpoint in %s is the last good one. "
                                "This is a fault in the ranks' hardware or in qtrain: report it",
                                r->plan.step, k, all[k], all[0], r->cfg->run.out_dir);
        }
    return QT_OK;
}
