/* test_conv.c - the nn_conv suite: im2col convolution and pooling.
 *
 * The fast conv2d (im2col + one sgemm) is checked against the direct loops of
 * conv2d_forward_ref / conv2d_backward_ref on deliberately awkward shapes
 * (1x1 images, non-square images and kernels, strides that skip pixels,
 * padding wider than the kernel reach), then every op is checked against
 * finite differences, and bad shapes/arguments against their error messages. */
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "base/parallel.h"
#include "base/rng.h"
#include "nn/conv_taps.h"
#include "nn/ops.h"
#include "nn/pool2x2.h"
#include "test_util.h"

typedef struct {
    int N, C, H, W;  /* input */
    int OC, KH, KW;  /* weight */
    int stride, padding;
} ConvCase;

static const ConvCase conv_cases[] = {
    {1, 1, 1, 1, 1, 1, 1, 1, 0},    /* the smallest conv there is */
    {1, 1, 1, 1, 7, 3, 3, 1, 1},    /* 1x1 image, 3x3 kernel: all but the centre tap is padding */
    {2, 3, 7, 7, 7, 3, 3, 1, 1},    /* "same" conv */
    {3, 3, 7, 5, 7, 3, 3, 2, 1},    /* non-square image, stride 2 */
    {1, 3, 33, 33, 7, 3, 3, 3, 2},  /* stride 3 with padding 2 */
    {2, 1, 33, 7, 1, 5, 5, 2, 2},   /* 5x5 kernel, tall image */
    {2, 3, 7, 33, 7, 1, 3, 1, 0},   /* 1x3 kernel, wide image */
    {1, 3, 3, 3, 7, 3, 1, 3, 2},    /* 3x1 kernel, stride 3: output 2x3 */
    {2, 3, 3, 7, 1, 5, 3, 2, 1},    /* kernel taller than the image, fits only with padding */
    {4, 1, 7, 7, 7, 1, 1, 2, 0},    /* 1x1 kernel, stride 2: pointwise subsampling */
    {3, 5, 6, 7, 4, 1, 1, 1, 0},    /* 1x1 kernel, stride 1, no padding: x and dy read in place, dx written */
    {1, 3, 33, 1, 7, 3, 1, 2, 2},   /* W = 1 with padding 2: whole output columns are padding */
    {2, 3, 8, 6, 5, 3, 3, 2, 1},    /* stride 2 over an even image: through its parity planes */
    {2, 4, 6, 8, 3, 1, 1, 2, 0},    /* 1x1 kernel, stride 2 over an even image: the even-even plane alone */
};
#define N_CONV_CASES (sizeof conv_cases / sizeof conv_cases[0])

static int conv_out(int in, int kernel, int stride, int padding) { return (in + 2 * padding - kernel) / stride + 1; }

static void print_case(const char *what, const ConvCase *k) {
    fprintf(stderr, "\n  %s: N=%d C=%d H=%d W=%d OC=%d KH=%d KW=%d stride=%d padding=%d", what, k->N, k->C, k->H,
            k->W, k->OC, k->KH, k->KW, k->stride, k->padding);
}

/* ASSERT_ALL_CLOSE that also names the shape combination that failed. */
#define ASSERT_CASE_CLOSE(what, k, a, b, n, atol, rtol)                                             \
    do {                                                                                            \
        if (test_close_ratio((a), (b), (n), (atol), (rtol), NULL) > 1.0) print_case((what), (k));   \
        ASSERT_ALL_CLOSE((a), (b), (n), (atol), (rtol));                                            \
    } while (0)

/* Tolerance for a float32 sum of `terms` products of O(1) numbers compared
 * with the same sum taken in double. Rounding errors of a float sum grow
 * about like terms * 2^-24 * rms(term) (random-walk partial sums), i.e.
 * ~1e-7 * terms here; 1e-6 * terms leaves a 10x margin over that estimate
 * (the errors measured with OpenBLAS are ~100x below it) yet stays far below
 * the O(0.1..1) error of any real bug (a wrong tap, a pad read as data, a
 * mis-ordered column) for every size used in this file (terms <= 500). */
static double sum_atol(size_t terms) { return 1e-6 * (double)terms + 1e-6; }
#define SUM_RTOL 1e-5

/* [n] floats from the env's arena. */
static float *arena_floats(TestEnv *e, size_t n) { return tape_alloc(&e->tape, n * sizeof(float)); }

static float *uniform_floats(TestEnv *e, Rng *r, size_t n) {
    float *p = arena_floats(e, n);
    rng_fill_uniform(r, p, n, -1.0f, 1.0f);
    return p;
}

static float *zero_floats(TestEnv *e, size_t n) { return arena_calloc(&e->arena, n * sizeof(float)); }

/* The Vars of one case: x (N, C, H, W), w (OC, C, KH, KW), bias (OC,) or NULL. */
typedef struct {
    Var *x, *w, *bias;
} ConvVars;

static ConvVars make_conv_vars(TestEnv *e, Rng *r, const ConvCase *k, bool with_bias, bool requires_grad) {
    ConvVars v;
    size_t nx = (size_t)k->N * k->C * k->H * k->W, nw = (size_t)k->OC * k->C * k->KH * k->KW;
    v.x = test_var(e, uniform_floats(e, r, nx), 4, (const int[]){k->N, k->C, k->H, k->W}, requires_grad);
    v.w = test_var(e, uniform_floats(e, r, nw), 4, (const int[]){k->OC, k->C, k->KH, k->KW}, requires_grad);
    v.bias = with_bias ? test_var(e, uniform_floats(e, r, (size_t)k->OC), 1, &k->OC, requires_grad) : NULL;
    return v;
}

/* Sets up env and rng for case k (seeded from `seed`), runs nn_conv2d on
 * fresh Vars and returns its output; NULL (case printed) if conv2d failed.
 * The caller frees the env either way. */
