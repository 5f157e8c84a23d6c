/* test_conv_taps.c - the nn_conv_taps suite: the "same" stride-1 convolution as taps over padded planes
 * (nn/conv_taps.h). Its vector kernels give the plain C definitions' bits on every level the CPU has (a visible
 * skip for each it lacks); those definitions agree with the direct loops of conv2d_forward_ref /
 * conv2d_backward_ref; and nn_conv2d_fused gives the same outputs and gradients through them as through im2col and
 * sgemm (conv_taps_max_level = CONV_TAPS_OFF). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "nn/conv_taps.h"
#include "nn/ops.h"
#include "nn/ops_conv_internal.h"
#include "test_conv_pair.h"
#include "test_util.h"

typedef struct {
    int N, C, H, W, OC, K; /* K x K kernel, padding (K - 1) / 2; KH, KW below when not square */
    int KH, KW;
} TapsCase;

/* Kernel-level cases: rows of one vector and of several, a last vector of one lane, block remainders (OC, C not
 * multiples of 8 or 4), a 1-channel input, 5x5 (taps past the first 9), 1x3 and 3x1 (no padding on one axis),
 * images of 1, 2 and 3 rows, flat planes (conv_taps.h) of 3, 4 (7x7, a last vector of one lane), 5 (a last tile
 * of 2 vectors), 7, 21 and 49 vectors at 16 lanes, and of 2, 3, 4, 7, 10, 13 (4 to 13: a last tile of one
 * vector), 42 and 98 at 8. */
static const TapsCase kernel_cases[] = {
    {1, 1, 1, 1, 1, 3, 0, 0},  {2, 3, 5, 7, 5, 3, 0, 0},   {3, 4, 6, 17, 9, 3, 0, 0}, {1, 16, 12, 28, 16, 3, 0, 0},
    {2, 5, 9, 14, 13, 5, 0, 0}, {1, 1, 28, 28, 8, 3, 0, 0}, {2, 3, 7, 33, 4, 0, 1, 3}, {2, 6, 11, 9, 3, 0, 3, 1},
    {1, 2, 4, 20, 2, 7, 0, 0},  {2, 3, 2, 9, 3, 3, 0, 0},   {1, 2, 3, 16, 4, 3, 0, 0}, {1, 2, 8, 10, 3, 3, 0, 0},
    /* the weight gradient's channel vectors: pairs and a last one alone, 3x3 (odd rows: a last position alone)
     * and not, a last vector mostly padding; 8 output channels (a rank) at 16 lanes: two input channels a vector */
    {2, 3, 5, 6, 33, 3, 0, 0},  {1, 3, 4, 7, 16, 3, 0, 0},  {1, 2, 4, 7, 20, 5, 0, 0}, {3, 2, 3, 5, 40, 0, 1, 3},
    {2, 4, 6, 9, 8, 3, 0, 0},   {1, 5, 3, 4, 7, 3, 0, 0},   {2, 5, 7, 7, 12, 3, 0, 0}, /* 7x7: 4 flat vectors */
};
#define N_KERNEL_CASES (sizeof kernel_cases / sizeof kernel_cases[0])

static int case_kh(const TapsCase *k) { return k->K ? k->K : k->KH; }
static int case_kw(const TapsCase *k) { return k->K ? k->K : k->KW; }

static void print_case(const char *what, const TapsCase *k, ConvTapsLevel level) {
    fprintf(stderr, "\n  %s (%s): N=%d C=%d H=%d W=%d OC=%d kernel %dx%d", what, conv_taps_level_name(level), k->N,
            k->C, k->H, k->W, k->OC, case_kh(k), case_kw(k));
}

/* The arrays of one kernel case, planned at level's lanes. */
typedef struct {
    ConvTaps p;
    float *tables, *x, *w, *dp, *xp, *xr, *dpp, *wp, *wt, *y, *y_ref, *dw, *dw_ref, *dx, *dx_ref;
} TapsBufs;

static void bufs_init(TapsBufs *b, const TapsCase *k, ConvTapsLevel level, uint64_t seed) {
    const int KH = case_kh(k), KW = case_kw(k), KK = KH * KW;
    memset(b, 0, sizeof *b);
    b->tables = malloc(conv_taps_table_floats(k->H, k->W, 8) * sizeof(float)); /* 8 lanes: the larger tables */
    conv_taps_plan(&b->p, level, k->C, k->OC, k->H, k->W, KH, KW, b->tables);
    const size_t hw = (size_t)k->H * k->W, nx = (size_t)k->N * k->C * hw, ny = (size_t)k->N * k->OC * hw;
    b->x = test_random_uniform(nx, seed, -1.0f, 1.0f);
    b->w = test_random_uniform((size_t)k->OC * k->C * KK, seed + 1, -1.0f, 1.0f);
    b->dp = test_random_uniform(ny, seed + 2, -1.0f, 1.0f);
    /* the forward's layout and the rows (the weight gradient's), each sized exactly: a kernel reading past its
     * layout's planes and the lanes after them trips the sanitizer build */
    b->xp = malloc(((size_t)k->N * k->C * b->p.fplane + (size_t)b->p.lanes) * sizeof(float));
    b->xr = malloc(((size_t)k->N * k->C * b->p.pplane + (size_t)b->p.lanes) * sizeof(float));
    b->dpp = malloc(((size_t)k->OC * b->p.fplane + (size_t)b->p.lanes) * sizeof(float));
    b->wp = malloc(conv_taps_packed_floats(&b->p, k->OC, k->C) * sizeof(float));
    b->wt = malloc(conv_taps_packed_floats(&b->p, k->C, k->OC) * sizeof(float));
    b->y = malloc(ny * sizeof(float)), b->y_ref = malloc(ny * sizeof(float));
    b->dx = malloc(nx * sizeof(float)), b->dx_ref = malloc(nx * sizeof(float));
    const size_t nw = (size_t)k->C * KK * conv_taps_oc_pad(k->OC); /* transposed, (C KK, ldd) */
    b->dw = malloc(nw * sizeof(float)), b->dw_ref = malloc(nw * sizeof(float));
    conv_taps_pad(&b->p, b->xp, b->x, k->C, k->N, (size_t)k->C * hw, hw);
    conv_taps_pad_rows(&b->p, b->xr, b->x, k->C, k->N, (size_t)k->C * hw, hw);
    conv_taps_pack(&b->p, b->wp, b->w, k->C * KK, k->OC);
    conv_taps_pack_t(&b->p, b->wt, b->w, k->C * KK);
}

