/* main.c - the qtrain command line. Only this layer decides to exit:
 * 0 success, 1 runtime failure, 2 usage or config error. */
#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <hdf5.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <unistd.h>

#include "nn/conv_taps.h"
#include "nn/conv_wino.h"
#include "nn/gemm.h"
#include "quant/qlayer.h"
#include "cli/autoquant.h"
#include "cli/bench.h"
#include "trainer/dist.h"
#ifdef QTRAIN_MPI
#include "mpi/dist_mpi.h"
#endif
#include "trainer/checkpoint.h"
#include "cli/compare.h"
#include "trainer/config.h"
#include "cli/demo.h"
#include "trainer/interrupt.h"
#include "trainer/eval_int.h"
#include "trainer/export_c.h"
#include "trainer/interop.h"
#include "trainer/tools.h"
#include "trainer/train.h"
#include "trainer/version.h"

#define MAX_OVERRIDES 64

/* Each command's synopsis and description: `qtrain CMD --help` prints its own, `qtrain --help` all. */
typedef struct {
    const char *name, *synopsis, *help;
} CmdHelp;

static const CmdHelp CMD_HELP[] = {
    {"train",
     "qtrain [train] --config FILE [--resume PATH|auto] [--set KEY=VALUE]... [--stop-at-step N] [--quiet]",
     "  (train)   train per the YAML config; writes metrics.csv, summary.json and\n"
     "            checkpoints (ckpt-<step>.h5, last.h5, final.h5) into run.out_dir.\n"
     "            --resume PATH continues from a checkpoint bit for bit; --resume auto\n"
     "            takes the newest checkpoint in run.out_dir (or starts fresh if none).\n"
     "            --set train.optimizer.lr=3e-4 overrides one key (repeatable).\n"
     "            --stop-at-step N stops after step N with a checkpoint, to be resumed.\n"
     "            mpirun -np N build/qtrain-mpi --config FILE trains on N ranks (make\n"
     "            MPI=1; docs/DISTRIBUTED.md).\n"},
    {"eval", "qtrain eval [--config FILE] --checkpoint PATH [--out PATH] [--dump-logits FILE.npy] [--integer] "
             "[--set KEY=VALUE]... [--quiet]",
     "  eval      evaluate a checkpoint on the test split (and validation split, if\n"
     "            any); writes eval.json beside the checkpoint, or to --out PATH (a\n"
     "            file, or an existing directory to hold eval.json); an autoencoder\n"
     "            (data.target: input) also writes scores.csv there. Without --config\n"
     "            the config stored in the checkpoint is used (its data.cache_dir only\n"
     "            if it is none; else the default cache). --dump-logits FILE.npy writes\n"
     "            the test split's model outputs, (N, values) float32, for other tools.\n"
     "            --integer runs the integer program export --format c writes (same\n"
     "            runtime, same logits); --dump-logits then writes its int8 codes.\n"},
    {"quantize", "qtrain quantize --config FILE --checkpoint PATH --out PATH [--force] [--set KEY=VALUE]...",
     "  quantize  post-training-quantize a float checkpoint by the config's quant rules\n"
     "            (weight-only, no data needed) into a PTQ checkpoint for model.init_from.\n"},
    {"merge", "qtrain merge --checkpoint PATH --out PATH [--dequantize] [--force]",
     "  merge     fold a run's LoRA adapters into its base (a quantized base is\n"
     "            dequantized, added to and re-quantized) and report the merge error\n"
     "            and the test accuracy and loss before and after. --dequantize\n"
     "            writes a float model instead (no re-quantization error).\n"},
    {"convert", "qtrain convert --checkpoint PATH --out PATH [--force]",
     "  convert   turn a QAT checkpoint into a PTQ one (real quantized weights with\n"
     "            the learned ranges) that evaluates exactly as it trained.\n"},
    {"export", "qtrain export --checkpoint PATH --format safetensors|peft|h5|c --out PATH [--merge] [--name NAME] "
               "[--low-ram] [--force]",
     "  export    a checkpoint's model for other tools: safetensors, a PyTorch\n"
     "            state_dict (<module>.weight, .bias, batch-norm buffers) in float32,\n"
     "            quantized weights dequantized as qtrain computes them; peft, a LoRA\n"
     "            run's adapters as a PEFT adapter directory with its base beside\n"
     "            them; h5, a float qtrain checkpoint. --merge folds LoRA adapters in\n"
     "            first (else they are left out). c: int8 C99 for a device (NAME.h/.c,\n"
     "            the runtime, main_example.c, Makefile, export.json) in the new\n"
     "            directory PATH, from a PTQ checkpoint with static int8 input ranges\n"
     "            (QAT converted, LoRA merged on the way); --name sets the C prefix,\n"
     "            --low-ram runs the convs without scratch (a smaller arena, slower).\n"},
    {"compare", "qtrain compare RUN_DIR... [--out DIR]",
     "  compare   runs side by side from their summary.json and metrics.csv: a\n"
     "            table (formats, bits/param, size, accuracy, delta vs the first\n"
     "            float run, speed), and DIR/compare.md and DIR/compare.svg\n"
     "            (accuracy vs bits/param, training-loss curves); DIR defaults\n"
     "            to runs/compare and is created with its parents; compare.md and\n"
     "            compare.svg replace regular files of those names there.\n"},
    {"sensitivity", "qtrain sensitivity --config FILE --checkpoint PATH [--formats LIST] [--split val|test] [--out DIR] "
                    "[--force] [--set KEY=VALUE]... [--quiet]",
     "  sensitivity\n"
     "            each dense/conv2d module of a float checkpoint quantized alone\n"
     "            (weight-only PTQ, batch norms folded) in each of --formats (default\n"
     "            int8,int4,nf4,int2; NAME/ch per channel, NAME/N blocks): the loss and\n"
     "            accuracy change on the validation split (without one, the training\n"
     "            set's last 10%; --split test: the test split) and the bits per\n"
     "            weight; a table, DIR/sensitivity.csv and DIR/sensitivity.svg (DIR\n"
     "            defaults to sensitivity/ beside the checkpoint; --force replaces them).\n"},
    {"autoquant", "qtrain autoquant --config FILE --checkpoint PATH --budget BITS [--formats LIST] [--sensitivity CSV] "
                  "[--split val|test] [--out DIR] [--force] [--set KEY=VALUE]... [--quiet]",
     "  autoquant a format per module (or float32) with the least predicted loss change\n"
     "            under BITS per weight (an exact knapsack over the sensitivity table,\n"
     "            measured here or read from --sensitivity CSV); writes DIR/autoquant.yaml,\n"
     "            a PTQ config qtrain --config runs (DIR defaults to autoquant-BITS/ beside\n"
     "            the checkpoint), and prints its test accuracy and loss beside uniform\n"
     "            int4 and nf4 per channel.\n"},
    {"inspect", "qtrain inspect PATH",
     "  inspect   list a checkpoint's groups, datasets (shape, dtype), attributes and\n"
     "            total bytes.\n"},
    {"demo", "qtrain demo [--steps N] [--batch-size B] [--seed S] [--threads T] [--quiet]",
     "  demo      train a small MLP on synthetic spirals: an engine check without data.\n"},
    {"bench",
     "qtrain bench --config FILE [--steps N] [--warmup N] [--eval-batches N] [--since-ns NS]\n"
     "                    [--set KEY=VALUE]...",
     "  bench     time the config's run, set up as training sets it up but writing nothing:\n"
     "            --warmup (10) untimed and --steps (100) timed training steps, batch\n"
     "            loading included, a GEMM-accounting pass, --eval-batches (40)\n"
     "            forward-only test batches, then a 1024 sgemm (training runs); prints\n"
     "            bench: lines (samples/s, step ms, GEMM share, the step's multiply-adds\n"
     "            and its GEMM-bound limit, peak RSS, start-up). --since-ns NS: the caller's\n"
     "            CLOCK_REALTIME nanoseconds at process start, e.g. $(date +%s%N).\n"},
    {"config", "qtrain config --doc",
     "  config    --doc prints the config reference (every key: default, values, what a\n"
     "            resume does with it, meaning) as Markdown, as in docs/CONFIG.md.\n"},
};
#define N_CMDS ((int)(sizeof CMD_HELP / sizeof CMD_HELP[0]))

