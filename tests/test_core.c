/* test_core.c - arena, tape, RNG, errors, GEMM wrapper. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/gemm.h"
#include "nn/ops.h"
#include "test_util.h"

static void test_arena_alignment_and_reset(void) {
    Arena a;
    CU_ASSERT_EQUAL_FATAL(arena_init(&a, 1000), 0);
    for (int i = 1; i < 50; i++) {
        void *p = arena_alloc(&a, (size_t)i * 7);
        CU_ASSERT_PTR_NOT_NULL(p);
        CU_ASSERT_EQUAL((uintptr_t)p % ARENA_ALIGN, 0);
    }
    CU_ASSERT(a.grow_count > 0); /* 1000 bytes could not hold it all */
    size_t hw = a.high_water;
    arena_reset(&a);
    CU_ASSERT_EQUAL(a.used, 0);
    CU_ASSERT(arena_capacity(&a) >= hw);
    /* The same step again fits without growing: the no-malloc guarantee. */
    size_t grows = a.grow_count;
    for (int i = 1; i < 50; i++) arena_alloc(&a, (size_t)i * 7);
    CU_ASSERT_EQUAL(a.grow_count, grows);
    float *z = arena_calloc(&a, 64 * sizeof(float));
    for (int i = 0; i < 64; i++) CU_ASSERT_EQUAL(z[i], 0.0f);
    arena_free(&a);
}

/* Known-answer vectors of Philox4x32-10 from the Random123 distribution
 * (kat_vectors): counter, key -> output. */
