/* test_nonfinite.c - the numerical guards (trainer/guard.h): finding
 * non-finite values, train.on_nonfinite stop and skip, and the divergence
 * watch. */
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "nn/tensor.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/guard.h"
#include "trainer/run.h"
#include "trainer/tools.h"
#include "trainer/train.h"

static char *tmp_root;

static int suite_init(void) { return (tmp_root = test_tmpdir_new()) ? 0 : -1; }
static int suite_clean(void) { return test_tmpdir_remove(tmp_root) ? 0 : -1; }

/* tests/configs/tiny-mlp.yaml into <tmp_root>/<sub> with overrides. */
static Config *load_tiny(const char *sub, const char *const *extra, int n_extra) {
    static char out_dir[512];
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/%s", tmp_root, sub);
    const char *ov[16] = {out_dir};
    for (int i = 0; i < n_extra && i < 15; i++) ov[1 + i] = extra[i];
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    if (c && config_load(c, "tests/configs/tiny-mlp.yaml", ov, 1 + n_extra, &err) != QT_OK) {
        fprintf(stderr, "\n  config: %s\n", err.msg);
        free(c);
        return NULL;
    }
    return c;
}

static size_t first_nonfinite_ref(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return i;
    return n;
}

static void test_first_nonfinite_matches_ref(void) {
    enum { N = 5000 };
    float *x = malloc(N * sizeof *x);
    CU_ASSERT_PTR_NOT_NULL_FATAL(x);
    Rng rng;
    rng_init(&rng, 7, 0);
    rng_fill_uniform(&rng, x, N, -1e38f, 1e38f); /* hi - lo must stay finite */
    x[10] = -0.0f, x[11] = 1e-45f, x[12] = 3.4028235e38f, x[13] = -3.4028235e38f; /* finite extremes */
    CU_ASSERT_EQUAL(floats_first_nonfinite(x, N), (size_t)N);
    CU_ASSERT_EQUAL(floats_first_nonfinite(x, 0), 0u);
    const float bad[] = {NAN, INFINITY, -INFINITY, -NAN};
    const size_t at[] = {0, 1, 1023, 1024, 1025, 2047, 4999};
    for (size_t b = 0; b < sizeof bad / sizeof *bad; b++)
        for (size_t i = 0; i < sizeof at / sizeof *at; i++) {
            float keep = x[at[i]];
            x[at[i]] = bad[b];
            CU_ASSERT_EQUAL(floats_first_nonfinite(x, N), first_nonfinite_ref(x, N));
            CU_ASSERT_EQUAL(floats_first_nonfinite(x, N), at[i]);
            CU_ASSERT_EQUAL(floats_first_nonfinite(x, at[i]), at[i]); /* before it: all finite */
            x[at[i]] = keep;
        }
    free(x);
}

/* Once when an occurrence starts, again only after it has ended. */
static void test_loss_watch_reports_once_per_occurrence(void) {
    LossWatch w = {0};
    double fast, slow;
    int reports = 0, first_at = -1;
    for (int s = 0; s < 300; s++) {
        double loss = 0.5 + 0.05 * ((s * 7919) % 13 - 6) / 6.0; /* noisy but steady */
        if (s >= 100 && s < 110) loss = 5.0;                     /* a burst */
        if (s >= 200 && s < 215) loss = 8.0;                     /* another */
        bool starts = loss_watch_feed(&w, loss, 2.0, &fast, &slow);
        if (s == 99) CU_ASSERT(fabs(slow - 0.5) < 0.05); /* bias-corrected: the steady loss, not pulled to 0 */
        if (starts) {
            reports++;
            if (first_at < 0) first_at = s;
        }
    }
    CU_ASSERT_EQUAL(reports, 2);
    CU_ASSERT_EQUAL(w.occurrences, 2);
    CU_ASSERT(first_at >= 100 && first_at < 103);

    /* a falling loss (early training) never reports; nor does a factor of 0 */
    LossWatch down = {0}, off = {0};
    bool any = false;
    for (int s = 0; s < 200; s++) {
        any |= loss_watch_feed(&down, 2.3 * exp(-s / 40.0) + 0.2, 2.0, &fast, &slow);
        any |= loss_watch_feed(&off, s == 150 ? 100.0 : 0.3, 0.0, &fast, &slow);
    }
    CU_ASSERT_FALSE(any);
    /* no report in the warm-up, however large the jump */
    LossWatch early = {0};
    for (int s = 0; s < LOSS_WATCH_WARMUP - 1; s++) CU_ASSERT_FALSE(loss_watch_feed(&early, s < 5 ? 0.1 : 50.0, 2.0,
                                                                                   &fast, &slow));
}