static const char EXIT_HELP[] = "Exit status: 0 success, 1 runtime failure, 2 usage or config error.\n";

static void usage(FILE *out) {
    for (int i = 0; i < N_CMDS; i++) fprintf(out, "%s %s\n", i ? "      " : "usage:", CMD_HELP[i].synopsis);
    fprintf(out, "       qtrain --help | --version | CMD --help\n\n");
    for (int i = 0; i < N_CMDS; i++) fputs(CMD_HELP[i].help, out);
    fprintf(out, "\n%s", EXIT_HELP);
}

/* `qtrain cmd --help`: that command's usage only, on stdout, exit 0. */
static void cmd_help_exit(const char *cmd) {
    for (int i = 0; i < N_CMDS; i++) {
        if (strcmp(CMD_HELP[i].name, cmd) != 0) continue;
        printf("usage: %s\n\n%s\n%s", CMD_HELP[i].synopsis, CMD_HELP[i].help, EXIT_HELP);
        exit(0);
    }
    usage(stdout);
    exit(0);
}

static bool is_help(const char *arg) { return strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0; }

typedef struct {
    const char *config, *resume, *checkpoint, *out;
    const char *dump_logits; /* eval: the test outputs as a .npy file */
    long long stop_at_step;
    const char *overrides[MAX_OVERRIDES];
    int n_overrides;
    bool quiet;
    bool force; /* --out may replace a regular file */
    bool dequantize; /* merge: write a float model */
    const char *format; /* export */
    bool merge;         /* export: fold adapters in */
    bool integer;       /* eval: the integer program (what export --format c ships) */
    const char *name;   /* export --format c: the C identifier prefix */
    bool low_ram;       /* export --format c: convs without scratch */
} CliArgs;

/* Parses a positive integer option value; exits 2 on garbage. */
static long parse_positive(const char *opt, const char *value) {
    char *end = NULL;
    long v = value ? strtol(value, &end, 10) : 0;
    if (!value || *end || v < 1) {
        fprintf(stderr, "qtrain: %s needs a positive integer, got '%s'\n", opt, value ? value : "(nothing)");
        exit(2);
    }
    return v;
}

