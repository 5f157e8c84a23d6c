/* test_qarray_numerics.c - QArray numerics: error bounds on Gaussian data
 * argued from each format's step, zero points, stochastic rounding, scale
 * types and double quantization. Expected values come from DESIGN.md's
 * formulas, worked out here. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "quant/qarray.h"
#include "test_qarray.h"
#include "test_util.h"

/* RMSE of each format on 64K N(0,1) samples (256 x 256). The max |x| of
 * 64K samples is about 4.2; the bounds follow from each format's step and
 * uniform rounding error step / sqrt(12), with ~20% headroom (a different
 * sample moves the RMSE by well under 1%). */
static void test_error_bounds(void) {
    float *x = qa_normal_sample(1234, N_BIG), *y = qa_alloc_floats(N_BIG);
    QArrayOptions per_row = qa_channelwise(0), blocks32 = qa_row_blocks(32), blocks64 = qa_row_blocks(64);
    struct {
        const char *qt;
        const QArrayOptions *o;
        double bound;
        const char *why;
    } cases[] = {
        {"int8", NULL, 0.012, "step 4.2 / 127.5 = 0.033, / sqrt(12) = 0.0095"},
        {"int4", NULL, 0.19, "step 4.2 / 7.5 = 0.56, / sqrt(12) = 0.16"},
        {"uint8", NULL, 0.012, "step (max - min) / 255 = 8.4 / 255 = 0.033 -> 0.0095"},
        /* NF4 gaps times a block absmax ~2.5: 0.20, 0.20, 0.21, 0.23, 0.26, 0.31, 0.40, 0.69 from 0 up;
         * sum over gaps of P(gap) * gap^2 / 12 = 0.0073 -> 0.086; the absmax varies from block to block */
        {"nf4", &blocks64, 0.10, "NF4 gaps x block absmax 2.5 -> 0.086"},
        /* floats: the step is 2^-M of the binade's bottom, 2^-M-1..2^-M of |x|; about 0.75 * 2^-M * rms(x) */
        {"fp8_e4m3", NULL, 0.032, "0.75 * 2^-3 / sqrt(12) = 0.027"},
        {"fp8_e5m2", NULL, 0.064, "0.75 * 2^-2 / sqrt(12) = 0.054"},
        {"fp4_e2m1", NULL, 0.15, "0.75 * 2^-1 / sqrt(12) = 0.11, plus the coarse band near 0 (step 0.5 * 0.7)"},
        /* fp4 elements under a per-32 power of two: the block max lands anywhere in [4, 8) of the grid, so
         * on average the grid is coarser than a float scale's; same 2^-1 relative step */
        {"mxfp4", NULL, 0.14, "fp4's 0.11 with power-of-two block scales"},
        /* mxint8: step 2^(X-6), X = floor(log2 amax of 32) = 1 for 77% of blocks (amax >= 2), else 0:
         * sqrt(0.77 (1/32)^2 / 12 + 0.23 (1/64)^2 / 12) = 0.0082 */
        {"mxint8", NULL, 0.0095, "steps 1/32 and 1/64 -> 0.0082"},
        /* the largest |x| of n samples is about the largest of 2n signed ones: ~3.0 for 256, ~2.45 for 32 */
        {"int8", &per_row, 0.0085, "row amax ~3.0: step 3.0 / 127.5 = 0.024 -> 0.0068"},
        {"int4", &blocks32, 0.115, "block amax ~2.45: step 2.45 / 7.5 = 0.33 -> 0.094"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        QArray q;
        qa_quant_ok(&q, x, 2, BIG_SHAPE, cases[k].qt, cases[k].o);
        qarray_dequantize(&q, y);
        double e = qa_rmse(x, y, N_BIG);
        if (getenv("QT_TEST_SHOW_RMSE")) /* for reading the margins */
            fprintf(stderr, "\n  %-9s RMSE %.5f (bound %.4f)", cases[k].qt, e, cases[k].bound);
        if (!(e <= cases[k].bound))
            fprintf(stderr, "\n  %s: RMSE %.5f above %.4f (%s)\n", cases[k].qt, e, cases[k].bound, cases[k].why);
        CU_ASSERT(e <= cases[k].bound);
        /* and not absurdly small either: the grid is really that coarse */
        CU_ASSERT(e >= cases[k].bound * 0.5);
        qarray_free(&q);
    }
    free(x);
    free(y);
}

/* ---- zero points --------------------------------------------------------------------- */

static void check_asym(const char *qt, const float *x, size_t n, QArrayZpType zp_type, float want_zp) {
    const int shape[1] = {(int)n};
    QArrayOptions o = {.range = QARRAY_RANGE_ASYMMETRIC, .zp_type = zp_type};
    QArray q;
    qa_quant_ok(&q, x, 1, shape, qt, &o);
    CU_ASSERT(q.asymmetric && q.zp_type == zp_type);
    float s = qarray_scale_at(&q, 0), zp = qarray_zero_point_at(&q, 0);
    if (!isnan(want_zp)) CU_ASSERT_EQUAL(zp, want_zp);
    float *y = qa_alloc_floats(n);
    qarray_dequantize(&q, y);
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs((double)x[i] - y[i]));
    CU_ASSERT(worst <= 0.5 * s * (1.0 + 1e-5));
    if (zp_type == QARRAY_ZP_INT32) {
        /* 0 is exactly code zp */
        CU_ASSERT_EQUAL((zp - zp) * s, 0.0f);
        QArray z;
        float with0[2] = {x[0], 0.0f};
        qa_quant_ok(&z, with0, 1, (const int[]){2}, qt, &o);
        float y0[2];
        qarray_dequantize(&z, y0);
        CU_ASSERT_EQUAL(y0[1], 0.0f);
        qarray_free(&z);
    }
    free(y);
    qarray_free(&q);
}

