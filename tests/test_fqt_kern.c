/* test_fqt_kern.c - QT's int quantizers (quant/fqt_kern.h): each x86 family
 * (AVX2, AVX-512) equals the scalar _ref kernels bit for bit, and the drivers equal
 * QArray's general rules (qarray_plan_encode over the calibrated range),
 * the path QT takes for every other format, at 1 and 2 threads. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/ops.h"
#include "quant/fqt_kern.h"
#include "quant/qarray_plan.h"
#include "quant/qtype.h"
#include "test_util.h"

/* Data with the cases that decide a rounding: exact halves of the scale, values past the range, signed zeros,
 * subnormals, and plain uniform values. */
static float *edge_data(size_t n, uint64_t seed, float s) {
    float *x = test_random_uniform(n, seed, -130.0f * s, 130.0f * s);
    for (size_t i = 0; i < n; i++) switch (i % 9) {
        case 1: x[i] = ((float)(int)(i % 41) - 20.0f + 0.5f) * s; break; /* a tie */
        case 3: x[i] = i % 2 ? -0.0f : 0.0f; break;
        case 5: x[i] = (i % 2 ? -1.0f : 1.0f) * 1e-40f; break;
        case 7: x[i] = (i % 2 ? -1.0f : 1.0f) * 1e6f * s; break;
        default: break;
        }
    return x;
}

