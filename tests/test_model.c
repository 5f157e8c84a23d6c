/* test_model.c - layers and the sequential model: gradients of inputs and
 * parameters, initialisation, learning, steady-state allocation, freezing,
 * and errors for models whose layers do not chain. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "nn/ops.h"
#include "nn/optim.h"
#include "test_util.h"

static LayerSpec dense(const char *name, int units) {
    LayerSpec s = {.type = LAYER_DENSE, .units = units};
    snprintf(s.name, sizeof s.name, "%s", name);
    return s;
}
static LayerSpec conv(const char *name, int oc, int k, int stride, int pad) {
    LayerSpec s = {.type = LAYER_CONV2D, .out_channels = oc, .kernel = k, .stride = stride, .padding = pad};
    snprintf(s.name, sizeof s.name, "%s", name);
    return s;
}
static LayerSpec layer(LayerType type) { return (LayerSpec){.type = type}; }

/* Loss of the model on a batch; grads into params and x if requested. */
static double model_loss(Model *m, TestEnv *e, const float *x, const int *xshape, int xndim, const int32_t *labels,
                         bool backward, float *dx) {
    tape_reset(&e->tape);
    e->tape.grad_enabled = backward;
    Var *vx = test_var(e, x, xndim, xshape, dx != NULL);
    Var *loss = nn_softmax_cross_entropy(&e->tape, model_forward(m, &e->tape, vx), labels);
    if (!loss) {
        fprintf(stderr, "\n  model_loss: %s\n", e->tape.err.msg);
        return NAN;
    }
    if (backward) {
        CU_ASSERT_EQUAL(tape_backward(&e->tape, loss), QT_OK);
        if (dx) memcpy(dx, vx->grad, var_numel(vx) * sizeof(float));
    }
    return loss->value.data[0];
}

/* Central differences of the loss w.r.t. (a sample of) every parameter and
 * every input element. Tolerances as in gradcheck() (test_util.h). */
static void check_model_grads(Model *m, const float *x, const int *xshape, int xndim, const int32_t *labels) {
    TestEnv e;
    test_env_init(&e, 3);
    size_t nx = 1;
    for (int i = 0; i < xndim; i++) nx *= (size_t)xshape[i];
    float *dx = malloc(nx * sizeof(float)), *xp = malloc(nx * sizeof(float));
    memcpy(xp, x, nx * sizeof(float));
    for (int i = 0; i < m->n_params; i++) memset(m->params[i].var.grad, 0, var_numel(&m->params[i].var) * 4);
    model_loss(m, &e, x, xshape, xndim, labels, true, dx);
    const double eps = 1e-3, atol = 1e-3, rtol = 1e-2;
    for (int i = 0; i < m->n_params; i++) {
        Var *p = &m->params[i].var;
        size_t n = var_numel(p), stride = n > 40 ? n / 40 : 1; /* ~40 elements per parameter */
        for (size_t j = 0; j < n; j += stride) {
            float p0 = p->value.data[j];
            p->value.data[j] = p0 + (float)eps;
            double fp = model_loss(m, &e, x, xshape, xndim, labels, false, NULL);
            p->value.data[j] = p0 - (float)eps;
            double fm = model_loss(m, &e, x, xshape, xndim, labels, false, NULL);
            p->value.data[j] = p0;
            double num = (fp - fm) / (2 * eps);
            if (fabs(num - p->grad[j]) > atol + rtol * fabs(num))
                fprintf(stderr, "\n  %s[%zu]: analytic %.6g numeric %.6g\n", m->params[i].name, j, p->grad[j], num);
            CU_ASSERT(fabs(num - p->grad[j]) <= atol + rtol * fabs(num));
        }
    }
    for (size_t j = 0; j < nx; j += nx > 60 ? nx / 60 : 1) {
        float x0 = xp[j];
        xp[j] = x0 + (float)eps;
        double fp = model_loss(m, &e, xp, xshape, xndim, labels, false, NULL);
        xp[j] = x0 - (float)eps;
        double fm = model_loss(m, &e, xp, xshape, xndim, labels, false, NULL);
        xp[j] = x0;
        double num = (fp - fm) / (2 * eps);
        CU_ASSERT(fabs(num - dx[j]) <= atol + rtol * fabs(num));
    }
    free(dx);
    free(xp);
    test_env_free(&e);
}

