/* api.c - include/qtrain.h on top of the trainer: a qtrain_run is the Run
 * that `qtrain train` sets up (run_prepare), stepped by the caller
 * (run_step) instead of train.c's loop, so both give the same numbers. */
#include "include/qtrain.h"

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/metrics.h"
#include "trainer/run.h"
#include "trainer/tools.h"
#include "trainer/train.h"
#include "trainer/version.h"

_Static_assert((int)QTRAIN_ERR_CONFIG == (int)QT_ERR_CONFIG && (int)QTRAIN_ERR_ARG == (int)QT_ERR_ARG,
               "qtrain_status mirrors QtStatus");

struct qtrain_config {
    Config cfg;
};

struct qtrain_run {
    Run run;             /* run.dir holds no out_dir: only what checkpoints record (config text, base identity) */
    Config cfg;          /* the run's own copy: run.cfg points here */
    TrainOptions opt;    /* run.opt points here; quiet unless qtrain_run_set_verbose */
};

static _Thread_local char last_error[QT_ERROR_MSG_MAX];

/* Keeps e's message for qtrain_last_error; returns its status. */
static qtrain_status api_fail(const QtError *e, QtStatus st) {
    snprintf(last_error, sizeof last_error, "%s", e->msg[0] ? e->msg : qt_status_name(st));
    return (qtrain_status)st;
}