static bool same_bits(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

/* The twins tests run once per x86 family, each against the _ref kernels: a family this CPU lacks is a visible
 * skip (an AVX2-only CPU skips the AVX-512 runs; a CPU without AVX2 skips both). */
static void families_up_to(FqtKernFamily top, const char *test, void (*body)(void)) {
    static const FqtKernFamily families[] = {FQT_KERN_AVX2, FQT_KERN_AVX512};
    static const char *const names[] = {"portable", "avx2", "avx512"};
    for (size_t f = 0; f < sizeof families / sizeof *families && families[f] <= top; f++) {
        if (fqt_kern_cap(families[f]) != families[f]) {
            test_skip("%s (%s): this CPU lacks the %s kernels", test, names[families[f]], names[families[f]]);
            continue;
        }
        body();
    }
    fqt_kern_cap(FQT_KERN_AVX512);
}

/* Every family: the kernels with an AVX-512 twin (fqt_kern_x86.h). */
static void for_each_family(const char *test, void (*body)(void)) { families_up_to(FQT_KERN_AVX512, test, body); }

static void test_absmax_twins_body(void) {
    for (size_t n = 0; n < 70; n++) {
        float *x = edge_data(n, 100 + n, 0.01f);
        float a = -1.0f, b = -2.0f;
        CU_ASSERT(fqt_absmax(x, n, &a) && fqt_absmax_ref(x, n, &b));
        CU_ASSERT(a == b);
        for (size_t bad = 0; bad < n; bad += 7) { /* NaN and infinity anywhere, also in a vector's lanes */
            float keep = x[bad];
            x[bad] = bad % 2 ? NAN : -INFINITY;
            CU_ASSERT(!fqt_absmax(x, n, &a) && !fqt_absmax_ref(x, n, &b));
            x[bad] = keep;
        }
        free(x);
    }
}

static void test_absmax_twins(void) { for_each_family("absmax: fast = ref", test_absmax_twins_body); }

/* The masked maximum: fast = ref, a non-finite g counts only where y > 0 (a NaN y masks it out), and on a pooled
 * gradient it is the fqt_absmax of the plane nn_conv_epilogue_grad_plane makes (odd sizes: a last row and column
 * outside every window). */
static void test_masked_absmax_twins_body(void) {
    for (size_t n = 0; n < 70; n++) {
        float *g = edge_data(n, 200 + n, 0.01f), *y = test_random_uniform(n, 300 + n, -1.0f, 1.0f);
        for (size_t i = 0; i < n; i += 5) y[i] = i % 2 ? 0.0f : -0.0f; /* a relu's zeros: masked */
        float a = -1.0f, b = -2.0f;
        CU_ASSERT(fqt_masked_absmax(g, y, n, &a) && fqt_masked_absmax_ref(g, y, n, &b));
        CU_ASSERT(a == b);
        for (size_t bad = 0; bad < n; bad += 7) {
            const float keep = g[bad], keep_y = y[bad];
            g[bad] = bad % 2 ? NAN : -INFINITY;
            y[bad] = 0.5f; /* counted: both refuse */
            CU_ASSERT(!fqt_masked_absmax(g, y, n, &a) && !fqt_masked_absmax_ref(g, y, n, &b));
            y[bad] = bad % 3 ? -0.5f : NAN; /* masked: both pass, as before */
            CU_ASSERT(fqt_masked_absmax(g, y, n, &a) && fqt_masked_absmax_ref(g, y, n, &b) && a == b);
            g[bad] = keep, y[bad] = keep_y;
        }
        free(g), free(y);
    }
    static const int SIZES[][2] = {{28, 28}, {7, 9}, {14, 14}, {2, 2}, {5, 34}};
    for (size_t k = 0; k < sizeof SIZES / sizeof *SIZES; k++) {
        const int OH = SIZES[k][0], OW = SIZES[k][1];
        const size_t PP = (size_t)(OH / 2) * (OW / 2), P = (size_t)OH * OW;
        float *dy = edge_data(PP, 400 + k, 0.01f), *y = test_random_uniform(PP, 500 + k, -1.0f, 1.0f);
        float *plane = malloc(P * sizeof *plane);
        uint8_t *win = malloc(PP);
        for (size_t i = 0; i < PP; i++) win[i] = (uint8_t)((i * 7 + k) % 4);
        nn_conv_epilogue_grad_plane(plane, dy, y, win, OH, OW, CONV_EPI_RELU_MAXPOOL2);
        float a = -1.0f, b = -2.0f;
        CU_ASSERT(fqt_masked_absmax(dy, y, PP, &a) && fqt_absmax_ref(plane, P, &b) && a == b);
        free(dy), free(y), free(plane), free(win);
    }
}

static void test_masked_absmax_twins(void) { /* no AVX-512 twin: the AVX2 one serves both */
    families_up_to(FQT_KERN_AVX2, "masked absmax: fast = ref", test_masked_absmax_twins_body);
}

static void test_col_absmax_twins_body(void) {
    const int shapes[][2] = {{1, 1}, {3, 8}, {17, 13}, {64, 32}, {5, 70}};
    for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
        int rows = shapes[k][0], out = shapes[k][1];
        float *g = edge_data((size_t)rows * out, 200 + k, 0.5f), a[70], b[70];
        for (int o = 0; o < out; o++) a[o] = b[o] = (float)o * 0.1f; /* the maxima are updated, not reset */
        CU_ASSERT(fqt_col_absmax(a, g, rows, out) && fqt_col_absmax_ref(b, g, rows, out));
        CU_ASSERT(same_bits(a, b, (size_t)out * sizeof *a));
        g[(size_t)(rows - 1) * out + out / 2] = NAN;
        CU_ASSERT(!fqt_col_absmax(a, g, rows, out) && !fqt_col_absmax_ref(b, g, rows, out));
        free(g);
    }
}

static void test_col_absmax_twins(void) { /* no AVX-512 twin */
    families_up_to(FQT_KERN_AVX2, "column absmax: fast = ref", test_col_absmax_twins_body);
}

static void test_span_twins_body(void) {
    const FqtRound modes[] = {{-128, 127, false}, {-128, 127, true}, {-127, 127, false}, {-8, 7, true}};
    for (size_t m = 0; m < sizeof modes / sizeof *modes; m++)
        for (size_t n = 1; n < 70; n += 3)
            for (int steps = 0; steps < 6; steps++) {
                int s_step = steps & 1;
                size_t u_step = (size_t)(steps >> 1) * (steps >> 1); /* 0, 1, 4: a column of row-major noise */
                float *x = edge_data(n, 300 + n, 0.02f), *s = test_random_uniform(n, 400 + n, 0.01f, 0.03f);
                for (size_t i = 10; i < n; i += 11) x[i] = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
                float *u = test_random_uniform(n * 4, 500 + n, 0.0f, 1.0f);
                for (size_t i = 0; i < n * 4; i += 5) u[i] = i % 2 ? 0.5f : 0.0f; /* exactly at the threshold */
                int8_t qa[70], qb[70];
                float va[70], vb[70];
                fqt_quant_span(qa, va, x, n, s, s_step, u, u_step, &modes[m]);
                fqt_quant_span_ref(qb, vb, x, n, s, s_step, u, u_step, &modes[m]);
                CU_ASSERT(same_bits(qa, qb, n) && same_bits(va, vb, n * sizeof *va));
                fqt_quant_span(NULL, va, x, n, s, s_step, u, u_step, &modes[m]); /* either output alone */
                fqt_quant_span(qa, NULL, x, n, s, s_step, u, u_step, &modes[m]);
                CU_ASSERT(same_bits(qa, qb, n) && same_bits(va, vb, n * sizeof *va));
                free(x), free(s), free(u);
            }
}

