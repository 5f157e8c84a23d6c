/* test_dora.c - DoRA adapters (lora/lora_dora.h, lora.rules[].dora): the
 * magnitude starts at the channel norms and a fresh adapter leaves the
 * output unchanged; the gradients of x, A, B, m (and W when it trains)
 * against finite differences, dense, conv and grouped conv, over a float
 * and a quantized base; parity with PyTorch (tests/fixtures/torch_dora.h5);
 * merging equals the unmerged adapter; the step's multiply-adds; tiny runs
 * of tests/configs/tiny-dora.yaml over a float and a QLoRA base: they
 * learn, resume bit for bit, store the magnitude, merge, and refuse
 * mismatched adapter files and a base DoRA cannot normalise. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/h5io.h"
#include "lora/lora_dora.h"
#include "nn/ops.h"
#include "quant/qlayer.h"
#include "test_proc.h"
#include "test_runs.h"
#include "test_util.h"
#include "trainer/hook.h"
#include "trainer/tools.h"

#define YMAX 512 /* room for every output in this file */

static TestRuns dora_runs;

static int dora_suite_init(void) { return test_runs_init(&dora_runs); }
static int dora_suite_cleanup(void) { return test_runs_cleanup(&dora_runs); }

/* ---- a one-layer model with a DoRA adapter --------------------------------------------------- */

typedef struct {
    const char *what;
    int in_ndim, in_shape[3];
    LayerSpec layer;
    int x_ndim, x_shape[4];
    int rank;
    int n_post;           /* layers after the adapted one (a relu and a pool the conv's fused hook folds in) */
    LayerSpec post[2];
} Case;

static LayerSpec dense(int units) {
    LayerSpec s = {.type = LAYER_DENSE, .units = units};
    snprintf(s.name, sizeof s.name, "fc");
    return s;
}
static LayerSpec conv(int oc, int k, int stride, int pad, int groups) {
    LayerSpec s = {.type = LAYER_CONV2D, .out_channels = oc, .kernel = k, .stride = stride, .padding = pad,
                   .groups = groups};
    snprintf(s.name, sizeof s.name, "conv");
    return s;
}

/* fan-ins that are multiples of 8, the quantized base's tile */
static const Case *cases(void) {
    static Case c[3];
    c[0] = (Case){"dense", 1, {8}, dense(5), 2, {3, 8}, 3, .n_post = 0};
    c[1] = (Case){"conv", 3, {2, 5, 5}, conv(3, 2, 2, 1, 1), 4, {2, 2, 5, 5}, 2, .n_post = 0};
    c[2] = (Case){"grouped conv", 3, {4, 4, 4}, conv(4, 2, 1, 0, 2), 4, {2, 4, 4, 4}, 2, .n_post = 0};
    return c;
}

static size_t case_numel(const Case *c) {
    size_t n = 1;
    for (int i = 0; i < c->x_ndim; i++) n *= (size_t)c->x_shape[i];
    return n;
}

typedef struct {
    Model m;
    QLayer q;
    bool quant;
    LoraAdapter a;
} Rig;

static void deq(const void *ctx, float *w) { qlayer_dequantize_weight(ctx, w); }

/* The base (frozen; int4 in tiles of 8 when quant), then, if install, a fresh DoRA adapter over it as
 * hook_lora.c attaches one: the magnitude from the (dequantized) base weight. */
static void rig_init(Rig *r, const Case *c, bool quant, float dropout, bool install, uint64_t seed) {
    memset(r, 0, sizeof *r);
    QtError err = {0};
    LayerSpec layers[3] = {c->layer};
    for (int i = 0; i < c->n_post; i++) layers[1 + i] = c->post[i];
    CU_ASSERT_EQUAL_FATAL(model_init(&r->m, c->in_ndim, c->in_shape, layers, 1 + c->n_post, &err), QT_OK);
    Rng rng;
    rng_init(&rng, seed, RNG_STREAM_INIT);
    model_init_params(&r->m, &rng);
    Module *mod = &r->m.modules[0];
    param_freeze(mod->weight);
    param_freeze(mod->bias);
    r->quant = quant;
    if (quant) {
        QLayerSpec spec = qlayer_spec_default();
        spec.weight_qtype = qtype_find("int4", NULL);
        spec.tile_size = 8;
        CU_ASSERT_EQUAL_FATAL(qlayer_init_quantize(&r->q, mod, &spec, mod->weight->var.value.data, &err), QT_OK);
        param_release(mod->weight);
        qlayer_install(&r->q);
    }
    if (!install) return;
    LoraSpec ls = {.rank = c->rank, .alpha = 3.0f, .dropout = dropout, .dora = true};
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&r->a, mod, &ls, &err), QT_OK);
    lora_adapter_init_params(&r->a, &rng);
    size_t nw = (size_t)r->a.out * r->a.fan_in;
    float *w = malloc(nw * sizeof(float));
    if (quant) {
        r->a.base_weight = deq;
        r->a.base_weight_ctx = &r->q;
        qlayer_dequantize_weight(&r->q, w);
    } else {
        memcpy(w, mod->weight->var.value.data, nw * sizeof(float));
    }
    CU_ASSERT_EQUAL_FATAL(lora_dora_init_magnitude(&r->a, w, &err), QT_OK);
    free(w);
    lora_adapter_install(&r->a);
}

