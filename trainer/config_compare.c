/* config_compare.c - what may change between a checkpoint's config and the
 * config that resumes it.
 *
 * The data order and the model are fixed by data.* (but not where the files
 * live), model.* (but not init_from, which a resume does not read),
 * run.seed and train.batch_size: a change there would silently train a
 * different run. Optimizer, schedule and clipping changes are legitimate
 * (a longer schedule, a lower lr for the rest of a run) but break
 * bit-identity with an uninterrupted run, so they are reported. */
#include <stdio.h>
#include <string.h>

#include "config.h"

static bool transforms_equal(const DataConfig *a, const DataConfig *b) {
    if (a->n_transforms != b->n_transforms) return false;
    for (int i = 0; i < a->n_transforms; i++) {
        const Transform *x = &a->transforms[i], *y = &b->transforms[i];
        if (x->kind != y->kind || x->stats_given != y->stats_given || x->mean != y->mean || x->std != y->std ||
            x->limit != y->limit || x->n_classes != y->n_classes ||
            memcmp(x->classes, y->classes, sizeof(int) * (size_t)x->n_classes) != 0)
            return false;
    }
    return true;
}

static bool layers_equal(const LayerSpec *a, const LayerSpec *b) {
    return a->type == b->type && strcmp(a->name, b->name) == 0 && a->units == b->units &&
           a->out_channels == b->out_channels && a->kernel == b->kernel && a->stride == b->stride &&
           a->padding == b->padding && a->p == b->p && a->eps == b->eps && a->no_bias == b->no_bias &&
           a->init == b->init && a->init_std == b->init_std;
}

static const char *first_fixed_difference(const Config *a, const Config *b, int *layer) {
    *layer = -1;
    if (strcmp(a->data.dataset, b->data.dataset) != 0) return "data.dataset";
    if (!transforms_equal(&a->data, &b->data)) return "data.transform";
    if (a->data.val_fraction != b->data.val_fraction) return "data.val_fraction";
    if (a->data.shuffle != b->data.shuffle) return "data.shuffle";
    if (a->data.drop_last != b->data.drop_last) return "data.drop_last";
    if (a->model.input_ndim != b->model.input_ndim ||
        memcmp(a->model.input_shape, b->model.input_shape, sizeof a->model.input_shape) != 0)
        return "model.input";
    if (a->model.n_layers != b->model.n_layers) return "model.layers";
    for (int i = 0; i < a->model.n_layers; i++)
        if (!layers_equal(&a->model.layers[i], &b->model.layers[i])) return *layer = i, "model.layers";
    if (a->run.seed != b->run.seed) return "run.seed";
    if (a->train.batch_size != b->train.batch_size) return "train.batch_size";
    return NULL;
}

static void append(char *buf, size_t cap, const char *key) {
    size_t len = strlen(buf);
    snprintf(buf + len, cap - len, "%s%s", len ? ", " : "", key);
}

void config_diff_for_resume(const Config *stored, const Config *now, char *fixed, size_t fixed_cap, char *changed,
                            size_t changed_cap) {
    int layer;
    const char *key = first_fixed_difference(stored, now, &layer);
    if (!key) fixed[0] = '\0';
    else if (layer >= 0) snprintf(fixed, fixed_cap, "%s[%d]", key, layer);
    else snprintf(fixed, fixed_cap, "%s", key);
    changed[0] = '\0';
    const OptimConfig *o = &stored->train.optim, *p = &now->train.optim;
    if (o->kind != p->kind) append(changed, changed_cap, "train.optimizer.name");
    if (o->lr != p->lr) append(changed, changed_cap, "train.optimizer.lr");
    if (o->weight_decay != p->weight_decay) append(changed, changed_cap, "train.optimizer.weight_decay");
    if (o->beta1 != p->beta1 || o->beta2 != p->beta2 || o->eps != p->eps)
        append(changed, changed_cap, "train.optimizer.betas/eps");
    if (o->momentum != p->momentum || o->dampening != p->dampening || o->nesterov != p->nesterov)
        append(changed, changed_cap, "train.optimizer.momentum/dampening/nesterov");
    const LrSchedule *s = &stored->train.schedule, *t = &now->train.schedule;
    if (s->kind != t->kind || s->warmup_steps != t->warmup_steps || s->min_lr != t->min_lr ||
        s->step_size != t->step_size || s->gamma != t->gamma)
        append(changed, changed_cap, "train.schedule");
    if (stored->train.epochs != now->train.epochs || stored->train.steps != now->train.steps)
        append(changed, changed_cap, "train.epochs/steps");
    if (stored->train.grad_clip != now->train.grad_clip) append(changed, changed_cap, "train.grad_clip");
}
