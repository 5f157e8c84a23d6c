/* test_qconv_dw.c - the depthwise int8 convolution (qgemm_dw in qgemm.h, qlayer_int8_conv_dw): the VNNI kernel
 * against the portable one and an int64 definition, bit for bit; a depthwise QLayer's int8 forward against its
 * fake-quantized float path (strides 1 to 3, paddings 0, 1 and 'same', non-square kernels, strides and paddings,
 * a channel multiplier, odd widths, 1 and many channels, N = 1 and N > 1), bit for bit across kernels and thread
 * counts; its relu and relu + 2x2 max pool epilogues against nn's ops; the geometries that still fall back;
 * errors; a model's arena in the steady state; and a PTQ run of the tiny depthwise model evaluated by `qtrain
 * eval` on each forced kernel. The quant_int8_dw suite. */
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
#include "test_int8.h"
#include "test_proc.h"
#include "test_qarray.h"
#include "test_util.h"

/* As test_qlayer_int8.c: the float path sums the 9 or so products in float, the int8 path rounds the exact sum
 * once; outputs are O(1). */
#define ATOL 2e-4
#define RTOL 1e-4

/* ---- the kernels ----------------------------------------------------------------------------------------------- */

typedef struct {
    int kh, kw, sh, sw, h, w, pt, pl, n_oc; /* kernel, strides, input, padding on the top and the left, channels */
    int oh, ow;                             /* set by kernel_case */
} KGeo;

/* out (n_oc, oh, ow) by the definition: int64 sums of (u - a_zero) w over the input (the padding's terms are 0),
 * one fmaf, relu. */
static void dw_definition(float *out, const uint8_t *act, const int8_t *w, const KGeo *g, int a_zero,
                          const float *scale, const float *bias, bool relu) {
    for (int oc = 0; oc < g->n_oc; oc++)
        for (int i = 0; i < g->oh; i++)
            for (int j = 0; j < g->ow; j++) {
                int64_t s = 0;
                for (int r = 0; r < g->kh; r++)
                    for (int c = 0; c < g->kw; c++) {
                        const int ih = i * g->sh + r - g->pt, iw = j * g->sw + c - g->pl;
                        if (ih < 0 || ih >= g->h || iw < 0 || iw >= g->w) continue;
                        s += ((int64_t)act[(size_t)ih * g->w + iw] - a_zero) * w[((size_t)oc * g->kh + r) * g->kw + c];
                    }
                float y = fmaf((float)(int32_t)s, scale[oc], bias ? bias[oc] : 0.0f);
                out[((size_t)oc * g->oh + i) * g->ow + j] = !relu || y > 0.0f ? y : 0.0f;
            }
}

/* Codes only 0 or 255 and weights only -128 or 127 (what vpmaddubsw would saturate on), for kernels_on. */
static bool dw_extremes;

/* extra: rows and columns of padding below and right beyond pt and pl (padding 'same' of an even kernel). The
 * codes sit in a buffer of exactly h * w bytes, so a read outside them is an error under the sanitizers. */
static void kernel_case(const KGeo *geo, int extra, int a_zero, bool relu, bool bias, QGemmIsa family,
                        uint64_t seed) {
    KGeo g = *geo;
    g.oh = (g.h + 2 * g.pt + extra - g.kh) / g.sh + 1, g.ow = (g.w + 2 * g.pl + extra - g.kw) / g.sw + 1;
    CU_ASSERT_FATAL(g.oh >= 1 && g.ow >= 1);
    char what[200];
    snprintf(what, sizeof what, "%dx%d kernel, stride [%d, %d], input %dx%d, padding [%d, %d] + %d, %d channels, "
             "a_zero %d%s%s", g.kh, g.kw, g.sh, g.sw, g.h, g.w, g.pt, g.pl, extra, g.n_oc, a_zero, relu ? ", relu" : "",
             bias ? ", bias" : "");
    QGemmPackedDw p;
    QtError err = {0};
    const size_t nw = (size_t)g.n_oc * g.kh * g.kw, n_act = (size_t)g.h * g.w, n_out = (size_t)g.n_oc * g.oh * g.ow;
    int8_t *w = malloc(nw);
    float *scale = malloc((size_t)g.n_oc * sizeof *scale), *bi = malloc((size_t)g.n_oc * sizeof *bi);
    uint8_t *act = malloc(n_act);
    Rng r;
    rng_init(&r, seed, 0);
    for (size_t i = 0; i < nw; i++) w[i] = (int8_t)rng_below(&r, 256);
    w[0] = -128, w[nw - 1] = 127; /* the extremes */
    for (int i = 0; i < g.n_oc; i++) scale[i] = 1e-3f * (float)(1 + i % 5), bi[i] = 0.25f * (float)(i % 3) - 0.3f;
    for (size_t i = 0; i < n_act; i++) act[i] = (uint8_t)rng_below(&r, 256);
    act[0] = 255, act[n_act - 1] = 0;
    if (dw_extremes) {
        for (size_t i = 0; i < nw; i++) w[i] = rng_below(&r, 2) ? 127 : -128;
        for (size_t i = 0; i < n_act; i++) act[i] = rng_below(&r, 2) ? 255 : 0;
    }
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_dw(&p, w, g.n_oc, g.kh, g.kw, &err), QT_OK);
    float *want = qa_alloc_floats(n_out), *got = qa_alloc_floats(n_out);
    uint32_t *scratch = aligned_alloc(64, qgemm_dw_scratch(&p, g.oh, g.ow, g.sh));
    dw_definition(want, act, w, &g, a_zero, scale, bias ? bi : NULL, relu);
    QGemmDw d = {.act = act, .in_h = g.h, .in_w = g.w, .pad_t = g.pt, .pad_l = g.pl, .oh_n = g.oh, .ow_n = g.ow,
                 .sh = g.sh, .sw = g.sw, .w = &p, .oc0 = 0, .n_oc = g.n_oc, .a_zero = a_zero, .out = got,
                 .scale = scale, .bias = bias ? bi : NULL, .relu = relu, .scratch = scratch};
    test_int8_family_on(family);
    qgemm_dw(&d);
    const char *kernel = qgemm_kernel_name();
    test_int8_family_off();
    bool same = !memcmp(want, got, n_out * sizeof *got);
    if (!same) fprintf(stderr, "\n  %s kernel, %s%s: differs from the definition\n", kernel, what,
                       dw_extremes ? ", extreme codes" : "");
    CU_ASSERT(same);
    /* a range of output channels writes only its own */
    if (g.n_oc > 2) {
        memset(got, 0, n_out * sizeof *got);
        d.oc0 = 1, d.n_oc = g.n_oc - 2;
        test_int8_family_on(family);
        qgemm_dw(&d);
        test_int8_family_off();
        const size_t plane = (size_t)g.oh * g.ow;
        CU_ASSERT(!memcmp(want + plane, got, (n_out - 2 * plane) * sizeof *got));
    }
    free(w), free(scale), free(bi), free(act), free(want), free(got), free(scratch);
    qgemm_packed_dw_free(&p);
}