static void bufs_free(TapsBufs *b) {
    float *all[] = {b->tables, b->x, b->w, b->dp, b->xp, b->xr, b->dpp, b->wp, b->wt, b->y, b->y_ref, b->dw, b->dw_ref,
                    b->dx, b->dx_ref};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

/* The three products of case k at level (vector: the level's kernels, else the plain C definitions): y (N, OC, H,
 * W) = the forward, dx (N, C, H, W) = the input gradient of dp, dw (C KK, ldd) = the weight gradient of all N
 * images, transposed. With add, all three are added to what the arrays hold (their fill). */
static void taps_products(TapsBufs *b, const TapsCase *k, ConvTapsLevel level, bool vector, float *y, float *dx,
                          float *dw, bool add) {
    const size_t hw = (size_t)k->H * k->W;
    for (int n = 0; n < k->N; n++) {
        float *yn = y + (size_t)n * k->OC * hw, *dxn = dx + (size_t)n * k->C * hw;
        const float *xpn = b->xp + (size_t)n * k->C * b->p.fplane;
        if (vector) conv_taps_forward(&b->p, level, yn, hw, xpn, b->wp, k->OC, k->C, add);
        else conv_taps_forward_ref(&b->p, b->p.lanes, yn, hw, xpn, b->wp, k->OC, k->C, add);
        conv_taps_pad(&b->p, b->dpp, b->dp + (size_t)n * k->OC * hw, k->OC, 1, 0, hw);
        if (vector) conv_taps_forward(&b->p, level, dxn, hw, b->dpp, b->wt, k->C, k->OC, add);
        else conv_taps_forward_ref(&b->p, b->p.lanes, dxn, hw, b->dpp, b->wt, k->C, k->OC, add);
    }
    /* dp as the backward holds it: (OC, N H W), image n at column n H W; then transposed */
    float *dpc = malloc((size_t)k->N * k->OC * hw * sizeof(float));
    float *dpt = malloc((size_t)k->N * hw * conv_taps_oc_pad(k->OC) * sizeof(float));
    for (int n = 0; n < k->N; n++)
        for (int oc = 0; oc < k->OC; oc++)
            memcpy(dpc + (size_t)oc * k->N * hw + (size_t)n * hw, b->dp + ((size_t)n * k->OC + oc) * hw,
                   hw * sizeof(float));
    if (vector) conv_taps_dp_t(&b->p, level, dpt, dpc, (size_t)k->N * hw, hw, k->OC, k->N);
    else conv_taps_dp_t_ref(&b->p, dpt, dpc, (size_t)k->N * hw, hw, k->OC, k->N);
    if (vector) conv_taps_dw(&b->p, level, dw, dpt, b->xr, k->N, add);
    else conv_taps_dw_ref(&b->p, dw, dpt, b->xr, k->N, add);
    free(dpc), free(dpt);
}

/* Whether the transposed weight gradients a and b hold the same bits in every output channel's column (the
 * columns past OC are unspecified). */
static bool same_dwt(const float *a, const float *b, const TapsCase *k) {
    const size_t ldd = conv_taps_oc_pad(k->OC), rows = (size_t)k->C * case_kh(k) * case_kw(k);
    for (size_t r = 0; r < rows; r++)
        if (memcmp(a + r * ldd, b + r * ldd, (size_t)k->OC * sizeof(float))) return false;
    return true;
}

static void fill(float *p, size_t n, float v) {
    for (size_t i = 0; i < n; i++) p[i] = v;
}

/* Added-to start values that differ from one float to the next (a kernel that went on from the wrong row or lane
 * would show), or NaN everywhere for written outputs (whatever was there is gone). */
static void fill_start(float *p, size_t n, bool add) {
    for (size_t i = 0; i < n; i++) p[i] = add ? 0.25f * (float)((i * 37) % 17) - 2.0f : NAN;
}

/* Every vector level's kernels give the plain C definitions' bits, written and added. */
static void test_taps_kernels_match_ref_bits(void) {
    static const ConvTapsLevel levels[] = {CONV_TAPS_AVX2, CONV_TAPS_AVX512};
    for (size_t li = 0; li < 2; li++) {
        const ConvTapsLevel level = levels[li];
        if (conv_taps_cpu() < level) {
            test_skip("conv_taps %s kernels: this CPU has no %s", conv_taps_level_name(level),
                      level == CONV_TAPS_AVX512 ? "AVX-512F" : "AVX2 with FMA");
            continue;
        }
        for (size_t i = 0; i < N_KERNEL_CASES; i++) {
            const TapsCase *k = &kernel_cases[i];
            const size_t hw = (size_t)k->H * k->W, nx = (size_t)k->N * k->C * hw, ny = (size_t)k->N * k->OC * hw;
            const size_t ldd = conv_taps_oc_pad(k->OC), nw = (size_t)k->C * case_kh(k) * case_kw(k) * ldd;
            for (int add = 0; add < 2; add++) {
                TapsBufs b;
                bufs_init(&b, k, level, 100 + 10 * i);
                const float start = add ? 0.375f : NAN; /* written: whatever was there is gone */
                fill(b.y, ny, start), fill(b.y_ref, ny, start), fill(b.dx, nx, start), fill(b.dx_ref, nx, start);
                fill_start(b.dw, nw, add), fill_start(b.dw_ref, nw, add);
                taps_products(&b, k, level, true, b.y, b.dx, b.dw, add);
                taps_products(&b, k, level, false, b.y_ref, b.dx_ref, b.dw_ref, add);
                const bool fy = !memcmp(b.y, b.y_ref, ny * sizeof(float));
                const bool fx = !memcmp(b.dx, b.dx_ref, nx * sizeof(float));
                const bool fw = same_dwt(b.dw, b.dw_ref, k);
                /* dp transposed as the output gradient lies, (N, OC, H, W): every float of the plain C
                 * transpose, the padding columns' zeros too; and the images in two calls, the second going on
                 * from the first's sums: the same chains, the same bits */
                const size_t nt = (size_t)k->N * hw * ldd;
                float *dpt = malloc(nt * sizeof(float)), *dpt_ref = malloc(nt * sizeof(float));
                fill(dpt, nt, NAN), fill(dpt_ref, nt, -NAN);
                conv_taps_dp_t(&b.p, level, dpt, b.dp, hw, (size_t)k->OC * hw, k->OC, k->N);
                conv_taps_dp_t_ref(&b.p, dpt_ref, b.dp, hw, (size_t)k->OC * hw, k->OC, k->N);
                const bool ft = !memcmp(dpt, dpt_ref, nt * sizeof(float));
                float *dw2 = malloc(nw * sizeof(float));
                fill_start(dw2, nw, add);
                const int n1 = k->N / 2;
                if (n1) conv_taps_dw(&b.p, level, dw2, dpt, b.xr, n1, add);
                conv_taps_dw(&b.p, level, dw2, dpt + (size_t)n1 * hw * ldd, b.xr + (size_t)n1 * k->C * b.p.pplane,
                             k->N - n1, add || n1);
                const bool fw2 = same_dwt(dw2, b.dw_ref, k);
                if (!ft) print_case("transposed output gradient bits", k, level);
                if (!fw2) print_case("weight gradient in two calls from (N, OC, H, W) bits", k, level);
                CU_ASSERT(ft);
                CU_ASSERT(fw2);
                free(dw2), free(dpt), free(dpt_ref);
                if (!fy) print_case(add ? "forward (added) bits" : "forward bits", k, level);
                if (!fx) print_case(add ? "input gradient (added) bits" : "input gradient bits", k, level);
                if (!fw) print_case(add ? "weight gradient (added) bits" : "weight gradient bits", k, level);
                CU_ASSERT(fy);
                CU_ASSERT(fx);
                CU_ASSERT(fw);
                bufs_free(&b);
            }
        }
    }
}

/* The vector pad (conv_taps_pad_avx2) writes the plain C pad's floats for plans of both widths: rows of 1 to 33
 * columns (one vector, several, a last one of one lane), kernels 3x3, 5x5, 7x7, 1x3, 3x1 and 1x9 (a left padding
 * of 4 lanes), strided sources (gaps between channels and images) in buffers of exactly their size, every float of
 * the padded planes written (a NaN canary before). */
static void test_taps_pad_matches_ref(void) {
    if (conv_taps_cpu() < CONV_TAPS_AVX2) {
        test_skip("conv_taps pad: this CPU has no AVX2 with FMA");
        return;
    }
    static const ConvTapsLevel levels[] = {CONV_TAPS_AVX2, CONV_TAPS_AVX512}; /* plans of 8 and 16 lanes */
    static const int WS[] = {1, 2, 5, 7, 8, 9, 14, 15, 16, 17, 28, 33}, KS[][2] = {{3, 3}, {5, 5}, {7, 7}, {1, 3},
                                                                                    {3, 1}, {1, 9}};
    for (size_t li = 0; li < 2; li++) {
        const ConvTapsLevel level = levels[li];
        int bad = 0;
        for (size_t wi = 0; wi < sizeof WS / sizeof *WS; wi++)
            for (size_t ki = 0; ki < sizeof KS / sizeof *KS; ki++) {
                const int W = WS[wi], H = 1 + (int)(wi % 3) * 3, C = 1 + (int)(ki % 3), N = 1 + (int)(wi % 2);
                const int KH = KS[ki][0], KW = KS[ki][1];
                float *tables = malloc(conv_taps_table_floats(H, W, 8) * sizeof(float));
                ConvTaps p;
                conv_taps_plan(&p, level, C, 1, H, W, KH, KW, tables);
                const size_t ld = (size_t)H * W + 3, img = (size_t)C * ld + 5, nsrc = (size_t)(N - 1) * img +
                                                                                       (size_t)(C - 1) * ld + (size_t)H * W;
                float *src = test_random_uniform(nsrc, 7 + wi * 10 + ki, -1.0f, 1.0f);
                const size_t nd = conv_taps_padded_rows_floats(&p, C, N);
                float *got = malloc(nd * sizeof(float)), *want = malloc(nd * sizeof(float));
                fill(got, nd, NAN), fill(want, nd, NAN);
                conv_taps_pad_avx2(&p, got, src, C, N, img, ld);
                conv_taps_pad_ref(&p, want, src, C, N, img, ld);
                if (memcmp(got, want, nd * sizeof(float)) != 0) {
                    bad++;
                    fprintf(stderr, "\n  pad of a %d-lane plan: N=%d C=%d H=%d W=%d kernel %dx%d differs from the C pad",
                            p.lanes, N, C, H, W, KH, KW);
                }
                free(tables), free(src), free(got), free(want);
            }
        CU_ASSERT_EQUAL(bad, 0);
    }
}

/* The plain C definitions at either width are the convolution: against the direct loops in double-checked
 * tolerance (a float sum of `terms` products of values in [-1, 1]: 1e-6 per term, test_conv.c's bound). */
static void test_taps_ref_matches_direct(void) {
    static const ConvTapsLevel levels[] = {CONV_TAPS_AVX2, CONV_TAPS_AVX512}; /* the plans' lanes; C runs both */
    for (size_t li = 0; li < 2; li++)
        for (size_t i = 0; i < N_KERNEL_CASES; i++) {
            const TapsCase *k = &kernel_cases[i];
            const int KH = case_kh(k), KW = case_kw(k), pad = (KH - 1) / 2;
            if ((KW - 1) / 2 != pad) continue; /* the direct loops take one padding for both axes */
            const size_t hw = (size_t)k->H * k->W, nx = (size_t)k->N * k->C * hw, ny = (size_t)k->N * k->OC * hw;
            const size_t nw = (size_t)k->OC * k->C * KH * KW;
            TapsBufs b;
            bufs_init(&b, k, levels[li], 300 + 10 * i);
            taps_products(&b, k, levels[li], false, b.y, b.dx, b.dw, false);
            conv2d_forward_ref(b.y_ref, b.x, b.w, NULL, k->N, k->C, k->H, k->W, k->OC, KH, KW, 1, pad);
            memset(b.dx_ref, 0, nx * sizeof(float)), memset(b.dw_ref, 0, nw * sizeof(float));
            conv2d_backward_ref(b.dx_ref, b.dw_ref, NULL, b.dp, b.x, b.w, k->N, k->C, k->H, k->W, k->OC, KH, KW, 1,
                                pad);
            const double ty = 1e-6 * k->C * KH * KW + 1e-6, tx = 1e-6 * k->OC * KH * KW + 1e-6;
            const double tw = 1e-6 * (double)k->N * hw + 1e-6;
            if (test_close_ratio(b.y, b.y_ref, ny, ty, 1e-5, NULL) > 1.0) print_case("forward", k, levels[li]);
            ASSERT_ALL_CLOSE(b.y, b.y_ref, ny, ty, 1e-5);
            if (test_close_ratio(b.dx, b.dx_ref, nx, tx, 1e-5, NULL) > 1.0) print_case("dx", k, levels[li]);
            ASSERT_ALL_CLOSE(b.dx, b.dx_ref, nx, tx, 1e-5);
            float *dw = calloc(nw, sizeof(float)); /* (OC, C KK): the transpose added to zeros */
            conv_taps_dw_add_parts(&b.p, dw, b.dw, 1);
            if (test_close_ratio(dw, b.dw_ref, nw, tw, 1e-5, NULL) > 1.0) print_case("dw", k, levels[li]);
            ASSERT_ALL_CLOSE(dw, b.dw_ref, nw, tw, 1e-5);
            free(dw);
            bufs_free(&b);
        }
}

/* Which geometries the taps take, at each width. */
static void test_taps_fits(void) {
    const ConvTapsLevel v16 = CONV_TAPS_AVX512, v8 = CONV_TAPS_AVX2;
    CU_ASSERT(conv_taps_fits(v16, 28, 28, 3, 3, 1, 1));
    CU_ASSERT(conv_taps_fits(v16, 14, 14, 3, 3, 1, 1));
    CU_ASSERT(conv_taps_fits(v16, 9, 12, 5, 5, 1, 2));
    CU_ASSERT(conv_taps_fits(v16, 7, 7, 3, 3, 1, 1));   /* rows 7 of 16 lanes, flat 49 of 64 */
    CU_ASSERT(!conv_taps_fits(v16, 7, 7, 5, 5, 1, 2));  /* 7 of 16, and no flat planes for 5x5 */
    CU_ASSERT(!conv_taps_fits(v16, 1, 5, 3, 3, 1, 1));  /* flat too: 5 of 16 */
    CU_ASSERT(conv_taps_fits(v8, 7, 7, 3, 3, 1, 1));    /* 7 of 8 */
    CU_ASSERT(conv_taps_fits(v8, 10, 9, 3, 3, 1, 1));   /* rows 9 of 16 lanes, flat 90 of 96 */
    CU_ASSERT(!conv_taps_fits(v8, 10, 9, 5, 5, 1, 2));  /* 9 of 16, and no flat planes for 5x5 */
    CU_ASSERT(conv_taps_fits(v16, 20, 20, 3, 3, 1, 1)); /* rows 20 of 32, flat 400 of 400 */
    CU_ASSERT(!conv_taps_fits(v16, 20, 20, 5, 5, 1, 2)); /* 20 of 32, no flat planes */
    CU_ASSERT(!conv_taps_fits(v16, 28, 28, 3, 3, 2, 1)); /* stride 2 */
    CU_ASSERT(!conv_taps_fits(v16, 28, 28, 3, 3, 1, 0)); /* not "same" */
    CU_ASSERT(!conv_taps_fits(v16, 28, 28, 3, 3, 1, 2));
    CU_ASSERT(!conv_taps_fits(v16, 28, 28, 1, 1, 1, 0)); /* 1x1: its own product */
    CU_ASSERT(!conv_taps_fits(v16, 28, 28, 2, 2, 1, 0)); /* even */
    CU_ASSERT(!conv_taps_fits(v16, 28, 28, 9, 9, 1, 4)); /* 81 taps */
    CU_ASSERT(!conv_taps_fits(CONV_TAPS_OFF, 28, 28, 3, 3, 1, 1));
    CU_ASSERT_STRING_EQUAL(conv_taps_level_name(CONV_TAPS_OFF), "gemm");
    CU_ASSERT_STRING_EQUAL(conv_taps_level_name(CONV_TAPS_AVX512), "avx512");
}

/* QTRAIN_CONV_KERNEL's names (conv_taps_select): each level caps conv_taps_level(); a level the CPU lacks and an
 * unknown name are errors that say what to choose. */
static void test_taps_select(void) {
    const ConvTapsLevel saved = conv_taps_max_level;
    QtError err = {0};
    CU_ASSERT_EQUAL(conv_taps_select("gemm", "QTRAIN_CONV_KERNEL", &err), QT_OK);
    CU_ASSERT_EQUAL(conv_taps_level(), CONV_TAPS_OFF);
    CU_ASSERT_EQUAL(conv_taps_select(NULL, "QTRAIN_CONV_KERNEL", &err), QT_OK);
    CU_ASSERT_EQUAL(conv_taps_level(), conv_taps_cpu());
    CU_ASSERT_EQUAL(conv_taps_select("auto", "QTRAIN_CONV_KERNEL", &err), QT_OK);
    CU_ASSERT_EQUAL(conv_taps_level(), conv_taps_cpu());
    static const ConvTapsLevel levels[] = {CONV_TAPS_AVX2, CONV_TAPS_AVX512};
    for (int i = 0; i < 2; i++) {
        QtError e = {0};
        const QtStatus st = conv_taps_select(conv_taps_level_name(levels[i]), "QTRAIN_CONV_KERNEL", &e);
        if (conv_taps_cpu() >= levels[i]) {
            CU_ASSERT_EQUAL(st, QT_OK);
            CU_ASSERT_EQUAL(conv_taps_level(), levels[i]);
        } else {
            CU_ASSERT_EQUAL(st, QT_ERR_CONFIG);
            CU_ASSERT(test_msg_has(&e, "this CPU (or OS) has no"));
        }
    }
    QtError e = {0};
    CU_ASSERT_EQUAL(conv_taps_select("avx-512", "QTRAIN_CONV_KERNEL", &e), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&e, "QTRAIN_CONV_KERNEL: unknown convolution kernel 'avx-512'"));
    CU_ASSERT(test_msg_has(&e, "expected avx512, avx2, gemm or auto"));
    conv_taps_max_level = saved;
}

