/* test_qarray_deq.c - the dequantize kernels (qarray_deq.h): every kernel
 * gives qarray_deq_ref's bits on random codes, tables, scales and zero
 * points (special values included), and qarray_dequantize gives the same
 * array at every kernel level and thread count, element by element the
 * value of its code and scale. Part of the quant_qarray suite. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "quant/qarray_deq.h"
#include "test_qarray.h"
#include "test_util.h"

/* ---- kernels against the reference -------------------------------------------------------------------------- */

#define K_BYTES 4096
#define K_GROUPS 3
#define K_MAX_GLEN 100
#define K_MAX_OUT (K_GROUPS * K_MAX_GLEN)

typedef void (*DeqFn)(const QDeqSpan *sp, float *y);

static const struct {
    const char *name;
    QDeqLevel level;
    DeqFn fn;
} KERNELS[] = {
    {"portable", QDEQ_PORTABLE, qarray_deq_portable},
    {"avx2", QDEQ_AVX2, qarray_deq_avx2},
    {"avx512", QDEQ_AVX512, qarray_deq_avx512},
};

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Values that stress the arithmetic: signed zeros, a quiet and a signalling NaN, infinities, subnormals and a
 * product that overflows. */
static const float *specials(void) {
    static float v[10];
    v[0] = -0.0f, v[1] = bits_f32(0x7fc01234u), v[2] = INFINITY, v[3] = 1e-40f, v[4] = -INFINITY;
    v[5] = 3e38f, v[6] = 0.0f, v[7] = bits_f32(0x7f800001u), v[8] = -1e-41f, v[9] = 2.5f;
    return v;
}

/* Table of 256 values: normal numbers, or (special) the values above at the low codes too. */
static void fill_lut(float *lut, Rng *g, bool special) {
    rng_fill_normal(g, lut, 256, 0.0f, 2.0f);
    if (!special) return;
    const float *s = specials();
    for (int i = 0; i < 10; i++) lut[i] = s[i], lut[255 - 7 * i] = s[i];
}

/* Runs every kernel the CPU has on sp and compares with the reference, the floats past the output included
 * (nothing is written beyond it). */
static bool kernels_agree(const QDeqSpan *sp, const char *what) {
    float want[K_MAX_OUT + 4], got[K_MAX_OUT + 4];
    const size_t n = sp->n_groups * sp->glen;
    memset(want, 0x5a, sizeof want);
    qarray_deq_ref(sp, want);
    bool ok = true;
    for (size_t k = 0; k < sizeof KERNELS / sizeof KERNELS[0]; k++) {
        if (KERNELS[k].level > qarray_deq_cpu()) continue;
        memset(got, 0x5a, sizeof got);
        KERNELS[k].fn(sp, got);
        if (memcmp(want, got, (n + 4) * sizeof(float)) == 0) continue;
        size_t i = 0;
        while (i < n + 4 && memcmp(&want[i], &got[i], sizeof(float)) == 0) i++;
        fprintf(stderr, "\n  %s, %s kernel: y[%zu] = %a, the reference %a\n", what, KERNELS[k].name, i, (double)got[i],
                (double)want[i]);
        ok = false;
    }
    return ok;
}

