/* compare.c - runs side by side: a table, compare.md and an SVG chart. */
#include "compare.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/fsutil.h"

#include "trainer/train.h"

/* ---- reading a run --------------------------------------------------------------------- */

static char *read_text(const char *path, QtError *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        qt_error_set(err, QT_ERR_IO, "cannot read %s: %s (a run writes it when it finishes)", path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += got;
        if (len + 1 == cap) {
            char *b = realloc(buf, cap * 2);
            if (!b) free(buf);
            buf = b, cap *= 2;
        }
    }
    fclose(f);
    if (!buf) qt_error_set(err, QT_ERR_NOMEM, "out of memory reading %s", path);
    else buf[len] = '\0';
    return buf;
}

/* The value of "key" in our flat summary.json: a string (unescaped into
 * out), a number or null. Returns false if the key is absent. */
static bool json_find(const char *text, const char *key, char *out, size_t cap) {
    char pat[96];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(text, pat);
    if (!p) return false;
    p += strlen(pat);
    while (*p == ' ') p++;
    size_t n = 0;
    if (*p == '"') {
        for (p++; *p && *p != '"' && n + 1 < cap; p++) {
            if (*p == '\\' && p[1]) p++;
            out[n++] = *p;
        }
    } else {
        while (*p && *p != ',' && *p != '\n' && *p != '}' && n + 1 < cap) out[n++] = *p++;
    }
    out[n] = '\0';
    return true;
}

static double json_number_or(const char *text, const char *key, double dflt) {
    char v[64];
    if (!json_find(text, key, v, sizeof v) || strcmp(v, "null") == 0) return dflt;
    char *end = NULL;
    double d = strtod(v, &end);
    return end != v ? d : dflt;
}

static void json_string_or(const char *text, const char *key, const char *dflt, char *out, size_t cap) {
    if (!json_find(text, key, out, cap) || !out[0]) snprintf(out, cap, "%s", dflt);
}

/* The train rows of metrics.csv: (step, loss). A row whose step or loss is
 * not a finite number (a damaged or hand-edited file) is skipped with a
 * warning naming the file and line: an infinite step or loss has no place
 * on the chart's axes. */
static QtStatus read_curve(CompareRun *r, const char *path, QtError *err) {
    char *text = read_text(path, err);
    if (!text) return err->status;
    size_t cap = 64;
    r->steps = malloc(cap * sizeof(double));
    r->losses = malloc(cap * sizeof(double));
    QtStatus st = r->steps && r->losses ? QT_OK : qt_error_set(err, QT_ERR_NOMEM, "out of memory reading %s", path);
    int line_no = 0;
    for (char *line = text, *next; st == QT_OK && line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        line_no++;
        double step, epoch, loss;
        if (strncmp(line, "train,", 6) != 0 || sscanf(line + 6, "%lf,%lf,%lf", &step, &epoch, &loss) != 3) continue;
        if (!isfinite(step) || !isfinite(loss) || step < 0) {
            fprintf(stderr, "qtrain: warning: %s:%d: a train row with step %g and loss %g is skipped (the step must "
                    "be a finite count and the loss finite)\n", path, line_no, step, loss);
            continue;
        }
        if ((size_t)r->n_points == cap) {
            cap *= 2;
            double *s = realloc(r->steps, cap * sizeof(double)), *l = s ? realloc(r->losses, cap * sizeof(double)) : NULL;
            if (s) r->steps = s;
            if (l) r->losses = l;
            if (!s || !l) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory reading %s", path);
        }
        if (st == QT_OK) r->steps[r->n_points] = step, r->losses[r->n_points++] = loss;
    }
    free(text);
    return st;
}

