/* test_qat.c - the quantization-aware-training layer: spec errors, setup of
 * the learned ranges, the forward and every gradient against the float op
 * run on the fake-quantized weight and input (QArray's round trip with the
 * STE's mask, or fq_learned_quant composed by hand), finite differences with
 * the rounding skipped, static input statistics, calibration, conversion to
 * a QLayer (test_qat_convert.c) that evaluates bit for bit alike, and the
 * arena's steady state. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/ops.h"
#include "quant/fakequant.h"
#include "quant/qat.h"
#include "test_fakequant.h"
#include "test_qarray.h"
#include "test_qat.h"
#include "test_util.h"

/* ---- models, specs, layers --------------------------------------------------------------------------------------- */

void qtest_one_layer_model(Model *m, int ndim, const int *in_shape, const LayerSpec *l, uint64_t seed) {
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(m, ndim, in_shape, l, 1, &err), QT_OK);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    model_init_params(m, &r);
    /* a bias of some size, so a wrong bias path shows */
    Param *b = m->modules[0].bias;
    for (size_t i = 0; b && i < var_numel(&b->var); i++) b->var.value.data[i] = 0.1f * (float)((int)i % 5 - 2);
}

void qtest_dense_model(Model *m, int in, int out, uint64_t seed) {
    qtest_one_layer_model(m, 1, (const int[]){in}, &(LayerSpec){.type = LAYER_DENSE, .units = out, .name = "fc1"}, seed);
}

void qtest_conv_model(Model *m, int C, int H, int W, int OC, int k, int stride, int pad, uint64_t seed) {
    LayerSpec l = {.type = LAYER_CONV2D, .out_channels = OC, .kernel = k, .stride = stride, .padding = pad,
                   .name = "conv1"};
    qtest_one_layer_model(m, 3, (const int[]){C, H, W}, &l, seed);
}

QLayerSpec qtest_wspec(const char *qt, int tile, QArrayScaleType scale_type) {
    QLayerSpec s = qlayer_spec_default();
    s.weight_qtype = qa_find(qt);
    s.tile_size = tile;
    s.scale_type = scale_type;
    return s;
}

QatSpec qtest_qspec(QatLearn learn, bool act_static) {
    QatSpec q = qat_spec_default();
    q.learn_amax = learn;
    q.act_static_scale = act_static;
    return q;
}

void qtest_init_ok(QatLayer *q, Module *mod, const QLayerSpec *spec, const QatSpec *qs) {
    QtError err = {0};
    QtStatus st = qat_layer_init(q, mod, spec, qs, &err);
    if (st != QT_OK) fprintf(stderr, "\n  qat_layer_init: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

size_t qtest_input_numel(const Module *mod, int N) {
    size_t n = (size_t)N;
    for (int d = 0; d < mod->in_ndim; d++) n *= (size_t)mod->in_shape[d];
    return n;
}

/* x's shape (N, in_shape...) -> xs; returns its ndim. */
int qtest_input_shape(const Module *mod, int N, int xs[4]) {
    xs[0] = N;
    for (int d = 0; d < mod->in_ndim; d++) xs[d + 1] = mod->in_shape[d];
    return mod->in_ndim + 1;
}

float *qtest_copy_floats(const float *src, size_t n) {
    float *d = qa_alloc_floats(n ? n : 1);
    if (src) memcpy(d, src, n * sizeof *d);
    else memset(d, 0, (n ? n : 1) * sizeof *d);
    return d;
}

void qtest_zero(float *g, size_t n) {
    if (g) memset(g, 0, n * sizeof *g);
}

void qtest_zero_grads(QatLayer *q) {
    Module *m = q->module;
    qtest_zero(m->weight->var.grad, var_numel(&m->weight->var));
    if (m->bias) qtest_zero(m->bias->var.grad, var_numel(&m->bias->var));
    Param *p[2];
    for (int i = 0, n = qat_layer_params(q, p); i < n; i++) qtest_zero(p[i]->var.grad, var_numel(&p[i]->var));
}


void qtest_run_free(QtestRun *r) {
    free(r->y), free(r->dx), free(r->dw), free(r->db), free(r->dlw), free(r->dla);
    memset(r, 0, sizeof *r);
}

const float *qtest_range_values(const FqRange *r) { return r->param.var.value.data; }

/* The QAT layer on x (batch N), then its backward from a fixed random dy when `backward`. */
void qtest_run_qat(QatLayer *q, const float *x, int N, bool training, bool backward, QtestRun *r) {
    Module *mod = q->module;
    TestEnv e;
    test_env_init(&e, 5);
    e.tape.training = training;
    int xs[4], xnd = qtest_input_shape(mod, N, xs);
    Var *vx = test_var(&e, x, xnd, xs, true);
    qtest_zero_grads(q);
    Var *y = qat_layer_forward(&e.tape, q, vx);
    if (!y) fprintf(stderr, "\n  qat_layer_forward: %s\n", e.tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    memset(r, 0, sizeof *r);
    r->ny = var_numel(y), r->nx = qtest_input_numel(mod, N), r->nw = var_numel(&mod->weight->var);
    r->nb = mod->bias ? var_numel(&mod->bias->var) : 0;
    r->nlw = q->w_range.n_channels;
    if (backward) {
        float *dy = qa_normal_sample(77, r->ny);
        CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, dy), QT_OK);
        free(dy);
    }
    r->y = qtest_copy_floats(y->value.data, r->ny);
    r->dx = qtest_copy_floats(vx->grad, r->nx);
    r->dw = qtest_copy_floats(mod->weight->var.grad, r->nw);
    r->db = qtest_copy_floats(mod->bias ? mod->bias->var.grad : NULL, r->nb);
    r->dlw = qtest_copy_floats(q->w_range.param.var.grad, r->nlw);
    r->dla = qtest_copy_floats(q->a_range.param.var.grad, 1);
    test_env_free(&e);
}

/* The reference: the module's float op on leaves holding w and x, through fq_learned_quant with a copy of wr's
 * (ar's) values where given; without, w and x are taken as already fake-quantized. */

void qtest_run_ref(const QatLayer *q, const QtestRef *ref, int N, QtestRun *r) {
    Module *mod = q->module;
    TestEnv e;
    test_env_init(&e, 5);
    int xs[4], xnd = qtest_input_shape(mod, N, xs);
    Var *vw = test_var(&e, ref->w, 2, q->w_shape, true), *w2 = vw, *vlw = NULL, *vla = NULL;
    if (ref->wr) {
        vlw = test_var(&e, qtest_range_values(ref->wr), 1, (const int[]){ref->wr->n_channels}, true);
        w2 = fq_learned_quant(&e.tape, vw, vlw, &ref->wr->spec);
    }
    const Tensor *ws = &mod->weight->var.value;
    Var *wq = nn_reshape(&e.tape, w2, ws->ndim, ws->shape);
    Var *vx = test_var(&e, ref->x, xnd, xs, true), *xin = vx;
    if (ref->ar) {
        vla = test_var(&e, qtest_range_values(ref->ar), 1, (const int[]){1}, true);
        xin = fq_learned_quant(&e.tape, vx, vla, &ref->ar->spec);
    }
    Var *b = mod->bias ? test_var(&e, mod->bias->var.value.data, 1, mod->bias->var.value.shape, true) : NULL;
    Var *y = mod->spec.type == LAYER_DENSE ? nn_linear(&e.tape, xin, wq, b)
                                           : nn_conv2d(&e.tape, xin, wq, b, mod->spec.stride, mod->spec.padding);
    if (!y) fprintf(stderr, "\n  reference: %s\n", e.tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    memset(r, 0, sizeof *r);
    r->ny = var_numel(y), r->nx = qtest_input_numel(mod, N), r->nw = tensor_numel(ws), r->nb = b ? var_numel(b) : 0;
    r->nlw = ref->wr ? (size_t)ref->wr->n_channels : 0;
    float *dy = qa_normal_sample(77, r->ny);
    CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, dy), QT_OK);
    free(dy);
    r->y = qtest_copy_floats(y->value.data, r->ny);
    r->dx = qtest_copy_floats(vx->grad, r->nx);
    r->dw = qtest_copy_floats(vw->grad, r->nw);
    r->db = qtest_copy_floats(b ? b->grad : NULL, r->nb);
    r->dlw = qtest_copy_floats(vlw ? vlw->grad : NULL, r->nlw);
    r->dla = qtest_copy_floats(vla ? vla->grad : NULL, 1);
    test_env_free(&e);
}

