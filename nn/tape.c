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
    if (!t->nodes || arena_init(&t->small, 64 << 10) != 0) {
        free(t->nodes);
        t->nodes = NULL;
        return qt_error_set(err, QT_ERR_NOMEM, "tape_init: cannot allocate %zu tape nodes", t->cap_nodes);
    }
    return QT_OK;
}

void tape_free(Tape *t) {
    free(t->nodes);
    arena_free(&t->small);
    memset(t, 0, sizeof *t);
}

void tape_reset(Tape *t) {
    t->n_nodes = 0;
    t->backward_done = false;
    t->free_grads = NULL;
    t->deferred = NULL, t->run_deferred = NULL, t->hold = 0, t->n_held = 0;
    qt_error_clear(&t->err);
    arena_reset(t->arena);
    arena_reset(&t->small);
}

/* A free buffer (a dead gradient or activation): the header lives in the
 * buffer's first bytes. The list is kept in address order and neighbours
 * merge, so buffers freed one by one serve a larger request later; a request
 * smaller than the buffer it takes leaves the rest listed; a free buffer that
 * ends at the arena's top goes back to the arena. Without this, a step
 * alternating 6 MB and 3 MB tensors leaves its memory in pieces too small for
 * the next 6 MB gradient, and the arena grows instead. */
typedef struct FreeGrad {
    struct FreeGrad *next;
    size_t bytes; /* a multiple of ARENA_ALIGN */
} FreeGrad;

/* Buffers of fewer bytes than this are not kept (too small to hold the
 * header, and not worth it). */
#define FREE_GRAD_MIN ARENA_ALIGN

