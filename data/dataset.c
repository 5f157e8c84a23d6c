/* dataset.c - data sets from IDX files (images in memory or read in place,
 * image_file.c), transforms, the validation split, float batches and the
 * epoch-ordered Batcher. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dataset.h"
#include "image_file.h"
#include "base/rng.h"

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

void dataset_free(Dataset *d) {
    if (!d) return;
    image_file_free(d->file);
    free(d->pixels);
    free(d->labels);
    free(d->targets);
    memset(d, 0, sizeof *d);
}

const char *dataset_image_file(const Dataset *d) { return d && d->file ? d->file->path : NULL; }

/* ---- transforms ------------------------------------------------------------ */

/* The transforms are first worked out on index lists and a folded pixel
 * map, and only applied to the data once all of them have succeeded, so a
 * failing list leaves both data sets as they were. */
typedef struct {
    Dataset *d;          /* NULL: the set is absent */
    const char *name;    /* "training" / "test", for messages */
    uint32_t *keep;      /* [d->n]: kept example indices, increasing; the first cnt are valid */
    int32_t *labels;     /* [d->n]: the kept examples' labels after relabelling */
    int cnt;
    double scale, shift; /* the pixel map so far */
} SetPlan;

static QtStatus plan_init(SetPlan *p, Dataset *d, const char *name, QtError *err) {
    memset(p, 0, sizeof *p);
    p->name = name;
    if (!d) return QT_OK;
    p->d = d;
    p->cnt = d->n;
    p->scale = d->pixel_scale;
    p->shift = d->pixel_shift;
    size_t n = d->n > 0 ? (size_t)d->n : 1;
    p->keep = malloc(n * sizeof *p->keep);
    p->labels = malloc(n * sizeof *p->labels);
    if (!p->keep || !p->labels)
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the index lists for %d %s examples", d->n, name);
    for (int i = 0; i < d->n; i++) p->keep[i] = (uint32_t)i, p->labels[i] = d->labels[i];
    return QT_OK;
}

static void plan_free(SetPlan *p) {
    free(p->keep);
    free(p->labels);
}

/* "[a, b, c]", shortened with "..." when it does not fit. */
static const char *classes_str(char *buf, size_t size, const Transform *t) {
    size_t len = (size_t)snprintf(buf, size, "[");
    int n = t->n_classes < DATASET_MAX_CLASSES ? t->n_classes : DATASET_MAX_CLASSES;
    for (int i = 0; i < n && len < size; i++) {
        if (len + 16 >= size) {
            snprintf(buf + len, size - len, "...");
            return buf;
        }
        len += (size_t)snprintf(buf + len, size - len, "%s%d", i ? ", " : "", t->classes[i]);
    }
    if (len < size) snprintf(buf + len, size - len, "]");
    return buf;
}

/* Byte counts, in four tables filled in turn: images are mostly runs of one
 * value (the background), and increments of a single counter would wait on
 * each other; this is about 3x faster on Fashion-MNIST. */
typedef struct {
    uint64_t part[4][256];
    size_t feat;        /* bytes per example */
} PixelHist;

static void hist_add(PixelHist *h, const uint8_t *px, size_t len) {
    size_t j = 0;
    for (; j + 4 <= len; j += 4) {
        h->part[0][px[j]]++, h->part[1][px[j + 1]]++;
        h->part[2][px[j + 2]]++, h->part[3][px[j + 3]]++;
    }
    for (; j < len; j++) h->part[0][px[j]]++;
}

static void hist_add_run(void *ctx, int i0, const uint8_t *px, int k) {
    (void)i0;
    PixelHist *h = ctx;
    hist_add(h, px, (size_t)k * h->feat);
}

/* Population mean and std, in double, of the pixel values x = scale*p + shift
 * over the examples the training plan keeps, from a histogram of the bytes
 * (read through once for a file-backed set). */
