/* autoquant.c - `qtrain sensitivity` and `qtrain autoquant` (trainer/sensitivity.h): the per-module
 * sensitivity table on stdout, as CSV and as an SVG chart; a format per module under a bits-per-weight budget,
 * written as a PTQ config and evaluated beside uniform int4 and nf4 per channel. */
#include "autoquant.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/fsutil.h"
#include "trainer/sensitivity.h"
#include "trainer/train.h"

#define AQ_OVERRIDES_MAX 64

typedef struct {
    const char *config, *checkpoint, *formats, *out, *sensitivity;
    double budget;
    bool have_budget, use_test, force, quiet, formats_given;
    const char *overrides[AQ_OVERRIDES_MAX];
    int n_overrides;
} AqArgs;

static int aq_fail(const QtError *err) {
    fprintf(stderr, "qtrain: error: %s\n", err->msg);
    return err->status == QT_ERR_CONFIG || err->status == QT_ERR_ARG ? 2 : 1;
}

static int aq_usage(const char *cmd, const char *fmt, const char *what) {
    fprintf(stderr, "qtrain %s: ", cmd);
    fprintf(stderr, fmt, what);
    fprintf(stderr, " (see qtrain %s --help)\n", cmd);
    return 2;
}

/* Parses the options; 0 or the exit status of a usage error. */
static int aq_parse(int argc, char **argv, const char *cmd, bool autoquant, AqArgs *a) {
    memset(a, 0, sizeof *a);
    a->formats = SENS_DEFAULT_FORMATS;
    for (int i = 0; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool takes = strcmp(o, "--config") == 0 || strcmp(o, "--checkpoint") == 0 || strcmp(o, "--formats") == 0 ||
                     strcmp(o, "--out") == 0 || strcmp(o, "--split") == 0 || strcmp(o, "--set") == 0 ||
                     (autoquant && (strcmp(o, "--budget") == 0 || strcmp(o, "--sensitivity") == 0));
        if (takes && !v) return aq_usage(cmd, "%s needs a value", o);
        if (strcmp(o, "--config") == 0) a->config = v, i++;
        else if (strcmp(o, "--checkpoint") == 0) a->checkpoint = v, i++;
        else if (strcmp(o, "--formats") == 0) a->formats = v, a->formats_given = true, i++;
        else if (strcmp(o, "--out") == 0) a->out = v, i++;
        else if (strcmp(o, "--split") == 0) {
            if (strcmp(v, "test") != 0 && strcmp(v, "val") != 0)
                return aq_usage(cmd, "--split is val (the validation split, or the training set's last 10%) "
                                "or test, not '%s'", v);
            a->use_test = strcmp(v, "test") == 0, i++;
        } else if (strcmp(o, "--set") == 0) {
            if (a->n_overrides == AQ_OVERRIDES_MAX) return aq_usage(cmd, "%s", "too many --set options");
            a->overrides[a->n_overrides++] = v, i++;
        } else if (autoquant && strcmp(o, "--sensitivity") == 0) a->sensitivity = v, i++;
        else if (autoquant && strcmp(o, "--budget") == 0) {
            char *end = NULL;
            a->budget = strtod(v, &end);
            if (!*v || *end || !isfinite(a->budget) || a->budget <= 0)
                return aq_usage(cmd, "--budget needs bits per weight > 0, e.g. 4.5, not '%s'", v);
            a->have_budget = true, i++;
        } else if (strcmp(o, "--force") == 0) a->force = true;
        else if (strcmp(o, "--quiet") == 0 || strcmp(o, "-q") == 0) a->quiet = true;
        else return aq_usage(cmd, "unknown option '%s'", o);
    }
    if (!a->config) return aq_usage(cmd, "%s", "--config FILE is required (the float model's config)");
    if (!a->checkpoint) return aq_usage(cmd, "%s", "--checkpoint PATH is required (the float checkpoint)");
    if (autoquant && !a->have_budget) return aq_usage(cmd, "%s", "--budget BITS_PER_WEIGHT is required, e.g. 4.5");
    struct stat sb;
    if (stat(a->checkpoint, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fprintf(stderr, "qtrain: error: --checkpoint %s: %s; give the float checkpoint (e.g. runs/pretrain/final.h5)\n",
                a->checkpoint, stat(a->checkpoint, &sb) != 0 ? strerror(errno) : "not a regular file");
        return 2;
    }
    return 0;
}

/* DIR: --out, else `leaf` beside the checkpoint. */
static void aq_out_dir(const AqArgs *a, const char *leaf, char *dir, size_t cap) {
    if (a->out) {
        snprintf(dir, cap, "%s", a->out);
        return;
    }
    const char *slash = strrchr(a->checkpoint, '/');
    if (slash) snprintf(dir, cap, "%.*s/%s", (int)(slash - a->checkpoint), a->checkpoint, leaf);
    else snprintf(dir, cap, "%s", leaf);
}

static QtStatus aq_make_dir(const char *dir, QtError *err) {
    struct stat sb;
    if (lstat(dir, &sb) == 0 && !S_ISDIR(sb.st_mode))
        return qt_error_set(err, QT_ERR_ARG, "--out %s is not a directory (%s); give a directory", dir,
                            S_ISLNK(sb.st_mode) ? "a symbolic link" : "another kind of file");
    return train_make_dirs(dir, "--out", NULL, 0, err);
}

static const char *split_words(const char *split) {
    if (strcmp(split, "holdout") == 0)
        return "the last 10% of the training set, apart from the test split; the model saw it in training unless "
               "data.val_fraction held it out";
    if (strcmp(split, "val") == 0) return "the validation split";
    return "the TEST split (--split test): choices made on it are judged on the same examples";
}

/* ---- the sensitivity table -------------------------------------------------------------------- */

static void print_table(FILE *f, const SensTable *t) {
    fprintf(f, "\nsensitivity on the %s split (%s): %d examples; float model loss %.4f accuracy %.4f\n", t->split,
            split_words(t->split), t->examples, t->base_loss, t->base_accuracy);
    fprintf(f, "%-14s %9s %-8s %-10s %11s %11s %12s %10s\n", "module", "params", "format", "layout", "bits/weight",
            "bits saved", "delta loss", "delta acc");
    for (int m = 0; m < t->n_modules; m++)
        for (int k = 0; k < t->n_formats; k++) {
            const SensEntry *e = &t->entries[m * t->n_formats + k];
            if (e->bits < 0) {
                fprintf(f, "%-14s %9lld %-8s %-10s %11s %11s %12s %10s  (%s)\n", e->module, (long long)e->params,
                        e->format, e->layout, "-", "-", "-", "-", e->note);
                continue;
            }
            fprintf(f, "%-14s %9lld %-8s %-10s %11.3f %11lld %+12.5f %+9.2f%%\n", e->module, (long long)e->params,
                    e->format, e->layout, e->bits_per_param, (long long)(32 * e->params - e->bits), e->delta_loss,
                    100.0 * e->delta_accuracy);
        }
    fprintf(f, "bits: the quantized weight's storage (codes and scales, e.g. int4 per channel 4 + 32/fan_in per "
               "weight); weights only, biases and batch norms stay float32; saved against float32\n");
    if (strcmp(t->split, "holdout") == 0)
        fprintf(stderr, "qtrain: warning: the config has no validation split, so these changes were measured on the "
                "last 10%% of the training set, which the model trained on; they understate what quantization costs "
                "on unseen examples (train with data.val_fraction to hold examples out, or give --split test)\n");
}

static const char *const FMT_COLORS[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                                          "#e377c2", "#17becf"};

/* Grouped bars: per module, each format's accuracy change (percentage points) on the split. */
static void write_svg_body(FILE *f, const SensTable *t) {
    double lo = 0, hi = 0;
    for (int i = 0; i < t->n_modules * t->n_formats; i++) {
        double v = 100.0 * t->entries[i].delta_accuracy;
        if (isfinite(v)) lo = fmin(lo, v), hi = fmax(hi, v);
    }
    if (hi - lo < 0.5) lo = fmin(lo, -0.5);
    double pad = 0.08 * (hi - lo);
    lo -= pad, hi += pad;
    double x0 = 80, y0 = 60, h = 320, group = 28.0 * t->n_formats + 24;
    double w = fmax(group * t->n_modules, 520.0); /* room for the title */
    fprintf(f, "<svg xmlns='http://www.w3.org/2000/svg' width='%.0f' height='%.0f' font-family='sans-serif' "
               "font-size='12'>\n<rect width='100%%' height='100%%' fill='white'/>\n", x0 + w + 150, y0 + h + 50);
    fprintf(f, "<text x='%.1f' y='30' text-anchor='middle' font-size='15'>accuracy change when one module is "
               "quantized (%s split, %d examples)</text>\n", x0 + w / 2, t->split, t->examples);
    fprintf(f, "<rect x='%.1f' y='%.1f' width='%.1f' height='%.1f' fill='none' stroke='#444'/>\n", x0, y0, w, h);
#define PY(v) (y0 + h - ((v) - lo) / (hi - lo) * h)
    double step = pow(10.0, floor(log10((hi - lo) / 4.0)));
    if ((hi - lo) / step > 10) step *= 2.5;
    for (int k = 0; k < 40; k++) {
        double v = ceil(lo / step) * step + k * step;
        if (v > hi) break;
        fprintf(f, "<line x1='%.1f' x2='%.1f' y1='%.1f' y2='%.1f' stroke='%s'/>\n", x0, x0 + w, PY(v), PY(v),
                fabs(v) < 1e-9 ? "#444" : "#ddd");
        fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='end'>%.2g</text>\n", x0 - 6, PY(v) + 4, v);
    }
    fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle' transform='rotate(-90 %.1f %.1f)'>accuracy change "
               "(percentage points)</text>\n", x0 - 52, y0 + h / 2, x0 - 52, y0 + h / 2);
    for (int m = 0; m < t->n_modules; m++) {
        double gx = x0 + m * group + 12;
        for (int k = 0; k < t->n_formats; k++) {
            const SensEntry *e = &t->entries[m * t->n_formats + k];
            double v = 100.0 * e->delta_accuracy;
            if (!isfinite(v)) continue;
            double top = fmin(PY(v), PY(0)), bh = fabs(PY(v) - PY(0));
            fprintf(f, "<rect x='%.1f' y='%.1f' width='24' height='%.1f' fill='%s'><title>%s %s (%s): %.3f "
                       "bits/weight, delta accuracy %+.2f pp, delta loss %+.4f</title></rect>\n",
                    gx + 28.0 * k, top, fmax(bh, 0.5), FMT_COLORS[k % 8], e->module, e->format, e->layout,
                    e->bits_per_param, v, e->delta_loss);
        }
        fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle'>%s</text>\n", gx + 14.0 * t->n_formats - 2,
                y0 + h + 18, t->entries[m * t->n_formats].module);
        fprintf(f, "<text x='%.1f' y='%.1f' text-anchor='middle' font-size='10' fill='#555'>%lld weights</text>\n",
                gx + 14.0 * t->n_formats - 2, y0 + h + 32, (long long)t->entries[m * t->n_formats].params);
    }
    for (int k = 0; k < t->n_formats; k++) {
        double ly = y0 + 14 + 18.0 * k;
        fprintf(f, "<rect x='%.1f' y='%.1f' width='14' height='10' fill='%s'/>\n", x0 + w + 14, ly - 9,
                FMT_COLORS[k % 8]);
        fprintf(f, "<text x='%.1f' y='%.1f'>%s</text>\n", x0 + w + 34, ly, t->formats[k].name);
    }
