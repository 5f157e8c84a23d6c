/* config_rules.c - the quant and lora sections: ordered lists of rules
 * (trainer/rules.h), each giving the modules it matches their PTQ or adapter
 * settings, and the modules LoRA trains in full.
 *
 * Every rule stores its settings resolved (the defaults filled in: the
 * symmetric flags and calibrations following the formats, nf4's block of
 * 64), so config_to_yaml prints what runs. A skip rule stores none: its
 * spec stays zero. Rule
 * structs are zeroed and filled field by field, never assigned whole, so
 * that two loads of one text compare equal byte for byte (padding too). */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "config_schema.h"

#define BIT(k) (1u << (k))
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

#define QR (&CFG_QUANT_RULE_TABLE)
#define LR (&CFG_LORA_RULE_TABLE)

/* ---- what a rule matches ------------------------------------------------------------ */

/* op_types: names of layer types with a weight that rules can act on. */
static QtStatus load_op_types(QtError *err, const YNode *v, const char *path, unsigned *out) {
    if (!v) return QT_OK;
    if (v->kind != YNODE_SEQUENCE)
        return cfg_fail_expected(err, v, path, "a sequence of layer types, e.g. [dense, conv2d] ([] for any)", "");
    const char *names[LAYER_COUNT] = {NULL};
    names[LAYER_DENSE] = layer_type_name(LAYER_DENSE);
    names[LAYER_CONV2D] = layer_type_name(LAYER_CONV2D);
    for (int j = 0; j < v->n; j++) {
        char item[160], name[64];
        snprintf(item, sizeof item, "%s[%d]", path, j);
        QtError inner = {0};
        int t = 0;
        QtStatus st = cfg_to_str(err, v->items[j], item, false, name, sizeof name);
        if (st != QT_OK) return st;
        st = qt_name_lookup("op type", name, names, LAYER_COUNT, &t, &inner);
        if (st != QT_OK) return cfg_lookup_fail(err, v->items[j], item, st, &inner);
        if (*out & BIT(t)) return cfg_fail(err, v->items[j], item, "%s is listed twice", names[t]);
        *out |= BIT(t);
    }
    return QT_OK;
}

/* module_path (compiled here, so that a bad pattern is reported at its
 * rule), op_types, skip and the rule's `where`. */
static QtStatus load_match(QtError *err, const YNode *item, const char *path, const char *kind, RuleMatch *m,
                           bool *skip) {
    char at[CONFIG_PATH_MAX + 32], where[CONFIG_PATH_MAX + 128], full[128];
    snprintf(where, sizeof where, "%s: %s", ynode_where(item, at, sizeof at), path);
    cfg_set_str(m->where, sizeof m->where, where);
    const YNode *v = cfg_field(item, "module_path");
    if (!v)
        return cfg_fail(err, item, cfg_join(full, sizeof full, path, "module_path"),
                        "missing; every %s needs module_path, a regular expression that must match a whole module "
                        "path such as \"fc1\" (\".*\" matches all)",
                        kind);
    QtStatus st = cfg_to_str(err, v, cfg_join(full, sizeof full, path, "module_path"), false, m->module_path,
                             sizeof m->module_path);
    RuleSet set;
    if (st == QT_OK) st = rule_set_compile(&set, m, 1, sizeof *m, err);
    if (st == QT_OK) rule_set_free(&set);
    cfg_join(full, sizeof full, path, "op_types");
    if (st == QT_OK) st = load_op_types(err, cfg_field(item, "op_types"), full, &m->op_types);
    if (st == QT_OK) st = cfg_get_bool(err, item, path, "skip", skip);
    for (int k = 0; st == QT_OK && *skip && k < item->n; k++) {
        const char *key = item->keys[k]->text;
        bool match_key = false;
        for (int i = 0; i < RULE_MATCH_KEYS; i++) match_key = match_key || strcmp(key, QR->keys[i].key) == 0;
        if (!match_key && !ynode_is_null(item->items[k]))
            st = cfg_fail(err, item->keys[k], cfg_join(full, sizeof full, path, key),
                          "skip: true takes no other settings; remove %s or the skip", key);
    }
    return st;
}

