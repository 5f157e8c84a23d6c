/* test_qgemm_x86.c - the integer kernels of qgemm.h: each vector family
 * (AVX-512 VNNI, AVX-VNNI, AVX2; a visible skip for each the CPU lacks),
 * the portable kernels and the scalar definitions agree bit for bit on odd shapes (int32 sums and float
 * outputs, with the taps' relu and relu + 2x2 max pool epilogues against
 * nn's pool2x2_window), split ranges give the whole, the activation
 * quantizers equal fake quantization's rounding (one plane, or four into
 * dwords), qgemm_s8 on both paths, the packers' errors. Registers the quant_int8 suite (with test_qlayer_int8.c). On a
 * CPU without any vector family the "fast" runs are the portable kernels
 * again. */
#include <CUnit/CUnit.h>
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/pool2x2.h"
#include "base/rng.h"
#include "quant/qgemm.h"
#include "quant/fqt.h"
#include "test_int8.h"
#include "test_util.h"

static void *xmalloc(size_t n) {
    void *p = calloc(n ? n : 1, 1); /* zeroed: no read of malloc garbage, even in the compiler's eyes */
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    return p;
}

static void fill_bytes(uint8_t *p, size_t n, Rng *r) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)rng_below(r, 256);
}

static bool same_or_say(const void *a, const void *b, size_t bytes, const char *what) {
    if (memcmp(a, b, bytes) == 0) return true;
    fprintf(stderr, "\n  %s differ (%s kernels)\n", what, qgemm_kernel_name());
    return false;
}

/* The vector families, each run through the dispatching functions (qgemm_force_isa). */
static const struct {
    QGemmIsa isa;
    const char *name;
} FAMILIES[] = {{QGEMM_ISA_AMX, "AMX"},
                {QGEMM_ISA_AVX512_VNNI, "AVX-512 VNNI"},
                {QGEMM_ISA_AVXVNNI, "AVX-VNNI"},
                {QGEMM_ISA_AVX2, "AVX2"}};

/* cases() once per vector family the CPU has, a skip naming each it lacks; at least once (portable) anywhere. */
static void for_each_family(void (*cases)(void), const char *what) {
    int ran = 0;
    for (size_t i = 0; i < sizeof FAMILIES / sizeof *FAMILIES; i++) {
        if (!qgemm_cpu_has_isa(FAMILIES[i].isa)) {
            test_skip("%s on the %s kernels: this CPU has no %s", what, FAMILIES[i].name, FAMILIES[i].name);
            continue;
        }
        qgemm_force_isa = FAMILIES[i].isa;
        CU_ASSERT_EQUAL(qgemm_isa(), FAMILIES[i].isa);
        cases();
        ran++;
    }
    qgemm_force_isa = -1;
    if (!ran) cases();
}

/* ---- dense ----------------------------------------------------------------------------------------------------- */

/* c (M, N) through the dispatching kernel (portable or not) in pieces: rows in thirds, panels one by one. */
static void dense_in_pieces(const QGemmDense *d, bool portable) {
    int cuts[4] = {0, d->m / 3, 2 * d->m / 3, d->m};
    for (int i = 0; i < 3; i++)
        for (int p = 0; p < d->b->panels; p++) {
            if (portable) qgemm_dense_portable(d, cuts[i], cuts[i + 1], p, p + 1);
            else qgemm_dense(d, cuts[i], cuts[i + 1], p, p + 1);
        }
}

/* extremes: 1, every code at the end that makes the longest sum; 2, each code at random at one end (a in
 * {0, 255}, b in {-128, 127}: two such products overflow vpmaddubsw's int16). */
static void dense_case(int M, int N, int K, int a_zero, uint64_t seed, int extremes) {
    char what[96];
    snprintf(what, sizeof what, "dense (%d, %d, %d) a_zero %d%s", M, N, K, a_zero,
             extremes == 1 ? " extremes" : extremes ? " mixed extremes" : "");
    Rng r;
    rng_init(&r, seed, 3);
    uint8_t *a = xmalloc((size_t)M * K); /* exactly M*K: reading past a row end is an ASan error */
    int8_t *b = xmalloc((size_t)N * K);
    fill_bytes(a, (size_t)M * K, &r);
    fill_bytes((uint8_t *)b, (size_t)N * K, &r);
    if (extremes == 1) {
        memset(a, a_zero < 128 ? 255 : 0, (size_t)M * K);
        memset(b, 0x80, (size_t)N * K); /* -128 */
    } else if (extremes) {
        for (size_t i = 0; i < (size_t)M * K; i++) a[i] = rng_below(&r, 2) ? 255 : 0;
        for (size_t i = 0; i < (size_t)N * K; i++) b[i] = rng_below(&r, 2) ? 127 : -128;
    }
    QGemmPackedB p;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_b(&p, b, N, K, &err), QT_OK);
    const int ldc = N + 3; /* a gap the kernels must not touch */
    size_t nc = (size_t)M * ldc;
    int32_t *ref = xmalloc((size_t)M * N * sizeof *ref), *c1 = xmalloc(nc * 4), *c2 = xmalloc(nc * 4);
    float *f1 = xmalloc(nc * 4), *f2 = xmalloc(nc * 4), *want = xmalloc(nc * 4);
    float *scale = xmalloc((size_t)N * 4), *bias = xmalloc((size_t)N * 4);
    for (int j = 0; j < N; j++) scale[j] = 1e-3f * (1.0f + (float)rng_below(&r, 1000)), bias[j] = (float)j - 7.25f;
    qgemm_u8s8_ref(ref, a, a_zero, b, M, N, K);

    memset(c1, 0x5a, nc * 4), memset(c2, 0x5a, nc * 4);
    QGemmDense d = {.a = a, .lda = K, .m = M, .a_zero = a_zero, .b = &p, .c_i32 = c1, .ldc = ldc};
    qgemm_dense(&d, 0, M, 0, p.panels);
    d.c_i32 = c2;
    dense_in_pieces(&d, true);
    bool ok = memcmp(c1, c2, nc * 4) == 0; /* the gaps too */
    for (int i = 0; i < M; i++) ok &= memcmp(c1 + (size_t)i * ldc, ref + (size_t)i * N, (size_t)N * 4) == 0;
    if (!ok) fprintf(stderr, "\n  %s: int32 sums differ\n", what);
    CU_ASSERT(ok);

    /* float outputs: fmaf of the exact sum, with and without a bias */
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        memset(f1, 0x5a, nc * 4), memset(f2, 0x5a, nc * 4), memset(want, 0x5a, nc * 4);
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++)
                want[(size_t)i * ldc + j] = fmaf((float)ref[(size_t)i * N + j], scale[j], with_bias ? bias[j] : 0.0f);
        QGemmDense df = {.a = a, .lda = K, .m = M, .a_zero = a_zero, .b = &p, .c_f32 = f1, .ldc = ldc,
                         .scale = scale, .bias = with_bias ? bias : NULL};
        dense_in_pieces(&df, false);
        df.c_f32 = f2;
        qgemm_dense_portable(&df, 0, M, 0, p.panels);
        CU_ASSERT(same_or_say(f1, want, nc * 4, what));
        CU_ASSERT(same_or_say(f2, want, nc * 4, what));
    }
    /* the plain entry */
    qgemm_u8s8(c1, a, a_zero, &p, M);
    CU_ASSERT(same_or_say(c1, ref, (size_t)M * N * 4, what));
    qgemm_packed_b_free(&p);
    CU_ASSERT_PTR_NULL(p.data);
    free(a), free(b), free(ref), free(c1), free(c2), free(f1), free(f2), free(want), free(scale), free(bias);
}

