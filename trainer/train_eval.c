/* train_eval.c - `qtrain eval`: a checkpoint's model on the test (and
 * validation) split of its config's data, reported in eval.json (and, for
 * a data.target: input model, each test example's reconstruction error in
 * scores.csv beside it). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/gemm.h"
#include "data/npy.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_internal.h"
#include "trainer/config.h"
#include "trainer/net.h"
#include "trainer/run.h"

/* A `qtrain merge` output holds no adapters, whatever its config's lora
 * section says: it is reported as its base's mode, with where it came from. */
static QtStatus run_note_merge(const Run *r, const char *checkpoint, TrainResult *res, QtError *err) {
    CheckpointProvenance *p = malloc(sizeof *p);
    if (!p) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    QtStatus st = checkpoint_read_provenance(checkpoint, p, err);
    if (st == QT_OK && p->merged_from[0]) {
        snprintf(res->merged_from, sizeof res->merged_from, "%s", p->merged_from);
        snprintf(res->merged_from_base_sha256, sizeof res->merged_from_base_sha256, "%s", p->merged_from_base_sha256);
        res->mode = r->cfg->quant.mode == QUANT_MODE_NONE ? "float" : quant_mode_name(r->cfg->quant.mode);
    }
    free(p);
    return st;
}

/* scores.csv goes where eval.json goes: in the same directory. */
static QtStatus eval_scores_path(const char *json_path, TrainResult *res, QtError *err) {
    const char *slash = strrchr(json_path, '/');
    int dir_len = slash ? (int)(slash - json_path) : 0;
    int n = snprintf(res->scores_path, sizeof res->scores_path, "%.*s%sscores.csv", dir_len, json_path,
                     slash ? "/" : "");
    if (n < 0 || (size_t)n >= sizeof res->scores_path) {
        res->scores_path[0] = '\0';
        return qt_error_set(err, QT_ERR_ARG, "the path of scores.csv beside %s is too long; give a shorter --out",
                            json_path);
    }
    return QT_OK;
}

/* The test split's outputs (n, width) as a .npy file at path, written to a temporary name and renamed. */
static QtStatus eval_write_logits(const char *path, const Run *r, QtError *err) {
    void *buf = NULL;
    size_t len = 0;
    const int64_t shape[2] = {r->data.test.n, (int64_t)r->eval.logits_width};
    QtStatus st = npy_encode_f32(r->eval.logits, 2, shape, &buf, &len, err);
    if (st == QT_OK) st = ckpt_write_atomic(path, buf, len, FS_REPLACE_REGULAR, err);
    free(buf);
    return st;
}

QtStatus train_eval_checkpoint_to(const Config *cfg, const char *checkpoint, const char *json_path, TrainResult *res,
                                  QtError *err) {
    return train_eval_checkpoint_dump(cfg, checkpoint, json_path, NULL, res, err);
}

QtStatus train_eval_checkpoint_dump(const Config *cfg, const char *checkpoint, const char *json_path,
                                    const char *logits_path, TrainResult *res, QtError *err) {
    Run r;
    TrainOptions o = {.quiet = true}; /* the caller reports the result */
    run_init(&r, cfg, &o);
    memset(res, 0, sizeof *res);
    /* Evaluation never trains: no batcher and no schedule, so a config whose schedule does not fit its data
       (or a batch larger than the data) still evaluates. */
    r.plan.steps_per_epoch = 1;
    gemm_set_threads(cfg->run.threads);
    QtStatus st = run_load_data(&r, err);
    if (st == QT_OK) st = run_build_model(&r, false, err);
    CheckpointNet parts = net_checkpoint_parts(&r.model.net);
    if (st == QT_OK) st = checkpoint_load_model(checkpoint, &r.model.net.model, &parts, err);
    if (st == QT_OK) st = run_alloc(&r, err);
    if (st == QT_OK && logits_path) {
        const Module *last = &r.model.net.model.modules[r.model.net.model.n_modules - 1];
        size_t width = 1;
        for (int i = 0; i < last->out_ndim; i++) width *= (size_t)last->out_shape[i];
        r.eval.logits_width = width;
        if (!(r.eval.logits = malloc(((size_t)r.data.test.n * width + 1) * sizeof(float))))
            st = qt_error_set(err, QT_ERR_NOMEM, "out of memory for the test logits (%d x %zu)", r.data.test.n, width);
    }
    if (st == QT_OK) st = run_eval_and_log(&r, &res->test_loss, &res->test_accuracy, &res->val_loss,
                                           &res->val_accuracy, err);
    if (st == QT_OK && logits_path) st = eval_write_logits(logits_path, &r, err);
    free(r.eval.logits);
    r.eval.logits = NULL;
    if (st == QT_OK) run_fill_result(&r, res), run_fill_eval_result(&r, res);
    if (st == QT_OK) st = run_note_merge(&r, checkpoint, res, err);
    if (st == QT_OK && json_path && r.eval.have_scores) st = eval_scores_path(json_path, res, err);
    if (st == QT_OK && json_path) st = eval_write_json(json_path, &r, res, checkpoint, err);
    if (st == QT_OK && res->scores_path[0]) st = eval_write_scores(res->scores_path, &r, err);
    run_free(&r);
    return st;
}

QtStatus train_eval_checkpoint(const Config *cfg, const char *checkpoint, bool write_json, TrainResult *res,
                               QtError *err) {
    char path[CONFIG_PATH_MAX + 32];
    QtStatus st = write_json ? train_eval_json_path(checkpoint, NULL, path, sizeof path, err) : QT_OK;
    if (st != QT_OK) return st;
    return train_eval_checkpoint_to(cfg, checkpoint, write_json ? path : NULL, res, err);
}