static void test_asymmetric(void) {
    float pos[64], neg[64], mixed[64];
    for (int i = 0; i < 64; i++) {
        pos[i] = 1.0f + 2.0f * (float)i / 63.0f + 0.001f * (float)(i % 7); /* min > 0 */
        neg[i] = -pos[i];                                                  /* max < 0 */
        mixed[i] = -1.3f + 4.0f * (float)i / 63.0f;
    }
    /* min > 0: lo- = 0, so zp = qmin; max < 0: hi+ = 0, so 0 sits at the top code */
    check_asym("uint8", pos, 64, QARRAY_ZP_INT32, 0.0f);
    check_asym("uint8", neg, 64, QARRAY_ZP_INT32, 255.0f);
    check_asym("int8", pos, 64, QARRAY_ZP_INT32, -128.0f);
    check_asym("int8", neg, 64, QARRAY_ZP_INT32, 127.0f);
    check_asym("uint4", mixed, 64, QARRAY_ZP_INT32, NAN);
    /* uint's default range is asymmetric: scale (2.7 + 1.3) / 255 and zp = -rne(-1.3 / scale) */
    QArray q;
    qa_quant_ok(&q, mixed, 1, (const int[]){64}, "uint8", NULL);
    float s = (float)(((double)mixed[63] - mixed[0]) / 255.0);
    CU_ASSERT(q.asymmetric);
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 0), s);
    CU_ASSERT_EQUAL(qarray_zero_point_at(&q, 0), -rintf(mixed[0] / s));
    CU_ASSERT_EQUAL(qarray_bytes(&q), 64u + 4u + 4u);
    qarray_free(&q);
    /* float zero point: the range ends map onto codes 0 and 255, zp unrounded */
    check_asym("uint8", mixed, 64, QARRAY_ZP_FLOAT, NAN);
    qa_quant_ok(&q, mixed, 1, (const int[]){64}, "uint8", &(QArrayOptions){.zp_type = QARRAY_ZP_FLOAT});
    CU_ASSERT(fabsf(qarray_zero_point_at(&q, 0) - (-mixed[0] / s)) < 1e-4f);
    uint32_t *c = qa_codes_of(&q);
    CU_ASSERT(c[0] == 0 && c[63] == 255);
    free(c);
    qarray_free(&q);
    /* uint symmetric = unsigned: zp 0, scale amax / 255, negatives clamp to 0 */
    qa_quant_ok(&q, mixed, 1, (const int[]){64}, "uint8", &(QArrayOptions){.range = QARRAY_RANGE_SYMMETRIC});
    CU_ASSERT(!q.asymmetric);
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 0), mixed[63] / 255.0f);
    float y[64];
    qarray_dequantize(&q, y);
    CU_ASSERT(y[0] == 0.0f && y[63] == mixed[63]);
    qarray_free(&q);
}

