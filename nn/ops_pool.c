/* ops_pool.c - max and average pooling over (N, C, H, W).
 *
 * The 2x2 / stride-2 max of a window is nn/pool2x2.h's, shared with the
 * convolution's fused relu + maxpool epilogue (ops_conv.c). */
#include "ops.h"

#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "base/parallel.h"
#include "pool2x2.h"

#define SHAPE_STR_MAX 64

/* ---- pooling ---------------------------------------------------------------- */

/* x: (N, C, H, W). QT_OK and the output size filled, or the error, set on the tape. */
static QtStatus pool2d_check(Tape *t, const char *op, const Var *x, int kernel, int stride, int *OH, int *OW) {
    char xs[SHAPE_STR_MAX];
    tensor_shape_str(&x->value, xs, sizeof xs);
    if (x->value.ndim != 4)
        return qt_error_set(&t->err, QT_ERR_SHAPE, "%s: input %s must be 4-D (N, C, H, W)", op, xs);
    if (kernel < 1 || stride < 1)
        return qt_error_set(&t->err, QT_ERR_ARG, "%s: kernel and stride must be >= 1, got kernel %d, stride %d "
                            "(input %s)", op, kernel, stride, xs);
    const int H = x->value.shape[2], W = x->value.shape[3];
    if (kernel > H || kernel > W)
        return qt_error_set(&t->err, QT_ERR_SHAPE, "%s: kernel %dx%d is larger than input %s (H %d, W %d); "
                            "the output would be empty", op, kernel, kernel, xs, H, W);
    /* maxpool2d saves in-plane argmax offsets as int32. */
    if ((long long)H * W > INT32_MAX)
        return qt_error_set(&t->err, QT_ERR_ARG, "%s: input %s: an H*W plane is too large to index", op, xs);
    *OH = (H - kernel) / stride + 1;
    *OW = (W - kernel) / stride + 1;
    return QT_OK;
}

/* Tests set this to compare the 2x2 fast path with the generic loops. */
bool maxpool_force_generic = false;

/* y: (planes, OH, OW); argmax: (planes, OH, OW) offsets ih*W + iw of each
 * window's winner within its (H, W) plane of x: (planes, H, W). The 2x2,
 * stride-2 case every reference CNN uses, through pool2x2_window. */
static void maxpool2d_forward_2x2(float *y, int32_t *argmax, const float *x, int planes, int H, int W, int OH,
                                  int OW) {
    for (int p = 0; p < planes; p++) {
        const float *xp = x + (size_t)p * H * W;
        float *yp = y + (size_t)p * OH * OW;
        int32_t *ap = argmax + (size_t)p * OH * OW;
        for (int oh = 0; oh < OH; oh++) {
            const float *r0 = xp + (size_t)(2 * oh) * W, *r1 = r0 + W;
            for (int ow = 0; ow < OW; ow++) {
                int k;
                yp[oh * OW + ow] = pool2x2_window(r0[2 * ow], r0[2 * ow + 1], r1[2 * ow], r1[2 * ow + 1], &k);
                ap[oh * OW + ow] = (2 * oh + (k >> 1)) * W + 2 * ow + (k & 1);
            }
        }
    }
}

static void maxpool2d_forward_planes(float *y, int32_t *argmax, const float *x, int planes, int H, int W,
                                     int kernel, int stride, int OH, int OW) {
    if (kernel == 2 && stride == 2 && !maxpool_force_generic) {
        maxpool2d_forward_2x2(y, argmax, x, planes, H, W, OH, OW);
        return;
    }
    for (int p = 0; p < planes; p++) {
        const float *xp = x + (size_t)p * H * W;
        for (int oh = 0; oh < OH; oh++)
            for (int ow = 0; ow < OW; ow++) {
                int best_at = oh * stride * W + ow * stride;
                float best = xp[best_at];
                for (int kh = 0; kh < kernel; kh++)
                    for (int kw = 0; kw < kernel; kw++) {
                        const int at = (oh * stride + kh) * W + ow * stride + kw;
                        const float v = xp[at];
                        /* Strict > keeps the first of equal values; a NaN wins (once) so it
                         * propagates instead of being hidden by the comparison. */
                        /* Selects, not a branch: on ReLU outputs the comparison
                         * goes either way half the time and mispredicts. */
                        const bool take = (v > best) | ((v != v) & (best == best)); /* | &: no short-circuit branch */
                        best = take ? v : best;
                        best_at = take ? at : best_at;
                    }
                const size_t o = ((size_t)p * OH + oh) * OW + ow;
                y[o] = best;
                argmax[o] = best_at;
            }
    }
}

