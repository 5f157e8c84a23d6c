/* test_kernels_fast.c - the vectorised kernels against their scalar `_ref` twins (batch-norm statistics and
 * gradient sums, the depthwise stride-1 loops), and the gradients a backward writes instead of adding into
 * zeros (tape_grad_to_write): the same values either way. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "nn/ops.h"
#include "test_util.h"

/* max |a - b| / (atol + rtol |b|) over [0, n), for doubles. */
static double close_ratio_d(const double *a, const double *b, int n, double atol, double rtol) {
    double worst = 0.0;
    for (int i = 0; i < n; i++) {
        const double r = fabs(a[i] - b[i]) / (atol + rtol * fabs(b[i]));
        if (r > worst) worst = r;
    }
    return worst;
}

/* Shapes around the lane width (16) and the block (1024), a channel mean far from 0 against a small spread
 * (the case a one-pass E[x^2] - E[x]^2 in float gets wrong) and a spread far larger than the mean. */
static void test_bn_stats_match_ref(void) {
    static const struct {
        int N, C;
        size_t inner;
        float lo, hi;
    } cases[] = {
        {3, 2, 16, -1.0f, 1.0f},      {4, 3, 17, 0.0f, 5.0f},     {8, 5, 196, 99.9f, 100.1f},
        {2, 3, 1100, -3.0f, 7.0f},    {5, 2, 2049, 1e3f, 1e3f + 1.0f}, {6, 4, 31, -1e-3f, 1e-3f},
        {16, 3, 49, -20.0f, 20.0f},   {4, 6, 4, -1.0f, 3.0f} /* below the lane width: the ref kernel */,
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const int N = cases[k].N, C = cases[k].C;
        const size_t inner = cases[k].inner, n = (size_t)N * C * inner;
        float *x = test_random_uniform(n, 100 + k, cases[k].lo, cases[k].hi);
        float *dy = test_random_uniform(n, 200 + k, -1.0f, 1.0f);
        double m[8], v[8], mr[8], vr[8], s[8], d[8], sr[8], dr[8];
        float mf[8];
        batchnorm_stats(m, v, x, N, C, inner, 0, C);
        batchnorm_stats_ref(mr, vr, x, N, C, inner, 0, C);
        const double spread = (double)cases[k].hi - cases[k].lo;
        /* the mean to a few float roundings of its size; the variance to 1e-5 of itself */
        CU_ASSERT(close_ratio_d(m, mr, C, 1e-7 * spread, 4e-7) <= 1.0);
        CU_ASSERT(close_ratio_d(v, vr, C, 0.0, 1e-5) <= 1.0);
        for (int c = 0; c < C; c++) mf[c] = (float)mr[c];
        batchnorm_grad_sums(s, d, dy, x, mf, N, C, inner, 0, C);
        batchnorm_grad_sums_ref(sr, dr, dy, x, mf, N, C, inner, 0, C);
        /* float lanes per block: a few roundings of the sum of |terms| */
        const double terms = (double)N * inner;
        CU_ASSERT(close_ratio_d(s, sr, C, 1e-6 * terms, 1e-6) <= 1.0);
        CU_ASSERT(close_ratio_d(d, dr, C, 1e-6 * terms * spread, 1e-6) <= 1.0);
        /* masked by a relu after the batch norm: the same tolerance against the masked _ref, and the ref itself
         * against the plain sums of dy masked by hand with batchnorm_apply's y */
        float scale[8], beta[8];
        for (int c = 0; c < C; c++) scale[c] = (float)(1.0 / sqrt(vr[c] + 1e-5)) * (c % 2 ? -0.7f : 1.3f),
                                    beta[c] = 0.1f * (float)c - 0.15f;
        batchnorm_grad_sums_relu(s, d, dy, x, mf, scale, beta, N, C, inner, 0, C);
        batchnorm_grad_sums_relu_ref(sr, dr, dy, x, mf, scale, beta, N, C, inner, 0, C);
        CU_ASSERT(close_ratio_d(s, sr, C, 1e-6 * terms, 1e-6) <= 1.0);
        CU_ASSERT(close_ratio_d(d, dr, C, 1e-6 * terms * spread, 1e-6) <= 1.0);
        {
            float *y = malloc(n * sizeof *y), *gm = malloc(n * sizeof *gm);
            batchnorm_apply(y, x, mf, scale, beta, N, C, inner, 0, C);
            for (size_t i = 0; i < n; i++) gm[i] = y[i] > 0.0f ? dy[i] : 0.0f;
            double s2[8], d2[8];
            batchnorm_grad_sums_ref(s2, d2, gm, x, mf, N, C, inner, 0, C);
            CU_ASSERT(memcmp(s2, sr, (size_t)C * sizeof *s2) == 0 && memcmp(d2, dr, (size_t)C * sizeof *d2) == 0);
            /* the masked input gradient = the plain one on the masked dy, bit for bit */
            float k1[8], k2[8], *dxa = malloc(n * sizeof *dxa), *dxb = malloc(n * sizeof *dxb);
            for (int c = 0; c < C; c++) k1[c] = 0.01f * (float)c, k2[c] = 0.02f - 0.003f * (float)c;
            batchnorm_grad_input_relu(dxa, false, dy, x, mf, scale, beta, k1, k2, N, C, inner, 0, C);
            batchnorm_grad_input(dxb, false, gm, x, mf, scale, k1, k2, N, C, inner, 0, C);
            CU_ASSERT(memcmp(dxa, dxb, n * sizeof *dxa) == 0);
            for (size_t i = 0; i < n; i++) dxa[i] = dxb[i] = 0.25f;
            batchnorm_grad_input_relu(dxa, true, dy, x, mf, scale, beta, k1, k2, N, C, inner, 0, C);
            batchnorm_grad_input(dxb, true, gm, x, mf, scale, k1, k2, N, C, inner, 0, C);
            CU_ASSERT(memcmp(dxa, dxb, n * sizeof *dxa) == 0);
            free(y), free(gm), free(dxa), free(dxb);
        }
        /* a sub-range of channels gives the same bits as the whole */
        if (C > 1) {
            double m1[8], v1[8];
            batchnorm_stats(m1, v1, x, N, C, inner, 1, C);
            CU_ASSERT(memcmp(m1 + 1, m + 1, (size_t)(C - 1) * sizeof *m) == 0);
            CU_ASSERT(memcmp(v1 + 1, v + 1, (size_t)(C - 1) * sizeof *v) == 0);
        }
        free(x);
        free(dy);
    }
}