static qtrain_status api_fail_msg(QtStatus st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static qtrain_status api_fail_msg(QtStatus st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return (qtrain_status)st;
}

const char *qtrain_version(void) { return QTRAIN_VERSION; }
const char *qtrain_last_error(void) { return last_error; }
const char *qtrain_status_name(qtrain_status status) { return qt_status_name((QtStatus)status); }

/* ---- configs --------------------------------------------------------------------------------------------- */

static qtrain_status config_new(qtrain_config **out, const char *path, const char *text, const char *name,
                                const char *const *overrides, int n) {
    if (!out) return api_fail_msg(QT_ERR_ARG, "qtrain_config: the handle pointer is NULL");
    *out = NULL;
    if (!(path || text)) return api_fail_msg(QT_ERR_ARG, "qtrain_config: no path or YAML text given");
    if (n < 0 || (n > 0 && !overrides))
        return api_fail_msg(QT_ERR_ARG, "qtrain_config: %d overrides %s", n, n < 0 ? "(a negative count)" : "in NULL");
    for (int i = 0; i < n; i++)
        if (!overrides[i]) return api_fail_msg(QT_ERR_ARG, "qtrain_config: override %d of %d is NULL", i, n);
    qtrain_config *c = malloc(sizeof *c);
    if (!c) return api_fail_msg(QT_ERR_NOMEM, "out of memory for a config");
    QtError e = {0};
    QtStatus st = path ? config_load(&c->cfg, path, overrides, n, &e)
                       : config_load_string(&c->cfg, text, name ? name : "(config text)", overrides, n, &e);
    if (st != QT_OK) {
        free(c);
        return api_fail(&e, st);
    }
    *out = c;
    return QTRAIN_OK;
}

qtrain_status qtrain_config_load(qtrain_config **cfg, const char *path, const char *const *overrides,
                                 int n_overrides) {
    if (!path) return api_fail_msg(QT_ERR_ARG, "qtrain_config_load: the path is NULL");
    return config_new(cfg, path, NULL, NULL, overrides, n_overrides);
}

qtrain_status qtrain_config_parse(qtrain_config **cfg, const char *yaml, const char *name,
                                  const char *const *overrides, int n_overrides) {
    if (!yaml) return api_fail_msg(QT_ERR_ARG, "qtrain_config_parse: the YAML text is NULL");
    return config_new(cfg, NULL, yaml, name, overrides, n_overrides);
}

qtrain_status qtrain_config_from_checkpoint(qtrain_config **cfg, const char *checkpoint,
                                            const char *const *overrides, int n_overrides) {
    if (!checkpoint) return api_fail_msg(QT_ERR_ARG, "qtrain_config_from_checkpoint: the path is NULL");
    char *text = NULL, name[CONFIG_PATH_MAX + 16];
    QtError e = {0};
    QtStatus st = checkpoint_read_config(checkpoint, &text, &e);
    if (st != QT_OK) return api_fail(&e, st);
    snprintf(name, sizeof name, "%s:/config", checkpoint);
    qtrain_status s = config_new(cfg, NULL, text, name, overrides, n_overrides);
    free(text);
    return s;
}

char *qtrain_config_yaml(const qtrain_config *cfg) { return cfg ? config_to_yaml(&cfg->cfg) : NULL; }

void qtrain_config_free(qtrain_config *cfg) { free(cfg); }

qtrain_status qtrain_quantize_checkpoint(const qtrain_config *cfg, const char *checkpoint, const char *out) {
    if (!cfg || !checkpoint || !out)
        return api_fail_msg(QT_ERR_ARG, "qtrain_quantize_checkpoint: the config, checkpoint or out is NULL");
    QtError e = {0};
    QtStatus st = tools_quantize(&cfg->cfg, checkpoint, out, true, NULL, &e);
    return st == QT_OK ? QTRAIN_OK : api_fail(&e, st);
}

/* ---- runs ------------------------------------------------------------------------------------------------ */

/* A zeroed run on a copy of cfg, as train_run starts one. */
static qtrain_status run_new(qtrain_run **out, const qtrain_config *cfg) {
    if (!out || !cfg) return api_fail_msg(QT_ERR_ARG, "qtrain_run: the handle pointer or the config is NULL");
    *out = NULL;
    qtrain_run *q = calloc(1, sizeof *q);
    if (!q) return api_fail_msg(QT_ERR_NOMEM, "out of memory for a run");
    q->cfg = cfg->cfg;
    q->opt.quiet = true;
    run_init(&q->run, &q->cfg, &q->opt);
    *out = q;
    return QTRAIN_OK;
}

/* Setting up the run failed: frees it, keeps the message. */
static qtrain_status run_fail(qtrain_run **out, const QtError *e, QtStatus st) {
    qtrain_run_free(*out);
    *out = NULL;
    return api_fail(e, st);
}

qtrain_status qtrain_run_new(qtrain_run **run, const qtrain_config *cfg) {
    qtrain_status s = run_new(run, cfg);
    if (s != QTRAIN_OK) return s;
    Run *r = &(*run)->run;
    QtError e = {0};
    QtStatus st = run_prepare(r, true, &e);
    if (st == QT_OK) st = run_dir_note(r, &e);
    if (st != QT_OK) return run_fail(run, &e, st);
    net_print_unused_rules(&r->model.net, stderr); /* a rule that applies nowhere is a likely typo */
    return QTRAIN_OK;
}

qtrain_status qtrain_run_load(qtrain_run **run, const qtrain_config *cfg, const char *checkpoint) {
    if (!checkpoint) return api_fail_msg(QT_ERR_ARG, "qtrain_run_load: the checkpoint path is NULL");
    qtrain_status s = run_new(run, cfg);
    if (s != QTRAIN_OK) return s;
    Run *r = &(*run)->run;
    QtError e = {0};
    QtStatus st = run_prepare(r, false, &e);
    if (st != QT_OK) return run_fail(run, &e, st);
    if ((st = run_restore(r, checkpoint, &e)) != QT_OK) {
        /* The usual cause here: a config other than the one the run was trained with. */
        if (st == QT_ERR_CONFIG)
            snprintf(e.msg + strlen(e.msg), sizeof e.msg - strlen(e.msg),
                     "; or load it with the config it was trained with (qtrain_config_from_checkpoint)");
        return run_fail(run, &e, st);
    }
    if ((st = run_dir_note(r, &e)) != QT_OK) return run_fail(run, &e, st);
    return QTRAIN_OK;
}

void qtrain_run_set_verbose(qtrain_run *run, int verbose) {
    if (run) run->opt.quiet = !verbose;
}

int64_t qtrain_run_steps_done(const qtrain_run *run) { return run ? run->run.plan.step : 0; }
int64_t qtrain_run_steps_total(const qtrain_run *run) { return run ? run->run.plan.total_steps : 0; }
int64_t qtrain_run_steps_left(const qtrain_run *run) {
    return run ? qtrain_run_steps_total(run) - qtrain_run_steps_done(run) : 0;
}

qtrain_status qtrain_run_step(qtrain_run *run, double *loss) {
    if (loss) *loss = NAN;
    if (!run) return api_fail_msg(QT_ERR_ARG, "qtrain_run_step: the run is NULL");
    Run *r = &run->run;
    if (r->plan.step >= r->plan.total_steps)
        return api_fail_msg(QT_ERR_ARG, "the run has done all %lld steps of its plan; raise train.steps or "
                            "train.epochs in its config for more", (long long)r->plan.total_steps);
    double before = r->log.win_loss_sum;
    int64_t steps_before = r->log.win_steps;
    QtError e = {0};
    r->work.tape.training = true;
    QtStatus st = run_step(r, &e);
    if (st != QT_OK) return api_fail(&e, st);
    if (loss && r->log.win_steps > steps_before) *loss = r->log.win_loss_sum - before; /* else the step was skipped */
    return QTRAIN_OK;
}

static void metrics_from(const Run *r, qtrain_metrics *m) {
    TrainResult res;
    memset(&res, 0, sizeof res);
    run_fill_result(r, &res);
    m->step = res.steps;
    m->params_trainable = res.params_trainable, m->params_frozen = res.params_frozen;
    m->model_bytes = res.model_bytes;
    m->base_bits_per_param = res.base_bits_per_param;
}

qtrain_status qtrain_run_evaluate(qtrain_run *run, qtrain_metrics *metrics) {
    if (!run || !metrics) return api_fail_msg(QT_ERR_ARG, "qtrain_run_evaluate: the run or metrics is NULL");
    memset(metrics, 0, sizeof *metrics);
    QtError e = {0};
    QtStatus st = run_eval_and_log(&run->run, &metrics->test_loss, &metrics->test_accuracy, &metrics->val_loss,
                                   &metrics->val_accuracy, &e);
    if (st != QT_OK) return api_fail(&e, st);
    metrics_from(&run->run, metrics);
    return QTRAIN_OK;
}

qtrain_status qtrain_evaluate_checkpoint(const qtrain_config *cfg, const char *checkpoint, qtrain_metrics *metrics) {
    if (!checkpoint || !metrics)
        return api_fail_msg(QT_ERR_ARG, "qtrain_evaluate_checkpoint: the checkpoint or metrics is NULL");
    memset(metrics, 0, sizeof *metrics);
    qtrain_config *stored = NULL;
    if (!cfg) {
        qtrain_status s = qtrain_config_from_checkpoint(&stored, checkpoint, NULL, 0);
        if (s != QTRAIN_OK) return s;
        cfg = stored;
    }
    TrainResult res;
    QtError e = {0};
    QtStatus st = train_eval_checkpoint_to(&cfg->cfg, checkpoint, NULL, &res, &e);
    qtrain_config_free(stored);
    CheckpointProvenance *prov = st == QT_OK ? malloc(sizeof *prov) : NULL; /* the step: evaluation reads no plan */
    if (st == QT_OK && !prov) st = qt_error_set(&e, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK) st = checkpoint_read_provenance(checkpoint, prov, &e);
    int64_t step = st == QT_OK ? prov->step : 0;
    free(prov);
    if (st != QT_OK) return api_fail(&e, st);
    *metrics = (qtrain_metrics){
        .step = step, .test_loss = res.test_loss, .test_accuracy = res.test_accuracy,
        .val_loss = res.val_loss, .val_accuracy = res.val_accuracy, .params_trainable = res.params_trainable,
        .params_frozen = res.params_frozen, .model_bytes = res.model_bytes,
        .base_bits_per_param = res.base_bits_per_param,
    };
    return QTRAIN_OK;
}

qtrain_status qtrain_run_save(qtrain_run *run, const char *path) {
    if (!run || !path) return api_fail_msg(QT_ERR_ARG, "qtrain_run_save: the run or path is NULL");
    Run *r = &run->run;
    QtError e = {0};
    CheckpointState s = run_checkpoint_state(r);
    s.replace = FS_REPLACE_REGULAR; /* a path the caller names: only ever over a regular file */
    QtStatus st = checkpoint_save(path, &r->model.net.model, &r->model.optim, &s, &e);
    if (st != QT_OK) return api_fail(&e, st);
    r->dir.saved_step = r->plan.step;
    return QTRAIN_OK;
}

void qtrain_run_free(qtrain_run *run) {
    if (!run) return;
    run_free(&run->run);
    free(run);
}
