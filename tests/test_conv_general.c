/* test_conv_general.c - the nn_conv_general suite: nn_conv2d_general (groups,
 * depthwise, per-axis stride and padding, the extra bottom/right padding of
 * 'same', dilation).
 *
 * Its three routes (nn_conv2d, the direct depthwise loops, grouped im2col +
 * sgemm) are held against the direct loops of conv2d_general_forward_ref /
 * conv2d_general_backward_ref, against finite differences, against
 * themselves at 1 and 2 threads, and against PyTorch's F.conv2d through
 * tests/fixtures/torch_conv.h5 (tests/make_fixtures_conv.py). */
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/conv_taps.h"
#include "nn/ops.h"
#include "test_util.h"

#define FIXTURE_PATH "tests/fixtures/torch_conv.h5"

typedef struct {
    const char *what;
    int N, C, H, W; /* input */
    int OC, KH, KW; /* weight (OC, C/groups, KH, KW) */
    ConvGeom2d g;   /* stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, pad_h_extra, pad_w_extra */
} GCase;

static const GCase cases[] = {
    {"grouped 2, 3x3", 2, 4, 7, 6, 6, 3, 3, {1, 1, 1, 1, 1, 1, 2, 0, 0}},
    {"grouped 2, pointwise (x read in place)", 3, 4, 5, 5, 6, 1, 1, {1, 1, 0, 0, 1, 1, 2, 0, 0}},
    {"depthwise, stride 2 (row loops)", 2, 3, 8, 7, 3, 3, 3, {2, 2, 1, 1, 1, 1, 3, 0, 0}},
    {"depthwise 3x3 'same' (padded-plane loops)", 3, 5, 9, 11, 5, 3, 3, {1, 1, 1, 1, 1, 1, 5, 0, 0}},
    {"depthwise multiplier 2, dilation 2", 2, 3, 7, 7, 6, 3, 3, {1, 1, 2, 2, 2, 2, 3, 0, 0}},
    {"depthwise 1x5, stride [1, 2]", 2, 4, 6, 9, 4, 1, 5, {1, 2, 0, 2, 1, 1, 4, 0, 0}},
    {"depthwise 2x2, 'same' extra row and column", 1, 2, 5, 4, 4, 2, 2, {1, 1, 0, 0, 1, 1, 2, 1, 1}},
    {"one group, 3x2, stride [2, 3], padding [1, 0]", 2, 3, 9, 8, 4, 3, 2, {2, 3, 1, 0, 1, 1, 1, 0, 0}},
    {"one group, dilation [2, 1]", 2, 2, 9, 6, 3, 3, 3, {1, 1, 2, 1, 2, 1, 1, 0, 0}},
    {"grouped 2, padding [0, 2], extra [1, 0]", 2, 2, 5, 6, 4, 3, 5, {1, 1, 0, 2, 1, 1, 2, 1, 0}},
    {"depthwise, padding wider than the kernel", 1, 2, 3, 3, 2, 3, 3, {2, 1, 3, 2, 1, 1, 2, 0, 0}},
};
#define N_CASES (sizeof cases / sizeof cases[0])

static int out_h(const GCase *k) {
    return conv_general_out_size(k->H, k->KH, k->g.stride_h, k->g.pad_h, k->g.pad_h + k->g.pad_h_extra, k->g.dil_h);
}
static int out_w(const GCase *k) {
    return conv_general_out_size(k->W, k->KW, k->g.stride_w, k->g.pad_w, k->g.pad_w + k->g.pad_w_extra, k->g.dil_w);
}

static float *uniform_floats(TestEnv *e, Rng *r, size_t n) {
    float *p = tape_alloc(&e->tape, n * sizeof(float));
    rng_fill_uniform(r, p, n, -1.0f, 1.0f);
    return p;
}

typedef struct {
    Var *x, *w, *bias, *y;
    float *dy;
} GRun;