/* qarray_quantize -> qarray_dequantize of x [numel] into a malloc'd array; *qa keeps the QArray (for its scales). */
float *qtest_qarray_round_trip(const float *x, int ndim, const int *shape, const QType *t, const QArrayOptions *o,
                                QArray *qa) {
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qarray_quantize(qa, x, ndim, shape, t, o, &err), QT_OK);
    float *y = qa_alloc_floats(qa->numel);
    qarray_dequantize(qa, y);
    return y;
}

/* g [n] with the clipped STE's mask of x under qa applied: element i passes where x / s lies in the
 * representable range [qmin - zp, qmax - zp] of its slice (QArray's rows of w_shape[1] or of the tensor). */
void qtest_apply_mask(float *g, const float *x, size_t n, const QArray *qa) {
    size_t per = n / qa->n_scales;
    const QType *t = qa->qtype;
    for (size_t i = 0; i < n; i++) {
        float s = qarray_scale_at(qa, i / per), zp = qarray_zero_point_at(qa, i / per), v = x[i] / s;
        if (!(v >= (float)t->qmin - zp && v <= (float)t->qmax - zp)) g[i] = 0.0f;
    }
}

/* ---- names and spec errors --------------------------------------------------------------------------------------- */

static void test_names(void) {
    CU_ASSERT_STRING_EQUAL(qat_learn_name(QAT_LEARN_NONE), "none");
    CU_ASSERT_STRING_EQUAL(qat_learn_name(QAT_LEARN_TQT), "tqt");
    CU_ASSERT_STRING_EQUAL(qat_learn_name(QAT_LEARN_LSQ), "lsq");
    CU_ASSERT_STRING_EQUAL(qat_learn_name((QatLearn)7), "unknown");
    QatLearn l = QAT_LEARN_NONE;
    QtError err = {0};
    CU_ASSERT(qat_learn_parse("LSQ", &l, &err) == QT_OK && l == QAT_LEARN_LSQ);
    CU_ASSERT_EQUAL(qat_learn_parse("pact", &l, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "pact") && test_msg_has(&err, "none, tqt, lsq"));
    QatSpec d = qat_spec_default();
    CU_ASSERT(d.learn_amax == QAT_LEARN_NONE && !d.act_static_scale);
    CU_ASSERT(d.amax_init.kind == CALIB_ABSMAX && d.amax_init.s == 1.0);
}

typedef struct {
    const char *name, *qt;
    int tile;
    bool dq, asym, narrow;
    QArrayScaleType scale_type;
    const char *act_qt;
    bool act_asym;
    QatLearn learn;
    bool act_static, bad_init;
    const char *has[3]; /* besides the module path */
} QatErr;

