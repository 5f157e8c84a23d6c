/* ops_bn_kernels.c - the batch norm's per-channel kernels (ops.h): statistics, the affine map (with a relu after
 * it), the gradient's channel sums and the input gradient, each with the scalar `_ref` twin the tests compare
 * against. nn_batchnorm (ops_norm.c) runs them over channel ranges on the thread pool. */
#include <stdbool.h>
#include <stddef.h>

#include "ops.h"

/* x is viewed as (N, C, inner): inner = 1 for (N, C), L for (N, C, L), H*W for
 * (N, C, H, W). A channel's elements are N runs of `inner` floats, C*inner
 * apart. Every kernel works on a range of channels [c0, c1), and a channel's
 * arithmetic does not depend on the range it falls in, so splitting the
 * channels over any number of threads gives the same bits.
 *
 * The fast kernels cut each run into blocks of at most BN_BLOCK floats and
 * sum a block in BN_LANES float lanes (independent chains the compiler
 * vectorises; the plain `s += x[i]` in double of the `_ref` twins is one
 * serial chain), then carry the blocks' sums in double: a float sum of a
 * block of 1024 loses ~10 bits at worst, far less than the fixtures allow,
 * and the double carry keeps a channel of 100k values from losing more.
 * Runs shorter than BN_LANES take the `_ref` kernels (no block to speak of). */
#define BN_LANES 16
#define BN_BLOCK 1024

/* The sum of x[0, n) in BN_LANES lanes, the lanes then added in order. */
static inline float bn_block_sum(const float *restrict x, size_t n) {
    float lane[BN_LANES] = {0};
    size_t i = 0;
    for (; i + BN_LANES <= n; i += BN_LANES)
        for (int k = 0; k < BN_LANES; k++) lane[k] += x[i + k];
    float s = 0.0f;
    for (; i < n; i++) s += x[i];
    for (int k = 0; k < BN_LANES; k++) s += lane[k];
    return s;
}

/* *s1 = sum (x - c), *s2 = sum (x - c)^2 over x[0, n), in lanes. */
static inline void bn_block_moments(const float *restrict x, size_t n, float c, float *s1, float *s2) {
    float l1[BN_LANES] = {0}, l2[BN_LANES] = {0};
    size_t i = 0;
    for (; i + BN_LANES <= n; i += BN_LANES)
        for (int k = 0; k < BN_LANES; k++) {
            const float d = x[i + k] - c;
            l1[k] += d;
            l2[k] += d * d;
        }
    float a = 0.0f, b = 0.0f;
    for (; i < n; i++) {
        const float d = x[i] - c;
        a += d;
        b += d * d;
    }
    for (int k = 0; k < BN_LANES; k++) a += l1[k], b += l2[k];
    *s1 = a;
    *s2 = b;
}

/* dy as the relu after the batch norm passes it back: dy where its output y = (x - m) a + b is > 0 (the relu's
 * own test on the value batchnorm_apply makes, the same operations), else 0. */
static inline __attribute__((always_inline)) float bn_relu_dy(float dy, float x, float m, float a, float b) {
    const float v = (x - m) * a + b;
    return v > 0.0f ? dy : 0.0f;
}

/* *sdy = sum g, *dot = sum g (x - m) over [0, n), in lanes; g = dy, or dy masked by the relu (bn_relu_dy with a,
 * b) if relu (a constant where inlined). */
static inline __attribute__((always_inline)) void bn_block_grad_sums(const float *restrict dy, const float *restrict x,
                                                                     size_t n, float m, bool relu, float a, float b,
                                                                     float *sdy, float *dot) {
    float l1[BN_LANES] = {0}, l2[BN_LANES] = {0};
    size_t i = 0;
    for (; i + BN_LANES <= n; i += BN_LANES)
        for (int k = 0; k < BN_LANES; k++) {
            const float g = relu ? bn_relu_dy(dy[i + k], x[i + k], m, a, b) : dy[i + k];
            l1[k] += g;
            l2[k] += g * (x[i + k] - m);
        }
    float s = 0.0f, d = 0.0f;
    for (; i < n; i++) {
        const float g = relu ? bn_relu_dy(dy[i], x[i], m, a, b) : dy[i];
        s += g;
        d += g * (x[i] - m);
    }
    for (int k = 0; k < BN_LANES; k++) s += l1[k], d += l2[k];
    *sdy = s;
    *dot = d;
}

void batchnorm_stats_ref(double *mean, double *var, const float *x, int N, int C, size_t inner, int c0, int c1) {
    const size_t stride = (size_t)C * inner;
    const double count = (double)N * (double)inner;
    for (int ch = c0; ch < c1; ch++) {
        double sum = 0.0, ss = 0.0;
        for (int n = 0; n < N; n++) {
            const float *xp = x + n * stride + (size_t)ch * inner;
            for (size_t i = 0; i < inner; i++) sum += xp[i];
        }
        const double m = sum / count;
        for (int n = 0; n < N; n++) {
            const float *xp = x + n * stride + (size_t)ch * inner;
            for (size_t i = 0; i < inner; i++) ss += ((double)xp[i] - m) * ((double)xp[i] - m);
        }
        mean[ch] = m;
        var[ch] = ss / count;
    }
}

