/* bench.c - `qtrain bench`: a config's training and evaluation speed,
 * memory and start-up time, measured on the run training would set up
 * (trainer/run.h), with nothing written to run.out_dir. */
#include "cli/bench.h"

#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "nn/conv_taps.h"
#include "nn/conv_wino.h"
#include "nn/gemm.h"
#include "nn/model.h"
#include "quant/fqt_kern.h"
#include "base/rng.h"
#include "trainer/metrics.h"
#include "trainer/run.h"

#define BENCH_EVAL_WARMUP 2 /* untimed evaluation batches before the timed ones */
#define BENCH_SGEMM_N 1024     /* the square sgemm timed for the machine's rate (M = N = K) */
/* Timed products after one warm-up: until they took BENCH_SGEMM_BUDGET_S,
 * at least BENCH_SGEMM_MIN_REPS and at most BENCH_SGEMM_MAX_REPS. Many short
 * products rather than a few long ones: on a shared machine the best of
 * them is likelier to have had every core. */
#define BENCH_SGEMM_MIN_REPS 3
#define BENCH_SGEMM_MAX_REPS 30
#define BENCH_SGEMM_BUDGET_S 0.2

typedef struct {
    Run run;
    Config *cfg;                /* the caller's config, init_from pointed at the temporary base if one is made */
    char model_name[128];       /* e.g. "conv32-conv64-dense128-dense10" */
    struct timespec first_real, first_boot; /* when the first step (or eval batch) started */
    bool have_first;
    StepMacs macs;              /* per example of a training step (net_step_macs) */
    double sgemm_gflops, sgemm_gflops_median; /* the best and the median product of bench_sgemm */
    int sgemm_reps;
    /* the timed steps' figures (bench_train), printed once the sgemm rate is known (bench_print_train) */
    bool trained;
    double samples_per_s, step_ms, step_ms_median, step_ms_min, gemm_share, gemm_gflops, gemm_calls, loss;
} Bench;

BenchOptions bench_options_default(void) {
    BenchOptions o = {.steps = BENCH_DEFAULT_STEPS, .warmup = BENCH_DEFAULT_WARMUP,
                      .eval_batches = BENCH_DEFAULT_EVAL_BATCHES, .since_ns = 0};
    return o;
}

static double ts_seconds(const struct timespec *t) { return (double)t->tv_sec + 1e-9 * (double)t->tv_nsec; }

static void bench_mark_first(Bench *b) {
    if (b->have_first) return;
    clock_gettime(CLOCK_REALTIME, &b->first_real);
    clock_gettime(CLOCK_BOOTTIME, &b->first_boot);
    b->have_first = true;
}

/* The process's start in seconds since boot, from field 22 of
 * /proc/self/stat (clock ticks); an exec keeps it. Negative if unreadable. */
static double proc_start_boot_s(void) {
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f) return -1.0;
    char buf[1024];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    unsigned long long start = 0;
    /* after ")": state is field 3, starttime field 22 */
    if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
                     &start) != 1)
        return -1.0;
    long hz = sysconf(_SC_CLK_TCK);
    return hz > 0 ? (double)start / (double)hz : -1.0;
}

/* Seconds from the process start to the first step; *clock names the source. */
static double bench_startup_s(const Bench *b, const BenchOptions *o, const char **clock) {
    if (o->since_ns > 0) {
        *clock = "since-ns";
        return ts_seconds(&b->first_real) - (double)o->since_ns * 1e-9;
    }
    *clock = "proc-stat";
    double start = proc_start_boot_s();
    return start < 0 ? NAN : ts_seconds(&b->first_boot) - start;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The machine's sgemm rate at the run's threads, through gemm_f32 as every
 * product of a step: a BENCH_SGEMM_N cube, timed as BENCH_SGEMM_* say. The
 * best is the rate the bound is taken against (the most the machine gave),
 * the median says how steady it was. Measured last, once peak RSS and
 * start-up are read: the cube's 8 MB and the larger packing buffers it
 * makes OpenBLAS touch (which stay resident) would raise the peak by MBs. */
static QtStatus bench_sgemm(Bench *b, QtError *err) {
    const int n = BENCH_SGEMM_N;
    const size_t nn = (size_t)n * n;
    /* mmap, not malloc: freeing a malloc'd block this large would raise glibc's mmap and trim thresholds
       for the rest of the run */
    const size_t bytes = 2 * nn * sizeof(float);
    float *a = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a == MAP_FAILED)
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory for the %dx%d sgemm of the benchmark", n, n);
    float *c = a + nn; /* a: A, used as B too; c: C */
    for (size_t i = 0; i < nn; i++) a[i] = (float)((int)(i % 17) - 8) * (1.0f / 64.0f); /* no denormals */
    double secs[BENCH_SGEMM_MAX_REPS], timed = 0.0;
    gemm_f32(false, false, n, n, n, 1.0f, a, n, a, n, 0.0f, c, n);
    int reps = 0;
    while (reps < BENCH_SGEMM_MAX_REPS && (reps < BENCH_SGEMM_MIN_REPS || timed < BENCH_SGEMM_BUDGET_S)) {
        double t0 = metrics_now();
        gemm_f32(false, false, n, n, n, 1.0f, a, n, a, n, 0.0f, c, n);
        secs[reps] = metrics_now() - t0;
        timed += secs[reps++];
    }
    munmap(a, bytes);
    qsort(secs, (size_t)reps, sizeof *secs, cmp_double);
    const double flops = 2.0 * n * n * n;
    b->sgemm_gflops = flops / secs[0] * 1e-9;
    b->sgemm_gflops_median = flops / secs[reps / 2] * 1e-9;
    b->sgemm_reps = reps;
    return QT_OK;
}

