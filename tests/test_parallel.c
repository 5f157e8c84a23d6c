/* test_parallel.c - the thread pool, products split over it, and the fused
 * convolution blocks (which use both). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "nn/gemm.h"
#include "nn/ops.h"
#include "base/parallel.h"
#include "base/rng.h"
#include "test_util.h"

/* ---- the pool ------------------------------------------------------------ */

typedef struct {
    atomic_int runs[97];     /* per task */
    atomic_int bad_index;    /* thread index out of range */
    atomic_int nested_runs;  /* tasks of jobs started inside a task */
    atomic_int nested_not_serial;
    int threads;
} PoolProbe;

static void nested_task(void *ctx, int task, int n_tasks) {
    PoolProbe *p = ctx;
    (void)task, (void)n_tasks;
    atomic_fetch_add(&p->nested_runs, 1);
    if (!parallel_in_task()) atomic_fetch_add(&p->nested_not_serial, 1);
}

static void probe_task(void *ctx, int task, int n_tasks) {
    PoolProbe *p = ctx;
    atomic_fetch_add(&p->runs[task], 1);
    int ix = parallel_thread_index();
    if (ix < 0 || ix >= p->threads || !parallel_in_task() || n_tasks != 97) atomic_fetch_add(&p->bad_index, 1);
    if (task % 10 == 0) parallel_run(3, nested_task, p);
}

static void test_pool_runs_every_task_once(void) {
    const int counts[] = {2, 3, 1, 2};
    for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
        CU_ASSERT_EQUAL(parallel_set_threads(counts[c]), counts[c]);
        CU_ASSERT_EQUAL(parallel_get_threads(), counts[c]);
        for (int rep = 0; rep < 50; rep++) { /* many jobs back to back: no straggler mixes two */
            static PoolProbe p;
            memset(&p, 0, sizeof p);
            p.threads = counts[c];
            parallel_run(97, probe_task, &p);
            int once = 0;
            for (int i = 0; i < 97; i++) once += atomic_load(&p.runs[i]) == 1;
            CU_ASSERT_EQUAL(once, 97);
            CU_ASSERT_EQUAL(atomic_load(&p.bad_index), 0);
            CU_ASSERT_EQUAL(atomic_load(&p.nested_runs), 10 * 3);
            CU_ASSERT_EQUAL(atomic_load(&p.nested_not_serial), 0);
        }
        CU_ASSERT(!parallel_in_task());
        CU_ASSERT_EQUAL(parallel_thread_index(), 0);
    }
    parallel_set_threads(1);
}

static void test_pool_range_partitions(void) {
    const int ns[] = {0, 1, 7, 128, 1000};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
        for (int tasks = 1; tasks <= 5; tasks++) {
            int expect = 0;
            for (int t = 0; t < tasks; t++) {
                int lo, hi;
                parallel_range(ns[i], t, tasks, &lo, &hi);
                CU_ASSERT_EQUAL(lo, expect);
                CU_ASSERT(hi >= lo && hi - lo <= ns[i] / tasks + 1);
                expect = hi;
            }
            CU_ASSERT_EQUAL(expect, ns[i]);
        }
}

/* ---- gemm over the pool ------------------------------------------------------ */

/* Products big enough to be split (over 4 MFLOP), in every transpose, with
 * leading dimensions wider than the matrices: each part must address its
 * band through them. */
static void test_gemm_split_matches_ref(void) {
    gemm_set_threads(2);
    const struct {
        int M, N, K;
    } shapes[] = {{128, 96, 300}, {40, 700, 150}, {257, 33, 301}};
    Rng r;
    rng_init(&r, 4242, RNG_STREAM_INIT);
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                const int M = shapes[s].M, N = shapes[s].N, K = shapes[s].K;
                const int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 7;
                size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb, nc = (size_t)M * ldc;
                float *a = malloc(na * sizeof *a), *b = malloc(nb * sizeof *b);
                float *c = malloc(nc * sizeof *c), *c_ref = malloc(nc * sizeof *c);
                CU_ASSERT_PTR_NOT_NULL_FATAL(a && b && c && c_ref);
                rng_fill_normal(&r, a, na, 0.0f, 1.0f);
                rng_fill_normal(&r, b, nb, 0.0f, 1.0f);
                rng_fill_normal(&r, c, nc, 0.0f, 1.0f);
                memcpy(c_ref, c, nc * sizeof *c);
                gemm_f32(ta, tb, M, N, K, 0.5f, a, lda, b, ldb, 0.25f, c, ldc);
                gemm_f32_ref(ta, tb, M, N, K, 0.5f, a, lda, b, ldb, 0.25f, c_ref, ldc);
                /* K <= 301 float products of N(0,1) values: ~1e-5 absolute error at most */
                ASSERT_ALL_CLOSE(c, c_ref, nc, 1e-4, 1e-5);
                free(a), free(b), free(c), free(c_ref);
            }
    gemm_set_threads(1);
}

