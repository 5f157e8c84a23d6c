/* fqt.c - the quantized-training layer: the spec's checks, setup and the
 * forward on quantized operands (the integer GEMM for signed int formats,
 * the float GEMM of the dequantized operands otherwise); the backward is
 * fqt_backward.c, the split of both over the step's threads fqt_shares.c.
 *
 * The operands are quantized through QArray's own per-slice rules
 * (qarray_plan.h): W as the QArray (out, fan_in) with channelwise axis 0, x
 * as one slice, both symmetric absmax with float32 scales, so their values
 * are bit for bit those of QAT's dynamic fake quantization of the same
 * layer (int formats through fqt_kern.h's vectorised twins of those
 * rules). A conv layer quantizes x once, then gathers the codes of every
 * receptive field (one byte per element): on the integer path as the
 * columns of X^T for W X^T (qgemm_s8_nn, image by image, the product laid
 * out or through the fused epilogue while in cache; the weight gradient
 * reads the same X^T), otherwise as the rows of X for the float GEMM of
 * the dequantized operands. */
#include "fqt.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "base/parallel.h"
#include "fqt_kern.h"
#include "nn/gemm.h"
#include "nn/ops.h"
#include "fqt_internal.h"
#include "qarray_plan.h"
#include "qgemm.h"
#include "qwino.h"

/* The integer GEMM's sums stay inside int32 for fan_in below 2^17 (|code product| <= 2^14). */
#define FQT_INT_FAN_IN_MAX (1 << 17)

static const char OP[] = FQT_OP;

FqtSpec fqt_spec_default(void) {
    return (FqtSpec){.bwd_calib = {.kind = CALIB_ABSMAX, .s = 1.0}, .noise_axes = FQT_NOISE_ROWS};
}

/* ---- checks ------------------------------------------------------------------------------------------------------ */

/* Why t cannot be one of QT's operand formats; NULL if it can. */
static const char *format_problem(const QType *t) {
    switch (t->kind) {
    case QTYPE_KIND_INT:
    case QTYPE_KIND_UINT:
    case QTYPE_KIND_FLOAT: return t->bits <= 8 ? NULL : "has codes of more than 8 bits";
    case QTYPE_KIND_LUT: return "is a lookup format";
    case QTYPE_KIND_TERNARY:
    case QTYPE_KIND_BINARY: return "is scaled by mean |x|, not by a range";
    default: return "is a block format with shared scales of its own";
    }
}

static QtStatus check_format(const Module *m, const char *key, const QType *t, QtError *err) {
    const char *why = format_problem(t);
    if (!why) return QT_OK;
    return qt_error_set(err, QT_ERR_CONFIG, "%s: %s: %s %s; qt quantizes with int, uint or float element formats "
                        "and one scale per slice (e.g. int8, int4, fp8_e4m3)", m->path, key, t->name, why);
}

static QtStatus check_module(const Module *m, QtError *err) {
    if (m->spec.type != LAYER_DENSE && m->spec.type != LAYER_CONV2D)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: qt quantizes the GEMMs of dense and conv2d modules, and this is "
                            "a %s module (narrow the rule's module_path)", m->path, layer_type_name(m->spec.type));
    int want = m->spec.type == LAYER_DENSE ? 2 : 4;
    if (!m->weight || m->weight->var.value.ndim != want)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the %s module has no %d-d weight for qt to quantize", m->path,
                            layer_type_name(m->spec.type), want);
    if (m->spec.type == LAYER_CONV2D && !m->conv_plain)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: qt's integer GEMM runs plain convolutions (one group, dilation "
                            "1, a square kernel, the same stride and padding on both axes), and this conv2d is %s; "
                            "leave it float32 (narrow the rule's module_path) or use qat", m->path,
                            m->spec.groups > 1 ? "grouped" : m->spec.dilation > 1 || m->spec.dilation_w > 1
                                                                 ? "dilated" : "not the same on both axes");
    return QT_OK;
}

/* The backward's settings. */
static QtStatus check_backward(const FqtSpec *spec, const Module *m, QtError *err) {
    if (spec->bwd_weight_grad_tile_size < 0)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: bwd_weight_grad_tile_size: %d is negative; give 0 (one scale per "
                            "column of the gradient) or the rows per scale", m->path, spec->bwd_weight_grad_tile_size);
    if (spec->noise_axes & ~(unsigned)(FQT_NOISE_ROWS | FQT_NOISE_COLS))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: channelwise_noise_axes: %u names axes other than the rows (1) "
                            "and columns (2) of the gradient", m->path, spec->noise_axes);
    QtError inner = {0};
    if (calib_spec_check(&spec->bwd_calib, &inner) != QT_OK)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: bwd_calib: %s", m->path, inner.msg);
    const QType *b = spec->bwd_qtype;
    if (!b && spec->bwd_stochastic)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: bwd_stochastic_rounding is set, but there is no bwd_qtype, so "
                            "the gradient is not quantized; set bwd_qtype or turn the rounding off", m->path);
    if (!b && spec->bwd_weight_grad_tile_size > 0)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: bwd_weight_grad_tile_size is %d, but there is no bwd_qtype, so "
                            "the gradient is not quantized; set bwd_qtype or the tile size 0", m->path,
                            spec->bwd_weight_grad_tile_size);
    if (!b) return QT_OK;
    QtStatus st = check_format(m, "bwd_qtype", b, err);
    if (st == QT_OK && b->kind == QTYPE_KIND_UINT)
        st = qt_error_set(err, QT_ERR_CONFIG, "%s: bwd_qtype: %s has no negative codes, but gradients take both "
                          "signs; use an int or float format (e.g. int8, fp8_e5m2)", m->path, b->name);
    return st;
}