static void dense_cases(void) {
    static const int MS[] = {1, 7, 8, 9, 23}, NS[] = {1, 15, 16, 17, 47, 49, 97}, KS[] = {1, 3, 4, 5, 63, 785};
    uint64_t seed = 1;
    for (size_t i = 0; i < sizeof MS / sizeof *MS; i++)
        for (size_t j = 0; j < sizeof NS / sizeof *NS; j++)
            for (size_t k = 0; k < sizeof KS / sizeof *KS; k++)
                dense_case(MS[i], NS[j], KS[k], (int)(seed * 37 % 256), seed, 0), seed++;
    dense_case(13, 33, 3001, 128, 90, 0);
    dense_case(5, 18, 4099, 0, 91, 1);      /* 255 * -128 summed */
    dense_case(3, 17, 4098, 255, 92, 1);    /* (0 - 255) * -128 summed */
    dense_case(2, 3, QGEMM_K_MAX, 0, 93, 1); /* the longest exact sum: -2^31 + 2^23 */
    for (int z = 0; z < 256; z += 51) dense_case(6, 21, 37, z, 94 + (uint64_t)z, 2); /* mixed extremes */
    dense_case(9, 40, 1001, 255, 95, 2);
}

static void test_dense(void) { for_each_family(dense_cases, "dense"); }

/* ---- taps ------------------------------------------------------------------------------------------------------ */

/* The definition: y of row i at pixel q (vector q / 16, lane q % 16) for the taps at off. */
static float taps_def(const uint8_t *act, const int32_t *off, const uint32_t *w, int taps, int a_zero, float scale,
                      float bias, int i, int q) {
    int64_t s = 0;
    for (int t = 0; t < taps; t++)
        for (int j = 0; j < 4; j++)
            s += ((int64_t)act[4 * ((size_t)off[t] + (size_t)q) + j] - a_zero) *
                 (int8_t)(uint8_t)(w[(size_t)i * taps + t] >> (8 * j));
    return fmaf((float)s, scale, bias);
}

static float relu_def(float y) { return y > 0.0f ? y : 0.0f; }

/* Random taps operands: offsets off [taps] in 0..40, act of n_vec vectors past the last offset, weights w
 * (rows, taps), scale and bias [rows]. With relu, bias spreads y around 0, and row 2 has a NaN bias (relu gives
 * 0). extremes: codes only 0 or 255, weights only -128 or 127 (vpmaddubsw would saturate on them). Free with
 * taps_operands_free. */
typedef struct {
    int32_t *off;
    uint8_t *act;
    uint32_t *w;
    float *scale, *bias;
} TapsOperands;

/* stride > 0: tap t at 3 + t stride (one strided operand, as a 1x1 convolution's channel quads: the AMX tiles);
 * else offsets drawn in [0, 40]. */
static TapsOperands taps_operands_at(int rows, int taps, int n_vec, bool relu, bool extremes, int stride, Rng *r) {
    TapsOperands o = {.off = xmalloc((size_t)taps * 4), .w = xmalloc((size_t)rows * taps * 4),
                      .scale = xmalloc((size_t)rows * 4), .bias = xmalloc((size_t)rows * 4)};
    int max_off = 0;
    for (int t = 0; t < taps; t++) {
        o.off[t] = stride > 0 ? 3 + t * stride : (int32_t)rng_below(r, 41);
        max_off = o.off[t] > max_off ? o.off[t] : max_off;
    }
    size_t n_act = (size_t)(max_off + QGEMM_LANES * n_vec) * 4; /* exactly what the kernels may read */
    o.act = xmalloc(n_act);
    fill_bytes(o.act, n_act, r);
    fill_bytes((uint8_t *)o.w, (size_t)rows * taps * 4, r);
    if (extremes) {
        for (size_t i = 0; i < n_act; i++) o.act[i] = rng_below(r, 2) ? 255 : 0;
        for (size_t i = 0; i < (size_t)rows * taps * 4; i++) ((uint8_t *)o.w)[i] = rng_below(r, 2) ? 0x7f : 0x80;
    }
    for (int i = 0; i < rows; i++) {
        o.scale[i] = 1e-4f * (float)(1 + rng_below(r, 500));
        o.bias[i] = relu ? 0.01f * (float)((int)rng_below(r, 201) - 100) : 0.5f * (float)i;
    }
    if (relu && rows > 2) o.bias[2] = NAN;
    return o;
}

static TapsOperands taps_operands(int rows, int taps, int n_vec, bool relu, bool extremes, Rng *r) {
    return taps_operands_at(rows, taps, n_vec, relu, extremes, 0, r);
}

static void taps_operands_free(TapsOperands *o) {
    free(o->off), free(o->act), free(o->w), free(o->scale), free(o->bias);
}

/* The AVX2 family's widened codes, filled with garbage (the kernel must write what it reads), or NULL for the
 * others. */
static int16_t *taps_act_wide(const QGemmTaps *g) {
    const size_t n = qgemm_taps_act_wide_bytes(g);
    if (!n) return NULL;
    int16_t *w = aligned_alloc(64, (n + 63) / 64 * 64);
    CU_ASSERT_PTR_NOT_NULL_FATAL(w);
    memset(w, 0xa5, n);
    return w;
}

