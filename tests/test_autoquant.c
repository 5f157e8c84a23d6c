/* test_autoquant.c - per-module sensitivity and the choice of formats under a budget
 * (trainer/sensitivity.h, `qtrain sensitivity`, `qtrain autoquant`): the exact knapsack against exhaustive search
 * and on a case where upgrading by the best loss-per-bit ratio (greedy) is worse; the commands end to end on the
 * mini set (the training set's tail, not the test split, by default; autoquant reproducing its choice from the CSV it
 * wrote; the written config runs as a PTQ run); and bad input, each a clear error with exit status 2. */
#include <CUnit/CUnit.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "base/rng.h"
#include "test_proc.h"
#include "test_util.h"
#include "trainer/sensitivity.h"

/* ---- the knapsack ------------------------------------------------------------------------------ */

/* Two modules of 10 weights. From both at 2 bits (40 bits, delta 1.9), upgrading by the best delta saved per bit
 * takes B to 4 bits (0.02 per bit), then B to 8 bits (A's upgrade no longer fits in 100): delta 1.0. The best
 * under 100 bits is A at 8 bits and B at 2: delta 0.9. */
static void test_knapsack_beats_greedy_by_ratio(void) {
    const int64_t bits[2 * 3] = {20, -1, 80, 20, 40, 80};
    const double delta[2 * 3] = {1.0, 0.0, 0.0, 0.9, 0.5, 0.0};
    int choice[2] = {-9, -9};
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(sens_knapsack(2, 3, bits, delta, 100, 1, choice, &err), QT_OK);
    CU_ASSERT_EQUAL(choice[0], 2);
    CU_ASSERT_EQUAL(choice[1], 0);
    /* a unit coarser than the costs rounds them up: 100 bits in units of 30 are 3 units, and 20, 40 and 80 bits
       1, 2 and 3 units, so A at 8 bits with B at 2 (4 units) no longer fits: A at 2 bits, B at 4 */
    CU_ASSERT_EQUAL_FATAL(sens_knapsack(2, 3, bits, delta, 100, 30, choice, &err), QT_OK);
    CU_ASSERT_EQUAL(choice[0], 0);
    CU_ASSERT_EQUAL(choice[1], 1);
    /* below the least: an error naming it */
    CU_ASSERT_EQUAL(sens_knapsack(2, 3, bits, delta, 39, 1, choice, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "the least is 40"));
}

/* Random tables against exhaustive search: never over the budget, never a larger delta sum. */
static void test_knapsack_is_exact(void) {
    Rng r;
    rng_init(&r, 11, 0);
    for (int trial = 0; trial < 300; trial++) {
        int nm = 1 + (int)(rng_below(&r, 4)), k = 1 + (int)(rng_below(&r, 4));
        int64_t bits[16];
        double delta[16];
        for (int i = 0; i < nm * k; i++) {
            bits[i] = rng_below(&r, 7) == 0 ? -1 : 8 + 8 * (int64_t)(rng_below(&r, 40));
            delta[i] = (double)(rng_below(&r, 1000)) / 100.0 - 1.0;
        }
        for (int m = 0; m < nm; m++)
            if (bits[m * k] < 0) bits[m * k] = 8; /* every module has an option */
        int64_t budget = (int64_t)rng_below(&r, (uint32_t)(nm * 320 + 1));
        /* exhaustive */
        double best = INFINITY;
        int total = 1;
        for (int m = 0; m < nm; m++) total *= k;
        for (int c = 0; c < total; c++) {
            int64_t b = 0;
            double d = 0;
            bool ok = true;
            for (int m = 0, x = c; m < nm; m++, x /= k) {
                int j = x % k;
                if (bits[m * k + j] < 0) ok = false;
                b += bits[m * k + j], d += delta[m * k + j];
            }
            if (ok && b <= budget && d < best) best = d;
        }
        int choice[4];
        QtError err = {0};
        QtStatus st = sens_knapsack(nm, k, bits, delta, budget, 8, choice, &err);
        if (!isfinite(best)) {
            CU_ASSERT_EQUAL(st, QT_ERR_ARG);
            continue;
        }
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        int64_t b = 0;
        double d = 0;
        for (int m = 0; m < nm; m++) {
            CU_ASSERT_FATAL(choice[m] >= 0 && choice[m] < k && bits[m * k + choice[m]] >= 0);
            b += bits[m * k + choice[m]], d += delta[m * k + choice[m]];
        }
        CU_ASSERT(b <= budget);
        CU_ASSERT(fabs(d - best) < 1e-9);
    }
}