QtStatus fqt_layer_check(const FqtSpec *spec, const Module *m, QtError *err) {
    if (!spec || !m) return qt_error_set(err, QT_ERR_ARG, "fqt_layer_check: NULL spec or module");
    QtStatus st = check_module(m, err);
    if (st != QT_OK) return st;
    if (!spec->weight_qtype)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: weight_qtype: not set; qt quantizes the forward's weight, so "
                            "give it a format (e.g. int8)", m->path);
    st = check_format(m, "weight_qtype", spec->weight_qtype, err);
    if (st == QT_OK && spec->act_qtype) st = check_format(m, "act_qtype", spec->act_qtype, err);
    if (st == QT_OK) st = check_backward(spec, m, err);
    return st;
}

/* ---- setup ------------------------------------------------------------------------------------------------------- */

QtStatus fqt_layer_init(FqtLayer *q, Module *m, const FqtSpec *spec, uint64_t seed, uint64_t stream, QtError *err) {
    if (!q) return qt_error_set(err, QT_ERR_ARG, "fqt_layer_init: no FqtLayer");
    memset(q, 0, sizeof *q);
    QtStatus st = fqt_layer_check(spec, m, err);
    if (st != QT_OK) return st;
    q->module = m;
    q->spec = *spec;
    const Tensor *w = &m->weight->var.value;
    q->out = w->shape[0];
    q->fan_in = (int)(tensor_numel(w) / (size_t)q->out);
    rng_init(&q->rng, seed, stream);
    return QT_OK;
}

static Var *fqt_forward(Tape *t, FqtLayer *q, Var *x, Var *bias, ConvEpilogue epi);

static Var *fqt_hook(Tape *t, Module *m, Var *x, void *ctx) {
    (void)m;
    return fqt_layer_forward(t, ctx, x);
}

/* conv2d with the following relu (and 2x2 max pool) folded in, as nn_conv2d_fused folds them: the same values and
 * gradients as the separate ops. Declines (NULL, no error) a bias other than the module's own (a folded batch
 * norm's), which then runs as separate ops. */
static Var *fqt_fused_hook(Tape *t, Module *m, Var *x, void *ctx, Var *bias, ConvEpilogue epi) {
    if (bias != (m->bias ? &m->bias->var : NULL)) return NULL;
    return fqt_forward(t, ctx, x, bias, epi);
}

void fqt_layer_install(FqtLayer *q) {
    if (!q || !q->module) return;
    q->module->forward_hook = fqt_hook;
    q->module->fused_hook = q->module->spec.type == LAYER_CONV2D ? fqt_fused_hook : NULL;
    q->module->fused_residual = false;
    q->module->weight_hook = NULL;
    q->module->hook_ctx = q;
}

/* ---- QArray's rules ---------------------------------------------------------------------------------------------- */

/* The representable range [lo, hi] of plan p's elements in units of their scale, as fake quantization's clipped
 * STE judges it (symmetric: no zero point). */
static void plan_bounds(const QArrayPlan *p, float *lo, float *hi) {
    if (p->t->kind == QTYPE_KIND_FLOAT) {
        *lo = -p->t->max, *hi = p->t->max;
    } else {
        *lo = p->qmin, *hi = p->qmax;
    }
}

/* The scale of the slice v [n] under plan p (calibrated, rounded to the scale type); work as calib_compute takes it. */
QtStatus fqt_slice_scale(const QArrayPlan *p, const float *v, size_t n, void *work, size_t work_bytes, float *s,
                            QtError *err) {
    CalibRange r;
    uint32_t stored;
    QtStatus st = qarray_plan_slice_range(p, v, n, work, work_bytes, &r, err);
    if (st == QT_OK) st = qarray_plan_round_scale(p, 0, qarray_plan_scale(p, r.lo, r.hi), &stored, s, err);
    return st;
}

/* The value of every code of t, in code units (int) or element units (float). */
static void format_values(const QType *t, float *lut /* [1 << bits] */) {
    for (uint32_t c = 0; c < (1u << t->bits); c++) lut[c] = qtype_decode(t, c);
}

static const QType *act_format(const FqtLayer *q) {
    return q->spec.act_qtype ? q->spec.act_qtype : q->spec.weight_qtype;
}

/* Whether the codes of both operands are signed integers an int8 holds, summed exactly in int32. */
static bool integer_gemm(const QType *wt, const QType *at, int fan_in) {
    return wt->kind == QTYPE_KIND_INT && at->kind == QTYPE_KIND_INT && wt->bits <= 8 && at->bits <= 8 &&
           fan_in < FQT_INT_FAN_IN_MAX;
}