static void test_grads_finite_names_module_and_tensor(void) {
    float g1[4] = {0}, g2[6] = {0}, v1[4] = {0}, v2[6] = {0};
    Param a = {.name = "fc1/weight", .trainable = true}, b = {.name = "head/bias", .trainable = true};
    a.var.value.data = v1, a.var.grad = g1, a.var.value.ndim = 1, a.var.value.shape[0] = 4;
    b.var.value.data = v2, b.var.grad = g2, b.var.value.ndim = 1, b.var.value.shape[0] = 6;
    Param *ps[] = {&a, &b};
    char where[256] = "";
    CU_ASSERT(guard_grads_finite(ps, 2, where, sizeof where));
    g1[2] = INFINITY;
    CU_ASSERT_FALSE(guard_grads_finite(ps, 2, where, sizeof where));
    CU_ASSERT_PTR_NOT_NULL(strstr(where, "module fc1, tensor weight"));
    CU_ASSERT_PTR_NOT_NULL(strstr(where, "inf at index 2"));
    CU_ASSERT_PTR_NOT_NULL(strstr(where, "1 of 2"));
    g2[5] = NAN; /* nearer the loss: named first */
    CU_ASSERT_FALSE(guard_grads_finite(ps, 2, where, sizeof where));
    CU_ASSERT_PTR_NOT_NULL(strstr(where, "module head, tensor bias"));
    CU_ASSERT_PTR_NOT_NULL(strstr(where, "at index 5"));
    CU_ASSERT_PTR_NOT_NULL(strstr(where, "2 of 2"));
}

/* A prepared run of tiny-mlp (no out_dir use) for driving run_step. */
static bool prepare(Run *r, Config *c, TrainOptions *o) {
    run_init(r, c, o);
    QtError err = {0};
    if (run_prepare(r, true, &err) != QT_OK) {
        fprintf(stderr, "\n  run_prepare: %s\n", err.msg);
        return false;
    }
    r->work.tape.training = true;
    return true;
}

static float *copy_params(const Model *m, size_t *n_out) {
    size_t n = 0;
    for (int i = 0; i < m->n_params; i++) n += var_numel(&m->params[i].var);
    float *v = malloc(n * sizeof *v), *p = v;
    for (int i = 0; v && i < m->n_params; i++) {
        memcpy(p, m->params[i].var.value.data, var_numel(&m->params[i].var) * sizeof *p);
        p += var_numel(&m->params[i].var);
    }
    *n_out = n;
    return v;
}

/* A weight value poked to NaN: stop names the step, module and tensor;
 * skip drops exactly that step's update and the run goes on. */
