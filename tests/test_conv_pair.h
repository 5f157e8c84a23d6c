/* test_conv_pair.h - a forward and backward of two convolutions sharing their input, for the suites that compare
 * the convolution's kernels with each other (nn_conv_taps, nn_conv_wino). */
#ifndef QTRAIN_TESTS_TEST_CONV_PAIR_H
#define QTRAIN_TESTS_TEST_CONV_PAIR_H

#include <stdbool.h>
#include <stddef.h>

#include "nn/ops.h"

typedef struct {
    float *y, *dx, *dw, *db; /* malloc'd: the summed output, x's, both weights' (one after the other), the bias's */
    size_t ny, nx, nw;       /* nw: both weights' floats */
} ConvPairOut;

/* nn_conv2d_fused (stride 1, padding pad, epilogue epi) of x (N, C, H, W) with two weights (OC, C, KH, KW), the
 * first with a bias; their outputs added, and the backward from a drawn gradient (the second conv's adds into the
 * dx the first wrote). The kernels are those conv_taps_max_level and conv_wino_enabled choose when it runs. The
 * same draws every call. False (the tape's error printed) if a step failed. */
bool test_conv_pair_run(int N, int C, int H, int W, int OC, int KH, int KW, int pad, ConvEpilogue epi,
                        ConvPairOut *out);
void test_conv_pair_free(ConvPairOut *o);

#endif
