/* test_qat.c - the quantization-aware-training layer: spec errors, setup of
 * the learned ranges, the forward and every gradient against the float op
 * run on the fake-quantized weight and input (QArray's round trip with the
 * STE's mask, or fq_learned_quant composed by hand), finite differences with
 * the rounding skipped, static input statistics, calibration, conversion to
 * a QLayer that evaluates bit for bit alike, and the arena's steady state. */
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
#include "test_util.h"

/* ---- models, specs, layers --------------------------------------------------------------------------------------- */

static void one_layer_model(Model *m, int ndim, const int *in_shape, const LayerSpec *l, uint64_t seed) {
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(m, ndim, in_shape, l, 1, &err), QT_OK);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    model_init_params(m, &r);
    /* a bias of some size, so a wrong bias path shows */
    Param *b = m->modules[0].bias;
    for (size_t i = 0; b && i < var_numel(&b->var); i++) b->var.value.data[i] = 0.1f * (float)((int)i % 5 - 2);
}

static void dense_model(Model *m, int in, int out, uint64_t seed) {
    one_layer_model(m, 1, (const int[]){in}, &(LayerSpec){.type = LAYER_DENSE, .units = out, .name = "fc1"}, seed);
}

static void conv_model(Model *m, int C, int H, int W, int OC, int k, int stride, int pad, uint64_t seed) {
    LayerSpec l = {.type = LAYER_CONV2D, .out_channels = OC, .kernel = k, .stride = stride, .padding = pad,
                   .name = "conv1"};
    one_layer_model(m, 3, (const int[]){C, H, W}, &l, seed);
}

static QLayerSpec wspec(const char *qt, int tile, QArrayScaleType scale_type) {
    QLayerSpec s = qlayer_spec_default();
    s.weight_qtype = qa_find(qt);
    s.tile_size = tile;
    s.scale_type = scale_type;
    return s;
}

static QatSpec qspec(QatLearn learn, bool act_static) {
    QatSpec q = qat_spec_default();
    q.learn_amax = learn;
    q.act_static_scale = act_static;
    return q;
}

