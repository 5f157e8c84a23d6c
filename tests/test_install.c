/* test_install.c - the runner itself (a missing suite is a link error, a
 * skip shows in the final summary) and the installed library: `make
 * install` into a temporary prefix, examples/finetune.c built with
 * `pkg-config --cflags --libs qtrain` against it, run on the mini data set
 * and checked against the qtrain binary on the same config. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "include/qtrain.h"
#include "nn/gemm.h"
#include "test_proc.h"
#include "test_util.h"

/* Set in the child runner that test_skip_shows_in_summary starts. */
#define SKIP_DEMO_ENV "QTRAIN_TEST_SKIP_DEMO"

/* Runs cmd with sh, its stdout and stderr into log; returns the exit status, -1 if it did not exit. */
static int run_shell(const char *cmd, const char *log) {
    size_t cap = strlen(cmd) + strlen(log) + 32;
    char *full = malloc(cap);
    CU_ASSERT_PTR_NOT_NULL_FATAL(full);
    snprintf(full, cap, "( %s ) >'%s' 2>&1", cmd, log);
    fflush(NULL);
    int st = system(full);
    free(full);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Whether every one of the programs (sh's command -v) is there. */
static bool have_tools(const char *tools) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "for t in %s; do command -v $t >/dev/null || exit 1; done", tools);
    return run_shell(cmd, "/dev/null") == 0;
}

/* Prints the log (for a failure's diagnosis). */
static void show_log(const char *what, const char *log) {
    char *text = test_file_read(log, NULL);
    fprintf(stderr, "\n  %s:\n%s\n", what, text ? text : "(no output)");
    free(text);
}

/* ---- the runner --------------------------------------------------------------------------------------------- */

/* main.c alone, without the suites it lists, must not link: a suite whose
 * file is missing or whose registration was renamed is an error naming it,
 * not a suite silently left out. */
static void test_missing_suite_is_link_error(void) {
    if (getenv(SKIP_DEMO_ENV)) return;
    if (!have_tools("cc pkg-config")) {
        test_skip("cc or pkg-config is missing");
        return;
    }
    char *dir = test_tmpdir_new(), cmd[4096], log[PATH_MAX];
    snprintf(log, sizeof log, "%s/link.log", dir);
    snprintf(cmd, sizeof cmd, "cc -std=gnu11 -I. $(pkg-config --cflags cunit openblas hdf5) -c tests/main.c -o %s/main.o",
             dir);
    int compiled = run_shell(cmd, log);
    if (compiled != 0) show_log("compiling tests/main.c", log);
    CU_ASSERT_EQUAL_FATAL(compiled, 0);
    snprintf(cmd, sizeof cmd, "cc %s/main.o $(pkg-config --libs cunit) -o %s/runner", dir, dir);
    int linked = run_shell(cmd, log);
    char *text = test_file_read(log, NULL);
    CU_ASSERT_NOT_EQUAL(linked, 0);
    CU_ASSERT(text && strstr(text, "register_nn_core_suite") && strstr(text, "register_install_suite"));
    if (linked == 0 || !text || !strstr(text, "register_install_suite")) show_log("linking main.o alone", log);
    free(text);
    test_tmpdir_remove(dir);
}

/* A test that calls test_skip is listed, with its reason, after CUnit's
 * summary, and the run still passes: the runner, started again on this
 * suite with SKIP_DEMO_ENV set, is where the skip happens. */
