/* qarray.h - QArray: a tensor of quantized codes with its scales.
 *
 *   x ≈ (q - zp) * broadcast(scale)
 *
 * q are the element codes of a qtype (bit-packed as qtype_pack does: 4-bit
 * element 2k in the high nibble of byte k), decoded with qtype_decode (code
 * units for the integer kinds, element values for the float, nf4 and
 * ternary/binary kinds). The scale tensor has the array's rank; along each
 * axis d it is
 *   shape[d]          channelwise: one scale per index,
 *   1                 shared over the whole axis,
 *   shape[d] / tile   tiled (blockwise, sub-channel): one per tile.
 * Per-tensor, per-channel and per-block quantization are all this one
 * description (Qwix's channelwise_axes / tiled_axes). The optional zero
 * point has the scale's shape.
 *
 * Numerics (DESIGN.md, "Quantization"). t is the calibrated range
 * (symmetric: t = max(-lo, hi)), qmin..qmax the format's code range:
 *   signed int, symmetric:  scale = t / (qmax + 1/2), codes clamp to
 *       [qmin, qmax]; narrow_range: scale = t / qmax, codes clamp to
 *       [-qmax, qmax]. The half step puts t on the rounding boundary of the
 *       extreme code, so no value is off by more than half a step.
 *   asymmetric (int and uint): lo- = min(lo, 0), hi+ = max(hi, 0),
 *       scale = (hi+ - lo-) / (qmax - qmin), zp = clamp(qmin - rne(lo- /
 *       scale), qmin, qmax), q = clamp(round(x / scale) + zp, qmin, qmax).
 *       For a signed int, qmin..qmax is its signed range (narrow_range:
 *       -qmax..qmax). 0 is exactly code zp. The rounding of x / scale comes
 *       before zp is added, so ties go to even on the grid of the data.
 *       Float zero points (zp_type float, AMD Quark's float32 zero point):
 *       zp = qmin - lo- / scale unrounded and q = clamp(round(x / scale +
 *       zp)); lo- and hi+ map exactly to qmin and qmax, and 0 is no longer
 *       exactly representable.
 *   uint, symmetric ("unsigned", ModelOpt's unsigned=True): zp = 0,
 *       scale = t / qmax, negative values clamp to code 0. uint formats are
 *       asymmetric by default (QARRAY_RANGE_AUTO).
 *   float formats (fp8/fp6/fp4, eXmY): scale = t / format max; codes are
 *       qtype_encode of x / scale (saturating clamp, then rounding on the
 *       element grid).
 *   nf4 (and every LUT kind): scale = t / max|table| (= t, the absmax),
 *       x / scale to the nearest table value (a tie to the lower code).
 *       Without axes in the options, nf4 is quantized in blocks of 64 along
 *       the last axis, every other axis channelwise (bitsandbytes' default
 *       blocks of 64 consecutive elements).
 *   ternary, binary: scale = mean |x| over the slice, then clamp(rne(x /
 *       scale), -1, 1) (ternary) or sign(x) (binary). Ternary is BitNet
 *       b1.58's "absmean" quantizer (Ma et al. 2024, eq. 1-3); for binary,
 *       alpha = mean |x| is the scale that minimises ||x - alpha sign(x)||^2
 *       (XNOR-Net, Rastegari et al. 2016). An explicit calibration replaces
 *       mean |x|: scale = t, so t maps to the code +1.
 *   MX (mxfp8_e4m3, mxfp6_e3m2, mxfp4, mxint8) and mx6/mx9: the shared
 *       scales are those of qtype_block_quantize (e8m0 per 32 elements, or
 *       the shared exponent per 16 for mx6/mx9), over blocks along the last
 *       axis (every other axis channelwise, so a block never spans rows);
 *       the codes field holds the packed blocks, scales included.
 *       Tiling is fixed by the format; axes, calibration, an asymmetric
 *       range, float16/bfloat16 scales and double quantization are errors.
 *   A scale below 1e-19 (an all-zero slice) becomes 1, never a division by
 *       0; the codes of an all-zero slice are those of 0.
 *
 * Re-quantizing a dequantized QArray with the same options gives the same
 * codes, with one exception built into the default signed int rule: a
 * slice's extreme dequantizes to qmax * s or (qmax + 1) * s, which moves the
 * new scale so that a code -qmax (or -qmax-1) lands exactly on the tie
 * -(qmax + 1/2), and the two codes may swap. narrow_range has no such tie.
 *
 * Calibration: options.calib NULL means absmax for a symmetric range and
 * minmax for an asymmetric one (mean |x| for ternary/binary); any CalibSpec
 * of calib.h can be given. Its methods that quantize (mse) or count levels
 * (entropy, kl_j) see this format's round trip (rne) and 2^(bits-1) levels.
 *
 * Scale types: the scale is rounded to the scale type before any code is
 * computed, and stored in that type, so dequantize uses exactly the stored
 * scale and qarray_bytes counts what the type takes:
 *   float32   4 bytes per scale (default);
 *   float16   2 bytes: round-to-nearest-even of the float32 scale (IEEE
 *             binary16, subnormals included); a scale that rounds past
 *             65504 is QT_ERR_VALUE; one that rounds to 0 becomes 2^-24,
 *             the smallest subnormal (a larger scale never clips, it only
 *             coarsens the grid);
 *   bfloat16  2 bytes: round-to-nearest-even to 8 significant bits;
 *   pof2      1 byte (e8m0: 2^(code - 127)): 2^ceil(log2 scale). Ceil,
 *             not round: the stored scale is never below the calibrated
 *             one, so the calibrated range stays representable and nothing
 *             clips that calibration kept (rounding to nearest could lose up
 *             to 29% of the range; ceil costs at most a 2x coarser step).
 *             TQT (Jain et al. 2019) takes the power of two the same way.
 *
 * Rounding (options.round, qtype.h's QRound) acts on x / scale on the
 * format's grid. Stochastic rounding is floor(v + u) on the grid, u in
 * [0, 1) from options.rng, drawn in a fixed order: element i of x (flat,
 * row-major) takes the i-th 32-bit word rng_fill_u32 produces from the rng's
 * state at the call (u_i = rng_u32_to_unit(word i)), every element one word
 * whether it needs it or not. The rng advances by ceil(numel / 4) blocks, so
 * the same state gives the same codes bit for bit, and consecutive calls
 * draw fresh noise.
 *
 * Double quantization (options.double_quant; bitsandbytes'
 * compress_statistics, QLoRA, Dettmers et al. 2023): the block scales s,
 * taken in the scale tensor's row-major order, are offset by their mean m
 * (float32), and the offsets are quantized blockwise, dq_block (256) scales
 * per block, each block with a float32 absmax a_j: code_i = nearest entry
 * of the 8-bit map to (s_i - m) / a_j. The map is bitsandbytes' default for
 * quantize_blockwise, the signed dynamic map (create_dynamic_map(signed=
 * True): Dettmers 2016, "8-Bit Approximations for Parallelism in Deep
 * Learning"), not a linear int8: 127 positive values 10^(k-6) * (0.1 + (j +
 * 1/2) * 0.9 / 2^k), j < 2^k, k = 0..6, their negatives, 0 and 1 (see
 * qarray_dq_map). The reconstructed scale s'_i = map[code_i] * a_j + m
 * (rounded to float32 once) is the one the element codes are computed
 * with and the one dequantize uses; bitsandbytes computes the codes with s
 * and dequantizes with s', which makes the two disagree. Storage: one byte
 * per scale, 4 per block of 256, 4 for m. For nf4 in blocks of 64 that is
 *   4 + 8/64 + 32/(64 * 256) + 32/N  ≈ 4.127 bits per element
 * (4.5 without). Next to an outlier slice, the mean and the block absmax
 * are so large that a small slice's s'_i is coarse or even negative; its
 * codes are computed with s'_i all the same (x / s'_i), so its values shrink
 * towards 0 instead of growing, and if |s'_i| < 1e-19 its codes are those of
 * 0. Double quantization needs a symmetric range, float32 scales and a
 * non-block format.
 *
 * Errors: a NaN or Inf in x is QT_ERR_VALUE naming the first (flat) index;
 * a tile that does not divide its axis is QT_ERR_SHAPE naming the axis, its
 * size and the tile; an axis out of range or listed twice, and an option the
 * format or the other options cannot use, are QT_ERR_ARG naming the option.
 * Zero-sized arrays are valid.
 *
 * Fake quantization: fq_fake_quant_dynamic / fq_fake_quant_qarray
 * (fakequant.h) slice and quantize through the same code (qarray_plan.h),
 * so with the same options they return qarray_dequantize's values bit for
 * bit (double quantization aside).
 *
 * Lifetimes: qarray_quantize allocates every buffer of the QArray (and
 * scratch it frees again); the QArray owns them until qarray_free. Nothing
 * else allocates: dequantize and the accessors work on the stored data with
 * stack scratch only, so they suit a per-step path. A QArray is not changed
 * after quantize, so any number of threads may read it. */
