/* sensitivity_choose.c - the sensitivity table as CSV, and the choice of a
 * format per module under a bits-per-weight budget (sensitivity.h). */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/fsutil.h"
#include "trainer/sensitivity.h"

/* ---- CSV --------------------------------------------------------------------------------------- */

static const char CSV_HEADER[] = "module,params,fan_in,format,layout,tile,bits_per_param,bits,delta_loss,"
                                 "delta_accuracy,base_loss,base_accuracy,split,examples,weights_sha256,data_sha256";

QtStatus sens_write_csv(const SensTable *t, const char *path, bool force, QtError *err) {
    QtStatus st = fs_check_out_path(path, force, "--out:", err);
    if (st != QT_OK) return st;
    char tmp[4200];
    fs_remove_stale_tmps_of(path, 0);
    FILE *f = fs_fopen_tmp(path, tmp, sizeof tmp);
    if (!f) return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; give another --out", path, strerror(errno));
    fprintf(f, "%s\n", CSV_HEADER);
    for (int m = 0; m < t->n_modules; m++)
        for (int k = 0; k < t->n_formats; k++) {
            const SensEntry *e = &t->entries[m * t->n_formats + k];
            /* %.17g: autoquant --sensitivity reads back the very numbers it would have measured */
            fprintf(f, "%s,%lld,%d,%s,%s,%d,%.17g,%lld,%.17g,%.17g,%.17g,%.17g,%s,%d,%s,%s\n", e->module,
                    (long long)e->params, e->fan_in, e->format, e->layout, e->tile, e->bits_per_param,
                    (long long)e->bits, e->delta_loss, e->delta_accuracy, t->base_loss, t->base_accuracy, t->split,
                    t->examples, t->weights_sha256, t->data_sha256);
        }
    if (fs_fcommit_tmp(f, tmp, path, force ? FS_REPLACE_REGULAR : FS_REPLACE_NONE) == 0) return QT_OK;
    if (errno == EEXIST)
        return qt_error_set(err, QT_ERR_IO, "cannot write %s: something appeared there meanwhile; nothing was "
                            "replaced", path);
    return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
}

#define CSV_FIELDS 16
#define SENS_CSV_ROWS_MAX (256 * SENS_FORMATS_MAX) /* csv_shape's modules x formats */

/* Splits line (modified) at commas into f[CSV_FIELDS]; the count. */
static int split_fields(char *line, char **f) {
    int n = 0;
    for (char *p = line; n < CSV_FIELDS;) {
        f[n++] = p;
        char *c = strchr(p, ',');
        if (!c) break;
        *c = '\0', p = c + 1;
    }
    return n;
}

static bool parse_num(const char *s, double *v) {
    char *end = NULL;
    *v = strtod(s, &end);
    return *s && !*end;
}

static QtStatus csv_bad(QtError *err, const char *path, int line, const char *what) {
    return qt_error_set(err, QT_ERR_ARG, "%s:%d: %s; give the sensitivity.csv that qtrain sensitivity wrote", path,
                        line, what);
}

/* Row fields into entry e and the table's identity (the first row sets it, the others must agree). */
static QtStatus csv_row(char **f, SensTable *t, SensEntry *e, bool first, const char *path, int line,
                        QtError *err) {
    double v[8];
    const int num_idx[8] = {1, 2, 5, 6, 7, 8, 9, 13};
    for (int i = 0; i < 8; i++)
        if (!parse_num(f[num_idx[i]], &v[i])) return csv_bad(err, path, line, "a number is malformed");
    /* params, fan_in, tile, bits, examples: whole numbers a model can have, before they are cast */
    const int int_idx[5] = {0, 1, 2, 4, 7};
    for (int i = 0; i < 5; i++)
        if (!(v[int_idx[i]] >= -1.0 && v[int_idx[i]] <= 9007199254740992.0) || v[int_idx[i]] != floor(v[int_idx[i]]) ||
            (int_idx[i] != 4 && int_idx[i] != 0 && v[int_idx[i]] > (double)INT32_MAX))
            return csv_bad(err, path, line, "a count (params, fan_in, tile, bits or examples) is out of range");
    if (strlen(f[0]) >= MODULE_NAME_MAX || strlen(f[3]) >= SENS_FORMAT_NAME_MAX || strlen(f[4]) >= SENS_FORMAT_NAME_MAX ||
        strlen(f[12]) >= sizeof t->split || strlen(f[14]) != 64 || strlen(f[15]) != 64)
        return csv_bad(err, path, line, "a name or hash has the wrong length");
    snprintf(e->module, sizeof e->module, "%s", f[0]);
    e->params = (int64_t)v[0], e->fan_in = (int)v[1];
    snprintf(e->format, sizeof e->format, "%s", f[3]);
    snprintf(e->layout, sizeof e->layout, "%s", f[4]);
    e->tile = (int)v[2], e->bits_per_param = v[3], e->bits = (int64_t)v[4];
    e->delta_loss = v[5], e->delta_accuracy = v[6];
    double base_loss = 0, base_acc = 0;
    if (!parse_num(f[10], &base_loss) || !parse_num(f[11], &base_acc))
        return csv_bad(err, path, line, "base_loss or base_accuracy is malformed");
    if (e->bits == -1 && !isfinite(e->delta_loss)) /* a format that does not fit the module */
        snprintf(e->note, sizeof e->note, "%s", "the format does not fit this module");
    else if (e->params < 1 || e->bits < 1 || !isfinite(e->delta_loss))
        return csv_bad(err, path, line, "params, bits or delta_loss is out of range");
    if (first) {
        t->base_loss = base_loss, t->base_accuracy = base_acc;
        snprintf(t->split, sizeof t->split, "%s", f[12]);
        t->examples = (int)v[7];
        snprintf(t->weights_sha256, sizeof t->weights_sha256, "%s", f[14]);
        snprintf(t->data_sha256, sizeof t->data_sha256, "%s", f[15]);
    } else if (strcmp(t->split, f[12]) != 0 || strcmp(t->weights_sha256, f[14]) != 0 ||
               strcmp(t->data_sha256, f[15]) != 0)
        return csv_bad(err, path, line, "its split or hashes differ from the first row's (rows of two measurements)");
    return QT_OK;
}