bool fqt_layer_integer(const FqtLayer *q) {
    return q && q->spec.weight_qtype && integer_gemm(q->spec.weight_qtype, act_format(q), q->fan_in);
}

/* ---- the forward ------------------------------------------------------------------------------------------------- */

/* rows and, for conv, the geometry of x against the weight; false with the tape error set. */
static bool input_geometry(Tape *t, const FqtLayer *q, const Var *x, FqtCtx *c) {
    const Module *m = q->module;
    const Tensor *w = &m->weight->var.value;
    char sx[64], sw[64];
    tensor_shape_str(&x->value, sx, sizeof sx);
    tensor_shape_str(w, sw, sizeof sw);
    const int *xs = x->value.shape;
    if (!c->conv) {
        if (x->value.ndim != 2 || xs[1] != q->fan_in) {
            qt_error_set(&t->err, QT_ERR_SHAPE, "%s (%s): input %s does not fit weight %s (want (N, %d))", m->path, OP,
                         sx, sw, q->fan_in);
            return false;
        }
        c->rows = xs[0];
        return true;
    }
    int s = m->spec.stride, p = m->spec.padding;
    if (x->value.ndim != 4 || xs[1] != w->shape[1] || s < 1 || p < 0) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "%s (%s): input %s does not fit weight %s with stride %d, padding %d "
                     "(want (N, %d, H, W))", m->path, OP, sx, sw, s, p, w->shape[1]);
        return false;
    }
    long long ph = (long long)xs[2] + 2LL * p, pw = (long long)xs[3] + 2LL * p;
    long long oh = (ph - w->shape[2]) / s + 1, ow = (pw - w->shape[3]) / s + 1;
    if (ph < w->shape[2] || pw < w->shape[3] || (long long)xs[0] * oh * ow > INT_MAX) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "%s (%s): input %s padded by %d does not fit the %dx%d kernel of weight "
                     "%s, or gives more than %d output pixels", m->path, OP, sx, p, w->shape[2], w->shape[3], sw,
                     INT_MAX);
        return false;
    }
    c->cg = (FqtConvGeom){xs[0], xs[1], xs[2], xs[3], w->shape[2], w->shape[3], (int)oh, (int)ow, s, p};
    c->rows = (int)(xs[0] * oh * ow);
    return true;
}

/* Sets the tape error for an error of `inner` while quantizing `what`. */
bool fqt_quant_failed(Tape *t, const FqtLayer *q, const char *what, const QtError *inner) {
    qt_error_set(&t->err, inner->status, "%s (%s): quantizing %s: %s", q->module->path, OP, what, inner->msg);
    return false;
}

/* W (out, fan_in) per output channel: scales sw, values wd and, for the integer GEMM, the codes *wc. */
static bool quantize_weight(Tape *t, const FqtLayer *q, FqtCtx *c, bool integer, int8_t **wc) {
    const QType *wt = q->spec.weight_qtype;
    int out = c->out, K = c->fan_in;
    const float *w = q->module->weight->var.value.data; /* (out, fan_in) */
    QArrayOptions o = {.n_channelwise = 1, .channelwise_axes = {0}, .range = QARRAY_RANGE_SYMMETRIC};
    QArrayPlan p;
    QtError inner = {0};
    if (qarray_plan_make(&p, "weight_qtype", 2, (const int[]){out, K}, wt, &o, &inner) != QT_OK)
        return fqt_quant_failed(t, q, "the weight", &inner);
    float *sw = tape_alloc(t, (size_t)out * sizeof *sw), *wd = tape_alloc(t, (size_t)out * K * sizeof *wd);
    int8_t *codes = integer ? tape_alloc(t, (size_t)out * K) : NULL; /* (out, fan_in) */
    if (!sw || !wd || (integer && !codes)) return false;
    plan_bounds(&p, &c->w_lo, &c->w_hi);
    c->sw = sw, c->wd = wd, *wc = codes;
    if (fqt_plan_fast(&p) && fqt_quant_rows(codes, wd, sw, w, out, K, &p, NULL)) return true;
    float lut[256];
    format_values(wt, lut);
    for (int r = 0; r < out; r++) {
        const float *row = w + (size_t)r * K;
        if (fqt_slice_scale(&p, row, (size_t)K, NULL, 0, &sw[r], &inner) != QT_OK)
            return fqt_quant_failed(t, q, "the weight", &inner);
        for (int k = 0; k < K; k++) {
            float v = lut[qarray_plan_encode(&p, row[k], sw[r], 0.0f, QROUND_RNE, 0.0f)];
            wd[(size_t)r * K + k] = v * sw[r];
            if (codes) codes[(size_t)r * K + k] = (int8_t)v;
        }
    }
    return true;
}

/* rows (rows, C*KH*KW) = the receptive field of every output pixel (n, oh, ow) of x (N, C, H, W), one byte per
 * element, 0 for the padding (the code and the integer value of 0 alike). Images [lo, hi). */
typedef struct {
    uint8_t *rows;
    const uint8_t *x;
    const FqtConvGeom *g;
} PatchJob;

