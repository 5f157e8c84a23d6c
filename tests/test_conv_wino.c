/* test_conv_wino.c - the nn_conv_wino suite: the 3x3 stride-1 convolution as Winograd's F(2x2, 3x3)
 * (nn/conv_wino.h). Its vector kernels give the plain C definition's bits on every level the CPU has (a visible
 * skip for each it lacks), written and added, touching nothing outside the output planes; the definition agrees
 * with direct double-precision loops for the forward, the input gradient (the flipped, transposed pack) and the
 * weight gradient; and
 * nn_conv2d_fused gives the same outputs and gradients with it as without it (the taps kernels, conv_taps.h),
 * within the tolerances of test_conv_taps.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/conv_wino.h"
#include "nn/ops.h"
#include "test_conv_pair.h"
#include "test_util.h"

typedef struct {
    int C, R, H, W; /* channels in, rows (channels) out, plane */
    int gx, gy;     /* floats between planes past H W: x's and y's */
} WinoCase;

/* Planes of 1x1 and 2x2 (one tile, mostly padding), odd sizes (a last tile half outside), ResNet-8's three stages
 * and the CNN's second conv, tile rows of up to half a 16-lane vector (the transforms at 8 lanes under AVX-512:
 * TW = 8 at 16x16) and just past it (TW = 9), of several vectors (7x33, 2x40: TW 17, 20), rows and channels off
 * the blocks (1, 5, 9, 13, 17 rows; 9, 11, 33 channels), and gaps between planes. */
static const WinoCase cases[] = {
    {8, 8, 1, 1, 0, 0},    {8, 8, 2, 2, 1, 3},     {9, 5, 3, 5, 0, 2},     {16, 16, 28, 28, 0, 0},
    {32, 32, 14, 14, 3, 0}, {64, 64, 7, 7, 0, 5},  {32, 64, 14, 14, 0, 0}, {33, 17, 5, 13, 2, 1},
    {8, 12, 8, 10, 0, 0},  {10, 9, 15, 17, 1, 1},  {8, 8, 7, 33, 0, 4},    {12, 1, 2, 40, 0, 0},
    {11, 13, 30, 30, 0, 0}, {8, 20, 16, 16, 5, 0}, {9, 8, 18, 18, 0, 1},
};
#define N_CASES (sizeof cases / sizeof cases[0])

static size_t plane(const WinoCase *k) { return (size_t)k->H * k->W; }
static size_t ldx(const WinoCase *k, bool t) { return plane(k) + (size_t)(t ? k->gy : k->gx); }
static size_t ldy(const WinoCase *k, bool t) { return plane(k) + (size_t)(t ? k->gx : k->gy); }
/* Floats of n planes ld apart, exactly: a kernel reading or writing past the last plane trips the sanitizer. */
static size_t planes_floats(const WinoCase *k, int n, size_t ld) { return (size_t)(n - 1) * ld + plane(k); }

static void print_case(const char *what, const WinoCase *k, ConvTapsLevel level) {
    fprintf(stderr, "\n  %s (%s): C=%d rows=%d H=%d W=%d gaps %d, %d", what, conv_taps_level_name(level), k->C, k->R,
            k->H, k->W, k->gx, k->gy);
}

/* Written outputs start as NaN (whatever was there is gone); added-to ones as values that differ float to float;
 * the gaps between planes as a value no output takes. */
static void fill_y(float *y, const WinoCase *k, int rows, size_t ld, bool add) {
    for (size_t i = 0; i < planes_floats(k, rows, ld); i++)
        y[i] = i % ld >= plane(k) ? 1234.5f : add ? 0.25f * (float)((i * 37) % 17) - 2.0f : NAN;
}

/* The forward (t false: rows R of C channels, conv_wino_pack) or the input gradient (t true: rows C of R
 * channels, conv_wino_pack_t) of case k at level, into y; vector false: the definition. */
