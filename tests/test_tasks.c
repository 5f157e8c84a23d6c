/* test_tasks.c - regression and autoencoder training: the mse loss against
 * PyTorch, the ROC AUC, dropping classes from a data set, value targets,
 * the config rules of train.loss / data.target / data.anomaly_classes, and
 * end to end on the mini data set a dense autoencoder (tests/configs/
 * tiny-ae.yaml): its loss falls, its resume is exact, `qtrain eval` writes
 * scores.csv and test_auc, its int8 PTQ evaluates, and compare shows mse. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/compare.h"
#include "data/dataset.h"
#include "nn/ops.h"
#include "test_proc.h"
#include "test_runs.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/metrics.h"
#include "trainer/run.h"
#include "trainer/train.h"

#define AE_CONFIG "tests/configs/tiny-ae.yaml"

/* ---- the mse op against PyTorch ------------------------------------------------------------------------------- */

/* torch.nn.MSELoss(reduction='mean') of these (2, 3) tensors, and the gradient it gives the prediction
 * (PyTorch 1.13, float32). */
static void test_mse_matches_torch(void) {
    static const float pred[6] = {0.5f, -1.25f, 2.0f, 0.75f, 0.0f, -0.5f};
    static const float target[6] = {0.25f, -1.0f, 1.0f, 1.5f, 0.125f, -0.5f};
    static const float torch_grad[6] = {0.0833333358168602f, -0.0833333358168602f, 0.3333333432674408f,
                                        -0.25f, -0.0416666679084301f, 0.0f};
    TestEnv e;
    test_env_init(&e, 1);
    Var *p = test_var(&e, pred, 2, (int[]){2, 3}, true), *t = test_var(&e, target, 2, (int[]){2, 3}, false);
    Var *l = nn_mse(&e.tape, p, t);
    CU_ASSERT_PTR_NOT_NULL_FATAL(l);
    CU_ASSERT_DOUBLE_EQUAL(l->value.data[0], 0.2838541567325592, 1e-7);
    CU_ASSERT_EQUAL_FATAL(tape_backward(&e.tape, l), QT_OK);
    ASSERT_ALL_CLOSE(p->grad, torch_grad, 6, 1e-7, 1e-6);
    test_env_free(&e);
}

/* ---- ROC AUC -------------------------------------------------------------------------------------------------- */

static double auc_of(const float *scores, const bool *pos, int n) {
    AucItem items[16];
    for (int i = 0; i < n; i++) items[i] = (AucItem){scores[i], pos[i]};
    return metrics_roc_auc(items, n);
}

static void test_auc_hand_values(void) {
    /* perfectly separated, either way */
    CU_ASSERT_DOUBLE_EQUAL(auc_of((float[]){0.1f, 0.3f, 0.2f, 0.4f}, (bool[]){0, 1, 0, 1}, 4), 1.0, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(auc_of((float[]){0.1f, 0.3f, 0.2f, 0.4f}, (bool[]){1, 0, 1, 0}, 4), 0.0, 1e-12);
    /* positives {0.5, 0.8}, negatives {0.5, 0.2, 0.9}: of the 6 pairs, 0.5 beats 0.2 (1) and ties 0.5 (1/2),
       0.8 beats 0.5 and 0.2 (2); neither beats 0.9: U = 3.5, AUC = 3.5 / 6 */
    CU_ASSERT_DOUBLE_EQUAL(auc_of((float[]){0.5f, 0.5f, 0.2f, 0.8f, 0.9f}, (bool[]){1, 0, 0, 1, 0}, 5), 3.5 / 6.0,
                           1e-12);
    /* a tie across three: positives {1, 1}, negatives {1, 0}: U = 2 * (1/2 + 1) = 3 of 4 */
    CU_ASSERT_DOUBLE_EQUAL(auc_of((float[]){1.0f, 1.0f, 1.0f, 0.0f}, (bool[]){1, 0, 1, 0}, 4), 0.75, 1e-12);
    /* every score equal: no ranking at all */
    CU_ASSERT_DOUBLE_EQUAL(auc_of((float[]){2.0f, 2.0f, 2.0f, 2.0f, 2.0f}, (bool[]){1, 0, 0, 1, 0}, 5), 0.5, 1e-12);
}

static void test_auc_undefined_is_nan(void) {
    CU_ASSERT(isnan(auc_of((float[]){0.1f, 0.2f}, (bool[]){0, 0}, 2))); /* no anomaly */
    CU_ASSERT(isnan(auc_of((float[]){0.1f, 0.2f}, (bool[]){1, 1}, 2))); /* only anomalies */
    CU_ASSERT(isnan(auc_of(NULL, NULL, 0)));
    CU_ASSERT(isnan(auc_of((float[]){0.1f, NAN, 0.3f}, (bool[]){0, 1, 1}, 3)));
}

/* ---- dropping classes ----------------------------------------------------------------------------------------- */

/* n examples of feat bytes (example i's bytes are 10 i, 10 i + 1, ...) with these labels. */
static void make_labelled_set(Dataset *d, int n, int feat, const int32_t *labels) {
    memset(d, 0, sizeof *d);
    d->n = n, d->ndim = 3, d->shape[0] = 1, d->shape[1] = 1, d->shape[2] = feat, d->feat = feat;
    d->pixels = malloc((size_t)n * (size_t)feat);
    d->labels = malloc((size_t)n * sizeof *d->labels);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < feat; j++) d->pixels[i * feat + j] = (uint8_t)(10 * i + j);
    memcpy(d->labels, labels, (size_t)n * sizeof *labels);
    d->n_classes = 10, d->pixel_scale = 1.0f, d->pixel_shift = 0.0f;
}