static void test_skip_shows_in_summary(void) {
    if (getenv(SKIP_DEMO_ENV)) {
        test_skip("the demonstration skip of the runner suite");
        return;
    }
    char *dir = test_tmpdir_new(), cmd[PATH_MAX + 256], log[PATH_MAX], self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    CU_ASSERT_FATAL(n > 0);
    self[n] = '\0';
    snprintf(log, sizeof log, "%s/runner.log", dir);
    snprintf(cmd, sizeof cmd, "%s=1 '%s' runner", SKIP_DEMO_ENV, self);
    int code = run_shell(cmd, log);
    char *text = test_file_read(log, NULL);
    const char *summary = text ? strstr(text, "Run Summary") : NULL;
    const char *list = summary ? strstr(summary, "\nskipped: 1 ") : NULL;
    CU_ASSERT_EQUAL(code, 0);
    CU_ASSERT_PTR_NOT_NULL(list);
    CU_ASSERT(list && strstr(list, "a skip shows in the summary: the demonstration skip of the runner suite"));
    if (code != 0 || !list) show_log("the runner with a skipping test", log);
    free(text);
    test_tmpdir_remove(dir);
}

/* Without CUnit's pkg-config file (PKG_CONFIG_LIBDIR: a copy of the system's .pc files but cunit.pc), the
 * library and the qtrain command still build, and the test runner's check says which package to install. */
static void test_make_without_cunit(void) {
    if (getenv(SKIP_DEMO_ENV)) return;
    if (!have_tools("make cc pkg-config")) {
        test_skip("make, cc or pkg-config is missing");
        return;
    }
    char *dir = test_tmpdir_new(), cmd[4096], log[PATH_MAX];
    snprintf(log, sizeof log, "%s/make.log", dir);
    snprintf(cmd, sizeof cmd, "mkdir %s/pc && for d in $(pkg-config --variable pc_path pkg-config | tr : ' '); do "
             "for f in \"$d\"/*.pc; do [ -f \"$f\" ] && cp -n \"$f\" %s/pc/; done; done; rm -f %s/pc/cunit.pc; "
             "unset PKG_CONFIG_PATH; export PKG_CONFIG_LIBDIR=%s/pc; ! pkg-config --exists cunit && "
             "env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make --no-print-directory -j2 SANITIZE= CLONES= "
             "build/libqtrain.a build/qtrain && echo BUILT && ! env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make "
             "--no-print-directory SANITIZE= CLONES= pkgcheck-cunit", dir, dir, dir, dir);
    int code = run_shell(cmd, log);
    char *text = test_file_read(log, NULL);
    CU_ASSERT_EQUAL(code, 0);
    CU_ASSERT(text && strstr(text, "BUILT"));
    CU_ASSERT(text && strstr(text, "pkg-config cannot find cunit (Debian: libcunit1-dev)") &&
              strstr(text, "'make test-deps'"));
    if (code != 0 || !text || !strstr(text, "libcunit1-dev")) show_log("make without cunit.pc", log);
    free(text);
    test_tmpdir_remove(dir);
}

int register_runner_suite(void) {
    CU_pSuite s = CU_add_suite("runner", NULL, NULL);
    return !s || !CU_add_test(s, "a missing suite is a link error", test_missing_suite_is_link_error) ||
           !CU_add_test(s, "a skip shows in the summary", test_skip_shows_in_summary) ||
           !CU_add_test(s, "make without CUnit builds; the test build names its package", test_make_without_cunit);
}

/* ---- the installed library ------------------------------------------------------------------------------- */

/* The number after `key` ("test_accuracy:" in the example's output,
 * "\"test_accuracy\": " in summary.json and eval.json) in the file at
 * path; NaN if it is not there. */
static double number_after(const char *path, const char *key) {
    char *text = test_file_read(path, NULL);
    const char *at = text ? strstr(text, key) : NULL;
    double v = at ? strtod(at + strlen(key), NULL) : NAN;
    free(text);
    return v;
}

/* make install into a temporary prefix; examples/finetune.c built by
 * pkg-config's flags against it, linked to libqtrain.so and to libqtrain.a;
 * both run on the mini data set give the test accuracy and loss that the
 * installed qtrain gives on the same config, to the last bit (a float
 * training and a QLoRA fine-tune of its checkpoint), and `qtrain eval`
 * reads the example's checkpoint to the same numbers; make uninstall then
 * leaves no file in the prefix. */
