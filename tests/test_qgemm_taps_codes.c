/* test_qgemm_taps_codes.c - the taps kernels writing their outputs as the reader's codes (QGemmTaps.codes: plain
 * bytes and channel quads; the floats too with floats_too) and summing a residual (QGemmTaps.res, relu'd or not) on
 * every family the CPU has and the portable kernel, against the portable kernel's
 * floats quantized by qgemm_quantize_u8_portable, bit for bit: rows that leave a quad or a row block part full,
 * vectors with no, some and all lanes output, relu, zero points 0 to 255, quotients exactly on a half (the
 * division path), calls a row block and half the vectors at a time; nothing written outside the outputs; a value
 * that is not finite reported. The families that make floats first (AVX2, AVX-VNNI, AMX's tiles) say so through
 * qgemm_taps_codes_direct and still give the same codes. The quant_taps_codes suite. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "quant/qgemm.h"
#include "test_int8.h"
#include "test_util.h"

#define CANARY 0xA5

/* One case's operands and what the portable kernel makes of them. */
typedef struct {
    int rows, total;          /* output rows, output pixels (the lanes of vec_mask) */
    size_t ldo, qplane, quads; /* out's row pitch (2 past the outputs), dwords per quad (3 more), quads */
    int32_t *off, *pos;
    uint8_t *act;
    uint32_t *w;
    float *scale, *bias, *res, *ref; /* res (rows, ldo) or NULL; ref: the floats wanted */
    uint16_t *mask;
    QGemmPackedTaps p;
    QGemmCodes q;
} Case;

/* Random operands (stride > 0: the taps at one stride, AMX's tiles where 16 | taps); half: weights in -2..1 and
 * codes within 3 of the zero point, every scale 1e-3, no bias, the reader's scale 2e-3, so every odd sum lies on
 * a half inside the bounds; else the reader's scale spans the outputs, so most round and some clamp. resmode 1, 2:
 * a residual summed, relu'd in 2 (nn_add's sum and nn_relu's relu, by hand). nan_bias: row 0's bias NaN. */
static void case_init(Case *k, int rows, int taps, int n_vec, int stride, int a_zero, QGemmEpi epi, bool half,
                      bool nan_bias, int resmode, Rng *r) {
    memset(k, 0, sizeof *k);
    k->rows = rows, k->off = malloc((size_t)taps * 4);
    int max_off = 0;
    for (int t = 0; t < taps; t++) {
        k->off[t] = stride > 0 ? 3 + t * stride : (int32_t)rng_below(r, 41);
        max_off = k->off[t] > max_off ? k->off[t] : max_off;
    }
    const size_t n_act = (size_t)(max_off + QGEMM_LANES * n_vec) * 4;
    k->act = malloc(n_act), k->w = malloc((size_t)rows * taps * 4);
    k->scale = malloc((size_t)rows * 4), k->bias = malloc((size_t)rows * 4);
    for (size_t i = 0; i < n_act; i++) {
        const int u = half ? a_zero + (int)rng_below(r, 7) - 3 : (int)rng_below(r, 256);
        k->act[i] = (uint8_t)(u < 0 ? 0 : u > 255 ? 255 : u);
    }
    rng_fill_u32(r, k->w, (size_t)rows * taps);
    if (half)
        for (size_t i = 0; i < (size_t)rows * taps * 4; i++) ((uint8_t *)k->w)[i] = (uint8_t)(rng_below(r, 3) + 255);
    for (int i = 0; i < rows; i++) {
        k->scale[i] = half ? 1e-3f : 1e-4f * (float)(1 + rng_below(r, 300));
        k->bias[i] = half ? 0.0f : 0.02f * (float)((int)rng_below(r, 201) - 100);
    }
    if (nan_bias) k->bias[0] = NAN;
    k->mask = malloc((size_t)n_vec * 2), k->pos = malloc((size_t)n_vec * 4);
    for (int v = 0; v < n_vec; v++) {
        uint32_t m = rng_below(r, 3) == 0 ? 0xFFFF : rng_below(r, 65536);
        if (v == 1) m = 0;
        k->mask[v] = (uint16_t)m, k->pos[v] = k->total, k->total += __builtin_popcount(m);
    }
    k->ldo = (size_t)k->total + 2, k->qplane = k->ldo + 3, k->quads = (size_t)(rows + 3) / 4;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_taps(&k->p, k->w, rows, taps, &err), QT_OK);
    k->ref = malloc((size_t)rows * k->ldo * 4);
    memset(k->ref, 0x5a, (size_t)rows * k->ldo * 4);
    QGemmTaps g = {.act = k->act, .tap_off = k->off, .n_vec = n_vec, .vec_mask = k->mask, .vec_pos = k->pos,
                   .w = &k->p, .a_zero = a_zero, .out = k->ref, .ldo = k->ldo, .scale = k->scale, .bias = k->bias,
                   .epi = epi};
    qgemm_taps_portable(&g, 0, k->p.row_blocks, 0, n_vec); /* the floats (checked against the definition elsewhere) */
    float lo = 0.0f, hi = 0.0f;
    for (int i = 0; i < rows; i++)
        for (int px = 0; px < k->total; px++) {
            float *o = k->ref + (size_t)i * k->ldo + px;
            if (resmode) {
                if (!k->res) k->res = malloc((size_t)rows * k->ldo * 4);
                const float rv = k->res[(size_t)i * k->ldo + px] = 0.01f * (float)((int)rng_below(r, 2001) - 1000);
                const float v = *o + rv;
                *o = resmode == 2 && !(v > 0.0f) ? 0.0f : v;
            }
            lo = *o < lo ? *o : lo, hi = *o > hi ? *o : hi;
        }
    const float s = half ? 2e-3f : (hi - lo) / 230.0f + 1e-6f;
    k->q = (QGemmCodes){.s = s, .lo = (float)-a_zero, .hi = (float)(255 - a_zero), .zero = a_zero};
}