/* ---- stochastic rounding ---------------------------------------------------------------- */

static void test_stochastic(void) {
    /* int8 with fixed,127.5: scale 1, so a value v is rounded to floor(v) or floor(v) + 1 */
    CalibSpec fixed = {.kind = CALIB_FIXED, .a = 127.5};
    Rng g;
    rng_init(&g, 99, RNG_STREAM_ROUNDING);
    QArrayOptions o = {.calib = &fixed, .round = QROUND_STOCHASTIC, .rng = &g};
    const float vals[3] = {0.3f, -2.7f, 5.875f};
    float x[64], y[64];
    for (int v = 0; v < 3; v++) {
        for (int i = 0; i < 64; i++) x[i] = vals[v];
        /* 256 calls x 64 elements, each element its own RNG word: 16384 independent draws of a
         * Bernoulli(p) step; std of the mean <= 0.5 / sqrt(16384) = 0.0039; tolerance 5 sigma = 0.02 */
        double sum = 0.0;
        for (int rep = 0; rep < 256; rep++) {
            QArray q;
            qa_quant_ok(&q, x, 1, (const int[]){64}, "int8", &o);
            qarray_dequantize(&q, y);
            for (int i = 0; i < 64; i++) {
                CU_ASSERT(y[i] == floorf(vals[v]) || y[i] == floorf(vals[v]) + 1.0f);
                sum += y[i];
            }
            qarray_free(&q);
        }
        CU_ASSERT(fabs(sum / 16384.0 - vals[v]) < 0.02);
    }
    /* the order of draws: element i takes word i of the stream: code i = floor(x_i + u_i) */
    float xs[37];
    for (int i = 0; i < 37; i++) xs[i] = -9.0f + 0.49f * (float)i;
    Rng before = g, copy = g;
    uint32_t words[37];
    rng_fill_u32(&copy, words, 37);
    QArray a, b;
    qa_quant_ok(&a, xs, 1, (const int[]){37}, "int8", &o);
    CU_ASSERT_EQUAL(g.counter, before.counter + 10); /* ceil(37 / 4) blocks */
    CU_ASSERT_EQUAL(g.counter, copy.counter);
    float ya[37];
    qarray_dequantize(&a, ya);
    for (int i = 0; i < 37; i++) CU_ASSERT_EQUAL(ya[i], floorf(xs[i] + rng_u32_to_unit(words[i])));
    /* the same state gives the same codes bit for bit; the next state others */
    g = before;
    qa_quant_ok(&b, xs, 1, (const int[]){37}, "int8", &o);
    CU_ASSERT(memcmp(a.codes, b.codes, a.code_bytes) == 0);
    qarray_free(&b);
    qa_quant_ok(&b, xs, 1, (const int[]){37}, "int8", &o);
    CU_ASSERT(memcmp(a.codes, b.codes, a.code_bytes) != 0);
    qarray_free(&a);
    qarray_free(&b);
    /* a float grid: fp8 e4m3 with scale 1 (fixed,448); 1.3 lies between 1.25 and 1.375, up with p = 0.4 */
    fixed.a = 448.0;
    for (int i = 0; i < 64; i++) x[i] = 1.3f;
    double sum = 0.0;
    for (int rep = 0; rep < 256; rep++) {
        qa_quant_ok(&a, x, 1, (const int[]){64}, "fp8_e4m3", &o);
        qarray_dequantize(&a, y);
        for (int i = 0; i < 64; i++) sum += y[i];
        qarray_free(&a);
    }
    /* std of one draw 0.125 * sqrt(0.24) = 0.061; of the mean 0.00048; 5 sigma = 0.0024 */
    CU_ASSERT(fabs(sum / 16384.0 - 1.3) < 0.0024);
    /* block formats draw the same way: mxint8 of a constant block */
    for (int i = 0; i < 32; i++) x[i] = 1.0f + 1.0f / 256.0f; /* between codes 64 and 65 of 2^-6, p = 0.25 */
    x[0] = 1.75f;
    sum = 0.0;
    for (int rep = 0; rep < 512; rep++) {
        qa_quant_ok(&a, x, 1, (const int[]){32}, "mxint8", &(QArrayOptions){.round = QROUND_STOCHASTIC, .rng = &g});
        qarray_dequantize(&a, y);
        for (int i = 1; i < 32; i++) sum += y[i];
        qarray_free(&a);
    }
    /* 512 * 31 draws of a step of 1/64 with p = 0.25: std of the mean 0.0156 * 0.43 / 126 = 5.4e-5 */
    CU_ASSERT(fabs(sum / (512.0 * 31.0) - (1.0 + 1.0 / 256.0)) < 2.7e-4);
}

