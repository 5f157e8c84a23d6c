/* test_conv_bn.c - the passes a conv and the batch norm around it share: a convolution whose only reader is a
 * batch norm makes the batch statistics' plane moments while its output planes are in cache (nn_conv2d_bn,
 * nn_conv2d_general_bn, model_graph_conv_bn), and the batch norm merges them instead of reading the output again;
 * a batch norm + relu whose only reader is a plain or depthwise stride-1 conv is never written, the conv reading
 * it through a view (nn_batchnorm_relu_view, model_graph_bn_relu_view). The kernels against their definition,
 * the ops against the plain ones, bit for bit. */
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/model.h"
#include "nn/ops.h"
#include "test_util.h"

/* The batch norm kernels' blocked sums by their definition, one value at a time: a block (at most 1024 values of a
 * channel's plane) sums into 16 float lanes (value i into lane i mod 16) over its whole lanes, the rest serially
 * (the tail), then tail + lane 0 + ... + lane 15 in that order. Compiled without FMA contraction (Makefile), as the
 * kernels are. */
#define DEF_LANES 16
#define DEF_BLOCK 1024

static void def_block_sums(const float *dy, const float *x, size_t n, float c, bool relu, float a, float b, float *s1,
                           float *s2) {
    float l1[DEF_LANES] = {0}, l2[DEF_LANES] = {0}, t1 = 0.0f, t2 = 0.0f;
    const size_t body = n / DEF_LANES * DEF_LANES;
    for (size_t i = 0; i < n; i++) {
        float u, v;
        if (dy) { /* the gradient's sums: g and g (x - c), g masked by a relu after the batch norm */
            const float y = (x[i] - c) * a + b;
            u = relu && !(y > 0.0f) ? 0.0f : dy[i];
            v = u * (x[i] - c);
        } else { /* the moments about c */
            u = x[i] - c;
            v = u * u;
        }
        if (i < body) l1[i % DEF_LANES] += u, l2[i % DEF_LANES] += v;
        else t1 += u, t2 += v;
    }
    for (int k = 0; k < DEF_LANES; k++) t1 += l1[k], t2 += l2[k];
    *s1 = t1;
    *s2 = t2;
}

/* batchnorm_stats by definition: per block the shift c = (its sum, as above) / len, the moments about c, merged in
 * sample then block order by Chan's update in double. */
static void def_stats(double *mean, double *var, const float *x, int N, int C, size_t inner) {
    for (int ch = 0; ch < C; ch++) {
        double cnt = 0.0, m = 0.0, m2 = 0.0;
        for (int n = 0; n < N; n++)
            for (size_t i0 = 0; i0 < inner; i0 += DEF_BLOCK) {
                const float *xp = x + ((size_t)n * C + ch) * inner + i0;
                const size_t len = inner - i0 < DEF_BLOCK ? inner - i0 : DEF_BLOCK;
                float sum, unused, s1, s2;
                def_block_sums(NULL, xp, len, 0.0f, false, 0.0f, 0.0f, &sum, &unused); /* (x - 0): x itself */
                const float c = sum / (float)len;
                def_block_sums(NULL, xp, len, c, false, 0.0f, 0.0f, &s1, &s2);
                const double nb = (double)len, mb = c + (double)s1 / nb, m2b = (double)s2 - (double)s1 * s1 / nb;
                const double tot = cnt + nb, delta = mb - m;
                m += delta * nb / tot;
                m2 += m2b + delta * delta * cnt * nb / tot;
                cnt = tot;
            }
        mean[ch] = m;
        var[ch] = (m2 > 0.0 ? m2 : 0.0) / cnt;
    }
}