QtStatus compare_load_run(CompareRun *r, const char *dir, QtError *err) {
    memset(r, 0, sizeof *r);
    snprintf(r->dir, sizeof r->dir, "%s", dir);
    char path[1100];
    snprintf(path, sizeof path, "%s/summary.json", dir);
    char *text = read_text(path, err);
    if (!text) return err->status;
    QtStatus st = QT_OK;
    if (!strstr(text, "\"test_accuracy\"") && !strstr(text, "\"test_mse\""))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s is not a qtrain summary (no test_accuracy or test_mse)", path);
    if (st == QT_OK) {
        json_string_or(text, "name", dir, r->name, sizeof r->name);
        json_string_or(text, "mode", "float", r->mode, sizeof r->mode);
        /* summaries written before these keys existed: known for a float run only */
        bool fl = strcmp(r->mode, "float") == 0 || strcmp(r->mode, "lora") == 0;
        json_string_or(text, "weight_formats", fl ? "float32" : "?", r->weights, sizeof r->weights);
        json_string_or(text, "act_formats", fl ? "none" : "?", r->acts, sizeof r->acts);
        json_string_or(text, "bwd_format", "none", r->bwd, sizeof r->bwd);
        r->bits_per_param = json_number_or(text, "base_bits_per_param", 32.0);
        r->model_bytes = (int64_t)json_number_or(text, "model_bytes", 0.0);
        r->test_accuracy = json_number_or(text, "test_accuracy", NAN);
        r->mse = strstr(text, "\"test_mse\"") != NULL;
        r->test_mse = json_number_or(text, "test_mse", NAN);
        r->samples_per_s = json_number_or(text, "samples_per_s", 0.0);
        r->wall_s = json_number_or(text, "wall_s", 0.0);
    }
    free(text);
    snprintf(path, sizeof path, "%s/metrics.csv", dir);
    if (st == QT_OK) st = read_curve(r, path, err);
    if (st != QT_OK) compare_run_free(r);
    return st;
}

void compare_run_free(CompareRun *r) {
    free(r->steps);
    free(r->losses);
    r->steps = r->losses = NULL;
    r->n_points = 0;
}

/* ---- the table ----------------------------------------------------------------------------- */

/* The first float run that reports as `mse` does (accuracy or mse), or -1. */
static int first_float(const CompareRun *runs, int n, bool mse) {
    for (int i = 0; i < n; i++)
        if (strcmp(runs[i].mode, "float") == 0 && runs[i].mse == mse) return i;
    return -1;
}

/* How many of the runs are mse runs. */
static int count_mse(const CompareRun *runs, int n) {
    int k = 0;
    for (int i = 0; i < n; i++) k += runs[i].mse;
    return k;
}

static void write_table(FILE *f, const CompareRun *runs, int n) {
    int n_mse = count_mse(runs, n);
    int base = first_float(runs, n, n_mse == n), base_acc = first_float(runs, n, false);
    int base_mse = first_float(runs, n, true);
    const char *metric = n_mse == 0 ? "test acc" : n_mse == n ? "test mse" : "test acc (mse for mse runs)";
    if (base < 0) base = base_acc >= 0 ? base_acc : base_mse;
    fprintf(f, "| run | mode | weights | acts | bwd | bits/param | model KiB | %s | Δ vs %s | samples/s | wall s |\n",
            metric, base >= 0 ? runs[base].name : "float (none)");
    fprintf(f, "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (int i = 0; i < n; i++) {
        const CompareRun *r = &runs[i];
        char delta[32] = "-", value[32];
        /* each kind against the first float run of its kind */
        int b = r->mse ? base_mse : base_acc;
        if (r->mse) {
            snprintf(value, sizeof value, "%.4f", r->test_mse);
            if (b >= 0 && isfinite(r->test_mse) && isfinite(runs[b].test_mse))
                snprintf(delta, sizeof delta, "%+.4f", r->test_mse - runs[b].test_mse);
        } else {
            snprintf(value, sizeof value, "%.2f %%", 100.0 * r->test_accuracy);
            if (b >= 0 && isfinite(r->test_accuracy) && isfinite(runs[b].test_accuracy))
                snprintf(delta, sizeof delta, "%+.2f", 100.0 * (r->test_accuracy - runs[b].test_accuracy));
        }
        fprintf(f, "| %s | %s | %s | %s | %s | %.3f | %.1f | %s | %s | %.0f | %.1f |\n", r->name, r->mode,
                r->weights, r->acts, r->bwd, r->bits_per_param, (double)r->model_bytes / 1024.0, value, delta,
                r->samples_per_s, r->wall_s);
    }
}