/* The input gradient written (a fresh buffer) equals the one added into zeros, bit for bit. */
static void test_bn_grad_input_write_is_add(void) {
    const int N = 3, C = 4;
    const size_t inner = 37, n = (size_t)N * C * inner;
    float *x = test_random_uniform(n, 1, -2.0f, 2.0f), *dy = test_random_uniform(n, 2, -1.0f, 1.0f);
    float *a = calloc(n, sizeof(float)), *b = malloc(n * sizeof(float));
    const float mean[4] = {0.1f, -0.2f, 0.3f, 0.0f}, scale[4] = {1.5f, 0.5f, 2.0f, 1.0f};
    const float k1[4] = {0.01f, 0.02f, -0.03f, 0.0f}, k2[4] = {0.5f, 0.25f, 1.0f, 0.0f};
    for (size_t i = 0; i < n; i++) b[i] = NAN;
    batchnorm_grad_input(a, true, dy, x, mean, scale, k1, k2, N, C, inner, 0, C);
    batchnorm_grad_input(b, false, dy, x, mean, scale, k1, k2, N, C, inner, 0, C);
    CU_ASSERT(memcmp(a, b, n * sizeof(float)) == 0);
    free(x), free(dy), free(a), free(b);
}

/* A chain of relu, batchnorm, add and scale ops: each elementwise backward computes its input's gradient in
 * place of its output's, and a dead output gradient is reused, so the backward takes a few buffers from the
 * arena rather than one per op; the gradients are those of the same chain on a fresh arena each op. */
