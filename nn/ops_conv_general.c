/* ops_conv_general.c - the general 2-D convolution: groups (depthwise when
 * groups = in_channels), non-square kernels, per-axis stride and padding
 * (with PyTorch's extra bottom/right row for padding 'same'), dilation.
 *
 * Three routes, by geometry:
 *  - the plain one (one group, dilation 1, equal strides and paddings on
 *    both axes) is nn_conv2d itself (ops_conv.c), bit for bit;
 *  - depthwise (groups = C > 1, OC = C * multiplier) runs direct loops: an
 *    im2col + GEMM of one input channel at a time would be a 1-row product
 *    per plane. At stride 1 they run on a zero-padded copy of each plane,
 *    one contiguous multiply-add per tap; other strides tap by tap along
 *    the rows. The forward splits the planes over the thread pool; the
 *    backward splits the input channels, so each task owns its channels'
 *    dx planes and weight taps outright;
 *  - any other grouping: per sample and group, im2col (Cg*KH*KW, OH*OW)
 *    and one sgemm (a 1x1 stride-1 unpadded conv reads x in place). The
 *    weight gradient is summed in CONVG_PARTS fixed slices of the batch
 *    and reduced in slice order.
 * Every route's result is the same whatever the thread count. The `_ref`
 * twin of these kernels is conv2d_general_forward_ref /
 * conv2d_general_backward_ref (ops_conv_ref.c). */
#include "ops_conv_internal.h"

#include <limits.h>
#include <stddef.h>
#include <string.h>

#include "gemm.h"
#include "base/parallel.h"

/* Slices of the batch the grouped route's weight gradient is summed in: a
 * constant, not the thread count, so the sum's order never changes. */
#define CONVG_PARTS 8

typedef struct {
    int N, C, H, W;     /* x */
    int OC, KH, KW;     /* w: (OC, Cg, KH, KW) */
    int OH, OW;         /* y */
    int Cg, OCg;        /* channels per group, in and out */
    bool depthwise;     /* groups = C > 1: the direct loops */
    bool in_place;      /* 1x1, stride 1, no padding: x is its own im2col */
    ConvGeom2d g;
} ConvGDims;

/* Work of one pass, shared by its tasks. */
typedef struct {
    const ConvGDims *d;
    const float *x;    /* (N, C, H, W) */
    const float *w;    /* (OC, Cg, KH, KW) */
    const float *bias; /* (OC,) or NULL */
    float *y;          /* forward: (N, OC, OH, OW) */
    float *moments;    /* forward, depthwise: (N, OC, 3), each y plane's batchnorm_plane_moments, or NULL */
    const NnAffineRelu *view; /* depthwise stride 1: x is view->x, read through the view's map (Var.view), or NULL */
    const float *dy;   /* backward: (N, OC, OH, OW) */
    float *dx;         /* (N, C, H, W) accumulated, or NULL */
    bool dx_accumulate; /* depthwise stride 1: false when dx is a fresh buffer it writes */
    float *dw;         /* depthwise: (OC, 1, KH, KW) accumulated; grouped: (CONVG_PARTS, OC, Cg*KH*KW) partials; or NULL */
    float *scratch;    /* per thread: thread_floats */
    size_t thread_floats;
} ConvGJob;

ConvGeom2d conv_geom2d(int stride, int padding) {
    return (ConvGeom2d){stride, stride, padding, padding, 1, 1, 1, 0, 0};
}

QtStatus conv_geom2d_same(ConvGeom2d *g, int KH, int KW, QtError *err) {
    if (g->stride_h != 1 || g->stride_w != 1)
        return qt_error_set(err, QT_ERR_ARG,
                            "conv2d: padding 'same' needs stride 1 on both axes, got stride [%d, %d] (as in PyTorch); "
                            "give the padding as numbers instead", g->stride_h, g->stride_w);
    if (KH < 1 || KW < 1 || g->dil_h < 1 || g->dil_w < 1)
        return qt_error_set(err, QT_ERR_ARG, "conv2d: padding 'same' for kernel %dx%d with dilation [%d, %d]: "
                            "kernel and dilation must be >= 1", KH, KW, g->dil_h, g->dil_w);
    const long long th = (long long)g->dil_h * (KH - 1), tw = (long long)g->dil_w * (KW - 1);
    if (th > INT_MAX || tw > INT_MAX)
        return qt_error_set(err, QT_ERR_ARG, "conv2d: padding 'same' for kernel %dx%d with dilation [%d, %d] is "
                            "too large", KH, KW, g->dil_h, g->dil_w);
    g->pad_h = (int)(th / 2);
    g->pad_h_extra = (int)(th - 2 * (th / 2));
    g->pad_w = (int)(tw / 2);
    g->pad_w_extra = (int)(tw - 2 * (tw / 2));
    return QT_OK;
}

static bool conv_geom_plain(const ConvGeom2d *g) {
    return g->groups == 1 && g->dil_h == 1 && g->dil_w == 1 && g->stride_h == g->stride_w && g->pad_h == g->pad_w &&
           g->pad_h_extra == 0 && g->pad_w_extra == 0;
}

