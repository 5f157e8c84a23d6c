/* test_runs.h - in-process training runs for the suites that train the tiny
 * configs on the shipped mini data set (qlora, quant_defaults): a suite
 * directory holding tests/configs/tiny-base.yaml's float base, trained once
 * by the suite's init, configs whose run.out_dir lies below it, and paths
 * there; a config's net, with its unused-rule warnings or a checkpoint's
 * model. */
#ifndef QTRAIN_TESTS_TEST_RUNS_H
#define QTRAIN_TESTS_TEST_RUNS_H

#include <stdint.h>

#include "base/error.h"
#include "trainer/net.h"
#include "trainer/config.h"
#include "trainer/train.h"

typedef struct {
    char *root;           /* the suite's directory (test_tmpdir_new); NULL outside the suite */
    char base_ckpt[1024]; /* root/base/final.h5 once the base is trained; "" before */
} TestRuns;

/* A suite's init: makes the directory and trains tiny-base.yaml into
 * root/base. 0, or -1 with a message on stderr. */
int test_runs_init(TestRuns *tr);
/* A suite's cleanup: removes the directory. 0, or -1 if something stayed. */
int test_runs_cleanup(TestRuns *tr);

/* path with run.out_dir=root/sub, model.init_from the float base (once it
 * is trained), then the extra overrides; malloc'd. NULL, with a message on
 * stderr, if the config does not load. */
Config *test_runs_config(const TestRuns *tr, const char *path, const char *sub, const char *const *extra,
                         int n_extra);

/* train_run, quiet, from `resume` (NULL: fresh) and stopping after stop_at
 * (0: the end). stdout is flushed first, so the run's output (none when all
 * is well) does not interleave with CUnit's. */
QtStatus test_runs_train(const Config *c, const char *resume, int64_t stop_at, TrainResult *r, QtError *err);

/* Builds c's net as `how` into n (the test stops if it cannot) and returns
 * the warnings net_print_unused_rules gives for it, one a line, malloc'd
 * ("" for none); *count gets how many it counted. */
char *test_runs_net_warnings(Net *n, const Config *c, NetInit how, int *count);

/* Builds c's net as a shell into n and loads the model of checkpoint ckpt
 * into it; the test stops (with the message) if either fails. */
void test_runs_load_net(Net *n, const Config *c, const char *ckpt);

/* Asserts every parameter and batch-norm statistic of checkpoints a and b, loaded into c's model, equal bit
 * for bit (naming a parameter that differs), and every statistic read from the files (a count above 0);
 * returns the batch-norm modules compared. */
int test_runs_assert_same_state(const Config *c, const char *a, const char *b);

/* Trains path twice under tr->root (run.out_dir sub-straight and sub-split): straight through, and stopped
 * after stop_at then resumed (--resume auto); asserts both end at the same step, test accuracy and loss with
 * every parameter and batch-norm statistic of final.h5 equal bit for bit. Returns the straight run's test
 * accuracy (-1 if a run failed); *n_bn gets the batch-norm modules compared (NULL: not wanted). */
double test_runs_resume_exact(const TestRuns *tr, const char *path, const char *sub, int64_t stop_at, int *n_bn);

/* "root/sub/name" in one of four static buffers, used in turn: up to four
 * may be alive at once. */
char *test_runs_path(const TestRuns *tr, const char *sub, const char *name);

#endif
