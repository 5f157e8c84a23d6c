/* test_checkpoint.c - HDF5 checkpoints: exact round trips of parameters,
 * optimizer state and run state (NaN included); the file layout other tools
 * read; refusal of files that are not checkpoints, are incomplete or belong
 * to another model, leaving the run untouched; the inspect listing; and the
 * h5io helpers underneath. Failed saves and run directories are in
 * test_checkpoint_dir.c, whose tests join this suite. */
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "nn/optim.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "base/h5io.h"
#include "trainer/sha256.h"

/* ---- fixtures ---------------------------------------------------------------------- */

static LayerSpec dense(const char *name, int units) {
    LayerSpec s = {.type = LAYER_DENSE, .units = units};
    snprintf(s.name, sizeof s.name, "%s", name);
    return s;
}

static LayerSpec conv(const char *name, int oc, int k, int pad) {
    LayerSpec s = {.type = LAYER_CONV2D, .out_channels = oc, .kernel = k, .padding = pad};
    snprintf(s.name, sizeof s.name, "%s", name);
    return s;
}

/* A model, its optimizer and the run state a checkpoint carries. */
typedef struct {
    Model m;
    Optimizer opt;
    Rng dropout, rounding;
    CheckpointState st;
} Run;

static const char *CONFIG_TEXT = "run:\n  name: test\n  seed: 7\nmodel:\n  input: [1, 6, 6]\n  layers:\n"
                                 "    - {type: conv2d, name: conv1, out_channels: 3, kernel: 3, padding: 1}\n"
                                 "    - {type: relu}\n    - {type: flatten}\n    - {type: dense, name: fc, units: 5}\n";

/* The CNN: (1, 6, 6) -> conv1 3ch k3 pad1 -> relu -> flatten -> fc (units). */
static void cnn_layers(LayerSpec *l, int units, bool extra_layer, int *n) {
    l[0] = conv("conv1", 3, 3, 1);
    l[1] = (LayerSpec){.type = LAYER_RELU};
    l[2] = (LayerSpec){.type = LAYER_FLATTEN};
    l[3] = dense("fc", units);
    *n = 4;
    if (extra_layer) l[(*n)++] = dense("fc2", 4);
}

/* Builds a run; `steps` optimizer steps on random gradients make the moments
 * nonzero; the rngs are advanced so their counters are not zero. */
static void run_init(Run *r, const LayerSpec *layers, int n_layers, int in_ndim, const int *in_shape,
                     OptimKind kind, float momentum, uint64_t seed, int steps) {
    memset(r, 0, sizeof *r);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&r->m, in_ndim, in_shape, layers, n_layers, &err), QT_OK);
    Rng init;
    rng_init(&init, seed, RNG_STREAM_INIT);
    model_init_params(&r->m, &init);
    OptimConfig c = optim_config_default(kind);
    c.momentum = momentum;
    CU_ASSERT_EQUAL_FATAL(optim_init(&r->opt, &c, r->m.param_list, r->m.n_params, &err), QT_OK);
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < r->m.n_params; i++)
            rng_fill_normal(&init, r->m.params[i].var.grad, var_numel(&r->m.params[i].var), 0.0f, 1.0f);
        optim_step(&r->opt, 0.01f);
    }
    rng_init(&r->dropout, seed, RNG_STREAM_DROPOUT);
    rng_init(&r->rounding, seed, RNG_STREAM_ROUNDING);
    uint32_t junk[64];
    rng_fill_u32(&r->dropout, junk, (size_t)(4 * steps + 3));
    rng_fill_u32(&r->rounding, junk, (size_t)(steps + 1));
    r->st = (CheckpointState){
        .step = r->opt.step, .epoch = steps ? 2 : 0, .cursor = steps ? 17 : 0, .seed = seed,
        .n_train = steps ? 600 : 0, .log_loss_sum = steps ? 1.0 / 3.0 : 0.0, .log_correct = steps ? 11 : 0,
        .log_seen = steps ? 40 : 0, .log_steps = steps ? 3 : 0, .train_s = 0.1 * (double)seed + 12.25 * steps,
        .wall_s = 1.0 / 3.0 + (double)seed + 20.5 * steps, .trained_examples = 1000 * (int64_t)seed + 40 * steps,
        .last_train_loss = steps ? 2.0 / 3.0 : NAN, .n_rngs = 2, .config_text = CONFIG_TEXT,
    };
    r->st.rngs[0].name = "dropout";
    r->st.rngs[0].rng = &r->dropout;
    r->st.rngs[1].name = "rounding";
    r->st.rngs[1].rng = &r->rounding;
}

static void run_cnn(Run *r, int units, bool extra_layer, OptimKind kind, uint64_t seed, int steps) {
    LayerSpec l[5];
    int n;
    cnn_layers(l, units, extra_layer, &n);
    run_init(r, l, n, 3, (int[]){1, 6, 6}, kind, 0.0f, seed, steps);
}

