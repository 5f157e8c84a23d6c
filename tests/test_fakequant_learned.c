/* test_fakequant_learned.c - the learned ranges' gradients (TQT, LSQ):
 * against the formulas computed here, by gradcheck with rounding off, by
 * central differences with rounding on, and LSQ's gradient scale. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/ops.h"
#include "quant/fakequant.h"
#include "test_fakequant.h"
#include "test_qarray.h"
#include "test_util.h"

/* ---- learned ranges: gradients -------------------------------------------------------------------------- */

/* TQT's and LSQ's code range: signed [-2^(b-1), 2^(b-1) - 1], uint [0, 2^b - 1]. */
static void levels_of(const QType *t, int *n, int *p) {
    bool u = t->kind == QTYPE_KIND_UINT;
    *n = u ? 0 : -(1 << (t->bits - 1));
    *p = u ? (1 << t->bits) - 1 : (1 << (t->bits - 1)) - 1;
}

/* x = (k + d) s0 per element: k a whole code in [n - 3, p + 3], d in +-[0.05, 0.35],
 * so x / s0 stays 0.15 from every rounding boundary and 0.05 from every
 * whole number (n and p included).
 * Elements of k < n or k > p lie outside the range. rows x cols, channel = column. */
static float *codes_data(int rows, int cols, const float *s0, int n, int p, uint64_t seed) {
    float *x = malloc((size_t)rows * cols * sizeof *x);
    Rng g;
    rng_init(&g, seed, 4);
    for (int i = 0; i < rows * cols; i++) {
        int k = n - 3 + (int)rng_below(&g, (uint32_t)(p - n + 7));
        float d;
        rng_fill_uniform(&g, &d, 1, 0.05f, 0.35f);
        if (rng_below(&g, 2)) d = -d;
        x[i] = ((float)k + d) * s0[i % cols];
    }
    return x;
}

/* The expected range gradient of channel c, computed from the formulas of
 * DESIGN.md (TQT) and of the LSQ paper, in double, and dx. */
static void learned_expected(const FqRangeSpec *spec, const float *x, const float *dy, int rows, int cols,
                             const float *s, double *dr, float *dx) {
    int n, p;
    levels_of(spec->qtype, &n, &p);
    for (int c = 0; c < cols; c++) dr[c] = 0.0;
    for (int i = 0; i < rows * cols; i++) {
        int c = i % cols;
        double v = (double)(x[i] / s[c]), r = rint(v), f;
        bool in;
        if (spec->kind == FQ_RANGE_TQT) {
            in = r >= n && r <= p;
            f = (in ? r - v : r < n ? n : p) * s[c] * LN2;
        } else {
            in = v > n && v < p;
            f = in ? r - v : v <= n ? n : p;
        }
        dr[c] += dy[i] * f;
        dx[i] = in ? dy[i] : 0.0f;
    }
}

/* Forward + backward of the learned op on a fresh tape: y, dx, dparam. */
static bool learned_run(TestEnv *e, const FqRangeSpec *spec, const float *x, int rows, int cols, const float *param,
                        int nparam, const float *dy, float *y, float *dx, float *dparam) {
    tape_reset(&e->tape);
    Var *vx = test_var(e, x, 2, (int[]){rows, cols}, dx != NULL);
    Var *vp = test_var(e, param, 1, (int[]){nparam}, dparam != NULL);
    Var *vy = fq_learned_quant(&e->tape, vx, vp, spec);
    if (!vy || (dy && tape_backward_from(&e->tape, vy, dy) != QT_OK)) {
        fprintf(stderr, "\n  learned op: %s\n", e->tape.err.msg);
        return false;
    }
    memcpy(y, vy->value.data, (size_t)rows * cols * sizeof(float));
    if (dx) memcpy(dx, vx->grad, (size_t)rows * cols * sizeof(float));
    if (dparam) memcpy(dparam, vp->grad, (size_t)nparam * sizeof(float));
    return true;
}

/* With rne and TQT's ceil: the backward equals the formula computed above,
 * per tensor and per channel; dx exactly. This is the only check of the
 * ceil's pass-through: with the ceil on, the forward is constant in l. */
