/* conv_taps.h - the "same" stride-1 convolution without im2col: each tap (kh, kw) of the kernel reads the padded
 * input planes shifted by (kh, kw), so the forward, the input gradient and the weight gradient are products over
 * those shifted planes that read the input where it lies (an implicit GEMM). A small-channel layer (ResNet-8's
 * 16-channel stage, the CNN's first convs) spends as long in sgemm packing its im2col matrix as in multiplying it;
 * here nothing is packed and no im2col matrix is written.
 *
 * Geometry: x (C, H, W), w (OC, C, KH, KW) with KH, KW odd, padding (KH-1)/2 and (KW-1)/2, stride 1: y (OC, H, W).
 * The padded planes (C, H + KH - 1, pw), pw = W + KW - 1 rounded up to lanes, hold x at row kh0 = (KH-1)/2,
 * column kw0 = (KW-1)/2 and zeros around it; after the last plane, `lanes` floats of zeros (a row's last vector
 * reads past its row).
 * Output row oh is ceil(W / lanes) vectors of `lanes` columns; a vector's lanes past W are computed and dropped.
 *
 * Arithmetic (every kernel, every ISA, the same bits for finite inputs; conv_taps_*_ref are the definitions; a
 * vector's lanes past W add 0 x (a value of the next row), which a non-finite value there would make NaN):
 * - forward: y[oc][p] = the fmaf chain over c = 0..C-1, then t = 0..KH*KW-1 (row-major taps), from 0, added to
 *   y[oc][p] (add) or to +0.0f: a sum that underflowed to -0.0f is stored +0.0f, as a zero bias's add would make
 *   it, so a convolution without bias or relu needs no epilogue pass (ops_conv.c).
 * - input gradient: the forward of the padded output gradient with the weights transposed (rows C, channels OC)
 *   and the taps flipped: dx[c][p] = the chain over oc, then t, of w[oc][c][KK-1-t] dp_pad[oc][p + off(t)].
 * - weight gradient, transposed: dwt[c KK + t][oc] = for each image in turn, the fmaf chain from 0 of
 *   dp[oc][q] x_pad[c][q + off(t)] over its rows, then its columns (every q of the output, none past W), added to
 *   dwt (or, for a call's first image without add, written): the same bits whatever the width or the number of
 *   images a call takes, and chains no longer than a plane. The kernels hold 16 (or 8) output channels in a
 *   vector's lanes, so no lane is padding and no sum ends in a tree; they read dp transposed, each position's
 *   channels along a row (conv_taps_dp_t). */
#ifndef QTRAIN_NN_CONV_TAPS_H
#define QTRAIN_NN_CONV_TAPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

typedef enum {
    CONV_TAPS_OFF,    /* im2col and sgemm (ops_conv.c) */
    CONV_TAPS_AVX2,   /* 8 lanes, AVX2 + FMA */
    CONV_TAPS_AVX512, /* 16 lanes, AVX-512F */
    CONV_TAPS_LEVEL_COUNT
} ConvTapsLevel;

/* The CPU's best level; conv_taps_level(): that, capped by conv_taps_max_level (tests; QTRAIN_CONV_KERNEL through
 * conv_taps_select). */
ConvTapsLevel conv_taps_cpu(void);
ConvTapsLevel conv_taps_level(void);
extern ConvTapsLevel conv_taps_max_level;
/* "gemm", "avx2", "avx512". */
const char *conv_taps_level_name(ConvTapsLevel level);
/* Sets the cap from a name (what: where it came from, for the message): one of the level names, or auto / NULL /
 * "" (the CPU's best); a level the CPU lacks or another name is a QT_ERR_CONFIG error. */
QtStatus conv_taps_select(const char *name, const char *what, QtError *err);

/* A level's vector width in floats: 16 at AVX512, else 8. */
int conv_taps_lanes(ConvTapsLevel level);

/* Forward rows per weight block: 8 at 16 lanes, 4 at 8. */
#define CONV_TAPS_RB_MAX 8