/* Parses the options shared by training and eval; exits 2 on a bad one. */
static void parse_args(int argc, char **argv, const char *cmd, bool eval, CliArgs *a) {
    memset(a, 0, sizeof *a);
    const char *name = cmd[0] ? cmd + 1 : "train";
    for (int i = 0; i < argc; i++) /* --help anywhere wins, even after an option missing its value */
        if (is_help(argv[i]) && (i == 0 || strcmp(argv[i - 1], "--set") != 0)) cmd_help_exit(name);
    for (int i = 0; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool takes_value = strcmp(o, "--config") == 0 || strcmp(o, "--set") == 0 ||
                           (!eval && (strcmp(o, "--resume") == 0 || strcmp(o, "--stop-at-step") == 0)) ||
                           (eval && (strcmp(o, "--checkpoint") == 0 || strcmp(o, "--out") == 0)) ||
                           (strcmp(cmd, " eval") == 0 && strcmp(o, "--dump-logits") == 0) ||
                           (strcmp(cmd, " export") == 0 &&
                            (strcmp(o, "--format") == 0 || strcmp(o, "--name") == 0));
        if (takes_value && !v) {
            fprintf(stderr, "qtrain%s: %s needs a value\n", cmd, o);
            exit(2);
        }
        if (strcmp(o, "--config") == 0) a->config = v, i++;
        else if (!eval && strcmp(o, "--resume") == 0) a->resume = v, i++;
        else if (!eval && strcmp(o, "--stop-at-step") == 0) a->stop_at_step = parse_positive(o, v), i++;
        else if (eval && strcmp(o, "--checkpoint") == 0) a->checkpoint = v, i++;
        else if (eval && strcmp(o, "--out") == 0) a->out = v, i++;
        else if (strcmp(cmd, " eval") == 0 && strcmp(o, "--dump-logits") == 0) a->dump_logits = v, i++;
        else if (eval && strcmp(o, "--force") == 0) a->force = true;
        else if (strcmp(cmd, " merge") == 0 && strcmp(o, "--dequantize") == 0) a->dequantize = true;
        else if (strcmp(cmd, " export") == 0 && strcmp(o, "--format") == 0) a->format = v, i++;
        else if (strcmp(cmd, " export") == 0 && strcmp(o, "--merge") == 0) a->merge = true;
        else if (strcmp(cmd, " export") == 0 && strcmp(o, "--name") == 0) a->name = v, i++;
        else if (strcmp(cmd, " export") == 0 && strcmp(o, "--low-ram") == 0) a->low_ram = true;
        else if (strcmp(cmd, " eval") == 0 && strcmp(o, "--integer") == 0) a->integer = true;
        else if (strcmp(o, "--set") == 0) {
            if (a->n_overrides == MAX_OVERRIDES) {
                fprintf(stderr, "qtrain%s: more than %d --set options\n", cmd, MAX_OVERRIDES);
                exit(2);
            }
            a->overrides[a->n_overrides++] = v, i++;
        } else if (strcmp(o, "--quiet") == 0 || strcmp(o, "-q") == 0) a->quiet = true;
        else if (is_help(o)) cmd_help_exit(name);
        else {
            fprintf(stderr, "qtrain%s: unknown option '%s' (see qtrain --help)\n", cmd, o);
            exit(2);
        }
    }
}

/* Config errors are the user's to fix: exit status 2. */
static int exit_status(const QtError *err) {
    return err->status == QT_ERR_CONFIG || err->status == QT_ERR_ARG ? 2 : 1;
}

static int fail(const QtError *err, int status) {
    fprintf(stderr, "qtrain: error: %s\n", err->msg);
    return status;
}

/* The ranks of build/qtrain-mpi under mpirun (dist_mpi_start in main); rank 0 of 1 otherwise. */
static Dist cli_dist;

/* A failed run on one of several ranks: a failure the ranks agreed on ends each normally (rank 0, or the rank
 * that failed, says why); any other leaves ranks waiting in a collective, so this rank ends the whole job. */
static int fail_rank(const QtError *err, int status) {
    Dist *d = &cli_dist;
    if (!dist_is_multi(d)) return fail(err, status);
    if (!d->said_elsewhere) {
        if (d->rank == 0 && d->agreed) fprintf(stderr, "qtrain: error: %s\n", err->msg);
        else fprintf(stderr, "qtrain: error: rank %d of %d: %s\n", d->rank, d->world, err->msg);
    }
    if (!d->agreed) {
        fprintf(stderr, "qtrain: rank %d of %d ends the job (the other ranks cannot go on without it)\n", d->rank,
                d->world);
        dist_abort(d, status);
    }
    return status;
}

/* Rank 0's config on every rank: its resolved text, loaded again (the same values as a checkpoint's config).
 * st: rank 0's config_load; a failure there ends every rank with its status (rank 0 says why). */
static QtStatus share_config(Config *cfg, QtStatus st, QtError *err) {
    Dist *d = &cli_dist;
    char *text = d->rank == 0 && st == QT_OK ? config_to_yaml(cfg) : NULL;
    int64_t head[2] = {d->rank == 0 && st == QT_OK && !text ? QT_ERR_NOMEM : st, text ? (int64_t)strlen(text) + 1 : 0};
    QtError e = {0};
    if (dist_bcast(d, head, sizeof head, 0, &e) != QT_OK) {
        free(text);
        return qt_error_set(err, e.status, "%s", e.msg);
    }
    if (head[0] != QT_OK) {
        free(text);
        d->agreed = true, d->said_elsewhere = d->rank != 0;
        if (d->rank == 0 && st == QT_OK) return qt_error_set(err, QT_ERR_NOMEM, "out of memory sharing the config");
        return d->rank == 0 ? st : qt_error_set(err, (QtStatus)head[0], "rank 0 could not load the config");
    }
    if (d->rank != 0 && !(text = malloc((size_t)head[1])))
        return qt_error_set(err, QT_ERR_NOMEM, "rank %d: out of memory for the config", d->rank);
    char name[sizeof cfg->source]; /* config_default clears cfg->source first */
    snprintf(name, sizeof name, "%s", cfg->source);
    QtStatus bst = dist_bcast(d, text, (size_t)head[1], 0, &e);
    if (bst == QT_OK && d->rank != 0) bst = config_load_string(cfg, text, name, NULL, 0, &e);
    free(text);
    return bst == QT_OK ? QT_OK : qt_error_set(err, e.status, "rank %d: %s", d->rank, e.msg);
}

