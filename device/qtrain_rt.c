/* qtrain_rt.c - the integer kernels of qtrain_rt.h. Strict C99, no heap,
 * no libm, no written globals (reentrant).
 *
 * Every kernel has a plain-C path; the AVX2 and NEON paths replace only the
 * inner loops (dot products, the depthwise taps, the requantization of a
 * row, the int4 unpacking) and compute the same integers: sums are exact in
 * int32 and the requantization is qrt_rshift_round's, so every path writes
 * the same int8. Compiled for AVX-VNNI as well, the AVX2 path uses its
 * vpdpwssd for madd + add, and its general conv multiplies uint8 x + 128 by
 * int8 weights with vpdpbusd (the same sums after a per-channel correction);
 * AArch64 with the dotprod extension does the same with sdot on int8 x.
 *
 * Convolutions take one of two shapes, chosen from the parameters alone (so
 * qrt_conv2d_scratch is the same for every path):
 *   - one input channel per group (depthwise, or a first layer on a single
 *     channel): each group's plane is copied once as int16 x - in_zp with
 *     the padding at 0, its columns split by stride phase so that every tap
 *     of a row of outputs reads a contiguous run; each output sums its
 *     k_h * k_w taps;
 *   - otherwise the group's input is copied channels-last (int16 x - in_zp,
 *     the padding at 0) and its weights are widened to int16 in the same
 *     (kh, kw, ic) order, QRT_WBLOCK output channels at a time; an im2col
 *     of QRT_TILE_PX output pixels at a time (K = in_c/groups * k_h * k_w
 *     values per pixel, one contiguous run per kernel row, zeros up to a
 *     multiple of 16) is multiplied by two output channels at a time: one
 *     dot product of length K per output.
 * In both the padding contributes exact zeros, so no zero-point correction
 * is needed and the borders cost nothing in the inner loops. Dense layers
 * take (x - in_zp) * w directly, four output rows per pass over x. */
#include "qtrain_rt.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && !defined(QRT_PORTABLE)
#define QRT_AVX2 1
#include <immintrin.h>
/* acc + madd(a, b): one instruction where the compiler may use AVX-VNNI (the same exact int32 sums). With VNNI
 * the general conv also takes uint8 x + 128 against int8 weights, four products per lane (QRT_DPBUSD). */
#if defined(__AVXVNNI__)
#define QRT_VNNI 1
#define QRT_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#define QRT_DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32((acc), (a), (b))
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QRT_VNNI 1
#define QRT_DPWSSD(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#define QRT_DPBUSD(acc, a, b) _mm256_dpbusd_epi32((acc), (a), (b))
#else
#define QRT_DPWSSD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif
#elif defined(__ARM_NEON) && !defined(QRT_PORTABLE)
#define QRT_NEON 1
#include <arm_neon.h>
#endif

/* The general conv in 8 bits where a 4-way int8 dot product instruction exists (AVX-VNNI's vpdpbusd on uint8
 * x + 128, AArch64's sdot on int8 x): QRT_I8_XOFF is added to the input bytes, K is padded to QRT_I8_KALIGN. */
#if defined(QRT_VNNI)
#define QRT_I8DOT 1
#define QRT_I8_XOFF 128
#define QRT_I8_KALIGN 32
#elif defined(QRT_NEON) && defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define QRT_I8DOT 1
#define QRT_I8_XOFF 0
#define QRT_I8_KALIGN 16
#endif

#define QRT_TILE_PX 32  /* output pixels per im2col tile */
#define QRT_WBLOCK 32   /* output channels whose weights are widened at a time (an even number) */
#define QRT_KALIGN 16   /* im2col rows and widened weights are padded to this many values */
#define QRT_ALIGN 32    /* the scratch is used from its first 32-byte aligned address */
#define QRT_DW_ACC 256  /* depthwise accumulators: rows (or a row's columns) requantized at once */
#define QRT_CHUNK 256   /* int4 dense weights are unpacked this many at a time */

static int qrt_imin(int a, int b) { return a < b ? a : b; }

/* Weight i of a tensor of w_bits-wide values (4: two per byte, the even index in the low nibble). */
static int8_t qrt_weight_at(int w_bits, const void *w, size_t i) {
    if (w_bits == 4) {
        unsigned b = ((const uint8_t *)w)[i >> 1];
        unsigned nib = (i & 1u) ? b >> 4 : b & 15u;
        return (int8_t)((int)(nib ^ 8u) - 8);
    }
    return ((const int8_t *)w)[i];
}

/* dst[i] = weight start + i of an int4 tensor for i < m: 16 bytes (32 weights) at a time on the SIMD paths, a
 * byte (two) at a time on the portable one. A nibble v is the int4 (v ^ 8) - 8. */
static void qrt_unpack4(const void *w, size_t start, int m, int8_t *dst) {
    const uint8_t *b = (const uint8_t *)w + (start >> 1);
    int i = 0;
    if ((start & 1u) && m > 0) dst[i++] = (int8_t)((int)((*b++ >> 4) ^ 8u) - 8);
#if defined(QRT_AVX2)
    const __m128i low4 = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    for (; i + 32 <= m; i += 32, b += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)b);
        __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        __m128i v0 = _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(lo, hi), eight), eight);
        __m128i v1 = _mm_sub_epi8(_mm_xor_si128(_mm_unpackhi_epi8(lo, hi), eight), eight);
        _mm_storeu_si128((__m128i *)(dst + i), v0);
        _mm_storeu_si128((__m128i *)(dst + i + 16), v1);
    }
#elif defined(QRT_NEON)
    const uint8x16_t low4 = vdupq_n_u8(15), eight = vdupq_n_u8(8);
    for (; i + 32 <= m; i += 32, b += 16) {
        uint8x16_t v = vld1q_u8(b);
        uint8x16x2_t z = vzipq_u8(veorq_u8(vandq_u8(v, low4), eight), veorq_u8(vshrq_n_u8(v, 4), eight));
        vst1q_s8(dst + i, vsubq_s8(vreinterpretq_s8_u8(z.val[0]), vreinterpretq_s8_u8(eight)));
        vst1q_s8(dst + i + 16, vsubq_s8(vreinterpretq_s8_u8(z.val[1]), vreinterpretq_s8_u8(eight)));
    }
#endif
    for (; i + 2 <= m; i += 2, b++) {
        dst[i] = (int8_t)((int)((*b & 15u) ^ 8u) - 8);
        dst[i + 1] = (int8_t)((int)((*b >> 4) ^ 8u) - 8);
    }
    if (i < m) dst[i] = (int8_t)((int)((*b & 15u) ^ 8u) - 8);
}

static void *qrt_align_ptr(void *p) {
    uintptr_t a = (uintptr_t)p;
    a = (a + (QRT_ALIGN - 1)) & ~(uintptr_t)(QRT_ALIGN - 1);
    return (void *)a;
}

static size_t qrt_round_k(size_t k) { return (k + QRT_KALIGN - 1) / QRT_KALIGN * QRT_KALIGN; }

/* ---- requantization of a row: y[j] = requant(bias + acc[j]) with one multiplier ---------------------------- */

#if defined(QRT_AVX2)
/* clamp(r, lo, hi) on int64 lanes. */
static __m256i qrt_clamp64(__m256i r, __m256i lo, __m256i hi) {
    r = _mm256_blendv_epi8(r, lo, _mm256_cmpgt_epi64(lo, r));
    return _mm256_blendv_epi8(r, hi, _mm256_cmpgt_epi64(r, hi));
}

/* AVX2 has no arithmetic int64 shift. With |acc * mult| < 2^62, u = (acc * mult + 2^(n-1) + 2^62) >> n as an
 * unsigned (logical) shift is qrt_rshift_round(acc * mult, n) + 2^(62-n), non-negative and below 2^62: it is
 * clamped with bounds moved by the same 2^(62-n), and its low 32 bits plus zp - 2^(62-n) (mod 2^32) are then
 * the exact result, which lies in [lo, hi]. */