static void test_dense_layers_grad(void) {
    /* tanh/gelu/sigmoid: smooth everywhere, so no kink can spoil the check. */
    LayerSpec layers[] = {dense("fc1", 9), layer(LAYER_TANH), dense("fc2", 7), layer(LAYER_GELU),
                          layer(LAYER_LAYERNORM), dense("head", 4)};
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){6}, layers, 6, &err), QT_OK);
    Rng r;
    rng_init(&r, 1, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    float x[5 * 6];
    rng_fill_normal(&r, x, 30, 0, 1);
    check_model_grads(&m, x, (int[]){5, 6}, 2, (int32_t[]){0, 3, 1, 2, 3});
    model_free(&m);
}

static void test_conv_layers_grad(void) {
    LayerSpec layers[] = {conv("conv1", 3, 3, 1, 1), layer(LAYER_SIGMOID), layer(LAYER_AVGPOOL2D),
                          conv("conv2", 4, 2, 2, 0), layer(LAYER_TANH), layer(LAYER_FLATTEN), dense("head", 3)};
    layers[2].kernel = 2;
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){2, 9, 9}, layers, 7, &err), QT_OK);
    /* 9x9 -> conv p1 -> 9x9 -> avgpool 2 -> 4x4 -> conv k2 s2 -> 2x2 -> 16 -> 3 */
    CU_ASSERT_EQUAL(m.modules[5].out_shape[0], 16);
    Rng r;
    rng_init(&r, 2, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    float x[2 * 2 * 9 * 9];
    rng_fill_normal(&r, x, 324, 0, 1);
    check_model_grads(&m, x, (int[]){2, 2, 9, 9}, 4, (int32_t[]){2, 0});
    model_free(&m);
}

/* Init distributions: PyTorch's default gives U(+-1/sqrt(fan_in)) for
 * weights and biases; xavier and normal have the stated spreads. */
static void test_init_distributions(void) {
    struct {
        InitKind init;
        double bound; /* uniform: max |w|; normal: 0 */
        double std;   /* expected std of the weights */
    } cases[] = {
        {INIT_DEFAULT, 1.0 / sqrt(800.0), 1.0 / sqrt(800.0) / sqrt(3.0)},
        {INIT_XAVIER_UNIFORM, sqrt(6.0 / 1200.0), sqrt(6.0 / 1200.0) / sqrt(3.0)},
        {INIT_XAVIER_NORMAL, 0.0, sqrt(2.0 / 1200.0)},
        {INIT_NORMAL, 0.0, 0.02},
    };
    for (size_t c = 0; c < 4; c++) {
        /* conv 32 -> 16, k5: fan_in = 32*25 = 800, fan_out = 16*25 = 400. */
        LayerSpec l = conv("c", 16, 5, 1, 0);
        l.init = cases[c].init;
        Model m;
        CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){32, 8, 8}, &l, 1, NULL), QT_OK);
        Rng r;
        rng_init(&r, 5, RNG_STREAM_INIT);
        model_init_params(&m, &r);
        const Var *w = &m.params[0].var, *b = &m.params[1].var;
        size_t n = var_numel(w);
        double sum = 0, sq = 0, amax = 0;
        for (size_t i = 0; i < n; i++) {
            double v = w->value.data[i];
            sum += v, sq += v * v, amax = fmax(amax, fabs(v));
        }
        double std = sqrt(sq / n - (sum / n) * (sum / n));
        /* 12800 samples: the std estimate is within ~1% (3 sigma ~ 2%). */
        CU_ASSERT(fabs(std / cases[c].std - 1.0) < 0.03);
        if (cases[c].bound > 0) {
            CU_ASSERT(amax <= cases[c].bound);
        }
        double bmax = 0;
        for (int i = 0; i < 16; i++) bmax = fmax(bmax, fabs(b->value.data[i]));
        if (cases[c].init == INIT_DEFAULT) {
            CU_ASSERT(bmax > 0 && bmax <= 1.0 / sqrt(800.0));
        } else {
            CU_ASSERT_EQUAL(bmax, 0.0);
        }
        model_free(&m);
    }
}

/* 64 points of a 4-class problem no linear model can solve (quadrants of
 * x*y sign and radius): a small MLP must drive the training loss near 0. */
