/* ops_conv.c - 2-D convolution and pooling.
 *
 * Convolution lowers to one matrix product per layer: im2col unrolls every
 * receptive field of the whole batch into a column of `col`, so
 *     y (OC, N*OH*OW) = w (OC, C*KH*KW) @ col (C*KH*KW, N*OH*OW)
 * is a single large sgemm (one call amortises OpenBLAS's packing far better
 * than N small ones). The forward keeps `col` for the backward's dW product.
 * The `_ref` functions are direct loops with no BLAS, for tests only. */
#include "ops.h"

#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "gemm.h"

#define SHAPE_STR_MAX 64 /* "(2147483647, 2147483647, 2147483647, 2147483647)" fits */

/* ---- im2col / col2im ---------------------------------------------------- */

/* The output positions o in [*lo, *hi) whose input coordinate o*stride + offset
 * lies in [0, in_size); the rest read zero padding. Solved once per kernel tap
 * so the inner loops need no bounds test. */
static void valid_output_range(int offset, int stride, int in_size, int out_size, int *lo, int *hi) {
    int first = offset < 0 ? (-offset + stride - 1) / stride : 0;
    int last_input = in_size - 1 - offset; /* largest admissible o*stride */
    int end = last_input >= 0 ? last_input / stride + 1 : 0;
    if (end > out_size) end = out_size;
    if (first > end) first = end;
    *lo = first;
    *hi = end;
}

/* col: (C*KH*KW, N*OH*OW), x: (N, C, H, W). */
void im2col(float *col, const float *x, int N, int C, int H, int W, int KH, int KW, int stride, int padding,
            int OH, int OW) {
    const size_t plane = (size_t)H * W;
    const size_t n_cols = (size_t)N * OH * OW;
    for (int c = 0; c < C; c++) {
        for (int kh = 0; kh < KH; kh++) {
            for (int kw = 0; kw < KW; kw++) {
                float *row = col + ((size_t)(c * KH + kh) * KW + kw) * n_cols; /* [N*OH*OW] */
                const int w_offset = kw - padding;
                int ow_lo, ow_hi;
                valid_output_range(w_offset, stride, W, OW, &ow_lo, &ow_hi);
                for (int n = 0; n < N; n++) {
                    const float *x_plane = x + ((size_t)n * C + c) * plane; /* (H, W) */
                    for (int oh = 0; oh < OH; oh++) {
                        float *dst = row + ((size_t)n * OH + oh) * OW; /* [OW] */
                        const int ih = oh * stride + kh - padding;
                        if (ih < 0 || ih >= H) {
                            memset(dst, 0, (size_t)OW * sizeof *dst);
                            continue;
                        }
                        const float *x_row = x_plane + (size_t)ih * W; /* [W] */
                        for (int ow = 0; ow < ow_lo; ow++) dst[ow] = 0.0f;
                        for (int ow = ow_lo; ow < ow_hi; ow++) dst[ow] = x_row[ow * stride + w_offset];
                        for (int ow = ow_hi; ow < OW; ow++) dst[ow] = 0.0f;
                    }
                }
            }
        }
    }
}

/* dx: (N, C, H, W) accumulated; dcol: (C*KH*KW, N*OH*OW). Padding taps are
 * dropped: they are constants, not inputs. */
void col2im(float *dx, const float *dcol, int N, int C, int H, int W, int KH, int KW, int stride, int padding,
            int OH, int OW) {
    const size_t plane = (size_t)H * W;
    const size_t n_cols = (size_t)N * OH * OW;
    for (int c = 0; c < C; c++) {
        for (int kh = 0; kh < KH; kh++) {
            for (int kw = 0; kw < KW; kw++) {
                const float *row = dcol + ((size_t)(c * KH + kh) * KW + kw) * n_cols; /* [N*OH*OW] */
                const int w_offset = kw - padding;
                int ow_lo, ow_hi;
                valid_output_range(w_offset, stride, W, OW, &ow_lo, &ow_hi);
                for (int n = 0; n < N; n++) {
                    float *dx_plane = dx + ((size_t)n * C + c) * plane; /* (H, W) */
                    for (int oh = 0; oh < OH; oh++) {
                        const int ih = oh * stride + kh - padding;
                        if (ih < 0 || ih >= H) continue;
                        const float *src = row + ((size_t)n * OH + oh) * OW; /* [OW] */
                        float *dx_row = dx_plane + (size_t)ih * W;             /* [W] */
                        for (int ow = ow_lo; ow < ow_hi; ow++) dx_row[ow * stride + w_offset] += src[ow];
                    }
                }
            }
        }
    }
}