static void gather_patches_part(const void *ctx, int lo, int hi) {
    const PatchJob *j = ctx;
    const FqtConvGeom *g = j->g;
    const size_t ckk = (size_t)g->C * g->KH * g->KW, plane = (size_t)g->H * g->W;
    /* [ow_lo, ow_hi): the output columns whose whole kernel row lies inside the input */
    int ow_lo = (g->padding + g->stride - 1) / g->stride;
    int ow_hi = g->W - g->KW + g->padding < 0 ? 0 : (g->W - g->KW + g->padding) / g->stride + 1;
    if (ow_hi > g->OW) ow_hi = g->OW;
    if (ow_lo > ow_hi) ow_lo = ow_hi;
    uint8_t *dst = j->rows + (size_t)lo * g->OH * g->OW * ckk;
    for (int n = lo; n < hi; n++)
        for (int oh = 0; oh < g->OH; oh++)
            for (int ow = 0; ow < g->OW; ow++, dst += ckk) {
                uint8_t *d = dst;
                const bool inside = ow >= ow_lo && ow < ow_hi;
                for (int ch = 0; ch < g->C; ch++) {
                    const uint8_t *xp = j->x + ((size_t)n * g->C + ch) * plane; /* (H, W) */
                    for (int kh = 0; kh < g->KH; kh++, d += g->KW) {
                        int ih = oh * g->stride + kh - g->padding, iw0 = ow * g->stride - g->padding;
                        if (ih < 0 || ih >= g->H) {
                            memset(d, 0, (size_t)g->KW);
                        } else if (inside && g->KW == 3) {
                            /* the common kernel: one 4-byte load and store, the 4th byte rewritten by the next
                               row of the patch (the pixel's last row: 3 bytes); xb has 4 bytes of slack */
                            const uint8_t *src = xp + (size_t)ih * g->W + iw0;
                            if (ch < g->C - 1 || kh < g->KH - 1) {
                                uint32_t v4;
                                memcpy(&v4, src, 4);
                                memcpy(d, &v4, 4);
                            } else {
                                d[0] = src[0], d[1] = src[1], d[2] = src[2];
                            }
                        } else if (inside) {
                            memcpy(d, xp + (size_t)ih * g->W + iw0, (size_t)g->KW);
                        } else {
                            for (int kw = 0; kw < g->KW; kw++) {
                                int iw = iw0 + kw;
                                d[kw] = iw >= 0 && iw < g->W ? xp[(size_t)ih * g->W + iw] : 0;
                            }
                        }
                    }
                }
            }
}

static void gather_patches(uint8_t *rows, const uint8_t *x, const FqtConvGeom *g) {
    PatchJob j = {rows, x, g};
    fqt_shares_run(g->N, (size_t)g->N * g->OH * g->OW * g->C * g->KH * g->KW, gather_patches_part, &j);
}

/* Rows [lo, hi) of X^T's block (the elements k of a patch): fqt_gather_xt. */
typedef struct {
    int8_t *xt;
    const FqtCtx *c;
    int r0, L;
} XtJob;

/* dst (H, W) = src (H, W) shifted: dst[h][w] = src[h + dh][w + dw], 0 outside (|dh| < H, |dw| < W): the valid
 * rows as one block copy, then the |dw| columns that wrapped into the neighbouring row set to 0. */
static void xt_shifted_plane(int8_t *dst, const int8_t *src, int H, int W, int dh, int dw) {
    const int h_lo = dh < 0 ? -dh : 0, h_hi = dh > 0 ? H - dh : H, adw = dw < 0 ? -dw : dw;
    if (h_hi <= h_lo || adw >= W) {
        memset(dst, 0, (size_t)H * W);
        return;
    }
    memset(dst, 0, (size_t)h_lo * W);
    memset(dst + (size_t)h_hi * W, 0, (size_t)(H - h_hi) * W);
    const size_t n = (size_t)(h_hi - h_lo) * W - (size_t)adw;
    int8_t *d = dst + (size_t)h_lo * W;
    const int8_t *s0 = src + (size_t)(h_lo + dh) * W;
    /* the wrapped columns: one byte a row for a 3x3 kernel, stored in place (a memset call a row cost more than
     * the copy: the reference CNN's conv2 makes 36,864 planes of 14 rows a step) */
    int8_t *edge = dst + (size_t)h_lo * W + (dw >= 0 ? W - adw : 0);
    if (dw >= 0) memcpy(d, s0 + dw, n);
    else memcpy(d + adw, s0, n);
    if (adw == 1)
        for (int h = h_lo; h < h_hi; h++, edge += W) *edge = 0;
    else if (adw > 1)
        for (int h = h_lo; h < h_hi; h++, edge += W) memset(edge, 0, (size_t)adw);
}

