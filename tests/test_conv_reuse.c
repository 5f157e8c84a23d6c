/* test_conv_reuse.c - the plain convolution's step memory: its im2col scratch and gradient partials are handed
 * back to the tape after each pass, so a chain of convolutions grows the arena by its activations and
 * gradients, not by one scratch per convolution; and an input gradient the convolution is first to reach is
 * written into an uninitialised (recycled) buffer with the bits of the add into zeros. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/conv_taps.h"
#include "nn/ops.h"
#include "nn/ops_conv_internal.h"
#include "test_util.h"

/* DEPTH "same" 3x3 convolutions of C channels, weights and biases trained. Per convolution the forward's
 * scratch (im2col and product of a chunk, ~half an activation here) and the backward's (the same, plus the dW
 * partials) used to come from the arena anew; now one of each serves the whole chain. */
static void test_conv_scratch_reused(void) {
    enum { N = 64, C = 8, HW = 16, DEPTH = 6, NX = N * C * HW * HW, NW = C * C * 9 };
    const int shape[4] = {N, C, HW, HW};
    const int threads = parallel_get_threads();
    parallel_set_threads(1); /* one scratch slot: the sizes below are per thread */
    float *x0 = test_random_uniform(NX, 11, -1.0f, 1.0f), *dy = test_random_uniform(NX, 12, -1.0f, 1.0f);
    float *w0 = test_random_uniform((size_t)DEPTH * NW, 13, -0.2f, 0.2f), *b0 = test_random_uniform((size_t)DEPTH * C, 14, -0.1f, 0.1f);
    const size_t act = NX * sizeof(float);
    TestEnv e;
    test_env_init(&e, 3);
    Var *x = test_var(&e, x0, 4, shape, true), *h = x, *w[DEPTH], *b[DEPTH];
    for (int d = 0; d < DEPTH; d++) {
        w[d] = test_var(&e, w0 + (size_t)d * NW, 4, (int[]){C, C, 3, 3}, true);
        b[d] = test_var(&e, b0 + (size_t)d * C, 1, (int[]){C}, true);
    }
    size_t before = e.arena.used;
    for (int d = 0; d < DEPTH; d++) h = nn_conv2d(&e.tape, h, w[d], b[d], 1, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(h);
    const size_t fwd = e.arena.used - before;
    before = e.arena.used;
    CU_ASSERT_FATAL(tape_backward_from(&e.tape, h, dy) == QT_OK);
    const size_t bwd = e.arena.used - before;
    /* forward: the outputs and one scratch (without reuse: DEPTH * ~1.5 activations) */
    CU_ASSERT(fwd <= (size_t)(DEPTH + 1) * act);
    /* backward: the seed, x's gradient, one live gradient between them, one scratch, the small gradients
     * (without reuse: DEPTH scratches and dW partials more) */
    CU_ASSERT(bwd <= 4 * act);
    if (fwd > (size_t)(DEPTH + 1) * act || bwd > 4 * act)
        fprintf(stderr, "\n  forward grew %.2f, backward %.2f activations\n", (double)fwd / act, (double)bwd / act);
    test_env_free(&e);
    parallel_set_threads(threads);
    free(x0), free(dy), free(w0), free(b0);
}

typedef struct {
    int C, OC, H, W, K, stride, padding;
    ConvEpilogue epi;
    int rank; /* > 0: with a low-rank term */
} ConvCase;

/* Hands back, filled with NaN, a buffer of each of the sizes the backward asks for first (the output's
 * gradient, then x's), so an uninitialised gradient comes from one: an entry the write path missed shows. */
static void poison_free_buffers(Tape *t, const Var *x, const Var *y) {
    const Var *like[2] = {y, x};
    for (int k = 0; k < 2; k++) {
        Var *v = tape_new_var(t, like[k]->value.ndim, like[k]->value.shape);
        for (size_t i = 0; i < var_numel(v); i++) v->value.data[i] = NAN;
        tape_release(t, v);
    }
}

/* x's gradient through one convolution of case cc, into out [numel(x)]: with zeroed, x's gradient exists
 * (zeroed) before the backward, so the convolution adds into it; otherwise it is the first writer. */
static void conv_case_dx(const ConvCase *cc, bool zeroed, float *out) {
    enum { N = 5 };
    const int xs[4] = {N, cc->C, cc->H, cc->W};
    const size_t nx = (size_t)N * cc->C * cc->H * cc->W, nw = (size_t)cc->OC * cc->C * cc->K * cc->K;
    float *x0 = test_random_uniform(nx, 21, -1.0f, 1.0f), *w0 = test_random_uniform(nw, 22, -0.5f, 0.5f);
    float *a0 = test_random_uniform((size_t)(cc->rank + 1) * cc->C * cc->K * cc->K, 23, -0.5f, 0.5f);
    float *b0 = test_random_uniform((size_t)cc->OC * (cc->rank + 1), 24, -0.5f, 0.5f);
    TestEnv e;
    test_env_init(&e, 3);
    Var *x = test_var(&e, x0, 4, xs, true), *w = test_var(&e, w0, 4, (int[]){cc->OC, cc->C, cc->K, cc->K}, true);
    ConvLowRank lr = {0};
    if (cc->rank > 0) {
        lr.A = test_var(&e, a0, 4, (int[]){cc->rank, cc->C, cc->K, cc->K}, true);
        lr.B = test_var(&e, b0, 4, (int[]){cc->OC, cc->rank, 1, 1}, true);
        lr.scale = 0.5f;
    }
    Var *y = nn_conv2d_fused_lowrank(&e.tape, x, w, NULL, cc->rank > 0 ? &lr : NULL, cc->stride, cc->padding,
                                     cc->epi);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    float *dy = test_random_uniform(var_numel(y), 25, -1.0f, 1.0f);
    for (size_t i = 0; i < var_numel(y); i += 7) dy[i] = 0.0f; /* exact zeros: -0.0f sums where w < 0 */
    poison_free_buffers(&e.tape, x, y);
    if (zeroed) CU_ASSERT_PTR_NOT_NULL(tape_grad(&e.tape, x));
    CU_ASSERT_FATAL(tape_backward_from(&e.tape, y, dy) == QT_OK);
    memcpy(out, x->grad, nx * sizeof *out);
    test_env_free(&e);
    free(x0), free(w0), free(a0), free(b0), free(dy);
}

/* The "same" stride-1 path (first tap written, including a plane its first tap sees only as padding), the
 * strided and 1x1 ones (zeroed per chunk), a pooled block and a low-rank one. */
static void test_conv_dx_written(void) {
    const ConvCase cases[] = {
        {3, 5, 9, 9, 3, 1, 1, CONV_EPI_NONE, 0},          {4, 6, 9, 7, 3, 2, 1, CONV_EPI_NONE, 0},
        {4, 8, 9, 9, 1, 2, 0, CONV_EPI_NONE, 0},          {8, 4, 1, 1, 3, 1, 1, CONV_EPI_NONE, 0},
        {2, 3, 6, 6, 5, 1, 2, CONV_EPI_RELU, 0},          {3, 4, 8, 8, 3, 1, 1, CONV_EPI_RELU_MAXPOOL2, 0},
        {3, 5, 9, 9, 3, 1, 1, CONV_EPI_NONE, 2},          {4, 6, 9, 9, 3, 2, 1, CONV_EPI_RELU, 2},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const ConvCase *cc = &cases[k];
        const size_t nx = (size_t)5 * cc->C * cc->H * cc->W;
        float *written = malloc(nx * sizeof(float)), *added = malloc(nx * sizeof(float));
        conv_case_dx(cc, false, written);
        conv_case_dx(cc, true, added);
        size_t nan = 0;
        for (size_t i = 0; i < nx; i++) nan += isnan(written[i]) != 0;
        CU_ASSERT_EQUAL(nan, 0);
        CU_ASSERT(memcmp(written, added, nx * sizeof(float)) == 0);
        if (nan || memcmp(written, added, nx * sizeof(float)))
            fprintf(stderr, "\n  case %zu (C %d, %dx%d, kernel %d, stride %d): %zu NaN\n", k, cc->C, cc->H, cc->W,
                    cc->K, cc->stride, nan);
        free(written), free(added);
    }
}

/* col2im with write against col2im into zeros, on a dcol whose channel-0 rows are all -0.0f (the add into
 * zeros turns those into +0.0f; a plain store would keep -0.0f), "same" stride 1 and strided. */
static void test_col2im_write_signed_zero(void) {
    enum { N = 2, C = 3, H = 6, W = 5, K = 3 };
    for (int stride = 1; stride <= 2; stride++) {
        const int OH = (H + 2 - K) / stride + 1, OW = (W + 2 - K) / stride + 1;
        const size_t cols = (size_t)N * OH * OW, ndcol = (size_t)C * K * K * cols, nx = (size_t)N * C * H * W;
        float *dcol = test_random_uniform(ndcol, 31, -1.0f, 1.0f), *dcol2 = malloc(ndcol * sizeof(float));
        for (size_t i = 0; i < (size_t)K * K * cols; i++) dcol[i] = -0.0f;
        memcpy(dcol2, dcol, ndcol * sizeof(float));
        float *written = malloc(nx * sizeof(float)), *added = calloc(nx, sizeof(float));
        for (size_t i = 0; i < nx; i++) written[i] = NAN;
        col2im_consume(written, dcol, N, C, H, W, K, K, stride, 1, OH, OW, true);
        col2im_consume(added, dcol2, N, C, H, W, K, K, stride, 1, OH, OW, false);
        CU_ASSERT(memcmp(written, added, nx * sizeof(float)) == 0);
        CU_ASSERT(!signbit(written[0]) && written[0] == 0.0f);
        free(dcol), free(dcol2), free(written), free(added);
    }
}

/* A conv without bias or relu whose every sum underflows (x 2^-100 times w -2^-100: each FMA from +0.0f rounds to
 * -0.0f) gives +0.0f outputs, the epilogue's add of 0.0f (through the taps, whose forward skips that pass, their
 * stores' add to +0.0f), whether a chunk holds one sample (the product written straight into the output) or
 * several: the output's bits do not depend on the chunking or the kernel. */
static void test_conv_underflow_zero_sign(void) {
    enum { C = 16, NW = C * C * 9 };
    const int threads = parallel_get_threads();
    parallel_set_threads(1);
    float *w0 = malloc(NW * sizeof(float));
    for (int i = 0; i < NW; i++) w0[i] = -ldexpf(1.0f, -100);
    const ConvTapsLevel saved = conv_taps_max_level;
    for (int run = 0; run < 12; run++) {
        /* 16 x 16: one sample a chunk; 8 x 8: several (the im2col product copied into y, the taps writing y) */
        const int n = 1 + run % 3, HW = run < 6 ? 16 : 8;
        conv_taps_max_level = run % 6 < 3 ? CONV_TAPS_OFF : conv_taps_cpu(); /* im2col and sgemm, then the taps */
        const size_t nx = (size_t)n * C * HW * HW;
        float *x0 = malloc(nx * sizeof(float));
        for (size_t i = 0; i < nx; i++) x0[i] = ldexpf(1.0f, -100);
        TestEnv e;
        test_env_init(&e, 5);
        Var *x = test_var(&e, x0, 4, (int[]){n, C, HW, HW}, false);
        Var *w = test_var(&e, w0, 4, (int[]){C, C, 3, 3}, false);
        Var *y = nn_conv2d(&e.tape, x, w, NULL, 1, 1);
        CU_ASSERT_PTR_NOT_NULL_FATAL(y);
        size_t negative = 0;
        for (size_t i = 0; i < nx; i++) negative += y->value.data[i] == 0.0f && signbit(y->value.data[i]);
        CU_ASSERT_EQUAL(negative, 0);
        if (negative)
            fprintf(stderr, "\n  N=%d %dx%d (%s): %zu outputs -0.0f\n", n, HW, HW, conv_taps_level_name(conv_taps_level()),
                    negative);
        test_env_free(&e);
        free(x0);
    }
    conv_taps_max_level = saved;
    parallel_set_threads(threads);
    free(w0);
}

/* parallel_range_falling, the conv tasks' split: the tasks tile [0, n) in order, none empty (each writes its weight-gradient partial), and none
 * holds more than one sample over the task before it (rounding at small n), for every n from the task count up. */
static void test_conv_task_ranges(void) {
    int bad = 0;
    for (int tasks = 1; tasks <= 16; tasks++)
        for (int n = tasks; n <= 300; n++) {
            int end = 0, last = n + 1;
            for (int k = 0; k < tasks; k++) {
                int lo, hi;
                parallel_range_falling(n, k, tasks, &lo, &hi);
                if (lo != end || hi <= lo || hi - lo > last + 1) {
                    if (bad++ < 5) fprintf(stderr, "\n  n=%d tasks=%d: task %d is [%d, %d) after %d", n, tasks, k, lo, hi, end);
                }
                last = hi - lo, end = hi;
            }
            if (end != n && bad++ < 5) fprintf(stderr, "\n  n=%d tasks=%d: the tasks end at %d", n, tasks, end);
        }
    CU_ASSERT_EQUAL(bad, 0);
    int lo, hi; /* ResNet-8's batch over 8 tasks: 128 = 1 + 15 / 64 of the other 120 first, ..., 1 + 1 / 64 last */
    parallel_range_falling(128, 0, 8, &lo, &hi);
    CU_ASSERT(lo == 0 && hi == 29);
    parallel_range_falling(128, 7, 8, &lo, &hi);
    CU_ASSERT(lo == 125 && hi == 128);
}

int register_nn_conv_reuse_suite(void) {
    CU_pSuite s = CU_add_suite("nn_conv_reuse", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "conv2d: im2col scratch and partials handed back and reused", test_conv_scratch_reused) ||
                   !CU_add_test(s, "conv2d: an input gradient written first has the bits of one added into zeros",
                                test_conv_dx_written) ||
                   !CU_add_test(s, "col2im written: -0.0f taps give +0.0f, as added into zeros",
                                test_col2im_write_signed_zero) ||
                   !CU_add_test(s, "conv2d: sums underflowing to -0.0f come out +0.0f at any chunking",
                                test_conv_underflow_zero_sign) ||
                   !CU_add_test(s, "conv2d tasks: falling sizes that tile the batch, none empty", test_conv_task_ranges)
               ? -1
               : 0;
}