/* One read of each block from memory: its sum gives a shift c near the
 * block's mean, and the moments about c (re-reading the block from L1)
 * give the block's mean and squared deviations without the cancellation
 * of E[x^2] - E[x]^2. Blocks merge in double by Chan et al.'s pairwise
 * update (count, mean, M2). */
NN_SIMD_CLONES
void batchnorm_stats(double *mean, double *var, const float *x, int N, int C, size_t inner, int c0, int c1) {
    if (inner < BN_LANES) {
        batchnorm_stats_ref(mean, var, x, N, C, inner, c0, c1);
        return;
    }
    const size_t stride = (size_t)C * inner;
    for (int ch = c0; ch < c1; ch++) {
        double cnt = 0.0, m = 0.0, m2 = 0.0;
        for (int n = 0; n < N; n++) {
            const float *xp = x + n * stride + (size_t)ch * inner;
            for (size_t i0 = 0; i0 < inner; i0 += BN_BLOCK) {
                const size_t len = inner - i0 < BN_BLOCK ? inner - i0 : BN_BLOCK;
                const float c = bn_block_sum(xp + i0, len) / (float)len;
                float s1, s2;
                bn_block_moments(xp + i0, len, c, &s1, &s2);
                const double nb = (double)len, mb = c + (double)s1 / nb;
                const double m2b = (double)s2 - (double)s1 * (double)s1 / nb;
                const double tot = cnt + nb, delta = mb - m;
                m += delta * nb / tot;
                m2 += m2b + delta * delta * cnt * nb / tot;
                cnt = tot;
            }
        }
        mean[ch] = m;
        var[ch] = (m2 > 0.0 ? m2 : 0.0) / cnt;
    }
}

/* y = (x - mean) * scale + beta, relu'd (y > 0 ? y : 0, as nn_relu_inplace) if relu; inlined into each clone
 * with relu a constant. */
static inline __attribute__((always_inline)) void bn_apply_channels(float *y, const float *x, const float *mean,
                                                                    const float *scale, const float *beta, int N,
                                                                    int C, size_t inner, int c0, int c1, bool relu) {
    const size_t stride = (size_t)C * inner;
    for (int ch = c0; ch < c1; ch++) {
        const float m = mean[ch], a = scale[ch], b = beta ? beta[ch] : 0.0f;
        for (int n = 0; n < N; n++) {
            const size_t off = n * stride + (size_t)ch * inner;
            const float *restrict xp = x + off;
            float *restrict yp = y + off;
            for (size_t i = 0; i < inner; i++) {
                const float v = (xp[i] - m) * a + b;
                yp[i] = relu ? (v > 0.0f ? v : 0.0f) : v;
            }
        }
    }
}

NN_SIMD_CLONES
void batchnorm_apply(float *y, const float *x, const float *mean, const float *scale, const float *beta, int N,
                     int C, size_t inner, int c0, int c1) {
    bn_apply_channels(y, x, mean, scale, beta, N, C, inner, c0, c1, false);
}

/* batchnorm_apply then relu in one pass: the same floats. */
NN_SIMD_CLONES
void batchnorm_apply_relu(float *y, const float *x, const float *mean, const float *scale, const float *beta,
                                 int N, int C, size_t inner, int c0, int c1) {
    bn_apply_channels(y, x, mean, scale, beta, N, C, inner, c0, c1, true);
}

/* The sums' _ref twins: one serial chain in double; scale NULL: dy unmasked. */
static void grad_sums_ref(double *sum_dy, double *dot, const float *dy, const float *x, const float *mean,
                          const float *scale, const float *beta, int N, int C, size_t inner, int c0, int c1) {
    const size_t stride = (size_t)C * inner;
    for (int ch = c0; ch < c1; ch++) {
        const float m = mean[ch], a = scale ? scale[ch] : 0.0f, b = beta ? beta[ch] : 0.0f;
        double s = 0.0, d = 0.0;
        for (int n = 0; n < N; n++) {
            const size_t off = n * stride + (size_t)ch * inner;
            const float *xp = x + off, *dyp = dy + off;
            for (size_t i = 0; i < inner; i++) {
                const float g = scale ? bn_relu_dy(dyp[i], xp[i], m, a, b) : dyp[i];
                s += g;
                d += (double)g * (double)(xp[i] - m);
            }
        }
        sum_dy[ch] = s;
        dot[ch] = d;
    }
}

void batchnorm_grad_sums_ref(double *sum_dy, double *dot, const float *dy, const float *x, const float *mean, int N,
                             int C, size_t inner, int c0, int c1) {
    grad_sums_ref(sum_dy, dot, dy, x, mean, NULL, NULL, N, C, inner, c0, c1);
}

