/* sensitivity.c - per-module quantization sensitivity (sensitivity.h):
 * every measurement is a PTQ run of the config's model built from the float
 * checkpoint by generated quant.rules, so the quantization, batch-norm
 * folding and defaults are the PTQ rules' own. The CSV, the choice and the
 * generated config are in sensitivity_choose.c. */
#include "trainer/sensitivity.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/gemm.h"
#include "quant/qtype.h"
#include "trainer/checkpoint.h"
#include "trainer/net.h"
#include "trainer/run.h"
#include "trainer/sha256.h"

/* ---- formats ------------------------------------------------------------------------------- */

static QtStatus parse_one_format(const char *text, size_t len, SensFormat *f, QtError *err) {
    if (len == 0 || len >= SENS_FORMAT_NAME_MAX)
        return qt_error_set(err, QT_ERR_ARG, "--formats: %s format name '%.*s'; give e.g. int8,int4,nf4,int2",
                            len ? "too long a" : "an empty", (int)(len > 40 ? 40 : len), text);
    memset(f, 0, sizeof *f);
    memcpy(f->name, text, len);
    snprintf(f->qtype, sizeof f->qtype, "%s", f->name);
    f->tile = -1;
    char *slash = strchr(f->qtype, '/');
    if (slash) {
        *slash = '\0';
        const char *s = slash + 1;
        char *end = NULL;
        long t = strtol(s, &end, 10);
        if (strcmp(s, "ch") == 0) f->tile = 0;
        else if (*s && !*end && t > 0 && t <= 1 << 20) f->tile = (int)t;
        else
            return qt_error_set(err, QT_ERR_ARG, "--formats: '%s': after '/' comes ch (per output channel) or a block "
                                "size > 0, e.g. nf4/ch or int4/64", f->name);
    }
    QtError inner = {0};
    const QType *q = qtype_find(f->qtype, &inner);
    if (!q) return qt_error_set(err, QT_ERR_ARG, "--formats: %s", inner.msg);
    snprintf(f->qtype, sizeof f->qtype, "%s", qtype_name(q)); /* the canonical spelling */
    return QT_OK;
}

QtStatus sens_parse_formats(const char *list, SensFormat *out, int cap, int *n, QtError *err) {
    *n = 0;
    if (!list || !*list)
        return qt_error_set(err, QT_ERR_ARG, "--formats is empty; give one or more formats, e.g. int8,int4,nf4,int2");
    for (const char *p = list;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (*n == cap)
            return qt_error_set(err, QT_ERR_ARG, "--formats: more than %d formats", cap);
        QtStatus st = parse_one_format(p, len, &out[*n], err);
        if (st != QT_OK) return st;
        for (int i = 0; i < *n; i++)
            if (strcmp(out[i].name, out[*n].name) == 0)
                return qt_error_set(err, QT_ERR_ARG, "--formats: '%s' is listed twice", out[i].name);
        ++*n;
        if (!comma) break;
        p = comma + 1;
    }
    return QT_OK;
}

/* ---- the configs ------------------------------------------------------------------------------- */

/* text without its top-level `section:` block (config_to_yaml's layout: a key at column 0, its body indented). */
static void strip_section(char *text, const char *section) {
    size_t klen = strlen(section);
    for (char *line = text; *line;) {
        char *next = strchr(line, '\n');
        next = next ? next + 1 : line + strlen(line);
        if (strncmp(line, section, klen) == 0 && line[klen] == ':') {
            char *end = next;
            while (*end && (*end == ' ' || *end == '-' || *end == '\n')) { /* the indented body */
                char *nl = strchr(end, '\n');
                end = nl ? nl + 1 : end + strlen(end);
            }
            memmove(line, end, strlen(end) + 1);
            return;
        }
        line = next;
    }
}