static QtStatus plan_pixel_stats(const SetPlan *p, double *mean, double *std, QtError *err) {
    PixelHist h;
    memset(&h, 0, sizeof h);
    uint64_t hist[256];
    size_t feat = (size_t)p->d->feat;
    h.feat = feat;
    if (p->d->file) {
        QtStatus st = image_file_read(p->d->file, p->keep, 0, p->cnt, hist_add_run, &h, err);
        if (st != QT_OK) return st;
    } else {
        for (int i = 0; i < p->cnt; i++) hist_add(&h, p->d->pixels + (size_t)p->keep[i] * feat, feat);
    }
    for (int v = 0; v < 256; v++) hist[v] = h.part[0][v] + h.part[1][v] + h.part[2][v] + h.part[3][v];
    double total = (double)p->cnt * (double)feat, sum = 0.0, var = 0.0;
    for (int v = 0; v < 256; v++) sum += (double)v * (double)hist[v];
    double mean_p = sum / total;
    for (int v = 0; v < 256; v++) var += (double)hist[v] * ((double)v - mean_p) * ((double)v - mean_p);
    *mean = p->scale * mean_p + p->shift;
    *std = fabs(p->scale) * sqrt(var / total);
    return QT_OK;
}

static QtStatus transform_normalize(SetPlan *plans, const Transform *t, int ti, QtError *err) {
    double mean = t->mean, std = t->std;
    if (t->stats_given) {
        if (!(std > 0.0) || isinf(std) || !isfinite(mean))
            return qt_error_set(err, QT_ERR_CONFIG,
                                "data.transform[%d] (normalize): mean = %g, std = %g is invalid; the mean must be "
                                "finite and the std a finite number > 0",
                                ti, (double)t->mean, (double)t->std);
    } else {
        QtStatus st = plan_pixel_stats(&plans[0], &mean, &std, err);
        if (st != QT_OK) return st;
        if (!(std > 0.0) || !isfinite(std))
            return qt_error_set(err, QT_ERR_VALUE,
                                "data.transform[%d] (normalize): every pixel of the %d training examples has the "
                                "value %g, so their std is 0 and they cannot be normalized; give mean and std "
                                "explicitly or drop the normalize",
                                ti, plans[0].cnt, mean);
    }
    for (int s = 0; s < 2; s++) {
        plans[s].scale = plans[s].scale / std;
        plans[s].shift = (plans[s].shift - mean) / std;
    }
    return QT_OK;
}

static QtStatus transform_check_transpose(const SetPlan *plans, int ti, QtError *err) {
    for (int s = 0; s < 2; s++) {
        const Dataset *d = plans[s].d;
        if (!d) continue;
        if (d->ndim != 3 || d->shape[1] != d->shape[2])
            return qt_error_set(err, QT_ERR_SHAPE,
                                "data.transform[%d] (transpose): the %s images are %d x %d, but transpose needs "
                                "square images (C, H, W) with H == W",
                                ti, plans[s].name, d->ndim == 3 ? d->shape[1] : 0, d->ndim == 3 ? d->shape[2] : 0);
    }
    return QT_OK;
}

static QtStatus transform_classes(SetPlan *plans, const Transform *t, int ti, int *n_classes, QtError *err) {
    char list[256];
    classes_str(list, sizeof list, t);
    if (t->n_classes < 1 || t->n_classes > DATASET_MAX_CLASSES)
        return qt_error_set(err, QT_ERR_CONFIG, "data.transform[%d] (classes): %d classes listed; give 1 to %d", ti,
                            t->n_classes, DATASET_MAX_CLASSES);
    int map[DATASET_MAX_CLASSES];
    for (int c = 0; c < DATASET_MAX_CLASSES; c++) map[c] = -1;
    for (int k = 0; k < t->n_classes; k++) {
        int c = t->classes[k];
        if (c < 0 || c >= *n_classes)
            return qt_error_set(err, QT_ERR_CONFIG,
                                "data.transform[%d]: classes %s names class %d, but the labels at that point are "
                                "0..%d",
                                ti, list, c, *n_classes - 1);
        if (map[c] >= 0)
            return qt_error_set(err, QT_ERR_CONFIG, "data.transform[%d]: classes %s names class %d twice", ti, list, c);
        map[c] = k;
    }
    for (int s = 0; s < 2; s++) {
        SetPlan *p = &plans[s];
        if (!p->d) continue;
        int kept = 0;
        for (int i = 0; i < p->cnt; i++) {
            int c = map[p->labels[i]];
            if (c < 0) continue;
            p->keep[kept] = p->keep[i];
            p->labels[kept++] = c;
        }
        p->cnt = kept;
        if (kept == 0)
            return qt_error_set(err, QT_ERR_CONFIG,
                                "data.transform[%d]: classes %s leaves no %s examples; list classes the data has", ti,
                                list, p->name);
    }
    *n_classes = t->n_classes;
    return QT_OK;
}

