/* qgemm.h - integer GEMM kernels: uint8 activation codes times int8 weight
 * codes, summed exactly in int32, for int8 inference (qlayer_int8.c) and for
 * quantized training's int8 x int8 product (qgemm_s8 in qt.h).
 *
 * Kernel families, chosen at run time (qgemm_isa), the best the CPU and the
 * OS have: AVX-512 VNNI (vpdpbusd on 512 bits, qgemm_x86.c) where they have
 * AVX-512 F/BW/VL/VNNI (Intel Ice Lake servers on, AMD Zen 4 and 5); else
 * AVX-VNNI (vpdpbusd on 256 bits, qgemm_avx2.c: Intel client chips from
 * Alder Lake on); else AVX2 + FMA (qgemm_avx2.c: no
 * byte dot product there, so codes are widened to int16 and multiplied by
 * vpmaddwd, exact); else portable C (qgemm.c). The vector files use function
 * target attributes, so the binary still runs on any x86-64. All give the
 * same int32 sums and the same float outputs bit for bit; the tests compare
 * them. The 256-bit families cover dense, taps, depthwise (strides 1 and 2
 * across; others portable C, which qlayer_int8.c leaves to float emulation)
 * and the quantizers; qgemm_s8 has no 256-bit version and runs portable C
 * there.
 *
 * vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes, adds the four
 * products and the int32 accumulator without saturation (the s variant
 * saturates; it is not used). Activations are therefore unsigned: an int8
 * code q is stored as q + 128 with a zero point raised by 128, and
 *   sum_k (a_k - a_zero) b_k = sum_k a_k b_k - a_zero * sum_k b_k,
 * the second term from the weight's per-output-channel sums, computed once
 * when the weight is packed. The accumulators wrap modulo 2^32 and so do the
 * corrections (unsigned arithmetic in C), so the result is exact whenever
 * the true sum fits in int32: |a - a_zero| <= 255 and |b| <= 128 make that
 * K <= QGEMM_K_MAX for any codes.
 *
 * Float outputs are fmaf((float)sum, scale, bias): one rounding of the
 * product-sum, the same in both kernel families.
 *
 * Nothing here allocates but the pack functions. */
#ifndef QTRAIN_QUANT_QGEMM_H
#define QTRAIN_QUANT_QGEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

#define QGEMM_LANES 16    /* int32 lanes of one vector: columns of a panel, pixels of a vector */
#define QGEMM_ROWS 8      /* rows of one register tile */
#define QGEMM_K_MAX 65536 /* longest sum that is exact for any codes: 65536 * 255 * 128 < 2^31 */

/* The kernel families, slowest first. */
typedef enum {
    QGEMM_ISA_PORTABLE,
    QGEMM_ISA_AVX2,        /* AVX2 and FMA */
    QGEMM_ISA_AVXVNNI,     /* AVX2, FMA and AVX-VNNI */
    QGEMM_ISA_AVX512_VNNI, /* AVX-512 F/BW/VL/VNNI */
    QGEMM_ISA_AMX,         /* AMX-TILE and AMX-INT8 with the above, and the OS's leave (Linux): tiles for the int8 x
                              int8 products (qgemm_s8, qgemm_s8_nn); every other kernel runs its AVX-512 VNNI one */
} QGemmIsa;

/* Tests and benchmarks set this to run the portable kernels on any CPU. */
extern bool qgemm_force_portable;
/* A family to run instead of the best one (tests, benchmarks, QTRAIN_INT8_KERNEL), or -1 (the default): the
 * best the CPU has. Set only a family qgemm_cpu_has_isa accepts; qgemm_force_portable still wins. */
extern int qgemm_force_isa;

/* Whether this CPU (and OS) can run the AVX-512 VNNI kernels. */
bool qgemm_cpu_has_vnni(void);
/* Whether this CPU (and OS) can run family isa (PORTABLE: always). */
bool qgemm_cpu_has_isa(QGemmIsa isa);
/* The family the dispatching functions run now. */
QGemmIsa qgemm_isa(void);
/* The kernels the dispatching functions run now: "amx", "avx512-vnni", "avxvnni", "avx2" or "portable". */
const char *qgemm_kernel_name(void);

/* ---- dense: uint8 rows times a packed int8 weight ------------------------------------------------------------ */