#undef PY
    fputs("</svg>\n", f);
}

static QtStatus write_svg(const char *path, const SensTable *t, bool force, QtError *err) {
    char tmp[4200];
    fs_remove_stale_tmps_of(path, 0);
    FILE *f = fs_fopen_tmp(path, tmp, sizeof tmp);
    if (!f) return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; give another --out", path, strerror(errno));
    write_svg_body(f, t);
    if (fs_fcommit_tmp(f, tmp, path, force ? FS_REPLACE_REGULAR : FS_REPLACE_NONE) == 0) return QT_OK;
    return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s", path,
                        errno == EEXIST ? "something appeared there meanwhile; nothing was replaced" : strerror(errno));
}

static QtStatus write_text(const char *path, const char *text, bool force, QtError *err) {
    char tmp[4200];
    fs_remove_stale_tmps_of(path, 0);
    FILE *f = fs_fopen_tmp(path, tmp, sizeof tmp);
    if (!f) return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; give another --out", path, strerror(errno));
    fputs("# qtrain autoquant: a format per module under a bits-per-weight budget, as a PTQ run of the float\n"
          "# checkpoint (model.init_from); qtrain --config THIS_FILE evaluates it.\n", f);
    fputs(text, f);
    if (fs_fcommit_tmp(f, tmp, path, force ? FS_REPLACE_REGULAR : FS_REPLACE_NONE) == 0) return QT_OK;
    return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s", path,
                        errno == EEXIST ? "something appeared there meanwhile; nothing was replaced" : strerror(errno));
}