/* A hand-made table through sens_choose: the budget in bits per weight over the modules' weights, float32 as a
 * choice, and a budget below the smallest formats refused. */
static void test_choose_under_budget(void) {
    SensEntry e[2 * 2] = {
        {.module = "a", .params = 100, .bits = 400, .delta_loss = 0.30},  /* a int4 */
        {.module = "a", .params = 100, .bits = 200, .delta_loss = 0.90},  /* a int2 */
        {.module = "b", .params = 1000, .bits = 4000, .delta_loss = 0.01},
        {.module = "b", .params = 1000, .bits = 2000, .delta_loss = 0.05},
    };
    SensTable t = {.entries = e, .n_modules = 2, .n_formats = 2};
    int choice[2];
    QtError err = {0};
    /* 1100 weights at 2.2 bits: 2420 bits; a int4 + b int2 = 2400 fits, and is better than a int2 + b int2 */
    CU_ASSERT_EQUAL_FATAL(sens_choose(&t, 2.2, choice, &err), QT_OK);
    CU_ASSERT_EQUAL(choice[0], 0);
    CU_ASSERT_EQUAL(choice[1], 1);
    /* room for a in float32 (3200 bits) and b int2: delta 0.05, the best */
    CU_ASSERT_EQUAL_FATAL(sens_choose(&t, 5200.0 / 1100, choice, &err), QT_OK);
    CU_ASSERT_EQUAL(choice[0], -1);
    CU_ASSERT_EQUAL(choice[1], 1);
    CU_ASSERT_EQUAL_FATAL(sens_choose(&t, 2.0, choice, &err), QT_OK); /* exactly the least: both int2 */
    CU_ASSERT_EQUAL(choice[0], 1);
    CU_ASSERT_EQUAL(choice[1], 1);
    CU_ASSERT_EQUAL(sens_choose(&t, 1.99, choice, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "below 2.0000"));
}

static void test_parse_formats(void) {
    SensFormat f[SENS_FORMATS_MAX];
    int n = 0;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(sens_parse_formats("int8,nf4/ch,int4/64", f, SENS_FORMATS_MAX, &n, &err), QT_OK);
    CU_ASSERT_EQUAL(n, 3);
    CU_ASSERT_EQUAL(f[0].tile, -1);
    CU_ASSERT_EQUAL(f[1].tile, 0);
    CU_ASSERT_EQUAL(f[2].tile, 64);
    CU_ASSERT_STRING_EQUAL(f[1].qtype, "nf4");
    const char *bad[] = {"", "int8,,int4", "int5x", "int4/xx", "int4,int4"};
    const char *says[] = {"--formats is empty", "an empty format", "int5x", "after '/'", "listed twice"};
    for (int i = 0; i < 5; i++) {
        QtError e = {0};
        CU_ASSERT_EQUAL(sens_parse_formats(bad[i], f, SENS_FORMATS_MAX, &n, &e), QT_ERR_ARG);
        CU_ASSERT(test_msg_has(&e, says[i]));
    }
}

/* ---- the commands on the mini set -------------------------------------------------------------- */

static char *tmp_root;
static char bin[PATH_MAX];
static bool have_models;

#define CNN "--config tests/configs/tiny-cnn.yaml"

/* `qtrain ARGS` into a log under tmp_root (test_util.h); log_has looks in the last one. */
#define cli(...) test_cli(bin, tmp_root, __VA_ARGS__)
#define log_has test_cli_log_has

static char *read_at(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *read_at(const char *fmt, ...) {
    char path[PATH_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(path, sizeof path, fmt, ap);
    va_end(ap);
    return test_file_read(path, NULL);
}

static int autoquant_suite_init(void) {
    tmp_root = test_tmpdir_new();
    if (!tmp_root) return -1;
    if (!realpath(test_qtrain_bin(), bin)) snprintf(bin, sizeof bin, "%s", test_qtrain_bin());
    /* the float models the commands start from: the tiny CNN, and the tiny MLP (another model) */
    have_models = cli(CNN " --set run.out_dir=%s/cnn -q", tmp_root) == 0 &&
                  cli("--config tests/configs/tiny-mlp.yaml --set run.out_dir=%s/mlp -q", tmp_root) == 0;
    return 0;
}

static int autoquant_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

static bool need_models(void) {
    if (!have_models) CU_FAIL("the tiny models did not train (see the log above)");
    return have_models;
}

/* The CSV's value of column `col` in data row `row` (0-based), or "" */
static void csv_cell(const char *csv, int row, int col, char *out, size_t cap) {
    out[0] = '\0';
    const char *p = strchr(csv, '\n');
    for (int r = 0; p && r < row; r++) p = strchr(p + 1, '\n');
    if (!p) return;
    p++;
    for (int c = 0; c < col && p; c++) p = strchr(p, ','), p = p ? p + 1 : NULL;
    if (!p) return;
    size_t n = strcspn(p, ",\n");
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), p);
}