static void check_poked_step(bool skip, bool clip) {
    /* with clipping, a non-finite gradient shows in the clipping norm; without, in a scan */
    const char *ov[] = {skip ? "train.on_nonfinite=skip" : "train.on_nonfinite=stop",
                        clip ? "train.grad_clip=1" : "train.grad_clip=0"};
    char sub[32];
    snprintf(sub, sizeof sub, "poke-%s-%d", skip ? "skip" : "stop", clip);
    Config *c = load_tiny(sub, ov, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainOptions o = {.quiet = true};
    Run r;
    CU_ASSERT_FATAL(prepare(&r, c, &o));
    QtError err = {0};
    CU_ASSERT_EQUAL(run_step(&r, &err), QT_OK);
    CU_ASSERT_EQUAL(run_step(&r, &err), QT_OK);
    Param *w = &r.model.net.model.params[3]; /* a relu would hide a NaN in fc1 */
    CU_ASSERT_STRING_EQUAL(w->name, "head/bias");
    size_t n_before;
    float *before = copy_params(&r.model.net.model, &n_before);
    int64_t optim_step = r.model.optim.step;
    float keep = w->var.value.data[7];
    w->var.value.data[7] = NAN;
    QtStatus st = run_step(&r, &err);
    w->var.value.data[7] = keep; /* as it was before the step */
    size_t n_after;
    float *after = copy_params(&r.model.net.model, &n_after);
    /* either way the update was not applied and the optimizer did not count it */
    CU_ASSERT(n_before == n_after && memcmp(before, after, n_before * sizeof *before) == 0);
    CU_ASSERT_EQUAL(r.model.optim.step, optim_step);
    if (!skip) {
        CU_ASSERT_EQUAL(st, QT_ERR_VALUE);
        CU_ASSERT(test_msg_has(&err, "step 3:"));
        CU_ASSERT(test_msg_has(&err, "module head, tensor bias holds nan at index 7"));
        CU_ASSERT(test_msg_has(&err, "train.on_nonfinite: skip"));
        CU_ASSERT_EQUAL(r.plan.step, 2);
    } else {
        CU_ASSERT_EQUAL(st, QT_OK);
        CU_ASSERT_EQUAL(r.plan.step, 3);
        CU_ASSERT_EQUAL(r.guards.nonfinite_skipped, 1);
        CU_ASSERT_EQUAL(r.log.win_steps, 2); /* the skipped loss is not in the window */
        CU_ASSERT_EQUAL(run_step(&r, &err), QT_OK); /* and training goes on */
        CU_ASSERT_EQUAL(r.model.optim.step, optim_step + 1);
        CU_ASSERT_EQUAL(r.guards.nonfinite_skipped, 1);
    }
    free(before), free(after);
    run_free(&r);
    free(c);
}

static void test_poked_weight_stops(void) { check_poked_step(false, false), check_poked_step(false, true); }
static void test_poked_weight_skips(void) { check_poked_step(true, false), check_poked_step(true, true); }

/* An absurd learning rate blows the weights up: the run stops with the
 * step, module and tensor named, and the last good checkpoint loads. */
static void test_exploding_run_stops_and_keeps_last_good(void) {
    const char *ov[] = {"train.optimizer.name=sgd", "train.optimizer.lr=1e30", "train.checkpoint_every=1",
                        "train.eval_every=0"};
    Config *c = load_tiny("explode", ov, 4);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainOptions o = {.quiet = true};
    TrainResult res;
    QtError err = {0};
    CU_ASSERT_EQUAL(train_run(c, &o, &res, &err), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&err, "is not finite"));
    CU_ASSERT(test_msg_has(&err, "module "));
    CU_ASSERT(test_msg_has(&err, "the last good checkpoint, step "));
    long step = -1, good = -1;
    const char *s = strstr(err.msg, "step "), *g = strstr(err.msg, "checkpoint, step ");
    if (s) step = strtol(s + 5, NULL, 10);
    if (g) good = strtol(g + 17, NULL, 10);
    CU_ASSERT(step >= 2 && good == step - 1);
    /* last.h5 is that step's, loads, and holds finite parameters */
    char *last = test_path_join(c->run.out_dir, "last.h5");
    Run r;
    CU_ASSERT_FATAL(prepare(&r, c, &o));
    CheckpointState st = {.n_rngs = 0};
    CU_ASSERT_EQUAL(checkpoint_load(last, &r.model.net.model, &r.model.optim, &st, &err), QT_OK);
    CU_ASSERT_EQUAL(st.step, good);
    for (int i = 0; i < r.model.net.model.n_params; i++) {
        const Var *v = &r.model.net.model.params[i].var;
        CU_ASSERT_EQUAL(floats_first_nonfinite(v->value.data, var_numel(v)), var_numel(v));
    }
    run_free(&r);
    free(last), free(c);
}

/* skip on a run that cannot recover: every later step is dropped and
 * counted, across a stop and resume, until GUARD_MAX_SKIPS_IN_A_ROW in a
 * row stop it; the count of the first invocation carries over. */
