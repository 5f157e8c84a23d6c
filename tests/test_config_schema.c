/* test_config_schema.c - the config schema's tables drive the config: the
 * committed reference (docs/CONFIG.md) is `qtrain config --doc`'s output,
 * and for every row of every section table the loaded default is the row's,
 * a changed value round-trips through config_to_yaml, a value out of the
 * row's range is refused naming the key and the range, a misspelt key is
 * answered with the row's key, and a change on resume is refused, reported
 * or let through as the row says. */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "test_proc.h"
#include "test_util.h"
#include "trainer/config_schema.h"

#define DOC_PATH "docs/CONFIG.md"
#define REGENERATE "./build/qtrain config --doc > docs/CONFIG.md"

static const char MINIMAL[] = "model:\n  input: [1, 4, 4]\n  layers: [{type: flatten}, {type: dense, units: 3}]\n";

/* Every scalar row of the section tables, with its full key path and table. */
typedef struct {
    const CfgTable *table;
    const CfgKey *row;
    size_t offset; /* of the row's section within Config */
    char path[96];
} Row;

static int collect(const CfgTable *t, size_t base, Row *out, int n, int cap) {
    for (int i = 0; i < t->n && n < cap; i++) {
        const CfgKey *row = &t->keys[i];
        if (row->type == CFG_T_SECTION) {
            n = collect(row->sub, base + row->offset, out, n, cap);
            continue;
        }
        if (row->type == CFG_T_PART) continue;
        out[n].table = t;
        out[n].row = row;
        out[n].offset = base;
        snprintf(out[n].path, sizeof out[n].path, "%s%s%s", t->path, t->path[0] ? "." : "", row->key);
        n++;
    }
    return n;
}

static int all_rows(Row *rows, int cap) {
    int n = 0;
    for (int i = 0; i < CFG_ROOT.n; i++) n = collect(CFG_ROOT.keys[i].sub, CFG_ROOT.keys[i].offset, rows, n, cap);
    return n;
}

static const void *field_of(const Config *c, const Row *r, size_t offset) {
    return (const char *)c + r->offset + offset;
}

/* ---- the reference -------------------------------------------------------------------------------------------- */

/* The first line where two texts differ, for the message. */
static void first_difference(const char *a, const char *b, char *buf, size_t size) {
    int line = 1;
    const char *la = a, *lb = b;
    for (; *a && *a == *b; a++, b++)
        if (*a == '\n') line++, la = a + 1, lb = b + 1;
    snprintf(buf, size, "line %d: file \"%.*s\" vs generated \"%.*s\"", line, (int)strcspn(la, "\n"), la,
             (int)strcspn(lb, "\n"), lb);
}