QtStatus sens_ptq_config(const Config *cfg, const char *rules_yaml, const char *checkpoint, const char *name,
                         const char *out_dir, Config *out, char **text, QtError *err) {
    if (text) *text = NULL;
    char *base = config_to_yaml(cfg);
    size_t cap = (base ? strlen(base) : 0) + strlen(rules_yaml) + 256;
    char *full = base ? malloc(cap) : NULL;
    if (!full) {
        free(base);
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    }
    strip_section(base, "quant");
    snprintf(full, cap, "%squant:\n  mode: ptq\n  fold_bn: %s\n  rules:%s\n%s", base,
             cfg->quant.fold_bn ? "true" : "false", rules_yaml[0] ? "" : " []", rules_yaml);
    free(base);
    QtStatus st = config_load_string(out, full, cfg->source, NULL, 0, err);
    free(full);
    if (st != QT_OK) return st;
    snprintf(out->model.init_from, sizeof out->model.init_from, "%s", checkpoint);
    out->train.epochs = 0, out->train.steps = 0;
    if (name) snprintf(out->run.name, sizeof out->run.name, "%s", name);
    if (out_dir) snprintf(out->run.out_dir, sizeof out->run.out_dir, "%s", out_dir);
    if (text && !(*text = config_to_yaml(out))) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    return QT_OK;
}

/* A module's name as a POSIX ERE matching it alone (the rule anchors it), in single quotes for YAML. */
static void module_pattern(const char *module, char *buf, size_t cap) {
    size_t n = 0;
    buf[n++] = '\'';
    for (const char *s = module; *s && n + 4 < cap; s++) {
        if (strchr(".[]()*+?{}|^$\\", *s)) buf[n++] = '\\';
        if (*s == '\'') buf[n++] = '\''; /* YAML's '' */
        buf[n++] = *s;
    }
    buf[n++] = '\'';
    buf[n] = '\0';
}

/* One rule line: module at qtype with tile (-1: the rule's default). */
static void rule_line(char *buf, size_t cap, const char *indent, const char *module, const char *qtype, int tile) {
    char pat[2 * MODULE_NAME_MAX + 4], t[32] = "";
    module_pattern(module, pat, sizeof pat);
    if (tile >= 0) snprintf(t, sizeof t, ", tile_size: %d", tile);
    snprintf(buf, cap, "%s- {module_path: %s, weight_qtype: %s%s}\n", indent, pat, qtype, t);
}

char *sens_rules_yaml(const SensTable *t, const int *choice, const char *indent) {
    size_t cap = (size_t)t->n_modules * (2 * MODULE_NAME_MAX + 128) + 1;
    char *out = calloc(cap, 1);
    if (!out) return NULL;
    size_t len = 0;
    for (int m = 0; m < t->n_modules; m++) {
        if (choice[m] < 0) continue; /* float32: no rule */
        const SensEntry *e = &t->entries[m * t->n_formats + choice[m]];
        char line[2 * MODULE_NAME_MAX + 128];
        rule_line(line, sizeof line, indent, e->module, t->formats[choice[m]].qtype, e->tile);
        len += (size_t)snprintf(out + len, cap - len, "%s", line);
    }
    return out;
}

/* ---- evaluating ---------------------------------------------------------------------------------- */

/* The data loaded once, the split chosen, and batch buffers; each model is built into r.model and freed. */
typedef struct {
    Run r;
    TrainOptions opt;
    const Config *data_cfg;
    const Dataset *split;
    char split_name[16];
} SensRun;