static Var *run_conv_case(TestEnv *e, Rng *r, ConvVars *v, const ConvCase *k, int with_bias, bool requires_grad,
                          uint64_t seed) {
    test_env_init(e, seed);
    rng_init(r, seed + 1000, RNG_STREAM_INIT);
    *v = make_conv_vars(e, r, k, with_bias, requires_grad);
    Var *y = nn_conv2d(&e->tape, v->x, v->w, v->bias, k->stride, k->padding);
    CU_ASSERT_PTR_NOT_NULL(y);
    if (!y) print_case(e->tape.err.msg, k);
    return y;
}

/* ---- forward and backward vs the direct loops ------------------------------ */

static void test_conv2d_forward_matches_ref(void) {
    for (size_t i = 0; i < N_CONV_CASES; i++) {
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            const ConvCase *k = &conv_cases[i];
            TestEnv e;
            Rng r;
            ConvVars v;
            Var *y = run_conv_case(&e, &r, &v, k, with_bias, false, 1000 + i);
            if (!y) {
                test_env_free(&e);
                continue;
            }
            const int OH = conv_out(k->H, k->KH, k->stride, k->padding);
            const int OW = conv_out(k->W, k->KW, k->stride, k->padding);
            CU_ASSERT(y->value.ndim == 4 && y->value.shape[0] == k->N && y->value.shape[1] == k->OC &&
                      y->value.shape[2] == OH && y->value.shape[3] == OW);
            CU_ASSERT(!y->requires_grad); /* no input asked for a gradient */
            size_t ny = var_numel(y);
            float *ref = arena_floats(&e, ny);
            conv2d_forward_ref(ref, v.x->value.data, v.w->value.data, v.bias ? v.bias->value.data : NULL, k->N, k->C,
                               k->H, k->W, k->OC, k->KH, k->KW, k->stride, k->padding);
            /* Each output sums C*KH*KW products of values in [-1, 1]. */
            size_t terms = (size_t)k->C * k->KH * k->KW;
            ASSERT_CASE_CLOSE("conv2d forward", k, y->value.data, ref, ny, sum_atol(terms), SUM_RTOL);
            test_env_free(&e);
        }
    }
}

static void test_conv2d_backward_matches_ref(void) {
    for (size_t i = 0; i < N_CONV_CASES; i++) {
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            const ConvCase *k = &conv_cases[i];
            TestEnv e;
            Rng r;
            ConvVars v;
            Var *y = run_conv_case(&e, &r, &v, k, with_bias, true, 3000 + i);
            if (!y) {
                test_env_free(&e);
                continue;
            }
            size_t ny = var_numel(y), nx = var_numel(v.x), nw = var_numel(v.w);
            float *dy = arena_floats(&e, ny);
            rng_fill_normal(&r, dy, ny, 0.0f, 1.0f);
            CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, dy), QT_OK);

            float *dx = zero_floats(&e, nx), *dw = zero_floats(&e, nw), *db = zero_floats(&e, (size_t)k->OC);
            conv2d_backward_ref(dx, dw, with_bias ? db : NULL, dy, v.x->value.data, v.w->value.data, k->N, k->C,
                                k->H, k->W, k->OC, k->KH, k->KW, k->stride, k->padding);
            CU_ASSERT_PTR_NOT_NULL(v.x->grad);
            CU_ASSERT_PTR_NOT_NULL(v.w->grad);
            const int OH = conv_out(k->H, k->KH, k->stride, k->padding);
            const int OW = conv_out(k->W, k->KW, k->stride, k->padding);
            const size_t positions = (size_t)k->N * OH * OW;
            /* dx sums OC*KH*KW products dy*w; dW and dbias sum one term per output position. */
            if (v.x->grad)
                ASSERT_CASE_CLOSE("conv2d dx", k, v.x->grad, dx, nx, sum_atol((size_t)k->OC * k->KH * k->KW),
                                  SUM_RTOL);
            if (v.w->grad) ASSERT_CASE_CLOSE("conv2d dw", k, v.w->grad, dw, nw, sum_atol(positions), SUM_RTOL);
            if (with_bias) {
                CU_ASSERT_PTR_NOT_NULL(v.bias->grad);
                if (v.bias->grad)
                    ASSERT_CASE_CLOSE("conv2d dbias", k, v.bias->grad, db, (size_t)k->OC, sum_atol(positions),
                                      SUM_RTOL);
            }
            test_env_free(&e);
        }
    }
}

/* Backward must add to grads that already hold something (a parameter's grad
 * over several micro-batches) and leave inputs without requires_grad alone. */
