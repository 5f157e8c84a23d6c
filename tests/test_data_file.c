/* test_data_file.c - images read in place from an uncompressed IDX file
 * (data.storage: file): the same floats, batches and training runs as
 * images held in memory, bit for bit; the choice of auto/memory/file
 * through the cache; files that change under a run; the config key.
 * Registered with the data_cache suite (test_data_cache.c). */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "data/dataset.h"
#include "data/image_file.h"
#include "nn/model.h"
#include "test_data.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/train.h"

#define MINI_DIR "data/fashion-mnist-mini"

void data_file_add_tests(CU_pSuite s, int *failed);

/* ---- helpers -------------------------------------------------------------------- */

/* Writes a plain IDX file of ndim dimensions holding data. */
static void write_idx(const char *path, int ndim, const int *dims, const uint8_t *data) {
    size_t n = 1, hdr = 4 + 4 * (size_t)ndim;
    for (int i = 0; i < ndim; i++) n *= (size_t)dims[i];
    uint8_t *buf = malloc(hdr + n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(buf);
    buf[0] = 0, buf[1] = 0, buf[2] = 8, buf[3] = (uint8_t)ndim;
    for (int i = 0; i < ndim; i++) {
        uint32_t d = (uint32_t)dims[i];
        buf[4 + 4 * i] = (uint8_t)(d >> 24), buf[5 + 4 * i] = (uint8_t)(d >> 16);
        buf[6 + 4 * i] = (uint8_t)(d >> 8), buf[7 + 4 * i] = (uint8_t)d;
    }
    memcpy(buf + hdr, data, n);
    test_file_write(path, buf, hdr + n);
    free(buf);
}

/* <dir>/<prefix>-images-idx3-ubyte (n, side, side) and -labels-idx1-ubyte,
 * plain, pseudo-random bytes and labels 0..9. */
static void write_set(const char *dir, const char *prefix, int n, int side, uint32_t seed) {
    size_t feat = (size_t)side * side;
    uint8_t *px = malloc((size_t)n * feat), *lab = malloc((size_t)n);
    CU_ASSERT_FATAL(px && lab);
    uint32_t s = seed;
    for (size_t i = 0; i < (size_t)n * feat; i++) {
        s = s * 1664525u + 1013904223u;
        px[i] = (uint8_t)(s >> 24);
    }
    for (int i = 0; i < n; i++) lab[i] = (uint8_t)((i * 7 + (int)seed) % 10);
    char path[1024];
    int idims[3] = {n, side, side}, ldims[1] = {n};
    snprintf(path, sizeof path, "%s/%s-images-idx3-ubyte", dir, prefix);
    write_idx(path, 3, idims, px);
    snprintf(path, sizeof path, "%s/%s-labels-idx1-ubyte", dir, prefix);
    write_idx(path, 1, ldims, lab);
    free(px);
    free(lab);
}

/* All of d's floats and labels, malloc'd. */
static float *all_floats(const Dataset *d, int32_t **labels) {
    float *x = malloc(((size_t)d->n * d->feat + 1) * sizeof *x);
    *labels = malloc(((size_t)d->n + 1) * sizeof **labels);
    CU_ASSERT_FATAL(x && *labels);
    QtError err = {0};
    CU_ASSERT_EQUAL(dataset_fill_range(d, 0, d->n, x, *labels, &err), QT_OK);
    return x;
}

/* The same examples, labels, pixel map and floats, bit for bit. */
static void assert_same_set(const Dataset *a, const Dataset *b, const char *what) {
    bool same = a->n == b->n && a->feat == b->feat && a->n_classes == b->n_classes &&
                memcmp(a->shape, b->shape, sizeof a->shape) == 0 &&
                memcmp(&a->pixel_scale, &b->pixel_scale, sizeof(float)) == 0 &&
                memcmp(&a->pixel_shift, &b->pixel_shift, sizeof(float)) == 0;
    if (same && a->n > 0) {
        int32_t *la, *lb;
        float *xa = all_floats(a, &la), *xb = all_floats(b, &lb);
        same = memcmp(xa, xb, (size_t)a->n * a->feat * sizeof *xa) == 0 &&
               memcmp(la, lb, (size_t)a->n * sizeof *la) == 0;
        free(xa), free(xb), free(la), free(lb);
    }
    if (!same) fprintf(stderr, "\n  %s: the file-backed set differs from the one in memory\n", what);
    CU_ASSERT(same);
}

/* Batches of both through fill_batch (repeats, runs, reversals) and three
 * epochs of shuffled batches, then a seek into the middle of epoch 1. */
static void assert_same_batches(const Dataset *a, const Dataset *b) {
    enum { BS = 16, STEPS = 40 };
    size_t feat = (size_t)a->feat;
    float *xa = malloc(BS * feat * sizeof *xa), *xb = malloc(BS * feat * sizeof *xb);
    CU_ASSERT_FATAL(xa && xb);
    int32_t ya[BS], yb[BS];
    QtError err = {0};
    uint32_t idx[BS];
    for (int i = 0; i < BS; i++) idx[i] = (uint32_t)(i < 6 ? i + 3 : i < 9 ? a->n - 1 - i : (i * 37) % a->n);
    idx[BS - 1] = idx[0]; /* a repeat */
    CU_ASSERT_EQUAL(dataset_fill_batch(a, idx, BS, xa, ya, &err), QT_OK);
    CU_ASSERT_EQUAL(dataset_fill_batch(b, idx, BS, xb, yb, &err), QT_OK);
    CU_ASSERT(memcmp(xa, xb, BS * feat * sizeof *xa) == 0 && memcmp(ya, yb, sizeof ya) == 0);
    Batcher ba, bb;
    CU_ASSERT_EQUAL_FATAL(batcher_init(&ba, a, BS, true, false, 11, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(batcher_init(&bb, b, BS, true, false, 11, &err), QT_OK);
    int diff = 0;
    for (int s = 0; s < STEPS; s++) {
        int na = 0, nb = 0;
        int64_t ea = 0, eb = 0;
        if (s == STEPS / 2) { /* a resumed run: both seek to the same place */
            CU_ASSERT_EQUAL(batcher_seek(&ba, 1, a->n / 3, &err), QT_OK);
            CU_ASSERT_EQUAL(batcher_seek(&bb, 1, b->n / 3, &err), QT_OK);
        }
        CU_ASSERT_EQUAL(batcher_next(&ba, xa, ya, &na, &ea, &err), QT_OK);
        CU_ASSERT_EQUAL(batcher_next(&bb, xb, yb, &nb, &eb, &err), QT_OK);
        diff += na != nb || ea != eb || memcmp(xa, xb, (size_t)na * feat * sizeof *xa) != 0 ||
                memcmp(ya, yb, (size_t)na * sizeof *ya) != 0;
    }
    CU_ASSERT(ba.epoch >= 2);
    CU_ASSERT_EQUAL(diff, 0);
    batcher_free(&ba);
    batcher_free(&bb);
    free(xa);
    free(xb);
}

/* ---- file and memory agree ---------------------------------------------------------- */

static void test_file_equals_memory(void) {
    enum { SIDE = 40, N_TRAIN = 300, N_TEST = 50 };
    char *dir = test_tmpdir_new();
    write_set(dir, "train", N_TRAIN, SIDE, 3);
    write_set(dir, "t10k", N_TEST, SIDE, 5);
    const int three[] = {7, 2, 5}, all_rev[] = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0};
    const Transform lists[][4] = {
        {{0}},
        {tf(TRANSFORM_TRANSPOSE)},
        {tf(TRANSFORM_NORMALIZE), tf(TRANSFORM_INVERT)},
        {tf_classes(3, three), tf(TRANSFORM_TRANSPOSE), tf(TRANSFORM_NORMALIZE)},
        {tf_limit(100), tf(TRANSFORM_TRANSPOSE), tf(TRANSFORM_TRANSPOSE), tf(TRANSFORM_INVERT)},
        {tf(TRANSFORM_INVERT), tf_classes(10, all_rev), tf_limit(90), tf(TRANSFORM_TRANSPOSE)},
    };
    const int counts[] = {0, 1, 2, 3, 4, 4};
    const double fractions[] = {0.2, 0.0, 0.25, 0.2, 0.1, 0.3};
    for (size_t l = 0; l < sizeof counts / sizeof counts[0]; l++) {
        Dataset mtr, mte, mval, ftr, fte, fval;
        QtError err = {0};
        CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&mtr, &mte, dir, NULL, DATA_STORAGE_MEMORY, &err),
                              QT_OK);
        CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&ftr, &fte, dir, NULL, DATA_STORAGE_FILE, &err),
                              QT_OK);
        CU_ASSERT(dataset_image_file(&mtr) == NULL && mtr.pixels != NULL);
        CU_ASSERT(dataset_image_file(&ftr) != NULL && ftr.pixels == NULL && fte.pixels == NULL);
        CU_ASSERT(strstr(dataset_image_file(&ftr), "train-images-idx3-ubyte") != NULL);
        CU_ASSERT_EQUAL(dataset_apply_transforms(&mtr, &mte, lists[l], counts[l], &err), QT_OK);
        CU_ASSERT_EQUAL(dataset_apply_transforms(&ftr, &fte, lists[l], counts[l], &err), QT_OK);
        CU_ASSERT_EQUAL(dataset_split_tail(&mtr, &mval, fractions[l], &err), QT_OK);
        CU_ASSERT_EQUAL(dataset_split_tail(&ftr, &fval, fractions[l], &err), QT_OK);
        if (err.status) fprintf(stderr, "\n  list %zu: %s\n", l, err.msg);
        CU_ASSERT(fval.n == 0 ? fval.file == NULL : fval.file != NULL);
        char what[64];
        snprintf(what, sizeof what, "list %zu, training set", l);
        assert_same_set(&mtr, &ftr, what);
        snprintf(what, sizeof what, "list %zu, validation set", l);
        assert_same_set(&mval, &fval, what);
        snprintf(what, sizeof what, "list %zu, test set", l);
        assert_same_set(&mte, &fte, what);
        assert_same_batches(&mtr, &ftr);
        if (mval.n > 0) assert_same_batches(&mval, &fval);
        Dataset *sets[] = {&mtr, &mte, &mval, &ftr, &fte, &fval};
        for (int i = 0; i < 6; i++) dataset_free(sets[i]);
    }
    CU_ASSERT(test_tmpdir_remove(dir));
}

