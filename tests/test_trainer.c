/* test_trainer.c - end to end: the demo, and training runs on the shipped
 * mini data set: exact resume, outputs, and the CLI's errors and exit codes. */
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "test_runs.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "cli/demo.h"
#include "trainer/run.h"
#include "trainer/train.h"

static void test_demo_learns_spirals(void) {
    DemoOptions o = demo_options_default();
    o.steps = 300;
    o.quiet = true;
    QtError err = {0};
    double acc = 0.0;
    /* stdout carries the demo's report; the CUnit log stays readable. */
    fflush(stdout);
    CU_ASSERT_EQUAL_FATAL(demo_run(&o, &acc, &err), QT_OK);
    /* A linear model gets ~1/3 on interleaved spirals; the MLP separates them. */
    CU_ASSERT(acc > 0.95);
    o.batch_size = 0;
    CU_ASSERT_EQUAL(demo_run(&o, &acc, &err), QT_ERR_ARG);
}

/* ---- helpers ----------------------------------------------------------- */

static char *tmp_root;

static int trainer_suite_init(void) {
    tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int trainer_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

/* Loads a config with run.out_dir=<tmp_root>/<sub> plus extra overrides. */
static Config *load_config(const char *path, const char *sub, const char *const *extra, int n_extra) {
    static char out_dir[256];
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/%s", tmp_root, sub);
    const char *ov[16] = {out_dir};
    for (int i = 0; i < n_extra && i < 15; i++) ov[1 + i] = extra[i];
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    if (c && config_load(c, path, ov, 1 + n_extra, &err) != QT_OK) {
        fprintf(stderr, "\n  config %s: %s\n", path, err.msg);
        free(c);
        return NULL;
    }
    return c;
}

static QtStatus run_quiet(const Config *c, const char *resume, int64_t stop_at, TrainResult *r, QtError *err) {
    TrainOptions o = {.resume = resume, .quiet = true, .stop_at_step = stop_at};
    return train_run(c, &o, r, err);
}

/* The metrics.csv rows without the two timing columns. */
static char *metrics_without_timings(const char *dir) {
    char path[2048];
    snprintf(path, sizeof path, "%s/metrics.csv", dir);
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    size_t cap = 1 << 16, len = 0;
    char *out = calloc(cap, 1), line[512];
    while (out && fgets(line, sizeof line, f)) {
        /* keep the first six columns: split,step,epoch,loss,accuracy,lr */
        int commas = 0;
        for (char *p = line; *p; p++)
            if (*p == ',' && ++commas == 6) *p = '\0';
        size_t n = strlen(line);
        if (len + n + 2 < cap) memcpy(out + len, line, n), out[len + n] = '\n', len += n + 1;
    }
    fclose(f);
    return out;
}

/* N steps straight vs k steps, stop, resume, N - k steps. */
static void check_exact_resume(const char *config, int64_t k) {
    char straight[64], split[64];
    snprintf(straight, sizeof straight, "%s-straight", strrchr(config, '/') + 1);
    snprintf(split, sizeof split, "%s-split", strrchr(config, '/') + 1);
    Config *a = load_config(config, straight, NULL, 0), *b = load_config(config, split, NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(a);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    QtError err = {0};
    TrainResult ra, rb1, rb2;
    CU_ASSERT_EQUAL_FATAL(run_quiet(a, NULL, 0, &ra, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(run_quiet(b, NULL, k, &rb1, &err), QT_OK);
    CU_ASSERT(rb1.stopped);
    CU_ASSERT_EQUAL(rb1.steps, k);
    CU_ASSERT_EQUAL_FATAL(run_quiet(b, "auto", 0, &rb2, &err), QT_OK);
    if (err.status) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL(rb2.steps, ra.steps);
    CU_ASSERT_EQUAL(rb2.test_accuracy, ra.test_accuracy);
    CU_ASSERT_EQUAL(rb2.test_loss, ra.test_loss);
    char fa[2048], fb[2048];
    snprintf(fa, sizeof fa, "%s/final.h5", a->run.out_dir);
    snprintf(fb, sizeof fb, "%s/final.h5", b->run.out_dir);
    test_runs_assert_same_state(a, fa, fb);
    char *ma = metrics_without_timings(a->run.out_dir), *mb = metrics_without_timings(b->run.out_dir);
    CU_ASSERT_PTR_NOT_NULL(ma);
    CU_ASSERT_PTR_NOT_NULL(mb);
    if (ma && mb && strcmp(ma, mb) != 0) {
        fprintf(stderr, "\n  metrics differ:\n%s\n-- vs --\n%s\n", ma, mb);
        CU_FAIL("metrics.csv rows differ after resume");
    }
    free(ma), free(mb), free(a), free(b);
}

/* ---- tests --------------------------------------------------------------- */

static void test_resume_is_exact_cnn(void) { check_exact_resume("tests/configs/tiny-cnn.yaml", 5); }

static void test_resume_is_exact_mlp(void) { check_exact_resume("tests/configs/tiny-mlp.yaml", 7); }

static void test_run_outputs(void) {
    Config *c = load_config("tests/configs/tiny-mlp.yaml", "outputs", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    TrainResult r;
    CU_ASSERT_EQUAL_FATAL(run_quiet(c, NULL, 0, &r, &err), QT_OK);
    const char *d = c->run.out_dir;
    CU_ASSERT(test_file_exists(d, "metrics.csv"));
    CU_ASSERT(test_file_exists(d, "summary.json"));
    CU_ASSERT(test_file_exists(d, "final.h5"));
    CU_ASSERT(test_file_exists(d, "last.h5"));
    CU_ASSERT(test_file_exists(d, "ckpt-00000010.h5"));
    CU_ASSERT(r.test_accuracy > 0.3); /* 20 steps on 512 examples: well above chance (0.1) */
    CU_ASSERT(r.params_trainable > 0);
    CU_ASSERT_EQUAL(r.params_frozen, 0);
    char path[2048];
    snprintf(path, sizeof path, "%s/summary.json", d);
    char *json = test_file_read(path, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(json);
    const char *keys[] = {"\"test_accuracy\"", "\"test_loss\"", "\"steps\": 20", "\"wall_s\"", "\"samples_per_s\"",
                          "\"params_trainable\"", "\"params_frozen\"", "\"model_bytes\""};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) CU_ASSERT_PTR_NOT_NULL(strstr(json, keys[i]));
    free(json);

    /* eval of the final checkpoint reproduces the run's test metrics */
    TrainResult e;
    snprintf(path, sizeof path, "%s/final.h5", d);
    CU_ASSERT_EQUAL(train_eval_checkpoint(c, path, true, &e, &err), QT_OK);
    CU_ASSERT_EQUAL(e.test_accuracy, r.test_accuracy);
    CU_ASSERT_EQUAL(e.test_loss, r.test_loss);
    free(c);
}

static void test_bad_inputs(void) {
    QtError err = {0};
    TrainResult r;
    /* a data directory without the files */
    const char *nodata[] = {"data.dir=/nonexistent/fashion"};
    Config *c = load_config("tests/configs/tiny-mlp.yaml", "bad-data", nodata, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_EQUAL(run_quiet(c, NULL, 0, &r, &err), QT_ERR_IO);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "/nonexistent/fashion"));
    free(c);

    /* an out_dir under a regular file */
    char file[256], ov[300];
    snprintf(file, sizeof file, "%s/plain-file", tmp_root);
    test_file_write(file, "", 0);
    snprintf(ov, sizeof ov, "run.out_dir=%s/sub", file);
    const char *badout[] = {ov};
    c = load_config("tests/configs/tiny-mlp.yaml", "unused", badout, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(run_quiet(c, NULL, 0, &r, &err), QT_ERR_IO);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "plain-file"));
    free(c);

    /* a model input that does not match the data */
    const char *badinput[] = {"model.input=[100]"}; /* the layers chain, but the data has 784 values */
    c = load_config("tests/configs/tiny-mlp.yaml", "bad-input", badinput, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(run_quiet(c, NULL, 0, &r, &err), QT_ERR_CONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "model.input"));
    free(c);

    /* resuming from a corrupt checkpoint, and init_from of another model */
    char junk[256];
    snprintf(junk, sizeof junk, "%s/junk.h5", tmp_root);
    test_file_write(junk, "not a checkpoint\n", 17);
    c = load_config("tests/configs/tiny-mlp.yaml", "bad-resume", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    qt_error_clear(&err);
    CU_ASSERT_NOT_EQUAL(run_quiet(c, junk, 0, &r, &err), QT_OK);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "junk.h5"));
    CU_ASSERT(!test_file_exists(c->run.out_dir, "final.h5"));
    free(c);

    /* the CNN's weights into the MLP (the CNN run is the resume test's) */
    char other[300];
    snprintf(other, sizeof other, "model.init_from=%s/tiny-cnn.yaml-straight/final.h5", tmp_root);
    const char *initfrom[] = {other};
    c = load_config("tests/configs/tiny-mlp.yaml", "bad-init", initfrom, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    qt_error_clear(&err);
    CU_ASSERT_NOT_EQUAL(run_quiet(c, NULL, 0, &r, &err), QT_OK);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "final.h5"));
    free(c);
}

/* dir/name's contents, NUL-terminated; NULL if it cannot be read. */
static char *read_file(const char *dir, const char *name) {
    char *path = test_path_join(dir, name);
    char *text = test_file_read(path, NULL);
    free(path);
    return text;
}

/* What a resume may and may not do. */
static void test_resume_rules(void) {
    QtError err = {0};
    TrainResult r;
    Config *c = load_config("tests/configs/tiny-mlp.yaml", "rules", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_EQUAL_FATAL(run_quiet(c, NULL, 0, &r, &err), QT_OK);
    double wall = r.wall_s;

    /* a finished run: nothing to do, nothing rewritten */
    char *metrics = read_file(c->run.out_dir, "metrics.csv"), *summary = read_file(c->run.out_dir, "summary.json");
    CU_ASSERT_EQUAL(run_quiet(c, "auto", 0, &r, &err), QT_OK);
    CU_ASSERT(r.already_complete);
    char *metrics2 = read_file(c->run.out_dir, "metrics.csv"), *summary2 = read_file(c->run.out_dir, "summary.json");
    CU_ASSERT(metrics && metrics2 && strcmp(metrics, metrics2) == 0);
    CU_ASSERT(summary && summary2 && strcmp(summary, summary2) == 0);
    free(metrics), free(metrics2), free(summary), free(summary2);

    /* a fresh start over an earlier run's checkpoints is refused */
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(run_quiet(c, NULL, 0, &r, &err), QT_ERR_CONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "--resume auto"));

    /* a resume that would change the data order or the model is refused */
    char ckpt[2048];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-00000010.h5", c->run.out_dir);
    const char *other_batch[] = {"train.batch_size=16"};
    Config *c2 = load_config("tests/configs/tiny-mlp.yaml", "rules", other_batch, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c2);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(run_quiet(c2, ckpt, 0, &r, &err), QT_ERR_CONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "train.batch_size"));
    free(c2);

    /* a checkpoint beyond the config's steps, and a stop before the checkpoint */
    const char *fewer[] = {"train.steps=5"};
    c2 = load_config("tests/configs/tiny-mlp.yaml", "rules", fewer, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c2);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(run_quiet(c2, ckpt, 0, &r, &err), QT_ERR_CONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "train.steps"));
    free(c2);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(run_quiet(c, ckpt, 4, &r, &err), QT_ERR_ARG);

    /* totals carry over a stop and resume; init_from is not needed to resume */
    char init[2300], moved[2300];
    snprintf(init, sizeof init, "model.init_from=%s/final.h5", c->run.out_dir);
    snprintf(moved, sizeof moved, "%s/base.h5", tmp_root);
    const char *from[] = {init, "train.log_every=0"};
    c2 = load_config("tests/configs/tiny-mlp.yaml", "rules-init", from, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c2);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL_FATAL(run_quiet(c2, NULL, 3, &r, &err), QT_OK);
    CU_ASSERT(r.stopped);
    CU_ASSERT_EQUAL(rename(init + strlen("model.init_from="), moved), 0);
    CU_ASSERT_EQUAL(run_quiet(c2, "auto", 0, &r, &err), QT_OK);
    if (err.status) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL(r.steps, 20);
    CU_ASSERT(r.samples_per_s > 0);
    CU_ASSERT(r.train_loss == r.train_loss); /* log_every 0 still logs the last step */
    CU_ASSERT(wall > 0);
    char *m = read_file(c2->run.out_dir, "metrics.csv");
    CU_ASSERT_PTR_NOT_NULL(m);
    int train_rows = 0;
    for (const char *q = m; q && (q = strstr(q, "\ntrain,")) != NULL; q++) train_rows++;
    CU_ASSERT_EQUAL(train_rows, 1); /* log_every 0: only the last step's row */
    CU_ASSERT(m && strstr(m, "\ntrain,20,"));
    free(m);
    free(c2), free(c);
}