static void init_ok(QatLayer *q, Module *mod, const QLayerSpec *spec, const QatSpec *qs) {
    QtError err = {0};
    QtStatus st = qat_layer_init(q, mod, spec, qs, &err);
    if (st != QT_OK) fprintf(stderr, "\n  qat_layer_init: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

static size_t input_numel(const Module *mod, int N) {
    size_t n = (size_t)N;
    for (int d = 0; d < mod->in_ndim; d++) n *= (size_t)mod->in_shape[d];
    return n;
}

/* x's shape (N, in_shape...) -> xs; returns its ndim. */
static int input_shape(const Module *mod, int N, int xs[4]) {
    xs[0] = N;
    for (int d = 0; d < mod->in_ndim; d++) xs[d + 1] = mod->in_shape[d];
    return mod->in_ndim + 1;
}

static float *copy_floats(const float *src, size_t n) {
    float *d = qa_alloc_floats(n ? n : 1);
    if (src) memcpy(d, src, n * sizeof *d);
    else memset(d, 0, (n ? n : 1) * sizeof *d);
    return d;
}

static void zero(float *g, size_t n) {
    if (g) memset(g, 0, n * sizeof *g);
}

static void zero_grads(QatLayer *q) {
    Module *m = q->module;
    zero(m->weight->var.grad, var_numel(&m->weight->var));
    if (m->bias) zero(m->bias->var.grad, var_numel(&m->bias->var));
    Param *p[2];
    for (int i = 0, n = qat_layer_params(q, p); i < n; i++) zero(p[i]->var.grad, var_numel(&p[i]->var));
}

/* One pass: y and every gradient, copied out. */
typedef struct {
    float *y, *dx, *dw, *db, *dlw, *dla;
    size_t ny, nx, nw, nb, nlw;
} Run;

static void run_free(Run *r) {
    free(r->y), free(r->dx), free(r->dw), free(r->db), free(r->dlw), free(r->dla);
    memset(r, 0, sizeof *r);
}

static const float *range_values(const FqRange *r) { return r->param.var.value.data; }

/* The QAT layer on x (batch N), then its backward from a fixed random dy when `backward`. */
static void run_qat(QatLayer *q, const float *x, int N, bool training, bool backward, Run *r) {
    Module *mod = q->module;
    TestEnv e;
    test_env_init(&e, 5);
    e.tape.training = training;
    int xs[4], xnd = input_shape(mod, N, xs);
    Var *vx = test_var(&e, x, xnd, xs, true);
    zero_grads(q);
    Var *y = qat_layer_forward(&e.tape, q, vx);
    if (!y) fprintf(stderr, "\n  qat_layer_forward: %s\n", e.tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    memset(r, 0, sizeof *r);
    r->ny = var_numel(y), r->nx = input_numel(mod, N), r->nw = var_numel(&mod->weight->var);
    r->nb = mod->bias ? var_numel(&mod->bias->var) : 0;
    r->nlw = q->w_range.n_channels;
    if (backward) {
        float *dy = qa_normal_sample(77, r->ny);
        CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, dy), QT_OK);
        free(dy);
    }
    r->y = copy_floats(y->value.data, r->ny);
    r->dx = copy_floats(vx->grad, r->nx);
    r->dw = copy_floats(mod->weight->var.grad, r->nw);
    r->db = copy_floats(mod->bias ? mod->bias->var.grad : NULL, r->nb);
    r->dlw = copy_floats(q->w_range.param.var.grad, r->nlw);
    r->dla = copy_floats(q->a_range.param.var.grad, 1);
    test_env_free(&e);
}

/* The reference: the module's float op on leaves holding w and x, through fq_learned_quant with a copy of wr's
 * (ar's) values where given; without, w and x are taken as already fake-quantized. */
typedef struct {
    const float *w;    /* [numel] in the layer's QArray view w_shape */
    const FqRange *wr; /* or NULL */
    const float *x;    /* [N * in] */
    const FqRange *ar; /* or NULL */
} Ref;

static void run_ref(const QatLayer *q, const Ref *ref, int N, Run *r) {
    Module *mod = q->module;
    TestEnv e;
    test_env_init(&e, 5);
    int xs[4], xnd = input_shape(mod, N, xs);
    Var *vw = test_var(&e, ref->w, 2, q->w_shape, true), *w2 = vw, *vlw = NULL, *vla = NULL;
    if (ref->wr) {
        vlw = test_var(&e, range_values(ref->wr), 1, (const int[]){ref->wr->n_channels}, true);
        w2 = fq_learned_quant(&e.tape, vw, vlw, &ref->wr->spec);
    }
    const Tensor *ws = &mod->weight->var.value;
    Var *wq = nn_reshape(&e.tape, w2, ws->ndim, ws->shape);
    Var *vx = test_var(&e, ref->x, xnd, xs, true), *xin = vx;
    if (ref->ar) {
        vla = test_var(&e, range_values(ref->ar), 1, (const int[]){1}, true);
        xin = fq_learned_quant(&e.tape, vx, vla, &ref->ar->spec);
    }
    Var *b = mod->bias ? test_var(&e, mod->bias->var.value.data, 1, mod->bias->var.value.shape, true) : NULL;
    Var *y = mod->spec.type == LAYER_DENSE ? nn_linear(&e.tape, xin, wq, b)
                                           : nn_conv2d(&e.tape, xin, wq, b, mod->spec.stride, mod->spec.padding);
    if (!y) fprintf(stderr, "\n  reference: %s\n", e.tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    memset(r, 0, sizeof *r);
    r->ny = var_numel(y), r->nx = input_numel(mod, N), r->nw = tensor_numel(ws), r->nb = b ? var_numel(b) : 0;
    r->nlw = ref->wr ? (size_t)ref->wr->n_channels : 0;
    float *dy = qa_normal_sample(77, r->ny);
    CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, dy), QT_OK);
    free(dy);
    r->y = copy_floats(y->value.data, r->ny);
    r->dx = copy_floats(vx->grad, r->nx);
    r->dw = copy_floats(vw->grad, r->nw);
    r->db = copy_floats(b ? b->grad : NULL, r->nb);
    r->dlw = copy_floats(vlw ? vlw->grad : NULL, r->nlw);
    r->dla = copy_floats(vla ? vla->grad : NULL, 1);
    test_env_free(&e);
}

/* qarray_quantize -> qarray_dequantize of x [numel] into a malloc'd array; *qa keeps the QArray (for its scales). */
static float *qarray_round_trip(const float *x, int ndim, const int *shape, const QType *t, const QArrayOptions *o,
                                QArray *qa) {
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qarray_quantize(qa, x, ndim, shape, t, o, &err), QT_OK);
    float *y = qa_alloc_floats(qa->numel);
    qarray_dequantize(qa, y);
    return y;
}

/* g [n] with the clipped STE's mask of x under qa applied: element i passes where x / s lies in the
 * representable range [qmin - zp, qmax - zp] of its slice (QArray's rows of w_shape[1] or of the tensor). */
