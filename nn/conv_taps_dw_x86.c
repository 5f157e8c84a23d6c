/* conv_taps_dw_x86.c - the taps convolution's weight gradient (conv_taps.h): AVX-512F with 16 output channels in a
 * vector's lanes, AVX2 + FMA with 8, and the transposes of dp they read. Each lane is one weight's chain over an
 * image, added to the weight's sum, in conv_taps_dw_ref's order, so every kernel gives its bits.
 *
 * Why channels in the lanes: with positions in the lanes (a row of W outputs as whole vectors), a 14-wide row
 * filled 14 of 16 lanes and every sum ended in a tree of its lanes; here every lane is a weight, each position
 * of x is one broadcast against the output channels' vectors of dp, and each image's sums are added to dwt.
 *
 * AVX-512: per position, 2 vectors of dpt (32 output channels) by up to 9 taps of one input channel, 18 sums in
 * registers, each x value one broadcast for both; one vector of channels (16) with a 3x3 kernel takes two
 * positions a step, whose 12 distinct x values serve the 18 products (9 broadcasts a position bound the loop
 * otherwise); at most 8 channels take two input channels a vector (dw512_k3_two). AVX2: one vector of 8 channels
 * by up to 9 taps. */
#include "conv_taps.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)

#include <immintrin.h>

#define T512 __attribute__((target("avx512f,fma")))
#define T256 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

/* ---- AVX-512 --------------------------------------------------------------------------------------------------- */

/* A broadcast of *x kept as one load: gcc would otherwise share the loads of neighbouring positions through
 * scalar registers and broadcast from those, a shuffle each. */
T512 INLINE __m512 bcast512(const float *x) {
    __m512 b = _mm512_set1_ps(*x);
    __asm__("" : "+v"(b));
    return b;
}

/* Rows t0 .. t0 + tb - 1 of out (dwt's rows of channel c, from tap t0; columns: R vectors of 16 output channels)
 * over one image's positions: d its dpt (position q at d + q ldd), x its padded plane of channel c. k3: the 3x3
 * kernel (t0 0, tb 9), its taps as constant shifts of three row pointers. The image's chains start at 0; their
 * sums go to out (fresh) or are added to it. */
T512 INLINE void dw512_block(const ConvTaps *p, float *out, size_t ldd, const float *d, const float *x, bool fresh,
                             const int R, int t0, int tb, const bool k3) {
    __m512 a[2][9];
#pragma GCC unroll 9
    for (int k = 0; k < 9; k++)
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++)
            a[r][k] = _mm512_setzero_ps();
    int off[9];
    for (int k = 0; k < 9; k++) off[k] = p->off[k < tb ? t0 + k : t0];
    const size_t pw = (size_t)p->pw;
    for (int h = 0; h < p->H; h++) {
        const float *x0 = x + (size_t)h * pw, *x1 = x0 + pw, *x2 = x1 + pw;
        for (int w = 0; w < p->W; w++, d += ldd) {
            const __m512 d0 = _mm512_loadu_ps(d), d1 = R > 1 ? _mm512_loadu_ps(d + 16) : d0;
#pragma GCC unroll 9
            for (int k = 0; k < 9; k++) {
                if (!k3 && k >= tb) break;
                const __m512 b = bcast512(k3 ? (k < 3 ? x0 : k < 6 ? x1 : x2) + w + k % 3 : x0 + w + off[k]);
                a[0][k] = _mm512_fmadd_ps(d0, b, a[0][k]);
                if (R > 1) a[1][k] = _mm512_fmadd_ps(d1, b, a[1][k]);
            }
        }
    }
#pragma GCC unroll 9
    for (int k = 0; k < 9; k++)
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            if (k >= tb) break;
            float *o = out + k * ldd + 16 * r;
            _mm512_storeu_ps(o, fresh ? a[r][k] : _mm512_add_ps(_mm512_loadu_ps(o), a[r][k]));
        }
}

/* d[0 .. 7] in both halves. */
T512 INLINE __m512 bcast8(const float *d) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)(const void *)d)));
}

/* *x0 in the low half, *x1 in the high. */
T512 INLINE __m512 bcast2(const float *x0, const float *x1) {
    __m512 b = _mm512_mask_broadcastss_ps(_mm512_set1_ps(*x0), 0xFF00, _mm_load_ss(x1));
    __asm__("" : "+v"(b));
    return b;
}