static void test_backward_reuses_grads(void) {
    enum { N = 4, C = 8, HW = 256, NX = N * C * HW, DEPTH = 12 };
    const int shape[4] = {N, C, 16, 16};
    float *x0 = test_random_uniform(NX, 5, -1.0f, 1.0f), *dy = test_random_uniform(NX, 6, -1.0f, 1.0f);
    float ref[NX];
    for (int pass = 0; pass < 2; pass++) {
        TestEnv e;
        test_env_init(&e, 3);
        float mean[C], var[C];
        int64_t count = 0;
        for (int c = 0; c < C; c++) mean[c] = 0.0f, var[c] = 1.0f;
        BatchNormState bn = {mean, var, &count, 0.1f, 1e-5f, false};
        Var *x = test_var(&e, x0, 4, shape, true), *h = x;
        for (int d = 0; d < DEPTH; d++) {
            Var *r = nn_relu(&e.tape, nn_batchnorm(&e.tape, h, NULL, NULL, &bn));
            h = d % 3 == 2 ? nn_add(&e.tape, r, h) : nn_scale(&e.tape, r, 1.0f + 0.01f * d);
        }
        CU_ASSERT_PTR_NOT_NULL_FATAL(h);
        const size_t before = e.arena.used;
        CU_ASSERT_FATAL(tape_backward_from(&e.tape, h, dy) == QT_OK);
        const size_t grown = e.arena.used - before, bytes = NX * sizeof(float);
        if (pass == 0) {
            /* the seed, x's own and at most a few live ones; without reuse it would be ~3 per depth */
            CU_ASSERT(grown <= 5 * bytes + 65536);
            memcpy(ref, x->grad, sizeof ref);
        } else {
            CU_ASSERT(memcmp(ref, x->grad, sizeof ref) == 0); /* the same bits on a second tape */
        }
        test_env_free(&e);
    }
    free(x0), free(dy);
}

/* add(a, b) with both needing gradients: each gets dy in its own buffer (one may take dy's), and add(a, a)
 * gives a 2 dy; relu of an input that already has a gradient adds into it. */
static void test_add_relu_grads(void) {
    enum { NX = 64 };
    const int shape[2] = {4, 16};
    float *a0 = test_random_uniform(NX, 1, -1.0f, 1.0f), *b0 = test_random_uniform(NX, 2, -1.0f, 1.0f);
    float *dy = test_random_uniform(NX, 3, -1.0f, 1.0f);
    TestEnv e;
    test_env_init(&e, 1);
    Var *a = test_var(&e, a0, 2, shape, true), *b = test_var(&e, b0, 2, shape, true);
    Var *y = nn_add(&e.tape, a, b);
    CU_ASSERT_FATAL(y && tape_backward_from(&e.tape, y, dy) == QT_OK);
    CU_ASSERT(a->grad != b->grad);
    CU_ASSERT(memcmp(a->grad, dy, sizeof(float) * NX) == 0 && memcmp(b->grad, dy, sizeof(float) * NX) == 0);
    tape_reset(&e.tape);
    a = test_var(&e, a0, 2, shape, true);
    y = nn_add(&e.tape, nn_relu(&e.tape, a), nn_add(&e.tape, a, a)); /* relu(a) + 2a */
    CU_ASSERT_FATAL(y && tape_backward_from(&e.tape, y, dy) == QT_OK);
    for (int i = 0; i < NX; i++) CU_ASSERT(a->grad[i] == 2.0f * dy[i] + (a0[i] > 0.0f ? dy[i] : 0.0f));
    test_env_free(&e);
    free(a0), free(b0), free(dy);
}

/* The stride-1 depthwise loops (padded planes, DW_LANES outputs per chunk) against the direct loops on the
 * shapes DS-CNN and MobileNet use (3x3 'same' on 14x14 and 7x7, a multiplier, a 5x5 dilated kernel), dx
 * written into a fresh buffer and added into an existing one. */