/* B random and m off its start, so every path of the adapter carries something. */
static void rig_randomize(Rig *r, uint64_t seed) {
    Rng rng;
    rng_init(&rng, seed, RNG_STREAM_INIT);
    rng_fill_normal(&rng, r->a.B.var.value.data, var_numel(&r->a.B.var), 0.0f, 0.5f);
    float *m = r->a.M.var.value.data;
    for (int o = 0; o < r->a.out; o++) m[o] *= 1.0f + 0.3f * (float)o / r->a.out - 0.1f;
}

static void rig_free(Rig *r) {
    lora_adapter_free(&r->a);
    if (r->quant) qlayer_free(&r->q);
    model_free(&r->m);
}

static void fill_normal(float *x, size_t n, uint64_t seed) {
    Rng r;
    rng_init(&r, seed, 77);
    rng_fill_normal(&r, x, n, 0.0f, 1.0f);
}

/* The model's output on x (no gradients) into y [YMAX]; its numel. */
static size_t forward_copy(Model *m, TestEnv *e, const float *x, const Case *c, bool training, float *y) {
    return test_forward_copy(m, e, x, c->x_ndim, c->x_shape, training, y, YMAX);
}

/* ---- the magnitude at init; a fresh adapter changes nothing ---------------------------------- */

static void test_magnitude_init(void) {
    for (int k = 0; k < 3; k++)
        for (int quant = 0; quant < 2; quant++) {
            const Case *c = &cases()[k];
            Rig r;
            rig_init(&r, c, quant, 0.0f, true, 10 + k);
            size_t nw = (size_t)r.a.out * r.a.fan_in;
            float *w = malloc(nw * sizeof(float));
            if (quant) qlayer_dequantize_weight(&r.q, w);
            else memcpy(w, r.m.modules[0].weight->var.value.data, nw * sizeof(float));
            CU_ASSERT_EQUAL(var_numel(&r.a.M.var), (size_t)r.a.out);
            CU_ASSERT_STRING_EQUAL(r.a.M.name, k == 0 ? "fc/lora_magnitude" : "conv/lora_magnitude");
            for (int o = 0; o < r.a.out; o++) {
                double s2 = 0.0;
                const float *row = w + (size_t)o * r.a.fan_in;
                for (int j = 0; j < r.a.fan_in; j++) s2 += (double)row[j] * row[j];
                CU_ASSERT_DOUBLE_EQUAL(r.a.M.var.value.data[o], sqrt(s2), 1e-6 * sqrt(s2));
            }
            CU_ASSERT(r.a.M.trainable && r.a.M.var.requires_grad);
            free(w);
            rig_free(&r);
        }
}

/* B = 0 and m = |W|_c: the gain is exactly 1 and the branch exactly 0, so the output is the base's bit for bit, in
 * eval and in training with adapter dropout (where the base runs again on the dropped input, times g - 1 = 0). */
static void test_fresh_is_identity(void) {
    for (int k = 0; k < 3; k++)
        for (int quant = 0; quant < 2; quant++) {
            const Case *c = &cases()[k];
            float x[YMAX], y0[YMAX], y1[YMAX], y2[YMAX];
            fill_normal(x, case_numel(c), 20 + k);
            TestEnv e;
            test_env_init(&e, 1);
            Rig base, r;
            rig_init(&base, c, quant, 0.5f, false, 30 + k);
            size_t n = forward_copy(&base.m, &e, x, c, false, y0);
            rig_init(&r, c, quant, 0.5f, true, 30 + k);
            CU_ASSERT_EQUAL(forward_copy(&r.m, &e, x, c, false, y1), n);
            forward_copy(&r.m, &e, x, c, true, y2);
            if (memcmp(y0, y1, n * sizeof(float)) || memcmp(y0, y2, n * sizeof(float)))
                fprintf(stderr, "\n  %s%s: a fresh DoRA adapter changed the output\n", c->what, quant ? " (int4)" : "");
            CU_ASSERT_EQUAL(memcmp(y0, y1, n * sizeof(float)), 0);
            CU_ASSERT_EQUAL(memcmp(y0, y2, n * sizeof(float)), 0);
            test_env_free(&e);
            rig_free(&base);
            rig_free(&r);
        }
}

/* ---- gradients ------------------------------------------------------------------------------- */

typedef struct {
    Model *model;
    LoraAdapter *a;
    Param *w; /* the base weight when it trains (a float base), else NULL */
} DoraGradCtx;

/* Inputs x, A, B, m (and W): the adapter's parameters take their values, and their grads point at the
 * parameters' persistent grad buffers, where the backward accumulates. */
static Var *dora_model_fn(Tape *t, Var **in, void *ctx) {
    DoraGradCtx *c = ctx;
    Param *p[4] = {&c->a->A, &c->a->B, &c->a->M, c->w};
    for (int i = 0; i < (c->w ? 4 : 3); i++) {
        size_t n = var_numel(&p[i]->var);
        memcpy(p[i]->var.value.data, in[i + 1]->value.data, n * sizeof(float));
        memset(p[i]->var.grad, 0, n * sizeof(float));
        in[i + 1]->grad = p[i]->var.grad;
    }
    return model_forward(c->model, t, in[0]);
}

