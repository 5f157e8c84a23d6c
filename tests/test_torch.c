/* test_torch.c - qtrain against PyTorch: forward, backward and optimizer steps of small models, compared with
 * the references tests/make_fixtures.py wrote into tests/fixtures/torch_ref.h5 (regenerate: make fixtures).
 *
 * Tolerances. Both sides compute in float32 but sum in different orders (OpenBLAS/im2col here, ATen loops in
 * PyTorch), so a dot product of K terms may differ by ~K * 6e-8 of the sum of |terms|. The fixtures hold values
 * of O(1e-3..1) and K <= 36, so differences of a few 1e-8 are expected (measured: <= 4e-8 absolute, 6e-6
 * relative on elements above 1e-3), while real bugs (a transposed weight, a wrong GELU constant, a missing
 * 1/N, a gradient routed to the wrong pool element) move values by 1e-3 or more. Hence:
 *  - forward and backward: |got - want| <= 1e-6 + 1e-5 |want|; the atol covers elements that are small
 *    because of cancellation, where a relative bound means nothing; the margin (~50x) absorbs other BLAS
 *    kernels (AVX2 vs AVX-512 change the summation order);
 *  - the optimizer runs: AdamW divides each gradient by its RMS, which turns a relative gradient error
 *    delta/|g| into a parameter error of lr * delta/|g| per step; the fixture keeps every nonzero gradient
 *    above 1e-5 (make_fixtures.py MIN_GRAD) so this stays small. Measured after 5 steps: <= 6e-8; bound
 *    2e-6 + 2e-5 |want|. Dropping weight decay, nesterov or changing beta2 misses by 10x to 1000x. */
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "nn/ops.h"
#include "nn/optim.h"
#include "test_util.h"

#define FIXTURE_PATH "tests/fixtures/torch_ref.h5"

#define FB_ATOL 1e-6   /* forward/backward */
#define FB_RTOL 1e-5
#define OPT_ATOL 2e-6  /* after 5 optimizer steps */
#define OPT_RTOL 2e-5
#define STEPS 5

/* ---- reading the fixture --------------------------------------------------- */

/* Opens the fixture, or fails the current test with how to regenerate it: a missing file must never pass. */
static hid_t fixture_open(void) {
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL); /* errors are reported below, in words */
    hid_t f = H5Fopen(FIXTURE_PATH, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0) {
        fprintf(stderr, "\n  cannot open %s: run the tests from the repository root, or regenerate it with "
                "`make fixtures` (needs python3-torch and python3-h5py)\n", FIXTURE_PATH);
        /* CU_FAIL stringifies its argument, so the message must be a literal. */
        CU_FAIL("cannot open tests/fixtures/torch_ref.h5; regenerate it with `make fixtures`");
    }
    return f;
}

/* Reads dataset `path` into out, after checking that it has exactly the shape (ndim, shape); ndim 0 is a
 * scalar. On any mismatch prints what was found, fails the test and returns false. */