/* Forward of case k on fresh Vars from seed, then backward from a random dy
 * onto grads prefilled with 0.5 (a backward must add to them). */
static bool run_case(TestEnv *e, const GCase *k, bool with_bias, uint64_t seed, GRun *o) {
    Rng r;
    test_env_init(e, seed);
    rng_init(&r, seed + 1, RNG_STREAM_INIT);
    const size_t nx = (size_t)k->N * k->C * k->H * k->W, nw = (size_t)k->OC * (k->C / k->g.groups) * k->KH * k->KW;
    o->x = test_var(e, uniform_floats(e, &r, nx), 4, (const int[]){k->N, k->C, k->H, k->W}, true);
    o->w = test_var(e, uniform_floats(e, &r, nw), 4, (const int[]){k->OC, k->C / k->g.groups, k->KH, k->KW}, true);
    o->bias = with_bias ? test_var(e, uniform_floats(e, &r, (size_t)k->OC), 1, &k->OC, true) : NULL;
    Var *vars[] = {o->x, o->w, o->bias};
    for (int i = 0; i < (with_bias ? 3 : 2); i++) {
        float *g = tape_grad(&e->tape, vars[i]);
        for (size_t j = 0; j < var_numel(vars[i]); j++) g[j] = 0.5f;
    }
    o->y = nn_conv2d_general(&e->tape, o->x, o->w, o->bias, &k->g);
    if (!o->y) {
        fprintf(stderr, "\n  %s: %s\n", k->what, e->tape.err.msg);
        return false;
    }
    o->dy = uniform_floats(e, &r, var_numel(o->y));
    return tape_backward_from(&e->tape, o->y, o->dy) == QT_OK;
}

static void check(const char *case_what, const char *what, const float *got, const float *want, size_t n,
                  double atol, double rtol) {
    if (test_close_ratio(got, want, n, atol, rtol, NULL) > 1.0) fprintf(stderr, "\n  %s: %s", case_what, what);
    ASSERT_ALL_CLOSE(got, want, n, atol, rtol);
}

/* ---- the fast routes against the direct loops ---------------------------------- */

static void test_matches_ref(void) {
    for (size_t i = 0; i < N_CASES; i++)
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            const GCase *k = &cases[i];
            TestEnv e;
            GRun o;
            bool ok = run_case(&e, k, with_bias, 100 + 2 * i + with_bias, &o);
            CU_ASSERT(ok);
            if (!ok) {
                test_env_free(&e);
                continue;
            }
            /* the route: depthwise cases must run the direct loops, not a GEMM per channel */
            const char *want_op = k->g.groups == k->C ? "conv2d_depthwise"
                                  : k->g.groups > 1   ? "conv2d_grouped"
                                                      : "conv2d_general";
            CU_ASSERT_STRING_EQUAL(e.tape.nodes[e.tape.n_nodes - 1].op, want_op);
            const int OH = out_h(k), OW = out_w(k);
            CU_ASSERT(o.y->value.shape[0] == k->N && o.y->value.shape[1] == k->OC && o.y->value.shape[2] == OH &&
                      o.y->value.shape[3] == OW);
            const size_t ny = var_numel(o.y), nx = var_numel(o.x), nw = var_numel(o.w);
            float *y = calloc(ny, sizeof *y), *dx = malloc(nx * sizeof *dx), *dw = malloc(nw * sizeof *dw);
            float *db = malloc((size_t)k->OC * sizeof *db);
            for (size_t j = 0; j < nx; j++) dx[j] = 0.5f;
            for (size_t j = 0; j < nw; j++) dw[j] = 0.5f;
            for (int j = 0; j < k->OC; j++) db[j] = 0.5f;
            conv2d_general_forward_ref(y, o.x->value.data, o.w->value.data, with_bias ? o.bias->value.data : NULL,
                                       k->N, k->C, k->H, k->W, k->OC, k->KH, k->KW, &k->g);
            conv2d_general_backward_ref(dx, dw, with_bias ? db : NULL, o.dy, o.x->value.data, o.w->value.data, k->N,
                                        k->C, k->H, k->W, k->OC, k->KH, k->KW, &k->g);
            /* float sums of at most a few hundred O(1) terms against double ones: ~1e-6 apart; a wrong tap is O(0.1) */
            check(k->what, "y", o.y->value.data, y, ny, 2e-5, 1e-5);
            check(k->what, "dx", o.x->grad, dx, nx, 2e-5, 1e-5);
            check(k->what, "dw", o.w->grad, dw, nw, 1e-4, 1e-5);
            if (with_bias) check(k->what, "dbias", o.bias->grad, db, (size_t)k->OC, 1e-4, 1e-5);
            free(y);
            free(dx);
            free(dw);
            free(db);
            test_env_free(&e);
        }
}