void batchnorm_grad_sums_relu_ref(double *sum_dy, double *dot, const float *dy, const float *x, const float *mean,
                                  const float *scale, const float *beta, int N, int C, size_t inner, int c0, int c1) {
    grad_sums_ref(sum_dy, dot, dy, x, mean, scale, beta, N, C, inner, c0, c1);
}

/* The fast sums over channels [c0, c1): blocks of lanes carried in double; relu a constant where inlined. */
static inline __attribute__((always_inline)) void grad_sums_channels(double *sum_dy, double *dot, const float *dy,
                                                                     const float *x, const float *mean,
                                                                     const float *scale, const float *beta, int N,
                                                                     int C, size_t inner, int c0, int c1, bool relu) {
    const size_t stride = (size_t)C * inner;
    for (int ch = c0; ch < c1; ch++) {
        const float m = mean[ch], a = relu ? scale[ch] : 0.0f, b = relu && beta ? beta[ch] : 0.0f;
        double s = 0.0, d = 0.0;
        for (int n = 0; n < N; n++) {
            const size_t off = n * stride + (size_t)ch * inner;
            for (size_t i0 = 0; i0 < inner; i0 += BN_BLOCK) {
                const size_t len = inner - i0 < BN_BLOCK ? inner - i0 : BN_BLOCK;
                float bs, bd;
                bn_block_grad_sums(dy + off + i0, x + off + i0, len, m, relu, a, b, &bs, &bd);
                s += bs;
                d += bd;
            }
        }
        sum_dy[ch] = s;
        dot[ch] = d;
    }
}

NN_SIMD_CLONES
void batchnorm_grad_sums(double *sum_dy, double *dot, const float *dy, const float *x, const float *mean, int N,
                         int C, size_t inner, int c0, int c1) {
    if (inner < BN_LANES) grad_sums_ref(sum_dy, dot, dy, x, mean, NULL, NULL, N, C, inner, c0, c1);
    else grad_sums_channels(sum_dy, dot, dy, x, mean, NULL, NULL, N, C, inner, c0, c1, false);
}

NN_SIMD_CLONES
void batchnorm_grad_sums_relu(double *sum_dy, double *dot, const float *dy, const float *x, const float *mean,
                              const float *scale, const float *beta, int N, int C, size_t inner, int c0, int c1) {
    if (inner < BN_LANES) grad_sums_ref(sum_dy, dot, dy, x, mean, scale, beta, N, C, inner, c0, c1);
    else grad_sums_channels(sum_dy, dot, dy, x, mean, scale, beta, N, C, inner, c0, c1, true);
}

/* dx from dy (masked by the relu with ms, mb if relu), x and the channel constants; relu a constant where
 * inlined. */
static inline __attribute__((always_inline)) void grad_input_channels(float *dx, bool accumulate, const float *dy,
                                                                      const float *x, const float *mean,
                                                                      const float *scale, const float *k1,
                                                                      const float *k2, const float *ms,
                                                                      const float *mb, int N, int C, size_t inner,
                                                                      int c0, int c1, bool relu) {
    const size_t stride = (size_t)C * inner;
    for (int ch = c0; ch < c1; ch++) {
        const float m = mean[ch], a = scale[ch], p = k1[ch], q = k2[ch];
        const float ra = relu ? ms[ch] : 0.0f, rb = relu && mb ? mb[ch] : 0.0f;
        for (int n = 0; n < N; n++) {
            const size_t off = n * stride + (size_t)ch * inner;
            const float *restrict xp = x + off, *dyp = dy + off; /* dx may be dy */
            float *dxp = dx + off;
            if (accumulate)
                for (size_t i = 0; i < inner; i++) {
                    const float g = relu ? bn_relu_dy(dyp[i], xp[i], m, ra, rb) : dyp[i];
                    dxp[i] += (g - p - (xp[i] - m) * q) * a;
                }
            else
                for (size_t i = 0; i < inner; i++) {
                    const float g = relu ? bn_relu_dy(dyp[i], xp[i], m, ra, rb) : dyp[i];
                    dxp[i] = (g - p - (xp[i] - m) * q) * a;
                }
        }
    }
}

NN_SIMD_CLONES
void batchnorm_grad_input(float *dx, bool accumulate, const float *dy, const float *x, const float *mean,
                          const float *scale, const float *k1, const float *k2, int N, int C, size_t inner, int c0,
                          int c1) {
    grad_input_channels(dx, accumulate, dy, x, mean, scale, k1, k2, NULL, NULL, N, C, inner, c0, c1, false);
}

NN_SIMD_CLONES
void batchnorm_grad_input_relu(float *dx, bool accumulate, const float *dy, const float *x, const float *mean,
                               const float *scale, const float *beta, const float *k1, const float *k2, int N, int C,
                               size_t inner, int c0, int c1) {
    grad_input_channels(dx, accumulate, dy, x, mean, scale, k1, k2, scale, beta, N, C, inner, c0, c1, true);
}
