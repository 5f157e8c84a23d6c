/* test_fakequant_blocks.c - the dynamic fake-quant op with QArray's whole
 * description: per-block (tiled) scales, fraction tiles, scale types, zero
 * points, calibrations, stochastic rounding and the MX / mx6 / mx9 block
 * formats. The forward against qarray_quantize -> qarray_dequantize bit for
 * bit, the clipped STE per block exactly, gradcheck with the rounding
 * skipped, errors, and the arena's steady state. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/fakequant.h"
#include "test_fakequant.h"
#include "test_qarray.h"
#include "test_util.h"

#define CW0 .n_channelwise = 1, .channelwise_axes = {0}
#define TILE1(t) .n_tiled = 1, .tiled_axes = {{1, t}}

static CalibSpec parse_calib(const char *text) {
    CalibSpec s = {0};
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(calib_parse(text, &s, &err), QT_OK);
    return s;
}

static size_t numel_of(int ndim, const int *shape) {
    size_t n = 1;
    for (int d = 0; d < ndim; d++) n *= (size_t)shape[d];
    return n;
}

/* N(0, 1) data whose magnitude changes every 16 elements (so neighbouring
 * blocks get different scales), with outliers, and the first 32 elements
 * all zero (an all-zero block). */
static float *block_data(uint64_t seed, size_t n) {
    float *x = qa_normal_sample(seed, n);
    for (size_t i = 0; i < n; i++) x[i] *= exp2f((float)((i / 16) % 7) - 3.0f);
    for (size_t i = 5; i < n; i += 37) x[i] *= 6.0f;
    for (size_t i = 0; i < n && i < 32; i++) x[i] = 0.0f;
    return x;
}

/* The FakeQuantSpec that describes the same quantizer as o. */
static FakeQuantSpec spec_of(const QType *qt, const QArrayOptions *o) {
    FakeQuantSpec s = {.qtype = qt, .n_channelwise = o->n_channelwise, .n_tiled = o->n_tiled,
                       .scale_type = o->scale_type, .range = o->range, .narrow_range = o->narrow_range,
                       .zp_type = o->zp_type, .round = o->round, .rng = o->rng};
    memcpy(s.channelwise_axes, o->channelwise_axes, sizeof s.channelwise_axes);
    memcpy(s.tiled_axes, o->tiled_axes, sizeof s.tiled_axes);
    return s;
}

/* ---- forward == QArray ---------------------------------------------------------------------------- */

typedef struct {
    const char *name, *qt;
    int ndim, shape[4];
    QArrayOptions o; /* rng filled in for stochastic rounding */
    const char *calib;
} BlockCase;

