/* pool2x2.h - the max of one 2x2 window, for nn/ only (ops_pool.c and the
 * fused epilogue of ops_conv.c): both must pick the same winner.
 *
 * No data-dependent branch: on ReLU outputs a compare goes either way about
 * half the time, and mispredictions made pooling the slowest op of the CNN.
 * The max is a chain of `v > m ? v : m` (one maxss each) and the winner's
 * index in 0..3 (a, b, c, d = row-major window order) is integer arithmetic
 * on the comparison results. Ties go to the first; the first NaN wins, as in
 * the generic pooling loops. */
#ifndef QTRAIN_NN_POOL2X2_H
#define QTRAIN_NN_POOL2X2_H

#include <math.h>

static inline float pool2x2_window(float a, float b, float c, float d, int *winner) {
    if ((a != a) | (b != b) | (c != c) | (d != d)) {
        *winner = a != a ? 0 : b != b ? 1 : c != c ? 2 : 3; /* rare */
        return NAN;
    }
    int t = b > a;
    float m = b > a ? b : a;
    int k = t;
    t = c > m;
    m = c > m ? c : m;
    k += t * (2 - k);
    t = d > m;
    m = d > m ? d : m;
    k += t * (3 - k);
    *winner = k;
    return m;
}

#endif
