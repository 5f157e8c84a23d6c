#include "optim.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/ops.h" /* NN_SIMD_CLONES */

OptimConfig optim_config_default(OptimKind kind) {
    OptimConfig c = {.kind = kind, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    if (kind == OPTIM_ADAMW) {
        c.lr = 1e-3f;
        c.weight_decay = 0.01f;
    } else {
        c.lr = 0.01f;
    }
    return c;
}

static const char *const KIND_NAMES[] = {[OPTIM_SGD] = "sgd", [OPTIM_ADAMW] = "adamw"};
#define N_KINDS ((int)(sizeof KIND_NAMES / sizeof KIND_NAMES[0]))

const char *optim_kind_name(OptimKind kind) {
    return (int)kind >= 0 && (int)kind < N_KINDS ? KIND_NAMES[kind] : "unknown";
}

QtStatus optim_kind_parse(const char *name, OptimKind *out, QtError *err) {
    int k = 0;
    QtStatus st = qt_name_lookup("optimizer", name, KIND_NAMES, N_KINDS, &k, err);
    if (st == QT_OK) *out = (OptimKind)k;
    return st;
}

/* Written as !(x >= lo) so that NaN fails every check. */
static QtStatus validate_config(const OptimConfig *c, QtError *err) {
    const char *k = optim_kind_name(c->kind);
    if (c->kind != OPTIM_SGD && c->kind != OPTIM_ADAMW)
        return qt_error_set(err, QT_ERR_CONFIG, "optimizer config: kind %d is not sgd or adamw", (int)c->kind);
    if (!(c->lr >= 0.0f) || isinf(c->lr))
        return qt_error_set(err, QT_ERR_CONFIG, "%s config: lr = %g is invalid; it must be a finite number >= 0", k,
                            (double)c->lr);
    if (!(c->weight_decay >= 0.0f) || isinf(c->weight_decay))
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s config: weight_decay = %g is invalid; it must be a finite number >= 0", k,
                            (double)c->weight_decay);
    if (c->kind == OPTIM_ADAMW) {
        if (!(c->beta1 >= 0.0f && c->beta1 < 1.0f))
            return qt_error_set(err, QT_ERR_CONFIG, "adamw config: beta1 = %g is invalid; it must be in [0, 1)",
                                (double)c->beta1);
        if (!(c->beta2 >= 0.0f && c->beta2 < 1.0f))
            return qt_error_set(err, QT_ERR_CONFIG, "adamw config: beta2 = %g is invalid; it must be in [0, 1)",
                                (double)c->beta2);
        if (!(c->eps > 0.0f) || isinf(c->eps))
            return qt_error_set(err, QT_ERR_CONFIG, "adamw config: eps = %g is invalid; it must be a finite number > 0",
                                (double)c->eps);
        return QT_OK;
    }
    if (!(c->momentum >= 0.0f) || isinf(c->momentum))
        return qt_error_set(err, QT_ERR_CONFIG, "sgd config: momentum = %g is invalid; it must be a finite number >= 0",
                            (double)c->momentum);
    if (isnan(c->dampening) || isinf(c->dampening))
        return qt_error_set(err, QT_ERR_CONFIG, "sgd config: dampening = %g is invalid; it must be finite",
                            (double)c->dampening);
    if (c->nesterov && (c->momentum <= 0.0f || c->dampening != 0.0f))
        return qt_error_set(err, QT_ERR_CONFIG,
                            "sgd config: nesterov requires momentum > 0 and dampening == 0 (got momentum = %g, "
                            "dampening = %g)",
                            (double)c->momentum, (double)c->dampening);
    return QT_OK;
}

/* Counts the trainable params and checks each has the buffers a step needs. */
static QtStatus count_trainable(Param *const *params, int n_params, int *n_out, QtError *err) {
    if (n_params < 0 || (n_params > 0 && !params))
        return qt_error_set(err, QT_ERR_ARG, "optim_init: no params array (n_params = %d)", n_params);
    int n = 0;
    for (int i = 0; i < n_params; i++) {
        const Param *p = params[i];
        if (!p) return qt_error_set(err, QT_ERR_ARG, "optim_init: params[%d] is NULL", i);
        if (!p->trainable) continue;
        if (!p->var.value.data || !p->var.grad)
            return qt_error_set(err, QT_ERR_ARG, "optim_init: trainable param '%s' has no %s buffer", p->name,
                                p->var.value.data ? "grad" : "value");
        n++;
    }
    if (n == 0)
        return qt_error_set(err, QT_ERR_ARG, "optim_init: none of the %d params is trainable; nothing to optimize",
                            n_params);
    *n_out = n;
    return QT_OK;
}

