/* model.c - shape inference, parameter allocation and init, forward. */
#include "model.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

static const char *const layer_names[LAYER_COUNT] = {
    [LAYER_DENSE] = "dense",         [LAYER_CONV2D] = "conv2d",       [LAYER_RELU] = "relu",
    [LAYER_GELU] = "gelu",           [LAYER_TANH] = "tanh",           [LAYER_SIGMOID] = "sigmoid",
    [LAYER_MAXPOOL2D] = "maxpool2d", [LAYER_AVGPOOL2D] = "avgpool2d", [LAYER_FLATTEN] = "flatten",
    [LAYER_DROPOUT] = "dropout",     [LAYER_LAYERNORM] = "layernorm", [LAYER_BATCHNORM1D] = "batchnorm1d",
    [LAYER_BATCHNORM2D] = "batchnorm2d", [LAYER_GLOBALAVGPOOL] = "globalavgpool", [LAYER_ADD] = "add",
    [LAYER_CONCAT] = "concat",
};

static const char *const init_names[INIT_COUNT] = {
    [INIT_DEFAULT] = "default",
    [INIT_XAVIER_UNIFORM] = "xavier_uniform",
    [INIT_XAVIER_NORMAL] = "xavier_normal",
    [INIT_NORMAL] = "normal",
};

const char *layer_type_name(LayerType type) { return type < LAYER_COUNT ? layer_names[type] : "?"; }
const char *init_kind_name(InitKind kind) { return kind < INIT_COUNT ? init_names[kind] : "?"; }

QtStatus layer_type_parse(const char *name, LayerType *out, QtError *err) {
    int v = 0;
    QtStatus st = qt_name_lookup("layer type", name, layer_names, LAYER_COUNT, &v, err);
    if (st == QT_OK) *out = (LayerType)v;
    return st;
}

QtStatus init_kind_parse(const char *name, InitKind *out, QtError *err) {
    int v = 0;
    QtStatus st = qt_name_lookup("init", name, init_names, INIT_COUNT, &v, err);
    if (st == QT_OK) *out = (InitKind)v;
    return st;
}

static char *shape_str(char *buf, size_t size, int ndim, const int *shape) {
    Tensor t = {0};
    tensor_set_shape(&t, ndim, shape);
    return tensor_shape_str(&t, buf, size);
}

/* ---- shape inference ----------------------------------------------------- */

/* What a model may hold: per example, at most 2^28 values in and out of
 * every layer (shapes and their products stay far inside int), and 2^28
 * parameters in all (1 GiB of float32, as much again for the gradients).
 * Checked before anything is allocated, so a config with a typo (padding
 * 1231) is refused with its cause instead of reserving tens of GB. */
#define MODEL_VALUES_MAX ((int64_t)1 << 28)

static int64_t shape_values(int ndim, const int *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

/* The values of m's parameters (weight and bias), from its spec and input shape. */
static int64_t module_param_values(const Module *m) {
    const LayerSpec *s = &m->spec;
    int64_t out = m->out_shape[0], bias = s->no_bias ? 0 : out;
    switch (s->type) {
    case LAYER_DENSE: return out * m->in_shape[0] + bias;
    case LAYER_CONV2D: return out * (m->in_shape[0] / s->groups) * s->kernel * s->kernel_w + bias;
    case LAYER_LAYERNORM: return 2 * (int64_t)m->in_shape[m->in_ndim - 1];
    case LAYER_BATCHNORM1D:
    case LAYER_BATCHNORM2D: return s->no_affine ? 0 : 2 * (int64_t)m->in_shape[0];
    default: return 0;
    }
}

/* conv2d's part of module_infer: its geometry, output shape and the checks
 * (groups dividing the channels, 'same' at stride 1, a kernel that fits). */
static QtStatus conv_infer(Module *m, int *n_params, QtError *err) {
    const LayerSpec *s = &m->spec;
    char in[64];
    shape_str(in, sizeof in, m->in_ndim, m->in_shape);
    if (m->in_ndim != 3)
        return qt_error_set(err, QT_ERR_SHAPE, "layer '%s' (conv2d) needs (C, H, W) input per example, got %s",
                            m->path, in);
    if (s->kernel < 1 || s->kernel_w < 1)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (conv2d): kernel must be >= 1", m->path);
    if (s->stride < 1 || s->stride_w < 1)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (conv2d): stride must be >= 1", m->path);
    if (s->padding < 0 || s->padding_w < 0)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (conv2d): padding must be >= 0", m->path);
    if (s->dilation < 1 || s->dilation_w < 1)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (conv2d): dilation must be >= 1", m->path);
    if (s->out_channels < 1)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (conv2d): out_channels must be >= 1", m->path);
    int c = m->in_shape[0];
    if (s->groups < 1 || c % s->groups || s->out_channels % s->groups)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (conv2d): groups %d must divide its %d input channels "
                            "(input %s) and its %d out_channels", m->path, s->groups, c, in, s->out_channels);
    ConvGeom2d *g = &m->geom;
    *g = (ConvGeom2d){.stride_h = s->stride, .stride_w = s->stride_w, .pad_h = s->padding, .pad_w = s->padding_w,
                      .dil_h = s->dilation, .dil_w = s->dilation_w, .groups = s->groups};
    if (s->padding_same) {
        QtError e = {0};
        if (conv_geom2d_same(g, s->kernel, s->kernel_w, &e) != QT_OK)
            return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (conv2d): padding 'same' needs stride 1, got stride "
                                "[%d, %d] (as in PyTorch); give the padding as numbers instead", m->path, s->stride,
                                s->stride_w);
    }
    int oh = conv_general_out_size(m->in_shape[1], s->kernel, g->stride_h, g->pad_h, g->pad_h + g->pad_h_extra,
                                   g->dil_h);
    int ow = conv_general_out_size(m->in_shape[2], s->kernel_w, g->stride_w, g->pad_w, g->pad_w + g->pad_w_extra,
                                   g->dil_w);
    bool square = s->kernel == s->kernel_w && s->dilation == 1 && s->dilation_w == 1 && !s->padding_same &&
                  s->padding == s->padding_w;
    if ((oh < 1 || ow < 1) && square)
        return qt_error_set(err, QT_ERR_SHAPE, "layer '%s' (conv2d): kernel %d is larger than its input %s%s", m->path,
                            s->kernel, in, s->padding ? " with padding" : "");
    if (oh < 1 || ow < 1)
        return qt_error_set(err, QT_ERR_SHAPE, "layer '%s' (conv2d): kernel %dx%d at dilation [%d, %d] spans %lldx%lld, "
                            "larger than its input %s padded to %lldx%lld", m->path, s->kernel, s->kernel_w,
                            s->dilation, s->dilation_w, (long long)s->dilation * (s->kernel - 1) + 1,
                            (long long)s->dilation_w * (s->kernel_w - 1) + 1, in,
                            (long long)m->in_shape[1] + 2LL * g->pad_h + g->pad_h_extra,
                            (long long)m->in_shape[2] + 2LL * g->pad_w + g->pad_w_extra);
    m->conv_plain = s->groups == 1 && s->dilation == 1 && s->dilation_w == 1 && s->kernel == s->kernel_w &&
                    s->stride == s->stride_w && !s->padding_same && s->padding == s->padding_w;
    m->out_shape[0] = s->out_channels;
    m->out_shape[1] = oh;
    m->out_shape[2] = ow;
    *n_params = s->no_bias ? 1 : 2;
    return QT_OK;
}