/* batchnorm_grad_sums(_relu) by definition: the blocks' float sums added in double in sample then block order. */
static void def_grad_sums(double *sdy, double *dot, const float *dy, const float *x, const float *mean,
                          const float *scale, const float *beta, int N, int C, size_t inner) {
    for (int ch = 0; ch < C; ch++) {
        double s = 0.0, d = 0.0;
        for (int n = 0; n < N; n++)
            for (size_t i0 = 0; i0 < inner; i0 += DEF_BLOCK) {
                const size_t off = ((size_t)n * C + ch) * inner + i0;
                const size_t len = inner - i0 < DEF_BLOCK ? inner - i0 : DEF_BLOCK;
                float bs, bd;
                def_block_sums(dy + off, x + off, len, mean[ch], scale != NULL, scale ? scale[ch] : 0.0f,
                               beta ? beta[ch] : 0.0f, &bs, &bd);
                s += bs;
                d += bd;
            }
        sdy[ch] = s;
        dot[ch] = d;
    }
}

/* batchnorm_stats, batchnorm_grad_sums and batchnorm_grad_sums_relu (which reduce 16 blocks at once) are their
 * blocked definition bit for bit, for one-block planes, the 16-plane groups and their remainder, and planes of
 * several blocks; batchnorm_stats_planes over the planes' batchnorm_plane_moments (one at a time, or many in one
 * call) is batchnorm_stats, bit for bit, at every plane size batchnorm_plane_fits takes; sizes outside it are
 * refused. */
static void test_plane_moments_kernel(void) {
    static const size_t inners[] = {16, 17, 31, 49, 196, 784, 1000, 1024, 1030, 2100};
    enum { N = 20, C = 3 };
    for (size_t k = 0; k < sizeof inners / sizeof *inners; k++) {
        const size_t inner = inners[k], n = (size_t)N * C * inner;
        /* an offset far from 0, where a shift-free sum of squares would cancel */
        float *x = test_random_uniform(n, 40 + k, 3.0f, 5.0f), *dy = test_random_uniform(n, 50 + k, -1.0f, 1.0f);
        double m[C], v[C], mp[C], vp[C];
        batchnorm_stats(m, v, x, N, C, inner, 0, C);
        def_stats(mp, vp, x, N, C, inner);
        bool same = !memcmp(m, mp, sizeof m) && !memcmp(v, vp, sizeof v);
        float mf[C], scale[C], beta[C];
        for (int c = 0; c < C; c++) mf[c] = (float)m[c], scale[c] = c % 2 ? -1.3f : 0.9f, beta[c] = 0.2f * c - 0.1f;
        for (int relu = 0; relu < 2; relu++) {
            double s[C], d[C], sd[C], dd[C];
            if (relu) batchnorm_grad_sums_relu(s, d, dy, x, mf, scale, beta, N, C, inner, 0, C);
            else batchnorm_grad_sums(s, d, dy, x, mf, N, C, inner, 0, C);
            def_grad_sums(sd, dd, dy, x, mf, relu ? scale : NULL, relu ? beta : NULL, N, C, inner);
            same &= !memcmp(s, sd, sizeof s) && !memcmp(d, dd, sizeof d);
        }
        if (!same) fprintf(stderr, "\n  batch norm sums, inner %zu: not their definition's bits\n", inner);
        CU_ASSERT(same);
        CU_ASSERT(batchnorm_plane_fits(inner) == (inner <= 1024));
        if (batchnorm_plane_fits(inner)) {
            float *m3 = malloc((size_t)N * C * 3 * sizeof *m3), *m3one = malloc((size_t)N * C * 3 * sizeof *m3);
            batchnorm_plane_moments(m3, x, inner, N * C);
            for (size_t p = 0; p < (size_t)N * C; p++) batchnorm_plane_moments(m3one + 3 * p, x + p * inner, inner, 1);
            CU_ASSERT(!memcmp(m3, m3one, (size_t)N * C * 3 * sizeof *m3));
            batchnorm_stats_planes(mp, vp, m3, N, C, inner, 0, C);
            same = !memcmp(m, mp, sizeof m) && !memcmp(v, vp, sizeof v);
            if (!same) fprintf(stderr, "\n  plane moments, inner %zu: not batchnorm_stats's bits\n", inner);
            CU_ASSERT(same);
            /* a channel range alone gives the same bits */
            batchnorm_stats_planes(mp, vp, m3, N, C, inner, 1, 3);
            CU_ASSERT(!memcmp(m + 1, mp + 1, 2 * sizeof *m) && !memcmp(v + 1, vp + 1, 2 * sizeof *v));
            free(m3), free(m3one);
        }
        free(x), free(dy);
    }
    CU_ASSERT(!batchnorm_plane_fits(15));
}

