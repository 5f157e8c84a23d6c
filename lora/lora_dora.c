/* lora_dora.c - DoRA adapters (lora_dora.h): the per-channel gain
 * g = m / |W + scale B A|_c with its exact backward, the combination of
 * the base and the adapter branch under g, merging and the step's work.
 *
 * Three tape ops, each a plain forward and backward:
 *   dora_gain     (M, A, B, W) -> g (out)
 *   dora_combine  (z, pz, u, g, bias) -> y = z + (g - 1)(pz - bias) + g scale u
 *   dora_weight   (M, A, B, W) -> W' = g V (W's shape)
 * A conv without active dropout runs as one convolution on W' (dora_weight),
 * its relu and pooling fused in when they follow (lora_dora_fused); a dense
 * layer, and a conv under adapter dropout or over a base that does not
 * lend its weight, runs the base and the branch (dora_gain, dora_combine):
 * for a dense layer the branch's r (in + out) products per example are
 * fewer than W''s gradient, in out. */
#include "lora_dora.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/gemm.h"
#include "nn/ops.h"

/* ---- the direction V = W + scale B A and its norms ------------------------------------------- */

/* Output channels per group of B and rows of A per group: a dense layer is one group. */
static int dora_groups(const LoraAdapter *a) {
    return a->module->spec.type == LAYER_CONV2D ? a->module->spec.groups : 1;
}

void lora_dora_direction(const LoraAdapter *a, const float *w, float *v, float *norms) {
    const int g = dora_groups(a), og = a->out / g, rg = a->spec.rank / g, fan = a->fan_in;
    const float *A = a->A.var.value.data, *B = a->B.var.value.data;
    if (v != w) memcpy(v, w, (size_t)a->out * fan * sizeof(float));
    /* group k: v[k rows] (og, fan) += scale B_k (og, rg) A_k (rg, fan) */
    for (int k = 0; k < g; k++)
        gemm_f32(false, false, og, fan, rg, a->scale, B + (size_t)k * og * rg, rg, A + (size_t)k * rg * fan, fan, 1.0f,
                 v + (size_t)k * og * fan, fan);
    for (int o = 0; norms && o < a->out; o++) {
        const float *row = v + (size_t)o * fan;
        double s2 = 0.0;
        for (int j = 0; j < fan; j++) s2 += (double)row[j] * row[j];
        norms[o] = (float)sqrt(s2);
    }
}

QtStatus lora_dora_init_magnitude(LoraAdapter *a, const float *w, QtError *err) {
    /* lora_dora_direction's own norms, so the gain m / |V|_c of the first forward is exactly 1 */
    float *v = malloc((size_t)a->out * a->fan_in * sizeof(float));
    if (!v)
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory initialising the DoRA magnitude of %s", a->module->path);
    lora_dora_direction(a, w, v, a->M.var.value.data);
    free(v);
    return QT_OK;
}

/* 1 / |V|_c, 0 for a zero row (whose direction is undefined; it stays zero) */
static float inv_norm(float n) { return n > 0.0f ? 1.0f / n : 0.0f; }
/* the gain m / |V|_c (a division, not m inv_norm: every path rounds it alike), 0 for a zero row */
static float dora_g(float m, float n) { return n > 0.0f ? m / n : 0.0f; }

void lora_dora_merge(const LoraAdapter *a, float *w) {
    lora_dora_direction(a, w, w, NULL); /* V in place: no scratch */
    const float *m = a->M.var.value.data;
    for (int o = 0; o < a->out; o++) {
        float *row = w + (size_t)o * a->fan_in;
        double s2 = 0.0; /* |V|_c and the gain as the forward rounds them: the merged layer computes what the
                            adapter did */
        for (int j = 0; j < a->fan_in; j++) s2 += (double)row[j] * row[j];
        const float g = dora_g(m[o], (float)sqrt(s2));
        for (int j = 0; j < a->fan_in; j++) row[j] = g * row[j];
    }
}

/* ---- dora_gain: g = m / |W + scale B A|_c ---------------------------------------------------- */

