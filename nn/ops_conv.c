/* ops_conv.c - 2-D convolution, alone or with a fused relu / relu + 2x2 max
 * pool epilogue.
 *
 * Convolution lowers to matrix products: im2col unrolls the receptive fields
 * of a chunk of samples into the columns of `col`, so
 *     y (OC, chunk*OH*OW) = w (OC, C*KH*KW) @ col (C*KH*KW, chunk*OH*OW)
 * (see nn_conv2d_fused below for the chunking). The `_ref` functions are
 * direct loops with no BLAS, for tests only. */
#include "ops.h"

#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "gemm.h"
#include "base/parallel.h"
#include "pool2x2.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

/* The "same" stride-1 case (OH == H, OW == W: padding (K-1)/2 on both
 * axes), every reference CNN's: each row of col for one sample is the input
 * plane shifted by (kh - padding, kw - padding), so it is one contiguous
 * copy, then the rows and the column that fell outside the plane (the copy
 * wrapped them around from the neighbouring row) are zeroed. */
static bool conv_same_stride1(int H, int W, int KH, int KW, int stride, int padding, int OH, int OW) {
    return stride == 1 && OH == H && OW == W && KH == 2 * padding + 1 && KW == 2 * padding + 1;
}

/* Zeroes the columns of p (H, W) that a contiguous copy shifted by dw wraps
 * in from the neighbouring row: the first -dw (dw < 0) or the last dw
 * (dw > 0) of every row. The rows a shift by dh reads from outside the plane
 * lie outside the contiguous range the callers copy or add, so they need
 * nothing here. */
static void zero_wrapped_columns(float *p, int H, int W, int dw) {
    if (dw == 0) return;
    const int cols = dw < 0 ? (-dw < W ? -dw : W) : (dw < W ? dw : W);
    float *first = dw < 0 ? p : p + (W - cols); /* (H, cols) with row stride W */
    if (cols == 1) { /* a 3x3 kernel's: one store a row (the loop below becomes a memset call a row) */
        for (int h = 0; h < H; h++) first[(size_t)h * W] = 0.0f;
        return;
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < cols; c++) first[(size_t)h * W + c] = 0.0f;
}

/* dst (H, W) = x_plane (H, W) shifted by (dh, dw), zero outside. */
static void shift_plane(float *restrict dst, const float *restrict x_plane, int H, int W, int dh, int dw) {
    const long long plane = (long long)H * W, off = (long long)dh * W + dw;
    long long lo = off < 0 ? -off : 0, hi = off > 0 ? plane - off : plane; /* dst range reading inside x */
    if (lo > plane) lo = plane;
    if (hi < lo) hi = lo;
    memset(dst, 0, (size_t)lo * sizeof *dst);
    memcpy(dst + lo, x_plane + lo + off, (size_t)(hi - lo) * sizeof *dst);
    memset(dst + hi, 0, (size_t)(plane - hi) * sizeof *dst);
    zero_wrapped_columns(dst, H, W, dw);
}

/* dx_plane (H, W) += src (H, W) shifted back by (dh, dw): one contiguous
 * add over the entries whose row reads inside the plane, after zeroing
 * the wrapped-in columns (src is scratch). Always inlined, so each clone of
 * col2im_same_s1 vectorises it in its own ISA. */
static inline __attribute__((always_inline)) void unshift_plane_add(float *restrict dx_plane, float *restrict src,
                                                                    int H, int W, int dh, int dw) {
    const long long plane = (long long)H * W, off = (long long)dh * W + dw;
    zero_wrapped_columns(src, H, W, dw);
    long long lo = off < 0 ? -off : 0, hi = off > 0 ? plane - off : plane;
    if (lo > plane) lo = plane;
    if (hi < lo) hi = lo;
    float *restrict d = dx_plane + lo + off;
    const float *restrict s = src + lo;
    for (long long i = 0; i < hi - lo; i++) d[i] += s[i];
}

static void im2col_same_s1(float *col, const float *x, int N, int C, int H, int W, int KH, int KW, int padding) {
    const size_t plane = (size_t)H * W, n_cols = (size_t)N * plane;
    for (int c = 0; c < C; c++)
        for (int kh = 0; kh < KH; kh++)
            for (int kw = 0; kw < KW; kw++) {
                float *row = col + ((size_t)(c * KH + kh) * KW + kw) * n_cols; /* [N*H*W] */
                for (int n = 0; n < N; n++)
                    shift_plane(row + (size_t)n * plane, x + ((size_t)n * C + c) * plane, H, W, kh - padding,
                                kw - padding);
            }
}

