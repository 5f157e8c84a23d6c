/* test_conv_lowrank.c - the nn_conv_lowrank suite: the convolution with a
 * low-rank term on its weight (nn/ops_conv_lowrank.c).
 *
 * Each of the three routes for A's and B's gradients (ConvLowRankGrad) is
 * forced in turn: against the direct loops of conv2d_forward_ref /
 * conv2d_backward_ref on the merged weight, against each other on every
 * epilogue and mix of trainable inputs, on one and two threads, and
 * against finite differences. conv_lowrank_grad_choose is held to the
 * sizes that pick each route. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "nn/gemm.h"
#include "nn/ops.h"
#include "nn/ops_conv_internal.h"
#include "test_util.h"

typedef struct {
    int N, C, H, W, OC, K, stride, padding, rank;
} LrCase;

static const LrCase lr_cases[] = {
    {3, 3, 7, 6, 8, 3, 1, 1, 2},  /* "same" stride 1: every route */
    {2, 2, 9, 9, 6, 5, 1, 2, 3},  /* "same" with a 5x5 kernel */
    {3, 3, 9, 7, 8, 3, 2, 1, 2},  /* stride 2: no dt im2col */
    {2, 2, 6, 8, 5, 3, 1, 0, 1},  /* stride 1 without padding: not "same" */
    {3, 4, 5, 6, 7, 1, 1, 0, 2},  /* pointwise: each sample's x read in place as its im2col */
};
#define N_LR_CASES (sizeof lr_cases / sizeof lr_cases[0])

static const ConvLowRankGrad routes[] = {CONV_LR_GRAD_FULL, CONV_LR_GRAD_COL, CONV_LR_GRAD_DTCOL};
static const char *const route_names[] = {"auto", "full", "col", "dtcol"};

static int out_size(int in, int k, int stride, int padding) { return (in + 2 * padding - k) / stride + 1; }

static bool lr_case_same(const LrCase *k) {
    return k->stride == 1 && k->K == 2 * k->padding + 1;
}

/* The inputs of one case, from a seed; and which of them train. */
typedef struct {
    size_t nx, nw, nb, na, nbb; /* x, w, bias, A, B element counts */
    float *x, *w, *bias, *A, *B, *dy;
    size_t ny_max;              /* dy's length: the unpooled output's */
} LrData;

static void lr_data_init(LrData *D, const LrCase *k, uint64_t seed) {
    const int OH = out_size(k->H, k->K, k->stride, k->padding), OW = out_size(k->W, k->K, k->stride, k->padding);
    D->nx = (size_t)k->N * k->C * k->H * k->W;
    D->nw = (size_t)k->OC * k->C * k->K * k->K;
    D->nb = (size_t)k->OC;
    D->na = (size_t)k->rank * k->C * k->K * k->K;
    D->nbb = (size_t)k->OC * k->rank;
    D->ny_max = (size_t)k->N * k->OC * OH * OW;
    D->x = malloc(D->nx * 4), D->w = malloc(D->nw * 4), D->bias = malloc(D->nb * 4);
    D->A = malloc(D->na * 4), D->B = malloc(D->nbb * 4), D->dy = malloc(D->ny_max * 4);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    rng_fill_normal(&r, D->x, D->nx, 0.0f, 1.0f);
    rng_fill_normal(&r, D->w, D->nw, 0.0f, 0.5f);
    rng_fill_normal(&r, D->bias, D->nb, 0.0f, 0.5f);
    rng_fill_normal(&r, D->A, D->na, 0.0f, 0.5f);
    rng_fill_normal(&r, D->B, D->nbb, 0.0f, 0.5f);
    rng_fill_normal(&r, D->dy, D->ny_max, 0.0f, 1.0f);
}

static void lr_data_free(LrData *D) { free(D->x), free(D->w), free(D->bias), free(D->A), free(D->B), free(D->dy); }

/* What one forward and backward gave; NULL where an input did not train. */
typedef struct {
    size_t ny;
    float *y, *dx, *dw, *db, *dA, *dB;
    ConvLowRankGrad recorded; /* the route the tape node kept */
} LrResult;

static float *copy_grad(const Var *v, size_t n) {
    if (!v->grad) return NULL;
    float *p = malloc(n * 4);
    memcpy(p, v->grad, n * 4);
    return p;
}

static void lr_result_free(LrResult *R) { free(R->y), free(R->dx), free(R->dw), free(R->db), free(R->dA), free(R->dB); }