static void wino_run(const WinoCase *k, ConvTapsLevel level, bool vector, bool t, bool add, const float *x,
                     const float *w, float *y) {
    ConvWino p;
    conv_wino_plan(&p, level, k->H, k->W);
    const int rows = t ? k->C : k->R, channels = t ? k->R : k->C;
    float *wp = malloc(conv_wino_packed_floats(&p, rows, channels) * sizeof(float));
    float *scratch = malloc(conv_wino_scratch_floats(&p, channels) * sizeof(float));
    if (t) conv_wino_pack_t(&p, wp, w, k->C * 9, k->C, k->R);
    else conv_wino_pack(&p, wp, w, k->C * 9, k->R, k->C);
    if (vector) conv_wino_forward(&p, level, y, ldy(k, t), x, ldx(k, t), wp, rows, channels, add, scratch);
    else conv_wino_forward_ref(&p, y, ldy(k, t), x, ldx(k, t), wp, rows, channels, add);
    free(wp), free(scratch);
}

/* Every vector level's kernel gives the definition's bits, forward and input gradient, written and added; the
 * floats between output planes keep theirs. */
static void test_wino_kernels_match_ref_bits(void) {
    static const ConvTapsLevel levels[] = {CONV_TAPS_AVX2, CONV_TAPS_AVX512};
    for (size_t li = 0; li < 2; li++) {
        const ConvTapsLevel level = levels[li];
        if (conv_taps_cpu() < level) {
            test_skip("conv_wino %s kernel: this CPU has no %s", conv_taps_level_name(level),
                      level == CONV_TAPS_AVX512 ? "AVX-512F" : "AVX2 with FMA");
            continue;
        }
        for (size_t i = 0; i < N_CASES; i++)
            for (int t = 0; t < 2; t++)
                for (int add = 0; add < 2; add++) {
                    const WinoCase *k = &cases[i];
                    const int in = t ? k->R : k->C, out = t ? k->C : k->R;
                    const size_t nx = planes_floats(k, in, ldx(k, t)), ny = planes_floats(k, out, ldy(k, t));
                    float *x = test_random_uniform(nx, 11 + i, -1.0f, 1.0f);
                    float *w = test_random_uniform((size_t)k->R * k->C * 9, 12 + i, -1.0f, 1.0f);
                    float *y = malloc(ny * sizeof(float)), *y_ref = malloc(ny * sizeof(float));
                    fill_y(y, k, out, ldy(k, t), add), fill_y(y_ref, k, out, ldy(k, t), add);
                    wino_run(k, level, true, t, add, x, w, y);
                    wino_run(k, level, false, t, add, x, w, y_ref);
                    const bool same = memcmp(y, y_ref, ny * sizeof(float)) == 0;
                    if (!same) print_case(t ? (add ? "input gradient, added" : "input gradient")
                                            : (add ? "forward, added" : "forward"), k, level);
                    CU_ASSERT(same);
                    free(x), free(w), free(y), free(y_ref);
                }
    }
}

/* conv_wino_forward_again: a second product of the same input (the low-rank term's A x), from the transform the
 * forward left in the scratch, gives the definition's bits, as written after a forward with other weights. */