static QtStatus conv_general_check(Tape *t, const Var *x, const Var *w, const Var *bias, const ConvGeom2d *g,
                                   ConvGDims *d) {
    char xs[SHAPE_STR_MAX], ws[SHAPE_STR_MAX], bs[SHAPE_STR_MAX];
    tensor_shape_str(&x->value, xs, sizeof xs);
    tensor_shape_str(&w->value, ws, sizeof ws);
    if (x->value.ndim != 4)
        return qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d: input %s must be 4-D (N, C, H, W) (weight %s)", xs, ws);
    if (w->value.ndim != 4)
        return qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d: weight %s must be 4-D (OC, C/groups, KH, KW) (input %s)",
                            ws, xs);
    if (x->view && x->view->affine_only)
        return qt_error_set(&t->err, QT_ERR_ARG, "conv2d: its input %s is a batch norm's view without relu "
                            "(nn_batchnorm_view), which only nn_add reads", xs);
    if (g->stride_h < 1 || g->stride_w < 1 || g->dil_h < 1 || g->dil_w < 1 || g->pad_h < 0 || g->pad_w < 0 ||
        g->pad_h_extra < 0 || g->pad_w_extra < 0 || g->groups < 1)
        return qt_error_set(&t->err, QT_ERR_ARG,
                            "conv2d: stride [%d, %d], dilation [%d, %d] and groups %d must be >= 1, padding [%d, %d] "
                            "(extra [%d, %d]) >= 0 (input %s, weight %s)", g->stride_h, g->stride_w, g->dil_h,
                            g->dil_w, g->groups, g->pad_h, g->pad_w, g->pad_h_extra, g->pad_w_extra, xs, ws);
    const int *xd = x->value.shape, *wd = w->value.shape;
    if (xd[1] % g->groups || wd[0] % g->groups)
        return qt_error_set(&t->err, QT_ERR_SHAPE,
                            "conv2d: groups %d must divide the input channels %d and the output channels %d "
                            "(input %s, weight %s)", g->groups, xd[1], wd[0], xs, ws);
    if (wd[1] * g->groups != xd[1])
        return qt_error_set(&t->err, QT_ERR_SHAPE,
                            "conv2d: input %s has %d channels, so weight %s with groups %d must have %d input "
                            "channels per group, not %d", xs, xd[1], ws, g->groups, xd[1] / g->groups, wd[1]);
    if (bias && (bias->value.ndim != 1 || bias->value.shape[0] != wd[0]))
        return qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d: bias %s does not match weight %s: expected (%d,)",
                            tensor_shape_str(&bias->value, bs, sizeof bs), ws, wd[0]);
    const int oh = conv_general_out_size(xd[2], wd[2], g->stride_h, g->pad_h, g->pad_h + g->pad_h_extra, g->dil_h);
    const int ow = conv_general_out_size(xd[3], wd[3], g->stride_w, g->pad_w, g->pad_w + g->pad_w_extra, g->dil_w);
    if (oh < 1 || ow < 1)
        return qt_error_set(&t->err, QT_ERR_SHAPE,
                            "conv2d: kernel %dx%d of weight %s at dilation [%d, %d] spans %lldx%lld, larger than "
                            "input %s padded to %lldx%lld; the output would be empty", wd[2], wd[3], ws, g->dil_h,
                            g->dil_w, (long long)g->dil_h * (wd[2] - 1) + 1, (long long)g->dil_w * (wd[3] - 1) + 1,
                            xs, (long long)xd[2] + 2LL * g->pad_h + g->pad_h_extra,
                            (long long)xd[3] + 2LL * g->pad_w + g->pad_w_extra);
    if ((long long)xd[0] * wd[0] > INT_MAX)
        return qt_error_set(&t->err, QT_ERR_ARG, "conv2d: input %s with weight %s has more than %d output planes",
                            xs, ws, INT_MAX);
    /* gemm_f32 takes int sizes: one group's im2col must fit. */
    const long long rows = (long long)wd[1] * wd[2] * wd[3], cols = (long long)oh * ow;
    if (rows * cols > INT_MAX)
        return qt_error_set(&t->err, QT_ERR_ARG,
                            "conv2d: input %s with weight %s needs a %lld x %lld im2col matrix per group; at most "
                            "%d elements", xs, ws, rows, cols, INT_MAX);
    *d = (ConvGDims){.N = xd[0], .C = xd[1], .H = xd[2], .W = xd[3], .OC = wd[0], .KH = wd[2], .KW = wd[3],
                     .OH = oh, .OW = ow, .Cg = wd[1], .OCg = wd[0] / g->groups, .g = *g};
    d->depthwise = g->groups == d->C && d->C > 1;
    d->in_place = d->KH == 1 && d->KW == 1 && g->stride_h == 1 && g->stride_w == 1 && g->pad_h == 0 &&
                  g->pad_w == 0 && g->pad_h_extra == 0 && g->pad_w_extra == 0;
    return QT_OK;
}

/* The outputs o in [*lo, *hi) whose input coordinate o*stride + offset lies
 * in [0, in); the others read padding. */
static void convg_valid_range(int offset, int stride, int in, int out, int *lo, int *hi) {
    int first = offset < 0 ? (-offset + stride - 1) / stride : 0;
    const int last = in - 1 - offset;
    int end = last >= 0 ? last / stride + 1 : 0;
    if (end > out) end = out;
    if (first > end) first = end;
    *lo = first;
    *hi = end;
}

/* ---- depthwise: direct loops ------------------------------------------------- */

/* y (OH, OW) = bias + the taps of w (KH, KW) over x (H, W), tap by tap. */
static void dw_forward_plane(float *restrict y, const float *restrict x, const float *restrict w, float b,
                             const ConvGDims *d) {
    const ConvGeom2d *g = &d->g;
    const int sw = g->stride_w, OW = d->OW;
    for (size_t p = 0; p < (size_t)d->OH * OW; p++) y[p] = b;
    for (int kh = 0; kh < d->KH; kh++)
        for (int kw = 0; kw < d->KW; kw++) {
            const float wv = w[kh * d->KW + kw];
            const int hoff = kh * g->dil_h - g->pad_h, woff = kw * g->dil_w - g->pad_w;
            int lo, hi;
            convg_valid_range(woff, sw, d->W, OW, &lo, &hi);
            for (int oh = 0; oh < d->OH; oh++) {
                const int ih = oh * g->stride_h + hoff;
                if (ih < 0 || ih >= d->H) continue;
                const float *xr = x + (size_t)ih * d->W + woff; /* xr[ow*sw] for ow in [lo, hi) */
                float *yr = y + (size_t)oh * OW;
                if (sw == 1)
                    for (int ow = lo; ow < hi; ow++) yr[ow] += wv * xr[ow];
                else
                    for (int ow = lo; ow < hi; ow++) yr[ow] += wv * xr[(size_t)ow * sw];
            }
        }
}

