/* test_device_export.c - `qtrain export --format c` end to end.
 *
 * The tiny CNN, the residual batch-norm CNN and the depthwise CNN, trained
 * on the mini set and post-training quantized to int8 (BN folded), are
 * exported; the program compiles with the export's own Makefile (-std=c99
 * -Wall -Wextra -Werror), runs on the mini test set, and its int8 logits
 * equal `qtrain eval --integer`'s, example by example. The same with int4
 * weights, with the portable kernels (-DQRT_PORTABLE) and the AVX2 ones,
 * from a QAT checkpoint (converted on the way) and a LoRA run over an int8
 * base (merged on the way). Cross-compiled for aarch64 and armhf (NEON) and
 * run under qemu-user: identical again; compiled for a Cortex-M4, whose
 * sizes export.json reports. MLPerf Tiny's ResNet-8 and DS-CNN, a relu whose
 * input another layer also reads, module names that sanitise alike, and the
 * transpose/invert/classes transforms (applied on the device) export too;
 * the integer argmax agrees with `qtrain eval`'s on at least 90 % of the
 * examples, so the program computes the model and not only itself. Bad
 * input: a float checkpoint, a layer without a static input range, an nf4
 * layer, a float layer, a gelu, an existing directory, bad names: each a
 * clear error and no directory. Each cross tool that is not installed is a
 * visible skip. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_proc.h"
#include "test_runs.h"
#include "test_util.h"

static TestRuns runs;
static char images[1100], labels[1100];

static int suite_init(void) {
    if (test_runs_init(&runs) != 0) return -1;
    snprintf(images, sizeof images, "%s/t10k-images", runs.root);
    snprintf(labels, sizeof labels, "%s/t10k-labels", runs.root);
    char cmd[3000];
    snprintf(cmd, sizeof cmd, "zcat data/fashion-mnist-mini/t10k-images-idx3-ubyte.gz > '%s' && "
                              "zcat data/fashion-mnist-mini/t10k-labels-idx1-ubyte.gz > '%s'", images, labels);
    return system(cmd) == 0 ? 0 : -1;
}
static int suite_cleanup(void) { return test_runs_cleanup(&runs); }

static const char *path_in(const char *name) {
    static char buf[8][1100];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", runs.root, name);
    return buf[k];
}

static int qtrain(const char *log, const char *const *args) { return test_proc_run(path_in(log), args, 600); }

/* A shell command's exit status (its output appended to the suite's sh.log). */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(cmd, sizeof cmd - 64, fmt, ap);
    va_end(ap);
    snprintf(cmd + n, sizeof cmd - (size_t)n, " >> '%s/sh.log' 2>&1", runs.root);
    fflush(stdout);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static bool have(const char *tool) { return sh("command -v %s", tool) == 0; }

/* The float model of tests/configs/NAME.yaml trained into root/f-NAME (once). */
static const char *trained(const char *name) {
    static char done[8][64], ckpt[8][1100];
    for (int k = 0; k < 8; k++)
        if (strcmp(done[k], name) == 0) return ckpt[k];
    int k = 0;
    while (k < 7 && done[k][0]) k++;
    char cfg[256], out[1200];
    snprintf(cfg, sizeof cfg, "tests/configs/%s.yaml", name);
    snprintf(out, sizeof out, "run.out_dir=%s/f-%s", runs.root, name);
    const char *args[] = {"--config", cfg, "--set", out, "--quiet", NULL};
    if (qtrain("train.log", args) != 0) return NULL;
    snprintf(done[k], sizeof done[k], "%s", name);
    snprintf(ckpt[k], sizeof ckpt[k], "%s/f-%s/final.h5", runs.root, name);
    return ckpt[k];
}

/* A PTQ of tests/configs/NAME.yaml's model from `from` under `rules` (YAML list items); its final.h5 in
 * root/ID, or NULL. */