static void test_install_example_matches_cli(void) {
    if (!have_tools("make cc pkg-config")) {
        test_skip("make, cc or pkg-config is missing");
        return;
    }
    char *dir = test_tmpdir_new(), cmd[8 * PATH_MAX], log[PATH_MAX], path[PATH_MAX], want[PATH_MAX];
    snprintf(log, sizeof log, "%s/log", dir);
    /* the normal build whatever this runner's: an ASan library would not link into a plain program */
    const char *make = "env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make --no-print-directory -j2 SANITIZE= CLONES=";
    snprintf(cmd, sizeof cmd, "%s install PREFIX=%s/prefix", make, dir);
    int code = run_shell(cmd, log);
    if (code != 0) show_log("make install", log);
    CU_ASSERT_EQUAL_FATAL(code, 0);
    const char *installed[] = {"bin/qtrain", "lib/libqtrain.a", "lib/libqtrain.so", "lib/libqtrain.so.0",
                               "include/qtrain.h", "lib/pkgconfig/qtrain.pc"};
    for (size_t i = 0; i < sizeof installed / sizeof *installed; i++) {
        snprintf(path, sizeof path, "%s/prefix/%s", dir, installed[i]);
        if (access(path, R_OK) != 0) fprintf(stderr, "\n  not installed: %s\n", path);
        CU_ASSERT_EQUAL(access(path, R_OK), 0);
    }

    /* a second install of the built tree (as `sudo make install` after a build), staged by DESTDIR: it writes
     * nothing under build/, where a root-owned file would break the next build, and qtrain.pc names PREFIX */
    snprintf(cmd, sizeof cmd, "touch %s/stamp && %s install PREFIX=/usr/local DESTDIR=%s/stage && "
             "test -z \"$(find build -maxdepth 1 -type f -newer %s/stamp)$(find build/pic -type f -newer %s/stamp)\" && "
             "grep -qx 'prefix=/usr/local' %s/stage/usr/local/lib/pkgconfig/qtrain.pc && "
             "%s uninstall PREFIX=/usr/local DESTDIR=%s/stage && test -z \"$(find %s/stage ! -type d)\"",
             dir, make, dir, dir, dir, dir, make, dir, dir);
    code = run_shell(cmd, log);
    if (code != 0) show_log("make install DESTDIR= of a built tree (nothing new under build/), then uninstall", log);
    CU_ASSERT_EQUAL(code, 0);

    /* the example, against the shared and the static library */
    const char *pc = "PKG_CONFIG_PATH=\"$P/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}\"";
    snprintf(cmd, sizeof cmd, "P=%s/prefix; export %s; cc -std=gnu11 -Wall -Wextra -Werror examples/finetune.c "
             "$(pkg-config --cflags --libs qtrain) -o %s/finetune-shared && cc examples/finetune.c "
             "$(pkg-config --cflags qtrain) $(pkg-config --static --libs qtrain | sed 's/-lqtrain\\b/-l:libqtrain.a/') "
             "-o %s/finetune-static", dir, pc, dir, dir);
    code = run_shell(cmd, log);
    if (code != 0) show_log("building examples/finetune.c with pkg-config", log);
    CU_ASSERT_EQUAL_FATAL(code, 0);

    /* a float training, then a QLoRA fine-tune of its checkpoint: the installed qtrain, and the example */
    snprintf(cmd, sizeof cmd, "%s/prefix/bin/qtrain --config tests/configs/tiny-base.yaml --set run.out_dir=%s/base "
             "--quiet && %s/prefix/bin/qtrain --config tests/configs/tiny-qlora.yaml --set run.out_dir=%s/qlora "
             "--set model.init_from=%s/base/final.h5 --quiet", dir, dir, dir, dir, dir);
    code = run_shell(cmd, log);
    if (code != 0) show_log("qtrain on tiny-base.yaml and tiny-qlora.yaml", log);
    CU_ASSERT_EQUAL_FATAL(code, 0);
    /* On an AVX-512 CPU whose OpenBLAS picks AVX2 kernels the qtrain command restarts itself with
     * OPENBLAS_CORETYPE set (nn/gemm.h), unless the environment already pins one, which both then keep; a program
     * gets the same kernels, and numbers, with the same setting. */
    const char *upgrade = getenv("OPENBLAS_CORETYPE") ? NULL : gemm_blas_core_upgrade();
    char coretype[64] = "";
    if (upgrade) snprintf(coretype, sizeof coretype, "OPENBLAS_CORETYPE=%s", upgrade);
    struct {
        const char *binary, *config, *set, *cli_dir;
    } runs[] = {{"finetune-static", "tiny-base", "", "base"},
                {"finetune-shared", "tiny-qlora", "model.init_from=%s/base/final.h5", "qlora"}};
    for (int i = 0; i < 2; i++) {
        char set[PATH_MAX], out[PATH_MAX];
        snprintf(set, sizeof set, runs[i].set, dir);
        snprintf(out, sizeof out, "%s/%s.out", dir, runs[i].binary);
        snprintf(cmd, sizeof cmd, "%s LD_LIBRARY_PATH=%s/prefix/lib %s/%s tests/configs/%s.yaml %s/%s.h5 %s >%s",
                 coretype, dir, dir, runs[i].binary, runs[i].config, dir, runs[i].binary, set, out);
        code = run_shell(cmd, log);
        if (code != 0) show_log(runs[i].binary, log);
        CU_ASSERT_EQUAL_FATAL(code, 0);
        snprintf(want, sizeof want, "%s/%s/summary.json", dir, runs[i].cli_dir);
        double acc = number_after(out, "test_accuracy:"), loss = number_after(out, "test_loss:");
        double cli_acc = number_after(want, "\"test_accuracy\": "), cli_loss = number_after(want, "\"test_loss\": ");
        if (!(acc == cli_acc && loss == cli_loss))
            fprintf(stderr, "\n  %s on %s: test accuracy %.17g loss %.17g; qtrain: %.17g, %.17g\n", runs[i].binary,
                    runs[i].config, acc, loss, cli_acc, cli_loss);
        CU_ASSERT(isfinite(acc) && acc > 0.0 && acc == cli_acc);
        CU_ASSERT(isfinite(loss) && loss == cli_loss);
    }
    /* the fine-tune's checkpoint, evaluated by the qtrain command */
    snprintf(cmd, sizeof cmd, "%s/prefix/bin/qtrain eval --checkpoint %s/finetune-shared.h5 --out %s/eval.json --quiet",
             dir, dir, dir);
    code = run_shell(cmd, log);
    if (code != 0) show_log("qtrain eval of the example's checkpoint", log);
    CU_ASSERT_EQUAL(code, 0);
    snprintf(path, sizeof path, "%s/eval.json", dir);
    snprintf(want, sizeof want, "%s/qlora/summary.json", dir);
    CU_ASSERT_EQUAL(number_after(path, "\"test_accuracy\": "), number_after(want, "\"test_accuracy\": "));

    snprintf(cmd, sizeof cmd, "%s uninstall PREFIX=%s/prefix && test -z \"$(find %s/prefix ! -type d)\"", make, dir, dir);
    code = run_shell(cmd, log);
    if (code != 0) show_log("make uninstall (no file may be left in the prefix)", log);
    CU_ASSERT_EQUAL(code, 0);
    test_tmpdir_remove(dir);
}

