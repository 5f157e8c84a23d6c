/* test_qat_convert.c - QAT layers converted to PTQ layers evaluate bit for
 * bit as they trained; the static and learned input ops agree; a model of
 * QAT layers reaches the arena's steady state. Part of the quant_qat suite. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/ops.h"
#include "quant/fakequant.h"
#include "quant/qat.h"
#include "quant/qarray_io.h"
#include "test_fakequant.h"
#include "test_qarray.h"
#include "test_qat.h"
#include "test_util.h"

/* ---- convert ----------------------------------------------------------------------------------------------------- */

/* A few steps of plain SGD on the weight and the ranges, so that neither is where it started. */
static void train_steps(QatLayer *q, const float *x, int N, int steps) {
    Param *p[2];
    int np = qat_layer_params(q, p);
    Param *w = q->module->weight;
    for (int s = 0; s < steps; s++) {
        QtestRun r;
        qtest_run_qat(q, x, N, true, true, &r);
        qtest_run_free(&r);
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
        float *y = qtest_qarray_round_trip(w, q->w_ndim, q->w_shape, q->spec.weight_qtype, &q->w_options, &qa);
        qarray_free(&qa);
        return y;
    }
    TestEnv e;
    test_env_init(&e, 3);
    Var *vw = test_var(&e, w, 2, q->w_shape, false);
    Var *vr = test_var(&e, qtest_range_values(&q->w_range), 1, (const int[]){q->w_range.n_channels}, false);
    Var *y = fq_learned_quant(&e.tape, vw, vr, &q->w_range.spec);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    float *out = qtest_copy_floats(y->value.data, n);
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
            CU_ASSERT(qarray_scale_at(&ql.weight, (size_t)c) == fq_range_scale(&wr->spec, qtest_range_values(wr)[c]));
    }
    if (ar->param.var.value.data)
        CU_ASSERT(ql.act_scale == fq_range_scale(&ar->spec, qtest_range_values(ar)[0]) && ql.act_zero_point == 0.0f);
    /* eval of both */
    QtestRun a;
    qtest_run_qat(q, x, N, false, false, &a);
    TestEnv e;
    test_env_init(&e, 4);
    int xs[4], xnd = qtest_input_shape(q->module, N, xs);
    Var *y = qlayer_forward(&e.tape, &ql, test_var(&e, x, xnd, xs, false));
    if (!y) fprintf(stderr, "\n  %s: qlayer_forward: %s\n", what, e.tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    snprintf(label, sizeof label, "%s y", what);
    CU_ASSERT(fq_test_same_bits(y->value.data, a.y, a.ny, label));
    test_env_free(&e);
    qtest_run_free(&a);
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
    qtest_dense_model(&dm, 24, 10, 61);
    qtest_conv_model(&cm, 4, 6, 6, 8, 3, 1, 1, 62); /* fan_in 36, 288 weights */
    for (size_t i = 0; i < sizeof CONVERT_CASES / sizeof CONVERT_CASES[0]; i++) {
        const ConvertCase *c = &CONVERT_CASES[i];
        Module *mod = c->conv ? &cm.modules[0] : &dm.modules[0];
        int N = c->conv ? 2 : 5;
        QLayerSpec spec = qtest_wspec(c->wq, c->tile, c->learn == QAT_LEARN_TQT ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
        spec.per_tensor = c->per_tensor;
        if (c->aq) spec.act_qtype = qa_find(c->aq);
        spec.act_symmetric = !c->act_asym;
        if (c->act_asym) spec.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
        QatSpec qs = qtest_qspec(c->learn, c->learn == QAT_LEARN_NONE && c->aq);
        /* the weights are trained below; start each case from the same ones */
        size_t nw = var_numel(&mod->weight->var);
        float *w0 = qtest_copy_floats(mod->weight->var.value.data, nw);
        QatLayer q;
        qtest_init_ok(&q, mod, &spec, &qs);
        float *x = qa_normal_sample(63 + i, qtest_input_numel(mod, N));
        for (size_t k = 0; c->act_asym && k < qtest_input_numel(mod, N); k++) x[k] += 0.8f; /* a qtest_zero point not 0 */
        qtest_ranges_ok(&q, x, N);
        train_steps(&q, x, N, 3);
        for (size_t k = 0; k < qtest_input_numel(mod, N); k++) x[k] *= 1.5f; /* some of it beyond the range */
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
    qtest_dense_model(&m, 12, 4, 71);
    QLayerSpec spec = qtest_wspec("int8", 0, QARRAY_SCALE_F32);
    spec.act_qtype = qa_find("int8");
    QatSpec qs = qtest_qspec(QAT_LEARN_NONE, false);
    QatLayer q;
    qtest_init_ok(&q, &m.modules[0], &spec, &qs);
    QLayer ql;
    memset(&ql, 0x5a, sizeof ql);
    QtError err = {0};
    CU_ASSERT_EQUAL(qat_layer_convert(&q, &ql, &err), QT_ERR_CONFIG);
    CU_ASSERT(strncmp(err.msg, "fc1: ", 5) == 0);
    CU_ASSERT(test_msg_has(&err, "act_static_scale") && test_msg_has(&err, "learn_amax"));
    CU_ASSERT(ql.module == NULL && ql.weight.codes == NULL);
    qat_layer_free(&q);
    spec.act_qtype = NULL;
    qtest_init_ok(&q, &m.modules[0], &spec, &qs);
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
    Model m;
    QtError err = {0};
    test_small_cnn(&m, 91);
    QLayerSpec cs = qtest_wspec("int8", 0, QARRAY_SCALE_POF2);
    cs.act_qtype = qa_find("int8");
    QLayerSpec ds = qtest_wspec("int4", 16, QARRAY_SCALE_F32); /* 144 x 10 in blocks of 16 */
    ds.act_qtype = qa_find("uint8");
    ds.act_symmetric = false;
    ds.act_calib = (CalibSpec){.kind = CALIB_PERCENTILE, .s = 1.0, .p = 99.0}; /* needs workspace */
    QatSpec cq = qtest_qspec(QAT_LEARN_TQT, false), dq = qtest_qspec(QAT_LEARN_NONE, true);
    QatLayer q[2];
    Module *mods[2] = {&m.modules[0], &m.modules[2]};
    qtest_init_ok(&q[0], mods[0], &cs, &cq);
    qtest_init_ok(&q[1], mods[1], &ds, &dq);
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
    t.training = true;
    test_assert_steady_steps(&m, &t, &a, x, dy, 5);
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

int qat_convert_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "convert", test_convert) ||
           !CU_add_test(s, "convert: dynamic input", test_convert_dynamic_input) ||
           !CU_add_test(s, "static and learned input ops agree", test_input_ops_agree) ||
           !CU_add_test(s, "steady state", test_steady_state);
}
