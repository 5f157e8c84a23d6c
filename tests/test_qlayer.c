/* test_qlayer.c - the post-training-quantized dense / conv2d layer and the
 * QArray storage I/O: layouts and band alignment, the forward and input
 * gradient against nn_linear / nn_conv2d run with the dequantized weight,
 * finite differences, the bias, static activation calibration, spec errors,
 * the storage size, the arena's steady state, and QArrays restored from
 * their blobs bit for bit. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/conv_taps.h"
#include "nn/ops.h"
#include "base/parallel.h"
#include "quant/fakequant.h"
#include "quant/qarray_io.h"
#include "quant/qlayer.h"
#include "quant/qlayer_ops.h"
#include "test_qarray.h"
#include "test_util.h"

/* float rounding of two GEMM orders; values are O(1) */
#define ATOL 1e-5
#define RTOL 1e-5

/* ---- models and layers ------------------------------------------------------------------------------- */

static void one_layer_model(Model *m, int ndim, const int *in_shape, const LayerSpec *l, uint64_t seed) {
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(m, ndim, in_shape, l, 1, &err), QT_OK);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    model_init_params(m, &r);
}

static void dense_model(Model *m, int in, int out, uint64_t seed) {
    one_layer_model(m, 1, (const int[]){in}, &(LayerSpec){.type = LAYER_DENSE, .units = out, .name = "fc1"}, seed);
}

static void conv_model(Model *m, int C, int H, int W, int OC, int k, int stride, int pad, uint64_t seed) {
    LayerSpec l = {.type = LAYER_CONV2D, .out_channels = OC, .kernel = k, .stride = stride, .padding = pad,
                   .name = "conv1"};
    one_layer_model(m, 3, (const int[]){C, H, W}, &l, seed);
}

static QLayerSpec spec_for(const char *qt, int tile, bool dq, bool symmetric) {
    QLayerSpec s = qlayer_spec_default();
    s.weight_qtype = qa_find(qt);
    s.tile_size = tile;
    s.double_quant = dq;
    s.symmetric = symmetric;
    if (!symmetric) s.weight_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
    return s;
}

