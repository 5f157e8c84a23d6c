/* ops_norm.c - layer normalisation over the last axis; batch normalisation
 * over all axes but the channel axis (1). */
#include <math.h>
#include <stdbool.h>
#include <string.h>

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

typedef struct {
    float *mean;   /* (C,): the statistics the forward normalised with */
    float *invstd; /* (C,): 1 / sqrt(var + eps) */
    bool batch;    /* the statistics came from this batch (the training form) */
    int N, C;
    size_t inner;
    double count;  /* values per channel the batch statistics cover: N*inner, or the global batch's with sync */
    const TapeSync *sync; /* the batch statistics are the global batch's, gathered through it; else NULL */
    const float *scale; /* (C,): invstd * gamma as the forward used it (nn_batchnorm_remakeable) */
    const float *beta;  /* (C,) or NULL */
    Var *x;             /* the input (N, C, inner), read by a remake */
    bool relu;          /* a remake applies the relu the caller ran in place on the output */
    bool relu_fwd;      /* the forward applied the relu itself (nn_batchnorm_relu, whose relu node records it) */
    bool no_output;     /* nn_batchnorm_relu_view, nn_batchnorm_view: the output is never written, only viewed */
    NnAffineRelu view;  /* those two: how its reader makes the output */
    bool relu_mask;     /* set by that relu's backward: the output gradient arrives unmasked, and this backward
                         * masks it (batchnorm_grad_*_relu) instead of a pass of the relu's own */
} BatchnormCtx;

typedef struct {
    const BatchnormCtx *c;
    const BatchNormState *bn;
    float *y;           /* forward: (N, C, inner) */
    float *dx;          /* backward: NULL if not needed */
    bool dx_accumulate; /* false: dx is a fresh buffer, written rather than added to */
    float *dgamma, *dbeta;
    const float *x, *dy, *gamma, *beta;
    float *scale;       /* (C,): invstd * gamma, the factor of y and of dx */
    float *k1, *k2;     /* backward: (C,) scratch */
    double *s1, *s2;    /* (C,) scratch: mean and variance, or sum dy and sum dy (x - mean) */
    const float *moments; /* forward: x's planes' batchnorm_plane_moments (N, C, 3) made by its producer, or NULL */
} BatchnormJob;

/* The batch statistics of channels [c0, c1) into j->s1, j->s2: from the planes' moments x's producer made, or a
 * read of x; the same bits either way. */
static void batchnorm_stats_run(const BatchnormJob *j, int c0, int c1) {
    const BatchnormCtx *c = j->c;
    if (j->moments) batchnorm_stats_planes(j->s1, j->s2, j->moments, c->N, c->C, c->inner, c0, c1);
    else batchnorm_stats(j->s1, j->s2, j->x, c->N, c->C, c->inner, c0, c1);
}

/* The mean and variance in j->s1, j->s2 of channels [c0, c1) into
 * c->mean/invstd, and the running update (unbiased over c->count values). */
static void batchnorm_stats_finish(const BatchnormJob *j, int c0, int c1) {
    const BatchnormCtx *c = j->c;
    const BatchNormState *bn = j->bn;
    const double count = c->count;
    for (int ch = c0; ch < c1; ch++) {
        const double mean = j->s1[ch], var = j->s2[ch];
        c->mean[ch] = (float)mean;
        c->invstd[ch] = (float)(1.0 / sqrt(var + bn->eps));
        if (bn->running_mean && !bn->frozen) {
            /* PyTorch: running = (1 - momentum) running + momentum batch, with
             * the unbiased variance (count > 1 is checked by the op). */
            const double m = bn->momentum;
            bn->running_mean[ch] = (float)((1.0 - m) * bn->running_mean[ch] + m * mean);
            bn->running_var[ch] = (float)((1.0 - m) * bn->running_var[ch] + m * (var * count / (count - 1.0)));
        }
    }
}

