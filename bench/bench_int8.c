/* bench_int8.c - int8 inference: the integer GEMM kernels and the PTQ int8
 * forward of the two reference models.
 *
 * 1. Kernels, one thread: the dense u8 x s8 kernel (float epilogue) on the
 *    MLP's and the CNN's dense shapes, and qgemm_s8 (quantized training) on
 *    a dense and an im2col shape, AVX-512 VNNI against the portable C.
 * 2. Layers: one quantized layer's int8 forward (quantizing the input,
 *    building the conv planes, the kernel, the epilogue) for every dense and
 *    conv layer of the two models at the batch size, on --threads threads.
 * 3. End to end: PTQ int8 inference (eval, forward only) of the MLP
 *    784-512-256-10 and the CNN at the batch size: int8 weights per output
 *    channel, static int8 input ranges (int8 for the first layer, uint8 with
 *    a zero point after a ReLU) calibrated on 4 batches, on the int8 path;
 *    the same model on the fake-quantized float path and the float model for
 *    comparison. Synthetic N(0, 1) data and random weights: speed only.
 *
 * Greppable lines start with "bench:"; see bench/README.md. Exits non-zero
 * only on an error, never because a result is slow. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/arena.h"
#include "nn/gemm.h"
#include "nn/model.h"
#include "base/parallel.h"
#include "base/rng.h"
#include "nn/tape.h"
#include "quant/qgemm.h"
#include "quant/qlayer.h"
#include "quant/fqt.h"

#define POOL_BATCHES 8
#define CALIB_BATCHES 4
/* PyTorch 1.13 oneDNN int8 inference at batch 128, 2 threads, on this kind of machine. Not measured here. */
#define REF_MLP_SAMPLES_PER_S 175000.0
#define REF_CNN_SAMPLES_PER_S 50000.0

typedef struct {
    int threads, batch;
    double seconds;
    bool run_mlp, run_cnn, kernels;
} Args;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Best seconds of one fn(ctx) call, repeated for about `seconds` (at least 3 calls). */
static double best_of(void (*fn)(void *), void *ctx, double seconds) {
    fn(ctx); /* warm the caches and the workers */
    double best = 1e30, end = now_s() + seconds;
    for (int n = 0; n < 3 || now_s() < end; n++) {
        double t0 = now_s();
        fn(ctx);
        double dt = now_s() - t0;
        best = dt < best ? dt : best;
    }
    return best;
}

/* ---- 1. kernels ------------------------------------------------------------------------------------------------ */

typedef struct {
    QGemmDense d;
    const int8_t *a, *b; /* qgemm_s8 */
    int32_t *c;
    int M, N, K;
} KernelJob;

static void run_dense(void *ctx) {
    KernelJob *j = ctx;
    qgemm_dense(&j->d, 0, j->d.m, 0, j->d.b->panels);
}

static void run_s8(void *ctx) {
    KernelJob *j = ctx;
    qgemm_s8(j->c, j->a, j->b, j->M, j->N, j->K);
}

static void run_s8_nn(void *ctx) {
    KernelJob *j = ctx;
    qgemm_s8_nn(j->c, j->N, j->a, j->b, j->N, j->M, j->N, j->K);
}

/* Which operand holds X's codes when they are >= 0, as QT's are after a ReLU (the AVX2 kernels multiply those as
 * unsigned bytes): none (conv1's input, the normalized image), a or b. */
enum { QT_X_SIGNED, QT_X_A, QT_X_B };

/* Quantized training's products on every int8 family this CPU runs, one thread: nn (b as K x N, the conv
 * forward's W X^T) or nt (qgemm_s8: the weight gradient X^T g, a dense forward). */