static void qrt_requant_row(const int32_t *acc, int n, int32_t bias, int32_t mult, int shift, int32_t zp, int32_t lo,
                            int32_t hi, int8_t *y) {
    const int64_t off = (int64_t)1 << (62 - shift);
    int64_t zp_off = (int64_t)zp - (off & 0xffffffffLL); /* zp - 2^(62-n) mod 2^32, as an int32 */
    if (zp_off < INT32_MIN) zp_off += (int64_t)1 << 32;
    const __m256i vb = _mm256_set1_epi32(bias), vm = _mm256_set1_epi32(mult);
    const __m256i rnd = _mm256_set1_epi64x(((int64_t)1 << (shift - 1)) + ((int64_t)1 << 62));
    const __m256i lo64 = _mm256_set1_epi64x((int64_t)lo - zp + off), hi64 = _mm256_set1_epi64x((int64_t)hi - zp + off);
    const __m256i vzp = _mm256_set1_epi32((int32_t)zp_off);
    const __m128i cnt = _mm_cvtsi32_si128(shift);
    int32_t tail_in[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int8_t tail_out[8];
    for (int j = 0; j < n; j += 8) {
        /* A last partial block runs on a zero-padded copy. */
        const int32_t *src = acc + j;
        int8_t *dst = y + j;
        if (n - j < 8) {
            memcpy(tail_in, src, (size_t)(n - j) * sizeof(int32_t));
            src = tail_in, dst = tail_out;
        }
        __m256i a = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)src), vb);
        __m256i ev = _mm256_mul_epi32(a, vm);                        /* lanes 0, 2, 4, 6 as int64 */
        __m256i od = _mm256_mul_epi32(_mm256_srli_epi64(a, 32), vm); /* lanes 1, 3, 5, 7 */
        ev = qrt_clamp64(_mm256_srl_epi64(_mm256_add_epi64(ev, rnd), cnt), lo64, hi64);
        od = qrt_clamp64(_mm256_srl_epi64(_mm256_add_epi64(od, rnd), cnt), lo64, hi64);
        __m256i r = _mm256_add_epi32(_mm256_blend_epi32(ev, _mm256_slli_epi64(od, 32), 0xaa), vzp);
        __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(r, r), _mm256_packs_epi32(r, r));
        int32_t w0 = _mm256_cvtsi256_si32(p8), w1 = _mm256_extract_epi32(p8, 4);
        memcpy(dst, &w0, 4);
        memcpy(dst + 4, &w1, 4);
        if (dst == tail_out) memcpy(y + j, tail_out, (size_t)(n - j));
    }
}
#elif defined(QRT_NEON)
static void qrt_requant_row(const int32_t *acc, int n, int32_t bias, int32_t mult, int shift, int32_t zp, int32_t lo,
                            int32_t hi, int8_t *y) {
    const int32x4_t vb = vdupq_n_s32(bias), vzp = vdupq_n_s32(zp), vlo = vdupq_n_s32(lo), vhi = vdupq_n_s32(hi);
    const int32x2_t vm = vdup_n_s32(mult);
    const int64x2_t rnd = vdupq_n_s64((int64_t)1 << (shift - 1)), nsh = vdupq_n_s64(-(int64_t)shift);
    int32_t tail_in[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int8_t tail_out[8];
    for (int j = 0; j < n; j += 8) {
        /* A last partial block runs on a zero-padded copy. */
        const int32_t *src = acc + j;
        int8_t *dst = y + j;
        if (n - j < 8) {
            memcpy(tail_in, src, (size_t)(n - j) * sizeof(int32_t));
            src = tail_in, dst = tail_out;
        }
        int32x4_t r[2];
        for (int h = 0; h < 2; h++) {
            int32x4_t a = vaddq_s32(vld1q_s32(src + 4 * h), vb);
            /* vshlq_s64 by -shift is an arithmetic shift (floor); vqmovn saturates what int32 cannot hold,
             * which the saturating zero-point add and the clamp keep outside [lo, hi]. */
            int64x2_t p0 = vshlq_s64(vaddq_s64(vmull_s32(vget_low_s32(a), vm), rnd), nsh);
            int64x2_t p1 = vshlq_s64(vaddq_s64(vmull_s32(vget_high_s32(a), vm), rnd), nsh);
            int32x4_t q = vqaddq_s32(vcombine_s32(vqmovn_s64(p0), vqmovn_s64(p1)), vzp);
            r[h] = vminq_s32(vmaxq_s32(q, vlo), vhi);
        }
        vst1_s8(dst, vmovn_s16(vcombine_s16(vmovn_s32(r[0]), vmovn_s32(r[1]))));
        if (dst == tail_out) memcpy(y + j, tail_out, (size_t)(n - j));
    }
}
#else
static void qrt_requant_row(const int32_t *acc, int n, int32_t bias, int32_t mult, int shift, int32_t zp, int32_t lo,
                            int32_t hi, int8_t *y) {
    for (int j = 0; j < n; j++) y[j] = qrt_requant(((int64_t)acc[j] + bias) * mult, shift, zp, lo, hi);
}
#endif

/* ---- dot products ---------------------------------------------------------------------------------------- */

/* qrt_gemm_tile: acc0[i] = sum_k col[i][k] * w0[k] and acc1 likewise for w1 (NULL: one channel only) over the np
 * rows of col (np, kp), kp a multiple of QRT_KALIGN (the padding is 0 in col and in w). */

#if defined(QRT_AVX2)
static int32_t qrt_hsum256(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

#if !defined(QRT_I8DOT) /* otherwise the general conv is the 8-bit one */
static void qrt_gemm_tile(const int16_t *col, int np, int kp, const int16_t *w0, const int16_t *w1, int32_t *acc0,
                          int32_t *acc1) {
    int i = 0;
    if (w1) {
        for (; i + 4 <= np; i += 4) {
            const int16_t *c = col + (size_t)i * kp;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int k = 0; k < kp; k += 16) {
                __m256i u = _mm256_loadu_si256((const __m256i *)(w0 + k));
                __m256i v = _mm256_loadu_si256((const __m256i *)(w1 + k));
                __m256i x0 = _mm256_loadu_si256((const __m256i *)(c + k));
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(c + kp + k));
                __m256i x2 = _mm256_loadu_si256((const __m256i *)(c + 2 * (size_t)kp + k));
                __m256i x3 = _mm256_loadu_si256((const __m256i *)(c + 3 * (size_t)kp + k));
                a0 = QRT_DPWSSD(a0, x0, u);
                a1 = QRT_DPWSSD(a1, x1, u);
                a2 = QRT_DPWSSD(a2, x2, u);
                a3 = QRT_DPWSSD(a3, x3, u);
                b0 = QRT_DPWSSD(b0, x0, v);
                b1 = QRT_DPWSSD(b1, x1, v);
                b2 = QRT_DPWSSD(b2, x2, v);
                b3 = QRT_DPWSSD(b3, x3, v);
            }
            /* Eight horizontal sums at once: [a0 a1 a2 a3 | b0 b1 b2 b3]. */
            __m256i t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
            __m256i t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(b0, b1), _mm256_hadd_epi32(b2, b3));
            __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20),
                                         _mm256_permute2x128_si256(t0, t1, 0x31));
            _mm_storeu_si128((__m128i *)(acc0 + i), _mm256_castsi256_si128(s));
            _mm_storeu_si128((__m128i *)(acc1 + i), _mm256_extracti128_si256(s, 1));
        }
    }
    for (; i < np; i++) {
        const int16_t *c = col + (size_t)i * kp;
        __m256i a = _mm256_setzero_si256(), b = a;
        for (int k = 0; k < kp; k += 16) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(c + k));
            a = QRT_DPWSSD(a, x, _mm256_loadu_si256((const __m256i *)(w0 + k)));
            if (w1) b = QRT_DPWSSD(b, x, _mm256_loadu_si256((const __m256i *)(w1 + k)));
        }
        acc0[i] = qrt_hsum256(a);
        if (w1) acc1[i] = qrt_hsum256(b);
    }
}
#endif
#elif defined(QRT_NEON)
static int32_t qrt_hsum_s32(int32x4_t v) {
#if defined(__aarch64__)
    return vaddvq_s32(v);
#else
    int32x2_t s = vadd_s32(vget_low_s32(v), vget_high_s32(v));
    return vget_lane_s32(vpadd_s32(s, s), 0);
#endif
}

