/* ops_norm.c - layer normalisation over the last axis. */
#include <math.h>

#include "ops.h"

void layernorm_forward(float *y, float *mean, float *rstd, const float *x, const float *gamma,
                       const float *beta, int rows, int D, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * D;
        float *yr = y + (size_t)r * D;
        /* Two passes in double: the one-pass E[x^2]-E[x]^2 cancels badly
         * for rows with a large mean. */
        double m = 0.0, v = 0.0;
        for (int i = 0; i < D; i++) m += xr[i];
        m /= D;
        for (int i = 0; i < D; i++) v += ((double)xr[i] - m) * ((double)xr[i] - m);
        v /= D;
        float rs = (float)(1.0 / sqrt(v + eps));
        mean[r] = (float)m;
        rstd[r] = rs;
        for (int i = 0; i < D; i++) {
            float xhat = (xr[i] - (float)m) * rs;
            yr[i] = xhat * (gamma ? gamma[i] : 1.0f) + (beta ? beta[i] : 0.0f);
        }
    }
}

void layernorm_backward(float *dx, float *dgamma, float *dbeta, const float *dy, const float *x,
                        const float *gamma, const float *mean, const float *rstd, int rows, int D) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * D, *dyr = dy + (size_t)r * D;
        /* dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) */
        double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
        for (int i = 0; i < D; i++) {
            float xhat = (xr[i] - mean[r]) * rstd[r];
            float dxhat = dyr[i] * (gamma ? gamma[i] : 1.0f);
            sum_dxhat += dxhat;
            sum_dxhat_xhat += (double)dxhat * xhat;
            if (dgamma) dgamma[i] += dyr[i] * xhat;
            if (dbeta) dbeta[i] += dyr[i];
        }
        if (!dx) continue;
        float m1 = (float)(sum_dxhat / D), m2 = (float)(sum_dxhat_xhat / D);
        float *dxr = dx + (size_t)r * D;
        for (int i = 0; i < D; i++) {
            float xhat = (xr[i] - mean[r]) * rstd[r];
            float dxhat = dyr[i] * (gamma ? gamma[i] : 1.0f);
            dxr[i] += rstd[r] * (dxhat - m1 - xhat * m2);
        }
    }
}

typedef struct {
    float *mean; /* [rows] */
    float *rstd; /* [rows] */
    int rows, D;
} LayernormCtx;

static void layernorm_tape_backward(Tape *t, const TapeNode *node) {
    const LayernormCtx *c = node->ctx;
    Var *x = node->in[0], *gamma = node->in[1], *beta = node->in[2];
    float *dx = x->requires_grad ? tape_grad(t, x) : NULL;
    float *dg = gamma && gamma->requires_grad ? tape_grad(t, gamma) : NULL;
    float *db = beta && beta->requires_grad ? tape_grad(t, beta) : NULL;
    if (!tape_ok(t)) return;
    layernorm_backward(dx, dg, db, node->out->grad, x->value.data, gamma ? gamma->value.data : NULL, c->mean, c->rstd,
                       c->rows, c->D);
}

Var *nn_layernorm(Tape *t, Var *x, Var *gamma, Var *beta, float eps) {
    if (!x) return NULL;
    char sx[64], sp[64];
    int D = x->value.shape[x->value.ndim - 1];
    for (int k = 0; k < 2; k++) {
        Var *p = k ? beta : gamma;
        if (p && (p->value.ndim != 1 || p->value.shape[0] != D)) {
            qt_error_set(&t->err, QT_ERR_SHAPE, "layernorm: %s %s does not match the last axis of input %s (%d)",
                         k ? "beta" : "gamma", tensor_shape_str(&p->value, sp, sizeof sp),
                         tensor_shape_str(&x->value, sx, sizeof sx), D);
            return NULL;
        }
    }
    if (!(eps > 0.0f)) {
        qt_error_set(&t->err, QT_ERR_ARG, "layernorm: eps must be > 0, got %g", (double)eps);
        return NULL;
    }
    int rows = (int)(var_numel(x) / (size_t)D);
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    LayernormCtx *c = tape_alloc(t, sizeof *c);
    if (!y || !c) return NULL;
    c->mean = tape_alloc(t, (size_t)rows * sizeof(float));
    c->rstd = tape_alloc(t, (size_t)rows * sizeof(float));
    if (!c->mean || !c->rstd) return NULL;
    c->rows = rows;
    c->D = D;
    layernorm_forward(y->value.data, c->mean, c->rstd, x->value.data, gamma ? gamma->value.data : NULL,
                      beta ? beta->value.data : NULL, rows, D, eps);
    return tape_record(t, "layernorm", layernorm_tape_backward, y, (Var *[]){x, gamma, beta}, 3, c) ? y : NULL;
}
