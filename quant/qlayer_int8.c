/* qlayer_int8.c - the frozen layer's integer forward (qlayer.h, "Int8
 * inference"): the input quantized to uint8 codes with the static range,
 * the int8 weight packed once, the products on qgemm.h's kernels.
 *
 * Codes. Fake quantization maps x to q = rint(clamp(x / s, qmin - zp,
 * qmax - zp)) and back to q * s. Here the same q is stored as the byte
 * u = q + a_zero with a_zero = zp (uint8) or zp + 128 (int8), so that
 * sum_k q_k w_k = sum_k (u_k - a_zero) w_k, which the kernels compute.
 *
 * Dense: x (N, in) -> codes (N, in), then the u8 x s8 GEMM against the
 * packed weight with the float epilogue: y (N, out) directly.
 *
 * Conv2d, stride 1: no im2col. Each image's codes go into "planes" of
 * dwords over the zero-padded image (padding value a_zero, whose term is
 * then 0), in one of two groupings:
 *   ch4  dword = 4 channels of one padded pixel; one tap per (channel
 *        quad, kh, kw) at offset kh * Wp + kw;
 *   kw4  dword = 4 consecutive pixels of one channel's padded row (a
 *        sliding window); one tap per (channel, kh, quad of kw) at offset
 *        kh * Wp + 4 * quad: for few channels (the first layer's 1).
 * The grouping with fewer taps wins. Outputs are computed at every pixel
 * of the padded width (q = oh * Wp + ow), and the taps kernel stores only
 * the lanes with ow < OW, packed, so each row lands in y's unpadded plane.
 * Stride 2 over whole channel quads: "ph4", ch4's dwords dealt to the
 * padded image's four phases (even or odd rows, even or odd columns), each
 * (Hp + 1) / 2 rows of Wq = (Wp + 1) / 2; tap (quad, kh, kw) reads phase
 * (kh % 2, kw % 2) at offset (kh / 2) Wq + kw / 2, and outputs are computed
 * at q = oh * Wq + ow: a stride-1 read with no columns built (ResNet-8's
 * strided 3x3 and 1x1 shortcut convs; the same taps as columns would take).
 * Any other stride: "cols", the im2col matrix in dwords of 4 consecutive
 * k, one tap per dword, gathered from a zero-point-padded copy of the
 * codes (qgemm_gather_u8x4: 16 dwords a step at stride 2). Every image is one task (quantize, planes, taps);
 * ch4 quantizes straight into its planes (qgemm_quantize_u8x4).
 *
 * Depthwise (qlayer_int8_dw.c; qlayer_int8_conv_is_dw: every output channel
 * reads one input channel, w (OC, 1, KH, KW), no dilation; any kernel,
 * stride and padding per axis, 'same' included, M = OC / C output channels
 * per input channel): each image is one task, its codes quantized in one pass, then per input
 * channel qgemm_dw, which pads itself: VNNI gathers, for every padded row
 * and output column, the dwords of 4 consecutive codes (one per quad of
 * kernel columns; masked loads put a_zero outside the image), then one
 * vpdpbusd per (kernel row, quad) for 16 output columns with the channel's
 * weight dword broadcast. One output per input channel and a 3-row kernel
 * of up to 4 columns at stride 1 (DS-CNN's and MobileNet's 3x3) takes
 * qgemm_dw_x86.c's kernel instead: each row's windows gathered into a
 * register and kept for the 3 output rows that read them, 4 channels side
 * by side, the outputs quantized there when handing off (no float output
 * in scratch). A dilated conv, one with several input channels
 * per group, or one group of several channels with per-axis geometry, runs
 * on its dequantized weight (INT8_WHY_GEOMETRY).
 *
 * A following relu, or relu and 2x2 max pool, runs in the kernels' epilogue
 * (qlayer_int8_conv_fused, for the fused hook): no full-size output is
 * written. When pooling, the padded row pitch is rounded up to 16, 32 or
 * 48 where that is at most 3 vectors, so the kernels pool in registers.
 * Depthwise (qlayer_int8_conv_dw): the relu in its kernel, the max pool
 * over an input channel's relu'd outputs in scratch. A residual add (and
 * its relu) that model_forward joins to a plain conv (Tape.residual, in a
 * forward without gradients) runs in the taps kernel's epilogue where its
 * family sums residuals there (qgemm_taps_codes_direct: VNNI, portable;
 * QGemmTaps.res), else after the kernel on each image's output while it is
 * in cache (add_residual); the kernel's own relu is then off, as it must
 * come after the sum.
 *
 * Hand-off. In a forward without gradients, model_forward names the modules
 * that read an op's output with it as their one input (Tape.handoff), when
 * the others that read it are merges (a residual add: Tape.handoff_keep).
 * When the op is an int8 conv2d and those readers are too, all with one
 * quantizer and layout (qlayer_int8_reads_codes), the op writes
 * each image's output into its thread's scratch and quantizes it there with
 * the readers' quantizer (the VNNI and portable taps kernels and the
 * depthwise rows kernel quantize in their epilogue instead, in registers:
 * QGemmCodesOut) into its output Var's buffer (Var.codes: bytes, not
 * floats); a reader takes the codes in place of quantizing: depthwise as
 * its codes, ch4 interleaved into dwords (qgemm_interleave_u8x4), kw4 and
 * cols copied. For readers on ch4 or ph4 the producer quantizes straight
 * into channel quads, 4 channels a dword (VarCodes.plane): an unpadded
 * stride-1 reader (a pointwise conv) uses them as its planes (or copies
 * them row by row into wider ones when its max pool widened them), a padded
 * one copies their rows into its padded planes, a ph4 one deals their rows
 * to its phases; none interleaves bytes. One that a
 * globalavgpool alone reads makes the pool's means (Var.means, nn_plane_mean
 * on each plane in scratch) and never writes its output. With merges among
 * the readers (handoff_keep), a plain conv writes its floats to its Var for
 * them and the codes to a buffer of their own (VarCodes.floats); a depthwise
 * one then hands nothing off. A plain conv whose readers take its codes, or
 * are all merges, joins the chain of hand-offs below. The same
 * codes, so the same bits; no reader reads the float output back to
 * quantize it. A non-finite output is then the producer's error, naming it.
 *
 * Scratch (codes, planes, output vector tables) comes from the tape's
 * arena; the packed weight is allocated once (qlayer_int8_prepare). */