/* Fills m->out_shape from m->in_shape; the number of params it needs in *n_params. */
static QtStatus module_infer(Module *m, int *n_params, QtError *err) {
    const LayerSpec *s = &m->spec;
    char in[64];
    shape_str(in, sizeof in, m->in_ndim, m->in_shape);
    m->out_ndim = m->in_ndim;
    memcpy(m->out_shape, m->in_shape, sizeof m->out_shape);
    *n_params = 0;
    switch (s->type) {
    case LAYER_DENSE:
        if (m->in_ndim != 1)
            return qt_error_set(err, QT_ERR_SHAPE,
                                "layer '%s' (dense) gets input %s per example but needs a vector; add a flatten layer "
                                "before it",
                                m->path, in);
        if (s->units < 1) return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (dense): units must be >= 1", m->path);
        m->out_shape[0] = s->units;
        *n_params = s->no_bias ? 1 : 2;
        return QT_OK;
    case LAYER_CONV2D: return conv_infer(m, n_params, err);
    case LAYER_MAXPOOL2D:
    case LAYER_AVGPOOL2D: {
        const char *tn = layer_type_name(s->type);
        if (m->in_ndim != 3)
            return qt_error_set(err, QT_ERR_SHAPE, "layer '%s' (%s) needs (C, H, W) input per example, got %s",
                                m->path, tn, in);
        if (s->kernel < 1) return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s): kernel must be >= 1", m->path, tn);
        if (s->stride < 1) return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s): stride must be >= 1", m->path, tn);
        int pad = 0;
        int oh = (m->in_shape[1] + 2 * pad - s->kernel) / s->stride + 1;
        int ow = (m->in_shape[2] + 2 * pad - s->kernel) / s->stride + 1;
        if (m->in_shape[1] + 2 * pad < s->kernel || m->in_shape[2] + 2 * pad < s->kernel)
            return qt_error_set(err, QT_ERR_SHAPE, "layer '%s' (%s): kernel %d is larger than its input %s%s", m->path,
                                tn, s->kernel, in, pad ? " with padding" : "");
        m->out_shape[0] = m->in_shape[0];
        m->out_shape[1] = oh;
        m->out_shape[2] = ow;
        return QT_OK;
    }
    case LAYER_FLATTEN:
        m->out_ndim = 1;
        m->out_shape[0] = m->in_shape[0] * (m->in_ndim > 1 ? m->in_shape[1] : 1) * (m->in_ndim > 2 ? m->in_shape[2] : 1);
        return QT_OK;
    case LAYER_DROPOUT:
        if (!(s->p >= 0.0f && s->p < 1.0f))
            return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (dropout): p must be in [0, 1), got %g", m->path,
                                (double)s->p);
        return QT_OK;
    case LAYER_LAYERNORM:
        *n_params = 2;
        return QT_OK;
    case LAYER_BATCHNORM1D:
    case LAYER_BATCHNORM2D: {
        /* Per example (C,) for batchnorm1d (the batch is (N, C)), (C, H, W) for batchnorm2d. */
        int want = s->type == LAYER_BATCHNORM1D ? 1 : 3;
        if (m->in_ndim != want)
            return qt_error_set(err, QT_ERR_SHAPE, "layer '%s' (%s) needs %s input per example, got %s%s", m->path,
                                layer_type_name(s->type), want == 1 ? "(C,)" : "(C, H, W)", in,
                                want == 1 ? "; use batchnorm2d on (C, H, W) or flatten first" : "; use batchnorm1d");
        if (!(s->eps > 0.0f))
            return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s): eps must be > 0", m->path,
                                layer_type_name(s->type));
        if (!(s->momentum >= 0.0f && s->momentum <= 1.0f))
            return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s): momentum must be in [0, 1], got %g", m->path,
                                layer_type_name(s->type), (double)s->momentum);
        *n_params = s->no_affine ? 0 : 2;
        return QT_OK;
    }
    case LAYER_GLOBALAVGPOOL:
        if (m->in_ndim != 3)
            return qt_error_set(err, QT_ERR_SHAPE, "layer '%s' (globalavgpool) needs (C, H, W) input per example, "
                                "got %s", m->path, in);
        m->out_ndim = 1;
        return QT_OK;
    case LAYER_RELU:
    case LAYER_GELU:
    case LAYER_TANH:
    case LAYER_SIGMOID:
    case LAYER_ADD:    /* model_graph_resolve gave the merged shape as its input */
    case LAYER_CONCAT:
        return QT_OK;
    case LAYER_COUNT:
        break;
    }
    return qt_error_set(err, QT_ERR_CONFIG, "layer '%s': unknown layer type %d", m->path, (int)s->type);
}

