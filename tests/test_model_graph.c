/* test_model_graph.c - the layers of small real models reached from a
 * config: batchnorm1d/2d with the running statistics their modules own,
 * globalavgpool; the model as a DAG (inputs, add, concat); their config keys
 * and errors; batch-norm and residual CNNs trained end to end on the mini
 * data set. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nn/model.h"
#include "nn/ops.h"
#include "test_runs.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/train.h"

static char *tmp_root; /* the suite's scratch directory */
static TestRuns runs;  /* its runs: root = tmp_root, no float base */

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

/* A PyTorch state_dict of BatchNorm1d(3) + Linear(3, 2) after three training
 * steps, written with h5py in the checkpoint layout, loads as
 * model.init_from does: parameters and running statistics bit for bit. */
#define PYTHON "/usr/bin/python3"
static const char TORCH_BN_SCRIPT[] =
    "import sys, h5py, torch\n"
    "torch.manual_seed(0)\n"
    "m = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2)).train()\n"
    "for _ in range(3): m(torch.randn(8, 3) * 2 + 1)\n"
    "names = {'0': 'bn', '1': 'head'}\n"
    "with h5py.File(sys.argv[1], 'w') as f, open(sys.argv[2], 'w') as out:\n"
    "    f.attrs['format'] = 'qtrain'\n"
    "    f.attrs['version'] = 1\n"
    "    for k, v in m.state_dict().items():\n"
    "        mod, t = k.split('.')\n"
    "        g = 'buffers' if t in ('running_mean', 'running_var', 'num_batches_tracked') else 'params'\n"
    "        f[g + '/' + names[mod] + '/' + t] = v.numpy()\n"
    "        if g == 'buffers': out.write(' '.join(float(x).hex() for x in v.reshape(-1).tolist()) + '\\n')\n";

static void test_bn_torch_state_dict(void) {
    if (access(PYTHON, X_OK) != 0) {
        test_skip(PYTHON " is missing (Debian's python3 with python3-torch and python3-h5py)");
        return;
    }
    char script[1100], h5[1100], expect[1100], cmd[4096];
    snprintf(script, sizeof script, "%s/torch_bn.py", tmp_root);
    snprintf(h5, sizeof h5, "%s/torch_bn.h5", tmp_root);
    snprintf(expect, sizeof expect, "%s/torch_bn.txt", tmp_root);
    FILE *f = fopen(script, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fputs(TORCH_BN_SCRIPT, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, PYTHON " -c 'import torch, h5py' >/dev/null 2>&1");
    fflush(NULL);
    if (system(cmd) != 0) {
        test_skip(PYTHON " cannot import torch and h5py (install python3-torch python3-h5py)");
        return;
    }
    snprintf(cmd, sizeof cmd, PYTHON " %s %s %s", script, h5, expect);
    CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
    LayerSpec layers[] = {bn_layer(LAYER_BATCHNORM1D, "bn"), {.type = LAYER_DENSE, .name = "head", .units = 2}};
    Model m;
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){3}, layers, 2, NULL), QT_OK);
    QtError err = {0};
    CU_ASSERT_EQUAL(checkpoint_load_params(h5, &m, &err), QT_OK);
    if (err.status) fprintf(stderr, "\n  %s\n", err.msg);
    char *text = test_file_read(expect, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    char *p = text, *end;
    const Module *bn = &m.modules[0];
    for (int k = 0; k < 3; k++, p = end) CU_ASSERT_EQUAL((float)strtod(p, &end), bn->running_mean[k]);
    for (int k = 0; k < 3; k++, p = end) CU_ASSERT_EQUAL((float)strtod(p, &end), bn->running_var[k]);
    CU_ASSERT_EQUAL((int64_t)strtod(p, &end), bn->num_batches_tracked);
    CU_ASSERT_EQUAL(bn->num_batches_tracked, 3);
    CU_ASSERT(bn->running_mean[0] != 0.0f);
    free(text);
    model_free(&m);
}

/* ---- the DAG ------------------------------------------------------------------------ */

