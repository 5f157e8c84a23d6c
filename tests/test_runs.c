/* test_runs.c - in-process training runs for the suites that train the tiny
 * configs (test_runs.h). */
#include "test_runs.h"

#include <CUnit/CUnit.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/checkpoint.h"

int test_runs_init(TestRuns *tr) {
    tr->base_ckpt[0] = '\0';
    tr->root = test_tmpdir_new();
    if (!tr->root) return -1;
    Config *c = test_runs_config(tr, "tests/configs/tiny-base.yaml", "base", NULL, 0);
    TrainResult r;
    QtError err = {0};
    QtStatus st = c ? test_runs_train(c, NULL, 0, &r, &err) : QT_ERR_CONFIG;
    if (c && st != QT_OK) fprintf(stderr, "\n  base run: %s\n", err.msg);
    snprintf(tr->base_ckpt, sizeof tr->base_ckpt, "%s/base/final.h5", tr->root);
    free(c);
    return st == QT_OK ? 0 : -1;
}

int test_runs_cleanup(TestRuns *tr) {
    bool ok = test_tmpdir_remove(tr->root);
    tr->root = NULL;
    tr->base_ckpt[0] = '\0';
    return ok ? 0 : -1;
}

Config *test_runs_config(const TestRuns *tr, const char *path, const char *sub, const char *const *extra,
                         int n_extra) {
    char out_dir[512], init[1100];
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/%s", tr->root, sub);
    snprintf(init, sizeof init, "model.init_from=%s", tr->base_ckpt);
    const char *ov[24] = {out_dir, init};
    int n = tr->base_ckpt[0] ? 2 : 1;
    for (int i = 0; i < n_extra && n < 24; i++) ov[n++] = extra[i];
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    if (c && config_load(c, path, ov, n, &err) != QT_OK) {
        fprintf(stderr, "\n  config %s: %s\n", path, err.msg);
        free(c);
        return NULL;
    }
    return c;
}

QtStatus test_runs_train(const Config *c, const char *resume, int64_t stop_at, TrainResult *r, QtError *err) {
    TrainOptions o = {.resume = resume, .quiet = true, .stop_at_step = stop_at};
    fflush(stdout);
    return train_run(c, &o, r, err);
}

char *test_runs_net_warnings(Net *n, const Config *c, NetInit how, int *count) {
    QtError err = {0};
    QtStatus st = net_build(n, c, how, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", c->source, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    FILE *f = tmpfile();
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    *count = net_print_unused_rules(n, f);
    long len = ftell(f);
    char *text = calloc((size_t)(len > 0 ? len : 0) + 1, 1);
    rewind(f);
    bool ok = text && len >= 0 && fread(text, 1, (size_t)len, f) == (size_t)len;
    fclose(f);
    CU_ASSERT_FATAL(ok);
    return text;
}

void test_runs_load_net(Net *n, const Config *c, const char *ckpt) {
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(net_build(n, c, NET_SHELL, &err), QT_OK);
    CheckpointNet p = net_checkpoint_parts(n);
    QtStatus st = checkpoint_load_model(ckpt, &n->model, &p, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

char *test_runs_path(const TestRuns *tr, const char *sub, const char *name) {
    static char buf[4][1024];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s/%s", tr->root, sub, name);
    return buf[k];
}

int test_runs_assert_same_state(const Config *c, const char *a, const char *b) {
    Model ma, mb;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&ma, c->model.input_ndim, c->model.input_shape, c->model.layers,
                                     c->model.n_layers, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(model_init(&mb, c->model.input_ndim, c->model.input_shape, c->model.layers,
                                     c->model.n_layers, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(a, &ma, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(b, &mb, &err), QT_OK);
    for (int i = 0; i < ma.n_params; i++) {
        size_t bytes = var_numel(&ma.params[i].var) * sizeof(float);
        if (memcmp(ma.params[i].var.value.data, mb.params[i].var.value.data, bytes) != 0) {
            fprintf(stderr, "\n  %s differs between %s and %s\n", ma.params[i].name, a, b);
            CU_FAIL("parameters differ");
        }
    }
    int n_bn = 0;
    for (int i = 0; i < ma.n_modules; i++) {
        const Module *x = &ma.modules[i], *y = &mb.modules[i];
        if (!x->running_mean) continue;
        n_bn++;
        size_t bytes = (size_t)x->in_shape[0] * sizeof(float);
        CU_ASSERT(memcmp(x->running_mean, y->running_mean, bytes) == 0);
        CU_ASSERT(memcmp(x->running_var, y->running_var, bytes) == 0);
        CU_ASSERT_EQUAL(x->num_batches_tracked, y->num_batches_tracked);
        CU_ASSERT(x->num_batches_tracked > 0);
        CU_ASSERT(x->running_var[0] != 1.0f); /* the statistics were read, not left at their start */
    }
    model_free(&ma), model_free(&mb);
    return n_bn;
}

double test_runs_resume_exact(const TestRuns *tr, const char *path, const char *sub, int64_t stop_at, int *n_bn) {
    char straight[256], split[256];
    snprintf(straight, sizeof straight, "%s-straight", sub);
    snprintf(split, sizeof split, "%s-split", sub);
    Config *a = test_runs_config(tr, path, straight, NULL, 0), *b = test_runs_config(tr, path, split, NULL, 0);
    double acc = -1.0;
    QtError err = {0};
    TrainResult ra, rb;
    bool ok = a && b && test_runs_train(a, NULL, 0, &ra, &err) == QT_OK;
    ok = ok && test_runs_train(b, NULL, stop_at, &rb, &err) == QT_OK;
    CU_ASSERT(!ok || (rb.stopped && rb.steps == stop_at));
    ok = ok && test_runs_train(b, "auto", 0, &rb, &err) == QT_OK;
    if (!ok) fprintf(stderr, "\n  %s: %s\n", path, err.msg);
    CU_ASSERT(ok);
    if (ok) {
        CU_ASSERT_EQUAL(rb.steps, ra.steps);
        CU_ASSERT_EQUAL(rb.test_accuracy, ra.test_accuracy);
        CU_ASSERT_EQUAL(rb.test_loss, ra.test_loss);
        char fa[1100], fb[1100];
        snprintf(fa, sizeof fa, "%s/final.h5", a->run.out_dir);
        snprintf(fb, sizeof fb, "%s/final.h5", b->run.out_dir);
        int n = test_runs_assert_same_state(a, fa, fb);
        if (n_bn) *n_bn = n;
        acc = ra.test_accuracy;
    }
    free(a), free(b);
    return acc;
}