static void check_learned_formula(FqRangeKind kind, const char *qt, int cols, const float *param) {
    enum { ROWS = 40 };
    TestEnv e;
    test_env_init(&e, 6);
    FqRangeSpec spec = {.kind = kind, .qtype = qa_find(qt), .per_channel = cols > 1, .axis = 1};
    float s[4];
    for (int c = 0; c < cols; c++) s[c] = fq_range_scale(&spec, param[c]);
    int n, p;
    levels_of(spec.qtype, &n, &p);
    float *x = codes_data(ROWS, cols, s, n, p, 7);
    float dy[ROWS * 4], y[ROWS * 4], dx[ROWS * 4], want_dx[ROWS * 4], dp[4];
    double want_dp[4];
    Rng g;
    rng_init(&g, 8, 1);
    rng_fill_uniform(&g, dy, ROWS * (size_t)cols, -1.0f, 1.0f);
    CU_ASSERT_FATAL(learned_run(&e, &spec, x, ROWS, cols, param, cols, dy, y, dx, dp));
    learned_expected(&spec, x, dy, ROWS, cols, s, want_dp, want_dx);
    double gscale = kind == FQ_RANGE_LSQ ? 1.0 / sqrt((double)ROWS * p) : 1.0;
    for (int c = 0; c < cols; c++) {
        double want = want_dp[c] * gscale, tol = 1e-5 * (1.0 + fabs(want));
        if (fabs(dp[c] - want) > tol)
            fprintf(stderr, "\n  %s %s channel %d: grad %.9g, want %.9g\n", fq_range_kind_name(kind), qt, c,
                    (double)dp[c], want);
        CU_ASSERT_DOUBLE_EQUAL(dp[c], want, tol);
    }
    CU_ASSERT(fq_test_same_bits(dx, want_dx, ROWS * (size_t)cols, "dx"));
    for (int i = 0; i < ROWS * cols; i++) { /* y = clamp(rne(x / s), n, p) * s */
        float r = fminf(fmaxf(rintf(x[i] / s[i % cols]), (float)n), (float)p);
        CU_ASSERT(y[i] == r * s[i % cols]);
    }
    free(x);
    test_env_free(&e);
}

static void test_learned_formula(void) {
    check_learned_formula(FQ_RANGE_TQT, "int8", 1, (float[]){0.4f});              /* ceil 1: s = 2 / 128 */
    check_learned_formula(FQ_RANGE_TQT, "int4", 3, (float[]){-0.3f, 0.6f, 1.2f}); /* ceil 0, 1, 2 */
    check_learned_formula(FQ_RANGE_TQT, "uint8", 2, (float[]){2.5f, -1.5f});      /* s = 2^ceil(l) / 256 */
    check_learned_formula(FQ_RANGE_LSQ, "int8", 1, (float[]){0.02f});
    check_learned_formula(FQ_RANGE_LSQ, "int4", 3, (float[]){0.1f, 0.25f, 0.7f});
    check_learned_formula(FQ_RANGE_LSQ, "uint4", 2, (float[]){0.3f, 0.05f});
}

static Var *run_learned(Tape *t, Var **in, void *ctx) { return fq_learned_quant(t, in[0], in[1], ctx); }

/* With skip_rounding (and TQT's exact scale) the forward is
 * clamp(x / s, n, p) * s, continuous in x and in the parameter, and the
 * estimators are its exact derivative: inside, dy/dx = 1 and dy/ds = 0 (r -
 * x/s = 0); outside, 0 and n or p (times s ln2 for l). gradcheck perturbs x
 * and the parameter by 1e-3; values keep 0.02 from the clip edges n s and
 * p s, which such a step moves by less than 0.01. */
