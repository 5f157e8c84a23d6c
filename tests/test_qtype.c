/* test_qtype.c - quantized formats: table, lookup, element encode/decode,
 * rounding, packing and the MX / mx6 / mx9 blocks, against values worked
 * out by hand or from formulas written here independently of quant/. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/qtype.h"
#include "test_util.h"

/* The largest float below 1: stochastic rounding's "u -> 1". */
#define U_TOP 0.99999994f

static const QType *find(const char *name) {
    QtError err = {0};
    const QType *t = qtype_find(name, &err);
    if (!t) fprintf(stderr, "\n  qtype_find(%s): %s\n", name, err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(t);
    return t;
}

/* Every element format: the table's non-block entries and a few generic
 * small floats (E = 1, M = 0 and wide-exponent corners included). */
static int element_formats(const QType **out) {
    int n = 0;
    for (int i = 0; i < qtype_count(); i++)
        if (!qtype_is_block(qtype_at(i))) out[n++] = qtype_at(i);
    const char *generic[] = {"e3m4", "e1m2", "e3m0", "e1m0", "e5m1", "e7m0", "e4m2", "fp7_e2m4"};
    for (size_t i = 0; i < sizeof generic / sizeof generic[0]; i++) out[n++] = find(generic[i]);
    return n;
}

/* Same value, and the same sign for zeros; NaN matches NaN. */
static bool same_value(float a, double want) {
    if (isnan(want)) return isnan(a);
    return (double)a == want && !signbit(a) == !signbit(want);
}

/* ---- table and lookup ----------------------------------------------------- */

static void test_table(void) {
    const char *names[] = {"int2", "int3", "int4", "int5", "int6", "int7", "int8", "uint4", "uint8", "ternary",
                           "binary", "nf4", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1",
                           "mxfp8_e4m3", "mxfp6_e3m2", "mxfp4", "mxint8", "mx6", "mx9"};
    const double bpe[] = {2, 3, 4, 5, 6, 7, 8, 4, 8, 2, 1, 4, 8, 8, 6, 6, 4, 8.25, 6.25, 4.25, 8.25, 6, 9};
    int n = (int)(sizeof names / sizeof names[0]);
    CU_ASSERT_EQUAL(qtype_count(), n);
    for (int i = 0; i < n; i++) {
        const QType *t = find(names[i]);
        CU_ASSERT_STRING_EQUAL(qtype_name(t), names[i]);
        CU_ASSERT_DOUBLE_EQUAL(t->bits_per_elem, bpe[i], 1e-12);
        bool listed = false;
        for (int k = 0; k < qtype_count(); k++) listed |= qtype_at(k) == t;
        CU_ASSERT(listed);
        if (qtype_is_block(t)) CU_ASSERT_EQUAL(qtype_packed_bytes(t, (size_t)t->block), t->block_bytes);
    }
    CU_ASSERT_PTR_EQUAL(find("FP8_E4M3"), find("fp8_e4m3"));
    CU_ASSERT_PTR_EQUAL(find("MxFp4"), find("mxfp4"));
    CU_ASSERT_PTR_NULL(qtype_at(-1));
    CU_ASSERT_PTR_NULL(qtype_at(n));
    CU_ASSERT_STRING_EQUAL(qtype_name(NULL), "(none)");
    /* int ranges */
    const QType *i4 = find("int4"), *u8 = find("uint8"), *tern = find("ternary");
    CU_ASSERT(i4->qmin == -8 && i4->qmax == 7);
    CU_ASSERT(u8->qmin == 0 && u8->qmax == 255);
    CU_ASSERT(tern->qmin == -1 && tern->qmax == 1 && tern->bits == 2);
    /* block geometry */
    CU_ASSERT_EQUAL(find("mxfp4")->block, 32);
    CU_ASSERT_EQUAL(find("mxfp4")->block_bytes, 17u);
    CU_ASSERT_EQUAL(find("mxfp6_e3m2")->block_bytes, 25u);
    CU_ASSERT_EQUAL(find("mxfp8_e4m3")->block_bytes, 33u);
    CU_ASSERT_EQUAL(find("mxint8")->block_bytes, 33u);
    CU_ASSERT_PTR_EQUAL(find("mxfp4")->elem, find("fp4_e2m1"));
    CU_ASSERT_PTR_EQUAL(find("mxfp8_e4m3")->elem, find("fp8_e4m3"));
    const QType *mx9 = find("mx9"), *mx6 = find("mx6");
    CU_ASSERT(mx9->block == 16 && mx9->sub_block == 2 && mx9->micro_bits == 1 && mx9->mant_bits == 7);
    CU_ASSERT(mx6->block == 16 && mx6->sub_block == 2 && mx6->micro_bits == 1 && mx6->mant_bits == 4);
    CU_ASSERT_EQUAL(mx9->block_bytes, 18u);
    CU_ASSERT_EQUAL(mx6->block_bytes, 12u);
    CU_ASSERT_EQUAL(qtype_packed_bytes(mx9, 17), 36u); /* two blocks */
}

static void test_generic_parse(void) {
    const QType *a = find("e3m4"), *b = find("fp8_e3m4"), *c = find("E3M4");
    CU_ASSERT_PTR_EQUAL(a, b);
    CU_ASSERT_PTR_EQUAL(a, c);
    CU_ASSERT_STRING_EQUAL(qtype_name(a), "fp8_e3m4");
    CU_ASSERT_EQUAL(a->kind, QTYPE_KIND_FLOAT);
    CU_ASSERT(a->exp_bits == 3 && a->man_bits == 4 && a->bits == 8);
    CU_ASSERT_EQUAL(a->bias, 3); /* 2^(3-1) - 1 */
    CU_ASSERT(!a->has_inf && !a->has_nan && !qtype_has_nan(a));
    /* all codes finite: top code 0.111.1111 = (1 + 15/16) * 2^(7 - 3) = 31 */
    CU_ASSERT_EQUAL(a->max, 31.0f);
    CU_ASSERT_EQUAL(qtype_decode(a, 0x7F), 31.0f);
    /* ModelOpt's other (E, M) maxima follow the same formula */
    CU_ASSERT_EQUAL(find("e1m2")->max, 3.5f);
    CU_ASSERT_EQUAL(find("e3m0")->max, 16.0f);
    CU_ASSERT_EQUAL(find("fp4_e1m2")->max, 3.5f);
    /* named floats win over the generic formula */
    CU_ASSERT_PTR_EQUAL(find("e4m3"), find("fp8_e4m3"));
    CU_ASSERT_EQUAL(find("e4m3")->max, 448.0f);
    CU_ASSERT_PTR_EQUAL(find("e5m2"), find("fp8_e5m2"));
    CU_ASSERT_PTR_EQUAL(find("e3m2"), find("fp6_e3m2"));
    CU_ASSERT_PTR_EQUAL(find("e2m3"), find("fp6_e2m3"));
    CU_ASSERT_PTR_EQUAL(find("fp4_e2m1"), find("e2m1"));
    CU_ASSERT_EQUAL(find("e7m0")->max, ldexpf(1.0f, 127 - 63));
}

static void expect_find_error(const char *name, const char *what) {
    QtError err = {0};
    CU_ASSERT_PTR_NULL(qtype_find(name, &err));
    CU_ASSERT_EQUAL(err.status, QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, what));
}

