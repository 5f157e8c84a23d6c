/* config_compare.c - what may change between a checkpoint's config and the
 * config that resumes it: each table row says (CfgResume).
 *
 * The data order and the model are fixed by data.* (but not where the files
 * live, nor data.storage: where the images are held changes no value),
 * model.* (but not init_from and adapters_from, which a resume does not
 * read), run.seed, train.batch_size, and everything in quant and lora
 * (which modules are quantized how, which carry adapters of what shape):
 * a change there would silently train a different run. Optimizer, schedule and clipping changes are legitimate
 * (a longer schedule, a lower lr for the rest of a run) but break
 * bit-identity with an uninterrupted run, so they are reported. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "config_schema.h"

/* Whether a scalar row's field differs. */
static bool row_differs(const CfgKey *row, const void *sa, const void *sb) {
    const char *a = (const char *)sa + row->offset, *b = (const char *)sb + row->offset;
    switch (row->type) {
    case CFG_T_STR:
    case CFG_T_PATH:
    case CFG_T_NAME: return strcmp(a, b) != 0;
    case CFG_T_BOOL: return *(const bool *)a != *(const bool *)b;
    case CFG_T_INT:
    case CFG_T_ENUM: return *(const int *)a != *(const int *)b;
    case CFG_T_I64: return *(const int64_t *)a != *(const int64_t *)b;
    case CFG_T_U64: return *(const uint64_t *)a != *(const uint64_t *)b;
    case CFG_T_FLOAT: return *(const float *)a != *(const float *)b;
    case CFG_T_DOUBLE: return *(const double *)a != *(const double *)b;
    case CFG_T_FLOAT2:
        return *(const float *)a != *(const float *)b ||
               *(const float *)((const char *)sa + row->offset2) != *(const float *)((const char *)sb + row->offset2);
    default: return false;
    }
}

/* Every row of the layer table, and the bias (stored as no_bias). */
static bool layers_equal(const LayerSpec *a, const LayerSpec *b) {
    for (int i = 0; i < CFG_LAYER_TABLE.n; i++)
        if (CFG_LAYER_TABLE.keys[i].type != CFG_T_PART && row_differs(&CFG_LAYER_TABLE.keys[i], a, b)) return false;
    if (a->n_inputs != b->n_inputs) return false;
    for (int k = 0; k < a->n_inputs; k++)
        if (strcmp(a->inputs[k], b->inputs[k]) != 0) return false;
    return a->no_bias == b->no_bias && a->no_affine == b->no_affine && a->kernel_w == b->kernel_w &&
           a->stride_w == b->stride_w && a->padding_w == b->padding_w && a->dilation_w == b->dilation_w &&
           a->padding_same == b->padding_same;
}

int cfg_diff_transforms(const void *sa, const void *sb) {
    const DataConfig *a = sa, *b = sb;
    if (a->n_transforms != b->n_transforms) return -2;
    for (int i = 0; i < a->n_transforms; i++) {
        const Transform *x = &a->transforms[i], *y = &b->transforms[i];
        if (x->kind != y->kind || x->stats_given != y->stats_given || x->mean != y->mean || x->std != y->std ||
            x->n_stats != y->n_stats || x->per_channel != y->per_channel ||
            memcmp(x->means, y->means, sizeof(float) * (size_t)x->n_stats) != 0 ||
            memcmp(x->stds, y->stds, sizeof(float) * (size_t)x->n_stats) != 0 ||
            x->limit != y->limit || x->n_classes != y->n_classes ||
            memcmp(x->classes, y->classes, sizeof(int) * (size_t)x->n_classes) != 0)
            return -2;
    }
    return -1;
}

/* AugmentSpec's every byte is set (augment_spec_default), so the specs compare bytewise. */
int cfg_diff_augment(const void *sa, const void *sb) {
    const DataConfig *a = sa, *b = sb;
    if (a->augment.n != b->augment.n) return -2;
    return memcmp(a->augment.items, b->augment.items, sizeof(AugmentSpec) * (size_t)a->augment.n) == 0 ? -1 : -2;
}

int cfg_diff_anomaly(const void *sa, const void *sb) {
    const DataConfig *a = sa, *b = sb;
    bool same = a->n_anomaly_classes == b->n_anomaly_classes &&
                memcmp(a->anomaly_classes, b->anomaly_classes, sizeof(int) * (size_t)a->n_anomaly_classes) == 0;
    return same ? -1 : -2;
}

int cfg_diff_input(const void *sa, const void *sb) {
    const ModelConfig *a = sa, *b = sb;
    bool same = a->input_ndim == b->input_ndim && memcmp(a->input_shape, b->input_shape, sizeof a->input_shape) == 0;
    return same ? -1 : -2;
}

/* Rules compare by what they do; `where` (the file position) may differ. */
static bool matches_equal(const RuleMatch *a, const RuleMatch *b) {
    return strcmp(a->module_path, b->module_path) == 0 && a->op_types == b->op_types;
}

static bool calibs_equal(const CalibSpec *a, const CalibSpec *b) {
    return a->kind == b->kind && a->s == b->s && a->a == b->a && a->lo == b->lo && a->hi == b->hi && a->p == b->p &&
           a->fixed_minmax == b->fixed_minmax;
}