#include "qlayer_int8.h"
#include "qlayer_int8_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fakequant_internal.h"
#include "fqt_kern.h"
#include "base/parallel.h"
#include "qgemm.h"

bool qlayer_int8_disable = false;

/* Below this many multiply-adds (a few microseconds of VNNI work) a layer runs on one thread: waking a worker
 * would cost more than it saves. */
double qlayer_int8_parallel_min_macs = 4e6;

bool qlayer_int8_phases = true;

/* ---- eligibility ----------------------------------------------------------------------------------------------- */

static bool is_int8_act(const QType *a) {
    return a && (a->kind == QTYPE_KIND_INT || a->kind == QTYPE_KIND_UINT) && a->bits == 8;
}

/* The one reason that is the layer's shape, not its formats: such a layer has int8 weights and inputs but runs on
 * its dequantized weight, and a run says how many of its int8 layers do (qlayer_int8_formats). */
static const char INT8_WHY_GEOMETRY[] = "the conv2d is dilated, or grouped with more than one input channel per "
                                        "group, or has one group of several input channels and a kernel, stride or "
                                        "padding that differs between the axes or padding 'same' (the int8 kernels "
                                        "run plain convolutions and undilated ones of one input channel per group, "
                                        "such as depthwise; it runs on its dequantized weight)";

/* A conv2d that is not plain but runs on the depthwise kernel: every output channel reads one input channel
 * (w (OC, 1, KH, KW): groups = C, OC a multiple of C), no dilation; any kernel, stride and padding per axis. */
bool qlayer_int8_conv_is_dw(const QLayer *q) {
    const Module *m = q->module;
    return m->spec.type == LAYER_CONV2D && !m->conv_plain && q->w_shape[1] == 1 && m->geom.dil_h == 1 &&
           m->geom.dil_w == 1;
}

/* Why q's formats exclude the int8 path, or NULL. */
static const char *unsupported_why(const QLayer *q) {
    const QType *w = q->weight.qtype;
    if (!w || w->kind != QTYPE_KIND_INT || w->bits != 8) return "the weight is not int8";
    if (q->weight.asymmetric) return "the weight has zero points (int8 weights must be symmetric)";
    if (q->spec.tile_size != 0 || (q->weight.n_scales != 1 && q->weight.n_scales != (size_t)q->out))
        return "the weight has block scales (use one per output channel or per tensor: tile_size 0)";
    if (!is_int8_act(q->spec.act_qtype)) return "the input is not quantized to int8 or uint8 (act_qtype)";
    if (q->fan_in > QGEMM_K_MAX) return "fan_in is longer than an exact int32 sum allows";
    if (q->module->spec.type == LAYER_CONV2D && !q->module->conv_plain && !qlayer_int8_conv_is_dw(q)) return INT8_WHY_GEOMETRY;
    return NULL;
}