static void test_parse_errors(void) {
    /* unknown names list every valid one and the eXmY form */
    const char *unknown[] = {"int9", "fp8", "float", "", "e3", "e3m", "fp8e4m3", "e3m4x", "mx4"};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        expect_find_error(unknown[i], "unknown qtype");
        expect_find_error(unknown[i], "int2, int3");
        expect_find_error(unknown[i], "nf4");
        expect_find_error(unknown[i], "mxfp4");
        expect_find_error(unknown[i], "mx9");
        expect_find_error(unknown[i], "eXmY");
    }
    expect_find_error(NULL, "unknown qtype '(none)'");
    expect_find_error("e8m0", "1 <= X <= 7");
    expect_find_error("e0m3", "1 <= X <= 7");
    expect_find_error("e3m5", "1 + X + Y <= 8");
    expect_find_error("fp6_e3m4", "make 8 bits, not 6");
    expect_find_error("fp6_e3m4", "fp8_e3m4");
    expect_find_error("fp4_e4m3", "not 4");
    /* the first error is kept */
    QtError err = {0};
    qtype_find("bogus1", &err);
    qtype_find("bogus2", &err);
    CU_ASSERT(test_msg_has(&err, "bogus1"));

    QRound r = QROUND_RNE;
    QtError e2 = {0};
    CU_ASSERT_EQUAL(qround_parse("half-away", &r, &e2), QT_OK);
    CU_ASSERT_EQUAL(r, QROUND_HALF_AWAY);
    CU_ASSERT_EQUAL(qround_parse("Stochastic", &r, &e2), QT_OK);
    CU_ASSERT_EQUAL(r, QROUND_STOCHASTIC);
    CU_ASSERT_EQUAL(qround_parse("nearest", &r, &e2), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&e2, "rne, half_away, floor, stochastic"));
    CU_ASSERT_STRING_EQUAL(qround_name(QROUND_FLOOR), "floor");
    CU_ASSERT_STRING_EQUAL(qround_name((QRound)99), "unknown");
}

/* ---- exact values ---------------------------------------------------------- */

static void test_nf4_values(void) {
    /* bitsandbytes' NF4 table, as float32 */
    const float want[16] = {-1.0f,
                            -0.6961928009986877f,
                            -0.5250730514526367f,
                            -0.39491748809814453f,
                            -0.28444138169288635f,
                            -0.18477343022823334f,
                            -0.09105003625154495f,
                            0.0f,
                            0.07958029955625534f,
                            0.16093020141124725f,
                            0.24611230194568634f,
                            0.33791524171829224f,
                            0.44070982933044434f,
                            0.5626170039176941f,
                            0.7229568362236023f,
                            1.0f};
    const QType *t = find("nf4");
    CU_ASSERT_EQUAL(t->kind, QTYPE_KIND_LUT);
    for (uint32_t c = 0; c < 16; c++) {
        CU_ASSERT_EQUAL(qtype_decode(t, c), want[c]);
        CU_ASSERT_EQUAL(qtype_encode(t, want[c], QROUND_RNE, 0.0f), c);
    }
    /* nearest code: 0.5 is 0.059 from 0.4407 and 0.063 from 0.5626; 0.52 is nearer 0.5626 */
    CU_ASSERT_EQUAL(qtype_encode(t, 0.5f, QROUND_RNE, 0.0f), 12u);
    CU_ASSERT_EQUAL(qtype_encode(t, 0.52f, QROUND_RNE, 0.0f), 13u);
    CU_ASSERT_EQUAL(qtype_encode(t, -0.05f, QROUND_RNE, 0.0f), 6u); /* -0.091 is 0.041 away, 0 is 0.05 */
    CU_ASSERT_EQUAL(qtype_encode(t, 0.03f, QROUND_RNE, 0.0f), 7u);
    /* ties go to the lower code: 0.0795.../2 is an exact float midpoint */
    float mid = want[8] / 2;
    CU_ASSERT_EQUAL(qtype_encode(t, mid, QROUND_RNE, 0.0f), 7u);
    CU_ASSERT_EQUAL(qtype_encode(t, want[6] / 2, QROUND_RNE, 0.0f), 6u);   /* -0.0455: lower code is -0.091 */
    CU_ASSERT_EQUAL(qtype_encode(t, want[6] / 2, QROUND_HALF_AWAY, 0.0f), 6u);
    CU_ASSERT_EQUAL(qtype_encode(t, mid, QROUND_HALF_AWAY, 0.0f), 8u);
}

static void test_fp4_grid(void) {
    const QType *t = find("fp4_e2m1");
    const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    CU_ASSERT(t->exp_bits == 2 && t->man_bits == 1 && t->bias == 1 && t->max == 6.0f);
    CU_ASSERT(!qtype_has_nan(t));
    for (uint32_t c = 0; c < 8; c++) {
        CU_ASSERT(same_value(qtype_decode(t, c), grid[c]));
        CU_ASSERT(same_value(qtype_decode(t, c | 8), -(double)grid[c]));
    }
    CU_ASSERT_EQUAL(qtype_encode(t, 2.4f, QROUND_RNE, 0), 4u);
    CU_ASSERT_EQUAL(qtype_encode(t, 2.6f, QROUND_RNE, 0), 5u);
    CU_ASSERT_EQUAL(qtype_encode(t, -0.2f, QROUND_RNE, 0), 8u); /* -0 */
    CU_ASSERT_EQUAL(qtype_encode(t, 5.0f, QROUND_RNE, 0), 6u);  /* tie 4|6: code 6 is even */
    CU_ASSERT_EQUAL(qtype_encode(t, 5.0f, QROUND_HALF_AWAY, 0), 7u);
}

/* OCP E4M3FN and E5M2, from the bit fields directly. */
static double ref_e4m3(int c) {
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    double mag = e == 0 ? m / 8.0 * pow(2, -6) : (1 + m / 8.0) * pow(2, e - 7);
    return s ? -mag : mag;
}