/* ---- parameters ---------------------------------------------------------- */

static QtStatus param_alloc(Param *p, const char *module, const char *tensor, int ndim, const int *shape,
                            QtError *err) {
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s/%s", module, tensor);
    tensor_set_shape(&p->var.value, ndim, shape);
    size_t n = tensor_numel(&p->var.value);
    p->var.value.data = calloc(n, sizeof(float));
    p->var.grad = calloc(n, sizeof(float));
    if (!p->var.value.data || !p->var.grad)
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate parameter %s (%zu floats)", p->name, n);
    p->var.requires_grad = true;
    p->var.is_param = true;
    p->trainable = true;
    return QT_OK;
}

void param_freeze(Param *p) {
    free(p->var.grad);
    p->var.grad = NULL;
    p->var.requires_grad = false;
    p->trainable = false;
}

void param_release(Param *p) {
    param_freeze(p);
    free(p->var.value.data);
    p->var.value.data = NULL;
    p->released = true;
}

QtStatus param_unfreeze(Param *p, QtError *err) {
    if (p->trainable) return QT_OK;
    if (p->released)
        return qt_error_set(err, QT_ERR_ARG, "%s is held quantized (released) and cannot be trained", p->name);
    p->var.grad = calloc(var_numel(&p->var), sizeof(float));
    if (!p->var.grad) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the gradient of %s", p->name);
    p->var.requires_grad = true;
    p->trainable = true;
    return QT_OK;
}

static QtStatus module_alloc_params(Module *m, Param *slots, QtError *err) {
    const LayerSpec *s = &m->spec;
    QtStatus st = QT_OK;
    int out = m->out_shape[0];
    /* The module points at its slots before they are filled, so model_free
     * releases a half-allocated parameter too. */
    m->weight = &slots[0];
    if (s->type == LAYER_DENSE) {
        st = param_alloc(&slots[0], m->path, "weight", 2, (int[]){out, m->in_shape[0]}, err);
    } else if (s->type == LAYER_CONV2D) {
        st = param_alloc(&slots[0], m->path, "weight", 4, (int[]){out, m->in_shape[0] / s->groups, s->kernel, s->kernel_w},
                         err);
    } else if (s->type == LAYER_LAYERNORM) {
        out = m->in_shape[m->in_ndim - 1];
        st = param_alloc(&slots[0], m->path, "weight", 1, (int[]){out}, err);
    } else if ((s->type == LAYER_BATCHNORM1D || s->type == LAYER_BATCHNORM2D) && !s->no_affine) {
        out = m->in_shape[0];
        st = param_alloc(&slots[0], m->path, "weight", 1, (int[]){out}, err);
    } else {
        m->weight = NULL;
        return QT_OK;
    }
    if (st != QT_OK || (s->no_bias && (s->type == LAYER_DENSE || s->type == LAYER_CONV2D))) return st;
    m->bias = &slots[1];
    return param_alloc(&slots[1], m->path, "bias", 1, (int[]){out}, err);
}

static bool layer_is_batchnorm(LayerType t) { return t == LAYER_BATCHNORM1D || t == LAYER_BATCHNORM2D; }

/* A batchnorm module's running statistics, as PyTorch starts them: mean 0, variance 1, no batches. */
static QtStatus module_alloc_buffers(Module *m, QtError *err) {
    if (!layer_is_batchnorm(m->spec.type)) return QT_OK;
    size_t c = (size_t)m->in_shape[0];
    m->running_mean = calloc(c, sizeof(float));
    m->running_var = malloc(c * sizeof(float));
    if (!m->running_mean || !m->running_var)
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the running statistics of '%s' (%zu channels)",
                            m->path, c);
    for (size_t i = 0; i < c; i++) m->running_var[i] = 1.0f;
    m->num_batches_tracked = 0;
    m->bn = (BatchNormState){.running_mean = m->running_mean, .running_var = m->running_var,
                             .num_batches_tracked = &m->num_batches_tracked, .momentum = m->spec.momentum,
                             .eps = m->spec.eps};
    return QT_OK;
}

