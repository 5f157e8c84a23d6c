/* config_emit.c - config_to_yaml: the resolved Config as YAML that loads
 * back into the same Config, written from the schema's tables in their row
 * order (which is therefore the order of the stored config), and the parts
 * a table cannot write. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "config_schema.h"

/* The shortest %g that reads back (through the loader's strtod and the cast
 * to float) as exactly v: "0.001" rather than "0.00100000005". At 9
 * significant digits every float reads back exactly. */
static const char *fmt_float(char *buf, size_t size, float v) {
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, size, "%.*g", prec, (double)v);
        if ((float)strtod(buf, NULL) == v) break;
    }
    return buf;
}

/* The same for a double (17 digits always suffice). */
static const char *fmt_double(char *buf, size_t size, double v) {
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, size, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    return buf;
}

/* A plain scalar when it cannot be read as anything but this string (a
 * letter-first word of [A-Za-z0-9_./-] that is not a bool or null), else a
 * double-quoted one with escapes. */
static void put_str(FILE *f, const char *s) {
    static const char *const reserved[] = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"};
    bool plain = (s[0] >= 'a' && s[0] <= 'z') || (s[0] >= 'A' && s[0] <= 'Z') || s[0] == '_' || s[0] == '/';
    for (const char *p = s; plain && *p; p++)
        plain = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || strchr("_./-", *p);
    for (size_t i = 0; plain && i < sizeof reserved / sizeof reserved[0]; i++) plain = strcasecmp(s, reserved[i]) != 0;
    if (plain) {
        fputs(s, f);
        return;
    }
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20 || *p == 0x7f)
            fprintf(f, "\\x%02x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

static void put_key_str(FILE *f, const char *indent, const char *key, const char *s) {
    fprintf(f, "%s%s: ", indent, key);
    put_str(f, s);
    fputc('\n', f);
}

static void put_transform(FILE *f, const Transform *t) {
    char a[32], b[32];
    const char *name = transform_kind_name(t->kind);
    switch (t->kind) {
    case TRANSFORM_NORMALIZE:
        if (t->stats_given && t->n_stats > 0) {
            for (int k = 0; k < 2; k++) {
                fputs(k ? "], std: [" : "{normalize: {mean: [", f);
                for (int c = 0; c < t->n_stats; c++)
                    fprintf(f, "%s%s", c ? ", " : "", fmt_float(a, sizeof a, k ? t->stds[c] : t->means[c]));
            }
            fputs("]}}", f);
        } else if (t->stats_given) {
            fprintf(f, "{normalize: {mean: %s, std: %s}}", fmt_float(a, sizeof a, t->mean),
                    fmt_float(b, sizeof b, t->std));
        } else if (t->per_channel) {
            fputs("{normalize: {per_channel: true}}", f);
        } else {
            fputs(name, f);
        }
        break;
    case TRANSFORM_CLASSES:
        fputs("{classes: [", f);
        for (int j = 0; j < t->n_classes; j++) fprintf(f, "%s%d", j ? ", " : "", t->classes[j]);
        fputs("]}", f);
        break;
    case TRANSFORM_LIMIT: fprintf(f, "{limit: %d}", t->limit); break;
    default: fputs(name, f); break;
    }
}

/* A conv2d's per-axis value (never the first key): an int when both axes agree, else [h, w]. */
static void put_hw(FILE *f, const char *key, int h, int w) {
    if (h == w)
        fprintf(f, ", %s: %d", key, h);
    else
        fprintf(f, ", %s: [%d, %d]", key, h, w);
}

/* One layer in flow style: the rows of its table that apply to its type, in their order (init_std only with
 * init: normal). */
static void put_layer(FILE *f, const LayerSpec *s) {
    const CfgTable *t = &CFG_LAYER_TABLE;
    char a[32];
    fputs("    - {", f);
    for (int i = 0; i < t->n; i++) {
        const CfgKey *row = &t->keys[i];
        const char *field = (const char *)s + row->offset;
        if (!cfg_row_applies(row, (int)s->type) || (field == (const char *)&s->init_std && s->init != INIT_NORMAL))
            continue;
        if (strcmp(row->key, "inputs") == 0) { /* only when given: a chain's YAML stays as it was */
            for (int k = 0; k < s->n_inputs; k++) {
                fputs(k ? ", " : ", inputs: [", f);
                put_str(f, s->inputs[k]);
            }
            if (s->n_inputs) fputc(']', f);
            continue;
        }
        if (s->type == LAYER_CONV2D && (field == (const char *)&s->groups || field == (const char *)&s->dilation)) {
            /* only when not 1, so the YAML of a plain conv2d stays as it was */
            if (field == (const char *)&s->groups && s->groups > 1) fprintf(f, ", groups: %d", s->groups);
            if (field == (const char *)&s->dilation && (s->dilation > 1 || s->dilation_w > 1))
                put_hw(f, "dilation", s->dilation, s->dilation_w);
            continue;
        }
        if (s->type == LAYER_CONV2D && field == (const char *)&s->padding && s->padding_same) {
            fputs(", padding: same", f);
            continue;
        }
        if (s->type == LAYER_CONV2D && field == (const char *)&s->kernel) {
            put_hw(f, "kernel", s->kernel, s->kernel_w);
            continue;
        }
        if (s->type == LAYER_CONV2D && field == (const char *)&s->stride) {
            put_hw(f, "stride", s->stride, s->stride_w);
            continue;
        }
        if (s->type == LAYER_CONV2D && field == (const char *)&s->padding) {
            put_hw(f, "padding", s->padding, s->padding_w);
            continue;
        }
        fprintf(f, "%s%s: ", i ? ", " : "", row->key);
        switch (row->type) {
        case CFG_T_STR: put_str(f, field); break;
        case CFG_T_INT: fprintf(f, "%d", *(const int *)field); break;
        case CFG_T_FLOAT: fputs(fmt_float(a, sizeof a, *(const float *)field), f); break;
        case CFG_T_ENUM: fputs(row->name_of(*(const int *)field), f); break;
        default: /* bias and affine, stored as no_bias and no_affine */
            fputs((strcmp(row->key, "affine") == 0 ? s->no_affine : s->no_bias) ? "false" : "true", f);
            break;
        }
    }
    fputs("}\n", f);
}

void cfg_emit_transforms(FILE *f, const char *indent, const void *section) {
    const DataConfig *d = section;
    fprintf(f, "%stransform:%s\n", indent, d->n_transforms ? "" : " []");
    for (int i = 0; i < d->n_transforms; i++) {
        fprintf(f, "%s  - ", indent);
        put_transform(f, &d->transforms[i]);
        fputc('\n', f);
    }
}

/* Every setting written out, so the resolved config says what runs. */
static void put_augment(FILE *f, const AugmentSpec *s) {
    char a[32], b[32], c[32];
    switch (s->kind) {
    case AUGMENT_RANDOM_CROP:
        if (s->size_h == s->size_w)
            fprintf(f, "{random_crop: {size: %d, padding: %d}}", s->size_h, s->padding);
        else
            fprintf(f, "{random_crop: {size: [%d, %d], padding: %d}}", s->size_h, s->size_w, s->padding);
        break;
    case AUGMENT_HFLIP: fprintf(f, "{hflip: {p: %s}}", fmt_float(a, sizeof a, s->p)); break;
    case AUGMENT_RANDOM_ERASE:
        fprintf(f, "{random_erase: {p: %s, ", fmt_float(a, sizeof a, s->p));
        fprintf(f, "scale: [%s, %s], ", fmt_float(b, sizeof b, s->scale[0]), fmt_float(c, sizeof c, s->scale[1]));
        fprintf(f, "ratio: [%s, %s], ", fmt_float(b, sizeof b, s->ratio[0]), fmt_float(c, sizeof c, s->ratio[1]));
        fprintf(f, "value: %s}}", fmt_float(a, sizeof a, s->value));
        break;
    default: fputs(augment_kind_name(s->kind), f); break;
    }
}

void cfg_emit_augment(FILE *f, const char *indent, const void *section) {
    const DataConfig *d = section;
    fprintf(f, "%saugment:%s\n", indent, d->augment.n ? "" : " []");
    for (int i = 0; i < d->augment.n; i++) {
        fprintf(f, "%s  - ", indent);
        put_augment(f, &d->augment.items[i]);
        fputc('\n', f);
    }
}

void cfg_emit_input(FILE *f, const char *indent, const void *section) {
    const ModelConfig *m = section;
    fprintf(f, "%sinput: [", indent);
    for (int i = 0; i < m->input_ndim; i++) fprintf(f, "%s%d", i ? ", " : "", m->input_shape[i]);
    fputs("]\n", f);
}

void cfg_emit_anomaly(FILE *f, const char *indent, const void *section) {
    const DataConfig *d = section;
    fprintf(f, "%sanomaly_classes: [", indent);
    for (int i = 0; i < d->n_anomaly_classes; i++) fprintf(f, "%s%d", i ? ", " : "", d->anomaly_classes[i]);
    fputs("]\n", f);
}

void cfg_emit_layers(FILE *f, const char *indent, const void *section) {
    const ModelConfig *m = section;
    fprintf(f, "%slayers:%s\n", indent, m->n_layers ? "" : " []");
    for (int i = 0; i < m->n_layers; i++) put_layer(f, &m->layers[i]);
}

static const char *bool_str(bool b) { return b ? "true" : "false"; }
static void emit_row(FILE *f, const char *indent, const CfgKey *row, const void *section);

/* A rule's first lines: module_path, op_types ([] = any) and skip. */
static void put_match(FILE *f, const RuleMatch *m, bool skip) {
    fputs("    - module_path: ", f);
    put_str(f, m->module_path);
    fputs("\n      op_types: [", f);
    const char *sep = "";
    for (int t = 0; t < LAYER_COUNT; t++) {
        if (!(m->op_types & (1u << t))) continue;
        fprintf(f, "%s%s", sep, layer_type_name((LayerType)t));
        sep = ", ";
    }
    fprintf(f, "]\n      skip: %s\n", bool_str(skip));
}

/* A quant rule's scalar key as its row writes it. */
static void put_rule_key(FILE *f, const char *key, const QuantRule *r) {
    emit_row(f, "      ", cfg_table_row(&CFG_QUANT_RULE_TABLE, key), r);
}

static void put_qt(FILE *f, const QuantRule *r) {
    const FqtSpec *q = &r->qt;
    char c[64];
    calib_format(&q->bwd_calib, c, sizeof c);
    put_key_str(f, "      ", "bwd_qtype", q->bwd_qtype ? qtype_name(q->bwd_qtype) : "none");
    put_key_str(f, "      ", "bwd_calibration", c);
    put_rule_key(f, "bwd_weight_grad_tile_size", r);
    fprintf(f, "      bwd_stochastic_rounding: %s\n", q->bwd_stochastic ? "uniform" : "none");
    fprintf(f, "      channelwise_noise_axes: [%s]\n", q->noise_axes == (FQT_NOISE_ROWS | FQT_NOISE_COLS) ? "0, 1"
                                                        : q->noise_axes == FQT_NOISE_COLS ? "1" : "0");
}

void cfg_emit_quant_rules(FILE *f, const char *indent, const void *section) {
    const QuantConfig *q = section;
    fprintf(f, "%srules:%s\n", indent, q->n_rules ? "" : " []");
    for (int i = 0; i < q->n_rules; i++) {
        const QuantRule *r = &q->rules[i];
        put_match(f, &r->match, r->skip);
        if (r->skip) continue;
        const QLayerSpec *s = &r->spec;
        char a[64], b[64];
        calib_format(&s->weight_calib, a, sizeof a);
        put_key_str(f, "      ", "weight_qtype", s->weight_qtype ? qtype_name(s->weight_qtype) : "none");
        put_rule_key(f, "tile_size", r);
        put_rule_key(f, "per_tensor", r);
        put_key_str(f, "      ", "weight_calibration", a);
        fprintf(f, "      symmetric: %s\n", bool_str(s->symmetric));
        put_rule_key(f, "narrow_range", r);
        fprintf(f, "      scale_type: %s\n", qarray_scale_type_name(s->scale_type));
        put_rule_key(f, "double_quant", r);
        fprintf(f, "      rounding: %s\n", qround_name(s->rounding));
        put_rule_key(f, "allow_clip", r);
        put_key_str(f, "      ", "act_qtype", s->act_qtype ? qtype_name(s->act_qtype) : "none");
        calib_format(&s->act_calib, b, sizeof b);
        put_key_str(f, "      ", "act_calibration", b);
        fprintf(f, "      act_symmetric: %s\n", bool_str(s->act_symmetric));
        if (q->mode == QUANT_MODE_QT) put_qt(f, r);
        if (q->mode != QUANT_MODE_QAT) continue;
        char c[64];
        calib_format(&r->qat.amax_init, c, sizeof c);
        put_rule_key(f, "learn_amax", r);
        put_key_str(f, "      ", "amax_init", c);
        put_rule_key(f, "act_static_scale", r);
        put_rule_key(f, "lr", r);
    }
}

void cfg_emit_lora_rules(FILE *f, const char *indent, const void *section) {
    const LoraConfig *l = section;
    fprintf(f, "%srules:%s\n", indent, l->n_rules ? "" : " []");
    for (int i = 0; i < l->n_rules; i++) {
        const LoraRule *r = &l->rules[i];
        put_match(f, &r->match, r->skip);
        for (int k = RULE_MATCH_KEYS; !r->skip && k < CFG_LORA_RULE_TABLE.n; k++)
            emit_row(f, "      ", &CFG_LORA_RULE_TABLE.keys[k], r);
    }
}

void cfg_emit_trainable(FILE *f, const char *indent, const void *section) {
    const LoraConfig *l = section;
    fprintf(f, "%strainable: [", indent);
    for (int i = 0; i < l->n_trainable; i++) {
        if (i) fputs(", ", f);
        put_str(f, l->trainable[i]);
    }
    fputs("]\n", f);
}

/* One scalar or section row as "<indent><key>: <value>\n" (and the lines under it). */
static void emit_row(FILE *f, const char *indent, const CfgKey *row, const void *section) {
    char a[48], b[48], deeper[32];
    const char *field = (const char *)section + row->offset;
    switch (row->type) {
    case CFG_T_STR:
    case CFG_T_PATH:
    case CFG_T_NAME: put_key_str(f, indent, row->key, field); break;
    case CFG_T_BOOL: fprintf(f, "%s%s: %s\n", indent, row->key, bool_str(*(const bool *)field)); break;
    case CFG_T_INT: fprintf(f, "%s%s: %d\n", indent, row->key, *(const int *)field); break;
    case CFG_T_I64: fprintf(f, "%s%s: %" PRId64 "\n", indent, row->key, *(const int64_t *)field); break;
    case CFG_T_U64: fprintf(f, "%s%s: %" PRIu64 "\n", indent, row->key, *(const uint64_t *)field); break;
    case CFG_T_FLOAT: fprintf(f, "%s%s: %s\n", indent, row->key, fmt_float(a, sizeof a, *(const float *)field)); break;
    case CFG_T_DOUBLE:
        fprintf(f, "%s%s: %s\n", indent, row->key, fmt_double(a, sizeof a, *(const double *)field));
        break;
    case CFG_T_ENUM: fprintf(f, "%s%s: %s\n", indent, row->key, row->name_of(*(const int *)field)); break;
    case CFG_T_FLOAT2:
        fprintf(f, "%s%s: [%s, %s]\n", indent, row->key, fmt_float(a, sizeof a, *(const float *)field),
                fmt_float(b, sizeof b, *(const float *)((const char *)section + row->offset2)));
        break;
    case CFG_T_SECTION:
        fprintf(f, "%s%s:\n", indent, row->key);
        snprintf(deeper, sizeof deeper, "%s  ", indent);
        cfg_emit_table(f, row->sub, deeper, field);
        break;
    case CFG_T_PART: row->part->emit(f, indent, section); break;
    }
}

void cfg_emit_table(FILE *f, const CfgTable *t, const char *indent, const void *section) {
    int kind = cfg_table_kind(t, section);
    for (int i = 0; i < t->n; i++)
        if (cfg_row_applies(&t->keys[i], kind)) emit_row(f, indent, &t->keys[i], section);
}

char *config_to_yaml(const Config *c) {
    char *text = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&text, &size);
    if (!f) return NULL;
    cfg_emit_table(f, &CFG_ROOT, "", c);
    bool failed = ferror(f) != 0;
    if (fclose(f) != 0 || failed) {
        free(text);
        return NULL;
    }
    return text;
}