static void test_wino_again_matches_ref_bits(void) {
    static const ConvTapsLevel levels[] = {CONV_TAPS_AVX2, CONV_TAPS_AVX512};
    for (size_t li = 0; li < 2; li++) {
        const ConvTapsLevel level = levels[li];
        if (conv_taps_cpu() < level) {
            test_skip("conv_wino %s second product: this CPU has no %s", conv_taps_level_name(level),
                      level == CONV_TAPS_AVX512 ? "AVX-512F" : "AVX2 with FMA");
            continue;
        }
        for (size_t i = 0; i < N_CASES; i++) {
            const WinoCase *k = &cases[i];
            const int rows2 = k->R > 9 ? 9 : k->R; /* a rank's rows */
            ConvWino p;
            conv_wino_plan(&p, level, k->H, k->W);
            const size_t ly = ldy(k, false), ny = planes_floats(k, k->R, ly), ny2 = planes_floats(k, rows2, ly);
            float *x = test_random_uniform(planes_floats(k, k->C, ldx(k, false)), 51 + i, -1.0f, 1.0f);
            float *w = test_random_uniform((size_t)k->R * k->C * 9, 52 + i, -1.0f, 1.0f);
            float *w2 = test_random_uniform((size_t)rows2 * k->C * 9, 53 + i, -1.0f, 1.0f);
            float *wp = malloc(conv_wino_packed_floats(&p, k->R, k->C) * sizeof(float));
            float *wp2 = malloc(conv_wino_packed_floats(&p, rows2, k->C) * sizeof(float));
            float *scratch = malloc(conv_wino_scratch_floats(&p, k->C) * sizeof(float));
            float *y = malloc(ny * sizeof(float)), *y2 = malloc(ny2 * sizeof(float)), *y2_ref = malloc(ny2 * 4);
            conv_wino_pack(&p, wp, w, k->C * 9, k->R, k->C);
            conv_wino_pack(&p, wp2, w2, k->C * 9, rows2, k->C);
            fill_y(y2, k, rows2, ly, false), fill_y(y2_ref, k, rows2, ly, false);
            conv_wino_forward(&p, level, y, ly, x, ldx(k, false), wp, k->R, k->C, false, scratch);
            conv_wino_forward_again(&p, level, y2, ly, x, ldx(k, false), wp2, rows2, k->C, false, scratch);
            conv_wino_forward_ref(&p, y2_ref, ly, x, ldx(k, false), wp2, rows2, k->C, false);
            const bool same = memcmp(y2, y2_ref, ny2 * sizeof(float)) == 0;
            if (!same) print_case("second product", k, level);
            CU_ASSERT(same);
            free(x), free(w), free(w2), free(wp), free(wp2), free(scratch), free(y), free(y2), free(y2_ref);
        }
    }
}

/* dpt (H W, ldd) = k's output gradient for R channels transposed, zeros past R (as conv_taps_dp_t makes it). */
static float *grad_t(const WinoCase *k, uint64_t seed) {
    const size_t ldd = conv_taps_oc_pad(k->R);
    float *dp = test_random_uniform(plane(k) * k->R, seed, -1.0f, 1.0f), *dpt = malloc(plane(k) * ldd * sizeof(float));
    for (size_t q = 0; q < plane(k); q++)
        for (size_t r = 0; r < ldd; r++) dpt[q * ldd + r] = r < (size_t)k->R ? dp[r * plane(k) + q] : 0.0f;
    free(dp);
    return dpt;
}

/* The weight gradient of case k (C channels in, R out) at level into dwt (C 9, conv_taps_oc_pad(R)); vector false:
 * the definition. */
static void wino_dw_run(const WinoCase *k, ConvTapsLevel level, bool vector, bool add, const float *x,
                        const float *dpt, float *dwt) {
    ConvWino p;
    conv_wino_plan(&p, level, k->H, k->W);
    float *scratch = malloc(conv_wino_dw_scratch_floats(&p, k->C, k->R) * sizeof(float));
    if (vector) conv_wino_dw(&p, level, dwt, dpt, x, ldx(k, false), k->C, k->R, add, scratch);
    else conv_wino_dw_ref(&p, dwt, dpt, x, ldx(k, false), k->C, k->R, add);
    free(scratch);
}

/* The weight gradient's vector kernels give the definition's bits, written (NaN before) and added, in every
 * column (those past R: sums of zeros). */
