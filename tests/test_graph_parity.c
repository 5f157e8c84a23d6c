/* test_graph_parity.c - whole models with merges against PyTorch 1.13: a residual network (add, a strided 1x1
 * shortcut conv) and a two-branch network (concat of a depthwise-separable branch and a grouped dilated conv),
 * both with batch norm, built from their configs and compared with the references tests/make_fixtures_graph.py
 * wrote into tests/fixtures/torch_graph.h5 (regenerate: make fixtures): one train-mode step (logits, loss,
 * every gradient, the input's), 5 optimizer steps (losses, parameters, running statistics and counts), then
 * eval-mode logits of the trained model.
 *
 * Tolerances. Both sides compute in float32 and sum in different orders; batch norm amplifies a difference by
 * its invstd * gamma, and the gradients through it are differences of terms of O(|dy|), so as in
 * test_batchnorm.c's parity test one step's values are held to |got - want| <= 1e-5 + 1e-4 |want|. After 5
 * steps (SGD with momentum: linear in the gradients; Adam: a relative gradient error delta/|g| moves a
 * parameter by lr * delta/|g|, and the generator keeps every nonzero gradient above 1e-5) the same bound
 * times 2. Measured with PyTorch 1.13 (QT_TEST_SHOW_MSGS=1 prints it): the worst difference is 0.006 of the
 * tolerance after one step and 0.002 after 5, a margin for other BLAS kernels and summation orders; real
 * bugs (a shortcut that does not stride, a concat in the wrong order, a gradient missing from one of two
 * readers, the biased variance in the running update) move values by 1e-2 or more. */
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "nn/ops.h"
#include "nn/optim.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/train.h"

#define FIXTURE_PATH "tests/fixtures/torch_graph.h5"
#define FB_ATOL 1e-5 /* one step */
#define FB_RTOL 1e-4
#define OPT_ATOL 2e-5 /* after the optimizer steps */
#define OPT_RTOL 2e-4
#define STEPS 5
#define BATCH 4
#define CLASSES 5
#define NX (BATCH * 3 * 7 * 7)

/* The models, as the generator's CONFIG strings (the fixture holds its copy: they must agree): the stem both
 * start with (its StemNet.STEM_CONFIG), their own layers, the head both end with (StemNet.HEAD_CONFIG). */
#define STEM_YAML                                                                                  \
    "model:\n"                                                                                     \
    "  input: [3, 7, 7]\n"                                                                         \
    "  layers:\n"                                                                                  \
    "    - {name: stem, type: conv2d, out_channels: 4, kernel: 3, padding: 1, bias: false}\n"      \
    "    - {name: stem_bn, type: batchnorm2d}\n"                                                   \
    "    - {name: stem_relu, type: relu}\n"
#define HEAD_YAML                                                                                  \
    "    - {name: gap, type: globalavgpool}\n"                                                     \
    "    - {name: head, type: dense, units: 5}\n"

static const char RESNET_YAML[] =
    STEM_YAML
    "    - {name: b1_conv1, type: conv2d, out_channels: 4, kernel: 3, padding: 1, bias: false}\n"
    "    - {name: b1_bn1, type: batchnorm2d}\n"
    "    - {name: b1_relu1, type: relu}\n"
    "    - {name: b1_conv2, type: conv2d, out_channels: 4, kernel: 3, padding: 1, bias: false}\n"
    "    - {name: b1_bn2, type: batchnorm2d}\n"
    "    - {name: b1_add, type: add, inputs: [b1_bn2, stem_relu]}\n"
    "    - {name: b1_relu2, type: relu}\n"
    "    - {name: b2_conv1, type: conv2d, out_channels: 8, kernel: 3, stride: 2, padding: 1, bias: false}\n"
    "    - {name: b2_bn1, type: batchnorm2d}\n"
    "    - {name: b2_relu1, type: relu}\n"
    "    - {name: b2_conv2, type: conv2d, out_channels: 8, kernel: 3, padding: 1, bias: false}\n"
    "    - {name: b2_bn2, type: batchnorm2d}\n"
    "    - {name: b2_short, type: conv2d, out_channels: 8, kernel: 1, stride: 2, inputs: [b1_relu2]}\n"
    "    - {name: b2_add, type: add, inputs: [b2_bn2, b2_short]}\n"
    "    - {name: b2_relu2, type: relu}\n"
    HEAD_YAML;

