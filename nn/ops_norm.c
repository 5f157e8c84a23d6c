/* ops_norm.c - layer normalisation over the last axis; batch normalisation
 * over all axes but the channel axis (1). */
#include <math.h>

#include "ops.h"
#include "base/parallel.h"

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

/* ---- batch normalisation --------------------------------------------------- */

/* x is viewed as (N, C, inner): inner = 1 for (N, C), L for (N, C, L), H*W for
 * (N, C, H, W). A channel's elements are N runs of `inner` floats, C*inner
 * apart. Every kernel below works on a range of channels, and a channel's
 * arithmetic does not depend on the range it falls in, so splitting the
 * channels over any number of threads gives the same bits. */

typedef struct {
    float *mean;   /* (C,): the statistics the forward normalised with */
    float *invstd; /* (C,): 1 / sqrt(var + eps) */
    bool batch;    /* the statistics came from this batch (the training form) */
    int N, C;
    size_t inner;
} BatchnormCtx;

typedef struct {
    const BatchnormCtx *c;
    const BatchNormState *bn;
    float *y;           /* forward: (N, C, inner) */
    float *dx;          /* backward: NULL if not needed */
    float *dgamma, *dbeta;
    const float *x, *dy, *gamma, *beta;
} BatchnormJob;

/* Statistics of channels [c0, c1) into c->mean/invstd, and the running update.
 *
 * Two passes in double: the mean, then the sum of squared deviations from it.
 * A channel of a conv layer holds N*H*W values (100k at batch 128 on 28x28),
 * where a float sum loses ~log2(100k) = 17 bits, and the one-pass
 * E[x^2] - E[x]^2 cancels catastrophically when |mean| >> std (a ReLU's
 * output, a layer without bias). Welford would also be stable, but costs a
 * division per element; the second pass re-reads data that was just read.
 * This is also what PyTorch's CPU kernel does (double accumulators, two
 * passes), so the statistics agree to rounding. */
static void batchnorm_stats(const BatchnormJob *j, int c0, int c1) {
    const BatchnormCtx *c = j->c;
    const BatchNormState *bn = j->bn;
    const size_t stride = (size_t)c->C * c->inner;
    const double count = (double)c->N * (double)c->inner;
    for (int ch = c0; ch < c1; ch++) {
        double sum = 0.0, ss = 0.0;
        for (int n = 0; n < c->N; n++) {
            const float *xp = j->x + n * stride + (size_t)ch * c->inner;
            for (size_t i = 0; i < c->inner; i++) sum += xp[i];
        }
        const double mean = sum / count;
        for (int n = 0; n < c->N; n++) {
            const float *xp = j->x + n * stride + (size_t)ch * c->inner;
            for (size_t i = 0; i < c->inner; i++) ss += ((double)xp[i] - mean) * ((double)xp[i] - mean);
        }
        c->mean[ch] = (float)mean;
        c->invstd[ch] = (float)(1.0 / sqrt(ss / count + bn->eps));
        if (bn->running_mean && !bn->frozen) {
            /* PyTorch: running = (1 - momentum) running + momentum batch, with
             * the unbiased variance (count > 1 is checked by the op). */
            const double m = bn->momentum;
            bn->running_mean[ch] = (float)((1.0 - m) * bn->running_mean[ch] + m * mean);
            bn->running_var[ch] = (float)((1.0 - m) * bn->running_var[ch] + m * (ss / (count - 1.0)));
        }
    }
}

/* y = (x - mean) * (invstd * gamma) + beta over channels [c0, c1). */
static void batchnorm_apply(const BatchnormJob *j, int c0, int c1) {
    const BatchnormCtx *c = j->c;
    const size_t stride = (size_t)c->C * c->inner;
    for (int ch = c0; ch < c1; ch++) {
        const float m = c->mean[ch], a = c->invstd[ch] * (j->gamma ? j->gamma[ch] : 1.0f);
        const float b = j->beta ? j->beta[ch] : 0.0f;
        for (int n = 0; n < c->N; n++) {
            const size_t off = n * stride + (size_t)ch * c->inner;
            const float *xp = j->x + off;
            float *yp = j->y + off;
            for (size_t i = 0; i < c->inner; i++) yp[i] = (xp[i] - m) * a + b;
        }
    }
}