static void test_span_twins(void) { for_each_family("span: fast = ref", test_span_twins_body); }

static void test_sum_twins_body(void) {
    for (size_t n = 0; n < 300; n += 7) {
        float *x = edge_data(n, 950 + n, 0.3f);
        double a = fqt_sum_f64(x, n), b = fqt_sum_f64_ref(x, n);
        CU_ASSERT(memcmp(&a, &b, sizeof a) == 0);
        free(x);
    }
}

static void test_sum_twins(void) { /* no AVX-512 twin */
    families_up_to(FQT_KERN_AVX2, "sum: fast = ref", test_sum_twins_body);
}

static void test_plane_stats_twins_body(void) {
    for (size_t n = 0; n < 300; n += 11) {
        float *x = edge_data(n, 960 + n, 0.2f), *ra = test_random_uniform(n, 961 + n, 0.0f, 5.0f);
        float *rb = malloc((n ? n : 1) * sizeof *rb);
        memcpy(rb, ra, n * sizeof *ra);
        float ma = -1.0f, mb = -2.0f;
        double sa = 1.0, sb = 2.0;
        CU_ASSERT(fqt_plane_stats(x, n, ra, &ma, &sa) && fqt_plane_stats_ref(x, n, rb, &mb, &sb));
        CU_ASSERT(ma == mb && memcmp(&sa, &sb, sizeof sa) == 0 && same_bits(ra, rb, n * sizeof *ra));
        ma = -1.0f, sa = 1.0; /* without the rows' maxima: the same plane maximum and sum */
        CU_ASSERT(fqt_plane_stats(x, n, NULL, &ma, &sa) && ma == mb && memcmp(&sa, &sb, sizeof sa) == 0);
        CU_ASSERT(fqt_plane_stats_ref(x, n, NULL, &ma, &sa) && ma == mb && memcmp(&sa, &sb, sizeof sa) == 0);
        double s1 = fqt_sum_f64_ref(x, n);
        CU_ASSERT(memcmp(&sa, &s1, sizeof sa) == 0); /* the same additions as the sum alone */
        if (n > 0) {
            x[n / 2] = NAN;
            CU_ASSERT(!fqt_plane_stats(x, n, ra, &ma, &sa) && !fqt_plane_stats_ref(x, n, rb, &mb, &sb));
        }
        free(x), free(ra), free(rb);
    }
}

static void test_plane_stats_twins(void) { /* no AVX-512 twin */
    families_up_to(FQT_KERN_AVX2, "plane stats: fast = ref", test_plane_stats_twins_body);
}

/* The inlined scale formula equals the drivers' (calib_compute's range, then qarray_plan_scale). */
static void test_scales_of_amax(void) {
    static const char *const TYPES[] = {"int8", "int4"};
    const CalibSpec calibs[] = {{.kind = CALIB_ABSMAX, .s = 1.0}, {.kind = CALIB_ABSMAX, .s = 0.7}};
    float amax[64], s[64];
    for (int i = 0; i < 64; i++) amax[i] = i == 0 ? 0.0f : i == 1 ? 1e-30f : ldexpf(1.0f + 0.013f * (float)i, i - 32);
    for (int t = 0; t < 2; t++)
        for (int k = 0; k < 2; k++)
            for (int narrow = 0; narrow < 2; narrow++) {
                QArrayOptions o = {.range = QARRAY_RANGE_SYMMETRIC, .calib = &calibs[k], .narrow_range = narrow};
                QArrayPlan p;
                QtError err = {0};
                CU_ASSERT_FATAL(qarray_plan_make(&p, "test", 1, (const int[]){64}, qtype_find(TYPES[t], &err), &o,
                                                 &err) == QT_OK);
                CU_ASSERT(fqt_scales_of_amax(&p, amax, s, 64));
                for (int i = 0; i < 64; i++) {
                    float want;
                    CU_ASSERT(fqt_scale_of_amax(&p, amax[i], &want));
                    CU_ASSERT(memcmp(&s[i], &want, sizeof want) == 0);
                }
            }
}

