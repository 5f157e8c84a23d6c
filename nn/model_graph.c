/* model_graph.c - which outputs a module reads: the model as a DAG.
 *
 * A layer reads the previous layer's output unless it names its inputs
 * (LayerSpec.inputs): earlier layers by name, or MODEL_INPUT_NAME for the
 * model's input when no layer has that name. Only earlier layers may be
 * named, so evaluating the list in order computes every input before it is
 * read, and there can be no cycle. Merge layers (add, concat) read two or
 * more inputs; every other layer reads one. */
#include <stdio.h>
#include <string.h>

#include "model.h"

static bool is_merge(LayerType t) { return t == LAYER_ADD || t == LAYER_CONCAT; }

static char *shape_text(char *buf, size_t size, int ndim, const int *shape) {
    Tensor t = {0};
    tensor_set_shape(&t, ndim, shape);
    return tensor_shape_str(&t, buf, size);
}

/* The name layer j of the list will get (its own, or model_init's automatic one). */
static void layer_path(const LayerSpec *layers, int j, char *out, size_t cap) {
    if (layers[j].name[0]) snprintf(out, cap, "%s", layers[j].name);
    else snprintf(out, cap, "%s%d", layer_type_name(layers[j].type), j);
}

/* The index of input `name` of module i: an earlier module, or -1 for the model's input. */
static QtStatus resolve_name(const Model *m, int i, const char *name, const LayerSpec *layers, int n_layers, int *out,
                             QtError *err) {
    const Module *mod = &m->modules[i];
    const char *tn = layer_type_name(mod->spec.type);
    for (int j = 0; j < i; j++)
        if (strcmp(m->modules[j].path, name) == 0) return *out = j, QT_OK;
    if (strcmp(name, MODEL_INPUT_NAME) == 0) {
        bool taken = false;
        for (int j = i; j < n_layers && !taken; j++) {
            char p[MODULE_NAME_MAX];
            layer_path(layers, j, p, sizeof p);
            taken = strcmp(p, name) == 0;
        }
        if (!taken) return *out = -1, QT_OK;
    }
    if (strcmp(name, mod->path) == 0)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s) names itself as its input; a layer reads earlier "
                            "layers only", mod->path, tn);
    for (int j = i + 1; j < n_layers; j++) {
        char p[MODULE_NAME_MAX];
        layer_path(layers, j, p, sizeof p);
        if (strcmp(p, name) == 0)
            return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s) reads '%s', which comes later (layer %d); layers "
                                "run in the order listed, so an input must be an earlier layer (this also rules out "
                                "cycles)", mod->path, tn, name, j);
    }
    return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s) reads '%s', which is no earlier layer; name an earlier "
                        "layer, or '" MODEL_INPUT_NAME "' for the model's input", mod->path, tn, name);
}

/* The output shape of input k of module mod (k's index in mod->inputs). */
static void input_shape(const Model *m, int idx, int *ndim, int *shape) {
    shape[0] = shape[1] = shape[2] = 1;
    if (idx < 0) {
        *ndim = m->input_ndim;
        memcpy(shape, m->input_shape, (size_t)m->input_ndim * sizeof(int));
    } else {
        *ndim = m->modules[idx].out_ndim;
        memcpy(shape, m->modules[idx].out_shape, 3 * sizeof(int));
    }
}

static const char *input_name(const Model *m, int idx) { return idx < 0 ? MODEL_INPUT_NAME : m->modules[idx].path; }

/* A merge's input shape: add needs equal shapes, concat equal ones but for the channel axis (its sum). */
static QtStatus merge_shape(Model *m, Module *mod, QtError *err) {
    const bool add = mod->spec.type == LAYER_ADD;
    int ndim, shape[3];
    input_shape(m, mod->inputs[0], &ndim, shape);
    for (int k = 1; k < mod->n_inputs; k++) {
        int kd, ks[3];
        input_shape(m, mod->inputs[k], &kd, ks);
        bool fits = kd == ndim;
        for (int d = add ? 0 : 1; fits && d < ndim; d++) fits = ks[d] == shape[d];
        if (!fits) {
            char a[64], b[64];
            input_shape(m, mod->inputs[0], &ndim, shape);
            return qt_error_set(err, QT_ERR_SHAPE, "layer '%s' (%s): its inputs '%s' %s and '%s' %s %s", mod->path,
                                layer_type_name(mod->spec.type), input_name(m, mod->inputs[0]),
                                shape_text(a, sizeof a, ndim, shape), input_name(m, mod->inputs[k]),
                                shape_text(b, sizeof b, kd, ks),
                                add ? "differ in shape; add needs equal shapes (a 1x1 conv2d on one path can match "
                                      "them)"
                                    : "differ in more than the channel axis; concat joins inputs whose other "
                                      "dimensions are equal");
        }
        if (!add) shape[0] += ks[0];
    }
    mod->in_ndim = ndim;
    memcpy(mod->in_shape, shape, sizeof shape);
    return QT_OK;
}