/* Transposes each (side, side) channel of the n examples' bytes in place. */
static void pixels_transpose(uint8_t *pixels, int n, int channels, int side) {
    size_t feat = (size_t)channels * (size_t)side * (size_t)side;
    for (int e = 0; e < n; e++) {
        for (int c = 0; c < channels; c++) {
            uint8_t *img = pixels + (size_t)e * feat + (size_t)c * side * side;
            for (int i = 0; i < side; i++) {
                for (int j = i + 1; j < side; j++) {
                    uint8_t tmp = img[i * side + j];
                    img[i * side + j] = img[j * side + i];
                    img[j * side + i] = tmp;
                }
            }
        }
    }
}

/* Applies the plan to its data set: keeps and relabels the examples, sets
 * the pixel map, and transposes the pixels if asked (a file-backed set
 * only notes which rows to read and that they are to be transposed). */
static void plan_commit(SetPlan *p, int n_classes, bool transpose) {
    Dataset *d = p->d;
    if (!d) return;
    size_t feat = (size_t)d->feat;
    if (d->file) {
        if (image_file_keep(d->file, p->keep, p->cnt)) p->keep = NULL; /* now the file's row list */
        d->file->transpose ^= transpose;
    } else {
        /* keep[] is increasing, so moving example keep[i] down to i never
         * overwrites one still to be moved. */
        for (int i = 0; i < p->cnt; i++)
            if (p->keep[i] != (uint32_t)i) memmove(d->pixels + (size_t)i * feat, d->pixels + p->keep[i] * feat, feat);
    }
    memcpy(d->labels, p->labels, (size_t)p->cnt * sizeof *d->labels);
    if (p->cnt < d->n) {
        /* Give the dropped examples' memory back; keeping it is harmless if that fails. */
        if (d->pixels) {
            uint8_t *px = realloc(d->pixels, (size_t)p->cnt * feat);
            if (px) d->pixels = px;
        }
        int32_t *lb = realloc(d->labels, (size_t)p->cnt * sizeof *lb);
        if (lb) d->labels = lb;
    }
    d->n = p->cnt;
    d->n_classes = n_classes;
    d->pixel_scale = (float)p->scale;
    d->pixel_shift = (float)p->shift;
    if (transpose && d->pixels) pixels_transpose(d->pixels, d->n, d->shape[0], d->shape[1]);
}

static QtStatus transforms_check_args(const Dataset *train, const Dataset *test, const Transform *transforms, int n,
                                      QtError *err) {
    if (!train) return qt_error_set(err, QT_ERR_ARG, "dataset_apply_transforms: no training set");
    if (n < 0 || (n > 0 && !transforms))
        return qt_error_set(err, QT_ERR_ARG, "dataset_apply_transforms: no transform list (n = %d)", n);
    if (train->n < 1)
        return qt_error_set(err, QT_ERR_ARG, "dataset_apply_transforms: the training set has no examples");
    if (train->n_classes < 1 || train->n_classes > DATASET_MAX_CLASSES)
        return qt_error_set(err, QT_ERR_ARG, "dataset_apply_transforms: n_classes = %d is outside 1..%d",
                            train->n_classes, DATASET_MAX_CLASSES);
    if (test && test->n_classes != train->n_classes)
        return qt_error_set(err, QT_ERR_ARG,
                            "dataset_apply_transforms: the training set has %d classes but the test set %d",
                            train->n_classes, test->n_classes);
    return QT_OK;
}