bool qlayer_int8_formats(const QLayer *q) {
    if (!q || !q->module) return false;
    const char *why = unsupported_why(q);
    return !why || why == INT8_WHY_GEOMETRY;
}

const char *qlayer_int8_kernel(void) {
    if (qlayer_int8_disable) return "float-emulated";
    if (qgemm_force_portable) return "portable";
    switch (qgemm_isa()) {
    case QGEMM_ISA_AMX: return "amx";
    case QGEMM_ISA_AVX512_VNNI: return "vnni";
    case QGEMM_ISA_AVXVNNI: return "avxvnni";
    case QGEMM_ISA_AVX2: return "avx2";
    default: return "float-emulated";
    }
}

/* The families QTRAIN_INT8_KERNEL names, with what the CPU needs for each. */
static const struct {
    const char *name, *needs;
    QGemmIsa isa;
} INT8_KERNELS[] = {
    {"amx", "AMX-INT8 with AVX-512 VNNI (and Linux's leave to use the tiles)", QGEMM_ISA_AMX},
    {"vnni", "AVX-512 VNNI", QGEMM_ISA_AVX512_VNNI},
    {"avxvnni", "AVX-VNNI (with AVX2 and FMA)", QGEMM_ISA_AVXVNNI},
    {"avx2", "AVX2 and FMA", QGEMM_ISA_AVX2},
};

/* QT's quantizers (fqt_kern.h) follow the products' width, so that a 256-bit cap runs what an AVX2-only CPU runs
 * end to end. */
QtStatus qlayer_int8_kernel_select(const char *name, const char *what, QtError *err) {
    if (!name || !*name || strcmp(name, "auto") == 0) {
        qlayer_int8_disable = false, qgemm_force_portable = false, qgemm_force_isa = -1;
        fqt_kern_cap(FQT_KERN_AVX512);
        return QT_OK;
    }
    for (size_t i = 0; i < sizeof INT8_KERNELS / sizeof *INT8_KERNELS; i++) {
        if (strcmp(name, INT8_KERNELS[i].name) != 0) continue;
        if (!qgemm_cpu_has_isa(INT8_KERNELS[i].isa))
            return qt_error_set(err, QT_ERR_CONFIG, "%s: %s: this CPU (or OS) has no %s; choose another of amx, "
                                "vnni, avxvnni, avx2, portable, float or auto", what, name, INT8_KERNELS[i].needs);
        qlayer_int8_disable = false, qgemm_force_portable = false, qgemm_force_isa = INT8_KERNELS[i].isa;
        const bool wide = INT8_KERNELS[i].isa == QGEMM_ISA_AMX || INT8_KERNELS[i].isa == QGEMM_ISA_AVX512_VNNI;
        fqt_kern_cap(wide ? FQT_KERN_AVX512 : FQT_KERN_AVX2);
        return QT_OK;
    }
    fqt_kern_cap(strcmp(name, "portable") == 0 ? FQT_KERN_PORTABLE : FQT_KERN_AVX512);
    if (strcmp(name, "portable") == 0) {
        qlayer_int8_disable = false, qgemm_force_portable = true, qgemm_force_isa = -1;
    } else if (strcmp(name, "float") == 0) {
        qlayer_int8_disable = true, qgemm_force_portable = false, qgemm_force_isa = -1;
    } else {
        return qt_error_set(err, QT_ERR_CONFIG, "%s: unknown int8 kernel '%s'; expected amx, vnni, avxvnni, "
                            "avx2, portable, float or auto", what, name);
    }
    return QT_OK;
}

bool qlayer_int8_supported(const QLayer *q) { return q && q->module && !unsupported_why(q); }

/* The 256-bit families' depthwise kernel takes strides 1 and 2 across (qgemm_dw_avx2): a depthwise conv with a
 * longer stride keeps the float path with them. */
static bool dw_stride_beyond_256(const QLayer *q, QGemmIsa isa) {
    return (isa == QGEMM_ISA_AVX2 || isa == QGEMM_ISA_AVXVNNI) && qlayer_int8_conv_is_dw(q) && q->module->geom.stride_w > 2;
}

bool qlayer_int8_on_kernel(const QLayer *q) {
    return qlayer_int8_supported(q) && !dw_stride_beyond_256(q, qgemm_isa());
}