typedef QtStatus (*RuleLoadFn)(QtError *err, const YNode *item, const char *path, void *rule);

/* A list of rules; rule i is at (char *)rules + i * stride. */
static QtStatus load_rules(QtError *err, const YNode *v, const char *path, const char *example, RuleLoadFn load,
                           void *rules, size_t stride, int *n) {
    if (!v) return QT_OK;
    if (v->kind != YNODE_SEQUENCE) return cfg_fail_expected(err, v, path, "a sequence of rules", "");
    if (v->n > RULES_MAX) return cfg_fail(err, v, path, "expected at most %d rules, got %d", RULES_MAX, v->n);
    for (int i = 0; i < v->n; i++) {
        char item[64];
        snprintf(item, sizeof item, "%s[%d]", path, i);
        if (v->items[i]->kind != YNODE_MAPPING)
            return cfg_fail_expected(err, v->items[i], item, example, "");
        QtStatus st = load(err, v->items[i], item, (char *)rules + (size_t)i * stride);
        if (st != QT_OK) return st;
        *n = i + 1;
    }
    return QT_OK;
}

/* ---- quant -------------------------------------------------------------------------- */

static void calib_copy(CalibSpec *dst, const CalibSpec *src) {
    dst->kind = src->kind;
    dst->s = src->s;
    dst->a = src->a;
    dst->lo = src->lo;
    dst->hi = src->hi;
    dst->p = src->p;
    dst->fixed_minmax = src->fixed_minmax;
}

/* absmax for a symmetric range, minmax for an asymmetric one; mean |x| for
 * ternary and binary (BitNet b1.58's absmean, XNOR-Net's alpha). */
static void calib_default(CalibSpec *c, bool symmetric, const QType *t) {
    bool mean_abs = t && (t->kind == QTYPE_KIND_TERNARY || t->kind == QTYPE_KIND_BINARY);
    const CalibSpec d = {.kind = mean_abs ? CALIB_MEAN_ABS : symmetric ? CALIB_ABSMAX : CALIB_MINMAX, .s = 1.0};
    calib_copy(c, &d);
}

static bool is_unsigned(const QType *t) { return t && t->kind == QTYPE_KIND_UINT; }

/* `symmetric` (or `act_symmetric`) for a format: unsigned formats default
 * to an asymmetric range, since a symmetric one has no negative codes and
 * clips every negative value to 0. Saying `true` for one anyway is an
 * error unless the rule also says allow_clip: true (a ReLU output is
 * non-negative; net_print_unused_rules then warns). */
static QtStatus load_symmetric(QtError *err, const YNode *item, const char *path, const char *key, const QType *t,
                               bool allow_clip, bool *out) {
    *out = !is_unsigned(t);
    QtStatus st = cfg_get_bool(err, item, path, key, out);
    if (st != QT_OK || !is_unsigned(t) || !*out || allow_clip) return st;
    char full[128];
    return cfg_fail(err, cfg_field(item, key), cfg_join(full, sizeof full, path, key),
                    "true with the unsigned format %s has no negative codes, so every negative value clips to 0; "
                    "remove it (unsigned formats default to an asymmetric range with a zero point), or add "
                    "allow_clip: true if the data cannot be negative (e.g. after a ReLU)", qtype_name(t));
}

/* Entropy calibration is TensorRT's for activations: its histogram's KL
 * divergence rewards covering the bulk of many values, and on a small
 * weight channel (tens of values) it clips the few that matter to a tiny
 * range. */
static QtStatus check_weight_calib(QtError *err, const YNode *item, const char *path, const CalibSpec *c) {
    if (c->kind != CALIB_ENTROPY) return QT_OK;
    char full[128];
    return cfg_fail(err, cfg_field(item, "weight_calibration"), cfg_join(full, sizeof full, path,
                    "weight_calibration"), "entropy is a calibration for activations (a histogram over many "
                    "values): on a weight channel it collapses small channels to a tiny range; for weights use "
                    "absmax, minmax, mse, percentile,p, rms,s, fixed,a, 3sd, kl_j or mean_abs");
}