QtStatus model_graph_resolve(Model *m, int i, const LayerSpec *layers, int n_layers, QtError *err) {
    Module *mod = &m->modules[i];
    const LayerSpec *s = &mod->spec;
    const char *tn = layer_type_name(s->type);
    if (s->n_inputs < 0 || s->n_inputs > LAYER_INPUTS_MAX)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s): %d inputs; at most %d", mod->path, tn, s->n_inputs,
                            LAYER_INPUTS_MAX);
    if (is_merge(s->type) && s->n_inputs < 2)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s) merges two or more inputs; name them, e.g. "
                            "inputs: [%s, %s]", mod->path, tn, i > 1 ? m->modules[i - 2].path : MODEL_INPUT_NAME,
                            i > 0 ? m->modules[i - 1].path : MODEL_INPUT_NAME);
    if (!is_merge(s->type) && s->n_inputs > 1)
        return qt_error_set(err, QT_ERR_CONFIG, "layer '%s' (%s) reads one input, got %d; merge them first with an "
                            "add or concat layer", mod->path, tn, s->n_inputs);
    mod->n_inputs = s->n_inputs ? s->n_inputs : 1;
    mod->inputs[0] = i - 1;
    for (int k = 0; k < s->n_inputs; k++) {
        QtStatus st = resolve_name(m, i, s->inputs[k], layers, n_layers, &mod->inputs[k], err);
        if (st != QT_OK) return st;
    }
    if (is_merge(s->type)) return merge_shape(m, mod, err);
    input_shape(m, mod->inputs[0], &mod->in_ndim, mod->in_shape);
    return QT_OK;
}

void model_graph_count_consumers(Model *m) {
    for (int i = 0; i < m->n_modules; i++) m->modules[i].n_consumers = 0;
    for (int i = 0; i < m->n_modules; i++)
        for (int k = 0; k < m->modules[i].n_inputs; k++)
            if (m->modules[i].inputs[k] >= 0) m->modules[m->modules[i].inputs[k]].n_consumers++;
    if (m->n_modules > 0) m->modules[m->n_modules - 1].n_consumers++;
}

bool model_reads_previous(const Model *m, int i) {
    const Module *mod = &m->modules[i];
    return mod->n_inputs == 1 && mod->inputs[0] == i - 1;
}

int model_graph_last_reader(const Model *m, int j) {
    if (j == m->n_modules - 1) return m->n_modules;
    int last = -1;
    for (int i = j + 1; i < m->n_modules; i++)
        for (int k = 0; k < m->modules[i].n_inputs; k++)
            if (m->modules[i].inputs[k] == j) last = i;
    return last;
}

/* Whether module j's output is a buffer its own op allocated: not its
 * input's values (flatten's view, dropout's identity in eval, a batch norm
 * folded into its producer) and not whatever a hook returns. */
static bool owns_output(const Module *mod) {
    if (mod->forward_hook) return false;
    switch (mod->spec.type) {
    case LAYER_FLATTEN:
    case LAYER_DROPOUT: return false;
    case LAYER_BATCHNORM1D:
    case LAYER_BATCHNORM2D: return mod->bn_folded != BN_FOLD_INTO;
    default: return true;
    }
}

bool model_graph_relu_in_place(const Model *m, int i) {
    const Module *r = &m->modules[i];
    if (m->keep_outputs || r->spec.type != LAYER_RELU || r->forward_hook || r->n_inputs != 1 || r->inputs[0] < 0)
        return false;
    const int j = r->inputs[0];
    const Module *p = &m->modules[j];
    const bool bn = (p->spec.type == LAYER_BATCHNORM1D || p->spec.type == LAYER_BATCHNORM2D) &&
                    p->bn_folded == BN_FOLD_NONE;
    /* the only reader, not just the last: an earlier reader's backward (a conv's weight gradient) or a view of
       it (dropout in eval, flatten) still needs the values */
    return (bn || p->spec.type == LAYER_ADD) && !p->forward_hook && p->n_consumers == 1 &&
           model_graph_last_reader(m, j) == i;
}

static bool unfolded_bn(const Module *mod);
static bool plain_module(const Module *mod);

bool model_graph_bn_relu(const Model *m, int j) {
    return model_graph_relu_in_place(m, j) && unfolded_bn(&m->modules[m->modules[j].inputs[0]]);
}