static void run_mlp(Run *r, float momentum, uint64_t seed, int steps) {
    LayerSpec l[3] = {dense("fc1", 16), {.type = LAYER_RELU}, dense("fc2", 4)};
    run_init(r, l, 3, 1, (int[]){8}, OPTIM_SGD, momentum, seed, steps);
}

static void run_free(Run *r) {
    optim_free(&r->opt);
    model_free(&r->m);
}

static bool moments_equal(float **a, float **b, const Optimizer *o) {
    if (!a || !b) return a == b;
    for (int i = 0; i < o->n_params; i++)
        if (memcmp(a[i], b[i], var_numel(&o->params[i]->var) * sizeof(float)) != 0) return false;
    return true;
}

/* Everything a run keeps, as one byte string, to see that a failed load changed nothing. */
typedef struct {
    float *bytes;
    size_t n;
} Snapshot;

static Snapshot snapshot(const Run *r) {
    size_t n = model_param_count(&r->m, false) * 3 + 16;
    Snapshot s = {calloc(n, sizeof(float)), 0};
    for (int i = 0; i < r->m.n_params; i++) {
        size_t k = var_numel(&r->m.params[i].var);
        memcpy(s.bytes + s.n, r->m.params[i].var.value.data, k * sizeof(float));
        s.n += k;
        if (r->opt.m) memcpy(s.bytes + s.n, r->opt.m[i], k * sizeof(float)), s.n += k;
        if (r->opt.v) memcpy(s.bytes + s.n, r->opt.v[i], k * sizeof(float)), s.n += k;
    }
    float tail[16] = {(float)r->opt.step, (float)r->st.step, (float)r->st.cursor, (float)r->dropout.counter,
                      (float)r->rounding.counter, (float)r->st.epoch, (float)r->st.train_s, (float)r->st.wall_s,
                      (float)r->st.trained_examples, (float)r->st.last_train_loss};
    memcpy(s.bytes + s.n, tail, sizeof tail);
    s.n += 16;
    return s;
}

static bool snapshot_same(Snapshot a, const Run *r) {
    Snapshot b = snapshot(r);
    bool same = a.n == b.n && memcmp(a.bytes, b.bytes, a.n * sizeof(float)) == 0;
    free(b.bytes);
    return same;
}

/* ---- round trips ------------------------------------------------------------------------------ */

static void check_roundtrip(Run *src, Run *dst, const char *path) {
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(path, &src->m, &src->opt, &src->st, &err), QT_OK);
    test_assert_hdf5_closed();
    CU_ASSERT_FALSE(test_params_equal(&src->m, &dst->m));
    CU_ASSERT_EQUAL(checkpoint_load(path, &dst->m, &dst->opt, &dst->st, &err), QT_OK);
    if (err.status) fprintf(stderr, "\n  %s\n", err.msg);
    test_assert_hdf5_closed();
    CU_ASSERT(test_params_equal(&src->m, &dst->m));
    CU_ASSERT(moments_equal(src->opt.m, dst->opt.m, &src->opt));
    CU_ASSERT(moments_equal(src->opt.v, dst->opt.v, &src->opt));
    CU_ASSERT_EQUAL(dst->opt.step, src->opt.step);
    CU_ASSERT_EQUAL(memcmp(&dst->dropout, &src->dropout, sizeof(Rng)), 0);
    CU_ASSERT_EQUAL(memcmp(&dst->rounding, &src->rounding, sizeof(Rng)), 0);
    const CheckpointState *a = &src->st, *b = &dst->st;
    CU_ASSERT(a->step == b->step && a->epoch == b->epoch && a->cursor == b->cursor && a->seed == b->seed);
    CU_ASSERT(a->n_train == b->n_train && a->log_correct == b->log_correct && a->log_seen == b->log_seen &&
              a->log_steps == b->log_steps);
    CU_ASSERT(a->trained_examples == b->trained_examples);
    /* Bit for bit: NaN (and its payload) too. */
    CU_ASSERT_EQUAL(memcmp(&a->log_loss_sum, &b->log_loss_sum, sizeof(double)), 0);
    CU_ASSERT_EQUAL(memcmp(&a->train_s, &b->train_s, sizeof(double)), 0);
    CU_ASSERT_EQUAL(memcmp(&a->wall_s, &b->wall_s, sizeof(double)), 0);
    CU_ASSERT_EQUAL(memcmp(&a->last_train_loss, &b->last_train_loss, sizeof(double)), 0);
    CU_ASSERT_PTR_EQUAL(b->rngs[0].rng, &dst->dropout); /* names and pointers stay the caller's */
    CU_ASSERT_EQUAL(b->n_rngs, 2);
}