static void taps_case_at(int rows, int taps, int n_vec, int a_zero, QGemmEpi epi, uint64_t seed, bool extremes,
                         int stride) {
    char what[128];
    snprintf(what, sizeof what, "taps rows %d taps %d vectors %d a_zero %d%s%s stride %d", rows, taps, n_vec, a_zero,
             epi == QGEMM_EPI_RELU ? " relu" : "", extremes ? " extremes" : "", stride);
    Rng r;
    rng_init(&r, seed, 4);
    TapsOperands op = taps_operands_at(rows, taps, n_vec, epi != QGEMM_EPI_NONE, extremes, stride, &r);
    uint16_t *mask = xmalloc((size_t)n_vec * 2);
    int32_t *pos = xmalloc((size_t)n_vec * 4);
    int total = 0;
    for (int v = 0; v < n_vec; v++) {
        uint32_t m = rng_below(&r, 4) == 0 ? 0xFFFF : rng_below(&r, 65536);
        if (v == 1) m = 0; /* a vector with no output */
        mask[v] = (uint16_t)m, pos[v] = total, total += __builtin_popcount(m);
    }
    const size_t ldo = (size_t)total + 2, n_out = (size_t)rows * ldo;
    float *want = xmalloc(n_out * 4), *o1 = xmalloc(n_out * 4), *o2 = xmalloc(n_out * 4);
    memset(want, 0x5a, n_out * 4), memset(o1, 0x5a, n_out * 4), memset(o2, 0x5a, n_out * 4);
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < n_vec; v++)
            for (int l = 0, at = 0; l < QGEMM_LANES; l++) {
                if (!(mask[v] >> l & 1)) continue;
                float y = taps_def(op.act, op.off, op.w, taps, a_zero, op.scale[i], op.bias[i], i, v * QGEMM_LANES + l);
                want[(size_t)i * ldo + pos[v] + at++] = epi == QGEMM_EPI_RELU ? relu_def(y) : y;
            }
    QGemmPackedTaps p;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_taps(&p, op.w, rows, taps, &err), QT_OK);
    QGemmTaps g = {.act = op.act, .tap_off = op.off, .n_vec = n_vec, .vec_mask = mask, .vec_pos = pos, .w = &p,
                   .a_zero = a_zero, .out = o1, .ldo = ldo, .scale = op.scale, .bias = op.bias, .epi = epi};
    g.act_wide = taps_act_wide(&g);
    for (int rb = 0; rb < p.row_blocks; rb++) /* in pieces: row blocks, vectors split in two */
        qgemm_taps(&g, rb, rb + 1, 0, n_vec / 2), qgemm_taps(&g, rb, rb + 1, n_vec / 2, n_vec);
    free(g.act_wide);
    g.out = o2;
    qgemm_taps_portable(&g, 0, p.row_blocks, 0, n_vec);
    CU_ASSERT(same_or_say(o1, want, n_out * 4, what));
    CU_ASSERT(same_or_say(o2, want, n_out * 4, what));
    qgemm_packed_taps_free(&p);
    taps_operands_free(&op);
    free(mask), free(pos), free(want), free(o1), free(o2);
}

static void taps_case(int rows, int taps, int n_vec, int a_zero, QGemmEpi epi, uint64_t seed, bool extremes) {
    taps_case_at(rows, taps, n_vec, a_zero, epi, seed, extremes, 0);
}

/* The relu + 2x2 max pool epilogue: pixel q is output pixel (q / pitch, q % pitch) of an (OH, OW) output; the
 * windows against pool2x2_window on the relu'd definition. Row 0 has all-zero weights: every window ties. */
static void taps_pool_case(int rows, int taps, int pitch, int OH, int OW, int a_zero, uint64_t seed, bool extremes) {
    char what[128];
    snprintf(what, sizeof what, "taps pool rows %d taps %d pitch %d output %dx%d a_zero %d%s", rows, taps, pitch, OH,
             OW, a_zero, extremes ? " extremes" : "");
    Rng r;
    rng_init(&r, seed, 6);
    const int n_vec = (OH * pitch + QGEMM_LANES - 1) / QGEMM_LANES, PH = OH / 2, PW = OW / 2;
    TapsOperands op = taps_operands(rows, taps, n_vec, true, extremes, &r);
    memset(op.w, 0, (size_t)taps * 4);
    op.bias[0] = 0.75f;
    const size_t ldo = (size_t)PH * PW + 3, n_out = (size_t)rows * ldo; /* a gap the kernels must not touch */
    float *want = xmalloc(n_out * 4), *o1 = xmalloc(n_out * 4), *o2 = xmalloc(n_out * 4);
    memset(want, 0x5a, n_out * 4), memset(o1, 0x5a, n_out * 4), memset(o2, 0x5a, n_out * 4);
    for (int i = 0; i < rows; i++)
        for (int ph = 0; ph < PH; ph++)
            for (int pw = 0; pw < PW; pw++) {
                float v[4];
                for (int k = 0; k < 4; k++) {
                    const int q = (2 * ph + k / 2) * pitch + 2 * pw + k % 2;
                    v[k] = relu_def(taps_def(op.act, op.off, op.w, taps, a_zero, op.scale[i], op.bias[i], i, q));
                }
                int winner;
                want[(size_t)i * ldo + (size_t)ph * PW + pw] = pool2x2_window(v[0], v[1], v[2], v[3], &winner);
            }
    QGemmPackedTaps p;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_taps(&p, op.w, rows, taps, &err), QT_OK);
    float *buf = aligned_alloc(64, (size_t)QGEMM_ROWS * n_vec * QGEMM_LANES * 4);
    CU_ASSERT_PTR_NOT_NULL_FATAL(buf);
    QGemmTaps g = {.act = op.act, .tap_off = op.off, .n_vec = n_vec, .w = &p, .a_zero = a_zero, .out = o1, .ldo = ldo,
                   .scale = op.scale, .bias = op.bias, .epi = QGEMM_EPI_RELU_POOL2, .pitch = pitch, .pool_h = PH,
                   .pool_w = PW, .pool_buf = buf};
    g.act_wide = taps_act_wide(&g);
    for (int rb = 0; rb < p.row_blocks; rb++) /* row blocks one by one; a vector range is ignored */
        qgemm_taps(&g, rb, rb + 1, 1, n_vec / 2);
    free(g.act_wide);
    g.out = o2;
    qgemm_taps_portable(&g, 0, p.row_blocks, 0, 0);
    CU_ASSERT(same_or_say(o1, want, n_out * 4, what));
    CU_ASSERT(same_or_say(o2, want, n_out * 4, what));
    qgemm_packed_taps_free(&p);
    taps_operands_free(&op);
    free(buf), free(want), free(o1), free(o2);
}

