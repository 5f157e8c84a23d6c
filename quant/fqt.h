/* qt.h - quantized training (QT) of a dense or conv2d layer: the forward
 * GEMM on quantized operands and the two backward GEMMs on a quantized
 * incoming gradient.
 *
 * Forward. The weight W (out, fan_in) is quantized per output channel and
 * the input per tensor, both symmetric with absmax ranges (QArray's rules,
 * so the values are QAT's dynamic fake quantization of the same layer), in
 * the rule's weight_qtype / act_qtype. X is the input matrix (rows,
 * fan_in): rows = N for dense; conv: the im2col matrix of the quantized
 * input, one row per output pixel, (N*OH*OW, C*KH*KW). For int8 on both
 * sides the product is a real integer GEMM (int8 x int8 -> int32,
 * qgemm_s8, then y = acc * sx * sw[col] in float); for other formats the
 * float GEMM of the dequantized operands. The bias is added in float.
 *
 * Backward, with g = dL/dy (rows, out):
 *   dX = g W     g quantized with bwd_qtype per row of g (its non-contracting
 *                axis in this product), W the forward's quantized weight;
 *   dW = g^T X   g quantized per output channel (column of g), over tiles of
 *                bwd_weight_grad_tile_size rows along the contraction (batch)
 *                axis when > 0; X the forward's quantized input.
 * Both products use the same noise when rounding is stochastic: u ~ U[0, 1)
 * (floor(v + u), i.e. U(-1/2, 1/2) noise before round-to-nearest) drawn
 * per element along the axes in noise_axes (bit 0: the rows of g, bit 1:
 * its columns) and shared (broadcast) along the others; default rows only.
 * The noise comes from the layer's Rng, advanced by the same count every
 * step, so a resumed run draws the same noise.
 * With bwd_qtype NULL the backward is QAT's: the float GEMMs of the
 * straight-through estimator (clipped at the operands' ranges) on the
 * dequantized forward operands.
 *
 * How the products run (fqt_backward.c). Where the forward was integer
 * and bwd_qtype takes fqt_kern.h's int rules, g is quantized in the
 * output's own layout, dW is the exact int8 product of g's column codes
 * and X's codes (contraction pieces of at most FQT_DW_CHUNK rows, scaled
 * per tile: qgemm_s8_nn on X's rows for dense; for conv qgemm_s8 of X^T
 * and g, or of g and X^T where the patch has fewer elements than the
 * layer has channels, the smaller operand packed), and dX = g_row deq(W)
 * goes through the float convolution's input-gradient pass (or one GEMM
 * for dense): the row scales of g and the channel scales of W share W's
 * contraction axis, so dX has no integer form. Otherwise float GEMMs of
 * the dequantized values.
 * The codes, scales and noise are the same either way.
 *
 * Scratch comes from the tape's arena; nothing is allocated per step. */
#ifndef QTRAIN_QUANT_QT_H
#define QTRAIN_QUANT_QT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"
#include "nn/model.h"
#include "base/rng.h"
#include "nn/tape.h"
#include "quant/calib.h"
#include "quant/qtype.h"

/* ---- integer GEMM ------------------------------------------------------------------------------ */

/* c (M, N) int32 = a (M, K) int8 x b (N, K)^T int8: both operands row-major
 * with K contiguous (the layout of X and W), exact integer arithmetic.
 * The fast kernel and its scalar _ref twin give identical results. The
 * fast kernel is qgemm.h's family (qgemm_isa): AVX-512 VNNI or AVX-VNNI
 * ((a + 128) b^T minus 128 times the row sums of b), AVX2 (int16 widening,
 * vpmaddwd), else a portable int16 one (qgemm_force_portable picks that
 * one anywhere). Exact, so every family gives the same sums. */
void qgemm_s8(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K);
void qgemm_s8_ref(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K);
/* qgemm_s8 with c's rows ldc >= N apart, so column ranges of one product (rows of b) can run on different
 * threads, each packing only its own; nothing between the rows written. */
void qgemm_s8_ldc(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K);
/* c (M, N) = a (M, K) b (K, N): b row-major with rows ldb apart (N
 * contiguous: the im2col layout of a conv's input codes), c's rows ldc
 * apart, so column ranges of one product can run on different threads.
 * The same kernel families and exactness as qgemm_s8. */
void qgemm_s8_nn(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K);
void qgemm_s8_nn_ref(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K);

/* ---- the layer --------------------------------------------------------------------------------- */

enum { FQT_NOISE_ROWS = 1u, FQT_NOISE_COLS = 2u };

typedef struct {
    const QType *weight_qtype;        /* forward W; int/uint/float formats (no blocks, no LUT) */
    const QType *act_qtype;           /* forward X; NULL: the weight's format */
    const QType *bwd_qtype;           /* NULL: QAT's float backward */
    CalibSpec bwd_calib;              /* g's range per slice; default absmax */
    int bwd_weight_grad_tile_size;    /* rows of g per scale in dW's g (0: all rows) */
    bool bwd_stochastic;              /* bwd_stochastic_rounding: uniform */
    unsigned noise_axes;              /* FQT_NOISE_ROWS | FQT_NOISE_COLS; 0 means rows */
} FqtSpec;

/* Defaults: absmax, no tile, round to nearest, noise along rows. */
FqtSpec fqt_spec_default(void);

typedef struct {
    Module *module;                   /* dense or conv2d, weight trainable float */
    FqtSpec spec;
    int out, fan_in;
    Rng rng;                          /* stochastic rounding noise; a checkpoint saves it with the run's */
} FqtLayer;

/* Checks spec against module m; messages start with the module path and
 * name the key (e.g. "bwd_qtype: nf4 is a lookup format"). */
QtStatus fqt_layer_check(const FqtSpec *spec, const Module *m, QtError *err);
/* The noise generator starts at (seed, stream, 0); give each layer its own stream. */
QtStatus fqt_layer_init(FqtLayer *q, Module *m, const FqtSpec *spec, uint64_t seed, uint64_t stream, QtError *err);
/* Whether the layer's forward (and weight gradient) run integer GEMMs: int formats of at most 8 bits on both
 * operands (qgemm_s8 and qgemm_s8_nn, on the family qgemm_isa picks). */
bool fqt_layer_integer(const FqtLayer *q);
void fqt_layer_install(FqtLayer *q);

/* The layer's forward (see above); records the quantized backward. */
Var *fqt_layer_forward(Tape *t, FqtLayer *q, Var *x);

#endif