static void test_sensitivity_holds_out_training_examples(void) {
    if (!need_models()) return;
    CU_ASSERT_EQUAL_FATAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --formats int8,int4,nf4,int2 "
                              "--out %s/sens", tmp_root, tmp_root), 0);
    CU_ASSERT(log_has("sensitivity on the holdout split (the last 10% of the training set, apart from the test split"));
    char *csv = read_at("%s/sens/sensitivity.csv", tmp_root);
    char *svg = read_at("%s/sens/sensitivity.svg", tmp_root);
    CU_ASSERT_PTR_NOT_NULL_FATAL(csv);
    CU_ASSERT(svg && strstr(svg, "<svg") && strstr(svg, "conv1"));
    /* conv1 and head, 4 formats each: a header and 8 rows */
    int lines = 0;
    for (const char *p = csv; *p; p++) lines += *p == '\n';
    CU_ASSERT_EQUAL(lines, 9);
    char cell[80];
    csv_cell(csv, 0, 0, cell, sizeof cell);
    CU_ASSERT_STRING_EQUAL(cell, "conv1");
    csv_cell(csv, 0, 12, cell, sizeof cell);
    CU_ASSERT_STRING_EQUAL(cell, "holdout");
    /* tiny-cnn: 512 training examples, the last 10% held out */
    csv_cell(csv, 0, 13, cell, sizeof cell);
    CU_ASSERT_STRING_EQUAL(cell, "51");
    /* int4 per channel on head (fan_in 784): 4 + 32/784 bits per weight, its storage exactly */
    csv_cell(csv, 5, 3, cell, sizeof cell);
    CU_ASSERT_STRING_EQUAL(cell, "int4");
    csv_cell(csv, 5, 6, cell, sizeof cell);
    CU_ASSERT_DOUBLE_EQUAL(atof(cell), 4.0 + 32.0 / 784.0, 1e-9);
    /* nf4 on conv1 (36 weights, not a multiple of 64): per channel, as a PTQ rule must be */
    csv_cell(csv, 2, 4, cell, sizeof cell);
    CU_ASSERT_STRING_EQUAL(cell, "nf4/ch");

    /* --split test: labelled test, all 128 test examples of the mini set, other numbers */
    CU_ASSERT_EQUAL_FATAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --split test --out %s/sens-test -q",
                              tmp_root, tmp_root), 0);
    CU_ASSERT(log_has("on the test split (the TEST split (--split test)"));
    char *tcsv = read_at("%s/sens-test/sensitivity.csv", tmp_root);
    CU_ASSERT_PTR_NOT_NULL_FATAL(tcsv);
    csv_cell(tcsv, 0, 12, cell, sizeof cell);
    CU_ASSERT_STRING_EQUAL(cell, "test");
    char a[80], b[80];
    csv_cell(csv, 0, 10, a, sizeof a);
    csv_cell(tcsv, 0, 10, b, sizeof b);
    CU_ASSERT_STRING_NOT_EQUAL(a, b); /* the float model's loss differs: other examples */

    /* a config with a validation split measures on it */
    CU_ASSERT_EQUAL(cli("sensitivity " CNN " --set data.val_fraction=0.25 --checkpoint %s/cnn/final.h5 --formats "
                        "int8 --out %s/sens-val -q", tmp_root, tmp_root), 0);
    CU_ASSERT(log_has("sensitivity on the val split"));
    free(csv), free(svg), free(tcsv);
}

/* The quant section of a written autoquant.yaml. */
static char *quant_section(const char *dir) {
    char *text = read_at("%s/autoquant.yaml", dir);
    if (!text) return NULL;
    char *q = strstr(text, "\nquant:\n"), *end = q ? strstr(q, "\nlora:\n") : NULL;
    char *out = q && end ? strndup(q, (size_t)(end - q)) : NULL;
    free(text);
    return out;
}