/* DIR/sensitivity.csv and .svg may be written (refused before any measurement, so no work is lost). */
static QtStatus check_table_files(const char *dir, bool force, QtError *err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/sensitivity.csv", dir);
    QtStatus st = fs_check_out_path(path, force, "--out:", err);
    snprintf(path, sizeof path, "%s/sensitivity.svg", dir);
    return st == QT_OK ? fs_check_out_path(path, force, "--out:", err) : st;
}

/* DIR/sensitivity.csv and .svg: both checked before either is written. */
static QtStatus write_table_files(const char *dir, const SensTable *t, bool force, char *csv, size_t cap,
                                  QtError *err) {
    char svg[4200];
    snprintf(csv, cap, "%s/sensitivity.csv", dir);
    snprintf(svg, sizeof svg, "%s/sensitivity.svg", dir);
    QtStatus st = fs_check_out_path(csv, force, "--out:", err);
    if (st == QT_OK) st = fs_check_out_path(svg, force, "--out:", err);
    if (st == QT_OK) st = sens_write_csv(t, csv, force, err);
    if (st == QT_OK) st = write_svg(svg, t, force, err);
    return st;
}

static QtStatus load_config(const AqArgs *a, Config *cfg, SensOptions *o, QtError *err) {
    QtStatus st = config_load(cfg, a->config, a->overrides, a->n_overrides, err);
    if (st == QT_OK) st = sens_parse_formats(a->formats, o->formats, SENS_FORMATS_MAX, &o->n_formats, err);
    o->checkpoint = a->checkpoint;
    o->use_test = a->use_test;
    o->log = a->quiet ? NULL : stdout;
    return st;
}