/* A run's output and gradients (y, dx, dw, dbias) kept in first[] by the first run of a case, or compared bit for
 * bit with it by a later one (what: the later run's setting, named in a difference). Returns false on one. */
static bool keep_or_compare(float *first[4], const GRun *o, const GCase *k, const char *what) {
    const float *got[4] = {o->y->value.data, o->x->grad, o->w->grad, o->bias->grad};
    const size_t n[4] = {var_numel(o->y), var_numel(o->x), var_numel(o->w), (size_t)k->OC};
    bool same = true;
    for (int a = 0; a < 4; a++) {
        if (!first[a]) {
            first[a] = malloc(n[a] * sizeof(float));
            memcpy(first[a], got[a], n[a] * sizeof(float));
        } else if (memcmp(first[a], got[a], n[a] * sizeof(float)) != 0) {
            fprintf(stderr, "\n  %s: array %d differs %s", k->what, a, what);
            same = false;
        }
    }
    return same;
}

/* The result must not depend on the pool: every route at 1 and 2 threads, bit for bit. */
static void test_threads_identical(void) {
    const int before = parallel_get_threads();
    for (size_t i = 0; i < N_CASES; i++) {
        const GCase *k = &cases[i];
        float *first[4] = {0};
        for (int threads = 1; threads <= 2; threads++) {
            CU_ASSERT_EQUAL(parallel_set_threads(threads), threads);
            TestEnv e;
            GRun o;
            CU_ASSERT_FATAL(run_case(&e, k, true, 500 + i, &o));
            if (!keep_or_compare(first, &o, k, "between 1 and 2 threads")) CU_FAIL("1 and 2 threads differ");
            test_env_free(&e);
        }
        for (int a = 0; a < 4; a++) free(first[a]);
    }
    parallel_set_threads(before);
}

/* The stride-1 depthwise backward's weight-gradient lanes (nn/conv_dw_wgrad.c: one vector of 16 at AVX-512,
 * two of 8 at AVX2, plain C below) give the same bits at every level conv_taps_max_level allows, as do its
 * input gradient and forward, for each stride-1 depthwise case (3x3 unrolled; a multiplier of 2 with dilation
 * 2; 2x2 'same' with its extra row and column; 3x5 in two groups of one channel, padding [0, 2]). */
