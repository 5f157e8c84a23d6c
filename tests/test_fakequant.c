/* test_fakequant.c - fake quantization tape ops: forwards against QArray and
 * against codes worked out by hand, the straight-through gradients exactly,
 * stochastic rounding, initialisers, the QType CalibQuant and bad input.
 * The learned ranges' gradients are in test_fakequant_learned.c. */
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

static Var *wrap1(TestEnv *e, float *data, int n) { return tape_wrap(&e->tape, data, 1, (int[]){n}); }

static CalibSpec parse_calib(const char *text) {
    CalibSpec s = {0};
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(calib_parse(text, &s, &err), QT_OK);
    return s;
}

bool fq_test_same_bits(const float *a, const float *b, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            fprintf(stderr, "\n  %s: element %zu: %.9g vs %.9g\n", what, i, (double)a[i], (double)b[i]);
            return false;
        }
    return true;
}

/* ---- forward: equal to QArray --------------------------------------------------------------------- */

typedef struct {
    const char *qt;
    int ndim, shape[4];
    bool per_channel;
    int axis;
    QArrayRange range;
    bool narrow;
    QArrayZpType zp_type;
    QRound round;
    const char *calib; /* NULL: the default */
} FwdCase;

static const FwdCase FWD_CASES[] = {
    {"int8", 2, {8, 16}, false, 0, 0, false, 0, QROUND_RNE, NULL},
    {"int8", 2, {8, 16}, true, 0, 0, false, 0, QROUND_RNE, NULL},
    {"int4", 4, {3, 4, 2, 5}, true, 1, 0, false, 0, QROUND_RNE, NULL},
    {"int4", 2, {6, 5}, true, -1, 0, false, 0, QROUND_RNE, "mse"},
    {"int6", 2, {6, 5}, false, 0, 0, false, 0, QROUND_HALF_AWAY, "percentile,99"},
    {"int3", 2, {6, 5}, true, 0, 0, false, 0, QROUND_FLOOR, NULL},
    {"uint8", 2, {8, 16}, false, 0, 0, false, 0, QROUND_RNE, NULL}, /* auto: asymmetric */
    {"uint8", 2, {8, 16}, true, 0, QARRAY_RANGE_ASYMMETRIC, false, QARRAY_ZP_FLOAT, QROUND_RNE, NULL},
    {"uint4", 2, {8, 16}, false, 0, QARRAY_RANGE_SYMMETRIC, false, 0, QROUND_RNE, NULL},
    {"int8", 3, {4, 3, 8}, true, 1, QARRAY_RANGE_ASYMMETRIC, true, 0, QROUND_RNE, NULL},
    {"int8", 2, {8, 16}, false, 0, 0, true, 0, QROUND_RNE, "entropy"},
    {"nf4", 1, {64}, false, 0, 0, false, 0, QROUND_RNE, NULL},
    {"nf4", 2, {4, 16}, true, 0, 0, false, 0, QROUND_RNE, NULL},
    {"fp8_e4m3", 2, {8, 16}, false, 0, 0, false, 0, QROUND_RNE, NULL},
    {"fp8_e4m3", 2, {8, 16}, true, 0, 0, false, 0, QROUND_RNE, "mse"},
    {"fp8_e5m2", 2, {8, 16}, true, 1, 0, false, 0, QROUND_RNE, NULL},
    {"fp6_e3m2", 2, {8, 16}, false, 0, 0, false, 0, QROUND_RNE, NULL},
    {"fp4_e2m1", 2, {8, 16}, true, 0, 0, false, 0, QROUND_RNE, NULL},
    {"ternary", 2, {8, 16}, true, 0, 0, false, 0, QROUND_RNE, NULL},
    {"int8", 2, {8, 16}, true, 0, 0, false, 0, QROUND_STOCHASTIC, NULL},
    {"uint8", 2, {8, 16}, false, 0, 0, false, 0, QROUND_STOCHASTIC, NULL},
    {"fp8_e4m3", 2, {8, 16}, true, 1, 0, false, 0, QROUND_STOCHASTIC, NULL},
    {"nf4", 2, {4, 16}, true, 0, 0, false, 0, QROUND_STOCHASTIC, NULL},
};

/* The static op with q's own scales and zero points, and the dynamic op
 * with q's options, both give q's dequantized values bit for bit. */