bool model_graph_bn_relu_producer(const Model *m, int i) {
    if (!unfolded_bn(&m->modules[i]) || m->modules[i].n_consumers != 1) return false;
    for (int j = i + 1; j < m->n_modules; j++)
        for (int k = 0; k < m->modules[j].n_inputs; k++)
            if (m->modules[j].inputs[k] == i) return model_graph_bn_relu(m, j);
    return false;
}

bool model_graph_bn_relu_view(const Model *m, int i) {
    if (!model_graph_bn_relu_producer(m, i)) return false;
    int j = -1, k = -1; /* the relu, then its reader */
    for (int q = i + 1; q < m->n_modules && k < 0; q++)
        for (int r = 0; r < m->modules[q].n_inputs; r++) {
            if (j < 0 && m->modules[q].inputs[r] == i) j = q;
            else if (j >= 0 && m->modules[q].inputs[r] == j) k = q;
        }
    if (k < 0 || m->modules[j].n_consumers != 1 || m->modules[k].inputs[0] != j || m->modules[k].n_inputs != 1)
        return false;
    const Module *c = &m->modules[k]; /* nn_conv2d's routes, and the depthwise stride-1 one, read a view */
    return c->spec.type == LAYER_CONV2D && plain_module(c) &&
           (c->conv_plain || (c->in_shape[0] > 1 && c->geom.groups == c->in_shape[0] && c->geom.stride_h == 1 &&
                              c->geom.stride_w == 1));
}

bool model_graph_add_relu(const Model *m, int i) {
    /* the relu right after the add: a fused conv group that takes the add as its residual (no gradients, int8)
     * then takes the relu too, so the relu never finds a sum the add did not relu */
    if (m->modules[i].spec.type != LAYER_ADD || m->modules[i].n_inputs < 2 || m->modules[i].n_consumers != 1 ||
        i + 1 >= m->n_modules)
        return false;
    const Module *r = &m->modules[i + 1];
    return r->n_inputs == 1 && r->inputs[0] == i && model_graph_relu_in_place(m, i + 1);
}

bool model_graph_bn_add_view(const Model *m, int i) {
    const Module *b = &m->modules[i];
    if (m->keep_outputs || !unfolded_bn(b) || b->n_consumers != 1) return false;
    for (int j = i + 1; j < m->n_modules; j++)
        for (int k = 0; k < m->modules[j].n_inputs; k++)
            if (m->modules[j].inputs[k] == i)
                return m->modules[j].spec.type == LAYER_ADD && plain_module(&m->modules[j]);
    return false;
}

bool model_graph_conv_bn(const Model *m, int i) {
    const Module *c = &m->modules[i];
    if (c->spec.type != LAYER_CONV2D || !plain_module(c) || c->n_consumers != 1) return false;
    for (int j = i + 1; j < m->n_modules; j++)
        for (int k = 0; k < m->modules[j].n_inputs; k++)
            if (m->modules[j].inputs[k] == i) return k == 0 && unfolded_bn(&m->modules[j]);
    return false;
}

void model_graph_release_dead(Model *m, Tape *t, int first, int last) {
    const Module *mod = &m->modules[first];
    for (int k = 0; k < mod->n_inputs; k++) {
        const int j = mod->inputs[k];
        bool seen = false;
        for (int q = 0; q < k; q++) seen |= mod->inputs[q] == j;
        if (j < 0 || seen || model_graph_last_reader(m, j) != first || !owns_output(&m->modules[j])) continue;
        Var *v = m->outs[1 + j];
        if (!v) continue;
        /* A later output still read may be this buffer (a flatten's view of it). */
        bool alias = false;
        for (int q = j + 1; q <= last && !alias; q++)
            alias = m->outs[1 + q] && m->outs[1 + q]->value.data == v->value.data &&
                    model_graph_last_reader(m, q) > first;
        if (!alias) tape_release(t, v);
    }
}

/* ---- activation memory of a training step --------------------------------------------------------------------
 * What the backward reads of module outputs, by the type of the op that reads them (unhooked modules only: a
 * hook's op may keep what it likes):
 *   conv2d, dense       their input (the weight gradient), not their output (no epilogue: see out_not_read)
 *   batchnorm           its input, not its output
 *   add, concat, gap    nothing
 *   relu in place       its output, the buffer it shares with its input
 * So, in a training forward, a value is
 *   remade   a batch norm's output relu'd in place, read later only by the types above: dropped after its last
 *            forward reader, made again from the batch norm's input where a backward reads it, handed back after
 *            the relu's backward;
 *   dead     read only by add, concat or gap, and not by its own backward: dropped after its last forward reader;
 *   released after the batch norm's backward when it is the batch norm's input and has no other reader.
 * Everything else stays until the step ends, as before. */

