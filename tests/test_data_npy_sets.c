/* test_data_npy_sets.c - data sets from four .npy files (data.dataset: npy).
 *
 * The files are written here (a version 1.0 header and the bytes), so the
 * suite needs no NumPy: the mini Fashion-MNIST as .npy gives the IDX
 * reader's floats and trains to the same parameters, read once or per
 * batch; every example type with labels or float targets (float64 rounded
 * to float32) loads exactly; each bad pair of files is an error naming the
 * file and what is wrong. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/dataset.h"
#include "data/npy.h"
#include "test_proc.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/train.h"

static char *root;

static int suite_init(void) {
    root = test_tmpdir_new();
    return root ? 0 : -1;
}

static int suite_cleanup(void) {
    bool ok = test_tmpdir_remove(root);
    root = NULL;
    return ok ? 0 : -1;
}

static const char *tmp(const char *name) {
    static char buf[8][1024];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", root, name);
    return buf[k];
}

/* Writes a version 1.0 .npy file: descr (e.g. "<f4", "|u1"), shape[ndim], then the data bytes. */
static bool write_npy(const char *path, const char *descr, int ndim, const long *shape, const void *data,
                      size_t bytes) {
    char dict[256], sh[128] = "";
    size_t len = 0;
    for (int i = 0; i < ndim; i++) len += (size_t)snprintf(sh + len, sizeof sh - len, "%ld, ", shape[i]);
    if (ndim > 1) sh[len - 2] = '\0'; /* (2, 3) */
    else if (ndim == 1) sh[len - 1] = '\0'; /* (5,) */
    int n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", descr, sh);
    int total = 10 + n + 1, pad = (64 - total % 64) % 64;
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)((n + pad + 1) & 0xff),
                             (unsigned char)((n + pad + 1) >> 8)};
    bool ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)n, f) == (size_t)n;
    for (int i = 0; i < pad && ok; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF && (bytes == 0 || fwrite(data, 1, bytes, f) == bytes);
    return fclose(f) == 0 && ok;
}

/* The mini Fashion-MNIST as tx/ty/sx/sy.npy in the suite's directory. */
static bool write_mini(void) {
    Dataset tr, te;
    QtError e = {0};
    if (dataset_load_fashion_mnist(&tr, &te, "data/fashion-mnist-mini", &e) != QT_OK) return false;
    int64_t *ly = malloc((size_t)tr.n * 8);
    for (int i = 0; i < tr.n; i++) ly[i] = tr.labels[i];
    uint8_t *ls = malloc((size_t)te.n);
    for (int i = 0; i < te.n; i++) ls[i] = (uint8_t)te.labels[i];
    bool ok = write_npy(tmp("tx.npy"), "|u1", 3, (long[]){tr.n, 28, 28}, tr.pixels, (size_t)tr.n * 784) &&
              write_npy(tmp("ty.npy"), "<i8", 1, (long[]){tr.n}, ly, (size_t)tr.n * 8) &&
              write_npy(tmp("sx.npy"), "|u1", 4, (long[]){te.n, 1, 28, 28}, te.pixels, (size_t)te.n * 784) &&
              write_npy(tmp("sy.npy"), "|u1", 1, (long[]){te.n}, ls, (size_t)te.n);
    free(ly), free(ls);
    dataset_free(&tr), dataset_free(&te);
    return ok;
}

static QtStatus load4(Dataset *tr, Dataset *te, const char *const f[4], DataStorage storage, QtError *e) {
    return dataset_load_npy(tr, te, f[0], f[1], f[2], f[3], storage, 512u << 20, e);
}

