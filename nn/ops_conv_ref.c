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

/* ---- reference general convolution (tests only) ------------------------------ */

int conv_general_out_size(int in, int kernel, int stride, int pad_before, int pad_after, int dil) {
    const long long padded = (long long)in + pad_before + pad_after, span = (long long)dil * (kernel - 1) + 1;
    if (stride < 1 || padded < span) return 0;
    const long long out = (padded - span) / stride + 1;
    return out > 0x7fffffff ? 0 : (int)out;
}

/* The input coordinate output o's tap k reads (may be padding: out of [0, in)). */
static inline int conv_general_in_at(int o, int k, int stride, int pad, int dil) { return o * stride + k * dil - pad; }

void conv2d_general_forward_ref(float *y, const float *x, const float *w, const float *bias, int N, int C, int H,
                                int W, int OC, int KH, int KW, const ConvGeom2d *g) {
    const int OH = conv_general_out_size(H, KH, g->stride_h, g->pad_h, g->pad_h + g->pad_h_extra, g->dil_h);
    const int OW = conv_general_out_size(W, KW, g->stride_w, g->pad_w, g->pad_w + g->pad_w_extra, g->dil_w);
    const int Cg = C / g->groups, OCg = OC / g->groups;
    for (int n = 0; n < N; n++)
        for (int oc = 0; oc < OC; oc++)
            for (int oh = 0; oh < OH; oh++)
                for (int ow = 0; ow < OW; ow++) {
                    double acc = bias ? bias[oc] : 0.0;
                    for (int cg = 0; cg < Cg; cg++)
                        for (int kh = 0; kh < KH; kh++)
                            for (int kw = 0; kw < KW; kw++) {
                                const int c = oc / OCg * Cg + cg;
                                const int ih = conv_general_in_at(oh, kh, g->stride_h, g->pad_h, g->dil_h);
                                const int iw = conv_general_in_at(ow, kw, g->stride_w, g->pad_w, g->dil_w);
                                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                                acc += (double)x[(((size_t)n * C + c) * H + ih) * W + iw] *
                                       w[(((size_t)oc * Cg + cg) * KH + kh) * KW + kw];
                            }
                    y[(((size_t)n * OC + oc) * OH + oh) * OW + ow] = (float)acc;
                }
}

void conv2d_general_backward_ref(float *dx, float *dw, float *dbias, const float *dy, const float *x,
                                 const float *w, int N, int C, int H, int W, int OC, int KH, int KW,
                                 const ConvGeom2d *g) {
    const int OH = conv_general_out_size(H, KH, g->stride_h, g->pad_h, g->pad_h + g->pad_h_extra, g->dil_h);
    const int OW = conv_general_out_size(W, KW, g->stride_w, g->pad_w, g->pad_w + g->pad_w_extra, g->dil_w);
    const int Cg = C / g->groups, OCg = OC / g->groups;
    if (dbias)
        for (int oc = 0; oc < OC; oc++) {
            double acc = 0.0;
            for (int n = 0; n < N; n++)
                for (int p = 0; p < OH * OW; p++) acc += dy[((size_t)n * OC + oc) * OH * OW + p];
            dbias[oc] += (float)acc;
        }
    if (dw)
        for (int oc = 0; oc < OC; oc++)
            for (int cg = 0; cg < Cg; cg++)
                for (int kh = 0; kh < KH; kh++)
                    for (int kw = 0; kw < KW; kw++) {
                        const int c = oc / OCg * Cg + cg;
                        double acc = 0.0;
                        for (int n = 0; n < N; n++)
                            for (int oh = 0; oh < OH; oh++)
                                for (int ow = 0; ow < OW; ow++) {
                                    const int ih = conv_general_in_at(oh, kh, g->stride_h, g->pad_h, g->dil_h);
                                    const int iw = conv_general_in_at(ow, kw, g->stride_w, g->pad_w, g->dil_w);
                                    if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                                    acc += (double)dy[(((size_t)n * OC + oc) * OH + oh) * OW + ow] *
                                           x[(((size_t)n * C + c) * H + ih) * W + iw];
                                }
                        dw[(((size_t)oc * Cg + cg) * KH + kh) * KW + kw] += (float)acc;
                    }
    if (!dx) return;
    /* Gathered per input element, so each is one sum in double. */
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            for (int ih = 0; ih < H; ih++)
                for (int iw = 0; iw < W; iw++) {
                    double acc = 0.0;
                    const int grp = c / Cg, cg = c % Cg;
                    for (int oc = grp * OCg; oc < (grp + 1) * OCg; oc++)
                        for (int oh = 0; oh < OH; oh++)
                            for (int kh = 0; kh < KH; kh++) {
                                if (conv_general_in_at(oh, kh, g->stride_h, g->pad_h, g->dil_h) != ih) continue;
                                for (int ow = 0; ow < OW; ow++)
                                    for (int kw = 0; kw < KW; kw++) {
                                        if (conv_general_in_at(ow, kw, g->stride_w, g->pad_w, g->dil_w) != iw)
                                            continue;
                                        acc += (double)dy[(((size_t)n * OC + oc) * OH + oh) * OW + ow] *
                                               w[(((size_t)oc * Cg + cg) * KH + kh) * KW + kw];
                                    }
                            }
                    dx[(((size_t)n * C + c) * H + ih) * W + iw] += (float)acc;
                }
}
