/* qat.h - quantization-aware training of a dense or conv2d layer.
 *
 * The layer keeps its float weight and trains it; every forward pass
 * fake-quantizes the weight (and, with an act_qtype, the layer's input)
 * before the layer's own op, with the clipped straight-through estimator,
 * so training sees the rounding and clipping the quantized model will
 * have. The weight's layout is the one a PTQ base of the same rule would
 * have (quant/qlayer.h: per output channel, per tensor, or blocks of the
 * flattened weight), so `qtrain convert` turns a QAT layer into a QLayer
 * that evaluates exactly as it trained.
 *
 * Ranges:
 *   learn_amax none  the weight's range is calibrated on every forward
 *                    (spec.weight_calib, QArray's rules: the dynamic op);
 *                    the input's range per tensor either the same way
 *                    (dynamic) or, with act_static_scale, the running mean
 *                    of per-batch ranges (CalibRunning), updated in
 *                    training only and frozen in eval;
 *   learn_amax tqt   TQT (Jain et al. 2019): log2 t is a parameter per
 *                    output channel (per tensor with per_tensor) for the
 *                    weight and per tensor for the input, power-of-two
 *                    scales (spec.scale_type must be pof2);
 *   learn_amax lsq   LSQ (Esser et al. 2020): the step size s is the
 *                    parameter, float scales.
 *   Learned ranges need an int or uint format and no tile (blocks); they
 *   start from spec.amax_init (any calibration method; TQT's own are 3sd
 *   and kl_j): the weight's from the initial weight at qat_layer_init_ranges,
 *   the input's from the calibration batches (qat_layer_calib_*). */
#ifndef QTRAIN_QUANT_QAT_H
#define QTRAIN_QUANT_QAT_H

#include <stdbool.h>
#include <stddef.h>

#include "base/error.h"
#include "nn/model.h"
#include "nn/tape.h"
#include "quant/calib.h"
#include "quant/fakequant.h"
#include "quant/qlayer.h"

typedef enum { QAT_LEARN_NONE = 0, QAT_LEARN_TQT, QAT_LEARN_LSQ, QAT_LEARN_COUNT } QatLearn;

/* The QAT part of a rule; the formats, layout and calibrations come from
 * the rule's QLayerSpec. */
typedef struct {
    QatLearn learn_amax;
    CalibSpec amax_init;     /* learned ranges' initialisation; default absmax */
    bool act_static_scale;   /* learn_amax none: a running static range for the input */
    float lr;                /* learned ranges' learning rate; 0: the optimizer's */
} QatSpec;

typedef struct {
    Module *module;          /* dense or conv2d; not owned; its weight stays a trainable float Param */
    QLayerSpec spec;         /* weight_qtype (required), tile_size, per_tensor, calibrations, symmetric,
                                narrow_range, scale_type, act_qtype; double_quant is refused */
    QatSpec qat;
    int out, fan_in;         /* the weight as (out, fan_in) */
    QArrayOptions w_options; /* the weight's layout as qlayer_layout gives it; calib points into spec */
    int w_ndim, w_shape[2];  /* the QArray view of the weight */
    FqRange w_range;         /* learned: per output channel (axis 0 of (out, fan_in)) or per tensor */
    FqRange a_range;         /* learned, with an act_qtype: per tensor */
    CalibRunning act_stats;  /* act_static_scale, or the calibration batches of a learned input range */
    bool calibrating;        /* qat_layer_calib_begin..end: observe the input, no input quantization */
    bool ranges_ready;       /* learned ranges initialised (init_ranges and calib_end, or a checkpoint) */
    Rng round_rng;           /* spec.rounding stochastic: seed and stream; the counter comes from round_step */
    int64_t round_step;      /* the training step the next forward belongs to (qat_layer_set_step) */
    Module *bn;              /* a batch norm folded in (qat_layer_fold_bn), or NULL; not owned */
    int64_t bn_freeze_after; /* bn's statistics freeze from this training step on (0: never) */
} QatLayer;

/* "none", "tqt", "lsq"; "unknown" outside the enum. */
const char *qat_learn_name(QatLearn l);
QtStatus qat_learn_parse(const char *name, QatLearn *out, QtError *err);
/* QatSpec defaults: none, absmax, no static scale. */
QatSpec qat_spec_default(void);