static int cmd_train(int argc, char **argv) {
    CliArgs a;
    parse_args(argc, argv, "", false, &a);
    if (!a.config) {
        fprintf(stderr, "qtrain: --config FILE is required (see qtrain --help)\n");
        return 2;
    }
    Config *cfg = calloc(1, sizeof *cfg);
    QtError err = {0};
    if (!cfg) return 1;
    Dist *d = &cli_dist;
    QtStatus cst = d->rank == 0 ? config_load(cfg, a.config, a.overrides, a.n_overrides, &err) : QT_OK;
    if (dist_is_multi(d)) {
        snprintf(cfg->source, sizeof cfg->source, "%s", a.config);
        cst = share_config(cfg, cst, &err);
    }
    if (cst != QT_OK) {
        free(cfg);
        return fail_rank(&err, 2);
    }
    TrainOptions o = {.resume = a.resume, .quiet = a.quiet, .progress = isatty(STDERR_FILENO) == 1,
                      .stop_at_step = a.stop_at_step, .dist = dist_is_multi(d) ? d : NULL};
    TrainResult r;
    if (interrupt_install() != 0) fprintf(stderr, "qtrain: warning: cannot handle SIGINT/SIGTERM (%s): a stop "
                                          "signal will end the run without a checkpoint\n", strerror(errno));
    QtStatus st = train_run(cfg, &o, &r, &err);
    free(cfg);
    if (st != QT_OK) return fail_rank(&err, exit_status(&err));
    if (d->rank != 0) return r.interrupted ? INTERRUPT_EXIT_STATUS : 0; /* rank 0 reports */
    if (a.quiet && r.interrupted) printf("interrupted: steps:%lld\n", (long long)r.steps);
    if (r.interrupted) return INTERRUPT_EXIT_STATUS;
    if (a.quiet && r.stopped) printf("stopped: steps:%lld\n", (long long)r.steps);
    else if (a.quiet && r.already_complete) printf("already complete: steps:%lld\n", (long long)r.steps);
    else if (a.quiet) {
        char what[96];
        train_result_format(&r, what, sizeof what);
        printf("%s steps:%lld\n", what, (long long)r.steps);
    }
    return 0;
}

/* Whether the overrides set `key`. */
static bool overrides_set(const CliArgs *a, const char *key) {
    size_t n = strlen(key);
    for (int i = 0; i < a->n_overrides; i++)
        if (strncmp(a->overrides[i], key, n) == 0 && a->overrides[i][n] == '=') return true;
    return false;
}

/* The config stored in the checkpoint. Its data.cache_dir is kept only when it is `none` (no writes): a stored
 * config does not choose a directory for eval to write into; --set data.cache_dir=DIR does. */
static QtStatus eval_stored_config(Config *cfg, const CliArgs *a, QtError *err) {
    char *text = NULL, name[CONFIG_PATH_MAX + 16];
    snprintf(name, sizeof name, "%s:/config", a->checkpoint);
    QtStatus st = checkpoint_read_config(a->checkpoint, &text, err);
    if (st == QT_ERR_FORMAT && strstr(err->msg, "holds no stored config")) {
        qt_error_clear(err);
        return qt_error_set(err, QT_ERR_ARG, "%s holds no stored config; pass the config the model was trained with: "
                            "qtrain eval --config FILE --checkpoint %s", a->checkpoint, a->checkpoint);
    }
    if (st == QT_OK) st = config_load_string(cfg, text, name, a->overrides, a->n_overrides, err);
    free(text);
    if (st == QT_OK && strcmp(cfg->data.cache_dir, "none") != 0 && !overrides_set(a, "data.cache_dir"))
        cfg->data.cache_dir[0] = '\0';
    return st;
}

/* Whether a and b name one file (an existing one: the same device and inode; else the same text). */
static bool same_file(const char *a, const char *b) {
    struct stat sa, sb;
    if (stat(a, &sa) == 0 && stat(b, &sb) == 0) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    return strcmp(a, b) == 0;
}