/* A failing transform list leaves a file-backed set as it was. */
static void test_file_transform_error_keeps_set(void) {
    char *dir = test_tmpdir_new();
    write_set(dir, "train", 30, 4, 9);
    Dataset tr, ref;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&tr, NULL, dir, NULL, DATA_STORAGE_FILE, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&ref, NULL, dir, NULL, DATA_STORAGE_MEMORY, &err), QT_OK);
    const int bad[] = {11}; /* out of range */
    Transform list[] = {tf(TRANSFORM_TRANSPOSE), tf_classes(1, bad), tf(TRANSFORM_INVERT)};
    CU_ASSERT_EQUAL(dataset_apply_transforms(&tr, NULL, list, 3, &err), QT_ERR_CONFIG);
    CU_ASSERT(!tr.file->transpose && tr.file->rows == NULL);
    assert_same_set(&ref, &tr, "after a failed transform list");
    dataset_free(&tr);
    dataset_free(&ref);
    CU_ASSERT(test_tmpdir_remove(dir));
}

/* ---- auto, memory and file through the cache ------------------------------------------ */

static void test_storage_choice(void) {
    char *dir = test_tmpdir_new(), *cache = test_path_join(dir, "cache"), *plain = test_path_join(dir, "plain"),
         *blocked = test_path_join(dir, "plain/sub");
    Dataset ref_tr, ref_te, tr, te;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist(&ref_tr, &ref_te, MINI_DIR, &err), QT_OK);
    /* file: the first load inflates and writes the four copies and reads the images in place from them */
    for (int round = 0; round < 2; round++) {
        IdxCache c;
        idx_cache_init(&c, cache);
        CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&tr, &te, MINI_DIR, &c, DATA_STORAGE_FILE, &err),
                              QT_OK);
        CU_ASSERT_EQUAL(c.writes, round == 0 ? 4 : 0);
        CU_ASSERT_EQUAL(c.hits, round == 0 ? 0 : 4);
        CU_ASSERT_STRING_EQUAL(c.warning, "");
        CU_ASSERT(dataset_image_file(&tr) && strncmp(dataset_image_file(&tr), cache, strlen(cache)) == 0);
        CU_ASSERT(dataset_image_file(&te) && strstr(dataset_image_file(&te), "/t10k-images-idx3-ubyte-"));
        assert_same_set(&ref_tr, &tr, "mini training set, file");
        assert_same_set(&ref_te, &te, "mini test set, file");
        dataset_free(&tr);
        dataset_free(&te);
    }
    /* auto: file with a cache, memory without; memory: always memory */
    const struct {
        const char *cache;
        DataStorage storage;
        bool file;
    } cases[] = {
        {cache, DATA_STORAGE_AUTO, true},
        {"none", DATA_STORAGE_AUTO, false},
        {cache, DATA_STORAGE_MEMORY, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        IdxCache c;
        idx_cache_init(&c, cases[i].cache);
        CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&tr, &te, MINI_DIR, &c, cases[i].storage, &err),
                              QT_OK);
        CU_ASSERT_EQUAL(dataset_image_file(&tr) != NULL, cases[i].file);
        CU_ASSERT_EQUAL(dataset_image_file(&te) != NULL, cases[i].file);
        assert_same_set(&ref_tr, &tr, "mini training set");
        dataset_free(&tr);
        dataset_free(&te);
    }
    /* file without an uncompressed copy: an error that says why and what to do */
    IdxCache c;
    idx_cache_init(&c, "none");
    CU_ASSERT_EQUAL(dataset_load_fashion_mnist_stored(&tr, &te, MINI_DIR, &c, DATA_STORAGE_FILE, &err),
                    QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "data.storage is file") && test_msg_has(&err, "data.cache_dir is none") &&
              test_msg_has(&err, "train-images-idx3-ubyte.gz") && test_msg_has(&err, "auto or memory"));
    CU_ASSERT(tr.pixels == NULL && tr.file == NULL && te.file == NULL);
    test_file_write(plain, "", 0);
    idx_cache_init(&c, blocked);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(dataset_load_fashion_mnist_stored(&tr, &te, MINI_DIR, &c, DATA_STORAGE_FILE, &err),
                    QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "no inflated copy") && test_msg_has(&err, "plain/sub"));
    /* ... which auto turns into memory, with the cache's warning */
    idx_cache_init(&c, blocked);
    CU_ASSERT_EQUAL(dataset_load_fashion_mnist_stored(&tr, &te, MINI_DIR, &c, DATA_STORAGE_AUTO, &err), QT_OK);
    CU_ASSERT(tr.pixels != NULL && c.n_warnings > 0);
    dataset_free(&tr);
    dataset_free(&te);
    dataset_free(&ref_tr);
    dataset_free(&ref_te);
    free(cache), free(plain), free(blocked);
    CU_ASSERT(test_tmpdir_remove(dir));
}