/* The weight b (n, k), k contiguous, packed once. Layout: panels of 16
 * output columns; within a panel, groups of 4 consecutive k; within a
 * group, 16 lanes (columns) of 4 bytes (k):
 *   data[((p * k_groups + g) * 16 + l) * 4 + j] = b[16 p + l][4 g + j],
 * 0 where 16 p + l >= n or 4 g + j >= k. One 64-byte vector holds a group
 * of a panel, the operand of one vpdpbusd against 4 broadcast bytes of a
 * row. Panels are 64-byte aligned. */
typedef struct {
    int n, k;
    int k_groups;      /* ceil(k / 4) */
    int panels;        /* ceil(n / 16) */
    int8_t *data;      /* [panels][k_groups][16][4], layout above */
    int32_t *col_sum;  /* [panels * 16] sum over k of each row of b; 0 in the padding */
} QGemmPackedB;

/* b (n, k) -> *p (allocated; free with qgemm_packed_b_free). n, k >= 1,
 * k <= QGEMM_K_MAX, else QT_ERR_ARG; QT_ERR_NOMEM. On error *p is zeroed. */
QtStatus qgemm_pack_b(QGemmPackedB *p, const int8_t *b, int n, int k, QtError *err);
void qgemm_packed_b_free(QGemmPackedB *p);

/* c = (a - a_zero) b^T over rows and panels, with one of two outputs:
 *   c_i32 (m, ldc)  the int32 sums;
 *   c_f32 (m, ldc)  fmaf((float)sum, scale[j], bias ? bias[j] : 0).
 * Row i of a is k bytes at a + i * lda (nothing past them is read). */
typedef struct {
    const uint8_t *a;      /* (m, lda) codes */
    int lda, m;
    int a_zero;            /* 0..255 */
    const QGemmPackedB *b;
    int32_t *c_i32;        /* exactly one of c_i32 and c_f32 */
    float *c_f32;
    int ldc;
    const float *scale;    /* [n], c_f32 only */
    const float *bias;     /* [n] or NULL, c_f32 only */
} QGemmDense;

/* Rows [row0, row1) and panels [p0, p1) of the product; disjoint ranges
 * may run on different threads. Ranges are clipped to the problem. */
void qgemm_dense(const QGemmDense *d, int row0, int row1, int p0, int p1);
void qgemm_dense_portable(const QGemmDense *d, int row0, int row1, int p0, int p1);

/* c (m, n) int32 = (a - a_zero) b^T with a (m, k) contiguous: the plain u8 x s8 entry. */
void qgemm_u8s8(int32_t *c, const uint8_t *a, int a_zero, const QGemmPackedB *b, int m);
/* The scalar definition on the unpacked weight b (n, k), for tests. */
void qgemm_u8s8_ref(int32_t *c, const uint8_t *a, int a_zero, const int8_t *b, int m, int n, int k);

/* ---- taps: a shifted GEMM for convolutions without im2col ------------------------------------------------------ */

/* out[r][q] = sum over taps t of dot4(w[r][t], act[off[t] + q]) - a_zero * row_sum[r]
 * where act is an array of dwords (4 uint8 codes each), w[r][t] a dword of
 * 4 int8 weights, and q runs over pixels 16 at a time. A convolution is
 * this with one tap per (channel group, kernel offset): the activation
 * planes hold 4 channels (or 4 kernel columns) per dword and the tap's
 * offset shifts the plane by the kernel offset, so no im2col matrix is
 * built (qlayer_int8.c). Packed layout: blocks of 8 rows, then taps, then
 * the 8 rows' dwords:
 *   data[(rb * taps + t) * 8 + s] = w[8 rb + s][t], 0 for rows >= rows,
 * the 8 broadcasts of one tap adjacent in memory. */
typedef struct {
    int rows, taps;
    int row_blocks;    /* ceil(rows / 8) */
    int32_t *data;     /* [row_blocks][taps][8], layout above; 64-byte aligned */
    int32_t *row_sum;  /* [row_blocks * 8] sum of the 4 * taps int8 weights of each row */
    int16_t *wide;     /* [row_blocks][taps][8][4] data's bytes sign-extended: the AVX2 kernel's broadcasts */
    int32_t *tiles;    /* [8 row_blocks + 8][taps] w row-major, 0 past rows: the AMX kernel's A tiles (16 rows from
                        * any block's first); NULL unless the CPU has AMX and taps is a multiple of 16 */
} QGemmPackedTaps;

