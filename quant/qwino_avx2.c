/* qwino_avx2.c - the int8 F(2x2, 3x3)'s AVX2 kernel (qwino.h): 8 tiles of a tile row in a vector's int32 lanes,
 * as nn/conv_wino_kern.h holds floats. Per image: the codes split into even and odd padded columns (int16); each
 * channel pair's input transforms (int16, exact, 16 tiles a vector: of one tile row, or of two where a row has at
 * most 8) interleaved into int16 pairs; per block of 4 output rows the 16 products (4 rows by 3 vectors of tiles,
 * vpmaddwd over the channel pairs), then the output transform and the exact division by 4. The same sums as
 * qwino_forward_ref, so the same bits. The passes stay out of line, each its own line in a profile. */
#include "qwino.h"

#include <string.h>

#include "nn/conv_wino.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)

#include <immintrin.h>

#define T256 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

/* 32 codes (int8, bytes of b in column order) -> their even columns at o and odd ones at e (int16, 16 each). */
T256 INLINE void qw_deal32(int16_t *o, int16_t *e, __m256i b) {
    /* per 128-bit lane the even bytes, then the odd ones; then the lanes' evens together, and their odds */
    const __m256i pick = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                          12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i d = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, pick), 0xd8);
    _mm256_storeu_si256((__m256i *)(void *)o, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(d)));
    _mm256_storeu_si256((__m256i *)(void *)e, _mm256_cvtepi8_epi16(_mm256_extracti128_si256(d, 1)));
}

/* The last split entry qw_input reads (E[jr], O[jr]): 8 where rows of at most 8 tiles go two a vector, else
 * the 16-tile vectors' reach. */
static int qw_reach(const QWino *p) { return p->TW <= 8 ? 8 : (p->TW + 15) / 16 * 16; }

/* Row pr of channel c's split plane: E[j] = x(pr - 1, 2j - 1) at s, O[j] = x(pr - 1, 2j) at s + ew, 0 outside, for
 * every j the input transform reads (j <= jn = qw_reach), as int16. A row's codes, 32 at a time (the bytes
 * past the row masked to 0; the last 32 bytes of the input through a copy, as it has no slack past its end),
 * dealt into even and odd columns and widened. */
T256 __attribute__((noinline)) static void qw_split(const QWino *p, int16_t *s, const int8_t *x) {
    static const int8_t ones[64] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                    -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    const int W = p->W, ew = p->ew, jn = qw_reach(p);
    const size_t n = (size_t)p->C * p->H * W; /* the input's bytes */
    int8_t tail[32] = {0};
    for (int c = 0; c < p->C; c++)
        for (int pr = 0; pr < 2 * p->TH + 2; pr++) {
            int16_t *e = s + (size_t)c * p->splane + (size_t)pr * 2 * ew, *o = e + ew;
            const int h = pr - 1;
            if (h < 0 || h >= p->H) {
                for (int j = 0; j <= jn; j += 16) {
                    _mm256_storeu_si256((__m256i *)(void *)(e + j), _mm256_setzero_si256());
                    _mm256_storeu_si256((__m256i *)(void *)(o + j), _mm256_setzero_si256());
                }
                continue;
            }
            const size_t at = ((size_t)c * p->H + h) * W;
            e[0] = 0;
            for (int k = 0; k < W; k += 32) { /* columns k .. k + 31: O[k / 2 ..], E[k / 2 + 1 ..] */
                __m256i b;
                if (at + k + 32 <= n) {
                    b = _mm256_loadu_si256((const __m256i *)(const void *)(x + at + k));
                } else {
                    memcpy(tail, x + at + k, n - at - k);
                    b = _mm256_loadu_si256((const __m256i *)(const void *)tail);
                }
                if (W - k < 32)
                    b = _mm256_and_si256(b, _mm256_loadu_si256((const __m256i *)(const void *)(ones + 32 - (W - k))));
                qw_deal32(o + k / 2, e + k / 2 + 1, b);
            }
            o[jn] = 0;
        }
}

/* The 8 dwords of a ch4 row from column c0 (the row's c0 .. c0 + 7), those outside [0, cols) the zero point's. */
T256 INLINE __m256i qw_ch4_8(const uint32_t *row, int c0, int cols, __m256i zp4) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(-c0), lane),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - c0), lane));
    /* the address by integers: c0 may be -1 (its lane masked off, never read) */
    const int *at = (const int *)(uintptr_t)((uintptr_t)row + (uintptr_t)(intptr_t)c0 * sizeof *row);
    return _mm256_or_si256(_mm256_maskload_epi32(at, in), _mm256_andnot_si256(in, zp4));
}

