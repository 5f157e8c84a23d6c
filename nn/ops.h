/* ops.h - differentiable ops.
 *
 * Two levels:
 *  - kernels: plain forward/backward function pairs on raw float arrays
 *    (outputs first, then inputs, then sizes). Backward kernels accumulate
 *    (+=) into the input grads they are given; a NULL grad pointer means
 *    "not needed" and is skipped. Fast kernels have a scalar `_ref` twin.
 *  - tape ops (nn_*): check shapes, allocate the output from the step
 *    arena, run the forward kernel and record the backward. They return
 *    NULL on error (tape->err says which op and which shapes) or when given
 *    a NULL input, so a forward pass can be checked once at the end.
 *
 * Shapes are written (N, C, H, W) for images and (N, F) for features. */
#ifndef QTRAIN_NN_OPS_H
#define QTRAIN_NN_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tape.h"

/* Marks a kernel whose loops vectorise: it gets AVX-512 and AVX2 copies,
 * the CPU's best chosen once at load (the default build targets baseline
 * x86-64, 4-float vectors). fp-contract is off in every copy, so none fuses
 * a multiply and an add the others round twice: all copies give the same
 * bits. Short copy loops stay loops rather than becoming memcpy calls (rows
 * of a few floats). (clang, which builds the fuzz targets, links no
 * resolver for it.) No variable caps the choice at run time; `make
 * CLONES=avx2` builds without the AVX-512 copies (QTRAIN_NO_AVX512_CLONES,
 * into build/avx2/), so an AVX-512 machine runs what an AVX2-only one runs
 * (bench/README.md). */
#ifdef QTRAIN_NO_AVX512_CLONES
#define NN_CLONE_TARGETS "avx2", "default"
#else
#define NN_CLONE_TARGETS "avx512f", "avx2", "default"
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NN_SIMD_CLONES                                                                                    \
    __attribute__((target_clones(NN_CLONE_TARGETS),                                                        \
                   optimize("fp-contract=off", "no-tree-loop-distribute-patterns")))
#else
#define NN_SIMD_CLONES
#endif

/* Asks for the n floats at p, a 64-byte line at a time: the kernels that walk a channel across the batch (runs
 * C*H*W apart, each on a page the hardware's prefetchers have not followed) call it for the run a few samples
 * ahead. Never faults. */
static inline __attribute__((always_inline)) void nn_prefetch(const float *p, size_t n) {
    for (size_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);
}

/* ---- matrix products ------------------------------------------------- */

/* y = op(a) @ op(b). a: (M, K), or (K, M) if trans_a; b: (K, N), or (N, K)
 * if trans_b. y: (M, N). */
Var *nn_matmul(Tape *t, Var *a, Var *b, bool trans_a, bool trans_b);

/* The dense layer's fused op: y = x @ w^T + bias.
 * x: (N, in), w: (out, in), bias: (out,) or NULL; y: (N, out). */
Var *nn_linear(Tape *t, Var *x, Var *w, Var *bias);

/* ---- elementwise and broadcasting ------------------------------------ */

/* y = x + bias broadcast along axis 1. x: (N, C) or (N, C, H, W); bias (C,). */
Var *nn_bias_add(Tape *t, Var *x, Var *bias);
/* y = a + b, same shapes. a and b may be the same Var (its gradient gets dy twice). Either may be a batch norm's
 * view (nn_batchnorm_view, nn_batchnorm_relu_view), made plane by plane as it is added. */
Var *nn_add(Tape *t, Var *a, Var *b);
/* relu(a + b) (v > 0 ? v : 0) in the add's one pass, recorded as nn_add (its backward passes dy on): for a caller
 * that then records the relu with nn_relu_inplace_applied on y, whose backward masks the gradient (a residual
 * block's add and its relu, model_graph_add_relu). The same bits as nn_add then nn_relu_inplace, a pass fewer. */
Var *nn_add_relu(Tape *t, Var *a, Var *b);
/* Concatenation along the channel axis 1: xs[0..n) of (N, Ci, ...), n >= 1,
 * equal in every dim but axis 1; y: (N, sum Ci, ...). A Var may appear more
 * than once. */