static void set_input(GradcheckInput *in, const Var *v) {
    *in = (GradcheckInput){v->value.data, v->value.ndim, {0}, true};
    memcpy(in->shape, v->value.shape, sizeof in->shape);
}

static void check_grads(const Case *c, bool quant, float dropout, bool train_w, uint64_t seed) {
    Rig r;
    rig_init(&r, c, quant, dropout, true, seed);
    rig_randomize(&r, seed + 1);
    Param *w = r.m.modules[0].weight;
    if (train_w) {
        w->trainable = w->var.requires_grad = true;
        if (!w->var.grad) w->var.grad = calloc(var_numel(&w->var), sizeof(float));
    }
    float x[YMAX];
    fill_normal(x, case_numel(c), seed + 2);
    GradcheckInput in[5] = {{x, c->x_ndim, {0}, true}};
    memcpy(in[0].shape, c->x_shape, sizeof c->x_shape);
    set_input(&in[1], &r.a.A.var);
    set_input(&in[2], &r.a.B.var);
    set_input(&in[3], &r.a.M.var);
    if (train_w) set_input(&in[4], &w->var);
    DoraGradCtx ctx = {&r.m, &r.a, train_w ? w : NULL};
    char name[96];
    snprintf(name, sizeof name, "DoRA %s%s%s%s", c->what, quant ? " over int4" : "", dropout > 0 ? " dropout" : "",
             train_w ? " W trains" : "");
    CU_ASSERT(gradcheck(name, dora_model_fn, &ctx, in, train_w ? 5 : 4, 1e-3, 2e-3, 1e-2));
    rig_free(&r);
}

/* Whether a training forward of c's rig records an op named `op` (which path the adapter took). */
static bool forward_records(Rig *r, const Case *c, const char *op) {
    float x[YMAX];
    fill_normal(x, case_numel(c), 1);
    TestEnv e;
    test_env_init(&e, 1);
    Var *y = model_forward(&r->m, &e.tape, test_var(&e, x, c->x_ndim, c->x_shape, true));
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    bool found = false;
    for (size_t i = 0; i < e.tape.n_nodes; i++) found |= strcmp(e.tape.nodes[i].op, op) == 0;
    test_env_free(&e);
    return found;
}

/* A conv without adapter dropout runs as one convolution on the merged weight (dora_weight), relu and pool folded
 * in when they follow; with dropout, the base and the branch (dora_combine); a dense layer always the latter. */
static void test_paths(void) {
    Case fused = cases()[1];
    fused.layer = conv(3, 3, 1, 1, 1);
    fused.in_shape[0] = fused.x_shape[1] = 8; /* fan-in 72: whole tiles of 8 */
    fused.in_shape[1] = fused.in_shape[2] = fused.x_shape[2] = fused.x_shape[3] = 6;
    fused.x_shape[0] = 1;
    fused.n_post = 2;
    fused.post[0] = (LayerSpec){.type = LAYER_RELU};
    fused.post[1] = (LayerSpec){.type = LAYER_MAXPOOL2D, .kernel = 2};
    struct {
        const Case *c;
        float dropout;
        const char *has, *lacks;
    } runs[] = {{&cases()[1], 0.0f, "dora_weight", "dora_combine"}, {&cases()[1], 0.3f, "dora_combine", "dora_weight"},
                {&cases()[0], 0.0f, "dora_combine", "dora_weight"}, {&fused, 0.0f, "dora_weight", "relu"},
                {&fused, 0.3f, "dora_combine", "dora_weight"}};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++)
        for (int quant = 0; quant < 2; quant++) {
            Rig r;
            rig_init(&r, runs[i].c, quant, runs[i].dropout, true, 5);
            bool has = forward_records(&r, runs[i].c, runs[i].has);
            bool lacks = !forward_records(&r, runs[i].c, runs[i].lacks);
            if (!has || !lacks)
                fprintf(stderr, "\n  %s dropout %g%s: expected %s and no %s\n", runs[i].c->what,
                        (double)runs[i].dropout, quant ? " int4" : "", runs[i].has, runs[i].lacks);
            CU_ASSERT(has && lacks);
            rig_free(&r);
        }
    /* the fused path's output and gradients are the merged conv's followed by relu and pool as separate ops (whose
       gradients test_grads checks against finite differences; here the kinks of relu and pool would make those
       noisy) */
    for (int quant = 0; quant < 2; quant++) {
        float x[YMAX], y[2][YMAX], *g[2][4] = {{0}};
        size_t n[4] = {0};
        fill_normal(x, case_numel(&fused), 6);
        for (int k = 0; k < 2; k++) {
            Rig r;
            rig_init(&r, &fused, quant, 0.0f, true, 7);
            rig_randomize(&r, 8);
            if (k) r.m.modules[0].fused_hook = NULL; /* the layers one by one */
            TestEnv e;
            test_env_init(&e, 1);
            Var *xv = test_var(&e, x, fused.x_ndim, fused.x_shape, true);
            Var *out = model_forward(&r.m, &e.tape, xv);
            CU_ASSERT_PTR_NOT_NULL_FATAL(out);
            CU_ASSERT_EQUAL_FATAL(var_numel(out), (size_t)27);
            memcpy(y[k], out->value.data, 27 * sizeof(float));
            float dy[27];
            fill_normal(dy, 27, 9);
            CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, out, dy), QT_OK);
            const Var *vs[4] = {xv, &r.a.A.var, &r.a.B.var, &r.a.M.var};
            for (int v = 0; v < 4; v++) {
                n[v] = var_numel(vs[v]);
                g[k][v] = malloc(n[v] * sizeof(float));
                memcpy(g[k][v], vs[v]->grad, n[v] * sizeof(float));
            }
            test_env_free(&e);
            rig_free(&r);
        }
        ASSERT_ALL_CLOSE(y[0], y[1], 27, 1e-6, 1e-5);
        for (int v = 0; v < 4; v++) {
            ASSERT_ALL_CLOSE(g[0][v], g[1][v], n[v], 1e-6, 1e-5);
            free(g[0][v]);
            free(g[1][v]);
        }
    }
}