static void test_doc_matches_file(void) {
    char *doc = config_doc_markdown(), *file = test_file_read(DOC_PATH, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(doc);
    bool same = file && strcmp(file, doc) == 0;
    if (!same) {
        char where[512] = "it cannot be read";
        if (file) first_difference(file, doc, where, sizeof where);
        fprintf(stderr, "\n  %s differs from `qtrain config --doc` (%s); regenerate it with `%s` and commit it\n",
                DOC_PATH, where, REGENERATE);
    }
    CU_ASSERT(same);
    free(file);
    free(doc);
}

/* The binary prints the same text (and every key of every table is in it). */
static void test_doc_command(void) {
    char *dir = test_tmpdir_new(), *log = test_path_join(dir, "doc.md");
    int st = test_proc_run(log, (const char *const[]){"config", "--doc", NULL}, 60);
    char *out = test_file_read(log, NULL), *doc = config_doc_markdown();
    CU_ASSERT_EQUAL(st, 0);
    CU_ASSERT(out && doc && strcmp(out, doc) == 0);
    Row rows[256];
    int n = all_rows(rows, 256);
    for (int i = 0; out && i < n; i++) {
        char cell[128];
        snprintf(cell, sizeof cell, "| `%s` |", rows[i].path);
        if (!strstr(out, cell)) fprintf(stderr, "\n  %s is not in config --doc\n", rows[i].path);
        CU_ASSERT(strstr(out, cell) != NULL);
    }
    free(out);
    free(log);
    log = test_path_join(dir, "bad.log");
    CU_ASSERT_EQUAL(test_proc_run(log, (const char *const[]){"config", NULL}, 60), 2);
    CU_ASSERT_EQUAL(test_proc_run(log, (const char *const[]){"config", "--help", NULL}, 60), 0);
    out = test_file_read(log, NULL);
    CU_ASSERT(out && strstr(out, "give --doc") && strstr(out, "usage: qtrain config --doc"));
    free(out);
    CU_ASSERT_EQUAL(test_proc_run(log, (const char *const[]){"config", "--doc", "--x", NULL}, 60), 2);
    out = test_file_read(log, NULL);
    CU_ASSERT(out && strstr(out, "unknown option '--x'"));
    free(out);
    free(log);
    free(doc);
    test_tmpdir_remove(dir);
}

/* Cell `col` (0: key, 1: default, 2: values, 3: resume, 4: meaning) of the doc's row for `path`, trimmed; "" if
 * there is no such row. */
static void doc_cell(const char *doc, const char *path, int col, char *out, size_t size) {
    char head[160];
    snprintf(head, sizeof head, "| `%s` |", path);
    const char *p = strstr(doc, head);
    out[0] = '\0';
    if (!p) return;
    for (int c = 0; c < col; c++) {
        p = strstr(p + 1, " | ");
        if (!p) return;
    }
    p += 3;
    size_t n = strcspn(p, "|\n");
    while (n > 0 && p[n - 1] == ' ') n--;
    snprintf(out, size, "%.*s", (int)n, p);
}

/* The class a resume gives every key of t (nested sections too), or NULL when they differ. */
static const char *keys_resume(const CfgTable *t, CfgResume inherit) {
    static const char *const names[] = {"free", "fixed", "reported"};
    const char *name = NULL;
    for (int i = 0; i < t->n; i++) {
        const CfgKey *row = &t->keys[i];
        const char *r = row->type == CFG_T_SECTION ? keys_resume(row->sub, row->resume)
                                                   : names[row->resume ? row->resume : inherit];
        if (!r || (name && strcmp(name, r) != 0)) return NULL;
        name = r;
    }
    return name;
}

/* Every row of t and of the tables under it says a default, its values with their type (an integer or a
 * number), its meaning in a line (details go to the table's paragraph), and for a section what a resume does
 * with the section's keys. */
static int check_doc_rows(const char *doc, const CfgTable *t) {
    int bad = 0;
    for (int i = 0; i < t->n; i++) {
        const CfgKey *row = &t->keys[i];
        char path[128], def[256], values[256], resume[64];
        snprintf(path, sizeof path, "%s.%s", t->path, row->key);
        doc_cell(doc, path, 1, def, sizeof def);
        doc_cell(doc, path, 2, values, sizeof values);
        doc_cell(doc, path, 3, resume, sizeof resume);
        const char *type_word = NULL;
        if (!row->doc_values && (row->type == CFG_T_INT || row->type == CFG_T_I64 || row->type == CFG_T_U64))
            type_word = "integer";
        if (!row->doc_values && (row->type == CFG_T_FLOAT || row->type == CFG_T_DOUBLE || row->type == CFG_T_FLOAT2))
            type_word = "number";
        const char *want_resume = row->type == CFG_T_SECTION ? keys_resume(row->sub, row->resume) : NULL;
        const char *why = !def[0]                                     ? "no default"
                          : strlen(row->doc ? row->doc : "") > 250    ? "a meaning longer than a line (250 bytes)"
                          : type_word && !strstr(values, type_word)   ? "values without their type"
                          : want_resume && strcmp(resume, want_resume) ? "a resume class that is not its keys'"
                                                                       : NULL;
        if (why) fprintf(stderr, "\n  docs: %s has %s: default '%s', values '%s', resume '%s'\n", path, why, def,
                         values, resume);
        bad += why != NULL;
    }
    for (int i = 0; i < t->n; i++)
        if (t->keys[i].sub) bad += check_doc_rows(doc, t->keys[i].sub);
    return bad;
}

static void test_doc_rows_say_enough(void) {
    char *doc = config_doc_markdown();
    CU_ASSERT_PTR_NOT_NULL_FATAL(doc);
    int bad = 0;
    for (int i = 0; i < CFG_ROOT.n; i++) bad += check_doc_rows(doc, CFG_ROOT.keys[i].sub);
    CU_ASSERT_EQUAL(bad, 0);
    char cell[64];
    doc_cell(doc, "train.optimizer", 3, cell, sizeof cell); /* its keys are all reported */
    CU_ASSERT_STRING_EQUAL(cell, "reported");
    doc_cell(doc, "train.epochs", 2, cell, sizeof cell);
    CU_ASSERT_STRING_EQUAL(cell, "an integer in [0, 1000000]");
    free(doc);
}

/* The defaults the doc writes out by hand for a rule's symmetric flags follow the format: every unsigned format
 * that loads with an asymmetric default is named there. */
static void test_doc_symmetric_defaults(void) {
    char *doc = config_doc_markdown();
    CU_ASSERT_PTR_NOT_NULL_FATAL(doc);
    Config *c = malloc(sizeof *c);
    int checked = 0;
    for (int i = 0; i < qtype_count(); i++) {
        const QType *t = qtype_at(i);
        if (t->kind != QTYPE_KIND_UINT) continue;
        static const char *const keys[][2] = {{"weight_qtype", "symmetric"}, {"act_qtype", "act_symmetric"}};
        for (int k = 0; k < 2; k++) {
            char rules[200], def[256], path[64], want[32];
            snprintf(rules, sizeof rules, "quant.rules=[{module_path: \".*\", %s%s: %s}]",
                     k ? "weight_qtype: int8, " : "", keys[k][0], qtype_name(t));
            const char *ov[] = {"quant.mode=ptq", rules};
            QtError e = {0};
            if (config_load_string(c, MINIMAL, "t.yaml", ov, 2, &e) != QT_OK) continue; /* not a format here */
            bool symmetric = k == 0 ? c->quant.rules[0].spec.symmetric : c->quant.rules[0].spec.act_symmetric;
            snprintf(path, sizeof path, "quant.rules[].%s", keys[k][1]);
            snprintf(want, sizeof want, "`%s`", qtype_name(t));
            doc_cell(doc, path, 1, def, sizeof def);
            bool ok = symmetric || strstr(def, want);
            if (!ok) fprintf(stderr, "\n  docs: %s's default '%s' does not name %s, which defaults to false\n", path,
                             def, want);
            CU_ASSERT(ok);
            checked++;
        }
    }
    CU_ASSERT(checked >= 4);
    free(c);
    free(doc);
}

/* ---- values a row takes ---------------------------------------------------------------------------------------- */

/* --set overrides that another key needs: the row's kind (the first it applies to) and keys it depends on;
 * with_value: those that the row's value (not its default) needs too. */
static int companions(const Row *r, bool with_value, const char **ov, char (*buf)[160]) {
    int n = 0;
    const CfgTable *t = r->table;
    if (r->row->kinds && t->kind_key >= 0) {
        int k = 0;
        while (!(r->row->kinds & (1u << k))) k++;
        snprintf(buf[n], sizeof buf[n], "%s.%s=%s", t->path, t->keys[t->kind_key].key, t->keys[t->kind_key].name_of(k));
        ov[n] = buf[n], n++;
        if (strcmp(t->path, "train.schedule") == 0 && k == SCHED_STEP) ov[n++] = "train.schedule.step_size=5";
    }
    if (strcmp(r->path, "train.optimizer.nesterov") == 0) ov[n++] = "train.optimizer.momentum=0.9";
    if (strcmp(r->path, "data.target") == 0) ov[n++] = "train.loss=mse"; /* target: input needs it */
    if (with_value && strcmp(r->path, "quant.mode") == 0)
        ov[n++] = "quant.rules=[{module_path: \".*\", weight_qtype: int8}]";
    /* the data set's files: data.path is hdf5's, data.files npy's and idx's (all four) */
    if (strcmp(r->path, "data.path") == 0) ov[n++] = "data.dataset=hdf5", ov[n++] = "data.path=data.h5";
    if (with_value && strcmp(r->path, "data.dataset") == 0) ov[n++] = "data.path=data.h5";
    if (strncmp(r->path, "data.files.", 11) == 0) {
        static const char *const files[] = {"data.dataset=idx", "data.files.train_x=tx", "data.files.train_y=ty",
                                            "data.files.test_x=sx", "data.files.test_y=sy"};
        for (int k = 0; k < 5; k++) ov[n++] = files[k];
    }
    return n;
}

/* A valid value for the row other than its field's value in c, as YAML text. */
static void other_value(const Row *r, const Config *c, char *buf, size_t size) {
    const CfgKey *row = r->row;
    const void *f = field_of(c, r, row->offset);
    double x = 0;
    switch (row->type) {
    case CFG_T_STR:
    case CFG_T_PATH: snprintf(buf, size, "other-%s", row->key); return;
    case CFG_T_BOOL: snprintf(buf, size, "%s", *(const bool *)f ? "false" : "true"); return;
    case CFG_T_INT:
    case CFG_T_I64: {
        int64_t v = row->type == CFG_T_INT ? *(const int *)f : *(const int64_t *)f;
        snprintf(buf, size, "%" PRId64, v < row->imin ? row->imin : v + 1 <= row->imax ? v + 1 : row->imin);
        return;
    }
    case CFG_T_U64: snprintf(buf, size, "%" PRIu64, *(const uint64_t *)f + 1); return;
    case CFG_T_ENUM:
    case CFG_T_NAME: {
        int k = 0;
        if (row->type == CFG_T_ENUM) k = *(const int *)f;
        /* one name only (data.dataset): another spelling, which must come back canonical */
        if (row->n_names == 1) snprintf(buf, size, "\"%s\"", row->name_of(0));
        else snprintf(buf, size, "%s", row->name_of((k + 1) % row->n_names));
        return;
    }
    case CFG_T_FLOAT2:
    case CFG_T_FLOAT:
    case CFG_T_DOUBLE:
        x = row->type == CFG_T_DOUBLE ? *(const double *)f : *(const float *)f;
        /* halfway to a finite upper end, else half as large again (or a small value for 0) */
        x = isfinite(row->range.hi) ? (x + row->range.hi) / 2 : x > 0 ? x * 1.5 : 0.0005;
        if (row->type == CFG_T_FLOAT2) snprintf(buf, size, "[%.9g, %.9g]", x, x);
        else snprintf(buf, size, "%.17g", x);
        return;
    default: buf[0] = '\0';
    }
}

static bool field_equal(const Row *r, const Config *a, const Config *b) {
    const CfgKey *row = r->row;
    size_t n = row->type == CFG_T_STR || row->type == CFG_T_PATH || row->type == CFG_T_NAME ? row->size
               : row->type == CFG_T_BOOL                                                  ? sizeof(bool)
               : row->type == CFG_T_INT || row->type == CFG_T_ENUM                         ? sizeof(int)
               : row->type == CFG_T_FLOAT                                                  ? sizeof(float)
                                                                                           : 8;
    bool same = memcmp(field_of(a, r, row->offset), field_of(b, r, row->offset), n) == 0;
    if (row->type == CFG_T_FLOAT2) same = same && memcmp(field_of(a, r, row->offset2), field_of(b, r, row->offset2),
                                                         sizeof(float)) == 0;
    return same;
}

/* Loads MINIMAL with the row's companions and `path=value`; NULL value: only the companions. */
static QtStatus load_with(Config *c, const Row *r, const char *value, QtError *e) {
    const char *ov[8];
    char buf[4][160], set[256];
    int n = companions(r, value != NULL, ov, buf);
    if (value) {
        snprintf(set, sizeof set, "%s=%s", r->path, value);
        ov[n++] = set;
    }
    return config_load_string(c, MINIMAL, "t.yaml", ov, n, e);
}

/* ---- defaults and round trips ------------------------------------------------------------------------------------ */

static void test_defaults_are_the_rows(void) {
    Row rows[256];
    int n = all_rows(rows, 256);
    CU_ASSERT(n >= 40);
    Config *c = malloc(sizeof *c), *d = malloc(sizeof *d);
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(config_load_string(c, MINIMAL, "t.yaml", NULL, 0, &e), QT_OK);
    config_default(d);
    OptimConfig od = optim_config_default(OPTIM_ADAMW);
    for (int i = 0; i < n; i++) {
        const CfgKey *row = rows[i].row;
        const void *f = field_of(c, &rows[i], row->offset);
        bool ok = field_equal(&rows[i], c, d);
        switch (row->type) {
        case CFG_T_STR:
        case CFG_T_PATH:
        case CFG_T_NAME: ok = ok && strcmp(f, row->def_str ? row->def_str : "") == 0; break;
        case CFG_T_BOOL: ok = ok && *(const bool *)f == (row->def != 0); break;
        case CFG_T_INT: ok = ok && *(const int *)f == (int)row->def; break;
        case CFG_T_I64: ok = ok && *(const int64_t *)f == (int64_t)row->def; break;
        case CFG_T_U64: ok = ok && *(const uint64_t *)f == (uint64_t)row->def; break;
        case CFG_T_DOUBLE: ok = ok && *(const double *)f == row->def; break;
        case CFG_T_FLOAT:
            /* a kind's default is the library's (optim_config_default) */
            if (row->def_by_kind) ok = ok && memcmp(f, (const char *)&od + row->offset, sizeof(float)) == 0;
            else ok = ok && *(const float *)f == (float)row->def;
            break;
        case CFG_T_ENUM: ok = ok && strcmp(row->name_of(*(const int *)f), row->def_str) == 0; break;
        default: break;
        }
        if (!ok) fprintf(stderr, "\n  %s: the loaded default is not the row's\n", rows[i].path);
        CU_ASSERT(ok);
    }
    free(c);
    free(d);
}

static void test_every_key_round_trips(void) {
    Row rows[256];
    int n = all_rows(rows, 256);
    Config *base = malloc(sizeof *base), *c = malloc(sizeof *c), *back = malloc(sizeof *back);
    for (int i = 0; i < n; i++) {
        QtError e = {0};
        char value[96];
        bool ok = load_with(base, &rows[i], NULL, &e) == QT_OK;
        other_value(&rows[i], base, value, sizeof value);
        ok = ok && load_with(c, &rows[i], value, &e) == QT_OK;
        /* the value took (data.dataset's only name: another spelling, stored canonical) */
        ok = ok && (rows[i].row->n_names == 1 ? field_equal(&rows[i], c, base) : !field_equal(&rows[i], c, base));
        char *yaml = ok ? config_to_yaml(c) : NULL;
        ok = ok && yaml && config_load_string(back, yaml, "resolved", NULL, 0, &e) == QT_OK;
        cfg_set_str(back->source, sizeof back->source, c->source);
        for (int j = 0; ok && j < c->quant.n_rules; j++) { /* where a rule was read differs, and only that */
            RuleMatch *m = &back->quant.rules[j].match;
            memcpy(m->where, c->quant.rules[j].match.where, sizeof m->where);
        }
        ok = ok && memcmp(c, back, sizeof *c) == 0;
        char *again = ok ? config_to_yaml(back) : NULL;
        ok = ok && again && strcmp(yaml, again) == 0;
        if (!ok) fprintf(stderr, "\n  %s=%s does not round-trip (%s)\n", rows[i].path, value, e.msg);
        CU_ASSERT(ok);
        free(yaml);
        free(again);
    }
    free(base);
    free(c);
    free(back);
}

/* The size of the field a scalar row's type reads and writes; 0 for a row without one of fixed size. */
static size_t type_size(CfgType type) {
    switch (type) {
    case CFG_T_BOOL: return sizeof(bool);
    case CFG_T_INT: return sizeof(int);
    case CFG_T_I64: return sizeof(int64_t);
    case CFG_T_U64: return sizeof(uint64_t);
    case CFG_T_FLOAT:
    case CFG_T_FLOAT2: return sizeof(float);
    case CFG_T_DOUBLE: return sizeof(double);
    default: return 0;
    }
}

/* Every table fits the key check's 32-bit mask, and its keys are unique. A row declared with its field (size
 * set) has the field its type reads; a string's buffer and an enum's name buffer hold every valid name. */
static void check_table(const CfgTable *t) {
    CU_ASSERT(t->n > 0 && t->n <= 32);
    for (int i = 0; i < t->n; i++) {
        const CfgKey *row = &t->keys[i];
        for (int j = 0; j < i; j++) CU_ASSERT(strcmp(row->key, t->keys[j].key) != 0);
        bool ok = true;
        if (type_size(row->type) && row->size) ok = row->size == type_size(row->type);
        if (row->type == CFG_T_STR || row->type == CFG_T_PATH || row->type == CFG_T_NAME) ok = row->size > 1;
        for (int k = 0; (row->type == CFG_T_ENUM || row->type == CFG_T_NAME) && k < row->n_names; k++)
            ok = ok && row->size > strlen(row->name_of(k));
        if (!ok) fprintf(stderr, "\n  %s.%s: its size %zu does not fit its type\n", t->path, row->key, row->size);
        CU_ASSERT(ok);
        if (row->sub) check_table(row->sub);
    }
}

static void test_tables_are_sound(void) { check_table(&CFG_ROOT); }

/* ---- the rows of a layer and of a rule ------------------------------------------------------------------------- */

/* A layer's and a rule's keys are loaded, written and compared by hand-written code (their defaults follow other
 * keys), so a row there is not used by itself: each scalar row must change the loaded item when given, come back
 * from config_to_yaml, and be refused on resume. A row the hand-written code forgets would be a key that is
 * accepted and silently ignored. A misspelt key of the item is answered with the row's key. */
typedef struct {
    const char *base[3];  /* overrides of MINIMAL that give the row an item it applies to */
    char set[200];        /* the override that gives the row its other value */
    size_t item;          /* offset of the item (a layer, rule 0) in Config */
    const char *fixed;    /* what a resume names */
    const char *prefix;   /* the item's key path in an override, "model.layers.1." */
} ItemCase;

/* The case for row of t; false when it has none (a kind row, which changes the item's kind). */
static bool item_case(const CfgTable *t, int i, ItemCase *ic) {
    const CfgKey *row = &t->keys[i];
    memset(ic, 0, sizeof *ic);
    if (row->type == CFG_T_PART || i == t->kind_key) return false;
    if (t == &CFG_LAYER_TABLE) {
        /* the first layer type the row applies to, as layer 1 of a model whose shapes chain */
        static const char *const models[LAYER_COUNT] = {
            [LAYER_DENSE] = "model.layers=[{type: flatten}, {type: dense, units: 3}]",
            [LAYER_CONV2D] = "model.layers=[{type: conv2d, out_channels: 2, kernel: 1}, {type: conv2d, out_channels: 2, "
                             "kernel: 2}]", /* 2 channels in: groups 2 fits */
            [LAYER_MAXPOOL2D] = "model.layers=[{type: relu}, {type: maxpool2d, kernel: 2}, {type: flatten}]",
            [LAYER_DROPOUT] = "model.layers=[{type: flatten}, {type: dropout}]",
            [LAYER_LAYERNORM] = "model.layers=[{type: flatten}, {type: layernorm}]",
        };
        int k = 0;
        while (row->kinds && !(row->kinds & (1u << k))) k++;
        ic->base[0] = models[k];
        if (!ic->base[0]) return false;
        if (strcmp(row->key, "init_std") == 0) ic->base[1] = "model.layers.1.init=normal";
        snprintf(ic->set, sizeof ic->set, "model.layers.1.%s=", row->key);
        ic->item = offsetof(Config, model.layers[1]);
        ic->fixed = "model.layers[1]";
        ic->prefix = "model.layers.1.";
        return true;
    }
    bool quant = t == &CFG_QUANT_RULE_TABLE;
    ic->item = quant ? offsetof(Config, quant.rules[0]) : offsetof(Config, lora.rules[0]);
    ic->fixed = quant ? "quant.rules[0]" : "lora.rules[0]";
    ic->prefix = quant ? "quant.rules.0." : "lora.rules.0.";
    ic->base[0] = !quant                                 ? "lora.rules=[{module_path: \".*\", rank: 2}]"
                  : row->kinds == 1u << QUANT_MODE_QAT ? "quant.mode=qat"
                  : row->kinds == 1u << QUANT_MODE_QT  ? "quant.mode=qt"
                                                        : "quant.mode=ptq";
    if (quant) ic->base[1] = "quant.rules=[{module_path: \".*\", weight_qtype: int8, act_qtype: int8}]";
    if (strcmp(row->key, "skip") == 0) /* a skip rule takes no other key */
        snprintf(ic->set, sizeof ic->set, "%s.rules=[{module_path: \".*\", skip: true}]#", quant ? "quant" : "lora");
    else
        snprintf(ic->set, sizeof ic->set, "%s.rules.0.%s=", quant ? "quant" : "lora", row->key);
    return true;
}

static QtStatus load_case(Config *c, const ItemCase *ic, const char *set, QtError *e) {
    const char *ov[8];
    int n = 0;
    for (int i = 0; i < 3 && ic->base[i]; i++) ov[n++] = ic->base[i];
    if (set) ov[n++] = set;
    return config_load_string(c, MINIMAL, "t.yaml", ov, n, e);
}

static void check_item_rows(const CfgTable *t, int *tried) {
    Config *base = malloc(sizeof *base), *c = malloc(sizeof *c), *back = malloc(sizeof *back);
    for (int i = 0; i < t->n; i++) {
        ItemCase ic;
        if (!item_case(t, i, &ic)) continue;
        Row r = {.table = t, .row = &t->keys[i], .offset = ic.item};
        snprintf(r.path, sizeof r.path, "%s.%s", t->path, t->keys[i].key);
        QtError e = {0};
        char value[96], set[300], fixed[128], changed[512];
        bool ok = load_case(base, &ic, NULL, &e) == QT_OK;
        other_value(&r, base, value, sizeof value);
        if (ic.set[strlen(ic.set) - 1] == '#') snprintf(set, sizeof set, "%.*s", (int)strlen(ic.set) - 1, ic.set);
        else snprintf(set, sizeof set, "%s%s", ic.set, value);
        ok = ok && load_case(c, &ic, set, &e) == QT_OK && !field_equal(&r, c, base);
        char *yaml = ok ? config_to_yaml(c) : NULL;
        ok = ok && yaml && config_load_string(back, yaml, "resolved", NULL, 0, &e) == QT_OK;
        if (ok) {
            cfg_set_str(back->source, sizeof back->source, c->source);
            for (int j = 0; j < c->quant.n_rules; j++) { /* where a rule was read differs, and only that */
                RuleMatch *m = &back->quant.rules[j].match;
                memcpy(m->where, c->quant.rules[j].match.where, sizeof m->where);
            }
            for (int j = 0; j < c->lora.n_rules; j++) {
                RuleMatch *m = &back->lora.rules[j].match;
                memcpy(m->where, c->lora.rules[j].match.where, sizeof m->where);
            }
            ok = memcmp(c, back, sizeof *c) == 0;
            config_diff_for_resume(base, c, fixed, sizeof fixed, changed, sizeof changed);
            ok = ok && strcmp(fixed, ic.fixed) == 0;
        }
        if (!ok) fprintf(stderr, "\n  %s (%s) is not read, written or compared as its row says (%s)\n", r.path, set,
                         e.msg);
        CU_ASSERT(ok);
        /* and the key check's did-you-mean offers it */
        char want[96];
        snprintf(set, sizeof set, "%s%sx=1", ic.prefix, t->keys[i].key);
        snprintf(want, sizeof want, "(did you mean '%s'?)", t->keys[i].key);
        ok = load_case(c, &ic, set, &e) == QT_ERR_CONFIG && strstr(e.msg, want);
        if (!ok) fprintf(stderr, "\n  %s: want '%s', got: %s\n", set, want, e.msg);
        CU_ASSERT(ok);
        free(yaml);
        (*tried)++;
    }
    free(base);
    free(c);
    free(back);
}

static void test_item_rows_are_used(void) {
    int tried = 0;
    check_item_rows(&CFG_LAYER_TABLE, &tried);
    check_item_rows(&CFG_QUANT_RULE_TABLE, &tried);
    check_item_rows(&CFG_LORA_RULE_TABLE, &tried);
    CU_ASSERT(tried >= 25);
    if (tried < 25) fprintf(stderr, "\n  only %d rows of layers and rules were tried\n", tried);
}

/* ---- errors ----------------------------------------------------------------------------------------------------- */

static bool load_fails_with(const Row *r, const char *value, const char *want) {
    Config *c = malloc(sizeof *c);
    QtError e = {0};
    bool ok = load_with(c, r, value, &e) == QT_ERR_CONFIG && strstr(e.msg, r->path) && strstr(e.msg, want);
    if (!ok) fprintf(stderr, "\n  %s=%s: want an error naming it and '%s', got: %s\n", r->path, value, want, e.msg);
    free(c);
    return ok;
}

static void test_out_of_range_refused(void) {
    Row rows[256];
    int n = all_rows(rows, 256), tried = 0;
    for (int i = 0; i < n; i++) {
        const CfgKey *row = rows[i].row;
        char value[64], want[128];
        if (row->type == CFG_T_INT || row->type == CFG_T_I64) {
            if (row->imax == INT64_MAX || row->imax == INT_MAX) snprintf(want, sizeof want, ">= %" PRId64, row->imin);
            else snprintf(want, sizeof want, "[%" PRId64 ", %" PRId64 "]", row->imin, row->imax);
            snprintf(value, sizeof value, "%" PRId64, row->imin - 1);
            CU_ASSERT(load_fails_with(&rows[i], value, want));
            if (row->imax != INT64_MAX && row->imax != INT_MAX) {
                snprintf(value, sizeof value, "%" PRId64, row->imax + 1);
                CU_ASSERT(load_fails_with(&rows[i], value, want));
            }
            tried++;
        } else if (row->type == CFG_T_FLOAT || row->type == CFG_T_DOUBLE) {
            CfgRange r = row->range;
            if (isinf(r.lo)) continue;
            if (isinf(r.hi)) snprintf(want, sizeof want, "%s %g", r.lo_open ? ">" : ">=", r.lo);
            else snprintf(want, sizeof want, "%c%g, %g%c", r.lo_open ? '(' : '[', r.lo, r.hi, r.hi_open ? ')' : ']');
            snprintf(value, sizeof value, "%g", r.lo_open ? r.lo : r.lo - 1);
            CU_ASSERT(load_fails_with(&rows[i], value, want));
            if (!isinf(r.hi)) {
                snprintf(value, sizeof value, "%g", r.hi_open ? r.hi : r.hi + 1);
                CU_ASSERT(load_fails_with(&rows[i], value, want));
            }
            tried++;
        } else if (row->type == CFG_T_ENUM || row->type == CFG_T_NAME) {
            char valid[256] = "valid: ";
            for (int k = 0; k < row->n_names; k++)
                snprintf(valid + strlen(valid), sizeof valid - strlen(valid), "%s%s", k ? ", " : "", row->name_of(k));
            CU_ASSERT(load_fails_with(&rows[i], "no-such-name", valid));
            tried++;
        }
    }
    CU_ASSERT(tried >= 25);
    if (tried < 25) fprintf(stderr, "\n  only %d rows of layers and rules were tried\n", tried);
}

/* key + "x": the loader's did-you-mean names the row's key, from the table's key list. */
static void test_misspelt_keys_suggest_the_row(void) {
    Row rows[256];
    int n = all_rows(rows, 256);
    for (int i = 0; i < n; i++) {
        Config *c = malloc(sizeof *c);
        QtError e = {0};
        const char *ov[8];
        char buf[4][160], set[160], want[96];
        int k = companions(&rows[i], false, ov, buf);
        snprintf(set, sizeof set, "%sx=1", rows[i].path);
        ov[k++] = set;
        snprintf(want, sizeof want, "(did you mean '%s'?)", rows[i].row->key);
        bool ok = config_load_string(c, MINIMAL, "t.yaml", ov, k, &e) == QT_ERR_CONFIG && strstr(e.msg, want);
        if (!ok) fprintf(stderr, "\n  %sx: want '%s', got: %s\n", rows[i].path, want, e.msg);
        CU_ASSERT(ok);
        free(c);
    }
}

/* Each row's change: refused (fixed), reported (by its group's name), or let through. */
static void test_resume_follows_the_rows(void) {
    Row rows[256];
    int n = all_rows(rows, 256), fixed_rows = 0;
    Config *a = malloc(sizeof *a), *b = malloc(sizeof *b);
    for (int i = 0; i < n; i++) {
        const CfgKey *row = rows[i].row;
        QtError e = {0};
        char value[96], fixed[128], changed[512];
        bool ok = load_with(a, &rows[i], NULL, &e) == QT_OK;
        other_value(&rows[i], a, value, sizeof value);
        ok = ok && load_with(b, &rows[i], value, &e) == QT_OK;
        if (ok && row->n_names == 1) continue; /* nothing else to change to */
        config_diff_for_resume(a, b, fixed, sizeof fixed, changed, sizeof changed);
        const char *group = row->resume_as ? row->resume_as : rows[i].path;
        if (row->resume == CFG_RESUME_FIXED) ok = ok && strcmp(fixed, rows[i].path) == 0, fixed_rows++;
        else if (row->resume == CFG_RESUME_REPORTED) ok = ok && !fixed[0] && strstr(changed, group);
        else ok = ok && !fixed[0] && !changed[0];
        if (!ok) fprintf(stderr, "\n  %s changed on resume: fixed '%s', changed '%s'\n", rows[i].path, fixed, changed);
        CU_ASSERT(ok);
    }
    CU_ASSERT(fixed_rows >= 6);
    free(a);
    free(b);
}

int register_config_schema_suite(void) {
    CU_pSuite s = CU_add_suite("config_schema", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "docs/CONFIG.md is config --doc's output", test_doc_matches_file) ||
           !CU_add_test(s, "config --doc through the binary lists every key", test_doc_command) ||
           !CU_add_test(s, "every doc row says its default, its values' type, a section's resume class",
                        test_doc_rows_say_enough) ||
           !CU_add_test(s, "the doc's symmetric defaults name every unsigned format", test_doc_symmetric_defaults) ||
           !CU_add_test(s, "tables fit the key check, keys unique", test_tables_are_sound) ||
           !CU_add_test(s, "every loaded default is its row's", test_defaults_are_the_rows) ||
           !CU_add_test(s, "every key round-trips through config_to_yaml", test_every_key_round_trips) ||
           !CU_add_test(s, "every row of a layer and a rule is read, written and compared", test_item_rows_are_used) ||
           !CU_add_test(s, "a value outside a row's range is refused naming key and range",
                        test_out_of_range_refused) ||
           !CU_add_test(s, "a misspelt key suggests the row's key", test_misspelt_keys_suggest_the_row) ||
           !CU_add_test(s, "a change on resume is refused, reported or free as its row says",
                        test_resume_follows_the_rows);
}