Var *nn_concat(Tape *t, Var *const *xs, int n);
/* y = s * x. */
Var *nn_scale(Tape *t, Var *x, float s);
Var *nn_relu(Tape *t, Var *x);
/* relu written over x's values (y shares x's buffer), for a caller that
 * knows nothing else reads x and that x's producer's backward does not read
 * it (model_graph_relu_in_place). The same values and gradients as nn_relu. */
Var *nn_relu_inplace(Tape *t, Var *x);
/* nn_relu_inplace on values already relu'd (nn_add_relu's): the relu node, no pass. */
Var *nn_relu_inplace_applied(Tape *t, Var *x);
/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
Var *nn_gelu(Tape *t, Var *x);
Var *nn_tanh(Tape *t, Var *x);
Var *nn_sigmoid(Tape *t, Var *x);
/* Inverted dropout: zero with probability p, scale survivors by 1/(1-p).
 * The identity when !t->training or p == 0. Masks come from t->rng. */
Var *nn_dropout(Tape *t, Var *x, float p);

/* Same data, new shape (numel must agree). Shares the value buffer. */
Var *nn_reshape(Tape *t, Var *x, int ndim, const int *shape);
/* (N, ...) -> (N, rest). */
Var *nn_flatten(Tape *t, Var *x);

/* Layer normalisation over the last axis: x (..., D), gamma/beta (D,) or NULL. */
Var *nn_layernorm(Tape *t, Var *x, Var *gamma, Var *beta, float eps);

/* Batch normalisation's settings and running statistics. The statistics are
 * buffers, not parameters: no gradient, never touched by an optimizer. The
 * caller owns them (allocates them for the run, initialises running_mean to 0,
 * running_var to 1 and the count to 0 as PyTorch does, and checkpoints them);
 * the op reads them, and updates them in the training form. */
typedef struct {
    float *running_mean;          /* (C,); NULL with running_var: keep no running
                                     statistics (PyTorch's track_running_stats=False) */
    float *running_var;           /* (C,) */
    int64_t *num_batches_tracked; /* one counter, or NULL */
    float momentum;               /* in [0, 1]: running = (1 - momentum) running + momentum batch (0.1) */
    float eps;                    /* > 0, added to the variance (1e-5) */
    bool frozen;                  /* normalise with the running statistics and leave them alone even when
                                     the tape trains (a frozen base, BN statistics frozen for QAT) */
} BatchNormState;

/* Batch normalisation over every axis but the channel axis 1, as PyTorch's
 * BatchNorm1d/2d. x: (N, C), (N, C, L) or (N, C, H, W); gamma, beta: (C,) or
 * NULL (affine=False); y like x.
 * The form follows t->training, as a module's training flag in PyTorch:
 *  - training (and not bn->frozen), or no running statistics: normalise with
 *    this batch's mean and biased variance; update the running mean and the
 *    running variance with the unbiased one (N*inner/(N*inner-1) times the
 *    biased), and add 1 to num_batches_tracked. The backward is the full
 *    batch-norm gradient (through the mean and variance). Needs more than one
 *    value per channel.
 *  - otherwise (eval, or frozen): the affine map with the running statistics,
 *    (x - running_mean) / sqrt(running_var + eps) * gamma + beta; nothing is
 *    updated.
 * Data-parallel (t->bn_sync set, tape training, training form): the batch
 * statistics are the global batch's, as PyTorch's SyncBatchNorm. Each rank's
 * count, mean and variance are gathered (on the calling thread) and combined
 * in rank order in double; the running update's unbiased factor takes the
 * global count, and one value per channel on a rank is enough. The backward
 * gathers sum dy and sum dy (x - mean) for dx; dgamma and dbeta stay this
 * rank's sums (the ranks' parameter gradients are summed afterwards). A
 * failed gather sets the tape error: NULL, or the backward stops.
 * The statistics come from one read of the input: float lanes per block of
 * a channel, the blocks merged in double (batchnorm_stats). Channels run over the thread pool; the result is the same for any thread
 * count. */