static void quantize_ok(QLayer *q, Module *mod, const QLayerSpec *spec) {
    QtError err = {0};
    QtStatus st = qlayer_init_quantize(q, mod, spec, mod->weight->var.value.data, &err);
    if (st != QT_OK) fprintf(stderr, "\n  qlayer_init_quantize: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

static float *weight_deq(const QLayer *q) {
    float *w = qa_alloc_floats((size_t)q->out * (size_t)q->fan_in);
    qlayer_dequantize_weight(q, w);
    return w;
}

static size_t gcd_z(size_t a, size_t b) {
    while (b) {
        size_t r = a % b;
        a = b, b = r;
    }
    return a;
}

/* Output channels a band must be a multiple of. */
static size_t band_align(const QLayer *q) {
    size_t L = (size_t)q->weight.shape[1];
    return L / gcd_z((size_t)q->fan_in, L);
}

/* Bands start on QArray rows and the scratch stays within the budget, or
 * within one aligned band when that alone is larger. */
static void check_bands(const QLayer *q) {
    size_t align = band_align(q), row_bytes = (size_t)q->fan_in * sizeof(float);
    size_t limit = QLAYER_TILE_BYTES > align * row_bytes ? QLAYER_TILE_BYTES : align * row_bytes;
    CU_ASSERT(q->band_rows >= 1 && q->band_rows <= q->out);
    CU_ASSERT_EQUAL((size_t)q->band_rows % align, 0);
    CU_ASSERT((size_t)q->band_rows * row_bytes <= limit);
    /* as large as the budget allows */
    if (q->band_rows < q->out && align * row_bytes <= QLAYER_TILE_BYTES)
        CU_ASSERT(((size_t)q->band_rows + align) * row_bytes > QLAYER_TILE_BYTES);
}

/* ---- the reference: the float op with the dequantized weight ----------------------------------------------- */

typedef struct {
    float *y, *dx, *db; /* malloc'd copies */
    size_t ny, nx, nb;
} Result;

static void result_free(Result *r) {
    free(r->y), free(r->dx), free(r->db);
    memset(r, 0, sizeof *r);
}

static float *copy_floats(const float *src, size_t n) {
    float *d = qa_alloc_floats(n);
    if (src) memcpy(d, src, n * sizeof *d);
    else memset(d, 0, n * sizeof *d);
    return d;
}

/* x through fake quantization with act's static scale (and zero point): the reference of the layer's input. */
static Var *fq_input(Tape *t, const QLayer *act, Var *x) {
    Var *s = tape_new_var(t, 1, (const int[]){1}), *zp = NULL;
    s->value.data[0] = act->act_scale;
    if (!act->spec.act_symmetric) {
        zp = tape_new_var(t, 1, (const int[]){1});
        zp->value.data[0] = act->act_zero_point;
    }
    FakeQuantSpec fs = {.qtype = act->spec.act_qtype};
    return fq_fake_quant(t, x, &fs, s, zp);
}

/* Runs y = layer(x) and its backward from a fixed random dy into *r: the quantized layer if q, else the float
 * op with weight w, on fq(x) if act (a calibrated layer) is given. x: the module's input with batch N. */
static void run_layer(QLayer *q, Module *mod, const float *w, const QLayer *act, const float *x, int N, Result *r) {
    TestEnv e;
    test_env_init(&e, 5);
    int xs[4] = {N, mod->in_shape[0], mod->in_shape[1], mod->in_shape[2]};
    int xnd = mod->in_ndim + 1;
    size_t nx = (size_t)N;
    for (int d = 1; d < xnd; d++) nx *= (size_t)xs[d];
    Var *vx = test_var(&e, x, xnd, xs, true), *y;
    Var *b = mod->bias ? test_var(&e, mod->bias->var.value.data, 1, mod->bias->var.value.shape, true) : NULL;
    Param *pb = mod->bias;
    if (q) {
        if (pb && pb->var.grad) memset(pb->var.grad, 0, var_numel(&pb->var) * sizeof(float));
        y = qlayer_forward(&e.tape, q, vx);
    } else {
        Var *vw = tape_wrap(&e.tape, (float *)w, mod->weight->var.value.ndim, mod->weight->var.value.shape);
        Var *xin = act ? fq_input(&e.tape, act, vx) : vx;
        y = mod->spec.type == LAYER_DENSE ? nn_linear(&e.tape, xin, vw, b)
                                          : nn_conv2d(&e.tape, xin, vw, b, mod->spec.stride, mod->spec.padding);
    }
    if (!y) fprintf(stderr, "\n  forward: %s\n", e.tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    size_t ny = var_numel(y);
    float *dy = qa_normal_sample(77, ny);
    CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, dy), QT_OK);
    r->ny = ny, r->nx = nx, r->nb = pb ? (size_t)mod->weight->var.value.shape[0] : 0;
    r->y = copy_floats(y->value.data, ny);
    r->dx = copy_floats(vx->grad, nx);
    if (pb) r->db = copy_floats(q ? pb->var.grad : b->grad, r->nb);
    free(dy);
    test_env_free(&e);
}

/* Whether a and b are close; names the case and the array if not. */
static bool close_or_say(const float *a, const float *b, size_t n, const char *what, const char *array) {
    size_t worst = 0;
    double r = test_close_ratio(a, b, n, ATOL, RTOL, &worst);
    if (r <= 1.0) return true;
    fprintf(stderr, "\n  %s: %s[%zu] = %.9g vs %.9g (ratio %.3g)\n", what, array, worst, (double)a[worst],
            (double)b[worst], r);
    return false;
}

/* The quantized layer's y, dx and bias grad against the float op with the dequantized weight. */
static void compare_layer(QLayer *q, Module *mod, const float *x, int N, const char *what) {
    float *w = weight_deq(q);
    Result a = {0}, b = {0};
    run_layer(q, mod, NULL, NULL, x, N, &a);
    run_layer(NULL, mod, w, NULL, x, N, &b);
    CU_ASSERT_EQUAL(a.ny, b.ny);
    CU_ASSERT(close_or_say(a.y, b.y, a.ny, what, "y"));
    CU_ASSERT(close_or_say(a.dx, b.dx, a.nx, what, "dx"));
    if (a.db) CU_ASSERT(close_or_say(a.db, b.db, a.nb, what, "dbias"));
    result_free(&a), result_free(&b);
    free(w);
}

static size_t input_numel(const Module *mod, int N) {
    size_t n = (size_t)N;
    for (int d = 0; d < mod->in_ndim; d++) n *= (size_t)mod->in_shape[d];
    return n;
}

/* ---- layouts and bands ------------------------------------------------------------------------------- */

static void test_layout_dense(void) {
    Model m;
    dense_model(&m, 700, 300, 1);
    Module *mod = &m.modules[0];
    QLayerSpec spec = spec_for("int8", 0, false, true);
    int ndim = 0, shape[2] = {0, 0};
    QArrayOptions o;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qlayer_layout(&spec, mod, &ndim, shape, &o, &err), QT_OK);
    CU_ASSERT(ndim == 2 && shape[0] == 300 && shape[1] == 700);
    CU_ASSERT(o.n_channelwise == 1 && o.channelwise_axes[0] == 0 && o.n_tiled == 0);
    CU_ASSERT(o.calib == &spec.weight_calib && o.range == QARRAY_RANGE_SYMMETRIC && !o.double_quant);
    float *x = qa_normal_sample(3, input_numel(mod, 4));
    QLayer q;
    quantize_ok(&q, mod, &spec);
    CU_ASSERT(q.out == 300 && q.fan_in == 700 && q.w_ndim == 2);
    CU_ASSERT_EQUAL(q.band_rows, (int)(QLAYER_TILE_BYTES / (700 * 4))); /* 93: four bands */
    check_bands(&q);
    compare_layer(&q, mod, x, 4, "int8 per channel 300x700");
    qlayer_free(&q);

    /* blocks of 16 across rows of 700: a band must start on a block, i.e. be a multiple of 4 rows */
    spec = spec_for("int4", 16, false, true);
    CU_ASSERT_EQUAL_FATAL(qlayer_layout(&spec, mod, &ndim, shape, &o, &err), QT_OK);
    CU_ASSERT(shape[0] == 300 * 700 / 16 && shape[1] == 16 && o.n_channelwise == 1 && o.channelwise_axes[0] == 0);
    quantize_ok(&q, mod, &spec);
    CU_ASSERT_EQUAL(band_align(&q), 4);
    CU_ASSERT_EQUAL(q.band_rows, 92);
    check_bands(&q);
    compare_layer(&q, mod, x, 4, "int4 blocks of 16 over 300x700");
    qlayer_free(&q);

    /* per tensor: one scale, nf4 too (whose QArray default would be blocks of 64) */
    const char *per_tensor[] = {"int8", "nf4"};
    for (int i = 0; i < 2; i++) {
        spec = spec_for(per_tensor[i], 0, false, true);
        spec.per_tensor = true;
        quantize_ok(&q, mod, &spec);
        CU_ASSERT_EQUAL(q.weight.n_scales, 1);
        compare_layer(&q, mod, x, 4, per_tensor[i]);
        qlayer_free(&q);
    }
    free(x);
    model_free(&m);
}

