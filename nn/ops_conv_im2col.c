/* ops_conv_im2col.c - the convolution's lowering to matrix products: im2col
 * unrolls the receptive fields of a chunk of samples into the columns of col
 * (C*KH*KW, N*OH*OW), col2im scatters a product of that shape back onto the
 * input planes (its adjoint). The general loops take any geometry; the "same"
 * stride-1 geometry and stride 2 over an input twice the output's size (every
 * reference network's) run as whole shifted planes instead. */
#include "ops_conv_internal.h"

#include <stdbool.h>
#include <string.h>

/* ---- im2col / col2im ---------------------------------------------------- */

/* The output positions o in [*lo, *hi) whose input coordinate o*stride + offset
 * lies in [0, in_size); the rest read zero padding. Solved once per kernel tap
 * so the inner loops need no bounds test. */
static void valid_output_range(int offset, int stride, int in_size, int out_size, int *lo, int *hi) {
    int first = offset < 0 ? (-offset + stride - 1) / stride : 0;
    int last_input = in_size - 1 - offset; /* largest admissible o*stride */
    int end = last_input >= 0 ? last_input / stride + 1 : 0;
    if (end > out_size) end = out_size;
    if (first > end) first = end;
    *lo = first;
    *hi = end;
}

/* The "same" stride-1 case (OH == H, OW == W: padding (K-1)/2 on both
 * axes), every reference CNN's: each row of col for one sample is the input
 * plane shifted by (kh - padding, kw - padding), so it is one contiguous
 * copy, then the rows and the column that fell outside the plane (the copy
 * wrapped them around from the neighbouring row) are zeroed. */
bool conv_same_stride1(int H, int W, int KH, int KW, int stride, int padding, int OH, int OW) {
    return stride == 1 && OH == H && OW == W && KH == 2 * padding + 1 && KW == 2 * padding + 1;
}

/* Zeroes the columns of p (H, W) that a contiguous copy shifted by dw wraps
 * in from the neighbouring row: the first -dw (dw < 0) or the last dw
 * (dw > 0) of every row. The rows a shift by dh reads from outside the plane
 * lie outside the contiguous range the callers copy or add, so they need
 * nothing here. */
static void zero_wrapped_columns(float *p, int H, int W, int dw) {
    if (dw == 0) return;
    const int cols = dw < 0 ? (-dw < W ? -dw : W) : (dw < W ? dw : W);
    float *first = dw < 0 ? p : p + (W - cols); /* (H, cols) with row stride W */
    if (cols == 1) { /* a 3x3 kernel's: one store a row (the loop below becomes a memset call a row) */
        for (int h = 0; h < H; h++) first[(size_t)h * W] = 0.0f;
        return;
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < cols; c++) first[(size_t)h * W + c] = 0.0f;
}

/* dst (H, W) = x_plane (H, W) shifted by (dh, dw), zero outside. */
void conv_shift_plane(float *restrict dst, const float *restrict x_plane, int H, int W, int dh, int dw) {
    const long long plane = (long long)H * W, off = (long long)dh * W + dw;
    long long lo = off < 0 ? -off : 0, hi = off > 0 ? plane - off : plane; /* dst range reading inside x */
    if (lo > plane) lo = plane;
    if (hi < lo) hi = lo;
    memset(dst, 0, (size_t)lo * sizeof *dst);
    memcpy(dst + lo, x_plane + lo + off, (size_t)(hi - lo) * sizeof *dst);
    memset(dst + hi, 0, (size_t)(plane - hi) * sizeof *dst);
    zero_wrapped_columns(dst, H, W, dw);
}

/* dx_plane (H, W) += src (H, W) shifted back by (dh, dw): one contiguous
 * add over the entries whose row reads inside the plane, after zeroing
 * the wrapped-in columns (src is scratch). Always inlined, so each clone of
 * col2im_same_s1 vectorises it in its own ISA. */
