/* test_commands.c - the commands where a user runs them, through the binary:
 * --help of every command, a warmup longer than the run, eval's output file
 * and its config, compare in a fresh directory, what a failed start leaves,
 * init_from of float64/float16 weights, and the README's examples. */
#include <hdf5.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_proc.h"
#include "trainer/checkpoint.h"
#include "test_util.h"

static char *tmp_root;
static char bin[PATH_MAX];

static int commands_suite_init(void) {
    tmp_root = test_tmpdir_new();
    /* absolute: some commands run in another working directory */
    if (!realpath(test_qtrain_bin(), bin)) snprintf(bin, sizeof bin, "%s", test_qtrain_bin());
    return tmp_root ? 0 : -1;
}

static int commands_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}


/* `qtrain ARGS` into a log under tmp_root (test_util.h); log_has looks in the last one. */
#define cli(...) test_cli(bin, tmp_root, __VA_ARGS__)
#define log_has test_cli_log_has

static bool path_exists(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static bool path_exists(const char *fmt, ...) {
    char path[PATH_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(path, sizeof path, fmt, ap);
    va_end(ap);
    struct stat st;
    return stat(path, &st) == 0;
}

#define TINY "--config tests/configs/tiny-mlp.yaml"

/* ---- --help --------------------------------------------------------------------------------- */

static void test_help_of_every_command(void) {
    const char *cmds[] = {"train", "eval", "inspect", "compare", "quantize", "merge", "convert", "demo", "bench"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char want[64];
        snprintf(want, sizeof want, "usage: qtrain %s", strcmp(cmds[i], "train") == 0 ? "[train]" : cmds[i]);
        CU_ASSERT_EQUAL(cli("%s --help", cmds[i]), 0);
        CU_ASSERT(log_has(want));
        CU_ASSERT_EQUAL(cli("%s -h", cmds[i]), 0);
        CU_ASSERT(log_has(want));
    }
    /* after other options too, and for the options-first form of train */
    CU_ASSERT_EQUAL(cli("compare runs/a --help"), 0);
    CU_ASSERT(log_has("usage: qtrain compare"));
    CU_ASSERT_EQUAL(cli(TINY " --help"), 0);
    CU_ASSERT(log_has("usage: qtrain [train]"));
    CU_ASSERT_EQUAL(cli("--help"), 0);
    CU_ASSERT(log_has("qtrain inspect PATH"));
    CU_ASSERT(log_has("qtrain bench --config FILE"));
}

/* ---- a warmup longer than the run ------------------------------------------------------------- */

#define LONG_WARMUP "--set train.schedule.name=cosine --set train.schedule.warmup_steps=100"

static void test_long_warmup_is_clamped(void) {
    CU_ASSERT_EQUAL(cli(TINY " " LONG_WARMUP " --set run.out_dir=%s/warm --quiet", tmp_root), 0);
    CU_ASSERT(log_has("train.schedule.warmup_steps 100 is longer than the run's 20 steps"));
    CU_ASSERT(log_has("clamped to 20 steps"));
    /* the whole run warms up: the last step runs at train.optimizer.lr */
    char path[PATH_MAX], lr[64];
    snprintf(path, sizeof path, "%s/warm/metrics.csv", tmp_root);
    char *m = test_file_read(path, NULL);
    snprintf(lr, sizeof lr, "\ntrain,20,");
    const char *row = m ? strstr(m, lr) : NULL;
    CU_ASSERT_PTR_NOT_NULL(row);
    snprintf(lr, sizeof lr, ",%.9g,", (double)1e-3f);
    if (row) {
        const char *end = strchr(row + 1, '\n');
        char line[256];
        snprintf(line, sizeof line, "%.*s", end ? (int)(end - row) : 200, row);
        if (!strstr(line, lr)) fprintf(stderr, "\n  last row %s lacks lr %s\n", line, lr);
        CU_ASSERT_PTR_NOT_NULL(strstr(line, lr));
    }
    free(m);
    /* the stored config keeps the value as written (the warning says what is used) */
    snprintf(path, sizeof path, "%s/warm/final.h5", tmp_root);
    char *config = NULL;
    QtError err = {0};
    CU_ASSERT_EQUAL(checkpoint_read_config(path, &config, &err), QT_OK);
    CU_ASSERT(config && strstr(config, "warmup_steps: 100"));
    free(config);

    /* stop at step 7 and resume: bit-identical to the straight run */
    CU_ASSERT_EQUAL(cli(TINY " " LONG_WARMUP " --set run.out_dir=%s/warm-split --stop-at-step 7 --quiet", tmp_root),
                    0);
    CU_ASSERT_EQUAL(cli(TINY " " LONG_WARMUP " --set run.out_dir=%s/warm-split --resume auto --quiet", tmp_root), 0);
    CU_ASSERT(log_has("clamped to 20 steps"));
    char a[PATH_MAX], b[PATH_MAX];
    snprintf(a, sizeof a, "%s/warm/final.h5", tmp_root);
    snprintf(b, sizeof b, "%s/warm-split/final.h5", tmp_root);
    CU_ASSERT(test_ckpt_group_within(a, b, "params"));
    CU_ASSERT(test_ckpt_group_within(a, b, "optim"));
}

/* ---- eval ------------------------------------------------------------------------------------- */

/* Evaluation never trains: neither the schedule nor the batch plan of the config stops it. */
static void test_eval_ignores_the_training_plan(void) {
    CU_ASSERT_EQUAL_FATAL(cli(TINY " --set run.out_dir=%s/ev --set train.steps=3 --quiet", tmp_root), 0);
    CU_ASSERT_EQUAL(cli("eval " TINY " --checkpoint %s/ev/final.h5 --set train.steps=0 --set train.epochs=1 "
                        "--set train.schedule.name=cosine --set train.schedule.warmup_steps=1000000 --quiet",
                        tmp_root), 0);
    CU_ASSERT(log_has("test_accuracy:"));
    CU_ASSERT_EQUAL(cli("eval " TINY " --checkpoint %s/ev/final.h5 --set train.batch_size=100000 "
                        "--set data.drop_last=true --quiet", tmp_root), 0);
    CU_ASSERT(log_has("test_accuracy:"));
    /* a `qtrain quantize` output stores such a config; eval takes it from there */
    CU_ASSERT_EQUAL(cli("quantize " TINY " --checkpoint %s/ev/final.h5 --out %s/ev/int8.h5 --set quant.mode=ptq "
                        "--set 'quant.rules=[{module_path: \".*\", weight_qtype: int8}]' --set train.steps=0 "
                        "--set train.epochs=1 --set train.schedule.name=cosine --set train.schedule.warmup_steps=1000",
                        tmp_root, tmp_root), 0);
    CU_ASSERT_EQUAL(cli("eval --checkpoint %s/ev/int8.h5 --quiet", tmp_root), 0);
    CU_ASSERT(log_has("test_accuracy:"));
}

/* A copy of src without the config attribute. */
static bool copy_without_config(const char *src, const char *dst) {
    if (!test_file_copy(src, dst)) return false;
    hid_t f = H5Fopen(dst, H5F_ACC_RDWR, H5P_DEFAULT);
    bool ok = f >= 0 && H5Adelete(f, "config") >= 0;
    if (f >= 0) H5Fclose(f);
    return ok;
}

static void test_eval_writes_beside_the_checkpoint(void) {
    CU_ASSERT_EQUAL_FATAL(cli(TINY " --set run.out_dir=%s/ev2 --set train.steps=3 --quiet", tmp_root), 0);
    /* the run moves: its stored run.out_dir no longer exists and must not be made */
    char from[PATH_MAX], to[PATH_MAX];
    snprintf(from, sizeof from, "%s/ev2", tmp_root);
    snprintf(to, sizeof to, "%s/moved", tmp_root);
    CU_ASSERT_EQUAL_FATAL(rename(from, to), 0);
    CU_ASSERT_EQUAL(cli("eval --checkpoint %s/moved/final.h5", tmp_root), 0);
    CU_ASSERT(path_exists("%s/moved/eval.json", tmp_root));
    CU_ASSERT(!path_exists("%s/ev2", tmp_root));
    /* nor does a config's run.out_dir decide */
    CU_ASSERT_EQUAL(cli("eval " TINY " --set run.out_dir=%s/elsewhere --checkpoint %s/moved/final.h5 --quiet",
                        tmp_root, tmp_root), 0);
    CU_ASSERT(!path_exists("%s/elsewhere", tmp_root));
    /* --out: a file, or an existing directory */
    CU_ASSERT_EQUAL(cli("eval --checkpoint %s/moved/final.h5 --out %s/mine.json --quiet", tmp_root, tmp_root), 0);
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/mine.json", tmp_root);
    char *json = test_file_read(path, NULL);
    CU_ASSERT(json && strstr(json, "\"test_accuracy\""));
    free(json);
    snprintf(path, sizeof path, "%s/outdir", tmp_root);
    CU_ASSERT_EQUAL(mkdir(path, 0777), 0);
    CU_ASSERT_EQUAL(cli("eval --checkpoint %s/moved/final.h5 --out %s --quiet", tmp_root, path), 0);
    CU_ASSERT(path_exists("%s/outdir/eval.json", tmp_root));

    /* a checkpoint without a stored config: the message says to pass --config */
    char src[PATH_MAX], dst[PATH_MAX];
    snprintf(src, sizeof src, "%s/moved/final.h5", tmp_root);
    snprintf(dst, sizeof dst, "%s/noconfig.h5", tmp_root);
    CU_ASSERT_FATAL(copy_without_config(src, dst));
    CU_ASSERT_EQUAL(cli("eval --checkpoint %s", dst), 2);
    CU_ASSERT(log_has("holds no stored config"));
    CU_ASSERT(log_has("--config FILE"));
    CU_ASSERT_EQUAL(cli("eval " TINY " --checkpoint %s --quiet", dst), 0);
}

/* ---- compare -------------------------------------------------------------------------------- */

static void test_compare_in_a_fresh_directory(void) {
    CU_ASSERT_EQUAL_FATAL(cli(TINY " --set run.out_dir=%s/cmp-a --set train.steps=3 --quiet", tmp_root), 0);
    char fresh[PATH_MAX];
    snprintf(fresh, sizeof fresh, "%s/fresh", tmp_root);
    CU_ASSERT_EQUAL_FATAL(mkdir(fresh, 0777), 0);
    /* the default --out, runs/compare, where there is no runs/ */
    CU_ASSERT_EQUAL(cli("--version >/dev/null; cd %s && %s compare %s/cmp-a", fresh, bin, tmp_root), 0);
    CU_ASSERT(path_exists("%s/runs/compare/compare.md", fresh));
    CU_ASSERT(path_exists("%s/runs/compare/compare.svg", fresh));
    CU_ASSERT_EQUAL(cli("compare %s/cmp-a --out %s/x/y/z", tmp_root, tmp_root), 0);
    CU_ASSERT(path_exists("%s/x/y/z/compare.md", tmp_root));
}

/* ---- a failed start ------------------------------------------------------------------------- */

static void test_failed_start_leaves_nothing(void) {
    /* init_from missing: the out_dir and the parents this run made are gone */
    CU_ASSERT_EQUAL(cli(TINY " --set run.out_dir=%s/nx/deep/run --set model.init_from=%s/missing.h5 --quiet",
                        tmp_root, tmp_root), 1);
    CU_ASSERT(log_has("missing.h5"));
    CU_ASSERT(!path_exists("%s/nx", tmp_root));
    /* a config error found after the data is read, in an out_dir whose parent existed */
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s/existing", tmp_root);
    CU_ASSERT_EQUAL_FATAL(mkdir(parent, 0777), 0);
    CU_ASSERT_EQUAL(cli(TINY " --set run.out_dir=%s/sub --set model.input=[100] --quiet", parent), 2);
    CU_ASSERT(log_has("model.input"));
    CU_ASSERT(path_exists("%s", parent));
    CU_ASSERT(!path_exists("%s/sub", parent));
    /* an out_dir that existed stays */
    CU_ASSERT_EQUAL(cli(TINY " --set run.out_dir=%s --set model.input=[100] --quiet", parent), 2);
    CU_ASSERT(path_exists("%s", parent));
}

/* ---- init_from of any float type --------------------------------------------------------------- */

typedef struct {
    hid_t f, ftype;
    bool wrong_shape; /* the first dataset gets one more row */
    int done;
} Rewrite;

/* Rewrites /params/<name> as ftype (the values converted by HDF5). */
static herr_t rewrite_one(hid_t group, const char *name, const H5O_info_t *info, void *data) {
    Rewrite *r = data;
    if (info->type != H5O_TYPE_DATASET) return 0;
    hid_t d = H5Dopen2(group, name, H5P_DEFAULT), sp = H5Dget_space(d);
    hsize_t dims[8];
    int rank = H5Sget_simple_extent_dims(sp, dims, NULL);
    hssize_t n = H5Sget_simple_extent_npoints(sp);
    H5Sclose(sp);
    bool grow = r->wrong_shape && r->done == 0;
    size_t rowlen = rank > 0 && dims[0] > 0 ? (size_t)n / dims[0] : 1;
    float *buf = calloc((size_t)n + (grow ? rowlen : 0), sizeof *buf);
    herr_t e = buf && H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0 ? 0 : -1;
    H5Dclose(d);
    if (e == 0) e = H5Ldelete(group, name, H5P_DEFAULT);
    if (grow) dims[0]++;
    hid_t space = H5Screate_simple(rank, dims, NULL);
    hid_t nd = e == 0 ? H5Dcreate2(group, name, r->ftype, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT) : -1;
    if (nd < 0 || H5Dwrite(nd, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) < 0) e = -1;
    if (nd >= 0) H5Dclose(nd);
    H5Sclose(space);
    free(buf);
    r->done++;
    return e;
}

/* A copy of checkpoint src whose parameters are stored as ftype. */
static bool write_params_as(const char *src, const char *dst, hid_t ftype, bool wrong_shape) {
    if (!test_file_copy(src, dst)) return false;
    Rewrite r = {.f = H5Fopen(dst, H5F_ACC_RDWR, H5P_DEFAULT), .ftype = ftype, .wrong_shape = wrong_shape};
    if (r.f < 0) return false;
    /* the names first, as H5Ovisit must not see the group change under it */
    char names[16][64];
    int count = 0;
    hid_t g = H5Gopen2(r.f, "params", H5P_DEFAULT);
    H5G_info_t gi;
    bool ok = g >= 0 && H5Gget_info(g, &gi) >= 0;
    for (hsize_t i = 0; ok && i < gi.nlinks && count < 16; i++) {
        char mod[32];
        if (H5Lget_name_by_idx(g, ".", H5_INDEX_NAME, H5_ITER_INC, i, mod, sizeof mod, H5P_DEFAULT) < 0) ok = false;
        hid_t mg = ok ? H5Gopen2(g, mod, H5P_DEFAULT) : -1;
        H5G_info_t mi;
        if (mg < 0 || H5Gget_info(mg, &mi) < 0) ok = false;
        for (hsize_t k = 0; ok && k < mi.nlinks && count < 16; k++) {
            char leaf[32];
            if (H5Lget_name_by_idx(mg, ".", H5_INDEX_NAME, H5_ITER_INC, k, leaf, sizeof leaf, H5P_DEFAULT) < 0)
                ok = false;
            snprintf(names[count++], sizeof names[0], "%s/%s", mod, leaf);
        }
        if (mg >= 0) H5Gclose(mg);
    }
    for (int i = 0; ok && i < count; i++) {
        H5O_info_t info;
        ok = H5Oget_info_by_name(g, names[i], &info, H5P_DEFAULT) >= 0 && rewrite_one(g, names[i], &info, &r) == 0;
    }
    if (g >= 0) H5Gclose(g);
    H5Fclose(r.f);
    return ok && count > 0;
}

/* IEEE binary16, as numpy's float16 (HDF5 1.10 has no predefined type). */
static hid_t half_type(void) {
    hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    H5Tset_fields(t, 15, 10, 5, 0, 10);
    H5Tset_size(t, 2);
    H5Tset_ebias(t, 15);
    return t;
}

static void test_init_from_any_float(void) {
    CU_ASSERT_EQUAL_FATAL(cli(TINY " --set run.out_dir=%s/f32 --set train.steps=3 --quiet", tmp_root), 0);
    char src[PATH_MAX], f64[PATH_MAX], f16[PATH_MAX], bad[PATH_MAX];
    snprintf(src, sizeof src, "%s/f32/final.h5", tmp_root);
    snprintf(f64, sizeof f64, "%s/params-f64.h5", tmp_root);
    snprintf(f16, sizeof f16, "%s/params-f16.h5", tmp_root);
    snprintf(bad, sizeof bad, "%s/params-bad.h5", tmp_root);
    hid_t half = half_type();
    CU_ASSERT_FATAL(write_params_as(src, f64, H5T_IEEE_F64LE, false));
    CU_ASSERT_FATAL(write_params_as(src, f16, half, false));
    CU_ASSERT_FATAL(write_params_as(src, bad, H5T_IEEE_F64LE, true));
    H5Tclose(half);
    CU_ASSERT_EQUAL(cli("inspect %s", f64), 0);
    CU_ASSERT(log_has("float64"));

    /* evaluation only (epochs 0): float64 holds every float32 exactly, so the metrics are the original's */
    char want[256] = "", *text = NULL;
    CU_ASSERT_EQUAL(cli(TINY " --set run.out_dir=%s/i32 --set model.init_from=%s --set train.steps=0 "
                        "--set train.epochs=0 --quiet", tmp_root, src), 0);
    text = test_file_read(test_cli_log(), NULL);
    if (text) snprintf(want, sizeof want, "%.*s", (int)strcspn(text, "\n"), text);
    free(text);
    CU_ASSERT(strstr(want, "test_accuracy:") != NULL);
    CU_ASSERT_EQUAL(cli(TINY " --set run.out_dir=%s/i64 --set model.init_from=%s --set train.steps=0 "
                        "--set train.epochs=0 --quiet", tmp_root, f64), 0);
    CU_ASSERT(want[0] && log_has(want));
    /* float16 rounds the weights, but loads; a training run starts from it */
    CU_ASSERT_EQUAL(cli(TINY " --set run.out_dir=%s/i16 --set model.init_from=%s --set train.steps=3 --quiet",
                        tmp_root, f16), 0);
    CU_ASSERT(log_has("test_accuracy:"));
    /* a wrong shape is refused, naming both shapes */
    CU_ASSERT_EQUAL(cli(TINY " --set run.out_dir=%s/ibad --set model.init_from=%s --quiet", tmp_root, bad), 1);
    CU_ASSERT(log_has("fc1/bias has shape (33,) in the checkpoint but (32,) in the model"));
}

/* ---- the README's examples ------------------------------------------------------------------ */

/* scripts/readme-examples.sh runs every `qtrain ...` example of README.md on the mini data set (it lists what it
 * substitutes and skips); 77 is its "cannot run here". */
static void test_readme_examples_run(void) {
    if (access("scripts/readme-examples.sh", X_OK) != 0 || access("/bin/bash", X_OK) != 0) {
        test_skip("scripts/readme-examples.sh or /bin/bash is missing");
        return;
    }
    char log[PATH_MAX + 32], cmd[3 * PATH_MAX];
    snprintf(log, sizeof log, "%s/readme-examples.log", tmp_root);
    snprintf(cmd, sizeof cmd, "scripts/readme-examples.sh %s README.md >%s 2>&1", bin, log);
    fflush(NULL);
    int st = system(cmd);
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    char *text = test_file_read(log, NULL);
    if (code == 77) {
        test_skip("%s", text ? text : "(no reason given)");
    } else {
        if (code != 0) fprintf(stderr, "\n  scripts/readme-examples.sh exited %d:\n%s\n", code, text ? text : "");
        CU_ASSERT_EQUAL(code, 0);
        /* the extraction itself: the examples of every kind were found and run */
        const char *kinds[] = {"ok      qtrain --config configs/qlora.yaml", "ok      qtrain eval --checkpoint",
                               "ok      qtrain compare", "ok      qtrain merge", "ok      qtrain convert",
                               "ok      qtrain quantize", "0 failed"};
        for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
            CU_ASSERT(text && strstr(text, kinds[i]));
    }
    free(text);
}

int register_commands_suite(void) {
    CU_pSuite s = CU_add_suite("commands", commands_suite_init, commands_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "every command answers --help and -h with its usage", test_help_of_every_command) ||
           !CU_add_test(s, "a warmup longer than the run is clamped; resume stays exact", test_long_warmup_is_clamped) ||
           !CU_add_test(s, "eval ignores the training schedule and batch plan", test_eval_ignores_the_training_plan) ||
           !CU_add_test(s, "eval.json beside the checkpoint or at --out; no config", test_eval_writes_beside_the_checkpoint) ||
           !CU_add_test(s, "compare creates its output directory", test_compare_in_a_fresh_directory) ||
           !CU_add_test(s, "a failed start leaves no directory it made", test_failed_start_leaves_nothing) ||
           !CU_add_test(s, "init_from accepts float64 and float16 weights", test_init_from_any_float) ||
           !CU_add_test(s, "the README's qtrain examples run on the mini data", test_readme_examples_run);
}