/* ---- the chart --------------------------------------------------------------------------------- */

static const char *const COLORS[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                     "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
#define N_COLORS (sizeof COLORS / sizeof COLORS[0])

typedef struct {
    double x0, y0, w, h;         /* the plot area in SVG units */
    double xmin, xmax, ymin, ymax;
} Panel;

static double px(const Panel *p, double x) { return p->x0 + (x - p->xmin) / (p->xmax - p->xmin) * p->w; }
static double py(const Panel *p, double y) { return p->y0 + p->h - (y - p->ymin) / (p->ymax - p->ymin) * p->h; }

static void svg_text_escaped(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else fputc(*s, f);
    }
}

static void svg_frame(FILE *f, const Panel *p, const char *title, const char *xlabel, const char *ylabel) {
    fprintf(f, "<rect x='%.1f' y='%.1f' width='%.1f' height='%.1f' fill='none' stroke='#444'/>\n", p->x0, p->y0, p->w,
            p->h);
    fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle' font-size='15'>%s</text>\n", p->x0 + p->w / 2,
            p->y0 - 12, title);
    fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle'>%s</text>\n", p->x0 + p->w / 2, p->y0 + p->h + 38,
            xlabel);
    fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle' transform='rotate(-90 %.1f %.1f)'>%s</text>\n",
            p->x0 - 48, p->y0 + p->h / 2, p->x0 - 48, p->y0 + p->h / 2, ylabel);
}

/* Ticks per axis at most: nice_step aims at ~5, and every tick loop counts
 * its ticks, so no span (1e-19 wide, 1e300 long) can make it run away. */
#define TICKS_MAX 20

static void svg_yticks(FILE *f, const Panel *p, double step, const char *fmt) {
    double first = ceil(p->ymin / step) * step;
    for (int k = 0; k < TICKS_MAX && isfinite(first); k++) {
        double y = first + k * step;
        if (y > p->ymax + 1e-6 * step) break;
        fprintf(f, "<line x1='%.1f' x2='%.1f' y1='%.1f' y2='%.1f' stroke='#ddd'/>\n", p->x0, p->x0 + p->w, py(p, y),
                py(p, y));
        fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='end'>", p->x0 - 6, py(p, y) + 4);
        fprintf(f, fmt, y);
        fputs("</text>\n", f);
    }
}

static double nice_step(double span) {
    if (!(span > 0) || !isfinite(span)) return 1.0; /* no data: any step; the tick loops count */
    double raw = span / 5.0, mag = pow(10.0, floor(log10(raw)));
    double r = raw / mag;
    return (r < 1.5 ? 1.0 : r < 3.5 ? 2.0 : r < 7.5 ? 5.0 : 10.0) * mag;
}

/* What the left panel plots of a run: accuracy (%), or with mse the test mse. */
static double panel_value(const CompareRun *r, bool mse) { return mse ? r->test_mse : 100.0 * r->test_accuracy; }

/* Accuracy (%) against log2 bits per parameter; when every run is an mse
 * run, test mse instead (in a mix, the mse runs have no point here). */
