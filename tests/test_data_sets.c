/* test_data_sets.c - the data suite's in-memory data sets: transforms, the
 * validation split, batches and the batcher's epochs and seek. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/dataset.h"
#include "base/rng.h"
#include "test_data.h"
#include "test_util.h"

/* ---- transforms ------------------------------------------------------------ */

/* A data set of n (1, h, w) images with the given bytes and labels. */
static Dataset make_set(int n, int h, int w, const uint8_t *px, const int32_t *labels, int n_classes) {
    Dataset d = {.n = n, .ndim = 3, .shape = {1, h, w}, .feat = h * w, .n_classes = n_classes};
    d.pixels = malloc((size_t)n * h * w);
    d.labels = malloc((size_t)n * sizeof *d.labels);
    memcpy(d.pixels, px, (size_t)n * h * w);
    memcpy(d.labels, labels, (size_t)n * sizeof *d.labels);
    d.pixel_scale = 1.0f / 255.0f;
    return d;
}

/* Six 2x2 training images (labels 0 1 2 0 2 1) and three test images (2 1 0). */
static const uint8_t TRAIN_PX[6 * 4] = {0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110,
                                        120, 130, 140, 150, 160, 170, 180, 190, 200, 210, 220, 230};
static const int32_t TRAIN_LAB[6] = {0, 1, 2, 0, 2, 1};
static const uint8_t TEST_PX[3 * 4] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
static const int32_t TEST_LAB[3] = {2, 1, 0};

static void make_pair(Dataset *tr, Dataset *te) {
    *tr = make_set(6, 2, 2, TRAIN_PX, TRAIN_LAB, 3);
    *te = make_set(3, 2, 2, TEST_PX, TEST_LAB, 3);
}

static void free_pair(Dataset *tr, Dataset *te) {
    dataset_free(tr);
    dataset_free(te);
}

static Transform tf_norm(float mean, float std) {
    return (Transform){.kind = TRANSFORM_NORMALIZE, .stats_given = true, .mean = mean, .std = std};
}

/* Population mean and std of all the floats a data set produces. */
static void float_stats(const Dataset *d, double *mean, double *std) {
    size_t n = (size_t)d->n * d->feat;
    float *x = malloc(n * sizeof *x);
    CU_ASSERT_EQUAL(dataset_fill_range(d, 0, d->n, x, NULL, NULL), QT_OK);
    double s = 0, v = 0;
    for (size_t i = 0; i < n; i++) s += x[i];
    *mean = s / n;
    for (size_t i = 0; i < n; i++) v += (x[i] - *mean) * (x[i] - *mean);
    *std = sqrt(v / n);
    free(x);
}

