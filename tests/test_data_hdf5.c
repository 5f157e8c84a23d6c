/* test_data_hdf5.c - data sets from HDF5 files (data.dataset: hdf5) and any
 * IDX set (data.dataset: idx).
 *
 * Files are written here with HDF5's C API (every element type, chunked
 * and gzip'd or contiguous, bad files of each kind). Fashion-MNIST's mini
 * set as HDF5 gives the IDX reader's floats and trains to the same
 * parameters; reading per batch by hyperslab gives the batches of reading
 * the file once; a 3-channel 16x20 set of 7 classes, uint8 and float32,
 * trains and resumes bit for bit; each bad file is an error naming the
 * file, the dataset and what is wrong. */
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "data/dataset.h"
#include "test_proc.h"
#include "test_runs.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/train.h"

static char *root;

static int suite_init(void) {
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    root = test_tmpdir_new();
    return root ? 0 : -1;
}

static int suite_cleanup(void) {
    bool ok = test_tmpdir_remove(root);
    root = NULL;
    return ok ? 0 : -1;
}

static const char *tmp(const char *name) {
    static char buf[4][1024];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", root, name);
    return buf[k];
}

/* ---- writing files ---------------------------------------------------------------- */

/* One dataset to write: its path, file type, shape, data in mtype (NULL: never written), and gzip chunks of
 * `chunk_rows` rows (0: contiguous). */
typedef struct {
    const char *path;
    hid_t ftype, mtype;
    int rank;
    hsize_t dims[5];
    const void *data;
    hsize_t chunk_rows;
} DsSpec;

static hid_t half_type(void) {
    hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    H5Tset_fields(t, 15, 10, 5, 0, 10);
    H5Tset_precision(t, 16);
    H5Tset_size(t, 2);
    H5Tset_ebias(t, 15);
    return t;
}

/* Writes file `name` with the datasets and, when n_classes > 0, a root attribute `classes` of that many
 * integers (its length is what counts). */
