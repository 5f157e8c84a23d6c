/* test_util.h - shared helpers for the CUnit suites. */
#ifndef QTRAIN_TESTS_TEST_UTIL_H
#define QTRAIN_TESTS_TEST_UTIL_H

#include <CUnit/CUnit.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "nn/model.h"
#include "nn/tape.h"

/* Every suite file defines one registration function, listed in main.c. */
typedef int (*SuiteRegisterFn)(void);

/* A test-local arena + tape + rng, torn down by test_env_free. */
typedef struct {
    Arena arena;
    Rng rng;
    Tape tape;
} TestEnv;

void test_env_init(TestEnv *e, uint64_t seed);
void test_env_free(TestEnv *e);

/* A Var in the env's arena holding a copy of data, requires_grad as given. */
Var *test_var(TestEnv *e, const float *data, int ndim, const int *shape, bool requires_grad);
/* A layer spec named name reading in0 (and in1; NULL: the previous layer / none): a conv2d is 4 channels, 3x3,
 * stride 1, padding 1, no bias; a batch norm eps 1e-5, momentum 0.1. */
LayerSpec test_layer(LayerType type, const char *name, const char *in0, const char *in1);
/* m's output on x (ndim, shape; no gradients, the tape's training flag as given) into y [cap]; its numel
 * (a failed forward or more than cap values fail the test). */
size_t test_forward_copy(Model *m, TestEnv *e, const float *x, int ndim, const int *shape, bool training, float *y,
                         size_t cap);
/* A training step's results, to compare two ways of running the same step (fused ops, memory plans): the output,
 * every parameter's gradient, every batch norm's running mean and variance. */
#define TEST_STEP_RESULTS_MAX 64
typedef struct {
    float *v[TEST_STEP_RESULTS_MAX];
    size_t n[TEST_STEP_RESULTS_MAX];
    int count;
} TestStepResults;
/* Before a step: m's parameter gradients zeroed, its batch norms' running statistics as PyTorch starts them. */
void test_model_step_reset(Model *m);
/* The backward of y, m's output, from a fixed dy (i % 5 - 2), then r = copies of the results. */
void test_model_step_take(Model *m, TestEnv *e, Var *y, TestStepResults *r);
/* a and b equal bit for bit (each difference named after what); frees both. */
void test_model_step_same(TestStepResults *a, TestStepResults *b, const char *what);

/* max |a[i] - b[i]| / (atol + rtol * |b[i]|) over i: <= 1 means close.
 * *worst gets the index of the worst element if non-NULL. */
double test_close_ratio(const float *a, const float *b, size_t n, double atol, double rtol, size_t *worst);