/* ---- fused convolution blocks ------------------------------------------------ */

typedef struct {
    int N, C, H, W, OC, K, stride, padding;
} BlockCase;

static const BlockCase block_cases[] = {
    {3, 2, 8, 6, 4, 3, 1, 1},  /* "same" conv: the shifted-plane im2col */
    {2, 3, 7, 5, 5, 3, 1, 1},  /* odd output: the last row and column belong to no window */
    {2, 2, 9, 9, 3, 3, 2, 0},  /* stride 2, no padding: the generic im2col */
    {1, 1, 2, 2, 2, 3, 1, 1},  /* a single 2x2 window */
    {40, 1, 6, 6, 3, 3, 1, 1}, /* many samples: several chunks per task */
    {2, 2, 14, 14, 3, 3, 1, 1}, /* 7 windows a row: a group of four and an overlapping one */
    {2, 1, 17, 27, 2, 3, 1, 1}, /* odd sizes with groups of four: 13 windows a row, 8 rows */
    /* With the rank-2 term of the low-rank tests, the cases above take A's and
     * B's gradients from the full weight gradient, except {2, 3, 7, 5, 5}; these
     * take the adapter's own products: */
    {2, 4, 9, 9, 6, 3, 2, 0},   /* stride 2: dA as dt col^T */
    {40, 3, 12, 12, 5, 3, 1, 1}, /* "same": dA as x dtcol^T, over several chunks per task */
};

/* Runs the block fused and as separate ops on the same inputs; returns
 * whether values and gradients agree (values, dx and dw bit for bit; the
 * bias gradient is summed in another order, so to 1e-6). */
static bool block_agrees(const BlockCase *k, ConvEpilogue epi, uint64_t seed) {
    Var *out[2], *x[2], *w[2], *b[2];
    TestEnv e[2];
    Rng r;
    const int xs[] = {k->N, k->C, k->H, k->W}, ws[] = {k->OC, k->C, k->K, k->K};
    size_t nx = (size_t)k->N * k->C * k->H * k->W, nw = (size_t)k->OC * k->C * k->K * k->K;
    float *xv = malloc(nx * sizeof *xv), *wv = malloc(nw * sizeof *wv), *bv = malloc((size_t)k->OC * sizeof *bv);
    rng_init(&r, seed, RNG_STREAM_INIT);
    rng_fill_normal(&r, xv, nx, 0.0f, 1.0f);
    rng_fill_normal(&r, wv, nw, 0.0f, 0.5f);
    rng_fill_normal(&r, bv, (size_t)k->OC, 0.0f, 0.5f);
    for (int v = 0; v < 2; v++) {
        test_env_init(&e[v], seed);
        x[v] = test_var(&e[v], xv, 4, xs, true);
        w[v] = test_var(&e[v], wv, 4, ws, true);
        b[v] = test_var(&e[v], bv, 1, &k->OC, true);
        Tape *t = &e[v].tape;
        if (v == 0) {
            out[v] = nn_conv2d_fused(t, x[v], w[v], b[v], k->stride, k->padding, epi);
        } else {
            Var *y = nn_conv2d(t, x[v], w[v], b[v], k->stride, k->padding);
            if (epi != CONV_EPI_NONE) y = nn_relu(t, y);
            out[v] = epi == CONV_EPI_RELU_MAXPOOL2 ? nn_maxpool2d(t, y, 2, 2) : y;
        }
        CU_ASSERT_PTR_NOT_NULL_FATAL(out[v]);
        /* L = mean((out - R)^2), R the same fixed target for both */
        Rng rr;
        rng_init(&rr, seed + 1, RNG_STREAM_INIT);
        size_t n = var_numel(out[v]);
        float *proj = tape_alloc(t, n * sizeof *proj);
        rng_fill_normal(&rr, proj, n, 0.0f, 1.0f);
        Var *p = test_var(&e[v], proj, out[v]->value.ndim, out[v]->value.shape, false);
        Var *loss = nn_mse(t, out[v], p);
        CU_ASSERT_EQUAL_FATAL(tape_backward(t, loss), QT_OK);
    }
    bool ok = var_numel(out[0]) == var_numel(out[1]) &&
              memcmp(out[0]->value.data, out[1]->value.data, var_numel(out[0]) * sizeof(float)) == 0 &&
              memcmp(x[0]->grad, x[1]->grad, nx * sizeof(float)) == 0 &&
              memcmp(w[0]->grad, w[1]->grad, nw * sizeof(float)) == 0 &&
              test_close_ratio(b[0]->grad, b[1]->grad, (size_t)k->OC, 1e-6, 1e-6, NULL) <= 1.0;
    for (int v = 0; v < 2; v++) test_env_free(&e[v]);
    free(xv), free(wv), free(bv);
    return ok;
}

