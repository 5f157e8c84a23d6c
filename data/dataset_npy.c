/* dataset_npy.c - data sets from four NumPy .npy files (data.dataset: npy,
 * data.files: train_x, train_y, test_x, test_y).
 *
 * x: (N, C, H, W), (N, H, W) read as one channel, or (N, F), of uint8,
 * int8, float16 or float32, in C order (data/npy.c's reader: little-endian,
 * the file exactly as long as its header says). y: (N,) integers (class
 * labels 0..255; the classes are 1 + the largest of either split) or (N,) /
 * (N, K) floats (targets; float64 is rounded to float32). The examples are
 * read once when both splits take at most max_memory bytes (or
 * data.storage: memory), else each batch reads its rows with pread. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "dataset.h"
#include "image_file.h"
#include "npy.h"

static QtStatus elem_of(const char *path, NpyDtype t, DataElem *e, QtError *err) {
    switch (t) {
    case NPY_U8: *e = DATA_ELEM_U8; return QT_OK;
    case NPY_I8: *e = DATA_ELEM_I8; return QT_OK;
    case NPY_F16: *e = DATA_ELEM_F16; return QT_OK;
    case NPY_F32: *e = DATA_ELEM_F32; return QT_OK;
    default:
        return qt_error_set(err, QT_ERR_FORMAT,
                            "'%s' holds %s; examples must be uint8, int8, float16 or float32 (convert it: "
                            "np.save(path, x.astype('float32')) or .astype('uint8'))",
                            path, npy_dtype_name(t));
    }
}

/* The shape of x's examples into d. */
static QtStatus example_shape(const char *path, const NpyInfo *in, Dataset *d, QtError *err) {
    if (in->ndim < 2 || in->ndim > 4)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "'%s' has %d dimensions; examples must be (N, C, H, W), (N, H, W) or (N, F)", path,
                            in->ndim);
    uint64_t feat = 1;
    for (int i = 1; i < in->ndim; i++) feat *= (uint64_t)in->shape[i];
    if (in->shape[0] < 1)
        return qt_error_set(err, QT_ERR_FORMAT, "'%s' holds no examples (its first dimension is 0); the split must "
                            "not be empty", path);
    if (in->shape[0] > INT32_MAX || feat < 1 || feat > INT32_MAX / 4 || (in->ndim == 4 && in->shape[1] > 4096))
        return qt_error_set(err, QT_ERR_FORMAT, "'%s': %" PRId64 " examples of %" PRIu64 " values is too large or "
                            "empty (at most 2^31 examples of 2^29 values, 4096 channels)", path, in->shape[0], feat);
    d->n = (int)in->shape[0];
    d->feat = (int)feat;
    if (in->ndim == 2) d->ndim = 1, d->shape[0] = (int)in->shape[1], d->shape[1] = d->shape[2] = 1;
    else if (in->ndim == 3)
        d->ndim = 3, d->shape[0] = 1, d->shape[1] = (int)in->shape[1], d->shape[2] = (int)in->shape[2];
    else d->ndim = 3, d->shape[0] = (int)in->shape[1], d->shape[1] = (int)in->shape[2], d->shape[2] = (int)in->shape[3];
    return QT_OK;
}

/* Element i of raw (dtype t) as an int64 (integers and bool). */
static int64_t int_at(const uint8_t *raw, size_t i, NpyDtype t) {
    const uint8_t *p = raw + i * (size_t)npy_dtype_bytes(t);
    switch (t) {
    case NPY_U8:
    case NPY_BOOL: return p[0];
    case NPY_I8: return (int8_t)p[0];
    case NPY_U16: { uint16_t v; memcpy(&v, p, 2); return v; }
    case NPY_I16: { int16_t v; memcpy(&v, p, 2); return v; }
    case NPY_U32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case NPY_I32: { int32_t v; memcpy(&v, p, 4); return v; }
    case NPY_I64: { int64_t v; memcpy(&v, p, 8); return v; }
    case NPY_U64: { uint64_t v; memcpy(&v, p, 8); return v > INT64_MAX ? INT64_MAX : (int64_t)v; }
    default: return -1;
    }
}