typedef struct {
    int C, OC, H, W, KH, KW;
    int lanes;        /* 16 or 8 */
    int rb;           /* the forward's output rows per weight block */
    int pw;           /* padded row pitch: W + KW - 1 rounded up to whole vectors */
    int vpr;          /* vectors per output row: ceil(W / lanes) */
    size_t pplane;    /* floats of one padded plane: (H + KH - 1) pw */
    int32_t *grid;    /* [H vpr] vector v's first column in a padded plane: (v / vpr) pw + (v % vpr) lanes */
    int32_t *out;     /* [H vpr] its first column in an output plane: (v / vpr) W + (v % vpr) lanes */
    int32_t *off;     /* [KH KW] tap t's shift in a padded plane: (t / KW) pw + t % KW */
    uint8_t *n;       /* [H vpr] its columns inside the row: min(lanes, W - (v % vpr) lanes) */
    /* The flat layout (a 3x3 kernel where it takes fewer vectors than rows of whole vectors: 28x28, 14x14): the
     * forward and the input gradient read planes (H + 2, W) with one guard float before and after (vplane = (H +
     * 2) W + 2 floats, x at 1 + (h + 1) W + w), and a vector is `lanes` consecutive outputs of the plane, across
     * rows; tap (kh, kw) reads the plane shifted by kh W + kw, and the lanes where kw = 0 or 2 would read the
     * neighbouring row's last or first column read the padding's zero instead, so every sum takes the row
     * layout's products: the same bits. At 16 lanes those loads are zero-masked (AVX-512's masks cost nothing);
     * at 8 a channel's plane comes three times (fplane = 3 vplane): as it is for kw = 1, with column W - 1 zeroed
     * for kw = 0 and with column 0 zeroed for kw = 2, whose loads need no mask (AVX2 has no mask registers, and
     * 12 accumulators leave no room for mask vectors). The weight gradient keeps the row layout. */
    bool flat;
    int nvf;          /* flat: vectors per plane, ceil(H W / lanes) */
    size_t vplane;    /* flat: floats of one copy of a plane, (H + 2) W + 2 (else pplane) */
    size_t fplane;    /* floats of a channel in the forward's layout: pplane, or flat vplane (16 lanes), 3 vplane (8) */
    uint16_t *fm0;    /* [nvf] flat at 16 lanes: vector v's lanes whose column is not 0 (tap column 0 reads inside
                       * the row) */
    uint16_t *fm2;    /* [nvf] flat at 16 lanes: its lanes whose column is not W - 1 (tap column 2) */
} ConvTaps;

/* Whether the geometry is one conv_taps takes at level (not OFF): same stride 1, odd kernels of 3 to 49 taps
 * (1x1 runs as its own product, ops_conv.c), and vectors not mostly padding: W >= 2/3 of its row's vectors'
 * lanes, or, where the flat layout applies, H W >= 2/3 of the flat vectors' (7x7 at 16 lanes: 49 of 64). */
bool conv_taps_fits(ConvTapsLevel level, int H, int W, int KH, int KW, int stride, int padding);
/* Floats of a plan's tables, for conv_taps_plan's buffer (int32 and bytes, counted in floats). */
size_t conv_taps_table_floats(int H, int W, int lanes);
/* Fills p for the level's lanes; tables: conv_taps_table_floats floats. */
void conv_taps_plan(ConvTaps *p, ConvTapsLevel level, int C, int OC, int H, int W, int KH, int KW, float *tables);

/* Floats of padded input for n images in the forward's layout (n channels fplane + lanes; conv_taps_pad) and in
 * the row layout (n channels pplane + lanes; conv_taps_pad_rows). */
size_t conv_taps_padded_floats(const ConvTaps *p, int channels, int n);
size_t conv_taps_padded_rows_floats(const ConvTaps *p, int channels, int n);
/* dst (n, channels, fplane) + lanes zeros = the n images at src (image i's channel c at src + i img + c ld,
 * (H, W) row-major) padded in the forward's layout (flat or rows), which conv_taps_forward reads; every float
 * of dst written. */
void conv_taps_pad(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img, size_t ld);
/* The same in the row layout (n, channels, pplane), which conv_taps_dw reads. */
void conv_taps_pad_rows(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img,
                        size_t ld);
/* The same, one row at a time in C (the definition), and each padded row as whole vectors of 8, the source's
 * columns through masked loads (conv_taps_x86.c; AVX2, for plans of either width: conv_taps_pad runs it where the
 * CPU has AVX2). */
void conv_taps_pad_ref(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img, size_t ld);
void conv_taps_pad_avx2(const ConvTaps *p, float *dst, const float *src, int channels, int n, size_t img, size_t ld);

/* Floats of packed weights (forward or transposed) for rows output rows. */
size_t conv_taps_packed_floats(const ConvTaps *p, int rows, int channels);
/* The forward's weights: w (rows, ldw), row r's first C KK floats (c, kh, kw) -> blocks [rows/rb][C][KK][rb]
 * (rows past the last zero); rows: OC, or a low-rank term's rank. */