static int qt_shape(const char *layer, bool nn, int M, int N, int K, int x_side, double seconds) {
    size_t na = (size_t)M * K, nb = (size_t)N * K;
    int8_t *a = malloc(na), *b = malloc(nb);
    int32_t *c = malloc((size_t)M * N * sizeof *c);
    if (!a || !b || !c) {
        free(a), free(b), free(c);
        return -1;
    }
    Rng r;
    rng_init(&r, 9, 1);
    for (size_t i = 0; i < na; i++) a[i] = (int8_t)(rng_below(&r, 256) - 128);
    for (size_t i = 0; i < nb; i++) b[i] = (int8_t)(rng_below(&r, 256) - 128);
    if (x_side == QT_X_A)
        for (size_t i = 0; i < na; i++) a[i] = (int8_t)(a[i] & 0x7f);
    if (x_side == QT_X_B)
        for (size_t i = 0; i < nb; i++) b[i] = (int8_t)(b[i] & 0x7f);
    KernelJob j = {.a = a, .b = b, .c = c, .M = M, .N = N, .K = K};
    static const char *const NAMES[] = {"portable", "avx2", "avxvnni", "vnni", "amx"}; /* by QGemmIsa */
    printf("bench:qt_kernel model:cnn layer:%s kernel:%s m:%d n:%d k:%d x_codes:%s threads:1", layer,
           nn ? "s8s8_nn" : "s8s8", M, N, K, x_side == QT_X_SIGNED ? "signed" : "nonneg");
    const double ops = 2.0 * M * N * K;
    for (int isa = QGEMM_ISA_PORTABLE; isa <= QGEMM_ISA_AMX; isa++) {
        if (!qgemm_cpu_has_isa((QGemmIsa)isa)) continue;
        qgemm_force_isa = isa;
        double sec = best_of(nn ? run_s8_nn : run_s8, &j, isa == QGEMM_ISA_PORTABLE ? seconds / 4 : seconds);
        printf(" %s_gops:%.1f", NAMES[isa], ops / sec * 1e-9);
    }
    qgemm_force_isa = -1;
    printf("\n");
    free(a), free(b), free(c);
    return 0;
}

/* GOPS (2 M N K per second) fast and portable; returns -1 on an allocation failure. */
static int kernel_shape(const char *model, const char *layer, bool s8, int M, int N, int K, double seconds) {
    size_t na = (size_t)M * K, nb = (size_t)N * K;
    uint8_t *a = malloc(na);
    int8_t *b = malloc(nb);
    float *c = malloc((size_t)M * N * sizeof *c), *scale = malloc((size_t)N * sizeof *scale);
    if (!a || !b || !c || !scale) {
        free(a), free(b), free(c), free(scale);
        return -1;
    }
    Rng r;
    rng_init(&r, 7, 1);
    for (size_t i = 0; i < na; i++) a[i] = (uint8_t)rng_below(&r, 256);
    for (size_t i = 0; i < nb; i++) b[i] = (int8_t)(rng_below(&r, 256) - 128);
    for (int j = 0; j < N; j++) scale[j] = 1e-4f;
    QGemmPackedB p = {0};
    KernelJob j = {.a = (const int8_t *)a, .b = b, .c = (int32_t *)c, .M = M, .N = N, .K = K};
    int rc = 0;
    if (!s8) {
        if (qgemm_pack_b(&p, b, N, K, NULL) != QT_OK) rc = -1;
        j.d = (QGemmDense){.a = a, .lda = K, .m = M, .a_zero = 3, .b = &p, .c_f32 = c, .ldc = N, .scale = scale};
    }
    double sec[2] = {0, 0};
    for (int port = 0; rc == 0 && port < 2; port++) {
        qgemm_force_portable = port;
        sec[port] = best_of(s8 ? run_s8 : run_dense, &j, port ? seconds / 4 : seconds);
    }
    qgemm_force_portable = false;
    if (rc == 0) {
        double ops = 2.0 * M * N * K;
        printf("bench:int8_kernel model:%s layer:%s kernel:%s m:%d n:%d k:%d threads:1 gops:%.1f portable_gops:%.1f "
               "speedup:%.1f\n", model, layer, s8 ? "s8s8" : "u8s8", M, N, K, ops / sec[0] * 1e-9,
               ops / sec[1] * 1e-9, sec[1] / sec[0]);
    }
    qgemm_packed_b_free(&p);
    free(a), free(b), free(c), free(scale);
    return rc;
}