static void test_kernels_bit_exact(void) {
    Rng g;
    rng_init(&g, 41, RNG_STREAM_INIT);
    uint8_t *codes = malloc(K_BYTES);
    CU_ASSERT_PTR_NOT_NULL_FATAL(codes);
    rng_fill_u32(&g, (uint32_t *)(void *)codes, K_BYTES / 4);
    float lut[256], scale[K_GROUPS], zp[K_GROUPS];
    const size_t glens[] = {1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100};
    const size_t firsts[] = {0, 1, 2, 5, 8, 64};
    bool ok = true;
    for (int special = 0; special < 2; special++) {
        fill_lut(lut, &g, special);
        rng_fill_normal(&g, scale, K_GROUPS, 0.0f, 1.0f);
        rng_fill_normal(&g, zp, K_GROUPS, 0.0f, 4.0f);
        if (special) scale[1] = INFINITY, scale[2] = -0.0f, zp[0] = NAN, zp[2] = -0.0f;
        for (int bits = 1; bits <= 8; bits++)
            for (size_t a = 0; a < sizeof glens / sizeof *glens; a++)
                for (size_t f = 0; f < sizeof firsts / sizeof *firsts; f++)
                    for (int with_zp = 0; with_zp < 2; with_zp++) {
                        QDeqSpan sp = {.codes = codes, .first = firsts[f], .n_groups = K_GROUPS, .glen = glens[a],
                                       .bits = bits, .lut = lut, .scale = scale, .zp = with_zp ? zp : NULL};
                        char what[96];
                        snprintf(what, sizeof what, "%d bits, runs of %zu from %zu, %s zp, %s table", bits, glens[a],
                                 firsts[f], with_zp ? "with" : "no", special ? "special" : "normal");
                        ok &= kernels_agree(&sp, what);
                    }
    }
    /* 8-bit codes that are their own values: converted, not looked up */
    for (int sign = 0; sign < 2; sign++) {
        for (int c = 0; c < 256; c++) lut[c] = sign ? (float)(int8_t)(uint8_t)c : (float)c;
        CU_ASSERT_EQUAL(qarray_deq_codes_of(lut), sign ? QDEQ_CODES_S8 : QDEQ_CODES_U8);
        for (size_t a = 0; a < sizeof glens / sizeof *glens; a++)
            for (int with_zp = 0; with_zp < 2; with_zp++) {
                QDeqSpan sp = {.codes = codes, .first = 3, .n_groups = K_GROUPS, .glen = glens[a], .bits = 8,
                               .lut = lut, .scale = scale, .zp = with_zp ? zp : NULL,
                               .codes_are = sign ? QDEQ_CODES_S8 : QDEQ_CODES_U8};
                ok &= kernels_agree(&sp, sign ? "int8 codes converted" : "uint8 codes converted");
            }
    }
    lut[17] = -0.0f; /* one value off: a table again */
    CU_ASSERT_EQUAL(qarray_deq_codes_of(lut), QDEQ_CODES_TABLE);
    CU_ASSERT(ok);
    free(codes);
}

/* ---- whole arrays: levels, threads and the element formula ----------------------------------------------------- */

#define A_ROWS 256
#define A_COLS 512
#define A_NUMEL (A_ROWS * A_COLS)

typedef struct {
    const char *name, *qt;
    QArrayOptions o;
    int ndim;
    int shape[3];
} ArrCase;

#define CW0 .n_channelwise = 1, .channelwise_axes = {0}
#define TILE1(t) .n_tiled = 1, .tiled_axes = {{1, t}}

static const ArrCase ARR_CASES[] = {
    {"nf4 blocks of 64 + dq", "nf4", {.double_quant = true}, 2, {A_ROWS, A_COLS}},
    {"nf4 blocks of 64 + dq in blocks of 16", "nf4", {.double_quant = true, .dq_block = 16}, 2, {A_ROWS, A_COLS}},
    {"nf4 blocks of 64", "nf4", {0}, 2, {A_ROWS, A_COLS}},
    {"int4 blocks of 32", "int4", {CW0, TILE1(32)}, 2, {A_ROWS, A_COLS}},
    {"uint4 asymmetric blocks of 16", "uint4", {CW0, TILE1(16)}, 2, {A_ROWS, A_COLS}},
    {"fp4_e2m1 per channel", "fp4_e2m1", {CW0}, 2, {A_ROWS, A_COLS}},
    {"int8 per channel", "int8", {CW0}, 2, {A_ROWS, A_COLS}},
    {"uint8 asymmetric per channel", "uint8", {CW0}, 2, {A_ROWS, A_COLS}},
    {"int8 asymmetric, float zero points", "int8", {CW0, .range = QARRAY_RANGE_ASYMMETRIC,
                                                    .zp_type = QARRAY_ZP_FLOAT}, 2, {A_ROWS, A_COLS}},
    {"fp8_e4m3 per tensor", "fp8_e4m3", {0}, 2, {A_ROWS, A_COLS}},
    {"int8 per column, float16 scales", "int8", {.n_channelwise = 1, .channelwise_axes = {1},
                                                 .scale_type = QARRAY_SCALE_F16}, 2, {A_ROWS, A_COLS}},
    {"int4 3-d, channels on axis 1, blocks of 64", "int4", {.n_channelwise = 1, .channelwise_axes = {1},
                                                           .n_tiled = 1, .tiled_axes = {{2, 64}}}, 3, {4, 64, 512}},
    {"int3 blocks of 16", "int3", {CW0, TILE1(16)}, 2, {A_ROWS, A_COLS}},
    {"ternary per channel", "ternary", {CW0}, 2, {A_ROWS, A_COLS}},
    {"binary per channel", "binary", {CW0}, 2, {A_ROWS, A_COLS}},
    {"mxfp4", "mxfp4", {0}, 2, {A_ROWS, A_COLS}},
};

