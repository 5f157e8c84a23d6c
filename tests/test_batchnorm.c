/* test_batchnorm.c - batch norm, global average pooling and channel concat: finite-difference gradients, the
 * running statistics, eval mode, a whole residual block, bad shapes, and parity with PyTorch 1.13 on the
 * references tests/make_fixtures_bn.py wrote into tests/fixtures/torch_bn.h5 (regenerate:
 * /usr/bin/python3 tests/make_fixtures_bn.py tests/fixtures/torch_bn.h5).
 *
 * Parity tolerances: both sides normalise in float32 from statistics summed in double, in different orders
 * and with y computed as (x - mean) * (invstd * gamma) + beta here against x * alpha + beta' in ATen, so
 * outputs differ by a few float32 roundings of O(1) values, and the input gradient (a difference of three
 * terms of O(|dy|)) by a few roundings of |dy| * invstd * gamma. |got - want| <= 1e-5 + 1e-4 |want| keeps a
 * margin of ~10x over the measured differences (test_torch_parity), while real bugs (the
 * biased variance in the running update, a missing 1/M, gamma left out of dx, momentum the wrong way round)
 * move values by 1e-2 or more. */
#include <hdf5.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/ops.h"
#include "test_util.h"

#define EPS 1e-3
#define ATOL 2e-3
#define RTOL 1e-2

#define FIXTURE_PATH "tests/fixtures/torch_bn.h5"
#define PT_ATOL 1e-5
#define PT_RTOL 1e-4
#define PT_STEPS 5

/* Random values in [lo, hi). */
static float *random_data(size_t n, uint64_t seed, float lo, float hi) {
    float *x = malloc(n * sizeof(float));
    Rng r;
    rng_init(&r, seed, 11);
    rng_fill_uniform(&r, x, n, lo, hi);
    return x;
}

static GradcheckInput input(const float *data, int ndim, const int *shape, bool check) {
    GradcheckInput in = {data, ndim, {1, 1, 1, 1}, check};
    memcpy(in.shape, shape, (size_t)ndim * sizeof(int));
    return in;
}

/* A BatchNormState with its own running buffers of C channels (mean 0, var 1, count 0, as PyTorch starts). */
typedef struct {
    float mean[16], var[16];
    int64_t count;
    BatchNormState s;
} TestBn;

static void test_bn_init(TestBn *b, int C, float momentum) {
    CU_ASSERT_FATAL(C <= 16);
    memset(b, 0, sizeof *b);
    for (int c = 0; c < C; c++) b->var[c] = 1.0f;
    b->s = (BatchNormState){b->mean, b->var, &b->count, momentum, 1e-5f, false};
}

/* ---- gradients -------------------------------------------------------------------------- */

typedef struct {
    TestBn *bn;
    bool affine, eval;
} BnArgs;

static Var *run_bn(Tape *t, Var **in, void *ctx) {
    const BnArgs *a = ctx;
    t->training = !a->eval;
    return nn_batchnorm(t, in[0], a->affine ? in[1] : NULL, a->affine ? in[2] : NULL, &a->bn->s);
}

/* Train mode (the full gradient through the batch statistics) for (N, C), (N, C, L) and (N, C, H, W),
 * with and without gamma/beta, and eval mode (the affine map). */
static void test_bn_grads(void) {
    static const int shapes[3][4] = {{6, 5, 1, 1}, {3, 4, 5, 1}, {3, 3, 4, 3}};
    static const int ndims[3] = {2, 3, 4};
    for (int k = 0; k < 3; k++) {
        int C = shapes[k][1];
        size_t n = (size_t)shapes[k][0] * shapes[k][1] * shapes[k][2] * shapes[k][3];
        /* A non-zero mean and a variance far from 1, so a missing centring or scaling shows. */
        float *x = random_data(n, 20 + k, -1.0f, 3.0f), *g = random_data(C, 30 + k, 0.5f, 1.5f);
        float *b = random_data(C, 40 + k, -1.0f, 1.0f);
        for (int mode = 0; mode < 3; mode++) {
            TestBn bn;
            test_bn_init(&bn, C, 0.1f);
            for (int c = 0; c < C; c++) bn.mean[c] = 0.3f * c, bn.var[c] = 0.5f + c; /* for eval */
            BnArgs args = {&bn, mode != 1, mode == 2};
            GradcheckInput ins[3] = {input(x, ndims[k], shapes[k], true), input(g, 1, &C, true),
                                     input(b, 1, &C, true)};
            char name[64];
            snprintf(name, sizeof name, "batchnorm %dd %s", ndims[k], mode == 0 ? "train affine" : mode == 1 ?
                     "train plain" : "eval affine");
            CU_ASSERT(gradcheck(name, run_bn, &args, ins, args.affine ? 3 : 1, EPS, ATOL, RTOL));
        }
        free(x);
        free(g);
        free(b);
    }
}

/* Train-mode output: every channel has mean beta and biased std gamma (up to eps). */
static void test_bn_train_values(void) {
    enum { N = 4, C = 3, HW = 5 };
    float *x = random_data(N * C * HW, 5, 10.0f, 14.0f); /* |mean| >> std: a one-pass variance would cancel */
    const float g[C] = {1.0f, 2.0f, 0.5f}, b[C] = {0.0f, -1.0f, 3.0f};
    TestEnv e;
    test_env_init(&e, 1);
    TestBn bn;
    test_bn_init(&bn, C, 0.1f);
    Var *y = nn_batchnorm(&e.tape, test_var(&e, x, 3, (int[]){N, C, HW}, true), test_var(&e, g, 1, (int[]){C}, true),
                          test_var(&e, b, 1, (int[]){C}, true), &bn.s);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    for (int c = 0; c < C; c++) {
        double m = 0, v = 0;
        for (int i = 0; i < N; i++)
            for (int j = 0; j < HW; j++) m += y->value.data[(i * C + c) * HW + j];
        m /= N * HW;
        for (int i = 0; i < N; i++)
            for (int j = 0; j < HW; j++) v += pow(y->value.data[(i * C + c) * HW + j] - m, 2);
        v /= N * HW;
        CU_ASSERT_DOUBLE_EQUAL(m, b[c], 1e-5);
        CU_ASSERT_DOUBLE_EQUAL(sqrt(v), g[c], 1e-3 * g[c]);
    }
    test_env_free(&e);
    free(x);
}

