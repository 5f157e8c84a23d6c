/* config_compare.c - what may change between a checkpoint's config and the
 * config that resumes it.
 *
 * The data order and the model are fixed by data.* (but not where the files
 * live, nor data.storage: where the images are held changes no value),
 * model.* (but not init_from and adapters_from, which a resume does not
 * read), run.seed, train.batch_size, and everything in quant and lora
 * (which modules are quantized how, which carry adapters of what shape):
 * a change there would silently train a different run. Optimizer, schedule and clipping changes are legitimate
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

/* Rules compare by what they do; `where` (the file position) may differ. */
static bool matches_equal(const RuleMatch *a, const RuleMatch *b) {
    return strcmp(a->module_path, b->module_path) == 0 && a->op_types == b->op_types;
}

static bool calibs_equal(const CalibSpec *a, const CalibSpec *b) {
    return a->kind == b->kind && a->s == b->s && a->a == b->a && a->lo == b->lo && a->hi == b->hi && a->p == b->p &&
           a->fixed_minmax == b->fixed_minmax;
}

static bool quant_rules_equal(const QuantRule *a, const QuantRule *b) {
    const QLayerSpec *x = &a->spec, *y = &b->spec;
    return matches_equal(&a->match, &b->match) && a->skip == b->skip && x->weight_qtype == y->weight_qtype &&
           x->tile_size == y->tile_size && x->per_tensor == y->per_tensor &&
           calibs_equal(&x->weight_calib, &y->weight_calib) && x->symmetric == y->symmetric &&
           x->narrow_range == y->narrow_range && x->scale_type == y->scale_type && x->double_quant == y->double_quant &&
           x->rounding == y->rounding && a->allow_clip == b->allow_clip &&
           x->act_qtype == y->act_qtype && calibs_equal(&x->act_calib, &y->act_calib) &&
           x->act_symmetric == y->act_symmetric && a->qat.learn_amax == b->qat.learn_amax &&
           calibs_equal(&a->qat.amax_init, &b->qat.amax_init) && a->qat.act_static_scale == b->qat.act_static_scale &&
           a->qat.lr == b->qat.lr && a->qt.bwd_qtype == b->qt.bwd_qtype &&
           calibs_equal(&a->qt.bwd_calib, &b->qt.bwd_calib) &&
           a->qt.bwd_weight_grad_tile_size == b->qt.bwd_weight_grad_tile_size &&
           a->qt.bwd_stochastic == b->qt.bwd_stochastic && a->qt.noise_axes == b->qt.noise_axes;
}

static bool lora_rules_equal(const LoraRule *a, const LoraRule *b) {
    const LoraSpec *x = &a->spec, *y = &b->spec;
    return matches_equal(&a->match, &b->match) && a->skip == b->skip && x->rank == y->rank && x->alpha == y->alpha &&
           x->dropout == y->dropout && x->rslora == y->rslora && x->init == y->init;
}

/* The first index where two rule lists differ (a rule added or removed
 * counts at its index), or -1. */
static int quant_rules_difference(const QuantConfig *a, const QuantConfig *b) {
    int n = a->n_rules < b->n_rules ? a->n_rules : b->n_rules;
    for (int i = 0; i < n; i++)
        if (!quant_rules_equal(&a->rules[i], &b->rules[i])) return i;
    return a->n_rules != b->n_rules ? n : -1;
}

static int lora_rules_difference(const LoraConfig *a, const LoraConfig *b) {
    int n = a->n_rules < b->n_rules ? a->n_rules : b->n_rules;
    for (int i = 0; i < n; i++)
        if (!lora_rules_equal(&a->rules[i], &b->rules[i])) return i;
    return a->n_rules != b->n_rules ? n : -1;
}

static bool trainable_equal(const LoraConfig *a, const LoraConfig *b) {
    if (a->n_trainable != b->n_trainable) return false;
    for (int i = 0; i < a->n_trainable; i++)
        if (strcmp(a->trainable[i], b->trainable[i]) != 0) return false;
    return true;
}

static const char *first_fixed_difference(const Config *a, const Config *b, int *index) {
    *index = -1;
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
        if (!layers_equal(&a->model.layers[i], &b->model.layers[i])) return *index = i, "model.layers";
    if (a->run.seed != b->run.seed) return "run.seed";
    if (a->train.batch_size != b->train.batch_size) return "train.batch_size";
    if (a->quant.mode != b->quant.mode) return "quant.mode";
    if (a->quant.calibration_batches != b->quant.calibration_batches) return "quant.calibration_batches";
    if ((*index = quant_rules_difference(&a->quant, &b->quant)) >= 0) return "quant.rules";
    if ((*index = lora_rules_difference(&a->lora, &b->lora)) >= 0) return "lora.rules";
    if (!trainable_equal(&a->lora, &b->lora)) return "lora.trainable";
    return NULL;
}

static void append(char *buf, size_t cap, const char *key) {
    size_t len = strlen(buf);
    snprintf(buf + len, cap - len, "%s%s", len ? ", " : "", key);
}

void config_diff_for_resume(const Config *stored, const Config *now, char *fixed, size_t fixed_cap, char *changed,
                            size_t changed_cap) {
    int index;
    const char *key = first_fixed_difference(stored, now, &index);
    if (!key) fixed[0] = '\0';
    else if (index >= 0) snprintf(fixed, fixed_cap, "%s[%d]", key, index);
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
