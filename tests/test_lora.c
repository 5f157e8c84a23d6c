/* test_lora.c - LoRA adapters: a fresh adapter leaves the base unchanged;
 * gradients of A, B and the input (dense and conv, over the layer's own op
 * and over another forward hook) against finite differences; merging;
 * scales; dropout; init statistics; spec errors. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lora/lora.h"
#include "nn/ops.h"
#include "test_lora.h"
#include "test_util.h"

#define YMAX 256 /* room for every output in this file */

static LayerSpec dense(const char *name, int units) {
    LayerSpec s = {.type = LAYER_DENSE, .units = units};
    snprintf(s.name, sizeof s.name, "%s", name);
    return s;
}
static LayerSpec conv(const char *name, int oc, int k, int stride, int pad) {
    LayerSpec s = {.type = LAYER_CONV2D, .out_channels = oc, .kernel = k, .stride = stride, .padding = pad};
    snprintf(s.name, sizeof s.name, "%s", name);
    return s;
}
static LoraSpec lspec(int rank, float alpha, float dropout) {
    return (LoraSpec){.rank = rank, .alpha = alpha, .dropout = dropout, .init = LORA_INIT_DEFAULT};
}

/* A one-layer model with random parameters. */
static void model_one(Model *m, int ndim, const int *shape, LayerSpec l, uint64_t seed) {
    CU_ASSERT_EQUAL_FATAL(model_init(m, ndim, shape, &l, 1, NULL), QT_OK);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    model_init_params(m, &r);
}

/* A per its init, then B random, so the adapter path is not zero. */
static void adapter_randomize(LoraAdapter *a, uint64_t seed) {
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    lora_adapter_init_params(a, &r);
    rng_fill_normal(&r, a->B.var.value.data, var_numel(&a->B.var), 0.0f, 0.5f);
}

/* What the owner of a module and its adapter does to take the adapter out. */
static void adapter_uninstall(LoraAdapter *a) {
    a->module->forward_hook = a->base_fn;
    a->module->hook_ctx = a->base_ctx;
    a->installed = false;
}

static void fill_normal(float *x, size_t n, uint64_t seed) {
    Rng r;
    rng_init(&r, seed, 77);
    rng_fill_normal(&r, x, n, 0.0f, 1.0f);
}

/* The model's output on x (no gradients) into y [YMAX]; its numel. */
static size_t forward_copy(Model *m, TestEnv *e, const float *x, int ndim, const int *shape, bool training, float *y) {
    return test_forward_copy(m, e, x, ndim, shape, training, y, YMAX);
}

/* The layers most tests adapt: dense, and conv with stride 2 and padding 1. */
typedef struct {
    const char *what;
    int in_ndim, in_shape[3];
    LayerSpec layer;
    int x_ndim, x_shape[4];
} Case;

static const Case *cases(void) {
    static Case c[2];
    c[0] = (Case){"dense", 1, {6}, dense("fc", 5), 2, {4, 6}};
    c[1] = (Case){"conv", 3, {2, 6, 6}, conv("conv", 3, 3, 2, 1), 4, {2, 2, 6, 6}};
    return c;
}

static size_t case_numel(const Case *c) {
    size_t n = 1;
    for (int i = 0; i < c->x_ndim; i++) n *= (size_t)c->x_shape[i];
    return n;
}

/* ---- a fresh adapter changes nothing ---------------------------------------- */

/* B = 0 makes the adapter path exactly +0, so base + 0 is the base bit for
 * bit, in eval and in training with dropout (which acts on the adapter's
 * input only). */