static void test_philox_known_answers(void) {
    struct {
        uint32_t ctr[4], key[2], out[4];
    } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
         {0xffffffff, 0xffffffff},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
         {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (size_t i = 0; i < sizeof kat / sizeof kat[0]; i++) {
        uint32_t out[4];
        philox4x32_10(out, kat[i].ctr, kat[i].key);
        for (int j = 0; j < 4; j++) CU_ASSERT_EQUAL(out[j], kat[i].out[j]);
    }
}

static void test_rng_state_is_the_whole_story(void) {
    Rng a, b;
    rng_init(&a, 42, RNG_STREAM_INIT);
    float first[10], again[10], skip[6];
    rng_fill_uniform(&a, first, 10, 0.0f, 1.0f);
    /* Restoring (seed, stream, counter) replays exactly. */
    rng_init(&b, 42, RNG_STREAM_INIT);
    rng_fill_uniform(&b, again, 10, 0.0f, 1.0f);
    CU_ASSERT_EQUAL(memcmp(first, again, sizeof first), 0);
    /* Blocks are 4 wide: 10 floats take 3 blocks. Jumping the counter to 2
     * gives floats 8.. of the same stream. */
    CU_ASSERT_EQUAL(a.counter, 3);
    Rng c = {42, RNG_STREAM_INIT, 2};
    rng_fill_uniform(&c, skip, 2, 0.0f, 1.0f);
    CU_ASSERT_EQUAL(memcmp(skip, first + 8, 2 * sizeof(float)), 0);
    /* Another stream differs. */
    Rng d = rng_fork(&a, RNG_STREAM_SHUFFLE);
    rng_fill_uniform(&d, again, 10, 0.0f, 1.0f);
    CU_ASSERT_NOT_EQUAL(memcmp(first, again, sizeof first), 0);
}

/* The 8-lane Philox (AVX2) gives the scalar blocks' words and leaves the counter where they do: every length
 * around the 32-word step, counters that carry into the high word, large seeds and streams. */
static void test_rng_fill_lanes(void) {
    static const uint64_t starts[] = {0, 5, 0xFFFFFFF9ull, 0x1234FFFFFFFEull};
    static const size_t lens[] = {0, 1, 31, 32, 33, 63, 64, 100, 1000, 4099};
    static uint32_t a[4100], b[4100];
    for (size_t si = 0; si < sizeof starts / sizeof *starts; si++)
        for (size_t li = 0; li < sizeof lens / sizeof *lens; li++) {
            Rng x, y;
            rng_init(&x, 0xDEADBEEFCAFEull + si, 0xABCDEF0123ull * (li + 1));
            x.counter = starts[si];
            y = x;
            rng_fill_u32(&x, a, lens[li]);
            rng_fill_u32_ref(&y, b, lens[li]);
            CU_ASSERT(memcmp(a, b, lens[li] * sizeof *a) == 0);
            CU_ASSERT_EQUAL(x.counter, y.counter);
        }
    /* and the scalar path alone when forced */
    rng_force_scalar = true;
    Rng x, y;
    rng_init(&x, 3, 4);
    y = x;
    rng_fill_u32(&x, a, 100);
    rng_fill_u32_ref(&y, b, 100);
    rng_force_scalar = false;
    CU_ASSERT(memcmp(a, b, 100 * sizeof *a) == 0);
}

/* Handing uniforms out in chunks gives word i of one big draw, across
 * chunk boundaries, and leaves the rng where that draw would. */
static void test_rng_uniforms_match_one_draw(void) {
    enum { N = 3 * RNG_UNIFORMS_CHUNK + 7 };
    static uint32_t words[N];
    Rng a, b;
    rng_init(&a, 42, RNG_STREAM_ROUNDING);
    b = a;
    rng_fill_u32(&a, words, N);
    RngUniforms u;
    rng_uniforms_init(&u, &b, N);
    int mismatches = 0;
    for (int i = 0; i < N; i++) mismatches += rng_uniforms_next(&u) != rng_u32_to_unit(words[i]);
    CU_ASSERT_EQUAL(mismatches, 0);
    CU_ASSERT_EQUAL(a.counter, b.counter);
    rng_uniforms_init(&u, NULL, 4);
    CU_ASSERT_EQUAL(rng_uniforms_next(&u), 0.0f);
}

/* rng_fill_unit_at in parts that start on blocks (as QT's threads draw the noise) = RngUniforms' sequence, and
 * rng_blocks advances the counter to where that draw leaves it, at lengths around the block and chunk sizes. */
static void test_rng_fill_unit_at_parts(void) {
    static const size_t LENS[] = {1, 4, 5, 255, 256, 257, 1031, 4096 + 3};
    static float got[4099];
    for (size_t li = 0; li < sizeof LENS / sizeof *LENS; li++) {
        const size_t n = LENS[li];
        Rng r, seq;
        rng_init(&r, 19, RNG_STREAM_ROUNDING);
        r.counter = 3 + li;
        seq = r;
        for (size_t a = 0; a < n; a += 260) /* parts of 260 words: 65 blocks, not a chunk multiple */
            rng_fill_unit_at(&r, a, got + a, n - a < 260 ? n - a : 260);
        r.counter += rng_blocks(n);
        RngUniforms u;
        rng_uniforms_init(&u, &seq, n);
        int mismatches = 0;
        for (size_t i = 0; i < n; i++) mismatches += rng_uniforms_next(&u) != got[i];
        CU_ASSERT_EQUAL(mismatches, 0);
        CU_ASSERT_EQUAL(r.counter, seq.counter);
    }
}

/* rng_fill_uniform (words in chunks through the vector Philox) against one block per 4 values: the same floats
 * and the same counter after, at lengths around the chunk and block sizes. */
static void test_rng_fill_uniform_blocks(void) {
    static const size_t LENS[] = {1, 3, 4, 5, 31, 32, 33, 255, 256, 257, 1000, 1027};
    static float got[1027], want[1027];
    for (size_t li = 0; li < sizeof LENS / sizeof *LENS; li++) {
        Rng x, y;
        rng_init(&x, 11, 5);
        x.counter = 7 + li;
        y = x;
        rng_fill_uniform(&x, got, LENS[li], -0.5f, 2.0f);
        uint32_t b[4];
        for (size_t i = 0; i < LENS[li]; i += 4) {
            rng_next_block(&y, b);
            for (size_t j = 0; j < 4 && i + j < LENS[li]; j++) want[i + j] = -0.5f + 2.5f * rng_u32_to_unit(b[j]);
        }
        CU_ASSERT(memcmp(got, want, LENS[li] * sizeof *got) == 0);
        CU_ASSERT_EQUAL(x.counter, y.counter);
    }
}

static void test_rng_distributions(void) {
    Rng r;
    rng_init(&r, 7, 1);
    enum { N = 200000 };
    float *x = malloc(N * sizeof(float));
    rng_fill_uniform(&r, x, N, -2.0f, 2.0f);
    double mean = 0, var = 0, lo = 1e9, hi = -1e9;
    for (int i = 0; i < N; i++) mean += x[i], lo = fmin(lo, x[i]), hi = fmax(hi, x[i]);
    mean /= N;
    for (int i = 0; i < N; i++) var += (x[i] - mean) * (x[i] - mean);
    var /= N;
    /* U(-2,2): mean 0, var 16/12. Standard error of the mean is
     * sqrt(4/3/N) = 0.0026: 5 sigma = 0.013. */
    CU_ASSERT(fabs(mean) < 0.013);
    CU_ASSERT(fabs(var - 16.0 / 12.0) < 0.02);
    CU_ASSERT(lo >= -2.0 && hi < 2.0);
    rng_fill_normal(&r, x, N, 1.0f, 3.0f);
    mean = var = 0;
    for (int i = 0; i < N; i++) mean += x[i];
    mean /= N;
    for (int i = 0; i < N; i++) var += (x[i] - mean) * (x[i] - mean);
    var /= N;
    /* N(1, 9): standard error of the mean 3/sqrt(N) = 0.0067. */
    CU_ASSERT(fabs(mean - 1.0) < 0.034);
    CU_ASSERT(fabs(sqrt(var) - 3.0) < 0.03);
    free(x);
    /* rng_below covers its range evenly; a shuffle is a permutation. */
    int counts[7] = {0};
    for (int i = 0; i < 70000; i++) counts[rng_below(&r, 7)]++;
    for (int i = 0; i < 7; i++) CU_ASSERT(abs(counts[i] - 10000) < 500); /* sigma ~ 93 */
    uint32_t idx[100];
    int seen[100] = {0};
    for (uint32_t i = 0; i < 100; i++) idx[i] = i;
    rng_shuffle_u32(&r, idx, 100);
    for (int i = 0; i < 100; i++) seen[idx[i]]++;
    for (int i = 0; i < 100; i++) CU_ASSERT_EQUAL(seen[i], 1);
}

/* sgemm (OpenBLAS) against the naive loop, every transpose, odd shapes,
 * leading dimensions larger than the rows, alpha/beta. */
static void test_gemm_matches_ref(void) {
    const int dims[] = {1, 3, 7, 33};
    Rng r;
    rng_init(&r, 3, 1);
    float A[40 * 40], B[40 * 40], C0[40 * 40], C1[40 * 40], C2[40 * 40];
    rng_fill_uniform(&r, A, 1600, -1, 1);
    rng_fill_uniform(&r, B, 1600, -1, 1);
    rng_fill_uniform(&r, C0, 1600, -1, 1);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int im = 0; im < 4; im++)
                for (int in = 0; in < 4; in++)
                    for (int ik = 0; ik < 4; ik++) {
                        int M = dims[im], N = dims[in], K = dims[ik];
                        int lda = (ta ? M : K) + 2, ldb = (tb ? K : N) + 1, ldc = N + 3;
                        memcpy(C1, C0, sizeof C0);
                        memcpy(C2, C0, sizeof C0);
                        gemm_f32(ta, tb, M, N, K, 0.5f, A, lda, B, ldb, 0.25f, C1, ldc);
                        gemm_f32_ref(ta, tb, M, N, K, 0.5f, A, lda, B, ldb, 0.25f, C2, ldc);
                        /* K <= 33 products of values in [-1,1] in float:
                         * error <= K * 2^-24 * sum|ab| ~ 33*33*6e-8 = 7e-5. */
                        ASSERT_ALL_CLOSE(C1, C2, (size_t)M * ldc, 1e-4, 1e-5);
                    }
}

