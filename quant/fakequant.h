/* fakequant.h - fake quantization as tape ops: the forward quantizes and
 * dequantizes at once, the backward is a straight-through estimator (STE).
 * Learnable ranges (TQT, LSQ) are parameters the op reads and whose grads it
 * accumulates; a CalibQuant describes any QType to the calibration methods.
 *
 * Two ops differ in where the scales come from:
 *   fq_fake_quant          given scales (and zero points): one per tensor,
 *                          or one per index along `axis` (per channel).
 *   fq_fake_quant_dynamic  scales calibrated from x on every call, with
 *   fq_fake_quant_qarray   everything QArray takes (qarray.h): channelwise
 *                          axes, tiled axes (per-block / sub-channel scales,
 *                          tile as a count or a fraction of the axis), any
 *                          calibration, symmetric or asymmetric, narrow
 *                          range, int32 or float zero points, float32 /
 *                          float16 / bfloat16 / pof2 scales, every rounding
 *                          mode, and the block formats (MX, mx6/mx9). The
 *                          two differ only in how they are told: a
 *                          FakeQuantSpec, or QArrayOptions themselves.
 * Per-block scales and the block formats go through the dynamic op only:
 * QAT recalibrates its weights on every step anyway, and a static range of
 * activations is one scale per tensor or channel.
 *
 * Forward. The dynamic op's y is exactly what qarray_quantize with the same
 * options (and the same rng state) stores and qarray_dequantize returns, bit
 * for bit: it slices x with QArray's own plan and applies QArray's rules to
 * every slice (the scale rounded to the scale type before any code is
 * computed, the zero point from the rounded scale, qtype_block_quantize /
 * qtype_block_dequantize per block for the block formats). The static op
 * gives the same numbers for the scales it is given. With the scale s and
 * zero point zp of the element's slice (zp = 0 when symmetric):
 *   int, uint:  y = clamp(round(x / s), qmin - zp, qmax - zp) * s, the
 *               rounding before the shift (int32 zero points); with float
 *               zero points y = (round(clamp(x / s + zp, qmin, qmax)) - zp) * s.
 *               qmin..qmax is the format's code range, -qmax..qmax with
 *               narrow_range (signed int only).
 *   float (fp8/fp6/fp4, eXmY), nf4, ternary, binary:
 *               y = qtype_decode(qtype_encode(x / s)) * s: saturation to
 *               the format's extremes, then rounding on its grid.
 *   block formats: each block of the last axis through its own shared
 *               scale, 2^k (MX: k is the e8m0 scale, mxint8's 2^-6 included;
 *               mx6/mx9: the shared exponent less the sub-block's
 *               micro-exponent, in units of the element's last magnitude bit).
 *
 * Representable range of a slice, in units of s: [elo, ehi] =
 *   [qmin - zp, qmax - zp] for int/uint (symmetric uint: [0, qmax]),
 *   [-max, max] for the float formats, [lut[0], lut[last]] = [-1, 1] for
 *   nf4, [-1, 1] for ternary and binary; for a block format, in units of
 *   2^k, [-max, max] of the element format (fp4 6, fp6_e3m2 28, fp8_e4m3
 *   448, mxint8 127, mx9 127, mx6 15).
 *
 * Backward (FQ_STE_CLIPPED, the default): dx += dy where
 * elo <= x / s <= ehi (block formats: |x| 2^-k <= max) and nothing
 * elsewhere - the straight-through estimator with clipping of NVIDIA
 * ModelOpt's fake quantization ("for -amax <= input <= amax the gradient
 * passes straight through, otherwise the gradient is zero") and of Qwix,
 * each element judged by its own slice's or block's scale. An element that
 * saturates gets no gradient: with absmax scales that is the positive
 * extreme of a symmetric int slice (x / s = qmax + 1/2), and the largest
 * values of an MX block when they scale beyond the element max (OCP's
 * shared scale 2^(floor(log2 amax) - emax) maps amax into [2^emax,
 * 2^(emax+1)), e.g. [4, 8) for fp4, whose max is 6). FQ_STE_PASS
 * passes dy everywhere (ModelOpt's legacy function). Scales and zero points
 * are constants: no gradient reaches them (also in the dynamic op, whose
 * scales are computed from x). The dynamic op keeps one bit per element for
 * its backward.
 *
 * Rounding (spec.round, qtype.h's QRound) acts on x / s as in qarray.h.
 * Stochastic rounding draws from spec.rng, or from the tape's rng when that
 * is NULL (give the op a stream of its own, RNG_STREAM_ROUNDING, so dropout
 * and rounding do not share one): element i (flat, row-major) takes the
 * i-th 32-bit word rng_fill_u32 produces from the rng's state at the call,
 * every element one word, and the rng advances by ceil(numel / 4) blocks -
 * the same draws as qarray_quantize (for the block formats too), so a
 * fake-quantized tensor equals the QArray quantized from the same rng
 * state, and a resumed run repeats them.
 *
 * Learned ranges (fq_learned_quant; Jain et al. 2019 "Trained Quantization
 * Thresholds", Esser et al. 2020 "Learned Step Size Quantization"). int or
 * uint formats of b bits: n = -2^(b-1), p = 2^(b-1) - 1 (uint: n = 0,
 * p = 2^b - 1). The parameter holds one value per channel:
 *   tqt  l = log2 t;  s = 2^ceil(l) / 2^(b-1)  (uint: / 2^b)
 *   lsq  s itself (the step size)
 * r = round(x / s) by spec.round, y = clamp(r, n, p) * s.
 * Backward, summed over the channel's elements:
 *   tqt (TQT eq. 7-8; the regions are decided by the rounded r, and the
 *        ceil passes the gradient straight through):
 *        dl += dy * s ln2 * (r - x/s   if n <= r <= p,
 *                            n         if r < n,
 *                            p         if r > p)
 *        dx += dy if n <= r <= p, else nothing
 *   lsq (LSQ eq. 3; the regions are decided by x / s itself):
 *        ds += g * dy * (r - x/s   if n < x/s < p,
 *                        n         if x/s <= n,
 *                        p         if x/s >= p)
 *        dx += dy if n < x/s < p, else nothing
 *        g = 1 / sqrt(N p), N = elements per scale (numel / channels),
 *        unless spec.lsq_grad_scale overrides it.
 * These are estimators, not the derivative of the forward: with the
 * rounding fixed, the forward's own derivative inside the range is r (not
 * r - x/s) for lsq and r s ln2 for tqt, and 0 for the ceil. Two switches
 * make the forward the very function whose derivative the estimator is,
 * so that finite differences can check the backward: skip_rounding (r =
 * x / s) and tqt_exact_scale (s = 2^l / 2^(b-1), no ceil).
 *
 * Errors go to the tape (NULL return, first error kept) naming the op
 * ("fake_quant", "fake_quant_dynamic", "fake_quant_tqt", "fake_quant_lsq")
 * and the shapes: a NaN or Inf in x (QT_ERR_VALUE with its flat index), a
 * scale or parameter that does not fit the axis, a tile that does not
 * divide its axis (QT_ERR_SHAPE naming the axis, its size and the tile), an
 * axis out of range or listed twice, a format or option the op cannot use
 * (QT_ERR_ARG; the dynamic op reports QArray's option errors under its own
 * name), a scale that is not finite and positive or does not fit its scale
 * type (QT_ERR_VALUE). A scale below 1e-19 becomes 1 (DESIGN.md), a learned
 * one is an error instead, since training pushed it there. The output is
 * always a new Var; x is never written. Nothing is malloc'ed per call:
 * saved state and scratch (calibration workspace, slice buffers, the
 * backward's mask) come from the tape's arena, the same amount for the same
 * shape and options, so a training loop stops growing the arena after its
 * first step. */