static void test_roundtrip_adamw_cnn(void) {
    char *dir = test_tmpdir_new();
    char *path = test_path_join(dir, "a.h5");
    Run src, dst;
    run_cnn(&src, 5, false, OPTIM_ADAMW, 1, 3);
    run_cnn(&dst, 5, false, OPTIM_ADAMW, 2, 0);
    dst.st.config_text = NULL;
    CU_ASSERT_EQUAL(src.opt.step, 3);
    check_roundtrip(&src, &dst, path);
    CU_ASSERT_PTR_NULL(dst.st.config_text); /* not set by a load */
    char *cfg = NULL;
    QtError err = {0};
    CU_ASSERT_EQUAL(checkpoint_read_config(path, &cfg, &err), QT_OK);
    CU_ASSERT(cfg && strcmp(cfg, CONFIG_TEXT) == 0);
    free(cfg);
    test_assert_hdf5_closed();
    run_free(&src);
    run_free(&dst);
    free(path);
    test_tmpdir_remove(dir);
}

static void test_roundtrip_sgd(void) {
    char *dir = test_tmpdir_new();
    char *path = test_path_join(dir, "s.h5");
    Run src, dst;
    run_mlp(&src, 0.9f, 3, 2);
    run_mlp(&dst, 0.9f, 4, 0);
    CU_ASSERT_PTR_NOT_NULL(src.opt.m);
    CU_ASSERT_PTR_NULL(src.opt.v);
    check_roundtrip(&src, &dst, path);
    /* The momentum buffer is stored, no second moment. */
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    CU_ASSERT(f >= 0);
    CU_ASSERT(H5Lexists(f, "optim/fc1/weight/m", H5P_DEFAULT) > 0);
    CU_ASSERT(H5Lexists(f, "optim/fc1/weight/v", H5P_DEFAULT) == 0);
    H5Fclose(f);
    run_free(&src);
    run_free(&dst);

    /* SGD without momentum keeps no buffer, and the file has none. */
    run_mlp(&src, 0.0f, 5, 2);
    run_mlp(&dst, 0.0f, 6, 0);
    CU_ASSERT_PTR_NULL(src.opt.m);
    uint64_t nan_bits = 0xfff8000000abcdefULL; /* a negative quiet NaN with a payload: kept bit for bit */
    memcpy(&src.st.last_train_loss, &nan_bits, sizeof nan_bits);
    check_roundtrip(&src, &dst, path);
    CU_ASSERT(isnan(dst.st.last_train_loss));
    f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    CU_ASSERT(H5Lexists(f, "optim/fc2/bias", H5P_DEFAULT) > 0);
    CU_ASSERT(H5Lexists(f, "optim/fc2/bias/m", H5P_DEFAULT) == 0);
    H5Fclose(f);
    /* A run with momentum cannot resume from it: its buffer would be missing. */
    Run mom;
    run_mlp(&mom, 0.9f, 7, 0);
    QtError err = {0};
    CU_ASSERT_EQUAL(checkpoint_load(path, &mom.m, &mom.opt, NULL, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "/optim/fc1/weight/m"));
    run_free(&mom);
    test_assert_hdf5_closed();
    run_free(&src);
    run_free(&dst);
    free(path);
    test_tmpdir_remove(dir);
}

/* ---- layout ------------------------------------------------------------------------------------- */

static void expect_dims(hid_t f, const char *path, int rank, const hsize_t *want) {
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    CU_ASSERT_FATAL(d >= 0);
    hid_t s = H5Dget_space(d), t = H5Dget_type(d);
    hsize_t dims[8] = {0};
    CU_ASSERT_EQUAL(H5Sget_simple_extent_ndims(s), rank);
    H5Sget_simple_extent_dims(s, dims, NULL);
    for (int i = 0; i < rank; i++) CU_ASSERT_EQUAL(dims[i], want[i]);
    CU_ASSERT_EQUAL(H5Tget_class(t), H5T_FLOAT);
    CU_ASSERT_EQUAL(H5Tget_size(t), 4);
    H5Tclose(t);
    H5Sclose(s);
    H5Dclose(d);
}

static int64_t attr_i64(hid_t obj, const char *name) {
    int64_t v = -1;
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    CU_ASSERT(a >= 0);
    if (a >= 0) {
        CU_ASSERT(H5Aread(a, H5T_NATIVE_INT64, &v) >= 0);
        H5Aclose(a);
    }
    return v;
}

/* A fixed-length UTF-8 string attribute of exactly want's bytes (h5py reads
 * it as bytes); never variable-length, which lives in the global heap. */
static bool attr_str_is(hid_t obj, const char *name, const char *want) {
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    if (a < 0) return false;
    hid_t t = H5Aget_type(a);
    size_t len = strlen(want);
    bool ok = H5Tis_variable_str(t) == 0 && H5Tget_cset(t) == H5T_CSET_UTF8 && H5Tget_size(t) == (len ? len : 1);
    char *s = calloc(len + 2, 1);
    ok = ok && s && H5Aread(a, t, s) >= 0 && strcmp(s, want) == 0;
    free(s);
    H5Tclose(t);
    H5Aclose(a);
    return ok;
}