/* Eval mode and a frozen state in a training tape are the affine map with the running statistics, and touch
 * neither the statistics nor the count. */
static void test_bn_eval_is_affine(void) {
    enum { N = 3, C = 2, HW = 4 };
    float *x = random_data(N * C * HW, 6, -2.0f, 2.0f);
    const float g[C] = {1.5f, -0.5f}, b[C] = {0.25f, 1.0f};
    for (int frozen = 0; frozen < 2; frozen++) {
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = frozen; /* frozen acts as eval even on a training tape */
        TestBn bn;
        test_bn_init(&bn, C, 0.1f);
        bn.mean[0] = 0.5f, bn.mean[1] = -1.0f, bn.var[0] = 2.0f, bn.var[1] = 0.25f;
        bn.s.frozen = frozen;
        Var *y = nn_batchnorm(&e.tape, test_var(&e, x, 4, (int[]){N, C, 2, 2}, true),
                              test_var(&e, g, 1, (int[]){C}, false), test_var(&e, b, 1, (int[]){C}, false), &bn.s);
        CU_ASSERT_PTR_NOT_NULL_FATAL(y);
        float want[N * C * HW];
        for (int i = 0; i < N * C * HW; i++) {
            int c = (i / HW) % C;
            want[i] = (float)((x[i] - bn.mean[c]) / sqrt(bn.var[c] + 1e-5) * g[c] + b[c]);
        }
        ASSERT_ALL_CLOSE(y->value.data, want, (size_t)N * C * HW, 1e-6, 1e-6);
        CU_ASSERT(bn.mean[0] == 0.5f && bn.mean[1] == -1.0f && bn.var[0] == 2.0f && bn.var[1] == 0.25f);
        CU_ASSERT_EQUAL(bn.count, 0);
        test_env_free(&e);
    }
    free(x);
}

/* Several training steps on different batches: running = (1 - m) running + m batch, with the unbiased
 * variance, computed here in double from the definition; the count counts the steps. Without running
 * buffers (track_running_stats=False) eval mode still normalises with the batch. */
static void test_bn_running_stats(void) {
    enum { N = 5, C = 3, HW = 6, STEPS = 4 };
    const float momentum = 0.2f;
    TestBn bn;
    test_bn_init(&bn, C, momentum);
    double rm[C] = {0, 0, 0}, rv[C] = {1, 1, 1};
    for (int s = 0; s < STEPS; s++) {
        float *x = random_data(N * C * HW, 100 + s, -1.0f + s, 2.0f + 2 * s);
        TestEnv e;
        test_env_init(&e, 1);
        CU_ASSERT_PTR_NOT_NULL(nn_batchnorm(&e.tape, test_var(&e, x, 3, (int[]){N, C, HW}, false), NULL, NULL,
                                            &bn.s));
        for (int c = 0; c < C; c++) {
            double m = 0, v = 0;
            for (int i = 0; i < N; i++)
                for (int j = 0; j < HW; j++) m += x[(i * C + c) * HW + j];
            m /= N * HW;
            for (int i = 0; i < N; i++)
                for (int j = 0; j < HW; j++) v += pow(x[(i * C + c) * HW + j] - m, 2);
            v /= N * HW - 1;
            rm[c] = (1 - momentum) * rm[c] + momentum * m;
            rv[c] = (1 - momentum) * rv[c] + momentum * v;
            CU_ASSERT_DOUBLE_EQUAL(bn.mean[c], rm[c], 1e-6 * (1 + fabs(rm[c])));
            CU_ASSERT_DOUBLE_EQUAL(bn.var[c], rv[c], 1e-6 * rv[c]);
        }
        CU_ASSERT_EQUAL(bn.count, s + 1);
        test_env_free(&e);
        free(x);
    }
    /* No running buffers: batch statistics in eval too, and nothing to count. */
    float *x = random_data(N * C * HW, 7, 3.0f, 5.0f);
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.training = false;
    BatchNormState none = {NULL, NULL, NULL, 0.1f, 1e-5f, false};
    Var *y = nn_batchnorm(&e.tape, test_var(&e, x, 3, (int[]){N, C, HW}, false), NULL, NULL, &none);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    double m = 0;
    for (int i = 0; i < N * HW; i++) m += y->value.data[(i / HW) * C * HW + i % HW];
    CU_ASSERT_DOUBLE_EQUAL(m / (N * HW), 0.0, 1e-5);
    test_env_free(&e);
    free(x);
}