bool model_has_batchnorm(const Model *m) {
    for (int i = 0; i < m->n_modules; i++)
        if (layer_is_batchnorm(m->modules[i].spec.type)) return true;
    return false;
}

/* The limits above, for module m just inferred; its parameters are added to *param_values. */
static QtStatus check_values(const Module *m, int64_t *param_values, QtError *err) {
    char shape[64];
    if (shape_values(m->out_ndim, m->out_shape) > MODEL_VALUES_MAX)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s) gives %s per example, more than 2^28 values; use "
                            "fewer channels, less padding or a smaller input", m->path, layer_type_name(m->spec.type),
                            shape_str(shape, sizeof shape, m->out_ndim, m->out_shape));
    *param_values += module_param_values(m);
    if (*param_values > MODEL_VALUES_MAX)
        return qt_error_set(err, QT_ERR_CONFIG, "with layer '%s' (%s) the model has %lld parameters, more than the "
                            "2^28 qtrain holds; use fewer units or channels, or a smaller input before it", m->path,
                            layer_type_name(m->spec.type), (long long)*param_values);
    return QT_OK;
}

QtStatus model_init(Model *m, int input_ndim, const int *input_shape, const LayerSpec *layers, int n_layers,
                    QtError *err) {
    memset(m, 0, sizeof *m);
    if (input_ndim < 1 || input_ndim > 3)
        return qt_error_set(err, QT_ERR_CONFIG, "model input must be [features] or [C, H, W], got %d dims", input_ndim);
    for (int i = 0; i < input_ndim; i++)
        if (input_shape[i] < 1)
            return qt_error_set(err, QT_ERR_CONFIG, "model input dimension %d is %d; every dimension must be >= 1", i,
                                input_shape[i]);
    char in[64];
    if (shape_values(input_ndim, input_shape) > MODEL_VALUES_MAX)
        return qt_error_set(err, QT_ERR_CONFIG, "the model input %s has more than 2^28 values per example",
                            shape_str(in, sizeof in, input_ndim, input_shape));
    if (n_layers < 1) return qt_error_set(err, QT_ERR_CONFIG, "the model has no layers");
    m->input_ndim = input_ndim;
    memcpy(m->input_shape, input_shape, (size_t)input_ndim * sizeof(int));
    m->modules = calloc((size_t)n_layers, sizeof *m->modules);
    m->params = calloc((size_t)n_layers * 2, sizeof *m->params);
    m->param_list = calloc((size_t)n_layers * 2, sizeof *m->param_list);
    m->outs = calloc((size_t)n_layers + 1, sizeof *m->outs);
    if (!m->modules || !m->params || !m->param_list || !m->outs) {
        model_free(m);
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate a model of %d layers", n_layers);
    }
    int64_t param_values = 0;
    for (int i = 0; i < n_layers; i++) {
        Module *mod = &m->modules[m->n_modules++];
        mod->spec = layers[i];
        LayerSpec *s = &mod->spec;
        if (s->type == LAYER_CONV2D) {
            if (s->stride == 0) s->stride = 1;
            if (s->kernel_w == 0) s->kernel_w = s->kernel, s->stride_w = s->stride, s->padding_w = s->padding;
            if (s->dilation == 0) s->dilation = 1;
            if (s->dilation_w == 0) s->dilation_w = s->dilation;
            if (s->groups == 0) s->groups = 1;
        }
        if ((s->type == LAYER_MAXPOOL2D || s->type == LAYER_AVGPOOL2D) && s->stride == 0) s->stride = s->kernel;
        if ((s->type == LAYER_LAYERNORM || layer_is_batchnorm(s->type)) && s->eps == 0.0f) s->eps = 1e-5f;
        if (s->init == INIT_NORMAL && s->init_std == 0.0f) s->init_std = 0.02f;
        if (s->name[0])
            snprintf(mod->path, sizeof mod->path, "%s", s->name);
        else
            snprintf(mod->path, sizeof mod->path, "%s%d", layer_type_name(s->type), i);
        if (model_find_module(m, mod->path) != mod) {
            QtStatus st = qt_error_set(err, QT_ERR_CONFIG, "two layers are named '%s'; module names must be unique",
                                       mod->path);
            model_free(m);
            return st;
        }
        int n_params = 0;
        QtStatus st = model_graph_resolve(m, i, layers, n_layers, err);
        if (st == QT_OK) st = module_infer(mod, &n_params, err);
        if (st == QT_OK) st = check_values(mod, &param_values, err);
        if (st == QT_OK && n_params) st = module_alloc_params(mod, &m->params[m->n_params], err);
        if (st == QT_OK) st = module_alloc_buffers(mod, err);
        if (st != QT_OK) {
            model_free(m);
            return st;
        }
        if (mod->weight) m->param_list[m->n_params] = &m->params[m->n_params], m->n_params++;
        if (mod->bias) m->param_list[m->n_params] = &m->params[m->n_params], m->n_params++;
    }
    model_graph_count_consumers(m);
    return QT_OK;
}