static const char CATNET_YAML[] =
    STEM_YAML
    "    - {name: dw, type: conv2d, out_channels: 4, kernel: 3, padding: 1, groups: 4, bias: false}\n"
    "    - {name: dw_bn, type: batchnorm2d}\n"
    "    - {name: dw_relu, type: relu}\n"
    "    - {name: pw, type: conv2d, out_channels: 6, kernel: 1, bias: false}\n"
    "    - {name: gc, type: conv2d, out_channels: 4, kernel: 3, padding: 2, dilation: 2, groups: 2, bias: false,\n"
    "       inputs: [stem_relu]}\n"
    "    - {name: cat, type: concat, inputs: [pw, gc]}\n"
    "    - {name: cat_bn, type: batchnorm2d}\n"
    "    - {name: cat_relu, type: relu}\n"
    HEAD_YAML;

typedef struct {
    const char *group; /* in the fixture */
    const char *yaml;
    int n_bn;          /* batch norms in the model */
    OptimConfig (*optim)(void);
} GraphModel;

/* torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=5e-4) */
static OptimConfig resnet_optim(void) {
    OptimConfig c = optim_config_default(OPTIM_SGD);
    c.lr = 0.1f, c.momentum = 0.9f, c.dampening = 0.0f, c.nesterov = false, c.weight_decay = 5e-4f;
    return c;
}

/* torch.optim.Adam(lr=1e-2, betas=(0.9, 0.999), eps=1e-8): AdamW without decay */
static OptimConfig catnet_optim(void) {
    OptimConfig c = optim_config_default(OPTIM_ADAMW);
    c.lr = 1e-2f, c.beta1 = 0.9f, c.beta2 = 0.999f, c.eps = 1e-8f, c.weight_decay = 0.0f;
    return c;
}

static const GraphModel RESNET = {"resnet", RESNET_YAML, 5, resnet_optim};
static const GraphModel CATNET = {"catnet", CATNET_YAML, 3, catnet_optim};

/* ---- reading the fixture ---------------------------------------------------------------------------------- */

/* A missing fixture fails (it is part of the repository): it must never pass silently. */
static hid_t fixture_open(void) {
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    hid_t f = H5Fopen(FIXTURE_PATH, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0) {
        fprintf(stderr, "\n  cannot open %s: run the tests from the repository root, or regenerate it with "
                "`make fixtures` (needs python3-torch and python3-h5py)\n", FIXTURE_PATH);
        CU_FAIL("cannot open tests/fixtures/torch_graph.h5; regenerate it with `make fixtures`");
    }
    return f;
}

/* "/<group>/<name>" of exactly n elements into out; false (test failed, reason printed) otherwise. */
static bool fx_read(hid_t f, const char *group, const char *name, hid_t memtype, void *out, size_t n) {
    char path[160];
    snprintf(path, sizeof path, "/%s/%s", group, name);
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    hid_t s = d >= 0 ? H5Dget_space(d) : H5I_INVALID_HID;
    hssize_t got = s >= 0 ? H5Sget_simple_extent_npoints(s) : -1;
    bool ok = got == (hssize_t)n && H5Dread(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) >= 0;
    if (!ok) fprintf(stderr, "\n  %s: %s missing, unreadable or not of %zu elements (has %lld); run `make fixtures`\n",
                     FIXTURE_PATH, path, n, (long long)got);
    if (s >= 0) H5Sclose(s);
    if (d >= 0) H5Dclose(d);
    CU_ASSERT(ok);
    return ok;
}

static bool fx_floats(hid_t f, const char *group, const char *name, float *out, size_t n) {
    return fx_read(f, group, name, H5T_NATIVE_FLOAT, out, n);
}