static void test_transform_pixel_maps(void) {
    Dataset tr, te;
    QtError err = {0};
    make_pair(&tr, &te);
    /* scale to [0,1] then normalize(0.5, 0.25): x = (p/255 - 0.5) / 0.25 */
    Transform list[3] = {tf_norm(0.5f, 0.25f)};
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 1, &err), QT_OK);
    CU_ASSERT(fabsf(tr.pixel_scale - 4.0f / 255.0f) < 1e-9f && fabsf(tr.pixel_shift + 2.0f) < 1e-6f);
    CU_ASSERT(tr.pixel_scale == te.pixel_scale && tr.pixel_shift == te.pixel_shift);
    CU_ASSERT_EQUAL(memcmp(tr.pixels, TRAIN_PX, sizeof TRAIN_PX), 0); /* the bytes stay */
    free_pair(&tr, &te);

    /* invert: x = 1 - p/255; then normalize(0.5, 0.5): x = 1 - 2p/255 */
    make_pair(&tr, &te);
    list[0] = tf(TRANSFORM_INVERT);
    list[1] = tf_norm(0.5f, 0.5f);
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 2, &err), QT_OK);
    float x[6 * 4], want[6 * 4];
    CU_ASSERT_EQUAL(dataset_fill_range(&tr, 0, 6, x, NULL, NULL), QT_OK);
    for (int i = 0; i < 24; i++) want[i] = (float)(1.0 - 2.0 * TRAIN_PX[i] / 255.0);
    ASSERT_ALL_CLOSE(x, want, 24, 1e-6, 1e-6);
    free_pair(&tr, &te);

    /* invert alone */
    make_pair(&tr, &te);
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 1, &err), QT_OK);
    CU_ASSERT(fabsf(tr.pixel_scale + 1.0f / 255.0f) < 1e-9f && tr.pixel_shift == 1.0f);
    free_pair(&tr, &te);

    /* measured: train's floats come out with mean 0, std 1; test gets the same map */
    make_pair(&tr, &te);
    list[0] = tf(TRANSFORM_INVERT);
    list[1] = tf(TRANSFORM_NORMALIZE);
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 2, &err), QT_OK);
    double mean, std;
    float_stats(&tr, &mean, &std);
    CU_ASSERT(fabs(mean) < 1e-6 && fabs(std - 1.0) < 1e-6);
    CU_ASSERT(tr.pixel_scale == te.pixel_scale && tr.pixel_shift == te.pixel_shift);
    /* By hand: bytes 0..230 step 10 have mean 115 and population std
     * 10*sqrt((24^2-1)/12); x = (1 - p/255 - (1 - 115/255)) / (std/255) = (115 - p) / std. */
    double pstd = 10.0 * sqrt((24.0 * 24.0 - 1.0) / 12.0);
    CU_ASSERT(fabs(tr.pixel_scale + 1.0 / pstd) < 1e-7 && fabs(tr.pixel_shift - 115.0 / pstd) < 1e-6);
    free_pair(&tr, &te);

    /* measured after classes: only the kept examples count (labels 1: images 1 and 5) */
    make_pair(&tr, &te);
    const int one[1] = {1};
    list[0] = tf_classes(1, one);
    list[1] = tf(TRANSFORM_NORMALIZE);
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 2, &err), QT_OK);
    /* bytes 40 50 60 70 200 210 220 230: mean 135, population std sqrt(sum (p-135)^2 / 8) */
    double s2 = 0;
    const int kept[8] = {40, 50, 60, 70, 200, 210, 220, 230};
    for (int i = 0; i < 8; i++) s2 += (kept[i] - 135.0) * (kept[i] - 135.0);
    double kstd = sqrt(s2 / 8);
    CU_ASSERT(fabs(tr.pixel_scale - 1.0 / kstd) < 1e-7 && fabs(tr.pixel_shift + 135.0 / kstd) < 1e-6);
    float_stats(&tr, &mean, &std);
    CU_ASSERT(fabs(mean) < 1e-6 && fabs(std - 1.0) < 1e-6);
    free_pair(&tr, &te);
}

static void test_transform_transpose(void) {
    const uint8_t px[2 * 9] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18};
    const uint8_t want[2 * 9] = {1, 4, 7, 2, 5, 8, 3, 6, 9, 10, 13, 16, 11, 14, 17, 12, 15, 18};
    const int32_t lab[2] = {1, 0};
    Dataset d = make_set(2, 3, 3, px, lab, 2);
    QtError err = {0};
    Transform list[2] = {tf(TRANSFORM_TRANSPOSE), tf(TRANSFORM_TRANSPOSE)};
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&d, NULL, list, 1, &err), QT_OK);
    CU_ASSERT_EQUAL(memcmp(d.pixels, want, sizeof want), 0);
    CU_ASSERT(d.labels[0] == 1 && d.labels[1] == 0 && d.pixel_scale == 1.0f / 255.0f);
    /* twice is the identity */
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&d, NULL, list, 2, &err), QT_OK);
    CU_ASSERT_EQUAL(memcmp(d.pixels, want, sizeof want), 0);
    dataset_free(&d);

    /* two channels of 2x2 each transpose on their own */
    const uint8_t px2[8] = {1, 2, 3, 4, 5, 6, 7, 8}, want2[8] = {1, 3, 2, 4, 5, 7, 6, 8};
    d = make_set(1, 2, 4, px2, lab, 2);
    d.shape[0] = 2, d.shape[1] = 2, d.shape[2] = 2;
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&d, NULL, list, 1, &err), QT_OK);
    CU_ASSERT_EQUAL(memcmp(d.pixels, want2, sizeof want2), 0);
    dataset_free(&d);

    /* not square */
    d = make_set(1, 2, 4, px2, lab, 2);
    ASSERT_ERR(dataset_apply_transforms(&d, NULL, list, 1, &err), err, QT_ERR_SHAPE, "2 x 4", "square");
    CU_ASSERT_EQUAL(memcmp(d.pixels, px2, sizeof px2), 0);
    dataset_free(&d);
}