typedef struct {
    int N, C, H, W, OC, K, stride, pad, groups;
    bool made; /* whether the conv makes the moments (in training) */
    const char *what;
} ConvBnCase;

enum { RESULTS = 7 }; /* bn output, dx, dw, dgamma, dbeta, running mean, running var */

typedef struct {
    float *v[RESULTS];
    size_t n[RESULTS];
} ConvBnResult;

/* A batch norm's running statistics as PyTorch starts them (mean 0, variance 1), for up to 64 channels. */
typedef struct {
    float mean[64], var[64];
    int64_t count;
    BatchNormState s;
} RunBn;

static void run_bn_init(RunBn *b, int C) {
    CU_ASSERT_FATAL(C <= 64);
    memset(b, 0, sizeof *b);
    for (int k = 0; k < C; k++) b->var[k] = 1.0f;
    b->s = (BatchNormState){b->mean, b->var, &b->count, 0.1f, 1e-5f, false};
}

/* The backward of out from a random dy of its size. */
static void backward_run(TestEnv *e, Var *out) {
    float *dy = test_random_uniform(var_numel(out), 77, -1.0f, 1.0f);
    CU_ASSERT_FATAL(tape_backward_from(&e->tape, out, dy) == QT_OK);
    free(dy);
}

/* r = copies of the results (src[q], len[q] floats each; NULL: zeros), taken after the backward (the gradients'
 * buffers are made by it). */
static void results_take(const float *const src[RESULTS], const size_t len[RESULTS], ConvBnResult *r) {
    for (int q = 0; q < RESULTS; q++) {
        r->n[q] = len[q];
        r->v[q] = calloc(len[q], sizeof(float));
        if (src[q]) memcpy(r->v[q], src[q], len[q] * sizeof(float));
    }
}

/* conv -> batch norm (gamma, beta, running statistics) and a backward from dy, in training; with_moments: the
 * conv as the batch norm's producer (nn_conv2d_general_bn). *made: whether the conv's output carried moments. */
static void conv_bn_run(const ConvBnCase *c, bool with_moments, bool training, const float *x, const float *w,
                        const float *gb, ConvBnResult *r, bool *made) {
    const int OH = (c->H + 2 * c->pad - c->K) / c->stride + 1, OW = (c->W + 2 * c->pad - c->K) / c->stride + 1;
    const size_t nx = (size_t)c->N * c->C * c->H * c->W, nw = (size_t)c->OC * (c->C / c->groups) * c->K * c->K;
    const size_t ny = (size_t)c->N * c->OC * OH * OW;
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.training = training;
    RunBn bn;
    run_bn_init(&bn, c->OC);
    Var *xv = test_var(&e, x, 4, (int[]){c->N, c->C, c->H, c->W}, true);
    Var *wv = test_var(&e, w, 4, (int[]){c->OC, c->C / c->groups, c->K, c->K}, true);
    Var *gv = test_var(&e, gb, 1, &c->OC, true), *bv = test_var(&e, gb + c->OC, 1, &c->OC, true);
    ConvGeom2d g = conv_geom2d(c->stride, c->pad);
    g.groups = c->groups;
    Var *y = with_moments ? nn_conv2d_general_bn(&e.tape, xv, wv, NULL, &g)
                          : nn_conv2d_general(&e.tape, xv, wv, NULL, &g);
    CU_ASSERT_FATAL(y != NULL);
    *made = y->moments != NULL;
    Var *z = nn_batchnorm(&e.tape, y, gv, bv, &bn.s);
    CU_ASSERT_FATAL(z != NULL);
    backward_run(&e, z);
    results_take((const float *[RESULTS]){z->value.data, xv->grad, wv->grad, gv->grad, bv->grad, bn.mean, bn.var},
                 (const size_t[RESULTS]){ny, nx, nw, (size_t)c->OC, (size_t)c->OC, (size_t)c->OC, (size_t)c->OC}, r);
    test_env_free(&e);
}