static int32x4_t qrt_mla8(int32x4_t a, int16x8_t x, int16x8_t w) {
    a = vmlal_s16(a, vget_low_s16(x), vget_low_s16(w));
    return vmlal_s16(a, vget_high_s16(x), vget_high_s16(w));
}

#if !defined(QRT_I8DOT)
static void qrt_gemm_tile(const int16_t *col, int np, int kp, const int16_t *w0, const int16_t *w1, int32_t *acc0,
                          int32_t *acc1) {
    int i = 0;
    if (w1) {
        for (; i + 4 <= np; i += 4) {
            const int16_t *c = col + (size_t)i * kp;
            int32x4_t a[4], b[4];
            for (int r = 0; r < 4; r++) a[r] = b[r] = vdupq_n_s32(0);
            for (int k = 0; k < kp; k += 8) {
                int16x8_t u = vld1q_s16(w0 + k), v = vld1q_s16(w1 + k);
                for (int r = 0; r < 4; r++) {
                    int16x8_t x = vld1q_s16(c + (size_t)r * kp + k);
                    a[r] = qrt_mla8(a[r], x, u);
                    b[r] = qrt_mla8(b[r], x, v);
                }
            }
            for (int r = 0; r < 4; r++) {
                acc0[i + r] = qrt_hsum_s32(a[r]);
                acc1[i + r] = qrt_hsum_s32(b[r]);
            }
        }
    }
    for (; i < np; i++) {
        const int16_t *c = col + (size_t)i * kp;
        int32x4_t a = vdupq_n_s32(0), b = a;
        for (int k = 0; k < kp; k += 8) {
            int16x8_t x = vld1q_s16(c + k);
            a = qrt_mla8(a, x, vld1q_s16(w0 + k));
            if (w1) b = qrt_mla8(b, x, vld1q_s16(w1 + k));
        }
        acc0[i] = qrt_hsum_s32(a);
        if (w1) acc1[i] = qrt_hsum_s32(b);
    }
}
#endif
#else
static void qrt_gemm_tile(const int16_t *col, int np, int kp, const int16_t *w0, const int16_t *w1, int32_t *acc0,
                          int32_t *acc1) {
    /* Inner loops of a constant QRT_KALIGN values: a compiler vectorises them even at its cheapest cost model. */
    for (int i = 0; i < np; i++) {
        const int16_t *c = col + (size_t)i * kp;
        int32_t s0 = 0, s1 = 0;
        for (int k0 = 0; k0 < kp; k0 += QRT_KALIGN)
            for (int k = k0; k < k0 + QRT_KALIGN; k++) s0 += (int32_t)c[k] * w0[k];
        acc0[i] = s0;
        if (w1) {
            for (int k0 = 0; k0 < kp; k0 += QRT_KALIGN)
                for (int k = k0; k < k0 + QRT_KALIGN; k++) s1 += (int32_t)c[k] * w1[k];
            acc1[i] = s1;
        }
    }
}
#endif

/* out[r] = sum_k (x[k] - zp) * w[r][k] for rows r < rows (at most 4), k < n. */
static void qrt_dot_rows_plain(const int8_t *x, int32_t zp, const int8_t *const *w, int rows, int k0, int n,
                               int32_t *out) {
    for (int r = 0; r < rows; r++) {
        const int8_t *wr = w[r];
        int32_t s = 0;
        int k = k0;
        for (; k + 16 <= n; k += 16) /* a constant trip count, which the compiler vectorises */
            for (int i = k; i < k + 16; i++) s += ((int32_t)x[i] - zp) * wr[i];
        for (; k < n; k++) s += ((int32_t)x[k] - zp) * wr[k];
        out[r] += s;
    }
}

#if defined(QRT_AVX2)
static void qrt_dot_rows(const int8_t *x, int32_t zp, const int8_t *const *w, int rows, int n, int32_t *out) {
    const __m256i vzp = _mm256_set1_epi16((int16_t)zp);
    int k = 0;
    if (rows == 4) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (; k + 16 <= n; k += 16) {
            __m256i xv = _mm256_sub_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + k))), vzp);
            a0 = QRT_DPWSSD(a0, xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[0] + k))));
            a1 = QRT_DPWSSD(a1, xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[1] + k))));
            a2 = QRT_DPWSSD(a2, xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[2] + k))));
            a3 = QRT_DPWSSD(a3, xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[3] + k))));
        }
        __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        int32_t v[4];
        _mm_storeu_si128((__m128i *)v, s);
        for (int r = 0; r < 4; r++) out[r] += v[r];
    } else {
        for (int r = 0; r < rows; r++) {
            __m256i a = _mm256_setzero_si256();
            int kk = 0;
            for (; kk + 16 <= n; kk += 16) {
                __m256i xv = _mm256_sub_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + kk))), vzp);
                a = QRT_DPWSSD(a, xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + kk))));
            }
            out[r] += qrt_hsum256(a);
            k = kk;
        }
    }
    qrt_dot_rows_plain(x, zp, w, rows, k, n, out);
}
#elif defined(QRT_NEON)
static void qrt_dot_rows(const int8_t *x, int32_t zp, const int8_t *const *w, int rows, int n, int32_t *out) {
    const int16x8_t vzp = vdupq_n_s16((int16_t)zp);
    int32x4_t a[4];
    for (int r = 0; r < 4; r++) a[r] = vdupq_n_s32(0);
    int k = 0;
    for (; k + 8 <= n; k += 8) {
        int16x8_t xv = vsubq_s16(vmovl_s8(vld1_s8(x + k)), vzp);
        for (int r = 0; r < rows; r++) a[r] = qrt_mla8(a[r], xv, vmovl_s8(vld1_s8(w[r] + k)));
    }
    for (int r = 0; r < rows; r++) out[r] += qrt_hsum_s32(a[r]);
    qrt_dot_rows_plain(x, zp, w, rows, k, n, out);
}
#else
static void qrt_dot_rows(const int8_t *x, int32_t zp, const int8_t *const *w, int rows, int n, int32_t *out) {
    qrt_dot_rows_plain(x, zp, w, rows, 0, n, out);
}
#endif

/* ---- depthwise taps -------------------------------------------------------------------------------------- */

/* acc[j] = sum_t wk[t] * src[off[t] + j] for j < nw: the plane is laid out so that every tap of a row of outputs
 * reads a contiguous run (see qrt_conv2d_one_in). The SIMD paths work in whole blocks (16 or 8 outputs): they
 * may read up to QRT_DW_SLACK values past src[off[t] + nw - 1] and write acc up to nw rounded up to 16. */
#define QRT_DW_SLACK 16