enum { TRAIN_X = 1, TRAIN_W = 2, TRAIN_BIAS = 4, TRAIN_A = 8, TRAIN_B = 16, TRAIN_ALL = 31 };

/* Forward with route forced, backward from D->dy. false if the op failed. */
static bool lr_run(const LrCase *k, const LrData *D, ConvEpilogue epi, ConvLowRankGrad route, int train, float scale,
                   LrResult *R) {
    memset(R, 0, sizeof *R);
    TestEnv e;
    test_env_init(&e, 1);
    Var *x = test_var(&e, D->x, 4, (const int[]){k->N, k->C, k->H, k->W}, train & TRAIN_X);
    Var *w = test_var(&e, D->w, 4, (const int[]){k->OC, k->C, k->K, k->K}, train & TRAIN_W);
    Var *b = test_var(&e, D->bias, 1, (const int[]){k->OC}, train & TRAIN_BIAS);
    Var *A = test_var(&e, D->A, 4, (const int[]){k->rank, k->C, k->K, k->K}, train & TRAIN_A);
    Var *B = test_var(&e, D->B, 4, (const int[]){k->OC, k->rank, 1, 1}, train & TRAIN_B);
    ConvLowRank lr = {A, B, scale};
    Var *y = conv2d_lowrank_with_grad(&e.tape, x, w, b, &lr, k->stride, k->padding, epi, route);
    bool ok = y && tape_backward_from(&e.tape, y, D->dy) == QT_OK;
    CU_ASSERT(ok);
    if (ok) {
        R->recorded = e.tape.n_nodes ? conv_lowrank_node_grad(&e.tape.nodes[e.tape.n_nodes - 1]) : CONV_LR_GRAD_AUTO;
        R->ny = var_numel(y);
        R->y = malloc(R->ny * 4);
        memcpy(R->y, y->value.data, R->ny * 4);
        R->dx = copy_grad(x, D->nx), R->dw = copy_grad(w, D->nw), R->db = copy_grad(b, D->nb);
        R->dA = copy_grad(A, D->na), R->dB = copy_grad(B, D->nbb);
    }
    test_env_free(&e);
    return ok;
}

static void print_lr_case(const char *what, const LrCase *k, ConvLowRankGrad route, int epi, int train, int threads) {
    fprintf(stderr, "\n  %s: N=%d C=%d H=%d W=%d OC=%d K=%d stride=%d padding=%d rank=%d route=%s epi=%d train=%d "
            "threads=%d", what, k->N, k->C, k->H, k->W, k->OC, k->K, k->stride, k->padding, k->rank,
            route_names[route], epi, train, threads);
}

/* ---- the choice ---------------------------------------------------------------------------------------------- */

static ConvLowRankGrad choose(int N, int C, int H, int W, int OC, int K, int stride, int padding, int rank) {
    ConvDims d = {N, C, H, W, OC, K, K, out_size(H, K, stride, padding), out_size(W, K, stride, padding)};
    return conv_lowrank_grad_choose(&d, rank, stride, padding);
}

/* The reference CNN's conv1 (1 -> 32 channels) goes through the full
 * gradient, its conv2 (32 -> 64) through dt's im2col, a strided or unpadded
 * one through x's; the boundary OC*C*K*K = 2 rank (C*K*K + OC) still takes
 * the full one. */
static void test_choice_follows_sizes(void) {
    CU_ASSERT_EQUAL(choose(128, 1, 28, 28, 32, 3, 1, 1, 8), CONV_LR_GRAD_FULL);
    CU_ASSERT_EQUAL(choose(128, 32, 14, 14, 64, 3, 1, 1, 8), CONV_LR_GRAD_DTCOL);
    CU_ASSERT_EQUAL(choose(128, 32, 14, 14, 64, 3, 2, 1, 8), CONV_LR_GRAD_COL);
    CU_ASSERT_EQUAL(choose(128, 32, 14, 14, 64, 3, 1, 0, 8), CONV_LR_GRAD_COL);
    CU_ASSERT_EQUAL(choose(4, 32, 14, 14, 64, 5, 1, 2, 8), CONV_LR_GRAD_DTCOL);
    CU_ASSERT_EQUAL(choose(4, 1, 8, 8, 18, 3, 1, 1, 3), CONV_LR_GRAD_FULL);  /* 162 = 2*3*27 */
    CU_ASSERT_EQUAL(choose(4, 1, 8, 8, 19, 3, 1, 1, 3), CONV_LR_GRAD_DTCOL); /* 171 > 2*3*28 */
    CU_ASSERT_EQUAL(choose(4, 32, 14, 14, 64, 3, 1, 1, 200), CONV_LR_GRAD_FULL);
}

