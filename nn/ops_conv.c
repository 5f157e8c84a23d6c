/* ops_conv.c - 2-D convolution, alone or with a fused relu / relu + 2x2 max
 * pool epilogue.
 *
 * Convolution lowers to matrix products: im2col unrolls the receptive fields
 * of a chunk of samples into the columns of `col`, so
 *     y (OC, chunk*OH*OW) = w (OC, C*KH*KW) @ col (C*KH*KW, chunk*OH*OW)
 * (see nn_conv2d_fused below for the chunking; im2col and col2im live in
 * ops_conv_im2col.c). The pieces of a pass are
 * shared with the low-rank form (ops_conv_lowrank.c) through
 * ops_conv_internal.h. The `_ref` functions (ops_conv_ref.c) are direct
 * loops with no BLAS, for tests only. */
#include "ops_conv_internal.h"

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
 * keeps only its pooled output and one byte per window. A pointwise conv
 * (conv_pointwise) runs one sample a chunk, with no copies at all. */
#define CONV_CHUNK_BUDGET (256u << 10)

/* Output size along one axis, or 0 if the kernel does not fit the padded input. */
static long long conv_out_size(int in, int kernel, int stride, int padding) {
    long long padded = (long long)in + 2LL * padding;
    return padded < kernel ? 0 : (padded - kernel) / stride + 1;
}

QtStatus conv2d_check(Tape *t, const Var *x, const Var *w, const Var *bias, int stride, int padding, ConvDims *d) {
    char xs[SHAPE_STR_MAX], ws[SHAPE_STR_MAX], bs[SHAPE_STR_MAX];
    tensor_shape_str(&x->value, xs, sizeof xs);
    tensor_shape_str(&w->value, ws, sizeof ws);
    if (x->value.ndim != 4)
        return qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d: input %s must be 4-D (N, C, H, W) (weight %s)", xs, ws);
    if (w->value.ndim != 4)
        return qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d: weight %s must be 4-D (OC, C, KH, KW) (input %s)", ws,
                            xs);
    if (x->view && x->view->affine_only)
        return qt_error_set(&t->err, QT_ERR_ARG, "conv2d: its input %s is a batch norm's view without relu "
                            "(nn_batchnorm_view), which only nn_add reads", xs);
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

/* A 1x1 convolution at stride 1 without padding: one sample's input (C, H*W) is its own im2col matrix, and its
 * output gradient (OC, H*W) the backward's dpre (without an epilogue), so a chunk of one sample reads both in
 * place and writes dx straight from the product. */
static bool conv_pointwise(const ConvDims *d) {
    return d->KH == 1 && d->KW == 1 && d->OH == d->H && d->OW == d->W;
}

/* Samples per chunk: as many as keep the chunk's im2col and product within the budget. */
static int conv_chunk(const ConvDims *d) {
    if (conv_pointwise(d)) return 1;
    size_t per_sample = (size_t)(conv_ckk(d) + d->OC) * conv_plane(d) * sizeof(float);
    size_t n = per_sample ? CONV_CHUNK_BUDGET / per_sample : 1;
    if (n < 1) n = 1;
    return n > (size_t)d->N ? d->N : (int)n;
}

Var *conv2d_new_output(Tape *t, const ConvDims *d, ConvEpilogue epi) {
    const bool pooled = epi == CONV_EPI_RELU_MAXPOOL2;
    if (pooled && (d->OH < 2 || d->OW < 2)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d+relu+maxpool2d: the convolution's output %dx%d is smaller than "
                     "the 2x2 pooling window", d->OH, d->OW);
        return NULL;
    }
    const int YH = pooled ? d->OH / 2 : d->OH, YW = pooled ? d->OW / 2 : d->OW;
    return tape_new_var(t, 4, (const int[]){d->N, d->OC, YH, YW});
}

bool conv2d_ctx_init(Tape *t, Conv2dCtx *c, const ConvDims *d, int stride, int padding, ConvEpilogue epi,
                     const Var *y) {
    *c = (Conv2dCtx){.d = *d, .stride = stride, .padding = padding, .epi = epi, .chunk = conv_chunk(d)};
    return epi != CONV_EPI_RELU_MAXPOOL2 || (c->winner = tape_alloc(t, var_numel(y)));
}