static void conv_bn_result_free(ConvBnResult *r) {
    for (int q = 0; q < RESULTS; q++) free(r->v[q]);
}

/* On every route (plain 3x3, 1x1, strided; depthwise at stride 1 and 2, with a channel multiplier), the conv
 * made for a batch norm gives the batch norm's output, every gradient and the running statistics of the plain
 * pair at the same thread count (1 and 2), bit for bit; the moments are made where the route and plane size
 * allow, in training only, and left to the batch norm elsewhere (grouped, planes under 16 or over 1024 values). */
static void test_conv_bn_same_bits(void) {
    static const ConvBnCase cases[] = {
        {3, 3, 8, 8, 4, 3, 1, 1, 1, true, "plain 3x3"},
        {2, 4, 9, 9, 5, 1, 1, 0, 1, true, "plain 1x1"},
        {2, 3, 10, 10, 4, 3, 2, 1, 1, true, "plain 3x3 stride 2"},
        {3, 4, 10, 10, 4, 3, 1, 1, 4, true, "depthwise stride 1"},
        {2, 3, 7, 7, 6, 3, 1, 1, 3, true, "depthwise x2 stride 1"},
        {2, 4, 11, 11, 4, 3, 2, 1, 4, true, "depthwise stride 2"},
        {2, 4, 8, 8, 4, 3, 1, 1, 2, false, "grouped"},
        {4, 2, 3, 3, 3, 3, 1, 1, 1, false, "planes of 9"},
        {1, 2, 34, 34, 3, 3, 1, 1, 1, false, "planes of 1156"},
    };
    const int before = parallel_get_threads();
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const ConvBnCase *c = &cases[k];
        const size_t nx = (size_t)c->N * c->C * c->H * c->W, nw = (size_t)c->OC * (c->C / c->groups) * c->K * c->K;
        float *x = test_random_uniform(nx, 10 + k, -1.0f, 2.0f), *w = test_random_uniform(nw, 20 + k, -0.5f, 0.5f);
        float *gb = test_random_uniform(2 * (size_t)c->OC, 30 + k, 0.5f, 1.5f);
        bool made;
        for (int th = 1; th <= 2; th++) { /* a plain conv's weight gradient is summed per task: one count at a time */
            parallel_set_threads(th);
            ConvBnResult ref, got;
            conv_bn_run(c, false, true, x, w, gb, &ref, &made);
            CU_ASSERT(!made);
            conv_bn_run(c, true, true, x, w, gb, &got, &made);
            if (made != c->made) fprintf(stderr, "\n  %s: moments %s\n", c->what, made ? "made" : "not made");
            CU_ASSERT(made == c->made);
            for (int q = 0; q < RESULTS; q++) {
                const bool same = !memcmp(ref.v[q], got.v[q], ref.n[q] * sizeof(float));
                if (!same) fprintf(stderr, "\n  %s, %d thread(s): result %d differs\n", c->what, th, q);
                CU_ASSERT(same);
            }
            conv_bn_result_free(&got);
            conv_bn_result_free(&ref);
        }
        /* eval: running statistics, nothing to make */
        ConvBnResult ev;
        conv_bn_run(c, true, false, x, w, gb, &ev, &made);
        CU_ASSERT(!made);
        conv_bn_result_free(&ev);
        free(x), free(w), free(gb);
    }
    parallel_set_threads(before);
}