static QtStatus load_rounding(QtError *err, const YNode *item, const char *path, QRound *out) {
    const YNode *v = cfg_field(item, "rounding");
    if (!v) return QT_OK;
    char full[128], name[32];
    QtError inner = {0};
    cfg_join(full, sizeof full, path, "rounding");
    QtStatus st = cfg_to_str(err, v, full, false, name, sizeof name);
    if (st == QT_OK) st = cfg_lookup_fail(err, v, full, qround_parse(name, out, &inner), &inner);
    return st;
}

static void spec_defaults(QLayerSpec *s) {
    const QLayerSpec d = qlayer_spec_default();
    s->weight_qtype = d.weight_qtype;
    s->tile_size = d.tile_size;
    s->per_tensor = d.per_tensor;
    calib_copy(&s->weight_calib, &d.weight_calib);
    s->symmetric = d.symmetric;
    s->narrow_range = d.narrow_range;
    s->scale_type = d.scale_type;
    s->double_quant = d.double_quant;
    s->rounding = d.rounding;
    s->act_qtype = d.act_qtype;
    calib_copy(&s->act_calib, &d.act_calib);
    s->act_symmetric = d.act_symmetric;
}

/* A format name, or "none" for NULL; absent keeps *out. */
static QtStatus load_qtype(QtError *err, const YNode *map, const char *path, const char *key, const char *none,
                           const QType **out) {
    const YNode *v = cfg_field(map, key);
    if (!v) return QT_OK;
    char full[128], name[64];
    cfg_join(full, sizeof full, path, key);
    QtStatus st = cfg_to_str(err, v, full, false, name, sizeof name);
    if (st != QT_OK) return st;
    if (strcasecmp(name, "none") == 0) {
        *out = NULL;
        return QT_OK;
    }
    QtError inner = {0};
    *out = qtype_find(name, &inner);
    return *out ? QT_OK : cfg_fail(err, v, full, "%s; or none %s", inner.msg, none);
}

static QtStatus load_calib(QtError *err, const YNode *map, const char *path, const char *key, CalibSpec *out) {
    const YNode *v = cfg_field(map, key);
    if (!v) return QT_OK;
    char full[128], text[128];
    cfg_join(full, sizeof full, path, key);
    CalibSpec c;
    QtError inner = {0};
    QtStatus st = cfg_to_str(err, v, full, false, text, sizeof text);
    if (st == QT_OK) st = cfg_lookup_fail(err, v, full, calib_parse(text, &c, &inner), &inner);
    if (st == QT_OK) calib_copy(out, &c);
    return st;
}

static QtStatus load_weight_settings(QtError *err, const YNode *item, const char *path, QuantRule *r) {
    QLayerSpec *s = &r->spec;
    bool allow_clip = r->allow_clip;
    char full[128];
    if (!cfg_field(item, "weight_qtype"))
        return cfg_fail(err, item, cfg_join(full, sizeof full, path, "weight_qtype"),
                        "missing; a quant rule needs weight_qtype, a format such as int8 or nf4 (or none to keep "
                        "the weights float), unless it has skip: true");
    QtStatus st = load_qtype(err, item, path, "weight_qtype", "(keep the weights float)", &s->weight_qtype);
    if (st == QT_OK) st = cfg_load_key(err, item, path, QR, "tile_size", r);
    if (st == QT_OK) st = cfg_load_key(err, item, path, QR, "per_tensor", r);
    bool no_axes = false; /* QAT's name for per-tensor scales (ModelOpt's disable_channelwise_axes) */
    if (st == QT_OK) st = cfg_get_bool(err, item, path, "disable_channelwise_axes", &no_axes);
    s->per_tensor = s->per_tensor || no_axes;
    /* nf4 without a tile_size: bitsandbytes' blocks of 64 (tile_size: 0 asks for one scale per channel) */
    if (s->weight_qtype && s->weight_qtype->kind == QTYPE_KIND_LUT && !cfg_field(item, "tile_size") &&
        !s->per_tensor)
        s->tile_size = QARRAY_NF4_BLOCK;
    if (st == QT_OK && s->per_tensor && s->tile_size > 0)
        st = cfg_fail(err, cfg_field(item, "per_tensor"), cfg_join(full, sizeof full, path, "per_tensor"),
                      "applies only with tile_size 0 (one scale for the whole weight), but tile_size is %d",
                      s->tile_size);
    if (st == QT_OK) st = load_symmetric(err, item, path, "symmetric", s->weight_qtype, allow_clip, &s->symmetric);
    calib_default(&s->weight_calib, s->symmetric, s->weight_qtype);
    if (st == QT_OK) st = load_calib(err, item, path, "weight_calibration", &s->weight_calib);
    if (st == QT_OK) st = check_weight_calib(err, item, path, &s->weight_calib);
    if (st == QT_OK) st = load_rounding(err, item, path, &s->rounding);
    if (st == QT_OK) st = cfg_load_key(err, item, path, QR, "narrow_range", r);
    const YNode *v = cfg_field(item, "scale_type");
    if (st == QT_OK && v) {
        char name[64];
        QtError inner = {0};
        cfg_join(full, sizeof full, path, "scale_type");
        st = cfg_to_str(err, v, full, false, name, sizeof name);
        if (st == QT_OK)
            st = cfg_lookup_fail(err, v, full, qarray_scale_type_parse(name, &s->scale_type, &inner), &inner);
    }
    if (st == QT_OK) st = cfg_load_key(err, item, path, QR, "double_quant", r);
    return st;
}

