/* test_calib.c - calibration methods against values worked out in the test:
 * by hand on small arrays, from order statistics or moments of a sample,
 * or by numerically integrating a quantizer's error over a density.
 * Samples come from the Philox RNG, so every run sees the same numbers. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "quant/calib.h"
#include "test_util.h"

/* Parses text and computes the range of x; fails the test on any error. */
static CalibRange range_of(const char *text, const float *x, size_t n, const CalibQuant *q) {
    CalibSpec spec;
    CalibRange r = {NAN, NAN};
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(calib_parse(text, &spec, &err), QT_OK);
    QtStatus st = calib_compute(&spec, x, n, q, NULL, 0, &r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", text, err.msg);
    CU_ASSERT_EQUAL(st, QT_OK);
    return r;
}

static float *normal_sample(uint64_t seed, size_t n, float mean, float std) {
    float *x = malloc(n * sizeof *x);
    CU_ASSERT_PTR_NOT_NULL_FATAL(x);
    Rng g;
    rng_init(&g, seed, RNG_STREAM_INIT);
    rng_fill_normal(&g, x, n, mean, std);
    return x;
}

static float *uniform_sample(uint64_t seed, size_t n, float lo, float hi) {
    float *x = malloc(n * sizeof *x);
    CU_ASSERT_PTR_NOT_NULL_FATAL(x);
    Rng g;
    rng_init(&g, seed, RNG_STREAM_INIT);
    rng_fill_uniform(&g, x, n, lo, hi);
    return x;
}

static float abs_max(const float *x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}

/* ---- simple methods ------------------------------------------------------- */

static void test_absmax_minmax(void) {
    const float x[] = {-3.0f, 1.0f, 2.5f, -0.5f};
    CalibRange r = range_of("absmax", x, 4, NULL);
    CU_ASSERT_EQUAL(r.lo, -3.0f);
    CU_ASSERT_EQUAL(r.hi, 3.0f);
    r = range_of("absmax,0.5", x, 4, NULL);
    CU_ASSERT_EQUAL(r.lo, -1.5f);
    CU_ASSERT_EQUAL(r.hi, 1.5f);
    r = range_of("minmax", x, 4, NULL);
    CU_ASSERT_EQUAL(r.lo, -3.0f);
    CU_ASSERT_EQUAL(r.hi, 2.5f);
    r = range_of("minmax,2", x, 4, NULL);
    CU_ASSERT_EQUAL(r.lo, -6.0f);
    CU_ASSERT_EQUAL(r.hi, 5.0f);
}

static void test_rms_fixed(void) {
    /* sqrt((9 + 16 + 0 + 0) / 4) = 2.5, times s = 2. */
    const float x[] = {3.0f, -4.0f, 0.0f, 0.0f};
    CalibRange r = range_of("rms,2", x, 4, NULL);
    CU_ASSERT_DOUBLE_EQUAL(r.hi, 5.0, 1e-6);
    CU_ASSERT_EQUAL(r.lo, -r.hi);
    /* fixed ignores the data, and needs none. */
    r = range_of("fixed,1.5", x, 4, NULL);
    CU_ASSERT_EQUAL(r.lo, -1.5f);
    CU_ASSERT_EQUAL(r.hi, 1.5f);
    r = range_of("fixed,-1,6", NULL, 0, NULL);
    CU_ASSERT_EQUAL(r.lo, -1.0f);
    CU_ASSERT_EQUAL(r.hi, 6.0f);
}

static void test_percentile_small(void) {
    const float x[] = {5.0f, -1.0f, 3.0f, -7.0f, 2.0f};
    /* |x| sorted: 1 2 3 5 7. p = 90: h = 4 * 0.9 = 3.6, 5 + 0.6 * (7 - 5) = 6.2.
     * p = 50: h = 2 exactly, 3. p = 100: h = 4, the maximum 7.
     * p = 10: h = 0.4, 1 + 0.4 * (2 - 1) = 1.4. */
    CU_ASSERT_DOUBLE_EQUAL(range_of("percentile,90", x, 5, NULL).hi, 6.2, 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(range_of("percentile,50", x, 5, NULL).hi, 3.0, 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(range_of("percentile,100", x, 5, NULL).hi, 7.0, 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(range_of("percentile,10", x, 5, NULL).lo, -1.4, 1e-6);
    /* Asymmetric: x sorted -7 -1 2 3 5. p = 90 at h = 3.6: 3 + 0.6 * 2 = 4.2;
     * p = 10 at h = 0.4: -7 + 0.4 * 6 = -4.6. p = 75 at h = 3: 3; p = 25 at
     * h = 1: -1. p = 25 gives the same pair, ordered. */
    CalibQuant qa = calib_quant_int(8, true);
    CalibRange r = range_of("percentile,90", x, 5, &qa);
    CU_ASSERT_DOUBLE_EQUAL(r.lo, -4.6, 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(r.hi, 4.2, 1e-6);
    r = range_of("percentile,75", x, 5, &qa);
    CU_ASSERT_DOUBLE_EQUAL(r.lo, -1.0, 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(r.hi, 3.0, 1e-6);
    r = range_of("percentile,25", x, 5, &qa);
    CU_ASSERT_DOUBLE_EQUAL(r.lo, -1.0, 1e-6);
    CU_ASSERT_DOUBLE_EQUAL(r.hi, 3.0, 1e-6);
    /* The caller's data is never reordered. */
    CU_ASSERT_EQUAL(x[0], 5.0f);
    CU_ASSERT_EQUAL(x[3], -7.0f);
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Selection must agree with the definition on sorted data, also with many
 * ties (values rounded to a coarse grid) and sizes 1... */
static void test_percentile_vs_sort(void) {
    const size_t sizes[] = {1, 2, 3, 7, 100, 1001};
    const double ps[] = {0.5, 10, 33.3, 50, 90, 99, 99.9, 100};
    Rng g;
    rng_init(&g, 11, RNG_STREAM_INIT);
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        for (int ties = 0; ties < 2; ties++) {
            size_t n = sizes[si];
            float *x = malloc(n * sizeof *x), *sorted = malloc(n * sizeof *x);
            CU_ASSERT_PTR_NOT_NULL_FATAL(x);
            CU_ASSERT_PTR_NOT_NULL_FATAL(sorted);
            rng_fill_normal(&g, x, n, 0.0f, 1.0f);
            if (ties)
                for (size_t i = 0; i < n; i++) x[i] = roundf(x[i] * 2.0f) / 2.0f;
            for (size_t i = 0; i < n; i++) sorted[i] = fabsf(x[i]);
            qsort(sorted, n, sizeof *sorted, cmp_float);
            for (size_t pi = 0; pi < sizeof ps / sizeof ps[0]; pi++) {
                double h = (double)(n - 1) * ps[pi] / 100.0;
                size_t k = (size_t)floor(h);
                double want = k + 1 < n ? sorted[k] + (h - k) * ((double)sorted[k + 1] - sorted[k]) : sorted[k];
                char text[32];
                snprintf(text, sizeof text, "percentile,%g", ps[pi]);
                CU_ASSERT_DOUBLE_EQUAL(range_of(text, x, n, NULL).hi, want, 1e-6 * (1.0 + fabs(want)));
            }
            free(x);
            free(sorted);
        }
    }
}

static void test_percentile_uniform(void) {
    /* |x| of U[-1, 1) is U[0, 1), whose 99th percentile is 0.99. The sample
     * quantile has standard deviation sqrt(p (1 - p) / n) / density =
     * sqrt(0.99 * 0.01 / 1e5) / 1 = 3.1e-4, so 2e-3 is over 6 of those. */
    const size_t n = 100000;
    float *x = uniform_sample(3, n, -1.0f, 1.0f);
    CalibRange r = range_of("percentile,99", x, n, NULL);
    CU_ASSERT_DOUBLE_EQUAL(r.hi, 0.99, 2e-3);
    CU_ASSERT_EQUAL(r.lo, -r.hi);
    free(x);
    /* Asymmetric on U[-1, 3): the 1st and 99th percentiles of x are -0.96 and
     * 2.96; the density is 1/4, so the spread is 4 * 3.1e-4 = 1.3e-3 and
     * 8e-3 is again over 6 of those. */
    x = uniform_sample(4, n, -1.0f, 3.0f);
    CalibQuant qa = calib_quant_int(8, true);
    r = range_of("percentile,99", x, n, &qa);
    CU_ASSERT_DOUBLE_EQUAL(r.lo, -0.96, 8e-3);
    CU_ASSERT_DOUBLE_EQUAL(r.hi, 2.96, 8e-3);
    free(x);
}

static void test_mean_abs(void) {
    /* {-3, 1, -0.5, 1.5}: |x| sums to 6, so t = 1.5, symmetric. */
    const float x[] = {-3.0f, 1.0f, -0.5f, 1.5f};
    CalibRange r = range_of("mean_abs", x, 4, NULL);
    CU_ASSERT_EQUAL(r.hi, 1.5f);
    CU_ASSERT_EQUAL(r.lo, -1.5f);
    /* asymmetric quantizers get the same symmetric range */
    CalibQuant qa = calib_quant_int(8, true);
    CU_ASSERT_EQUAL(range_of("mean_abs", x, 4, &qa).hi, 1.5f);
    /* 0.1 three times and 0.2: the sum in double, (float)(0.5 / 4) */
    const float y[] = {0.1f, -0.1f, 0.1f, -0.2f};
    double sum = (double)0.1f * 3 + (double)0.2f;
    CU_ASSERT_EQUAL(range_of("mean_abs", y, 4, NULL).hi, (float)(sum / 4.0));
}

static void test_3sd(void) {
    /* {1, 2, 3, 4}: mean 2.5, population variance (2.25 + 0.25) * 2 / 4 = 1.25. */
    const float x[] = {1.0f, 2.0f, 3.0f, 4.0f};
    CU_ASSERT_DOUBLE_EQUAL(range_of("3sd", x, 4, NULL).hi, 2.5 + 3.0 * sqrt(1.25), 1e-5);
    /* N(0, 1), n = 1e5: the mean's standard error is 1/sqrt(n) = 3.2e-3 and
     * the std's about 1/sqrt(2n) = 2.2e-3, so |mean| + 3 std is 3 within a
     * spread of sqrt(3.2e-3^2 + (3 * 2.2e-3)^2) = 7.4e-3; 0.03 is 4 of those. */
    const size_t n = 100000;
    float *g = normal_sample(5, n, 0.0f, 1.0f);
    CU_ASSERT_DOUBLE_EQUAL(range_of("3sd", g, n, NULL).hi, 3.0, 0.03);
    free(g);
    /* N(2, 0.5): |2| + 3 * 0.5 = 3.5, spreads half as large. */
    g = normal_sample(6, n, 2.0f, 0.5f);
    CU_ASSERT_DOUBLE_EQUAL(range_of("3sd", g, n, NULL).hi, 3.5, 0.02);
    free(g);
}

/* ---- quantizers ----------------------------------------------------------- */

static void test_quant_int(void) {
    /* int8 over t = 127.5: scale = 127.5 / 127.5 = 1. */
    CalibQuant q8 = calib_quant_int(8, false);
    CU_ASSERT_EQUAL(q8.levels, 128);
    CU_ASSERT_EQUAL(q8.fn(3.4f, -127.5f, 127.5f, &q8), 3.0f);
    CU_ASSERT_EQUAL(q8.fn(2.5f, -127.5f, 127.5f, &q8), 2.0f); /* ties to even */
    CU_ASSERT_EQUAL(q8.fn(-3.5f, -127.5f, 127.5f, &q8), -4.0f);
    CU_ASSERT_EQUAL(q8.fn(200.0f, -127.5f, 127.5f, &q8), 127.0f);
    CU_ASSERT_EQUAL(q8.fn(-200.0f, -127.5f, 127.5f, &q8), -128.0f);
    /* int4 over t = 3.75: scale 0.5, codes -8..7. */
    CalibQuant q4 = calib_quant_int(4, false);
    CU_ASSERT_EQUAL(q4.levels, 8);
    CU_ASSERT_EQUAL(q4.fn(1.3f, -3.75f, 3.75f, &q4), 1.5f);
    CU_ASSERT_EQUAL(q4.fn(9.0f, -3.75f, 3.75f, &q4), 3.5f);
    CU_ASSERT_EQUAL(q4.fn(-9.0f, -3.75f, 3.75f, &q4), -4.0f);
    /* A zero range quantizes with scale 1, never dividing by 0. */
    CU_ASSERT_EQUAL(q8.fn(1.2f, 0.0f, 0.0f, &q8), 1.0f);
    /* uint8 over [0, 255]: scale 1, zero point 0. */
    CalibQuant qa = calib_quant_int(8, true);
    CU_ASSERT(qa.asymmetric);
    CU_ASSERT_EQUAL(qa.fn(3.5f, 0.0f, 255.0f, &qa), 4.0f);
    CU_ASSERT_EQUAL(qa.fn(-1.0f, 0.0f, 255.0f, &qa), 0.0f);
    CU_ASSERT_EQUAL(qa.fn(300.0f, 0.0f, 255.0f, &qa), 255.0f);
    /* [-1, 2] with 2 bits: scale 3/3 = 1, zp = 1, codes 0..3 hold -1..2. A
     * range above 0 is widened to include it: [1, 3] acts as [0, 3]. */
    CalibQuant q2 = calib_quant_int(2, true);
    CU_ASSERT_EQUAL(q2.fn(-1.4f, -1.0f, 2.0f, &q2), -1.0f);
    CU_ASSERT_EQUAL(q2.fn(1.6f, -1.0f, 2.0f, &q2), 2.0f);
    CU_ASSERT_EQUAL(q2.fn(-5.0f, -1.0f, 2.0f, &q2), -1.0f);
    CU_ASSERT_EQUAL(q2.fn(0.4f, 1.0f, 3.0f, &q2), 0.0f);
    /* Outside 2..16 bits there is no round trip. */
    CU_ASSERT_PTR_NULL(calib_quant_int(1, false).fn);
    CU_ASSERT_PTR_NULL(calib_quant_int(17, true).fn);
}

/* ---- mse ------------------------------------------------------------------ */

static void test_mse_uniform(void) {
    /* On U[-A, A] with t < A, int8: clipping costs (A - t)^3 / (3A), rounding
     * (t / 127.5)^2 / 12 * t / A; the derivative vanishes at
     * A - t = t / 255, t = 0.996 A. Grid steps of 0.001 A and sampling
     * leave it within [0.98, 1] * amax. */
    const size_t n = 20000;
    float *x = uniform_sample(7, n, -1.0f, 1.0f);
    CalibQuant q8 = calib_quant_int(8, false);
    float amax = abs_max(x, n);
    CalibRange r = range_of("mse", x, n, &q8);
    CU_ASSERT(r.hi >= 0.98f * amax);
    CU_ASSERT(r.hi <= amax);
    CU_ASSERT_EQUAL(r.lo, -r.hi);
    free(x);
}

/* E[(x - Q_t(x))^2] for x ~ N(0, 1), midpoint rule over [-8, 8]. */
static double gauss_quant_mse(const CalibQuant *q, double t) {
    const double h = 2e-3;
    double sum = 0.0;
    for (double v = -8.0 + h / 2; v < 8.0; v += h) {
        double d = v - q->fn((float)v, (float)-t, (float)t, q);
        sum += d * d * exp(-0.5 * v * v) * h;
    }
    return sum / sqrt(2.0 * M_PI);
}

static void test_mse_gauss_4bit(void) {
    /* The population optimum of this quantizer on N(0, 1), by integration
     * over t in steps of 0.01 (ACIQ's analysis puts it near 2.55 sigma for
     * 4 bits). A sample of 2e4 has amax near 4, so the optimum is clearly
     * clipping; the sample's minimiser lies within 0.15 of the population's
     * (the error curve is flat there: measured 2.50..2.56 over seeds). */
    CalibQuant q4 = calib_quant_int(4, false);
    double best_t = 0.0, best = INFINITY;
    for (double t = 1.5; t <= 3.5; t += 0.01) {
        double e = gauss_quant_mse(&q4, t);
        if (e < best) best = e, best_t = t;
    }
    CU_ASSERT(best_t > 2.4 && best_t < 2.7);
    const size_t n = 20000;
    float *x = normal_sample(8, n, 0.0f, 1.0f);
    float amax = abs_max(x, n);
    CalibRange r = range_of("mse", x, n, &q4);
    CU_ASSERT_DOUBLE_EQUAL(r.hi, best_t, 0.15);
    CU_ASSERT(r.hi < 0.75f * amax);
    /* 8 bits clip much less: the population optimum is near 3.9. */
    CalibQuant q8 = calib_quant_int(8, false);
    CalibRange r8 = range_of("mse", x, n, &q8);
    CU_ASSERT(r8.hi > 3.5f && r8.hi <= amax);
    free(x);
}

/* Clipping only, no rounding: every clip costs, so the best range is the
 * whole extent. */
static float quant_clip_only(float x, float lo, float hi, const CalibQuant *q) {
    (void)q;
    return x < lo ? lo : x > hi ? hi : x;
}

static void test_mse_custom_and_asymmetric(void) {
    const float x[] = {-2.0f, 0.5f, 1.0f, 7.0f};
    CalibQuant clip = {.fn = quant_clip_only, .levels = 128};
    CalibRange r = range_of("mse", x, 4, &clip);
    CU_ASSERT_EQUAL(r.hi, 7.0f);
    CU_ASSERT_EQUAL(r.lo, -7.0f);
    clip.asymmetric = true;
    r = range_of("mse", x, 4, &clip);
    CU_ASSERT_EQUAL(r.lo, -2.0f);
    CU_ASSERT_EQUAL(r.hi, 7.0f);
    /* uint8 on U[0, 4): as with the symmetric uniform case the optimum keeps
     * almost all of the range; lo = f * min stays near 0. */
    const size_t n = 20000;
    float *u = uniform_sample(9, n, 0.0f, 4.0f);
    CalibQuant qa = calib_quant_int(8, true);
    r = range_of("mse", u, n, &qa);
    CU_ASSERT(r.hi >= 0.98f * abs_max(u, n) && r.hi <= abs_max(u, n));
    CU_ASSERT(r.lo >= 0.0f && r.lo < 1e-3f);
    free(u);
}

/* ---- entropy and kl_j ----------------------------------------------------- */

static void test_entropy_by_hand(void) {
    /* amax = 2048 makes the 2048 bins exactly 1 wide. Bins 0..127 hold 1, 3,
     * 1, 3, ... values (value k + 0.5 in bin k), and one outlier sits at
     * 2048, in bin 2047: N = 64 * 4 + 1 = 257.
     * Candidates 129..2047 leave bin i-1 empty under a non-empty tail:
     * infinite KL. Two remain:
     *   i = 128: one level per bin, Q = h / 256; P = h / 257 except bin 127
     *     (3 + 1) / 257: KL = (253/257) ln(256/257) + (4/257) ln(4*256/(3*257))
     *     = -0.00384 + 0.00442 = 0.0006.
     *   i = 2048: 16 bins a level, so each level of bins 0..127 averages
     *     (8 + 24) / 16 = 2 and Q = 2/257 there (the outlier's level holds
     *     it alone: Q = P): KL = (64/257) ln(1/2) + (192/257) ln(3/2) = 0.130.
     * The least is i = 128: t = 128 * 1. */
    float x[257];
    size_t n = 0;
    for (int k = 0; k < 128; k++)
        for (int c = 0; c < (k % 2 ? 3 : 1); c++) x[n++] = (k % 3 ? 1.0f : -1.0f) * (k + 0.5f);
    x[n++] = -2048.0f;
    CU_ASSERT_EQUAL_FATAL(n, 257);
    CalibRange r = range_of("entropy", x, n, NULL);
    CU_ASSERT_EQUAL(r.hi, 128.0f);
    CU_ASSERT_EQUAL(r.lo, -128.0f);
    /* Bins 0..127 all 2 instead: i = 2048 reproduces them exactly (KL = 0,
     * below i = 128's (254/257) ln(256/257) + (3/257) ln(3 * 256 / (2 * 257))
     * = 0.0008), so nothing is clipped. */
    n = 0;
    for (int k = 0; k < 128; k++) x[n++] = k + 0.5f, x[n++] = -(k + 0.5f);
    x[n++] = 2048.0f;
    CU_ASSERT_EQUAL(range_of("entropy", x, n, NULL).hi, 2048.0f);
}

static void test_entropy_distributions(void) {
    const size_t n = 100000;
    /* N(0, 1) with 128 levels keeps nearly the whole sample: measured
     * 3.83..4.65 over 30 seeds of n = 1e5 (amax 4.4..4.9), past the 8-bit
     * MSE optimum of 3.9 sigma and far above the smallest candidate,
     * amax * 128/2048 = 0.3. Band [3.6, 4.8], never above amax. */
    float *x = normal_sample(12, n, 0.0f, 1.0f);
    float amax = abs_max(x, n);
    CalibRange r = range_of("entropy", x, n, NULL);
    CU_ASSERT(r.hi >= 3.6f && r.hi <= 4.8f);
    CU_ASSERT(r.hi <= amax);
    /* Student's t with 2 degrees of freedom, z / sqrt(E) with E ~ Exp(1):
     * a sample of 1e5 reaches |x| of a few hundred while 99% lie within
     * 9.9. Entropy clips most of that tail: measured 0.06..0.23 of amax
     * over 30 seeds; 0.0625 = 128/2048 is the smallest candidate. */
    float *u = uniform_sample(13, n, 0.0f, 1.0f);
    for (size_t i = 0; i < n; i++) x[i] /= sqrtf(-logf(1.0f - u[i]));
    amax = abs_max(x, n);
    r = range_of("entropy", x, n, NULL);
    CU_ASSERT(r.hi >= 0.0625f * amax * 0.999f);
    CU_ASSERT(r.hi <= 0.3f * amax);
    CU_ASSERT(r.hi > 9.9f);
    free(u);
    free(x);
}

static void test_kl_j(void) {
    /* N(0, 1), n = 1e5: B = 317 bins, candidates 129..317 for 128 levels.
     * The CDF's resampling is exact where (i - 1) is a multiple of 127, so
     * the result moves between a few such bins from sample to sample:
     * measured 3.47..4.33 over 30 seeds. Band [3.2, 4.6], never above amax. */
    const size_t n = 100000;
    float *x = normal_sample(14, n, 0.0f, 1.0f);
    float amax = abs_max(x, n);
    CalibRange r = range_of("kl_j", x, n, NULL);
    CU_ASSERT(r.hi >= 3.2f && r.hi <= 4.6f);
    CU_ASSERT(r.hi <= amax);
    CU_ASSERT_EQUAL(r.lo, -r.hi);
    /* With n = 100 there are ceil(sqrt(100)) = 10 bins, fewer than 129: the
     * threshold is amax. With 4 bits (8 levels) candidates 9 and 10 exist,
     * so t is 0.9 or 1 times amax. */
    CU_ASSERT_EQUAL(range_of("kl_j", x, 100, NULL).hi, abs_max(x, 100));
    CalibQuant q4 = calib_quant_int(4, false);
    float t4 = range_of("kl_j", x, 100, &q4).hi, a100 = abs_max(x, 100);
    CU_ASSERT(t4 == a100 || fabsf(t4 - 0.9f * a100) <= 1e-6f * a100);
    free(x);
}

/* ---- edge cases ----------------------------------------------------------- */

static const char *const DATA_METHODS[] = {"absmax", "minmax", "rms,3", "percentile,99", "mse",
                                           "entropy", "3sd", "kl_j"};
#define N_DATA_METHODS (sizeof DATA_METHODS / sizeof DATA_METHODS[0])

static void test_degenerate(void) {
    const float zeros[5] = {0};
    const float one[1] = {2.5f};
    for (size_t m = 0; m < N_DATA_METHODS; m++) {
        CalibRange r = range_of(DATA_METHODS[m], NULL, 0, NULL);
        CU_ASSERT(r.lo == 0.0f && r.hi == 0.0f);
        r = range_of(DATA_METHODS[m], zeros, 5, NULL);
        CU_ASSERT(r.lo == 0.0f && r.hi == 0.0f);
        /* One value: every method lands on it (rms,3 on 3 times it; minmax
         * on (2.5, 2.5); mse on the full range since no t <= 2.5 stores 2.5
         * exactly with scale t / 127.5). */
        r = range_of(DATA_METHODS[m], one, 1, NULL);
        float want = m == 2 ? 7.5f : 2.5f;
        if (fabsf(r.hi - want) > 1e-6f) fprintf(stderr, "\n  %s on {2.5}: hi %g\n", DATA_METHODS[m], r.hi);
        CU_ASSERT(fabsf(r.hi - want) <= 1e-6f);
        CU_ASSERT_EQUAL(r.lo, m == 1 ? 2.5f : -r.hi);
    }
    /* minmax keeps all-negative extremes as they are; the format adds 0. */
    const float neg[] = {-3.0f, -1.0f, -2.0f};
    CalibRange r = range_of("minmax,0.5", neg, 3, NULL);
    CU_ASSERT_EQUAL(r.lo, -1.5f);
    CU_ASSERT_EQUAL(r.hi, -0.5f);
}

static void test_nan_inf(void) {
    float x[6] = {1.0f, -2.0f, 0.5f, NAN, INFINITY, 3.0f};
    const char *const methods[] = {"absmax", "minmax", "rms,3", "percentile,99", "mse", "entropy", "3sd", "kl_j",
                                   "fixed,1"};
    for (size_t m = 0; m < sizeof methods / sizeof methods[0]; m++) {
        CalibSpec spec;
        CalibRange r = {7.0f, 7.0f};
        QtError err = {0};
        CU_ASSERT_EQUAL_FATAL(calib_parse(methods[m], &spec, &err), QT_OK);
        CU_ASSERT_EQUAL(calib_compute(&spec, x, 6, NULL, NULL, 0, &r, &err), QT_ERR_VALUE);
        CU_ASSERT(test_msg_has(&err, "x[3]"));
        CU_ASSERT(test_msg_has(&err, "NaN"));
        CU_ASSERT(r.lo == 7.0f && r.hi == 7.0f); /* untouched */
    }
    x[3] = 0.0f;
    x[0] = -INFINITY;
    CalibSpec spec;
    CalibRange r;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(calib_parse("absmax", &spec, &err), QT_OK);
    CU_ASSERT_EQUAL(calib_compute(&spec, x, 6, NULL, NULL, 0, &r, &err), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&err, "x[0]"));
    CU_ASSERT(test_msg_has(&err, "Inf"));
    /* A scale that overflows float is an error too, not an Inf range. */
    const float big[] = {3e38f};
    qt_error_clear(&err);
    CU_ASSERT_EQUAL_FATAL(calib_parse("absmax,10", &spec, &err), QT_OK);
    CU_ASSERT_EQUAL(calib_compute(&spec, big, 1, NULL, NULL, 0, &r, &err), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&err, "float32"));
}

static void test_workspace_and_quantizer_checks(void) {
    const size_t n = 1000;
    float *x = normal_sample(15, n, 0.0f, 1.0f);
    CalibSpec spec;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(calib_parse("percentile,99", &spec, &err), QT_OK);
    CU_ASSERT_EQUAL(calib_workspace_bytes(&spec, n), n * sizeof(float));
    /* A caller's workspace gives the same answer as the internal one. */
    double *work = malloc(n * sizeof(float));
    CalibRange a, b;
    CU_ASSERT_EQUAL(calib_compute(&spec, x, n, NULL, work, n * sizeof(float), &a, &err), QT_OK);
    CU_ASSERT_EQUAL(calib_compute(&spec, x, n, NULL, NULL, 0, &b, &err), QT_OK);
    CU_ASSERT(a.lo == b.lo && a.hi == b.hi);
    CU_ASSERT_EQUAL(calib_compute(&spec, x, n, NULL, work, n * sizeof(float) - 1, &a, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "calib_workspace_bytes"));
    free(work);
    CalibSpec ent, klj, mse;
    CU_ASSERT_EQUAL_FATAL(calib_parse("entropy", &ent, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(calib_parse("kl_j", &klj, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(calib_parse("mse", &mse, &err), QT_OK);
    CU_ASSERT_EQUAL(calib_workspace_bytes(&ent, n), 2048 * sizeof(double));
    CU_ASSERT_EQUAL(calib_workspace_bytes(&klj, n), 2 * 32 * sizeof(double)); /* ceil(sqrt(1000)) = 32 */
    CU_ASSERT_EQUAL(calib_workspace_bytes(&klj, 1024), 2 * 32 * sizeof(double));
    CU_ASSERT_EQUAL(calib_workspace_bytes(&klj, 1025), 2 * 33 * sizeof(double));
    CU_ASSERT_EQUAL(calib_workspace_bytes(&mse, n), 0);
    CU_ASSERT_EQUAL(calib_workspace_bytes(&ent, 0), 0);
    /* mse without a round trip, entropy without levels. */
    CalibQuant none = calib_quant_int(1, false);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(calib_compute(&mse, x, n, &none, NULL, 0, &a, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "CalibQuant.fn"));
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(calib_compute(&ent, x, n, &none, NULL, 0, &a, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "levels"));
    free(x);
}

/* ---- parsing -------------------------------------------------------------- */

static void test_parse_round_trip(void) {
    const struct {
        const char *text, *canonical;
    } cases[] = {
        {"absmax", "absmax"},
        {"ABSMAX,1", "absmax"},
        {" absmax , 0.5 ", "absmax,0.5"},
        {"minmax,2", "minmax,2"},
        {"rms,3", "rms,3"},
        {"rms,0.1", "rms,0.1"},
        {"fixed,6", "fixed,6"},
        {"fixed,-1.5,6", "fixed,-1.5,6"},
        {"percentile,99.99", "percentile,99.99"},
        {"percentile,1e2", "percentile,100"},
        {"mse", "mse"},
        {"Entropy", "entropy"},
        {"3sd", "3sd"},
        {"kl_j", "kl_j"},
        {" Mean_Abs ", "mean_abs"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CalibSpec a, b;
        QtError err = {0};
        char buf[64];
        CU_ASSERT_EQUAL_FATAL(calib_parse(cases[i].text, &a, &err), QT_OK);
        calib_format(&a, buf, sizeof buf);
        if (strcmp(buf, cases[i].canonical) != 0) fprintf(stderr, "\n  '%s' -> '%s'\n", cases[i].text, buf);
        CU_ASSERT_STRING_EQUAL(buf, cases[i].canonical);
        CU_ASSERT_EQUAL_FATAL(calib_parse(buf, &b, &err), QT_OK);
        CU_ASSERT(a.kind == b.kind && a.s == b.s && a.a == b.a && a.lo == b.lo && a.hi == b.hi && a.p == b.p &&
                  a.fixed_minmax == b.fixed_minmax);
    }
    /* Numbers without a short decimal form still come back exactly. */
    CalibSpec s = {.kind = CALIB_ABSMAX, .s = 1.0 / 3.0}, back;
    char buf[64];
    calib_format(&s, buf, sizeof buf);
    CU_ASSERT_EQUAL_FATAL(calib_parse(buf, &back, NULL), QT_OK);
    CU_ASSERT_EQUAL(back.s, 1.0 / 3.0);
    CU_ASSERT_STRING_EQUAL(calib_kind_name(CALIB_KL_J), "kl_j");
    CU_ASSERT_STRING_EQUAL(calib_kind_name(CALIB_MEAN_ABS), "mean_abs");
    CU_ASSERT_STRING_EQUAL(calib_kind_name(CALIB_COUNT), "unknown");
}

static void test_parse_errors(void) {
    const struct {
        const char *text, *what;
    } cases[] = {
        {"foo", "unknown calibration method 'foo'"},
        {"", "empty"},
        {"   ", "empty"},
        {"absmax,0", "s = 0"},
        {"absmax,-1", "s = -1"},
        {"minmax,0", "must be a finite number > 0"},
        {"rms", "rms takes one number"},
        {"rms,0", "s = 0"},
        {"percentile", "percentile takes one number"},
        {"percentile,0", "(0, 100]"},
        {"percentile,100.5", "(0, 100]"},
        {"fixed", "fixed takes one number (a) or two"},
        {"fixed,0", "a = 0"},
        {"fixed,2,1", "min < max"},
        {"fixed,1,1", "min < max"},
        {"fixed,1,2,3", "fixed takes one number (a) or two"},
        {"mse,3", "mse takes no number"},
        {"3sd,1", "3sd takes no number"},
        {"absmax,abc", "'abc' is not a finite number"},
        {"absmax,", "'' is not a finite number"},
        {"absmax,nan", "'nan' is not a finite number"},
        {"percentile,inf", "'inf' is not a finite number"},
        {"absmax,1,2", "absmax takes at most one number"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CalibSpec spec = {.kind = CALIB_MSE, .s = 42.0};
        QtError err = {0};
        CU_ASSERT_EQUAL(calib_parse(cases[i].text, &spec, &err), QT_ERR_CONFIG);
        CU_ASSERT(test_msg_has(&err, cases[i].what));
        CU_ASSERT_EQUAL(spec.s, 42.0); /* untouched on error */
        /* Every message names the string it rejects. */
        if (*cases[i].text && strspn(cases[i].text, " ") != strlen(cases[i].text))
            CU_ASSERT(test_msg_has(&err, cases[i].text));
    }
    /* Unknown names and wrong counts list every valid form. */
    QtError err = {0};
    CalibSpec spec;
    CU_ASSERT_EQUAL(calib_parse("percentil,99", &spec, &err), QT_ERR_CONFIG);
    const char *forms[] = {"absmax,s", "minmax,s", "rms,s", "fixed,a", "fixed,min,max", "percentile,p",
                           "mse",      "entropy",  "3sd",   "kl_j"};
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) CU_ASSERT(test_msg_has(&err, forms[i]));
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(calib_parse(NULL, &spec, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "fixed,min,max"));
    /* A spec built in code gets the same checks. */
    CalibSpec bad = {.kind = CALIB_PERCENTILE, .s = 1.0, .p = 0.0};
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(calib_spec_check(&bad, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "(0, 100]"));
    CalibRange r;
    CU_ASSERT_EQUAL(calib_compute(&bad, NULL, 0, NULL, NULL, 0, &r, NULL), QT_ERR_CONFIG);
}

/* ---- running statistics --------------------------------------------------- */

static void test_running(void) {
    CalibSpec spec;
    CU_ASSERT_EQUAL_FATAL(calib_parse("minmax", &spec, NULL), QT_OK);
    CalibRunning r;
    calib_running_init(&r, &spec);
    CU_ASSERT_EQUAL(r.count, 0);
    CalibRange z = calib_running_range(&r);
    CU_ASSERT(z.lo == 0.0f && z.hi == 0.0f);
    /* Means of (-1, 2), (-3, 4), (-2, 3): (-2, 3). */
    const CalibRange batches[] = {{-1.0f, 2.0f}, {-3.0f, 4.0f}, {-2.0f, 3.0f}};
    for (int i = 0; i < 3; i++) CU_ASSERT_EQUAL(calib_running_update(&r, batches[i], NULL), QT_OK);
    CU_ASSERT_EQUAL(r.count, 3);
    CU_ASSERT_DOUBLE_EQUAL(r.lo_mean, -2.0, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(r.hi_mean, 3.0, 1e-12);
    CalibRange m = calib_running_range(&r);
    CU_ASSERT(m.lo == -2.0f && m.hi == 3.0f);
    /* A bad batch is refused and changes nothing. */
    QtError err = {0};
    CU_ASSERT_EQUAL(calib_running_update(&r, (CalibRange){2.0f, 1.0f}, &err), QT_ERR_VALUE);
    CU_ASSERT_EQUAL(calib_running_update(&r, (CalibRange){NAN, 1.0f}, NULL), QT_ERR_VALUE);
    CU_ASSERT_EQUAL(r.count, 3);
    /* observe = compute + update; (1, 5) moves the means to (-1.25, 3.5);
     * an empty batch adds nothing. */
    const float x[] = {5.0f, 1.0f, 3.0f};
    CU_ASSERT_EQUAL(calib_running_observe(&r, x, 3, NULL, NULL, 0, NULL), QT_OK);
    CU_ASSERT_EQUAL(calib_running_observe(&r, NULL, 0, NULL, NULL, 0, NULL), QT_OK);
    CU_ASSERT_EQUAL(r.count, 4);
    CU_ASSERT_DOUBLE_EQUAL(r.lo_mean, -1.25, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(r.hi_mean, 3.5, 1e-12);
    /* What a checkpoint restores must make sense. */
    CU_ASSERT_EQUAL(calib_running_check(&r, NULL), QT_OK);
    CalibRunning bad = r;
    bad.count = -1;
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(calib_running_check(&bad, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "count"));
    bad = r;
    bad.lo_mean = 9.0;
    CU_ASSERT_EQUAL(calib_running_check(&bad, NULL), QT_ERR_FORMAT);
    bad = r;
    bad.count = 0;
    CU_ASSERT_EQUAL(calib_running_check(&bad, NULL), QT_ERR_FORMAT);
    bad = r;
    bad.spec.s = 0.0;
    CU_ASSERT_EQUAL(calib_running_check(&bad, NULL), QT_ERR_FORMAT);
}

int register_quant_calib_suite(void) {
    CU_pSuite s = CU_add_suite("quant_calib", NULL, NULL);
    if (!s) return -1;
    struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"absmax and minmax with s", test_absmax_minmax},
        {"rms and fixed", test_rms_fixed},
        {"percentile: numpy interpolation by hand", test_percentile_small},
        {"percentile: selection vs sorting", test_percentile_vs_sort},
        {"percentile 99 of uniform samples", test_percentile_uniform},
        {"3sd: small array and normal samples", test_3sd},
        {"mean_abs: mean |x| by hand", test_mean_abs},
        {"int quantizer round trips", test_quant_int},
        {"mse: uniform 8-bit near absmax", test_mse_uniform},
        {"mse: Gaussian 4-bit near the integrated optimum", test_mse_gauss_4bit},
        {"mse: custom and asymmetric quantizers", test_mse_custom_and_asymmetric},
        {"entropy: histogram worked by hand", test_entropy_by_hand},
        {"entropy: Gaussian and heavy tail", test_entropy_distributions},
        {"kl_j: Gaussian band and small samples", test_kl_j},
        {"degenerate inputs", test_degenerate},
        {"NaN and Inf rejected with the index", test_nan_inf},
        {"workspace and quantizer checks", test_workspace_and_quantizer_checks},
        {"parse and format round trip", test_parse_round_trip},
        {"parse errors", test_parse_errors},
        {"running statistics", test_running},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return 0;
}