static void test_fresh_adapter_is_identity(void) {
    for (int k = 0; k < 2; k++) {
        const Case *c = &cases()[k];
        Model m;
        model_one(&m, c->in_ndim, c->in_shape, c->layer, 10 + k);
        float x[YMAX], y0[YMAX], y1[YMAX], y2[YMAX];
        fill_normal(x, case_numel(c), 20 + k);
        TestEnv e;
        test_env_init(&e, 1);
        size_t n = forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, y0);
        LoraAdapter a;
        LoraSpec s = lspec(2, 4.0f, 0.5f);
        CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, &m.modules[0], &s, NULL), QT_OK);
        Rng r;
        rng_init(&r, 3, RNG_STREAM_INIT);
        lora_adapter_init_params(&a, &r);
        lora_adapter_install(&a);
        CU_ASSERT(a.installed && a.base_fn == NULL && m.modules[0].hook_ctx == &a);
        CU_ASSERT_PTR_NOT_NULL(m.modules[0].forward_hook);
        CU_ASSERT_EQUAL(forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, y1), n);
        forward_copy(&m, &e, x, c->x_ndim, c->x_shape, true, y2);
        if (memcmp(y0, y1, n * sizeof(float)) || memcmp(y0, y2, n * sizeof(float)))
            fprintf(stderr, "\n  %s: a fresh adapter changed the output\n", c->what);
        CU_ASSERT_EQUAL(memcmp(y0, y1, n * sizeof(float)), 0);
        CU_ASSERT_EQUAL(memcmp(y0, y2, n * sizeof(float)), 0);
        test_env_free(&e);
        lora_adapter_free(&a);
        model_free(&m);
    }
}

/* ---- gradients ------------------------------------------------------------------ */

Var *lora_test_model_fn(Tape *t, Var **in, void *ctx) {
    LoraGradCtx *c = ctx;
    Param *p[2] = {&c->a->A, &c->a->B};
    for (int i = 0; i < 2; i++) {
        size_t n = var_numel(&p[i]->var);
        memcpy(p[i]->var.value.data, in[i + 1]->value.data, n * sizeof(float));
        memset(p[i]->var.grad, 0, n * sizeof(float));
        in[i + 1]->grad = p[i]->var.grad;
    }
    return model_forward(c->model, t, in[0]);
}

/* Gradcheck of x, A and B through the model's forward; the base weight is
 * frozen and must come out with no grad and unchanged. */
static void check_adapter_grads(const char *name, Model *m, LoraAdapter *a, const Case *c) {
    Param *w = m->modules[0].weight;
    param_freeze(w);
    size_t nw = var_numel(&w->var);
    float *w0 = malloc(nw * sizeof(float)), x[YMAX];
    memcpy(w0, w->var.value.data, nw * sizeof(float));
    fill_normal(x, case_numel(c), 5);
    GradcheckInput in[3] = {
        {x, c->x_ndim, {0}, true},
        {a->A.var.value.data, a->A.var.value.ndim, {0}, true},
        {a->B.var.value.data, a->B.var.value.ndim, {0}, true},
    };
    memcpy(in[0].shape, c->x_shape, sizeof c->x_shape);
    memcpy(in[1].shape, a->A.var.value.shape, sizeof in[1].shape);
    memcpy(in[2].shape, a->B.var.value.shape, sizeof in[2].shape);
    LoraGradCtx ctx = {m, a};
    CU_ASSERT(gradcheck(name, lora_test_model_fn, &ctx, in, 3, 1e-3, 2e-3, 1e-2));
    CU_ASSERT_PTR_NULL(w->var.grad);
    CU_ASSERT_FALSE(w->var.requires_grad);
    CU_ASSERT_EQUAL(memcmp(w0, w->var.value.data, nw * sizeof(float)), 0);
    free(w0);
}

static void test_adapter_grads(void) {
    struct {
        int k, rank;
        float alpha, dropout;
    } runs[] = {{0, 3, 6.0f, 0.0f}, {0, 2, 2.0f, 0.3f}, {1, 2, 3.0f, 0.0f}};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        const Case *c = &cases()[runs[i].k];
        Model m;
        model_one(&m, c->in_ndim, c->in_shape, c->layer, 30 + i);
        LoraAdapter a;
        LoraSpec s = lspec(runs[i].rank, runs[i].alpha, runs[i].dropout);
        CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, &m.modules[0], &s, NULL), QT_OK);
        adapter_randomize(&a, 40 + i);
        lora_adapter_install(&a);
        char name[64];
        snprintf(name, sizeof name, "%s rank %d dropout %g", c->what, runs[i].rank, (double)runs[i].dropout);
        check_adapter_grads(name, &m, &a, c);
        lora_adapter_free(&a);
        model_free(&m);
    }
}

