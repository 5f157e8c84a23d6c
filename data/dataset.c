/* dataset.c - what every data set shares once loaded (dataset_idx.c,
 * dataset_hdf5.c): transforms, the validation split, float batches and the
 * epoch-ordered Batcher. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "dataset.h"
#include "image_file.h"
#include "base/rng.h"

void dataset_free(Dataset *d) {
    if (!d) return;
    image_file_free(d->file);
    free(d->pixels);
    free(d->labels);
    free(d->targets);
    free(d->chan_scale);
    free(d->chan_shift);
    memset(d, 0, sizeof *d);
}

const char *dataset_image_file(const Dataset *d) { return d && d->file ? d->file->path : NULL; }

/* ---- transforms ------------------------------------------------------------ */

/* The transforms are first worked out on index lists and a folded pixel
 * map (one per channel), and only applied to the data once all of them have
 * succeeded, so a failing list leaves both data sets as they were. */
#define PLAN_SETS 3 /* training, test, validation (an HDF5 file's own /val) */

typedef struct {
    Dataset *d;          /* NULL: the set is absent */
    const char *name;    /* "training", "test", "validation", for messages */
    uint32_t *keep;      /* [d->n]: kept example indices, increasing; the first cnt are valid */
    int32_t *labels;     /* [d->n]: the kept examples' labels after relabelling; NULL for value targets */
    int cnt;
    int n_chan;          /* channels of the map: shape[0] */
    double *scale, *shift; /* [n_chan]: the pixel map so far */
} SetPlan;

static QtStatus plan_init(SetPlan *p, Dataset *d, const char *name, QtError *err) {
    memset(p, 0, sizeof *p);
    p->name = name;
    if (!d) return QT_OK;
    p->d = d;
    p->cnt = d->n;
    p->n_chan = d->shape[0] > 0 ? d->shape[0] : 1;
    size_t n = d->n > 0 ? (size_t)d->n : 1;
    p->keep = malloc(n * sizeof *p->keep);
    p->labels = d->labels ? malloc(n * sizeof *p->labels) : NULL;
    p->scale = malloc(2 * (size_t)p->n_chan * sizeof *p->scale);
    if (!p->keep || (d->labels && !p->labels) || !p->scale)
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the index lists for %d %s examples", d->n, name);
    p->shift = p->scale + p->n_chan;
    for (int c = 0; c < p->n_chan; c++) {
        p->scale[c] = d->chan_scale ? d->chan_scale[c] : d->pixel_scale;
        p->shift[c] = d->chan_scale ? d->chan_shift[c] : d->pixel_shift;
    }
    for (int i = 0; i < d->n; i++) {
        p->keep[i] = (uint32_t)i;
        if (p->labels) p->labels[i] = d->labels[i];
    }
    return QT_OK;
}