/* A 1-channel 3x3 conv has fan_in 9: blocks of 64 run across output channels, so bands are multiples of 64
 * rows; with 8192 channels that is two bands of 7232 and 960. */
static void test_layout_conv_blocks(void) {
    Model m;
    conv_model(&m, 1, 5, 5, 8192, 3, 1, 1, 2);
    Module *mod = &m.modules[0];
    QLayerSpec spec = spec_for("int8", 64, false, true);
    int ndim = 0, shape[2] = {0, 0};
    QArrayOptions o;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qlayer_layout(&spec, mod, &ndim, shape, &o, &err), QT_OK);
    CU_ASSERT(ndim == 2 && shape[0] == 8192 * 9 / 64 && shape[1] == 64);
    float *x = qa_normal_sample(4, input_numel(mod, 2));
    QLayer q;
    quantize_ok(&q, mod, &spec);
    CU_ASSERT(q.out == 8192 && q.fan_in == 9 && q.w_ndim == 4 && q.w_shape[1] == 1 && q.w_shape[3] == 3);
    CU_ASSERT_EQUAL(band_align(&q), 64);
    CU_ASSERT_EQUAL(q.band_rows, 7232);
    check_bands(&q);
    /* dx sums 8192 channels' 9 taps: the float op on im2col + sgemm, whose blocked sums round as the layer's
     * bands do; the taps kernels (a 5x5 plane takes their flat planes at 16 lanes) sum each output in one chain
     * of 73,728 products, about 15 times further from the exact sum, past this test's tolerance, which is for
     * the banding */
    const ConvTapsLevel saved = conv_taps_max_level;
    conv_taps_max_level = CONV_TAPS_OFF;
    compare_layer(&q, mod, x, 2, "int8 blocks of 64 over a 9-wide conv");
    qlayer_free(&q);

    /* blocks of 8192: the alignment alone (8192 rows x 36 bytes) is over the budget, and is the band */
    spec = spec_for("int8", 8192, false, true);
    quantize_ok(&q, mod, &spec);
    CU_ASSERT_EQUAL(q.band_rows, 8192);
    CU_ASSERT((size_t)q.band_rows * 9 * 4 > QLAYER_TILE_BYTES);
    check_bands(&q);
    compare_layer(&q, mod, x, 2, "int8 blocks of 8192");
    conv_taps_max_level = saved;
    qlayer_free(&q);
    free(x);
    model_free(&m);

    /* mxfp4 on fan_in 36: its own blocks of 32, no axes, no calibration, bands of multiples of 8 */
    conv_model(&m, 4, 6, 6, 16, 3, 1, 0, 3);
    mod = &m.modules[0];
    spec = spec_for("mxfp4", 0, false, true);
    CU_ASSERT_EQUAL_FATAL(qlayer_layout(&spec, mod, &ndim, shape, &o, &err), QT_OK);
    CU_ASSERT(shape[0] == 18 && shape[1] == 32 && o.n_channelwise == 0 && o.n_tiled == 0 && !o.calib);
    spec.tile_size = 32; /* the format's own block may be named */
    quantize_ok(&q, mod, &spec);
    CU_ASSERT_EQUAL(band_align(&q), 8);
    check_bands(&q);
    qlayer_free(&q);
    model_free(&m);

    /* one weight row larger than the budget: bands of one row */
    dense_model(&m, 70000, 2, 4);
    mod = &m.modules[0];
    spec = spec_for("int8", 0, false, true);
    quantize_ok(&q, mod, &spec);
    CU_ASSERT_EQUAL(q.band_rows, 1);
    check_bands(&q);
    x = qa_normal_sample(5, input_numel(mod, 2));
    compare_layer(&q, mod, x, 2, "rows over the budget");
    free(x);
    qlayer_free(&q);
    model_free(&m);
}

/* ---- forward and input gradient per format ----------------------------------------------------------- */