/* ---- over an existing forward hook ----------------------------------------------- */

typedef struct {
    float factor;
    int calls;
} ScaleHook;

/* Stands in for a quantized base: the module's own output, scaled. */
static Var *scale_hook(Tape *t, Module *m, Var *x, void *ctx) {
    ScaleHook *h = ctx;
    h->calls++;
    return nn_scale(t, model_module_forward(t, m, x), h->factor);
}

/* y = factor * (W x + b) + scale * B A x, by hand in double. x (N, in),
 * y (N, out); rank <= 8. */
static void dense_reference(const Module *mod, const LoraAdapter *a, float factor, const float *x, int N, float *y) {
    int in = a->fan_in, out = a->out, r = a->spec.rank;
    const float *W = mod->weight->var.value.data, *b = mod->bias->var.value.data;
    const float *A = a->A.var.value.data, *B = a->B.var.value.data;
    for (int n = 0; n < N; n++) {
        double h[8] = {0};
        for (int k = 0; k < r; k++)
            for (int j = 0; j < in; j++) h[k] += (double)A[k * in + j] * x[n * in + j];
        for (int o = 0; o < out; o++) {
            double base = b[o], u = 0.0;
            for (int j = 0; j < in; j++) base += (double)W[o * in + j] * x[n * in + j];
            for (int k = 0; k < r; k++) u += (double)B[o * r + k] * h[k];
            y[n * out + o] = (float)(factor * base + a->scale * u);
        }
    }
}

static void test_adapter_over_hook(void) {
    const Case *c = &cases()[0];
    Model m;
    model_one(&m, c->in_ndim, c->in_shape, c->layer, 50);
    Module *mod = &m.modules[0];
    ScaleHook h = {-1.5f, 0};
    mod->forward_hook = scale_hook;
    mod->hook_ctx = &h;
    float x[YMAX], y0[YMAX], y1[YMAX], ref[YMAX];
    fill_normal(x, case_numel(c), 51);
    TestEnv e;
    test_env_init(&e, 1);
    size_t n = forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, y0);
    CU_ASSERT_EQUAL(h.calls, 1);
    LoraAdapter a;
    LoraSpec s = lspec(3, 1.5f, 0.0f);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, mod, &s, NULL), QT_OK);
    Rng r;
    rng_init(&r, 4, RNG_STREAM_INIT);
    lora_adapter_init_params(&a, &r);
    lora_adapter_install(&a);
    lora_adapter_install(&a); /* a second install must not chain the adapter onto itself */
    CU_ASSERT(a.base_fn == scale_hook && a.base_ctx == &h);
    CU_ASSERT(mod->forward_hook != scale_hook && mod->hook_ctx == &a);
    forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, y1);
    CU_ASSERT_EQUAL(h.calls, 2);
    CU_ASSERT_EQUAL(memcmp(y0, y1, n * sizeof(float)), 0);
    /* Nonzero B: the hook's output plus the adapter path. */
    adapter_randomize(&a, 52);
    forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, y1);
    dense_reference(mod, &a, h.factor, x, c->x_shape[0], ref);
    ASSERT_ALL_CLOSE(y1, ref, n, 1e-5, 1e-5);
    check_adapter_grads("dense over a hook", &m, &a, c);
    CU_ASSERT(h.calls > 3);
    test_env_free(&e);
    lora_adapter_free(&a);
    model_free(&m);
}

/* ---- merging ------------------------------------------------------------------------- */

/* The merged weight alone gives the adapter's output (conv: a 1x1 conv
 * after a conv is the conv with the product kernel), and the delta is
 * scale * B A in the weight's layout. */