/* Gradients over channels [c0, c1), accumulated, from the channel sums in
 * j->s1, j->s2 (batchnorm_grad_sums). With xhat = (x - mean) invstd,
 * M = c->count values per channel, and g = gamma (or 1):
 *   dbeta  = sum dy,  dgamma = sum dy xhat
 *   training form (mean and var depend on x):
 *     dx = g invstd (dy - sum(dy)/M - xhat sum(dy xhat)/M)
 *   running statistics (constants): dx = g invstd dy.
 * Two passes over dy and x: the two channel sums, then dx. With sync the
 * sums are the global batch's and dgamma, dbeta NULL (added by the caller
 * from this rank's sums). */
static void batchnorm_grads_finish(const BatchnormJob *j, int c0, int c1) {
    const BatchnormCtx *c = j->c;
    const double count = c->count;
    for (int ch = c0; ch < c1; ch++) {
        const double sum_dy = j->s1[ch], dot = j->s2[ch], is = c->invstd[ch];
        if (j->dbeta) j->dbeta[ch] += (float)sum_dy;
        if (j->dgamma) j->dgamma[ch] += (float)(dot * is);
        j->scale[ch] = c->invstd[ch] * (j->gamma ? j->gamma[ch] : 1.0f);
        j->k1[ch] = c->batch ? (float)(sum_dy / count) : 0.0f;
        j->k2[ch] = c->batch ? (float)(dot * is * is / count) : 0.0f;
    }
    if (j->dx && c->relu_mask) /* the forward's scale: the same floats as j->scale */
        batchnorm_grad_input_relu(j->dx, j->dx_accumulate, j->dy, j->x, c->mean, c->scale, c->beta, j->k1, j->k2,
                                  c->N, c->C, c->inner, c0, c1);
    else if (j->dx)
        batchnorm_grad_input(j->dx, j->dx_accumulate, j->dy, j->x, c->mean, j->scale, j->k1, j->k2, c->N, c->C,
                             c->inner, c0, c1);
}

/* The gradient's channel sums of channels [c0, c1), masked by the relu where it left that to this backward. */
static void batchnorm_sums(const BatchnormJob *j, int c0, int c1) {
    const BatchnormCtx *c = j->c;
    if (c->relu_mask)
        batchnorm_grad_sums_relu(j->s1, j->s2, j->dy, j->x, c->mean, c->scale, c->beta, c->N, c->C, c->inner, c0, c1);
    else
        batchnorm_grad_sums(j->s1, j->s2, j->dy, j->x, c->mean, c->N, c->C, c->inner, c0, c1);
}

/* FORWARD and BACKWARD do all of an op's work per channel range; with sync
 * each is split where the ranks' sums are gathered (on the calling thread:
 * a collective must not run in a pool task): STATS then FORWARD_FINISH,
 * GRAD_SUMS then BACKWARD_FINISH. A channel's arithmetic is the same either way. */
typedef enum {
    BN_JOB_FORWARD,
    BN_JOB_STATS,
    BN_JOB_FORWARD_FINISH,
    BN_JOB_BACKWARD,
    BN_JOB_GRAD_SUMS,
    BN_JOB_BACKWARD_FINISH,
    BN_JOB_REMAKE
} BatchnormJobKind;

typedef struct {
    const BatchnormJob *job;
    BatchnormJobKind kind;
} BatchnormTask;

/* Channels a group: about BN_GROUP_BYTES of each operand, so that the second pass over a group (apply after the
 * statistics, dx after the sums) reads it from L2 rather than memory. A channel's arithmetic does not depend on
 * the grouping. */
#define BN_GROUP_BYTES (512u << 10)

static int batchnorm_group(const BatchnormCtx *c) {
    const size_t per = (size_t)c->N * c->inner * sizeof(float);
    const size_t g = per ? BN_GROUP_BYTES / per : 1;
    return g < 1 ? 1 : g > (size_t)c->C ? c->C : (int)g;
}

/* The forward of channels [c0, c1) once their statistics are in j->s1, j->s2 (batch form) or c (running). */
static void batchnorm_forward_finish(const BatchnormJob *j, int c0, int c1) {
    const BatchnormCtx *c = j->c;
    if (c->batch) batchnorm_stats_finish(j, c0, c1);
    for (int ch = c0; ch < c1; ch++) j->scale[ch] = c->invstd[ch] * (j->gamma ? j->gamma[ch] : 1.0f);
    if (c->no_output) return;
    if (c->relu_fwd) batchnorm_apply_relu(j->y, j->x, c->mean, j->scale, j->beta, c->N, c->C, c->inner, c0, c1);
    else batchnorm_apply(j->y, j->x, c->mean, j->scale, j->beta, c->N, c->C, c->inner, c0, c1);
}

