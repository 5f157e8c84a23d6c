/* fqt_kern_x86.c - the AVX2 and AVX-512 twins of fqt_kern.c's _ref kernels
 * (fqt_kern_x86.h). Target attributes, so the file builds with the
 * project's flags and runs anywhere: fqt_kern.c calls each family only
 * where CPUID reports it. Built with -ffp-contract=off (Makefile): every
 * product and sum is rounded where the scalar loop rounds it. */
#include "fqt_kern_x86.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <math.h>

#define KERN_AVX2 __attribute__((target("avx2")))
#define KERN_AVX512 __attribute__((target("avx512f")))
/* the span loops' instances stay apart only if inlined into their callers (see span8_body) */
#define KERN_INLINE inline __attribute__((always_inline))

/* The 8 lanes' |x| and whether each is finite (|x| <= FLT_MAX is false for NaN and infinity). */
KERN_AVX2 static inline __m256 abs8(__m256 x, __m256 *finite) {
    __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    *finite = _mm256_and_ps(*finite, _mm256_cmp_ps(a, _mm256_set1_ps(3.40282347e38f), _CMP_LE_OQ));
    return a;
}

/* 8 values of x at i, or where y is given, x where y > 0 and 0 elsewhere (fqt_masked_absmax's values). */
KERN_AVX2 static KERN_INLINE __m256 masked8(const float *x, const float *y, size_t i) {
    const __m256 v = _mm256_loadu_ps(x + i);
    return y ? _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(y + i), _mm256_setzero_ps(), _CMP_GT_OQ), v) : v;
}

/* fqt_absmax (y NULL) and fqt_masked_absmax: two chains of 8 lanes, the tail by the _ref rule. */
KERN_AVX2 static KERN_INLINE bool absmax_body(const float *x, const float *y, size_t n, float *amax) {
    __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), m0 = _mm256_setzero_ps(), m1 = m0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(m0, abs8(masked8(x, y, i), &all));
        m1 = _mm256_max_ps(m1, abs8(masked8(x, y, i + 8), &all));
    }
    for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(m0, abs8(masked8(x, y, i), &all));
    if (_mm256_movemask_ps(all) != 0xff) return false;
    float lanes[8], m = 0.0f;
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
    float tail;
    if (!(y ? fqt_masked_absmax_ref(x + i, y + i, n - i, &tail) : fqt_absmax_ref(x + i, n - i, &tail))) return false;
    *amax = tail > m ? tail : m;
    return true;
}

KERN_AVX2 bool fqt_absmax_avx2(const float *x, size_t n, float *amax) { return absmax_body(x, NULL, n, amax); }

KERN_AVX2 bool fqt_masked_absmax_avx2(const float *g, const float *y, size_t n, float *amax) {
    return absmax_body(g, y, n, amax);
}

KERN_AVX2 bool fqt_col_absmax_avx2(float *amax, const float *g, int rows, int out) {
    int o = 0;
    for (; o + 8 <= out; o += 8) {
        __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), m = _mm256_loadu_ps(amax + o);
        for (int r = 0; r < rows; r++) m = _mm256_max_ps(m, abs8(_mm256_loadu_ps(g + (size_t)r * out + o), &all));
        if (_mm256_movemask_ps(all) != 0xff) return false;
        _mm256_storeu_ps(amax + o, m);
    }
    for (; o < out; o++)
        for (int r = 0; r < rows; r++) {
            float x = g[(size_t)r * out + o];
            if (!isfinite(x)) return false;
            float a = fabsf(x);
            amax[o] = a > amax[o] ? a : amax[o];
        }
    return true;
}

/* 8 int32 in [-128, 127] -> 8 bytes. */
KERN_AVX2 static inline void store8_i8(int8_t *q, __m256i c) {
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)(void *)q, _mm_packs_epi16(w, w));
}

/* The first k of 8 lanes set: a tail's mask for maskload/maskstore. */
KERN_AVX2 static inline __m256i lanes_below(size_t k) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 codes of quant_one: x / s clamped, then rounded to nearest even or stochastically against u. */
KERN_AVX2 static inline __m256i quant8(__m256 x, __m256 sv, __m256 uv, __m256 qmin, __m256 qmax, bool stochastic) {
    const __m256 one = _mm256_set1_ps(1.0f);
    /* max first with the bound second: a NaN becomes qmin, as fmaxf(NaN, qmin) does */
    __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(x, sv), qmin), qmax);
    if (stochastic) {
        __m256 lo = _mm256_floor_ps(t);
        __m256 up = _mm256_cmp_ps(uv, _mm256_sub_ps(one, _mm256_sub_ps(t, lo)), _CMP_GE_OQ);
        t = _mm256_add_ps(lo, _mm256_and_ps(up, one));
    } else {
        t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    return _mm256_cvtps_epi32(t); /* exact: t is an integer */
}