/* The binary: exit status 0 / 1 / 2 and a message on stderr. */
static int run_cli(const char *args) {
    const char *bin = getenv("QTRAIN_BIN") ? getenv("QTRAIN_BIN") : "build/qtrain";
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s >/dev/null 2>&1", bin, args);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_cli_exit_status(void) {
    char args[512];
    CU_ASSERT_EQUAL(run_cli("--version"), 0);
    CU_ASSERT_EQUAL(run_cli("--help"), 0);
    CU_ASSERT_EQUAL(run_cli("--config tests/configs/tiny-mlp.yaml --help"), 0);
    CU_ASSERT_EQUAL(run_cli(""), 2);
    CU_ASSERT_EQUAL(run_cli("--config"), 2);
    CU_ASSERT_EQUAL(run_cli("--config tests/configs/tiny-mlp.yaml --bogus"), 2);
    CU_ASSERT_EQUAL(run_cli("--config /nonexistent.yaml"), 2);
    CU_ASSERT_EQUAL(run_cli("--config tests/configs/tiny-mlp.yaml --set train.batchsize=3"), 2);
    snprintf(args, sizeof args, "--config tests/configs/tiny-mlp.yaml --set run.out_dir=%s/cli --set "
             "data.dir=/nonexistent --quiet", tmp_root);
    CU_ASSERT_EQUAL(run_cli(args), 1);
    snprintf(args, sizeof args, "--config tests/configs/tiny-mlp.yaml --set run.out_dir=%s/cli --set "
             "train.steps=3 --quiet", tmp_root);
    CU_ASSERT_EQUAL(run_cli(args), 0);
    snprintf(args, sizeof args, "inspect %s/cli/final.h5", tmp_root);
    CU_ASSERT_EQUAL(run_cli(args), 0);
    snprintf(args, sizeof args, "eval --checkpoint %s/cli/final.h5 --quiet", tmp_root);
    CU_ASSERT_EQUAL(run_cli(args), 0);
    snprintf(args, sizeof args, "inspect %s/junk.h5", tmp_root);
    CU_ASSERT_EQUAL(run_cli(args), 1);
}