/* ---- the convolution op through the taps ----------------------------------------------------------------------- */

/* Op-level cases, every one taken at 16 lanes: backward chunks of 6 samples and a last of 3 (N = 27 at 24 x 24 on
 * one thread: the 256 KiB budget over 26 KiB of padded input and 13.5 KiB of dpre a sample), C and OC off the
 * blocks, 5x5. */
static const TapsCase op_cases[] = {
    {3, 5, 12, 14, 11, 3, 0, 0},
    {27, 8, 24, 24, 6, 3, 0, 0},
    {2, 3, 16, 11, 7, 5, 0, 0},
    {4, 1, 28, 28, 16, 3, 0, 0},
    {2, 16, 10, 10, 12, 3, 0, 0}, /* F(2x2, 3x3) (conv_wino.h) for the forward and the input gradient */
};

/* test_conv_pair_run of case k with epilogue epi at conv_taps_max_level = level. */
static bool run_op(const TapsCase *k, ConvEpilogue epi, ConvTapsLevel level, ConvPairOut *out) {
    const ConvTapsLevel saved = conv_taps_max_level;
    conv_taps_max_level = level;
    const int KH = case_kh(k), KW = case_kw(k);
    const bool ok = test_conv_pair_run(k->N, k->C, k->H, k->W, k->OC, KH, KW, (KH - 1) / 2, epi, out);
    conv_taps_max_level = saved;
    return ok;
}