/* One zeroed [numel] buffer per trainable param. */
static float **alloc_state(Param *const *params, int n) {
    float **s = calloc((size_t)n, sizeof *s);
    if (!s) return NULL;
    for (int i = 0; i < n; i++) {
        s[i] = calloc(var_numel(&params[i]->var), sizeof(float));
        if (!s[i]) {
            for (int j = 0; j < i; j++) free(s[j]);
            free(s);
            return NULL;
        }
    }
    return s;
}

static void free_state(float **s, int n) {
    if (!s) return;
    for (int i = 0; i < n; i++) free(s[i]);
    free(s);
}

QtStatus optim_init(Optimizer *o, const OptimConfig *cfg, Param *const *params, int n_params, QtError *err) {
    memset(o, 0, sizeof *o);
    if (!cfg) return qt_error_set(err, QT_ERR_ARG, "optim_init: no config");
    QtStatus st = validate_config(cfg, err);
    if (st != QT_OK) return st;
    int n = 0;
    if ((st = count_trainable(params, n_params, &n, err)) != QT_OK) return st;

    o->cfg = *cfg;
    o->n_params = n;
    o->params = malloc((size_t)n * sizeof *o->params);
    if (!o->params) goto nomem;
    for (int i = 0, j = 0; i < n_params; i++)
        if (params[i]->trainable) o->params[j++] = params[i];
    o->lr_scale = malloc((size_t)(n ? n : 1) * sizeof *o->lr_scale);
    if (!o->lr_scale) goto nomem;
    for (int i = 0; i < n; i++) o->lr_scale[i] = 1.0f;
    bool need_m = cfg->kind == OPTIM_ADAMW || cfg->momentum != 0.0f;
    if (need_m && !(o->m = alloc_state(o->params, n))) goto nomem;
    if (cfg->kind == OPTIM_ADAMW && !(o->v = alloc_state(o->params, n))) goto nomem;
    return QT_OK;

nomem:
    optim_free(o);
    return qt_error_set(err, QT_ERR_NOMEM, "optim_init: cannot allocate %s state for %d params",
                        optim_kind_name(cfg->kind), n);
}

void optim_free(Optimizer *o) {
    if (!o) return;
    free_state(o->m, o->n_params);
    free_state(o->v, o->n_params);
    free(o->params);
    free(o->lr_scale);
    memset(o, 0, sizeof *o);
}

/* Float scalars of one SGD step, as PyTorch casts its Python scalars. */
typedef struct {
    float wd;             /* d_p = g + wd*p */
    float buf_keep;       /* buf = buf*buf_keep + buf_take*d_p */
    float buf_take;
    float d_keep;         /* d_p = d_keep*d_p + d_mom*buf */
    float d_mom;
    float neg_lr;         /* p += neg_lr*d_p */
} SgdScalars;

/* PyTorch 1.13 _single_tensor_sgd:
 *   d_p = g + wd*p (only if wd != 0)
 *   buf = d_p on the first step, else buf*mom + (1-damp)*d_p
 *   d_p = nesterov ? d_p + mom*buf : buf;  p += -lr*d_p
 * The branches become scalars so the loop has no control flow and
 * vectorises: wd = 0 adds 0*p; the first step computes buf*0 + 1*d_p (buf
 * is zero from init); without nesterov d_p = 0*d_p + 1*buf. Each is exact
 * for finite values (at most the sign of a zero differs). */
static void sgd_update(float *restrict p, const float *restrict g, float *restrict buf, size_t n,
                       const SgdScalars *s) {
    const SgdScalars c = *s;
    if (!buf) {
        for (size_t i = 0; i < n; i++) p[i] = p[i] + c.neg_lr * (g[i] + c.wd * p[i]);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        float d = g[i] + c.wd * p[i];
        float b = buf[i] * c.buf_keep + c.buf_take * d;
        buf[i] = b;
        p[i] = p[i] + c.neg_lr * (c.d_keep * d + c.d_mom * b);
    }
}