static const QatErr QAT_ERRS[] = {
    {"double_quant", "int4", 32, true, false, false, 0, NULL, false, QAT_LEARN_NONE, false, false, {"double_quant"}},
    {"tqt with float32 scales", "int8", 0, false, false, false, QARRAY_SCALE_F32, NULL, false, QAT_LEARN_TQT, false,
     false, {"learn_amax: tqt", "scale_type", "pof2"}},
    {"lsq with pof2 scales", "int8", 0, false, false, false, QARRAY_SCALE_POF2, NULL, false, QAT_LEARN_LSQ, false,
     false, {"learn_amax: lsq", "scale_type", "float32"}},
    {"tqt of a float format", "fp8_e4m3", 0, false, false, false, QARRAY_SCALE_POF2, NULL, false, QAT_LEARN_TQT, false,
     false, {"learn_amax: tqt", "fp8_e4m3", "int or uint"}},
    {"lsq in blocks", "int4", 16, false, false, false, 0, NULL, false, QAT_LEARN_LSQ, false, false,
     {"learn_amax: lsq", "tile_size"}},
    {"tqt asymmetric", "int8", 0, false, true, false, QARRAY_SCALE_POF2, NULL, false, QAT_LEARN_TQT, false, false,
     {"learn_amax: tqt", "symmetric"}},
    {"lsq narrow", "int8", 0, false, false, true, 0, NULL, false, QAT_LEARN_LSQ, false, false, {"narrow_range"}},
    {"tqt with a float input", "int8", 0, false, false, false, QARRAY_SCALE_POF2, "fp8_e4m3", false, QAT_LEARN_TQT,
     false, false, {"act_qtype", "fp8_e4m3"}},
    {"lsq with an asymmetric input", "int8", 0, false, false, false, 0, "uint8", true, QAT_LEARN_LSQ, false, false,
     {"learn_amax: lsq", "act_symmetric"}},
    {"static scale and tqt", "int8", 0, false, false, false, QARRAY_SCALE_POF2, "int8", false, QAT_LEARN_TQT, true,
     false, {"act_static_scale", "learn_amax: tqt"}},
    {"static scale without act_qtype", "int8", 0, false, false, false, 0, NULL, false, QAT_LEARN_NONE, true, false,
     {"act_static_scale", "act_qtype"}},
    {"a bad amax_init", "int8", 0, false, false, false, 0, NULL, false, QAT_LEARN_LSQ, false, true, {"amax_init"}},
    {"a PTQ rule: tile not dividing", "int4", 64, false, false, false, 0, NULL, false, QAT_LEARN_NONE, false, false,
     {"tile_size 64", "224"}},
};

static QLayerSpec err_spec(const QatErr *c, QatSpec *qs) {
    QLayerSpec s = qtest_wspec(c->qt, c->tile, c->scale_type);
    s.double_quant = c->dq, s.symmetric = !c->asym, s.narrow_range = c->narrow;
    if (c->asym) s.weight_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
    if (c->act_qt) s.act_qtype = qa_find(c->act_qt);
    s.act_symmetric = !c->act_asym;
    *qs = qtest_qspec(c->learn, c->act_static);
    if (c->bad_init) qs->amax_init.s = -1.0;
    return s;
}

static void test_check_errors(void) {
    Model m;
    qtest_dense_model(&m, 32, 7, 61); /* 224 weights */
    Module *mod = &m.modules[0];
    for (size_t i = 0; i < sizeof QAT_ERRS / sizeof QAT_ERRS[0]; i++) {
        const QatErr *c = &QAT_ERRS[i];
        QatSpec qs;
        QLayerSpec spec = err_spec(c, &qs);
        QtError err = {0};
        QtStatus st = qat_layer_check(&spec, &qs, mod, &err);
        if (st != QT_ERR_CONFIG) fprintf(stderr, "\n  %s: status %d (%s)\n", c->name, (int)st, err.msg);
        CU_ASSERT_EQUAL(st, QT_ERR_CONFIG);
        CU_ASSERT(strncmp(err.msg, "fc1: ", 5) == 0);
        for (int k = 0; k < 3 && c->has[k]; k++) CU_ASSERT(test_msg_has(&err, c->has[k]));
        /* init refuses the same and leaves q zeroed */
        QatLayer q;
        memset(&q, 0x5a, sizeof q);
        QtError err2 = {0};
        CU_ASSERT_EQUAL(qat_layer_init(&q, mod, &spec, &qs, &err2), QT_ERR_CONFIG);
        CU_ASSERT(q.module == NULL && q.w_range.param.var.value.data == NULL && q.a_range.param.var.value.data == NULL);
        CU_ASSERT_STRING_EQUAL(err.msg, err2.msg);
        qat_layer_free(&q);
    }
    /* a learned range rounds to nearest only */
    QatSpec lq = qtest_qspec(QAT_LEARN_LSQ, false);
    QLayerSpec ls = qtest_wspec("int8", 0, QARRAY_SCALE_F32);
    ls.rounding = QROUND_STOCHASTIC;
    QtError lerr = {0};
    CU_ASSERT_EQUAL(qat_layer_check(&ls, &lq, mod, &lerr), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&lerr, "fc1: learn_amax: lsq") && test_msg_has(&lerr, "rounding rne") &&
              test_msg_has(&lerr, "stochastic"));
    /* valid ones */
    const QatErr ok[] = {
        {"tqt", "int8", 0, false, false, false, QARRAY_SCALE_POF2, "int8", false, QAT_LEARN_TQT, false, false, {0}},
        {"lsq", "uint4", 0, false, false, false, 0, "uint8", false, QAT_LEARN_LSQ, false, false, {0}},
        {"dynamic", "int4", 16, false, false, false, 0, "uint8", true, QAT_LEARN_NONE, false, false, {0}},
        {"static", "nf4", 32, false, false, false, 0, "int8", false, QAT_LEARN_NONE, true, false, {0}},
        {"mx", "mxfp4", 0, false, false, false, 0, NULL, false, QAT_LEARN_NONE, false, false, {0}},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        QatSpec qs;
        QLayerSpec spec = err_spec(&ok[i], &qs);
        QtError err = {0};
        QtStatus st = qat_layer_check(&spec, &qs, mod, &err);
        if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", ok[i].name, err.msg);
        CU_ASSERT_EQUAL(st, QT_OK);
    }
    model_free(&m);
}