const char *conv2d_op_name(ConvEpilogue epi) {
    static const char *const names[] = {"conv2d", "conv2d+relu", "conv2d+relu+maxpool2d"};
    return names[epi];
}

/* Writes chunk sample s's output plane for channel oc from its product row
 * row [OH*OW]; row may be that output plane itself (unpooled epilogues). */
void nn_conv_epilogue_plane(float *y, uint8_t *winner, const float *pre, float b, int OH, int OW, ConvEpilogue epi) {
    const size_t plane = (size_t)OH * OW;
    if (epi == CONV_EPI_NONE) {
        for (size_t p = 0; p < plane; p++) y[p] = pre[p] + b;
        return;
    }
    if (epi == CONV_EPI_RELU) {
        for (size_t p = 0; p < plane; p++) {
            float v = pre[p] + b;
            y[p] = v > 0.0f ? v : 0.0f;
        }
        return;
    }
    /* the taps' ISA (QTRAIN_CONV_KERNEL caps both): AVX2's 8 windows where pool2x2_avx2_fits */
    if (pool2x2_avx2_fits(OH, OW) && conv_taps_level() >= CONV_TAPS_AVX2)
        pool2x2_relu_plane_avx2(y, winner, pre, b, OH, OW);
    else pool2x2_relu_plane(y, winner, pre, b, OH, OW);
}

static void conv_epilogue(const ConvJob *j, const float *row, int n, int oc) {
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const size_t out_plane = c->epi == CONV_EPI_RELU_MAXPOOL2 ? (size_t)(d->OH / 2) * (d->OW / 2) : conv_plane(d);
    const size_t at = ((size_t)n * d->OC + oc) * out_plane;
    nn_conv_epilogue_plane(j->y + at, c->winner ? c->winner + at : NULL, row, j->bias ? j->bias[oc] : 0.0f, d->OH,
                           d->OW, c->epi);
}

float *conv_thread_scratch(const ConvJob *j) {
    return j->scratch + (size_t)parallel_thread_index() * j->thread_floats;
}

/* Floats of the thread scratch that hold a chunk's input made through a view (after col and prod). */
static size_t conv_view_floats(const ConvJob *j, const Var *x) {
    return x->view ? (size_t)conv_job_chunk(j) * j->c->d.C * j->c->d.H * j->c->d.W : 0;
}

/* Samples [n0, n0 + nc) of the input (nc, C, H, W): x itself, or made through the view (the values the batch
 * norm + relu would have written) into the thread's scratch after col and prod. */
const float *conv_chunk_input(const ConvJob *j, int n0, int nc) {
    const ConvDims *d = &j->c->d;
    const size_t in_plane = (size_t)d->H * d->W;
    const float *x = j->x + (size_t)n0 * d->C * in_plane;
    if (!j->view) return x;
    float *buf = conv_thread_scratch(j) + j->col_floats + j->prod_floats;
    const NnAffineRelu *v = j->view;
    for (int s = 0; s < nc; s++)
        for (int c = 0; c < d->C; c++) {
            const size_t at = ((size_t)s * d->C + c) * in_plane;
            /* the backward reads x from memory, a few KB a plane: ask for the plane two ahead (as im2col's splits) */
            if ((size_t)s * d->C + c + 2 < (size_t)nc * d->C) nn_prefetch(x + at + 2 * in_plane, in_plane);
            batchnorm_relu_rows(buf + at, in_plane, x + at, 1, (int)in_plane, v->mean[c], v->scale[c],
                                v->beta ? v->beta[c] : 0.0f);
        }
    return buf;
}