static const BlockCase CASES[] = {
    {"int4 blocks of 32", "int4", 2, {8, 64}, {CW0, TILE1(32)}, NULL},
    {"int8 blocks of 64 per row", "int8", 2, {6, 128}, {CW0, TILE1(64)}, NULL},
    {"int8 blocks of 64 spanning the rows", "int8", 2, {6, 128}, {TILE1(64)}, NULL},
    {"int4 fraction tiles 0.25 x 0.5", "int4", 2, {8, 64}, {.n_tiled = 2, .tiled_axes = {{1, 0.25}, {0, 0.5}}}, NULL},
    {"int6 3-d tiles", "int6", 3, {4, 6, 32}, {CW0, .n_tiled = 2, .tiled_axes = {{1, 3}, {-1, 8}}}, NULL},
    {"int8 4-d tiles", "int8", 4, {2, 3, 4, 16},
     {.n_channelwise = 1, .channelwise_axes = {1}, .n_tiled = 3, .tiled_axes = {{0, 2}, {2, 2}, {3, 4}}}, NULL},
    {"nf4 default blocks of 64", "nf4", 2, {4, 128}, {0}, NULL},
    {"nf4 blocks of 64 over 2 rows", "nf4", 2, {4, 32}, {.n_tiled = 2, .tiled_axes = {{0, 2}, {1, 32}}}, NULL},
    {"fp8_e4m3 blocks of 16", "fp8_e4m3", 2, {4, 64}, {CW0, TILE1(16)}, NULL},
    {"fp4_e2m1 blocks of 32, mse", "fp4_e2m1", 2, {4, 64}, {CW0, TILE1(32)}, "mse"},
    {"int4 blocks of 16, percentile", "int4", 2, {4, 64}, {CW0, TILE1(16)}, "percentile,90"},
    {"int8 blocks of 128, entropy", "int8", 2, {2, 256}, {CW0, TILE1(128)}, "entropy"},
    {"int8 blocks of 64, kl_j", "int8", 2, {2, 256}, {CW0, TILE1(64)}, "kl_j"},
    {"int8 blocks, float16 scales", "int8", 2, {8, 64}, {CW0, TILE1(32), .scale_type = QARRAY_SCALE_F16}, NULL},
    {"int8 blocks, bfloat16 scales", "int8", 2, {8, 64}, {CW0, TILE1(32), .scale_type = QARRAY_SCALE_BF16}, NULL},
    {"int8 narrow blocks, pof2 scales", "int8", 2, {8, 64},
     {CW0, TILE1(32), .scale_type = QARRAY_SCALE_POF2, .narrow_range = true}, NULL},
    {"fp8_e4m3 blocks, pof2 scales", "fp8_e4m3", 2, {4, 64}, {CW0, TILE1(32), .scale_type = QARRAY_SCALE_POF2},
     NULL},
    {"uint8 asymmetric blocks, int zero points", "uint8", 2, {8, 64}, {CW0, TILE1(16)}, NULL},
    {"uint8 asymmetric blocks, float zero points", "uint8", 2, {8, 64},
     {CW0, TILE1(16), .zp_type = QARRAY_ZP_FLOAT}, NULL},
    {"uint8 asymmetric blocks, percentile", "uint8", 2, {8, 64}, {CW0, TILE1(32)}, "percentile,95"},
    {"int8 asymmetric narrow blocks, f16 scales", "int8", 2, {8, 64},
     {CW0, TILE1(32), .range = QARRAY_RANGE_ASYMMETRIC, .narrow_range = true, .scale_type = QARRAY_SCALE_F16}, NULL},
    {"uint4 symmetric blocks", "uint4", 2, {8, 64}, {CW0, TILE1(32), .range = QARRAY_RANGE_SYMMETRIC}, NULL},
    {"ternary blocks (mean |x|)", "ternary", 2, {4, 64}, {CW0, TILE1(16)}, NULL},
    {"binary blocks", "binary", 2, {4, 64}, {CW0, TILE1(16)}, NULL},
    {"mxfp4", "mxfp4", 2, {4, 64}, {0}, NULL},
    {"mxfp4, pof2 given", "mxfp4", 2, {2, 32}, {.scale_type = QARRAY_SCALE_POF2}, NULL},
    {"mxfp6_e3m2", "mxfp6_e3m2", 2, {4, 64}, {0}, NULL},
    {"mxfp8_e4m3", "mxfp8_e4m3", 3, {2, 2, 64}, {0}, NULL},
    {"mxint8", "mxint8", 2, {4, 64}, {0}, NULL},
    {"mx9", "mx9", 2, {4, 64}, {0}, NULL},
    {"mx6", "mx6", 1, {128}, {0}, NULL},
    {"int4 blocks, half away", "int4", 2, {8, 64}, {CW0, TILE1(32), .round = QROUND_HALF_AWAY}, NULL},
    {"int4 blocks, floor", "int4", 2, {8, 64}, {CW0, TILE1(32), .round = QROUND_FLOOR}, NULL},
    {"int4 blocks, stochastic", "int4", 2, {8, 64}, {CW0, TILE1(32), .round = QROUND_STOCHASTIC}, NULL},
    {"uint8 float zp blocks, stochastic", "uint8", 2, {8, 64},
     {CW0, TILE1(16), .zp_type = QARRAY_ZP_FLOAT, .round = QROUND_STOCHASTIC}, NULL},
    {"fp8_e4m3 blocks, bf16, stochastic", "fp8_e4m3", 2, {4, 64},
     {CW0, TILE1(16), .scale_type = QARRAY_SCALE_BF16, .round = QROUND_STOCHASTIC}, NULL},
    {"nf4 blocks, stochastic", "nf4", 2, {4, 128}, {.round = QROUND_STOCHASTIC}, NULL},
    {"mxfp4, stochastic", "mxfp4", 2, {4, 64}, {.round = QROUND_STOCHASTIC}, NULL},
    {"mx9, stochastic", "mx9", 2, {4, 64}, {.round = QROUND_STOCHASTIC}, NULL},
};