Var *nn_batchnorm(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn);
/* relu(nn_batchnorm(...)) in two recorded nodes over one buffer, for a relu that is the batch norm's only reader:
 * nn_batchnorm_relu applies the relu in the batch norm's own pass (its output is already relu'd), and
 * nn_batchnorm_relu_inplace(t, y) on that output records the relu (in place, as nn_relu_inplace) without a pass
 * of its own; in the backward the relu hands its gradient on unmasked and the batch norm's passes mask it, the
 * mask made again from x. The same bits as nn_batchnorm then nn_relu_inplace, two passes fewer. Call
 * nn_batchnorm_relu_inplace on every nn_batchnorm_relu output (error QT_ERR_ARG on any other y). */
Var *nn_batchnorm_relu(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn);
Var *nn_batchnorm_relu_inplace(Tape *t, Var *y);
/* nn_batchnorm without its output pass, for an add that alone reads the output (a residual block's second batch
 * norm, model_graph_bn_add_view): nn_add makes each plane through the view as it adds, the same floats as
 * nn_batchnorm then nn_add, and the batch norm's backward reads x as nn_batchnorm's does. Only nn_add reads such
 * a view (the convolutions refuse it). */
Var *nn_batchnorm_view(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn);
/* A value never written: relu((x - mean[c]) * scale[c] + beta[c]) per channel c of x (N, C, inner), as
 * nn_batchnorm_relu would have written it (Var.view); with affine_only, without the relu, as nn_batchnorm would
 * have (nn_batchnorm_view, which only nn_add reads). */
typedef struct NnAffineRelu {
    Var *x;                           /* (N, C, inner): the batch norm's input */
    const float *mean, *scale, *beta; /* (C,); beta may be NULL (0) */
    bool affine_only;                 /* no relu */
} NnAffineRelu;
/* nn_batchnorm_relu without its output pass, for a relu whose only reader is a convolution of the plain
 * geometry (nn_conv2d, nn_conv2d_fused: each chunk's input is made through the view into scratch before its
 * im2col) or a depthwise stride-1 one (nn_conv2d_general: each plane made as it is padded), in its forward and
 * again in its backward: the batch statistics, the running update and the backward are nn_batchnorm_relu's, y's
 * buffer is never made (value.data NULL), and no pass writes or remakes it. nn_batchnorm_relu_inplace on y
 * passes the view on. Other readers refuse it (QT_ERR_ARG) or must not be given it. */
Var *nn_batchnorm_relu_view(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn);
/* The backward of a recorded relu node (in[0] x, out relu(x)): what nn_relu and nn_relu_inplace record, for ops
 * that record relu nodes of their own and fall back to it. */
void nn_relu_tape_backward(Tape *t, const TapeNode *node);
/* Lets the tape drop y, nn_batchnorm's recorded output (relu'd in place into
 * relu_out by nn_relu_inplace, or relu_out NULL), and make it again from the
 * node's input for the backward (tape_remake_set): the caller keeps that
 * input until the node's backward. false if y's node is not found among the
 * last few (not recorded) or out of memory (tape error set). */
bool nn_batchnorm_remakeable(Tape *t, Var *y, Var *relu_out);
/* The same for y, a recorded nn_conv2d (no epilogue) or nn_conv2d_general
 * output, if remaking it is cheap: at most 27 multiply-adds per value (a
 * first layer on few channels, a depthwise conv); false otherwise. Its
 * input, weight and bias must stay (or be remakeable) until y's readers'
 * backwards are done. */
bool nn_conv2d_remakeable(Tape *t, Var *y);

/* ---- convolution (ops_conv.c, ops_conv_lowrank.c) and pooling (ops_pool.c) */

/* x: (N, C, H, W), w: (OC, C, KH, KW), bias: (OC,) or NULL.
 * y: (N, OC, OH, OW), OH = (H + 2*padding - KH)/stride + 1 (likewise OW).
 * Zero padding; im2col + sgemm a few samples at a time, over the thread
 * pool; nothing but the output is kept for the backward. */
