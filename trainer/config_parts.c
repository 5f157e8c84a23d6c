/* config_parts.c - the parts of the schema whose keys depend on a kind:
 * layers (per layer type), data transforms, optimizer and lr schedule. */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "config_schema.h"

#define BIT(k) (1u << (k))
#define LAYER_SIZE_MAX (1 << 20) /* units, out_channels */
#define LAYER_WINDOW_MAX 4096    /* kernel, stride, padding */

/* ---- layers ------------------------------------------------------------------ */

enum { LK_NAME, LK_TYPE, LK_UNITS, LK_OUT_CHANNELS, LK_KERNEL, LK_STRIDE, LK_PADDING, LK_P, LK_EPS, LK_BIAS, LK_INIT,
       LK_INIT_STD, LK_COUNT };
static const char *const LAYER_KEYS[LK_COUNT] = {
    [LK_NAME] = "name",       [LK_TYPE] = "type",     [LK_UNITS] = "units", [LK_OUT_CHANNELS] = "out_channels",
    [LK_KERNEL] = "kernel",   [LK_STRIDE] = "stride", [LK_PADDING] = "padding", [LK_P] = "p",
    [LK_EPS] = "eps",         [LK_BIAS] = "bias",     [LK_INIT] = "init",   [LK_INIT_STD] = "init_std",
};

static unsigned layer_keys(LayerType type) {
    const unsigned base = BIT(LK_NAME) | BIT(LK_TYPE), weights = BIT(LK_BIAS) | BIT(LK_INIT) | BIT(LK_INIT_STD);
    switch (type) {
    case LAYER_DENSE: return base | BIT(LK_UNITS) | weights;
    case LAYER_CONV2D: return base | BIT(LK_OUT_CHANNELS) | BIT(LK_KERNEL) | BIT(LK_STRIDE) | BIT(LK_PADDING) | weights;
    case LAYER_MAXPOOL2D:
    case LAYER_AVGPOOL2D: return base | BIT(LK_KERNEL) | BIT(LK_STRIDE);
    case LAYER_DROPOUT: return base | BIT(LK_P);
    case LAYER_LAYERNORM: return base | BIT(LK_EPS);
    default: return base;
    }
}

static QtStatus required_int(QtError *err, const YNode *m, const char *path, const char *key, int lo, int hi,
                             const LayerSpec *s, const char *what, int *out) {
    char full[96];
    if (!cfg_field(m, key))
        return cfg_fail(err, m, cfg_join(full, sizeof full, path, key), "missing; a %s layer needs %s %s",
                        layer_type_name(s->type), key, what);
    return cfg_get_int(err, m, path, key, lo, hi, out);
}

static QtStatus layer_name(QtError *err, const YNode *m, const char *path, int index, LayerSpec *s) {
    const YNode *v = cfg_field(m, "name");
    if (!v) {
        /* The name model_init would give it, written down so the config says what runs. */
        snprintf(s->name, sizeof s->name, "%s%d", layer_type_name(s->type), index);
        return QT_OK;
    }
    char full[96];
    cfg_join(full, sizeof full, path, "name");
    QtStatus st = cfg_to_str(err, v, full, false, s->name, sizeof s->name);
    if (st == QT_OK)
        st = cfg_check_name(err, v, full, s->name, "module names are group names in checkpoints and appear in rules");
    return st;
}

/* units, out_channels, kernel, stride, padding: required ones per type, and the stride default. */
static QtStatus layer_sizes(QtError *err, const YNode *m, const char *path, LayerSpec *s) {
    QtStatus st = QT_OK;
    switch (s->type) {
    case LAYER_DENSE: return required_int(err, m, path, "units", 1, LAYER_SIZE_MAX, s, "(its outputs)", &s->units);
    case LAYER_CONV2D:
        st = required_int(err, m, path, "out_channels", 1, LAYER_SIZE_MAX, s, "(its output channels)",
                          &s->out_channels);
        if (st == QT_OK) st = required_int(err, m, path, "kernel", 1, LAYER_WINDOW_MAX, s, "(its size)", &s->kernel);
        s->stride = 1;
        if (st == QT_OK) st = cfg_get_int(err, m, path, "stride", 1, LAYER_WINDOW_MAX, &s->stride);
        if (st == QT_OK) st = cfg_get_int(err, m, path, "padding", 0, LAYER_WINDOW_MAX, &s->padding);
        return st;
    case LAYER_MAXPOOL2D:
    case LAYER_AVGPOOL2D:
        st = required_int(err, m, path, "kernel", 1, LAYER_WINDOW_MAX, s, "(its window size)", &s->kernel);
        s->stride = s->kernel;
        if (st == QT_OK) st = cfg_get_int(err, m, path, "stride", 1, LAYER_WINDOW_MAX, &s->stride);
        return st;
    default: return QT_OK;
    }
}