static void svg_accuracy_panel(FILE *f, const CompareRun *runs, int n) {
    bool mse = n > 0 && count_mse(runs, n) == n;
    Panel p = {80, 50, 400, 320, 1.0, 5.0, mse ? INFINITY : 100.0, 0.0};
    for (int i = 0; i < n; i++) {
        double a = panel_value(&runs[i], mse);
        if (!isfinite(a)) continue;
        p.ymin = fmin(p.ymin, a), p.ymax = fmax(p.ymax, a);
    }
    if (p.ymin > p.ymax) p.ymin = 0, p.ymax = mse ? 1.0 : 100;
    if (mse) {
        double pad = fmax(1e-3, 0.1 * (p.ymax - p.ymin));
        p.ymin = fmax(0.0, p.ymin - pad), p.ymax += pad;
    } else {
        double pad = fmax(1.0, 0.1 * (p.ymax - p.ymin));
        p.ymin = fmax(0.0, p.ymin - pad), p.ymax = fmin(100.0, p.ymax + pad);
    }
    if (p.ymax - p.ymin < 1e-6) p.ymax = p.ymin + (mse ? 1e-3 : 1.0);
    svg_frame(f, &p, mse ? "test mse vs bits per parameter" : "test accuracy vs bits per parameter",
              "bits per base parameter (log2 axis)", mse ? "test mse (lower is better)" : "test accuracy (%)");
    svg_yticks(f, &p, nice_step(p.ymax - p.ymin), mse ? "%.3g" : "%.1f");
    for (int b = 1; b <= 5; b++)
        fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle'>%d</text>\n", px(&p, b), p.y0 + p.h + 18, 1 << b);
    for (int i = 0; i < n; i++) {
        if (!isfinite(panel_value(&runs[i], mse))) continue;
        double x = px(&p, log2(fmin(fmax(runs[i].bits_per_param, 2.0), 32.0)));
        double y = py(&p, panel_value(&runs[i], mse));
        fprintf(f, "<circle cx='%.1f' cy='%.1f' r='5' fill='%s'/>\n", x, y, COLORS[(size_t)i % N_COLORS]);
        fprintf(f, "<text x='%.1f' y='%.1f' font-size='11'>", x + 8, y - 6 - 12.0 * (i % 2));
        svg_text_escaped(f, runs[i].name);
        fputs("</text>\n", f);
    }
}

/* Training loss against the step, every run. */
static void svg_loss_panel(FILE *f, const CompareRun *runs, int n) {
    Panel p = {600, 50, 400, 320, 0.0, 1.0, 0.0, 0.0};
    for (int i = 0; i < n; i++)
        for (int k = 0; k < runs[i].n_points; k++) {
            p.xmax = fmax(p.xmax, runs[i].steps[k]);
            if (isfinite(runs[i].losses[k])) p.ymax = fmax(p.ymax, runs[i].losses[k]);
        }
    if (p.ymax <= 0) p.ymax = 1.0;
    p.ymax *= 1.05;
    svg_frame(f, &p, "training loss", "step", "mean loss per logged window");
    svg_yticks(f, &p, nice_step(p.ymax), "%.2g");
    double xs = nice_step(p.xmax);
    for (int k = 0; k < TICKS_MAX && k * xs <= p.xmax + 1e-6 * xs; k++)
        fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle'>%.0f</text>\n", px(&p, k * xs), p.y0 + p.h + 18,
                k * xs);
    for (int i = 0; i < n; i++) {
        const char *color = COLORS[(size_t)i % N_COLORS];
        if (runs[i].n_points > 0) {
            fprintf(f, "<polyline fill='none' stroke='%s' stroke-width='1.5' points='", color);
            for (int k = 0; k < runs[i].n_points; k++)
                if (isfinite(runs[i].losses[k]))
                    fprintf(f, "%.1f,%.1f ", px(&p, runs[i].steps[k]), py(&p, runs[i].losses[k]));
            fputs("'/>\n", f);
        }
        double ly = p.y0 + 14 + 16.0 * i;
        fprintf(f, "<line x1='%.1f' x2='%.1f' y1='%.1f' y2='%.1f' stroke='%s' stroke-width='3'/>\n", p.x0 + p.w + 12,
                p.x0 + p.w + 32, ly - 4, ly - 4, color);
        fprintf(f, "<text x='%.1f' y='%.1f' font-size='11'>", p.x0 + p.w + 36, ly);
        svg_text_escaped(f, runs[i].name);
        fprintf(f, "%s</text>\n", runs[i].n_points ? "" : " (no steps)");
    }
}

