/* lora.c - LoRA adapters: spec checks, parameters, the adapter forward and
 * merging the adapter into a float weight. */
#include "lora.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_dora.h"
#include "nn/ops.h"

static const char *const lora_init_names[LORA_INIT_COUNT] = {
    [LORA_INIT_DEFAULT] = "default",
    [LORA_INIT_GAUSSIAN] = "gaussian",
    [LORA_INIT_LOFTQ] = "loftq",
    [LORA_INIT_PISSA] = "pissa",
};

const char *lora_init_name(LoraInit init) {
    return (int)init >= 0 && (int)init < LORA_INIT_COUNT ? lora_init_names[init] : "unknown";
}

QtStatus lora_init_parse(const char *name, LoraInit *out, QtError *err) {
    int v = 0;
    QtStatus st = qt_name_lookup("lora init", name, lora_init_names, LORA_INIT_COUNT, &v, err);
    if (st == QT_OK) *out = (LoraInit)v;
    return st;
}

/* ---- checks ------------------------------------------------------------------- */

/* The module's weight seen as the matrix (out, fan_in): fan_in = in for
 * dense, C*KH*KW for conv, so the row-major weight is that matrix. */
static void weight_dims(const Module *m, int *out, int *fan_in) {
    const Tensor *w = &m->weight->var.value;
    int f = 1;
    for (int i = 1; i < w->ndim; i++) f *= w->shape[i];
    *out = w->shape[0];
    *fan_in = f;
}

QtStatus lora_spec_check(const LoraSpec *spec, const Module *m, QtError *err) {
    if (!spec || !m) return qt_error_set(err, QT_ERR_ARG, "lora_spec_check: spec and module must not be NULL");
    LayerType type = m->spec.type;
    if (type != LAYER_DENSE && type != LAYER_CONV2D)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: lora adapters apply to dense and conv2d layers only, not %s; make the rule's "
                            "module_path match only those layers",
                            m->path, layer_type_name(type));
    int want_ndim = type == LAYER_DENSE ? 2 : 4;
    if (!m->weight || m->weight->var.value.ndim != want_ndim)
        return qt_error_set(err, QT_ERR_ARG, "%s: the %s layer has no %d-D weight for a lora adapter to act on",
                            m->path, layer_type_name(type), want_ndim);
    if (type == LAYER_CONV2D && m->spec.groups > 1) {
        if (m->spec.groups == m->in_shape[0])
            return qt_error_set(err, QT_ERR_CONFIG, "%s: a depthwise conv2d (groups = its %d input channels) takes no "
                                "lora adapter: its per-channel kernels have no low-rank structure to adapt; adapt the "
                                "pointwise (1x1) conv2d that follows it instead", m->path, m->spec.groups);
        if (spec->rank % m->spec.groups)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: lora rank %d must be a multiple of the conv2d's groups %d "
                                "(PEFT's grouped adapter: A has rank/groups outputs per group); use rank %d",
                                m->path, spec->rank, m->spec.groups,
                                (spec->rank / m->spec.groups + 1) * m->spec.groups);
        if (lora_init_is_svd(spec->init))
            return qt_error_set(err, QT_ERR_CONFIG, "%s: lora init %s takes A and B from the SVD of the whole weight, "
                                "but this conv2d has %d groups (its adapter's B A is block-diagonal by group); give "
                                "it init default or gaussian (a rule of its own)", m->path,
                                lora_init_name(spec->init), m->spec.groups);
    }
    int out = 0, fan_in = 0;
    weight_dims(m, &out, &fan_in);
    int max_rank = out < fan_in ? out : fan_in;
    if (spec->rank < 1)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: lora rank %d must be at least 1", m->path, spec->rank);
    if (spec->rank > max_rank)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: lora rank %d is larger than the layer's smaller dimension (out %d, fan_in %d); use a "
                            "rank of at most %d",
                            m->path, spec->rank, out, fan_in, max_rank);
    if (!(spec->alpha > 0.0f) || isinf(spec->alpha))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: lora alpha must be a finite number > 0, got %g", m->path,
                            (double)spec->alpha);
    if (!(spec->dropout >= 0.0f && spec->dropout < 1.0f))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: lora dropout must be in [0, 1), got %g", m->path,
                            (double)spec->dropout);
    if ((int)spec->init < 0 || (int)spec->init >= LORA_INIT_COUNT)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: unknown lora init %d (valid: default, gaussian, loftq, pissa)", m->path,
                            (int)spec->init);
    return QT_OK;
}

/* ---- parameters ------------------------------------------------------------------ */

/* Zeroed value and grad, trainable: the same state model_init leaves its
 * parameters in, so optimizers and checkpoints treat A and B like any other. */