static void test_transform_classes_limit(void) {
    Dataset tr, te;
    QtError err = {0};
    make_pair(&tr, &te);
    /* classes [2, 0]: label 2 -> 0, label 0 -> 1, in the data's order */
    const int c20[2] = {2, 0};
    Transform list[3] = {tf_classes(2, c20)};
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 1, &err), QT_OK);
    CU_ASSERT(tr.n == 4 && tr.n_classes == 2 && te.n == 2 && te.n_classes == 2);
    const int32_t want_lab[4] = {1, 0, 1, 0}; /* train examples 0, 2, 3, 4 */
    CU_ASSERT_EQUAL(memcmp(tr.labels, want_lab, sizeof want_lab), 0);
    CU_ASSERT_EQUAL(memcmp(tr.pixels, TRAIN_PX + 0, 4), 0);
    CU_ASSERT_EQUAL(memcmp(tr.pixels + 4, TRAIN_PX + 8, 8), 0);
    CU_ASSERT_EQUAL(memcmp(tr.pixels + 12, TRAIN_PX + 16, 4), 0);
    CU_ASSERT(te.labels[0] == 0 && te.labels[1] == 1);           /* test examples 0 and 2 */
    CU_ASSERT(te.pixels[0] == 1 && te.pixels[4] == 9);
    /* a second classes counts in the new labels */
    const int c1[1] = {1};
    list[0] = tf_classes(1, c1);
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 1, &err), QT_OK);
    CU_ASSERT(tr.n == 2 && tr.n_classes == 1 && tr.labels[0] == 0 && tr.pixels[4] == 120);
    CU_ASSERT(te.n == 1 && te.pixels[0] == 9);
    free_pair(&tr, &te);

    /* limit applies to each set; a set smaller than the limit is kept whole */
    make_pair(&tr, &te);
    list[0] = tf_limit(4);
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 1, &err), QT_OK);
    CU_ASSERT(tr.n == 4 && te.n == 3 && tr.labels[3] == 0 && tr.pixels[15] == 150);
    list[0] = tf_limit(1);
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 1, &err), QT_OK);
    CU_ASSERT(tr.n == 1 && te.n == 1 && te.labels[0] == 2);
    free_pair(&tr, &te);

    /* order matters: classes [1] then limit 1 keeps train example 1; limit 1 then classes [1] keeps none */
    make_pair(&tr, &te);
    list[0] = tf_classes(1, c1);
    list[1] = tf_limit(1);
    CU_ASSERT_EQUAL_FATAL(dataset_apply_transforms(&tr, &te, list, 2, &err), QT_OK);
    CU_ASSERT(tr.n == 1 && tr.pixels[0] == 40 && te.n == 1 && te.pixels[0] == 5);
    free_pair(&tr, &te);
    make_pair(&tr, &te);
    list[0] = tf_limit(1);
    list[1] = tf_classes(1, c1);
    ASSERT_ERR(dataset_apply_transforms(&tr, &te, list, 2, &err), err, QT_ERR_CONFIG, "classes [1]",
               "leaves no training examples");
    /* a failed list leaves both sets as they were */
    CU_ASSERT(tr.n == 6 && te.n == 3 && tr.n_classes == 3 && memcmp(tr.pixels, TRAIN_PX, sizeof TRAIN_PX) == 0);
    /* limit 2, classes [0]: the training set keeps example 0, the test set (labels 2 1) none */
    const int c0[1] = {0};
    list[0] = tf_limit(2);
    list[1] = tf_classes(1, c0);
    qt_error_clear(&err);
    ASSERT_ERR(dataset_apply_transforms(&tr, &te, list, 2, &err), err, QT_ERR_CONFIG, "classes [0]",
               "leaves no test examples");
    /* without a test set it succeeds */
    CU_ASSERT_EQUAL(dataset_apply_transforms(&tr, NULL, list, 2, &err), QT_OK);
    CU_ASSERT(tr.n == 1 && tr.labels[0] == 0 && tr.n_classes == 1);
    free_pair(&tr, &te);
}