static QtStatus load_qat_settings(QtError *err, const YNode *item, const char *path, QuantRule *r) {
    QatSpec *q = &r->qat;
    const QatSpec d = qat_spec_default();
    q->learn_amax = d.learn_amax;
    calib_copy(&q->amax_init, &d.amax_init);
    q->act_static_scale = d.act_static_scale;
    q->lr = d.lr;
    QtStatus st = cfg_load_key(err, item, path, QR, "learn_amax", r);
    if (st == QT_OK) st = load_calib(err, item, path, "amax_init", &q->amax_init);
    if (st == QT_OK) st = cfg_load_key(err, item, path, QR, "act_static_scale", r);
    if (st == QT_OK) st = cfg_load_key(err, item, path, QR, "lr", r);
    return st;
}

static QtStatus load_noise_axes(QtError *err, const YNode *item, const char *path, unsigned *out) {
    const YNode *v = cfg_field(item, "channelwise_noise_axes");
    if (!v) return QT_OK;
    char full[128];
    cfg_join(full, sizeof full, path, "channelwise_noise_axes");
    if (v->kind != YNODE_SEQUENCE)
        return cfg_fail_expected(err, v, full, "a list of axes of the gradient: [0] (rows: batch), [1] (columns), "
                                 "[0, 1]", "");
    unsigned axes = 0;
    for (int i = 0; i < v->n; i++) {
        int64_t a = 0;
        char item_path[160];
        snprintf(item_path, sizeof item_path, "%s[%d]", full, i);
        QtStatus st = cfg_to_int(err, v->items[i], item_path, 0, 1, &a);
        if (st != QT_OK) return st;
        axes |= 1u << a;
    }
    *out = axes;
    return QT_OK;
}

static QtStatus load_qt_settings(QtError *err, const YNode *item, const char *path, QuantRule *r) {
    FqtSpec *q = &r->qt;
    const FqtSpec d = fqt_spec_default();
    q->weight_qtype = q->act_qtype = q->bwd_qtype = NULL;
    calib_copy(&q->bwd_calib, &d.bwd_calib);
    q->bwd_weight_grad_tile_size = d.bwd_weight_grad_tile_size;
    q->bwd_stochastic = d.bwd_stochastic;
    q->noise_axes = FQT_NOISE_ROWS;
    QtStatus st = load_qtype(err, item, path, "bwd_qtype", "(the float backward of QAT)", &q->bwd_qtype);
    if (st == QT_OK) st = load_calib(err, item, path, "bwd_calibration", &q->bwd_calib);
    if (st == QT_OK) st = cfg_load_key(err, item, path, QR, "bwd_weight_grad_tile_size", r);
    const YNode *v = cfg_field(item, "bwd_stochastic_rounding");
    if (st == QT_OK && v) {
        char full[128], name[32];
        static const char *const names[] = {"none", "uniform"};
        int k = 0;
        QtError inner = {0};
        cfg_join(full, sizeof full, path, "bwd_stochastic_rounding");
        st = cfg_to_str(err, v, full, false, name, sizeof name);
        if (st == QT_OK)
            st = cfg_lookup_fail(err, v, full, qt_name_lookup("rounding", name, names, 2, &k, &inner), &inner);
        q->bwd_stochastic = k == 1;
    }
    if (st == QT_OK) st = load_noise_axes(err, item, path, &q->noise_axes);
    return st;
}