static void test_skip_gives_up_on_a_broken_model(void) {
    const char *ov[] = {"train.optimizer.name=sgd", "train.optimizer.lr=1e30", "train.on_nonfinite=skip",
                        "train.checkpoint_every=4", "train.eval_every=0", "train.steps=60"};
    Config *c = load_tiny("explode-skip", ov, 6);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainOptions o = {.quiet = true, .stop_at_step = 10};
    TrainResult res;
    QtError err = {0};
    QtStatus st = train_run(c, &o, &res, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT_EQUAL(res.steps, 10);
    o.stop_at_step = 0, o.resume = "auto";
    CU_ASSERT_EQUAL(train_run(c, &o, &res, &err), QT_ERR_VALUE);
    /* steps 2.. are skipped (the first one blew the weights up); step 26 is the 25th in a row */
    CU_ASSERT(test_msg_has(&err, "step 26: the training loss has not been finite for 25 steps in a row (25 skipped"));
    CU_ASSERT(test_msg_has(&err, "Skipping cannot mend the model"));
    CU_ASSERT(test_msg_has(&err, "the last good checkpoint, step 24,"));
    free(c);
}

static long summary_count(const char *dir, const char *key) {
    char *path = test_path_join(dir, "summary.json"), *text = test_file_read(path, NULL), want[64];
    snprintf(want, sizeof want, "\"%s\": ", key);
    const char *at = text ? strstr(text, want) : NULL;
    long v = at ? strtol(at + strlen(want), NULL, 10) : -1;
    free(path), free(text);
    return v;
}

/* A learning rate raised 20x at step 50 makes the loss jump: one report
 * (the loss stays up for a while: still one occurrence), none when off. */
static void test_divergence_reported_in_a_run(void) {
    const char *ov[] = {"train.optimizer.name=sgd", "train.optimizer.lr=0.05", "train.schedule.name=step",
                        "train.schedule.step_size=50", "train.schedule.gamma=20", "train.steps=100",
                        "train.eval_every=0", "train.divergence_factor=2"};
    for (int off = 0; off < 2; off++) {
        if (off) ov[7] = "train.divergence_factor=0";
        Config *c = load_tiny(off ? "diverge-off" : "diverge", ov, 8);
        CU_ASSERT_PTR_NOT_NULL_FATAL(c);
        TrainOptions o = {.quiet = true};
        TrainResult res;
        QtError err = {0};
        CU_ASSERT_EQUAL(train_run(c, &o, &res, &err), QT_OK);
        CU_ASSERT_EQUAL(summary_count(c->run.out_dir, "divergences"), off ? 0 : 1);
        CU_ASSERT_EQUAL(summary_count(c->run.out_dir, "nonfinite_skipped"), 0);
        free(c);
    }
}

/* The tiny config in sub, trained 3 steps with o, for a test that damages
 * its final.h5: *final gets that path (malloc'd). */
static Config *train_tiny_3_steps(const char *sub, const TrainOptions *o, char **final) {
    const char *ov[] = {"train.steps=3"};
    Config *c = load_tiny(sub, ov, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainResult res;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(train_run(c, o, &res, &err), QT_OK);
    *final = test_path_join(c->run.out_dir, "final.h5");
    return c;
}

/* Sets every value of dataset ds in file path to `value` (all = true) or
 * only index `at`; returns the old value at `at` (NAN on failure). */
static float poke_dataset(const char *path, const char *ds, size_t at, float value, bool all) {
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT), d = f >= 0 ? H5Dopen2(f, ds, H5P_DEFAULT) : -1;
    float old = NAN;
    if (d >= 0) {
        hid_t space = H5Dget_space(d);
        size_t n = (size_t)H5Sget_simple_extent_npoints(space);
        float *v = malloc(n * sizeof *v);
        if (v && at < n && H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0) {
            old = v[at];
            for (size_t i = 0; i < n; i++)
                if (all || i == at) v[i] = value;
            if (H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) < 0) old = NAN;
        }
        free(v);
        H5Sclose(space), H5Dclose(d);
    }
    if (f >= 0) H5Fclose(f);
    return old;
}

/* A checkpoint with a NaN parameter or optimizer moment is refused, naming
 * the dataset and the index. */
static void test_checkpoint_with_nan_is_refused(void) {
    TrainOptions o = {.quiet = true};
    char *final = NULL;
    Config *c = train_tiny_3_steps("nan-ckpt", &o, &final);
    QtError err = {0};
    const char *datasets[] = {"/params/head/bias", "/optim/fc1/weight/v"};
    for (int k = 0; k < 2; k++) {
        float keep = poke_dataset(final, datasets[k], 3, k ? INFINITY : NAN, false);
        CU_ASSERT_FATAL(isfinite(keep));
        Run r;
        CU_ASSERT_FATAL(prepare(&r, c, &o));
        CheckpointState st = {.n_rngs = 0};
        err = (QtError){0};
        CU_ASSERT_EQUAL(checkpoint_load(final, &r.model.net.model, &r.model.optim, &st, &err), QT_ERR_FORMAT);
        CU_ASSERT(test_msg_has(&err, datasets[k] + 1));
        CU_ASSERT(test_msg_has(&err, k ? "holds inf at index 3" : "holds nan at index 3"));
        run_free(&r);
        /* mended again for the next case */
        poke_dataset(final, datasets[k], 3, keep, false);
    }
    test_assert_hdf5_closed();
    free(final), free(c);
}

