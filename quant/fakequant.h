/* fakequant.h - fake quantization as tape ops: the forward quantizes and
 * dequantizes at once, the backward is a straight-through estimator (STE).
 * Learnable ranges (TQT, LSQ) are parameters the op reads and whose grads it
 * accumulates; a CalibQuant describes any QType to the calibration methods.
 *
 * Scales and channels. One scale (and zero point) per tensor, or one per
 * index along `axis` (per channel): x is seen as (outer, C, inner) with
 * C = shape[axis], and element i belongs to channel (i / inner) % C.
 *
 * Forward (fq_fake_quant, fq_fake_quant_dynamic). With the scale s and zero
 * point zp of the element's channel (zp = 0 when symmetric), y is what a
 * QArray with those scales stores and dequantizes (qarray.h), bit for bit:
 *   int, uint:  y = clamp(round(x / s), qmin - zp, qmax - zp) * s, the
 *               rounding before the shift (int32 zero points); with float
 *               zero points y = (round(clamp(x / s + zp, qmin, qmax)) - zp) * s.
 *               qmin..qmax is the format's code range, -qmax..qmax with
 *               narrow_range (signed int only).
 *   float (fp8/fp6/fp4, eXmY), nf4, ternary, binary:
 *               y = qtype_decode(qtype_encode(x / s)) * s: saturation to
 *               the format's extremes, then rounding on its grid.
 * The block formats (MX, mx6/mx9) are not supported: their scales live in
 * the blocks; quantize them with qarray_quantize.
 *
 * Representable range of a channel, in units of s: [elo, ehi] =
 *   [qmin - zp, qmax - zp] for int/uint (symmetric uint: [0, qmax]),
 *   [-max, max] for the float formats, [lut[0], lut[last]] = [-1, 1] for
 *   nf4, [-1, 1] for ternary and binary.
 *
 * Backward (FQ_STE_CLIPPED, the default): dx += dy where
 * elo <= x / s <= ehi and nothing elsewhere - the straight-through estimator
 * with clipping of NVIDIA ModelOpt's fake quantization ("for -amax <= input
 * <= amax the gradient passes straight through, otherwise the gradient is
 * zero") and of Qwix. FQ_STE_PASS passes dy everywhere (ModelOpt's legacy
 * function). Scales and zero points are constants: no gradient reaches them
 * (also in the dynamic variant, whose scales are computed from x).
 *
 * Rounding (spec.round, qtype.h's QRound) acts on x / s as in qarray.h.
 * Stochastic rounding draws from spec.rng, or from the tape's rng when that
 * is NULL (give the op a stream of its own, RNG_STREAM_ROUNDING, so dropout
 * and rounding do not share one): element i (flat, row-major) takes the
 * i-th 32-bit word rng_fill_u32 produces from the rng's state at the call,
 * every element one word, and the rng advances by ceil(numel / 4) blocks -
 * the same draws as qarray_quantize, so a fake-quantized tensor equals the
 * QArray quantized from the same rng state, and a resumed run repeats them.
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
 * scale or parameter that does not fit the axis (QT_ERR_SHAPE), an axis out
 * of range, a format or option the op cannot use (QT_ERR_ARG), a scale that
 * is not finite and positive (QT_ERR_VALUE). A scale below 1e-19 becomes 1
 * (DESIGN.md), a learned one is an error instead, since training pushed it
 * there. The output is always a new Var; x is never written. Nothing is
 * malloc'ed per call: saved state and scratch come from the tape's arena. */
#ifndef QTRAIN_QUANT_FAKEQUANT_H
#define QTRAIN_QUANT_FAKEQUANT_H

#include <stdbool.h>
#include <stddef.h>

#include "nn/error.h"
#include "nn/param.h"
#include "nn/rng.h"
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
 * uint in the dynamic op), int32 zero points, rne, clipped STE. */
typedef struct {
    const QType *qtype;    /* element format: int, uint, ternary, binary, nf4 (LUT) or float */
    bool per_channel;      /* one scale per index along axis; false: one for the tensor */
    int axis;              /* per_channel: -ndim..ndim-1 (negative counts from the end) */
    QArrayRange range;     /* dynamic: AUTO is asymmetric for uint, symmetric otherwise. Static: the zero point
                              argument decides; SYMMETRIC with zero points or ASYMMETRIC without is an error */
    bool narrow_range;     /* signed int only: codes -qmax..qmax (ModelOpt's narrow_range) */
    QArrayZpType zp_type;  /* int32 (integral zero points, rounding before the shift) or float */
    QRound round;
    Rng *rng;              /* stochastic rounding; NULL: the tape's rng. Read by no other mode */
    FqSte ste;
    bool skip_rounding;    /* tests: clamp without rounding, so the forward is the function whose derivative
                              the clipped STE is */
} FakeQuantSpec;

/* x (any shape, ndim 1..4) -> y, same shape. scale: (C,) per channel or
 * (1,) per tensor, positive; it must not require a gradient (a learnable
 * range is fq_learned_quant's). zero_point: NULL (symmetric) or like
 * scale, in code units, int/uint formats only. A caller's float array
 * becomes a Var with tape_wrap. NULL on error (see above). */
Var *fq_fake_quant(Tape *t, Var *x, const FakeQuantSpec *spec, Var *scale, Var *zero_point);

/* The same with the scales (and zero points) calibrated from x on every
 * call, per channel, by qarray.h's rules: calib NULL is absmax when
 * symmetric, minmax when asymmetric and mean |x| for ternary/binary;
 * otherwise any CalibSpec, whose mse/entropy/kl_j see this format through
 * fq_calib_quant. The calibration's workspace comes from the arena. */
Var *fq_fake_quant_dynamic(Tape *t, Var *x, const FakeQuantSpec *spec, const CalibSpec *calib);

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