static void test_tape_errors_poison_not_crash(void) {
    TestEnv e;
    test_env_init(&e, 1);
    float d[6] = {1, 2, 3, 4, 5, 6};
    Var *a = test_var(&e, d, 2, (int[]){2, 3}, true);
    Var *b = test_var(&e, d, 2, (int[]){2, 3}, true);
    Var *y = nn_matmul(&e.tape, a, b, false, false); /* (2,3)@(2,3): mismatch */
    CU_ASSERT_PTR_NULL(y);
    CU_ASSERT_EQUAL(e.tape.err.status, QT_ERR_SHAPE);
    CU_ASSERT_PTR_NOT_NULL(strstr(e.tape.err.msg, "matmul"));
    CU_ASSERT_PTR_NOT_NULL(strstr(e.tape.err.msg, "(2, 3)"));
    /* Downstream ops pass the NULL along and keep the first message. */
    CU_ASSERT_PTR_NULL(nn_relu(&e.tape, nn_scale(&e.tape, y, 2.0f)));
    CU_ASSERT_PTR_NOT_NULL(strstr(e.tape.err.msg, "matmul"));
    CU_ASSERT_NOT_EQUAL(tape_backward(&e.tape, y), QT_OK);
    /* Reset clears the error for the next step. */
    tape_reset(&e.tape);
    CU_ASSERT(tape_ok(&e.tape));
    /* A zero-sized dimension is refused where the Var is made. */
    CU_ASSERT_PTR_NULL(tape_new_var(&e.tape, 2, (int[]){0, 3}));
    CU_ASSERT_EQUAL(e.tape.err.status, QT_ERR_SHAPE);
    tape_reset(&e.tape);
    /* Backward of a non-scalar "loss" is an error, not garbage. */
    a = test_var(&e, d, 2, (int[]){2, 3}, true);
    CU_ASSERT_EQUAL(tape_backward(&e.tape, nn_relu(&e.tape, a)), QT_ERR_SHAPE);
    test_env_free(&e);
}