static void test_grads(void) {
    for (int k = 0; k < 3; k++) {
        check_grads(&cases()[k], false, 0.0f, false, 40 + 10 * k);
        check_grads(&cases()[k], true, 0.0f, false, 41 + 10 * k);
        check_grads(&cases()[k], false, 0.3f, false, 42 + 10 * k);
    }
    check_grads(&cases()[0], true, 0.3f, false, 70);
    check_grads(&cases()[0], false, 0.0f, true, 71); /* lora.trainable and dora on one module: W's gradient too */
    check_grads(&cases()[1], false, 0.0f, true, 72);
}

/* ---- parity with PyTorch --------------------------------------------------------------------- */

#define DORA_FIXTURE "tests/fixtures/torch_dora.h5"

static float *fx_read(H5ioFile *f, const char *group, const char *name, const Tensor *like, size_t n_alt) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", group, name);
    size_t n = like ? tensor_numel(like) : n_alt;
    float *buf = malloc(n * sizeof(float));
    QtError err = {0};
    H5ioInfo info;
    QtStatus st = h5io_dataset_info(f, path, &info, &err);
    if (st == QT_OK && (size_t)info.numel != n)
        st = qt_error_set(&err, QT_ERR_FORMAT, "%s has %lld values, expected %zu", path, (long long)info.numel, n);
    int shape[H5IO_MAX_RANK];
    for (int i = 0; st == QT_OK && i < info.rank; i++) shape[i] = (int)info.dims[i];
    if (st == QT_OK) st = h5io_read_f32(f, path, buf, info.rank, shape, &err);
    if (st != QT_OK) {
        fprintf(stderr, "\n  %s: %s (regenerate with `make fixtures`)\n", DORA_FIXTURE, err.msg);
        CU_FAIL("fixture dataset missing or misshapen");
        free(buf);
        return NULL;
    }
    return buf;
}

static void check_close(const char *what, const float *got, const float *want, size_t n) {
    if (test_close_ratio(got, want, n, 1e-5, 1e-4, NULL) > 1.0) fprintf(stderr, "\n  mismatch in %s:", what);
    ASSERT_ALL_CLOSE(got, want, n, 1e-5, 1e-4);
}

static void parity_case(H5ioFile *f, const char *group, const Case *c) {
    Rig r;
    rig_init(&r, c, false, 0.0f, true, 1);
    Module *mod = &r.m.modules[0];
    float *W = fx_read(f, group, "W", &mod->weight->var.value, 0);
    float *b = fx_read(f, group, "b", &mod->bias->var.value, 0);
    float *A = fx_read(f, group, "A", &r.a.A.var.value, 0), *B = fx_read(f, group, "B", &r.a.B.var.value, 0);
    float *m = fx_read(f, group, "m", &r.a.M.var.value, 0);
    size_t nx = case_numel(c);
    float *x = fx_read(f, group, "x", NULL, nx), *dx = fx_read(f, group, "dx", NULL, nx);
    float *dA = fx_read(f, group, "dA", &r.a.A.var.value, 0), *dB = fx_read(f, group, "dB", &r.a.B.var.value, 0);
    float *dm = fx_read(f, group, "dm", &r.a.M.var.value, 0);
    double scale = 0.0;
    QtError err = {0};
    CU_ASSERT_EQUAL(h5io_attr_read_f64(f, group, "scale", &scale, &err), QT_OK);
    CU_ASSERT_DOUBLE_EQUAL(scale, 1.5, 0.0);
    if (W && b && A && B && m && x && dx && dA && dB && dm) {
        memcpy(mod->weight->var.value.data, W, var_numel(&mod->weight->var) * sizeof(float));
        memcpy(mod->bias->var.value.data, b, var_numel(&mod->bias->var) * sizeof(float));
        memcpy(r.a.A.var.value.data, A, var_numel(&r.a.A.var) * sizeof(float));
        memcpy(r.a.B.var.value.data, B, var_numel(&r.a.B.var) * sizeof(float));
        memcpy(r.a.M.var.value.data, m, var_numel(&r.a.M.var) * sizeof(float));
        r.a.scale = (float)scale; /* alpha 3 / rank 2 */
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = false;
        Var *xv = test_var(&e, x, c->x_ndim, c->x_shape, true);
        Var *y = model_forward(&r.m, &e.tape, xv);
        CU_ASSERT_PTR_NOT_NULL_FATAL(y);
        size_t ny = var_numel(y);
        float *yref = fx_read(f, group, "y", NULL, ny), *dy = fx_read(f, group, "dy", NULL, ny);
        CU_ASSERT_FATAL(yref && dy);
        check_close("y", y->value.data, yref, ny);
        CU_ASSERT_EQUAL_FATAL(tape_backward_from(&e.tape, y, dy), QT_OK);
        check_close("dx", xv->grad, dx, nx);
        check_close("dA", r.a.A.var.grad, dA, var_numel(&r.a.A.var));
        check_close("dB", r.a.B.var.grad, dB, var_numel(&r.a.B.var));
        check_close("dm", r.a.M.var.grad, dm, var_numel(&r.a.M.var));
        free(yref);
        free(dy);
        test_env_free(&e);
    }
    float *all[] = {W, b, A, B, m, x, dx, dA, dB, dm};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
    rig_free(&r);
}