/* Keys and combinations that make no sense for the mode, each naming both
 * keys: QAT-only keys outside qat, double_quant in qat (it only compresses
 * stored scales), a learned range on a format without an integer grid. */
static QtStatus check_rule_mode(QtError *err, const YNode *item, const char *path, const QuantRule *r, QuantMode mode) {
    char full[128];
    for (int i = 0; mode != QUANT_MODE_QT && i < QR->n; i++) {
        const char *key = QR->keys[i].key;
        if (QR->keys[i].kinds == 1u << QUANT_MODE_QT && cfg_field(item, key))
            return cfg_fail(err, cfg_field(item, key), cfg_join(full, sizeof full, path, key),
                            "applies to quant.mode qt (the quantized backward), but quant.mode is %s; remove it or "
                            "set quant.mode: qt", quant_mode_name(mode));
    }
    for (int i = 0; mode != QUANT_MODE_QAT && i < QR->n; i++) {
        const char *key = QR->keys[i].key;
        if (QR->keys[i].kinds == 1u << QUANT_MODE_QAT && cfg_field(item, key))
            return cfg_fail(err, cfg_field(item, key), cfg_join(full, sizeof full, path, key),
                            "applies to quant.mode qat, but quant.mode is %s; remove it or set quant.mode: qat",
                            quant_mode_name(mode));
    }
    if (!r->skip && mode == QUANT_MODE_QT && r->spec.double_quant)
        return cfg_fail(err, cfg_field(item, "double_quant"), cfg_join(full, sizeof full, path, "double_quant"),
                        "does not apply to quant.mode qt (it compresses the stored scales of a frozen base)");
    if (!r->skip && mode == QUANT_MODE_QT && r->spec.rounding != QROUND_RNE)
        return cfg_fail(err, cfg_field(item, "rounding"), cfg_join(full, sizeof full, path, "rounding"),
                        "applies to quant.mode ptq and qat (the weight's codes); qt rounds its forward to nearest "
                        "(bwd_stochastic_rounding rounds its gradients)");
    if (r->skip || mode != QUANT_MODE_QAT) return QT_OK;
    if (r->spec.double_quant)
        return cfg_fail(err, cfg_field(item, "double_quant"), cfg_join(full, sizeof full, path, "double_quant"),
                        "does not apply to quant.mode qat (it compresses the stored scales of a frozen base); remove "
                        "it, or use quant.mode ptq");
    const QType *w = r->spec.weight_qtype, *a = r->spec.act_qtype;
    bool int_grid_w = w && (w->kind == QTYPE_KIND_INT || w->kind == QTYPE_KIND_UINT);
    bool int_grid_a = !a || a->kind == QTYPE_KIND_INT || a->kind == QTYPE_KIND_UINT;
    if (r->qat.learn_amax != QAT_LEARN_NONE && (!int_grid_w || !int_grid_a))
        return cfg_fail(err, cfg_field(item, "learn_amax"), cfg_join(full, sizeof full, path, "learn_amax"),
                        "%s learns the range of an integer grid, but %s is %s; use an int/uint format there or "
                        "learn_amax: none", qat_learn_name(r->qat.learn_amax), int_grid_w ? "act_qtype" : "weight_qtype",
                        int_grid_w ? qtype_name(a) : (w ? qtype_name(w) : "none"));
    if (r->qat.learn_amax != QAT_LEARN_NONE && r->spec.rounding != QROUND_RNE)
        return cfg_fail(err, cfg_field(item, "rounding"), cfg_join(full, sizeof full, path, "rounding"),
                        "%s with learn_amax %s: a learned range rounds to nearest (its gradient is defined for rne); "
                        "use learn_amax: none or rounding: rne", qround_name(r->spec.rounding),
                        qat_learn_name(r->qat.learn_amax));
    if (r->qat.act_static_scale && (!a || r->qat.learn_amax != QAT_LEARN_NONE))
        return cfg_fail(err, cfg_field(item, "act_static_scale"),
                        cfg_join(full, sizeof full, path, "act_static_scale"),
                        "needs an act_qtype and learn_amax: none (a learned range is already static)");
    return QT_OK;
}