void model_free(Model *m) {
    for (int i = 0; m->modules && i < m->n_modules; i++) {
        Param *ps[2] = {m->modules[i].weight, m->modules[i].bias};
        for (int k = 0; k < 2; k++) {
            if (!ps[k]) continue;
            free(ps[k]->var.value.data);
            free(ps[k]->var.grad);
        }
        free(m->modules[i].running_mean);
        free(m->modules[i].running_var);
    }
    free(m->params);
    free(m->param_list);
    free(m->outs);
    free(m->modules);
    memset(m, 0, sizeof *m);
}

/* ---- initialisation ------------------------------------------------------ */

static void module_init_params(Module *m, Rng *rng) {
    const LayerSpec *s = &m->spec;
    if (!m->weight) return;
    Var *w = &m->weight->var;
    size_t nw = var_numel(w);
    if (s->type == LAYER_LAYERNORM || layer_is_batchnorm(s->type)) {
        for (size_t i = 0; i < nw; i++) w->value.data[i] = 1.0f;
        if (m->bias) memset(m->bias->var.value.data, 0, var_numel(&m->bias->var) * sizeof(float));
        return;
    }
    /* Dense (out, in): fan_in = in. Conv (OC, C/groups, KH, KW): fan_in =
     * C/groups*KH*KW, fan_out = OC*KH*KW, as torch.nn.init computes them. */
    size_t receptive = w->value.ndim == 4 ? (size_t)w->value.shape[2] * w->value.shape[3] : 1;
    double fan_in = (double)w->value.shape[1] * receptive;
    double fan_out = (double)w->value.shape[0] * receptive;
    float bias_bound = 0.0f;
    switch (s->init) {
    case INIT_DEFAULT: {
        /* kaiming_uniform_(a=sqrt(5)): gain = sqrt(2/(1+5)), bound = gain*sqrt(3/fan_in) = 1/sqrt(fan_in). */
        float bound = (float)(1.0 / sqrt(fan_in));
        rng_fill_uniform(rng, w->value.data, nw, -bound, bound);
        bias_bound = bound;
        break;
    }
    case INIT_XAVIER_UNIFORM: {
        float bound = (float)sqrt(6.0 / (fan_in + fan_out));
        rng_fill_uniform(rng, w->value.data, nw, -bound, bound);
        break;
    }
    case INIT_XAVIER_NORMAL:
        rng_fill_normal(rng, w->value.data, nw, 0.0f, (float)sqrt(2.0 / (fan_in + fan_out)));
        break;
    case INIT_NORMAL:
    case INIT_COUNT:
        rng_fill_normal(rng, w->value.data, nw, 0.0f, s->init_std);
        break;
    }
    if (!m->bias) return;
    Var *b = &m->bias->var;
    if (bias_bound > 0.0f)
        rng_fill_uniform(rng, b->value.data, var_numel(b), -bias_bound, bias_bound);
    else
        memset(b->value.data, 0, var_numel(b) * sizeof(float));
}

void model_init_params(Model *m, Rng *rng) {
    for (int i = 0; i < m->n_modules; i++) module_init_params(&m->modules[i], rng);
}

/* ---- forward --------------------------------------------------------------- */

Var *model_module_forward(Tape *t, Module *m, Var *x) {
    if (!x) return NULL;
    if (m->weight && m->weight->released) {
        qt_error_set(&t->err, QT_ERR_ARG, "module '%s': its weight was released (held quantized) and no forward "
                     "hook replaces the layer", m->path);
        return NULL;
    }
    const LayerSpec *s = &m->spec;
    Var *w = m->weight ? &m->weight->var : NULL, *b = m->bias ? &m->bias->var : NULL;
    switch (s->type) {
    case LAYER_DENSE: return nn_linear(t, x, w, b);
    case LAYER_CONV2D: return model_conv_forward(t, m, x, w, b);
    case LAYER_RELU: return nn_relu(t, x);
    case LAYER_GELU: return nn_gelu(t, x);
    case LAYER_TANH: return nn_tanh(t, x);
    case LAYER_SIGMOID: return nn_sigmoid(t, x);
    case LAYER_MAXPOOL2D: return nn_maxpool2d(t, x, s->kernel, s->stride);
    case LAYER_AVGPOOL2D: return nn_avgpool2d(t, x, s->kernel, s->stride);
    case LAYER_FLATTEN: return nn_flatten(t, x);
    case LAYER_DROPOUT: return nn_dropout(t, x, s->p);
    case LAYER_LAYERNORM: return nn_layernorm(t, x, w, b, s->eps);
    case LAYER_BATCHNORM1D:
    case LAYER_BATCHNORM2D:
        if (m->bn_folded == BN_FOLD_BIAS) return nn_bias_add(t, x, b);
        if (m->bn_folded == BN_FOLD_INTO) return x;
        return nn_batchnorm(t, x, w, b, &m->bn); /* batch or running statistics: t->training */
    case LAYER_GLOBALAVGPOOL: return nn_globalavgpool(t, x);
    case LAYER_ADD:
    case LAYER_CONCAT:
        qt_error_set(&t->err, QT_ERR_ARG, "module '%s' (%s) merges several inputs: run it with model_step", m->path,
                     layer_type_name(s->type));
        return NULL;
    case LAYER_COUNT: break;
    }
    qt_error_set(&t->err, QT_ERR_ARG, "module '%s': unknown layer type", m->path);
    return NULL;
}

