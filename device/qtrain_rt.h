/* qtrain_rt.h - the integer kernels of an exported model (`qtrain export
 * --format c`). C99 with no dependency beyond <stdint.h> and <stddef.h>: no
 * malloc, no libm, no threads. qtrain compiles this same file into its own
 * integer evaluation (`qtrain eval --integer`), which is why the two give the
 * same logits bit for bit. The semantics are docs/DEVICE.md's; in short:
 *
 *   Every activation is int8 with a per-tensor scale s and zero point zp
 *   (real value = s * (q - zp)); weights are int8 (or int4, two per byte)
 *   with a per-output-channel scale and no zero point; biases are int32 in
 *   units of s_in * s_w[o]. A conv or dense output channel o computes
 *
 *     acc = bias[o] + sum_k (x_k - in_zp) * w[o][k]          (exact, int32)
 *     y   = clamp(out_zp + qrt_rshift_round(acc * mult[o], shift[o]),
 *                 act_min, act_max)
 *
 *   where qrt_rshift_round(v, n) = floor((v + 2^(n-1)) / 2^n) on int64
 *   (round half up), mult in [0, 2^31), shift in [1, 62]. A relu that
 *   follows is act_min = out_zp. Add, average pools and concat requantize
 *   their inputs the same way (one rounding per output value).
 *
 * Optional SIMD paths (x86 AVX2 when __AVX2__, ARM NEON when __ARM_NEON)
 * compute the same integers; define QRT_PORTABLE to compile the plain loops
 * only. Shapes are per example (no batch axis), channels first (C, H, W). */
#ifndef QTRAIN_RT_H
#define QTRAIN_RT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* floor((v + 2^(n-1)) / 2^n) for n in [1, 62], without relying on the
 * implementation-defined right shift of a negative number. v + 2^(n-1) must
 * not overflow; the kernels' v (acc * mult, |acc| < 2^31, mult < 2^31) stay
 * below 2^62 in magnitude. */
static inline int64_t qrt_rshift_round(int64_t v, int n) {
    int64_t r = v + ((int64_t)1 << (n - 1));
    return r >= 0 ? (r >> n) : ~((~r) >> n);
}

/* clamp(zp + qrt_rshift_round(v, n), lo, hi) as an int8. */
static inline int8_t qrt_requant(int64_t v, int n, int32_t zp, int32_t lo, int32_t hi) {
    int64_t y = (int64_t)zp + qrt_rshift_round(v, n);
    return (int8_t)(y < lo ? lo : y > hi ? hi : y);
}

/* A convolution: y (out_c, out_h, out_w) from x (in_c, in_h, in_w).
 * Input row ih = oh * stride_h - pad_t + kh * dil_h (likewise columns);
 * outside the image the input is in_zp (a real 0). groups divides in_c and
 * out_c; out channel o reads input channels g * in_c/groups .. +in_c/groups
 * with g = o / (out_c/groups) (depthwise: groups = in_c). */
typedef struct {
    int in_c, in_h, in_w;
    int out_c, out_h, out_w;
    int k_h, k_w, stride_h, stride_w, pad_t, pad_l, dil_h, dil_w, groups;
    int w_bits;              /* 8: one int8 per weight; 4: two per byte, the even index in the low nibble */
    const void *weight;      /* (out_c, in_c/groups, k_h, k_w) in that order, w_bits each */
    const int32_t *bias;     /* (out_c) */
    const int32_t *mult;     /* (out_c) requantization multipliers, in [0, 2^31) */
    const int8_t *shift;     /* (out_c) in [1, 62] */
    int32_t in_zp, out_zp, act_min, act_max;
} qrt_conv2d_t;

/* A dense layer: y (out) from x (in). Weight (out, in), the rest as conv. */
typedef struct {
    int in, out;
    int w_bits;
    const void *weight;      /* (out, in), w_bits each */
    const int32_t *bias;     /* (out) */
    const int32_t *mult;     /* (out) */
    const int8_t *shift;     /* (out) */
    int32_t in_zp, out_zp, act_min, act_max;
} qrt_dense_t;

/* Max pool (no padding): y (c, out_h, out_w), window k_h x k_w, stride
 * stride_h, stride_w; the same scale and zero point in and out. */
typedef struct {
    int c, in_h, in_w, out_h, out_w, k_h, k_w, stride_h, stride_w;
} qrt_maxpool2d_t;

/* Average pool (no padding) and global average pool (k = in, out 1 x 1):
 * y = clamp(out_zp + rshift_round((sum_window x - n * in_zp) * mult, shift),
 * act_min, act_max) with n = k_h * k_w the window's size. */
typedef struct {
    int c, in_h, in_w, out_h, out_w, k_h, k_w, stride_h, stride_w;
    int32_t mult;
    int shift;
    int32_t in_zp, out_zp, act_min, act_max;
} qrt_avgpool2d_t;

/* Elementwise add of two tensors of n values:
 * y = clamp(out_zp + rshift_round((a - a_zp) * a_mult + (b - b_zp) * b_mult, shift), act_min, act_max). */
typedef struct {
    int n;
    int32_t a_zp, b_zp, a_mult, b_mult;
    int shift;
    int32_t out_zp, act_min, act_max;
} qrt_add_t;

/* Requantization of n values (one input of a concat, a tensor whose consumers want other parameters):
 * y = clamp(out_zp + rshift_round((x - in_zp) * mult, shift), act_min, act_max). */
typedef struct {
    int n;
    int32_t in_zp, mult;
    int shift;
    int32_t out_zp, act_min, act_max;
} qrt_requant_t;

/* Bytes of scratch the kernel may use beside its input and output (0 if none). The same on every path and
 * compiler, so an arena planned once fits every build. */
size_t qrt_conv2d_scratch(const qrt_conv2d_t *p);

/* y must not overlap x or scratch. scratch may be NULL: the kernel then runs a direct loop that needs none
 * (slower; the same integers), for a device short of RAM. */
void qrt_conv2d(const qrt_conv2d_t *p, const int8_t *x, int8_t *y, void *scratch);
void qrt_dense(const qrt_dense_t *p, const int8_t *x, int8_t *y);
void qrt_maxpool2d(const qrt_maxpool2d_t *p, const int8_t *x, int8_t *y);
void qrt_avgpool2d(const qrt_avgpool2d_t *p, const int8_t *x, int8_t *y);
/* y may be a or b (in place). */
void qrt_add(const qrt_add_t *p, const int8_t *a, const int8_t *b, int8_t *y);
/* y may be x (in place). */
void qrt_requant_n(const qrt_requant_t *p, const int8_t *x, int8_t *y);
/* y[i] = max(x[i], lo) for n values: a relu that could not be fused (lo = the zero point); y may be x. */
void qrt_relu(int n, int32_t lo, const int8_t *x, int8_t *y);
/* Input codes from stored bytes: y[c][i] = table[c][x[c][i]] for c channels of hw values each (table (c, 256)). */
void qrt_quantize_u8(int c, int hw, const int8_t *table, const uint8_t *x, int8_t *y);

/* The SIMD path this build of the runtime uses: "avx2", "neon" or "portable". */
const char *qrt_simd(void);

#ifdef __cplusplus
}
#endif

#endif