typedef struct {
    const char *name, *qt;
    int tile;
    bool dq, symmetric;
} FmtCase;

static const FmtCase FMT_CASES[] = {
    {"int8 per channel", "int8", 0, false, true},
    {"int4 blocks of 32", "int4", 32, false, true},
    {"nf4 blocks of 64 + dq", "nf4", 64, true, true},
    {"fp8_e4m3 per channel", "fp8_e4m3", 0, false, true},
    {"uint8 asymmetric", "uint8", 0, false, false},
    {"mxfp4", "mxfp4", 0, false, true},
};
#define N_FMT_CASES (int)(sizeof FMT_CASES / sizeof FMT_CASES[0])

static void test_forward_formats(void) {
    Model dm, cm;
    dense_model(&dm, 96, 40, 11);
    conv_model(&cm, 4, 7, 7, 16, 3, 2, 1, 12); /* fan_in 36: blocks of 32 and 64 span rows */
    Model *models[2] = {&dm, &cm};
    const int batch[2] = {5, 3};
    for (int k = 0; k < 2; k++) {
        Module *mod = &models[k]->modules[0];
        float *x = qa_normal_sample(13 + (uint64_t)k, input_numel(mod, batch[k]));
        for (int c = 0; c < N_FMT_CASES; c++) {
            const FmtCase *fc = &FMT_CASES[c];
            QLayerSpec spec = spec_for(fc->qt, fc->tile, fc->dq, fc->symmetric);
            QLayer q;
            quantize_ok(&q, mod, &spec);
            CU_ASSERT_EQUAL(q.weight.double_quant, fc->dq);
            CU_ASSERT_EQUAL(q.weight.asymmetric, !fc->symmetric);
            check_bands(&q);
            char what[96];
            snprintf(what, sizeof what, "%s %s", mod->path, fc->name);
            compare_layer(&q, mod, x, batch[k], what);
            qlayer_free(&q);
        }
        free(x);
    }
    model_free(&dm);
    model_free(&cm);
}

/* A dense weight dequantized whole (once per step, the backward reading the forward's copy; over 3 threads the
 * forward is split into parts that each dequantize and multiply their rows) and band by band (forward and backward
 * each dequantizing): the backward's GEMMs are the same calls on the same values, so dx and the bias grad are the
 * same bits; the forwards are one GEMM, parts of it or several, equal up to sgemm's blocking. All match the float
 * op on the dequantized weight. */
static void test_dense_whole_and_bands(void) {
    enum { N = 32 }; /* 2 * 32 * 96 * 784 flops: worth splitting */
    Model m;
    dense_model(&m, 784, 96, 15); /* bands of 80 rows (blocks of 64 across rows of 784): two bands */
    Module *mod = &m.modules[0];
    QLayerSpec spec = spec_for("nf4", 64, true, true);
    QLayer q;
    quantize_ok(&q, mod, &spec);
    CU_ASSERT_EQUAL(q.band_rows, 80);
    float *x = qa_normal_sample(16, input_numel(mod, N));
    const size_t whole_bytes = qlayer_dense_whole_bytes;
    const int threads_before = parallel_get_threads();
    static const struct {
        const char *what;
        bool banded;
        int threads;
    } runs[3] = {{"nf4 784x96 whole", false, 1}, {"nf4 784x96 whole, 3 threads", false, 3},
                 {"nf4 784x96 in bands", true, 1}};
    Result r[3] = {{0}};
    for (int i = 0; i < 3; i++) {
        qlayer_dense_whole_bytes = runs[i].banded ? 0 : whole_bytes;
        parallel_set_threads(runs[i].threads);
        run_layer(&q, mod, NULL, NULL, x, N, &r[i]);
        compare_layer(&q, mod, x, N, runs[i].what);
    }
    qlayer_dense_whole_bytes = whole_bytes;
    parallel_set_threads(threads_before);
    for (int i = 1; i < 3; i++) {
        CU_ASSERT(close_or_say(r[i].y, r[0].y, r[0].ny, runs[i].what, "y"));
        CU_ASSERT(close_or_say(r[i].dx, r[0].dx, r[0].nx, runs[i].what, "dx"));
        CU_ASSERT(r[0].db && memcmp(r[i].db, r[0].db, r[0].nb * sizeof(float)) == 0);
    }
    CU_ASSERT(memcmp(r[2].dx, r[0].dx, r[0].nx * sizeof(float)) == 0);
    for (int i = 0; i < 3; i++) result_free(&r[i]);
    free(x);
    qlayer_free(&q);
    model_free(&m);
}

static Var *gc_layer(Tape *t, Var **in, void *ctx) { return qlayer_forward(t, ctx, in[0]); }