static void test_autoquant_reproduces_its_choice_from_the_csv(void) {
    if (!need_models()) return;
    char d1[PATH_MAX], d2[PATH_MAX];
    snprintf(d1, sizeof d1, "%s/aq-measured", tmp_root);
    snprintf(d2, sizeof d2, "%s/aq-from-csv", tmp_root);
    CU_ASSERT_EQUAL_FATAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --out %s/sens-aq -q", tmp_root,
                              tmp_root), 0);
    CU_ASSERT_EQUAL_FATAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 4.5 --out %s -q", tmp_root,
                              d1), 0);
    CU_ASSERT(log_has("uniform int4/ch"));
    CU_ASSERT(log_has("uniform nf4/ch"));
    CU_ASSERT_EQUAL_FATAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 4.5 --sensitivity "
                              "%s/sens-aq/sensitivity.csv --out %s", tmp_root, tmp_root, d2), 0);
    char *q1 = quant_section(d1), *q2 = quant_section(d2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(q1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(q2);
    CU_ASSERT_STRING_EQUAL(q1, q2);
    CU_ASSERT(strstr(q1, "mode: ptq") != NULL);
    /* the CSV autoquant wrote is the one sensitivity wrote */
    char *c1 = read_at("%s/sensitivity.csv", d1), *c2 = read_at("%s/sens-aq/sensitivity.csv", tmp_root);
    CU_ASSERT(c1 && c2 && strcmp(c1, c2) == 0);
    /* the config runs as a PTQ run and evaluates what autoquant printed */
    char *printed = test_file_read(test_cli_log(), NULL);
    CU_ASSERT_EQUAL_FATAL(cli("--config %s/autoquant.yaml -q", d2), 0);
    char *run = test_file_read(test_cli_log(), NULL);
    const char *row = printed ? strstr(printed, "\nautoquant-4.5 ") : NULL;
    double bpp = 0, acc = -1, loss = -1, racc = -2, rloss = -2;
    CU_ASSERT_FATAL(row && sscanf(row, " autoquant-4.5 %lf %lf %lf", &bpp, &acc, &loss) == 3);
    CU_ASSERT_FATAL(run && sscanf(run, "test_accuracy:%lf test_loss:%lf", &racc, &rloss) == 2);
    CU_ASSERT(bpp <= 4.5);
    CU_ASSERT_DOUBLE_EQUAL(acc, racc, 1e-4);
    CU_ASSERT_DOUBLE_EQUAL(loss, rloss, 1e-4);
    free(q1), free(q2), free(c1), free(c2), free(printed), free(run);
}

/* A format that does not fit a module (int4 in blocks of 16 on conv1's 36 weights) is listed as not available and
 * never chosen; --sensitivity without --formats takes the CSV's formats; a CSV measured with another quant.fold_bn,
 * or cut short, is refused by name. */
static void test_unavailable_formats_and_csv_identity(void) {
    if (!need_models()) return;
    CU_ASSERT_EQUAL_FATAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --formats int8,int4/16 --out %s/na",
                              tmp_root, tmp_root), 0);
    CU_ASSERT(log_has("not available"));
    char *csv = read_at("%s/na/sensitivity.csv", tmp_root);
    CU_ASSERT_PTR_NOT_NULL_FATAL(csv);
    char cell[80];
    csv_cell(csv, 1, 4, cell, sizeof cell); /* conv1, int4/16 */
    CU_ASSERT_STRING_EQUAL(cell, "n/a");
    csv_cell(csv, 1, 7, cell, sizeof cell);
    CU_ASSERT_STRING_EQUAL(cell, "-1");
    csv_cell(csv, 3, 4, cell, sizeof cell); /* head, int4/16: 7,840 weights, 490 blocks */
    CU_ASSERT_STRING_EQUAL(cell, "int4/16");
    /* no --formats: int4/16 (6 bits a weight) comes from the CSV; under 7 bits head must take it, conv1 cannot */
    CU_ASSERT_EQUAL_FATAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 7 --sensitivity "
                              "%s/na/sensitivity.csv --out %s/na-aq", tmp_root, tmp_root, tmp_root), 0);
    char na_aq[PATH_MAX];
    snprintf(na_aq, sizeof na_aq, "%s/na-aq", tmp_root);
    char *q = quant_section(na_aq);
    CU_ASSERT_PTR_NOT_NULL_FATAL(q);
    CU_ASSERT(strstr(q, "module_path: head") && strstr(q, "tile_size: 16"));
    CU_ASSERT(!strstr(q, "module_path: conv1\n      op_types: []\n      skip: false\n      weight_qtype: int4"));
    free(q);
    /* another quant.fold_bn: the CSV is not this measurement's */
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --set quant.fold_bn=false --checkpoint %s/cnn/final.h5 --budget 4.5 "
                        "--sensitivity %s/na/sensitivity.csv --out %s/na-fold", tmp_root, tmp_root, tmp_root), 2);
    CU_ASSERT(log_has("quant.fold_bn"));
    /* cut short after conv1's rows */
    char *nl = strchr(csv, '\n');
    for (int r = 0; nl && r < 2; r++) nl = strchr(nl + 1, '\n');
    CU_ASSERT_PTR_NOT_NULL_FATAL(nl);
    char cut[PATH_MAX];
    snprintf(cut, sizeof cut, "%s/na/cut.csv", tmp_root);
    test_file_write(cut, csv, (size_t)(nl + 1 - csv));
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 4.5 --sensitivity %s --out "
                        "%s/na-cut", tmp_root, cut, tmp_root), 2);
    CU_ASSERT(log_has("incomplete: it has 1 of this model's 2 modules"));
    free(csv);
}