int autoquant_cmd_sensitivity(int argc, char **argv) {
    AqArgs a;
    int rc = aq_parse(argc, argv, "sensitivity", false, &a);
    if (rc) return rc;
    Config *cfg = calloc(1, sizeof *cfg);
    QtError err = {0};
    SensOptions o = {0};
    SensTable t = {0};
    char dir[4096], csv[4200];
    aq_out_dir(&a, "sensitivity", dir, sizeof dir);
    QtStatus st = cfg ? load_config(&a, cfg, &o, &err) : qt_error_set(&err, QT_ERR_NOMEM, "out of memory");
    struct stat before;
    const bool made = lstat(dir, &before) != 0; /* a refused run leaves no empty directory of its own behind */
    if (st == QT_OK) st = aq_make_dir(dir, &err);
    if (st == QT_OK) st = check_table_files(dir, a.force, &err); /* before the measurement */
    if (st == QT_OK) st = sens_measure(cfg, &o, &t, &err);
    if (st == QT_OK) print_table(stdout, &t);
    if (st == QT_OK) st = write_table_files(dir, &t, a.force, csv, sizeof csv, &err);
    if (st == QT_OK) printf("wrote %s and %s/sensitivity.svg\n", csv, dir);
    sens_table_free(&t);
    free(cfg);
    if (st != QT_OK && made) rmdir(dir); /* only if empty: a measured table stays */
    return st == QT_OK ? 0 : aq_fail(&err);
}