static void dw_forward_task(void *ctx, int task, int n_tasks) {
    const ConvGJob *j = ctx;
    const ConvGDims *d = j->d;
    const size_t in_plane = (size_t)d->H * d->W, out_plane = (size_t)d->OH * d->OW, kk = (size_t)d->KH * d->KW;
    int lo, hi;
    parallel_range(d->N * d->OC, task, n_tasks, &lo, &hi);
    for (int p = lo; p < hi; p++) {
        const int n = p / d->OC, oc = p % d->OC, c = oc / d->OCg;
        dw_forward_plane(j->y + (size_t)p * out_plane, j->x + ((size_t)n * d->C + c) * in_plane, j->w + oc * kk,
                         j->bias ? j->bias[oc] : 0.0f, d);
        if (j->moments) batchnorm_plane_moments(j->moments + 3 * (size_t)p, j->y + (size_t)p * out_plane, out_plane, 1);
    }
}

/* One (sample, output channel) plane's backward: dx (H, W) += the taps of
 * w scattered from dy (OH, OW); acc[tap] += the tap's sum of dy * x, taken
 * column-wise in rowacc [OW] (scratch) first, so the products vectorise. */
static void dw_backward_plane(float *restrict dx, double *restrict acc, float *restrict rowacc,
                              const float *restrict dy, const float *restrict x, const float *restrict w,
                              const ConvGDims *d) {
    const ConvGeom2d *g = &d->g;
    const int sw = g->stride_w, OW = d->OW;
    for (int kh = 0; kh < d->KH; kh++)
        for (int kw = 0; kw < d->KW; kw++) {
            const float wv = w[kh * d->KW + kw];
            const int hoff = kh * g->dil_h - g->pad_h, woff = kw * g->dil_w - g->pad_w;
            int lo, hi;
            convg_valid_range(woff, sw, d->W, OW, &lo, &hi);
            if (acc) memset(rowacc, 0, (size_t)OW * sizeof *rowacc);
            for (int oh = 0; oh < d->OH; oh++) {
                const int ih = oh * g->stride_h + hoff;
                if (ih < 0 || ih >= d->H) continue;
                const size_t at = (size_t)ih * d->W + woff;
                const float *dyr = dy + (size_t)oh * OW;
                if (acc) {
                    const float *xr = x + at;
                    if (sw == 1)
                        for (int ow = lo; ow < hi; ow++) rowacc[ow] += dyr[ow] * xr[ow];
                    else
                        for (int ow = lo; ow < hi; ow++) rowacc[ow] += dyr[ow] * xr[(size_t)ow * sw];
                }
                if (dx) {
                    float *dxr = dx + at;
                    if (sw == 1)
                        for (int ow = lo; ow < hi; ow++) dxr[ow] += wv * dyr[ow];
                    else
                        for (int ow = lo; ow < hi; ow++) dxr[(size_t)ow * sw] += wv * dyr[ow];
                }
            }
            if (acc) {
                double tap = 0.0;
                for (int ow = lo; ow < hi; ow++) tap += rowacc[ow];
                acc[kh * d->KW + kw] += tap;
            }
        }
}

/* Each task owns a range of input channels: their dx planes, and the weight
 * taps of their output channels, summed over the batch in sample order. */
static void dw_backward_task(void *ctx, int task, int n_tasks) {
    const ConvGJob *j = ctx;
    const ConvGDims *d = j->d;
    const size_t in_plane = (size_t)d->H * d->W, out_plane = (size_t)d->OH * d->OW, kk = (size_t)d->KH * d->KW;
    double *acc = j->dw ? (double *)(j->scratch + (size_t)parallel_thread_index() * j->thread_floats) : NULL;
    float *rowacc = acc ? (float *)(acc + kk) : NULL; /* [OW] */
    int lo, hi;
    parallel_range(d->C, task, n_tasks, &lo, &hi);
    for (int c = lo; c < hi; c++)
        for (int oc = c * d->OCg; oc < (c + 1) * d->OCg; oc++) {
            if (acc) memset(acc, 0, kk * sizeof *acc);
            for (int n = 0; n < d->N; n++) {
                const size_t xi = ((size_t)n * d->C + c) * in_plane;
                dw_backward_plane(j->dx ? j->dx + xi : NULL, acc, rowacc, j->dy + ((size_t)n * d->OC + oc) * out_plane,
                                  j->x + xi, j->w + oc * kk, d);
            }
            if (acc)
                for (size_t k = 0; k < kk; k++) j->dw[oc * kk + k] += (float)acc[k];
        }
}

/* Stride 1 on both axes (every depthwise conv of DS-CNN, most of
 * MobileNet's): the rows are a few floats long (14 on a 28x28 input at
 * stride 2 before), too short for vectors. Instead the input plane sits in
 * a zero-padded plane xp (Hp, Wp), and the output is computed at row
 * stride Wp, so all taps read one contiguous run: yp[q] = b + sum over taps
 * of w[tap] * xp[q + off(tap)], off = kh*dil_h*Wp + kw*dil_w, for q < L =
 * (OH-1)*Wp + OW. q runs in chunks of DW_LANES held in registers over all
 * taps (one store per output); columns OW..Wp-1 of each yp row are junk and
 * dropped. The scratch planes' padding is zeroed once per task and never
 * written, so a plane costs the copy of its H*W interior and nothing else.
 * The backward is the same loop on dy (padded the same way: its junk
 * columns and margins stay zero), gathering dx at the interior of a padded
 * plane; the weight gradient's taps are dot products over the same runs,
 * in lanes per plane, summed over the batch in double. */
#define DW_LANES CONV_DW_LANES

