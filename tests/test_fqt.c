/* test_fqt.c - quantized training: the integer GEMM (test_qgemm.c), the
 * spec's checks, the forward and the float backward against a QAT
 * layer of the same formats, the quantized backward against the hand-written
 * reference of test_fqt_ref.c (round to nearest and stochastic, rows/columns
 * noise, tiles of the weight gradient), the fused relu/pool hook against the
 * separate ops, the unbiasedness of stochastic rounding, the noise's
 * determinism and the arena's steady state. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "quant/qat.h"
#include "quant/fqt.h"
#include "quant/fqt_kern.h"
#include "test_qarray.h"
#include "test_qat.h"
#include "test_fqt.h"
#include "test_util.h"

/* ---- specs, layers, runs ----------------------------------------------------------------------------------------- */

static FqtSpec spec_of(const char *wt, const char *at, const char *bwd) {
    FqtSpec s = fqt_spec_default();
    s.weight_qtype = wt ? qa_find(wt) : NULL;
    s.act_qtype = at ? qa_find(at) : NULL;
    s.bwd_qtype = bwd ? qa_find(bwd) : NULL;
    return s;
}

static void init_ok(FqtLayer *q, Module *mod, const FqtSpec *spec, uint64_t stream) {
    QtError err = {0};
    QtStatus st = fqt_layer_init(q, mod, spec, 42, stream, &err);
    if (st != QT_OK) fprintf(stderr, "\n  fqt_layer_init: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

/* The QAT layer a QT layer without bwd_qtype equals: weight per channel, dynamic input per tensor. */
static void qat_twin(QatLayer *qa, Module *mod, const char *wt, const char *at) {
    QLayerSpec s = qtest_wspec(wt, 0, QARRAY_SCALE_F32);
    s.act_qtype = qa_find(at);
    QatSpec qs = qtest_qspec(QAT_LEARN_NONE, false);
    qtest_init_ok(qa, mod, &s, &qs);
}

static void zero_module_grads(Module *m) {
    qtest_zero(m->weight->var.grad, var_numel(&m->weight->var));
    if (m->bias) qtest_zero(m->bias->var.grad, var_numel(&m->bias->var));
}

/* The QT layer on x (batch N) and its backward from dy (NULL: the dy qtest_run_qat uses), copied out. With epi,
 * the relu (and 2x2 max pool) after it: through the fused hook (fused), or as the layer and the separate ops.
 * x_grad: x wants its gradient (else dx comes out as zeros). */
static void run_layer(FqtLayer *q, const float *x, int N, const float *dy, ConvEpilogue epi, bool fused, bool x_grad,
                      QtestRun *r) {
    Module *mod = q->module;
    TestEnv e;
    test_env_init(&e, 5);
    int xs[4], xnd = qtest_input_shape(mod, N, xs);
    Var *vx = test_var(&e, x, xnd, xs, x_grad);
    zero_module_grads(mod);
    Var *y;
    if (fused) {
        y = mod->fused_hook(&e.tape, mod, vx, q, mod->bias ? &mod->bias->var : NULL, epi);
    } else {
        y = fqt_layer_forward(&e.tape, q, vx);
        if (y && epi != CONV_EPI_NONE) y = nn_relu(&e.tape, y);
        if (y && epi == CONV_EPI_RELU_MAXPOOL2) y = nn_maxpool2d(&e.tape, y, 2, 2);
    }
    if (!y) fprintf(stderr, "\n  forward: %s\n", e.tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    memset(r, 0, sizeof *r);
    r->ny = var_numel(y), r->nx = qtest_input_numel(mod, N), r->nw = var_numel(&mod->weight->var);
    r->nb = mod->bias ? var_numel(&mod->bias->var) : 0;
    float *own = dy ? NULL : qa_normal_sample(77, r->ny);
    QtStatus st = tape_backward_from(&e.tape, y, dy ? dy : own);
    if (st != QT_OK) fprintf(stderr, "\n  backward: %s\n", e.tape.err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    free(own);
    r->y = qtest_copy_floats(y->value.data, r->ny);
    r->dx = qtest_copy_floats(vx->grad, r->nx);
    r->dw = qtest_copy_floats(mod->weight->var.grad, r->nw);
    r->db = qtest_copy_floats(mod->bias ? mod->bias->var.grad : NULL, r->nb);
    test_env_free(&e);
}

void fqtest_run_qt(FqtLayer *q, const float *x, int N, const float *dy, QtestRun *r) {
    run_layer(q, x, N, dy, CONV_EPI_NONE, false, true, r);
}

/* The fused hook against the layer and the separate ops (test_fused_epilogue): dy drawn as run_qt's. */
static void run_fused(FqtLayer *q, const float *x, int N, ConvEpilogue epi, bool fused, bool x_grad, QtestRun *r) {
    run_layer(q, x, N, NULL, epi, fused, x_grad, r);
}

void fqtest_run_fused(FqtLayer *q, const float *x, int N, ConvEpilogue epi, QtestRun *r) {
    run_layer(q, x, N, NULL, epi, epi != CONV_EPI_NONE, true, r);
}

void fqtest_init_int8(FqtLayer *q, Module *mod, uint64_t stream) {
    FqtSpec s = spec_of("int8", "int8", "int8");
    s.bwd_stochastic = true;
    init_ok(q, mod, &s, stream);
    fqt_layer_install(q);
}

static bool same_floats(const float *a, const float *b, size_t n) { return n == 0 || memcmp(a, b, n * sizeof *a) == 0; }

/* The fused hook's backward remakes g's planes from the epilogue's gradient (or keeps g whole, with dW tiles), and
 * skips the rows' maxima without dx: the same bits as the separate ops in each case. */
static void test_fused_epilogue(void) {
    static const struct {
        int H, W, k, stride, pad;
        const char *act;
        bool x_grad;
        int tile;
    } CASES[] = {{7, 6, 3, 1, 1, "int8", true, 0},     {9, 9, 4, 3, 1, "int8", true, 0},
                 {8, 7, 3, 2, 1, "fp8_e4m3", true, 0}, {7, 6, 3, 1, 1, "int8", false, 0},
                 {8, 8, 3, 1, 1, "int8", true, 7},     {8, 8, 3, 1, 1, "int8", false, 7}};
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++)
        for (int e = CONV_EPI_RELU; e <= CONV_EPI_RELU_MAXPOOL2; e++) {
            Model m;
            qtest_conv_model(&m, 3, CASES[i].H, CASES[i].W, 5, CASES[i].k, CASES[i].stride, CASES[i].pad, 300 + i);
            FqtLayer q;
            FqtSpec s = spec_of("int8", CASES[i].act, "int8");
            s.bwd_stochastic = true;
            s.bwd_weight_grad_tile_size = CASES[i].tile;
            init_ok(&q, &m.modules[0], &s, 12);
            fqt_layer_install(&q);
            CU_ASSERT_PTR_NOT_NULL_FATAL(m.modules[0].fused_hook);
            const int N = 3;
            float *x = qa_normal_sample(310 + i, qtest_input_numel(&m.modules[0], N));
            QtestRun a, b;
            const Rng start = q.rng;
            run_fused(&q, x, N, (ConvEpilogue)e, true, CASES[i].x_grad, &a);
            q.rng = start; /* the same noise for both */
            run_fused(&q, x, N, (ConvEpilogue)e, false, CASES[i].x_grad, &b);
            CU_ASSERT(a.ny == b.ny && same_floats(a.y, b.y, a.ny));
            CU_ASSERT(same_floats(a.dx, b.dx, a.nx) && same_floats(a.dw, b.dw, a.nw) && same_floats(a.db, b.db, a.nb));
            qtest_run_free(&a), qtest_run_free(&b);
            free(x);
            model_free(&m);
        }
}

/* A non-finite gradient through the fused hook is an error naming the module, whether g's planes were remade per
 * pass or kept whole (dW tiles), with and without dx. */
static void test_fused_nonfinite(void) {
    for (int k = 0; k < 4; k++) {
        Model m;
        qtest_conv_model(&m, 3, 8, 8, 5, 3, 1, 1, 320);
        FqtLayer q;
        FqtSpec s = spec_of("int8", "int8", "int8");
        s.bwd_weight_grad_tile_size = k & 1 ? 7 : 0;
        init_ok(&q, &m.modules[0], &s, 13);
        fqt_layer_install(&q);
        Module *mod = &m.modules[0];
        const int N = 2;
        float *x = qa_normal_sample(321, qtest_input_numel(mod, N));
        TestEnv e;
        test_env_init(&e, 5);
        int xs[4], xnd = qtest_input_shape(mod, N, xs);
        Var *vx = test_var(&e, x, xnd, xs, k >= 2);
        Var *y = mod->fused_hook(&e.tape, mod, vx, &q, mod->bias ? &mod->bias->var : NULL, CONV_EPI_RELU_MAXPOOL2);
        CU_ASSERT_PTR_NOT_NULL_FATAL(y);
        float *dy = qa_normal_sample(322, var_numel(y));
        for (size_t i = 0; i < var_numel(y); i++) dy[i] = y->value.data[i] > 0.0f ? NAN : dy[i];
        CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, dy), QT_ERR_VALUE);
        CU_ASSERT(test_msg_has(&e.tape.err, "conv1") && test_msg_has(&e.tape.err, "NaN"));
        test_env_free(&e);
        free(dy), free(x);
        model_free(&m);
    }
}

/* ---- setup and checks -------------------------------------------------------------------------------------------- */

static void test_init_and_install(void) {
    FqtSpec d = fqt_spec_default();
    CU_ASSERT(!d.weight_qtype && !d.act_qtype && !d.bwd_qtype);
    CU_ASSERT(d.bwd_calib.kind == CALIB_ABSMAX && d.bwd_calib.s == 1.0);
    CU_ASSERT(d.bwd_weight_grad_tile_size == 0 && !d.bwd_stochastic && d.noise_axes == FQT_NOISE_ROWS);
    Model m;
    qtest_conv_model(&m, 2, 6, 5, 4, 3, 1, 1, 3);
    Module *mod = &m.modules[0];
    FqtSpec s = spec_of("int8", NULL, "int8");
    FqtLayer q;
    init_ok(&q, mod, &s, 9);
    CU_ASSERT(q.module == mod && q.out == 4 && q.fan_in == 18 && q.spec.weight_qtype == qa_find("int8"));
    CU_ASSERT(q.rng.seed == 42 && q.rng.stream == 9 && q.rng.counter == 0);
    fqt_layer_install(&q);
    CU_ASSERT(mod->forward_hook != NULL && mod->hook_ctx == &q);
    /* the model's forward goes through the layer */
    float *x = qa_normal_sample(4, 2 * 2 * 6 * 5);
    TestEnv e;
    test_env_init(&e, 1);
    Var *vx = tape_wrap(&e.tape, x, 4, (const int[]){2, 2, 6, 5});
    Var *y1 = model_forward(&m, &e.tape, vx), *y2 = fqt_layer_forward(&e.tape, &q, vx);
    CU_ASSERT_FATAL(y1 && y2);
    CU_ASSERT(var_numel(y1) == 2 * 4 * 6 * 5 && memcmp(y1->value.data, y2->value.data, var_numel(y1) * 4) == 0);
    test_env_free(&e);
    free(x);
    model_free(&m);
}

typedef struct {
    const char *name, *wt, *at, *bwd;
    int tile;
    bool stochastic;
    unsigned axes;
    bool bad_calib;
    const char *has[3]; /* besides the module path */
} FqtErrCase;

static const FqtErrCase FQT_ERRS[] = {
    {"no weight format", NULL, NULL, NULL, 0, false, 1, false, {"weight_qtype", "not set"}},
    {"nf4 weight", "nf4", NULL, NULL, 0, false, 1, false, {"weight_qtype: nf4 is a lookup format"}},
    {"mx weight", "mxfp4", NULL, NULL, 0, false, 1, false, {"weight_qtype: mxfp4", "block format"}},
    {"binary weight", "binary", NULL, NULL, 0, false, 1, false, {"weight_qtype: binary", "mean |x|"}},
    {"ternary input", "int8", "ternary", NULL, 0, false, 1, false, {"act_qtype: ternary"}},
    {"mx9 input", "int8", "mx9", NULL, 0, false, 1, false, {"act_qtype: mx9"}},
    {"nf4 gradient", "int8", NULL, "nf4", 0, false, 1, false, {"bwd_qtype: nf4 is a lookup format"}},
    {"mx gradient", "int8", NULL, "mxfp8_e4m3", 0, false, 1, false, {"bwd_qtype: mxfp8_e4m3"}},
    {"uint gradient", "int8", NULL, "uint8", 0, false, 1, false, {"bwd_qtype: uint8", "both signs"}},
    {"negative tile", "int8", NULL, "int8", -2, false, 1, false, {"bwd_weight_grad_tile_size", "-2"}},
    {"noise axes", "int8", NULL, "int8", 0, true, 4, false, {"channelwise_noise_axes", "4"}},
    {"bad calibration", "int8", NULL, "int8", 0, false, 1, true, {"bwd_calib"}},
    {"stochastic without bwd_qtype", "int8", NULL, NULL, 0, true, 1, false,
     {"bwd_stochastic_rounding", "bwd_qtype"}},
    {"tile without bwd_qtype", "int4", NULL, NULL, 8, false, 1, false, {"bwd_weight_grad_tile_size", "bwd_qtype"}},
};

static FqtSpec err_spec(const FqtErrCase *c) {
    FqtSpec s = spec_of(c->wt, c->at, c->bwd);
    s.bwd_weight_grad_tile_size = c->tile;
    s.bwd_stochastic = c->stochastic;
    s.noise_axes = c->axes;
    if (c->bad_calib) s.bwd_calib.s = -1.0;
    return s;
}

static void test_check_errors(void) {
    Model m;
    qtest_dense_model(&m, 12, 5, 2);
    Module *mod = &m.modules[0];
    for (size_t i = 0; i < sizeof FQT_ERRS / sizeof FQT_ERRS[0]; i++) {
        const FqtErrCase *c = &FQT_ERRS[i];
        FqtSpec s = err_spec(c);
        QtError err = {0};
        QtStatus st = fqt_layer_check(&s, mod, &err);
        if (st != QT_ERR_CONFIG) fprintf(stderr, "\n  %s: status %d (%s)\n", c->name, (int)st, err.msg);
        CU_ASSERT_EQUAL(st, QT_ERR_CONFIG);
        CU_ASSERT(strncmp(err.msg, "fc1: ", 5) == 0);
        for (int k = 0; k < 3 && c->has[k]; k++) CU_ASSERT(test_msg_has(&err, c->has[k]));
        FqtLayer q;
        memset(&q, 0x5a, sizeof q);
        QtError err2 = {0};
        CU_ASSERT_EQUAL(fqt_layer_init(&q, mod, &s, 1, 2, &err2), QT_ERR_CONFIG);
        CU_ASSERT(q.module == NULL);
        CU_ASSERT_STRING_EQUAL(err.msg, err2.msg);
    }
    /* valid ones */
    const FqtErrCase ok[] = {
        {"int8", "int8", NULL, NULL, 0, false, 0, false, {0}},
        {"mixed", "int4", "fp8_e4m3", "fp8_e5m2", 16, true, 3, false, {0}},
        {"uint input", "e3m4", "uint8", "int4", 0, true, 2, false, {0}},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        FqtSpec s = err_spec(&ok[i]);
        QtError err = {0};
        QtStatus st = fqt_layer_check(&s, mod, &err);
        if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", ok[i].name, err.msg);
        CU_ASSERT_EQUAL(st, QT_OK);
    }
    FqtSpec s = spec_of("int8", NULL, NULL);
    QtError err = {0};
    CU_ASSERT_EQUAL(fqt_layer_check(NULL, mod, &err), QT_ERR_ARG);
    CU_ASSERT_EQUAL(fqt_layer_init(NULL, mod, &s, 1, 2, &err), QT_ERR_ARG);
    model_free(&m);

    /* a module without a weight matrix */
    LayerSpec relu = {.type = LAYER_RELU, .name = "act"};
    qtest_one_layer_model(&m, 1, (const int[]){8}, &relu, 1);
    err = (QtError){0};
    CU_ASSERT_EQUAL(fqt_layer_check(&s, &m.modules[0], &err), QT_ERR_CONFIG);
    CU_ASSERT(strncmp(err.msg, "act: ", 5) == 0 && test_msg_has(&err, "relu") && test_msg_has(&err, "dense"));
    model_free(&m);
}

/* Errors of the forward and backward go to the tape, naming the module. */
static void test_forward_errors(void) {
    Model m;
    qtest_dense_model(&m, 6, 3, 4);
    FqtSpec s = spec_of("int8", NULL, "int8");
    FqtLayer q;
    init_ok(&q, &m.modules[0], &s, 1);
    TestEnv e;
    test_env_init(&e, 1);
    float x[12] = {0};
    CU_ASSERT_PTR_NULL(fqt_layer_forward(&e.tape, &q, tape_wrap(&e.tape, x, 2, (const int[]){3, 4})));
    CU_ASSERT(e.tape.err.status == QT_ERR_SHAPE && test_msg_has(&e.tape.err, "fc1") &&
              test_msg_has(&e.tape.err, "(3, 4)"));
    tape_reset(&e.tape);
    x[7] = NAN;
    CU_ASSERT_PTR_NULL(fqt_layer_forward(&e.tape, &q, tape_wrap(&e.tape, x, 2, (const int[]){2, 6})));
    CU_ASSERT(e.tape.err.status == QT_ERR_VALUE && test_msg_has(&e.tape.err, "fc1") &&
              test_msg_has(&e.tape.err, "input"));
    /* a NaN gradient cannot be quantized */
    tape_reset(&e.tape);
    x[7] = 0.5f;
    Var *vx = test_var(&e, x, 2, (const int[]){2, 6}, true);
    Var *y = fqt_layer_forward(&e.tape, &q, vx);
    CU_ASSERT_FATAL(y != NULL);
    const float dy[6] = {1.0f, NAN, 0.0f, 1.0f, 2.0f, 3.0f};
    CU_ASSERT_EQUAL(tape_backward_from(&e.tape, y, dy), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&e.tape.err, "fc1") && test_msg_has(&e.tape.err, "gradient"));
    test_env_free(&e);
    model_free(&m);
}