static void test_wino_dw_kernels_match_ref_bits(void) {
    static const ConvTapsLevel levels[] = {CONV_TAPS_AVX2, CONV_TAPS_AVX512};
    for (size_t li = 0; li < 2; li++) {
        const ConvTapsLevel level = levels[li];
        if (conv_taps_cpu() < level) {
            test_skip("conv_wino %s weight gradient: this CPU has no %s", conv_taps_level_name(level),
                      level == CONV_TAPS_AVX512 ? "AVX-512F" : "AVX2 with FMA");
            continue;
        }
        for (size_t i = 0; i < N_CASES; i++)
            for (int add = 0; add < 2; add++) {
                const WinoCase *k = &cases[i];
                const size_t nw = (size_t)k->C * 9 * conv_taps_oc_pad(k->R);
                float *x = test_random_uniform(planes_floats(k, k->C, ldx(k, false)), 31 + i, -1.0f, 1.0f);
                float *dpt = grad_t(k, 32 + i);
                float *dw = malloc(nw * sizeof(float)), *dw_ref = malloc(nw * sizeof(float));
                for (size_t n = 0; n < nw; n++) dw[n] = dw_ref[n] = add ? 0.25f * (float)((n * 37) % 17) - 2.0f : NAN;
                wino_dw_run(k, level, true, add, x, dpt, dw);
                wino_dw_run(k, level, false, add, x, dpt, dw_ref);
                const bool same = memcmp(dw, dw_ref, nw * sizeof(float)) == 0;
                if (!same) print_case(add ? "weight gradient, added" : "weight gradient", k, level);
                CU_ASSERT(same);
                free(x), free(dpt), free(dw), free(dw_ref);
            }
    }
}

/* The weight gradient's definition against direct loops in double, dw[r][c][kh][kw] = the sum over the plane of
 * dp[r](h, w) x[c](h + kh - 1, w + kw - 1), within 2e-7 per product. */
static void test_wino_dw_ref_matches_direct(void) {
    for (size_t i = 0; i < N_CASES; i++) {
        const WinoCase *k = &cases[i];
        const size_t ldd = conv_taps_oc_pad(k->R), nw = (size_t)k->C * 9 * ldd, lx = ldx(k, false);
        float *x = test_random_uniform(planes_floats(k, k->C, lx), 41 + i, -1.0f, 1.0f);
        float *dpt = grad_t(k, 42 + i);
        float *dw = malloc(nw * sizeof(float)), *dw_dir = malloc(nw * sizeof(float));
        wino_dw_run(k, CONV_TAPS_OFF, false, false, x, dpt, dw);
        for (int c = 0; c < k->C; c++)
            for (int t = 0; t < 9; t++)
                for (size_t r = 0; r < ldd; r++) {
                    double s = 0.0;
                    for (int h = 0; h < k->H; h++)
                        for (int w = 0; w < k->W; w++) {
                            const int hh = h + t / 3 - 1, ww = w + t % 3 - 1;
                            if (hh < 0 || ww < 0 || hh >= k->H || ww >= k->W) continue;
                            s += (double)dpt[((size_t)h * k->W + w) * ldd + r] *
                                 x[(size_t)c * lx + (size_t)hh * k->W + ww];
                        }
                    dw_dir[((size_t)c * 9 + t) * ldd + r] = (float)s;
                }
        const double worst = test_close_ratio(dw, dw_dir, nw, 2e-7 * (double)plane(k) + 1e-7, 0.0, NULL);
        if (worst > 1.0) print_case("weight gradient vs direct", k, CONV_TAPS_OFF);
        CU_ASSERT(worst <= 1.0);
        free(x), free(dpt), free(dw), free(dw_dir);
    }
}

/* The definition against direct loops in double: the forward y[r] = sum over c, (kh, kw) of w[r][c][kh][kw]
 * x[c](h + kh - 1, w + kw - 1), and the input gradient dx[c] = sum over r, (kh, kw) of w[r][c][kh][kw] dp[r](h -
 * kh + 1, w - kw + 1), within 2e-7 per summed term (inputs in [-1, 1]; F(2x2, 3x3) rounds its transforms too). */