static void test_depthwise_levels_identical(void) {
    const ConvTapsLevel saved = conv_taps_max_level;
    const ConvTapsLevel levels[] = {CONV_TAPS_AVX512, CONV_TAPS_AVX2, CONV_TAPS_OFF};
    for (size_t li = 0; li < 2; li++)
        if (conv_taps_cpu() < levels[li])
            test_skip(li == 0 ? "depthwise weight gradient at AVX-512: this CPU has no AVX-512F"
                              : "depthwise weight gradient at AVX2: this CPU has no AVX2 with FMA");
    int compared = 0;
    for (size_t i = 0; i < N_CASES; i++) {
        const GCase *k = &cases[i];
        if (k->g.groups != k->C || k->g.stride_h != 1 || k->g.stride_w != 1) continue;
        float *first[4] = {0};
        for (size_t li = 0; li < 3; li++) {
            if (conv_taps_cpu() < levels[li]) continue;
            conv_taps_max_level = levels[li];
            TestEnv e;
            GRun o;
            CU_ASSERT_FATAL(run_case(&e, k, true, 700 + i, &o));
            char what[64];
            snprintf(what, sizeof what, "at level %s", conv_taps_level_name(levels[li]));
            if (!keep_or_compare(first, &o, k, what)) CU_FAIL("depthwise levels differ");
            if (li > 0) compared++; /* a level held against a wider one's bits */
            test_env_free(&e);
        }
        for (int a = 0; a < 4; a++) free(first[a]);
    }
    conv_taps_max_level = saved;
    /* the four stride-1 depthwise cases, each at AVX2 and plain C against the widest level (where there are two) */
    if (conv_taps_cpu() >= CONV_TAPS_AVX2) CU_ASSERT(compared >= 4);
}

/* One group, dilation 1, the same stride and padding on both axes: nn_conv2d, bit for bit. */
static void test_plain_is_conv2d(void) {
    const GCase k = {"plain", 3, 3, 9, 8, 5, 3, 2, {2, 2, 1, 1, 1, 1, 1, 0, 0}};
    CU_ASSERT_EQUAL(memcmp(&k.g, &(ConvGeom2d){2, 2, 1, 1, 1, 1, 1, 0, 0}, sizeof k.g), 0);
    ConvGeom2d plain = conv_geom2d(2, 1);
    CU_ASSERT_EQUAL(memcmp(&k.g, &plain, sizeof plain), 0);
    TestEnv e;
    GRun o;
    CU_ASSERT_FATAL(run_case(&e, &k, true, 900, &o));
    TestEnv e2;
    test_env_init(&e2, 900);
    Var *x = test_var(&e2, o.x->value.data, 4, o.x->value.shape, true);
    Var *w = test_var(&e2, o.w->value.data, 4, o.w->value.shape, true);
    Var *b = test_var(&e2, o.bias->value.data, 1, o.bias->value.shape, true);
    Var *vars[] = {x, w, b};
    for (int i = 0; i < 3; i++) {
        float *g = tape_grad(&e2.tape, vars[i]);
        for (size_t j = 0; j < var_numel(vars[i]); j++) g[j] = 0.5f;
    }
    Var *y = nn_conv2d(&e2.tape, x, w, b, 2, 1);
    CU_ASSERT_FATAL(y && tape_backward_from(&e2.tape, y, o.dy) == QT_OK);
    CU_ASSERT_EQUAL(memcmp(y->value.data, o.y->value.data, var_numel(y) * sizeof(float)), 0);
    CU_ASSERT_EQUAL(memcmp(x->grad, o.x->grad, var_numel(x) * sizeof(float)), 0);
    CU_ASSERT_EQUAL(memcmp(w->grad, o.w->grad, var_numel(w) * sizeof(float)), 0);
    CU_ASSERT_EQUAL(memcmp(b->grad, o.bias->grad, var_numel(b) * sizeof(float)), 0);
    test_env_free(&e2);
    test_env_free(&e);
}

/* Scratch comes from the step arena: after the first step (which grows a
 * deliberately small arena) a step of every route allocates nothing. */