static void test_outputs_follow_the_house_rules(void) {
    if (!need_models()) return;
    CU_ASSERT_EQUAL_FATAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --formats int8 --out %s/rules -q",
                              tmp_root, tmp_root), 0);
    /* an existing file only with --force */
    CU_ASSERT_EQUAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --formats int8 --out %s/rules -q",
                        tmp_root, tmp_root), 2);
    CU_ASSERT(log_has("--force"));
    CU_ASSERT_EQUAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --formats int8 --out %s/rules --force -q",
                        tmp_root, tmp_root), 0);
    /* never over a directory, whatever --force says */
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/rules2/sensitivity.svg", tmp_root);
    snprintf(path, sizeof path, "%s/rules2", tmp_root);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/rules2/sensitivity.svg", tmp_root);
    mkdir(path, 0755);
    CU_ASSERT_EQUAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --formats int8 --out %s/rules2 --force -q",
                        tmp_root, tmp_root), 2);
    CU_ASSERT(log_has("is a directory"));
    CU_ASSERT(!test_file_exists(tmp_root, "rules2/sensitivity.csv")); /* checked before either is written */
}

static void test_help(void) {
    CU_ASSERT_EQUAL(cli("sensitivity --help"), 0);
    CU_ASSERT(log_has("usage: qtrain sensitivity --config FILE --checkpoint PATH"));
    CU_ASSERT_EQUAL(cli("autoquant --config x.yaml -h"), 0);
    CU_ASSERT(log_has("usage: qtrain autoquant --config FILE --checkpoint PATH --budget BITS"));
    CU_ASSERT_EQUAL(cli("--help"), 0);
    CU_ASSERT(log_has("qtrain sensitivity --config FILE"));
    CU_ASSERT(log_has("qtrain autoquant --config FILE"));
    CU_ASSERT_EQUAL(cli("autoquant --config x.yaml --bogus"), 2);
    CU_ASSERT(log_has("unknown option '--bogus'"));
}