/* Forward and every gradient through the taps at each level the CPU has equal im2col and sgemm's up to the sums'
 * order: the tolerances of test_conv.c (1e-6 per summed term). */
static void test_taps_op_matches_gemm(void) {
    static const ConvEpilogue epis[] = {CONV_EPI_NONE, CONV_EPI_RELU, CONV_EPI_RELU_MAXPOOL2};
    static const ConvTapsLevel levels[] = {CONV_TAPS_AVX2, CONV_TAPS_AVX512};
    for (size_t li = 0; li < 2; li++) {
        const ConvTapsLevel level = levels[li];
        if (conv_taps_cpu() < level) {
            test_skip("conv2d through the %s taps: this CPU has no %s", conv_taps_level_name(level),
                      level == CONV_TAPS_AVX512 ? "AVX-512F" : "AVX2 with FMA");
            continue;
        }
        for (size_t i = 0; i < sizeof op_cases / sizeof op_cases[0]; i++)
            for (size_t ei = 0; ei < 3; ei++) {
                const TapsCase *k = &op_cases[i];
                const int KH = case_kh(k), KW = case_kw(k);
                CU_ASSERT(conv_taps_fits(level, k->H, k->W, KH, KW, 1, (KH - 1) / 2));
                ConvPairOut t = {0}, g = {0};
                if (!run_op(k, epis[ei], level, &t) || !run_op(k, epis[ei], CONV_TAPS_OFF, &g)) {
                    CU_FAIL("the convolution failed");
                    test_conv_pair_free(&t), test_conv_pair_free(&g);
                    continue;
                }
                const bool pooled = epis[ei] == CONV_EPI_RELU_MAXPOOL2;
                const size_t hw = (size_t)k->H * k->W, ny = t.ny;
                CU_ASSERT_EQUAL(t.ny, g.ny);
                const size_t nx = (size_t)k->N * k->C * hw, nw = (size_t)k->OC * k->C * KH * KW;
                const double ty = 2e-6 * k->C * KH * KW + 1e-6, tx = 2e-6 * k->OC * KH * KW + 1e-6;
                const double tw = 1e-6 * (double)k->N * hw + 1e-6;
                double worst = test_close_ratio(t.y, g.y, ny, ty, 1e-5, NULL);
                worst = fmax(worst, test_close_ratio(t.dx, g.dx, nx, tx, 1e-5, NULL));
                worst = fmax(worst, test_close_ratio(t.dw, g.dw, 2 * nw, tw, 1e-5, NULL));
                worst = fmax(worst, test_close_ratio(t.db, g.db, (size_t)k->OC, tw, 1e-5, NULL));
                if (worst > 1.0) print_case(epis[ei] == CONV_EPI_NONE ? "conv" : pooled ? "conv+relu+pool"
                                                                                         : "conv+relu", k, level);
                CU_ASSERT(worst <= 1.0);
                test_conv_pair_free(&t), test_conv_pair_free(&g);
            }
    }
}