/* ---- the forward and the float backward equal QAT's -------------------------------------------------------------- */

/* QT without bwd_qtype against the QAT layer of the same formats: y, dx, dw and dbias to float rounding. */
static void check_equals_qat(Model *m, int N, const char *wt, const char *at, uint64_t seed) {
    Module *mod = &m->modules[0];
    FqtLayer q;
    FqtSpec s = spec_of(wt, at, NULL);
    init_ok(&q, mod, &s, 1);
    QatLayer qa;
    qat_twin(&qa, mod, wt, at);
    float *x = qa_normal_sample(seed, qtest_input_numel(mod, N));
    QtestRun a, b;
    fqtest_run_qt(&q, x, N, NULL, &a);
    qtest_run_qat(&qa, x, N, true, true, &b);
    char label[96];
    const char *kind = mod->spec.type == LAYER_CONV2D ? "conv" : "dense";
    snprintf(label, sizeof label, "%s %s/%s y", kind, wt, at);
    CU_ASSERT(a.ny == b.ny && fqtest_close_to(a.y, b.y, a.ny, label));
    snprintf(label, sizeof label, "%s %s/%s dx", kind, wt, at);
    CU_ASSERT(fqtest_close_to(a.dx, b.dx, a.nx, label));
    snprintf(label, sizeof label, "%s %s/%s dw", kind, wt, at);
    CU_ASSERT(fqtest_close_to(a.dw, b.dw, a.nw, label));
    snprintf(label, sizeof label, "%s %s/%s db", kind, wt, at);
    CU_ASSERT(fqtest_close_to(a.db, b.db, a.nb, label));
    /* the clipped STE zeroed something: a positive extreme of an int slice (qmax + 1/2) or, for a symmetric
     * uint, the negative inputs */
    size_t zw = 0, zx = 0;
    for (size_t i = 0; i < a.nw; i++) zw += a.dw[i] == 0.0f;
    for (size_t i = 0; i < a.nx; i++) zx += a.dx[i] == 0.0f;
    CU_ASSERT(zw < a.nw && zx < a.nx);
    if (qa_find(wt)->kind == QTYPE_KIND_INT) CU_ASSERT(zw > 0);
    if (qa_find(at)->kind == QTYPE_KIND_UINT) CU_ASSERT(zx > 0);
    qtest_run_free(&a), qtest_run_free(&b);
    qat_layer_free(&qa);
    free(x);
}