static void check_fwd_case(const FwdCase *k, int idx) {
    TestEnv e;
    test_env_init(&e, 3);
    size_t n = 1;
    for (int d = 0; d < k->ndim; d++) n *= (size_t)k->shape[d];
    float *x = qa_normal_sample(100 + (uint64_t)idx, n);
    for (size_t i = 0; i < n; i += 7) x[i] *= 4.0f; /* some outliers that an mse or percentile range clips */
    CalibSpec cs = k->calib ? parse_calib(k->calib) : (CalibSpec){0};
    Rng r0, r1, r2, r3;
    rng_init(&r0, 77, RNG_STREAM_ROUNDING);
    r1 = r2 = r3 = r0;
    QArrayOptions o = {.n_channelwise = k->per_channel, .channelwise_axes = {k->axis}, .range = k->range,
                       .narrow_range = k->narrow, .zp_type = k->zp_type, .round = k->round,
                       .rng = k->round == QROUND_STOCHASTIC ? &r1 : NULL, .calib = k->calib ? &cs : NULL};
    QArray q = {0};
    qa_quant_ok(&q, x, k->ndim, k->shape, k->qt, &o);
    float *ref = qa_alloc_floats(n), *sc = qa_alloc_floats(q.n_scales), *zp = qa_alloc_floats(q.n_scales);
    qarray_dequantize(&q, ref);
    qarray_scales(&q, sc);
    for (size_t i = 0; i < q.n_scales; i++) zp[i] = qarray_zero_point_at(&q, i);
    FakeQuantSpec spec = {.qtype = qa_find(k->qt), .per_channel = k->per_channel, .axis = k->axis, .range = k->range,
                          .narrow_range = k->narrow, .zp_type = k->zp_type, .round = k->round, .rng = &r2};
    Var *vx = test_var(&e, x, k->ndim, k->shape, true);
    Var *yd = fq_fake_quant_dynamic(&e.tape, vx, &spec, k->calib ? &cs : NULL);
    spec.rng = &r3;
    Var *ys = fq_fake_quant(&e.tape, vx, &spec, wrap1(&e, sc, (int)q.n_scales),
                            q.asymmetric ? wrap1(&e, zp, (int)q.n_scales) : NULL);
    if (!yd || !ys) fprintf(stderr, "\n  case %d (%s): %s\n", idx, k->qt, e.tape.err.msg);
    CU_ASSERT_FATAL(yd && ys);
    char what[64];
    snprintf(what, sizeof what, "case %d (%s) dynamic", idx, k->qt);
    CU_ASSERT(fq_test_same_bits(yd->value.data, ref, n, what));
    snprintf(what, sizeof what, "case %d (%s) static", idx, k->qt);
    CU_ASSERT(fq_test_same_bits(ys->value.data, ref, n, what));
    CU_ASSERT(yd->value.data != vx->value.data && ys->value.data != vx->value.data);
    CU_ASSERT(yd->requires_grad && ys->requires_grad);
    /* The same draws: every generator advanced by ceil(n / 4) blocks. */
    CU_ASSERT(r1.counter == r2.counter && r2.counter == r3.counter);
    qarray_free(&q);
    free(x), free(ref), free(sc), free(zp);
    test_env_free(&e);
}

static void test_forward_matches_qarray(void) {
    for (size_t i = 0; i < sizeof FWD_CASES / sizeof FWD_CASES[0]; i++) check_fwd_case(&FWD_CASES[i], (int)i);
}

/* Values worked out from DESIGN.md's formulas, with power-of-two scales so
 * that x / s is exact. */
static void test_forward_by_hand(void) {
    TestEnv e;
    test_env_init(&e, 1);
    /* int4, s = 0.25: codes clamp(rne(x / 0.25), -8, 7). 0.125 -> 0.5 -> 0 and
     * 0.375 -> 1.5 -> 2 (ties to even); 1.9 -> 7.6 -> 7; -2.5 -> -10 -> -8. */
    float x4[8] = {0.1f, 0.125f, 0.375f, -0.375f, 1.9f, -2.5f, 0.6f, -0.625f};
    const float want4[8] = {0.0f, 0.0f, 0.5f, -0.5f, 1.75f, -2.0f, 0.5f, -0.5f};
    float s4 = 0.25f;
    FakeQuantSpec spec = {.qtype = qa_find("int4")};
    Var *y = fq_fake_quant(&e.tape, test_var(&e, x4, 1, (int[]){8}, false), &spec, wrap1(&e, &s4, 1), NULL);
    CU_ASSERT_FATAL(y != NULL);
    CU_ASSERT(fq_test_same_bits(y->value.data, want4, 8, "int4"));
    /* uint8, s = 0.5, zp = 10: values (clamp(rne(x / s), -10, 245)) * s. */
    float xu[4] = {-5.0f, -6.0f, 3.2f, 200.0f}, su = 0.5f, zu = 10.0f;
    const float wantu[4] = {-5.0f, -5.0f, 3.0f, 122.5f};
    spec.qtype = qa_find("uint8");
    y = fq_fake_quant(&e.tape, test_var(&e, xu, 1, (int[]){4}, false), &spec, wrap1(&e, &su, 1), wrap1(&e, &zu, 1));
    CU_ASSERT_FATAL(y != NULL);
    CU_ASSERT(fq_test_same_bits(y->value.data, wantu, 4, "uint8"));
    /* fp8_e4m3, s = 2: 1000 / 2 saturates to 448; 2.3 / 2 = 1.15 lies between
     * 1.125 and 1.25 (step 1/8 in [1, 2)) and goes to 1.125; 3 / 2 is exact. */
    float xf[3] = {1000.0f, 2.3f, 3.0f}, sf = 2.0f;
    const float wantf[3] = {896.0f, 2.25f, 3.0f};
    spec.qtype = qa_find("fp8_e4m3");
    y = fq_fake_quant(&e.tape, test_var(&e, xf, 1, (int[]){3}, false), &spec, wrap1(&e, &sf, 1), NULL);
    CU_ASSERT_FATAL(y != NULL);
    CU_ASSERT(fq_test_same_bits(y->value.data, wantf, 3, "fp8_e4m3"));
    /* nf4, s = 1: 0.5 is nearer code 12 (0.4407) than code 13 (0.5626). */
    float xn[2] = {0.5f, -2.0f}, sn = 1.0f;
    const float wantn[2] = {0.44070982933044434f, -1.0f};
    spec.qtype = qa_find("nf4");
    y = fq_fake_quant(&e.tape, test_var(&e, xn, 1, (int[]){2}, false), &spec, wrap1(&e, &sn, 1), NULL);
    CU_ASSERT_FATAL(y != NULL);
    CU_ASSERT(fq_test_same_bits(y->value.data, wantn, 2, "nf4"));
    test_env_free(&e);
}