static QtStatus sens_run_open(SensRun *s, const Config *cfg, bool use_test, QtError *err) {
    memset(s, 0, sizeof *s);
    s->opt = (TrainOptions){.quiet = true};
    s->data_cfg = cfg;
    run_init(&s->r, cfg, &s->opt);
    s->r.plan.steps_per_epoch = 1; /* evaluation never trains: no plan */
    gemm_set_threads(cfg->run.threads);
    QtStatus st = run_load_data(&s->r, err);
    RunData *d = &s->r.data;
    if (st == QT_OK && use_test) s->split = &d->test, snprintf(s->split_name, sizeof s->split_name, "test");
    else if (st == QT_OK && d->val.n > 0) s->split = &d->val, snprintf(s->split_name, sizeof s->split_name, "val");
    else if (st == QT_OK) {
        /* no validation split: the training set's tail, fixed (Fashion-MNIST's file is in random order) */
        dataset_free(&d->val);
        st = dataset_split_tail(&d->train, &d->val, SENS_HOLDOUT_FRACTION, err);
        s->split = &d->val, snprintf(s->split_name, sizeof s->split_name, "holdout");
        if (st == QT_OK && d->val.n == 0)
            st = qt_error_set(err, QT_ERR_CONFIG, "%s: the training set has too few examples (%d) to hold out %g of "
                              "them; set data.val_fraction or measure on the test split", cfg->source, d->train.n,
                              SENS_HOLDOUT_FRACTION);
    }
    if (st == QT_OK) st = run_alloc(&s->r, err);
    return st;
}

static void sens_run_close(SensRun *s) {
    s->r.cfg = s->data_cfg;
    run_free(&s->r);
}

/* Builds c's model fresh (init_from, folding, quantizing) into s->r.model; the caller evaluates and frees it. */
static QtStatus sens_run_build(SensRun *s, const Config *c, QtError *err) {
    s->r.cfg = c;
    QtStatus st = run_build_model(&s->r, true, err);
    if (st != QT_OK) run_model_free(&s->r.model), s->r.cfg = s->data_cfg;
    return st;
}

static QtStatus sens_run_eval(SensRun *s, const Dataset *d, SensEval *out, QtError *err) {
    Tape *t = &s->r.work.tape;
    t->training = false, t->grad_enabled = false;
    double loss_sum = 0;
    int64_t correct = 0;
    int bs = s->r.cfg->train.eval_batch_size;
    QtStatus st = QT_OK;
    for (int start = 0; st == QT_OK && start < d->n; start += bs)
        st = run_eval_batch(&s->r, d, start, d->n - start < bs ? d->n - start : bs, &loss_sum, &correct, err);
    t->grad_enabled = true;
    out->loss = d->n ? loss_sum / d->n : NAN;
    out->accuracy = d->n && s->r.cfg->train.loss != LOSS_MSE ? (double)correct / d->n : NAN;
    const Net *n = &s->r.model.net;
    out->q_params = out->q_bits = 0;
    for (int i = 0, c = net_hook_count(n, &HOOK_PTQ); i < c; i++) {
        const QLayer *q = net_qlayer(n, i);
        out->q_params += (int64_t)q->out * q->fan_in;
        out->q_bits += (int64_t)qarray_bytes(&q->weight) * 8;
    }
    char acts[64];
    net_format_summary(n, out->formats, sizeof out->formats, acts, sizeof acts);
    return st;
}

static void sens_run_drop(SensRun *s) {
    run_model_free(&s->r.model);
    s->r.cfg = s->data_cfg;
}

QtStatus sens_eval_config(const Config *ptq, bool test_split, SensEval *out, QtError *err) {
    SensRun s;
    memset(out, 0, sizeof *out);
    QtStatus st = sens_run_open(&s, ptq, test_split, err);
    if (st == QT_OK && (st = sens_run_build(&s, ptq, err)) == QT_OK) {
        st = sens_run_eval(&s, s.split, out, err);
        sens_run_drop(&s);
    }
    sens_run_close(&s);
    return st;
}

/* ---- identity ----------------------------------------------------------------------------------- */

static void hash_floats(Sha256 *h, const char *name, const float *v, size_t n) {
    sha256_update(h, name, strlen(name) + 1);
    if (v) sha256_update(h, v, n * sizeof *v);
}