static void test_bad_input_exits_2(void) {
    if (!need_models()) return;
    CU_ASSERT_EQUAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --formats int8,int5x --out %s/bad", tmp_root,
                        tmp_root), 2);
    CU_ASSERT(log_has("int5x"));
    CU_ASSERT_EQUAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --formats '' --out %s/bad", tmp_root,
                        tmp_root), 2);
    CU_ASSERT(log_has("--formats is empty"));
    CU_ASSERT_EQUAL(cli("sensitivity " CNN " --checkpoint %s/nothing.h5 --out %s/bad", tmp_root, tmp_root), 2);
    CU_ASSERT(log_has("nothing.h5: No such file"));
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --checkpoint %s/nothing.h5 --budget 4 --out %s/bad", tmp_root, tmp_root), 2);
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --out %s/bad", tmp_root, tmp_root), 2);
    CU_ASSERT(log_has("--budget"));
    /* below int2 per channel everywhere: refused before anything is written */
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 1.5 --formats int8,int2 --out "
                        "%s/bad-budget -q", tmp_root, tmp_root), 2);
    CU_ASSERT(log_has("is below"));
    CU_ASSERT(!test_file_exists(tmp_root, "bad-budget/autoquant.yaml"));

    /* a CSV of another model (the tiny MLP) */
    CU_ASSERT_EQUAL_FATAL(cli("sensitivity --config tests/configs/tiny-mlp.yaml --checkpoint %s/mlp/final.h5 "
                              "--formats int8 --out %s/sens-mlp -q", tmp_root, tmp_root), 0);
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 8.5 --formats int8 --sensitivity "
                        "%s/sens-mlp/sensitivity.csv --out %s/bad", tmp_root, tmp_root, tmp_root), 2);
    CU_ASSERT(log_has("was measured on another model"));
    /* the CNN's CSV with other data (another transform) or on another split */
    CU_ASSERT_EQUAL_FATAL(cli("sensitivity " CNN " --checkpoint %s/cnn/final.h5 --formats int8 --out %s/sens-cnn8 -q",
                              tmp_root, tmp_root), 0);
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --set data.transform.0.limit=256 --checkpoint %s/cnn/final.h5 --budget 8.5 "
                        "--formats int8 --sensitivity %s/sens-cnn8/sensitivity.csv --out %s/bad", tmp_root, tmp_root,
                        tmp_root), 2);
    CU_ASSERT(log_has("another data section"));
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 8.5 --formats int4 --sensitivity "
                        "%s/sens-cnn8/sensitivity.csv --out %s/bad", tmp_root, tmp_root, tmp_root), 2);
    CU_ASSERT(log_has("has no format int4"));
    /* a budget refused with a table read from elsewhere: nothing written, so no directory left behind */
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 1 --sensitivity "
                        "%s/sens-cnn8/sensitivity.csv --out %s/bad-empty", tmp_root, tmp_root, tmp_root), 2);
    CU_ASSERT(log_has("is below"));
    CU_ASSERT(!test_file_exists(tmp_root, "bad-empty"));
    /* not a CSV of ours */
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/junk.csv", tmp_root);
    test_file_write(path, "a,b\n1,2\n", 8);
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 8.5 --sensitivity %s --out %s/bad",
                        tmp_root, path, tmp_root), 2);
    CU_ASSERT(log_has("the header is not qtrain sensitivity's"));
    /* ours, with a count no model has (cast to an integer it would overflow) */
    char *good = read_at("%s/sens-cnn8/sensitivity.csv", tmp_root);
    CU_ASSERT_PTR_NOT_NULL_FATAL(good);
    char *row = strchr(good, '\n'), *comma = row ? strchr(row + 1, ',') : NULL;
    CU_ASSERT_PTR_NOT_NULL_FATAL(comma);
    char *end = strchr(comma + 1, ',');
    CU_ASSERT_PTR_NOT_NULL_FATAL(end);
    char *big = malloc(strlen(good) + 64);
    snprintf(big, strlen(good) + 64, "%.*s1e300%s", (int)(comma + 1 - good), good, end);
    snprintf(path, sizeof path, "%s/big.csv", tmp_root);
    test_file_write(path, big, strlen(big));
    CU_ASSERT_EQUAL(cli("autoquant " CNN " --checkpoint %s/cnn/final.h5 --budget 8.5 --sensitivity %s --out %s/bad",
                        tmp_root, path, tmp_root), 2);
    CU_ASSERT(log_has("big.csv:2: a count (params, fan_in, tile, bits or examples) is out of range"));
    free(big), free(good);
}

int register_autoquant_suite(void) {
    CU_pSuite s = CU_add_suite("autoquant", autoquant_suite_init, autoquant_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "the knapsack beats upgrading by ratio; units round up", test_knapsack_beats_greedy_by_ratio) ||
           !CU_add_test(s, "the knapsack matches exhaustive search, within the budget", test_knapsack_is_exact) ||
           !CU_add_test(s, "sens_choose: bits per weight, float32 as a choice, a budget too small",
                        test_choose_under_budget) ||
           !CU_add_test(s, "--formats: names, /ch and /N, errors", test_parse_formats) ||
           !CU_add_test(s, "sensitivity measures on the training set's tail, not the test split",
                        test_sensitivity_holds_out_training_examples) ||
           !CU_add_test(s, "autoquant reproduces its choice from the CSV; its config runs",
                        test_autoquant_reproduces_its_choice_from_the_csv) ||
           !CU_add_test(s, "a format that does not fit is n/a; the CSV's formats, fold_bn and length",
                        test_unavailable_formats_and_csv_identity) ||
           !CU_add_test(s, "output files: --force, never over a directory", test_outputs_follow_the_house_rules) ||
           !CU_add_test(s, "--help of both commands", test_help) ||
           !CU_add_test(s, "bad input: a clear error, exit 2", test_bad_input_exits_2);
}