/* ---- the API in this process --------------------------------------------------------------------------- */

/* Steps run to steps_done == until; false (with the message) on a failure. */
static bool api_steps_until(qtrain_run *run, int64_t until) {
    while (qtrain_run_steps_done(run) < until) {
        double loss = NAN;
        qtrain_status st = qtrain_run_step(run, &loss);
        if (st != QTRAIN_OK || !isfinite(loss)) {
            fprintf(stderr, "\n  step %lld: %s\n", (long long)qtrain_run_steps_done(run), qtrain_last_error());
            return false;
        }
    }
    return true;
}

/* A run saved halfway and loaded by qtrain_run_load (with the config the
 * checkpoint stores) ends where the run without the break ends (the same
 * test accuracy and loss, bit for bit), and its saved end evaluates from
 * the file to the same numbers and quantizes to int8 (a config from YAML
 * text) at about the float accuracy; the plan's end, a checkpoint past a
 * shorter plan, a missing file and a mistyped key are errors with a
 * message, and so are overrides passed as NULL. */
static void test_api_save_load_continues(void) {
    char *dir = test_tmpdir_new(), *half = test_path_join(dir, "half.h5"), *end = test_path_join(dir, "end.h5");
    const char *sets[] = {"train.steps=12"};
    qtrain_config *cfg = NULL;
    CU_ASSERT_EQUAL_FATAL(qtrain_config_load(&cfg, "tests/configs/tiny-base.yaml", sets, 1), QTRAIN_OK);
    qtrain_run *whole = NULL, *first = NULL, *second = NULL;
    qtrain_metrics a, b;
    CU_ASSERT_EQUAL_FATAL(qtrain_run_new(&whole, cfg), QTRAIN_OK);
    CU_ASSERT_EQUAL(qtrain_run_steps_total(whole), 12);
    CU_ASSERT_FATAL(api_steps_until(whole, 12));
    CU_ASSERT_EQUAL(qtrain_run_step(whole, NULL), QTRAIN_ERR_ARG); /* the plan is done */
    CU_ASSERT_PTR_NOT_NULL(strstr(qtrain_last_error(), "raise train.steps"));
    CU_ASSERT_EQUAL_FATAL(qtrain_run_evaluate(whole, &a), QTRAIN_OK);
    CU_ASSERT_EQUAL_FATAL(qtrain_run_save(whole, end), QTRAIN_OK);

    CU_ASSERT_EQUAL_FATAL(qtrain_run_new(&first, cfg), QTRAIN_OK);
    CU_ASSERT_FATAL(api_steps_until(first, 5));
    CU_ASSERT_EQUAL_FATAL(qtrain_run_save(first, half), QTRAIN_OK);
    qtrain_run_free(first);
    qtrain_config *stored = NULL; /* the config the checkpoint holds, as the run had it */
    CU_ASSERT_EQUAL_FATAL(qtrain_config_from_checkpoint(&stored, half, NULL, 0), QTRAIN_OK);
    CU_ASSERT_EQUAL_FATAL(qtrain_run_load(&second, stored, half), QTRAIN_OK);
    qtrain_config_free(stored);
    CU_ASSERT_EQUAL(qtrain_run_steps_done(second), 5);
    CU_ASSERT_FATAL(api_steps_until(second, 12));
    CU_ASSERT_EQUAL_FATAL(qtrain_run_evaluate(second, &b), QTRAIN_OK);
    CU_ASSERT_EQUAL(b.step, 12);
    CU_ASSERT(a.test_accuracy == b.test_accuracy && a.test_loss == b.test_loss && a.test_accuracy > 0.2);
    if (!(a.test_accuracy == b.test_accuracy && a.test_loss == b.test_loss))
        fprintf(stderr, "\n  whole %.17g %.17g, saved and loaded %.17g %.17g\n", a.test_accuracy, a.test_loss,
                b.test_accuracy, b.test_loss);
    qtrain_run_free(whole);
    qtrain_run_free(second);
    qtrain_config_free(cfg);

    /* the saved end, evaluated from the file with its stored config */
    CU_ASSERT_EQUAL(qtrain_evaluate_checkpoint(NULL, end, &b), QTRAIN_OK);
    CU_ASSERT(b.step == 12 && b.test_accuracy == a.test_accuracy && b.test_loss == a.test_loss);
    /* PTQ of the saved end by a config given as YAML text: int8 weights, about the float accuracy */
    char *yaml = test_file_read("tests/configs/tiny-base.yaml", NULL), *quant = test_path_join(dir, "int8.h5");
    CU_ASSERT_PTR_NOT_NULL_FATAL(yaml);
    const char *rules = "quant:\n  mode: ptq\n  rules:\n    - {module_path: \".*\", weight_qtype: int8}\n";
    char *text = malloc(strlen(yaml) + strlen(rules) + 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    strcat(strcpy(text, yaml), rules);
    CU_ASSERT_EQUAL_FATAL(qtrain_config_parse(&cfg, text, "tiny-base+int8", NULL, 0), QTRAIN_OK);
    CU_ASSERT_EQUAL(qtrain_quantize_checkpoint(cfg, end, quant), QTRAIN_OK);
    qtrain_config_free(cfg);
    qtrain_metrics q;
    CU_ASSERT_EQUAL(qtrain_evaluate_checkpoint(NULL, quant, &q), QTRAIN_OK);
    CU_ASSERT(q.base_bits_per_param < 9.0 && fabs(q.test_accuracy - a.test_accuracy) < 0.05);
    free(yaml), free(text), free(quant);
    /* a plan shorter than the checkpoint's step cannot continue it */
    const char *shorter[] = {"train.steps=3"};
    CU_ASSERT_EQUAL_FATAL(qtrain_config_load(&cfg, "tests/configs/tiny-base.yaml", shorter, 1), QTRAIN_OK);
    CU_ASSERT_EQUAL(qtrain_run_load(&second, cfg, half), QTRAIN_ERR_CONFIG);
    CU_ASSERT_PTR_NULL(second);
    CU_ASSERT_PTR_NOT_NULL(strstr(qtrain_last_error(), "qtrain_config_from_checkpoint"));
    qtrain_config_free(cfg);

    cfg = NULL;
    CU_ASSERT_EQUAL(qtrain_config_load(&cfg, "tests/configs/no-such.yaml", NULL, 0), QTRAIN_ERR_IO);
    CU_ASSERT_PTR_NULL(cfg);
    CU_ASSERT_PTR_NOT_NULL(strstr(qtrain_last_error(), "no-such.yaml"));
    const char *typo[] = {"train.stpes=3"};
    CU_ASSERT_EQUAL(qtrain_config_load(&cfg, "tests/configs/tiny-base.yaml", typo, 1), QTRAIN_ERR_CONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(qtrain_last_error(), "steps"));
    /* overrides that are not there are a bad argument, not a crash */
    const char *holes[] = {"train.steps=3", NULL};
    CU_ASSERT_EQUAL(qtrain_config_load(&cfg, "tests/configs/tiny-base.yaml", NULL, 1), QTRAIN_ERR_ARG);
    CU_ASSERT_PTR_NULL(cfg);
    CU_ASSERT_EQUAL(qtrain_config_load(&cfg, "tests/configs/tiny-base.yaml", holes, -1), QTRAIN_ERR_ARG);
    CU_ASSERT_EQUAL(qtrain_config_parse(&cfg, "train: {steps: 3}\n", "text", holes, 2), QTRAIN_ERR_ARG);
    CU_ASSERT_PTR_NOT_NULL(strstr(qtrain_last_error(), "override 1 of 2 is NULL"));
    CU_ASSERT_PTR_NULL(cfg);
    free(half), free(end);
    test_tmpdir_remove(dir);
}

int register_install_suite(void) {
    CU_pSuite s = CU_add_suite("install", NULL, NULL);
    return !s || !CU_add_test(s, "make install, the example via pkg-config = qtrain", test_install_example_matches_cli) ||
           !CU_add_test(s, "the API: a loaded run continues exactly; quantize, evaluate a file, errors, NULL overrides",
                           test_api_save_load_continues);
}
