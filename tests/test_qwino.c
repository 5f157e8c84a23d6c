/* test_qwino.c - the quant_qwino suite: the int8 3x3 stride-1 convolution as F(2x2, 3x3) in integers
 * (quant/qwino.h). Its definition and its AVX2 kernel (a visible skip without AVX2) give exactly the direct sums of
 * code products, those qgemm_s8_nn gives QT's forward: on planes from 1x1 to 28x28 and 17x33, 8 to 64 channels
 * (odd counts: a last pair with one channel), 4 to 64 output rows off the blocks of 4, codes over the whole int8
 * range and at its ends (-128, 127, random signs), QWINO_C_MAX channels (exact there; random signs keep the sums far
 * from the int32 bound, which qwino.h derives), an output row stride past the plane whose gap floats are left
 * alone, and the input's last row read without a byte past it. Also which convs take it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "nn/conv_wino.h"
#include "quant/qgemm.h"
#include "quant/qwino.h"
#include "test_util.h"

typedef struct {
    int C, out, H, W;
} QwCase;

static const QwCase cases[] = {
    {8, 4, 1, 1},   {8, 4, 2, 2},    {9, 5, 5, 13},  {16, 16, 28, 28}, {32, 64, 14, 14}, {64, 64, 7, 7},
    {33, 7, 3, 1},  {8, 9, 17, 33},  {12, 4, 1, 40}, {11, 13, 30, 30}, {10, 6, 16, 16},  {8, 8, 18, 18},
};

/* Codes drawn over [-128, 127]; extreme: every code -128 or 127 (the largest sums of each sign). */
static int8_t *codes(size_t n, uint64_t seed, bool extreme) {
    int8_t *c = malloc(n ? n : 1);
    uint32_t *u = malloc((n ? n : 1) * sizeof *u);
    Rng r;
    rng_init(&r, seed, 0);
    rng_fill_u32(&r, u, n);
    for (size_t i = 0; i < n; i++) c[i] = extreme ? (u[i] & 1 ? 127 : -128) : (int8_t)(u[i] & 0xff);
    free(u);
    return c;
}

/* acc (out, ldc) = the direct sums, in int64 (an overflow of the int32 forms would show). */
static void direct(int64_t *acc, size_t ldc, const QwCase *k, const int8_t *x, const int8_t *w) {
    for (int r = 0; r < k->out; r++)
        for (int h = 0; h < k->H; h++)
            for (int c0 = 0; c0 < k->W; c0++) {
                int64_t s = 0;
                for (int c = 0; c < k->C; c++)
                    for (int t = 0; t < 9; t++) {
                        const int hh = h + t / 3 - 1, ww = c0 + t % 3 - 1;
                        if (hh >= 0 && ww >= 0 && hh < k->H && ww < k->W)
                            s += (int64_t)w[((size_t)r * k->C + c) * 9 + t] * x[((size_t)c * k->H + hh) * k->W + ww];
                    }
                acc[(size_t)r * ldc + (size_t)h * k->W + c0] = s;
            }
}

/* Whether acc (int32) holds the direct sums in every output float, and the sentinel in every gap. */
static bool holds(const int32_t *acc, const int64_t *want, const QwCase *k, size_t ldc) {
    for (int r = 0; r < k->out; r++)
        for (size_t i = 0; i < ldc; i++) {
            const size_t at = (size_t)r * ldc + i;
            if (i < (size_t)k->H * k->W ? acc[at] != want[at] : acc[at] != 0x5a5a5a5a) return false;
        }
    return true;
}

