/* qtrain_rt.c - the integer kernels of qtrain_rt.h as plain loops, one
 * output value at a time: the definition the faster paths are checked
 * against. */
#include "qtrain_rt.h"
#include <string.h>
static int wv(const void *w, int bits, size_t k) {
    if (bits == 8) return ((const int8_t *)w)[k];
    uint8_t b = ((const uint8_t *)w)[k / 2]; int v = k % 2 ? b >> 4 : b & 15; return v >= 8 ? v - 16 : v;
}
size_t qrt_conv2d_scratch(const qrt_conv2d_t *p) { (void)p; return 0; }
void qrt_conv2d(const qrt_conv2d_t *p, const int8_t *x, int8_t *y, void *s) {
    (void)s; int cpg = p->in_c / p->groups, opg = p->out_c / p->groups;
    for (int o = 0; o < p->out_c; o++) { int g = o / opg;
      for (int oh = 0; oh < p->out_h; oh++) for (int ow = 0; ow < p->out_w; ow++) {
        int32_t acc = p->bias[o];
        for (int c = 0; c < cpg; c++) for (int kh = 0; kh < p->k_h; kh++) for (int kw = 0; kw < p->k_w; kw++) {
            int ih = oh * p->stride_h - p->pad_t + kh * p->dil_h, iw = ow * p->stride_w - p->pad_l + kw * p->dil_w;
            int xv = (ih < 0 || iw < 0 || ih >= p->in_h || iw >= p->in_w) ? p->in_zp : x[((size_t)(g * cpg + c) * p->in_h + ih) * p->in_w + iw];
            acc += (xv - p->in_zp) * wv(p->weight, p->w_bits, (((size_t)o * cpg + c) * p->k_h + kh) * p->k_w + kw);
        }
        y[((size_t)o * p->out_h + oh) * p->out_w + ow] = qrt_requant((int64_t)acc * p->mult[o], p->shift[o], p->out_zp, p->act_min, p->act_max);
      } }
}
void qrt_dense(const qrt_dense_t *p, const int8_t *x, int8_t *y) {
    for (int o = 0; o < p->out; o++) { int32_t acc = p->bias[o];
        for (int k = 0; k < p->in; k++) acc += (x[k] - p->in_zp) * wv(p->weight, p->w_bits, (size_t)o * p->in + k);
        y[o] = qrt_requant((int64_t)acc * p->mult[o], p->shift[o], p->out_zp, p->act_min, p->act_max); }
}
void qrt_maxpool2d(const qrt_maxpool2d_t *p, const int8_t *x, int8_t *y) {
    for (int c = 0; c < p->c; c++) for (int oh = 0; oh < p->out_h; oh++) for (int ow = 0; ow < p->out_w; ow++) {
        int m = -128; for (int a = 0; a < p->k_h; a++) for (int b = 0; b < p->k_w; b++) {
            int v = x[((size_t)c * p->in_h + oh * p->stride_h + a) * p->in_w + ow * p->stride_w + b]; if (v > m) m = v; }
        y[((size_t)c * p->out_h + oh) * p->out_w + ow] = (int8_t)m; }
}
void qrt_avgpool2d(const qrt_avgpool2d_t *p, const int8_t *x, int8_t *y) {
    for (int c = 0; c < p->c; c++) for (int oh = 0; oh < p->out_h; oh++) for (int ow = 0; ow < p->out_w; ow++) {
        int32_t s = 0; for (int a = 0; a < p->k_h; a++) for (int b = 0; b < p->k_w; b++)
            s += x[((size_t)c * p->in_h + oh * p->stride_h + a) * p->in_w + ow * p->stride_w + b];
        s -= p->k_h * p->k_w * p->in_zp;
        y[((size_t)c * p->out_h + oh) * p->out_w + ow] = qrt_requant((int64_t)s * p->mult, p->shift, p->out_zp, p->act_min, p->act_max); }
}
void qrt_add(const qrt_add_t *p, const int8_t *a, const int8_t *b, int8_t *y) {
    for (int i = 0; i < p->n; i++) y[i] = qrt_requant((int64_t)(a[i] - p->a_zp) * p->a_mult + (int64_t)(b[i] - p->b_zp) * p->b_mult, p->shift, p->out_zp, p->act_min, p->act_max);
}
void qrt_requant_n(const qrt_requant_t *p, const int8_t *x, int8_t *y) {
    for (int i = 0; i < p->n; i++) y[i] = qrt_requant((int64_t)(x[i] - p->in_zp) * p->mult, p->shift, p->out_zp, p->act_min, p->act_max);
}
void qrt_relu(int n, int32_t lo, const int8_t *x, int8_t *y) { for (int i = 0; i < n; i++) y[i] = x[i] < lo ? (int8_t)lo : x[i]; }
void qrt_quantize_u8(int c, int hw, const int8_t *t, const uint8_t *x, int8_t *y) {
    for (int k = 0; k < c; k++) for (int i = 0; i < hw; i++) y[k * hw + i] = t[k * 256 + x[k * hw + i]];
}
const char *qrt_simd(void) { return "portable"; }