#if defined(QRT_AVX2)
static void qrt_dw_row(const int16_t *src, const int32_t *off, const int16_t *wk, int kk, int nw, int32_t *acc) {
    for (int j = 0; j < nw; j += 16) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        for (int t = 0; t < kk; t++) {
            /* |x - zp| <= 255 and |w| <= 128: the int16 product is exact. */
            __m256i m = _mm256_mullo_epi16(_mm256_loadu_si256((const __m256i *)(src + off[t] + j)),
                                           _mm256_set1_epi16(wk[t]));
            a0 = _mm256_add_epi32(a0, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(m)));
            a1 = _mm256_add_epi32(a1, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(m, 1)));
        }
        _mm256_storeu_si256((__m256i *)(acc + j), a0);
        _mm256_storeu_si256((__m256i *)(acc + j + 8), a1);
    }
}
#elif defined(QRT_NEON)
static void qrt_dw_row(const int16_t *src, const int32_t *off, const int16_t *wk, int kk, int nw, int32_t *acc) {
    for (int j = 0; j < nw; j += 8) {
        int32x4_t a0 = vdupq_n_s32(0), a1 = a0;
        for (int t = 0; t < kk; t++) {
            int16x8_t v = vld1q_s16(src + off[t] + j);
            a0 = vmlal_n_s16(a0, vget_low_s16(v), wk[t]);
            a1 = vmlal_n_s16(a1, vget_high_s16(v), wk[t]);
        }
        vst1q_s32(acc + j, a0);
        vst1q_s32(acc + j + 4, a1);
    }
}
#else
static void qrt_dw_row(const int16_t *src, const int32_t *off, const int16_t *wk, int kk, int nw, int32_t *acc) {
    /* Whole blocks of 16 (the slack allows it): a constant trip count, which the compiler vectorises. */
    for (int j0 = 0; j0 < nw; j0 += 16) {
        int32_t a[16];
        for (int j = 0; j < 16; j++) a[j] = 0;
        for (int t = 0; t < kk; t++) {
            const int16_t *s = src + off[t] + j0;
            int32_t w = wk[t];
            for (int j = 0; j < 16; j++) a[j] += w * s[j];
        }
        for (int j = 0; j < 16; j++) acc[j0 + j] = a[j];
    }
}
#endif

/* ---- convolution ----------------------------------------------------------------------------------------- */

/* Input rows (or columns) the outputs read, from the first padded one: the padded plane's height (width). */
static size_t qrt_span(int out, int stride, int k, int dil) {
    return (size_t)(out - 1) * (size_t)stride + (size_t)(k - 1) * (size_t)dil + 1;
}

static int qrt_conv_one_in_channel(const qrt_conv2d_t *p) { return p->in_c / p->groups == 1; }

/* The one-input-channel path's plane: hp rows of sw phases of wq values each (wq = ceil(wp / sw)); padded
 * column c is at phase c % sw, index c / sw, so output column ow's tap kw is at a fixed offset plus ow. */
typedef struct {
    size_t hp, wq, row; /* row: values per plane row, sw * wq */
} qrt_plane_t;

static qrt_plane_t qrt_plane_geom(const qrt_conv2d_t *p) {
    qrt_plane_t g;
    size_t wp = qrt_span(p->out_w, p->stride_w, p->k_w, p->dil_w);
    g.hp = qrt_span(p->out_h, p->stride_h, p->k_h, p->dil_h);
    g.wq = (wp + (size_t)p->stride_w - 1) / (size_t)p->stride_w;
    g.row = g.wq * (size_t)p->stride_w;
    return g;
}

size_t qrt_conv2d_scratch(const qrt_conv2d_t *p) {
    if (p->out_h <= 0 || p->out_w <= 0 || p->out_c <= 0) return 0;
    size_t kk = (size_t)p->k_h * (size_t)p->k_w;
    if (qrt_conv_one_in_channel(p)) { /* the taps' offsets (int32) and weights (int16), then the plane */
        qrt_plane_t g = qrt_plane_geom(p);
        return qrt_round_k(kk) * (sizeof(int32_t) + sizeof(int16_t)) +
               (g.hp * g.row + QRT_DW_SLACK) * sizeof(int16_t) + QRT_ALIGN;
    }
    /* The group's input channels-last and padded, the im2col tile, the group's weights (all int16). */
    size_t cin_g = (size_t)(p->in_c / p->groups), kp = qrt_round_k(cin_g * kk);
    size_t px = (size_t)qrt_imin(p->out_h * p->out_w, QRT_TILE_PX);
    size_t hwc = qrt_span(p->out_h, p->stride_h, p->k_h, p->dil_h) * qrt_span(p->out_w, p->stride_w, p->k_w, p->dil_w);
    size_t wblock = (size_t)qrt_imin(p->out_c / p->groups, QRT_WBLOCK);
    return (hwc * cin_g + (px + wblock) * kp) * sizeof(int16_t) + QRT_ALIGN;
}

/* d[i] = src[2 i] - zp for i < n (a stride-2 plane's phase), reading only src[0 .. avail). */
static void qrt_gather2(const int8_t *src, long n, long avail, int32_t zp, int16_t *d) {
    long i = 0;
#if defined(QRT_AVX2)
    const __m128i evens = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i vzp = _mm_set1_epi16((int16_t)zp);
    for (; i + 8 <= n && 2 * i + 16 <= avail; i += 8) {
        __m128i v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(src + 2 * i)), evens);
        _mm_storeu_si128((__m128i *)(d + i), _mm_sub_epi16(_mm_cvtepi8_epi16(v), vzp));
    }
#elif defined(QRT_NEON)
    const int16x8_t vzp = vdupq_n_s16((int16_t)zp);
    for (; i + 8 <= n && 2 * i + 16 <= avail; i += 8) {
        int8x8x2_t v = vld2_s8(src + 2 * i);
        vst1q_s16(d + i, vsubq_s16(vmovl_s8(v.val[0]), vzp));
    }
#else
    (void)avail;
#endif
    for (; i < n; i++) d[i] = (int16_t)(src[2 * i] - zp);
}

/* One input channel per group: each group's plane as int16 x - in_zp with the padding at 0 (qrt_plane_t), then
 * per output channel the k_h * k_w taps summed over contiguous runs of it, a few output rows at a time (packed in
 * acc as they are in y) so that one requantization call covers them. */
static void qrt_conv2d_one_in(const qrt_conv2d_t *p, const int8_t *x, int8_t *y, void *scratch) {
    const int kk = p->k_h * p->k_w, cout_g = p->out_c / p->groups, sw = p->stride_w;
    const qrt_plane_t g = qrt_plane_geom(p);
    const long wp = (long)qrt_span(p->out_w, p->stride_w, p->k_w, p->dil_w);
    const size_t n_out = (size_t)p->out_h * p->out_w;
    const int tw = qrt_imin(p->out_w, QRT_DW_ACC), rows = tw == p->out_w ? QRT_DW_ACC / tw : 1;
    int32_t *off = (int32_t *)qrt_align_ptr(scratch);
    int16_t *wk = (int16_t *)(off + qrt_round_k((size_t)kk));
    int16_t *plane = wk + qrt_round_k((size_t)kk);
    int32_t acc[QRT_DW_ACC + 16];
    const int8_t *x_end = x + (size_t)p->in_c * p->in_h * p->in_w;
    for (int kh = 0; kh < p->k_h; kh++)
        for (int kw = 0; kw < p->k_w; kw++) {
            int c = kw * p->dil_w;
            off[kh * p->k_w + kw] =
                (int32_t)((size_t)kh * p->dil_h * g.row + (size_t)(c % sw) * g.wq + (size_t)(c / sw));
        }
    memset(plane + g.hp * g.row, 0, QRT_DW_SLACK * sizeof(int16_t));
    for (int gi = 0; gi < p->groups; gi++) {
        const int8_t *xg = x + (size_t)gi * p->in_h * p->in_w;
        /* Phase ph holds padded columns c = q * sw + ph (input column c - pad_l): q in [qa, qb) are inside the
         * image, the others padding. */
        for (int ph = 0; ph < sw; ph++) {
            long qw = (wp - ph + sw - 1) / sw, qa = p->pad_l > ph ? (p->pad_l - ph + sw - 1) / sw : 0;
            long qb = (p->pad_l + p->in_w - ph + sw - 1) / sw;
            qb = qb < qw ? qb : qw;
            qa = qa < qb ? qa : qb;
            for (size_t r = 0; r < g.hp; r++) {
                long ih = (long)r - p->pad_t;
                int16_t *d = plane + r * g.row + (size_t)ph * g.wq;
                long q = 0;
                if (ih >= 0 && ih < p->in_h) {
                    const int8_t *src = xg + (size_t)ih * p->in_w + (qa * sw + ph - p->pad_l);
                    for (; q < qa; q++) d[q] = 0;
                    if (sw == 1)
                        for (; q < qb; q++) d[q] = (int16_t)(src[q - qa] - p->in_zp);
                    else if (sw == 2)
                        qrt_gather2(src, qb - qa, x_end - src, p->in_zp, d + qa), q = qb;
                    else
                        for (; q < qb; q++) d[q] = (int16_t)(src[(q - qa) * sw] - p->in_zp);
                }
                for (; q < (long)g.wq; q++) d[q] = 0;
            }
        }
        for (int j = 0; j < cout_g; j++) {
            const int o = gi * cout_g + j;
            for (int t = 0; t < kk; t++) wk[t] = qrt_weight_at(p->w_bits, p->weight, (size_t)o * kk + (size_t)t);
            for (int oh0 = 0; oh0 < p->out_h; oh0 += rows) {
                const int nr = qrt_imin(rows, p->out_h - oh0);
                for (int ow0 = 0; ow0 < p->out_w; ow0 += tw) {
                    const int nw = qrt_imin(tw, p->out_w - ow0); /* nr > 1 only when nw is the whole row */
                    for (int r = 0; r < nr; r++)
                        qrt_dw_row(plane + (size_t)(oh0 + r) * p->stride_h * g.row + ow0, off, wk, kk, nw,
                                   acc + (size_t)r * nw);
                    qrt_requant_row(acc, nr * nw, p->bias[o], p->mult[o], p->shift[o], p->out_zp, p->act_min,
                                    p->act_max, y + (size_t)o * n_out + (size_t)oh0 * p->out_w + ow0);
                }
            }
        }
    }
}

