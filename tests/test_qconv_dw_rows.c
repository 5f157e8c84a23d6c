/* test_qconv_dw_rows.c - qgemm_dw with one output channel per input channel (in_plane > 0) and its outputs as the
 * reader's codes (QGemmCodesOut, plain and by channel quads): every kernel family against an int64 definition
 * and qgemm_quantize_u8_portable, bit for bit; the VNNI kernel with its rows in registers (3-row kernels of up to
 * 4 columns at stride 1: channel counts that leave 1 to 3 in the last quad, 1 to 3 column vectors, paddings 0 to
 * 2) and the shapes it leaves to the general kernels; quotients on a half, which take the division; a range of
 * channels from oc0 > 0; the reader's scale spanning the outputs (most codes round, some clamp); nothing written
 * past the floats, the plain codes or each quad's codes; a value that is not finite reported. The
 * quant_int8_dw_rows suite. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "quant/qgemm.h"
#include "test_int8.h"
#include "test_util.h"

typedef struct {
    int kh, kw, sh, h, w, pt, pl, n; /* kernel, stride (both axes), input, padding top and left, channels */
} RGeo;

/* out (n, oh, ow): channel i of act (n, h, w) by the definition, int64 sums, one fmaf, relu. */
static void definition(float *out, const uint8_t *act, const int8_t *w, const RGeo *g, int oh_n, int ow_n, int oc0,
                       int a_zero, const float *scale, const float *bias, bool relu) {
    for (int i = 0; i < g->n; i++)
        for (int oh = 0; oh < oh_n; oh++)
            for (int ow = 0; ow < ow_n; ow++) {
                const int oc = oc0 + i;
                int64_t s = 0;
                for (int r = 0; r < g->kh; r++)
                    for (int c = 0; c < g->kw; c++) {
                        const int ih = oh * g->sh + r - g->pt, iw = ow * g->sh + c - g->pl;
                        if (ih < 0 || ih >= g->h || iw < 0 || iw >= g->w) continue;
                        s += ((int64_t)act[((size_t)i * g->h + ih) * g->w + iw] - a_zero) *
                             w[((size_t)oc * g->kh + r) * g->kw + c];
                    }
                const float y = fmaf((float)(int32_t)s, scale[oc], bias ? bias[oc] : 0.0f);
                out[((size_t)i * oh_n + oh) * ow_n + ow] = !relu || y > 0.0f ? y : 0.0f;
            }
}

#define CANARY 0xA5

/* One geometry on one family: floats, plain codes and quads against the definition and the portable quantizer.
 * half: every channel's scale the same, no bias, and the reader's scale twice it, so every odd sum lies on a
 * half. Returns the number of mismatches (each printed). */