static inline bool dw_s1(const ConvGDims *d) { return d->g.stride_h == 1 && d->g.stride_w == 1; }
static inline int dw_s1_hp(const ConvGDims *d) { return d->H + 2 * d->g.pad_h + d->g.pad_h_extra; }
static inline int dw_s1_wp(const ConvGDims *d) { return d->W + 2 * d->g.pad_w + d->g.pad_w_extra; }
static inline size_t dw_round(size_t n) { return (n + DW_LANES - 1) / DW_LANES * DW_LANES; }
/* Floats of a padded plane with the slack a last chunk may read past it. */
static inline size_t dw_s1_plane(const ConvGDims *d) { return dw_round((size_t)dw_s1_hp(d) * dw_s1_wp(d)) + DW_LANES; }
/* The largest tap offset, rounded up: dy's front margin in the backward. */
static inline size_t dw_s1_margin(const ConvGDims *d) {
    return dw_round((size_t)(d->KH - 1) * d->g.dil_h * dw_s1_wp(d) + (size_t)(d->KW - 1) * d->g.dil_w);
}

/* DW_LANES floats as one GCC vector (4 SSE registers, 2 AVX2 or 1 AVX-512
 * in the clones); loaded and stored unaligned through memcpy. */
typedef float DwVec __attribute__((vector_size(DW_LANES * sizeof(float))));
#define DW_LOAD(v, p) memcpy(&(v), (p), sizeof(DwVec))

/* d[0, n) = s[0, n) inline: rows of a few floats (14 on DS-CNN), where a call to memcpy or the scalar loop the
 * compiler makes of a plain one cost more than the copy. Eight floats at a time, the last eight overlapping. */
typedef float DwVec8 __attribute__((vector_size(8 * sizeof(float))));
static inline void dw_copy(float *restrict d, const float *restrict s, size_t n) {
    if (n < 8) {
        for (size_t i = 0; i < n; i++) d[i] = s[i];
        return;
    }
    DwVec8 v;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) memcpy(&v, s + i, sizeof v), memcpy(d + i, &v, sizeof v);
    if (i < n) memcpy(&v, s + n - 8, sizeof v), memcpy(d + n - 8, &v, sizeof v);
}

/* The interior (rows r0.., columns c0..) of a padded plane (.., Wp) = src (rows, cols). */
static inline void dw_put(float *restrict dst, int Wp, int r0, int c0, const float *restrict src, int rows,
                          int cols) {
    for (int h = 0; h < rows; h++) dw_copy(dst + (size_t)(h + r0) * Wp + c0, src + (size_t)h * cols, (size_t)cols);
}

/* dw_put of x's plane (sample n, channel c): x itself, or made through the view's map as it is copied. */
static inline void dw_put_x(float *restrict dst, int Wp, const ConvGJob *j, int n, int c) {
    const ConvGDims *d = j->d;
    const float *src = j->x + ((size_t)n * d->C + c) * d->H * d->W;
    if (!j->view) {
        dw_put(dst, Wp, d->g.pad_h, d->g.pad_w, src, d->H, d->W);
        return;
    }
    const NnAffineRelu *v = j->view;
    batchnorm_relu_rows(dst + (size_t)d->g.pad_h * Wp + d->g.pad_w, (size_t)Wp, src, d->H, d->W, v->mean[c],
                        v->scale[c], v->beta ? v->beta[c] : 0.0f);
}

/* Every tap of w over the padded plane src at row stride Wp, into dst[0, L)
 * (plus junk up to the next chunk); sign -1 reads src backwards from the
 * tap offsets (the adjoint, for dx: src points at the margin's end). */
/* The 3 x 3 undilated case of dw_s1_taps with the taps unrolled (the loops over them cost more than the
 * arithmetic): the same products added in the same order, so the same bits. */
static inline void dw_s1_taps33(float *restrict dst, const float *restrict src, const float *restrict w, float b,
                                size_t L, int Wp, bool adjoint) {
    const ptrdiff_t r = adjoint ? -(ptrdiff_t)Wp : (ptrdiff_t)Wp, c = adjoint ? -1 : 1;
    const ptrdiff_t off[9] = {0, c, 2 * c, r, r + c, r + 2 * c, 2 * r, 2 * r + c, 2 * r + 2 * c};
    for (size_t q0 = 0; q0 < L; q0 += DW_LANES) {
        DwVec acc = {0}, v;
        acc += b;
#pragma GCC unroll 9
        for (int t = 0; t < 9; t++) {
            DW_LOAD(v, src + q0 + off[t]);
            acc += w[t] * v;
        }
        memcpy(dst + q0, &acc, sizeof acc);
    }
}

static inline void dw_s1_taps(float *restrict dst, const float *restrict src, const float *restrict w, float b,
                              size_t L, const ConvGDims *d, int Wp, bool adjoint) {
    const int KH = d->KH, KW = d->KW;
    if (KH == 3 && KW == 3 && d->g.dil_h == 1 && d->g.dil_w == 1) {
        dw_s1_taps33(dst, src, w, b, L, Wp, adjoint);
        return;
    }
    for (size_t q0 = 0; q0 < L; q0 += DW_LANES) {
        DwVec acc = {0}, v; /* vector variables: they stay in registers across the taps */
        acc += b;
        for (int kh = 0; kh < KH; kh++)
            for (int kw = 0; kw < KW; kw++) {
                const ptrdiff_t off = (ptrdiff_t)kh * d->g.dil_h * Wp + (ptrdiff_t)kw * d->g.dil_w;
                DW_LOAD(v, src + q0 + (adjoint ? -off : off));
                acc += w[kh * KW + kw] * v;
            }
        memcpy(dst + q0, &acc, sizeof acc);
    }
}

/* Tasks per thread of the stride-1 depthwise passes: a thread that a busy core slows then leaves a few tasks to the
 * others instead of half the pass (each plane's and channel's arithmetic is the same in any task). */
#define DW_TASKS_PER_THREAD 4