static inline __attribute__((always_inline)) void unshift_plane_add(float *restrict dx_plane, float *restrict src,
                                                                    int H, int W, int dh, int dw) {
    const long long plane = (long long)H * W, off = (long long)dh * W + dw;
    zero_wrapped_columns(src, H, W, dw);
    long long lo = off < 0 ? -off : 0, hi = off > 0 ? plane - off : plane;
    if (lo > plane) lo = plane;
    if (hi < lo) hi = lo;
    float *restrict d = dx_plane + lo + off;
    const float *restrict s = src + lo;
    for (long long i = 0; i < hi - lo; i++) d[i] += s[i];
}

/* The same for the first of a plane's taps when dx_plane holds no gradient
 * yet: written, not added, and zero where the tap reads padding. Each entry
 * is 0.0f + src, as the add into a zeroed plane gives (a -0.0f turns into
 * +0.0f the same way), so the two give the same bits. */
static inline __attribute__((always_inline)) void unshift_plane_write(float *restrict dx_plane, float *restrict src,
                                                                      int H, int W, int dh, int dw) {
    const long long plane = (long long)H * W, off = (long long)dh * W + dw;
    zero_wrapped_columns(src, H, W, dw);
    long long lo = off < 0 ? -off : 0, hi = off > 0 ? plane - off : plane;
    if (hi <= lo) { /* the tap reads only padding */
        memset(dx_plane, 0, (size_t)plane * sizeof *dx_plane);
        return;
    }
    memset(dx_plane, 0, (size_t)(lo + off) * sizeof *dx_plane);
    float *restrict d = dx_plane + lo + off;
    const float *restrict s = src + lo;
    for (long long i = 0; i < hi - lo; i++) d[i] = 0.0f + s[i];
    memset(dx_plane + hi + off, 0, (size_t)(plane - hi - off) * sizeof *dx_plane);
}

static void im2col_same_s1(float *col, const float *x, int N, int C, int H, int W, int KH, int KW, int padding) {
    const size_t plane = (size_t)H * W, n_cols = (size_t)N * plane;
    for (int c = 0; c < C; c++)
        for (int kh = 0; kh < KH; kh++)
            for (int kw = 0; kw < KW; kw++) {
                float *row = col + ((size_t)(c * KH + kh) * KW + kw) * n_cols; /* [N*H*W] */
                for (int n = 0; n < N; n++)
                    conv_shift_plane(row + (size_t)n * plane, x + ((size_t)n * C + c) * plane, H, W, kh - padding,
                                kw - padding);
            }
}

/* The input gradient's col2im is 9 adds per element of every conv input
 * plane each step, a few percent of a CNN step: with AVX2/AVX-512 where the
 * CPU has them (chosen once, at load; clang, which builds the fuzz targets,
 * links no resolver for it). Each element's adds keep their order, so every
 * clone gives the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones(NN_CLONE_TARGETS)))
#endif
static void col2im_same_s1(float *dx, float *dcol, int N, int C, int H, int W, int KH, int KW, int padding,
                           bool write) {
    const size_t plane = (size_t)H * W, n_cols = (size_t)N * plane;
    for (int c = 0; c < C; c++)
        for (int kh = 0; kh < KH; kh++)
            for (int kw = 0; kw < KW; kw++) {
                float *row = dcol + ((size_t)(c * KH + kh) * KW + kw) * n_cols; /* [N*H*W] */
                if (write && kh == 0 && kw == 0) /* the first tap of each of channel c's planes */
                    for (int n = 0; n < N; n++)
                        unshift_plane_write(dx + ((size_t)n * C + c) * plane, row + (size_t)n * plane, H, W,
                                            kh - padding, kw - padding);
                else
                    for (int n = 0; n < N; n++)
                        unshift_plane_add(dx + ((size_t)n * C + c) * plane, row + (size_t)n * plane, H, W,
                                          kh - padding, kw - padding);
            }
}