static void test_drop_classes(void) {
    Dataset d;
    make_labelled_set(&d, 6, 2, (int32_t[]){0, 9, 1, 9, 2, 3});
    QtError err = {0};
    int dropped = -1;
    CU_ASSERT_EQUAL_FATAL(dataset_drop_classes(&d, (int[]){9}, 1, &dropped, &err), QT_OK);
    CU_ASSERT_EQUAL(dropped, 2);
    CU_ASSERT_EQUAL_FATAL(d.n, 4);
    static const int kept[4] = {0, 2, 4, 5};
    float x[8];
    int32_t y[4];
    CU_ASSERT_EQUAL_FATAL(dataset_fill_range(&d, 0, 4, x, y, &err), QT_OK);
    for (int i = 0; i < 4; i++) {
        CU_ASSERT_EQUAL(y[i], i == 3 ? 3 : i); /* labels kept as they were: 0, 1, 2, 3 */
        CU_ASSERT_EQUAL(x[2 * i], (float)(10 * kept[i]));
        CU_ASSERT_EQUAL(x[2 * i + 1], (float)(10 * kept[i] + 1));
    }
    CU_ASSERT_EQUAL(d.n_classes, 10);
    /* nothing to drop: nothing changes */
    CU_ASSERT_EQUAL(dataset_drop_classes(&d, (int[]){7, 8}, 2, &dropped, &err), QT_OK);
    CU_ASSERT_EQUAL(dropped, 0);
    CU_ASSERT_EQUAL(d.n, 4);
    dataset_free(&d);
    /* a set of value targets has no classes to drop */
    make_labelled_set(&d, 2, 2, (int32_t[]){0, 1});
    free(d.labels), d.labels = NULL, d.n_classes = 0;
    d.n_targets = 1, d.targets = calloc(2, sizeof(float));
    CU_ASSERT_EQUAL(dataset_drop_classes(&d, (int[]){1}, 1, NULL, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "without class labels"));
    dataset_free(&d);
}

/* ---- value targets -------------------------------------------------------------------------------------------- */

/* n examples of 4 bytes with 2 value targets each, a linear function of the pixels x = p / 255. */
static void make_value_set(Dataset *d, int n, uint64_t seed) {
    memset(d, 0, sizeof *d);
    d->n = n, d->ndim = 3, d->shape[0] = 1, d->shape[1] = 1, d->shape[2] = 4, d->feat = 4;
    d->pixels = malloc((size_t)n * 4);
    d->targets = malloc((size_t)n * 2 * sizeof(float));
    d->n_targets = 2, d->pixel_scale = 1.0f / 255.0f, d->pixel_shift = 0.0f;
    float *u = test_random_uniform((size_t)n * 4, seed, 0.0f, 255.0f);
    for (int i = 0; i < n; i++) {
        float x[4];
        for (int j = 0; j < 4; j++) d->pixels[4 * i + j] = (uint8_t)u[4 * i + j], x[j] = d->pixels[4 * i + j] / 255.0f;
        d->targets[2 * i] = x[0] + 2.0f * x[1] - x[2];
        d->targets[2 * i + 1] = x[3] - 0.5f;
    }
    free(u);
}