static void test_steady_state_arena(void) {
    for (size_t i = 0; i < N_CASES; i++) {
        const GCase *k = &cases[i];
        TestEnv e;
        GRun o;
        CU_ASSERT_FATAL(run_case(&e, k, true, 700 + i, &o)); /* the inputs, on e's arena */
        Arena a;
        Tape t;
        CU_ASSERT_FATAL(arena_init(&a, 64) == 0 && tape_init(&t, &a, &e.rng, NULL) == QT_OK);
        size_t grown_after_first = 0;
        for (int step = 0; step < 3; step++) {
            o.x->grad = o.w->grad = o.bias->grad = NULL; /* the step's grads live on t's arena */
            Var *y = nn_conv2d_general(&t, o.x, o.w, o.bias, &k->g);
            CU_ASSERT(y && tape_backward_from(&t, y, o.dy) == QT_OK);
            if (step == 0) grown_after_first = a.grow_count;
            tape_reset(&t);
        }
        CU_ASSERT(grown_after_first > 0);
        if (a.grow_count != grown_after_first) fprintf(stderr, "\n  %s: the arena grew after the first step", k->what);
        CU_ASSERT_EQUAL(a.grow_count, grown_after_first);
        tape_free(&t);
        arena_free(&a);
        test_env_free(&e);
    }
}

/* ---- finite differences ------------------------------------------------------ */

typedef struct {
    const ConvGeom2d *g;
    bool with_bias;
} GArgs;

static Var *gconv_fn(Tape *t, Var **in, void *ctx) {
    const GArgs *a = ctx;
    return nn_conv2d_general(t, in[0], in[1], a->with_bias ? in[2] : NULL, a->g);
}

static GradcheckInput gc_input(const float *data, int ndim, const int *shape) {
    GradcheckInput in = {.data = data, .ndim = ndim, .check = true};
    for (int i = 0; i < ndim; i++) in.shape[i] = shape[i];
    return in;
}

static void test_gradcheck(void) {
    for (size_t i = 0; i < N_CASES; i++) {
        const GCase *k = &cases[i];
        TestEnv e;
        test_env_init(&e, 1300 + i);
        Rng r;
        rng_init(&r, 1400 + i, RNG_STREAM_INIT);
        const int Cg = k->C / k->g.groups;
        const int xs[] = {k->N, k->C, k->H, k->W}, ws[] = {k->OC, Cg, k->KH, k->KW};
        const size_t nx = (size_t)k->N * k->C * k->H * k->W, nw = (size_t)k->OC * Cg * k->KH * k->KW;
        float *x = tape_alloc(&e.tape, nx * sizeof(float)), *w = tape_alloc(&e.tape, nw * sizeof(float));
        float *b = tape_alloc(&e.tape, (size_t)k->OC * sizeof(float));
        rng_fill_normal(&r, x, nx, 0.0f, 1.0f);
        rng_fill_normal(&r, w, nw, 0.0f, 1.0f);
        rng_fill_normal(&r, b, (size_t)k->OC, 0.0f, 1.0f);
        GradcheckInput in[3] = {gc_input(x, 4, xs), gc_input(w, 4, ws), gc_input(b, 1, &k->OC)};
        GArgs args = {&k->g, i % 2 == 0}; /* every other case with a bias */
        bool ok = gradcheck(k->what, gconv_fn, &args, in, args.with_bias ? 3 : 2, 1e-3, 2e-3, 1e-2);
        if (!ok) fprintf(stderr, "\n  gradcheck failed: %s", k->what);
        CU_ASSERT(ok);
        test_env_free(&e);
    }
}

/* ---- padding 'same' and bad arguments ------------------------------------------ */

static void test_same_padding(void) {
    QtError err = {0};
    const struct {
        int K, dil, pad, extra;
    } want[] = {{3, 1, 1, 0}, {4, 1, 1, 1}, {2, 1, 0, 1}, {3, 2, 2, 0}, {2, 3, 1, 1}, {1, 5, 0, 0}, {5, 1, 2, 0}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        ConvGeom2d g = conv_geom2d(1, 7);
        g.dil_h = want[i].dil;
        g.dil_w = 1;
        CU_ASSERT_EQUAL_FATAL(conv_geom2d_same(&g, want[i].K, 3, &err), QT_OK);
        CU_ASSERT(g.pad_h == want[i].pad && g.pad_h_extra == want[i].extra);
        CU_ASSERT(g.pad_w == 1 && g.pad_w_extra == 0);
    }
    ConvGeom2d g = conv_geom2d(2, 0);
    CU_ASSERT_EQUAL(conv_geom2d_same(&g, 3, 3, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "'same'") && test_msg_has(&err, "stride [2, 2]"));
}