/* ---- reference convolution (tests only) --------------------------------- */

/* y: (N, OC, OH, OW), x: (N, C, H, W), w: (OC, C, KH, KW), bias: (OC,) or NULL. */
void conv2d_forward_ref(float *y, const float *x, const float *w, const float *bias, int N, int C, int H, int W,
                        int OC, int KH, int KW, int stride, int padding) {
    const int OH = (H + 2 * padding - KH) / stride + 1, OW = (W + 2 * padding - KW) / stride + 1;
    for (int n = 0; n < N; n++)
        for (int oc = 0; oc < OC; oc++)
            for (int oh = 0; oh < OH; oh++)
                for (int ow = 0; ow < OW; ow++) {
                    double acc = bias ? bias[oc] : 0.0;
                    for (int c = 0; c < C; c++)
                        for (int kh = 0; kh < KH; kh++)
                            for (int kw = 0; kw < KW; kw++) {
                                const int ih = oh * stride + kh - padding, iw = ow * stride + kw - padding;
                                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                                acc += (double)x[(((size_t)n * C + c) * H + ih) * W + iw] *
                                       w[(((size_t)oc * C + c) * KH + kh) * KW + kw];
                            }
                    y[(((size_t)n * OC + oc) * OH + oh) * OW + ow] = (float)acc;
                }
}

/* dx: (N, C, H, W) += sum over the outputs each input pixel feeds, gathered
 * (rather than scattered) so every element is one sum in double. */
static void conv2d_backward_ref_dx(float *dx, const float *dy, const float *w, int N, int C, int H, int W, int OC,
                                   int KH, int KW, int stride, int padding, int OH, int OW) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            for (int ih = 0; ih < H; ih++)
                for (int iw = 0; iw < W; iw++) {
                    double acc = 0.0;
                    for (int oc = 0; oc < OC; oc++)
                        for (int kh = 0; kh < KH; kh++)
                            for (int kw = 0; kw < KW; kw++) {
                                const int sh = ih + padding - kh, sw = iw + padding - kw; /* oh*stride, ow*stride */
                                if (sh < 0 || sw < 0 || sh % stride || sw % stride) continue;
                                const int oh = sh / stride, ow = sw / stride;
                                if (oh >= OH || ow >= OW) continue;
                                acc += (double)dy[(((size_t)n * OC + oc) * OH + oh) * OW + ow] *
                                       w[(((size_t)oc * C + c) * KH + kh) * KW + kw];
                            }
                    dx[(((size_t)n * C + c) * H + ih) * W + iw] += (float)acc;
                }
}

/* dx: (N, C, H, W), dw: (OC, C, KH, KW), dbias: (OC,), each NULL if not wanted;
 * dy: (N, OC, OH, OW), x: (N, C, H, W), w: (OC, C, KH, KW). */
void conv2d_backward_ref(float *dx, float *dw, float *dbias, const float *dy, const float *x, const float *w,
                         int N, int C, int H, int W, int OC, int KH, int KW, int stride, int padding) {
    const int OH = (H + 2 * padding - KH) / stride + 1, OW = (W + 2 * padding - KW) / stride + 1;
    const size_t out_plane = (size_t)OH * OW;
    if (dbias)
        for (int oc = 0; oc < OC; oc++) {
            double acc = 0.0;
            for (int n = 0; n < N; n++)
                for (size_t p = 0; p < out_plane; p++) acc += dy[((size_t)n * OC + oc) * out_plane + p];
            dbias[oc] += (float)acc;
        }
    if (dw)
        for (int oc = 0; oc < OC; oc++)
            for (int c = 0; c < C; c++)
                for (int kh = 0; kh < KH; kh++)
                    for (int kw = 0; kw < KW; kw++) {
                        double acc = 0.0;
                        for (int n = 0; n < N; n++)
                            for (int oh = 0; oh < OH; oh++)
                                for (int ow = 0; ow < OW; ow++) {
                                    const int ih = oh * stride + kh - padding, iw = ow * stride + kw - padding;
                                    if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                                    acc += (double)dy[(((size_t)n * OC + oc) * OH + oh) * OW + ow] *
                                           x[(((size_t)n * C + c) * H + ih) * W + iw];
                                }
                        dw[(((size_t)oc * C + c) * KH + kh) * KW + kw] += (float)acc;
                    }
    if (dx) conv2d_backward_ref_dx(dx, dy, w, N, C, H, W, OC, KH, KW, stride, padding, OH, OW);
}

