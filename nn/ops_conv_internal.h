/* ops_conv_internal.h - what the plain convolution (ops_conv.c) shares with
 * the fused low-rank one (ops_conv_lowrank.c): the geometry, the per-chunk
 * pieces of the forward and backward passes, and the tasks that run them
 * over the thread pool. Also the low-rank gradient strategies, which the
 * tests force one by one. Internal to nn/ and its tests. */
#ifndef QTRAIN_NN_OPS_CONV_INTERNAL_H
#define QTRAIN_NN_OPS_CONV_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "conv_taps.h"
#include "conv_wino.h"
#include "ops.h"

#define SHAPE_STR_MAX 64 /* "(2147483647, 2147483647, 2147483647, 2147483647)" fits */

typedef struct {
    int N, C, H, W;   /* input x */
    int OC, KH, KW;   /* weight w, with C */
    int OH, OW;       /* convolution output, before any pooling */
} ConvDims;

/* The saved state of one convolution, for its backward. */
typedef struct {
    ConvDims d;
    int stride, padding;
    ConvEpilogue epi;
    int chunk;        /* samples per im2col chunk */
    uint8_t *winner;  /* (N, OC, OH/2, OW/2) 2x2 window winner 0..3, CONV_EPI_RELU_MAXPOOL2 only */
} Conv2dCtx;

/* What a convolution's remake reads (nn_conv2d_remakeable): its saved state and its node's inputs. */
typedef struct {
    const void *ctx;        /* Conv2dCtx or ConvGDims */
    Var *x, *w, *bias;      /* bias may be NULL */
} ConvRemake;

/* ops_conv_general.c: the backward of its tape node, and the remake of that node's output when it costs at most
 * max_macs multiply-adds per value (false otherwise, or out of memory). */
TapeBackwardFn conv_general_backward_fn(void);
bool conv_general_remakeable(Tape *t, const TapeNode *n, int max_macs);

/* Work shared by the tasks of one forward or backward pass. */
typedef struct {
    const Conv2dCtx *c;
    const float *x;    /* (N, C, H, W) */
    const float *w;    /* (OC, C*KH*KW) with row length ldw (the low-rank form's merged weight is wider) */
    int ldw;
    const float *bias; /* (OC,) or NULL */
    float *y;          /* forward: the output; backward: the saved output (relu epilogues) */
    float *moments;    /* forward, no epilogue: (N, OC, 3), each output plane's batchnorm_plane_moments, or NULL */
    const NnAffineRelu *view; /* x is view->x read through the view's map (Var.view; plain routes), or NULL */
    const float *dy;   /* backward: the output's gradient */
    float *dx;         /* (N, C, H, W) accumulated, or NULL */
    bool dx_fresh;     /* dx uninitialised (tape_grad_to_write): each chunk writes its samples' part */
    float *dw_part;    /* per-task dW, conv_dw_part_floats apart: (OC, C*KH*KW), or with the taps kernels or dw_t
                        * its transpose (C*KH*KW, conv_taps_oc_pad(OC)); or NULL */
    bool dw_t;         /* conv_backward_task's im2col products write dw_part transposed (nn_conv2d's backward) */
    double *db_part;   /* (n_tasks, OC) per-task dbias, or NULL */
    /* per thread: col (col_floats), then prod (prod_floats: the forward's
     * product, the backward's dpre), then what the low-rank backward adds */
    float *scratch;
    size_t col_floats, prod_floats, thread_floats;
    /* the taps convolution (conv_taps.h) in place of im2col and sgemm, or taps NULL; col then holds padded planes */
    const ConvTaps *taps;
    ConvTapsLevel taps_level;
    const float *taps_w;  /* the forward's packed weights (conv_taps_pack), or NULL */
    const float *taps_wt; /* the input gradient's (conv_taps_pack_t), or NULL */
    const float *taps_a;  /* the low-rank forward: A's rank rows packed, whose product A x goes to taps_u */
    float *taps_u;        /* (rank, N OH OW): the samples' planes side by side, as a chunk's dpre lies; or NULL */
    int taps_rank;
    /* F(2x2, 3x3) (conv_wino.h) where conv_wino_fits, or wino NULL: for the forward (wino_w) and the input
     * gradient (wino_wt) in place of the taps' (taps_w, taps_wt then NULL), and for the weight gradient where
     * wino_dw (conv_wino_dw_pays); its scratch is the taps' padded images' */
    const ConvWino *wino;
    const float *wino_w, *wino_wt;
    const float *wino_a; /* the low-rank forward's A (rank rows) where F(2x2, 3x3) takes it, else taps_a's */
    bool wino_dw;
    int chunk;            /* samples per chunk of this pass if not c->chunk's (0) */
} ConvJob;