Var *nn_conv2d(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding);

typedef enum {
    CONV_EPI_NONE,          /* the convolution: nn_conv2d */
    CONV_EPI_RELU,          /* relu(conv): (N, OC, OH, OW) */
    CONV_EPI_RELU_MAXPOOL2, /* maxpool 2x2 stride 2 of relu(conv): (N, OC, OH/2, OW/2) */
} ConvEpilogue;
/* The convolution with its following layers fused in: the same values and
 * gradients as nn_conv2d -> nn_relu (-> nn_maxpool2d(2, 2)), without the
 * full-resolution intermediates (a pooled block keeps one byte per window
 * for its backward). model_forward uses it for unhooked conv2d modules. */
Var *nn_conv2d_fused(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding, ConvEpilogue epi);
/* One output plane of the fused epilogue: y = epi(pre + b), pre (OH, OW)
 * the convolution's plane without bias; y (OH, OW), or (OH/2, OW/2) with
 * winner [OH/2 * OW/2] for the pool. And its backward: dpre (OH, OW), the
 * gradient before the epilogue, from dy, y and winner as the forward left
 * them (y unread for CONV_EPI_NONE). For ops that run a convolution of
 * their own and fuse as nn_conv2d_fused does (the same bits). */
void nn_conv_epilogue_plane(float *y, uint8_t *winner, const float *pre, float b, int OH, int OW, ConvEpilogue epi);
/* The sum of g [n], or with y [n] given, of (y[p] > 0 ? g[p] : 0) (the relu's gradient), in double over eight
 * interleaved partial sums combined in a fixed order: a bias gradient, a plane's mean. */
double nn_sum8_f32(const float *g, const float *y, size_t n);
void nn_conv_epilogue_grad_plane(float *dpre, const float *dy, const float *y, const uint8_t *winner, int OH, int OW,
                                 ConvEpilogue epi);
/* dx (N, C, H, W) = the input gradient of the plain convolution of a
 * (N, C, H, W) input by w (OC, C*KH*KW) with stride and padding, for the
 * output gradient dy (N, OC, OH, OW): nn_conv2d's own backward pass for
 * dx, written, not added. For ops that run a forward of their own (QT's
 * integer one); scratch from the tape. false: no memory (on the tape). */
bool nn_conv2d_input_grad(Tape *t, float *dx, const float *dy, const float *w, int N, int C, int H, int W, int OC,
                          int KH, int KW, int stride, int padding);

/* A low-rank term added to the convolution's weight: w + scale * B A, as a
 * LoRA adapter on a conv2d layer computes it (A a convolution with w's
 * kernel, stride and padding to rank channels, B a 1x1 convolution back). */
typedef struct {
    Var *A;      /* (rank, C, KH, KW) */
    Var *B;      /* (OC, rank, 1, 1) */
    float scale;
} ConvLowRank;
/* nn_conv2d_fused plus scale * conv(conv(x, A), B) (ops_conv_lowrank.c).
 * The forward and the input gradient run on the merged weight
 * w + scale * B A (formed once per call). A's and B's gradients take the
 * cheapest of three routes for the sizes (ConvLowRankGrad,
 * ops_conv_internal.h): from the full weight gradient, or from their own
 * products (two forms of dA's), for which the forward keeps A x (N, rank, OH, OW) for B's and
 * the input gradient's product also gives scale B^T dy for A's. No second
 * (N, OC, OH, OW) tensor is held, and a frozen w costs no weight gradient
 * unless the first route wants it. B = 0 gives the base's output bit for
 * bit. lr NULL: nn_conv2d_fused. */
Var *nn_conv2d_fused_lowrank(Tape *t, Var *x, Var *w, Var *bias, const ConvLowRank *lr, int stride, int padding,
                             ConvEpilogue epi);
/* The general convolution's geometry (ops_conv_general.c). Padding is
 * pad_h rows on top and pad_h + pad_h_extra at the bottom (likewise pad_w,
 * pad_w_extra on the left and right): the extra row or column is how
 * PyTorch's padding='same' pads an even total (conv_geom2d_same). */