/* CU_ASSERT with a printed diagnosis when arrays differ. */
#define ASSERT_ALL_CLOSE(a, b, n, atol, rtol)                                                             \
    do {                                                                                                   \
        size_t w_ = 0;                                                                                     \
        double r_ = test_close_ratio((a), (b), (n), (atol), (rtol), &w_);                                  \
        if (r_ > 1.0)                                                                                      \
            fprintf(stderr, "\n  %s:%d: %s[%zu]=%.9g vs %s[%zu]=%.9g (ratio %.3g)\n", __FILE__, __LINE__, \
                    #a, w_, (double)(a)[w_], #b, w_, (double)(b)[w_], r_);                                 \
        CU_ASSERT(r_ <= 1.0);                                                                              \
    } while (0)

/* n floats drawn uniformly from [lo, hi) by an Rng seeded with seed (stream 7); the caller frees them. */
float *test_random_uniform(size_t n, uint64_t seed, float lo, float hi);

/* ---- finite-difference gradient check ----------------------------------- */

/* Builds an output from the inputs (already Vars on e->tape); NULL on error. */
typedef Var *(*GradcheckFn)(Tape *t, Var **inputs, void *ctx);

typedef struct {
    const float *data; /* [numel] initial values */
    int ndim;
    int shape[4];
    bool check;        /* compare this input's gradient */
} GradcheckInput;

/* Checks d/dx of L = sum(out * R), R a fixed random projection, for every
 * element of every input with check=true, against central differences
 * (f(x+eps) - f(x-eps)) / 2eps. L is accumulated in double from the float
 * outputs. Tolerance: |analytic - numeric| <= atol + rtol * |numeric|.
 * With eps = 1e-3 and O(1) values the float32 rounding of each output
 * (~6e-8 relative) contributes ~sqrt(numel) * 6e-8 / 2e-3 < 1e-3 to the
 * numeric derivative, and the O(eps^2) truncation error ~1e-6 * f''', so
 * atol = 2e-3, rtol = 1e-2 separates real bugs (errors of O(1)) from noise.
 * The RNG is reset before every forward so dropout masks repeat.
 * Prints the worst element and returns false on mismatch. */
bool gradcheck(const char *name, GradcheckFn fn, void *ctx, const GradcheckInput *inputs, int n_inputs,
               double eps, double atol, double rtol);

/* ---- files and messages -------------------------------------------------- */

/* A new directory /tmp/qtrain-test-XXXXXX (malloc'd). If mkdtemp fails inside a
 * test the test stops (CU_FAIL_FATAL); outside one (a suite's init) NULL is
 * returned, as a fatal assertion has no test to end there. */
char *test_tmpdir_new(void);

/* Removes dir and everything below it, then frees dir; NULL does nothing.
 * Each directory is made 0700 before it is read, as tests leave read-only
 * ones behind on purpose. True if everything was removed. */
bool test_tmpdir_remove(char *dir);

/* "dir/name", malloc'd. */
char *test_path_join(const char *dir, const char *name);

/* Writes buf[0..n) to path, replacing it; fails the test if path cannot be opened. */
void test_file_write(const char *path, const void *buf, size_t n);

/* The whole file, malloc'd and NUL-terminated; NULL if it cannot be opened.
 * *n gets its length if n is non-NULL. */
char *test_file_read(const char *path, size_t *n);

/* Copies the file src to dst (replacing it); false if src cannot be read. */
bool test_file_copy(const char *src, const char *dst);

/* dir/metrics.csv without its two timing columns (samples_per_s, wall_s),
 * what runs that must agree (a resumed and an uninterrupted one) share;
 * malloc'd, NULL if it cannot be read. */
char *test_metrics_rows(const char *dir);

/* Runs `bin ARGS` (ARGS printf-style, through sh, from the repository root, OpenBLAS on one thread) with
 * stdout and stderr into dir/cli-N.log; returns the exit status (-1: did not exit). test_cli_log() is that
 * log's path, test_cli_log_has() looks in it. */
int test_cli(const char *bin, const char *dir, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
const char *test_cli_log(void);
/* Whether the last test_cli output holds `what`; prints the output if not. */
bool test_cli_log_has(const char *what);

/* Whether dir/name exists. */
bool test_file_exists(const char *dir, const char *name);

/* Whether e's message holds `what`; prints the message if not. With
 * QT_TEST_SHOW_MSGS set every message checked is printed, for reading them. */
bool test_msg_has(const QtError *e, const char *what);

/* No HDF5 object of any file may stay open after a library call. */
void test_assert_hdf5_closed(void);

/* Same parameter count, sizes and values, bit for bit. */
bool test_params_equal(const Model *a, const Model *b);

/* ---- skipped tests ------------------------------------------------------- */

/* What cannot run here (a VNNI kernel on an AVX2 machine, a case that needs
 * root, a missing tool) is reported, never passed in silence: prints
 * "  <test>: skipped: <reason>" at once and keeps the line for the list that
 * main.c prints after CUnit's summary ("skipped: N", then each). The test
 * returns after it (or goes on without the part that cannot run). */
void test_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The skips so far as that list into out; returns their count. */
int test_skips_print(FILE *out);

/* ---- the arena's steady state ------------------------------------------- */

/* The small model the steady-state tests run: input (2, 6, 6) -> conv2d of
 * 4 channels, 3x3, padding 1 -> flatten -> dense 10; parameters from seed. */
void test_small_cnn(Model *m, uint64_t seed);
/* `steps` forward and backward passes of m on the batch x (4, 2, 6, 6)
 * with output gradient dy (4, 10), each after tape_reset; checks that the
 * input gets a gradient, that the arena grew in the first steps, and that
 * neither it nor the tape's node array grows after step 1. */
void test_assert_steady_steps(Model *m, Tape *t, Arena *a, const float *x, const float *dy, int steps);

/* Asserts, reported at file:line, that the YAML text fails config_load_string (as "t.yaml") with a config
 * error whose message holds n1 and, unless NULL, n2 and n3; prints the message when not. */
void test_expect_config_error(const char *file, int line, const char *yaml, const char *n1, const char *n2,
                              const char *n3);

#endif