const float *conv_forward_chunk(const ConvJob *j, float *col, float *prod, int n0, int nc) {
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const size_t plane = conv_plane(d);
    const int cols = nc * (int)plane;
    const float *xc = conv_chunk_input(j, n0, nc);
    /* The product's layout: channel oc of chunk sample s at prod + oc ldc + s lds. Unpooled, one sample's product
     * (OC, OH*OW) is its output's layout, and the taps write any layout: the product goes straight into y, (nc, OC,
     * OH*OW), and the epilogue runs in place, the same operations on the same values without the copy through
     * prod. With neither bias nor relu the taps' stores have done its add of 0.0f (a -0.0f sum made +0.0f, so the
     * bits do not depend on the chunking): no pass at all. */
    size_t ldc = (size_t)cols, lds = plane;
    const bool in_y = c->epi != CONV_EPI_RELU_MAXPOOL2 && (nc == 1 || j->taps);
    if (in_y) prod = j->y + (size_t)n0 * d->OC * plane, ldc = plane, lds = (size_t)d->OC * plane;
    if (j->taps) {
        conv_taps_forward_chunk(j, prod, ldc, lds, col, xc, n0, nc);
        col = NULL;
    } else {
        if (nc == 1 && conv_pointwise(d)) col = (float *)xc; /* read, never written */
        else im2col(col, xc, nc, d->C, d->H, d->W, d->KH, d->KW, c->stride, c->padding, d->OH, d->OW);
        gemm_f32(false, false, d->OC, cols, conv_ckk(d), 1.0f, j->w, j->ldw, col, cols, 0.0f, prod, (int)ldc);
    }
    if (!(in_y && j->taps && c->epi == CONV_EPI_NONE && !j->bias))
        for (int oc = 0; oc < d->OC; oc++)
            for (int s = 0; s < nc; s++) conv_epilogue(j, prod + (size_t)oc * ldc + (size_t)s * lds, n0 + s, oc);
    if (j->moments) /* the chunk's output planes, just written, still in cache */
        batchnorm_plane_moments(j->moments + 3 * (size_t)n0 * d->OC, j->y + (size_t)n0 * d->OC * plane, plane,
                                nc * d->OC);
    return col;
}

void conv_forward_task(void *ctx, int task, int n_tasks) {
    const ConvJob *j = ctx;
    const int chunk = j->c->chunk;
    float *col = conv_thread_scratch(j), *prod = col + j->col_floats;
    int lo, hi;
    parallel_range_falling(j->c->d.N, task, n_tasks, &lo, &hi);
    for (int n0 = lo; n0 < hi; n0 += chunk) conv_forward_chunk(j, col, prod, n0, hi - n0 < chunk ? hi - n0 : chunk);
}

/* nn_sum8_f32: one chain would wait on the add latency for every element. The SSE2 lanes hold the same eight
 * chains, combined in the same order, so both paths give the same bits. */