static void test_transform_errors(void) {
    Dataset tr, te;
    QtError err = {0};
    make_pair(&tr, &te);
    const int out_of_range[2] = {0, 3}, dup[3] = {1, 2, 1}, neg[1] = {-1};
    struct {
        Transform t;
        QtStatus want;
        const char *sub1, *sub2;
    } cases[] = {
        {tf_classes(2, out_of_range), QT_ERR_CONFIG, "names class 3", "0..2"},
        {tf_classes(3, dup), QT_ERR_CONFIG, "classes [1, 2, 1]", "twice"},
        {tf_classes(1, neg), QT_ERR_CONFIG, "class -1", NULL},
        {tf_classes(0, neg), QT_ERR_CONFIG, "0 classes", NULL},
        {{.kind = TRANSFORM_CLASSES, .n_classes = 1000}, QT_ERR_CONFIG, "1000 classes", "1 to 256"},
        {tf_limit(0), QT_ERR_CONFIG, "limit = 0", ">= 1"},
        {tf_norm(0.5f, 0.0f), QT_ERR_CONFIG, "std = 0", "> 0"},
        {tf_norm(0.5f, -1.0f), QT_ERR_CONFIG, "std = -1", NULL},
        {tf_norm(NAN, 1.0f), QT_ERR_CONFIG, "mean = nan", NULL},
        {{.kind = TRANSFORM_COUNT}, QT_ERR_ARG, "unknown transform", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        /* after a harmless first transform, so the index in the message is 1 */
        Transform list[2] = {tf(TRANSFORM_INVERT), cases[i].t};
        qt_error_clear(&err);
        ASSERT_ERR(dataset_apply_transforms(&tr, &te, list, 2, &err), err, cases[i].want, cases[i].sub1,
                   cases[i].sub2);
        CU_ASSERT(strstr(err.msg, "data.transform[1]") != NULL);
        CU_ASSERT(tr.n == 6 && tr.pixel_scale == 1.0f / 255.0f && tr.pixel_shift == 0.0f);
    }
    free_pair(&tr, &te);

    /* measured std 0: every training pixel the same */
    uint8_t flat[8];
    memset(flat, 77, sizeof flat);
    const int32_t lab[2] = {0, 1};
    tr = make_set(2, 2, 2, flat, lab, 2);
    Transform norm = tf(TRANSFORM_NORMALIZE);
    qt_error_clear(&err);
    ASSERT_ERR(dataset_apply_transforms(&tr, NULL, &norm, 1, &err), err, QT_ERR_VALUE, "std is 0", "0.30196");
    dataset_free(&tr);
}

/* ---- split and batches ------------------------------------------------------- */

/* n examples of one pixel each, pixel = index, label = index % 3, pixel map
 * the identity, so a batch's floats are the example indices. */
static Dataset make_indexed(int n) {
    Dataset d = {.n = n, .ndim = 3, .shape = {1, 1, 1}, .feat = 1, .n_classes = 3, .pixel_scale = 1.0f};
    d.pixels = malloc((size_t)n);
    d.labels = malloc((size_t)n * sizeof *d.labels);
    for (int i = 0; i < n; i++) d.pixels[i] = (uint8_t)i, d.labels[i] = i % 3;
    return d;
}

static void test_split_tail(void) {
    Dataset d = make_indexed(10), val;
    d.pixel_scale = 0.5f, d.pixel_shift = 0.25f;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_split_tail(&d, &val, 0.25, &err), QT_OK); /* round(2.5) = 3 */
    CU_ASSERT(d.n == 7 && val.n == 3 && val.feat == 1 && val.ndim == 3 && val.n_classes == 3);
    CU_ASSERT(val.pixel_scale == 0.5f && val.pixel_shift == 0.25f);
    CU_ASSERT(val.pixels[0] == 7 && val.pixels[2] == 9 && val.labels[0] == 1 && val.labels[2] == 0);
    CU_ASSERT(d.pixels[6] == 6 && d.labels[6] == 0);
    dataset_free(&val);
    CU_ASSERT_EQUAL(dataset_split_tail(&d, &val, 0.0, &err), QT_OK);
    CU_ASSERT(d.n == 7 && val.n == 0 && val.pixels == NULL && val.feat == 1);
    dataset_free(&val);
    ASSERT_ERR(dataset_split_tail(&d, &val, 1.0, &err), err, QT_ERR_CONFIG, "val_fraction = 1", "[0, 1)");
    qt_error_clear(&err);
    ASSERT_ERR(dataset_split_tail(&d, &val, -0.1, &err), err, QT_ERR_CONFIG, "val_fraction", NULL);
    qt_error_clear(&err);
    ASSERT_ERR(dataset_split_tail(&d, &val, 0.95, &err), err, QT_ERR_CONFIG, "all 7 training examples", NULL);
    CU_ASSERT_EQUAL(d.n, 7);
    dataset_free(&d);
}