static void test_fused_blocks_equal_separate_ops(void) {
    const int threads[] = {1, 2};
    for (size_t th = 0; th < 2; th++) {
        gemm_set_threads(threads[th]);
        for (size_t i = 0; i < sizeof block_cases / sizeof *block_cases; i++)
            for (int epi = CONV_EPI_NONE; epi <= CONV_EPI_RELU_MAXPOOL2; epi++) {
                bool ok = block_agrees(&block_cases[i], (ConvEpilogue)epi, 900 + i);
                if (!ok) fprintf(stderr, "\n  block case %zu epilogue %d, %d threads differs\n", i, epi, threads[th]);
                CU_ASSERT(ok);
            }
    }
    gemm_set_threads(1);
}

/* On two threads the convolution still matches the direct loops. */
static void test_conv_two_threads_matches_ref(void) {
    gemm_set_threads(2);
    const BlockCase *k = &block_cases[4];
    TestEnv e;
    test_env_init(&e, 77);
    Rng r;
    rng_init(&r, 78, RNG_STREAM_INIT);
    const int xs[] = {k->N, k->C, k->H, k->W}, ws[] = {k->OC, k->C, k->K, k->K};
    size_t nx = (size_t)k->N * k->C * k->H * k->W, nw = (size_t)k->OC * k->C * k->K * k->K;
    float *xv = tape_alloc(&e.tape, nx * 4), *wv = tape_alloc(&e.tape, nw * 4);
    rng_fill_normal(&r, xv, nx, 0.0f, 1.0f);
    rng_fill_normal(&r, wv, nw, 0.0f, 1.0f);
    Var *x = test_var(&e, xv, 4, xs, true), *w = test_var(&e, wv, 4, ws, true);
    Var *y = nn_conv2d(&e.tape, x, w, NULL, k->stride, k->padding);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    size_t ny = var_numel(y);
    float *y_ref = tape_alloc(&e.tape, ny * 4), *dx_ref = calloc(nx, 4), *dw_ref = calloc(nw, 4);
    conv2d_forward_ref(y_ref, xv, wv, NULL, k->N, k->C, k->H, k->W, k->OC, k->K, k->K, k->stride, k->padding);
    ASSERT_ALL_CLOSE(y->value.data, y_ref, ny, 1e-5, 1e-5);
    /* mse against a zero target: dy = 2 y / n */
    float *zeros = calloc(ny, 4), *dy = tape_alloc(&e.tape, ny * 4);
    Var *loss = nn_mse(&e.tape, y, test_var(&e, zeros, 4, y->value.shape, false));
    CU_ASSERT_EQUAL_FATAL(tape_backward(&e.tape, loss), QT_OK);
    for (size_t i = 0; i < ny; i++) dy[i] = 2.0f * y->value.data[i] / (float)ny;
    free(zeros);
    conv2d_backward_ref(dx_ref, dw_ref, NULL, dy, xv, wv, k->N, k->C, k->H, k->W, k->OC, k->K, k->K, k->stride,
                        k->padding);
    ASSERT_ALL_CLOSE(x->grad, dx_ref, nx, 1e-6, 1e-4);
    ASSERT_ALL_CLOSE(w->grad, dw_ref, nw, 1e-6, 1e-4); /* sums of 40*36 products */
    free(dx_ref), free(dw_ref);
    test_env_free(&e);
    gemm_set_threads(1);
}