static const char *const FORMATS[][2] = {
    {"int8", "int8"},         /* the integer GEMM */
    {"int4", "int8"},         /* the integer GEMM on int4 codes */
    {"fp8_e4m3", "fp8_e4m3"}, /* float GEMMs on the dequantized operands */
    {"int8", "uint8"},
    {"int4", "fp6_e2m3"},
};

static void test_dense_equals_qat(void) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++) {
        Model m;
        qtest_dense_model(&m, 37, 11, 20 + i);
        check_equals_qat(&m, 5, FORMATS[i][0], FORMATS[i][1], 30 + i);
        model_free(&m);
    }
}

static void test_conv_equals_qat(void) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++) {
        Model m;
        qtest_conv_model(&m, 3, 7, 6, 5, 3, 2, 1, 40 + i); /* stride 2, padding 1 */
        check_equals_qat(&m, 2, FORMATS[i][0], FORMATS[i][1], 50 + i);
        model_free(&m);
    }
    Model m;
    qtest_conv_model(&m, 2, 5, 5, 3, 2, 1, 0, 60); /* even kernel, no padding, batch 1 */
    check_equals_qat(&m, 1, "int8", "int8", 61);
    model_free(&m);
}

/* ---- the quantized backward -------------------------------------------------------------------------------------- */