/* The group's "config" attribute equals yaml: the generator's model is the one built here. */
static bool fx_config_matches(hid_t f, const char *group, const char *yaml) {
    hid_t g = H5Gopen2(f, group, H5P_DEFAULT);
    hid_t a = g >= 0 ? H5Aopen(g, "config", H5P_DEFAULT) : H5I_INVALID_HID;
    hid_t mt = H5Tcopy(H5T_C_S1);
    H5Tset_size(mt, H5T_VARIABLE);
    H5Tset_cset(mt, H5T_CSET_UTF8);
    char *text = NULL;
    bool ok = a >= 0 && H5Aread(a, mt, &text) >= 0 && text && strcmp(text, yaml) == 0;
    if (!ok) fprintf(stderr, "\n  %s: /%s's config attribute differs from the test's model (or is missing):\n%s\n",
                     FIXTURE_PATH, group, text ? text : "(none)");
    if (text) H5free_memory(text);
    H5Tclose(mt);
    if (a >= 0) H5Aclose(a);
    if (g >= 0) H5Gclose(g);
    CU_ASSERT(ok);
    return ok;
}

/* The worst ratio to the tolerance of all comparisons, to show the margin (QT_TEST_SHOW_MSGS=1). */
static double worst;
static char worst_what[160];

static void check_close(const char *what, const float *got, const float *want, size_t n, double atol, double rtol) {
    double r = test_close_ratio(got, want, n, atol, rtol, NULL);
    if (r > worst) worst = r, snprintf(worst_what, sizeof worst_what, "%s", what);
    if (r > 1.0) fprintf(stderr, "\n  mismatch in %s:", what);
    ASSERT_ALL_CLOSE(got, want, n, atol, rtol);
}

static void show_worst(const char *what) {
    if (getenv("QT_TEST_SHOW_MSGS"))
        fprintf(stderr, "\n  %s: worst ratio to the tolerance %.3g (%s)\n", what, worst, worst_what);
}

/* ---- the model from its config, with the fixture's parameters -------------------------------------------- */

typedef struct {
    Model m;
    float x[NX];
    int32_t labels[BATCH];
} Setup;

/* Each param p compared with (check) or loaded from (!check) "/<group>/<dir>/<p.name>"; grads: p's grad. */
static bool params_io(hid_t f, Model *m, const char *group, const char *dir, bool check, bool grads, double atol,
                      double rtol) {
    bool ok = true;
    for (int i = 0; i < m->n_params; i++) {
        Param *p = &m->params[i];
        size_t n = var_numel(&p->var);
        char name[160];
        snprintf(name, sizeof name, "%s/%s", dir, p->name);
        if (!check) {
            ok &= fx_floats(f, group, name, p->var.value.data, n);
            continue;
        }
        float *want = malloc(n * sizeof *want);
        if (want && fx_floats(f, group, name, want, n)) {
            char what[200];
            snprintf(what, sizeof what, "%s/%s", group, name);
            check_close(what, grads ? p->var.grad : p->var.value.data, want, n, atol, rtol);
        } else {
            ok = false;
        }
        free(want);
    }
    return ok;
}

/* The model built from gm's config with the fixture's initial parameters, zeroed grads, and the batch. */
static bool setup(hid_t f, const GraphModel *gm, Setup *s) {
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    CU_ASSERT_FATAL(c != NULL);
    QtStatus st = config_load_string(c, gm->yaml, "graph.yaml", NULL, 0, &err);
    if (st == QT_OK)
        st = model_init(&s->m, c->model.input_ndim, c->model.input_shape, c->model.layers, c->model.n_layers, &err);
    free(c);
    if (st != QT_OK) {
        fprintf(stderr, "\n  %s: %s\n", gm->group, err.msg);
        CU_FAIL("the model's config does not load");
        return false;
    }
    int n_bn = 0;
    for (int i = 0; i < s->m.n_modules; i++) n_bn += s->m.modules[i].running_mean != NULL;
    CU_ASSERT_EQUAL(n_bn, gm->n_bn);
    bool ok = fx_config_matches(f, gm->group, gm->yaml) &&
              params_io(f, &s->m, gm->group, "params", false, false, 0, 0) &&
              fx_floats(f, gm->group, "x", s->x, NX) &&
              fx_read(f, gm->group, "labels", H5T_NATIVE_INT32, s->labels, BATCH);
    for (int i = 0; i < s->m.n_params; i++)
        memset(s->m.params[i].var.grad, 0, var_numel(&s->m.params[i].var) * sizeof(float));
    if (!ok) model_free(&s->m);
    return ok;
}