#ifndef QTRAIN_QUANT_QARRAY_H
#define QTRAIN_QUANT_QARRAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"
#include "base/rng.h"
#include "quant/calib.h"
#include "quant/qtype.h"

#define QARRAY_MAX_DIMS 4
#define QARRAY_NF4_BLOCK 64  /* nf4's default block along the last axis */
#define QARRAY_DQ_BLOCK 256  /* double quantization: scales per float32 absmax */
#define QARRAY_SCALE_MIN 1e-19f /* smaller scales become 1 */

typedef enum {
    QARRAY_SCALE_F32 = 0,
    QARRAY_SCALE_F16,
    QARRAY_SCALE_BF16,
    QARRAY_SCALE_POF2, /* stored as e8m0; the scale of the MX formats */
    QARRAY_SCALE_COUNT
} QArrayScaleType;

typedef enum { QARRAY_ZP_INT32 = 0, QARRAY_ZP_FLOAT, QARRAY_ZP_COUNT } QArrayZpType;

typedef enum {
    QARRAY_RANGE_AUTO = 0,   /* asymmetric for uint formats, symmetric otherwise */
    QARRAY_RANGE_SYMMETRIC,
    QARRAY_RANGE_ASYMMETRIC, /* int and uint formats only */
    QARRAY_RANGE_COUNT
} QArrayRange;