/* The low-rank convolution (x, w, A, B; B not zero) with gradient route grad, plus the plain one of x and w,
 * through the taps at level: their sum y, and the gradients of x, A, B and (train_w) w, into out (malloc'd,
 * concatenated in that order). */
static bool run_lowrank(const TapsCase *k, ConvLowRankGrad grad, bool train_w, ConvEpilogue epi, int rank,
                        ConvTapsLevel level, float **out, size_t *n) {
    const ConvTapsLevel saved = conv_taps_max_level;
    conv_taps_max_level = level;
    TestEnv e;
    test_env_init(&e, 91);
    const int KH = case_kh(k), KW = case_kw(k), pad = (KH - 1) / 2, ckk = k->C * KH * KW;
    const size_t hw = (size_t)k->H * k->W, nx = (size_t)k->N * k->C * hw, nw = (size_t)k->OC * ckk;
    const size_t na = (size_t)rank * ckk, nb = (size_t)k->OC * rank;
    float *x = test_random_uniform(nx, 15, -1.0f, 1.0f), *w = test_random_uniform(nw, 16, -1.0f, 1.0f);
    float *a = test_random_uniform(na, 17, -1.0f, 1.0f), *b = test_random_uniform(nb, 18, -1.0f, 1.0f);
    Var *vx = test_var(&e, x, 4, (const int[]){k->N, k->C, k->H, k->W}, true);
    Var *vw = test_var(&e, w, 4, (const int[]){k->OC, k->C, KH, KW}, train_w);
    Var *va = test_var(&e, a, 4, (const int[]){rank, k->C, KH, KW}, true);
    Var *vb = test_var(&e, b, 4, (const int[]){k->OC, rank, 1, 1}, true);
    const ConvLowRank lr = {va, vb, 0.5f};
    /* plus a plain conv of x recorded after it: its backward runs first and writes dx, the low-rank one adds */
    Var *ylr = conv2d_lowrank_with_grad(&e.tape, vx, vw, NULL, &lr, 1, pad, epi, grad);
    Var *yp = ylr ? nn_conv2d_fused(&e.tape, vx, vw, NULL, 1, pad, epi) : NULL;
    Var *y = yp ? nn_add(&e.tape, ylr, yp) : NULL;
    bool ok = y != NULL;
    if (ok) {
        const size_t ny = var_numel(y);
        float *dy = test_random_uniform(ny, 19, -1.0f, 1.0f);
        ok = tape_backward_from(&e.tape, y, dy) == QT_OK && vx->grad && va->grad && vb->grad &&
             (!train_w || vw->grad);
        free(dy);
        if (ok) {
            *n = ny + nx + na + nb + (train_w ? nw : 0);
            float *o = *out = malloc(*n * sizeof(float));
            memcpy(o, y->value.data, ny * sizeof(float)), o += ny;
            memcpy(o, vx->grad, nx * sizeof(float)), o += nx;
            memcpy(o, va->grad, na * sizeof(float)), o += na;
            memcpy(o, vb->grad, nb * sizeof(float)), o += nb;
            if (train_w) memcpy(o, vw->grad, nw * sizeof(float));
        }
    }
    if (!ok) fprintf(stderr, "\n  run_lowrank: %s", e.tape.err.msg);
    free(x), free(w), free(a), free(b);
    test_env_free(&e);
    conv_taps_max_level = saved;
    return ok;
}