static void test_mini_as_npy_equals_idx(void) {
    CU_ASSERT_FATAL(write_mini());
    Dataset tr, te, a, b;
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist(&tr, &te, "data/fashion-mnist-mini", &e), QT_OK);
    const char *f[4] = {tmp("tx.npy"), tmp("ty.npy"), tmp("sx.npy"), tmp("sy.npy")};
    for (int storage = 0; storage < 2; storage++) {
        QtStatus st = load4(&a, &b, f, storage ? DATA_STORAGE_FILE : DATA_STORAGE_MEMORY, &e);
        if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        CU_ASSERT((a.file != NULL) == (storage == 1));
        CU_ASSERT(a.n == tr.n && b.n == te.n && a.n_classes == 10 && a.elem == DATA_ELEM_U8);
        CU_ASSERT(a.ndim == 3 && a.shape[0] == 1 && a.shape[1] == 28 && a.shape[2] == 28);
        float *x1 = malloc((size_t)tr.n * 784 * 4), *x2 = malloc((size_t)tr.n * 784 * 4);
        int32_t *y1 = malloc((size_t)tr.n * 4), *y2 = malloc((size_t)tr.n * 4);
        CU_ASSERT_EQUAL(dataset_fill_range(&tr, 0, tr.n, x1, y1, &e), QT_OK);
        CU_ASSERT_EQUAL(dataset_fill_range(&a, 0, a.n, x2, y2, &e), QT_OK);
        CU_ASSERT(memcmp(x1, x2, (size_t)tr.n * 784 * 4) == 0 && memcmp(y1, y2, (size_t)tr.n * 4) == 0);
        CU_ASSERT_EQUAL(dataset_fill_range(&te, 0, te.n, x1, y1, &e), QT_OK);
        CU_ASSERT_EQUAL(dataset_fill_range(&b, 0, b.n, x2, y2, &e), QT_OK);
        CU_ASSERT(memcmp(x1, x2, (size_t)te.n * 784 * 4) == 0 && memcmp(y1, y2, (size_t)te.n * 4) == 0);
        free(x1), free(x2), free(y1), free(y2);
        dataset_free(&a), dataset_free(&b);
    }
    dataset_free(&tr), dataset_free(&te);
}