typedef struct {
    int stride, padding;
    ConvEpilogue epi;
} FusedArgs;

static Var *fused_fn(Tape *t, Var **in, void *ctx) {
    const FusedArgs *a = ctx;
    return nn_conv2d_fused(t, in[0], in[1], in[2], a->stride, a->padding, a->epi);
}

/* Finite differences through the relu and the pooling. The seed is one
 * whose outputs sit clear of relu's kink and of pooling ties (a +-1e-3
 * nudge would otherwise change which side is taken). */
static void test_fused_gradcheck(void) {
    const BlockCase *k = &block_cases[0];
    for (int epi = CONV_EPI_RELU; epi <= CONV_EPI_RELU_MAXPOOL2; epi++) {
        Rng r;
        rng_init(&r, 41 + epi, RNG_STREAM_INIT);
        const int xs[] = {k->N, k->C, k->H, k->W}, ws[] = {k->OC, k->C, k->K, k->K};
        size_t nx = (size_t)k->N * k->C * k->H * k->W, nw = (size_t)k->OC * k->C * k->K * k->K;
        float *x = malloc(nx * 4), *w = malloc(nw * 4), *b = malloc((size_t)k->OC * 4);
        rng_fill_normal(&r, x, nx, 0.0f, 1.0f);
        rng_fill_normal(&r, w, nw, 0.0f, 1.0f);
        rng_fill_normal(&r, b, (size_t)k->OC, 0.0f, 1.0f);
        GradcheckInput in[3] = {{x, 4, {xs[0], xs[1], xs[2], xs[3]}, true},
                                {w, 4, {ws[0], ws[1], ws[2], ws[3]}, true},
                                {b, 1, {k->OC}, true}};
        FusedArgs a = {k->stride, k->padding, (ConvEpilogue)epi};
        bool ok = gradcheck(epi == CONV_EPI_RELU ? "conv2d+relu" : "conv2d+relu+maxpool2d", fused_fn, &a, in, 3,
                            1e-3, 2e-3, 1e-2);
        CU_ASSERT(ok);
        free(x), free(w), free(b);
    }
}

/* The low-rank form against the adapter spelled out as ops: base conv +
 * scale * conv(conv(x, A), B), then relu and pooling. Rounding differs (the
 * adapter is added before the bias), so values and gradients are close, not
 * equal; with B = 0 the output is the base block's bit for bit. */
