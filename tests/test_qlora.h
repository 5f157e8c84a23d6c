/* test_qlora.h - what the files of the qlora suite (test_qlora.c,
 * test_qlora_qat.c) share: its directory with the float base, and the
 * config, run and path helpers over it. */
#ifndef QTRAIN_TESTS_TEST_QLORA_H
#define QTRAIN_TESTS_TEST_QLORA_H

#include <CUnit/CUnit.h>
#include <stdio.h>

#include "test_runs.h"

/* The qlora suite's directory and float base (test_qlora.c's init trains it). */
extern TestRuns qlora_runs;

static inline Config *load_cfg(const char *path, const char *sub, const char *const *extra, int n_extra) {
    return test_runs_config(&qlora_runs, path, sub, extra, n_extra);
}

static inline QtStatus run(const Config *c, const char *resume, int64_t stop_at, TrainResult *r, QtError *err) {
    return test_runs_train(c, resume, stop_at, r, err);
}

/* run from scratch (or resume, up to stop_at) that must succeed: the test
 * stops, with the message, if it does not. */
static inline void run_ok(const Config *c, const char *resume, int64_t stop_at, TrainResult *r) {
    QtError err = {0};
    QtStatus st = run(c, resume, stop_at, r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", c->source, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

static inline char *path_in(const char *sub, const char *name) { return test_runs_path(&qlora_runs, sub, name); }

/* Adds the QAT and QT tests (test_qlora_qat.c) to the qlora suite s, after
 * the others: 0, or -1 if CUnit cannot. */
int qlora_add_qat_tests(CU_pSuite s);

#endif
