/* conv_wino_x86.c - F(2x2, 3x3)'s vector kernels (conv_wino.h): conv_wino_kern.h's text at AVX2 + FMA (8 lanes, 4
 * rows per block) and at AVX-512F (16 lanes, 8 rows). */
#include "conv_wino.h"


#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)

#include <immintrin.h>

/* ---- AVX2 ------------------------------------------------------------------------------------------------------ */

#define WV __m256
#define WL 8
#define WRB 4
#define W_TARGET __attribute__((target("avx2,fma")))
#define W_NAME(f) wino256_##f
#define W_ZERO() _mm256_setzero_ps()
#define W_LOADU(a) _mm256_loadu_ps(a)
#define W_STOREU(a, v) _mm256_storeu_ps((a), (v))
#define W_ADD(a, b) _mm256_add_ps((a), (b))
#define W_SUB(a, b) _mm256_sub_ps((a), (b))
#define W_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define W_SET1(x) _mm256_set1_ps(x)
#define W_MUL(a, b) _mm256_mul_ps((a), (b))
#define W_NEG(a) _mm256_xor_ps((a), _mm256_set1_ps(-0.0f))
/* lanes [0, n) */
#define W_MASK_DECL(mk, n) \
    const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define W_MASK_LOAD(a, mk) _mm256_maskload_ps((a), (mk))
#define W_MASK_KEEP(v, mk) _mm256_and_ps((v), _mm256_castsi256_ps(mk))
#define W_MASK_STORE(a, mk, v) _mm256_maskstore_ps((a), (mk), (v))
/* ev = lo, hi's even lanes, od = their odd lanes, in order */
#define W_DEINTERLEAVE(ev, od, lo, hi)                                                               \
    do {                                                                                             \
        const __m256 e_ = _mm256_shuffle_ps((lo), (hi), 0x88), o_ = _mm256_shuffle_ps((lo), (hi), 0xdd); \
        (ev) = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e_), 0xd8));                     \
        (od) = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o_), 0xd8));                     \
    } while (0)
/* lo, hi = ev[0] od[0] ev[1] od[1] ... */
#define W_INTERLEAVE(lo, hi, ev, od)                                              \
    do {                                                                          \
        const __m256 l_ = _mm256_unpacklo_ps((ev), (od)), h_ = _mm256_unpackhi_ps((ev), (od)); \
        (lo) = _mm256_permute2f128_ps(l_, h_, 0x20);                              \
        (hi) = _mm256_permute2f128_ps(l_, h_, 0x31);                              \
    } while (0)

#include "conv_wino_kern.h"

void conv_wino_forward_avx2(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                            int rows, int channels, bool add, float *scratch) {
    wino256_forward(p, y, ldy, x, ldx, wp, rows, channels, add, scratch);
}

void conv_wino_products_avx2(const ConvWino *p, float *y, size_t ldy, const float *wp, int rows, int channels,
                             bool add, float *scratch) {
    wino256_again(p, y, ldy, wp, rows, channels, add, scratch);
}

void conv_wino_dw_avx2(const ConvWino *p, float *dwt, const float *dpt, const float *x, size_t ldx, int C, int OC,
                       bool add, float *scratch) {
    wino256_dw(p, dwt, dpt, x, ldx, C, OC, add, scratch);
}

#undef WV
#undef WL
#undef WRB
#undef W_TARGET
#undef W_NAME
#undef W_ZERO
#undef W_LOADU
#undef W_STOREU
#undef W_ADD
#undef W_SUB
#undef W_FMA
#undef W_SET1
#undef W_MUL
#undef W_NEG
#undef W_MASK_DECL
#undef W_MASK_LOAD
#undef W_MASK_KEEP
#undef W_MASK_STORE
#undef W_DEINTERLEAVE
#undef W_INTERLEAVE

/* ---- AVX-512 --------------------------------------------------------------------------------------------------- */