static void test_wino_ref_matches_direct(void) {
    for (size_t i = 0; i < N_CASES; i++)
        for (int t = 0; t < 2; t++) {
            const WinoCase *k = &cases[i];
            const int in = t ? k->R : k->C, out = t ? k->C : k->R;
            const size_t lx = ldx(k, t), ly = ldy(k, t), ny = planes_floats(k, out, ly);
            float *x = test_random_uniform(planes_floats(k, in, lx), 21 + i, -1.0f, 1.0f);
            float *w = test_random_uniform((size_t)k->R * k->C * 9, 22 + i, -1.0f, 1.0f);
            float *y = malloc(ny * sizeof(float)), *y_dir = malloc(ny * sizeof(float));
            fill_y(y, k, out, ly, false);
            wino_run(k, CONV_TAPS_OFF, false, t, false, x, w, y);
            memcpy(y_dir, y, ny * sizeof(float)); /* the gaps as written */
            for (int o = 0; o < out; o++)
                for (int h = 0; h < k->H; h++)
                    for (int c = 0; c < k->W; c++) {
                        double s = 0.0;
                        for (int j = 0; j < in; j++)
                            for (int kh = 0; kh < 3; kh++)
                                for (int kw = 0; kw < 3; kw++) {
                                    const int hh = t ? h - kh + 1 : h + kh - 1, cc = t ? c - kw + 1 : c + kw - 1;
                                    if (hh < 0 || cc < 0 || hh >= k->H || cc >= k->W) continue;
                                    const int r = t ? j : o, ch = t ? o : j;
                                    s += (double)w[((size_t)r * k->C + ch) * 9 + kh * 3 + kw] *
                                         x[(size_t)j * lx + (size_t)hh * k->W + cc];
                                }
                        y_dir[(size_t)o * ly + (size_t)h * k->W + c] = (float)s;
                    }
            const double tol = 2e-7 * in * 9 + 1e-7;
            const double worst = test_close_ratio(y, y_dir, ny, tol, 0.0, NULL);
            if (worst > 1.0) print_case(t ? "input gradient vs direct" : "forward vs direct", k, CONV_TAPS_OFF);
            CU_ASSERT(worst <= 1.0);
            free(x), free(w), free(y), free(y_dir);
        }
}

/* test_conv_pair_run (3x3, padding 1) of x (N, C, H, W) at level with F(2x2, 3x3) on or off. */
static bool run_op(int N, const WinoCase *k, ConvEpilogue epi, ConvTapsLevel level, bool wino, ConvPairOut *out) {
    const ConvTapsLevel saved = conv_taps_max_level;
    const bool saved_wino = conv_wino_enabled;
    conv_taps_max_level = level, conv_wino_enabled = wino;
    const bool ok = test_conv_pair_run(N, k->C, k->H, k->W, k->R, 3, 3, 1, epi, out);
    conv_taps_max_level = saved, conv_wino_enabled = saved_wino;
    return ok;
}

/* Forward and every gradient with F(2x2, 3x3) equal the taps kernels' (without it) within test_conv_taps.c's
 * tolerances (2e-6 per summed term), for the plain conv, relu and relu + pool epilogues, at each level the CPU
 * has: ResNet-8's middle stage, an odd plane with rows off the blocks, a 28x28 pooled layer over 9 channels, and
 * 32 to 33 channels on 14x14, whose weight gradient takes it at 16 lanes too (conv_wino_dw_pays). */
