/* test_bn_add_view.c - a batch norm whose only reader is an add (a residual block's second batch norm) is never
 * written: the add makes each plane through the batch norm's view as it adds (nn_batchnorm_view,
 * model_graph_bn_add_view); an add whose only reader is a relu in place applies it in its pass (nn_add_relu,
 * model_graph_add_relu). The ops against nn_batchnorm, nn_add and nn_relu_inplace, bit for bit; the convolutions'
 * refusal; a residual model's step with both against the same step with every output kept. */
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/model.h"
#include "nn/ops.h"
#include "test_util.h"

enum { BN_MAX_C = 32, OUTS = 11 };

/* A batch norm's gamma, beta and running statistics as PyTorch starts the latter (mean 0, variance 1). */
typedef struct {
    float gb[2 * BN_MAX_C], mean[BN_MAX_C], var[BN_MAX_C];
    int64_t count;
    BatchNormState s;
} AddBn;

static void add_bn_init(AddBn *b, int C, unsigned seed) {
    CU_ASSERT_FATAL(C <= BN_MAX_C);
    memset(b, 0, sizeof *b);
    float *gb = test_random_uniform(2 * (size_t)C, seed, -1.0f, 1.0f); /* some gammas negative */
    memcpy(b->gb, gb, 2 * (size_t)C * sizeof(float));
    free(gb);
    for (int k = 0; k < C; k++) b->var[k] = 1.0f;
    b->s = (BatchNormState){b->mean, b->var, &b->count, 0.1f, 1e-5f, false};
}

typedef struct {
    int ndim, shape[4];
    const char *what;
} AddCase;

/* Which inputs of the add are batch norms: the first, the second, both, or neither. */
typedef enum { BN_FIRST, BN_SECOND, BN_BOTH, BN_NONE } BnAt;

/* y = add(a, b), a and/or b a batch norm of its own input (training or eval), relu'd in place if relu, then a
 * backward from a fixed dy; fused: the batch norms as nn_batchnorm_view and the relu as nn_add_relu +
 * nn_relu_inplace_applied, else nn_batchnorm, nn_add and nn_relu_inplace. out: y, then the inputs' gradients,
 * then each batch norm's dgamma, dbeta, running mean and running variance (zeros where there is none). */
static void add_run(const AddCase *c, BnAt at, bool fused, bool relu, bool training, float *out[OUTS],
                    size_t len[OUTS]) {
    const bool view = fused;
    size_t n = 1;
    for (int d = 0; d < c->ndim; d++) n *= (size_t)c->shape[d];
    const int C = c->shape[1];
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.training = training;
    AddBn bn[2];
    Var *in[2], *src[2], *gv[2] = {NULL, NULL}, *bv[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        float *x = test_random_uniform(n, 30 + (unsigned)k, -2.0f, 2.0f);
        src[k] = test_var(&e, x, c->ndim, c->shape, true);
        free(x);
        add_bn_init(&bn[k], C, 40 + (unsigned)k);
        in[k] = src[k];
        if (at == BN_BOTH || (int)at == k) {
            gv[k] = test_var(&e, bn[k].gb, 1, &C, true), bv[k] = test_var(&e, bn[k].gb + C, 1, &C, true);
            in[k] = view ? nn_batchnorm_view(&e.tape, src[k], gv[k], bv[k], &bn[k].s)
                         : nn_batchnorm(&e.tape, src[k], gv[k], bv[k], &bn[k].s);
            CU_ASSERT_FATAL(in[k] != NULL);
            CU_ASSERT((in[k]->value.data == NULL) == view);
        }
    }
    Var *y = relu && fused ? nn_relu_inplace_applied(&e.tape, nn_add_relu(&e.tape, in[0], in[1]))
             : relu        ? nn_relu_inplace(&e.tape, nn_add(&e.tape, in[0], in[1]))
                           : nn_add(&e.tape, in[0], in[1]);
    CU_ASSERT_FATAL(y != NULL);
    float *dy = test_random_uniform(n, 50, -1.0f, 1.0f);
    CU_ASSERT_FATAL(tape_backward_from(&e.tape, y, dy) == QT_OK);
    free(dy);
    const float *from[OUTS] = {y->value.data, src[0]->grad, src[1]->grad};
    len[0] = len[1] = len[2] = n;
    for (int k = 0; k < 2; k++) {
        from[3 + 4 * k] = gv[k] ? gv[k]->grad : NULL, from[4 + 4 * k] = bv[k] ? bv[k]->grad : NULL;
        from[5 + 4 * k] = bn[k].mean, from[6 + 4 * k] = bn[k].var;
        for (int q = 3; q < 7; q++) len[q + 4 * k] = (size_t)C;
    }
    for (int q = 0; q < OUTS; q++) {
        out[q] = calloc(len[q], sizeof(float));
        if (from[q]) memcpy(out[q], from[q], len[q] * sizeof(float));
    }
    test_env_free(&e);
}