/* model_graph_conv_bn: a conv whose only reader is a batch norm (its first input), not one with a second reader,
 * one read by a relu, or a batch norm read by a conv; model_forward then runs the conv so, and its output carries
 * the moments in training only. */
static void test_model_conv_bn(void) {
    enum { N = 3, C = 2, HW = 6 };
    LayerSpec layers[9];
    int n = 0;
    layers[n++] = test_layer(LAYER_CONV2D, "c0", NULL, NULL);      /* 0: read by bn0 alone */
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn0", NULL, NULL); /* 1 */
    layers[n++] = test_layer(LAYER_CONV2D, "c1", NULL, NULL);      /* 2: read by bn1 and the add */
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn1", NULL, NULL); /* 3 */
    layers[n++] = test_layer(LAYER_ADD, "sum", "bn1", "c1");        /* 4 */
    layers[n++] = test_layer(LAYER_CONV2D, "c2", NULL, NULL);      /* 5: read by a relu */
    layers[n++] = test_layer(LAYER_RELU, "r", NULL, NULL);          /* 6 */
    layers[n++] = test_layer(LAYER_FLATTEN, "f", NULL, NULL);       /* 7 */
    layers[n] = test_layer(LAYER_DENSE, "head", NULL, NULL);        /* 8 */
    layers[n++].units = 3;
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){C, HW, HW}, layers, n, &err), QT_OK);
    CU_ASSERT(model_graph_conv_bn(&m, 0));
    CU_ASSERT(!model_graph_conv_bn(&m, 1));
    CU_ASSERT(!model_graph_conv_bn(&m, 2));
    CU_ASSERT(!model_graph_conv_bn(&m, 5));
    Rng r;
    rng_init(&r, 5, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    float *x = test_random_uniform((size_t)N * C * HW * HW, 6, -1.0f, 1.0f);
    m.keep_outputs = true;
    for (int training = 0; training < 2; training++) {
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = training;
        e.tape.grad_enabled = training;
        Var *y = model_forward(&m, &e.tape, test_var(&e, x, 4, (int[]){N, C, HW, HW}, false));
        CU_ASSERT_FATAL(y != NULL);
        CU_ASSERT((m.outs[1]->moments != NULL) == (training == 1));
        CU_ASSERT(m.outs[3]->moments == NULL);
        CU_ASSERT(!m.outs[6] || m.outs[6]->moments == NULL); /* fused with its relu: never made */
        test_env_free(&e);
    }
    free(x);
    model_free(&m);
}

/* ---- a batch norm + relu read by a conv through a view ---------------------------------------------------- */

typedef struct {
    int N, C, H, W, M, K, pad, dil; /* M: output channels per input channel */
    bool plain;                     /* one group (nn_conv2d's routes), else depthwise */
    int stride;
    const char *what;
} ViewCase;

/* x -> batch norm (gamma, beta, running statistics) -> relu -> conv (plain, or depthwise stride 1) -> backward; view:
 * the batch norm as nn_batchnorm_relu_view, else nn_batchnorm_relu. Results as ConvBnResult: the conv's output,
 * dx, dw, dgamma, dbeta, running mean, running var. */