static void apply_mask(float *g, const float *x, size_t n, const QArray *qa) {
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
    QLayerSpec s = wspec(c->qt, c->tile, c->scale_type);
    s.double_quant = c->dq, s.symmetric = !c->asym, s.narrow_range = c->narrow;
    if (c->asym) s.weight_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
    if (c->act_qt) s.act_qtype = qa_find(c->act_qt);
    s.act_symmetric = !c->act_asym;
    *qs = qspec(c->learn, c->act_static);
    if (c->bad_init) qs->amax_init.s = -1.0;
    return s;
}

static void test_check_errors(void) {
    Model m;
    dense_model(&m, 32, 7, 61); /* 224 weights */
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
    dense_model(&m, 20, 6, 1);
    Module *mod = &m.modules[0];
    const float *w = mod->weight->var.value.data;
    QLayerSpec spec = wspec("int8", 0, QARRAY_SCALE_POF2);
    spec.act_qtype = qa_find("int8");
    QatSpec qs = qspec(QAT_LEARN_TQT, false);
    QatLayer q;
    init_ok(&q, mod, &spec, &qs);
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
        CU_ASSERT_DOUBLE_EQUAL(range_values(&q.w_range)[o], log2(amax), 1e-6);
    }
    CU_ASSERT(!q.ranges_ready); /* the input's comes from calibration */
    qat_layer_install(&q);
    CU_ASSERT(mod->hook_ctx == &q && mod->forward_hook != NULL);
    qat_layer_free(&q);

    /* lsq per tensor, no input: one parameter, s = amax / p; ready after init_ranges */
    spec = wspec("int4", 0, QARRAY_SCALE_F32);
    spec.per_tensor = true;
    qs = qspec(QAT_LEARN_LSQ, false);
    init_ok(&q, mod, &spec, &qs);
    CU_ASSERT_EQUAL_FATAL(qat_layer_params(&q, p), 1);
    CU_ASSERT_STRING_EQUAL(p[0]->name, "fc1/weight/step_size");
    CU_ASSERT_EQUAL(q.w_range.n_channels, 1);
    CU_ASSERT_EQUAL_FATAL(qat_layer_init_ranges(&q, &err), QT_OK);
    CU_ASSERT_DOUBLE_EQUAL(range_values(&q.w_range)[0], qa_abs_max(w, 120) / 7.0, 1e-7);
    CU_ASSERT(q.ranges_ready);
    qat_layer_free(&q);

    /* no learned range: no parameters, init_ranges does nothing */
    spec = wspec("int4", 8, QARRAY_SCALE_F32);
    qs = qspec(QAT_LEARN_NONE, false);
    init_ok(&q, mod, &spec, &qs);
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
    size_t nw = var_numel(&mod->weight->var), nx = input_numel(mod, N);
    float *x = qa_normal_sample(seed, nx);
    QArray qw, qx = {0};
    float *wq = qarray_round_trip(w, q->w_ndim, q->w_shape, q->spec.weight_qtype, &q->w_options, &qw), *xq = x;
    if (q->spec.act_qtype) { /* per tensor */
        QArrayOptions ao = {.calib = &q->spec.act_calib,
                            .range = q->spec.act_symmetric ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC};
        xq = qarray_round_trip(x, 1, (const int[]){(int)nx}, q->spec.act_qtype, &ao, &qx);
    }
    Run a, b;
    run_qat(q, x, N, true, true, &a);
    run_ref(q, &(Ref){.w = wq, .x = xq}, N, &b);
    apply_mask(b.dw, w, nw, &qw);
    if (q->spec.act_qtype) apply_mask(b.dx, x, nx, &qx);
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
    run_free(&a), run_free(&b);
    qarray_free(&qw), qarray_free(&qx);
    if (xq != x) free(xq);
    free(wq), free(x);
}