static void lowrank_case(const BlockCase *k, ConvEpilogue epi, bool zero_b, int threads, uint64_t seed) {
    gemm_set_threads(threads);
    const int rank = 2;
    const int xs[] = {k->N, k->C, k->H, k->W}, ws[] = {k->OC, k->C, k->K, k->K};
    const int as[] = {rank, k->C, k->K, k->K}, bs[] = {k->OC, rank, 1, 1};
    size_t nx = (size_t)k->N * k->C * k->H * k->W, nw = (size_t)k->OC * k->C * k->K * k->K;
    size_t na = (size_t)rank * k->C * k->K * k->K, nb = (size_t)k->OC * rank;
    float *xv = malloc(nx * 4), *wv = malloc(nw * 4), *av = malloc(na * 4), *bv = malloc(nb * 4);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    rng_fill_normal(&r, xv, nx, 0.0f, 1.0f);
    rng_fill_normal(&r, wv, nw, 0.0f, 0.5f);
    rng_fill_normal(&r, av, na, 0.0f, 0.5f);
    rng_fill_normal(&r, bv, nb, 0.0f, zero_b ? 0.0f : 0.5f);
    TestEnv e[2];
    Var *out[2], *x[2], *a[2], *b[2];
    for (int v = 0; v < 2; v++) {
        test_env_init(&e[v], seed);
        Tape *t = &e[v].tape;
        x[v] = test_var(&e[v], xv, 4, xs, true);
        Var *w = test_var(&e[v], wv, 4, ws, false); /* frozen, as under LoRA */
        a[v] = test_var(&e[v], av, 4, as, true);
        b[v] = test_var(&e[v], bv, 4, bs, true);
        if (v == 0) {
            ConvLowRank lr = {a[v], b[v], 1.5f};
            out[v] = nn_conv2d_fused_lowrank(t, x[v], w, NULL, &lr, k->stride, k->padding, epi);
        } else {
            Var *base = nn_conv2d(t, x[v], w, NULL, k->stride, k->padding);
            Var *u = nn_conv2d(t, nn_conv2d(t, x[v], a[v], NULL, k->stride, k->padding), b[v], NULL, 1, 0);
            Var *y = nn_add(t, base, nn_scale(t, u, 1.5f));
            if (epi != CONV_EPI_NONE) y = nn_relu(t, y);
            out[v] = epi == CONV_EPI_RELU_MAXPOOL2 ? nn_maxpool2d(t, y, 2, 2) : y;
        }
        CU_ASSERT_PTR_NOT_NULL_FATAL(out[v]);
        float *zeros = tape_alloc(t, var_numel(out[v]) * 4);
        memset(zeros, 0, var_numel(out[v]) * 4);
        Var *loss = nn_mse(t, out[v], test_var(&e[v], zeros, 4, out[v]->value.shape, false));
        CU_ASSERT_EQUAL_FATAL(tape_backward(t, loss), QT_OK);
    }
    size_t ny = var_numel(out[0]);
    ASSERT_ALL_CLOSE(out[0]->value.data, out[1]->value.data, ny, 1e-5, 1e-5);
    ASSERT_ALL_CLOSE(x[0]->grad, x[1]->grad, nx, 1e-6, 1e-4);
    ASSERT_ALL_CLOSE(a[0]->grad, a[1]->grad, na, 1e-6, 1e-4);
    ASSERT_ALL_CLOSE(b[0]->grad, b[1]->grad, nb, 1e-6, 1e-4);
    if (zero_b) { /* B = 0: exactly the base block */
        TestEnv eb;
        test_env_init(&eb, seed);
        Var *w = test_var(&eb, wv, 4, ws, false);
        Var *yb = nn_conv2d_fused(&eb.tape, test_var(&eb, xv, 4, xs, false), w, NULL, k->stride, k->padding, epi);
        CU_ASSERT(yb && memcmp(yb->value.data, out[0]->value.data, ny * 4) == 0);
        test_env_free(&eb);
    }
    for (int v = 0; v < 2; v++) test_env_free(&e[v]);
    free(xv), free(wv), free(av), free(bv);
    gemm_set_threads(1);
}

static void test_lowrank_matches_adapter_ops(void) {
    for (size_t i = 0; i < sizeof block_cases / sizeof *block_cases; i++)
        for (int epi = CONV_EPI_NONE; epi <= CONV_EPI_RELU_MAXPOOL2; epi++) {
            lowrank_case(&block_cases[i], (ConvEpilogue)epi, false, 1 + (int)(i % 2), 1300 + i);
            lowrank_case(&block_cases[i], (ConvEpilogue)epi, true, 1, 1400 + i);
        }
}

static Var *lowrank_fn(Tape *t, Var **in, void *ctx) {
    const FusedArgs *f = ctx;
    ConvLowRank lr = {in[2], in[3], 0.75f};
    return nn_conv2d_fused_lowrank(t, in[0], in[1], NULL, &lr, f->stride, f->padding, CONV_EPI_NONE);
}

/* Every input trainable, the weight too, so each backward path of the
 * low-rank term runs beside a weight gradient: OC 3 takes A's and B's
 * gradients from the full one; OC 6 its own products, "same" (x dtcol^T)
 * and strided (dt col^T). */
static void test_lowrank_gradcheck(void) {
    static const struct {
        int OC, H, W, stride, padding;
    } cases[] = {{3, 5, 4, 1, 1}, {6, 5, 4, 1, 1}, {6, 7, 6, 2, 0}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const int OC = cases[k].OC, H = cases[k].H, W = cases[k].W;
        Rng r;
        rng_init(&r, 99 + k, RNG_STREAM_INIT);
        float x[2 * 2 * 7 * 6], w[6 * 2 * 3 * 3], a[2 * 2 * 3 * 3], b[6 * 2];
        rng_fill_normal(&r, x, sizeof x / 4, 0.0f, 1.0f);
        rng_fill_normal(&r, w, sizeof w / 4, 0.0f, 1.0f);
        rng_fill_normal(&r, a, sizeof a / 4, 0.0f, 1.0f);
        rng_fill_normal(&r, b, sizeof b / 4, 0.0f, 1.0f);
        GradcheckInput in[4] = {{x, 4, {2, 2, H, W}, true}, {w, 4, {OC, 2, 3, 3}, true},
                                {a, 4, {2, 2, 3, 3}, true}, {b, 4, {OC, 2, 1, 1}, true}};
        FusedArgs f = {cases[k].stride, cases[k].padding, CONV_EPI_NONE};
        CU_ASSERT(gradcheck("conv2d low rank", lowrank_fn, &f, in, 4, 1e-3, 2e-3, 1e-2));
    }
}