/* ---- the straight-through estimator ----------------------------------------------------------------- */

/* Runs y = fq(x) (twice, added, when twice: the grads must accumulate),
 * backward from dy, and checks dx[i] == mult * dy[i] exactly where pass[i]
 * and exactly 0 elsewhere. */
static void check_ste(const FakeQuantSpec *spec, const float *x, const int *pass, int rows, int cols, float *scale,
                      float *zp, bool twice) {
    TestEnv e;
    test_env_init(&e, 2);
    int n = rows * cols, nc = spec->per_channel ? (spec->axis == 0 ? rows : cols) : 1;
    Var *vx = test_var(&e, x, 2, (int[]){rows, cols}, true);
    Var *y = fq_fake_quant(&e.tape, vx, spec, wrap1(&e, scale, nc), zp ? wrap1(&e, zp, nc) : NULL);
    if (twice)
        y = nn_add(&e.tape, y, fq_fake_quant(&e.tape, vx, spec, wrap1(&e, scale, nc), zp ? wrap1(&e, zp, nc) : NULL));
    if (!y) fprintf(stderr, "\n  %s\n", e.tape.err.msg);
    CU_ASSERT_FATAL(y != NULL);
    float dy[64];
    Rng g;
    rng_init(&g, 5, 9);
    rng_fill_uniform(&g, dy, (size_t)n, 0.5f, 1.5f); /* never 0, so a passed gradient is seen */
    CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, dy), QT_OK);
    float mult = twice ? 2.0f : 1.0f;
    for (int i = 0; i < n; i++) {
        float want = pass[i] ? mult * dy[i] : 0.0f;
        if (vx->grad[i] != want)
            fprintf(stderr, "\n  %s element %d (x = %g): grad %.9g, want %.9g\n", qtype_name(spec->qtype), i,
                    (double)x[i], (double)vx->grad[i], (double)want);
        CU_ASSERT(vx->grad[i] == want);
    }
    test_env_free(&e);
}

static void test_ste_clipped(void) {
    /* int4, s = 0.25: representable [-8 s, 7 s] = [-2, 1.75], edges included. */
    FakeQuantSpec spec = {.qtype = qa_find("int4")};
    float s = 0.25f;
    const float x[8] = {0.3f, -2.0f, 1.75f, 1.76f, -2.01f, 5.0f, -9.0f, 1.8f};
    const int pass[8] = {1, 1, 1, 0, 0, 0, 0, 0};
    check_ste(&spec, x, pass, 2, 4, &s, NULL, false);
    check_ste(&spec, x, pass, 2, 4, &s, NULL, true);
    /* Per channel along axis 1, scales 0.1, 0.2, 0.5: ranges [-0.8, 0.7], [-1.6, 1.4], [-4, 3.5]. */
    float s3[3] = {0.1f, 0.2f, 0.5f};
    const float xc[6] = {0.75f, 1.5f, 3.4f, -0.7f, -1.7f, -4.5f};
    const int passc[6] = {0, 0, 1, 1, 0, 0};
    spec.per_channel = true, spec.axis = 1;
    check_ste(&spec, xc, passc, 2, 3, s3, NULL, false);
    /* uint8 with zp 10, s = 0.5: [(0 - 10) s, (255 - 10) s] = [-5, 122.5]. */
    spec = (FakeQuantSpec){.qtype = qa_find("uint8")};
    float su = 0.5f, zu = 10.0f;
    const float xu[4] = {-5.0f, -5.5f, 122.0f, 123.0f};
    const int passu[4] = {1, 0, 1, 0};
    check_ste(&spec, xu, passu, 1, 4, &su, &zu, false);
    /* fp8_e4m3, s = 1/64: [-448 s, 448 s] = [-7, 7]; nf4, s = 2: [-2, 2]. */
    spec.qtype = qa_find("fp8_e4m3");
    float sf = 1.0f / 64;
    const float xf[4] = {6.9f, -7.0f, 7.1f, -100.0f};
    const int passf[4] = {1, 1, 0, 0};
    check_ste(&spec, xf, passf, 2, 2, &sf, NULL, false);
    spec.qtype = qa_find("nf4");
    float sn = 2.0f;
    const float xn[4] = {1.9f, -2.0f, 2.1f, -3.0f};
    const int passn[4] = {1, 1, 0, 0};
    check_ste(&spec, xn, passn, 2, 2, &sn, NULL, false);
}