#if defined(QRT_AVX2)
/* c[j] = column j of the 16 x 16 bytes r[0..15] (SSE2's unpack network: bytes, words, dwords, qwords). */
static void qrt_transpose16(const __m128i *r, __m128i *c) {
    __m128i a[16], b[16];
    for (int i = 0; i < 8; i++) { /* a[2i], a[2i+1]: columns 0-7 and 8-15 of rows 2i, 2i+1 */
        a[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int q = 0; q < 4; q++) /* b[4q + m]: columns 4m .. 4m+3 of rows 4q .. 4q+3 */
        for (int h = 0; h < 2; h++) {
            b[4 * q + 2 * h] = _mm_unpacklo_epi16(a[4 * q + h], a[4 * q + 2 + h]);
            b[4 * q + 2 * h + 1] = _mm_unpackhi_epi16(a[4 * q + h], a[4 * q + 2 + h]);
        }
    for (int o = 0; o < 2; o++) /* a[8o + n]: columns 2n, 2n+1 of rows 8o .. 8o+7 */
        for (int m = 0; m < 4; m++) {
            a[8 * o + 2 * m] = _mm_unpacklo_epi32(b[8 * o + m], b[8 * o + 4 + m]);
            a[8 * o + 2 * m + 1] = _mm_unpackhi_epi32(b[8 * o + m], b[8 * o + 4 + m]);
        }
    for (int n = 0; n < 8; n++) {
        c[2 * n] = _mm_unpacklo_epi64(a[n], a[8 + n]);
        c[2 * n + 1] = _mm_unpackhi_epi64(a[n], a[8 + n]);
    }
}

/* Whether the 16-byte loads of 16 weight rows of kk (src[i * kk + t0 ..], t0 < kk in steps of 16) stay before
 * end. */
static int qrt_rows16_fit(const int8_t *src, int kk, const int8_t *end) {
    return (size_t)(end - src) >= (size_t)15 * kk + qrt_round_k((size_t)kk);
}
#endif

/* The general path. K runs over (kh, kw, ic) here, not the weights' (ic, kh, kw): with the group's input copied
 * channels-last (HWC, int16 x - in_zp, the padding at 0) one kernel row of a pixel's im2col row is one contiguous
 * run of k_w * cin_g values (or k_w runs of cin_g with dilation), and the weights are reordered (and widened) to
 * match, QRT_WBLOCK output channels at a time (16 x 16 byte transposes on x86). */
typedef struct {
    int cin_g, cout_g, k, kp;
    size_t hp, wp;
} qrt_gemm_geom_t;

static qrt_gemm_geom_t qrt_gemm_geom(const qrt_conv2d_t *p) {
    qrt_gemm_geom_t g;
    g.cin_g = p->in_c / p->groups, g.cout_g = p->out_c / p->groups;
    g.k = g.cin_g * p->k_h * p->k_w, g.kp = (int)qrt_round_k((size_t)g.k);
    g.hp = qrt_span(p->out_h, p->stride_h, p->k_h, p->dil_h), g.wp = qrt_span(p->out_w, p->stride_w, p->k_w, p->dil_w);
    return g;
}

#if !defined(QRT_I8DOT)

/* The group's input xg (cin_g, in_h, in_w) as hwc (hp, wp, cin_g). */
static void qrt_hwc_copy(const qrt_conv2d_t *p, const qrt_gemm_geom_t *g, const int8_t *xg, int16_t *hwc) {
    const size_t plane = (size_t)p->in_h * p->in_w;
    memset(hwc, 0, g->hp * g->wp * (size_t)g->cin_g * sizeof(int16_t));
    for (int ih = 0; ih < p->in_h; ih++) {
        long r = (long)ih + p->pad_t;
        if (r >= (long)g->hp) break;
        long c0 = p->pad_l, n = p->in_w;
        if (c0 + n > (long)g->wp) n = (long)g->wp - c0;
        for (long iw = 0; iw < n; iw++) {
            int16_t *d = hwc + ((size_t)r * g->wp + (size_t)(c0 + iw)) * g->cin_g;
            const int8_t *s = xg + (size_t)ih * p->in_w + (size_t)iw;
            for (int ic = 0; ic < g->cin_g; ic++) d[ic] = (int16_t)(s[(size_t)ic * plane] - p->in_zp);
        }
    }
}

/* Rows n0 .. n0+np of the im2col (np, kp) from hwc, zero from K to kp. */
static void qrt_im2col(const qrt_conv2d_t *p, const qrt_gemm_geom_t *g, const int16_t *hwc, int n0, int np,
                       int16_t *col) {
    const size_t run = (size_t)p->k_w * g->cin_g;
    for (int i = 0; i < np; i++) {
        const int n = n0 + i, oh = n / p->out_w, ow = n % p->out_w;
        int16_t *c = col + (size_t)i * g->kp;
        for (int kh = 0; kh < p->k_h; kh++) {
            const int16_t *s = hwc + ((size_t)(oh * p->stride_h + kh * p->dil_h) * g->wp + (size_t)ow * p->stride_w) *
                                         g->cin_g;
            if (p->dil_w == 1) {
                memcpy(c, s, run * sizeof(int16_t));
            } else {
                for (int kw = 0; kw < p->k_w; kw++)
                    memcpy(c + (size_t)kw * g->cin_g, s + (size_t)kw * p->dil_w * g->cin_g,
                           (size_t)g->cin_g * sizeof(int16_t));
            }
            c += run;
        }
        for (int k = g->k; k < g->kp; k++) col[(size_t)i * g->kp + k] = 0;
    }
}

/* wb (nc, kp): output channels o0 .. o0+nc of the weights in (kh, kw, ic) order, zero from K to kp. */
static void qrt_widen_weights(const qrt_conv2d_t *p, const qrt_gemm_geom_t *g, int o0, int nc, int16_t *wb) {
    const int kk = p->k_h * p->k_w;
    for (int j = 0; j < nc; j++) {
        int16_t *w = wb + (size_t)j * g->kp;
        const size_t base = (size_t)(o0 + j) * g->k;
        if (p->w_bits == 8) {
            const int8_t *src = (const int8_t *)p->weight + base;
            int ic = 0;
#if defined(QRT_AVX2)
            const int8_t *end = (const int8_t *)p->weight + (size_t)p->out_c * g->k;
            for (; ic + 16 <= g->cin_g && qrt_rows16_fit(src + (size_t)ic * kk, kk, end); ic += 16)
                for (int t0 = 0; t0 < kk; t0 += 16) {
                    __m128i r[16], c[16];
                    for (int i = 0; i < 16; i++)
                        r[i] = _mm_loadu_si128((const __m128i *)(src + (size_t)(ic + i) * kk + t0));
                    qrt_transpose16(r, c);
                    for (int jj = 0; jj < 16 && t0 + jj < kk; jj++) {
                        int16_t *d = w + (size_t)(t0 + jj) * g->cin_g + ic;
                        _mm_storeu_si128((__m128i *)d, _mm_cvtepi8_epi16(c[jj]));
                        _mm_storeu_si128((__m128i *)(d + 8), _mm_cvtepi8_epi16(_mm_srli_si128(c[jj], 8)));
                    }
                }
#endif
            for (int t = 0; t < kk; t++)
                for (int i = ic; i < g->cin_g; i++) w[(size_t)t * g->cin_g + i] = src[(size_t)i * kk + (size_t)t];
        } else {
            for (int ic = 0; ic < g->cin_g; ic++)
                for (int t = 0; t < kk; t++)
                    w[(size_t)t * g->cin_g + ic] = qrt_weight_at(4, p->weight, base + (size_t)ic * kk + (size_t)t);
        }
        for (int k = g->k; k < g->kp; k++) w[k] = 0;
    }
}

static void qrt_conv2d_im2col(const qrt_conv2d_t *p, const int8_t *x, int8_t *y, void *scratch) {
    const qrt_gemm_geom_t g = qrt_gemm_geom(p);
    const int n_out = p->out_h * p->out_w, tile = qrt_imin(n_out, QRT_TILE_PX);
    int16_t *hwc = (int16_t *)qrt_align_ptr(scratch);
    int16_t *col = hwc + g.hp * g.wp * (size_t)g.cin_g, *wb = col + (size_t)tile * g.kp;
    int32_t acc0[QRT_TILE_PX], acc1[QRT_TILE_PX];
    for (int gi = 0; gi < p->groups; gi++) {
        qrt_hwc_copy(p, &g, x + (size_t)gi * g.cin_g * p->in_h * p->in_w, hwc);
        /* QRT_WBLOCK output channels' weights at a time (the scratch stays small); the im2col, a copy of runs, is
         * redone for each block. */
        for (int j0 = 0; j0 < g.cout_g; j0 += QRT_WBLOCK) {
            const int nc = qrt_imin(QRT_WBLOCK, g.cout_g - j0);
            qrt_widen_weights(p, &g, gi * g.cout_g + j0, nc, wb);
            for (int n0 = 0; n0 < n_out; n0 += tile) {
                const int np = qrt_imin(tile, n_out - n0);
                qrt_im2col(p, &g, hwc, n0, np, col);
                for (int j = 0; j < nc; j += 2) {
                    const int o = gi * g.cout_g + j0 + j, two = j + 1 < nc;
                    const int16_t *w0 = wb + (size_t)j * g.kp;
                    qrt_gemm_tile(col, np, g.kp, w0, two ? w0 + g.kp : NULL, acc0, acc1);
                    for (int c = 0; c <= two; c++)
                        qrt_requant_row(c ? acc1 : acc0, np, p->bias[o + c], p->mult[o + c], p->shift[o + c],
                                        p->out_zp, p->act_min, p->act_max, y + (size_t)(o + c) * n_out + n0);
                }
            }
        }
    }
}

#else
/* The general path in 8 bits: the same layouts in bytes x + QRT_I8_XOFF (the padding in_zp + QRT_I8_XOFF; uint8
 * for vpdpbusd, int8 for sdot) and int8 weights, K padded to QRT_I8_KALIGN, in the int16 path's scratch (each part
 * fits in its int16 counterpart). sum (x + XOFF) * w is exact in int32 (neither instruction saturates), and
 * bias - (in_zp + XOFF) * sum w turns it into the int16 path's sum. */
static void qrt_hwc_copy8(const qrt_conv2d_t *p, const qrt_gemm_geom_t *g, const int8_t *xg, uint8_t *hwc) {
    const size_t plane = (size_t)p->in_h * p->in_w;
    memset(hwc, (uint8_t)(p->in_zp + QRT_I8_XOFF), g->hp * g->wp * (size_t)g->cin_g);
    for (int ih = 0; ih < p->in_h; ih++) {
        long r = (long)ih + p->pad_t;
        if (r >= (long)g->hp) break;
        long c0 = p->pad_l, n = p->in_w;
        if (c0 + n > (long)g->wp) n = (long)g->wp - c0;
        for (long iw = 0; iw < n; iw++) {
            uint8_t *d = hwc + ((size_t)r * g->wp + (size_t)(c0 + iw)) * g->cin_g;
            const int8_t *s = xg + (size_t)ih * p->in_w + (size_t)iw;
            for (int ic = 0; ic < g->cin_g; ic++) d[ic] = (uint8_t)(s[(size_t)ic * plane] + QRT_I8_XOFF);
        }
    }
}

static void qrt_im2col8(const qrt_conv2d_t *p, const qrt_gemm_geom_t *g, const uint8_t *hwc, int n0, int np,
                        int kq, uint8_t *col) {
    const size_t run = (size_t)p->k_w * g->cin_g;
    for (int i = 0; i < np; i++) {
        const int n = n0 + i, oh = n / p->out_w, ow = n % p->out_w;
        uint8_t *c = col + (size_t)i * kq;
        for (int kh = 0; kh < p->k_h; kh++) {
            const uint8_t *s = hwc + ((size_t)(oh * p->stride_h + kh * p->dil_h) * g->wp + (size_t)ow * p->stride_w) *
                                         g->cin_g;
            if (p->dil_w == 1) {
                memcpy(c, s, run);
            } else {
                for (int kw = 0; kw < p->k_w; kw++)
                    memcpy(c + (size_t)kw * g->cin_g, s + (size_t)kw * p->dil_w * g->cin_g, (size_t)g->cin_g);
            }
            c += run;
        }
        memset(col + (size_t)i * kq + g->k, 0, (size_t)(kq - g->k));
    }
}

/* wb (nc, kq) int8 in (kh, kw, ic) order, zero from K to kq, and each channel's sum of weights. */
static void qrt_weights8(const qrt_conv2d_t *p, const qrt_gemm_geom_t *g, int o0, int nc, int kq, int8_t *wb,
                         int32_t *sumw) {
    const int kk = p->k_h * p->k_w;
    for (int j = 0; j < nc; j++) {
        int8_t *w = wb + (size_t)j * kq;
        const size_t base = (size_t)(o0 + j) * g->k;
        if (p->w_bits == 8) {
            const int8_t *src = (const int8_t *)p->weight + base;
            int ic = 0;
#if defined(QRT_AVX2)
            const int8_t *end = (const int8_t *)p->weight + (size_t)p->out_c * g->k;
            for (; ic + 16 <= g->cin_g && qrt_rows16_fit(src + (size_t)ic * kk, kk, end); ic += 16)
                for (int t0 = 0; t0 < kk; t0 += 16) {
                    __m128i r[16], c[16];
                    for (int i = 0; i < 16; i++)
                        r[i] = _mm_loadu_si128((const __m128i *)(src + (size_t)(ic + i) * kk + t0));
                    qrt_transpose16(r, c);
                    for (int jj = 0; jj < 16 && t0 + jj < kk; jj++)
                        _mm_storeu_si128((__m128i *)(w + (size_t)(t0 + jj) * g->cin_g + ic), c[jj]);
                }
#endif
            for (int t = 0; t < kk; t++)
                for (int i = ic; i < g->cin_g; i++) w[(size_t)t * g->cin_g + i] = src[(size_t)i * kk + (size_t)t];
        } else {
            for (int ic = 0; ic < g->cin_g; ic++)
                for (int t = 0; t < kk; t++)
                    w[(size_t)t * g->cin_g + ic] = qrt_weight_at(4, p->weight, base + (size_t)ic * kk + (size_t)t);
        }
        memset(w + g->k, 0, (size_t)(kq - g->k));
#if defined(QRT_AVX2)
        __m256i a = _mm256_setzero_si256(); /* sum w as 1 * w, four bytes per lane */
        for (int k = 0; k < kq; k += 32)
            a = QRT_DPBUSD(a, _mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i *)(w + k)));
        sumw[j] = qrt_hsum256(a);
#else
        int32x4_t a = vdupq_n_s32(0);
        for (int k = 0; k < kq; k += 16) a = vdotq_s32(a, vdupq_n_s8(1), vld1q_s8(w + k));
        sumw[j] = qrt_hsum_s32(a);
#endif
    }
}

