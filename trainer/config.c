/* config.c - the config loader: a YAML tree into a checked Config, driven
 * by the schema's tables (config_table.c): conversions, ranges, defaults.
 *
 * Value rules (the same for every key):
 *   - A key given as null (`key:` or `key: null`) keeps its default.
 *   - Numbers and booleans must be plain scalars: a quoted "3" is a string,
 *     as in YAML itself, and is rejected where a number is expected.
 *   - Integers are decimal (optional sign, no underscores, no 0x); a value
 *     with a fraction or exponent is not an integer (batch_size: 1.5 fails).
 *   - Numbers for float keys: decimal with optional fraction and exponent
 *     (1e-3 is accepted, unlike strict YAML 1.1), .inf and .nan (which the
 *     range checks then reject).
 *   - Booleans: true/false, yes/no, on/off in any case (YAML 1.1 without the
 *     single letters y/n, which too often mean something else).
 *   - Strings may be plain or quoted; a plain 123 for a string key is "123".
 * Layers store their resolved defaults (name, stride, eps, init_std), so the
 * Config says exactly what model_init will build and config_to_yaml prints
 * what actually runs. */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "config_schema.h"
#include "yamltree.h"

#define INPUT_DIM_MAX 65536
#define INPUT_NUMEL_MAX (1 << 28)

const char *const NONFINITE_ACTION_NAMES[NONFINITE_COUNT] = {"stop", "skip"};
const char *const LOSS_KIND_NAMES[LOSS_COUNT] = {"cross_entropy", "mse"};
const char *const DATA_TARGET_NAMES[DATA_TARGET_COUNT] = {"label", "input"};
const char *const LORA_BATCHNORM_NAMES[LORA_BN_COUNT] = {"frozen", "train"};
const char *const CONFIG_DATASETS[CONFIG_N_DATASETS] = {"fashion-mnist", "hdf5", "npy", "idx"};

#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* ---- messages -------------------------------------------------------------- */

QtStatus cfg_fail(QtError *err, const YNode *at, const char *path, const char *fmt, ...) {
    char where[CONFIG_PATH_MAX + 32], what[QT_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return qt_error_set(err, QT_ERR_CONFIG, "%s: %s%s%s", at ? ynode_where(at, where, sizeof where) : "config", path,
                        path[0] ? ": " : "", what);
}

const char *cfg_join(char *buf, size_t size, const char *path, const char *key) {
    snprintf(buf, size, "%s%s%s", path, path[0] ? "." : "", key);
    return buf;
}

int config_edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    int *row = malloc((lb + 1) * sizeof *row);
    if (!row) return (int)(la > lb ? la : lb);
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0]; /* row[i-1][j-1] */
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            diag = up;
            row[j] = best;
        }
    }
    int d = row[lb];
    free(row);
    return d;
}

static void list_keys(char *buf, size_t size, const char *const *keys, int n, unsigned allowed) {
    buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (!(allowed & (1u << i))) continue;
        size_t len = strlen(buf);
        snprintf(buf + len, size - len, "%s%s", len ? ", " : "", keys[i]);
    }
}

QtStatus cfg_check_keys(QtError *err, const YNode *map, const char *path, const char *const *keys, int n,
                        unsigned allowed, const char *owner) {
    char valid[512], full[256];
    list_keys(valid, sizeof valid, keys, n, allowed);
    for (int k = 0; map && k < map->n; k++) {
        const YNode *key = map->keys[k];
        int idx = -1;
        for (int i = 0; i < n && idx < 0; i++)
            if (strcmp(key->text, keys[i]) == 0) idx = i;
        if (idx >= 0 && (allowed & (1u << idx))) continue;
        if (idx >= 0)
            return cfg_fail(err, key, cfg_join(full, sizeof full, path, key->text),
                            "does not apply to %s (its keys: %s)", owner, valid);
        int best = -1, best_d = INT_MAX, len = (int)strlen(key->text);
        for (int i = 0; i < n; i++) {
            if (!(allowed & (1u << i))) continue;
            int d = config_edit_distance(key->text, keys[i]);
            /* a tie goes to a key the typed one starts with (train_yx: train_y, not train_x) */
            bool prefix = strncmp(key->text, keys[i], strlen(keys[i])) == 0;
            if (d < best_d || (d == best_d && prefix)) best = i, best_d = d;
        }
        int limit = len / 3 > 2 ? len / 3 : 2;
        const char *what = path[0] ? "key" : "top-level key";
        if (best >= 0 && best_d <= limit && best_d < len)
            return cfg_fail(err, key, path, "unknown %s '%s' (did you mean '%s'?)", what, key->text, keys[best]);
        return cfg_fail(err, key, path, "unknown %s '%s' (valid keys: %s)", what, key->text, valid);
    }
    return QT_OK;
}