static Config *value_config(const char *loss, int units) {
    char yaml[512];
    snprintf(yaml, sizeof yaml,
             "run: {threads: 1}\nmodel: {input: [4], layers: [{name: fc, type: dense, units: %d}]}\n"
             "train: {loss: %s, batch_size: 16, eval_batch_size: 8, optimizer: {name: adamw, lr: 0.05, "
             "weight_decay: 0}}\n", units, loss);
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    if (config_load_string(c, yaml, "value.yaml", NULL, 0, &err) != QT_OK) {
        fprintf(stderr, "\n  %s\n", err.msg);
        free(c);
        return NULL;
    }
    return c;
}

/* A linear model learns a data set's value targets: run_step and evaluation read them, not the labels. */
static void test_value_targets_train(void) {
    Config *c = value_config("mse", 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    Run r;
    TrainOptions o = {.quiet = true};
    run_init(&r, c, &o);
    make_value_set(&r.data.train, 64, 3);
    make_value_set(&r.data.test, 20, 4);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(run_build_model(&r, true, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(batcher_init(&r.plan.batcher, &r.data.train, 16, true, false, 1, &err), QT_OK);
    r.plan.steps_per_epoch = 4, r.plan.total_steps = 300;
    r.plan.sched = c->train.schedule;
    r.plan.sched.base_lr = c->train.optim.lr, r.plan.sched.total_steps = 300;
    CU_ASSERT_EQUAL_FATAL(run_alloc(&r, &err), QT_OK);
    CU_ASSERT_PTR_NOT_NULL(r.work.bt);
    double l0, a0, vl, va, l1, a1;
    CU_ASSERT_EQUAL_FATAL(run_eval_and_log(&r, &l0, &a0, &vl, &va, &err), QT_OK);
    CU_ASSERT(isnan(a0)); /* no accuracy without classes */
    CU_ASSERT(isfinite(r.eval.test_mae) && r.eval.test_mae > 0);
    r.work.tape.training = true;
    for (int s = 0; s < 300; s++) {
        if (run_step(&r, &err) != QT_OK) {
            fprintf(stderr, "\n  step %d: %s\n", s, err.msg);
            CU_FAIL_FATAL("a step failed");
        }
    }
    CU_ASSERT_EQUAL_FATAL(run_eval_and_log(&r, &l1, &a1, &vl, &va, &err), QT_OK);
    CU_ASSERT(l1 < 0.05 * l0);
    /* The test mse is the mean over every value: recompute it from the model's own outputs. */
    TrainResult res;
    memset(&res, 0, sizeof res);
    res.test_loss = l1, res.val_loss = -1;
    run_fill_eval_result(&r, &res);
    CU_ASSERT(res.mse);
    CU_ASSERT_EQUAL(res.test_mse, l1);
    CU_ASSERT(res.test_mae > 0 && res.test_mae * res.test_mae <= res.test_mse * (1 + 1e-9)); /* mae^2 <= mse */
    CU_ASSERT(isnan(res.test_auc));
    CU_ASSERT_EQUAL(res.val_mse, -1.0);
    run_free(&r);
    free(c);
}

/* The head must fit the targets, and cross_entropy cannot fit values: each an error naming what to do. */
static void test_value_targets_checks(void) {
    for (int k = 0; k < 2; k++) {
        Config *c = k ? value_config("mse", 3) : value_config("cross_entropy", 2);
        CU_ASSERT_PTR_NOT_NULL_FATAL(c);
        Run r;
        TrainOptions o = {.quiet = true};
        run_init(&r, c, &o);
        make_value_set(&r.data.train, 8, 3);
        QtError err = {0};
        CU_ASSERT_EQUAL(run_build_model(&r, true, &err), QT_ERR_CONFIG);
        if (k) {
            CU_ASSERT(test_msg_has(&err, "gives 3 values per example"));
            CU_ASSERT(test_msg_has(&err, "targets, 2 values per example"));
        } else {
            CU_ASSERT(test_msg_has(&err, "set train.loss: mse"));
        }
        run_free(&r);
        free(c);
    }
}

/* ---- config rules --------------------------------------------------------------------------------------------- */

#define MODEL_YAML "model: {input: [784], layers: [{type: dense, units: 784}]}\n"

static void test_task_config_rules(void) {
    test_expect_config_error(__FILE__, __LINE__, MODEL_YAML "data: {target: input}\n", "data.target",
                             "set train.loss: mse", NULL);
    test_expect_config_error(__FILE__, __LINE__, MODEL_YAML "data: {target: input}\ntrain: {loss: cross_entropy}\n",
                             "train.loss", "set train.loss: mse", NULL);
    test_expect_config_error(__FILE__, __LINE__, MODEL_YAML "data: {anomaly_classes: [9]}\ntrain: {loss: mse}\n",
                             "data.anomaly_classes", "needs data.target: input", NULL);
    test_expect_config_error(__FILE__, __LINE__, MODEL_YAML "data: {target: input, anomaly_classes: [9, 9]}\n"
                             "train: {loss: mse}\n", "data.anomaly_classes[1]", "listed twice", NULL);
    test_expect_config_error(__FILE__, __LINE__, MODEL_YAML "train: {loss: l1}\n", "train.loss", "cross_entropy",
                             "mse");
    /* the resolved config carries the keys, and reads back the same */
    Config *c = malloc(sizeof *c), *d = malloc(sizeof *d);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(config_load_string(c, MODEL_YAML "data: {target: input, anomaly_classes: [9, 3]}\n"
                                                "train: {loss: mse}\n", "a.yaml", NULL, 0, &err), QT_OK);
    char *yaml = config_to_yaml(c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(yaml);
    CU_ASSERT(strstr(yaml, "target: input") && strstr(yaml, "anomaly_classes: [9, 3]") && strstr(yaml, "loss: mse"));
    CU_ASSERT_EQUAL(config_load_string(d, yaml, "b.yaml", NULL, 0, &err), QT_OK);
    CU_ASSERT_EQUAL(d->train.loss, LOSS_MSE);
    CU_ASSERT_EQUAL(d->data.target, DATA_TARGET_INPUT);
    CU_ASSERT_EQUAL(d->data.n_anomaly_classes, 2);
    char fixed[96] = "", changed[512] = "";
    config_diff_for_resume(c, d, fixed, sizeof fixed, changed, sizeof changed);
    CU_ASSERT_STRING_EQUAL(fixed, "");
    /* a resume may not change what the model learns */
    d->data.anomaly_classes[1] = 4;
    config_diff_for_resume(c, d, fixed, sizeof fixed, changed, sizeof changed);
    CU_ASSERT_PTR_NOT_NULL(strstr(fixed, "data.anomaly_classes"));
    d->data.anomaly_classes[1] = 3, d->train.loss = LOSS_CROSS_ENTROPY;
    config_diff_for_resume(c, d, fixed, sizeof fixed, changed, sizeof changed);
    CU_ASSERT_PTR_NOT_NULL(strstr(fixed, "train.loss"));
    free(yaml), free(c), free(d);
}

/* ---- end to end: the tiny autoencoder ------------------------------------------------------------------------- */

static TestRuns runs;

static int tasks_suite_init(void) {
    runs.root = test_tmpdir_new();
    runs.base_ckpt[0] = '\0'; /* no base: these configs start from their seed */
    return runs.root ? 0 : -1;
}

static int tasks_suite_cleanup(void) { return test_runs_cleanup(&runs); }

/* The train rows' losses of dir/metrics.csv: the first and the last; every accuracy cell must be empty. */
static bool train_losses(const char *dir, double *first, double *last, int *rows) {
    char *path = test_path_join(dir, "metrics.csv");
    char *text = test_file_read(path, NULL);
    free(path);
    if (!text) return false;
    *rows = 0;
    bool empty_acc = true;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        long step;
        double epoch, loss;
        int used = 0;
        if (strncmp(line, "train,", 6) && strncmp(line, "test,", 5)) continue;
        const char *rest = strchr(line, ',') + 1;
        if (sscanf(rest, "%ld,%lf,%lf,%n", &step, &epoch, &loss, &used) != 3) continue;
        empty_acc &= rest[used] == ','; /* split,step,epoch,loss,,lr: the accuracy cell is empty */
        if (line[1] != 'r') continue;
        if ((*rows)++ == 0) *first = loss;
        *last = loss;
    }
    free(text);
    return empty_acc;
}

static void test_ae_trains(void) {
    Config *c = test_runs_config(&runs, AE_CONFIG, "ae", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    TrainResult r;
    CU_ASSERT_EQUAL_FATAL(test_runs_train(c, NULL, 0, &r, &err), QT_OK);
    CU_ASSERT(r.mse);
    CU_ASSERT(isnan(r.test_accuracy));
    CU_ASSERT_EQUAL(r.test_mse, r.test_loss);
    CU_ASSERT(r.test_mae > 0 && r.test_mae < 1.0);
    CU_ASSERT(r.test_auc >= 0.0 && r.test_auc <= 1.0);
    double first = 0, last = 0;
    int rows = 0;
    CU_ASSERT(train_losses(c->run.out_dir, &first, &last, &rows));
    CU_ASSERT_EQUAL(rows, 6);
    CU_ASSERT(last < 0.6 * first); /* measured: 0.94 at step 10, 0.34 at step 60 */
    char *path = test_path_join(c->run.out_dir, "summary.json");
    char *sum = test_file_read(path, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(sum);
    CU_ASSERT(strstr(sum, "\"test_mse\"") && strstr(sum, "\"test_mae\"") && strstr(sum, "\"test_auc\""));
    CU_ASSERT_PTR_NOT_NULL(strstr(sum, "\"loss\": \"mse\""));
    CU_ASSERT_PTR_NULL(strstr(sum, "\"test_accuracy\""));
    free(sum), free(path), free(c);
}

/* Stopped after step 17 (inside a logging window, before the step-30 evaluation) and resumed: the same model,
 * test mse and metrics rows as straight through. */
static void test_ae_resume_is_exact(void) {
    Config *a = test_runs_config(&runs, AE_CONFIG, "ae-straight", NULL, 0);
    Config *b = test_runs_config(&runs, AE_CONFIG, "ae-split", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(a);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    QtError err = {0};
    TrainResult ra, rb;
    CU_ASSERT_EQUAL_FATAL(test_runs_train(a, NULL, 0, &ra, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(test_runs_train(b, NULL, 17, &rb, &err), QT_OK);
    CU_ASSERT(rb.stopped && rb.steps == 17);
    CU_ASSERT_EQUAL_FATAL(test_runs_train(b, "auto", 0, &rb, &err), QT_OK);
    CU_ASSERT_EQUAL(rb.steps, ra.steps);
    CU_ASSERT(memcmp(&rb.test_mse, &ra.test_mse, sizeof ra.test_mse) == 0);
    CU_ASSERT(memcmp(&rb.test_mae, &ra.test_mae, sizeof ra.test_mae) == 0);
    CU_ASSERT(memcmp(&rb.test_auc, &ra.test_auc, sizeof ra.test_auc) == 0);
    char *fa = test_path_join(a->run.out_dir, "final.h5"), *fb = test_path_join(b->run.out_dir, "final.h5");
    CU_ASSERT(test_runs_assert_same_state(a, fa, fb) == 1); /* the one batch norm, its statistics too */
    char *ma = test_metrics_rows(a->run.out_dir), *mb = test_metrics_rows(b->run.out_dir);
    CU_ASSERT(ma && mb && strcmp(ma, mb) == 0);
    free(ma), free(mb), free(fa), free(fb), free(a), free(b);
}

/* The anomaly classes dropped from a file-backed training set (its row list) and its validation split give the
 * same run as from memory, bit for bit. */
static void test_ae_file_storage(void) {
    char cache[1100];
    snprintf(cache, sizeof cache, "data.cache_dir=%s/cache", runs.root);
    const char *mem[] = {"data.storage=memory", "data.val_fraction=0.1"};
    const char *file[] = {"data.storage=file", "data.val_fraction=0.1", cache};
    Config *a = test_runs_config(&runs, AE_CONFIG, "ae-mem", mem, 2);
    Config *b = test_runs_config(&runs, AE_CONFIG, "ae-file", file, 3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(a);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    QtError err = {0};
    TrainResult ra, rb;
    CU_ASSERT_EQUAL_FATAL(test_runs_train(a, NULL, 0, &ra, &err), QT_OK);
    if (test_runs_train(b, NULL, 0, &rb, &err) != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(err.status, QT_OK);
    CU_ASSERT(ra.val_mse > 0);
    CU_ASSERT(memcmp(&ra.test_mse, &rb.test_mse, sizeof ra.test_mse) == 0);
    CU_ASSERT(memcmp(&ra.val_mse, &rb.val_mse, sizeof ra.val_mse) == 0);
    CU_ASSERT(memcmp(&ra.test_auc, &rb.test_auc, sizeof ra.test_auc) == 0);
    char *fa = test_path_join(a->run.out_dir, "final.h5"), *fb = test_path_join(b->run.out_dir, "final.h5");
    test_runs_assert_same_state(a, fa, fb);
    free(fa), free(fb), free(a), free(b);
}

/* Mann-Whitney by pairs, O(n^2): the definition the sort-based AUC must equal. */
static double auc_by_pairs(const float *s, const bool *pos, int n) {
    double u = 0;
    int64_t p = 0, q = 0;
    for (int i = 0; i < n; i++) {
        p += pos[i], q += !pos[i];
        if (!pos[i]) continue;
        for (int j = 0; j < n; j++)
            if (!pos[j]) u += s[i] > s[j] ? 1.0 : s[i] == s[j] ? 0.5 : 0.0;
    }
    return u / ((double)p * (double)q);
}

/* `qtrain eval` of the autoencoder: scores.csv beside eval.json with one row per test example, and a test_auc
 * that is the AUC of those scores with class 9 positive. */
static void test_ae_eval_scores(void) {
    char *ckpt = test_path_join(runs.root, "ae/final.h5");
    if (!test_file_exists(runs.root, "ae/final.h5")) {
        test_skip("the autoencoder of test_ae_trains is missing (run the whole tasks suite)");
        free(ckpt);
        return;
    }
    char *out = test_path_join(runs.root, "ae-eval"), *log = test_path_join(runs.root, "ae-eval.log");
    CU_ASSERT_EQUAL_FATAL(mkdir(out, 0700), 0); /* --out DIR: eval.json and scores.csv go into it */
    int st = test_proc_run(log, (const char *const[]){"eval", "--checkpoint", ckpt, "--out", out, NULL}, 120);
    CU_ASSERT_EQUAL_FATAL(st, 0);
    char *logtext = test_file_read(log, NULL);
    CU_ASSERT(logtext && strstr(logtext, "test_mse:") && strstr(logtext, "test_auc:") && strstr(logtext, "scores.csv"));
    free(logtext);
    char *sp = test_path_join(out, "scores.csv"), *jp = test_path_join(out, "eval.json");
    char *csv = test_file_read(sp, NULL), *json = test_file_read(jp, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(csv);
    CU_ASSERT_PTR_NOT_NULL_FATAL(json);
    CU_ASSERT_EQUAL(strncmp(csv, "index,label,score\n", 18), 0);
    int n_test = -1;
    const char *k = strstr(json, "\"test_examples\": ");
    if (k) n_test = atoi(k + 17);
    const char *a = strstr(json, "\"test_auc\": ");
    double auc = a ? strtod(a + 12, NULL) : NAN;
    CU_ASSERT(auc >= 0.0 && auc <= 1.0);
    CU_ASSERT(strstr(json, "\"test_mse\"") && strstr(json, "\"scores\""));
    float *s = malloc(sizeof(float) * 2000);
    bool *pos = malloc(sizeof(bool) * 2000);
    int n = 0, anomalies = 0;
    bool in_order = true;
    for (char *line = strtok(csv + 18, "\n"); line && n < 2000; line = strtok(NULL, "\n")) {
        int idx, label;
        float score;
        if (sscanf(line, "%d,%d,%f", &idx, &label, &score) != 3) break;
        in_order &= idx == n;
        s[n] = score, pos[n] = label == 9, anomalies += label == 9;
        n++;
    }
    CU_ASSERT(in_order);
    CU_ASSERT_EQUAL(n, n_test); /* one row per test example */
    CU_ASSERT(anomalies > 0 && anomalies < n);
    /* the scores are printed to 9 digits: the AUC of the read-back scores equals the reported one */
    CU_ASSERT_DOUBLE_EQUAL(auc_by_pairs(s, pos, n), auc, 1e-9);
    free(s), free(pos), free(csv), free(json), free(sp), free(jp), free(out), free(log), free(ckpt);
}

/* int8 PTQ of the autoencoder (weights per channel, the batch norm folded) evaluates, its test mse near the
 * float model's. */
static void test_ae_ptq_int8(void) {
    char init[1100];
    snprintf(init, sizeof init, "model.init_from=%s/ae/final.h5", runs.root);
    if (!test_file_exists(runs.root, "ae/final.h5")) {
        test_skip("the autoencoder of test_ae_trains is missing (run the whole tasks suite)");
        return;
    }
    const char *ov[] = {init, "quant.mode=ptq", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]",
                        "train.steps=0", "train.epochs=0"};
    Config *c = test_runs_config(&runs, AE_CONFIG, "ae-ptq", ov, 5);
    Config *f = test_runs_config(&runs, AE_CONFIG, "ae", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    QtError err = {0};
    TrainResult q, fl;
    if (test_runs_train(c, NULL, 0, &q, &err) != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(err.status, QT_OK);
    char *fp = test_path_join(runs.root, "ae/final.h5");
    CU_ASSERT_EQUAL_FATAL(train_eval_checkpoint_to(f, fp, NULL, &fl, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(q.mode, "ptq");
    CU_ASSERT(q.mse && isfinite(q.test_mse));
    CU_ASSERT(fabs(q.test_mse - fl.test_mse) < 0.02 * fl.test_mse); /* measured: equal to 4 digits */
    CU_ASSERT(q.test_auc >= 0.0 && q.test_auc <= 1.0);
    /* compare puts the two side by side by their test mse */
    CompareRun cr[2];
    char *fdir = test_path_join(runs.root, "ae"), *cmp = test_path_join(runs.root, "ae-compare");
    CU_ASSERT_EQUAL_FATAL(compare_load_run(&cr[0], fdir, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(compare_load_run(&cr[1], c->run.out_dir, &err), QT_OK);
    CU_ASSERT(cr[0].mse && cr[1].mse && isnan(cr[0].test_accuracy));
    CU_ASSERT_EQUAL_FATAL(compare_write(cr, 2, cmp, NULL, &err), QT_OK);
    char *mdp = test_path_join(cmp, "compare.md"), *svp = test_path_join(cmp, "compare.svg");
    char *md = test_file_read(mdp, NULL), *svg = test_file_read(svp, NULL);
    CU_ASSERT(md && strstr(md, "| test mse |") && !strstr(md, "nan"));
    CU_ASSERT(svg && strstr(svg, "test mse vs bits per parameter"));
    compare_run_free(&cr[0]), compare_run_free(&cr[1]);
    free(md), free(svg), free(mdp), free(svp), free(fdir), free(cmp), free(fp), free(c), free(f);
}

/* The binary refuses cross_entropy with target: input before touching run.out_dir; and anomaly classes the
 * test split lacks leave the AUC undefined, which is an error naming them. */
/* `qtrain merge` and `qtrain convert` of autoencoder runs (LoRA over the float model; QAT) print the test mse
 * before and after, not an accuracy, which an mse model does not have. */
static void test_ae_merge_convert_print_mse(void) {
    char init[1100];
    snprintf(init, sizeof init, "model.init_from=%s/ae/final.h5", runs.root);
    if (!test_file_exists(runs.root, "ae/final.h5")) {
        test_skip("the autoencoder of test_ae_trains is missing (run the whole tasks suite)");
        return;
    }
    const char *lo[] = {init, "lora.rules=[{module_path: enc, rank: 4}]", "lora.batchnorm=frozen", "train.steps=10"};
    const char *qo[] = {"quant.mode=qat", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]", "train.steps=10"};
    Config *l = test_runs_config(&runs, AE_CONFIG, "ae-lora", lo, 4), *q = test_runs_config(&runs, AE_CONFIG, "ae-qat",
                                                                                              qo, 3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(l);
    CU_ASSERT_PTR_NOT_NULL_FATAL(q);
    QtError err = {0};
    TrainResult r;
    if (test_runs_train(l, NULL, 0, &r, &err) != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(err.status, QT_OK);
    if (test_runs_train(q, NULL, 0, &r, &err) != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(err.status, QT_OK);
    char *lc = test_path_join(runs.root, "ae-lora/final.h5"), *lm = test_path_join(runs.root, "ae-lora/merged.h5");
    char *qc = test_path_join(runs.root, "ae-qat/final.h5"), *qm = test_path_join(runs.root, "ae-qat/ptq.h5");
    char *log = test_path_join(runs.root, "ae-merge.log");
    CU_ASSERT_EQUAL(test_proc_run(log, (const char *const[]){"merge", "--checkpoint", lc, "--out", lm, "-q", NULL},
                                  120), 0);
    char *text = test_file_read(log, NULL);
    CU_ASSERT(text && strstr(text, "test_mse_before:") && strstr(text, "test_mse_after:") && !strstr(text, "nan"));
    free(text);
    CU_ASSERT_EQUAL(test_proc_run(log, (const char *const[]){"convert", "--checkpoint", qc, "--out", qm, "-q", NULL},
                                  120), 0);
    text = test_file_read(log, NULL);
    CU_ASSERT(text && strstr(text, "test_mse_qat:") && strstr(text, "test_mse_ptq:") && !strstr(text, "nan"));
    free(text);
    free(lc), free(lm), free(qc), free(qm), free(log), free(l), free(q);
}

static void test_ae_refusals(void) {
    char *log = test_path_join(runs.root, "refused.log"), *od = test_path_join(runs.root, "refused");
    char set_out[1100];
    snprintf(set_out, sizeof set_out, "run.out_dir=%s", od);
    int st = test_proc_run(log, (const char *const[]){"--config", AE_CONFIG, "--set", "train.loss=cross_entropy",
                                                      "--set", set_out, NULL}, 60);
    CU_ASSERT_EQUAL(st, 2);
    char *text = test_file_read(log, NULL);
    CU_ASSERT(text && strstr(text, "train.loss: cross_entropy cannot measure") && strstr(text, "set train.loss: mse"));
    CU_ASSERT(!test_file_exists(runs.root, "refused"));
    free(text);
    /* a class the data does not have, alone or beside one it has: named, not ignored */
    static const char *const lists[2] = {"data.anomaly_classes=[12]", "data.anomaly_classes=[9, 12]"};
    for (int k = 0; k < 2; k++) {
        Config *c = test_runs_config(&runs, AE_CONFIG, k ? "ae-typo" : "ae-none", &lists[k], 1);
        CU_ASSERT_PTR_NOT_NULL_FATAL(c);
        QtError err = {0};
        TrainResult r;
        CU_ASSERT_EQUAL(test_runs_train(c, NULL, 0, &r, &err), QT_ERR_CONFIG);
        CU_ASSERT(test_msg_has(&err, k ? "data.anomaly_classes [9, 12]" : "data.anomaly_classes [12]"));
        CU_ASSERT(test_msg_has(&err, "names class 12, but the data has 10 classes"));
        free(c);
    }
    free(log), free(od);
}

int register_tasks_suite(void) {
    CU_pSuite s = CU_add_suite("tasks", tasks_suite_init, tasks_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "mse value and gradient match PyTorch's MSELoss", test_mse_matches_torch) ||
           !CU_add_test(s, "ROC AUC: hand values with ties, all equal = 0.5", test_auc_hand_values) ||
           !CU_add_test(s, "ROC AUC: no anomaly, only anomalies, NaN score = NaN", test_auc_undefined_is_nan) ||
           !CU_add_test(s, "dataset_drop_classes keeps the rest in order", test_drop_classes) ||
           !CU_add_test(s, "value targets: a linear model learns them with mse", test_value_targets_train) ||
           !CU_add_test(s, "value targets: head size and cross_entropy refused", test_value_targets_checks) ||
           !CU_add_test(s, "train.loss / data.target / data.anomaly_classes rules", test_task_config_rules) ||
           !CU_add_test(s, "tiny autoencoder: loss falls, mse summary", test_ae_trains) ||
           !CU_add_test(s, "tiny autoencoder: stop + resume is bit-identical", test_ae_resume_is_exact) ||
           !CU_add_test(s, "tiny autoencoder: file storage drops the same examples", test_ae_file_storage) ||
           !CU_add_test(s, "tiny autoencoder: eval writes scores.csv and test_auc", test_ae_eval_scores) ||
           !CU_add_test(s, "tiny autoencoder: int8 PTQ, compare by mse", test_ae_ptq_int8) ||
           !CU_add_test(s, "tiny autoencoder: merge and convert print the test mse", test_ae_merge_convert_print_mse) ||
           !CU_add_test(s, "tiny autoencoder: refusals", test_ae_refusals);
}
