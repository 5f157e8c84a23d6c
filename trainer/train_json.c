/* train_json.c - a run's result as JSON: summary.json after training,
 * eval.json after evaluating a checkpoint. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/error.h"
#include "base/fsutil.h"
#include "quant/qtype.h"
#include "trainer/metrics.h"
#include "trainer/net.h"
#include "trainer/run.h"
#include "trainer/rundir.h"
#include "trainer/version.h"

/* summary.json (training) or eval.json (is_eval): written to a temp name
 * (fs_fopen_tmp: never through a symlink), fsync'd and renamed onto path as
 * `how` allows, so a reader never sees half a file. */
QtStatus write_json_atomically(const char *path, const Run *r, const TrainResult *res, const char *ckpt,
                               bool is_eval, FsReplace how, QtError *err) {
    char tmp[CONFIG_PATH_MAX + 64];
    FILE *f = fs_fopen_tmp(path, tmp, sizeof tmp);
    if (!f)
        return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s%s", tmp, strerror(errno),
                            is_eval ? "; write eval.json elsewhere with --out PATH" : "");
    JsonWriter w;
    json_begin(&w, f);
    json_string(&w, "name", r->cfg->run.name);
    json_string(&w, "config", r->cfg->source);
    json_string(&w, "qtrain_version", QTRAIN_VERSION);
    json_string(&w, "mode", res->mode);
    json_string(&w, "checkpoint", ckpt);
    if (res->merged_from[0]) {
        json_string(&w, "merged_from", res->merged_from);
        json_string(&w, "merged_from_base_sha256", res->merged_from_base_sha256);
    }
    if (!is_eval) {
        json_int(&w, "steps", res->steps);
        json_number(&w, "epochs", res->epochs);
    }
    if (res->mse) { /* no classes: the mean squared and absolute errors over every output value */
        json_number(&w, "test_mse", res->test_mse);
        json_number(&w, "test_mae", res->test_mae);
        if (r->cfg->data.n_anomaly_classes > 0) json_number(&w, "test_auc", res->test_auc);
    } else {
        json_number(&w, "test_accuracy", res->test_accuracy);
    }
    json_number(&w, "test_loss", res->test_loss);
    if (res->mse) {
        json_number(&w, "val_mse", res->val_mse >= 0 ? res->val_mse : NAN);
        json_number(&w, "val_mae", res->val_mae >= 0 ? res->val_mae : NAN);
    } else {
        json_number(&w, "val_accuracy", res->val_accuracy >= 0 ? res->val_accuracy : NAN);
    }
    json_number(&w, "val_loss", res->val_loss >= 0 ? res->val_loss : NAN);
    json_string(&w, "loss", LOSS_KIND_NAMES[r->cfg->train.loss]);
    if (res->scores_path[0]) json_string(&w, "scores", res->scores_path);
    json_int(&w, "test_examples", r->data.test.n);
    json_int(&w, "val_examples", r->data.val.n);
    if (!is_eval) {
        json_number(&w, "train_loss", res->train_loss);
        json_int(&w, "train_examples", r->data.train.n);
        json_number(&w, "wall_s", res->wall_s);
        json_number(&w, "train_s", r->clock.train_s);
        json_number(&w, "samples_per_s", res->samples_per_s);
        json_int(&w, "world_size", res->world_size > 0 ? res->world_size : 1);
        json_number(&w, "allreduce_bytes_per_step", res->allreduce_bytes_per_step);
    }
    json_int(&w, "params_trainable", res->params_trainable);
    json_int(&w, "params_frozen", res->params_frozen);
    json_int(&w, "model_bytes", res->model_bytes);
    json_number(&w, "base_bits_per_param", res->base_bits_per_param);
    char wf[256], af[128];
    net_format_summary(&r->model.net, wf, sizeof wf, af, sizeof af);
    json_string(&w, "weight_formats", wf);
    json_string(&w, "act_formats", af);
    char bf[64] = "none";
    const Net *net = &r->model.net;
    const FqtSpec *qt = net_hook_count(net, &HOOK_FQT) > 0 ? &net_fqt_layer(net, 0)->spec : NULL;
    if (qt && qt->bwd_qtype)
        snprintf(bf, sizeof bf, "%s%s", qtype_name(qt->bwd_qtype), qt->bwd_stochastic ? "+sr" : "");
    json_string(&w, "bwd_format", bf);
    json_string(&w, "int8_kernel", net_int8_kernel(&r->model.net));
    int int8_on, int8_with;
    net_int8_layers(&r->model.net, &int8_on, &int8_with);
    json_int(&w, "int8_layers", int8_with);
    json_int(&w, "int8_kernel_layers", int8_on);
    if (!is_eval) {
        json_int(&w, "nonfinite_skipped", r->guards.nonfinite_skipped);
        json_int(&w, "divergences", r->guards.loss_watch.occurrences);
    }
    for (int i = 0; i < net_hook_count(net, &HOOK_LORA); i++) { /* a pissa / loftq init's residual (lora_svd.h) */
        const LoraAdapter *a = net_adapter(net, i);
        if (!a->init_reported) continue;
        char key[MODULE_NAME_MAX + 48];
        snprintf(key, sizeof key, "lora_init_%s", a->module->path);
        json_string(&w, key, lora_init_name(a->spec.init));
        snprintf(key, sizeof key, "lora_init_rel_error_%s", a->module->path);
        json_number(&w, key, a->init_rel_error);
        snprintf(key, sizeof key, "lora_init_default_rel_error_%s", a->module->path);
        json_number(&w, key, a->init_default_rel_error);
    }
    json_number(&w, "peak_rss_mb", res->peak_rss_mb);
    if (!is_eval) json_int(&w, "arena_bytes", (int64_t)r->work.arena.high_water);
    json_end(&w);
    if (fs_fcommit_tmp(f, tmp, path, how) != 0) {
        int e = errno;
        char big[160];
        return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; %s", path, strerror(e),
                            e == EFBIG ? qt_file_too_large_hint(big, sizeof big)
                            : is_eval  ? "free disk space or give --out PATH"
                                       : "free disk space or change run.out_dir");
    }
    return QT_OK;
}

