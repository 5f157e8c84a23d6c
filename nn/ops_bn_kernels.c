/* ops_bn_kernels.c - the batch norm's per-channel kernels (ops.h): statistics, the affine map (with a relu after
 * it), the gradient's channel sums and the input gradient, each with the scalar `_ref` twin the tests compare
 * against. nn_batchnorm (ops_norm.c) runs them over channel ranges on the thread pool. */
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

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

/* Each block's sums are BN_LANES float lanes over its whole lanes, a serial sum of the rest (its tail), and then
 * the tail plus the lanes added in order. That last reduction is a chain of BN_LANES dependent adds: for short
 * blocks (a 14x14 plane) it is most of a block's time, so the kernels below reduce BN_PLANES blocks at once, the
 * blocks' chains interleaved (bn_reduce): every block still adds its own values in its own order, the same bits
 * as one block at a time. */
#define BN_PLANES 16

/* A channel's values are N runs of `inner` floats, C * inner apart: each run starts on a page the hardware's
 * prefetchers have not seen (they follow streams within a page), so without help every run would open with a
 * wait on memory. The kernels that walk a channel across the batch ask for the run BN_AHEAD runs ahead of the one
 * they read (nn_prefetch). */
#define BN_AHEAD 4

/* The offset of the run BN_AHEAD runs after sample n's of channel ch, in a walk over channels [.., c1) each across
 * the N samples: this channel's, then the next one's first; -1 past the walk's end. */
static inline __attribute__((always_inline)) ptrdiff_t bn_ahead(size_t n, int ch, int c1, int N, size_t stride,
                                                                size_t inner) {
    const size_t a = n + BN_AHEAD;
    if (a < (size_t)N) return (ptrdiff_t)(a * stride + (size_t)ch * inner);
    if (ch + 1 < c1 && a - (size_t)N < (size_t)N) return (ptrdiff_t)((a - (size_t)N) * stride + (size_t)(ch + 1) * inner);
    return -1;
}

/* lane[k] = the sum of x[i + k] over x[0, n)'s whole lanes; *tail = the serial sum of the rest. */
static inline __attribute__((always_inline)) void bn_lanes_sum(float *restrict lane, float *restrict tail,
                                                                const float *restrict x, size_t n) {
    float l[BN_LANES] = {0};
    size_t i = 0;
    for (; i + BN_LANES <= n; i += BN_LANES)
        for (int k = 0; k < BN_LANES; k++) l[k] += x[i + k];
    float s = 0.0f;
    for (; i < n; i++) s += x[i];
    for (int k = 0; k < BN_LANES; k++) lane[k] = l[k];
    *tail = s;
}

/* The same for sum (x - c) (l1, *a) and sum (x - c)^2 (l2, *b). */
static inline __attribute__((always_inline)) void bn_lanes_moments(float *restrict l1, float *restrict l2,
                                                                    float *restrict a, float *restrict b,
                                                                    const float *restrict x, size_t n, float c) {
    float p[BN_LANES] = {0}, q[BN_LANES] = {0};
    size_t i = 0;
    for (; i + BN_LANES <= n; i += BN_LANES)
        for (int k = 0; k < BN_LANES; k++) {
            const float d = x[i + k] - c;
            p[k] += d;
            q[k] += d * d;
        }
    float s = 0.0f, t = 0.0f;
    for (; i < n; i++) {
        const float d = x[i] - c;
        s += d;
        t += d * d;
    }
    for (int k = 0; k < BN_LANES; k++) l1[k] = p[k], l2[k] = q[k];
    *a = s;
    *b = t;
}

/* dy as the relu after the batch norm passes it back: dy where its output y = (x - m) a + b is > 0 (the relu's
 * own test on the value batchnorm_apply makes, the same operations), else 0. */
static inline __attribute__((always_inline)) float bn_relu_dy(float dy, float x, float m, float a, float b) {
    const float v = (x - m) * a + b;
    return v > 0.0f ? dy : 0.0f;
}

/* The same for sum g (l1, *s) and sum g (x - m) (l2, *d); g = dy, or dy masked by the relu (bn_relu_dy with a, b)
 * if relu (a constant where inlined). */
static inline __attribute__((always_inline)) void bn_lanes_grad_sums(float *restrict l1, float *restrict l2,
                                                                      float *restrict s, float *restrict d,
                                                                      const float *restrict dy,
                                                                      const float *restrict x, size_t n, float m,
                                                                      bool relu, float a, float b) {
    float p[BN_LANES] = {0}, q[BN_LANES] = {0};
    size_t i = 0;
    for (; i + BN_LANES <= n; i += BN_LANES)
        for (int k = 0; k < BN_LANES; k++) {
            const float g = relu ? bn_relu_dy(dy[i + k], x[i + k], m, a, b) : dy[i + k];
            p[k] += g;
            q[k] += g * (x[i + k] - m);
        }
    float u = 0.0f, v = 0.0f;
    for (; i < n; i++) {
        const float g = relu ? bn_relu_dy(dy[i], x[i], m, a, b) : dy[i];
        u += g;
        v += g * (x[i] - m);
    }
    for (int k = 0; k < BN_LANES; k++) l1[k] = p[k], l2[k] = q[k];
    *s = u;
    *d = v;
}