static void check_learned_gradcheck(FqRangeKind kind, int cols, const float *param) {
    FqRangeSpec spec = {.kind = kind, .qtype = qa_find("int4"), .per_channel = cols > 1, .axis = 1,
                        .tqt_exact_scale = true, .lsq_grad_scale = 1.0f, .skip_rounding = true};
    float edges[8];
    for (int c = 0; c < cols; c++) {
        float s = fq_range_scale(&spec, param[c]);
        edges[2 * c] = -8 * s, edges[2 * c + 1] = 7 * s;
    }
    float *x = fq_test_spread_away(12 * (size_t)cols, 9, 3.0f, edges, 2 * cols, 0.02f);
    GradcheckInput in[2] = {{x, 2, {12, cols, 1, 1}, true}, {param, 1, {cols, 1, 1, 1}, true}};
    char name[64];
    snprintf(name, sizeof name, "%s, %d channel(s)", fq_range_kind_name(kind), cols);
    CU_ASSERT(gradcheck(name, run_learned, &spec, in, 2, 1e-3, 2e-3, 1e-2));
    free(x);
}

static void test_learned_gradcheck(void) {
    check_learned_gradcheck(FQ_RANGE_TQT, 1, (float[]){0.7f});
    check_learned_gradcheck(FQ_RANGE_TQT, 3, (float[]){-0.3f, 0.6f, 1.2f});
    check_learned_gradcheck(FQ_RANGE_LSQ, 1, (float[]){0.3f});
    check_learned_gradcheck(FQ_RANGE_LSQ, 3, (float[]){0.2f, 0.3f, 0.45f});
}

/* With rne on, the forward is clamp(r, n, p) * s with r fixed while no
 * element crosses a rounding boundary: its derivative inside the range is r
 * per unit of s (r s ln2 per unit of l, TQT's exact scale), not the
 * estimator's r - x/s. So the central difference of L = sum(y dy) in one
 * channel's parameter must equal the analytic gradient plus the part the
 * estimator adds, sum over that channel's inside elements of dy x ln2 (tqt)
 * or dy x / s (lsq), each method with its own inside rule. The data keep
 * x / s 0.15 from every rounding boundary, and the step (1e-3 in l, 0.1% of
 * s) moves x / s by at most 0.09 (int8's largest |x / s|, 131, times
 * 2^0.001 - 1); the test asserts that the codes at both ends are the base
 * codes. This
 * ties the backward to the actual forward (scale, ln2, the outside n and p,
 * the per-channel sums), which the formula check alone cannot. */
static void check_rounded_fd(FqRangeKind kind, const char *qt, int cols, const float *param) {
    enum { ROWS = 30 };
    TestEnv e;
    test_env_init(&e, 10);
    FqRangeSpec spec = {.kind = kind, .qtype = qa_find(qt), .per_channel = cols > 1, .axis = 1,
                        .tqt_exact_scale = true, .lsq_grad_scale = 1.0f};
    int n, p;
    levels_of(spec.qtype, &n, &p);
    float s[4], pp[4], dy[ROWS * 4], y0[ROWS * 4], y1[ROWS * 4], dp[4];
    for (int c = 0; c < cols; c++) s[c] = fq_range_scale(&spec, param[c]);
    float *x = codes_data(ROWS, cols, s, n, p, 12);
    Rng g;
    rng_init(&g, 13, 1);
    rng_fill_uniform(&g, dy, ROWS * (size_t)cols, -1.0f, 1.0f);
    CU_ASSERT_FATAL(learned_run(&e, &spec, x, ROWS, cols, param, cols, dy, y0, NULL, dp));
    for (int c = 0; c < cols; c++) {
        double L[2], h, corr = 0.0, scale = 0.0, eps = kind == FQ_RANGE_TQT ? 1e-3 : 1e-3 * param[c];
        memcpy(pp, param, (size_t)cols * sizeof(float));
        for (int k = 0; k < 2; k++) {
            pp[c] = (float)(param[c] + (k ? -eps : eps));
            CU_ASSERT_FATAL(learned_run(&e, &spec, x, ROWS, cols, pp, cols, NULL, y1, NULL, NULL));
            float sk = fq_range_scale(&spec, pp[c]);
            L[k] = 0.0;
            for (int i = c; i < ROWS * cols; i += cols) {
                CU_ASSERT_EQUAL(rintf(y1[i] / sk), rintf(y0[i] / s[c])); /* no code changed */
                L[k] += (double)y1[i] * dy[i];
            }
        }
        h = (double)(float)(param[c] + eps) - (double)(float)(param[c] - eps);
        for (int i = c; i < ROWS * cols; i += cols) {
            double v = (double)(x[i] / s[c]);
            bool in = kind == FQ_RANGE_TQT ? rint(v) >= n && rint(v) <= p : v > n && v < p;
            if (in) corr += dy[i] * (kind == FQ_RANGE_TQT ? x[i] * LN2 : x[i] / (double)s[c]);
            scale += fabs(dy[i] * y0[i] / s[c]) * (kind == FQ_RANGE_TQT ? s[c] * LN2 : 1.0);
        }
        double fd = (L[0] - L[1]) / h;
        if (fabs(dp[c] - (fd - corr)) > 1e-3 * scale)
            fprintf(stderr, "\n  %s channel %d: analytic %.9g, difference %.9g - estimator part %.9g\n",
                    fq_range_kind_name(kind), c, (double)dp[c], fd, corr);
        CU_ASSERT(fabs(dp[c] - (fd - corr)) <= 1e-3 * scale);
    }
    free(x);
    test_env_free(&e);
}