/* Stride 2 over an input exactly twice the output's size (H == 2 OH,
 * W == 2 OW), every subsampling convolution of the reference networks:
 * tap (kh, kw) reads input row 2 oh + kh - padding, a row of one parity
 * shifted by whole rows (the same for columns). So each (sample, channel)
 * plane is split once into its parity planes (OH, OW), and each tap's part
 * of col is a shifted copy of one of them (conv_shift_plane), as in the
 * stride-1 case, instead of a strided gather row by row; col2im adds each
 * tap's row into its parity plane the same way and interleaves the planes
 * back once. The parity planes live on the stack: larger planes take the
 * general loops. */
#define CONV_S2_PARITY_MAX 4096 /* floats: 4 OH OW */

/* The planes are read one after another, each a few KB (3 KB at 28x28): a page's worth, where the hardware's
 * prefetchers start each page cold. The splits ask for the plane this many ahead (nn_prefetch, a line at a time). */
#define S2_AHEAD 2

static bool conv_stride2_parity(int H, int W, int stride, int OH, int OW) {
    return stride == 2 && H == 2 * OH && W == 2 * OW && (size_t)4 * OH * OW <= CONV_S2_PARITY_MAX;
}

/* The parity planes the taps read: bit 2 rp + cp for row parity rp and column parity cp (th = -1 is odd). A 1x1
 * kernel without padding (a strided shortcut) reads only the even-even one. */
static unsigned s2_parities(int KH, int KW, int padding) {
    unsigned rows = 0, cols = 0, need = 0;
    for (int kh = 0; kh < KH; kh++) rows |= 1u << ((kh - padding) & 1);
    for (int kw = 0; kw < KW; kw++) cols |= 1u << ((kw - padding) & 1);
    for (int rp = 0; rp < 2; rp++)
        for (int cp = 0; cp < 2; cp++)
            if ((rows >> rp & 1u) && (cols >> cp & 1u)) need |= 1u << (2 * rp + cp);
    return need;
}

/* parity (4, OH, OW): plane 2 rp + cp = x_plane (2 OH, 2 OW)'s rows of parity rp and columns of parity cp, for the
 * planes in need; the others are not written. */
static void s2_split(float *restrict parity, const float *restrict x_plane, int OH, int OW, unsigned need) {
    const size_t oplane = (size_t)OH * OW, W = (size_t)2 * OW;
    for (int h = 0; h < 2 * OH; h++) { /* in memory order: the prefetchers follow one stream */
        const int rp = h & 1;
        const bool even = need >> (2 * rp) & 1u, odd = need >> (2 * rp + 1) & 1u;
        const float *x_row = x_plane + (size_t)h * W;                          /* [W] */
        float *pe = parity + (size_t)(2 * rp) * oplane + (size_t)(h >> 1) * OW, /* [OW] */
            *po = pe + oplane;
        if (even && odd)
            for (int j = 0; j < OW; j++) pe[j] = x_row[2 * j], po[j] = x_row[2 * j + 1];
        else if (even)
            for (int j = 0; j < OW; j++) pe[j] = x_row[2 * j];
        else if (odd)
            for (int j = 0; j < OW; j++) po[j] = x_row[2 * j + 1];
    }
}

/* s2_split's inverse for all four planes: x_plane = the planes interleaved. */
static void s2_merge(float *restrict x_plane, const float *restrict parity, int OH, int OW) {
    const size_t oplane = (size_t)OH * OW, W = (size_t)2 * OW;
    for (int h = 0; h < 2 * OH; h++) {
        float *x_row = x_plane + (size_t)h * W;                                              /* [W] */
        const float *pe = parity + (size_t)(2 * (h & 1)) * oplane + (size_t)(h >> 1) * OW, /* [OW] */
            *po = pe + oplane;
        for (int j = 0; j < OW; j++) x_row[2 * j] = pe[j], x_row[2 * j + 1] = po[j];
    }
}