#ifndef QTRAIN_QUANT_FAKEQUANT_H
#define QTRAIN_QUANT_FAKEQUANT_H

#include <stdbool.h>
#include <stddef.h>

#include "base/error.h"
#include "nn/param.h"
#include "base/rng.h"
#include "nn/tape.h"
#include "quant/calib.h"
#include "quant/qarray.h"
#include "quant/qtype.h"

typedef enum {
    FQ_STE_CLIPPED = 0, /* the gradient passes inside the representable range only */
    FQ_STE_PASS,        /* the gradient passes everywhere */
    FQ_STE_COUNT
} FqSte;

/* All-zero but qtype is the default: per tensor, symmetric (asymmetric for
 * uint in the dynamic op), float32 scales, int32 zero points, rne, clipped
 * STE. */
typedef struct {
    const QType *qtype;    /* int, uint, ternary, binary, nf4 (LUT) or float; the dynamic op also takes the block
                              formats (MX, mx6/mx9) */
    bool per_channel;      /* one scale per index along axis; false: one for the tensor */
    int axis;              /* per_channel: -ndim..ndim-1 (negative counts from the end) */
    /* Dynamic op only (the static op rejects them): the rest of QArray's description of the scale tensor, as
       QArrayOptions has it. per_channel adds `axis` to the channelwise axes. */
    int n_channelwise;
    int channelwise_axes[QARRAY_MAX_DIMS];       /* [n_channelwise] one scale per index along these */
    int n_tiled;
    QArrayTiledAxis tiled_axes[QARRAY_MAX_DIMS]; /* [n_tiled] one scale per tile (a count, or a fraction) */
    QArrayScaleType scale_type; /* every computed scale is rounded to it before use */
    QArrayRange range;     /* dynamic: AUTO is asymmetric for uint, symmetric otherwise. Static: the zero point
                              argument decides; SYMMETRIC with zero points or ASYMMETRIC without is an error */
    bool narrow_range;     /* signed int only: codes -qmax..qmax (ModelOpt's narrow_range) */
    QArrayZpType zp_type;  /* int32 (integral zero points, rounding before the shift) or float */
    QRound round;
    Rng *rng;              /* stochastic rounding; NULL: the tape's rng. Read by no other mode */
    FqSte ste;
    bool skip_rounding;    /* tests: clamp without rounding (block formats: to each block's range), so the
                              forward is the function whose derivative the clipped STE is */
} FakeQuantSpec;