static const char *ptq(const char *name, const char *from, const char *id, const char *rules) {
    static char ckpt[4][1100];
    static int k;
    k = (k + 1) % 4;
    char src[1200];
    if (strchr(name, '/')) snprintf(src, sizeof src, "%s", name);
    else snprintf(src, sizeof src, "tests/configs/%s.yaml", name);
    char *text = test_file_read(src, NULL);
    if (!text) return NULL;
    char *train = strstr(text, "\ntrain:");
    if (train) train[1] = 0;
    char *yaml = malloc(strlen(text) + 2048);
    sprintf(yaml, "%squant:\n  mode: ptq\n  calibration_batches: 4\n  rules:\n%strain: {epochs: 0, batch_size: 16}\n",
            text, rules);
    free(text);
    const char *cfg = path_in("ptq.yaml");
    test_file_write(cfg, yaml, strlen(yaml));
    free(yaml);
    char out[1200], init[1200];
    snprintf(out, sizeof out, "run.out_dir=%s/%s", runs.root, id);
    snprintf(init, sizeof init, "model.init_from=%s", from);
    const char *args[] = {"--config", cfg, "--set", out, "--set", init, "--quiet", NULL};
    if (qtrain("ptq.log", args) != 0) return NULL;
    snprintf(ckpt[k], sizeof ckpt[k], "%s/%s/final.h5", runs.root, id);
    return ckpt[k];
}

static const char W8A8[] = "    - {module_path: \".*\", weight_qtype: int8, act_qtype: uint8, act_symmetric: false}\n";

/* `qtrain eval --integer`'s int8 logits of ckpt (malloc'd, *n bytes), or NULL. */
static int8_t *integer_logits(const char *ckpt, size_t *n) {
    const char *npy = path_in("integer.npy");
    unlink(npy);
    const char *args[] = {"eval", "--checkpoint", ckpt, "--integer", "--dump-logits", npy, "--quiet", NULL};
    if (qtrain("eval.log", args) != 0) return NULL;
    size_t len = 0;
    char *buf = test_file_read(npy, &len);
    if (!buf || len < 10 || memcmp(buf, "\x93NUMPY", 6) != 0 || !strstr(buf + 10, "'|i1'")) {
        free(buf);
        return NULL;
    }
    const size_t head = 10 + (size_t)(uint8_t)buf[8] + 256 * (size_t)(uint8_t)buf[9];
    *n = len - head;
    memmove(buf, buf + head, *n);
    return (int8_t *)buf;
}

/* export --format c of ckpt into root/dir (replacing a former one); 0 or qtrain's status. */
static int export_c(const char *ckpt, const char *dir, const char *name) {
    const char *args[] = {"export", "--format", "c", "--checkpoint", ckpt, "--out", path_in(dir), "--name", name,
                          "--force", "--quiet", NULL};
    return qtrain("export.log", args);
}

/* Builds root/dir's example with `make CC=cc CFLAGS=cflags` into exe, runs it (under runner, "" for none) on the
 * mini test set and compares its logits with want (n bytes). */
static bool run_matches(const char *dir, const char *name, const char *cc, const char *cflags, const char *runner,
                        const int8_t *want, size_t n) {
    const char *d = path_in(dir);
    if (sh("make -s -C '%s' clean && make -s -C '%s' CC='%s' CFLAGS='%s'", d, d, cc, cflags) != 0) {
        fprintf(stderr, "\n  %s: make CC=%s CFLAGS='%s' failed (see %s/sh.log)\n", d, cc, cflags, runs.root);
        return false;
    }
    const char *bin = path_in("logits.bin");
    unlink(bin);
    if (sh("%s '%s/%s_example' '%s' '%s' -o '%s'", runner, d, name, images, labels, bin) != 0) {
        fprintf(stderr, "\n  %s: the example failed under '%s'\n", d, runner);
        return false;
    }
    size_t got_n = 0;
    char *got = test_file_read(bin, &got_n);
    /* the program ran every image of the file; the eval, the config's (limited) test split: its first n */
    bool ok = got && got_n >= n && memcmp(got, want, n) == 0;
    if (got && got_n >= n && !ok)
        for (size_t k = 0; k < n; k++)
            if (got[k] != want[k]) {
                fprintf(stderr, "\n  %s (%s %s): logit %zu is %d, qtrain eval --integer %d\n", d, cc, cflags, k,
                        got[k], want[k]);
                break;
            }
    free(got);
    return ok;
}

/* The share of test examples whose largest integer logit (q, n bytes) is the largest of `qtrain eval`'s float
 * logits of ckpt: the integer program must compute the model, not merely agree with itself. -1 on failure. */