static void test_backward_rne(void) {
    Model m;
    qtest_dense_model(&m, 9, 5, 70);
    FqtLayer q;
    FqtSpec s = spec_of("int8", NULL, "int8");
    s.bwd_weight_grad_tile_size = 4; /* 6 rows: tiles of 4 and 2 */
    init_ok(&q, &m.modules[0], &s, 1);
    fqtest_check_against_ref(&q, 6, 71, 8, "dense int8 tile 4");
    s.bwd_qtype = qa_find("int4");
    s.bwd_weight_grad_tile_size = 0;
    init_ok(&q, &m.modules[0], &s, 1);
    fqtest_check_against_ref(&q, 6, 72, 4, "dense int4");
    model_free(&m);

    qtest_dense_model(&m, 3, 2, 75); /* 65,600 rows: dW's two chunks of one tile, summed in int64 */
    s = spec_of("int8", "int8", "int8");
    init_ok(&q, &m.modules[0], &s, 1);
    fqtest_check_against_ref(&q, FQT_DW_CHUNK + 64, 76, 8, "dense int8, two chunks");
    model_free(&m);

    qtest_conv_model(&m, 2, 6, 7, 4, 3, 2, 1, 73);
    s = spec_of("int8", "int8", "int8");
    s.bwd_weight_grad_tile_size = 5; /* over 2 * 3 * 4 = 24 pixel rows */
    init_ok(&q, &m.modules[0], &s, 1);
    fqtest_check_against_ref(&q, 2, 74, 8, "conv int8 tile 5");
    CU_ASSERT_EQUAL(q.rng.counter, 0); /* round to nearest draws nothing */
    model_free(&m);
}