static bool fixture_read(hid_t f, const char *path, hid_t memtype, void *out, int ndim, const int *shape) {
    bool ok = false;
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    hid_t s = d >= 0 ? H5Dget_space(d) : H5I_INVALID_HID;
    hsize_t dims[8] = {0};
    int rank = s >= 0 ? H5Sget_simple_extent_ndims(s) : -1;
    if (d < 0) {
        fprintf(stderr, "\n  %s: no dataset %s (stale fixture? run `make fixtures`)\n", FIXTURE_PATH, path);
    } else if (rank < 0 || rank > 8 || H5Sget_simple_extent_dims(s, dims, NULL) < 0) {
        fprintf(stderr, "\n  %s: cannot read the shape of %s\n", FIXTURE_PATH, path);
    } else {
        ok = rank == ndim;
        for (int i = 0; ok && i < ndim; i++) ok = dims[i] == (hsize_t)shape[i];
        if (!ok) {
            fprintf(stderr, "\n  %s: %s has rank %d (dims", FIXTURE_PATH, path, rank);
            for (int i = 0; i < rank; i++) fprintf(stderr, " %llu", (unsigned long long)dims[i]);
            fprintf(stderr, "), expected rank %d (dims", ndim);
            for (int i = 0; i < ndim; i++) fprintf(stderr, " %d", shape[i]);
            fprintf(stderr, ")\n");
        } else if (H5Dread(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0) {
            fprintf(stderr, "\n  %s: cannot read %s\n", FIXTURE_PATH, path);
            ok = false;
        }
    }
    if (s >= 0) H5Sclose(s);
    if (d >= 0) H5Dclose(d);
    if (!ok) CU_FAIL("fixture dataset missing, misshapen or unreadable (details above)");
    return ok;
}

static bool read_floats(hid_t f, const char *path, float *out, int ndim, const int *shape) {
    return fixture_read(f, path, H5T_NATIVE_FLOAT, out, ndim, shape);
}

/* The fixture's dataset "/<group>/<dir>/<param name>" (param names are "<module>/weight|bias"). */
static bool read_param_like(hid_t f, const char *group, const char *dir, const Param *p, float *out) {
    char path[256];
    snprintf(path, sizeof path, "/%s/%s/%s", group, dir, p->name);
    return read_floats(f, path, out, p->var.value.ndim, p->var.value.shape);
}

/* ASSERT_ALL_CLOSE with the name of what is compared, since one call site checks many arrays. */
static void check_close(const char *what, const float *got, const float *want, size_t n, double atol,
                        double rtol) {
    if (test_close_ratio(got, want, n, atol, rtol, NULL) > 1.0) fprintf(stderr, "\n  mismatch in %s:", what);
    ASSERT_ALL_CLOSE(got, want, n, atol, rtol);
}

/* Each param's fixture dataset under dir: `check` false loads it into the param, true compares the param's
 * value (`grads` false) or its grad (`grads` true) with it. */
static bool params_io(hid_t f, Model *m, const char *group, const char *dir, bool check, bool grads) {
    bool ok = true;
    for (int i = 0; i < m->n_params; i++) {
        Param *p = &m->params[i];
        size_t n = var_numel(&p->var);
        if (!check) {
            ok &= read_param_like(f, group, dir, p, p->var.value.data);
            continue;
        }
        float *want = malloc(n * sizeof(float));
        if (want && read_param_like(f, group, dir, p, want)) {
            char what[128];
            snprintf(what, sizeof what, "%s/%s/%s", group, dir, p->name);
            check_close(what, grads ? p->var.grad : p->var.value.data, want, n, grads ? FB_ATOL : OPT_ATOL,
                        grads ? FB_RTOL : OPT_RTOL);
        } else {
            ok = false;
        }
        free(want);
    }
    return ok;
}

/* ---- the models -------------------------------------------------------------- */

/* One model of the fixture: its group, per-example input shape, batch size and layers. */
typedef struct {
    const char *group;
    int in_ndim, in_shape[3];
    int batch, classes;
    const LayerSpec *layers;
    int n_layers;
} RefModel;

static const LayerSpec MLP_LAYERS[] = {
    {.type = LAYER_DENSE, .name = "fc1", .units = 16},
    {.type = LAYER_RELU, .name = "relu1"},
    {.type = LAYER_DENSE, .name = "fc2", .units = 8},
    {.type = LAYER_GELU, .name = "gelu2"},
    {.type = LAYER_DENSE, .name = "head", .units = 5},
};

static const LayerSpec CNN_LAYERS[] = {
    {.type = LAYER_CONV2D, .name = "conv1", .out_channels = 4, .kernel = 3, .padding = 1},
    {.type = LAYER_RELU, .name = "relu1"},
    {.type = LAYER_MAXPOOL2D, .name = "pool1", .kernel = 2},
    {.type = LAYER_CONV2D, .name = "conv2", .out_channels = 6, .kernel = 3, .padding = 1, .stride = 1},
    {.type = LAYER_TANH, .name = "tanh2"},
    {.type = LAYER_AVGPOOL2D, .name = "pool2", .kernel = 2, .stride = 2},
    {.type = LAYER_FLATTEN, .name = "flatten"},
    {.type = LAYER_DENSE, .name = "head", .units = 5},
};

static const RefModel MLP = {"mlp", 1, {12}, 4, 5, MLP_LAYERS, sizeof MLP_LAYERS / sizeof MLP_LAYERS[0]};
static const RefModel CNN = {"cnn", 3, {1, 10, 10}, 3, 5, CNN_LAYERS, sizeof CNN_LAYERS / sizeof CNN_LAYERS[0]};

/* A batch of the fixture: x (batch, in_shape...) and labels, in malloc'ed buffers. */
typedef struct {
    int ndim, shape[4];
    size_t numel;
    float *x;
    int32_t *labels;
} Batch;

static void batch_free(Batch *b) {
    free(b->x);
    free(b->labels);
}

/* The model with the fixture's /<group>/params loaded and zeroed grads, and its batch. */
static bool ref_setup(hid_t f, const RefModel *r, Model *m, Batch *b) {
    memset(b, 0, sizeof *b);
    QtError err = {0};
    if (model_init(m, r->in_ndim, r->in_shape, r->layers, r->n_layers, &err) != QT_OK) {
        fprintf(stderr, "\n  model_init(%s): %s\n", r->group, err.msg);
        CU_FAIL("model_init failed");
        return false;
    }
    b->ndim = r->in_ndim + 1;
    b->shape[0] = r->batch;
    b->numel = (size_t)r->batch;
    for (int i = 0; i < r->in_ndim; i++) b->numel *= (size_t)(b->shape[i + 1] = r->in_shape[i]);
    b->x = malloc(b->numel * sizeof(float));
    b->labels = malloc((size_t)r->batch * sizeof(int32_t));
    char path[128];
    bool ok = b->x && b->labels && params_io(f, m, r->group, "params", false, false);
    snprintf(path, sizeof path, "/%s/x", r->group);
    ok = ok && read_floats(f, path, b->x, b->ndim, b->shape);
    snprintf(path, sizeof path, "/%s/labels", r->group);
    ok = ok && fixture_read(f, path, H5T_NATIVE_INT32, b->labels, 1, &r->batch);
    /* Zeroed explicitly: the backward accumulates, and the comparison must not depend on model_init's calloc. */
    for (int i = 0; i < m->n_params; i++)
        memset(m->params[i].var.grad, 0, var_numel(&m->params[i].var) * sizeof(float));
    if (!ok) {
        model_free(m);
        batch_free(b);
    }
    return ok;
}

/* Forward to the mean cross-entropy on env's tape; NULL (test failed, tape error printed) on error. */
static Var *forward_loss(TestEnv *env, Model *m, Var *x, const int32_t *labels, Var **logits) {
    *logits = model_forward(m, &env->tape, x);
    Var *loss = nn_softmax_cross_entropy(&env->tape, *logits, labels);
    if (!loss || !tape_ok(&env->tape)) {
        fprintf(stderr, "\n  forward failed: %s\n", env->tape.err.msg);
        CU_FAIL("forward failed");
        return NULL;
    }
    return loss;
}

/* ---- forward + backward vs PyTorch ------------------------------------------ */

/* Compares logits, loss, every param grad and the input grad after the backward with the fixture. */
static void check_outputs(hid_t f, const RefModel *r, Model *m, const Batch *b, Var *x, Var *logits, Var *loss) {
    char path[128];
    float want_logits[64], want_loss;
    int lshape[2] = {r->batch, r->classes};
    snprintf(path, sizeof path, "/%s/logits", r->group);
    bool shape_ok = logits->value.ndim == 2 && logits->value.shape[0] == r->batch &&
                    logits->value.shape[1] == r->classes && r->batch * r->classes <= 64;
    CU_ASSERT(shape_ok);
    if (shape_ok && read_floats(f, path, want_logits, 2, lshape))
        check_close(path, logits->value.data, want_logits, var_numel(logits), FB_ATOL, FB_RTOL);
    snprintf(path, sizeof path, "/%s/loss", r->group);
    if (read_floats(f, path, &want_loss, 0, NULL)) check_close(path, loss->value.data, &want_loss, 1, 0, FB_RTOL);
    params_io(f, m, r->group, "grads", true, true);
    snprintf(path, sizeof path, "/%s/grad_x", r->group);
    CU_ASSERT_PTR_NOT_NULL(x->grad);
    float *want_dx = malloc(b->numel * sizeof(float));
    if (x->grad && want_dx && read_floats(f, path, want_dx, b->ndim, b->shape))
        check_close(path, x->grad, want_dx, b->numel, FB_ATOL, FB_RTOL);
    free(want_dx);
}

static void check_forward_backward(const RefModel *r) {
    hid_t f = fixture_open();
    if (f < 0) return;
    Model m;
    Batch b;
    if (!ref_setup(f, r, &m, &b)) {
        H5Fclose(f);
        return;
    }
    TestEnv env;
    test_env_init(&env, 1);
    env.tape.training = true;
    Var *x = test_var(&env, b.x, b.ndim, b.shape, true);
    Var *logits = NULL, *loss = x ? forward_loss(&env, &m, x, b.labels, &logits) : NULL;
    if (loss && tape_backward(&env.tape, loss) == QT_OK) {
        check_outputs(f, r, &m, &b, x, logits, loss);
    } else if (loss) {
        fprintf(stderr, "\n  backward failed: %s\n", env.tape.err.msg);
        CU_FAIL("backward failed");
    }
    test_env_free(&env);
    model_free(&m);
    batch_free(&b);
    H5Fclose(f);
}

static void test_mlp_matches_torch(void) { check_forward_backward(&MLP); }
static void test_cnn_matches_torch(void) { check_forward_backward(&CNN); }

/* ---- optimizer trajectories vs PyTorch -------------------------------------- */

/* STEPS steps of `cfg` on the /mlp batch from the /mlp params; losses into got[]. */
static bool train_steps(Model *m, const Batch *b, const OptimConfig *cfg, float got[STEPS]) {
    Param *ptrs[16];
    CU_ASSERT_FATAL(m->n_params <= 16);
    for (int i = 0; i < m->n_params; i++) ptrs[i] = &m->params[i];
    Optimizer opt;
    QtError err = {0};
    if (optim_init(&opt, cfg, ptrs, m->n_params, &err) != QT_OK) {
        fprintf(stderr, "\n  optim_init: %s\n", err.msg);
        CU_FAIL("optim_init failed");
        return false;
    }
    TestEnv env;
    test_env_init(&env, 1);
    bool ok = true;
    optim_zero_grad(&opt);
    for (int step = 0; ok && step < STEPS; step++) {
        tape_reset(&env.tape);
        Var *logits, *x = tape_wrap(&env.tape, b->x, b->ndim, b->shape);
        Var *loss = x ? forward_loss(&env, m, x, b->labels, &logits) : NULL;
        ok = loss && tape_backward(&env.tape, loss) == QT_OK;
        if (!ok) break;
        got[step] = loss->value.data[0];
        optim_step(&opt, cfg->lr);
        optim_zero_grad(&opt);
    }
    if (!ok) {
        fprintf(stderr, "\n  training step failed: %s\n", env.tape.err.msg);
        CU_FAIL("training step failed");
    }
    test_env_free(&env);
    optim_free(&opt);
    return ok;
}

static void check_optimizer(const char *group, const OptimConfig *cfg) {
    hid_t f = fixture_open();
    if (f < 0) return;
    Model m;
    Batch b;
    if (!ref_setup(f, &MLP, &m, &b)) {
        H5Fclose(f);
        return;
    }
    float got[STEPS], want[STEPS];
    char path[128];
    snprintf(path, sizeof path, "/%s/losses", group);
    if (read_floats(f, path, want, 1, (int[]){STEPS}) && train_steps(&m, &b, cfg, got)) {
        check_close(path, got, want, STEPS, 0, OPT_RTOL);
        params_io(f, &m, group, "params_final", true, false);
    }
    model_free(&m);
    batch_free(&b);
    H5Fclose(f);
}

static void test_adamw_matches_torch(void) {
    OptimConfig cfg = optim_config_default(OPTIM_ADAMW);
    cfg.lr = 1e-2f;
    cfg.beta1 = 0.9f;
    cfg.beta2 = 0.999f;
    cfg.eps = 1e-8f;
    cfg.weight_decay = 0.1f;
    check_optimizer("adamw", &cfg);
}

static void test_sgd_nesterov_matches_torch(void) {
    OptimConfig cfg = optim_config_default(OPTIM_SGD);
    cfg.lr = 0.05f;
    cfg.momentum = 0.9f;
    cfg.dampening = 0.0f;
    cfg.nesterov = true;
    cfg.weight_decay = 0.01f;
    check_optimizer("sgd", &cfg);
}

/* ---- cross-entropy at extreme logits ------------------------------------------ */

/* Logits of +-80 overflow a naive exp() (e^80 > FLT_MAX); the loss (~50) and grad must stay finite and match. */
static void test_cross_entropy_extreme_logits(void) {
    hid_t f = fixture_open();
    if (f < 0) return;
    enum { N = 4, C = 5 };
    float z[N * C], want_dz[N * C], want_loss;
    int32_t labels[N];
    bool ok = read_floats(f, "/mlp_ce_extreme/logits", z, 2, (int[]){N, C}) &&
              fixture_read(f, "/mlp_ce_extreme/labels", H5T_NATIVE_INT32, labels, 1, (int[]){N}) &&
              read_floats(f, "/mlp_ce_extreme/loss", &want_loss, 0, NULL) &&
              read_floats(f, "/mlp_ce_extreme/grad_logits", want_dz, 2, (int[]){N, C});
    H5Fclose(f);
    if (!ok) return;
    TestEnv env;
    test_env_init(&env, 1);
    Var *logits = test_var(&env, z, 2, (int[]){N, C}, true);
    Var *loss = nn_softmax_cross_entropy(&env.tape, logits, labels);
    CU_ASSERT_PTR_NOT_NULL(loss);
    if (loss && tape_backward(&env.tape, loss) == QT_OK) {
        CU_ASSERT(isfinite(loss->value.data[0]));
        check_close("/mlp_ce_extreme/loss", loss->value.data, &want_loss, 1, 0, FB_RTOL);
        /* Probabilities here are 0, 1 or O(0.1): a 1e-7 atol still catches any stray e^-80-sized error. */
        check_close("/mlp_ce_extreme/grad_logits", logits->grad, want_dz, N * C, 1e-7, FB_RTOL);
    } else {
        fprintf(stderr, "\n  cross-entropy failed: %s\n", env.tape.err.msg);
        CU_FAIL("cross-entropy on extreme logits failed");
    }
    test_env_free(&env);
}

int register_nn_torch_suite(void) {
    CU_pSuite s = CU_add_suite("nn_torch", NULL, NULL);
    if (!s) return -1;
    if (!CU_add_test(s, "mlp forward/backward matches PyTorch", test_mlp_matches_torch) ||
        !CU_add_test(s, "cnn forward/backward matches PyTorch", test_cnn_matches_torch) ||
        !CU_add_test(s, "5 AdamW steps match PyTorch", test_adamw_matches_torch) ||
        !CU_add_test(s, "5 SGD nesterov steps match PyTorch", test_sgd_nesterov_matches_torch) ||
        !CU_add_test(s, "cross-entropy at +-80 logits matches PyTorch", test_cross_entropy_extreme_logits))
        return -1;
    return 0;
}