/* qw_split from PTQ's ch4 codes (qwino.h), a channel quad at a time: padded column k of padded row pr is byte
 * c % 4 of the quad's dword there minus the zero point (the zero point's outside the planes), 32 columns at a
 * time up to qw_reach, each quad's 32 dwords read once: their bytes dealt by channel and column parity (a byte
 * shuffle groups each 4 columns' bytes by channel and parity, an 8 x 8 transpose of their 16-bit pairs gathers
 * each channel's 16 even and 16 odd columns), widened, the zero point subtracted. */
T256 __attribute__((noinline)) static void qw_split_ch4(const QWino *p, int16_t *s, const QWinoCh4 *a) {
    const int ew = p->ew, n = 2 * qw_reach(p) + 2;                     /* n: the padded columns made */
    const int o = a->origin, rows = p->H + 2 - 2 * o, cols = p->W + 2 - 2 * o; /* the planes' image */
    const __m256i zp4 = _mm256_set1_epi32((int)((uint32_t)a->zero * 0x01010101u));
    const __m256i zero = _mm256_set1_epi16((short)a->zero);
    /* per 128-bit lane (4 columns of 4 bytes): pairs of the even columns' bytes of channels 0 .. 3, then the odd */
    const __m256i deal = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3,
                                          11, 4, 12, 5, 13, 6, 14, 7, 15);
    for (int g = 0; 4 * g < p->C; g++) {
        const int nch = p->C - 4 * g < 4 ? p->C - 4 * g : 4;
        for (int pr = 0; pr < 2 * p->TH + 2; pr++) {
            int16_t *e[4], *od[4];
            for (int c = 0; c < nch; c++)
                e[c] = s + (size_t)(4 * g + c) * p->splane + (size_t)pr * 2 * ew, od[c] = e[c] + ew;
            const int sr = pr - o;
            if (sr < 0 || sr >= rows) {
                for (int c = 0; c < nch; c++)
                    for (int k = 0; k < n; k += 32) {
                        _mm256_storeu_si256((__m256i *)(void *)(e[c] + k / 2), _mm256_setzero_si256());
                        _mm256_storeu_si256((__m256i *)(void *)(od[c] + k / 2), _mm256_setzero_si256());
                    }
                continue;
            }
            const uint32_t *row = a->planes + (size_t)g * a->plane + (size_t)sr * a->Wp;
            for (int k = 0; k < n; k += 32) {
                if (k - o >= cols) { /* no column inside: zero points, 0 once subtracted */
                    for (int c = 0; c < nch; c++) {
                        _mm256_storeu_si256((__m256i *)(void *)(e[c] + k / 2), _mm256_setzero_si256());
                        _mm256_storeu_si256((__m256i *)(void *)(od[c] + k / 2), _mm256_setzero_si256());
                    }
                    continue;
                }
                __m256i l[4];
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) l[h] = qw_ch4_8(row, k + 8 * h - o, cols, zp4);
                /* 128-bit lanes of 4 columns, lane i of the 8 in the low halves' then the high halves' order */
                const __m256i v0 = _mm256_shuffle_epi8(_mm256_permute2x128_si256(l[0], l[2], 0x20), deal);
                const __m256i v1 = _mm256_shuffle_epi8(_mm256_permute2x128_si256(l[0], l[2], 0x31), deal);
                const __m256i v2 = _mm256_shuffle_epi8(_mm256_permute2x128_si256(l[1], l[3], 0x20), deal);
                const __m256i v3 = _mm256_shuffle_epi8(_mm256_permute2x128_si256(l[1], l[3], 0x31), deal);
                const __m256i a0 = _mm256_unpacklo_epi16(v0, v1), a1 = _mm256_unpackhi_epi16(v0, v1);
                const __m256i a2 = _mm256_unpacklo_epi16(v2, v3), a3 = _mm256_unpackhi_epi16(v2, v3);
                /* w[q]: pair q (channel q % 4, even for q < 4) of the 8 lanes, low lanes' then high lanes' */
                const __m256i w[4] = {_mm256_permute4x64_epi64(_mm256_unpacklo_epi32(a0, a2), 0xd8),
                                      _mm256_permute4x64_epi64(_mm256_unpackhi_epi32(a0, a2), 0xd8),
                                      _mm256_permute4x64_epi64(_mm256_unpacklo_epi32(a1, a3), 0xd8),
                                      _mm256_permute4x64_epi64(_mm256_unpackhi_epi32(a1, a3), 0xd8)};
                for (int c = 0; c < nch; c++) {
                    const __m256i we = w[c / 2], wo = w[2 + c / 2];
                    const __m128i be = c % 2 ? _mm256_extracti128_si256(we, 1) : _mm256_castsi256_si128(we);
                    const __m128i bo = c % 2 ? _mm256_extracti128_si256(wo, 1) : _mm256_castsi256_si128(wo);
                    _mm256_storeu_si256((__m256i *)(void *)(e[c] + k / 2),
                                        _mm256_sub_epi16(_mm256_cvtepu8_epi16(be), zero));
                    _mm256_storeu_si256((__m256i *)(void *)(od[c] + k / 2),
                                        _mm256_sub_epi16(_mm256_cvtepu8_epi16(bo), zero));
                }
            }
        }
    }
}