/* ---- autoquant ---------------------------------------------------------------------------------- */

/* The PTQ config of rules (from rules_yaml) evaluated on the test split. */
static QtStatus eval_rules(const Config *cfg, const char *checkpoint, const char *rules, SensEval *ev, QtError *err) {
    Config *c = malloc(sizeof *c);
    if (!c) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    QtStatus st = sens_ptq_config(cfg, rules, checkpoint, NULL, NULL, c, NULL, err);
    if (st == QT_OK) st = sens_eval_config(c, true, ev, err);
    free(c);
    return st;
}

static void print_choice(const SensTable *t, const int *choice, double budget) {
    int64_t params = 0, bits = 0;
    double pred = 0;
    printf("\nchoice under %g bits per weight (exact knapsack over the bits: least predicted loss change, the "
           "sum of the modules' delta loss):\n", budget);
    printf("%-14s %9s %-8s %-10s %11s %12s\n", "module", "params", "format", "layout", "bits/weight", "delta loss");
    for (int m = 0; m < t->n_modules; m++) {
        const SensEntry *e = &t->entries[m * t->n_formats + (choice[m] < 0 ? 0 : choice[m])];
        int64_t b = choice[m] < 0 ? 32 * e->params : e->bits;
        double d = choice[m] < 0 ? 0.0 : e->delta_loss;
        params += e->params, bits += b, pred += d;
        printf("%-14s %9lld %-8s %-10s %11.3f %+12.5f\n", e->module, (long long)e->params,
               choice[m] < 0 ? "float32" : e->format, choice[m] < 0 ? "float32" : e->layout,
               (double)b / (double)e->params, d);
    }
    printf("total: %.4f bits per weight over %lld weights (budget %g); predicted delta loss %+.5f on the %s split\n",
           (double)bits / (double)params, (long long)params, budget, pred, t->split);
}

static QtStatus autoquant_table(const AqArgs *a, const Config *cfg, const SensOptions *o, const char *dir,
                                SensTable *t, QtError *err) {
    if (!a->sensitivity) {
        char csv[4200];
        QtStatus st = sens_measure(cfg, o, t, err);
        if (st == QT_OK && !a->quiet) print_table(stdout, t);
        if (st == QT_OK) st = write_table_files(dir, t, a->force, csv, sizeof csv, err);
        if (st == QT_OK) printf("wrote %s and %s/sensitivity.svg\n", csv, dir);
        return st;
    }
    SensTable all = {0}, now = {0};
    QtStatus st = sens_read_csv(a->sensitivity, &all, err);
    if (st == QT_OK) st = sens_identify(cfg, a->checkpoint, a->use_test, &now, err);
    if (st == QT_OK) st = sens_check_csv(&all, a->sensitivity, &now, err);
    /* without --formats: every format the CSV measured */
    if (st == QT_OK) st = a->formats_given ? sens_table_select_formats(&all, o->formats, o->n_formats, t, err)
                                           : sens_table_select_formats(&all, all.formats, all.n_formats, t, err);
    if (st == QT_OK) printf("sensitivity from %s (%s split, %d examples)\n", a->sensitivity, t->split, t->examples);
    if (st == QT_OK && !a->quiet) print_table(stdout, t);
    sens_table_free(&all);
    sens_table_free(&now);
    return st;
}