static void test_scale_i32_twins_body(void) {
    for (size_t n = 0; n < 100; n += 7) {
        int32_t *x = malloc((n ? n : 1) * sizeof *x);
        float *a = malloc((n ? n : 1) * sizeof *a), *b = malloc((n ? n : 1) * sizeof *b);
        for (size_t i = 0; i < n; i++) x[i] = (int32_t)(((uint32_t)i * 2654435761u) >> 4) - (1 << 27);
        for (int add = 0; add < 2; add++) {
            fqt_scale_i32(a, x, n, 0.0123f, 3.7e-3f, -0.25f, add);
            fqt_scale_i32_ref(b, x, n, 0.0123f, 3.7e-3f, -0.25f, add);
            CU_ASSERT(same_bits(a, b, n * sizeof *a));
        }
        free(x), free(a), free(b);
    }
}

static void test_scale_i32_twins(void) { for_each_family("int32 scaling: fast = ref", test_scale_i32_twins_body); }

static void test_ste_clip_twins_body(void) {
    for (size_t n = 0; n < 70; n += 3) {
        float *v = edge_data(n, 900 + n, 0.05f), *tmp = test_random_uniform(n, 901 + n, -1.0f, 1.0f);
        float *a = test_random_uniform(n, 902 + n, -1.0f, 1.0f), *b = malloc((n ? n : 1) * sizeof *b);
        for (size_t i = 0; i < n; i += 4) a[i] = i % 8 ? -0.0f : 0.0f; /* += 0 turns -0 into +0: the same in both */
        memcpy(b, a, n * sizeof *a);
        fqt_ste_clip(a, v, tmp, n, 0.05f, -128.0f, 127.0f);
        fqt_ste_clip_ref(b, v, tmp, n, 0.05f, -128.0f, 127.0f);
        CU_ASSERT(same_bits(a, b, n * sizeof *a));
        /* into an unwritten d: the bits of adding into zeros */
        for (size_t i = 0; i < n; i++) a[i] = NAN, b[i] = 0.0f;
        fqt_ste_clip_write(a, v, tmp, n, 0.05f, -128.0f, 127.0f);
        fqt_ste_clip_ref(b, v, tmp, n, 0.05f, -128.0f, 127.0f);
        CU_ASSERT(same_bits(a, b, n * sizeof *a));
        for (size_t i = 0; i < n; i++) a[i] = NAN;
        fqt_ste_clip_write_ref(a, v, tmp, n, 0.05f, -128.0f, 127.0f);
        CU_ASSERT(same_bits(a, b, n * sizeof *a));
        free(v), free(tmp), free(a), free(b);
    }
}

static void test_ste_clip_twins(void) { for_each_family("STE clip: fast = ref", test_ste_clip_twins_body); }

/* The general rules: the slice's calibrated range, the plan's scale, qarray_plan_encode, the code's value. */
static float general_scale(const QArrayPlan *p, const float *v, size_t n) {
    CalibRange r;
    QtError err = {0};
    CU_ASSERT_FATAL(qarray_plan_slice_range(p, v, n, NULL, 0, &r, &err) == QT_OK);
    return qarray_plan_scale(p, r.lo, r.hi);
}

static float general_value(const QArrayPlan *p, float x, float s, float u) {
    return qtype_decode(p->t, qarray_plan_encode(p, x, s, 0.0f, p->round, u)) * s;
}