static LayerSpec named(LayerType type, const char *name, const char *in0, const char *in1) {
    LayerSpec s = {.type = type};
    snprintf(s.name, sizeof s.name, "%s", name);
    if (in0) snprintf(s.inputs[s.n_inputs++], MODULE_NAME_MAX, "%s", in0);
    if (in1) snprintf(s.inputs[s.n_inputs++], MODULE_NAME_MAX, "%s", in1);
    return s;
}

/* A DAG where fusion must hold back: r (conv c's relu) is read by the pool
 * after it and by another layer, so only c + r fuse; c2 is read by r2 and by
 * an add, so c2 does not fuse at all. Its output equals the ops run by hand. */
static void test_dag_forward(void) {
    LayerSpec layers[] = {
        {.type = LAYER_CONV2D, .name = "c", .out_channels = 2, .kernel = 3, .stride = 1, .padding = 1},
        named(LAYER_RELU, "r", NULL, NULL),
        {.type = LAYER_MAXPOOL2D, .name = "p", .kernel = 2, .stride = 2},
        {.type = LAYER_AVGPOOL2D, .name = "a", .kernel = 2, .stride = 2, .n_inputs = 1, .inputs = {"r"}},
        named(LAYER_ADD, "s", "p", "a"),
        {.type = LAYER_CONV2D, .name = "c2", .out_channels = 2, .kernel = 3, .stride = 1, .padding = 1},
        named(LAYER_RELU, "r2", NULL, NULL),
        named(LAYER_ADD, "s2", "r2", "c2"),
        named(LAYER_CONCAT, "cat", "s2", "p"),
        {.type = LAYER_FLATTEN, .name = "f"},
        {.type = LAYER_DENSE, .name = "head", .units = 3},
    };
    enum { NL = sizeof layers / sizeof layers[0], N = 2 };
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){1, 6, 6}, layers, NL, &err), QT_OK);
    Rng r;
    rng_init(&r, 5, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    CU_ASSERT_EQUAL(m.modules[1].n_consumers, 2);  /* r: p and a */
    CU_ASSERT_EQUAL(m.modules[5].n_consumers, 2);  /* c2: r2 and s2 */
    CU_ASSERT_EQUAL(m.modules[8].out_shape[0], 4); /* cat: 2 + 2 channels */
    CU_ASSERT_EQUAL(m.modules[NL - 1].n_consumers, 1);
    float x[N * 36];
    rng_fill_normal(&r, x, N * 36, 0, 1);
    TestEnv e;
    test_env_init(&e, 1);
    Tape *t = &e.tape;
    Var *vx = test_var(&e, x, 4, (int[]){N, 1, 6, 6}, false);
    Var *y = model_forward(&m, t, vx);
    if (!y) fprintf(stderr, "\n  %s\n", t->err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    Var *w[4] = {&m.modules[0].weight->var, &m.modules[0].bias->var, &m.modules[5].weight->var,
                 &m.modules[5].bias->var};
    Var *rr = nn_relu(t, nn_conv2d(t, vx, w[0], w[1], 1, 1));
    Var *pp = nn_maxpool2d(t, rr, 2, 2), *ss = nn_add(t, pp, nn_avgpool2d(t, rr, 2, 2));
    Var *c2 = nn_conv2d(t, ss, w[2], w[3], 1, 1);
    Var *cat = nn_concat(t, (Var *[]){nn_add(t, nn_relu(t, c2), c2), pp}, 2);
    Var *ref = nn_linear(t, nn_flatten(t, cat), &m.modules[NL - 1].weight->var, &m.modules[NL - 1].bias->var);
    CU_ASSERT_PTR_NOT_NULL_FATAL(ref);
    for (int i = 0; i < N * 3; i++) CU_ASSERT_DOUBLE_EQUAL(y->value.data[i], ref->value.data[i], 1e-5);
    /* module by module (as the non-finite guard re-runs it) gives the same */
    tape_reset(t);
    m.outs[0] = test_var(&e, x, 4, (int[]){N, 1, 6, 6}, false);
    Var *last = NULL;
    for (int i = 0; i < NL; i++) last = model_step(&m, t, i, m.outs);
    CU_ASSERT_PTR_NOT_NULL_FATAL(last);
    for (int i = 0; i < N * 3; i++) CU_ASSERT_DOUBLE_EQUAL(last->value.data[i], ref->value.data[i], 1e-5);
    /* model_print names what a module reads where it is not the previous one */
    char buf[4096] = "";
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    model_print(&m, f);
    fclose(f);
    CU_ASSERT_PTR_NOT_NULL(strstr(buf, "<- p, a\n"));
    CU_ASSERT_PTR_NOT_NULL(strstr(buf, "<- r\n"));
    test_env_free(&e);
    model_free(&m);
}

/* Finite differences of the loss through a residual block with batch norm
 * (training mode: batch statistics) against the tape's gradients. */
static void test_residual_block_grad(void) {
    LayerSpec layers[] = {
        {.type = LAYER_CONV2D, .name = "c1", .out_channels = 3, .kernel = 3, .stride = 1, .padding = 1,
         .no_bias = true},
        bn_layer(LAYER_BATCHNORM2D, "b1"),
        named(LAYER_RELU, "r1", NULL, NULL),
        {.type = LAYER_CONV2D, .name = "c2", .out_channels = 2, .kernel = 3, .stride = 1, .padding = 1,
         .no_bias = true},
        bn_layer(LAYER_BATCHNORM2D, "b2"),
        named(LAYER_ADD, "sum", "b2", "input"),
        named(LAYER_RELU, "r2", NULL, NULL),
        {.type = LAYER_GLOBALAVGPOOL, .name = "gap"},
        {.type = LAYER_DENSE, .name = "head", .units = 3},
    };
    enum { NL = sizeof layers / sizeof layers[0], N = 3, NX = N * 2 * 4 * 4 };
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){2, 4, 4}, layers, NL, &err), QT_OK);
    Rng r;
    rng_init(&r, 9, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    for (int i = 0; i < m.n_params; i++) /* BN weights and biases away from 1 and 0 */
        if (m.params[i].var.value.ndim == 1)
            for (size_t j = 0; j < var_numel(&m.params[i].var); j++)
                m.params[i].var.value.data[j] += 0.3f * (float)((int)j % 3) - 0.2f;
    float x[NX];
    rng_fill_normal(&r, x, NX, 0, 1);
    int32_t labels[N] = {0, 2, 1};
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.training = true;
    Var *vx = test_var(&e, x, 4, (int[]){N, 2, 4, 4}, false);
    Var *loss = nn_softmax_cross_entropy(&e.tape, model_forward(&m, &e.tape, vx), labels);
    CU_ASSERT_PTR_NOT_NULL_FATAL(loss);
    CU_ASSERT_EQUAL_FATAL(tape_backward(&e.tape, loss), QT_OK);
    int checked = 0, bad = 0;
    for (int i = 0; i < m.n_params; i++) {
        Var *p = &m.params[i].var;
        for (size_t j = 0; j < var_numel(p); j += 5) {
            float p0 = p->value.data[j];
            double l[2];
            for (int sgn = 0; sgn < 2; sgn++) {
                p->value.data[j] = p0 + (sgn ? -1e-3f : 1e-3f);
                tape_reset(&e.tape);
                e.tape.grad_enabled = false;
                Var *vx2 = test_var(&e, x, 4, (int[]){N, 2, 4, 4}, false);
                l[sgn] = nn_softmax_cross_entropy(&e.tape, model_forward(&m, &e.tape, vx2), labels)->value.data[0];
            }
            p->value.data[j] = p0;
            double fd = (l[0] - l[1]) / 2e-3, an = p->grad[j];
            if (fabs(fd - an) > 2e-3 + 2e-2 * fabs(fd)) {
                fprintf(stderr, "\n  %s[%zu]: analytic %g, numeric %g", m.params[i].name, j, an, fd);
                bad++;
            }
            checked++;
        }
    }
    CU_ASSERT(checked > 20);
    CU_ASSERT_EQUAL(bad, 0);
    test_env_free(&e);
    model_free(&m);
}