static void taps_cases(void) {
    static const int ROWS[] = {1, 7, 8, 9, 33}, TAPS[] = {1, 3, 9, 72}, VECS[] = {1, 2, 3, 4, 14};
    uint64_t seed = 100;
    for (size_t i = 0; i < sizeof ROWS / sizeof *ROWS; i++)
        for (size_t j = 0; j < sizeof TAPS / sizeof *TAPS; j++)
            for (size_t k = 0; k < sizeof VECS / sizeof *VECS; k++)
                taps_case(ROWS[i], TAPS[j], VECS[k], (int)(seed * 61 % 256), QGEMM_EPI_NONE, seed, false), seed++;
    taps_case(16, 2000, 5, 128, QGEMM_EPI_NONE, 7, false); /* 8000-long sums */
    for (int z = 0; z < 256; z += 51) /* zero points 0 .. 255 on codes and weights at their ends */
        taps_case(9, 40, 3, z, z % 2 ? QGEMM_EPI_RELU : QGEMM_EPI_NONE, 8 + (uint64_t)z, true);
    taps_case(8, 2000, 2, 0, QGEMM_EPI_NONE, 9, true);
    /* taps at one stride, 16 of them a multiple (the AMX family's tiles; the others run them as any taps): rows
     * that leave a tile half full or cross blocks, 1-7 vectors (a last group of fewer than 4), strides shorter and
     * longer than a vector, relu, codes and weights at their ends, the K of DS-CNN's pointwise convs and more */
    static const int SROWS[] = {1, 8, 12, 16, 24, 64, 70}, STAPS[] = {16, 32, 48}, SVECS[] = {1, 3, 4, 5, 7};
    for (size_t i = 0; i < sizeof SROWS / sizeof *SROWS; i++)
        for (size_t j = 0; j < sizeof STAPS / sizeof *STAPS; j++)
            for (size_t k = 0; k < sizeof SVECS / sizeof *SVECS; k++, seed++)
                taps_case_at(SROWS[i], STAPS[j], SVECS[k], (int)(seed * 37 % 256),
                             seed % 2 ? QGEMM_EPI_RELU : QGEMM_EPI_NONE, seed, seed % 7 == 0,
                             seed % 3 == 0 ? 5 : 16 * SVECS[k] + 4 * (int)(seed % 4));
}

static void test_taps(void) { for_each_family(taps_cases, "taps"); }

static void taps_epi_cases(void) {
    static const int ROWS[] = {1, 3, 8, 9, 33}, TAPS[] = {1, 3, 72}, VECS[] = {1, 3, 4, 14};
    uint64_t seed = 300;
    for (size_t i = 0; i < sizeof ROWS / sizeof *ROWS; i++)
        for (size_t j = 0; j < sizeof TAPS / sizeof *TAPS; j++)
            for (size_t k = 0; k < sizeof VECS / sizeof *VECS; k++)
                taps_case(ROWS[i], TAPS[j], VECS[k], (int)(seed * 61 % 256), QGEMM_EPI_RELU, seed, false), seed++;
    /* {pitch, OH, OW}: rows of 1, 2 or 3 whole vectors (pooled in registers: the CNN's 16 and 32 pixels a row),
     * other pitches (through the buffer), odd sizes (the last row or column is left out), windows past 16 columns,
     * one window */
    static const int GEO[][3] = {{16, 14, 14}, {32, 28, 28}, {16, 5, 16}, {32, 7, 31}, {48, 6, 45}, {48, 4, 48},
                                 {48, 3, 33}, {30, 28, 28}, {9, 7, 7}, {11, 6, 11}, {40, 5, 37}, {2, 2, 2}, {5, 3, 4}};
    for (size_t i = 0; i < sizeof GEO / sizeof *GEO; i++)
        for (size_t j = 0; j < sizeof ROWS / sizeof *ROWS; j++) {
            taps_pool_case(ROWS[j], 3, GEO[i][0], GEO[i][1], GEO[i][2], (int)(seed * 61 % 256), seed, false), seed++;
            if (j % 2) taps_pool_case(ROWS[j], 72, GEO[i][0], GEO[i][1], GEO[i][2], 0, seed, false), seed++;
        }
    for (size_t i = 0; i < sizeof GEO / sizeof *GEO; i += 3) /* codes and weights at their ends */
        taps_pool_case(9, 20, GEO[i][0], GEO[i][1], GEO[i][2], (int)(i * 29 % 256), seed, true), seed++;
}

static void test_taps_relu_pool(void) { for_each_family(taps_epi_cases, "taps relu and relu + 2x2 max pool"); }

/* ---- quantizing ------------------------------------------------------------------------------------------------ */

static void quantize_case(size_t n, float s, int qmin, int qmax, int zp, int shift, uint64_t seed) {
    Rng r;
    rng_init(&r, seed, 5);
    float *x = xmalloc(n * 4);
    for (size_t i = 0; i < n; i++) {
        switch (rng_below(&r, 5)) {
        case 0: x[i] = ((float)(int)rng_below(&r, 600) - 300.0f + 0.5f) * s; break; /* ties */
        case 1: x[i] = (float)(int)rng_below(&r, 2000) * 1e3f - 1e6f; break;       /* clipped */
        case 2: /* a few ulps either side of a tie: the quotient through 1 / s may round otherwise there */
            x[i] = ((float)(int)rng_below(&r, 600) - 300.0f + 0.5f) * s;
            for (int u = (int)rng_below(&r, 7) - 3; u != 0; u += u > 0 ? -1 : 1) x[i] = nextafterf(x[i], u * INFINITY);
            break;
        default: x[i] = ((float)rng_below(&r, 1u << 20) / (float)(1u << 20) - 0.5f) * 300.0f * s; break;
        }
    }
    const float lo = (float)(qmin - zp), hi = (float)(qmax - zp);
    uint8_t *want = xmalloc(n), *u1 = xmalloc(n), *u2 = xmalloc(n);
    for (size_t i = 0; i < n; i++) /* fake quantization's code, shifted */
        want[i] = (uint8_t)((int)rintf(fminf(fmaxf(x[i] / s, lo), hi)) + zp + shift);
    CU_ASSERT(qgemm_quantize_u8(u1, x, n, s, lo, hi, zp + shift));
    CU_ASSERT(qgemm_quantize_u8_portable(u2, x, n, s, lo, hi, zp + shift));
    CU_ASSERT(same_or_say(u1, want, n, "quantized codes"));
    CU_ASSERT(same_or_say(u2, want, n, "portable quantized codes"));
    /* a NaN or an infinity anywhere, the tail included, is reported */
    for (size_t at = 0; n && at < n; at += n / 3 + 1) {
        float keep = x[at];
        x[at] = at % 2 ? NAN : -INFINITY;
        CU_ASSERT(!qgemm_quantize_u8(u1, x, n, s, lo, hi, zp + shift));
        CU_ASSERT(!qgemm_quantize_u8_portable(u2, x, n, s, lo, hi, zp + shift));
        CU_ASSERT_EQUAL(u1[at], u2[at]); /* NaN -> lo, -inf -> lo */
        x[at] = keep;
    }
    x[n - 1] = FLT_MAX; /* large but finite */
    CU_ASSERT(qgemm_quantize_u8(u1, x, n, s, lo, hi, zp + shift));
    CU_ASSERT_EQUAL(u1[n - 1], (uint8_t)(qmax + shift));
    free(x), free(want), free(u1), free(u2);
}

