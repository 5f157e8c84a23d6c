/* test_qat_bn.c - QAT of batch-norm models in the folded form (torch.ao's
 * ConvBn modules; qat_layer_fold_bn), layer by layer: nn_chscale's
 * gradients; finite differences of a conv2d/dense + batch norm in training
 * with the weight's fake quant reduced to its clamp; the eval form equals the
 * layer with bn_fold_into's weight and shift; freezing stops the statistics;
 * PyTorch parity (tests/fixtures/torch_qatbn.h5). Whole runs (fold rules,
 * convert, quant.freeze_bn_after, resume, the folded_bn markers) are
 * test_qat_bn_runs.c. */
#include <CUnit/CUnit.h>
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/ops.h"
#include "nn/ops_chscale.h"
#include "quant/qat.h"
#include "test_fakequant.h"
#include "test_qarray.h"
#include "test_qat.h"
#include "test_util.h"
#include "trainer/bn_fold.h"
#include "trainer/checkpoint.h"
#include "base/h5io.h"
#include "trainer/net.h"
#include "trainer/tools.h"

/* ---- the op ------------------------------------------------------------------------------------------------------ */

typedef struct {
    int axis;
    bool divide;
} ChCase;

static Var *chscale_fn(Tape *t, Var **in, void *ctx) {
    const ChCase *c = ctx;
    return nn_chscale(t, in[0], in[1], c->axis, c->divide);
}

/* x (2, 3, 4) scaled along each axis, multiplied and divided: both gradients by finite differences; a scale that
 * does not match the axis is a shape error. */
static void test_chscale(void) {
    float *x = qa_normal_sample(11, 24), s[4] = {0.7f, -1.3f, 2.1f, 0.9f};
    for (int axis = 0; axis < 3; axis++)
        for (int d = 0; d < 2; d++) {
            ChCase c = {axis, d == 1};
            const int dims[3] = {2, 3, 4};
            GradcheckInput in[2] = {{x, 3, {2, 3, 4}, true}, {s, 1, {dims[axis]}, true}};
            char name[48];
            snprintf(name, sizeof name, "chscale axis %d %s", axis, c.divide ? "divide" : "multiply");
            CU_ASSERT(gradcheck(name, chscale_fn, &c, in, 2, 1e-3, 2e-3, 1e-2));
        }
    TestEnv e;
    test_env_init(&e, 1);
    Var *vx = test_var(&e, x, 3, (const int[]){2, 3, 4}, false), *vs = test_var(&e, s, 1, (const int[]){4}, false);
    Var *y = nn_chscale(&e.tape, vx, vs, 2, false);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    CU_ASSERT_EQUAL(y->value.data[5], x[5] * s[1]);
    CU_ASSERT_PTR_NULL(nn_chscale(&e.tape, vx, vs, 1, true));
    CU_ASSERT(e.tape.err.status == QT_ERR_SHAPE && test_msg_has(&e.tape.err, "axis 1"));
    test_env_free(&e);
    free(x);
}

/* ---- a layer + batch norm ---------------------------------------------------------------------------------------- */

static LayerSpec spec_of(LayerType type, const char *name) {
    LayerSpec s = {.type = type};
    snprintf(s.name, sizeof s.name, "%s", name);
    if (type == LAYER_BATCHNORM1D || type == LAYER_BATCHNORM2D) s.eps = 1e-5f, s.momentum = 0.1f;
    return s;
}

/* conv2d (2, 5, 5) -> 3 channels, 3x3, padding 1, or dense 6 -> 4; then its batch norm. Running statistics,
 * gamma and beta away from their start. */