#define DAG_HEAD                   \
    "model:\n"                     \
    "  input: [2, 4, 4]\n"         \
    "  layers:\n"                  \
    "    - {name: a, type: conv2d, out_channels: 2, kernel: 3, padding: 1}\n" \
    "    - {name: b, type: conv2d, out_channels: 3, kernel: 3, padding: 1}\n" \
    "    - {name: p, type: maxpool2d, kernel: 2}\n"

static void expect_dag_error(int line, const char *tail, const char *n1, const char *n2, const char *n3) {
    char text[1024];
    snprintf(text, sizeof text, DAG_HEAD "%s    - {type: flatten}\n    - {type: dense, units: 3}\n", tail);
    test_expect_config_error(__FILE__, line, text, n1, n2, n3);
}

static void test_dag_config(void) {
    /* a valid DAG: its resolved YAML names the inputs, and loads back */
    Config c;
    QtError e = {0};
    const char *ok = DAG_HEAD "    - {name: s, type: add, inputs: [a, input]}\n"
                              "    - {name: j, type: concat, inputs: [s, b]}\n"
                              "    - {type: flatten}\n    - {type: dense, units: 3}\n";
    CU_ASSERT_EQUAL_FATAL(config_load_string(&c, ok, NAME, NULL, 0, &e), QT_OK);
    CU_ASSERT_EQUAL(c.model.layers[3].n_inputs, 2);
    CU_ASSERT_STRING_EQUAL(c.model.layers[3].inputs[1], "input");
    char *yaml = config_to_yaml(&c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(yaml);
    CU_ASSERT_PTR_NOT_NULL(strstr(yaml, "{name: s, type: add, inputs: [a, input]}"));
    CU_ASSERT_PTR_NOT_NULL(strstr(yaml, "{name: j, type: concat, inputs: [s, b]}"));
    CU_ASSERT_PTR_NULL(strstr(yaml, "{name: a, type: conv2d, inputs")); /* inputs only where given */
    Config back;
    CU_ASSERT_EQUAL(config_load_string(&back, yaml, "resolved", NULL, 0, &e), QT_OK);
    char *again = config_to_yaml(&back);
    CU_ASSERT(again && strcmp(again, yaml) == 0);
    free(again);
    free(yaml);
    /* a config without inputs resolves as it always did: no inputs key anywhere */
    Config cnn;
    CU_ASSERT_EQUAL_FATAL(config_load(&cnn, "tests/configs/tiny-cnn.yaml", NULL, 0, &e), QT_OK);
    yaml = config_to_yaml(&cnn);
    CU_ASSERT(yaml && !strstr(yaml, "inputs"));
    free(yaml);

    /* each bad input: an error at the layer's line (7), naming what is wrong */
    expect_dag_error(__LINE__, "    - {name: s, type: add, inputs: [a, nope]}\n", "t.yaml:7:", "'nope'",
                     "no earlier layer");
    expect_dag_error(__LINE__, "    - {name: s, type: add, inputs: [a, later]}\n    - {name: later, type: relu}\n",
                     "t.yaml:7:", "'later', which comes later", NULL);
    expect_dag_error(__LINE__, "    - {name: s, type: add, inputs: [a, t]}\n    - {name: t, type: relu, inputs: [s]}\n",
                     "t.yaml:7:", "comes later", "cycles");
    expect_dag_error(__LINE__, "    - {name: s, type: add, inputs: [a, b]}\n", "t.yaml:7:",
                     "its inputs 'a' (2, 4, 4) and 'b' (3, 4, 4) differ in shape", NULL);
    expect_dag_error(__LINE__, "    - {name: s, type: concat, inputs: [a, p]}\n", "t.yaml:7:",
                     "its inputs 'a' (2, 4, 4) and 'p' (3, 2, 2) differ in more than the channel axis", NULL);
    expect_dag_error(__LINE__, "    - {name: s, type: add, inputs: [s]}\n", "t.yaml:7:", "two or more inputs", NULL);
    expect_dag_error(__LINE__, "    - {name: s, type: add}\n", "t.yaml:7:", "two or more inputs", NULL);
    expect_dag_error(__LINE__, "    - {name: s, type: relu, inputs: [a, b]}\n", "t.yaml:7:", "reads one input", NULL);
    expect_dag_error(__LINE__, "    - {name: s, type: relu, inputs: a}\n", "t.yaml:7:", "model.layers[3].inputs",
                     NULL);
    expect_dag_error(__LINE__, "    - {name: s, type: relu, inputs: [s]}\n", "t.yaml:7:", "names itself", NULL);
}

/* ---- end to end ---------------------------------------------------------------------- */


static int graph_suite_init(void) {
    runs.root = tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int graph_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    runs.root = tmp_root = NULL;
    return ok ? 0 : -1;
}

/* conv2d (no bias) -> batchnorm2d -> relu -> globalavgpool -> dense learns;
 * eval of its final checkpoint (running statistics from /buffers) gives the
 * run's test metrics. */
static void test_bn_cnn_trains(void) {
    Config *c = test_runs_config(&runs, "tests/configs/tiny-bn.yaml", "bn-full", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    TrainResult r;
    TrainOptions full = {.quiet = true};
    CU_ASSERT_EQUAL_FATAL(train_run(c, &full, &r, &err), QT_OK);
    printf("(test accuracy %.3f) ", r.test_accuracy);
    CU_ASSERT(r.test_accuracy > 0.25); /* 40 steps: well above chance (0.1) */
    char path[1100];
    snprintf(path, sizeof path, "%s/final.h5", c->run.out_dir);
    TrainResult ev;
    CU_ASSERT_EQUAL(train_eval_checkpoint(c, path, false, &ev, &err), QT_OK);
    CU_ASSERT_EQUAL(ev.test_accuracy, r.test_accuracy);
    CU_ASSERT_EQUAL(ev.test_loss, r.test_loss);
    free(c);
}

/* The residual CNN with batch norm and dropout: 40 steps straight equal 13
 * (mid-epoch: 22 steps an epoch), stop, resume, 27, bit for bit. */
static void test_res_cnn_resume_exact(void) {
    int n_bn = 0;
    double acc = test_runs_resume_exact(&runs, "tests/configs/tiny-res.yaml", "res", 13, &n_bn);
    printf("(test accuracy %.3f) ", acc);
    CU_ASSERT(acc > 0.2); /* 40 steps: well above chance (0.1) */
    CU_ASSERT_EQUAL(n_bn, 3);
}

/* Saves m to tmp_root/name; returns the path. */
static const char *save_to(Model *m, const char *name) {
    static char path[1100];
    snprintf(path, sizeof path, "%s/%s", tmp_root, name);
    QtError err = {0};
    CU_ASSERT_EQUAL(checkpoint_save(path, m, NULL, NULL, &err), QT_OK);
    return path;
}

static void expect_load_error(const char *path, const char *n1, const char *n2) {
    Model m;
    LayerSpec layers[] = {bn_layer(LAYER_BATCHNORM1D, "bn"), {.type = LAYER_DENSE, .name = "head", .units = 2}};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){3}, layers, 2, NULL), QT_OK);
    QtError err = {0};
    CU_ASSERT_EQUAL(checkpoint_load_params(path, &m, &err), QT_ERR_FORMAT);
    bool ok = strstr(err.msg, n1) && strstr(err.msg, n2);
    if (!ok) fprintf(stderr, "\n  want '%s' and '%s' in: %s\n", n1, n2, err.msg);
    CU_ASSERT(ok);
    CU_ASSERT_EQUAL(m.modules[0].running_var[0], 1.0f); /* nothing applied */
    model_free(&m);
}

