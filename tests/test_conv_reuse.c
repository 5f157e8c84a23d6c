/* test_conv_reuse.c - the plain convolution's step memory: its im2col scratch and gradient partials are handed
 * back to the tape after each pass, so a chain of convolutions grows the arena by its activations and
 * gradients, not by one scratch per convolution. */
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/ops.h"
#include "test_util.h"

static float *random_data(size_t n, uint64_t seed, float lo, float hi) {
    float *x = malloc(n * sizeof(float));
    Rng r;
    rng_init(&r, seed, 7);
    rng_fill_uniform(&r, x, n, lo, hi);
    return x;
}

/* DEPTH "same" 3x3 convolutions of C channels, weights and biases trained. Per convolution the forward's
 * scratch (im2col and product of a chunk, ~half an activation here) and the backward's (the same, plus the dW
 * partials) used to come from the arena anew; now one of each serves the whole chain. */
static void test_conv_scratch_reused(void) {
    enum { N = 64, C = 8, HW = 16, DEPTH = 6, NX = N * C * HW * HW, NW = C * C * 9 };
    const int shape[4] = {N, C, HW, HW};
    const int threads = parallel_get_threads();
    parallel_set_threads(1); /* one scratch slot: the sizes below are per thread */
    float *x0 = random_data(NX, 11, -1.0f, 1.0f), *dy = random_data(NX, 12, -1.0f, 1.0f);
    float *w0 = random_data((size_t)DEPTH * NW, 13, -0.2f, 0.2f), *b0 = random_data((size_t)DEPTH * C, 14, -0.1f, 0.1f);
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

int register_nn_conv_reuse_suite(void) {
    CU_pSuite s = CU_add_suite("nn_conv_reuse", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "conv2d: im2col scratch and partials handed back and reused", test_conv_scratch_reused)
               ? -1
               : 0;
}