static void bn_model(Model *m, bool conv, bool bias, uint64_t seed) {
    LayerSpec l[2] = {spec_of(conv ? LAYER_CONV2D : LAYER_DENSE, conv ? "conv1" : "fc1"),
                      spec_of(conv ? LAYER_BATCHNORM2D : LAYER_BATCHNORM1D, "bn1")};
    if (conv) l[0].out_channels = 3, l[0].kernel = 3, l[0].stride = 1, l[0].padding = 1;
    else l[0].units = 4;
    l[0].no_bias = !bias;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(m, conv ? 3 : 1, conv ? (const int[]){2, 5, 5} : (const int[]){6}, l, 2, &err),
                          QT_OK);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    model_init_params(m, &r);
    Module *b = &m->modules[1];
    int C = b->in_shape[0];
    rng_fill_uniform(&r, b->running_mean, (size_t)C, -0.5f, 0.5f);
    rng_fill_uniform(&r, b->running_var, (size_t)C, 0.3f, 2.0f);
    rng_fill_uniform(&r, b->weight->var.value.data, (size_t)C, 0.5f, 1.5f);
    rng_fill_uniform(&r, b->bias->var.value.data, (size_t)C, -1.0f, 1.0f);
    for (int c = 0; bias && c < C; c++) m->modules[0].bias->var.value.data[c] = 0.2f * (float)(c - 1);
}