static void case_free(Case *k) {
    qgemm_packed_taps_free(&k->p);
    free(k->off), free(k->pos), free(k->act), free(k->w), free(k->scale), free(k->bias), free(k->res), free(k->ref);
    free(k->mask);
}

/* The codes wanted, plain (rows, ldo) and by quads (quads, qplane) dwords, canaries where no output lands; false if
 * some output is not finite. */
static bool case_codes(const Case *k, uint8_t *plain, uint32_t *quad) {
    memset(plain, CANARY, (size_t)k->rows * k->ldo), memset(quad, CANARY, k->quads * k->qplane * 4);
    bool finite = true;
    for (int i = 0; i < k->rows; i++)
        finite &= qgemm_quantize_u8_portable(plain + (size_t)i * k->ldo, k->ref + (size_t)i * k->ldo,
                                             (size_t)k->total, k->q.s, k->q.lo, k->q.hi, k->q.zero);
    for (size_t gq = 0; gq < k->quads; gq++)
        for (int px = 0; px < k->total; px++) {
            uint32_t d = 0;
            for (int b = 0; b < 4; b++) {
                const int i = 4 * (int)gq + b;
                d |= (uint32_t)(i < k->rows ? plain[(size_t)i * k->ldo + px] : (uint8_t)k->q.zero) << (8 * b);
            }
            quad[gq * k->qplane + (size_t)px] = d;
        }
    return finite;
}

/* One case on family fam (case_init's arguments): forms plain codes with the floats too, quads, floats alone,
 * quads with the floats too, each in pieces (a row block and half the vectors at a time), against the portable
 * floats and their codes. Returns the mismatches (each printed); with nan_bias, 1 unless every form with codes
 * says false. */
static int codes_case(QGemmIsa fam, int rows, int taps, int n_vec, int stride, int a_zero, QGemmEpi epi, bool half,
                      bool nan_bias, int resmode, uint64_t seed) {
    Rng r;
    rng_init(&r, seed, 9);
    Case k;
    case_init(&k, rows, taps, n_vec, stride, a_zero, epi, half, nan_bias, resmode, &r);
    const size_t n_out = (size_t)rows * k.ldo, n_quad = k.quads * k.qplane;
    uint8_t *plain_want = malloc(n_out), *plain = malloc(n_out);
    uint32_t *quad_want = malloc(n_quad * 4), *quad = malloc(n_quad * 4);
    float *tmp = malloc(n_out * 4);
    const bool finite = case_codes(&k, plain_want, quad_want);
    QGemmTaps g = {.act = k.act, .tap_off = k.off, .n_vec = n_vec, .vec_mask = k.mask, .vec_pos = k.pos, .w = &k.p,
                   .a_zero = a_zero, .out = tmp, .ldo = k.ldo, .scale = k.scale, .bias = k.bias, .epi = epi,
                   .res = k.res, .res_relu = resmode == 2};
    test_int8_family_on(fam);
    const char *kernel = qgemm_kernel_name();
    const size_t wb = qgemm_taps_act_wide_bytes(&g);
    int16_t *wide = wb ? aligned_alloc(64, (wb + 63) / 64 * 64) : NULL;
    g.act_wide = wide;
    static const char *const FORMS[] = {"plain codes + floats", "quads", "floats", "quads + floats"};
    bool ok[4], same[4];
    for (int form = 0; form < 4; form++) {
        const bool quads = form % 2 == 1, codes = form != 2, floats = form != 1;
        memset(quad, CANARY, n_quad * 4), memset(plain, CANARY, n_out), memset(tmp, 0x5a, n_out * 4);
        const QGemmCodesOut co = {.q = k.q, .dst = quads ? (uint8_t *)quad : plain, .quad_plane = quads ? k.qplane : 0};
        g.codes = codes ? &co : NULL, g.floats_too = codes && floats;
        ok[form] = true;
        for (int rb = 0; rb < k.p.row_blocks; rb++)
            ok[form] &= qgemm_taps(&g, rb, rb + 1, 0, n_vec / 2) & qgemm_taps(&g, rb, rb + 1, n_vec / 2, n_vec);
        same[form] = (!floats || !memcmp(tmp, k.ref, n_out * 4)) &&
                     (!codes || (quads ? !memcmp(quad, quad_want, n_quad * 4) : !memcmp(plain, plain_want, n_out)));
    }
    test_int8_family_off();
    int bad = 0;
    if (nan_bias) {
        bad = ok[0] || ok[1] || ok[3] || !ok[2] || finite;
        if (bad) fprintf(stderr, "\n  %s taps codes: a NaN output not reported\n", kernel);
    }
    for (int form = 0; form < 4 && !nan_bias; form++) {
        if (same[form] && ok[form] && finite) continue;
        bad++;
        fprintf(stderr, "\n  %s taps codes, %s: rows %d taps %d vectors %d stride %d zero %d%s%s%s differ\n", kernel,
                FORMS[form], rows, taps, n_vec, stride, a_zero, epi == QGEMM_EPI_RELU ? " relu" : "",
                half ? " halves" : "", resmode ? resmode == 2 ? " residual + relu" : " residual" : "");
    }
    case_free(&k);
    free(plain_want), free(plain), free(quad_want), free(quad), free(tmp), free(wide);
    return bad;
}