typedef struct {
    const LoraAdapter *a;
    float *v;     /* (out, fan_in): V, turned into dV by the backward */
    float *norms; /* (out) |V|_c */
} DoraGainCtx;

/* dV (out, fan_in) into A, B and W: dB_k += scale dV_k A_k^T; dA_k += scale B_k^T dV_k; dW += dV. */
static void dora_dv_backward(Tape *t, const LoraAdapter *a, const float *dv, Var *A, Var *B, Var *W) {
    const int out = a->out, fan = a->fan_in, g = dora_groups(a), og = out / g, rg = a->spec.rank / g;
    if (B->requires_grad) {
        float *dB = tape_grad(t, B);
        if (!dB) return;
        for (int k = 0; k < g; k++)
            gemm_f32(false, true, og, rg, fan, a->scale, dv + (size_t)k * og * fan, fan,
                     A->value.data + (size_t)k * rg * fan, fan, 1.0f, dB + (size_t)k * og * rg, rg);
    }
    if (A->requires_grad) {
        float *dA = tape_grad(t, A);
        if (!dA) return;
        for (int k = 0; k < g; k++)
            gemm_f32(true, false, rg, fan, og, a->scale, B->value.data + (size_t)k * og * rg, rg,
                     dv + (size_t)k * og * fan, fan, 1.0f, dA + (size_t)k * rg * fan, fan);
    }
    if (W && W->requires_grad) {
        float *dW = tape_grad(t, W);
        if (!dW) return;
        for (size_t i = 0, n = (size_t)out * fan; i < n; i++) dW[i] += dv[i];
    }
}

/* in: M (out), A, B, W (out, fan_in) (the base weight; a dequantized one needs no gradient).
 * dm = dg / |V|; d|V| = -dg m / |V|^2; dV = d|V| V / |V|, then dora_dv_backward. */
static void dora_gain_backward(Tape *t, const TapeNode *node) {
    const DoraGainCtx *c = node->ctx;
    const LoraAdapter *a = c->a;
    Var *M = node->in[0];
    const float *dg = node->out->grad, *m = M->value.data;
    const int fan = a->fan_in;
    float *dm = M->requires_grad ? tape_grad(t, M) : NULL;
    for (int o = 0; o < a->out; o++) {
        float inv = inv_norm(c->norms[o]);
        if (dm) dm[o] += dg[o] * inv;
        float cv = (float)(-(double)dg[o] * m[o] * inv * inv * inv);
        float *row = c->v + (size_t)o * fan;
        for (int j = 0; j < fan; j++) row[j] *= cv;
    }
    dora_dv_backward(t, a, c->v, node->in[1], node->in[2], node->in[3]);
}

/* The context both ops keep for their backward: V and its norms from w, in the step's arena; NULL if it is full. */
static DoraGainCtx *dora_prepare(Tape *t, const LoraAdapter *a, const Var *w) {
    DoraGainCtx *c = tape_alloc(t, sizeof *c);
    float *v = tape_alloc(t, (size_t)a->out * a->fan_in * sizeof(float));
    float *norms = tape_alloc(t, (size_t)a->out * sizeof(float));
    if (!c || !v || !norms) return NULL;
    *c = (DoraGainCtx){a, v, norms};
    lora_dora_direction(a, w->value.data, v, norms);
    return c;
}

/* g (out) from M, A, B and the base weight w (out, fan_in as the module's weight). */
static Var *dora_gain(Tape *t, const LoraAdapter *a, Var *w) {
    if (!w) return NULL;
    Var *g = tape_new_var(t, 1, &a->out);
    DoraGainCtx *c = g ? dora_prepare(t, a, w) : NULL;
    if (!c) return NULL;
    const float *m = a->M.var.value.data;
    for (int o = 0; o < a->out; o++) g->value.data[o] = dora_g(m[o], c->norms[o]);
    Var *in[4] = {(Var *)&a->M.var, (Var *)&a->A.var, (Var *)&a->B.var, w};
    return tape_record(t, "dora_gain", dora_gain_backward, g, in, 4, c) ? g : NULL;
}

/* ---- dora_weight: W' = g V, the merged weight ------------------------------------------------ */