/* ---- scalars ------------------------------------------------------------------ */

const YNode *cfg_field(const YNode *map, const char *key) {
    const YNode *v = ynode_get(map, key);
    return ynode_is_null(v) ? NULL : v;
}

QtStatus cfg_fail_expected(QtError *err, const YNode *v, const char *path, const char *expected, const char *extra) {
    char got[96];
    return cfg_fail(err, v, path, "expected %s, got %s%s", expected, ynode_describe(v, got, sizeof got), extra);
}

/* The same for numbers and booleans, with a hint when the value was quoted. */
static QtStatus fail_scalar(QtError *err, const YNode *v, const char *path, const char *expected, const char *extra) {
    char got[96];
    bool quoted = v->kind == YNODE_SCALAR && !v->plain;
    return cfg_fail(err, v, path, "expected %s, got %s%s%s", expected, ynode_describe(v, got, sizeof got), extra,
                    quoted ? " (quotes make a string; write the value without them)" : "");
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

/* 0: an integer in *out; 1: not an integer; 2: out of int64 range. */
static int parse_int(const char *s, int64_t *out) {
    const char *p = s + (*s == '+' || *s == '-');
    if (!*p) return 1;
    for (const char *q = p; *q; q++)
        if (!is_digit(*q)) return 1;
    errno = 0;
    *out = strtoll(s, NULL, 10);
    return errno == ERANGE ? 2 : 0;
}

/* YAML-style floats: [sign] digits [. digits] [e [sign] digits], .inf, .nan. */
static bool parse_number(const char *s, double *out) {
    const char *p = s + (*s == '+' || *s == '-');
    if (strcasecmp(p, ".inf") == 0) return *out = *s == '-' ? -INFINITY : INFINITY, true;
    if (strcasecmp(s, ".nan") == 0) return *out = NAN, true;
    bool digits = false;
    for (; is_digit(*p); p++) digits = true;
    if (*p == '.')
        for (p++; is_digit(*p); p++) digits = true;
    if (!digits) return false;
    if (*p == 'e' || *p == 'E') {
        p += 1 + (p[1] == '+' || p[1] == '-');
        if (!is_digit(*p)) return false;
        while (is_digit(*p)) p++;
    }
    if (*p) return false;
    *out = strtod(s, NULL); /* an overflow gives +-inf, which the finite check reports */
    return true;
}

QtStatus cfg_to_int(QtError *err, const YNode *v, const char *path, int64_t lo, int64_t hi, int64_t *out) {
    char expected[96];
    if (hi == INT64_MAX || hi == INT_MAX)
        snprintf(expected, sizeof expected, "an integer >= %" PRId64, lo);
    else
        snprintf(expected, sizeof expected, "an integer in [%" PRId64 ", %" PRId64 "]", lo, hi);
    int64_t x = 0;
    int r = v->kind == YNODE_SCALAR && v->plain ? parse_int(v->text, &x) : 1;
    if (r == 0 && x >= lo && x <= hi) {
        *out = x;
        return QT_OK;
    }
    return fail_scalar(err, v, path, expected, r == 2 || (r == 0 && x > hi) ? ", which is too large" : "");
}

static QtStatus to_u64(QtError *err, const YNode *v, const char *path, uint64_t *out) {
    const char *s = v->kind == YNODE_SCALAR && v->plain ? v->text : ""; /* a mapping or sequence has no text */
    bool ok = s[*s == '+'] != '\0';
    for (const char *p = s + (*s == '+'); ok && *p; p++) ok = is_digit(*p);
    if (ok) {
        errno = 0;
        *out = strtoull(s, NULL, 10);
        if (errno != ERANGE) return QT_OK;
    }
    return fail_scalar(err, v, path, "an integer in [0, 18446744073709551615]", "");
}

QtStatus cfg_to_number(QtError *err, const YNode *v, const char *path, CfgRange r, double *out) {
    char expected[96];
    if (isinf(r.lo) && isinf(r.hi))
        snprintf(expected, sizeof expected, "a finite number");
    else if (isinf(r.hi))
        snprintf(expected, sizeof expected, "a finite number %s %g", r.lo_open ? ">" : ">=", r.lo);
    else
        snprintf(expected, sizeof expected, "a number in %c%g, %g%c", r.lo_open ? '(' : '[', r.lo, r.hi,
                 r.hi_open ? ')' : ']');
    double x = 0;
    bool ok = v->kind == YNODE_SCALAR && v->plain && parse_number(v->text, &x);
    /* Written so that NaN fails. */
    bool in = ok && isfinite(x) && (r.lo_open ? x > r.lo : x >= r.lo) && (r.hi_open ? x < r.hi : x <= r.hi);
    if (in && r.is_float && isinf((float)x)) return fail_scalar(err, v, path, expected, ", too large for a float");
    if (!in) return fail_scalar(err, v, path, expected, "");
    *out = x;
    return QT_OK;
}

QtStatus cfg_to_bool(QtError *err, const YNode *v, const char *path, bool *out) {
    static const char *const yes[] = {"true", "yes", "on"}, *const no[] = {"false", "no", "off"};
    for (int i = 0; v->kind == YNODE_SCALAR && v->plain && i < 3; i++) {
        if (strcasecmp(v->text, yes[i]) == 0) return *out = true, QT_OK;
        if (strcasecmp(v->text, no[i]) == 0) return *out = false, QT_OK;
    }
    return fail_scalar(err, v, path, "true or false", "");
}

QtStatus cfg_to_str(QtError *err, const YNode *v, const char *path, bool allow_empty, char *out, size_t size) {
    if (v->kind != YNODE_SCALAR) return cfg_fail_expected(err, v, path, "a string", "");
    size_t len = strlen(v->text);
    if (!allow_empty && len == 0) return cfg_fail(err, v, path, "expected a non-empty string, got \"\"");
    if (len >= size)
        return cfg_fail(err, v, path, "expected at most %zu characters, got %zu", size - 1, len);
    cfg_set_str(out, size, v->text);
    return QT_OK;
}

QtStatus cfg_check_name(QtError *err, const YNode *v, const char *path, const char *name, const char *why) {
    bool ok = name[0] && name[0] != '.' && name[0] != '-';
    for (const char *p = name; ok && *p; p++)
        ok = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || strchr("_.-", *p);
    if (ok) return QT_OK;
    return cfg_fail(err, v, path, "expected letters, digits, '_', '-' and '.' only, not starting with '.' or '-' (%s), "
                    "got \"%s\"", why, name);
}

QtStatus cfg_check_path(QtError *err, const YNode *v, const char *path, const char *value) {
    for (const char *p = value; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            return cfg_fail(err, v, path, "the path contains a control character (byte 0x%02x at offset %zu); give a "
                            "path without them", (unsigned)(unsigned char)*p, (size_t)(p - value));
    return QT_OK;
}

void cfg_set_str(char *out, size_t size, const char *s) {
    memset(out, 0, size);
    snprintf(out, size, "%s", s);
}

QtStatus cfg_get_float(QtError *err, const YNode *map, const char *path, const char *key, CfgRange r, float *out) {
    const YNode *v = cfg_field(map, key);
    char full[256];
    double x = *out;
    r.is_float = true;
    QtStatus st = v ? cfg_to_number(err, v, cfg_join(full, sizeof full, path, key), r, &x) : QT_OK;
    *out = (float)x;
    return st;
}

QtStatus cfg_get_bool(QtError *err, const YNode *map, const char *path, const char *key, bool *out) {
    const YNode *v = cfg_field(map, key);
    char full[256];
    return v ? cfg_to_bool(err, v, cfg_join(full, sizeof full, path, key), out) : QT_OK;
}

QtStatus cfg_lookup_fail(QtError *err, const YNode *at, const char *path, QtStatus st, const QtError *inner) {
    if (st == QT_OK) return QT_OK;
    return cfg_fail(err, at, path, "%s", inner->msg);
}

/* ---- the tables ------------------------------------------------------------------ */

const CfgKey *cfg_table_row(const CfgTable *t, const char *key) {
    for (int i = 0; i < t->n; i++)
        if (strcmp(t->keys[i].key, key) == 0) return &t->keys[i];
    return NULL;
}

bool cfg_row_applies(const CfgKey *row, int kind) { return kind < 0 || !row->kinds || (row->kinds & (1u << kind)); }

int cfg_table_kind(const CfgTable *t, const void *section) {
    return t->kind_key < 0 ? -1 : *(const int *)((const char *)section + t->keys[t->kind_key].offset);
}

QtStatus cfg_check_table_keys(QtError *err, const YNode *map, const CfgTable *t, const char *path, int kind,
                              const char *owner) {
    const char *keys[32];
    unsigned allowed = 0;
    for (int i = 0; i < t->n && i < 32; i++) {
        keys[i] = t->keys[i].key;
        if (cfg_row_applies(&t->keys[i], kind)) allowed |= 1u << i;
    }
    return cfg_check_keys(err, map, path, keys, t->n < 32 ? t->n : 32, allowed, owner ? owner : t->owner);
}

/* One of the row's names; *idx its index. */
static QtStatus load_name(QtError *err, const YNode *v, const char *path, const CfgKey *row, int *idx) {
    char name[CONFIG_PATH_MAX];
    const char *names[64];
    size_t size = row->size && row->size < sizeof name ? row->size : sizeof name;
    QtStatus st = cfg_to_str(err, v, path, false, name, size);
    if (st != QT_OK) return st;
    for (int i = 0; i < row->n_names && i < 64; i++) names[i] = row->name_of(i);
    QtError inner = {0};
    int n = row->n_names < 64 ? row->n_names : 64;
    return cfg_lookup_fail(err, v, path, qt_name_lookup(row->names_what, name, names, n, idx, &inner), &inner);
}

/* [a, b], each in the row's range (names_what says what the pair is). */
static QtStatus load_pair(QtError *err, const YNode *v, const char *path, const CfgKey *row, void *section) {
    if (v->kind != YNODE_SEQUENCE || v->n != 2) return cfg_fail_expected(err, v, path, row->names_what, "");
    float *dst[2] = {(float *)((char *)section + row->offset), (float *)((char *)section + row->offset2)};
    CfgRange r = row->range;
    r.is_float = true;
    for (int j = 0; j < 2; j++) {
        char item[300];
        snprintf(item, sizeof item, "%s[%d]", path, j);
        double x = 0;
        QtStatus st = cfg_to_number(err, v->items[j], item, r, &x);
        if (st != QT_OK) return st;
        *dst[j] = (float)x;
    }
    return QT_OK;
}

/* The value v (present) of a scalar row into its field. */
static QtStatus load_value(QtError *err, const YNode *v, const char *path, const CfgKey *row, void *section) {
    char *field = (char *)section + row->offset;
    QtStatus st = QT_OK;
    int64_t i = 0;
    double x = 0;
    int k = 0;
    CfgRange r = row->range;
    switch (row->type) {
    case CFG_T_STR: return cfg_to_str(err, v, path, row->empty_ok, field, row->size);
    case CFG_T_PATH:
        st = cfg_to_str(err, v, path, row->empty_ok, field, row->size);
        return st == QT_OK ? cfg_check_path(err, v, path, field) : st;
    case CFG_T_BOOL: return cfg_to_bool(err, v, path, (bool *)field);
    case CFG_T_INT:
        if ((st = cfg_to_int(err, v, path, row->imin, row->imax, &i)) == QT_OK) *(int *)field = (int)i;
        return st;
    case CFG_T_I64: return cfg_to_int(err, v, path, row->imin, row->imax, (int64_t *)field);
    case CFG_T_U64: return to_u64(err, v, path, (uint64_t *)field);
    case CFG_T_FLOAT:
        r.is_float = true;
        if ((st = cfg_to_number(err, v, path, r, &x)) == QT_OK) *(float *)field = (float)x;
        return st;
    case CFG_T_DOUBLE: return cfg_to_number(err, v, path, r, (double *)field);
    case CFG_T_ENUM:
        if ((st = load_name(err, v, path, row, &k)) == QT_OK) *(int *)field = k;
        return st;
    case CFG_T_NAME:
        if ((st = load_name(err, v, path, row, &k)) == QT_OK) cfg_set_str(field, row->size, row->name_of(k));
        return st;
    case CFG_T_FLOAT2: return load_pair(err, v, path, row, section);
    default: return qt_error_set(err, QT_ERR_ARG, "%s: not a scalar key of the schema", path);
    }
}

QtStatus cfg_load_row(QtError *err, const YNode *map, const char *path, const CfgKey *row, void *section) {
    const YNode *v = cfg_field(map, row->key);
    char full[256];
    cfg_join(full, sizeof full, path, row->key);
    QtStatus st = v ? load_value(err, v, full, row, section) : QT_OK;
    if (st == QT_OK && row->check) st = row->check(err, v, full, section);
    return st;
}

QtStatus cfg_load_key(QtError *err, const YNode *map, const char *path, const CfgTable *t, const char *key,
                      void *section) {
    const CfgKey *row = cfg_table_row(t, key);
    if (!row) return qt_error_set(err, QT_ERR_ARG, "%s.%s: not in the schema", t->path, key);
    return cfg_load_row(err, map, path, row, section);
}

QtStatus cfg_load_table(QtError *err, const YNode *parent, const char *key, const CfgTable *t, void *section,
                        void *parent_section, CfgCtx *ctx) {
    const YNode *m = cfg_field(parent, key);
    if (m && m->kind != YNODE_MAPPING) return cfg_fail_expected(err, m, t->path, "a mapping of keys", "");
    if (!m && t->missing) return cfg_fail(err, parent, t->path, "%s", t->missing);
    QtStatus st = QT_OK;
    char owner[64];
    int kind = -1;
    snprintf(owner, sizeof owner, "%s", t->owner);
    if (t->kind_key >= 0) {
        /* The kind first, so that its defaults apply to whatever keys are not given, in any key order. */
        const CfgKey *kind_row = &t->keys[t->kind_key];
        if ((st = cfg_load_row(err, m, t->path, kind_row, section)) != QT_OK) return st;
        kind = cfg_table_kind(t, section);
        if (t->kind_defaults) t->kind_defaults(section, kind);
        snprintf(owner, sizeof owner, t->owner, kind_row->name_of(kind));
    }
    st = cfg_check_table_keys(err, m, t, t->path, kind, owner);
    for (int i = 0; st == QT_OK && i < t->n; i++) {
        const CfgKey *row = &t->keys[i];
        if (i == t->kind_key || !cfg_row_applies(row, kind)) continue;
        if (row->type == CFG_T_SECTION)
            st = cfg_load_table(err, m, row->key, row->sub, (char *)section + row->offset, section, ctx);
        else if (row->type == CFG_T_PART)
            st = row->part->load(err, cfg_field(m, row->key), m, section, ctx);
        else
            st = cfg_load_row(err, m, t->path, row, section);
    }
    if (st == QT_OK && t->after) st = t->after(err, m, parent, section, parent_section, ctx);
    return st;
}

void cfg_table_defaults(const CfgTable *t, void *section) {
    for (int i = 0; i < t->n; i++) {
        const CfgKey *row = &t->keys[i];
        char *field = (char *)section + row->offset;
        if (row->def_by_kind) continue;
        switch (row->type) {
        case CFG_T_STR:
        case CFG_T_PATH:
        case CFG_T_NAME: cfg_set_str(field, row->size, row->def_str ? row->def_str : ""); break;
        case CFG_T_BOOL: *(bool *)field = row->def != 0; break;
        case CFG_T_INT: *(int *)field = (int)row->def; break;
        case CFG_T_I64: *(int64_t *)field = (int64_t)row->def; break;
        case CFG_T_U64: *(uint64_t *)field = (uint64_t)row->def; break;
        case CFG_T_FLOAT: *(float *)field = (float)row->def; break;
        case CFG_T_DOUBLE: *(double *)field = row->def; break;
        case CFG_T_ENUM:
            *(int *)field = 0;
            for (int k = 0; row->def_str && k < row->n_names; k++)
                if (strcmp(row->name_of(k), row->def_str) == 0) *(int *)field = k;
            break;
        case CFG_T_FLOAT2:
            *(float *)field = (float)row->def;
            *(float *)((char *)section + row->offset2) = (float)row->def;
            break;
        case CFG_T_SECTION: cfg_table_defaults(row->sub, field); break;
        default: break; /* parts start zeroed */
        }
    }
    if (t->kind_defaults) t->kind_defaults(section, cfg_table_kind(t, section));
}

/* ---- parts ------------------------------------------------------------------------ */

static QtStatus load_input(QtError *err, const YNode *v, const YNode *model, ModelConfig *mc) {
    if (!v) return cfg_fail(err, model, "model.input", "missing; give the per-example input shape, [C, H, W] or "
                                                       "[features], e.g. input: [1, 28, 28]");
    if (v->kind != YNODE_SEQUENCE || (v->n != 1 && v->n != 3)) {
        char extra[32] = "";
        if (v->kind == YNODE_SEQUENCE) snprintf(extra, sizeof extra, " of %d", v->n);
        return cfg_fail_expected(err, v, "model.input", "a sequence of 1 or 3 integers ([features] or [C, H, W])",
                                 extra);
    }
    int64_t numel = 1;
    for (int i = 0; i < v->n; i++) {
        char path[64];
        snprintf(path, sizeof path, "model.input[%d]", i);
        int64_t x = 0;
        QtStatus st = cfg_to_int(err, v->items[i], path, 1, INPUT_DIM_MAX, &x);
        if (st != QT_OK) return st;
        mc->input_shape[i] = (int)x;
        numel *= x;
    }
    if (numel > INPUT_NUMEL_MAX)
        return cfg_fail(err, v, "model.input", "%" PRId64 " elements per example is more than %d", numel,
                        INPUT_NUMEL_MAX);
    mc->input_ndim = v->n;
    return QT_OK;
}

/* The dry run: layers whose shapes do not chain are reported at the first
 * layer that fails, with model_init's explanation. On success *dry is the
 * model (for the checks that need module paths); the caller frees it. */
static QtStatus check_shapes(QtError *err, const ModelConfig *mc, const YNode *layers, Model *dry) {
    Model m;
    QtError inner = {0};
    QtStatus st = model_init(dry, mc->input_ndim, mc->input_shape, mc->layers, mc->n_layers, &inner);
    if (st == QT_OK) return QT_OK;
    if (st == QT_ERR_NOMEM) return qt_error_set(err, st, "%s", inner.msg);
    int bad = mc->n_layers - 1;
    for (int k = 1; k < mc->n_layers; k++) {
        QtError e = {0};
        if (model_init(&m, mc->input_ndim, mc->input_shape, mc->layers, k, &e) != QT_OK) {
            bad = k - 1;
            break;
        }
        model_free(&m);
    }
    char path[64];
    snprintf(path, sizeof path, "model.layers[%d]", bad);
    return cfg_fail(err, layers->items[bad], path, "%s", inner.msg);
}

QtStatus cfg_part_load_input(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx) {
    (void)ctx;
    return load_input(err, v, map, section);
}

QtStatus cfg_part_load_layers(QtError *err, const YNode *layers, const YNode *m, void *section, CfgCtx *ctx) {
    (void)ctx;
    ModelConfig *mc = section;
    if (!layers) return cfg_fail(err, m, "model.layers", "missing; give a list of layers, e.g. [{type: flatten}, "
                                                         "{type: dense, units: 10}]");
    if (layers->kind != YNODE_SEQUENCE || layers->n == 0)
        return cfg_fail_expected(err, layers, "model.layers", "a non-empty sequence of layers",
                             layers->kind == YNODE_SEQUENCE ? " (an empty one)" : "");
    if (layers->n > CONFIG_MAX_LAYERS)
        return cfg_fail(err, layers, "model.layers", "expected at most %d layers, got %d", CONFIG_MAX_LAYERS,
                        layers->n);
    for (int i = 0; i < layers->n; i++) {
        char path[64];
        snprintf(path, sizeof path, "model.layers[%d]", i);
        QtStatus st = cfg_load_layer(err, layers->items[i], path, i, &mc->layers[i]);
        if (st != QT_OK) return st;
        mc->n_layers = i + 1;
    }
    return QT_OK;
}

/* The model's shapes chain; on success ctx->dry is the model (for the checks that need module paths). */
QtStatus cfg_model_after(QtError *err, const YNode *m, const YNode *parent_map, void *section, void *parent,
                         CfgCtx *ctx) {
    (void)parent_map, (void)parent;
    QtStatus st = check_shapes(err, section, cfg_field(m, "layers"), &ctx->dry);
    ctx->have_dry = st == QT_OK;
    return st;
}

/* What the model learns (data.target) and the loss that measures it
 * (train.loss) agree. `root` is the top-level mapping; the data section
 * is loaded before train. */
QtStatus cfg_train_after(QtError *err, const YNode *m, const YNode *root, void *section, void *parent, CfgCtx *ctx) {
    (void)ctx;
    const TrainConfig *t = section;
    const DataConfig *d = &((const Config *)parent)->data;
    const YNode *data = cfg_field(root, "data");
    if (d->target == DATA_TARGET_INPUT && t->loss == LOSS_CROSS_ENTROPY) {
        const YNode *loss = cfg_field(m, "loss");
        return cfg_fail(err, loss ? loss : cfg_field(data, "target"), loss ? "train.loss" : "data.target",
                        "data.target: input trains the model to reconstruct its input, which train.loss: "
                        "cross_entropy cannot measure (it needs class labels); set train.loss: mse");
    }
    if (d->n_anomaly_classes > 0 && d->target != DATA_TARGET_INPUT)
        return cfg_fail(err, cfg_field(data, "anomaly_classes"), "data.anomaly_classes",
                        "needs data.target: input: an example's anomaly score is the model's reconstruction error; "
                        "set data.target: input and train.loss: mse (or remove data.anomaly_classes)");
    return QT_OK;
}

static QtStatus load_root(QtError *err, const YNode *root, Config *c) {
    CfgCtx ctx = {.have_dry = false};
    QtStatus st = cfg_check_table_keys(err, root, &CFG_ROOT, "", -1, NULL);
    for (int i = 0; st == QT_OK && i < CFG_ROOT.n; i++) {
        const CfgKey *row = &CFG_ROOT.keys[i];
        st = cfg_load_table(err, root, row->key, row->sub, (char *)c + row->offset, c, &ctx);
    }
    if (ctx.have_dry) model_free(&ctx.dry);
    return st;
}

/* ---- entry points ------------------------------------------------------------------ */

void config_default(Config *c) {
    memset(c, 0, sizeof *c);
    cfg_table_defaults(&CFG_ROOT, c);
}

static QtStatus load_text(Config *c, const char *text, size_t len, const char *name, const char *const *overrides,
                          int n_overrides, QtError *err) {
    YNode *root = NULL;
    QtStatus st = ytree_parse(text, len, name, false, &root, err);
    if (st == QT_OK && (!root || ynode_is_null(root)))
        st = qt_error_set(err, QT_ERR_CONFIG,
                          "%s:1:1: the config is empty; it needs at least a model section with input and layers",
                          name);
    if (st == QT_OK && root->kind != YNODE_MAPPING)
        st = cfg_fail_expected(err, root, "", "a mapping of sections (run, data, model, train) at the top level", "");
    for (int i = 0; st == QT_OK && i < n_overrides; i++) {
        if (!overrides[i]) st = qt_error_set(err, QT_ERR_ARG, "config: override %d is NULL", i);
        else st = ytree_set(root, overrides[i], err);
    }
    if (st == QT_OK) st = load_root(err, root, c);
    ynode_free(root);
    if (st != QT_OK) {
        /* A half-filled Config must not look usable. */
        config_default(c);
        cfg_set_str(c->source, sizeof c->source, name);
    }
    return st;
}

QtStatus config_load_string(Config *c, const char *text, const char *name, const char *const *overrides,
                            int n_overrides, QtError *err) {
    if (!name) name = "<config>";
    config_default(c);
    cfg_set_str(c->source, sizeof c->source, name);
    if (!text) return qt_error_set(err, QT_ERR_ARG, "%s: no config text", name);
    return load_text(c, text, strlen(text), name, overrides, n_overrides, err);
}

#define CONFIG_FILE_MAX (16 << 20)

/* The whole file in *text (malloc'd, NUL-terminated), its length in *len. */
static QtStatus read_file(const char *path, char **text, size_t *len, QtError *err) {
    *text = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return qt_error_set(err, QT_ERR_IO, "cannot open config file '%s': %s", path, strerror(errno));
    size_t cap = 0;
    QtStatus st = QT_OK;
    for (;;) {
        if (cap - *len < 2) { /* room for one more byte and the NUL */
            if (cap >= CONFIG_FILE_MAX) {
                st = qt_error_set(err, QT_ERR_CONFIG, "config file '%s' is larger than %d MiB; is it a config?", path,
                                  CONFIG_FILE_MAX >> 20);
                break;
            }
            size_t grown_cap = cap ? 2 * cap : 4096;
            char *grown = realloc(*text, grown_cap);
            if (!grown) {
                st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %zu bytes to read '%s'", grown_cap, path);
                break;
            }
            *text = grown;
            cap = grown_cap;
        }
        size_t got = fread(*text + *len, 1, cap - 1 - *len, f);
        *len += got;
        if (got == 0) {
            if (ferror(f))
                st = qt_error_set(err, QT_ERR_IO, "cannot read config file '%s': %s", path, strerror(errno));
            break;
        }
    }
    fclose(f);
    if (st != QT_OK) {
        free(*text);
        *text = NULL;
        return st;
    }
    (*text)[*len] = '\0';
    return QT_OK;
}

QtStatus config_load(Config *c, const char *path, const char *const *overrides, int n_overrides, QtError *err) {
    config_default(c);
    if (!path) return qt_error_set(err, QT_ERR_ARG, "config_load: no path");
    cfg_set_str(c->source, sizeof c->source, path);
    char *text = NULL;
    size_t len = 0;
    QtStatus st = read_file(path, &text, &len, err);
    if (st == QT_OK) st = load_text(c, text, len, path, overrides, n_overrides, err);
    free(text);
    return st;
}

const char *quant_mode_name(QuantMode mode) {
    static const char *const names[QUANT_MODE_COUNT] = {"none", "ptq", "qat", "qt"};
    return (unsigned)mode < QUANT_MODE_COUNT ? names[mode] : "unknown";
}

bool config_has_lora(const Config *c) { return c->lora.n_rules > 0 || c->lora.n_trainable > 0; }