/* The integer backward (g quantized in the output's layout, dW from int8 products in chunks, dX through the conv's
 * own input gradient) over geometries whose patches cut the padding differently, every noise layout, tiles that
 * split images, and a contraction longer than one int32 chunk (FQT_DW_CHUNK rows). */
static void test_backward_integer_geometries(void) {
    static const struct {
        int C, H, W, OC, k, stride, pad, N, tile;
        unsigned axes;
        const char *bwd;
    } CASES[] = {
        {3, 9, 8, 5, 4, 3, 2, 2, 7, FQT_NOISE_COLS, "int8"},
        {2, 11, 7, 9, 5, 2, 2, 3, 0, FQT_NOISE_ROWS, "int8"},
        {4, 6, 6, 17, 3, 1, 1, 2, 13, FQT_NOISE_ROWS | FQT_NOISE_COLS, "int4"},
        {1, 5, 9, 3, 2, 2, 0, 4, 0, FQT_NOISE_ROWS | FQT_NOISE_COLS, "int8"},
        {1, 262, 256, 2, 1, 1, 0, 1, 0, FQT_NOISE_ROWS, "int8"}, /* 67,072 rows: two chunks of one tile */
        {2, 7, 8, 3, 5, 1, 2, 2, 0, FQT_NOISE_ROWS, "int8"}, /* "same" 5x5: X^T's planes shifted by up to 2 */
        {1, 6, 7, 12, 3, 1, 1, 3, 20, FQT_NOISE_ROWS, "int8"}, /* 9 patch elements < 12 channels: dW as g X */
    };
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        Model m;
        qtest_conv_model(&m, CASES[i].C, CASES[i].H, CASES[i].W, CASES[i].OC, CASES[i].k, CASES[i].stride,
                         CASES[i].pad, 200 + i);
        FqtLayer q;
        FqtSpec s = spec_of("int8", "int8", CASES[i].bwd);
        s.bwd_stochastic = true;
        s.noise_axes = CASES[i].axes;
        s.bwd_weight_grad_tile_size = CASES[i].tile;
        init_ok(&q, &m.modules[0], &s, 11);
        char what[64];
        snprintf(what, sizeof what, "integer backward case %zu", i);
        fqtest_check_against_ref(&q, CASES[i].N, 210 + i, strcmp(CASES[i].bwd, "int4") == 0 ? 4 : 8, what);
        model_free(&m);
    }
}

/* The integer path's work split over threads (by images, by output channels within an image when the batch is
 * smaller than the thread count) changes no bit: 1, 2 and 3 threads on batches of 1 and 5, fused and not. */
static void test_threads_same_bits(void) {
    Model m;
    qtest_conv_model(&m, 3, 10, 9, 7, 3, 1, 1, 320);
    FqtLayer q;
    FqtSpec s = spec_of("int8", "int8", "int8");
    s.bwd_stochastic = true;
    init_ok(&q, &m.modules[0], &s, 13);
    fqt_layer_install(&q);
    for (int N = 1; N <= 5; N += 4)
        for (int e = CONV_EPI_NONE; e <= CONV_EPI_RELU_MAXPOOL2; e += 2) {
            float *x = qa_normal_sample(330 + N, qtest_input_numel(&m.modules[0], N));
            const Rng start = q.rng;
            QtestRun r[3];
            for (int th = 1; th <= 3; th++) {
                CU_ASSERT_FATAL(parallel_set_threads(th) == th);
                q.rng = start;
                run_fused(&q, x, N, (ConvEpilogue)e, e != CONV_EPI_NONE, true, &r[th - 1]);
            }
            parallel_set_threads(1);
            for (int k = 1; k < 3; k++) {
                CU_ASSERT(same_floats(r[k].y, r[0].y, r[0].ny) && same_floats(r[k].dx, r[0].dx, r[0].nx));
                CU_ASSERT(same_floats(r[k].dw, r[0].dw, r[0].nw) && same_floats(r[k].db, r[0].db, r[0].nb));
            }
            for (int k = 0; k < 3; k++) qtest_run_free(&r[k]);
            free(x);
        }
    /* and against the hand reference, the one image's channels split over 2 and 3 threads */
    for (int th = 2; th <= 3; th++) {
        CU_ASSERT_FATAL(parallel_set_threads(th) == th);
        fqtest_check_against_ref(&q, 1, 340 + th, 8, "one image over threads");
    }
    parallel_set_threads(1);
    model_free(&m);
    /* noise of 10,240 words (a uniform per row and column), drawn by 2 and 3 threads in parts of 4,096 words: the
     * reference's one sequential draw */
    qtest_conv_model(&m, 2, 16, 16, 8, 3, 1, 1, 350);
    s.noise_axes = FQT_NOISE_ROWS | FQT_NOISE_COLS;
    init_ok(&q, &m.modules[0], &s, 14);
    for (int th = 2; th <= 3; th++) {
        CU_ASSERT_FATAL(parallel_set_threads(th) == th);
        fqtest_check_against_ref(&q, 5, 350 + th, 8, "noise drawn in parts over threads");
    }
    parallel_set_threads(1);
    model_free(&m);
}