static void test_conv2d_backward_accumulates_and_skips(void) {
    /* a strided 3x3, and a pointwise conv (whose dx comes straight out of the product) */
    static const ConvCase ks[2] = {{2, 3, 7, 5, 4, 3, 3, 2, 1}, {3, 6, 5, 4, 5, 1, 1, 1, 0}};
    for (int variant = 0; variant < 4; variant++) {
        const ConvCase k = ks[variant / 2];
        TestEnv e;
        test_env_init(&e, 5000 + variant);
        Rng r;
        rng_init(&r, 5100 + variant, RNG_STREAM_INIT);
        ConvVars v = make_conv_vars(&e, &r, &k, true, true);
        size_t nx = var_numel(v.x), nw = var_numel(v.w);
        float *dx = zero_floats(&e, nx), *dw = zero_floats(&e, nw), *db = zero_floats(&e, (size_t)k.OC);
        if (variant % 2 == 0) {
            /* Everything requires grad and already holds 0.25 / 0.5 / -1. */
            v.x->grad = arena_floats(&e, nx);
            v.w->grad = arena_floats(&e, nw);
            v.w->is_param = true;
            v.bias->grad = arena_floats(&e, (size_t)k.OC);
            for (size_t j = 0; j < nx; j++) v.x->grad[j] = dx[j] = 0.25f;
            for (size_t j = 0; j < nw; j++) v.w->grad[j] = dw[j] = 0.5f;
            for (int j = 0; j < k.OC; j++) v.bias->grad[j] = db[j] = -1.0f;
        } else {
            /* Only the weight learns: x is data, the bias is frozen. */
            v.x->requires_grad = false;
            v.bias->requires_grad = false;
        }
        Var *y = nn_conv2d(&e.tape, v.x, v.w, v.bias, k.stride, k.padding);
        CU_ASSERT_PTR_NOT_NULL_FATAL(y);
        CU_ASSERT(y->requires_grad);
        size_t ny = var_numel(y);
        float *dy = arena_floats(&e, ny);
        rng_fill_normal(&r, dy, ny, 0.0f, 1.0f);
        CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, dy), QT_OK);
        conv2d_backward_ref(variant % 2 == 0 ? dx : NULL, dw, variant % 2 == 0 ? db : NULL, dy, v.x->value.data,
                            v.w->value.data, k.N, k.C, k.H, k.W, k.OC, k.KH, k.KW, k.stride, k.padding);
        const size_t positions = (size_t)k.N * conv_out(k.H, k.KH, k.stride, k.padding) *
                                 conv_out(k.W, k.KW, k.stride, k.padding);
        CU_ASSERT_PTR_NOT_NULL_FATAL(v.w->grad);
        ASSERT_ALL_CLOSE(v.w->grad, dw, nw, sum_atol(positions), SUM_RTOL);
        if (variant % 2 == 0) {
            ASSERT_ALL_CLOSE(v.x->grad, dx, nx, sum_atol((size_t)k.OC * k.KH * k.KW), SUM_RTOL);
            ASSERT_ALL_CLOSE(v.bias->grad, db, (size_t)k.OC, sum_atol(positions), SUM_RTOL);
        } else {
            CU_ASSERT_PTR_NULL(v.x->grad);
            CU_ASSERT_PTR_NULL(v.bias->grad);
        }
        test_env_free(&e);
    }
}

/* With gradients disabled the op computes its output and records nothing. */
static void test_conv2d_no_grad_records_nothing(void) {
    const ConvCase k = {2, 3, 7, 7, 7, 3, 3, 1, 1};
    TestEnv e;
    test_env_init(&e, 5200);
    Rng r;
    rng_init(&r, 5201, RNG_STREAM_INIT);
    ConvVars v = make_conv_vars(&e, &r, &k, true, true);
    e.tape.grad_enabled = false;
    Var *y = nn_conv2d(&e.tape, v.x, v.w, v.bias, k.stride, k.padding);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    CU_ASSERT(!y->requires_grad);
    CU_ASSERT_EQUAL(e.tape.n_nodes, 0);
    Var *p = nn_maxpool2d(&e.tape, y, 2, 2);
    CU_ASSERT_PTR_NOT_NULL(p);
    CU_ASSERT_EQUAL(e.tape.n_nodes, 0);
    test_env_free(&e);
}

/* ---- im2col / col2im ---------------------------------------------------- */