static void make_plan(QArrayPlan *p, const char *type, int rows, int out, bool sr, const CalibSpec *calib) {
    QArrayOptions o = {.range = QARRAY_RANGE_SYMMETRIC, .round = sr ? QROUND_STOCHASTIC : QROUND_RNE,
                       .calib = calib};
    static Rng rng; /* the plan wants one for stochastic rounding; the tests give their own uniforms */
    if (sr) o.rng = &rng;
    QtError err = {0};
    CU_ASSERT_FATAL(qtype_find(type, &err) != NULL);
    CU_ASSERT_FATAL(qarray_plan_make(p, "test", 2, (const int[]){rows, out}, qtype_find(type, &err), &o, &err) ==
                    QT_OK);
}

static void check_rows_and_cols(int threads) {
    CU_ASSERT_FATAL(parallel_set_threads(threads) == threads);
    const int rows = 700, out = 24; /* 16,800 values: big enough to split at 2 threads with tile 0 */
    float *g = edge_data((size_t)rows * out, 600, 0.003f);
    float *u = test_random_uniform((size_t)rows * out, 601, 0.0f, 1.0f);
    float *v = malloc((size_t)rows * out * sizeof *v), *want = malloc((size_t)rows * out * sizeof *want);
    float *s = malloc((size_t)rows * out * sizeof *s), *part = malloc(PARALLEL_MAX_THREADS * out * sizeof *part);
    int8_t *q = malloc((size_t)rows * out);
    float buf[700];
    const FqtNoise noises[] = {{NULL, 0, 0}, {u, 1, 0}, {u, 0, 1}, {u, (size_t)out, 1}};
    for (size_t k = 0; k < sizeof noises / sizeof *noises; k++) {
        const FqtNoise *z = &noises[k];
        QArrayPlan p;
        make_plan(&p, k == 3 ? "int4" : "int8", rows, out, z->u != NULL, NULL);
        CU_ASSERT_FATAL(fqt_plan_fast(&p));
        /* per row */
        CU_ASSERT(fqt_quant_rows(q, v, s, g, rows, out, &p, z));
        for (int r = 0; r < rows; r++) {
            float sr = general_scale(&p, g + (size_t)r * out, (size_t)out);
            CU_ASSERT(s[r] == sr);
            for (int o = 0; o < out; o++)
                want[(size_t)r * out + o] = general_value(&p, g[(size_t)r * out + o], sr,
                                                          z->u ? z->u[r * z->row_step + o * z->col_step] : 0.0f);
        }
        CU_ASSERT(same_bits(v, want, (size_t)rows * out * sizeof *v));
        for (size_t i = 0; i < (size_t)rows * out; i++) CU_ASSERT_EQUAL_FATAL((float)q[i] * s[i / out], v[i]);
        /* per column, over tiles (the last shorter) and over all rows */
        for (int tile = 0; tile <= 300; tile += 300) {
            int t_rows = tile ? tile : rows;
            CU_ASSERT(fqt_quant_cols(NULL, v, s, part, g, rows, out, tile, &p, z));
            for (int r0 = 0, t = 0; r0 < rows; r0 += t_rows, t++)
                for (int o = 0; o < out; o++) {
                    int n = rows - r0 < t_rows ? rows - r0 : t_rows;
                    for (int i = 0; i < n; i++) buf[i] = g[(size_t)(r0 + i) * out + o];
                    float sc = general_scale(&p, buf, (size_t)n);
                    CU_ASSERT(s[(size_t)t * out + o] == sc);
                    for (int i = 0; i < n; i++) {
                        size_t r = (size_t)(r0 + i);
                        want[r * out + o] = general_value(&p, buf[i], sc,
                                                          z->u ? z->u[r * z->row_step + o * z->col_step] : 0.0f);
                    }
                }
            CU_ASSERT(same_bits(v, want, (size_t)rows * out * sizeof *v));
        }
    }
    /* one scale for the whole array */
    QArrayPlan p;
    make_plan(&p, "int8", rows, out, false, NULL);
    float st;
    CU_ASSERT(fqt_quant_tensor(q, v, &st, part, g, (size_t)rows * out, &p));
    float sw = general_scale(&p, g, (size_t)rows * out);
    CU_ASSERT(st == sw);
    for (size_t i = 0; i < (size_t)rows * out; i++) {
        CU_ASSERT_EQUAL_FATAL(v[i], general_value(&p, g[i], sw, 0.0f));
        CU_ASSERT_EQUAL_FATAL((float)q[i] * sw, v[i]);
    }
    /* a non-finite value: false, so that the caller's general path says where */
    g[(size_t)rows * out - 3] = INFINITY;
    CU_ASSERT(!fqt_quant_rows(q, v, s, g, rows, out, &p, &noises[0]));
    CU_ASSERT(!fqt_quant_cols(q, v, s, part, g, rows, out, 0, &p, &noises[0]));
    CU_ASSERT(!fqt_quant_tensor(q, v, &st, part, g, (size_t)rows * out, &p));
    free(g), free(u), free(v), free(want), free(s), free(part), free(q);
    parallel_set_threads(1);
}