/* The layer is linear in x: central differences are exact up to float noise. */
static void test_gradcheck(void) {
    Model dm, cm;
    dense_model(&dm, 20, 12, 21);
    conv_model(&cm, 2, 5, 5, 4, 3, 2, 1, 22);
    Model *models[2] = {&dm, &cm};
    const int tiles[2] = {16, 8}; /* both across rows: fan_in 20 and 18 */
    for (int k = 0; k < 2; k++) {
        Module *mod = &models[k]->modules[0];
        QLayerSpec spec = spec_for("int4", tiles[k], false, true);
        QLayer q;
        quantize_ok(&q, mod, &spec);
        GradcheckInput in = {.ndim = mod->in_ndim + 1, .shape = {2, mod->in_shape[0], mod->in_shape[1],
                                                                 mod->in_shape[2]}, .check = true};
        float *x = qa_normal_sample(23 + (uint64_t)k, input_numel(mod, 2));
        in.data = x;
        CU_ASSERT(gradcheck(mod->path, gc_layer, &q, &in, 1, 1e-3, 2e-3, 1e-2));
        free(x);
        qlayer_free(&q);
    }
    model_free(&dm);
    model_free(&cm);
}

/* ---- bias and weight -------------------------------------------------------------------------------------- */

static bool nodes_read(const Tape *t, const Var *v) {
    for (size_t i = 0; i < t->n_nodes; i++)
        for (int k = 0; k < TAPE_MAX_INPUTS; k++)
            if (t->nodes[i].in[k] == v) return true;
    return false;
}

/* A trainable bias gets its gradient (compare_layer checks its value), a frozen one none and no error; the
 * weight, even released, is neither read nor given a gradient. */
static void test_bias_and_weight(void) {
    Model m;
    conv_model(&m, 3, 6, 6, 8, 3, 2, 1, 31);
    Module *mod = &m.modules[0];
    QLayerSpec spec = spec_for("int8", 0, false, true);
    QLayer q;
    quantize_ok(&q, mod, &spec);
    float *x = qa_normal_sample(32, input_numel(mod, 2));
    compare_layer(&q, mod, x, 2, "trainable bias");
    double sum = 0.0;
    for (int i = 0; i < 8; i++) sum += fabsf(mod->bias->var.grad[i]);
    CU_ASSERT(sum > 0.0);

    param_release(mod->weight);
    param_freeze(mod->bias);
    CU_ASSERT_PTR_NULL(mod->weight->var.value.data);
    TestEnv e;
    test_env_init(&e, 33);
    Var *vx = test_var(&e, x, 4, (const int[]){2, 3, 6, 6}, true);
    Var *y = qlayer_forward(&e.tape, &q, vx);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    CU_ASSERT(!nodes_read(&e.tape, &mod->weight->var));
    float *dy = qa_normal_sample(34, var_numel(y));
    CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, dy), QT_OK);
    CU_ASSERT_PTR_NOT_NULL(vx->grad);
    CU_ASSERT_PTR_NULL(mod->weight->var.grad);
    CU_ASSERT_PTR_NULL(mod->bias->var.grad);
    free(dy);
    test_env_free(&e);

    /* neither x nor the bias needs a gradient: nothing is recorded */
    test_env_init(&e, 35);
    vx = test_var(&e, x, 4, (const int[]){2, 3, 6, 6}, false);
    y = qlayer_forward(&e.tape, &q, vx);
    CU_ASSERT(y && !y->requires_grad && e.tape.n_nodes == 0);
    test_env_free(&e);
    free(x);
    qlayer_free(&q);
    model_free(&m);

    /* no bias at all */
    one_layer_model(&m, 1, (const int[]){10}, &(LayerSpec){.type = LAYER_DENSE, .units = 6, .no_bias = true}, 36);
    quantize_ok(&q, &m.modules[0], &spec);
    x = qa_normal_sample(37, 30);
    compare_layer(&q, &m.modules[0], x, 3, "no bias");
    free(x);
    qlayer_free(&q);
    model_free(&m);
}

/* ---- static activation ranges ------------------------------------------------------------------------------ */

/* Calibrates over three batches (each observed, unquantized) and checks the mean range's scale, then that the
 * forward is the layer on fq(x). */