static void check_case(const QwCase *k, bool extreme, uint64_t seed, bool vector) {
    QWino p;
    qwino_plan(&p, k->C, k->H, k->W);
    const size_t plane = (size_t)k->H * k->W, ldc = plane + 3, nx = (size_t)k->C * plane;
    int8_t *x = codes(nx, seed, extreme), *w = codes((size_t)k->out * k->C * 9, seed + 1, extreme);
    int32_t *wp = malloc(qwino_packed_words(&p, k->out) * sizeof *wp);
    int32_t *acc = malloc((size_t)k->out * ldc * sizeof *acc);
    int64_t *want = malloc((size_t)k->out * ldc * sizeof *want);
    void *scratch = malloc(qwino_scratch_bytes(&p));
    memset(acc, 0x5a, (size_t)k->out * ldc * sizeof *acc);
    qwino_pack(&p, wp, w, k->out);
    if (vector) qwino_forward_avx2(&p, acc, ldc, x, wp, k->out, scratch);
    else qwino_forward_ref(&p, acc, ldc, x, wp, k->out);
    direct(want, ldc, k, x, w);
    const bool ok = holds(acc, want, k, ldc);
    if (!ok)
        fprintf(stderr, "\n  %s%s: C=%d out=%d %dx%d", vector ? "avx2" : "definition", extreme ? ", extreme codes" : "",
                k->C, k->out, k->H, k->W);
    CU_ASSERT(ok);
    free(x), free(w), free(wp), free(acc), free(want), free(scratch);
}

/* The definition and the AVX2 kernel give the direct sums. */
static void test_qwino_exact(void) {
    const bool avx2 = qgemm_cpu_has_isa(QGEMM_ISA_AVX2);
    if (!avx2) test_skip("qwino avx2 kernel: this CPU has no AVX2 with FMA");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int extreme = 0; extreme < 2; extreme++)
            for (int vector = 0; vector <= (int)avx2; vector++) check_case(&cases[i], extreme, 60 + i, vector);
    /* QWINO_C_MAX channels of extreme codes (random signs: not the bound's worst case) */
    const QwCase big = {QWINO_C_MAX, 5, 4, 6};
    for (int vector = 0; vector <= (int)avx2; vector++) check_case(&big, true, 99, vector);
}

/* PTQ's form: ch4 planes of uint8 codes (rows Wp >= W + 2 dwords apart, a zero point around the image and in the
 * columns past it, each group's plane exactly its rows; or, unpadded, a producer's hand-off: the image alone, rows
 * W + wide apart, the buffer exactly the planes) to floats with the taps kernels' epilogue. The AVX2 kernel gives
 * the definition's bits, and the definition the direct sums through the same fmaf, relu and 2x2 max. */