/* p, eps, bias, init, init_std, with their defaults. */
static QtStatus layer_options(QtError *err, const YNode *m, const char *path, LayerSpec *s) {
    if (s->type == LAYER_DROPOUT) {
        s->p = 0.5f; /* PyTorch's default */
        return cfg_get_float(err, m, path, "p", (CfgRange){0.0, 1.0, false, true, true}, &s->p);
    }
    if (s->type == LAYER_LAYERNORM) {
        s->eps = 1e-5f;
        return cfg_get_float(err, m, path, "eps", CFG_POSITIVE, &s->eps);
    }
    if (s->type != LAYER_DENSE && s->type != LAYER_CONV2D) return QT_OK;
    bool bias = true;
    QtStatus st = cfg_get_bool(err, m, path, "bias", &bias);
    s->no_bias = !bias;
    const YNode *init = cfg_field(m, "init");
    char full[96], name[64];
    if (st == QT_OK && init) {
        cfg_join(full, sizeof full, path, "init");
        QtError inner = {0};
        st = cfg_to_str(err, init, full, false, name, sizeof name);
        if (st == QT_OK) st = cfg_lookup_fail(err, init, full, init_kind_parse(name, &s->init, &inner), &inner);
    }
    const YNode *std = cfg_field(m, "init_std");
    if (st == QT_OK && std && s->init != INIT_NORMAL)
        return cfg_fail(err, std, cfg_join(full, sizeof full, path, "init_std"),
                        "only applies with init: normal (this layer's init is %s)", init_kind_name(s->init));
    if (s->init == INIT_NORMAL) s->init_std = 0.02f;
    if (st == QT_OK) st = cfg_get_float(err, m, path, "init_std", CFG_POSITIVE, &s->init_std);
    return st;
}

QtStatus cfg_load_layer(QtError *err, const YNode *m, const char *path, int index, LayerSpec *s) {
    if (m->kind != YNODE_MAPPING)
        return cfg_fail_expected(err, m, path, "a layer mapping such as {type: dense, units: 10}", "");
    char full[96], name[64], owner[48];
    cfg_join(full, sizeof full, path, "type");
    const YNode *type = cfg_field(m, "type");
    if (!type) {
        /* A misspelt `type` is better reported as such than as missing. */
        QtStatus st = cfg_check_keys(err, m, path, LAYER_KEYS, LK_COUNT, BIT(LK_COUNT) - 1, "a layer");
        if (st != QT_OK) return st;
        char valid[256] = "";
        for (int t = 0; t < LAYER_COUNT; t++)
            snprintf(valid + strlen(valid), sizeof valid - strlen(valid), "%s%s", t ? ", " : "",
                     layer_type_name((LayerType)t));
        return cfg_fail(err, m, full, "missing; every layer needs a type (one of %s)", valid);
    }
    QtError inner = {0};
    QtStatus st = cfg_to_str(err, type, full, false, name, sizeof name);
    if (st == QT_OK) st = cfg_lookup_fail(err, type, full, layer_type_parse(name, &s->type, &inner), &inner);
    if (st != QT_OK) return st;
    snprintf(owner, sizeof owner, "a %s layer", layer_type_name(s->type));
    if (st == QT_OK) st = cfg_check_keys(err, m, path, LAYER_KEYS, LK_COUNT, layer_keys(s->type), owner);
    if (st == QT_OK) st = layer_name(err, m, path, index, s);
    if (st == QT_OK) st = layer_sizes(err, m, path, s);
    if (st == QT_OK) st = layer_options(err, m, path, s);
    return st;
}

/* ---- transforms ---------------------------------------------------------------- */

static const char *const NORMALIZE_KEYS[] = {"mean", "std"};