/* The input gradient's col2im is 9 adds per element of every conv input
 * plane each step, a few percent of a CNN step: with AVX2/AVX-512 where the
 * CPU has them (chosen once, at load; clang, which builds the fuzz targets,
 * links no resolver for it). Each element's adds keep their order, so every
 * clone gives the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void col2im_same_s1(float *dx, float *dcol, int N, int C, int H, int W, int KH, int KW, int padding) {
    const size_t plane = (size_t)H * W, n_cols = (size_t)N * plane;
    for (int c = 0; c < C; c++)
        for (int kh = 0; kh < KH; kh++)
            for (int kw = 0; kw < KW; kw++) {
                float *row = dcol + ((size_t)(c * KH + kh) * KW + kw) * n_cols; /* [N*H*W] */
                for (int n = 0; n < N; n++)
                    unshift_plane_add(dx + ((size_t)n * C + c) * plane, row + (size_t)n * plane, H, W,
                                      kh - padding, kw - padding);
            }
}

/* col: (C*KH*KW, N*OH*OW), x: (N, C, H, W). */
void im2col(float *col, const float *x, int N, int C, int H, int W, int KH, int KW, int stride, int padding,
            int OH, int OW) {
    if (conv_same_stride1(H, W, KH, KW, stride, padding, OH, OW)) {
        im2col_same_s1(col, x, N, C, H, W, KH, KW, padding);
        return;
    }
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

/* col2im that may overwrite dcol (scratch): the fast path zeroes the
 * entries that read padding before its contiguous adds. */
static void col2im_consume(float *dx, float *dcol, int N, int C, int H, int W, int KH, int KW, int stride,
                           int padding, int OH, int OW) {
    if (conv_same_stride1(H, W, KH, KW, stride, padding, OH, OW)) col2im_same_s1(dx, dcol, N, C, H, W, KH, KW, padding);
    else col2im(dx, dcol, N, C, H, W, KH, KW, stride, padding, OH, OW);
}

/* ---- nn_conv2d and the fused conv blocks ----------------------------------- */

/* The batch is cut into chunks of a few samples whose im2col matrix and
 * product fit in L2 (CONV_CHUNK_BUDGET bytes; counting the product matters
 * for a first conv, whose im2col is small but whose product, read again by
 * the epilogue, is OC/(C*KH*KW) times larger), and the chunks are shared out over the thread
 * pool in two contiguous ranges (base/parallel.h). Per chunk the forward runs
 * im2col, one single-threaded sgemm into a (OC, chunk*OH*OW) scratch, and an
 * epilogue that adds the bias, applies the fused relu / 2x2 max pool and
 * writes the output in (N, OC, ...) order. Nothing of size C*KH*KW x
 * N*OH*OW is ever held: the backward recomputes each chunk's im2col, which
 * costs far less than the memory traffic of keeping it, and a fused block
 * keeps only its pooled output and one byte per window. */
#define CONV_CHUNK_BUDGET (256u << 10)

typedef struct {
    int N, C, H, W;   /* input x */
    int OC, KH, KW;   /* weight w, with C */
    int OH, OW;       /* convolution output, before any pooling */
} ConvDims;

typedef struct {
    ConvDims d;
    int stride, padding;
    ConvEpilogue epi;
    int chunk;        /* samples per im2col chunk */
    bool lr_via_full; /* the low-rank gradients from the full weight gradient (conv_low_rank_via_full) */
    uint8_t *winner;  /* (N, OC, OH/2, OW/2) 2x2 window winner 0..3, CONV_EPI_RELU_MAXPOOL2 only */
    int rank;         /* low-rank term's rank, 0 = none */
    float scale;      /* its scale */
    /* (OC + rank, C*KH*KW + rank), rank > 0 only: rows [0, OC) hold
     * [w' | scale B] with w' = w + scale B A, rows OC.. hold [A | 0]. The
     * forward reads its first C*KH*KW columns: w' for the output, A for the
     * A col that dB wants. The input gradient reads its first OC rows
     * transposed, [w' | scale B]^T, so one product gives dcol and dt =
     * scale B^T dpre. */
    float *w_merged;
    int ldw;          /* w_merged's row length, C*KH*KW + rank */
    float *u;         /* (N, rank, OH, OW) A x, saved by the forward for dB; NULL when not wanted */
    bool da_by_dt_col; /* dA as dtcol x^T (conv_da_from_dt_col), the "same" stride-1 case */
} Conv2dCtx;

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

/* Work shared by the tasks of one forward or backward pass. */
typedef struct {
    const Conv2dCtx *c;
    const float *x;    /* (N, C, H, W) */
    const float *w;    /* (OC, C*KH*KW) with row length ldw: the weight, or w_merged */
    int ldw;
    const float *bias; /* (OC,) or NULL */
    float *y;          /* forward: the output; backward: the saved output (relu epilogues) */
    const float *dy;   /* backward: the output's gradient */
    float *dx;         /* (N, C, H, W) accumulated, or NULL */
    float *dw_part;    /* (n_tasks, OC, C*KH*KW) per-task dW, or NULL */
    double *db_part;   /* (n_tasks, OC) per-task dbias, or NULL */
    /* (n_tasks, rank, C*KH*KW) per-task dA, or NULL; with da_by_dt_col
     * (n_tasks, rank*KH*KW, C) with the kernel flipped (conv_da_from_dt_col) */
    float *da_part;
    float *dbb_part;   /* (n_tasks, OC, rank) per-task dB, or NULL */
    int m_fwd;         /* rows of the forward product: OC, or OC + rank with A col */
    /* per thread: col, then prod (the forward's product, the backward's dpre),
     * then dcol when col must outlive the input gradient's product, then
     * dt's im2col (rank*KH*KW, OH*OW) */
    float *scratch;
    size_t col_floats, prod_floats, dcol_floats, low_floats;
} ConvJob;

static int conv_ckk(const ConvDims *d) { return d->C * d->KH * d->KW; }
static size_t conv_plane(const ConvDims *d) { return (size_t)d->OH * d->OW; }

/* Samples per chunk: as many as keep the chunk's im2col and product within the budget. */
static int conv_chunk(const ConvDims *d) {
    size_t per_sample = (size_t)(conv_ckk(d) + d->OC) * conv_plane(d) * sizeof(float);
    size_t n = per_sample ? CONV_CHUNK_BUDGET / per_sample : 1;
    if (n < 1) n = 1;
    return n > (size_t)d->N ? d->N : (int)n;
}

/* Writes chunk sample s's output plane for channel oc from its product row
 * row [OH*OW]. */
static void conv_epilogue(const ConvJob *j, const float *row, int n, int oc) {
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const size_t plane = conv_plane(d);
    const float b = j->bias ? j->bias[oc] : 0.0f;
    if (c->epi == CONV_EPI_NONE) {
        float *dst = j->y + ((size_t)n * d->OC + oc) * plane;
        for (size_t p = 0; p < plane; p++) dst[p] = row[p] + b;
        return;
    }
    if (c->epi == CONV_EPI_RELU) {
        float *dst = j->y + ((size_t)n * d->OC + oc) * plane;
        for (size_t p = 0; p < plane; p++) {
            float v = row[p] + b;
            dst[p] = v > 0.0f ? v : 0.0f;
        }
        return;
    }
    const int PH = d->OH / 2, PW = d->OW / 2;
    const size_t at = ((size_t)n * d->OC + oc) * PH * PW;
    for (int ph = 0; ph < PH; ph++) {
        const float *r0 = row + (size_t)(2 * ph) * d->OW;
        pool2x2_relu_row(j->y + at + (size_t)ph * PW, c->winner + at + (size_t)ph * PW, r0, r0 + d->OW, b, PW);
    }
}

static float *conv_thread_scratch(const ConvJob *j) {
    return j->scratch +
           (size_t)parallel_thread_index() * (j->col_floats + j->prod_floats + j->dcol_floats + j->low_floats);
}

static void conv_forward_task(void *ctx, int task, int n_tasks) {
    const ConvJob *j = ctx;
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const int ckk = conv_ckk(d);
    const size_t plane = conv_plane(d), x_sample = (size_t)d->C * d->H * d->W;
    float *col = conv_thread_scratch(j), *prod = col + j->col_floats;
    int lo, hi;
    parallel_range(d->N, task, n_tasks, &lo, &hi);
    for (int n0 = lo; n0 < hi; n0 += c->chunk) {
        const int nc = hi - n0 < c->chunk ? hi - n0 : c->chunk, cols = nc * (int)plane;
        im2col(col, j->x + (size_t)n0 * x_sample, nc, d->C, d->H, d->W, d->KH, d->KW, c->stride, c->padding, d->OH,
               d->OW);
        /* Two products, not one of m_fwd rows: sgemm may take another kernel
         * path for more rows, and the output must not depend on whether A
         * col is wanted (B = 0 gives the base's output bit for bit). */
        gemm_f32(false, false, d->OC, cols, ckk, 1.0f, j->w, j->ldw, col, cols, 0.0f, prod, cols);
        if (j->m_fwd > d->OC)
            gemm_f32(false, false, j->m_fwd - d->OC, cols, ckk, 1.0f, j->w + (size_t)d->OC * j->ldw, j->ldw, col, cols,
                     0.0f, prod + (size_t)d->OC * cols, cols);
        for (int oc = 0; oc < d->OC; oc++)
            for (int s = 0; s < nc; s++) conv_epilogue(j, prod + (size_t)oc * cols + (size_t)s * plane, n0 + s, oc);
        for (int i = 0; i < j->m_fwd - d->OC; i++) /* A col, kept per sample for dB */
            for (int s = 0; s < nc; s++)
                memcpy(c->u + ((size_t)(n0 + s) * c->rank + i) * plane, prod + (size_t)(d->OC + i) * cols + s * plane,
                       plane * sizeof(float));
    }
}

/* The sum of g [n], or with y [n] given, of (y[p] > 0 ? g[p] : 0) (the
 * relu's gradient), in double over eight interleaved partial sums: one chain
 * would wait on the add latency for every element. The SSE2 lanes hold the
 * same eight chains, combined in the same order, so both paths give the
 * same bits. */
static double sum8_f32(const float *g, const float *y, size_t n) {
    double acc[8] = {0};
    size_t i = 0;
#if defined(__SSE2__)
    __m128d a01 = _mm_setzero_pd(), a23 = a01, a45 = a01, a67 = a01;
    for (; i + 8 <= n; i += 8) {
        __m128 v0 = _mm_loadu_ps(g + i), v1 = _mm_loadu_ps(g + i + 4);
        if (y) {
            v0 = _mm_and_ps(_mm_cmpgt_ps(_mm_loadu_ps(y + i), _mm_setzero_ps()), v0);
            v1 = _mm_and_ps(_mm_cmpgt_ps(_mm_loadu_ps(y + i + 4), _mm_setzero_ps()), v1);
        }
        a01 = _mm_add_pd(a01, _mm_cvtps_pd(v0));
        a23 = _mm_add_pd(a23, _mm_cvtps_pd(_mm_movehl_ps(v0, v0)));
        a45 = _mm_add_pd(a45, _mm_cvtps_pd(v1));
        a67 = _mm_add_pd(a67, _mm_cvtps_pd(_mm_movehl_ps(v1, v1)));
    }
    _mm_storeu_pd(acc, a01);
    _mm_storeu_pd(acc + 2, a23);
    _mm_storeu_pd(acc + 4, a45);
    _mm_storeu_pd(acc + 6, a67);
#else
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += !y || y[i + k] > 0.0f ? g[i + k] : 0.0f;
#endif
    for (; i < n; i++) acc[0] += !y || y[i] > 0.0f ? g[i] : 0.0f;
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* dpre row [OH*OW]: the gradient at the convolution's output (before the
 * epilogue) of sample n, channel oc. Returns the row's sum (the bias's share). */