/* Lanes [0, k) of the noise at u, u_step apart (k <= 8). */
KERN_AVX2 static inline __m256 noise8(const float *u, size_t u_step, size_t k) {
    if (u_step == 1 && k == 8) return _mm256_loadu_ps(u);
    float l[8] = {0};
    for (size_t i = 0; i < k; i++) l[i] = u[i * u_step];
    return _mm256_loadu_ps(l);
}

/* The span's whole vectors with the loop's choices fixed (sr: stochastic; per_s: s_step 1; u1: u_step 1), so that
 * each instance's loop holds only the operations it needs: the stores through q and v may alias r, which kept a
 * general loop reloading r->stochastic every vector. Returns the first element not done. */
KERN_AVX2 static KERN_INLINE size_t span8_body(int8_t *q, float *v, const float *x, size_t n, const float *s,
                                               const float *u, size_t u_step, const FqtRound *r, const bool sr,
                                               const bool per_s, const bool u1) {
    const __m256 qmin = _mm256_set1_ps(r->qmin), qmax = _mm256_set1_ps(r->qmax);
    __m256 sv = _mm256_set1_ps(s[0]), uv = _mm256_set1_ps(sr ? u[0] : 0.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if (per_s) sv = _mm256_loadu_ps(s + i);
        if (sr && u_step) uv = u1 ? _mm256_loadu_ps(u + i) : noise8(u + i * u_step, u_step, 8);
        const __m256i c = quant8(_mm256_loadu_ps(x + i), sv, uv, qmin, qmax, sr);
        if (q) store8_i8(q + i, c);
        if (v) _mm256_storeu_ps(v + i, _mm256_mul_ps(_mm256_cvtepi32_ps(c), sv));
    }
    return i;
}

KERN_AVX2 void fqt_quant_span_avx2(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step,
                                   const float *u, size_t u_step, const FqtRound *r) {
    const bool sr = r->stochastic, u1 = u_step == 1;
    size_t i;
    if (sr && s_step) i = u1 ? span8_body(q, v, x, n, s, u, u_step, r, true, true, true)
                             : span8_body(q, v, x, n, s, u, u_step, r, true, true, false);
    else if (sr) i = u1 ? span8_body(q, v, x, n, s, u, u_step, r, true, false, true)
                        : span8_body(q, v, x, n, s, u, u_step, r, true, false, false);
    else i = s_step ? span8_body(q, v, x, n, s, u, u_step, r, false, true, false)
                    : span8_body(q, v, x, n, s, u, u_step, r, false, false, false);
    if (i == n) return;
    /* the tail in one masked vector: lanes past n read 0 / 1 and are not stored */
    const size_t k = n - i;
    const __m256i m = lanes_below(k);
    const __m256 mf = _mm256_castsi256_ps(m);
    const __m256 sv = s_step ? _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_maskload_ps(s + i, m), mf)
                             : _mm256_set1_ps(s[0]);
    const __m256 uv = !sr ? _mm256_setzero_ps() : u_step ? noise8(u + i * u_step, u_step, k) : _mm256_set1_ps(u[0]);
    const __m256i c = quant8(_mm256_maskload_ps(x + i, m), sv, uv, _mm256_set1_ps(r->qmin), _mm256_set1_ps(r->qmax),
                             sr);
    if (q) {
        int8_t b[8];
        store8_i8(b, c);
        for (size_t j = 0; j < k; j++) q[i + j] = b[j];
    }
    if (v) _mm256_maskstore_ps(v + i, m, _mm256_mul_ps(_mm256_cvtepi32_ps(c), sv));
}