/* A QAT layer on module 0 with module 1 folded in: weight_qtype wq, learned range learn (none: calibrated). */
static void qat_fold_on(QatLayer *q, Model *m, const char *wq, QatLearn learn) {
    QLayerSpec spec = qtest_wspec(wq, 0, learn == QAT_LEARN_TQT ? QARRAY_SCALE_POF2 : QARRAY_SCALE_F32);
    QatSpec qs = qtest_qspec(learn, false);
    qtest_init_ok(q, &m->modules[0], &spec, &qs);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(qat_layer_fold_bn(q, &m->modules[1], 0, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(qat_layer_init_ranges(q, &err), QT_OK);
    qat_layer_install(q);
}

/* L = sum(y * R) of the model in training from the same running statistics each time (the batch norm updates them
 * on every training forward, and the folded weight reads the running variance). */
static double loss_at(Model *m, const float *x, int N, const float *R, size_t ny, const float *rm, const float *rv) {
    Module *b = &m->modules[1];
    size_t C = (size_t)b->in_shape[0];
    memcpy(b->running_mean, rm, C * sizeof(float));
    memcpy(b->running_var, rv, C * sizeof(float));
    float *y = qa_alloc_floats(ny);
    qtest_run_model(m, x, N, true, NULL, y, ny, NULL);
    double l = 0.0;
    for (size_t i = 0; i < ny; i++) l += (double)y[i] * R[i];
    free(y);
    return l;
}

/* Central differences of L over v[0..n) against the analytic g; false (printing the worst) past 2e-3 + 1e-2 |fd|. */
static bool fd_check(Model *m, const float *x, int N, const float *R, size_t ny, const float *rm, const float *rv,
                     float *v, size_t n, const float *g, const char *what) {
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        float v0 = v[i];
        const double eps = 1e-3;
        v[i] = (float)(v0 + eps);
        double lp = loss_at(m, x, N, R, ny, rm, rv);
        v[i] = (float)(v0 - eps);
        double lm = loss_at(m, x, N, R, ny, rm, rv);
        v[i] = v0;
        double fd = (lp - lm) / (2 * eps);
        if (fabs(fd - g[i]) > 2e-3 + 1e-2 * fabs(fd)) {
            fprintf(stderr, "\n  %s[%zu]: analytic %.6g, finite differences %.6g\n", what, i, (double)g[i], fd);
            ok = false;
        }
    }
    return ok;
}

/* The folded QAT form in training (batch statistics) has the gradients of its function, checked by finite
 * differences for every weight, bias, gamma, beta and input: the weight's fake quant is an lsq range with the
 * rounding skipped (clamp(w s / step) step), its step chosen so some folded weights clip (their gradient, and
 * gamma's through them, then comes from the clamp), none within 4 % of the edge. Conv2d and dense, with and
 * without the layer's bias. */
static void test_folded_gradients(void) {
    for (int k = 0; k < 4; k++) {
        bool conv = k < 2, bias = k % 2 == 0;
        Model m;
        bn_model(&m, conv, bias, 20 + (uint64_t)k);
        Module *mod = &m.modules[0], *b = &m.modules[1];
        const int C = b->in_shape[0], N = 4;
        size_t per = var_numel(&mod->weight->var) / (size_t)C;
        QatLayer q;
        qat_fold_on(&q, &m, "int8", QAT_LEARN_LSQ);
        q.w_range.spec.skip_rounding = true, q.w_range.spec.lsq_grad_scale = 1.0f;
        /* the folded weight's edge 127 step = 0.5 on every channel; weights spread to 1.3x it, away from it */
        for (int c = 0; c < C; c++) q.w_range.param.var.value.data[c] = 0.5f / 127.0f;
        float edges[2] = {-0.5f, 0.5f};
        float *u = fq_test_spread_away(var_numel(&mod->weight->var), 30 + (uint64_t)k, 0.65f, edges, 2, 0.04f);
        for (int c = 0; c < C; c++) {
            double s = b->weight->var.value.data[c] / sqrt((double)b->running_var[c] + b->bn.eps);
            for (size_t j = 0; j < per; j++) mod->weight->var.value.data[c * per + j] = (float)(u[c * per + j] / s);
        }
        float *x = qa_normal_sample(40 + (uint64_t)k, qtest_input_numel(&m.modules[0], N));
        float *rm = qtest_copy_floats(b->running_mean, (size_t)C), *rv = qtest_copy_floats(b->running_var, (size_t)C);
        size_t ny = (size_t)N * (conv ? (size_t)C * 25 : (size_t)C);
        float *R = qa_normal_sample(50 + (uint64_t)k, ny),
              *dx = qa_alloc_floats(qtest_input_numel(&m.modules[0], N));
        loss_at(&m, x, N, R, ny, rm, rv); /* statistics restored */
        memcpy(b->running_mean, rm, (size_t)C * sizeof(float));
        memcpy(b->running_var, rv, (size_t)C * sizeof(float));
        qtest_run_model(&m, x, N, true, R, NULL, 0, dx);
        float *gw = qtest_copy_floats(mod->weight->var.grad, var_numel(&mod->weight->var));
        float *gb = bias ? qtest_copy_floats(mod->bias->var.grad, (size_t)C) : NULL;
        float *gg = qtest_copy_floats(b->weight->var.grad, (size_t)C);
        float *gbe = qtest_copy_floats(b->bias->var.grad, (size_t)C);
        const char *what = conv ? (bias ? "conv2d+bias" : "conv2d") : (bias ? "dense+bias" : "dense");
        char name[64];
        snprintf(name, sizeof name, "%s weight", what);
        size_t nw = var_numel(&mod->weight->var);
        CU_ASSERT(fd_check(&m, x, N, R, ny, rm, rv, mod->weight->var.value.data, nw, gw, name));
        snprintf(name, sizeof name, "%s gamma", what);
        CU_ASSERT(fd_check(&m, x, N, R, ny, rm, rv, b->weight->var.value.data, (size_t)C, gg, name));
        snprintf(name, sizeof name, "%s beta", what);
        CU_ASSERT(fd_check(&m, x, N, R, ny, rm, rv, b->bias->var.value.data, (size_t)C, gbe, name));
        snprintf(name, sizeof name, "%s x", what);
        CU_ASSERT(fd_check(&m, x, N, R, ny, rm, rv, x, qtest_input_numel(&m.modules[0], N), dx, name));
        if (bias) {
            snprintf(name, sizeof name, "%s bias", what);
            CU_ASSERT(fd_check(&m, x, N, R, ny, rm, rv, mod->bias->var.value.data, (size_t)C, gb, name));
        }
        /* the clamp is reached: some weights have no gradient, and gamma's does not vanish (it would, the scale
           cancelling, without clipping and rounding) */
        size_t zero = 0;
        for (size_t i = 0; i < var_numel(&mod->weight->var); i++) zero += gw[i] == 0.0f;
        CU_ASSERT(zero > 0 && zero < var_numel(&mod->weight->var));
        free(gw), free(gb), free(gg), free(gbe), free(u), free(x), free(rm), free(rv), free(R), free(dx);
        qat_layer_free(&q);
        model_free(&m);
    }
}

/* Eval: the QAT layer + batch norm give, bit for bit, the layer with bn_fold_into's weight fake-quantized and its
 * shift (in the layer's bias, or the batch norm's); training updates the statistics, a frozen batch norm leaves
 * them, and its output is then the same function as eval's (to rounding). */
static void test_eval_form_and_freeze(void) {
    for (int k = 0; k < 4; k++) {
        bool conv = k < 2, bias = k % 2 == 0;
        Model m, f;
        bn_model(&m, conv, bias, 60 + (uint64_t)k);
        bn_model(&f, conv, bias, 60 + (uint64_t)k);
        const int N = 3, C = m.modules[1].in_shape[0];
        size_t ny = (size_t)N * (conv ? (size_t)C * 25 : (size_t)C);
        float *x = qa_normal_sample(70 + (uint64_t)k, qtest_input_numel(&m.modules[0], N));
        QatLayer q, qf;
        qat_fold_on(&q, &m, "int4", QAT_LEARN_NONE);
        /* the reference: folded first, then a plain QAT layer over the folded weight */
        bn_fold_into(&f.modules[0], &f.modules[1]);
        CU_ASSERT_EQUAL(f.modules[1].bn_folded, bias ? BN_FOLD_INTO : BN_FOLD_BIAS);
        QLayerSpec spec = qtest_wspec("int4", 0, QARRAY_SCALE_F32);
        QatSpec qs = qtest_qspec(QAT_LEARN_NONE, false);
        qtest_init_ok(&qf, &f.modules[0], &spec, &qs);
        qat_layer_install(&qf);
        float *a = qa_alloc_floats(ny), *r = qa_alloc_floats(ny);
        qtest_run_model(&m, x, N, false, NULL, a, ny, NULL);
        qtest_run_model(&f, x, N, false, NULL, r, ny, NULL);
        char label[64];
        snprintf(label, sizeof label, "%s%s eval", conv ? "conv2d" : "dense", bias ? "+bias" : "");
        CU_ASSERT(fq_test_same_bits(a, r, ny, label));
        /* training moves the statistics ... */
        Module *b = &m.modules[1];
        float *rm = qtest_copy_floats(b->running_mean, (size_t)C), *rv = qtest_copy_floats(b->running_var, (size_t)C);
        qtest_run_model(&m, x, N, true, NULL, NULL, 0, NULL);
        CU_ASSERT(memcmp(rm, b->running_mean, (size_t)C * sizeof(float)) != 0);
        CU_ASSERT_EQUAL(b->num_batches_tracked, 1);
        /* ... until the step freeze_bn_after names: then they hold, and the output is eval's function */
        q.bn_freeze_after = 3;
        qat_layer_set_step(&q, 2);
        CU_ASSERT(!b->bn.frozen);
        qat_layer_set_step(&q, 3);
        CU_ASSERT(b->bn.frozen);
        memcpy(rm, b->running_mean, (size_t)C * sizeof(float));
        memcpy(rv, b->running_var, (size_t)C * sizeof(float));
        float *t = qa_alloc_floats(ny);
        qtest_run_model(&m, x, N, true, NULL, t, ny, NULL);
        qtest_run_model(&m, x, N, false, NULL, a, ny, NULL);
        CU_ASSERT(memcmp(rm, b->running_mean, (size_t)C * sizeof(float)) == 0);
        CU_ASSERT(memcmp(rv, b->running_var, (size_t)C * sizeof(float)) == 0);
        CU_ASSERT_EQUAL(b->num_batches_tracked, 1);
        ASSERT_ALL_CLOSE(t, a, ny, 1e-5, 1e-5);
        free(x), free(a), free(r), free(t), free(rm), free(rv);
        qat_layer_free(&q), qat_layer_free(&qf);
        model_free(&m), model_free(&f);
    }
}

/* A batch norm already folded into the weights (as a checkpoint of a folded model holds it) stays so: the QAT layer
 * with it attached runs, in training and eval, bit for bit as a plain QAT layer on the folded model, and leaves the
 * statistics alone. */
static void test_already_folded(void) {
    for (int k = 0; k < 2; k++) {
        bool bias = k == 0;
        Model m, f;
        bn_model(&m, true, bias, 80 + (uint64_t)k);
        bn_model(&f, true, bias, 80 + (uint64_t)k);
        bn_fold_into(&m.modules[0], &m.modules[1]);
        bn_fold_into(&f.modules[0], &f.modules[1]);
        QatLayer q, qf;
        qat_fold_on(&q, &m, "int4", QAT_LEARN_NONE);
        QLayerSpec spec = qtest_wspec("int4", 0, QARRAY_SCALE_F32);
        QatSpec qs = qtest_qspec(QAT_LEARN_NONE, false);
        qtest_init_ok(&qf, &f.modules[0], &spec, &qs);
        qat_layer_install(&qf);
        const int N = 2;
        size_t ny = (size_t)N * 3 * 25;
        float *x = qa_normal_sample(85 + (uint64_t)k, qtest_input_numel(&m.modules[0], N));
        float *a = qa_alloc_floats(ny), *r = qa_alloc_floats(ny);
        for (int training = 0; training < 2; training++) {
            qtest_run_model(&m, x, N, training, NULL, a, ny, NULL);
            qtest_run_model(&f, x, N, training, NULL, r, ny, NULL);
            CU_ASSERT(fq_test_same_bits(a, r, ny, training ? "already folded, training" : "already folded, eval"));
        }
        CU_ASSERT_EQUAL(m.modules[1].num_batches_tracked, 0);
        free(x), free(a), free(r);
        qat_layer_free(&q), qat_layer_free(&qf);
        model_free(&m), model_free(&f);
    }
}

/* A batch norm without a bias (affine: false) after a layer without one has nowhere to keep the shift: refused. */
static void test_fold_refused(void) {
    LayerSpec l[2] = {spec_of(LAYER_DENSE, "fc1"), spec_of(LAYER_BATCHNORM1D, "bn1")};
    l[0].units = 4, l[0].no_bias = true, l[1].no_affine = true;
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (const int[]){6}, l, 2, &err), QT_OK);
    QLayerSpec spec = qtest_wspec("int8", 0, QARRAY_SCALE_F32);
    QatSpec qs = qtest_qspec(QAT_LEARN_NONE, false);
    QatLayer q;
    qtest_init_ok(&q, &m.modules[0], &spec, &qs);
    CU_ASSERT_EQUAL(qat_layer_fold_bn(&q, &m.modules[1], 0, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "bn1") && test_msg_has(&err, "fc1"));
    CU_ASSERT_PTR_NULL(q.bn);
    CU_ASSERT_PTR_NULL(m.modules[1].forward_hook);
    qat_layer_free(&q);
    model_free(&m);
}