static bool write_h5(const char *file, const DsSpec *ds, int n, int n_classes) {
    hid_t f = H5Fcreate(file, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    if (f < 0) return false;
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    bool ok = true;
    for (int i = 0; i < n && ok; i++) {
        hid_t sp = H5Screate_simple(ds[i].rank, ds[i].dims, NULL), dcpl = H5Pcreate(H5P_DATASET_CREATE);
        if (ds[i].chunk_rows) {
            hsize_t chunk[5];
            memcpy(chunk, ds[i].dims, sizeof chunk);
            chunk[0] = ds[i].chunk_rows < ds[i].dims[0] ? ds[i].chunk_rows : ds[i].dims[0];
            H5Pset_chunk(dcpl, ds[i].rank, chunk);
            H5Pset_deflate(dcpl, 4);
        }
        hid_t d = H5Dcreate2(f, ds[i].path, ds[i].ftype, sp, lcpl, dcpl, H5P_DEFAULT);
        ok = d >= 0 && (!ds[i].data || H5Dwrite(d, ds[i].mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, ds[i].data) >= 0);
        if (d >= 0) H5Dclose(d);
        H5Pclose(dcpl);
        H5Sclose(sp);
    }
    if (ok && n_classes > 0) {
        hsize_t k = (hsize_t)n_classes;
        int64_t names[256] = {0};
        hid_t sp = H5Screate_simple(1, &k, NULL);
        hid_t a = H5Acreate2(f, "classes", H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
        ok = a >= 0 && H5Awrite(a, H5T_NATIVE_INT64, names) >= 0;
        if (a >= 0) H5Aclose(a);
        H5Sclose(sp);
    }
    H5Pclose(lcpl);
    return H5Fclose(f) >= 0 && ok;
}

/* A set of n examples of `feat` values each (per example shape given by rank/dims[1..]), values v(i) =
 * (i * 37 + 11) % 251, labels i % classes. */
typedef struct {
    int n_train, n_test;
    int rank;
    hsize_t shape[4];    /* per example (rank - 1 dims) */
    hid_t ftype, mtype;  /* examples */
    size_t elem;         /* bytes per element */
    int classes;         /* 0: float targets of k_targets values */
    int k_targets;
    hsize_t chunk_rows;
} GenSpec;

static void fill_values(void *buf, size_t count, const GenSpec *g, size_t off) {
    for (size_t i = 0; i < count; i++) {
        const int v = (int)(((off + i) * 37 + 11) % 251);
        if (g->mtype == H5T_NATIVE_UINT8) ((uint8_t *)buf)[i] = (uint8_t)v;
        else if (g->mtype == H5T_NATIVE_INT8) ((int8_t *)buf)[i] = (int8_t)(v - 125);
        else ((float *)buf)[i] = (float)(v - 125) / 16.0f;
    }
}

static bool write_gen(const char *file, const GenSpec *g) {
    size_t feat = 1;
    for (int i = 0; i < g->rank - 1; i++) feat *= g->shape[i];
    const int ns[2] = {g->n_train, g->n_test};
    void *x[2] = {NULL, NULL}, *y[2] = {NULL, NULL};
    DsSpec ds[4];
    static const char *const names[2][2] = {{"train/x", "train/y"}, {"test/x", "test/y"}};
    for (int s = 0; s < 2; s++) {
        x[s] = malloc((size_t)ns[s] * feat * 4);
        fill_values(x[s], (size_t)ns[s] * feat, g, s ? 100000 : 0);
        ds[2 * s] = (DsSpec){names[s][0], g->ftype, g->mtype, g->rank, {(hsize_t)ns[s]}, x[s], g->chunk_rows};
        memcpy(ds[2 * s].dims + 1, g->shape, sizeof g->shape);
        if (g->classes) {
            int64_t *lab = malloc((size_t)ns[s] * sizeof *lab);
            for (int i = 0; i < ns[s]; i++) lab[i] = (i + s) % g->classes;
            y[s] = lab;
            ds[2 * s + 1] = (DsSpec){names[s][1], H5T_STD_I64LE, H5T_NATIVE_INT64, 1, {(hsize_t)ns[s]}, lab, 0};
        } else {
            float *t = malloc((size_t)ns[s] * g->k_targets * sizeof *t);
            for (int i = 0; i < ns[s] * g->k_targets; i++) t[i] = (float)(i % 13) * 0.25f - 1.0f;
            y[s] = t;
            ds[2 * s + 1] = (DsSpec){names[s][1], H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, g->k_targets > 1 ? 2 : 1,
                                     {(hsize_t)ns[s], (hsize_t)g->k_targets}, t, 0};
        }
    }
    bool ok = write_h5(file, ds, 4, 0);
    for (int s = 0; s < 2; s++) free(x[s]), free(y[s]);
    return ok;
}

/* ---- loading ---------------------------------------------------------------------- */

static const char *mini_dir(void) { return "data/fashion-mnist-mini"; }

/* The mini Fashion-MNIST set written as HDF5 (uint8 (N, 1, 28, 28), int64 labels), gzip'd in chunks of 64 rows
 * when chunked. */
static bool write_mini_h5(const char *file, bool chunked) {
    Dataset tr, te;
    QtError e = {0};
    if (dataset_load_fashion_mnist(&tr, &te, mini_dir(), &e) != QT_OK) return false;
    int64_t *ly[2] = {malloc((size_t)tr.n * 8), malloc((size_t)te.n * 8)};
    for (int i = 0; i < tr.n; i++) ly[0][i] = tr.labels[i];
    for (int i = 0; i < te.n; i++) ly[1][i] = te.labels[i];
    DsSpec ds[4] = {
        {"train/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, 4, {(hsize_t)tr.n, 1, 28, 28}, tr.pixels, chunked ? 64 : 0},
        {"train/y", H5T_STD_I64LE, H5T_NATIVE_INT64, 1, {(hsize_t)tr.n}, ly[0], 0},
        {"test/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, 4, {(hsize_t)te.n, 1, 28, 28}, te.pixels, chunked ? 64 : 0},
        {"test/y", H5T_STD_I64LE, H5T_NATIVE_INT64, 1, {(hsize_t)te.n}, ly[1], 0},
    };
    bool ok = write_h5(file, ds, 4, 0);
    free(ly[0]), free(ly[1]);
    dataset_free(&tr), dataset_free(&te);
    return ok;
}

static void assert_same_floats(const Dataset *a, const Dataset *b) {
    CU_ASSERT_EQUAL_FATAL(a->n, b->n);
    CU_ASSERT_EQUAL_FATAL(a->feat, b->feat);
    float *xa = malloc((size_t)a->n * a->feat * sizeof(float)), *xb = malloc((size_t)b->n * b->feat * sizeof(float));
    int32_t *ya = malloc((size_t)a->n * 4), *yb = malloc((size_t)b->n * 4);
    QtError e = {0};
    CU_ASSERT_EQUAL(dataset_fill_range(a, 0, a->n, xa, ya, &e), QT_OK);
    CU_ASSERT_EQUAL(dataset_fill_range(b, 0, b->n, xb, yb, &e), QT_OK);
    CU_ASSERT(memcmp(xa, xb, (size_t)a->n * a->feat * sizeof(float)) == 0);
    CU_ASSERT(memcmp(ya, yb, (size_t)a->n * 4) == 0);
    free(xa), free(xb), free(ya), free(yb);
}

static void test_mini_as_hdf5_equals_idx(void) {
    Dataset tr, te, h[3];
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist(&tr, &te, mini_dir(), &e), QT_OK);
    for (int chunked = 0; chunked < 2; chunked++) {
        const char *f = tmp(chunked ? "mini-gz.h5" : "mini.h5");
        CU_ASSERT_FATAL(write_mini_h5(f, chunked));
        for (int storage = 0; storage < 2; storage++) {
            QtStatus st = dataset_load_hdf5(&h[0], &h[1], &h[2], f, storage ? DATA_STORAGE_FILE : DATA_STORAGE_MEMORY,
                                            512u << 20, &e);
            if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
            CU_ASSERT_EQUAL_FATAL(st, QT_OK);
            CU_ASSERT_EQUAL(h[0].n_classes, 10);
            CU_ASSERT_EQUAL(h[1].n, 0);
            CU_ASSERT((h[0].file != NULL) == (storage == 1));
            CU_ASSERT_EQUAL(h[0].ndim, 3);
            CU_ASSERT(h[0].shape[0] == 1 && h[0].shape[1] == 28 && h[0].shape[2] == 28);
            assert_same_floats(&tr, &h[0]);
            assert_same_floats(&te, &h[2]);
            /* a random batch, as the batcher draws it */
            uint32_t idx[37];
            for (int i = 0; i < 37; i++) idx[i] = (uint32_t)((i * 811 + 5) % tr.n);
            float xa[37 * 784], xb[37 * 784];
            CU_ASSERT_EQUAL(dataset_fill_batch(&tr, idx, 37, xa, NULL, &e), QT_OK);
            CU_ASSERT_EQUAL(dataset_fill_batch(&h[0], idx, 37, xb, NULL, &e), QT_OK);
            CU_ASSERT(memcmp(xa, xb, sizeof xa) == 0);
            for (int k = 0; k < 3; k++) dataset_free(&h[k]);
        }
    }
    dataset_free(&tr), dataset_free(&te);
}

/* Every element type, ranks 2 to 4, class labels and value targets: the floats are the stored values through
 * the load's map (uint8: / 255), whether read once or per batch (max_memory 1 byte: auto reads per batch). */
static void test_element_types_and_shapes(void) {
    hid_t half = half_type();
    const GenSpec specs[] = {
        {40, 9, 4, {3, 16, 20}, H5T_STD_U8LE, H5T_NATIVE_UINT8, 1, 7, 0, 0},
        {40, 9, 4, {3, 16, 20}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 4, 7, 0, 16},
        {33, 5, 3, {16, 20}, H5T_STD_I8LE, H5T_NATIVE_INT8, 1, 3, 0, 0},
        {50, 8, 2, {12}, half, H5T_NATIVE_FLOAT, 4, 0, 3, 8},
        {50, 8, 2, {12}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 4, 0, 1, 0},
    };
    for (size_t k = 0; k < sizeof specs / sizeof specs[0]; k++) {
        const GenSpec *g = &specs[k];
        const char *f = tmp("gen.h5");
        CU_ASSERT_FATAL(write_gen(f, g));
        for (int per_batch = 0; per_batch < 2; per_batch++) {
            Dataset d[3];
            QtError e = {0};
            QtStatus st = dataset_load_hdf5(&d[0], &d[1], &d[2], f, DATA_STORAGE_AUTO, per_batch ? 1 : 1u << 30, &e);
            if (st != QT_OK) fprintf(stderr, "\n  case %zu: %s\n", k, e.msg);
            CU_ASSERT_EQUAL_FATAL(st, QT_OK);
            CU_ASSERT((d[0].file != NULL) == per_batch);
            size_t feat = 1;
            for (int i = 0; i < g->rank - 1; i++) feat *= g->shape[i];
            CU_ASSERT_EQUAL(d[0].feat, (int)feat);
            CU_ASSERT_EQUAL(d[0].ndim, g->rank == 2 ? 1 : 3);
            CU_ASSERT_EQUAL(d[0].shape[0], g->rank == 4 ? (int)g->shape[0] : g->rank == 3 ? 1 : (int)g->shape[0]);
            CU_ASSERT_EQUAL(d[0].n_classes, g->classes);
            CU_ASSERT_EQUAL(d[0].n_targets, g->k_targets);
            float *x = malloc((size_t)g->n_test * feat * sizeof *x);
            float *want = malloc((size_t)g->n_test * feat * sizeof *want);
            CU_ASSERT_EQUAL(dataset_fill_range(&d[2], 0, g->n_test, x, NULL, &e), QT_OK);
            uint8_t raw[4];
            for (size_t i = 0; i < (size_t)g->n_test * feat; i++) {
                GenSpec one = *g;
                fill_values(raw, 1, &one, 100000 + i);
                want[i] = g->mtype == H5T_NATIVE_UINT8  ? (1.0f / 255.0f) * (float)raw[0] + 0.0f
                          : g->mtype == H5T_NATIVE_INT8 ? 1.0f * (float)(int8_t)raw[0] + 0.0f
                                                        : *(float *)(void *)raw; /* k/16: exact in float16 too */
            }
            CU_ASSERT(memcmp(x, want, (size_t)g->n_test * feat * sizeof *x) == 0);
            if (g->classes) {
                for (int i = 0; i < g->n_test; i++) CU_ASSERT_EQUAL(d[2].labels[i], (i + 1) % g->classes);
            } else {
                float t[8 * 3];
                CU_ASSERT(dataset_fill_targets_range(&d[2], 0, g->n_test, t));
                for (int i = 0; i < g->n_test * g->k_targets; i++)
                    CU_ASSERT_EQUAL(t[i], (float)(i % 13) * 0.25f - 1.0f);
            }
            free(x), free(want);
            for (int s = 0; s < 3; s++) dataset_free(&d[s]);
        }
    }
    H5Tclose(half);
}

/* Per-channel normalize with given lists and measured per channel; limit and the validation split carry value
 * targets; classes on value targets is refused. */
static void test_transforms_per_channel_and_targets(void) {
    const GenSpec g = {60, 10, 4, {3, 4, 5}, H5T_STD_U8LE, H5T_NATIVE_UINT8, 1, 4, 0, 0};
    const char *f = tmp("chan.h5");
    CU_ASSERT_FATAL(write_gen(f, &g));
    Dataset d[3];
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_load_hdf5(&d[0], &d[1], &d[2], f, DATA_STORAGE_MEMORY, 1u << 30, &e), QT_OK);
    Transform t = {.kind = TRANSFORM_NORMALIZE, .stats_given = true, .n_stats = 3,
                   .means = {0.1f, 0.2f, 0.3f}, .stds = {0.5f, 0.25f, 2.0f}};
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&d[0], &d[2], &t, 1, &e), QT_OK);
    CU_ASSERT_FATAL(d[0].chan_scale != NULL && d[2].chan_scale != NULL);
    for (int c = 0; c < 3; c++) {
        CU_ASSERT_EQUAL(d[0].chan_scale[c], (float)((1.0 / 255.0) / t.stds[c]));
        CU_ASSERT_EQUAL(d[0].chan_shift[c], (float)((0.0 - t.means[c]) / t.stds[c]));
    }
    float x[60], want[60];
    CU_ASSERT_EQUAL(dataset_fill_range(&d[2], 0, 1, x, NULL, &e), QT_OK);
    for (int i = 0; i < 60; i++) {
        uint8_t raw[4];
        fill_values(raw, 1, &g, 100000 + (size_t)i);
        want[i] = d[2].chan_scale[i / 20] * (float)raw[0] + d[2].chan_shift[i / 20];
    }
    CU_ASSERT(memcmp(x, want, sizeof x) == 0);
    /* measured per channel: each channel of the training set then has mean 0 and std 1 */
    Transform m = {.kind = TRANSFORM_NORMALIZE, .per_channel = true};
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&d[0], &d[2], &m, 1, &e), QT_OK);
    float *all = malloc((size_t)d[0].n * 60 * sizeof *all);
    CU_ASSERT_EQUAL(dataset_fill_range(&d[0], 0, d[0].n, all, NULL, &e), QT_OK);
    for (int c = 0; c < 3; c++) {
        double s = 0, s2 = 0;
        for (int i = 0; i < d[0].n; i++)
            for (int p = 0; p < 20; p++) {
                const double v = all[i * 60 + c * 20 + p];
                s += v, s2 += v * v;
            }
        const double mean = s / (d[0].n * 20.0), var = s2 / (d[0].n * 20.0) - mean * mean;
        CU_ASSERT(fabs(mean) < 1e-5 && fabs(var - 1.0) < 1e-4);
    }
    free(all);
    /* a list of the wrong length */
    t.n_stats = 2;
    e = (QtError){0};
    CU_ASSERT_EQUAL(dataset_apply_transforms(&d[0], &d[2], &t, 1, &e), QT_ERR_CONFIG);
    CU_ASSERT(strstr(e.msg, "2 means and stds given, but the examples have 3 channels") != NULL);
    for (int s = 0; s < 3; s++) dataset_free(&d[s]);

    const GenSpec r = {50, 8, 2, {6}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 4, 0, 2, 0};
    CU_ASSERT_FATAL(write_gen(f, &r));
    CU_ASSERT_EQUAL_FATAL(dataset_load_hdf5(&d[0], &d[1], &d[2], f, DATA_STORAGE_FILE, 1u << 30, &e), QT_OK);
    Transform lim = {.kind = TRANSFORM_LIMIT, .limit = 30}, cls = {.kind = TRANSFORM_CLASSES, .n_classes = 1};
    e = (QtError){0};
    CU_ASSERT_EQUAL(dataset_apply_transforms(&d[0], &d[2], &cls, 1, &e), QT_ERR_CONFIG);
    CU_ASSERT(strstr(e.msg, "targets are values") != NULL);
    e = (QtError){0};
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&d[0], &d[2], &lim, 1, &e), QT_OK);
    Dataset val;
    CU_ASSERT_EQUAL_FATAL(dataset_split_tail(&d[0], &val, 0.2, &e), QT_OK);
    CU_ASSERT(d[0].n == 24 && val.n == 6 && val.n_targets == 2);
    float tv[12], xv[36];
    CU_ASSERT(dataset_fill_targets_range(&val, 0, 6, tv));
    for (int i = 0; i < 12; i++) CU_ASSERT_EQUAL(tv[i], (float)((48 + i) % 13) * 0.25f - 1.0f);
    CU_ASSERT_EQUAL(dataset_fill_range(&val, 0, 6, xv, NULL, &e), QT_OK);
    for (int i = 0; i < 36; i++) {
        float want1;
        fill_values(&want1, 1, &r, (size_t)(24 * 6 + i));
        CU_ASSERT_EQUAL(xv[i], want1);
    }
    dataset_free(&val);
    for (int s = 0; s < 3; s++) dataset_free(&d[s]);
}