/* w (rows, taps) dwords, byte j of w[r][t] (little-endian) the int8 weight
 * of lane j -> *p. rows, taps >= 1, 4 * taps <= QGEMM_K_MAX, else
 * QT_ERR_ARG; QT_ERR_NOMEM. On error *p is zeroed. */
QtStatus qgemm_pack_taps(QGemmPackedTaps *p, const uint32_t *w, int rows, int taps, QtError *err);
void qgemm_packed_taps_free(QGemmPackedTaps *p);

/* qgemm_quantize_u8's arguments s, lo, hi, zero. */
typedef struct {
    float s, lo, hi;
    int zero;
} QGemmCodes;

/* A producer's outputs as the codes its reader takes instead of floats: each value y quantized as
 * qgemm_quantize_u8 quantizes it (the same bits), stored plain (quad_plane 0: output channel i's P codes at
 * dst + i P, P the outputs of a channel) or by channel quads (dword p of quad g at dst + 4 (g quad_plane + p),
 * bytes 0 .. 3 the codes of channels 4 g .. 4 g + 3, the zero point for channels past the last), i counted from
 * the call's first output channel. */
typedef struct {
    QGemmCodes q;
    uint8_t *dst;
    size_t quad_plane;         /* 0: plain; else dwords per quad, at least P */
} QGemmCodesOut;

/* What the taps kernels make of y = fmaf((float)sum, scale[r], bias ? bias[r] : 0). */
typedef enum {
    QGEMM_EPI_NONE,       /* y */
    QGEMM_EPI_RELU,       /* y > 0 ? y : 0 (a NaN gives 0), as nn's relu */
    QGEMM_EPI_RELU_POOL2, /* the relu'd outputs' 2x2 maximum, stride 2, as nn's maxpool2d(2, 2) after the relu */
} QGemmEpi;

/* Vector v covers q = 16 v .. 16 v + 15; the lanes in vec_mask[v] are
 * outputs, stored in lane order to out[r * ldo + vec_pos[v] + 0, 1, ...]
 * (so a row of a padded plane lands on a row of the unpadded output):
 *   out = y, or relu(y) (epi).
 * QGEMM_EPI_RELU_POOL2 instead reads pixel q as output pixel (q / pitch,
 * q % pitch) and stores the window maxima
 *   out[r * ldo + i * pool_w + j] = max of relu(y) at (2i + a, 2j + b), a, b in {0, 1},
 * for i < pool_h, j < pool_w (2 pool_h and 2 pool_w within the pixels the
 * vectors cover); vec_mask and vec_pos are unused. A window needs whole
 * rows, so that epilogue computes every vector of each row block: v0 and
 * v1 are ignored, and each call needs a pool_buf of its own. A pitch of
 * 16, 32 or 48 (rows of whole vectors) lets the VNNI kernels take the
 * windows in registers, without the pool buffer, and skip a last odd row.
 * With res (epi NONE, no pool), each output is y + res[r * ldo + vec_pos[v]
 * + k] (nn_add's sum), relu'd if res_relu (a residual block's sum and relu).
 * With codes (no pool), the outputs go to codes' layout instead, channel r
 * at pixel vec_pos[v] + k, P = ldo (the channels past rows in the last quad
 * the zero point), and qgemm_taps returns false if some output is NaN or
 * infinite; with floats_too, out gets the floats as well. The VNNI and
 * portable kernels add res and quantize in their
 * epilogue (out unused with codes); the others write the floats to out
 * first (scratch then), and qgemm_taps adds and quantizes after. */