/* The add reading a batch norm's view gives the sum, every gradient and the running statistics of the written
 * batch norm, bit for bit, and with its relu applied in its pass (nn_add_relu) those of nn_add then
 * nn_relu_inplace: a view first, second, both or none, in training and eval, on 1 and 2 threads, over planes of
 * 784 (ResNet-8's first stage), odd sizes and one value (batchnorm1d's (N, C)). */
static void test_bn_add_view_same_bits(void) {
    static const AddCase cases[] = {
        {4, {6, 16, 28, 28}, "ResNet-8's first stage"},
        {4, {3, 5, 7, 9}, "odd planes"},
        {4, {4, 3, 1, 1}, "planes of one value"},
        {2, {9, 7, 0, 0}, "(N, C)"},
        {3, {2, 4, 33, 0}, "(N, C, L)"},
    };
    const int before = parallel_get_threads();
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++)
        for (int at = BN_FIRST; at <= BN_NONE; at++)
            for (int training = 0; training <= 1; training++)
                for (int relu = 0; relu <= 1; relu++)
                    for (int th = 1; th <= 2; th++) {
                        if (at == BN_NONE && !relu) continue; /* nothing fused */
                        parallel_set_threads(th);
                        float *ref[OUTS], *got[OUTS];
                        size_t len[OUTS];
                        add_run(&cases[k], (BnAt)at, false, relu, training, ref, len);
                        add_run(&cases[k], (BnAt)at, true, relu, training, got, len);
                        static const char *const where[] = {"first", "second", "both", "none"};
                        for (int q = 0; q < OUTS; q++) {
                            const bool same = !memcmp(ref[q], got[q], len[q] * sizeof(float));
                            if (!same)
                                fprintf(stderr, "\n  add%s, %s, batch norm %s, %s, %d thread(s): result %d differs",
                                        relu ? " + relu" : "", cases[k].what, where[at],
                                        training ? "training" : "eval", th, q);
                            CU_ASSERT(same);
                            free(ref[q]), free(got[q]);
                        }
                    }
    parallel_set_threads(before);
}

/* A convolution given such a view (no relu) refuses it, by name, on both its routes' checks. */
static void test_conv_refuses_affine_view(void) {
    for (int general = 0; general < 2; general++) {
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = true;
        float xs[2 * 2 * 4 * 4], ws[2 * 2 * 9];
        for (size_t i = 0; i < sizeof xs / sizeof *xs; i++) xs[i] = (float)(i % 7) - 3.0f;
        for (size_t i = 0; i < sizeof ws / sizeof *ws; i++) ws[i] = 0.1f * (float)(i % 5);
        AddBn bn;
        add_bn_init(&bn, 2, 9);
        Var *b = nn_batchnorm_view(&e.tape, test_var(&e, xs, 4, (int[]){2, 2, 4, 4}, true), NULL, NULL, &bn.s);
        CU_ASSERT_FATAL(b != NULL && b->view && b->view->affine_only);
        Var *w = test_var(&e, ws, 4, (int[]){2, general ? 1 : 2, 3, 3}, true);
        ConvGeom2d g = conv_geom2d(1, 1);
        g.groups = 2;
        CU_ASSERT_PTR_NULL(general ? nn_conv2d_general(&e.tape, b, w, NULL, &g) : nn_conv2d(&e.tape, b, w, NULL, 1, 1));
        CU_ASSERT(e.tape.err.status == QT_ERR_ARG && test_msg_has(&e.tape.err, "nn_batchnorm_view"));
        test_env_free(&e);
    }
}

/* model_graph_bn_add_view: a batch norm read by an add alone (the identity and the 1x1-conv shortcut's blocks),
 * not one with a second reader, nor one read by a relu; and a small residual model trains one step to the same
 * output, gradients and running statistics with the views (and the step's memory plan) as with every output
 * kept, which runs none. */