static QtStatus load_normalize(QtError *err, const YNode *arg, const char *path, Transform *t) {
    if (!arg || (arg->kind == YNODE_MAPPING && arg->n == 0)) return QT_OK; /* measured on the training set */
    if (arg->kind != YNODE_MAPPING)
        return cfg_fail_expected(err, arg, path, "nothing or a mapping {mean: M, std: S}", "");
    QtStatus st = cfg_check_keys(err, arg, path, NORMALIZE_KEYS, 2, 3u, "normalize");
    if (st != QT_OK) return st;
    if (!cfg_field(arg, "mean") || !cfg_field(arg, "std"))
        return cfg_fail(err, arg, path,
                        "needs both mean and std, or neither (to measure them on the training set)");
    t->stats_given = true;
    st = cfg_get_float(err, arg, path, "mean", CFG_ANY, &t->mean);
    if (st == QT_OK) st = cfg_get_float(err, arg, path, "std", CFG_POSITIVE, &t->std);
    return st;
}

static QtStatus load_classes(QtError *err, const YNode *arg, const char *path, Transform *t) {
    if (arg->kind != YNODE_SEQUENCE || arg->n == 0 || arg->n > DATASET_MAX_CLASSES)
        return cfg_fail_expected(err, arg, path, "a non-empty sequence of class labels, e.g. [0, 2, 4]", "");
    for (int j = 0; j < arg->n; j++) {
        char item[160];
        snprintf(item, sizeof item, "%s[%d]", path, j);
        int64_t x = 0;
        QtStatus st = cfg_to_int(err, arg->items[j], item, 0, DATASET_MAX_CLASSES - 1, &x);
        if (st != QT_OK) return st;
        for (int k = 0; k < j; k++)
            if (t->classes[k] == (int)x)
                return cfg_fail(err, arg->items[j], item, "class %d is listed twice (first as item %d)", (int)x, k);
        t->classes[j] = (int)x;
        t->n_classes = j + 1;
    }
    return QT_OK;
}

static QtStatus load_transform(QtError *err, const YNode *item, const char *path, Transform *t) {
    const YNode *name = NULL, *arg = NULL;
    if (item->kind == YNODE_SCALAR && !ynode_is_null(item)) {
        name = item;
    } else if (item->kind == YNODE_MAPPING && item->n == 1) {
        name = item->keys[0];
        arg = ynode_is_null(item->items[0]) ? NULL : item->items[0];
    } else {
        return cfg_fail_expected(err, item, path,
                                 "a transform: normalize, transpose, invert, or a single-key mapping such as "
                                 "{limit: 1000}",
                                 "");
    }
    QtError inner = {0};
    QtStatus st = cfg_lookup_fail(err, name, path, transform_kind_parse(name->text, &t->kind, &inner), &inner);
    if (st != QT_OK) return st;
    char full[128];
    cfg_join(full, sizeof full, path, transform_kind_name(t->kind));
    int64_t limit = 0;
    switch (t->kind) {
    case TRANSFORM_NORMALIZE: return load_normalize(err, arg, full, t);
    case TRANSFORM_TRANSPOSE:
    case TRANSFORM_INVERT:
        if (arg && !(arg->kind == YNODE_MAPPING && arg->n == 0))
            return cfg_fail_expected(err, arg, full, "no value (write just the name)", "");
        return QT_OK;
    case TRANSFORM_CLASSES:
        if (!arg) return cfg_fail(err, item, full, "missing the labels to keep, e.g. {classes: [0, 2, 4]}");
        return load_classes(err, arg, full, t);
    case TRANSFORM_LIMIT:
        if (!arg) return cfg_fail(err, item, full, "missing the number of examples, e.g. {limit: 1000}");
        st = cfg_to_int(err, arg, full, 1, INT_MAX, &limit);
        t->limit = (int)limit;
        return st;
    default: return cfg_fail(err, item, path, "unsupported transform");
    }
}

QtStatus cfg_load_transforms(QtError *err, const YNode *v, DataConfig *d) {
    if (!v) return QT_OK;
    if (v->kind != YNODE_SEQUENCE)
        return cfg_fail_expected(err, v, "data.transform", "a sequence of transforms, e.g. [{limit: 1000}, normalize]",
                                 "");
    if (v->n > CONFIG_MAX_TRANSFORMS)
        return cfg_fail(err, v, "data.transform", "expected at most %d transforms, got %d", CONFIG_MAX_TRANSFORMS,
                        v->n);
    for (int i = 0; i < v->n; i++) {
        char path[64];
        snprintf(path, sizeof path, "data.transform[%d]", i);
        QtStatus st = load_transform(err, v->items[i], path, &d->transforms[i]);
        if (st != QT_OK) return st;
        d->n_transforms = i + 1;
    }
    return QT_OK;
}