/* x (any shape, ndim 1..4) -> y, same shape. scale: (C,) per channel or
 * (1,) per tensor, positive; it must not require a gradient (a learnable
 * range is fq_learned_quant's). zero_point: NULL (symmetric) or like
 * scale, in code units, int/uint formats only. A caller's float array
 * becomes a Var with tape_wrap. NULL on error (see above). */
Var *fq_fake_quant(Tape *t, Var *x, const FakeQuantSpec *spec, Var *scale, Var *zero_point);

/* The same with the scales (and zero points) calibrated from x on every
 * call, by qarray.h's rules: the slices are those of QArray's options
 * built from spec (channelwise axes, per_channel's axis, tiled axes; nf4
 * without axes: blocks of 64 along the last axis, QArray's default), calib
 * NULL is absmax when symmetric, minmax when asymmetric and mean |x| for
 * ternary/binary; otherwise any CalibSpec, whose mse/entropy/kl_j see this
 * format's round trip as QArray's do. Block formats take no calibration,
 * axes or asymmetric range (QArray's rules). The calibration's workspace
 * comes from the arena. */
Var *fq_fake_quant_dynamic(Tape *t, Var *x, const FakeQuantSpec *spec, const CalibSpec *calib);

/* The dynamic op described by QArrayOptions itself: y equals
 * qarray_dequantize(qarray_quantize(x, qtype, options)) bit for bit, for
 * every options qarray_quantize accepts but double_quant (QT_ERR_ARG: it
 * compresses stored scales). options NULL: all defaults. Stochastic
 * rounding with options->rng NULL draws from the tape's rng. */
Var *fq_fake_quant_qarray(Tape *t, Var *x, const QType *qtype, const QArrayOptions *options, FqSte ste);

/* "clipped", "pass"; "unknown" outside the enum. */
const char *fq_ste_name(FqSte ste);
QtStatus fq_ste_parse(const char *name, FqSte *out, QtError *err);

/* ---- the format for calibration ------------------------------------------------------ */

/* A CalibQuant whose round trip is this format's fake quantization (rne)
 * with the scale qarray.h derives from the candidate range: the signed int
 * rule t / (qmax + 1/2) (narrow: t / qmax), asymmetric (hi+ - lo-) /
 * (qmax - qmin) with its zero point (int32 or float), t / format max for
 * floats, t for nf4's [-1, 1] table and for ternary/binary. For int4
 * symmetric that is calib_quant_int(4, false) exactly. levels (entropy,
 * kl_j) = 2^(bits-1), at least 2, as QArray counts them - but 2^bits for a
 * symmetric uint, whose codes all lie in [0, t] (calib.h's advice for
 * non-negative data quantized unsigned). range AUTO is asymmetric for uint.
 * ctx points at the QType, which outlives the program's use of it, so the
 * value can be copied and kept. fn is NULL and levels 0 (which mse and
 * entropy reject) for NULL, a block format, or options the format cannot
 * take (asymmetric non-int, narrow non-int, float zero points when
 * symmetric). */