/* /buffers round trip, and the checkpoints that are refused: none for a
 * batch-norm module, a negative or non-finite statistic. */
static void test_bn_buffers_in_checkpoints(void) {
    LayerSpec layers[] = {bn_layer(LAYER_BATCHNORM1D, "bn"), {.type = LAYER_DENSE, .name = "head", .units = 2}};
    Model m, back;
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){3}, layers, 2, NULL), QT_OK);
    CU_ASSERT_EQUAL_FATAL(model_init(&back, 1, (int[]){3}, layers, 2, NULL), QT_OK);
    Module *bn = &m.modules[0];
    const float mean[3] = {0.25f, -1.5f, 3.0f}, var[3] = {0.5f, 2.0f, 1e-3f};
    memcpy(bn->running_mean, mean, sizeof mean);
    memcpy(bn->running_var, var, sizeof var);
    bn->num_batches_tracked = 12345678901LL;
    const char *path = save_to(&m, "bn-good.h5");
    QtError err = {0};
    CU_ASSERT_EQUAL(checkpoint_load_params(path, &back, &err), QT_OK);
    CU_ASSERT(memcmp(back.modules[0].running_mean, mean, sizeof mean) == 0);
    CU_ASSERT(memcmp(back.modules[0].running_var, var, sizeof var) == 0);
    CU_ASSERT_EQUAL(back.modules[0].num_batches_tracked, 12345678901LL);
    model_free(&back);

    bn->running_var[1] = -0.5f;
    expect_load_error(save_to(&m, "bn-negvar.h5"), "/buffers/bn/running_var holds -0.5 at index 1", "never negative");
    bn->running_var[1] = INFINITY;
    expect_load_error(save_to(&m, "bn-infvar.h5"), "/buffers/bn/running_var holds inf", "damaged");
    bn->running_var[1] = 2.0f;
    bn->running_mean[2] = NAN;
    expect_load_error(save_to(&m, "bn-nanmean.h5"), "/buffers/bn/running_mean holds nan", "damaged");
    /* a model without batch norm writes no /buffers: loading its file into one with batch norm names the module */
    LayerSpec plain[] = {{.type = LAYER_DENSE, .name = "head", .units = 2}};
    Model p;
    CU_ASSERT_EQUAL_FATAL(model_init(&p, 1, (int[]){3}, plain, 1, NULL), QT_OK);
    path = save_to(&p, "no-bn.h5");
    model_free(&p);
    float *keep = bn->running_mean;
    bn->running_mean = NULL; /* saved as if the module had no statistics */
    const char *stripped = save_to(&m, "bn-stripped.h5");
    bn->running_mean = keep;
    expect_load_error(stripped, "no dataset /buffers/bn/running_mean", "module 'bn' (batchnorm1d) needs its running");
    model_free(&m);
}