double nn_sum8_f32(const float *g, const float *y, size_t n) {
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

void nn_conv_epilogue_grad_plane(float *dpre, const float *dy, const float *y, const uint8_t *winner, int OH, int OW,
                                 ConvEpilogue epi) {
    const size_t plane = (size_t)OH * OW;
    if (epi == CONV_EPI_NONE) { /* the output may be gone (model_graph_train_memory): not read */
        memcpy(dpre, dy, plane * sizeof *dpre);
        return;
    }
    if (epi == CONV_EPI_RELU) {
        for (size_t p = 0; p < plane; p++) dpre[p] = y[p] > 0.0f ? dy[p] : 0.0f;
        return;
    }
    /* Only each window's winner gets the pooled gradient, and only if the
     * relu let it through: the pooled value is the winner's relu output.
     * The row pairs are written whole; a last odd row or column belongs to
     * no window. */
    if (pool2x2_avx2_fits(OH, OW) && conv_taps_level() >= CONV_TAPS_AVX2)
        pool2x2_relu_grad_plane_avx2(dpre, dy, y, winner, OH, OW);
    else pool2x2_relu_grad_plane(dpre, dy, y, winner, OH, OW);
    if (OW & 1)
        for (int r = 0; r < OH / 2 * 2; r++) dpre[(size_t)r * OW + OW - 1] = 0.0f;
    if (OH & 1) memset(dpre + (size_t)(OH - 1) * OW, 0, (size_t)OW * sizeof *dpre);
}

/* dpre row [OH*OW]: the gradient at the convolution's output (before the
 * epilogue) of sample n, channel oc. Returns the row's sum (the bias's share). */
static double conv_pre_grad(const ConvJob *j, float *row, int n, int oc) {
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const bool pooled = c->epi == CONV_EPI_RELU_MAXPOOL2;
    const size_t out_plane = pooled ? (size_t)(d->OH / 2) * (d->OW / 2) : conv_plane(d);
    const size_t at = ((size_t)n * d->OC + oc) * out_plane;
    const float *g = j->dy + at, *y = c->epi == CONV_EPI_NONE ? NULL : j->y + at;
    nn_conv_epilogue_grad_plane(row, g, y, pooled ? c->winner + at : NULL, d->OH, d->OW, c->epi);
    if (!j->db_part) return 0.0;
    return pooled ? nn_sum8_f32(g, y, out_plane) : nn_sum8_f32(row, NULL, conv_plane(d));
}

void conv_pre_grads(const ConvJob *j, float *dpre, int n0, int nc, int task) {
    const ConvDims *d = &j->c->d;
    const size_t plane = conv_plane(d), cols = (size_t)nc * plane;
    double *db = j->db_part ? j->db_part + (size_t)task * d->OC : NULL; /* (OC,) */
    for (int oc = 0; oc < d->OC; oc++)
        for (int s = 0; s < nc; s++) {
            double sum = conv_pre_grad(j, dpre + (size_t)oc * cols + (size_t)s * plane, n0 + s, oc);
            if (db) db[oc] += sum;
        }
}

/* One chunk's backward: dpre, then the weight gradient from the chunk's
 * im2col, then dcol = w^T dpre (in col's place) and col2im. */
void conv_backward_task(void *ctx, int task, int n_tasks) {
    const ConvJob *j = ctx;
    const Conv2dCtx *c = j->c;
    const ConvDims *d = &c->d;
    const int ckk = conv_ckk(d);
    const size_t plane = conv_plane(d), x_sample = (size_t)d->C * d->H * d->W;
    float *col = conv_thread_scratch(j), *dpre = col + j->col_floats;
    float *dw = j->dw_part ? j->dw_part + (size_t)task * conv_dw_part_floats(d) : NULL; /* j->dw_part's forms */
    int lo, hi;
    parallel_range_falling(d->N, task, n_tasks, &lo, &hi);
    const int chunk = conv_job_chunk(j);
    for (int n0 = lo; n0 < hi; n0 += chunk) {
        const int nc = hi - n0 < chunk ? hi - n0 : chunk, cols = nc * (int)plane;
        const float *dp = dpre; /* (OC, cols): channel oc of sample s at oc ldc + s lds */
        size_t ldc = (size_t)cols, lds = plane;
        if (c->epi == CONV_EPI_NONE && (nc == 1 || j->taps)) {
            /* the output gradient is dpre as it stands, one sample's (OC, OH*OW) or, for the taps kernels, which
             * take any strides, the chunk's (nc, OC, OH*OW): read it in place, no copy */
            dp = j->dy + (size_t)n0 * d->OC * plane, ldc = plane, lds = (size_t)d->OC * plane;
            if (j->db_part)
                for (int oc = 0; oc < d->OC; oc++)
                    for (int s = 0; s < nc; s++)
                        j->db_part[(size_t)task * d->OC + oc] +=
                            nn_sum8_f32(dp + (size_t)oc * ldc + (size_t)s * lds, NULL, plane);
        } else {
            conv_pre_grads(j, dpre, n0, nc, task);
        }
        if (j->taps) {
            conv_taps_backward_chunk(j, dw, col, dp, ldc, lds, n0, nc, n0 != lo);
            continue;
        }
        const bool pw = nc == 1 && conv_pointwise(d);
        if (dw) {
            const float *xc = conv_chunk_input(j, n0, nc);
            if (!pw) im2col(col, xc, nc, d->C, d->H, d->W, d->KH, d->KW, c->stride, c->padding, d->OH, d->OW);
            if (j->dw_t) /* col dp^T: a product of ckk rows runs faster than dp col^T's OC (32 or 64) rows */
                gemm_f32(false, true, ckk, d->OC, cols, 1.0f, pw ? xc : col, cols, dp, cols, n0 == lo ? 0.0f : 1.0f,
                         dw, (int)conv_taps_oc_pad(d->OC));
            else
                gemm_f32(false, true, d->OC, ckk, cols, 1.0f, dp, cols, pw ? xc : col, cols, n0 == lo ? 0.0f : 1.0f,
                         dw, ckk);
        }
        if (j->dx && pw) { /* dx's sample is the product itself */
            gemm_f32(true, false, ckk, cols, d->OC, 1.0f, j->w, j->ldw, dp, cols, j->dx_fresh ? 0.0f : 1.0f,
                     j->dx + (size_t)n0 * x_sample, cols);
        } else if (j->dx) {
            gemm_f32(true, false, ckk, cols, d->OC, 1.0f, j->w, j->ldw, dp, cols, 0.0f, col, cols);
            col2im_consume(j->dx + (size_t)n0 * x_sample, col, nc, d->C, d->H, d->W, d->KH, d->KW, c->stride,
                           c->padding, d->OH, d->OW, j->dx_fresh);
        }
    }
}

int conv_tasks(const ConvDims *d) {
    int t = parallel_get_threads();
    if (t > 1) t *= CONV_TASKS_PER_THREAD;
    return t > d->N ? d->N : t;
}

void *conv_buffer_take(Tape *t, size_t bytes) {
    const size_t floats = (bytes + sizeof(float) - 1) / sizeof(float);
    if (floats == 0 || floats > INT_MAX) return tape_alloc(t, bytes);
    /* tape_new_var is the way to a buffer an earlier op of the step handed
     * back; only its value buffer is used. */
    Var *v = tape_new_var(t, 1, (const int[]){(int)floats});
    return v ? v->value.data : NULL;
}

void conv_job_release(Tape *t, ConvJob *j, int n_tasks) {
    const ConvDims *d = &j->c->d;
    tape_release_buffer(t, j->scratch, (size_t)parallel_get_threads() * j->thread_floats * sizeof(float));
    tape_release_buffer(t, j->dw_part, (size_t)n_tasks * conv_dw_part_floats(d) * sizeof(float));
    tape_release_buffer(t, j->db_part, (size_t)n_tasks * d->OC * sizeof(double));
    j->scratch = j->dw_part = NULL;
    j->db_part = NULL;
}

float *conv_scratch(Tape *t, ConvJob *j, size_t col_rows, size_t prod_rows, size_t extra_floats) {
    const size_t cols = (size_t)conv_job_chunk(j) * conv_plane(&j->c->d);
    j->col_floats = col_rows * cols;
    j->prod_floats = prod_rows * cols;
    j->thread_floats = j->col_floats + j->prod_floats + extra_floats;
    j->scratch = conv_buffer_take(t, (size_t)parallel_get_threads() * j->thread_floats * sizeof(float));
    return j->scratch;
}

/* The same result whichever thread ran which task. */
void conv_add_partials_apart(float *grad, const float *parts, int n_tasks, size_t n, size_t stride) {
    for (int k = 0; k < n_tasks; k++)
        for (size_t i = 0; i < n; i++) grad[i] += parts[(size_t)k * stride + i];
}

void conv_add_partials(float *grad, const float *parts, int n_tasks, size_t n) {
    conv_add_partials_apart(grad, parts, n_tasks, n, n);
}

size_t conv_dw_part_floats(const ConvDims *d) { return (size_t)conv_ckk(d) * conv_taps_oc_pad(d->OC); }

typedef struct {
    const ConvJob *j;
    float *grad;
    int n_parts;
} DwPartsJob;

static void dw_parts_task(void *ctx, int task, int n_tasks) {
    const DwPartsJob *a = ctx;
    const ConvDims *d = &a->j->c->d;
    int lo, hi;
    parallel_range(d->OC, task, n_tasks, &lo, &hi);
    conv_dw_t_add_parts_rows(a->grad, a->j->dw_part, a->n_parts, d->OC, (size_t)conv_ckk(d), lo, hi);
}

/* The transposed partials (the taps', or dw_t's) summed over the pool by rows of grad from this many floats of
 * partials (one thread summing a 64-channel layer's kept the other waiting about 1 % of the ResNet-8 step). */
#define DW_PARTS_PARALLEL_MIN (1 << 15)

void conv_add_dw_parts(const ConvJob *j, float *grad, int n_tasks) {
    if (j->taps || j->dw_t) {
        const int threads = parallel_get_threads();
        DwPartsJob a = {j, grad, n_tasks};
        if (threads > 1 && (size_t)n_tasks * conv_dw_part_floats(&j->c->d) >= DW_PARTS_PARALLEL_MIN &&
            j->c->d.OC >= threads)
            parallel_run(threads, dw_parts_task, &a);
        else dw_parts_task(&a, 0, 1);
        return;
    }
    conv_add_partials_apart(grad, j->dw_part, n_tasks, (size_t)j->c->d.OC * conv_ckk(&j->c->d),
                            conv_dw_part_floats(&j->c->d));
}

float *conv_partials(Tape *t, const Var *v, int n_tasks, size_t n) {
    return v && v->requires_grad ? conv_buffer_take(t, (size_t)n_tasks * n * sizeof(float)) : NULL;
}

bool conv_backward_alloc(Tape *t, ConvJob *j, Var *x, bool want_dw, const Var *bias, int n_tasks) {
    const ConvDims *d = &j->c->d;
    /* the first writer of x's gradient writes it instead of adding into zeros */
    if (x->requires_grad && !(j->dx = tape_grad_to_write(t, x, &j->dx_fresh))) return false;
    if (want_dw && !(j->dw_part = conv_buffer_take(t, (size_t)n_tasks * conv_dw_part_floats(d) * sizeof(float))))
        return false;
    if (bias && bias->requires_grad) {
        if (!(j->db_part = conv_buffer_take(t, (size_t)n_tasks * d->OC * sizeof(double)))) return false;
        memset(j->db_part, 0, (size_t)n_tasks * d->OC * sizeof(double));
    }
    return true;
}

void conv_add_bias_grad(Tape *t, const ConvJob *j, Var *bias, int n_tasks) {
    float *g;
    if (!j->db_part || !(g = tape_grad(t, bias))) return;
    for (int oc = 0; oc < j->c->d.OC; oc++) {
        double acc = 0.0;
        for (int k = 0; k < n_tasks; k++) acc += j->db_part[(size_t)k * j->c->d.OC + oc];
        g[oc] += (float)acc;
    }
}

static void conv2d_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0], *w = node->in[1], *bias = node->in[2];
    const Conv2dCtx *c = node->ctx;
    const int tasks = conv_tasks(&c->d);
    if (x->view && !tape_value_ready(t, x->view->x)) return; /* the view's source, if it was dropped */
    ConvJob j = {.c = c, .x = x->view ? x->view->x->value.data : x->value.data, .w = w->value.data,
                 .ldw = conv_ckk(&c->d), .y = node->out->value.data, .dy = node->out->grad, .view = x->view};
    if (!conv_backward_alloc(t, &j, x, w->requires_grad, bias, tasks) ||
        !conv_taps_setup(t, &j, c->stride, c->padding, false, j.dx != NULL) ||
        !conv_scratch(t, &j, conv_col_rows(&j, true), (size_t)c->d.OC, conv_view_floats(&j, x)))
        return;
    j.dw_t = !j.taps;
    parallel_run(tasks, conv_backward_task, &j);
    float *g;
    if (j.dw_part && (g = tape_grad(t, w))) conv_add_dw_parts(&j, g, tasks);
    conv_add_bias_grad(t, &j, bias, tasks);
    conv_job_release(t, &j, tasks);
    /* the pooling winners are read by this pass alone */
    tape_release_buffer(t, c->winner, var_numel(node->out));
}