static int cmd_eval(int argc, char **argv) {
    CliArgs a;
    parse_args(argc, argv, " eval", true, &a);
    if (!a.checkpoint) {
        fprintf(stderr, "qtrain eval: --checkpoint PATH is required (see qtrain eval --help)\n");
        return 2;
    }
    char json[CONFIG_PATH_MAX + 32];
    QtError err = {0};
    if (train_eval_json_path(a.checkpoint, a.out, json, sizeof json, &err) != QT_OK) return fail(&err, 2);
    Config *cfg = malloc(sizeof *cfg);
    if (!cfg) return 1;
    QtStatus st;
    if (a.config) {
        if (config_load(cfg, a.config, a.overrides, a.n_overrides, &err) != QT_OK) {
            free(cfg);
            return fail(&err, 2);
        }
        st = QT_OK;
    } else st = eval_stored_config(cfg, &a, &err);
    if (st != QT_OK) {
        free(cfg);
        return fail(&err, exit_status(&err));
    }
    TrainResult r;
    if (a.dump_logits) {
        const char *others[3] = {a.checkpoint, a.config, json};
        for (int k = 0; k < 3; k++)
            if (others[k] && same_file(a.dump_logits, others[k])) {
                fprintf(stderr, "qtrain eval: --dump-logits %s is %s; give the logits a file of their own\n",
                        a.dump_logits, k == 0 ? "the checkpoint" : k == 1 ? "the config" : "where eval.json goes");
                free(cfg);
                return 2;
            }
        if (fs_check_out_path(a.dump_logits, a.force, "--dump-logits", &err) != QT_OK) {
            free(cfg);
            return fail(&err, 2);
        }
    }
    if (a.integer && a.out) {
        fprintf(stderr, "qtrain eval: --integer writes no eval.json; drop --out (its result is the printed line)\n");
        free(cfg);
        return 2;
    }
    if (a.integer) {
        IntEvalResult ir;
        st = eval_int_checkpoint(cfg, a.checkpoint, a.dump_logits, &ir, &err);
        free(cfg);
        if (st != QT_OK) return fail(&err, exit_status(&err));
        if (ir.mse) printf("integer test_mse:%.6f", ir.loss);
        else printf("integer test_accuracy:%.4f test_loss:%.4f", ir.accuracy, ir.loss);
        printf(" examples:%d logits_scale:%.9g logits_zero_point:%d arena_bytes:%zu macs:%.0f\n", ir.n,
               (double)ir.out_scale, (int)ir.out_zp, ir.arena_bytes, ir.macs);
        if (!a.quiet && a.dump_logits) printf("wrote %s\n", a.dump_logits);
        return 0;
    }
    st = train_eval_checkpoint_dump(cfg, a.checkpoint, json, a.dump_logits, &r, &err);
    free(cfg);
    if (st != QT_OK) return fail(&err, exit_status(&err));
    char what[96];
    train_result_format(&r, what, sizeof what);
    printf("%s", what);
    if (r.mse && r.val_mse >= 0) printf(" val_mse:%.4f val_mae:%.4f", r.val_mse, r.val_mae);
    else if (!r.mse && r.val_accuracy >= 0) printf(" val_accuracy:%.4f val_loss:%.4f", r.val_accuracy, r.val_loss);
    printf("\n");
    if (!a.quiet) printf("wrote %s\n", json);
    if (!a.quiet && r.scores_path[0]) printf("wrote %s\n", r.scores_path);
    if (!a.quiet && a.dump_logits) printf("wrote %s\n", a.dump_logits);
    return 0;
}

static int cmd_quantize(int argc, char **argv) {
    CliArgs a;
    parse_args(argc, argv, " quantize", true, &a);
    if (!a.config || !a.checkpoint || !a.out) {
        fprintf(stderr, "qtrain quantize: --config FILE, --checkpoint PATH and --out PATH are required\n");
        return 2;
    }
    Config *cfg = malloc(sizeof *cfg);
    QtError err = {0};
    if (!cfg) return 1;
    QtStatus st = config_load(cfg, a.config, a.overrides, a.n_overrides, &err);
    if (st == QT_OK) st = tools_quantize(cfg, a.checkpoint, a.out, a.force, a.quiet ? NULL : stdout, &err);
    free(cfg);
    return st == QT_OK ? 0 : fail(&err, exit_status(&err));
}

static int cmd_merge(int argc, char **argv) {
    CliArgs a;
    parse_args(argc, argv, " merge", true, &a);
    if (!a.checkpoint || !a.out || a.config || a.n_overrides) {
        fprintf(stderr, "qtrain merge: give --checkpoint PATH and --out PATH (the config comes from the checkpoint)\n");
        return 2;
    }
    QtError err = {0};
    MergeReport rep;
    QtStatus st = tools_merge(a.checkpoint, a.out, a.dequantize, a.force, a.quiet ? NULL : stdout, &rep, &err);
    if (st != QT_OK) return fail(&err, exit_status(&err));
    if (isnan(rep.test_accuracy_before)) /* an mse model: its loss is the test mse, as training prints it */
        printf("merged:%d mode:%s weight_rel_rmse:%.4g test_mse_before:%.6f test_mse_after:%.6f delta:%+.6f out:%s\n",
               rep.modules, rep.mode, rep.weight_rel_rmse, rep.test_loss_before, rep.test_loss_after,
               rep.test_loss_after - rep.test_loss_before, a.out);
    else
        printf("merged:%d mode:%s weight_rel_rmse:%.4g test_accuracy_before:%.4f test_accuracy_after:%.4f "
               "delta:%+.4f test_loss_before:%.4f test_loss_after:%.4f out:%s\n", rep.modules, rep.mode,
               rep.weight_rel_rmse, rep.test_accuracy_before, rep.test_accuracy_after,
               rep.test_accuracy_after - rep.test_accuracy_before, rep.test_loss_before, rep.test_loss_after, a.out);
    return 0;
}