static void test_wino_op_matches_taps(void) {
    static const struct {
        int N;
        WinoCase k;
    } op_cases[] = {{3, {16, 16, 14, 14, 0, 0}}, {2, {8, 12, 9, 7, 0, 0}}, {5, {9, 8, 28, 28, 0, 0}},
                    {2, {32, 33, 14, 14, 0, 0}}};
    static const ConvEpilogue epis[] = {CONV_EPI_NONE, CONV_EPI_RELU, CONV_EPI_RELU_MAXPOOL2};
    static const ConvTapsLevel levels[] = {CONV_TAPS_AVX2, CONV_TAPS_AVX512};
    for (size_t li = 0; li < 2; li++) {
        const ConvTapsLevel level = levels[li];
        if (conv_taps_cpu() < level) {
            test_skip("conv2d with F(2x2, 3x3) at %s: this CPU has no %s", conv_taps_level_name(level),
                      level == CONV_TAPS_AVX512 ? "AVX-512F" : "AVX2 with FMA");
            continue;
        }
        for (size_t i = 0; i < sizeof op_cases / sizeof op_cases[0]; i++)
            for (size_t ei = 0; ei < 3; ei++) {
                const WinoCase *k = &op_cases[i].k;
                CU_ASSERT(conv_wino_fits(level, 3, 3, 1, 1, k->C, k->R));
                ConvWino plan;
                conv_wino_plan(&plan, level, k->H, k->W);
                const bool dw_too = conv_wino_dw_pays(&plan, k->C, k->R);
                ConvPairOut a = {0}, b = {0};
                if (!run_op(op_cases[i].N, k, epis[ei], level, true, &a) ||
                    !run_op(op_cases[i].N, k, epis[ei], level, false, &b)) {
                    CU_FAIL("the convolution failed");
                    test_conv_pair_free(&a), test_conv_pair_free(&b);
                    continue;
                }
                CU_ASSERT_EQUAL(a.ny, b.ny);
                const double ty = 2e-6 * k->C * 9 + 1e-6, tx = 2e-6 * k->R * 9 + 1e-6;
                const double tw = 1e-6 * (double)op_cases[i].N * plane(k) + 1e-6;
                double worst = test_close_ratio(a.y, b.y, a.ny, ty, 1e-5, NULL);
                worst = fmax(worst, test_close_ratio(a.dx, b.dx, a.nx, tx, 1e-5, NULL));
                worst = fmax(worst, test_close_ratio(a.dw, b.dw, a.nw, tw, 1e-5, NULL));
                worst = fmax(worst, test_close_ratio(a.db, b.db, (size_t)k->R, tw, 1e-5, NULL));
                if (worst > 1.0) print_case(ei == 0 ? "conv" : ei == 1 ? "conv+relu" : "conv+relu+pool", k, level);
                CU_ASSERT(worst <= 1.0);
                /* and it ran: the sums' rounding differs from the taps' */
                CU_ASSERT(memcmp(a.y, b.y, a.ny * sizeof(float)) != 0);
                if (dw_too) CU_ASSERT(memcmp(a.dw, b.dw, a.nw * sizeof(float)) != 0);
                test_conv_pair_free(&a), test_conv_pair_free(&b);
            }
    }
}

/* Which convolutions take it: 3x3, stride 1, padding 1, a vector level, at least 8 channels each way, enabled;
 * and which weight gradients (every one at 8 lanes; at 16, 32 tiles or more and C OC >= 1024). */