bool nn_conv2d_input_grad(Tape *t, float *dx, const float *dy, const float *w, int N, int C, int H, int W, int OC,
                          int KH, int KW, int stride, int padding) {
    if (N <= 0) return true;
    const int OH = (H + 2 * padding - KH) / stride + 1, OW = (W + 2 * padding - KW) / stride + 1;
    const ConvDims d = {N, C, H, W, OC, KH, KW, OH, OW};
    Conv2dCtx c;
    if (!conv2d_ctx_init(t, &c, &d, stride, padding, CONV_EPI_NONE, NULL)) return false;
    ConvJob j = {.c = &c, .w = w, .ldw = conv_ckk(&d), .dy = dy, .dx = dx, .dx_fresh = true};
    if (!conv_taps_setup(t, &j, stride, padding, false, true) ||
        !conv_scratch(t, &j, conv_col_rows(&j, true), (size_t)OC, 0))
        return false;
    parallel_run(conv_tasks(&d), conv_backward_task, &j);
    conv_job_release(t, &j, conv_tasks(&d));
    return true;
}

/* The forward of c on x into y (c's output shape, before any pooling epilogue writes the smaller y); with
 * moments (N, OC, 3), no epilogue, each plane's batchnorm_plane_moments too. */
static bool conv2d_forward_run(Tape *t, const Conv2dCtx *c, const Var *x, const Var *w, const Var *bias, float *y,
                               float *moments) {
    ConvJob j = {.c = c, .x = x->view ? x->view->x->value.data : x->value.data, .w = w->value.data,
                 .ldw = conv_ckk(&c->d), .bias = bias ? bias->value.data : NULL, .y = y, .moments = moments,
                 .view = x->view};
    if (!conv_taps_setup(t, &j, c->stride, c->padding, true, false) ||
        !conv_scratch(t, &j, conv_col_rows(&j, false), (size_t)c->d.OC, conv_view_floats(&j, x)))
        return false;
    parallel_run(conv_tasks(&c->d), conv_forward_task, &j);
    conv_job_release(t, &j, conv_tasks(&c->d));
    return true;
}