static void test_merge(void) {
    for (int k = 0; k < 2; k++) {
        const Case *c = &cases()[k];
        Model m;
        model_one(&m, c->in_ndim, c->in_shape, c->layer, 60 + k);
        Module *mod = &m.modules[0];
        LoraAdapter a;
        LoraSpec s = lspec(2, 3.0f, 0.0f);
        CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, mod, &s, NULL), QT_OK);
        adapter_randomize(&a, 62 + k);
        lora_adapter_install(&a);
        int fan_in = (int)(var_numel(&mod->weight->var) / (size_t)mod->out_shape[0]);
        CU_ASSERT_EQUAL(a.fan_in, fan_in);
        CU_ASSERT_EQUAL(a.out, mod->out_shape[0]);
        float x[YMAX], y1[YMAX], y2[YMAX];
        fill_normal(x, case_numel(c), 64);
        TestEnv e;
        test_env_init(&e, 1);
        size_t n = forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, y1);
        size_t nw = (size_t)a.out * a.fan_in;
        float *delta = malloc(nw * sizeof(float)), *ref = malloc(nw * sizeof(float));
        float *w = mod->weight->var.value.data, *w0 = malloc(nw * sizeof(float));
        memcpy(w0, w, nw * sizeof(float));
        lora_adapter_delta(&a, delta);
        const float *A = a.A.var.value.data, *B = a.B.var.value.data;
        for (int o = 0; o < a.out; o++)
            for (int j = 0; j < a.fan_in; j++) {
                double acc = 0.0;
                for (int q = 0; q < 2; q++) acc += (double)B[o * 2 + q] * A[q * a.fan_in + j];
                ref[o * a.fan_in + j] = (float)(a.scale * acc);
            }
        ASSERT_ALL_CLOSE(delta, ref, nw, 1e-7, 1e-6);
        lora_adapter_merge(&a, w);
        bool exact = true;
        for (size_t i = 0; i < nw; i++) exact &= w[i] == w0[i] + delta[i];
        CU_ASSERT(exact);
        adapter_uninstall(&a);
        CU_ASSERT_PTR_NULL(mod->forward_hook);
        forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, y2);
        ASSERT_ALL_CLOSE(y2, y1, n, 1e-5, 1e-5);
        free(delta);
        free(ref);
        free(w0);
        test_env_free(&e);
        lora_adapter_free(&a);
        model_free(&m);
    }
}

/* ---- scale ------------------------------------------------------------------------------ */

/* alpha/rank, or alpha/sqrt(rank) with rslora; the adapter path of the
 * forward scales with it. */
static void test_scale_and_rslora(void) {
    const Case *c = &cases()[0];
    Model m;
    model_one(&m, c->in_ndim, c->in_shape, c->layer, 70);
    float x[YMAX], y0[YMAX], yp[YMAX], yr[YMAX];
    fill_normal(x, case_numel(c), 71);
    TestEnv e;
    test_env_init(&e, 1);
    size_t n = forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, y0);
    LoraAdapter plain, rs;
    LoraSpec s = lspec(4, 8.0f, 0.0f);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&plain, &m.modules[0], &s, NULL), QT_OK);
    s.rslora = true;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&rs, &m.modules[0], &s, NULL), QT_OK);
    CU_ASSERT_EQUAL(plain.scale, 2.0f);
    CU_ASSERT_EQUAL(rs.scale, 4.0f);
    adapter_randomize(&plain, 72);
    memcpy(rs.A.var.value.data, plain.A.var.value.data, var_numel(&plain.A.var) * sizeof(float));
    memcpy(rs.B.var.value.data, plain.B.var.value.data, var_numel(&plain.B.var) * sizeof(float));
    lora_adapter_install(&plain);
    forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, yp);
    adapter_uninstall(&plain);
    lora_adapter_install(&rs);
    forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, yr);
    float dp[YMAX], dr[YMAX];
    for (size_t i = 0; i < n; i++) dp[i] = 2.0f * (yp[i] - y0[i]), dr[i] = yr[i] - y0[i];
    ASSERT_ALL_CLOSE(dr, dp, n, 1e-5, 1e-5);
    lora_adapter_free(&plain);
    lora_adapter_free(&rs);
    /* rank 3: 1.5/3 and 1.5/sqrt(3). */
    LoraSpec s3 = lspec(3, 1.5f, 0.0f);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&plain, &m.modules[0], &s3, NULL), QT_OK);
    s3.rslora = true;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&rs, &m.modules[0], &s3, NULL), QT_OK);
    CU_ASSERT_EQUAL(plain.scale, 0.5f);
    CU_ASSERT(fabs(rs.scale - 1.5 / sqrt(3.0)) < 1e-7);
    lora_adapter_free(&plain);
    lora_adapter_free(&rs);
    test_env_free(&e);
    model_free(&m);
}