#if defined(QRT_AVX2)
static void qrt_gemm_tile8(const uint8_t *col, int np, int kq, const int8_t *w0, const int8_t *w1, int32_t *acc0,
                           int32_t *acc1) {
    int i = 0;
    if (w1) {
        for (; i + 4 <= np; i += 4) {
            const uint8_t *c = col + (size_t)i * kq;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int k = 0; k < kq; k += 32) {
                __m256i u = _mm256_loadu_si256((const __m256i *)(w0 + k));
                __m256i v = _mm256_loadu_si256((const __m256i *)(w1 + k));
                __m256i x0 = _mm256_loadu_si256((const __m256i *)(c + k));
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(c + kq + k));
                __m256i x2 = _mm256_loadu_si256((const __m256i *)(c + 2 * (size_t)kq + k));
                __m256i x3 = _mm256_loadu_si256((const __m256i *)(c + 3 * (size_t)kq + k));
                a0 = QRT_DPBUSD(a0, x0, u);
                a1 = QRT_DPBUSD(a1, x1, u);
                a2 = QRT_DPBUSD(a2, x2, u);
                a3 = QRT_DPBUSD(a3, x3, u);
                b0 = QRT_DPBUSD(b0, x0, v);
                b1 = QRT_DPBUSD(b1, x1, v);
                b2 = QRT_DPBUSD(b2, x2, v);
                b3 = QRT_DPBUSD(b3, x3, v);
            }
            __m256i t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
            __m256i t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(b0, b1), _mm256_hadd_epi32(b2, b3));
            __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20),
                                         _mm256_permute2x128_si256(t0, t1, 0x31));
            _mm_storeu_si128((__m128i *)(acc0 + i), _mm256_castsi256_si128(s));
            _mm_storeu_si128((__m128i *)(acc1 + i), _mm256_extracti128_si256(s, 1));
        }
    }
    for (; i < np; i++) {
        const uint8_t *c = col + (size_t)i * kq;
        __m256i a = _mm256_setzero_si256(), b = a;
        for (int k = 0; k < kq; k += 32) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(c + k));
            a = QRT_DPBUSD(a, x, _mm256_loadu_si256((const __m256i *)(w0 + k)));
            if (w1) b = QRT_DPBUSD(b, x, _mm256_loadu_si256((const __m256i *)(w1 + k)));
        }
        acc0[i] = qrt_hsum256(a);
        if (w1) acc1[i] = qrt_hsum256(b);
    }
}