bool qlayer_int8_applies(const Tape *t, const QLayer *q, const Var *x, const Var *bias) {
    if (qlayer_int8_disable || !q->act_ready || q->calibrating || !qlayer_int8_supported(q)) return false;
    /* without vector kernels the portable ones are slower than fake quantization + sgemm: keep the float path
     * there unless the portable kernels are asked for */
    if (!qgemm_force_portable) {
        const QGemmIsa isa = qgemm_isa();
        if (isa == QGEMM_ISA_PORTABLE || dw_stride_beyond_256(q, isa)) return false;
    }
    return !(t->grad_enabled && (x->requires_grad || (bias && bias->requires_grad)));
}

/* ---- the packed weight ----------------------------------------------------------------------------------------- */

ConvShape qlayer_int8_conv_shape(const QLayer *q) {
    ConvShape c = {.C = q->w_shape[1], .KH = q->w_shape[2], .KW = q->w_shape[3]};
    c.kq = (c.KW + 3) / 4;
    long ch4 = (long)((c.C + 3) / 4) * c.KH * c.KW, kw4 = (long)c.C * c.KH * c.kq;
    const int stride = q->module->spec.stride;
    /* stride 2 on whole channel quads: ch4 over the image's four phases, as many taps as columns, none built */
    if (stride == 1) c.mode = kw4 < ch4 ? CONV_KW4 : CONV_CH4;
    else c.mode = stride == 2 && c.C % 4 == 0 && qlayer_int8_phases ? CONV_PH4 : CONV_COLS;
    switch (c.mode) {
    case CONV_CH4:
    case CONV_PH4: c.groups = (c.C + 3) / 4, c.taps = (int)ch4; break;
    case CONV_KW4: c.groups = c.C, c.taps = (int)kw4; break;
    default: c.groups = (c.C * c.KH * c.KW + 3) / 4, c.taps = c.groups; break;
    }
    return c;
}

void qlayer_int8_tap_at(const ConvShape *c, int t, int *g, int *kh, int *kw) {
    if (c->mode == CONV_CH4 || c->mode == CONV_PH4) *g = t / (c->KH * c->KW), *kh = t / c->KW % c->KH, *kw = t % c->KW;
    else if (c->mode == CONV_KW4) *g = t / (c->KH * c->kq), *kh = t / c->kq % c->KH, *kw = 4 * (t % c->kq);
    else *g = t, *kh = 0, *kw = 0;
}

/* w (OC, C*KH*KW) int8 codes -> dw (OC, taps): byte j of tap t is the weight lane j of its dword meets. */
static void conv_dwords(uint32_t *dw, const int8_t *w, int OC, const ConvShape *c) {
    const int K = c->C * c->KH * c->KW;
    for (int oc = 0; oc < OC; oc++)
        for (int t = 0; t < c->taps; t++) {
            int g, kh, kw;
            qlayer_int8_tap_at(c, t, &g, &kh, &kw);
            uint32_t d = 0;
            for (int j = 0; j < 4; j++) {
                int k = -1; /* flat (c, kh, kw) index, -1 for padding lanes */
                if ((c->mode == CONV_CH4 || c->mode == CONV_PH4) && 4 * g + j < c->C)
                    k = ((4 * g + j) * c->KH + kh) * c->KW + kw;
                else if (c->mode == CONV_KW4 && kw + j < c->KW) k = (g * c->KH + kh) * c->KW + kw + j;
                else if (c->mode == CONV_COLS && 4 * g + j < K) k = 4 * g + j;
                if (k >= 0) d |= (uint32_t)(uint8_t)w[(size_t)oc * K + k] << (8 * j);
            }
            dw[(size_t)oc * c->taps + t] = d;
        }
}

static void int8_free(QLayerInt8 *p) {
    if (!p) return;
    qgemm_packed_b_free(&p->dense);
    qgemm_packed_taps_free(&p->taps);
    qgemm_packed_dw_free(&p->dw);
    free(p->w_scale), free(p->wino_w);
    free(p);
}

void qlayer_int8_release(QLayer *q) {
    if (!q) return;
    int8_free(q->int8);
    q->int8 = NULL;
}