/* ---- bad files: one error per kind, naming the file and the dataset ----------------------------------------- */

typedef struct {
    const char *what;
    DsSpec ds[6];
    int n, classes;
    const char *want[2]; /* substrings of the message */
    QtStatus status;
} BadCase;

static void test_bad_files(void) {
    static uint8_t x8[4 * 2 * 3];
    static int64_t y4[4] = {0, 1, 2, 1}, y3[3] = {0, 1, 1}, yneg[4] = {0, -1, 1, 1};
    static float xnan[4 * 6], tinf[4];
    static double x64[4 * 6];
    static int16_t x16[4 * 6];
    for (int i = 0; i < 24; i++) xnan[i] = (float)i;
    xnan[13] = NAN;
    tinf[2] = INFINITY;
#define TEST_SPLIT(xp, ft, mt, x, yp, yft, ymt, ydim, y)                                                          \
    {xp, ft, mt, 3, {4, 2, 3}, x, 0}, { yp, yft, ymt, 1, {ydim}, y, 0 }
    const BadCase cases[] = {
        {"N mismatch", {TEST_SPLIT("train/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "train/y", H5T_STD_I64LE,
                                   H5T_NATIVE_INT64, 3, y3),
                        TEST_SPLIT("test/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "test/y", H5T_STD_I64LE,
                                   H5T_NATIVE_INT64, 4, y4)},
         4, 0, {"/train/x holds 4 examples but /train/y holds 3", NULL}, QT_ERR_FORMAT},
        {"rank", {{"train/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, 1, {24}, x8, 0},
                  {"train/y", H5T_STD_I64LE, H5T_NATIVE_INT64, 1, {4}, y4, 0},
                  TEST_SPLIT("test/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "test/y", H5T_STD_I64LE,
                             H5T_NATIVE_INT64, 4, y4)},
         4, 0, {"/train/x has shape (24,)", "(N, C, H, W), (N, H, W) or (N, F)"}, QT_ERR_FORMAT},
        {"float64", {TEST_SPLIT("train/x", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, x64, "train/y", H5T_STD_I64LE,
                                H5T_NATIVE_INT64, 4, y4),
                     TEST_SPLIT("test/x", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, x64, "test/y", H5T_STD_I64LE,
                                H5T_NATIVE_INT64, 4, y4)},
         4, 0, {"/train/x is float64", "uint8, int8, float16 or float32"}, QT_ERR_FORMAT},
        {"int16", {TEST_SPLIT("train/x", H5T_STD_I16LE, H5T_NATIVE_INT16, x16, "train/y", H5T_STD_I64LE,
                              H5T_NATIVE_INT64, 4, y4),
                   TEST_SPLIT("test/x", H5T_STD_I16LE, H5T_NATIVE_INT16, x16, "test/y", H5T_STD_I64LE,
                              H5T_NATIVE_INT64, 4, y4)},
         4, 0, {"/train/x is int16", NULL}, QT_ERR_FORMAT},
        {"NaN", {TEST_SPLIT("train/x", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, xnan, "train/y", H5T_STD_I64LE,
                            H5T_NATIVE_INT64, 4, y4),
                 TEST_SPLIT("test/x", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, xnan, "test/y", H5T_STD_I64LE,
                            H5T_NATIVE_INT64, 4, y4)},
         4, 0, {"/train/x: value 1 of example 2 is nan", NULL}, QT_ERR_VALUE},
        {"inf target", {TEST_SPLIT("train/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "train/y", H5T_IEEE_F32LE,
                                   H5T_NATIVE_FLOAT, 4, tinf),
                        TEST_SPLIT("test/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "test/y", H5T_IEEE_F32LE,
                                   H5T_NATIVE_FLOAT, 4, tinf)},
         4, 0, {"/train/y: target 0 of example 2 is inf", NULL}, QT_ERR_VALUE},
        {"negative label", {TEST_SPLIT("train/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "train/y", H5T_STD_I64LE,
                                       H5T_NATIVE_INT64, 4, yneg),
                            TEST_SPLIT("test/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "test/y", H5T_STD_I64LE,
                                       H5T_NATIVE_INT64, 4, y4)},
         4, 0, {"/train/y: label -1 of example 1 is out of range", NULL}, QT_ERR_VALUE},
        {"label >= classes", {TEST_SPLIT("train/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "train/y", H5T_STD_I64LE,
                                         H5T_NATIVE_INT64, 4, y4),
                              TEST_SPLIT("test/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "test/y", H5T_STD_I64LE,
                                         H5T_NATIVE_INT64, 4, y4)},
         4, 2, {"a label is 2, but the root attribute 'classes' names 2 classes", NULL}, QT_ERR_VALUE},
        {"empty split", {{"train/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, 3, {0, 2, 3}, NULL, 0},
                         {"train/y", H5T_STD_I64LE, H5T_NATIVE_INT64, 1, {0}, NULL, 0},
                         TEST_SPLIT("test/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "test/y", H5T_STD_I64LE,
                                    H5T_NATIVE_INT64, 4, y4)},
         4, 0, {"/train/x has shape (0, 2, 3): the split is empty", NULL}, QT_ERR_FORMAT},
        {"no test", {TEST_SPLIT("train/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "train/y", H5T_STD_I64LE,
                                H5T_NATIVE_INT64, 4, y4)},
         2, 0, {"no group /test", "docs/DATA.md"}, QT_ERR_FORMAT},
        {"never written", {TEST_SPLIT("train/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, NULL, "train/y", H5T_STD_I64LE,
                                      H5T_NATIVE_INT64, 4, y4),
                           TEST_SPLIT("test/x", H5T_STD_U8LE, H5T_NATIVE_UINT8, x8, "test/y", H5T_STD_I64LE,
                                      H5T_NATIVE_INT64, 4, y4)},
         4, 0, {"refusing dataset /train/x", "never written"}, QT_ERR_FORMAT},
    };
#undef TEST_SPLIT
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const BadCase *c = &cases[k];
        const char *f = tmp("bad.h5");
        CU_ASSERT_FATAL(write_h5(f, c->ds, c->n, c->classes));
        Dataset d[3];
        QtError e = {0};
        QtStatus st = dataset_load_hdf5(&d[0], &d[1], &d[2], f, DATA_STORAGE_MEMORY, 1u << 30, &e);
        bool ok = st == c->status && strstr(e.msg, f) != NULL;
        for (int w = 0; w < 2 && c->want[w]; w++) ok = ok && strstr(e.msg, c->want[w]) != NULL;
        if (!ok) fprintf(stderr, "\n  %s: status %d, message: %s\n", c->what, (int)st, e.msg);
        CU_ASSERT(ok);
        CU_ASSERT(d[0].pixels == NULL && d[0].labels == NULL && d[2].pixels == NULL);
    }
    /* a truncated file, and a file that is not HDF5 */
    const char *f = tmp("trunc.h5");
    CU_ASSERT_FATAL(write_mini_h5(f, false));
    struct stat sb;
    CU_ASSERT_FATAL(stat(f, &sb) == 0);
    CU_ASSERT_FATAL(truncate(f, sb.st_size / 2) == 0);
    Dataset d[3];
    QtError e = {0};
    QtStatus st = dataset_load_hdf5(&d[0], &d[1], &d[2], f, DATA_STORAGE_MEMORY, 1u << 30, &e);
    CU_ASSERT(st == QT_ERR_FORMAT && strstr(e.msg, f) != NULL);
    FILE *txt = fopen(tmp("text.h5"), "w");
    fputs("not hdf5\n", txt);
    fclose(txt);
    e = (QtError){0};
    st = dataset_load_hdf5(&d[0], &d[1], &d[2], tmp("text.h5"), DATA_STORAGE_MEMORY, 1u << 30, &e);
    CU_ASSERT(st == QT_ERR_FORMAT && strstr(e.msg, "not an HDF5 file") != NULL);
    e = (QtError){0};
    st = dataset_load_hdf5(&d[0], &d[1], &d[2], tmp("missing.h5"), DATA_STORAGE_MEMORY, 1u << 30, &e);
    CU_ASSERT(st == QT_ERR_IO && strstr(e.msg, "missing.h5") != NULL);
}

/* A NaN in a float file read per batch: the batch that holds it is an error naming the example and its row. */
static void test_nan_found_per_batch(void) {
    const GenSpec g = {20, 4, 2, {5}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 4, 2, 0, 0};
    const char *f = tmp("nanbatch.h5");
    CU_ASSERT_FATAL(write_gen(f, &g));
    hid_t h = H5Fopen(f, H5F_ACC_RDWR, H5P_DEFAULT), ds = H5Dopen2(h, "train/x", H5P_DEFAULT);
    hid_t sp = H5Dget_space(ds);
    hsize_t at[2] = {7, 3}, one[2] = {1, 1};
    H5Sselect_hyperslab(sp, H5S_SELECT_SET, at, NULL, one, NULL);
    hid_t ms = H5Screate_simple(2, one, NULL);
    float nan = NAN;
    CU_ASSERT(H5Dwrite(ds, H5T_NATIVE_FLOAT, ms, sp, H5P_DEFAULT, &nan) >= 0);
    H5Sclose(ms), H5Sclose(sp), H5Dclose(ds), H5Fclose(h);
    Dataset d[3];
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_load_hdf5(&d[0], &d[1], &d[2], f, DATA_STORAGE_FILE, 1u << 30, &e), QT_OK);
    float x[20 * 5];
    CU_ASSERT_EQUAL(dataset_fill_range(&d[0], 0, 5, x, NULL, &e), QT_OK);
    uint32_t idx[3] = {2, 7, 9};
    CU_ASSERT_EQUAL(dataset_fill_batch(&d[0], idx, 3, x, NULL, &e), QT_ERR_VALUE);
    CU_ASSERT(strstr(e.msg, "value 3 of example 7 (file row 7) is nan") != NULL);
    for (int s = 0; s < 3; s++) dataset_free(&d[s]);
    /* read once, the load finds it */
    e = (QtError){0};
    CU_ASSERT_EQUAL(dataset_load_hdf5(&d[0], &d[1], &d[2], f, DATA_STORAGE_MEMORY, 1u << 30, &e), QT_ERR_VALUE);
    CU_ASSERT(strstr(e.msg, "value 3 of example 7 is nan") != NULL);
}

