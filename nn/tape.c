#include "tape.h"

#include <stdlib.h>
#include <string.h>

QtStatus tape_init(Tape *t, Arena *arena, Rng *rng, QtError *err) {
    memset(t, 0, sizeof *t);
    t->arena = arena;
    t->rng = rng;
    t->grad_enabled = true;
    t->training = true;
    t->cap_nodes = 256;
    t->nodes = malloc(t->cap_nodes * sizeof *t->nodes);
    if (!t->nodes) return qt_error_set(err, QT_ERR_NOMEM, "tape_init: cannot allocate %zu tape nodes", t->cap_nodes);
    return QT_OK;
}

void tape_free(Tape *t) {
    free(t->nodes);
    memset(t, 0, sizeof *t);
}

void tape_reset(Tape *t) {
    t->n_nodes = 0;
    t->backward_done = false;
    qt_error_clear(&t->err);
    arena_reset(t->arena);
}

void *tape_alloc(Tape *t, size_t bytes) {
    void *p = arena_alloc(t->arena, bytes);
    if (!p) qt_error_set(&t->err, QT_ERR_NOMEM, "out of memory: the step arena could not grow by %zu bytes", bytes);
    return p;
}

Var *tape_new_var(Tape *t, int ndim, const int *shape) {
    Var *v = tape_alloc(t, sizeof *v);
    if (!v) return NULL;
    memset(v, 0, sizeof *v);
    if (!tensor_set_shape(&v->value, ndim, shape)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "tape_new_var: invalid shape (ndim %d; every dim must be >= 1)", ndim);
        return NULL;
    }
    v->value.data = tape_alloc(t, tensor_numel(&v->value) * sizeof(float));
    return v->value.data ? v : NULL;
}

Var *tape_wrap(Tape *t, float *data, int ndim, const int *shape) {
    Var *v = tape_alloc(t, sizeof *v);
    if (!v) return NULL;
    memset(v, 0, sizeof *v);
    if (!tensor_set_shape(&v->value, ndim, shape)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "tape_wrap: invalid shape (ndim %d; every dim must be >= 1)", ndim);
        return NULL;
    }
    v->value.data = data;
    return v;
}

float *tape_grad(Tape *t, Var *v) {
    if (!v->grad && v->is_param) {
        /* A parameter's grad lives for the run; an arena buffer would dangle
         * after tape_reset. A frozen one must not receive a gradient. */
        qt_error_set(&t->err, QT_ERR_ARG, "a gradient reached a frozen parameter (requires_grad set without a grad "
                                          "buffer; use param_unfreeze)");
        return NULL;
    }
    if (!v->grad) v->grad = arena_calloc(t->arena, var_numel(v) * sizeof(float));
    if (!v->grad) qt_error_set(&t->err, QT_ERR_NOMEM, "out of memory: no room for a gradient of %zu floats", var_numel(v));
    return v->grad;
}

float *tape_grad_to_write(Tape *t, Var *v, bool *fresh) {
    *fresh = false;
    if (v->grad || v->is_param) return tape_grad(t, v);
    v->grad = tape_alloc(t, var_numel(v) * sizeof(float));
    *fresh = v->grad != NULL;
    return v->grad;
}

bool tape_record(Tape *t, const char *op, TapeBackwardFn backward, Var *out,
                 Var *const *in, int n_in, void *ctx) {
    bool needs = false;
    for (int i = 0; i < n_in; i++) needs |= in[i] && in[i]->requires_grad;
    out->requires_grad = needs && t->grad_enabled;
    if (!out->requires_grad) return true;
    if (n_in > TAPE_MAX_INPUTS) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: %d inputs, but a tape node holds at most %d", op, n_in,
                     TAPE_MAX_INPUTS);
        return false;
    }
    if (t->n_nodes == t->cap_nodes) {
        /* Only while the first steps discover the graph's size. */
        size_t cap = t->cap_nodes * 2;
        TapeNode *nodes = realloc(t->nodes, cap * sizeof *nodes);
        if (!nodes) {
            qt_error_set(&t->err, QT_ERR_NOMEM, "%s: cannot grow the tape to %zu nodes", op, cap);
            return false;
        }
        t->nodes = nodes;
        t->cap_nodes = cap;
    }
    TapeNode *n = &t->nodes[t->n_nodes++];
    memset(n, 0, sizeof *n);
    n->op = op;
    n->backward = backward;
    n->out = out;
    for (int i = 0; i < n_in; i++) n->in[i] = in[i];
    n->ctx = ctx;
    return true;
}

QtStatus tape_backward(Tape *t, Var *loss) {
    if (!tape_ok(t)) return t->err.status;
    if (!loss) return qt_error_set(&t->err, QT_ERR_ARG, "tape_backward: loss is NULL");
    if (var_numel(loss) != 1) {
        char s[64];
        return qt_error_set(&t->err, QT_ERR_SHAPE, "tape_backward: the loss must have one element, got shape %s",
                            tensor_shape_str(&loss->value, s, sizeof s));
    }
    const float one = 1.0f;
    return tape_backward_from(t, loss, &one);
}

QtStatus tape_backward_from(Tape *t, Var *out, const float *dout) {
    if (!tape_ok(t)) return t->err.status;
    if (!out) return qt_error_set(&t->err, QT_ERR_ARG, "tape_backward: output is NULL");
    if (!out->requires_grad) return QT_OK; /* nothing to differentiate */
    if (t->backward_done)
        /* The intermediate grads of the first pass are still there: a second
         * pass would add them in again. */
        return qt_error_set(&t->err, QT_ERR_ARG, "tape_backward: called twice on one tape; tape_reset() between steps");
    t->backward_done = true;
    float *g = tape_grad(t, out);
    if (!g) return t->err.status;
    for (size_t i = 0, n = var_numel(out); i < n; i++) g[i] += dout[i];
    for (size_t i = t->n_nodes; i-- > 0;) {
        const TapeNode *n = &t->nodes[i];
        if (!n->out->grad) continue; /* nothing flowed into this op's output */
        n->backward(t, n);
        if (!tape_ok(t)) break;
    }
    return t->err.status;
}