/* Both entry points (QArrayOptions and FakeQuantSpec) give q's dequantized
 * values bit for bit, drawing the same words. */
static void check_case(const BlockCase *k, int idx) {
    TestEnv e;
    test_env_init(&e, 11);
    size_t n = numel_of(k->ndim, k->shape);
    float *x = block_data(300 + (uint64_t)idx, n), *ref = qa_alloc_floats(n);
    CalibSpec cs = k->calib ? parse_calib(k->calib) : (CalibSpec){0};
    bool sr = k->o.round == QROUND_STOCHASTIC;
    Rng r0, r1, r2, r3;
    rng_init(&r0, 91 + (uint64_t)idx, RNG_STREAM_ROUNDING);
    r1 = r2 = r3 = r0;
    QArrayOptions o = k->o;
    o.calib = k->calib ? &cs : NULL;
    o.rng = sr ? &r1 : NULL;
    QArray q = {0};
    qa_quant_ok(&q, x, k->ndim, k->shape, k->qt, &o);
    qarray_dequantize(&q, ref);
    Var *vx = test_var(&e, x, k->ndim, k->shape, true);
    o.rng = sr ? &r2 : NULL;
    Var *ya = fq_fake_quant_qarray(&e.tape, vx, qa_find(k->qt), &o, FQ_STE_CLIPPED);
    o.rng = sr ? &r3 : NULL;
    FakeQuantSpec spec = spec_of(qa_find(k->qt), &o);
    Var *yb = fq_fake_quant_dynamic(&e.tape, vx, &spec, o.calib);
    if (!ya || !yb) fprintf(stderr, "\n  %s: %s\n", k->name, e.tape.err.msg);
    CU_ASSERT_FATAL(ya && yb);
    char what[96];
    snprintf(what, sizeof what, "%s (options)", k->name);
    CU_ASSERT(fq_test_same_bits(ya->value.data, ref, n, what));
    snprintf(what, sizeof what, "%s (spec)", k->name);
    CU_ASSERT(fq_test_same_bits(yb->value.data, ref, n, what));
    CU_ASSERT(r1.counter == r2.counter && r2.counter == r3.counter);
    if (sr) CU_ASSERT_EQUAL(r2.counter, (n + 3) / 4);
    CU_ASSERT(memcmp(vx->value.data, x, n * sizeof(float)) == 0); /* x untouched */
    qarray_free(&q);
    free(x), free(ref);
    test_env_free(&e);
}

static void test_forward_blocks(void) {
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) check_case(&CASES[i], (int)i);
}

/* per_channel's axis joins the spec's channelwise axes; consecutive
 * stochastic calls draw fresh noise; the tape's rng stands in for spec.rng. */