static Var *zeros_var(TestEnv *e, int ndim, const int *shape) {
    Var *v = tape_new_var(&e->tape, ndim, shape);
    if (v) memset(v->value.data, 0, var_numel(v) * sizeof(float));
    return v;
}

/* conv of zero x (xs) and w (ws) with g must fail with status and a message holding each needle. */
static void expect_error(const char *what, const int *xs, const int *ws, const ConvGeom2d *g, QtStatus status,
                         const char *const *needles) {
    TestEnv e;
    test_env_init(&e, 1);
    Var *y = nn_conv2d_general(&e.tape, zeros_var(&e, 4, xs), zeros_var(&e, 4, ws), NULL, g);
    bool ok = y == NULL && e.tape.err.status == status;
    for (const char *const *s = needles; ok && *s; s++) ok = strstr(e.tape.err.msg, *s) != NULL;
    if (!ok)
        fprintf(stderr, "\n  %s: got %s, status %s, message \"%s\"\n", what, y ? "a Var" : "NULL",
                qt_status_name(e.tape.err.status), e.tape.err.msg);
    CU_ASSERT(ok);
    test_env_free(&e);
}

static void test_bad_arguments(void) {
    const int x4[] = {2, 4, 6, 6};
    ConvGeom2d g3 = conv_geom2d(1, 1);
    g3.groups = 3;
    expect_error("groups not dividing C", x4, (const int[]){6, 1, 3, 3}, &g3, QT_ERR_SHAPE,
                 (const char *[]){"groups 3", "input channels 4", "(2, 4, 6, 6)", "(6, 1, 3, 3)", NULL});
    ConvGeom2d g4 = conv_geom2d(1, 1);
    g4.groups = 4;
    expect_error("groups not dividing OC", x4, (const int[]){6, 1, 3, 3}, &g4, QT_ERR_SHAPE,
                 (const char *[]){"groups 4", "output channels 6", NULL});
    ConvGeom2d g2 = conv_geom2d(1, 1);
    g2.groups = 2;
    expect_error("weight channels per group", x4, (const int[]){4, 4, 3, 3}, &g2, QT_ERR_SHAPE,
                 (const char *[]){"groups 2", "2 input channels per group, not 4", "(4, 4, 3, 3)", NULL});
    ConvGeom2d d3 = {1, 1, 0, 1, 3, 1, 2, 0, 0}; /* 3 taps at dilation 3 span 7 > 6 rows */
    expect_error("dilated kernel larger than the padded input", x4, (const int[]){4, 2, 3, 3}, &d3, QT_ERR_SHAPE,
                 (const char *[]){"kernel 3x3", "dilation [3, 1]", "spans 7x3", "padded to 6x8", NULL});
    ConvGeom2d s0 = {1, 0, 1, 1, 1, 1, 2, 0, 0};
    expect_error("stride 0", x4, (const int[]){4, 2, 3, 3}, &s0, QT_ERR_ARG,
                 (const char *[]){"stride [1, 0]", "(2, 4, 6, 6)", NULL});
    ConvGeom2d dil0 = {1, 1, 1, 1, 0, 1, 2, 0, 0};
    expect_error("dilation 0", x4, (const int[]){4, 2, 3, 3}, &dil0, QT_ERR_ARG,
                 (const char *[]){"dilation [0, 1]", NULL});
    ConvGeom2d neg = {1, 1, 1, 1, 1, 1, 2, 0, -1};
    expect_error("negative extra padding", x4, (const int[]){4, 2, 3, 3}, &neg, QT_ERR_ARG,
                 (const char *[]){"extra [0, -1]", NULL});
    ConvGeom2d grp0 = {1, 1, 1, 1, 1, 1, 0, 0, 0};
    expect_error("groups 0", x4, (const int[]){4, 2, 3, 3}, &grp0, QT_ERR_ARG, (const char *[]){"groups 0", NULL});

    /* NULL inputs (an earlier op failed): NULL back, no new error. */
    TestEnv e;
    test_env_init(&e, 2);
    CU_ASSERT_PTR_NULL(nn_conv2d_general(&e.tape, NULL, zeros_var(&e, 4, (const int[]){4, 2, 3, 3}), NULL, &g2));
    CU_ASSERT(tape_ok(&e.tape));
    test_env_free(&e);
}