static double ref_e5m2(int c) {
    int s = c >> 7, e = (c >> 2) & 31, m = c & 3;
    if (e == 31 && m != 0) return NAN;
    double mag = e == 31 ? INFINITY : e == 0 ? m / 4.0 * pow(2, -14) : (1 + m / 4.0) * pow(2, e - 15);
    return s ? -mag : mag;
}

static void test_fp8_decode_all(void) {
    const QType *e4 = find("fp8_e4m3"), *e5 = find("fp8_e5m2");
    int nan4 = 0, nan5 = 0;
    for (int c = 0; c < 256; c++) {
        float d4 = qtype_decode(e4, (uint32_t)c), d5 = qtype_decode(e5, (uint32_t)c);
        if (!same_value(d4, ref_e4m3(c))) fprintf(stderr, "\n  e4m3 0x%02x: %g vs %g\n", c, d4, ref_e4m3(c));
        if (!same_value(d5, ref_e5m2(c))) fprintf(stderr, "\n  e5m2 0x%02x: %g vs %g\n", c, d5, ref_e5m2(c));
        CU_ASSERT(same_value(d4, ref_e4m3(c)));
        CU_ASSERT(same_value(d5, ref_e5m2(c)));
        CU_ASSERT_EQUAL(qtype_code_is_nan(e4, (uint32_t)c), isnan(d4));
        CU_ASSERT_EQUAL(qtype_code_is_nan(e5, (uint32_t)c), isnan(d5));
        nan4 += isnan(d4);
        nan5 += isnan(d5);
    }
    CU_ASSERT_EQUAL(nan4, 2); /* 0x7F, 0xFF */
    CU_ASSERT_EQUAL(nan5, 6); /* 0x7D-0x7F, 0xFD-0xFF */
    CU_ASSERT_EQUAL(qtype_decode(e4, 0x7E), 448.0f);
    CU_ASSERT_EQUAL(qtype_decode(e4, 0x01), ldexpf(1, -9));
    CU_ASSERT_EQUAL(qtype_decode(e5, 0x7B), 57344.0f);
    CU_ASSERT_EQUAL(qtype_decode(e5, 0x7C), INFINITY);
    CU_ASSERT_EQUAL(qtype_decode(e5, 0xFC), -INFINITY);
    CU_ASSERT_EQUAL(qtype_decode(e5, 0x01), ldexpf(1, -16));
    CU_ASSERT(e4->max == 448.0f && e4->bias == 7 && !e4->has_inf && e4->has_nan);
    CU_ASSERT(e5->max == 57344.0f && e5->bias == 15 && e5->has_inf && e5->has_nan);
}

static void test_fp6_max(void) {
    const QType *e3 = find("fp6_e3m2"), *e2 = find("fp6_e2m3");
    /* 0.111.11 = 1.75 * 2^(7-3); 0.11.111 = 1.875 * 2^(3-1) */
    CU_ASSERT_EQUAL(qtype_decode(e3, 0x1F), 28.0f);
    CU_ASSERT_EQUAL(qtype_decode(e3, 0x3F), -28.0f);
    CU_ASSERT_EQUAL(qtype_decode(e2, 0x1F), 7.5f);
    CU_ASSERT_EQUAL(qtype_decode(e2, 0x3F), -7.5f);
    CU_ASSERT(e3->max == 28.0f && e3->bias == 3 && !qtype_has_nan(e3));
    CU_ASSERT(e2->max == 7.5f && e2->bias == 1 && !qtype_has_nan(e2));
    /* smallest subnormals: 0.25 * 2^(1-3) and 0.125 * 2^(1-1) */
    CU_ASSERT_EQUAL(qtype_decode(e3, 0x01), 0.0625f);
    CU_ASSERT_EQUAL(qtype_decode(e2, 0x01), 0.125f);
}

/* ---- rounding -------------------------------------------------------------- */

typedef struct {
    float v;
    uint32_t code;
} GridPoint;

static int cmp_grid(const void *a, const void *b) {
    float x = ((const GridPoint *)a)->v, y = ((const GridPoint *)b)->v;
    return (x > y) - (x < y);
}

/* The finite values of t, ascending, one entry per value (+0 for zeros). */
static int grid_of(const QType *t, GridPoint *g) {
    int n = 0;
    for (uint32_t c = 0; c < (1u << t->bits); c++) {
        float v = qtype_decode(t, c);
        if (!qtype_code_valid(t, c) || !isfinite(v) || (v == 0.0f && signbit(v))) continue;
        g[n++] = (GridPoint){v, c};
    }
    qsort(g, (size_t)n, sizeof *g, cmp_grid);
    return n;
}

/* The code of a grid value on the side of `near` (for floats, -0 below zero). */
static uint32_t code_near(const QType *t, GridPoint p, float near) {
    if (p.v == 0.0f && near < 0.0f && t->kind == QTYPE_KIND_FLOAT) return p.code | (1u << (t->bits - 1));
    return p.code;
}