CalibQuant fq_calib_quant(const QType *t, QArrayRange range, bool narrow_range, QArrayZpType zp_type);

/* ---- learned ranges -------------------------------------------------------------------- */

typedef enum { FQ_RANGE_TQT = 0, FQ_RANGE_LSQ, FQ_RANGE_COUNT } FqRangeKind;

typedef struct {
    FqRangeKind kind;
    const QType *qtype;    /* int2..int8, uint4, uint8 (INT or UINT kinds, 2..16 bits) */
    bool per_channel;
    int axis;              /* per_channel: -ndim..ndim-1 */
    QRound round;
    Rng *rng;              /* stochastic rounding; NULL: the tape's rng */
    float lsq_grad_scale;  /* lsq: 0 = 1 / sqrt(N p) (the LSQ paper); > 0 this factor (1: no scaling) */
    bool tqt_exact_scale;  /* tqt: s = 2^l / 2^(b-1) without the ceil; for gradient checks and experiments */
    bool skip_rounding;    /* tests: r = x / s, see above */
} FqRangeSpec;

/* A learned range and its parameter. The parameter is an ordinary Param
 * (value and grad [n_channels], requires_grad), so the trainer adds
 * &range.param to the optimizer and the checkpoint like any other. Its name
 * is "<prefix>/log2_t" for tqt and "<prefix>/step_size" for lsq, prefix
 * being "<module>/<tensor>" (e.g. "fc1/weight/log2_t"), which the checkpoint
 * stores under /quant/<module>/<tensor>/state/. */
typedef struct {
    Param param;
    FqRangeSpec spec;
    int n_channels;        /* channels along spec.axis, or 1 per tensor */
} FqRange;

/* Allocates the parameter (n_channels >= 1; 1 unless per channel) with
 * threshold 1: tqt l = 0, lsq s = 1 / p. Checks the spec (QT_ERR_ARG). On
 * failure r is left freeable. */
QtStatus fq_range_init(FqRange *r, const char *prefix, const FqRangeSpec *spec, int n_channels, QtError *err);
void fq_range_free(FqRange *r);

/* Sets the parameter from data x [numel] of the given shape (per channel:
 * shape[axis] must be n_channels). Per channel, the threshold t:
 *   calib NULL: tqt t = max|x| (l = log2 t, TQT's default); lsq
 *               s = 2 mean|x| / sqrt(p), the LSQ paper's initialisation;
 *   calib given: t = max(-lo, hi) of calib_compute (mse/entropy/kl_j see
 *               this learned quantizer: s = t / 2^(b-1) for tqt, without the
 *               ceil, and t / p for lsq), then l = log2 t, or s = t / p.
 * TQT's own initialisers are the calibrations "3sd" and "kl_j". A zero
 * range gives the scale 1 (l = b - 1, uint: b; s = 1). Errors: QT_ERR_VALUE
 * for NaN/Inf in x, QT_ERR_SHAPE, calib_compute's errors; the parameter is
 * unchanged on error. Allocates its scratch (call it once, not per step). */
QtStatus fq_range_calibrate(FqRange *r, const float *x, int ndim, const int *shape, const CalibSpec *calib,
                            QtError *err);

/* The scale s a parameter value gives under spec (tqt: from l; lsq: the
 * value itself). NaN for a format fq_learned_quant rejects. */
float fq_range_scale(const FqRangeSpec *spec, float value);

/* x -> y with the learned range held in `range`: a Var of shape (C,) per
 * channel or (1,) per tensor, typically &FqRange.param.var, whose grad
 * receives the range gradient (+=) when it requires one. */
Var *fq_learned_quant(Tape *t, Var *x, Var *range, const FqRangeSpec *spec);

static inline Var *fq_range_apply(Tape *t, Var *x, FqRange *r) {
    return fq_learned_quant(t, x, &r->param.var, &r->spec);
}

/* "tqt", "lsq"; "unknown" outside the enum. */
const char *fq_range_kind_name(FqRangeKind kind);
QtStatus fq_range_kind_parse(const char *name, FqRangeKind *out, QtError *err);

#endif