/* A float64 attribute of obj holding exactly the bits of want. */
static bool attr_f64_is(hid_t obj, const char *name, double want) {
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    if (a < 0) return false;
    hid_t t = H5Aget_type(a);
    double v = 0.0;
    bool ok = H5Tget_class(t) == H5T_FLOAT && H5Tget_size(t) == 8 && H5Aread(a, H5T_NATIVE_DOUBLE, &v) >= 0 &&
              memcmp(&v, &want, sizeof v) == 0;
    H5Tclose(t);
    H5Aclose(a);
    return ok;
}

static void test_file_layout(void) {
    char *dir = test_tmpdir_new();
    char *path = test_path_join(dir, "layout.h5");
    Run r;
    run_cnn(&r, 5, false, OPTIM_ADAMW, 1, 2);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(path, &r.m, &r.opt, &r.st, &err), QT_OK);
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    CU_ASSERT_FATAL(f >= 0);
    expect_dims(f, "/params/conv1/weight", 4, (hsize_t[]){3, 1, 3, 3});
    expect_dims(f, "/params/conv1/bias", 1, (hsize_t[]){3});
    expect_dims(f, "/params/fc/weight", 2, (hsize_t[]){5, 108});
    expect_dims(f, "/optim/fc/weight/v", 2, (hsize_t[]){5, 108});
    CU_ASSERT(attr_str_is(f, "format", "qtrain"));
    CU_ASSERT(attr_str_is(f, "config", CONFIG_TEXT));
    CU_ASSERT_EQUAL(attr_i64(f, "version"), 1);
    CU_ASSERT_EQUAL(attr_i64(f, "step"), 2);
    /* The stored weights are the model's, in its layout. */
    float w[27];
    hid_t d = H5Dopen2(f, "/params/conv1/weight", H5P_DEFAULT);
    CU_ASSERT(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, w) >= 0);
    H5Dclose(d);
    CU_ASSERT_EQUAL(memcmp(w, r.m.params[0].var.value.data, sizeof w), 0);
    hid_t g = H5Gopen2(f, "/optim", H5P_DEFAULT);
    CU_ASSERT(attr_str_is(g, "optimizer", "adamw"));
    CU_ASSERT_EQUAL(attr_i64(g, "step"), 2);
    H5Gclose(g);
    g = H5Gopen2(f, "/data", H5P_DEFAULT);
    CU_ASSERT_EQUAL(attr_i64(g, "cursor"), 17);
    H5Gclose(g);
    g = H5Gopen2(f, "/train", H5P_DEFAULT);
    CU_ASSERT(attr_f64_is(g, "train_s", r.st.train_s) && attr_f64_is(g, "wall_s", r.st.wall_s));
    CU_ASSERT(attr_f64_is(g, "last_train_loss", r.st.last_train_loss) && attr_f64_is(g, "loss_sum", 1.0 / 3.0));
    CU_ASSERT_EQUAL(attr_i64(g, "trained_examples"), r.st.trained_examples);
    H5Gclose(g);
    g = H5Gopen2(f, "/rng/dropout", H5P_DEFAULT);
    CU_ASSERT_EQUAL(attr_i64(g, "counter"), (int64_t)r.dropout.counter);
    H5Gclose(g);
    H5Fclose(f);
    test_assert_hdf5_closed();
    run_free(&r);
    free(path);
    test_tmpdir_remove(dir);
}

/* ---- refusals ------------------------------------------------------------------------------------- */

/* Loads `path` into r (model, optimizer, state), expects `status` and a
 * message naming `what`, and checks r is unchanged. */
static void expect_refused(const char *path, Run *r, QtStatus status, const char *what) {
    Snapshot before = snapshot(r);
    QtError err = {0};
    CU_ASSERT_EQUAL(checkpoint_load(path, &r->m, &r->opt, &r->st, &err), status);
    CU_ASSERT(test_msg_has(&err, what));
    CU_ASSERT(snapshot_same(before, r));
    free(before.bytes);
    test_assert_hdf5_closed();
}

static void make_hdf5_without_format(const char *path) {
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    CU_ASSERT_FATAL(f >= 0);
    hid_t g = H5Gcreate2(f, "params", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Gclose(g);
    H5Fclose(f);
}

static void set_version(const char *path, int64_t version) {
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    CU_ASSERT_FATAL(f >= 0);
    H5Adelete(f, "version");
    hid_t s = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f, "version", H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &version);
    H5Aclose(a);
    H5Sclose(s);
    H5Fclose(f);
}