static void test_im2col_layout(void) {
    /* x (1, 2, 2, 3), kernel 2x2, stride 1, no padding: col (8, 2), rows (c, kh, kw), columns ow. */
    const float x1[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    const float col1_expected[] = {1, 2, 2, 3, 4, 5, 5, 6, 7, 8, 8, 9, 10, 11, 11, 12};
    float col1[16];
    im2col(col1, x1, 1, 2, 2, 3, 2, 2, 1, 0, 1, 2);
    ASSERT_ALL_CLOSE(col1, col1_expected, 16, 1e-12, 0.0); /* copies: exact */

    /* x (2, 1, 2, 2), kernel 1x1, stride 2, padding 1: output 2x2 per image, only
     * (oh, ow) = (1, 1) reads a pixel (x[1][1]); columns ordered (n, oh, ow). */
    const float x2[] = {1, 2, 3, 4, 5, 6, 7, 8};
    const float col2_expected[] = {0, 0, 0, 4, 0, 0, 0, 8};
    float col2[8];
    im2col(col2, x2, 2, 1, 2, 2, 1, 1, 2, 1, 2, 2);
    ASSERT_ALL_CLOSE(col2, col2_expected, 8, 1e-12, 0.0);

    /* col2im scatters back and adds: x2 + col2im(col2) doubles the pixels read. */
    float dx[8];
    memcpy(dx, x2, sizeof dx);
    col2im(dx, col2, 2, 1, 2, 2, 1, 1, 2, 1, 2, 2);
    const float dx_expected[] = {1, 2, 3, 8, 5, 6, 7, 16};
    ASSERT_ALL_CLOSE(dx, dx_expected, 8, 1e-12, 0.0);
}

/* col2im is im2col's adjoint: <im2col(x), c> == <x, col2im(c)>. Both sides
 * are taken in double; col2im itself adds in float, at most KH*KW terms per
 * pixel and channel (<= 25 here), so the sides differ by at most about
 * 25 * 2^-24 * sum|term| < 2e-6 * sum|term|; 1e-5 is a safe bound while a
 * mis-scattered tap changes the product by O(1) * a whole term. */
static void test_im2col_col2im_adjoint(void) {
    for (size_t i = 0; i < N_CONV_CASES; i++) {
        const ConvCase *k = &conv_cases[i];
        TestEnv e;
        test_env_init(&e, 6000 + i);
        Rng r;
        rng_init(&r, 6100 + i, RNG_STREAM_INIT);
        const int OH = conv_out(k->H, k->KH, k->stride, k->padding);
        const int OW = conv_out(k->W, k->KW, k->stride, k->padding);
        size_t nx = (size_t)k->N * k->C * k->H * k->W;
        size_t ncol = (size_t)k->C * k->KH * k->KW * k->N * OH * OW;
        float *x = uniform_floats(&e, &r, nx), *c = uniform_floats(&e, &r, ncol);
        float *col = arena_floats(&e, ncol), *dx = zero_floats(&e, nx);
        im2col(col, x, k->N, k->C, k->H, k->W, k->KH, k->KW, k->stride, k->padding, OH, OW);
        col2im(dx, c, k->N, k->C, k->H, k->W, k->KH, k->KW, k->stride, k->padding, OH, OW);
        double lhs = 0.0, rhs = 0.0, scale = 0.0;
        for (size_t j = 0; j < ncol; j++) {
            lhs += (double)col[j] * c[j];
            scale += fabs((double)col[j] * c[j]);
        }
        for (size_t j = 0; j < nx; j++) rhs += (double)x[j] * dx[j];
        if (!(fabs(lhs - rhs) <= 1e-5 * scale + 1e-12)) {
            print_case("im2col adjoint", k);
            fprintf(stderr, " <im2col(x), c> = %.12g, <x, col2im(c)> = %.12g\n", lhs, rhs);
        }
        CU_ASSERT(fabs(lhs - rhs) <= 1e-5 * scale + 1e-12);
        test_env_free(&e);
    }
}

/* ---- finite differences ------------------------------------------------------ */

/* gradcheck's defaults (see test_util.h): O(1) values, eps 1e-3. */
#define GC_EPS 1e-3
#define GC_ATOL 2e-3
#define GC_RTOL 1e-2

typedef struct {
    int stride, padding;
    bool with_bias;
} ConvArgs;

static Var *conv_fn(Tape *t, Var **in, void *ctx) {
    const ConvArgs *a = ctx;
    return nn_conv2d(t, in[0], in[1], a->with_bias ? in[2] : NULL, a->stride, a->padding);
}

typedef struct {
    int kernel, stride;
    bool max;
} PoolArgs;

static Var *pool_fn(Tape *t, Var **in, void *ctx) {
    const PoolArgs *a = ctx;
    return a->max ? nn_maxpool2d(t, in[0], a->kernel, a->stride) : nn_avgpool2d(t, in[0], a->kernel, a->stride);
}

static GradcheckInput gc_input(const float *data, int ndim, const int *shape) {
    GradcheckInput in = {.data = data, .ndim = ndim, .check = true};
    for (int i = 0; i < ndim; i++) in.shape[i] = shape[i];
    return in;
}

static void test_conv2d_gradcheck(void) {
    const ConvCase cases[] = {
        {2, 2, 5, 4, 3, 3, 2, 2, 1}, /* non-square kernel, stride 2 */
        {1, 1, 4, 4, 2, 3, 3, 1, 2}, /* padding 2: border outputs see only padding and a corner */
        {1, 3, 3, 5, 2, 1, 1, 3, 0}, /* 1x1 kernel, stride 3 skips pixels (their grad must be 0) */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const ConvCase *k = &cases[i];
        TestEnv e;
        test_env_init(&e, 7000 + i);
        Rng r;
        rng_init(&r, 7100 + i, RNG_STREAM_INIT);
        const int xs[] = {k->N, k->C, k->H, k->W}, ws[] = {k->OC, k->C, k->KH, k->KW};
        size_t nx = (size_t)k->N * k->C * k->H * k->W, nw = (size_t)k->OC * k->C * k->KH * k->KW;
        float *x = arena_floats(&e, nx), *w = arena_floats(&e, nw), *b = arena_floats(&e, (size_t)k->OC);
        rng_fill_normal(&r, x, nx, 0.0f, 1.0f);
        rng_fill_normal(&r, w, nw, 0.0f, 1.0f);
        rng_fill_normal(&r, b, (size_t)k->OC, 0.0f, 1.0f);
        GradcheckInput in[3] = {gc_input(x, 4, xs), gc_input(w, 4, ws), gc_input(b, 1, &k->OC)};
        const bool with_bias = i != 2;
        ConvArgs args = {k->stride, k->padding, with_bias};
        bool ok = gradcheck("conv2d", conv_fn, &args, in, with_bias ? 3 : 2, GC_EPS, GC_ATOL, GC_RTOL);
        if (!ok) print_case("conv2d gradcheck", k);
        CU_ASSERT(ok);
        test_env_free(&e);
    }
}

/* Pool cases: x (N, C, H, W), kernel, stride. */
static const struct {
    int shape[4], kernel, stride;
} pool_cases[] = {
    {{2, 2, 7, 7}, 3, 2}, /* overlapping windows */
    {{1, 3, 5, 6}, 2, 1}, /* stride 1: every interior pixel is in 4 windows */
    {{1, 1, 4, 4}, 2, 2}, /* the classic tiling */
    {{2, 1, 7, 8}, 3, 3}, /* the last row and columns belong to no window: grad 0 */
};
#define N_POOL_CASES (sizeof pool_cases / sizeof pool_cases[0])

static void test_maxpool2d_gradcheck(void) {
    for (size_t i = 0; i < N_POOL_CASES; i++) {
        TestEnv e;
        test_env_init(&e, 8000 + i);
        Rng r;
        rng_init(&r, 8100 + i, RNG_STREAM_INIT);
        const int *s = pool_cases[i].shape;
        size_t n = (size_t)s[0] * s[1] * s[2] * s[3];
        /* Distinct values 0.01 apart, shuffled: a +-eps (1e-3) nudge never changes
         * a window's winner, so max is differentiable at every test point. */
        uint32_t *perm = tape_alloc(&e.tape, n * sizeof *perm);
        for (size_t j = 0; j < n; j++) perm[j] = (uint32_t)j;
        rng_shuffle_u32(&r, perm, n);
        float *x = arena_floats(&e, n);
        for (size_t j = 0; j < n; j++) x[j] = 0.01f * (float)perm[j];
        GradcheckInput in = gc_input(x, 4, s);
        PoolArgs args = {pool_cases[i].kernel, pool_cases[i].stride, true};
        bool ok = gradcheck("maxpool2d", pool_fn, &args, &in, 1, GC_EPS, GC_ATOL, GC_RTOL);
        if (!ok) fprintf(stderr, "  (maxpool2d case %zu)\n", i);
        CU_ASSERT(ok);
        test_env_free(&e);
    }
}

static void test_avgpool2d_gradcheck(void) {
    for (size_t i = 0; i < N_POOL_CASES; i++) {
        TestEnv e;
        test_env_init(&e, 8200 + i);
        Rng r;
        rng_init(&r, 8300 + i, RNG_STREAM_INIT);
        const int *s = pool_cases[i].shape;
        size_t n = (size_t)s[0] * s[1] * s[2] * s[3];
        float *x = arena_floats(&e, n);
        rng_fill_normal(&r, x, n, 0.0f, 1.0f);
        GradcheckInput in = gc_input(x, 4, s);
        PoolArgs args = {pool_cases[i].kernel, pool_cases[i].stride, false};
        bool ok = gradcheck("avgpool2d", pool_fn, &args, &in, 1, GC_EPS, GC_ATOL, GC_RTOL);
        if (!ok) fprintf(stderr, "  (avgpool2d case %zu)\n", i);
        CU_ASSERT(ok);
        test_env_free(&e);
    }
}

/* ---- pooling by hand ---------------------------------------------------------- */

static void test_maxpool2d_hand_example(void) {
    TestEnv e;
    test_env_init(&e, 9000);
    const float x[] = {
        1, 3, 2, 0,
        5, 4, 1, 7,
        0, 2, 9, 8,
        6, 1, 3, 3,
    };
    Var *xv = test_var(&e, x, 4, (const int[]){1, 1, 4, 4}, true);
    Var *y = nn_maxpool2d(&e.tape, xv, 2, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    CU_ASSERT(y->value.shape[2] == 2 && y->value.shape[3] == 2);
    const float y_expected[] = {5, 7, 6, 9};
    ASSERT_ALL_CLOSE(y->value.data, y_expected, 4, 1e-12, 0.0);
    const float dy[] = {1, 2, 3, 4};
    CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, dy), QT_OK);
    const float dx_expected[] = {
        0, 0, 0, 0,
        1, 0, 0, 2,
        0, 0, 4, 0,
        3, 0, 0, 0,
    };
    CU_ASSERT_PTR_NOT_NULL_FATAL(xv->grad);
    ASSERT_ALL_CLOSE(xv->grad, dx_expected, 16, 1e-12, 0.0);
    test_env_free(&e);
}

