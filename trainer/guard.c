/* guard.c - non-finite values and divergence in a run (guard.h). */
#include "trainer/guard.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define FAST_DECAY 0.9  /* ~10 steps */
#define SLOW_DECAY 0.99 /* ~100 steps */

bool loss_watch_feed(LossWatch *w, double loss, double factor, double *fast_mean, double *slow_mean) {
    w->fast = FAST_DECAY * w->fast + (1.0 - FAST_DECAY) * loss;
    w->slow = SLOW_DECAY * w->slow + (1.0 - SLOW_DECAY) * loss;
    w->steps++;
    /* bias correction, as the means start from 0 */
    double t = (double)w->steps;
    *fast_mean = w->fast / (1.0 - pow(FAST_DECAY, t));
    *slow_mean = w->slow / (1.0 - pow(SLOW_DECAY, t));
    if (factor <= 0.0 || w->steps < LOSS_WATCH_WARMUP) return false;
    bool above = *fast_mean > factor * *slow_mean;
    bool starts = above && !w->diverging;
    w->diverging = above;
    w->occurrences += starts;
    return starts;
}

/* "conv1/weight" -> module "conv1", tensor "weight". */
static void param_where(const Param *p, char *module, size_t mcap, const char **tensor) {
    const char *slash = strrchr(p->name, '/');
    int len = slash ? (int)(slash - p->name) : (int)strlen(p->name);
    snprintf(module, mcap, "%.*s", len, p->name);
    *tensor = slash ? slash + 1 : "value";
}

static bool tensor_finite(const float *x, size_t n, size_t *bad) {
    *bad = floats_first_nonfinite(x, n);
    return *bad == n;
}

bool guard_grads_finite(Param *const *ps, int n, char *where, size_t cap) {
    int n_bad = 0, last = -1;
    size_t last_index = 0;
    for (int i = 0; i < n; i++) {
        const Var *v = &ps[i]->var;
        size_t bad;
        if (!v->grad || tensor_finite(v->grad, var_numel(v), &bad)) continue;
        n_bad++, last = i, last_index = bad;
    }
    if (n_bad == 0) return true;
    if (!where || cap == 0) return false;
    char module[PARAM_NAME_MAX];
    const char *tensor;
    param_where(ps[last], module, sizeof module, &tensor);
    snprintf(where, cap, "the gradient of module %s, tensor %s (%s) holds %g at index %zu; %d of %d trainable "
             "tensors have non-finite gradients", module, tensor, ps[last]->name,
             (double)ps[last]->var.grad[last_index], last_index, n_bad, n);
    return false;
}

/* A parameter of the model whose value is not finite (a released, quantized
 * weight has no float values to look at). */
static bool param_values_finite(const Param *p, char *where, size_t cap) {
    size_t bad;
    if (!p || p->released || tensor_finite(p->var.value.data, var_numel(&p->var), &bad)) return true;
    if (!where || cap == 0) return false;
    char module[PARAM_NAME_MAX];
    const char *tensor;
    param_where(p, module, sizeof module, &tensor);
    snprintf(where, cap, "module %s, tensor %s holds %g at index %zu: the parameters themselves are no longer finite",
             module, tensor, (double)p->var.value.data[bad], bad);
    return false;
}

bool guard_params_finite(Param *const *ps, int n, char *where, size_t cap) {
    for (int i = 0; i < n; i++)
        if (!param_values_finite(ps[i], where, cap)) return false;
    return true;
}

void guard_locate_nonfinite_forward(Model *m, Tape *t, Var *x, Param *const *ps, int n, char *where, size_t cap) {
    size_t bad;
    if (!tensor_finite(x->value.data, var_numel(x), &bad)) {
        snprintf(where, cap, "the input batch holds %g at index %zu", (double)x->value.data[bad], bad);
        return;
    }
    for (int i = 0; i < n; i++)
        if (!param_values_finite(ps[i], where, cap)) return;
    bool training = t->training, grad = t->grad_enabled;
    t->training = false, t->grad_enabled = false;
    snprintf(where, cap, "the forward pass run again in inference mode is finite: the non-finite value comes from "
             "a training-only op (dropout, a batch norm's batch statistics) or from the loss");
    /* Module by module, each on the outputs it reads (the model may be a DAG), none fused. */
    m->outs[0] = x;
    for (int i = 0; i < m->n_modules; i++) {
        Module *mod = &m->modules[i];
        if (!param_values_finite(mod->weight, where, cap) || !param_values_finite(mod->bias, where, cap)) break;
        Var *y = model_step(m, t, i, m->outs);
        if (!y) {
            snprintf(where, cap, "the forward pass could not be run again (%s)", t->err.msg);
            break;
        }
        if (!tensor_finite(y->value.data, var_numel(y), &bad)) {
            snprintf(where, cap, "module %s (%s) gives %g at output index %zu from finite inputs and parameters "
                     "(an overflow)", mod->path, layer_type_name(mod->spec.type), (double)y->value.data[bad], bad);
            break;
        }
    }
    t->training = training, t->grad_enabled = grad;
}
