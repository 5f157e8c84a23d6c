/* test_model_graph.c - the layers of small real models reached from a
 * config: batchnorm1d/2d with the running statistics their modules own,
 * globalavgpool; their config keys and errors; a batch-norm CNN trained end
 * to end on the mini data set. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "nn/ops.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/train.h"

static LayerSpec bn_layer(LayerType type, const char *name) {
    LayerSpec s = {.type = type, .eps = 1e-5f, .momentum = 0.1f};
    snprintf(s.name, sizeof s.name, "%s", name);
    return s;
}

/* ---- batchnorm and globalavgpool modules ------------------------------------------ */

static void test_bn_module_state(void) {
    LayerSpec layers[] = {{.type = LAYER_CONV2D, .name = "conv1", .out_channels = 3, .kernel = 3, .stride = 1,
                           .padding = 1, .no_bias = true},
                          bn_layer(LAYER_BATCHNORM2D, "bn1"),
                          {.type = LAYER_RELU},
                          {.type = LAYER_GLOBALAVGPOOL},
                          bn_layer(LAYER_BATCHNORM1D, "bn2"),
                          {.type = LAYER_DENSE, .name = "head", .units = 4}};
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){2, 5, 5}, layers, 6, &err), QT_OK);
    Rng r;
    rng_init(&r, 3, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    CU_ASSERT(model_has_batchnorm(&m));
    const char *names[] = {"conv1/weight", "bn1/weight", "bn1/bias", "bn2/weight", "bn2/bias", "head/weight",
                           "head/bias"};
    CU_ASSERT_EQUAL(m.n_params, 7);
    for (int i = 0; i < 7 && i < m.n_params; i++) CU_ASSERT_STRING_EQUAL(m.params[i].name, names[i]);
    Module *bn1 = model_find_module(&m, "bn1"), *gap = &m.modules[3];
    CU_ASSERT_EQUAL(gap->out_ndim, 1);
    CU_ASSERT_EQUAL(gap->out_shape[0], 3);
    for (int c = 0; c < 3; c++) {
        CU_ASSERT_EQUAL(bn1->weight->var.value.data[c], 1.0f);
        CU_ASSERT_EQUAL(bn1->bias->var.value.data[c], 0.0f);
        CU_ASSERT_EQUAL(bn1->running_mean[c], 0.0f);
        CU_ASSERT_EQUAL(bn1->running_var[c], 1.0f);
    }
    CU_ASSERT_EQUAL(bn1->num_batches_tracked, 0);
    CU_ASSERT_PTR_NULL(m.modules[0].running_mean); /* only batch norms hold statistics */
    model_free(&m);

    /* affine: false has no parameters, but still its statistics */
    LayerSpec plain = bn_layer(LAYER_BATCHNORM1D, "bn");
    plain.no_affine = true;
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){6}, &plain, 1, &err), QT_OK);
    CU_ASSERT_EQUAL(m.n_params, 0);
    CU_ASSERT_PTR_NOT_NULL(m.modules[0].running_var);
    model_free(&m);
}

/* Training normalises with the batch and moves the running statistics; eval
 * is the affine map with the running statistics, whatever the batch holds. */
static void test_bn_train_and_eval(void) {
    LayerSpec bn = bn_layer(LAYER_BATCHNORM2D, "bn");
    Model m;
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){2, 2, 2}, &bn, 1, NULL), QT_OK);
    Module *mod = &m.modules[0];
    Rng r;
    rng_init(&r, 3, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    enum { N = 3, NX = N * 2 * 2 * 2 };
    float x[NX];
    for (int i = 0; i < NX; i++) x[i] = (float)((i * 7) % 11) - 3.0f;
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.training = true;
    Var *y = model_forward(&m, &e.tape, test_var(&e, x, 4, (int[]){N, 2, 2, 2}, false));
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    CU_ASSERT_EQUAL(mod->num_batches_tracked, 1);
    /* channel 0: values x[n*8 + 0..3]; running_mean = 0.1 * mean, running_var = 0.9 + 0.1 * unbiased var */
    double s = 0, ss = 0;
    for (int n = 0; n < N; n++)
        for (int k = 0; k < 4; k++) s += x[n * 8 + k];
    double mean = s / 12;
    for (int n = 0; n < N; n++)
        for (int k = 0; k < 4; k++) ss += (x[n * 8 + k] - mean) * (x[n * 8 + k] - mean);
    CU_ASSERT_DOUBLE_EQUAL(mod->running_mean[0], 0.1 * mean, 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(mod->running_var[0], 0.9 + 0.1 * ss / 11, 1e-5);
    /* the training output is normalised: channel 0 has mean 0 */
    double ym = 0;
    for (int n = 0; n < N; n++)
        for (int k = 0; k < 4; k++) ym += y->value.data[n * 8 + k];
    CU_ASSERT_DOUBLE_EQUAL(ym / 12, 0.0, 1e-5);

    /* eval: (x - running_mean) / sqrt(running_var + eps) * weight + bias, statistics untouched */
    mod->running_mean[0] = 0.5f, mod->running_var[0] = 4.0f, mod->running_mean[1] = -1.0f, mod->running_var[1] = 0.25f;
    mod->weight->var.value.data[1] = 2.0f, mod->bias->var.value.data[1] = 0.5f;
    tape_reset(&e.tape);
    e.tape.training = false;
    e.tape.grad_enabled = false;
    y = model_forward(&m, &e.tape, test_var(&e, x, 4, (int[]){N, 2, 2, 2}, false));
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < 4; k++) {
            double want0 = (x[n * 8 + k] - 0.5) / sqrt(4.0 + 1e-5);
            double want1 = (x[n * 8 + 4 + k] + 1.0) / sqrt(0.25 + 1e-5) * 2.0 + 0.5;
            CU_ASSERT_DOUBLE_EQUAL(y->value.data[n * 8 + k], want0, 1e-5);
            CU_ASSERT_DOUBLE_EQUAL(y->value.data[n * 8 + 4 + k], want1, 1e-5);
        }
    CU_ASSERT_EQUAL(mod->num_batches_tracked, 1);
    CU_ASSERT_EQUAL(mod->running_mean[0], 0.5f);
    test_env_free(&e);
    model_free(&m);
}