/* Float scalars of one AdamW step. */
typedef struct {
    float decay;          /* 1 - lr*wd */
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float bc2_sqrt;       /* sqrt(1 - beta2^t) */
    float eps;
    float neg_step_size;  /* -lr / (1 - beta1^t) */
} AdamScalars;

/* PyTorch 1.13 _single_tensor_adamw, op by op:
 *   param.mul_(1 - lr*wd); exp_avg.mul_(b1).add_(g, alpha=1-b1);
 *   exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2);
 *   denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps);
 *   param.addcdiv_(exp_avg, denom, value=-step_size)   # p + (value*m)/denom */
/* The clones (AVX-512, AVX2, baseline) make the same IEEE operations in wider vectors, without contraction: the
 * same bits; the divisions and the square root per element were most of the step's serial time on the MLP. */
NN_SIMD_CLONES
static void adamw_update(float *restrict p, const float *restrict g, float *restrict m, float *restrict v, size_t n,
                         const AdamScalars *s) {
    const AdamScalars c = *s;
    for (size_t i = 0; i < n; i++) {
        float gi = g[i];
        float pi = p[i] * c.decay;
        float mi = m[i] * c.beta1 + c.one_minus_beta1 * gi;
        float vi = v[i] * c.beta2 + c.one_minus_beta2 * gi * gi;
        float denom = sqrtf(vi) / c.bc2_sqrt + c.eps;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi + c.neg_step_size * mi / denom;
    }
}

static SgdScalars sgd_scalars(const Optimizer *o, float lr) {
    const OptimConfig *c = &o->cfg;
    bool first = o->step == 0; /* PyTorch: the buffer is None until a param's first step */
    SgdScalars s = {
        .wd = c->weight_decay,
        .buf_keep = first ? 0.0f : c->momentum,
        .buf_take = first ? 1.0f : (float)(1.0 - (double)c->dampening),
        .d_keep = c->nesterov ? 1.0f : 0.0f,
        .d_mom = c->nesterov ? c->momentum : 1.0f,
        .neg_lr = -lr,
    };
    return s;
}

static void sgd_step(Optimizer *o, float lr) {
    SgdScalars shared = sgd_scalars(o, lr);
    for (int i = 0; i < o->n_params; i++) {
        Var *var = &o->params[i]->var;
        if (!var->grad) continue; /* frozen after optim_init: keeps its state, takes no step */
        SgdScalars own = o->lr_scale[i] != 1.0f ? sgd_scalars(o, lr * o->lr_scale[i]) : shared;
        sgd_update(var->value.data, var->grad, o->m ? o->m[i] : NULL, var_numel(var), &own);
    }
}

static AdamScalars adam_scalars(const Optimizer *o, float lr) {
    const OptimConfig *c = &o->cfg;
    /* PyTorch keeps the step as a float tensor and reads it back as a Python
     * float, so the powers and corrections are double arithmetic. */
    double t = (double)o->step;
    double bc1 = 1.0 - pow((double)c->beta1, t);
    double bc2 = 1.0 - pow((double)c->beta2, t);
    AdamScalars s = {
        .decay = (float)(1.0 - (double)lr * (double)c->weight_decay),
        .beta1 = c->beta1,
        .one_minus_beta1 = (float)(1.0 - (double)c->beta1),
        .beta2 = c->beta2,
        .one_minus_beta2 = (float)(1.0 - (double)c->beta2),
        .bc2_sqrt = (float)sqrt(bc2),
        .eps = c->eps,
        .neg_step_size = (float)(-((double)lr / bc1)),
    };
    return s;
}

/* Parameters of at least this many elements are updated by the pool in
 * contiguous ranges (the update is elementwise: the same result however
 * it is split); smaller ones in the calling thread. */
#define OPTIM_PARALLEL_MIN 32768

typedef struct {
    Optimizer *o;
    int i;              /* parameter index */
    AdamScalars s;
} AdamJob;

static void adamw_range_task(void *ctx, int task, int n_tasks) {
    const AdamJob *j = ctx;
    Var *var = &j->o->params[j->i]->var;
    int lo, hi;
    parallel_range((int)var_numel(var), task, n_tasks, &lo, &hi);
    adamw_update(var->value.data + lo, var->grad + lo, j->o->m[j->i] + lo, j->o->v[j->i] + lo, (size_t)(hi - lo),
                 &j->s);
}