/* in: M (out), A, B, W as dora_gain's; out W' shaped as W.
 * dg_o = sum_j dW'_oj V_oj; dm = dg / |V|; dV = g dW' + d|V| V / |V| with d|V| = -dg m / |V|^2; then
 * dora_dv_backward. */
static void dora_weight_backward(Tape *t, const TapeNode *node) {
    const DoraGainCtx *c = node->ctx;
    const LoraAdapter *a = c->a;
    Var *M = node->in[0];
    const float *dw = node->out->grad, *m = M->value.data;
    const int fan = a->fan_in;
    float *dm = M->requires_grad ? tape_grad(t, M) : NULL;
    for (int o = 0; o < a->out; o++) {
        float *row = c->v + (size_t)o * fan;
        const float *drow = dw + (size_t)o * fan;
        double dg = 0.0;
        for (int j = 0; j < fan; j++) dg += (double)drow[j] * row[j];
        float inv = inv_norm(c->norms[o]), g = m[o] * inv;
        if (dm) dm[o] += (float)(dg * inv);
        float cv = (float)(-dg * m[o] * inv * inv * inv);
        for (int j = 0; j < fan; j++) row[j] = g * drow[j] + cv * row[j];
    }
    dora_dv_backward(t, a, c->v, node->in[1], node->in[2], node->in[3]);
}

/* W' (shaped as w) = m V / |V|_c from M, A, B and the base weight w. */
static Var *dora_weight(Tape *t, const LoraAdapter *a, Var *w) {
    if (!w) return NULL;
    Var *wp = tape_new_var(t, w->value.ndim, w->value.shape);
    DoraGainCtx *c = wp ? dora_prepare(t, a, w) : NULL;
    if (!c) return NULL;
    const float *m = a->M.var.value.data;
    for (int o = 0; o < a->out; o++) {
        const float g = dora_g(m[o], c->norms[o]);
        const size_t row = (size_t)o * a->fan_in;
        for (int j = 0; j < a->fan_in; j++) wp->value.data[row + j] = g * c->v[row + j];
    }
    Var *in[4] = {(Var *)&a->M.var, (Var *)&a->A.var, (Var *)&a->B.var, w};
    return tape_record(t, "dora_weight", dora_weight_backward, wp, in, 4, c) ? wp : NULL;
}

/* ---- dora_combine: y = z + (g - 1)(pz - bias) + g scale u ------------------------------------ */

typedef struct {
    float scale;
    int out;      /* channels: dimension 1 */
    size_t inner; /* elements per channel and example (OH * OW, or 1) */
} DoraCombineCtx;

/* in: z, pz (NULL: pz is z), u, g (out), bias (out) or NULL; all but g and bias shaped (N, out, ...).
 * dz += dy; dpz += (g - 1) dy; du += g scale dy; dg += sum dy (pz - bias + scale u); dbias -= (g - 1) sum dy. */
static void dora_combine_backward(Tape *t, const TapeNode *node) {
    const DoraCombineCtx *c = node->ctx;
    Var *z = node->in[0], *pz = node->in[1] ? node->in[1] : node->in[0], *u = node->in[2], *gv = node->in[3],
        *bias = node->in[4];
    const float *dy = node->out->grad, *g = gv->value.data, *b = bias ? bias->value.data : NULL;
    const size_t n = var_numel(node->out), inner = c->inner;
    const size_t rows = n / inner; /* (example, channel) pairs */
    float *dz = z->requires_grad ? tape_grad(t, z) : NULL;
    float *dpz = pz->requires_grad && pz != z ? tape_grad(t, pz) : NULL;
    float *du = u->requires_grad ? tape_grad(t, u) : NULL;
    float *dg = gv->requires_grad ? tape_grad(t, gv) : NULL;
    float *db = bias && bias->requires_grad ? tape_grad(t, bias) : NULL;
    if (t->err.status != QT_OK) return;
    const float *pzv = pz->value.data, *uv = u->value.data, s = c->scale;
    for (size_t r = 0; r < rows; r++) {
        const int o = (int)(r % (size_t)c->out);
        const float gm1 = g[o] - 1.0f, gs = g[o] * s, bo = b ? b[o] : 0.0f;
        const float *d = dy + r * inner;
        /* one pass per gradient, each a plain loop the compiler vectorizes */
        if (dz) {
            float *q = dz + r * inner, k = pz == z ? g[o] : 1.0f; /* pz is z: dz gets dy + (g - 1) dy */
            for (size_t i = 0; i < inner; i++) q[i] += k * d[i];
        }
        if (dpz && pz != z) {
            float *q = dpz + r * inner;
            for (size_t i = 0; i < inner; i++) q[i] += gm1 * d[i];
        }
        if (du) {
            float *q = du + r * inner;
            for (size_t i = 0; i < inner; i++) q[i] += gs * d[i];
        }
        if (dg || db) {
            const float *p = pzv + r * inner, *uu = uv + r * inner;
            float sg = 0.0f, sb = 0.0f;
            for (size_t i = 0; i < inner; i++) sg += d[i] * ((p[i] - bo) + s * uu[i]), sb += d[i];
            if (dg) dg[o] += sg;
            if (db) db[o] -= gm1 * sb;
        }
    }
}