/* The planes a task walks start where the hardware's prefetchers may not have looked (the backward's: a channel
 * across the batch, C planes apart), so the tasks ask for planes ahead of the one they put: the forward for the
 * input plane DW_AHEAD after the next, the backward for sample n + DW_AHEAD's dy and x planes as it puts sample
 * n's. 8 measured best (3: 4 % slower on DS-CNN's step; 16: 5 %). */
#define DW_AHEAD 8

/* Output planes whose batch-norm moments the depthwise forward makes at once (batchnorm_plane_moments). */
#define DW_MOMENT_PLANES 16

/* Task over (sample, input channel) planes: each padded once for its OC/C outputs. Two padded planes take turns:
 * plane p + 1 is put into one before the taps read plane p from the other. The taps' unaligned vector loads each
 * span several of the put's narrower stores, which a load cannot take from the store buffer: read right after its
 * put, a plane waited for every one of its stores to reach the cache (about a third of this loop's time on DS-CNN's
 * 14x14 planes); a plane put one turn earlier is there. */
NN_SIMD_CLONES
static void dw_s1_forward_task(void *ctx, int task, int n_tasks) {
    const ConvGJob *j = ctx;
    const ConvGDims *d = j->d;
    const int Wp = dw_s1_wp(d), kk = d->KH * d->KW;
    const size_t out_plane = (size_t)d->OH * d->OW, plane = dw_s1_plane(d);
    const size_t L = (size_t)(d->OH - 1) * Wp + d->OW;
    float *xp = j->scratch + (size_t)parallel_thread_index() * j->thread_floats; /* [2][plane] */
    float *yp = xp + 2 * plane;                                                    /* dw_round(L) */
    int lo, hi;
    parallel_range(d->N * d->C, task, n_tasks, &lo, &hi);
    if (lo >= hi) return;
    memset(xp, 0, 2 * plane * sizeof *xp);
    /* the task's output planes are (n, oc) = [lo OCg, hi OCg) in order: their moments DW_MOMENT_PLANES at a time,
     * while those are in cache */
    size_t first = (size_t)lo * d->OCg;
    dw_put_x(xp, Wp, j, lo / d->C, lo % d->C);
    for (int p = lo; p < hi; p++) {
        const int n = p / d->C, c = p % d->C;
        const float *xq = xp + (size_t)((p - lo) & 1) * plane; /* plane p, put a turn ago */
        if (p + 1 < hi) dw_put_x(xp + (size_t)((p + 1 - lo) & 1) * plane, Wp, j, (p + 1) / d->C, (p + 1) % d->C);
        if (p + 1 + DW_AHEAD < hi) nn_prefetch(j->x + (size_t)(p + 1 + DW_AHEAD) * d->H * d->W, (size_t)d->H * d->W);
        for (int oc = c * d->OCg; oc < (c + 1) * d->OCg; oc++) {
            dw_s1_taps(yp, xq, j->w + (size_t)oc * kk, j->bias ? j->bias[oc] : 0.0f, L, d, Wp, false);
            float *y = j->y + ((size_t)n * d->OC + oc) * out_plane;
            for (int oh = 0; oh < d->OH; oh++) dw_copy(y + (size_t)oh * d->OW, yp + (size_t)oh * Wp, (size_t)d->OW);
        }
        const size_t end = (size_t)(p + 1) * d->OCg;
        if (j->moments && (end - first >= DW_MOMENT_PLANES || p + 1 == hi)) {
            batchnorm_plane_moments(j->moments + 3 * first, j->y + first * out_plane, out_plane, (int)(end - first));
            first = end;
        }
    }
}

/* Sample n's turn of dw_s1_backward_task at xp: dy of output channel oc into xp + plane + M, and x of input channel
 * c (for the weight gradient) into xp. The task walks a channel across the batch, a plane a sample (C planes
 * apart): each starts where the hardware's prefetchers have not looked, so the planes DW_AHEAD samples on are
 * asked for now. */
static inline __attribute__((always_inline)) void dw_s1_put_turn(float *xp, const ConvGJob *j, int n, int c, int oc,
                                                                  size_t plane, size_t M) {
    const ConvGDims *d = j->d;
    if (n + DW_AHEAD < d->N) {
        const int a = n + DW_AHEAD;
        nn_prefetch(j->dy + ((size_t)a * d->OC + oc) * d->OH * d->OW, (size_t)d->OH * d->OW);
        if (j->dw) nn_prefetch(j->x + ((size_t)a * d->C + c) * d->H * d->W, (size_t)d->H * d->W);
    }
    dw_put(xp + plane + M, dw_s1_wp(d), 0, 0, j->dy + ((size_t)n * d->OC + oc) * d->OH * d->OW, d->OH, d->OW);
    if (j->dw) dw_put_x(xp, dw_s1_wp(d), j, n, c);
}

/* Task over input channels, as dw_backward_task: per sample the padded x
 * (for the weight), dy padded at row stride Wp, dx gathered at the padded
 * plane's interior and summed over the channel's outputs. As in the
 * forward, two turns of x and dy take turns: sample n + 1's are put before
 * sample n's are read. */