/* ---- setup ------------------------------------------------------------------------------------------------------- */

static void test_init_and_params(void) {
    Model m;
    qtest_dense_model(&m, 20, 6, 1);
    Module *mod = &m.modules[0];
    const float *w = mod->weight->var.value.data;
    QLayerSpec spec = qtest_wspec("int8", 0, QARRAY_SCALE_POF2);
    spec.act_qtype = qa_find("int8");
    QatSpec qs = qtest_qspec(QAT_LEARN_TQT, false);
    QatLayer q;
    qtest_init_ok(&q, mod, &spec, &qs);
    CU_ASSERT(q.out == 6 && q.fan_in == 20 && q.w_ndim == 2 && q.w_shape[0] == 6 && q.w_shape[1] == 20);
    CU_ASSERT(q.w_options.n_channelwise == 1 && q.w_options.calib == &q.spec.weight_calib);
    CU_ASSERT(mod->weight->trainable && mod->weight->var.requires_grad);
    Param *p[2] = {NULL, NULL};
    CU_ASSERT_EQUAL(qat_layer_params(&q, NULL), 2);
    CU_ASSERT_EQUAL_FATAL(qat_layer_params(&q, p), 2);
    CU_ASSERT(p[0] == &q.w_range.param && p[1] == &q.a_range.param);
    CU_ASSERT_STRING_EQUAL(p[0]->name, "fc1/weight/log2_t");
    CU_ASSERT_STRING_EQUAL(p[1]->name, "fc1/input/log2_t");
    CU_ASSERT(q.w_range.n_channels == 6 && q.w_range.spec.per_channel && q.w_range.spec.axis == 0);
    CU_ASSERT(q.a_range.n_channels == 1 && !q.a_range.spec.per_channel);
    CU_ASSERT(p[0]->trainable && p[1]->trainable);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qat_layer_init_ranges(&q, &err), QT_OK);
    for (int o = 0; o < 6; o++) { /* absmax: l = log2 max |w| of the row */
        float amax = qa_abs_max(w + o * 20, 20);
        CU_ASSERT_DOUBLE_EQUAL(qtest_range_values(&q.w_range)[o], log2(amax), 1e-6);
    }
    CU_ASSERT(!q.ranges_ready); /* the input's comes from calibration */
    qat_layer_install(&q);
    CU_ASSERT(mod->hook_ctx == &q && mod->forward_hook != NULL);
    qat_layer_free(&q);

    /* lsq per tensor, no input: one parameter, s = amax / p; ready after init_ranges */
    spec = qtest_wspec("int4", 0, QARRAY_SCALE_F32);
    spec.per_tensor = true;
    qs = qtest_qspec(QAT_LEARN_LSQ, false);
    qtest_init_ok(&q, mod, &spec, &qs);
    CU_ASSERT_EQUAL_FATAL(qat_layer_params(&q, p), 1);
    CU_ASSERT_STRING_EQUAL(p[0]->name, "fc1/weight/step_size");
    CU_ASSERT_EQUAL(q.w_range.n_channels, 1);
    CU_ASSERT_EQUAL_FATAL(qat_layer_init_ranges(&q, &err), QT_OK);
    CU_ASSERT_DOUBLE_EQUAL(qtest_range_values(&q.w_range)[0], qa_abs_max(w, 120) / 7.0, 1e-7);
    CU_ASSERT(q.ranges_ready);
    qat_layer_free(&q);

    /* no learned range: no parameters, init_ranges does nothing */
    spec = qtest_wspec("int4", 8, QARRAY_SCALE_F32);
    qs = qtest_qspec(QAT_LEARN_NONE, false);
    qtest_init_ok(&q, mod, &spec, &qs);
    CU_ASSERT_EQUAL(qat_layer_params(&q, p), 0);
    CU_ASSERT_EQUAL(qat_layer_init_ranges(&q, &err), QT_OK);
    CU_ASSERT(q.w_ndim == 2 && q.w_shape[0] == 15 && q.w_shape[1] == 8);
    qat_layer_free(&q);
    model_free(&m);
}

/* ---- forward and gradients: calibrated weight (and input) -------------------------------------------------------- */

/* The layer against the float op on the QArray round trips of w (and of x with a dynamic act_qtype): y, dbias
 * bit for bit, dw and dx as the reference's masked by the clipped STE. */