/* AdamW's v < 0 is refused at load, naming file, dataset, index and value
 * (it used to load and turn a weight into NaN at the next update). */
static void test_negative_v_refused_at_load(void) {
    TrainOptions o = {.quiet = true};
    char *final = NULL;
    Config *c = train_tiny_3_steps("neg-v", &o, &final);
    QtError err = {0};
    CU_ASSERT_FATAL(isfinite(poke_dataset(final, "/optim/fc1/weight/v", 5, -0.25f, false)));
    Run r;
    CU_ASSERT_FATAL(prepare(&r, c, &o));
    CheckpointState st = {.n_rngs = 0};
    CU_ASSERT_EQUAL(checkpoint_load(final, &r.model.net.model, &r.model.optim, &st, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, final));
    CU_ASSERT(test_msg_has(&err, "/optim/fc1/weight/v holds -0.25 at index 5"));
    CU_ASSERT(test_msg_has(&err, "never negative"));
    run_free(&r);
    test_assert_hdf5_closed();
    free(final), free(c);
}

/* A parameter made non-finite by the update itself (finite loss and
 * gradients; here a negative second moment put in memory) stops the run in
 * both on_nonfinite modes: skip cannot undo an applied update. The NaN is in
 * fc1, whose ReLU would hide it from every later loss and gradient. */
