/* test_qarray.c - QArray layouts (per-tensor, per-channel, blocks, tile
 * fractions), exact and idempotent round trips, sizes, row dequantization,
 * per-kind scale rules and bad input; the shared helpers. Numerics (error
 * bounds, zero points, stochastic rounding, scale types, double
 * quantization) are in test_qarray_numerics.c. Expected values are worked
 * out from DESIGN.md's formulas, not taken from quant/. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "quant/qarray.h"
#include "test_qarray.h"
#include "test_util.h"

const int BIG_SHAPE[2] = {256, 256};

const QType *qa_find(const char *name) {
    QtError err = {0};
    const QType *t = qtype_find(name, &err);
    if (!t) fprintf(stderr, "\n  qtype_find(%s): %s\n", name, err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    return t;
}

/* Quantizes and fails the test (printing the message) on any error. */
void qa_quant_ok(QArray *q, const float *x, int ndim, const int *shape, const char *qt, const QArrayOptions *o) {
    QtError err = {0};
    QtStatus st = qarray_quantize(q, x, ndim, shape, qa_find(qt), o, &err);
    if (st != QT_OK) fprintf(stderr, "\n  qarray_quantize(%s): %s\n", qt, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

/* Quantizing must fail with `want`, and the message must hold every
 * string of `has` (NULL-terminated); the output is left empty. */
void qa_quant_fails(const float *x, int ndim, const int *shape, const char *qt, const QArrayOptions *o,
                        QtStatus want, const char *const *has) {
    QtError err = {0};
    QArray q;
    memset(&q, 0xab, sizeof q);
    QtStatus st = qarray_quantize(&q, x, ndim, shape, qa_find(qt), o, &err);
    if (st != want) fprintf(stderr, "\n  %s: status %d, want %d (%s)\n", qt, (int)st, (int)want, err.msg);
    CU_ASSERT_EQUAL(st, want);
    for (int i = 0; has && has[i]; i++) CU_ASSERT(test_msg_has(&err, has[i]));
    CU_ASSERT_PTR_NULL(q.codes);
    CU_ASSERT_PTR_NULL(q.scale.f32);
    CU_ASSERT_EQUAL(q.numel, 0u);
}

float *qa_normal_sample(uint64_t seed, size_t n) {
    float *x = malloc(n * sizeof *x);
    CU_ASSERT_PTR_NOT_NULL_FATAL(x);
    Rng g;
    rng_init(&g, seed, RNG_STREAM_INIT);
    rng_fill_normal(&g, x, n, 0.0f, 1.0f);
    return x;
}

float *qa_alloc_floats(size_t n) {
    float *y = malloc((n ? n : 1) * sizeof *y);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    return y;
}

/* Every code of q, unpacked with qtype_unpack (not QArray's own reader). */
uint32_t *qa_codes_of(const QArray *q) {
    uint32_t *c = malloc((q->numel ? q->numel : 1) * sizeof *c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_EQUAL(qtype_unpack(q->qtype, q->codes, q->numel, c), QT_OK);
    return c;
}

double qa_rmse(const float *a, const float *b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return sqrt(s / (double)n);
}

float qa_abs_max(const float *x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}

QArrayOptions qa_channelwise(int axis) {
    QArrayOptions o = {0};
    o.n_channelwise = 1;
    o.channelwise_axes[0] = axis;
    return o;
}

/* One scale per row (axis 0) and per `tile` of axis 1: subchannel blocks. */
QArrayOptions qa_row_blocks(double tile) {
    QArrayOptions o = qa_channelwise(0);
    o.n_tiled = 1;
    o.tiled_axes[0] = (QArrayTiledAxis){1, tile};
    return o;
}

/* DESIGN's symmetric int code, written out here. */
int32_t qa_int_code(float x, float scale, int bits) {
    float v = rintf(x / scale), lo = -(float)(1 << (bits - 1)), hi = (float)((1 << (bits - 1)) - 1);
    return (int32_t)fminf(fmaxf(v, lo), hi);
}

/* ---- layouts ------------------------------------------------------------------ */

static void test_per_tensor(void) {
    const float x[6] = {-1.0f, 0.5f, 2.55f, -2.0f, 0.01f, 0.0f};
    const int shape[2] = {2, 3};
    QArray q;
    qa_quant_ok(&q, x, 2, shape, "int8", NULL);
    CU_ASSERT(q.ndim == 2 && q.shape[0] == 2 && q.shape[1] == 3 && q.numel == 6);
    CU_ASSERT(q.scale_shape[0] == 1 && q.scale_shape[1] == 1 && q.n_scales == 1);
    CU_ASSERT(!q.asymmetric && !q.double_quant && q.scale_type == QARRAY_SCALE_F32);
    float s = 2.55f / 127.5f;
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 0), s);
    uint32_t *c = qa_codes_of(&q);
    float y[6];
    qarray_dequantize(&q, y);
    for (int i = 0; i < 6; i++) {
        int32_t k = qa_int_code(x[i], s, 8);
        CU_ASSERT_EQUAL(qtype_decode(q.qtype, c[i]), (float)k);
        CU_ASSERT_EQUAL(y[i], (float)k * s);
    }
    CU_ASSERT_EQUAL(qarray_bytes(&q), 6u + 4u);
    free(c);
    qarray_free(&q);
    CU_ASSERT_PTR_NULL(q.codes);
    qarray_free(&q); /* twice is harmless */
    qarray_free(NULL);
}

/* A dense weight (out, in) = (4, 8), one scale per output row. */
static void test_per_channel(void) {
    float w[32];
    for (int i = 0; i < 32; i++) w[i] = (float)((i * 37) % 23 - 11) * (0.1f + 0.3f * (float)(i / 8));
    const int shape[2] = {4, 8};
    QArrayOptions o = qa_channelwise(0);
    QArray q;
    qa_quant_ok(&q, w, 2, shape, "int8", &o);
    CU_ASSERT(q.scale_shape[0] == 4 && q.scale_shape[1] == 1 && q.n_scales == 4);
    CU_ASSERT(q.tile[0] == 1 && q.tile[1] == 8);
    uint32_t *c = qa_codes_of(&q);
    for (int r = 0; r < 4; r++) {
        float s = qa_abs_max(w + 8 * r, 8) / 127.5f;
        CU_ASSERT_EQUAL(qarray_scale_at(&q, (size_t)r), s);
        for (int j = 0; j < 8; j++)
            CU_ASSERT_EQUAL(qtype_decode(q.qtype, c[8 * r + j]), (float)qa_int_code(w[8 * r + j], s, 8));
    }
    free(c);
    qarray_free(&q);
    /* channelwise along the input axis (columns): strided slices */
    o = qa_channelwise(-1);
    qa_quant_ok(&q, w, 2, shape, "int8", &o);
    CU_ASSERT(q.scale_shape[0] == 1 && q.scale_shape[1] == 8);
    for (int j = 0; j < 8; j++) {
        float col[4] = {w[j], w[8 + j], w[16 + j], w[24 + j]};
        CU_ASSERT_EQUAL(qarray_scale_at(&q, (size_t)j), qa_abs_max(col, 4) / 127.5f);
    }
    qarray_free(&q);
}

/* Blocks of 32 and 64 along the input axis of a (4, 128) weight. */
static void test_blocks(void) {
    float *w = qa_normal_sample(7, 512);
    const int shape[2] = {4, 128};
    const int tiles[2] = {32, 64};
    for (int k = 0; k < 2; k++) {
        int t = tiles[k], nb = 128 / t;
        QArrayOptions o = qa_row_blocks(t);
        QArray q;
        qa_quant_ok(&q, w, 2, shape, "int4", &o);
        CU_ASSERT(q.scale_shape[0] == 4 && q.scale_shape[1] == nb && q.tile[1] == t);
        CU_ASSERT_EQUAL(q.n_scales, (size_t)(4 * nb));
        uint32_t *c = qa_codes_of(&q);
        for (int r = 0; r < 4; r++)
            for (int b = 0; b < nb; b++) {
                const float *blk = w + 128 * r + t * b;
                float s = qa_abs_max(blk, (size_t)t) / 7.5f;
                CU_ASSERT_EQUAL(qarray_scale_at(&q, (size_t)(r * nb + b)), s);
                for (int j = 0; j < t; j++)
                    CU_ASSERT_EQUAL(qtype_decode(q.qtype, c[128 * r + t * b + j]), (float)qa_int_code(blk[j], s, 4));
            }
        free(c);
        qarray_free(&q);
    }
    /* nf4 without options: blocks of 64 along the last axis, rows apart (bitsandbytes) */
    QArray q;
    qa_quant_ok(&q, w, 2, shape, "nf4", NULL);
    CU_ASSERT(q.scale_shape[0] == 4 && q.scale_shape[1] == 2 && q.tile[0] == 1 && q.tile[1] == 64);
    for (int b = 0; b < 8; b++) CU_ASSERT_EQUAL(qarray_scale_at(&q, (size_t)b), qa_abs_max(w + 64 * b, 64));
    qarray_free(&q);
    /* mxfp4: blocks of 32 along the last axis, one scale per block of each row */
    qa_quant_ok(&q, w, 2, shape, "mxfp4", NULL);
    CU_ASSERT(q.scale_shape[0] == 4 && q.scale_shape[1] == 4 && q.n_scales == 16 && q.tile[1] == 32);
    CU_ASSERT(q.scale_type == QARRAY_SCALE_POF2);
    for (int b = 0; b < 16; b++) /* OCP: 2^(floor(log2 amax) - emax_elem), emax_elem = 2 for fp4 */
        CU_ASSERT_EQUAL(qarray_scale_at(&q, (size_t)b), ldexpf(1.0f, (int)floorf(log2f(qa_abs_max(w + 32 * b, 32))) - 2));
    qarray_free(&q);
    free(w);
}

/* A fraction f tiles an axis into round(dim * f) elements: 0.25 = 4 tiles. */
static void test_fraction_tiles(void) {
    float *x = qa_normal_sample(8, 8 * 64);
    const int shape[2] = {8, 64};
    QArrayOptions o = qa_row_blocks(0.25);
    QArray q;
    qa_quant_ok(&q, x, 2, shape, "int8", &o);
    CU_ASSERT(q.tile[1] == 16 && q.scale_shape[1] == 4 && q.scale_shape[0] == 8);
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 5), qa_abs_max(x + 64 * 1 + 16 * 1, 16) / 127.5f);
    qarray_free(&q);
    /* both axes tiled: 0.5 of 8 rows = 4, 32 of 64 columns; 2 x 2 scales */
    o = (QArrayOptions){.n_tiled = 2, .tiled_axes = {{0, 0.5}, {1, 32}}};
    qa_quant_ok(&q, x, 2, shape, "int8", &o);
    CU_ASSERT(q.tile[0] == 4 && q.tile[1] == 32 && q.scale_shape[0] == 2 && q.scale_shape[1] == 2);
    float box[128];
    for (int r = 0; r < 4; r++) memcpy(box + 32 * r, x + 64 * (4 + r) + 32, 32 * sizeof(float));
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 3), qa_abs_max(box, 128) / 127.5f);
    qarray_free(&q);
    /* a 3-d array, channelwise on the middle axis, fraction on the last */
    const int shape3[3] = {2, 4, 64};
    o = (QArrayOptions){.n_channelwise = 1, .channelwise_axes = {1}, .n_tiled = 1, .tiled_axes = {{2, 0.5}}};
    qa_quant_ok(&q, x, 3, shape3, "int8", &o);
    CU_ASSERT(q.scale_shape[0] == 1 && q.scale_shape[1] == 4 && q.scale_shape[2] == 2 && q.n_scales == 8);
    float part[64];
    memcpy(part, x + 64 * 1 + 32, 32 * sizeof(float));
    memcpy(part + 32, x + 256 + 64 * 1 + 32, 32 * sizeof(float));
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 3), qa_abs_max(part, 64) / 127.5f);
    qarray_free(&q);
    free(x);
}