/* The float model's parameters and batch-norm statistics, by module path. */
static void weights_sha256(const Model *m, char hex[65]) {
    Sha256 h;
    sha256_init(&h);
    for (int i = 0; i < m->n_modules; i++) {
        const Module *md = &m->modules[i];
        char name[MODULE_NAME_MAX + 16];
        const Param *p[2] = {md->weight, md->bias};
        for (int k = 0; k < 2; k++) {
            if (!p[k]) continue;
            snprintf(name, sizeof name, "%s/%s", md->path, k ? "bias" : "weight");
            hash_floats(&h, name, p[k]->var.value.data, var_numel(&p[k]->var));
        }
        if (md->running_mean) {
            snprintf(name, sizeof name, "%s/running", md->path);
            hash_floats(&h, name, md->running_mean, (size_t)md->in_shape[0]);
            hash_floats(&h, name, md->running_var, (size_t)md->in_shape[0]);
        }
    }
    uint8_t d[SHA256_DIGEST_BYTES];
    sha256_final(&h, d);
    sha256_hex(d, hex);
}

/* The resolved data section (what decides the examples and their order), but for the keys that only say where
 * or how they are read (cache_dir, storage, max_memory_mb). */
static QtStatus data_sha256(const Config *cfg, char hex[65], QtError *err) {
    char *text = config_to_yaml(cfg);
    if (!text) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    char *start = strstr(text, "\ndata:\n"), *end = start ? strstr(start + 1, "\nmodel:\n") : NULL;
    Sha256 h;
    sha256_init(&h);
    if (!start || !end) start = text, end = text + strlen(text);
    /* where and how the examples are read changes none of them */
    static const char *const SKIP[] = {"  cache_dir:", "  storage:", "  max_memory_mb:"};
    for (const char *line = start; line < end;) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) + 1 : strlen(line);
        bool skip = false;
        for (size_t k = 0; k < sizeof SKIP / sizeof SKIP[0]; k++) skip |= strncmp(line, SKIP[k], strlen(SKIP[k])) == 0;
        if (!skip) sha256_update(&h, line, len);
        line += len;
    }
    free(text);
    /* batch-norm folding decides what each measured PTQ model is */
    sha256_update(&h, cfg->quant.fold_bn ? "quant.fold_bn: true\n" : "quant.fold_bn: false\n",
                  cfg->quant.fold_bn ? 20 : 21);
    uint8_t d[SHA256_DIGEST_BYTES];
    sha256_final(&h, d);
    sha256_hex(d, hex);
    return QT_OK;
}

/* cfg as a float model loading checkpoint (quant none, no rules). */
static QtStatus float_config(const Config *cfg, const char *checkpoint, Config *out, QtError *err) {
    if (config_has_lora(cfg))
        return qt_error_set(err, QT_ERR_CONFIG, "%s has lora rules or lora.trainable; give the config the float "
                            "model was trained with", cfg->source);
    char (*stored)[MODULE_NAME_MAX] = calloc(CKPT_LIST_MAX, MODULE_NAME_MAX);
    if (!stored) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    int n_stored = 0;
    QtStatus st = checkpoint_list_quant(checkpoint, stored, CKPT_LIST_MAX, &n_stored, err);
    if (st == QT_OK && n_stored > 0)
        st = qt_error_set(err, QT_ERR_ARG, "%s holds module %s quantized; sensitivity starts from the float "
                          "checkpoint (e.g. runs/pretrain/final.h5)", checkpoint, stored[0]);
    free(stored);
    if (st != QT_OK) return st;
    *out = *cfg;
    out->quant.mode = QUANT_MODE_NONE;
    out->quant.n_rules = 0;
    snprintf(out->model.init_from, sizeof out->model.init_from, "%s", checkpoint);
    out->train.epochs = 0, out->train.steps = 0;
    return QT_OK;
}

static bool quantizable(const Module *m) {
    return (m->spec.type == LAYER_DENSE || m->spec.type == LAYER_CONV2D) && m->weight;
}