static void test_tiny_mlp_learns(void) {
    LayerSpec layers[] = {dense("fc1", 32), layer(LAYER_RELU), dense("fc2", 32), layer(LAYER_RELU), dense("head", 4)};
    Model m;
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){2}, layers, 5, NULL), QT_OK);
    Rng r;
    rng_init(&r, 11, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    enum { N = 64 };
    float x[N * 2];
    int32_t y[N];
    rng_fill_uniform(&r, x, N * 2, -1, 1);
    for (int i = 0; i < N; i++)
        y[i] = (x[2 * i] * x[2 * i + 1] > 0) * 2 + (x[2 * i] * x[2 * i] + x[2 * i + 1] * x[2 * i + 1] > 0.5f);
    Optimizer opt;
    OptimConfig oc = optim_config_default(OPTIM_ADAMW);
    oc.weight_decay = 0.0f;
    CU_ASSERT_EQUAL_FATAL(optim_init(&opt, &oc, m.param_list, m.n_params, NULL), QT_OK);
    TestEnv e;
    test_env_init(&e, 1);
    double first = 0, loss = 0;
    for (int step = 0; step < 600; step++) {
        loss = model_loss(&m, &e, x, (int[]){N, 2}, 2, y, true, NULL);
        if (step == 0) first = loss;
        optim_step(&opt, 1e-2f);
        optim_zero_grad(&opt);
    }
    printf("(loss %.3f -> %.4f) ", first, loss);
    CU_ASSERT(first > 1.0);
    CU_ASSERT(loss < 0.05);
    optim_free(&opt);
    test_env_free(&e);
    model_free(&m);
}

/* After the first steps size the arena and the tape, a training step
 * allocates nothing: the arena never grows and the tape never reallocates. */
static void test_steady_state_allocates_nothing(void) {
    LayerSpec layers[] = {conv("conv1", 4, 3, 1, 1), layer(LAYER_RELU), layer(LAYER_MAXPOOL2D), layer(LAYER_FLATTEN),
                          layer(LAYER_DROPOUT), dense("head", 10)};
    layers[2].kernel = 2;
    layers[4].p = 0.1f;
    Model m;
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){1, 8, 8}, layers, 6, NULL), QT_OK);
    Rng r;
    rng_init(&r, 1, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    Optimizer opt;
    OptimConfig oc = optim_config_default(OPTIM_ADAMW);
    CU_ASSERT_EQUAL_FATAL(optim_init(&opt, &oc, m.param_list, m.n_params, NULL), QT_OK);
    TestEnv e;
    arena_init(&e.arena, 1024); /* deliberately small: the first step must grow it */
    rng_init(&e.rng, 1, RNG_STREAM_DROPOUT);
    tape_init(&e.tape, &e.arena, &e.rng, NULL);
    e.tape.cap_nodes = 1; /* likewise for the node array (realloc grows it) */
    float x[16 * 64];
    int32_t y[16] = {0};
    rng_fill_normal(&r, x, 16 * 64, 0, 1);
    size_t grows = 0, cap = 0;
    for (int step = 0; step < 10; step++) {
        model_loss(&m, &e, x, (int[]){16, 1, 8, 8}, 4, y, true, NULL);
        optim_step(&opt, 1e-3f);
        optim_zero_grad(&opt);
        if (step == 1) grows = e.arena.grow_count, cap = e.tape.cap_nodes;
    }
    CU_ASSERT(grows > 0);
    CU_ASSERT_EQUAL(e.arena.grow_count, grows);
    CU_ASSERT_EQUAL(e.tape.cap_nodes, cap);
    optim_free(&opt);
    test_env_free(&e);
    model_free(&m);
}

/* A frozen parameter has no grad buffer and no optimizer state, and stays
 * bit-for-bit unchanged; gradients still flow through it to earlier layers. */
static void test_frozen_params(void) {
    LayerSpec layers[] = {dense("fc1", 8), layer(LAYER_TANH), dense("head", 3)};
    Model m;
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){5}, layers, 3, NULL), QT_OK);
    Rng r;
    rng_init(&r, 1, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    Param *hw = model_find_param(&m, "head/weight"), *hb = model_find_param(&m, "head/bias");
    CU_ASSERT_FATAL(hw && hb && !model_find_param(&m, "head/nothing"));
    param_freeze(hw);
    CU_ASSERT_PTR_NULL(hw->var.grad);
    CU_ASSERT_EQUAL(model_param_count(&m, true), model_param_count(&m, false) - 24);
    float before[24];
    memcpy(before, hw->var.value.data, sizeof before);
    Optimizer opt;
    OptimConfig oc = optim_config_default(OPTIM_ADAMW);
    CU_ASSERT_EQUAL_FATAL(optim_init(&opt, &oc, m.param_list, m.n_params, NULL), QT_OK);
    CU_ASSERT_EQUAL(opt.n_params, 3);
    TestEnv e;
    test_env_init(&e, 1);
    float x[4 * 5];
    rng_fill_normal(&r, x, 20, 0, 1);
    float fc1_before = model_find_param(&m, "fc1/weight")->var.value.data[0];
    for (int step = 0; step < 3; step++) {
        model_loss(&m, &e, x, (int[]){4, 5}, 2, (int32_t[]){0, 1, 2, 0}, true, NULL);
        optim_step(&opt, 1e-2f);
        optim_zero_grad(&opt);
    }
    CU_ASSERT_EQUAL(memcmp(before, hw->var.value.data, sizeof before), 0);
    CU_ASSERT_NOT_EQUAL(model_find_param(&m, "fc1/weight")->var.value.data[0], fc1_before);
    /* Freezing after optim_init: the optimizer skips the parameter (no NULL
     * grad is touched) and it stays put. */
    Param *fb = model_find_param(&m, "fc1/bias");
    param_freeze(fb);
    float fb0 = fb->var.value.data[0];
    model_loss(&m, &e, x, (int[]){4, 5}, 2, (int32_t[]){0, 1, 2, 0}, true, NULL);
    optim_step(&opt, 1e-2f);
    optim_zero_grad(&opt);
    CU_ASSERT_EQUAL(fb->var.value.data[0], fb0);
    CU_ASSERT_EQUAL(param_unfreeze(hw, NULL), QT_OK);
    CU_ASSERT_PTR_NOT_NULL(hw->var.grad);
    optim_free(&opt);
    test_env_free(&e);
    model_free(&m);
}