static int cmd_export(int argc, char **argv) {
    CliArgs a;
    parse_args(argc, argv, " export", true, &a);
    if (!a.checkpoint || !a.out || !a.format || a.config || a.n_overrides) {
        fprintf(stderr, "qtrain export: give --checkpoint PATH, --format safetensors|peft|h5|c and --out PATH (the model "
                        "comes from the checkpoint)\n");
        return 2;
    }
    QtError err = {0};
    if (strcmp(a.format, "c") == 0) {
        if (a.merge) {
            fprintf(stderr, "qtrain export: --format c merges a LoRA run's adapters by itself; drop --merge\n");
            return 2;
        }
        ExportCReport r;
        if (export_c(a.checkpoint, a.out, a.name, a.force, a.low_ram, a.quiet ? NULL : stdout, &r, &err) != QT_OK)
            return fail(&err, exit_status(&err));
        printf("export:c ops:%d conv2d:%d dense:%d int4_layers:%d macs:%.0f weight_bytes:%zu const_bytes:%zu "
               "arena_bytes:%zu ram_bytes:%zu", r.ops, r.conv_layers, r.dense_layers, r.int4_layers, r.macs,
               r.weight_bytes, r.const_bytes, r.arena_bytes, r.arena_bytes + r.io_bytes);
        if (r.code_measured)
            printf(" flash_bytes:%ld m4_text:%ld m4_rodata:%ld m4_data:%ld m4_bss:%ld",
                   r.text_bytes + r.rodata_bytes + r.data_bytes, r.text_bytes, r.rodata_bytes, r.data_bytes,
                   r.bss_bytes);
        else printf(" flash_bytes:unmeasured(no arm-none-eabi-gcc)");
        if (isnan(r.test_accuracy)) printf(" integer_test_mse:%.6f", r.test_loss);
        else printf(" integer_test_accuracy:%.4f", r.test_accuracy);
        printf(" examples:%d out:%s\n", r.test_examples, a.out);
        return 0;
    }
    if (a.name || a.low_ram) {
        fprintf(stderr, "qtrain export: --name and --low-ram are options of --format c\n");
        return 2;
    }
    QtStatus st = interop_export(a.checkpoint, a.format, a.out, a.merge, a.force, a.quiet ? NULL : stdout, &err);
    return st == QT_OK ? 0 : fail(&err, exit_status(&err));
}

static int cmd_compare(int argc, char **argv) {
    const char *out = "runs/compare", *dirs[COMPARE_MAX_RUNS];
    int n = 0;
    for (int i = 0; i < argc; i++)
        if (is_help(argv[i])) cmd_help_exit("compare");
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--out") == 0 && i + 1 < argc) out = argv[++i];
        else if (strcmp(argv[i], "--out") == 0) {
            fprintf(stderr, "qtrain compare: --out needs a value\n");
            return 2;
        }
        else if (argv[i][0] == '-') {
            fprintf(stderr, "qtrain compare: unknown option '%s' (see qtrain --help)\n", argv[i]);
            return 2;
        } else if (n == COMPARE_MAX_RUNS) {
            fprintf(stderr, "qtrain compare: at most %d runs\n", COMPARE_MAX_RUNS);
            return 2;
        } else dirs[n++] = argv[i];
    }
    if (n == 0) {
        fprintf(stderr, "qtrain compare: give one or more run directories (each with summary.json)\n");
        return 2;
    }
    CompareRun *runs = calloc((size_t)n, sizeof *runs);
    QtError err = {0};
    QtStatus st = runs ? QT_OK : qt_error_set(&err, QT_ERR_NOMEM, "out of memory");
    int loaded = 0;
    for (; st == QT_OK && loaded < n; loaded++)
        if ((st = compare_load_run(&runs[loaded], dirs[loaded], &err)) != QT_OK) break;
    if (st == QT_OK) st = compare_write(runs, n, out, stdout, &err);
    if (st == QT_OK) printf("\nwrote %s/compare.md and %s/compare.svg\n", out, out);
    for (int i = 0; runs && i < loaded; i++) compare_run_free(&runs[i]);
    free(runs);
    return st == QT_OK ? 0 : fail(&err, exit_status(&err));
}

static int cmd_convert(int argc, char **argv) {
    CliArgs a;
    parse_args(argc, argv, " convert", true, &a);
    if (!a.checkpoint || !a.out || a.config || a.n_overrides) {
        fprintf(stderr, "qtrain convert: give --checkpoint PATH and --out PATH (the config comes from the "
                "checkpoint)\n");
        return 2;
    }
    QtError err = {0};
    ConvertReport rep;
    if (tools_convert(a.checkpoint, a.out, a.force, a.quiet ? NULL : stdout, &rep, &err) != QT_OK)
        return fail(&err, exit_status(&err));
    if (isnan(rep.test_accuracy_qat)) /* an mse model */
        printf("converted:%d test_mse_qat:%.6f test_mse_ptq:%.6f out:%s\n", rep.modules, rep.test_loss_qat,
               rep.test_loss_ptq, a.out);
    else
        printf("converted:%d test_accuracy_qat:%.4f test_accuracy_ptq:%.4f test_loss_qat:%.6f test_loss_ptq:%.6f "
               "out:%s\n", rep.modules, rep.test_accuracy_qat, rep.test_accuracy_ptq, rep.test_loss_qat,
               rep.test_loss_ptq, a.out);
    return 0;
}

static int cmd_inspect(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (is_help(argv[i])) cmd_help_exit("inspect");
    if (argc != 1) {
        fprintf(stderr, "qtrain inspect: give exactly one checkpoint path\n");
        return 2;
    }
    QtError err = {0};
    if (checkpoint_inspect(argv[0], stdout, &err) != QT_OK) return fail(&err, 1);
    return 0;
}