static void expect_model_error(int ndim, const int *shape, const LayerSpec *layers, int n, const char *needle) {
    Model m;
    QtError err = {0};
    CU_ASSERT_NOT_EQUAL(model_init(&m, ndim, shape, layers, n, &err), QT_OK);
    if (!strstr(err.msg, needle)) fprintf(stderr, "\n  want '%s' in: %s\n", needle, err.msg);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, needle));
}

static void test_bn_shape_errors(void) {
    LayerSpec bn2 = bn_layer(LAYER_BATCHNORM2D, "bn"), bn1 = bn_layer(LAYER_BATCHNORM1D, "bn");
    LayerSpec gap = {.type = LAYER_GLOBALAVGPOOL, .name = "gap"};
    expect_model_error(1, (int[]){8}, &bn2, 1, "layer 'bn' (batchnorm2d) needs (C, H, W) input per example, got (8,)");
    expect_model_error(3, (int[]){2, 4, 4}, &bn1, 1, "layer 'bn' (batchnorm1d) needs (C,) input per example");
    expect_model_error(1, (int[]){8}, &gap, 1, "layer 'gap' (globalavgpool) needs (C, H, W) input");
    bn1.momentum = 1.5f;
    expect_model_error(1, (int[]){8}, &bn1, 1, "momentum must be in [0, 1]");
}

/* ---- config -------------------------------------------------------------------------- */

#define NAME "t.yaml"
#define BN_MODEL                                                                          \
    "model:\n"                                                                            \
    "  input: [1, 4, 4]\n"                                                                \
    "  layers:\n"                                                                         \
    "    - {name: c, type: conv2d, out_channels: 2, kernel: 3, padding: 1, bias: false}\n" \
    "    - {name: bn, type: batchnorm2d%s}\n"                                             \
    "    - {type: globalavgpool}\n"                                                       \
    "    - {type: dense, units: 3}\n"

static QtStatus load_bn(Config *c, const char *bn_keys, QtError *e) {
    char text[1024];
    snprintf(text, sizeof text, BN_MODEL, bn_keys);
    qt_error_clear(e);
    return config_load_string(c, text, NAME, NULL, 0, e);
}

static void expect_bn_error(int line, const char *bn_keys, const char *needle) {
    Config c;
    QtError e = {0};
    QtStatus st = load_bn(&c, bn_keys, &e);
    bool ok = st == QT_ERR_CONFIG && strstr(e.msg, needle) != NULL;
    if (!ok) fprintf(stderr, "\n  %s:%d: status %d, message: %s\n", __FILE__, line, st, e.msg);
    CU_assertImplementation(ok, (unsigned)line, "config error as expected", __FILE__, "", CU_FALSE);
}