static double conv_pre_grad(const ConvJob *j, float *row, int n, int oc) {
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const size_t plane = conv_plane(d);
    if (c->epi != CONV_EPI_RELU_MAXPOOL2) {
        const size_t at = ((size_t)n * d->OC + oc) * plane;
        const float *g = j->dy + at, *y = j->y + at;
        if (c->epi == CONV_EPI_NONE) memcpy(row, g, plane * sizeof *row);
        else
            for (size_t p = 0; p < plane; p++) row[p] = y[p] > 0.0f ? g[p] : 0.0f;
        return j->db_part ? sum8_f32(row, NULL, plane) : 0.0;
    }
    /* Only each window's winner gets the pooled gradient, and only if the
     * relu let it through: the pooled value is the winner's relu output.
     * The row pairs are written whole; a last odd row or column belongs to
     * no window. */
    const int PH = d->OH / 2, PW = d->OW / 2, OW = d->OW;
    const size_t at = ((size_t)n * d->OC + oc) * PH * PW;
    const float *g = j->dy + at, *y = j->y + at;
    for (int ph = 0; ph < PH; ph++) {
        float *q0 = row + (size_t)(2 * ph) * OW, *q1 = q0 + OW;
        pool2x2_relu_row_grad(q0, q1, g + (size_t)ph * PW, y + (size_t)ph * PW, c->winner + at + (size_t)ph * PW, PW);
        if (OW & 1) q0[OW - 1] = q1[OW - 1] = 0.0f;
    }
    if (d->OH & 1) memset(row + (size_t)(d->OH - 1) * OW, 0, (size_t)OW * sizeof *row);
    return j->db_part ? sum8_f32(g, y, (size_t)PH * PW) : 0.0;
}