static void test_axis_errors(void) {
    float x[400] = {0};
    const int shape[2] = {4, 100};
    QArrayOptions o = qa_row_blocks(32);
    qa_quant_fails(x, 2, shape, "int8", &o, QT_ERR_SHAPE,
                (const char *const[]){"axis 1", "size 100", "tile size 32", NULL});
    o = qa_row_blocks(0.3); /* 30 elements */
    qa_quant_fails(x, 2, shape, "int8", &o, QT_ERR_SHAPE, (const char *const[]){"axis 1", "100", "30", "0.3", NULL});
    o = qa_row_blocks(0.001);
    qa_quant_fails(x, 2, shape, "int8", &o, QT_ERR_SHAPE, (const char *const[]){"rounds to 0", NULL});
    const double bad_tiles[] = {0.0, -4.0, 2.5, NAN, INFINITY};
    for (int i = 0; i < 5; i++) {
        o = qa_row_blocks(bad_tiles[i]);
        qa_quant_fails(x, 2, shape, "int8", &o, QT_ERR_ARG, (const char *const[]){"tiled_axes", NULL});
    }
    o = qa_channelwise(2);
    qa_quant_fails(x, 2, shape, "int8", &o, QT_ERR_ARG, (const char *const[]){"axis 2 is out of range", "-2..1", NULL});
    o = (QArrayOptions){.n_tiled = 1, .tiled_axes = {{-3, 4}}};
    qa_quant_fails(x, 2, shape, "int8", &o, QT_ERR_ARG, (const char *const[]){"tiled_axes", "out of range", NULL});
    o = (QArrayOptions){.n_channelwise = 2, .channelwise_axes = {1, -1}};
    qa_quant_fails(x, 2, shape, "int8", &o, QT_ERR_ARG, (const char *const[]){"listed twice", NULL});
    o = (QArrayOptions){.n_channelwise = 1, .channelwise_axes = {0}, .n_tiled = 1, .tiled_axes = {{-2, 2}}};
    qa_quant_fails(x, 2, shape, "int8", &o, QT_ERR_ARG, (const char *const[]){"listed twice", "channelwise", NULL});
    o = (QArrayOptions){.n_channelwise = 5};
    qa_quant_fails(x, 2, shape, "int8", &o, QT_ERR_ARG, (const char *const[]){"n_channelwise", NULL});
    /* format defaults that do not divide */
    qa_quant_fails(x, 2, shape, "nf4", NULL, QT_ERR_SHAPE, (const char *const[]){"axis 1", "64", "default", NULL});
    qa_quant_fails(x, 2, shape, "mxfp4", NULL, QT_ERR_SHAPE, (const char *const[]){"axis 1", "32", "mxfp4", NULL});
    qa_quant_fails(x, 0, shape, "mxfp4", NULL, QT_ERR_SHAPE, (const char *const[]){"0-d", NULL});
    /* shapes */
    qa_quant_fails(x, 5, (const int[]){1, 1, 1, 1, 1}, "int8", NULL, QT_ERR_ARG, (const char *const[]){"0..4", NULL});
    qa_quant_fails(x, 2, (const int[]){4, -1}, "int8", NULL, QT_ERR_SHAPE, (const char *const[]){"negative", NULL});
}