static void im2col_s2(float *col, const float *x, int N, int C, int H, int W, int KH, int KW, int padding, int OH,
                      int OW) {
    float parity[CONV_S2_PARITY_MAX]; /* (row parity, column parity, OH, OW) */
    const size_t plane = (size_t)H * W, oplane = (size_t)OH * OW, n_cols = (size_t)N * oplane;
    const unsigned need = s2_parities(KH, KW, padding);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            const float *x_plane = x + ((size_t)n * C + c) * plane; /* (H, W) */
            if ((size_t)n * C + c + S2_AHEAD < (size_t)N * C) nn_prefetch(x_plane + S2_AHEAD * plane, plane);
            if (KH == 1 && KW == 1 && padding == 0) { /* the one tap's row is the even-even plane itself */
                s2_split(col + (size_t)c * n_cols + (size_t)n * oplane, x_plane, OH, OW, 1u);
                continue;
            }
            s2_split(parity, x_plane, OH, OW, need);
            for (int kh = 0; kh < KH; kh++)
                for (int kw = 0; kw < KW; kw++) {
                    const int th = kh - padding, tw = kw - padding; /* the tap's input offset */
                    const int rp = th & 1, cp = tw & 1;             /* its parities (th = -1 is odd) */
                    float *row = col + ((size_t)(c * KH + kh) * KW + kw) * n_cols + (size_t)n * oplane;
                    conv_shift_plane(row, parity + (size_t)(2 * rp + cp) * oplane, OH, OW, (th - rp) / 2,
                                     (tw - cp) / 2);
                }
        }
}

/* col: (C*KH*KW, N*OH*OW), x: (N, C, H, W). */
void im2col(float *col, const float *x, int N, int C, int H, int W, int KH, int KW, int stride, int padding,
            int OH, int OW) {
    if (conv_same_stride1(H, W, KH, KW, stride, padding, OH, OW)) {
        im2col_same_s1(col, x, N, C, H, W, KH, KW, padding);
        return;
    }
    if (conv_stride2_parity(H, W, stride, OH, OW)) {
        im2col_s2(col, x, N, C, H, W, KH, KW, padding, OH, OW);
        return;
    }
    const size_t plane = (size_t)H * W;
    const size_t n_cols = (size_t)N * OH * OW;
    for (int c = 0; c < C; c++) {
        for (int kh = 0; kh < KH; kh++) {
            for (int kw = 0; kw < KW; kw++) {
                float *row = col + ((size_t)(c * KH + kh) * KW + kw) * n_cols; /* [N*OH*OW] */
                const int w_offset = kw - padding;
                int ow_lo, ow_hi;
                valid_output_range(w_offset, stride, W, OW, &ow_lo, &ow_hi);
                for (int n = 0; n < N; n++) {
                    const float *x_plane = x + ((size_t)n * C + c) * plane; /* (H, W) */
                    for (int oh = 0; oh < OH; oh++) {
                        float *dst = row + ((size_t)n * OH + oh) * OW; /* [OW] */
                        const int ih = oh * stride + kh - padding;
                        if (ih < 0 || ih >= H) {
                            memset(dst, 0, (size_t)OW * sizeof *dst);
                            continue;
                        }
                        const float *x_row = x_plane + (size_t)ih * W; /* [W] */
                        for (int ow = 0; ow < ow_lo; ow++) dst[ow] = 0.0f;
                        for (int ow = ow_lo; ow < ow_hi; ow++) dst[ow] = x_row[ow * stride + w_offset];
                        for (int ow = ow_hi; ow < OW; ow++) dst[ow] = 0.0f;
                    }
                }
            }
        }
    }
}

/* dx: (N, C, H, W) accumulated; dcol: (C*KH*KW, N*OH*OW). Padding taps are
 * dropped: they are constants, not inputs. */