/* write: d = 0 + masked tmp (the bits of a zeroed d), else d += masked tmp. */
KERN_AVX2 void fqt_ste_clip_avx2(float *d, const float *v, const float *tmp, size_t n, float s, float lo,
                                    float hi, bool write) {
    const __m256 sv = _mm256_set1_ps(s), lov = _mm256_set1_ps(lo), hiv = _mm256_set1_ps(hi);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 q = _mm256_div_ps(_mm256_loadu_ps(v + i), sv);
        const __m256 in = _mm256_and_ps(_mm256_cmp_ps(q, lov, _CMP_GE_OQ), _mm256_cmp_ps(q, hiv, _CMP_LE_OQ));
        const __m256 base = write ? _mm256_setzero_ps() : _mm256_loadu_ps(d + i);
        _mm256_storeu_ps(d + i, _mm256_add_ps(base, _mm256_and_ps(in, _mm256_loadu_ps(tmp + i))));
    }
    if (write) fqt_ste_clip_write_ref(d + i, v + i, tmp + i, n - i, s, lo, hi);
    else fqt_ste_clip_ref(d + i, v + i, tmp + i, n - i, s, lo, hi);
}

/* fqt_sum_f64's eight partial sums as two vectors of four (i mod 8 in 0..3, 4..7): the same additions. */
KERN_AVX2 double fqt_sum_f64_avx2(const float *x, size_t n) {
    __m256d lo = _mm256_setzero_pd(), hi = lo;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm_loadu_ps(x + i)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4)));
    }
    double a[8];
    _mm256_storeu_pd(a, lo);
    _mm256_storeu_pd(a + 4, hi);
    for (int k = 0; i < n; i++, k++) a[k] += x[i];
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* fqt_plane_stats in one pass: the maxima as absmax_avx2's, the sums as sum_f64_avx2's (the same additions). */
KERN_AVX2 bool fqt_plane_stats_avx2(const float *x, size_t n, float *rowmax, float *amax, double *sum) {
    __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), m = _mm256_setzero_ps();
    __m256d lo = _mm256_setzero_pd(), hi = lo;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i), a = abs8(v, &all);
        m = _mm256_max_ps(m, a);
        if (rowmax) _mm256_storeu_ps(rowmax + i, _mm256_max_ps(_mm256_loadu_ps(rowmax + i), a));
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    if (_mm256_movemask_ps(all) != 0xff) return false;
    float lanes[8], mm = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int k = 0; k < 8; k++) mm = lanes[k] > mm ? lanes[k] : mm;
    double acc[8];
    _mm256_storeu_pd(acc, lo);
    _mm256_storeu_pd(acc + 4, hi);
    for (int k = 0; i < n; i++, k++) {
        if (!isfinite(x[i])) return false;
        const float a = fabsf(x[i]);
        mm = a > mm ? a : mm;
        if (rowmax) rowmax[i] = a > rowmax[i] ? a : rowmax[i];
        acc[k] += x[i];
    }
    *amax = mm;
    *sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    return true;
}

/* No FMA in this target: the product is rounded before the bias is added, as in the scalar loop. */
KERN_AVX2 void fqt_scale_i32_avx2(float *y, const int32_t *x, size_t n, float s1, float s2, float b, bool add_b) {
    const __m256 v1 = _mm256_set1_ps(s1), v2 = _mm256_set1_ps(s2), vb = _mm256_set1_ps(b);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i xi = _mm256_loadu_si256((const __m256i *)(x + i));
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(xi), v1), v2);
        _mm256_storeu_ps(y + i, add_b ? _mm256_add_ps(v, vb) : v);
    }
    if (i == n) return;
    const __m256i m = lanes_below(n - i); /* the tail in one masked vector */
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_maskload_epi32((const int *)(x + i), m)), v1), v2);
    _mm256_maskstore_ps(y + i, m, add_b ? _mm256_add_ps(v, vb) : v);
}

/* ---- AVX-512 ----------------------------------------------------------------------------------------------------
 * 16 lanes, with masks for the tails, so no scalar remainder; the same operations as the AVX2 kernels (vdivps
 * zmm costs what vdivps ymm does on the CPUs measured, so the division-bound span does twice the work per
 * division). Only AVX-512F: the masks are 16-bit. */

/* The first k (< 16) of 16 lanes. */
static inline __mmask16 lanes16(size_t k) { return (__mmask16)((1u << k) - 1u); }

/* The 16 lanes' |x|; *bad gets the lanes that are NaN or infinite. */
KERN_AVX512 static inline __m512 abs16(__m512 x, __mmask16 m, __mmask16 *bad) {
    const __m512 a = _mm512_abs_ps(x);
    *bad |= _mm512_mask_cmp_ps_mask(m, a, _mm512_set1_ps(3.40282347e38f), _CMP_NLE_UQ);
    return a;
}

