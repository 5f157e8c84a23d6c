/* fqt_kern.h - QT's quantizers for its common case: a signed int format
 * (int8, int4, ...) with a symmetric absmax range and no zero point, the
 * rule of every operand QT quantizes by default (weights per row, inputs
 * per tensor, gradients per row and per column).
 *
 * Each kernel gives, bit for bit, what QArray's scalar rules give
 * (qarray_plan_encode, then qtype_decode of the code): x / s clamped to
 * [qmin, qmax], then rounded, ties to even or stochastically (floor(v) + 1
 * when u >= 1 - frac(v)), the value q * s. The AVX2 and AVX-512 kernels do the same
 * IEEE operations in the same order (a division, not a multiplication by
 * 1/s), so they are exact twins of the _ref ones; tests compare them. The
 * maxima are exact in any order, so splitting them over threads changes
 * nothing. */
#ifndef QTRAIN_QUANT_FQT_KERN_H
#define QTRAIN_QUANT_FQT_KERN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "qarray_plan.h"

/* max |x[i]| over x [n] into *amax (0 for n = 0); false if an element is
 * NaN or infinite (then *amax means nothing). */
bool fqt_absmax(const float *x, size_t n, float *amax);
bool fqt_absmax_ref(const float *x, size_t n, float *amax);

/* *amax = max |v[i]| over v[i] = y[i] > 0 ? g[i] : 0 (0 for n = 0); false if a v[i] is NaN or infinite. For a
 * conv whose relu + 2x2 max pool were fused, g and y the pool's output gradient and output: the v[i] are the
 * values at the windows' winners of the plane nn_conv_epilogue_grad_plane makes, whose other values are 0, so
 * this is the plane's fqt_absmax (and its finiteness) from a quarter of the values. */
bool fqt_masked_absmax(const float *g, const float *y, size_t n, float *amax);
bool fqt_masked_absmax_ref(const float *g, const float *y, size_t n, float *amax);

/* amax [out] = max(amax, |g[r][o]|) over the rows of g (rows, out),
 * row-major: the columns' maxima, updated; false if an element is not
 * finite. */
bool fqt_col_absmax(float *amax, const float *g, int rows, int out);
bool fqt_col_absmax_ref(float *amax, const float *g, int rows, int out);

/* A span's rounding: the code range and the mode. */
typedef struct {
    float qmin, qmax; /* integers, qmin < 0 < qmax */
    bool stochastic;  /* floor(v) + (u >= 1 - frac(v)); else rint (ties to even) */
} FqtRound;

/* x [n] quantized element by element: scale s[i * s_step], uniform
 * u[i * u_step] (s_step 0 or 1; u unused unless stochastic). Writes the
 * integer codes q [n] (if q) and the values q * s (if v). u_step may
 * also be larger than 1 (a column of row-major noise). */
void fqt_quant_span(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step, const float *u,
                    size_t u_step, const FqtRound *r);
void fqt_quant_span_ref(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step, const float *u,
                        size_t u_step, const FqtRound *r);

/* ---- the drivers: whole operands, split over the step's threads ---------------------------------------------------- */

/* Whether plan p is the case above: an int format of <= 8 bits, symmetric
 * without a zero point, absmax calibration, float32 scales. */
bool fqt_plan_fast(const QArrayPlan *p);

/* Stochastic rounding's uniforms: element (r, o) takes
 * u[r * row_step + o * col_step]; u NULL: round to nearest. */
typedef struct {
    const float *u;
    size_t row_step, col_step;
} FqtNoise;

/* x (rows, n) quantized per row under p (fqt_plan_fast): s [rows] the
 * scales, q (rows, n) the codes (if q), v (rows, n) the values (if v).
 * False if x holds a non-finite value (nothing useful written: the
 * general rules say why). */
bool fqt_quant_rows(int8_t *q, float *v, float *s, const float *x, int rows, int n, const QArrayPlan *p,
                    const FqtNoise *z);
/* x (rows, out) quantized per column over tiles of `tile` rows (the last
 * may be shorter): s [ceil(rows / tile) * out] the scales, tile-major.
 * part [out * parallel_get_threads()] is scratch. */
bool fqt_quant_cols(int8_t *q, float *v, float *s, float *part, const float *x, int rows, int out, int tile,
                    const QArrayPlan *p, const FqtNoise *z);