/* The input x and weight w of case k on e's tape, and its adapter (A, B, scale 1). */
static ConvLowRank lr_vars(TestEnv *e, const LrCase *k, LrData *D, Var **x, Var **w) {
    *x = test_var(e, D->x, 4, (const int[]){k->N, k->C, k->H, k->W}, true);
    *w = test_var(e, D->w, 4, (const int[]){k->OC, k->C, k->K, k->K}, false);
    Var *A = test_var(e, D->A, 4, (const int[]){k->rank, k->C, k->K, k->K}, true);
    Var *B = test_var(e, D->B, 4, (const int[]){k->OC, k->rank, 1, 1}, true);
    return (ConvLowRank){A, B, 1.0f};
}

/* nn_conv2d_fused_lowrank records the chosen route, a forced route is
 * recorded as forced, and the plain convolution records none. */
static void test_routes_recorded(void) {
    const LrCase *k = &lr_cases[0]; /* OC 8, C*K*K 27, rank 2: 216 > 140, "same": dt im2col */
    LrData D;
    lr_data_init(&D, k, 11);
    LrResult R;
    TestEnv e;
    test_env_init(&e, 1);
    Var *x, *w;
    ConvLowRank lr = lr_vars(&e, k, &D, &x, &w);
    CU_ASSERT_PTR_NOT_NULL_FATAL(nn_conv2d_fused_lowrank(&e.tape, x, w, NULL, &lr, 1, 1, CONV_EPI_RELU));
    CU_ASSERT_EQUAL(conv_lowrank_node_grad(&e.tape.nodes[e.tape.n_nodes - 1]), CONV_LR_GRAD_DTCOL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(nn_conv2d_fused(&e.tape, x, w, NULL, 1, 1, CONV_EPI_RELU));
    CU_ASSERT_EQUAL(conv_lowrank_node_grad(&e.tape.nodes[e.tape.n_nodes - 1]), CONV_LR_GRAD_AUTO);
    test_env_free(&e);
    for (size_t r = 0; r < 3; r++)
        if (lr_run(k, &D, CONV_EPI_NONE, routes[r], TRAIN_ALL, 1.0f, &R)) {
            CU_ASSERT_EQUAL(R.recorded, routes[r]);
            lr_result_free(&R);
        }
    lr_data_free(&D);
}

/* The dt-im2col route on a strided convolution is refused, by name. */
static void test_dtcol_needs_same_geometry(void) {
    const LrCase *k = &lr_cases[2];
    LrData D;
    lr_data_init(&D, k, 12);
    TestEnv e;
    test_env_init(&e, 1);
    Var *x, *w;
    ConvLowRank lr = lr_vars(&e, k, &D, &x, &w);
    CU_ASSERT_PTR_NULL(conv2d_lowrank_with_grad(&e.tape, x, w, NULL, &lr, k->stride, k->padding, CONV_EPI_NONE,
                                                CONV_LR_GRAD_DTCOL));
    CU_ASSERT_EQUAL(e.tape.err.status, QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&e.tape.err, "\"same\" stride-1"));
    CU_ASSERT(test_msg_has(&e.tape.err, "stride 2, padding 1"));
    test_env_free(&e);
    lr_data_free(&D);
}

/* ---- against the direct loops -------------------------------------------------------------------------------- */

/* ref = the merged weight w + scale B A, in double. */
static void merged_weight_ref(float *wm, const LrCase *k, const LrData *D, float scale) {
    const size_t ckk = (size_t)k->C * k->K * k->K;
    for (int oc = 0; oc < k->OC; oc++)
        for (size_t j = 0; j < ckk; j++) {
            double acc = 0.0;
            for (int i = 0; i < k->rank; i++) acc += (double)D->B[(size_t)oc * k->rank + i] * D->A[i * ckk + j];
            wm[oc * ckk + j] = (float)(D->w[oc * ckk + j] + scale * acc);
        }
}

/* With G the merged weight's gradient from conv2d_backward_ref, dA = scale
 * B^T G and dB = scale G A^T, in double. */