/* 16 int16 at e: from one row, or (two) 8 from e and 8 from e2. */
T256 INLINE __m256i qw_load16(const int16_t *e, const int16_t *e2, const bool two) {
    if (!two) return _mm256_loadu_si256((const __m256i *)(const void *)e);
    return _mm256_loadu2_m128i((const __m128i *)(const void *)e2, (const __m128i *)(const void *)e);
}

/* v[16] = the input transform of 16 tiles of the split plane sc: int16, exact (|v| <= 1020). Tiles (i, j ..
 * j + 15), or (two, for rows of at most 8 tiles) (i, j .. j + 7) in the low 128 bits and (i2, j .. j + 7) in the
 * high ones. */
T256 INLINE void qw_tiles(__m256i v[16], const QWino *p, const int16_t *sc, int i, int i2, int j, const bool two) {
    const size_t ew = (size_t)p->ew;
    const int16_t *r0 = sc + (size_t)(2 * i) * 2 * ew + j, *r2 = sc + (size_t)(2 * i2) * 2 * ew + j;
    __m256i h[4][4];
#pragma GCC unroll 4
    for (int a = 0; a < 4; a++) {
        const int16_t *e = r0 + a * 2 * ew, *o = e + ew, *e2 = r2 + a * 2 * ew, *o2 = e2 + ew;
        const __m256i e0 = qw_load16(e, e2, two), e1 = qw_load16(e + 1, e2 + 1, two);
        const __m256i o0 = qw_load16(o, o2, two), o1 = qw_load16(o + 1, o2 + 1, two);
        h[a][0] = _mm256_sub_epi16(e0, e1), h[a][1] = _mm256_add_epi16(o0, e1);
        h[a][2] = _mm256_sub_epi16(e1, o0), h[a][3] = _mm256_sub_epi16(o0, o1);
    }
#pragma GCC unroll 4
    for (int b = 0; b < 4; b++) {
        v[0 + b] = _mm256_sub_epi16(h[0][b], h[2][b]), v[4 + b] = _mm256_add_epi16(h[1][b], h[2][b]);
        v[8 + b] = _mm256_sub_epi16(h[2][b], h[1][b]), v[12 + b] = _mm256_sub_epi16(h[1][b], h[3][b]);
    }
}

/* The 16 tiles at (i, j) (two: rows i and i2 from j) of channel pair k's planes s0, s1 (second: s1 exists, else
 * zeros) as int16 pairs (low, high) at dst (two: row i's 8 at dst, row i2's at dst2, that order): the first
 * channel's kept on the stack while the second's are made, then each position's two vectors interleaved (one
 * row: their 64-bit quarters ordered 0 2 1 3 first, so the unpacks leave the tiles in order; two rows: the
 * unpacks' 128-bit halves regrouped by row). */