/* ---- dropout --------------------------------------------------------------------------- */

/* In eval the adapter ignores its dropout; in training a seed fixes the
 * mask, and the result differs from eval. */
static void test_dropout(void) {
    const Case *c = &cases()[0];
    Model m;
    model_one(&m, c->in_ndim, c->in_shape, c->layer, 80);
    LoraAdapter a;
    LoraSpec s = lspec(3, 3.0f, 0.5f);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, &m.modules[0], &s, NULL), QT_OK);
    adapter_randomize(&a, 81);
    lora_adapter_install(&a);
    float x[YMAX], ye[YMAX], ye0[YMAX], yt1[YMAX], yt2[YMAX], yt3[YMAX];
    fill_normal(x, case_numel(c), 82);
    TestEnv e;
    test_env_init(&e, 1);
    size_t n = forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, ye);
    a.spec.dropout = 0.0f;
    forward_copy(&m, &e, x, c->x_ndim, c->x_shape, false, ye0);
    a.spec.dropout = 0.5f;
    CU_ASSERT_EQUAL(memcmp(ye, ye0, n * sizeof(float)), 0);
    rng_init(&e.rng, 42, RNG_STREAM_DROPOUT);
    forward_copy(&m, &e, x, c->x_ndim, c->x_shape, true, yt1);
    rng_init(&e.rng, 42, RNG_STREAM_DROPOUT);
    forward_copy(&m, &e, x, c->x_ndim, c->x_shape, true, yt2);
    rng_init(&e.rng, 43, RNG_STREAM_DROPOUT);
    forward_copy(&m, &e, x, c->x_ndim, c->x_shape, true, yt3);
    CU_ASSERT_EQUAL(memcmp(yt1, yt2, n * sizeof(float)), 0);
    CU_ASSERT_NOT_EQUAL(memcmp(yt1, ye, n * sizeof(float)), 0);
    CU_ASSERT_NOT_EQUAL(memcmp(yt1, yt3, n * sizeof(float)), 0);
    test_env_free(&e);
    lora_adapter_free(&a);
    model_free(&m);
}

/* ---- init --------------------------------------------------------------------------------- */

static void moments(const float *v, size_t n, double *mean, double *std, double *amax) {
    double sum = 0, sq = 0;
    *amax = 0;
    for (size_t i = 0; i < n; i++) sum += v[i], sq += (double)v[i] * v[i], *amax = fmax(*amax, fabs(v[i]));
    *mean = sum / n;
    *std = sqrt(sq / n - *mean * *mean);
}

static bool all_zero(const Var *v) {
    for (size_t i = 0, n = var_numel(v); i < n; i++)
        if (v->value.data[i] != 0.0f) return false;
    return true;
}

/* default: A ~ U(+-1/sqrt(fan_in)), drawn as one rng_fill_uniform over A in
 * row-major order; B = 0. */
static void check_default_init(Model *m, int rank, int fan_in) {
    LoraAdapter a;
    LoraSpec s = lspec(rank, (float)rank, 0.0f);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, &m->modules[0], &s, NULL), QT_OK);
    CU_ASSERT_EQUAL(a.fan_in, fan_in);
    size_t na = var_numel(&a.A.var);
    CU_ASSERT_EQUAL(na, (size_t)rank * fan_in);
    CU_ASSERT_EQUAL(lora_adapter_param_count(&a), na + (size_t)a.out * rank);
    for (size_t i = 0, nb = var_numel(&a.B.var); i < nb; i++) a.B.var.value.data[i] = 1.0f;
    Rng r, r2;
    rng_init(&r, 90, RNG_STREAM_INIT);
    r2 = r;
    lora_adapter_init_params(&a, &r);
    float *want = malloc(na * sizeof(float));
    double bound = 1.0 / sqrt((double)fan_in);
    rng_fill_uniform(&r2, want, na, -(float)bound, (float)bound);
    CU_ASSERT_EQUAL(memcmp(want, a.A.var.value.data, na * sizeof(float)), 0);
    CU_ASSERT_EQUAL(r.counter, r2.counter);
    double mean, std, amax;
    moments(a.A.var.value.data, na, &mean, &std, &amax);
    CU_ASSERT(amax <= bound);
    CU_ASSERT(fabs(std / (bound / sqrt(3.0)) - 1.0) < 0.05);
    CU_ASSERT(all_zero(&a.B.var));
    free(want);
    lora_adapter_free(&a);
}

