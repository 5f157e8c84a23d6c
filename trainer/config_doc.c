/* config_doc.c - the config reference (docs/CONFIG.md), written from the
 * schema's tables by `qtrain config --doc`. A test compares the committed
 * file with this output, so the reference cannot drift from the loader. */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_schema.h"

static const char INTRO[] =
    "# Config reference\n"
    "\n"
    "<!-- Generated from the schema (trainer/config_table.c); do not edit. Regenerate with\n"
    "     ./build/qtrain config --doc > docs/CONFIG.md -->\n"
    "\n"
    "A config is a YAML file with the sections `run`, `data`, `model`, `train`,\n"
    "and optionally `quant` (a quantized or quantization-aware model) and `lora`\n"
    "(adapters). Every key but `model.input` and `model.layers` has a default;\n"
    "the resolved config, with every key, is printed at the start of a run and\n"
    "stored in each checkpoint (`qtrain inspect` shows it). The whole config is\n"
    "checked (types, ranges, names, and that the layers' shapes chain) before\n"
    "any data is read; `--set key.path=value` overrides one key\n"
    "(`--set model.layers.3.units=64` for an item of a list).\n"
    "\n"
    "Values: a key given as null (`key:`) keeps its default. Numbers and\n"
    "booleans are plain scalars (a quoted `\"3\"` is a string and is refused\n"
    "where a number is expected); integers are decimal; floats may use an\n"
    "exponent (`1e-3`); booleans are `true`/`false`, `yes`/`no` or `on`/`off`\n"
    "in any case. A key that does not apply (to a layer type, the chosen\n"
    "optimizer or schedule, or the quant mode) is an error, and so is an\n"
    "unknown key, with the closest valid one suggested.\n"
    "\n"
    "The resume column says what `--resume` does when the config differs from\n"
    "the checkpoint's: *fixed* keys decide the data order or the model, and a\n"
    "change is refused; a change of a *reported* key is allowed with a warning\n"
    "(the run no longer matches an uninterrupted one); *free* keys may change\n"
    "without a word.\n";

/* The values say their type: "≥ 0" alone leaves open whether 2.5 is taken. */
static void put_int_range(FILE *f, int64_t lo, int64_t hi) {
    if (hi == INT64_MAX || hi == INT_MAX) fprintf(f, "an integer ≥ %" PRId64, lo);
    else fprintf(f, "an integer in [%" PRId64 ", %" PRId64 "]", lo, hi);
}

/* " ≥ 0", " > 0", " in [0, 1)"; nothing without bounds. */
static void put_bounds(FILE *f, CfgRange r) {
    if (isinf(r.lo) && isinf(r.hi)) return;
    if (isinf(r.hi)) fprintf(f, " %s %g", r.lo_open ? ">" : "≥", r.lo);
    else fprintf(f, " in %c%g, %g%c", r.lo_open ? '(' : '[', r.lo, r.hi, r.hi_open ? ')' : ']');
}

static void put_values(FILE *f, const CfgKey *row) {
    if (row->doc_values) {
        fputs(row->doc_values, f);
        return;
    }
    switch (row->type) {
    case CFG_T_STR: fputs(row->empty_ok ? "a string" : "a non-empty string", f); break;
    case CFG_T_PATH: fputs(row->empty_ok ? "a path, or `\"\"`" : "a path", f); break;
    case CFG_T_BOOL: fputs("true, false", f); break;
    case CFG_T_INT:
    case CFG_T_I64: put_int_range(f, row->imin, row->imax); break;
    case CFG_T_U64: fputs("an integer in [0, 2^64 − 1]", f); break;
    case CFG_T_FLOAT:
    case CFG_T_DOUBLE:
        fputs(isinf(row->range.lo) && isinf(row->range.hi) ? "any finite number" : "a number", f);
        put_bounds(f, row->range);
        break;
    case CFG_T_FLOAT2:
        fputs("two numbers, each", f);
        put_bounds(f, row->range);
        break;
    case CFG_T_ENUM:
    case CFG_T_NAME:
        for (int k = 0; k < row->n_names; k++) fprintf(f, "%s`%s`", k ? ", " : "", row->name_of(k));
        break;
    case CFG_T_SECTION: fprintf(f, "a mapping (%s below)", row->sub->path); break;
    case CFG_T_PART: break;
    }
}