/* One transform, on the plans; transposes counts the transposes so far. */
static QtStatus transform_plan_one(SetPlan *plans, const Transform *t, int ti, int *n_classes, int *transposes,
                                   QtError *err) {
    switch (t->kind) {
    case TRANSFORM_NORMALIZE: return transform_normalize(plans, t, ti, err);
    case TRANSFORM_TRANSPOSE: {
        QtStatus st = transform_check_transpose(plans, ti, err);
        if (st == QT_OK) (*transposes)++;
        return st;
    }
    case TRANSFORM_INVERT:
        for (int s = 0; s < 2; s++) {
            plans[s].scale = -plans[s].scale;
            plans[s].shift = 1.0 - plans[s].shift;
        }
        return QT_OK;
    case TRANSFORM_CLASSES: return transform_classes(plans, t, ti, n_classes, err);
    case TRANSFORM_LIMIT:
        if (t->limit < 1)
            return qt_error_set(err, QT_ERR_CONFIG, "data.transform[%d] (limit): limit = %d; it must be >= 1", ti,
                                t->limit);
        for (int s = 0; s < 2; s++)
            if (plans[s].cnt > t->limit) plans[s].cnt = t->limit;
        return QT_OK;
    case TRANSFORM_COUNT: break;
    }
    return qt_error_set(err, QT_ERR_ARG, "data.transform[%d]: unknown transform kind %d", ti, (int)t->kind);
}

QtStatus dataset_apply_transforms(Dataset *train, Dataset *test, const Transform *transforms, int n, QtError *err) {
    QtStatus st = transforms_check_args(train, test, transforms, n, err);
    if (st != QT_OK) return st;
    SetPlan plans[2];
    int n_classes = train->n_classes, transposes = 0;
    st = plan_init(&plans[0], train, "training", err);
    if (st == QT_OK) st = plan_init(&plans[1], test, "test", err);
    else memset(&plans[1], 0, sizeof plans[1]);
    for (int i = 0; i < n && st == QT_OK; i++)
        st = transform_plan_one(plans, &transforms[i], i, &n_classes, &transposes, err);
    if (st == QT_OK) {
        /* Two transposes cancel. */
        plan_commit(&plans[0], n_classes, transposes % 2 == 1);
        plan_commit(&plans[1], n_classes, transposes % 2 == 1);
    }
    plan_free(&plans[0]);
    plan_free(&plans[1]);
    return st;
}

/* ---- validation split -------------------------------------------------------- */

QtStatus dataset_split_tail(Dataset *train, Dataset *val, double fraction, QtError *err) {
    memset(val, 0, sizeof *val);
    if (!(fraction >= 0.0 && fraction < 1.0))
        return qt_error_set(err, QT_ERR_CONFIG, "data.val_fraction = %g is invalid; it must be in [0, 1)", fraction);
    int k = (int)llround(fraction * train->n);
    if (k >= train->n)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "data.val_fraction = %g would move all %d training examples to the validation set; "
                            "lower it",
                            fraction, train->n);
    val->ndim = train->ndim;
    memcpy(val->shape, train->shape, sizeof val->shape);
    val->feat = train->feat;
    val->n_classes = train->n_classes;
    val->pixel_scale = train->pixel_scale;
    val->pixel_shift = train->pixel_shift;
    if (k == 0) return QT_OK;
    size_t feat = (size_t)train->feat;
    int first = train->n - k;
    val->labels = malloc((size_t)k * sizeof *val->labels);
    if (!train->file) val->pixels = malloc((size_t)k * feat);
    QtStatus st = QT_OK;
    if (!val->labels || (!train->file && !val->pixels))
        st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate a validation set of %d examples", k);
    else if (train->file) /* last: it shrinks train's row list */
        st = image_file_split(train->file, first, k, &val->file, err);
    if (st != QT_OK) {
        dataset_free(val);
        return st;
    }
    if (val->pixels) memcpy(val->pixels, train->pixels + (size_t)first * feat, (size_t)k * feat);
    memcpy(val->labels, train->labels + first, (size_t)k * sizeof *val->labels);
    val->n = k;
    train->n = first;
    if (train->pixels) {
        uint8_t *px = realloc(train->pixels, (size_t)first * feat);
        if (px) train->pixels = px;
    }
    int32_t *lb = realloc(train->labels, (size_t)first * sizeof *lb);
    if (lb) train->labels = lb;
    return QT_OK;
}

/* ---- batches ------------------------------------------------------------------ */

/* x = scale * p + shift for len bytes: the one place the pixel map is
 * applied, so memory- and file-backed sets give the same floats. */
static void convert_bytes(float *x, const uint8_t *px, size_t len, float scale, float shift) {
    for (size_t j = 0; j < len; j++) x[j] = scale * (float)px[j] + shift;
}