/* Gradients over channels [c0, c1), accumulated. With xhat = (x - mean) invstd,
 * M = N*inner values per channel, and g = gamma (or 1):
 *   dbeta  = sum dy,  dgamma = sum dy xhat
 *   training form (mean and var depend on x):
 *     dx = g invstd (dy - sum(dy)/M - xhat sum(dy xhat)/M)
 *   running statistics (constants): dx = g invstd dy.
 * The two channel sums are taken in double (as the statistics are). */
static void batchnorm_grads(const BatchnormJob *j, int c0, int c1) {
    const BatchnormCtx *c = j->c;
    const size_t stride = (size_t)c->C * c->inner;
    const double count = (double)c->N * (double)c->inner;
    for (int ch = c0; ch < c1; ch++) {
        const float m = c->mean[ch], is = c->invstd[ch];
        double sum_dy = 0.0, dot = 0.0; /* dot = sum dy (x - mean) */
        for (int n = 0; n < c->N; n++) {
            const size_t off = n * stride + (size_t)ch * c->inner;
            const float *xp = j->x + off, *dyp = j->dy + off;
            for (size_t i = 0; i < c->inner; i++) {
                sum_dy += dyp[i];
                dot += (double)dyp[i] * (double)(xp[i] - m);
            }
        }
        if (j->dbeta) j->dbeta[ch] += (float)sum_dy;
        if (j->dgamma) j->dgamma[ch] += (float)(dot * is);
        if (!j->dx) continue;
        const float a = is * (j->gamma ? j->gamma[ch] : 1.0f);
        const float k1 = c->batch ? (float)(sum_dy / count) : 0.0f;
        const float k2 = c->batch ? (float)(dot * (double)is * (double)is / count) : 0.0f;
        for (int n = 0; n < c->N; n++) {
            const size_t off = n * stride + (size_t)ch * c->inner;
            const float *xp = j->x + off, *dyp = j->dy + off;
            float *dxp = j->dx + off;
            for (size_t i = 0; i < c->inner; i++) dxp[i] += (dyp[i] - k1 - (xp[i] - m) * k2) * a;
        }
    }
}

typedef enum { BN_JOB_FORWARD, BN_JOB_BACKWARD } BatchnormJobKind;

typedef struct {
    const BatchnormJob *job;
    BatchnormJobKind kind;
} BatchnormTask;

static void batchnorm_task(void *ctx, int task, int n_tasks) {
    const BatchnormTask *bt = ctx;
    int c0, c1;
    parallel_range(bt->job->c->C, task, n_tasks, &c0, &c1);
    if (bt->kind == BN_JOB_BACKWARD) {
        batchnorm_grads(bt->job, c0, c1);
        return;
    }
    if (bt->job->c->batch) batchnorm_stats(bt->job, c0, c1);
    batchnorm_apply(bt->job, c0, c1);
}

/* Channels split over the pool when the tensor is large enough to pay for
 * the hand-off (results are the same either way: see above). */
static void batchnorm_run(const BatchnormJob *job, BatchnormJobKind kind) {
    BatchnormTask bt = {job, kind};
    size_t numel = (size_t)job->c->N * job->c->C * job->c->inner;
    int n_tasks = numel >= ((size_t)1 << 15) ? parallel_get_threads() : 1;
    if (n_tasks > job->c->C) n_tasks = job->c->C;
    parallel_run(n_tasks, batchnorm_task, &bt);
}

static void batchnorm_tape_backward(Tape *t, const TapeNode *node) {
    const BatchnormCtx *c = node->ctx;
    Var *x = node->in[0], *gamma = node->in[1], *beta = node->in[2];
    BatchnormJob j = {.c = c, .x = x->value.data, .dy = node->out->grad,
                      .gamma = gamma ? gamma->value.data : NULL};
    j.dx = x->requires_grad ? tape_grad(t, x) : NULL;
    j.dgamma = gamma && gamma->requires_grad ? tape_grad(t, gamma) : NULL;
    j.dbeta = beta && beta->requires_grad ? tape_grad(t, beta) : NULL;
    if (!tape_ok(t)) return;
    batchnorm_run(&j, BN_JOB_BACKWARD);
}

