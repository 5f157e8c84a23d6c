/* qgemm_internal.h - the vector kernels behind qgemm.h's dispatching
 * functions: AVX-512 VNNI (qgemm_x86.c), AVX-VNNI and AVX2 (qgemm_avx2.c; their int8 x int8 products in
 * qgemm_s8_avx2.c), AMX (qgemm_amx.c).
 * Internal to quant/: call each only when qgemm_isa() is its family. */
#ifndef QTRAIN_QUANT_QGEMM_INTERNAL_H
#define QTRAIN_QUANT_QGEMM_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/qgemm.h"

/* The CPU has the kernels and qgemm_force_portable is off. */
bool qgemm_use_vnni(void);

/* The quantizers' quotients x / s through r = fl(1 / s). Let q = x / s exactly. fl(x r) and fl(x / s) are each
 * within 2^-22 |q| of q, so for |q| <= 256 within 2^-14 of it; the fast quantizers' t = fl(x r + zero) (one
 * rounding, zero <= 255) is within |q| 2^-24 + 2^-16 <= 2^-15 of q + zero. Each rounds as q (q + zero) does unless
 * q lies within 2^-14 of a half, so a vector with a lane within 2^-12 of a half (its distance to the nearest integer
 * above QGEMM_RCP_EDGE: a margin of 4) is divided instead. Past 256 both clamp to the same bound (|lo|, |hi| <= 255,
 * so the codes between the bounds come from |q| < 256), and NaN and the infinities take the same bounds either way.
 * r must be normal: s in [2^-125, 2^125]. */
#define QGEMM_RCP_EDGE (0.5f - 0x1p-12f)
static inline bool qgemm_rcp_ok(float s) { return s >= 0x1p-125f && s <= 0x1p125f; }

void qgemm_dense_vnni(const QGemmDense *d, int row0, int row1, int p0, int p1);
bool qgemm_taps_vnni(const QGemmTaps *g, int rb0, int rb1, int v0, int v1);
/* The taps on AMX tiles (qgemm_amx.c) for the g qgemm_taps hands it: w->tiles set, taps a multiple of 16 at one
 * stride, epi NONE or RELU. */
void qgemm_taps_amx(const QGemmTaps *g, int rb0, int rb1, int v0, int v1);
void qgemm_dw_vnni(const QGemmDw *d);
/* The VNNI kernel with the rows in registers (qgemm_dw_x86.c) takes 3-row kernels of up to 4 columns at stride 1,
 * one output channel per input channel. */
static inline bool qgemm_dw_rows_fit(const QGemmDw *d) {
    return d->in_plane > 0 && d->w->kh == 3 && d->w->kq == 1 && d->sh == 1 && d->sw == 1;
}
bool qgemm_dw_rows_vnni(const QGemmDw *d);
bool qgemm_quantize_u8_vnni(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero);
bool qgemm_quantize_u8x4_vnni(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows, int n,
                              const QGemmCodes *c);
/* AVX2 + FMA, and the same with 256-bit vpdpbusd (AVX-VNNI); the quantizers are the same for both. */
void qgemm_dense_avx2(const QGemmDense *d, int row0, int row1, int p0, int p1);
void qgemm_dense_avxvnni(const QGemmDense *d, int row0, int row1, int p0, int p1);
void qgemm_taps_avx2(const QGemmTaps *g, int rb0, int rb1, int v0, int v1);
void qgemm_taps_avxvnni(const QGemmTaps *g, int rb0, int rb1, int v0, int v1);
/* Depthwise for both 256-bit families (vpmaddwd); strides past 2 across run the portable kernel. Its padded rows
 * are qgemm_dw_avx2_width int16 values (a multiple of 16); qgemm_dw_scratch counts them at stride 2. */
void qgemm_dw_avx2(const QGemmDw *d);
size_t qgemm_dw_avx2_width(const QGemmPackedDw *w, int ow_n, int sw);
bool qgemm_quantize_u8_avx2(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero);
bool qgemm_quantize_u8x4_avx2(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows, int n,
                              const QGemmCodes *c);
/* qgemm_gather_u8x4 at stride 2 (qgemm_avx2.c), the whole of n. */
void qgemm_gather_u8x4_s2_avx2(uint32_t *dst, const uint8_t *const src[4], const size_t step[4], int rows, int n);
/* qgemm_interleave_u8x4 (qgemm_avx2.c). */
void qgemm_interleave_u8x4_avx2(uint32_t *dst, size_t ldd, const uint8_t *const src[4], size_t lds, int rows, int n);
/* qt.h's qgemm_s8: c (M, N) = a (M, K) b (N, K)^T, int8 both. */
/* qgemm_s8_ldc's families (c's rows ldc apart); the non-x86 builds' stand-ins call qgemm_s8_ref_ldc. */
void qgemm_s8_ref_ldc(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K);
void qgemm_s8_vnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K);
void qgemm_s8_avx2(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K);
void qgemm_s8_avxvnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K);
/* The AVX2 pack of 8 columns of b (N, K) for qgemm_s8 (qgemm_s8_avx2.c): group g's 32 bytes at pack + g * gstride;
 * the AVX-512 kernel packs its 16-lane panels with it, two halves a group. */
bool qgemm_s8_pack8_nt_avx2(int8_t *pack, size_t gstride, const int8_t *b, int K, int j0, int jn, int k0, int kn,
                            int kg);
/* The AVX-512 VNNI kernels' packs of b for qgemm_s8 (b (N, K)) and qgemm_s8_nn (b (K, N)): ceil(jn / 16) of the 3
 * panels (the ones the kernels read; a narrow b packs one) of kg groups
 * (16 columns x 4 bytes a group, zeros past the problem) and the columns' sums (none if sum is NULL); the AMX kernels
 * load the groups as tile rows. */
void qgemm_s8_pack_vnni(int8_t *pack, int32_t *sum, const int8_t *b, int K, int j0, int jn, int k0, int kn, int kg);
void qgemm_s8_pack_nn_vnni(int8_t *pack, int32_t *sum, const int8_t *b, int ldb, int j0, int jn, int k0, int kn,
                           int kg);
/* AMX tiles (qgemm_amx.c). */
void qgemm_s8_amx(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K);
void qgemm_s8_nn_amx(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K);
/* qgemm_s8_nn's families. */
void qgemm_s8_nn_vnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K);
void qgemm_s8_nn_avx2(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K);
void qgemm_s8_nn_avxvnni(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K);

#endif