/* The table's modules, float model and identity; n_formats 0 leaves the entries to the caller. */
static QtStatus identify_into(SensRun *s, const Config *fcfg, SensTable *t, int n_formats, QtError *err) {
    const Model *m = &s->r.model.net.model;
    int nq = 0;
    for (int i = 0; i < m->n_modules; i++) nq += quantizable(&m->modules[i]);
    if (nq == 0)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the model has no dense or conv2d module with a weight to "
                            "quantize", fcfg->source);
    t->entries = calloc((size_t)nq * (size_t)(n_formats > 0 ? n_formats : 1), sizeof *t->entries);
    if (!t->entries) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    t->n_modules = nq, t->n_formats = n_formats;
    int k = 0;
    for (int i = 0; i < m->n_modules; i++) {
        const Module *md = &m->modules[i];
        if (!quantizable(md)) continue;
        for (int f = 0; f < (n_formats > 0 ? n_formats : 1); f++) {
            SensEntry *e = &t->entries[k * (n_formats > 0 ? n_formats : 1) + f];
            snprintf(e->module, sizeof e->module, "%s", md->path);
            e->params = (int64_t)var_numel(&md->weight->var);
            e->fan_in = (int)(e->params / md->weight->var.value.shape[0]);
        }
        k++;
    }
    snprintf(t->split, sizeof t->split, "%s", s->split_name);
    t->examples = s->split->n;
    weights_sha256(m, t->weights_sha256);
    return data_sha256(fcfg, t->data_sha256, err);
}

QtStatus sens_identify(const Config *cfg, const char *checkpoint, bool use_test, SensTable *t, QtError *err) {
    memset(t, 0, sizeof *t);
    Config *fcfg = malloc(sizeof *fcfg);
    if (!fcfg) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    SensRun s;
    memset(&s, 0, sizeof s);
    QtStatus st = float_config(cfg, checkpoint, fcfg, err);
    if (st == QT_OK) st = sens_run_open(&s, fcfg, use_test, err);
    if (st == QT_OK && (st = sens_run_build(&s, fcfg, err)) == QT_OK) {
        st = identify_into(&s, fcfg, t, 0, err);
        sens_run_drop(&s);
    }
    if (s.data_cfg) sens_run_close(&s);
    free(fcfg);
    return st;
}

QtStatus sens_eval_float(const Config *cfg, const char *checkpoint, bool test_split, SensEval *out, QtError *err) {
    Config *fcfg = malloc(sizeof *fcfg);
    if (!fcfg) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    QtStatus st = float_config(cfg, checkpoint, fcfg, err);
    if (st == QT_OK) st = sens_eval_config(fcfg, test_split, out, err);
    free(fcfg);
    return st;
}

void sens_table_free(SensTable *t) {
    free(t->entries);
    memset(t, 0, sizeof *t);
}

/* The tile a format's rule is written with for module e: as given, or -1 (the rule's default) but for nf4, whose
 * default blocks of 64 PTQ refuses on a weight 64 does not divide: per channel there. */
static int format_tile(const SensFormat *f, const SensEntry *e) {
    if (f->tile >= 0) return f->tile;
    QtError ignored = {0}; /* the name was checked when parsed */
    const QType *q = qtype_find(f->qtype, &ignored);
    if (q && q->kind == QTYPE_KIND_LUT && e->params % QARRAY_NF4_BLOCK != 0) return 0;
    return -1;
}

/* "int4/ch", "nf4/64", "mxfp4/mx", as the run's module table names it. */
static void layout_name(const SensEval *ev, const SensFormat *f, char *buf, size_t cap) {
    snprintf(buf, cap, "%.*s", (int)cap - 1, ev->formats[0] ? ev->formats : f->qtype);
}