static void test_torch_parity(void) {
    H5ioFile f;
    QtError err = {0};
    if (h5io_open(&f, DORA_FIXTURE, &err) != QT_OK) {
        fprintf(stderr, "\n  %s (run from the repository root, or regenerate with `make fixtures`)\n", err.msg);
        CU_FAIL("cannot open tests/fixtures/torch_dora.h5");
        return;
    }
    /* the fixture's shapes (tests/make_fixtures_dora.py CASES), rank 2 or 4, alpha 3 */
    Case d = {"dense", 1, {7}, dense(5), 2, {3, 7}, 2, .n_post = 0};
    Case cv = {"conv", 3, {3, 6, 6}, conv(4, 3, 2, 1, 1), 4, {2, 3, 6, 6}, 2, .n_post = 0};
    Case gc = {"grouped conv", 3, {4, 5, 5}, conv(6, 3, 1, 1, 2), 4, {2, 4, 5, 5}, 4, .n_post = 0};
    parity_case(&f, "dense", &d);
    parity_case(&f, "conv", &cv);
    parity_case(&f, "conv_grouped", &gc);
    h5io_close(&f, &err);
}

/* ---- merging --------------------------------------------------------------------------------- */

/* The merged weight in a float model computes what the adapter computed: over the float base and over the
 * dequantized int4 base (merge --dequantize). */
static void test_merge_equals_unmerged(void) {
    for (int k = 0; k < 3; k++)
        for (int quant = 0; quant < 2; quant++) {
            const Case *c = &cases()[k];
            float x[YMAX], y1[YMAX], y2[YMAX];
            fill_normal(x, case_numel(c), 80 + k);
            TestEnv e;
            test_env_init(&e, 1);
            Rig r, flat;
            rig_init(&r, c, quant, 0.2f, true, 90 + k);
            rig_randomize(&r, 95 + k);
            size_t n = forward_copy(&r.m, &e, x, c, false, y1);
            rig_init(&flat, c, false, 0.0f, false, 90 + k); /* the same float weight and bias, no adapter */
            float *w = flat.m.modules[0].weight->var.value.data;
            if (quant) qlayer_dequantize_weight(&r.q, w);
            lora_adapter_merge(&r.a, w);
            CU_ASSERT_EQUAL(forward_copy(&flat.m, &e, x, c, false, y2), n);
            double ratio = test_close_ratio(y2, y1, n, 1e-5, 1e-5, NULL);
            if (ratio > 1.0)
                fprintf(stderr, "\n  %s%s: merged differs (ratio %g)\n", c->what, quant ? " int4" : "", ratio);
            CU_ASSERT(ratio <= 1.0);
            test_env_free(&e);
            rig_free(&r);
            rig_free(&flat);
        }
}

/* ---- the step's multiply-adds ---------------------------------------------------------------- */

/* tiny-dora's conv1 (1 -> 8, 3x3, 28x28 out, rank 4, dropout 0.1, no input gradient) and fc1 (1568 -> 32,
 * input gradient), batch 32, counted by hand from lora_dora.h's accounting. */