static void test_forward_dynamic(void) {
    Model dm, cm;
    dense_model(&dm, 24, 10, 11);
    conv_model(&cm, 4, 6, 6, 8, 3, 2, 1, 12); /* fan_in 36: blocks of 16 run across output channels */
    QatLayer q;
    QatSpec qs = qspec(QAT_LEARN_NONE, false);

    QLayerSpec spec = wspec("int8", 0, QARRAY_SCALE_F32);
    init_ok(&q, &dm.modules[0], &spec, &qs);
    check_dynamic(&q, 5, 13, "dense int8 per channel");
    qat_layer_free(&q);
    init_ok(&q, &cm.modules[0], &spec, &qs);
    check_dynamic(&q, 2, 14, "conv int8 per channel");
    qat_layer_free(&q);

    spec = wspec("int4", 16, QARRAY_SCALE_F32);
    init_ok(&q, &cm.modules[0], &spec, &qs);
    CU_ASSERT(q.w_shape[0] == 8 * 36 / 16 && q.w_shape[1] == 16);
    check_dynamic(&q, 2, 15, "conv int4 blocks of 16");
    qat_layer_free(&q);
    init_ok(&q, &dm.modules[0], &spec, &qs);
    check_dynamic(&q, 3, 16, "dense int4 blocks of 16");
    qat_layer_free(&q);

    /* uint8 asymmetric input, calibrated per batch (minmax of normal data: a zero point inside the codes) */
    spec = wspec("int8", 0, QARRAY_SCALE_F32);
    spec.act_qtype = qa_find("uint8");
    spec.act_symmetric = false;
    spec.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 0.8}; /* some of x clips */
    init_ok(&q, &dm.modules[0], &spec, &qs);
    check_dynamic(&q, 4, 17, "dense int8, uint8 asymmetric input");
    qat_layer_free(&q);
    model_free(&dm);
    model_free(&cm);
}

/* ---- gradients: learned ranges ----------------------------------------------------------------------------------- */

/* The layer against the float op on fq_learned_quant of w and x (the same ranges): everything bit for bit. */
static void check_learned(QatLayer *q, int N, uint64_t seed, const char *what) {
    size_t nx = input_numel(q->module, N);
    float *x = qa_normal_sample(seed, nx);
    for (size_t i = 0; i < nx; i++) x[i] *= 1.5f; /* beyond the calibrated range here and there */
    Run a, b;
    run_qat(q, x, N, true, true, &a);
    Ref ref = {.w = q->module->weight->var.value.data, .wr = &q->w_range, .x = x,
               .ar = q->a_range.param.var.value.data ? &q->a_range : NULL};
    run_ref(q, &ref, N, &b);
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
    run_free(&a), run_free(&b);
    free(x);
}