/* The channels run over the thread pool: 1 and 2 threads give the same bits, forward and backward. */
static void test_bn_threads_agree(void) {
    enum { N = 8, C = 6, HW = 32 * 32 }; /* above the size at which the pool is used */
    const size_t n = (size_t)N * C * HW;
    float *x = random_data(n, 8, -1.0f, 3.0f), *dy = random_data(n, 9, -1.0f, 1.0f);
    float *g = random_data(C, 10, 0.5f, 1.5f), *b = random_data(C, 11, -1.0f, 1.0f);
    float *out[2][4];
    int before = parallel_get_threads();
    for (int th = 0; th < 2; th++) {
        parallel_set_threads(th + 1);
        TestEnv e;
        test_env_init(&e, 1);
        TestBn bn;
        test_bn_init(&bn, C, 0.1f);
        Var *xv = test_var(&e, x, 4, (int[]){N, C, 32, 32}, true);
        Var *gv = test_var(&e, g, 1, (int[]){C}, true), *bv = test_var(&e, b, 1, (int[]){C}, true);
        Var *y = nn_batchnorm(&e.tape, xv, gv, bv, &bn.s);
        CU_ASSERT_FATAL(y && tape_backward_from(&e.tape, y, dy) == QT_OK);
        const float *src[4] = {y->value.data, xv->grad, gv->grad, bv->grad};
        size_t len[4] = {n, n, C, C};
        for (int k = 0; k < 4; k++) {
            out[th][k] = malloc(len[k] * sizeof(float));
            memcpy(out[th][k], src[k], len[k] * sizeof(float));
        }
        test_env_free(&e);
    }
    parallel_set_threads(before);
    size_t len[4] = {n, n, C, C};
    for (int k = 0; k < 4; k++) {
        CU_ASSERT(memcmp(out[0][k], out[1][k], len[k] * sizeof(float)) == 0);
        free(out[0][k]);
        free(out[1][k]);
    }
    free(x);
    free(dy);
    free(g);
    free(b);
}

/* ---- a relu after the batch norm, folded into its passes ----------------------------------------------------- */

/* relu(bn(x)) either way: nn_batchnorm_relu + nn_batchnorm_relu_inplace (fused), or nn_batchnorm +
 * nn_relu_inplace; with `twice`, the relu'd buffer is also read through the batch norm's own Var (add(r, y)), so
 * the relu's backward finds a gradient there already and runs its own pass. */
static Var *bn_relu_pair(Tape *t, Var *x, Var *g, Var *b, TestBn *bn, bool fused, bool twice) {
    Var *y = fused ? nn_batchnorm_relu(t, x, g, b, &bn->s) : nn_batchnorm(t, x, g, b, &bn->s);
    Var *r = fused ? nn_batchnorm_relu_inplace(t, y) : nn_relu_inplace(t, y);
    return twice && r ? nn_add(t, r, y) : r;
}

static Var *run_bn_relu(Tape *t, Var **in, void *ctx) {
    const BnArgs *a = ctx;
    t->training = !a->eval;
    return bn_relu_pair(t, in[0], a->affine ? in[1] : NULL, a->affine ? in[2] : NULL, a->bn, true, false);
}

/* The fused pair gives the separate ops' bits: the output, every gradient and the running statistics, train and
 * eval, affine or not, runs shorter than a lane block (N, C) and longer (N, C, H, W), 1 and 2 threads, and with
 * the relu's own backward pass (twice); and its gradients pass finite differences. */
static void test_bn_relu_fused(void) {
    static const int shapes[2][4] = {{9, 5, 1, 1}, {6, 4, 12, 11}};
    const int before = parallel_get_threads();
    for (int k = 0; k < 2; k++)
        for (int mode = 0; mode < 8; mode++) {
            const bool affine = mode & 1, eval = mode & 2, twice = mode & 4;
            const int N = shapes[k][0], C = shapes[k][1], nd = k ? 4 : 2;
            const size_t n = (size_t)N * C * shapes[k][2] * shapes[k][3];
            float *x = random_data(n, 60 + k, -1.0f, 3.0f), *dy = random_data(n, 61 + k, -1.0f, 1.0f);
            float *g = random_data(C, 62 + k, -1.5f, 1.5f), *b = random_data(C, 63 + k, -1.0f, 1.0f);
            float *out[2][2][4];
            float run[2][2][32];
            for (int th = 0; th < 2; th++)
                for (int fused = 0; fused < 2; fused++) {
                    parallel_set_threads(th + 1);
                    TestEnv e;
                    test_env_init(&e, 1);
                    e.tape.training = !eval;
                    TestBn bn;
                    test_bn_init(&bn, C, 0.1f);
                    for (int c = 0; c < C; c++) bn.mean[c] = 0.2f * c, bn.var[c] = 0.5f + c;
                    Var *xv = test_var(&e, x, nd, shapes[k], true);
                    Var *gv = affine ? test_var(&e, g, 1, &C, true) : NULL;
                    Var *bv = affine ? test_var(&e, b, 1, &C, true) : NULL;
                    Var *r = bn_relu_pair(&e.tape, xv, gv, bv, &bn, fused, twice);
                    CU_ASSERT_FATAL(r && tape_backward_from(&e.tape, r, dy) == QT_OK);
                    const float *src[4] = {r->value.data, xv->grad, gv ? gv->grad : NULL, bv ? bv->grad : NULL};
                    const size_t len[4] = {n, n, (size_t)C, (size_t)C};
                    for (int q = 0; q < 4; q++) {
                        out[th][fused][q] = calloc(len[q], sizeof(float));
                        if (src[q]) memcpy(out[th][fused][q], src[q], len[q] * sizeof(float));
                    }
                    memcpy(run[th][fused], bn.mean, (size_t)C * sizeof(float));
                    memcpy(run[th][fused] + 16, bn.var, (size_t)C * sizeof(float));
                    test_env_free(&e);
                }
            parallel_set_threads(before);
            const size_t len[4] = {n, n, (size_t)C, (size_t)C};
            bool same = true;
            for (int th = 0; th < 2; th++) {
                for (int q = 0; q < 4; q++) same &= !memcmp(out[th][0][q], out[th][1][q], len[q] * sizeof(float));
                same &= !memcmp(run[th][0], run[th][1], (size_t)C * sizeof(float)) &&
                        !memcmp(run[th][0] + 16, run[th][1] + 16, (size_t)C * sizeof(float));
                for (int q = 0; q < 4; q++) free(out[th][0][q]), free(out[th][1][q]);
            }
            if (!same) fprintf(stderr, "\n  batchnorm + relu %dd, mode %d: fused != separate\n", nd, mode);
            CU_ASSERT(same);
            if (!twice && k == 0) { /* small: no value within a step of the relu's kink */
                TestBn bn;
                test_bn_init(&bn, C, 0.1f);
                BnArgs args = {&bn, affine, eval};
                GradcheckInput ins[3] = {input(x, nd, shapes[k], true), input(g, 1, &C, true), input(b, 1, &C, true)};
                CU_ASSERT(gradcheck("batchnorm + relu fused", run_bn_relu, &args, ins, affine ? 3 : 1, EPS, ATOL,
                                    RTOL));
            }
            free(x), free(dy), free(g), free(b);
        }
    /* on a value no nn_batchnorm_relu made (and that wants a gradient): an error, not a silent relu */
    TestEnv e;
    test_env_init(&e, 1);
    float v[4] = {1, -1, 2, -2};
    CU_ASSERT_PTR_NULL(nn_batchnorm_relu_inplace(&e.tape, nn_relu(&e.tape, test_var(&e, v, 2, (int[]){2, 2}, true))));
    CU_ASSERT(e.tape.err.status == QT_ERR_ARG && test_msg_has(&e.tape.err, "nn_batchnorm_relu"));
    test_env_free(&e);
}