int autoquant_cmd_autoquant(int argc, char **argv) {
    AqArgs a;
    int rc = aq_parse(argc, argv, "autoquant", true, &a);
    if (rc) return rc;
    Config *cfg = calloc(1, sizeof *cfg), *ptq = calloc(1, sizeof *ptq);
    QtError err = {0};
    SensOptions o = {0};
    SensTable t = {0};
    char dir[4096], leaf[64], yaml_path[4200], name[CONFIG_NAME_MAX];
    snprintf(leaf, sizeof leaf, "autoquant-%g", a.budget);
    snprintf(name, sizeof name, "autoquant-%g", a.budget);
    aq_out_dir(&a, leaf, dir, sizeof dir);
    snprintf(yaml_path, sizeof yaml_path, "%s/autoquant.yaml", dir);
    int *choice = NULL;
    char *rules = NULL, *text = NULL;
    QtStatus st = cfg && ptq ? load_config(&a, cfg, &o, &err) : qt_error_set(&err, QT_ERR_NOMEM, "out of memory");
    struct stat before;
    const bool made = lstat(dir, &before) != 0; /* a refused run leaves no empty directory of its own behind */
    if (st == QT_OK) st = aq_make_dir(dir, &err);
    if (st == QT_OK) st = fs_check_out_path(yaml_path, a.force, "--out:", &err);
    if (st == QT_OK && !a.sensitivity) st = check_table_files(dir, a.force, &err); /* before the measurement */
    if (st == QT_OK) st = autoquant_table(&a, cfg, &o, dir, &t, &err);
    if (st == QT_OK && !(choice = calloc((size_t)t.n_modules, sizeof *choice)))
        st = qt_error_set(&err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK) st = sens_choose(&t, a.budget, choice, &err);
    if (st == QT_OK && !(rules = sens_rules_yaml(&t, choice, "    ")))
        st = qt_error_set(&err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK) print_choice(&t, choice, a.budget);
    if (st == QT_OK) st = sens_ptq_config(cfg, rules, a.checkpoint, name, dir, ptq, &text, &err);
    if (st == QT_OK) st = write_text(yaml_path, text, a.force, &err);
    if (st == QT_OK)
        printf("wrote %s (qtrain --config %s runs it as a PTQ run into %s)\n", yaml_path, yaml_path, dir);
    /* the chosen model beside uniform int4 and nf4 per channel and the float model, on the test split */
    const char *names[4] = {"float32", name, "uniform int4/ch", "uniform nf4/ch"};
    const char *uni[2] = {"    - {module_path: '.*', op_types: [conv2d, dense], weight_qtype: int4, tile_size: 0}\n",
                          "    - {module_path: '.*', op_types: [conv2d, dense], weight_qtype: nf4, tile_size: 0}\n"};
    SensEval ev[4];
    if (st == QT_OK) st = sens_eval_float(cfg, a.checkpoint, true, &ev[0], &err);
    if (st == QT_OK) st = sens_eval_config(ptq, true, &ev[1], &err);
    for (int i = 0; st == QT_OK && i < 2; i++) st = eval_rules(cfg, a.checkpoint, uni[i], &ev[2 + i], &err);
    if (st == QT_OK) {
        printf("\non the test split (the float model's weights; bits/weight over the dense and conv2d weights):\n");
        printf("%-20s %11s %10s %10s\n", "model", "bits/weight", "test acc", "test loss");
        int64_t all_params = 0;
        for (int m = 0; m < t.n_modules; m++) all_params += t.entries[m * t.n_formats].params;
        for (int i = 0; i < 4; i++) {
            /* bits over every dense and conv2d weight: a module kept float counts 32 */
            double bpp = (double)(ev[i].q_bits + 32 * (all_params - ev[i].q_params)) / (double)all_params;
            printf("%-20s %11.4f %10.4f %10.4f\n", names[i], bpp, ev[i].accuracy, ev[i].loss);
        }
    }
    free(rules), free(text), free(choice);
    sens_table_free(&t);
    free(cfg), free(ptq);
    if (st != QT_OK && made) rmdir(dir); /* only if empty: a measured table stays */
    return st == QT_OK ? 0 : aq_fail(&err);
}