/* Every combination a format or the other options cannot use names its option. */
static void test_option_errors(void) {
    float x[128] = {0};
    const int shape[2] = {2, 64};
    Rng g;
    rng_init(&g, 1, RNG_STREAM_ROUNDING);
    CalibSpec absmax = {.kind = CALIB_ABSMAX, .s = 1.0}, bad = {.kind = CALIB_ABSMAX, .s = -1.0};
    struct {
        const char *qt;
        QArrayOptions o;
        QtStatus want;
        const char *has;
    } cases[] = {
        {"fp8_e4m3", {.range = QARRAY_RANGE_ASYMMETRIC}, QT_ERR_ARG, "asymmetric"},
        {"nf4", {.range = QARRAY_RANGE_ASYMMETRIC}, QT_ERR_ARG, "asymmetric"},
        {"uint8", {.narrow_range = true}, QT_ERR_ARG, "narrow_range"},
        {"fp4_e2m1", {.narrow_range = true}, QT_ERR_ARG, "narrow_range"},
        {"int8", {.zp_type = QARRAY_ZP_FLOAT}, QT_ERR_ARG, "zp_type"},
        {"int8", {.round = QROUND_STOCHASTIC}, QT_ERR_ARG, "options.rng"},
        {"int8", {.rng = &g}, QT_ERR_ARG, "rng"},
        {"int8", {.double_quant = true, .range = QARRAY_RANGE_ASYMMETRIC}, QT_ERR_ARG, "double_quant"},
        {"int8", {.double_quant = true, .scale_type = QARRAY_SCALE_F16}, QT_ERR_ARG, "double_quant"},
        {"int8", {.dq_block = 128}, QT_ERR_ARG, "dq_block"},
        {"int8", {.double_quant = true, .dq_block = -1}, QT_ERR_ARG, "dq_block"},
        {"mxfp4", {.double_quant = true}, QT_ERR_ARG, "double_quant"},
        {"mxfp4", {.calib = &absmax}, QT_ERR_ARG, "calib"},
        {"mxfp4", {.n_channelwise = 1, .channelwise_axes = {0}}, QT_ERR_ARG, "channelwise_axes"},
        {"mxfp4", {.n_tiled = 1, .tiled_axes = {{1, 16}}}, QT_ERR_ARG, "tiled_axes"},
        {"mx9", {.scale_type = QARRAY_SCALE_BF16}, QT_ERR_ARG, "scale_type"},
        {"mxint8", {.range = QARRAY_RANGE_ASYMMETRIC}, QT_ERR_ARG, "asymmetric"},
        {"int8", {.scale_type = (QArrayScaleType)9}, QT_ERR_ARG, "scale_type"},
        {"int8", {.range = (QArrayRange)7}, QT_ERR_ARG, "range"},
        {"int8", {.round = (QRound)11}, QT_ERR_ARG, "round"},
        {"int8", {.calib = &bad}, QT_ERR_CONFIG, "scale s"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        qa_quant_fails(x, 2, shape, cases[i].qt, &cases[i].o, cases[i].want, (const char *const[]){cases[i].has, NULL});
    /* the block formats accept their own tiling said out loud, and pof2 */
    QArrayOptions o = {.n_tiled = 1, .tiled_axes = {{-1, 32}}, .scale_type = QARRAY_SCALE_POF2};
    QArray q;
    qa_quant_ok(&q, x, 2, shape, "mxfp4", &o);
    qarray_free(&q);
    QtError err = {0};
    CU_ASSERT_EQUAL(qarray_quantize(&q, x, 2, shape, NULL, NULL, &err), QT_ERR_ARG);
    CU_ASSERT_EQUAL(qarray_quantize(&q, NULL, 2, shape, qa_find("int8"), NULL, NULL), QT_ERR_ARG);
    CU_ASSERT_EQUAL(qarray_quantize(NULL, x, 2, shape, qa_find("int8"), NULL, NULL), QT_ERR_ARG);
}

/* ---- round trips -------------------------------------------------------------- */

/* quantize -> dequantize of values on the grid gives them back exactly. */
static void check_exact(const char *qt, const float *x, int n, const QArrayOptions *o) {
    QArray q;
    const int shape[1] = {n};
    qa_quant_ok(&q, x, 1, shape, qt, o);
    float *y = qa_alloc_floats((size_t)n);
    qarray_dequantize(&q, y);
    int bad = -1;
    for (int i = 0; i < n && bad < 0; i++)
        if (y[i] != x[i] && !(isnan(x[i]) && isnan(y[i]))) bad = i;
    if (bad >= 0) fprintf(stderr, "\n  %s: x[%d] = %.9g came back as %.9g\n", qt, bad, (double)x[bad], (double)y[bad]);
    CU_ASSERT_EQUAL(bad, -1);
    free(y);
    qarray_free(&q);
}

static void test_exact_round_trip(void) {
    float x[256];
    /* int8: fixed,31.875 gives scale 31.875 / 127.5 = 0.25; every code k * 0.25 */
    CalibSpec fixed = {.kind = CALIB_FIXED, .a = 31.875};
    QArrayOptions o = {.calib = &fixed};
    for (int k = 0; k < 256; k++) x[k] = (float)(k - 128) * 0.25f;
    check_exact("int8", x, 256, &o);
    /* int8 narrow: amax 127 * 0.25 gives scale 0.25 itself */
    o = (QArrayOptions){.narrow_range = true};
    check_exact("int8", x + 1, 255, &o);
    /* int4 and int2 the same way */
    fixed.a = 7.5 * 0.5;
    o = (QArrayOptions){.calib = &fixed};
    for (int k = 0; k < 16; k++) x[k] = (float)(k - 8) * 0.5f;
    check_exact("int4", x, 16, &o);
    /* uint8 asymmetric: (k - 100) * 0.5 spans lo = -50 .. hi = 77.5, so scale 127.5 / 255 = 0.5, zp 100 */
    for (int k = 0; k < 256; k++) x[k] = (float)(k - 100) * 0.5f;
    check_exact("uint8", x, 256, NULL);
    /* nf4: every table value times 2 in one block of 16 -> absmax 2 */
    const QType *nf4 = qa_find("nf4");
    for (int c = 0; c < 16; c++) x[c] = 2.0f * qtype_decode(nf4, (uint32_t)c);
    o = (QArrayOptions){.n_tiled = 1, .tiled_axes = {{0, 16}}};
    check_exact("nf4", x, 16, &o);
    /* fp8 e4m3 / e5m2 / fp4: every finite code times 0.5 -> scale amax / max = 0.5 */
    const char *floats[] = {"fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "fp6_e3m2"};
    for (int f = 0; f < 4; f++) {
        const QType *t = qa_find(floats[f]);
        int n = 0;
        for (uint32_t c = 0; c < (1u << t->bits); c++) {
            float v = qtype_decode(t, c);
            if (isfinite(v)) x[n++] = 0.5f * v;
        }
        check_exact(floats[f], x, n, NULL);
    }
    /* mxfp4: two copies of the fp4 grid times 2^-3: amax 0.75 -> X = floor(log2 0.75) - 2 = -3 */
    const QType *fp4 = qa_find("fp4_e2m1");
    for (int i = 0; i < 32; i++) x[i] = ldexpf(qtype_decode(fp4, (uint32_t)(i % 16)), -3);
    check_exact("mxfp4", x, 32, NULL);
    /* ternary with a fixed range (scale = a) and binary (mean |x| = a) */
    fixed.a = 0.75;
    o = (QArrayOptions){.calib = &fixed};
    for (int i = 0; i < 9; i++) x[i] = 0.75f * (float)(i % 3 - 1);
    check_exact("ternary", x, 9, &o);
    for (int i = 0; i < 9; i++) x[i] = i % 2 ? 0.75f : -0.75f;
    check_exact("binary", x, 9, NULL);
}

/* quantize(dequantize(quantize(x))) has the codes of quantize(x) (and, where
 * the scale rule gives back the same scale, the same scales and values). */
static void test_idempotence(void) {
    const int shape[2] = {64, 128};
    size_t n = 64 * 128;
    float *x = qa_normal_sample(11, n), *y = qa_alloc_floats(n), *y2 = qa_alloc_floats(n);
    QArrayOptions per_row = qa_channelwise(0), blocks32 = qa_row_blocks(32), narrow = {.narrow_range = true};
    QArrayOptions narrow_rows = per_row, narrow_blocks = blocks32;
    narrow_rows.narrow_range = narrow_blocks.narrow_range = true;
    struct {
        const char *qt;
        const QArrayOptions *o;
        bool same_scale; /* ternary's mean |x| shrinks: codes stay, the scale does not */
    } cases[] = {
        {"int8", &narrow, true}, {"int4", &narrow, true}, {"int8", &narrow_rows, true}, {"int4", &narrow_blocks, true},
        {"uint8", NULL, true}, {"uint4", &per_row, true}, {"nf4", NULL, true}, {"fp8_e4m3", NULL, true},
        {"fp8_e5m2", &per_row, true}, {"fp4_e2m1", &blocks32, true}, {"mxfp4", NULL, true}, {"mxint8", NULL, true},
        {"mxfp8_e4m3", NULL, true}, {"mx9", NULL, true}, {"mx6", NULL, true}, {"ternary", NULL, false},
        {"binary", NULL, true},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        QArray a, b;
        qa_quant_ok(&a, x, 2, shape, cases[k].qt, cases[k].o);
        qarray_dequantize(&a, y);
        qa_quant_ok(&b, y, 2, shape, cases[k].qt, cases[k].o);
        qarray_dequantize(&b, y2);
        bool same = a.code_bytes == b.code_bytes && memcmp(a.codes, b.codes, a.code_bytes) == 0;
        if (!same) fprintf(stderr, "\n  %s: re-quantizing changed the codes\n", cases[k].qt);
        CU_ASSERT(same);
        if (cases[k].same_scale) CU_ASSERT(memcmp(y, y2, n * sizeof(float)) == 0);
        qarray_free(&a);
        qarray_free(&b);
    }
    /* DESIGN's default int rule, scale = amax / (qmax + 1/2), is idempotent but for one tie. Dequantized,
     * a slice's largest |x| is qmax * s or (qmax + 1) * s, so the new scale is s * qmax / (qmax + 1/2) or
     * s * (qmax + 1) / (qmax + 1/2): a code q moves by q / (2 qmax) or q / (2 qmax + 2), under 1/2 for
     * every q but -qmax (first case) and -qmax-1 (second), which land exactly on the tie -(qmax + 1/2).
     * In exact arithmetic rne keeps -qmax-1 and turns -qmax into -qmax-1; in float the new scale's last
     * bit decides. So the only codes that can change are -qmax <-> -qmax-1. */
    QArrayOptions rows_or_blocks[2] = {per_row, blocks32};
    const char *ints[2] = {"int8", "int4"};
    for (int k = 0; k < 2; k++) {
        QArray a, b;
        qa_quant_ok(&a, x, 2, shape, ints[k], &rows_or_blocks[k]);
        qarray_dequantize(&a, y);
        qa_quant_ok(&b, y, 2, shape, ints[k], &rows_or_blocks[k]);
        uint32_t *ca = qa_codes_of(&a), *cb = qa_codes_of(&b);
        float qmax = (float)a.qtype->qmax;
        bool only_tie = true;
        for (size_t i = 0; i < n; i++) {
            float qa = qtype_decode(a.qtype, ca[i]), qb = qtype_decode(b.qtype, cb[i]);
            only_tie &= qa == qb || (fminf(qa, qb) == -qmax - 1.0f && fmaxf(qa, qb) == -qmax);
        }
        CU_ASSERT(only_tie);
        qarray_free(&a);
        qarray_free(&b);
        free(ca);
        free(cb);
    }
    QArray a, b;
    uint32_t *ca, *cb;
    /* the smallest case: {1, -127/127.5} has codes {127, -127}, re-quantized {127, -128} */
    const float tie[2] = {1.0f, -127.0f / 127.5f};
    float t2[2];
    qa_quant_ok(&a, tie, 1, (const int[]){2}, "int8", NULL);
    qarray_dequantize(&a, t2);
    qa_quant_ok(&b, t2, 1, (const int[]){2}, "int8", NULL);
    ca = qa_codes_of(&a), cb = qa_codes_of(&b);
    CU_ASSERT(ca[0] == 127 && ca[1] == (uint32_t)(256 - 127) && cb[0] == 127 && cb[1] == 128u);
    qarray_free(&a);
    qarray_free(&b);
    free(ca);
    free(cb);
    free(x);
    free(y);
    free(y2);
}

/* ---- error bounds ---------------------------------------------------------------- */

static void test_bytes(void) {
    float *x = qa_normal_sample(5, 4096);
    const int shape[2] = {32, 128};
    QArray q;
    qa_quant_ok(&q, x, 2, shape, "nf4", NULL); /* N/2 code bytes + 4 per 64 */
    CU_ASSERT_EQUAL(q.code_bytes, 2048u);
    CU_ASSERT_EQUAL(qarray_bytes(&q), 2048u + 4u * 64u);
    qarray_free(&q);
    qa_quant_ok(&q, x, 2, shape, "mxfp4", NULL); /* 17 bytes per 32: 4.25 bits */
    CU_ASSERT_EQUAL(qarray_bytes(&q), 128u * 17u);
    CU_ASSERT_DOUBLE_EQUAL(qarray_bits_per_element(&q), 4.25, 1e-12);
    qarray_free(&q);
    qa_quant_ok(&q, x, 2, shape, "mx9", NULL); /* 18 bytes per 16: 9 bits */
    CU_ASSERT_DOUBLE_EQUAL(qarray_bits_per_element(&q), 9.0, 1e-12);
    CU_ASSERT_EQUAL(q.n_scales, 256u);
    qarray_free(&q);
    QArrayOptions o = qa_channelwise(0);
    o.range = QARRAY_RANGE_ASYMMETRIC;
    qa_quant_ok(&q, x, 2, shape, "int4", &o); /* 4096 / 2 + 32 scales + 32 int32 zero points */
    CU_ASSERT_EQUAL(qarray_bytes(&q), 2048u + 32u * 4u + 32u * 4u);
    qarray_free(&q);
    o = (QArrayOptions){.n_tiled = 1, .tiled_axes = {{1, 32}}, .scale_type = QARRAY_SCALE_POF2};
    qa_quant_ok(&q, x, 2, shape, "ternary", &o); /* 2 bits each + one byte per 32 x 32 tile */
    CU_ASSERT_EQUAL(qarray_bytes(&q), 1024u + 4u);
    qarray_free(&q);
    qa_quant_ok(&q, x, 1, (const int[]){4095}, "int3", NULL); /* ceil(4095 * 3 / 8) */
    CU_ASSERT_EQUAL(q.code_bytes, 1536u);
    qarray_free(&q);
    free(x);
}

/* Dequantizing rows of arrays whose rows start mid-byte matches the whole. */
static void test_dequantize_rows(void) {
    float *x = qa_normal_sample(9, 5 * 7 * 3);
    const int shape[3] = {5, 7, 3};
    const char *formats[] = {"int3", "ternary", "nf4", "fp6_e2m3", "binary", "uint4"};
    for (int f = 0; f < 6; f++) {
        QArrayOptions o = {.n_channelwise = 1, .channelwise_axes = {1}, .n_tiled = 1, .tiled_axes = {{2, 3}}};
        QArray q;
        qa_quant_ok(&q, x, 3, shape, formats[f], &o);
        float all[105], part[105];
        qarray_dequantize(&q, all);
        /* against the codes from qtype_unpack */
        uint32_t *c = qa_codes_of(&q);
        bool same = true;
        for (int i = 0; i < 105; i++) {
            size_t g = (size_t)((i / 3) % 7);
            same &= all[i] == (qtype_decode(q.qtype, c[i]) - qarray_zero_point_at(&q, g)) * qarray_scale_at(&q, g);
        }
        CU_ASSERT(same);
        free(c);
        for (size_t r0 = 0; r0 < 35; r0 += 4) {
            size_t n = r0 + 9 <= 35 ? 9 : 35 - r0;
            CU_ASSERT_EQUAL(qarray_dequantize_rows(&q, r0, n, part), QT_OK);
            CU_ASSERT(memcmp(part, all + 3 * r0, 3 * n * sizeof(float)) == 0);
        }
        CU_ASSERT_EQUAL(qarray_dequantize_rows(&q, 30, 6, part), QT_ERR_ARG);
        qarray_free(&q);
    }
    /* a block format by rows */
    float w[4 * 64], all[4 * 64], part[2 * 64];
    memcpy(w, x, 64 * sizeof(float));
    for (int i = 64; i < 256; i++) w[i] = x[i % 105] * 3.0f;
    QArray q;
    qa_quant_ok(&q, w, 2, (const int[]){4, 64}, "mx6", NULL);
    qarray_dequantize(&q, all);
    CU_ASSERT_EQUAL(qarray_dequantize_rows(&q, 1, 2, part), QT_OK);
    CU_ASSERT(memcmp(part, all + 64, sizeof part) == 0);
    qarray_free(&q);
    free(x);
}

/* ---- scale rules of the other kinds ---------------------------------------------------------------- */

static void test_kind_rules(void) {
    float *x = qa_normal_sample(31, 1024);
    const int shape[1] = {1024};
    double mean = 0.0;
    for (int i = 0; i < 1024; i++) mean += fabsf(x[i]);
    mean /= 1024.0;
    /* ternary and binary: scale = mean |x| (BitNet b1.58 absmean; XNOR-Net's alpha) */
    const char *tb[2] = {"ternary", "binary"};
    for (int k = 0; k < 2; k++) {
        QArray q;
        qa_quant_ok(&q, x, 1, shape, tb[k], NULL);
        float s = qarray_scale_at(&q, 0);
        CU_ASSERT_EQUAL(s, (float)mean);
        uint32_t *c = qa_codes_of(&q);
        bool ok = true;
        for (int i = 0; i < 1024; i++) {
            float v = qtype_decode(q.qtype, c[i]);
            float want = k == 0 ? fminf(fmaxf(rintf(x[i] / s), -1.0f), 1.0f) : (x[i] >= 0.0f ? 1.0f : -1.0f);
            ok &= v == want;
        }
        CU_ASSERT(ok);
        free(c);
        qarray_free(&q);
    }
    /* float formats: scale = amax / format max */
    QArray q;
    qa_quant_ok(&q, x, 1, shape, "fp8_e5m2", NULL);
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 0), qa_abs_max(x, 1024) / 57344.0f);
    qarray_free(&q);
    qa_quant_ok(&q, x, 1, shape, "e3m4", NULL);
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 0), qa_abs_max(x, 1024) / qa_find("e3m4")->max);
    qarray_free(&q);
    /* narrow range: amax / 127, codes within +-127 */
    qa_quant_ok(&q, x, 1, shape, "int8", &(QArrayOptions){.narrow_range = true});
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 0), qa_abs_max(x, 1024) / 127.0f);
    uint32_t *c = qa_codes_of(&q);
    bool in = true;
    for (int i = 0; i < 1024; i++) in &= fabsf(qtype_decode(q.qtype, c[i])) <= 127.0f;
    CU_ASSERT(in);
    free(c);
    qarray_free(&q);
    /* calibration: mse on int4 clips, and beats absmax on Gaussian data; percentile reaches the spec */
    CalibSpec mse = {.kind = CALIB_MSE, .s = 1.0}, pct = {.kind = CALIB_PERCENTILE, .s = 1.0, .p = 99.0};
    float y[1024];
    qa_quant_ok(&q, x, 1, shape, "int4", NULL);
    qarray_dequantize(&q, y);
    double e_absmax = qa_rmse(x, y, 1024);
    qarray_free(&q);
    qa_quant_ok(&q, x, 1, shape, "int4", &(QArrayOptions){.calib = &mse});
    qarray_dequantize(&q, y);
    CU_ASSERT(qarray_scale_at(&q, 0) < qa_abs_max(x, 1024) / 7.5f);
    CU_ASSERT(qa_rmse(x, y, 1024) < e_absmax);
    qarray_free(&q);
    qa_quant_ok(&q, x, 1, shape, "fp4_e2m1", &(QArrayOptions){.calib = &pct});
    CU_ASSERT(qarray_scale_at(&q, 0) < qa_abs_max(x, 1024) / 6.0f);
    qarray_free(&q);
    free(x);
}

