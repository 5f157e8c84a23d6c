/* fqt_internal.h - what QT's forward (fqt.c) and backward (fqt_backward.c)
 * share: the saved state of a QT node and the helpers both use. Internal
 * to quant/ and its tests. */
#ifndef QTRAIN_QUANT_FQT_INTERNAL_H
#define QTRAIN_QUANT_FQT_INTERNAL_H

#include "fqt.h"
#include "qarray_plan.h"

#define FQT_OP "qt"

/* The convolution's sizes; the input is (N, C, H, W), the output (N, OC, OH, OW). */
typedef struct {
    int N, C, H, W, KH, KW, OH, OW, stride, padding;
} FqtConvGeom;

/* A QT node's saved state (arena). Rows of X and g: the batch (dense) or the output pixels (n, oh, ow) (conv). */
typedef struct {
    FqtLayer *q;            /* its Rng draws the backward's noise */
    bool conv;
    FqtConvGeom cg;         /* conv only */
    int rows, out, fan_in;
    float sx;              /* the input's scale (per tensor) */
    float x_lo, x_hi;      /* the input's representable range in units of sx: the clipped STE passes inside */
    float w_lo, w_hi;      /* the weight's, in units of its row's scale */
    const float *sw;       /* [out] the weight's scale per output channel */
    const float *wd;       /* (out, fan_in) deq(W) */
    const int8_t *xc;      /* (rows, fan_in) X's integer codes (the integer GEMM), or NULL */
    const int8_t *xb;      /* x's integer codes in x's layout ((N, C, H, W) or (N, fan_in)), integer GEMM only */
    const int8_t *xt;      /* conv on the integer path: X^T's codes, blocks (fan_in, L) per dW chunk, or NULL */
    bool int_bwd;          /* integer forward and g's format takes the int rules: fqt_backward's integer path */
    const float *xd;       /* (rows, fan_in) deq(X) (the float GEMM), or NULL */
    ConvEpilogue epi;      /* conv: the relu (and 2x2 max pool) fused after it (fqt's fused hook) */
    const uint8_t *winner; /* (N, OC, OH/2, OW/2) the pool's winners, CONV_EPI_RELU_MAXPOOL2 only */
} FqtCtx;

/* The backward of a QT node (fqt_backward.c). */
void fqt_backward(Tape *t, const TapeNode *node);
/* The rows of g per scale of dW's quantized g (bwd_weight_grad_tile_size, or all rows). */
static inline int fqt_grad_tile(const FqtCtx *c) {
    const int k = c->q->spec.bwd_weight_grad_tile_size;
    return k > 0 && k < c->rows ? k : c->rows;
}
/* Whether the backward takes the integer path (given X's codes): g's format takes fqt_kern.h's int rules. */
bool fqt_int_backward_applies(const FqtCtx *c);
/* A conv's X^T codes for rows [r0, r0 + L) (a dW chunk): the block (fan_in, L) at xt + r0 * fan_in, from c->xb
 * (the im2col layout), split over the threads. Dense layers need none: their dW reads X's rows. */
void fqt_gather_xt(int8_t *xt, const FqtCtx *c, int r0, int L);

/* fn(ctx, lo, hi) over [0, n) in contiguous shares, a few per thread (FQT_SHARES_PER_THREAD), taken by the
 * step's threads as they free up; every item's result depends on the item alone, so the split changes no bit.
 * One share when the work (elements touched) is small. */
typedef void (*FqtShareFn)(const void *ctx, int lo, int hi);
void fqt_shares_run(int n, size_t work, FqtShareFn fn, const void *ctx);

/* qgemm_s8 split over the step's threads by rows of a and c (exact sums: the split changes nothing). */
void fqt_qgemm_s8(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K);
/* qgemm_s8_nn (c (M, N), rows ldc apart, = a (M, K) b (K, N), b's rows ldb apart) split by columns of b. */
void fqt_qgemm_s8_nn(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K);

/* The scale of the slice v [n] under plan p (calibrated, rounded to the scale type); work as calib_compute takes
 * it. */
QtStatus fqt_slice_scale(const QArrayPlan *p, const float *v, size_t n, void *work, size_t work_bytes, float *s,
                         QtError *err);
/* Sets the tape error for an error of `inner` while quantizing `what`; returns false. */
bool fqt_quant_failed(Tape *t, const FqtLayer *q, const char *what, const QtError *inner);

#endif