static void adamw_step(Optimizer *o, float lr) {
    AdamScalars shared = adam_scalars(o, lr);
    for (int i = 0; i < o->n_params; i++) {
        Var *var = &o->params[i]->var;
        if (!var->grad) continue; /* frozen after optim_init: keeps its state, takes no step */
        AdamScalars own = o->lr_scale[i] != 1.0f ? adam_scalars(o, lr * o->lr_scale[i]) : shared;
        size_t n = var_numel(var);
        if (n >= OPTIM_PARALLEL_MIN && n <= INT_MAX) {
            AdamJob j = {o, i, own};
            parallel_run(parallel_get_threads(), adamw_range_task, &j);
        } else {
            adamw_update(var->value.data, var->grad, o->m[i], o->v[i], n, &own);
        }
    }
}

QtStatus optim_set_lr_scale(Optimizer *o, const Param *p, float scale, QtError *err) {
    if (!(scale >= 0.0f) || !isfinite(scale))
        return qt_error_set(err, QT_ERR_ARG, "%s: learning-rate factor %g must be a finite number >= 0", p->name,
                            (double)scale);
    for (int i = 0; i < o->n_params; i++)
        if (o->params[i] == p) {
            o->lr_scale[i] = scale;
            return QT_OK;
        }
    return qt_error_set(err, QT_ERR_ARG, "%s is not a parameter this optimizer trains", p->name);
}

void optim_step(Optimizer *o, float lr) {
    if (o->cfg.kind == OPTIM_ADAMW) {
        o->step++; /* AdamW's bias correction counts this step */
        adamw_step(o, lr);
    } else {
        sgd_step(o, lr); /* SGD needs the count before this step to spot the first */
        o->step++;
    }
}

void optim_zero_grad(Optimizer *o) {
    for (int i = 0; i < o->n_params; i++) {
        Var *var = &o->params[i]->var;
        if (var->grad) memset(var->grad, 0, var_numel(var) * sizeof(float));
    }
}

static bool has_grad(const Param *p) { return p && p->trainable && p->var.grad; }

/* The sum of g[j]^2 in double over eight interleaved chains (one chain would wait on the add latency per
 * element), combined in a fixed order; the clones hold the same chains in their lanes. */
NN_SIMD_CLONES
static double sumsq8(const float *g, size_t n) {
    double acc[8] = {0};
    size_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) acc[k] += (double)g[j + k] * (double)g[j + k];
    for (; j < n; j++) acc[0] += (double)g[j] * (double)g[j];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

double optim_grad_norm(Param *const *params, int n_params) {
    double sumsq = 0.0;
    for (int i = 0; i < n_params; i++)
        if (has_grad(params[i])) sumsq += sumsq8(params[i]->var.grad, var_numel(&params[i]->var));
    return sqrt(sumsq);
}

void optim_clip_grads_to_norm(Param *const *params, int n_params, double norm, float max_norm) {
    if (!(max_norm > 0.0f)) return;
    /* torch: clip_coef = max_norm / (total_norm + 1e-6) on a float tensor,
     * where `scalar / tensor` is tensor.reciprocal() * scalar; then
     * clamp(max=1) and multiply, so a coefficient >= 1 changes nothing (and a
     * NaN norm, as in torch, turns every grad into NaN). */
    float coef = (1.0f / ((float)norm + 1e-6f)) * max_norm;
    if (coef >= 1.0f) return;
    for (int i = 0; i < n_params; i++) {
        if (!has_grad(params[i])) continue;
        float *g = params[i]->var.grad;
        size_t n = var_numel(&params[i]->var);
        for (size_t j = 0; j < n; j++) g[j] *= coef;
    }
}

double optim_clip_grad_norm(Param *const *params, int n_params, float max_norm) {
    double norm = optim_grad_norm(params, n_params);
    optim_clip_grads_to_norm(params, n_params, norm, max_norm);
    return norm;
}

size_t optim_state_bytes(const Optimizer *o) {
    size_t floats = 0;
    for (int i = 0; i < o->n_params; i++) floats += var_numel(&o->params[i]->var);
    return floats * sizeof(float) * (size_t)((o->m != NULL) + (o->v != NULL));
}