static void test_backward_stochastic(void) {
    static const unsigned AXES[] = {FQT_NOISE_ROWS, FQT_NOISE_COLS, FQT_NOISE_ROWS | FQT_NOISE_COLS};
    for (int i = 0; i < 3; i++) {
        Model m;
        qtest_dense_model(&m, 9, 5, 80 + i);
        FqtLayer q;
        FqtSpec s = spec_of("int8", NULL, "int4");
        s.bwd_stochastic = true;
        s.noise_axes = AXES[i];
        s.bwd_weight_grad_tile_size = 3;
        init_ok(&q, &m.modules[0], &s, 7);
        char what[64];
        snprintf(what, sizeof what, "dense stochastic axes %u", AXES[i]);
        fqtest_check_against_ref(&q, 6, 90 + i, 4, what);
        fqtest_check_against_ref(&q, 6, 90 + i, 4, what); /* the next step, fresh noise */
        uint64_t per_step = AXES[i] == FQT_NOISE_ROWS ? 2 : AXES[i] == FQT_NOISE_COLS ? 2 : 8; /* ceil(n / 4) */
        CU_ASSERT_EQUAL(q.rng.counter, 2 * per_step);
        model_free(&m);
    }
    Model m;
    qtest_conv_model(&m, 2, 5, 6, 3, 3, 2, 1, 95);
    FqtLayer q;
    FqtSpec s = spec_of("int8", "int8", "int8");
    s.bwd_stochastic = true;
    s.noise_axes = FQT_NOISE_ROWS | FQT_NOISE_COLS;
    init_ok(&q, &m.modules[0], &s, 8);
    fqtest_check_against_ref(&q, 2, 96, 8, "conv stochastic");
    model_free(&m);
}

/* A dense layer with W = I (16 x 16) and g whose every element but one per row lies halfway between two codes of
 * a row scale 1: dx / deq(W_ii) is the quantized g, and whether each element rounded up shows its u >= 1/2. */
static void noise_pattern(unsigned axes, bool up[8][16]) {
    enum { N = 8, D = 16 };
    Model m;
    qtest_dense_model(&m, D, D, 100);
    Module *mod = &m.modules[0];
    float *w = mod->weight->var.value.data;
    for (int i = 0; i < D * D; i++) w[i] = i % (D + 1) == 0 ? 1.0f : 0.0f;
    float x[N * D], g[N * D];
    for (int i = 0; i < N * D; i++) {
        x[i] = i ? 0.1f + 0.8f * (float)(i % 7) / 7.0f : 1.0f; /* only x[0] saturates */
        int r = i / D, o = i % D;
        g[i] = o == r ? 127.5f : (float)((r * 7 + o * 3) % 100 - 50) + 0.5f;
    }
    FqtSpec s = spec_of("int8", NULL, "int8");
    s.bwd_stochastic = true;
    s.noise_axes = axes;
    FqtLayer q;
    init_ok(&q, mod, &s, 11);
    QtestRun a;
    fqtest_run_qt(&q, x, N, g, &a);
    float wdiag = 127.0f * (1.0f / 127.5f); /* deq of the code 127 at scale 1 / 127.5 */
    for (int i = 0; i < N * D; i++) {
        int r = i / D, o = i % D;
        if (o == r || i == 0) continue;
        float gq = a.dx[i] / wdiag;
        CU_ASSERT(fabsf(gq - (g[i] + 0.5f)) < 1e-3f || fabsf(gq - (g[i] - 0.5f)) < 1e-3f);
        up[r][o] = gq > g[i];
    }
    qtest_run_free(&a);
    model_free(&m);
}

static void test_noise_axes(void) {
    bool up[8][16];
    /* rows only: a row rounds all its halfway elements the same way, and rows differ */
    noise_pattern(FQT_NOISE_ROWS, up);
    int rows_up = 0;
    for (int r = 0; r < 8; r++) {
        int o0 = r == 0 ? 1 : 0, same = 1;
        for (int o = 0; o < 16; o++)
            if (o != r && !(r == 0 && o == 0)) same &= up[r][o] == up[r][o0];
        CU_ASSERT(same);
        rows_up += up[r][o0];
    }
    CU_ASSERT(rows_up > 0 && rows_up < 8);
    /* columns only: a column rounds the same way in every row */
    noise_pattern(FQT_NOISE_COLS, up);
    int cols_up = 0;
    for (int o = 8; o < 16; o++) { /* columns 8..15 hold no row's extreme */
        int same = 1;
        for (int r = 1; r < 8; r++) same &= up[r][o] == up[0][o];
        CU_ASSERT(same);
        cols_up += up[0][o];
    }
    CU_ASSERT(cols_up > 0 && cols_up < 8);
    /* both: elements of one row differ */
    noise_pattern(FQT_NOISE_ROWS | FQT_NOISE_COLS, up);
    int mixed = 0;
    for (int r = 1; r < 8; r++) {
        int n_up = 0;
        for (int o = 8; o < 16; o++) n_up += up[r][o];
        mixed += n_up > 0 && n_up < 8;
    }
    CU_ASSERT(mixed > 0);
}

