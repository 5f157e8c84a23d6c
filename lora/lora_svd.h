/* lora_svd.h - the truncated SVD and the SVD-based adapter initialisations
 * (PiSSA, LoftQ) of lora/lora.h, on LAPACK (LAPACKE_dgesdd, in double).
 *
 * PiSSA (Meng et al. 2024): A and B from the top-r singular triplets of the
 * base weight W (out, fan_in); the base becomes the residual W - s B A
 * (quantized, under a quant rule).
 * LoftQ (Li et al. 2023, arXiv 2310.08659): starting from s B A = 0,
 * alternately Q = quantize(W - s B A) and s B A = the rank-r truncated SVD
 * of W - Q, up to `iters` times; the base becomes the last Q. An
 * iteration that raises the error (a quantizer whose scales follow its
 * input's range is no exact projection) is undone and ends the loop: the
 * error never rises from one iteration to the next.
 * Both split the singular values evenly between the factors:
 *   B = U_r sqrt(S_r) / sqrt(s),  A = sqrt(S_r) V_r^T / sqrt(s),
 * so s B A is exactly the truncated SVD. */
#ifndef QTRAIN_LORA_LORA_SVD_H
#define QTRAIN_LORA_LORA_SVD_H

#include <stdbool.h>

#include "base/error.h"

#define LORA_LOFTQ_ITERS_MAX 100 /* lora.loftq_iters' upper bound: the report keeps each iteration's error */

/* The rank-r truncated SVD of the row-major matrix m [rows * cols]:
 * u [rows * r] (column k the k-th left singular vector), s [r] descending,
 * vt [r * cols] (row k the k-th right singular vector); computed in double.
 * r in 1..min(rows, cols); singular values past the matrix's rank are 0
 * (their vectors still orthonormal). QT_ERR_ARG for bad sizes,
 * QT_ERR_NOMEM, QT_ERR_VALUE if LAPACK fails (no convergence, NaN input). */
QtStatus lora_svd_truncated(const float *m, int rows, int cols, int r, double *u, double *s, double *vt,
                            QtError *err);

/* Quantizes target [out * fan_in] with the module's base format and writes
 * the dequantized result to deq [out * fan_in]; the quantized weight it
 * keeps (the last call's) is the base. */
typedef QtStatus (*LoraQuantizeFn)(void *ctx, const float *target, float *deq, QtError *err);

/* What an SVD initialisation did to one module: relative Frobenius errors
 * ||W - (Q + s B A)||_F / ||W||_F of the chosen init and of the default
 * (B = 0: ||W - quantize(W)|| / ||W||, 0 on a float base), and LoftQ's
 * error after each iteration. */
typedef struct {
    double rel_error;
    double default_rel_error;
    int iters;                                /* LoftQ's iterations kept (0 for PiSSA) */
    bool stopped;                             /* iteration iters + 1 raised the error and was undone */
    double iter_error[LORA_LOFTQ_ITERS_MAX];  /* [iters] */
} LoraInitReport;

/* PiSSA (iters 0) or LoftQ (iters >= 1; needs quantize) on the weight
 * w [out * fan_in] with rank r and adapter scale `scale`: fills
 * a [r * fan_in] and b [out * r] and base [out * fan_in] (the residual on a
 * float base, quantize == NULL; else the dequantized base whose quantized
 * form the last quantize call left). rep may be NULL. */
QtStatus lora_svd_init(const float *w, int out, int fan_in, int r, float scale, int iters, LoraQuantizeFn quantize,
                       void *qctx, float *a, float *b, float *base, LoraInitReport *rep, QtError *err);

#endif