/* Shapes and arguments; QT_OK or the error set on the tape. */
static QtStatus batchnorm_check(Tape *t, const Var *x, const Var *gamma, const Var *beta, const BatchNormState *bn) {
    char sx[64], sp[64];
    tensor_shape_str(&x->value, sx, sizeof sx);
    if (x->value.ndim < 2)
        return qt_error_set(&t->err, QT_ERR_SHAPE, "batchnorm: input %s must be (N, C), (N, C, L) or (N, C, H, W)",
                            sx);
    const int C = x->value.shape[1];
    for (int k = 0; k < 2; k++) {
        const Var *p = k ? beta : gamma;
        if (p && (p->value.ndim != 1 || p->value.shape[0] != C))
            return qt_error_set(&t->err, QT_ERR_SHAPE, "batchnorm: %s %s does not match the %d channels (axis 1) "
                                "of input %s; want (%d,)", k ? "beta" : "gamma",
                                tensor_shape_str(&p->value, sp, sizeof sp), C, sx, C);
    }
    if (!bn)
        return qt_error_set(&t->err, QT_ERR_ARG, "batchnorm: no BatchNormState given (input %s)", sx);
    if (!(bn->eps > 0.0f))
        return qt_error_set(&t->err, QT_ERR_ARG, "batchnorm: eps must be > 0, got %g (input %s)", (double)bn->eps,
                            sx);
    if (!(bn->momentum >= 0.0f && bn->momentum <= 1.0f))
        return qt_error_set(&t->err, QT_ERR_ARG, "batchnorm: momentum must be in [0, 1], got %g (input %s)",
                            (double)bn->momentum, sx);
    if (!bn->running_mean != !bn->running_var)
        return qt_error_set(&t->err, QT_ERR_ARG, "batchnorm: running_mean and running_var must be given together "
                            "(input %s)", sx);
    if (bn->frozen && !bn->running_mean)
        return qt_error_set(&t->err, QT_ERR_ARG, "batchnorm: frozen needs running statistics (input %s)", sx);
    return QT_OK;
}

Var *nn_batchnorm(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn) {
    if (!x) return NULL;
    if (batchnorm_check(t, x, gamma, beta, bn) != QT_OK) return NULL;
    const int N = x->value.shape[0], C = x->value.shape[1];
    const size_t inner = var_numel(x) / ((size_t)N * C);
    /* PyTorch's rule: batch statistics when the module trains (or keeps no
     * running statistics); a frozen state acts as eval whatever the tape. */
    const bool batch = !bn->running_mean || (t->training && !bn->frozen);
    if (batch && (size_t)N * inner < 2) {
        char sx[64];
        qt_error_set(&t->err, QT_ERR_SHAPE, "batchnorm: batch statistics need more than 1 value per channel, "
                     "got input %s (use a batch of 2 or more, or eval mode)",
                     tensor_shape_str(&x->value, sx, sizeof sx));
        return NULL;
    }
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    BatchnormCtx *c = tape_alloc(t, sizeof *c);
    if (!y || !c) return NULL;
    *c = (BatchnormCtx){.batch = batch, .N = N, .C = C, .inner = inner};
    c->mean = tape_alloc(t, (size_t)C * sizeof(float));
    c->invstd = tape_alloc(t, (size_t)C * sizeof(float));
    if (!c->mean || !c->invstd) return NULL;
    if (!batch)
        for (int ch = 0; ch < C; ch++) {
            c->mean[ch] = bn->running_mean[ch];
            c->invstd[ch] = (float)(1.0 / sqrt((double)bn->running_var[ch] + bn->eps));
        }
    BatchnormJob j = {.c = c, .bn = bn, .y = y->value.data, .x = x->value.data,
                      .gamma = gamma ? gamma->value.data : NULL, .beta = beta ? beta->value.data : NULL};
    batchnorm_run(&j, BN_JOB_FORWARD);
    if (batch && bn->running_mean && bn->num_batches_tracked) (*bn->num_batches_tracked)++;
    return tape_record(t, "batchnorm", batchnorm_tape_backward, y, (Var *[]){x, gamma, beta}, 3, c) ? y : NULL;
}