/* Element i of raw (a float dtype) as a float. */
static float float_at(const uint8_t *raw, size_t i, NpyDtype t) {
    if (t == NPY_F16) return convert_value(raw, i, DATA_ELEM_F16);
    if (t == NPY_F32) return convert_value(raw, i, DATA_ELEM_F32);
    double v;
    memcpy(&v, raw + 8 * i, 8);
    return (float)v;
}

/* The labels or targets of y_path for the n examples of d; *max_label gets the largest label. */
static QtStatus load_y(const char *path, const char *x_path, Dataset *d, int *max_label, QtError *err) {
    NpyFile f = {.fd = -1};
    QtStatus st = npy_file_open(&f, path, err);
    if (st != QT_OK) return st;
    const NpyInfo *in = &f.info;
    const NpyDtype t = in->dtype;
    const bool floats = t == NPY_F16 || t == NPY_F32 || t == NPY_F64;
    uint8_t *raw = NULL;
    if (!(in->ndim == 1 || (floats && in->ndim == 2)))
        st = qt_error_set(err, QT_ERR_FORMAT, "'%s' has %d dimensions of %s; labels are (N,) integers, targets (N,) "
                          "or (N, K) floats", path, in->ndim, npy_dtype_name(t));
    else if (in->shape[0] != d->n)
        st = qt_error_set(err, QT_ERR_FORMAT, "'%s' holds %" PRId64 " rows but '%s' holds %d examples; x and y must "
                          "have one row per example", path, in->shape[0], x_path, d->n);
    else if (floats && in->ndim == 2 && (in->shape[1] < 1 || in->shape[1] > 65536))
        st = qt_error_set(err, QT_ERR_FORMAT, "'%s': %" PRId64 " targets per example; 1 to 65536", path, in->shape[1]);
    else if (!(raw = malloc(in->n_bytes ? in->n_bytes : 1)))
        st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %" PRIu64 " bytes for '%s'", in->n_bytes, path);
    else
        st = npy_file_read_rows(&f, 0, (uint64_t)d->n, raw, in->n_bytes, err);
    const size_t n = (size_t)in->n_elems;
    if (st == QT_OK && floats) {
        d->n_targets = in->ndim == 2 ? (int)in->shape[1] : 1;
        if (!(d->targets = malloc(n * sizeof *d->targets)))
            st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the targets of '%s'", path);
        for (size_t i = 0; st == QT_OK && i < n; i++) {
            d->targets[i] = float_at(raw, i, t);
            if (!isfinite(d->targets[i]))
                st = qt_error_set(err, QT_ERR_VALUE, "'%s': target %zu of example %zu is %g; targets must be finite "
                                  "numbers that fit float32 (fix or drop that example)", path,
                                  i % (size_t)d->n_targets, i / (size_t)d->n_targets, (double)d->targets[i]);
        }
    } else if (st == QT_OK) {
        if (!(d->labels = malloc(n * sizeof *d->labels)))
            st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the labels of '%s'", path);
        for (size_t i = 0; st == QT_OK && i < n; i++) {
            const int64_t v = int_at(raw, i, t);
            if (v < 0 || v >= DATASET_MAX_CLASSES)
                st = qt_error_set(err, QT_ERR_VALUE, "'%s': label %" PRId64 " of example %zu is out of range; class "
                                  "labels must be 0..%d", path, v, i, DATASET_MAX_CLASSES - 1);
            else if (v > *max_label)
                *max_label = (int)v;
            d->labels[i] = (int32_t)v;
        }
    }
    free(raw);
    npy_file_close(&f);
    return st;
}