/* acc[p] += lane[p][0] + ... + lane[p][BN_LANES - 1], in that order, for the P blocks at once: the blocks' chains
 * interleave (the loop over p is innermost). */
static inline __attribute__((always_inline)) void bn_reduce(float *restrict acc, const float (*restrict lane)[BN_LANES],
                                                             int P) {
    for (int k = 0; k < BN_LANES; k++)
        for (int p = 0; p < P; p++) acc[p] += lane[p][k];
}

/* m3[p] = {c, s1, s2} of the P <= BN_PLANES blocks x + p pitch of len values each (batchnorm_stats's block
 * statistics: the shift c, the block's sum over len, and the moments about it), the reductions interleaved. */
static inline __attribute__((always_inline)) void bn_planes_stats(float (*restrict m3)[3], const float *x, size_t pitch,
                                                                   size_t len, int P) {
    float l1[BN_PLANES][BN_LANES], l2[BN_PLANES][BN_LANES], a[BN_PLANES], b[BN_PLANES], c[BN_PLANES];
    for (int p = 0; p < P; p++) bn_lanes_sum(l1[p], &a[p], x + (size_t)p * pitch, len);
    bn_reduce(a, l1, P);
    for (int p = 0; p < P; p++) c[p] = a[p] / (float)len;
    for (int p = 0; p < P; p++) bn_lanes_moments(l1[p], l2[p], &a[p], &b[p], x + (size_t)p * pitch, len, c[p]);
    bn_reduce(a, l1, P);
    bn_reduce(b, l2, P);
    for (int p = 0; p < P; p++) m3[p][0] = c[p], m3[p][1] = a[p], m3[p][2] = b[p];
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

/* The block m3 of len values merged into a channel's running (count, mean, M2), in double, by Chan et al.'s
 * pairwise update. */
static inline void bn_block_merge(double *cnt, double *m, double *m2, size_t len, const float m3[3]) {
    const double nb = (double)len, mb = m3[0] + (double)m3[1] / nb;
    const double m2b = (double)m3[2] - (double)m3[1] * (double)m3[1] / nb;
    const double tot = *cnt + nb, delta = mb - *m;
    *m += delta * nb / tot;
    *m2 += m2b + delta * delta * *cnt * nb / tot;
    *cnt = tot;
}

/* One read of each block from memory (bn_planes_stats), the blocks merged in order (bn_block_merge). */
NN_SIMD_CLONES
void batchnorm_stats(double *mean, double *var, const float *x, int N, int C, size_t inner, int c0, int c1) {
    if (inner < BN_LANES) {
        batchnorm_stats_ref(mean, var, x, N, C, inner, c0, c1);
        return;
    }
    const size_t stride = (size_t)C * inner;
    for (int ch = c0; ch < c1; ch++) {
        double cnt = 0.0, m = 0.0, m2 = 0.0;
        if (inner <= BN_BLOCK) { /* a plane per sample, one block each: BN_PLANES samples' planes at once */
            for (int n0 = 0; n0 < N; n0 += BN_PLANES) {
                const int P = N - n0 < BN_PLANES ? N - n0 : BN_PLANES;
                float m3[BN_PLANES][3];
                bn_planes_stats(m3, x + (size_t)n0 * stride + (size_t)ch * inner, stride, inner, P);
                for (int p = 0; p < P; p++) bn_block_merge(&cnt, &m, &m2, inner, m3[p]);
            }
        } else {
            for (int n = 0; n < N; n++) {
                const float *xp = x + n * stride + (size_t)ch * inner;
                for (size_t i0 = 0; i0 < inner; i0 += BN_BLOCK) {
                    const size_t len = inner - i0 < BN_BLOCK ? inner - i0 : BN_BLOCK;
                    float m3[1][3];
                    bn_planes_stats(m3, xp + i0, 0, len, 1);
                    bn_block_merge(&cnt, &m, &m2, len, m3[0]);
                }
            }
        }
        mean[ch] = m;
        var[ch] = (m2 > 0.0 ? m2 : 0.0) / cnt;
    }
}

/* A plane of BN_LANES..BN_BLOCK values is one block of batchnorm_stats: its m3 can be made by whoever writes the
 * plane, while it is in cache, and merged later by batchnorm_stats_planes. */
bool batchnorm_plane_fits(size_t inner) { return inner >= BN_LANES && inner <= BN_BLOCK; }

NN_SIMD_CLONES
void batchnorm_plane_moments(float *m3, const float *x, size_t inner, int P) {
    for (int p0 = 0; p0 < P; p0 += BN_PLANES)
        bn_planes_stats((float (*)[3])(m3 + 3 * (size_t)p0), x + (size_t)p0 * inner, inner, inner,
                        P - p0 < BN_PLANES ? P - p0 : BN_PLANES);
}

void batchnorm_stats_planes(double *mean, double *var, const float *m3, int N, int C, size_t inner, int c0, int c1) {
    for (int ch = c0; ch < c1; ch++) {
        double cnt = 0.0, m = 0.0, m2 = 0.0;
        for (int n = 0; n < N; n++) bn_block_merge(&cnt, &m, &m2, inner, m3 + 3 * ((size_t)n * C + ch));
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
            const ptrdiff_t ahead = bn_ahead((size_t)n, ch, c1, N, stride, inner);
            if (ahead >= 0) nn_prefetch(x + ahead, inner);
            for (size_t i = 0; i < inner; i++) {
                const float v = (xp[i] - m) * a + b;
                yp[i] = relu ? (v > 0.0f ? v : 0.0f) : v;
            }
        }
    }
}