static void test_fill_batch_exact(void) {
    uint8_t px[3 * 4];
    for (int i = 0; i < 12; i++) px[i] = (uint8_t)(i * 23);
    const int32_t lab[3] = {4, 5, 6};
    Dataset d = make_set(3, 2, 2, px, lab, 7);
    /* exactly representable, so x must equal 0.5 p - 1 bit for bit */
    d.pixel_scale = 0.5f, d.pixel_shift = -1.0f;
    const uint32_t idx[4] = {2, 0, 2, 1};
    float x[4 * 4], r[3 * 4];
    int32_t y[4], ry[3];
    CU_ASSERT_EQUAL(dataset_fill_batch(&d, idx, 4, x, y, NULL), QT_OK);
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 4; j++) CU_ASSERT_EQUAL(x[i * 4 + j], 0.5f * px[idx[i] * 4 + j] - 1.0f);
        CU_ASSERT_EQUAL(y[i], lab[idx[i]]);
    }
    CU_ASSERT_EQUAL(dataset_fill_range(&d, 1, 2, r, ry, NULL), QT_OK);
    CU_ASSERT_EQUAL(memcmp(r, x + 12, 4 * sizeof(float)), 0); /* example 1 */
    CU_ASSERT_EQUAL(memcmp(r + 4, x, 4 * sizeof(float)), 0);  /* example 2 */
    CU_ASSERT(ry[0] == 5 && ry[1] == 6);
    /* the default 1/255 map */
    d.pixel_scale = 1.0f / 255.0f, d.pixel_shift = 0.0f;
    CU_ASSERT_EQUAL(dataset_fill_range(&d, 0, 3, r, NULL, NULL), QT_OK);
    for (int i = 0; i < 12; i++) CU_ASSERT(fabsf(r[i] - px[i] / 255.0f) <= 1e-7f);
    dataset_free(&d);
}