/* A damaged cached copy is found by its CRC, reported and rebuilt, also when read in place. */
static void test_storage_damaged_copy(void) {
    char *dir = test_tmpdir_new(), *cache = test_path_join(dir, "cache");
    Dataset ref, tr;
    QtError err = {0};
    IdxCache c;
    idx_cache_init(&c, cache);
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&ref, NULL, MINI_DIR, &c, DATA_STORAGE_MEMORY, &err),
                          QT_OK);
    idx_cache_init(&c, cache);
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&tr, NULL, MINI_DIR, &c, DATA_STORAGE_FILE, &err), QT_OK);
    char copy[IDX_FILE_PATH_MAX];
    snprintf(copy, sizeof copy, "%s", dataset_image_file(&tr));
    dataset_free(&tr);
    int fd = open(copy, O_WRONLY);
    CU_ASSERT_FATAL(fd >= 0);
    struct stat sb;
    CU_ASSERT_FATAL(fstat(fd, &sb) == 0);
    CU_ASSERT(pwrite(fd, "\x55", 1, sb.st_size - 100) == 1);
    close(fd);
    idx_cache_init(&c, cache);
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&tr, NULL, MINI_DIR, &c, DATA_STORAGE_FILE, &err), QT_OK);
    CU_ASSERT(c.writes == 1 && c.hits == 1 && strstr(c.warning, "damaged") && strstr(c.warning, "CRC-32"));
    CU_ASSERT(dataset_image_file(&tr) != NULL);
    assert_same_set(&ref, &tr, "rebuilt copy");
    dataset_free(&tr);
    dataset_free(&ref);
    free(cache);
    CU_ASSERT(test_tmpdir_remove(dir));
}