void col2im(float *dx, const float *dcol, int N, int C, int H, int W, int KH, int KW, int stride, int padding,
            int OH, int OW) {
    const size_t plane = (size_t)H * W;
    const size_t n_cols = (size_t)N * OH * OW;
    for (int c = 0; c < C; c++) {
        for (int kh = 0; kh < KH; kh++) {
            for (int kw = 0; kw < KW; kw++) {
                const float *row = dcol + ((size_t)(c * KH + kh) * KW + kw) * n_cols; /* [N*OH*OW] */
                const int w_offset = kw - padding;
                int ow_lo, ow_hi;
                valid_output_range(w_offset, stride, W, OW, &ow_lo, &ow_hi);
                for (int n = 0; n < N; n++) {
                    float *dx_plane = dx + ((size_t)n * C + c) * plane; /* (H, W) */
                    for (int oh = 0; oh < OH; oh++) {
                        const int ih = oh * stride + kh - padding;
                        if (ih < 0 || ih >= H) continue;
                        const float *src = row + ((size_t)n * OH + oh) * OW; /* [OW] */
                        float *dx_row = dx_plane + (size_t)ih * W;             /* [W] */
                        for (int ow = ow_lo; ow < ow_hi; ow++) dx_row[ow * stride + w_offset] += src[ow];
                    }
                }
            }
        }
    }
}

/* col2im at stride 2 (conv_stride2_parity): each (sample, channel) plane's parity planes start as dx's entries (or
 * zeros, with write), take each tap's row of dcol as a contiguous shifted add (unshift_plane_add; dcol is scratch),
 * in col2im's tap order, and go back into dx once. Every entry of dx gets the same adds in the same order as
 * col2im's strided loop gives it, so the same value (a -0.0f in dx where a tap reads padding may come back +0.0f:
 * the zeroed entry is added, not skipped). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones(NN_CLONE_TARGETS)))
#endif
static void col2im_s2(float *dx, float *dcol, int N, int C, int H, int W, int KH, int KW, int padding, int OH,
                      int OW, bool write) {
    float parity[CONV_S2_PARITY_MAX]; /* (row parity, column parity, OH, OW) */
    const size_t plane = (size_t)H * W, oplane = (size_t)OH * OW, n_cols = (size_t)N * oplane;
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            float *dx_plane = dx + ((size_t)n * C + c) * plane; /* (H, W) */
            if (!write && (size_t)n * C + c + S2_AHEAD < (size_t)N * C) nn_prefetch(dx_plane + S2_AHEAD * plane, plane);
            if (write) memset(parity, 0, 4 * oplane * sizeof *parity);
            else s2_split(parity, dx_plane, OH, OW, 0xfu);
            for (int kh = 0; kh < KH; kh++)
                for (int kw = 0; kw < KW; kw++) {
                    const int th = kh - padding, tw = kw - padding, rp = th & 1, cp = tw & 1;
                    float *row = dcol + ((size_t)(c * KH + kh) * KW + kw) * n_cols + (size_t)n * oplane;
                    unshift_plane_add(parity + (size_t)(2 * rp + cp) * oplane, row, OH, OW, (th - rp) / 2,
                                      (tw - cp) / 2);
                }
            s2_merge(dx_plane, parity, OH, OW);
        }
}

/* col2im that may overwrite dcol (scratch): the fast paths zero the
 * entries that read padding before their contiguous adds. With write, dx
 * holds nothing yet and is written: the fast path's first tap writes each
 * plane, the general path zeroes dx first (the chunk's part, while it is in
 * cache). */
void col2im_consume(float *dx, float *dcol, int N, int C, int H, int W, int KH, int KW, int stride, int padding,
                    int OH, int OW, bool write) {
    if (conv_same_stride1(H, W, KH, KW, stride, padding, OH, OW)) {
        col2im_same_s1(dx, dcol, N, C, H, W, KH, KW, padding, write);
        return;
    }
    /* the parity planes where the taps read all four; a 1x1 shortcut's one tap touches a quarter of dx, which the
     * loops below reach without splitting and merging the rest */
    if (conv_stride2_parity(H, W, stride, OH, OW) && s2_parities(KH, KW, padding) == 0xfu) {
        col2im_s2(dx, dcol, N, C, H, W, KH, KW, padding, OH, OW, write);
        return;
    }
    if (write) memset(dx, 0, (size_t)N * C * H * W * sizeof *dx);
    col2im(dx, dcol, N, C, H, W, KH, KW, stride, padding, OH, OW);
}