static QtStatus load_quant_rule(QtError *err, const YNode *item, const char *path, void *rule) {
    QuantRule *r = rule;
    memset(r, 0, sizeof *r);
    QtStatus st = cfg_check_table_keys(err, item, QR, path, -1, NULL);
    if (st == QT_OK) st = load_match(err, item, path, "quant rule", &r->match, &r->skip);
    if (st != QT_OK || r->skip) return st;
    QLayerSpec *s = &r->spec;
    spec_defaults(s);
    st = cfg_load_key(err, item, path, QR, "allow_clip", r);
    if (st == QT_OK) st = load_weight_settings(err, item, path, r);
    if (st == QT_OK) st = load_qtype(err, item, path, "act_qtype", "(keep the input float)", &s->act_qtype);
    if (st == QT_OK)
        st = load_symmetric(err, item, path, "act_symmetric", s->act_qtype, r->allow_clip, &s->act_symmetric);
    calib_default(&s->act_calib, s->act_symmetric, NULL);
    if (st == QT_OK) st = load_calib(err, item, path, "act_calibration", &s->act_calib);
    if (st == QT_OK) st = load_qat_settings(err, item, path, r);
    if (st == QT_OK) st = load_qt_settings(err, item, path, r);
    r->qt.weight_qtype = s->weight_qtype;
    r->qt.act_qtype = s->act_qtype;
    return st;
}

QtStatus cfg_part_load_quant_rules(QtError *err, const YNode *rules, const YNode *map, void *section, CfgCtx *ctx) {
    (void)map, (void)ctx;
    QuantConfig *q = section;
    return load_rules(err, rules, "quant.rules", "a rule mapping such as {module_path: \"fc.*\", weight_qtype: int8}",
                      load_quant_rule, q->rules, sizeof q->rules[0], &q->n_rules);
}

/* quant.mode and quant.rules agree, and every rule suits the mode. */
QtStatus cfg_quant_after(QtError *err, const YNode *m, const YNode *parent_map, void *section, void *parent,
                         CfgCtx *ctx) {
    (void)parent_map, (void)parent, (void)ctx;
    const QuantConfig *q = section;
    const YNode *mode = cfg_field(m, "mode"), *rules = cfg_field(m, "rules");
    QtStatus st = QT_OK;
    if (q->mode == QUANT_MODE_NONE && q->n_rules > 0)
        st = cfg_fail(err, rules, "quant.rules",
                      "%d rule%s given, but quant.mode is none, which quantizes nothing; set quant.mode: ptq or qat to "
                      "apply them (or remove the rules)",
                      q->n_rules, q->n_rules == 1 ? " is" : "s are");
    if (st == QT_OK && q->mode != QUANT_MODE_NONE && q->n_rules == 0)
        st = cfg_fail(err, mode, "quant.mode",
                      "%s needs quant.rules saying what to quantize, e.g. rules: [{module_path: \".*\", "
                      "weight_qtype: int8}]", quant_mode_name(q->mode));
    for (int i = 0; st == QT_OK && i < q->n_rules; i++) {
        char item[64];
        snprintf(item, sizeof item, "quant.rules[%d]", i);
        st = check_rule_mode(err, rules->items[i], item, &q->rules[i], q->mode);
    }
    return st;
}

/* ---- lora --------------------------------------------------------------------------- */