NN_SIMD_CLONES
static void dw_s1_backward_task(void *ctx, int task, int n_tasks) {
    const ConvGJob *j = ctx;
    const ConvGDims *d = j->d;
    const int Wp = dw_s1_wp(d), kk = d->KH * d->KW;
    const size_t in_plane = (size_t)d->H * d->W, plane = dw_s1_plane(d);
    const size_t L = (size_t)(d->OH - 1) * Wp + d->OW, M = dw_s1_margin(d);
    /* the interior's span in the padded plane: its first element, and the end of its last row */
    const size_t p0 = (size_t)d->g.pad_h * Wp + d->g.pad_w, P = (size_t)(d->H - 1) * Wp + d->W;
    const size_t turn = plane + M + plane;          /* one turn's x and dy; two turns alternate */
    float *xp0 = j->scratch + (size_t)parallel_thread_index() * j->thread_floats; /* [2] of: */
    /* xp0: the padded x plane; dyb0 = xp0 + plane: M zeros, then dy at row stride Wp (M + plane) */
    float *dxp = xp0 + 2 * turn;                    /* dw_round(P) */
    double *wacc = (double *)(dxp + dw_round(P));   /* [kk] */
    float *lanes = (float *)(wacc + kk);            /* [kk][DW_LANES] */
    const ConvTapsLevel level = conv_taps_level();
    int lo, hi;
    parallel_range(d->C, task, n_tasks, &lo, &hi);
    memset(xp0, 0, 2 * turn * sizeof *xp0);
    for (int c = lo; c < hi; c++)
        for (int oc = c * d->OCg; oc < (c + 1) * d->OCg; oc++) {
            const float *w = j->w + (size_t)oc * kk;
            if (j->dw) memset(wacc, 0, (size_t)kk * sizeof *wacc);
            dw_s1_put_turn(xp0, j, 0, c, oc, plane, M);
            for (int n = 0; n < d->N; n++) {
                const size_t xi = ((size_t)n * d->C + c) * in_plane;
                float *xp = xp0 + (size_t)(n & 1) * turn, *dyb = xp + plane; /* sample n's, put a turn ago */
                if (n + 1 < d->N) dw_s1_put_turn(xp0 + (size_t)((n + 1) & 1) * turn, j, n + 1, c, oc, plane, M);
                if (j->dw) {
                    conv_dw_wgrad_lanes(level, lanes, dyb + M, xp, L, d->KH, d->KW, (size_t)d->g.dil_h * Wp,
                                        (size_t)d->g.dil_w);
                    for (int t = 0; t < kk; t++) {
                        float s = 0.0f;
                        for (int k = 0; k < DW_LANES; k++) s += lanes[t * DW_LANES + k];
                        wacc[t] += s;
                    }
                }
                if (!j->dx) continue;
                /* dx at padded position p0 + q is the sum over taps of w * dy[p0 + q - off] */
                dw_s1_taps(dxp, dyb + M + p0, w, 0.0f, P, d, Wp, true);
                const bool first = oc == c * d->OCg && !j->dx_accumulate;
                for (int h = 0; h < d->H; h++) {
                    float *restrict o = j->dx + xi + (size_t)h * d->W;
                    const float *restrict s = dxp + (size_t)h * Wp;
                    if (first)
                        dw_copy(o, s, (size_t)d->W);
                    else
                        for (int v = 0; v < d->W; v++) o[v] += s[v];
                }
            }
            if (j->dw)
                for (int t = 0; t < kk; t++) j->dw[(size_t)oc * kk + t] += (float)wacc[t];
        }
}

/* ---- grouped: im2col + sgemm per sample and group ----------------------------- */

/* col (Cg*KH*KW, OH*OW) of x (Cg, H, W): row (c, kh, kw), column (oh, ow). */
static void convg_im2col(float *col, const float *x, const ConvGDims *d) {
    const ConvGeom2d *g = &d->g;
    const size_t P = (size_t)d->OH * d->OW;
    for (int c = 0; c < d->Cg; c++)
        for (int kh = 0; kh < d->KH; kh++)
            for (int kw = 0; kw < d->KW; kw++) {
                float *row = col + ((size_t)(c * d->KH + kh) * d->KW + kw) * P;
                const int hoff = kh * g->dil_h - g->pad_h, woff = kw * g->dil_w - g->pad_w;
                int lo, hi;
                convg_valid_range(woff, g->stride_w, d->W, d->OW, &lo, &hi);
                for (int oh = 0; oh < d->OH; oh++) {
                    float *dst = row + (size_t)oh * d->OW;
                    const int ih = oh * g->stride_h + hoff;
                    if (ih < 0 || ih >= d->H) {
                        memset(dst, 0, (size_t)d->OW * sizeof *dst);
                        continue;
                    }
                    const float *xr = x + ((size_t)c * d->H + ih) * d->W + woff;
                    for (int ow = 0; ow < lo; ow++) dst[ow] = 0.0f;
                    for (int ow = lo; ow < hi; ow++) dst[ow] = xr[(size_t)ow * g->stride_w];
                    for (int ow = hi; ow < d->OW; ow++) dst[ow] = 0.0f;
                }
            }
}

/* dx (Cg, H, W) += the scatter of dcol (Cg*KH*KW, OH*OW): convg_im2col's adjoint. */
static void convg_col2im(float *dx, const float *dcol, const ConvGDims *d) {
    const ConvGeom2d *g = &d->g;
    const size_t P = (size_t)d->OH * d->OW;
    for (int c = 0; c < d->Cg; c++)
        for (int kh = 0; kh < d->KH; kh++)
            for (int kw = 0; kw < d->KW; kw++) {
                const float *row = dcol + ((size_t)(c * d->KH + kh) * d->KW + kw) * P;
                const int hoff = kh * g->dil_h - g->pad_h, woff = kw * g->dil_w - g->pad_w;
                int lo, hi;
                convg_valid_range(woff, g->stride_w, d->W, d->OW, &lo, &hi);
                for (int oh = 0; oh < d->OH; oh++) {
                    const int ih = oh * g->stride_h + hoff;
                    if (ih < 0 || ih >= d->H) continue;
                    const float *src = row + (size_t)oh * d->OW;
                    float *dxr = dx + ((size_t)c * d->H + ih) * d->W + woff;
                    for (int ow = lo; ow < hi; ow++) dxr[(size_t)ow * g->stride_w] += src[ow];
                }
            }
}

static float *convg_thread_scratch(const ConvGJob *j) {
    return j->scratch + (size_t)parallel_thread_index() * j->thread_floats;
}