static int rows_case(const RGeo *g, int oc0, int a_zero, bool relu, bool bias, bool half, QGemmIsa fam, uint64_t seed) {
    const int oh_n = (g->h + 2 * g->pt - g->kh) / g->sh + 1, ow_n = (g->w + 2 * g->pl - g->kw) / g->sh + 1;
    const int C = oc0 + g->n, quads = (g->n + 3) / 4;
    const size_t P = (size_t)oh_n * ow_n, n_out = (size_t)g->n * P, qplane = P + 19; /* room past the codes */
    Rng r;
    rng_init(&r, seed, 0);
    int8_t *w = malloc((size_t)C * g->kh * g->kw);
    float *scale = malloc((size_t)C * sizeof *scale), *bi = malloc((size_t)C * sizeof *bi);
    uint8_t *act = malloc((size_t)g->n * g->h * g->w);
    /* halves: weights in -2..1 and codes within 3 of the zero point, so the sums stay inside the reader's bounds */
    for (size_t i = 0; i < (size_t)C * g->kh * g->kw; i++)
        w[i] = half ? (int8_t)((int)rng_below(&r, 4) - 2) : (int8_t)rng_below(&r, 256);
    for (int i = 0; i < C; i++)
        scale[i] = half ? 1e-3f : 1e-3f * (float)(1 + i % 5), bi[i] = 0.2f * (float)(i % 3) - 0.25f;
    for (size_t i = 0; i < (size_t)g->n * g->h * g->w; i++) {
        const int u = half ? a_zero + (int)rng_below(&r, 7) - 3 : (int)rng_below(&r, 256);
        act[i] = (uint8_t)(u < 0 ? 0 : u > 255 ? 255 : u);
    }
    QGemmPackedDw p;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_dw(&p, w, C, g->kh, g->kw, &err), QT_OK);
    /* 16 more floats and bytes than the outputs, canaries that must stay */
    float *want = malloc((n_out + 16) * sizeof *want), *got = malloc((n_out + 16) * sizeof *got);
    float *tmp = malloc(n_out * sizeof *tmp);
    memset(want, CANARY, (n_out + 16) * sizeof *want), memset(got, CANARY, (n_out + 16) * sizeof *got);
    definition(want, act, w, g, oh_n, ow_n, oc0, a_zero, scale, bias && !half ? bi : NULL, relu);
    float lo = 0.0f, hi = 0.0f;
    for (size_t i = 0; i < n_out; i++) lo = want[i] < lo ? want[i] : lo, hi = want[i] > hi ? want[i] : hi;
    const QGemmCodes q = {.s = half ? 2e-3f : (hi - lo) / 230.0f + 1e-6f, .lo = (float)-a_zero,
                          .hi = (float)(255 - a_zero), .zero = a_zero};
    uint8_t *plain_want = malloc(n_out + 16), *plain = malloc(n_out + 16);
    memset(plain_want, CANARY, n_out + 16);
    uint32_t *quad_want = malloc((size_t)quads * qplane * 4), *quad = malloc((size_t)quads * qplane * 4);
    CU_ASSERT_FATAL(qgemm_quantize_u8_portable(plain_want, want, n_out, q.s, q.lo, q.hi, q.zero));
    memset(quad_want, CANARY, (size_t)quads * qplane * 4);
    for (int gq = 0; gq < quads; gq++)
        for (size_t px = 0; px < P; px++) {
            uint32_t d = 0;
            for (int k = 0; k < 4; k++)
                d |= (uint32_t)(4 * gq + k < g->n ? plain_want[(size_t)(4 * gq + k) * P + px] : (uint8_t)q.zero) << (8 * k);
            quad_want[(size_t)gq * qplane + px] = d;
        }
    uint32_t *scratch = aligned_alloc(64, qgemm_dw_scratch(&p, oh_n, ow_n, g->sh)); /* exactly: a 64 multiple */
    QGemmDw d = {.act = act, .in_plane = (size_t)g->h * g->w, .in_h = g->h, .in_w = g->w, .pad_t = g->pt,
                 .pad_l = g->pl, .oh_n = oh_n, .ow_n = ow_n, .sh = g->sh, .sw = g->sh, .w = &p, .oc0 = oc0,
                 .n_oc = g->n, .a_zero = a_zero, .scale = scale, .bias = bias && !half ? bi : NULL, .relu = relu,
                 .scratch = scratch};
    test_int8_family_on(fam);
    const char *kernel = qgemm_kernel_name();
    d.out = got;
    const bool ok_f = qgemm_dw(&d);
    memset(plain, CANARY, n_out + 16);
    QGemmCodesOut co = {.q = q, .dst = plain, .quad_plane = 0};
    d.out = tmp, d.codes = &co;
    const bool ok_p = qgemm_dw(&d);
    memset(quad, CANARY, (size_t)quads * qplane * 4);
    co.dst = (uint8_t *)quad, co.quad_plane = qplane;
    const bool ok_q = qgemm_dw(&d);
    test_int8_family_off();
    const bool f = !memcmp(want, got, (n_out + 16) * sizeof *got), pl = !memcmp(plain_want, plain, n_out + 16);
    const bool qd = !memcmp(quad_want, quad, (size_t)quads * qplane * 4);
    if (!f || !pl || !qd || !ok_f || !ok_p || !ok_q)
        fprintf(stderr, "\n  %s: %dx%d stride %d input %dx%d pad [%d, %d] %d channels from %d, zero %d%s%s%s: floats %s, "
                "plain %s, quads %s\n", kernel, g->kh, g->kw, g->sh, g->h, g->w, g->pt, g->pl, g->n, oc0, a_zero,
                relu ? ", relu" : "", bias ? ", bias" : "", half ? ", halves" : "", f && ok_f ? "ok" : "DIFFER",
                pl && ok_p ? "ok" : "DIFFER", qd && ok_q ? "ok" : "DIFFER");
    const int bad = !f + !pl + !qd + !ok_f + !ok_p + !ok_q;
    free(w), free(scale), free(bi), free(act), free(want), free(got), free(tmp), free(plain_want), free(plain);
    free(quad_want), free(quad), free(scratch);
    qgemm_packed_dw_free(&p);
    return bad;
}