typedef struct {
    const uint8_t *act;        /* dwords; the kernels read act[4 (off[t] + q) ...] for q < 16 n_vec */
    const int32_t *tap_off;    /* [taps] >= 0, in dwords */
    int n_vec;
    const uint16_t *vec_mask;  /* [n_vec] */
    const int32_t *vec_pos;    /* [n_vec] */
    const QGemmPackedTaps *w;
    int a_zero;                /* 0..255 */
    float *out;                /* (rows, ldo) */
    size_t ldo;
    const float *scale;        /* [rows] */
    const float *bias;         /* [rows] or NULL */
    QGemmEpi epi;
    int pitch, pool_h, pool_w; /* QGEMM_EPI_RELU_POOL2 only, as above */
    float *pool_buf;           /* QGEMM_EPI_RELU_POOL2 only: [8][16 n_vec] floats, 64-byte aligned, overwritten */
    int16_t *act_wide;         /* the AVX2 family: qgemm_taps_act_wide_bytes(g) bytes, 32-byte aligned, overwritten
                                * with the codes the call reads widened to int16 (without it, the portable kernel
                                * runs); the other families ignore it */
    const QGemmCodesOut *codes; /* or NULL: the outputs as floats in out */
    const float *res;          /* (rows, ldo) or NULL: y + res at y's out index, then relu'd if res_relu (epi NONE) */
    bool res_relu;
    bool floats_too;           /* with codes: the floats go to out as well */
} QGemmTaps;

/* Bytes of g->act_wide for the family qgemm_isa() runs now: 8 (max tap_off + 16 n_vec) for AVX2, else 0. */
size_t qgemm_taps_act_wide_bytes(const QGemmTaps *g);

/* Row blocks [rb0, rb1) and vectors [v0, v1); disjoint ranges may run on different threads. The AMX family
 * runs the taps on tiles where they form one strided operand (tap t at off[0] + t d: a 1x1 convolution's channel
 * quads), their count is a multiple of 16 and no pool follows; every other case takes the AVX-512 VNNI kernel. */
bool qgemm_taps(const QGemmTaps *g, int rb0, int rb1, int v0, int v1);
bool qgemm_taps_portable(const QGemmTaps *g, int rb0, int rb1, int v0, int v1);
/* Whether qgemm_taps sums g's res and quantizes its outputs in the kernel's epilogue on the family that runs now
 * (else through out). */
bool qgemm_taps_codes_direct(const QGemmTaps *g);

/* ---- depthwise: one input channel per output channel ------------------------------------------------------------ */

/* The weight of a convolution whose every output channel reads one input
 * channel (depthwise; w (OC, 1, KH, KW)), packed once: per output channel
 * and kernel row, the kernel columns in dwords of 4 (a "quad"), byte j of
 * quad q the int8 weight of column 4 q + j, 0 past KW:
 *   data[(oc * kh + r) * kq + q] = w[oc][0][r][4 q + 0 .. 3].
 * One dword meets 4 consecutive input codes of a row, one vpdpbusd. */
typedef struct {
    int channels, kh, kw;
    int kq;            /* ceil(kw / 4) */
    int32_t *data;     /* [channels][kh][kq], layout above */
    int32_t *sum;      /* [channels] sum of each channel's kh * kw weights */
} QGemmPackedDw;

/* w (channels, kh * kw) int8 codes -> *p. channels, kh, kw >= 1, kh * kw <= QGEMM_K_MAX, else QT_ERR_ARG;
 * QT_ERR_NOMEM. On error *p is zeroed. */
QtStatus qgemm_pack_dw(QGemmPackedDw *p, const int8_t *w, int channels, int kh, int kw, QtError *err);
void qgemm_packed_dw_free(QGemmPackedDw *p);

/* Output channels [oc0, oc0 + n_oc) of one image, each reading one input
 * channel's codes (in_h, in_w), unpadded: all of them act's (in_plane 0,
 * a depthwise conv of several outputs per input channel), or each its own
 * (in_plane > 0: output channel oc0 + i reads act + i in_plane, one output
 * per input channel). Code u(i, j) = act[i in_w + j] inside, a_zero (whose
 * term is 0) in the padding around it, pad_t rows above and pad_l columns
 * left (and below and right as far as the outputs reach):
 *   s = sum over r < kh, c < kw of (u(oh sh + r - pad_t, ow sw + c - pad_l) - a_zero) w[oc][r][c]
 *   y = fmaf((float)s, scale[oc], bias ? bias[oc] : 0), relu'd if relu (as nn's relu: 0 unless y > 0)
 *   out[(oc - oc0) * oh_n * ow_n + oh * ow_n + ow] = y,
 * or, with codes, y's code in codes' layout (qgemm_dw then returns false if
 * some y is NaN or infinite; out is scratch then, overwritten on the paths
 * that make the floats first). The VNNI kernel first gathers each padded
 * row's dwords of 4 codes for every output column into scratch
 * (qgemm_dw_scratch bytes, 64-byte aligned; masked loads, so nothing
 * outside act is read), except for 3-row kernels of up to 4 columns at
 * stride 1 with one output per input channel: those gather each row in
 * registers, run 4 channels at a time and quantize there; the AVX2 one
 * widens the padded rows in scratch to int16 (reading nothing outside act
 * either); the portable one sums the codes directly. */