/* "dense512-dense256-dense10": the layers with weights, by width. */
static void bench_name_model(const Model *m, char *buf, size_t cap) {
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < m->n_modules && len < cap; i++) {
        const LayerSpec *s = &m->modules[i].spec;
        int w = s->type == LAYER_CONV2D ? s->out_channels : s->type == LAYER_DENSE ? s->units : -1;
        if (w < 0) continue;
        int k = snprintf(buf + len, cap - len, "%s%s%d", len ? "-" : "", s->type == LAYER_CONV2D ? "conv" : "dense",
                         w);
        len = k < 0 ? cap : len + (size_t)k;
    }
    if (!buf[0]) snprintf(buf, cap, "none");
}

/* The run as training sets it up for a fresh start. */
static QtStatus bench_setup(Bench *b, const TrainOptions *topt, FILE *out, QtError *err) {
    Run *r = &b->run;
    run_init(r, b->cfg, topt);
    r->base_from_seed = b->cfg->quant.mode == QUANT_MODE_PTQ && !b->cfg->model.init_from[0];
    if (r->base_from_seed)
        fprintf(out, "note: model.init_from is not set: the quantized base is the fresh initialisation of run.seed "
                "(timing only)\n");
    QtStatus st = run_prepare(r, true, err);
    if (st == QT_OK) st = net_step_macs(&r->model.net, &b->macs, err);
    if (st != QT_OK) return st;
    net_print_unused_rules(&r->model.net, out);
    bench_name_model(&r->model.net.model, b->model_name, sizeof b->model_name);
    return QT_OK;
}

/* Timed training steps, then a pass with GEMM accounting on; the figures
 * go into b. */
static QtStatus bench_train(Bench *b, const BenchOptions *o, QtError *err) {
    Run *r = &b->run;
    double *ms = malloc((size_t)o->steps * sizeof *ms);
    if (!ms) return qt_error_set(err, QT_ERR_NOMEM, "out of memory for %d step times", o->steps);
    r->work.tape.training = true;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < o->warmup; i++) {
        bench_mark_first(b);
        st = run_step(r, err);
    }
    int64_t examples = r->clock.trained_examples;
    double t_begin = metrics_now();
    for (int i = 0; st == QT_OK && i < o->steps; i++) {
        bench_mark_first(b);
        double t0 = metrics_now();
        st = run_step(r, err);
        ms[i] = (metrics_now() - t0) * 1e3;
    }
    double timed_s = metrics_now() - t_begin;
    examples = r->clock.trained_examples - examples;
    double loss = r->log.win_steps ? r->log.win_loss_sum / (double)r->log.win_steps : NAN;
    int stats_steps = o->steps / 2 > 0 ? o->steps / 2 : 1;
    gemm_stats_reset();
    gemm_stats_enable(true);
    double t_stats = metrics_now();
    for (int i = 0; st == QT_OK && i < stats_steps; i++) st = run_step(r, err);
    t_stats = metrics_now() - t_stats;
    gemm_stats_enable(false);
    GemmStats g = gemm_stats_get();
    if (st == QT_OK) {
        qsort(ms, (size_t)o->steps, sizeof *ms, cmp_double);
        b->trained = true;
        b->samples_per_s = (double)examples / timed_s, b->step_ms = timed_s * 1e3 / o->steps;
        b->step_ms_median = ms[o->steps / 2], b->step_ms_min = ms[0];
        b->gemm_share = t_stats > 0 ? g.core_seconds / t_stats : 0.0;
        b->gemm_gflops = g.seconds > 0 ? g.flops / g.core_seconds * 1e-9 : 0.0;
        b->gemm_calls = (double)g.calls / stats_steps, b->loss = loss;
    }
    free(ms);
    return st;
}