void conv_taps_pack(const ConvTaps *p, float *dst, const float *w, int ldw, int rows);
/* The input gradient's: rows c, channels oc, taps flipped: [C/rb][OC][KK][rb]. */
void conv_taps_pack_t(const ConvTaps *p, float *dst, const float *w, int ldw);

/* y (rows, H W) with row stride ldy (=, or += if add) the forward of one padded image xp (channels, fplane) with
 * packed weights wp (conv_taps_pack: rows OC, channels C; conv_taps_pack_t: rows C, channels OC). */
void conv_taps_forward(const ConvTaps *p, ConvTapsLevel level, float *y, size_t ldy, const float *xp,
                       const float *wp, int rows, int channels, bool add);
void conv_taps_forward_ref(const ConvTaps *p, int lanes, float *y, size_t ldy, const float *xp, const float *wp,
                           int rows, int channels, bool add);
/* Floats of a row of the weight gradient's operands (dpt's and dwt's): rows (output channels) rounded up to 16. */
size_t conv_taps_oc_pad(int rows);
/* dpt (n H W, ldd = conv_taps_oc_pad(rows)) = dp transposed: dpt[(i H W + q) ldd + r] = dp[r ldp + i ldi + q] for
 * r < rows, 0 for rows <= r < ldd; dp's channel r of image i at dp + r ldp + i ldi, (H, W) row-major (a chunk's
 * dpre (rows, n H W): ldp = n H W, ldi = H W; the output gradient as it lies, (n, rows, H, W): ldp = H W,
 * ldi = rows H W). */
void conv_taps_dp_t(const ConvTaps *p, ConvTapsLevel level, float *dpt, const float *dp, size_t ldp, size_t ldi,
                    int rows, int n);
void conv_taps_dp_t_ref(const ConvTaps *p, float *dpt, const float *dp, size_t ldp, size_t ldi, int rows, int n);
/* dwt (C KK, ldd = conv_taps_oc_pad(OC)) = the weight gradient of n images, transposed (the images' chains above,
 * added to dwt's values if add, else from the first image's); dpt: conv_taps_dp_t's of the OC rows; xp their padded
 * inputs in the row layout (n, C, pplane: conv_taps_pad_rows). dwt's columns past OC are unspecified. */
void conv_taps_dw(const ConvTaps *p, ConvTapsLevel level, float *dwt, const float *dpt, const float *xp, int n,
                  bool add);
void conv_taps_dw_ref(const ConvTaps *p, float *dwt, const float *dpt, const float *xp, int n, bool add);
/* grad (OC, C KK) += parts[k] transposed for k < n_parts, in order: parts n_parts dwt's (C KK, ldd); _rows: rows
 * [oc0, oc1) of grad alone (threads may take disjoint row ranges: the same bits). */
void conv_taps_dw_add_parts(const ConvTaps *p, float *grad, const float *parts, int n_parts);
void conv_taps_dw_add_parts_rows(const ConvTaps *p, float *grad, const float *parts, int n_parts, int oc0, int oc1);
/* The same for any (OC, ckk) gradient and (ckk, conv_taps_oc_pad(OC)) partials (im2col's transposed products). */
void conv_dw_t_add_parts_rows(float *grad, const float *parts, int n_parts, int OC, size_t ckk, int oc0, int oc1);

/* conv_taps_x86.c: the kernels of each level. */
void conv_taps_forward_avx512(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wp, int rows,
                              int channels, bool add);
void conv_taps_forward_avx2(const ConvTaps *p, float *y, size_t ldy, const float *xp, const float *wp, int rows,
                            int channels, bool add);
/* conv_taps_dw_x86.c: the weight gradient's kernels and the transposes. */
void conv_taps_dw_avx512(const ConvTaps *p, float *dwt, const float *dpt, const float *xp, int n, bool add);
void conv_taps_dw_avx2(const ConvTaps *p, float *dwt, const float *dpt, const float *xp, int n, bool add);
void conv_taps_dp_t_avx512(const ConvTaps *p, float *dpt, const float *dp, size_t ldp, size_t ldi, int rows, int n);
void conv_taps_dp_t_avx2(const ConvTaps *p, float *dpt, const float *dp, size_t ldp, size_t ldi, int rows, int n);

#endif