/* eval.json replaces only a regular file (never a symlink, device or FIFO)
 * and, in a run directory, only while no live run holds its lock. */
QtStatus eval_write_json(const char *path, const Run *r, const TrainResult *res, const char *ckpt,
                         QtError *err) {
    RunDirLock lock;
    QtStatus st = fs_check_out_path(path, true, "eval.json", err);
    if (st == QT_OK) st = rundir_lock_if_run(path, &lock, err);
    if (st != QT_OK) return st;
    fs_remove_stale_tmps_of(path, 0);
    st = write_json_atomically(path, r, res, ckpt, true, FS_REPLACE_REGULAR, err);
    rundir_unlock(&lock, false);
    return st;
}

QtStatus eval_write_scores(const char *path, const Run *r, QtError *err) {
    RunDirLock lock;
    QtStatus st = fs_check_out_path(path, true, "scores.csv", err);
    if (st == QT_OK) st = rundir_lock_if_run(path, &lock, err);
    if (st != QT_OK) return st;
    fs_remove_stale_tmps_of(path, 0);
    char tmp[CONFIG_PATH_MAX + 64];
    FILE *f = fs_fopen_tmp(path, tmp, sizeof tmp);
    if (!f) {
        st = qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; write it elsewhere with --out PATH", tmp,
                          strerror(errno));
    } else {
        const Dataset *d = &r->data.test;
        fputs("index,label,score\n", f);
        for (int i = 0; i < d->n; i++) {
            if (d->labels) fprintf(f, "%d,%d,%.9g\n", i, (int)d->labels[i], (double)r->work.scores[i]);
            else fprintf(f, "%d,,%.9g\n", i, (double)r->work.scores[i]);
        }
        if (fs_fcommit_tmp(f, tmp, path, FS_REPLACE_REGULAR) != 0) {
            int e = errno;
            char big[160];
            st = qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; %s", path, strerror(e),
                              e == EFBIG ? qt_file_too_large_hint(big, sizeof big)
                                         : "free disk space or give --out PATH");
        }
    }
    rundir_unlock(&lock, false);
    return st;
}
