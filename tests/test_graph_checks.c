/* test_graph_checks.c - a whole residual block as the config describes it (conv-bn-relu-conv-bn plus a strided
 * 1x1 shortcut conv, add, relu), built from its config, against central differences for every parameter and
 * input element; and an adapter on a depthwise conv written in the config refused at its rule's line. (The
 * other bad inputs of a model graph, each a config error at the layer's line, are in test_model_graph.c's
 * test_dag_config and test_conv_geom.c's test_geom_errors.) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/net.h"

/* As gradcheck (test_util.h): float32 outputs of O(1) summed in double, eps 1e-3 (the step actually taken in
 * float), so rounding contributes < 1e-3 to a numeric derivative and real bugs O(1). */
#define EPS 1e-3
#define ATOL 2e-3
#define RTOL 1e-2
/* A ReLU input within this of 0 could cross the kink under a step of EPS: such draws are rejected. */
#define KINK_GAP 0.02f

static const char BLOCK_YAML[] =
    "model:\n"
    "  input: [2, 6, 5]\n"
    "  layers:\n"
    "    - {name: conv1, type: conv2d, out_channels: 3, kernel: 3, stride: 2, padding: 1, bias: false}\n"
    "    - {name: bn1, type: batchnorm2d}\n"
    "    - {name: relu1, type: relu}\n"
    "    - {name: conv2, type: conv2d, out_channels: 3, kernel: 3, padding: 1, bias: false}\n"
    "    - {name: bn2, type: batchnorm2d}\n"
    "    - {name: short, type: conv2d, out_channels: 3, kernel: 1, stride: 2, inputs: [input]}\n"
    "    - {name: sum, type: add, inputs: [bn2, short]}\n"
    "    - {name: out, type: relu}\n";

enum { N = 3, XC = 2, XH = 6, XW = 5, NX = N * XC * XH * XW, OUT = N * 3 * 3 * 3 };
static const int X_SHAPE[4] = {N, XC, XH, XW};

static bool block_model(Model *m) {
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    QtStatus st = c ? config_load_string(c, BLOCK_YAML, "block.yaml", NULL, 0, &err) : QT_ERR_NOMEM;
    if (st == QT_OK)
        st = model_init(m, c->model.input_ndim, c->model.input_shape, c->model.layers, c->model.n_layers, &err);
    free(c);
    if (st != QT_OK) fprintf(stderr, "\n  block.yaml: %s\n", err.msg);
    m->keep_outputs = st == QT_OK; /* block_loss reads the relus' inputs after the pass */
    return st == QT_OK;
}

/* L = sum(out * proj) in double after a train-mode forward of x on a fresh tape; with_grad: also the backward,
 * leaving the input's gradient in *xgrad (numel NX) and the params' in their grads. */
static double block_loss(Model *m, TestEnv *e, const float *x, const float *proj, bool with_grad, float *xgrad,
                         float *min_relu_in) {
    tape_reset(&e->tape);
    e->tape.training = true;
    e->tape.grad_enabled = with_grad;
    Var *vx = test_var(e, x, 4, X_SHAPE, with_grad);
    Var *out = model_forward(m, &e->tape, vx);
    if (!out) {
        fprintf(stderr, "\n  forward failed: %s\n", e->tape.err.msg);
        return NAN;
    }
    CU_ASSERT_FATAL(var_numel(out) == OUT);
    double l = 0;
    for (int i = 0; i < OUT; i++) l += (double)out->value.data[i] * proj[i];
    if (min_relu_in) { /* the inputs of relu1 (bn1's output) and out (sum's) */
        *min_relu_in = INFINITY;
        for (int i = 0; i < m->n_modules; i++) {
            if (m->modules[i].spec.type != LAYER_RELU) continue;
            const Var *in = m->outs[1 + m->modules[i].inputs[0]];
            for (size_t j = 0; j < var_numel(in); j++) *min_relu_in = fminf(*min_relu_in, fabsf(in->value.data[j]));
        }
    }
    if (with_grad) {
        for (int i = 0; i < m->n_params; i++)
            memset(m->params[i].var.grad, 0, var_numel(&m->params[i].var) * sizeof(float));
        if (tape_backward_from(&e->tape, out, proj) != QT_OK) {
            fprintf(stderr, "\n  backward failed: %s\n", e->tape.err.msg);
            return NAN;
        }
        memcpy(xgrad, vx->grad, NX * sizeof(float));
    }
    return l;
}

static double fd_worst; /* the worst ratio to the tolerance, shown with QT_TEST_SHOW_MSGS=1 */

/* Central difference of block_loss in *v[j] against the analytic gradient; false (printed) on a mismatch. */
static bool fd_one(Model *m, TestEnv *e, float *x, const float *proj, float *v, const char *what, size_t j,
                   double analytic) {
    float v0 = v[j];
    v[j] = (float)(v0 + EPS);
    double lp = block_loss(m, e, x, proj, false, NULL, NULL);
    v[j] = (float)(v0 - EPS);
    double lm = block_loss(m, e, x, proj, false, NULL, NULL);
    double h = (double)(float)(v0 + EPS) - (double)(float)(v0 - EPS);
    v[j] = v0;
    double num = (lp - lm) / h, ratio = fabs(num - analytic) / (ATOL + RTOL * fabs(num));
    if (ratio > fd_worst) fd_worst = ratio;
    if (ratio <= 1.0) return true;
    fprintf(stderr, "\n  residual block %s[%zu]: analytic %.7g numeric %.7g\n", what, j, analytic, num);
    return false;
}