/* Four planes (rows, ldx) to dwords (rows, ldd): byte k of a dword the code qgemm_quantize_u8 gives plane k's
 * value, or zero for a missing plane (bit k of absent); nothing between rows is written. */
static void quantize_x4_case(int rows, int n, int absent, uint64_t seed) {
    char what[96];
    snprintf(what, sizeof what, "four planes of %d x %d, absent 0x%x", rows, n, absent);
    Rng r;
    rng_init(&r, seed, 7);
    const size_t ldx = (size_t)n + 3, ldd = (size_t)n + 2, nx = (size_t)rows * ldx, nd = (size_t)rows * ldd;
    const QGemmCodes c = {.s = 0.021f, .lo = -100.0f, .hi = 155.0f, .zero = 100};
    float *x = xmalloc(4 * nx * 4);
    for (size_t i = 0; i < 4 * nx; i++) {
        x[i] = ((float)rng_below(&r, 1u << 20) / (float)(1u << 20) - 0.5f) * 400.0f * c.s;
        if (i % 5 == 0) x[i] = ((float)(int)rng_below(&r, 300) - 150.0f + 0.5f) * c.s; /* ties */
    }
    const float *planes[4];
    for (int k = 0; k < 4; k++) planes[k] = absent >> k & 1 ? NULL : x + (size_t)k * nx;
    uint32_t *want = xmalloc(nd * 4), *d1 = xmalloc(nd * 4), *d2 = xmalloc(nd * 4);
    uint8_t *u = xmalloc((size_t)n);
    memset(want, 0xa5, nd * 4), memset(d1, 0xa5, nd * 4), memset(d2, 0xa5, nd * 4);
    for (int h = 0; h < rows; h++) {
        for (int i = 0; i < n; i++) want[(size_t)h * ldd + i] = (uint32_t)c.zero * 0x01010101u;
        for (int k = 0; k < 4; k++) {
            if (!planes[k]) continue;
            CU_ASSERT(qgemm_quantize_u8_portable(u, planes[k] + (size_t)h * ldx, (size_t)n, c.s, c.lo, c.hi, c.zero));
            for (int i = 0; i < n; i++) {
                uint32_t *d = &want[(size_t)h * ldd + i];
                *d = (*d & ~(0xFFu << (8 * k))) | (uint32_t)u[i] << (8 * k);
            }
        }
    }
    CU_ASSERT(qgemm_quantize_u8x4(d1, ldd, planes, ldx, rows, n, &c));
    CU_ASSERT(qgemm_quantize_u8x4_portable(d2, ldd, planes, ldx, rows, n, &c));
    CU_ASSERT(same_or_say(d1, want, nd * 4, what));
    CU_ASSERT(same_or_say(d2, want, nd * 4, what));
    /* a NaN or an infinity in any present plane is reported; one between rows is never read */
    for (int k = 0; k < 4; k++) {
        if (!planes[k]) continue;
        float *at = x + (size_t)k * nx + (size_t)(rows - 1) * ldx + (size_t)(n - 1), keep = *at;
        *at = k % 2 ? NAN : INFINITY;
        CU_ASSERT(!qgemm_quantize_u8x4(d1, ldd, planes, ldx, rows, n, &c));
        CU_ASSERT(!qgemm_quantize_u8x4_portable(d2, ldd, planes, ldx, rows, n, &c));
        *at = keep;
        at = x + (size_t)k * nx + (size_t)n, keep = *at;
        *at = NAN;
        CU_ASSERT(qgemm_quantize_u8x4(d1, ldd, planes, ldx, rows, n, &c));
        CU_ASSERT(qgemm_quantize_u8x4_portable(d2, ldd, planes, ldx, rows, n, &c));
        *at = keep;
    }
    free(x), free(want), free(d1), free(d2), free(u);
}

static void quantize_cases(void) {
    static const size_t NS[] = {1, 15, 16, 17, 64, 100, 129, 1000};
    for (size_t i = 0; i < sizeof NS / sizeof *NS; i++) {
        quantize_case(NS[i], 0.037f, -128, 127, 0, 128, 10 + i);  /* int8 symmetric */
        quantize_case(NS[i], 0.011f, -128, 127, -20, 128, 20 + i); /* int8 with a zero point */
        quantize_case(NS[i], 0.02f, 0, 255, 37, 0, 30 + i);       /* uint8 with a zero point */
        quantize_case(NS[i], 0.5f, 0, 255, 0, 0, 40 + i);         /* uint8 symmetric */
        /* scales whose reciprocal rounds (1 / 3, 0.1, 7e-4), a large one and one near the smallest normal */
        quantize_case(NS[i], 1.0f / 3.0f, -128, 127, 0, 128, 60 + i);
        quantize_case(NS[i], 0.1f, 0, 255, 13, 0, 70 + i);
        quantize_case(NS[i], 7e-4f, -128, 127, 5, 128, 80 + i);
        quantize_case(NS[i], 3e5f, 0, 255, 0, 0, 90 + i);
        quantize_case(NS[i], 0x1p-124f, -128, 127, 0, 128, 100 + i);
    }
    static const int ROWS[] = {1, 3, 14}, COLS[] = {1, 14, 16, 17, 40}, ABSENT[] = {0, 8, 14};
    uint64_t seed = 50;
    for (size_t i = 0; i < sizeof ROWS / sizeof *ROWS; i++)
        for (size_t j = 0; j < sizeof COLS / sizeof *COLS; j++)
            for (size_t k = 0; k < sizeof ABSENT / sizeof *ABSENT; k++)
                quantize_x4_case(ROWS[i], COLS[j], ABSENT[k], seed++);
}

static void test_quantize(void) { for_each_family(quantize_cases, "activation codes"); }

/* The fast quantizers' test for quotients near a half (QGEMM_RCP_EDGE), for scales whose reciprocal rounds up,
 * down or not at all and every zero point: (1) each half-integer quotient k + 1/2 over the codes, and the floats up
 * to 40 ulps either side of (k + 1/2) s, 32 k a call (a block of 64 or 32 lanes with one lane near a half goes the
 * dividing way whole); (2) blocks whose every quotient lies 1.25 to 1.9 times the test's 2^-12 from a half, which
 * take the fast way (its rounding and clamping next to the edge); both through qgemm_quantize_u8 and the four-plane
 * qgemm_quantize_u8x4. The codes equal the portable quantizer's, which divides. */