/* ---- nn_conv2d ------------------------------------------------------------ */

typedef struct {
    int N, C, H, W;   /* input x */
    int OC, KH, KW;   /* weight w, with C */
    int OH, OW;       /* output y */
} ConvDims;

typedef struct {
    float *col;       /* (C*KH*KW, N*OH*OW): the forward's im2col of x, reused for dW */
    int stride, padding;
} Conv2dCtx;

static ConvDims conv_dims(const Var *x, const Var *w, const Var *y) {
    const int *xs = x->value.shape, *ws = w->value.shape, *ys = y->value.shape;
    return (ConvDims){xs[0], xs[1], xs[2], xs[3], ws[0], ws[2], ws[3], ys[2], ys[3]};
}

/* Output size along one axis, or 0 if the kernel does not fit the padded input. */
static long long conv_out_size(int in, int kernel, int stride, int padding) {
    long long padded = (long long)in + 2LL * padding;
    return padded < kernel ? 0 : (padded - kernel) / stride + 1;
}

/* x: (N, C, H, W), w: (OC, C, KH, KW), bias: (OC,) or NULL. QT_OK and d filled,
 * or the error, set on the tape. */
static QtStatus conv2d_check(Tape *t, const Var *x, const Var *w, const Var *bias, int stride, int padding,
                             ConvDims *d) {
    char xs[SHAPE_STR_MAX], ws[SHAPE_STR_MAX], bs[SHAPE_STR_MAX];
    tensor_shape_str(&x->value, xs, sizeof xs);
    tensor_shape_str(&w->value, ws, sizeof ws);
    if (x->value.ndim != 4)
        return qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d: input %s must be 4-D (N, C, H, W) (weight %s)", xs, ws);
    if (w->value.ndim != 4)
        return qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d: weight %s must be 4-D (OC, C, KH, KW) (input %s)", ws,
                            xs);
    if (stride < 1 || padding < 0)
        return qt_error_set(&t->err, QT_ERR_ARG,
                            "conv2d: stride must be >= 1 and padding >= 0, got stride %d, padding %d "
                            "(input %s, weight %s)", stride, padding, xs, ws);
    const int *xd = x->value.shape, *wd = w->value.shape;
    if (xd[1] != wd[1])
        return qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d: input %s has %d channels but weight %s expects %d", xs,
                            xd[1], ws, wd[1]);
    if (bias && (bias->value.ndim != 1 || bias->value.shape[0] != wd[0]))
        return qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d: bias %s does not match weight %s: expected (%d,)",
                            tensor_shape_str(&bias->value, bs, sizeof bs), ws, wd[0]);
    long long oh = conv_out_size(xd[2], wd[2], stride, padding), ow = conv_out_size(xd[3], wd[3], stride, padding);
    if (oh < 1 || ow < 1)
        return qt_error_set(&t->err, QT_ERR_SHAPE,
                            "conv2d: kernel %dx%d of weight %s is larger than input %s padded by %d (%lldx%lld); "
                            "the output would be empty", wd[2], wd[3], ws, xs, padding,
                            (long long)xd[2] + 2LL * padding, (long long)xd[3] + 2LL * padding);
    /* gemm_f32 takes int sizes: both sides of the im2col matrix must fit. */
    long long rows = (long long)wd[1] * wd[2] * wd[3], cols = (long long)xd[0] * oh * ow;
    if (rows > INT_MAX || cols > INT_MAX)
        return qt_error_set(&t->err, QT_ERR_ARG,
                            "conv2d: input %s with weight %s needs a %lld x %lld im2col matrix; each side must "
                            "be at most %d", xs, ws, rows, cols, INT_MAX);
    *d = (ConvDims){xd[0], xd[1], xd[2], xd[3], wd[0], wd[2], wd[3], (int)oh, (int)ow};
    return QT_OK;
}