static void test_init_params(void) {
    Model m;
    model_one(&m, 1, (int[]){400}, dense("fc", 50), 91);
    check_default_init(&m, 8, 400);
    /* Names, shapes and state of the parameters. */
    LoraAdapter a;
    LoraSpec s = lspec(16, 16.0f, 0.0f);
    s.init = LORA_INIT_GAUSSIAN;
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, &m.modules[0], &s, NULL), QT_OK);
    CU_ASSERT_STRING_EQUAL(a.A.name, "fc/lora_A");
    CU_ASSERT_STRING_EQUAL(a.B.name, "fc/lora_B");
    CU_ASSERT(a.A.var.value.ndim == 2 && a.A.var.value.shape[0] == 16 && a.A.var.value.shape[1] == 400);
    CU_ASSERT(a.B.var.value.ndim == 2 && a.B.var.value.shape[0] == 50 && a.B.var.value.shape[1] == 16);
    Param *ps[2] = {&a.A, &a.B};
    for (int i = 0; i < 2; i++) {
        CU_ASSERT(ps[i]->trainable && ps[i]->var.requires_grad && ps[i]->var.is_param && !ps[i]->released);
        CU_ASSERT_PTR_NOT_NULL(ps[i]->var.grad);
    }
    CU_ASSERT(a.out == 50 && a.fan_in == 400 && a.scale == 1.0f && !a.installed);
    /* gaussian: std 1/rank over 6400 draws (the std estimate is within ~1%). */
    Rng r;
    rng_init(&r, 92, RNG_STREAM_INIT);
    a.B.var.value.data[7] = 3.0f;
    lora_adapter_init_params(&a, &r);
    double mean, std, amax;
    moments(a.A.var.value.data, var_numel(&a.A.var), &mean, &std, &amax);
    CU_ASSERT(fabs(std * 16.0 - 1.0) < 0.04);
    CU_ASSERT(fabs(mean) < 0.004);
    CU_ASSERT(all_zero(&a.B.var));
    lora_adapter_free(&a);
    model_free(&m);
    /* conv: fan_in = C*KH*KW = 8*3*3; A (rank, C, KH, KW), B (OC, rank, 1, 1). */
    model_one(&m, 3, (int[]){8, 5, 5}, conv("c", 16, 3, 1, 0), 93);
    check_default_init(&m, 4, 72);
    s = lspec(4, 4.0f, 0.0f);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, &m.modules[0], &s, NULL), QT_OK);
    const int *as = a.A.var.value.shape, *bs = a.B.var.value.shape;
    CU_ASSERT(a.A.var.value.ndim == 4 && as[0] == 4 && as[1] == 8 && as[2] == 3 && as[3] == 3);
    CU_ASSERT(a.B.var.value.ndim == 4 && bs[0] == 16 && bs[1] == 4 && bs[2] == 1 && bs[3] == 1);
    lora_adapter_free(&a);
    model_free(&m);
}

/* ---- errors ------------------------------------------------------------------------------- */

static void expect_spec_error(const LoraSpec *s, const Module *m, const char *what) {
    QtError err = {0};
    CU_ASSERT_EQUAL(lora_spec_check(s, m, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, what));
    /* Every message starts with the module path. */
    size_t len = strlen(m->path);
    CU_ASSERT(strncmp(err.msg, m->path, len) == 0 && err.msg[len] == ':');
}