/* One epoch from b: the indices in order, the batch sizes, the epochs. */
static int drain_epoch(Batcher *b, int steps, int *order, int *sizes, int64_t *epochs) {
    float x[64];
    int32_t y[64];
    int k = 0;
    for (int s = 0; s < steps; s++) {
        int m = 0;
        CU_ASSERT_EQUAL(batcher_next(b, x, y, &m, &epochs[s], NULL), QT_OK);
        sizes[s] = m;
        for (int i = 0; i < m; i++) {
            order[k++] = (int)x[i];
            CU_ASSERT_EQUAL(y[i], (int)x[i] % 3);
        }
    }
    return k;
}

static void test_batcher_epochs(void) {
    enum { N = 50 };
    Dataset d = make_indexed(N);
    QtError err = {0};
    Batcher b;
    int order[2][N], sizes[8];
    int64_t epochs[8];
    /* shuffled, short last batch */
    CU_ASSERT_EQUAL_FATAL(batcher_init(&b, &d, 16, true, false, 7, &err), QT_OK);
    CU_ASSERT_EQUAL(batcher_steps_per_epoch(&b), 4);
    for (int e = 0; e < 2; e++) {
        CU_ASSERT_EQUAL(drain_epoch(&b, 4, order[e], sizes, epochs), N);
        CU_ASSERT(sizes[0] == 16 && sizes[1] == 16 && sizes[2] == 16 && sizes[3] == 2);
        CU_ASSERT(epochs[0] == e && epochs[3] == e);
        int seen[N] = {0}, moved = 0;
        for (int i = 0; i < N; i++) seen[order[e][i]]++, moved += order[e][i] != i;
        for (int i = 0; i < N; i++) CU_ASSERT_EQUAL(seen[i], 1);
        CU_ASSERT(moved > N / 2);
        /* the order is the documented function of (seed, epoch) */
        uint32_t ref[N];
        for (uint32_t i = 0; i < N; i++) ref[i] = i;
        Rng r;
        rng_init(&r, 7, RNG_STREAM_SHUFFLE + ((uint64_t)e << 8));
        rng_shuffle_u32(&r, ref, N);
        int same = 0;
        for (int i = 0; i < N; i++) same += order[e][i] == (int)ref[i];
        CU_ASSERT_EQUAL(same, N);
    }
    CU_ASSERT_NOT_EQUAL(memcmp(order[0], order[1], sizeof order[0]), 0);
    batcher_free(&b);

    /* no shuffle: identity; drop_last: only full batches */
    CU_ASSERT_EQUAL_FATAL(batcher_init(&b, &d, 16, false, true, 7, &err), QT_OK);
    CU_ASSERT_EQUAL(batcher_steps_per_epoch(&b), 3);
    for (int e = 0; e < 2; e++) {
        CU_ASSERT_EQUAL(drain_epoch(&b, 3, order[0], sizes, epochs), 48);
        for (int i = 0; i < 48; i++) CU_ASSERT_EQUAL(order[0][i], i);
        CU_ASSERT(sizes[2] == 16 && epochs[0] == e && epochs[2] == e);
    }
    batcher_free(&b);

    /* a batch larger than the data set without drop_last: one batch of all */
    CU_ASSERT_EQUAL_FATAL(batcher_init(&b, &d, 64, true, false, 1, &err), QT_OK);
    CU_ASSERT_EQUAL(batcher_steps_per_epoch(&b), 1);
    int both[2 * N];
    CU_ASSERT_EQUAL(drain_epoch(&b, 2, both, sizes, epochs), 2 * N);
    CU_ASSERT(sizes[0] == N && sizes[1] == N && epochs[0] == 0 && epochs[1] == 1);
    batcher_free(&b);

    ASSERT_ERR(batcher_init(&b, &d, 0, true, false, 1, &err), err, QT_ERR_CONFIG, "batch_size = 0", NULL);
    qt_error_clear(&err);
    ASSERT_ERR(batcher_init(&b, &d, 51, true, true, 1, &err), err, QT_ERR_CONFIG, "batch_size = 51", "drop_last");
    CU_ASSERT_PTR_NULL(b.order);
    dataset_free(&d);
}