/* float32 (N, F) examples with float64 targets (N, 2); float16 and int8 examples with int32 and bool labels. */
static void test_types_and_targets(void) {
    float x[6 * 5];
    double t[6 * 2];
    for (int i = 0; i < 30; i++) x[i] = (float)i / 8.0f - 1.0f;
    for (int i = 0; i < 12; i++) t[i] = 0.1 * i + 1e-12;
    const char *f[4] = {tmp("fx.npy"), tmp("ft.npy"), tmp("fx.npy"), tmp("ft.npy")};
    CU_ASSERT_FATAL(write_npy(f[0], "<f4", 2, (long[]){6, 5}, x, sizeof x));
    CU_ASSERT_FATAL(write_npy(f[1], "<f8", 2, (long[]){6, 2}, t, sizeof t));
    Dataset a, b;
    QtError e = {0};
    QtStatus st = load4(&a, &b, f, DATA_STORAGE_MEMORY, &e);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT(a.ndim == 1 && a.shape[0] == 5 && a.elem == DATA_ELEM_F32 && !a.labels && a.n_targets == 2);
    CU_ASSERT_EQUAL(a.n_classes, 0);
    float got[30], tg[12];
    CU_ASSERT_EQUAL(dataset_fill_range(&a, 0, 6, got, NULL, &e), QT_OK);
    CU_ASSERT(memcmp(got, x, sizeof x) == 0);
    CU_ASSERT(dataset_fill_targets_range(&a, 0, 6, tg));
    for (int i = 0; i < 12; i++) CU_ASSERT_EQUAL(tg[i], (float)t[i]);
    dataset_free(&a), dataset_free(&b);

    uint16_t h[4 * 3] = {0x3c00, 0xc000, 0x3800, 0x0001, 0x7bff, 0x8000, 0, 0x3555, 0x4248, 0x2e66, 0xbc00, 0x4000};
    int32_t lab[4] = {0, 3, 1, 2};
    uint8_t yes[4] = {1, 0, 1, 1};
    int8_t s8[4 * 3] = {-128, -1, 0, 1, 127, 5, -5, 9, 10, 11, -12, 13};
    const char *g[4] = {tmp("hx.npy"), tmp("hy.npy"), tmp("bx.npy"), tmp("by.npy")};
    CU_ASSERT_FATAL(write_npy(g[0], "<f2", 2, (long[]){4, 3}, h, sizeof h));
    CU_ASSERT_FATAL(write_npy(g[1], "<i4", 1, (long[]){4}, lab, sizeof lab));
    CU_ASSERT_FATAL(write_npy(g[2], "|i1", 2, (long[]){4, 3}, s8, sizeof s8));
    CU_ASSERT_FATAL(write_npy(g[3], "|b1", 1, (long[]){4}, yes, sizeof yes));
    /* float16 train, int8 test: refused (one type for both splits) */
    CU_ASSERT_EQUAL(load4(&a, &b, g, DATA_STORAGE_MEMORY, &e), QT_ERR_FORMAT);
    CU_ASSERT(strstr(e.msg, "same shape and type") != NULL);
    const char *hh[4] = {g[0], g[1], g[0], g[3]}, *ss[4] = {g[2], g[3], g[2], g[3]};
    e = (QtError){0};
    CU_ASSERT_EQUAL_FATAL(load4(&a, &b, hh, DATA_STORAGE_FILE, &e), QT_OK);
    CU_ASSERT(a.elem == DATA_ELEM_F16 && a.n_classes == 4 && b.labels[1] == 0);
    float hv[12];
    CU_ASSERT_EQUAL(dataset_fill_range(&a, 0, 4, hv, NULL, &e), QT_OK);
    for (int i = 0; i < 12; i++) CU_ASSERT_EQUAL(hv[i], data_half_to_float(h[i]));
    CU_ASSERT_EQUAL(hv[0], 1.0f);
    CU_ASSERT_EQUAL(hv[3], ldexpf(1.0f, -24));
    CU_ASSERT_EQUAL(hv[4], 65504.0f);
    dataset_free(&a), dataset_free(&b);
    CU_ASSERT_EQUAL_FATAL(load4(&a, &b, ss, DATA_STORAGE_MEMORY, &e), QT_OK);
    CU_ASSERT(a.elem == DATA_ELEM_I8 && a.n_classes == 2);
    CU_ASSERT_EQUAL(dataset_fill_range(&a, 0, 4, hv, NULL, &e), QT_OK);
    for (int i = 0; i < 12; i++) CU_ASSERT_EQUAL(hv[i], (float)s8[i]);
    dataset_free(&a), dataset_free(&b);
}