static void cases_on(QGemmIsa fam) {
    static const int ROWS[] = {1, 3, 7, 8, 9, 13, 33}, TAPS[] = {1, 9, 16}, VECS[] = {1, 3, 5};
    uint64_t seed = 40;
    int bad = 0;
    for (size_t i = 0; i < sizeof ROWS / sizeof *ROWS; i++)
        for (size_t j = 0; j < sizeof TAPS / sizeof *TAPS; j++)
            for (size_t k = 0; k < sizeof VECS / sizeof *VECS; k++, seed++)
                bad += codes_case(fam, ROWS[i], TAPS[j], VECS[k], TAPS[j] == 16 && seed % 2 ? 1 + (int)(seed % 3) * 8 : 0,
                                  (int)(seed * 53 % 256), seed % 3 ? QGEMM_EPI_RELU : QGEMM_EPI_NONE, false, false,
                                  0, seed);
    for (int i = 0; i < 4; i++, seed++)
        bad += codes_case(fam, 5 + 4 * i, 9, 3, 0, 30 * i, QGEMM_EPI_NONE, true, false, 0, seed);
    for (int i = 0; i < 6; i++, seed++) /* a residual block's sum, with and without its relu (epi NONE) */
        bad += codes_case(fam, ROWS[i], 9, 1 + i % 3, 0, 40 * i, QGEMM_EPI_NONE, false, false, 1 + i % 2, seed);
    bad += codes_case(fam, 9, 9, 3, 0, 7, QGEMM_EPI_NONE, false, true, 0, seed++);
    bad += codes_case(fam, 64, 16, 4, 1, 0, QGEMM_EPI_RELU, false, false, 0, seed++); /* a pointwise conv's shape */
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_codes_portable(void) { cases_on(QGEMM_ISA_PORTABLE); }

static void test_codes_families(void) {
    static const QGemmIsa FAMILIES[] = {QGEMM_ISA_AMX, QGEMM_ISA_AVX512_VNNI, QGEMM_ISA_AVXVNNI, QGEMM_ISA_AVX2};
    test_int8_on_families(cases_on, FAMILIES, 4, "taps codes");
}

/* Which families quantize in the epilogue: the portable and AVX-512 VNNI kernels, never a pool. */
static void test_codes_direct(void) {
    QGemmPackedTaps p = {.rows = 8, .taps = 1, .row_blocks = 1};
    QGemmTaps g = {.w = &p, .epi = QGEMM_EPI_RELU};
    test_int8_family_on(QGEMM_ISA_PORTABLE);
    CU_ASSERT(qgemm_taps_codes_direct(&g));
    g.epi = QGEMM_EPI_RELU_POOL2;
    CU_ASSERT_FALSE(qgemm_taps_codes_direct(&g));
    g.epi = QGEMM_EPI_NONE;
    test_int8_family_off();
    if (qgemm_cpu_has_isa(QGEMM_ISA_AVX512_VNNI)) {
        test_int8_family_on(QGEMM_ISA_AVX512_VNNI);
        CU_ASSERT(qgemm_taps_codes_direct(&g));
        test_int8_family_off();
    }
    if (qgemm_cpu_has_isa(QGEMM_ISA_AVX2)) {
        test_int8_family_on(QGEMM_ISA_AVX2);
        CU_ASSERT_FALSE(qgemm_taps_codes_direct(&g));
        test_int8_family_off();
    }
}

int register_quant_taps_codes_suite(void) {
    CU_pSuite s = CU_add_suite("quant_taps_codes", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "taps codes: the portable kernel equals its floats quantized", test_codes_portable) ||
           !CU_add_test(s, "taps codes: every family equals the portable floats quantized", test_codes_families) ||
           !CU_add_test(s, "taps codes: the families that quantize in the epilogue", test_codes_direct);
}