/* x [n] quantized with one scale *s, rounding to nearest. part
 * [parallel_get_threads()] is scratch. */
bool fqt_quant_tensor(int8_t *q, float *v, float *s, float *part, const float *x, size_t n, const QArrayPlan *p);

/* ---- the gradient as the layer's output gradient lays it ---------------------------------------------------------- */

/* g (N, OC, P): P = OH*OW output pixels per channel (1 for a dense layer,
 * whose g is (N, OC) row-major). QT's row r of g is the pixel (n, p), r =
 * n*P + p, its column the channel o; noise element (r, o) as FqtNoise.
 * fqt_quant_grad_cols quantizes g's columns in that layout, with no
 * transposed copy, to what fqt_quant_cols gives on the (N*P, OC) matrix. */

/* The contraction of dW = g^T X runs in chunks: the tiles of the scales,
 * cut further to at most FQT_DW_CHUNK rows so that an int8 x int8 sum
 * stays inside int32 (127 * 128 * 2^16 < 2^31). Chunk k covers rows
 * [r0, fqt_dw_chunk_end(r0, rows, tile)). */
#define FQT_DW_CHUNK 65536
int fqt_dw_chunk_end(int r0, int rows, int tile);

/* Per column over tiles of `tile` rows (0: all), the codes chunk-major:
 * chunk [r0, r1) is the block (OC, r1 - r0) at q + r0 * OC. s [tiles * OC]
 * the scales, tile-major. */
bool fqt_quant_grad_cols(int8_t *q, float *s, const float *g, int N, int OC, int P, int tile, const QArrayPlan *p,
                         const FqtNoise *z);

/* ---- the backward's elementwise passes ---------------------------------------------------------------------------- */

/* The sum of x [n] in double: eight partial sums over i mod 8, then
 * ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)); a fixed order. */
double fqt_sum_f64(const float *x, size_t n);
double fqt_sum_f64_ref(const float *x, size_t n);

/* The clipped straight-through estimator: d[i] += tmp[i] where v[i] / s
 * lies in [lo, hi], else += 0 (d, v, tmp [n]). */
void fqt_ste_clip(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi);
void fqt_ste_clip_ref(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi);
/* The same into a d not yet written: d[i] = 0 + (tmp[i] or 0), the bits
 * fqt_ste_clip leaves in a zeroed d. */
void fqt_ste_clip_write(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi);
void fqt_ste_clip_write_ref(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi);

/* One plane of g in one pass: *amax = max |x[i]|, rowmax[i] = max(rowmax[i],
 * |x[i]|) (the running maxima of the rows the plane crosses; rowmax may be
 * NULL when they are not wanted), *sum = fqt_sum_f64(x, n); false if an
 * element is not finite. */
bool fqt_plane_stats(const float *x, size_t n, float *rowmax, float *amax, double *sum);
bool fqt_plane_stats_ref(const float *x, size_t n, float *rowmax, float *amax, double *sum);

/* The scale of a slice whose max |x| is amax under plan p (fqt_plan_fast),
 * as the drivers compute it; false where calibration refuses the range. */
bool fqt_scale_of_amax(const QArrayPlan *p, float amax, float *s);
/* The same for amax [n] into s [n], the int formula inlined. */
bool fqt_scales_of_amax(const QArrayPlan *p, const float *amax, float *s, size_t n);

/* y [n] = ((float)x[i] * s1) * s2, plus b when add_b: an integer product's
 * outputs in the operations' own order. */
void fqt_scale_i32(float *y, const int32_t *x, size_t n, float s1, float s2, float b, bool add_b);
void fqt_scale_i32_ref(float *y, const int32_t *x, size_t n, float s1, float s2, float b, bool add_b);

/* The kernel families, narrowest first. */
typedef enum { FQT_KERN_PORTABLE, FQT_KERN_AVX2, FQT_KERN_AVX512 } FqtKernFamily;
/* Which family fqt_absmax and friends run: "avx512", "avx2" or "portable"
 * (the CPU's widest, under the cap). */
const char *fqt_kern_name(void);
/* Tests: cap the family at max (FQT_KERN_AVX512: the CPU's best again);
 * returns the family that now runs, which is below max where the CPU
 * lacks it. */
FqtKernFamily fqt_kern_cap(FqtKernFamily max);

#endif
