/* dataset_hdf5.c - data sets from one HDF5 file (data.dataset: hdf5).
 *
 * Layout (docs/DATA.md): /train/x (N, C, H, W), (N, H, W) read as one
 * channel, or (N, F), of uint8, int8, float16 or float32; /train/y (N,) of
 * integers (class labels) or (N,) / (N, K) of floats (targets); the same
 * under /test, and optionally /val. Root attributes: `classes` (names; their
 * count is the number of classes), `mean` and `std` (what a normalize
 * without values uses, one value or one per channel).
 *
 * The file is untrusted input: every dataset passes h5io's checks (no
 * external storage or links, no unwritten or oversized chunks). The labels
 * and targets are read into memory; the examples too when they take at most
 * max_memory bytes (or data.storage: memory), else they stay in the file
 * and each batch reads its runs of rows by hyperslab, so a file larger than
 * memory trains in bounded memory. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "dataset.h"
#include "image_file.h"
#include "base/h5io.h"

#define SPLIT_PATH_MAX 32

/* What one split holds, from its datasets' headers. */
typedef struct {
    const char *name;          /* "train", "val", "test" */
    bool present;
    int n;                     /* examples */
    int ndim, shape[3], feat;  /* per example */
    DataElem elem;
    bool value_targets;        /* y holds floats */
    int n_targets;             /* values per target (value_targets) */
} SplitInfo;

static QtStatus elem_of(const H5ioFile *f, const char *path, const H5ioInfo *in, DataElem *e, QtError *err) {
    char dt[64];
    if (in->cls == H5T_INTEGER && in->size == 1) *e = in->is_signed ? DATA_ELEM_I8 : DATA_ELEM_U8;
    else if (in->cls == H5T_FLOAT && in->size == 2) *e = DATA_ELEM_F16;
    else if (in->cls == H5T_FLOAT && in->size == 4) *e = DATA_ELEM_F32;
    else
        return qt_error_set(err, QT_ERR_FORMAT,
                            "%s: /%s is %s; examples must be uint8, int8, float16 or float32 (convert it, e.g. "
                            "x.astype('float32') or x.astype('uint8') with scripts/make_dataset.py)",
                            f->path, path, h5io_dtype_str(in, dt, sizeof dt));
    return QT_OK;
}

/* The header of /<split>/x and /<split>/y. */
static QtStatus split_info(const H5ioFile *f, SplitInfo *s, QtError *err) {
    char px[SPLIT_PATH_MAX], py[SPLIT_PATH_MAX], sh[96], dt[64];
    snprintf(px, sizeof px, "%s/x", s->name);
    snprintf(py, sizeof py, "%s/y", s->name);
    s->present = h5io_kind(f, s->name) == H5IO_GROUP;
    if (!s->present) return QT_OK;
    H5ioInfo x, y;
    QtStatus st = h5io_dataset_info(f, px, &x, err);
    if (st == QT_OK) st = h5io_dataset_info(f, py, &y, err);
    if (st != QT_OK) return st;
    if (x.rank < 2 || x.rank > 4)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "%s: /%s has shape %s; examples must be (N, C, H, W), (N, H, W) or (N, F)", f->path, px,
                            h5io_shape_str(&x, sh, sizeof sh));
    uint64_t feat = 1;
    for (int i = 1; i < x.rank; i++) feat *= x.dims[i];
    if (x.dims[0] < 1 || x.dims[0] > INT32_MAX || feat > INT32_MAX / 4 || (x.rank == 4 && x.dims[1] > 4096))
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has shape %s: %s", f->path, px,
                            h5io_shape_str(&x, sh, sizeof sh),
                            x.dims[0] < 1 ? "the split is empty; write at least one example or leave the split out"
                                          : "too large (at most 2^31 examples of 2^29 values, 4096 channels)");
    if ((st = elem_of(f, px, &x, &s->elem, err)) != QT_OK) return st;
    s->n = (int)x.dims[0];
    s->feat = (int)feat;
    if (x.rank == 2) s->ndim = 1, s->shape[0] = (int)x.dims[1], s->shape[1] = s->shape[2] = 1;
    else if (x.rank == 3) s->ndim = 3, s->shape[0] = 1, s->shape[1] = (int)x.dims[1], s->shape[2] = (int)x.dims[2];
    else s->ndim = 3, s->shape[0] = (int)x.dims[1], s->shape[1] = (int)x.dims[2], s->shape[2] = (int)x.dims[3];
    const bool ints = y.cls == H5T_INTEGER, floats = y.cls == H5T_FLOAT;
    if (!(ints && y.rank == 1) && !(floats && (y.rank == 1 || y.rank == 2)))
        return qt_error_set(err, QT_ERR_FORMAT,
                            "%s: /%s is %s of shape %s; it must be integer class labels (N,) or float targets (N,) "
                            "or (N, K)",
                            f->path, py, h5io_dtype_str(&y, dt, sizeof dt), h5io_shape_str(&y, sh, sizeof sh));
    if (y.dims[0] != x.dims[0])
        return qt_error_set(err, QT_ERR_FORMAT,
                            "%s: /%s holds %llu examples but /%s holds %llu; x and y of a split must have one row "
                            "per example",
                            f->path, px, (unsigned long long)x.dims[0], py, (unsigned long long)y.dims[0]);
    s->value_targets = floats;
    s->n_targets = floats ? (y.rank == 2 ? (int)y.dims[1] : 1) : 0;
    if (floats && (y.rank == 2 && (y.dims[1] < 1 || y.dims[1] > 65536)))
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has shape %s: 1 to 65536 targets per example", f->path, py,
                            h5io_shape_str(&y, sh, sizeof sh));
    return QT_OK;
}