/* The same for one example whose (side, side) channels are transposed. */
static void convert_transposed(float *x, const uint8_t *px, int channels, int side, float scale, float shift) {
    size_t plane = (size_t)side * (size_t)side;
    for (int c = 0; c < channels; c++, x += plane, px += plane)
        for (int i = 0; i < side; i++)
            for (int j = 0; j < side; j++) x[i * side + j] = scale * (float)px[j * side + i] + shift;
}

typedef struct {
    const Dataset *d;
    float *x;          /* (n, feat): the whole request */
} FillCtx;

static void fill_run(void *ctx, int i0, const uint8_t *px, int k) {
    const FillCtx *c = ctx;
    const Dataset *d = c->d;
    size_t feat = (size_t)d->feat;
    float *x = c->x + (size_t)i0 * feat;
    if (!d->file->transpose) {
        convert_bytes(x, px, (size_t)k * feat, d->pixel_scale, d->pixel_shift);
        return;
    }
    for (int r = 0; r < k; r++)
        convert_transposed(x + (size_t)r * feat, px + (size_t)r * feat, d->file->channels, d->file->side,
                           d->pixel_scale, d->pixel_shift);
}

QtStatus dataset_fill_batch(const Dataset *d, const uint32_t *idx, int n, float *x, int32_t *y, QtError *err) {
    size_t feat = (size_t)d->feat;
    if (d->file) {
        FillCtx c = {d, x};
        QtStatus st = image_file_read(d->file, idx, 0, n, fill_run, &c, err);
        if (st != QT_OK) return st;
    } else {
        for (int i = 0; i < n; i++)
            convert_bytes(x + (size_t)i * feat, d->pixels + (size_t)idx[i] * feat, feat, d->pixel_scale,
                          d->pixel_shift);
    }
    if (y && d->labels)
        for (int i = 0; i < n; i++) y[i] = d->labels[idx[i]];
    return QT_OK;
}

QtStatus dataset_fill_range(const Dataset *d, int start, int n, float *x, int32_t *y, QtError *err) {
    size_t feat = (size_t)d->feat;
    if (d->file) {
        FillCtx c = {d, x};
        QtStatus st = image_file_read(d->file, NULL, start, n, fill_run, &c, err);
        if (st != QT_OK) return st;
    } else {
        convert_bytes(x, d->pixels + (size_t)start * feat, (size_t)n * feat, d->pixel_scale, d->pixel_shift);
    }
    if (y && d->labels) memcpy(y, d->labels + start, (size_t)n * sizeof *y);
    return QT_OK;
}

bool dataset_fill_targets(const Dataset *d, const uint32_t *idx, int n, float *t) {
    if (!d->targets) return false;
    const size_t k = (size_t)d->n_targets;
    for (int i = 0; i < n; i++) memcpy(t + (size_t)i * k, d->targets + (size_t)idx[i] * k, k * sizeof *t);
    return true;
}

bool dataset_fill_targets_range(const Dataset *d, int start, int n, float *t) {
    if (!d->targets) return false;
    memcpy(t, d->targets + (size_t)start * d->n_targets, (size_t)n * d->n_targets * sizeof *t);
    return true;
}

/* The order of epoch b->epoch: identity, shuffled unless shuffle is off. */
static void batcher_make_order(Batcher *b) {
    for (int i = 0; i < b->d->n; i++) b->order[i] = (uint32_t)i;
    if (!b->shuffle) return;
    Rng r;
    rng_init(&r, b->seed, RNG_STREAM_SHUFFLE + ((uint64_t)b->epoch << 8));
    rng_shuffle_u32(&r, b->order, (size_t)b->d->n);
}

QtStatus batcher_init(Batcher *b, const Dataset *d, int batch_size, bool shuffle, bool drop_last, uint64_t seed,
                      QtError *err) {
    memset(b, 0, sizeof *b);
    if (!d || d->n < 1) return qt_error_set(err, QT_ERR_ARG, "batcher_init: the data set has no examples");
    if (batch_size < 1)
        return qt_error_set(err, QT_ERR_CONFIG, "train.batch_size = %d is invalid; it must be >= 1", batch_size);
    if (drop_last && batch_size > d->n)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "train.batch_size = %d is larger than the %d training examples, so with data.drop_last "
                            "no batch is ever full; lower the batch size or turn drop_last off",
                            batch_size, d->n);
    b->order = malloc((size_t)d->n * sizeof *b->order);
    if (!b->order)
        return qt_error_set(err, QT_ERR_NOMEM, "batcher_init: cannot allocate the order of %d examples", d->n);
    b->d = d;
    b->batch_size = batch_size;
    b->shuffle = shuffle;
    b->drop_last = drop_last;
    b->seed = seed;
    batcher_make_order(b);
    return QT_OK;
}