static void test_drivers_1_thread(void) { check_rows_and_cols(1); }
static void test_drivers_2_threads(void) { check_rows_and_cols(2); }

/* Drivers on every family this CPU has, the portable kernels included: the same bits. */
static void test_drivers_families(void) {
    fqt_kern_cap(FQT_KERN_PORTABLE);
    CU_ASSERT_STRING_EQUAL(fqt_kern_name(), "portable");
    check_rows_and_cols(2);
    for_each_family("drivers = general rules, each family", test_drivers_2_threads);
}

/* The column driver on g as the layer's output lays it, (N, OC, P), equals fqt_quant_cols on the (N*P, OC)
 * matrix: the same scales and codes (chunk-major). */
static void check_grad_layout(int N, int OC, int P, int tile, int z_kind, const char *type) {
    const int rows = N * P;
    const size_t n = (size_t)rows * OC;
    float *g = edge_data(n, 700 + (size_t)P, 0.004f), *m = malloc(n * sizeof *m); /* m: (rows, OC) */
    for (int i = 0; i < N; i++)
        for (int o = 0; o < OC; o++)
            for (int p = 0; p < P; p++) m[((size_t)i * P + p) * OC + o] = g[((size_t)i * OC + o) * P + p];
    float *u = test_random_uniform(n, 701, 0.0f, 1.0f);
    const FqtNoise zs[] = {{NULL, 0, 0}, {u, 1, 0}, {u, 0, 1}, {u, (size_t)OC, 1}};
    const FqtNoise *z = &zs[z_kind];
    QArrayPlan p;
    make_plan(&p, type, rows, OC, z->u != NULL, NULL);
    float *want = malloc(n * sizeof *want), *s_want = malloc(n * sizeof *s_want);
    float *part = malloc(PARALLEL_MAX_THREADS * (size_t)(P > OC ? P : OC) * sizeof *part);
    int8_t *q = malloc(n), *q_want = malloc(n);
    const int t_rows = tile > 0 && tile < rows ? tile : rows, tiles = (rows + t_rows - 1) / t_rows;
    float *s_col = malloc((size_t)tiles * OC * sizeof *s_col);
    CU_ASSERT(fqt_quant_grad_cols(q, s_col, g, N, OC, P, tile, &p, z));
    CU_ASSERT(fqt_quant_cols(q_want, want, s_want, part, m, rows, OC, tile, &p, z));
    CU_ASSERT(same_bits(s_col, s_want, (size_t)tiles * OC * sizeof *s_col));
    bool same = true;
    for (int r0 = 0; r0 < rows;) {
        const int r1 = fqt_dw_chunk_end(r0, rows, tile), L = r1 - r0;
        for (int o = 0; o < OC; o++)
            for (int r = r0; r < r1; r++) same &= q[(size_t)r0 * OC + (size_t)o * L + (r - r0)] == q_want[(size_t)r * OC + o];
        r0 = r1;
    }
    CU_ASSERT(same);
    free(g), free(m), free(u), free(want), free(s_want), free(part), free(q), free(q_want);
    free(s_col);
}

static void test_grad_layout(void) {
    for (int threads = 1; threads <= 2; threads++) {
        CU_ASSERT_FATAL(parallel_set_threads(threads) == threads);
        for (int z = 0; z < 4; z++) {
            check_grad_layout(3, 13, 49, 0, z, "int8");   /* conv-like: 147 rows */
            check_grad_layout(5, 8, 20, 33, z, "int4");   /* tiles that cut images */
            check_grad_layout(40, 24, 1, 7, z, "int8");   /* dense: P = 1 */
            check_grad_layout(2, 4, 600, 0, z, "int8");   /* big enough to split over threads */
        }
    }
    check_grad_layout(1, 2, 70000, 0, 1, "int8"); /* two chunks of one tile */
    parallel_set_threads(1);
}