static void test_ste_unclipped(void) {
    FakeQuantSpec spec = {.qtype = qa_find("int4"), .ste = FQ_STE_PASS};
    float s = 0.25f;
    const float x[8] = {0.3f, -2.0f, 1.75f, 1.76f, -2.01f, 5.0f, -9.0f, 1.8f};
    const int pass[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    check_ste(&spec, x, pass, 2, 4, &s, NULL, false);
    spec.qtype = qa_find("fp4_e2m1");
    check_ste(&spec, x, pass, 4, 2, &s, NULL, true);
}

static float GRAD_SCALES[3] = {0.2f, 0.3f, 0.25f};

static Var *run_skip_round(Tape *t, Var **in, void *ctx) {
    FakeQuantSpec *spec = ctx;
    return fq_fake_quant(t, in[0], spec, tape_wrap(t, GRAD_SCALES, 1, (int[]){3}), NULL);
}

/* Values in [-lim, lim] moved at least `gap` away from the points edges[]. */
float *fq_test_spread_away(size_t n, uint64_t seed, float lim, const float *edges, int n_edges, float gap) {
    float *x = malloc(n * sizeof *x);
    Rng g;
    rng_init(&g, seed, 3);
    rng_fill_uniform(&g, x, n, -lim, lim);
    for (size_t i = 0; i < n; i++)
        for (int k = 0; k < n_edges; k++)
            if (fabsf(x[i] - edges[k]) < gap) x[i] = edges[k] + (x[i] < edges[k] ? -gap : gap);
    return x;
}

/* With the rounding skipped, the forward is clamp(x / s, elo, ehi) * s, whose
 * derivative is exactly the clipped STE: central differences check it. Each
 * value keeps 0.01 (10 eps) from its channel's clip edges -8 s and 7 s, so
 * no step crosses one; about a third of the values lie outside. */
static void test_ste_finite_differences(void) {
    float edges[6];
    for (int c = 0; c < 3; c++) edges[2 * c] = -8 * GRAD_SCALES[c], edges[2 * c + 1] = 7 * GRAD_SCALES[c];
    float *x = fq_test_spread_away(60, 4, 3.0f, edges, 6, 0.01f);
    FakeQuantSpec spec = {.qtype = qa_find("int4"), .per_channel = true, .axis = 1, .skip_rounding = true};
    GradcheckInput in = {x, 2, {20, 3, 1, 1}, true};
    CU_ASSERT(gradcheck("fake_quant skip_rounding", run_skip_round, &spec, &in, 1, 1e-3, 2e-3, 1e-2));
    free(x);
}

/* ---- stochastic rounding ------------------------------------------------------------------------------- */

enum { N_DRAWS = 6000 };

static void test_stochastic_rounding(void) {
    TestEnv e;
    test_env_init(&e, 16);
    static float x[3 * N_DRAWS];
    const float v[3] = {0.3f, -1.75f, 2.5f}; /* int8, s = 1: code units */
    for (int i = 0; i < 3 * N_DRAWS; i++) x[i] = v[i % 3];
    Rng r, r_same, r_tape;
    rng_init(&r, 17, RNG_STREAM_ROUNDING);
    r_same = r_tape = r;
    float one = 1.0f;
    FakeQuantSpec spec = {.qtype = qa_find("int8"), .round = QROUND_STOCHASTIC, .rng = &r};
    Var *vx = test_var(&e, x, 1, (int[]){3 * N_DRAWS}, false);
    Var *y1 = fq_fake_quant(&e.tape, vx, &spec, wrap1(&e, &one, 1), NULL);
    CU_ASSERT_FATAL(y1 != NULL);
    CU_ASSERT_EQUAL(r.counter, (3 * N_DRAWS + 3) / 4);
    /* Unbiased: each mean within 5 sigma of v, sigma = sqrt(f (1 - f) / N); every value a neighbour of v. */
    for (int k = 0; k < 3; k++) {
        double sum = 0.0, lo = floor(v[k]), f = v[k] - lo;
        for (int i = k; i < 3 * N_DRAWS; i += 3) {
            sum += y1->value.data[i];
            CU_ASSERT(y1->value.data[i] == lo || y1->value.data[i] == lo + 1);
        }
        CU_ASSERT(fabs(sum / N_DRAWS - v[k]) <= 5.0 * sqrt(f * (1.0 - f) / N_DRAWS));
    }
    /* Reproducible: the same state gives the same values, also as the tape's rng; the next call differs. */
    spec.rng = &r_same;
    Var *y2 = fq_fake_quant(&e.tape, vx, &spec, wrap1(&e, &one, 1), NULL);
    spec.rng = NULL;
    e.tape.rng = &r_tape;
    Var *y3 = fq_fake_quant(&e.tape, vx, &spec, wrap1(&e, &one, 1), NULL);
    spec.rng = &r;
    Var *y4 = fq_fake_quant(&e.tape, vx, &spec, wrap1(&e, &one, 1), NULL);
    CU_ASSERT_FATAL(y2 && y3 && y4);
    CU_ASSERT(fq_test_same_bits(y1->value.data, y2->value.data, 3 * N_DRAWS, "same state"));
    CU_ASSERT(fq_test_same_bits(y1->value.data, y3->value.data, 3 * N_DRAWS, "tape rng"));
    CU_ASSERT(memcmp(y1->value.data, y4->value.data, sizeof x) != 0);
    /* fp8_e4m3: 1.15 between grid points 1.125 and 1.25; variance (1.25 - v)(v - 1.125). */
    for (int i = 0; i < N_DRAWS; i++) x[i] = 1.15f;
    spec.qtype = qa_find("fp8_e4m3");
    Var *yf = fq_fake_quant(&e.tape, test_var(&e, x, 1, (int[]){N_DRAWS}, false), &spec, wrap1(&e, &one, 1), NULL);
    CU_ASSERT_FATAL(yf != NULL);
    double sum = 0.0;
    for (int i = 0; i < N_DRAWS; i++) sum += yf->value.data[i];
    CU_ASSERT(fabs(sum / N_DRAWS - 1.15) <= 5.0 * sqrt((1.25 - 1.15) * (1.15 - 1.125) / N_DRAWS));
    /* The learned op rounds stochastically too: int8 TQT with l = 7 is s = 1. */
    for (int i = 0; i < N_DRAWS; i++) x[i] = 0.3f;
    FqRangeSpec ls = {.kind = FQ_RANGE_TQT, .qtype = qa_find("int8"), .round = QROUND_STOCHASTIC, .rng = &r};
    float l = 7.0f;
    Var *yl = fq_learned_quant(&e.tape, test_var(&e, x, 1, (int[]){N_DRAWS}, false), wrap1(&e, &l, 1), &ls);
    CU_ASSERT_FATAL(yl != NULL);
    sum = 0.0;
    for (int i = 0; i < N_DRAWS; i++) sum += yl->value.data[i];
    CU_ASSERT(fabs(sum / N_DRAWS - 0.3) <= 5.0 * sqrt(0.3 * 0.7 / N_DRAWS));
    test_env_free(&e);
}

/* ---- learned ranges: parameters and initialisers ------------------------------------------------------------ */

static QtStatus range_new(FqRange *r, FqRangeKind kind, const char *qt, int channels) {
    FqRangeSpec spec = {.kind = kind, .qtype = qa_find(qt), .per_channel = channels > 1, .axis = 0};
    QtError err = {0};
    QtStatus st = fq_range_init(r, "fc1/weight", &spec, channels, &err);
    if (st != QT_OK) fprintf(stderr, "\n  fq_range_init: %s\n", err.msg);
    return st;
}

static void test_range_init(void) {
    enum { C = 3, K = 50 };
    float *x = qa_normal_sample(18, C * K);
    for (int i = 0; i < K; i++) x[K + i] *= 0.1f, x[2 * K + i] = 0.0f; /* row 2 all zero */
    const int shape[2] = {C, K};
    FqRange t, l;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(range_new(&t, FQ_RANGE_TQT, "int8", C), QT_OK);
    CU_ASSERT_EQUAL_FATAL(range_new(&l, FQ_RANGE_LSQ, "int8", C), QT_OK);
    CU_ASSERT_STRING_EQUAL(t.param.name, "fc1/weight/log2_t");
    CU_ASSERT_STRING_EQUAL(l.param.name, "fc1/weight/step_size");
    CU_ASSERT(t.param.var.requires_grad && t.param.var.is_param && t.param.trainable && t.param.var.grad);
    CU_ASSERT(t.param.var.value.ndim == 1 && t.param.var.value.shape[0] == C);
    CU_ASSERT(t.param.var.value.data[1] == 0.0f && t.param.var.grad[1] == 0.0f); /* threshold 1 */
    CU_ASSERT(l.param.var.value.data[1] == 1.0f / 127);
    /* Defaults: TQT l = log2 max|x|, LSQ s = 2 mean|x| / sqrt(p); a zero row gets the scale 1. */
    CU_ASSERT_EQUAL_FATAL(fq_range_calibrate(&t, x, 2, shape, NULL, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(fq_range_calibrate(&l, x, 2, shape, NULL, &err), QT_OK);
    for (int c = 0; c < 2; c++) {
        double amax = qa_abs_max(x + c * K, K), mean = 0.0;
        for (int i = 0; i < K; i++) mean += fabsf(x[c * K + i]) / (double)K;
        CU_ASSERT_EQUAL(t.param.var.value.data[c], (float)log2(amax));
        CU_ASSERT_DOUBLE_EQUAL(l.param.var.value.data[c], 2.0 * mean / sqrt(127.0), 1e-6 * mean);
    }
    CU_ASSERT_EQUAL(t.param.var.value.data[2], 7.0f);
    CU_ASSERT_EQUAL(fq_range_scale(&t.spec, t.param.var.value.data[2]), 1.0f);
    CU_ASSERT_EQUAL(l.param.var.value.data[2], 1.0f);
    /* From a calibration: TQT's 3sd gives l = log2(|mean| + 3 std); LSQ from absmax s = amax / p. */
    CalibSpec sd = parse_calib("3sd"), am = parse_calib("absmax"), mse = parse_calib("mse");
    CU_ASSERT_EQUAL_FATAL(fq_range_calibrate(&t, x, 2, shape, &sd, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(fq_range_calibrate(&l, x, 2, shape, &am, &err), QT_OK);
    CalibRange cr;
    CU_ASSERT_EQUAL_FATAL(calib_compute(&sd, x, K, NULL, NULL, 0, &cr, &err), QT_OK);
    CU_ASSERT_EQUAL(t.param.var.value.data[0], (float)log2((double)cr.hi));
    CU_ASSERT_EQUAL(l.param.var.value.data[0], (float)(qa_abs_max(x, K) / 127.0));
    /* mse sees the learned quantizer: a 8-bit Gaussian clips a little, t <= amax. */
    CU_ASSERT_EQUAL_FATAL(fq_range_calibrate(&t, x, 2, shape, &mse, &err), QT_OK);
    CU_ASSERT(t.param.var.value.data[0] <= (float)log2(qa_abs_max(x, K)) + 1e-6f);
    CU_ASSERT(t.param.var.value.data[0] > (float)log2(qa_abs_max(x, K)) - 1.0f);
    /* Errors leave the values alone. */
    float before = t.param.var.value.data[0];
    CU_ASSERT_EQUAL(fq_range_calibrate(&t, x, 2, (int[]){5, 30}, NULL, &err), QT_ERR_SHAPE);
    CU_ASSERT(test_msg_has(&err, "(5, 30) has 5 channels"));
    x[7] = NAN;
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(fq_range_calibrate(&t, x, 2, shape, NULL, &err), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&err, "flat index 7"));
    CU_ASSERT_EQUAL(t.param.var.value.data[0], before);
    fq_range_free(&t);
    fq_range_free(&l);
    CU_ASSERT_PTR_NULL(t.param.var.value.data);
    /* uint8 TQT: a zero range is l = 8 (s = 2^8 / 2^8). */
    FqRange u;
    CU_ASSERT_EQUAL_FATAL(range_new(&u, FQ_RANGE_TQT, "uint8", 1), QT_OK);
    float zeros[4] = {0};
    CU_ASSERT_EQUAL_FATAL(fq_range_calibrate(&u, zeros, 1, (int[]){4}, NULL, &err), QT_OK);
    CU_ASSERT_EQUAL(u.param.var.value.data[0], 8.0f);
    fq_range_free(&u);
    /* Bad specs and names. */
    FqRangeSpec bad = {.kind = FQ_RANGE_TQT, .qtype = qa_find("fp8_e4m3")};
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(fq_range_init(&u, "a/b", &bad, 1, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "int or uint format"));
    bad.qtype = qa_find("int8");
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(fq_range_init(&u, "a/b", &bad, 3, &err), QT_ERR_ARG); /* per tensor, 3 channels */
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(fq_range_init(&u, "a_very_long_module_path/with_many_levels/and_a_tensor_name_too", &bad, 1, &err),
                    QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "longer than 63"));
    fq_range_free(&u);
    free(x);
}

/* The op reads the parameter's value and adds into its persistent grad. */
static void test_range_apply_accumulates(void) {
    FqRange r;
    CU_ASSERT_EQUAL_FATAL(range_new(&r, FQ_RANGE_LSQ, "int4", 3), QT_OK);
    float *x = qa_normal_sample(19, 3 * 8), dy[24], g1[3];
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(fq_range_calibrate(&r, x, 2, (int[]){3, 8}, NULL, &err), QT_OK);
    for (int i = 0; i < 24; i++) dy[i] = 1.0f - 0.05f * (float)i;
    for (int pass = 0; pass < 2; pass++) {
        TestEnv e;
        test_env_init(&e, 20);
        Var *y = fq_range_apply(&e.tape, test_var(&e, x, 2, (int[]){3, 8}, false), &r);
        CU_ASSERT_FATAL(y != NULL);
        CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, dy), QT_OK);
        if (pass == 0) memcpy(g1, r.param.var.grad, sizeof g1);
        test_env_free(&e);
    }
    for (int c = 0; c < 3; c++) {
        CU_ASSERT(g1[c] != 0.0f);
        CU_ASSERT_EQUAL(r.param.var.grad[c], 2.0f * g1[c]);
    }
    fq_range_free(&r);
    free(x);
}

/* ---- the CalibQuant of a QType ------------------------------------------------------------------------------ */

static void test_calib_quant_adapter(void) {
    const size_t n = 4000;
    float *x = qa_normal_sample(21, n);
    for (size_t i = 0; i < n; i += 50) x[i] *= 5.0f;
    const QType *i4 = qa_find("int4"), *i8 = qa_find("int8"), *u8 = qa_find("uint8"), *f8 = qa_find("fp8_e4m3");
    CalibQuant a = fq_calib_quant(i4, QARRAY_RANGE_SYMMETRIC, false, QARRAY_ZP_INT32), b = calib_quant_int(4, false);
    CU_ASSERT(a.fn && a.levels == b.levels && !a.asymmetric);
    for (size_t i = 0; i < 500; i++) {
        float t = 0.1f + fabsf(x[i + 1000]);
        CU_ASSERT_EQUAL(a.fn(x[i], -t, t, &a), b.fn(x[i], -t, t, &b));
    }
    /* mse through the adapter picks exactly calib_quant_int(4)'s range. */
    CalibSpec mse = parse_calib("mse"), ent = parse_calib("entropy");
    CalibRange ra, rb;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(calib_compute(&mse, x, n, &a, NULL, 0, &ra, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(calib_compute(&mse, x, n, &b, NULL, 0, &rb, &err), QT_OK);
    CU_ASSERT(ra.lo == rb.lo && ra.hi == rb.hi);
    CU_ASSERT(ra.hi < qa_abs_max(x, n)); /* 4 bits clip the outliers */
    /* entropy with int8 counts 128 levels, as the default quantizer does. */
    CalibQuant a8 = fq_calib_quant(i8, QARRAY_RANGE_AUTO, false, QARRAY_ZP_INT32);
    CU_ASSERT_EQUAL_FATAL(calib_compute(&ent, x, n, &a8, NULL, 0, &ra, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(calib_compute(&ent, x, n, NULL, NULL, 0, &rb, &err), QT_OK);
    CU_ASSERT(ra.lo == rb.lo && ra.hi == rb.hi);
    /* uint8: symmetric (unsigned) has 256 levels over [0, t]; auto is asymmetric. */
    CU_ASSERT_EQUAL(fq_calib_quant(u8, QARRAY_RANGE_SYMMETRIC, false, QARRAY_ZP_INT32).levels, 256);
    CalibQuant ua = fq_calib_quant(u8, QARRAY_RANGE_AUTO, false, QARRAY_ZP_INT32);
    CU_ASSERT(ua.asymmetric && ua.levels == 128);
    /* Asymmetric uint8 over [-1, 2]: scale 3/255, zero point 85. */
    float s = (float)(3.0 / 255.0);
    CU_ASSERT_EQUAL(ua.fn(0.5f, -1.0f, 2.0f, &ua), rintf(0.5f / s) * s);
    CU_ASSERT_EQUAL(ua.fn(-3.0f, -1.0f, 2.0f, &ua), -85.0f * s);
    /* fp8_e4m3 over t: scale t / 448, then the element grid. */
    CalibQuant af = fq_calib_quant(f8, QARRAY_RANGE_AUTO, false, QARRAY_ZP_INT32);
    CU_ASSERT(af.levels == 128 && !af.asymmetric);
    for (size_t i = 0; i < 200; i++) {
        float t = 0.5f + fabsf(x[i + 2000]), sf = t / 448.0f;
        CU_ASSERT_EQUAL(af.fn(x[i], -t, t, &af), qtype_decode(f8, qtype_encode(f8, x[i] / sf, QROUND_RNE, 0)) * sf);
    }
    /* What a format cannot take has no round trip, and mse says so. */
    CU_ASSERT_PTR_NULL(fq_calib_quant(f8, QARRAY_RANGE_ASYMMETRIC, false, QARRAY_ZP_INT32).fn);
    CU_ASSERT_PTR_NULL(fq_calib_quant(qa_find("mxfp4"), QARRAY_RANGE_AUTO, false, QARRAY_ZP_INT32).fn);
    CU_ASSERT_PTR_NULL(fq_calib_quant(i8, QARRAY_RANGE_SYMMETRIC, false, QARRAY_ZP_FLOAT).fn);
    CU_ASSERT_PTR_NULL(fq_calib_quant(u8, QARRAY_RANGE_AUTO, true, QARRAY_ZP_INT32).fn);
    CalibQuant none = fq_calib_quant(NULL, QARRAY_RANGE_AUTO, false, QARRAY_ZP_INT32);
    CU_ASSERT(none.fn == NULL && none.levels == 0);
    CU_ASSERT_EQUAL(calib_compute(&mse, x, n, &none, NULL, 0, &ra, &err), QT_ERR_ARG);
    free(x);
}

/* ---- bad input ------------------------------------------------------------------------------------------------- */

static void test_bad_input(void) {
    float d[12] = {0}, s3[3] = {1, 1, 1}, s4[4] = {1, -0.5f, 1, 1}, half = 0.5f, one = 1.0f, neg = -0.1f;
    const struct {
        QtStatus want;
        const char *has;
    } cases[] = {
        {QT_ERR_VALUE, "fake_quant: input (3, 4) holds nan at flat index 5"},
        {QT_ERR_VALUE, "fake_quant_dynamic: input (3, 4) holds nan at flat index 5"},
        {QT_ERR_VALUE, "fake_quant_tqt: input (3, 4) holds nan at flat index 5"},
        {QT_ERR_SHAPE, "fake_quant: scale (3,) does not fit input (3, 4): want (4,), one per index along axis 1"},
        {QT_ERR_ARG, "fake_quant: axis 2 is out of range for input (3, 4)"},
        {QT_ERR_SHAPE, "fake_quant_lsq: parameter (3,) does not fit input (3, 4): want (1,), one for the tensor"},
        {QT_ERR_ARG, "fake_quant of mxfp4: a block format"},
        {QT_ERR_ARG, "stochastic rounding needs an Rng"},
        {QT_ERR_VALUE, "fake_quant: scale[1] = -0.5"},
        {QT_ERR_ARG, "requires a gradient"},
        {QT_ERR_VALUE, "zero_point[0] = 0.5 is not a whole number"},
        {QT_ERR_VALUE, "fake_quant_lsq: parameter value -0.1 of channel 0"},
        {QT_ERR_ARG, "fake_quant_dynamic option range = asymmetric: fp8_e4m3 has no zero point"},
        {QT_ERR_SHAPE, "fake_quant_tqt: parameter (4,) does not fit input (3, 4): want (3,), one per index along"},
    };
    for (int k = 0; k < (int)(sizeof cases / sizeof cases[0]); k++) {
        TestEnv e;
        test_env_init(&e, 1);
        d[5] = k < 3 ? NAN : 0.0f;
        Var *x = test_var(&e, d, 2, (int[]){3, 4}, true), *out = NULL;
        FakeQuantSpec fs = {.qtype = qa_find("int8")};
        FqRangeSpec ls = {.kind = FQ_RANGE_TQT, .qtype = qa_find("int8")};
        switch (k) {
        case 0: out = fq_fake_quant(&e.tape, x, &fs, wrap1(&e, &one, 1), NULL); break;
        case 1: out = fq_fake_quant_dynamic(&e.tape, x, &fs, NULL); break;
        case 2: out = fq_learned_quant(&e.tape, x, wrap1(&e, &one, 1), &ls); break;
        case 3: fs.per_channel = true, fs.axis = 1, out = fq_fake_quant(&e.tape, x, &fs, wrap1(&e, s3, 3), NULL); break;
        case 4: fs.per_channel = true, fs.axis = 2, out = fq_fake_quant(&e.tape, x, &fs, wrap1(&e, s3, 3), NULL); break;
        case 5: ls.kind = FQ_RANGE_LSQ, out = fq_learned_quant(&e.tape, x, wrap1(&e, s3, 3), &ls); break;
        case 6: fs.qtype = qa_find("mxfp4"), out = fq_fake_quant(&e.tape, x, &fs, wrap1(&e, &one, 1), NULL); break;
        case 7:
            e.tape.rng = NULL, fs.round = QROUND_STOCHASTIC;
            out = fq_fake_quant(&e.tape, x, &fs, wrap1(&e, &one, 1), NULL);
            break;
        case 8: fs.per_channel = true, fs.axis = -1, out = fq_fake_quant(&e.tape, x, &fs, wrap1(&e, s4, 4), 0); break;
        case 9: out = fq_fake_quant(&e.tape, x, &fs, test_var(&e, &one, 1, (int[]){1}, true), NULL); break;
        case 10: out = fq_fake_quant(&e.tape, x, &fs, wrap1(&e, &one, 1), wrap1(&e, &half, 1)); break;
        case 11: ls.kind = FQ_RANGE_LSQ, out = fq_learned_quant(&e.tape, x, wrap1(&e, &neg, 1), &ls); break;
        case 12:
            fs.qtype = qa_find("fp8_e4m3"), fs.range = QARRAY_RANGE_ASYMMETRIC;
            out = fq_fake_quant_dynamic(&e.tape, x, &fs, NULL);
            break;
        case 13: ls.per_channel = true, out = fq_learned_quant(&e.tape, x, wrap1(&e, s4, 4), &ls); break;
        }
        CU_ASSERT_PTR_NULL(out);
        if (e.tape.err.status != cases[k].want) fprintf(stderr, "\n  case %d: %s\n", k, e.tape.err.msg);
        CU_ASSERT_EQUAL(e.tape.err.status, cases[k].want);
        CU_ASSERT(test_msg_has(&e.tape.err, cases[k].has));
        /* A NULL input poisons quietly: NULL out, the first error kept. */
        CU_ASSERT_PTR_NULL(fq_fake_quant(&e.tape, NULL, &fs, wrap1(&e, &one, 1), NULL));
        CU_ASSERT_EQUAL(e.tape.err.status, cases[k].want);
        test_env_free(&e);
    }
}

/* Without gradients (eval) the ops run forward only and record nothing. */
static void test_eval_records_nothing(void) {
    TestEnv e;
    test_env_init(&e, 1);
    float x[6] = {0.1f, -0.2f, 0.3f, 0.4f, -0.5f, 0.6f}, s = 0.01f, l = 0.0f;
    e.tape.grad_enabled = false;
    Var *vx = test_var(&e, x, 2, (int[]){2, 3}, true);
    FakeQuantSpec fs = {.qtype = qa_find("int8")};
    FqRangeSpec ls = {.kind = FQ_RANGE_TQT, .qtype = qa_find("int8")};
    Var *a = fq_fake_quant(&e.tape, vx, &fs, wrap1(&e, &s, 1), NULL);
    Var *b = fq_fake_quant_dynamic(&e.tape, vx, &fs, NULL);
    Var *c = fq_learned_quant(&e.tape, vx, test_var(&e, &l, 1, (int[]){1}, true), &ls);
    CU_ASSERT_FATAL(a && b && c);
    CU_ASSERT(!a->requires_grad && !b->requires_grad && !c->requires_grad);
    CU_ASSERT_EQUAL(e.tape.n_nodes, 0u);
    CU_ASSERT_EQUAL(a->value.data[4], -0.5f);
    test_env_free(&e);
}

static void test_names(void) {
    FqSte ste = FQ_STE_CLIPPED;
    FqRangeKind kind = FQ_RANGE_TQT;
    QtError err = {0};
    CU_ASSERT(fq_ste_parse("PASS", &ste, &err) == QT_OK && ste == FQ_STE_PASS);
    CU_ASSERT(fq_range_kind_parse("lsq", &kind, &err) == QT_OK && kind == FQ_RANGE_LSQ);
    CU_ASSERT_STRING_EQUAL(fq_ste_name(FQ_STE_CLIPPED), "clipped");
    CU_ASSERT_STRING_EQUAL(fq_range_kind_name(FQ_RANGE_TQT), "tqt");
    CU_ASSERT_EQUAL(fq_range_kind_parse("pact", &kind, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "valid: tqt, lsq"));
}

int register_quant_fake_suite(void) {
    CU_pSuite s = CU_add_suite("quant_fake", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "forward == QArray round trip (static and dynamic)", test_forward_matches_qarray) ||
           !CU_add_test(s, "forward by hand", test_forward_by_hand) ||
           !CU_add_test(s, "clipped STE: exact grads, accumulation", test_ste_clipped) ||
           !CU_add_test(s, "unclipped STE", test_ste_unclipped) ||
           !CU_add_test(s, "clipped STE by finite differences", test_ste_finite_differences) ||
           !CU_add_test(s, "stochastic rounding", test_stochastic_rounding) ||
           !CU_add_test(s, "learned range init and calibration", test_range_init) ||
           !CU_add_test(s, "learned range grads accumulate", test_range_apply_accumulates) ||
           !CU_add_test(s, "CalibQuant of a QType", test_calib_quant_adapter) ||
           !CU_add_test(s, "bad input", test_bad_input) ||
           !CU_add_test(s, "eval records nothing", test_eval_records_nothing) ||
           !CU_add_test(s, "names", test_names) || fq_learned_tests_add(s) != 0 || fq_block_tests_add(s) != 0;
}