static void xt_part(const void *ctx, int lo, int hi) {
    const XtJob *j = ctx;
    const FqtCtx *c = j->c;
    const int K = c->fan_in, r1 = j->r0 + j->L;
    for (int k = lo; k < hi; k++) {
        int8_t *dst = j->xt + (size_t)j->r0 * K + (size_t)k * j->L; /* [L] */
        const FqtConvGeom *g = &c->cg;
        const int P = g->OH * g->OW, ch = k / (g->KH * g->KW), kh = k / g->KW % g->KH, kw = k % g->KW;
        const int s = g->stride, off = kw - g->padding; /* iw = ow * s + off */
        /* [ow_lo, ow_hi): the output columns whose iw lies inside the row */
        const int ow_lo = off >= 0 ? 0 : (-off + s - 1) / s;
        int ow_hi = g->W - 1 - off < 0 ? 0 : (g->W - 1 - off) / s + 1;
        if (ow_hi > g->OW) ow_hi = g->OW;
        int n = j->r0 / P, oh = j->r0 % P / g->OW, ow = j->r0 % g->OW;
        /* stride 1, output as large as the input: an image's plane is the input plane shifted, copied whole */
        const bool same1 = s == 1 && g->OH == g->H && g->OW == g->W;
        for (int r = j->r0; r < r1;) {
            if (same1 && oh == 0 && ow == 0 && r1 - r >= P) {
                xt_shifted_plane(dst, c->xb + ((size_t)n * g->C + ch) * P, g->H, g->W, kh - g->padding, off);
                dst += P, r += P, n++;
                continue;
            }
            const int run = g->OW - ow < r1 - r ? g->OW - ow : r1 - r, ih = oh * s + kh - g->padding;
            if (ih < 0 || ih >= g->H) {
                memset(dst, 0, (size_t)run);
            } else {
                const int8_t *row = c->xb + (((size_t)n * g->C + ch) * g->H + ih) * g->W; /* [W] */
                const int a = ow_lo > ow ? (ow_lo < ow + run ? ow_lo : ow + run) : ow;
                const int b = ow_hi < ow + run ? (ow_hi > a ? ow_hi : a) : ow + run;
                memset(dst, 0, (size_t)(a - ow));
                if (s == 1) {
                    memcpy(dst + (a - ow), row + a + off, (size_t)(b - a));
                } else {
                    for (int q = a; q < b; q++) dst[q - ow] = row[q * s + off];
                }
                memset(dst + (b - ow), 0, (size_t)(ow + run - b));
            }
            dst += run, r += run, ow += run;
            if (ow == g->OW) {
                ow = 0;
                if (++oh == g->OH) oh = 0, n++;
            }
        }
    }
}

void fqt_gather_xt(int8_t *xt, const FqtCtx *c, int r0, int L) {
    XtJob j = {xt, c, r0, L};
    fqt_shares_run(c->fan_in, (size_t)c->fan_in * L, xt_part, &j);
}

/* x per tensor: the scale sx and X, as integer codes xc (integer GEMM) or values xd. */
static bool quantize_input(Tape *t, const FqtLayer *q, const Var *x, FqtCtx *c, bool integer, bool xt_path) {
    const QType *at = act_format(q);
    size_t numel = var_numel(x);
    QArrayOptions o = {.range = QARRAY_RANGE_SYMMETRIC}; /* no axes: one scale */
    QArrayPlan p;
    QtError inner = {0};
    if (qarray_plan_make(&p, "act_qtype", x->value.ndim, x->value.shape, at, &o, &inner) != QT_OK)
        return fqt_quant_failed(t, q, "the input", &inner);
    plan_bounds(&p, &c->x_lo, &c->x_hi);
    float lut[256];
    format_values(at, lut);
    /* one byte per element: the integer value for the integer GEMM, else the code */
    uint8_t *xb = tape_alloc(t, numel + 4); /* 4 bytes of slack: gather_patches' 4-byte loads */
    float *part = tape_alloc(t, (size_t)parallel_get_threads() * sizeof *part);
    if (!xb || !part) return false;
    if (fqt_plan_fast(&p) && fqt_quant_tensor((int8_t *)xb, NULL, &c->sx, part, x->value.data, numel, &p)) {
        const uint8_t mask = (uint8_t)((1u << at->bits) - 1u); /* the integer value's low bits are its code */
        for (size_t i = 0; !integer && mask != 0xff && i < numel; i++) xb[i] &= mask;
    } else {
        if (fqt_slice_scale(&p, x->value.data, numel, NULL, 0, &c->sx, &inner) != QT_OK)
            return fqt_quant_failed(t, q, "the input", &inner);
        for (size_t i = 0; i < numel; i++) {
            uint32_t code = qarray_plan_encode(&p, x->value.data[i], c->sx, 0.0f, QROUND_RNE, 0.0f);
            xb[i] = integer ? (uint8_t)(int8_t)lut[code] : (uint8_t)code;
        }
    }
    if (xt_path) { /* forward_product_xt gathers X^T from xb */
        c->xb = (const int8_t *)xb;
        return true;
    }
    size_t n = (size_t)c->rows * c->fan_in;
    uint8_t *rows = xb;
    if (c->conv) {
        if (!(rows = tape_alloc(t, n))) return false;
        gather_patches(rows, xb, &c->cg);
    }
    if (integer) {
        c->xc = (const int8_t *)rows;
        c->xb = (const int8_t *)xb;
        return true;
    }
    float *xd = tape_alloc(t, n * sizeof *xd);
    if (!xd) return false;
    for (size_t i = 0; i < n; i++) xd[i] = lut[rows[i]] * c->sx;
    c->xd = xd;
    return true;
}