/* An output file of compare: a temp file (fs_fopen_tmp) that out_close
 * renames onto path. */
static FILE *out_open(const char *path, char *tmp, size_t cap, QtError *err) {
    fs_remove_stale_tmps_of(path, 0);
    FILE *f = fs_fopen_tmp(path, tmp, cap);
    if (!f) qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; give another --out", tmp, strerror(errno));
    return f;
}

/* compare.md and compare.svg are qtrain's own outputs in a directory given
 * for them: a regular file there is replaced, as eval.json is; a symlink,
 * device or FIFO never (fs_check_out_path). */
static QtStatus out_close(FILE *f, const char *tmp, const char *path, QtError *err) {
    if (fs_fcommit_tmp(f, tmp, path, FS_REPLACE_REGULAR) == 0) return QT_OK;
    if (errno == EEXIST)
        return qt_error_set(err, QT_ERR_IO, "cannot write %s: it is no longer a regular file; nothing was replaced",
                            path);
    return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; free disk space or give another --out", path,
                        strerror(errno));
}

static QtStatus write_svg(const char *path, const CompareRun *runs, int n, QtError *err) {
    char tmp[1200];
    FILE *f = out_open(path, tmp, sizeof tmp, err);
    if (!f) return QT_ERR_IO;
    fprintf(f, "<svg xmlns='http://www.w3.org/2000/svg' width='1180' height='440' font-family='sans-serif' "
               "font-size='12'>\n<rect width='100%%' height='100%%' fill='white'/>\n");
    svg_accuracy_panel(f, runs, n);
    svg_loss_panel(f, runs, n);
    fputs("</svg>\n", f);
    return out_close(f, tmp, path, err);
}

QtStatus compare_write(const CompareRun *runs, int n, const char *out_dir, FILE *table, QtError *err) {
    struct stat sb;
    if (lstat(out_dir, &sb) == 0 && !S_ISDIR(sb.st_mode))
        return qt_error_set(err, QT_ERR_ARG, "--out %s is not a directory (%s); give a directory", out_dir,
                            S_ISLNK(sb.st_mode) ? "a symbolic link" : "another kind of file");
    /* with its parents: the default runs/compare in a fresh directory has none */
    QtStatus st = train_make_dirs(out_dir, "--out", NULL, 0, err);
    if (st != QT_OK) return st;
    char path[1100], svg[1100], tmp[1200];
    snprintf(path, sizeof path, "%s/compare.md", out_dir);
    snprintf(svg, sizeof svg, "%s/compare.svg", out_dir);
    /* both checked before either is written */
    st = fs_check_out_path(path, true, "compare --out:", err);
    if (st == QT_OK) st = fs_check_out_path(svg, true, "compare --out:", err);
    if (st != QT_OK) return st;
    if (table) write_table(table, runs, n);
    FILE *f = out_open(path, tmp, sizeof tmp, err);
    if (!f) return QT_ERR_IO;
    fprintf(f, "# Runs compared\n\n");
    write_table(f, runs, n);
    fprintf(f, "\nbits/param: bytes held for the frozen base (quantized weights with their scales, and float "
               "parameters) x 8 / its parameters; 32 for a float model. Runs:");
    for (int i = 0; i < n; i++) fprintf(f, "%s `%s`", i ? "," : "", runs[i].dir);
    bool mse = n > 0 && count_mse(runs, n) == n;
    if (count_mse(runs, n) > 0)
        fprintf(f, ".\n\ntest mse: the mean squared error over every output value of a `train.loss: mse` run "
                   "(lower is better); its Δ is against the first float mse run");
    fprintf(f, ".\n\n![%s vs bits per parameter, and training loss](compare.svg)\n", mse ? "mse" : "accuracy");
    if ((st = out_close(f, tmp, path, err)) != QT_OK) return st;
    return write_svg(svg, runs, n, err);
}