/* ---- global average pool, concat, add ------------------------------------------------------ */

static Var *run_gap(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_globalavgpool(t, in[0]); }
static Var *run_concat3(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_concat(t, in, 3); }
/* The same Var twice around another: (a, b, a). */
static Var *run_concat_aba(Tape *t, Var **in, void *ctx) {
    (void)ctx;
    return nn_concat(t, (Var *[]){in[0], in[1], in[0]}, 3);
}
static Var *run_add_self(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_add(t, in[0], in[0]); }
static Var *run_add(Tape *t, Var **in, void *ctx) { (void)ctx; return nn_add(t, in[0], in[1]); }

static void test_gap_concat_add(void) {
    float *x = random_data(2 * 3 * 4 * 5, 50, -1.0f, 1.0f), *y = random_data(2 * 3 * 4 * 5, 51, -1.0f, 1.0f);
    float *z = random_data(2 * 1 * 4 * 5, 52, -1.0f, 1.0f);
    GradcheckInput gap[1] = {input(x, 4, (int[]){2, 3, 4, 5}, true)};
    CU_ASSERT(gradcheck("globalavgpool", run_gap, NULL, gap, 1, EPS, ATOL, RTOL));
    GradcheckInput cat[3] = {input(x, 4, (int[]){2, 3, 4, 5}, true), input(z, 4, (int[]){2, 1, 4, 5}, true),
                             input(y, 4, (int[]){2, 3, 4, 5}, true)};
    CU_ASSERT(gradcheck("concat 4d", run_concat3, NULL, cat, 3, EPS, ATOL, RTOL));
    cat[1].check = false; /* an input without a gradient between two that have one */
    CU_ASSERT(gradcheck("concat 4d, middle constant", run_concat3, NULL, cat, 3, EPS, ATOL, RTOL));
    GradcheckInput cat2[3] = {input(x, 2, (int[]){4, 3}, true), input(y, 2, (int[]){4, 5}, true),
                              input(z, 2, (int[]){4, 2}, true)};
    CU_ASSERT(gradcheck("concat 2d", run_concat3, NULL, cat2, 3, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("concat (a, b, a)", run_concat_aba, NULL, cat2, 2, EPS, ATOL, RTOL));
    GradcheckInput pair[2] = {input(x, 4, (int[]){2, 3, 4, 5}, true), input(y, 4, (int[]){2, 3, 4, 5}, true)};
    CU_ASSERT(gradcheck("add, both with gradients", run_add, NULL, pair, 2, EPS, ATOL, RTOL));
    CU_ASSERT(gradcheck("add(a, a)", run_add_self, NULL, pair, 1, EPS, ATOL, RTOL));

    /* Values: the mean of each plane; the concatenated channels in order. */
    TestEnv e;
    test_env_init(&e, 1);
    Var *xv = test_var(&e, x, 4, (int[]){2, 3, 4, 5}, false), *zv = test_var(&e, z, 4, (int[]){2, 1, 4, 5}, false);
    Var *m = nn_globalavgpool(&e.tape, xv);
    CU_ASSERT_FATAL(m && m->value.ndim == 2 && m->value.shape[0] == 2 && m->value.shape[1] == 3);
    for (int p = 0; p < 6; p++) {
        double s = 0;
        for (int i = 0; i < 20; i++) s += x[p * 20 + i];
        CU_ASSERT_DOUBLE_EQUAL(m->value.data[p], s / 20, 1e-7);
    }
    Var *c = nn_concat(&e.tape, (Var *[]){zv, xv}, 2);
    CU_ASSERT_FATAL(c && c->value.shape[1] == 4 && c->value.shape[2] == 4 && c->value.shape[3] == 5);
    for (int n = 0; n < 2; n++) {
        CU_ASSERT(memcmp(c->value.data + n * 80, z + n * 20, 20 * sizeof(float)) == 0);
        CU_ASSERT(memcmp(c->value.data + n * 80 + 20, x + n * 60, 60 * sizeof(float)) == 0);
    }
    test_env_free(&e);
    free(x);
    free(y);
    free(z);
}

/* ---- a residual block ---------------------------------------------------------------------- */

typedef struct {
    TestBn bn1, bn2;
    float *pre[2]; /* if set: the two ReLU inputs are copied here (each numel(x)) */
} BlockArgs;

/* relu(bn2(conv2(relu(bn1(conv1(x))))) + x); in: x, w1, g1, b1, w2, g2, b2. */
static Var *run_block(Tape *t, Var **in, void *ctx) {
    BlockArgs *a = ctx;
    Var *h = nn_batchnorm(t, nn_conv2d(t, in[0], in[1], NULL, 1, 1), in[2], in[3], &a->bn1.s);
    if (h && a->pre[0]) memcpy(a->pre[0], h->value.data, var_numel(h) * sizeof(float));
    h = nn_batchnorm(t, nn_conv2d(t, nn_relu(t, h), in[4], NULL, 1, 1), in[5], in[6], &a->bn2.s);
    h = nn_add(t, h, in[0]);
    if (h && a->pre[1]) memcpy(a->pre[1], h->value.data, var_numel(h) * sizeof(float));
    return nn_relu(t, h);
}

/* The whole block end to end, every input and parameter. The inputs are drawn until both ReLUs' inputs stay
 * 0.02 away from 0, so no step of EPS crosses a kink (the numeric derivative would be meaningless there). */
static void test_residual_block_grads(void) {
    enum { N = 2, C = 2, H = 4, W = 4, NX = N * C * H * W, NW = C * C * 9 };
    const int xs[4] = {N, C, H, W}, ws[4] = {C, C, 3, 3};
    float pre0[NX], pre1[NX];
    for (uint64_t seed = 1; seed < 200; seed++) {
        float *d[7] = {random_data(NX, seed, -1.0f, 1.0f),        random_data(NW, seed + 1000, -0.5f, 0.5f),
                       random_data(C, seed + 2000, 0.5f, 1.5f),   random_data(C, seed + 3000, -0.5f, 0.5f),
                       random_data(NW, seed + 4000, -0.5f, 0.5f), random_data(C, seed + 5000, 0.5f, 1.5f),
                       random_data(C, seed + 6000, -0.5f, 0.5f)};
        BlockArgs args = {.pre = {pre0, pre1}};
        test_bn_init(&args.bn1, C, 0.1f);
        test_bn_init(&args.bn2, C, 0.1f);
        TestEnv e;
        test_env_init(&e, 1);
        Var *in[7];
        for (int k = 0; k < 7; k++)
            in[k] = test_var(&e, d[k], k == 0 ? 4 : k == 1 || k == 4 ? 4 : 1,
                             k == 0 ? xs : k == 1 || k == 4 ? ws : (int[]){C}, false);
        CU_ASSERT_PTR_NOT_NULL_FATAL(run_block(&e.tape, in, &args));
        test_env_free(&e);
        float gap = INFINITY;
        for (int i = 0; i < NX; i++) gap = fminf(gap, fminf(fabsf(pre0[i]), fabsf(pre1[i])));
        bool done = gap > 0.02f;
        if (done) {
            args.pre[0] = args.pre[1] = NULL;
            const int cs[1] = {C};
            GradcheckInput gi[7] = {input(d[0], 4, xs, true), input(d[1], 4, ws, true), input(d[2], 1, cs, true),
                                    input(d[3], 1, cs, true), input(d[4], 4, ws, true), input(d[5], 1, cs, true),
                                    input(d[6], 1, cs, true)};
            CU_ASSERT(gradcheck("residual block", run_block, &args, gi, 7, EPS, ATOL, RTOL));
        }
        for (int k = 0; k < 7; k++) free(d[k]);
        if (done) return;
    }
    CU_FAIL("no seed below 200 keeps the residual block's ReLU inputs away from 0");
}

/* The residual block's steps allocate only from the step arena: after the first step neither the arena nor
 * the tape's node array grows (a small first arena, so the first step must grow it). */
static void test_residual_block_steady(void) {
    enum { N = 4, C = 3, NX = N * C * 8 * 8, NW = C * C * 9 };
    float *d[7] = {random_data(NX, 1, -1.0f, 1.0f), random_data(NW, 2, -0.5f, 0.5f), random_data(C, 3, 0.5f, 1.5f),
                   random_data(C, 4, -0.5f, 0.5f),  random_data(NW, 5, -0.5f, 0.5f), random_data(C, 6, 0.5f, 1.5f),
                   random_data(C, 7, -0.5f, 0.5f)};
    float *dy = random_data(NX, 8, -1.0f, 1.0f);
    const int xs[4] = {N, C, 8, 8}, ws[4] = {C, C, 3, 3}, cs[1] = {C};
    Arena arena;
    Tape tape;
    CU_ASSERT_FATAL(arena_init(&arena, 4096) == 0);
    CU_ASSERT_FATAL(tape_init(&tape, &arena, NULL, NULL) == QT_OK);
    BlockArgs args = {0};
    test_bn_init(&args.bn1, C, 0.1f);
    test_bn_init(&args.bn2, C, 0.1f);
    size_t grows = 0, cap = 0;
    for (int step = 0; step < 4; step++) {
        tape_reset(&tape);
        Var *in[7];
        for (int k = 0; k < 7; k++) {
            const bool w = k == 1 || k == 4;
            in[k] = tape_wrap(&tape, d[k], k == 0 || w ? 4 : 1, k == 0 ? xs : w ? ws : cs);
            CU_ASSERT_PTR_NOT_NULL_FATAL(in[k]);
            in[k]->requires_grad = true;
        }
        Var *out = run_block(&tape, in, &args);
        CU_ASSERT_FATAL(out && tape_backward_from(&tape, out, dy) == QT_OK && in[0]->grad);
        if (step == 1) grows = arena.grow_count, cap = tape.cap_nodes;
    }
    CU_ASSERT(grows > 0);
    CU_ASSERT_EQUAL(arena.grow_count, grows);
    CU_ASSERT_EQUAL(tape.cap_nodes, cap);
    CU_ASSERT_EQUAL(args.bn1.count, 4);
    tape_free(&tape);
    arena_free(&arena);
    for (int k = 0; k < 7; k++) free(d[k]);
    free(dy);
}

/* ---- bad input ------------------------------------------------------------------------------- */

static void test_bad_shapes(void) {
    float d[64] = {0};
    for (int k = 0; k < 8; k++) {
        TestEnv e;
        test_env_init(&e, 1);
        TestBn bn;
        test_bn_init(&bn, 4, 0.1f);
        Var *x = test_var(&e, d, 4, (int[]){2, 4, 2, 2}, true);
        Var *out = NULL;
        QtStatus want = QT_ERR_SHAPE;
        const char *needle = "";
        switch (k) {
        case 0:
            out = nn_batchnorm(&e.tape, x, test_var(&e, d, 1, (int[]){3}, true), NULL, &bn.s);
            needle = "batchnorm: gamma (3,) does not match the 4 channels (axis 1) of input (2, 4, 2, 2); want (4,)";
            break;
        case 1:
            out = nn_batchnorm(&e.tape, x, NULL, test_var(&e, d, 2, (int[]){4, 1}, true), &bn.s);
            needle = "beta (4, 1)";
            break;
        case 2:
            out = nn_batchnorm(&e.tape, test_var(&e, d, 1, (int[]){8}, true), NULL, NULL, &bn.s);
            needle = "input (8,) must be (N, C)";
            break;
        case 3:
            out = nn_batchnorm(&e.tape, test_var(&e, d, 2, (int[]){1, 4}, true), NULL, NULL, &bn.s);
            needle = "more than 1 value per channel, got input (1, 4)";
            break;
        case 4:
            bn.s.momentum = 1.5f;
            out = nn_batchnorm(&e.tape, x, NULL, NULL, &bn.s);
            want = QT_ERR_ARG, needle = "momentum must be in [0, 1], got 1.5";
            break;
        case 5:
            out = nn_globalavgpool(&e.tape, test_var(&e, d, 2, (int[]){2, 4}, true));
            needle = "globalavgpool: input (2, 4) must be 4-D";
            break;
        case 6:
            out = nn_concat(&e.tape, (Var *[]){x, test_var(&e, d, 4, (int[]){2, 3, 2, 3}, true)}, 2);
            needle = "concat: input 1 (2, 3, 2, 3) does not fit input 0 (2, 4, 2, 2)";
            break;
        case 7:
            out = nn_add(&e.tape, x, test_var(&e, d, 4, (int[]){2, 4, 2, 1}, true));
            needle = "add: shapes differ: (2, 4, 2, 2) and (2, 4, 2, 1)";
            break;
        }
        CU_ASSERT_PTR_NULL(out);
        CU_ASSERT_EQUAL(e.tape.err.status, want);
        CU_ASSERT(test_msg_has(&e.tape.err, needle));
        /* The op refused before touching the statistics. */
        CU_ASSERT(bn.count == 0 && bn.mean[0] == 0.0f && bn.var[0] == 1.0f);
        test_env_free(&e);
    }
    /* A single value per channel is fine in eval mode (running statistics). */
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.training = false;
    TestBn bn;
    test_bn_init(&bn, 4, 0.1f);
    CU_ASSERT_PTR_NOT_NULL(nn_batchnorm(&e.tape, test_var(&e, d, 2, (int[]){1, 4}, true), NULL, NULL, &bn.s));
    test_env_free(&e);
}

/* ---- PyTorch parity ---------------------------------------------------------------------------- */

/* Reads dataset `path` (of exactly n elements of memtype) into out; false, with the reason printed, if it is
 * missing or of another size. */
static bool fx_read(hid_t f, const char *path, hid_t memtype, void *out, size_t n) {
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    hid_t s = d >= 0 ? H5Dget_space(d) : H5I_INVALID_HID;
    hssize_t got = s >= 0 ? H5Sget_simple_extent_npoints(s) : -1;
    bool ok = got == (hssize_t)n && H5Dread(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) >= 0;
    if (!ok) fprintf(stderr, "\n  %s: %s missing, unreadable or not of %zu elements (has %lld)\n", FIXTURE_PATH, path,
                     n, (long long)got);
    if (s >= 0) H5Sclose(s);
    if (d >= 0) H5Dclose(d);
    CU_ASSERT(ok);
    return ok;
}

/* The worst ratio of all comparisons, printed at the end to show the margin under the tolerance. */
static double pt_worst;

static void pt_check(const char *what, const float *got, const float *want, size_t n) {
    double r = test_close_ratio(got, want, n, PT_ATOL, PT_RTOL, NULL);
    if (r > pt_worst) pt_worst = r;
    if (r > 1.0) fprintf(stderr, "\n  mismatch in %s:", what);
    ASSERT_ALL_CLOSE(got, want, n, PT_ATOL, PT_RTOL);
}

/* "/group/name" of n floats, read into a malloc'd buffer (NULL on failure). */
static float *fx_floats(hid_t f, const char *group, const char *name, size_t n) {
    char path[128];
    snprintf(path, sizeof path, "/%s/%s", group, name);
    float *buf = malloc(n * sizeof(float));
    if (!fx_read(f, path, H5T_NATIVE_FLOAT, buf, n)) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* One BatchNorm group: PT_STEPS training steps on the fixture's batches (outputs, every gradient, the
 * running statistics after each), the count, then eval mode with the final statistics. */
static void pt_bn_group(hid_t f, const char *group, int ndim, const int *shape, bool affine) {
    const int C = shape[1];
    size_t n = 1;
    for (int i = 0; i < ndim; i++) n *= (size_t)shape[i];
    double eps = 0, momentum = 0;
    hid_t g = H5Gopen2(f, group, H5P_DEFAULT);
    CU_ASSERT_FATAL(g >= 0);
    hid_t a1 = H5Aopen(g, "eps", H5P_DEFAULT), a2 = H5Aopen(g, "momentum", H5P_DEFAULT);
    CU_ASSERT(H5Aread(a1, H5T_NATIVE_DOUBLE, &eps) >= 0 && H5Aread(a2, H5T_NATIVE_DOUBLE, &momentum) >= 0);
    H5Aclose(a1);
    H5Aclose(a2);
    H5Gclose(g);
    TestBn bn;
    test_bn_init(&bn, C, (float)momentum);
    bn.s.eps = (float)eps;
    const char *names[] = {"x", "dy", "y", "dx", "running_mean", "running_var", "dweight", "dbias"};
    const size_t sizes[] = {n, n, n, n, C, C, C, C};
    float *ref[8] = {0};
    for (int k = 0; k < (affine ? 8 : 6); k++) ref[k] = fx_floats(f, group, names[k], PT_STEPS * sizes[k]);
    float *w = affine ? fx_floats(f, group, "weight", C) : NULL, *b = affine ? fx_floats(f, group, "bias", C) : NULL;
    for (int k = 0; k < (affine ? 8 : 6); k++) CU_ASSERT_PTR_NOT_NULL_FATAL(ref[k]);
    for (int s = 0; s < PT_STEPS; s++) {
        TestEnv e;
        test_env_init(&e, 1);
        Var *x = test_var(&e, ref[0] + s * n, ndim, shape, true);
        Var *gv = affine ? test_var(&e, w, 1, &C, true) : NULL, *bv = affine ? test_var(&e, b, 1, &C, true) : NULL;
        Var *y = nn_batchnorm(&e.tape, x, gv, bv, &bn.s);
        CU_ASSERT_FATAL(y && tape_backward_from(&e.tape, y, ref[1] + s * n) == QT_OK);
        char what[96];
        const float *got[8] = {NULL, NULL, y->value.data, x->grad, bn.mean, bn.var, gv ? gv->grad : NULL,
                               bv ? bv->grad : NULL};
        for (int k = 2; k < (affine ? 8 : 6); k++) {
            snprintf(what, sizeof what, "%s/%s step %d", group, names[k], s);
            pt_check(what, got[k], ref[k] + s * sizes[k], sizes[k]);
        }
        test_env_free(&e);
    }
    int64_t count = -1;
    char path[96];
    snprintf(path, sizeof path, "/%s/num_batches_tracked", group);
    CU_ASSERT(fx_read(f, path, H5T_NATIVE_INT64, &count, 1) && count == bn.count && count == PT_STEPS);
    float *xe = fx_floats(f, group, "x_eval", n), *ye = fx_floats(f, group, "y_eval", n);
    if (xe && ye) {
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = false;
        Var *gv = affine ? test_var(&e, w, 1, &C, false) : NULL, *bv = affine ? test_var(&e, b, 1, &C, false) : NULL;
        Var *y = nn_batchnorm(&e.tape, test_var(&e, xe, ndim, shape, false), gv, bv, &bn.s);
        CU_ASSERT_FATAL(y != NULL);
        snprintf(path, sizeof path, "%s/y_eval", group);
        pt_check(path, y->value.data, ye, n);
        test_env_free(&e);
    }
    free(xe);
    free(ye);
    free(w);
    free(b);
    for (int k = 0; k < 8; k++) free(ref[k]);
}

static void pt_gap_cat(hid_t f) {
    enum { NX = 2 * 3 * 4 * 5 };
    float *x = fx_floats(f, "gap", "x", NX), *y = fx_floats(f, "gap", "y", 6), *dy = fx_floats(f, "gap", "dy", 6);
    float *dx = fx_floats(f, "gap", "dx", NX);
    if (x && y && dy && dx) {
        TestEnv e;
        test_env_init(&e, 1);
        Var *xv = test_var(&e, x, 4, (int[]){2, 3, 4, 5}, true);
        Var *out = nn_globalavgpool(&e.tape, xv);
        CU_ASSERT_FATAL(out && tape_backward_from(&e.tape, out, dy) == QT_OK);
        pt_check("gap/y", out->value.data, y, 6);
        pt_check("gap/dx", xv->grad, dx, NX);
        test_env_free(&e);
    }
    free(x), free(y), free(dy), free(dx);
    const int ch[3] = {2, 3, 1};
    const char *names[3] = {"a", "b", "c"}, *dnames[3] = {"da", "db", "dc"};
    float *in[3], *din[3];
    bool ok = true;
    for (int k = 0; k < 3; k++) {
        in[k] = fx_floats(f, "cat", names[k], 2 * ch[k] * 9);
        din[k] = fx_floats(f, "cat", dnames[k], 2 * ch[k] * 9);
        ok &= in[k] && din[k];
    }
    float *cy = fx_floats(f, "cat", "y", 2 * 6 * 9), *cdy = fx_floats(f, "cat", "dy", 2 * 6 * 9);
    if (ok && cy && cdy) {
        TestEnv e;
        test_env_init(&e, 1);
        Var *v[3];
        for (int k = 0; k < 3; k++) v[k] = test_var(&e, in[k], 4, (int[]){2, ch[k], 3, 3}, true);
        Var *out = nn_concat(&e.tape, v, 3);
        CU_ASSERT_FATAL(out && tape_backward_from(&e.tape, out, cdy) == QT_OK);
        pt_check("cat/y", out->value.data, cy, 2 * 6 * 9);
        for (int k = 0; k < 3; k++) pt_check(dnames[k], v[k]->grad, din[k], 2 * ch[k] * 9);
        test_env_free(&e);
    }
    for (int k = 0; k < 3; k++) free(in[k]), free(din[k]);
    free(cy), free(cdy);
}

static void pt_resblock(hid_t f) {
    enum { C = 3, NX = 2 * C * 6 * 6, NW = C * C * 9 };
    const char *pnames[6] = {"conv1/weight", "bn1/weight", "bn1/bias", "conv2/weight", "bn2/weight", "bn2/bias"};
    const size_t psizes[6] = {NW, C, C, NW, C, C};
    char name[64];
    float *p[6], *gp[6];
    bool ok = true;
    for (int k = 0; k < 6; k++) {
        snprintf(name, sizeof name, "params/%s", pnames[k]);
        p[k] = fx_floats(f, "resblock", name, psizes[k]);
        snprintf(name, sizeof name, "grads/%s", pnames[k]);
        gp[k] = fx_floats(f, "resblock", name, psizes[k]);
        ok &= p[k] && gp[k];
    }
    float *x = fx_floats(f, "resblock", "x", NX), *y = fx_floats(f, "resblock", "y", NX);
    float *dy = fx_floats(f, "resblock", "dy", NX), *dx = fx_floats(f, "resblock", "dx", NX);
    float *rs[4] = {fx_floats(f, "resblock", "bn1/running_mean", C), fx_floats(f, "resblock", "bn1/running_var", C),
                    fx_floats(f, "resblock", "bn2/running_mean", C), fx_floats(f, "resblock", "bn2/running_var", C)};
    ok &= x && y && dy && dx && rs[0] && rs[1] && rs[2] && rs[3];
    if (ok) {
        TestEnv e;
        test_env_init(&e, 1);
        BlockArgs args = {0};
        test_bn_init(&args.bn1, C, 0.1f);
        test_bn_init(&args.bn2, C, 0.1f);
        Var *in[7];
        in[0] = test_var(&e, x, 4, (int[]){2, C, 6, 6}, true);
        for (int k = 0; k < 6; k++)
            in[k + 1] = test_var(&e, p[k], psizes[k] == NW ? 4 : 1, psizes[k] == NW ? (int[]){C, C, 3, 3} : (int[]){C},
                                 true);
        Var *out = run_block(&e.tape, in, &args);
        CU_ASSERT_FATAL(out && tape_backward_from(&e.tape, out, dy) == QT_OK);
        pt_check("resblock/y", out->value.data, y, NX);
        pt_check("resblock/dx", in[0]->grad, dx, NX);
        for (int k = 0; k < 6; k++) pt_check(pnames[k], in[k + 1]->grad, gp[k], psizes[k]);
        pt_check("bn1/running_mean", args.bn1.mean, rs[0], C);
        pt_check("bn1/running_var", args.bn1.var, rs[1], C);
        pt_check("bn2/running_mean", args.bn2.mean, rs[2], C);
        pt_check("bn2/running_var", args.bn2.var, rs[3], C);
        test_env_free(&e);
    }
    for (int k = 0; k < 6; k++) free(p[k]), free(gp[k]);
    for (int k = 0; k < 4; k++) free(rs[k]);
    free(x), free(y), free(dy), free(dx);
}

/* Measured with PyTorch 1.13: worst ratio to the tolerance 0.11 (QT_TEST_SHOW_MSGS=1 prints it). */
static void test_torch_parity(void) {
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    hid_t f = H5Fopen(FIXTURE_PATH, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0) {
        test_skip("cannot open %s (run from the repository root; regenerate it with /usr/bin/python3 "
                  "tests/make_fixtures_bn.py %s)", FIXTURE_PATH, FIXTURE_PATH);
        return;
    }
    pt_worst = 0;
    pt_bn_group(f, "bn1d", 2, (int[]){8, 6}, true);
    pt_bn_group(f, "bn2d", 4, (int[]){3, 4, 4, 4}, true);
    pt_bn_group(f, "bn2d_plain", 4, (int[]){2, 3, 3, 3}, false);
    pt_gap_cat(f);
    pt_resblock(f);
    if (getenv("QT_TEST_SHOW_MSGS")) fprintf(stderr, "\n  torch_bn: worst ratio to the tolerance %.3g\n", pt_worst);
    H5Fclose(f);
}

int register_nn_batchnorm_suite(void) {
    CU_pSuite s = CU_add_suite("nn_batchnorm", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "batchnorm gradients, train and eval, 2/3/4-D", test_bn_grads) ||
           !CU_add_test(s, "batchnorm train output: mean beta, std gamma", test_bn_train_values) ||
           !CU_add_test(s, "batchnorm eval and frozen: the running affine map", test_bn_eval_is_affine) ||
           !CU_add_test(s, "batchnorm running statistics over steps", test_bn_running_stats) ||
           !CU_add_test(s, "batchnorm: 1 and 2 threads agree bit for bit", test_bn_threads_agree) ||
           !CU_add_test(s, "batchnorm + relu fused = the separate ops, bit for bit", test_bn_relu_fused) ||
           !CU_add_test(s, "globalavgpool, concat, add: gradients and values", test_gap_concat_add) ||
           !CU_add_test(s, "residual block gradients end to end", test_residual_block_grads) ||
           !CU_add_test(s, "residual block steps: no growth after the first", test_residual_block_steady) ||
           !CU_add_test(s, "bad shapes are refused, sizes named", test_bad_shapes) ||
           !CU_add_test(s, "PyTorch parity (torch_bn.h5)", test_torch_parity);
}