static void test_depthwise_s1_matches_ref(void) {
    static const struct {
        int N, C, H, W, OC, K;
        ConvGeom2d g;
    } cases[] = {
        {3, 4, 14, 14, 4, 3, {1, 1, 1, 1, 1, 1, 4, 0, 0}},
        {2, 3, 7, 7, 6, 3, {1, 1, 1, 1, 1, 1, 3, 0, 0}},
        {2, 2, 13, 17, 2, 5, {1, 1, 4, 3, 2, 2, 2, 0, 1}},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const int N = cases[k].N, C = cases[k].C, H = cases[k].H, W = cases[k].W, OC = cases[k].OC, K = cases[k].K;
        const ConvGeom2d *g = &cases[k].g;
        const int OH = conv_general_out_size(H, K, 1, g->pad_h, g->pad_h + g->pad_h_extra, g->dil_h);
        const int OW = conv_general_out_size(W, K, 1, g->pad_w, g->pad_w + g->pad_w_extra, g->dil_w);
        const size_t nx = (size_t)N * C * H * W, nw = (size_t)OC * K * K, ny = (size_t)N * OC * OH * OW;
        float *x = test_random_uniform(nx, 10 + k, -1.0f, 1.0f), *w = test_random_uniform(nw, 20 + k, -1.0f, 1.0f);
        float *b = test_random_uniform((size_t)OC, 30 + k, -1.0f, 1.0f), *dy = test_random_uniform(ny, 40 + k, -1.0f, 1.0f);
        float *yr = malloc(ny * sizeof(float)), *dxr = calloc(nx, sizeof(float)), *dwr = calloc(nw, sizeof(float));
        conv2d_general_forward_ref(yr, x, w, b, N, C, H, W, OC, K, K, g);
        conv2d_general_backward_ref(dxr, dwr, NULL, dy, x, w, N, C, H, W, OC, K, K, g);
        for (int pass = 0; pass < 2; pass++) {
            TestEnv e;
            test_env_init(&e, 1);
            Var *xv = test_var(&e, x, 4, (const int[]){N, C, H, W}, true);
            Var *wv = test_var(&e, w, 4, (const int[]){OC, 1, K, K}, true);
            Var *bv = test_var(&e, b, 1, (const int[]){OC}, false);
            if (pass == 1) { /* an existing gradient of 1: the loops add into it */
                xv->grad = tape_grad(&e.tape, xv);
                for (size_t i = 0; i < nx; i++) xv->grad[i] = 1.0f;
            }
            Var *y = nn_conv2d_general(&e.tape, xv, wv, bv, g);
            CU_ASSERT_FATAL(y && tape_backward_from(&e.tape, y, dy) == QT_OK);
            ASSERT_ALL_CLOSE(y->value.data, yr, ny, 1e-5, 1e-5);
            if (pass == 1)
                for (size_t i = 0; i < nx; i++) xv->grad[i] -= 1.0f;
            ASSERT_ALL_CLOSE(xv->grad, dxr, nx, 1e-5, 1e-5);
            ASSERT_ALL_CLOSE(wv->grad, dwr, nw, 1e-4, 1e-5);
            test_env_free(&e);
        }
        free(x), free(w), free(b), free(dy), free(yr), free(dxr), free(dwr);
    }
}

/* A stem and BLOCKS residual blocks (conv, bn, relu, conv, bn, add, relu), then flatten and a dense head.
 * A relu after a batch norm or an add that nothing else reads runs in place; a pass without gradients
 * hands dead activations back, so it holds a few of them, and gives the same logits as a pass that keeps
 * them all (one with gradients, eval-mode batch norm). */
