/* ops_chscale.c - per-channel scaling and batch norm folding's arithmetic
 * (ops_chscale.h). */
#include "ops_chscale.h"

#include <math.h>
#include <stdio.h>

void chscale_forward(float *restrict y, const float *restrict x, const float *restrict s, size_t outer, int C,
                     size_t inner, bool divide) {
    for (size_t o = 0; o < outer; o++)
        for (int c = 0; c < C; c++) {
            size_t base = (o * (size_t)C + (size_t)c) * inner;
            float f = s[c];
            if (divide)
                for (size_t i = 0; i < inner; i++) y[base + i] = x[base + i] / f;
            else
                for (size_t i = 0; i < inner; i++) y[base + i] = x[base + i] * f;
        }
}

void chscale_backward(float *dx, float *ds, const float *dy, const float *x, const float *y, const float *s,
                      size_t outer, int C, size_t inner, bool divide) {
    for (int c = 0; c < C; c++) {
        float f = s[c];
        double acc = 0.0; /* a channel's sum over outer * inner values: in double, as the statistics are */
        for (size_t o = 0; o < outer; o++) {
            size_t base = (o * (size_t)C + (size_t)c) * inner;
            if (dx) {
                if (divide)
                    for (size_t i = 0; i < inner; i++) dx[base + i] += dy[base + i] / f;
                else
                    for (size_t i = 0; i < inner; i++) dx[base + i] += dy[base + i] * f;
            }
            if (ds) {
                if (divide) /* d(x / f)/df = -x / f^2 = -y / f */
                    for (size_t i = 0; i < inner; i++) acc -= (double)dy[base + i] * y[base + i];
                else
                    for (size_t i = 0; i < inner; i++) acc += (double)dy[base + i] * x[base + i];
            }
        }
        if (ds) ds[c] += divide ? (float)(acc / f) : (float)acc;
    }
}

typedef struct {
    int axis;
    bool divide;
} ChscaleCtx;

/* x viewed as (outer, C, inner) around axis. */
static void chscale_dims(const Var *x, int axis, size_t *outer, size_t *inner) {
    *outer = 1;
    *inner = 1;
    for (int d = 0; d < axis; d++) *outer *= (size_t)x->value.shape[d];
    for (int d = axis + 1; d < x->value.ndim; d++) *inner *= (size_t)x->value.shape[d];
}

static void chscale_backward_node(Tape *t, const TapeNode *node) {
    const ChscaleCtx *c = node->ctx;
    Var *x = node->in[0], *s = node->in[1];
    float *dx = x->requires_grad ? tape_grad(t, x) : NULL;
    float *ds = s->requires_grad ? tape_grad(t, s) : NULL;
    if ((x->requires_grad && !dx) || (s->requires_grad && !ds)) return;
    size_t outer, inner;
    chscale_dims(x, c->axis, &outer, &inner);
    chscale_backward(dx, ds, node->out->grad, x->value.data, node->out->value.data, s->value.data, outer,
                     x->value.shape[c->axis], inner, c->divide);
}

Var *nn_chscale(Tape *t, Var *x, Var *s, int axis, bool divide) {
    if (!x || !s) return NULL;
    char sx[64], ss[64];
    if (axis < 0 || axis >= x->value.ndim || s->value.ndim != 1 || s->value.shape[0] != x->value.shape[axis]) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "chscale: scale %s does not match axis %d of input %s",
                     tensor_shape_str(&s->value, ss, sizeof ss), axis, tensor_shape_str(&x->value, sx, sizeof sx));
        return NULL;
    }
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    ChscaleCtx *c = y ? tape_alloc(t, sizeof *c) : NULL;
    if (!c) return NULL;
    *c = (ChscaleCtx){.axis = axis, .divide = divide};
    size_t outer, inner;
    chscale_dims(x, axis, &outer, &inner);
    chscale_forward(y->value.data, x->value.data, s->value.data, outer, x->value.shape[axis], inner, divide);
    return tape_record(t, "chscale", chscale_backward_node, y, (Var *[]){x, s}, 2, c) ? y : NULL;
}

void bn_fold_values(float *w_out, float *shift_out, const float *w, const float *b, const float *gamma,
                    const float *beta, const float *mean, const float *var, float eps, int C, size_t per) {
    for (int c = 0; c < C; c++) {
        double s = (gamma ? gamma[c] : 1.0) / sqrt((double)var[c] + (double)eps);
        if (w_out)
            for (size_t k = 0; k < per; k++) w_out[(size_t)c * per + k] = (float)(w[(size_t)c * per + k] * s);
        if (shift_out) shift_out[c] = (float)(((b ? b[c] : 0.0) - mean[c]) * s + (beta ? beta[c] : 0.0));
    }
}
