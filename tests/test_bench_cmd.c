/* test_bench_cmd.c - `qtrain bench` through the binary (QTRAIN_BIN, default
 * build/qtrain) on the shipped mini data set: the bench: lines parse, their
 * figures are positive and finite, nothing lands in run.out_dir, and bad
 * usage exits 2 with a message. No timing is judged here. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "test_util.h"

static char *tmp_root;

static int bench_suite_init(void) {
    tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int bench_suite_cleanup(void) {
    test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return 0;
}

/* Runs `qtrain <args>` (with `env` prepended to the command, may be "")
 * and returns its exit status (-1 if it did not exit); *out gets stdout and
 * stderr together (malloc'd). */
static int run_qtrain(const char *env, const char *args, char **out) {
    const char *bin = getenv("QTRAIN_BIN") ? getenv("QTRAIN_BIN") : "build/qtrain";
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s %s %s 2>&1", env, bin, args);
    fflush(stdout);
    FILE *p = popen(cmd, "r");
    *out = NULL;
    if (!p) return -1;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n - 1, p)) > 0;) {
        n += got;
        if (cap - n < 1024) {
            char *bigger = realloc(buf, cap * 2);
            if (!bigger) break;
            buf = bigger, cap *= 2;
        }
    }
    if (buf) buf[n] = '\0';
    *out = buf;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The value of `key` on the output's line starting with `kind` + " "
 * (e.g. "bench:train"), as a number; NAN if the line or key is missing. */
static double field(const char *out, const char *kind, const char *key) {
    char head[64], k[64];
    snprintf(head, sizeof head, "%s ", kind);
    snprintf(k, sizeof k, " %s:", key);
    for (const char *line = out; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        if (strncmp(line, head, strlen(head)) == 0) {
            const char *f = strstr(line, k);
            if (!f || f > line + len) return NAN;
            char *stop = NULL;
            double v = strtod(f + strlen(k), &stop);
            return stop == f + strlen(k) ? NAN : v;
        }
        line = end ? end + 1 : NULL;
    }
    return NAN;
}

static bool has_line(const char *out, const char *kind) {
    char head[64];
    snprintf(head, sizeof head, "\n%s ", kind);
    return out && (strncmp(out, head + 1, strlen(head + 1)) == 0 || strstr(out, head) != NULL);
}

static bool positive(double v) { return isfinite(v) && v > 0; }

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The figures every run prints, and that out_dir was never made. */
static void check_common(const char *out, const char *out_dir_name) {
    CU_ASSERT(has_line(out, "bench:config"));
    CU_ASSERT(has_line(out, "bench:blas"));
    CU_ASSERT(positive(field(out, "bench:eval", "samples_per_s")));
    CU_ASSERT(positive(field(out, "bench:eval", "batch_ms")));
    double share = field(out, "bench:eval", "gemm_share");
    CU_ASSERT(isfinite(share) && share >= 0 && share <= 1);
    CU_ASSERT(positive(field(out, "bench:mem", "peak_rss_mb")));
    CU_ASSERT(positive(field(out, "bench:mem", "arena_mb")));
    CU_ASSERT(positive(field(out, "bench:startup", "first_step_s")));
    CU_ASSERT_FALSE(test_file_exists(tmp_root, out_dir_name));
}

static void check_train(const char *out) {
    CU_ASSERT(positive(field(out, "bench:train", "samples_per_s")));
    CU_ASSERT(positive(field(out, "bench:train", "step_ms")));
    CU_ASSERT(positive(field(out, "bench:train", "step_ms_median")));
    CU_ASSERT(positive(field(out, "bench:train", "gemm_gflops")));
    CU_ASSERT_EQUAL(field(out, "bench:train", "steps"), 3);
    double share = field(out, "bench:train", "gemm_share");
    CU_ASSERT(isfinite(share) && share > 0 && share <= 1);
}

static void test_bench_float(void) {
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "bench --config tests/configs/tiny-mlp.yaml --set run.out_dir=%s/mlp --steps 3 "
             "--warmup 1 --eval-batches 2 --since-ns %lld", tmp_root, now_ns());
    CU_ASSERT_EQUAL(run_qtrain("", args, &out), 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    check_common(out, "mlp");
    check_train(out);
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "bench:train model:dense32-dense10 mode:float batch:32 "));
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "first:train clock:since-ns"));
    if (strstr(out, "bench:train") == NULL) fprintf(stderr, "\n%s\n", out);
    free(out);
}

/* A QLoRA config without init_from: the fresh initialisation, quantized in
 * memory; nothing is written, under TMPDIR either. */
static void test_bench_qlora_fresh_base(void) {
    char *tmpdir = test_path_join(tmp_root, "tmp"), env[1100], args[1024], *out = NULL;
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", tmpdir);
    CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
    snprintf(env, sizeof env, "TMPDIR=%s", tmpdir);
    snprintf(args, sizeof args, "bench --config tests/configs/tiny-qlora.yaml --set run.out_dir=%s/qlora "
             "--steps 3 --warmup 0 --eval-batches 1", tmp_root);
    CU_ASSERT_EQUAL(run_qtrain(env, args, &out), 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    check_common(out, "qlora");
    check_train(out);
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "note: model.init_from is not set"));
    CU_ASSERT_PTR_NOT_NULL(strstr(out, " mode:qlora "));
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "first:train clock:proc-stat"));
    if (strstr(out, "bench:train") == NULL) fprintf(stderr, "\n%s\n", out);
    free(out);
    snprintf(cmd, sizeof cmd, "rmdir %s 2>/dev/null", tmpdir); /* fails if anything was left in it */
    CU_ASSERT_EQUAL(system(cmd), 0);
    free(tmpdir);
}