static void quantize_halves_cases(void) {
    static const float S[] = {1.0f / 3.0f, 0.1f, 7e-4f, 0.0213f, 1.7f, 0.5f, 3e-6f, 1.0f / 255.0f};
    static const int ZERO[] = {0, 1, 37, 127, 128, 200, 255};
    const size_t n = 81 * 32; /* 32 k a call, 81 floats each */
    float *x = xmalloc(n * 4);
    uint8_t *u1 = xmalloc(n), *u2 = xmalloc(n);
    uint32_t *d1 = xmalloc(n * 4), *d2 = xmalloc(n * 4);
    Rng r;
    rng_init(&r, 4242, 9);
    int bad = 0;
    for (size_t i = 0; i < sizeof S / sizeof *S; i++)
        for (size_t j = 0; j < sizeof ZERO / sizeof *ZERO; j++) {
            const int z = ZERO[j];
            const float s = S[i];
            const QGemmCodes c = {.s = s, .lo = (float)-z, .hi = (float)(255 - z), .zero = z};
            for (int k0 = -z - 1; k0 < 256 - z + 32; k0 += 32) {
                const bool band = k0 >= 256 - z; /* the last round: (2) */
                for (size_t b = 0; b < n / 81; b++) {
                    const int k = k0 + (int)b;
                    float v = ((float)k + 0.5f) * s;
                    for (int u = 0; u < 40; u++) v = nextafterf(v, -INFINITY);
                    for (int u = 0; u < 81; u++, v = nextafterf(v, INFINITY)) x[b * 81 + (size_t)u] = v;
                }
                if (band)
                    for (size_t e = 0; e < n; e++) {
                        const double d = (0x1p-12 * (1.25 + 0.65 * (double)rng_below(&r, 1000) / 1000.0)) *
                                         (rng_below(&r, 2) ? 1.0 : -1.0);
                        x[e] = (float)(((double)((int)rng_below(&r, 256) - z) + 0.5 + d) * (double)s);
                    }
                CU_ASSERT(qgemm_quantize_u8(u1, x, n, s, c.lo, c.hi, z));
                CU_ASSERT(qgemm_quantize_u8_portable(u2, x, n, s, c.lo, c.hi, z));
                const float *planes[4] = {x, x + n / 4, x + n / 2, x + 3 * n / 4};
                CU_ASSERT(qgemm_quantize_u8x4(d1, 0, planes, 0, 1, (int)(n / 4), &c));
                CU_ASSERT(qgemm_quantize_u8x4_portable(d2, 0, planes, 0, 1, (int)(n / 4), &c));
                /* d1, d2 hold plane p's code of x[p n / 4 + i] in byte p of dword i: the same codes as u1, u2 */
                for (size_t e = 0; e < n; e++)
                    u1[e] = (uint8_t)(u1[e] != u2[e] || (uint8_t)(d1[e % (n / 4)] >> (8 * (e / (n / 4)))) !=
                                                            (uint8_t)(d2[e % (n / 4)] >> (8 * (e / (n / 4)))));
                size_t at = 0;
                while (at < n && !u1[at]) at++;
                if (at < n && bad++ < 3)
                    fprintf(stderr, "\n  s %g zero %d%s: x %.9g, the portable code %d, not the fast one's\n", (double)s,
                            z, band ? " (band)" : "", (double)x[at], u2[at]);
            }
        }
    CU_ASSERT_EQUAL(bad, 0);
    free(x), free(u1), free(u2), free(d1), free(d2);
}

static void test_quantize_halves(void) { for_each_family(quantize_halves_cases, "activation codes near halves"); }

/* ---- the strided conv's dword gather ------------------------------------------------------------------------------ */

/* qgemm_gather_u8x4 against the definition written here, for strides 1-3, rows of lengths about a vector, 1-3
 * rows apart by a step that is or is not the row's own length (and 0: a repeated source): nothing written at or
 * past dst[rows * n], and the slack read past a row's last byte (QGEMM_GATHER_SLACK) inside the buffer. */
static void gather_cases(void) {
    Rng r;
    rng_init(&r, 71, 3);
    for (int stride = 1; stride <= 3; stride++)
        for (int n = 1; n <= 40; n++)
            for (int rows = 1; rows <= 3; rows++) {
                const size_t step[4] = {(size_t)n * stride, (size_t)n * stride + 5, 0, 2 * (size_t)n * stride};
                const size_t len = 2 * (size_t)n * stride * (rows - 1) + (size_t)(n - 1) * stride + 1 + QGEMM_GATHER_SLACK;
                uint8_t *bytes = xmalloc(4 * len);
                for (size_t i = 0; i < 4 * len; i++) bytes[i] = (uint8_t)rng_below(&r, 256);
                const uint8_t *const src[4] = {bytes, bytes + len, bytes + 2 * len, bytes + 3 * len};
                uint32_t want[128], got[128];
                for (int h = 0; h < rows; h++)
                    for (int i = 0; i < n; i++) {
                        uint32_t d = 0;
                        for (int k = 0; k < 4; k++) d |= (uint32_t)src[k][h * step[k] + (size_t)i * stride] << (8 * k);
                        want[h * n + i] = d;
                    }
                for (int i = rows * n; i < 128; i++) want[i] = 0xa5a5a5a5u;
                char what[64];
                snprintf(what, sizeof what, "gather stride %d n %d rows %d", stride, n, rows);
                memset(got, 0xa5, sizeof got);
                qgemm_gather_u8x4(got, src, step, rows, n, stride);
                CU_ASSERT(same_or_say(got, want, sizeof got, what));
                memset(got, 0xa5, sizeof got);
                qgemm_gather_u8x4_portable(got, src, step, rows, n, stride);
                CU_ASSERT(same_or_say(got, want, sizeof got, what));
                free(bytes);
            }
}

static void test_gather(void) { for_each_family(gather_cases, "strided conv gather"); }

/* ---- int8 x int8 ----------------------------------------------------------------------------------------------- */

/* Which side of an int8 x int8 product holds only bytes >= 0 (as activations after a ReLU): the AVX2 kernels take
 * the unsigned-times-signed form there. S8_ONE_NEG: both >= 0 but for a's first byte and b's last element, so one
 * row block and one column block fall back. */
enum { S8_SIGNED, S8_A_POS, S8_B_POS, S8_ONE_NEG };

static void s8_signs(int8_t *a, size_t na, int8_t *b, size_t nb, int signs, bool extremes) {
    if (signs == S8_A_POS || signs == S8_ONE_NEG)
        for (size_t i = 0; i < na; i++) a[i] = extremes ? 127 : (int8_t)(a[i] & 0x7f);
    if (signs == S8_B_POS || signs == S8_ONE_NEG)
        for (size_t i = 0; i < nb; i++) b[i] = extremes ? 127 : (int8_t)(b[i] & 0x7f);
    if (signs == S8_ONE_NEG && na > 0) a[0] = -3;
}

