/* test_bn_fuse.c - a batch norm folded after a conv2d without a bias
 * (BN_FOLD_BIAS: the batch norm adds the folded shift) runs inside the
 * conv's fused op, the shift as its bias, with the relu (and 2x2 max pool)
 * epilogue when they follow: the fused-away outputs are never made, and the
 * model's output equals the modules run one by one (model_step) within
 * float rounding, for a float model, PTQ weight-only and PTQ w8a8 (the int8
 * kernels; the portable ones on a CPU without VNNI). Model.keep_outputs
 * turns the fusion off. The bn_fuse suite. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "quant/qarray.h"
#include "quant/qgemm.h"
#include "quant/qlayer.h"
#include "test_qarray.h"
#include "test_util.h"
#include "trainer/bn_fold.h"

#define N_EX 3 /* examples per batch */

static LayerSpec spec_of(LayerType type, const char *name) {
    LayerSpec s = {.type = type};
    snprintf(s.name, sizeof s.name, "%s", name);
    if (type == LAYER_BATCHNORM2D) s.eps = 1e-5f, s.momentum = 0.1f;
    return s;
}

static LayerSpec conv_of(const char *name, int oc, int stride) {
    LayerSpec s = spec_of(LAYER_CONV2D, name);
    s.out_channels = oc, s.kernel = 3, s.stride = stride, s.padding = 1, s.no_bias = true;
    return s;
}

/* conv -> bn -> relu -> maxpool (one op), conv -> bn -> relu (one op), conv -> bn (one op), flatten, dense; every
 * batch norm folded into its conv (BN_FOLD_BIAS), with statistics far from their start. */
enum { N_MODULES = 11 };
static const bool FUSED_AWAY[N_MODULES] = {true, true, true, false, true, true, false, true, false, false, false};

static void model_for(Model *m) {
    LayerSpec l[N_MODULES] = {conv_of("c1", 8, 1),          spec_of(LAYER_BATCHNORM2D, "b1"),
                              spec_of(LAYER_RELU, "r1"),     spec_of(LAYER_MAXPOOL2D, "p1"),
                              conv_of("c2", 8, 1),          spec_of(LAYER_BATCHNORM2D, "b2"),
                              spec_of(LAYER_RELU, "r2"),     conv_of("c3", 6, 2),
                              spec_of(LAYER_BATCHNORM2D, "b3"), spec_of(LAYER_FLATTEN, "flat"),
                              spec_of(LAYER_DENSE, "fc")};
    l[3].kernel = 2, l[3].stride = 2;
    l[10].units = 10;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(m, 3, (int[]){3, 8, 8}, l, N_MODULES, &err), QT_OK);
    Rng r;
    rng_init(&r, 41, RNG_STREAM_INIT);
    model_init_params(m, &r);
    for (int i = 0; i < m->n_modules; i++) {
        Module *b = &m->modules[i];
        if (!b->running_mean) continue;
        const size_t C = (size_t)b->in_shape[0];
        rng_fill_uniform(&r, b->running_mean, C, -0.5f, 0.5f);
        rng_fill_uniform(&r, b->running_var, C, 0.2f, 2.0f);
        rng_fill_uniform(&r, b->weight->var.value.data, C, 0.5f, 1.5f);
        rng_fill_uniform(&r, b->bias->var.value.data, C, -1.0f, 1.0f);
        bn_fold_into(&m->modules[b->inputs[0]], b);
        CU_ASSERT_EQUAL(b->bn_folded, BN_FOLD_BIAS);
    }
}

/* The model's output on x without gradients, into out (N_EX x 10): by model_forward (fused) or module by module
 * (model_step, which never fuses). outs_made[i]: whether module i's output was made. */
static void eval(Model *m, const float *x, bool fused, float *out, bool *outs_made) {
    Arena a;
    Tape t;
    Rng r;
    arena_init(&a, 1 << 16);
    rng_init(&r, 1, RNG_STREAM_DROPOUT);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, &r, NULL), QT_OK);
    t.training = false, t.grad_enabled = false;
    Var *vx = tape_wrap(&t, (float *)x, 4, (int[]){N_EX, 3, 8, 8}), *y = NULL;
    if (fused) {
        y = model_forward(m, &t, vx);
    } else {
        Var *outs[N_MODULES + 1] = {vx};
        for (int i = 0; i < m->n_modules; i++) y = model_step(m, &t, i, outs);
    }
    if (!tape_ok(&t)) fprintf(stderr, "\n  forward: %s\n", t.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    CU_ASSERT_EQUAL_FATAL(var_numel(y), N_EX * 10);
    memcpy(out, y->value.data, N_EX * 10 * sizeof(float));
    for (int i = 0; fused && i < m->n_modules; i++) outs_made[i] = m->outs[1 + i] != NULL;
    tape_free(&t);
    arena_free(&a);
}

