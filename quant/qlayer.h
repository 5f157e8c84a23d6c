/* qlayer.h - a frozen, post-training-quantized dense or conv2d layer.
 *
 * The weight is quantized once (from float, or filled from a checkpoint)
 * and kept as a QArray; a float copy lives in the step's arena only. A
 * dense weight of at most qlayer_dense_whole_bytes as float (16 MiB,
 * qlayer_ops.h) is dequantized whole, once per step: the forward's GEMM and
 * the backward's read it. Otherwise forward and the input gradient run a
 * tile at a time: a band of output channels is dequantized into a scratch
 * buffer of at most QLAYER_TILE_BYTES and fed to one sgemm, then the next
 * band, so the float copy of such a layer never exceeds one tile budget
 * however large the layer is. The weight gets no gradient;
 * the input does (LoRA adapters and earlier layers need it).
 *
 * Weight layout. The weight is seen as the matrix (out, fan_in), fan_in =
 * in (dense) or C*KH*KW (conv), row-major as PyTorch stores it:
 *   tile_size 0, !per_tensor   one scale per output channel: QArray (out, fan_in),
 *                              channelwise axis 0;
 *   tile_size 0, per_tensor    one scale: QArray (out, fan_in), no axes;
 *   tile_size T > 0            blocks of T consecutive elements of the flattened
 *                              weight (bitsandbytes' layout): QArray (numel/T, T),
 *                              channelwise axis 0. When T divides fan_in a block
 *                              lies within one output channel, i.e. blocks along
 *                              the input axis; otherwise blocks continue across
 *                              rows (conv1 of a 1-channel 3x3 conv has fan_in 9).
 *                              numel must be a multiple of T.
 *   MX / mx6 / mx9 formats     the format's own block (32 / 16) in the same
 *                              flattened layout, tile_size 0 or equal to it.
 * The codes are packed exactly as qarray_quantize packs them; a checkpoint
 * stores them as they are (qarray_blobs).
 *
 * Activations (spec.act_qtype): the layer's input is fake-quantized per
 * tensor with a static range, the running mean of calib_compute over the
 * calibration batches (qlayer_calib_*), with a clipped STE in training.
 *
 * Int8 inference (qlayer_int8.c). When the weight is int8 (symmetric, one
 * scale per output channel or per tensor, tile_size 0), the input is
 * quantized to an 8-bit integer act_qtype (int8 or uint8, symmetric or with
 * a zero point) with a calibrated range (act_ready), and no gradient flows
 * through the layer (gradients disabled, or neither the input nor the bias
 * needs one: evaluation, calibration aside), the forward runs on integer
 * kernels (qgemm.h): the input's codes, the very codes fake quantization
 * computes, times the weight's codes, summed exactly in int32, then
 *   y = s_x * s_w[oc] * (sum - zero-point terms) + bias.
 * That is the fake-quantized float forward up to float rounding; the
 * kernels (AVX-512 VNNI, AVX-VNNI, AVX2 or portable C) agree bit for bit.
 * It needs a CPU with AVX2 and FMA at least (depthwise convs with a
 * stride past 2 across: AVX-512 VNNI), or qgemm_force_portable: the portable kernels are slower than
 * fake quantization + sgemm, so elsewhere the float path stays
 * (qlayer_int8_kernel says which path runs; a run reports it).
 * A forward that needs a gradient always takes the float path, whose
 * backward needs the dequantized bands anyway, so training sees the same
 * numbers it always did. The weight is packed into the kernels' layout
 * once, on the first int8 forward (or by qlayer_int8_prepare), and kept
 * until qlayer_free or qlayer_int8_release. Work is split over the step's
 * thread pool (base/parallel.h). An int8 conv2d whose output one int8
 * conv2d alone reads hands it over as that reader's input codes
 * (qlayer_int8.h, qlayer_int8_handoff): the same codes, never stored as
 * floats. */
#ifndef QTRAIN_QUANT_QLAYER_H
#define QTRAIN_QUANT_QLAYER_H

#include <stdbool.h>
#include <stddef.h>

#include "base/error.h"
#include "nn/model.h"
#include "nn/tape.h"
#include "quant/calib.h"
#include "quant/qarray.h"
#include "quant/qtype.h"

/* Scratch for one dequantized band of the weight. */
#define QLAYER_TILE_BYTES (256u << 10)