/* ---- bad input and degenerate arrays ------------------------------------------------------------- */

static void test_bad_and_empty(void) {
    float x[8] = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, NAN, 3.0f, INFINITY};
    const int shape[2] = {2, 4};
    qa_quant_fails(x, 2, shape, "int8", NULL, QT_ERR_VALUE, (const char *const[]){"x[5]", "(1, 1)", "NaN", NULL});
    x[5] = 0.0f;
    qa_quant_fails(x, 2, shape, "fp8_e4m3", NULL, QT_ERR_VALUE, (const char *const[]){"x[7]", "+Inf", NULL});
    x[7] = -INFINITY;
    qa_quant_fails(x, 2, shape, "ternary", NULL, QT_ERR_VALUE, (const char *const[]){"x[7]", "-Inf", NULL});

    /* zero-sized arrays: per-tensor keeps one scale of 1; channelwise over an empty axis has none */
    QArray q;
    qa_quant_ok(&q, NULL, 2, (const int[]){0, 64}, "int8", NULL);
    CU_ASSERT(q.numel == 0 && q.n_scales == 1 && q.code_bytes == 0);
    CU_ASSERT_EQUAL(qarray_scale_at(&q, 0), 1.0f);
    CU_ASSERT_EQUAL(qarray_bytes(&q), 4u);
    CU_ASSERT_EQUAL(qarray_bits_per_element(&q), 0.0);
    qarray_dequantize(&q, NULL);
    qarray_free(&q);
    qa_quant_ok(&q, NULL, 2, (const int[]){0, 64}, "nf4", &(QArrayOptions){.double_quant = true});
    CU_ASSERT(q.n_scales == 0 && q.scale_shape[0] == 0 && q.scale_shape[1] == 1);
    qarray_free(&q);
    qa_quant_ok(&q, NULL, 2, (const int[]){3, 0}, "mxfp4", NULL);
    CU_ASSERT(q.n_scales == 0 && q.code_bytes == 0);
    qarray_free(&q);
    QArrayOptions o = qa_row_blocks(0.5);
    qa_quant_ok(&q, NULL, 2, (const int[]){4, 0}, "int4", &o);
    CU_ASSERT(q.n_scales == 0);
    qarray_free(&q);
    /* a 0-d array: one element, one scale */
    float one = -3.0f, back;
    qa_quant_ok(&q, &one, 0, NULL, "int8", NULL);
    CU_ASSERT(q.numel == 1 && q.n_scales == 1);
    qarray_dequantize(&q, &back);
    CU_ASSERT_EQUAL(back, -128.0f * (3.0f / 127.5f)); /* -127.5 is a tie: rne gives the even -128 */
    qarray_free(&q);

    /* an all-zero block: scale 1 and the code of 0, for every kind */
    float *w = qa_normal_sample(3, 128);
    for (int i = 32; i < 64; i++) w[i] = 0.0f;
    const char *formats[] = {"int4", "int8", "nf4", "fp8_e4m3", "fp4_e2m1", "ternary", "mxfp4", "mxint8"};
    for (int f = 0; f < 8; f++) {
        QArray b;
        QArrayOptions ob = (QArrayOptions){.n_tiled = 1, .tiled_axes = {{1, 32}}};
        qa_quant_ok(&b, w, 2, (const int[]){1, 128}, formats[f], qtype_is_block(qa_find(formats[f])) ? NULL : &ob);
        CU_ASSERT_EQUAL(qarray_scale_at(&b, 1), 1.0f);
        float y[128];
        qarray_dequantize(&b, y);
        bool zero = true;
        for (int i = 32; i < 64; i++) zero &= y[i] == 0.0f;
        CU_ASSERT(zero);
        if (!qtype_is_block(b.qtype)) {
            uint32_t *c = qa_codes_of(&b), z = qtype_encode(b.qtype, 0.0f, QROUND_RNE, 0.0f);
            bool codes0 = true;
            for (int i = 32; i < 64; i++) codes0 &= c[i] == z;
            CU_ASSERT(codes0);
            free(c);
        }
        qarray_free(&b);
    }
    /* all zeros, asymmetric: scale 1, zero point 0 (uint8) */
    memset(w, 0, 128 * sizeof(float));
    qa_quant_ok(&q, w, 1, (const int[]){128}, "uint8", NULL);
    CU_ASSERT(qarray_scale_at(&q, 0) == 1.0f && qarray_zero_point_at(&q, 0) == 0.0f);
    qarray_free(&q);
    free(w);
    /* out-of-range accessors */
    CU_ASSERT(isnan(qarray_scale_at(&q, 0)));
    CU_ASSERT_EQUAL(qarray_bytes(NULL), 0u);
}

int register_quant_qarray_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qarray", NULL, NULL);
    if (!s) return -1;
    struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"per-tensor int8 by hand", test_per_tensor},
        {"per-channel rows and columns", test_per_channel},
        {"blocks of 32 and 64 along the input axis; nf4 and mxfp4 defaults", test_blocks},
        {"fraction tiles and 3-d layouts", test_fraction_tiles},
        {"axis and tile errors name the axis, size and tile", test_axis_errors},
        {"option combinations a format cannot use", test_option_errors},
        {"representable values round-trip exactly", test_exact_round_trip},
        {"re-quantizing a dequantized array keeps the codes", test_idempotence},
        {"qarray_bytes of each layout", test_bytes},
        {"dequantize rows starting mid-byte", test_dequantize_rows},
        {"ternary/binary/float/narrow scales and calibration", test_kind_rules},
        {"NaN/Inf rejected; empty arrays and all-zero blocks", test_bad_and_empty},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return qarray_numerics_tests_add(s) || qarray_io_tests_add(s) || qarray_deq_tests_add(s);
}
