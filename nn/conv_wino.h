/* conv_wino.h - the 3x3 "same" stride-1 convolution as Winograd's F(2x2, 3x3): each 2x2 block of outputs (a tile)
 * comes from a 4x4 window of the padded input and the 3x3 kernel through 16 products where the direct form takes
 * 36, so a channel pair costs 16 multiply-adds per tile instead of 36 (2.25x fewer). The transforms between
 * (additions only) cost about a tenth of that at 16 channels and less at more; the products are 16 small GEMMs,
 * one per window position, over the image's tiles (Lavin and Gray, "Fast algorithms for convolutional neural
 * networks", 2016).
 *
 * Geometry: x (channels, H, W), a plane every ldx floats; y (rows, H, W) with row stride ldy; padding 1. Tiles:
 * TH = ceil(H / 2) by TW = ceil(W / 2), tile (i, j) writing outputs (2i + a, 2j + b) that lie inside the plane.
 *
 * Arithmetic (every kernel, every ISA, the same bits for finite inputs; conv_wino_forward_ref is the definition):
 * - weights (conv_wino_pack): u = G g G^T for each 3x3 kernel g, G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1]: first
 *   the columns, t[0] = g[0], t[1] = ((g[0] + g[1]) + g[2]) * .5, t[2] = ((g[0] - g[1]) + g[2]) * .5, t[3] = g[2]
 *   (each of g's three columns), then the same along each of t's four rows.
 * - input: d the window d[a][b] = x(2i - 1 + a, 2j - 1 + b), 0 outside the plane; along each row
 *   h0 = d0 - d2, h1 = d1 + d2, h2 = d2 - d1, h3 = d1 - d3, then the same down each column of h: v[a][b], which
 *   is position p = 4a + b.
 * - products: m[p][r] = the fmaf chain over the channels c = 0 .. channels - 1, from 0, of u[p][r][c] v[p][c].
 * - output: down each column, s0 = (m0 + m1) + m2, s1 = (m1 - m2) - m3; along each of s0, s1:
 *   o0 = (s0 + s1) + s2, o1 = (s1 - s2) - s3; written y = o + 0.0f, or y + o if add.
 * The sums differ from the direct form's (conv_taps.h) in rounding, a few ulps of the largest product.
 *
 * The vector kernels hold `lanes` tiles of a tile row in a vector: the input is first copied to planes of its
 * even and odd padded columns (E[j] = x(., 2j - 1), O[j] = x(., 2j)), so a window's columns 0 .. 3 are E[j], O[j],
 * E[j + 1], O[j + 1]: plain loads. */
#ifndef QTRAIN_NN_CONV_WINO_H
#define QTRAIN_NN_CONV_WINO_H

#include <stdbool.h>
#include <stddef.h>

#include "conv_taps.h"

typedef struct {
    int H, W;       /* the planes' size (in = out) */
    int TH, TW, T;  /* tile rows, tile columns, tiles */
    int lanes, rb;  /* vector width in floats (16 at AVX-512, else 8); output rows per weight block (8, 4) */
    int tv;         /* vectors of tiles: ceil(T / lanes) */
    size_t ldv;     /* floats between two channels' transformed inputs: tv lanes + lanes */
    int ew;         /* floats of a split row's even (or odd) half: (TW + 1) rounded up to lanes, + lanes */
    size_t splane;  /* floats of one channel's split padded plane: (2 TH + 2) rows of 2 ew */
    size_t ldm;     /* floats between two positions' products: conv_wino_stride(rb ldv) */
} ConvWino;

/* A stride between the 16 positions' arrays for n floats each: n rounded up to 4 KiB, plus 320 bytes, so the
 * positions' vectors, stored and loaded together, do not fall on the same 4 KiB offset (which makes a load wait
 * for an unrelated store). */
size_t conv_wino_stride(size_t n);

/* Whether F(2x2, 3x3) may run (default true; tests, and QTRAIN_CONV_WINOGRAD through conv_wino_select). */
extern bool conv_wino_enabled;
/* Sets conv_wino_enabled from a value (what: where it came from, for the message): on, off, or auto / NULL / ""
 * (on); another value is a QT_ERR_CONFIG error. */
QtStatus conv_wino_select(const char *value, const char *what, QtError *err);

/* Whether the convolution runs as F(2x2, 3x3) at level: enabled, a 3x3 kernel at stride 1 with padding 1, a
 * vector level, and enough channels that the products outweigh the transforms (channels and rows at least 8). */
bool conv_wino_fits(ConvTapsLevel level, int KH, int KW, int stride, int padding, int channels, int rows);
void conv_wino_plan(ConvWino *p, ConvTapsLevel level, int H, int W);

