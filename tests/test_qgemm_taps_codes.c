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
#include "test_util.h"

#define CANARY 0xA5

static void family_on(QGemmIsa f) {
    qgemm_force_portable = f == QGEMM_ISA_PORTABLE;
    qgemm_force_isa = f == QGEMM_ISA_PORTABLE ? -1 : (int)f;
}

static void family_off(void) { qgemm_force_portable = false, qgemm_force_isa = -1; }

/* One case on family fam; stride > 0 puts the taps at one stride (AMX's tiles where 16 | taps). half: every scale
 * 1e-3, no bias and the reader's scale 2e-3, so every odd sum lies on a half. nan_bias: row 0's bias NaN and no
 * relu, so qgemm_taps must say false. Returns the mismatches (each printed). */
static int codes_case(QGemmIsa fam, int rows, int taps, int n_vec, int stride, int a_zero, QGemmEpi epi, bool half,
                      bool nan_bias, int resmode, uint64_t seed) {
    Rng r;
    rng_init(&r, seed, 9);
    int32_t *off = malloc((size_t)taps * 4);
    int max_off = 0;
    for (int t = 0; t < taps; t++) {
        off[t] = stride > 0 ? 3 + t * stride : (int32_t)rng_below(&r, 41);
        max_off = off[t] > max_off ? off[t] : max_off;
    }
    const size_t n_act = (size_t)(max_off + QGEMM_LANES * n_vec) * 4;
    uint8_t *act = malloc(n_act);
    uint32_t *w = malloc((size_t)rows * taps * 4);
    float *scale = malloc((size_t)rows * 4), *bias = malloc((size_t)rows * 4);
    for (size_t i = 0; i < n_act; i++) act[i] = (uint8_t)rng_below(&r, 256);
    rng_fill_u32(&r, w, (size_t)rows * taps);
    for (int i = 0; i < rows; i++) {
        scale[i] = half ? 1e-3f : 1e-4f * (float)(1 + rng_below(&r, 300));
        bias[i] = half ? 0.0f : 0.02f * (float)((int)rng_below(&r, 201) - 100);
    }
    if (nan_bias) bias[0] = NAN;
    uint16_t *mask = malloc((size_t)n_vec * 2);
    int32_t *pos = malloc((size_t)n_vec * 4);
    int total = 0;
    for (int v = 0; v < n_vec; v++) {
        uint32_t m = rng_below(&r, 3) == 0 ? 0xFFFF : rng_below(&r, 65536);
        if (v == 1) m = 0;
        mask[v] = (uint16_t)m, pos[v] = total, total += __builtin_popcount(m);
    }
    const size_t ldo = (size_t)total + 2, qplane = ldo + 3, quads = (size_t)(rows + 3) / 4;
    const QGemmCodes q = {.s = half ? 2e-3f : 0.013f, .lo = (float)-a_zero, .hi = (float)(255 - a_zero), .zero = a_zero};
    QGemmPackedTaps p;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_taps(&p, w, rows, taps, &err), QT_OK);
    float *ref = malloc((size_t)rows * ldo * 4), *tmp = malloc((size_t)rows * ldo * 4), *res = NULL;
    memset(ref, 0x5a, (size_t)rows * ldo * 4);
    QGemmTaps g = {.act = act, .tap_off = off, .n_vec = n_vec, .vec_mask = mask, .vec_pos = pos, .w = &p,
                   .a_zero = a_zero, .out = ref, .ldo = ldo, .scale = scale, .bias = bias, .epi = epi};
    qgemm_taps_portable(&g, 0, p.row_blocks, 0, n_vec); /* the floats (checked against the definition elsewhere) */
    if (resmode) { /* a residual summed, relu'd in mode 2: nn_add's sum and nn_relu's relu, by hand */
        res = malloc((size_t)rows * ldo * 4);
        for (size_t i = 0; i < (size_t)rows * ldo; i++) res[i] = 0.01f * (float)((int)rng_below(&r, 2001) - 1000);
        for (int i = 0; i < rows; i++)
            for (int px = 0; px < total; px++) {
                float *o = ref + (size_t)i * ldo + px;
                const float v = *o + res[(size_t)i * ldo + px];
                *o = resmode == 2 && !(v > 0.0f) ? 0.0f : v;
            }
        g.res = res, g.res_relu = resmode == 2;
    }
    /* the codes wanted: plain (rows, ldo) and quads (quads, qplane) dwords, canaries where no output lands */
    uint8_t *plain_want = malloc((size_t)rows * ldo), *plain = malloc((size_t)rows * ldo);
    uint32_t *quad_want = malloc(quads * qplane * 4), *quad = malloc(quads * qplane * 4);
    memset(plain_want, CANARY, (size_t)rows * ldo), memset(quad_want, CANARY, quads * qplane * 4);
    bool finite = true;
    for (int i = 0; i < rows; i++)
        finite &= qgemm_quantize_u8_portable(plain_want + (size_t)i * ldo, ref + (size_t)i * ldo, (size_t)total, q.s,
                                             q.lo, q.hi, q.zero);
    for (size_t gq = 0; gq < quads; gq++)
        for (int px = 0; px < total; px++) {
            uint32_t d = 0;
            for (int k = 0; k < 4; k++) {
                const int i = 4 * (int)gq + k;
                d |= (uint32_t)(i < rows ? plain_want[(size_t)i * ldo + px] : (uint8_t)q.zero) << (8 * k);
            }
            quad_want[gq * qplane + (size_t)px] = d;
        }
    family_on(fam);
    const char *kernel = qgemm_kernel_name();
    int16_t *wide = NULL;
    const size_t wb = qgemm_taps_act_wide_bytes(&g);
    if (wb) wide = aligned_alloc(64, (wb + 63) / 64 * 64);
    g.act_wide = wide, g.out = tmp;
    bool ok[3] = {true, true, true}, floats[2] = {true, true};
    for (int form = 0; form < 3; form++) { /* plain codes with the floats too, quads, floats alone */
        if (form == 1) memset(quad, CANARY, quads * qplane * 4);
        else if (form == 0) memset(plain, CANARY, (size_t)rows * ldo);
        if (form != 1) memset(tmp, 0x5a, (size_t)rows * ldo * 4);
        const QGemmCodesOut co = {.q = q, .dst = form ? (uint8_t *)quad : plain, .quad_plane = form ? qplane : 0};
        g.codes = form == 2 ? NULL : &co, g.floats_too = form == 0;
        for (int rb = 0; rb < p.row_blocks; rb++) /* in pieces: row blocks, vectors split in two */
            ok[form] &= qgemm_taps(&g, rb, rb + 1, 0, n_vec / 2) & qgemm_taps(&g, rb, rb + 1, n_vec / 2, n_vec);
        if (form != 1) floats[form / 2] = !memcmp(tmp, ref, (size_t)rows * ldo * 4);
    }
    family_off();
    int bad = 0;
    if (nan_bias) {
        bad = ok[0] || ok[1] || !ok[2] || finite;
        if (bad) fprintf(stderr, "\n  %s taps codes: a NaN output not reported\n", kernel);
    } else {
        const bool pl = !memcmp(plain, plain_want, (size_t)rows * ldo) && ok[0];
        const bool qd = !memcmp(quad, quad_want, quads * qplane * 4) && ok[1];
        bad = !pl + !qd + !finite + !floats[0] + !floats[1] + !ok[2];
        if (bad)
            fprintf(stderr, "\n  %s taps codes: rows %d taps %d vectors %d stride %d zero %d%s%s%s: plain %s, quads %s, "
                    "floats with codes %s, floats alone %s\n", kernel, rows, taps, n_vec, stride, a_zero,
                    epi == QGEMM_EPI_RELU ? " relu" : "", half ? " halves" : "",
                    resmode ? resmode == 2 ? " residual + relu" : " residual" : "", pl ? "ok" : "DIFFER",
                    qd ? "ok" : "DIFFER", floats[0] ? "ok" : "DIFFER", floats[1] && ok[2] ? "ok" : "DIFFER");
    }
    qgemm_packed_taps_free(&p);
    free(off), free(act), free(w), free(scale), free(bias), free(mask), free(pos), free(ref), free(tmp), free(wide);
    free(res);
    free(plain_want), free(plain), free(quad_want), free(quad);
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
    static const char *const NAMES[] = {"AMX", "AVX-512 VNNI", "AVX-VNNI", "AVX2"};
    for (int i = 0; i < 4; i++) {
        if (!qgemm_cpu_has_isa(FAMILIES[i])) {
            test_skip("taps codes on %s: this CPU (or OS) has no %s", NAMES[i], NAMES[i]);
            continue;
        }
        cases_on(FAMILIES[i]);
    }
}