/* Checks spec and qat against module m (qlayer_spec_check's rules but
 * double_quant; learned ranges: an int/uint format, no tile, tqt with pof2
 * scales, lsq without). Messages start with the module path. */
QtStatus qat_layer_check(const QLayerSpec *spec, const QatSpec *qat, const Module *m, QtError *err);

/* Sets up q for module m (allocating the learned ranges' parameters, named
 * "<path>/weight/log2_t" or ".../step_size", and "<path>/input/..."). */
QtStatus qat_layer_init(QatLayer *q, Module *m, const QLayerSpec *spec, const QatSpec *qat, QtError *err);
void qat_layer_free(QatLayer *q);
/* Learned weight ranges from the module's current weight (amax_init). */
QtStatus qat_layer_init_ranges(QatLayer *q, QtError *err);
/* Installs the QAT forward as the module's forward_hook. */
void qat_layer_install(QatLayer *q);

/* Stochastic weight rounding (spec.rounding): every training forward
 * (tape->training) of step s draws the noise of round_rng with its counter
 * set to s * ceil(numel / 4), the blocks one draw takes, so each step has
 * noise of its own that depends on nothing but (seed, stream, s): a resumed
 * run, which restores the step, draws it again bit for bit without any
 * generator state in the checkpoint. The trainer calls this before each
 * step's forward. Every other forward (evaluation, calibration) draws
 * counter 0, the draw qat_layer_convert quantizes with, so the converted
 * layer evaluates exactly as the QAT layer does. */
void qat_layer_set_step(QatLayer *q, int64_t step);

/* Folds batch norm module bn, which alone reads this layer's output, into
 * the layer as torch.ao's ConvBn/LinearBn modules do, and installs bn's
 * forward (call before qat_layer_init_ranges, whose weight range then
 * starts from the folded weight). In training the layer fake-quantizes
 * w * s, s = gamma / sqrt(running_var + eps) per output channel, divides
 * its output by s again and adds its bias; bn normalises that with the
 * batch's statistics, or, from training step freeze_after on (> 0; 0:
 * never), with its running statistics, which it no longer updates
 * (BatchNormState.frozen, set by qat_layer_set_step). In eval the layer
 * computes with the weight folded at the running statistics, fake-quantized,
 * and the folded shift (bn_fold_values, nn/ops_chscale.h) as its bias, or,
 * without a bias, bn adds the shift: the model bn_fold_into gives, so
 * folding bn into the module before qat_layer_convert converts exactly.
 * Needs the layer's bias or bn's (affine). A batch norm already folded into
 * the weights (bn->bn_folded, as a checkpoint holds it) is left to its own
 * forward and the layer runs as without it. */
QtStatus qat_layer_fold_bn(QatLayer *q, Module *bn, int64_t freeze_after, QtError *err);
/* Undoes qat_layer_fold_bn: the batch norm runs as a module of its own
 * again and the layer as without it (a checkpoint whose layer trained so). */
void qat_layer_unfold_bn(QatLayer *q);

/* The layer's forward with fake-quantized weight and input (see above). */
Var *qat_layer_forward(Tape *t, QatLayer *q, Var *x);

/* Learned range parameters of the layer (0, 1 or 2), for the optimizer and
 * checkpoints. */
int qat_layer_params(QatLayer *q, Param **out);

/* Input calibration for learned input ranges (amax_init over the batches)
 * and for act_static_scale's starting statistics: begin, forwards, end. */
void qat_layer_calib_begin(QatLayer *q);
QtStatus qat_layer_calib_end(QatLayer *q, QtError *err);

/* A frozen PTQ layer (out, installed by the caller) that evaluates exactly
 * as this QAT layer does in eval: the current weight quantized with the
 * learned range (codes clamp(round(w / s)), the scale stored in its type)
 * or, without one, by qlayer_init_quantize_rng with the same options (and
 * round_rng, stochastic rounding's evaluation draw); and the
 * input's static scale (learned, or the running statistics). With a batch
 * norm folded in (q->bn), the caller first folds it into the module's float
 * weight and bias (trainer/bn_fold.h's bn_fold_into). A dynamic
 * input range has no PTQ equivalent: QT_ERR_CONFIG naming the module and
 * act_static_scale / learn_amax as the fix. */
QtStatus qat_layer_convert(const QatLayer *q, QLayer *out, QtError *err);

#endif