/* One error per kind, naming the file. */
static void test_bad_pairs(void) {
    uint8_t x[4 * 6] = {0};
    int64_t y3[3] = {0, 1, 2}, yneg[4] = {0, -1, 1, 2}, y2d[8] = {0};
    int16_t x16[4 * 6] = {0};
    float xnan[4 * 6] = {0}, tinf[4] = {0, 1, INFINITY, 0};
    xnan[9] = NAN;
    CU_ASSERT_FATAL(write_npy(tmp("x.npy"), "|u1", 2, (long[]){4, 6}, x, sizeof x));
    CU_ASSERT_FATAL(write_npy(tmp("x0.npy"), "|u1", 2, (long[]){0, 6}, NULL, 0));
    CU_ASSERT_FATAL(write_npy(tmp("xr.npy"), "|u1", 1, (long[]){24}, x, sizeof x));
    CU_ASSERT_FATAL(write_npy(tmp("x16.npy"), "<i2", 2, (long[]){4, 6}, x16, sizeof x16));
    CU_ASSERT_FATAL(write_npy(tmp("xnan.npy"), "<f4", 2, (long[]){4, 6}, xnan, sizeof xnan));
    CU_ASSERT_FATAL(write_npy(tmp("x7.npy"), "|u1", 2, (long[]){4, 3}, x, 12));
    CU_ASSERT_FATAL(write_npy(tmp("y3.npy"), "<i8", 1, (long[]){3}, y3, sizeof y3));
    CU_ASSERT_FATAL(write_npy(tmp("yneg.npy"), "<i8", 1, (long[]){4}, yneg, sizeof yneg));
    CU_ASSERT_FATAL(write_npy(tmp("y2d.npy"), "<i8", 2, (long[]){4, 2}, y2d, sizeof y2d));
    CU_ASSERT_FATAL(write_npy(tmp("tinf.npy"), "<f4", 1, (long[]){4}, tinf, sizeof tinf));
    int64_t ok4[4] = {0, 1, 2, 1};
    float tf[4] = {0.5f, 1.5f, -2.0f, 0.0f};
    CU_ASSERT_FATAL(write_npy(tmp("tf.npy"), "<f4", 1, (long[]){4}, tf, sizeof tf));
    CU_ASSERT_FATAL(write_npy(tmp("y.npy"), "<i8", 1, (long[]){4}, ok4, sizeof ok4));
    struct {
        const char *f[4];
        QtStatus status;
        const char *want;
    } cases[] = {
        {{"x.npy", "y3.npy", "x.npy", "y.npy"}, QT_ERR_FORMAT, "y3.npy' holds 3 rows but"},
        {{"xr.npy", "y.npy", "x.npy", "y.npy"}, QT_ERR_FORMAT, "xr.npy' has 1 dimensions"},
        {{"x16.npy", "y.npy", "x.npy", "y.npy"}, QT_ERR_FORMAT, "x16.npy' holds int16"},
        {{"xnan.npy", "y.npy", "xnan.npy", "y.npy"}, QT_ERR_VALUE, "xnan.npy': value 3 of example 1 is nan"},
        {{"x.npy", "yneg.npy", "x.npy", "y.npy"}, QT_ERR_VALUE, "yneg.npy': label -1 of example 1"},
        {{"x.npy", "y2d.npy", "x.npy", "y.npy"}, QT_ERR_FORMAT, "y2d.npy' has 2 dimensions of int64"},
        {{"x.npy", "tinf.npy", "x.npy", "tinf.npy"}, QT_ERR_VALUE, "tinf.npy': target 0 of example 2 is inf"},
        {{"x.npy", "y.npy", "x.npy", "tf.npy"}, QT_ERR_FORMAT, "both splits must have the same targets"},
        {{"x.npy", "y.npy", "x7.npy", "y.npy"}, QT_ERR_FORMAT, "same shape and type"},
        {{"x0.npy", "y.npy", "x.npy", "y.npy"}, QT_ERR_FORMAT, "x0.npy' holds no examples"},
        {{"x.npy", "y.npy", "missing.npy", "y.npy"}, QT_ERR_IO, "missing.npy"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const char *f[4];
        for (int j = 0; j < 4; j++) f[j] = tmp(cases[k].f[j]);
        Dataset a, b;
        QtError e = {0};
        QtStatus st = load4(&a, &b, f, DATA_STORAGE_MEMORY, &e);
        bool ok = st == cases[k].status && strstr(e.msg, cases[k].want) != NULL;
        if (!ok) fprintf(stderr, "\n  case %zu: status %d: %s\n", k, (int)st, e.msg);
        CU_ASSERT(ok);
        CU_ASSERT(a.pixels == NULL && a.labels == NULL && a.targets == NULL && b.pixels == NULL);
    }
}

/* The mini set as .npy trains to the IDX run's parameters, in memory and per batch. */
static void test_runs_npy_equal_fashion_mnist(void) {
    CU_ASSERT_FATAL(write_mini());
    char files[4][1100], outs[3][1100];
    static const char *const keys[4] = {"train_x", "train_y", "test_x", "test_y"};
    static const char *const names[4] = {"tx.npy", "ty.npy", "sx.npy", "sy.npy"};
    for (int j = 0; j < 4; j++) snprintf(files[j], sizeof files[j], "data.files.%s=%s", keys[j], tmp(names[j]));
    double loss[3];
    char final[3][1200];
    for (int k = 0; k < 3; k++) {
        snprintf(outs[k], sizeof outs[k], "run.out_dir=%s/npy-run%d", root, k);
        const char *ov[8] = {outs[k], "train.steps=12"};
        int n = 2;
        if (k > 0) {
            ov[n++] = "data.dataset=npy";
            for (int j = 0; j < 4; j++) ov[n++] = files[j];
            if (k == 2) ov[n++] = "data.storage=file";
        } else {
            ov[n++] = "data.dir=data/fashion-mnist-mini";
        }
        Config *c = malloc(sizeof *c);
        QtError e = {0};
        CU_ASSERT_EQUAL_FATAL(config_load(c, "tests/configs/tiny-cnn.yaml", ov, n, &e), QT_OK);
        TrainOptions o = {.quiet = true};
        TrainResult r;
        QtStatus st = train_run(c, &o, &r, &e);
        if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        loss[k] = r.test_loss;
        snprintf(final[k], sizeof final[k], "%s/final.h5", c->run.out_dir);
        free(c);
    }
    for (int k = 1; k < 3; k++) {
        CU_ASSERT_EQUAL(loss[k], loss[0]);
        CU_ASSERT(test_ckpt_group_within(final[0], final[k], "params"));
    }
}

/* qtrain eval --dump-logits: the test outputs as (N, 10) float32 .npy; their argmax gives eval's accuracy. */
static void test_eval_dump_logits(void) {
    char out[1100], ckpt[1200], npy[1200], log[1200];
    snprintf(out, sizeof out, "run.out_dir=%s/dump-run", root);
    snprintf(ckpt, sizeof ckpt, "%s/dump-run/final.h5", root);
    snprintf(npy, sizeof npy, "%s/logits.npy", root);
    snprintf(log, sizeof log, "%s/dump.log", root);
    const char *train[] = {"--config", "tests/configs/tiny-mlp.yaml", "--set", out, "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, train, 120), 0);
    const char *eval[] = {"eval", "--checkpoint", ckpt, "--dump-logits", npy, NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, eval, 120), 0);
    NpyFile f = {.fd = -1};
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(npy_file_open(&f, npy, &e), QT_OK);
    CU_ASSERT(f.info.dtype == NPY_F32 && f.info.ndim == 2 && f.info.shape[0] == 512 && f.info.shape[1] == 10);
    float *x = malloc((size_t)f.info.n_bytes);
    CU_ASSERT_EQUAL_FATAL(npy_file_read_rows(&f, 0, 512, x, f.info.n_bytes, &e), QT_OK);
    npy_file_close(&f);
    Dataset tr, te;
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist(&tr, &te, "data/fashion-mnist-mini", &e), QT_OK);
    int correct = 0;
    for (int i = 0; i < 512; i++) {
        int best = 0;
        for (int k = 1; k < 10; k++) best = x[i * 10 + k] > x[i * 10 + best] ? k : best;
        correct += best == te.labels[i];
    }
    char *text = test_file_read(log, NULL);
    char want[64];
    snprintf(want, sizeof want, "test_accuracy:%.4f", correct / 512.0);
    CU_ASSERT(text && strstr(text, want) != NULL);
    if (text && !strstr(text, want)) fprintf(stderr, "\n  want %s in:\n%s\n", want, text);
    free(text), free(x);
    dataset_free(&tr), dataset_free(&te);
}

int register_data_npy_sets_suite(void) {
    CU_pSuite s = CU_add_suite("data_npy_sets", suite_init, suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "the mini Fashion-MNIST as .npy (read once, per batch) gives the IDX floats and labels",
                        test_mini_as_npy_equals_idx) ||
           !CU_add_test(s, "float32 with float64 targets, float16, int8; int32 and bool labels",
                        test_types_and_targets) ||
           !CU_add_test(s, "bad pairs of files: one error per kind, naming the file", test_bad_pairs) ||
           !CU_add_test(s, "runs on the mini set as .npy (once, per batch) end at the IDX run's parameters",
                        test_runs_npy_equal_fashion_mnist) ||
           !CU_add_test(s, "eval --dump-logits writes the test outputs; their argmax is eval's accuracy",
                        test_eval_dump_logits)
               ? -1
               : 0;
}