static size_t free_grad_round(size_t bytes) { return (bytes + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN; }

/* The smallest free buffer of at least `bytes` (its front part when larger), unlinked; NULL if none. */
static void *free_grad_take(Tape *t, size_t bytes) {
    bytes = free_grad_round(bytes);
    FreeGrad **best = NULL;
    for (FreeGrad **p = (FreeGrad **)&t->free_grads; *p; p = &(*p)->next)
        if ((*p)->bytes >= bytes && (!best || (*p)->bytes < (*best)->bytes)) best = p;
    if (!best) return NULL;
    FreeGrad *f = *best;
    if (f->bytes - bytes >= FREE_GRAD_MIN) { /* the rest stays listed, in f's place */
        FreeGrad *rest = (FreeGrad *)(void *)((char *)f + bytes);
        rest->next = f->next;
        rest->bytes = f->bytes - bytes;
        *best = rest;
    } else {
        *best = f->next;
    }
    return f;
}

static void free_grad_put(Tape *t, float *buf, size_t bytes) {
    if (t->hold > 0) { /* still read by deferred work */
        if (t->n_held < TAPE_HELD_MAX) t->held[t->n_held].p = buf, t->held[t->n_held++].bytes = bytes;
        return;
    }
    bytes = free_grad_round(bytes);
    if (bytes < FREE_GRAD_MIN) return;
    char *b = (char *)buf;
    if (arena_is_unused(t->arena, buf)) return; /* handed back once already, and given back to the arena since */
    FreeGrad *prev = NULL, *next = t->free_grads;
    for (; next && (char *)next < b; prev = next, next = next->next) {}
    /* already free (a buffer two Vars share, handed back by both) */
    if (prev && b < (char *)prev + prev->bytes) return;
    if (next && (char *)next == b) return;
    FreeGrad *f = (FreeGrad *)(void *)buf;
    f->bytes = bytes;
    f->next = next;
    if (next && b + bytes == (char *)next) f->bytes += next->bytes, f->next = next->next;
    if (prev && (char *)prev + prev->bytes == b) {
        prev->bytes += f->bytes, prev->next = f->next;
        f = prev;
    } else if (prev) {
        prev->next = f;
    } else {
        t->free_grads = f;
    }
    if (!f->next && arena_give_back(t->arena, f, f->bytes)) { /* the arena's top: back to the arena */
        FreeGrad **p = (FreeGrad **)&t->free_grads;
        while (*p != f) p = &(*p)->next;
        *p = NULL;
    }
}

void *tape_alloc(Tape *t, size_t bytes) {
    void *p = arena_alloc(bytes <= TAPE_SMALL_BYTES ? &t->small : t->arena, bytes);
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
    const size_t bytes = tensor_numel(&v->value) * sizeof(float);
    if (!(v->value.data = free_grad_take(t, bytes))) v->value.data = tape_alloc(t, bytes);
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

/* An arena (or recycled) buffer for v's gradient, uninitialised. */
static float *grad_alloc(Tape *t, Var *v) {
    const size_t bytes = var_numel(v) * sizeof(float);
    float *g = free_grad_take(t, bytes);
    if (!g) g = arena_alloc(t->arena, bytes);
    if (!g) qt_error_set(&t->err, QT_ERR_NOMEM, "out of memory: no room for a gradient of %zu floats", var_numel(v));
    return g;
}

void tape_release_buffer(Tape *t, void *p, size_t bytes) {
    if (p) free_grad_put(t, p, bytes);
}

void tape_hold_releases(Tape *t) { t->hold++; }

bool tape_run_deferred(Tape *t) { return !t->deferred || !t->run_deferred || t->run_deferred(t); }

void tape_release_held(Tape *t) {
    if (t->hold <= 0 || --t->hold > 0) return;
    const int n = t->n_held;
    t->n_held = 0;
    for (int i = 0; i < n; i++) free_grad_put(t, t->held[i].p, t->held[i].bytes);
}

void tape_release(Tape *t, Var *v) {
    if (v && v->value.data) free_grad_put(t, v->value.data, var_numel(v) * sizeof(float));
}

bool tape_grad_take(Tape *t, Var *v, Var *from) {
    (void)t;
    if (v->grad || v->is_param || !from->grad || from->is_param || var_numel(v) != var_numel(from)) return false;
    v->grad = from->grad;
    return true;
}

float *tape_grad(Tape *t, Var *v) {
    if (!v->grad && v->is_param) {
        /* A parameter's grad lives for the run; an arena buffer would dangle
         * after tape_reset. A frozen one must not receive a gradient. */
        qt_error_set(&t->err, QT_ERR_ARG, "a gradient reached a frozen parameter (requires_grad set without a grad "
                                          "buffer; use param_unfreeze)");
        return NULL;
    }
    if (!v->grad && (v->grad = grad_alloc(t, v))) memset(v->grad, 0, var_numel(v) * sizeof(float));
    return v->grad;
}

float *tape_grad_to_write(Tape *t, Var *v, bool *fresh) {
    *fresh = false;
    if (v->grad || v->is_param) return tape_grad(t, v);
    v->grad = grad_alloc(t, v);
    *fresh = v->grad != NULL;
    return v->grad;
}

/* ---- activation memory ------------------------------------------------------ */

static void value_forget(Var *v) {
    if (v->remake) {
        for (int k = 0; k < 2; k++)
            if (v->remake->vars[k]) v->remake->vars[k]->value.data = NULL;
    }
    v->value.data = NULL;
}

bool tape_remake_set(Tape *t, Var *v, Var *also, TapeRemakeFn fn, const void *ctx) {
    TapeRemake *r = tape_alloc(t, sizeof *r);
    if (!r) return false;
    *r = (TapeRemake){fn, ctx, {v, also}, var_numel(v) * sizeof(float)};
    v->remake = r;
    if (also) also->remake = r;
    return true;
}

void tape_drop(Tape *t, Var *v) {
    if (!v || !v->value.data) return;
    free_grad_put(t, v->value.data, var_numel(v) * sizeof(float));
    value_forget(v);
}

bool tape_release_after(Tape *t, Var *out, Var *v) {
    for (size_t i = t->n_nodes, seen = 0; i-- > 0 && seen < 4; seen++) {
        TapeNode *n = &t->nodes[i];
        if (n->out != out) continue;
        for (int k = 0; k < TAPE_NODE_RELEASES; k++)
            if (!n->release[k] || n->release[k] == v) return (n->release[k] = v, true);
        return false;
    }
    return false;
}

bool tape_value_ready(Tape *t, Var *v) {
    if (!v || v->value.data || !v->remake) return tape_ok(t);
    const TapeRemake *r = v->remake;
    float *buf = free_grad_take(t, r->bytes);
    if (!buf && !(buf = tape_alloc(t, r->bytes))) return false;
    r->fn(t, buf, r->ctx);
    for (int q = 0; q < 2; q++)
        if (r->vars[q]) r->vars[q]->value.data = buf;
    return tape_ok(t);
}

/* Before node n's backward: its inputs' dropped values, made again. */
static bool remake_values(Tape *t, const TapeNode *n) {
    bool ok = true;
    for (int k = 0; ok && !n->value_free && k < TAPE_MAX_INPUTS; k++) ok = tape_value_ready(t, n->in[k]);
    return ok;
}

static void release_values(Tape *t, const TapeNode *n) {
    for (int k = 0; k < TAPE_NODE_RELEASES; k++)
        if (n->release[k]) tape_drop(t, n->release[k]);
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

bool tape_record_value_free(Tape *t, const char *op, TapeBackwardFn backward, Var *out, Var *const *in, int n_in,
                            void *ctx) {
    const size_t before = t->n_nodes;
    if (!tape_record(t, op, backward, out, in, n_in, ctx)) return false;
    if (t->n_nodes > before) t->nodes[t->n_nodes - 1].value_free = true;
    return true;
}

/* After node n's backward: its output's gradient is dead, unless an input
 * took it over (tape_grad_take) or it is a parameter's. */
static void release_out_grad(Tape *t, const TapeNode *n) {
    Var *out = n->out;
    if (out->is_param || !out->grad) return;
    for (int k = 0; k < TAPE_MAX_INPUTS; k++)
        if (n->in[k] && n->in[k]->grad == out->grad) return;
    free_grad_put(t, out->grad, var_numel(out) * sizeof(float));
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
        if (n->out->grad) { /* else nothing flowed into this op's output */
            if (!remake_values(t, n)) break;
            n->backward(t, n);
            if (!tape_ok(t)) break;
            release_out_grad(t, n);
        }
        release_values(t, n);
    }
    return t->err.status;
}