/* Element i of q from its code and its scale alone (non-block formats). */
static void by_formula(const QArray *q, float *y) {
    uint32_t *c = qa_codes_of(q);
    size_t sstride[QARRAY_MAX_DIMS], st = 1;
    for (int d = q->ndim - 1; d >= 0; d--) sstride[d] = st, st *= (size_t)q->scale_shape[d];
    for (size_t i = 0; i < q->numel; i++) {
        size_t r = i, g = 0;
        for (int d = q->ndim - 1; d >= 0; d--) {
            g += r % (size_t)q->shape[d] / (size_t)q->tile[d] * sstride[d];
            r /= (size_t)q->shape[d];
        }
        y[i] = (qtype_decode(q->qtype, c[i]) - qarray_zero_point_at(q, g)) * qarray_scale_at(q, g);
    }
    free(c);
}

static bool same_bits(const float *a, const float *b, size_t n, const char *what) {
    if (memcmp(a, b, n * sizeof *a) == 0) return true;
    size_t i = 0;
    while (memcmp(&a[i], &b[i], sizeof *a) == 0) i++;
    fprintf(stderr, "\n  %s: y[%zu] = %a, expected %a\n", what, i, (double)a[i], (double)b[i]);
    return false;
}

static void test_levels_and_threads(void) {
    float *x = qa_normal_sample(43, A_NUMEL), *want = qa_alloc_floats(A_NUMEL), *got = qa_alloc_floats(A_NUMEL);
    x[5] = 40.0f; /* an outlier block: double-quantized neighbours get coarse scales */
    const int threads_before = parallel_get_threads();
    const int threads[] = {1, 3};
    for (size_t c = 0; c < sizeof ARR_CASES / sizeof *ARR_CASES; c++) {
        const ArrCase *ac = &ARR_CASES[c];
        QArray q;
        qa_quant_ok(&q, x, ac->ndim, ac->shape, ac->qt, &ac->o);
        CU_ASSERT_EQUAL_FATAL(q.numel, (size_t)A_NUMEL);
        if (qtype_is_block(q.qtype)) {
            qarray_deq_max_level = QDEQ_REF;
            parallel_set_threads(1);
            qarray_dequantize(&q, want);
        } else {
            by_formula(&q, want);
        }
        for (int lv = QDEQ_REF; lv < QDEQ_LEVEL_COUNT; lv++)
            for (int th = 0; th < 2; th++) {
                qarray_deq_max_level = (QDeqLevel)lv;
                parallel_set_threads(threads[th]);
                char what[128];
                snprintf(what, sizeof what, "%s, %s kernel, %d threads", ac->name,
                         qarray_deq_level_name(qarray_deq_level()), threads[th]);
                memset(got, 0, A_NUMEL * sizeof *got);
                qarray_dequantize(&q, got);
                CU_ASSERT(same_bits(got, want, A_NUMEL, what));
                /* rows from the middle, over the pool as well */
                size_t last = (size_t)q.shape[q.ndim - 1], rows = q.numel / last;
                CU_ASSERT_EQUAL(qarray_dequantize_rows(&q, 3, rows - 5, got), QT_OK);
                CU_ASSERT(same_bits(got, want + 3 * last, (rows - 5) * last, what));
            }
        qarray_free(&q);
    }
    qarray_deq_max_level = QDEQ_AVX512;
    parallel_set_threads(threads_before);
    free(x), free(want), free(got);
}

int qarray_deq_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "dequantize kernels equal the reference bit for bit", test_kernels_bit_exact) ||
           !CU_add_test(s, "dequantize: every level and thread count, the element formula", test_levels_and_threads);
}