static void floats_case(const QwCase *k, int zero, int wide, QGemmEpi epi, uint64_t seed, bool vector, bool unpadded) {
    QWino p;
    qwino_plan(&p, k->C, k->H, k->W);
    const int Wp = k->W + 2 + wide, Hp = k->H + 2, groups = (k->C + 3) / 4;
    const size_t plane = (size_t)Hp * Wp;
    uint32_t *planes = malloc(groups * plane * sizeof *planes);
    int8_t *noise = codes(groups * plane * 4, seed, false), *w = codes((size_t)k->out * k->C * 9, seed + 1, false);
    for (size_t d = 0; d < groups * plane; d++) {
        const int row = (int)(d % plane / (size_t)Wp), col = (int)(d % plane % (size_t)Wp);
        const bool inside = row >= 1 && row <= k->H && col >= 1 && col <= k->W;
        uint32_t v = 0;
        for (int b = 0; b < 4; b++) {
            const int c = (int)(d / plane) * 4 + b;
            const uint8_t code = inside && c < k->C ? (uint8_t)noise[d * 4 + b] : (uint8_t)zero;
            v |= (uint32_t)code << (8 * b);
        }
        planes[d] = v;
    }
    float *scale = malloc(k->out * sizeof *scale), *bias = malloc(k->out * sizeof *bias);
    for (int r = 0; r < k->out; r++) scale[r] = 1e-3f * (float)(r + 1), bias[r] = 0.05f * (float)(r % 5) - 0.1f;
    const bool pool = epi == QGEMM_EPI_RELU_POOL2;
    const size_t ldo = pool ? (size_t)(k->H / 2) * (k->W / 2) : (size_t)k->H * k->W, ny = (size_t)k->out * ldo;
    float *y = malloc((ny ? ny : 1) * sizeof *y), *want = malloc((ny ? ny : 1) * sizeof *want);
    for (size_t i = 0; i < ny; i++) y[i] = NAN;
    int32_t *wp = malloc(qwino_packed_words(&p, k->out) * sizeof *wp);
    qwino_pack(&p, wp, w, k->out);
    QWinoCh4 a = {.planes = planes, .plane = plane, .Wp = Wp, .zero = zero};
    const int Wu = k->W + wide; /* unpadded: the image's rows, Wu dwords apart, its planes back to back */
    const size_t uplane = (size_t)(k->H - 1) * Wu + k->W;
    uint32_t *quads = unpadded ? malloc(groups * uplane * sizeof *quads) : NULL;
    if (unpadded) {
        for (int g = 0; g < groups; g++)
            for (int h = 0; h < k->H; h++)
                for (int c0 = 0; c0 < Wu && (size_t)h * Wu + c0 < uplane; c0++) /* past a row: never read */
                    quads[g * uplane + (size_t)h * Wu + c0] =
                        c0 < k->W ? planes[g * plane + (size_t)(h + 1) * Wp + c0 + 1] : 0xdeadbeefu;
        a = (QWinoCh4){.planes = quads, .plane = uplane, .Wp = Wu, .zero = zero, .origin = 1};
    }
    const QWinoFloats f = {.out = y, .ldo = ldo, .scale = scale, .bias = bias, .relu = epi != QGEMM_EPI_NONE,
                           .pool = pool};
    void *scratch = malloc(qwino_scratch_bytes(&p));
    if (vector) qwino_floats_avx2(&p, &f, &a, wp, k->out, scratch);
    else qwino_floats_ref(&p, &f, &a, wp, k->out);
    /* the direct sums through the epilogue */
    for (int r = 0; r < k->out; r++)
        for (int h = 0; h < k->H; h++)
            for (int c0 = 0; c0 < k->W; c0++) {
                int32_t sum = 0;
                for (int c = 0; c < k->C; c++)
                    for (int t = 0; t < 9; t++) {
                        const uint32_t d = planes[(size_t)(c / 4) * plane + (size_t)(h + t / 3) * Wp + c0 + t % 3];
                        sum += w[((size_t)r * k->C + c) * 9 + t] * ((int32_t)(d >> (8 * (c % 4)) & 0xff) - zero);
                    }
                float v = fmaf((float)sum, scale[r], bias[r]);
                if (epi != QGEMM_EPI_NONE) v = v > 0.0f ? v : 0.0f;
                if (!pool) {
                    want[(size_t)r * ldo + (size_t)h * k->W + c0] = v;
                } else if (h < k->H / 2 * 2 && c0 < k->W / 2 * 2) {
                    float *o = want + (size_t)r * ldo + (size_t)(h / 2) * (k->W / 2) + c0 / 2;
                    *o = h % 2 == 0 && c0 % 2 == 0 ? v : (v > *o ? v : *o);
                }
            }
    const bool ok = ny == 0 || !memcmp(y, want, ny * sizeof *y);
    if (!ok)
        fprintf(stderr, "\n  %s floats: C=%d out=%d %dx%d zero %d, Wp + %d, epilogue %d%s",
                vector ? "avx2" : "definition", k->C, k->out, k->H, k->W, zero, wide, (int)epi,
                unpadded ? ", unpadded" : "");
    CU_ASSERT(ok);
    free(planes), free(noise), free(w), free(scale), free(bias), free(y), free(want), free(wp), free(scratch);
    free(quads);
}