static void check_act_case(const char *act, bool symmetric, const char *calib, float shift) {
    enum { N = 6, IN = 32, OUT = 8 };
    Model m;
    dense_model(&m, IN, OUT, 43);
    Module *mod = &m.modules[0];
    QLayerSpec spec = spec_for("int8", 0, false, true);
    spec.act_qtype = qa_find(act);
    spec.act_symmetric = symmetric;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(calib_parse(calib, &spec.act_calib, &err), QT_OK);
    QLayer q;
    quantize_ok(&q, mod, &spec);
    CU_ASSERT(!q.act_ready && !q.calibrating);
    float *w = weight_deq(&q), *x = qa_normal_sample(44, N * IN), bx[N * IN];
    Result a = {0}, b = {0};
    q.act_scale = 123.0f; /* stale: calibration must replace it */
    qlayer_calib_begin(&q);
    CU_ASSERT(q.calibrating && !q.act_ready && q.act_stats.count == 0);
    double lo_sum = 0.0, hi_sum = 0.0;
    CalibQuant cq = fq_calib_quant(spec.act_qtype, symmetric ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC, false,
                                   QARRAY_ZP_INT32);
    for (int k = 1; k <= 3; k++) {
        for (int i = 0; i < N * IN; i++) bx[i] = x[i] * (float)k + shift;
        CalibRange br;
        CU_ASSERT_EQUAL_FATAL(calib_compute(&spec.act_calib, bx, N * IN, &cq, NULL, 0, &br, &err), QT_OK);
        lo_sum += br.lo, hi_sum += br.hi;
        /* observed, not quantized: the plain layer */
        run_layer(&q, mod, NULL, NULL, bx, N, &a);
        run_layer(NULL, mod, w, NULL, bx, N, &b);
        CU_ASSERT(close_or_say(a.y, b.y, N * OUT, act, "y while calibrating"));
        result_free(&a), result_free(&b);
    }
    CU_ASSERT_EQUAL(q.act_stats.count, 3);
    CU_ASSERT_EQUAL_FATAL(qlayer_calib_end(&q, &err), QT_OK);
    CU_ASSERT(q.act_ready && !q.calibrating);
    const QType *t = spec.act_qtype;
    float lo = (float)(lo_sum / 3), hi = (float)(hi_sum / 3);
    if (symmetric) hi = fmaxf(-lo, hi), lo = -hi;
    float s = qarray_scale_for_range(t, !symmetric, false, (float)t->qmin, (float)t->qmax, lo, hi);
    CU_ASSERT(fabsf(q.act_scale - s) <= 1e-6f * s);
    if (!symmetric) {
        float zp = qarray_zero_point_for_range(false, (float)t->qmin, (float)t->qmax, lo, q.act_scale);
        CU_ASSERT_EQUAL(q.act_zero_point, zp);
        CU_ASSERT(q.act_zero_point > 0.0f);
    } else {
        CU_ASSERT_EQUAL(q.act_zero_point, 0.0f);
    }

    /* quantized input; x scaled by 4 so that some of it clips and gets no gradient */
    for (int i = 0; i < N * IN; i++) bx[i] = x[i] * 4.0f + shift;
    run_layer(&q, mod, NULL, NULL, bx, N, &a);
    run_layer(NULL, mod, w, &q, bx, N, &b);
    CU_ASSERT(close_or_say(a.y, b.y, N * OUT, act, "y"));
    CU_ASSERT(close_or_say(a.dx, b.dx, N * IN, act, "dx"));
    int clipped = 0;
    for (int i = 0; i < N * IN; i++) clipped += a.dx[i] == 0.0f;
    CU_ASSERT(clipped > 0);
    result_free(&a), result_free(&b);

    /* the statistics alone (as a checkpoint restores them) give the same scale */
    QLayer q2 = q;
    q2.act_ready = false, q2.act_scale = 0.0f;
    CU_ASSERT_EQUAL(qlayer_act_from_stats(&q2, &err), QT_OK);
    CU_ASSERT(q2.act_ready && q2.act_scale == q.act_scale && q2.act_zero_point == q.act_zero_point);
    free(w), free(x);
    qlayer_free(&q);
    model_free(&m);
}

static void test_act_calibration(void) {
    check_act_case("int8", true, "absmax", 0.0f);
    check_act_case("uint8", false, "minmax", 1.5f);
    check_act_case("fp8_e4m3", true, "percentile,99", 0.0f);
}

static void test_calib_errors(void) {
    Model m;
    dense_model(&m, 16, 4, 51);
    QLayerSpec spec = spec_for("int8", 0, false, true);
    QLayer q;
    QtError err = {0};
    /* without an act_qtype: no-ops */
    quantize_ok(&q, &m.modules[0], &spec);
    qlayer_calib_begin(&q);
    CU_ASSERT(!q.calibrating);
    CU_ASSERT_EQUAL(qlayer_calib_end(&q, &err), QT_OK);
    CU_ASSERT(!q.act_ready);
    qlayer_free(&q);
    /* no batch seen */
    spec.act_qtype = qa_find("int8");
    quantize_ok(&q, &m.modules[0], &spec);
    qlayer_calib_begin(&q);
    CU_ASSERT_EQUAL(qlayer_calib_end(&q, &err), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&err, "fc1: "));
    CU_ASSERT(test_msg_has(&err, "no batch"));
    CU_ASSERT(!q.act_ready);
    qlayer_free(&q);
    model_free(&m);
}

/* ---- spec errors --------------------------------------------------------------------------------------- */

typedef struct {
    const char *name, *qt;
    int tile;
    bool per_tensor, dq, symmetric, narrow;
    QArrayScaleType scale_type;
    const char *act_qt;
    const char *has[3]; /* besides the module path */
} SpecErr;

static const SpecErr SPEC_ERRS[] = {
    {"tile not dividing numel", "int4", 64, false, false, true, false, 0, NULL, {"224", "tile_size 64", "e.g. 56"}},
    {"double_quant with a block format", "mxfp4", 0, false, true, true, false, 0, NULL, {"double_quant", "mxfp4"}},
    {"asymmetric nf4", "nf4", 0, false, false, false, false, 0, NULL, {"nf4", "symmetric"}},
    {"per_tensor with a tile", "int8", 10, true, false, true, false, 0, NULL, {"per_tensor", "tile_size 10"}},
    {"a block format's block changed", "mxfp4", 16, false, false, true, false, 0, NULL, {"blocks of 32", "16"}},
    {"double_quant with float16 scales", "int4", 0, false, true, true, false, QARRAY_SCALE_F16, NULL,
     {"double_quant", "float32"}},
    {"narrow float", "fp8_e4m3", 0, false, false, true, true, 0, NULL, {"narrow_range"}},
    {"block act format", "int8", 0, false, false, true, false, 0, "mxfp8_e4m3", {"act_qtype", "mxfp8_e4m3"}},
};