static void view_run(const ViewCase *c, bool view, const float *x, const float *w, const float *gb, ConvBnResult *r) {
    const int OC = c->M * c->C, OH = (c->H + 2 * c->pad - c->dil * (c->K - 1) - 1) / c->stride + 1;
    const int OW = (c->W + 2 * c->pad - c->dil * (c->K - 1) - 1) / c->stride + 1, Cg = c->plain ? c->C : 1;
    const size_t nx = (size_t)c->N * c->C * c->H * c->W, nw = (size_t)OC * Cg * c->K * c->K;
    const size_t ny = (size_t)c->N * OC * OH * OW;
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.training = true;
    RunBn bn;
    run_bn_init(&bn, c->C);
    Var *xv = test_var(&e, x, 4, (int[]){c->N, c->C, c->H, c->W}, true);
    Var *wv = test_var(&e, w, 4, (int[]){OC, Cg, c->K, c->K}, true);
    Var *gv = test_var(&e, gb, 1, &c->C, true), *bv = test_var(&e, gb + c->C, 1, &c->C, true);
    Var *b = view ? nn_batchnorm_relu_view(&e.tape, xv, gv, bv, &bn.s) : nn_batchnorm_relu(&e.tape, xv, gv, bv, &bn.s);
    CU_ASSERT_FATAL(b != NULL);
    CU_ASSERT((b->value.data == NULL) == view && (b->view != NULL) == view);
    Var *rl = nn_batchnorm_relu_inplace(&e.tape, b);
    CU_ASSERT_FATAL(rl != NULL);
    CU_ASSERT((rl->view != NULL) == view);
    ConvGeom2d g = conv_geom2d(c->stride, c->pad);
    g.groups = c->plain ? 1 : c->C, g.dil_h = g.dil_w = c->dil;
    Var *y = nn_conv2d_general(&e.tape, rl, wv, NULL, &g);
    CU_ASSERT_FATAL(y != NULL);
    backward_run(&e, y);
    results_take((const float *[RESULTS]){y->value.data, xv->grad, wv->grad, gv->grad, bv->grad, bn.mean, bn.var},
                 (const size_t[RESULTS]){ny, nx, nw, (size_t)c->C, (size_t)c->C, (size_t)c->C, (size_t)c->C}, r);
    test_env_free(&e);
}

/* A conv reading the batch norm + relu through its view gives the conv's output, every gradient and the running
 * statistics of the written pair, bit for bit, on 1 and 2 threads; the view's buffer is never made. Depthwise
 * stride 1: rows shorter than 8, 8 and over, a channel multiplier, dilation; plain: 3x3 "same", pointwise (the
 * input read as its own im2col), strided, and planes of more than one chunk. */