/* The low-rank convolution through the taps (forward, and its backward by the adapter's products or through the
 * full weight gradient) equals im2col and sgemm's on every gradient route, with the base frozen or trained. */
static void test_taps_lowrank_matches_gemm(void) {
    static const ConvLowRankGrad grads[] = {CONV_LR_GRAD_FULL, CONV_LR_GRAD_COL, CONV_LR_GRAD_DTCOL};
    const ConvTapsLevel level = conv_taps_cpu();
    if (level == CONV_TAPS_OFF) {
        test_skip("the low-rank conv through the taps: this CPU has neither AVX-512F nor AVX2 with FMA");
        return;
    }
    /* rank 3 and 8 (at 16 lanes: two input channels a vector for dA), 20 (more than the cases' output
     * channels, two vectors) */
    static const int RANKS[] = {3, 8, 20};
    for (size_t ri = 0; ri < 3; ri++)
        for (size_t i = 0; i < sizeof op_cases / sizeof op_cases[0]; i++)
            for (size_t gi = 0; gi < 3; gi++)
                for (int train_w = 0; train_w < 2; train_w++) {
                    const TapsCase *k = &op_cases[i];
                    const int rank = RANKS[ri];
                    const ConvEpilogue epi = train_w ? CONV_EPI_RELU : CONV_EPI_NONE;
                    float *t = NULL, *g = NULL;
                    size_t nt = 0, ng = 0;
                    if (!run_lowrank(k, grads[gi], train_w, epi, rank, level, &t, &nt) ||
                        !run_lowrank(k, grads[gi], train_w, epi, rank, CONV_TAPS_OFF, &g, &ng) || nt != ng) {
                        CU_FAIL("the low-rank convolution failed");
                        free(t), free(g);
                        continue;
                    }
                    /* every value is a sum of at most N H W (dA, dB, dw) or C KH KW (+ rank) products */
                    const double tol = 2e-6 * ((double)k->N * k->H * k->W + k->C * 25 + k->OC * 25 + rank) + 1e-6;
                    const double worst = test_close_ratio(t, g, nt, tol, 1e-5, NULL);
                    if (worst > 1.0) print_case(train_w ? "low-rank conv, w trained" : "low-rank conv", k, level);
                    CU_ASSERT(worst <= 1.0);
                    free(t), free(g);
                }
}