Var *model_conv_forward(Tape *t, const Module *m, Var *x, Var *w, Var *bias) {
    if (m->conv_plain) return nn_conv2d(t, x, w, bias, m->spec.stride, m->spec.padding);
    return nn_conv2d_general(t, x, w, bias, &m->geom);
}

/* A run of modules model_forward computes as one convolution. */
typedef struct {
    int n;            /* modules it covers from the conv2d on; 1: no fusing */
    ConvEpilogue epi;
    Var *bias;        /* (OC,): the conv's bias or the shift of the batch norm folded after it, or NULL */
    int residual;     /* an add's other input, summed in before the epilogue (Tape.residual): a module index
                         (-1: the model's input), or RESIDUAL_NONE */
} ConvFusion;

#define RESIDUAL_NONE (-2)

/* Whether module j, a batch norm folded after the conv2d i before it that
 * has no bias (BN_FOLD_BIAS: y = x + its bias), joins the conv as its bias.
 * Not with Model.keep_outputs: a caller reads the conv's output. */
static bool model_fusable_bn(const Model *m, int i, int j) {
    const Module *c = &m->modules[i], *b = &m->modules[j];
    return !m->keep_outputs && !c->bias && b->spec.type == LAYER_BATCHNORM2D && b->bn_folded == BN_FOLD_BIAS &&
           !b->forward_hook && b->bias && var_numel(&b->bias->var) == (size_t)c->out_shape[0] &&
           model_reads_previous(m, j) && c->n_consumers == 1;
}

/* The input of the add j other than module j - 1's output, when the add can join the fused conv i before it as a
 * residual: an unhooked add of two inputs, j - 1 read by it alone, the other made before the conv (so before the
 * fused op runs); RESIDUAL_NONE otherwise. */
static int model_fusable_residual(const Model *m, int i, int j) {
    const Module *a = &m->modules[j];
    if (a->spec.type != LAYER_ADD || a->forward_hook || a->n_inputs != 2 || m->modules[j - 1].n_consumers != 1)
        return RESIDUAL_NONE;
    const int k = a->inputs[0] == j - 1 ? 1 : a->inputs[1] == j - 1 ? 0 : -1;
    return k >= 0 && a->inputs[k] < i ? a->inputs[k] : RESIDUAL_NONE;
}

/* Which modules from i on run as one fused convolution: a conv2d, then a
 * batch norm folded into it as its bias (model_fusable_bn), then a residual
 * add (model_fusable_residual; a hook with fused_residual, no gradients),
 * then a relu (the relu epilogue), then a max pool (kernel 2, stride 2; the
 * relu and pool epilogue, not after an add); each part optional but the
 * pool needs the relu. A hooked conv2d fuses only if its hook offers a
 * fused form. Each fused-away output must have the next module as its only
 * consumer: the fused op never makes it. */
static ConvFusion model_fusable_layers(const Model *m, const Tape *t, int i) {
    ConvFusion f = {1, CONV_EPI_NONE, NULL, RESIDUAL_NONE};
    const Module *c = &m->modules[i];
    /* nn_conv2d_fused runs plain convs; a hook's fused form may take others (the int8 depthwise kernel) and
       declines what it cannot run */
    if (c->spec.type != LAYER_CONV2D || (!c->conv_plain && !c->forward_hook)) return f;
    if (c->forward_hook ? !c->fused_hook : !c->weight || c->weight->released) return f;
    f.bias = c->bias ? &c->bias->var : NULL;
    int j = i + 1; /* the next module to fold in */
    if (j < m->n_modules && model_fusable_bn(m, i, j)) f.bias = &m->modules[j++].bias->var;
    if (j >= m->n_modules) return (f.n = j - i, f);
    /* a residual add next, then perhaps a relu: a hook that takes it (no backward for the sum, so no gradients) */
    if (c->forward_hook && c->fused_residual && !t->grad_enabled && !m->keep_outputs &&
        (f.residual = model_fusable_residual(m, i, j)) != RESIDUAL_NONE)
        j++;
    if (j >= m->n_modules) return (f.n = j - i, f);
    const Module *prev = &m->modules[j - 1], *r = &m->modules[j];
    if (r->spec.type != LAYER_RELU || r->forward_hook || !model_reads_previous(m, j) || prev->n_consumers != 1)
        return (f.n = j - i, f);
    f.epi = CONV_EPI_RELU;
    if (++j >= m->n_modules || f.residual != RESIDUAL_NONE) return (f.n = j - i, f); /* no pool after a sum */
    const Module *p = &m->modules[j];
    bool pool = p->spec.type == LAYER_MAXPOOL2D && !p->forward_hook && p->spec.kernel == 2 && p->spec.stride == 2 &&
                c->out_shape[1] >= 2 && c->out_shape[2] >= 2 && model_reads_previous(m, j) && r->n_consumers == 1;
    if (pool) f.epi = CONV_EPI_RELU_MAXPOOL2, j++;
    return (f.n = j - i, f);
}

/* The modules that read module e's output, for Tape.handoff: in a forward without gradients whose outputs are not
 * kept, every later module that has it as its one input, when there are 1 to TAPE_HANDOFF_MAX of them; the
 * merges among its readers (a residual add) then take its floats (Tape.handoff_keep). Else none (no reader of one
 * input, or e the model's output); Tape.handoff_merges if every reader is a merge. */