/* A fresh learned weight range starts from the weight the layer quantizes: the folded one (absmax per channel of
 * w gamma / sqrt(running_var + eps), tqt's log2 of it), not the raw weight. */
static void test_range_from_folded(void) {
    Model m;
    bn_model(&m, true, true, 95);
    QatLayer q;
    qat_fold_on(&q, &m, "int8", QAT_LEARN_TQT);
    Module *mod = &m.modules[0], *b = &m.modules[1];
    const int C = q.out;
    float *wf = qa_alloc_floats(var_numel(&mod->weight->var));
    bn_fold_values(wf, NULL, mod->weight->var.value.data, NULL, b->weight->var.value.data, NULL, b->running_mean,
                   b->running_var, b->bn.eps, C, (size_t)q.fan_in);
    for (int c = 0; c < C; c++) {
        float amax = qa_abs_max(wf + (size_t)c * q.fan_in, (size_t)q.fan_in),
              raw = qa_abs_max(mod->weight->var.value.data + (size_t)c * q.fan_in, (size_t)q.fan_in);
        CU_ASSERT_DOUBLE_EQUAL(q.w_range.param.var.value.data[c], log2(amax), 1e-6);
        CU_ASSERT(fabs(log2(amax) - log2(raw)) > 1e-3); /* the fold changed it */
    }
    free(wf);
    qat_layer_free(&q);
    model_free(&m);
}