/* The table's shape from its rows: modules in order of appearance, formats likewise, every pair once. */
static QtStatus csv_shape(SensTable *t, SensEntry *rows, int n, const char *path, QtError *err) {
    int nm = 0, nf = 0;
    char mods[256][MODULE_NAME_MAX];
    for (int i = 0; i < n; i++) {
        int m = 0, f = 0;
        while (m < nm && strcmp(mods[m], rows[i].module) != 0) m++;
        if (m == nm) {
            if (nm == 256) return csv_bad(err, path, i + 2, "more than 256 modules");
            snprintf(mods[nm++], MODULE_NAME_MAX, "%s", rows[i].module);
        }
        while (f < nf && strcmp(t->formats[f].name, rows[i].format) != 0) f++;
        if (f == nf) {
            if (nf == SENS_FORMATS_MAX) return csv_bad(err, path, i + 2, "more than 8 formats");
            QtError e = {0};
            int got = 0;
            if (sens_parse_formats(rows[i].format, &t->formats[nf], 1, &got, &e) != QT_OK)
                return csv_bad(err, path, i + 2, e.msg);
            nf++;
        }
    }
    if (nm * nf != n)
        return qt_error_set(err, QT_ERR_ARG, "%s: %d rows, but %d modules x %d formats need %d; give the "
                            "sensitivity.csv that qtrain sensitivity wrote", path, n, nm, nf, nm * nf);
    t->entries = calloc((size_t)n, sizeof *t->entries);
    if (!t->entries) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    t->n_modules = nm, t->n_formats = nf;
    char *seen = calloc((size_t)n, 1);
    if (!seen) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n; i++) {
        int m = 0, f = 0;
        while (strcmp(mods[m], rows[i].module) != 0) m++;
        while (strcmp(t->formats[f].name, rows[i].format) != 0) f++;
        if (seen[m * nf + f]++) st = csv_bad(err, path, i + 2, "a module and format repeat an earlier row");
        else t->entries[m * nf + f] = rows[i];
    }
    free(seen);
    return st;
}

QtStatus sens_read_csv(const char *path, SensTable *t, QtError *err) {
    memset(t, 0, sizeof *t);
    FILE *fp = fopen(path, "r");
    if (!fp)
        return qt_error_set(err, QT_ERR_ARG, "--sensitivity %s: %s; give the sensitivity.csv qtrain sensitivity "
                            "wrote", path, strerror(errno));
    char line[1024];
    int n = 0, cap = 64, lineno = 1;
    SensEntry *rows = malloc((size_t)cap * sizeof *rows);
    QtStatus st = rows ? QT_OK : qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK && (!fgets(line, sizeof line, fp) || strncmp(line, CSV_HEADER, strlen(CSV_HEADER)) != 0))
        st = csv_bad(err, path, 1, "the header is not qtrain sensitivity's");
    while (st == QT_OK && fgets(line, sizeof line, fp)) {
        lineno++;
        line[strcspn(line, "\r\n")] = '\0';
        if (!line[0]) continue;
        char *f[CSV_FIELDS];
        if (split_fields(line, f) != CSV_FIELDS) {
            st = csv_bad(err, path, lineno, "it does not have 16 fields");
            break;
        }
        if (n == SENS_CSV_ROWS_MAX) { /* more modules x formats than a table can hold: not ours */
            st = csv_bad(err, path, lineno, "it has more rows than 256 modules x 8 formats");
            break;
        }
        if (n == cap) {
            SensEntry *r = realloc(rows, (size_t)(cap *= 2) * sizeof *rows);
            if (!r) {
                st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
                break;
            }
            rows = r;
        }
        st = csv_row(f, t, &rows[n], n == 0, path, lineno, err);
        n++;
    }
    fclose(fp);
    if (st == QT_OK && n == 0) st = csv_bad(err, path, 2, "it has no rows");
    if (st == QT_OK) st = csv_shape(t, rows, n, path, err);
    free(rows);
    if (st != QT_OK) sens_table_free(t);
    return st;
}