static void test_spec_errors(void) {
    LayerSpec layers[] = {dense("fc", 4), {.type = LAYER_RELU, .name = "act"}};
    Model m;
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){5}, layers, 2, NULL), QT_OK);
    Module *fc = &m.modules[0], *act = &m.modules[1];
    LoraSpec s = lspec(4, 1.0f, 0.0f);
    CU_ASSERT_EQUAL(lora_spec_check(&s, fc, NULL), QT_OK);
    s.rank = 0;
    expect_spec_error(&s, fc, "lora rank 0 must be at least 1");
    s.rank = 5;
    expect_spec_error(&s, fc, "fc: lora rank 5 is larger than the layer's smaller dimension (out 4, fan_in 5); use "
                              "a rank of at most 4");
    s = lspec(2, 0.0f, 0.0f);
    expect_spec_error(&s, fc, "alpha");
    s = lspec(2, 1.0f, 1.0f);
    expect_spec_error(&s, fc, "dropout must be in [0, 1), got 1");
    s = lspec(2, 1.0f, 0.0f);
    expect_spec_error(&s, act, "dense and conv2d layers only, not relu");
    /* A failed init leaves the adapter zeroed. */
    LoraAdapter a;
    memset(&a, 0xff, sizeof a);
    QtError err = {0};
    s.rank = 9;
    CU_ASSERT_EQUAL(lora_adapter_init(&a, fc, &s, &err), QT_ERR_CONFIG);
    CU_ASSERT(a.module == NULL && a.A.var.value.data == NULL && a.B.var.grad == NULL && !a.installed);
    lora_adapter_free(&a);
    model_free(&m);
    /* conv: fan_in counts the kernel. */
    model_one(&m, 3, (int[]){1, 6, 6}, conv("conv1", 16, 3, 1, 0), 1);
    s.rank = 10;
    expect_spec_error(&s, &m.modules[0], "(out 16, fan_in 9); use a rank of at most 9");
    s.rank = 9;
    CU_ASSERT_EQUAL(lora_spec_check(&s, &m.modules[0], NULL), QT_OK);
    model_free(&m);
    /* Init names. */
    LoraInit init = LORA_INIT_DEFAULT;
    CU_ASSERT_EQUAL(lora_init_parse("GAUSSIAN", &init, NULL), QT_OK);
    CU_ASSERT_EQUAL(init, LORA_INIT_GAUSSIAN);
    CU_ASSERT_EQUAL(lora_init_parse("Default", &init, NULL), QT_OK);
    CU_ASSERT_EQUAL(init, LORA_INIT_DEFAULT);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(lora_init_parse("xavier", &init, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "'xavier' (valid: default, gaussian, loftq, pissa)"));
    CU_ASSERT_STRING_EQUAL(lora_init_name(LORA_INIT_GAUSSIAN), "gaussian");
    CU_ASSERT_STRING_EQUAL(lora_init_name(LORA_INIT_COUNT), "unknown");
}

/* A NULL input gives NULL without touching the base. */
static void test_null_input(void) {
    Model m;
    model_one(&m, 1, (int[]){5}, dense("fc", 4), 1);
    LoraAdapter a;
    LoraSpec s = lspec(2, 2.0f, 0.0f);
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, &m.modules[0], &s, NULL), QT_OK);
    lora_adapter_install(&a);
    TestEnv e;
    test_env_init(&e, 1);
    CU_ASSERT_PTR_NULL(lora_adapter_forward(&e.tape, &a, NULL));
    CU_ASSERT(tape_ok(&e.tape));
    CU_ASSERT_EQUAL(e.tape.n_nodes, 0);
    test_env_free(&e);
    lora_adapter_free(&a);
    model_free(&m);
}

int register_lora_suite(void) {
    CU_pSuite s = CU_add_suite("lora", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "a fresh adapter leaves the output unchanged", test_fresh_adapter_is_identity) ||
           !CU_add_test(s, "gradients of A, B and x (dense, conv s2 p1)", test_adapter_grads) ||
           !CU_add_test(s, "adapter over an existing forward hook", test_adapter_over_hook) ||
           !CU_add_test(s, "merge: delta and merged weight give the same output", test_merge) ||
           !CU_add_test(s, "scale alpha/rank and rslora", test_scale_and_rslora) ||
           !CU_add_test(s, "dropout: eval ignores it, training is seeded", test_dropout) ||
           !CU_add_test(s, "init: default and gaussian statistics, B zero", test_init_params) ||
           !CU_add_test(s, "spec errors and init names", test_spec_errors) ||
           !CU_add_test(s, "NULL input propagates", test_null_input);
}
