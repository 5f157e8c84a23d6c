/* qarray_deq_x86.c - the AVX2 and AVX-512 dequantize kernels of
 * qarray_deq.h.
 *
 * Every function here carries a target attribute instead of a compiler
 * flag, so this file builds with the project's flags and the rest of the
 * binary still runs on CPUs without these extensions; qarray_deq_run calls
 * them only after qarray_deq_cpu() reported them.
 *
 * 4-bit codes: 8 bytes give 16 codes, high nibble first (qtype_pack's
 * order), widened to 32-bit table indexes. AVX-512 holds the whole 16-entry
 * table in one register (vpermps); AVX2 looks the index up in both halves
 * of the table and picks by its bit 3. 8-bit codes: a conversion where the
 * table holds the codes themselves (int8, uint8: qarray_deq_codes_of), a
 * gather from the 256-entry table otherwise. Then (v - zp) * s as two
 * separate IEEE operations, the scalar loop's, so the bits are the same. A
 * run's last codes (fewer than a vector) and runs that do not start on a
 * byte go through qarray_deq_run_tail. */
#include "qarray_deq.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define DEQ_AVX2 __attribute__((target("avx2")))
#define DEQ_AVX512 __attribute__((target("avx512f")))

/* ---- AVX2 ----------------------------------------------------------------------------------------------- */

/* 16 table values for the codes of 8 packed bytes: lo (codes 0..7), hi (codes 8..15). */
DEQ_AVX2 static inline void nib16_avx2(const uint8_t *p, __m256 t0, __m256 t1, __m256 *lo, __m256 *hi) {
    const __m128i m = _mm_set1_epi8(0x0f);
    __m128i x = _mm_loadl_epi64((const __m128i *)(const void *)p);
    __m128i c = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m));
    __m256i i0 = _mm256_cvtepu8_epi32(c), i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8));
    *lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, i0), _mm256_permutevar8x32_ps(t1, i0),
                           _mm256_castsi256_ps(_mm256_slli_epi32(i0, 28)));
    *hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, i1), _mm256_permutevar8x32_ps(t1, i1),
                           _mm256_castsi256_ps(_mm256_slli_epi32(i1, 28)));
}

/* Codes of one run that the vectors take; returns how many. */
DEQ_AVX2 static size_t run_avx2(const QDeqSpan *sp, size_t e, size_t n, float s, float zp, float *y) {
    const __m256 S = _mm256_set1_ps(s), Z = _mm256_set1_ps(zp);
    const bool sub = sp->zp != NULL;
    size_t j = 0;
    if (sp->bits == 4 && e % 2 == 0) {
        const __m256 t0 = _mm256_loadu_ps(sp->lut), t1 = _mm256_loadu_ps(sp->lut + 8);
        const uint8_t *p = sp->codes + e / 2;
        for (; j + 16 <= n; j += 16) {
            __m256 a, b;
            nib16_avx2(p + j / 2, t0, t1, &a, &b);
            if (sub) a = _mm256_sub_ps(a, Z), b = _mm256_sub_ps(b, Z);
            _mm256_storeu_ps(y + j, _mm256_mul_ps(a, S));
            _mm256_storeu_ps(y + j + 8, _mm256_mul_ps(b, S));
        }
    } else if (sp->bits == 8) {
        const uint8_t *p = sp->codes + e;
        for (; j + 8 <= n; j += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(const void *)(p + j));
            __m256 v = sp->codes_are == QDEQ_CODES_U8   ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
                       : sp->codes_are == QDEQ_CODES_S8 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))
                                                        : _mm256_i32gather_ps(sp->lut, _mm256_cvtepu8_epi32(b), 4);
            if (sub) v = _mm256_sub_ps(v, Z);
            _mm256_storeu_ps(y + j, _mm256_mul_ps(v, S));
        }
    }
    return j;
}


/* ---- AVX-512 -------------------------------------------------------------------------------------------- */

DEQ_AVX512 static size_t run_avx512(const QDeqSpan *sp, size_t e, size_t n, float s, float zp, float *y) {
    const __m512 S = _mm512_set1_ps(s), Z = _mm512_set1_ps(zp);
    const bool sub = sp->zp != NULL;
    size_t j = 0;
    if (sp->bits == 4 && e % 2 == 0) {
        const __m512 t = _mm512_loadu_ps(sp->lut);
        const __m128i m = _mm_set1_epi8(0x0f);
        const uint8_t *p = sp->codes + e / 2;
        for (; j + 16 <= n; j += 16) {
            __m128i x = _mm_loadl_epi64((const __m128i *)(const void *)(p + j / 2));
            __m128i c = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m));
            __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c), t);
            if (sub) v = _mm512_sub_ps(v, Z);
            _mm512_storeu_ps(y + j, _mm512_mul_ps(v, S));
        }
    } else if (sp->bits == 8) {
        const uint8_t *p = sp->codes + e;
        for (; j + 16 <= n; j += 16) {
            __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(p + j));
            __m512 v = sp->codes_are == QDEQ_CODES_U8   ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
                       : sp->codes_are == QDEQ_CODES_S8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))
                                                        : _mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), sp->lut, 4);
            if (sub) v = _mm512_sub_ps(v, Z);
            _mm512_storeu_ps(y + j, _mm512_mul_ps(v, S));
        }
    }
    return j;
}

/* ---- the drivers ------------------------------------------------------------------------------------------ */

/* A span group by group: the vector run, then the scalar tail of each group. */
typedef size_t (*DeqRunFn)(const QDeqSpan *sp, size_t e, size_t n, float s, float zp, float *y);

static void deq_groups(const QDeqSpan *sp, float *y, DeqRunFn run) {
    for (size_t k = 0; k < sp->n_groups; k++) {
        const float s = sp->scale[k], zp = sp->zp ? sp->zp[k] : 0.0f;
        const size_t e = sp->first + k * sp->glen;
        float *yk = y + k * sp->glen;
        size_t j = run(sp, e, sp->glen, s, zp, yk);
        if (j < sp->glen) qarray_deq_run_tail(sp->codes, e + j, sp->glen - j, sp->bits, sp->lut, s, zp, sp->zp != NULL,
                                              yk + j);
    }
}

void qarray_deq_avx2(const QDeqSpan *sp, float *y) { deq_groups(sp, y, run_avx2); }
void qarray_deq_avx512(const QDeqSpan *sp, float *y) { deq_groups(sp, y, run_avx512); }

#else /* not x86: qarray_deq_cpu never reports these; they stay callable */

void qarray_deq_avx2(const QDeqSpan *sp, float *y) { qarray_deq_portable(sp, y); }
void qarray_deq_avx512(const QDeqSpan *sp, float *y) { qarray_deq_portable(sp, y); }

#endif