typedef struct {
    const uint8_t *act;        /* (in_h, in_w), or (n_oc, in_plane) */
    size_t in_plane;           /* 0, or the bytes from one input channel's codes to the next */
    int in_h, in_w, pad_t, pad_l;
    int oh_n, ow_n, sh, sw;    /* output rows and columns, strides */
    const QGemmPackedDw *w;
    int oc0, n_oc;
    int a_zero;                /* 0..255 */
    float *out;                /* (n_oc, oh_n, ow_n) */
    const QGemmCodesOut *codes; /* or NULL: the outputs as floats in out */
    const float *scale;        /* [channels] */
    const float *bias;         /* [channels] or NULL */
    bool relu;
    uint32_t *scratch;         /* VNNI, AVX2: qgemm_dw_scratch bytes */
} QGemmDw;

size_t qgemm_dw_scratch(const QGemmPackedDw *w, int oh_n, int ow_n, int sh);
bool qgemm_dw(const QGemmDw *d);
/* The plain C definition (exact int32 sums, one fmaf, the codes of qgemm_quantize_u8_portable), bit for bit the
 * VNNI kernels' outputs. */
bool qgemm_dw_portable(const QGemmDw *d);

/* ---- quantizing activations ------------------------------------------------------------------------------------ */

/* dst[i] = rint(clamp(x[i] / s, lo, hi)) + zero: fake quantization's codes
 * (the bounds are whole numbers, so clamping before rounding is clamping
 * after), shifted to 0..255 (lo + zero >= 0, hi + zero <= 255). False if
 * some x[i] is NaN or infinite (dst is then unspecified). */
bool qgemm_quantize_u8(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero);
bool qgemm_quantize_u8_portable(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero);


/* Four float planes straight to the dwords of the taps kernels' channel
 * groups: for h < rows, i < n,
 *   dst[h * ldd + i] = u0 | u1 << 8 | u2 << 16 | u3 << 24,  uk = the code of x[k][h * ldx + i]
 * as qgemm_quantize_u8 makes it, or zero where x[k] is NULL. False if some
 * value is NaN or infinite (dst is then unspecified). */
bool qgemm_quantize_u8x4(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows, int n,
                         const QGemmCodes *c);
bool qgemm_quantize_u8x4_portable(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows, int n,
                                  const QGemmCodes *c);

/* qgemm_quantize_u8x4 from codes: four byte planes' rows to the taps kernels' dwords, for h < rows, i < n,
 *   dst[h * ldd + i] = s0[h * lds + i] | s1[...] << 8 | s2[...] << 16 | s3[...] << 24,  sk = src[k].
 * Writes those dwords only; may read up to 15 bytes past each source row's n-th byte. */
void qgemm_interleave_u8x4(uint32_t *dst, size_t ldd, const uint8_t *const src[4], size_t lds, int rows, int n);
void qgemm_interleave_u8x4_portable(uint32_t *dst, size_t ldd, const uint8_t *const src[4], size_t lds, int rows,
                                    int n);

/* Four strided byte sources to the taps kernels' dwords (a strided conv's im2col, "cols"), rows of n: for h < rows,
 * i < n, with s_k = src[k] + h * step[k] and at = i * stride,
 *   dst[h * n + i] = s_0[at] | s_1[at] << 8 | s_2[at] << 16 | s_3[at] << 24.
 * Writes dst[0, rows * n) only; may read up to QGEMM_GATHER_SLACK bytes past a row's last byte (the caller's
 * buffer has them). The AVX2 families take stride 2 sixteen dwords at a time; the rest is the portable loop. */
#define QGEMM_GATHER_SLACK 64
void qgemm_gather_u8x4(uint32_t *dst, const uint8_t *const src[4], const size_t step[4], int rows, int n, int stride);
void qgemm_gather_u8x4_portable(uint32_t *dst, const uint8_t *const src[4], const size_t step[4], int rows, int n,
                                int stride);

#endif