static void test_load_rejects_non_checkpoints(void) {
    char *dir = test_tmpdir_new();
    char *text = test_path_join(dir, "notes.txt"), *plain = test_path_join(dir, "plain.h5");
    char *v2 = test_path_join(dir, "v2.h5"), *missing = test_path_join(dir, "missing.h5");
    Run r;
    run_cnn(&r, 5, false, OPTIM_ADAMW, 1, 2);
    test_file_write(text, "not hdf5 at all\n", 16);
    expect_refused(text, &r, QT_ERR_FORMAT, "not an HDF5 file");
    expect_refused(text, &r, QT_ERR_FORMAT, text);
    expect_refused(missing, &r, QT_ERR_IO, "missing.h5");
    expect_refused(dir, &r, QT_ERR_IO, "directory");
    make_hdf5_without_format(plain);
    expect_refused(plain, &r, QT_ERR_FORMAT, "is an HDF5 file but not a qtrain checkpoint (no 'format' attribute)");
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(v2, &r.m, &r.opt, &r.st, &err), QT_OK);
    set_version(v2, 2);
    expect_refused(v2, &r, QT_ERR_FORMAT, "version 2");
    expect_refused(v2, &r, QT_ERR_FORMAT, "reads version 1");
    char *cfg = NULL;
    CU_ASSERT_EQUAL(checkpoint_read_config(plain, &cfg, &err), QT_ERR_FORMAT);
    CU_ASSERT_PTR_NULL(cfg);
    test_assert_hdf5_closed();
    run_free(&r);
    free(text);
    free(plain);
    free(v2);
    free(missing);
    test_tmpdir_remove(dir);
}

static void test_load_rejects_other_model(void) {
    char *dir = test_tmpdir_new();
    char *path = test_path_join(dir, "c.h5"), *bigger = test_path_join(dir, "bigger.h5");
    Run saved, wide, deep, sgd, no_opt;
    run_cnn(&saved, 5, false, OPTIM_ADAMW, 1, 2);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(path, &saved.m, &saved.opt, &saved.st, &err), QT_OK);
    /* Other units: the first differing parameter and both shapes. */
    run_cnn(&wide, 7, false, OPTIM_ADAMW, 2, 1);
    expect_refused(path, &wide, QT_ERR_FORMAT, "parameter fc/weight has shape (5, 108) in the checkpoint but (7, 108)");
    expect_refused(path, &wide, QT_ERR_FORMAT, "qtrain inspect");
    /* One more layer in the model: its parameter is missing from the file. */
    run_cnn(&deep, 5, true, OPTIM_ADAMW, 3, 1);
    expect_refused(path, &deep, QT_ERR_FORMAT, "parameter fc2/weight (4, 5) is missing");
    /* One more layer in the file: it is named as extra. */
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(bigger, &deep.m, &deep.opt, &deep.st, &err), QT_OK);
    expect_refused(bigger, &saved, QT_ERR_FORMAT, "the checkpoint has module fc2");
    CU_ASSERT_EQUAL(checkpoint_load_params(bigger, &saved.m, &err), QT_ERR_FORMAT);
    /* Another optimizer. */
    run_cnn(&sgd, 5, false, OPTIM_SGD, 4, 1);
    expect_refused(path, &sgd, QT_ERR_FORMAT, "written by optimizer 'adamw' but this run uses 'sgd'");
    /* A file saved without optimizer state cannot resume one. */
    run_cnn(&no_opt, 5, false, OPTIM_ADAMW, 5, 1);
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(bigger, &no_opt.m, NULL, &no_opt.st, &err), QT_OK);
    expect_refused(bigger, &saved, QT_ERR_FORMAT, "has no optimizer state");
    /* A state asking for a generator the file lacks. */
    saved.st.rngs[1].name = "shuffle";
    expect_refused(path, &saved, QT_ERR_FORMAT, "random generator 'shuffle'");
    run_free(&saved);
    run_free(&wide);
    run_free(&deep);
    run_free(&sgd);
    run_free(&no_opt);
    free(path);
    free(bigger);
    test_tmpdir_remove(dir);
}

static void test_truncated_file(void) {
    char *dir = test_tmpdir_new();
    char *path = test_path_join(dir, "good.h5"), *cut = test_path_join(dir, "cut.h5");
    Run r;
    run_cnn(&r, 5, false, OPTIM_ADAMW, 1, 2);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(path, &r.m, &r.opt, &r.st, &err), QT_OK);
    size_t n = 0;
    char *bytes = test_file_read(path, &n);
    CU_ASSERT_FATAL(bytes && n > 1000);
    size_t cuts[] = {n / 2, n - 1, 3 * n / 4, 600, 8};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        test_file_write(cut, bytes, cuts[i]);
        expect_refused(cut, &r, QT_ERR_FORMAT, "cut.h5");
    }
    free(bytes);
    run_free(&r);
    free(path);
    free(cut);
    test_tmpdir_remove(dir);
}