/* Every split must hold the same kind of examples and targets as the training split. */
static QtStatus splits_agree(const char *path, const SplitInfo *tr, const SplitInfo *s, QtError *err) {
    if (!s->present) return QT_OK;
    if (s->ndim != tr->ndim || memcmp(s->shape, tr->shape, sizeof s->shape) != 0)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "%s: /%s/x holds examples of %d x %d x %d values but /train/x of %d x %d x %d; every "
                            "split must hold the same shape",
                            path, s->name, s->shape[0], s->shape[1], s->shape[2], tr->shape[0], tr->shape[1],
                            tr->shape[2]);
    if (s->elem != tr->elem)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s/x is %s but /train/x is %s; store every split alike", path,
                            s->name, data_elem_name(s->elem), data_elem_name(tr->elem));
    if (s->value_targets != tr->value_targets || s->n_targets != tr->n_targets)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "%s: /%s/y holds %s but /train/y holds %s; every split must have the same targets", path,
                            s->name, s->value_targets ? "float targets" : "class labels",
                            tr->value_targets ? "float targets" : "class labels");
    return QT_OK;
}

/* The memory type of elem: the file's own class and size, little-endian IEEE half for float16 (HDF5 1.10 has no
 * native half type); *owned when the caller must close it. */
static hid_t elem_memtype(DataElem e, bool *owned) {
    *owned = false;
    switch (e) {
    case DATA_ELEM_U8: return H5T_NATIVE_UINT8;
    case DATA_ELEM_I8: return H5T_NATIVE_INT8;
    case DATA_ELEM_F32: return H5T_NATIVE_FLOAT;
    case DATA_ELEM_F16: {
        hid_t t = H5Tcopy(H5T_IEEE_F32LE);
        if (t < 0) return t;
        if (H5Tset_fields(t, 15, 10, 5, 0, 10) < 0 || H5Tset_precision(t, 16) < 0 || H5Tset_size(t, 2) < 0 ||
            H5Tset_ebias(t, 15) < 0) {
            H5Tclose(t);
            return H5I_INVALID_HID;
        }
        *owned = true;
        return t;
    }
    default: return H5I_INVALID_HID;
    }
}

/* Reads the labels of a split, checks each is >= 0 and below 256; *max_label gets the largest. */
static QtStatus read_labels(const H5ioFile *f, const SplitInfo *s, Dataset *d, int *max_label, QtError *err) {
    char py[SPLIT_PATH_MAX];
    snprintf(py, sizeof py, "%s/y", s->name);
    int64_t *raw = malloc((size_t)s->n * sizeof *raw);
    d->labels = malloc((size_t)s->n * sizeof *d->labels);
    if (!raw || !d->labels) {
        free(raw);
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %d labels of '%s'", s->n, f->path);
    }
    H5ioDataset ds;
    QtStatus st = h5io_dataset_open(f, py, &ds, err);
    if (st == QT_OK) st = h5io_dataset_read_rows(&ds, H5T_NATIVE_INT64, 0, (uint64_t)s->n, raw, err);
    h5io_dataset_close(&ds);
    for (int i = 0; st == QT_OK && i < s->n; i++) {
        if (raw[i] < 0 || raw[i] >= DATASET_MAX_CLASSES)
            st = qt_error_set(err, QT_ERR_VALUE,
                              "%s: /%s: label %" PRId64 " of example %d is out of range; class labels must be 0..%d",
                              f->path, py, raw[i], i, DATASET_MAX_CLASSES - 1);
        else if ((int)raw[i] > *max_label)
            *max_label = (int)raw[i];
        d->labels[i] = (int32_t)raw[i];
    }
    free(raw);
    return st;
}