static QtStatus pack_weight(QLayerInt8 *p, const QLayer *q, QtError *err) {
    const int8_t *codes = (const int8_t *)q->weight.codes;
    QtError inner = {0};
    QtStatus st;
    if (q->module->spec.type != LAYER_CONV2D) {
        st = qgemm_pack_b(&p->dense, codes, q->out, q->fan_in, &inner);
    } else if (qlayer_int8_conv_is_dw(q)) {
        st = qgemm_pack_dw(&p->dw, codes, q->out, q->w_shape[2], q->w_shape[3], &inner);
    } else {
        ConvShape c = qlayer_int8_conv_shape(q);
        uint32_t *dw = malloc((size_t)q->out * c.taps * sizeof *dw);
        if (!dw)
            return qt_error_set(err, QT_ERR_NOMEM, "%s: out of memory packing the weight for int8", q->module->path);
        conv_dwords(dw, codes, q->out, &c);
        st = qgemm_pack_taps(&p->taps, dw, q->out, c.taps, &inner);
        free(dw);
    }
    if (st != QT_OK) qt_error_set(err, st, "%s: packing the weight for int8: %s", q->module->path, inner.msg);
    return st;
}

QtStatus qlayer_int8_prepare(QLayer *q, QtError *err) {
    if (!q || !q->module || !q->weight.qtype)
        return qt_error_set(err, QT_ERR_ARG, "qlayer_int8_prepare: the quantized layer is not initialised");
    const char *why = unsupported_why(q);
    if (why)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the int8 path does not apply: %s; it needs an int8 weight "
                            "(symmetric, tile_size 0) and an int8 or uint8 act_qtype", q->module->path, why);
    if (q->int8) return QT_OK;
    QLayerInt8 *p = calloc(1, sizeof *p);
    float *ws = malloc((size_t)q->out * sizeof *ws);
    if (!p || !ws) {
        free(p), free(ws);
        return qt_error_set(err, QT_ERR_NOMEM, "%s: out of memory packing the weight for int8", q->module->path);
    }
    p->w_scale = ws;
    for (int o = 0; o < q->out; o++) ws[o] = qarray_scale_at(&q->weight, q->weight.n_scales == 1 ? 0 : (size_t)o);
    QtStatus st = pack_weight(p, q, err);
    if (st != QT_OK) {
        int8_free(p);
        return st;
    }
    q->int8 = p;
    return QT_OK;
}

/* ---- the input's codes ----------------------------------------------------------------------------------------- */

/* The static range as codes (s, lo, hi: fake quantization's scale and clamp bounds in code units, zero point
 * applied; zero: a_zero, the byte of the value 0), checked as fake quantization checks a given scale and zero point. */
static bool act_codes_err(const QLayer *q, QGemmCodes *a, QtError *err) {
    const QType *at = q->spec.act_qtype;
    float s = q->act_scale, zp = q->spec.act_symmetric ? 0.0f : q->act_zero_point;
    if (!(s > 0.0f) || isinf(s)) {
        qt_error_set(err, QT_ERR_VALUE, "%s: the static input scale is %g; it must be a finite number > 0 "
                     "(calibrate again)", q->module->path, (double)s);
        return false;
    }
    if (!(zp >= (float)at->qmin && zp <= (float)at->qmax) || zp != rintf(zp)) {
        qt_error_set(err, QT_ERR_VALUE, "%s: the static input zero point %g is not a whole number within %s's "
                     "codes %d..%d (calibrate again)", q->module->path, (double)zp, at->name, at->qmin, at->qmax);
        return false;
    }
    *a = (QGemmCodes){.s = fq_effective_scale(s), .zero = (int)zp + (at->kind == QTYPE_KIND_INT ? 128 : 0)};
    fq_int_code_bounds(at, false, zp, &a->lo, &a->hi); /* layer_input fake-quantizes without a narrow range */
    return true;
}

bool qlayer_int8_act_codes(Tape *t, const QLayer *q, QGemmCodes *a) { return act_codes_err(q, a, &t->err); }

/* s_x * s_w[o] for every output channel -> arena [out]. */
float *qlayer_int8_out_scales(Tape *t, const QLayer *q, float sx) {
    float *s = tape_alloc(t, (size_t)q->out * sizeof *s);
    for (int o = 0; s && o < q->out; o++) s[o] = sx * q->int8->w_scale[o];
    return s;
}

/* Packs on first use; false with the tape error set. */
bool qlayer_int8_ensure_packed(Tape *t, QLayer *q) {
    if (q->int8) return true;
    QtError e = {0};
    if (qlayer_int8_prepare(q, &e) == QT_OK) return true;
    qt_error_set(&t->err, e.status, "%s", e.msg);
    return false;
}

/* The threads a layer of this many multiply-adds uses. */
int qlayer_int8_threads_for(double macs) { return macs < qlayer_int8_parallel_min_macs ? 1 : parallel_get_threads(); }