/* Training steps of a model with a folded QAT layer (conv 2 -> 4 + batch norm, flatten, dense 10) allocate
 * nothing past step 1: the arena and the tape's node array stay as they are. */
static void test_steady_state(void) {
    LayerSpec l[4] = {spec_of(LAYER_CONV2D, "conv1"), spec_of(LAYER_BATCHNORM2D, "bn1"), spec_of(LAYER_FLATTEN, "flat"),
                      spec_of(LAYER_DENSE, "head")};
    l[0].out_channels = 4, l[0].kernel = 3, l[0].stride = 1, l[0].padding = 1, l[0].no_bias = true;
    l[3].units = 10;
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (const int[]){2, 6, 6}, l, 4, &err), QT_OK);
    Rng r;
    rng_init(&r, 96, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    QatLayer q;
    qat_fold_on(&q, &m, "int4", QAT_LEARN_LSQ);
    Arena a;
    Tape t;
    CU_ASSERT_FATAL(arena_init(&a, 4096) == 0);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, NULL, NULL), QT_OK);
    t.training = true;
    float *x = qa_normal_sample(97, 4 * 2 * 6 * 6), *dy = qa_normal_sample(98, 40);
    qat_layer_set_step(&q, 0);
    test_assert_steady_steps(&m, &t, &a, x, dy, 5);
    CU_ASSERT_EQUAL(m.modules[1].num_batches_tracked, 5);
    CU_ASSERT(q.w_range.param.var.grad[0] != 0.0f && m.modules[1].weight->var.grad[0] != 0.0f);
    free(x), free(dy);
    tape_free(&t);
    arena_free(&a);
    qat_layer_free(&q);
    model_free(&m);
}