/* The examples of x_path into d: in memory, or (in_file) a reader of its rows. */
static QtStatus load_x(const char *path, const NpyFile *f, Dataset *d, bool in_file, QtError *err) {
    const size_t row = (size_t)f->row_bytes, total = (size_t)d->n * row;
    if (in_file) return image_file_open_rows(&d->file, path, f->info.data_offset, d->n, row, err);
    if (!(d->pixels = malloc(total)))
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %zu MB for the examples of '%s'; set data.storage: "
                            "file to read them at every batch", total >> 20, path);
    QtStatus st = npy_file_read_rows(f, 0, (uint64_t)d->n, d->pixels, total, err);
    const size_t values = (size_t)d->n * (size_t)d->feat;
    const size_t bad = st == QT_OK ? convert_first_nonfinite(d->pixels, values, d->elem) : values;
    if (bad < values)
        st = qt_error_set(err, QT_ERR_VALUE, "'%s': value %zu of example %zu is %g; examples must be finite (fix or "
                          "drop that example)", path, bad % (size_t)d->feat, bad / (size_t)d->feat,
                          (double)convert_value(d->pixels, bad, d->elem));
    return st;
}

/* The header of one split's x file, into d's shape and element type. */
static QtStatus split_header(const char *x_path, NpyFile *f, Dataset *d, QtError *err) {
    memset(d, 0, sizeof *d);
    QtStatus st = npy_file_open(f, x_path, err);
    if (st != QT_OK) return st;
    if ((st = elem_of(x_path, f->info.dtype, &d->elem, err)) == QT_OK) st = example_shape(x_path, &f->info, d, err);
    if (st != QT_OK) npy_file_close(f);
    return st;
}

QtStatus dataset_load_npy(Dataset *train, Dataset *test, const char *train_x, const char *train_y,
                          const char *test_x, const char *test_y, DataStorage storage, size_t max_memory_bytes,
                          QtError *err) {
    memset(train, 0, sizeof *train), memset(test, 0, sizeof *test);
    NpyFile fx[2] = {{.fd = -1}, {.fd = -1}};
    Dataset *sets[2] = {train, test};
    const char *xs[2] = {train_x, test_x}, *ys[2] = {train_y, test_y};
    QtStatus st = split_header(train_x, &fx[0], train, err);
    if (st == QT_OK && (st = split_header(test_x, &fx[1], test, err)) != QT_OK) npy_file_close(&fx[0]);
    if (st != QT_OK) return st;
    if (test->ndim != train->ndim || memcmp(test->shape, train->shape, sizeof test->shape) != 0 ||
        test->elem != train->elem)
        st = qt_error_set(err, QT_ERR_FORMAT, "'%s' holds %s examples of %d x %d x %d values but '%s' %s of %d x %d x "
                          "%d; both splits must hold the same shape and type", test_x, data_elem_name(test->elem),
                          test->shape[0], test->shape[1], test->shape[2], train_x, data_elem_name(train->elem),
                          train->shape[0], train->shape[1], train->shape[2]);
    const uint64_t bytes = (uint64_t)fx[0].info.n_bytes + fx[1].info.n_bytes;
    const bool in_file = storage == DATA_STORAGE_FILE || (storage == DATA_STORAGE_AUTO && bytes > max_memory_bytes);
    int max_label = -1;
    for (int s = 0; s < 2 && st == QT_OK; s++) {
        sets[s]->pixel_scale = sets[s]->elem == DATA_ELEM_U8 ? 1.0f / 255.0f : 1.0f;
        st = load_y(ys[s], xs[s], sets[s], &max_label, err);
        if (st == QT_OK) st = load_x(xs[s], &fx[s], sets[s], in_file, err);
    }
    if (st == QT_OK && (train->labels == NULL) != (test->labels == NULL))
        st = qt_error_set(err, QT_ERR_FORMAT, "'%s' holds %s but '%s' %s; both splits must have the same targets",
                          train_y, train->labels ? "class labels" : "float targets", test_y,
                          test->labels ? "class labels" : "float targets");
    if (st == QT_OK && train->targets && train->n_targets != test->n_targets)
        st = qt_error_set(err, QT_ERR_FORMAT, "'%s' holds %d targets per example but '%s' %d; both splits must have "
                          "the same targets", train_y, train->n_targets, test_y, test->n_targets);
    npy_file_close(&fx[0]), npy_file_close(&fx[1]);
    if (st != QT_OK) {
        dataset_free(train), dataset_free(test);
        return st;
    }
    if (train->labels) train->n_classes = test->n_classes = max_label + 1;
    return QT_OK;
}