static QtStatus read_targets(const H5ioFile *f, const SplitInfo *s, Dataset *d, QtError *err) {
    char py[SPLIT_PATH_MAX];
    snprintf(py, sizeof py, "%s/y", s->name);
    const size_t n = (size_t)s->n * (size_t)s->n_targets;
    if (!(d->targets = malloc(n * sizeof *d->targets)))
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %zu targets of '%s'", n, f->path);
    d->n_targets = s->n_targets;
    H5ioDataset ds;
    QtStatus st = h5io_dataset_open(f, py, &ds, err);
    if (st == QT_OK) st = h5io_dataset_read_rows(&ds, H5T_NATIVE_FLOAT, 0, (uint64_t)s->n, d->targets, err);
    h5io_dataset_close(&ds);
    for (size_t i = 0; st == QT_OK && i < n; i++)
        if (!isfinite(d->targets[i]))
            st = qt_error_set(err, QT_ERR_VALUE,
                              "%s: /%s: target %zu of example %zu is %g; targets must be finite numbers (fix or drop "
                              "that example)",
                              f->path, py, i % (size_t)s->n_targets, i / (size_t)s->n_targets,
                              (double)d->targets[i]);
    return st;
}

/* The examples of a split into memory, or a reader of them (in_file). */
static QtStatus read_examples(const H5ioFile *f, const SplitInfo *s, Dataset *d, bool in_file, QtError *err) {
    char px[SPLIT_PATH_MAX];
    snprintf(px, sizeof px, "%s/x", s->name);
    const size_t row = (size_t)s->feat * data_elem_bytes(s->elem);
    bool owned;
    hid_t mt = elem_memtype(s->elem, &owned);
    if (mt < 0) return qt_error_set(err, QT_ERR_NOMEM, "cannot make the HDF5 type of %s", data_elem_name(s->elem));
    if (in_file) return image_file_open_hdf5(&d->file, f->path, px, s->n, row, mt, owned, err);
    QtStatus st = QT_OK;
    if (!(d->pixels = malloc((size_t)s->n * row)))
        st = qt_error_set(err, QT_ERR_NOMEM,
                          "cannot allocate %zu MB for the %d examples of /%s in '%s'; set data.storage: file to read "
                          "them at every batch",
                          (size_t)s->n * row >> 20, s->n, px, f->path);
    H5ioDataset ds = {.id = H5I_INVALID_HID};
    if (st == QT_OK) st = h5io_dataset_open(f, px, &ds, err);
    if (st == QT_OK) st = h5io_dataset_read_rows(&ds, mt, 0, (uint64_t)s->n, d->pixels, err);
    h5io_dataset_close(&ds);
    if (owned) H5Tclose(mt);
    const size_t total = (size_t)s->n * (size_t)s->feat, bad = st == QT_OK ? convert_first_nonfinite(d->pixels, total,
                                                                                                     s->elem)
                                                                           : total;
    if (st == QT_OK && bad < total)
        st = qt_error_set(err, QT_ERR_VALUE,
                          "%s: /%s: value %zu of example %zu is %g; examples must be finite (fix or drop that "
                          "example)",
                          f->path, px, bad % (size_t)s->feat, bad / (size_t)s->feat,
                          (double)convert_value(d->pixels, bad, s->elem));
    return st;
}

/* The data set of one split, its examples in memory or (in_file) read per batch. */
static QtStatus load_split(const H5ioFile *f, const SplitInfo *s, Dataset *d, bool in_file, int *max_label,
                           QtError *err) {
    memset(d, 0, sizeof *d);
    if (!s->present) return QT_OK;
    d->ndim = s->ndim;
    memcpy(d->shape, s->shape, sizeof d->shape);
    d->feat = s->feat;
    d->elem = s->elem;
    d->pixel_scale = s->elem == DATA_ELEM_U8 ? 1.0f / 255.0f : 1.0f;
    d->pixel_shift = 0.0f;
    QtStatus st = s->value_targets ? read_targets(f, s, d, err) : read_labels(f, s, d, max_label, err);
    if (st == QT_OK) st = read_examples(f, s, d, in_file, err);
    if (st != QT_OK) {
        dataset_free(d);
        return st;
    }
    d->n = s->n;
    return QT_OK;
}