/* ---- PyTorch parity (tests/make_fixtures_qatbn.py) --------------------------------------------------------------- */

#define QB_FIXTURE "tests/fixtures/torch_qatbn.h5"
#define QB_ATOL 1e-5
#define QB_RTOL 1e-4

/* "/case/name" of exactly n elements of memtype into out; false (printed) if missing or of another size. */
static bool qb_read(hid_t f, const char *c, const char *name, hid_t memtype, void *out, size_t n) {
    char path[128];
    snprintf(path, sizeof path, "/%s/%s", c, name);
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    hid_t sp = d >= 0 ? H5Dget_space(d) : H5I_INVALID_HID;
    hssize_t got = sp >= 0 ? H5Sget_simple_extent_npoints(sp) : -1;
    bool ok = got == (hssize_t)n && H5Dread(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) >= 0;
    if (!ok) fprintf(stderr, "\n  %s: %s missing or not of %zu elements (has %lld)\n", QB_FIXTURE, path, n,
                     (long long)got);
    if (sp >= 0) H5Sclose(sp);
    if (d >= 0) H5Dclose(d);
    CU_ASSERT(ok);
    return ok;
}

static float *qb_floats(hid_t f, const char *c, const char *name, size_t n) {
    float *buf = qa_alloc_floats(n);
    if (!qb_read(f, c, name, H5T_NATIVE_FLOAT, buf, n)) CU_FAIL_FATAL("fixture");
    return buf;
}

static double qb_worst;

static void qb_check(const char *c, const char *what, int step, const float *got, const float *want, size_t n) {
    double r = test_close_ratio(got, want, n, QB_ATOL, QB_RTOL, NULL);
    if (r > qb_worst) qb_worst = r;
    if (r > 1.0) fprintf(stderr, "\n  %s: %s step %d differs from torch:", c, what, step);
    ASSERT_ALL_CLOSE(got, want, n, QB_ATOL, QB_RTOL);
}

typedef struct {
    const char *name;
    bool conv;
    int N, in_shape[3], OC, stride;
    bool bias;
} QbCase;

/* One case: the fixture's initial parameters and weight scales (a tqt int4 range per channel whose scale is
 * torch's), its STEPS training steps (outputs, every gradient, the running statistics, SGD in between; the
 * statistics frozen from step freeze_at, as qat_layer_set_step freezes them after quant.freeze_bn_after), then
 * eval. */