static void check_dynamic(QatLayer *q, int N, uint64_t seed, const char *what) {
    Module *mod = q->module;
    const float *w = mod->weight->var.value.data;
    size_t nw = var_numel(&mod->weight->var), nx = qtest_input_numel(mod, N);
    float *x = qa_normal_sample(seed, nx);
    QArray qw, qx = {0};
    float *wq = qtest_qarray_round_trip(w, q->w_ndim, q->w_shape, q->spec.weight_qtype, &q->w_options, &qw), *xq = x;
    if (q->spec.act_qtype) { /* per tensor */
        QArrayOptions ao = {.calib = &q->spec.act_calib,
                            .range = q->spec.act_symmetric ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC};
        xq = qtest_qarray_round_trip(x, 1, (const int[]){(int)nx}, q->spec.act_qtype, &ao, &qx);
    }
    QtestRun a, b;
    qtest_run_qat(q, x, N, true, true, &a);
    qtest_run_ref(q, &(QtestRef){.w = wq, .x = xq}, N, &b);
    qtest_apply_mask(b.dw, w, nw, &qw);
    if (q->spec.act_qtype) qtest_apply_mask(b.dx, x, nx, &qx);
    char label[128];
    snprintf(label, sizeof label, "%s y", what);
    CU_ASSERT(fq_test_same_bits(a.y, b.y, a.ny, label));
    snprintf(label, sizeof label, "%s dw", what);
    CU_ASSERT(fq_test_same_bits(a.dw, b.dw, nw, label));
    snprintf(label, sizeof label, "%s dx", what);
    CU_ASSERT(fq_test_same_bits(a.dx, b.dx, nx, label));
    snprintf(label, sizeof label, "%s dbias", what);
    CU_ASSERT(fq_test_same_bits(a.db, b.db, a.nb, label));
    /* the mask did something: every absmax row's largest |w| saturates at qmax + 1/2 (or x clips) */
    size_t masked = 0, passed = 0;
    for (size_t i = 0; i < nw; i++) masked += a.dw[i] == 0.0f, passed += a.dw[i] != 0.0f;
    CU_ASSERT(masked > 0 && passed > masked);
    qtest_run_free(&a), qtest_run_free(&b);
    qarray_free(&qw), qarray_free(&qx);
    if (xq != x) free(xq);
    free(wq), free(x);
}

static void test_forward_dynamic(void) {
    Model dm, cm;
    qtest_dense_model(&dm, 24, 10, 11);
    qtest_conv_model(&cm, 4, 6, 6, 8, 3, 2, 1, 12); /* fan_in 36: blocks of 16 run across output channels */
    QatLayer q;
    QatSpec qs = qtest_qspec(QAT_LEARN_NONE, false);

    QLayerSpec spec = qtest_wspec("int8", 0, QARRAY_SCALE_F32);
    qtest_init_ok(&q, &dm.modules[0], &spec, &qs);
    check_dynamic(&q, 5, 13, "dense int8 per channel");
    qat_layer_free(&q);
    qtest_init_ok(&q, &cm.modules[0], &spec, &qs);
    check_dynamic(&q, 2, 14, "conv int8 per channel");
    qat_layer_free(&q);

    spec = qtest_wspec("int4", 16, QARRAY_SCALE_F32);
    qtest_init_ok(&q, &cm.modules[0], &spec, &qs);
    CU_ASSERT(q.w_shape[0] == 8 * 36 / 16 && q.w_shape[1] == 16);
    check_dynamic(&q, 2, 15, "conv int4 blocks of 16");
    qat_layer_free(&q);
    qtest_init_ok(&q, &dm.modules[0], &spec, &qs);
    check_dynamic(&q, 3, 16, "dense int4 blocks of 16");
    qat_layer_free(&q);

    /* uint8 asymmetric input, calibrated per batch (minmax of normal data: a qtest_zero point inside the codes) */
    spec = qtest_wspec("int8", 0, QARRAY_SCALE_F32);
    spec.act_qtype = qa_find("uint8");
    spec.act_symmetric = false;
    spec.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 0.8}; /* some of x clips */
    qtest_init_ok(&q, &dm.modules[0], &spec, &qs);
    check_dynamic(&q, 4, 17, "dense int8, uint8 asymmetric input");
    qat_layer_free(&q);
    model_free(&dm);
    model_free(&cm);
}

/* ---- gradients: learned ranges ----------------------------------------------------------------------------------- */

/* The layer against the float op on fq_learned_quant of w and x (the same ranges): everything bit for bit. */
static void check_learned(QatLayer *q, int N, uint64_t seed, const char *what) {
    size_t nx = qtest_input_numel(q->module, N);
    float *x = qa_normal_sample(seed, nx);
    for (size_t i = 0; i < nx; i++) x[i] *= 1.5f; /* beyond the calibrated range here and there */
    QtestRun a, b;
    qtest_run_qat(q, x, N, true, true, &a);
    QtestRef ref = {.w = q->module->weight->var.value.data, .wr = &q->w_range, .x = x,
               .ar = q->a_range.param.var.value.data ? &q->a_range : NULL};
    qtest_run_ref(q, &ref, N, &b);
    char label[128];
    const char *names[6] = {"y", "dw", "dx", "dbias", "dlog2_t/dstep weight", "dlog2_t/dstep input"};
    const float *av[6] = {a.y, a.dw, a.dx, a.db, a.dlw, a.dla}, *bv[6] = {b.y, b.dw, b.dx, b.db, b.dlw, b.dla};
    size_t n[6] = {a.ny, a.nw, a.nx, a.nb, a.nlw, 1};
    for (int k = 0; k < 6; k++) {
        snprintf(label, sizeof label, "%s %s", what, names[k]);
        CU_ASSERT(fq_test_same_bits(av[k], bv[k], n[k], label));
    }
    CU_ASSERT(a.dlw[0] != 0.0f);
    if (ref.ar) CU_ASSERT(a.dla[0] != 0.0f);
    qtest_run_free(&a), qtest_run_free(&b);
    free(x);
}