static QtStatus lora_param_alloc(Param *p, const char *path, const char *tensor, int ndim, const int *shape,
                                 QtError *err) {
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s/%s", path, tensor);
    tensor_set_shape(&p->var.value, ndim, shape);
    size_t n = tensor_numel(&p->var.value);
    p->var.value.data = calloc(n, sizeof(float));
    p->var.grad = calloc(n, sizeof(float));
    if (!p->var.value.data || !p->var.grad)
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate lora parameter %s (%zu floats)", p->name, n);
    p->var.requires_grad = true;
    p->var.is_param = true;
    p->trainable = true;
    return QT_OK;
}

static void lora_param_free(Param *p) {
    free(p->var.value.data);
    free(p->var.grad);
    memset(p, 0, sizeof *p);
}

float lora_spec_scale(const LoraSpec *spec) {
    return spec->rslora ? (float)(spec->alpha / sqrt((double)spec->rank)) : (float)((double)spec->alpha / spec->rank);
}

QtStatus lora_adapter_init(LoraAdapter *a, Module *m, const LoraSpec *spec, QtError *err) {
    memset(a, 0, sizeof *a);
    QtStatus st = lora_spec_check(spec, m, err);
    if (st != QT_OK) return st;
    const Tensor *w = &m->weight->var.value;
    int r = spec->rank;
    a->module = m;
    a->spec = *spec;
    a->scale = lora_spec_scale(spec);
    weight_dims(m, &a->out, &a->fan_in);
    if (m->spec.type == LAYER_DENSE) {
        st = lora_param_alloc(&a->A, m->path, "lora_A", 2, (const int[]){r, a->fan_in}, err);
        if (st == QT_OK) st = lora_param_alloc(&a->B, m->path, "lora_B", 2, (const int[]){a->out, r}, err);
    } else {
        st = lora_param_alloc(&a->A, m->path, "lora_A", 4, (const int[]){r, w->shape[1], w->shape[2], w->shape[3]},
                              err);
        /* PEFT's shapes: A (rank, C/groups, KH, KW) at the base's geometry and groups, B (OC, rank/groups, 1, 1)
           a grouped 1x1 convolution */
        int g = m->spec.groups;
        if (st == QT_OK) st = lora_param_alloc(&a->B, m->path, "lora_B", 4, (const int[]){a->out, r / g, 1, 1}, err);
    }
    if (st == QT_OK && spec->dora) st = lora_param_alloc(&a->M, m->path, "lora_magnitude", 1, &a->out, err);
    if (st != QT_OK) lora_adapter_free(a);
    return st;
}

/* Leaves the module alone: it may already be gone (model_free first), and a
 * module still pointing at this adapter must have its hook reset by the
 * owner of both. */
void lora_adapter_free(LoraAdapter *a) {
    if (!a) return;
    lora_param_free(&a->A);
    lora_param_free(&a->B);
    lora_param_free(&a->M);
    memset(a, 0, sizeof *a);
}

void lora_adapter_init_params(LoraAdapter *a, Rng *rng) {
    Var *A = &a->A.var, *B = &a->B.var;
    size_t na = var_numel(A);
    if (a->spec.init == LORA_INIT_GAUSSIAN) {
        rng_fill_normal(rng, A->value.data, na, 0.0f, (float)(1.0 / a->spec.rank));
    } else {
        /* kaiming_uniform_(a=sqrt(5)) over fan_in: bound = 1/sqrt(fan_in). */
        float bound = (float)(1.0 / sqrt((double)a->fan_in));
        rng_fill_uniform(rng, A->value.data, na, -bound, bound);
    }
    memset(B->value.data, 0, var_numel(B) * sizeof(float));
}

size_t lora_adapter_param_count(const LoraAdapter *a) {
    return var_numel(&a->A.var) + var_numel(&a->B.var) + (a->spec.dora ? var_numel(&a->M.var) : 0);
}

void lora_adapter_macs(const LoraAdapter *a, bool input_grad, bool weight_grad, StepMacs *macs) {
    const Module *m = a->module;
    const double r = a->spec.rank, fan = a->fan_in, out = a->out;
    if (a->spec.dora) {
        lora_dora_macs(a, input_grad, weight_grad, macs);
        return;
    }
    if (m->spec.type == LAYER_DENSE) {
        macs->forward += r * fan + out * r;
        macs->backward_dx += out * r + (input_grad ? r * fan : 0.0);
        macs->backward_dw += r * fan + out * r;
        return;
    }
    const double pos = (double)m->out_shape[1] * m->out_shape[2], rb = r / m->spec.groups; /* B's inputs per output */
    if (out * fan <= 2.0 * (r * fan + out * rb)) { /* through the full weight gradient */
        if (!weight_grad) macs->backward_dw += pos * out * fan;
        return;
    }
    macs->forward += pos * r * fan;
    macs->backward_dx += pos * out * rb;
    macs->backward_dw += pos * (r * fan + out * rb);
}

/* ---- forward ---------------------------------------------------------------------- */

static Var *lora_forward_hook(Tape *t, Module *m, Var *x, void *ctx) {
    (void)m;
    return lora_adapter_forward(t, ctx, x);
}