static void expect_model_error(int ndim, const int *shape, const LayerSpec *layers, int n, const char *needle) {
    Model m;
    QtError err = {0};
    CU_ASSERT_NOT_EQUAL(model_init(&m, ndim, shape, layers, n, &err), QT_OK);
    if (!strstr(err.msg, needle)) fprintf(stderr, "\n  message '%s' lacks '%s'\n", err.msg, needle);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, needle));
}

static void test_model_errors(void) {
    LayerSpec no_flatten[] = {conv("conv1", 4, 3, 1, 0), dense("fc1", 10)};
    expect_model_error(3, (int[]){1, 28, 28}, no_flatten, 2, "layer 'fc1' (dense) gets input (4, 26, 26)");
    LayerSpec big_kernel[] = {conv("conv1", 4, 9, 1, 1)};
    expect_model_error(3, (int[]){1, 5, 5}, big_kernel, 1, "kernel 9 is larger than its input (1, 5, 5)");
    LayerSpec twice[] = {dense("fc", 3), dense("fc", 3)};
    expect_model_error(1, (int[]){4}, twice, 2, "two layers are named 'fc'");
    LayerSpec conv_on_vec[] = {conv("c", 4, 3, 1, 0)};
    expect_model_error(1, (int[]){784}, conv_on_vec, 1, "needs (C, H, W) input");
    LayerSpec zero_units[] = {dense("fc", 0)};
    expect_model_error(1, (int[]){4}, zero_units, 1, "units must be >= 1");
    expect_model_error(1, (int[]){0}, zero_units, 1, "dimension 0 is 0");
    QtError err = {0};
    LayerType t;
    CU_ASSERT_EQUAL(layer_type_parse("conv3d", &t, &err), QT_ERR_ARG);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "valid: dense, conv2d, relu"));
    CU_ASSERT_EQUAL(layer_type_parse("maxpool2d", &t, NULL), QT_OK);
    CU_ASSERT_EQUAL(t, LAYER_MAXPOOL2D);
    /* A batch of the wrong shape at run time. */
    LayerSpec ok[] = {dense("fc", 3)};
    Model m;
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){4}, ok, 1, NULL), QT_OK);
    TestEnv e;
    test_env_init(&e, 1);
    float x[10] = {0};
    CU_ASSERT_PTR_NULL(model_forward(&m, &e.tape, test_var(&e, x, 2, (int[]){2, 5}, false)));
    CU_ASSERT_PTR_NOT_NULL(strstr(e.tape.err.msg, "input batch (2, 5) does not match the model's input (N, 4)"));
    test_env_free(&e);
    model_free(&m);
}

int register_nn_model_suite(void) {
    CU_pSuite s = CU_add_suite("nn_model", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "dense layers: input and parameter gradients", test_dense_layers_grad) ||
           !CU_add_test(s, "conv layers: input and parameter gradients", test_conv_layers_grad) ||
           !CU_add_test(s, "init distributions", test_init_distributions) ||
           !CU_add_test(s, "tiny MLP learns to near-zero loss", test_tiny_mlp_learns) ||
           !CU_add_test(s, "steady-state step allocates nothing", test_steady_state_allocates_nothing) ||
           !CU_add_test(s, "frozen params: no grad, no state, unchanged", test_frozen_params) ||
           !CU_add_test(s, "models that do not chain are errors", test_model_errors);
}