#else
static void qrt_gemm_tile8(const uint8_t *col, int np, int kq, const int8_t *w0, const int8_t *w1, int32_t *acc0,
                           int32_t *acc1) {
    int i = 0;
    if (w1) {
        for (; i + 4 <= np; i += 4) {
            const int8_t *c = (const int8_t *)col + (size_t)i * kq;
            int32x4_t a[4], b[4];
            for (int r = 0; r < 4; r++) a[r] = b[r] = vdupq_n_s32(0);
            for (int k = 0; k < kq; k += 16) {
                int8x16_t u = vld1q_s8(w0 + k), v = vld1q_s8(w1 + k);
                for (int r = 0; r < 4; r++) {
                    int8x16_t x = vld1q_s8(c + (size_t)r * kq + k);
                    a[r] = vdotq_s32(a[r], x, u);
                    b[r] = vdotq_s32(b[r], x, v);
                }
            }
            for (int r = 0; r < 4; r++) {
                acc0[i + r] = qrt_hsum_s32(a[r]);
                acc1[i + r] = qrt_hsum_s32(b[r]);
            }
        }
    }
    for (; i < np; i++) {
        const int8_t *c = (const int8_t *)col + (size_t)i * kq;
        int32x4_t a = vdupq_n_s32(0), b = a;
        for (int k = 0; k < kq; k += 16) {
            int8x16_t x = vld1q_s8(c + k);
            a = vdotq_s32(a, x, vld1q_s8(w0 + k));
            if (w1) b = vdotq_s32(b, x, vld1q_s8(w1 + k));
        }
        acc0[i] = qrt_hsum_s32(a);
        if (w1) acc1[i] = qrt_hsum_s32(b);
    }
}
#endif

static void qrt_conv2d_im2col(const qrt_conv2d_t *p, const int8_t *x, int8_t *y, void *scratch) {
    const qrt_gemm_geom_t g = qrt_gemm_geom(p);
    const int n_out = p->out_h * p->out_w, tile = qrt_imin(n_out, QRT_TILE_PX);
    const int kq = (g.k + QRT_I8_KALIGN - 1) / QRT_I8_KALIGN * QRT_I8_KALIGN;
    uint8_t *hwc = (uint8_t *)qrt_align_ptr(scratch);
    uint8_t *col = hwc + g.hp * g.wp * (size_t)g.cin_g * sizeof(int16_t);
    int8_t *wb = (int8_t *)(col + (size_t)tile * g.kp * sizeof(int16_t));
    int32_t acc0[QRT_TILE_PX], acc1[QRT_TILE_PX], sumw[QRT_WBLOCK];
    const int64_t xoff = (int64_t)p->in_zp + QRT_I8_XOFF;
    for (int gi = 0; gi < p->groups; gi++) {
        qrt_hwc_copy8(p, &g, x + (size_t)gi * g.cin_g * p->in_h * p->in_w, hwc);
        for (int j0 = 0; j0 < g.cout_g; j0 += QRT_WBLOCK) {
            const int nc = qrt_imin(QRT_WBLOCK, g.cout_g - j0);
            qrt_weights8(p, &g, gi * g.cout_g + j0, nc, kq, wb, sumw);
            for (int n0 = 0; n0 < n_out; n0 += tile) {
                const int np = qrt_imin(tile, n_out - n0);
                qrt_im2col8(p, &g, hwc, n0, np, kq, col);
                for (int j = 0; j < nc; j += 2) {
                    const int o = gi * g.cout_g + j0 + j, two = j + 1 < nc;
                    const int8_t *w0 = wb + (size_t)j * kq;
                    qrt_gemm_tile8(col, np, kq, w0, two ? w0 + kq : NULL, acc0, acc1);
                    for (int c = 0; c <= two; c++)
                        qrt_requant_row(c ? acc1 : acc0, np, (int32_t)(p->bias[o + c] - xoff * sumw[j + c]),
                                        p->mult[o + c], p->shift[o + c], p->out_zp, p->act_min, p->act_max,
                                        y + (size_t)(o + c) * n_out + n0);
                }
            }
        }
    }
}
#endif

