/* train_resume.c - what a checkpoint stores of a run and how a run resumes
 * from one: the state to save, the checks of a resumed config, the restore,
 * and which checkpoint --resume takes. Part of train.c's run (run.h). */
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
QtStatus run_check_resume_config(Run *r, const char *path, QtError *err) {
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
QtStatus run_resume_from(Run *r, const char *path, QtError *err) {
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
QtStatus run_find_checkpoint(Run *r, char *used, size_t cap, QtError *err) {
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