/* The number of classes: the `classes` attribute's length, else 1 + the largest label. */
static QtStatus class_count(const H5ioFile *f, int max_label, int *n_classes, QtError *err) {
    *n_classes = max_label + 1;
    if (!h5io_attr_exists(f, "", "classes")) return QT_OK;
    int64_t n = 0;
    QtStatus st = h5io_attr_numel(f, "", "classes", &n, err);
    if (st != QT_OK) return st;
    if (n < 1 || n > DATASET_MAX_CLASSES)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: the root attribute 'classes' names %lld classes; 1 to %d",
                            f->path, (long long)n, DATASET_MAX_CLASSES);
    if (n <= max_label)
        return qt_error_set(err, QT_ERR_VALUE,
                            "%s: a label is %d, but the root attribute 'classes' names %lld classes (labels 0..%lld); "
                            "fix the labels or the list",
                            f->path, max_label, (long long)n, (long long)n - 1);
    *n_classes = (int)n;
    return QT_OK;
}

/* The root attributes mean and std, when both are there, into the training set's stats. */
static QtStatus file_stats(const H5ioFile *f, Dataset *train, QtError *err) {
    const bool m = h5io_attr_exists(f, "", "mean"), s = h5io_attr_exists(f, "", "std");
    if (!m && !s) return QT_OK;
    if (m != s)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: the root attribute '%s' is there without '%s'; give both or "
                            "neither", f->path, m ? "mean" : "std", m ? "std" : "mean");
    int nm = 0, ns = 0;
    QtStatus st = h5io_attr_read_f64s(f, "", "mean", train->stats_mean, DATASET_MAX_CHANNELS, &nm, err);
    if (st == QT_OK) st = h5io_attr_read_f64s(f, "", "std", train->stats_std, DATASET_MAX_CHANNELS, &ns, err);
    if (st != QT_OK) return st;
    if (nm != ns || (nm != 1 && nm != train->shape[0]))
        return qt_error_set(err, QT_ERR_FORMAT,
                            "%s: the root attributes mean and std hold %d and %d values; give one each, or one per "
                            "channel (%d)",
                            f->path, nm, ns, train->shape[0]);
    for (int c = 0; c < nm; c++)
        if (!isfinite(train->stats_mean[c]) || !(train->stats_std[c] > 0.0) || isinf(train->stats_std[c]))
            return qt_error_set(err, QT_ERR_FORMAT, "%s: the root attributes give channel %d mean %g, std %g; the "
                                "mean must be finite and the std finite and > 0", f->path, c, train->stats_mean[c],
                                train->stats_std[c]);
    train->n_stats = nm;
    return QT_OK;
}

QtStatus dataset_load_hdf5(Dataset *train, Dataset *val, Dataset *test, const char *path, DataStorage storage,
                           size_t max_memory_bytes, QtError *err) {
    memset(train, 0, sizeof *train), memset(val, 0, sizeof *val), memset(test, 0, sizeof *test);
    if (!path || !*path)
        return qt_error_set(err, QT_ERR_CONFIG, "data.dataset: hdf5 needs data.path, the HDF5 file to read");
    H5ioFile f = H5IO_FILE_INIT;
    QtStatus st = h5io_open(&f, path, err);
    if (st != QT_OK) return st;
    SplitInfo sp[3] = {{.name = "train"}, {.name = "val"}, {.name = "test"}};
    for (int i = 0; i < 3 && st == QT_OK; i++) st = split_info(&f, &sp[i], err);
    if (st == QT_OK && (!sp[0].present || !sp[2].present))
        st = qt_error_set(err, QT_ERR_FORMAT,
                          "%s: no group /%s; a data file needs /train and /test, each with x and y (and may have "
                          "/val): see docs/DATA.md",
                          path, sp[0].present ? "test" : "train");
    for (int i = 1; i < 3 && st == QT_OK; i++) st = splits_agree(path, &sp[0], &sp[i], err);
    /* the examples stay in the file when all of them would take more than the budget */
    uint64_t bytes = 0;
    for (int i = 0; i < 3; i++) bytes += (uint64_t)sp[i].n * (uint64_t)sp[i].feat * data_elem_bytes(sp[i].elem);
    const bool in_file = storage == DATA_STORAGE_FILE || (storage == DATA_STORAGE_AUTO && bytes > max_memory_bytes);
    int max_label = -1, n_classes = 0;
    Dataset *sets[3] = {train, val, test};
    for (int i = 0; i < 3 && st == QT_OK; i++) st = load_split(&f, &sp[i], sets[i], in_file, &max_label, err);
    if (st == QT_OK && !sp[0].value_targets) st = class_count(&f, max_label, &n_classes, err);
    if (st == QT_OK) st = file_stats(&f, train, err);
    QtError close_err = {0};
    h5io_close(&f, &close_err);
    if (st != QT_OK) {
        for (int i = 0; i < 3; i++) dataset_free(sets[i]);
        return st;
    }
    for (int i = 0; i < 3; i++)
        if (sets[i]->labels) sets[i]->n_classes = n_classes;
    return QT_OK;
}