static int cmd_demo(int argc, char **argv) {
    DemoOptions o = demo_options_default();
    for (int i = 0; i < argc; i++)
        if (is_help(argv[i])) cmd_help_exit("demo");
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--steps") == 0) o.steps = (int)parse_positive(a, v), i++;
        else if (strcmp(a, "--batch-size") == 0) o.batch_size = (int)parse_positive(a, v), i++;
        else if (strcmp(a, "--seed") == 0) o.seed = (unsigned long long)parse_positive(a, v), i++;
        else if (strcmp(a, "--threads") == 0) o.threads = (int)parse_positive(a, v), i++;
        else if (strcmp(a, "--quiet") == 0) o.quiet = true;
        else {
            fprintf(stderr, "qtrain demo: unknown option '%s' (see qtrain demo --help)\n", a);
            return 2;
        }
    }
    QtError err = {0};
    double acc = 0.0;
    if (demo_run(&o, &acc, &err) != QT_OK) return fail(&err, err.status == QT_ERR_ARG ? 2 : 1);
    if (o.quiet) printf("test_accuracy:%.4f\n", acc);
    return 0;
}

/* An integer option value in [min, max]; exits 2 on garbage. */
static long long parse_count(const char *cmd, const char *opt, const char *value, long long min, long long max) {
    char *end = NULL;
    errno = 0;
    long long v = value ? strtoll(value, &end, 10) : 0;
    if (!value || !*value || *end || (errno && errno != ERANGE) || v < min) {
        fprintf(stderr, "qtrain%s: %s needs an integer >= %lld, got '%s'\n", cmd, opt, min,
                value ? value : "(nothing)");
        exit(2);
    }
    if (errno == ERANGE || v > max) {
        fprintf(stderr, "qtrain%s: %s %s is too large (at most %lld)\n", cmd, opt, value, max);
        exit(2);
    }
    return v;
}