static void test_spec_errors(void) {
    Model m;
    dense_model(&m, 32, 7, 61); /* 224 weights: blocks of 32 fit, 64 do not */
    Module *mod = &m.modules[0];
    for (size_t i = 0; i < sizeof SPEC_ERRS / sizeof SPEC_ERRS[0]; i++) {
        const SpecErr *c = &SPEC_ERRS[i];
        QLayerSpec spec = spec_for(c->qt, c->tile, c->dq, c->symmetric);
        spec.per_tensor = c->per_tensor, spec.narrow_range = c->narrow, spec.scale_type = c->scale_type;
        if (c->act_qt) spec.act_qtype = qa_find(c->act_qt);
        QtError err = {0};
        QtStatus st = qlayer_spec_check(&spec, mod, &err);
        if (st != QT_ERR_CONFIG) fprintf(stderr, "\n  %s: status %d (%s)\n", c->name, (int)st, err.msg);
        CU_ASSERT_EQUAL(st, QT_ERR_CONFIG);
        CU_ASSERT(strncmp(err.msg, "fc1: ", 5) == 0);
        for (int k = 0; k < 3 && c->has[k]; k++) CU_ASSERT(test_msg_has(&err, c->has[k]));
        /* init refuses the same spec and leaves q zeroed */
        QLayer q;
        memset(&q, 0x5a, sizeof q);
        QtError err2 = {0};
        CU_ASSERT_EQUAL(qlayer_init_quantize(&q, mod, &spec, mod->weight->var.value.data, &err2), QT_ERR_CONFIG);
        CU_ASSERT(q.module == NULL && q.weight.codes == NULL);
        CU_ASSERT_STRING_EQUAL(err.msg, err2.msg);
    }
    /* a block format whose block does not divide the weight */
    Model m1;
    dense_model(&m1, 30, 7, 62);
    QLayerSpec mx = spec_for("mxfp4", 0, false, true);
    QtError err = {0};
    CU_ASSERT_EQUAL(qlayer_spec_check(&mx, &m1.modules[0], &err), QT_ERR_CONFIG);
    CU_ASSERT(strncmp(err.msg, "fc1: ", 5) == 0);
    CU_ASSERT(test_msg_has(&err, "210") && test_msg_has(&err, "block of 32"));
    model_free(&m1);
    /* a module with no weight */
    LayerSpec l[2] = {{.type = LAYER_RELU, .name = "act1"}, {.type = LAYER_DENSE, .units = 3}};
    Model m2;
    qt_error_clear(&err);
    CU_ASSERT_EQUAL_FATAL(model_init(&m2, 1, (const int[]){4}, l, 2, &err), QT_OK);
    QLayerSpec spec = spec_for("int8", 0, false, true);
    CU_ASSERT_EQUAL(qlayer_spec_check(&spec, &m2.modules[0], &err), QT_ERR_CONFIG);
    CU_ASSERT(strncmp(err.msg, "act1: ", 6) == 0);
    /* and a valid one passes */
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(qlayer_spec_check(&spec, &m2.modules[1], &err), QT_OK);
    model_free(&m2);
    model_free(&m);
}

/* ---- storage -------------------------------------------------------------------------------------------- */

/* QLoRA's nf4 in blocks of 64 with double quantization: about 4.127 bits per weight. */
static void test_bits_and_describe(void) {
    Model m;
    dense_model(&m, 3136, 128, 71);
    QLayerSpec spec = spec_for("nf4", 64, true, true);
    spec.act_qtype = qa_find("int8");
    CU_ASSERT_EQUAL_FATAL(calib_parse("percentile,99.9", &spec.act_calib, NULL), QT_OK);
    QLayer q;
    quantize_ok(&q, &m.modules[0], &spec);
    double bits = (double)qlayer_bytes(&q) * 8.0 / (128.0 * 3136.0);
    CU_ASSERT(bits <= 4.2 && bits > 4.1);
    char d[160];
    qlayer_describe(&q, d, sizeof d);
    CU_ASSERT_STRING_EQUAL(d, "nf4 block 64 +dq absmax, act int8 percentile,99.9 (4.13 bits)");
    qlayer_free(&q);
    spec = spec_for("int8", 0, false, false);
    spec.scale_type = QARRAY_SCALE_BF16;
    quantize_ok(&q, &m.modules[0], &spec);
    qlayer_describe(&q, d, sizeof d);
    CU_ASSERT(strstr(d, "int8 per-channel asym bfloat16 scales minmax (") == d);
    qlayer_describe(&q, d, 8); /* truncated, still terminated */
    CU_ASSERT_EQUAL(strlen(d), 7);
    qlayer_free(&q);
    model_free(&m);
}