/* Plain files are held to idx_read's rules before they are read in place. */
static void test_storage_plain_errors(void) {
    char *dir = test_tmpdir_new();
    write_set(dir, "train", 20, 4, 1);
    char *img = test_path_join(dir, "train-images-idx3-ubyte"), *lab = test_path_join(dir, "train-labels-idx1-ubyte");
    Dataset d;
    QtError err = {0};
    /* one byte too many */
    size_t len = 0;
    char *bytes = test_file_read(img, &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(bytes);
    char *longer = malloc(len + 1);
    memcpy(longer, bytes, len);
    longer[len] = 0;
    test_file_write(img, longer, len + 1);
    CU_ASSERT_EQUAL(dataset_load_idx_stored(&d, img, lab, 10, NULL, DATA_STORAGE_FILE, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "1 byte after") && test_msg_has(&err, img));
    /* a labels file given as images */
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(dataset_load_idx_stored(&d, lab, lab, 10, NULL, DATA_STORAGE_AUTO, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "must be 3-D"));
    /* labels that do not match */
    test_file_write(img, bytes, len);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(dataset_load_idx_stored(&d, img, lab, 3, NULL, DATA_STORAGE_FILE, &err), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&err, "out of range") && d.file == NULL);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(dataset_load_idx_stored(&d, img, lab, 10, NULL, (DataStorage)7, &err), QT_ERR_ARG);
    CU_ASSERT_EQUAL(dataset_load_idx_stored(&d, img, lab, 10, NULL, DATA_STORAGE_AUTO, &err), QT_OK);
    CU_ASSERT(dataset_image_file(&d) != NULL && strcmp(dataset_image_file(&d), img) == 0);
    dataset_free(&d);
    free(bytes), free(longer), free(img), free(lab);
    CU_ASSERT(test_tmpdir_remove(dir));
}