/* The mean of dx over many steps of fresh noise approaches mask_x (E[gq] deq(W)), E[gq] = clamp(g / s) s per row:
 * stochastic rounding is unbiased inside the range. One u per row makes a row's errors correlated; their sum's
 * standard deviation is at most s/2 sum_o |W_oi|, so the mean of D draws lies within 4 of those / sqrt(D). */
static void test_stochastic_unbiased(void) {
    enum { N = 4, IN = 8, OUT = 6, DRAWS = 2000 };
    Model m;
    qtest_dense_model(&m, IN, OUT, 110);
    Module *mod = &m.modules[0];
    FqtSpec s = spec_of("int8", NULL, "int4");
    s.bwd_stochastic = true;
    FqtLayer q;
    init_ok(&q, mod, &s, 12);
    float *x = qa_normal_sample(111, N * IN), *dy = qa_normal_sample(112, N * OUT);
    FqtestOperands op;
    fqtest_operands_of(&q, x, N * IN, &op);
    /* the expectation and the tolerance */
    float expect[N * IN], tol[N * IN], first[N * IN];
    double sum[N * IN] = {0};
    for (int r = 0; r < N; r++) {
        float amax = 0.0f;
        for (int o = 0; o < OUT; o++) amax = fmaxf(amax, fabsf(dy[r * OUT + o]));
        float sc = fqtest_int_slice_scale(amax, 4);
        for (int i = 0; i < IN; i++) {
            double e = 0.0, wsum = 0.0;
            for (int o = 0; o < OUT; o++) {
                float eg = fminf(fmaxf(dy[r * OUT + o] / sc, -8.0f), 7.0f) * sc;
                e += (double)eg * op.wq[o * IN + i];
                wsum += fabs(op.wq[o * IN + i]);
            }
            expect[r * IN + i] = (float)e;
            tol[r * IN + i] = (float)(4.0 * 0.5 * sc * wsum / sqrt((double)DRAWS)) + 1e-6f;
        }
    }
    qtest_apply_mask(expect, x, N * IN, &op.qx);
    Arena a;
    Tape t;
    CU_ASSERT_FATAL(arena_init(&a, 1 << 16) == 0);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, NULL, NULL), QT_OK);
    for (int d = 0; d < DRAWS; d++) {
        tape_reset(&t);
        Var *vx = tape_new_var(&t, 2, (const int[]){N, IN});
        CU_ASSERT_FATAL(vx != NULL);
        memcpy(vx->value.data, x, sizeof x[0] * N * IN);
        vx->requires_grad = true;
        zero_module_grads(mod);
        Var *y = fqt_layer_forward(&t, &q, vx);
        CU_ASSERT_FATAL(y && tape_backward_from(&t, y, dy) == QT_OK);
        for (int i = 0; i < N * IN; i++) sum[i] += vx->grad[i];
        if (d == 0) memcpy(first, vx->grad, sizeof first);
    }
    int noisy = 0, off = 0;
    for (int i = 0; i < N * IN; i++) {
        double mean = sum[i] / DRAWS;
        if (fabs(mean - expect[i]) > tol[i]) {
            off++;
            fprintf(stderr, "\n  dx[%d]: mean %.6g, expected %.6g (tolerance %.3g)\n", i, mean, (double)expect[i],
                    (double)tol[i]);
        }
        noisy += fabsf(first[i] - expect[i]) > tol[i];
    }
    CU_ASSERT_EQUAL(off, 0);
    CU_ASSERT(noisy > 0); /* one draw alone is off: the agreement is the averaging's */
    tape_free(&t);
    arena_free(&a);
    fqtest_operands_free(&op);
    free(x), free(dy);
    model_free(&m);
}

/* The same rng state gives the same gradients; another stream or the next step other ones. */
static void test_determinism(void) {
    Model m;
    qtest_dense_model(&m, 10, 7, 120);
    Module *mod = &m.modules[0];
    FqtSpec s = spec_of("int8", "int8", "int8");
    s.bwd_stochastic = true;
    s.noise_axes = FQT_NOISE_ROWS | FQT_NOISE_COLS;
    FqtLayer a, b, c;
    init_ok(&a, mod, &s, 3);
    init_ok(&b, mod, &s, 3);
    init_ok(&c, mod, &s, 4);
    float *x = qa_normal_sample(121, 4 * 10);
    QtestRun ra, rb, rc, rd;
    Rng saved = a.rng;
    fqtest_run_qt(&a, x, 4, NULL, &ra);
    fqtest_run_qt(&b, x, 4, NULL, &rb);
    fqtest_run_qt(&c, x, 4, NULL, &rc);
    CU_ASSERT(a.rng.counter == 7 && b.rng.counter == 7); /* 4 x 7 uniforms: 7 blocks */
    CU_ASSERT(memcmp(ra.dx, rb.dx, ra.nx * 4) == 0 && memcmp(ra.dw, rb.dw, ra.nw * 4) == 0);
    CU_ASSERT(memcmp(ra.dx, rc.dx, ra.nx * 4) != 0 && memcmp(ra.dw, rc.dw, ra.nw * 4) != 0);
    fqtest_run_qt(&a, x, 4, NULL, &rd); /* the next step */
    CU_ASSERT(memcmp(ra.dx, rd.dx, ra.nx * 4) != 0);
    qtest_run_free(&rd);
    a.rng = saved; /* a resumed run */
    fqtest_run_qt(&a, x, 4, NULL, &rd);
    CU_ASSERT(memcmp(ra.dx, rd.dx, ra.nx * 4) == 0 && memcmp(ra.dw, rd.dw, ra.nw * 4) == 0);
    qtest_run_free(&ra), qtest_run_free(&rb), qtest_run_free(&rc), qtest_run_free(&rd);
    free(x);
    model_free(&m);
}

