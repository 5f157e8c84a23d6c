/* augment.c - random image augmentation of training batches (augment.h). */
#include "augment.h"

#include <math.h>
#include <string.h>

#include "base/rng.h"

static const char *const augment_names[AUGMENT_COUNT] = {
    [AUGMENT_RANDOM_CROP] = "random_crop", [AUGMENT_HFLIP] = "hflip", [AUGMENT_RANDOM_ERASE] = "random_erase",
};

const char *augment_kind_name(AugmentKind kind) {
    return (unsigned)kind < AUGMENT_COUNT ? augment_names[kind] : "unknown";
}

QtStatus augment_kind_parse(const char *name, AugmentKind *out, QtError *err) {
    int v = 0;
    QtStatus st = qt_name_lookup("augmentation", name, augment_names, AUGMENT_COUNT, &v, err);
    if (st == QT_OK) *out = (AugmentKind)v;
    return st;
}

void augment_spec_default(AugmentSpec *s, AugmentKind kind) {
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->p = 0.5f;
    if (kind == AUGMENT_RANDOM_ERASE) {
        s->scale[0] = 0.02f, s->scale[1] = 0.33f;
        s->ratio[0] = 0.3f, s->ratio[1] = 3.3f;
    }
}

QtStatus augment_check(const AugmentList *list, int ndim, const int *shape, QtError *err) {
    for (int i = 0; i < list->n; i++) {
        const AugmentSpec *s = &list->items[i];
        const char *name = augment_kind_name(s->kind);
        if (ndim != 3) {
            int feat = 1;
            for (int k = 0; k < ndim; k++) feat *= shape[k];
            return qt_error_set(err, QT_ERR_CONFIG,
                                "data.augment[%d] (%s): the training examples are vectors of %d values, not images "
                                "(C, H, W); augmentation applies to images only, so remove data.augment",
                                i, name, feat);
        }
        if (s->kind != AUGMENT_RANDOM_CROP) continue;
        int h = shape[1], w = shape[2], p = s->padding;
        if (s->size_h > h + 2 * p || s->size_w > w + 2 * p)
            return qt_error_set(err, QT_ERR_CONFIG,
                                "data.augment[%d] (random_crop): size [%d, %d] is larger than the padded image "
                                "[%d, %d] (the images are [%d, %d], padding %d); set size to [%d, %d]",
                                i, s->size_h, s->size_w, h + 2 * p, w + 2 * p, h, w, p, h, w);
        if (s->size_h != h || s->size_w != w)
            return qt_error_set(err, QT_ERR_CONFIG,
                                "data.augment[%d] (random_crop): size [%d, %d] differs from the images' [%d, %d]; "
                                "a crop must keep the input's shape (the model's input is the image), so set size "
                                "to [%d, %d] and use padding for the random shift",
                                i, s->size_h, s->size_w, h, w, h, w);
    }
    return QT_OK;
}

/* The generator of augmentation k of example `index` in epoch `epoch` (augment.h). */
static void augment_rng(Rng *r, uint64_t seed, int64_t epoch, uint32_t index, int k) {
    rng_init(r, seed, RNG_STREAM_AUGMENT + ((uint64_t)epoch << 8));
    r->counter = ((uint64_t)index << 32) + ((uint64_t)k << 24);
}

/* A uniform float in [0, 1) from one block (the other three words go unused: a few blocks per example). */
static float draw_unit(Rng *r) {
    uint32_t b[4];
    rng_next_block(r, b);
    return rng_u32_to_unit(b[0]);
}

/* A uniform double in [lo, hi), as torch's uniform_(lo, hi) from a float in [0, 1). */
static double draw_uniform(Rng *r, double lo, double hi) { return lo + (hi - lo) * (double)draw_unit(r); }

/* The padded-and-cropped image, computed in place as a shift: out[i][j] = in[i + dy][j + dx], 0 outside the
 * image. Rows are visited in the order that reads each source row before it is overwritten. */