KERN_AVX512 bool fqt_absmax_avx512(const float *x, size_t n, float *amax) {
    __m512 m0 = _mm512_setzero_ps(), m1 = m0;
    __mmask16 bad = 0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        m0 = _mm512_max_ps(m0, abs16(_mm512_loadu_ps(x + i), 0xFFFF, &bad));
        m1 = _mm512_max_ps(m1, abs16(_mm512_loadu_ps(x + i + 16), 0xFFFF, &bad));
    }
    for (; i < n; i += 16) { /* lanes past n read 0, which no maximum of |x| is below */
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : lanes16(n - i);
        m0 = _mm512_max_ps(m0, abs16(_mm512_maskz_loadu_ps(m, x + i), m, &bad));
    }
    if (bad) return false;
    *amax = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    return true;
}

/* 16 codes of quant_one, as quant8. */
KERN_AVX512 static inline __m512i quant16(__m512 x, __m512 sv, __m512 uv, __m512 qmin, __m512 qmax, bool stochastic) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x, sv), qmin), qmax); /* NaN -> qmin, as in quant8 */
    if (stochastic) {
        const __m512 lo = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __mmask16 up = _mm512_cmp_ps_mask(uv, _mm512_sub_ps(one, _mm512_sub_ps(t, lo)), _CMP_GE_OQ);
        t = _mm512_mask_add_ps(lo, up, lo, one);
    } else {
        t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    return _mm512_cvtps_epi32(t); /* exact: t is an integer */
}

/* Lanes m of the noise at u, u_step apart (the others 0). */
KERN_AVX512 static inline __m512 noise16(const float *u, size_t u_step, __mmask16 m) {
    if (u_step == 1) return _mm512_maskz_loadu_ps(m, u);
    _Alignas(64) float l[16] = {0};
    for (int i = 0; i < 16 && (m >> i & 1); i++) l[i] = u[(size_t)i * u_step];
    return _mm512_load_ps(l);
}

/* One vector of the span: lanes m of elements [i, i + 16), all of them with full. The full vectors load and
 * store without masks: a masked store, and above all vpmovsdb's masked store to memory, cost several times a
 * plain one on the Zen 5 measured. */
KERN_AVX512 static KERN_INLINE void span16_at(int8_t *q, float *v, const float *x, size_t i, const float *s,
                                              const float *u, size_t u_step, __m512 qmin, __m512 qmax, __mmask16 m,
                                              const bool full, const bool sr, const bool per_s) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 sv = !per_s ? _mm512_set1_ps(s[0])
                      : full ? _mm512_loadu_ps(s + i)
                             : _mm512_mask_loadu_ps(one, m, s + i);
    const __m512 uv = !sr        ? _mm512_setzero_ps()
                      : !u_step  ? _mm512_set1_ps(u[0])
                      : full && u_step == 1 ? _mm512_loadu_ps(u + i)
                                            : noise16(u + i * u_step, u_step, m);
    const __m512i c = quant16(full ? _mm512_loadu_ps(x + i) : _mm512_maskz_loadu_ps(m, x + i), sv, uv, qmin, qmax, sr);
    if (q) {
        if (full) _mm_storeu_si128((__m128i *)(void *)(q + i), _mm512_cvtsepi32_epi8(c));
        else _mm512_mask_cvtsepi32_storeu_epi8(q + i, m, c);
    }
    if (v) {
        const __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(c), sv);
        if (full) _mm512_storeu_ps(v + i, y);
        else _mm512_mask_storeu_ps(v + i, m, y);
    }
}

KERN_AVX512 static KERN_INLINE void span16_body(int8_t *q, float *v, const float *x, size_t n, const float *s,
                                                const float *u, size_t u_step, const FqtRound *r, const bool sr,
                                                const bool per_s) {
    const __m512 qmin = _mm512_set1_ps(r->qmin), qmax = _mm512_set1_ps(r->qmax);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) span16_at(q, v, x, i, s, u, u_step, qmin, qmax, 0xFFFF, true, sr, per_s);
    if (i < n) span16_at(q, v, x, i, s, u, u_step, qmin, qmax, lanes16(n - i), false, sr, per_s);
}

KERN_AVX512 void fqt_quant_span_avx512(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step,
                                       const float *u, size_t u_step, const FqtRound *r) {
    if (r->stochastic) {
        if (s_step) span16_body(q, v, x, n, s, u, u_step, r, true, true);
        else span16_body(q, v, x, n, s, u, u_step, r, true, false);
    } else {
        if (s_step) span16_body(q, v, x, n, s, u, u_step, r, false, true);
        else span16_body(q, v, x, n, s, u, u_step, r, false, false);
    }
}