static void test_bn_config(void) {
    Config c;
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(load_bn(&c, "", &e), QT_OK);
    const LayerSpec *s = &c.model.layers[1];
    CU_ASSERT_EQUAL(s->type, LAYER_BATCHNORM2D);
    CU_ASSERT_EQUAL(s->eps, 1e-5f);
    CU_ASSERT_EQUAL(s->momentum, 0.1f);
    CU_ASSERT_FALSE(s->no_affine);
    char *yaml = config_to_yaml(&c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(yaml);
    CU_ASSERT_PTR_NOT_NULL(strstr(yaml, "{name: bn, type: batchnorm2d, eps: 1e-05, momentum: 0.1, affine: true}"));
    CU_ASSERT_PTR_NOT_NULL(strstr(yaml, "{name: globalavgpool2, type: globalavgpool}"));
    /* the resolved YAML loads back to the same layers */
    Config back;
    CU_ASSERT_EQUAL(config_load_string(&back, yaml, "resolved", NULL, 0, &e), QT_OK);
    CU_ASSERT_EQUAL(back.model.layers[1].momentum, 0.1f);
    free(yaml);
    CU_ASSERT_EQUAL_FATAL(load_bn(&c, ", eps: 0.001, momentum: 0.01, affine: false", &e), QT_OK);
    CU_ASSERT_EQUAL(c.model.layers[1].momentum, 0.01f);
    CU_ASSERT_EQUAL(c.model.layers[1].eps, 0.001f);
    CU_ASSERT(c.model.layers[1].no_affine);
    yaml = config_to_yaml(&c);
    CU_ASSERT_PTR_NOT_NULL(yaml && strstr(yaml, "momentum: 0.01, affine: false}"));
    free(yaml);

    /* bad keys: each an error at its line and column (line 5 is the batch norm) */
    expect_bn_error(__LINE__, ", momentum: 1.5", "t.yaml:5:");
    expect_bn_error(__LINE__, ", momentum: 1.5", "model.layers[1].momentum");
    expect_bn_error(__LINE__, ", eps: 0", "model.layers[1].eps");
    expect_bn_error(__LINE__, ", affine: maybe", "model.layers[1].affine");
    expect_bn_error(__LINE__, ", units: 3", "t.yaml:5:");
    expect_bn_error(__LINE__, ", bias: false", "model.layers[1]");
    /* momentum does not apply to a layernorm */
    Config d;
    CU_ASSERT_NOT_EQUAL(config_load_string(&d,
                                           "model:\n  input: [4]\n  layers:\n    - {type: layernorm, momentum: 0.1}\n"
                                           "    - {type: dense, units: 2}\n",
                                           NAME, NULL, 0, &e),
                        QT_OK);
    CU_ASSERT_PTR_NOT_NULL(strstr(e.msg, "t.yaml:4:"));
    /* a batchnorm2d on a vector is a shape error at the layer */
    qt_error_clear(&e);
    CU_ASSERT_NOT_EQUAL(config_load_string(&d,
                                           "model:\n  input: [4]\n  layers:\n    - {type: dense, units: 2}\n"
                                           "    - {type: batchnorm2d}\n",
                                           NAME, NULL, 0, &e),
                        QT_OK);
    CU_ASSERT_PTR_NOT_NULL(strstr(e.msg, "t.yaml:5:"));
    CU_ASSERT_PTR_NOT_NULL(strstr(e.msg, "needs (C, H, W)"));
}

/* ---- end to end ---------------------------------------------------------------------- */

static char *tmp_root;

static int graph_suite_init(void) {
    tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int graph_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

static Config *load_run_config(const char *path, const char *sub) {
    char out_dir[512];
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/%s", tmp_root, sub);
    const char *ov[] = {out_dir};
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    if (c && config_load(c, path, ov, 1, &err) != QT_OK) {
        fprintf(stderr, "\n  config %s: %s\n", path, err.msg);
        free(c);
        return NULL;
    }
    return c;
}

/* conv2d (no bias) -> batchnorm2d -> relu -> globalavgpool -> dense learns; a
 * checkpoint of it cannot be loaded back while the format lacks the running
 * statistics (no resume or eval with statistics that never saw the data). */
static void test_bn_cnn_trains(void) {
    Config *c = load_run_config("tests/configs/tiny-bn.yaml", "bn");
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    TrainResult r;
    TrainOptions o = {.quiet = true, .stop_at_step = 25};
    CU_ASSERT_EQUAL_FATAL(train_run(c, &o, &r, &err), QT_OK);
    CU_ASSERT(r.stopped);
    TrainOptions again = {.quiet = true, .resume = "auto"};
    QtStatus st = train_run(c, &again, &r, &err);
    CU_ASSERT_NOT_EQUAL(st, QT_OK);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "module 'bn1' (batchnorm2d) keeps running statistics"));
    free(c);

    c = load_run_config("tests/configs/tiny-bn.yaml", "bn-full");
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    qt_error_clear(&err);
    TrainOptions full = {.quiet = true};
    CU_ASSERT_EQUAL_FATAL(train_run(c, &full, &r, &err), QT_OK);
    printf("(test accuracy %.3f) ", r.test_accuracy);
    CU_ASSERT(r.test_accuracy > 0.25); /* 40 steps: well above chance (0.1) */
    CU_ASSERT(isfinite(r.test_loss));
    char path[1100];
    snprintf(path, sizeof path, "%s/final.h5", c->run.out_dir);
    TrainResult ev;
    CU_ASSERT_NOT_EQUAL(train_eval_checkpoint(c, path, false, &ev, &err), QT_OK);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "running statistics"));
    free(c);
}

int register_model_graph_suite(void) {
    CU_pSuite s = CU_add_suite("model_graph", graph_suite_init, graph_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "batchnorm/globalavgpool modules: params, buffers, shapes", test_bn_module_state) ||
           !CU_add_test(s, "batchnorm: batch statistics in training, running ones in eval", test_bn_train_and_eval) ||
           !CU_add_test(s, "batchnorm/globalavgpool on wrong shapes are errors", test_bn_shape_errors) ||
           !CU_add_test(s, "batchnorm config keys, defaults, resolved YAML, errors at their line", test_bn_config) ||
           !CU_add_test(s, "a batch-norm CNN trains end to end; its checkpoints are not loaded", test_bn_cnn_trains);
}