static int cmd_bench(int argc, char **argv) {
    BenchOptions o = bench_options_default();
    const char *config = NULL, *overrides[MAX_OVERRIDES];
    int n_overrides = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (is_help(a)) cmd_help_exit("bench");
        bool known = strcmp(a, "--config") == 0 || strcmp(a, "--steps") == 0 || strcmp(a, "--warmup") == 0 ||
                     strcmp(a, "--eval-batches") == 0 || strcmp(a, "--since-ns") == 0 || strcmp(a, "--set") == 0;
        if (!known) {
            fprintf(stderr, "qtrain bench: unknown option '%s' (see qtrain --help)\n", a);
            return 2;
        }
        if (!v) {
            fprintf(stderr, "qtrain bench: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (strcmp(a, "--config") == 0) config = v;
        else if (strcmp(a, "--steps") == 0) o.steps = (int)parse_count(" bench", a, v, 1, INT_MAX);
        else if (strcmp(a, "--warmup") == 0) o.warmup = (int)parse_count(" bench", a, v, 0, INT_MAX);
        else if (strcmp(a, "--eval-batches") == 0) o.eval_batches = (int)parse_count(" bench", a, v, 0, INT_MAX);
        else if (strcmp(a, "--since-ns") == 0) o.since_ns = parse_count(" bench", a, v, 1, LLONG_MAX);
        else if (n_overrides == MAX_OVERRIDES) {
            fprintf(stderr, "qtrain bench: more than %d --set options\n", MAX_OVERRIDES);
            return 2;
        } else overrides[n_overrides++] = v;
    }
    if (!config) {
        fprintf(stderr, "qtrain bench: --config FILE is required (see qtrain --help)\n");
        return 2;
    }
    Config *cfg = malloc(sizeof *cfg);
    QtError err = {0};
    if (!cfg) return 1;
    if (config_load(cfg, config, overrides, n_overrides, &err) != QT_OK) {
        free(cfg);
        return fail(&err, 2);
    }
    QtStatus st = bench_run(cfg, &o, stdout, &err);
    free(cfg);
    return st == QT_OK ? 0 : fail(&err, exit_status(&err));
}

static int cmd_config(int argc, char **argv) {
    if (argc == 1 && is_help(argv[0])) cmd_help_exit("config");
    for (int i = 0; i < argc; i++)
        if (strcmp(argv[i], "--doc") != 0) {
            fprintf(stderr, "qtrain config: unknown option '%s'; the command takes --doc alone (see qtrain config "
                    "--help)\n", argv[i]);
            return 2;
        }
    if (argc != 1) {
        fprintf(stderr, "qtrain config: give --doc%s (see qtrain config --help)\n", argc ? " once" : "");
        return 2;
    }
    char *doc = config_doc_markdown();
    if (!doc) return fprintf(stderr, "qtrain config: out of memory\n"), 1;
    fputs(doc, stdout);
    free(doc);
    return fflush(stdout) == 0 ? 0 : 1;
}

/* What must hold before any command runs; false after saying why. */
static bool check_resources(void) {
    /* A write past the file-size limit (ulimit -f) then fails with EFBIG,
     * reported like a full disk, instead of killing the process without a
     * word and leaving a partial temp file. */
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim;
    size_t need = gemm_address_space_needed_mb();
    if (getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur / (1024 * 1024) < need) {
        int blas = openblas_get_num_threads();
        fprintf(stderr, "qtrain: error: qtrain needs at least %zu MB of address space (OpenBLAS maps a %d MB "
                "buffer per thread, %d here, and retries forever when it cannot); ulimit -v is %llu MB: raise it "
                "(ulimit -v unlimited)", need, GEMM_BLAS_BUFFER_MB, blas,
                (unsigned long long)(lim.rlim_cur / (1024 * 1024)));
        if (blas > 1)
            fprintf(stderr, ", or set OPENBLAS_NUM_THREADS=1 (qtrain splits the work over run.threads itself; it "
                    "then needs %zu MB)", need - (size_t)(blas - 1) * GEMM_BLAS_BUFFER_MB);
        fputc('\n', stderr);
        return false;
    }
    if (H5open() < 0) {
        fprintf(stderr, "qtrain: error: the HDF5 library cannot be initialised (H5open failed); free memory or raise "
                "ulimit -v\n");
        return false;
    }
    return true;
}

/* The command line's command; main's, after the checks that come first. */
static int cli_main(int argc, char **argv) {
    /* Only training runs on several ranks; another command's output would come once per rank. */
    if (dist_is_multi(&cli_dist) && argc >= 2 && strcmp(argv[1], "train") != 0 && argv[1][0] != '-') {
        if (cli_dist.rank == 0)
            fprintf(stderr, "qtrain: '%s' runs in one process; under mpirun only training runs on several ranks "
                    "(run it without mpirun, or with -np 1)\n", argv[1]);
        return 2;
    }
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("qtrain %s\n", QTRAIN_VERSION);
        return 0;
    }
    /* The int8 path and the convolutions' can be forced (tests, measurements): read once, before any layer is
     * built; it holds for the whole process. */
    QtError kerr = {0};
    if (qlayer_int8_kernel_select(getenv("QTRAIN_INT8_KERNEL"), "QTRAIN_INT8_KERNEL", &kerr) != QT_OK ||
        conv_taps_select(getenv("QTRAIN_CONV_KERNEL"), "QTRAIN_CONV_KERNEL", &kerr) != QT_OK ||
        conv_wino_select(getenv("QTRAIN_CONV_WINOGRAD"), "QTRAIN_CONV_WINOGRAD", &kerr) != QT_OK)
        return fail(&kerr, 2);
    if (strcmp(cmd, "eval") == 0) return cmd_eval(argc - 2, argv + 2);
    if (strcmp(cmd, "inspect") == 0) return cmd_inspect(argc - 2, argv + 2);
    if (strcmp(cmd, "quantize") == 0) return cmd_quantize(argc - 2, argv + 2);
    if (strcmp(cmd, "merge") == 0) return cmd_merge(argc - 2, argv + 2);
    if (strcmp(cmd, "convert") == 0) return cmd_convert(argc - 2, argv + 2);
    if (strcmp(cmd, "export") == 0) return cmd_export(argc - 2, argv + 2);
    if (strcmp(cmd, "compare") == 0) return cmd_compare(argc - 2, argv + 2);
    if (strcmp(cmd, "sensitivity") == 0 || strcmp(cmd, "autoquant") == 0) {
        for (int i = 2; i < argc; i++)
            if (is_help(argv[i]) && strcmp(argv[i - 1], "--set") != 0) cmd_help_exit(cmd);
        return cmd[0] == 's' ? autoquant_cmd_sensitivity(argc - 2, argv + 2) : autoquant_cmd_autoquant(argc - 2, argv + 2);
    }
    if (strcmp(cmd, "demo") == 0) return cmd_demo(argc - 2, argv + 2);
    if (strcmp(cmd, "bench") == 0) return cmd_bench(argc - 2, argv + 2);
    if (strcmp(cmd, "config") == 0) return cmd_config(argc - 2, argv + 2);
    if (strcmp(cmd, "train") == 0) return cmd_train(argc - 2, argv + 2);
    if (cmd[0] == '-') return cmd_train(argc - 1, argv + 1);
    fprintf(stderr, "qtrain: unknown command '%s' (see qtrain --help)\n", cmd);
    return 2;
}

int main(int argc, char **argv) {
    if (!check_resources()) {
        /* not exit(): OpenBLAS's threads may still be retrying their buffers, and exit would wait for them */
        fflush(NULL);
        _exit(1);
    }
    gemm_blas_upgrade_and_exec(argv);
    dist_init_single(&cli_dist);
#ifdef QTRAIN_MPI
    QtError merr = {0};
    if (dist_mpi_start(&argc, &argv, &cli_dist, &merr) != QT_OK) return fail(&merr, 1);
    atexit(dist_mpi_stop); /* the exit()s of option parsing and --help end MPI too */
    int rc = cli_main(argc, argv);
    dist_mpi_stop();
    return rc;
#else
    /* build/qtrain started by mpirun: each rank would train the whole run on its own, all into one out_dir */
    const char *world = getenv("OMPI_COMM_WORLD_SIZE"), *rank = getenv("OMPI_COMM_WORLD_RANK");
    if (world && atoi(world) > 1) {
        if (!rank || atoi(rank) == 0)
            fprintf(stderr, "qtrain: error: started by mpirun with %s ranks, but this qtrain is built without MPI: "
                    "each rank would train alone; run build/qtrain-mpi (make MPI=1) under mpirun, or qtrain without "
                    "it\n", world);
        return 2;
    }
    return cli_main(argc, argv);
#endif
}