typedef struct {
    int stride_h, stride_w; /* >= 1 */
    int pad_h, pad_w;       /* >= 0 */
    int dil_h, dil_w;       /* >= 1; the kernel's taps lie dil apart */
    int groups;             /* >= 1, divides C and OC; C = groups: depthwise */
    int pad_h_extra, pad_w_extra; /* >= 0, usually 0 */
} ConvGeom2d;
/* Stride and padding on both axes, dilation 1, one group. */
ConvGeom2d conv_geom2d(int stride, int padding);
/* Sets g's padding to PyTorch 1.13's padding='same' for a KH x KW kernel at
 * g's dilation: total dil*(K-1) per axis, half of it (rounded down) on the
 * top/left, the rest on the bottom/right. Strides other than 1: QT_ERR_ARG
 * (as PyTorch refuses them). */
QtStatus conv_geom2d_same(ConvGeom2d *g, int KH, int KW, QtError *err);
/* x: (N, C, H, W), w: (OC, C/groups, KH, KW), bias: (OC,) or NULL.
 * y: (N, OC, OH, OW), OH = (H + 2*pad_h + pad_h_extra - dil_h*(KH-1) - 1)/stride_h + 1
 * (likewise OW). Output channel oc sees input channels of group
 * oc / (OC/groups). The plain geometry (one group, dilation 1, the same
 * stride and padding on both axes) is nn_conv2d; depthwise (groups = C > 1,
 * OC a multiple of C) runs direct loops; other groups im2col + sgemm per
 * sample and group. Over the thread pool; a result does not depend on the
 * thread count. */
Var *nn_conv2d_general(Tape *t, Var *x, Var *w, Var *bias, const ConvGeom2d *g);
/* nn_conv2d / nn_conv2d_general for a batch norm that is the output's only reader: the same output and backward,
 * and in training (t->training) also y->moments, each output plane's batchnorm_plane_moments made while the plane
 * is in cache (plain and depthwise routes, planes of 16 to 1024 values), which nn_batchnorm's batch statistics
 * merge instead of reading y again: the same statistics, bit for bit. */
Var *nn_conv2d_bn(Tape *t, Var *x, Var *w, Var *bias, int stride, int padding);
Var *nn_conv2d_general_bn(Tape *t, Var *x, Var *w, Var *bias, const ConvGeom2d *g);

/* x: (N, C, H, W) -> (N, C, OH, OW), OH = (H - kernel)/stride + 1, no padding.
 * Max ties go to the first element in row-major window order. */
Var *nn_maxpool2d(Tape *t, Var *x, int kernel, int stride);
Var *nn_avgpool2d(Tape *t, Var *x, int kernel, int stride);
/* x: (N, C, H, W) -> (N, C): the mean over H and W (PyTorch's
 * adaptive_avg_pool2d(x, 1) flattened), summed in double. */
Var *nn_globalavgpool(Tape *t, Var *x);
/* The mean of x [n] as nn_globalavgpool takes it: nn_sum8_f32's sum in double, divided by n, as float. An op that
 * makes its output's Var.means for a globalavgpool reader computes them with this. */
float nn_plane_mean(const float *x, size_t n);
/* out[p] = nn_plane_mean(x + p n, n) for p < planes, the same bits, four planes' eight sums side by side. */
void nn_plane_means(float *out, const float *x, size_t planes, size_t n);
/* For tests: true makes maxpool2d skip its 2x2/stride-2 fast path. */
extern bool maxpool_force_generic;

/* ---- losses (scalar outputs, shape (1,)) ------------------------------ */

/* Mean over the batch of -log softmax(logits)[label]. logits: (N, C),
 * labels: [N] in 0..C-1. NaN/Inf logits or a label out of range: error. */
Var *nn_softmax_cross_entropy(Tape *t, Var *logits, const int32_t *labels);
/* Mean over all elements of (pred - target)^2; target gets no gradient. */
Var *nn_mse(Tape *t, Var *pred, Var *target);

/* ---- kernels ---------------------------------------------------------- */