static Var *dora_combine(Tape *t, Var *z, Var *pz, Var *u, Var *gv, Var *bias, float scale) {
    if (!z || !pz || !u || !gv) return NULL;
    const size_t n = var_numel(z);
    const int out = z->value.shape[1];
    Var *y = tape_new_var(t, z->value.ndim, z->value.shape);
    DoraCombineCtx *c = tape_alloc(t, sizeof *c);
    if (!y || !c) return NULL;
    *c = (DoraCombineCtx){scale, out, n / ((size_t)z->value.shape[0] * out)};
    const float *zv = z->value.data, *pzv = pz->value.data, *uv = u->value.data, *g = gv->value.data;
    const float *b = bias ? bias->value.data : NULL;
    for (size_t r = 0, rows = n / c->inner; r < rows; r++) {
        const int o = (int)(r % (size_t)out);
        const float gm1 = g[o] - 1.0f, gs = g[o] * scale, bo = b ? b[o] : 0.0f;
        for (size_t i = r * c->inner; i < (r + 1) * c->inner; i++)
            y->value.data[i] = zv[i] + gm1 * (pzv[i] - bo) + gs * uv[i];
    }
    Var *in[5] = {z, pz == z ? NULL : pz, u, gv, bias};
    return tape_record(t, "dora_combine", dora_combine_backward, y, in, 5, c) ? y : NULL;
}

/* ---- forward --------------------------------------------------------------------------------- */

/* The base weight as a Var (out, fan_in as the module's weight): the module's own (a float base, with its gradient
 * when it trains) or the quantized base's, dequantized into the step's arena. */
static Var *dora_base_weight(Tape *t, LoraAdapter *a) {
    Module *m = a->module;
    if (!a->base_weight) {
        if (!m->weight || m->weight->released) {
            qt_error_set(&t->err, QT_ERR_ARG, "%s: the DoRA adapter has no float base weight (it is released and no "
                         "dequantizer was given)", m->path);
            return NULL;
        }
        return &m->weight->var;
    }
    const Tensor *wt = &m->weight->var.value;
    Var *w = tape_new_var(t, wt->ndim, wt->shape);
    if (!w) return NULL;
    a->base_weight(a->base_weight_ctx, w->value.data);
    return w;
}

/* The base weight a merged conv runs on: the float weight, or a quantized base's dequantized one when it lends it
 * (Module.weight_hook: no activation quantization); NULL: the base must run as itself. */
static Var *dora_merge_base(Tape *t, LoraAdapter *a) {
    Module *m = a->module;
    if (m->spec.type != LAYER_CONV2D) return NULL;
    if (!a->base_fn) return m->weight && !m->weight->released ? &m->weight->var : NULL;
    return m->weight_hook ? m->weight_hook(t, m, a->base_ctx) : NULL;
}