/* Initialises the ranges: the weight's from the weight, the input's from one calibration batch. */
static void ranges_ok(QatLayer *q, const float *x, int N) {
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qat_layer_init_ranges(q, &err), QT_OK);
    qat_layer_calib_begin(q);
    Run r;
    run_qat(q, x, N, false, false, &r);
    run_free(&r);
    QtStatus st = qat_layer_calib_end(q, &err);
    if (st != QT_OK) fprintf(stderr, "\n  calib_end: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

static void test_gradients_learned(void) {
    Model dm, cm;
    dense_model(&dm, 24, 10, 21);
    conv_model(&cm, 3, 5, 5, 6, 3, 1, 1, 22);
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
        QLayerSpec spec = wspec(cases[i].wq, 0, cases[i].learn == QAT_LEARN_TQT ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
        spec.per_tensor = cases[i].per_tensor;
        if (cases[i].aq) spec.act_qtype = qa_find(cases[i].aq);
        QatSpec qs = qspec(cases[i].learn, false);
        QatLayer q;
        init_ok(&q, mod, &spec, &qs);
        float *x = qa_normal_sample(23 + i, input_numel(mod, cases[i].N));
        ranges_ok(&q, x, cases[i].N);
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
    Run r;
    run_qat(q, x, N, false, false, &r);
    double L = 0.0;
    for (size_t i = 0; i < r.ny; i++) L += (double)r.y[i] * R[i];
    run_free(&r);
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
    dense_model(&m, IN, OUT, 31);
    Module *mod = &m.modules[0];
    QLayerSpec spec = wspec("int4", 0, learn == QAT_LEARN_TQT ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
    spec.per_tensor = true;
    spec.act_qtype = qa_find("int4");
    QatSpec qs = qspec(learn, false);
    QatLayer q;
    init_ok(&q, mod, &spec, &qs);
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
    Run a;
    run_qat(&q, x, N, true, true, &a); /* dy = qa_normal_sample(77): R below */
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
    run_free(&a);
    free(R), free(w0), free(x);
    qat_layer_free(&q);
    model_free(&m);
}

static void test_gradients_fd(void) {
    check_fd(QAT_LEARN_TQT, 0.0f, 1.0f);    /* s = 1/8 and 1/4 */
    check_fd(QAT_LEARN_LSQ, 0.11f, 0.23f);
}

/* ---- static input statistics ------------------------------------------------------------------------------------- */

/* x [n] fake-quantized over the range [lo, hi] as a uint8 with a zero point, the codes written out:
 * (clamp(rne(x / s), -zp, 255 - zp) + 0) s with qarray.h's scale and zero point. */
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
    float *wq = qarray_round_trip(q->module->weight->var.value.data, 2, q->w_shape, q->spec.weight_qtype,
                                  &q->w_options, &qw);
    Run a, b;
    run_qat(q, x, N, training, true, &a);
    run_ref(q, &(Ref){.w = wq, .x = xq}, N, &b);
    CU_ASSERT(fq_test_same_bits(a.y, b.y, a.ny, what));
    run_free(&a), run_free(&b);
    qarray_free(&qw);
    free(wq);
}

static void test_static_input(void) {
    enum { IN = 16, OUT = 5, N = 4, NX = N * IN };
    Model m;
    dense_model(&m, IN, OUT, 41);
    QLayerSpec spec = wspec("int8", 0, QARRAY_SCALE_F32);
    spec.act_qtype = qa_find("uint8");
    spec.act_symmetric = false;
    spec.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
    QatSpec qs = qspec(QAT_LEARN_NONE, true);
    QatLayer q;
    init_ok(&q, &m.modules[0], &spec, &qs);
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
    Run r;
    run_qat(&q, x[0], N, false, false, &r);
    run_free(&r);
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
    dense_model(&m, IN, OUT, 51);
    QLayerSpec spec = wspec("int8", 0, learn == QAT_LEARN_TQT ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
    spec.act_qtype = qa_find("int8");
    QatSpec qs = qspec(learn, false);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(calib_parse(amax_init, &qs.amax_init, &err), QT_OK);
    QatLayer q;
    init_ok(&q, &m.modules[0], &spec, &qs);
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
        Run a, b;
        run_qat(&q, x, N, false, true, &a);
        run_ref(&q, &(Ref){.w = m.modules[0].weight->var.value.data, .wr = &q.w_range, .x = x}, N, &b);
        CU_ASSERT(fq_test_same_bits(a.y, b.y, a.ny, "calibrating y"));
        CU_ASSERT(fq_test_same_bits(a.dx, b.dx, a.nx, "calibrating dx"));
        run_free(&a), run_free(&b);
    }
    CU_ASSERT_EQUAL_FATAL(qat_layer_calib_end(&q, &err), QT_OK);
    CU_ASSERT(!q.calibrating && q.ranges_ready && q.act_stats.count == 3);
    double t = tsum / 3, v = range_values(&q.a_range)[0];
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

/* ---- convert ----------------------------------------------------------------------------------------------------- */

/* A few steps of plain SGD on the weight and the ranges, so that neither is where it started. */
static void train_steps(QatLayer *q, const float *x, int N, int steps) {
    Param *p[2];
    int np = qat_layer_params(q, p);
    Param *w = q->module->weight;
    for (int s = 0; s < steps; s++) {
        Run r;
        run_qat(q, x, N, true, true, &r);
        run_free(&r);
        for (size_t i = 0; i < var_numel(&w->var); i++) w->var.value.data[i] -= 0.05f * w->var.grad[i];
        for (int k = 0; k < np; k++) {
            float lr = q->qat.learn_amax == QAT_LEARN_TQT ? 0.01f : 1e-4f;
            for (size_t i = 0; i < var_numel(&p[k]->var); i++) p[k]->var.value.data[i] -= lr * p[k]->var.grad[i];
        }
    }
}

/* The fake-quantized weight the QAT forward uses, in the QArray view: QArray's round trip or fq_learned_quant. */
static float *qat_weight(const QatLayer *q) {
    const float *w = q->module->weight->var.value.data;
    size_t n = var_numel(&q->module->weight->var);
    if (!q->w_range.param.var.value.data) {
        QArray qa;
        float *y = qarray_round_trip(w, q->w_ndim, q->w_shape, q->spec.weight_qtype, &q->w_options, &qa);
        qarray_free(&qa);
        return y;
    }
    TestEnv e;
    test_env_init(&e, 3);
    Var *vw = test_var(&e, w, 2, q->w_shape, false);
    Var *vr = test_var(&e, range_values(&q->w_range), 1, (const int[]){q->w_range.n_channels}, false);
    Var *y = fq_learned_quant(&e.tape, vw, vr, &q->w_range.spec);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    float *out = copy_floats(y->value.data, n);
    test_env_free(&e);
    return out;
}

/* The converted layer evaluates x exactly as the QAT layer does in eval; its weight is the fake-quantized one,
 * its scales those of the learned range in their type, its input scale the learned one. */
static void check_convert(QatLayer *q, const float *x, int N, const char *what) {
    QLayer ql;
    QtError err = {0};
    QtStatus st = qat_layer_convert(q, &ql, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s: convert: %s\n", what, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT(ql.module == q->module && ql.act_ready == (q->spec.act_qtype != NULL));
    size_t nw = var_numel(&q->module->weight->var);
    float *deq = qa_alloc_floats(nw), *fq = qat_weight(q);
    qlayer_dequantize_weight(&ql, deq);
    char label[128];
    snprintf(label, sizeof label, "%s weight", what);
    CU_ASSERT(fq_test_same_bits(deq, fq, nw, label));
    const FqRange *wr = &q->w_range, *ar = &q->a_range;
    if (wr->param.var.value.data) {
        bool tqt = q->qat.learn_amax == QAT_LEARN_TQT;
        CU_ASSERT_EQUAL(ql.weight.scale_type, tqt ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
        CU_ASSERT_EQUAL_FATAL(ql.weight.n_scales, (size_t)wr->n_channels);
        for (int c = 0; c < wr->n_channels; c++)
            CU_ASSERT(qarray_scale_at(&ql.weight, (size_t)c) == fq_range_scale(&wr->spec, range_values(wr)[c]));
    }
    if (ar->param.var.value.data)
        CU_ASSERT(ql.act_scale == fq_range_scale(&ar->spec, range_values(ar)[0]) && ql.act_zero_point == 0.0f);
    /* eval of both */
    Run a;
    run_qat(q, x, N, false, false, &a);
    TestEnv e;
    test_env_init(&e, 4);
    int xs[4], xnd = input_shape(q->module, N, xs);
    Var *y = qlayer_forward(&e.tape, &ql, test_var(&e, x, xnd, xs, false));
    if (!y) fprintf(stderr, "\n  %s: qlayer_forward: %s\n", what, e.tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    snprintf(label, sizeof label, "%s y", what);
    CU_ASSERT(fq_test_same_bits(y->value.data, a.y, a.ny, label));
    test_env_free(&e);
    run_free(&a);
    free(deq), free(fq);
    qlayer_free(&ql);
}

typedef struct {
    bool conv;
    const char *wq;
    int tile;
    bool per_tensor;
    const char *aq;
    bool act_asym;
    QatLearn learn;
} ConvertCase;

static const ConvertCase CONVERT_CASES[] = {
    /* (a) calibrated weight, static input */
    {false, "int8", 0, false, "uint8", true, QAT_LEARN_NONE},
    {true, "int4", 16, false, "int8", false, QAT_LEARN_NONE},
    {true, "nf4", 0, false, "fp8_e4m3", false, QAT_LEARN_NONE},
    /* (b) tqt weight and input, pof2 scales */
    {false, "int8", 0, false, "int8", false, QAT_LEARN_TQT},
    {true, "int4", 0, true, "uint8", false, QAT_LEARN_TQT},
    {true, "uint8", 0, false, "int4", false, QAT_LEARN_TQT},
    /* (c) lsq */
    {false, "int4", 0, false, "uint8", false, QAT_LEARN_LSQ},
    {true, "int8", 0, true, "int8", false, QAT_LEARN_LSQ},
    {true, "uint4", 0, false, NULL, false, QAT_LEARN_LSQ},
};

static void test_convert(void) {
    Model dm, cm;
    dense_model(&dm, 24, 10, 61);
    conv_model(&cm, 4, 6, 6, 8, 3, 1, 1, 62); /* fan_in 36, 288 weights */
    for (size_t i = 0; i < sizeof CONVERT_CASES / sizeof CONVERT_CASES[0]; i++) {
        const ConvertCase *c = &CONVERT_CASES[i];
        Module *mod = c->conv ? &cm.modules[0] : &dm.modules[0];
        int N = c->conv ? 2 : 5;
        QLayerSpec spec = wspec(c->wq, c->tile, c->learn == QAT_LEARN_TQT ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
        spec.per_tensor = c->per_tensor;
        if (c->aq) spec.act_qtype = qa_find(c->aq);
        spec.act_symmetric = !c->act_asym;
        if (c->act_asym) spec.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
        QatSpec qs = qspec(c->learn, c->learn == QAT_LEARN_NONE && c->aq);
        /* the weights are trained below; start each case from the same ones */
        size_t nw = var_numel(&mod->weight->var);
        float *w0 = copy_floats(mod->weight->var.value.data, nw);
        QatLayer q;
        init_ok(&q, mod, &spec, &qs);
        float *x = qa_normal_sample(63 + i, input_numel(mod, N));
        for (size_t k = 0; c->act_asym && k < input_numel(mod, N); k++) x[k] += 0.8f; /* a zero point not 0 */
        ranges_ok(&q, x, N);
        train_steps(&q, x, N, 3);
        for (size_t k = 0; k < input_numel(mod, N); k++) x[k] *= 1.5f; /* some of it beyond the range */
        char what[96];
        snprintf(what, sizeof what, "%s %s %s%s, input %s", mod->path, qat_learn_name(c->learn), c->wq,
                 c->per_tensor ? " per tensor" : "", c->aq ? c->aq : "float");
        check_convert(&q, x, N, what);
        qat_layer_free(&q);
        memcpy(mod->weight->var.value.data, w0, nw * sizeof(float));
        free(w0), free(x);
    }
    model_free(&dm);
    model_free(&cm);
}

/* A dynamic input range has no frozen equivalent; without an act_qtype the weight alone converts. */
static void test_convert_dynamic_input(void) {
    Model m;
    dense_model(&m, 12, 4, 71);
    QLayerSpec spec = wspec("int8", 0, QARRAY_SCALE_F32);
    spec.act_qtype = qa_find("int8");
    QatSpec qs = qspec(QAT_LEARN_NONE, false);
    QatLayer q;
    init_ok(&q, &m.modules[0], &spec, &qs);
    QLayer ql;
    memset(&ql, 0x5a, sizeof ql);
    QtError err = {0};
    CU_ASSERT_EQUAL(qat_layer_convert(&q, &ql, &err), QT_ERR_CONFIG);
    CU_ASSERT(strncmp(err.msg, "fc1: ", 5) == 0);
    CU_ASSERT(test_msg_has(&err, "act_static_scale") && test_msg_has(&err, "learn_amax"));
    CU_ASSERT(ql.module == NULL && ql.weight.codes == NULL);
    qat_layer_free(&q);
    spec.act_qtype = NULL;
    init_ok(&q, &m.modules[0], &spec, &qs);
    float *x = qa_normal_sample(72, 36);
    check_convert(&q, x, 3, "fc1 int8, no input format");
    free(x);
    qat_layer_free(&q);
    model_free(&m);
}

/* QLayer's static input op (fq_fake_quant, symmetric, one scale) and fq_learned_quant are one function for one
 * scale: both clamp a signed int to [-2^(b-1), 2^(b-1) - 1] and a uint to [0, 2^b - 1] (the learned op has no
 * narrow range, nor does QLayer's input), round ties to even and give code 0 as +0. */
static void test_input_ops_agree(void) {
    const char *fmts[] = {"int8", "int4", "uint8", "uint4"};
    for (int f = 0; f < 4; f++) {
        const QType *t = qa_find(fmts[f]);
        int n = t->kind == QTYPE_KIND_UINT ? 0 : t->qmin, p = t->qmax;
        for (int kind = 0; kind < 2; kind++) {
            FqRangeSpec rs = {.kind = kind ? FQ_RANGE_LSQ : FQ_RANGE_TQT, .qtype = t};
            float param = kind ? 0.0371f : 0.3f, s = fq_range_scale(&rs, param);
            enum { MAXN = 5 * 270 + 2 };
            float x[MAXN];
            int nx = 0;
            static const float D[5] = {-0.5f, -0.25f, 0.0f, 0.25f, 0.5f}; /* ties and between */
            for (int k = n - 3; k <= p + 3; k++)
                for (int d = 0; d < 5; d++) x[nx++] = ((float)k + D[d]) * s;
            x[nx++] = -0.0f;
            x[nx++] = -0.1f * s;
            TestEnv e;
            test_env_init(&e, 81);
            Var *vx = test_var(&e, x, 1, (const int[]){nx}, false);
            Var *vp = test_var(&e, &param, 1, (const int[]){1}, false);
            Var *vs = tape_new_var(&e.tape, 1, (const int[]){1});
            vs->value.data[0] = s;
            FakeQuantSpec fs = {.qtype = t, .range = QARRAY_RANGE_SYMMETRIC, .ste = FQ_STE_CLIPPED};
            Var *y1 = fq_learned_quant(&e.tape, vx, vp, &rs), *y2 = fq_fake_quant(&e.tape, vx, &fs, vs, NULL);
            CU_ASSERT_FATAL(y1 && y2);
            char what[64];
            snprintf(what, sizeof what, "%s %s input", fmts[f], kind ? "lsq" : "tqt");
            CU_ASSERT(fq_test_same_bits(y1->value.data, y2->value.data, (size_t)nx, what));
            test_env_free(&e);
        }
    }
}

/* ---- a model of QAT layers: the arena's steady state ------------------------------------------------------------- */

static void test_steady_state(void) {
    enum { N = 4, C = 2, H = 6, W = 6, OC = 4, CLASSES = 10 };
    LayerSpec ls[3] = {{.type = LAYER_CONV2D, .out_channels = OC, .kernel = 3, .padding = 1},
                       {.type = LAYER_FLATTEN},
                       {.type = LAYER_DENSE, .units = CLASSES}};
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (const int[]){C, H, W}, ls, 3, &err), QT_OK);
    Rng r;
    rng_init(&r, 91, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    QLayerSpec cs = wspec("int8", 0, QARRAY_SCALE_POF2);
    cs.act_qtype = qa_find("int8");
    QLayerSpec ds = wspec("int4", 16, QARRAY_SCALE_F32); /* 144 x 10 in blocks of 16 */
    ds.act_qtype = qa_find("uint8");
    ds.act_symmetric = false;
    ds.act_calib = (CalibSpec){.kind = CALIB_PERCENTILE, .s = 1.0, .p = 99.0}; /* needs workspace */
    QatSpec cq = qspec(QAT_LEARN_TQT, false), dq = qspec(QAT_LEARN_NONE, true);
    QatLayer q[2];
    Module *mods[2] = {&m.modules[0], &m.modules[2]};
    init_ok(&q[0], mods[0], &cs, &cq);
    init_ok(&q[1], mods[1], &ds, &dq);
    for (int i = 0; i < 2; i++) {
        qat_layer_install(&q[i]);
        CU_ASSERT_EQUAL(qat_layer_init_ranges(&q[i], &err), QT_OK);
    }
    Arena a;
    Tape t;
    CU_ASSERT_FATAL(arena_init(&a, 4096) == 0);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, NULL, NULL), QT_OK);
    float *x = qa_normal_sample(92, N * C * H * W), *dy = qa_normal_sample(93, N * CLASSES);
    const int xs[4] = {N, C, H, W};
    for (int i = 0; i < 2; i++) qat_layer_calib_begin(&q[i]);
    t.grad_enabled = false;
    for (int b = 0; b < 2; b++) {
        tape_reset(&t);
        CU_ASSERT_PTR_NOT_NULL(model_forward(&m, &t, tape_wrap(&t, x, 4, xs)));
    }
    t.grad_enabled = true;
    for (int i = 0; i < 2; i++) CU_ASSERT_EQUAL_FATAL(qat_layer_calib_end(&q[i], &err), QT_OK);
    CU_ASSERT(q[0].ranges_ready && q[1].act_stats.count == 2);
    size_t grows = 0, cap = 0;
    t.training = true;
    for (int step = 0; step < 5; step++) {
        tape_reset(&t);
        Var *vx = tape_new_var(&t, 4, xs);
        CU_ASSERT_FATAL(vx != NULL);
        memcpy(vx->value.data, x, sizeof(float) * N * C * H * W);
        vx->requires_grad = true;
        Var *y = model_forward(&m, &t, vx);
        if (!y) fprintf(stderr, "\n  model_forward: %s\n", t.err.msg);
        CU_ASSERT_FATAL(y != NULL);
        CU_ASSERT_EQUAL_FATAL(tape_backward_from(&t, y, dy), QT_OK);
        if (step == 1) grows = a.grow_count, cap = t.cap_nodes;
    }
    CU_ASSERT(grows > 0);
    CU_ASSERT_EQUAL(a.grow_count, grows);
    CU_ASSERT_EQUAL(t.cap_nodes, cap);
    CU_ASSERT_EQUAL(q[1].act_stats.count, 7);
    /* the float weights and both ranges trained */
    CU_ASSERT(qa_abs_max(mods[0]->weight->var.grad, 72) > 0.0f && qa_abs_max(mods[1]->weight->var.grad, 1440) > 0.0f);
    CU_ASSERT(q[0].w_range.param.var.grad[0] != 0.0f && q[0].a_range.param.var.grad[0] != 0.0f);
    free(x), free(dy);
    tape_free(&t);
    arena_free(&a);
    qat_layer_free(&q[0]), qat_layer_free(&q[1]);
    model_free(&m);
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
           !CU_add_test(s, "calibration of learned input ranges", test_calib_learned) ||
           !CU_add_test(s, "convert", test_convert) ||
           !CU_add_test(s, "convert: dynamic input", test_convert_dynamic_input) ||
           !CU_add_test(s, "static and learned input ops agree", test_input_ops_agree) ||
           !CU_add_test(s, "steady state", test_steady_state);
}