/* ---- PyTorch parity ---------------------------------------------------------- */

/* Dataset /case/name into out (n values of type memtype); false if absent or of another size. */
static bool read_ds(hid_t f, const char *c, const char *name, hid_t memtype, void *out, size_t n) {
    char path[128];
    snprintf(path, sizeof path, "/%s/%s", c, name);
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    if (d < 0) return false;
    hid_t s = H5Dget_space(d);
    bool ok = s >= 0 && (size_t)H5Sget_simple_extent_npoints(s) == n &&
              H5Dread(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) >= 0;
    if (s >= 0) H5Sclose(s);
    H5Dclose(d);
    if (!ok) fprintf(stderr, "\n  %s: %s unreadable or not of %zu values", FIXTURE_PATH, path, n);
    return ok;
}

/* The dims of /case/name (4-D or 1-D) into dims; its rank, or -1. */
static int ds_dims(hid_t f, const char *c, const char *name, int *dims) {
    char path[128];
    snprintf(path, sizeof path, "/%s/%s", c, name);
    if (H5Lexists(f, path, H5P_DEFAULT) <= 0) return -1;
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT), s = H5Dget_space(d);
    hsize_t hd[4] = {0};
    int rank = H5Sget_simple_extent_ndims(s);
    if (rank < 1 || rank > 4 || H5Sget_simple_extent_dims(s, hd, NULL) < 0) rank = -1;
    for (int i = 0; i < rank; i++) dims[i] = (int)hd[i];
    H5Sclose(s);
    H5Dclose(d);
    return rank;
}

static const char *const torch_cases[] = {"grouped", "depthwise_m1", "depthwise_m2", "strided",
                                          "padded_asym", "same_even", "dilated", "nonsquare_dw"};

/* One fixture case: forward and every gradient within the tolerances of
 * test_torch.c (both sides float32, summed in different orders). */