static void test_ties(void) {
    const QType *fmts[64];
    int nf = element_formats(fmts), checked = 0;
    GridPoint g[256];
    for (int f = 0; f < nf; f++) {
        const QType *t = fmts[f];
        int n = grid_of(t, g), ties = 0;
        for (int i = 0; i + 1 < n; i++) {
            double mid = 0.5 * ((double)g[i].v + g[i + 1].v);
            float m = (float)mid;
            if ((double)m != mid) continue; /* not a float: no exact tie to test */
            ties++;
            uint32_t lo = code_near(t, g[i], m), hi = code_near(t, g[i + 1], m);
            uint32_t away = fabsf(g[i].v) > fabsf(g[i + 1].v) ? lo : hi;
            uint32_t even = t->kind == QTYPE_KIND_LUT ? lo         /* nf4: the lower code */
                            : t->kind == QTYPE_KIND_BINARY ? hi    /* 0 goes to +1 */
                            : (lo & 1) == 0 ? lo : hi;
            uint32_t got_rne = qtype_encode(t, m, QROUND_RNE, 0), got_away = qtype_encode(t, m, QROUND_HALF_AWAY, 0);
            if (got_rne != even || got_away != away)
                fprintf(stderr, "\n  %s tie %g (%g|%g): rne %u (want %u), away %u (want %u)\n", t->name, m,
                        g[i].v, g[i + 1].v, got_rne, even, got_away, away);
            CU_ASSERT_EQUAL(got_rne, even);
            CU_ASSERT_EQUAL(got_away, away);
        }
        /* every format except nf4 has exact midpoints everywhere; nf4 at least around 0 */
        CU_ASSERT(t->kind == QTYPE_KIND_LUT ? ties >= 2 : ties == n - 1);
        checked += ties;
    }
    CU_ASSERT(checked > 1000);
    /* a few by hand */
    const QType *i4 = find("int4"), *e4 = find("fp8_e4m3"), *tern = find("ternary");
    CU_ASSERT_EQUAL(qtype_encode(i4, 2.5f, QROUND_RNE, 0), 2u);
    CU_ASSERT_EQUAL(qtype_encode(i4, 3.5f, QROUND_RNE, 0), 4u);
    CU_ASSERT_EQUAL(qtype_encode(i4, -2.5f, QROUND_RNE, 0), 0xEu);      /* -2 */
    CU_ASSERT_EQUAL(qtype_encode(i4, -2.5f, QROUND_HALF_AWAY, 0), 0xDu); /* -3 */
    CU_ASSERT_EQUAL(qtype_encode(tern, 0.5f, QROUND_RNE, 0), 0u);
    CU_ASSERT_EQUAL(qtype_encode(tern, -0.5f, QROUND_HALF_AWAY, 0), 3u);
    /* e4m3 subnormals: 2^-10 ties 0 | 2^-9 -> 0; 3 * 2^-10 ties 2^-9 | 2^-8 -> code 2 */
    CU_ASSERT_EQUAL(qtype_encode(e4, ldexpf(1, -10), QROUND_RNE, 0), 0u);
    CU_ASSERT_EQUAL(qtype_encode(e4, ldexpf(3, -10), QROUND_RNE, 0), 2u);
    /* 1.0625 ties 1 (0x38) | 1.125 (0x39) -> 0x38; 1.1875 -> 0x3A */
    CU_ASSERT_EQUAL(qtype_encode(e4, 1.0625f, QROUND_RNE, 0), 0x38u);
    CU_ASSERT_EQUAL(qtype_encode(e4, 1.1875f, QROUND_RNE, 0), 0x3Au);
    CU_ASSERT_EQUAL(qtype_encode(e4, 1.0625f, QROUND_HALF_AWAY, 0), 0x39u);
    CU_ASSERT_EQUAL(qtype_encode(e4, -1.0625f, QROUND_HALF_AWAY, 0), 0xB9u);
}

static void test_saturation(void) {
    const QType *i4 = find("int4"), *u4 = find("uint4"), *i8 = find("int8"), *e4 = find("fp8_e4m3"),
                *e5 = find("fp8_e5m2"), *f4 = find("fp4_e2m1"), *nf4 = find("nf4"), *bin = find("binary"),
                *tern = find("ternary"), *e34 = find("e3m4");
    for (int mode = 0; mode < QROUND_COUNT; mode++) {
        QRound r = (QRound)mode;
        CU_ASSERT_EQUAL(qtype_encode(i4, 100.0f, r, 0.5f), 7u);
        CU_ASSERT_EQUAL(qtype_encode(i4, -100.0f, r, 0.5f), 8u); /* -8 */
        CU_ASSERT_EQUAL(qtype_encode(i4, -INFINITY, r, 0.5f), 8u);
        CU_ASSERT_EQUAL(qtype_encode(i8, 1e30f, r, 0.5f), 127u);
        CU_ASSERT_EQUAL(qtype_encode(i8, -128.7f, r, 0.5f), 128u); /* -128 */
        CU_ASSERT_EQUAL(qtype_encode(u4, -3.0f, r, 0.5f), 0u);
        CU_ASSERT_EQUAL(qtype_encode(u4, 99.0f, r, 0.5f), 15u);
        CU_ASSERT_EQUAL(qtype_encode(e4, 1e6f, r, 0.5f), 0x7Eu);   /* 448 */
        CU_ASSERT_EQUAL(qtype_encode(e4, 470.0f, r, 0.5f), 0x7Eu); /* clamped before rounding */
        CU_ASSERT_EQUAL(qtype_encode(e4, -1e6f, r, 0.5f), 0xFEu);
        CU_ASSERT_EQUAL(qtype_encode(e4, INFINITY, r, 0.5f), 0x7Eu); /* no inf: saturates */
        CU_ASSERT_EQUAL(qtype_encode(e5, 1e9f, r, 0.5f), 0x7Bu);     /* 57344 */
        CU_ASSERT_EQUAL(qtype_encode(e5, -61000.0f, r, 0.5f), 0xFBu);
        CU_ASSERT_EQUAL(qtype_encode(e5, INFINITY, r, 0.5f), 0x7Cu); /* an inf stays inf */
        CU_ASSERT_EQUAL(qtype_encode(e5, -INFINITY, r, 0.5f), 0xFCu);
        CU_ASSERT_EQUAL(qtype_encode(f4, 7.0f, r, 0.5f), 7u);
        CU_ASSERT_EQUAL(qtype_encode(f4, -1e20f, r, 0.5f), 15u);
        CU_ASSERT_EQUAL(qtype_encode(e34, 1000.0f, r, 0.5f), 0x7Fu);
        CU_ASSERT_EQUAL(qtype_encode(nf4, 5.0f, r, 0.5f), 15u);
        CU_ASSERT_EQUAL(qtype_encode(nf4, -5.0f, r, 0.5f), 0u);
        CU_ASSERT_EQUAL(qtype_encode(bin, 3.0f, r, 0.5f), 1u);
        CU_ASSERT_EQUAL(qtype_encode(bin, -3.0f, r, 0.5f), 0u);
        CU_ASSERT_EQUAL(qtype_encode(tern, 5.0f, r, 0.5f), 1u);
        CU_ASSERT_EQUAL(qtype_encode(tern, -5.0f, r, 0.5f), 3u);
    }
    /* NaN: the NaN code where there is one, otherwise as if 0 */
    CU_ASSERT(qtype_has_nan(e4) && qtype_has_nan(e5));
    CU_ASSERT_EQUAL(qtype_encode(e4, NAN, QROUND_RNE, 0), 0x7Fu);
    CU_ASSERT_EQUAL(qtype_encode(e5, NAN, QROUND_RNE, 0), 0x7Eu);
    CU_ASSERT(isnan(qtype_decode(e5, 0x7E)));
    CU_ASSERT(!qtype_has_nan(f4) && !qtype_has_nan(i8) && !qtype_has_nan(nf4) && !qtype_has_nan(NULL));
    CU_ASSERT_EQUAL(qtype_encode(f4, NAN, QROUND_RNE, 0), 0u);
    CU_ASSERT_EQUAL(qtype_encode(i8, NAN, QROUND_FLOOR, 0), 0u);
    CU_ASSERT_EQUAL(qtype_encode(nf4, NAN, QROUND_RNE, 0), 7u);
    /* binary: 0 is a tie and goes to +1 */
    CU_ASSERT_EQUAL(qtype_encode(bin, 0.0f, QROUND_RNE, 0), 1u);
    CU_ASSERT_EQUAL(qtype_encode(bin, -0.3f, QROUND_RNE, 0), 0u);
    CU_ASSERT_EQUAL(qtype_decode(bin, 0), -1.0f);
    CU_ASSERT_EQUAL(qtype_decode(bin, 1), 1.0f);
    /* ternary's unused code 0b10 */
    CU_ASSERT(!qtype_code_valid(tern, 2) && qtype_code_valid(tern, 3) && !qtype_code_valid(tern, 4));
    /* block kinds have no element codes */
    CU_ASSERT_EQUAL(qtype_encode(find("mxfp4"), 1.0f, QROUND_RNE, 0), 0u);
    CU_ASSERT(isnan(qtype_decode(find("mx9"), 0)));
}

