/* qwino.h - the int8 3x3 "same" stride-1 convolution as F(2x2, 3x3) in integers: the exact sums of code products
 * that QT's forward (quant/fqt.c) takes from qgemm_s8_nn and PTQ's int8 conv (quant/qlayer_int8_conv.c) from the
 * taps kernel, with 2.25x fewer multiply-adds. For the AVX2 family
 * (no VNNI), whose int8 products are vpmaddwd's 16 a instruction either way; VNNI's vpdpbusd takes 64 direct
 * products an instruction, which F(2x2, 3x3) on 16-bit operands (vpdpwssd, 32) does not beat.
 *
 * Integers make it exact. With d a 4x4 window of codes (|d| <= 128) and g a 3x3 kernel of codes (|g| <= 128):
 * - v = B^T d B sums 4 codes with signs: |v| <= 512, an int16;
 * - u = (2G) g (2G)^T, 2G = [2 0 0; 1 1 1; 1 -1 1; 0 0 2], sums 9 codes with weights of at most 3 x 3: |u| <= 1152,
 *   an int16; u is 4 times Winograd's G g G^T, so no halves;
 * - m[p] = the sum over channels of u[p] v[p]: vpmaddwd takes channel pairs (int16 pairs in int32 lanes);
 *   |m| <= C 589824;
 * - y4 = A^T m A sums 9 m with signs: |y4| <= 9 C 589824 < 2^31 for C <= QWINO_C_MAX; y4 is 4 times the direct
 *   sum (the transforms' identity holds over the integers), so y = y4 / 4 exactly: the bits of qgemm_s8_nn.
 * The transforms are those of nn/conv_wino.h (input: h0 = d0 - d2, h1 = d1 + d2, h2 = d2 - d1, h3 = d1 - d3
 * along rows, then columns; output: s0 = m0 + m1 + m2, s1 = m1 - m2 - m3 down columns, then along rows). */
#ifndef QTRAIN_QUANT_QWINO_H
#define QTRAIN_QUANT_QWINO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define QWINO_C_MAX 404 /* 9 C 512 1152 < 2^31 */


typedef struct {
    int C, H, W;    /* input channels, plane (in = out) */
    int TH, TW, T;  /* tile rows, tile columns, tiles */
    int tv;         /* vectors of 8 tiles: ceil(T / 8) */
    size_t ldv;     /* int32 between two pairs' transformed inputs: (tv + 2) 8, room for 16 tiles from any row */
    int ew;         /* int16 of a split row's even (or odd) half: (TW + 1) rounded up to 16, + 16 */
    size_t splane;  /* int16 of one channel's split padded plane: (2 TH + 2) rows of 2 ew */
} QWino;

/* Whether QT's conv of this geometry takes it: 3x3, stride 1, padding 1, 8 <= C <= QWINO_C_MAX, at least 4
 * output channels, the AVX2 family running (qgemm_isa), and conv_wino_enabled (QTRAIN_CONV_WINOGRAD). */
bool qwino_fits(int C, int out, int KH, int KW, int stride, int padding);
void qwino_plan(QWino *p, int C, int H, int W);

/* int32 of packed weights for out rows: [16][ceil(out / 4)][ceil(C / 2)][4], each an int16 pair of u. */
size_t qwino_packed_words(const QWino *p, int out);
/* The weights w (out, C 9) codes, row-major (c, kh, kw) as qgemm_s8_nn's a. */
void qwino_pack(const QWino *p, int32_t *dst, const int8_t *w, int out);

/* Bytes of qwino_forward's scratch. */
size_t qwino_scratch_bytes(const QWino *p);
/* acc (out, H W), row stride ldc, = the convolution's sums of x (C, H, W) codes with the packed weights: what
 * qgemm_s8_nn writes for w times the image's X^T. */
void qwino_forward(const QWino *p, int32_t *acc, size_t ldc, const int8_t *x, const int32_t *wp, int out,
                   void *scratch);
/* PTQ's int8 conv (quant/qlayer_int8_conv.c): uint8 codes with a zero point, so the sums are over code - zero in
 * [-255, 255]: |v| <= 1020 (still an int16), and 9 C 1020 1152 < 2^31 for C <= QWINO_U8_C_MAX. */
#define QWINO_U8_C_MAX 203

/* The codes as PTQ's taps kernels read them: groups of 4 channels a dword (byte c % 4 of group c / 4), each group
 * a plane of `plane` dwords holding the image padded by 1 (zero points around it; origin 0) or as it is (origin 1:
 * a producer's hand-off, the zero point taken around it) with rows Wp dwords apart. */
typedef struct {
    const uint32_t *planes;
    size_t plane;
    int Wp, zero;
    int origin; /* 0: padded; 1: unpadded */
} QWinoCh4;

/* The float outputs PTQ's taps kernels make of the sums: y = fmaf((float)sum, scale[r], bias ? bias[r] : 0),
 * relu'd (max(y, 0): 0 for a NaN) if relu; out (out, ldo) (h W + w), or with pool the 2x2 maxima of the relu'd
 * outputs (i (W / 2) + j for i < H / 2, j < W / 2: a tile is a window). */
typedef struct {
    float *out;
    size_t ldo;
    const float *scale, *bias;
    bool relu, pool;
} QWinoFloats;

/* Whether PTQ's conv of this geometry takes it: as qwino_fits, with C <= QWINO_U8_C_MAX. */
bool qwino_u8_fits(int C, int out, int KH, int KW, int stride, int padding);
/* f's outputs of the conv of the ch4 codes a (their zero point subtracted) with the packed weights. */
void qwino_floats(const QWino *p, const QWinoFloats *f, const QWinoCh4 *a, const int32_t *wp, int out,
                  void *scratch);
void qwino_floats_ref(const QWino *p, const QWinoFloats *f, const QWinoCh4 *a, const int32_t *wp, int out);
void qwino_floats_avx2(const QWino *p, const QWinoFloats *f, const QWinoCh4 *a, const int32_t *wp, int out,
                       void *scratch);

/* Calls of qwino_forward and of qwino_floats so far (tests: that a path took it). */
extern unsigned long qwino_forward_calls, qwino_floats_calls;
/* The definition, tile by tile in scalar integers. */
void qwino_forward_ref(const QWino *p, int32_t *acc, size_t ldc, const int8_t *x, const int32_t *wp, int out);
/* qwino_avx2.c: the AVX2 kernel (the portable definition where there is none). */
void qwino_forward_avx2(const QWino *p, int32_t *acc, size_t ldc, const int8_t *x, const int32_t *wp, int out,
                        void *scratch);

#endif