/* Initialises the ranges: the weight's from the weight, the input's from one calibration batch. */
void qtest_ranges_ok(QatLayer *q, const float *x, int N) {
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qat_layer_init_ranges(q, &err), QT_OK);
    qat_layer_calib_begin(q);
    QtestRun r;
    qtest_run_qat(q, x, N, false, false, &r);
    qtest_run_free(&r);
    QtStatus st = qat_layer_calib_end(q, &err);
    if (st != QT_OK) fprintf(stderr, "\n  calib_end: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

static void test_gradients_learned(void) {
    Model dm, cm;
    qtest_dense_model(&dm, 24, 10, 21);
    qtest_conv_model(&cm, 3, 5, 5, 6, 3, 1, 1, 22);
    struct {
        Model *m;
        const char *wq, *aq;
        QatLearn learn;
        bool per_tensor;
        int N;
    } cases[] = {
        {&dm, "int4", "int8", QAT_LEARN_TQT, false, 4}, {&dm, "int8", "uint8", QAT_LEARN_LSQ, true, 4},
        {&cm, "int8", "int4", QAT_LEARN_TQT, true, 2},  {&cm, "uint4", NULL, QAT_LEARN_LSQ, false, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        Module *mod = &cases[i].m->modules[0];
        QLayerSpec spec = qtest_wspec(cases[i].wq, 0, cases[i].learn == QAT_LEARN_TQT ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
        spec.per_tensor = cases[i].per_tensor;
        if (cases[i].aq) spec.act_qtype = qa_find(cases[i].aq);
        QatSpec qs = qtest_qspec(cases[i].learn, false);
        QatLayer q;
        qtest_init_ok(&q, mod, &spec, &qs);
        float *x = qa_normal_sample(23 + i, qtest_input_numel(mod, cases[i].N));
        qtest_ranges_ok(&q, x, cases[i].N);
        char what[96];
        snprintf(what, sizeof what, "%s %s %s%s", mod->path, qat_learn_name(cases[i].learn), cases[i].wq,
                 cases[i].per_tensor ? " per tensor" : "");
        check_learned(&q, cases[i].N, 24 + i, what);
        free(x);
        qat_layer_free(&q);
    }
    model_free(&dm);
    model_free(&cm);
}

/* L = sum(y * R) of the layer in eval, in double. */
static double qat_loss(QatLayer *q, const float *x, int N, const float *R) {
    QtestRun r;
    qtest_run_qat(q, x, N, false, false, &r);
    double L = 0.0;
    for (size_t i = 0; i < r.ny; i++) L += (double)r.y[i] * R[i];
    qtest_run_free(&r);
    return L;
}

/* Central differences of L in every element of v [n] (the weight, a range or x itself) against analytic [n]. */
static bool fd_matches(QatLayer *q, float *x, int N, const float *R, float *v, size_t n, const float *analytic,
                       double eps, const char *what) {
    for (size_t j = 0; j < n; j++) {
        float v0 = v[j];
        v[j] = (float)(v0 + eps);
        double lp = qat_loss(q, x, N, R);
        v[j] = (float)(v0 - eps);
        double lm = qat_loss(q, x, N, R);
        double h = (double)(float)(v0 + eps) - (double)(float)(v0 - eps);
        v[j] = v0;
        double num = (lp - lm) / h;
        if (fabs(num - analytic[j]) > 2e-3 + 1e-2 * fabs(num)) {
            fprintf(stderr, "\n  %s[%zu]: analytic %.7g, numeric %.7g\n", what, j, (double)analytic[j], num);
            return false;
        }
    }
    return true;
}

/* With skip_rounding (and TQT's exact scale, LSQ's gradient scale 1) the layer is continuous in the weight, x and
 * both ranges, and its gradients are their derivatives. The weight and x keep 0.02 from the clip edges n s and
 * p s (one scale per tensor), farther than any step moves either. */
static void check_fd(QatLearn learn, float w_param, float a_param) {
    enum { IN = 6, OUT = 4, N = 3 };
    Model m;
    qtest_dense_model(&m, IN, OUT, 31);
    Module *mod = &m.modules[0];
    QLayerSpec spec = qtest_wspec("int4", 0, learn == QAT_LEARN_TQT ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
    spec.per_tensor = true;
    spec.act_qtype = qa_find("int4");
    QatSpec qs = qtest_qspec(learn, false);
    QatLayer q;
    qtest_init_ok(&q, mod, &spec, &qs);
    FqRange *rs[2] = {&q.w_range, &q.a_range};
    float vals[2] = {w_param, a_param}, edges[2][2];
    for (int k = 0; k < 2; k++) {
        rs[k]->spec.skip_rounding = true, rs[k]->spec.tqt_exact_scale = true, rs[k]->spec.lsq_grad_scale = 1.0f;
        rs[k]->param.var.value.data[0] = vals[k];
        float s = fq_range_scale(&rs[k]->spec, vals[k]);
        edges[k][0] = -8.0f * s, edges[k][1] = 7.0f * s;
    }
    float *w0 = fq_test_spread_away(IN * OUT, 32, 1.3f * edges[0][1], edges[0], 2, 0.02f);
    float *x = fq_test_spread_away(N * IN, 33, 1.3f * edges[1][1], edges[1], 2, 0.02f);
    memcpy(mod->weight->var.value.data, w0, sizeof(float) * IN * OUT);
    QtestRun a;
    qtest_run_qat(&q, x, N, true, true, &a); /* dy = qa_normal_sample(77): R below */
    float *R = qa_normal_sample(77, a.ny);
    const char *kind = qat_learn_name(learn);
    /* tqt steps l by 1e-3, lsq s by 0.1% */
    bool tqt = learn == QAT_LEARN_TQT;
    double eps_w = tqt ? 1e-3 : 1e-3 * vals[0], eps_a = tqt ? 1e-3 : 1e-3 * vals[1];
    CU_ASSERT(fd_matches(&q, x, N, R, mod->weight->var.value.data, a.nw, a.dw, 1e-3, kind));
    CU_ASSERT(fd_matches(&q, x, N, R, x, a.nx, a.dx, 1e-3, kind));
    CU_ASSERT(fd_matches(&q, x, N, R, q.w_range.param.var.value.data, 1, a.dlw, eps_w, kind));
    CU_ASSERT(fd_matches(&q, x, N, R, q.a_range.param.var.value.data, 1, a.dla, eps_a, kind));
    /* both sides of both ranges are exercised */
    CU_ASSERT(a.dlw[0] != 0.0f && a.dla[0] != 0.0f);
    qtest_run_free(&a);
    free(R), free(w0), free(x);
    qat_layer_free(&q);
    model_free(&m);
}

static void test_gradients_fd(void) {
    check_fd(QAT_LEARN_TQT, 0.0f, 1.0f);    /* s = 1/8 and 1/4 */
    check_fd(QAT_LEARN_LSQ, 0.11f, 0.23f);
}

/* ---- static input statistics ------------------------------------------------------------------------------------- */

/* x [n] fake-quantized over the range [lo, hi] as a uint8 with a qtest_zero point, the codes written out:
 * (clamp(rne(x / s), -zp, 255 - zp) + 0) s with qarray.h's scale and qtest_zero point. */
static float *uint8_fq(const float *x, size_t n, CalibRange r) {
    const QType *t = qa_find("uint8");
    float s = qarray_scale_for_range(t, true, false, 0.0f, 255.0f, r.lo, r.hi);
    float zp = qarray_zero_point_for_range(false, 0.0f, 255.0f, r.lo, s);
    CU_ASSERT(zp > 0.0f && zp < 255.0f);
    float *y = qa_alloc_floats(n);
    for (size_t i = 0; i < n; i++) y[i] = (fminf(fmaxf(rintf(x[i] / s), -zp), 255.0f - zp) + 0.0f) * s;
    return y;
}

/* The layer (dense, int8 weight per channel) against the float op on the round trip of w and on xq. */
static void check_against(QatLayer *q, const float *x, const float *xq, int N, bool training, const char *what) {
    QArray qw;
    float *wq = qtest_qarray_round_trip(q->module->weight->var.value.data, 2, q->w_shape, q->spec.weight_qtype,
                                  &q->w_options, &qw);
    QtestRun a, b;
    qtest_run_qat(q, x, N, training, true, &a);
    qtest_run_ref(q, &(QtestRef){.w = wq, .x = xq}, N, &b);
    CU_ASSERT(fq_test_same_bits(a.y, b.y, a.ny, what));
    qtest_run_free(&a), qtest_run_free(&b);
    qarray_free(&qw);
    free(wq);
}

static void test_static_input(void) {
    enum { IN = 16, OUT = 5, N = 4, NX = N * IN };
    Model m;
    qtest_dense_model(&m, IN, OUT, 41);
    QLayerSpec spec = qtest_wspec("int8", 0, QARRAY_SCALE_F32);
    spec.act_qtype = qa_find("uint8");
    spec.act_symmetric = false;
    spec.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
    QatSpec qs = qtest_qspec(QAT_LEARN_NONE, true);
    QatLayer q;
    qtest_init_ok(&q, &m.modules[0], &spec, &qs);
    float *x0 = qa_normal_sample(42, NX), x[3][NX];
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < NX; i++) x[k][i] = x0[i] * (float)(k + 1) + 0.7f;

    /* no statistics yet: eval cannot quantize the input, and says so */
    TestEnv e;
    test_env_init(&e, 43);
    e.tape.training = false;
    Var *y = qat_layer_forward(&e.tape, &q, test_var(&e, x[0], 2, (const int[]){N, IN}, false));
    CU_ASSERT(y == NULL && e.tape.err.status == QT_ERR_VALUE);
    CU_ASSERT(strncmp(e.tape.err.msg, "fc1: ", 5) == 0 && test_msg_has(&e.tape.err, "no batch"));
    test_env_free(&e);
    QtError err = {0};
    qat_layer_calib_begin(&q);
    CU_ASSERT_EQUAL(qat_layer_calib_end(&q, &err), QT_ERR_VALUE);
    CU_ASSERT(strncmp(err.msg, "fc1: ", 5) == 0 && test_msg_has(&err, "no batch"));

    /* calibration: observed, not quantized; the statistics are the mean of the batches' minmax */
    qat_layer_calib_begin(&q);
    CU_ASSERT(q.calibrating && q.act_stats.count == 0);
    double lo = 0.0, hi = 0.0;
    for (int k = 0; k < 2; k++) {
        check_against(&q, x[k], x[k], N, false, "calibrating");
        float mn = x[k][0], mx = x[k][0];
        for (int i = 1; i < NX; i++) mn = fminf(mn, x[k][i]), mx = fmaxf(mx, x[k][i]);
        lo += mn, hi += mx;
    }
    CU_ASSERT_EQUAL(q.act_stats.count, 2);
    CU_ASSERT_DOUBLE_EQUAL(q.act_stats.lo_mean, lo / 2, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(q.act_stats.hi_mean, hi / 2, 1e-12);
    CU_ASSERT_EQUAL_FATAL(qat_layer_calib_end(&q, &err), QT_OK);
    CU_ASSERT(!q.calibrating && q.act_stats.count == 2);

    /* eval: the statistics stay; the input is quantized with their range */
    float *xq = uint8_fq(x[2], NX, calib_running_range(&q.act_stats));
    check_against(&q, x[2], xq, N, false, "eval");
    CU_ASSERT_EQUAL(q.act_stats.count, 2);
    free(xq);

    /* training: the batch joins the statistics first, then the input is quantized with the new mean */
    float mn = x[2][0], mx = x[2][0];
    for (int i = 1; i < NX; i++) mn = fminf(mn, x[2][i]), mx = fmaxf(mx, x[2][i]);
    CalibRunning want = q.act_stats;
    CU_ASSERT_EQUAL(calib_running_update(&want, (CalibRange){mn, mx}, &err), QT_OK);
    xq = uint8_fq(x[2], NX, calib_running_range(&want));
    check_against(&q, x[2], xq, N, true, "training");
    CU_ASSERT(q.act_stats.count == 3 && q.act_stats.lo_mean == want.lo_mean && q.act_stats.hi_mean == want.hi_mean);
    free(xq);
    /* and eval again leaves them */
    QtestRun r;
    qtest_run_qat(&q, x[0], N, false, false, &r);
    qtest_run_free(&r);
    CU_ASSERT_EQUAL(q.act_stats.count, 3);
    free(x0);
    qat_layer_free(&q);
    model_free(&m);
}

/* ---- calibration of learned input ranges ------------------------------------------------------------------------- */

/* Three batches of growing spread through the layer while calibrating (the input passes unquantized), then the
 * input's parameter from the mean range: tqt l = log2 t, lsq s = t / p. */
static void check_calib_learned(QatLearn learn, const char *amax_init) {
    enum { IN = 16, OUT = 5, N = 4, NX = N * IN };
    Model m;
    qtest_dense_model(&m, IN, OUT, 51);
    QLayerSpec spec = qtest_wspec("int8", 0, learn == QAT_LEARN_TQT ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
    spec.act_qtype = qa_find("int8");
    QatSpec qs = qtest_qspec(learn, false);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(calib_parse(amax_init, &qs.amax_init, &err), QT_OK);
    QatLayer q;
    qtest_init_ok(&q, &m.modules[0], &spec, &qs);
    CU_ASSERT_EQUAL_FATAL(qat_layer_init_ranges(&q, &err), QT_OK);
    CU_ASSERT(!q.ranges_ready);
    float *x0 = qa_normal_sample(52, NX), x[NX];
    qat_layer_calib_begin(&q);
    CU_ASSERT(q.calibrating);
    double tsum = 0.0;
    for (int k = 1; k <= 3; k++) {
        for (int i = 0; i < NX; i++) x[i] = x0[i] * (float)k + 0.2f;
        double t;
        if (qs.amax_init.kind == CALIB_3SD) { /* |mean| + 3 std, population */
            double mean = 0.0, var = 0.0;
            for (int i = 0; i < NX; i++) mean += x[i];
            mean /= NX;
            for (int i = 0; i < NX; i++) var += (x[i] - mean) * (x[i] - mean);
            t = fabs(mean) + 3.0 * sqrt(var / NX);
        } else {
            t = qa_abs_max(x, NX);
        }
        tsum += t;
        QtestRun a, b;
        qtest_run_qat(&q, x, N, false, true, &a);
        qtest_run_ref(&q, &(QtestRef){.w = m.modules[0].weight->var.value.data, .wr = &q.w_range, .x = x}, N, &b);
        CU_ASSERT(fq_test_same_bits(a.y, b.y, a.ny, "calibrating y"));
        CU_ASSERT(fq_test_same_bits(a.dx, b.dx, a.nx, "calibrating dx"));
        qtest_run_free(&a), qtest_run_free(&b);
    }
    CU_ASSERT_EQUAL_FATAL(qat_layer_calib_end(&q, &err), QT_OK);
    CU_ASSERT(!q.calibrating && q.ranges_ready && q.act_stats.count == 3);
    double t = tsum / 3, v = qtest_range_values(&q.a_range)[0];
    if (learn == QAT_LEARN_TQT) CU_ASSERT_DOUBLE_EQUAL(v, log2(t), 1e-6);
    if (learn == QAT_LEARN_LSQ) CU_ASSERT_DOUBLE_EQUAL(v, t / 127.0, 1e-6 * t / 127.0);
    free(x0);
    qat_layer_free(&q);
    model_free(&m);
}

static void test_calib_learned(void) {
    check_calib_learned(QAT_LEARN_TQT, "absmax");
    check_calib_learned(QAT_LEARN_LSQ, "3sd");
}

int register_quant_qat_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qat", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "names", test_names) || !CU_add_test(s, "spec errors", test_check_errors) ||
           !CU_add_test(s, "init, params, init_ranges", test_init_and_params) ||
           !CU_add_test(s, "forward: calibrated weight and input", test_forward_dynamic) ||
           !CU_add_test(s, "gradients: learned ranges", test_gradients_learned) ||
           !CU_add_test(s, "gradients: finite differences", test_gradients_fd) ||
           !CU_add_test(s, "static input statistics", test_static_input) ||
           !CU_add_test(s, "calibration of learned input ranges", test_calib_learned) || qat_convert_tests_add(s);
}

/* The model on x (N examples), training or eval; y copied into out[n_out] when out is given; with R, the backward
 * of sum(y * R) into the parameters' grads (zeroed first) and x's into dx. */
void qtest_run_model(Model *m, const float *x, int N, bool training, const float *R, float *out, size_t n_out,
                     float *dx) {
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].var.grad) memset(m->params[i].var.grad, 0, var_numel(&m->params[i].var) * sizeof(float));
    TestEnv e;
    test_env_init(&e, 2);
    e.tape.training = training;
    int xs[4], xnd = qtest_input_shape(&m->modules[0], N, xs);
    Var *vx = test_var(&e, x, xnd, xs, dx != NULL);
    Var *y = model_forward(m, &e.tape, vx);
    if (!y) fprintf(stderr, "\n  model_forward: %s\n", e.tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    if (out) {
        CU_ASSERT_EQUAL_FATAL(var_numel(y), n_out);
        memcpy(out, y->value.data, n_out * sizeof(float));
    }
    if (R) CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, R), QT_OK);
    if (dx) memcpy(dx, vx->grad, qtest_input_numel(&m->modules[0], N) * sizeof(float));
    test_env_free(&e);
}
