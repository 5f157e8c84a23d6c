/* rt_bench.c - the device runtime's hot kernels (device/qtrain_rt.c), one
 * thread, batch 1, in millions of multiply-accumulates per second:
 *
 *   conv2d 32 -> 64, 3x3, padding 1, on 14x14 (im2col path)
 *   conv2d 16 -> 32, 3x3, padding 1, on 28x28
 *   conv2d 64 -> 64, 3x3, padding 1, on 7x7
 *   conv2d  1 -> 16, 3x3, padding 1, on 28x28 (one input channel: the tap path)
 *   depthwise 64 channels, 3x3, padding 1, on 14x14 and stride 2 on 28x28
 *   dense 3136 -> 128, int8 and int4 weights
 *
 * `make bench` runs it twice: build/bench/rt_bench from libqtrain.a (the
 * runtime compiled with the library's flags: the portable path on a generic
 * x86-64) and build/bench/rt_bench_native (the runtime compiled again with
 * -march=native: AVX2 or NEON). Each line names the path it ran:
 *
 *   bench:rt kernel:<name> simd:<path> mmac_per_s:<M> us:<best microseconds per call>
 *
 * Synthetic data; timings only, nothing here is a test.
 *
 *   rt_bench [--seconds S]   time per kernel (default 0.3) */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device/qtrain_rt.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
static int8_t rand_i8(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (int8_t)(rng_state >> 24);
}

static void *fill_i8(size_t n) {
    int8_t *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "rt_bench: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++) p[i] = rand_i8();
    return p;
}

/* Per-channel requantization parameters that keep outputs in range (the values do not change the speed). */
typedef struct {
    int32_t *bias, *mult;
    int8_t *shift;
} Requant;

static Requant requant_new(int n) {
    Requant r = {malloc(sizeof(int32_t) * n), malloc(sizeof(int32_t) * n), malloc((size_t)n)};
    if (!r.bias || !r.mult || !r.shift) exit(1);
    for (int i = 0; i < n; i++) r.bias[i] = (i * 37) % 2000 - 1000, r.mult[i] = 1300000000 + i, r.shift[i] = 40;
    return r;
}

static void requant_free(Requant *r) { free(r->bias), free(r->mult), free(r->shift); }

/* Best seconds of one call, repeated for about `seconds` (at least 5 calls). */
typedef struct {
    const qrt_conv2d_t *conv;
    const qrt_dense_t *dense;
    const int8_t *x;
    int8_t *y;
    void *scratch;
} Call;

static void call_once(const Call *c) {
    if (c->conv)
        qrt_conv2d(c->conv, c->x, c->y, c->scratch);
    else
        qrt_dense(c->dense, c->x, c->y);
}

static double best_of(const Call *c, double seconds) {
    call_once(c);
    double best = 1e30, end = now_s() + seconds;
    for (int n = 0; n < 5 || now_s() < end; n++) {
        double t0 = now_s();
        call_once(c);
        double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    return best;
}

static void report(const char *name, double macs, double t) {
    printf("bench:rt kernel:%s simd:%s mmac_per_s:%.0f us:%.1f\n", name, qrt_simd(), macs / t / 1e6, t * 1e6);
    fflush(stdout);
}

static void bench_conv(const char *name, int in_c, int out_c, int hw, int groups, int stride, double seconds) {
    qrt_conv2d_t p;
    memset(&p, 0, sizeof p);
    p.in_c = in_c, p.out_c = out_c, p.in_h = p.in_w = hw, p.groups = groups;
    p.k_h = p.k_w = 3, p.stride_h = p.stride_w = stride, p.pad_t = p.pad_l = 1, p.dil_h = p.dil_w = 1;
    p.out_h = p.out_w = (hw + 2 - 3) / stride + 1;
    p.w_bits = 8;
    p.in_zp = -5, p.out_zp = -128, p.act_min = -128, p.act_max = 127;
    size_t k = (size_t)(in_c / groups) * 9;
    Requant r = requant_new(out_c);
    void *w = fill_i8((size_t)out_c * k);
    p.weight = w, p.bias = r.bias, p.mult = r.mult, p.shift = r.shift;
    Call c = {&p, NULL, fill_i8((size_t)in_c * hw * hw), malloc((size_t)out_c * p.out_h * p.out_w),
              malloc(qrt_conv2d_scratch(&p))};
    if (!c.y || !c.scratch) exit(1);
    double macs = (double)out_c * p.out_h * p.out_w * (double)k;
    report(name, macs, best_of(&c, seconds));
    free((void *)c.x), free(c.y), free(c.scratch), free(w);
    requant_free(&r);
}

static void bench_dense(const char *name, int in, int out, int w_bits, double seconds) {
    qrt_dense_t p;
    memset(&p, 0, sizeof p);
    p.in = in, p.out = out, p.w_bits = w_bits;
    p.in_zp = -128, p.out_zp = 0, p.act_min = 0, p.act_max = 127;
    Requant r = requant_new(out);
    void *w = fill_i8((size_t)out * in * w_bits / 8);
    p.weight = w, p.bias = r.bias, p.mult = r.mult, p.shift = r.shift;
    Call c = {NULL, &p, fill_i8((size_t)in), malloc((size_t)out), NULL};
    if (!c.y) exit(1);
    report(name, (double)in * out, best_of(&c, seconds));
    free((void *)c.x), free(c.y), free(w);
    requant_free(&r);
}

int main(int argc, char **argv) {
    double seconds = 0.3;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc)
            seconds = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: rt_bench [--seconds S]\n");
            return 2;
        }
    }
    bench_conv("conv3x3_32to64_14x14", 32, 64, 14, 1, 1, seconds);
    bench_conv("conv3x3_16to32_28x28", 16, 32, 28, 1, 1, seconds);
    bench_conv("conv3x3_64to64_7x7", 64, 64, 7, 1, 1, seconds);
    bench_conv("conv3x3_1to16_28x28", 1, 16, 28, 1, 1, seconds);
    bench_conv("dw3x3_64_14x14", 64, 64, 14, 64, 1, seconds);
    bench_conv("dw3x3_64_28x28_s2", 64, 64, 28, 64, 2, seconds);
    bench_dense("dense_3136to128_int8", 3136, 128, 8, seconds);
    bench_dense("dense_3136to128_int4", 3136, 128, 4, seconds);
    return 0;
}