/* The 3x3 kernel for one vector of output channels, two positions a step: positions w and w + 1 of a row read
 * columns w .. w + 3 of the three padded rows, 12 broadcasts for the 18 products (each sum still takes w, then
 * w + 1). With two (at most 8 output channels, a low-rank adapter's rank): two input channels at once, lanes
 * 0 .. 7 the output channels of c (plane xc0, dwt rows out0), lanes 8 .. 15 those of c + 1 (xc1, out1), so no
 * lane is padding: each position's dp is its 8 channels in both halves, each x value c's broadcast with c + 1's
 * merged into the upper half. Each lane is still one weight's chain. */
T512 INLINE void dw512_k3_pairs(const ConvTaps *p, float *out0, float *out1, size_t ldd, const float *d,
                                const float *xc0, const float *xc1, bool fresh, const bool two) {
    __m512 a[9];
#pragma GCC unroll 9
    for (int k = 0; k < 9; k++) a[k] = _mm512_setzero_ps();
    const size_t pw = (size_t)p->pw;
    for (int h = 0; h < p->H; h++) {
        const float *r0[3] = {xc0 + (size_t)h * pw, xc0 + (size_t)(h + 1) * pw, xc0 + (size_t)(h + 2) * pw};
        const float *r1[3] = {xc1 + (size_t)h * pw, xc1 + (size_t)(h + 1) * pw, xc1 + (size_t)(h + 2) * pw};
        int w = 0;
        for (; w + 2 <= p->W; w += 2, d += 2 * ldd) {
            const __m512 d0 = two ? bcast8(d) : _mm512_loadu_ps(d);
            const __m512 d1 = two ? bcast8(d + ldd) : _mm512_loadu_ps(d + ldd);
#pragma GCC unroll 3
            for (int kh = 0; kh < 3; kh++) {
                const float *s0 = r0[kh] + w, *s1 = r1[kh] + w;
                __m512 b[4];
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) b[j] = two ? bcast2(s0 + j, s1 + j) : bcast512(s0 + j);
                a[3 * kh] = _mm512_fmadd_ps(d0, b[0], a[3 * kh]);
                a[3 * kh + 1] = _mm512_fmadd_ps(d0, b[1], a[3 * kh + 1]);
                a[3 * kh + 2] = _mm512_fmadd_ps(d0, b[2], a[3 * kh + 2]);
                a[3 * kh] = _mm512_fmadd_ps(d1, b[1], a[3 * kh]);
                a[3 * kh + 1] = _mm512_fmadd_ps(d1, b[2], a[3 * kh + 1]);
                a[3 * kh + 2] = _mm512_fmadd_ps(d1, b[3], a[3 * kh + 2]);
            }
        }
        if (w < p->W) { /* an odd row's last position */
            const __m512 d0 = two ? bcast8(d) : _mm512_loadu_ps(d);
#pragma GCC unroll 9
            for (int k = 0; k < 9; k++) {
                const float *s0 = r0[k / 3] + w + k % 3, *s1 = r1[k / 3] + w + k % 3;
                a[k] = _mm512_fmadd_ps(d0, two ? bcast2(s0, s1) : bcast512(s0), a[k]);
            }
            d += ldd;
        }
    }
#pragma GCC unroll 9
    for (int k = 0; k < 9; k++) {
        if (!two) {
            float *o = out0 + k * ldd;
            _mm512_storeu_ps(o, fresh ? a[k] : _mm512_add_ps(_mm512_loadu_ps(o), a[k]));
            continue;
        }
        float *o0 = out0 + k * ldd, *o1 = out1 + k * ldd - 8; /* o1's lanes 8 .. 15: c + 1's row */
        if (!fresh) a[k] = _mm512_add_ps(_mm512_mask_loadu_ps(_mm512_maskz_loadu_ps(0x00FF, o0), 0xFF00, o1), a[k]);
        _mm512_mask_storeu_ps(o0, 0x00FF, a[k]);
        _mm512_mask_storeu_ps(o1, 0xFF00, a[k]);
    }
}

