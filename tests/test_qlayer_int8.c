/* test_qlayer_int8.c - the quantized layer's int8 path (qlayer_int8.c):
 * its output against the fake-quantized float path, for dense and conv2d
 * (every plane grouping, strides, paddings, odd sizes), every activation
 * mode, per-channel and per-tensor weights; bit for bit across kernels and
 * thread counts; when the path is taken and when not; its errors; a model's
 * arena in the steady state; the fused hook's relu and relu + max pool on the
 * int8 path bit for bit equal to the conv followed by nn's ops, alone and in
 * a model. Part of the quant_int8 suite. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/gemm.h"
#include "nn/ops.h"
#include "quant/qgemm.h"
#include "quant/qlayer.h"
#include "quant/qlayer_int8.h"
#include "quant/qwino.h"
#include "nn/conv_wino.h"
#include "test_int8.h"
#include "test_qarray.h"
#include "test_util.h"

/* Float rounding: the float path sums K float products in sgemm's order, the int8 path rounds the exact sum
 * once; outputs are O(1). */
#define ATOL 2e-4
#define RTOL 1e-4

typedef struct {
    const char *name;
    int C, H, W, OC, k, stride, pad; /* conv2d; C == 0: dense with H inputs, OC outputs */
} Geo;

typedef struct {
    const char *qtype;
    bool symmetric;
} Act;

static const Act ACTS[] = {{"int8", true}, {"uint8", false}, {"int8", false}, {"uint8", true}};

/* The int8 path needs VNNI or the portable kernels asked for: on a CPU without VNNI these tests run the portable
 * kernels throughout. */
static void int8_kernels_default(void) { qgemm_force_portable = !qgemm_cpu_has_vnni(); }

/* The 256-bit families, each compared below with the other kernels where the CPU has it. */
static const QGemmIsa WIDE256[] = {QGEMM_ISA_AVXVNNI, QGEMM_ISA_AVX2};
static const char *const WIDE256_NAME[] = {"AVX-VNNI", "AVX2"};

/* A visible skip for each 256-bit family this CPU lacks (what: the comparison). */
static void wide256_skips(const char *what) {
    for (int i = 0; i < 2; i++)
        if (!qgemm_cpu_has_isa(WIDE256[i])) test_skip("%s on the %s kernels: this CPU has no %s", what,
                                                         WIDE256_NAME[i], WIDE256_NAME[i]);
}

static void model_for(Model *m, const Geo *g, uint64_t seed) {
    QtError err = {0};
    LayerSpec l = {.type = LAYER_DENSE, .units = g->OC, .name = "fc"};
    int in_nd = 1, in[3] = {g->H, 0, 0};
    if (g->C) {
        l = (LayerSpec){.type = LAYER_CONV2D, .out_channels = g->OC, .kernel = g->k, .stride = g->stride,
                        .padding = g->pad, .name = "conv"};
        in_nd = 3, in[0] = g->C, in[1] = g->H, in[2] = g->W;
    }
    CU_ASSERT_EQUAL_FATAL(model_init(m, in_nd, in, &l, 1, &err), QT_OK);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    model_init_params(m, &r);
    Param *b = m->modules[0].bias; /* a bias that is not all zeros */
    for (int i = 0; b && i < b->var.value.shape[0]; i++) b->var.value.data[i] = 0.1f * (float)(i % 7) - 0.3f;
}

static size_t input_numel(const Module *mod, int N) {
    size_t n = (size_t)N;
    for (int d = 0; d < mod->in_ndim; d++) n *= (size_t)mod->in_shape[d];
    return n;
}

/* The static range of act over x narrowed to 70 %, so that some inputs clip. */
static void set_act_range(QLayer *q, const float *x, size_t n) {
    float lo = 0.0f, hi = 0.0f;
    for (size_t i = 0; i < n; i++) lo = fminf(lo, x[i]), hi = fmaxf(hi, x[i]);
    lo *= 0.7f, hi *= 0.7f;
    const QType *t = q->spec.act_qtype;
    bool asym = !q->spec.act_symmetric;
    if (!asym) hi = fmaxf(-lo, hi), lo = -hi;
    q->act_scale = qarray_scale_for_range(t, asym, false, (float)t->qmin, (float)t->qmax, lo, hi);
    q->act_zero_point = asym ? qarray_zero_point_for_range(false, (float)t->qmin, (float)t->qmax, lo, q->act_scale)
                             : 0.0f;
    q->act_ready = true;
}