/* dB += scale dpre (A x)^T for chunk samples [n0, n0 + nc), from the A x
 * the forward kept. */
static void conv_backward_db(const ConvJob *j, const float *dpre, int n0, int nc, int cols, int task, bool first) {
    const Conv2dCtx *c = j->c;
    const int OC = c->d.OC, r = c->rank, plane = (int)conv_plane(&c->d);
    for (int s = 0; s < nc; s++)
        gemm_f32(false, true, OC, r, plane, c->scale, dpre + (size_t)s * plane, cols,
                 c->u + (size_t)(n0 + s) * r * plane, plane, first && s == 0 ? 0.0f : 1.0f,
                 j->dbb_part + (size_t)task * OC * r, r);
}

/* dA's share of chunk samples [n0, n0 + nc) in the "same" stride-1 case:
 *     dA[i, c, kh, kw] = sum_p dt[i, p] x[c, p + (kh - pad, kw - pad)]
 *                      = sum_p dt[i, p + (pad - kh, pad - kw)] x[c, p],
 * so with dtcol the im2col of dt (rank*KH*KW, OH*OW) it is dtcol x^T
 * (rank*KH*KW, C) with the kernel flipped (pad - kh = kh' - pad for
 * kh' = KH-1-kh). x needs no im2col, and the product's shape suits sgemm
 * far better than dt col^T's rank by C*KH*KW: for the reference CNN's conv2
 * (72 by 32 against 8 by 288, 196 long) OpenBLAS runs it ~2.7x faster. dt:
 * (rank, cols) for the chunk; dtcol: (rank*KH*KW, OH*OW) scratch. */
