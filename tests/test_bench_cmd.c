/* test_bench_cmd.c - `qtrain bench` through the binary (QTRAIN_BIN, default
 * build/qtrain) on the shipped mini data set: the bench: lines parse, their
 * figures are positive and finite, nothing lands in run.out_dir, and bad
 * usage exits 2 with a message; and the harnesses of make bench-export. No
 * timing is judged here. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

/* Runs the shell command `cmd` and returns its exit status (-1 if it did
 * not exit); *out gets stdout and stderr together (malloc'd). */
static int run_shell(const char *cmd, char **out) {
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

/* Runs `qtrain <args>` (with `env` prepended to the command, may be "")
 * as run_shell does. */
static int run_qtrain(const char *env, const char *args, char **out) {
    const char *bin = getenv("QTRAIN_BIN") ? getenv("QTRAIN_BIN") : "build/qtrain";
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s %s %s 2>&1", env, bin, args);
    return run_shell(cmd, out);
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

/* The sgemm rate and the GEMM-bound limit on bench:train agree with each
 * other as printed: bound = rate / (2 macs), of_bound = samples/s / bound,
 * each within the rounding of the figures it is made of. */
static void check_bound(const char *out) {
    CU_ASSERT_EQUAL(field(out, "bench:sgemm", "m"), 1024);
    CU_ASSERT_EQUAL(field(out, "bench:sgemm", "n"), 1024);
    CU_ASSERT_EQUAL(field(out, "bench:sgemm", "k"), 1024);
    CU_ASSERT(field(out, "bench:sgemm", "reps") >= 3 && field(out, "bench:sgemm", "reps") <= 30);
    double rate = field(out, "bench:sgemm", "gflops"), median = field(out, "bench:sgemm", "gflops_median");
    CU_ASSERT(positive(rate) && positive(median) && median <= rate); /* the rate is the best product's */
    double macs = field(out, "bench:train", "macs_per_sample"), fwd = field(out, "bench:train", "macs_forward");
    double dx = field(out, "bench:train", "macs_backward_dx"), dw = field(out, "bench:train", "macs_backward_dw");
    CU_ASSERT(positive(macs) && positive(fwd) && dx >= 0 && dw >= 0);
    CU_ASSERT_DOUBLE_EQUAL(macs, fwd + dx + dw, 1.5);
    double bound = field(out, "bench:train", "bound_samples_per_s"), of = field(out, "bench:train", "of_bound");
    double sps = field(out, "bench:train", "samples_per_s");
    CU_ASSERT(positive(bound) && positive(of));
    double want = rate * 1e9 / (2.0 * macs);
    CU_ASSERT_DOUBLE_EQUAL(bound, want, want * 0.05 / rate + 0.05 + 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(of, sps / bound, 0.0005 + (sps / bound) * (0.05 / sps + 0.05 / bound) + 1e-9);
    /* in the order of the lines: the rate, then the step it bounds, then the evaluation */
    const char *sg = strstr(out, "bench:sgemm "), *tr = strstr(out, "bench:train "), *ev = strstr(out, "bench:eval ");
    CU_ASSERT(sg && tr && sg < tr && (!ev || tr < ev));
}

static void check_train(const char *out) {
    CU_ASSERT(positive(field(out, "bench:train", "samples_per_s")));
    CU_ASSERT(positive(field(out, "bench:train", "step_ms")));
    CU_ASSERT(positive(field(out, "bench:train", "step_ms_median")));
    CU_ASSERT(positive(field(out, "bench:train", "gemm_gflops")));
    CU_ASSERT_EQUAL(field(out, "bench:train", "steps"), 3);
    double share = field(out, "bench:train", "gemm_share");
    CU_ASSERT(isfinite(share) && share > 0 && share <= 1);
    check_bound(out);
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
    /* flatten 784 -> fc1 32 -> head 10: forward 784*32 + 32*10 = 25408; input gradient of the head alone
       (fc1 reads the data): 320; every weight's gradient: 25408 */
    CU_ASSERT_EQUAL(field(out, "bench:train", "macs_forward"), 25408);
    CU_ASSERT_EQUAL(field(out, "bench:train", "macs_backward_dx"), 320);
    CU_ASSERT_EQUAL(field(out, "bench:train", "macs_backward_dw"), 25408);
    CU_ASSERT_EQUAL(field(out, "bench:train", "macs_per_sample"), 51136);
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
    CU_ASSERT_FALSE(has_line(out, "bench:sgemm")); /* the rate is for the training step's bound */
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
        /* the eval line ends with how many int8 layers take the kernels, of those with int8 weights and inputs */
        const char *k = strstr(eval, " int8_kernel:portable int8_layers:");
        CU_ASSERT(k && k < strchr(eval, '\n'));
        int on = -1, with = -1;
        CU_ASSERT(k && sscanf(k, " int8_kernel:portable int8_layers:%d/%d", &on, &with) == 2 && on == with && on > 0);
    }
    if (!config || !eval || !strstr(out, "int8_kernel:portable")) fprintf(stderr, "\n%s\n", out);
    /* QT's quantizers follow the cap's width: the portable ones here */
    CU_ASSERT_PTR_NOT_NULL(strstr(out, " qt_kernel:portable\n"));
    free(out);
    /* the variable is read once at start: a wrong name stops the process before any work, naming it */
    CU_ASSERT_EQUAL(run_qtrain("QTRAIN_INT8_KERNEL=sse4", "bench --config tests/configs/tiny-mlp.yaml", &out), 2);
    CU_ASSERT(out && strstr(out, "qtrain: error: QTRAIN_INT8_KERNEL: unknown int8 kernel 'sse4'") &&
              strstr(out, "vnni, avxvnni, avx2, portable, float or auto"));
    if (out && !strstr(out, "'sse4'")) fprintf(stderr, "\n%s\n", out);
    free(out);
}

/* bench/torch_bench.py on a DAG of every layer kind it maps (grouped, dilated, [h, w], same-padded and biasless
 * conv2d, batchnorm2d/1d with eps, momentum and affine, concat, add, globalavgpool): `run` prints the bench lines
 * with qtrain bench's model name and parameter count, PTQ int8 (FX mode) evaluates it, `agree` compares that int8
 * model with the float one (and refuses a config without PTQ), and `train` with
 * model.init_from on qtrain's checkpoint and train.epochs 0 gives qtrain's own test accuracy and loss (the same
 * function, data transforms and running statistics). Needs Debian's python3 with torch, yaml, numpy and h5py;
 * without them the test says it is skipped and why. */
#define TORCH_PYTHON "/usr/bin/python3"
#define TORCH_BENCH TORCH_PYTHON " bench/torch_bench.py"

static void write_dag_config(const char *path, const char *out_dir, const char *model_extra, const char *tail) {
    char text[4096];
    int n = snprintf(text, sizeof text,
        "run: {name: tiny-dag, out_dir: %s, seed: 2, threads: 1}\n"
        "data:\n"
        "  dir: data/fashion-mnist-mini\n"
        "  cache_dir: none\n"
        "  transform: [{limit: 256}, normalize]\n"
        "model:\n"
        "  input: [1, 28, 28]\n%s"
        "  layers:\n"
        "    - {name: stem, type: conv2d, out_channels: 8, kernel: 3, stride: 2, padding: 1, bias: false}\n"
        "    - {name: stem_bn, type: batchnorm2d, eps: 0.001, momentum: 0.2}\n"
        "    - {name: trunk, type: relu}\n"
        "    - {name: dw, type: conv2d, out_channels: 8, kernel: [3, 5], padding: same, groups: 8, bias: false}\n"
        "    - {name: dw_bn, type: batchnorm2d, affine: false}\n"
        "    - {name: pw, type: conv2d, out_channels: 8, kernel: 1}\n"
        "    - {name: dil, type: conv2d, out_channels: 4, kernel: 3, padding: [2, 2], dilation: 2, groups: 2, "
        "inputs: [trunk]}\n"
        "    - {name: cat, type: concat, inputs: [pw, dil]}\n"
        "    - {name: wide, type: conv2d, out_channels: 12, kernel: [1, 3], padding: [0, 1], inputs: [trunk]}\n"
        "    - {name: sum, type: add, inputs: [cat, wide]}\n"
        "    - {type: relu}\n"
        "    - {type: globalavgpool}\n"
        "    - {type: batchnorm1d}\n"
        "    - {name: head, type: dense, units: 10}\n%s",
        out_dir, model_extra, tail);
    CU_ASSERT_FATAL(n > 0 && (size_t)n < sizeof text);
    test_file_write(path, text, (size_t)n);
}

/* The value of `key` on the `kind` line as text (up to the next space), into buf; "" if missing. */
static const char *text_field(const char *out, const char *kind, const char *key, char *buf, size_t cap) {
    char head[64], k[64];
    snprintf(head, sizeof head, "%s ", kind);
    snprintf(k, sizeof k, " %s:", key);
    buf[0] = '\0';
    const char *line = out ? strstr(out, head) : NULL;
    const char *f = line ? strstr(line, k) : NULL;
    const char *end = line ? strchr(line, '\n') : NULL;
    if (!f || (end && f > end)) return buf;
    f += strlen(k);
    size_t len = strcspn(f, " \n");
    snprintf(buf, cap, "%.*s", (int)(len < cap ? len : cap - 1), f);
    return buf;
}

static void test_torch_bench_dag(void) {
    char cmd[2048], *out = NULL;
    if (access(TORCH_PYTHON, X_OK) != 0) {
        test_skip(TORCH_PYTHON " is missing (Debian's python3 with python3-torch)");
        return;
    }
    if (run_shell(TORCH_PYTHON " -c 'import torch, yaml, numpy, h5py' 2>&1", &out) != 0) {
        size_t len = out ? strlen(out) : 0;
        while (len && out[len - 1] == '\n') out[--len] = '\0';
        const char *last = out ? strrchr(out, '\n') : NULL; /* the exception's line */
        test_skip(TORCH_PYTHON " cannot import torch, yaml, numpy and h5py (apt-get install python3-torch "
                  "python3-h5py): %s", last ? last + 1 : out ? out : "no output");
        free(out);
        return;
    }
    free(out);
    char *cfg = test_path_join(tmp_root, "dag.yaml"), *eval_cfg = test_path_join(tmp_root, "dag-eval.yaml");
    char *ptq_cfg = test_path_join(tmp_root, "dag-ptq.yaml"), *run_dir = test_path_join(tmp_root, "dag");
    char *ckpt = test_path_join(run_dir, "final.h5"), extra[1200];
    write_dag_config(cfg, run_dir, "", "train: {steps: 20, batch_size: 16, eval_batch_size: 64}\n");
    snprintf(extra, sizeof extra, "  init_from: %s\n", ckpt);
    write_dag_config(eval_cfg, run_dir, extra, "train: {epochs: 0, eval_batch_size: 64}\n");
    write_dag_config(ptq_cfg, run_dir, "",
                     "train: {epochs: 0, batch_size: 16, eval_batch_size: 64}\n"
                     "quant:\n  mode: ptq\n  calibration_batches: 2\n  rules:\n"
                     "    - {module_path: \".*\", op_types: [conv2d, dense], weight_qtype: int8, act_qtype: uint8, "
                     "act_symmetric: false}\n");

    /* qtrain's view of the model, then the same config in PyTorch */
    char args[1400], q_model[256], q_params[32], t_model[256], t_params[32];
    snprintf(args, sizeof args, "bench --config %s --steps 1 --warmup 0 --eval-batches 1", cfg);
    CU_ASSERT_EQUAL(run_qtrain("", args, &out), 0);
    text_field(out, "bench:config", "model", q_model, sizeof q_model);
    text_field(out, "bench:config", "params_trainable", q_params, sizeof q_params);
    free(out);
    CU_ASSERT_STRING_EQUAL(q_model, "conv8-conv8-conv8-conv4-conv12-dense10");
    snprintf(cmd, sizeof cmd, "OPENBLAS_NUM_THREADS=1 " TORCH_BENCH " run --config %s --steps 2 --warmup 1 "
             "--eval-batches 1 2>&1", cfg);
    CU_ASSERT_EQUAL(run_shell(cmd, &out), 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    text_field(out, "bench:config", "model", t_model, sizeof t_model);
    text_field(out, "bench:config", "params_trainable", t_params, sizeof t_params);
    CU_ASSERT_STRING_EQUAL(t_model, q_model);
    CU_ASSERT_STRING_EQUAL(t_params, q_params);
    CU_ASSERT(positive(field(out, "bench:train", "samples_per_s")));
    CU_ASSERT(positive(field(out, "bench:eval", "samples_per_s")));
    CU_ASSERT(positive(field(out, "bench:mem", "peak_rss_mb")));
    CU_ASSERT(has_line(out, "bench:startup"));
    if (!has_line(out, "bench:eval") || strcmp(t_params, q_params) != 0) fprintf(stderr, "\n%s\n", out);
    free(out);

    /* PTQ int8 in FX mode: the batch norms folded, the concat and add quantized */
    snprintf(cmd, sizeof cmd, "OPENBLAS_NUM_THREADS=1 " TORCH_BENCH " run --config %s --eval-batches 1 2>&1",
             ptq_cfg);
    CU_ASSERT_EQUAL(run_shell(cmd, &out), 0);
    CU_ASSERT(out && strstr(out, " mode:ptq ") && !has_line(out, "bench:train"));
    CU_ASSERT(positive(field(out, "bench:eval", "samples_per_s")));
    if (!has_line(out, "bench:eval")) fprintf(stderr, "\n%s\n", out ? out : "(no output)");
    free(out);

    /* `agree`: that int8 model against its float model, a line of figures; a config without PTQ refused */
    snprintf(cmd, sizeof cmd, "OPENBLAS_NUM_THREADS=1 " TORCH_BENCH " agree --config %s --batches 1 2>&1", ptq_cfg);
    CU_ASSERT_EQUAL(run_shell(cmd, &out), 0);
    const double agree = field(out, "bench:agree", "top1_agreement"), rel = field(out, "bench:agree", "rms_rel");
    CU_ASSERT(agree >= 0.5 && agree <= 1.0 && rel >= 0.0 && rel < 0.5);
    CU_ASSERT_EQUAL(field(out, "bench:agree", "images"), 64.0);
    if (!(agree >= 0.5 && rel < 0.5)) fprintf(stderr, "\n%s\n", out ? out : "(no output)");
    free(out);
    snprintf(cmd, sizeof cmd, TORCH_BENCH " agree --config %s 2>&1", cfg);
    CU_ASSERT_NOT_EQUAL(run_shell(cmd, &out), 0);
    CU_ASSERT(out && strstr(out, "agree compares a PTQ config's int8 model"));
    free(out);

    /* the same function: qtrain's trained checkpoint evaluates alike in PyTorch */
    snprintf(args, sizeof args, "--config %s", cfg);
    CU_ASSERT_EQUAL_FATAL(run_qtrain("OPENBLAS_NUM_THREADS=1", args, &out), 0);
    double q_acc = field(out, "done:", "test_accuracy"), q_loss = field(out, "done:", "test_loss");
    free(out);
    snprintf(cmd, sizeof cmd, "OPENBLAS_NUM_THREADS=1 " TORCH_BENCH " train --config %s 2>&1", eval_cfg);
    CU_ASSERT_EQUAL(run_shell(cmd, &out), 0);
    double t_acc = field(out, "torch:final", "test_acc"), t_loss = field(out, "torch:final", "test_loss");
    CU_ASSERT(isfinite(q_acc) && isfinite(q_loss));
    CU_ASSERT_DOUBLE_EQUAL(t_acc, q_acc, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(t_loss, q_loss, 2e-4);
    if (!(fabs(t_loss - q_loss) <= 2e-4))
        fprintf(stderr, "\n  qtrain test_accuracy %g test_loss %g; PyTorch:\n%s\n", q_acc, q_loss,
                out ? out : "(no output)");
    free(out);
    free(cfg), free(eval_cfg), free(ptq_cfg), free(run_dir), free(ckpt);
}

/* bench/export_timing.c and bench/export_torch.py (make bench-export) on a tiny PTQ w8a8 CNN of the mini data set:
 * a float base of a few steps, PTQ with uint8 input ranges on every conv and dense (as configs/ptq-w8a8.yaml), then
 * `qtrain export --format c`. The harness must build as C99 with every warning an error against the export and,
 * made to cover the whole test set once, give the export's own integer accuracy: it times the trained program, not
 * something else. Speeds are only checked to be positive and consistent with the MAC count. */
static void write_export_configs(const char *float_cfg, const char *ptq_cfg, const char *float_dir,
                                 const char *ptq_dir) {
    static const char common[] =
        "data:\n"
        "  dir: data/fashion-mnist-mini\n"
        "  cache_dir: none\n"
        "  transform: [{normalize: {mean: 0.2860, std: 0.3530}}]\n"
        "model:\n"
        "  input: [1, 28, 28]\n"
        "  layers:\n"
        "    - {name: conv1, type: conv2d, out_channels: 4, kernel: 3, padding: 1}\n"
        "    - {type: relu}\n"
        "    - {type: maxpool2d, kernel: 2}\n"
        "    - {type: flatten}\n"
        "    - {name: head, type: dense, units: 10}\n";
    char text[4096];
    int n = snprintf(text, sizeof text, "run: {name: et-float, out_dir: %s, seed: 3, threads: 1}\n%s"
                     "train: {steps: 30, batch_size: 32, optimizer: {name: adamw, lr: 0.003}}\n", float_dir, common);
    CU_ASSERT_FATAL(n > 0 && (size_t)n < sizeof text);
    test_file_write(float_cfg, text, (size_t)n);
    n = snprintf(text, sizeof text, "run: {name: et-ptq, out_dir: %s, seed: 3, threads: 1}\n%s"
                 "  init_from: %s/final.h5\n"
                 "quant:\n  mode: ptq\n  calibration_batches: 4\n  rules:\n"
                 "    - {module_path: \".*\", op_types: [conv2d, dense], weight_qtype: int8, act_qtype: uint8, "
                 "act_symmetric: false}\n"
                 "train: {epochs: 0, batch_size: 32}\n", ptq_dir, common, float_dir);
    CU_ASSERT_FATAL(n > 0 && (size_t)n < sizeof text);
    test_file_write(ptq_cfg, text, (size_t)n);
}

/* The tiny PTQ checkpoint and its C export, made once for the export tests: the paths (under tmp_root), the
 * export's integer test accuracy and MACs per example; false if a step failed. */
static bool export_fixture(char **float_cfg, char **ptq_cfg, char **float_ckpt, char **c_dir, double *int_acc,
                           double *macs) {
    static bool made, ok;
    static double acc, m;
    *float_cfg = test_path_join(tmp_root, "et-float.yaml");
    *ptq_cfg = test_path_join(tmp_root, "et-ptq.yaml");
    char *float_dir = test_path_join(tmp_root, "et-float"), *ptq_dir = test_path_join(tmp_root, "et-ptq");
    *float_ckpt = test_path_join(float_dir, "final.h5");
    *c_dir = test_path_join(tmp_root, "et-c");
    if (!made) {
        made = true;
        write_export_configs(*float_cfg, *ptq_cfg, float_dir, ptq_dir);
        char args[2048], *out = NULL;
        snprintf(args, sizeof args, "--config %s --quiet", *float_cfg);
        ok = run_qtrain("OPENBLAS_NUM_THREADS=1", args, &out) == 0;
        if (!ok) fprintf(stderr, "\n  float run: %s\n", out ? out : "(no output)");
        free(out), out = NULL;
        snprintf(args, sizeof args, "--config %s --quiet", *ptq_cfg);
        if (ok && run_qtrain("OPENBLAS_NUM_THREADS=1", args, &out) != 0) {
            fprintf(stderr, "\n  ptq run: %s\n", out ? out : "(no output)");
            ok = false;
        }
        free(out), out = NULL;
        snprintf(args, sizeof args, "export --format c --checkpoint %s/final.h5 --out %s --name tiny --quiet", ptq_dir,
                 *c_dir);
        if (ok && run_qtrain("OPENBLAS_NUM_THREADS=1", args, &out) != 0) {
            fprintf(stderr, "\n  export: %s\n", out ? out : "(no output)");
            ok = false;
        }
        acc = field(out, "export:c", "integer_test_accuracy");
        m = field(out, "export:c", "macs");
        ok = ok && isfinite(acc) && positive(m);
        free(out);
    }
    free(float_dir), free(ptq_dir);
    *int_acc = acc, *macs = m;
    CU_ASSERT(ok);
    return ok;
}

static void test_export_timing(void) {
    char *float_cfg, *ptq_cfg, *float_ckpt, *c_dir, cmd[4096], *out = NULL;
    double int_acc, macs;
    const char *cc = getenv("CC") && *getenv("CC") ? getenv("CC") : "cc";
    snprintf(cmd, sizeof cmd, "%s --version >/dev/null 2>&1", cc);
    if (system(cmd) != 0) {
        test_skip("no C compiler (%s) to build bench/export_timing.c with", cc);
        return;
    }
    if (export_fixture(&float_cfg, &ptq_cfg, &float_ckpt, &c_dir, &int_acc, &macs)) {
        char *bin = test_path_join(tmp_root, "export_timing"), *images = test_path_join(tmp_root, "t10k-images");
        char *labels = test_path_join(tmp_root, "t10k-labels");
        snprintf(cmd, sizeof cmd, "gunzip -c data/fashion-mnist-mini/t10k-images-idx3-ubyte.gz >%s && "
                 "gunzip -c data/fashion-mnist-mini/t10k-labels-idx1-ubyte.gz >%s", images, labels);
        CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
        snprintf(cmd, sizeof cmd, "%s -std=c99 -O2 -Wall -Wextra -Werror -DQRT_PORTABLE -I%s -DEXPORT_NAME=tiny "
                 "-DEXPORT_UPPER=TINY '-DEXPORT_HEADER=\"tiny.h\"' bench/export_timing.c %s/tiny.c %s/qtrain_rt.c "
                 "-o %s 2>&1", cc, c_dir, c_dir, c_dir, bin);
        int st = run_shell(cmd, &out);
        CU_ASSERT_EQUAL(st, 0);
        if (st != 0) fprintf(stderr, "\n  %s\n%s\n", cmd, out ? out : "(no output)");
        free(out), out = NULL;

        /* the whole mini test set (1000 images) once at least: its accuracy is the export's */
        snprintf(cmd, sizeof cmd, "%s %s %s --seconds 0 --warmup 0 --min-images 1000 2>&1", bin, images, labels);
        CU_ASSERT_EQUAL(run_shell(cmd, &out), 0);
        char simd[32];
        CU_ASSERT_STRING_EQUAL(text_field(out, "export:timing", "simd", simd, sizeof simd), "portable");
        CU_ASSERT(field(out, "export:timing", "images") >= 1000);
        CU_ASSERT_EQUAL(field(out, "export:timing", "accuracy_images"), 1000);
        CU_ASSERT_DOUBLE_EQUAL(field(out, "export:timing", "accuracy"), int_acc, 1e-9);
        CU_ASSERT_DOUBLE_EQUAL(field(out, "export:timing", "macs"), macs, 0.5);
        double per_s = field(out, "export:timing", "images_per_s"), mmac = field(out, "export:timing", "mmac_per_s");
        CU_ASSERT(positive(per_s) && positive(mmac));
        CU_ASSERT(fabs(mmac - per_s * macs * 1e-6) <= 0.01 * mmac + 0.1);
        if (!(field(out, "export:timing", "accuracy") == int_acc))
            fprintf(stderr, "\n  export integer_test_accuracy %g; harness:\n%s\n", int_acc, out ? out : "(none)");
        free(out), out = NULL;

        /* data that is not the model's: exit 1 and why; a bad option: exit 2 */
        snprintf(cmd, sizeof cmd, "%s %s %s 2>&1", bin, labels, labels);
        CU_ASSERT_EQUAL(run_shell(cmd, &out), 1);
        CU_ASSERT(out && strstr(out, "examples of 784 bytes"));
        free(out), out = NULL;
        snprintf(cmd, sizeof cmd, "%s %s %s 2>&1", bin, ptq_cfg, labels);
        CU_ASSERT_EQUAL(run_shell(cmd, &out), 1);
        CU_ASSERT(out && strstr(out, "not an IDX file of uint8"));
        free(out), out = NULL;
        snprintf(cmd, sizeof cmd, "%s %s %s --seconds soon 2>&1", bin, images, labels);
        CU_ASSERT_EQUAL(run_shell(cmd, &out), 2);
        CU_ASSERT(out && strstr(out, "--seconds needs seconds"));
        free(out), out = NULL;
        free(bin), free(images), free(labels);
    }
    free(float_cfg), free(ptq_cfg), free(float_ckpt), free(c_dir);
}

/* export_torch.py: the same model and weights quantized by PyTorch on one thread, timed at each batch size. */
static void test_export_torch(void) {
    char *float_cfg, *ptq_cfg, *float_ckpt, *c_dir, cmd[4096], *out = NULL;
    double int_acc, macs;
    if (run_shell(TORCH_PYTHON " -c 'import torch, yaml, numpy, h5py' 2>&1", &out) != 0) {
        test_skip(TORCH_PYTHON " cannot import torch, yaml, numpy and h5py (apt-get install python3-torch "
                  "python3-h5py)");
        free(out);
        return;
    }
    free(out), out = NULL;
    if (export_fixture(&float_cfg, &ptq_cfg, &float_ckpt, &c_dir, &int_acc, &macs)) {
        snprintf(cmd, sizeof cmd, TORCH_PYTHON " bench/export_torch.py --config %s --init-from %s --seconds 0.05 "
                 "--warmup 0 --batches 1,16 2>&1", ptq_cfg, float_ckpt);
        CU_ASSERT_EQUAL(run_shell(cmd, &out), 0);
        char engine[32];
        text_field(out, "export:torch", "engine", engine, sizeof engine);
        CU_ASSERT(strcmp(engine, "onednn") == 0 || strcmp(engine, "x86") == 0 || strcmp(engine, "fbgemm") == 0);
        CU_ASSERT_EQUAL(field(out, "export:torch", "threads"), 1);
        /* another quantizer (histogram observers) of the same float model: near qtrain's integer accuracy */
        double acc = field(out, "export:torch", "accuracy");
        CU_ASSERT(isfinite(acc) && fabs(acc - int_acc) < 0.05);
        CU_ASSERT(positive(field(out, "export:torch_eval batch:1", "images_per_s")));
        CU_ASSERT(positive(field(out, "export:torch_eval batch:16", "images_per_s")));
        if (!has_line(out, "export:torch_eval batch:16") || !(fabs(acc - int_acc) < 0.05))
            fprintf(stderr, "\n  qtrain integer accuracy %g; export_torch.py:\n%s\n", int_acc, out ? out : "(none)");
        free(out);
    }
    free(float_cfg), free(ptq_cfg), free(float_ckpt), free(c_dir);
}

/* torch_bench.py table: the QT row is qtrain's QT step over its float step, against 1.0 where the QT run took
 * VNNI (or AMX) int8 kernels and 1.3 where it took AVX2 ones, no target on the portable ones; the header names the
 * CPU and its ISA. Synthetic outputs: the table needs no torch. */
static void qt_table_case(const char *kernel, const char *qt_ms, const char *want_row) {
    char *q = test_path_join(tmp_root, "tq"), *t = test_path_join(tmp_root, "tt"), cmd[1024], *out = NULL;
    char *cnn = test_path_join(q, "cnn.txt"), *qt = test_path_join(q, "cnn-qt.txt"), text[256];
    CU_ASSERT_FATAL(mkdir(q, 0755) == 0 || errno == EEXIST);
    CU_ASSERT_FATAL(mkdir(t, 0755) == 0 || errno == EEXIST);
    test_file_write(cnn, "bench:train step_ms:10.000\n", strlen("bench:train step_ms:10.000\n"));
    int n = snprintf(text, sizeof text, "bench:config int8_kernel:%s\nbench:train step_ms:%s\n", kernel, qt_ms);
    test_file_write(qt, text, (size_t)n);
    snprintf(cmd, sizeof cmd, TORCH_BENCH " table --qtrain %s --torch %s --core X 2>&1", q, t);
    CU_ASSERT_EQUAL(run_shell(cmd, &out), 0);
    const char *row = out ? strstr(out, "| QT step / float step ") : NULL;
    const char *end = row ? strchr(row, '\n') : NULL;
    char line[256] = "";
    if (row) snprintf(line, sizeof line, "%.*s", (int)(end ? end - row : (long)strlen(row)), row);
    /* columns are padded: compare with the runs of spaces squeezed */
    char squeezed[256];
    size_t k = 0;
    for (size_t i = 0; line[i] && k + 1 < sizeof squeezed; i++)
        if (line[i] != ' ' || (k && squeezed[k - 1] != ' ')) squeezed[k++] = line[i];
    squeezed[k] = '\0';
    CU_ASSERT_STRING_EQUAL(squeezed, want_row);
    const char *head = out ? strstr(out, "qtrain vs PyTorch") : NULL;
    char hline[512] = "";
    if (head) snprintf(hline, sizeof hline, "%.*s", (int)strcspn(head, "\n"), head);
    const char *cpu = strstr(hline, " on both sides; "); /* then "<model name> (<isa> ...)" */
    CU_ASSERT(cpu && strchr(cpu, '(') && hline[strlen(hline) - 1] == ')');
    if (!row || strcmp(squeezed, want_row) != 0) fprintf(stderr, "\n%s\n", out ? out : "(no output)");
    free(out), free(cnn), free(qt), free(q), free(t);
}

static void test_torch_bench_qt_row(void) {
    if (access(TORCH_PYTHON, X_OK) != 0) {
        test_skip(TORCH_PYTHON " is missing");
        return;
    }
    qt_table_case("vnni", "9.100", "| QT step / float step | cnn | 0.91 | - | - | <= 1.0 (vnni int8 kernels) | yes |");
    qt_table_case("vnni", "12.000", "| QT step / float step | cnn | 1.20 | - | - | <= 1.0 (vnni int8 kernels) | NO |");
    qt_table_case("avx2", "12.000", "| QT step / float step | cnn | 1.20 | - | - | <= 1.3 (avx2 int8 kernels) | yes |");
    qt_table_case("avx2", "13.500", "| QT step / float step | cnn | 1.35 | - | - | <= 1.3 (avx2 int8 kernels) | NO |");
    qt_table_case("amx", "9.900", "| QT step / float step | cnn | 0.99 | - | - | <= 1.0 (amx int8 kernels) | yes |");
    qt_table_case("portable", "30.000", "| QT step / float step | cnn | 3.00 | - | - | none (portable int8 kernels) | |");
}

/* bench/run.sh --torch runs each group of its plan on qtrain and then at once on PyTorch (a ratio compares processes
 * seconds apart), PyTorch under the OpenBLAS family qtrain reported and qtrain with OPENBLAS_CORETYPE unset: both
 * sides stubbed by scripts that log what they were asked to run. */
static void test_run_sh_groups(void) {
    char *dir = test_path_join(tmp_root, "runsh"), *log = test_path_join(dir, "log");
    char *qstub = test_path_join(dir, "qtrain"), *pstub = test_path_join(dir, "python");
    CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0755), 0);
    static const char Q[] = "#!/bin/sh\n"
                            "cfg=$(basename \"$3\" .yaml)\n"
                            "echo \"qtrain $cfg ${OPENBLAS_CORETYPE-unset}\" >> \"$STUB_LOG\"\n"
                            "echo \"bench:blas core:Zen threads:2\"\n";
    static const char P[] = "#!/bin/sh\n"
                            "[ \"$2\" = run ] || exit 0\n"
                            "cfg=$(basename \"$4\" .yaml)\n"
                            "echo \"torch $cfg ${OPENBLAS_CORETYPE-unset}\" >> \"$STUB_LOG\"\n";
    test_file_write(qstub, Q, sizeof Q - 1), test_file_write(pstub, P, sizeof P - 1);
    CU_ASSERT_EQUAL_FATAL(chmod(qstub, 0755) | chmod(pstub, 0755), 0);
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "STUB_LOG=%s QTRAIN=%s PYTHON=%s BENCH_OUT=%s/out OPENBLAS_CORETYPE=Haswell "
             "BENCH_KEEP_CORETYPE=0 sh bench/run.sh --torch 2>&1", log, qstub, pstub, dir);
    CU_ASSERT_EQUAL(run_shell(cmd, &out), 0);
    free(out);
    size_t n = 0;
    char *text = test_file_read(log, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    /* blocks of one side: each PyTorch block is the qtrain block before it but the QT config, and each PyTorch
     * measurement at most 4 after its qtrain twin (the groups hold at most 4 configs) */
    char want[1024] = "", got[1024] = "", seen[32][64];
    int lines = 0, t_lines = 0, bad_env = 0, far = 0;
    bool last_torch = false;
    for (char *line = strtok(text, "\n"); line && lines < 32; line = strtok(NULL, "\n")) {
        char side[16], cfg[64], core[32];
        if (sscanf(line, "%15s %63s %31s", side, cfg, core) != 3) continue;
        const bool torch = !strcmp(side, "torch");
        if (!torch && last_torch) { /* a new group: the last one's blocks compared */
            CU_ASSERT_STRING_EQUAL(got, want);
            want[0] = got[0] = '\0';
        }
        last_torch = torch;
        const size_t len = strlen(cfg);
        const bool qt = len >= 3 && !strcmp(cfg + len - 3, "-qt");
        char *to = torch ? got : want;
        if (torch || !qt) snprintf(to + strlen(to), sizeof want - strlen(to), "%s ", cfg);
        if (torch) {
            int at = -1;
            for (int i = 0; i < lines; i++)
                if (!strcmp(seen[i], cfg)) at = i;
            far += at < 0 || lines - at > 4;
            seen[lines][0] = '\0';
        } else {
            snprintf(seen[lines], sizeof seen[lines], "%s", cfg);
        }
        bad_env += torch ? strcmp(core, "Zen") != 0 : strcmp(core, "unset") != 0;
        t_lines += torch;
        lines++;
    }
    CU_ASSERT_STRING_EQUAL(got, want);
    CU_ASSERT_EQUAL(far, 0);
    CU_ASSERT_EQUAL(bad_env, 0);
    CU_ASSERT_EQUAL(lines - t_lines, 13); /* every config in bench/configs */
    CU_ASSERT_EQUAL(t_lines, 12);         /* but cnn-qt */
    free(text), free(dir), free(log), free(qstub), free(pstub);
}

/* export_bench.sh replaces its run directories, so it refuses an output directory outside build/. */
static void test_export_bench_out_dir(void) {
    static const char *const bad[] = {"/tmp", "runs/bench", "build/../runs"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char cmd[256], *out = NULL;
        snprintf(cmd, sizeof cmd, "EXPORT_BENCH_OUT=%s sh bench/export_bench.sh 2>&1", bad[i]);
        CU_ASSERT_EQUAL(run_shell(cmd, &out), 2);
        CU_ASSERT(out && strstr(out, "EXPORT_BENCH_OUT") && strstr(out, bad[i]));
        free(out);
    }
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
           !CU_add_test(s, "bench: usage errors exit 2 with a message", test_bench_usage_errors) ||
           !CU_add_test(s, "bench: torch_bench.py on a DAG with batch norm: qtrain's model and function",
                        test_torch_bench_dag) ||
           !CU_add_test(s, "bench: export_timing.c builds as C99 against an export, times its accuracy",
                        test_export_timing) ||
           !CU_add_test(s, "bench: export_torch.py quantizes the same weights, one thread", test_export_torch) ||
           !CU_add_test(s, "bench: export_bench.sh writes under build/ only", test_export_bench_out_dir) ||
           !CU_add_test(s, "bench: torch_bench.py table's QT row (1.0 with VNNI, 1.3 with AVX2) and CPU header",
                        test_torch_bench_qt_row) ||
           !CU_add_test(s, "bench: run.sh --torch runs each group on qtrain, then at once on PyTorch", test_run_sh_groups);
}