static void test_macs(void) {
    Config *c = test_runs_config(&dora_runs, "tests/configs/tiny-dora.yaml", "macs", NULL, 0);
    const char *plain_ov[] = {"lora.rules.0.dora=false"};
    Config *p = test_runs_config(&dora_runs, "tests/configs/tiny-dora.yaml", "macs-plain", plain_ov, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    Net n, np;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c, NET_SHELL, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(&np, p, NET_SHELL, &err), QT_OK);
    StepMacs d, l;
    CU_ASSERT_EQUAL(net_step_macs(&n, &d, &err), QT_OK);
    CU_ASSERT_EQUAL(net_step_macs(&np, &l, &err), QT_OK);
    const double pos = 28.0 * 28.0, B = 32.0;
    /* plain LoRA's conv1 goes through its full weight gradient (72 <= 2 (36 + 32)); DoRA runs the branch */
    double conv_l = pos * 72.0;
    double conv_d = pos * (36 + 32) + pos * 32 + pos * (36 + 32) + pos * 72 /* dropout: the base again */ +
                    (8.0 * 4 * 9 + 8 * 9 + 2.0 * 8 * 4 * 9) / B;
    double fc_l = (4.0 * 1568 + 32 * 4) * 3 + 4.0 * 1568;
    double fc_d = fc_l + 32.0 * 1568 * 2 /* dropout: forward and input gradient */ +
                  (32.0 * 4 * 1568 + 32 * 1568 + 2.0 * 32 * 4 * 1568) / B;
    double want = step_macs_total(&l) - conv_l - fc_l + conv_d + fc_d;
    CU_ASSERT_DOUBLE_EQUAL(step_macs_total(&d), want, 1e-6 * want);
    /* without adapter dropout conv1 runs on its merged weight: LoRA's conv1 count (its full weight gradient) and
       the merged weight's per-batch work; fc1 loses the second base product */
    net_free(&n);
    const char *nodrop_ov[] = {"lora.rules.0.dropout=0"};
    Config *c2 = test_runs_config(&dora_runs, "tests/configs/tiny-dora.yaml", "macs-nodrop", nodrop_ov, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c2);
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c2, NET_SHELL, &err), QT_OK);
    CU_ASSERT_EQUAL(net_step_macs(&n, &d, &err), QT_OK);
    conv_d = pos * 72.0 + (8.0 * 4 * 9 + 8 * 9 + 8 * 9 + 2.0 * 8 * 4 * 9 + 2 * 8 * 9) / B;
    fc_d = fc_l + (32.0 * 4 * 1568 + 32 * 1568 + 2.0 * 32 * 4 * 1568) / B;
    want = step_macs_total(&l) - conv_l - fc_l + conv_d + fc_d;
    CU_ASSERT_DOUBLE_EQUAL(step_macs_total(&d), want, 1e-6 * want);
    free(c2);
    net_free(&n);
    net_free(&np);
    free(c);
    free(p);
}

/* ---- runs ------------------------------------------------------------------------------------ */

static const char *FLOAT_BASE[] = {"quant.mode=none", "quant.rules=[]"};