/* The bench:sgemm line, then bench:train with the GEMM-bound limit: the
 * step's multiply-adds at the sgemm rate. */
static void bench_print_train(const Bench *b, const BenchOptions *o, FILE *out) {
    const Run *r = &b->run;
    double macs = step_macs_total(&b->macs);
    double bound = macs > 0 ? b->sgemm_gflops * 1e9 / (2.0 * macs) : 0.0;
    fprintf(out, "bench:sgemm m:%d n:%d k:%d threads:%d reps:%d gflops:%.1f gflops_median:%.1f\n", BENCH_SGEMM_N,
            BENCH_SGEMM_N, BENCH_SGEMM_N, gemm_get_threads(), b->sgemm_reps, b->sgemm_gflops, b->sgemm_gflops_median);
    fprintf(out, "bench:train model:%s mode:%s batch:%d steps:%d warmup:%d samples_per_s:%.1f step_ms:%.3f "
            "step_ms_median:%.3f step_ms_min:%.3f gemm_share:%.3f gemm_gflops:%.1f gemm_calls_per_step:%.1f "
            "loss:%.4f macs_per_sample:%.0f bound_samples_per_s:%.1f of_bound:%.3f macs_forward:%.0f "
            "macs_backward_dx:%.0f macs_backward_dw:%.0f\n", b->model_name, net_mode_name(&r->model.net),
            r->cfg->train.batch_size, o->steps, o->warmup, b->samples_per_s, b->step_ms, b->step_ms_median,
            b->step_ms_min, b->gemm_share, b->gemm_gflops, b->gemm_calls, b->loss, macs, bound,
            bound > 0 ? b->samples_per_s / bound : 0.0, b->macs.forward, b->macs.backward_dx, b->macs.backward_dw);
}

/* Eval batches cycle through the test split in full batches; ms (may be
 * NULL) gets each batch's milliseconds. */
static QtStatus bench_eval_pass(Bench *b, int batches, int *next, int bs, double *ms, QtError *err) {
    Run *r = &b->run;
    double loss_sum = 0.0;
    int64_t correct = 0;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < batches; i++) {
        if (*next + bs > r->data.test.n) *next = 0;
        bench_mark_first(b);
        double t0 = metrics_now();
        st = run_eval_batch(r, &r->data.test, *next, bs, &loss_sum, &correct, err);
        if (ms) ms[i] = (metrics_now() - t0) * 1e3;
        *next += bs;
    }
    return st;
}

/* Forward-only batches of the test split at train.eval_batch_size. */
static QtStatus bench_eval(Bench *b, const BenchOptions *o, FILE *out, QtError *err) {
    Run *r = &b->run;
    int bs = r->cfg->train.eval_batch_size < r->data.test.n ? r->cfg->train.eval_batch_size : r->data.test.n, next = 0;
    double *ms = malloc((size_t)o->eval_batches * sizeof *ms);
    if (!ms) return qt_error_set(err, QT_ERR_NOMEM, "out of memory for %d batch times", o->eval_batches);
    r->work.tape.training = false, r->work.tape.grad_enabled = false;
    QtStatus st = bench_eval_pass(b, BENCH_EVAL_WARMUP, &next, bs, NULL, err);
    double t0 = metrics_now();
    if (st == QT_OK) st = bench_eval_pass(b, o->eval_batches, &next, bs, ms, err);
    double timed_s = metrics_now() - t0;
    int stats_batches = o->eval_batches / 2 > 0 ? o->eval_batches / 2 : 1;
    gemm_stats_reset();
    gemm_stats_enable(true);
    double t_stats = metrics_now();
    if (st == QT_OK) st = bench_eval_pass(b, stats_batches, &next, bs, NULL, err);
    t_stats = metrics_now() - t_stats;
    gemm_stats_enable(false);
    GemmStats g = gemm_stats_get();
    r->work.tape.grad_enabled = true;
    if (st == QT_OK) {
        int on, with;
        net_int8_layers(&r->model.net, &on, &with);
        qsort(ms, (size_t)o->eval_batches, sizeof *ms, cmp_double);
        fprintf(out, "bench:eval model:%s mode:%s batch:%d batches:%d samples_per_s:%.1f batch_ms:%.3f "
                "batch_ms_median:%.3f batch_ms_min:%.3f gemm_share:%.3f int8_kernel:%s int8_layers:%d/%d\n", b->model_name,
                net_mode_name(&r->model.net), bs, o->eval_batches, (double)o->eval_batches * bs / timed_s,
                timed_s * 1e3 / o->eval_batches, ms[o->eval_batches / 2], ms[0],
                t_stats > 0 ? g.core_seconds / t_stats : 0.0, net_int8_kernel(&r->model.net), on, with);
    }
    free(ms);
    return st;
}