static void maxpool2d_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0];
    if (!x->requires_grad) return;
    const int32_t *argmax = node->ctx; /* (N, C, OH, OW), offsets within each (H, W) plane */
    float *dx = tape_grad(t, x);       /* (N, C, H, W) */
    if (!dx) return;
    const float *dy = node->out->grad; /* (N, C, OH, OW) */
    const size_t plane = (size_t)x->value.shape[2] * x->value.shape[3];
    const size_t out_plane = (size_t)node->out->value.shape[2] * node->out->value.shape[3];
    const size_t planes = (size_t)x->value.shape[0] * x->value.shape[1];
    for (size_t p = 0; p < planes; p++)
        for (size_t o = 0; o < out_plane; o++) dx[p * plane + argmax[p * out_plane + o]] += dy[p * out_plane + o];
}

typedef struct {
    float *y;
    int32_t *argmax;
    const float *x;
    int planes, H, W, kernel, stride, OH, OW;
} PoolJob;

static void maxpool2d_task(void *ctx, int task, int n_tasks) {
    const PoolJob *j = ctx;
    int lo, hi;
    parallel_range(j->planes, task, n_tasks, &lo, &hi);
    const size_t in = (size_t)j->H * j->W, out = (size_t)j->OH * j->OW;
    maxpool2d_forward_planes(j->y + lo * out, j->argmax + lo * out, j->x + lo * in, hi - lo, j->H, j->W, j->kernel,
                             j->stride, j->OH, j->OW);
}

/* Planes split over the pool: each plane's result does not depend on who computes it. */
static void maxpool2d_forward(float *y, int32_t *argmax, const float *x, int planes, int H, int W, int kernel,
                              int stride, int OH, int OW) {
    PoolJob j = {y, argmax, x, planes, H, W, kernel, stride, OH, OW};
    int tasks = (size_t)planes * H * W < (1u << 16) ? 1 : parallel_get_threads();
    parallel_run(tasks < planes ? tasks : planes, maxpool2d_task, &j);
}

/* x: (N, C, H, W) -> (N, C, OH, OW). */
Var *nn_maxpool2d(Tape *t, Var *x, int kernel, int stride) {
    if (!t || !x) return NULL;
    int OH = 0, OW = 0;
    if (pool2d_check(t, "maxpool2d", x, kernel, stride, &OH, &OW) != QT_OK) return NULL;
    const int *xd = x->value.shape;
    Var *y = tape_new_var(t, 4, (const int[]){xd[0], xd[1], OH, OW});
    if (!y) return NULL;
    int32_t *argmax = tape_alloc(t, var_numel(y) * sizeof *argmax); /* (N, C, OH, OW) */
    if (!argmax) return NULL;
    maxpool2d_forward(y->value.data, argmax, x->value.data, xd[0] * xd[1], xd[2], xd[3], kernel, stride, OH, OW);
    Var *in[1] = {x};
    return tape_record(t, "maxpool2d", maxpool2d_backward, y, in, 1, argmax) ? y : NULL;
}

typedef struct {
    int kernel, stride;
} AvgPool2dCtx;