static bool plain_module(const Module *mod) { return !mod->forward_hook; }

static bool unfolded_bn(const Module *mod) { /* a batch norm that runs as nn_batchnorm, in model_step */
    return (mod->spec.type == LAYER_BATCHNORM1D || mod->spec.type == LAYER_BATCHNORM2D) &&
           mod->bn_folded == BN_FOLD_NONE && plain_module(mod);
}

/* Whether every reader of module j's output is an unhooked module whose op reads what the table above says;
 * values_read: conv2d and dense allowed too (they read their input), else only the value-free ones. */
static bool readers_known(const Model *m, int j, bool values_read) {
    if (j == m->n_modules - 1) return false; /* the model's output: the caller reads it */
    for (int i = j + 1; i < m->n_modules; i++) {
        const Module *r = &m->modules[i];
        bool reads = false;
        for (int k = 0; k < r->n_inputs; k++) reads |= r->inputs[k] == j;
        if (!reads) continue;
        if (!plain_module(r)) return false;
        const LayerType ty = r->spec.type;
        const bool value_free = ty == LAYER_ADD || ty == LAYER_CONCAT || ty == LAYER_GLOBALAVGPOOL;
        if (!value_free && !(values_read && (ty == LAYER_CONV2D || ty == LAYER_DENSE))) return false;
    }
    return true;
}

/* Whether module j's own backward leaves its output unread and j made the buffer itself. */
static bool out_not_read(const Model *m, int j) {
    const Module *mod = &m->modules[j];
    if (!plain_module(mod) || !owns_output(mod)) return false;
    switch (mod->spec.type) {
    case LAYER_CONV2D: /* a conv fused with an epilogue leaves outs[1 + j] NULL: never made */
    case LAYER_DENSE:
    case LAYER_ADD:
    case LAYER_CONCAT:
    case LAYER_GLOBALAVGPOOL: return true;
    case LAYER_BATCHNORM1D:
    case LAYER_BATCHNORM2D: return unfolded_bn(mod);
    default: return false;
    }
}

/* After module i's op (training, with gradients): marks what its output may shed in the backward. */
static void mark_output(Model *m, Tape *t, int i) {
    const Module *mod = &m->modules[i];
    Var *y = m->outs[1 + i];
    int bn = -1; /* the batch norm whose input the backward may hand back after it */
    if (model_graph_relu_in_place(m, i)) {
        const int p = mod->inputs[0];
        /* readers that make buffers of their own, and not the model's output (read after the backward) */
        const bool known = readers_known(m, i, true);
        if (unfolded_bn(&m->modules[p])) {
            bn = p;
            if (known) nn_batchnorm_remakeable(t, m->outs[1 + p], y);
        }
        if (known) tape_release_after(t, y, y); /* the relu's node reads the buffer last */
    } else if (unfolded_bn(mod)) {
        bn = i;
    }
    if (bn < 0) return;
    const int q = m->modules[bn].inputs[0];
    if (q >= 0 && m->modules[q].n_consumers == 1 && out_not_read(m, q) && m->outs[1 + q]) {
        /* a cheap conv's output is made again where the batch norm's backward (or remake) reads it */
        if (bn == i && m->modules[q].spec.type == LAYER_CONV2D) nn_conv2d_remakeable(t, m->outs[1 + q]);
        tape_release_after(t, m->outs[1 + bn], m->outs[1 + q]);
    }
}

void model_graph_train_memory(Model *m, Tape *t, int i, bool fused) {
    if (!fused && m->outs[1 + i]) mark_output(m, t, i);
    if (!fused && model_graph_relu_in_place(m, i)) return; /* its input's buffer is its output */
    const Module *mod = &m->modules[i];
    for (int k = 0; k < mod->n_inputs; k++) {
        const int j = mod->inputs[k];
        if (j < 0 || model_graph_last_reader(m, j) != i) continue;
        Var *v = m->outs[1 + j];
        if (!v) continue;
        if (m->outs[1 + i] && m->outs[1 + i]->view) continue; /* the view's reader reads its input later */
        if (v->remake || (out_not_read(m, j) && readers_known(m, j, false))) tape_drop(t, v);
        /* the view's reader has run: its source (the batch norm's input), kept for it, goes if it can be made
         * again (the reader's backward and the batch norm's make it first) */
        if (v->view && v->view->x->remake) tape_drop(t, v->view->x);
    }
}