static void torch_case(hid_t f, const char *c) {
    int xd[4], wd[4], yd[4], bd[1];
    int32_t geom[10];
    CU_ASSERT_FATAL(ds_dims(f, c, "x", xd) == 4 && ds_dims(f, c, "w", wd) == 4 && ds_dims(f, c, "y", yd) == 4);
    CU_ASSERT_FATAL(read_ds(f, c, "geom", H5T_NATIVE_INT32, geom, 10));
    const bool has_bias = ds_dims(f, c, "bias", bd) == 1;
    ConvGeom2d g = {geom[0], geom[1], geom[2], geom[3], geom[4], geom[5], geom[6], geom[7], geom[8]};
    if (geom[9]) { /* padding 'same': derive it as a config would, then hold it to what PyTorch used */
        ConvGeom2d s = g;
        s.pad_h = s.pad_w = s.pad_h_extra = s.pad_w_extra = 0;
        QtError err = {0};
        CU_ASSERT_FATAL(conv_geom2d_same(&s, wd[2], wd[3], &err) == QT_OK);
        CU_ASSERT(memcmp(&s, &g, sizeof g) == 0);
        g = s;
    }
    const size_t nx = (size_t)xd[0] * xd[1] * xd[2] * xd[3], nw = (size_t)wd[0] * wd[1] * wd[2] * wd[3];
    const size_t ny = (size_t)yd[0] * yd[1] * yd[2] * yd[3], nb = has_bias ? (size_t)bd[0] : 0;
    float *buf = malloc((2 * nx + 2 * nw + 2 * ny + 2 * nb + 1) * sizeof(float));
    float *x = buf, *dx = x + nx, *w = dx + nx, *dw = w + nw, *y = dw + nw, *dy = y + ny, *b = dy + ny, *db = b + nb;
    bool ok = read_ds(f, c, "x", H5T_NATIVE_FLOAT, x, nx) && read_ds(f, c, "dx", H5T_NATIVE_FLOAT, dx, nx) &&
              read_ds(f, c, "w", H5T_NATIVE_FLOAT, w, nw) && read_ds(f, c, "dw", H5T_NATIVE_FLOAT, dw, nw) &&
              read_ds(f, c, "y", H5T_NATIVE_FLOAT, y, ny) && read_ds(f, c, "dy", H5T_NATIVE_FLOAT, dy, ny) &&
              (!has_bias || (read_ds(f, c, "bias", H5T_NATIVE_FLOAT, b, nb) &&
                             read_ds(f, c, "dbias", H5T_NATIVE_FLOAT, db, nb)));
    CU_ASSERT(ok);
    TestEnv e;
    test_env_init(&e, 3);
    Var *xv = test_var(&e, x, 4, xd, true), *wv = test_var(&e, w, 4, wd, true);
    Var *bv = has_bias ? test_var(&e, b, 1, bd, true) : NULL;
    Var *yv = ok ? nn_conv2d_general(&e.tape, xv, wv, bv, &g) : NULL;
    if (ok && !yv) fprintf(stderr, "\n  %s: %s", c, e.tape.err.msg);
    CU_ASSERT(!ok || yv);
    if (yv && var_numel(yv) == ny && tape_backward_from(&e.tape, yv, dy) == QT_OK) {
        check(c, "y", yv->value.data, y, ny, 1e-5, 1e-5);
        check(c, "dx", xv->grad, dx, nx, 1e-5, 1e-5);
        check(c, "dw", wv->grad, dw, nw, 1e-5, 1e-5);
        if (has_bias) check(c, "dbias", bv->grad, db, nb, 1e-5, 1e-5);
    } else if (yv) {
        fprintf(stderr, "\n  %s: output of %zu values, the fixture's %zu", c, var_numel(yv), ny);
        CU_FAIL("output size differs from PyTorch's");
    }
    test_env_free(&e);
    free(buf);
}

static void test_torch_parity(void) {
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    hid_t f = H5Fopen(FIXTURE_PATH, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0) {
        test_skip("no %s (run from the repository root; regenerate with /usr/bin/python3 "
                  "tests/make_fixtures_conv.py %s)", FIXTURE_PATH, FIXTURE_PATH);
        return;
    }
    for (size_t i = 0; i < sizeof torch_cases / sizeof torch_cases[0]; i++) torch_case(f, torch_cases[i]);
    H5Fclose(f);
}

int register_nn_conv_general_suite(void) {
    CU_pSuite s = CU_add_suite("nn_conv_general", NULL, NULL);
    if (!s) return -1;
    const struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"general conv forward and accumulating backward match the direct loops", test_matches_ref},
        {"general conv gives the same bits at 1 and 2 threads", test_threads_identical},
        {"stride-1 depthwise gives the same bits at every kernel level", test_depthwise_levels_identical},
        {"plain geometry equals nn_conv2d bit for bit", test_plain_is_conv2d},
        {"general conv steps allocate nothing after the first", test_steady_state_arena},
        {"general conv gradcheck (groups, depthwise, strides, padding, dilation)", test_gradcheck},
        {"padding 'same' follows PyTorch 1.13", test_same_padding},
        {"general conv bad arguments name the sizes", test_bad_arguments},
        {"general conv matches PyTorch F.conv2d (tests/fixtures/torch_conv.h5)", test_torch_parity},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return 0;
}