static void test_tape_records_only_what_needs_grads(void) {
    TestEnv e;
    test_env_init(&e, 1);
    float d[4] = {1, -2, 3, -4};
    Var *c = test_var(&e, d, 1, (int[]){4}, false);
    Var *y = nn_relu(&e.tape, nn_scale(&e.tape, c, 2.0f));
    CU_ASSERT_PTR_NOT_NULL(y);
    CU_ASSERT_EQUAL(e.tape.n_nodes, 0);
    CU_ASSERT_FALSE(y->requires_grad);
    Var *p = test_var(&e, d, 1, (int[]){4}, true);
    e.tape.grad_enabled = false; /* eval: forward only */
    y = nn_relu(&e.tape, p);
    CU_ASSERT_EQUAL(e.tape.n_nodes, 0);
    e.tape.grad_enabled = true;
    y = nn_relu(&e.tape, nn_add(&e.tape, p, c));
    CU_ASSERT_EQUAL(e.tape.n_nodes, 2);
    CU_ASSERT(y->requires_grad);
    test_env_free(&e);
}

/* A Var used twice gets the sum of both paths: y = x*2 + x*3 -> dy/dx = 5. */
static void test_tape_accumulates_fanout(void) {
    TestEnv e;
    test_env_init(&e, 1);
    float d[3] = {1, 2, 3}, ones[3] = {1, 1, 1};
    Var *x = test_var(&e, d, 1, (int[]){3}, true);
    Var *y = nn_add(&e.tape, nn_scale(&e.tape, x, 2.0f), nn_scale(&e.tape, x, 3.0f));
    CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, ones), QT_OK);
    for (int i = 0; i < 3; i++) CU_ASSERT_DOUBLE_EQUAL(x->grad[i], 5.0, 0.0);
    test_env_free(&e);
}

