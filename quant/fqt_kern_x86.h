/* fqt_kern_x86.h - the x86 families of fqt_kern.h's kernels, each the bit
 * twin of its _ref: AVX2 (8 lanes) and AVX-512F (16 lanes, masked tails).
 * Only fqt_kern.c calls them, after CPUID says the family is there; off
 * x86 they are the _ref kernels, never called. */
#ifndef QTRAIN_QUANT_FQT_KERN_X86_H
#define QTRAIN_QUANT_FQT_KERN_X86_H

#include "fqt_kern.h"

bool fqt_absmax_avx2(const float *x, size_t n, float *amax);
bool fqt_masked_absmax_avx2(const float *g, const float *y, size_t n, float *amax);
bool fqt_col_absmax_avx2(float *amax, const float *g, int rows, int out);
void fqt_quant_span_avx2(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step, const float *u,
                         size_t u_step, const FqtRound *r);
/* write: d = 0 + the masked tmp (fqt_ste_clip_write), else d += it (fqt_ste_clip) */
void fqt_ste_clip_avx2(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi, bool write);
double fqt_sum_f64_avx2(const float *x, size_t n);
bool fqt_plane_stats_avx2(const float *x, size_t n, float *rowmax, float *amax, double *sum);
void fqt_scale_i32_avx2(float *y, const int32_t *x, size_t n, float s1, float s2, float b, bool add_b);

/* AVX-512 where the wider vector pays: the spans (division-bound), the clip, the scaling and absmax. The column
 * maxima and the sums keep AVX2's kernels: the sums' eight partial sums are one chain of additions per lane
 * either way. */
bool fqt_absmax_avx512(const float *x, size_t n, float *amax);
void fqt_quant_span_avx512(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step,
                           const float *u, size_t u_step, const FqtRound *r);
void fqt_ste_clip_avx512(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi,
                         bool write);
void fqt_scale_i32_avx512(float *y, const int32_t *x, size_t n, float s1, float s2, float b, bool add_b);

#endif