/* write: d = 0 + masked tmp, else d += masked tmp (the lanes out of range add +0, as the scalar loop's 0.0f). */
KERN_AVX512 void fqt_ste_clip_avx512(float *d, const float *v, const float *tmp, size_t n, float s, float lo,
                                     float hi, bool write) {
    const __m512 sv = _mm512_set1_ps(s), lov = _mm512_set1_ps(lo), hiv = _mm512_set1_ps(hi);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) { /* plain loads and stores: see span16_at */
        const __m512 q = _mm512_div_ps(_mm512_loadu_ps(v + i), sv);
        const __mmask16 in = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(q, lov, _CMP_GE_OQ), q, hiv, _CMP_LE_OQ);
        const __m512 base = write ? _mm512_setzero_ps() : _mm512_loadu_ps(d + i);
        _mm512_storeu_ps(d + i, _mm512_add_ps(base, _mm512_maskz_mov_ps(in, _mm512_loadu_ps(tmp + i))));
    }
    if (i == n) return;
    const __mmask16 m = lanes16(n - i);
    const __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(m, v + i), sv);
    const __mmask16 in = _mm512_mask_cmp_ps_mask(_mm512_mask_cmp_ps_mask(m, q, lov, _CMP_GE_OQ), q, hiv, _CMP_LE_OQ);
    const __m512 base = write ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, d + i);
    _mm512_mask_storeu_ps(d + i, m, _mm512_add_ps(base, _mm512_maskz_loadu_ps(in, tmp + i)));
}

/* No FMA: the product is rounded before the bias is added, as in the scalar loop. */
KERN_AVX512 void fqt_scale_i32_avx512(float *y, const int32_t *x, size_t n, float s1, float s2, float b,
                                      bool add_b) {
    const __m512 v1 = _mm512_set1_ps(s1), v2 = _mm512_set1_ps(s2), vb = _mm512_set1_ps(b);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) { /* plain loads and stores: see span16_at */
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(x + i)), v1), v2);
        _mm512_storeu_ps(y + i, add_b ? _mm512_add_ps(v, vb) : v);
    }
    if (i == n) return;
    const __mmask16 m = lanes16(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, x + i)), v1), v2);
    _mm512_mask_storeu_ps(y + i, m, add_b ? _mm512_add_ps(v, vb) : v);
}

#else /* not x86: fqt_kern.c never calls these (no family above portable); the _ref kernels keep them defined */

bool fqt_absmax_avx2(const float *x, size_t n, float *amax) { return fqt_absmax_ref(x, n, amax); }
bool fqt_masked_absmax_avx2(const float *g, const float *y, size_t n, float *amax) {
    return fqt_masked_absmax_ref(g, y, n, amax);
}
bool fqt_col_absmax_avx2(float *amax, const float *g, int rows, int out) {
    return fqt_col_absmax_ref(amax, g, rows, out);
}
void fqt_quant_span_avx2(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step, const float *u,
                         size_t u_step, const FqtRound *r) {
    fqt_quant_span_ref(q, v, x, n, s, s_step, u, u_step, r);
}
void fqt_ste_clip_avx2(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi, bool write) {
    (write ? fqt_ste_clip_write_ref : fqt_ste_clip_ref)(d, v, tmp, n, s, lo, hi);
}
double fqt_sum_f64_avx2(const float *x, size_t n) { return fqt_sum_f64_ref(x, n); }
bool fqt_plane_stats_avx2(const float *x, size_t n, float *rowmax, float *amax, double *sum) {
    return fqt_plane_stats_ref(x, n, rowmax, amax, sum);
}
void fqt_scale_i32_avx2(float *y, const int32_t *x, size_t n, float s1, float s2, float b, bool add_b) {
    fqt_scale_i32_ref(y, x, n, s1, s2, b, add_b);
}
bool fqt_absmax_avx512(const float *x, size_t n, float *amax) { return fqt_absmax_ref(x, n, amax); }
void fqt_quant_span_avx512(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step,
                           const float *u, size_t u_step, const FqtRound *r) {
    fqt_quant_span_ref(q, v, x, n, s, s_step, u, u_step, r);
}
void fqt_ste_clip_avx512(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi,
                         bool write) {
    (write ? fqt_ste_clip_write_ref : fqt_ste_clip_ref)(d, v, tmp, n, s, lo, hi);
}
void fqt_scale_i32_avx512(float *y, const int32_t *x, size_t n, float s1, float s2, float b, bool add_b) {
    fqt_scale_i32_ref(y, x, n, s1, s2, b, add_b);
}
#endif