/* ---- whole runs -------------------------------------------------------------------------------------------- */

static Config *load_cfg(const char *yaml_path, const char *out, const char *const *extra, int n_extra) {
    static char o[1100];
    snprintf(o, sizeof o, "run.out_dir=%s", tmp(out));
    const char *ov[16] = {o};
    for (int i = 0; i < n_extra; i++) ov[1 + i] = extra[i];
    Config *c = malloc(sizeof *c);
    QtError e = {0};
    if (config_load(c, yaml_path, ov, 1 + n_extra, &e) != QT_OK) {
        fprintf(stderr, "\n  %s: %s\n", yaml_path, e.msg);
        free(c);
        return NULL;
    }
    return c;
}

static QtStatus run_cfg(const Config *c, const char *resume, int64_t stop_at, TrainResult *r, QtError *e) {
    TrainOptions o = {.resume = resume, .quiet = true, .stop_at_step = stop_at};
    return train_run(c, &o, r, e);
}

/* The mini set as IDX (data.dataset: fashion-mnist), as HDF5 read once and read per batch (gzip'd chunks), and
 * as data.dataset: idx with data.files: the same parameters after the same steps. */
static void test_runs_hdf5_idx_equal_fashion_mnist(void) {
    const char *h5 = tmp("run-mini.h5"), *gz = tmp("run-mini-gz.h5");
    CU_ASSERT_FATAL(write_mini_h5(h5, false) && write_mini_h5(gz, true));
    char p1[1100], p2[1100];
    snprintf(p1, sizeof p1, "data.path=%s", h5);
    snprintf(p2, sizeof p2, "data.path=%s", gz);
    const char *base[] = {"data.dir=data/fashion-mnist-mini", "train.steps=12"};
    const char *as_h5[] = {"data.dataset=hdf5", p1, "train.steps=12"};
    const char *as_gz[] = {"data.dataset=hdf5", p2, "data.storage=file", "train.steps=12"};
    const char *as_idx[] = {"data.dataset=idx", "data.files.train_x=data/fashion-mnist-mini/train-images-idx3-ubyte.gz",
                            "data.files.train_y=data/fashion-mnist-mini/train-labels-idx1-ubyte.gz",
                            "data.files.test_x=data/fashion-mnist-mini/t10k-images-idx3-ubyte.gz",
                            "data.files.test_y=data/fashion-mnist-mini/t10k-labels-idx1-ubyte.gz", "train.steps=12"};
    Config *c[4] = {load_cfg("tests/configs/tiny-cnn.yaml", "r-idx", base, 2),
                    load_cfg("tests/configs/tiny-cnn.yaml", "r-h5", as_h5, 3),
                    load_cfg("tests/configs/tiny-cnn.yaml", "r-gz", as_gz, 4),
                    load_cfg("tests/configs/tiny-cnn.yaml", "r-files", as_idx, 6)};
    TrainResult r[4];
    for (int i = 0; i < 4; i++) {
        CU_ASSERT_PTR_NOT_NULL_FATAL(c[i]);
        QtError e = {0};
        QtStatus st = run_cfg(c[i], NULL, 0, &r[i], &e);
        if (st != QT_OK) fprintf(stderr, "\n  run %d: %s\n", i, e.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    }
    char fa[1200], fb[1200];
    snprintf(fa, sizeof fa, "%s/final.h5", c[0]->run.out_dir);
    for (int i = 1; i < 4; i++) {
        snprintf(fb, sizeof fb, "%s/final.h5", c[i]->run.out_dir);
        CU_ASSERT(test_ckpt_group_within(fa, fb, "params"));
        CU_ASSERT_EQUAL(r[i].test_loss, r[0].test_loss);
        CU_ASSERT_EQUAL(r[i].test_accuracy, r[0].test_accuracy);
    }
    for (int i = 0; i < 4; i++) free(c[i]);
}

/* A 3-channel 16x20 set of 7 classes, uint8 and float32 (read per batch), augmented (crop, flip, erase): trains,
 * stops mid-epoch, resumes to the bits of a run straight through. */
static void test_runs_3channel_resume(void) {
    static const char yaml[] =
        "run: {seed: 3}\n"
        "data: {dataset: hdf5, transform: [{normalize: {per_channel: true}}],\n"
        "       augment: [{random_crop: {size: [16, 20], padding: 2}}, {hflip: {p: 0.5}}, {random_erase: {p: 0.3}}]}\n"
        "model:\n  input: [3, 16, 20]\n  layers:\n"
        "    - {type: conv2d, out_channels: 6, kernel: 3, padding: 1}\n"
        "    - {type: batchnorm2d}\n    - {type: relu}\n    - {type: maxpool2d, kernel: 2}\n"
        "    - {type: flatten}\n    - {type: dense, units: 7}\n"
        "train: {epochs: 2, batch_size: 16, eval_batch_size: 32, optimizer: {name: adamw, lr: 0.01}}\n";
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s", tmp("three.yaml"));
    FILE *fy = fopen(cfg, "w");
    fputs(yaml, fy);
    fclose(fy);
    const GenSpec specs[2] = {{96, 40, 4, {3, 16, 20}, H5T_STD_U8LE, H5T_NATIVE_UINT8, 1, 7, 0, 0},
                              {96, 40, 4, {3, 16, 20}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 4, 7, 0, 32}};
    for (int k = 0; k < 2; k++) {
        char f[1024];
        snprintf(f, sizeof f, "%s", tmp(k ? "three-f32.h5" : "three-u8.h5"));
        CU_ASSERT_FATAL(write_gen(f, &specs[k]));
        char path[1100];
        snprintf(path, sizeof path, "data.path=%s", f);
        const char *ov[] = {path, k ? "data.storage=file" : "data.storage=memory"};
        Config *a = load_cfg(cfg, k ? "three-a1" : "three-a0", ov, 2), *b = load_cfg(cfg, k ? "three-b1" : "three-b0",
                                                                                        ov, 2);
        CU_ASSERT_PTR_NOT_NULL_FATAL(a);
        CU_ASSERT_PTR_NOT_NULL_FATAL(b);
        TrainResult ra, rb;
        QtError e = {0};
        QtStatus st = run_cfg(a, NULL, 0, &ra, &e);
        if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        CU_ASSERT_EQUAL(ra.steps, 12);
        CU_ASSERT_EQUAL_FATAL(run_cfg(b, NULL, 5, &rb, &e), QT_OK);
        CU_ASSERT_EQUAL_FATAL(run_cfg(b, "auto", 0, &rb, &e), QT_OK);
        CU_ASSERT_EQUAL(rb.test_loss, ra.test_loss);
        char fa[1200], fb[1200];
        snprintf(fa, sizeof fa, "%s/final.h5", a->run.out_dir);
        snprintf(fb, sizeof fb, "%s/final.h5", b->run.out_dir);
        test_runs_assert_same_state(a, fa, fb);
        free(a), free(b);
    }
}

/* Feature vectors (N, F) with float targets train a dense model on mse; image augmentation on them is refused
 * before training, saying why. */
static void test_runs_vectors(void) {
    const GenSpec g = {64, 16, 2, {12}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 4, 0, 2, 0};
    char f[1024], cfg[1024], path[1100];
    snprintf(f, sizeof f, "%s", tmp("vec.h5"));
    snprintf(cfg, sizeof cfg, "%s", tmp("vec.yaml"));
    CU_ASSERT_FATAL(write_gen(f, &g));
    FILE *fy = fopen(cfg, "w");
    fputs("data: {dataset: hdf5}\nmodel:\n  input: [12]\n  layers:\n    - {type: dense, units: 8}\n"
          "    - {type: batchnorm1d}\n    - {type: relu}\n    - {type: dense, units: 2}\n"
          "train: {loss: mse, epochs: 3, batch_size: 16}\n", fy);
    fclose(fy);
    snprintf(path, sizeof path, "data.path=%s", f);
    const char *ov[] = {path, "data.augment=[{hflip: {p: 0.5}}]"};
    Config *a = load_cfg(cfg, "vec-a", ov, 1), *b = load_cfg(cfg, "vec-b", ov, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(a);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    TrainResult r;
    QtError e = {0};
    QtStatus st = run_cfg(a, NULL, 0, &r, &e);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
    CU_ASSERT_EQUAL(st, QT_OK);
    CU_ASSERT_EQUAL(r.steps, 12);
    e = (QtError){0};
    CU_ASSERT_EQUAL(run_cfg(b, NULL, 0, &r, &e), QT_ERR_CONFIG);
    CU_ASSERT(strstr(e.msg, "augment") != NULL);
    free(a), free(b);
}

/* A 2.1 GB uint8 file (2,750,000 examples of 28x28, contiguous) trains with the examples read per batch: the run's
 * peak RSS stays under 300 MB. Skipped, visibly, without 3 GB of free space; under a sanitizer the RSS bound is
 * not checked (its shadow memory counts). */
static void test_run_over_a_2gb_file(void) {
    struct statvfs fs;
    const char *f = tmp("big.h5");
    if (statvfs(root, &fs) != 0 || (unsigned long long)fs.f_bavail * fs.f_frsize < (3ull << 30)) {
        test_skip("data_hdf5: a 2 GB data file needs 3 GB free in %s", root);
        return;
    }
    enum { N = 2750000, NT = 1000, F = 784, SLAB = 65536 };
    hid_t h = H5Fcreate(f, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    uint8_t *buf = malloc((size_t)SLAB * F);
    int64_t *lab = malloc((size_t)N * sizeof *lab);
    bool ok = h >= 0 && buf && lab;
    for (int s = 0; s < 2 && ok; s++) {
        const hsize_t n = s ? NT : N, dims[4] = {n, 1, 28, 28};
        hid_t sp = H5Screate_simple(4, dims, NULL);
        hid_t d = H5Dcreate2(h, s ? "test/x" : "train/x", H5T_STD_U8LE, sp, lcpl, H5P_DEFAULT, H5P_DEFAULT);
        for (hsize_t r0 = 0; ok && r0 < n; r0 += SLAB) {
            const hsize_t k = n - r0 < SLAB ? n - r0 : SLAB, at[4] = {r0, 0, 0, 0}, cnt[4] = {k, 1, 28, 28};
            for (size_t i = 0; i < (size_t)k * F; i++) buf[i] = (uint8_t)((r0 * F + i) * 2654435761u >> 24);
            hid_t ms = H5Screate_simple(4, cnt, NULL);
            H5Sselect_hyperslab(sp, H5S_SELECT_SET, at, NULL, cnt, NULL);
            ok = H5Dwrite(d, H5T_NATIVE_UINT8, ms, sp, H5P_DEFAULT, buf) >= 0;
            H5Sclose(ms);
        }
        H5Dclose(d), H5Sclose(sp);
        for (hsize_t i = 0; i < n; i++) lab[i] = (int64_t)(i % 10);
        hid_t ls = H5Screate_simple(1, &n, NULL);
        hid_t l = H5Dcreate2(h, s ? "test/y" : "train/y", H5T_STD_I64LE, ls, lcpl, H5P_DEFAULT, H5P_DEFAULT);
        ok = ok && H5Dwrite(l, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, lab) >= 0;
        H5Dclose(l), H5Sclose(ls);
    }
    H5Pclose(lcpl);
    ok = H5Fclose(h) >= 0 && ok;
    free(buf), free(lab);
    CU_ASSERT_FATAL(ok);
    char path[1100], out[1100];
    snprintf(path, sizeof path, "data.path=%s", f);
    snprintf(out, sizeof out, "run.out_dir=%s", tmp("big-run"));
    const char *args[] = {"--config", "tests/configs/tiny-mlp.yaml", "--set", "data.dataset=hdf5", "--set", path,
                          "--set", "data.dir=/usr/share/datasets/fashion-mnist", "--set", out, "--set",
                          "train.steps=30", "--set", "data.transform=[]", "--quiet", NULL};
    pid_t pid = test_proc_start(tmp("big-run.log"), args);
    CU_ASSERT_FATAL(pid > 0);
    int status = 0;
    struct rusage ru;
    CU_ASSERT_FATAL(wait4(pid, &status, 0, &ru) == pid);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    const double mb = (double)ru.ru_maxrss / 1024.0;
    fprintf(stderr, "(peak RSS %.0f MB) ", mb);
#if defined(__SANITIZE_ADDRESS__)
    test_skip("data_hdf5: the 300 MB peak-RSS bound of the 2 GB run is not checked under AddressSanitizer (%.0f MB "
              "with its shadow memory)", mb);
#else
    CU_ASSERT(mb < 300.0);
#endif
    unlink(f);
}

int register_data_hdf5_suite(void) {
    CU_pSuite s = CU_add_suite("data_hdf5", suite_init, suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "the mini Fashion-MNIST as HDF5 (read once, per batch, gzip'd) gives the IDX floats",
                        test_mini_as_hdf5_equals_idx) ||
           !CU_add_test(s, "uint8, int8, float16, float32; (N, C, H, W), (N, H, W), (N, F); labels and targets",
                        test_element_types_and_shapes) ||
           !CU_add_test(s, "per-channel normalize (given, measured); limit and split carry targets",
                        test_transforms_per_channel_and_targets) ||
           !CU_add_test(s, "bad files: one error per kind, naming the file and dataset", test_bad_files) ||
           !CU_add_test(s, "a NaN read per batch is named with its example and row", test_nan_found_per_batch) ||
           !CU_add_test(s, "runs on the mini set as IDX, HDF5 (once, per batch) and idx files: the same parameters",
                        test_runs_hdf5_idx_equal_fashion_mnist) ||
           !CU_add_test(s, "a 3-channel 16x20 set of 7 classes, uint8 and float32, augmented: resumes bit for bit",
                        test_runs_3channel_resume) ||
           !CU_add_test(s, "feature vectors with float targets train on mse; augmentation of them is refused",
                        test_runs_vectors) ||
           !CU_add_test(s, "a run over a 2 GB file, read per batch, peaks under 300 MB", test_run_over_a_2gb_file)
               ? -1
               : 0;
}