/* conv_taps_dw_add_parts adds the tasks' transposed partials into the gradient in conv_add_partials' order (each
 * element: the gradient, then part 0, 1, ...): the same bits as conv_add_partials on the parts transposed back,
 * for OC on and off the 16 columns of a row. */
static void test_taps_dw_add_parts(void) {
    static const int OCS[] = {5, 16, 21};
    for (size_t oi = 0; oi < 3; oi++) {
        ConvTaps p;
        float *tables = malloc(conv_taps_table_floats(6, 6, 8) * sizeof(float));
        conv_taps_plan(&p, CONV_TAPS_AVX2, 3, OCS[oi], 6, 6, 3, 3, tables);
        enum { PARTS = 3 };
        const size_t ckk = 27, ldd = conv_taps_oc_pad(p.OC), n = (size_t)p.OC * ckk, nt = ckk * ldd;
        float *parts = test_random_uniform(PARTS * nt, 900 + oi, -1.0f, 1.0f), *back = malloc(PARTS * n * 4);
        for (int k = 0; k < PARTS; k++)
            for (int oc = 0; oc < p.OC; oc++)
                for (size_t ct = 0; ct < ckk; ct++) back[k * n + oc * ckk + ct] = parts[k * nt + ct * ldd + oc];
        float *a = test_random_uniform(n, 950 + oi, -1.0f, 1.0f), *b = malloc(n * sizeof(float));
        memcpy(b, a, n * sizeof(float));
        float *c = malloc(n * sizeof(float)); /* the rows in two ranges, as threads take them */
        memcpy(c, a, n * sizeof(float));
        conv_taps_dw_add_parts(&p, a, parts, PARTS);
        conv_add_partials(b, back, PARTS, n);
        conv_taps_dw_add_parts_rows(&p, c, parts, PARTS, p.OC / 3, p.OC);
        conv_taps_dw_add_parts_rows(&p, c, parts, PARTS, 0, p.OC / 3);
        CU_ASSERT(!memcmp(a, b, n * sizeof(float)));
        CU_ASSERT(!memcmp(c, b, n * sizeof(float)));
        free(c);
        free(tables), free(parts), free(back), free(a), free(b);
    }
}

