/* train_plan.c - a run's step plan (batches, steps, the schedule, and the
 * batch split over several ranks) and the plan it prints at the start.
 * Part of train.c's run (run.h). */
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

QtStatus run_plan_steps(Run *r, QtError *err) {
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

void run_print_plan(Run *r, const char *resumed) {
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
    if (!resumed[0]) net_print_lora_init(&r->model.net, stdout);
    if (c->model.init_from[0] && !resumed[0]) printf("init_from: %s\n", c->model.init_from);
    if (c->model.adapters_from[0] && !resumed[0]) printf("adapters_from: %s\n", c->model.adapters_from);
    if (resumed[0]) printf("resumed from %s at step %" PRId64 " (epoch %.2f)\n", resumed, r->plan.step, run_epoch(r));
    fflush(stdout);
}