/* Every element of every parameter (conv1, bn1, conv2, bn2, the shortcut's weight and bias) and of the input.
 * Parameters and input are drawn until both ReLUs' inputs stay KINK_GAP away from 0, where the numeric
 * derivative is meaningful; batch norms' weight and bias away from 1 and 0, so a dropped gamma or beta shows. */
static void test_residual_block_fd(void) {
    Model m;
    CU_ASSERT_FATAL(block_model(&m));
    CU_ASSERT_EQUAL_FATAL(m.n_params, 8);
    CU_ASSERT(m.modules[5].out_shape[1] == 3 && m.modules[5].out_shape[2] == 3); /* the shortcut strides: 3x3 */
    float x[NX], xgrad[NX], proj[OUT];
    Rng r;
    rng_init(&r, 99, 7);
    rng_fill_uniform(&r, proj, OUT, -1.0f, 1.0f);
    TestEnv e;
    test_env_init(&e, 1);
    bool drawn = false;
    fd_worst = 0;
    for (uint64_t seed = 1; seed < 300 && !drawn; seed++) {
        rng_init(&r, seed, RNG_STREAM_INIT);
        model_init_params(&m, &r);
        for (int i = 0; i < m.n_params; i++)
            if (m.params[i].var.value.ndim == 1 && strncmp(m.params[i].name, "bn", 2) == 0)
                rng_fill_uniform(&r, m.params[i].var.value.data, var_numel(&m.params[i].var),
                                 strstr(m.params[i].name, "weight") ? 0.5f : -0.5f,
                                 strstr(m.params[i].name, "weight") ? 1.5f : 0.5f);
        rng_fill_normal(&r, x, NX, 0.0f, 1.0f);
        float gap;
        CU_ASSERT_FATAL(isfinite(block_loss(&m, &e, x, proj, false, NULL, &gap)));
        drawn = gap > KINK_GAP;
    }
    CU_ASSERT_FATAL(drawn);
    CU_ASSERT_FATAL(isfinite(block_loss(&m, &e, x, proj, true, xgrad, NULL)));
    /* the analytic gradients, kept: each finite difference's forward overwrites nothing but values */
    float *analytic[8] = {0};
    for (int i = 0; i < m.n_params; i++) {
        size_t n = var_numel(&m.params[i].var);
        analytic[i] = malloc(n * sizeof(float));
        memcpy(analytic[i], m.params[i].var.grad, n * sizeof(float));
    }
    int checked = 0, bad = 0;
    for (int i = 0; i < m.n_params; i++)
        for (size_t j = 0; j < var_numel(&m.params[i].var); j++, checked++)
            bad += !fd_one(&m, &e, x, proj, m.params[i].var.value.data, m.params[i].name, j, analytic[i][j]);
    for (size_t j = 0; j < NX; j++, checked++) bad += !fd_one(&m, &e, x, proj, x, "input", j, xgrad[j]);
    CU_ASSERT_EQUAL(checked, 54 + 2 * 3 + 81 + 2 * 3 + 6 + 3 + NX); /* conv1, bn1, conv2, bn2, short, input */
    CU_ASSERT_EQUAL(bad, 0);
    if (getenv("QT_TEST_SHOW_MSGS"))
        fprintf(stderr, "\n  residual block: %d elements, worst ratio to the tolerance %.3g\n", checked, fd_worst);
    for (int i = 0; i < m.n_params; i++) free(analytic[i]);
    test_env_free(&e);
    model_free(&m);
}

/* lora.rules in the config file naming a depthwise conv: the error is at the rule's line, names the conv and
 * the pointwise conv to adapt instead. */
static void test_lora_on_depthwise_at_line(void) {
    static const char yaml[] =
        "model:\n"
        "  input: [2, 6, 6]\n"
        "  layers:\n"
        "    - {name: dw, type: conv2d, out_channels: 2, kernel: 3, padding: 1, groups: 2, bias: false}\n"
        "    - {name: bn, type: batchnorm2d}\n"
        "    - {type: relu}\n"
        "    - {name: pw, type: conv2d, out_channels: 4, kernel: 1}\n"
        "    - {type: globalavgpool}\n"
        "    - {name: head, type: dense, units: 3}\n"
        "lora:\n"
        "  rules:\n"
        "    - {module_path: pw, rank: 2}\n"
        "    - {module_path: dw, rank: 2}\n";
    Config *c = malloc(sizeof *c);
    CU_ASSERT_FATAL(c != NULL);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(config_load_string(c, yaml, "t.yaml", NULL, 0, &err), QT_OK);
    Net n;
    memset(&n, 0, sizeof n);
    QtStatus st = net_build(&n, c, NET_FRESH, &err);
    CU_ASSERT_EQUAL(st, QT_ERR_CONFIG);
    if (st == QT_OK) net_free(&n);
    bool ok = strstr(err.msg, "t.yaml:13:") && strstr(err.msg, "lora.rules[1]") && strstr(err.msg, "dw") &&
              strstr(err.msg, "depthwise") && strstr(err.msg, "pointwise") && strstr(err.msg, "'pw'");
    if (!ok) fprintf(stderr, "\n  message: %s\n", err.msg);
    CU_ASSERT(ok);
    free(c);
}

int register_graph_checks_suite(void) {
    CU_pSuite s = CU_add_suite("graph_checks", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "residual block with a strided shortcut conv: every gradient by finite differences",
                        test_residual_block_fd) ||
           !CU_add_test(s, "an adapter on a depthwise conv: a config error at the rule's line",
                        test_lora_on_depthwise_at_line);
}