bool conv_moments_take(Tape *t, float **m3, int N, int OC, int OH, int OW) {
    *m3 = NULL;
    if (!t->training || !batchnorm_plane_fits((size_t)OH * OW)) return true; /* the batch norm reads y itself */
    return (*m3 = tape_alloc(t, (size_t)N * OC * 3 * sizeof(float))) != NULL;
}

static Var *conv2d_forward(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding, ConvEpilogue epi,
                           bool moments) {
    if (!t || !x || !w) return NULL;
    ConvDims d = {0}; /* zeroed only to quiet gcc: it cannot see that every error path returns */
    if (conv2d_check(t, x, w, bias, stride, padding, &d) != QT_OK) return NULL;
    Var *y = conv2d_new_output(t, &d, epi);
    Conv2dCtx *c = y ? tape_alloc(t, sizeof *c) : NULL;
    if (!c || !conv2d_ctx_init(t, c, &d, stride, padding, epi, y)) return NULL;
    float *m3 = NULL;
    if (moments && epi == CONV_EPI_NONE && !conv_moments_take(t, &m3, d.N, d.OC, d.OH, d.OW)) return NULL;
    if (!conv2d_forward_run(t, c, x, w, bias, y->value.data, m3)) return NULL;
    y->moments = m3;
    return tape_record(t, conv2d_op_name(epi), conv2d_backward, y, (Var *[]){x, w, bias}, 3, c) ? y : NULL;
}