static void avgpool2d_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0];
    if (!x->requires_grad) return;
    const AvgPool2dCtx *ctx = node->ctx;
    float *dx = tape_grad(t, x); /* (N, C, H, W) */
    if (!dx) return;
    const float *dy = node->out->grad; /* (N, C, OH, OW) */
    const int H = x->value.shape[2], W = x->value.shape[3];
    const int OH = node->out->value.shape[2], OW = node->out->value.shape[3], k = ctx->kernel, s = ctx->stride;
    const size_t planes = (size_t)x->value.shape[0] * x->value.shape[1];
    const float inv_area = 1.0f / (float)(k * k);
    for (size_t p = 0; p < planes; p++) {
        float *dxp = dx + p * H * W;
        for (int oh = 0; oh < OH; oh++)
            for (int ow = 0; ow < OW; ow++) {
                const float g = dy[(p * OH + oh) * OW + ow] * inv_area;
                for (int kh = 0; kh < k; kh++)
                    for (int kw = 0; kw < k; kw++) dxp[(oh * s + kh) * W + ow * s + kw] += g;
            }
    }
}

/* x: (N, C, H, W) -> (N, C, OH, OW), the mean of each kernel x kernel window. */
Var *nn_avgpool2d(Tape *t, Var *x, int kernel, int stride) {
    if (!t || !x) return NULL;
    int OH = 0, OW = 0;
    if (pool2d_check(t, "avgpool2d", x, kernel, stride, &OH, &OW) != QT_OK) return NULL;
    const int *xd = x->value.shape;
    const int H = xd[2], W = xd[3];
    Var *y = tape_new_var(t, 4, (const int[]){xd[0], xd[1], OH, OW});
    AvgPool2dCtx *ctx = tape_alloc(t, sizeof *ctx);
    if (!y || !ctx) return NULL;
    *ctx = (AvgPool2dCtx){kernel, stride};
    const size_t planes = (size_t)xd[0] * xd[1];
    for (size_t p = 0; p < planes; p++) {
        const float *xp = x->value.data + p * H * W; /* (H, W) */
        for (int oh = 0; oh < OH; oh++)
            for (int ow = 0; ow < OW; ow++) {
                double acc = 0.0;
                for (int kh = 0; kh < kernel; kh++)
                    for (int kw = 0; kw < kernel; kw++) acc += xp[(oh * stride + kh) * W + ow * stride + kw];
                y->value.data[(p * OH + oh) * OW + ow] = (float)(acc / ((double)kernel * kernel));
            }
    }
    Var *in[1] = {x};
    return tape_record(t, "avgpool2d", avgpool2d_backward, y, in, 1, ctx) ? y : NULL;
}

/* ---- global average pooling ----------------------------------------------------- */

static void globalavgpool_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0];
    bool fresh;
    float *dx = tape_grad_to_write(t, x, &fresh); /* (N, C, H, W) */
    if (!dx) return;
    const float *dy = node->out->grad; /* (N, C) */
    const size_t planes = (size_t)x->value.shape[0] * x->value.shape[1];
    const size_t area = (size_t)x->value.shape[2] * x->value.shape[3];
    const float inv_area = (float)(1.0 / (double)area);
    for (size_t p = 0; p < planes; p++) {
        const float g = dy[p] * inv_area;
        float *dxp = dx + p * area;
        if (fresh)
            for (size_t i = 0; i < area; i++) dxp[i] = g;
        else
            for (size_t i = 0; i < area; i++) dxp[i] += g;
    }
}

/* The mean of x [n] through nn_sum8_f32's eight chains (one serial chain was 5 % of DS-CNN's int8 eval); the
 * order does not depend on the threads. */
float nn_plane_mean(const float *x, size_t n) { return (float)(nn_sum8_f32(x, NULL, n) / (double)n); }