/* encode(decode(c)) == c for every valid, non-NaN code, in every mode. */
static void test_idempotence(void) {
    const QType *fmts[64];
    int nf = element_formats(fmts);
    /* and every generic small float */
    for (int e = 1; e <= 7; e++) {
        for (int m = 0; 1 + e + m <= 8; m++) {
            char name[16];
            snprintf(name, sizeof name, "e%dm%d", e, m);
            fmts[nf++] = find(name);
        }
    }
    const float us[] = {0.0f, 0.5f, U_TOP};
    long checked = 0;
    for (int f = 0; f < nf; f++) {
        const QType *t = fmts[f];
        for (uint32_t c = 0; c < (1u << t->bits); c++) {
            if (!qtype_code_valid(t, c) || qtype_code_is_nan(t, c)) continue;
            float v = qtype_decode(t, c);
            for (int mode = 0; mode < QROUND_COUNT; mode++) {
                for (size_t k = 0; k < sizeof us / sizeof us[0]; k++) {
                    uint32_t back = qtype_encode(t, v, (QRound)mode, us[k]);
                    if (back != c)
                        fprintf(stderr, "\n  %s code %u (%g) -> %u under %s\n", t->name, c, v, back,
                                qround_name((QRound)mode));
                    CU_ASSERT_EQUAL(back, c);
                    checked++;
                }
            }
        }
    }
    CU_ASSERT(checked > 10000);
}

/* Stochastic rounding with u = 0 is floor; with u -> 1 it is the ceiling. */
static void test_stochastic(void) {
    const QType *fmts[64];
    int nf = element_formats(fmts);
    GridPoint g[256];
    for (int f = 0; f < nf; f++) {
        const QType *t = fmts[f];
        int n = grid_of(t, g);
        for (int i = 0; i + 1 < n; i++) {
            for (int k = 1; k <= 3; k++) {
                float v = g[i].v + (g[i + 1].v - g[i].v) * (float)k / 4;
                float fl = qtype_decode(t, qtype_encode(t, v, QROUND_STOCHASTIC, 0.0f));
                float ce = qtype_decode(t, qtype_encode(t, v, QROUND_STOCHASTIC, U_TOP));
                float fm = qtype_decode(t, qtype_encode(t, v, QROUND_FLOOR, 0.5f));
                if (fl != g[i].v || ce != g[i + 1].v || fm != g[i].v)
                    fprintf(stderr, "\n  %s %g: u=0 %g, u->1 %g, floor %g (want %g, %g)\n", t->name, v, fl, ce, fm,
                            g[i].v, g[i + 1].v);
                CU_ASSERT_EQUAL(fl, g[i].v);
                CU_ASSERT_EQUAL(ce, g[i + 1].v);
                CU_ASSERT_EQUAL(fm, g[i].v);
            }
        }
    }
    /* floor(v + u) by hand */
    const QType *i8 = find("int8"), *e4 = find("fp8_e4m3");
    CU_ASSERT_EQUAL(qtype_encode(i8, 2.3f, QROUND_STOCHASTIC, 0.69f), 2u);
    CU_ASSERT_EQUAL(qtype_encode(i8, 2.3f, QROUND_STOCHASTIC, 0.71f), 3u);
    CU_ASSERT_EQUAL(qtype_encode(i8, -2.25f, QROUND_STOCHASTIC, 0.2f), 0xFDu); /* floor(-2.05) = -3 */
    CU_ASSERT_EQUAL(qtype_encode(i8, -2.25f, QROUND_STOCHASTIC, 0.3f), 0xFEu); /* floor(-1.95) = -2 */
    /* e4m3 1.0 (0x38) | 1.125 (0x39): 1.03125 is a quarter of the way up */
    CU_ASSERT_EQUAL(qtype_encode(e4, 1.03125f, QROUND_STOCHASTIC, 0.74f), 0x38u);
    CU_ASSERT_EQUAL(qtype_encode(e4, 1.03125f, QROUND_STOCHASTIC, 0.75f), 0x39u);
    CU_ASSERT_EQUAL(qtype_encode(e4, -1.03125f, QROUND_STOCHASTIC, 0.24f), 0xB9u); /* -1.125 */
    CU_ASSERT_EQUAL(qtype_encode(e4, -1.03125f, QROUND_STOCHASTIC, 0.25f), 0xB8u);
    /* unbiased: over a uniform grid of u the mean is v exactly */
    double sum = 0;
    for (int k = 0; k < 1000; k++)
        sum += qtype_decode(i8, qtype_encode(i8, 2.3f, QROUND_STOCHASTIC, (k + 0.5f) / 1000));
    CU_ASSERT_DOUBLE_EQUAL(sum / 1000, 2.3, 1e-9);
    /* binary: +1 with probability (1 + v) / 2 */
    const QType *bin = find("binary");
    CU_ASSERT_EQUAL(qtype_encode(bin, 0.5f, QROUND_STOCHASTIC, 0.24f), 0u);
    CU_ASSERT_EQUAL(qtype_encode(bin, 0.5f, QROUND_STOCHASTIC, 0.25f), 1u);
}

/* ---- packing --------------------------------------------------------------- */