/* Misuse that would silently corrupt gradients is an error instead. */
static void test_tape_refuses_misuse(void) {
    TestEnv e;
    test_env_init(&e, 1);
    float d[3] = {1, 2, 3}, ones[3] = {1, 1, 1};
    Var *x = test_var(&e, d, 1, (int[]){3}, true);
    Var *y = nn_scale(&e.tape, x, 2.0f);
    CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, ones), QT_OK);
    CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, ones), QT_ERR_ARG); /* would give 4, not 2 */
    CU_ASSERT_PTR_NOT_NULL(strstr(e.tape.err.msg, "twice"));
    CU_ASSERT_DOUBLE_EQUAL(x->grad[0], 2.0, 0.0);
    tape_reset(&e.tape);
    /* A parameter marked requires_grad without a grad buffer (frozen) must
     * not get an arena buffer that dangles after the reset. */
    Var p = {.value = {d, 1, {3, 1, 1, 1}}, .grad = NULL, .requires_grad = true, .is_param = true};
    y = nn_scale(&e.tape, &p, 2.0f);
    CU_ASSERT_NOT_EQUAL(tape_backward_from(&e.tape, y, ones), QT_OK);
    CU_ASSERT_PTR_NULL(p.grad);
    CU_ASSERT_PTR_NOT_NULL(strstr(e.tape.err.msg, "frozen parameter"));
    tape_reset(&e.tape);
    /* Shapes too large to index are refused where the Var is made. */
    CU_ASSERT_PTR_NULL(tape_new_var(&e.tape, 4, (int[]){1 << 20, 1 << 20, 2, 2}));
    test_env_free(&e);
}

static void test_error_keeps_first(void) {
    QtError err = {0};
    CU_ASSERT_EQUAL(qt_error_set(&err, QT_ERR_IO, "first %d", 1), QT_ERR_IO);
    qt_error_set(&err, QT_ERR_ARG, "second");
    CU_ASSERT_EQUAL(err.status, QT_ERR_IO);
    CU_ASSERT_STRING_EQUAL(err.msg, "first 1");
    CU_ASSERT_EQUAL(qt_error_set(NULL, QT_ERR_ARG, "ignored"), QT_ERR_ARG);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(err.status, QT_OK);
}

int register_nn_core_suite(void) {
    CU_pSuite s = CU_add_suite("nn_core", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "arena alignment, reset, steady state", test_arena_alignment_and_reset) ||
           !CU_add_test(s, "philox known answers", test_philox_known_answers) ||
           !CU_add_test(s, "philox in 8 lanes = the scalar blocks", test_rng_fill_lanes) ||
           !CU_add_test(s, "rng state replays exactly", test_rng_state_is_the_whole_story) ||
           !CU_add_test(s, "rng distributions", test_rng_distributions) ||
           !CU_add_test(s, "sgemm matches naive loop", test_gemm_matches_ref) ||
           !CU_add_test(s, "tape errors poison, never crash", test_tape_errors_poison_not_crash) ||
           !CU_add_test(s, "tape records only what needs grads", test_tape_records_only_what_needs_grads) ||
           !CU_add_test(s, "tape accumulates fan-out", test_tape_accumulates_fanout) ||
           !CU_add_test(s, "tape refuses double backward and frozen-param grads", test_tape_refuses_misuse) ||
           !CU_add_test(s, "error keeps the first cause", test_error_keeps_first) ||
           !CU_add_test(s, "chunked uniforms equal one draw", test_rng_uniforms_match_one_draw) ||
           !CU_add_test(s, "rng_fill_uniform = one block per 4 values", test_rng_fill_uniform_blocks) ||
           !CU_add_test(s, "uniforms drawn in parts = one draw", test_rng_fill_unit_at_parts);
}