/* restrict: outputs never alias inputs, which lets the compiler vectorise. */

void relu_forward(float *restrict y, const float *restrict x, size_t n);
void relu_backward(float *restrict dx, const float *restrict dy, const float *restrict y, size_t n);
/* dx = relu's gradient (written, not added); dx may be dy (in place). */
void relu_backward_write(float *dx, const float *dy, const float *restrict y, size_t n);
void gelu_forward(float *restrict y, const float *restrict x, size_t n);
void gelu_backward(float *restrict dx, const float *restrict dy, const float *restrict x, size_t n);
void tanh_forward(float *restrict y, const float *restrict x, size_t n);
void tanh_backward(float *restrict dx, const float *restrict dy, const float *restrict y, size_t n);
void sigmoid_forward(float *restrict y, const float *restrict x, size_t n);
void sigmoid_backward(float *restrict dx, const float *restrict dy, const float *restrict y, size_t n);

/* x, y: (rows, D); mean, rstd: [rows] saved for the backward. */
void layernorm_forward(float *y, float *mean, float *rstd, const float *x, const float *gamma,
                       const float *beta, int rows, int D, float eps);
void layernorm_backward(float *dx, float *dgamma, float *dbeta, const float *dy, const float *x,
                        const float *gamma, const float *mean, const float *rstd, int rows, int D);

/* Batch-norm kernels on x viewed as (N, C, inner), over channels [c0, c1)
 * (ops_norm.c). Arrays indexed by channel are (C,).
 * stats: mean and biased variance of each channel, in double. */
void batchnorm_stats(double *mean, double *var, const float *x, int N, int C, size_t inner, int c0, int c1);
/* dst rows (rows, cols) at row stride ldd = relu((x - m) * a + b) of the contiguous x (rows, cols): the values
 * batchnorm_apply_relu writes, bit for bit, for one plane (a reader of an NnAffineRelu view). */
void batchnorm_relu_rows(float *dst, size_t ldd, const float *x, int rows, int cols, float m, float a, float b);
/* y [n] = v + s (s NULL: v), v = (x - m) * a + b, relu'd if relu: batchnorm_apply's (or batchnorm_apply_relu's)
 * value then nn_add's sum, bit for bit (a reader of an NnAffineRelu view: nn_add); the sum relu'd if relu_sum
 * (nn_add_relu; s not NULL). y may be s. */
void batchnorm_view_add(float *y, const float *x, const float *s, size_t n, float m, float a, float b, bool relu,
                        bool relu_sum);
/* A (sample, channel) plane of inner values (batchnorm_plane_fits: 16 to 1024) is one block of batchnorm_stats:
 * batchnorm_plane_moments makes its m3[3] (the block's shift and its moments about it), by whoever writes the
 * plane while it is in cache (a conv before the batch norm), and batchnorm_stats_planes merges the (N, C, 3)
 * planes' m3 in batchnorm_stats's order: the same mean and variance, bit for bit, without reading x again. */
bool batchnorm_plane_fits(size_t inner);
/* m3 (P, 3) of the P planes x (P, inner), one after another. */
void batchnorm_plane_moments(float *m3, const float *x, size_t inner, int P);
void batchnorm_stats_planes(double *mean, double *var, const float *m3, int N, int C, size_t inner, int c0, int c1);
/* The `_ref` twin: two serial passes in double. */
void batchnorm_stats_ref(double *mean, double *var, const float *x, int N, int C, size_t inner, int c0, int c1);
/* y = (x - mean) * scale + beta (beta NULL: 0). */
void batchnorm_apply(float *y, const float *x, const float *mean, const float *scale, const float *beta, int N,
                     int C, size_t inner, int c0, int c1);
/* The same, relu'd (y > 0 ? y : 0, as nn_relu_inplace): batchnorm_apply then the relu, in one pass. */
void batchnorm_apply_relu(float *y, const float *x, const float *mean, const float *scale, const float *beta, int N,
                          int C, size_t inner, int c0, int c1);