static void lowrank_grads_ref(float *dA, float *dB, const float *G, const LrCase *k, const LrData *D, float scale) {
    const size_t ckk = (size_t)k->C * k->K * k->K;
    for (int i = 0; i < k->rank; i++)
        for (size_t j = 0; j < ckk; j++) {
            double acc = 0.0;
            for (int oc = 0; oc < k->OC; oc++) acc += (double)D->B[(size_t)oc * k->rank + i] * G[oc * ckk + j];
            dA[i * ckk + j] = (float)(scale * acc);
        }
    for (int oc = 0; oc < k->OC; oc++)
        for (int i = 0; i < k->rank; i++) {
            double acc = 0.0;
            for (size_t j = 0; j < ckk; j++) acc += (double)G[oc * ckk + j] * D->A[i * ckk + j];
            dB[(size_t)oc * k->rank + i] = (float)(scale * acc);
        }
}

static void test_every_route_matches_ref(void) {
    const float scale = 1.5f;
    for (size_t c = 0; c < N_LR_CASES; c++) {
        const LrCase *k = &lr_cases[c];
        LrData D;
        lr_data_init(&D, k, 100 + c);
        float *wm = malloc(D.nw * 4), *y = malloc(D.ny_max * 4);
        float *dx = calloc(D.nx, 4), *G = calloc(D.nw, 4), *db = calloc(D.nb, 4);
        float *dA = malloc(D.na * 4), *dB = malloc(D.nbb * 4);
        merged_weight_ref(wm, k, &D, scale);
        conv2d_forward_ref(y, D.x, wm, D.bias, k->N, k->C, k->H, k->W, k->OC, k->K, k->K, k->stride, k->padding);
        conv2d_backward_ref(dx, G, db, D.dy, D.x, wm, k->N, k->C, k->H, k->W, k->OC, k->K, k->K, k->stride,
                            k->padding);
        lowrank_grads_ref(dA, dB, G, k, &D, scale);
        for (int threads = 1; threads <= 2; threads++) {
            gemm_set_threads(threads);
            for (size_t r = 0; r < 3; r++) {
                if (routes[r] == CONV_LR_GRAD_DTCOL && !lr_case_same(k)) continue;
                LrResult R;
                if (!lr_run(k, &D, CONV_EPI_NONE, routes[r], TRAIN_ALL, scale, &R)) continue;
                size_t fails = CU_get_number_of_failures();
                CU_ASSERT_EQUAL(R.ny, D.ny_max);
                ASSERT_ALL_CLOSE(R.y, y, D.ny_max, 1e-5, 1e-5);
                ASSERT_ALL_CLOSE(R.dx, dx, D.nx, 1e-5, 1e-5);
                ASSERT_ALL_CLOSE(R.dw, G, D.nw, 1e-4, 1e-5);
                ASSERT_ALL_CLOSE(R.db, db, D.nb, 1e-4, 1e-5);
                ASSERT_ALL_CLOSE(R.dA, dA, D.na, 1e-4, 1e-5);
                ASSERT_ALL_CLOSE(R.dB, dB, D.nbb, 1e-4, 1e-5);
                if (CU_get_number_of_failures() != fails) print_lr_case("against ref", k, routes[r], 0, 31, threads);
                lr_result_free(&R);
            }
        }
        gemm_set_threads(1);
        free(wm), free(y), free(dx), free(G), free(db), free(dA), free(dB);
        lr_data_free(&D);
    }
}

/* ---- against each other ---------------------------------------------------------------------------------------- */

/* b's gradient against a's where a has one; both NULL or both set. */
static void expect_close_or_both_null(const float *a, const float *b, size_t n) {
    CU_ASSERT_EQUAL(a == NULL, b == NULL);
    if (a && b) ASSERT_ALL_CLOSE(b, a, n, 1e-5, 1e-5);
}

/* Every route on every epilogue, for a LoRA step (w frozen), a full one,
 * only A or only B training, and the input alone: the output is the same
 * bits whatever the route, the gradients agree to rounding. */