/* nn_sum8_f32's eight chains of a plane, four planes at a time: each chain still adds its own values in order
 * (a vector lane a chain, whatever the width), so the sums are nn_sum8_f32's; a plane alone waits on the latency
 * of its eight chains' adds, four interleave. The chains are GCC vectors, named (an array of doubles, or of
 * vectors, went through the stack: a store and a load on every chain's add, 2 us of DS-CNN's int8 image): a plane's
 * eight as one vector of 8 doubles at AVX-512, as two of 4 elsewhere (gcc 12's AVX2 copy of the 8-double form
 * rebuilt each add from pieces on the stack: nn_plane_means 4.6 % of DS-CNN's int8 batch on an AVX2 build against
 * 1.1 % on AVX-512; the halves make that batch 4 % shorter there, and the 8-double form's AVX-512 one 1 % shorter
 * than the halves do). The width is chosen as gcc's clones choose theirs (NN_CLONE_TARGETS). */
typedef double PoolV8d __attribute__((vector_size(64)));
typedef float PoolV8f __attribute__((vector_size(32)));
typedef double PoolV4d __attribute__((vector_size(32)));
typedef float PoolV4f __attribute__((vector_size(16)));

/* the 8 sums of each of planes q = 0..3 from x (4 planes n apart) -> out (the means, with the tail from i) */
static inline __attribute__((always_inline)) void plane_means_finish(float *out, const float *xp, size_t n,
                                                                     size_t i, double (*a)[8]) {
    for (int q = 0; q < 4; q++) {
        for (size_t k = i; k < n; k++) a[q][0] += (double)xp[(size_t)q * n + k];
        const double sum = ((a[q][0] + a[q][1]) + (a[q][2] + a[q][3])) + ((a[q][4] + a[q][5]) + (a[q][6] + a[q][7]));
        out[q] = (float)(sum / (double)n);
    }
}

#define PLANE_MEANS_V8                                                                                             \
    for (; p + 4 <= planes; p += 4) {                                                                              \
        PoolV8d a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                            \
        const float *xp = x + p * n;                                                                               \
        size_t i = 0;                                                                                              \
        for (; i + 8 <= n; i += 8) {                                                                               \
            PoolV8f f0, f1, f2, f3;                                                                                \
            memcpy(&f0, xp + i, sizeof f0), memcpy(&f1, xp + n + i, sizeof f1);                                    \
            memcpy(&f2, xp + 2 * n + i, sizeof f2), memcpy(&f3, xp + 3 * n + i, sizeof f3);                        \
            a0 += __builtin_convertvector(f0, PoolV8d), a1 += __builtin_convertvector(f1, PoolV8d);                \
            a2 += __builtin_convertvector(f2, PoolV8d), a3 += __builtin_convertvector(f3, PoolV8d);                \
        }                                                                                                          \
        double a[4][8];                                                                                            \
        memcpy(a[0], &a0, sizeof a0), memcpy(a[1], &a1, sizeof a1);                                                \
        memcpy(a[2], &a2, sizeof a2), memcpy(a[3], &a3, sizeof a3);                                                \
        plane_means_finish(out + p, xp, n, i, a);                                                                  \
    }

#define POOL_ADD8(a, b, src)                                                                                       \
    do {                                                                                                           \
        PoolV4f lo, hi;                                                                                            \
        memcpy(&lo, (src), sizeof lo), memcpy(&hi, (src) + 4, sizeof hi);                                          \
        a += __builtin_convertvector(lo, PoolV4d), b += __builtin_convertvector(hi, PoolV4d);                      \
    } while (0)