static void batchnorm_task(void *ctx, int task, int n_tasks) {
    const BatchnormTask *bt = ctx;
    const BatchnormJob *j = bt->job;
    const BatchnormCtx *c = j->c;
    int c0, c1;
    parallel_range(c->C, task, n_tasks, &c0, &c1);
    const int G = batchnorm_group(c);
    switch (bt->kind) {
    case BN_JOB_BACKWARD:
        for (int g0 = c0; g0 < c1; g0 += G) {
            const int g1 = c1 - g0 < G ? c1 : g0 + G;
            batchnorm_sums(j, g0, g1);
            batchnorm_grads_finish(j, g0, g1);
        }
        return;
    case BN_JOB_GRAD_SUMS:
        batchnorm_sums(j, c0, c1);
        return;
    case BN_JOB_BACKWARD_FINISH:
        batchnorm_grads_finish(j, c0, c1);
        return;
    case BN_JOB_REMAKE:
        if (c->relu) batchnorm_apply_relu(j->y, j->x, c->mean, c->scale, c->beta, c->N, c->C, c->inner, c0, c1);
        else batchnorm_apply(j->y, j->x, c->mean, c->scale, c->beta, c->N, c->C, c->inner, c0, c1);
        return;
    case BN_JOB_STATS:
        batchnorm_stats_run(j, c0, c1);
        return;
    case BN_JOB_FORWARD:
        for (int g0 = c0; g0 < c1; g0 += G) {
            const int g1 = c1 - g0 < G ? c1 : g0 + G;
            if (c->batch) batchnorm_stats_run(j, g0, g1);
            batchnorm_forward_finish(j, g0, g1);
        }
        return;
    case BN_JOB_FORWARD_FINISH:
        batchnorm_forward_finish(j, c0, c1);
        return;
    }
}

/* Channels split over the pool when the tensor is large enough to pay for
 * the hand-off (results are the same either way: see above). */
static void batchnorm_run(const BatchnormJob *job, BatchnormJobKind kind) {
    BatchnormTask bt = {job, kind};
    size_t numel = (size_t)job->c->N * job->c->C * job->c->inner;
    /* 4 tasks a thread: a thread that a busy core slows leaves a few to the others, not half the channels */
    int n_tasks = numel >= ((size_t)1 << 15) ? 4 * parallel_get_threads() : 1;
    if (n_tasks > job->c->C) n_tasks = job->c->C;
    parallel_run(n_tasks, batchnorm_task, &bt);
}

/* The per-call scratch of a job: scale, k1, k2 (C floats each) and s1, s2 (C doubles each). */
static bool batchnorm_job_scratch(Tape *t, BatchnormJob *j, int C) {
    j->s1 = tape_alloc(t, 2 * (size_t)C * sizeof(double));
    j->scale = tape_alloc(t, 3 * (size_t)C * sizeof(float));
    if (!j->s1 || !j->scale) return false;
    j->s2 = j->s1 + C;
    j->k1 = j->scale + C;
    j->k2 = j->k1 + C;
    return true;
}

/* The scratch of a gather of n doubles per rank: mine (n), then all (world, n);
 * NULL with the tape error set. */
static double *batchnorm_gather_buffer(Tape *t, const BatchnormCtx *c, size_t n) {
    return tape_alloc(t, (1 + (size_t)c->sync->world) * n * sizeof(double));
}

/* all (world, n) = every rank's mine through c->sync, on the calling thread.
 * QT_OK or the error set on the tape, naming the op, its channels and `what`. */
static QtStatus batchnorm_gather(Tape *t, const BatchnormCtx *c, const double *mine, size_t n, double *all,
                                 const char *what) {
    const TapeSync *s = c->sync;
    QtError e = {0};
    QtStatus st = s->allgather(s->ctx, mine, n, all, &e);
    if (st == QT_OK) return QT_OK;
    return qt_error_set(&t->err, st, "batchnorm (%d channels): gathering the %s from %d ranks failed: %s", c->C,
                        what, s->world, e.msg[0] ? e.msg : qt_status_name(st));
}