static double argmax_agreement(const char *ckpt, const int8_t *q, size_t n) {
    const char *npy = path_in("float.npy");
    unlink(npy);
    const char *args[] = {"eval", "--checkpoint", ckpt, "--dump-logits", npy, "--out", path_in("eval.json"),
                          "--quiet", NULL};
    if (qtrain("eval.log", args) != 0) return -1;
    size_t len = 0;
    char *buf = test_file_read(npy, &len);
    if (!buf || len < 10) {
        free(buf);
        return -1;
    }
    const size_t head = 10 + (size_t)(uint8_t)buf[8] + 256 * (size_t)(uint8_t)buf[9];
    const float *f = (const float *)(buf + head);
    const size_t nf = (len - head) / sizeof(float);
    if (nf != n || n == 0) {
        free(buf);
        return -1;
    }
    const char *shape = strstr(buf + 10, "'shape': (");
    long rows = shape ? strtol(shape + strlen("'shape': ("), NULL, 10) : 0;
    if (rows <= 0) {
        free(buf);
        return -1;
    }
    const size_t K = n / (size_t)rows;
    long same = 0;
    for (long r = 0; r < rows; r++) {
        size_t a = 0, b = 0;
        for (size_t k = 1; k < K; k++) {
            if (q[r * K + k] > q[r * K + a]) a = k;
            if (f[r * K + k] > f[r * K + b]) b = k;
        }
        same += a == b;
    }
    free(buf);
    return (double)same / (double)rows;
}

/* Export, build with the host compiler, and compare; the integer argmax must agree with qtrain eval's on at least
 * `agree` of the examples. */