static void conv_da_from_dt_col(const ConvJob *j, const float *dt, float *dtcol, int n0, int nc, int cols, int task,
                                bool first) {
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const int r = c->rank, kk = d->KH * d->KW;
    const size_t plane = conv_plane(d), x_sample = (size_t)d->C * plane;
    for (int s = 0; s < nc; s++) {
        for (int i = 0; i < r; i++)
            for (int kh = 0; kh < d->KH; kh++)
                for (int kw = 0; kw < d->KW; kw++)
                    shift_plane(dtcol + ((size_t)i * kk + kh * d->KW + kw) * plane, dt + (size_t)i * cols + s * plane,
                                d->H, d->W, kh - c->padding, kw - c->padding);
        gemm_f32(false, true, r * kk, d->C, (int)plane, 1.0f, dtcol, (int)plane, j->x + (size_t)(n0 + s) * x_sample,
                 (int)plane, first && s == 0 ? 0.0f : 1.0f, j->da_part + (size_t)task * r * d->C * kk, d->C);
    }
}

/* g (rank, C, KH, KW) += the per-task partials of conv_da_from_dt_col
 * (n_tasks, rank*KH*KW, C), unflipped, summed in task order. */
static void conv_add_da_flipped(float *g, const float *parts, const ConvDims *d, int r, int n_tasks) {
    const int kk = d->KH * d->KW;
    for (int k = 0; k < n_tasks; k++) {
        const float *p = parts + (size_t)k * d->C * r * kk;
        for (int i = 0; i < r; i++)
            for (int ch = 0; ch < d->C; ch++)
                for (int kh = 0; kh < d->KH; kh++)
                    for (int kw = 0; kw < d->KW; kw++)
                        g[(((size_t)i * d->C + ch) * d->KH + kh) * d->KW + kw] +=
                            p[((size_t)i * kk + (d->KH - 1 - kh) * d->KW + (d->KW - 1 - kw)) * d->C + ch];
    }
}

/* Whether the backward forms dt = scale B^T dpre: for A's own gradient only. */
static bool conv_backward_wants_dt(const ConvJob *j) {
    return j->c->rank && !j->c->lr_via_full && j->da_part;
}

/* One chunk's backward: dpre, then the weight gradient and dB, then one
 * product for the input gradient's dcol and (with A's gradient wanted) dt =
 * scale B^T dpre, dA from dt, and col2im. */