static void test_model_bn_add_view(void) {
    enum { N = 4, C = 3, HW = 8 };
    LayerSpec layers[17];
    int n = 0;
    layers[n] = test_layer(LAYER_CONV2D, "c0", NULL, NULL);          /* 0: 1 channel in: cheap, remade */
    layers[n++].out_channels = C;
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn0", NULL, NULL);   /* 1: read by its relu */
    layers[n++] = test_layer(LAYER_RELU, "stem", NULL, NULL);         /* 2 */
    layers[n] = test_layer(LAYER_CONV2D, "c1", NULL, NULL);           /* 3 */
    layers[n++].out_channels = C;
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn1", NULL, NULL);   /* 4: viewed by the add */
    layers[n++] = test_layer(LAYER_ADD, "sum1", "bn1", "stem");       /* 5: identity shortcut */
    layers[n++] = test_layer(LAYER_RELU, "out1", NULL, NULL);         /* 6 */
    layers[n] = test_layer(LAYER_CONV2D, "c2", NULL, NULL);           /* 7 */
    layers[n].out_channels = 2 * C, layers[n++].stride = 2;
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn2", NULL, NULL);   /* 8: viewed, the add's second input */
    layers[n] = test_layer(LAYER_CONV2D, "short", "out1", NULL);      /* 9: a strided 1x1 shortcut */
    layers[n].out_channels = 2 * C, layers[n].kernel = 1, layers[n].padding = 0, layers[n++].stride = 2;
    layers[n++] = test_layer(LAYER_ADD, "sum2", "short", "bn2");      /* 10 */
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn3", NULL, NULL);   /* 11: two readers: written */
    layers[n++] = test_layer(LAYER_ADD, "sum3", "bn3", "sum2");       /* 12 */
    layers[n++] = test_layer(LAYER_ADD, "sum4", "sum3", "bn3");       /* 13 */
    layers[n++] = test_layer(LAYER_GLOBALAVGPOOL, "gap", NULL, NULL); /* 14 */
    layers[n++] = test_layer(LAYER_FLATTEN, "f", NULL, NULL);         /* 15 */
    layers[n] = test_layer(LAYER_DENSE, "head", NULL, NULL);          /* 16 */
    layers[n++].units = 3;
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){1, HW, HW}, layers, n, &err), QT_OK);
    CU_ASSERT(!model_graph_bn_add_view(&m, 1));
    CU_ASSERT(model_graph_bn_add_view(&m, 4));
    CU_ASSERT(model_graph_bn_add_view(&m, 8));
    CU_ASSERT(!model_graph_bn_add_view(&m, 11));
    CU_ASSERT(!model_graph_bn_add_view(&m, 5));
    CU_ASSERT(model_graph_add_relu(&m, 5));   /* sum1, read by its relu alone */
    CU_ASSERT(!model_graph_add_relu(&m, 10)); /* sum2, read by a batch norm and an add */
    CU_ASSERT(!model_graph_add_relu(&m, 6));  /* a relu */
    Rng r;
    rng_init(&r, 9, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    float *x = test_random_uniform((size_t)N * HW * HW, 8, -1.0f, 1.0f);
    TestStepResults res[2];
    for (int keep = 0; keep < 2; keep++) {
        m.keep_outputs = keep;
        CU_ASSERT(model_graph_bn_add_view(&m, 4) == !keep && model_graph_add_relu(&m, 5) == !keep);
        test_model_step_reset(&m);
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = true;
        e.tape.grad_enabled = true;
        Var *y = model_forward(&m, &e.tape, test_var(&e, x, 4, (int[]){N, 1, HW, HW}, false));
        CU_ASSERT_FATAL(y != NULL);
        if (!keep)
            CU_ASSERT(m.outs[5] && m.outs[5]->view && m.outs[9] && m.outs[9]->view && m.outs[12] &&
                      !m.outs[12]->view);
        test_model_step_take(&m, &e, y, &res[keep]);
        test_env_free(&e);
    }
    test_model_step_same(&res[0], &res[1], "residual model with views against the kept outputs");
    free(x);
    model_free(&m);
}

int register_nn_bn_add_view_suite(void) {
    CU_pSuite s = CU_add_suite("nn_bn_add_view", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "add of a batch norm's view (+ relu) = batch norm written, then added (+ relu), bit for bit",
                        test_bn_add_view_same_bits) ||
                   !CU_add_test(s, "conv2d refuses a batch norm's view without relu", test_conv_refuses_affine_view) ||
                   !CU_add_test(s, "model_graph_bn_add_view; a residual model's step with views = all outputs kept",
                                test_model_bn_add_view)
               ? -1
               : 0;
}