/* The convolution without scratch, for a device short of RAM (the export's --low-ram): an output row at a time,
 * QRT_ROW outputs in int32 on the stack, each weight applied along the row. Slower than the paths above; the same
 * integers. */
#define QRT_ROW 64
static void qrt_conv2d_direct(const qrt_conv2d_t *p, const int8_t *x, int8_t *y) {
    const int cpg = p->in_c / p->groups, opg = p->out_c / p->groups;
    int32_t acc[QRT_ROW];
    for (int o = 0; o < p->out_c; o++) {
        const int8_t *xg = x + (size_t)(o / opg) * cpg * p->in_h * p->in_w;
        const size_t w0 = (size_t)o * cpg * p->k_h * p->k_w;
        for (int oh = 0; oh < p->out_h; oh++)
            for (int ow0 = 0; ow0 < p->out_w; ow0 += QRT_ROW) {
                const int n = qrt_imin(QRT_ROW, p->out_w - ow0);
                for (int j = 0; j < n; j++) acc[j] = 0;
                for (int c = 0; c < cpg; c++)
                    for (int kh = 0; kh < p->k_h; kh++) {
                        const int ih = oh * p->stride_h - p->pad_t + kh * p->dil_h;
                        if (ih < 0 || ih >= p->in_h) continue; /* padding: in_zp, which adds 0 */
                        const int8_t *row = xg + ((size_t)c * p->in_h + ih) * p->in_w;
                        for (int kw = 0; kw < p->k_w; kw++) {
                            const int w = qrt_weight_at(p->w_bits, p->weight,
                                                        w0 + ((size_t)c * p->k_h + kh) * p->k_w + (size_t)kw);
                            const int off = kw * p->dil_w - p->pad_l; /* iw = (ow0 + j) * stride_w + off */
                            int j0 = 0, j1 = n;                       /* the j whose iw lies in the row */
                            while (j0 < n && (ow0 + j0) * p->stride_w + off < 0) j0++;
                            while (j1 > j0 && (ow0 + j1 - 1) * p->stride_w + off >= p->in_w) j1--;
                            for (int j = j0; j < j1; j++)
                                acc[j] += (row[(ow0 + j) * p->stride_w + off] - p->in_zp) * w;
                        }
                    }
                int8_t *yr = y + ((size_t)o * p->out_h + oh) * p->out_w + ow0;
                for (int j = 0; j < n; j++)
                    yr[j] = qrt_requant(((int64_t)acc[j] + p->bias[o]) * p->mult[o], p->shift[o], p->out_zp,
                                        p->act_min, p->act_max);
            }
    }
}

void qrt_conv2d(const qrt_conv2d_t *p, const int8_t *x, int8_t *y, void *scratch) {
    if (p->out_h <= 0 || p->out_w <= 0 || p->out_c <= 0) return;
    if (!scratch && qrt_conv2d_scratch(p) > 0) {
        qrt_conv2d_direct(p, x, y);
        return;
    }
    if (qrt_conv_one_in_channel(p))
        qrt_conv2d_one_in(p, x, y, scratch);
    else
        qrt_conv2d_im2col(p, x, y, scratch);
}

/* ---- dense ----------------------------------------------------------------------------------------------- */

void qrt_dense(const qrt_dense_t *p, const int8_t *x, int8_t *y) {
    const int n = p->in;
    for (int o = 0; o < p->out; o += 4) {
        const int rows = qrt_imin(4, p->out - o);
        int32_t acc[4] = {0, 0, 0, 0};
        if (p->w_bits == 8) {
            const int8_t *w[4];
            for (int r = 0; r < rows; r++) w[r] = (const int8_t *)p->weight + (size_t)(o + r) * n;
            qrt_dot_rows(x, p->in_zp, w, rows, n, acc);
        } else {
            int8_t buf[4][QRT_CHUNK];
            const int8_t *w[4] = {buf[0], buf[1], buf[2], buf[3]};
            for (int k0 = 0; k0 < n; k0 += QRT_CHUNK) {
                const int m = qrt_imin(QRT_CHUNK, n - k0);
                for (int r = 0; r < rows; r++) qrt_unpack4(p->weight, (size_t)(o + r) * n + (size_t)k0, m, buf[r]);
                qrt_dot_rows(x + k0, p->in_zp, w, rows, m, acc);
            }
        }
        for (int r = 0; r < rows; r++)
            y[o + r] = qrt_requant(((int64_t)acc[r] + p->bias[o + r]) * p->mult[o + r], p->shift[o + r], p->out_zp,
                                   p->act_min, p->act_max);
    }
}

/* ---- pools, add, requant, relu, input quantization ------------------------------------------------------- */

void qrt_maxpool2d(const qrt_maxpool2d_t *p, const int8_t *x, int8_t *y) {
    for (int c = 0; c < p->c; c++) {
        const int8_t *xc = x + (size_t)c * p->in_h * p->in_w;
        for (int oh = 0; oh < p->out_h; oh++)
            for (int ow = 0; ow < p->out_w; ow++) {
                const int8_t *win = xc + (size_t)oh * p->stride_h * p->in_w + (size_t)ow * p->stride_w;
                int8_t m = INT8_MIN;
                for (int kh = 0; kh < p->k_h; kh++)
                    for (int kw = 0; kw < p->k_w; kw++) {
                        int8_t v = win[(size_t)kh * p->in_w + kw];
                        m = v > m ? v : m;
                    }
                *y++ = m;
            }
    }
}

void qrt_avgpool2d(const qrt_avgpool2d_t *p, const int8_t *x, int8_t *y) {
    const int32_t bias = -(int32_t)(p->k_h * p->k_w) * p->in_zp;
    for (int c = 0; c < p->c; c++) {
        const int8_t *xc = x + (size_t)c * p->in_h * p->in_w;
        for (int oh = 0; oh < p->out_h; oh++)
            for (int ow = 0; ow < p->out_w; ow++) {
                const int8_t *win = xc + (size_t)oh * p->stride_h * p->in_w + (size_t)ow * p->stride_w;
                int32_t s = 0;
                for (int kh = 0; kh < p->k_h; kh++)
                    for (int kw = 0; kw < p->k_w; kw++) s += win[(size_t)kh * p->in_w + kw];
                *y++ = qrt_requant(((int64_t)s + bias) * p->mult, p->shift, p->out_zp, p->act_min, p->act_max);
            }
    }
}

void qrt_add(const qrt_add_t *p, const int8_t *a, const int8_t *b, int8_t *y) {
    for (int i = 0; i < p->n; i++) {
        int64_t v = (int64_t)(a[i] - p->a_zp) * p->a_mult + (int64_t)(b[i] - p->b_zp) * p->b_mult;
        y[i] = qrt_requant(v, p->shift, p->out_zp, p->act_min, p->act_max);
    }
}

void qrt_requant_n(const qrt_requant_t *p, const int8_t *x, int8_t *y) {
    for (int i = 0; i < p->n; i++)
        y[i] = qrt_requant((int64_t)(x[i] - p->in_zp) * p->mult, p->shift, p->out_zp, p->act_min, p->act_max);
}

void qrt_relu(int n, int32_t lo, const int8_t *x, int8_t *y) {
    for (int i = 0; i < n; i++) y[i] = x[i] < lo ? (int8_t)lo : x[i];
}

void qrt_quantize_u8(int c, int hw, const int8_t *table, const uint8_t *x, int8_t *y) {
    for (int ch = 0; ch < c; ch++) {
        const int8_t *t = table + (size_t)ch * 256;
        const uint8_t *xc = x + (size_t)ch * hw;
        int8_t *yc = y + (size_t)ch * hw;
        for (int i = 0; i < hw; i++) yc[i] = t[xc[i]];
    }
}

const char *qrt_simd(void) {
#if defined(QRT_AVX2)
    return "avx2";
#elif defined(QRT_NEON)
    return "neon";
#else
    return "portable";
#endif
}