/* ---- optimizer ----------------------------------------------------------------- */

enum { OK_NAME, OK_LR, OK_WEIGHT_DECAY, OK_BETAS, OK_EPS, OK_MOMENTUM, OK_DAMPENING, OK_NESTEROV, OK_COUNT };
static const char *const OPTIM_KEYS[OK_COUNT] = {"name", "lr",       "weight_decay", "betas",
                                                 "eps",  "momentum", "dampening",    "nesterov"};

void cfg_optim_defaults(OptimConfig *o, OptimKind kind) {
    OptimConfig d = optim_config_default(kind);
    o->kind = d.kind;
    o->lr = d.lr;
    o->weight_decay = d.weight_decay;
    o->beta1 = d.beta1;
    o->beta2 = d.beta2;
    o->eps = d.eps;
    o->momentum = d.momentum;
    o->dampening = d.dampening;
    o->nesterov = d.nesterov;
}

static QtStatus load_betas(QtError *err, const YNode *m, OptimConfig *o) {
    const YNode *b = cfg_field(m, "betas");
    if (!b) return QT_OK;
    if (b->kind != YNODE_SEQUENCE || b->n != 2)
        return cfg_fail_expected(err, b, "train.optimizer.betas", "a sequence of two numbers [beta1, beta2]", "");
    float *dst[2] = {&o->beta1, &o->beta2};
    for (int j = 0; j < 2; j++) {
        char path[64];
        snprintf(path, sizeof path, "train.optimizer.betas[%d]", j);
        double x = 0;
        QtStatus st = cfg_to_number(err, b->items[j], path, (CfgRange){0.0, 1.0, false, true, true}, &x);
        if (st != QT_OK) return st;
        *dst[j] = (float)x;
    }
    return QT_OK;
}

/* The name first, so the kind's defaults apply to whatever keys are not given, in any key order. */
QtStatus cfg_load_optimizer(QtError *err, const YNode *train, OptimConfig *o) {
    const char *P = "train.optimizer";
    const YNode *m = NULL, *name = NULL;
    QtStatus st = cfg_section(err, train, "train", "optimizer", &m);
    OptimKind kind = OPTIM_ADAMW;
    if (st == QT_OK && (name = cfg_field(m, "name"))) {
        char buf[64];
        QtError inner = {0};
        st = cfg_to_str(err, name, "train.optimizer.name", false, buf, sizeof buf);
        if (st == QT_OK)
            st = cfg_lookup_fail(err, name, "train.optimizer.name", optim_kind_parse(buf, &kind, &inner), &inner);
    }
    if (st != QT_OK) return st;
    cfg_optim_defaults(o, kind);
    const unsigned common = BIT(OK_NAME) | BIT(OK_LR) | BIT(OK_WEIGHT_DECAY);
    unsigned allowed = kind == OPTIM_ADAMW ? common | BIT(OK_BETAS) | BIT(OK_EPS)
                                           : common | BIT(OK_MOMENTUM) | BIT(OK_DAMPENING) | BIT(OK_NESTEROV);
    char owner[48];
    snprintf(owner, sizeof owner, "the %s optimizer", optim_kind_name(kind));
    st = cfg_check_keys(err, m, P, OPTIM_KEYS, OK_COUNT, allowed, owner);
    if (st == QT_OK) st = cfg_get_float(err, m, P, "lr", CFG_NONNEG, &o->lr);
    if (st == QT_OK) st = cfg_get_float(err, m, P, "weight_decay", CFG_NONNEG, &o->weight_decay);
    if (kind == OPTIM_ADAMW) {
        if (st == QT_OK) st = load_betas(err, m, o);
        if (st == QT_OK) st = cfg_get_float(err, m, P, "eps", CFG_POSITIVE, &o->eps);
        return st;
    }
    if (st == QT_OK) st = cfg_get_float(err, m, P, "momentum", CFG_NONNEG, &o->momentum);
    if (st == QT_OK) st = cfg_get_float(err, m, P, "dampening", CFG_ANY, &o->dampening);
    if (st == QT_OK) st = cfg_get_bool(err, m, P, "nesterov", &o->nesterov);
    if (st == QT_OK && o->nesterov && (o->momentum <= 0.0f || o->dampening != 0.0f))
        st = cfg_fail(err, cfg_field(m, "nesterov"), "train.optimizer.nesterov",
                      "needs momentum > 0 and dampening 0, got momentum %g and dampening %g", (double)o->momentum,
                      (double)o->dampening);
    return st;
}