static QtStatus load_lora_rule(QtError *err, const YNode *item, const char *path, void *rule) {
    LoraRule *r = rule;
    memset(r, 0, sizeof *r);
    QtStatus st = cfg_check_table_keys(err, item, LR, path, -1, NULL);
    if (st == QT_OK) st = load_match(err, item, path, "lora rule", &r->match, &r->skip);
    if (st != QT_OK || r->skip) return st;
    LoraSpec *s = &r->spec;
    char full[128];
    if (!cfg_field(item, "rank"))
        return cfg_fail(err, item, cfg_join(full, sizeof full, path, "rank"),
                        "missing; a lora rule needs rank, the adapters' inner dimension (e.g. 8), unless it has "
                        "skip: true");
    st = cfg_load_key(err, item, path, LR, "rank", r);
    s->alpha = (float)s->rank;
    if (st == QT_OK) st = cfg_load_key(err, item, path, LR, "alpha", r);
    if (st == QT_OK && s->alpha == 0.0f)
        st = cfg_fail(err, cfg_field(item, "alpha"), cfg_join(full, sizeof full, path, "alpha"),
                      "is too small for a float (it rounds to 0)");
    if (st == QT_OK) st = cfg_load_key(err, item, path, LR, "dropout", r);
    if (st == QT_OK && s->dropout >= 1.0f)
        st = cfg_fail(err, cfg_field(item, "dropout"), cfg_join(full, sizeof full, path, "dropout"),
                      "rounds to 1 as a float; expected a value below 1");
    if (st == QT_OK) st = cfg_load_key(err, item, path, LR, "rslora", r);
    /* absent: lora.init, filled in once the section is loaded (lora_after; -1 until then) */
    if (st == QT_OK && cfg_field(item, "init")) st = cfg_load_key(err, item, path, LR, "init", r);
    else if (st == QT_OK) s->init = (LoraInit)-1;
    if (st == QT_OK) st = cfg_load_key(err, item, path, LR, "dora", r);
    return st;
}

static bool module_has_params(const Module *m) { return m->weight || m->bias; }

/* "fc1, head": the modules lora.trainable can name. */
static void list_param_modules(const Model *dry, char *buf, size_t size) {
    buf[0] = '\0';
    for (int i = 0; i < dry->n_modules; i++) {
        if (!module_has_params(&dry->modules[i])) continue;
        size_t len = strlen(buf);
        snprintf(buf + len, size - len, "%s%s", len ? ", " : "", dry->modules[i].path);
    }
}

QtStatus cfg_part_load_trainable(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx) {
    (void)map;
    const Model *dry = &ctx->dry;
    LoraConfig *l = section;
    if (!v) return QT_OK;
    if (v->kind != YNODE_SEQUENCE)
        return cfg_fail_expected(err, v, "lora.trainable", "a sequence of module names, e.g. [head]", "");
    if (v->n > CONFIG_MAX_LAYERS)
        return cfg_fail(err, v, "lora.trainable", "expected at most %d modules, got %d", CONFIG_MAX_LAYERS, v->n);
    for (int j = 0; j < v->n; j++) {
        char path[64], name[MODULE_NAME_MAX], valid[512];
        snprintf(path, sizeof path, "lora.trainable[%d]", j);
        QtStatus st = cfg_to_str(err, v->items[j], path, false, name, sizeof name);
        if (st != QT_OK) return st;
        const Module *m = NULL;
        for (int i = 0; i < dry->n_modules && !m; i++)
            if (strcmp(dry->modules[i].path, name) == 0) m = &dry->modules[i];
        if (!m || !module_has_params(m)) {
            list_param_modules(dry, valid, sizeof valid);
            return cfg_fail(err, v->items[j], path, "%s '%s' %s; modules with parameters: %s",
                            m ? "module" : "no module", name, m ? "has no parameters to train" : "in the model", valid);
        }
        for (int k = 0; k < j; k++)
            if (strcmp(l->trainable[k], name) == 0)
                return cfg_fail(err, v->items[j], path, "module '%s' is listed twice (first as item %d)", name, k);
        cfg_set_str(l->trainable[j], sizeof l->trainable[j], name);
        l->n_trainable = j + 1;
    }
    return QT_OK;
}

QtStatus cfg_part_load_lora_rules(QtError *err, const YNode *rules, const YNode *map, void *section, CfgCtx *ctx) {
    (void)map, (void)ctx;
    LoraConfig *l = section;
    return load_rules(err, rules, "lora.rules", "a rule mapping such as {module_path: \".*\", rank: 8}", load_lora_rule,
                      l->rules, sizeof l->rules[0], &l->n_rules);
}