static void shift_plane(float *x, int h, int w, int dy, int dx) {
    int j0 = dx < 0 ? -dx : 0, j1 = dx > 0 ? w - dx : w; /* out columns [j0, j1) come from the image */
    for (int t = 0; t < h; t++) {
        int i = dy > 0 ? t : h - 1 - t;
        int si = i + dy;
        float *dst = x + (size_t)i * (size_t)w;
        if (si < 0 || si >= h || j1 <= j0) {
            memset(dst, 0, (size_t)w * sizeof *dst);
            continue;
        }
        memmove(dst + j0, x + (size_t)si * (size_t)w + j0 + dx, (size_t)(j1 - j0) * sizeof *dst);
        memset(dst, 0, (size_t)j0 * sizeof *dst);
        memset(dst + j1, 0, (size_t)(w - j1) * sizeof *dst);
    }
}

static void random_crop(const AugmentSpec *s, Rng *r, const int *shape, float *x) {
    int c = shape[0], h = shape[1], w = shape[2], p = s->padding;
    /* torchvision: top in [0, H + 2p - size_h], left likewise, on the padded image */
    int top = (int)rng_below(r, (uint32_t)(h + 2 * p - s->size_h + 1));
    int left = (int)rng_below(r, (uint32_t)(w + 2 * p - s->size_w + 1));
    int dy = top - p, dx = left - p;
    if (dy == 0 && dx == 0) return;
    for (int k = 0; k < c; k++) shift_plane(x + (size_t)k * (size_t)h * (size_t)w, h, w, dy, dx);
}

static void hflip(const AugmentSpec *s, Rng *r, const int *shape, float *x) {
    if (!(draw_unit(r) < s->p)) return; /* p 0: never; p 1: always (the draw is < 1) */
    size_t rows = (size_t)shape[0] * (size_t)shape[1];
    int w = shape[2];
    for (size_t i = 0; i < rows; i++) {
        float *row = x + i * (size_t)w;
        for (int a = 0, b = w - 1; a < b; a++, b--) {
            float t = row[a];
            row[a] = row[b], row[b] = t;
        }
    }
}

/* torchvision's RandomErasing.get_params: up to 10 tries of an area and a log-uniform aspect ratio whose
 * rounded (half to even, as Python's round) sides fit strictly inside the image; none fitting erases nothing. */
static void random_erase(const AugmentSpec *s, Rng *r, const int *shape, float *x) {
    if (!(draw_unit(r) < s->p)) return;
    int c = shape[0], h = shape[1], w = shape[2];
    double area = (double)h * (double)w;
    double lr0 = log((double)s->ratio[0]), lr1 = log((double)s->ratio[1]);
    for (int attempt = 0; attempt < 10; attempt++) {
        double erase_area = area * draw_uniform(r, s->scale[0], s->scale[1]);
        double aspect = exp(draw_uniform(r, lr0, lr1));
        int eh = (int)nearbyint(sqrt(erase_area * aspect));
        int ew = (int)nearbyint(sqrt(erase_area / aspect));
        if (!(eh < h && ew < w)) continue;
        int i0 = (int)rng_below(r, (uint32_t)(h - eh + 1));
        int j0 = (int)rng_below(r, (uint32_t)(w - ew + 1));
        for (int k = 0; k < c; k++)
            for (int i = i0; i < i0 + eh; i++) {
                float *row = x + ((size_t)k * (size_t)h + (size_t)i) * (size_t)w;
                for (int j = j0; j < j0 + ew; j++) row[j] = s->value;
            }
        return;
    }
}

void augment_batch(const AugmentList *list, uint64_t seed, int64_t epoch, const uint32_t *idx, int n,
                   const int *shape, float *x) {
    size_t feat = (size_t)shape[0] * (size_t)shape[1] * (size_t)shape[2];
    for (int e = 0; e < n; e++) {
        float *img = x + (size_t)e * feat;
        for (int k = 0; k < list->n; k++) {
            const AugmentSpec *s = &list->items[k];
            Rng r;
            augment_rng(&r, seed, epoch, idx[e], k);
            switch (s->kind) {
            case AUGMENT_RANDOM_CROP: random_crop(s, &r, shape, img); break;
            case AUGMENT_HFLIP: hflip(s, &r, shape, img); break;
            case AUGMENT_RANDOM_ERASE: random_erase(s, &r, shape, img); break;
            default: break;
            }
        }
    }
}