T512 __attribute__((noinline)) static void dw512_k3_two(const ConvTaps *p, float *out0, float *out1, size_t ldd,
                                                        const float *d, const float *xc0, const float *xc1,
                                                        bool fresh) {
    dw512_k3_pairs(p, out0, out1, ldd, d, xc0, xc1, fresh, true);
}

/* Each shape its own function: 18 sums, 2 vectors of dp and a broadcast fill 21 of the 32 registers, which gcc 12
 * keeps there only in a function of its own. */
T512 __attribute__((noinline)) static void dw512_k3_r2(const ConvTaps *p, float *out, size_t ldd, const float *d,
                                                       const float *x, bool fresh) {
    dw512_block(p, out, ldd, d, x, fresh, 2, 0, 9, true);
}
T512 __attribute__((noinline)) static void dw512_k3_r1(const ConvTaps *p, float *out, size_t ldd, const float *d,
                                                       const float *x, bool fresh) {
    dw512_k3_pairs(p, out, out, ldd, d, x, x, fresh, false);
}
T512 __attribute__((noinline)) static void dw512_any_r2(const ConvTaps *p, float *out, size_t ldd, const float *d,
                                                        const float *x, bool fresh, int t0, int tb) {
    dw512_block(p, out, ldd, d, x, fresh, 2, t0, tb, false);
}
T512 __attribute__((noinline)) static void dw512_any_r1(const ConvTaps *p, float *out, size_t ldd, const float *d,
                                                        const float *x, bool fresh, int t0, int tb) {
    dw512_block(p, out, ldd, d, x, fresh, 1, t0, tb, false);
}

/* Image by image (its dpt and planes stay in cache while every block passes), then pairs of channel vectors, input
 * channels and groups of 9 taps; each block's sums go back to dwt after the image. */
T512 void conv_taps_dw_avx512(const ConvTaps *p, float *dwt, const float *dpt, const float *xp, int n, bool add) {
    const int KK = p->KH * p->KW, nv = (p->OC + 15) / 16;
    const bool k3 = p->KH == 3 && p->KW == 3;
    const size_t ldd = conv_taps_oc_pad(p->OC), plane = (size_t)p->H * p->W;
    for (int i = 0; i < n; i++)
        for (int o = 0; o < nv; o += 2)
            for (int c = 0; c < p->C; c++) {
                const float *d = dpt + (size_t)i * plane * ldd + 16 * (size_t)o;
                const float *x = xp + ((size_t)i * p->C + c) * p->pplane;
                const bool fresh = !add && i == 0, two = nv - o >= 2;
                if (k3 && p->OC <= 8 && c + 1 < p->C) { /* two input channels a vector */
                    dw512_k3_two(p, dwt + (size_t)c * KK * ldd, dwt + (size_t)(c + 1) * KK * ldd, ldd, d, x,
                                 x + p->pplane, fresh);
                    c++;
                    continue;
                }
                for (int t0 = 0; t0 < KK; t0 += 9) {
                    float *out = dwt + ((size_t)c * KK + t0) * ldd + 16 * (size_t)o;
                    const int tb = KK - t0 < 9 ? KK - t0 : 9;
                    if (k3 && two) dw512_k3_r2(p, out, ldd, d, x, fresh);
                    else if (k3) dw512_k3_r1(p, out, ldd, d, x, fresh);
                    else if (two) dw512_any_r2(p, out, ldd, d, x, fresh, t0, tb);
                    else dw512_any_r1(p, out, ldd, d, x, fresh, t0, tb);
                }
            }
}

/* Column k < nq of the 16 x 16 block whose row j is r[j] to dst + k ld: pairs, quads, then 128-bit lanes, each
 * column stored as it is made (fewer registers live than a block of results). */