static const int X_SHAPE[4] = {BATCH, 3, 7, 7};

/* Logits and the mean cross-entropy on env's tape; NULL (test failed) on error. */
static Var *forward_loss(TestEnv *e, Model *m, Var *x, const int32_t *labels, Var **logits) {
    *logits = model_forward(m, &e->tape, x);
    Var *loss = *logits ? nn_softmax_cross_entropy(&e->tape, *logits, labels) : NULL;
    if (!loss || !tape_ok(&e->tape)) {
        fprintf(stderr, "\n  forward failed: %s\n", e->tape.err.msg);
        CU_FAIL("forward failed");
        return NULL;
    }
    CU_ASSERT_FATAL((*logits)->value.ndim == 2 && (*logits)->value.shape[0] == BATCH &&
                    (*logits)->value.shape[1] == CLASSES);
    return loss;
}

/* ---- one train-mode step ------------------------------------------------------------------------------- */

static void check_step(const GraphModel *gm) {
    hid_t f = fixture_open();
    if (f < 0) return;
    Setup *s = malloc(sizeof *s);
    CU_ASSERT_FATAL(s != NULL);
    worst = 0;
    if (setup(f, gm, s)) {
        TestEnv e;
        test_env_init(&e, 1);
        e.tape.training = true;
        Var *x = test_var(&e, s->x, 4, X_SHAPE, true), *logits = NULL;
        Var *loss = forward_loss(&e, &s->m, x, s->labels, &logits);
        if (loss && tape_backward(&e.tape, loss) == QT_OK) {
            float want[BATCH * CLASSES], want_loss, want_dx[NX];
            char what[64];
            snprintf(what, sizeof what, "%s/logits", gm->group);
            if (fx_floats(f, gm->group, "logits", want, BATCH * CLASSES))
                check_close(what, logits->value.data, want, BATCH * CLASSES, FB_ATOL, FB_RTOL);
            snprintf(what, sizeof what, "%s/loss", gm->group);
            if (fx_floats(f, gm->group, "loss", &want_loss, 1))
                check_close(what, loss->value.data, &want_loss, 1, 0, FB_RTOL);
            params_io(f, &s->m, gm->group, "grads", true, true, FB_ATOL, FB_RTOL);
            snprintf(what, sizeof what, "%s/grad_x", gm->group);
            CU_ASSERT_PTR_NOT_NULL(x->grad);
            if (x->grad && fx_floats(f, gm->group, "grad_x", want_dx, NX))
                check_close(what, x->grad, want_dx, NX, FB_ATOL, FB_RTOL);
        } else if (loss) {
            fprintf(stderr, "\n  backward failed: %s\n", e.tape.err.msg);
            CU_FAIL("backward failed");
        }
        test_env_free(&e);
        model_free(&s->m);
        show_worst(gm->group);
    }
    free(s);
    H5Fclose(f);
}

/* ---- STEPS optimizer steps, the running statistics, eval ------------------------------------------------ */

static bool train_steps(Setup *s, const GraphModel *gm, float losses[STEPS]) {
    OptimConfig cfg = gm->optim();
    Optimizer opt;
    QtError err = {0};
    if (optim_init(&opt, &cfg, s->m.param_list, s->m.n_params, &err) != QT_OK) {
        fprintf(stderr, "\n  optim_init: %s\n", err.msg);
        CU_FAIL("optim_init failed");
        return false;
    }
    TestEnv e;
    test_env_init(&e, 1);
    bool ok = true;
    optim_zero_grad(&opt);
    for (int step = 0; ok && step < STEPS; step++) {
        tape_reset(&e.tape);
        e.tape.training = true;
        Var *logits, *x = tape_wrap(&e.tape, s->x, 4, X_SHAPE);
        Var *loss = x ? forward_loss(&e, &s->m, x, s->labels, &logits) : NULL;
        ok = loss && tape_backward(&e.tape, loss) == QT_OK;
        if (!ok) break;
        losses[step] = loss->value.data[0];
        optim_step(&opt, cfg.lr);
        optim_zero_grad(&opt);
    }
    if (!ok) {
        fprintf(stderr, "\n  training step failed: %s\n", e.tape.err.msg);
        CU_FAIL("training step failed");
    }
    test_env_free(&e);
    optim_free(&opt);
    return ok;
}