static void test_wino_fits(void) {
    ConvWino p;
    conv_wino_plan(&p, CONV_TAPS_AVX2, 7, 7);
    CU_ASSERT(conv_wino_dw_pays(&p, 8, 8));
    conv_wino_plan(&p, CONV_TAPS_AVX512, 7, 7);
    CU_ASSERT_FALSE(conv_wino_dw_pays(&p, 64, 64));
    conv_wino_plan(&p, CONV_TAPS_AVX512, 14, 14);
    CU_ASSERT(conv_wino_dw_pays(&p, 32, 32));
    CU_ASSERT_FALSE(conv_wino_dw_pays(&p, 16, 63));
    conv_wino_plan(&p, CONV_TAPS_AVX512, 28, 28);
    CU_ASSERT_FALSE(conv_wino_dw_pays(&p, 16, 16));
    CU_ASSERT(conv_wino_fits(CONV_TAPS_AVX2, 3, 3, 1, 1, 8, 8));
    CU_ASSERT(conv_wino_fits(CONV_TAPS_AVX512, 3, 3, 1, 1, 64, 16));
    CU_ASSERT_FALSE(conv_wino_fits(CONV_TAPS_OFF, 3, 3, 1, 1, 16, 16));
    CU_ASSERT_FALSE(conv_wino_fits(CONV_TAPS_AVX2, 5, 5, 1, 2, 16, 16));
    CU_ASSERT_FALSE(conv_wino_fits(CONV_TAPS_AVX2, 3, 1, 1, 1, 16, 16));
    CU_ASSERT_FALSE(conv_wino_fits(CONV_TAPS_AVX2, 3, 3, 2, 1, 16, 16));
    CU_ASSERT_FALSE(conv_wino_fits(CONV_TAPS_AVX2, 3, 3, 1, 0, 16, 16));
    CU_ASSERT_FALSE(conv_wino_fits(CONV_TAPS_AVX2, 3, 3, 1, 1, 7, 16));
    CU_ASSERT_FALSE(conv_wino_fits(CONV_TAPS_AVX2, 3, 3, 1, 1, 16, 7));
    const bool saved = conv_wino_enabled;
    conv_wino_enabled = false;
    CU_ASSERT_FALSE(conv_wino_fits(CONV_TAPS_AVX2, 3, 3, 1, 1, 16, 16));
    conv_wino_enabled = saved;
}

/* QTRAIN_CONV_WINOGRAD's values (conv_wino_select): on, off, auto and unset; another is an error naming them. */
static void test_wino_select(void) {
    QtError err = {0};
    CU_ASSERT_EQUAL(conv_wino_select("off", "QTRAIN_CONV_WINOGRAD", &err), QT_OK);
    CU_ASSERT_FALSE(conv_wino_enabled);
    CU_ASSERT_EQUAL(conv_wino_select("on", "QTRAIN_CONV_WINOGRAD", &err), QT_OK);
    CU_ASSERT(conv_wino_enabled);
    conv_wino_enabled = false;
    CU_ASSERT_EQUAL(conv_wino_select(NULL, "QTRAIN_CONV_WINOGRAD", &err), QT_OK);
    CU_ASSERT(conv_wino_enabled);
    conv_wino_enabled = false;
    CU_ASSERT_EQUAL(conv_wino_select("auto", "QTRAIN_CONV_WINOGRAD", &err), QT_OK);
    CU_ASSERT(conv_wino_enabled);
    QtError e = {0};
    CU_ASSERT_EQUAL(conv_wino_select("1", "QTRAIN_CONV_WINOGRAD", &e), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&e, "QTRAIN_CONV_WINOGRAD: unknown value '1'; expected on, off or auto"));
    CU_ASSERT(conv_wino_enabled);
}

int register_nn_conv_wino_suite(void) {
    CU_pSuite s = CU_add_suite("nn_conv_wino", NULL, NULL);
    if (!s) return -1;
    const struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"vector kernels give the definition's bits, written and added", test_wino_kernels_match_ref_bits},
        {"the definition matches direct loops (forward, input gradient)", test_wino_ref_matches_direct},
        {"a second product of the same input gives the definition's bits", test_wino_again_matches_ref_bits},
        {"weight gradient: vector kernels give the definition's bits", test_wino_dw_kernels_match_ref_bits},
        {"weight gradient: the definition matches direct loops", test_wino_dw_ref_matches_direct},
        {"conv2d with it matches the taps kernels (every gradient, each epilogue)", test_wino_op_matches_taps},
        {"which convolutions take it", test_wino_fits},
        {"QTRAIN_CONV_WINOGRAD's values", test_wino_select},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return 0;
}