static void test_bn_relu_view_same_bits(void) {
    static const ViewCase cases[] = {
        {3, 4, 14, 14, 1, 3, 1, 1, false, 1, "depthwise: DS-CNN's 14x14, 3x3"},
        {2, 3, 5, 6, 2, 3, 1, 1, false, 1, "depthwise: rows of 6, multiplier 2"},
        {2, 2, 9, 11, 1, 3, 2, 2, false, 1, "depthwise: rows of 11, dilation 2"},
        {2, 3, 8, 8, 1, 5, 2, 1, false, 1, "depthwise: rows of 8, 5x5"},
        {3, 4, 9, 7, 2, 3, 1, 1, true, 1, "plain 3x3 same"},
        {3, 5, 6, 6, 2, 1, 0, 1, true, 1, "plain pointwise"},
        {2, 3, 11, 10, 2, 3, 1, 1, true, 2, "plain 3x3 stride 2"},
        {5, 16, 28, 28, 1, 3, 1, 1, true, 1, "plain 3x3, one sample a chunk"},
    };
    const int before = parallel_get_threads();
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const ViewCase *c = &cases[k];
        const size_t nx = (size_t)c->N * c->C * c->H * c->W;
        const size_t nw = (size_t)c->M * c->C * (c->plain ? c->C : 1) * c->K * c->K;
        float *x = test_random_uniform(nx, 60 + k, -2.0f, 2.0f), *w = test_random_uniform(nw, 70 + k, -0.5f, 0.5f);
        float *gb = test_random_uniform(2 * (size_t)c->C, 80 + k, -1.0f, 1.0f); /* some gammas negative */
        for (int th = 1; th <= 2; th++) {
            parallel_set_threads(th);
            ConvBnResult ref, got;
            view_run(c, false, x, w, gb, &ref);
            view_run(c, true, x, w, gb, &got);
            for (int q = 0; q < RESULTS; q++) {
                const bool same = !memcmp(ref.v[q], got.v[q], ref.n[q] * sizeof(float));
                if (!same) fprintf(stderr, "\n  view, %s, %d thread(s): result %d differs\n", c->what, th, q);
                CU_ASSERT(same);
            }
            conv_bn_result_free(&ref), conv_bn_result_free(&got);
        }
        free(x), free(w), free(gb);
    }
    parallel_set_threads(before);
    /* only the plain and the depthwise stride-1 routes read a view: a grouped conv and a strided depthwise one
     * refuse it */
    for (int kind = 0; kind < 2; kind++) {
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = true;
        float xs[2 * 2 * 4 * 4], ws[4 * 2 * 9], rm[2] = {0}, rv[2] = {1, 1};
        for (size_t i = 0; i < sizeof xs / sizeof *xs; i++) xs[i] = (float)(i % 7) - 3.0f;
        for (size_t i = 0; i < sizeof ws / sizeof *ws; i++) ws[i] = 0.1f * (float)(i % 5);
        int64_t count = 0;
        BatchNormState bn = {rm, rv, &count, 0.1f, 1e-5f, false};
        Var *b = nn_batchnorm_relu_view(&e.tape, test_var(&e, xs, 4, (int[]){2, 2, 4, 4}, true), NULL, NULL, &bn);
        Var *rl = nn_batchnorm_relu_inplace(&e.tape, b);
        CU_ASSERT_FATAL(rl != NULL);
        float xs4[2 * 4 * 4 * 4];
        for (size_t i = 0; i < sizeof xs4 / sizeof *xs4; i++) xs4[i] = (float)(i % 7) - 3.0f;
        ConvGeom2d g = conv_geom2d(kind ? 2 : 1, 1);
        g.groups = 2;
        Var *w = test_var(&e, ws, 4, kind ? (int[]){2, 1, 3, 3} : (int[]){4, 2, 3, 3}, true);
        if (!kind) { /* 4 channels in 2 groups */
            float rm4[4] = {0}, rv4[4] = {1, 1, 1, 1};
            BatchNormState bn4 = {rm4, rv4, &count, 0.1f, 1e-5f, false};
            rl = nn_batchnorm_relu_inplace(
                &e.tape, nn_batchnorm_relu_view(&e.tape, test_var(&e, xs4, 4, (int[]){2, 4, 4, 4}, true), NULL, NULL,
                                                &bn4));
            CU_ASSERT_FATAL(rl != NULL);
        }
        CU_ASSERT_PTR_NULL(nn_conv2d_general(&e.tape, rl, w, NULL, &g));
        CU_ASSERT(e.tape.err.status == QT_ERR_ARG && test_msg_has(&e.tape.err, "nn_batchnorm_relu_view"));
        test_env_free(&e);
    }
}

/* model_graph_bn_relu_view: a batch norm whose relu feeds a depthwise stride-1 conv or a plain conv alone (not a
 * strided depthwise one); and a small depthwise-separable model (a first conv whose output the step
 * would drop and remake, then batch norm, relu, depthwise conv, ..., pointwise conv) trains one step to the same
 * loss, gradients and running statistics with the views (and the step's memory plan) as with every output kept,
 * which runs neither. */