T256 INLINE void qw_pair16(int32_t *dst, int32_t *dst2, size_t ldp, const QWino *p, const int16_t *s0,
                           const int16_t *s1, bool second, int i, int i2, int j, const bool two) {
    _Alignas(32) int16_t lo[16][16];
    __m256i v[16];
    qw_tiles(v, p, s0, i, i2, j, two);
    for (int q = 0; q < 16; q++) _mm256_store_si256((__m256i *)(void *)lo[q], v[q]);
    if (second) qw_tiles(v, p, s1, i, i2, j, two);
    for (int q = 0; q < 16; q++) {
        __m256i x0 = _mm256_load_si256((const __m256i *)(void *)lo[q]), x1 = second ? v[q] : _mm256_setzero_si256();
        if (!two) x0 = _mm256_permute4x64_epi64(x0, 0xd8), x1 = _mm256_permute4x64_epi64(x1, 0xd8);
        const __m256i l = _mm256_unpacklo_epi16(x0, x1), h = _mm256_unpackhi_epi16(x0, x1);
        if (!two) {
            _mm256_storeu_si256((__m256i *)(void *)(dst + q * ldp), l);
            _mm256_storeu_si256((__m256i *)(void *)(dst + q * ldp + 8), h);
        } else {
            _mm256_storeu_si256((__m256i *)(void *)(dst + q * ldp), _mm256_permute2x128_si256(l, h, 0x20));
            _mm256_storeu_si256((__m256i *)(void *)(dst2 + q * ldp), _mm256_permute2x128_si256(l, h, 0x31));
        }
    }
}

/* Channel pair k's input transforms (channels 2k, and 2k + 1 or zeros) as int16 pairs (low, high) into
 * vp [16][ceil(C / 2)][ldv] (tile t at t; lanes past a row: the next row's, written after; past T: 0): 16 tiles
 * of a row at a time, or of two rows where a row has at most 8 (the last of an odd count twice, stored once). */
T256 __attribute__((noinline)) static void qw_input(const QWino *p, int32_t *vp, size_t ldp, const int16_t *s, int k) {
    const int16_t *s0 = s + (size_t)(2 * k) * p->splane, *s1 = s0 + p->splane;
    const bool second = 2 * k + 1 < p->C;
    int32_t *vk = vp + (size_t)k * p->ldv;
    if (p->TW <= 8) {
        for (int i = 0; i < p->TH; i += 2) {
            const int i2 = i + 1 < p->TH ? i + 1 : i;
            qw_pair16(vk + (size_t)i * p->TW, vk + (size_t)i2 * p->TW, ldp, p, s0, s1, second, i, i2, 0, true);
        }
    } else {
        for (int i = 0; i < p->TH; i++)
            for (int j = 0; j < p->TW; j += 16)
                qw_pair16(vk + (size_t)i * p->TW + j, NULL, ldp, p, s0, s1, second, i, i, j, false);
    }
    for (int q = 0; q < 16; q++)
        for (int t = p->T; t < p->tv * 8; t++) vk[q * ldp + t] = 0;
}

/* m (4 rows ldv apart) tiles t0 .. t0 + NV - 1 vectors: the chains over the np pairs of vq (pairs ldv apart)
 * times the block's broadcast weight pairs wq [np][4]. */
T256 INLINE void qw_gemm_tile(int32_t *m, size_t ldv, const int32_t *vq, const int32_t *wq, int np, int t0,
                              const int NV) {
    __m256i acc[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++) acc[r][n] = _mm256_setzero_si256();
    const int32_t *vt = vq + (size_t)t0 * 8;
    for (int k = 0; k < np; k++, vt += ldv, wq += 4) {
        __m256i b[3];
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++)
            b[n] = n < NV ? _mm256_loadu_si256((const __m256i *)(vt + n * 8)) : _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m256i a = _mm256_set1_epi32(wq[r]);
#pragma GCC unroll 3
            for (int n = 0; n < 3; n++)
                if (n < NV) acc[r][n] = _mm256_add_epi32(acc[r][n], _mm256_madd_epi16(a, b[n]));
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++)
            if (n < NV) _mm256_storeu_si256((__m256i *)(m + (size_t)r * ldv + (size_t)(t0 + n) * 8), acc[r][n]);
}

/* y[a][b] = the sums of output (2i + a, 2j + b) of 8 tiles from their products mt (positions ldm apart): the
 * output transform, then the exact division by 4. */