/* The scratch of batchnorm_gather_buffer back to the tape: only a block from
 * the step arena goes on its free list (small ones live in the tape's small
 * arena until the reset). */
static void batchnorm_gather_done(Tape *t, const BatchnormCtx *c, double *buf, size_t n) {
    const size_t bytes = (1 + (size_t)c->sync->world) * n * sizeof(double);
    if (bytes > TAPE_SMALL_BYTES) tape_release_buffer(t, buf, bytes);
}

/* The global batch's statistics from every rank's [count, mean (C), var (C)]
 * (in j->s1, j->s2 on entry, the global ones on return), combined in rank
 * order in double: M = sum M_r, mean = sum M_r mean_r / M,
 * var = sum M_r (var_r + (mean_r - mean)^2) / M; c->count becomes M. */
static QtStatus batchnorm_sync_stats(Tape *t, BatchnormCtx *c, BatchnormJob *j) {
    const int C = c->C, W = c->sync->world;
    const size_t n = 1 + 2 * (size_t)C;
    double *mine = batchnorm_gather_buffer(t, c, n);
    if (!mine) return t->err.status;
    double *all = mine + n;
    mine[0] = c->count;
    memcpy(mine + 1, j->s1, (size_t)C * sizeof(double));
    memcpy(mine + 1 + C, j->s2, (size_t)C * sizeof(double));
    if (batchnorm_gather(t, c, mine, n, all, "batch statistics") != QT_OK) return t->err.status;
    double count = 0.0;
    for (int r = 0; r < W; r++) count += all[(size_t)r * n];
    for (int ch = 0; ch < C; ch++) {
        double s = 0.0, v = 0.0;
        for (int r = 0; r < W; r++) s += all[(size_t)r * n] * all[(size_t)r * n + 1 + ch];
        const double mean = s / count;
        for (int r = 0; r < W; r++) {
            const double *a = all + (size_t)r * n, d = a[1 + ch] - mean;
            v += a[0] * (a[1 + C + ch] + d * d);
        }
        j->s1[ch] = mean;
        j->s2[ch] = v / count;
    }
    c->count = count;
    batchnorm_gather_done(t, c, mine, n);
    return QT_OK;
}

/* The global batch's sum dy and sum dy (x - mean) (j->s1, j->s2: this rank's
 * on entry), summed over the ranks in rank order. */
static QtStatus batchnorm_sync_grad_sums(Tape *t, const BatchnormCtx *c, BatchnormJob *j) {
    const int C = c->C, W = c->sync->world;
    const size_t n = 2 * (size_t)C;
    double *mine = batchnorm_gather_buffer(t, c, n);
    if (!mine) return t->err.status;
    double *all = mine + n;
    memcpy(mine, j->s1, n * sizeof(double)); /* s2 follows s1 (batchnorm_job_scratch) */
    if (batchnorm_gather(t, c, mine, n, all, "gradient sums") != QT_OK) return t->err.status;
    for (size_t i = 0; i < n; i++) {
        double s = 0.0;
        for (int r = 0; r < W; r++) s += all[(size_t)r * n + i];
        j->s1[i] = s;
    }
    batchnorm_gather_done(t, c, mine, n);
    return QT_OK;
}