/* Floats of packed (transformed) weights for rows x channels kernels: [16][blocks of rb rows][channels][rb]. */
size_t conv_wino_packed_floats(const ConvWino *p, int rows, int channels);
/* The forward's weights: w (rows, ldw), row r's first channels * 9 floats (c, kh, kw). */
void conv_wino_pack(const ConvWino *p, float *dst, const float *w, int ldw, int rows, int channels);
/* The input gradient's: rows c (the input channels, C), channels oc (OC), the kernel flipped: g[kh][kw] =
 * w[oc][c][2 - kh][2 - kw]. */
void conv_wino_pack_t(const ConvWino *p, float *dst, const float *w, int ldw, int C, int OC);

/* Floats of conv_wino_forward's scratch for channels inputs and rows outputs. */
size_t conv_wino_scratch_floats(const ConvWino *p, int channels);
/* y (rows, H W, row stride ldy) = (add: +=) the convolution of x (channels planes of H W, ldx apart) with the
 * packed weights wp. scratch: conv_wino_scratch_floats floats. */
void conv_wino_forward(const ConvWino *p, ConvTapsLevel level, float *y, size_t ldy, const float *x, size_t ldx,
                       const float *wp, int rows, int channels, bool add, float *scratch);
void conv_wino_forward_ref(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                           int rows, int channels, bool add);
/* conv_wino_forward of the same x with other weights (a low-rank term's A: A x beside the conv's output), the
 * vector kernels reusing x's transform, which the last conv_wino_forward on this scratch with as many channels left
 * there (the definition computes it again). */
void conv_wino_forward_again(const ConvWino *p, ConvTapsLevel level, float *y, size_t ldy, const float *x,
                             size_t ldx, const float *wp, int rows, int channels, bool add, float *scratch);

/* The weight gradient of one image, the same tiles the other way: with v its input's transform as above and dm
 * the transform of each tile's 2x2 output gradient d (0 outside the plane), down each column r0 = d0,
 * r1 = d0 + d1, r2 = d0 - d1, r3 = -d1, then the same along each of r's four rows (position p = 4a + b):
 * - du[p][c][oc] = the fmaf chain over the tiles t = 0 .. T - 1, from 0, of v[p][c][t] dm[p][t][oc];
 * - dg = G^T du G: down each column of du, e0 = X0 + (X1 + X2) * .5, e1 = (X1 - X2) * .5,
 *   e2 = (X1 + X2) * .5 + X3, then the same along each of e's three rows;
 * - dwt[c 9 + kh 3 + kw][oc] = dg[kh][kw], or dwt + dg if add.
 * dwt (C 9, ldd = conv_taps_oc_pad(OC)), as conv_taps_dw writes it; dpt the image's output gradient transposed,
 * (H W, ldd) (conv_taps_dp_t: zeros past OC); x (C planes of H W, ldx apart). Columns past OC get sums of zeros.
 * scratch: conv_wino_dw_scratch_floats. */
size_t conv_wino_dw_scratch_floats(const ConvWino *p, int C, int OC);
/* Whether the weight gradient runs faster so than through the taps kernels (conv_taps_dw): at 8 lanes always; at
 * 16, where the image has at least 32 tiles and C OC >= 1024 (on Zen 5, ResNet-8's 28x28 stage of 16 channels and
 * its 7x7 one of 64 took 1.1 and 1.2 times the taps' time, the 14x14 ones 0.85 and 0.72). */
bool conv_wino_dw_pays(const ConvWino *p, int C, int OC);
void conv_wino_dw(const ConvWino *p, ConvTapsLevel level, float *dwt, const float *dpt, const float *x, size_t ldx,
                  int C, int OC, bool add, float *scratch);
void conv_wino_dw_ref(const ConvWino *p, float *dwt, const float *dpt, const float *x, size_t ldx, int C, int OC,
                      bool add);

/* conv_wino_x86.c */
void conv_wino_forward_avx2(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                            int rows, int channels, bool add, float *scratch);
void conv_wino_forward_avx512(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                              int rows, int channels, bool add, float *scratch);
void conv_wino_products_avx2(const ConvWino *p, float *y, size_t ldy, const float *wp, int rows, int channels,
                             bool add, float *scratch);
void conv_wino_products_avx512(const ConvWino *p, float *y, size_t ldy, const float *wp, int rows, int channels,
                               bool add, float *scratch);
void conv_wino_dw_avx2(const ConvWino *p, float *dwt, const float *dpt, const float *x, size_t ldx, int C, int OC,
                       bool add, float *scratch);
void conv_wino_dw_avx512(const ConvWino *p, float *dwt, const float *dpt, const float *x, size_t ldx, int C, int OC,
                         bool add, float *scratch);

#endif