/* Equal values: the first in row-major window order wins and gets the gradient. */
static void test_maxpool2d_tie_goes_to_first(void) {
    TestEnv e;
    test_env_init(&e, 9100);
    /* kernel 2, stride 1 on a 2x3 plane: window 0 = {2, 2 | 2, 0}, window 1 = {2, 1 | 0, 2}. */
    const float x[] = {
        2, 2, 1,
        2, 0, 2,
    };
    Var *xv = test_var(&e, x, 4, (const int[]){1, 1, 2, 3}, true);
    Var *y = nn_maxpool2d(&e.tape, xv, 2, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    const float y_expected[] = {2, 2};
    ASSERT_ALL_CLOSE(y->value.data, y_expected, 2, 1e-12, 0.0);
    const float dy[] = {1, 10};
    CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, dy), QT_OK);
    const float dx_expected[] = {
        1, 10, 0,
        0, 0, 0,
    };
    CU_ASSERT_PTR_NOT_NULL_FATAL(xv->grad);
    ASSERT_ALL_CLOSE(xv->grad, dx_expected, 6, 1e-12, 0.0);

    /* A constant plane: a single window, all tied; everything goes to (0, 0). */
    tape_reset(&e.tape);
    const float flat[9] = {5, 5, 5, 5, 5, 5, 5, 5, 5};
    xv = test_var(&e, flat, 4, (const int[]){1, 1, 3, 3}, true);
    y = nn_maxpool2d(&e.tape, xv, 3, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    const float one = 1.0f;
    CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, &one), QT_OK);
    CU_ASSERT_PTR_NOT_NULL_FATAL(xv->grad);
    CU_ASSERT_EQUAL(xv->grad[0], 1.0f);
    for (int j = 1; j < 9; j++) CU_ASSERT_EQUAL(xv->grad[j], 0.0f);
    test_env_free(&e);
}

/* A NaN in a window is passed on, not hidden by the comparisons. */
static void test_maxpool2d_propagates_nan(void) {
    TestEnv e;
    test_env_init(&e, 9200);
    const float x[] = {1, NAN, 3, 2};
    Var *xv = test_var(&e, x, 4, (const int[]){1, 1, 2, 2}, false);
    Var *y = nn_maxpool2d(&e.tape, xv, 2, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    CU_ASSERT(isnan(y->value.data[0]));
    test_env_free(&e);
}

static void test_avgpool2d_hand_example(void) {
    TestEnv e;
    test_env_init(&e, 9300);
    const float x[] = {
        1, 2, 3,
        4, 5, 6,
        7, 8, 9,
    };
    Var *xv = test_var(&e, x, 4, (const int[]){1, 1, 3, 3}, true);
    Var *y = nn_avgpool2d(&e.tape, xv, 2, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    const float y_expected[] = {3, 4, 6, 7};
    ASSERT_ALL_CLOSE(y->value.data, y_expected, 4, 1e-12, 0.0);
    const float dy[] = {4, 8, 12, 16};
    CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, dy), QT_OK);
    /* Each dy spread as dy/4 over its window; the centre is in all four. */
    const float dx_expected[] = {
        1, 3, 2,
        4, 10, 6,
        3, 7, 4,
    };
    CU_ASSERT_PTR_NOT_NULL_FATAL(xv->grad);
    ASSERT_ALL_CLOSE(xv->grad, dx_expected, 9, 1e-12, 0.0);
    test_env_free(&e);
}