/* y = X W^T (+ bias) laid out as the module's op lays it: (N, out), or (N, OC, OH, OW) from the product's
 * (N*OH*OW, OC). */
typedef struct {
    const FqtCtx *c;
    const int32_t *acc; /* (rows, out) the integer product, or NULL */
    const float *prod;  /* (rows, out) the float product (acc NULL) */
    const float *b;     /* [out] or NULL */
    float *y;           /* (N, OC, OH, OW), or the epilogue's output */
    uint8_t *winner;    /* the pool's winners (CONV_EPI_RELU_MAXPOOL2) */
    float *scratch;     /* fused: [threads][OC * OH * OW] one image's product planes per thread */
} LayoutJob;

/* Images [lo, hi): y[n][o][px] = product (n*plane + px, o) (scaled: (acc * sx) * sw[o], the dense path's order)
 * + bias. */
static void conv_layout_part(const void *ctx, int lo, int hi) {
    const LayoutJob *j = ctx;
    const FqtCtx *c = j->c;
    const size_t plane = (size_t)c->cg.OH * c->cg.OW;
    enum { BLOCK = 64 }; /* pixels whose product rows stay in L1 while every channel reads them */
    if (c->epi != CONV_EPI_NONE) { /* the image's planes without bias, then the epilogue adds it */
        float *pre = j->scratch + (size_t)parallel_thread_index() * c->out * plane; /* (OC, OH*OW) */
        const bool pooled = c->epi == CONV_EPI_RELU_MAXPOOL2;
        const size_t out_plane = pooled ? (size_t)(c->cg.OH / 2) * (c->cg.OW / 2) : plane;
        for (int img = lo; img < hi; img++) {
            for (size_t p0 = 0; p0 < plane; p0 += BLOCK) {
                const size_t p1 = plane - p0 < BLOCK ? plane : p0 + BLOCK;
                for (int o = 0; o < c->out; o++) {
                    const size_t first = (size_t)img * plane * c->out + o; /* then stride out */
                    float *dst = pre + (size_t)o * plane;
                    if (j->acc) {
                        const float so = c->sw[o];
                        for (size_t px = p0; px < p1; px++) dst[px] = (float)j->acc[first + px * c->out] * c->sx * so;
                    } else {
                        for (size_t px = p0; px < p1; px++) dst[px] = j->prod[first + px * c->out];
                    }
                }
            }
            for (int o = 0; o < c->out; o++) {
                const size_t at = ((size_t)img * c->out + o) * out_plane;
                nn_conv_epilogue_plane(j->y + at, pooled ? j->winner + at : NULL, pre + (size_t)o * plane,
                                       j->b ? j->b[o] : 0.0f, c->cg.OH, c->cg.OW, c->epi);
            }
        }
        return;
    }
    for (int img = lo; img < hi; img++)
        for (size_t p0 = 0; p0 < plane; p0 += BLOCK) {
            const size_t p1 = plane - p0 < BLOCK ? plane : p0 + BLOCK;
            for (int o = 0; o < c->out; o++) {
                float *dst = j->y + ((size_t)img * c->out + o) * plane; /* [OH*OW] */
                const size_t first = (size_t)img * plane * c->out + o;  /* then stride out */
                const float bo = j->b ? j->b[o] : 0.0f;
                if (j->acc) {
                    const float so = c->sw[o];
                    for (size_t px = p0; px < p1; px++)
                        dst[px] = (float)j->acc[first + px * c->out] * c->sx * so + bo;
                } else {
                    for (size_t px = p0; px < p1; px++) dst[px] = j->prod[first + px * c->out] + bo;
                }
            }
        }
}

static bool forward_product(Tape *t, const FqtCtx *c, const int8_t *wc, const Var *bias, Var *y) {
    size_t n = (size_t)c->rows * c->out;
    const float *b = bias ? bias->value.data : NULL;
    LayoutJob j = {.c = c, .b = b, .y = y->value.data};
    int32_t *acc = NULL;
    float *prod = NULL;
    if (c->xc) {
        if (!(acc = tape_alloc(t, n * sizeof *acc))) return false; /* (rows, out) */
        fqt_qgemm_s8(acc, c->xc, wc, c->rows, c->out, c->fan_in);
    }
    if (!c->conv || !acc) {
        prod = c->conv ? tape_alloc(t, n * sizeof *prod) : y->value.data; /* (rows, out) */
        if (!prod) return false;
    }
    if (acc && !c->conv) {
        for (int r = 0; r < c->rows; r++)
            for (int o = 0; o < c->out; o++)
                prod[(size_t)r * c->out + o] = (float)acc[(size_t)r * c->out + o] * c->sx * c->sw[o];
    } else if (!acc) {
        gemm_f32(false, true, c->rows, c->out, c->fan_in, 1.0f, c->xd, c->fan_in, c->wd, c->fan_in, 0.0f, prod,
                 c->out);
    }
    if (!c->conv) {
        for (int r = 0; b && r < c->rows; r++)
            for (int o = 0; o < c->out; o++) prod[(size_t)r * c->out + o] += b[o];
        return true;
    }
    j.acc = acc, j.prod = prod, j.winner = (uint8_t *)c->winner;
    if (c->epi != CONV_EPI_NONE &&
        !(j.scratch = tape_alloc(t, (size_t)parallel_get_threads() * c->out * c->cg.OH * c->cg.OW * sizeof(float))))
        return false;
    fqt_shares_run(c->cg.N, n, conv_layout_part, &j);
    return true;
}