/* One rule's resolved PTQ settings (quant.rules[i] of the config). */
typedef struct {
    const QType *weight_qtype;  /* NULL: the module stays float32 (frozen) */
    int tile_size;              /* 0: per output channel (or the MX block); > 0: blocks, see above */
    bool per_tensor;            /* tile_size 0 only: one scale for the whole weight */
    CalibSpec weight_calib;     /* default absmax (minmax when asymmetric) */
    bool symmetric;             /* default true; false: asymmetric int/uint with zero points */
    bool narrow_range;          /* signed int: codes -qmax..qmax */
    QArrayScaleType scale_type; /* default float32 */
    bool double_quant;          /* compress the block scales (QLoRA) */
    QRound rounding;            /* the weight's codes: default rne; stochastic draws from a generator of its own */
    const QType *act_qtype;     /* NULL: the input stays float */
    CalibSpec act_calib;        /* default absmax (minmax when !act_symmetric) */
    bool act_symmetric;         /* default true */
} QLayerSpec;

/* The spec with every default filled in: weight_qtype and act_qtype NULL. */
QLayerSpec qlayer_spec_default(void);

/* The int8 path's packed weight (qlayer_int8.c). */
typedef struct QLayerInt8 QLayerInt8;

typedef struct {
    Module *module;             /* dense or conv2d; not owned */
    QLayerSpec spec;
    int out, fan_in;            /* the weight as a matrix (out, fan_in) */
    int w_ndim, w_shape[4];     /* the module's weight shape: (out, in) or (OC, C, KH, KW) */
    QArray weight;              /* layout above */
    QArrayOptions options;      /* what weight was (or is to be) quantized with; calib points into spec */
    int band_rows;              /* output channels dequantized per sgemm (a multiple of the block alignment) */
    /* static activation range */
    CalibRunning act_stats;     /* running mean over the calibration batches */
    bool calibrating;           /* qlayer_calib_begin..end: the forward observes its input, unquantized */
    float act_scale;            /* from act_stats at qlayer_calib_end (or a checkpoint) */
    float act_zero_point;       /* in code units; 0 when symmetric */
    bool act_ready;             /* act_scale is set; the forward quantizes the input */
    QLayerInt8 *int8;           /* the weight packed for the int8 path; NULL until its first use; owned */
} QLayer;

/* Checks that spec can quantize module m's weight: a dense or conv2d
 * module with a weight, the format's and QArray's rules (asymmetric with
 * an int format, double_quant with a non-block format and float32 scales,
 * ...), a tile that divides numel, per_tensor without a tile. Messages
 * start with the module path. */
QtStatus qlayer_spec_check(const QLayerSpec *spec, const Module *m, QtError *err);

/* The QArray shape and options for m's weight under spec (the layout
 * above). options->calib points into *spec, so spec must outlive it.
 * options->round is spec->rounding; options->rng stays NULL: with
 * stochastic rounding the caller points it at a generator before
 * quantizing (qarray_alloc needs none). */
QtStatus qlayer_layout(const QLayerSpec *spec, const Module *m, int *ndim, int shape[2], QArrayOptions *options,
                       QtError *err);

/* Quantizes m's float weight (w: the weight's shape, usually
 * m->weight->var.value.data) into q. Does not release the float weight:
 * the caller does (param_release). On error q is left zeroed.
 * Stochastic rounding (spec->rounding) draws from qlayer_round_rng(0, 0). */
QtStatus qlayer_init_quantize(QLayer *q, Module *m, const QLayerSpec *spec, const float *w, QtError *err);
/* The same, stochastic rounding drawing from a copy of *rng (NULL: the
 * default above), element i taking word i (qarray.h), so one generator
 * state gives the same codes on every run. */
QtStatus qlayer_init_quantize_rng(QLayer *q, Module *m, const QLayerSpec *spec, const float *w, const Rng *rng,
                                  QtError *err);
/* The generator of module number `module`'s weight rounding in a run of
 * `seed`: stream RNG_STREAM_WEIGHT_ROUNDING + (module << 40), counter 0. */
Rng qlayer_round_rng(uint64_t seed, int module);
/* Allocates q's QArray for this layout with zeroed codes and scales, to
 * be filled from a checkpoint through qarray_blobs. */
QtStatus qlayer_init_empty(QLayer *q, Module *m, const QLayerSpec *spec, QtError *err);
void qlayer_free(QLayer *q);

/* Makes q the module's forward (module->forward_hook = the quantized layer,
 * hook_ctx = q). */