static void batchnorm_tape_backward(Tape *t, const TapeNode *node) {
    const BatchnormCtx *c = node->ctx;
    Var *x = node->in[0], *gamma = node->in[1], *beta = node->in[2];
    BatchnormJob j = {.c = c, .x = x->value.data, .dy = node->out->grad,
                      .gamma = gamma ? gamma->value.data : NULL};
    /* dx in place of dy when x has no gradient yet: the sums come first,
     * then each dx element from its own dy and x only. */
    bool fresh = false;
    if (x->requires_grad && tape_grad_take(t, x, node->out))
        j.dx = x->grad, fresh = true;
    else
        j.dx = x->requires_grad ? tape_grad_to_write(t, x, &fresh) : NULL;
    j.dx_accumulate = !fresh;
    j.dgamma = gamma && gamma->requires_grad ? tape_grad(t, gamma) : NULL;
    j.dbeta = beta && beta->requires_grad ? tape_grad(t, beta) : NULL;
    if (!tape_ok(t) || !batchnorm_job_scratch(t, &j, c->C)) return;
    /* Without dx nothing global is needed: dgamma and dbeta are this rank's sums. */
    if (!c->sync || !j.dx) {
        batchnorm_run(&j, BN_JOB_BACKWARD);
        return;
    }
    batchnorm_run(&j, BN_JOB_GRAD_SUMS);
    /* dgamma and dbeta from this rank's sums: the ranks' parameter gradients
     * are summed afterwards, and the global sums here would count them world
     * times. dx's terms take the global sums. */
    for (int ch = 0; ch < c->C; ch++) {
        if (j.dbeta) j.dbeta[ch] += (float)j.s1[ch];
        if (j.dgamma) j.dgamma[ch] += (float)(j.s2[ch] * c->invstd[ch]);
    }
    j.dgamma = j.dbeta = NULL;
    if (batchnorm_sync_grad_sums(t, c, &j) != QT_OK) return;
    batchnorm_run(&j, BN_JOB_BACKWARD_FINISH);
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

static Var *batchnorm_forward(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn, bool relu, bool view) {
    if (!x) return NULL;
    if (batchnorm_check(t, x, gamma, beta, bn) != QT_OK) return NULL;
    const int N = x->value.shape[0], C = x->value.shape[1];
    const size_t inner = var_numel(x) / ((size_t)N * C);
    /* PyTorch's rule: batch statistics when the module trains (or keeps no
     * running statistics); a frozen state acts as eval whatever the tape. */
    const bool batch = !bn->running_mean || (t->training && !bn->frozen);
    /* As PyTorch's SyncBatchNorm: the global batch's statistics only when
     * training (an evaluation without running statistics stays local). */
    const TapeSync *sync = batch && t->training ? t->bn_sync : NULL;
    /* Synced, the global batch has at least one value per rank, so one here is enough. */
    if (batch && !sync && (size_t)N * inner < 2) {
        char sx[64];
        qt_error_set(&t->err, QT_ERR_SHAPE, "batchnorm: batch statistics need more than 1 value per channel, "
                     "got input %s (use a batch of 2 or more, or eval mode)",
                     tensor_shape_str(&x->value, sx, sizeof sx));
        return NULL;
    }
    Var *y = view ? tape_wrap(t, NULL, x->value.ndim, x->value.shape) : tape_new_var(t, x->value.ndim, x->value.shape);
    BatchnormCtx *c = tape_alloc(t, sizeof *c);
    if (!y || !c) return NULL;
    *c = (BatchnormCtx){.batch = batch, .N = N, .C = C, .inner = inner, .count = (double)N * (double)inner,
                        .sync = sync, .relu_fwd = relu, .relu = relu, .no_output = view};
    c->mean = tape_alloc(t, (size_t)C * sizeof(float));
    c->invstd = tape_alloc(t, (size_t)C * sizeof(float));
    if (!c->mean || !c->invstd) return NULL;
    if (!batch)
        for (int ch = 0; ch < C; ch++) {
            c->mean[ch] = bn->running_mean[ch];
            c->invstd[ch] = (float)(1.0 / sqrt((double)bn->running_var[ch] + bn->eps));
        }
    BatchnormJob j = {.c = c, .bn = bn, .y = y->value.data, .x = x->value.data, /* y NULL with view: not written */
                      .gamma = gamma ? gamma->value.data : NULL, .beta = beta ? beta->value.data : NULL,
                      .moments = batch && batchnorm_plane_fits(inner) ? x->moments : NULL};
    if (!batchnorm_job_scratch(t, &j, C)) return NULL;
    if (sync) {
        batchnorm_run(&j, BN_JOB_STATS);
        if (batchnorm_sync_stats(t, c, &j) != QT_OK) return NULL;
        batchnorm_run(&j, BN_JOB_FORWARD_FINISH);
    } else {
        batchnorm_run(&j, BN_JOB_FORWARD);
    }
    c->scale = j.scale, c->beta = j.beta, c->x = x;
    if (view) {
        c->view = (NnAffineRelu){x, c->mean, c->scale, c->beta, !relu};
        y->view = &c->view;
    }
    if (batch && bn->running_mean && bn->num_batches_tracked) (*bn->num_batches_tracked)++;
    return tape_record(t, "batchnorm", batchnorm_tape_backward, y, (Var *[]){x, gamma, beta}, 3, c) ? y : NULL;
}

Var *nn_batchnorm(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn) {
    return batchnorm_forward(t, x, gamma, beta, bn, false, false);
}

Var *nn_batchnorm_relu(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn) {
    return batchnorm_forward(t, x, gamma, beta, bn, true, false);
}

Var *nn_batchnorm_relu_view(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn) {
    return batchnorm_forward(t, x, gamma, beta, bn, true, true);
}

Var *nn_batchnorm_view(Tape *t, Var *x, Var *gamma, Var *beta, BatchNormState *bn) {
    return batchnorm_forward(t, x, gamma, beta, bn, false, true);
}

/* The recorded batch norm whose output is y, or NULL. */
static BatchnormCtx *batchnorm_node_of(Tape *t, const Var *y) {
    for (size_t i = t->n_nodes; i-- > 0;) {
        const TapeNode *n = &t->nodes[i];
        if (n->out == y) return n->backward == batchnorm_tape_backward ? n->ctx : NULL;
    }
    return NULL;
}

/* The relu of nn_batchnorm_relu_inplace: hands its gradient to the batch norm's output unmasked, and the batch
 * norm's backward masks it in its own passes; where the batch norm's output has a gradient already (another
 * reader), the relu's own backward instead. */
static void batchnorm_relu_tape_backward(Tape *t, const TapeNode *node) {
    BatchnormCtx *c = node->ctx;
    if (tape_grad_take(t, node->in[0], node->out)) c->relu_mask = true;
    else if (c->no_output) /* the relu's own backward reads values that were never made */
        qt_error_set(&t->err, QT_ERR_ARG, "batchnorm relu: the output of nn_batchnorm_relu_view has a gradient "
                     "from a second reader (a view has exactly one)");
    else nn_relu_tape_backward(t, node);
}

Var *nn_batchnorm_relu_inplace(Tape *t, Var *y) {
    if (!y) return NULL;
    /* no gradient through y: its node was not recorded and neither is the relu's (the values are relu'd) */
    if (!y->requires_grad) {
        Var *r = tape_wrap(t, y->value.data, y->value.ndim, y->value.shape);
        if (r) r->view = y->view;
        return r;
    }
    BatchnormCtx *c = batchnorm_node_of(t, y);
    if (!c || !c->relu_fwd) {
        qt_error_set(&t->err, QT_ERR_ARG, "batchnorm relu: the input is not the output of a recorded "
                     "nn_batchnorm_relu (use nn_relu_inplace)");
        return NULL;
    }
    Var *r = tape_wrap(t, y->value.data, y->value.ndim, y->value.shape);
    if (!r) return NULL;
    r->view = y->view;
    return tape_record(t, "relu", batchnorm_relu_tape_backward, r, (Var *[]){y}, 1, c) ? r : NULL;
}

/* The output again from the input the node keeps, with the forward's own
 * mean, scale and beta: the same floats, bit for bit. */
static void batchnorm_remake(Tape *t, float *y, const void *ctx) {
    const BatchnormCtx *c = ctx;
    if (!tape_value_ready(t, c->x)) return;
    BatchnormJob j = {.c = c, .y = y, .x = c->x->value.data};
    batchnorm_run(&j, BN_JOB_REMAKE);
}

bool nn_batchnorm_remakeable(Tape *t, Var *y, Var *relu_out) {
    if (y->view) return false; /* never made in the first place */
    for (size_t i = t->n_nodes, seen = 0; i-- > 0 && seen < 4; seen++) {
        const TapeNode *n = &t->nodes[i];
        if (n->out != y) continue;
        if (n->backward != batchnorm_tape_backward) return false;
        BatchnormCtx *c = n->ctx;
        c->relu = relu_out != NULL || c->relu_fwd;
        return tape_remake_set(t, y, relu_out, batchnorm_remake, c);
    }
    return false;
}