/* Tiles along the rows give dW's g a scale per tile and column (tile 1: every element is its own slice, checked
 * against the reference), so dW changes with the tile while dX, quantized per row, does not. */
static void test_tile_scales(void) {
    enum { N = 6, IN = 5, OUT = 4 };
    Model m;
    qtest_dense_model(&m, IN, OUT, 130);
    float *x = qa_normal_sample(131, N * IN), *dy = qa_normal_sample(132, N * OUT);
    QtestRun r[3];
    for (int i = 0; i < 3; i++) {
        FqtSpec s = spec_of("int8", NULL, "int8");
        s.bwd_weight_grad_tile_size = i;
        FqtLayer q;
        init_ok(&q, &m.modules[0], &s, 1);
        fqtest_run_qt(&q, x, N, dy, &r[i]);
        if (i == 1) fqtest_check_against_ref(&q, N, 133, 8, "tile 1");
    }
    size_t bw = sizeof(float) * OUT * IN, bx = sizeof(float) * N * IN;
    CU_ASSERT(memcmp(r[0].dw, r[1].dw, bw) != 0 && memcmp(r[0].dw, r[2].dw, bw) != 0 && memcmp(r[1].dw, r[2].dw, bw));
    CU_ASSERT(memcmp(r[0].dx, r[1].dx, bx) == 0 && memcmp(r[0].dx, r[2].dx, bx) == 0);
    for (int i = 0; i < 3; i++) qtest_run_free(&r[i]);
    free(x), free(dy);
    model_free(&m);
}

/* ---- a model of QT layers: the arena's steady state -------------------------------------------------------------- */

static void test_steady_state(void) {
    enum { N = 4, C = 2, H = 6, W = 6, OC = 4, CLASSES = 10 };
    Model m;
    test_small_cnn(&m, 140);
    FqtSpec cs = spec_of("int8", "int8", "int8"), ds = spec_of("fp8_e4m3", "int8", "fp8_e5m2");
    cs.bwd_stochastic = true;
    cs.noise_axes = FQT_NOISE_ROWS | FQT_NOISE_COLS;
    cs.bwd_weight_grad_tile_size = 7;
    ds.bwd_calib = (CalibSpec){.kind = CALIB_PERCENTILE, .s = 1.0, .p = 99.0}; /* needs workspace */
    FqtLayer q[2];
    init_ok(&q[0], &m.modules[0], &cs, 1);
    init_ok(&q[1], &m.modules[2], &ds, 2);
    fqt_layer_install(&q[0]), fqt_layer_install(&q[1]);
    Arena a;
    Tape t;
    CU_ASSERT_FATAL(arena_init(&a, 4096) == 0);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, NULL, NULL), QT_OK);
    float *x = qa_normal_sample(141, N * C * H * W), *dy = qa_normal_sample(142, N * CLASSES);
    test_assert_steady_steps(&m, &t, &a, x, dy, 5);
    CU_ASSERT_EQUAL(q[0].rng.counter, 5 * (N * H * W * OC / 4)); /* 4 x 144 pixel rows x 4 channels a step */
    CU_ASSERT_EQUAL(q[1].rng.counter, 0);
    CU_ASSERT(qa_abs_max(m.modules[0].weight->var.grad, OC * C * 9) > 0.0f &&
              qa_abs_max(m.modules[2].weight->var.grad, CLASSES * OC * H * W) > 0.0f);
    free(x), free(dy);
    tape_free(&t);
    arena_free(&a);
    model_free(&m);
}

int register_quant_qt_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qt", NULL, NULL);
    if (!s) return -1;
    return qgemm_tests_add(s) || !CU_add_test(s, "init and install", test_init_and_install) ||
           !CU_add_test(s, "check errors", test_check_errors) ||
           !CU_add_test(s, "forward and backward errors", test_forward_errors) ||
           !CU_add_test(s, "dense equals QAT", test_dense_equals_qat) ||
           !CU_add_test(s, "conv equals QAT", test_conv_equals_qat) ||
           !CU_add_test(s, "quantized backward, round to nearest", test_backward_rne) ||
           !CU_add_test(s, "quantized backward, stochastic", test_backward_stochastic) ||
           !CU_add_test(s, "integer backward, geometries", test_backward_integer_geometries) ||
           !CU_add_test(s, "fused relu and pool = separate ops", test_fused_epilogue) ||
           !CU_add_test(s, "fused hook: a non-finite gradient names the module", test_fused_nonfinite) ||
           !CU_add_test(s, "1, 2, 3 threads, batches of 1 and 5: the same bits", test_threads_same_bits) ||
           !CU_add_test(s, "AVX2 family: the integer F(2x2, 3x3) forward keeps every bit", fqtest_qwino_same_bits) ||
           !CU_add_test(s, "noise axes", test_noise_axes) ||
           !CU_add_test(s, "stochastic rounding is unbiased", test_stochastic_unbiased) ||
           !CU_add_test(s, "determinism", test_determinism) ||
           !CU_add_test(s, "weight-gradient tiles", test_tile_scales) ||
           !CU_add_test(s, "steady state", test_steady_state);
}