static void test_routes_agree(void) {
    static const int trains[] = {TRAIN_X | TRAIN_A | TRAIN_B, TRAIN_ALL, TRAIN_A, TRAIN_B | TRAIN_BIAS, TRAIN_X,
                                 TRAIN_W | TRAIN_B};
    for (size_t c = 0; c < N_LR_CASES; c++) {
        const LrCase *k = &lr_cases[c];
        LrData D;
        lr_data_init(&D, k, 200 + c);
        for (int epi = CONV_EPI_NONE; epi <= CONV_EPI_RELU_MAXPOOL2; epi++)
            for (size_t t = 0; t < sizeof trains / sizeof *trains; t++) {
                const int threads = 1 + (int)((c + t) % 2);
                gemm_set_threads(threads);
                LrResult first;
                if (!lr_run(k, &D, (ConvEpilogue)epi, routes[0], trains[t], 0.75f, &first)) continue;
                for (size_t r = 1; r < 3; r++) {
                    if (routes[r] == CONV_LR_GRAD_DTCOL && !lr_case_same(k)) continue;
                    LrResult R;
                    if (!lr_run(k, &D, (ConvEpilogue)epi, routes[r], trains[t], 0.75f, &R)) continue;
                    size_t fails = CU_get_number_of_failures();
                    CU_ASSERT(R.ny == first.ny && memcmp(R.y, first.y, R.ny * 4) == 0);
                    expect_close_or_both_null(first.dx, R.dx, D.nx);
                    expect_close_or_both_null(first.dw, R.dw, D.nw);
                    expect_close_or_both_null(first.db, R.db, D.nb);
                    expect_close_or_both_null(first.dA, R.dA, D.na);
                    expect_close_or_both_null(first.dB, R.dB, D.nbb);
                    if (CU_get_number_of_failures() != fails)
                        print_lr_case("against the full route", k, routes[r], epi, trains[t], threads);
                    lr_result_free(&R);
                }
                lr_result_free(&first);
            }
        gemm_set_threads(1);
        lr_data_free(&D);
    }
}

/* ---- finite differences ---------------------------------------------------------------------------------------- */

typedef struct {
    int stride, padding;
    ConvEpilogue epi;
    ConvLowRankGrad route;
} LrArgs;

static Var *lowrank_route_fn(Tape *t, Var **in, void *ctx) {
    const LrArgs *a = ctx;
    ConvLowRank lr = {in[3], in[4], 0.75f};
    return conv2d_lowrank_with_grad(t, in[0], in[1], in[2], &lr, a->stride, a->padding, a->epi, a->route);
}

static void test_every_route_gradcheck(void) {
    for (size_t c = 0; c < N_LR_CASES; c++) {
        const LrCase *k = &lr_cases[c];
        LrData D;
        lr_data_init(&D, k, 300 + c);
        for (size_t r = 0; r < 3; r++) {
            if (routes[r] == CONV_LR_GRAD_DTCOL && !lr_case_same(k)) continue;
            /* the relu's kinks sit away from the probes only with luck: the
             * epilogues' own gradients are checked in nn_parallel. Without
             * one the output is linear in each input, so a longer step costs
             * no truncation error and divides the float rounding of the
             * forward's sums (which changes with the sgemm kernel) by 10:
             * at 1e-3 it reached the tolerance on one CPU. */
            LrArgs a = {k->stride, k->padding, CONV_EPI_NONE, routes[r]};
            GradcheckInput in[5] = {{D.x, 4, {k->N, k->C, k->H, k->W}, true},
                                    {D.w, 4, {k->OC, k->C, k->K, k->K}, true},
                                    {D.bias, 1, {k->OC}, true},
                                    {D.A, 4, {k->rank, k->C, k->K, k->K}, true},
                                    {D.B, 4, {k->OC, k->rank, 1, 1}, true}};
            bool ok = gradcheck("conv2d low rank", lowrank_route_fn, &a, in, 5, 1e-2, 2e-3, 1e-2);
            if (!ok) print_lr_case("gradcheck", k, routes[r], 0, 31, 1);
            CU_ASSERT(ok);
        }
        lr_data_free(&D);
    }
}

int register_nn_conv_lowrank_suite(void) {
    CU_pSuite s = CU_add_suite("nn_conv_lowrank", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "the route follows the sizes", test_choice_follows_sizes) ||
           !CU_add_test(s, "the route is recorded, forced or chosen", test_routes_recorded) ||
           !CU_add_test(s, "dt im2col only on a \"same\" stride-1 conv", test_dtcol_needs_same_geometry) ||
           !CU_add_test(s, "every route matches the direct loops", test_every_route_matches_ref) ||
           !CU_add_test(s, "the routes agree on every epilogue", test_routes_agree) ||
           !CU_add_test(s, "every route: finite differences", test_every_route_gradcheck);
}