static Config *cfg(const char *sub, const char *const *ov, int n) {
    Config *c = test_runs_config(&dora_runs, "tests/configs/tiny-dora.yaml", sub, ov, n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    return c;
}

static void run_ok(const Config *c, const char *resume, int64_t stop_at, TrainResult *r) {
    QtError err = {0};
    QtStatus st = test_runs_train(c, resume, stop_at, r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", c->source, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

/* /lora/<module>/magnitude (out,) and the dora attribute in file path */
static void check_file_has_magnitude(const char *path, const char *module, int out) {
    H5ioFile f;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(h5io_open(&f, path, &err), QT_OK);
    char ds[128], g[64];
    snprintf(g, sizeof g, "lora/%s", module);
    snprintf(ds, sizeof ds, "lora/%s/magnitude", module);
    H5ioInfo info;
    CU_ASSERT_EQUAL(h5io_dataset_info(&f, ds, &info, &err), QT_OK);
    CU_ASSERT(info.rank == 1 && info.dims[0] == (hsize_t)out);
    int64_t dora = 0;
    CU_ASSERT_EQUAL(h5io_attr_read_i64(&f, g, "dora", &dora, &err), QT_OK);
    CU_ASSERT_EQUAL(dora, 1);
    h5io_close(&f, &err);
}

static void test_runs_learn(void) {
    const char *pre[] = {"train.steps=0", "train.epochs=0"};
    Config *c0 = cfg("d0", pre, 2), *q = cfg("dq", NULL, 0), *fl = cfg("df", FLOAT_BASE, 2);
    TrainResult r0, rq, rf;
    run_ok(c0, NULL, 0, &r0);
    run_ok(q, NULL, 0, &rq);
    run_ok(fl, NULL, 0, &rf);
    CU_ASSERT_STRING_EQUAL(rq.mode, "qlora");
    CU_ASSERT_STRING_EQUAL(rf.mode, "lora");
    /* the head (330), the adapters of conv1 (4x9 + 8x4) and fc1 (4x1568 + 32x4), and their magnitudes (8, 32) */
    CU_ASSERT_EQUAL(rq.params_trainable, 330 + 36 + 32 + 6272 + 128 + 8 + 32);
    CU_ASSERT(rq.test_loss < r0.test_loss - 0.1 && rq.test_accuracy > r0.test_accuracy);
    CU_ASSERT(rf.test_loss < r0.test_loss - 0.1 && rf.test_accuracy > r0.test_accuracy);
    char *p = test_runs_path(&dora_runs, "dq", "adapters.h5");
    check_file_has_magnitude(p, "conv1", 8);
    check_file_has_magnitude(p, "fc1", 32);
    check_file_has_magnitude(test_runs_path(&dora_runs, "df", "final.h5"), "fc1", 32);
    /* scripts/qtrain_h5.py reads it as PEFT's name */
    if (system("/usr/bin/python3 -c 'import numpy, h5py' >/dev/null 2>&1") != 0) {
        test_skip("dora: /usr/bin/python3 cannot import numpy and h5py (scripts/qtrain_h5.py's check)");
    } else {
        char cmd[2048];
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 -c \"import sys; sys.path.insert(0, 'scripts'); import qtrain_h5; "
                 "d = qtrain_h5.load('%s'); sys.exit(0 if d['fc1.lora_magnitude_vector'].shape == (32,) and "
                 "d['conv1.lora_magnitude_vector'].shape == (8,) else 1)\"", p);
        CU_ASSERT_EQUAL(system(cmd), 0);
    }
    free(c0);
    free(q);
    free(fl);
}

static void assert_same_adapters(const Net *a, const Net *b) {
    CU_ASSERT_EQUAL_FATAL(net_hook_count(a, &HOOK_LORA), net_hook_count(b, &HOOK_LORA));
    for (int i = 0; i < net_hook_count(a, &HOOK_LORA); i++) {
        const LoraAdapter *x = net_adapter(a, i), *y = net_adapter(b, i);
        CU_ASSERT(x->spec.dora && y->spec.dora);
        CU_ASSERT(memcmp(x->A.var.value.data, y->A.var.value.data, var_numel(&x->A.var) * 4) == 0);
        CU_ASSERT(memcmp(x->B.var.value.data, y->B.var.value.data, var_numel(&x->B.var) * 4) == 0);
        CU_ASSERT(memcmp(x->M.var.value.data, y->M.var.value.data, var_numel(&x->M.var) * 4) == 0);
    }
}

/* Straight through and stopped after step 11 then resumed: the same test loss and the same adapters and
 * magnitudes bit for bit, over a QLoRA and a float base; adapters.h5 gives them back through adapters_from. */
static void test_resume_exact(void) {
    Config *c = cfg("rq-straight", NULL, 0), *s = cfg("rq-split", NULL, 0);
    TrainResult r, r2;
    run_ok(c, NULL, 0, &r);
    run_ok(s, NULL, 11, &r2);
    run_ok(s, "auto", 0, &r2);
    CU_ASSERT_EQUAL(r.test_loss, r2.test_loss);
    Net a, b, d;
    test_runs_load_net(&a, c, test_runs_path(&dora_runs, "rq-straight", "final.h5"));
    test_runs_load_net(&b, s, test_runs_path(&dora_runs, "rq-split", "final.h5"));
    assert_same_adapters(&a, &b);
    Config *fc = cfg("rf-straight", FLOAT_BASE, 2), *fs = cfg("rf-split", FLOAT_BASE, 2);
    run_ok(fc, NULL, 0, &r);
    run_ok(fs, NULL, 11, &r2);
    run_ok(fs, "auto", 0, &r2);
    CU_ASSERT_EQUAL(r.test_loss, r2.test_loss);
    Net fa, fb;
    test_runs_load_net(&fa, fc, test_runs_path(&dora_runs, "rf-straight", "final.h5"));
    test_runs_load_net(&fb, fs, test_runs_path(&dora_runs, "rf-split", "final.h5"));
    assert_same_adapters(&fa, &fb);
    Config *f = cfg("rq-from", NULL, 0);
    snprintf(f->model.adapters_from, sizeof f->model.adapters_from, "%s",
             test_runs_path(&dora_runs, "rq-split", "adapters.h5"));
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(net_build(&d, f, NET_FRESH, &err), QT_OK);
    assert_same_adapters(&a, &d);
    net_free(&a);
    net_free(&b);
    net_free(&d);
    net_free(&fa);
    net_free(&fb);
    free(c);
    free(s);
    free(fc);
    free(fs);
    free(f);
}

/* qtrain merge: a float base folds W' in (the same accuracy and, up to float rounding, loss); a QLoRA base
 * re-quantizes, and --dequantize gives the float W'. */
static void test_merge_runs(void) {
    Config *fl = cfg("mf", FLOAT_BASE, 2), *q = cfg("mq", NULL, 0);
    TrainResult r;
    run_ok(fl, NULL, 0, &r);
    run_ok(q, NULL, 0, &r);
    MergeReport rep;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(tools_merge(test_runs_path(&dora_runs, "mf", "final.h5"),
                                      test_runs_path(&dora_runs, "mf", "merged.h5"), false, false, NULL, &rep, &err),
                          QT_OK);
    CU_ASSERT_EQUAL(rep.modules, 2);
    CU_ASSERT(fabs(rep.test_accuracy_after - rep.test_accuracy_before) <= 0.002);
    CU_ASSERT(fabs(rep.test_loss_after - rep.test_loss_before) < 1e-4 * fabs(rep.test_loss_before) + 1e-6);
    CU_ASSERT_EQUAL_FATAL(tools_merge(test_runs_path(&dora_runs, "mq", "final.h5"),
                                      test_runs_path(&dora_runs, "mq", "merged.h5"), false, false, NULL, &rep, &err),
                          QT_OK);
    CU_ASSERT(rep.weight_rel_rmse > 0.0 && rep.weight_rel_rmse < 0.2);
    CU_ASSERT_STRING_EQUAL(rep.mode, "ptq");
    MergeReport deq;
    CU_ASSERT_EQUAL_FATAL(tools_merge(test_runs_path(&dora_runs, "mq", "final.h5"),
                                      test_runs_path(&dora_runs, "mq", "merged-float.h5"), true, false, NULL, &deq,
                                      &err), QT_OK);
    CU_ASSERT(deq.dequantized);
    CU_ASSERT(fabs(deq.test_accuracy_after - deq.test_accuracy_before) <= 0.002);
    CU_ASSERT(fabs(deq.test_loss_after - deq.test_loss_before) < 1e-4 * fabs(deq.test_loss_before) + 1e-6);
    free(fl);
    free(q);
}

/* ---- bad input ------------------------------------------------------------------------------- */

static void expect_error(const char *sub, const char *const *ov, int n, QtStatus want, const char *a, const char *b) {
    Config *c = cfg(sub, ov, n);
    TrainResult r;
    QtError err = {0};
    CU_ASSERT_EQUAL(test_runs_train(c, NULL, 0, &r, &err), want);
    if (!test_msg_has(&err, a) || !test_msg_has(&err, b)) {
        fprintf(stderr, "\n  unexpected message: %s\n", err.msg);
        CU_FAIL("message");
    }
    free(c);
}

static void test_bad_inputs(void) {
    /* a base DoRA cannot normalise: QAT's fake-quantized weight */
    const char *qat[] = {"quant.mode=qat", "quant.rules=[{module_path: '.*', weight_qtype: int8}]"};
    expect_error("e-qat", qat, 2, QT_ERR_CONFIG, "lora.rules[0]: conv1: dora: true needs a float or a "
                 "post-training-quantized", "is a QAT layer (its fake-quantized weight trains); set dora: false");
    /* adapters_from: plain LoRA adapters into a DoRA rule and DoRA adapters into a plain rule */
    const char *plain_ov[] = {"lora.rules.0.dora=false"};
    Config *p = cfg("e-plain-src", plain_ov, 1), *d = cfg("e-dora-src", NULL, 0);
    TrainResult r;
    run_ok(p, NULL, 0, &r);
    run_ok(d, NULL, 0, &r);
    char from_plain[1200], from_dora[1200];
    snprintf(from_plain, sizeof from_plain, "model.adapters_from=%s",
             test_runs_path(&dora_runs, "e-plain-src", "adapters.h5"));
    snprintf(from_dora, sizeof from_dora, "model.adapters_from=%s",
             test_runs_path(&dora_runs, "e-dora-src", "adapters.h5"));
    const char *a1[] = {from_plain};
    expect_error("e-from-plain", a1, 1, QT_ERR_CONFIG, "adapters.h5: the adapter of module conv1 is a plain LoRA",
                 "has dora: true; set dora: false in that rule");
    const char *a2[] = {from_dora, "lora.rules.0.dora=false"};
    expect_error("e-from-dora", a2, 2, QT_ERR_CONFIG, "adapters.h5: the adapter of module conv1 is a DoRA adapter",
                 "lora/conv1/magnitude), but this run's lora rule for conv1 has dora: false; set dora: true");
    /* a module type it cannot adapt: a depthwise conv, refused naming the rule, the module and what to adapt */
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    const char *dw[] = {"lora.rules=[{module_path: '.*', op_types: [conv2d], rank: 2, dora: true}]"};
    CU_ASSERT_EQUAL_FATAL(config_load(c, "tests/configs/tiny-dw.yaml", dw, 1, &err), QT_OK);
    Net n;
    CU_ASSERT_EQUAL(net_build(&n, c, NET_SHELL, &err), QT_ERR_CONFIG);
    if (!test_msg_has(&err, "lora.rules[0]: dw: a depthwise conv2d") || !test_msg_has(&err, "('pw')"))
        fprintf(stderr, "\n  unexpected message: %s\n", err.msg);
    CU_ASSERT(test_msg_has(&err, "lora.rules[0]: dw: a depthwise conv2d") && test_msg_has(&err, "('pw')"));
    err = (QtError){0};
    /* a value that is no boolean: the file, line and column (the --set) */
    const char *bad[] = {"lora.rules.0.dora=maybe"};
    CU_ASSERT_EQUAL(config_load(c, "tests/configs/tiny-dora.yaml", bad, 1, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "lora.rules[0].dora: expected true or false, got \"maybe\""));
    free(c);
    free(p);
    free(d);
}

int register_dora_suite(void) {
    CU_pSuite s = CU_add_suite("dora", dora_suite_init, dora_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "magnitude starts at the channel norms (float, int4 base)", test_magnitude_init) ||
           !CU_add_test(s, "a fresh adapter leaves the output unchanged", test_fresh_is_identity) ||
           !CU_add_test(s, "gradients of x, A, B, m (and W) against finite differences", test_grads) ||
           !CU_add_test(s, "merged-weight conv (fused relu and pool) or base and branch", test_paths) ||
           !CU_add_test(s, "forward and backward against PyTorch", test_torch_parity) ||
           !CU_add_test(s, "merged weight equals the unmerged adapter", test_merge_equals_unmerged) ||
           !CU_add_test(s, "the step's multiply-adds", test_macs) ||
           !CU_add_test(s, "tiny runs learn over a float and a QLoRA base; magnitude stored", test_runs_learn) ||
           !CU_add_test(s, "resume bit-exact; adapters.h5 round trip", test_resume_exact) ||
           !CU_add_test(s, "qtrain merge: float, re-quantized, --dequantize", test_merge_runs) ||
           !CU_add_test(s, "errors: a QAT base, adapters_from mismatches", test_bad_inputs);
}
