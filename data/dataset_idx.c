/* dataset_idx.c - data sets from IDX files: Fashion-MNIST's four in a
 * directory, or any IDX set's four files (data.dataset: idx); the images in
 * memory or read in place (image_file.c). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dataset.h"
#include "image_file.h"

#define FASHION_MNIST_CLASSES 10
#define DATASET_PATH_MAX 4096

/* ---- loading -------------------------------------------------------------- */

static char *dims_str(char *buf, size_t size, int ndim, const int *dims) {
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < ndim && len < size; i++)
        len += (size_t)snprintf(buf + len, size - len, "%s%d", i ? " x " : "", dims[i]);
    return buf;
}

/* The images of one file: read into img, or (file->fd >= 0) open in place. */
static QtStatus load_images(const char *path, IdxCache *cache, DataStorage storage, IdxArray *img, IdxFile *file,
                            QtError *err) {
    char dims[64];
    memset(file, 0, sizeof *file);
    file->fd = -1;
    QtStatus st = storage == DATA_STORAGE_MEMORY
                      ? idx_read_cached(path, cache, img, err)
                      : idx_open_cached(path, cache, storage == DATA_STORAGE_FILE, file, img, err);
    if (st != QT_OK) return st;
    int ndim = file->fd >= 0 ? file->ndim : img->ndim;
    if (ndim == 3) return QT_OK;
    st = qt_error_set(err, QT_ERR_FORMAT,
                      "images file '%s' holds a %d-D array (%s) but images must be 3-D (count x height x width); "
                      "is it a labels file?",
                      path, ndim, dims_str(dims, sizeof dims, ndim, file->fd >= 0 ? file->dims : img->dims));
    idx_free(img);
    idx_file_close(file);
    return st;
}

/* Reads both files and checks they fit together; on success the caller
 * owns img (or file) and lab. */
static QtStatus load_idx_pair(const char *images_path, const char *labels_path, IdxCache *cache, DataStorage storage,
                              IdxArray *img, IdxFile *file, IdxArray *lab, QtError *err) {
    char dims[64];
    memset(lab, 0, sizeof *lab);
    QtStatus st = load_images(images_path, cache, storage, img, file, err);
    if (st != QT_OK) return st;
    int n_images = file->fd >= 0 ? file->dims[0] : img->dims[0];
    if ((st = idx_read_cached(labels_path, cache, lab, err)) != QT_OK) goto fail;
    if (lab->ndim != 1) {
        st = qt_error_set(err, QT_ERR_FORMAT,
                          "labels file '%s' holds a %d-D array (%s) but labels must be 1-D (one per image); is it an "
                          "images file?",
                          labels_path, lab->ndim, dims_str(dims, sizeof dims, lab->ndim, lab->dims));
        goto fail;
    }
    if (lab->dims[0] != n_images) {
        st = qt_error_set(err, QT_ERR_FORMAT,
                          "images file '%s' holds %d images but labels file '%s' holds %d labels; the two files "
                          "must come from the same set",
                          images_path, n_images, labels_path, lab->dims[0]);
        goto fail;
    }
    return QT_OK;
fail:
    idx_free(img);
    idx_file_close(file);
    idx_free(lab);
    return st;
}

/* Labels as int32, after checking each is below n_classes. */
static QtStatus load_labels(const IdxArray *lab, const char *labels_path, int n_classes, int32_t **out,
                            QtError *err) {
    int n = lab->dims[0];
    for (int i = 0; i < n; i++)
        if (lab->data[i] >= n_classes)
            return qt_error_set(err, QT_ERR_VALUE,
                                "labels file '%s': label %d of example %d is out of range; this data set has %d "
                                "classes (labels 0..%d)",
                                labels_path, lab->data[i], i, n_classes, n_classes - 1);
    int32_t *labels = malloc((size_t)n * sizeof *labels);
    if (!labels) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %d labels for '%s'", n, labels_path);
    for (int i = 0; i < n; i++) labels[i] = lab->data[i];
    *out = labels;
    return QT_OK;
}

QtStatus dataset_load_idx_stored(Dataset *d, const char *images_path, const char *labels_path, int n_classes,
                                 IdxCache *cache, DataStorage storage, QtError *err) {
    memset(d, 0, sizeof *d);
    if (!images_path || !labels_path) return qt_error_set(err, QT_ERR_ARG, "dataset_load_idx: missing file name");
    if (n_classes < 1 || n_classes > DATASET_MAX_CLASSES)
        return qt_error_set(err, QT_ERR_ARG, "dataset_load_idx: n_classes = %d is outside 1..%d", n_classes,
                            DATASET_MAX_CLASSES);
    if ((unsigned)storage >= DATA_STORAGE_COUNT)
        return qt_error_set(err, QT_ERR_ARG, "dataset_load_idx: unknown storage %d", (int)storage);
    IdxArray img, lab;
    IdxFile file;
    QtStatus st = load_idx_pair(images_path, labels_path, cache, storage, &img, &file, &lab, err);
    if (st != QT_OK) return st;
    int32_t *labels = NULL;
    st = load_labels(&lab, labels_path, n_classes, &labels, err);
    idx_free(&lab);
    const int *dims = file.fd >= 0 ? file.dims : img.dims;
    d->n = dims[0];
    d->ndim = 3;
    d->shape[0] = 1, d->shape[1] = dims[1], d->shape[2] = dims[2];
    d->feat = dims[1] * dims[2];
    if (st == QT_OK && file.fd >= 0) st = image_file_open(&d->file, &file, err);
    idx_file_close(&file);
    if (st != QT_OK) {
        idx_free(&img);
        free(labels);
        memset(d, 0, sizeof *d);
        return st;
    }
    d->pixels = img.data; /* ownership moves to d (NULL for a file) */
    d->labels = labels;
    d->n_classes = n_classes;
    d->pixel_scale = 1.0f / 255.0f;
    d->pixel_shift = 0.0f;
    return QT_OK;
}