/* The match, every scalar row of the quant rule table, and the settings a row cannot hold. */
static bool quant_rules_equal(const QuantRule *a, const QuantRule *b) {
    for (int i = 0; i < CFG_QUANT_RULE_TABLE.n; i++)
        if (CFG_QUANT_RULE_TABLE.keys[i].type != CFG_T_PART && row_differs(&CFG_QUANT_RULE_TABLE.keys[i], a, b))
            return false;
    const QLayerSpec *x = &a->spec, *y = &b->spec;
    return matches_equal(&a->match, &b->match) && x->weight_qtype == y->weight_qtype &&
           calibs_equal(&x->weight_calib, &y->weight_calib) && x->symmetric == y->symmetric &&
           x->scale_type == y->scale_type && x->rounding == y->rounding && x->act_qtype == y->act_qtype &&
           calibs_equal(&x->act_calib, &y->act_calib) && x->act_symmetric == y->act_symmetric &&
           calibs_equal(&a->qat.amax_init, &b->qat.amax_init) && a->qt.bwd_qtype == b->qt.bwd_qtype &&
           calibs_equal(&a->qt.bwd_calib, &b->qt.bwd_calib) && a->qt.bwd_stochastic == b->qt.bwd_stochastic &&
           a->qt.noise_axes == b->qt.noise_axes;
}

/* The match, then every other row of the lora rule table. */
static bool lora_rules_equal(const LoraRule *a, const LoraRule *b) {
    if (!matches_equal(&a->match, &b->match)) return false;
    for (int i = 0; i < CFG_LORA_RULE_TABLE.n; i++)
        if (CFG_LORA_RULE_TABLE.keys[i].type != CFG_T_PART && row_differs(&CFG_LORA_RULE_TABLE.keys[i], a, b))
            return false;
    return true;
}

/* The first index where two rule lists differ (a rule added or removed
 * counts at its index), or -1. */
int cfg_diff_quant_rules(const void *sa, const void *sb) {
    const QuantConfig *a = sa, *b = sb;
    int n = a->n_rules < b->n_rules ? a->n_rules : b->n_rules;
    for (int i = 0; i < n; i++)
        if (!quant_rules_equal(&a->rules[i], &b->rules[i])) return i;
    return a->n_rules != b->n_rules ? n : -1;
}

int cfg_diff_lora_rules(const void *sa, const void *sb) {
    const LoraConfig *a = sa, *b = sb;
    int n = a->n_rules < b->n_rules ? a->n_rules : b->n_rules;
    for (int i = 0; i < n; i++)
        if (!lora_rules_equal(&a->rules[i], &b->rules[i])) return i;
    return a->n_rules != b->n_rules ? n : -1;
}

int cfg_diff_trainable(const void *sa, const void *sb) {
    const LoraConfig *a = sa, *b = sb;
    if (a->n_trainable != b->n_trainable) return -2;
    for (int i = 0; i < a->n_trainable; i++)
        if (strcmp(a->trainable[i], b->trainable[i]) != 0) return -2;
    return -1;
}

int cfg_diff_layers(const void *sa, const void *sb) {
    const ModelConfig *a = sa, *b = sb;
    if (a->n_layers != b->n_layers) return -2;
    for (int i = 0; i < a->n_layers; i++)
        if (!layers_equal(&a->layers[i], &b->layers[i])) return i;
    return -1;
}

/* The first fixed key of table t that differs, as "path.key" or "path.key[i]" in out; false if none. */
static bool first_fixed(const CfgTable *t, const void *a, const void *b, char *out, size_t cap) {
    for (int i = 0; i < t->n; i++) {
        const CfgKey *row = &t->keys[i];
        char path[128];
        snprintf(path, sizeof path, "%s%s%s", t->path, t->path[0] ? "." : "", row->key);
        if (row->type == CFG_T_SECTION) {
            if (first_fixed(row->sub, (const char *)a + row->offset, (const char *)b + row->offset, out, cap))
                return true;
            continue;
        }
        if (row->resume != CFG_RESUME_FIXED) continue;
        int d = row->type == CFG_T_PART ? row->part->diff(a, b) : row_differs(row, a, b) ? -2 : -1;
        if (d == -1) continue;
        if (d >= 0) snprintf(out, cap, "%s[%d]", path, d);
        else snprintf(out, cap, "%s", path);
        return true;
    }
    return false;
}

static void append(char *buf, size_t cap, const char *key) {
    size_t len = strlen(buf), n = strlen(key);
    for (const char *p = buf; (p = strstr(p, key)) != NULL; p += n) /* a group of keys is named once */
        if ((p == buf || p[-1] == ' ') && (p[n] == ',' || p[n] == '\0')) return;
    snprintf(buf + len, cap - len, "%s%s", len ? ", " : "", key);
}

/* The reported keys of t that differ, nested sections first (the optimizer's and the schedule's before the
 * run's length). */
static void reported(const CfgTable *t, const void *a, const void *b, char *out, size_t cap) {
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < t->n; i++) {
            const CfgKey *row = &t->keys[i];
            if ((row->type == CFG_T_SECTION) != (pass == 0)) continue;
            if (row->type == CFG_T_SECTION) {
                reported(row->sub, (const char *)a + row->offset, (const char *)b + row->offset, out, cap);
                continue;
            }
            if (row->resume != CFG_RESUME_REPORTED || !row_differs(row, a, b)) continue;
            char path[128];
            snprintf(path, sizeof path, "%s%s%s", t->path, t->path[0] ? "." : "", row->key);
            append(out, cap, row->resume_as ? row->resume_as : path);
        }
    }
}

void config_diff_for_resume(const Config *stored, const Config *now, char *fixed, size_t fixed_cap, char *changed,
                            size_t changed_cap) {
    /* When several differ, the data is named first, then the model. */
    static const char *const order[] = {"data", "model", "run", "train", "quant", "lora"};
    fixed[0] = '\0';
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        const CfgKey *row = cfg_table_row(&CFG_ROOT, order[i]);
        const char *a = (const char *)stored + row->offset, *b = (const char *)now + row->offset;
        if (first_fixed(row->sub, a, b, fixed, fixed_cap)) break;
    }
    changed[0] = '\0';
    reported(&CFG_ROOT, stored, now, changed, changed_cap);
}