static const RGeo GEOS[] = {
    {3, 3, 1, 14, 14, 1, 1, 64}, {3, 3, 1, 14, 14, 1, 1, 5}, {3, 3, 1, 13, 13, 1, 1, 6}, {3, 3, 1, 28, 28, 0, 0, 7},
    {3, 3, 1, 9, 33, 2, 3, 3},   {3, 3, 1, 1, 1, 1, 1, 2},   {3, 1, 1, 7, 20, 1, 0, 9},  {3, 4, 1, 6, 16, 2, 2, 4},
    {3, 2, 1, 5, 47, 0, 1, 1},   {3, 3, 1, 3, 17, 0, 0, 4},
    /* the shapes the rows kernel leaves to the general ones; strided ones that leave the input's last row unread
     * (the 256-bit kernel's rows end before the input's), and stride 3 (the portable kernel under the 256-bit one) */
    {3, 3, 2, 14, 14, 1, 1, 5},  {5, 5, 1, 9, 9, 2, 2, 3},   {1, 1, 1, 4, 20, 0, 0, 6},  {3, 5, 1, 6, 12, 1, 2, 2},
    {3, 3, 2, 16, 32, 0, 0, 3},  {3, 3, 3, 11, 17, 0, 1, 2}, {3, 3, 3, 10, 10, 1, 1, 2},
};

static void rows_on(QGemmIsa fam) {
    uint64_t seed = 900;
    int bad = 0;
    for (size_t i = 0; i < sizeof GEOS / sizeof *GEOS; i++)
        for (int k = 0; k < 4; k++)
            bad += rows_case(&GEOS[i], k == 2 ? 3 : 0, k == 0 ? 0 : 37 * k, k & 1, k < 2, false, fam, seed++);
    for (size_t i = 0; i < sizeof GEOS / sizeof *GEOS; i += 3) bad += rows_case(&GEOS[i], 0, 20, true, false, true, fam, seed++);
    CU_ASSERT_EQUAL(bad, 0);
}

static void test_rows_portable(void) { rows_on(QGEMM_ISA_PORTABLE); }

static void test_rows_vnni(void) {
    test_int8_on_families(rows_on, (const QGemmIsa[]){QGEMM_ISA_AVX512_VNNI}, 1, "the depthwise rows kernel");
}

static void test_rows_256(void) {
    test_int8_on_families(rows_on, (const QGemmIsa[]){QGEMM_ISA_AVXVNNI, QGEMM_ISA_AVX2}, 2, "depthwise codes");
}

/* An output past float's range: false with codes on every family, true (the infinity written) with floats. */
static void test_rows_not_finite(void) {
    const int8_t w[9] = {127, 127, 127, 127, 127, 127, 127, 127, 127};
    uint8_t act[16 * 16];
    memset(act, 255, sizeof act);
    QGemmPackedDw p;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_dw(&p, w, 1, 3, 3, &err), QT_OK);
    const float scale = 3e38f;
    float out[16 * 16];
    uint8_t codes[16 * 16];
    uint32_t *scratch = aligned_alloc(64, qgemm_dw_scratch(&p, 16, 16, 1) + 64);
    const QGemmCodesOut co = {.q = {.s = 0.1f, .lo = 0.0f, .hi = 255.0f, .zero = 0}, .dst = codes};
    QGemmDw d = {.act = act, .in_plane = sizeof act, .in_h = 16, .in_w = 16, .pad_t = 1, .pad_l = 1, .oh_n = 16,
                 .ow_n = 16, .sh = 1, .sw = 1, .w = &p, .n_oc = 1, .out = out, .scale = &scale, .relu = true,
                 .scratch = scratch};
    static const QGemmIsa FAMILIES[] = {QGEMM_ISA_PORTABLE, QGEMM_ISA_AVX2, QGEMM_ISA_AVX512_VNNI};
    for (int i = 0; i < 3; i++) {
        if (FAMILIES[i] != QGEMM_ISA_PORTABLE && !qgemm_cpu_has_isa(FAMILIES[i])) continue; /* the tests above skip */
        test_int8_family_on(FAMILIES[i]);
        d.codes = NULL;
        CU_ASSERT(qgemm_dw(&d) && isinf(out[17]));
        d.codes = &co;
        CU_ASSERT_FALSE(qgemm_dw(&d));
        test_int8_family_off();
    }
    free(scratch);
    qgemm_packed_dw_free(&p);
}

int register_quant_int8_dw_rows_suite(void) {
    CU_pSuite s = CU_add_suite("quant_int8_dw_rows", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "depthwise codes: the portable kernel equals the definition", test_rows_portable) ||
           !CU_add_test(s, "depthwise codes: the VNNI kernels equal the definition", test_rows_vnni) ||
           !CU_add_test(s, "depthwise codes: the AVX-VNNI and AVX2 kernels equal the definition", test_rows_256) ||
           !CU_add_test(s, "depthwise codes: a value not finite is reported", test_rows_not_finite);
}