static int bench_kernels(const Args *a) {
    const int B = a->batch;
    const double s = a->seconds / 4;
    int rc = 0;
    rc |= kernel_shape("mlp", "fc1", false, B, 512, 784, s);
    rc |= kernel_shape("mlp", "fc2", false, B, 256, 512, s);
    rc |= kernel_shape("mlp", "head", false, B, 10, 256, s);
    rc |= kernel_shape("cnn", "fc1", false, B, 128, 3136, s);
    rc |= kernel_shape("cnn", "head", false, B, 10, 128, s);
    rc |= kernel_shape("mlp", "fc1", true, B, 512, 784, s);
    rc |= kernel_shape("cnn", "conv2_im2col", true, B * 196, 64, 288, s);
    /* QT's CNN step (bench/configs/cnn-qt.yaml): each layer's forward and weight-gradient products */
    rc |= qt_shape("conv1_forward", true, 32, B * 784 < 65536 ? B * 784 : 65536, 9, QT_X_SIGNED, s);
    rc |= qt_shape("conv2_forward", true, 64, B * 196, 288, QT_X_B, s);
    rc |= qt_shape("fc1_forward", false, B, 128, 3136, QT_X_A, s);
    rc |= qt_shape("conv1_dw", false, 9, 32, B * 784 < 65536 ? B * 784 : 65536, QT_X_SIGNED, s);
    rc |= qt_shape("conv2_dw", false, 288, 64, B * 196, QT_X_A, s);
    rc |= qt_shape("fc1_dw", false, 3136, 128, B, QT_X_A, s);
    return rc;
}

/* ---- models ---------------------------------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    double ref;
    Model model;
    QLayer q[4];
    int n_q;
    int x_ndim, x_shape[4], sample;
    float *pool; /* [POOL_BATCHES][batch][sample] */
    Arena arena;
    Tape tape;
} Net;

static QtStatus net_build(Net *n, bool cnn, int batch, QtError *err) {
    memset(n, 0, sizeof *n);
    static const LayerSpec MLP[] = {
        {.type = LAYER_DENSE, .name = "fc1", .units = 512}, {.type = LAYER_RELU},
        {.type = LAYER_DENSE, .name = "fc2", .units = 256}, {.type = LAYER_RELU},
        {.type = LAYER_DENSE, .name = "head", .units = 10},
    };
    static const LayerSpec CNN[] = {
        {.type = LAYER_CONV2D, .name = "conv1", .out_channels = 32, .kernel = 3, .padding = 1},
        {.type = LAYER_RELU}, {.type = LAYER_MAXPOOL2D, .kernel = 2},
        {.type = LAYER_CONV2D, .name = "conv2", .out_channels = 64, .kernel = 3, .padding = 1},
        {.type = LAYER_RELU}, {.type = LAYER_MAXPOOL2D, .kernel = 2}, {.type = LAYER_FLATTEN},
        {.type = LAYER_DENSE, .name = "fc1", .units = 128}, {.type = LAYER_RELU},
        {.type = LAYER_DENSE, .name = "head", .units = 10},
    };
    n->name = cnn ? "cnn" : "mlp";
    n->ref = cnn ? REF_CNN_SAMPLES_PER_S : REF_MLP_SAMPLES_PER_S;
    n->x_ndim = cnn ? 4 : 2;
    n->x_shape[0] = batch;
    if (cnn) n->x_shape[1] = 1, n->x_shape[2] = 28, n->x_shape[3] = 28;
    else n->x_shape[1] = 784;
    n->sample = 784;
    QtStatus st = cnn ? model_init(&n->model, 3, (const int[]){1, 28, 28}, CNN, 10, err)
                      : model_init(&n->model, 1, (const int[]){784}, MLP, 5, err);
    if (st != QT_OK) return st;
    Rng r;
    rng_init(&r, 42, RNG_STREAM_INIT);
    model_init_params(&n->model, &r);
    n->pool = malloc((size_t)POOL_BATCHES * batch * n->sample * sizeof *n->pool);
    if (!n->pool || arena_init(&n->arena, 1u << 20) != 0)
        return qt_error_set(err, QT_ERR_NOMEM, "%s: out of memory for the data pool or the arena", n->name);
    rng_fill_normal(&r, n->pool, (size_t)POOL_BATCHES * batch * n->sample, 0.0f, 1.0f);
    st = tape_init(&n->tape, &n->arena, NULL, err);
    n->tape.grad_enabled = false, n->tape.training = false;
    return st;
}

/* Quantizes every dense / conv2d module: int8 weights per channel, int8 input for the first, uint8 asymmetric
 * after a ReLU. */