void batcher_free(Batcher *b) {
    if (!b) return;
    free(b->order);
    memset(b, 0, sizeof *b);
}

int64_t batcher_steps_per_epoch(const Batcher *b) {
    int64_t n = b->d->n, bs = b->batch_size;
    return b->drop_last ? n / bs : (n + bs - 1) / bs;
}

QtStatus batcher_seek(Batcher *b, int64_t epoch, int cursor, QtError *err) {
    if (epoch < 0 || cursor < 0 || cursor > b->d->n)
        return qt_error_set(err, QT_ERR_VALUE,
                            "data position epoch %lld, cursor %d is invalid for %d examples; the cursor must be in "
                            "0..%d and the epoch >= 0 (was the checkpoint made on other data?)",
                            (long long)epoch, cursor, b->d->n, b->d->n);
    b->epoch = epoch;
    b->cursor = cursor;
    batcher_make_order(b);
    return QT_OK;
}

QtStatus batcher_next(Batcher *b, float *x, int32_t *y, int *n, int64_t *epoch_of_batch, QtError *err) {
    int left = b->d->n - b->cursor;
    if (b->drop_last ? left < b->batch_size : left <= 0) {
        b->epoch++;
        b->cursor = 0;
        batcher_make_order(b);
        left = b->d->n;
    }
    int m = left < b->batch_size ? left : b->batch_size;
    QtStatus st = dataset_fill_batch(b->d, b->order + b->cursor, m, x, y, err);
    if (st != QT_OK) return st;
    if (n) *n = m;
    if (epoch_of_batch) *epoch_of_batch = b->epoch;
    b->cursor += m;
    return QT_OK;
}

/* ---- dropping classes (anomaly detection's held-out classes) ---------------------------------------------------- */

QtStatus dataset_drop_classes(Dataset *d, const int *classes, int n_drop, int *dropped, QtError *err) {
    if (dropped) *dropped = 0;
    if (n_drop <= 0 || d->n == 0) return QT_OK;
    if (!d->labels)
        return qt_error_set(err, QT_ERR_CONFIG, "cannot drop classes from a data set without class labels (its "
                            "targets are %d values per example)", d->n_targets);
    bool drop[DATASET_MAX_CLASSES] = {false};
    for (int k = 0; k < n_drop; k++)
        if (classes[k] >= 0 && classes[k] < DATASET_MAX_CLASSES) drop[classes[k]] = true;
    uint32_t *keep = malloc((size_t)d->n * sizeof *keep);
    if (!keep) return qt_error_set(err, QT_ERR_NOMEM, "out of memory dropping classes of %d examples", d->n);
    int cnt = 0;
    for (int i = 0; i < d->n; i++)
        if (d->labels[i] < 0 || d->labels[i] >= DATASET_MAX_CLASSES || !drop[d->labels[i]]) keep[cnt++] = (uint32_t)i;
    if (dropped) *dropped = d->n - cnt;
    if (cnt == d->n) {
        free(keep);
        return QT_OK;
    }
    /* keep[] is increasing: moving example keep[i] down to i never overwrites one still to be moved. */
    size_t feat = (size_t)d->feat, k = (size_t)d->n_targets;
    for (int i = 0; i < cnt; i++) {
        d->labels[i] = d->labels[keep[i]];
        if (d->targets) memmove(d->targets + (size_t)i * k, d->targets + keep[i] * k, k * sizeof *d->targets);
        if (d->pixels && keep[i] != (uint32_t)i)
            memmove(d->pixels + (size_t)i * feat, d->pixels + keep[i] * feat, feat);
    }
    d->n = cnt;
    if (d->file && image_file_keep(d->file, keep, cnt)) keep = NULL; /* now the file's row list */
    free(keep);
    return QT_OK;
}