/* ---- scale types -------------------------------------------------------------------------- */

static bool is_f16_value(float s) {
    if (!(s > 0.0f) || s > 65504.0f) return false;
    int e;
    frexpf(s, &e);
    int ex = e - 1 < -14 ? -14 : e - 1;
    float m = ldexpf(s, 10 - ex); /* an integer below 2048 for a binary16 value */
    return m == floorf(m) && m < 2048.0f;
}

static bool is_bf16_value(float s) {
    uint32_t u;
    memcpy(&u, &s, sizeof u);
    return (u & 0xffffu) == 0;
}

static float quant_scale(float amax, QArrayScaleType st) {
    float x[2] = {amax, -0.25f * amax};
    QArray q;
    qa_quant_ok(&q, x, 1, (const int[]){2}, "int8", &(QArrayOptions){.scale_type = st});
    float s = qarray_scale_at(&q, 0);
    qarray_free(&q);
    return s;
}

static void test_scale_types(void) {
    float *x = qa_normal_sample(21, N_BIG), *y = qa_alloc_floats(N_BIG);
    for (size_t i = 0; i < N_BIG; i++) x[i] *= 0.001f * (float)(1 + i % 977); /* scales over 3 decades */
    const QArrayScaleType types[3] = {QARRAY_SCALE_F16, QARRAY_SCALE_BF16, QARRAY_SCALE_POF2};
    const size_t bytes[3] = {2, 2, 1};
    QArray ref;
    QArrayOptions o = qa_channelwise(1);
    qa_quant_ok(&ref, x, 2, BIG_SHAPE, "int8", &o);
    for (int k = 0; k < 3; k++) {
        o.scale_type = types[k];
        QArray q;
        qa_quant_ok(&q, x, 2, BIG_SHAPE, "int8", &o);
        CU_ASSERT_EQUAL(q.scale_type, types[k]);
        CU_ASSERT_EQUAL(qarray_bytes(&q), (size_t)N_BIG + 256 * bytes[k]);
        bool ok = true;
        for (size_t c = 0; c < 256; c++) {
            float s = qarray_scale_at(&q, c), s32 = qarray_scale_at(&ref, c);
            if (types[k] == QARRAY_SCALE_F16) ok &= is_f16_value(s) && fabsf(s - s32) <= s32 * 0x1p-11f;
            if (types[k] == QARRAY_SCALE_BF16) ok &= is_bf16_value(s) && fabsf(s - s32) <= s32 * 0x1p-8f;
            if (types[k] == QARRAY_SCALE_POF2) {
                int e;
                ok &= frexpf(s, &e) == 0.5f && s >= s32 && s < 2.0f * s32; /* 2^ceil(log2 s) */
            }
        }
        CU_ASSERT(ok);
        /* dequantize uses exactly the stored scale: y = code * scale */
        uint32_t *cd = qa_codes_of(&q);
        qarray_dequantize(&q, y);
        bool exact = true;
        for (size_t i = 0; i < N_BIG; i++) exact &= y[i] == qtype_decode(q.qtype, cd[i]) * qarray_scale_at(&q, i % 256);
        CU_ASSERT(exact);
        free(cd);
        qarray_free(&q);
    }
    qarray_free(&ref);
    /* ties to even: 127.5 * (1 + 2^-11) gives the f32 scale 1 + 2^-11, halfway between f16 1 and 1 + 2^-10 */
    CU_ASSERT_EQUAL(quant_scale(127.5f * (1.0f + 0x1p-11f), QARRAY_SCALE_F16), 1.0f);
    CU_ASSERT_EQUAL(quant_scale(127.5f * (1.0f + 3 * 0x1p-11f), QARRAY_SCALE_F16), 1.0f + 0x1p-9f);
    CU_ASSERT_EQUAL(quant_scale(127.5f * (1.0f + 0x1p-8f), QARRAY_SCALE_BF16), 1.0f);
    CU_ASSERT_EQUAL(quant_scale(127.5f * (1.0f + 3 * 0x1p-8f), QARRAY_SCALE_BF16), 1.0f + 0x1p-6f);
    CU_ASSERT_EQUAL(quant_scale(127.5f * 3.0f, QARRAY_SCALE_POF2), 4.0f);
    CU_ASSERT_EQUAL(quant_scale(127.5f * 4.0f, QARRAY_SCALE_POF2), 4.0f);
    CU_ASSERT_EQUAL(quant_scale(127.5f * 0.3f, QARRAY_SCALE_POF2), 0.5f);
    /* f16 limits: a tiny scale becomes 2^-24, a huge one is an error */
    CU_ASSERT_EQUAL(quant_scale(1e-9f, QARRAY_SCALE_F16), 0x1p-24f);
    float big[2] = {1e7f, 1.0f};
    qa_quant_fails(big, 1, (const int[]){2}, "int8", &(QArrayOptions){.scale_type = QARRAY_SCALE_F16}, QT_ERR_VALUE,
                (const char *const[]){"float16", "65504", NULL});
    /* the conversions against known bit patterns */
    CU_ASSERT_EQUAL(qarray_f32_to_f16(1.0f), 0x3c00);
    CU_ASSERT_EQUAL(qarray_f32_to_f16(65504.0f), 0x7bff);
    CU_ASSERT_EQUAL(qarray_f32_to_f16(65520.0f), 0x7c00);
    CU_ASSERT_EQUAL(qarray_f32_to_f16(0x1p-14f), 0x0400);
    CU_ASSERT_EQUAL(qarray_f32_to_f16(0x1p-24f), 0x0001);
    CU_ASSERT_EQUAL(qarray_f32_to_f16(0.1f), 0x2e66);
    CU_ASSERT_EQUAL(qarray_f32_to_f16(-2.0f), 0xc000);
    CU_ASSERT_EQUAL(qarray_f16_to_f32(0x2e66), 0.0999755859375f);
    CU_ASSERT_EQUAL(qarray_f32_to_bf16(1.0f), 0x3f80);
    CU_ASSERT_EQUAL(qarray_f32_to_bf16(0.1f), 0x3dcd);
    CU_ASSERT_EQUAL(qarray_bf16_to_f32(0x3dcd), 0.10009765625f);
    for (uint32_t h = 0; h < 0x7c00; h++) CU_ASSERT_EQUAL(qarray_f32_to_f16(qarray_f16_to_f32((uint16_t)h)), h);
    /* names */
    QArrayScaleType st;
    CU_ASSERT(qarray_scale_type_parse("BF16", &st, NULL) == QT_OK && st == QARRAY_SCALE_BF16);
    CU_ASSERT(qarray_scale_type_parse("pof2", &st, NULL) == QT_OK && st == QARRAY_SCALE_POF2);
    QtError err = {0};
    CU_ASSERT_EQUAL(qarray_scale_type_parse("fp8", &st, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "float16"));
    CU_ASSERT_STRING_EQUAL(qarray_scale_type_name(QARRAY_SCALE_F16), "float16");
    QArrayZpType zt;
    CU_ASSERT(qarray_zp_type_parse("float", &zt, NULL) == QT_OK && zt == QARRAY_ZP_FLOAT);
    CU_ASSERT_STRING_EQUAL(qarray_zp_type_name(QARRAY_ZP_INT32), "int32");
    free(x);
    free(y);
}