static void test_model_activation_memory(void) {
    enum { BLOCKS = 6, NL = 3 + 7 * BLOCKS + 2, N = 128, C = 4, HW = 16 };
    LayerSpec layers[NL];
    int n = 0;
    layers[n++] = test_layer(LAYER_CONV2D, "c0", NULL, NULL);
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "b0", NULL, NULL);
    layers[n++] = test_layer(LAYER_RELU, "r0", NULL, NULL);
    char prev[16] = "r0", nm[7][16];
    for (int b = 0; b < BLOCKS; b++) {
        const char *kinds = "cbrcbar";
        for (int k = 0; k < 7; k++) snprintf(nm[k], sizeof nm[k], "%c%d_%d", kinds[k], b, k);
        layers[n++] = test_layer(LAYER_CONV2D, nm[0], NULL, NULL);
        layers[n++] = test_layer(LAYER_BATCHNORM2D, nm[1], NULL, NULL);
        layers[n++] = test_layer(LAYER_RELU, nm[2], NULL, NULL);
        layers[n++] = test_layer(LAYER_CONV2D, nm[3], NULL, NULL);
        layers[n++] = test_layer(LAYER_BATCHNORM2D, nm[4], NULL, NULL);
        layers[n++] = test_layer(LAYER_ADD, nm[5], nm[4], prev);
        layers[n++] = test_layer(LAYER_RELU, nm[6], NULL, NULL);
        snprintf(prev, sizeof prev, "%s", nm[6]);
    }
    layers[n++] = test_layer(LAYER_FLATTEN, "f", NULL, NULL);
    layers[n] = test_layer(LAYER_DENSE, "head", NULL, NULL);
    layers[n++].units = 3;
    CU_ASSERT_EQUAL_FATAL(n, NL);
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){C, HW, HW}, layers, NL, &err), QT_OK);
    Rng r;
    rng_init(&r, 5, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    float *x = test_random_uniform((size_t)N * C * HW * HW, 9, -1.0f, 1.0f);
    const size_t act = (size_t)N * C * HW * HW * sizeof(float);
    float logits[2][N * 3];
    size_t used[2];
    for (int pass = 0; pass < 2; pass++) {
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = false;
        e.tape.grad_enabled = pass == 0;
        Var *vx = test_var(&e, x, 4, (int[]){N, C, HW, HW}, false);
        const size_t before = e.arena.used;
        Var *y = model_forward(&m, &e.tape, vx);
        CU_ASSERT_FATAL(y != NULL);
        memcpy(logits[pass], y->value.data, sizeof logits[pass]);
        used[pass] = e.arena.used - before;
        if (pass == 0) {
            /* r0 and every block's relus share their batch norm's or add's buffer */
            CU_ASSERT(m.outs[1 + 2]->value.data == m.outs[1 + 1]->value.data);
            CU_ASSERT(m.outs[1 + 3 + 6]->value.data == m.outs[1 + 3 + 5]->value.data);
            CU_ASSERT(m.outs[1 + 3 + 2]->value.data == m.outs[1 + 3 + 1]->value.data);
            /* with gradients, what the backward reads is kept: the stem's conv output and each block's two conv
             * outputs and its add (relu'd in place); the batch norm + relu outputs are dropped after their last
             * reader (made again in the backward) and the second batch norm's output after the add (no backward
             * reads it), so one buffer in flight at most comes on top (the convolutions' scratch is handed back
             * and reused, so it does not pad the count) */
            CU_ASSERT(used[0] >= (size_t)(1 + 3 * BLOCKS) * act);
            CU_ASSERT(used[0] <= (size_t)(2 + 3 * BLOCKS) * act);
        } else {
            /* a few activations and the convolutions' scratch, against all of them */
            CU_ASSERT(used[1] * 3 < used[0]);
        }
        test_env_free(&e);
    }
    CU_ASSERT(memcmp(logits[0], logits[1], sizeof logits[0]) == 0);
    free(x);
    model_free(&m);
}

/* A batch norm's output read by a conv and then by a relu: the relu is its last reader but not its only one, and
 * the conv's backward (its weight gradient) and a view of it in eval (dropout) read those values, so the relu must
 * not overwrite them: with and without Model.keep_outputs the gradients and the eval output are the same bits. */
