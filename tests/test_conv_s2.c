/* test_conv_s2.c - im2col's stride-2 path (an input twice the output's size, split into its parity planes and
 * copied tap by tap) against the gather it replaces, element for element; col2im's (each tap added into its parity
 * plane, the planes merged back) against the strided loops, bit for bit. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/ops.h"
#include "nn/ops_conv_internal.h"
#include "test_util.h"

typedef struct {
    int N, C, H, W, K, padding;
} S2Case;

/* col (C*K*K, N*OH*OW) by its definition: x at (2 oh + kh - padding, 2 ow + kw - padding), 0 outside. */
static void im2col_direct(float *col, const float *x, const S2Case *k, int OH, int OW) {
    const size_t n_cols = (size_t)k->N * OH * OW;
    for (int c = 0; c < k->C; c++)
        for (int kh = 0; kh < k->K; kh++)
            for (int kw = 0; kw < k->K; kw++)
                for (int n = 0; n < k->N; n++)
                    for (int oh = 0; oh < OH; oh++)
                        for (int ow = 0; ow < OW; ow++) {
                            const int ih = 2 * oh + kh - k->padding, iw = 2 * ow + kw - k->padding;
                            const bool in = ih >= 0 && ih < k->H && iw >= 0 && iw < k->W;
                            col[((size_t)(c * k->K + kh) * k->K + kw) * n_cols + ((size_t)n * OH + oh) * OW + ow] =
                                in ? x[(((size_t)n * k->C + c) * k->H + ih) * k->W + iw] : 0.0f;
                        }
}

static const S2Case cases[] = {
    {3, 4, 28, 28, 3, 1}, /* ResNet-8's first subsampling conv */
    {2, 3, 14, 14, 3, 1}, /* its second: 7x7 parity planes */
    {2, 3, 14, 10, 1, 0}, /* a 1x1 shortcut, non-square */
    {1, 2, 40, 34, 3, 1}, /* rows of 17 and 20 outputs: past the vector rows (16), the scalar ones */
    {1, 2, 4, 32, 3, 1},  /* rows of 16 outputs, whole vectors */
    {2, 2, 12, 12, 5, 2}, /* taps two rows out */
    {2, 2, 8, 8, 4, 1},   /* an even kernel: output 4x4 */
    {1, 2, 8, 6, 3, 0},   /* no padding: output 3x2, H != 2 OH, the general loops */
    {2, 2, 7, 7, 3, 1},   /* odd input: the general loops */
    {1, 1, 96, 96, 3, 1}, /* parity planes too large for the stack: the general loops */
};

static void test_im2col_stride2(void) {
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const S2Case *k = &cases[i];
        const int OH = (k->H + 2 * k->padding - k->K) / 2 + 1, OW = (k->W + 2 * k->padding - k->K) / 2 + 1;
        const size_t nx = (size_t)k->N * k->C * k->H * k->W, ncol = (size_t)k->C * k->K * k->K * k->N * OH * OW;
        float *x = malloc(nx * sizeof *x), *got = malloc(ncol * sizeof *got), *want = malloc(ncol * sizeof *want);
        for (size_t j = 0; j < nx; j++) x[j] = (float)(j + 1); /* every input distinct and nonzero */
        for (size_t j = 0; j < ncol; j++) got[j] = -1.0f;
        im2col(got, x, k->N, k->C, k->H, k->W, k->K, k->K, 2, k->padding, OH, OW);
        im2col_direct(want, x, k, OH, OW);
        const bool same = memcmp(got, want, ncol * sizeof *got) == 0;
        CU_ASSERT(same);
        if (!same)
            fprintf(stderr, "\n  case %zu: N %d C %d %dx%d kernel %d padding %d differs\n", i, k->N, k->C, k->H, k->W,
                    k->K, k->padding);
        free(x), free(got), free(want);
    }
}

/* col2im_consume (dcol is scratch) against col2im's strided loops, adding into a gradient already there and
 * written: the same bits on every case (the parity planes take those whose taps read all four planes). */
static void test_col2im_stride2(void) {
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const S2Case *k = &cases[i];
        const int OH = (k->H + 2 * k->padding - k->K) / 2 + 1, OW = (k->W + 2 * k->padding - k->K) / 2 + 1;
        const size_t nx = (size_t)k->N * k->C * k->H * k->W, ncol = (size_t)k->C * k->K * k->K * k->N * OH * OW;
        for (int write = 0; write <= 1; write++) {
            float *dcol = test_random_uniform(ncol, 40 + (unsigned)i, -1.0f, 1.0f);
            float *dx0 = test_random_uniform(nx, 60 + (unsigned)i, -1.0f, 1.0f);
            float *want = malloc(nx * sizeof *want), *got = malloc(nx * sizeof *got);
            for (size_t j = 0; j < nx; j++) want[j] = write ? 0.0f : dx0[j], got[j] = write ? NAN : dx0[j];
            col2im(want, dcol, k->N, k->C, k->H, k->W, k->K, k->K, 2, k->padding, OH, OW);
            col2im_consume(got, dcol, k->N, k->C, k->H, k->W, k->K, k->K, 2, k->padding, OH, OW, write); /* last */
            const bool same = memcmp(got, want, nx * sizeof *got) == 0;
            CU_ASSERT(same);
            if (!same)
                fprintf(stderr, "\n  case %zu (%s): N %d C %d %dx%d kernel %d padding %d differs\n", i,
                        write ? "written" : "added", k->N, k->C, k->H, k->W, k->K, k->padding);
            free(dcol), free(dx0), free(want), free(got);
        }
    }
}

int register_nn_conv_s2_suite(void) {
    CU_pSuite s = CU_add_suite("nn_conv_s2", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "im2col stride 2: parity planes give the direct gather's columns", test_im2col_stride2) ||
                   !CU_add_test(s, "col2im stride 2: parity planes give the strided loops' bits, written and added",
                                test_col2im_stride2)
               ? -1
               : 0;
}