static void test_spec_details(void) {
    TestEnv e;
    test_env_init(&e, 12);
    const int shape[2] = {8, 64};
    float *x = block_data(41, 512), *ref = qa_alloc_floats(512);
    QArrayOptions o = {CW0, TILE1(32), .scale_type = QARRAY_SCALE_F16};
    QArray q = {0};
    qa_quant_ok(&q, x, 2, shape, "int4", &o);
    qarray_dequantize(&q, ref);
    FakeQuantSpec spec = {.qtype = qa_find("int4"), .per_channel = true, .axis = -2, .n_tiled = 1,
                          .tiled_axes = {{-1, 32}}, .scale_type = QARRAY_SCALE_F16};
    Var *vx = test_var(&e, x, 2, shape, false);
    Var *y = fq_fake_quant_dynamic(&e.tape, vx, &spec, NULL);
    CU_ASSERT_FATAL(y != NULL);
    CU_ASSERT(fq_test_same_bits(y->value.data, ref, 512, "per_channel + tiled"));
    qarray_free(&q);
    /* Stochastic with the tape's rng: the same as QArray from that state; the next call differs. */
    Rng tape_rng, r;
    rng_init(&tape_rng, 5, RNG_STREAM_ROUNDING);
    r = tape_rng;
    e.tape.rng = &tape_rng;
    qa_quant_ok(&q, x, 2, shape, "mxfp4", &(QArrayOptions){.round = QROUND_STOCHASTIC, .rng = &r});
    qarray_dequantize(&q, ref);
    FakeQuantSpec ms = {.qtype = qa_find("mxfp4"), .round = QROUND_STOCHASTIC};
    Var *y1 = fq_fake_quant_dynamic(&e.tape, vx, &ms, NULL), *y2 = fq_fake_quant_dynamic(&e.tape, vx, &ms, NULL);
    CU_ASSERT_FATAL(y1 && y2);
    CU_ASSERT(fq_test_same_bits(y1->value.data, ref, 512, "mxfp4 with the tape's rng"));
    CU_ASSERT(memcmp(y1->value.data, y2->value.data, 512 * sizeof(float)) != 0);
    CU_ASSERT_EQUAL(tape_rng.counter, 2 * 512 / 4);
    qarray_free(&q);
    free(x), free(ref);
    test_env_free(&e);
}

/* ---- the clipped STE per block -------------------------------------------------------------------------- */

/* y = fq(x) with o (spec when o is NULL), backward from dy in [0.5, 1.5];
 * dx must be dy exactly where pass[i] and 0 elsewhere. Returns y's values
 * in yout [n] when given. */
static void check_grads(const char *name, const char *qt, const float *x, int ndim, const int *shape,
                        const QArrayOptions *o, FqSte ste, const int *pass, float *yout) {
    TestEnv e;
    test_env_init(&e, 13);
    size_t n = numel_of(ndim, shape);
    Var *vx = test_var(&e, x, ndim, shape, true);
    Var *y = fq_fake_quant_qarray(&e.tape, vx, qa_find(qt), o, ste);
    if (!y) fprintf(stderr, "\n  %s: %s\n", name, e.tape.err.msg);
    CU_ASSERT_FATAL(y != NULL);
    float *dy = qa_alloc_floats(n);
    Rng g;
    rng_init(&g, 6, 9);
    rng_fill_uniform(&g, dy, n, 0.5f, 1.5f);
    CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, dy), QT_OK);
    for (size_t i = 0; i < n; i++) {
        float want = pass[i] ? dy[i] : 0.0f;
        if (vx->grad[i] != want)
            fprintf(stderr, "\n  %s element %zu (x = %g): grad %.9g, want %.9g\n", name, i, (double)x[i],
                    (double)vx->grad[i], (double)want);
        CU_ASSERT(vx->grad[i] == want);
    }
    if (yout) memcpy(yout, y->value.data, n * sizeof(float));
    free(dy);
    test_env_free(&e);
}

/* int4, blocks of 4 per row, percentile 50 of |x| and pof2 scales, worked
 * out by hand: block [0.1 -0.2 0.3 3]: t = P50 = 0.25, s = 0.25 / 7.5 ->
 * 2^-4, range [-8 s, 7 s] = [-0.5, 0.4375]; [-3.9 1.6 2.4 3.6]: t = 3, s =
 * 0.4 -> 0.5, [-4, 3.5]; [-0.6 0.05 -0.55 0.2]: t = 0.375, s = 0.05 -> 2^-4;
 * [-0.5 0.4375 0.1 0.2]: t = 0.31875 -> 2^-4, both edges exactly on the
 * range (inclusive). */