static void layer_for(QLayer *q, Module *mod, bool per_tensor, const Act *a) {
    QLayerSpec s = qlayer_spec_default();
    s.weight_qtype = qa_find("int8");
    s.per_tensor = per_tensor;
    s.act_qtype = a ? qa_find(a->qtype) : NULL;
    s.act_symmetric = a ? a->symmetric : true;
    if (a && !a->symmetric) s.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
    QtError err = {0};
    QtStatus st = qlayer_init_quantize(q, mod, &s, mod->weight->var.value.data, &err);
    if (st != QT_OK) fprintf(stderr, "\n  qlayer_init_quantize: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

/* y of q on x (batch N) with gradients off, malloc'd into *y; the tape error is copied to *err. No node may be
 * recorded. NULL if the forward failed. */
static float *eval_layer(QLayer *q, const float *x, int N, size_t *ny, QtError *err) {
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.grad_enabled = false, e.tape.training = false;
    const Module *mod = q->module;
    int xs[4] = {N, mod->in_shape[0], mod->in_shape[1], mod->in_shape[2]};
    Var *vx = test_var(&e, x, mod->in_ndim + 1, xs, false);
    Var *y = qlayer_forward(&e.tape, q, vx);
    CU_ASSERT_EQUAL(e.tape.n_nodes, 0);
    float *out = NULL;
    if (y) {
        *ny = var_numel(y);
        out = qa_alloc_floats(*ny);
        memcpy(out, y->value.data, *ny * sizeof *out);
    }
    if (err) *err = e.tape.err;
    test_env_free(&e);
    return out;
}

static float *eval_ok(QLayer *q, const float *x, int N, size_t *ny) {
    QtError err = {0};
    float *y = eval_layer(q, x, N, ny, &err);
    if (!y) fprintf(stderr, "\n  forward: %s\n", err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    return y;
}

/* ---- against the float path ------------------------------------------------------------------------------------ */

static void compare_case(const Geo *g, bool per_tensor, const Act *a, uint64_t seed) {
    char what[128];
    snprintf(what, sizeof what, "%s, %s weight, act %s%s", g->name, per_tensor ? "per-tensor" : "per-channel",
             a->qtype, a->symmetric ? "" : " asym");
    Model m;
    model_for(&m, g, seed);
    Module *mod = &m.modules[0];
    const int N = g->C ? 3 : 11;
    size_t nx = input_numel(mod, N), ny = 0, n2 = 0;
    float *x = qa_normal_sample(seed + 1, nx);
    for (size_t i = 0; i < nx; i++) x[i] += 0.3f; /* an off-centre range gives a zero point away from the middle */
    QLayer q;
    layer_for(&q, mod, per_tensor, a);
    set_act_range(&q, x, nx);
    CU_ASSERT(qlayer_int8_supported(&q));

    qlayer_int8_disable = true;
    float *yf = eval_ok(&q, x, N, &ny);
    qlayer_int8_disable = false;
    CU_ASSERT_PTR_NULL(q.int8); /* the float path packs nothing */
    int8_kernels_default();
    gemm_set_threads(1);
    float *y1 = eval_ok(&q, x, N, &n2);
    CU_ASSERT_PTR_NOT_NULL(q.int8);
    gemm_set_threads(2);
    qlayer_int8_parallel_min_macs = 0.0; /* split even these small layers */
    float *y2 = eval_ok(&q, x, N, &n2);
    qgemm_force_portable = true;
    float *y3 = eval_ok(&q, x, N, &n2);
    bool same_wide = true;
    for (int i = 0; i < 2; i++) { /* the 256-bit families the CPU has, on two threads too */
        if (!qgemm_cpu_has_isa(WIDE256[i])) continue;
        qgemm_force_portable = false, qgemm_force_isa = WIDE256[i];
        float *yw = eval_ok(&q, x, N, &n2);
        same_wide &= n2 == ny && !memcmp(y1, yw, ny * sizeof *y1);
        free(yw);
    }
    qgemm_force_isa = -1;
    if (!same_wide) fprintf(stderr, "\n  %s: the 256-bit kernels' outputs differ\n", what);
    CU_ASSERT(same_wide);
    int8_kernels_default();
    gemm_set_threads(1);
    qlayer_int8_parallel_min_macs = 4e6;

    CU_ASSERT_EQUAL(ny, n2);
    size_t worst = 0;
    double r = test_close_ratio(y1, yf, ny, ATOL, RTOL, &worst);
    if (r > 1.0)
        fprintf(stderr, "\n  %s: int8 y[%zu] = %.9g, float path %.9g (ratio %.3g)\n", what, worst, (double)y1[worst],
                (double)yf[worst], r);
    CU_ASSERT(r <= 1.0);
    bool same = !memcmp(y1, y2, ny * sizeof *y1) && !memcmp(y1, y3, ny * sizeof *y1);
    if (!same) fprintf(stderr, "\n  %s: outputs differ across thread counts or kernels\n", what);
    CU_ASSERT(same);
    free(x), free(yf), free(y1), free(y2), free(y3);
    qlayer_free(&q);
    CU_ASSERT_PTR_NULL(q.int8);
    model_free(&m);
}

static const Geo GEOS[] = {
    {"dense 37 -> 19", 0, 37, 0, 19, 0, 0, 0},
    {"dense 300 -> 40", 0, 300, 0, 40, 0, 0, 0},
    {"conv kw4 C1 9x11", 1, 9, 11, 5, 3, 1, 1},
    {"conv kw4 C2 k5 pad2", 2, 8, 7, 9, 5, 1, 2},
    {"conv ch4 C8 7x6", 8, 7, 6, 12, 3, 1, 1},
    {"conv ch4 C6 pad2", 6, 5, 9, 9, 3, 1, 2},
    {"conv ch4 1x1", 16, 4, 5, 3, 1, 1, 0},
    {"conv ch4 1x1 C64 (16 taps at one stride: AMX tiles)", 64, 7, 9, 20, 1, 1, 0},
    {"conv ch4 1x1 C128 14x14 (DS-CNN-like pointwise)", 128, 14, 14, 64, 1, 1, 0},
    {"conv ch4 no padding, wide", 4, 6, 37, 8, 3, 1, 0},
    {"conv ph4 stride 2", 4, 9, 7, 10, 3, 2, 1},
    {"conv cols stride 3 C1", 1, 10, 11, 4, 4, 3, 0},
    {"conv cols 1x1 stride 2 C3 (K past the last dword)", 3, 9, 10, 5, 1, 2, 0},
    {"conv cols stride 2 k5 pad2 C3", 3, 11, 8, 6, 5, 2, 2},
    {"conv ph4 stride 2 ResNet-8 stage 2 (16 -> 32, 28x28)", 16, 28, 28, 32, 3, 2, 1},
    {"conv ph4 1x1 stride 2 ResNet-8 shortcut (32 -> 64, 14x14)", 32, 14, 14, 64, 1, 2, 0},
    {"conv ph4 stride 2 k5 pad2 C8, odd sizes", 8, 11, 9, 6, 5, 2, 2},
    {"conv ph4 stride 2 k4 no padding", 4, 10, 13, 5, 4, 2, 0},
    {"conv ph4 stride 2 k2 (patches) C12", 12, 8, 8, 7, 2, 2, 0},
    {"conv ph4 stride 2, one output row, wide", 4, 3, 37, 5, 3, 2, 1},
    {"conv ph4 1x1 stride 2 C64 (AMX-shaped taps)", 64, 7, 9, 20, 1, 2, 0},
    {"conv cols stride 2, 8x8 output (the plane ends with the last row)", 5, 16, 16, 7, 3, 2, 1},
    {"conv cols stride 2, wide rows (35 outputs)", 3, 5, 70, 4, 3, 2, 1},
};

static void test_against_float(void) {
    uint64_t seed = 500;
    int8_kernels_default();
    for (size_t g = 0; g < sizeof GEOS / sizeof *GEOS; g++)
        for (int pt = 0; pt < 2; pt++)
            for (size_t a = 0; a < sizeof ACTS / sizeof *ACTS; a++) compare_case(&GEOS[g], pt, &ACTS[a], seed++);
    qgemm_force_portable = false;
    wide256_skips("int8 layers against the float path");
}

/* ---- stride 2 on phases ---------------------------------------------------------------------------------------- */

/* Every stride-2 geometry over whole channel quads in GEOS, read on the
 * image's phases gives the outputs of the columns built for it, bit for bit: on the default kernels and the
 * portable ones, every activation mode, from float inputs. */
static void test_phases_equal_columns(void) {
    uint64_t seed = 900;
    int ran = 0;
    for (size_t gi = 0; gi < sizeof GEOS / sizeof *GEOS; gi++) {
        const Geo *g = &GEOS[gi];
        if (g->stride != 2 || g->C % 4) continue;
        for (size_t a = 0; a < sizeof ACTS / sizeof *ACTS; a++, seed++)
            for (int portable = 0; portable < 2; portable++) {
                Model m;
                model_for(&m, g, seed);
                const int N = 3;
                size_t nx = input_numel(&m.modules[0], N), n1 = 0, n2 = 0;
                float *x = qa_normal_sample(seed + 1, nx);
                QLayer q;
                layer_for(&q, &m.modules[0], false, &ACTS[a]);
                set_act_range(&q, x, nx);
                qgemm_force_portable = portable || !qgemm_cpu_has_vnni();
                float *ph = eval_ok(&q, x, N, &n1);
                qlayer_int8_phases = false;
                qlayer_int8_release(&q); /* packed again for the columns' order */
                float *cols = eval_ok(&q, x, N, &n2);
                qlayer_int8_phases = true;
                const bool same = n1 == n2 && !memcmp(ph, cols, n1 * sizeof *ph);
                if (!same) fprintf(stderr, "\n  %s, act %zu, portable %d: phases and columns differ\n", g->name, a,
                                   portable);
                CU_ASSERT(same);
                ran++;
                free(x), free(ph), free(cols);
                qlayer_free(&q);
                model_free(&m);
            }
    }
    int8_kernels_default();
    CU_ASSERT(ran >= 8 * 8);
}

/* ---- relu and max pool folded in -------------------------------------------------------------------------------- */

/* The installed layer's fused hook on x (batch N) against its int8 conv followed by the separate nn ops: relu,
 * then maxpool2d(2, 2) where the output has a 2x2 window, and the hook with no epilogue against the layer. Bit
 * for bit; false (with a message) if they differ. */
static bool fused_matches(QLayer *q, const float *x, int N, const char *what) {
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.grad_enabled = false, e.tape.training = false;
    Tape *t = &e.tape;
    Module *mod = q->module;
    int xs[4] = {N, mod->in_shape[0], mod->in_shape[1], mod->in_shape[2]};
    Var *vx = test_var(&e, x, 4, xs, false);
    Var *ref[3] = {qlayer_forward(t, q, vx), NULL, NULL};
    CU_ASSERT_PTR_NOT_NULL_FATAL(ref[0]);
    ref[1] = nn_relu(t, ref[0]);
    const bool pool = ref[0]->value.shape[2] >= 2 && ref[0]->value.shape[3] >= 2;
    if (pool) ref[2] = nn_maxpool2d(t, ref[1], 2, 2);
    static const ConvEpilogue EPI[] = {CONV_EPI_NONE, CONV_EPI_RELU, CONV_EPI_RELU_MAXPOOL2};
    bool same = true;
    for (int k = 0; k < (pool ? 3 : 2); k++) {
        Var *y = mod->fused_hook(t, mod, vx, mod->hook_ctx, mod->bias ? &mod->bias->var : NULL, EPI[k]);
        CU_ASSERT_PTR_NOT_NULL_FATAL(y); /* not declined: the int8 path has the epilogue */
        bool ok = y->value.ndim == 4 && var_numel(y) == var_numel(ref[k]) &&
                  !memcmp(y->value.shape, ref[k]->value.shape, sizeof y->value.shape) &&
                  !memcmp(y->value.data, ref[k]->value.data, var_numel(y) * sizeof(float));
        if (!ok) fprintf(stderr, "\n  %s: the fused epilogue %d differs from the separate ops\n", what, k);
        same &= ok;
    }
    CU_ASSERT_EQUAL(t->n_nodes, 0);
    test_env_free(&e);
    return same;
}

static void fused_case(const Geo *g, const Act *a, bool nan_bias, uint64_t seed) {
    char what[128];
    snprintf(what, sizeof what, "%s, act %s%s%s", g->name, a->qtype, a->symmetric ? "" : " asym",
             nan_bias ? ", a NaN bias" : "");
    Model m;
    model_for(&m, g, seed);
    Module *mod = &m.modules[0];
    if (nan_bias) mod->bias->var.value.data[1] = NAN; /* relu makes it 0 */
    const int N = 3;
    size_t nx = input_numel(mod, N);
    float *x = qa_normal_sample(seed + 1, nx);
    QLayer q;
    layer_for(&q, mod, false, a);
    set_act_range(&q, x, nx);
    qlayer_install(&q);
    /* fast kernels on one and two threads (every layer split), then the portable ones */
    int8_kernels_default();
    CU_ASSERT(fused_matches(&q, x, N, what));
    gemm_set_threads(2);
    qlayer_int8_parallel_min_macs = 0.0;
    CU_ASSERT(fused_matches(&q, x, N, what));
    qgemm_force_portable = true;
    CU_ASSERT(fused_matches(&q, x, N, what));
    qgemm_force_portable = false;
    for (int i = 0; i < 2; i++) { /* the 256-bit families the CPU has */
        if (!qgemm_cpu_has_isa(WIDE256[i])) continue;
        qgemm_force_isa = WIDE256[i];
        CU_ASSERT(fused_matches(&q, x, N, what));
    }
    qgemm_force_isa = -1;
    int8_kernels_default();
    gemm_set_threads(1);
    qlayer_int8_parallel_min_macs = 4e6;
    free(x);
    qlayer_free(&q);
    model_free(&m);
}

static void test_fused_epilogues(void) {
    /* the CNN's two layers (the first kw4, the second ch4), odd output sizes (pooling leaves the last row and
     * column out), a 1-pixel-wide output (no window: relu only) */
    static const Geo MORE[] = {
        {"conv1 of the CNN", 1, 28, 28, 32, 3, 1, 1},
        {"conv2 of the CNN", 32, 14, 14, 64, 3, 1, 1},
        {"conv ch4 C5 odd 7x9", 5, 7, 9, 11, 3, 1, 1},
        {"conv 1 column", 4, 5, 1, 6, 1, 1, 0},
    };
    uint64_t seed = 900;
    for (size_t i = 2; i < sizeof GEOS / sizeof *GEOS; i++) /* the conv geometries */
        for (size_t a = 0; a < 2; a++) fused_case(&GEOS[i], &ACTS[a], i % 2, seed++);
    for (size_t i = 0; i < sizeof MORE / sizeof *MORE; i++) fused_case(&MORE[i], &ACTS[i % 2], i == 2, seed++);
    qgemm_force_portable = false;
    wide256_skips("fused relu and max pool epilogues");
}

/* On the AVX2 family a padded 3x3 stride-1 conv of 8 to QWINO_U8_C_MAX channels takes its sums from the integer
 * F(2x2, 3x3) (quant/qwino.h; counted: once an image) instead of the taps kernel: the same sums, so every output
 * bit (conv, relu, relu + 2x2 max pool, on odd planes whose pool drops a row and a column) on one and two threads,
 * for each kind of input codes (int8 and uint8, with and without a zero point). */
static void test_qwino_same_bits(void) {
    if (!qgemm_cpu_has_isa(QGEMM_ISA_AVX2)) {
        test_skip("PTQ conv through qwino: this CPU has no AVX2 with FMA");
        return;
    }
    static const Geo QW[] = {
        {"conv ch4 C9 9x13 (odd tiles)", 9, 9, 13, 7, 3, 1, 1},
        {"conv2 of the CNN", 32, 14, 14, 64, 3, 1, 1},
        {"ResNet-8 stage 3", 64, 7, 7, 64, 3, 1, 1},
    };
    static const ConvEpilogue EPI[] = {CONV_EPI_NONE, CONV_EPI_RELU, CONV_EPI_RELU_MAXPOOL2};
    const bool saved = conv_wino_enabled;
    uint64_t seed = 960;
    for (size_t i = 0; i < sizeof QW / sizeof *QW; i++)
        for (size_t a = 0; a < 4; a++) {
            Model m;
            model_for(&m, &QW[i], seed++);
            Module *mod = &m.modules[0];
            const int N = 3;
            const size_t nx = input_numel(mod, N);
            float *x = qa_normal_sample(seed++, nx);
            for (size_t k = 0; k < nx; k++) x[k] += 0.3f;
            QLayer q;
            layer_for(&q, mod, a % 2 == 1, &ACTS[a]);
            set_act_range(&q, x, nx);
            qlayer_install(&q);
            qgemm_force_isa = QGEMM_ISA_AVX2;
            for (int th = 1; th <= 2; th++) {
                gemm_set_threads(th);
                qlayer_int8_parallel_min_macs = th > 1 ? 0.0 : 4e6;
                for (int e = 0; e < 3; e++) {
                    float *y[2] = {NULL, NULL};
                    size_t ny[2] = {0, 0};
                    for (int w = 0; w < 2; w++) {
                        conv_wino_enabled = w;
                        TestEnv env;
                        test_env_init(&env, 1);
                        env.tape.grad_enabled = false, env.tape.training = false;
                        int xs[4] = {N, mod->in_shape[0], mod->in_shape[1], mod->in_shape[2]};
                        const unsigned long calls = qwino_floats_calls;
                        Var *out = mod->fused_hook(&env.tape, mod, test_var(&env, x, 4, xs, false), mod->hook_ctx,
                                                   mod->bias ? &mod->bias->var : NULL, EPI[e]);
                        CU_ASSERT_PTR_NOT_NULL_FATAL(out);
                        CU_ASSERT_EQUAL(qwino_floats_calls - calls, w ? (unsigned long)N : 0ul);
                        ny[w] = var_numel(out), y[w] = qa_alloc_floats(ny[w]);
                        memcpy(y[w], out->value.data, ny[w] * sizeof(float));
                        test_env_free(&env);
                    }
                    const bool same = ny[0] == ny[1] && !memcmp(y[0], y[1], ny[0] * sizeof(float));
                    if (!same) fprintf(stderr, "\n  %s, act %s%s, epilogue %d, %d threads: qwino's outputs differ\n",
                                       QW[i].name, ACTS[a].qtype, ACTS[a].symmetric ? "" : " asym", e, th);
                    CU_ASSERT(same);
                    free(y[0]), free(y[1]);
                }
            }
            conv_wino_enabled = saved, qgemm_force_isa = -1;
            gemm_set_threads(1);
            qlayer_int8_parallel_min_macs = 4e6;
            free(x);
            qlayer_free(&q);
            model_free(&m);
        }
}

/* A model with both fused forms (conv -> relu -> maxpool, conv -> relu) in eval: model_forward equals its modules
 * run one by one (the int8 layers, then nn's relu and max pool), on both kernel families. */
static void test_fused_model(void) {
    enum { N = 5, C = 3, H = 10, W = 9 };
    static const LayerSpec LS[] = {
        {.type = LAYER_CONV2D, .name = "c1", .out_channels = 6, .kernel = 3, .padding = 1}, {.type = LAYER_RELU},
        {.type = LAYER_MAXPOOL2D, .kernel = 2}, {.type = LAYER_CONV2D, .name = "c2", .out_channels = 9, .kernel = 3,
        .padding = 1}, {.type = LAYER_RELU}, {.type = LAYER_FLATTEN}, {.type = LAYER_DENSE, .name = "fc", .units = 4},
    };
    const int n_layers = (int)(sizeof LS / sizeof *LS), conv[2] = {0, 3};
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (const int[]){C, H, W}, LS, n_layers, &err), QT_OK);
    Rng r;
    rng_init(&r, 95, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    float *x = qa_normal_sample(96, N * C * H * W);
    QLayer q[2];
    for (int i = 0; i < 2; i++) {
        layer_for(&q[i], &m.modules[conv[i]], false, &ACTS[i]);
        qlayer_install(&q[i]);
        qlayer_calib_begin(&q[i]);
    }
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.grad_enabled = false, e.tape.training = false;
    const int xs[4] = {N, C, H, W};
    CU_ASSERT_PTR_NOT_NULL_FATAL(model_forward(&m, &e.tape, test_var(&e, x, 4, xs, false)));
    for (int i = 0; i < 2; i++) CU_ASSERT_EQUAL_FATAL(qlayer_calib_end(&q[i], &err), QT_OK);
    for (int portable = 0; portable < 2; portable++) {
        int8_kernels_default();
        qgemm_force_portable |= portable;
        tape_reset(&e.tape);
        Var *y = model_forward(&m, &e.tape, test_var(&e, x, 4, xs, false));
        Var *z = test_var(&e, x, 4, xs, false);
        for (int k = 0; z && k < n_layers; k++) {
            Module *mk = &m.modules[k];
            Tape *t = &e.tape;
            z = mk->forward_hook ? mk->forward_hook(t, mk, z, mk->hook_ctx) : model_module_forward(t, mk, z);
        }
        CU_ASSERT_FATAL(y && z && var_numel(y) == (size_t)N * 4 && var_numel(z) == (size_t)N * 4);
        CU_ASSERT(!memcmp(y->value.data, z->value.data, (size_t)N * 4 * sizeof(float)));
        CU_ASSERT(q[0].int8 && q[1].int8 && e.tape.n_nodes == 0);
    }
    /* a non-finite input: the fused form fails with the float path's message */
    x[17] = NAN;
    tape_reset(&e.tape);
    CU_ASSERT_PTR_NULL(model_forward(&m, &e.tape, test_var(&e, x, 4, xs, false)));
    CU_ASSERT(e.tape.err.status == QT_ERR_VALUE && test_msg_has(&e.tape.err, "flat index"));
    test_env_free(&e);
    free(x);
    qlayer_free(&q[0]), qlayer_free(&q[1]);
    model_free(&m);
    qgemm_force_portable = false;
}

/* ---- which path runs ------------------------------------------------------------------------------------------- */

/* One forward with gradients on; returns y's values and whether a node was recorded. */
static float *train_forward(QLayer *q, const float *x, int N, bool x_grad, size_t *nodes) {
    TestEnv e;
    test_env_init(&e, 1);
    int xs[2] = {N, q->fan_in};
    Var *vx = test_var(&e, x, 2, xs, x_grad);
    Var *y = qlayer_forward(&e.tape, q, vx);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    *nodes = e.tape.n_nodes;
    float *out = qa_alloc_floats(var_numel(y));
    memcpy(out, y->value.data, var_numel(y) * sizeof *out);
    test_env_free(&e);
    return out;
}

static void test_path_choice(void) {
    enum { N = 5, IN = 20, OUT = 7 };
    const Geo g = {"dense", 0, IN, 0, OUT, 0, 0, 0};
    Model m;
    int8_kernels_default();
    model_for(&m, &g, 41);
    Module *mod = &m.modules[0];
    float *x = qa_normal_sample(42, N * IN);
    QLayer q;
    layer_for(&q, mod, false, &ACTS[1]);
    size_t ny = 0, nodes = 0;
    /* not calibrated: the float path (an unquantized input), nothing packed */
    float *y0 = eval_ok(&q, x, N, &ny);
    CU_ASSERT_PTR_NULL(q.int8);
    set_act_range(&q, x, N * IN);
    /* a gradient to record: the float path, bit for bit the same as with the int8 path disabled */
    float *yt = train_forward(&q, x, N, true, &nodes);
    CU_ASSERT(nodes > 0);
    CU_ASSERT_PTR_NULL(q.int8);
    qlayer_int8_disable = true;
    float *yd = train_forward(&q, x, N, true, &nodes);
    qlayer_int8_disable = false;
    CU_ASSERT(!memcmp(yt, yd, N * OUT * sizeof *yt));
    /* the input needs none but the bias does: still the float path */
    free(train_forward(&q, x, N, false, &nodes));
    CU_ASSERT(nodes > 0 && !q.int8);
    /* nothing needs a gradient (frozen bias, plain input), gradients on: the int8 path */
    param_freeze(mod->bias);
    float *yi = train_forward(&q, x, N, false, &nodes);
    CU_ASSERT(nodes == 0 && q.int8);
    /* evaluation: the int8 path, the same values */
    float *ye = eval_ok(&q, x, N, &ny);
    CU_ASSERT(!memcmp(yi, ye, N * OUT * sizeof *yi));
    /* while calibrating the forward observes its plain input (float path) */
    qlayer_calib_begin(&q);
    float *yc = eval_ok(&q, x, N, &ny);
    CU_ASSERT(!memcmp(yc, y0, N * OUT * sizeof *yc));
    QtError err = {0};
    CU_ASSERT_EQUAL(qlayer_calib_end(&q, &err), QT_OK);
    /* released: the next int8 forward packs again, same values */
    set_act_range(&q, x, N * IN);
    qlayer_int8_release(&q);
    CU_ASSERT_PTR_NULL(q.int8);
    float *yr = eval_ok(&q, x, N, &ny);
    CU_ASSERT(q.int8 && !memcmp(yr, ye, N * OUT * sizeof *yr));
    /* prepare on a packed layer keeps it */
    QLayerInt8 *packed = q.int8;
    CU_ASSERT_EQUAL(qlayer_int8_prepare(&q, &err), QT_OK);
    CU_ASSERT(q.int8 == packed);
    free(x), free(y0), free(yt), free(yd), free(yi), free(ye), free(yc), free(yr);
    qlayer_free(&q);
    model_free(&m);
    qgemm_force_portable = false;
}

/* ---- errors ---------------------------------------------------------------------------------------------------- */

typedef struct {
    const char *weight, *act;
    int tile;
    bool symmetric;
    const char *why;
} Unsupported;

static const Unsupported UNSUPPORTED[] = {
    {"int4", "int8", 0, true, "not int8"},
    {"int8", "int8", 4, true, "block scales"},
    {"int8", "int8", 0, false, "zero points"},
    {"int8", "fp8_e4m3", 0, true, "act_qtype"},
    {"int8", "int4", 0, true, "act_qtype"},
    {"int8", NULL, 0, true, "act_qtype"},
};

static void test_unsupported(void) {
    const Geo g = {"dense", 0, 16, 0, 4, 0, 0, 0};
    Model m;
    model_for(&m, &g, 61);
    QtError err = {0};
    for (size_t i = 0; i < sizeof UNSUPPORTED / sizeof *UNSUPPORTED; i++) {
        const Unsupported *u = &UNSUPPORTED[i];
        QLayerSpec s = qlayer_spec_default();
        s.weight_qtype = qa_find(u->weight);
        s.tile_size = u->tile;
        s.symmetric = u->symmetric;
        if (!u->symmetric) s.weight_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
        s.act_qtype = u->act ? qa_find(u->act) : NULL;
        QLayer q;
        CU_ASSERT_EQUAL_FATAL(qlayer_init_quantize(&q, &m.modules[0], &s, m.modules[0].weight->var.value.data, &err),
                              QT_OK);
        CU_ASSERT(!qlayer_int8_supported(&q));
        qt_error_clear(&err);
        CU_ASSERT_EQUAL(qlayer_int8_prepare(&q, &err), QT_ERR_CONFIG);
        CU_ASSERT(test_msg_has(&err, "fc") && test_msg_has(&err, u->why));
        CU_ASSERT_PTR_NULL(q.int8);
        qlayer_free(&q);
    }
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(qlayer_int8_prepare(NULL, &err), QT_ERR_ARG);
    CU_ASSERT(!qlayer_int8_supported(NULL));
    model_free(&m);
}

/* The forward must fail with status want and a message holding has. */
static void eval_fails(QLayer *q, const float *x, int N, QtStatus want, const char *has) {
    QtError err = {0};
    size_t ny = 0;
    float *y = eval_layer(q, x, N, &ny, &err);
    CU_ASSERT_PTR_NULL(y);
    free(y);
    CU_ASSERT_EQUAL(err.status, want);
    CU_ASSERT(test_msg_has(&err, has));
}

static void test_forward_errors(void) {
    enum { N = 4 };
    const Geo gd = {"dense", 0, 20, 0, 6, 0, 0, 0}, gc = {"conv", 3, 5, 5, 4, 3, 1, 1};
    Model md, mc;
    int8_kernels_default();
    model_for(&md, &gd, 71);
    model_for(&mc, &gc, 72);
    float *x = qa_normal_sample(73, N * 3 * 5 * 5);
    QLayer qd, qc;
    layer_for(&qd, &md.modules[0], false, &ACTS[1]);
    layer_for(&qc, &mc.modules[0], true, &ACTS[0]);
    set_act_range(&qd, x, N * 20);
    set_act_range(&qc, x, N * 75);
    /* a NaN: the float path's own message */
    for (int conv = 0; conv < 2; conv++) {
        QLayer *q = conv ? &qc : &qd;
        size_t at = conv ? 61 : 33, ny = 0;
        float keep = x[at];
        x[at] = NAN;
        QtError e8 = {0}, ef = {0};
        float *y = eval_layer(q, x, N, &ny, &e8);
        qlayer_int8_disable = true;
        free(eval_layer(q, x, N, &ny, &ef));
        qlayer_int8_disable = false;
        CU_ASSERT(!y && e8.status == QT_ERR_VALUE && ef.status == QT_ERR_VALUE);
        CU_ASSERT(test_msg_has(&e8, "flat index") && strcmp(e8.msg, ef.msg) == 0);
        free(y);
        x[at] = keep;
    }
    /* bad static ranges */
    float s = qd.act_scale, zp = qd.act_zero_point;
    qd.act_scale = 0.0f;
    eval_fails(&qd, x, N, QT_ERR_VALUE, "static input scale");
    qd.act_scale = INFINITY;
    eval_fails(&qd, x, N, QT_ERR_VALUE, "static input scale");
    qd.act_scale = s, qd.act_zero_point = 2.5f;
    eval_fails(&qd, x, N, QT_ERR_VALUE, "zero point 2.5");
    qd.act_zero_point = 256.0f;
    eval_fails(&qd, x, N, QT_ERR_VALUE, "0..255");
    qd.act_zero_point = zp;
    /* shapes */
    const Module *dm = qd.module;
    ((Module *)dm)->in_shape[0] = 19; /* the batch as (N, 19) */
    eval_fails(&qd, x, N, QT_ERR_SHAPE, "does not fit");
    ((Module *)dm)->in_shape[0] = 20;
    mc.modules[0].in_shape[0] = 2;
    eval_fails(&qc, x, N, QT_ERR_SHAPE, "does not fit");
    mc.modules[0].in_shape[0] = 3;
    size_t ny = 0;
    free(eval_ok(&qc, x, N, &ny)); /* and it still works */
    free(x);
    qlayer_free(&qd), qlayer_free(&qc);
    model_free(&md), model_free(&mc);
    qgemm_force_portable = false;
}

/* ---- a model in the steady state ------------------------------------------------------------------------------- */

static void test_model_steady_state(void) {
    enum { N = 4, C = 2, H = 6, W = 6, CLASSES = 10 };
    Model m;
    int8_kernels_default();
    test_small_cnn(&m, 81);
    Module *mods[2] = {&m.modules[0], &m.modules[2]};
    float *x = qa_normal_sample(82, N * C * H * W);
    QLayer q[2];
    layer_for(&q[0], mods[0], false, &ACTS[0]);
    layer_for(&q[1], mods[1], true, &ACTS[1]);
    for (int i = 0; i < 2; i++) {
        param_release(mods[i]->weight);
        qlayer_install(&q[i]);
        qlayer_calib_begin(&q[i]);
    }
    Arena a;
    Tape t;
    CU_ASSERT_FATAL(arena_init(&a, 4096) == 0);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, NULL, NULL), QT_OK);
    t.grad_enabled = false, t.training = false;
    const int xs[4] = {N, C, H, W};
    CU_ASSERT_PTR_NOT_NULL(model_forward(&m, &t, tape_wrap(&t, x, 4, xs)));
    QtError err = {0};
    for (int i = 0; i < 2; i++) CU_ASSERT_EQUAL_FATAL(qlayer_calib_end(&q[i], &err), QT_OK);
    float first[N * CLASSES], ref[N * CLASSES];
    size_t grown = 0;
    for (int step = 0; step < 4; step++) {
        tape_reset(&t);
        Var *y = model_forward(&m, &t, tape_wrap(&t, x, 4, xs));
        CU_ASSERT_PTR_NOT_NULL_FATAL(y);
        CU_ASSERT_EQUAL(t.n_nodes, 0);
        if (step == 0) memcpy(first, y->value.data, sizeof first), grown = a.grow_count;
        else CU_ASSERT(!memcmp(first, y->value.data, sizeof first) && a.grow_count == grown);
    }
    CU_ASSERT(q[0].int8 && q[1].int8);
    tape_reset(&t);
    qlayer_int8_disable = true;
    Var *y = model_forward(&m, &t, tape_wrap(&t, x, 4, xs));
    qlayer_int8_disable = false;
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    memcpy(ref, y->value.data, sizeof ref);
    ASSERT_ALL_CLOSE(first, ref, (size_t)(N * CLASSES), ATOL, RTOL);
    free(x);
    tape_free(&t);
    arena_free(&a);
    qlayer_free(&q[0]), qlayer_free(&q[1]);
    model_free(&m);
    qgemm_force_portable = false;
}

int qlayer_int8_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "int8 layer equals the float path", test_against_float) ||
           !CU_add_test(s, "stride 2 on phases equals columns bit for bit", test_phases_equal_columns) ||
           !CU_add_test(s, "int8 path only without a gradient", test_path_choice) ||
           !CU_add_test(s, "unsupported formats", test_unsupported) ||
           !CU_add_test(s, "int8 forward errors", test_forward_errors) ||
           !CU_add_test(s, "int8 model steady state", test_model_steady_state) ||
           !CU_add_test(s, "int8 conv with relu and max pool folded in", test_fused_epilogues) ||
           !CU_add_test(s, "int8 model with fused convolutions", test_fused_model) ||
           !CU_add_test(s, "AVX2 family: the integer F(2x2, 3x3) keeps every output bit", test_qwino_same_bits);
}