/* Each batch norm's running statistics and count against /<group>/buffers/<module>/. */
static void check_buffers(hid_t f, const GraphModel *gm, Model *m) {
    int seen = 0;
    for (int i = 0; i < m->n_modules; i++) {
        Module *mod = &m->modules[i];
        if (!mod->running_mean) continue;
        seen++;
        int C = mod->out_shape[0];
        float want[16];
        int64_t count = -1;
        char name[160], what[200];
        CU_ASSERT_FATAL(C <= 16);
        const char *stat[2] = {"running_mean", "running_var"};
        const float *got[2] = {mod->running_mean, mod->running_var};
        for (int k = 0; k < 2; k++) {
            snprintf(name, sizeof name, "buffers/%s/%s", mod->path, stat[k]);
            snprintf(what, sizeof what, "%s/%s", gm->group, name);
            if (fx_floats(f, gm->group, name, want, (size_t)C)) check_close(what, got[k], want, C, OPT_ATOL, OPT_RTOL);
        }
        snprintf(name, sizeof name, "buffers/%s/num_batches_tracked", mod->path);
        if (fx_read(f, gm->group, name, H5T_NATIVE_INT64, &count, 1)) {
            CU_ASSERT_EQUAL(mod->num_batches_tracked, count);
            CU_ASSERT_EQUAL(count, STEPS);
        }
    }
    CU_ASSERT_EQUAL(seen, gm->n_bn);
}

static void check_training(const GraphModel *gm) {
    hid_t f = fixture_open();
    if (f < 0) return;
    Setup *s = malloc(sizeof *s);
    CU_ASSERT_FATAL(s != NULL);
    worst = 0;
    float got[STEPS], want[STEPS];
    if (setup(f, gm, s)) {
        char what[64];
        if (train_steps(s, gm, got) && fx_floats(f, gm->group, "losses", want, STEPS)) {
            snprintf(what, sizeof what, "%s/losses", gm->group);
            check_close(what, got, want, STEPS, 0, OPT_RTOL);
            params_io(f, &s->m, gm->group, "params_final", true, false, OPT_ATOL, OPT_RTOL);
            check_buffers(f, gm, &s->m);
            /* eval mode: the running statistics, nothing moves */
            float x_eval[NX], want_logits[BATCH * CLASSES];
            TestEnv e;
            test_env_init(&e, 1);
            e.tape.training = false;
            e.tape.grad_enabled = false;
            if (fx_floats(f, gm->group, "x_eval", x_eval, NX) &&
                fx_floats(f, gm->group, "logits_eval", want_logits, BATCH * CLASSES)) {
                Var *logits = model_forward(&s->m, &e.tape, test_var(&e, x_eval, 4, X_SHAPE, false));
                if (!logits) fprintf(stderr, "\n  eval forward failed: %s\n", e.tape.err.msg);
                CU_ASSERT_FATAL(logits != NULL);
                snprintf(what, sizeof what, "%s/logits_eval", gm->group);
                check_close(what, logits->value.data, want_logits, BATCH * CLASSES, OPT_ATOL, OPT_RTOL);
                check_buffers(f, gm, &s->m); /* the count too: still STEPS */
            }
            test_env_free(&e);
        }
        model_free(&s->m);
        show_worst(gm->group);
    }
    free(s);
    H5Fclose(f);
}

static void test_resnet_step(void) { check_step(&RESNET); }
static void test_catnet_step(void) { check_step(&CATNET); }
static void test_resnet_training(void) { check_training(&RESNET); }
static void test_catnet_training(void) { check_training(&CATNET); }

int register_graph_parity_suite(void) {
    CU_pSuite s = CU_add_suite("graph_parity", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "residual net (add, strided shortcut): one train step matches PyTorch",
                        test_resnet_step) ||
           !CU_add_test(s, "residual net: 5 SGD steps, running statistics, eval logits match PyTorch",
                        test_resnet_training) ||
           !CU_add_test(s, "concat net (depthwise, grouped dilated): one train step matches PyTorch",
                        test_catnet_step) ||
           !CU_add_test(s, "concat net: 5 Adam steps, running statistics, eval logits match PyTorch",
                        test_catnet_training);
}