static void test_ste_int_blocks(void) {
    const float x[16] = {0.1f, -0.2f, 0.3f, 3.0f, -3.9f, 1.6f, 2.4f, 3.6f,
                         -0.6f, 0.05f, -0.55f, 0.2f, -0.5f, 0.4375f, 0.1f, 0.2f};
    const int pass[16] = {1, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 1};
    CalibSpec p50 = parse_calib("percentile,50");
    QArrayOptions o = {CW0, TILE1(4), .calib = &p50, .scale_type = QARRAY_SCALE_POF2};
    float y[16];
    check_grads("int4 blocks", "int4", x, 2, (int[]){2, 8}, &o, FQ_STE_CLIPPED, pass, y);
    CU_ASSERT_EQUAL(y[3], 0.4375f); /* 3 clips to 7 s */
    CU_ASSERT_EQUAL(y[7], 3.5f);
    CU_ASSERT_EQUAL(y[8], -0.5f);
    CU_ASSERT_EQUAL(y[12], -0.5f);
    const int all[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    check_grads("int4 blocks, pass", "int4", x, 2, (int[]){2, 8}, &o, FQ_STE_PASS, all, NULL);
}

/* Asymmetric uint8 in blocks of 16 with percentile 90 (lo = P10, hi = P90
 * of x, so both tails clip): the expected mask from QArray's stored scales
 * and zero points, qmin - zp <= x / s <= qmax - zp. */
static void test_ste_asymmetric_blocks(void) {
    enum { R = 4, C = 64, N = R * C };
    float *x = qa_normal_sample(51, N);
    int pass[N], clipped = 0;
    CalibSpec p90 = parse_calib("percentile,90");
    QArrayOptions o = {CW0, TILE1(16), .calib = &p90};
    QArray q = {0};
    qa_quant_ok(&q, x, 2, (int[]){R, C}, "uint8", &o);
    for (int i = 0; i < N; i++) {
        size_t g = (size_t)(i / C) * 4 + (size_t)(i % C) / 16;
        float s = qarray_scale_at(&q, g), zp = qarray_zero_point_at(&q, g), v = x[i] / s;
        pass[i] = v >= 0.0f - zp && v <= 255.0f - zp;
        clipped += !pass[i];
    }
    CU_ASSERT(clipped >= N / 10); /* about 20% lie outside their block's range */
    check_grads("uint8 asymmetric blocks", "uint8", x, 2, (int[]){R, C}, &o, FQ_STE_CLIPPED, pass, NULL);
    qarray_free(&q);
    free(x);
}

/* mxfp4, one block per row: amax 7 gives the shared scale 2^(2 - 2) = 1 and
 * the range [-6, 6] (7 and -6.5 saturate, +-6 are on the edge); amax 0.75
 * gives 2^(-1 - 2), range +-0.75; amax 0.76 the same, so 0.76 saturates. */
static void test_ste_mx_blocks(void) {
    float x[3 * 32];
    int pass[3 * 32];
    for (int i = 0; i < 3 * 32; i++) x[i] = 0.01f * (float)(i % 7) - 0.03f, pass[i] = 1;
    const float row0[4] = {7.0f, -6.5f, 6.0f, -6.0f}, row1[2] = {0.75f, -0.7f}, row2[3] = {0.76f, 0.74f, -0.75f};
    memcpy(x, row0, sizeof row0);
    memcpy(x + 32, row1, sizeof row1);
    memcpy(x + 64, row2, sizeof row2);
    pass[0] = pass[1] = pass[64] = 0;
    float y[3 * 32];
    check_grads("mxfp4", "mxfp4", x, 2, (int[]){3, 32}, NULL, FQ_STE_CLIPPED, pass, y);
    CU_ASSERT(y[0] == 6.0f && y[1] == -6.0f && y[32] == 0.75f && y[64] == 0.75f);
    /* mx9, sub-blocks of 2, amax 1.99: shared exponent 0. A sub-block whose
     * amax has exponent 0 keeps micro-exponent 0 (unit 2^-6, range
     * +-127/64 = +-1.984375: 1.99 saturates, -1.984375 is the edge); one
     * below 1 takes micro-exponent 1 (unit 2^-7, +-127/128: -0.995
     * saturates). */
    const float x9[16] = {1.99f, 1.98f, 0.9f, -0.995f, 0.5f, 0.1f, 0.0f, 0.0f,
                          -1.984375f, 0.3f, 0.01f, 0.02f, 1.0f, -1.0f, 0.25f, 0.125f};
    const int pass9[16] = {0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    float y9[16];
    check_grads("mx9", "mx9", x9, 1, (int[]){16}, NULL, FQ_STE_CLIPPED, pass9, y9);
    CU_ASSERT(y9[0] == 1.984375f && y9[3] == -0.9921875f && y9[8] == -1.984375f);
}

/* ---- gradcheck with the rounding skipped --------------------------------------------------------------- */

static CalibSpec FIXED2;

static Var *run_int4_blocks(Tape *t, Var **in, void *ctx) {
    (void)ctx;
    FakeQuantSpec spec = {.qtype = qa_find("int4"), .per_channel = true, .axis = 0, .n_tiled = 1,
                          .tiled_axes = {{1, 4}}, .skip_rounding = true};
    return fq_fake_quant_dynamic(t, in[0], &spec, &FIXED2);
}

static Var *run_mxfp4(Tape *t, Var **in, void *ctx) {
    (void)ctx;
    FakeQuantSpec spec = {.qtype = qa_find("mxfp4"), .skip_rounding = true};
    return fq_fake_quant_dynamic(t, in[0], &spec, NULL);
}

/* skip_rounding makes the forward clamp(x / s, elo, ehi) s, whose
 * derivative is the clipped STE. int4 with the fixed range 2 (s = 2 / 7.5,
 * range [-8 s, 7 s]); mxfp4 with per-block scales: block b has amax
 * 1.7 * 2^e (shared scale 2^(e - 2), range +-1.5 * 2^e, so the amax and
 * -1.6 * 2^e clip) and the rest within +-1.4 * 2^e. No value lies within
 * 0.01 of a clip edge, and no amax near a power of two, so no step of
 * 1e-3 changes a scale or crosses an edge. */
static void test_gradcheck_blocks(void) {
    FIXED2 = parse_calib("fixed,2");
    float s = 2.0f / 7.5f, edges[2] = {-8.0f * s, 7.0f * s};
    float *x = fq_test_spread_away(40, 7, 3.0f, edges, 2, 0.01f);
    GradcheckInput in = {x, 2, {5, 8, 1, 1}, true};
    CU_ASSERT(gradcheck("fake_quant_dynamic int4 blocks", run_int4_blocks, NULL, &in, 1, 1e-3, 2e-3, 1e-2));
    free(x);
    float xm[2 * 64];
    Rng g;
    rng_init(&g, 8, 3);
    rng_fill_uniform(&g, xm, 128, -1.4f, 1.4f);
    const int e_of[4] = {-1, 0, 1, 0};
    for (int b = 0; b < 4; b++) {
        float m = exp2f((float)e_of[b]);
        for (int i = 0; i < 32; i++) xm[b * 32 + i] *= m;
        xm[b * 32 + 3] = 1.7f * m;
        xm[b * 32 + 9] = -1.6f * m;
    }
    GradcheckInput im = {xm, 2, {2, 64, 1, 1}, true};
    CU_ASSERT(gradcheck("fake_quant_dynamic mxfp4", run_mxfp4, NULL, &im, 1, 1e-3, 2e-3, 1e-2));
}

/* ---- errors ---------------------------------------------------------------------------------------------- */

static void test_block_errors(void) {
    float d[4 * 64] = {0};
    for (int i = 0; i < 4 * 64; i++) d[i] = 0.01f * (float)(i % 13);
    CalibSpec am = parse_calib("absmax");
    const struct {
        const char *qt;
        int shape[2];
        QArrayOptions o;
        bool spec_route, nan, static_op;
        QtStatus want;
        const char *has[4];
    } cases[] = {
        {"int8", {4, 10}, {TILE1(4)}, false, false, false, QT_ERR_SHAPE,
         {"fake_quant_dynamic", "axis 1 of size 10", "tile size 4"}},
        {"int8", {4, 10}, {TILE1(0.3)}, false, false, false, QT_ERR_SHAPE, {"axis 1 of size 10", "tile size 3", "0.3"}},
        {"int4", {4, 64}, {TILE1(32)}, false, true, false, QT_ERR_VALUE,
         {"fake_quant_dynamic: input (4, 64) holds nan at flat index 5"}},
        {"mxfp4", {4, 64}, {0}, true, true, false, QT_ERR_VALUE, {"fake_quant_dynamic: input (4, 64)", "index 5"}},
        {"mxfp4", {4, 48}, {0}, false, false, false, QT_ERR_SHAPE, {"axis 1 of size 48", "32", "mxfp4"}},
        {"mxfp4", {4, 64}, {.calib = &am}, false, false, false, QT_ERR_ARG, {"fake_quant_dynamic option calib"}},
        {"mx9", {4, 64}, {.scale_type = QARRAY_SCALE_F16}, true, false, false, QT_ERR_ARG, {"scale_type", "mx9"}},
        {"nf4", {4, 64}, {.double_quant = true}, false, false, false, QT_ERR_ARG, {"double_quant"}},
        {"int8", {4, 64}, {CW0, .n_tiled = 1, .tiled_axes = {{0, 2}}}, false, false, false, QT_ERR_ARG,
         {"listed twice"}},
        {"int8", {4, 64}, {TILE1(32)}, true, false, true, QT_ERR_ARG, {"fake_quant:", "fq_fake_quant_dynamic"}},
        {"int8", {4, 64}, {.scale_type = QARRAY_SCALE_POF2}, true, false, true, QT_ERR_ARG, {"scale_type"}},
        {"int8", {4, 64}, {.scale_type = QARRAY_SCALE_F16}, false, false, false, QT_ERR_VALUE,
         {"float16", "65504"}},
    };
    for (int k = 0; k < (int)(sizeof cases / sizeof cases[0]); k++) {
        TestEnv e;
        test_env_init(&e, 14);
        float x[4 * 64];
        memcpy(x, d, sizeof x);
        if (cases[k].nan) x[5] = NAN;
        if (k == (int)(sizeof cases / sizeof cases[0]) - 1) x[7] = 1e7f; /* s = 1e7 / 127.5 > 65504 */
        Var *vx = test_var(&e, x, 2, cases[k].shape, true), *y;
        const QType *qt = qa_find(cases[k].qt);
        FakeQuantSpec spec = spec_of(qt, &cases[k].o);
        float one = 1.0f;
        if (cases[k].static_op)
            y = fq_fake_quant(&e.tape, vx, &spec, tape_wrap(&e.tape, &one, 1, (int[]){1}), NULL);
        else if (cases[k].spec_route)
            y = fq_fake_quant_dynamic(&e.tape, vx, &spec, cases[k].o.calib);
        else
            y = fq_fake_quant_qarray(&e.tape, vx, qt, &cases[k].o, FQ_STE_CLIPPED);
        CU_ASSERT_PTR_NULL(y);
        if (e.tape.err.status != cases[k].want) fprintf(stderr, "\n  case %d: %s\n", k, e.tape.err.msg);
        CU_ASSERT_EQUAL(e.tape.err.status, cases[k].want);
        for (int h = 0; h < 4 && cases[k].has[h]; h++) CU_ASSERT(test_msg_has(&e.tape.err, cases[k].has[h]));
        test_env_free(&e);
    }
    /* A bad STE, and spec.per_channel on top of 4 channelwise axes. */
    TestEnv e;
    test_env_init(&e, 15);
    Var *vx = test_var(&e, d, 2, (int[]){4, 64}, true);
    CU_ASSERT_PTR_NULL(fq_fake_quant_qarray(&e.tape, vx, qa_find("int8"), NULL, (FqSte)7));
    CU_ASSERT(test_msg_has(&e.tape.err, "estimator 7"));
    test_env_free(&e);
    test_env_init(&e, 15);
    vx = test_var(&e, d, 2, (int[]){4, 64}, true);
    FakeQuantSpec full = {.qtype = qa_find("int8"), .per_channel = true, .n_channelwise = 4};
    CU_ASSERT_PTR_NULL(fq_fake_quant_dynamic(&e.tape, vx, &full, NULL));
    CU_ASSERT(test_msg_has(&e.tape.err, "at most 4 axes"));
    test_env_free(&e);
}

/* ---- steady state and eval ----------------------------------------------------------------------------- */

/* A training loop's calls reuse the arena: after the first step it never
 * grows (percentile's workspace, slice buffers, the mask and the MX blocks
 * all come from it). */
static void test_arena_steady_state(void) {
    Arena a;
    Tape t;
    Rng rng;
    CU_ASSERT_FATAL(arena_init(&a, 4096) == 0);
    rng_init(&rng, 3, RNG_STREAM_ROUNDING);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, &rng, NULL), QT_OK);
    enum { R = 16, C = 128, N = R * C };
    float *x = block_data(61, N), *dy = qa_alloc_floats(N);
    for (int i = 0; i < N; i++) dy[i] = 1.0f;
    CalibSpec pc = parse_calib("percentile,99");
    FakeQuantSpec is = {.qtype = qa_find("int4"), .per_channel = true, .n_tiled = 1, .tiled_axes = {{1, 32}},
                        .round = QROUND_STOCHASTIC, .scale_type = QARRAY_SCALE_BF16};
    FakeQuantSpec ms = {.qtype = qa_find("mxfp4")};
    size_t grows = 0, cap = 0;
    for (int step = 0; step < 4; step++) {
        tape_reset(&t);
        Var *vx = tape_new_var(&t, 2, (int[]){R, C});
        CU_ASSERT_FATAL(vx != NULL);
        memcpy(vx->value.data, x, sizeof(float) * N);
        vx->requires_grad = true;
        Var *y1 = fq_fake_quant_dynamic(&t, vx, &is, &pc), *y2 = fq_fake_quant_dynamic(&t, vx, &ms, NULL);
        CU_ASSERT_FATAL(y1 && y2);
        CU_ASSERT_EQUAL_FATAL(tape_backward_from(&t, y1, dy), QT_OK);
        if (step == 1) grows = a.grow_count, cap = t.cap_nodes;
    }
    CU_ASSERT(grows > 0);
    CU_ASSERT_EQUAL(a.grow_count, grows);
    CU_ASSERT_EQUAL(t.cap_nodes, cap);
    free(x), free(dy);
    tape_free(&t);
    arena_free(&a);
}