static void conv_backward_task(void *ctx, int task, int n_tasks) {
    const ConvJob *j = ctx;
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const int ckk = conv_ckk(d);
    const size_t plane = conv_plane(d), x_sample = (size_t)d->C * d->H * d->W;
    float *col = conv_thread_scratch(j), *dpre = col + j->col_floats;
    float *dcol = j->dcol_floats ? dpre + j->prod_floats : col, *dtcol = dpre + j->prod_floats + j->dcol_floats;
    float *dw = j->dw_part ? j->dw_part + (size_t)task * d->OC * ckk : NULL;         /* (OC, C*KH*KW) */
    double *db = j->db_part ? j->db_part + (size_t)task * d->OC : NULL;              /* (OC,) */
    const bool low_rank = c->rank && !c->lr_via_full, want_dt = conv_backward_wants_dt(j);
    const bool need_col = dw || (want_dt && !c->da_by_dt_col);
    /* rows of w_merged^T to multiply: dcol's (for dx), then dt's */
    const int row_lo = j->dx ? 0 : ckk, row_hi = want_dt ? ckk + c->rank : (j->dx ? ckk : 0);
    int lo, hi;
    parallel_range(d->N, task, n_tasks, &lo, &hi);
    for (int n0 = lo; n0 < hi; n0 += c->chunk) {
        const int nc = hi - n0 < c->chunk ? hi - n0 : c->chunk, cols = nc * (int)plane;
        for (int oc = 0; oc < d->OC; oc++)
            for (int s = 0; s < nc; s++) {
                double sum = conv_pre_grad(j, dpre + (size_t)oc * cols + (size_t)s * plane, n0 + s, oc);
                if (db) db[oc] += sum;
            }
        if (need_col)
            im2col(col, j->x + (size_t)n0 * x_sample, nc, d->C, d->H, d->W, d->KH, d->KW, c->stride, c->padding,
                   d->OH, d->OW);
        if (dw) gemm_f32(false, true, d->OC, ckk, cols, 1.0f, dpre, cols, col, cols, n0 == lo ? 0.0f : 1.0f, dw, ckk);
        if (low_rank && j->dbb_part) conv_backward_db(j, dpre, n0, nc, cols, task, n0 == lo);
        if (row_hi > row_lo) /* dcol replaces col unless col is still wanted (dcol_floats) */
            gemm_f32(true, false, row_hi - row_lo, cols, d->OC, 1.0f, j->w + row_lo, j->ldw, dpre, cols, 0.0f,
                     dcol + (size_t)row_lo * cols, cols);
        if (want_dt) {
            const float *dt = dcol + (size_t)ckk * cols; /* (rank, cols) */
            if (c->da_by_dt_col) conv_da_from_dt_col(j, dt, dtcol, n0, nc, cols, task, n0 == lo);
            else
                gemm_f32(false, true, c->rank, ckk, cols, 1.0f, dt, cols, col, cols, n0 == lo ? 0.0f : 1.0f,
                         j->da_part + (size_t)task * c->rank * ckk, ckk);
        }
        if (j->dx)
            col2im_consume(j->dx + (size_t)n0 * x_sample, dcol, nc, d->C, d->H, d->W, d->KH, d->KW, c->stride,
                           c->padding, d->OH, d->OW);
    }
}

static int conv_tasks(const ConvDims *d) {
    int t = parallel_get_threads();
    return t > d->N ? d->N : t;
}

/* The per-thread scratch of one pass (ConvJob.scratch), from the arena.
 * backward: sized for conv_backward_task, else for the forward. */
static float *conv_scratch(Tape *t, ConvJob *j, bool backward) {
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const size_t cols = (size_t)c->chunk * conv_plane(d), ckk = (size_t)conv_ckk(d);
    const bool want_dt = backward && conv_backward_wants_dt(j);
    j->col_floats = ckk * cols;
    j->prod_floats = (size_t)(backward ? d->OC : j->m_fwd) * cols;
    j->dcol_floats = 0;
    j->low_floats = 0;
    if (want_dt && c->da_by_dt_col) { /* dcol and dt replace col; dt's im2col one sample at a time */
        j->col_floats += (size_t)c->rank * cols;
        j->low_floats = (size_t)c->rank * d->KH * d->KW * conv_plane(d);
    } else if (want_dt) { /* dA reads col after the product */
        j->dcol_floats = (ckk + (size_t)c->rank) * cols;
    }
    const size_t per_thread = j->col_floats + j->prod_floats + j->dcol_floats + j->low_floats;
    j->scratch = tape_alloc(t, (size_t)parallel_get_threads() * per_thread * sizeof(float));
    return j->scratch;
}

/* grad [n] += the n_tasks partials [n_tasks][n], in task order: the same
 * result whichever thread ran which task. */
static void conv_add_partials(float *grad, const float *parts, int n_tasks, size_t n) {
    for (int k = 0; k < n_tasks; k++)
        for (size_t i = 0; i < n; i++) grad[i] += parts[(size_t)k * n + i];
}

/* Per-task partials for v's gradient, n floats each, or NULL (error on the tape). */
static float *conv_partials(Tape *t, const Var *v, int n_tasks, size_t n) {
    return v && v->requires_grad ? tape_alloc(t, (size_t)n_tasks * n * sizeof(float)) : NULL;
}

/* Whether A's and B's gradients are cheaper through the full weight
 * gradient G = dpre col^T (OC x C*KH*KW per output position), as dA =
 * scale B^T G and dB = scale G A^T once per pass, than through the
 * adapter's own products (A col, dB, B^T dpre, dA: 2 rank (C*KH*KW + OC)
 * per position). A first convolution's few input taps make it so: the
 * reference CNN's conv1 needs 288 multiply-adds a position that way
 * against 656. */
static bool conv_low_rank_via_full(const ConvDims *d, int rank) {
    return rank && (long long)d->OC * conv_ckk(d) <= 2LL * rank * (conv_ckk(d) + d->OC);
}

/* dA += scale B^T G and dB += scale G A^T, G (OC, C*KH*KW) the full weight
 * gradient, each if wanted. */