static void test_qwino_floats(void) {
    const bool avx2 = qgemm_cpu_has_isa(QGEMM_ISA_AVX2);
    if (!avx2) test_skip("qwino avx2 floats: this CPU has no AVX2 with FMA");
    static const QwCase fc[] = {{8, 4, 2, 2}, {9, 5, 5, 13}, {16, 16, 28, 28}, {32, 12, 14, 14},
                                {12, 7, 7, 7}, {8, 9, 17, 33}, {10, 4, 1, 40}};
    uint64_t seed = 700;
    for (size_t i = 0; i < sizeof fc / sizeof *fc; i++)
        for (int e = 0; e < 3; e++)
            for (int vector = 0; vector <= (int)avx2; vector++)
                for (int unpadded = 0; unpadded < 2; unpadded++)
                    floats_case(&fc[i], e == 1 ? 0 : 131, (int)(i % 3) * 5, (QGemmEpi)e, seed++, vector, unpadded);
    /* the longest exact sums: QWINO_U8_C_MAX channels */
    const QwCase big = {QWINO_U8_C_MAX, 5, 4, 6};
    for (int vector = 0; vector <= (int)avx2; vector++)
        for (int unpadded = 0; unpadded < 2; unpadded++)
            floats_case(&big, 255, 3, QGEMM_EPI_NONE, 99, vector, unpadded);
}

/* QT's convs take it on the AVX2 family only, 3x3 at stride 1 with padding 1, 8 to QWINO_C_MAX channels, 4 or
 * more outputs, with QTRAIN_CONV_WINOGRAD on. */
static void test_qwino_fits(void) {
    if (!qgemm_cpu_has_isa(QGEMM_ISA_AVX2)) {
        test_skip("qwino_fits at the avx2 family: this CPU has no AVX2 with FMA");
        return;
    }
    qgemm_force_isa = QGEMM_ISA_AVX2;
    CU_ASSERT(qwino_fits(8, 4, 3, 3, 1, 1));
    CU_ASSERT(qwino_fits(QWINO_C_MAX, 64, 3, 3, 1, 1));
    CU_ASSERT_FALSE(qwino_fits(QWINO_C_MAX + 1, 64, 3, 3, 1, 1));
    CU_ASSERT_FALSE(qwino_fits(7, 64, 3, 3, 1, 1));
    CU_ASSERT_FALSE(qwino_fits(16, 3, 3, 3, 1, 1));
    CU_ASSERT_FALSE(qwino_fits(16, 16, 3, 3, 2, 1));
    CU_ASSERT_FALSE(qwino_fits(16, 16, 3, 3, 1, 0));
    CU_ASSERT_FALSE(qwino_fits(16, 16, 5, 5, 1, 2));
    const bool saved = conv_wino_enabled;
    conv_wino_enabled = false;
    CU_ASSERT_FALSE(qwino_fits(16, 16, 3, 3, 1, 1));
    conv_wino_enabled = saved;
    qgemm_force_isa = -1;
    static const QGemmIsa others[] = {QGEMM_ISA_AVXVNNI, QGEMM_ISA_AVX512_VNNI, QGEMM_ISA_AMX};
    for (size_t i = 0; i < 3; i++) {
        if (!qgemm_cpu_has_isa(others[i])) continue;
        qgemm_force_isa = (int)others[i];
        CU_ASSERT_FALSE(qwino_fits(16, 16, 3, 3, 1, 1));
    }
    qgemm_force_isa = -1;
    qgemm_force_portable = true;
    CU_ASSERT_FALSE(qwino_fits(16, 16, 3, 3, 1, 1));
    qgemm_force_portable = false;
}

int register_quant_qwino_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qwino", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "the definition and the AVX2 kernel give the direct sums", test_qwino_exact) ||
                   !CU_add_test(s, "PTQ's form: ch4 codes to the taps' floats, bit for bit", test_qwino_floats) ||
                   !CU_add_test(s, "which convs take it", test_qwino_fits)
               ? -1
               : 0;
}