static void put_default(FILE *f, const CfgKey *row) {
    if (row->type == CFG_T_SECTION) {
        fputs("per key (below)", f);
        return;
    }
    if (row->doc_default) {
        fputs(row->doc_default, f);
        return;
    }
    switch (row->type) {
    case CFG_T_STR:
    case CFG_T_PATH:
    case CFG_T_NAME:
    case CFG_T_ENUM:
        if (row->def_str && row->def_str[0]) fprintf(f, "`%s`", row->def_str);
        else fputs("`\"\"`", f);
        break;
    case CFG_T_BOOL: fputs(row->def != 0 ? "true" : "false", f); break;
    case CFG_T_INT:
    case CFG_T_I64:
    case CFG_T_U64: fprintf(f, "%.0f", row->def); break;
    case CFG_T_FLOAT:
    case CFG_T_DOUBLE: fprintf(f, "%g", row->def); break;
    default: break;
    }
}

/* The kinds a row applies to, "adamw" or "qat", from its table's kind names. */
static void put_kinds(FILE *f, const CfgTable *t, const CfgKey *row) {
    const char *(*name)(int) = t->kind_key >= 0 ? t->keys[t->kind_key].name_of : t->kind_name;
    int n = t->kind_key >= 0 ? t->keys[t->kind_key].n_names : t->n_kinds;
    if (!row->kinds || !name) return;
    fputs("*", f);
    for (int k = 0, first = 1; k < n; k++) {
        if (!(row->kinds & (1u << k))) continue;
        fprintf(f, "%s%s", first ? "" : ", ", name(k));
        first = 0;
    }
    fputs(" only.* ", f);
}

static const char *const RESUME_NAMES[] = {"free", "fixed", "reported"};

/* What a resume does with a section's keys: theirs when they agree, else "per key". A section row's own
 * class is not a key's: train.optimizer's keys are reported, not free. */
static const char *section_resume(const CfgTable *t, CfgResume inherit) {
    const char *name = NULL;
    for (int i = 0; i < t->n; i++) {
        const CfgKey *row = &t->keys[i];
        const char *r = row->type == CFG_T_SECTION ? section_resume(row->sub, row->resume)
                                                   : RESUME_NAMES[row->resume ? row->resume : inherit];
        if (name && strcmp(name, r) != 0) return "per key";
        name = r;
    }
    return name ? name : RESUME_NAMES[inherit];
}

/* inherit: what a resume does with the list whose items t describes (their keys alike). */
static void put_table(FILE *f, const CfgTable *t, CfgResume inherit) {
    fprintf(f, "\n## %s\n\n", t->path);
    if (t->doc) fprintf(f, "%s\n\n", t->doc);
    fputs("| key | default | values | resume | meaning |\n| --- | --- | --- | --- | --- |\n", f);
    for (int i = 0; i < t->n; i++) {
        const CfgKey *row = &t->keys[i];
        fprintf(f, "| `%s.%s` | ", t->path, row->key);
        put_default(f, row);
        fputs(" | ", f);
        put_values(f, row);
        fprintf(f, " | %s | ", row->type == CFG_T_SECTION ? section_resume(row->sub, row->resume)
                                                          : RESUME_NAMES[row->resume ? row->resume : inherit]);
        put_kinds(f, t, row);
        fprintf(f, "%s |\n", row->doc ? row->doc : "");
    }
    for (int i = 0; i < t->n; i++)
        if (t->keys[i].sub) put_table(f, t->keys[i].sub, t->keys[i].resume);
}

char *config_doc_markdown(void) {
    char *text = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&text, &size);
    if (!f) return NULL;
    fputs(INTRO, f);
    for (int i = 0; i < CFG_ROOT.n; i++) put_table(f, CFG_ROOT.keys[i].sub, CFG_RESUME_FREE);
    bool failed = ferror(f) != 0;
    if (fclose(f) != 0 || failed) {
        free(text);
        return NULL;
    }
    return text;
}
