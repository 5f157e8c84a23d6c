/* train_guard.c - the step loop's numerical guards: the divergence watch,
 * and what a step with a non-finite loss, gradient or update does (stop or
 * skip, naming where). Part of train.c's run (run.h). */
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
QtStatus run_nonfinite(Run *r, Var *x, double loss, const char *grad_where, QtError *err) {
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