#define PLANE_MEANS_V4                                                                                             \
    for (; p + 4 <= planes; p += 4) {                                                                              \
        PoolV4d a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};                    \
        const float *xp = x + p * n;                                                                               \
        size_t i = 0;                                                                                              \
        for (; i + 8 <= n; i += 8) {                                                                               \
            POOL_ADD8(a0, b0, xp + i);                                                                             \
            POOL_ADD8(a1, b1, xp + n + i);                                                                         \
            POOL_ADD8(a2, b2, xp + 2 * n + i);                                                                     \
            POOL_ADD8(a3, b3, xp + 3 * n + i);                                                                     \
        }                                                                                                          \
        double a[4][8];                                                                                            \
        memcpy(a[0], &a0, sizeof a0), memcpy(a[0] + 4, &b0, sizeof b0);                                            \
        memcpy(a[1], &a1, sizeof a1), memcpy(a[1] + 4, &b1, sizeof b1);                                            \
        memcpy(a[2], &a2, sizeof a2), memcpy(a[2] + 4, &b2, sizeof b2);                                            \
        memcpy(a[3], &a3, sizeof a3), memcpy(a[3] + 4, &b3, sizeof b3);                                            \
        plane_means_finish(out + p, xp, n, i, a);                                                                  \
    }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("avx512f"))) static size_t plane_means_v8(float *out, const float *x, size_t planes,
                                                                 size_t n) {
    size_t p = 0;
    PLANE_MEANS_V8
    return p;
}
__attribute__((target("avx2"))) static size_t plane_means_v4(float *out, const float *x, size_t planes, size_t n) {
    size_t p = 0;
    PLANE_MEANS_V4
    return p;
}
#endif
static size_t plane_means_plain(float *out, const float *x, size_t planes, size_t n) {
    size_t p = 0;
    PLANE_MEANS_V4
    return p;
}

void nn_plane_means(float *out, const float *x, size_t planes, size_t n) {
    size_t p;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    static int width = -1; /* every thread that races here stores the same value */
    if (__atomic_load_n(&width, __ATOMIC_RELAXED) < 0) {
        __builtin_cpu_init();
#ifdef QTRAIN_NO_AVX512_CLONES
        const int w = __builtin_cpu_supports("avx2") ? 4 : 0;
#else
        const int w = __builtin_cpu_supports("avx512f") ? 8 : __builtin_cpu_supports("avx2") ? 4 : 0;
#endif
        __atomic_store_n(&width, w, __ATOMIC_RELAXED);
    }
    const int w = __atomic_load_n(&width, __ATOMIC_RELAXED);
    p = w == 8 ? plane_means_v8(out, x, planes, n) : w == 4 ? plane_means_v4(out, x, planes, n)
                                                            : plane_means_plain(out, x, planes, n);
#else
    p = plane_means_plain(out, x, planes, n);
#endif
    for (; p < planes; p++) out[p] = nn_plane_mean(x + p * n, n);
}

typedef struct {
    float *y;       /* (planes) */
    const float *x; /* (planes, area) */
    int planes;
    size_t area;
} GapJob;

static void gap_task(void *ctx, int task, int n_tasks) {
    const GapJob *j = ctx;
    int lo, hi;
    parallel_range(j->planes, task, n_tasks, &lo, &hi);
    nn_plane_means(j->y + lo, j->x + (size_t)lo * j->area, (size_t)(hi - lo), j->area);
}

Var *nn_globalavgpool(Tape *t, Var *x) {
    if (!t || !x) return NULL;
    if (x->value.ndim != 4) {
        char xs[SHAPE_STR_MAX];
        qt_error_set(&t->err, QT_ERR_SHAPE, "globalavgpool: input %s must be 4-D (N, C, H, W)",
                     tensor_shape_str(&x->value, xs, sizeof xs));
        return NULL;
    }
    const int *xd = x->value.shape;
    Var *y = tape_new_var(t, 2, (const int[]){xd[0], xd[1]});
    if (!y) return NULL;
    GapJob j = {y->value.data, x->value.data, (int)((size_t)xd[0] * xd[1]), (size_t)xd[2] * xd[3]};
    if (x->means) { /* made by x's producer as it wrote x (never written then), the same means */
        memcpy(y->value.data, x->means, (size_t)j.planes * sizeof *y->value.data);
        Var *in[1] = {x};
        return tape_record_value_free(t, "globalavgpool", globalavgpool_backward, y, in, 1, NULL) ? y : NULL;
    }
    const int tasks = (size_t)j.planes * j.area < (1u << 16) ? 1 : parallel_get_threads();
    parallel_run(tasks < j.planes ? tasks : j.planes, gap_task, &j);
    Var *in[1] = {x};
    return tape_record_value_free(t, "globalavgpool", globalavgpool_backward, y, in, 1, NULL) ? y : NULL;
}