/* ---- double quantization ------------------------------------------------------------------- */

static void test_double_quant(void) {
    /* the map: 256 ascending values, -0.99296875 .. 1, zero in the middle */
    const float *map = qarray_dq_map();
    bool ascending = true;
    for (int i = 1; i < 256; i++) ascending &= map[i - 1] < map[i];
    CU_ASSERT(ascending);
    CU_ASSERT_EQUAL(map[127], 0.0f);
    CU_ASSERT_EQUAL(map[255], 1.0f);
    CU_ASSERT_EQUAL(map[254], 0.99296875f);  /* 0.1 + 63.5 * 0.9 / 64 */
    CU_ASSERT_EQUAL(map[0], -0.99296875f);
    CU_ASSERT_EQUAL(map[128], (float)0.55e-6); /* 10^-6 * (0.1 + 0.5 * 0.9) */

    float *x = qa_normal_sample(1234, N_BIG), *y = qa_alloc_floats(N_BIG), *y0 = qa_alloc_floats(N_BIG);
    QArray plain, dq;
    qa_quant_ok(&plain, x, 2, BIG_SHAPE, "nf4", NULL);
    qa_quant_ok(&dq, x, 2, BIG_SHAPE, "nf4", &(QArrayOptions){.double_quant = true});
    /* 4 bits + 32 bits per 64 elements = 4.5 */
    CU_ASSERT_DOUBLE_EQUAL(qarray_bits_per_element(&plain), 4.5, 1e-12);
    /* bytes: N/2 codes + N/64 one-byte scale codes + 4 per 256 scales + 4 for the mean;
     * bits/param = 4 + 8/64 + 32/(64 * 256) + 32/N = 4.127441 for N = 65536 */
    size_t ns = N_BIG / 64;
    CU_ASSERT_EQUAL(dq.n_scales, ns);
    CU_ASSERT_EQUAL(dq.dq.n_blocks, ns / 256);
    CU_ASSERT_EQUAL(qarray_bytes(&dq), (size_t)N_BIG / 2 + ns + 4 * (ns / 256) + 4);
    double want = 4.0 + 8.0 / 64 + 32.0 / (64 * 256) + 32.0 / N_BIG;
    CU_ASSERT_DOUBLE_EQUAL(qarray_bits_per_element(&dq), want, 1e-12);
    CU_ASSERT(fabs(qarray_bits_per_element(&dq) - 4.127) < 0.001);
    CU_ASSERT_PTR_NULL(dq.scale.f32);
    /* the reconstructed scales are close to the block absmaxes, and the codes use them exactly */
    double worst = 0.0;
    for (size_t i = 0; i < ns; i++)
        worst = fmax(worst, fabs(qarray_scale_at(&dq, i) - qarray_scale_at(&plain, i)) / qarray_scale_at(&plain, i));
    CU_ASSERT(worst < 0.01); /* (s - mean) / absmax on the map: steps of 1/64 of ~1.5 near the ends -> < 0.5% */
    uint32_t *c = qa_codes_of(&dq);
    qarray_dequantize(&dq, y);
    bool exact = true;
    for (size_t i = 0; i < N_BIG; i++) exact &= y[i] == qtype_decode(dq.qtype, c[i]) * qarray_scale_at(&dq, i / 64);
    CU_ASSERT(exact);
    free(c);
    /* RMSE within 3% of plain nf4 */
    qarray_dequantize(&plain, y0);
    double e0 = qa_rmse(x, y0, N_BIG), e1 = qa_rmse(x, y, N_BIG);
    CU_ASSERT(e1 <= e0 * 1.03);
    qarray_free(&plain);
    qarray_free(&dq);
    /* on another format and block: int4 blocks of 32 with DQ blocks of 64 scales, again within 3% */
    QArrayOptions o = qa_row_blocks(32);
    qa_quant_ok(&plain, x, 2, BIG_SHAPE, "int4", &o);
    qarray_dequantize(&plain, y0);
    o.double_quant = true, o.dq_block = 64;
    qa_quant_ok(&dq, x, 2, BIG_SHAPE, "int4", &o);
    CU_ASSERT(dq.dq.block == 64 && dq.dq.n_blocks == 2048 / 64);
    qarray_dequantize(&dq, y);
    CU_ASSERT(qa_rmse(x, y, N_BIG) <= qa_rmse(x, y0, N_BIG) * 1.03);
    qarray_free(&plain);
    qarray_free(&dq);
    /* an outlier block drags the mean and the DQ block's absmax far from the other scales, whose
     * reconstruction is then coarse or even negative; their codes are computed with that scale, so they
     * shrink towards 0 instead of being amplified (no error beyond the values themselves), while the
     * outlier block keeps its accuracy */
    float *w = qa_normal_sample(77, 256 * 64), *wy = qa_alloc_floats(256 * 64);
    for (int i = 0; i < 64; i++) w[i] *= 1e6f;
    qa_quant_ok(&dq, w, 2, (const int[]){256, 64}, "nf4", &(QArrayOptions){.double_quant = true});
    qarray_dequantize(&dq, wy);
    bool bounded = true;
    for (int i = 64; i < 256 * 64; i++) bounded &= fabsf(wy[i] - w[i]) <= qa_abs_max(w + i / 64 * 64, 64) * 1.001f;
    CU_ASSERT(bounded);
    CU_ASSERT(qa_rmse(w, wy, 64) < 0.1 * 1e6);
    qarray_free(&dq);
    free(w);
    free(wy);
    /* one scale only, or all equal: exact (the offset is the scale, the code is 0) */
    qa_quant_ok(&dq, x, 2, BIG_SHAPE, "int8", &(QArrayOptions){.double_quant = true});
    CU_ASSERT_EQUAL(qarray_scale_at(&dq, 0), qa_abs_max(x, N_BIG) / 127.5f);
    qarray_free(&dq);
    free(x);
    free(y);
    free(y0);
}

/* ---- sizes ------------------------------------------------------------------------------------ */

int qarray_numerics_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "RMSE on N(0,1) within each format's step bound", test_error_bounds) ||
           !CU_add_test(s, "asymmetric zero points: min > 0, max < 0, float zp", test_asymmetric) ||
           !CU_add_test(s, "stochastic rounding: unbiased, ordered, reproducible", test_stochastic) ||
           !CU_add_test(s, "scale types float16, bfloat16, pof2", test_scale_types) ||
           !CU_add_test(s, "double quantization: 4.127 bits, RMSE near nf4", test_double_quant);
}