/* ---- lr schedule --------------------------------------------------------------- */

enum { SK_NAME, SK_WARMUP_STEPS, SK_MIN_LR, SK_STEP_SIZE, SK_GAMMA, SK_COUNT };
static const char *const SCHED_KEYS[SK_COUNT] = {"name", "warmup_steps", "min_lr", "step_size", "gamma"};

/* The checks that involve train.steps and the optimizer's lr. */
static QtStatus check_schedule(QtError *err, const YNode *train, const YNode *m, const TrainConfig *t) {
    const LrSchedule *s = &t->schedule;
    if (s->kind == SCHED_COSINE && s->min_lr > t->optim.lr)
        return cfg_fail(err, cfg_field(m, "min_lr"), "train.schedule.min_lr",
                        "expected at most train.optimizer.lr = %g for a cosine schedule, got %g", (double)t->optim.lr,
                        (double)s->min_lr);
    /* The library's own check as a backstop. A warmup longer than the run is not an error: the run clamps it
       (run_plan_steps), as only then is the run's length known. */
    LrSchedule probe = *s;
    probe.base_lr = t->optim.lr;
    probe.total_steps = s->warmup_steps;
    QtError inner = {0};
    if (lr_schedule_validate(&probe, &inner) == QT_OK) return QT_OK;
    const YNode *at = m ? m : train;
    if (!at) return qt_error_set(err, QT_ERR_CONFIG, "train.schedule: %s", inner.msg);
    return cfg_fail(err, at, "train.schedule", "%s", inner.msg);
}

QtStatus cfg_load_schedule(QtError *err, const YNode *train, TrainConfig *t) {
    const char *P = "train.schedule";
    LrSchedule *s = &t->schedule;
    const YNode *m = NULL, *name = NULL;
    QtStatus st = cfg_section(err, train, "train", "schedule", &m);
    if (st == QT_OK && (name = cfg_field(m, "name"))) {
        char buf[64];
        QtError inner = {0};
        st = cfg_to_str(err, name, "train.schedule.name", false, buf, sizeof buf);
        if (st == QT_OK)
            st = cfg_lookup_fail(err, name, "train.schedule.name", sched_kind_parse(buf, &s->kind, &inner), &inner);
    }
    if (st != QT_OK) return st;
    unsigned allowed = BIT(SK_NAME) | BIT(SK_WARMUP_STEPS);
    if (s->kind == SCHED_COSINE) allowed |= BIT(SK_MIN_LR);
    if (s->kind == SCHED_STEP) allowed |= BIT(SK_STEP_SIZE) | BIT(SK_GAMMA);
    char owner[48];
    snprintf(owner, sizeof owner, "the %s schedule", sched_kind_name(s->kind));
    st = cfg_check_keys(err, m, P, SCHED_KEYS, SK_COUNT, allowed, owner);
    if (st == QT_OK) st = cfg_get_i64(err, m, P, "warmup_steps", 0, INT64_MAX, &s->warmup_steps);
    if (st == QT_OK) st = cfg_get_float(err, m, P, "min_lr", CFG_NONNEG, &s->min_lr);
    if (st == QT_OK) st = cfg_get_float(err, m, P, "gamma", CFG_POSITIVE, &s->gamma);
    if (st == QT_OK && s->kind == SCHED_STEP && !cfg_field(m, "step_size"))
        st = cfg_fail(err, m ? m : train, "train.schedule.step_size",
                      "missing; the step schedule needs step_size (optimizer steps between lr drops)");
    if (st == QT_OK) st = cfg_get_i64(err, m, P, "step_size", 1, INT64_MAX, &s->step_size);
    if (st == QT_OK) st = check_schedule(err, train, m, t);
    return st;
}