static const KGeo KGEOS[] = {
    {3, 3, 1, 1, 14, 14, 1, 1, 4, 0, 0}, {3, 3, 1, 1, 13, 13, 1, 1, 3, 0, 0}, {3, 3, 1, 1, 28, 28, 0, 0, 1, 0, 0},
    {3, 3, 2, 2, 13, 13, 1, 1, 5, 0, 0}, {3, 3, 2, 2, 28, 28, 1, 1, 2, 0, 0}, {1, 5, 1, 1, 9, 17, 0, 2, 3, 0, 0},
    {5, 1, 1, 2, 6, 65, 2, 0, 2, 0, 0},  {7, 7, 3, 3, 11, 9, 3, 3, 3, 0, 0},  {1, 1, 1, 1, 3, 16, 0, 0, 2, 0, 0},
    {2, 9, 2, 1, 7, 31, 0, 4, 3, 0, 0},  {3, 3, 1, 3, 8, 1, 1, 1, 2, 0, 0},   {4, 6, 3, 2, 5, 40, 2, 3, 3, 0, 0},
    {3, 3, 2, 2, 1, 2, 1, 1, 2, 0, 0},   {3, 5, 1, 1, 4, 3, 2, 6, 2, 0, 0},   {3, 3, 2, 2, 40, 47, 5, 9, 1, 0, 0},
};

static void kernels_on(QGemmIsa family) {
    uint64_t seed = 3100;
    for (size_t i = 0; i < sizeof KGEOS / sizeof *KGEOS; i++)
        for (int k = 0; k < 4; k++)
            kernel_case(&KGEOS[i], k == 3, k == 0 ? 0 : k == 1 ? 128 : 77 + k, k & 1, k < 3, family, seed++);
    /* 64 x 64 products at the largest codes: the exact sum needs much of int32's range */
    const KGeo big = {64, 64, 1, 1, 65, 80, 0, 0, 2, 0, 0};
    kernel_case(&big, 0, 0, false, true, family, seed++);
    /* codes and weights only at their ends, zero points 0 .. 255 */
    dw_extremes = true;
    for (size_t i = 0; i < sizeof KGEOS / sizeof *KGEOS; i += 2)
        kernel_case(&KGEOS[i], 0, (int)(i * 37 % 256), false, true, family, seed++);
    kernel_case(&KGEOS[0], 0, 255, true, true, family, seed++);
    dw_extremes = false;
}

static void test_dw_kernel_portable(void) { kernels_on(QGEMM_ISA_PORTABLE); }

static void test_dw_kernel_vnni(void) {
    test_int8_on_families(kernels_on, (const QGemmIsa[]){QGEMM_ISA_AVX512_VNNI}, 1, "the depthwise kernel");
}

/* The 256-bit families share one depthwise kernel; each is run as qgemm_dw dispatches it. */
static void test_dw_kernel_256(void) {
    test_int8_on_families(kernels_on, (const QGemmIsa[]){QGEMM_ISA_AVXVNNI, QGEMM_ISA_AVX2}, 2, "the depthwise kernel");
}

static void test_dw_pack_errors(void) {
    QGemmPackedDw p;
    QtError err = {0};
    const int8_t w[4] = {1, 2, 3, 4};
    CU_ASSERT_EQUAL(qgemm_pack_dw(&p, w, 0, 2, 2, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "qgemm_pack_dw") && p.data == NULL);
    CU_ASSERT_EQUAL(qgemm_pack_dw(&p, w, 1, 257, 256, &err), QT_ERR_ARG);
    CU_ASSERT_EQUAL(qgemm_pack_dw(&p, NULL, 1, 2, 2, &err), QT_ERR_ARG);
    CU_ASSERT_EQUAL_FATAL(qgemm_pack_dw(&p, w, 1, 1, 4, &err), QT_OK);
    CU_ASSERT(p.kq == 1 && p.sum[0] == 10 && (uint32_t)p.data[0] == 0x04030201u);
    qgemm_packed_dw_free(&p);
    CU_ASSERT(p.data == NULL && p.sum == NULL);
}

/* ---- the layer ------------------------------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    int C, M, H, W;          /* input channels, output channels per input channel, input size */
    int kh, kw, sh, sw, ph, pw;
    bool same;               /* padding 'same' (ph, pw unused) */
    int groups, dil;         /* 0: C and 1 (depthwise); set for the geometries that fall back */
} DwGeo;

static const DwGeo DW_GEOS[] = {
    {"DS-CNN dw 3x3 s1 p1 14x14", 16, 1, 14, 14, 3, 3, 1, 1, 1, 1, false, 0, 0},
    {"dw 3x3 s2 p1 W13", 8, 1, 11, 13, 3, 3, 2, 2, 1, 1, false, 0, 0},
    {"dw 3x3 s[1,2] p0 one channel W28", 1, 1, 9, 28, 3, 3, 1, 2, 0, 0, false, 0, 0},
    {"dw 3x3 s2 p0 W28", 6, 1, 10, 28, 3, 3, 2, 2, 0, 0, false, 0, 0},
    {"dw 1x5 p[0,2] W13", 5, 1, 9, 13, 1, 5, 1, 1, 0, 2, false, 0, 0},
    {"dw 5x3 s[2,1] p[2,1] W14", 3, 1, 12, 14, 5, 3, 2, 1, 2, 1, false, 0, 0},
    {"dw 3x3 s[1,2] p[1,0] W13", 4, 1, 8, 13, 3, 3, 1, 2, 1, 0, false, 0, 0},
    {"dw 3x3 same W13", 7, 1, 6, 13, 3, 3, 1, 1, 0, 0, true, 0, 0},
    {"dw 4x2 same (an extra row and column) W14", 6, 1, 7, 14, 4, 2, 1, 1, 0, 0, true, 0, 0},
    {"dw 3x3 multiplier 2", 4, 2, 9, 10, 3, 3, 1, 1, 1, 1, false, 0, 0},
    {"dw 7x7 s3 p3 (two kernel quads)", 3, 1, 15, 17, 7, 7, 3, 3, 3, 3, false, 0, 0},
    {"one channel, one group, 3x1 p[1,0]", 1, 3, 8, 13, 3, 1, 1, 1, 1, 0, false, 1, 0},
};