/* n_tasks tasks over the step's pool (base/parallel.h), or all in the calling
 * thread when threads is 1. Per-thread scratch is sized for the whole pool
 * and indexed by parallel_thread_index(), which holds for both. */
void qlayer_int8_run(int threads, int n_tasks, ParallelFn fn, void *ctx) {
    if (threads > 1) {
        parallel_run(n_tasks, fn, ctx);
        return;
    }
    for (int i = 0; i < n_tasks; i++) fn(ctx, i, n_tasks);
}

/* ---- the chain of hand-offs -------------------------------------------------------------------------------------
 * A conv2d whose output int8 conv2ds alone read as codes (merges among the readers too: a residual add, a concat),
 * or whose output only merges read, runs nothing yet (a conv under an adapter's hook never: the adapter reads its
 * output at once): its job waits in Tape.deferred, and the first op that is not such a
 * conv (model_forward runs the waiting work before it: Tape.run_deferred) or the first conv whose output goes
 * elsewhere runs them all, each image through every layer of the chain in one task, in the order they came. An
 * image's codes and residual sums then go from layer to layer in its core's cache, and the batch crosses the
 * threads once a chain rather than once a layer. The buffers the waiting jobs read are held from release meanwhile
 * (tape_hold_releases). The same computations, so the same bits. */

#define CHAIN_MAX 32 /* jobs in one chain; a longer one runs in parts */

bool qlayer_int8_chain = true;
unsigned long qlayer_int8_chained = 0, qlayer_int8_chains = 0;

typedef struct {
    QLayerInt8Job job[CHAIN_MAX];
    int n;
} Chain;

static void chain_task(void *ctx, int image, int n_tasks) {
    const Chain *c = ctx;
    for (int k = 0; k < c->n; k++) c->job[k].fn(c->job[k].ctx, image, n_tasks);
}

/* Runs the waiting jobs, each image through all of them, then checks each job's images in order. */
static bool chain_run(Tape *t) {
    Chain *c = t->deferred;
    if (!c || !c->n) return true;
    int threads = 1;
    for (int k = 0; k < c->n; k++) threads = c->job[k].threads > threads ? c->job[k].threads : threads;
    qlayer_int8_run(threads, c->job[0].n, chain_task, c);
    qlayer_int8_chained += (unsigned long)c->n, qlayer_int8_chains++;
    bool ok = true;
    for (int k = 0; k < c->n && ok; k++)
        ok = qlayer_int8_checks_pass(t, c->job[k].q, c->job[k].x, c->job[k].bad, c->job[k].n);
    c->n = 0;
    tape_release_held(t);
    return ok;
}

bool qlayer_int8_launch(Tape *t, const QLayerInt8Job *j, bool defer) {
    defer = defer && qlayer_int8_chain;
    Chain *c = t->deferred;
    if (!c && defer) {
        if (!(c = tape_alloc(t, sizeof *c))) return false;
        c->n = 0, t->deferred = c, t->run_deferred = chain_run;
    }
    const int waiting = c ? c->n : 0;
    if (waiting && c->job[0].n != j->n) { /* not the batch the chain began with: never so in model_forward */
        qt_error_set(&t->err, QT_ERR_ARG, "%s: the int8 chain holds %d images, this layer %d", j->q->module->path,
                     c->job[0].n, j->n);
        return false;
    }
    if (defer && waiting + 1 < CHAIN_MAX) { /* the last slot is for the op that ends the chain */
        if (!waiting) tape_hold_releases(t);
        c->job[c->n++] = *j;
        return true;
    }
    if (!waiting) {
        qlayer_int8_run(j->threads, j->n, j->fn, j->ctx);
        return qlayer_int8_checks_pass(t, j->q, j->x, j->bad, j->n);
    }
    c->job[c->n++] = *j;
    return chain_run(t);
}

/* After the tasks: the float path's message for a non-finite input. */
static bool inputs_finite(Tape *t, const Var *x, const uint8_t *bad, int n) {
    for (int i = 0; i < n; i++) {
        if (!bad[i]) continue;
        if (fq_check_finite(t, "fake_quant", x)) /* cannot happen: the kernels saw a NaN or an infinity */
            qt_error_set(&t->err, QT_ERR_VALUE, "fake_quant: the input holds a value that is not finite");
        return false;
    }
    return true;
}

/* ---- the int8 hand-off ------------------------------------------------------------------------------------------ */

size_t qlayer_int8_ch4_plane(int Hp, int Wp, int KW) { return ((size_t)Hp * Wp + (size_t)KW + 19 + 15) / 16 * 16; }