static void s8_case_signs(int M, int N, int K, uint64_t seed, bool extremes, int signs);
static void s8_case(int M, int N, int K, uint64_t seed, bool extremes) {
    s8_case_signs(M, N, K, seed, extremes, S8_SIGNED);
}

static void s8_case_signs(int M, int N, int K, uint64_t seed, bool extremes, int signs) {
    size_t na = (size_t)M * K, nb = (size_t)N * K, nc = (size_t)M * N;
    int8_t *a = xmalloc(na), *b = xmalloc(nb);
    int32_t *c1 = xmalloc(nc * 4), *c2 = xmalloc(nc * 4), *ref = xmalloc(nc * 4);
    Rng r;
    rng_init(&r, seed, 6);
    fill_bytes((uint8_t *)a, na, &r);
    fill_bytes((uint8_t *)b, nb, &r);
    if (extremes) memset(a, 0x80, na), memset(b, 0x80, nb);
    s8_signs(a, na, b, nb, signs, extremes);
    if (signs == S8_ONE_NEG && nb > 0) b[nb - 1] = -128;
    memset(c1, 0x5a, nc * 4), memset(c2, 0x3c, nc * 4);
    qgemm_s8_ref(ref, a, b, M, N, K);
    char what[64];
    /* every family this CPU runs (the ones it lacks are reported skipped by the suite's ISA tests) */
    for (int isa = QGEMM_ISA_PORTABLE; isa <= QGEMM_ISA_AMX; isa++) {
        if (!qgemm_cpu_has_isa((QGemmIsa)isa)) continue;
        qgemm_force_isa = isa;
        memset(c1, 0x5a, nc * 4);
        qgemm_s8(c1, a, b, M, N, K);
        snprintf(what, sizeof what, "qgemm_s8 (%d, %d, %d) isa %d signs %d", M, N, K, isa, signs);
        CU_ASSERT(same_or_say(c1, ref, nc * 4, what));
    }
    /* qgemm_s8_ldc: c's rows N + 3 apart, the gaps between them as they were */
    const int ldc = N + 3;
    const size_t nw = (size_t)M * ldc;
    int32_t *cw = xmalloc(nw * 4), *rw = xmalloc(nw * 4);
    memset(rw, 0x77, nw * 4);
    for (int i = 0; i < M; i++) memcpy(rw + (size_t)i * ldc, ref + (size_t)i * N, (size_t)N * 4);
    for (int isa = QGEMM_ISA_PORTABLE; isa <= QGEMM_ISA_AMX; isa++) {
        if (!qgemm_cpu_has_isa((QGemmIsa)isa)) continue;
        qgemm_force_isa = isa;
        memset(cw, 0x77, nw * 4);
        qgemm_s8_ldc(cw, ldc, a, b, M, N, K);
        snprintf(what, sizeof what, "qgemm_s8_ldc (%d, %d, %d) isa %d signs %d", M, N, K, isa, signs);
        CU_ASSERT(same_or_say(cw, rw, nw * 4, what));
    }
    free(cw), free(rw);
    qgemm_force_isa = -1;
    qgemm_force_portable = true;
    qgemm_s8(c2, a, b, M, N, K);
    qgemm_force_portable = false;
    snprintf(what, sizeof what, "qgemm_s8 (%d, %d, %d)", M, N, K);
    CU_ASSERT(same_or_say(c2, ref, nc * 4, what));
    free(a), free(b), free(c1), free(c2), free(ref);
}

/* qgemm_s8_nn: b (K, N) with rows ldb apart, c's ldc, on every family the CPU runs and on the portable one. */
static void s8_nn_case_signs(int M, int N, int K, int pad, uint64_t seed, bool extremes, int signs);
static void s8_nn_case(int M, int N, int K, int pad, uint64_t seed, bool extremes) {
    s8_nn_case_signs(M, N, K, pad, seed, extremes, S8_SIGNED);
}

static void s8_nn_case_signs(int M, int N, int K, int pad, uint64_t seed, bool extremes, int signs) {
    const int ldb = N + pad, ldc = N + 2 * pad;
    size_t na = (size_t)M * K, nb = (size_t)K * ldb + 1, nc = (size_t)M * ldc;
    int8_t *a = xmalloc(na + 1), *b = xmalloc(nb);
    int32_t *c = xmalloc(nc * 4 + 4), *ref = xmalloc(nc * 4 + 4);
    Rng r;
    rng_init(&r, seed, 7);
    fill_bytes((uint8_t *)a, na, &r);
    fill_bytes((uint8_t *)b, nb, &r);
    if (extremes) memset(a, 0x80, na), memset(b, 0x80, nb);
    s8_signs(a, na, b, nb, signs, extremes);
    if (signs == S8_ONE_NEG && K > 0) b[(size_t)(K - 1) * ldb + N - 1] = -128;
    memset(ref, 0x77, nc * 4);
    qgemm_s8_nn_ref(ref, ldc, a, b, ldb, M, N, K);
    char what[96];
    for (int isa = QGEMM_ISA_PORTABLE; isa <= QGEMM_ISA_AMX; isa++) {
        if (!qgemm_cpu_has_isa((QGemmIsa)isa)) continue;
        qgemm_force_isa = isa;
        memset(c, 0x77, nc * 4); /* the gaps between rows keep the bytes they had, as ref's */
        qgemm_s8_nn(c, ldc, a, b, ldb, M, N, K);
        snprintf(what, sizeof what, "qgemm_s8_nn (%d, %d, %d) ldb %d isa %d signs %d", M, N, K, ldb, isa, signs);
        CU_ASSERT(same_or_say(c, ref, nc * 4, what));
    }
    qgemm_force_isa = -1;
    free(a), free(b), free(c), free(ref);
}

static void test_s8_nn(void) {
    static const int MS[] = {1, 6, 8, 9, 33, 97}, NS[] = {1, 7, 8, 15, 16, 17, 47, 48, 49, 100},
                     KS[] = {1, 3, 4, 9, 288, 511, 512, 513};
    uint64_t seed = 400;
    for (size_t i = 0; i < sizeof MS / sizeof *MS; i++)
        for (size_t j = 0; j < sizeof NS / sizeof *NS; j++)
            for (size_t k = 0; k < sizeof KS / sizeof *KS; k++) s8_nn_case(MS[i], NS[j], KS[k], (int)(k % 3), seed++, false);
    s8_nn_case(3, 50, 1 << 16, 5, 1, true); /* (-128)^2 summed over 2^16 */
    /* one side >= 0 (the AVX2 u8 x s8 tiles), a block with one negative byte, 127 x -128 pairs at the int16 edge */
    static const int PM[] = {1, 9, 64, 73}, PN[] = {5, 40, 100}, PK[] = {3, 288, 513};
    for (int sg = S8_A_POS; sg <= S8_ONE_NEG; sg++)
        for (size_t i = 0; i < sizeof PM / sizeof *PM; i++)
            for (size_t j = 0; j < sizeof PN / sizeof *PN; j++)
                for (size_t k = 0; k < sizeof PK / sizeof *PK; k++)
                    s8_nn_case_signs(PM[i], PN[j], PK[k], (int)(k % 2), seed++, false, sg);
    for (int sg = S8_A_POS; sg <= S8_B_POS; sg++) s8_nn_case_signs(5, 40, 4099, 1, 3, true, sg);
    s8_nn_case(4, 5, 0, 1, 2, false);       /* no terms: zeros */
}