typedef struct {
    int axis;    /* -ndim..ndim-1; negative counts from the end */
    double tile; /* >= 1: elements per tile, a whole number; in (0, 1): a fraction of the axis,
                    tile = round(shape[axis] * fraction) (0.25: 4 tiles), as Qwix does */
} QArrayTiledAxis;

/* All-zero is the default: per-tensor, absmax (minmax when asymmetric),
 * symmetric (asymmetric for uint), float32 scales, int32 zero points, rne,
 * no double quantization. */
typedef struct {
    int n_channelwise;
    int channelwise_axes[QARRAY_MAX_DIMS]; /* [n_channelwise] one scale per index along these */
    int n_tiled;
    QArrayTiledAxis tiled_axes[QARRAY_MAX_DIMS]; /* [n_tiled] */
    const CalibSpec *calib;   /* NULL: the default above; not owned, read during quantize only */
    QArrayRange range;
    bool narrow_range;        /* signed int only: codes -qmax..qmax */
    QArrayScaleType scale_type;
    QArrayZpType zp_type;     /* asymmetric only */
    QRound round;
    Rng *rng;                 /* QROUND_STOCHASTIC only (and then required); advanced by ceil(numel / 4) blocks */
    bool double_quant;
    int dq_block;             /* scales per double-quantization block; 0: QARRAY_DQ_BLOCK */
} QArrayOptions;