/* Eight floats as one GCC vector, for rows of a few floats (14 on DS-CNN): the compiler's loop would run them in
 * its scalar remainder. The last eight of a row overlap the ones before (the same values written twice). */
typedef float BnVec8 __attribute__((vector_size(8 * sizeof(float))));
typedef int BnVec8i __attribute__((vector_size(8 * sizeof(int))));

static inline __attribute__((always_inline)) void bn_relu8(float *restrict d, const float *restrict s, float m,
                                                           float a, float b) {
    BnVec8 v;
    memcpy(&v, s, sizeof v);
    v = (v - m) * a + b;                                      /* bn_apply_channels's operations, lane by lane */
    const BnVec8i keep = v > (BnVec8){0};                     /* v > 0 ? v : 0: NaN and -0 give +0 */
    v = (BnVec8)((BnVec8i)v & keep);
    memcpy(d, &v, sizeof v);
}

NN_SIMD_CLONES
void batchnorm_relu_rows(float *dst, size_t ldd, const float *x, int rows, int cols, float m, float a, float b) {
    for (int h = 0; h < rows; h++) {
        const float *restrict xp = x + (size_t)h * cols;
        float *restrict yp = dst + (size_t)h * ldd;
        if (cols < 8) {
            for (int i = 0; i < cols; i++) {
                const float v = (xp[i] - m) * a + b;
                yp[i] = v > 0.0f ? v : 0.0f;
            }
            continue;
        }
        int i = 0;
        for (; i + 8 <= cols; i += 8) bn_relu8(yp + i, xp + i, m, a, b);
        if (i < cols) bn_relu8(yp + cols - 8, xp + cols - 8, m, a, b);
    }
}

NN_SIMD_CLONES
void batchnorm_view_add(float *y, const float *x, const float *s, size_t n, float m, float a, float b, bool relu,
                        bool relu_sum) {
    if (!s) {
        for (size_t i = 0; i < n; i++) {
            const float v = (x[i] - m) * a + b;
            y[i] = relu ? (v > 0.0f ? v : 0.0f) : v;
        }
        return;
    }
    for (size_t i = 0; i < n; i++) { /* y may be s: each element read before it is written */
        const float v = (x[i] - m) * a + b, u = (relu ? (v > 0.0f ? v : 0.0f) : v) + s[i];
        y[i] = relu_sum ? (u > 0.0f ? u : 0.0f) : u;
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
        /* blocks of at most BN_BLOCK values: a plane per sample, or a plane's pieces; BN_PLANES at once */
        const size_t pieces = (inner + BN_BLOCK - 1) / BN_BLOCK, blocks = (size_t)N * pieces;
        for (size_t q0 = 0; q0 < blocks; q0 += BN_PLANES) {
            const int P = blocks - q0 < BN_PLANES ? (int)(blocks - q0) : BN_PLANES;
            float l1[BN_PLANES][BN_LANES], l2[BN_PLANES][BN_LANES], bs[BN_PLANES], bd[BN_PLANES];
            for (int p = 0; p < P; p++) {
                const size_t n = (q0 + p) / pieces, i0 = (q0 + p) % pieces * BN_BLOCK;
                const size_t off = n * stride + (size_t)ch * inner + i0;
                const size_t len = inner - i0 < BN_BLOCK ? inner - i0 : BN_BLOCK;
                const ptrdiff_t ahead = pieces == 1 ? bn_ahead(n, ch, c1, N, stride, inner) : -1;
                if (ahead >= 0) nn_prefetch(dy + ahead, inner), nn_prefetch(x + ahead, inner);
                bn_lanes_grad_sums(l1[p], l2[p], &bs[p], &bd[p], dy + off, x + off, len, m, relu, a, b);
            }
            bn_reduce(bs, l1, P);
            bn_reduce(bd, l2, P);
            for (int p = 0; p < P; p++) s += bs[p], d += bd[p];
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
            const ptrdiff_t ahead = bn_ahead((size_t)n, ch, c1, N, stride, inner);
            if (ahead >= 0) {
                nn_prefetch(x + ahead, inner), nn_prefetch(dy + ahead, inner);
                if (accumulate && dx != dy) nn_prefetch(dx + ahead, inner);
            }
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