static void grouped_forward_task(void *ctx, int task, int n_tasks) {
    const ConvGJob *j = ctx;
    const ConvGDims *d = j->d;
    const int P = d->OH * d->OW, ckk = d->Cg * d->KH * d->KW;
    const size_t in_plane = (size_t)d->H * d->W;
    float *col = convg_thread_scratch(j);
    int lo, hi;
    parallel_range(d->N, task, n_tasks, &lo, &hi);
    for (int n = lo; n < hi; n++)
        for (int grp = 0; grp < d->g.groups; grp++) {
            const float *xg = j->x + ((size_t)n * d->C + (size_t)grp * d->Cg) * in_plane; /* (Cg, H, W) */
            float *yg = j->y + ((size_t)n * d->OC + (size_t)grp * d->OCg) * P;             /* (OCg, P) */
            const float *c = xg;
            if (!d->in_place) {
                convg_im2col(col, xg, d);
                c = col;
            }
            gemm_f32(false, false, d->OCg, P, ckk, 1.0f, j->w + (size_t)grp * d->OCg * ckk, ckk, c, P, 0.0f, yg, P);
            if (j->bias)
                for (int o = 0; o < d->OCg; o++) {
                    const float b = j->bias[grp * d->OCg + o];
                    for (int p = 0; p < P; p++) yg[(size_t)o * P + p] += b;
                }
        }
}

/* Slice `task` of CONVG_PARTS: its samples' weight gradient into its own
 * partial, their input gradient straight into dx. */
static void grouped_backward_task(void *ctx, int task, int n_tasks) {
    const ConvGJob *j = ctx;
    const ConvGDims *d = j->d;
    const int P = d->OH * d->OW, ckk = d->Cg * d->KH * d->KW;
    const size_t in_plane = (size_t)d->H * d->W;
    float *col = convg_thread_scratch(j);
    float *dw = j->dw ? j->dw + (size_t)task * d->OC * ckk : NULL; /* (OC, Cg*KH*KW) */
    int lo, hi;
    parallel_range(d->N, task, n_tasks, &lo, &hi);
    for (int n = lo; n < hi; n++)
        for (int grp = 0; grp < d->g.groups; grp++) {
            const size_t xi = ((size_t)n * d->C + (size_t)grp * d->Cg) * in_plane;
            const float *dyg = j->dy + ((size_t)n * d->OC + (size_t)grp * d->OCg) * P; /* (OCg, P) */
            const float *wg = j->w + (size_t)grp * d->OCg * ckk;                       /* (OCg, ckk) */
            if (dw) {
                const float *c = j->x + xi;
                if (!d->in_place) {
                    convg_im2col(col, j->x + xi, d);
                    c = col;
                }
                gemm_f32(false, true, d->OCg, ckk, P, 1.0f, dyg, P, c, P, n == lo ? 0.0f : 1.0f,
                         dw + (size_t)grp * d->OCg * ckk, ckk);
            }
            if (!j->dx) continue;
            if (d->in_place) {
                gemm_f32(true, false, ckk, P, d->OCg, 1.0f, wg, ckk, dyg, P, 1.0f, j->dx + xi, P);
            } else {
                gemm_f32(true, false, ckk, P, d->OCg, 1.0f, wg, ckk, dyg, P, 0.0f, col, P);
                convg_col2im(j->dx + xi, col, d);
            }
        }
}

/* ---- the tape op ------------------------------------------------------------- */

static void conv_general_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0], *w = node->in[1], *bias = node->in[2];
    const ConvGDims *d = node->ctx;
    const size_t out_plane = (size_t)d->OH * d->OW, ckk = (size_t)d->Cg * d->KH * d->KW;
    if (x->view && !tape_value_ready(t, x->view->x)) return; /* the view's source, if it was dropped */
    ConvGJob j = {.d = d, .x = x->view ? x->view->x->value.data : x->value.data, .w = w->value.data,
                  .dy = node->out->grad, .dx_accumulate = true, .view = x->view};
    if (x->requires_grad) {
        /* the stride-1 depthwise loops write every element of dx; the others add */
        bool fresh = false;
        j.dx = d->depthwise && dw_s1(d) ? tape_grad_to_write(t, x, &fresh) : tape_grad(t, x);
        if (!j.dx) return;
        j.dx_accumulate = !fresh;
    }
    if (bias && bias->requires_grad) {
        float *db = tape_grad(t, bias);
        if (!db) return;
        for (int oc = 0; oc < d->OC; oc++) {
            double acc = 0.0;
            for (int n = 0; n < d->N; n++) {
                const float *g = j.dy + ((size_t)n * d->OC + oc) * out_plane;
                for (size_t p = 0; p < out_plane; p++) acc += g[p];
            }
            db[oc] += (float)acc;
        }
    }
    if (!j.dx && !w->requires_grad) return;
    if (d->depthwise && dw_s1(d)) {
        if (w->requires_grad && !(j.dw = tape_grad(t, w))) return;
        const size_t kk = (size_t)d->KH * d->KW, P = (size_t)(d->H - 1) * dw_s1_wp(d) + d->W;
        j.thread_floats = dw_round(4 * dw_s1_plane(d) + 2 * dw_s1_margin(d) + dw_round(P) + kk * (2 + DW_LANES));
        if (!(j.scratch = tape_alloc(t, (size_t)parallel_get_threads() * j.thread_floats * sizeof(float)))) return;
        const int tasks = DW_TASKS_PER_THREAD * parallel_get_threads();
        parallel_run(tasks < d->C ? tasks : d->C, dw_s1_backward_task, &j);
        tape_release_buffer(t, j.scratch, (size_t)parallel_get_threads() * j.thread_floats * sizeof(float));
        return;
    }
    if (d->depthwise) {
        if (w->requires_grad && !(j.dw = tape_grad(t, w))) return;
        /* KH*KW doubles, then OW floats; even, so every thread's doubles stay aligned */
        j.thread_floats = j.dw ? (size_t)d->KH * d->KW * (sizeof(double) / sizeof(float)) + (size_t)(d->OW + 1) / 2 * 2
                               : 0;
        if (j.thread_floats &&
            !(j.scratch = tape_alloc(t, (size_t)parallel_get_threads() * j.thread_floats * sizeof(float))))
            return;
        const int tasks = parallel_get_threads() < d->C ? parallel_get_threads() : d->C;
        parallel_run(tasks, dw_backward_task, &j);
        return;
    }
    const int parts = d->N < CONVG_PARTS ? d->N : CONVG_PARTS;
    if (w->requires_grad && !(j.dw = tape_alloc(t, (size_t)parts * d->OC * ckk * sizeof(float)))) return;
    j.thread_floats = d->in_place ? 1 : ckk * out_plane;
    if (!(j.scratch = tape_alloc(t, (size_t)parallel_get_threads() * j.thread_floats * sizeof(float)))) return;
    parallel_run(parts, grouped_backward_task, &j);
    float *g;
    if (j.dw && (g = tape_grad(t, w))) conv_add_partials(g, j.dw, parts, (size_t)d->OC * ckk);
}