QtStatus dataset_load_idx(Dataset *d, const char *images_path, const char *labels_path, int n_classes, QtError *err) {
    return dataset_load_idx_stored(d, images_path, labels_path, n_classes, NULL, DATA_STORAGE_MEMORY, err);
}

QtStatus dataset_load_idx_pairs(Dataset *train, Dataset *test, const char *train_x, const char *train_y,
                                const char *test_x, const char *test_y, IdxCache *cache, DataStorage storage,
                                QtError *err) {
    memset(test, 0, sizeof *test);
    /* every byte is a valid label here; the classes are those the labels use */
    QtStatus st = dataset_load_idx_stored(train, train_x, train_y, DATASET_MAX_CLASSES, cache, storage, err);
    if (st != QT_OK) return st;
    if ((st = dataset_load_idx_stored(test, test_x, test_y, DATASET_MAX_CLASSES, cache, storage, err)) != QT_OK) {
        dataset_free(train);
        return st;
    }
    if (test->shape[1] != train->shape[1] || test->shape[2] != train->shape[2]) {
        st = qt_error_set(err, QT_ERR_FORMAT, "data.files: the test images ('%s') are %d x %d but the training images "
                          "('%s') %d x %d; both must come from one data set", test_x, test->shape[1], test->shape[2],
                          train_x, train->shape[1], train->shape[2]);
        dataset_free(train), dataset_free(test);
        return st;
    }
    int max = 0;
    for (int i = 0; i < train->n; i++) max = train->labels[i] > max ? train->labels[i] : max;
    for (int i = 0; i < test->n; i++) max = test->labels[i] > max ? test->labels[i] : max;
    train->n_classes = test->n_classes = max + 1;
    return QT_OK;
}

/* <dir>/<name>.gz if it exists, else <dir>/<name>; if neither does, an IO
 * error naming both and saying where the files come from. */
static QtStatus fashion_path(char *out, size_t size, const char *dir, const char *name, QtError *err) {
    struct stat sb;
    int len = snprintf(out, size, "%s/%s.gz", dir, name);
    if (len < 0 || (size_t)len >= size)
        return qt_error_set(err, QT_ERR_ARG, "data directory '%s' is too long a path (limit %zu bytes)", dir, size);
    if (stat(out, &sb) == 0) return QT_OK;
    int gz_errno = errno;
    snprintf(out, size, "%s/%s", dir, name);
    if (stat(out, &sb) == 0) return QT_OK;
    return qt_error_set(err, QT_ERR_IO,
                        "Fashion-MNIST file '%s/%s.gz' (or '%s') cannot be found: %s; install the Debian package "
                        "dataset-fashion-mnist or set data.dir to the directory holding the four IDX files",
                        dir, name, out, strerror(gz_errno));
}

static QtStatus load_fashion_set(Dataset *d, const char *dir, const char *prefix, IdxCache *cache,
                                 DataStorage storage, QtError *err) {
    char images[DATASET_PATH_MAX], labels[DATASET_PATH_MAX], name[64];
    snprintf(name, sizeof name, "%s-images-idx3-ubyte", prefix);
    QtStatus st = fashion_path(images, sizeof images, dir, name, err);
    if (st != QT_OK) return st;
    snprintf(name, sizeof name, "%s-labels-idx1-ubyte", prefix);
    if ((st = fashion_path(labels, sizeof labels, dir, name, err)) != QT_OK) return st;
    return dataset_load_idx_stored(d, images, labels, FASHION_MNIST_CLASSES, cache, storage, err);
}

QtStatus dataset_load_fashion_mnist(Dataset *train, Dataset *test, const char *dir, QtError *err) {
    return dataset_load_fashion_mnist_cached(train, test, dir, NULL, err);
}

QtStatus dataset_load_fashion_mnist_cached(Dataset *train, Dataset *test, const char *dir, IdxCache *cache,
                                           QtError *err) {
    return dataset_load_fashion_mnist_stored(train, test, dir, cache, DATA_STORAGE_MEMORY, err);
}

QtStatus dataset_load_fashion_mnist_stored(Dataset *train, Dataset *test, const char *dir, IdxCache *cache,
                                           DataStorage storage, QtError *err) {
    memset(train, 0, sizeof *train);
    if (test) memset(test, 0, sizeof *test);
    if (!dir || !*dir) return qt_error_set(err, QT_ERR_ARG, "Fashion-MNIST: no data directory given; set data.dir");
    QtStatus st = load_fashion_set(train, dir, "train", cache, storage, err);
    if (st != QT_OK || !test) return st;
    if ((st = load_fashion_set(test, dir, "t10k", cache, storage, err)) != QT_OK) {
        dataset_free(train);
        return st;
    }
    if (test->shape[1] != train->shape[1] || test->shape[2] != train->shape[2]) {
        st = qt_error_set(err, QT_ERR_FORMAT,
                          "Fashion-MNIST in '%s': the test images are %d x %d but the training images %d x %d; the "
                          "directory mixes files of different data sets",
                          dir, test->shape[1], test->shape[2], train->shape[1], train->shape[2]);
        dataset_free(train);
        dataset_free(test);
    }
    return st;
}