static void qb_case(hid_t f, const QbCase *k) {
    const char *c = k->name;
    LayerSpec l[2] = {spec_of(k->conv ? LAYER_CONV2D : LAYER_DENSE, "layer"),
                      spec_of(k->conv ? LAYER_BATCHNORM2D : LAYER_BATCHNORM1D, "bn")};
    if (k->conv) l[0].out_channels = k->OC, l[0].kernel = 3, l[0].stride = k->stride, l[0].padding = 1;
    else l[0].units = k->OC;
    l[0].no_bias = !k->bias;
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, k->conv ? 3 : 1, k->in_shape, l, 2, &err), QT_OK);
    Module *mod = &m.modules[0], *b = &m.modules[1];
    const int C = k->OC;
    size_t nw = var_numel(&mod->weight->var), nx = qtest_input_numel(&m.modules[0], k->N);
    size_t ny = (size_t)k->N * (k->conv ? (size_t)C * b->in_shape[1] * b->in_shape[2] : (size_t)C);
    int steps = 0, freeze_at = 0;
    double lr = 0;
    hid_t g = H5Gopen2(f, c, H5P_DEFAULT);
    CU_ASSERT_FATAL(g >= 0);
    hid_t a1 = H5Aopen(g, "steps", H5P_DEFAULT), a2 = H5Aopen(g, "freeze_at", H5P_DEFAULT),
          a3 = H5Aopen(g, "lr", H5P_DEFAULT);
    CU_ASSERT_FATAL(H5Aread(a1, H5T_NATIVE_INT, &steps) >= 0 && H5Aread(a2, H5T_NATIVE_INT, &freeze_at) >= 0 &&
                    H5Aread(a3, H5T_NATIVE_DOUBLE, &lr) >= 0);
    H5Aclose(a1), H5Aclose(a2), H5Aclose(a3), H5Gclose(g);
    CU_ASSERT_FATAL(steps > freeze_at && freeze_at > 0);
    /* the initial state */
    struct {
        const char *name;
        float *dst;
        size_t n;
    } init[] = {{"params/layer/weight", mod->weight->var.value.data, nw},
                {"params/layer/bias", k->bias ? mod->bias->var.value.data : NULL, (size_t)C},
                {"params/bn/weight", b->weight->var.value.data, (size_t)C},
                {"params/bn/bias", b->bias->var.value.data, (size_t)C},
                {"params/bn/running_mean", b->running_mean, (size_t)C},
                {"params/bn/running_var", b->running_var, (size_t)C}};
    for (size_t i = 0; i < sizeof init / sizeof init[0]; i++)
        if (init[i].dst) CU_ASSERT_FATAL(qb_read(f, c, init[i].name, H5T_NATIVE_FLOAT, init[i].dst, init[i].n));
    QLayerSpec spec = qtest_wspec("int4", 0, QARRAY_SCALE_POF2);
    QatSpec qs = qtest_qspec(QAT_LEARN_TQT, false);
    QatLayer q;
    qtest_init_ok(&q, mod, &spec, &qs);
    CU_ASSERT_EQUAL_FATAL(qat_layer_fold_bn(&q, b, freeze_at, &err), QT_OK);
    float *scale = qb_floats(f, c, "scale", (size_t)C);
    for (int ch = 0; ch < C; ch++) { /* int4: s = 2^ceil(l) / 8 */
        q.w_range.param.var.value.data[ch] = log2f(scale[ch]) + 3.0f;
        CU_ASSERT_EQUAL(fq_range_scale(&q.w_range.spec, q.w_range.param.var.value.data[ch]), scale[ch]);
    }
    q.ranges_ready = true;
    qat_layer_install(&q);
    /* the steps */
    const char *names[] = {"x", "dy", "y", "dx", "dweight", "dbias", "dgamma", "dbeta", "running_mean", "running_var"};
    const size_t sizes[] = {nx, ny, ny, nx, nw, (size_t)C, (size_t)C, (size_t)C, (size_t)C, (size_t)C};
    float *ref[10] = {0};
    for (int i = 0; i < 10; i++)
        if (i != 5 || k->bias) ref[i] = qb_floats(f, c, names[i], (size_t)steps * sizes[i]);
    float *y = qa_alloc_floats(ny), *dx = qa_alloc_floats(nx);
    Param *ps[4] = {mod->weight, k->bias ? mod->bias : NULL, b->weight, b->bias};
    for (int s = 0; s < steps; s++) {
        qat_layer_set_step(&q, s);
        CU_ASSERT_EQUAL(b->bn.frozen, s >= freeze_at);
        qtest_run_model(&m, ref[0] + (size_t)s * nx, k->N, true, ref[1] + (size_t)s * ny, y, ny, dx);
        const float *got[10] = {NULL, NULL, y, dx, mod->weight->var.grad, k->bias ? mod->bias->var.grad : NULL,
                                b->weight->var.grad, b->bias->var.grad, b->running_mean, b->running_var};
        for (int i = 2; i < 10; i++)
            if (ref[i]) qb_check(c, names[i], s, got[i], ref[i] + (size_t)s * sizes[i], sizes[i]);
        for (int p = 0; p < 4; p++)
            for (size_t i = 0; ps[p] && i < var_numel(&ps[p]->var); i++)
                ps[p]->var.value.data[i] -= (float)lr * ps[p]->var.grad[i];
    }
    int64_t count = -1;
    CU_ASSERT(qb_read(f, c, "num_batches_tracked", H5T_NATIVE_INT64, &count, 1) && count == freeze_at);
    CU_ASSERT_EQUAL(b->num_batches_tracked, count);
    float *xe = qb_floats(f, c, "x_eval", nx), *ye = qb_floats(f, c, "y_eval", ny);
    qtest_run_model(&m, xe, k->N, false, NULL, y, ny, NULL);
    qb_check(c, "y_eval", steps, y, ye, ny);
    free(xe), free(ye), free(y), free(dx), free(scale);
    for (int i = 0; i < 10; i++) free(ref[i]);
    qat_layer_free(&q);
    model_free(&m);
}