/* Without gradients nothing is recorded and no mask is kept. */
static void test_blocks_eval(void) {
    TestEnv e;
    test_env_init(&e, 16);
    float *x = block_data(71, 256);
    e.tape.grad_enabled = false;
    Var *vx = test_var(&e, x, 2, (int[]){4, 64}, true);
    FakeQuantSpec ms = {.qtype = qa_find("mx9")}, is = {.qtype = qa_find("int8"), TILE1(16)};
    Var *a = fq_fake_quant_dynamic(&e.tape, vx, &ms, NULL), *b = fq_fake_quant_dynamic(&e.tape, vx, &is, NULL);
    CU_ASSERT_FATAL(a && b);
    CU_ASSERT(!a->requires_grad && !b->requires_grad);
    CU_ASSERT_EQUAL(e.tape.n_nodes, 0u);
    free(x);
    test_env_free(&e);
}

int fq_block_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "blocks: forward == QArray round trip, every layout and format", test_forward_blocks) ||
           !CU_add_test(s, "blocks: per_channel with tiles, the tape's rng", test_spec_details) ||
           !CU_add_test(s, "blocks: clipped STE per int block, by hand", test_ste_int_blocks) ||
           !CU_add_test(s, "blocks: clipped STE per asymmetric block", test_ste_asymmetric_blocks) ||
           !CU_add_test(s, "blocks: clipped STE per MX block, by hand", test_ste_mx_blocks) ||
           !CU_add_test(s, "blocks: gradcheck without rounding", test_gradcheck_blocks) ||
           !CU_add_test(s, "blocks: errors", test_block_errors) ||
           !CU_add_test(s, "blocks: no arena growth after the first step", test_arena_steady_state) ||
           !CU_add_test(s, "blocks: eval records nothing", test_blocks_eval);
}