bool qlayer_int8_handoff = true;
bool qlayer_int8_handoff_quads = true;

bool qlayer_int8_reads_codes(const Tape *t, const QLayer *q, const int *shape, VarCodes *c) {
    if (!qlayer_int8_handoff || !q || !q->module || q->module->spec.type != LAYER_CONV2D) return false;
    const Var none = {0}; /* no gradient: the forward has none */
    QGemmCodes a;
    QtError err = {0};
    if (!qlayer_int8_applies(t, q, &none, NULL) || !act_codes_err(q, &a, &err)) return false;
    *c = (VarCodes){.s = a.s, .lo = a.lo, .hi = a.hi, .zero = a.zero};
    /* Channel quads, where they fit the value's buffer: an unpadded stride-1 conv takes them as its planes (with
     * the slack its taps read past), a padded one copies their rows into its padded planes, a stride-2 one on
     * phases deals their rows to the phases. Those two take any plane of at least H W dwords, so they ask for a
     * 1 x 1 conv's: the plane every reader of a block's output asks for, which then shares one set of codes. */
    const ConvShape cs = qlayer_int8_conv_shape(q);
    const bool direct = cs.mode == CONV_CH4 && q->module->spec.padding == 0;
    if (q->module->conv_plain && (direct || (qlayer_int8_conv_quads(&cs) && qlayer_int8_handoff_quads))) {
        const size_t plane = qlayer_int8_ch4_plane(shape[2], shape[3], direct ? cs.KW : 1);
        if ((size_t)cs.groups * plane <= (size_t)shape[1] * shape[2] * shape[3]) c->plane = plane;
    }
    return true;
}

/* The codes of an input x: its hand-off's, which must be q's own (the producer asked qlayer_int8_reads_codes). */
const uint8_t *qlayer_int8_input_codes(Tape *t, const QLayer *q, const Var *x, const QGemmCodes *a, bool quads) {
    const VarCodes *c = x->codes;
    if (c->s == a->s && c->lo == a->lo && c->hi == a->hi && c->zero == a->zero && (quads || !c->plane)) return c->data;
    qt_error_set(&t->err, QT_ERR_ARG, "%s: the input's int8 codes were made for another quantizer (the hand-off "
                 "between layers went wrong; set QTRAIN_INT8_KERNEL=float to run without it)", q->module->path);
    return NULL;
}

/* The output Var of a producer handing off: its float buffer holds the codes. */
Var *qlayer_int8_handoff_var(Tape *t, int ndim, const int *shape, const VarCodes *hand) {
    Var *y = tape_new_var(t, ndim, shape);
    VarCodes *c = y ? tape_alloc(t, sizeof *c) : NULL;
    if (!c) return NULL;
    *c = *hand;
    c->data = (const unsigned char *)y->value.data;
    y->codes = c;
    return y;
}

/* The output Var of a producer handing off whose floats another reader takes too (Tape.handoff_keep): the floats
 * in its value, the codes in a buffer of their own, as large. */
Var *qlayer_int8_handoff_var_keep(Tape *t, int ndim, const int *shape, const VarCodes *hand) {
    Var *y = tape_new_var(t, ndim, shape);
    VarCodes *c = y ? tape_alloc(t, sizeof *c) : NULL;
    unsigned char *data = c ? tape_alloc(t, tensor_numel(&y->value) * sizeof(float)) : NULL;
    if (!data) return NULL;
    *c = *hand;
    c->data = data, c->floats = true;
    y->codes = c;
    return y;
}

/* One image's output, made in scratch (C planes of P floats), to its codes at dst (the image's); false for a value
 * that is not finite. */
bool qlayer_int8_handoff_image(const VarCodes *hand, uint8_t *dst, const float *y, int C, size_t P) {
    if (!hand->plane) return qgemm_quantize_u8(dst, y, (size_t)C * P, hand->s, hand->lo, hand->hi, hand->zero);
    const QGemmCodes a = {.s = hand->s, .lo = hand->lo, .hi = hand->hi, .zero = hand->zero};
    bool ok = true;
    for (int g = 0; g < (C + 3) / 4; g++) {
        uint32_t *p = (uint32_t *)(void *)dst + (size_t)g * hand->plane;
        const float *r[4];
        for (int k = 0; k < 4; k++) r[k] = 4 * g + k < C ? y + (size_t)(4 * g + k) * P : NULL;
        ok &= qgemm_quantize_u8x4(p, 0, r, 0, 1, (int)P, &a);
    }
    qlayer_int8_handoff_tails(hand, dst, C, P);
    return ok;
}