static void test_batcher_seek(void) {
    enum { N = 37, BS = 5, STEPS = 20 };
    Dataset d = make_indexed(N);
    QtError err = {0};
    for (int drop = 0; drop < 2; drop++) {
        /* an uninterrupted run of STEPS batches (a few epochs) */
        Batcher a;
        CU_ASSERT_EQUAL_FATAL(batcher_init(&a, &d, BS, true, drop, 1234, &err), QT_OK);
        float xa[STEPS][BS];
        int ma[STEPS];
        int64_t ea[STEPS], pos_epoch[STEPS];
        int pos_cursor[STEPS];
        for (int s = 0; s < STEPS; s++) {
            pos_epoch[s] = a.epoch, pos_cursor[s] = a.cursor;
            CU_ASSERT_EQUAL(batcher_next(&a, xa[s], NULL, &ma[s], &ea[s], NULL), QT_OK);
        }
        CU_ASSERT(ea[STEPS - 1] >= 2);
        /* resuming from any recorded position continues identically */
        for (int k = 1; k < STEPS; k += 3) {
            Batcher b;
            CU_ASSERT_EQUAL_FATAL(batcher_init(&b, &d, BS, true, drop, 1234, &err), QT_OK);
            CU_ASSERT_EQUAL_FATAL(batcher_seek(&b, pos_epoch[k], pos_cursor[k], &err), QT_OK);
            for (int s = k; s < STEPS; s++) {
                float xb[BS];
                int64_t eb;
                int m = 0;
                CU_ASSERT_EQUAL(batcher_next(&b, xb, NULL, &m, &eb, NULL), QT_OK);
                CU_ASSERT(m == ma[s] && eb == ea[s] && memcmp(xb, xa[s], (size_t)m * sizeof(float)) == 0);
            }
            batcher_free(&b);
        }
        /* a position at the very end of an epoch moves on to the next */
        CU_ASSERT_EQUAL(batcher_seek(&a, 4, N, &err), QT_OK);
        float x[BS];
        int64_t e;
        CU_ASSERT_EQUAL(batcher_next(&a, x, NULL, NULL, &e, NULL), QT_OK);
        CU_ASSERT(e == 5 && a.epoch == 5);
        ASSERT_ERR(batcher_seek(&a, 0, N + 1, &err), err, QT_ERR_VALUE, "cursor 38", "0..37");
        qt_error_clear(&err);
        ASSERT_ERR(batcher_seek(&a, 0, -1, &err), err, QT_ERR_VALUE, "cursor -1", NULL);
        qt_error_clear(&err);
        ASSERT_ERR(batcher_seek(&a, -1, 0, &err), err, QT_ERR_VALUE, "epoch -1", NULL);
        qt_error_clear(&err);
        batcher_free(&a);
    }
    /* another seed, another order */
    Batcher a, b;
    CU_ASSERT_EQUAL_FATAL(batcher_init(&a, &d, N, true, false, 1, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(batcher_init(&b, &d, N, true, false, 2, &err), QT_OK);
    CU_ASSERT_NOT_EQUAL(memcmp(a.order, b.order, N * sizeof *a.order), 0);
    batcher_free(&a);
    batcher_free(&b);
    dataset_free(&d);
}

int data_add_set_tests(CU_pSuite s) {
    struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"transforms: pixel maps", test_transform_pixel_maps},
        {"transforms: transpose", test_transform_transpose},
        {"transforms: classes and limit", test_transform_classes_limit},
        {"transforms: errors", test_transform_errors},
        {"split_tail", test_split_tail},
        {"fill_batch / fill_range", test_fill_batch_exact},
        {"batcher epochs", test_batcher_epochs},
        {"batcher seek", test_batcher_seek},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return 0;
}