QtStatus sens_check_csv(const SensTable *csv, const char *path, const SensTable *now, QtError *err) {
    const char *hint = "run qtrain sensitivity (or autoquant without --sensitivity) on this config and checkpoint";
    bool same = csv->n_modules == now->n_modules;
    for (int m = 0; same && m < csv->n_modules; m++) {
        const SensEntry *a = &csv->entries[m * csv->n_formats], *b = &now->entries[m * (now->n_formats ? now->n_formats : 1)];
        same = strcmp(a->module, b->module) == 0 && a->params == b->params;
    }
    bool prefix = !same && csv->n_modules < now->n_modules; /* a table cut short: its modules the model's first */
    for (int m = 0; prefix && m < csv->n_modules; m++) {
        const SensEntry *a = &csv->entries[m * csv->n_formats], *b = &now->entries[m * (now->n_formats ? now->n_formats : 1)];
        prefix = strcmp(a->module, b->module) == 0 && a->params == b->params;
    }
    if (prefix)
        return qt_error_set(err, QT_ERR_ARG, "--sensitivity %s is incomplete: it has %d of this model's %d modules "
                            "(a measurement cut short?); %s", path, csv->n_modules, now->n_modules, hint);
    if (!same)
        return qt_error_set(err, QT_ERR_ARG, "--sensitivity %s was measured on another model (its modules or their "
                            "sizes differ from this config's); %s", path, hint);
    if (strcmp(csv->weights_sha256, now->weights_sha256) != 0)
        return qt_error_set(err, QT_ERR_ARG, "--sensitivity %s was measured on other weights (weights_sha256 %.12s..., "
                            "this checkpoint's %.12s...); %s", path, csv->weights_sha256, now->weights_sha256, hint);
    if (strcmp(csv->data_sha256, now->data_sha256) != 0)
        return qt_error_set(err, QT_ERR_ARG, "--sensitivity %s was measured with another data section of the config "
                            "or another quant.fold_bn (data_sha256 differs); %s", path, hint);
    if (strcmp(csv->split, now->split) != 0)
        return qt_error_set(err, QT_ERR_ARG, "--sensitivity %s was measured on the %s split, this run uses %s; %s",
                            path, csv->split, now->split, hint);
    return QT_OK;
}

QtStatus sens_table_select_formats(const SensTable *t, const SensFormat *formats, int n, SensTable *out,
                                   QtError *err) {
    *out = *t;
    out->entries = calloc((size_t)t->n_modules * (size_t)n, sizeof *out->entries);
    if (!out->entries) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    out->n_formats = n;
    for (int f = 0; f < n; f++) {
        int k = 0;
        while (k < t->n_formats && strcmp(t->formats[k].name, formats[f].name) != 0) k++;
        if (k == t->n_formats) {
            free(out->entries);
            out->entries = NULL;
            return qt_error_set(err, QT_ERR_ARG, "the sensitivity table has no format %s; measure it (qtrain "
                                "sensitivity --formats ...) or leave it out of --formats", formats[f].name);
        }
        out->formats[f] = t->formats[k];
        for (int m = 0; m < t->n_modules; m++) out->entries[m * n + f] = t->entries[m * t->n_formats + k];
    }
    return QT_OK;
}

/* ---- choosing ----------------------------------------------------------------------------------- */

#define KNAPSACK_UNITS_MAX (1 << 20) /* the DP's columns at most: sens_choose coarsens the unit above this */

static int64_t units_of(int64_t bits, int64_t unit) { return (bits + unit - 1) / unit; }