T256 INLINE void qw_tile_sums(__m256i y[2][2], const int32_t *mt, size_t ldm) {
    __m256i s0[4], s1[4];
#pragma GCC unroll 4
    for (int b = 0; b < 4; b++) {
        const __m256i m0 = _mm256_loadu_si256((const __m256i *)(mt + (0 + b) * ldm));
        const __m256i m1 = _mm256_loadu_si256((const __m256i *)(mt + (4 + b) * ldm));
        const __m256i m2 = _mm256_loadu_si256((const __m256i *)(mt + (8 + b) * ldm));
        const __m256i m3 = _mm256_loadu_si256((const __m256i *)(mt + (12 + b) * ldm));
        s0[b] = _mm256_add_epi32(_mm256_add_epi32(m0, m1), m2);
        s1[b] = _mm256_sub_epi32(_mm256_sub_epi32(m1, m2), m3);
    }
#pragma GCC unroll 2
    for (int a = 0; a < 2; a++) {
        const __m256i *s = a ? s1 : s0;
        y[a][0] = _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), s[2]), 2);
        y[a][1] = _mm256_srai_epi32(_mm256_sub_epi32(_mm256_sub_epi32(s[1], s[2]), s[3]), 2);
    }
}

/* The output transform of rows [0, rows) of m (positions ldm apart) into acc, divided by 4. */
T256 __attribute__((noinline)) static void qw_output(const QWino *p, int32_t *acc, size_t ldc, const int32_t *m,
                                                     size_t ldm, int rows) {
    const int W = p->W;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < p->TH; i++)
            for (int j = 0; j < p->TW; j += 8) {
                __m256i y[2][2];
                qw_tile_sums(y, m + (size_t)r * p->ldv + (size_t)i * p->TW + j, ldm);
                const int cols = W - 2 * j;
                for (int a = 0; a < 2; a++) {
                    if (2 * i + a >= p->H) break;
                    const __m256i l = _mm256_unpacklo_epi32(y[a][0], y[a][1]);
                    const __m256i h = _mm256_unpackhi_epi32(y[a][0], y[a][1]);
                    const __m256i lo = _mm256_permute2x128_si256(l, h, 0x20);
                    const __m256i hi = _mm256_permute2x128_si256(l, h, 0x31);
                    int32_t *o = acc + (size_t)r * ldc + (size_t)(2 * i + a) * W + 2 * j;
                    if (cols >= 8) _mm256_storeu_si256((__m256i *)o, lo);
                    else _mm256_maskstore_epi32(o, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane), lo);
                    if (cols >= 16) _mm256_storeu_si256((__m256i *)(o + 8), hi);
                    else if (cols > 8)
                        _mm256_maskstore_epi32(o + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane), hi);
                }
            }
}

/* The output transform of rows [0, rows) of m (positions ldm apart, row r0 of the layer first) as PTQ's floats
 * (qwino.h: QWinoFloats). */
T256 __attribute__((noinline)) static void qw_output_f(const QWino *p, const QWinoFloats *f, int r0,
                                                       const int32_t *m, size_t ldm, int rows) {
    const int W = p->W, PH = p->H / 2, PW = p->W / 2;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < rows; r++) {
        const __m256 sc = _mm256_set1_ps(f->scale[r0 + r]), bi = _mm256_set1_ps(f->bias ? f->bias[r0 + r] : 0.0f);
        float *out = f->out + (size_t)(r0 + r) * f->ldo;
        for (int i = 0; i < p->TH; i++) {
            if (f->pool && i >= PH) break;
            for (int j = 0; j < p->TW; j += 8) {
                __m256i sum[2][2];
                qw_tile_sums(sum, m + (size_t)r * p->ldv + (size_t)i * p->TW + j, ldm);
                __m256 y[2][2]; /* [tile row][column parity], 8 tiles */
                for (int a = 0; a < 2; a++) {
                    y[a][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[a][0]), sc, bi);
                    y[a][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[a][1]), sc, bi);
                    if (f->relu) /* max(y, 0): 0 unless y > 0, a NaN included, as nn's relu */
                        y[a][0] = _mm256_max_ps(y[a][0], _mm256_setzero_ps()),
                        y[a][1] = _mm256_max_ps(y[a][1], _mm256_setzero_ps());
                }
                if (f->pool) { /* tile (i, j) is window (i, j): >= +0 and never NaN, so any order of the maxima */
                    if (j >= PW) continue;
                    const __m256 w = _mm256_max_ps(_mm256_max_ps(y[0][0], y[0][1]), _mm256_max_ps(y[1][0], y[1][1]));
                    float *o = out + (size_t)i * PW + j;
                    if (PW - j >= 8) _mm256_storeu_ps(o, w);
                    else _mm256_maskstore_ps(o, _mm256_cmpgt_epi32(_mm256_set1_epi32(PW - j), lane), w);
                    continue;
                }
                const int cols = W - 2 * j;
                for (int a = 0; a < 2; a++) {
                    if (2 * i + a >= p->H) break;
                    const __m256 l = _mm256_unpacklo_ps(y[a][0], y[a][1]), h = _mm256_unpackhi_ps(y[a][0], y[a][1]);
                    const __m256 lo = _mm256_permute2f128_ps(l, h, 0x20), hi = _mm256_permute2f128_ps(l, h, 0x31);
                    float *o = out + (size_t)(2 * i + a) * W + 2 * j;
                    if (cols >= 8) _mm256_storeu_ps(o, lo);
                    else _mm256_maskstore_ps(o, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane), lo);
                    if (cols >= 16) _mm256_storeu_ps(o + 8, hi);
                    else if (cols > 8)
                        _mm256_maskstore_ps(o + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane), hi);
                }
            }
        }
    }
}