Var *nn_conv2d_fused(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding, ConvEpilogue epi) {
    return conv2d_forward(t, x, w, bias, stride, padding, epi, false);
}

Var *nn_conv2d(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding) {
    return conv2d_forward(t, x, w, bias, stride, padding, CONV_EPI_NONE, false);
}

Var *nn_conv2d_bn(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding) {
    return conv2d_forward(t, x, w, bias, stride, padding, CONV_EPI_NONE, true);
}

/* ---- remaking a dropped output ------------------------------------------------ */

/* A convolution costing at most this many multiply-adds per output value is
 * remade in the backward rather than kept (nn_conv2d_remakeable): a first
 * layer on 1 to 3 channels, a depthwise conv. Remaking a 16-channel 3x3 conv
 * would cost as much as a third of its backward again. */
#define CONV_REMAKE_MAX_MACS 27

static void conv2d_remake(Tape *t, float *y, const void *ctx) {
    const ConvRemake *r = ctx;
    if (tape_value_ready(t, r->x) && (!r->x->view || tape_value_ready(t, r->x->view->x)))
        conv2d_forward_run(t, r->ctx, r->x, r->w, r->bias, y, NULL);
}

bool nn_conv2d_remakeable(Tape *t, Var *y) {
    for (size_t i = t->n_nodes, seen = 0; i-- > 0 && seen < 4; seen++) {
        const TapeNode *n = &t->nodes[i];
        if (n->out != y) continue;
        if (n->backward == conv_general_backward_fn()) return conv_general_remakeable(t, n, CONV_REMAKE_MAX_MACS);
        const Conv2dCtx *c = n->ctx;
        if (n->backward != conv2d_backward || c->epi != CONV_EPI_NONE || conv_ckk(&c->d) > CONV_REMAKE_MAX_MACS)
            return false;
        ConvRemake *r = tape_alloc(t, sizeof *r);
        if (!r) return false;
        *r = (ConvRemake){c, n->in[0], n->in[1], n->in[2]};
        return tape_remake_set(t, y, NULL, conv2d_remake, r);
    }
    return false;
}