static void test_chunk_ends(void) {
    CU_ASSERT_EQUAL(fqt_dw_chunk_end(0, 10, 0), 10);
    CU_ASSERT_EQUAL(fqt_dw_chunk_end(0, 10, 4), 4);
    CU_ASSERT_EQUAL(fqt_dw_chunk_end(8, 10, 4), 10);
    CU_ASSERT_EQUAL(fqt_dw_chunk_end(0, 200000, 0), FQT_DW_CHUNK);
    CU_ASSERT_EQUAL(fqt_dw_chunk_end(FQT_DW_CHUNK, 200000, 100000), 100000);
    CU_ASSERT_EQUAL(fqt_dw_chunk_end(100000, 200000, 100000), 100000 + FQT_DW_CHUNK);
}

static void test_plan_fast_cases(void) {
    QArrayPlan p;
    make_plan(&p, "int8", 4, 4, true, NULL);
    CU_ASSERT(fqt_plan_fast(&p));
    make_plan(&p, "int4", 4, 4, false, NULL);
    CU_ASSERT(fqt_plan_fast(&p));
    make_plan(&p, "fp8_e4m3", 4, 4, false, NULL);
    CU_ASSERT(!fqt_plan_fast(&p)); /* a float format: the general rules */
    make_plan(&p, "uint8", 4, 4, false, NULL);
    CU_ASSERT(!fqt_plan_fast(&p));
    CalibSpec pct = {.kind = CALIB_PERCENTILE, .p = 99.9, .s = 1.0};
    make_plan(&p, "int8", 4, 4, false, &pct);
    CU_ASSERT(!fqt_plan_fast(&p)); /* another calibration */
    CalibSpec half = {.kind = CALIB_ABSMAX, .s = 0.5};
    make_plan(&p, "int8", 4, 4, false, &half); /* absmax scaled: still the fast path, with its factor */
    CU_ASSERT(fqt_plan_fast(&p));
    float g[16], v[16], s[4], want;
    for (int i = 0; i < 16; i++) g[i] = (float)(i - 7) * 0.37f;
    CU_ASSERT(fqt_quant_rows(NULL, v, s, g, 4, 4, &p, &(FqtNoise){0}));
    want = general_scale(&p, g, 4);
    CU_ASSERT(s[0] == want);
}

int register_quant_qt_kern_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qt_kern", NULL, NULL);
    if (!s) return 1;
    printf("  quant_qt_kern: kernels %s\n", fqt_kern_name());
    return !CU_add_test(s, "absmax: fast = ref", test_absmax_twins) ||
           !CU_add_test(s, "column absmax: fast = ref", test_col_absmax_twins) ||
           !CU_add_test(s, "masked absmax: fast = ref = the pooled plane's absmax", test_masked_absmax_twins) ||
           !CU_add_test(s, "span: fast = ref", test_span_twins) ||
           !CU_add_test(s, "STE clip: fast = ref", test_ste_clip_twins) ||
           !CU_add_test(s, "sum: fast = ref", test_sum_twins) ||
           !CU_add_test(s, "plane stats: fast = ref", test_plane_stats_twins) ||
           !CU_add_test(s, "int32 scaling: fast = ref", test_scale_i32_twins) ||
           !CU_add_test(s, "scales of maxima = the drivers' scale", test_scales_of_amax) ||
           !CU_add_test(s, "drivers = general rules, 1 thread", test_drivers_1_thread) ||
           !CU_add_test(s, "drivers = general rules, 2 threads", test_drivers_2_threads) ||
           !CU_add_test(s, "drivers on every kernel family", test_drivers_families) ||
           !CU_add_test(s, "which plans take the fast path", test_plan_fast_cases) ||
           !CU_add_test(s, "g's columns in the output's layout = the (rows, out) driver", test_grad_layout) ||
           !CU_add_test(s, "dW's contraction chunks", test_chunk_ends);
}