static void test_fused_pool_too_small(void) {
    TestEnv e;
    test_env_init(&e, 5);
    float v[4] = {1, 2, 3, 4};
    Var *x = test_var(&e, v, 4, (const int[]){1, 1, 1, 4}, false);
    Var *w = test_var(&e, v, 4, (const int[]){1, 1, 1, 1}, false);
    CU_ASSERT_PTR_NULL(nn_conv2d_fused(&e.tape, x, w, NULL, 1, 0, CONV_EPI_RELU_MAXPOOL2));
    CU_ASSERT_EQUAL(e.tape.err.status, QT_ERR_SHAPE);
    CU_ASSERT_PTR_NOT_NULL(strstr(e.tape.err.msg, "2x2 pooling window"));
    test_env_free(&e);
}


/* add over the pool (above 2^16 elements): y = a + b exactly, and the backward's accumulation dx += dy (a input
 * used twice), the same on 1 and 2 threads. */
static void test_add_threads_agree(void) {
    enum { N = 6, C = 16, H = 28, W = 28 }; /* 75,264 elements */
    const size_t n = (size_t)N * C * H * W;
    float *a = malloc(n * 4), *b = malloc(n * 4), *y[2], *ga[2];
    CU_ASSERT_FATAL(a && b);
    Rng r;
    rng_init(&r, 81, RNG_STREAM_INIT);
    rng_fill_normal(&r, a, n, 0.0f, 1.0f);
    rng_fill_normal(&r, b, n, 0.0f, 1.0f);
    const int before = parallel_get_threads();
    for (int th = 0; th < 2; th++) {
        parallel_set_threads(th + 1);
        TestEnv e;
        test_env_init(&e, 3);
        Var *av = test_var(&e, a, 4, (const int[]){N, C, H, W}, true);
        Var *bv = test_var(&e, b, 4, (const int[]){N, C, H, W}, true);
        Var *s1 = nn_add(&e.tape, av, bv), *s2 = nn_add(&e.tape, s1, av); /* a twice: its gradient accumulates */
        CU_ASSERT_FATAL(s2 && tape_backward_from(&e.tape, s2, b) == QT_OK);
        for (size_t i = 0; i < n; i++)
            if (s1->value.data[i] != a[i] + b[i] || av->grad[i] != b[i] + b[i]) {
                CU_FAIL("add or its gradient differs from the elementwise definition");
                break;
            }
        y[th] = malloc(n * 4), ga[th] = malloc(n * 4);
        CU_ASSERT_FATAL(y[th] && ga[th]);
        memcpy(y[th], s2->value.data, n * 4), memcpy(ga[th], av->grad, n * 4);
        test_env_free(&e);
    }
    parallel_set_threads(before);
    CU_ASSERT(memcmp(y[0], y[1], n * 4) == 0 && memcmp(ga[0], ga[1], n * 4) == 0);
    free(a), free(b), free(y[0]), free(y[1]), free(ga[0]), free(ga[1]);
}

int register_nn_parallel_suite(void) {
    CU_pSuite s = CU_add_suite("nn_parallel", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "pool runs every task once, nested jobs serially", test_pool_runs_every_task_once) ||
           !CU_add_test(s, "task ranges partition", test_pool_range_partitions) ||
           !CU_add_test(s, "gemm split over two threads matches ref", test_gemm_split_matches_ref) ||
           !CU_add_test(s, "fused conv blocks equal the separate ops", test_fused_blocks_equal_separate_ops) ||
           !CU_add_test(s, "conv on two threads matches ref", test_conv_two_threads_matches_ref) ||
           !CU_add_test(s, "fused conv blocks: finite differences", test_fused_gradcheck) ||
           !CU_add_test(s, "low-rank conv equals the adapter as ops", test_lowrank_matches_adapter_ops) ||
           !CU_add_test(s, "low-rank conv: finite differences", test_lowrank_gradcheck) ||
           !CU_add_test(s, "fused pool on a too small output", test_fused_pool_too_small) ||
           !CU_add_test(s, "add: the definition's values, the same on 1 and 2 threads", test_add_threads_agree);
}