static void check_nonfinite_update(bool skip) {
    const char *ov[] = {skip ? "train.on_nonfinite=skip" : "train.on_nonfinite=stop"};
    Config *c = load_tiny(skip ? "bad-update-skip" : "bad-update-stop", ov, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainOptions o = {.quiet = true};
    Run r;
    CU_ASSERT_FATAL(prepare(&r, c, &o));
    QtError err = {0};
    CU_ASSERT_EQUAL(run_step(&r, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(r.model.net.trainable[0]->name, "fc1/weight");
    r.model.optim.v[0][9] = -1.0f;
    CU_ASSERT_EQUAL(run_step(&r, &err), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&err, "step 2: the optimizer update left a parameter non-finite"));
    CU_ASSERT(test_msg_has(&err, "module fc1, tensor weight holds "));
    CU_ASSERT(test_msg_has(&err, "nan at index 9"));
    CU_ASSERT(test_msg_has(&err, "cannot undo"));
    CU_ASSERT_EQUAL(r.plan.step, 1);
    run_free(&r);
    free(c);
}

static void test_nonfinite_update_stops(void) { check_nonfinite_update(false), check_nonfinite_update(true); }

/* Adapters are checked like parameters at load, and merge checks the
 * merged weights before it writes anything. */
static void test_adapters_and_merge_checked(void) {
    char out_dir[600];
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/lora-nan", tmp_root);
    const char *ov[] = {out_dir, "quant.mode=none", "quant.rules=[]", "train.steps=4"};
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    CU_ASSERT_FATAL(c && config_load(c, "tests/configs/tiny-qlora.yaml", ov, 4, &err) == QT_OK);
    TrainOptions o = {.quiet = true};
    TrainResult res;
    CU_ASSERT_EQUAL_FATAL(train_run(c, &o, &res, &err), QT_OK);
    char *final = test_path_join(c->run.out_dir, "final.h5"), *adapters = test_path_join(c->run.out_dir, "adapters.h5");
    char *merged = test_path_join(c->run.out_dir, "merged.h5");
    MergeReport rep;
    /* a NaN in an adapter: refused at load, by merge and by a run reading adapters_from */
    float keep = poke_dataset(final, "/lora/fc1/A", 2, NAN, false);
    CU_ASSERT_FATAL(isfinite(keep));
    CU_ASSERT_EQUAL(tools_merge(final, merged, false, false, NULL, &rep, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "/lora/fc1/A holds nan at index 2"));
    CU_ASSERT(!test_file_exists(c->run.out_dir, "merged.h5"));
    CU_ASSERT(isnan(poke_dataset(final, "/lora/fc1/A", 2, keep, false)));
    CU_ASSERT(isfinite(poke_dataset(adapters, "/lora/fc1/B", 0, INFINITY, false)));
    Config *c2 = malloc(sizeof *c2);
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/lora-from", tmp_root);
    char from[700];
    snprintf(from, sizeof from, "model.adapters_from=%s", adapters);
    const char *ov2[] = {out_dir, "quant.mode=none", "quant.rules=[]", "train.steps=2", from};
    CU_ASSERT_FATAL(c2 && config_load(c2, "tests/configs/tiny-qlora.yaml", ov2, 5, &err) == QT_OK);
    err = (QtError){0};
    CU_ASSERT_NOT_EQUAL(train_run(c2, &o, &res, &err), QT_OK);
    CU_ASSERT(test_msg_has(&err, "/lora/fc1/B holds inf at index 0"));
    /* finite but huge adapters overflow the merged weight: refused, nothing written */
    CU_ASSERT(isfinite(poke_dataset(final, "/lora/fc1/A", 0, 1e30f, true)));
    CU_ASSERT(isfinite(poke_dataset(final, "/lora/fc1/B", 0, 3e38f, true)));
    err = (QtError){0};
    CU_ASSERT_EQUAL(tools_merge(final, merged, false, false, NULL, &rep, &err), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&err, "fc1/weight = inf"));
    CU_ASSERT(test_msg_has(&err, "nothing was written"));
    CU_ASSERT(!test_file_exists(c->run.out_dir, "merged.h5"));
    test_assert_hdf5_closed();
    free(final), free(adapters), free(merged), free(c), free(c2);
}

static void test_config_keys(void) {
    const char *bad1[] = {"train.on_nonfinite=ignore"}, *bad2[] = {"train.divergence_factor=0.5"};
    const char *ok[] = {"train.on_nonfinite=skip", "train.divergence_factor=0"};
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    CU_ASSERT_EQUAL(config_load(c, "tests/configs/tiny-mlp.yaml", bad1, 1, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "train.on_nonfinite") && test_msg_has(&err, "skip"));
    err = (QtError){0};
    CU_ASSERT_EQUAL(config_load(c, "tests/configs/tiny-mlp.yaml", bad2, 1, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "train.divergence_factor"));
    err = (QtError){0};
    CU_ASSERT_EQUAL_FATAL(config_load(c, "tests/configs/tiny-mlp.yaml", NULL, 0, &err), QT_OK);
    CU_ASSERT_EQUAL(c->train.on_nonfinite, NONFINITE_STOP);
    CU_ASSERT_EQUAL(c->train.divergence_factor, 2.0f);
    CU_ASSERT_EQUAL_FATAL(config_load(c, "tests/configs/tiny-mlp.yaml", ok, 2, &err), QT_OK);
    CU_ASSERT_EQUAL(c->train.on_nonfinite, NONFINITE_SKIP);
    CU_ASSERT_EQUAL(c->train.divergence_factor, 0.0f);
    free(c);
}

int register_nonfinite_suite(void) {
    CU_pSuite s = CU_add_suite("nonfinite", suite_init, suite_clean);
    if (!s) return -1;
    return !CU_add_test(s, "floats_first_nonfinite matches the scalar search", test_first_nonfinite_matches_ref) ||
           !CU_add_test(s, "divergence watch: once per occurrence, not in warm-up or on a falling loss",
                        test_loss_watch_reports_once_per_occurrence) ||
           !CU_add_test(s, "a non-finite gradient names its module and tensor",
                        test_grads_finite_names_module_and_tensor) ||
           !CU_add_test(s, "on_nonfinite stop: the step, module and tensor named, no update",
                        test_poked_weight_stops) ||
           !CU_add_test(s, "on_nonfinite skip: the update dropped and counted, training goes on",
                        test_poked_weight_skips) ||
           !CU_add_test(s, "an exploding run stops; the last good checkpoint loads",
                        test_exploding_run_stops_and_keeps_last_good) ||
           !CU_add_test(s, "skip gives up on a broken model, counting across a resume",
                        test_skip_gives_up_on_a_broken_model) ||
           !CU_add_test(s, "a diverging run is reported once", test_divergence_reported_in_a_run) ||
           !CU_add_test(s, "a checkpoint with a NaN or inf is refused", test_checkpoint_with_nan_is_refused) ||
           !CU_add_test(s, "a negative AdamW second moment is refused at load", test_negative_v_refused_at_load) ||
           !CU_add_test(s, "a parameter made non-finite by an update stops the run (stop and skip)",
                        test_nonfinite_update_stops) ||
           !CU_add_test(s, "non-finite adapters are refused at load; merge checks its weights before writing",
                        test_adapters_and_merge_checked) ||
           !CU_add_test(s, "train.on_nonfinite and train.divergence_factor", test_config_keys);
}