int register_model_graph_suite(void) {
    CU_pSuite s = CU_add_suite("model_graph", graph_suite_init, graph_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "batchnorm/globalavgpool modules: params, buffers, shapes", test_bn_module_state) ||
           !CU_add_test(s, "batchnorm: batch statistics in training, running ones in eval", test_bn_train_and_eval) ||
           !CU_add_test(s, "batchnorm/globalavgpool on wrong shapes are errors", test_bn_shape_errors) ||
           !CU_add_test(s, "batchnorm config keys, defaults, resolved YAML, errors at their line", test_bn_config) ||
           !CU_add_test(s, "a batch-norm CNN trains end to end; eval of its checkpoint agrees", test_bn_cnn_trains) ||
           !CU_add_test(s, "/buffers: statistics round trip; missing, negative, non-finite refused",
                        test_bn_buffers_in_checkpoints) ||
           !CU_add_test(s, "/buffers: a PyTorch state_dict written with h5py loads", test_bn_torch_state_dict) ||
           !CU_add_test(s, "DAG: merges, outputs kept, fusion only without other consumers", test_dag_forward) ||
           !CU_add_test(s, "DAG: residual block with batch norm, finite differences", test_residual_block_grad) ||
           !CU_add_test(s, "DAG: inputs in the config, resolved YAML, errors at the layer", test_dag_config) ||
           !CU_add_test(s, "residual CNN with batch norm, dropout: resume is bit-identical", test_res_cnn_resume_exact);
}