/* Which families quantize in the epilogue: the portable and AVX-512 VNNI kernels, never a pool. */
static void test_codes_direct(void) {
    QGemmPackedTaps p = {.rows = 8, .taps = 1, .row_blocks = 1};
    QGemmTaps g = {.w = &p, .epi = QGEMM_EPI_RELU};
    family_on(QGEMM_ISA_PORTABLE);
    CU_ASSERT(qgemm_taps_codes_direct(&g));
    g.epi = QGEMM_EPI_RELU_POOL2;
    CU_ASSERT_FALSE(qgemm_taps_codes_direct(&g));
    g.epi = QGEMM_EPI_NONE;
    family_off();
    if (qgemm_cpu_has_isa(QGEMM_ISA_AVX512_VNNI)) {
        family_on(QGEMM_ISA_AVX512_VNNI);
        CU_ASSERT(qgemm_taps_codes_direct(&g));
        family_off();
    }
    if (qgemm_cpu_has_isa(QGEMM_ISA_AVX2)) {
        family_on(QGEMM_ISA_AVX2);
        CU_ASSERT_FALSE(qgemm_taps_codes_direct(&g));
        family_off();
    }
}

int register_quant_taps_codes_suite(void) {
    CU_pSuite s = CU_add_suite("quant_taps_codes", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "taps codes: the portable kernel equals its floats quantized", test_codes_portable) ||
           !CU_add_test(s, "taps codes: every family equals the portable floats quantized", test_codes_families) ||
           !CU_add_test(s, "taps codes: the families that quantize in the epilogue", test_codes_direct);
}