/* ---- errors ------------------------------------------------------------------- */

/* A zero-filled Var on e's tape. */
static Var *zeros_var(TestEnv *e, int ndim, const int *shape) {
    Var *v = tape_new_var(&e->tape, ndim, shape);
    if (v) memset(v->value.data, 0, var_numel(v) * sizeof(float));
    return v;
}

/* y must be NULL with tape error `status` whose message contains each of
 * needles[] (NULL-terminated); the tape is reset afterwards. */
static void expect_error(TestEnv *e, const char *what, Var *y, QtStatus status, const char *const *needles) {
    bool ok = y == NULL && e->tape.err.status == status;
    for (const char *const *s = needles; ok && *s; s++) ok = strstr(e->tape.err.msg, *s) != NULL;
    if (!ok)
        fprintf(stderr, "\n  %s: got %s, status %s (wanted %s), message \"%s\"\n", what, y ? "a Var" : "NULL",
                qt_status_name(e->tape.err.status), qt_status_name(status), e->tape.err.msg);
    CU_ASSERT(ok);
    tape_reset(&e->tape);
}

static void test_conv2d_bad_inputs(void) {
    TestEnv e;
    test_env_init(&e, 9400);
    Tape *t = &e.tape;
    const int x8[] = {8, 3, 28, 28}, w1[] = {32, 1, 3, 3};
    expect_error(&e, "channel mismatch", nn_conv2d(t, zeros_var(&e, 4, x8), zeros_var(&e, 4, w1), NULL, 1, 1),
                 QT_ERR_SHAPE, (const char *[]){"conv2d", "(8, 3, 28, 28)", "(32, 1, 3, 3)", "channels", NULL});

    const int x3[] = {1, 1, 3, 3}, w5[] = {2, 1, 5, 5};
    expect_error(&e, "kernel > padded input", nn_conv2d(t, zeros_var(&e, 4, x3), zeros_var(&e, 4, w5), NULL, 1, 0),
                 QT_ERR_SHAPE, (const char *[]){"conv2d", "(1, 1, 3, 3)", "(2, 1, 5, 5)", NULL});
    /* The boundary: padding 1 makes the 3x3 input 5x5, exactly one output. */
    Var *y = nn_conv2d(t, zeros_var(&e, 4, x3), zeros_var(&e, 4, w5), NULL, 1, 1);
    CU_ASSERT(y && y->value.shape[2] == 1 && y->value.shape[3] == 1 && tape_ok(t));
    tape_reset(t);

    const int x1[] = {2, 1, 6, 6}, w3[] = {4, 1, 3, 3};
    expect_error(&e, "stride 0", nn_conv2d(t, zeros_var(&e, 4, x1), zeros_var(&e, 4, w3), NULL, 0, 1), QT_ERR_ARG,
                 (const char *[]){"conv2d", "stride", "(2, 1, 6, 6)", "(4, 1, 3, 3)", NULL});
    expect_error(&e, "padding -1", nn_conv2d(t, zeros_var(&e, 4, x1), zeros_var(&e, 4, w3), NULL, 1, -1),
                 QT_ERR_ARG, (const char *[]){"conv2d", "padding", "(2, 1, 6, 6)", NULL});

    const int x3d[] = {3, 28, 28}, w33[] = {8, 3, 3, 3};
    expect_error(&e, "3-D input", nn_conv2d(t, zeros_var(&e, 3, x3d), zeros_var(&e, 4, w33), NULL, 1, 0),
                 QT_ERR_SHAPE, (const char *[]){"conv2d", "(3, 28, 28)", "4-D", NULL});
    const int w2d[] = {4, 9};
    expect_error(&e, "2-D weight", nn_conv2d(t, zeros_var(&e, 4, x1), zeros_var(&e, 2, w2d), NULL, 1, 0),
                 QT_ERR_SHAPE, (const char *[]){"conv2d", "(4, 9)", NULL});

    const int b5[] = {5};
    expect_error(&e, "bias size",
                 nn_conv2d(t, zeros_var(&e, 4, x1), zeros_var(&e, 4, w3), zeros_var(&e, 1, b5), 1, 1),
                 QT_ERR_SHAPE, (const char *[]){"conv2d", "bias", "(5,)", "(4, 1, 3, 3)", NULL});

    /* NULL inputs (an earlier op failed): NULL back, no new error, no crash. */
    CU_ASSERT_PTR_NULL(nn_conv2d(t, NULL, zeros_var(&e, 4, w3), NULL, 1, 1));
    CU_ASSERT_PTR_NULL(nn_conv2d(t, zeros_var(&e, 4, x1), NULL, NULL, 1, 1));
    CU_ASSERT_PTR_NULL(nn_maxpool2d(t, NULL, 2, 2));
    CU_ASSERT_PTR_NULL(nn_avgpool2d(t, NULL, 2, 2));
    CU_ASSERT(tape_ok(t));
    test_env_free(&e);
}

/* globalavgpool: each plane's mean (eight interleaved double sums) within float rounding of a long-double sum,
 * the same bits on 1 and 2 threads (the planes go over the pool above 2^16 inputs), the gradient dy / area. */