Var *lora_dora_fused(Tape *t, LoraAdapter *a, Var *x, Var *bias, ConvEpilogue epi) {
    Module *m = a->module;
    if (!x || !m->conv_plain || (t->training && a->spec.dropout > 0.0f)) return NULL;
    Var *w = dora_merge_base(t, a);
    return w ? nn_conv2d_fused(t, x, dora_weight(t, a, w), bias, m->spec.stride, m->spec.padding, epi) : NULL;
}

Var *lora_dora_forward(Tape *t, LoraAdapter *a, Var *x) {
    if (!x) return NULL;
    Module *m = a->module;
    Var *bias = m->bias ? &m->bias->var : NULL;
    if (!(t->training && a->spec.dropout > 0.0f)) {
        /* a conv runs on the merged weight W' = g V: one convolution instead of the base's and the branch's */
        Var *w = dora_merge_base(t, a);
        if (w) return model_conv_forward(t, m, x, dora_weight(t, a, w), bias);
    }
    Var *z = a->base_fn ? a->base_fn(t, m, x, a->base_ctx) : model_module_forward(t, m, x);
    Var *xd = nn_dropout(t, x, a->spec.dropout);
    /* PEFT's base_nobias(xd): with dropout active the base runs again on the dropped input; otherwise it is z */
    Var *pz = xd == x ? z : a->base_fn ? a->base_fn(t, m, xd, a->base_ctx) : model_module_forward(t, m, xd);
    Var *u = lora_adapter_branch(t, a, xd);
    Var *g = dora_gain(t, a, dora_base_weight(t, a));
    return dora_combine(t, z, pz, u, g, bias, a->scale);
}

/* ---- work ------------------------------------------------------------------------------------ */

/* Whether a training step runs the adapter as one convolution on the merged weight (lora_dora_forward): a conv
 * without adapter dropout over a float base or one that lends its weight (a quantized base without activation
 * quantization; only a forward can ask it, so a conv base hook counts as lending, as qlayer_weight_hook does for
 * weight-only formats). */
static bool dora_merged(const LoraAdapter *a) {
    const Module *m = a->module;
    return m->spec.type == LAYER_CONV2D && a->spec.dropout == 0.0f && (!a->base_fn || m->weight_hook);
}

/* Per example and output position, with fan = fan_in, r = rank, rg = r / groups. A conv without adapter dropout
 * runs on the merged weight, which replaces the base's product: what it adds is W''s gradient (out fan), unless
 * the weight trains anyway. Otherwise the branch's own products as lora_adapter_forward's dense path runs them,
 * x A^T (r fan) and h B^T (out rg) forward, dh = dy B (out rg) and with an input gradient dh A (r fan), dA (r
 * fan) and dB (out rg); with adapter dropout the base's product again on the dropped input (out fan) and its
 * input gradient. */
void lora_dora_macs(const LoraAdapter *a, bool input_grad, bool weight_grad, StepMacs *macs) {
    const Module *m = a->module;
    const double r = a->spec.rank, fan = a->fan_in, out = a->out, rg = r / dora_groups(a);
    const double pos = m->spec.type == LAYER_CONV2D ? (double)m->out_shape[1] * m->out_shape[2] : 1.0;
    if (dora_merged(a)) {
        if (!weight_grad) macs->backward_dw += pos * out * fan;
        return;
    }
    macs->forward += pos * (r * fan + out * rg);
    macs->backward_dx += pos * (out * rg + (input_grad ? r * fan : 0.0));
    macs->backward_dw += pos * (r * fan + out * rg);
    if (a->spec.dropout > 0.0f) {
        macs->forward += pos * out * fan;
        if (input_grad) macs->backward_dx += pos * out * fan;
    }
}

void lora_dora_batch_macs(const LoraAdapter *a, int batch, StepMacs *macs) {
    const double fan = a->fan_in, out = a->out, rg = (double)a->spec.rank / dora_groups(a);
    const double per = batch > 0 ? 1.0 / batch : 1.0, merged = dora_merged(a) ? out * fan : 0.0;
    macs->forward += per * (out * rg * fan + out * fan + merged);
    macs->backward_dw += per * (2.0 * out * rg * fan + 2.0 * merged);
}