/* Images [lo, hi) of the conv's forward on the integer path: each image's product W X^T (out, OH*OW) into the
 * thread's scratch (the image's columns of X^T, cut where a dW chunk ends), then laid out as y (N, OC, OH, OW)
 * with the bias, or through the fused epilogue: the product never leaves the cache. */
typedef struct {
    const FqtCtx *c;
    const int8_t *w, *xt; /* (out, fan_in); X^T chunk-major */
    const float *b;       /* [out] or NULL */
    float *y;
    uint8_t *winner;
    int32_t *acc;         /* [threads][out * OH*OW] */
    float *pre;           /* [threads][OH*OW], fused epilogues */
    int tile;
    int split;            /* shares of the output channels per image: > 1 when the images are fewer than threads */
    /* the integer F(2x2, 3x3) (qwino.h) in place of qgemm_s8_nn where it takes the conv (split 1), or NULL */
    const QWino *wino;
    const int32_t *wino_w; /* its packed weights */
    uint8_t *wino_scratch; /* [threads][qwino_scratch_bytes] */
} NnJob;

/* The dW chunk [*c0, *c1) that holds row a: tiles start at multiples of tile, chunks at multiples of
 * FQT_DW_CHUNK from their tile's start (fqt_dw_chunk_end). */
static void chunk_of(int a, int rows, int tile, int *c0, int *c1) {
    const int t0 = a / tile * tile;
    *c0 = t0 + (a - t0) / FQT_DW_CHUNK * FQT_DW_CHUNK;
    *c1 = fqt_dw_chunk_end(*c0, rows, tile);
}

/* Units [lo, hi) of j->split per image: unit u is image u / split, its output channels' share u % split. */
static void nn_image_part(const void *ctx, int lo, int hi) {
    const NnJob *j = ctx;
    const FqtCtx *c = j->c;
    const int P = c->cg.OH * c->cg.OW, K = c->fan_in, rows = c->rows;
    const bool pooled = c->epi == CONV_EPI_RELU_MAXPOOL2;
    const size_t out_plane = pooled ? (size_t)(c->cg.OH / 2) * (c->cg.OW / 2) : (size_t)P;
    const int th = parallel_thread_index();
    int32_t *acc = j->acc + (size_t)th * c->out * P; /* (out, P) */
    float *pre = j->pre ? j->pre + (size_t)th * P : NULL;
    for (int u = lo; u < hi; u++) {
        const int n = u / j->split;
        int o_lo, o_hi;
        parallel_range(c->out, u % j->split, j->split, &o_lo, &o_hi);
        if (o_lo >= o_hi) continue;
        if (j->wino) /* the same sums from the image's codes as they lie */
            qwino_forward(j->wino, acc, (size_t)P, c->xb + (size_t)n * c->cg.C * c->cg.H * c->cg.W, j->wino_w, c->out,
                          j->wino_scratch + (size_t)th * qwino_scratch_bytes(j->wino));
        for (int a = n * P; !j->wino && a < (n + 1) * P;) { /* the image's columns, chunk by chunk */
            int c0, c1;
            chunk_of(a, rows, j->tile, &c0, &c1);
            const int b = c1 < (n + 1) * P ? c1 : (n + 1) * P, L = c1 - c0;
            qgemm_s8_nn(acc + (size_t)o_lo * P + (a - n * P), P, j->w + (size_t)o_lo * K,
                        j->xt + (size_t)c0 * K + (a - c0), L, o_hi - o_lo, b - a, K);
            a = b;
        }
        for (int o = o_lo; o < o_hi; o++) {
            const int32_t *src = acc + (size_t)o * P;
            const float so = c->sw[o], bo = j->b ? j->b[o] : 0.0f;
            const size_t at = ((size_t)n * c->out + o) * out_plane;
            if (c->epi == CONV_EPI_NONE) {
                fqt_scale_i32(j->y + at, src, (size_t)P, c->sx, so, bo, true);
                continue;
            }
            fqt_scale_i32(pre, src, (size_t)P, c->sx, so, 0.0f, false);
            nn_conv_epilogue_plane(j->y + at, pooled ? j->winner + at : NULL, pre, bo, c->cg.OH, c->cg.OW, c->epi);
        }
    }
}

/* The conv's product as W (out, fan_in) X^T (fan_in, rows): X^T gathered chunk by chunk (the weight gradient's
 * chunks, kept in c->xt for it), then image by image the integer sums, laid out (and the epilogue) as
 * forward_product does: the same values. Where qwino takes the sums from the codes as they lie, X^T is gathered
 * only for a backward. */