#define WV __m512
#define WL 16
#define WRB 8
#define W_TARGET __attribute__((target("avx512f,fma")))
#define W_NAME(f) wino512_##f
#define W_NARROW(f) wino256_##f
#define W_ZERO() _mm512_setzero_ps()
#define W_LOADU(a) _mm512_loadu_ps(a)
#define W_STOREU(a, v) _mm512_storeu_ps((a), (v))
#define W_ADD(a, b) _mm512_add_ps((a), (b))
#define W_SUB(a, b) _mm512_sub_ps((a), (b))
#define W_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define W_SET1(x) _mm512_set1_ps(x)
#define W_MUL(a, b) _mm512_mul_ps((a), (b))
#define W_NEG(a) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000)))
#define W_MASK_DECL(mk, n) const __mmask16 mk = (__mmask16)((1u << (n)) - 1u)
#define W_MASK_LOAD(a, mk) _mm512_maskz_loadu_ps((mk), (a))
#define W_MASK_KEEP(v, mk) _mm512_maskz_mov_ps((mk), (v))
#define W_MASK_STORE(a, mk, v) _mm512_mask_storeu_ps((a), (mk), (v))
#define W_DEINTERLEAVE(ev, od, lo, hi)                                                                          \
    do {                                                                                                        \
        const __m512i ie_ = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);       \
        const __m512i io_ = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);       \
        (ev) = _mm512_permutex2var_ps((lo), ie_, (hi));                                                         \
        (od) = _mm512_permutex2var_ps((lo), io_, (hi));                                                         \
    } while (0)
#define W_INTERLEAVE(lo, hi, ev, od)                                                                            \
    do {                                                                                                        \
        const __m512i il_ = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);         \
        const __m512i ih_ = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);   \
        (lo) = _mm512_permutex2var_ps((ev), il_, (od));                                                         \
        (hi) = _mm512_permutex2var_ps((ev), ih_, (od));                                                         \
    } while (0)

#include "conv_wino_kern.h"

void conv_wino_forward_avx512(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                              int rows, int channels, bool add, float *scratch) {
    wino512_forward(p, y, ldy, x, ldx, wp, rows, channels, add, scratch);
}

void conv_wino_products_avx512(const ConvWino *p, float *y, size_t ldy, const float *wp, int rows, int channels,
                               bool add, float *scratch) {
    wino512_again(p, y, ldy, wp, rows, channels, add, scratch);
}

void conv_wino_dw_avx512(const ConvWino *p, float *dwt, const float *dpt, const float *x, size_t ldx, int C, int OC,
                         bool add, float *scratch) {
    wino512_dw(p, dwt, dpt, x, ldx, C, OC, add, scratch);
}

#else /* not x86-64 gcc: conv_wino_fits never picks a vector level there (conv_taps_cpu is OFF) */

void conv_wino_forward_avx2(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                            int rows, int channels, bool add, float *scratch) {
    (void)scratch;
    conv_wino_forward_ref(p, y, ldy, x, ldx, wp, rows, channels, add);
}
void conv_wino_forward_avx512(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                              int rows, int channels, bool add, float *scratch) {
    (void)scratch;
    conv_wino_forward_ref(p, y, ldy, x, ldx, wp, rows, channels, add);
}
void conv_wino_products_avx2(const ConvWino *p, float *y, size_t ldy, const float *wp, int rows, int channels,
                             bool add, float *scratch) {
    (void)p, (void)y, (void)ldy, (void)wp, (void)rows, (void)channels, (void)add, (void)scratch;
}
void conv_wino_products_avx512(const ConvWino *p, float *y, size_t ldy, const float *wp, int rows, int channels,
                               bool add, float *scratch) {
    (void)p, (void)y, (void)ldy, (void)wp, (void)rows, (void)channels, (void)add, (void)scratch;
}
void conv_wino_dw_avx2(const ConvWino *p, float *dwt, const float *dpt, const float *x, size_t ldx, int C, int OC,
                       bool add, float *scratch) {
    (void)scratch;
    conv_wino_dw_ref(p, dwt, dpt, x, ldx, C, OC, add);
}
void conv_wino_dw_avx512(const ConvWino *p, float *dwt, const float *dpt, const float *x, size_t ldx, int C, int OC,
                         bool add, float *scratch) {
    (void)scratch;
    conv_wino_dw_ref(p, dwt, dpt, x, ldx, C, OC, add);
}

#endif