QtStatus sens_knapsack(int n_modules, int k, const int64_t *bits, const double *delta, int64_t max_bits,
                       int64_t unit, int *choice, QtError *err) {
    if (n_modules < 1 || k < 1 || k > 127)
        return qt_error_set(err, QT_ERR_ARG, "sens_knapsack: %d modules of %d options", n_modules, k);
    if (unit < 1) unit = 1;
    int64_t least = 0, most = 0;
    for (int m = 0; m < n_modules; m++) {
        int64_t lo = -1, hi = 0;
        for (int j = 0; j < k; j++) {
            int64_t b = bits[m * k + j];
            if (b < 0) continue;
            if (lo < 0 || b < lo) lo = b;
            if (b > hi) hi = b;
        }
        if (lo < 0) return qt_error_set(err, QT_ERR_ARG, "module %d has no option", m);
        least += units_of(lo, unit) * unit, most += units_of(hi, unit);
    }
    if (least > max_bits)
        return qt_error_set(err, QT_ERR_ARG, "no choice fits in %lld bits: the least is %lld", (long long)max_bits,
                            (long long)least);
    int64_t cap = max_bits / unit;
    if (cap > most) cap = most; /* more room than the largest choice needs changes nothing */
    size_t w = (size_t)cap + 1;
    double *dp = malloc(w * sizeof *dp), *nd = malloc(w * sizeof *nd);
    signed char *pick = malloc((size_t)n_modules * w);
    if (!dp || !nd || !pick) {
        free(dp), free(nd), free(pick);
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory for the knapsack (%d modules x %zu units)", n_modules, w);
    }
    /* dp[c]: the least delta of the modules so far with their bits at most c units */
    for (size_t c = 0; c < w; c++) dp[c] = 0.0;
    for (int m = 0; m < n_modules; m++) {
        signed char *pm = pick + (size_t)m * w;
        for (size_t c = 0; c < w; c++) {
            nd[c] = INFINITY, pm[c] = -1;
            for (int j = 0; j < k; j++) {
                int64_t b = bits[m * k + j];
                if (b < 0) continue;
                int64_t u = units_of(b, unit);
                if ((size_t)u > c || !isfinite(dp[c - (size_t)u])) continue;
                double v = dp[c - (size_t)u] + delta[m * k + j];
                if (v < nd[c]) nd[c] = v, pm[c] = (signed char)j;
            }
        }
        double *s = dp;
        dp = nd, nd = s;
    }
    double best = dp[w - 1];
    size_t c = w - 1;
    /* the fewest bits that reach the least delta (to rounding) */
    for (size_t i = 0; i < w; i++)
        if (dp[i] <= best + 1e-12 * (1.0 + fabs(best))) {
            c = i;
            break;
        }
    for (int m = n_modules - 1; m >= 0; m--) {
        int j = pick[(size_t)m * w + c];
        choice[m] = j;
        c -= (size_t)units_of(bits[m * k + j], unit);
    }
    free(dp), free(nd), free(pick);
    return QT_OK;
}

QtStatus sens_choose(const SensTable *t, double budget, int *choice, QtError *err) {
    int k = t->n_formats + 1, nm = t->n_modules; /* the formats, then float32 */
    int64_t *bits = malloc((size_t)nm * (size_t)k * sizeof *bits);
    double *delta = malloc((size_t)nm * (size_t)k * sizeof *delta);
    int *pick = malloc((size_t)nm * sizeof *pick);
    if (!bits || !delta || !pick) {
        free(bits), free(delta), free(pick);
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    }
    int64_t params = 0, least = 0;
    for (int m = 0; m < nm; m++) {
        const SensEntry *row = &t->entries[m * t->n_formats];
        params += row->params;
        int64_t lo = 32 * row->params;
        for (int f = 0; f < t->n_formats; f++) {
            bits[m * k + f] = row[f].bits, delta[m * k + f] = row[f].delta_loss; /* bits -1: no option */
            if (row[f].bits >= 0 && row[f].bits < lo) lo = row[f].bits;
        }
        bits[m * k + t->n_formats] = 32 * row->params, delta[m * k + t->n_formats] = 0.0;
        least += lo;
    }
    double least_bpp = (double)least / (double)params;
    QtStatus st = QT_OK;
    if (!(budget >= least_bpp))
        st = qt_error_set(err, QT_ERR_ARG, "--budget %g bits per weight is below %.4f, the least these formats reach "
                          "(each module in its smallest format); give a larger budget or a smaller format", budget,
                          least_bpp);
    int64_t max_bits = (int64_t)floor(budget * (double)params + 1e-9);
    int64_t unit = 8; /* the storage is whole bytes */
    if (max_bits / unit > KNAPSACK_UNITS_MAX) unit = (max_bits + KNAPSACK_UNITS_MAX - 1) / KNAPSACK_UNITS_MAX;
    if (st == QT_OK) st = sens_knapsack(nm, k, bits, delta, max_bits, unit, pick, err);
    for (int m = 0; st == QT_OK && m < nm; m++) choice[m] = pick[m] == t->n_formats ? -1 : pick[m];
    free(bits), free(delta), free(pick);
    return st;
}