/* sum_dy = sum dy, dot = sum dy (x - mean), per channel, in double. */
void batchnorm_grad_sums(double *sum_dy, double *dot, const float *dy, const float *x, const float *mean, int N,
                         int C, size_t inner, int c0, int c1);
void batchnorm_grad_sums_ref(double *sum_dy, double *dot, const float *dy, const float *x, const float *mean, int N,
                             int C, size_t inner, int c0, int c1);
/* The same with dy the gradient of relu(y) rather than of y, y = (x - mean) * scale + beta as batchnorm_apply makes
 * it: every dy is first masked as the relu's backward masks it (dy where y > 0, else 0), y made again from x. */
void batchnorm_grad_sums_relu(double *sum_dy, double *dot, const float *dy, const float *x, const float *mean,
                              const float *scale, const float *beta, int N, int C, size_t inner, int c0, int c1);
void batchnorm_grad_sums_relu_ref(double *sum_dy, double *dot, const float *dy, const float *x, const float *mean,
                                  const float *scale, const float *beta, int N, int C, size_t inner, int c0, int c1);
/* dx (+= if accumulate, else =) (dy - k1 - (x - mean) k2) scale; dx may be dy. */
void batchnorm_grad_input(float *dx, bool accumulate, const float *dy, const float *x, const float *mean,
                          const float *scale, const float *k1, const float *k2, int N, int C, size_t inner, int c0,
                          int c1);
/* The same with dy masked as batchnorm_grad_sums_relu masks it (the forward's scale and beta). */
void batchnorm_grad_input_relu(float *dx, bool accumulate, const float *dy, const float *x, const float *mean,
                               const float *scale, const float *beta, const float *k1, const float *k2, int N, int C,
                               size_t inner, int c0, int c1);

/* probs: (N, C) softmax of logits, saved for the backward; returns mean loss. */
double softmax_cross_entropy_forward(float *probs, const float *logits, const int32_t *labels, int N, int C);
/* dlogits (N, C) += dloss * (probs - onehot) / N. */
void softmax_cross_entropy_backward(float *dlogits, float dloss, const float *probs, const int32_t *labels,
                                    int N, int C);

/* col: (C*KH*KW, N*OH*OW): row (c, kh, kw), column (n, oh, ow). */
void im2col(float *col, const float *x, int N, int C, int H, int W, int KH, int KW, int stride, int padding,
            int OH, int OW);
/* dx (N, C, H, W) += the scatter of dcol (C*KH*KW, N*OH*OW): im2col's adjoint. */
void col2im(float *dx, const float *dcol, int N, int C, int H, int W, int KH, int KW, int stride, int padding,
            int OH, int OW);
/* Direct convolution, for tests: y (N, OC, OH, OW) = conv(x, w) + bias. */
void conv2d_forward_ref(float *y, const float *x, const float *w, const float *bias, int N, int C, int H, int W,
                        int OC, int KH, int KW, int stride, int padding);
/* Direct backward, for tests; accumulates into the non-NULL grads. */
void conv2d_backward_ref(float *dx, float *dw, float *dbias, const float *dy, const float *x, const float *w,
                         int N, int C, int H, int W, int OC, int KH, int KW, int stride, int padding);
/* Direct general convolution (groups, dilation, per-axis stride and
 * padding), for tests: the `_ref` twin of nn_conv2d_general's kernels.
 * y: (N, OC, OH, OW), x: (N, C, H, W), w: (OC, C/groups, KH, KW). */
void conv2d_general_forward_ref(float *y, const float *x, const float *w, const float *bias, int N, int C, int H,
                                int W, int OC, int KH, int KW, const ConvGeom2d *g);
/* Its backward, accumulating into the non-NULL dx, dw, dbias. */
void conv2d_general_backward_ref(float *dx, float *dw, float *dbias, const float *dy, const float *x,
                                 const float *w, int N, int C, int H, int W, int OC, int KH, int KW,
                                 const ConvGeom2d *g);
/* Output size along one axis of the general convolution, 0 if the dilated
 * kernel does not fit the padded input. */
int conv_general_out_size(int in, int kernel, int stride, int pad_before, int pad_after, int dil);

#endif