typedef struct {
    const char *qtype;
    bool symmetric;
} Act;

static const Act ACTS[] = {{"int8", true}, {"uint8", false}, {"int8", false}, {"uint8", true}};

static void dw_model(Model *m, const DwGeo *g, uint64_t seed) {
    QtError err = {0};
    LayerSpec l = {.type = LAYER_CONV2D, .name = "dw", .out_channels = g->C * g->M, .kernel = g->kh,
                   .kernel_w = g->kw, .stride = g->sh, .stride_w = g->sw, .padding = g->ph, .padding_w = g->pw,
                   .padding_same = g->same, .groups = g->groups ? g->groups : g->C, .dilation = g->dil ? g->dil : 1,
                   .dilation_w = g->dil ? g->dil : 1};
    QtStatus st = model_init(m, 3, (const int[]){g->C, g->H, g->W}, &l, 1, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", g->name, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    model_init_params(m, &r);
    Param *b = m->modules[0].bias;
    for (int i = 0; b && i < b->var.value.shape[0]; i++) b->var.value.data[i] = 0.1f * (float)(i % 7) - 0.3f;
}

static void dw_layer(QLayer *q, Module *mod, bool per_tensor, const Act *a) {
    QLayerSpec s = qlayer_spec_default();
    s.weight_qtype = qa_find("int8");
    s.per_tensor = per_tensor;
    s.act_qtype = qa_find(a->qtype);
    s.act_symmetric = a->symmetric;
    if (!a->symmetric) s.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
    QtError err = {0};
    QtStatus st = qlayer_init_quantize(q, mod, &s, mod->weight->var.value.data, &err);
    if (st != QT_OK) fprintf(stderr, "\n  qlayer_init_quantize: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

/* The static range of the input over x narrowed to 70 %, so that some inputs clip (as test_qlayer_int8.c). */
static void dw_act_range(QLayer *q, const float *x, size_t n) {
    float lo = 0.0f, hi = 0.0f;
    for (size_t i = 0; i < n; i++) lo = fminf(lo, x[i]), hi = fmaxf(hi, x[i]);
    lo *= 0.7f, hi *= 0.7f;
    const QType *t = q->spec.act_qtype;
    const bool asym = !q->spec.act_symmetric;
    if (!asym) hi = fmaxf(-lo, hi), lo = -hi;
    q->act_scale = qarray_scale_for_range(t, asym, false, (float)t->qmin, (float)t->qmax, lo, hi);
    q->act_zero_point = asym ? qarray_zero_point_for_range(false, (float)t->qmin, (float)t->qmax, lo, q->act_scale)
                             : 0.0f;
    q->act_ready = true;
}

static size_t dw_in_numel(const Module *mod, int N) {
    return (size_t)N * mod->in_shape[0] * mod->in_shape[1] * mod->in_shape[2];
}

/* dw_eval's epi past this: the installed layer's fused hook with epilogue epi - DW_HOOK. */
#define DW_HOOK 10

/* y of q on x (batch N), gradients off, no node recorded: malloc'd, or NULL with the tape error in *err. epi: the
 * layer's forward (-1), qlayer_int8_conv_dw with that epilogue, or the fused hook's (DW_HOOK + epilogue). */
static float *dw_eval(QLayer *q, const float *x, int N, int epi, size_t *ny, QtError *err) {
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.grad_enabled = false, e.tape.training = false;
    const Module *mod = q->module;
    const int xs[4] = {N, mod->in_shape[0], mod->in_shape[1], mod->in_shape[2]};
    Var *vx = test_var(&e, x, 4, xs, false);
    Var *bias = mod->bias ? &mod->bias->var : NULL, *y = NULL;
    if (epi < 0) y = qlayer_forward(&e.tape, q, vx);
    else if (epi < DW_HOOK) y = qlayer_int8_conv_dw(&e.tape, q, vx, bias, (ConvEpilogue)epi, NULL, false);
    else y = mod->fused_hook(&e.tape, (Module *)mod, vx, mod->hook_ctx, bias, (ConvEpilogue)(epi - DW_HOOK));
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

static float *dw_eval_ok(QLayer *q, const float *x, int N, int epi, size_t *ny) {
    QtError err = {0};
    float *y = dw_eval(q, x, N, epi, ny, &err);
    if (!y) fprintf(stderr, "\n  forward: %s\n", err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    return y;
}

/* The int8 kernels on this CPU: VNNI where it is, else the portable ones asked for. */
static void dw_kernels_default(void) { qgemm_force_portable = !qgemm_cpu_has_vnni(); }

/* The layer's forward on the kernels on 1 thread, on 2 (every layer split), and on the portable kernels: all three
 * bit for bit the same; the first returned. */
static float *dw_eval_all_kernels(QLayer *q, const float *x, int N, int epi, size_t *ny, const char *what) {
    dw_kernels_default();
    gemm_set_threads(1);
    float *y1 = dw_eval_ok(q, x, N, epi, ny);
    gemm_set_threads(2);
    qlayer_int8_parallel_min_macs = 0.0;
    float *y2 = dw_eval_ok(q, x, N, epi, ny);
    qgemm_force_portable = true;
    float *y3 = dw_eval_ok(q, x, N, epi, ny);
    dw_kernels_default();
    gemm_set_threads(1);
    qlayer_int8_parallel_min_macs = 4e6;
    bool same = !memcmp(y1, y2, *ny * sizeof *y1) && !memcmp(y1, y3, *ny * sizeof *y1);
    if (!same) fprintf(stderr, "\n  %s: outputs differ across thread counts or kernels\n", what);
    CU_ASSERT(same);
    free(y2), free(y3);
    return y1;
}

static void dw_compare_case(const DwGeo *g, int N, bool per_tensor, const Act *a, uint64_t seed) {
    char what[160];
    snprintf(what, sizeof what, "%s, N %d, %s weight, act %s%s", g->name, N, per_tensor ? "per-tensor" : "per-channel",
             a->qtype, a->symmetric ? "" : " asym");
    Model m;
    dw_model(&m, g, seed);
    Module *mod = &m.modules[0];
    CU_ASSERT_FATAL(!mod->conv_plain);
    const size_t nx = dw_in_numel(mod, N);
    float *x = qa_normal_sample(seed + 1, nx);
    for (size_t i = 0; i < nx; i++) x[i] += 0.3f; /* an off-centre range gives a zero point away from the middle */
    QLayer q;
    dw_layer(&q, mod, per_tensor, a);
    dw_act_range(&q, x, nx);
    CU_ASSERT(qlayer_int8_supported(&q) && qlayer_int8_formats(&q));
    size_t ny = 0, n8 = 0;
    qlayer_int8_disable = true;
    float *yf = dw_eval_ok(&q, x, N, -1, &ny);
    qlayer_int8_disable = false;
    CU_ASSERT_PTR_NULL(q.int8); /* the float path packs nothing */
    float *y8 = dw_eval_all_kernels(&q, x, N, -1, &n8, what);
    CU_ASSERT_PTR_NOT_NULL(q.int8); /* it did take the int8 path */
    CU_ASSERT_EQUAL(ny, n8);
    size_t worst = 0;
    double r = test_close_ratio(y8, yf, ny, ATOL, RTOL, &worst);
    if (r > 1.0)
        fprintf(stderr, "\n  %s: int8 y[%zu] = %.9g, float path %.9g (ratio %.3g)\n", what, worst, (double)y8[worst],
                (double)yf[worst], r);
    CU_ASSERT(r <= 1.0);
    free(x), free(yf), free(y8);
    qlayer_free(&q);
    model_free(&m);
}

static void test_dw_against_float(void) {
    uint64_t seed = 3300;
    for (size_t g = 0; g < sizeof DW_GEOS / sizeof *DW_GEOS; g++)
        for (size_t a = 0; a < sizeof ACTS / sizeof *ACTS; a++)
            dw_compare_case(&DW_GEOS[g], a == 2 ? 1 : 3, a == 3, &ACTS[a], seed++);
    qgemm_force_portable = false;
}

/* qlayer_int8_conv_dw's relu and relu + 2x2 max pool against the layer followed by nn_relu (and
 * nn_maxpool2d(2, 2)), bit for bit, on every kernel and thread count; a NaN bias is relu'd to 0. */
static void test_dw_epilogues(void) {
    uint64_t seed = 3500;
    for (size_t i = 0; i < sizeof DW_GEOS / sizeof *DW_GEOS; i++, seed++) {
        const DwGeo *g = &DW_GEOS[i];
        Model m;
        dw_model(&m, g, seed);
        Module *mod = &m.modules[0];
        if (i % 3 == 1) mod->bias->var.value.data[0] = NAN;
        const int N = 2;
        const size_t nx = dw_in_numel(mod, N);
        float *x = qa_normal_sample(seed + 1, nx);
        QLayer q;
        dw_layer(&q, mod, false, &ACTS[i % 2]);
        dw_act_range(&q, x, nx);
        size_t ny = 0, nr = 0, np = 0;
        float *y = dw_eval_all_kernels(&q, x, N, CONV_EPI_NONE, &ny, g->name);
        float *yr = dw_eval_all_kernels(&q, x, N, CONV_EPI_RELU, &nr, g->name);
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.grad_enabled = false, e.tape.training = false;
        const int OC = mod->out_shape[0], OH = mod->out_shape[1], OW = mod->out_shape[2];
        Var *vy = test_var(&e, y, 4, (const int[]){N, OC, OH, OW}, false), *relu = nn_relu(&e.tape, vy);
        CU_ASSERT_FATAL(relu && ny == nr && ny == (size_t)N * OC * OH * OW);
        bool same = !memcmp(relu->value.data, yr, nr * sizeof *yr);
        if (!same) fprintf(stderr, "\n  %s: the relu epilogue differs from nn_relu\n", g->name);
        CU_ASSERT(same);
        /* the installed layer's fused hook: the same bits */
        qlayer_install(&q);
        float *yh = dw_eval_all_kernels(&q, x, N, DW_HOOK + CONV_EPI_RELU, &nr, g->name);
        CU_ASSERT(!memcmp(yh, yr, nr * sizeof *yr));
        free(yh);
        if (OH >= 2 && OW >= 2) {
            float *yp = dw_eval_all_kernels(&q, x, N, CONV_EPI_RELU_MAXPOOL2, &np, g->name);
            Var *pool = nn_maxpool2d(&e.tape, relu, 2, 2);
            CU_ASSERT_FATAL(pool && var_numel(pool) == np);
            same = !memcmp(pool->value.data, yp, np * sizeof *yp);
            if (!same) fprintf(stderr, "\n  %s: the relu + max pool epilogue differs from nn's ops\n", g->name);
            CU_ASSERT(same);
            yh = dw_eval_all_kernels(&q, x, N, DW_HOOK + CONV_EPI_RELU_MAXPOOL2, &np, g->name);
            CU_ASSERT(!memcmp(yh, yp, np * sizeof *yp));
            free(yp), free(yh);
        }
        test_env_free(&e);
        free(x), free(y), free(yr);
        qlayer_free(&q);
        model_free(&m);
    }
    qgemm_force_portable = false;
}

/* ---- what still falls back ------------------------------------------------------------------------------------- */

/* A dilated depthwise conv, a grouped one of 2 channels per group and a one-group conv of 2 channels with a 1x3
 * kernel: int8 formats but no int8 kernel; the error says which geometry; the forward is the float path's, bit for
 * bit, and packs nothing. A depthwise conv of the same sizes is supported. */
static void test_dw_fallbacks(void) {
    static const DwGeo FALLBACK[] = {
        {"dilated depthwise", 4, 1, 9, 9, 3, 3, 1, 1, 2, 2, false, 0, 2},
        {"2 channels per group", 4, 1, 9, 9, 3, 3, 1, 1, 1, 1, false, 2, 0},
        {"one group of 2 channels, 1x3", 2, 2, 9, 9, 1, 3, 1, 1, 0, 1, false, 1, 0},
    };
    dw_kernels_default();
    for (size_t i = 0; i < sizeof FALLBACK / sizeof *FALLBACK; i++) {
        const DwGeo *g = &FALLBACK[i];
        Model m;
        dw_model(&m, g, 3700 + i);
        const size_t nx = dw_in_numel(&m.modules[0], 2);
        float *x = qa_normal_sample(3710 + i, nx);
        QLayer q;
        dw_layer(&q, &m.modules[0], false, &ACTS[1]);
        dw_act_range(&q, x, nx);
        CU_ASSERT(!qlayer_int8_supported(&q));
        CU_ASSERT(qlayer_int8_formats(&q));
        QtError err = {0};
        CU_ASSERT_EQUAL(qlayer_int8_prepare(&q, &err), QT_ERR_CONFIG);
        CU_ASSERT(test_msg_has(&err, "dw") && test_msg_has(&err, "dilated") &&
                  test_msg_has(&err, "more than one input channel per group") && test_msg_has(&err, "depthwise"));
        size_t n1 = 0, n2 = 0;
        float *y = dw_eval_ok(&q, x, 2, -1, &n1);
        qlayer_int8_disable = true;
        float *yf = dw_eval_ok(&q, x, 2, -1, &n2);
        qlayer_int8_disable = false;
        CU_ASSERT(n1 == n2 && !memcmp(y, yf, n1 * sizeof *y) && q.int8 == NULL);
        /* and its fused hook declines (no error): the layer and separate ops run instead */
        qlayer_install(&q);
        QtError eh = {0};
        float *yh = dw_eval(&q, x, 2, DW_HOOK + CONV_EPI_RELU, &n1, &eh);
        CU_ASSERT(yh == NULL && eh.status == QT_OK);
        free(yh);
        free(x), free(y), free(yf);
        qlayer_free(&q);
        model_free(&m);
    }
    qgemm_force_portable = false;
}

/* With the AVX2 or AVX-VNNI family chosen, a depthwise layer with a stride of 1 or 2 across takes the integer
 * path (their depthwise kernel), one with stride 3 keeps the float path (the portable kernel would run); a forced
 * portable or the AVX-512 family runs both on the integer kernels. */
static void test_dw_vector_families(void) {
    static const DwGeo S3 = {"dw 3x3 s3", 4, 1, 10, 13, 3, 3, 3, 3, 1, 1, false, 0, 0};
    const DwGeo *geos[2] = {&DW_GEOS[1], &S3};
    for (int gi = 0; gi < 2; gi++) {
        Model m;
        dw_model(&m, geos[gi], 3750 + (uint64_t)gi);
        const size_t nx = dw_in_numel(&m.modules[0], 2);
        float *x = qa_normal_sample(3752 + (uint64_t)gi, nx);
        QLayer q;
        dw_layer(&q, &m.modules[0], false, &ACTS[1]);
        dw_act_range(&q, x, nx);
        CU_ASSERT_FATAL(qlayer_int8_supported(&q));
        Tape t = {0}; /* no gradient: only the kernel choice decides */
        static const QGemmIsa FAMILIES[] = {QGEMM_ISA_AVX2, QGEMM_ISA_AVXVNNI, QGEMM_ISA_AVX512_VNNI};
        static const char *const NAMES[] = {"AVX2", "AVX-VNNI", "AVX-512 VNNI"};
        for (int i = 0; i < 3; i++) {
            if (!qgemm_cpu_has_isa(FAMILIES[i])) {
                if (gi == 0) test_skip("a depthwise layer on the %s kernels: this CPU has no %s", NAMES[i], NAMES[i]);
                continue;
            }
            qgemm_force_isa = FAMILIES[i];
            CU_ASSERT_EQUAL(qlayer_int8_applies(&t, &q, NULL, NULL), gi == 0 || FAMILIES[i] == QGEMM_ISA_AVX512_VNNI);
            qgemm_force_portable = true;
            CU_ASSERT(qlayer_int8_applies(&t, &q, NULL, NULL));
            qgemm_force_portable = false;
        }
        qgemm_force_isa = -1;
        free(x);
        qlayer_free(&q);
        model_free(&m);
    }
}

/* ---- errors ---------------------------------------------------------------------------------------------------- */

static void test_dw_errors(void) {
    const DwGeo *g = &DW_GEOS[1];
    Model m;
    dw_kernels_default();
    dw_model(&m, g, 3800);
    Module *mod = &m.modules[0];
    const int N = 2;
    const size_t nx = dw_in_numel(mod, N);
    float *x = qa_normal_sample(3801, nx);
    QLayer q;
    dw_layer(&q, mod, false, &ACTS[0]);
    dw_act_range(&q, x, nx);
    /* a NaN: the float path's own message */
    x[nx / 2 + 3] = NAN;
    QtError e8 = {0}, ef = {0};
    size_t ny = 0;
    float *y = dw_eval(&q, x, N, -1, &ny, &e8);
    qlayer_int8_disable = true;
    free(dw_eval(&q, x, N, -1, &ny, &ef));
    qlayer_int8_disable = false;
    CU_ASSERT(!y && e8.status == QT_ERR_VALUE && ef.status == QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&e8, "flat index") && strcmp(e8.msg, ef.msg) == 0);
    free(y);
    x[nx / 2 + 3] = 0.5f;
    /* an input of other channels, or too small for the kernel (or for the max pool after it) */
    mod->in_shape[0] = g->C - 1;
    y = dw_eval(&q, x, N, -1, &ny, &e8);
    CU_ASSERT(!y && e8.status == QT_ERR_SHAPE && test_msg_has(&e8, "does not fit") && test_msg_has(&e8, "dw"));
    free(y);
    mod->in_shape[0] = g->C, mod->in_shape[1] = 1, mod->in_shape[2] = 1;
    y = dw_eval(&q, x, N, CONV_EPI_RELU_MAXPOOL2, &ny, &e8);
    CU_ASSERT(!y && e8.status == QT_ERR_SHAPE && test_msg_has(&e8, "max pool"));
    free(y);
    mod->in_shape[1] = g->H, mod->in_shape[2] = g->W;
    free(dw_eval_ok(&q, x, N, -1, &ny)); /* and it still works */
    free(x);
    qlayer_free(&q);
    model_free(&m);
    /* a plain conv (one channel, square: the taps kernels) is not the depthwise entry's */
    const DwGeo plain = {"plain", 1, 2, 6, 6, 3, 3, 1, 1, 1, 1, false, 0, 0};
    dw_model(&m, &plain, 3802);
    CU_ASSERT_FATAL(m.modules[0].conv_plain);
    x = qa_normal_sample(3803, 36);
    dw_layer(&q, &m.modules[0], false, &ACTS[0]);
    dw_act_range(&q, x, 36);
    y = dw_eval(&q, x, 1, CONV_EPI_NONE, &ny, &e8);
    CU_ASSERT(!y && e8.status == QT_ERR_ARG && test_msg_has(&e8, "one input channel per group"));
    free(y), free(x);
    qlayer_free(&q);
    model_free(&m);
    qgemm_force_portable = false;
}

/* ---- a model in the steady state ------------------------------------------------------------------------------- */

/* conv (strided) -> relu -> depthwise -> relu -> globalavgpool -> dense, all int8 in eval: every step after the
 * first takes no more arena, records nothing and gives the same bits; the float path is close. */
static void test_dw_model_steady_state(void) {
    enum { N = 3, C = 2, H = 12, W = 13, CLASSES = 5 };
    static const LayerSpec LS[] = {
        {.type = LAYER_CONV2D, .name = "c1", .out_channels = 6, .kernel = 3, .stride = 2, .padding = 1},
        {.type = LAYER_RELU},
        {.type = LAYER_CONV2D, .name = "dw", .out_channels = 6, .kernel = 3, .padding = 1, .groups = 6},
        {.type = LAYER_RELU},
        {.type = LAYER_GLOBALAVGPOOL},
        {.type = LAYER_DENSE, .name = "fc", .units = CLASSES},
    };
    const int quantized[3] = {0, 2, 5};
    Model m;
    QtError err = {0};
    dw_kernels_default();
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (const int[]){C, H, W}, LS, 6, &err), QT_OK);
    Rng r;
    rng_init(&r, 3900, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    float *x = qa_normal_sample(3901, N * C * H * W);
    QLayer q[3];
    for (int i = 0; i < 3; i++) {
        dw_layer(&q[i], &m.modules[quantized[i]], false, &ACTS[i ? 1 : 0]);
        param_release(m.modules[quantized[i]].weight);
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
    for (int i = 0; i < 3; i++) CU_ASSERT_EQUAL_FATAL(qlayer_calib_end(&q[i], &err), QT_OK);
    CU_ASSERT(qlayer_int8_supported(&q[1]));
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
    CU_ASSERT(q[0].int8 && q[1].int8 && q[2].int8);
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
    for (int i = 0; i < 3; i++) qlayer_free(&q[i]);
    model_free(&m);
    qgemm_force_portable = false;
}

/* ---- a PTQ run of the tiny depthwise model --------------------------------------------------------------------- */

static char *tmp_root;

static int dw_suite_init(void) {
    tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int dw_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

/* A number after `key` ("\"test_loss\": ") in text; NAN if missing. */
static double json_number(const char *text, const char *key) {
    const char *at = text ? strstr(text, key) : NULL;
    return at ? strtod(at + strlen(key), NULL) : NAN;
}

/* Whether files a and b hold the same bytes. */
static bool same_file_bytes(const char *a, const char *b) {
    size_t na = 0, nb = 0;
    char *x = test_file_read(a, &na), *y = test_file_read(b, &nb);
    bool same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x), free(y);
    return same;
}

/* tests/configs/tiny-dw.yaml trained, then PTQ with DS-CNN's rules (int8 weights; int8 inputs for conv1, uint8
 * with zero points for the rest): `qtrain eval` of its checkpoint on the float, portable and vector kernels (VNNI,
 * AVX-VNNI, AVX2) gives the same accuracy, losses within 1e-4 of the float path's and the vector kernels' equal to
 * portable's to the last digit, and all
 * four int8 layers, the depthwise one too, on the kernels. With the depthwise conv dilated, the rules table names
 * it as the layer on its dequantized weight. */
static void test_dw_ptq_eval_kernels(void) {
    char out[1100], init[1200], log[1100], ckpt[1100], json[1100];
    snprintf(out, sizeof out, "run.out_dir=%s/base", tmp_root);
    snprintf(log, sizeof log, "%s/run.log", tmp_root);
    const char *train[] = {"--config", "tests/configs/tiny-dw.yaml", "--set", out, "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, train, 300.0), 0);
    snprintf(init, sizeof init, "model.init_from=%s/base/final.h5", tmp_root);
    snprintf(out, sizeof out, "run.out_dir=%s/ptq", tmp_root);
    const char *ptq[] = {"--config", "tests/configs/tiny-dw.yaml", "--set", out, "--set", init, "--set",
                         "quant.mode=ptq", "--set", "quant.rules=[{module_path: conv1, weight_qtype: int8, act_qtype: "
                         "int8}, {module_path: \".*\", op_types: [conv2d, dense], weight_qtype: int8, act_qtype: "
                         "uint8, act_symmetric: false}]", "--set", "train.epochs=0", "--set", "train.steps=0",
                         "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, ptq, 300.0), 0);
    snprintf(ckpt, sizeof ckpt, "%s/ptq/final.h5", tmp_root);
    snprintf(json, sizeof json, "%s/ptq/eval.json", tmp_root);
    static const char *const KERNELS[] = {"float", "portable", "vnni", "avxvnni", "avx2"};
    static const QGemmIsa FAMILY[] = {QGEMM_ISA_PORTABLE, QGEMM_ISA_PORTABLE, QGEMM_ISA_AVX512_VNNI,
                                      QGEMM_ISA_AVXVNNI, QGEMM_ISA_AVX2};
    double acc[5] = {NAN, NAN, NAN, NAN, NAN}, loss[5] = {NAN, NAN, NAN, NAN, NAN};
    for (int k = 0; k < 5; k++) {
        if (!qgemm_cpu_has_isa(FAMILY[k])) {
            test_skip("qtrain eval on the %s kernels: this CPU (or OS) lacks them", KERNELS[k]);
            continue;
        }
        setenv("QTRAIN_INT8_KERNEL", KERNELS[k], 1);
        char dump[1200];
        snprintf(dump, sizeof dump, "%s/dw-logits-%s.npy", tmp_root, KERNELS[k]);
        const char *eval[] = {"eval", "--checkpoint", ckpt, "--dump-logits", dump, "--quiet", NULL};
        int rc = test_proc_run(log, eval, 300.0);
        unsetenv("QTRAIN_INT8_KERNEL");
        CU_ASSERT_EQUAL_FATAL(rc, 0);
        char *js = test_file_read(json, NULL), want[64];
        snprintf(want, sizeof want, "\"int8_kernel\": \"%s\"", k == 0 ? "float-emulated" : KERNELS[k]);
        const bool counted = js && strstr(js, want) && strstr(js, "\"int8_layers\": 4,") &&
                             strstr(js, "\"int8_kernel_layers\": 4,");
        if (!counted) fprintf(stderr, "\n  %s: %s\n", KERNELS[k], js ? js : "(no eval.json)");
        CU_ASSERT(counted);
        acc[k] = json_number(js, "\"test_accuracy\": "), loss[k] = json_number(js, "\"test_loss\": ");
        free(js);
    }
    printf("(accuracy %.4f, loss float %.6f portable %.6f vnni %.6f) ", acc[0], loss[0], loss[1], loss[2]);
    CU_ASSERT(acc[0] > 0.2 && acc[1] == acc[0] && fabs(loss[1] - loss[0]) <= 1e-4 * loss[0]);
    /* every vector family: portable's bits (the depthwise kernel included), logit for logit; the float path's
       logits differ, so the comparison shows the kernels ran */
    char dumps[5][1200];
    for (int k = 0; k < 5; k++) snprintf(dumps[k], sizeof dumps[k], "%s/dw-logits-%s.npy", tmp_root, KERNELS[k]);
    CU_ASSERT_FALSE(same_file_bytes(dumps[0], dumps[1]));
    for (int k = 2; k < 5; k++)
        if (qgemm_cpu_has_isa(FAMILY[k])) {
            CU_ASSERT(acc[k] == acc[0] && loss[k] == loss[1]);
            CU_ASSERT(same_file_bytes(dumps[k], dumps[1]));
        }
    /* the same with the depthwise conv dilated: it falls back, and the rules table names it */
    char tlog[1100];
    snprintf(out, sizeof out, "run.out_dir=%s/ptq-dilated", tmp_root);
    snprintf(tlog, sizeof tlog, "%s/dilated.log", tmp_root);
    const char *dil[] = {"--config", "tests/configs/tiny-dw.yaml", "--set", out, "--set", init, "--set",
                         "model.layers.3.dilation=2", "--set", "quant.mode=ptq", "--set", ptq[9], "--set",
                         "train.epochs=0", "--set", "train.steps=0", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(tlog, dil, 300.0), 0);
    char *table = test_file_read(tlog, NULL);
    const char *want = " on 3 of 4 int8 layers; dequantized float (dilated, grouped or per-axis conv2d): dw\n";
    CU_ASSERT(table && strstr(table, want));
    if (!table || !strstr(table, want)) fprintf(stderr, "\n%s\n", table ? table : "(no output)");
    free(table);
    /* with a stride of 3 across, the 256-bit kernels keep the depthwise conv on the float path: the rules table and
       eval.json's int8_kernel_layers count 3 of 4 there, 4 of 4 on the other kernels */
    static const char *const WIDE[] = {"avx2", "avxvnni"};
    static const QGemmIsa WIDE_ISA[] = {QGEMM_ISA_AVX2, QGEMM_ISA_AVXVNNI};
    snprintf(out, sizeof out, "run.out_dir=%s/ptq-stride3", tmp_root);
    const char *st3[] = {"--config", "tests/configs/tiny-dw.yaml", "--set", out, "--set", init, "--set",
                         "model.layers.3.stride=3", "--set", "model.layers.3.padding=1", "--set", "quant.mode=ptq",
                         "--set", ptq[9], "--set",
                         "train.epochs=0", "--set", "train.steps=0", NULL};
    for (int k = 0; k < 2; k++) {
        if (!qgemm_cpu_has_isa(WIDE_ISA[k])) {
            test_skip("a stride-3 depthwise conv on the %s kernels: this CPU (or OS) lacks them", WIDE[k]);
            continue;
        }
        snprintf(tlog, sizeof tlog, "%s/stride3-%s.log", tmp_root, WIDE[k]);
        setenv("QTRAIN_INT8_KERNEL", WIDE[k], 1);
        int rc = test_proc_run(tlog, st3, 300.0);
        char sckpt[1100];
        snprintf(sckpt, sizeof sckpt, "%s/ptq-stride3/final.h5", tmp_root);
        const char *ev[] = {"eval", "--checkpoint", sckpt, "--quiet", NULL};
        int rc2 = rc == 0 ? test_proc_run(tlog, ev, 300.0) : -1;
        unsetenv("QTRAIN_INT8_KERNEL");
        CU_ASSERT_EQUAL(rc, 0);
        CU_ASSERT_EQUAL(rc2, 0);
        char *t3 = test_file_read(tlog, NULL), w3[160], sjson[1100];
        snprintf(w3, sizeof w3, "int8_kernel: %s on 3 of 4 int8 layers; float-emulated (a depthwise stride over 2 "
                 "across on the %s kernels): dw\n", WIDE[k], WIDE[k]);
        CU_ASSERT(t3 && strstr(t3, w3));
        if (!t3 || !strstr(t3, w3)) fprintf(stderr, "\n%s\n", t3 ? t3 : "(no output)");
        free(t3);
        snprintf(sjson, sizeof sjson, "%s/ptq-stride3/eval.json", tmp_root);
        char *js = test_file_read(sjson, NULL);
        CU_ASSERT(js && strstr(js, "\"int8_layers\": 4,") && strstr(js, "\"int8_kernel_layers\": 3,"));
        free(js);
        char path[1100];
        snprintf(path, sizeof path, "%s/ptq-stride3", tmp_root);
        test_tmpdir_remove(strdup(path)); /* the next kernel's run starts afresh */
    }
}

/* tests/configs/tiny-cnn.yaml (conv1, relu and 2x2 max pool: the taps kernels' pooling epilogue, then a dense
 * head) trained, then PTQ with int8 weights, int8 inputs for conv1 and uint8 with zero points for the head:
 * `qtrain eval` of its checkpoint on every vector family the CPU has (QTRAIN_INT8_KERNEL vnni, avxvnni, avx2)
 * gives portable's accuracy and loss to the last digit, both layers on the kernels; a family the CPU lacks is a
 * skip, and forcing it an error naming the missing feature. */
static void test_cnn_ptq_eval_vector_kernels(void) {
    char out[1100], init[1200], log[1100], ckpt[1100], json[1100];
    snprintf(out, sizeof out, "run.out_dir=%s/cnn", tmp_root);
    snprintf(log, sizeof log, "%s/cnn.log", tmp_root);
    const char *train[] = {"--config", "tests/configs/tiny-cnn.yaml", "--set", out, "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, train, 300.0), 0);
    snprintf(init, sizeof init, "model.init_from=%s/cnn/final.h5", tmp_root);
    snprintf(out, sizeof out, "run.out_dir=%s/cnn-ptq", tmp_root);
    const char *ptq[] = {"--config", "tests/configs/tiny-cnn.yaml", "--set", out, "--set", init, "--set",
                         "quant.mode=ptq", "--set", "quant.rules=[{module_path: conv1, weight_qtype: int8, act_qtype: "
                         "int8}, {module_path: head, weight_qtype: int8, act_qtype: uint8, act_symmetric: false}]",
                         "--set", "train.epochs=0", "--set", "train.steps=0", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, ptq, 300.0), 0);
    snprintf(ckpt, sizeof ckpt, "%s/cnn-ptq/final.h5", tmp_root);
    snprintf(json, sizeof json, "%s/cnn-ptq/eval.json", tmp_root);
    static const struct {
        const char *env, *reported, *needs;
        QGemmIsa isa;
    } K[] = {{"portable", "portable", NULL, QGEMM_ISA_PORTABLE},
             {"float", "float-emulated", NULL, QGEMM_ISA_PORTABLE},
             {"vnni", "vnni", "AVX-512 VNNI", QGEMM_ISA_AVX512_VNNI},
             {"avxvnni", "avxvnni", "AVX-VNNI", QGEMM_ISA_AVXVNNI},
             {"avx2", "avx2", "AVX2 and FMA", QGEMM_ISA_AVX2}};
    double acc[5], loss[5];
    for (int k = 0; k < 5; k++) {
        acc[k] = loss[k] = NAN;
        char dump[1200];
        snprintf(dump, sizeof dump, "%s/cnn-logits-%s.npy", tmp_root, K[k].env);
        const char *eval[] = {"eval", "--checkpoint", ckpt, "--dump-logits", dump, "--quiet", NULL};
        setenv("QTRAIN_INT8_KERNEL", K[k].env, 1);
        if (K[k].needs && !qgemm_cpu_has_isa(K[k].isa)) {
            test_skip("qtrain eval on the %s kernels: this CPU (or OS) has no %s", K[k].env, K[k].needs);
            int rc = test_proc_run(log, eval, 300.0); /* refused, naming what is missing */
            unsetenv("QTRAIN_INT8_KERNEL");
            char *text = test_file_read(log, NULL);
            CU_ASSERT(rc == 2 && text && strstr(text, K[k].needs));
            free(text);
            continue;
        }
        int rc = test_proc_run(log, eval, 300.0);
        unsetenv("QTRAIN_INT8_KERNEL");
        CU_ASSERT_EQUAL_FATAL(rc, 0);
        char *js = test_file_read(json, NULL), want[64];
        snprintf(want, sizeof want, "\"int8_kernel\": \"%s\"", K[k].reported);
        const bool counted = js && strstr(js, want) && strstr(js, "\"int8_layers\": 2,") &&
                             strstr(js, "\"int8_kernel_layers\": 2,");
        if (!counted) fprintf(stderr, "\n  %s: %s\n", K[k].env, js ? js : "(no eval.json)");
        CU_ASSERT(counted);
        acc[k] = json_number(js, "\"test_accuracy\": "), loss[k] = json_number(js, "\"test_loss\": ");
        free(js);
        if (k < 2) continue;
        if (acc[k] != acc[0] || loss[k] != loss[0])
            fprintf(stderr, "\n  %s: accuracy %.6f loss %.9g, portable %.6f %.9g\n", K[k].env, acc[k], loss[k], acc[0],
                    loss[0]);
        CU_ASSERT(acc[k] == acc[0] && loss[k] == loss[0]);
        char port[1200];
        snprintf(port, sizeof port, "%s/cnn-logits-portable.npy", tmp_root);
        CU_ASSERT(same_file_bytes(dump, port)); /* logit for logit */
    }
    char fl[1200], port[1200];
    snprintf(fl, sizeof fl, "%s/cnn-logits-float.npy", tmp_root);
    snprintf(port, sizeof port, "%s/cnn-logits-portable.npy", tmp_root);
    CU_ASSERT_FALSE(same_file_bytes(fl, port)); /* so the comparisons above show the kernels ran */
    printf("(accuracy %.4f, loss portable %.6f float %.6f) ", acc[0], loss[0], loss[1]);
    CU_ASSERT(acc[0] > 0.2 && fabs(loss[1] - loss[0]) <= 1e-4 * loss[0]);
}

int register_quant_int8_dw_suite(void) {
    CU_pSuite s = CU_add_suite("quant_int8_dw", dw_suite_init, dw_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "depthwise portable kernel equals the definition", test_dw_kernel_portable) ||
           !CU_add_test(s, "depthwise VNNI kernel equals the definition", test_dw_kernel_vnni) ||
           !CU_add_test(s, "depthwise AVX-VNNI and AVX2 kernels equal the definition", test_dw_kernel_256) ||
           !CU_add_test(s, "depthwise packing and its errors", test_dw_pack_errors) ||
           !CU_add_test(s, "int8 depthwise layer equals the float path", test_dw_against_float) ||
           !CU_add_test(s, "int8 depthwise relu and relu + max pool epilogues", test_dw_epilogues) ||
           !CU_add_test(s, "dilated and grouped convs keep the float fallback", test_dw_fallbacks) ||
           !CU_add_test(s, "depthwise layers on the 256-bit families: strides 1 and 2 integer",
                        test_dw_vector_families) ||
           !CU_add_test(s, "int8 depthwise forward errors", test_dw_errors) ||
           !CU_add_test(s, "int8 depthwise model steady state", test_dw_model_steady_state) ||
           !CU_add_test(s, "PTQ of the depthwise model: qtrain eval on every kernel", test_dw_ptq_eval_kernels) ||
           !CU_add_test(s, "PTQ of the CNN: qtrain eval on every vector family equals portable",
                        test_cnn_ptq_eval_vector_kernels);
}
