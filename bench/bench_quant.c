/* bench_quant.c - quantize and dequantize throughput of QArray.
 *
 * For a 1024 x 1024 float32 weight (4 MiB) in the layouts PTQ and QLoRA use,
 * prints GB/s of float input for qarray_quantize and qarray_dequantize next
 * to memcpy of the same 4 MiB on the same machine, so the figures can be read
 * as "how many memcpys is a quantize". Single thread. Timings only: nothing
 * here is a test.
 *
 *   bench_quant [--seconds S]   time per measurement (default 0.5) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/rng.h"
#include "quant/qarray.h"

#define ROWS 1024
#define COLS 1024
#define NUMEL ((size_t)ROWS * COLS)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    const char *label;
    const char *qtype;
    int channelwise_axis;   /* -1: none */
    int tile;               /* along axis 1; 0: none */
    bool double_quant;
} Case;

/* Runs fn until `seconds` have passed (at least 3 times); returns the best
 * time of one call, the least disturbed by other work on a shared machine. */
typedef void (*BenchFn)(void *ctx);
static double best_time(BenchFn fn, void *ctx, double seconds) {
    double best = 1e30, start = now_s();
    for (int i = 0; i < 3 || now_s() - start < seconds; i++) {
        double t0 = now_s();
        fn(ctx);
        double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    return best;
}

typedef struct {
    const float *x;
    float *y;
    const QType *t;
    QArrayOptions opt;
    QArray q;
    int failed;
} Ctx;

static void run_memcpy(void *p) {
    Ctx *c = p;
    memcpy(c->y, c->x, NUMEL * sizeof(float));
}

static void run_quantize(void *p) {
    Ctx *c = p;
    QtError err = {0};
    qarray_free(&c->q);
    if (qarray_quantize(&c->q, c->x, 2, (int[]){ROWS, COLS}, c->t, &c->opt, &err) != QT_OK) {
        if (!c->failed) fprintf(stderr, "bench_quant: %s\n", err.msg);
        c->failed = 1;
    }
}

static void run_dequantize(void *p) {
    Ctx *c = p;
    qarray_dequantize(&c->q, c->y);
}

int main(int argc, char **argv) {
    double seconds = 0.5;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) seconds = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_quant [--seconds S]\n");
            return 2;
        }
    }
    float *x = malloc(NUMEL * sizeof(float)), *y = malloc(NUMEL * sizeof(float));
    if (!x || !y) return 1;
    Rng rng;
    rng_init(&rng, 1, RNG_STREAM_INIT);
    rng_fill_normal(&rng, x, NUMEL, 0.0f, 1.0f);

    Ctx c = {.x = x, .y = y};
    double gb = (double)(NUMEL * sizeof(float)) / 1e9;
    double t_copy = best_time(run_memcpy, &c, seconds);
    printf("quantize/dequantize of a %dx%d float32 weight (%.1f MiB), 1 thread, best of %.1f s each\n", ROWS, COLS,
           gb * 1e9 / (1 << 20), seconds);
    printf("memcpy of the same bytes: %.2f GB/s\n\n", gb / t_copy);
    /* "time / memcpy": how many memcpys of the same bytes one call costs */
    printf("%-28s %11s %13s %12s %14s %10s\n", "layout", "quant GB/s", "dequant GB/s", "quant/memcpy",
           "dequant/memcpy", "bits/elem");

    const Case cases[] = {
        {"int8 per-channel", "int8", 0, 0, false},
        {"int4 block 32", "int4", 0, 32, false},
        {"nf4 block 64 + double quant", "nf4", 0, 64, true},
        {"fp8_e4m3 per-tensor", "fp8_e4m3", -1, 0, false},
    };
    int status = 0;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const Case *cs = &cases[k];
        QtError err = {0};
        memset(&c.opt, 0, sizeof c.opt);
        memset(&c.q, 0, sizeof c.q);
        c.failed = 0;
        c.t = qtype_find(cs->qtype, &err);
        if (!c.t) {
            fprintf(stderr, "bench_quant: %s\n", err.msg);
            return 1;
        }
        if (cs->channelwise_axis >= 0) c.opt.n_channelwise = 1, c.opt.channelwise_axes[0] = cs->channelwise_axis;
        if (cs->tile > 0) c.opt.n_tiled = 1, c.opt.tiled_axes[0] = (QArrayTiledAxis){1, cs->tile};
        c.opt.double_quant = cs->double_quant;
        double tq = best_time(run_quantize, &c, seconds);
        double td = c.failed ? 1e30 : best_time(run_dequantize, &c, seconds);
        if (c.failed) status = 1;
        printf("%-28s %11.2f %13.2f %11.0fx %13.0fx %10.3f\n", cs->label, gb / tq, gb / td, tq / t_copy, td / t_copy,
               c.failed ? 0.0 : qarray_bits_per_element(&c.q));
        qarray_free(&c.q);
    }
    free(x), free(y);
    return status;
}