/* After a split into s: the transforms, the products and the output transform into acc (QT) or f (PTQ). */
T256 static void qw_core(const QWino *p, int16_t *s, const int32_t *wp, int out, int32_t *acc, size_t ldc,
                         const QWinoFloats *f) {
    const int np = (p->C + 1) / 2;
    const size_t ldp = conv_wino_stride((size_t)np * p->ldv), ldm = conv_wino_stride(4 * p->ldv);
    int32_t *vp = (int32_t *)(void *)(s + ((size_t)p->C * p->splane + 1) / 2 * 2), *m = vp + 16 * ldp;
    for (int q = 0; q < 16; q++) /* lanes past the products' vectors, read by the last output vectors */
        for (int r = 0; r < 4; r++)
            _mm256_storeu_si256((__m256i *)(m + q * ldm + (size_t)r * p->ldv + p->tv * 8), _mm256_setzero_si256());
    for (int k = 0; k < np; k++) qw_input(p, vp, ldp, s, k);
    const int blocks = (out + 3) / 4;
    const size_t per_q = (size_t)blocks * np * 4;
    for (int b = 0; b < blocks; b++) {
        for (int q = 0; q < 16; q++) {
            const int32_t *wq = wp + q * per_q + (size_t)b * np * 4, *vq = vp + q * ldp;
            int32_t *mq = m + q * ldm;
            for (int t = 0; t < p->tv;) { /* tiles of 3 vectors; 4 left as 2 + 2, not 3 + 1 (one vector's 4 chains
                                           * wait on vpmaddwd's latency) */
                const int left = p->tv - t;
                if (left == 4 || left == 2) qw_gemm_tile(mq, p->ldv, vq, wq, np, t, 2), t += 2;
                else if (left == 1) qw_gemm_tile(mq, p->ldv, vq, wq, np, t, 1), t += 1;
                else qw_gemm_tile(mq, p->ldv, vq, wq, np, t, 3), t += 3;
            }
        }
        const int rb = out - 4 * b < 4 ? out - 4 * b : 4;
        if (f) qw_output_f(p, f, 4 * b, m, ldm, rb);
        else qw_output(p, acc + (size_t)b * 4 * ldc, ldc, m, ldm, rb);
    }
}

T256 void qwino_forward_avx2(const QWino *p, int32_t *acc, size_t ldc, const int8_t *x, const int32_t *wp, int out,
                             void *scratch) {
    qw_split(p, scratch, x);
    qw_core(p, scratch, wp, out, acc, ldc, NULL);
}

T256 void qwino_floats_avx2(const QWino *p, const QWinoFloats *f, const QWinoCh4 *a, const int32_t *wp, int out,
                            void *scratch) {
    qw_split_ch4(p, scratch, a);
    qw_core(p, scratch, wp, out, NULL, 0, f);
}

#else

void qwino_floats_avx2(const QWino *p, const QWinoFloats *f, const QWinoCh4 *a, const int32_t *wp, int out,
                       void *scratch) {
    (void)scratch;
    qwino_floats_ref(p, f, a, wp, out);
}

void qwino_forward_avx2(const QWino *p, int32_t *acc, size_t ldc, const int8_t *x, const int32_t *wp, int out,
                        void *scratch) {
    (void)scratch;
    qwino_forward_ref(p, acc, ldc, x, wp, out);
}

#endif