static bool forward_product_xt(Tape *t, FqtCtx *c, const int8_t *wc, const Var *bias, Var *y) {
    const int rows = c->rows, out = c->out, K = c->fan_in, tile = fqt_grad_tile(c), P = c->cg.OH * c->cg.OW;
    const int threads = parallel_get_threads();
    int8_t *xt = tape_alloc(t, (size_t)rows * K); /* chunk-major blocks (fan_in, L) */
    NnJob j = {.c = c, .w = wc, .xt = xt, .b = bias ? bias->value.data : NULL, .y = y->value.data,
               .winner = (uint8_t *)c->winner, .tile = tile};
    j.acc = tape_alloc(t, (size_t)threads * out * P * sizeof *j.acc);
    if (c->epi != CONV_EPI_NONE) j.pre = tape_alloc(t, (size_t)threads * P * sizeof *j.pre);
    if (!xt || !j.acc || (c->epi != CONV_EPI_NONE && !j.pre)) return false;
    j.split = c->cg.N >= threads ? 1 : (threads + c->cg.N - 1) / c->cg.N;
    if (j.split > out) j.split = out;
    const FqtConvGeom *g = &c->cg;
    if (j.split == 1 && qwino_fits(g->C, out, g->KH, g->KW, g->stride, g->padding)) {
        QWino *p = tape_alloc(t, sizeof *p);
        if (!p) return false;
        qwino_plan(p, g->C, g->H, g->W);
        int32_t *wp = tape_alloc(t, qwino_packed_words(p, out) * sizeof *wp);
        if (!wp || !(j.wino_scratch = tape_alloc(t, (size_t)threads * qwino_scratch_bytes(p)))) return false;
        qwino_pack(p, wp, wc, out);
        j.wino = p, j.wino_w = wp;
    }
    const bool gather = !j.wino || t->grad_enabled; /* X^T: qgemm_s8_nn's, and the weight gradient's */
    for (int r0 = 0; gather && r0 < rows;) {
        const int r1 = fqt_dw_chunk_end(r0, rows, tile);
        fqt_gather_xt(xt, c, r0, r1 - r0);
        r0 = r1;
    }
    c->xt = gather ? xt : NULL;
    fqt_shares_run(c->cg.N * j.split, (size_t)rows * out * K >> 3, nn_image_part, &j);
    return true;
}

/* The layer's forward with epi fused after it (conv; CONV_EPI_NONE for dense), its bias added before epi. */
static Var *fqt_forward(Tape *t, FqtLayer *q, Var *x, Var *bias, ConvEpilogue epi) {
    if (!t || !x) return NULL;
    if (!q || !q->module || !q->spec.weight_qtype) {
        qt_error_set(&t->err, QT_ERR_ARG, "fqt_layer_forward: the QT layer is not initialised");
        return NULL;
    }
    Module *m = q->module;
    if (!m->weight || !m->weight->var.value.data) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: the float weight was released, but a QT layer trains it (a module "
                     "takes either PTQ or QT)", m->path);
        return NULL;
    }
    FqtCtx *c = tape_alloc(t, sizeof *c);
    if (!c) return NULL;
    *c = (FqtCtx){.q = q, .conv = m->spec.type == LAYER_CONV2D, .out = q->out, .fan_in = q->fan_in, .epi = epi};
    bool integer = integer_gemm(q->spec.weight_qtype, act_format(q), q->fan_in);
    int8_t *wc = NULL;
    if (!input_geometry(t, q, x, c)) return NULL;
    /* a conv whose backward (if any) is integer multiplies W by X^T: the codes the weight gradient reads too */
    c->int_bwd = integer && fqt_int_backward_applies(c);
    const bool xt_path = c->conv && integer && (!t->grad_enabled || c->int_bwd);
    if (!quantize_weight(t, q, c, integer, &wc) || !quantize_input(t, q, x, c, integer, xt_path)) return NULL;
    const bool pooled = epi == CONV_EPI_RELU_MAXPOOL2;
    if (pooled && (c->cg.OH < 2 || c->cg.OW < 2)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "%s (%s): the %dx%d output is too small for the fused 2x2 max pool",
                     m->path, OP, c->cg.OH, c->cg.OW);
        return NULL;
    }
    const int OH = pooled ? c->cg.OH / 2 : c->cg.OH, OW = pooled ? c->cg.OW / 2 : c->cg.OW;
    Var *y = c->conv ? tape_new_var(t, 4, (const int[]){c->cg.N, c->out, OH, OW})
                     : tape_new_var(t, 2, (const int[]){c->rows, c->out});
    if (!y || (pooled && !(c->winner = tape_alloc(t, var_numel(y)))) ||
        !(xt_path ? forward_product_xt(t, c, wc, bias, y) : forward_product(t, c, wc, bias, y)))
        return NULL;
    return tape_record(t, OP, fqt_backward, y, (Var *[]){x, &m->weight->var, bias}, 3, c) ? y : NULL;
}

Var *fqt_layer_forward(Tape *t, FqtLayer *q, Var *x) {
    Var *bias = q && q->module && q->module->bias ? &q->module->bias->var : NULL;
    return fqt_forward(t, q, x, bias, CONV_EPI_NONE);
}