/* y: (N, OC, OH*OW) = prod (OC, N*OH*OW) regrouped by image, plus bias (OC,) or
 * NULL. prod may alias y when N == 1 (the layouts then coincide). */
static void conv_output_from_product(float *y, const float *prod, const float *bias, const ConvDims *d) {
    const size_t out_plane = (size_t)d->OH * d->OW, n_cols = (size_t)d->N * out_plane;
    for (int n = 0; n < d->N; n++)
        for (int oc = 0; oc < d->OC; oc++) {
            float *dst = y + ((size_t)n * d->OC + oc) * out_plane;            /* [OH*OW] */
            const float *src = prod + (size_t)oc * n_cols + n * out_plane;   /* [OH*OW] */
            const float b = bias ? bias[oc] : 0.0f;
            for (size_t p = 0; p < out_plane; p++) dst[p] = src[p] + b;
        }
}

/* dyt: (OC, N*OH*OW) from dy: (N, OC, OH*OW), the layout the gemm products want. */
static void conv_transpose_dy(float *dyt, const float *dy, const ConvDims *d) {
    const size_t out_plane = (size_t)d->OH * d->OW, n_cols = (size_t)d->N * out_plane;
    for (int n = 0; n < d->N; n++)
        for (int oc = 0; oc < d->OC; oc++)
            memcpy(dyt + (size_t)oc * n_cols + n * out_plane, dy + ((size_t)n * d->OC + oc) * out_plane,
                   out_plane * sizeof *dyt);
}

/* dbias: (OC,) += dy (N, OC, OH, OW) summed over n, oh, ow. */
static void conv_bias_grad(float *dbias, const float *dy, const ConvDims *d) {
    const size_t out_plane = (size_t)d->OH * d->OW;
    for (int oc = 0; oc < d->OC; oc++) {
        double acc = 0.0; /* up to N*OH*OW terms: cheap to keep exact */
        for (int n = 0; n < d->N; n++) {
            const float *g = dy + ((size_t)n * d->OC + oc) * out_plane;
            for (size_t p = 0; p < out_plane; p++) acc += g[p];
        }
        dbias[oc] += (float)acc;
    }
}

static void conv2d_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0], *w = node->in[1], *bias = node->in[2];
    const Conv2dCtx *ctx = node->ctx;
    const ConvDims d = conv_dims(x, w, node->out);
    const float *dy = node->out->grad; /* (N, OC, OH, OW) */
    const int ckk = d.C * d.KH * d.KW, n_cols = d.N * d.OH * d.OW;
    if (bias && bias->requires_grad) {
        float *dbias = tape_grad(t, bias); /* (OC,) */
        if (!dbias) return;
        conv_bias_grad(dbias, dy, &d);
    }
    if (!w->requires_grad && !x->requires_grad) return;
    const float *dyt = dy; /* (OC, N*OH*OW); for N == 1 that is dy's own layout */
    if (d.N > 1) {
        float *buf = tape_alloc(t, (size_t)d.OC * n_cols * sizeof *buf);
        if (!buf) return;
        conv_transpose_dy(buf, dy, &d);
        dyt = buf;
    }
    if (w->requires_grad) {
        float *dw = tape_grad(t, w); /* (OC, C*KH*KW) */
        if (!dw) return;
        gemm_f32(false, true, d.OC, ckk, n_cols, 1.0f, dyt, n_cols, ctx->col, n_cols, 1.0f, dw, ckk);
    }
    if (x->requires_grad) {
        float *dx = tape_grad(t, x);                                        /* (N, C, H, W) */
        float *dcol = tape_alloc(t, (size_t)ckk * n_cols * sizeof *dcol);   /* (C*KH*KW, N*OH*OW) */
        if (!dx || !dcol) return;
        gemm_f32(true, false, ckk, n_cols, d.OC, 1.0f, w->value.data, ckk, dyt, n_cols, 0.0f, dcol, n_cols);
        col2im(dx, dcol, d.N, d.C, d.H, d.W, d.KH, d.KW, ctx->stride, ctx->padding, d.OH, d.OW);
    }
}

