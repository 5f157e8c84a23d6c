/* bench_train.c - steady-state training throughput of the two reference models.
 *
 * For each model (MLP 784-512-256-10, small CNN) at a fixed batch size and
 * OpenBLAS thread count: build the model, AdamW, a step arena and a tape;
 * warm up; then time full training steps (forward, loss, backward, optimizer
 * step, zero grad, tape reset) for a fixed wall time. A second, shorter pass
 * with GEMM accounting on splits the step into phases and measures the share
 * of time inside sgemm. See bench/README.md for how to read the output.
 *
 * Exits non-zero only on an error (bad arguments, allocation, tape error),
 * never because a result is slow. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/arena.h"
#include "nn/gemm.h"
#include "nn/model.h"
#include "nn/ops.h"
#include "nn/optim.h"
#include "base/rng.h"
#include "nn/tape.h"

#define N_CLASSES 10
#define POOL_BATCHES 16        /* distinct pre-generated batches, cycled; ~6 MiB for the MLP at batch 128,
                                  more than L2, so inputs are not unrealistically cache-hot */
#define ARENA_START_BYTES (64u << 10) /* deliberately small: warm-up must grow it, the steady state must not */
#define MAX_STEP_SAMPLES 100000

/* PyTorch 1.13 training figures at batch 128, 2 threads, on this kind of
 * machine. Not measured here: printed only to orient the reader. */
#define REF_MLP_SAMPLES_PER_S 23700.0
#define REF_CNN_SAMPLES_PER_S 3150.0

typedef struct {
    int threads, batch, warmup;
    double seconds;
    bool run_mlp, run_cnn, peak;
} Args;

typedef struct {
    const char *name;
    double ref_samples_per_s;
    Model model;
    Optimizer opt;
    Arena arena;
    Tape tape;
    Rng rng;
    float lr;
    int batch, sample_numel;
    int x_ndim, x_shape[4];      /* batch shape: (B, 784) or (B, 1, 28, 28) */
    float *x_pool;               /* [POOL_BATCHES * batch * sample_numel] */
    int32_t *y_pool;             /* [POOL_BATCHES * batch] */
    long long step;              /* steps taken, picks the pool batch */
    float last_loss;
} Bench;

/* Time per phase over a pass, and the part of each spent inside sgemm. */
typedef struct {
    double fwd, bwd, optim, reset;
    double gemm_fwd, gemm_bwd;
} Phases;

typedef struct {
    long long steps;
    double seconds;
    double step_ms_median, step_ms_min;
} TimedResult;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- arguments ------------------------------------------------------------ */

static void usage(FILE *out) {
    fprintf(out, "usage: bench_train [--threads N] [--batch B] [--seconds S] [--warmup W] [--model mlp|cnn|all]\n"
                 "                   [--no-peak]\n"
                 "defaults: --threads 2 --batch 128 --seconds 3 --warmup 5 --model all\n");
}

static bool parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

static bool parse_seconds(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v > 0.0 && v <= 3600.0)) return false;
    *out = v;
    return true;
}

/* Returns 0 to run, 1 to exit successfully (--help), -1 on a bad argument. */
static int parse_args(int argc, char **argv, Args *a) {
    *a = (Args){.threads = 2, .batch = 128, .warmup = 5, .seconds = 3.0, .run_mlp = true, .run_cnn = true,
                .peak = true};
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = true, takes_value = true;
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            usage(stdout);
            return 1;
        } else if (!strcmp(opt, "--no-peak")) {
            a->peak = false;
            takes_value = false;
        } else if (!val) {
            ok = false;
        } else if (!strcmp(opt, "--threads")) {
            ok = parse_int(val, 1, 256, &a->threads);
        } else if (!strcmp(opt, "--batch")) {
            ok = parse_int(val, 1, 65536, &a->batch);
        } else if (!strcmp(opt, "--warmup")) {
            ok = parse_int(val, 1, 10000, &a->warmup);
        } else if (!strcmp(opt, "--seconds")) {
            ok = parse_seconds(val, &a->seconds);
        } else if (!strcmp(opt, "--model")) {
            a->run_mlp = !strcmp(val, "mlp") || !strcmp(val, "all");
            a->run_cnn = !strcmp(val, "cnn") || !strcmp(val, "all");
            ok = a->run_mlp || a->run_cnn;
        } else {
            ok = false;
        }
        if (!ok) {
            fprintf(stderr, "bench_train: bad or incomplete option '%s%s%s'\n", opt, val && takes_value ? " " : "",
                    val && takes_value ? val : "");
            usage(stderr);
            return -1;
        }
        i += takes_value;
    }
    return 0;
}