static inline int conv_job_chunk(const ConvJob *j) { return j->chunk ? j->chunk : j->c->chunk; }

static inline int conv_ckk(const ConvDims *d) { return d->C * d->KH * d->KW; }
static inline size_t conv_plane(const ConvDims *d) { return (size_t)d->OH * d->OW; }

/* Whether the geometry is the "same" stride-1 one (OH == H, OW == W,
 * padding (K-1)/2 on both axes), whose im2col rows are shifted planes. */
bool conv_same_stride1(int H, int W, int KH, int KW, int stride, int padding, int OH, int OW);
/* dst (H, W) = x_plane (H, W) shifted by (dh, dw), zero outside. */
void conv_shift_plane(float *restrict dst, const float *restrict x_plane, int H, int W, int dh, int dw);
/* col2im that may overwrite dcol (scratch); with write, dx (N, C, H, W)
 * is written as if it had been zeroed first (the same bits). */
void col2im_consume(float *dx, float *dcol, int N, int C, int H, int W, int KH, int KW, int stride, int padding,
                    int OH, int OW, bool write);

/* x: (N, C, H, W), w: (OC, C, KH, KW), bias: (OC,) or NULL. QT_OK and d
 * filled, or the error, set on the tape. */
QtStatus conv2d_check(Tape *t, const Var *x, const Var *w, const Var *bias, int stride, int padding, ConvDims *d);
/* The output Var for d and epi, or NULL (error on the tape: no memory, or
 * an output too small to pool). */
Var *conv2d_new_output(Tape *t, const ConvDims *d, ConvEpilogue epi);
/* Fills c for y = the convolution of d with epi, the pooling's winner
 * bytes from the arena. false: no memory (error on the tape). */
bool conv2d_ctx_init(Tape *t, Conv2dCtx *c, const ConvDims *d, int stride, int padding, ConvEpilogue epi,
                     const Var *y);
/* *m3 = step memory for the (N, OC, 3) plane moments of an output (OH, OW) a batch norm reads in training
 * (batchnorm_plane_moments), or NULL where they are not made (eval, or planes batchnorm_plane_fits refuses: the
 * batch norm reads the output itself). False when out of step memory (the error on the tape). */
bool conv_moments_take(Tape *t, float **m3, int N, int OC, int OH, int OW);
/* The tape op's name for epi. */
const char *conv2d_op_name(ConvEpilogue epi);

/* The tasks a pass of d is split into: CONV_TASKS_PER_THREAD per thread (one with one thread), at most one per
 * image. Each takes its samples by parallel_range_falling (an even split left the ResNet-8 step's main thread
 * waiting 5 % of its time at the ends of the passes), and none is empty: each writes its weight-gradient partial.
 * The pool hands them out as threads free up, so a thread slowed for a while (a busy sibling, a descheduled vCPU)
 * holds a pass up by the task it holds (the first is the largest: 29 of a 128 batch over 8 tasks), not by all of
 * its share. A fixed thread count gives fixed tasks, and the weight gradient's partials (one per task) are summed
 * in task order: the same bits run to run. */
#define CONV_TASKS_PER_THREAD 4
int conv_tasks(const ConvDims *d);
/* bytes of step memory for an op's scratch: a buffer an earlier op handed
 * back (tape_release_buffer) if one is large enough, else the arena's.
 * Uninitialised; NULL on error (on the tape). */
