/* test_ops.c - finite-difference gradient checks and bad input for the
 * dense, elementwise, normalisation and loss ops. Conv and pooling live in
 * test_conv.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/ops.h"
#include "test_util.h"

#define EPS 1e-3
#define ATOL 2e-3
#define RTOL 1e-2

/* Random values in [-1, 1] kept at least `gap` away from 0, so a ReLU kink
 * is never crossed by a step of EPS. */
static float *random_data(size_t n, uint64_t seed, float gap) {
    float *x = malloc(n * sizeof(float));
    Rng r;
    rng_init(&r, seed, 11);
    rng_fill_uniform(&r, x, n, -1.0f, 1.0f);
    for (size_t i = 0; i < n; i++)
        if (fabsf(x[i]) < gap) x[i] = x[i] < 0 ? -gap : gap;
    return x;
}

static GradcheckInput input(const float *data, int ndim, const int *shape) {
    GradcheckInput in = {data, ndim, {1, 1, 1, 1}, true};
    memcpy(in.shape, shape, (size_t)ndim * sizeof(int));
    return in;
}

/* ---- matmul / linear ---------------------------------------------------------- */

typedef struct {
    bool ta, tb;
} MatmulArgs;

static Var *run_matmul(Tape *t, Var **in, void *ctx) {
    const MatmulArgs *a = ctx;
    return nn_matmul(t, in[0], in[1], a->ta, a->tb);
}

static void test_matmul_grad(void) {
    const int M = 3, K = 5, N = 4;
    float *a = random_data(64, 1, 0), *b = random_data(64, 2, 0);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            MatmulArgs args = {ta, tb};
            GradcheckInput ins[2] = {input(a, 2, ta ? (int[]){K, M} : (int[]){M, K}),
                                     input(b, 2, tb ? (int[]){N, K} : (int[]){K, N})};
            CU_ASSERT(gradcheck("matmul", run_matmul, &args, ins, 2, EPS, ATOL, RTOL));
        }
    free(a);
    free(b);
}

static Var *run_linear(Tape *t, Var **in, void *ctx) { return nn_linear(t, in[0], in[1], ctx ? in[2] : NULL); }