/* ---- sgemm peak probe ------------------------------------------------------- */

/* A large square sgemm on the same thread count: what this machine's BLAS
 * can do when the shapes are kind, as context for the in-training figure. */
static int peak_probe(int threads) {
    const int n = 1024;
    const size_t nn = (size_t)n * n;
    float *a = malloc(nn * sizeof *a), *b = malloc(nn * sizeof *b), *c = malloc(nn * sizeof *c);
    if (!a || !b || !c) {
        free(a), free(b), free(c);
        fprintf(stderr, "bench_train: cannot allocate the sgemm probe's matrices\n");
        return -1;
    }
    Rng rng;
    rng_init(&rng, 1234, 99);
    rng_fill_uniform(&rng, a, nn, -1.0f, 1.0f);
    rng_fill_uniform(&rng, b, nn, -1.0f, 1.0f);
    gemm_f32(false, false, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n); /* wakes the BLAS threads, faults pages in */
    double best = INFINITY, total = 0.0, t_end = now_s() + 0.5;
    int reps = 0;
    while (reps < 3 || (now_s() < t_end && reps < 200)) {
        double t0 = now_s();
        gemm_f32(false, false, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
        double dt = now_s() - t0;
        total += dt;
        best = dt < best ? dt : best;
        reps++;
    }
    const double flops = 2.0 * n * n * n;
    printf("bench:sgemm_peak core:%s m:%d n:%d k:%d threads:%d reps:%d gflops_best:%.1f gflops_mean:%.1f\n",
           gemm_blas_core(), n, n, n, threads, reps, flops / best * 1e-9, flops * reps / total * 1e-9);
    free(a), free(b), free(c);
    return 0;
}

/* ---- models ----------------------------------------------------------------- */

static QtStatus build_model(Bench *b, bool cnn, QtError *err) {
    if (!cnn) {
        const LayerSpec mlp[] = {
            {.type = LAYER_DENSE, .name = "fc1", .units = 512}, {.type = LAYER_RELU},
            {.type = LAYER_DENSE, .name = "fc2", .units = 256}, {.type = LAYER_RELU},
            {.type = LAYER_DENSE, .name = "head", .units = N_CLASSES},
        };
        b->x_ndim = 2;
        b->x_shape[1] = 784;
        return model_init(&b->model, 1, (const int[]){784}, mlp, (int)(sizeof mlp / sizeof mlp[0]), err);
    }
    const LayerSpec spec[] = {
        {.type = LAYER_CONV2D, .name = "conv1", .out_channels = 32, .kernel = 3, .padding = 1},
        {.type = LAYER_RELU},
        {.type = LAYER_MAXPOOL2D, .kernel = 2},
        {.type = LAYER_CONV2D, .name = "conv2", .out_channels = 64, .kernel = 3, .padding = 1},
        {.type = LAYER_RELU},
        {.type = LAYER_MAXPOOL2D, .kernel = 2},
        {.type = LAYER_FLATTEN},
        {.type = LAYER_DENSE, .name = "fc1", .units = 128},
        {.type = LAYER_RELU},
        {.type = LAYER_DENSE, .name = "head", .units = N_CLASSES},
    };
    b->x_ndim = 4;
    b->x_shape[1] = 1, b->x_shape[2] = 28, b->x_shape[3] = 28;
    return model_init(&b->model, 3, (const int[]){1, 28, 28}, spec, (int)(sizeof spec / sizeof spec[0]), err);
}

/* Synthetic data, generated once: N(0, 1) inputs and uniform labels. The
 * values do not matter for speed, only that they are finite and varied. */
static QtStatus make_data(Bench *b, QtError *err) {
    size_t n_x = (size_t)POOL_BATCHES * b->batch * b->sample_numel, n_y = (size_t)POOL_BATCHES * b->batch;
    b->x_pool = malloc(n_x * sizeof *b->x_pool);
    b->y_pool = malloc(n_y * sizeof *b->y_pool);
    if (!b->x_pool || !b->y_pool)
        return qt_error_set(err, QT_ERR_NOMEM, "%s: cannot allocate %zu synthetic samples", b->name, n_y);
    Rng data = rng_fork(&b->rng, RNG_STREAM_SHUFFLE);
    rng_fill_normal(&data, b->x_pool, n_x, 0.0f, 1.0f);
    for (size_t i = 0; i < n_y; i++) b->y_pool[i] = (int32_t)rng_below(&data, N_CLASSES);
    return QT_OK;
}

static void bench_free(Bench *b) {
    optim_free(&b->opt);
    tape_free(&b->tape);
    arena_free(&b->arena);
    model_free(&b->model);
    free(b->x_pool);
    free(b->y_pool);
}

static QtStatus bench_setup(Bench *b, bool cnn, int batch, QtError *err) {
    memset(b, 0, sizeof *b);
    b->name = cnn ? "cnn" : "mlp";
    b->ref_samples_per_s = cnn ? REF_CNN_SAMPLES_PER_S : REF_MLP_SAMPLES_PER_S;
    b->batch = batch;
    rng_init(&b->rng, 42, RNG_STREAM_INIT);
    if (build_model(b, cnn, err) != QT_OK) return err->status;
    b->x_shape[0] = batch;
    b->sample_numel = 1;
    for (int i = 1; i < b->x_ndim; i++) b->sample_numel *= b->x_shape[i];
    model_init_params(&b->model, &b->rng);
    if (make_data(b, err) != QT_OK) return err->status;

    Param **ptrs = malloc((size_t)b->model.n_params * sizeof *ptrs);
    if (!ptrs) return qt_error_set(err, QT_ERR_NOMEM, "%s: cannot allocate the parameter list", b->name);
    for (int i = 0; i < b->model.n_params; i++) ptrs[i] = &b->model.params[i];
    OptimConfig oc = optim_config_default(OPTIM_ADAMW);
    oc.lr = 1e-3f;
    b->lr = oc.lr;
    QtStatus st = optim_init(&b->opt, &oc, ptrs, b->model.n_params, err);
    free(ptrs); /* optim_init copies what it keeps */
    if (st != QT_OK) return st;

    if (arena_init(&b->arena, ARENA_START_BYTES) != 0)
        return qt_error_set(err, QT_ERR_NOMEM, "%s: cannot allocate the step arena", b->name);
    return tape_init(&b->tape, &b->arena, NULL, err); /* no dropout: no rng needed */
}

/* ---- one training step ----------------------------------------------------- */

/* With ph != NULL, also adds each phase's wall time and its sgemm time (GEMM
 * stats must be on); a handful of clock reads per step. */
static QtStatus train_step(Bench *b, Phases *ph, QtError *err) {
    Tape *t = &b->tape;
    int slot = (int)(b->step++ % POOL_BATCHES);
    float *x = b->x_pool + (size_t)slot * b->batch * b->sample_numel;
    const int32_t *y = b->y_pool + (size_t)slot * b->batch;
    double t0 = ph ? now_s() : 0.0, g0 = ph ? gemm_stats_get().core_seconds : 0.0;

    Var *logits = model_forward(&b->model, t, tape_wrap(t, x, b->x_ndim, b->x_shape));
    Var *loss = nn_softmax_cross_entropy(t, logits, y);
    double t1 = ph ? now_s() : 0.0, g1 = ph ? gemm_stats_get().core_seconds : 0.0;
    QtStatus st = loss ? tape_backward(t, loss) : (tape_ok(t) ? QT_ERR_ARG : t->err.status);
    if (st != QT_OK) {
        qt_error_set(err, st, "%s step %lld: %s", b->name, b->step, tape_ok(t) ? "no loss" : t->err.msg);
        return st;
    }
    b->last_loss = loss->value.data[0];
    double t2 = ph ? now_s() : 0.0, g2 = ph ? gemm_stats_get().core_seconds : 0.0;
    optim_step(&b->opt, b->lr);
    optim_zero_grad(&b->opt);
    double t3 = ph ? now_s() : 0.0;
    tape_reset(t);
    if (ph) {
        double t4 = now_s();
        ph->fwd += t1 - t0, ph->bwd += t2 - t1, ph->optim += t3 - t2, ph->reset += t4 - t3;
        ph->gemm_fwd += g1 - g0, ph->gemm_bwd += g2 - g1;
    }
    return QT_OK;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Steps for `seconds` of wall time with no accounting at all; one clock read
 * per step (tens of ns against milliseconds) for the per-step distribution. */
static QtStatus timed_pass(Bench *b, double seconds, double *step_s, TimedResult *r, QtError *err) {
    double start = now_s(), prev = start, end = start + seconds;
    long long n = 0;
    do {
        if (train_step(b, NULL, err) != QT_OK) return err->status;
        double t = now_s();
        if (n < MAX_STEP_SAMPLES) step_s[n] = t - prev;
        prev = t;
        n++;
    } while (prev < end || n < 3);
    r->steps = n;
    r->seconds = prev - start;
    long long kept = n < MAX_STEP_SAMPLES ? n : MAX_STEP_SAMPLES;
    qsort(step_s, (size_t)kept, sizeof *step_s, cmp_double);
    r->step_ms_min = 1e3 * step_s[0];
    r->step_ms_median = 1e3 * (kept % 2 ? step_s[kept / 2] : 0.5 * (step_s[kept / 2 - 1] + step_s[kept / 2]));
    return QT_OK;
}

/* Steps for `seconds` with GEMM stats and phase timing on. */
static QtStatus stats_pass(Bench *b, double seconds, Phases *ph, long long *steps, double *wall, GemmStats *gs,
                           QtError *err) {
    *ph = (Phases){0};
    gemm_stats_reset();
    gemm_stats_enable(true);
    double start = now_s(), end = start + seconds, t;
    long long n = 0;
    QtStatus st = QT_OK;
    do {
        st = train_step(b, ph, err);
        n++;
        t = now_s();
    } while (st == QT_OK && (t < end || n < 3));
    gemm_stats_enable(false);
    *gs = gemm_stats_get();
    *steps = n;
    *wall = t - start;
    return st;
}

/* ---- reporting --------------------------------------------------------------- */

static void report_phases(const Bench *b, const Phases *ph, long long steps, double wall, const GemmStats *gs) {
    const double ms = 1e3 / (double)steps;
    double other = wall - ph->fwd - ph->bwd - ph->optim - ph->reset;
    printf("bench:train_phases model:%s steps:%lld step_ms:%.3f fwd_ms:%.3f fwd_gemm_ms:%.3f bwd_ms:%.3f "
           "bwd_gemm_ms:%.3f optim_ms:%.3f reset_ms:%.3f loop_ms:%.3f\n",
           b->name, steps, wall * ms, ph->fwd * ms, ph->gemm_fwd * ms, ph->bwd * ms,
           ph->gemm_bwd * ms,
           ph->optim * ms, ph->reset * ms, other * ms);
    printf("bench:train_gemm model:%s calls_per_step:%.1f gemm_ms_per_step:%.3f non_gemm_ms_per_step:%.3f "
           "gemm_flops_per_sample:%.4g\n",
           b->name, (double)gs->calls / (double)steps, gs->core_seconds * ms, (wall - gs->core_seconds) * ms,
           gs->flops / ((double)steps * b->batch));
}

static void report(const Bench *b, const Args *a, const TimedResult *r, const Phases *ph, long long s_steps,
                   double s_wall, const GemmStats *gs, size_t grow_warm, size_t grow_end) {
    double sps = (double)r->steps * b->batch / r->seconds;
    double share = gs->core_seconds / s_wall;
    double gemm_gflops = gs->core_seconds > 0 ? gs->flops / gs->core_seconds * 1e-9 : 0.0;
    double fwd_flops = model_forward_flops(&b->model), train_flops = 3.0 * fwd_flops;
    printf("bench:train model:%s batch:%d threads:%d samples_per_s:%.1f step_ms:%.3f gemm_share:%.3f "
           "gemm_gflops:%.1f\n",
           b->name, b->batch, a->threads, sps, 1e3 * r->seconds / (double)r->steps, share, gemm_gflops);
    printf("bench:train_steps model:%s steps:%lld seconds:%.3f step_ms_median:%.3f step_ms_min:%.3f "
           "final_loss:%.4f\n",
           b->name, r->steps, r->seconds, r->step_ms_median, r->step_ms_min, (double)b->last_loss);
    printf("bench:train_flops model:%s fwd_flops_per_sample:%.4g train_flops_per_sample_est:%.4g "
           "model_gflops:%.1f\n",
           b->name, fwd_flops, train_flops, train_flops * sps * 1e-9);
    report_phases(b, ph, s_steps, s_wall, gs);
    printf("bench:train_mem model:%s params:%zu param_bytes:%zu optim_state_bytes:%zu arena_bytes:%zu "
           "arena_high_water:%zu tape_nodes:%zu grow_count_after_warmup:%zu grow_count_end:%zu grow_stable:%s\n",
           b->name, model_param_count(&b->model, false), model_param_bytes(&b->model), optim_state_bytes(&b->opt),
           arena_capacity(&b->arena), b->arena.high_water, b->tape.cap_nodes, grow_warm, grow_end,
           grow_warm == grow_end ? "yes" : "no");
    if (grow_warm != grow_end)
        printf("  WARNING: the step arena grew after warm-up: the steady state is not malloc-free\n");
    /* The reference was taken at batch 128 on 2 threads; say so when this run differs. */
    bool same_setup = b->batch == 128 && a->threads == 2;
    printf("bench:train_ref model:%s ref_samples_per_s:%.0f ratio_ours_over_ref:%.2f same_batch_threads:%s "
           "note:reference_figure_from_elsewhere_not_measured_in_this_run\n",
           b->name, b->ref_samples_per_s, sps / b->ref_samples_per_s, same_setup ? "yes" : "no");
}

/* ---- driver ------------------------------------------------------------------ */

static int run_model(bool cnn, const Args *a, double *step_s) {
    Bench b;
    QtError err = {0};
    QtStatus st = bench_setup(&b, cnn, a->batch, &err);
    if (st == QT_OK) {
        printf("\n-- %s: batch %d, AdamW lr %g, %d warm-up steps, %.1f s timed + %.1f s with GEMM stats\n", b.name,
               a->batch, (double)b.lr, a->warmup, a->seconds, a->seconds / 2);
        model_print(&b.model, stdout);
    }
    for (int i = 0; st == QT_OK && i < a->warmup; i++) st = train_step(&b, NULL, &err);
    size_t grow_warm = b.arena.grow_count;
    TimedResult r = {0};
    Phases ph = {0};
    GemmStats gs = {0};
    long long s_steps = 0;
    double s_wall = 0.0;
    if (st == QT_OK) st = timed_pass(&b, a->seconds, step_s, &r, &err);
    if (st == QT_OK) st = stats_pass(&b, a->seconds / 2, &ph, &s_steps, &s_wall, &gs, &err);
    if (st == QT_OK) report(&b, a, &r, &ph, s_steps, s_wall, &gs, grow_warm, b.arena.grow_count);
    else fprintf(stderr, "bench_train: %s: %s: %s\n", cnn ? "cnn" : "mlp", qt_status_name(st), err.msg);
    bench_free(&b);
    return st == QT_OK ? 0 : -1;
}

int main(int argc, char **argv) {
    gemm_blas_upgrade_and_exec(argv);
    Args a;
    int pa = parse_args(argc, argv, &a);
    if (pa != 0) return pa > 0 ? 0 : 2;
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines appear as they are measured, even into a pipe */
    gemm_set_threads(a.threads);
    printf("bench_train: steady-state training step time, synthetic data, softmax cross-entropy + AdamW\n"
           "  threads %d (OpenBLAS reports %d), batch %d; greppable lines start with 'bench:'\n",
           a.threads, gemm_get_threads(), a.batch);
    printf("  train_flops_per_sample_est = 3 x model_forward_flops (dense+conv multiply-adds only)\n");
    printf("  reference figures (PyTorch 1.13, batch 128, 2 threads, from elsewhere, NOT measured in this run):\n"
           "    mlp ~%.0f samples/s, cnn ~%.0f samples/s\n",
           REF_MLP_SAMPLES_PER_S, REF_CNN_SAMPLES_PER_S);
    if (a.peak && peak_probe(a.threads) != 0) return 1;
    double *step_s = malloc(MAX_STEP_SAMPLES * sizeof *step_s);
    if (!step_s) {
        fprintf(stderr, "bench_train: out of memory\n");
        return 1;
    }
    int rc = 0;
    if (a.run_mlp && run_model(false, &a, step_s) != 0) rc = 1;
    if (a.run_cnn && run_model(true, &a, step_s) != 0) rc = 1;
    free(step_s);
    return rc;
}