/* ---- a model of quantized layers: install, release, the arena's steady state --------------------------------- */

static void test_model_steady_state(void) {
    enum { N = 4, C = 2, H = 6, W = 6, OC = 4, CLASSES = 10 };
    Model m;
    QtError err = {0};
    test_small_cnn(&m, 81);
    QLayerSpec cs = spec_for("nf4", 24, true, true); /* fan_in 18: blocks across channels */
    QLayerSpec ds = spec_for("int4", 32, false, true);
    ds.act_qtype = qa_find("int8");
    CU_ASSERT_EQUAL_FATAL(calib_parse("percentile,99", &ds.act_calib, &err), QT_OK);
    QLayer q[2];
    Module *mods[2] = {&m.modules[0], &m.modules[2]};
    quantize_ok(&q[0], mods[0], &cs);
    quantize_ok(&q[1], mods[1], &ds);
    for (int i = 0; i < 2; i++) {
        param_release(mods[i]->weight);
        qlayer_install(&q[i]);
        CU_ASSERT(mods[i]->hook_ctx == &q[i] && mods[i]->forward_hook != NULL);
    }
    Arena a;
    Tape t;
    CU_ASSERT_FATAL(arena_init(&a, 4096) == 0);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, NULL, NULL), QT_OK);
    float *x = qa_normal_sample(82, N * C * H * W), *dy = qa_normal_sample(83, N * CLASSES);
    const int xs[4] = {N, C, H, W};
    /* calibration batches, forward only */
    qlayer_calib_begin(&q[1]);
    t.grad_enabled = false;
    for (int b = 0; b < 2; b++) {
        tape_reset(&t);
        CU_ASSERT_PTR_NOT_NULL(model_forward(&m, &t, tape_wrap(&t, x, 4, xs)));
    }
    t.grad_enabled = true;
    CU_ASSERT_EQUAL_FATAL(qlayer_calib_end(&q[1], &err), QT_OK);
    test_assert_steady_steps(&m, &t, &a, x, dy, 5);
    /* the biases trained, the released weights never got a gradient */
    CU_ASSERT(mods[0]->bias->var.grad[0] != 0.0f && mods[1]->bias->var.grad[0] != 0.0f);
    CU_ASSERT(mods[0]->weight->var.grad == NULL && mods[1]->weight->var.grad == NULL);
    free(x), free(dy);
    tape_free(&t);
    arena_free(&a);
    qlayer_free(&q[0]), qlayer_free(&q[1]);
    model_free(&m);
}

static void test_layer_restore(void) {
    Model m;
    conv_model(&m, 4, 6, 6, 16, 3, 1, 1, 101);
    Module *mod = &m.modules[0];
    QLayerSpec spec = spec_for("nf4", 64, true, true);
    QLayer a, b;
    QtError err = {0};
    quantize_ok(&a, mod, &spec);
    CU_ASSERT_EQUAL_FATAL(qlayer_init_empty(&b, mod, &spec, &err), QT_OK);
    CU_ASSERT(b.band_rows == a.band_rows && b.out == a.out && b.fan_in == a.fan_in);
    CU_ASSERT(b.options.calib == &b.spec.weight_calib);
    qa_copy_blobs(&b.weight, &a.weight, 3);
    CU_ASSERT_EQUAL(qlayer_bytes(&a), qlayer_bytes(&b));
    float *x = qa_normal_sample(102, input_numel(mod, 2));
    Result ra = {0}, rb = {0};
    run_layer(&a, mod, NULL, NULL, x, 2, &ra);
    run_layer(&b, mod, NULL, NULL, x, 2, &rb);
    CU_ASSERT(memcmp(ra.y, rb.y, ra.ny * sizeof(float)) == 0);
    CU_ASSERT(memcmp(ra.dx, rb.dx, ra.nx * sizeof(float)) == 0);
    result_free(&ra), result_free(&rb);
    free(x);
    qlayer_free(&a), qlayer_free(&b);
    model_free(&m);
}

int register_quant_qlayer_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qlayer", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "dense layouts and bands", test_layout_dense) ||
           !CU_add_test(s, "conv blocks across rows, bands over the budget", test_layout_conv_blocks) ||
           !CU_add_test(s, "forward and input grad == float op, per format", test_forward_formats) ||
           !CU_add_test(s, "dense: whole weight once per step, or bands", test_dense_whole_and_bands) ||
           !CU_add_test(s, "input grad by finite differences", test_gradcheck) ||
           !CU_add_test(s, "bias grads, no weight grad", test_bias_and_weight) ||
           !CU_add_test(s, "static activation calibration", test_act_calibration) ||
           !CU_add_test(s, "calibration errors", test_calib_errors) ||
           !CU_add_test(s, "spec errors name the module", test_spec_errors) ||
           !CU_add_test(s, "bits per weight and description", test_bits_and_describe) ||
           !CU_add_test(s, "installed in a model: arena steady state", test_model_steady_state) ||
           !CU_add_test(s, "layer restored from blobs", test_layer_restore);
}