/* A conv adapter with its layer's relu (and pooling) folded in. Without
 * adapter dropout, over a float base or one that lends its weight
 * (Module.weight_hook: a quantized base, dequantized), the adapter shares
 * each chunk's im2col with the base (nn_conv2d_fused_lowrank); otherwise it
 * declines (NULL, no error) and the layers run one by one. */
static Var *lora_fused_hook(Tape *t, Module *m, Var *x, void *ctx, Var *bias, ConvEpilogue epi) {
    LoraAdapter *a = ctx;
    if (a->spec.dora) return lora_dora_fused(t, a, x, bias, epi);
    if (a->spec.dropout != 0.0f || !m->conv_plain) return NULL;
    Var *w = NULL;
    if (!a->base_fn) w = m->weight && !m->weight->released ? &m->weight->var : NULL;
    else if (m->weight_hook) w = m->weight_hook(t, m, a->base_ctx);
    if (!w) return NULL;
    ConvLowRank lr = {&a->A.var, &a->B.var, a->scale};
    return nn_conv2d_fused_lowrank(t, x, w, bias, &lr, m->spec.stride, m->spec.padding, epi);
}

void lora_adapter_install(LoraAdapter *a) {
    /* A second install would save the adapter's own hook as its base and
     * recurse forever. */
    if (a->installed) return;
    Module *m = a->module;
    a->base_fn = m->forward_hook;
    a->base_ctx = m->hook_ctx;
    m->forward_hook = lora_forward_hook;
    m->fused_hook = m->spec.type == LAYER_CONV2D ? lora_fused_hook : NULL;
    m->fused_residual = false;
    m->hook_ctx = a;
    a->installed = true;
}

Var *lora_adapter_forward(Tape *t, LoraAdapter *a, Var *x) {
    if (!x) return NULL;
    if (a->spec.dora) return lora_dora_forward(t, a, x);
    Module *m = a->module;
    Var *base = a->base_fn ? a->base_fn(t, m, x, a->base_ctx) : model_module_forward(t, m, x);
    if (!base) return NULL;
    Var *xd = nn_dropout(t, x, a->spec.dropout);
    return nn_add(t, base, nn_scale(t, lora_adapter_branch(t, a, xd), a->scale));
}

Var *lora_adapter_branch(Tape *t, LoraAdapter *a, Var *xd) {
    if (!xd) return NULL;
    Module *m = a->module;
    Var *u;
    if (m->spec.type == LAYER_CONV2D) {
        /* h: (N, rank, OH, OW) (A at the base's geometry and groups); u: (N, OC, OH, OW), B per group. */
        Var *h = model_conv_forward(t, m, xd, &a->A.var, NULL);
        if (m->spec.groups == 1) {
            u = nn_conv2d(t, h, &a->B.var, NULL, 1, 0);
        } else {
            ConvGeom2d g = conv_geom2d(1, 0);
            g.groups = m->spec.groups;
            u = nn_conv2d_general(t, h, &a->B.var, NULL, &g);
        }
    } else {
        /* h: (N, rank); u: (N, out). */
        Var *h = nn_linear(t, xd, &a->A.var, NULL);
        u = nn_linear(t, h, &a->B.var, NULL);
    }
    return u;
}

/* ---- merging ------------------------------------------------------------------------ */

/* scale * (B A)[o, j], the rank-long sum and the scaling in double and one
 * rounding to float at the end: B is (out, rank) in
 * either layout ((OC, rank, 1, 1) is the same row-major array), A is
 * (rank, fan_in). A grouped conv (groups g): B is (OC, rank/g), and output
 * o of group o / (OC/g) sums over A's rows of that group. */
static double delta_at(const LoraAdapter *a, int o, int j) {
    const float *A = a->A.var.value.data, *B = a->B.var.value.data;
    int g = a->module->spec.type == LAYER_CONV2D ? a->module->spec.groups : 1;
    int r = a->spec.rank / g, k0 = o / (a->out / g) * r;
    double acc = 0.0;
    for (int k = 0; k < r; k++) acc += (double)B[(size_t)o * r + k] * A[(size_t)(k0 + k) * a->fan_in + j];
    return (double)a->scale * acc;
}

/* Element by element, so no (out, fan_in) scratch is needed; A is read in
 * rank streams along its rows, which stays cache-friendly for small ranks. */
void lora_adapter_delta(const LoraAdapter *a, float *delta) {
    for (int o = 0; o < a->out; o++)
        for (int j = 0; j < a->fan_in; j++) delta[(size_t)o * a->fan_in + j] = (float)delta_at(a, o, j);
}

/* Adds the float delta exactly as lora_adapter_delta rounds it, so
 * merge(w) == w + delta element by element. */
void lora_adapter_merge(const LoraAdapter *a, float *w) {
    if (a->spec.dora) {
        lora_dora_merge(a, w);
        return;
    }
    for (int o = 0; o < a->out; o++)
        for (int j = 0; j < a->fan_in; j++) w[(size_t)o * a->fan_in + j] += (float)delta_at(a, o, j);
}