/* x: (N, C, H, W), w: (OC, C, KH, KW), bias: (OC,) or NULL -> y: (N, OC, OH, OW). */
Var *nn_conv2d(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding) {
    if (!t || !x || !w) return NULL;
    ConvDims d = {0}; /* zeroed only to quiet gcc: it cannot see that every error path returns */
    if (conv2d_check(t, x, w, bias, stride, padding, &d) != QT_OK) return NULL;
    const int ckk = d.C * d.KH * d.KW, n_cols = d.N * d.OH * d.OW;
    Var *y = tape_new_var(t, 4, (const int[]){d.N, d.OC, d.OH, d.OW});
    Conv2dCtx *ctx = tape_alloc(t, sizeof *ctx);
    float *col = tape_alloc(t, (size_t)ckk * n_cols * sizeof *col); /* (C*KH*KW, N*OH*OW) */
    if (!y || !ctx || !col) return NULL;
    /* The product is (OC, N*OH*OW); for N == 1 that is y's layout, so skip the
     * scratch buffer and add the bias in place. */
    float *prod = d.N == 1 ? y->value.data : tape_alloc(t, (size_t)d.OC * n_cols * sizeof *prod);
    if (!prod) return NULL;
    im2col(col, x->value.data, d.N, d.C, d.H, d.W, d.KH, d.KW, stride, padding, d.OH, d.OW);
    gemm_f32(false, false, d.OC, n_cols, ckk, 1.0f, w->value.data, ckk, col, n_cols, 0.0f, prod, n_cols);
    conv_output_from_product(y->value.data, prod, bias ? bias->value.data : NULL, &d);
    *ctx = (Conv2dCtx){col, stride, padding};
    Var *in[3] = {x, w, bias};
    return tape_record(t, "conv2d", conv2d_backward, y, in, 3, ctx) ? y : NULL;
}

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
 * window's winner within its (H, W) plane of x: (planes, H, W). */
/* The 2x2, stride-2 case every reference CNN uses. Same results as the
 * generic loops, ties and NaNs included (a test compares them), but with no
 * data-dependent branch: on ReLU outputs a compare goes either way about
 * half the time, and mispredictions made this the slowest op of the CNN.
 * The max is a chain of `v > m ? v : m` (one maxss each) and the winner's
 * index k in 0..3 is integer arithmetic on the comparison results. */
static void maxpool2d_forward_2x2(float *y, int32_t *argmax, const float *x, int planes, int H, int W, int OH,
                                  int OW) {
    for (int p = 0; p < planes; p++) {
        const float *xp = x + (size_t)p * H * W;
        float *yp = y + (size_t)p * OH * OW;
        int32_t *ap = argmax + (size_t)p * OH * OW;
        for (int oh = 0; oh < OH; oh++) {
            const float *r0 = xp + (size_t)(2 * oh) * W, *r1 = r0 + W;
            for (int ow = 0; ow < OW; ow++) {
                const float a = r0[2 * ow], b = r0[2 * ow + 1], c = r1[2 * ow], d = r1[2 * ow + 1];
                float m;
                int k;
                if ((a != a) | (b != b) | (c != c) | (d != d)) {
                    /* Rare: the first NaN of the window wins, as in the generic loops. */
                    k = a != a ? 0 : b != b ? 1 : c != c ? 2 : 3;
                    m = NAN;
                } else {
                    int t = b > a;
                    m = b > a ? b : a;
                    k = t;
                    t = c > m;
                    m = c > m ? c : m;
                    k += t * (2 - k);
                    t = d > m;
                    m = d > m ? d : m;
                    k += t * (3 - k);
                }
                yp[oh * OW + ow] = m;
                ap[oh * OW + ow] = (2 * oh + (k >> 1)) * W + 2 * ow + (k & 1);
            }
        }
    }
}

static void maxpool2d_forward(float *y, int32_t *argmax, const float *x, int planes, int H, int W, int kernel,
                              int stride, int OH, int OW) {
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