/* A run's parts (run.h): run_init's start values; run_prepare makes the
 * data, model, plan and work parts and leaves the run directory's part to
 * training (no config text, no lock, no out_dir); each part's free leaves
 * it zeroed, so run_free after it frees nothing twice. */
static void test_run_parts(void) {
    char out_dir[512], ov[600];
    snprintf(out_dir, sizeof out_dir, "%s/parts", tmp_root);
    snprintf(ov, sizeof ov, "run.out_dir=%s", out_dir);
    const char *ovs[] = {ov};
    Config *c = malloc(sizeof *c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(config_load(c, "tests/configs/tiny-mlp.yaml", ovs, 1, &err), QT_OK);
    TrainOptions o = {.quiet = true};
    Run *r = malloc(sizeof *r);
    CU_ASSERT_PTR_NOT_NULL_FATAL(r);
    memset(r, 0xA5, sizeof *r); /* run_init owes every field a value */
    run_init(r, c, &o);
    CU_ASSERT(r->cfg == c && r->opt == &o);
    CU_ASSERT_EQUAL(r->dir.saved_step, -1);
    CU_ASSERT(isnan(r->log.last_train_loss));
    CU_ASSERT(r->clock.t_start > 0.0);
    CU_ASSERT_EQUAL(r->plan.step, 0);
    CU_ASSERT_EQUAL(r->guards.nonfinite_skipped, 0);
    CU_ASSERT_PTR_NULL(r->work.bx);
    CU_ASSERT_PTR_NULL(r->dir.config_text);
    CU_ASSERT_EQUAL(run_prepare(r, true, &err), QT_OK);
    CU_ASSERT_EQUAL(r->data.train.n + r->data.val.n, 512);
    CU_ASSERT(r->model.net.n_trainable > 0);
    CU_ASSERT_EQUAL(r->plan.total_steps, 20);
    CU_ASSERT_EQUAL(r->plan.steps_per_epoch, 512 / 32);
    CU_ASSERT(r->work.bx && r->work.by && r->work.ex && r->work.ey);
    CU_ASSERT_PTR_NULL(r->dir.config_text);
    CU_ASSERT_PTR_NULL(r->log.metrics.csv);
    struct stat sb;
    CU_ASSERT_NOT_EQUAL(stat(out_dir, &sb), 0); /* run_prepare does not touch run.out_dir */
    run_work_free(&r->work);
    run_model_free(&r->model);
    run_data_free(&r->data);
    CU_ASSERT_PTR_NULL(r->work.bx);
    CU_ASSERT_EQUAL(r->model.net.n_trainable, 0);
    CU_ASSERT_EQUAL(r->data.train.n, 0);
    run_free(r); /* the freed parts are zero: nothing is freed twice */
    free(r);
    free(c);
}

int register_trainer_suite(void) {
    CU_pSuite s = CU_add_suite("trainer", trainer_suite_init, trainer_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "demo run learns 3-class spirals", test_demo_learns_spirals) ||
           !CU_add_test(s, "resume is bit-identical (CNN, SGD nesterov, dropout, cosine)", test_resume_is_exact_cnn) ||
           !CU_add_test(s, "resume is bit-identical (MLP, AdamW, mid-window stop)", test_resume_is_exact_mlp) ||
           !CU_add_test(s, "a run writes metrics, summary and checkpoints; eval agrees", test_run_outputs) ||
           !CU_add_test(s, "bad data dir, out_dir, input shape, checkpoints", test_bad_inputs) ||
           !CU_add_test(s, "resume: finished run, dirty out_dir, changed config, totals", test_resume_rules) ||
           !CU_add_test(s, "CLI exit status 0/1/2", test_cli_exit_status) ||
           !CU_add_test(s, "a run's parts: start values, what run_prepare makes", test_run_parts);
}