static void test_globalavgpool_threads_agree(void) {
    enum { N = 40, C = 33, H = 7, W = 9 }; /* 83,160 inputs; an area not a multiple of 8 */
    const size_t n = (size_t)N * C * H * W, planes = (size_t)N * C;
    float *x = malloc(n * sizeof *x), *y[2], *dy = malloc(planes * sizeof *dy);
    CU_ASSERT_FATAL(x && dy);
    Rng r;
    rng_init(&r, 77, 0);
    rng_fill_uniform(&r, x, n, -1.0f, 3.0f);
    for (size_t i = 0; i < n; i++) x[i] += (float)(i % 5) * 1e3f; /* offsets that cost a naive float sum bits */
    for (size_t p = 0; p < planes; p++) dy[p] = (float)p;
    const int before = parallel_get_threads();
    for (int th = 0; th < 2; th++) {
        parallel_set_threads(th + 1);
        TestEnv e;
        test_env_init(&e, 1);
        Var *xv = test_var(&e, x, 4, (const int[]){N, C, H, W}, true);
        Var *yv = nn_globalavgpool(&e.tape, xv);
        CU_ASSERT_FATAL(yv && tape_backward_from(&e.tape, yv, dy) == QT_OK);
        y[th] = malloc(planes * sizeof(float));
        CU_ASSERT_FATAL(y[th] != NULL);
        memcpy(y[th], yv->value.data, planes * sizeof(float));
        for (size_t p = 0; p < planes; p += 97)
            CU_ASSERT_DOUBLE_EQUAL(xv->grad[p * H * W + 5], dy[p] * (float)(1.0 / (H * W)), 1e-6 * (1 + dy[p]));
        test_env_free(&e);
    }
    parallel_set_threads(before);
    CU_ASSERT(memcmp(y[0], y[1], planes * sizeof(float)) == 0);
    for (size_t p = 0; p < planes; p++) {
        long double s = 0;
        for (size_t i = 0; i < (size_t)H * W; i++) s += x[p * H * W + i];
        const double ref = (double)(s / (H * W));
        CU_ASSERT(fabs(y[0][p] - ref) <= 1e-7 * fabs(ref) + 1e-12);
    }
    free(x), free(dy), free(y[0]), free(y[1]);
}

static void test_pool_bad_inputs(void) {
    TestEnv e;
    test_env_init(&e, 9500);
    Tape *t = &e.tape;
    const int x[] = {1, 2, 3, 3};
    expect_error(&e, "maxpool kernel > input", nn_maxpool2d(t, zeros_var(&e, 4, x), 4, 1), QT_ERR_SHAPE,
                 (const char *[]){"maxpool2d", "(1, 2, 3, 3)", NULL});
    expect_error(&e, "avgpool kernel > input", nn_avgpool2d(t, zeros_var(&e, 4, x), 4, 4), QT_ERR_SHAPE,
                 (const char *[]){"avgpool2d", "(1, 2, 3, 3)", NULL});
    expect_error(&e, "maxpool kernel 0", nn_maxpool2d(t, zeros_var(&e, 4, x), 0, 1), QT_ERR_ARG,
                 (const char *[]){"maxpool2d", "kernel", "(1, 2, 3, 3)", NULL});
    expect_error(&e, "avgpool stride 0", nn_avgpool2d(t, zeros_var(&e, 4, x), 2, 0), QT_ERR_ARG,
                 (const char *[]){"avgpool2d", "stride", "(1, 2, 3, 3)", NULL});
    const int x2d[] = {4, 9};
    expect_error(&e, "maxpool 2-D input", nn_maxpool2d(t, zeros_var(&e, 2, x2d), 2, 2), QT_ERR_SHAPE,
                 (const char *[]){"maxpool2d", "(4, 9)", "4-D", NULL});
    test_env_free(&e);
}

/* The 2x2/stride-2 fast path against the generic window loops: values and
 * argmax, on odd sizes (a dropped last row/column), many ties (values drawn
 * from 3 levels) and NaNs. */
static void test_maxpool2d_fast_path_matches_generic(void) {
    const int sizes[][2] = {{2, 2}, {5, 7}, {28, 28}, {9, 4}};
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
        const int N = 2, C = 3, H = sizes[c][0], W = sizes[c][1];
        TestEnv e;
        test_env_init(&e, 1);
        float *x = malloc((size_t)N * C * H * W * sizeof(float));
        Rng r;
        rng_init(&r, 40 + c, 1);
        rng_fill_uniform(&r, x, (size_t)N * C * H * W, 0.0f, 3.0f);
        for (int i = 0; i < N * C * H * W; i++) x[i] = floorf(x[i]); /* 0, 1, 2: ties everywhere */
        x[1] = NAN;
        x[N * C * H * W - 1] = NAN;
        Var *v = test_var(&e, x, 4, (int[]){N, C, H, W}, true);
        Var *fast = nn_maxpool2d(&e.tape, v, 2, 2);
        maxpool_force_generic = true;
        Var *slow = nn_maxpool2d(&e.tape, v, 2, 2);
        maxpool_force_generic = false;
        CU_ASSERT_FATAL(fast && slow);
        size_t n = var_numel(fast);
        /* memcmp: NaN == NaN bitwise, and ties must pick the same element. */
        CU_ASSERT_EQUAL(memcmp(fast->value.data, slow->value.data, n * sizeof(float)), 0);
        const int32_t *fa = e.tape.nodes[0].ctx, *sa = e.tape.nodes[1].ctx;
        CU_ASSERT_EQUAL(memcmp(fa, sa, n * sizeof(int32_t)), 0);
        free(x);
        test_env_free(&e);
    }
}