static void test_learned_rounded_fd(void) {
    check_rounded_fd(FQ_RANGE_TQT, "int8", 1, (float[]){0.3f});
    check_rounded_fd(FQ_RANGE_TQT, "int4", 3, (float[]){-0.3f, 0.6f, 1.2f});
    check_rounded_fd(FQ_RANGE_LSQ, "int4", 1, (float[]){0.2f});
    check_rounded_fd(FQ_RANGE_LSQ, "uint4", 3, (float[]){0.1f, 0.25f, 0.7f});
}

/* LSQ's gradient scale is 1 / sqrt(N p), N the elements per scale. */
static void test_lsq_grad_scale(void) {
    TestEnv e;
    test_env_init(&e, 14);
    const struct {
        const char *qt;
        bool per_channel;
        int axis, nparam;
    } cases[] = {{"int4", false, 0, 1}, {"int4", true, 0, 4}, {"uint8", true, 1, 15}, {"int8", true, 1, 15}};
    float *x = qa_normal_sample(15, 60), dy[60], y[60], d0[15], d1[15];
    for (int i = 0; i < 60; i++) dy[i] = 1.0f;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        FqRangeSpec spec = {.kind = FQ_RANGE_LSQ, .qtype = qa_find(cases[k].qt), .per_channel = cases[k].per_channel,
                            .axis = cases[k].axis};
        int n, p;
        levels_of(spec.qtype, &n, &p);
        if (n == 0) /* uint: values below 0 add n = 0, so keep them positive for a non-zero gradient */
            for (int i = 0; i < 60; i++) x[i] = fabsf(x[i]);
        float par[15];
        for (int c = 0; c < 15; c++) par[c] = 0.9f / (float)p; /* some values clip, some do not */
        CU_ASSERT_FATAL(learned_run(&e, &spec, x, 4, 15, par, cases[k].nparam, dy, y, NULL, d0));
        spec.lsq_grad_scale = 1.0f;
        CU_ASSERT_FATAL(learned_run(&e, &spec, x, 4, 15, par, cases[k].nparam, dy, y, NULL, d1));
        double g = 1.0 / sqrt(60.0 / cases[k].nparam * p);
        for (int c = 0; c < cases[k].nparam; c++) {
            CU_ASSERT(d1[c] != 0.0f);
            CU_ASSERT_DOUBLE_EQUAL(d0[c] / d1[c], g, 1e-6 * g);
        }
    }
    free(x);
    test_env_free(&e);
}

int fq_learned_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "tqt/lsq grads == formula", test_learned_formula) ||
           !CU_add_test(s, "tqt/lsq gradcheck without rounding", test_learned_gradcheck) ||
           !CU_add_test(s, "tqt/lsq central differences with rounding", test_learned_rounded_fd) ||
           !CU_add_test(s, "lsq gradient scale", test_lsq_grad_scale);
}