static void test_model_bn_relu_view(void) {
    enum { N = 4, C = 3, HW = 8 };
    LayerSpec layers[16];
    int n = 0;
    layers[n] = test_layer(LAYER_CONV2D, "c0", NULL, NULL);          /* 0: 1 channel in: cheap, remade */
    layers[n++].out_channels = C;
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn0", NULL, NULL);   /* 1: viewed */
    layers[n++] = test_layer(LAYER_RELU, "r0", NULL, NULL);           /* 2 */
    layers[n] = test_layer(LAYER_CONV2D, "dw", NULL, NULL);           /* 3: depthwise, stride 1 */
    layers[n].out_channels = C, layers[n++].groups = C;
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn1", NULL, NULL);   /* 4: viewed by a plain (pointwise) conv */
    layers[n++] = test_layer(LAYER_RELU, "r1", NULL, NULL);           /* 5 */
    layers[n] = test_layer(LAYER_CONV2D, "pw", NULL, NULL);           /* 6 */
    layers[n].out_channels = C, layers[n].kernel = 1, layers[n++].padding = 0;
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn2", NULL, NULL);   /* 7: its relu feeds a strided depthwise conv */
    layers[n++] = test_layer(LAYER_RELU, "r2", NULL, NULL);           /* 8 */
    layers[n] = test_layer(LAYER_CONV2D, "dws", NULL, NULL);          /* 9 */
    layers[n].out_channels = C, layers[n].groups = C, layers[n++].stride = 2;
    layers[n++] = test_layer(LAYER_BATCHNORM2D, "bn3", NULL, NULL);   /* 10: viewed */
    layers[n++] = test_layer(LAYER_RELU, "r3", NULL, NULL);           /* 11 */
    layers[n] = test_layer(LAYER_CONV2D, "dw2", NULL, NULL);          /* 12 */
    layers[n].out_channels = 2 * C, layers[n++].groups = C;
    layers[n++] = test_layer(LAYER_GLOBALAVGPOOL, "gap", NULL, NULL); /* 13 */
    layers[n++] = test_layer(LAYER_FLATTEN, "f", NULL, NULL);         /* 14 */
    layers[n] = test_layer(LAYER_DENSE, "head", NULL, NULL);          /* 15 */
    layers[n++].units = 3;
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){1, HW, HW}, layers, n, &err), QT_OK);
    CU_ASSERT(model_graph_bn_relu_view(&m, 1));
    CU_ASSERT(model_graph_bn_relu_view(&m, 4));
    CU_ASSERT(!model_graph_bn_relu_view(&m, 7));
    CU_ASSERT(model_graph_bn_relu_view(&m, 10));
    CU_ASSERT(!model_graph_bn_relu_view(&m, 3));
    Rng r;
    rng_init(&r, 9, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    float *x = test_random_uniform((size_t)N * HW * HW, 8, -1.0f, 1.0f);
    TestStepResults res[2];
    for (int keep = 0; keep < 2; keep++) {
        m.keep_outputs = keep;
        test_model_step_reset(&m);
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = true;
        e.tape.grad_enabled = true;
        Var *y = model_forward(&m, &e.tape, test_var(&e, x, 4, (int[]){N, 1, HW, HW}, false));
        CU_ASSERT_FATAL(y != NULL);
        if (!keep) CU_ASSERT(m.outs[2] && m.outs[2]->view && m.outs[5] && m.outs[5]->view && m.outs[11] &&
                             m.outs[11]->view && m.outs[8] && !m.outs[8]->view);
        /* c0's output, the view's source, read by the depthwise conv after bn0: dropped once that conv ran (it is
         * made again for the backward), not held to the end of the step */
        if (!keep) CU_ASSERT(m.outs[1] && m.outs[1]->value.data == NULL && m.outs[1]->remake);
        test_model_step_take(&m, &e, y, &res[keep]);
        test_env_free(&e);
    }
    test_model_step_same(&res[0], &res[1], "model with views against the kept outputs");
    free(x);
    model_free(&m);
}

int register_nn_conv_bn_suite(void) {
    CU_pSuite s = CU_add_suite("nn_conv_bn", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "batch norm sums = their blocked definition; plane moments merged = batchnorm_stats",
                        test_plane_moments_kernel) ||
                   !CU_add_test(s, "conv made for a batch norm = conv + batch norm, bit for bit",
                                test_conv_bn_same_bits) ||
                   !CU_add_test(s, "model_graph_conv_bn and the model's forward", test_model_conv_bn) ||
                   !CU_add_test(s, "batch norm + relu viewed by a conv = written, bit for bit",
                                test_bn_relu_view_same_bits) ||
                   !CU_add_test(s, "model_graph_bn_relu_view; a model's step with views = all outputs kept",
                                test_model_bn_relu_view)
               ? -1
               : 0;
}