/* The forward of d on x into y; with moments (N, OC, 3) (depthwise only), each plane's batchnorm_plane_moments
 * too. */
static bool convg_forward_run(Tape *t, const ConvGDims *d, const Var *x, const Var *w, const Var *bias, float *y,
                              float *moments) {
    ConvGJob j = {.d = d, .x = x->view ? x->view->x->value.data : x->value.data, .w = w->value.data,
                  .bias = bias ? bias->value.data : NULL, .y = y, .moments = moments, .view = x->view};
    const int threads = parallel_get_threads();
    if (d->depthwise && dw_s1(d)) {
        j.thread_floats = 2 * dw_s1_plane(d) + dw_round((size_t)(d->OH - 1) * dw_s1_wp(d) + d->OW);
        if (!(j.scratch = tape_alloc(t, (size_t)threads * j.thread_floats * sizeof(float)))) return false;
        const int planes = d->N * d->C;
        const int tasks = DW_TASKS_PER_THREAD * threads;
        parallel_run(tasks < planes ? tasks : planes, dw_s1_forward_task, &j);
        tape_release_buffer(t, j.scratch, (size_t)threads * j.thread_floats * sizeof(float));
    } else if (d->depthwise) {
        const int planes = d->N * d->OC;
        parallel_run(threads < planes ? threads : planes, dw_forward_task, &j);
    } else {
        j.thread_floats = d->in_place ? 1 : (size_t)d->Cg * d->KH * d->KW * d->OH * d->OW;
        if (!(j.scratch = tape_alloc(t, (size_t)threads * j.thread_floats * sizeof(float)))) return false;
        parallel_run(threads < d->N ? threads : d->N, grouped_forward_task, &j);
    }
    return true;
}

static void convg_remake(Tape *t, float *y, const void *ctx) {
    const ConvRemake *r = ctx;
    if (tape_value_ready(t, r->x) && (!r->x->view || tape_value_ready(t, r->x->view->x)))
        convg_forward_run(t, r->ctx, r->x, r->w, r->bias, y, NULL);
}

TapeBackwardFn conv_general_backward_fn(void) { return conv_general_backward; }

bool conv_general_remakeable(Tape *t, const TapeNode *n, int max_macs) {
    const ConvGDims *d = n->ctx;
    if (n->backward != conv_general_backward || d->Cg * d->KH * d->KW > max_macs) return false;
    ConvRemake *r = tape_alloc(t, sizeof *r);
    if (!r) return false;
    *r = (ConvRemake){d, n->in[0], n->in[1], n->in[2]};
    return tape_remake_set(t, n->out, NULL, convg_remake, r);
}

static Var *conv_general_forward(Tape *t, Var *x, Var *w, Var *bias, const ConvGeom2d *g, bool moments) {
    if (!t || !x || !w || !g) return NULL;
    if (conv_geom_plain(g))
        return moments ? nn_conv2d_bn(t, x, w, bias, g->stride_h, g->pad_h)
                       : nn_conv2d(t, x, w, bias, g->stride_h, g->pad_h);
    ConvGDims dims = {0};
    if (conv_general_check(t, x, w, bias, g, &dims) != QT_OK) return NULL;
    if (x->view && !(dims.depthwise && dw_s1(&dims))) {
        qt_error_set(&t->err, QT_ERR_ARG, "conv2d: its input is a batch norm's view (nn_batchnorm_relu_view), which "
                     "only the plain and the depthwise stride-1 routes read; this conv has %d groups, stride [%d, %d] "
                     "and dilation [%d, %d]", g->groups, g->stride_h, g->stride_w, g->dil_h, g->dil_w);
        return NULL;
    }
    Var *y = tape_new_var(t, 4, (const int[]){dims.N, dims.OC, dims.OH, dims.OW});
    ConvGDims *d = y ? tape_alloc(t, sizeof *d) : NULL;
    if (!d) return NULL;
    *d = dims;
    float *m3 = NULL; /* the grouped route's planes come out of one sgemm per group: the batch norm reads them */
    if (moments && d->depthwise && !conv_moments_take(t, &m3, d->N, d->OC, d->OH, d->OW)) return NULL;
    if (!convg_forward_run(t, d, x, w, bias, y->value.data, m3)) return NULL;
    y->moments = m3;
    const char *op = d->depthwise ? "conv2d_depthwise" : d->g.groups > 1 ? "conv2d_grouped" : "conv2d_general";
    return tape_record(t, op, conv_general_backward, y, (Var *[]){x, w, bias}, 3, d) ? y : NULL;
}

Var *nn_conv2d_general(Tape *t, Var *x, Var *w, Var *bias, const ConvGeom2d *g) {
    return conv_general_forward(t, x, w, bias, g, false);
}

Var *nn_conv2d_general_bn(Tape *t, Var *x, Var *w, Var *bias, const ConvGeom2d *g) {
    return conv_general_forward(t, x, w, bias, g, true);
}