static void handoff_readers(const Model *m, Tape *t, int e) {
    t->n_handoff = 0, t->handoff_keep = false, t->handoff_merges = false;
    if (t->grad_enabled || m->keep_outputs || e + 1 >= m->n_modules) return;
    int n = 0, merges = 0;
    for (int k = e + 1; k < m->n_modules; k++)
        for (int q = 0; q < m->modules[k].n_inputs; q++)
            if (m->modules[k].inputs[q] == e) {
                if (m->modules[k].n_inputs != 1) {
                    merges++;
                    continue;
                }
                if (n == TAPE_HANDOFF_MAX) return;
                t->handoff[n++] = &m->modules[k];
            }
    if (n && n + merges == m->modules[e].n_consumers) t->n_handoff = n, t->handoff_keep = merges > 0;
    t->handoff_merges = !n && merges && merges == m->modules[e].n_consumers;
}

/* Whether module i may run while a hook's work waits (Tape.deferred): a conv with a hook, which reads its input and
 * residual in the deferred work's order or runs that work first (quant's int8 chain). Any other op reads outputs
 * the waiting work has yet to write, so it runs that work first. */
static bool runs_with_deferred(const Module *mod) { return mod->forward_hook && mod->spec.type == LAYER_CONV2D; }

Var *model_forward(Model *m, Tape *t, Var *x) {
    if (!x) return NULL;
    bool fits = x->value.ndim == m->input_ndim + 1;
    for (int i = 0; fits && i < m->input_ndim; i++) fits = x->value.shape[i + 1] == m->input_shape[i];
    if (!fits) {
        char sx[64], sm[64] = "(N";
        for (int i = 0; i < m->input_ndim; i++)
            snprintf(sm + strlen(sm), sizeof sm - strlen(sm), ", %d", m->input_shape[i]);
        qt_error_set(&t->err, QT_ERR_SHAPE, "model: input batch %s does not match the model's input %s)",
                     tensor_shape_str(&x->value, sx, sizeof sx), sm);
        return NULL;
    }
    /* Every output stays a Var on the tape (its arena) until tape_reset, so a
       later module can read any earlier one; outs only indexes them. */
    Var **outs = m->outs;
    outs[0] = x;
    for (int i = 0; i < m->n_modules; i++) {
        Module *mod = &m->modules[i];
        if (!runs_with_deferred(mod) && !tape_run_deferred(t)) return NULL;
        ConvFusion f = model_fusable_layers(m, t, i);
        if (f.residual != RESIDUAL_NONE && !outs[1 + f.residual]) f.n = 1; /* not made (defensive): one by one */
        if (f.n > 1) {
            Var *in = outs[1 + mod->inputs[0]];
            handoff_readers(m, t, i + f.n - 1);
            t->residual = f.residual != RESIDUAL_NONE ? outs[1 + f.residual] : NULL;
            Var *y = mod->forward_hook ? mod->fused_hook(t, mod, in, mod->hook_ctx, f.bias, f.epi)
                                       : nn_conv2d_fused(t, in, &mod->weight->var, f.bias, mod->spec.stride,
                                                         mod->spec.padding, f.epi);
            t->n_handoff = 0, t->handoff_keep = false, t->handoff_merges = false, t->residual = NULL;
            if (!y && !tape_ok(t)) return NULL;
            if (y) {
                for (int q = i; q < i + f.n - 1; q++) outs[1 + q] = NULL; /* never made */
                outs[i + f.n] = y;
                if (!t->grad_enabled && !m->keep_outputs) /* the residual's last reader may be the add */
                    for (int q = i; q < i + f.n; q++) model_graph_release_dead(m, t, q, i + f.n - 1);
                else if (!m->keep_outputs) model_graph_train_memory(m, t, i, true);
                i += f.n - 1;
                continue;
            }
            /* the hook declined: run it and the layers after it one by one */
        }
        handoff_readers(m, t, i);
        Var *y = model_step(m, t, i, outs);
        t->n_handoff = 0, t->handoff_keep = false, t->handoff_merges = false;
        if (!y) return NULL;
        if (!t->grad_enabled && !m->keep_outputs) model_graph_release_dead(m, t, i, i);
        else if (!m->keep_outputs) model_graph_train_memory(m, t, i, false);
    }
    return tape_run_deferred(t) ? outs[m->n_modules] : NULL; /* the caller reads the output */
}

