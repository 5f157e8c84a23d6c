/* ops_conv_ref.c - the direct-loop convolution, no BLAS and no im2col: the
 * reference the tests hold nn/ops_conv.c's lowered forms against. */
#include "ops.h"

#include <stddef.h>

/* ---- reference convolution (tests only) --------------------------------- */

/* y: (N, OC, OH, OW), x: (N, C, H, W), w: (OC, C, KH, KW), bias: (OC,) or NULL. */
void conv2d_forward_ref(float *y, const float *x, const float *w, const float *bias, int N, int C, int H, int W,
                        int OC, int KH, int KW, int stride, int padding) {
    const int OH = (H + 2 * padding - KH) / stride + 1, OW = (W + 2 * padding - KW) / stride + 1;
    for (int n = 0; n < N; n++)
        for (int oc = 0; oc < OC; oc++)
            for (int oh = 0; oh < OH; oh++)
                for (int ow = 0; ow < OW; ow++) {
                    double acc = bias ? bias[oc] : 0.0;
                    for (int c = 0; c < C; c++)
                        for (int kh = 0; kh < KH; kh++)
                            for (int kw = 0; kw < KW; kw++) {
                                const int ih = oh * stride + kh - padding, iw = ow * stride + kw - padding;
                                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                                acc += (double)x[(((size_t)n * C + c) * H + ih) * W + iw] *
                                       w[(((size_t)oc * C + c) * KH + kh) * KW + kw];
                            }
                    y[(((size_t)n * OC + oc) * OH + oh) * OW + ow] = (float)acc;
                }
}

/* dx: (N, C, H, W) += sum over the outputs each input pixel feeds, gathered
 * (rather than scattered) so every element is one sum in double. */
static void conv2d_backward_ref_dx(float *dx, const float *dy, const float *w, int N, int C, int H, int W, int OC,
                                   int KH, int KW, int stride, int padding, int OH, int OW) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            for (int ih = 0; ih < H; ih++)
                for (int iw = 0; iw < W; iw++) {
                    double acc = 0.0;
                    for (int oc = 0; oc < OC; oc++)
                        for (int kh = 0; kh < KH; kh++)
                            for (int kw = 0; kw < KW; kw++) {
                                const int sh = ih + padding - kh, sw = iw + padding - kw; /* oh*stride, ow*stride */
                                if (sh < 0 || sw < 0 || sh % stride || sw % stride) continue;
                                const int oh = sh / stride, ow = sw / stride;
                                if (oh >= OH || ow >= OW) continue;
                                acc += (double)dy[(((size_t)n * OC + oc) * OH + oh) * OW + ow] *
                                       w[(((size_t)oc * C + c) * KH + kh) * KW + kw];
                            }
                    dx[(((size_t)n * C + c) * H + ih) * W + iw] += (float)acc;
                }
}

/* dx: (N, C, H, W), dw: (OC, C, KH, KW), dbias: (OC,), each NULL if not wanted;
 * dy: (N, OC, OH, OW), x: (N, C, H, W), w: (OC, C, KH, KW). */
void conv2d_backward_ref(float *dx, float *dw, float *dbias, const float *dy, const float *x, const float *w,
                         int N, int C, int H, int W, int OC, int KH, int KW, int stride, int padding) {
    const int OH = (H + 2 * padding - KH) / stride + 1, OW = (W + 2 * padding - KW) / stride + 1;
    const size_t out_plane = (size_t)OH * OW;
    if (dbias)
        for (int oc = 0; oc < OC; oc++) {
            double acc = 0.0;
            for (int n = 0; n < N; n++)
                for (size_t p = 0; p < out_plane; p++) acc += dy[((size_t)n * OC + oc) * out_plane + p];
            dbias[oc] += (float)acc;
        }
    if (dw)
        for (int oc = 0; oc < OC; oc++)
            for (int c = 0; c < C; c++)
                for (int kh = 0; kh < KH; kh++)
                    for (int kw = 0; kw < KW; kw++) {
                        double acc = 0.0;
                        for (int n = 0; n < N; n++)
                            for (int oh = 0; oh < OH; oh++)
                                for (int ow = 0; ow < OW; ow++) {
                                    const int ih = oh * stride + kh - padding, iw = ow * stride + kw - padding;
                                    if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                                    acc += (double)dy[(((size_t)n * OC + oc) * OH + oh) * OW + ow] *
                                           x[(((size_t)n * C + c) * H + ih) * W + iw];
                                }
                        dw[(((size_t)oc * C + c) * KH + kh) * KW + kw] += (float)acc;
                    }
    if (dx) conv2d_backward_ref_dx(dx, dy, w, N, C, H, W, OC, KH, KW, stride, padding, OH, OW);
}