static void test_load_params(void) {
    char *dir = test_tmpdir_new();
    char *path = test_path_join(dir, "p.h5");
    Run a, b, other;
    run_cnn(&a, 5, false, OPTIM_ADAMW, 1, 2);
    run_cnn(&b, 5, false, OPTIM_SGD, 2, 0);
    run_cnn(&other, 6, false, OPTIM_ADAMW, 3, 0);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(path, &a.m, &a.opt, &a.st, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(path, &b.m, &err), QT_OK);
    CU_ASSERT(test_params_equal(&a.m, &b.m));
    CU_ASSERT_EQUAL(b.opt.step, 0); /* only the parameters */
    Snapshot before = snapshot(&other);
    CU_ASSERT_EQUAL(checkpoint_load_params(path, &other.m, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "fc/weight"));
    CU_ASSERT(snapshot_same(before, &other));
    free(before.bytes);
    test_assert_hdf5_closed();
    run_free(&a);
    run_free(&b);
    run_free(&other);
    free(path);
    test_tmpdir_remove(dir);
}

/* ---- run totals ------------------------------------------------------------------------------------ */

/* The run totals of /train are saved from a zero-initialised state too,
 * and a resume needs them (model.init_from does not). */
static void test_run_totals(void) {
    char *dir = test_tmpdir_new();
    char *path = test_path_join(dir, "t.h5");
    Run src, dst;
    run_cnn(&src, 5, false, OPTIM_ADAMW, 1, 2);
    run_cnn(&dst, 5, false, OPTIM_ADAMW, 2, 1);
    /* A zero-initialised state loads back as zeros; no state at all saves NaN as the last loss. */
    QtError err = {0};
    CheckpointState zero = {0}, back = {.train_s = 5.0, .wall_s = 6.0, .trained_examples = 7, .last_train_loss = 8.0};
    CU_ASSERT_EQUAL(checkpoint_save(path, &src.m, &src.opt, &zero, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load(path, &dst.m, &dst.opt, &back, &err), QT_OK);
    CU_ASSERT(back.train_s == 0.0 && back.wall_s == 0.0 && back.trained_examples == 0 && back.last_train_loss == 0.0);
    CU_ASSERT_EQUAL(checkpoint_save(path, &src.m, &src.opt, NULL, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load(path, &dst.m, &dst.opt, &back, &err), QT_OK);
    CU_ASSERT(isnan(back.last_train_loss));

    /* Without any one of them the file is incomplete. */
    const char *names[] = {"train_s", "wall_s", "trained_examples", "last_train_loss"};
    for (int i = 0; i < 4; i++) {
        CU_ASSERT_EQUAL_FATAL(checkpoint_save(path, &src.m, &src.opt, &src.st, &err), QT_OK);
        hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
        CU_ASSERT_FATAL(f >= 0);
        CU_ASSERT(H5Adelete_by_name(f, "train", names[i], H5P_DEFAULT) >= 0);
        H5Fclose(f);
        char want[64];
        snprintf(want, sizeof want, "lacks the run total '%s'", names[i]);
        expect_refused(path, &dst, QT_ERR_FORMAT, want);
        expect_refused(path, &dst, QT_ERR_FORMAT, "model.init_from");
        CU_ASSERT_EQUAL(checkpoint_load_params(path, &dst.m, &err), QT_OK);
    }
    CU_ASSERT_EQUAL(err.status, QT_OK);
    test_assert_hdf5_closed();
    run_free(&src);
    run_free(&dst);
    free(path);
    test_tmpdir_remove(dir);
}

/* ---- inspect -------------------------------------------------------------------------------------- */

static void test_inspect(void) {
    char *dir = test_tmpdir_new();
    char *path = test_path_join(dir, "i.h5"), *text = test_path_join(dir, "t.txt");
    Run r;
    run_cnn(&r, 5, false, OPTIM_ADAMW, 1, 2);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(path, &r.m, &r.opt, &r.st, &err), QT_OK);
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    CU_ASSERT_EQUAL(checkpoint_inspect(path, f, &err), QT_OK);
    fclose(f);
    const char *want[] = {"/params/conv1/weight", "float32", "(3, 1, 3, 3)", "108 bytes", "/params/fc/bias",
                          "(5,)", "/optim/fc/weight/m", "@format = \"qtrain\"", "@version = 1",
                          "@optimizer = \"adamw\"", "@loss_sum = 0.3333333333", "@config = \"run:...\" (",
                          "lines)", "@trained_examples = 1080", "@last_train_loss = 0.6666666667", "total: "};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        bool ok = out && strstr(out, want[i]);
        if (!ok) fprintf(stderr, "\n  inspect output lacks \"%s\":\n%s\n", want[i], out ? out : "");
        CU_ASSERT(ok);
    }
    free(out);
    test_file_write(text, "hello\n", 6);
    f = open_memstream(&out, &len);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(checkpoint_inspect(text, f, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "not an HDF5 file"));
    fclose(f);
    free(out);
    test_assert_hdf5_closed();
    run_free(&r);
    free(path);
    free(text);
    test_tmpdir_remove(dir);
}

/* ---- h5io ------------------------------------------------------------------------------------------- */