/* The fused epilogue's relu + 2x2 pool rows in AVX2 (pool2x2_x86.c, 8 windows a group, the last moved back)
 * against the plain rows (pool2x2_relu_plane, SSE2 or scalar), bit for bit: values and winners forward, the
 * gradient backward. Rows of 4 to 7 windows (a group a row pair, whose lanes past the row the next row pair
 * rewrites), of 8 to 24 (one group, a group and an overlapping one, three), odd sizes (a last row or column in no
 * window), values from a few levels (ties everywhere), -0, NaN and negatives (the relu's
 * cases), three biases. Every buffer is exactly its size (the sanitizer build catches a read or write past it);
 * the output planes are preset with a NaN canary, so a value neither writes shows up as a difference. */
static void test_pool2x2_avx2_rows_match_plain(void) {
    if (conv_taps_cpu() < CONV_TAPS_AVX2) {
        test_skip("relu + 2x2 pool rows in AVX2: this CPU has no AVX2 with FMA (the taps level gates both)");
        return;
    }
    static const int OWS[] = {8, 10, 14, 16, 17, 18, 23, 28, 31, 32, 33, 47, 48}, OHS[] = {2, 3, 4, 5, 7, 14, 28};
    static const float BIAS[] = {0.0f, 0.5f, -1.0f};
    int bad = 0;
    for (size_t wi = 0; wi < sizeof OWS / sizeof *OWS; wi++)
        for (size_t hi = 0; hi < sizeof OHS / sizeof *OHS; hi++)
            for (size_t bi = 0; bi < sizeof BIAS / sizeof *BIAS; bi++) {
                const int OW = OWS[wi], OH = OHS[hi], PW = OW / 2, PH = OH / 2;
                if (!pool2x2_avx2_fits(OH, OW)) continue; /* short rows over one row pair: the plain rows alone */
                const size_t n = (size_t)OH * OW, np = (size_t)PH * PW;
                Rng r;
                rng_init(&r, 500 + 40 * wi + 4 * hi + bi, 1);
                float *pre = malloc(n * sizeof(float)), *g = malloc(np * sizeof(float));
                rng_fill_uniform(&r, pre, n, -2.0f, 3.0f);
                for (size_t i = 0; i < n; i++) pre[i] = floorf(pre[i]); /* -2 .. 2: ties, and negatives */
                for (size_t i = 0; i < n; i += 13) pre[i] = -0.0f;
                for (size_t i = 5; i < n; i += 29) pre[i] = NAN;
                rng_fill_uniform(&r, g, np, -1.0f, 1.0f);
                float *y1 = malloc(np * sizeof(float)), *y2 = malloc(np * sizeof(float));
                uint8_t *w1 = malloc(np), *w2 = malloc(np);
                float *d1 = malloc(n * sizeof(float)), *d2 = malloc(n * sizeof(float));
                for (size_t i = 0; i < np; i++) y1[i] = y2[i] = NAN, w1[i] = w2[i] = 0xEE;
                for (size_t i = 0; i < n; i++) d1[i] = d2[i] = NAN;
                pool2x2_relu_plane_avx2(y1, w1, pre, BIAS[bi], OH, OW);
                pool2x2_relu_plane(y2, w2, pre, BIAS[bi], OH, OW);
                pool2x2_relu_grad_plane_avx2(d1, g, y2, w2, OH, OW);
                pool2x2_relu_grad_plane(d2, g, y2, w2, OH, OW);
                if (memcmp(y1, y2, np * sizeof(float)) || memcmp(w1, w2, np) || memcmp(d1, d2, n * sizeof(float))) {
                    bad++;
                    fprintf(stderr, "\n  relu + 2x2 pool, %dx%d plane, bias %g: the AVX2 rows differ (%s)", OH, OW,
                            (double)BIAS[bi], memcmp(y1, y2, np * sizeof(float)) ? "values"
                                              : memcmp(w1, w2, np)                  ? "winners"
                                                                                   : "gradient");
                }
                free(pre), free(g), free(y1), free(y2), free(w1), free(w2), free(d1), free(d2);
            }
    CU_ASSERT_EQUAL(bad, 0);
}

int register_nn_conv_suite(void) {
    CU_pSuite s = CU_add_suite("nn_conv", NULL, NULL);
    if (!s) return -1;
    const struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"conv2d forward (im2col + sgemm) matches direct loops", test_conv2d_forward_matches_ref},
        {"conv2d backward matches direct loops", test_conv2d_backward_matches_ref},
        {"conv2d backward accumulates, skips inputs without grad", test_conv2d_backward_accumulates_and_skips},
        {"conv2d with grad disabled records nothing", test_conv2d_no_grad_records_nothing},
        {"im2col/col2im layout on hand examples", test_im2col_layout},
        {"col2im is the adjoint of im2col", test_im2col_col2im_adjoint},
        {"conv2d gradcheck (x, w, bias)", test_conv2d_gradcheck},
        {"maxpool2d gradcheck", test_maxpool2d_gradcheck},
        {"avgpool2d gradcheck", test_avgpool2d_gradcheck},
        {"maxpool2d hand example", test_maxpool2d_hand_example},
        {"maxpool2d tie goes to the first element", test_maxpool2d_tie_goes_to_first},
        {"maxpool2d propagates NaN", test_maxpool2d_propagates_nan},
        {"maxpool2d 2x2 fast path matches the generic loops", test_maxpool2d_fast_path_matches_generic},
        {"relu + 2x2 pool rows: AVX2 matches the plain rows bit for bit", test_pool2x2_avx2_rows_match_plain},
        {"avgpool2d hand example", test_avgpool2d_hand_example},
        {"conv2d bad inputs", test_conv2d_bad_inputs},
        {"pool bad inputs", test_pool_bad_inputs},
        {"globalavgpool: mean within rounding, same bits on 1 and 2 threads", test_globalavgpool_threads_agree},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return 0;
}