void *conv_buffer_take(Tape *t, size_t bytes);
/* Hands j's scratch, dW and dbias partials back to the tape once the pass
 * (and the sums of its partials) is done: the next ops of the step reuse
 * them instead of growing the arena. */
void conv_job_release(Tape *t, ConvJob *j, int n_tasks);
/* Sizes the per-thread scratch (col_rows and prod_rows rows of a chunk's
 * columns, plus extra_floats) and takes it (conv_buffer_take); NULL on error. */
float *conv_scratch(Tape *t, ConvJob *j, size_t col_rows, size_t prod_rows, size_t extra_floats);
/* ops_conv_taps.c: plans the taps convolution for j where conv_taps_fits at conv_taps_level(),
 * packing the forward's weights if fwd and the input gradient's if dx; else leaves j->taps NULL. False: no memory
 * (the error on the tape). Then conv_col_rows sizes col for what j runs. */
bool conv_taps_setup(Tape *t, ConvJob *j, int stride, int padding, bool fwd, bool dx);
size_t conv_col_rows(const ConvJob *j, bool backward);
/* ops_conv_taps.c: prod = the forward of chunk samples [n0, n0 + nc) (sample s's channel oc at prod + oc ldc +
 * s lds: (OC, nc OH OW), or y's own (nc, OC, OH OW)), input xc (nc, C, H, W), col holding one padded sample at a
 * time (and taps_u's A x from the same padding); the backward's from the output
 * gradient dp at the convolution (sample s's channel oc at dp + oc ldc + s lds: a dpre (OC, nc OH OW) has ldc =
 * nc OH OW, lds = OH OW; the output gradient as it lies, (nc, OC, OH, OW), ldc = OH OW, lds = OC OH OW): the
 * weight gradient (transposed into dwt: conv_taps_dw's sums, added to dwt if add) from the chunk's padded
 * inputs and each sample's transposed dp, then dx; col holds all three.
 * conv_taps_dx_chunk: dx of those samples from dp, each padded at dpad (padded floats for OC channels). */
void conv_taps_forward_chunk(const ConvJob *j, float *prod, size_t ldc, size_t lds, float *col, const float *xc,
                             int n0, int nc);
void conv_taps_backward_chunk(const ConvJob *j, float *dwt, float *col, const float *dp, size_t ldc, size_t lds,
                              int n0, int nc, bool add);
/* Floats of one sample's transposed gradient of rows channels (conv_taps_dp_t), and where it lies in a thread's
 * col (after the padded inputs and the padded dpre conv_col_rows counts). */
size_t conv_taps_dpt_floats(const ConvJob *j, int rows);
float *conv_taps_dpt(const ConvJob *j, float *col);
void conv_taps_dx_chunk(const ConvJob *j, float *dpad, const float *dp, size_t ldc, size_t lds, int n0, int nc);
/* The calling thread's part of j->scratch. */
float *conv_thread_scratch(const ConvJob *j);
/* Samples [n0, n0 + nc) of j's input (nc, C, H, W): x itself, or made through j's view into the thread's scratch
 * after col and prod. */
const float *conv_chunk_input(const ConvJob *j, int n0, int nc);

/* One chunk of the forward, samples [n0, n0 + nc): the product (im2col
 * into col and w col, or the taps) into prod (OC, nc*OH*OW), or straight
 * into j->y where its layout is y's (unpooled: one sample, or the taps at
 * any nc; prod then untouched), and the epilogue into j->y (none for the
 * taps without bias or relu: their stores add the sums to +0.0f). Returns
 * the chunk's im2col matrix: col, x itself for one sample of a pointwise
 * conv (1x1, stride 1, no padding), which is read in place, or NULL for
 * the taps. */
const float *conv_forward_chunk(const ConvJob *j, float *col, float *prod, int n0, int nc);
/* parallel_run task: the forward over the task's samples. */
void conv_forward_task(void *ctx, int task, int n_tasks);
/* dpre (OC, nc*OH*OW): the gradient before the epilogue of chunk samples
 * [n0, n0 + nc); adds each row's sum to the task's dbias partial. */