static void test_s8(void) {
    static const int MS[] = {1, 6, 7, 8, 9, 17, 50}, NS[] = {1, 7, 8, 9, 16, 47, 48, 49, 97},
                     KS[] = {1, 5, 511, 512, 513, 3001};
    uint64_t seed = 200;
    for (size_t i = 0; i < sizeof MS / sizeof *MS; i++)
        for (size_t j = 0; j < sizeof NS / sizeof *NS; j++)
            for (size_t k = 0; k < sizeof KS / sizeof *KS; k++) s8_case(MS[i], NS[j], KS[k], seed++, false);
    s8_case(3, 50, 1 << 16, 1, true); /* (-128)^2 summed over 2^16: 2^30 */
    static const int PM[] = {1, 9, 72, 73, 300}, PN[] = {5, 64, 128, 129}, PK[] = {3, 513};
    for (int sg = S8_A_POS; sg <= S8_ONE_NEG; sg++)
        for (size_t i = 0; i < sizeof PM / sizeof *PM; i++)
            for (size_t j = 0; j < sizeof PN / sizeof *PN; j++)
                for (size_t k = 0; k < sizeof PK / sizeof *PK; k++) s8_case_signs(PM[i], PN[j], PK[k], seed++, false, sg);
    for (int sg = S8_A_POS; sg <= S8_B_POS; sg++) s8_case_signs(5, 40, 4099, 4, true, sg);
    s8_case(9, 5, 0, 2, false);       /* no terms: zeros */
}

/* ---- dispatch and errors --------------------------------------------------------------------------------------- */

static void test_dispatch_and_errors(void) {
    /* the best family the CPU has, one asked for, portable over any */
    static const char *const NAMES[] = {"portable", "avx2", "avxvnni", "avx512-vnni", "amx"};
    QGemmIsa best = QGEMM_ISA_PORTABLE;
    for (int isa = QGEMM_ISA_AVX2; isa <= QGEMM_ISA_AMX; isa++)
        if (qgemm_cpu_has_isa(isa)) best = isa;
    CU_ASSERT_EQUAL(qgemm_isa(), best);
    CU_ASSERT_STRING_EQUAL(qgemm_kernel_name(), NAMES[best]);
    CU_ASSERT_EQUAL(qgemm_cpu_has_vnni(), qgemm_cpu_has_isa(QGEMM_ISA_AVX512_VNNI));
    CU_ASSERT(qgemm_cpu_has_isa(QGEMM_ISA_PORTABLE));
    for (int isa = QGEMM_ISA_PORTABLE; isa <= QGEMM_ISA_AMX; isa++) {
        if (!qgemm_cpu_has_isa(isa)) continue;
        qgemm_force_isa = isa;
        CU_ASSERT_STRING_EQUAL(qgemm_kernel_name(), NAMES[isa]);
        qgemm_force_portable = true;
        CU_ASSERT_STRING_EQUAL(qgemm_kernel_name(), "portable");
        qgemm_force_portable = false;
    }
    qgemm_force_isa = -1;

    int8_t b[8] = {1, -2, 3, -4, 5, -6, 7, -8};
    uint32_t w[2] = {0x01020304u, 0xFFFEFDFCu};
    QGemmPackedB p;
    QGemmPackedTaps pt;
    QtError err = {0};
    CU_ASSERT_EQUAL(qgemm_pack_b(&p, b, 0, 8, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "(0, 8)") && test_msg_has(&err, "n >= 1"));
    CU_ASSERT_PTR_NULL(p.data);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(qgemm_pack_b(&p, b, 1, 0, &err), QT_ERR_ARG);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(qgemm_pack_b(&p, b, 1, QGEMM_K_MAX + 1, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "65536"));
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(qgemm_pack_b(&p, NULL, 1, 8, &err), QT_ERR_ARG);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(qgemm_pack_taps(&pt, w, 0, 2, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "0 rows"));
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(qgemm_pack_taps(&pt, w, 1, QGEMM_K_MAX / 4 + 1, &err), QT_ERR_ARG);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(qgemm_pack_taps(&pt, NULL, 1, 2, &err), QT_ERR_ARG);
    CU_ASSERT_PTR_NULL(pt.data);
    /* the sums the corrections use */
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_b(&p, b, 2, 4, NULL), QT_OK);
    CU_ASSERT(p.col_sum[0] == -2 && p.col_sum[1] == -2 && p.col_sum[2] == 0 && p.k_groups == 1 && p.panels == 1);
    qgemm_packed_b_free(&p);
    qgemm_packed_b_free(&p); /* twice is harmless */
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_taps(&pt, w, 1, 2, NULL), QT_OK);
    CU_ASSERT_EQUAL(pt.row_sum[0], 1 + 2 + 3 + 4 - 1 - 2 - 3 - 4);
    CU_ASSERT(pt.data[0] == (int32_t)w[0] && pt.data[8] == (int32_t)w[1] && pt.data[1] == 0);
    qgemm_packed_taps_free(&pt);
}

int register_quant_int8_suite(void) {
    CU_pSuite s = CU_add_suite("quant_int8", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "dense kernels equal the definition", test_dense) ||
           !CU_add_test(s, "taps kernels equal the definition", test_taps) ||
           !CU_add_test(s, "taps relu and relu + 2x2 max pool epilogues", test_taps_relu_pool) ||
           !CU_add_test(s, "activation codes equal fake quantization's", test_quantize) ||
           !CU_add_test(s, "activation codes near every half, every zero point: the portable quantizer's",
                        test_quantize_halves) ||
           !CU_add_test(s, "strided conv gather (cols dwords) equals the definition", test_gather) ||
           !CU_add_test(s, "qgemm_s8 on both paths", test_s8) ||
           !CU_add_test(s, "qgemm_s8_nn (b as K x N, strides) on every family", test_s8_nn) ||
           !CU_add_test(s, "dispatch and packing errors", test_dispatch_and_errors) || qlayer_int8_tests_add(s);
}