/* Fused against module by module, and the fusion's shape (which outputs were never made); with keep_outputs the
 * batch norms run on their own again. */
static void check_fused(Model *m, const char *what) {
    float *x = qa_normal_sample(77, (size_t)N_EX * 3 * 8 * 8), ref[N_EX * 10], got[N_EX * 10], kept[N_EX * 10];
    bool made[N_MODULES];
    eval(m, x, false, ref, NULL);
    eval(m, x, true, got, made);
    for (int i = 0; i < N_MODULES; i++) {
        if (made[i] == !FUSED_AWAY[i]) continue;
        fprintf(stderr, "\n  %s: module %s's output %s\n", what, m->modules[i].path,
                made[i] ? "was made: not fused" : "was not made");
        CU_FAIL("fusion");
    }
    double dmax = 0, rmax = 0;
    for (int i = 0; i < N_EX * 10; i++)
        dmax = fmax(dmax, fabs((double)got[i] - ref[i])), rmax = fmax(rmax, fabs(ref[i]));
    printf("(%s: max |diff| / max |y| = %.2e) ", what, dmax / rmax);
    CU_ASSERT(rmax > 0.1);
    CU_ASSERT(dmax <= 1e-5 * rmax);
    m->keep_outputs = true;
    eval(m, x, true, kept, made);
    m->keep_outputs = false;
    CU_ASSERT(made[1] && made[5] && made[8]); /* the batch norms ran */
    CU_ASSERT(!memcmp(kept, ref, sizeof ref));
    free(x);
}

static void test_float(void) {
    Model m;
    model_for(&m);
    check_fused(&m, "float");
    model_free(&m);
}

/* Every conv2d quantized (int8 per channel, as PTQ quantizes the folded weight), with int8 activations at a fixed
 * symmetric range if act. */
static void check_ptq(bool act, const char *what) {
    Model m;
    model_for(&m);
    QLayer q[3];
    const int convs[3] = {0, 4, 7};
    const bool portable = qgemm_force_portable;
    if (act) qgemm_force_portable = !qgemm_cpu_has_vnni();
    for (int k = 0; k < 3; k++) {
        Module *mod = &m.modules[convs[k]];
        QLayerSpec s = qlayer_spec_default();
        s.weight_qtype = qa_find("int8");
        s.act_qtype = act ? qa_find("int8") : NULL;
        QtError err = {0};
        QtStatus st = qlayer_init_quantize(&q[k], mod, &s, mod->weight->var.value.data, &err);
        if (st != QT_OK) fprintf(stderr, "\n  qlayer_init_quantize: %s\n", err.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        if (act) {
            const QType *t = s.act_qtype;
            q[k].act_scale = qarray_scale_for_range(t, false, false, (float)t->qmin, (float)t->qmax, -3.0f, 3.0f);
            q[k].act_zero_point = 0.0f;
            q[k].act_ready = true;
        }
        qlayer_install(&q[k]);
    }
    check_fused(&m, what);
    for (int k = 0; k < 3; k++) {
        if (act) CU_ASSERT_PTR_NOT_NULL(q[k].int8); /* the int8 kernels ran */
        qlayer_free(&q[k]);
    }
    qgemm_force_portable = portable;
    model_free(&m);
}

static void test_ptq_weight_only(void) { check_ptq(false, "PTQ int8 weight-only"); }
static void test_ptq_w8a8(void) { check_ptq(true, "PTQ w8a8"); }

int register_bn_fuse_suite(void) {
    CU_pSuite s = CU_add_suite("bn_fuse", NULL, NULL);
    if (!s) return 1;
    return !CU_add_test(s, "conv2d + folded batch norm (+ relu, max pool) fused: float", test_float) ||
           !CU_add_test(s, "conv2d + folded batch norm fused: PTQ weight-only", test_ptq_weight_only) ||
           !CU_add_test(s, "conv2d + folded batch norm fused: PTQ w8a8 on the int8 kernels", test_ptq_w8a8);
}
