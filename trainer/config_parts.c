/* config_parts.c - the parts of the schema a table row cannot express:
 * a layer (whose defaults and required keys follow its type; its keys and
 * ranges are CFG_LAYER_TABLE's rows) and the data transforms. */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "config_schema.h"

#define T (&CFG_LAYER_TABLE)

/* ---- layers ------------------------------------------------------------------ */

static QtStatus required_int(QtError *err, const YNode *m, const char *path, const char *key, LayerSpec *s,
                             const char *what) {
    char full[96];
    if (!cfg_field(m, key))
        return cfg_fail(err, m, cfg_join(full, sizeof full, path, key), "missing; a %s layer needs %s %s",
                        layer_type_name(s->type), key, what);
    return cfg_load_key(err, m, path, T, key, s);
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

/* inputs: a sequence of layer names (resolved by model_init, which knows the layers before this one). */
static QtStatus layer_inputs(QtError *err, const YNode *m, const char *path, LayerSpec *s) {
    const YNode *v = cfg_field(m, "inputs");
    if (!v) return QT_OK;
    char full[96];
    cfg_join(full, sizeof full, path, "inputs");
    if (v->kind != YNODE_SEQUENCE || v->n < 1 || v->n > LAYER_INPUTS_MAX)
        return cfg_fail_expected(err, v, full, "a sequence of 1 to 8 names of earlier layers, e.g. [conv1, input]",
                                 v->kind == YNODE_SEQUENCE ? " (of another length)" : "");
    for (int j = 0; j < v->n; j++) {
        char item[112];
        snprintf(item, sizeof item, "%s[%d]", full, j);
        QtStatus st = cfg_to_str(err, v->items[j], item, false, s->inputs[j], sizeof s->inputs[j]);
        if (st == QT_OK) st = cfg_check_name(err, v->items[j], item, s->inputs[j], "it names an earlier layer");
        if (st != QT_OK) return st;
    }
    s->n_inputs = v->n;
    return QT_OK;
}

/* A conv2d's kernel, stride, padding or dilation: an int (both axes) or [h, w], each in the row's range; padding
 * may also be `same` (*same set). An absent key leaves *h and *w as they are. */
static QtStatus load_hw(QtError *err, const YNode *m, const char *path, const char *key, int *h, int *w, bool *same) {
    const YNode *v = cfg_field(m, key);
    if (!v) return QT_OK;
    const CfgKey *row = cfg_table_row(T, key);
    char full[96], item[112];
    cfg_join(full, sizeof full, path, key);
    if (same && v->kind == YNODE_SCALAR && strcmp(v->text, "same") == 0) {
        *same = true;
        *h = *w = 0;
        return QT_OK;
    }
    int64_t x[2];
    if (v->kind == YNODE_SEQUENCE) {
        if (v->n != 2)
            return cfg_fail_expected(err, v, full, same ? "an int, [h, w] or same" : "an int or [h, w]",
                                     " (a sequence of another length)");
        for (int j = 0; j < 2; j++) {
            snprintf(item, sizeof item, "%s[%d]", full, j);
            QtStatus st = cfg_to_int(err, v->items[j], item, row->imin, row->imax, &x[j]);
            if (st != QT_OK) return st;
        }
    } else {
        if (same && v->kind == YNODE_SCALAR && v->text && (v->text[0] < '0' || v->text[0] > '9') &&
            v->text[0] != '-' && v->text[0] != '+')
            return cfg_fail_expected(err, v, full, "an int, [h, w] or same", "");
        QtStatus st = cfg_to_int(err, v, full, row->imin, row->imax, &x[0]);
        if (st != QT_OK) return st;
        x[1] = x[0];
    }
    *h = (int)x[0];
    *w = (int)x[1];
    return QT_OK;
}

/* A conv2d's geometry: kernel (required), stride, padding, dilation, groups. */
static QtStatus conv_geometry(QtError *err, const YNode *m, const char *path, LayerSpec *s) {
    char full[96];
    if (!cfg_field(m, "kernel"))
        return cfg_fail(err, m, cfg_join(full, sizeof full, path, "kernel"),
                        "missing; a conv2d layer needs kernel (its size: an int or [h, w])");
    s->stride = s->stride_w = 1;
    s->dilation = s->dilation_w = 1;
    s->groups = 1;
    QtStatus st = load_hw(err, m, path, "kernel", &s->kernel, &s->kernel_w, NULL);
    if (st == QT_OK) st = load_hw(err, m, path, "stride", &s->stride, &s->stride_w, NULL);
    if (st == QT_OK) st = load_hw(err, m, path, "padding", &s->padding, &s->padding_w, &s->padding_same);
    if (st == QT_OK) st = load_hw(err, m, path, "dilation", &s->dilation, &s->dilation_w, NULL);
    if (st == QT_OK) st = cfg_load_key(err, m, path, T, "groups", s);
    return st;
}

/* units, out_channels, kernel, stride, padding: required ones per type, and the stride default. */
static QtStatus layer_sizes(QtError *err, const YNode *m, const char *path, LayerSpec *s) {
    QtStatus st = QT_OK;
    switch (s->type) {
    case LAYER_DENSE: return required_int(err, m, path, "units", s, "(its outputs)");
    case LAYER_CONV2D:
        st = required_int(err, m, path, "out_channels", s, "(its output channels)");
        if (st == QT_OK) st = conv_geometry(err, m, path, s);
        return st;
    case LAYER_MAXPOOL2D:
    case LAYER_AVGPOOL2D:
        st = required_int(err, m, path, "kernel", s, "(its window size)");
        s->stride = s->kernel;
        if (st == QT_OK) st = cfg_load_key(err, m, path, T, "stride", s);
        return st;
    default: return QT_OK;
    }
}

/* p, eps, bias, init, init_std, with their defaults. */
static QtStatus layer_options(QtError *err, const YNode *m, const char *path, LayerSpec *s) {
    if (s->type == LAYER_DROPOUT) {
        s->p = (float)cfg_table_row(T, "p")->def; /* PyTorch's default */
        return cfg_load_key(err, m, path, T, "p", s);
    }
    if (s->type == LAYER_LAYERNORM) {
        s->eps = (float)cfg_table_row(T, "eps")->def;
        return cfg_load_key(err, m, path, T, "eps", s);
    }
    if (s->type == LAYER_BATCHNORM1D || s->type == LAYER_BATCHNORM2D) {
        s->eps = (float)cfg_table_row(T, "eps")->def;
        s->momentum = (float)cfg_table_row(T, "momentum")->def;
        bool affine = true;
        QtStatus st = cfg_load_key(err, m, path, T, "eps", s);
        if (st == QT_OK) st = cfg_load_key(err, m, path, T, "momentum", s);
        if (st == QT_OK) st = cfg_get_bool(err, m, path, "affine", &affine);
        s->no_affine = !affine;
        return st;
    }
    if (s->type != LAYER_DENSE && s->type != LAYER_CONV2D) return QT_OK;
    bool bias = true;
    QtStatus st = cfg_get_bool(err, m, path, "bias", &bias);
    s->no_bias = !bias;
    char full[96];
    if (st == QT_OK) st = cfg_load_key(err, m, path, T, "init", s);
    const YNode *std = cfg_field(m, "init_std");
    if (st == QT_OK && std && s->init != INIT_NORMAL)
        return cfg_fail(err, std, cfg_join(full, sizeof full, path, "init_std"),
                        "only applies with init: normal (this layer's init is %s)", init_kind_name(s->init));
    if (s->init == INIT_NORMAL) s->init_std = (float)cfg_table_row(T, "init_std")->def;
    if (st == QT_OK) st = cfg_load_key(err, m, path, T, "init_std", s);
    return st;
}

QtStatus cfg_load_layer(QtError *err, const YNode *m, const char *path, int index, LayerSpec *s) {
    if (m->kind != YNODE_MAPPING)
        return cfg_fail_expected(err, m, path, "a layer mapping such as {type: dense, units: 10}", "");
    char full[96], owner[48];
    cfg_join(full, sizeof full, path, "type");
    const YNode *type = cfg_field(m, "type");
    if (!type) {
        /* A misspelt `type` is better reported as such than as missing. */
        QtStatus st = cfg_check_table_keys(err, m, T, path, -1, "a layer");
        if (st != QT_OK) return st;
        char valid[256] = "";
        for (int t = 0; t < LAYER_COUNT; t++)
            snprintf(valid + strlen(valid), sizeof valid - strlen(valid), "%s%s", t ? ", " : "",
                     layer_type_name((LayerType)t));
        return cfg_fail(err, m, full, "missing; every layer needs a type (one of %s)", valid);
    }
    QtStatus st = cfg_load_key(err, m, path, T, "type", s);
    if (st != QT_OK) return st;
    snprintf(owner, sizeof owner, T->owner, layer_type_name(s->type));
    if (st == QT_OK) st = cfg_check_table_keys(err, m, T, path, (int)s->type, owner);
    if (st == QT_OK) st = layer_name(err, m, path, index, s);
    if (st == QT_OK) st = layer_inputs(err, m, path, s);
    if (st == QT_OK) st = layer_sizes(err, m, path, s);
    if (st == QT_OK) st = layer_options(err, m, path, s);
    return st;
}

/* ---- transforms ---------------------------------------------------------------- */

static const char *const NORMALIZE_KEYS[] = {"mean", "std", "per_channel"};

/* normalize's mean and std as lists, one value per channel. */
static QtStatus load_normalize_lists(QtError *err, const YNode *arg, const char *path, Transform *t) {
    const YNode *m = cfg_field(arg, "mean"), *s = cfg_field(arg, "std");
    if (m->kind != YNODE_SEQUENCE || s->kind != YNODE_SEQUENCE || m->n != s->n || m->n < 1 ||
        m->n > DATASET_MAX_CHANNELS)
        return cfg_fail(err, m->kind == YNODE_SEQUENCE ? s : m, path,
                        "mean and std must both be numbers, or both lists of one value per channel (1 to %d, the "
                        "same length)", DATASET_MAX_CHANNELS);
    for (int c = 0; c < m->n; c++) {
        char item[160];
        snprintf(item, sizeof item, "%s.mean[%d]", path, c);
        double mv = 0, sv = 0;
        QtStatus st = cfg_to_number(err, m->items[c], item, CFG_ANY, &mv);
        snprintf(item, sizeof item, "%s.std[%d]", path, c);
        if (st == QT_OK) st = cfg_to_number(err, s->items[c], item, CFG_POSITIVE, &sv);
        if (st != QT_OK) return st;
        t->means[c] = (float)mv, t->stds[c] = (float)sv;
    }
    t->n_stats = m->n;
    return QT_OK;
}

static QtStatus load_normalize(QtError *err, const YNode *arg, const char *path, Transform *t) {
    if (!arg || (arg->kind == YNODE_MAPPING && arg->n == 0)) return QT_OK; /* measured on the training set */
    if (arg->kind != YNODE_MAPPING)
        return cfg_fail_expected(err, arg, path, "nothing or a mapping {mean: M, std: S}", "");
    QtStatus st = cfg_check_keys(err, arg, path, NORMALIZE_KEYS, 3, 7u, "normalize");
    if (st != QT_OK) return st;
    const bool m = cfg_field(arg, "mean") != NULL, s = cfg_field(arg, "std") != NULL;
    if (cfg_field(arg, "per_channel")) {
        if (m || s)
            return cfg_fail(err, cfg_field(arg, "per_channel"), path,
                            "per_channel measures the statistics; with mean and std given, give lists instead");
        return cfg_get_bool(err, arg, path, "per_channel", &t->per_channel);
    }
    if (!m || !s)
        return cfg_fail(err, arg, path,
                        "needs both mean and std, or neither (to measure them on the training set)");
    t->stats_given = true;
    if (cfg_field(arg, "mean")->kind == YNODE_SEQUENCE || cfg_field(arg, "std")->kind == YNODE_SEQUENCE)
        return load_normalize_lists(err, arg, path, t);
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

/* A list item that is a name (`normalize`) or a single-key mapping ({limit: 1000}): *name and *arg (NULL for
 * none). false for anything else; the caller says what it expected. */
static bool item_name_arg(const YNode *item, const YNode **name, const YNode **arg) {
    *name = *arg = NULL;
    if (item->kind == YNODE_SCALAR && !ynode_is_null(item)) {
        *name = item;
        return true;
    }
    if (item->kind != YNODE_MAPPING || item->n != 1) return false;
    *name = item->keys[0];
    *arg = ynode_is_null(item->items[0]) ? NULL : item->items[0];
    return true;
}

static QtStatus load_transform(QtError *err, const YNode *item, const char *path, Transform *t) {
    const YNode *name, *arg;
    if (!item_name_arg(item, &name, &arg))
        return cfg_fail_expected(err, item, path,
                                 "a transform: normalize, transpose, invert, or a single-key mapping such as "
                                 "{limit: 1000}",
                                 "");
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

QtStatus cfg_part_load_transforms(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx) {
    (void)map, (void)ctx;
    DataConfig *d = section;
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

/* ---- augmentation ---------------------------------------------------------------- */

#define AUGMENT_SIZE_MAX 65536 /* model.input's largest dimension */
#define PROBABILITY ((CfgRange){0.0, 1.0, false, false, true})
#define ERASE_SCALE ((CfgRange){0.0, 1.0, true, false, true})      /* (0, 1] */
#define ERASE_RATIO ((CfgRange){0.0, INFINITY, true, false, true}) /* > 0 */
#define ANY_FLOAT ((CfgRange){-INFINITY, INFINITY, false, false, true})

static const char *const CROP_KEYS[] = {"size", "padding"};
static const char *const HFLIP_KEYS[] = {"p"};
static const char *const ERASE_KEYS[] = {"p", "scale", "ratio", "value"};

/* random_crop's size: an int (square) or [h, w]. */
static QtStatus load_crop_size(QtError *err, const YNode *arg, const char *path, AugmentSpec *s) {
    char full[160], item[176];
    const YNode *v = cfg_field(arg, "size");
    cfg_join(full, sizeof full, path, "size");
    if (!v) return cfg_fail(err, arg, full, "missing; random_crop needs the crop's size (an int or [h, w])");
    int64_t x[2];
    if (v->kind == YNODE_SEQUENCE) {
        if (v->n != 2) return cfg_fail_expected(err, v, full, "an int or [h, w]", " (a sequence of another length)");
        for (int j = 0; j < 2; j++) {
            snprintf(item, sizeof item, "%s[%d]", full, j);
            QtStatus st = cfg_to_int(err, v->items[j], item, 1, AUGMENT_SIZE_MAX, &x[j]);
            if (st != QT_OK) return st;
        }
    } else {
        QtStatus st = cfg_to_int(err, v, full, 1, AUGMENT_SIZE_MAX, &x[0]);
        if (st != QT_OK) return st;
        x[1] = x[0];
    }
    s->size_h = (int)x[0], s->size_w = (int)x[1];
    return QT_OK;
}

/* random_erase's scale or ratio: [min, max], each in r, min <= max. Absent: the default stays. */
static QtStatus load_range_pair(QtError *err, const YNode *arg, const char *path, const char *key, CfgRange r,
                                float out[2]) {
    const YNode *v = cfg_field(arg, key);
    if (!v) return QT_OK;
    char full[160], item[176];
    cfg_join(full, sizeof full, path, key);
    if (v->kind != YNODE_SEQUENCE || v->n != 2)
        return cfg_fail_expected(err, v, full, "[min, max]", v->kind == YNODE_SEQUENCE ? " (of another length)" : "");
    double x[2];
    for (int j = 0; j < 2; j++) {
        snprintf(item, sizeof item, "%s[%d]", full, j);
        QtStatus st = cfg_to_number(err, v->items[j], item, r, &x[j]);
        if (st != QT_OK) return st;
    }
    if (x[0] > x[1]) return cfg_fail(err, v, full, "min %g is larger than max %g; write [min, max]", x[0], x[1]);
    out[0] = (float)x[0], out[1] = (float)x[1];
    return QT_OK;
}

static QtStatus load_augment(QtError *err, const YNode *item, const char *path, AugmentSpec *s) {
    const YNode *name, *arg;
    if (!item_name_arg(item, &name, &arg))
        return cfg_fail_expected(err, item, path,
                                 "an augmentation: hflip, random_erase, or a single-key mapping such as "
                                 "{random_crop: {size: 28, padding: 4}}",
                                 "");
    AugmentKind kind = AUGMENT_HFLIP;
    QtError inner = {0};
    QtStatus st = cfg_lookup_fail(err, name, path, augment_kind_parse(name->text, &kind, &inner), &inner);
    if (st != QT_OK) return st;
    augment_spec_default(s, kind);
    char full[128];
    cfg_join(full, sizeof full, path, augment_kind_name(kind));
    if (arg && arg->kind != YNODE_MAPPING)
        return cfg_fail_expected(err, arg, full,
                                 kind == AUGMENT_RANDOM_CROP ? "a mapping {size: S, padding: P}"
                                                             : "nothing or a mapping",
                                 "");
    int64_t padding = 0;
    switch (kind) {
    case AUGMENT_RANDOM_CROP:
        if (!arg)
            return cfg_fail(err, item, full, "missing the crop's size, e.g. {random_crop: {size: 28, padding: 4}}");
        st = cfg_check_keys(err, arg, full, CROP_KEYS, 2, 3u, "random_crop");
        if (st == QT_OK) st = load_crop_size(err, arg, full, s);
        if (st == QT_OK && cfg_field(arg, "padding")) {
            char key[160];
            st = cfg_to_int(err, cfg_field(arg, "padding"), cfg_join(key, sizeof key, full, "padding"), 0,
                            AUGMENT_SIZE_MAX, &padding);
            s->padding = (int)padding;
        }
        return st;
    case AUGMENT_HFLIP:
        st = cfg_check_keys(err, arg, full, HFLIP_KEYS, 1, 1u, "hflip");
        if (st == QT_OK) st = cfg_get_float(err, arg, full, "p", PROBABILITY, &s->p);
        return st;
    case AUGMENT_RANDOM_ERASE:
        st = cfg_check_keys(err, arg, full, ERASE_KEYS, 4, 15u, "random_erase");
        if (st == QT_OK) st = cfg_get_float(err, arg, full, "p", PROBABILITY, &s->p);
        if (st == QT_OK) st = load_range_pair(err, arg, full, "scale", ERASE_SCALE, s->scale);
        if (st == QT_OK) st = load_range_pair(err, arg, full, "ratio", ERASE_RATIO, s->ratio);
        if (st == QT_OK) st = cfg_get_float(err, arg, full, "value", ANY_FLOAT, &s->value);
        return st;
    default: return cfg_fail(err, item, path, "unsupported augmentation");
    }
}

QtStatus cfg_part_load_augment(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx) {
    (void)map, (void)ctx;
    DataConfig *d = section;
    if (!v) return QT_OK;
    if (v->kind != YNODE_SEQUENCE)
        return cfg_fail_expected(err, v, "data.augment",
                                 "a sequence of augmentations, e.g. [{random_crop: {size: 28, padding: 4}}, hflip]",
                                 "");
    if (v->n > AUGMENT_MAX)
        return cfg_fail(err, v, "data.augment", "expected at most %d augmentations, got %d", AUGMENT_MAX, v->n);
    memset(&d->augment, 0, sizeof d->augment); /* items past n stay zero: Configs compare bytewise */
    for (int i = 0; i < v->n; i++) {
        char path[64];
        snprintf(path, sizeof path, "data.augment[%d]", i);
        QtStatus st = load_augment(err, v->items[i], path, &d->augment.items[i]);
        if (st != QT_OK) return st;
        d->augment.n = i + 1;
    }
    return QT_OK;
}

/* data.anomaly_classes: [] or absent = none. */
QtStatus cfg_part_load_anomaly(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx) {
    (void)map, (void)ctx;
    DataConfig *d = section;
    d->n_anomaly_classes = 0;
    if (!v || ynode_is_null(v) || (v->kind == YNODE_SEQUENCE && v->n == 0)) return QT_OK;
    if (v->kind != YNODE_SEQUENCE || v->n > DATASET_MAX_CLASSES)
        return cfg_fail_expected(err, v, "data.anomaly_classes", "a sequence of class labels, e.g. [9]", "");
    for (int j = 0; j < v->n; j++) {
        char item[64];
        snprintf(item, sizeof item, "data.anomaly_classes[%d]", j);
        int64_t x = 0;
        QtStatus st = cfg_to_int(err, v->items[j], item, 0, DATASET_MAX_CLASSES - 1, &x);
        if (st != QT_OK) return st;
        for (int k = 0; k < j; k++)
            if (d->anomaly_classes[k] == (int)x)
                return cfg_fail(err, v->items[j], item, "class %d is listed twice (first as item %d)", (int)x, k);
        d->anomaly_classes[j] = (int)x;
        d->n_anomaly_classes = j + 1;
    }
    return QT_OK;
}