static void conv_low_rank_grads_from_full(Tape *t, const Conv2dCtx *c, Var *A, Var *B, const float *G) {
    const int ckk = conv_ckk(&c->d), OC = c->d.OC, r = c->rank;
    float *g;
    if (A->requires_grad && (g = tape_grad(t, A)))
        gemm_f32(true, false, r, ckk, OC, c->scale, B->value.data, r, G, ckk, 1.0f, g, ckk);
    if (B->requires_grad && (g = tape_grad(t, B)))
        gemm_f32(false, true, OC, r, ckk, c->scale, G, ckk, A->value.data, ckk, 1.0f, g, r);
}

static void conv2d_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0], *w = node->in[1], *bias = node->in[2], *A = node->in[3], *B = node->in[4];
    const Conv2dCtx *c = node->ctx;
    const ConvDims *d = &c->d;
    const int ckk = conv_ckk(d), tasks = conv_tasks(d);
    const size_t nw = (size_t)d->OC * ckk, na = (size_t)c->rank * ckk, nb = (size_t)d->OC * c->rank;
    const bool want_b = bias && bias->requires_grad;
    const bool want_lr = c->rank && (A->requires_grad || B->requires_grad), via_full = want_lr && c->lr_via_full;
    ConvJob j = {.c = c, .x = x->value.data, .w = c->rank ? c->w_merged : w->value.data, .ldw = c->rank ? c->ldw : ckk,
                 .y = node->out->value.data, .dy = node->out->grad};
    if (x->requires_grad && !(j.dx = tape_grad(t, x))) return;
    if (w->requires_grad || via_full) j.dw_part = tape_alloc(t, (size_t)tasks * nw * sizeof(float));
    if (!via_full) {
        j.da_part = conv_partials(t, A, tasks, na);
        j.dbb_part = conv_partials(t, B, tasks, nb);
    }
    if (want_b && (j.db_part = tape_alloc(t, (size_t)tasks * d->OC * sizeof(double))))
        memset(j.db_part, 0, (size_t)tasks * d->OC * sizeof(double));
    if (!tape_ok(t) || !conv_scratch(t, &j, true)) return;
    parallel_run(tasks, conv_backward_task, &j);
    float *g;
    if (via_full) { /* the full gradient, summed in task order, then A's and B's from it */
        float *G = tape_alloc(t, nw * sizeof *G);
        if (!G) return;
        memset(G, 0, nw * sizeof *G);
        conv_add_partials(G, j.dw_part, tasks, nw);
        if (w->requires_grad && (g = tape_grad(t, w)))
            for (size_t i = 0; i < nw; i++) g[i] += G[i];
        conv_low_rank_grads_from_full(t, c, A, B, G);
    } else if (j.dw_part && (g = tape_grad(t, w))) {
        conv_add_partials(g, j.dw_part, tasks, nw);
    }
    if (j.da_part && (g = tape_grad(t, A))) {
        if (c->da_by_dt_col) conv_add_da_flipped(g, j.da_part, d, c->rank, tasks);
        else conv_add_partials(g, j.da_part, tasks, na);
    }
    if (j.dbb_part && (g = tape_grad(t, B))) conv_add_partials(g, j.dbb_part, tasks, nb);
    if (want_b && (g = tape_grad(t, bias)))
        for (int oc = 0; oc < d->OC; oc++) {
            double acc = 0.0;
            for (int k = 0; k < tasks; k++) acc += j.db_part[(size_t)k * d->OC + oc];
            g[oc] += (float)acc;
        }
}

/* A (rank, C, KH, KW) and B (OC, rank, 1, 1) against x and w. */
static bool conv_low_rank_check(Tape *t, const ConvLowRank *lr, const Var *w) {
    const Var *A = lr->A, *B = lr->B;
    const int *ws = w->value.shape;
    bool ok = A && B && A->value.ndim == 4 && B->value.ndim == 4 && A->value.shape[1] == ws[1] &&
              A->value.shape[2] == ws[2] && A->value.shape[3] == ws[3] && B->value.shape[0] == ws[0] &&
              B->value.shape[1] == A->value.shape[0] && B->value.shape[2] == 1 && B->value.shape[3] == 1;
    if (!ok) {
        char as[SHAPE_STR_MAX] = "NULL", bs[SHAPE_STR_MAX] = "NULL", wss[SHAPE_STR_MAX];
        if (A) tensor_shape_str(&A->value, as, sizeof as);
        if (B) tensor_shape_str(&B->value, bs, sizeof bs);
        tensor_shape_str(&w->value, wss, sizeof wss);
        qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d low-rank term: A %s and B %s do not fit weight %s: want A "
                     "(rank, C, KH, KW) and B (OC, rank, 1, 1)", as, bs, wss);
    }
    return ok;
}

/* Conv2dCtx.w_merged for w and lr in the arena, or NULL (error on the
 * tape). The forward and the input gradient run on this one weight: per
 * sample, the separate terms A col and B (A col) in the forward and A^T dt
 * in the backward cost more than the whole product B A does once per pass
 * (by a factor of the batch's output positions over the rank, with OC and
 * C*KH*KW rows). */