/* Measured with PyTorch 1.13: worst ratio to the tolerance printed with QT_TEST_SHOW_MSGS=1. */
static void test_torch_parity(void) {
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    hid_t f = H5Fopen(QB_FIXTURE, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0) {
        test_skip("cannot open %s (run from the repository root; regenerate it with /usr/bin/python3 "
                  "tests/make_fixtures_qatbn.py %s)", QB_FIXTURE, QB_FIXTURE);
        return;
    }
    static const QbCase cases[] = {{"convbn", true, 3, {3, 6, 6}, 4, 1, true},
                                   {"convbn_nobias", true, 2, {2, 7, 7}, 3, 2, false},
                                   {"linearbn", false, 6, {5}, 4, 1, true}};
    qb_worst = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) qb_case(f, &cases[i]);
    if (getenv("QT_TEST_SHOW_MSGS")) fprintf(stderr, "\n  torch_qatbn: worst ratio to the tolerance %.3g\n", qb_worst);
    H5Fclose(f);
}

int register_quant_qat_bn_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qat_bn", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "chscale: gradients, shapes", test_chscale) ||
           !CU_add_test(s, "folded QAT in training: finite differences", test_folded_gradients) ||
           !CU_add_test(s, "eval form equals the folded layer; freezing holds the statistics",
                        test_eval_form_and_freeze) ||
           !CU_add_test(s, "a batch norm already folded stays so", test_already_folded) ||
           !CU_add_test(s, "a batch norm without a bias for the shift is refused", test_fold_refused) ||
           !CU_add_test(s, "a learned weight range starts from the folded weight", test_range_from_folded) ||
           !CU_add_test(s, "no arena growth after step 1", test_steady_state) ||
           !CU_add_test(s, "PyTorch parity: ConvBn2d, LinearBn1d (torch_qatbn.h5)", test_torch_parity);
}
