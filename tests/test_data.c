/* test_data.c - IDX reading and data sets; their transforms, the split and
 * batches are test_data_sets.c's, in the same suite. */
#define _GNU_SOURCE /* unshare */
#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "data/dataset.h"
#include "test_data.h"
#include "test_util.h"

/* What data/make_fashion_mnist_mini.py writes. */
#define MINI_DIR "data/fashion-mnist-mini"
#define MINI_TRAIN 2400
#define MINI_TEST 1000

/* ---- temporary files ------------------------------------------------------ */

typedef struct {
    char *dir;
    char *paths[32]; /* handed out by tmp_path, freed by tmp_close */
    int n;
} TmpDir;

static bool tmp_open(TmpDir *t) {
    memset(t, 0, sizeof *t);
    t->dir = test_tmpdir_new();
    return t->dir != NULL;
}

/* The path of `name` in the directory, valid until tmp_close. */
static const char *tmp_path(TmpDir *t, const char *name) { return t->paths[t->n++] = test_path_join(t->dir, name); }

/* Writes bytes to `name`, through zlib's gzip writer if gz. */
static const char *tmp_write(TmpDir *t, const char *name, const void *bytes, size_t len, bool gz) {
    const char *p = tmp_path(t, name);
    if (!gz) {
        test_file_write(p, bytes, len);
        return p;
    }
    gzFile f = gzopen(p, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    if (len) CU_ASSERT_EQUAL(gzwrite(f, bytes, (unsigned)len), (int)len);
    CU_ASSERT_EQUAL(gzclose(f), Z_OK);
    return p;
}

static void tmp_close(TmpDir *t) {
    for (int i = 0; i < t->n; i++) free(t->paths[i]);
    CU_ASSERT(test_tmpdir_remove(t->dir));
}

/* An IDX file image in buf: magic, big-endian dims, payload. Returns its length. */
static size_t idx_image(uint8_t *buf, int type, int ndim, const uint32_t *dims, const uint8_t *payload, size_t len) {
    size_t k = 0;
    buf[k++] = 0, buf[k++] = 0, buf[k++] = (uint8_t)type, buf[k++] = (uint8_t)ndim;
    for (int i = 0; i < ndim; i++) {
        buf[k++] = (uint8_t)(dims[i] >> 24), buf[k++] = (uint8_t)(dims[i] >> 16);
        buf[k++] = (uint8_t)(dims[i] >> 8), buf[k++] = (uint8_t)dims[i];
    }
    if (len) memcpy(buf + k, payload, len);
    return k + len;
}

/* ---- idx_read -------------------------------------------------------------- */

static void test_idx_roundtrip(void) {
    TmpDir t;
    CU_ASSERT_FATAL(tmp_open(&t));
    uint8_t payload[2 * 3 * 4], buf[256];
    for (int i = 0; i < 24; i++) payload[i] = (uint8_t)(i * 37 + 5);
    const uint32_t dims[3] = {2, 3, 4};
    size_t len = idx_image(buf, 0x08, 3, dims, payload, sizeof payload);
    for (int gz = 0; gz < 2; gz++) {
        const char *p = tmp_write(&t, gz ? "a.idx.gz" : "a.idx", buf, len, gz);
        IdxArray a;
        QtError err = {0};
        CU_ASSERT_EQUAL_FATAL(idx_read(p, &a, &err), QT_OK);
        CU_ASSERT_EQUAL(a.ndim, 3);
        CU_ASSERT(a.dims[0] == 2 && a.dims[1] == 3 && a.dims[2] == 4);
        CU_ASSERT_EQUAL(a.n_bytes, 24);
        CU_ASSERT_EQUAL(memcmp(a.data, payload, 24), 0);
        idx_free(&a);
        CU_ASSERT_PTR_NULL(a.data);
    }
    /* 1-D and 4-D, and a payload past the first 1 MB allocation. */
    const uint32_t one[1] = {5}, four[4] = {1, 2, 1, 3};
    len = idx_image(buf, 0x08, 1, one, payload, 5);
    IdxArray a;
    QtError err = {0};
    CU_ASSERT_EQUAL(idx_read(tmp_write(&t, "b", buf, len, false), &a, &err), QT_OK);
    CU_ASSERT(a.ndim == 1 && a.dims[0] == 5 && memcmp(a.data, payload, 5) == 0);
    idx_free(&a);
    len = idx_image(buf, 0x08, 4, four, payload, 6);
    CU_ASSERT_EQUAL(idx_read(tmp_write(&t, "c", buf, len, true), &a, &err), QT_OK);
    CU_ASSERT(a.ndim == 4 && a.dims[3] == 3 && a.n_bytes == 6);
    idx_free(&a);
    enum { BIG = 3000000 };
    uint8_t *big = malloc(BIG + 16);
    const uint32_t bdims[2] = {1000, 3000};
    for (int i = 0; i < BIG; i++) big[12 + i] = (uint8_t)(i % 251);
    idx_image(big, 0x08, 2, bdims, NULL, 0);
    CU_ASSERT_EQUAL(idx_read(tmp_write(&t, "big.gz", big, BIG + 12, true), &a, &err), QT_OK);
    CU_ASSERT(a.n_bytes == BIG && memcmp(a.data, big + 12, BIG) == 0);
    idx_free(&a);
    free(big);
    tmp_close(&t);
}

typedef struct {
    const char *name;
    bool gz;
    uint8_t bytes[64];
    size_t len;
    QtStatus want;
    const char *sub1, *sub2; /* in the message, besides the file name */
} BadIdx;

static void test_idx_bad_inputs(void) {
    TmpDir t;
    CU_ASSERT_FATAL(tmp_open(&t));
    const BadIdx cases[] = {
        {"wrong-magic", false, {1, 2, 8, 1, 0, 0, 0, 1, 7}, 9, QT_ERR_FORMAT, "not an IDX file", "01 02 08 01"},
        {"float-type", false, {0, 0, 0x0D, 1, 0, 0, 0, 1, 0, 0, 0, 0}, 12, QT_ERR_FORMAT, "32-bit float",
         "only unsigned-byte"},
        {"int-type.gz", true, {0, 0, 0x0C, 1, 0, 0, 0, 1, 0, 0, 0, 0}, 12, QT_ERR_FORMAT, "32-bit integer", NULL},
        {"ndim0", false, {0, 0, 8, 0}, 4, QT_ERR_FORMAT, "0 dimensions", NULL},
        {"ndim5", false, {0, 0, 8, 5}, 4, QT_ERR_FORMAT, "5 dimensions", NULL},
        {"zero-dim", false, {0, 0, 8, 2, 0, 0, 0, 3, 0, 0, 0, 0}, 12, QT_ERR_FORMAT, "dimension 1 is 0", NULL},
        {"huge-dims", false, {0, 0, 8, 2, 0x7f, 0xff, 0xff, 0xff, 0x7f, 0xff, 0xff, 0xff, 1, 2, 3}, 15,
         QT_ERR_FORMAT, "2^31", NULL},
        /* A 2^31 - 16 byte promise in a 12-byte file: must fail without allocating it. */
        {"hostile", false, {0, 0, 8, 1, 0x7f, 0xff, 0xff, 0xf0, 1, 2, 3, 4}, 12, QT_ERR_FORMAT,
         "2147483632 bytes", "only 4"},
        {"short-header", false, {0, 0, 8, 3, 0, 0, 0, 2}, 8, QT_ERR_FORMAT, "ends inside its header", NULL},
        {"truncated", false, {0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5}, 17, QT_ERR_FORMAT, "6 bytes",
         "only 5"},
        {"truncated.gz", true, {0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5}, 17, QT_ERR_FORMAT, "6 bytes",
         "only 5"},
        {"trailing", false, {0, 0, 8, 1, 0, 0, 0, 2, 1, 2, 3, 4, 5}, 13, QT_ERR_FORMAT, "3 bytes after", NULL},
        {"trailing.gz", true, {0, 0, 8, 1, 0, 0, 0, 2, 1, 2, 3}, 11, QT_ERR_FORMAT, "1 byte after", NULL},
        /* A gzip header, then a deflate block of the reserved type 3. */
        {"corrupt.gz", false, {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 0xff, 0xff, 0xff, 0xff}, 14, QT_ERR_FORMAT,
         "not a valid gzip stream", "zlib: invalid block type"},
        {"empty", false, {0}, 0, QT_ERR_FORMAT, "is empty", NULL},
        {"empty.gz", true, {0}, 0, QT_ERR_FORMAT, "is empty", NULL},
        {"tiny", false, {0, 0}, 2, QT_ERR_FORMAT, "only 2 bytes", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const BadIdx *c = &cases[i];
        const char *p = tmp_write(&t, c->name, c->bytes, c->len, c->gz);
        IdxArray a;
        QtError err = {0};
        QtStatus st = idx_read(p, &a, &err);
        ASSERT_ERR(st, err, c->want, c->sub1, c->sub2);
        CU_ASSERT(strstr(err.msg, p) != NULL);
        CU_ASSERT(a.data == NULL && a.ndim == 0);
    }

    /* A missing file. */
    IdxArray a;
    QtError err = {0};
    const char *missing = tmp_path(&t, "missing-idx1-ubyte.gz");
    ASSERT_ERR(idx_read(missing, &a, &err), err, QT_ERR_IO, "No such file", "dataset-fashion-mnist");
    CU_ASSERT(strstr(err.msg, missing) != NULL);

    /* A good gzip file cut in the middle of its stream, and one with a bad CRC. */
    enum { N = 4000 };
    uint8_t *buf = malloc(N + 16);
    const uint32_t dims[1] = {N};
    for (int i = 0; i < N; i++) buf[8 + i] = (uint8_t)(i * i);
    size_t len = idx_image(buf, 0x08, 1, dims, NULL, 0) + N;
    const char *good = tmp_write(&t, "good.gz", buf, len, true);
    FILE *f = fopen(good, "rb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    uint8_t gzbytes[8192];
    size_t gzlen = fread(gzbytes, 1, sizeof gzbytes, f);
    fclose(f);
    CU_ASSERT_FATAL(gzlen > 100 && gzlen < sizeof gzbytes);
    const char *cut = tmp_write(&t, "cut.gz", gzbytes, gzlen / 2, false);
    qt_error_clear(&err);
    ASSERT_ERR(idx_read(cut, &a, &err), err, QT_ERR_FORMAT, "truncated", "zlib: unexpected end of file");
    CU_ASSERT(strstr(err.msg, cut) != NULL);
    gzbytes[gzlen - 8] ^= 0x55; /* the CRC-32 of the trailer */
    const char *crc = tmp_write(&t, "crc.gz", gzbytes, gzlen, false);
    qt_error_clear(&err);
    ASSERT_ERR(idx_read(crc, &a, &err), err, QT_ERR_FORMAT, "not a valid gzip stream", "zlib: incorrect data check");
    CU_ASSERT(strstr(err.msg, crc) != NULL);
    free(buf);
    tmp_close(&t);
}

/* A gzip'd IDX file: header for dims, then `payload` bytes (byte i = i * 131
 * if varied, else 0), written in 1 MB pieces. */
static const char *write_gz_stream(TmpDir *t, const char *name, int ndim, const uint32_t *dims, size_t payload,
                                   bool varied) {
    const char *p = tmp_path(t, name);
    gzFile f = gzopen(p, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    uint8_t hdr[4 + 4 * 4];
    size_t hlen = idx_image(hdr, 0x08, ndim, dims, NULL, 0);
    CU_ASSERT_EQUAL(gzwrite(f, hdr, (unsigned)hlen), (int)hlen);
    enum { PIECE = 1 << 20 };
    uint8_t *piece = calloc(PIECE, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(piece);
    for (size_t done = 0; done < payload;) {
        size_t n = payload - done < PIECE ? payload - done : PIECE;
        for (size_t i = 0; varied && i < n; i++) piece[i] = (uint8_t)((done + i) * 131u);
        CU_ASSERT_EQUAL_FATAL(gzwrite(f, piece, (unsigned)n), (int)n);
        done += n;
    }
    free(piece);
    CU_ASSERT_EQUAL(gzclose(f), Z_OK);
    return p;
}

static int count_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += e->d_name[0] != '.';
    if (d) closedir(d);
    return d ? n : -1;
}

/* Decompression bombs: a small gzip whose header declares 196 MB of zeros
 * is refused before anything is inflated (into memory or the cache); one
 * whose stream inflates far past its declared 1000 bytes is refused after
 * at most 64 MB of counting, holding only the declared bytes; a stream
 * shorter than its header is the usual truncation error. */
static void test_idx_decompression_bomb(void) {
    TmpDir t;
    CU_ASSERT_FATAL(tmp_open(&t));
    const uint32_t big[3] = {250000, 28, 28}, small[3] = {10, 10, 10}, some[3] = {1000, 28, 28};
    const char *bomb = write_gz_stream(&t, "bomb-idx3-ubyte.gz", 3, big, (size_t)250000 * 28 * 28, false);
    IdxArray a;
    QtError err = {0};
    ASSERT_ERR(idx_read(bomb, &a, &err), err, QT_ERR_FORMAT, "declares 196000000 bytes of data (250000 x 28 x 28)",
               "decompression bomb");
    CU_ASSERT(strstr(err.msg, bomb) != NULL);
    CU_ASSERT(a.data == NULL);
    /* through a cache: refused the same way, nothing written */
    const char *cache_dir = tmp_path(&t, "cache");
    IdxCache cache;
    idx_cache_init(&cache, cache_dir);
    IdxFile file;
    qt_error_clear(&err);
    ASSERT_ERR(idx_open_cached(bomb, &cache, false, &file, &a, &err), err, QT_ERR_FORMAT, "decompression bomb", NULL);
    CU_ASSERT(count_files(cache_dir) <= 0);
    /* more than declared: at most IDX_TRAILING_COUNT_MAX counted, the sizes named */
    const char *more = write_gz_stream(&t, "more-idx3-ubyte.gz", 3, small, 1000 + ((size_t)80 << 20), false);
    qt_error_clear(&err);
    ASSERT_ERR(idx_read(more, &a, &err), err, QT_ERR_FORMAT, "at least 67108864 bytes after the 1000 bytes",
               "header or the file is damaged");
    CU_ASSERT(strstr(err.msg, more) != NULL);
    /* less than declared: truncated */
    const char *less = write_gz_stream(&t, "less-idx3-ubyte.gz", 3, some, 1000, true);
    qt_error_clear(&err);
    ASSERT_ERR(idx_read(less, &a, &err), err, QT_ERR_FORMAT, "truncated", "promises 784000 bytes of data, only 1000");
    tmp_close(&t);
}

/* The inflated copy must fit the cache directory's free space: on a 1 MB
 * tmpfs a 2 MB file is not cached (a warning naming both sizes; no temp
 * file), and the data loads from memory. The tmpfs needs a mount namespace
 * (root); without one the test says it is skipped. */
static void test_idx_cache_free_space(void) {
    TmpDir t;
    CU_ASSERT_FATAL(tmp_open(&t));
    const uint32_t dims[1] = {2u << 20};
    const char *src = write_gz_stream(&t, "two-mb-idx1-ubyte.gz", 1, dims, 2u << 20, true);
    const char *mnt = tmp_path(&t, "small");
    CU_ASSERT_FATAL(mkdir(mnt, 0700) == 0);
    int pipefd[2];
    CU_ASSERT_FATAL(pipe(pipefd) == 0);
    fflush(NULL);
    pid_t pid = fork();
    CU_ASSERT_FATAL(pid >= 0);
    if (pid == 0) {
        close(pipefd[0]);
        char msg[1200] = "";
        int code = 0;
        if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
            mount("tmpfs", mnt, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m") != 0) {
            snprintf(msg, sizeof msg, "no private tmpfs (%s)", strerror(errno));
            code = 77;
        } else {
            IdxCache cache;
            idx_cache_init(&cache, mnt);
            IdxFile file;
            IdxArray a;
            QtError err = {0};
            QtStatus st = idx_open_cached(src, &cache, false, &file, &a, &err);
            bool in_memory = st == QT_OK && a.data && a.n_bytes == (2u << 20) && file.fd < 0;
            snprintf(msg, sizeof msg, "%s", st == QT_OK ? cache.warning : err.msg);
            code = !in_memory ? 1 : count_files(mnt) != 0 ? 2 : cache.writes != 0 ? 3 : 0;
            idx_free(&a);
            idx_file_close(&file);
        }
        ssize_t w = write(pipefd[1], msg, strlen(msg));
        (void)w;
        _exit(code);
    }
    close(pipefd[1]);
    char msg[1200] = "";
    ssize_t n = read(pipefd[0], msg, sizeof msg - 1);
    msg[n > 0 ? n : 0] = '\0';
    close(pipefd[0]);
    int status = 0;
    CU_ASSERT(waitpid(pid, &status, 0) == pid && WIFEXITED(status));
    if (WEXITSTATUS(status) == 77) {
        test_skip("%s", msg);
    } else {
        CU_ASSERT_EQUAL(WEXITSTATUS(status), 0);
        CU_ASSERT(strstr(msg, "needs 20") && strstr(msg, "bytes, the file system of the cache directory has"));
        CU_ASSERT(strstr(msg, src) != NULL);
        if (WEXITSTATUS(status) != 0 || !strstr(msg, "needs 20")) fprintf(stderr, "\n  %s\n", msg);
    }
    tmp_close(&t);
}

/* ---- loading ------------------------------------------------------------- */

/* Writes an images file (n, h, w) and a labels file (m,) in t. */
static void write_pair(TmpDir *t, const char *img_name, const char *lab_name, int n, int h, int w, int m,
                       const uint8_t *labels, bool gz) {
    uint8_t buf[1024], px[512];
    for (int i = 0; i < n * h * w; i++) px[i] = (uint8_t)(3 * i + 1);
    const uint32_t idims[3] = {(uint32_t)n, (uint32_t)h, (uint32_t)w}, ldims[1] = {(uint32_t)m};
    tmp_write(t, img_name, buf, idx_image(buf, 0x08, 3, idims, px, (size_t)(n * h * w)), gz);
    tmp_write(t, lab_name, buf, idx_image(buf, 0x08, 1, ldims, labels, (size_t)m), gz);
}

static void test_dataset_load_idx(void) {
    TmpDir t;
    CU_ASSERT_FATAL(tmp_open(&t));
    const uint8_t labels[4] = {2, 0, 1, 7};
    write_pair(&t, "img", "lab", 3, 2, 3, 3, labels, false);
    char img[128], lab[128];
    snprintf(img, sizeof img, "%s/img", t.dir);
    snprintf(lab, sizeof lab, "%s/lab", t.dir);
    Dataset d;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_load_idx(&d, img, lab, 3, &err), QT_OK);
    CU_ASSERT(d.n == 3 && d.ndim == 3 && d.shape[0] == 1 && d.shape[1] == 2 && d.shape[2] == 3 && d.feat == 6);
    CU_ASSERT(d.n_classes == 3 && d.labels[0] == 2 && d.labels[1] == 0 && d.labels[2] == 1);
    CU_ASSERT(d.pixels[0] == 1 && d.pixels[17] == 52);
    CU_ASSERT_EQUAL(d.pixel_scale, 1.0f / 255.0f);
    CU_ASSERT_EQUAL(d.pixel_shift, 0.0f);
    dataset_free(&d);
    CU_ASSERT_PTR_NULL(d.pixels);

    /* label 2 >= 2 classes */
    ASSERT_ERR(dataset_load_idx(&d, img, lab, 2, &err), err, QT_ERR_VALUE, "label 2 of example 0", lab);
    CU_ASSERT_PTR_NULL(d.pixels);
    /* three images, four labels */
    write_pair(&t, "img4", "lab4", 3, 2, 3, 4, labels, false);
    char lab4[128];
    snprintf(lab4, sizeof lab4, "%s/lab4", t.dir);
    qt_error_clear(&err);
    ASSERT_ERR(dataset_load_idx(&d, img, lab4, 8, &err), err, QT_ERR_FORMAT, "holds 3 images", "holds 4 labels");
    CU_ASSERT(strstr(err.msg, img) && strstr(err.msg, lab4));
    /* the files swapped: labels are not 3-D */
    qt_error_clear(&err);
    ASSERT_ERR(dataset_load_idx(&d, lab, img, 8, &err), err, QT_ERR_FORMAT, "must be 3-D", lab);
    /* an images file given as labels */
    qt_error_clear(&err);
    ASSERT_ERR(dataset_load_idx(&d, img, img, 8, &err), err, QT_ERR_FORMAT, "must be 1-D", img);
    qt_error_clear(&err);
    ASSERT_ERR(dataset_load_idx(&d, img, lab, 0, &err), err, QT_ERR_ARG, "n_classes", NULL);
    tmp_close(&t);
}

static void test_fashion_mnist_mini(void) {
    Dataset tr, te;
    QtError err = {0};
    QtStatus st = dataset_load_fashion_mnist(&tr, &te, MINI_DIR, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT_EQUAL(tr.n, MINI_TRAIN);
    CU_ASSERT_EQUAL(te.n, MINI_TEST);
    const Dataset *sets[2] = {&tr, &te};
    for (int s = 0; s < 2; s++) {
        const Dataset *d = sets[s];
        CU_ASSERT(d->ndim == 3 && d->shape[0] == 1 && d->shape[1] == 28 && d->shape[2] == 28 && d->feat == 784);
        CU_ASSERT_EQUAL(d->n_classes, 10);
        int counts[10] = {0}, bad = 0, lo = 255, hi = 0;
        for (int i = 0; i < d->n; i++) {
            if (d->labels[i] < 0 || d->labels[i] > 9) bad++;
            else counts[d->labels[i]]++;
        }
        for (size_t i = 0; i < (size_t)d->n * 784; i++) lo = d->pixels[i] < lo ? d->pixels[i] : lo;
        for (size_t i = 0; i < (size_t)d->n * 784; i++) hi = d->pixels[i] > hi ? d->pixels[i] : hi;
        CU_ASSERT_EQUAL(bad, 0);
        for (int c = 0; c < 10; c++) CU_ASSERT(counts[c] > d->n / 20); /* every class is there */
        CU_ASSERT(lo == 0 && hi == 255);
    }
    dataset_free(&tr);
    dataset_free(&te);
    /* test may be NULL */
    CU_ASSERT_EQUAL(dataset_load_fashion_mnist(&tr, NULL, MINI_DIR, &err), QT_OK);
    CU_ASSERT_EQUAL(tr.n, MINI_TRAIN);
    dataset_free(&tr);
}

static void test_fashion_mnist_files(void) {
    TmpDir t;
    CU_ASSERT_FATAL(tmp_open(&t));
    Dataset tr, te;
    QtError err = {0};
    /* An empty directory: the message names the file and the package. */
    ASSERT_ERR(dataset_load_fashion_mnist(&tr, &te, t.dir, &err), err, QT_ERR_IO, "train-images-idx3-ubyte.gz",
               "dataset-fashion-mnist");
    CU_ASSERT(strstr(err.msg, t.dir) != NULL);
    /* Plain files under the names without .gz are found too. */
    const uint8_t labels[4] = {9, 0, 3, 1};
    write_pair(&t, "train-images-idx3-ubyte", "train-labels-idx1-ubyte", 4, 2, 2, 4, labels, false);
    write_pair(&t, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 2, 2, 2, 2, labels, false);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist(&tr, &te, t.dir, &err), QT_OK);
    CU_ASSERT(tr.n == 4 && te.n == 2 && tr.labels[0] == 9 && te.labels[1] == 0 && tr.n_classes == 10);
    dataset_free(&tr);
    dataset_free(&te);
    /* A test set of another image size. */
    write_pair(&t, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 2, 3, 3, 2, labels, true);
    ASSERT_ERR(dataset_load_fashion_mnist(&tr, &te, t.dir, &err), err, QT_ERR_FORMAT, "3 x 3", "2 x 2");
    CU_ASSERT(tr.pixels == NULL && te.pixels == NULL);
    tmp_close(&t);
}

int register_data_suite(void) {
    CU_pSuite s = CU_add_suite("data", NULL, NULL);
    if (!s) return -1;
    struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"idx_read plain and gzip'd", test_idx_roundtrip},
        {"idx_read rejects bad files", test_idx_bad_inputs},
        {"IDX decompression bomb: refused by the declared size", test_idx_decompression_bomb},
        {"IDX cache: an inflated copy larger than the free space is not written", test_idx_cache_free_space},
        {"dataset_load_idx", test_dataset_load_idx},
        {"fashion-mnist-mini", test_fashion_mnist_mini},
        {"fashion-mnist file names", test_fashion_mnist_files},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return data_add_set_tests(s);
}