static void plan_free(SetPlan *p) {
    free(p->keep);
    free(p->labels);
    free(p->scale);
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

/* Per-channel sums of the stored values of the examples a plan keeps: for
 * bytes, counts of each value per channel in four tables filled in turn
 * (images are mostly runs of one value, the background, and increments of
 * a single counter would wait on each other: about 3x faster on
 * Fashion-MNIST); for other elements, the sum and the sum of squares about
 * the channel's first value, in double. */
typedef struct {
    const Dataset *d;
    int n_chan;
    size_t plane;       /* values per channel of an example */
    uint64_t (*part)[4][256]; /* [n_chan]: bytes */
    double *sum, *sq, *ref;   /* [n_chan] each: other elements */
    bool have_ref;
} ChanStats;

static void stats_add_row(ChanStats *h, const uint8_t *row) {
    const DataElem e = h->d->elem;
    for (int c = 0; c < h->n_chan; c++) {
        const size_t at = (size_t)c * h->plane;
        if (e == DATA_ELEM_U8) {
            const uint8_t *px = row + at;
            uint64_t (*t)[256] = h->part[c];
            size_t j = 0;
            for (; j + 4 <= h->plane; j += 4) {
                t[0][px[j]]++, t[1][px[j + 1]]++;
                t[2][px[j + 2]]++, t[3][px[j + 3]]++;
            }
            for (; j < h->plane; j++) t[0][px[j]]++;
            continue;
        }
        if (!h->have_ref) h->ref[c] = convert_value(row, at, e);
        for (size_t j = 0; j < h->plane; j++) {
            const double v = (double)convert_value(row, at + j, e) - h->ref[c];
            h->sum[c] += v, h->sq[c] += v * v;
        }
    }
    h->have_ref = true;
}

static void stats_add_run(void *ctx, int i0, const uint8_t *px, int k) {
    (void)i0;
    ChanStats *h = ctx;
    const size_t row = (size_t)h->d->feat * data_elem_bytes(h->d->elem);
    for (int r = 0; r < k; r++) stats_add_row(h, px + (size_t)r * row);
}

/* Population mean and std, in double, per channel, of the stored values
 * over the examples the training plan keeps (read through once for a
 * file-backed set), before the plan's map. */
static QtStatus plan_stored_stats(const SetPlan *p, double *mean, double *var, QtError *err) {
    const Dataset *d = p->d;
    ChanStats h = {.d = d, .n_chan = p->n_chan, .plane = (size_t)d->feat / (size_t)p->n_chan};
    const bool bytes = d->elem == DATA_ELEM_U8;
    if (bytes) h.part = calloc((size_t)p->n_chan, sizeof *h.part);
    else h.sum = calloc(3 * (size_t)p->n_chan, sizeof *h.sum);
    if (bytes ? !h.part : !h.sum)
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the statistics of %d channels", p->n_chan);
    if (!bytes) h.sq = h.sum + p->n_chan, h.ref = h.sq + p->n_chan;
    QtStatus st = QT_OK;
    if (d->file) {
        st = image_file_read(d->file, p->keep, 0, p->cnt, stats_add_run, &h, err);
    } else {
        const size_t row = (size_t)d->feat * data_elem_bytes(d->elem);
        for (int i = 0; i < p->cnt; i++) stats_add_row(&h, d->pixels + (size_t)p->keep[i] * row);
    }
    const double total = (double)p->cnt * (double)h.plane;
    for (int c = 0; st == QT_OK && c < p->n_chan; c++) {
        if (bytes) {
            uint64_t hist[256];
            for (int v = 0; v < 256; v++)
                hist[v] = h.part[c][0][v] + h.part[c][1][v] + h.part[c][2][v] + h.part[c][3][v];
            double sum = 0.0, m2 = 0.0;
            for (int v = 0; v < 256; v++) sum += (double)v * (double)hist[v];
            const double m = sum / total;
            for (int v = 0; v < 256; v++) m2 += (double)hist[v] * ((double)v - m) * ((double)v - m);
            mean[c] = m, var[c] = m2 / total;
        } else {
            const double m = h.sum[c] / total;
            mean[c] = h.ref[c] + m, var[c] = h.sq[c] / total - m * m;
            if (var[c] < 0.0) var[c] = 0.0;
        }
    }
    free(h.part);
    free(h.sum);
    return st;
}

/* The mean and std of the values x = scale*p + shift the plan gives now:
 * per channel (per_channel), else one pair over every value. */
static QtStatus plan_pixel_stats(const SetPlan *p, bool per_channel, double *mean, double *std, QtError *err) {
    double *m = malloc(2 * (size_t)p->n_chan * sizeof *m);
    if (!m) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the statistics of %d channels", p->n_chan);
    double *v = m + p->n_chan;
    QtStatus st = plan_stored_stats(p, m, v, err);
    if (st == QT_OK && (per_channel || p->n_chan == 1)) {
        for (int c = 0; c < p->n_chan; c++) {
            mean[c] = p->scale[c] * m[c] + p->shift[c];
            std[c] = fabs(p->scale[c]) * sqrt(v[c]);
        }
    } else if (st == QT_OK) { /* every channel holds as many values: the pooled mean and variance */
        double mu = 0.0, var = 0.0;
        for (int c = 0; c < p->n_chan; c++) mu += p->scale[c] * m[c] + p->shift[c];
        mu /= p->n_chan;
        for (int c = 0; c < p->n_chan; c++) {
            const double mc = p->scale[c] * m[c] + p->shift[c];
            var += p->scale[c] * p->scale[c] * v[c] + (mc - mu) * (mc - mu);
        }
        mean[0] = mu, std[0] = sqrt(var / p->n_chan);
    }
    free(m);
    return st;
}

static QtStatus transform_normalize(SetPlan *plans, const Transform *t, int ti, QtError *err) {
    const int C = plans[0].n_chan;
    double *mean = malloc(2 * (size_t)C * sizeof *mean);
    if (!mean) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the statistics of %d channels", C);
    double *std = mean + C;
    bool per = t->per_channel || t->n_stats > 0;
    QtStatus st = QT_OK;
    if (t->stats_given && t->n_stats > 0) {
        if (t->n_stats != C)
            st = qt_error_set(err, QT_ERR_CONFIG,
                              "data.transform[%d] (normalize): %d means and stds given, but the examples have %d "
                              "channels (axis 0 of %s); give one per channel, or a single mean and std",
                              ti, t->n_stats, C, plans[0].d->ndim == 3 ? "(C, H, W)" : "(F,): one per feature");
        for (int c = 0; st == QT_OK && c < C; c++) {
            mean[c] = t->means[c], std[c] = t->stds[c];
            if (!(std[c] > 0.0) || isinf(std[c]) || !isfinite(mean[c]))
                st = qt_error_set(err, QT_ERR_CONFIG,
                                  "data.transform[%d] (normalize): channel %d has mean = %g, std = %g; the mean must "
                                  "be finite and the std a finite number > 0",
                                  ti, c, mean[c], std[c]);
        }
    } else if (t->stats_given) {
        mean[0] = t->mean, std[0] = t->std;
        if (!(std[0] > 0.0) || isinf(std[0]) || !isfinite(mean[0]))
            st = qt_error_set(err, QT_ERR_CONFIG,
                              "data.transform[%d] (normalize): mean = %g, std = %g is invalid; the mean must be "
                              "finite and the std a finite number > 0",
                              ti, (double)t->mean, (double)t->std);
    } else if (plans[0].d->n_stats > 0) {
        /* the data file's own, of the values as loaded (uint8: p / 255; others: p), carried through the
           transforms before this one */
        const Dataset *d = plans[0].d;
        const double s0 = d->elem == DATA_ELEM_U8 ? 1.0 / 255.0 : 1.0;
        per = d->n_stats > 1;
        for (int c = 0; c < d->n_stats; c++) {
            const double a = plans[0].scale[c] / s0, b = plans[0].shift[c];
            mean[c] = a * d->stats_mean[c] + b, std[c] = fabs(a) * d->stats_std[c];
        }
    } else {
        st = plan_pixel_stats(&plans[0], per, mean, std, err);
        for (int c = 0; st == QT_OK && c < (per ? C : 1); c++)
            if (!(std[c] > 0.0) || !isfinite(std[c]))
                st = qt_error_set(err, QT_ERR_VALUE,
                                  "data.transform[%d] (normalize): every value of %s of the %d training examples is "
                                  "%g, so their std is 0 and they cannot be normalized; give mean and std explicitly "
                                  "or drop the normalize",
                                  ti, per ? "a channel" : "the", plans[0].cnt, mean[c]);
    }
    for (int s = 0; st == QT_OK && s < PLAN_SETS; s++)
        for (int c = 0; plans[s].d && c < C; c++) {
            const double m = mean[per ? c : 0], sd = std[per ? c : 0];
            plans[s].scale[c] = plans[s].scale[c] / sd;
            plans[s].shift[c] = (plans[s].shift[c] - m) / sd;
        }
    free(mean);
    return st;
}

static QtStatus transform_check_transpose(const SetPlan *plans, int ti, QtError *err) {
    for (int s = 0; s < PLAN_SETS; s++) {
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
    if (!plans[0].labels)
        return qt_error_set(err, QT_ERR_CONFIG, "data.transform[%d]: classes %s keeps examples by class label, but "
                            "this data set's targets are values (regression), not classes; drop the transform", ti,
                            list);
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
    for (int s = 0; s < PLAN_SETS; s++) {
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

/* Applies the plan to its data set: keeps and relabels the examples, sets
 * the pixel map, and transposes the pixels if asked (a file-backed set
 * only notes which rows to read and that they are to be transposed). */
/* Moves example rows keep[0..cnt) of base [n][row] down to 0..cnt: keep[] is increasing, so moving example
 * keep[i] down to i never overwrites one still to be moved. Gives the rest back (keeping it is harmless if that
 * fails). */
static void *rows_keep(void *base, const uint32_t *keep, int cnt, int n, size_t row) {
    uint8_t *b = base;
    for (int i = 0; i < cnt; i++)
        if (keep[i] != (uint32_t)i) memmove(b + (size_t)i * row, b + (size_t)keep[i] * row, row);
    if (cnt < n && cnt > 0) {
        void *shrunk = realloc(base, (size_t)cnt * row);
        if (shrunk) return shrunk;
    }
    return base;
}

static void plan_commit(SetPlan *p, int n_classes, bool transpose) {
    Dataset *d = p->d;
    if (!d) return;
    const size_t row = (size_t)d->feat * data_elem_bytes(d->elem);
    if (d->file) {
        uint32_t *keep = p->keep;
        if (d->targets) /* the file takes keep as its row list: the targets move first */
            d->targets = rows_keep(d->targets, keep, p->cnt, d->n, (size_t)d->n_targets * sizeof *d->targets);
        if (image_file_keep(d->file, keep, p->cnt)) p->keep = NULL; /* now the file's row list */
        d->file->transpose ^= transpose;
    } else {
        d->pixels = rows_keep(d->pixels, p->keep, p->cnt, d->n, row);
        if (d->targets)
            d->targets = rows_keep(d->targets, p->keep, p->cnt, d->n, (size_t)d->n_targets * sizeof *d->targets);
    }
    if (d->labels) {
        memcpy(d->labels, p->labels, (size_t)p->cnt * sizeof *d->labels);
        if (p->cnt < d->n && p->cnt > 0) {
            int32_t *lb = realloc(d->labels, (size_t)p->cnt * sizeof *lb);
            if (lb) d->labels = lb;
        }
    }
    d->n = p->cnt;
    d->n_classes = d->labels ? n_classes : 0;
    bool uniform = true;
    for (int c = 1; c < p->n_chan; c++) uniform &= p->scale[c] == p->scale[0] && p->shift[c] == p->shift[0];
    free(d->chan_scale), free(d->chan_shift);
    d->chan_scale = d->chan_shift = NULL;
    d->pixel_scale = (float)p->scale[0];
    d->pixel_shift = (float)p->shift[0];
    if (!uniform && (d->chan_scale = malloc((size_t)p->n_chan * sizeof(float))) &&
        (d->chan_shift = malloc((size_t)p->n_chan * sizeof(float)))) {
        for (int c = 0; c < p->n_chan; c++)
            d->chan_scale[c] = (float)p->scale[c], d->chan_shift[c] = (float)p->shift[c];
    }
    if (transpose && d->pixels) convert_transpose_rows(d->pixels, d->n, d->shape[0], d->shape[1], d->elem);
}

static QtStatus transforms_check_args(const Dataset *train, const Dataset *test, const Transform *transforms, int n,
                                      QtError *err) {
    if (!train) return qt_error_set(err, QT_ERR_ARG, "dataset_apply_transforms: no training set");
    if (n < 0 || (n > 0 && !transforms))
        return qt_error_set(err, QT_ERR_ARG, "dataset_apply_transforms: no transform list (n = %d)", n);
    if (train->n < 1)
        return qt_error_set(err, QT_ERR_ARG, "dataset_apply_transforms: the training set has no examples");
    if (train->labels && (train->n_classes < 1 || train->n_classes > DATASET_MAX_CLASSES))
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
        for (int s = 0; s < PLAN_SETS; s++)
            for (int c = 0; plans[s].d && c < plans[s].n_chan; c++) {
                plans[s].scale[c] = -plans[s].scale[c];
                plans[s].shift[c] = 1.0 - plans[s].shift[c];
            }
        return QT_OK;
    case TRANSFORM_CLASSES: return transform_classes(plans, t, ti, n_classes, err);
    case TRANSFORM_LIMIT:
        if (t->limit < 1)
            return qt_error_set(err, QT_ERR_CONFIG, "data.transform[%d] (limit): limit = %d; it must be >= 1", ti,
                                t->limit);
        for (int s = 0; s < PLAN_SETS; s++)
            if (plans[s].cnt > t->limit) plans[s].cnt = t->limit;
        return QT_OK;
    case TRANSFORM_COUNT: break;
    }
    return qt_error_set(err, QT_ERR_ARG, "data.transform[%d]: unknown transform kind %d", ti, (int)t->kind);
}

QtStatus dataset_apply_transforms3(Dataset *train, Dataset *val, Dataset *test, const Transform *transforms, int n,
                                   QtError *err) {
    QtStatus st = transforms_check_args(train, test, transforms, n, err);
    if (st == QT_OK && val && val->n_classes != train->n_classes)
        st = qt_error_set(err, QT_ERR_ARG, "dataset_apply_transforms: the training set has %d classes but the "
                          "validation set %d", train->n_classes, val->n_classes);
    if (st != QT_OK) return st;
    SetPlan plans[PLAN_SETS];
    memset(plans, 0, sizeof plans);
    int n_classes = train->n_classes, transposes = 0;
    Dataset *sets[PLAN_SETS] = {train, test, val};
    static const char *const names[PLAN_SETS] = {"training", "test", "validation"};
    for (int k = 0; k < PLAN_SETS && st == QT_OK; k++) st = plan_init(&plans[k], sets[k], names[k], err);
    for (int i = 0; i < n && st == QT_OK; i++)
        st = transform_plan_one(plans, &transforms[i], i, &n_classes, &transposes, err);
    for (int k = 0; k < PLAN_SETS && st == QT_OK; k++)
        plan_commit(&plans[k], n_classes, transposes % 2 == 1); /* two transposes cancel */
    for (int k = 0; k < PLAN_SETS; k++) plan_free(&plans[k]);
    return st;
}

QtStatus dataset_apply_transforms(Dataset *train, Dataset *test, const Transform *transforms, int n, QtError *err) {
    return dataset_apply_transforms3(train, NULL, test, transforms, n, err);
}

/* ---- validation split -------------------------------------------------------- */

/* A copy of n floats, or NULL (also for src NULL). */
static float *floats_dup(const float *src, size_t n) {
    float *p = src ? malloc(n * sizeof *p) : NULL;
    if (p) memcpy(p, src, n * sizeof *p);
    return p;
}

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
    val->elem = train->elem;
    val->n_classes = train->n_classes;
    val->n_targets = train->n_targets;
    val->pixel_scale = train->pixel_scale;
    val->pixel_shift = train->pixel_shift;
    const size_t C = (size_t)train->shape[0];
    val->chan_scale = floats_dup(train->chan_scale, C);
    val->chan_shift = floats_dup(train->chan_shift, C);
    QtStatus st = QT_OK;
    if (train->chan_scale && (!val->chan_scale || !val->chan_shift))
        st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the validation set's pixel map");
    if (k == 0 || st != QT_OK) {
        if (st != QT_OK) dataset_free(val);
        return st;
    }
    const size_t row = (size_t)train->feat * data_elem_bytes(train->elem), trow = (size_t)train->n_targets;
    int first = train->n - k;
    if (train->labels) val->labels = malloc((size_t)k * sizeof *val->labels);
    if (train->targets) val->targets = malloc((size_t)k * trow * sizeof *val->targets);
    if (!train->file) val->pixels = malloc((size_t)k * row);
    if ((train->labels && !val->labels) || (train->targets && !val->targets) || (!train->file && !val->pixels))
        st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate a validation set of %d examples", k);
    else if (train->file) /* last: it shrinks train's row list */
        st = image_file_split(train->file, first, k, &val->file, err);
    if (st != QT_OK) {
        dataset_free(val);
        return st;
    }
    if (val->pixels) memcpy(val->pixels, train->pixels + (size_t)first * row, (size_t)k * row);
    if (val->labels) memcpy(val->labels, train->labels + first, (size_t)k * sizeof *val->labels);
    if (val->targets) memcpy(val->targets, train->targets + (size_t)first * trow, (size_t)k * trow * sizeof(float));
    val->n = k;
    train->n = first;
    if (train->pixels) {
        uint8_t *px = realloc(train->pixels, (size_t)first * row);
        if (px) train->pixels = px;
    }
    if (train->labels) {
        int32_t *lb = realloc(train->labels, (size_t)first * sizeof *lb);
        if (lb) train->labels = lb;
    }
    if (train->targets) {
        float *tg = realloc(train->targets, (size_t)first * trow * sizeof *tg);
        if (tg) train->targets = tg;
    }
    return QT_OK;
}

/* ---- batches ------------------------------------------------------------------ */

typedef struct {
    const Dataset *d;
    float *x;          /* (n, feat): the whole request */
} FillCtx;

static void fill_run(void *ctx, int i0, const uint8_t *px, int k) {
    const FillCtx *c = ctx;
    convert_rows(c->x + (size_t)i0 * c->d->feat, px, k, c->d, c->d->file->transpose);
}

/* A file-backed set of float examples is checked as its batches are read (one read through at the start would
 * double the start-up of a data set larger than memory): the first non-finite value, named. */
static QtStatus check_batch_finite(const Dataset *d, const uint32_t *idx, int start, int n, const float *x,
                                   QtError *err) {
    if (!d->file || (d->elem != DATA_ELEM_F16 && d->elem != DATA_ELEM_F32)) return QT_OK;
    const size_t total = (size_t)n * (size_t)d->feat;
    for (size_t j = 0; j < total; j++)
        if (!isfinite(x[j])) {
            const size_t i = j / (size_t)d->feat;
            const uint32_t ex = idx ? idx[i] : (uint32_t)start + (uint32_t)i;
            return qt_error_set(err, QT_ERR_VALUE,
                                "'%s': value %zu of example %u (file row %u) is %g after the data transforms; "
                                "examples must be finite (fix or drop that example, or check the normalize's std)",
                                d->file->path, j % (size_t)d->feat, ex, image_file_row(d->file, ex), (double)x[j]);
        }
    return QT_OK;
}

QtStatus dataset_fill_batch(const Dataset *d, const uint32_t *idx, int n, float *x, int32_t *y, QtError *err) {
    size_t feat = (size_t)d->feat;
    if (d->file) {
        FillCtx c = {d, x};
        QtStatus st = image_file_read(d->file, idx, 0, n, fill_run, &c, err);
        if (st == QT_OK) st = check_batch_finite(d, idx, 0, n, x, err);
        if (st != QT_OK) return st;
    } else {
        const size_t row = feat * data_elem_bytes(d->elem);
        for (int i = 0; i < n; i++) convert_rows(x + (size_t)i * feat, d->pixels + (size_t)idx[i] * row, 1, d, false);
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
        if (st == QT_OK) st = check_batch_finite(d, NULL, start, n, x, err);
        if (st != QT_OK) return st;
    } else {
        convert_rows(x, d->pixels + (size_t)start * feat * data_elem_bytes(d->elem), n, d, false);
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

void batcher_part(int m, int part, int parts, int *lo, int *n) {
    int base = m / parts, extra = m % parts;
    *lo = part * base + (part < extra ? part : extra);
    *n = base + (part < extra ? 1 : 0);
}

QtStatus batcher_next_part(Batcher *b, int part, int parts, float *x, int32_t *y, int *n_batch, int *lo, int *n,
                           QtError *err) {
    int left = b->d->n - b->cursor;
    if (b->drop_last ? left < b->batch_size : left <= 0) {
        b->epoch++;
        b->cursor = 0;
        batcher_make_order(b);
        left = b->d->n;
    }
    int m = left < b->batch_size ? left : b->batch_size, first, count;
    batcher_part(m, part, parts, &first, &count);
    QtStatus st = dataset_fill_batch(b->d, b->order + b->cursor + first, count, x, y, err);
    if (st != QT_OK) return st;
    if (n_batch) *n_batch = m;
    if (lo) *lo = first;
    if (n) *n = count;
    b->cursor += m;
    return QT_OK;
}

QtStatus batcher_next(Batcher *b, float *x, int32_t *y, int *n, int64_t *epoch_of_batch, QtError *err) {
    QtStatus st = batcher_next_part(b, 0, 1, x, y, n, NULL, NULL, err);
    if (st == QT_OK && epoch_of_batch) *epoch_of_batch = b->epoch;
    return st;
}

void batcher_last_batch(const Batcher *b, int n, const uint32_t **idx, int64_t *epoch) {
    *idx = b->order + b->cursor - n;
    *epoch = b->epoch;
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
    const size_t row = (size_t)d->feat * data_elem_bytes(d->elem), k = (size_t)d->n_targets;
    for (int i = 0; i < cnt; i++) {
        d->labels[i] = d->labels[keep[i]];
        if (d->targets) memmove(d->targets + (size_t)i * k, d->targets + keep[i] * k, k * sizeof *d->targets);
        if (d->pixels && keep[i] != (uint32_t)i)
            memmove(d->pixels + (size_t)i * row, d->pixels + keep[i] * row, row);
    }
    d->n = cnt;
    if (d->file && image_file_keep(d->file, keep, cnt)) keep = NULL; /* now the file's row list */
    free(keep);
    return QT_OK;
}