static void test_h5io_roundtrip(void) {
    char *dir = test_tmpdir_new();
    char *path = test_path_join(dir, "h.h5");
    QtError err = {0};
    H5ioFile f = H5IO_FILE_INIT;
    CU_ASSERT_EQUAL_FATAL(h5io_create_mem(&f, path, 0, &err), QT_OK);
    int32_t q[6] = {-3, -2, -1, 0, 1, 2};
    float x[4] = {1.5f, -2.0f, 0.0f, 3.25f};
    CU_ASSERT_EQUAL(h5io_write(&f, "quant/fc/weight/qvalue", H5T_NATIVE_INT32, q, 2, (int[]){2, 3}, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_write_f32(&f, "/quant/fc/weight/scale", x, 1, (int[]){4}, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_group_create(&f, "lora/fc", &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_group_create(&f, "lora/fc", &err), QT_OK); /* already there: fine */
    CU_ASSERT_EQUAL(h5io_attr_write_i64(&f, "lora/fc", "rank", -4, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_attr_write_i64(&f, "lora/fc", "rank", 4, &err), QT_OK); /* replaced */
    CU_ASSERT_EQUAL(h5io_attr_write_u64(&f, "lora/fc", "big", UINT64_MAX, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_attr_write_f64(&f, "lora/fc", "alpha", 0.1, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_attr_write_str(&f, "", "note", "h\xc3\xa9llo", &err), QT_OK);
    char *long_str = malloc(100001); /* too long for an object header: written variable-length */
    memset(long_str, 'y', 100000);
    long_str[100000] = '\0';
    CU_ASSERT_EQUAL(h5io_attr_write_str(&f, "", "long", long_str, &err), QT_OK);
    free(long_str);
    CU_ASSERT_EQUAL(h5io_attr_write_str(&f, "quant/fc/weight", "qtype", "int4", &err), QT_OK);
    QtError e0 = {0};
    CU_ASSERT_EQUAL(h5io_group_create(&f, "quant/fc/weight/scale/x", &e0), QT_ERR_FORMAT); /* under a dataset */
    CU_ASSERT(test_msg_has(&e0, "/quant/fc/weight/scale exists and is not a group"));
    void *image = NULL;
    size_t size = 0;
    CU_ASSERT_EQUAL(h5io_image(&f, &image, &size, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_close(&f, &err), QT_OK);
    CU_ASSERT_EQUAL(f.id, H5I_INVALID_HID);
    test_file_write(path, image, size);
    free(image);
    if (err.status) fprintf(stderr, "\n  %s\n", err.msg);

    CU_ASSERT_EQUAL_FATAL(h5io_open(&f, path, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_kind(&f, ""), H5IO_GROUP);
    CU_ASSERT_EQUAL(h5io_kind(&f, "quant/fc/weight"), H5IO_GROUP);
    CU_ASSERT_EQUAL(h5io_kind(&f, "quant/fc/weight/qvalue"), H5IO_DATASET);
    CU_ASSERT_EQUAL(h5io_kind(&f, "quant/nothing/here"), H5IO_MISSING);
    CU_ASSERT_EQUAL(h5io_kind(&f, "quant/fc/weight/scale/deeper"), H5IO_MISSING);
    int32_t q2[6];
    float x2[4];
    CU_ASSERT_EQUAL(h5io_read(&f, "quant/fc/weight/qvalue", H5T_NATIVE_INT32, q2, 2, (int[]){2, 3}, &err), QT_OK);
    CU_ASSERT_EQUAL(memcmp(q, q2, sizeof q), 0);
    CU_ASSERT_EQUAL(h5io_read_f32(&f, "quant/fc/weight/scale", x2, 1, (int[]){4}, &err), QT_OK);
    CU_ASSERT_EQUAL(memcmp(x, x2, sizeof x), 0);
    H5ioInfo info;
    char buf[64];
    CU_ASSERT_EQUAL(h5io_dataset_info(&f, "quant/fc/weight/qvalue", &info, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(h5io_dtype_str(&info, buf, sizeof buf), "int32");
    CU_ASSERT_STRING_EQUAL(h5io_shape_str(&info, buf, sizeof buf), "(2, 3)");
    int64_t rank = 0;
    uint64_t big = 0;
    double alpha = 0;
    char *s = NULL, *fixed = NULL;
    CU_ASSERT_EQUAL(h5io_attr_read_i64(&f, "lora/fc", "rank", &rank, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_attr_read_u64(&f, "lora/fc", "big", &big, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_attr_read_f64(&f, "lora/fc", "alpha", &alpha, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_attr_read_str(&f, "/", "note", &s, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_attr_read_str(&f, "quant/fc/weight", "qtype", &fixed, &err), QT_OK);
    CU_ASSERT(rank == 4 && big == UINT64_MAX && alpha == 0.1);
    CU_ASSERT(s && strcmp(s, "h\xc3\xa9llo") == 0);
    CU_ASSERT(fixed && strcmp(fixed, "int4") == 0);
    free(s);
    free(fixed);
    char *long_back = NULL;
    CU_ASSERT_EQUAL(h5io_attr_read_str(&f, "/", "long", &long_back, &err), QT_OK);
    CU_ASSERT(long_back && strlen(long_back) == 100000 && long_back[99999] == 'y');
    free(long_back);
    CU_ASSERT_EQUAL(err.status, QT_OK);
    if (err.status) fprintf(stderr, "\n  %s\n", err.msg);

    /* Errors name the file, the object and what was expected. */
    QtError e1 = {0}, e2 = {0}, e3 = {0}, e4 = {0};
    CU_ASSERT_EQUAL(h5io_read_f32(&f, "quant/fc/weight/scale", x2, 2, (int[]){2, 2}, &e1), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&e1, "/quant/fc/weight/scale has shape (4,), expected (2, 2)"));
    CU_ASSERT(test_msg_has(&e1, "h.h5"));
    CU_ASSERT_EQUAL(h5io_attr_read_i64(&f, "lora/fc", "missing", &rank, &e2), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&e2, "/lora/fc has no attribute 'missing'"));
    CU_ASSERT_EQUAL(h5io_attr_read_i64(&f, "", "note", &rank, &e3), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&e3, "expected an integer"));
    CU_ASSERT_EQUAL(h5io_read_f32(&f, "quant/fc/weight/qvalue", x2, 2, (int[]){2, 3}, &e4), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&e4, "int32"));
    CU_ASSERT_EQUAL(h5io_close(&f, &err), QT_OK);
    test_assert_hdf5_closed();
    free(path);
    test_tmpdir_remove(dir);
}

/* test_checkpoint_dir.c: failed saves and run directories. */
extern int checkpoint_dir_tests_add(CU_pSuite s);
extern int hook_tests_add(CU_pSuite s); /* test_hook.c */

/* ---- SHA-256: the FIPS 180-4 examples (one, two and "long" message blocks, and the empty message) ---- */

static void sha256_of(const void *msg, size_t len, size_t chunk, char hex[SHA256_HEX_CHARS]) {
    Sha256 s;
    uint8_t d[SHA256_DIGEST_BYTES];
    sha256_init(&s);
    for (size_t off = 0; off < len; off += chunk)
        sha256_update(&s, (const char *)msg + off, len - off < chunk ? len - off : chunk);
    sha256_final(&s, d);
    sha256_hex(d, hex);
}

static void test_sha256_fips_vectors(void) {
    static const struct {
        const char *msg, *digest;
    } v[] = {
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
        {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrst"
         "nopqrstu",
         "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
    };
    char hex[SHA256_HEX_CHARS];
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        size_t len = strlen(v[i].msg);
        sha256_of(v[i].msg, len, len ? len : 1, hex); /* in one piece */
        CU_ASSERT_STRING_EQUAL(hex, v[i].digest);
        sha256_of(v[i].msg, len, 1, hex); /* byte by byte: the partial-block path */
        CU_ASSERT_STRING_EQUAL(hex, v[i].digest);
    }
    size_t n = 1000000; /* one million 'a' */
    char *a = malloc(n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(a);
    memset(a, 'a', n);
    sha256_of(a, n, n, hex);
    CU_ASSERT_STRING_EQUAL(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    sha256_of(a, n, 997, hex);
    CU_ASSERT_STRING_EQUAL(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    free(a);
}

int register_checkpoint_suite(void) {
    CU_pSuite s = CU_add_suite("checkpoint", NULL, NULL);
    if (!s) return -1;
    h5io_init(); /* the tests call HDF5 directly too; keep it quiet */
    return !CU_add_test(s, "save/load AdamW CNN is bit-exact", test_roundtrip_adamw_cnn) ||
           !CU_add_test(s, "save/load SGD (momentum, none) is bit-exact", test_roundtrip_sgd) ||
           !CU_add_test(s, "file layout for h5py/PyTorch", test_file_layout) ||
           !CU_add_test(s, "load refuses non-checkpoints, run untouched", test_load_rejects_non_checkpoints) ||
           !CU_add_test(s, "load refuses another model/optimizer", test_load_rejects_other_model) ||
           !CU_add_test(s, "truncated file is refused cleanly", test_truncated_file) ||
           !CU_add_test(s, "load_params", test_load_params) ||
           !CU_add_test(s, "run totals: zero state saves, required to resume", test_run_totals) ||
           !CU_add_test(s, "inspect listing", test_inspect) ||
           !CU_add_test(s, "h5io datasets and attributes", test_h5io_roundtrip) ||
           !CU_add_test(s, "SHA-256: FIPS 180-4 test vectors", test_sha256_fips_vectors) ||
           checkpoint_dir_tests_add(s) != 0 || hook_tests_add(s) != 0;
}