/* ---- the cache's copy written as the source is inflated ------------------------------------ */

/* An IDX file of n images of 6 x 6 (bytes i * 13), plus `extra` bytes, gzip'd; its first len bytes only if cut. */
static void write_gz_images(const char *path, int n, int extra, size_t cut) {
    size_t len = 16 + (size_t)n * 36 + (size_t)extra;
    uint8_t *buf = calloc(len, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(buf);
    buf[2] = 8, buf[3] = 3, buf[6] = (uint8_t)(n >> 8), buf[7] = (uint8_t)n, buf[11] = 6, buf[15] = 6;
    for (size_t i = 16; i < len; i++) buf[i] = (uint8_t)(i * 13);
    gzFile f = gzopen(path, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    CU_ASSERT_EQUAL(gzwrite(f, buf, (unsigned)len), (int)len);
    CU_ASSERT_EQUAL(gzclose(f), Z_OK);
    free(buf);
    if (cut) {
        size_t glen = 0;
        char *g = test_file_read(path, &glen);
        CU_ASSERT_FATAL(g && glen > cut);
        test_file_write(path, g, glen - cut);
        free(g);
    }
}

static int count_files(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static void test_storage_streamed_copy(void) {
    char *dir = test_tmpdir_new(), *src = test_path_join(dir, "x-images-idx3-ubyte.gz");
    char *streamed = test_path_join(dir, "streamed"), *held = test_path_join(dir, "held"),
         *full = test_path_join(dir, "full");
    write_gz_images(src, 300, 0, 0);
    IdxArray ref, mem, a;
    IdxFile f;
    IdxCache c;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(idx_read(src, &ref, &err), QT_OK);
    /* written while inflating, then opened in place: the data, and a copy byte for byte as written from memory */
    idx_cache_init(&c, streamed);
    CU_ASSERT_EQUAL_FATAL(idx_open_cached(src, &c, true, &f, &mem, &err), QT_OK);
    CU_ASSERT(f.fd >= 0 && mem.data == NULL && c.writes == 1 && c.hits == 0 && c.warning[0] == '\0');
    CU_ASSERT(f.ndim == 3 && f.dims[0] == 300 && f.dims[1] == 6 && f.n_bytes == ref.n_bytes);
    uint8_t *back = malloc(ref.n_bytes);
    CU_ASSERT(back && pread(f.fd, back, ref.n_bytes, (off_t)f.offset) == (ssize_t)ref.n_bytes);
    CU_ASSERT(back && memcmp(back, ref.data, ref.n_bytes) == 0);
    free(back);
    idx_file_close(&f);
    CU_ASSERT_EQUAL(f.fd, -1);
    idx_cache_init(&c, held);
    CU_ASSERT_EQUAL_FATAL(idx_read_cached(src, &c, &a, &err), QT_OK);
    idx_free(&a);
    DIR *d = opendir(streamed);
    CU_ASSERT_PTR_NOT_NULL_FATAL(d);
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.') continue;
        char *p1 = test_path_join(streamed, e->d_name), *p2 = test_path_join(held, e->d_name);
        size_t n1 = 0, n2 = 0;
        char *b1 = test_file_read(p1, &n1), *b2 = test_file_read(p2, &n2);
        CU_ASSERT(b1 && b2 && n1 == n2 && memcmp(b1, b2, n1) == 0);
        free(b1), free(b2), free(p1), free(p2);
    }
    closedir(d);
    /* a second open is a hit */
    idx_cache_init(&c, streamed);
    CU_ASSERT_EQUAL(idx_open_cached(src, &c, true, &f, &mem, &err), QT_OK);
    CU_ASSERT(f.fd >= 0 && c.hits == 1 && c.writes == 0);
    idx_file_close(&f);

    /* a full disk: the write fails halfway, leaves nothing behind; auto then holds the data in memory */
    struct rlimit old, small;
    getrlimit(RLIMIT_FSIZE, &old);
    small = (struct rlimit){.rlim_cur = 3000, .rlim_max = old.rlim_max};
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &small);
    idx_cache_init(&c, full);
    QtStatus st = idx_open_cached(src, &c, false, &f, &mem, &err);
    IdxCache c2;
    idx_cache_init(&c2, full);
    QtError err2 = {0};
    QtStatus st2 = idx_open_cached(src, &c2, true, &f, &a, &err2);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    CU_ASSERT(st == QT_OK && f.fd == -1 && mem.data && mem.n_bytes == ref.n_bytes &&
              memcmp(mem.data, ref.data, ref.n_bytes) == 0);
    CU_ASSERT(c.write_failed && c.writes == 0 && strstr(c.warning, "File too large"));
    CU_ASSERT(st2 == QT_ERR_CONFIG && test_msg_has(&err2, "File too large") && test_msg_has(&err2, "data.storage"));
    CU_ASSERT(a.data == NULL);
    CU_ASSERT_EQUAL(count_files(full), 0);
    idx_free(&mem);

    /* a damaged source fails as idx_read fails, word for word, and leaves no file */
    const struct {
        int extra;
        size_t cut;
    } bad[] = {{0, 40}, {1, 0}, {5000, 0}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *dmg = test_path_join(dir, "d-images-idx3-ubyte.gz"), *cache = test_path_join(dir, "dmg-cache");
        write_gz_images(dmg, 300, bad[i].extra, bad[i].cut);
        QtError want = {0}, got = {0};
        CU_ASSERT_EQUAL(idx_read(dmg, &a, &want), QT_ERR_FORMAT);
        idx_cache_init(&c, cache);
        CU_ASSERT_EQUAL(idx_open_cached(dmg, &c, false, &f, &mem, &got), QT_ERR_FORMAT);
        CU_ASSERT_STRING_EQUAL(got.msg, want.msg);
        CU_ASSERT(f.fd == -1 && mem.data == NULL && c.writes == 0);
        CU_ASSERT_EQUAL(count_files(cache), 0);
        free(dmg), free(cache);
    }
    idx_free(&ref);
    free(src), free(streamed), free(held), free(full);
    CU_ASSERT(test_tmpdir_remove(dir));
}

/* ---- a file that changes under the run ------------------------------------------------ */

static void test_file_changed_under_run(void) {
    enum { N = 64, SIDE = 8 };
    char *dir = test_tmpdir_new();
    write_set(dir, "train", N, SIDE, 2);
    char *img = test_path_join(dir, "train-images-idx3-ubyte");
    size_t len = 0;
    char *bytes = test_file_read(img, &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(bytes);
    Dataset d;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&d, NULL, dir, NULL, DATA_STORAGE_FILE, &err), QT_OK);
    float x[N * SIDE * SIDE];
    int32_t y[N];
    Batcher b;
    CU_ASSERT_EQUAL_FATAL(batcher_init(&b, &d, 8, true, false, 1, &err), QT_OK);
    CU_ASSERT_EQUAL(batcher_next(&b, x, y, NULL, NULL, &err), QT_OK);

    /* shrunk: the next read says so, names the file and what to do; the batcher stays put */
    CU_ASSERT_FATAL(truncate(img, (off_t)(len / 2)) == 0);
    int cursor = b.cursor;
    CU_ASSERT_EQUAL(batcher_next(&b, x, y, NULL, NULL, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, img) && test_msg_has(&err, "changed while the run was reading it") &&
              test_msg_has(&err, "data.storage: memory") && test_msg_has(&err, "resume"));
    CU_ASSERT_EQUAL(b.cursor, cursor);

    /* truncated between the check and the read: the short read is reported */
    struct stat sb;
    CU_ASSERT_FATAL(stat(img, &sb) == 0);
    d.file->size = (uint64_t)sb.st_size;
    d.file->mtime_s = (int64_t)sb.st_mtim.tv_sec, d.file->mtime_ns = sb.st_mtim.tv_nsec;
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(dataset_fill_range(&d, 0, 8, x, y, &err), QT_OK); /* the first half is still there */
    CU_ASSERT_EQUAL(dataset_fill_range(&d, N - 8, 8, x, y, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, img) && test_msg_has(&err, "truncated while the run was reading it") &&
              test_msg_has(&err, "images 56..63"));

    /* rewritten in place with the same size: the modification time gives it away */
    batcher_free(&b);
    dataset_free(&d);
    test_file_write(img, bytes, len);
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&d, NULL, dir, NULL, DATA_STORAGE_FILE, &err), QT_OK);
    struct timespec old[2] = {{1000000000, 0}, {1000000000, 0}};
    CU_ASSERT_FATAL(utimensat(AT_FDCWD, img, old, 0) == 0);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(dataset_fill_range(&d, 0, 1, x, y, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, "and modified since") && test_msg_has(&err, img));
    /* a file replaced by rename leaves the open one as it was: reading goes on */
    dataset_free(&d);
    test_file_write(img, bytes, len);
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_stored(&d, NULL, dir, NULL, DATA_STORAGE_FILE, &err), QT_OK);
    char *other = test_path_join(dir, "other");
    test_file_write(other, "x", 1);
    CU_ASSERT_FATAL(rename(other, img) == 0);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(dataset_fill_range(&d, 0, N, x, y, &err), QT_OK);
    dataset_free(&d);
    free(bytes), free(img), free(other);
    CU_ASSERT(test_tmpdir_remove(dir));
}