/* Double-quantized block scales: scale i = map[codes[i]] * absmax[i / block] + offset. */
typedef struct {
    uint8_t *codes;  /* [n_scales] codes of the 8-bit dynamic map (qarray_dq_map) */
    float *absmax;   /* [n_blocks] absmax of (scale - offset) over each block of `block` scales */
    float offset;    /* mean of the block scales */
    int block;       /* scales per block (256) */
    size_t n_blocks; /* ceil(n_scales / block) */
} QArrayDq;

typedef struct {
    const QType *qtype;
    int ndim;                            /* 0..QARRAY_MAX_DIMS */
    int shape[QARRAY_MAX_DIMS];          /* [ndim] the original shape */
    size_t numel;                        /* product of shape */
    int scale_shape[QARRAY_MAX_DIMS];    /* [ndim] shape[d] (channelwise), 1 (shared) or shape[d] / tile[d] */
    int tile[QARRAY_MAX_DIMS];           /* [ndim] elements per scale along d: 1, shape[d] or the tile
                                            (a zero-sized axis keeps the tile it was given) */
    size_t n_scales;                     /* product of scale_shape */
    uint8_t *codes;                      /* [code_bytes] packed codes (qtype_pack), or for block formats
                                            the packed blocks in row-major order, their scales included */
    size_t code_bytes;                   /* qtype_packed_bytes(qtype, numel) */
    QArrayScaleType scale_type;          /* POF2 for the block formats */
    union {
        float *f32;     /* [n_scales] QARRAY_SCALE_F32 */
        uint16_t *bits; /* [n_scales] F16 / BF16 bit patterns */
        uint8_t *e8m0;  /* [n_scales] POF2: scale 2^(e8m0 - 127) */
    } scale;            /* all NULL for block formats (in the blocks) and with double quantization */
    bool asymmetric;                     /* there is a zero point */
    QArrayZpType zp_type;
    union {
        int32_t *i32;   /* [n_scales] QARRAY_ZP_INT32, in code units */
        float *f32;     /* [n_scales] QARRAY_ZP_FLOAT */
    } zero_point;       /* NULL when symmetric */
    bool double_quant;
    QArrayDq dq;                         /* with double_quant */
    bool narrow_range;                   /* as quantized, for re-quantizing alike */
    QRound round;
} QArray;

/* ---- quantize / dequantize ------------------------------------------------- */

/* x [numel] (row-major, shape[0..ndim-1], 0 <= ndim <= 4; NULL allowed
 * when numel = 0) -> *out. options NULL: all defaults. *out is overwritten
 * without being freed (pass a zeroed or qarray_free'd QArray); on error it
 * is left zeroed and nothing leaks. Errors as listed above, QT_ERR_NOMEM. */
QtStatus qarray_quantize(QArray *out, const float *x, int ndim, const int *shape, const QType *qtype,
                         const QArrayOptions *options, QtError *err);

/* q -> out [numel], row-major in q's shape. Never allocates. Vectorised
 * for 4- and 8-bit codes where the CPU allows (AVX2, AVX-512; chosen at run
 * time); a large range (32768 elements or more per task) is split over the
 * step's thread pool (base/parallel.h; serial inside a pool task). The bits
 * are the same however it runs: every element is (code value - zero point)
 * * scale, two IEEE operations (qarray_deq.h). */
void qarray_dequantize(const QArray *q, float *out);

/* Rows [row0, row0 + n_rows) of q seen as (numel / last dim, last dim) ->
 * out [n_rows * last dim]: a slice of a weight dequantized right before its
 * GEMM. A 0-d array has one row of one element. QT_ERR_ARG if the rows are
 * out of range. Never allocates; vectorised and split as qarray_dequantize. */
QtStatus qarray_dequantize_rows(const QArray *q, size_t row0, size_t n_rows, float *out);

void qarray_free(QArray *q);