void qlayer_install(QLayer *q);

/* y = x * deq(W)^T + bias (dense; x (N, in) -> (N, out)) or the
 * convolution with deq(W) (x (N, C, H, W) -> (N, OC, OH, OW)), the bias the
 * module's float bias (frozen or not). The input is fake-quantized first
 * when act_ready. The backward gives x its gradient (tile by tile through
 * the packed weight) and the bias its, if it is trainable. Scratch comes
 * from the tape's arena. */
Var *qlayer_forward(Tape *t, QLayer *q, Var *x);

/* The whole dequantized weight in the module's shape -> w [numel]: for
 * merging and tests, not for the step loop. */
void qlayer_dequantize_weight(const QLayer *q, float *w);

/* Bytes the layer holds for its weight (qarray_bytes); the float bias is
 * the model's. */
size_t qlayer_bytes(const QLayer *q);

/* Static activation calibration: begin resets the statistics and makes the
 * forward observe (calib_running_observe) its input on each call without
 * quantizing it; end turns the mean range into act_scale / act_zero_point
 * (qarray_scale_for_range, qarray_zero_point_for_range) and sets
 * act_ready. end without any observed batch is QT_ERR_VALUE naming the
 * module. No-ops (QT_OK) without an act_qtype. */
void qlayer_calib_begin(QLayer *q);
QtStatus qlayer_calib_end(QLayer *q, QtError *err);
/* Sets act_scale / act_zero_point from q->act_stats (restored from a
 * checkpoint) as qlayer_calib_end does. */
QtStatus qlayer_act_from_stats(QLayer *q, QtError *err);

/* ---- int8 inference (see above) ---- */

/* Tests and benchmarks set this to keep every forward on the float path. */
extern bool qlayer_int8_disable;

/* The path a supported layer's gradient-free forward takes now: "amx"
 * (the AMX family: these layers run its AVX-512 VNNI kernels; QT's int8 x int8
 * products its tiles), "vnni" (AVX-512 VNNI kernels), "avxvnni" (256-bit vpdpbusd), "avx2" (AVX2 + FMA
 * kernels), "portable" (the C kernels, qgemm_force_portable), or
 * "float-emulated" (fake quantization + sgemm: qlayer_int8_disable, or a
 * CPU without AVX2). With avxvnni and avx2 a depthwise conv with a stride
 * past 2 across takes the float path. */
const char *qlayer_int8_kernel(void);
/* Applies a choice by name, for tests and for measuring: "amx", "vnni",
 * "avxvnni", "avx2" (each an error naming `what` and the missing CPU
 * feature on a CPU without it), "portable", "float", or "auto" / "" (the
 * default: the best of amx, vnni, avxvnni and avx2 the CPU has, else
 * float-emulated). QT_ERR_CONFIG naming `what` and the names otherwise. */
QtStatus qlayer_int8_kernel_select(const char *name, const char *what, QtError *err);

/* Whether q's formats allow the int8 path (the calibrated range is not
 * checked: a layer is supported before its calibration). */
bool qlayer_int8_supported(const QLayer *q);
/* Whether q has int8 weights and inputs the int8 path takes, whatever its geometry: a conv2d that is neither plain
 * nor undilated with one input channel per group (depthwise) has them but is not supported (it runs on its
 * dequantized weight). */
bool qlayer_int8_formats(const QLayer *q);
/* Whether q's int8 forward runs on the kernels int8_kernel names: supported, and not a depthwise conv with a stride
 * beyond 2 across while the 256-bit kernels (avx2, avxvnni) are chosen (it keeps the float path there). */
bool qlayer_int8_on_kernel(const QLayer *q);
/* Packs the weight for the int8 path now rather than at the first int8
 * forward. QT_ERR_CONFIG naming the module and the reason if the formats do
 * not allow it; QT_ERR_NOMEM. Nothing to do if it is packed already. */
QtStatus qlayer_int8_prepare(QLayer *q, QtError *err);
/* Frees the packed weight; the next int8 forward packs it again. Call it
 * after rewriting q->weight's codes or scales in place. */
void qlayer_int8_release(QLayer *q);

/* One line describing the resolved layout, for the start-of-run table:
 * e.g. "nf4 block 64 +dq absmax, act int8 percentile,99.9 (4.13 bits)". */
void qlayer_describe(const QLayer *q, char *buf, size_t cap);

#endif