static uint32_t lcg(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

static void test_pack_roundtrip(void) {
    const char *names[] = {"binary", "int2", "int3", "int4", "int5", "int6", "int7", "int8"};
    const size_t lens[] = {1, 3, 5, 7, 13, 31, 33, 101};
    uint32_t seed = 12345;
    for (int w = 1; w <= 8; w++) {
        const QType *t = find(names[w - 1]);
        CU_ASSERT_EQUAL_FATAL(t->bits, w);
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            size_t n = lens[li], nb = qtype_packed_bytes(t, n);
            CU_ASSERT_EQUAL(nb, (n * (size_t)w + 7) / 8);
            uint32_t codes[101], back[101];
            uint8_t buf[128];
            for (size_t i = 0; i < n; i++) codes[i] = lcg(&seed) & ((1u << w) - 1);
            memset(buf, 0xA5, sizeof buf);
            CU_ASSERT_EQUAL(qtype_pack(t, codes, n, buf), QT_OK);
            CU_ASSERT_EQUAL(buf[nb], 0xA5); /* nothing written past the end */
            int spare = (int)(nb * 8 - n * (size_t)w);
            CU_ASSERT_EQUAL(buf[nb - 1] & ((1u << spare) - 1), 0u); /* unused low bits are zero */
            CU_ASSERT_EQUAL(qtype_unpack(t, buf, n, back), QT_OK);
            CU_ASSERT(memcmp(codes, back, n * sizeof *codes) == 0);
        }
    }
    /* codes wider than the format are masked */
    uint32_t big[2] = {0x1F3, 0x2}, out[2];
    uint8_t b[1];
    const QType *i4 = find("int4");
    CU_ASSERT_EQUAL(qtype_pack(i4, big, 2, b), QT_OK);
    CU_ASSERT_EQUAL(b[0], 0x32);
    CU_ASSERT_EQUAL(qtype_unpack(i4, b, 2, out), QT_OK);
    CU_ASSERT(out[0] == 3 && out[1] == 2);
    CU_ASSERT_EQUAL(qtype_pack(find("mxfp4"), big, 2, b), QT_ERR_ARG);
    CU_ASSERT_EQUAL(qtype_unpack(find("mx6"), b, 2, out), QT_ERR_ARG);
    CU_ASSERT_EQUAL(qtype_pack(i4, NULL, 2, b), QT_ERR_ARG);
    CU_ASSERT_EQUAL(qtype_pack(i4, NULL, 0, NULL), QT_OK);
}

static void expect_packed(const char *name, const uint32_t *codes, size_t n, const uint8_t *want, size_t nb) {
    const QType *t = find(name);
    uint8_t buf[16];
    CU_ASSERT_EQUAL(qtype_packed_bytes(t, n), nb);
    CU_ASSERT_EQUAL(qtype_pack(t, codes, n, buf), QT_OK);
    for (size_t i = 0; i < nb; i++) {
        if (buf[i] != want[i]) fprintf(stderr, "\n  %s byte %zu: 0x%02x, want 0x%02x\n", name, i, buf[i], want[i]);
        CU_ASSERT_EQUAL(buf[i], want[i]);
    }
}

static void test_pack_layout(void) {
    /* 4-bit: element 2k in the high nibble */
    expect_packed("nf4", (const uint32_t[]){1, 2, 3, 4, 5}, 5, (const uint8_t[]){0x12, 0x34, 0x50}, 3);
    /* 2-bit: 01 10 11 00 | 11 -> 0x6C, 0xC0 */
    expect_packed("ternary", (const uint32_t[]){1, 2, 3, 0, 3}, 5, (const uint8_t[]){0x6C, 0xC0}, 2);
    /* 1-bit: 1011 0001 | 1 */
    expect_packed("binary", (const uint32_t[]){1, 0, 1, 1, 0, 0, 0, 1, 1}, 9, (const uint8_t[]){0xB1, 0x80}, 2);
    /* 3-bit: 101 011 11|1 -> 1010 1111, 1000 0000 */
    expect_packed("int3", (const uint32_t[]){5, 3, 7}, 3, (const uint8_t[]){0xAF, 0x80}, 2);
    /* 5-bit: 10001 111|11 -> 0x8F, 0xC0 */
    expect_packed("int5", (const uint32_t[]){0x11, 0x1F}, 2, (const uint8_t[]){0x8F, 0xC0}, 2);
    /* 6-bit: 111111 00|0001 -> 0xFC, 0x10 */
    expect_packed("fp6_e3m2", (const uint32_t[]){0x3F, 0x01}, 2, (const uint8_t[]){0xFC, 0x10}, 2);
    /* 7-bit: 1000001 1|111111 -> 0x83, 0xFC */
    expect_packed("int7", (const uint32_t[]){0x41, 0x7F}, 2, (const uint8_t[]){0x83, 0xFC}, 2);
    expect_packed("fp8_e4m3", (const uint32_t[]){0x12, 0xFE, 0x07}, 3, (const uint8_t[]){0x12, 0xFE, 0x07}, 3);
}

/* ---- MX blocks ------------------------------------------------------------- */