static QtStatus net_quantize(Net *n, QtError *err) {
    for (int i = 0; i < n->model.n_modules; i++) {
        Module *m = &n->model.modules[i];
        if (m->spec.type != LAYER_DENSE && m->spec.type != LAYER_CONV2D) continue;
        QLayerSpec s = qlayer_spec_default();
        QtError e = {0};
        s.weight_qtype = qtype_find("int8", &e);
        s.act_qtype = qtype_find(n->n_q == 0 ? "int8" : "uint8", &e);
        s.act_symmetric = n->n_q == 0;
        if (n->n_q > 0) s.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
        QLayer *q = &n->q[n->n_q++];
        QtStatus st = qlayer_init_quantize(q, m, &s, m->weight->var.value.data, err);
        if (st != QT_OK) return st;
        param_release(m->weight);
        qlayer_install(q);
    }
    return QT_OK;
}

static void net_free(Net *n) {
    for (int i = 0; i < n->n_q; i++) qlayer_free(&n->q[i]);
    tape_free(&n->tape);
    arena_free(&n->arena);
    model_free(&n->model);
    free(n->pool);
}

static long long g_batches;

static bool net_forward(Net *n) {
    float *x = n->pool + (size_t)(g_batches++ % POOL_BATCHES) * n->x_shape[0] * n->sample;
    tape_reset(&n->tape);
    return model_forward(&n->model, &n->tape, tape_wrap(&n->tape, x, n->x_ndim, n->x_shape)) != NULL;
}

static QtStatus net_calibrate(Net *n, QtError *err) {
    for (int i = 0; i < n->n_q; i++) qlayer_calib_begin(&n->q[i]);
    for (int b = 0; b < CALIB_BATCHES; b++)
        if (!net_forward(n)) return qt_error_set(err, n->tape.err.status, "%s", n->tape.err.msg);
    for (int i = 0; i < n->n_q; i++)
        if (qlayer_calib_end(&n->q[i], err) != QT_OK) return err->status;
    return QT_OK;
}

/* Samples per second of eval forwards for `seconds` after 5 warm-up batches; best batch time in *best_ms. */
static double net_rate(Net *n, double seconds, double *best_ms) {
    for (int i = 0; i < 5; i++)
        if (!net_forward(n)) return -1.0;
    double start = now_s(), prev = start, best = 1e30;
    long long k = 0;
    do {
        if (!net_forward(n)) return -1.0;
        double t = now_s();
        best = t - prev < best ? t - prev : best;
        prev = t, k++;
    } while (prev < start + seconds || k < 3);
    *best_ms = 1e3 * best;
    return (double)k * n->x_shape[0] / (prev - start);
}

/* ---- 2. layers ------------------------------------------------------------------------------------------------- */

typedef struct {
    Net *n;
    QLayer *q;
    float *x;     /* the layer's input, a copy */
    int ndim, shape[4];
} LayerJob;

static void run_layer(void *ctx) {
    LayerJob *j = ctx;
    Tape *t = &j->n->tape;
    tape_reset(t);
    qlayer_forward(t, j->q, tape_wrap(t, j->x, j->ndim, j->shape));
}

/* One layer's int8 forward on its calibrated input (captured from a model forward), fast and portable. */
static int bench_layer(Net *n, QLayer *q, const Args *a) {
    Module *m = q->module;
    tape_reset(&n->tape);
    /* The modules before m, unfused, each on the outputs it reads; then m's input. */
    Var **outs = n->model.outs;
    outs[0] = tape_wrap(&n->tape, n->pool, n->x_ndim, n->x_shape);
    const int mi = (int)(m - n->model.modules);
    for (int k = 0; k < mi; k++)
        if (!model_step(&n->model, &n->tape, k, outs)) return -1;
    Var *x = outs[1 + m->inputs[0]];
    if (!x) return -1;
    LayerJob j = {.n = n, .q = q, .ndim = x->value.ndim};
    memcpy(j.shape, x->value.shape, sizeof j.shape);
    size_t nx = var_numel(x);
    if (!(j.x = malloc(nx * sizeof *j.x))) return -1;
    memcpy(j.x, x->value.data, nx * sizeof *j.x);
    double macs = (double)n->x_shape[0] * q->out * q->fan_in;
    if (m->spec.type == LAYER_CONV2D) macs *= (double)m->out_shape[1] * m->out_shape[2];
    double sec[2];
    for (int port = 0; port < 2; port++) {
        qgemm_force_portable = port;
        sec[port] = best_of(run_layer, &j, port ? a->seconds / 8 : a->seconds / 4);
    }
    qgemm_force_portable = false;
    int ok = tape_ok(&n->tape) ? 0 : -1;
    printf("bench:int8_layer model:%s layer:%s batch:%d threads:%d ms:%.3f gops:%.1f portable_ms:%.3f "
           "portable_gops:%.1f\n", n->name, m->path, n->x_shape[0], gemm_get_threads(), 1e3 * sec[0],
           2.0 * macs / sec[0] * 1e-9, 1e3 * sec[1], 2.0 * macs / sec[1] * 1e-9);
    free(j.x);
    return ok;
}