static void test_relu_not_in_place_under_a_second_reader(void) {
    enum { N = 4, C = 4, HW = 6 };
    for (int kind = 0; kind < 2; kind++) { /* 0: a conv reads bn1 first (training); 1: a dropout (eval) */
        LayerSpec layers[7];
        int n = 0;
        layers[n++] = test_layer(LAYER_CONV2D, "c0", NULL, NULL);
        layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn1", NULL, NULL);
        layers[n++] = test_layer(kind == 0 ? LAYER_CONV2D : LAYER_DROPOUT, "side", "bn1", NULL);
        layers[n++] = test_layer(LAYER_RELU, "r", "bn1", NULL);
        layers[n++] = test_layer(LAYER_ADD, "sum", "side", "r");
        layers[n++] = test_layer(LAYER_FLATTEN, "f", NULL, NULL);
        layers[n] = test_layer(LAYER_DENSE, "head", NULL, NULL);
        layers[n++].units = 3;
        Model m;
        QtError err = {0};
        CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){C, HW, HW}, layers, n, &err), QT_OK);
        CU_ASSERT(!model_graph_relu_in_place(&m, 3));
        Rng r;
        rng_init(&r, 11, RNG_STREAM_INIT);
        model_init_params(&m, &r);
        float *x = test_random_uniform((size_t)N * C * HW * HW, 3, -1.0f, 1.0f);
        float out[2][N * 3];
        float *grads[2] = {NULL, NULL};
        const Param *w = m.modules[kind == 0 ? 2 : 0].weight;
        const size_t nw = var_numel(&w->var);
        for (int keep = 0; keep < 2; keep++) {
            m.keep_outputs = keep;
            TestEnv e;
            test_env_init(&e, 1);
            e.tape.training = kind == 0;
            e.tape.grad_enabled = kind == 0;
            memset(w->var.grad, 0, nw * sizeof(float));
            Var *vx = test_var(&e, x, 4, (int[]){N, C, HW, HW}, false);
            Var *y = model_forward(&m, &e.tape, vx);
            CU_ASSERT_FATAL(y != NULL);
            memcpy(out[keep], y->value.data, sizeof out[keep]);
            if (kind == 0) {
                float dy[N * 3];
                for (int i = 0; i < N * 3; i++) dy[i] = (float)(i % 5) - 2.0f;
                CU_ASSERT_FATAL(tape_backward_from(&e.tape, y, dy) == QT_OK);
                grads[keep] = malloc(nw * sizeof(float));
                memcpy(grads[keep], w->var.grad, nw * sizeof(float));
            }
            test_env_free(&e);
        }
        CU_ASSERT(memcmp(out[0], out[1], sizeof out[0]) == 0);
        if (kind == 0) CU_ASSERT(memcmp(grads[0], grads[1], nw * sizeof(float)) == 0);
        free(grads[0]), free(grads[1]), free(x);
        model_free(&m);
    }
}

/* nn_plane_means (four planes side by side, at the vector width the CPU gets: 8 doubles on AVX-512, two of 4 on
 * AVX2 and in `make test CLONES=avx2`) equals nn_plane_mean plane by plane, bit for bit:
 * plane counts around 4, lengths around 8 and a 14x14 plane, values far apart in magnitude. */
static void test_plane_means_match_mean(void) {
    static const size_t PLANES[] = {1, 3, 4, 5, 8, 9}, NS[] = {1, 7, 8, 9, 15, 16, 17, 196, 301};
    Rng r;
    rng_init(&r, 6100, 0);
    for (size_t a = 0; a < sizeof PLANES / sizeof *PLANES; a++)
        for (size_t b = 0; b < sizeof NS / sizeof *NS; b++) {
            const size_t P = PLANES[a], n = NS[b];
            float *x = malloc(P * n * sizeof *x), want[9], got[9];
            for (size_t i = 0; i < P * n; i++) {
                const float u = (float)rng_below(&r, 1u << 20) / (float)(1u << 20) - 0.3f;
                x[i] = u * (i % 5 == 0 ? 3e5f : i % 3 == 0 ? 1e-3f : 1.0f);
            }
            for (size_t p = 0; p < P; p++) want[p] = nn_plane_mean(x + p * n, n);
            nn_plane_means(got, x, P, n);
            CU_ASSERT(!memcmp(want, got, P * sizeof *got));
            free(x);
        }
}

int register_nn_kernels_fast_suite(void) {
    CU_pSuite s = CU_add_suite("nn_kernels_fast", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "batchnorm statistics and gradient sums match their _ref twins", test_bn_stats_match_ref) ||
           !CU_add_test(s, "batchnorm input gradient: written equals added into zeros",
                        test_bn_grad_input_write_is_add) ||
           !CU_add_test(s, "backward: gradients in place and reused, same values", test_backward_reuses_grads) ||
           !CU_add_test(s, "add and relu gradients: own buffers, accumulation", test_add_relu_grads) ||
           !CU_add_test(s, "depthwise stride-1 loops match the direct loops", test_depthwise_s1_matches_ref) ||
           !CU_add_test(s, "plane means four at a time match one at a time", test_plane_means_match_mean) ||
           !CU_add_test(s, "a relu that is not its input's only reader leaves it alone",
                        test_relu_not_in_place_under_a_second_reader) ||
           !CU_add_test(s, "model: relus in place, eval passes release dead activations",
                        test_model_activation_memory);
}