static void test_linear_grad(void) {
    float *x = random_data(64, 3, 0), *w = random_data(64, 4, 0), *b = random_data(8, 5, 0);
    GradcheckInput ins[3] = {input(x, 2, (int[]){3, 7}), input(w, 2, (int[]){5, 7}), input(b, 1, (int[]){5})};
    CU_ASSERT(gradcheck("linear+bias", run_linear, (void *)1, ins, 3, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("linear", run_linear, NULL, ins, 2, EPS, ATOL, RTOL));
    free(x);
    free(w);
    free(b);
}

/* linear == matmul(x, w^T) + bias_add, exactly the same numbers up to
 * summation order. */
static void test_linear_matches_matmul(void) {
    TestEnv e;
    test_env_init(&e, 1);
    float *x = random_data(33 * 17, 6, 0), *w = random_data(9 * 17, 7, 0), *b = random_data(9, 8, 0);
    Var *vx = test_var(&e, x, 2, (int[]){33, 17}, false), *vw = test_var(&e, w, 2, (int[]){9, 17}, false);
    Var *vb = test_var(&e, b, 1, (int[]){9}, false);
    Var *y1 = nn_linear(&e.tape, vx, vw, vb);
    Var *y2 = nn_bias_add(&e.tape, nn_matmul(&e.tape, vx, vw, false, true), vb);
    CU_ASSERT_FATAL(y1 && y2);
    ASSERT_ALL_CLOSE(y1->value.data, y2->value.data, 33 * 9, 1e-5, 1e-5);
    free(x);
    free(w);
    free(b);
    test_env_free(&e);
}

/* ---- elementwise ---------------------------------------------------------------- */

static Var *run_bias_add(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_bias_add(t, in[0], in[1]); }
static Var *run_add(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_add(t, in[0], in[1]); }
static Var *run_scale(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_scale(t, in[0], -1.7f); }
static Var *run_relu(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_relu(t, in[0]); }
static Var *run_gelu(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_gelu(t, in[0]); }
static Var *run_tanh(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_tanh(t, in[0]); }
static Var *run_sigmoid(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_sigmoid(t, in[0]); }
static Var *run_dropout(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_dropout(t, in[0], 0.3f); }
static Var *run_flatten(Tape *t, Var **in, void *ctx) {
    (void)ctx;
    /* Scale after the reshape so the gradient is not trivially 1. */
    return nn_scale(t, nn_flatten(t, in[0]), 3.0f);
}

static void test_elementwise_grads(void) {
    float *x = random_data(2 * 3 * 4 * 5, 9, 0.01f), *y = random_data(120, 10, 0), *b = random_data(3, 11, 0);
    /* Values up to +-3 so gelu/tanh/sigmoid are checked off their linear part. */
    float *wide = random_data(120, 12, 0);
    for (int i = 0; i < 120; i++) wide[i] *= 3.0f;
    GradcheckInput img[2] = {input(x, 4, (int[]){2, 3, 4, 5}), input(b, 1, (int[]){3})};
    GradcheckInput mat[2] = {input(x, 2, (int[]){4, 3}), input(b, 1, (int[]){3})};
    GradcheckInput pair[2] = {input(x, 2, (int[]){10, 12}), input(y, 2, (int[]){10, 12})};
    GradcheckInput one[1] = {input(wide, 3, (int[]){2, 6, 10})};
    GradcheckInput gapped[1] = {input(x, 2, (int[]){8, 15})};
    CU_ASSERT(gradcheck("bias_add 4d", run_bias_add, NULL, img, 2, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("bias_add 2d", run_bias_add, NULL, mat, 2, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("add", run_add, NULL, pair, 2, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("scale", run_scale, NULL, one, 1, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("relu", run_relu, NULL, gapped, 1, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("gelu", run_gelu, NULL, one, 1, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("tanh", run_tanh, NULL, one, 1, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("sigmoid", run_sigmoid, NULL, one, 1, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("dropout", run_dropout, NULL, one, 1, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("flatten", run_flatten, NULL, img, 1, EPS, ATOL, RTOL));
    free(x);
    free(y);
    free(b);
    free(wide);
}

/* GELU (tanh approximation) at hand-checked points. */
static void test_activation_values(void) {
    const float x[5] = {-3.0f, -1.0f, 0.0f, 0.5f, 2.0f};
    float y[5];
    gelu_forward(y, x, 5);
    /* 0.5 x (1 + tanh(0.7978845608 (x + 0.044715 x^3))), evaluated in double. */
    for (int i = 0; i < 5; i++) {
        double v = x[i], want = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
        CU_ASSERT_DOUBLE_EQUAL(y[i], want, 1e-6);
    }
    const float big[2] = {-100.0f, 100.0f};
    sigmoid_forward(y, big, 2);
    CU_ASSERT(y[0] >= 0.0f && y[0] < 1e-30f && y[1] == 1.0f); /* no overflow, no NaN */
}

static void test_dropout_statistics(void) {
    TestEnv e;
    test_env_init(&e, 5);
    enum { N = 100000 };
    float *ones = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) ones[i] = 1.0f;
    Var *x = test_var(&e, ones, 1, (int[]){N}, true);
    Var *y = nn_dropout(&e.tape, x, 0.25f);
    CU_ASSERT_FATAL(y != NULL);
    int zeros = 0;
    double sum = 0;
    for (int i = 0; i < N; i++) {
        zeros += y->value.data[i] == 0.0f;
        sum += y->value.data[i];
        CU_ASSERT(y->value.data[i] == 0.0f || fabsf(y->value.data[i] - 1.0f / 0.75f) < 1e-6f);
    }
    /* Binomial(N, 0.25): sigma = sqrt(N*0.25*0.75) = 137; allow 5 sigma. */
    CU_ASSERT(abs(zeros - N / 4) < 685);
    CU_ASSERT(fabs(sum / N - 1.0) < 0.01); /* inverted dropout keeps the mean */
    /* Eval mode: the identity, the very same Var. */
    e.tape.training = false;
    CU_ASSERT_PTR_EQUAL(nn_dropout(&e.tape, x, 0.25f), x);
    CU_ASSERT_PTR_NULL(nn_dropout(&e.tape, x, 1.0f)); /* p must be < 1 */
    CU_ASSERT_EQUAL(e.tape.err.status, QT_ERR_ARG);
    free(ones);
    test_env_free(&e);
}

/* ---- layernorm and losses --------------------------------------------------------- */

static Var *run_layernorm(Tape *t, Var **in, void *ctx) {
    (void)ctx;
    return nn_layernorm(t, in[0], in[1], in[2], 1e-5f);
}

static void test_layernorm(void) {
    float *x = random_data(4 * 9, 13, 0), *g = random_data(9, 14, 0), *b = random_data(9, 15, 0);
    for (int i = 0; i < 36; i++) x[i] = 2.0f * x[i] + 0.5f; /* a non-zero mean to remove */
    GradcheckInput ins[3] = {input(x, 2, (int[]){4, 9}), input(g, 1, (int[]){9}), input(b, 1, (int[]){9})};
    CU_ASSERT(gradcheck("layernorm", run_layernorm, NULL, ins, 3, EPS, ATOL, RTOL));
    /* Forward: each row has mean 0 and variance ~1 without gamma/beta. */
    float y[36], mean[4], rstd[4];
    layernorm_forward(y, mean, rstd, x, NULL, NULL, 4, 9, 1e-5f);
    for (int r = 0; r < 4; r++) {
        double m = 0, v = 0;
        for (int i = 0; i < 9; i++) m += y[r * 9 + i];
        for (int i = 0; i < 9; i++) v += (y[r * 9 + i] - m / 9) * (y[r * 9 + i] - m / 9);
        CU_ASSERT_DOUBLE_EQUAL(m / 9, 0.0, 1e-6);
        CU_ASSERT_DOUBLE_EQUAL(v / 9, 1.0, 1e-3); /* eps shifts it by ~1e-5/var */
    }
    free(x);
    free(g);
    free(b);
}

static const int32_t labels7[7] = {0, 3, 1, 4, 2, 2, 0};

static Var *run_cross_entropy(Tape *t, Var **in, void *ctx) {
    (void)ctx;
    return nn_softmax_cross_entropy(t, in[0], labels7);
}
static Var *run_mse(Tape *t, Var **in, void *ctx) {
    (void)ctx;
    return nn_mse(t, in[0], in[1]);
}

static void test_losses(void) {
    float *z = random_data(7 * 5, 16, 0), *y = random_data(35, 17, 0);
    for (int i = 0; i < 35; i++) z[i] *= 4.0f;
    GradcheckInput ce[1] = {input(z, 2, (int[]){7, 5})};
    GradcheckInput mse[2] = {input(z, 2, (int[]){5, 7}), input(y, 2, (int[]){5, 7})};
    mse[1].check = false; /* the target gets no gradient */
    CU_ASSERT(gradcheck("softmax_cross_entropy", run_cross_entropy, NULL, ce, 1, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("mse", run_mse, NULL, mse, 2, EPS, ATOL, RTOL));
    /* Hand value: logits (0, ln 3) with label 1 -> -log(3/4). */
    TestEnv e;
    test_env_init(&e, 1);
    float two[2] = {0.0f, logf(3.0f)};
    int32_t lab = 1;
    Var *l = nn_softmax_cross_entropy(&e.tape, test_var(&e, two, 2, (int[]){1, 2}, false), &lab);
    CU_ASSERT_DOUBLE_EQUAL(l->value.data[0], -log(0.75), 1e-6);
    /* Logits of +-1000 must not overflow: the loss is 2000 or 0. */
    float huge[4] = {1000.0f, -1000.0f, -1000.0f, 1000.0f};
    int32_t lab2[2] = {1, 1};
    l = nn_softmax_cross_entropy(&e.tape, test_var(&e, huge, 2, (int[]){2, 2}, false), lab2);
    CU_ASSERT_DOUBLE_EQUAL(l->value.data[0], 1000.0, 1e-3);
    test_env_free(&e);
    free(z);
    free(y);
}

/* ---- bad input ------------------------------------------------------------------------ */

static void test_bad_input_is_an_error(void) {
    TestEnv e;
    test_env_init(&e, 1);
    float d[12] = {0};
    int32_t lab[3] = {0, 1, 2};
    Var *x = test_var(&e, d, 2, (int[]){3, 4}, true);
    d[5] = NAN;
    Var *xnan = test_var(&e, d, 2, (int[]){3, 4}, true);
    Var *outs[] = {
        nn_softmax_cross_entropy(&e.tape, xnan, lab),
        nn_softmax_cross_entropy(&e.tape, x, (int32_t[]){0, 4, 1}),
        nn_mse(&e.tape, xnan, x),
        nn_mse(&e.tape, x, test_var(&e, d, 2, (int[]){4, 3}, false)),
        nn_linear(&e.tape, x, test_var(&e, d, 2, (int[]){2, 5}, false), NULL),
        nn_linear(&e.tape, x, test_var(&e, d, 2, (int[]){2, 4}, false), test_var(&e, d, 1, (int[]){3}, false)),
        nn_bias_add(&e.tape, x, test_var(&e, d, 1, (int[]){3}, false)),
        nn_add(&e.tape, x, test_var(&e, d, 2, (int[]){4, 3}, false)),
        nn_reshape(&e.tape, x, 2, (int[]){5, 2}),
        nn_reshape(&e.tape, x, 2, (int[]){0, 12}),
        nn_layernorm(&e.tape, x, test_var(&e, d, 1, (int[]){3}, false), NULL, 1e-5f),
        nn_softmax_cross_entropy(&e.tape, test_var(&e, d, 1, (int[]){12}, false), lab),
    };
    /* Every bad call returns NULL; the tape keeps the first cause (the NaN),
     * with its position. test_bad_input_messages checks each message. */
    for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++) CU_ASSERT_PTR_NULL(outs[i]);
    CU_ASSERT_EQUAL(e.tape.err.status, QT_ERR_VALUE);
    CU_ASSERT_PTR_NOT_NULL(strstr(e.tape.err.msg, "[1, 1]")); /* where the NaN is */
    test_env_free(&e);
}

/* Each bad case on its own tape, to check its status and its message. */
static void test_bad_input_messages(void) {
    float d[12] = {0};
    for (int k = 0; k < 6; k++) {
        TestEnv e;
        test_env_init(&e, 1);
        Var *x = test_var(&e, d, 2, (int[]){3, 4}, true);
        Var *out = NULL;
        QtStatus want = QT_ERR_SHAPE;
        const char *needle = "";
        switch (k) {
        case 0:
            out = nn_softmax_cross_entropy(&e.tape, x, (int32_t[]){0, 4, 1});
            want = QT_ERR_VALUE, needle = "label 4 of example 1";
            break;
        case 1:
            out = nn_mse(&e.tape, x, test_var(&e, d, 2, (int[]){4, 3}, false));
            needle = "(4, 3)";
            break;
        case 2:
            out = nn_linear(&e.tape, x, test_var(&e, d, 2, (int[]){2, 5}, false), NULL);
            needle = "linear: input (3, 4) does not fit weight (2, 5)";
            break;
        case 3:
            out = nn_reshape(&e.tape, x, 2, (int[]){5, 2});
            needle = "(3, 4) (12 elements) as (5, 2) (10 elements)";
            break;
        case 4:
            out = nn_matmul(&e.tape, x, x, true, true);
            needle = "(3, 4)^T @ (3, 4)^T";
            break;
        case 5:
            d[7] = INFINITY;
            out = nn_mse(&e.tape, test_var(&e, d, 2, (int[]){3, 4}, false), x);
            want = QT_ERR_VALUE, needle = "inf at flat index 7";
            d[7] = 0.0f;
            break;
        }
        CU_ASSERT_PTR_NULL(out);
        CU_ASSERT_EQUAL(e.tape.err.status, want);
        if (!strstr(e.tape.err.msg, needle)) fprintf(stderr, "\n  case %d: message '%s'\n", k, e.tape.err.msg);
        CU_ASSERT_PTR_NOT_NULL(strstr(e.tape.err.msg, needle));
        test_env_free(&e);
    }
}

/* relu's and add's backward over a batch-sized tensor (past the sizes that split it over the pool) give the same
 * bits on one thread and two, and the plain loops' values. Graph 0: y = add(relu(x), x), so the add's backward
 * copies dy into x's fresh gradient and the relu's adds into it; graph 1: y = relu(x), whose backward writes x's
 * gradient in dy's buffer. */
static void test_relu_add_backward_threads(void) {
    enum { N = 4, C = 16, H = 64, W = 64, NX = N * C * H * W };
    float *x = random_data(NX, 31, 0.0f), *dy = random_data(NX, 32, 0.0f), *got[2][2] = {{NULL}};
    const int before = parallel_get_threads();
    for (int graph = 0; graph < 2; graph++)
        for (int th = 0; th < 2; th++) {
            parallel_set_threads(th + 1);
            TestEnv e;
            test_env_init(&e, 1);
            Var *xv = test_var(&e, x, 4, (const int[]){N, C, H, W}, true);
            Var *r = nn_relu(&e.tape, xv), *y = graph == 0 && r ? nn_add(&e.tape, r, xv) : r;
            CU_ASSERT_FATAL(y && tape_backward_from(&e.tape, y, dy) == QT_OK && xv->grad);
            got[graph][th] = malloc(NX * sizeof(float));
            memcpy(got[graph][th], xv->grad, NX * sizeof(float));
            test_env_free(&e);
        }
    parallel_set_threads(before);
    for (int graph = 0; graph < 2; graph++) {
        size_t bad = 0;
        for (size_t i = 0; i < NX; i++) {
            const float want = graph == 0 ? (x[i] > 0.0f ? dy[i] + dy[i] : dy[i]) : x[i] > 0.0f ? dy[i] : 0.0f;
            bad += memcmp(&got[graph][0][i], &want, sizeof want) != 0;
        }
        if (bad) fprintf(stderr, "\n  graph %d: %zu gradients differ from the plain loops'", graph, bad);
        CU_ASSERT_EQUAL(bad, 0);
        CU_ASSERT(memcmp(got[graph][0], got[graph][1], NX * sizeof(float)) == 0);
        free(got[graph][0]), free(got[graph][1]);
    }
    free(x), free(dy);
}

int register_nn_ops_suite(void) {
    CU_pSuite s = CU_add_suite("nn_ops", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "matmul gradients, all transposes", test_matmul_grad) ||
           !CU_add_test(s, "linear gradients", test_linear_grad) ||
           !CU_add_test(s, "linear == matmul + bias_add", test_linear_matches_matmul) ||
           !CU_add_test(s, "elementwise gradients", test_elementwise_grads) ||
           !CU_add_test(s, "activation values", test_activation_values) ||
           !CU_add_test(s, "relu and add backward: one thread or two, the same bits", test_relu_add_backward_threads) ||
           !CU_add_test(s, "dropout statistics and eval identity", test_dropout_statistics) ||
           !CU_add_test(s, "layernorm gradients and values", test_layernorm) ||
           !CU_add_test(s, "loss gradients and values", test_losses) ||
           !CU_add_test(s, "bad input poisons the tape", test_bad_input_is_an_error) ||
           !CU_add_test(s, "bad input messages", test_bad_input_messages);
}