static float *conv_merge_low_rank(Tape *t, const Var *w, const ConvLowRank *lr) {
    const int OC = w->value.shape[0], ckk = (int)(var_numel(w) / (size_t)OC), r = lr->A->value.shape[0];
    const int ldw = ckk + r;
    const float *wv = w->value.data, *A = lr->A->value.data, *B = lr->B->value.data;
    float *wm = tape_alloc(t, (size_t)(OC + r) * ldw * sizeof *wm);
    if (!wm) return NULL;
    for (int oc = 0; oc < OC; oc++) {
        memcpy(wm + (size_t)oc * ldw, wv + (size_t)oc * ckk, (size_t)ckk * sizeof *wm);
        for (int i = 0; i < r; i++) wm[(size_t)oc * ldw + ckk + i] = lr->scale * B[(size_t)oc * r + i];
    }
    for (int i = 0; i < r; i++) {
        memcpy(wm + (size_t)(OC + i) * ldw, A + (size_t)i * ckk, (size_t)ckk * sizeof *wm);
        memset(wm + (size_t)(OC + i) * ldw + ckk, 0, (size_t)r * sizeof *wm);
    }
    gemm_f32(false, false, OC, ckk, r, lr->scale, B, r, A, ckk, 1.0f, wm, ldw);
    return wm;
}

Var *nn_conv2d_fused_lowrank(Tape *t, Var *x, Var *w, Var *bias, const ConvLowRank *lr, int stride, int padding,
                             ConvEpilogue epi) {
    if (!t || !x || !w) return NULL;
    ConvDims d = {0}; /* zeroed only to quiet gcc: it cannot see that every error path returns */
    if (conv2d_check(t, x, w, bias, stride, padding, &d) != QT_OK) return NULL;
    if (lr && !conv_low_rank_check(t, lr, w)) return NULL;
    if (epi == CONV_EPI_RELU_MAXPOOL2 && (d.OH < 2 || d.OW < 2)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d+relu+maxpool2d: the convolution's output %dx%d is smaller than "
                     "the 2x2 pooling window", d.OH, d.OW);
        return NULL;
    }
    const bool pooled = epi == CONV_EPI_RELU_MAXPOOL2;
    const int YH = pooled ? d.OH / 2 : d.OH, YW = pooled ? d.OW / 2 : d.OW;
    Var *y = tape_new_var(t, 4, (const int[]){d.N, d.OC, YH, YW});
    Conv2dCtx *c = tape_alloc(t, sizeof *c);
    if (!y || !c) return NULL;
    *c = (Conv2dCtx){.d = d, .stride = stride, .padding = padding, .epi = epi, .rank = lr ? lr->A->value.shape[0] : 0,
                     .scale = lr ? lr->scale : 0.0f};
    c->chunk = conv_chunk(&d);
    c->lr_via_full = conv_low_rank_via_full(&d, c->rank);
    c->da_by_dt_col = conv_same_stride1(d.H, d.W, d.KH, d.KW, stride, padding, d.OH, d.OW);
    if (pooled && !(c->winner = tape_alloc(t, var_numel(y)))) return NULL;
    ConvJob j = {.c = c, .x = x->value.data, .w = w->value.data, .ldw = conv_ckk(&d),
                 .bias = bias ? bias->value.data : NULL, .y = y->value.data, .m_fwd = d.OC};
    if (lr) {
        if (!(c->w_merged = conv_merge_low_rank(t, w, lr))) return NULL;
        j.w = c->w_merged;
        j.ldw = c->ldw = conv_ckk(&d) + c->rank;
        /* dB wants A x; the forward's product gives it for rank more rows */
        if (t->grad_enabled && lr->B->requires_grad && !c->lr_via_full) {
            if (!(c->u = tape_alloc(t, (size_t)d.N * c->rank * conv_plane(&d) * sizeof(float)))) return NULL;
            j.m_fwd += c->rank;
        }
    }
    if (!conv_scratch(t, &j, false)) return NULL;
    parallel_run(conv_tasks(&d), conv_forward_task, &j);
    static const char *const names[] = {"conv2d", "conv2d+relu", "conv2d+relu+maxpool2d"};
    Var *in[5] = {x, w, bias, lr ? lr->A : NULL, lr ? lr->B : NULL};
    return tape_record(t, names[epi], conv2d_backward, y, in, 5, c) ? y : NULL;
}

Var *nn_conv2d_fused(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding, ConvEpilogue epi) {
    return nn_conv2d_fused_lowrank(t, x, w, bias, NULL, stride, padding, epi);
}

Var *nn_conv2d(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding) {
    return nn_conv2d_fused(t, x, w, bias, stride, padding, CONV_EPI_NONE);
}