void conv_pre_grads(const ConvJob *j, float *dpre, int n0, int nc, int task);
/* parallel_run task: dx, the dW partials and the dbias partials over the
 * task's samples. */
void conv_backward_task(void *ctx, int task, int n_tasks);
/* The gradients' buffers for one backward: dx if x wants it, the per-task
 * dW partials if want_dw, dbias's (zeroed) if bias wants it. false: no
 * memory (error on the tape). */
bool conv_backward_alloc(Tape *t, ConvJob *j, Var *x, bool want_dw, const Var *bias, int n_tasks);
/* Per-task partials for v's gradient, n floats each, or NULL (not wanted, or error on the tape). */
float *conv_partials(Tape *t, const Var *v, int n_tasks, size_t n);
/* grad [n] += the n_tasks partials [n_tasks][n], in task order; _apart: partials stride floats apart. */
void conv_add_partials(float *grad, const float *parts, int n_tasks, size_t n);
void conv_add_partials_apart(float *grad, const float *parts, int n_tasks, size_t n, size_t stride);
/* Floats of one task's dW partial: room for either form (C*KH*KW conv_taps_oc_pad(OC)). */
size_t conv_dw_part_floats(const ConvDims *d);
/* grad (OC, C*KH*KW) += j's n_tasks dW partials, in task order, in the form j's kernels wrote (j->taps). */
void conv_add_dw_parts(const ConvJob *j, float *grad, int n_tasks);
/* bias's gradient += the sum of j's dbias partials, in task order. */
void conv_add_bias_grad(Tape *t, const ConvJob *j, Var *bias, int n_tasks);

/* ---- the fused low-rank convolution (ops_conv_lowrank.c) ------------------ */

/* How the low-rank form's backward gets A's and B's gradients. Each gives
 * the same gradients up to rounding; they differ in cost only. */
typedef enum {
    CONV_LR_GRAD_AUTO,  /* conv_lowrank_grad_choose picks one of the three below */
    /* From the full weight gradient G = dpre col^T: dA = scale B^T G and
     * dB = scale G A^T once per pass. */
    CONV_LR_GRAD_FULL,
    /* From the adapter's own products: dB from the A x the forward keeps,
     * dt = scale B^T dpre with the input gradient's product, and dA = dt
     * col^T, which keeps col alive through that product. */
    CONV_LR_GRAD_COL,
    /* As CONV_LR_GRAD_COL, but dA = im2col(dt) x^T with the kernel flipped:
     * x needs no im2col. The "same" stride-1 geometry only. */
    CONV_LR_GRAD_DTCOL,
} ConvLowRankGrad;

/* The strategy the low-rank form uses for a convolution of d with a
 * rank-rank term (rank >= 1), from the sizes alone. */
ConvLowRankGrad conv_lowrank_grad_choose(const ConvDims *d, int rank, int stride, int padding);

/* nn_conv2d_fused_lowrank with the gradient strategy grad (AUTO: as
 * conv_lowrank_grad_choose picks). CONV_LR_GRAD_DTCOL on another geometry
 * is a QT_ERR_ARG error. lr must not be NULL. */
Var *conv2d_lowrank_with_grad(Tape *t, Var *x, Var *w, Var *bias, const ConvLowRank *lr, int stride, int padding,
                              ConvEpilogue epi, ConvLowRankGrad grad);
/* The strategy the tape node of a low-rank convolution recorded. */
ConvLowRankGrad conv_lowrank_node_grad(const TapeNode *node);

/* nn/conv_dw_wgrad.c: the stride-1 depthwise weight gradient's lane sums, acc [KH KW][CONV_DW_LANES]: lane l of tap
 * (kh, kw) = the sum over chunks q0 = 0, 16, .. < L of dy[q0 + l] * xp[q0 + l + kh step_h + kw step_w], in q0's
 * order (a multiply and an add, no FMA), at level's vector width: the same bits at every level. */
#define CONV_DW_LANES 16
void conv_dw_wgrad_lanes(ConvTapsLevel level, float *restrict acc, const float *restrict dy, const float *restrict xp,
                         size_t L, int KH, int KW, size_t step_h, size_t step_w);

#endif