static void check_model_agree(const char *ckpt, const char *dir, const char *name, double agree) {
    CU_ASSERT_PTR_NOT_NULL_FATAL(ckpt);
    size_t n = 0;
    int8_t *want = integer_logits(ckpt, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(want);
    const double a = argmax_agreement(ckpt, want, n);
    if (a < agree) fprintf(stderr, "\n  %s: integer argmax agrees with qtrain eval on %.4f of the examples\n", ckpt, a);
    CU_ASSERT(a >= agree);
    CU_ASSERT_EQUAL_FATAL(export_c(ckpt, dir, name), 0);
    CU_ASSERT(run_matches(dir, name, "cc", "-O2", "", want, n));
    free(want);
}

static void check_model(const char *ckpt, const char *dir, const char *name) { check_model_agree(ckpt, dir, name, 0.9); }

/* The export of `exported` (converted or merged on the way) against eval --integer of `reference`, the same
 * conversion done by hand. */
static void check_export_of(const char *exported, const char *reference, const char *dir, const char *name) {
    size_t n = 0;
    int8_t *want = integer_logits(reference, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(want);
    CU_ASSERT_EQUAL_FATAL(export_c(exported, dir, name), 0);
    CU_ASSERT(run_matches(dir, name, "cc", "-O2", "", want, n));
    free(want);
}

static void test_cnn_identical(void) {
    check_model(ptq("tiny-base", runs.base_ckpt, "p-cnn", W8A8), "x-cnn", "cnn");
    /* the files an export holds */
    const char *files[] = {"cnn.h", "cnn.c", "qtrain_rt.h", "qtrain_rt.c", "main_example.c", "Makefile",
                           "export.json"};
    for (size_t k = 0; k < sizeof files / sizeof *files; k++) CU_ASSERT(test_file_exists(path_in("x-cnn"), files[k]));
    char *json = test_file_read(path_in("x-cnn/export.json"), NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(json);
    CU_ASSERT_PTR_NOT_NULL(strstr(json, "\"arena_bytes\": "));
    CU_ASSERT_PTR_NOT_NULL(strstr(json, "\"macs\": "));
    CU_ASSERT_PTR_NOT_NULL(strstr(json, "\"integer_test_accuracy\": 0."));
    free(json);
    /* no malloc, no libm, no threads in the inference path */
    CU_ASSERT_EQUAL(sh("grep -E 'malloc|free\\(|#include <(math|pthread|stdlib)' '%s/cnn.c' '%s/qtrain_rt.c'",
                       path_in("x-cnn"), path_in("x-cnn")), 1);
}

/* export.json's arena_bytes of root/dir, or -1. */
static long json_arena(const char *dir) {
    char path[1200];
    snprintf(path, sizeof path, "%s/export.json", path_in(dir));
    char *json = test_file_read(path, NULL);
    const char *at = json ? strstr(json, "\"arena_bytes\": ") : NULL;
    long v = at ? atol(at + strlen("\"arena_bytes\": ")) : -1;
    free(json);
    return v;
}

static void test_resnet_identical(void) {
    const char *ckpt = ptq("tiny-res", trained("tiny-res"), "p-res",
                           "    - {module_path: stem, weight_qtype: int8, act_qtype: int8}\n"
                           "    - {module_path: \".*\", weight_qtype: int8, act_qtype: uint8, act_symmetric: false}\n");
    check_model(ckpt, "x-res", "res");
    /* --low-ram: the convs' direct loop, no scratch: a smaller arena, the same logits */
    size_t n = 0;
    int8_t *want = integer_logits(ckpt, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(want);
    const char *args[] = {"export", "--format", "c", "--checkpoint", ckpt, "--out", path_in("x-res-low"), "--name",
                          "res", "--low-ram", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("export.log", args), 0);
    CU_ASSERT(run_matches("x-res-low", "res", "cc", "-O2 -march=native", "", want, n));
    const long small = json_arena("x-res-low"), big = json_arena("x-res");
    if (!(small > 0 && small < big)) fprintf(stderr, "\n  arena: --low-ram %ld bytes, default %ld\n", small, big);
    CU_ASSERT(small > 0 && small < big);
    free(want);
}

static void test_dscnn_identical(void) { check_model(ptq("tiny-dw", trained("tiny-dw"), "p-dw", W8A8), "x-dw", "dw"); }

/* MLPerf Tiny's ResNet-8 and DS-CNN (bench/configs), a few steps on the mini set, then their static int8 PTQ
 * (bench/configs/MODEL-ptq-int8.yaml: int8 conv1 input, uint8 elsewhere, batch norms folded). */
static void check_mlperf(const char *model) {
    char cfg[256], out[1200], init[1200], dir[64];
    snprintf(cfg, sizeof cfg, "bench/configs/%s.yaml", model);
    snprintf(out, sizeof out, "run.out_dir=%s/f-%s", runs.root, model);
    const char *targs[] = {"--config", cfg, "--set", out, "--set", "data.dir=data/fashion-mnist-mini", "--set",
                           "data.cache_dir=none", "--set", "train.epochs=1", "--set", "run.threads=2", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("mlperf.log", targs), 0);
    snprintf(cfg, sizeof cfg, "bench/configs/%s-ptq-int8.yaml", model);
    snprintf(out, sizeof out, "run.out_dir=%s/p-%s", runs.root, model);
    snprintf(init, sizeof init, "model.init_from=%s/f-%s/final.h5", runs.root, model);
    const char *pargs[] = {"--config", cfg, "--set", out, "--set", init, "--set", "data.dir=data/fashion-mnist-mini",
                           "--set", "data.cache_dir=none", "--set", "quant.calibration_batches=2", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("mlperf.log", pargs), 0);
    char ckpt[1200];
    snprintf(ckpt, sizeof ckpt, "%s/p-%s/final.h5", runs.root, model);
    snprintf(dir, sizeof dir, "x-%s", model);
    check_model(ckpt, dir, model);
}

static void test_resnet8_identical(void) { check_mlperf("resnet8"); }
static void test_dscnn_mlperf_identical(void) { check_mlperf("dscnn"); }

/* A float model of tiny-base.yaml's data and training with these layers (and data.transform items), trained into
 * root/f-ID; its config path in *cfg_out (static until the next call). */
static const char *custom(const char *id, const char *layers, const char *transforms, const char **cfg_out) {
    static char cfg[1100], ckpt[1100];
    char yaml[8192], out[1200];
    snprintf(yaml, sizeof yaml,
             "run: {name: %s, out_dir: runs/x, seed: 5}\n"
             "data:\n  dir: data/fashion-mnist-mini\n  cache_dir: none\n  transform:\n    - {limit: 512}\n%s"
             "model:\n  input: [1, 28, 28]\n  layers:\n%s"
             "train:\n  steps: 40\n  batch_size: 32\n  optimizer: {name: adamw, lr: 0.003}\n", id, transforms, layers);
    snprintf(cfg, sizeof cfg, "%s/%s.yaml", runs.root, id);
    test_file_write(cfg, yaml, strlen(yaml));
    snprintf(out, sizeof out, "run.out_dir=%s/f-%s", runs.root, id);
    const char *args[] = {"--config", cfg, "--set", out, "--quiet", NULL};
    *cfg_out = cfg;
    if (qtrain("custom.log", args) != 0) return NULL;
    snprintf(ckpt, sizeof ckpt, "%s/f-%s/final.h5", runs.root, id);
    return ckpt;
}

/* A relu whose class reaches a value something else reads: the other reader must see that value unclamped
 * (through a dropout before the relu, and through a max pool before it). */
static void test_relu_shared_values(void) {
    const char *cfg;
    const char *f = custom("relu-dropout",
                           "    - {name: c1, type: conv2d, out_channels: 6, kernel: 3, padding: 1}\n"
                           "    - {name: d, type: dropout, p: 0.1}\n"
                           "    - {name: r, type: relu}\n"
                           "    - {name: c2, type: conv2d, out_channels: 6, kernel: 3, padding: 1}\n"
                           "    - {name: s, type: add, inputs: [c2, c1]}\n"
                           "    - {type: globalavgpool}\n"
                           "    - {name: head, type: dense, units: 10}\n", "", &cfg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    check_model_agree(ptq(cfg, f, "p-relu-dropout", W8A8), "x-relu-dropout", "rd", 0.9);
    f = custom("relu-pool",
               "    - {name: c1, type: conv2d, out_channels: 6, kernel: 3, padding: 1}\n"
               "    - {name: p, type: maxpool2d, kernel: 2}\n"
               "    - {name: r, type: relu}\n"
               "    - {name: g1, type: globalavgpool}\n"
               "    - {name: g2, type: globalavgpool, inputs: [c1]}\n"
               "    - {name: cat, type: concat, inputs: [g1, g2]}\n"
               "    - {name: head, type: dense, units: 10}\n", "", &cfg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    check_model_agree(ptq(cfg, f, "p-relu-pool", W8A8), "x-relu-pool", "rp", 0.9);
}

/* Module names that sanitise alike, a module named like the program's own functions, a scale that is a whole
 * number: the C still compiles (and matches). */
static void test_awkward_names(void) {
    const char *cfg;
    const char *f = custom("names",
                           "    - {name: a-b, type: conv2d, out_channels: 4, kernel: 3, padding: 1}\n"
                           "    - {name: a_b, type: relu}\n"
                           "    - {name: arena, type: maxpool2d, kernel: 2}\n"
                           "    - {name: predict, type: flatten}\n"
                           "    - {name: run, type: dense, units: 10}\n",
                           "    - {normalize: {mean: 0.0, std: 0.00392156862745098}}\n", &cfg);
    if (!f) {
        test_skip("module names a-b and a_b: the config does not take them (names are [A-Za-z0-9_])");
        return;
    }
    check_model_agree(ptq(cfg, f, "p-names", W8A8), "x-names", "m", 0.9);
}

/* data.transform transposes and keeps three classes: the device sees the stored images and labels; predict
 * transposes, and main_example maps the labels (and skips the other classes). */
static void test_transforms(void) {
    const char *cfg;
    const char *f = custom("transforms",
                           "    - {name: c1, type: conv2d, out_channels: 4, kernel: 3, padding: 1}\n"
                           "    - {type: relu}\n"
                           "    - {type: maxpool2d, kernel: 2}\n"
                           "    - {type: flatten}\n"
                           "    - {name: head, type: dense, units: 3}\n",
                           "    - transpose\n    - invert\n    - {classes: [7, 1, 3]}\n", &cfg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    check_model_agree(ptq(cfg, f, "p-transforms", W8A8), "x-transforms", "tr", 0.9);
    char *src = test_file_read(path_in("x-transforms/tr.c"), NULL);
    CU_ASSERT_PTR_NOT_NULL(src && strstr(src, "\"Sneaker\", \"Trouser\", \"Dress\""));
    free(src);
}

/* int4 weights, packed two per byte; the portable and the AVX2 kernels give the same bits. */
static void test_int4_portable_simd(void) {
    const char *ckpt = ptq("tiny-base", runs.base_ckpt, "p-int4",
                           "    - {module_path: \".*\", weight_qtype: int4, act_qtype: uint8, act_symmetric: false}\n");
    CU_ASSERT_PTR_NOT_NULL_FATAL(ckpt);
    size_t n = 0;
    int8_t *want = integer_logits(ckpt, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(want);
    CU_ASSERT_EQUAL_FATAL(export_c(ckpt, "x-int4", "q4"), 0);
    char *json = test_file_read(path_in("x-int4/export.json"), NULL);
    CU_ASSERT_PTR_NOT_NULL(json && strstr(json, "\"weight_bytes\": "));
    free(json);
    CU_ASSERT(run_matches("x-int4", "q4", "cc", "-O2 -DQRT_PORTABLE", "", want, n));
    CU_ASSERT(run_matches("x-int4", "q4", "cc", "-O2", "", want, n));
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        CU_ASSERT(run_matches("x-int4", "q4", "cc", "-O2 -mavx2", "", want, n));
    } else {
        test_skip("the AVX2 build: this CPU has no AVX2");
    }
    free(want);
}

/* A QAT checkpoint is converted on the way: the export equals eval --integer of `qtrain convert`'s output. */
static void test_qat_converted(void) {
    char out[1200], init[1200];
    snprintf(out, sizeof out, "run.out_dir=%s/qat", runs.root);
    snprintf(init, sizeof init, "model.init_from=%s", runs.base_ckpt);
    const char *args[] = {"--config", "tests/configs/tiny-qat.yaml", "--set", out, "--set", init, "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("qat.log", args), 0);
    const char *qat = path_in("qat/final.h5"), *conv = path_in("qat-converted.h5");
    const char *cargs[] = {"convert", "--checkpoint", qat, "--out", conv, "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("convert.log", cargs), 0);
    check_export_of(qat, conv, "x-qat", "qat");
}

/* A LoRA run over an int8 base is merged (and re-quantized) on the way: as eval --integer of `qtrain merge`. */
static void test_lora_merged(void) {
    const char *base = ptq("tiny-base", runs.base_ckpt, "p-lora-base", W8A8);
    CU_ASSERT_PTR_NOT_NULL_FATAL(base);
    char *text = test_file_read("tests/configs/tiny-base.yaml", NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    char *train = strstr(text, "\ntrain:");
    if (train) train[1] = 0;
    char yaml[8192];
    snprintf(yaml, sizeof yaml, "%squant:\n  mode: ptq\n  calibration_batches: 4\n  rules:\n%s"
             "lora:\n  rules:\n    - {module_path: \".*\", rank: 2, alpha: 4}\n"
             "train: {steps: 6, batch_size: 16, optimizer: {name: adamw, lr: 0.01}}\n", text, W8A8);
    free(text);
    test_file_write(path_in("lora.yaml"), yaml, strlen(yaml));
    char out[1200], init[1200];
    snprintf(out, sizeof out, "run.out_dir=%s/lora", runs.root);
    snprintf(init, sizeof init, "model.init_from=%s", runs.base_ckpt);
    const char *args[] = {"--config", path_in("lora.yaml"), "--set", out, "--set", init, "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("lora.log", args), 0);
    const char *run = path_in("lora/final.h5"), *merged = path_in("lora-merged.h5");
    /* eval --integer leaves nothing out silently: the adapters must be folded in first */
    const char *iargs[] = {"eval", "--checkpoint", run, "--integer", "--quiet", NULL};
    CU_ASSERT_EQUAL(qtrain("lora-eval.log", iargs), 2);
    const char *margs[] = {"merge", "--checkpoint", run, "--out", merged, "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("merge.log", margs), 0);
    check_export_of(run, merged, "x-lora", "lora");
}

/* The residual model cross-compiled for aarch64 and armhf, NEON included, run under qemu-user. */
static void test_arm_qemu(void) {
    const char *ckpt = ptq("tiny-res", trained("tiny-res"), "p-arm", W8A8);
    CU_ASSERT_PTR_NOT_NULL_FATAL(ckpt);
    size_t n = 0;
    int8_t *want = integer_logits(ckpt, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(want);
    CU_ASSERT_EQUAL_FATAL(export_c(ckpt, "x-arm", "arm"), 0);
    if (have("aarch64-linux-gnu-gcc") && have("qemu-aarch64")) {
        CU_ASSERT(run_matches("x-arm", "arm", "aarch64-linux-gnu-gcc", "-O2 -static", "qemu-aarch64", want, n));
        CU_ASSERT(run_matches("x-arm", "arm", "aarch64-linux-gnu-gcc", "-O2 -static -DQRT_PORTABLE", "qemu-aarch64",
                              want, n));
    } else {
        test_skip("aarch64 under qemu: aarch64-linux-gnu-gcc or qemu-aarch64 is not installed (make test-deps "
                  "installs gcc-aarch64-linux-gnu and qemu-user)");
    }
    if (have("arm-linux-gnueabihf-gcc") && have("qemu-arm")) {
        CU_ASSERT(run_matches("x-arm", "arm", "arm-linux-gnueabihf-gcc", "-O2 -static -mfpu=neon", "qemu-arm", want,
                              n));
    } else {
        test_skip("armhf under qemu: arm-linux-gnueabihf-gcc or qemu-arm is not installed (make test-deps installs "
                  "gcc-arm-linux-gnueabihf and qemu-user)");
    }
    char *json = test_file_read(path_in("x-arm/export.json"), NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(json);
    if (have("arm-none-eabi-gcc")) {
        const char *m4 = strstr(json, "\"cortex_m4\": {\"text\": ");
        CU_ASSERT_PTR_NOT_NULL(m4);
        if (m4) CU_ASSERT(atol(m4 + strlen("\"cortex_m4\": {\"text\": ")) > 0);
    } else {
        CU_ASSERT_PTR_NOT_NULL(strstr(json, "\"cortex_m4\": null"));
        test_skip("Cortex-M4 sizes: arm-none-eabi-gcc is not installed (make test-deps installs gcc-arm-none-eabi)");
    }
    free(json);
    free(want);
}

/* --out with a space and a quote: the files land there, and the Cortex-M4 build still measures. */
static void test_awkward_path(void) {
    const char *ckpt = ptq("tiny-base", runs.base_ckpt, "p-path", W8A8);
    CU_ASSERT_PTR_NOT_NULL_FATAL(ckpt);
    char out[1200];
    snprintf(out, sizeof out, "%s/it's a dir", runs.root);
    const char *args[] = {"export", "--format", "c", "--checkpoint", ckpt, "--out", out, "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("path.log", args), 0);
    CU_ASSERT(test_file_exists(out, "model.c"));
    char json_path[1300];
    snprintf(json_path, sizeof json_path, "%s/export.json", out);
    char *json = test_file_read(json_path, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(json);
    if (have("arm-none-eabi-gcc")) CU_ASSERT_PTR_NOT_NULL(strstr(json, "\"cortex_m4\": {\"text\": "));
    free(json);
}

/* An export that fails: status 1, the message names what, and nothing is left at out (nor beside it). */
static void expect_refused(const char *ckpt, const char *out, const char *what) {
    const char *log = path_in("refused.log");
    unlink(log);
    const char *args[] = {"export", "--format", "c", "--checkpoint", ckpt, "--out", out, NULL};
    CU_ASSERT_NOT_EQUAL(test_proc_run(log, args, 300), 0);
    char *text = test_file_read(log, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    if (!strstr(text, what)) fprintf(stderr, "\n  expected '%s' in: %s\n", what, text);
    CU_ASSERT_PTR_NOT_NULL(strstr(text, what));
    free(text);
    struct stat s;
    CU_ASSERT_NOT_EQUAL(stat(out, &s), 0);
    CU_ASSERT_EQUAL(sh("ls -a '%s' | grep -q qtrain-export", runs.root), 1);
}

static void test_bad_inputs(void) {
    char out[1100];
    snprintf(out, sizeof out, "%s", path_in("x-bad"));
    /* a float model */
    expect_refused(runs.base_ckpt, out, "float checkpoint");
    /* weight-only PTQ: the inputs have no static range */
    const char *wonly = ptq("tiny-base", runs.base_ckpt, "p-wonly", "    - {module_path: \".*\", weight_qtype: int8}\n");
    CU_ASSERT_PTR_NOT_NULL_FATAL(wonly);
    expect_refused(wonly, out, "conv1: the input has no static range");
    /* a format other than int8/int4 */
    const char *nf4 = ptq("tiny-base", runs.base_ckpt, "p-nf4",
                          "    - {module_path: fc1, weight_qtype: nf4, tile_size: 32, act_qtype: uint8, "
                          "act_symmetric: false}\n"
                          "    - {module_path: \".*\", weight_qtype: int8, act_qtype: uint8, act_symmetric: false}\n");
    CU_ASSERT_PTR_NOT_NULL_FATAL(nf4);
    expect_refused(nf4, out, "fc1: weight format nf4");
    /* one layer left float */
    const char *part = ptq("tiny-base", runs.base_ckpt, "p-part",
                           "    - {module_path: \"conv1|head\", weight_qtype: int8, act_qtype: uint8, "
                           "act_symmetric: false}\n");
    CU_ASSERT_PTR_NOT_NULL_FATAL(part);
    expect_refused(part, out, "fc1: a float dense layer");
    /* a layer with no integer form */
    const char *cfg;
    const char *g = custom("gelu",
                           "    - {name: c1, type: conv2d, out_channels: 4, kernel: 3, padding: 1}\n"
                           "    - {name: act, type: gelu}\n"
                           "    - {type: flatten}\n"
                           "    - {name: head, type: dense, units: 10}\n", "", &cfg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(g);
    const char *gp = ptq(cfg, g, "p-gelu", W8A8);
    CU_ASSERT_PTR_NOT_NULL_FATAL(gp);
    expect_refused(gp, out, "act: a gelu layer has no integer form");
    /* an existing directory, without and with --force when it is not an export */
    char keep[1100];
    snprintf(keep, sizeof keep, "%s", path_in("keep"));
    CU_ASSERT_EQUAL_FATAL(mkdir(keep, 0700), 0);
    test_file_write(path_in("keep/mine.txt"), "x", 1);
    const char *ptq8 = ptq("tiny-base", runs.base_ckpt, "p-keep", W8A8);
    CU_ASSERT_PTR_NOT_NULL_FATAL(ptq8);
    const char *a1[] = {"export", "--format", "c", "--checkpoint", ptq8, "--out", keep, NULL};
    CU_ASSERT_EQUAL(qtrain("keep.log", a1), 2);
    const char *a2[] = {"export", "--format", "c", "--checkpoint", ptq8, "--out", keep, "--force", NULL};
    CU_ASSERT_EQUAL(qtrain("keep.log", a2), 2);
    CU_ASSERT(test_file_exists(keep, "mine.txt"));
    /* a name that is no C identifier */
    const char *a3[] = {"export", "--format", "c", "--checkpoint", ptq8, "--out", out, "--name", "9lives", NULL};
    CU_ASSERT_EQUAL(qtrain("name.log", a3), 2);
    const char *a4[] = {"export", "--format", "c", "--checkpoint", ptq8, "--out", out, "--name", "qrt_model", NULL};
    CU_ASSERT_EQUAL(qtrain("name.log", a4), 2);
    /* eval --integer writes no eval.json: --out is refused rather than ignored */
    const char *a5[] = {"eval", "--integer", "--checkpoint", ptq8, "--out", path_in("e.json"), NULL};
    CU_ASSERT_EQUAL(qtrain("name.log", a5), 2);
    struct stat s;
    CU_ASSERT_NOT_EQUAL(stat(out, &s), 0);
}

int register_device_export_suite(void) {
    CU_pSuite s = CU_add_suite("device_export", suite_init, suite_cleanup);
    if (!s) return -1;
    if (!CU_add_test(s, "cnn: exported program = eval --integer", test_cnn_identical) ||
        !CU_add_test(s, "residual BN CNN: identical logits", test_resnet_identical) ||
        !CU_add_test(s, "depthwise CNN: identical logits", test_dscnn_identical) ||
        !CU_add_test(s, "MLPerf Tiny ResNet-8: identical logits", test_resnet8_identical) ||
        !CU_add_test(s, "MLPerf Tiny DS-CNN: identical logits", test_dscnn_mlperf_identical) ||
        !CU_add_test(s, "int4 weights; portable = AVX2 = eval", test_int4_portable_simd) ||
        !CU_add_test(s, "QAT checkpoint converted on the way", test_qat_converted) ||
        !CU_add_test(s, "LoRA over int8 merged on the way", test_lora_merged) ||
        !CU_add_test(s, "aarch64 and armhf under qemu; Cortex-M4 sizes", test_arm_qemu) ||
        !CU_add_test(s, "an --out path with a space and a quote", test_awkward_path) ||
        !CU_add_test(s, "a relu never clamps values another layer reads", test_relu_shared_values) ||
        !CU_add_test(s, "module names that collide as C identifiers", test_awkward_names) ||
        !CU_add_test(s, "transpose and classes transforms on the device", test_transforms) ||
        !CU_add_test(s, "bad input: clear errors, no directory", test_bad_inputs))
        return -1;
    return 0;
}