/* The flat layout's edge taps add the padding's zero as the row layout does, not skip it: a sum that is -0.0f
 * before one (a subnormal product rounded to zero) comes out +0.0f, as the reference gives. Output (1, 0) of a
 * 3x5 image (flat at both widths): its first taps reach -2^-149 - 2^-149 ... rounded to -0.0f by then, and its
 * tap (1, 0) reads across the row's edge. */
static void test_taps_flat_edge_zero(void) {
    enum { H = 3, W = 5 };
    const ConvTapsLevel levels[] = {CONV_TAPS_AVX512, CONV_TAPS_AVX2};
    for (size_t li = 0; li < 2; li++) {
        const ConvTapsLevel level = levels[li];
        if (conv_taps_cpu() < level) {
            test_skip(level == CONV_TAPS_AVX512 ? "conv_taps flat layout at 16 lanes: this CPU has no AVX-512F"
                                                : "conv_taps flat layout at 8 lanes: this CPU has no AVX2 + FMA");
            continue;
        }
        ConvTaps p;
        float *tables = malloc(conv_taps_table_floats(H, W, 8) * sizeof(float));
        conv_taps_plan(&p, level, 1, 1, H, W, 3, 3, tables);
        CU_ASSERT(p.flat);
        float x[H * W] = {0}, w[9] = {1, ldexpf(1, -75), -1.25f * ldexpf(1, -75), 1, -1, -1, 1, -1, -1};
        x[0] = x[1] = ldexpf(1, -74);
        x[W - 1] = 7.0f; /* what tap (1, 0) of output (1, 0) would read across the edge without its zero */
        float *xp = malloc(conv_taps_padded_floats(&p, 1, 1) * sizeof(float));
        float *wp = malloc(conv_taps_packed_floats(&p, 1, 1) * sizeof(float));
        float y[H * W], y_ref[H * W];
        conv_taps_pad(&p, xp, x, 1, 1, 0, H * W);
        conv_taps_pack(&p, wp, w, 9, 1);
        conv_taps_forward(&p, level, y, H * W, xp, wp, 1, 1, false);
        conv_taps_forward_ref(&p, p.lanes, y_ref, H * W, xp, wp, 1, 1, false);
        CU_ASSERT(memcmp(y, y_ref, sizeof y) == 0);
        CU_ASSERT(y[W] == 0.0f && !signbit(y[W]));
        free(tables), free(xp), free(wp);
    }
}

/* Which planes take the flat layout: a 3x3 kernel where it saves vectors, at either width; at 8 lanes each
 * channel's plane comes three times. */
static void test_taps_flat_plans(void) {
    static const struct {
        ConvTapsLevel level;
        int H, W, K;
        bool flat;
    } cases[] = {
        {CONV_TAPS_AVX512, 28, 28, 3, true}, {CONV_TAPS_AVX512, 14, 14, 3, true}, {CONV_TAPS_AVX512, 7, 7, 3, true},
        {CONV_TAPS_AVX512, 16, 16, 3, false}, {CONV_TAPS_AVX2, 28, 28, 3, true}, {CONV_TAPS_AVX2, 14, 14, 3, true},
        {CONV_TAPS_AVX2, 7, 7, 3, false},   /* 7 vectors either way */
        {CONV_TAPS_AVX2, 28, 28, 5, false}, /* 5x5: rows */
        {CONV_TAPS_AVX2, 16, 16, 3, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ConvTaps p;
        float *tables = malloc(conv_taps_table_floats(cases[i].H, cases[i].W, 8) * sizeof(float));
        conv_taps_plan(&p, cases[i].level, 2, 3, cases[i].H, cases[i].W, cases[i].K, cases[i].K, tables);
        CU_ASSERT_EQUAL(p.flat, cases[i].flat);
        const size_t vplane = (size_t)(cases[i].H + 2) * cases[i].W + 2;
        if (cases[i].flat) {
            CU_ASSERT_EQUAL(p.nvf, (cases[i].H * cases[i].W + p.lanes - 1) / p.lanes);
            CU_ASSERT_EQUAL(p.vplane, vplane);
            CU_ASSERT_EQUAL(p.fplane, p.lanes == 16 ? vplane : 3 * vplane);
        } else {
            CU_ASSERT_EQUAL(p.fplane, p.pplane);
        }
        CU_ASSERT_EQUAL(conv_taps_padded_floats(&p, 2, 3), 6 * p.fplane + (size_t)p.lanes);
        CU_ASSERT_EQUAL(conv_taps_padded_rows_floats(&p, 2, 3), 6 * p.pplane + (size_t)p.lanes);
        free(tables);
    }
}

int register_nn_conv_taps_suite(void) {
    CU_pSuite s = CU_add_suite("nn_conv_taps", NULL, NULL);
    if (!s) return -1;
    const struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"fits", test_taps_fits},
        {"select", test_taps_select},
        {"kernels_match_ref_bits", test_taps_kernels_match_ref_bits},
        {"pad_matches_ref", test_taps_pad_matches_ref},
        {"ref_matches_direct", test_taps_ref_matches_direct},
        {"op_matches_gemm", test_taps_op_matches_gemm},
        {"lowrank_matches_gemm", test_taps_lowrank_matches_gemm},
        {"flat_edge_taps_add_zero", test_taps_flat_edge_zero},
        {"flat_plans", test_taps_flat_plans},
        {"dw_add_parts_order", test_taps_dw_add_parts},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return 0;
}