static void test_mx_example(void) {
    /* mxfp4: amax 20 -> floor(log2 20) = 4, emax(e2m1) = 2 -> X = 2, scale 4, code 129.
     *  20 / 4 = 5     ties 4|6 -> 4 (code 6, even)     -> 16
     *  -3 / 4 = -0.75 ties 0.5|1 -> 1 (code 2)         -> -4, code 0xA
     *   1 / 4 = 0.25  ties 0|0.5 -> 0                  -> 0
     *   9 / 4 = 2.25  -> 2 (code 4)                    -> 8
     * -13 / 4 = -3.25 -> -3 (code 0xD)                 -> -12
     * 0.1 / 4         -> 0
     * -20 / 4 = -5    -> -4 (code 0xE)                 -> -16 */
    const QType *t = find("mxfp4");
    float x[32] = {20, -3, 1, 9, -13, 0.1f, -20};
    uint8_t blk[17], want[17] = {129, 0x6A, 0x04, 0xD0, 0xE0};
    CU_ASSERT_EQUAL(qtype_block_quantize(t, x, 32, blk, QROUND_RNE, NULL), QT_OK);
    CU_ASSERT(memcmp(blk, want, sizeof want) == 0);
    float y[32], ywant[32] = {16, -4, 0, 8, -12, 0, -16};
    CU_ASSERT_EQUAL(qtype_block_dequantize(t, blk, 32, y), QT_OK);
    for (int i = 0; i < 32; i++) CU_ASSERT_EQUAL(y[i], ywant[i]);
    /* half-away moves the ties: 5 -> 6 (code 7), -0.75 -> -1 (unchanged), 0.25 -> 0.5 (code 1) */
    CU_ASSERT_EQUAL(qtype_block_quantize(t, x, 32, blk, QROUND_HALF_AWAY, NULL), QT_OK);
    CU_ASSERT(blk[0] == 129 && blk[1] == 0x7A && blk[2] == 0x14);
    /* a short block: the missing elements are zeros, n outputs */
    CU_ASSERT_EQUAL(qtype_block_quantize(t, x, 5, blk, QROUND_RNE, NULL), QT_OK);
    CU_ASSERT(memcmp(blk, (const uint8_t[]){129, 0x6A, 0x04, 0xD0, 0x00}, 5) == 0);
    float y5[5] = {0};
    CU_ASSERT_EQUAL(qtype_block_dequantize(t, blk, 5, y5), QT_OK);
    CU_ASSERT(y5[0] == 16 && y5[4] == -12);

    /* mxfp8_e4m3: amax 500 -> floor(log2) 8 - emax 8 = 0 -> code 127; 500 saturates to 448 */
    const QType *f8 = find("mxfp8_e4m3");
    uint8_t b8[33];
    CU_ASSERT_EQUAL(qtype_block_quantize(f8, (const float[]){500, 1, -0.5f}, 3, b8, QROUND_RNE, NULL), QT_OK);
    CU_ASSERT(b8[0] == 127 && b8[1] == 0x7E && b8[2] == 0x38 && b8[3] == 0xB0 && b8[4] == 0);

    /* mxfp6_e3m2: amax 0.3 -> floor(log2) -2 - 4 = -6 -> code 121; 0.3 * 64 = 19.2 -> 20
     * = 1.25 * 2^4 -> 0.111.01 = 0x1D -> 20 / 64 = 0.3125 */
    const QType *f6 = find("mxfp6_e3m2");
    uint8_t b6[25];
    float y6[1];
    CU_ASSERT_EQUAL(qtype_block_quantize(f6, (const float[]){0.3f}, 1, b6, QROUND_RNE, NULL), QT_OK);
    CU_ASSERT(b6[0] == 121 && b6[1] == (0x1D << 2));
    CU_ASSERT_EQUAL(qtype_block_dequantize(f6, b6, 1, y6), QT_OK);
    CU_ASSERT_EQUAL(y6[0], 0.3125f);

    /* mxint8: amax 3 -> X = 1; elements x / 2 * 64: 3 -> 96, -1.5 -> -48, 0.01 -> 0.32 -> 0;
     * 3.99 -> 127.68 -> 127 (symmetric clamp, not 128) */
    const QType *i8 = find("mxint8");
    uint8_t bi[33];
    float yi[4];
    CU_ASSERT_EQUAL(qtype_block_quantize(i8, (const float[]){3, -1.5f, 0.01f, 3.99f}, 4, bi, QROUND_RNE, NULL),
                    QT_OK);
    CU_ASSERT(bi[0] == 128 && bi[1] == 96 && bi[2] == 0xD0 && bi[3] == 0 && bi[4] == 127);
    CU_ASSERT_EQUAL(qtype_block_dequantize(i8, bi, 4, yi), QT_OK);
    CU_ASSERT(yi[0] == 3.0f && yi[1] == -1.5f && yi[2] == 0.0f && yi[3] == 127.0f / 32);
    CU_ASSERT_EQUAL(qtype_block_quantize(i8, (const float[]){-3.99f}, 1, bi, QROUND_RNE, NULL), QT_OK);
    CU_ASSERT_EQUAL(bi[1], 0x81); /* -127 */
}

static void test_mx_special_blocks(void) {
    const char *names[] = {"mxfp8_e4m3", "mxfp6_e3m2", "mxfp4", "mxint8", "mx6", "mx9"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        const QType *t = find(names[k]);
        float x[32] = {0}, y[32];
        uint8_t blk[40];
        /* all zeros: scale 2^0 (code 127), zero codes, zero values */
        CU_ASSERT_EQUAL(qtype_block_quantize(t, x, t->block, blk, QROUND_RNE, NULL), QT_OK);
        CU_ASSERT_EQUAL(blk[0], 127);
        size_t first_elem = t->kind == QTYPE_KIND_MX ? 1 : 2;
        for (size_t i = first_elem; i < t->block_bytes; i++) CU_ASSERT_EQUAL(blk[i], 0);
        CU_ASSERT_EQUAL(qtype_block_dequantize(t, blk, t->block, y), QT_OK);
        for (int i = 0; i < t->block; i++) CU_ASSERT_EQUAL(y[i], 0.0f);
        /* a NaN or an infinity anywhere: scale code 255, every value NaN */
        x[0] = 1.0f;
        x[3] = NAN;
        CU_ASSERT_EQUAL(qtype_block_quantize(t, x, t->block, blk, QROUND_RNE, NULL), QT_OK);
        CU_ASSERT_EQUAL(blk[0], 255);
        CU_ASSERT_EQUAL(qtype_block_dequantize(t, blk, t->block, y), QT_OK);
        for (int i = 0; i < t->block; i++) CU_ASSERT(isnan(y[i]));
        x[3] = -INFINITY;
        CU_ASSERT_EQUAL(qtype_block_quantize(t, x, t->block, blk, QROUND_RNE, NULL), QT_OK);
        CU_ASSERT_EQUAL(blk[0], 255);
        /* a hand-made block with scale byte 255 decodes to NaN whatever its elements */
        memset(blk, 0x11, sizeof blk);
        blk[0] = 255;
        CU_ASSERT_EQUAL(qtype_block_dequantize(t, blk, 2, y), QT_OK);
        CU_ASSERT(isnan(y[0]) && isnan(y[1]));
        /* tiny values: the scale clamps at 2^-127 (code 0) */
        x[3] = 0.0f;
        x[0] = ldexpf(1.0f, -140);
        CU_ASSERT_EQUAL(qtype_block_quantize(t, x, t->block, blk, QROUND_RNE, NULL), QT_OK);
        CU_ASSERT_EQUAL(blk[0], 0);
        /* misuse */
        CU_ASSERT_EQUAL(qtype_block_quantize(t, x, 0, blk, QROUND_RNE, NULL), QT_ERR_ARG);
        CU_ASSERT_EQUAL(qtype_block_quantize(t, x, t->block + 1, blk, QROUND_RNE, NULL), QT_ERR_ARG);
        CU_ASSERT_EQUAL(qtype_block_quantize(t, x, 4, blk, QROUND_STOCHASTIC, NULL), QT_ERR_ARG);
        CU_ASSERT_EQUAL(qtype_block_dequantize(t, blk, t->block + 1, y), QT_ERR_ARG);
    }
    float x[2] = {1, 2};
    uint8_t blk[8];
    CU_ASSERT_EQUAL(qtype_block_quantize(find("fp8_e4m3"), x, 2, blk, QROUND_RNE, NULL), QT_ERR_ARG);
    CU_ASSERT_EQUAL(qtype_block_dequantize(find("nf4"), blk, 2, x), QT_ERR_ARG);
    CU_ASSERT_EQUAL(qtype_block_quantize(NULL, x, 2, blk, QROUND_RNE, NULL), QT_ERR_ARG);
}