T512 INLINE void transpose16_store(const __m512 r[16], float *dst, size_t ld, int nq) {
    __m512 t[16], u[16];
#pragma GCC unroll 8
    for (int k = 0; k < 16; k += 2)
        t[k] = _mm512_unpacklo_ps(r[k], r[k + 1]), t[k + 1] = _mm512_unpackhi_ps(r[k], r[k + 1]);
#pragma GCC unroll 4
    for (int k = 0; k < 16; k += 4) { /* u[k + j]: rows k .. k + 3 at column j of each 128-bit lane */
        u[k] = _mm512_shuffle_ps(t[k], t[k + 2], 0x44), u[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], 0xEE);
        u[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0x44), u[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
        const __m512 w0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
        if (j < nq) _mm512_storeu_ps(dst + (size_t)j * ld, _mm512_shuffle_f32x4(v0, w0, 0x88));
        if (4 + j < nq) _mm512_storeu_ps(dst + (size_t)(4 + j) * ld, _mm512_shuffle_f32x4(v0, w0, 0xDD));
        if (8 + j < nq) _mm512_storeu_ps(dst + (size_t)(8 + j) * ld, _mm512_shuffle_f32x4(v1, w1, 0x88));
        if (12 + j < nq) _mm512_storeu_ps(dst + (size_t)(12 + j) * ld, _mm512_shuffle_f32x4(v1, w1, 0xDD));
    }
}

/* Blocks of 16 channels by 16 positions: a row of dp per channel (past the last position zero-masked, past the
 * last channel zeros), transposed, a row of dpt per position. */
#define DP_T_AHEAD 64 /* floats: four cache lines */

T512 void conv_taps_dp_t_avx512(const ConvTaps *p, float *dpt, const float *dp, size_t ldp, size_t ldi, int rows,
                                int n) {
    const size_t plane = (size_t)p->H * p->W, ldd = conv_taps_oc_pad(rows);
    for (int i = 0; i < n; i++)
        for (size_t r0 = 0; r0 < ldd; r0 += 16)
            for (size_t q0 = 0; q0 < plane; q0 += 16) {
                const int nq = plane - q0 < 16 ? (int)(plane - q0) : 16;
                const __mmask16 m = (__mmask16)((1u << nq) - 1u);
                __m512 v[16];
#pragma GCC unroll 16
                for (int k = 0; k < 16; k++)
                    v[k] = r0 + k < (size_t)rows ? _mm512_maskz_loadu_ps(m, dp + (r0 + k) * ldp + i * ldi + q0)
                                                 : _mm512_setzero_ps();
                /* 16 rows read side by side, from memory (the output gradient a batch norm's backward just wrote
                 * across the whole batch): more streams than the prefetchers follow, so each row's line
                 * DP_T_AHEAD floats on is asked for */
                if (q0 + DP_T_AHEAD < plane)
                    for (int k = 0; k < 16 && r0 + k < (size_t)rows; k++)
                        _mm_prefetch((const char *)(dp + (r0 + k) * ldp + i * ldi + q0 + DP_T_AHEAD), _MM_HINT_T0);
                transpose16_store(v, dpt + ((size_t)i * plane + q0) * ldd + r0, ldd, nq);
            }
}

/* ---- AVX2 ------------------------------------------------------------------------------------------------------ */

T256 INLINE __m256 bcast256(const float *x) {
    __m256 b = _mm256_broadcast_ss(x);
    __asm__("" : "+x"(b));
    return b;
}

/* As dw512_block with one vector of 8 output channels: 9 sums, a vector of dp and a broadcast. */
T256 INLINE void dw256_block(const ConvTaps *p, float *out, size_t ldd, const float *d, const float *x, bool fresh,
                             int t0, int tb, const bool k3) {
    __m256 a[9];
#pragma GCC unroll 9
    for (int k = 0; k < 9; k++) a[k] = _mm256_setzero_ps();
    int off[9];
    for (int k = 0; k < 9; k++) off[k] = p->off[k < tb ? t0 + k : t0];
    const size_t pw = (size_t)p->pw;
    for (int h = 0; h < p->H; h++) {
        const float *x0 = x + (size_t)h * pw, *x1 = x0 + pw, *x2 = x1 + pw;
        for (int w = 0; w < p->W; w++, d += ldd) {
            const __m256 d0 = _mm256_loadu_ps(d);
#pragma GCC unroll 9
            for (int k = 0; k < 9; k++) {
                if (!k3 && k >= tb) break;
                a[k] = _mm256_fmadd_ps(d0, bcast256(k3 ? (k < 3 ? x0 : k < 6 ? x1 : x2) + w + k % 3 : x0 + w + off[k]),
                                       a[k]);
            }
        }
    }
#pragma GCC unroll 9
    for (int k = 0; k < 9; k++) {
        if (k >= tb) break;
        float *o = out + k * ldd;
        _mm256_storeu_ps(o, fresh ? a[k] : _mm256_add_ps(_mm256_loadu_ps(o), a[k]));
    }
}