/* The scale and zero-point rules of one slice, shared with fake
 * quantization so both give the same numbers. qmin/qmax: the format's
 * effective code range (narrow applied). The scale follows DESIGN.md
 * (symmetric int amax/(qmax+0.5), narrow amax/qmax, uint amax/qmax, LUT
 * amax/largest code, float amax/max, ternary/binary amax; asymmetric
 * (max+ - min-)/(qmax - qmin)), before any scale type, and is 1 where it
 * would fall below QARRAY_SCALE_MIN or is not finite. The zero point is
 * qmin - lo/s (rounded unless zp_float), clamped to [qmin, qmax]. */
float qarray_scale_for_range(const QType *t, bool asym, bool narrow, float qmin, float qmax, float lo, float hi);
float qarray_zero_point_for_range(bool zp_float, float qmin, float qmax, float lo, float s);
/* Levels of |x| that entropy and kl_j calibration spread over [0, t]:
 * 2^b for a symmetric (unsigned-mode) uint, whose codes all cover the
 * non-negative side, else 2^(b-1); at least 2. */
int qarray_calib_levels(const QType *t, bool asym);

/* ---- scales and sizes ------------------------------------------------------ */

/* Scale i (row-major in scale_shape) as a float: decoded from its scale
 * type, reconstructed from the double quantization, or, for block formats,
 * the block's 2^(e8m0 - 127) (mx6/mx9: the shared exponent's power of two;
 * the per-element factors of qtype.h, mxint8's 2^-6 or the micro-exponents,
 * come on top). NaN for i out of range. */
float qarray_scale_at(const QArray *q, size_t i);
/* Zero point i in code units; 0 when symmetric or i out of range. */
float qarray_zero_point_at(const QArray *q, size_t i);
/* All scales -> out [n_scales]. */
void qarray_scales(const QArray *q, float *out);

/* Bytes held: codes + scales in their type + zero points + double
 * quantization data (codes, block absmaxes, offset). Bookkeeping fields of
 * the struct are not counted. */
size_t qarray_bytes(const QArray *q);
/* qarray_bytes * 8 / numel; 0 for an empty array. */
double qarray_bits_per_element(const QArray *q);

/* "float32", "float16", "bfloat16", "pof2"; "unknown" outside the enum. */
const char *qarray_scale_type_name(QArrayScaleType t);
/* Case-insensitive, also "f32", "fp32", "f16", "fp16", "bf16"; QT_ERR_ARG listing the names otherwise. */
QtStatus qarray_scale_type_parse(const char *name, QArrayScaleType *out, QtError *err);
/* "int32", "float"; "unknown" outside the enum. */
const char *qarray_zp_type_name(QArrayZpType t);
QtStatus qarray_zp_type_parse(const char *name, QArrayZpType *out, QtError *err);

/* ---- scale types and double quantization (qarray_dq.c) --------------------- */

/* Float <-> IEEE binary16 / bfloat16 bits, round-to-nearest-even; an
 * overflow gives the infinity code. */
uint16_t qarray_f32_to_f16(float v);
float qarray_f16_to_f32(uint16_t h);
uint16_t qarray_f32_to_bf16(float v);
float qarray_bf16_to_f32(uint16_t b);

/* The signed 8-bit dynamic map of double quantization: 256 ascending,
 * distinct values from -0.99296875 to 1, with 0 at index 127. Built once;
 * the values are computed in double and rounded to float32 (bitsandbytes
 * builds them in float32 arithmetic, so a value may differ in its last
 * bit). */
const float *qarray_dq_map(void);

/* Compresses scales [n] (all finite) into dq (allocating codes and absmax;
 * on failure dq is left empty) and writes the reconstructed scales to
 * rebuilt [n]. block >= 1. QT_ERR_NOMEM. */
QtStatus qarray_dq_compress(QArrayDq *dq, const float *scales, size_t n, int block, float *rebuilt, QtError *err);
/* Reconstructed scale i: (float)(map[codes[i]] * absmax[i / block] + offset), the product and sum in double. */
float qarray_dq_scale(const QArrayDq *dq, size_t i);
void qarray_dq_free(QArrayDq *dq);

#endif