/* ---- training runs ---------------------------------------------------------------------- */

#define RUN_YAML                                                                                   \
    "run: {seed: 3}\n"                                                                             \
    "data:\n"                                                                                      \
    "  dir: " MINI_DIR "\n"                                                                        \
    "  transform: [transpose, normalize, {limit: 600}, invert]\n"                                  \
    "  val_fraction: 0.1\n"                                                                        \
    "model:\n"                                                                                     \
    "  input: [1, 28, 28]\n"                                                                       \
    "  layers:\n"                                                                                  \
    "    - {name: conv1, type: conv2d, out_channels: 4, kernel: 3, padding: 1}\n"                  \
    "    - {type: relu}\n"                                                                         \
    "    - {type: maxpool2d, kernel: 2}\n"                                                         \
    "    - {type: flatten}\n"                                                                      \
    "    - {type: dropout, p: 0.1}\n"                                                              \
    "    - {name: head, type: dense, units: 10}\n"                                                 \
    "train: {steps: 12, batch_size: 16, eval_batch_size: 40, log_every: 4, eval_every: 6,\n"       \
    "        checkpoint_every: 6, optimizer: {name: adamw, lr: 0.01}}\n"

static Config *run_config(const char *dir, const char *name, const char *storage) {
    char out[1024], cache[1024], st[64];
    snprintf(out, sizeof out, "run.out_dir=%s/%s", dir, name);
    snprintf(cache, sizeof cache, "data.cache_dir=%s/cache", dir);
    snprintf(st, sizeof st, "data.storage=%s", storage);
    const char *ov[] = {out, cache, st};
    Config *c = malloc(sizeof *c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    QtStatus s = config_load_string(c, RUN_YAML, "run.yaml", ov, 3, &err);
    if (s != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(s, QT_OK);
    return c;
}

static void load_final(const Config *c, Model *m) {
    char path[1100];
    snprintf(path, sizeof path, "%s/final.h5", c->run.out_dir);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(m, c->model.input_ndim, c->model.input_shape, c->model.layers, c->model.n_layers,
                                     &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(path, m, &err), QT_OK);
}

static void assert_same_run(const Config *a, const TrainResult *ra, const Config *b, const TrainResult *rb) {
    CU_ASSERT(ra->steps == 12 && rb->steps == 12);
    CU_ASSERT(ra->test_loss == rb->test_loss && ra->test_accuracy == rb->test_accuracy);
    CU_ASSERT(ra->val_loss == rb->val_loss && ra->val_accuracy == rb->val_accuracy && ra->val_loss > 0);
    CU_ASSERT(ra->train_loss == rb->train_loss);
    Model ma, mb;
    load_final(a, &ma);
    load_final(b, &mb);
    CU_ASSERT(test_params_equal(&ma, &mb));
    model_free(&ma), model_free(&mb);
    char *xa = test_metrics_rows(a->run.out_dir), *xb = test_metrics_rows(b->run.out_dir);
    CU_ASSERT_FATAL(xa && xb);
    if (strcmp(xa, xb) != 0) fprintf(stderr, "\n  metrics differ:\n%s\n-- vs --\n%s\n", xa, xb);
    CU_ASSERT_STRING_EQUAL(xa, xb);
    free(xa), free(xb);
}

/* The same run with the images in memory, from the file, and started from
 * the file and resumed from memory (the storage may change on a resume). */
static void test_training_file_equals_memory(void) {
    char *dir = test_tmpdir_new();
    Config *a = run_config(dir, "memory", "memory"), *b = run_config(dir, "file", "file"),
           *c = run_config(dir, "mixed", "file"), *c2 = run_config(dir, "mixed", "memory");
    CU_ASSERT_EQUAL(b->data.storage, DATA_STORAGE_FILE);
    TrainOptions o = {.quiet = true}, stop = {.quiet = true, .stop_at_step = 5},
                 resume = {.quiet = true, .resume = "auto"};
    TrainResult ra, rb, rc1, rc2;
    QtError err = {0};
    fflush(stdout);
    CU_ASSERT_EQUAL_FATAL(train_run(a, &o, &ra, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(train_run(b, &o, &rb, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(train_run(c, &stop, &rc1, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(train_run(c2, &resume, &rc2, &err), QT_OK);
    if (err.status) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT(rc1.stopped && rc1.steps == 5);
    assert_same_run(a, &ra, b, &rb);
    assert_same_run(a, &ra, c2, &rc2);
    free(a), free(b), free(c), free(c2);
    CU_ASSERT(test_tmpdir_remove(dir));
}

/* ---- the config key ---------------------------------------------------------------------- */

#define CFG_MODEL "model: {input: [4], layers: [{type: dense, units: 2}]}\n"

static void test_config_storage(void) {
    Config *c = malloc(sizeof *c), *d = malloc(sizeof *d);
    CU_ASSERT_FATAL(c && d);
    QtError e = {0};
    const struct {
        const char *yaml;
        DataStorage want;
    } ok[] = {
        {CFG_MODEL, DATA_STORAGE_AUTO},
        {"data: {storage: auto}\n" CFG_MODEL, DATA_STORAGE_AUTO},
        {"data: {storage: memory}\n" CFG_MODEL, DATA_STORAGE_MEMORY},
        {"data: {storage: FILE}\n" CFG_MODEL, DATA_STORAGE_FILE},
        {"data: {storage: null}\n" CFG_MODEL, DATA_STORAGE_AUTO},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        qt_error_clear(&e);
        QtStatus st = config_load_string(c, ok[i].yaml, "t.yaml", NULL, 0, &e);
        if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        CU_ASSERT_EQUAL(c->data.storage, ok[i].want);
        char *text = config_to_yaml(c);
        CU_ASSERT_PTR_NOT_NULL_FATAL(text);
        char line[64];
        snprintf(line, sizeof line, "  storage: %s\n", data_storage_name(ok[i].want));
        CU_ASSERT_PTR_NOT_NULL(strstr(text, line));
        CU_ASSERT_EQUAL_FATAL(config_load_string(d, text, "emitted", NULL, 0, &e), QT_OK);
        CU_ASSERT_EQUAL(d->data.storage, ok[i].want);
        free(text);
    }
    const char *ov[] = {"data.storage=file"};
    CU_ASSERT_EQUAL(config_load_string(c, CFG_MODEL, "t.yaml", ov, 1, &e), QT_OK);
    CU_ASSERT_EQUAL(c->data.storage, DATA_STORAGE_FILE);
    const struct {
        const char *yaml, *override, *sub1, *sub2;
    } bad[] = {
        {"data: {storage: disk}\n" CFG_MODEL, NULL, "t.yaml:1:17: data.storage", "auto, memory, file"},
        {"data: {storage: [file]}\n" CFG_MODEL, NULL, "data.storage", "string"},
        {CFG_MODEL, "data.storage=mmap", "data.storage", "mmap"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        qt_error_clear(&e);
        const char *o[1] = {bad[i].override};
        CU_ASSERT_EQUAL(config_load_string(c, bad[i].yaml, "t.yaml", o, bad[i].override ? 1 : 0, &e), QT_ERR_CONFIG);
        CU_ASSERT(test_msg_has(&e, bad[i].sub1) && test_msg_has(&e, bad[i].sub2));
    }
    /* where the images are held changes no result, so a resume may change it without a word */
    CU_ASSERT_EQUAL(config_load_string(c, "data: {storage: memory}\n" CFG_MODEL, "t.yaml", NULL, 0, &e), QT_OK);
    CU_ASSERT_EQUAL(config_load_string(d, "data: {storage: file}\n" CFG_MODEL, "t.yaml", NULL, 0, &e), QT_OK);
    char fixed[256], changed[256];
    config_diff_for_resume(c, d, fixed, sizeof fixed, changed, sizeof changed);
    CU_ASSERT(fixed[0] == '\0' && changed[0] == '\0');
    free(c);
    free(d);
}

void data_file_add_tests(CU_pSuite s, int *failed) {
    const struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"file storage: same sets, floats and batches as memory", test_file_equals_memory},
        {"file storage: a failed transform list changes nothing", test_file_transform_error_keeps_set},
        {"storage auto/memory/file through the cache", test_storage_choice},
        {"storage file: a damaged cached copy is rebuilt", test_storage_damaged_copy},
        {"storage file: plain files are checked", test_storage_plain_errors},
        {"storage file: the cache's copy is written while inflating", test_storage_streamed_copy},
        {"storage file: a file changed under the run", test_file_changed_under_run},
        {"storage file: a training run equals memory's, resumed too", test_training_file_equals_memory},
        {"data.storage: values, errors, round trip", test_config_storage},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) *failed = 1;
}