/* Measures module k under format f into e. */
static QtStatus measure_one(SensRun *s, const Config *cfg, const char *checkpoint, const SensFormat *f, SensEntry *e,
                            const SensTable *t, Config *scratch, QtError *err) {
    char rules[2 * MODULE_NAME_MAX + 128];
    int tile = format_tile(f, e);
    rule_line(rules, sizeof rules, "    ", e->module, f->qtype, tile);
    snprintf(e->format, sizeof e->format, "%s", f->name);
    QtError why = {0};
    QtStatus st = sens_ptq_config(cfg, rules, checkpoint, NULL, NULL, scratch, NULL, &why);
    if (st == QT_OK) e->tile = tile < 0 ? scratch->quant.rules[0].spec.tile_size : tile;
    SensEval ev;
    if (st == QT_OK) st = sens_run_build(s, scratch, &why);
    if (st == QT_ERR_CONFIG) { /* the format does not fit this module (a block that does not divide it): no option */
        const char *msg = strstr(why.msg, "quant.rules[0]: ");
        snprintf(e->layout, sizeof e->layout, "n/a");
        e->tile = tile, e->bits = -1, e->bits_per_param = NAN, e->delta_loss = NAN, e->delta_accuracy = NAN;
        snprintf(e->note, sizeof e->note, "%.159s", msg ? msg + strlen("quant.rules[0]: ") : why.msg);
        return QT_OK;
    }
    if (st != QT_OK) return qt_error_set(err, st, "%s", why.msg);
    st = sens_run_eval(s, s->split, &ev, err);
    sens_run_drop(s);
    if (st != QT_OK) return st;
    layout_name(&ev, f, e->layout, sizeof e->layout);
    e->bits = ev.q_bits;
    e->bits_per_param = ev.q_params ? (double)ev.q_bits / (double)ev.q_params : NAN;
    e->delta_loss = ev.loss - t->base_loss;
    e->delta_accuracy = ev.accuracy - t->base_accuracy;
    return QT_OK;
}

QtStatus sens_measure(const Config *cfg, const SensOptions *o, SensTable *t, QtError *err) {
    memset(t, 0, sizeof *t);
    if (o->n_formats < 1 || o->n_formats > SENS_FORMATS_MAX)
        return qt_error_set(err, QT_ERR_ARG, "give 1 to %d formats", SENS_FORMATS_MAX);
    Config *fcfg = malloc(sizeof *fcfg), *scratch = malloc(sizeof *scratch);
    SensRun s;
    memset(&s, 0, sizeof s);
    QtStatus st = fcfg && scratch ? float_config(cfg, o->checkpoint, fcfg, err)
                                  : qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK) st = sens_run_open(&s, fcfg, o->use_test, err);
    SensEval base;
    if (st == QT_OK && (st = sens_run_build(&s, fcfg, err)) == QT_OK) {
        st = identify_into(&s, fcfg, t, o->n_formats, err);
        if (st == QT_OK) st = sens_run_eval(&s, s.split, &base, err);
        sens_run_drop(&s);
    }
    if (st == QT_OK) {
        memcpy(t->formats, o->formats, sizeof t->formats);
        t->base_loss = base.loss, t->base_accuracy = base.accuracy;
        if (o->log)
            fprintf(o->log, "float model on the %s split (%d examples): loss %.4f accuracy %.4f\n", t->split,
                    t->examples, base.loss, base.accuracy), fflush(o->log);
    }
    for (int m = 0; st == QT_OK && m < t->n_modules; m++)
        for (int f = 0; st == QT_OK && f < t->n_formats; f++) {
            SensEntry *e = &t->entries[m * t->n_formats + f];
            st = measure_one(&s, cfg, o->checkpoint, &o->formats[f], e, t, scratch, err);
            if (st == QT_OK && o->log && e->bits < 0)
                fprintf(o->log, "  %-12s %-8s not available: %s\n", e->module, e->format, e->note), fflush(o->log);
            else if (st == QT_OK && o->log)
                fprintf(o->log, "  %-12s %-8s %-10s %7.3f bits/weight  delta loss %+.4f  delta accuracy %+.4f\n",
                        e->module, e->format, e->layout, e->bits_per_param, e->delta_loss, e->delta_accuracy),
                    fflush(o->log);
        }
    if (s.data_cfg) sens_run_close(&s);
    free(fcfg), free(scratch);
    if (st != QT_OK) sens_table_free(t);
    return st;
}