static void test_mx_shared_example(void) {
    /* amax 3 -> E = 1, shared code 128. Sub-blocks (max floor(log2), t = min(E - that, 1), step 2^(E - t + 1 - m)):
     *   (3, -0.1):     1 -> t 0      (1.0, -1.0):   0 -> t 1
     *   (0.75, 0.5):  -1 -> t 1      (0.01, 0.02): -6 -> t 1      zeros: t 1
     * micro byte 0111 1111.
     * mx9 (m = 7): steps 2^-5, then 2^-6:
     *   3 * 32 = 96, -0.1 * 32 = -3.2 -> -3 (0x83); 0.75 * 64 = 48, 0.5 * 64 = 32;
     *   64, -64 (0xC0); 0.64 -> 1, 1.28 -> 1
     * mx6 (m = 4): steps 2^-2, then 2^-3:
     *   12, -0.4 -> 0; 6, 4; 8, -8 (0x18); 0.08 -> 0, 0.16 -> 0 */
    float x[16] = {3, -0.1f, 0.75f, 0.5f, 1, -1, 0.01f, 0.02f};
    const QType *mx9 = find("mx9"), *mx6 = find("mx6");
    uint8_t b9[18], w9[18] = {128, 0x7F, 96, 0x83, 48, 32, 64, 0xC0, 1, 1};
    CU_ASSERT_EQUAL(qtype_block_quantize(mx9, x, 16, b9, QROUND_RNE, NULL), QT_OK);
    CU_ASSERT(memcmp(b9, w9, sizeof w9) == 0);
    float y[16], y9[16] = {3, -0.09375f, 0.75f, 0.5f, 1, -1, 0.015625f, 0.015625f};
    CU_ASSERT_EQUAL(qtype_block_dequantize(mx9, b9, 16, y), QT_OK);
    for (int i = 0; i < 16; i++) CU_ASSERT_EQUAL(y[i], y9[i]);

    /* mx6 codes 12, 0, 6, 4, 8, 0x18, 0, 0 as 5-bit fields:
     * 01100 00000 00110 00100 01000 11000 00000 00000 -> 0x60 0x0C 0x44 0x60 0x00 */
    uint8_t b6[12], w6[12] = {128, 0x7F, 0x60, 0x0C, 0x44, 0x60, 0x00};
    CU_ASSERT_EQUAL(qtype_block_quantize(mx6, x, 16, b6, QROUND_RNE, NULL), QT_OK);
    CU_ASSERT(memcmp(b6, w6, sizeof w6) == 0);
    float y6[16] = {3, 0, 0.75f, 0.5f, 1, -1, 0, 0};
    CU_ASSERT_EQUAL(qtype_block_dequantize(mx6, b6, 16, y), QT_OK);
    for (int i = 0; i < 16; i++) CU_ASSERT_EQUAL(y[i], y6[i]);

    /* saturation: 3.99 * 32 = 127.68 -> 127 at most */
    CU_ASSERT_EQUAL(qtype_block_quantize(mx9, (const float[]){3.99f, -3.99f}, 2, b9, QROUND_RNE, NULL), QT_OK);
    CU_ASSERT(b9[0] == 128 && b9[2] == 0x7F && b9[3] == 0xFF);
}

/* Random blocks: re-quantizing a dequantized block gives the same bytes,
 * and every element is within one step of the shared scale. Stochastic
 * rounding with u = 0 equals floor for blocks too. */
static void test_block_roundtrip(void) {
    const char *names[] = {"mxfp8_e4m3", "mxfp6_e3m2", "mxfp4", "mxint8", "mx6", "mx9"};
    uint32_t seed = 777;
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        const QType *t = find(names[k]);
        for (int rep = 0; rep < 50; rep++) {
            float x[32], y[32], u0[32] = {0};
            float mag = ldexpf(1.0f, (int)(lcg(&seed) % 40) - 20);
            for (int i = 0; i < t->block; i++) {
                float r = (float)(lcg(&seed) % 2000001) / 1000000.0f - 1.0f;
                x[i] = r * mag * ((lcg(&seed) % 4) == 0 ? 0.01f : 1.0f);
            }
            uint8_t b[40], b2[40], bf[40];
            CU_ASSERT_EQUAL(qtype_block_quantize(t, x, t->block, b, QROUND_RNE, NULL), QT_OK);
            CU_ASSERT_EQUAL(qtype_block_dequantize(t, b, t->block, y), QT_OK);
            CU_ASSERT_EQUAL(qtype_block_quantize(t, y, t->block, b2, QROUND_RNE, NULL), QT_OK);
            CU_ASSERT(memcmp(b, b2, t->block_bytes) == 0);
            /* the largest element's step bounds every error: elements are at least that fine */
            int X = (int)b[0] - 127;
            double step = t->kind == QTYPE_KIND_MX_SHARED ? ldexp(1, X + 1 - t->mant_bits)
                          : t->elem->kind == QTYPE_KIND_INT ? ldexp(1, X - 6)
                                                            : ldexp(1, X + t->elem_emax - t->elem->man_bits);
            /* saturation can cost e4m3 up to two top-binade steps (amax/2^X < 512, max 448) */
            for (int i = 0; i < t->block; i++) CU_ASSERT(fabs((double)y[i] - x[i]) <= 2 * step);
            CU_ASSERT_EQUAL(qtype_block_quantize(t, x, t->block, b, QROUND_FLOOR, NULL), QT_OK);
            CU_ASSERT_EQUAL(qtype_block_quantize(t, x, t->block, bf, QROUND_STOCHASTIC, u0), QT_OK);
            CU_ASSERT(memcmp(b, bf, t->block_bytes) == 0);
        }
    }
}

int register_quant_qtype_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qtype", NULL, NULL);
    if (!s) return -1;
    struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"table, names, bits per element", test_table},
        {"generic eXmY formats", test_generic_parse},
        {"parse errors list the valid names", test_parse_errors},
        {"nf4: 16 values and ties to the lower code", test_nf4_values},
        {"fp4 grid", test_fp4_grid},
        {"fp8: all 256 codes of e4m3 and e5m2", test_fp8_decode_all},
        {"fp6 maxima", test_fp6_max},
        {"ties under rne and half-away, every format", test_ties},
        {"saturation and NaN", test_saturation},
        {"encode(decode(c)) == c", test_idempotence},
        {"stochastic: u=0 floor, u->1 ceil", test_stochastic},
        {"pack/unpack round trip, widths 1-8", test_pack_roundtrip},
        {"pack layout, MSB first", test_pack_layout},
        {"MX blocks: worked examples", test_mx_example},
        {"MX blocks: zero, NaN, tiny, misuse", test_mx_special_blocks},
        {"mx6/mx9: worked example", test_mx_shared_example},
        {"block round trips", test_block_roundtrip},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return 0;
}