/* train.epochs 0: evaluation only, no bench:train line. */
static void test_bench_eval_only(void) {
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "bench --config tests/configs/tiny-qlora.yaml --set run.out_dir=%s/evalonly "
             "--set train.steps=0 --set train.epochs=0 --eval-batches 2 --since-ns %lld", tmp_root, now_ns());
    CU_ASSERT_EQUAL(run_qtrain("", args, &out), 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    check_common(out, "evalonly");
    CU_ASSERT_FALSE(has_line(out, "bench:train"));
    CU_ASSERT_PTR_NOT_NULL(strstr(out, "first:eval"));
    /* nf4 layers have no integer path */
    CU_ASSERT_PTR_NOT_NULL(strstr(out, " int8_kernel:none\n"));
    free(out);
}

/* A w8a8 base: the lines say which int8 path the evaluation took, here the forced portable kernels. */
static void test_bench_int8_kernel(void) {
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "bench --config tests/configs/tiny-base.yaml --set run.out_dir=%s/w8a8 "
             "--set quant.mode=ptq --set 'quant.rules=[{module_path: \".*\", weight_qtype: int8, act_qtype: uint8}]' "
             "--set train.steps=0 --set train.epochs=0 --eval-batches 1", tmp_root);
    CU_ASSERT_EQUAL(run_qtrain("QTRAIN_INT8_KERNEL=portable", args, &out), 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    check_common(out, "w8a8");
    const char *config = strstr(out, "bench:config "), *eval = strstr(out, "bench:eval ");
    CU_ASSERT(config && eval);
    if (config && eval) {
        CU_ASSERT(strstr(config, " int8_kernel:portable\n") == strchr(config, '\n') - strlen(" int8_kernel:portable"));
        CU_ASSERT(strstr(eval, " int8_kernel:portable\n") == strchr(eval, '\n') - strlen(" int8_kernel:portable"));
    }
    if (!config || !eval || !strstr(out, "int8_kernel:portable")) fprintf(stderr, "\n%s\n", out);
    free(out);
    /* the variable is read once at start: a wrong name stops the process before any work, naming it */
    CU_ASSERT_EQUAL(run_qtrain("QTRAIN_INT8_KERNEL=avx2", "bench --config tests/configs/tiny-mlp.yaml", &out), 2);
    CU_ASSERT(out && strstr(out, "qtrain: error: QTRAIN_INT8_KERNEL: unknown int8 kernel 'avx2'") &&
              strstr(out, "vnni, portable, float or auto"));
    if (out && !strstr(out, "'avx2'")) fprintf(stderr, "\n%s\n", out);
    free(out);
}

/* Usage errors: exit 2 and a message naming the problem. */
static void test_bench_usage_errors(void) {
    static const struct {
        const char *args, *msg;
    } cases[] = {
        {"bench", "--config FILE is required"},
        {"bench --config /nonexistent/bench.yaml", "/nonexistent/bench.yaml"},
        {"bench --config tests/configs/tiny-mlp.yaml --bogus", "unknown option '--bogus'"},
        {"bench --config tests/configs/tiny-mlp.yaml --steps 0", "--steps needs an integer >= 1"},
        {"bench --config tests/configs/tiny-mlp.yaml --steps many", "--steps needs an integer >= 1"},
        {"bench --config tests/configs/tiny-mlp.yaml --warmup -1", "--warmup needs an integer >= 0"},
        {"bench --config tests/configs/tiny-mlp.yaml --eval-batches 99999999999", "is too large"},
        {"bench --config tests/configs/tiny-mlp.yaml --since-ns", "--since-ns needs a value"},
        {"bench --config tests/configs/tiny-mlp.yaml --set train.batchsize=3", "batch_size"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        int st = run_qtrain("", cases[i].args, &out);
        CU_ASSERT_EQUAL(st, 2);
        bool ok = out && strstr(out, cases[i].msg) != NULL;
        if (!ok) fprintf(stderr, "\n  qtrain %s (exit %d): %s\n", cases[i].args, st, out ? out : "(no output)");
        CU_ASSERT(ok);
        free(out);
    }
}

int register_bench_cmd_suite(void) {
    CU_pSuite s = CU_add_suite("bench_cmd", bench_suite_init, bench_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "bench: float run prints parsable figures, writes nothing", test_bench_float) ||
           !CU_add_test(s, "bench: QLoRA without init_from uses the fresh base", test_bench_qlora_fresh_base) ||
           !CU_add_test(s, "bench: train.epochs 0 benchmarks evaluation only", test_bench_eval_only) ||
           !CU_add_test(s, "bench: the int8 path on its lines", test_bench_int8_kernel) ||
           !CU_add_test(s, "bench: usage errors exit 2 with a message", test_bench_usage_errors);
}