/* ---- 3. end to end --------------------------------------------------------------------------------------------- */

/* Time spent in each module: a hook around its own forward (or its quantized layer's). */
typedef struct {
    ModuleForwardFn inner; /* NULL: the module's own op */
    void *inner_ctx;
    double seconds;
} ModuleTimer;

static Var *timed_hook(Tape *t, Module *m, Var *x, void *ctx) {
    ModuleTimer *mt = ctx;
    double t0 = now_s();
    Var *y = mt->inner ? mt->inner(t, m, x, mt->inner_ctx) : model_module_forward(t, m, x);
    mt->seconds += now_s() - t0;
    return y;
}

/* A line of milliseconds per batch in each module, and the share of the quantized ones. */
static int time_modules(Net *n, const Args *a) {
    const int nm = n->model.n_modules;
    ModuleTimer *mt = calloc((size_t)nm, sizeof *mt);
    if (!mt) return -1;
    for (int i = 0; i < nm; i++) {
        Module *m = &n->model.modules[i];
        mt[i] = (ModuleTimer){.inner = m->forward_hook, .inner_ctx = m->hook_ctx};
        m->forward_hook = timed_hook, m->hook_ctx = &mt[i];
    }
    long long b0 = g_batches;
    double best_ms, t0 = now_s();
    double rate = net_rate(n, a->seconds / 2, &best_ms);
    double wall = now_s() - t0, in_q = 0, batches = (double)(g_batches - b0);
    printf("bench:int8_split model:%s samples_per_s:%.0f", n->name, rate);
    for (int i = 0; i < nm; i++) {
        Module *m = &n->model.modules[i];
        if (mt[i].inner) in_q += mt[i].seconds;
        printf(" %s_ms:%.3f", m->path, 1e3 * mt[i].seconds / batches);
        m->forward_hook = mt[i].inner, m->hook_ctx = mt[i].inner_ctx;
    }
    printf(" int8_layer_share:%.3f\n", in_q / wall);
    free(mt);
    return rate > 0 ? 0 : -1;
}