static void bench_print_header(const Bench *b, FILE *out) {
    const Run *r = &b->run;
    const Config *c = r->cfg;
    fprintf(out, "bench:config name:%s config:%s model:%s mode:%s batch:%d eval_batch:%d threads:%d "
            "params_trainable:%zu params_frozen:%zu train_steps:%" PRId64 " int8_kernel:%s\n", c->run.name,
            c->source, b->model_name, net_mode_name(&r->model.net), c->train.batch_size, c->train.eval_batch_size,
            gemm_get_threads(), net_params_trainable(&r->model.net), net_params_frozen(&r->model.net),
            r->plan.total_steps, net_int8_kernel(&r->model.net));
    fprintf(out, "bench:blas core:%s threads:%d conv_kernel:%s conv_winograd:%s qt_kernel:%s\n", gemm_blas_core(),
            gemm_get_threads(), conv_taps_level_name(conv_taps_level()), conv_wino_enabled ? "on" : "off",
            fqt_kern_name());
    fflush(out);
}

static void bench_print_tail(const Bench *b, const BenchOptions *o, bool trained, FILE *out) {
    struct rusage ru;
    double rss = getrusage(RUSAGE_SELF, &ru) == 0 ? (double)ru.ru_maxrss / 1024.0 : 0.0;
    fprintf(out, "bench:mem peak_rss_mb:%.1f arena_mb:%.2f\n", rss,
            (double)arena_capacity(&b->run.work.arena) / (1024.0 * 1024.0));
    if (b->have_first) {
        const char *clock = "";
        double s = bench_startup_s(b, o, &clock);
        fprintf(out, "bench:startup first_step_s:%.3f first:%s clock:%s\n", s, trained ? "train" : "eval", clock);
    }
}

static QtStatus bench_check_options(const BenchOptions *o, QtError *err) {
    if (o->steps < 1 || o->warmup < 0 || o->eval_batches < 0 || o->since_ns < 0)
        return qt_error_set(err, QT_ERR_ARG, "bench: steps must be >= 1, warmup and eval batches >= 0 and "
                            "since_ns >= 0 (got %d, %d, %d, %" PRId64 ")", o->steps, o->warmup, o->eval_batches,
                            o->since_ns);
    return QT_OK;
}

QtStatus bench_run(const Config *cfg, const BenchOptions *o, FILE *out, QtError *err) {
    QtStatus st = bench_check_options(o, err);
    if (st != QT_OK) return st;
    Bench *b = calloc(1, sizeof *b);
    if (b) b->cfg = malloc(sizeof *b->cfg);
    if (!b || !b->cfg) {
        free(b);
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory setting up the benchmark");
    }
    *b->cfg = *cfg;
    TrainOptions topt = {.quiet = true};
    st = bench_setup(b, &topt, out, err);
    bool trains = st == QT_OK && b->run.plan.total_steps > 0;
    if (st == QT_OK) bench_print_header(b, out);
    /* The eval, memory and start-up lines wait here for bench:train, which waits for the sgemm rate, measured
       last (bench_sgemm); the lines keep their order. */
    char *later_text = NULL;
    size_t later_len = 0;
    FILE *later = st == QT_OK ? open_memstream(&later_text, &later_len) : NULL;
    if (st == QT_OK && !later) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory for the benchmark's output");
    if (st == QT_OK && trains) st = bench_train(b, o, err);
    if (st == QT_OK && o->eval_batches > 0) st = bench_eval(b, o, later, err);
    if (st == QT_OK) bench_print_tail(b, o, trains, later);
    if (later) fclose(later);
    if (b->trained) { /* also when eval failed after it: the training figures stand */
        QtError sg_err = {0};
        QtStatus sg = bench_sgemm(b, &sg_err);
        if (sg == QT_OK) bench_print_train(b, o, out);
        if (sg != QT_OK && st == QT_OK) {
            st = sg;
            if (err) *err = sg_err;
        }
    }
    if (later_text) fputs(later_text, out);
    free(later_text);
    fflush(out);
    run_free(&b->run);
    free(b->cfg);
    free(b);
    return st;
}