Var *model_step(Model *m, Tape *t, int i, Var **outs) {
    Module *mod = &m->modules[i];
    Var *xs[LAYER_INPUTS_MAX];
    for (int k = 0; k < mod->n_inputs; k++)
        if (!(xs[k] = outs[1 + mod->inputs[k]])) return outs[1 + i] = NULL;
    Var *y;
    if (mod->spec.type == LAYER_ADD || mod->spec.type == LAYER_CONCAT)
        y = model_merge_forward(t, mod, xs, mod->spec.type == LAYER_ADD && model_graph_add_relu(m, i));
    else if (model_graph_bn_relu(m, i))
        y = nn_batchnorm_relu_inplace(t, xs[0]); /* the batch norm applied it (below) */
    else if (model_graph_relu_in_place(m, i) && model_graph_add_relu(m, mod->inputs[0]))
        y = nn_relu_inplace_applied(t, xs[0]); /* the add applied it (above) */
    else if (model_graph_relu_in_place(m, i))
        y = nn_relu_inplace(t, xs[0]); /* a batch norm's or add's output read by nothing else */
    else if (model_graph_bn_relu_producer(m, i) && t->grad_enabled && model_graph_bn_relu_view(m, i))
        y = nn_batchnorm_relu_view(t, xs[0], mod->weight ? &mod->weight->var : NULL,
                                   mod->bias ? &mod->bias->var : NULL, &mod->bn); /* its one reader, a conv, reads it */
    else if (t->grad_enabled && model_graph_bn_add_view(m, i))
        y = nn_batchnorm_view(t, xs[0], mod->weight ? &mod->weight->var : NULL, mod->bias ? &mod->bias->var : NULL,
                              &mod->bn); /* its one reader, an add, reads it */
    else if (model_graph_bn_relu_producer(m, i))
        y = nn_batchnorm_relu(t, xs[0], mod->weight ? &mod->weight->var : NULL, mod->bias ? &mod->bias->var : NULL,
                              &mod->bn);
    else if (model_graph_conv_bn(m, i) && !(mod->weight && mod->weight->released))
        y = mod->conv_plain ? nn_conv2d_bn(t, xs[0], &mod->weight->var, mod->bias ? &mod->bias->var : NULL,
                                           mod->spec.stride, mod->spec.padding)
                            : nn_conv2d_general_bn(t, xs[0], &mod->weight->var, mod->bias ? &mod->bias->var : NULL,
                                                   &mod->geom);
    else
        y = mod->forward_hook ? mod->forward_hook(t, mod, xs[0], mod->hook_ctx) : model_module_forward(t, mod, xs[0]);
    return outs[1 + i] = y;
}

Var *model_merge_forward(Tape *t, Module *m, Var *const *xs, bool relu) {
    if (m->spec.type == LAYER_CONCAT) return nn_concat(t, xs, m->n_inputs);
    Var *y = xs[0];
    for (int k = 1; k < m->n_inputs && y; k++)
        y = relu && k == m->n_inputs - 1 ? nn_add_relu(t, y, xs[k]) : nn_add(t, y, xs[k]);
    return y;
}

/* ---- queries ----------------------------------------------------------------- */

Module *model_find_module(Model *m, const char *path) {
    for (int i = 0; i < m->n_modules; i++)
        if (strcmp(m->modules[i].path, path) == 0) return &m->modules[i];
    return NULL;
}

Param *model_find_param(Model *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

size_t model_param_count(const Model *m, bool trainable_only) {
    size_t n = 0;
    for (int i = 0; i < m->n_params; i++)
        if (!trainable_only || m->params[i].trainable) n += var_numel(&m->params[i].var);
    return n;
}

size_t model_param_bytes(const Model *m) {
    size_t n = 0;
    for (int i = 0; i < m->n_params; i++)
        if (!m->params[i].released) n += var_numel(&m->params[i].var);
    return n * sizeof(float);
}

double model_module_macs(const Module *mod) {
    if (mod->spec.type == LAYER_DENSE) return (double)mod->in_shape[0] * mod->out_shape[0];
    if (mod->spec.type == LAYER_CONV2D)
        return (double)mod->out_shape[0] * mod->out_shape[1] * mod->out_shape[2] *
               (mod->in_shape[0] / mod->spec.groups) * mod->spec.kernel * mod->spec.kernel_w;
    return 0.0;
}

double model_forward_flops(const Model *m) {
    double flops = 0.0;
    for (int i = 0; i < m->n_modules; i++) flops += 2.0 * model_module_macs(&m->modules[i]);
    return flops;
}

void model_print(const Model *m, FILE *out) {
    char s[64];
    fprintf(out, "  %-12s %-10s %-16s %s\n", "module", "type", "output", "params");
    fprintf(out, "  %-12s %-10s %-16s\n", "(input)", "", shape_str(s, sizeof s, m->input_ndim, m->input_shape));
    for (int i = 0; i < m->n_modules; i++) {
        const Module *mod = &m->modules[i];
        size_t np = (mod->weight ? var_numel(&mod->weight->var) : 0) + (mod->bias ? var_numel(&mod->bias->var) : 0);
        fprintf(out, "  %-12s %-10s %-16s %zu", mod->path, layer_type_name(mod->spec.type),
                shape_str(s, sizeof s, mod->out_ndim, mod->out_shape), np);
        const LayerSpec *c = &mod->spec;
        if (c->type == LAYER_CONV2D && c->groups > 1)
            fprintf(out, c->groups == mod->in_shape[0] ? "  depthwise" : "  groups %d", c->groups);
        if (c->type == LAYER_CONV2D && (c->dilation > 1 || c->dilation_w > 1))
            fprintf(out, "  dilation [%d, %d]", c->dilation, c->dilation_w);
        /* where a module does not read the one before it, what it reads */
        for (int k = 0; mod->spec.n_inputs && k < mod->n_inputs; k++)
            fprintf(out, "%s%s", k ? ", " : "  <- ", mod->inputs[k] < 0 ? "(input)" : m->modules[mod->inputs[k]].path);
        fputc('\n', out);
    }
    fprintf(out, "  total params: %zu (%zu trainable), %.1f KiB held as float32\n", model_param_count(m, false),
            model_param_count(m, true), (double)model_param_bytes(m) / 1024.0);
}