QGemmCodesOut qlayer_int8_codes_out(const VarCodes *hand, uint8_t *dst) {
    return (QGemmCodesOut){.q = {.s = hand->s, .lo = hand->lo, .hi = hand->hi, .zero = hand->zero}, .dst = dst,
                           .quad_plane = hand->plane};
}

/* The zero points past each quad's P codes at dst (plane > 0): what the reader's taps read past the image. */
void qlayer_int8_handoff_tails(const VarCodes *hand, uint8_t *dst, int C, size_t P) {
    if (!hand->plane) return;
    for (int g = 0; g < (C + 3) / 4; g++)
        qlayer_int8_fill_dwords((uint32_t *)(void *)dst + (size_t)g * hand->plane + P, hand->plane - P,
                                (uint32_t)hand->zero * 0x01010101u);
}

/* The bytes of one image's codes at plane > 0 (qlayer_int8_handoff_var's layout). */
size_t qlayer_int8_handoff_image_bytes(const VarCodes *hand, int C, size_t P) {
    return hand->plane ? (size_t)((C + 3) / 4) * hand->plane * 4 : (size_t)C * P;
}

/* After the tasks, bad[i] for image i: 1, an input value not finite (inputs_finite's message; never for codes
 * handed over, whose values were checked where they were made); 2, an output value the reader's quantizer cannot
 * code. */
bool qlayer_int8_checks_pass(Tape *t, const QLayer *q, const Var *x, const uint8_t *bad, int n) {
    uint8_t in = 0;
    for (int i = 0; i < n; i++) in |= bad[i] & 1;
    if (in) return inputs_finite(t, x, bad, n);
    for (int i = 0; i < n; i++)
        if (bad[i]) {
            qt_error_set(&t->err, QT_ERR_VALUE, "%s: image %d of the output holds a value that is not finite (NaN or "
                         "infinity), which the next layer's int8 input cannot code", q->module->path, i);
            return false;
        }
    return true;
}

/* ---- dense ----------------------------------------------------------------------------------------------------- */

typedef struct {
    QGemmDense d;
    const float *x; /* (N, in) */
    QGemmCodes ac;
    int rows;       /* per task */
    uint8_t *bad;   /* [tasks] */
} DenseJob;

static void dense_task(void *ctx, int task, int n_tasks) {
    (void)n_tasks;
    DenseJob *j = ctx;
    const int r0 = task * j->rows, r1 = r0 + j->rows < j->d.m ? r0 + j->rows : j->d.m, K = j->d.lda;
    uint8_t *a = (uint8_t *)j->d.a + (size_t)r0 * K;
    j->bad[task] = !qgemm_quantize_u8(a, j->x + (size_t)r0 * K, (size_t)(r1 - r0) * K, j->ac.s, j->ac.lo, j->ac.hi,
                                      j->ac.zero);
    qgemm_dense(&j->d, r0, r1, 0, j->d.b->panels);
}

Var *qlayer_int8_dense(Tape *t, QLayer *q, Var *x, Var *bias) {
    const int N = x->value.shape[0], in = q->fan_in, out = q->out;
    const int threads = qlayer_int8_threads_for((double)N * in * out);
    DenseJob j = {.x = x->value.data};
    if (!qlayer_int8_ensure_packed(t, q) || !qlayer_int8_act_codes(t, q, &j.ac)) return NULL;
    /* tasks of whole 8-row tiles, about two per thread so a slow one is evened out */
    int per = (N + 2 * threads - 1) / (2 * threads);
    j.rows = (per + QGEMM_ROWS - 1) / QGEMM_ROWS * QGEMM_ROWS;
    const int tasks = (N + j.rows - 1) / j.rows;
    Var *y = tape_new_var(t, 2, (const int[]){N, out});
    uint8_t *codes = tape_alloc(t, (size_t)N * in); /* (N, in) */
    float *scale = qlayer_int8_out_scales(t, q, j.ac.s);
    j.bad = tape_alloc(t, (size_t)tasks);
    if (!y || !codes || !scale || !j.bad) return NULL;
    j.d = (QGemmDense){.a = codes, .lda = in, .m = N, .a_zero = j.ac.zero, .b = &q->int8->dense,
                       .c_f32 = y->value.data, .ldc = out, .scale = scale, .bias = bias ? bias->value.data : NULL};
    qlayer_int8_run(threads, tasks, dense_task, &j);
    return inputs_finite(t, x, j.bad, tasks) ? y : NULL;
}