T256 __attribute__((noinline)) static void dw256_k3(const ConvTaps *p, float *out, size_t ldd, const float *d,
                                                    const float *x, bool fresh) {
    dw256_block(p, out, ldd, d, x, fresh, 0, 9, true);
}
T256 __attribute__((noinline)) static void dw256_any(const ConvTaps *p, float *out, size_t ldd, const float *d,
                                                     const float *x, bool fresh, int t0, int tb) {
    dw256_block(p, out, ldd, d, x, fresh, t0, tb, false);
}

T256 void conv_taps_dw_avx2(const ConvTaps *p, float *dwt, const float *dpt, const float *xp, int n, bool add) {
    const int KK = p->KH * p->KW, nv = (p->OC + 7) / 8;
    const bool k3 = p->KH == 3 && p->KW == 3;
    const size_t ldd = conv_taps_oc_pad(p->OC), plane = (size_t)p->H * p->W;
    for (int i = 0; i < n; i++)
        for (int o = 0; o < nv; o++)
            for (int c = 0; c < p->C; c++) {
                const float *d = dpt + (size_t)i * plane * ldd + 8 * (size_t)o;
                const float *x = xp + ((size_t)i * p->C + c) * p->pplane;
                const bool fresh = !add && i == 0;
                for (int t0 = 0; t0 < KK; t0 += 9) {
                    float *out = dwt + ((size_t)c * KK + t0) * ldd + 8 * (size_t)o;
                    if (k3) dw256_k3(p, out, ldd, d, x, fresh);
                    else dw256_any(p, out, ldd, d, x, fresh, t0, KK - t0 < 9 ? KK - t0 : 9);
                }
            }
}

/* r[k] = column k of the 8 x 8 block whose row j is r[j]. */
T256 INLINE void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
#pragma GCC unroll 4
    for (int k = 0; k < 8; k += 2)
        t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]), t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
#pragma GCC unroll 2
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44), u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
        u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44), u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20), r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
}

T256 void conv_taps_dp_t_avx2(const ConvTaps *p, float *dpt, const float *dp, size_t ldp, size_t ldi, int rows,
                              int n) {
    const size_t plane = (size_t)p->H * p->W, ldd = conv_taps_oc_pad(rows);
    for (int i = 0; i < n; i++)
        for (size_t r0 = 0; r0 < ldd; r0 += 8)
            for (size_t q0 = 0; q0 < plane; q0 += 8) {
                const int nq = plane - q0 < 8 ? (int)(plane - q0) : 8;
                const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(nq), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                __m256 v[8];
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    if (r0 + k >= (size_t)rows) { /* padding: zeros, and no address past dp */
                        v[k] = _mm256_setzero_ps();
                        continue;
                    }
                    const float *s = dp + (r0 + k) * ldp + i * ldi + q0;
                    v[k] = nq == 8 ? _mm256_loadu_ps(s) : _mm256_maskload_ps(s, m);
                }
                transpose8(v);
                for (int k = 0; k < nq; k++) _mm256_storeu_ps(dpt + ((size_t)i * plane + q0 + k) * ldd + r0, v[k]);
            }
}

#else /* no x86 kernels: conv_taps_cpu reports CONV_TAPS_OFF, so these are never called */

void conv_taps_dw_avx512(const ConvTaps *p, float *dwt, const float *dpt, const float *xp, int n, bool add) {
    conv_taps_dw_ref(p, dwt, dpt, xp, n, add);
}
void conv_taps_dw_avx2(const ConvTaps *p, float *dwt, const float *dpt, const float *xp, int n, bool add) {
    conv_taps_dw_ref(p, dwt, dpt, xp, n, add);
}
void conv_taps_dp_t_avx512(const ConvTaps *p, float *dpt, const float *dp, size_t ldp, size_t ldi, int rows, int n) {
    conv_taps_dp_t_ref(p, dpt, dp, ldp, ldi, rows, n);
}
void conv_taps_dp_t_avx2(const ConvTaps *p, float *dpt, const float *dp, size_t ldp, size_t ldi, int rows, int n) {
    conv_taps_dp_t_ref(p, dpt, dp, ldp, ldi, rows, n);
}

#endif
