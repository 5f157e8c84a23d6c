/* qgemm_x86_inline.h - what the AVX-512 VNNI kernel files (qgemm_x86.c, qgemm_dw_x86.c) share: their target
 * attribute, lane masks and the quantizer in registers (the codes of qgemm_quantize_u8, bit for bit). x86 only;
 * include inside the files' x86 sections, after qgemm_internal.h. */
#ifndef QTRAIN_QUANT_QGEMM_X86_INLINE_H
#define QTRAIN_QUANT_QGEMM_X86_INLINE_H

#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>

#define QG_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define QG_INLINE static inline __attribute__((always_inline))

static inline __mmask16 lane_mask(int n) { return n >= QGEMM_LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

/* The lanes i < n whose input column c0 + i lies in [0, w): the bytes a masked load may read. */
static inline uint32_t dw_cols_mask(int c0, int w, int n) {
    const int lo = c0 < 0 ? -c0 : 0, hi = w - c0 < n ? w - c0 : n;
    if (hi <= lo) return 0;
    return (uint32_t)((((uint64_t)1 << hi) - 1) & ~(((uint64_t)1 << lo) - 1));
}

/* The quantizer's constants in registers. */
typedef struct {
    __m512 s, r, lo, hi, big, edge;
    __m512 zf, loz, hiz; /* the zero point, lo + zero and hi + zero as floats (exact: integers under 512) */
    __m512i zero, absmask;
    bool rcp; /* quotients through r = 1 / s (qgemm_rcp_ok) */
} CodeRegs;

QG_TARGET QG_INLINE CodeRegs code_regs(float s, float lo, float hi, int zero) {
    return (CodeRegs){.s = _mm512_set1_ps(s), .r = _mm512_set1_ps(1.0f / s), .lo = _mm512_set1_ps(lo),
                      .hi = _mm512_set1_ps(hi), .big = _mm512_set1_ps(3.40282347e38f),
                      .edge = _mm512_set1_ps(QGEMM_RCP_EDGE), .zf = _mm512_set1_ps((float)zero),
                      .loz = _mm512_set1_ps(lo + (float)zero), .hiz = _mm512_set1_ps(hi + (float)zero),
                      .zero = _mm512_set1_epi32(zero),
                      .absmask = _mm512_set1_epi32(0x7fffffff), .rcp = qgemm_rcp_ok(s)};
}

/* The codes (int32 lanes, 0..255) of the lanes m of v (the others' are unspecified); *bad gets the lanes m that
 * are NaN or infinite. */
QG_TARGET QG_INLINE __m512i codes_of16(const CodeRegs *k, __m512 v, __mmask16 m, __mmask16 *bad) {
    const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), k->absmask));
    *bad |= _mm512_mask_cmp_ps_mask(m, a, k->big, _CMP_NLE_UQ);
    __m512 y;
    if (k->rcp) { /* x r, unless a lane lies near a half (qgemm_rcp_ok) */
        y = _mm512_mul_ps(v, k->r);
        const __m512 i = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 dist = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(y, i)),
                                                                 k->absmask));
        if (_mm512_cmp_ps_mask(dist, k->edge, _CMP_GT_OQ)) y = _mm512_div_ps(v, k->s);
    } else {
        y = _mm512_div_ps(v, k->s);
    }
    /* max returns its second operand when one is NaN: NaN -> lo, as the portable loop does */
    const __m512 q = _mm512_min_ps(_mm512_max_ps(y, k->lo), k->hi);
    return _mm512_add_epi32(_mm512_cvtps_epi32(q), k->zero); /* round to nearest even (MXCSR default) */
}

/* codes_of16 of the lanes m of x (0 in the others). */
QG_TARGET QG_INLINE __m512i codes16(const CodeRegs *k, const float *x, __mmask16 m, __mmask16 *bad) {
    return codes_of16(k, _mm512_maskz_loadu_ps(m, x), m, bad);
}

/* The fast form of codes_of16 where k->rcp: t = fl(v r + zero), the code before clamping, in one rounding (the
 * fused multiply-add; QGEMM_RCP_EDGE says why it rounds as v / s + zero does), *odd getting the lanes m whose t
 * lies within 2^-12 of a half or is not finite (their distance is NaN), for which the caller runs codes_of16. */
QG_TARGET QG_INLINE __m512 rcp_of16(const CodeRegs *k, __m512 v, __mmask16 m, __mmask16 *odd) {
    const __m512 t = _mm512_fmadd_ps(v, k->r, k->zf);
    const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 dist = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(t, i)), k->absmask));
    *odd |= _mm512_mask_cmp_ps_mask(m, dist, k->edge, _CMP_NLE_UQ);
    return t;
}

/* rcp_of16 of the lanes m of x (0 in the others). */
QG_TARGET QG_INLINE __m512 rcp16(const CodeRegs *k, const float *x, __mmask16 m, __mmask16 *odd) {
    return rcp_of16(k, _mm512_maskz_loadu_ps(m, x), m, odd);
}

/* The codes of rcp_of16's t: clamped to [lo + zero, hi + zero], then rounded (the nearest even, MXCSR's default). */
QG_TARGET QG_INLINE __m512i rcp_codes16(const CodeRegs *k, __m512 t) {
    return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(t, k->loz), k->hiz));
}

/* codes_of16 through the reciprocal when no lane m lies near a half: one vector of a producer's outputs. */
QG_TARGET QG_INLINE __m512i codes_fast16(const CodeRegs *k, __m512 v, __mmask16 m, __mmask16 *bad) {
    if (k->rcp) {
        __mmask16 odd = 0;
        const __m512 y = rcp_of16(k, v, m, &odd);
        if (!odd) return rcp_codes16(k, y);
    }
    return codes_of16(k, v, m, bad);
}

#endif