static int run_model(bool cnn, const Args *a) {
    Net n;
    QtError err = {0};
    QtStatus st = net_build(&n, cnn, a->batch, &err);
    /* the float model first */
    double best_ms = 0, float_rate = st == QT_OK ? net_rate(&n, a->seconds / 2, &best_ms) : -1;
    if (st == QT_OK) st = net_quantize(&n, &err);
    if (st == QT_OK) st = net_calibrate(&n, &err);
    if (st != QT_OK) {
        fprintf(stderr, "bench_int8: %s: %s\n", n.name, err.msg);
        net_free(&n);
        return 1;
    }
    qlayer_int8_disable = true;
    double fq_rate = net_rate(&n, a->seconds / 2, &best_ms);
    qlayer_int8_disable = false;
    qgemm_force_portable = true;
    double port_rate = net_rate(&n, a->seconds / 4, &best_ms);
    qgemm_force_portable = false;
    double rate = net_rate(&n, a->seconds, &best_ms);
    int rc = rate > 0 && fq_rate > 0 && port_rate > 0 && float_rate > 0 ? 0 : 1;
    printf("bench:int8_e2e model:%s batch:%d threads:%d kernel:%s samples_per_s:%.0f batch_ms_best:%.3f "
           "portable_samples_per_s:%.0f fakequant_samples_per_s:%.0f float_samples_per_s:%.0f\n", n.name, a->batch,
           gemm_get_threads(), qgemm_kernel_name(), rate, best_ms, port_rate, fq_rate, float_rate);
    printf("bench:int8_ref model:%s ref_samples_per_s:%.0f ratio_ours_over_ref:%.2f same_batch_threads:%s\n", n.name,
           n.ref, rate / n.ref, a->batch == 128 && gemm_get_threads() == 2 ? "yes" : "no");
    /* where the time goes: the quantized layers against the rest (activations, pooling, copies) */
    if (rc == 0 && time_modules(&n, a) != 0) rc = 1;
    for (int i = 0; rc == 0 && i < n.n_q; i++) rc = bench_layer(&n, &n.q[i], a) ? 1 : 0;
    if (rc) fprintf(stderr, "bench_int8: %s: a forward failed: %s\n", n.name, n.tape.err.msg);
    net_free(&n);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------------------------ */

static void usage(FILE *out) {
    fprintf(out, "usage: bench_int8 [--threads N] [--batch B] [--seconds S] [--model mlp|cnn|all] [--no-kernels]\n"
                 "defaults: --threads 2 --batch 128 --seconds 2 --model all\n");
}

static int parse_args(int argc, char **argv, Args *a) {
    *a = (Args){.threads = 2, .batch = 128, .seconds = 2.0, .run_mlp = true, .run_cnn = true, .kernels = true};
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        bool ok = val != NULL;
        errno = 0;
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            usage(stdout);
            return 1;
        } else if (!strcmp(opt, "--no-kernels")) {
            a->kernels = false;
            continue;
        } else if (ok && !strcmp(opt, "--threads")) {
            a->threads = (int)strtol(val, &end, 10);
            ok = !*end && !errno && a->threads >= 1 && a->threads <= PARALLEL_MAX_THREADS;
        } else if (ok && !strcmp(opt, "--batch")) {
            a->batch = (int)strtol(val, &end, 10);
            ok = !*end && !errno && a->batch >= 1 && a->batch <= 4096;
        } else if (ok && !strcmp(opt, "--seconds")) {
            a->seconds = strtod(val, &end);
            ok = !*end && !errno && a->seconds > 0.0 && a->seconds <= 600.0;
        } else if (ok && !strcmp(opt, "--model")) {
            a->run_mlp = !strcmp(val, "mlp") || !strcmp(val, "all");
            a->run_cnn = !strcmp(val, "cnn") || !strcmp(val, "all");
            ok = a->run_mlp || a->run_cnn;
        } else {
            ok = false;
        }
        if (!ok) {
            fprintf(stderr, "bench_int8: bad or incomplete option '%s%s%s'\n", opt, val ? " " : "", val ? val : "");
            usage(stderr);
            return -1;
        }
        i++;
    }
    return 0;
}

int main(int argc, char **argv) {
    gemm_blas_upgrade_and_exec(argv); /* the float baselines get OpenBLAS's best kernels, as bench_train's do */
    Args a;
    int pa = parse_args(argc, argv, &a);
    if (pa != 0) return pa > 0 ? 0 : 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    gemm_set_threads(a.threads);
    gemm_set_threads(a.threads);
    printf("bench_int8: int8 GEMM kernels and PTQ int8 inference (eval, forward only), synthetic data\n"
           "  kernels: %s (CPU has AVX-512 VNNI: %s); threads %d, batch %d; greppable lines start with 'bench:'\n"
           "  reference (PyTorch 1.13 oneDNN int8, batch 128, 2 threads, from elsewhere, NOT measured here):\n"
           "    mlp ~%.0f samples/s, cnn ~%.0f samples/s\n",
           qgemm_kernel_name(), qgemm_cpu_has_vnni() ? "yes" : "no", a.threads, a.batch, REF_MLP_SAMPLES_PER_S,
           REF_CNN_SAMPLES_PER_S);
    int rc = 0;
    if (a.kernels && bench_kernels(&a) != 0) {
        fprintf(stderr, "bench_int8: out of memory for the kernel shapes\n");
        rc = 1;
    }
    if (a.run_mlp && run_model(false, &a) != 0) rc = 1;
    if (a.run_cnn && run_model(true, &a) != 0) rc = 1;
    return rc;
}
