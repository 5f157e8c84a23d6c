/* fuzz_entry_idx.c - the idx target: IDX files, plain and gzip'd, through
 * idx_read, the decompressed cache (idx_read_cached) and dataset_load_idx.
 *
 * Input: a 6-byte header, then the payload.
 *   byte 0  flags: 1 gzip the payload before writing it (then the plain
 *           payload is read too, and both reads must agree); 2 read through
 *           an IdxCache twice (a miss that writes the copy, then a read of the
 *           copy), both equal to the plain read; 4 damage the cached copy
 *           between the two reads; 8 dataset mode: the payload is an images
 *           file and a labels file (split at bytes 4-5) for dataset_load_idx
 *   bytes 1-2  damage offset (big-endian, modulo the copy's size)
 *   byte 3     damage: XOR with this byte, 0 = truncate at the offset
 *   bytes 4-5  dataset mode: length of the images file (big-endian) */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "data/dataset.h"
#include "fuzz_harness.h"

#define FLAG_GZIP 1
#define FLAG_CACHE 2
#define FLAG_DAMAGE 4
#define FLAG_DATASET 8
#define HEADER 6

/* data[size] as a gzip stream (malloc'd into *out), or 1. */
static int gzip_bytes(const uint8_t *data, size_t size, uint8_t **out, size_t *out_size) {
    z_stream z;
    memset(&z, 0, sizeof z);
    if (deflateInit2(&z, Z_BEST_SPEED, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) return 1;
    size_t cap = deflateBound(&z, (uLong)size) + 32;
    *out = malloc(cap);
    if (!*out) {
        deflateEnd(&z);
        return 1;
    }
    z.next_in = (Bytef *)data;
    z.avail_in = (uInt)size;
    z.next_out = *out;
    z.avail_out = (uInt)cap;
    int rc = deflate(&z, Z_FINISH);
    *out_size = cap - z.avail_out;
    deflateEnd(&z);
    if (rc != Z_STREAM_END) {
        free(*out);
        *out = NULL;
        return 1;
    }
    return 0;
}

/* Writes data[size] (gzip'd when asked) to <scratch>/name. */
static int write_payload(const char *name, const uint8_t *data, size_t size, bool gzip, char *path, size_t cap) {
    if (!gzip) return fuzz_write_file(name, data, size, path, cap);
    uint8_t *gz = NULL;
    size_t gz_size = 0;
    if (gzip_bytes(data, size, &gz, &gz_size) != 0) return 1;
    int rc = fuzz_write_file(name, gz, gz_size, path, cap);
    free(gz);
    return rc;
}

static int check_array(const char *what, const IdxArray *a, char *why, size_t why_cap) {
    size_t n = 1;
    bool ok = a->ndim >= 1 && a->ndim <= IDX_MAX_DIMS && a->data;
    for (int i = 0; ok && i < a->ndim; i++) {
        ok = a->dims[i] >= 1;
        n *= (size_t)a->dims[i];
    }
    if (ok && n == a->n_bytes) return 0;
    snprintf(why, why_cap, "%s succeeded with an inconsistent array: ndim %d, n_bytes %zu", what, a->ndim, a->n_bytes);
    return 1;
}

/* Two reads of the same bytes must agree: both fail, or both give the same array. */
static int check_same(const char *what, QtStatus sa, const IdxArray *a, QtStatus sb, const IdxArray *b,
                      const QtError *eb, char *why, size_t why_cap) {
    bool same = sa == sb;
    if (same && sa == QT_OK)
        same = a->ndim == b->ndim && a->n_bytes == b->n_bytes && memcmp(a->dims, b->dims, sizeof a->dims) == 0 &&
               memcmp(a->data, b->data, a->n_bytes) == 0;
    if (same) return 0;
    snprintf(why, why_cap, "%s disagrees with the plain read: status %d vs %d (%s)", what, (int)sb, (int)sa, eb->msg);
    return 1;
}

/* Damages the cache copy in dir (the only file there) as the header asks:
 * XOR one byte, or truncate. */
static void damage_copy(const char *dir, const uint8_t *hdr) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char copy[1024] = "";
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') snprintf(copy, sizeof copy, "%s/%s", dir, e->d_name);
    closedir(d);
    struct stat sb;
    if (!copy[0] || stat(copy, &sb) != 0 || sb.st_size == 0) return;
    off_t at = (off_t)(((unsigned)hdr[1] << 8 | hdr[2]) % (unsigned long)sb.st_size);
    if (hdr[3] == 0) {
        int rc = truncate(copy, at);
        (void)rc; /* a copy that stays whole is a valid test too */
        return;
    }
    FILE *f = fopen(copy, "r+b");
    if (!f) return;
    int c = fseeko(f, at, SEEK_SET) == 0 ? fgetc(f) : EOF;
    if (c != EOF && fseeko(f, at, SEEK_SET) == 0) fputc(c ^ hdr[3], f);
    fclose(f);
}

/* The cached reads of the file at path (a miss, then the copy), each equal to the plain read. */
static int read_cached(const char *path, const uint8_t *hdr, QtStatus plain_st, const IdxArray *plain, char *why,
                       size_t why_cap) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/cache", fuzz_scratch_dir());
    mkdir(dir, 0700);
    fuzz_clear_dir(dir); /* a copy from an earlier input must not count as this one's */
    IdxCache cache;
    idx_cache_init(&cache, dir);
    int bad = 0;
    for (int pass = 0; !bad && pass < 2; pass++) {
        if (pass == 1 && (hdr[0] & FLAG_DAMAGE)) damage_copy(dir, hdr);
        IdxArray a;
        QtError err = {0};
        QtStatus st = idx_read_cached(path, &cache, &a, &err);
        bad = fuzz_check_status(pass ? "idx_read_cached (second read)" : "idx_read_cached", st, &err, why, why_cap);
        if (!bad)
            bad = check_same(pass ? "the second cached read" : "the first cached read", plain_st, plain, st, &a, &err,
                             why, why_cap);
        idx_free(&a);
    }
    /* An undamaged copy of a good gzip'd file is read from the cache the second time. */
    if (!bad && plain_st == QT_OK && (hdr[0] & FLAG_GZIP) && !(hdr[0] & FLAG_DAMAGE) && cache.hits != 1) {
        snprintf(why, why_cap, "the second read of a cached file was not a cache hit (hits %d, writes %d: %s)",
                 cache.hits, cache.writes, cache.warning);
        bad = 1;
    }
    return bad;
}

static int load_dataset(const uint8_t *hdr, const uint8_t *p, size_t n, char *why, size_t why_cap) {
    size_t split = (size_t)hdr[4] << 8 | hdr[5];
    if (split > n) split = n;
    char images[512], labels[512];
    bool gz = hdr[0] & FLAG_GZIP;
    if (write_payload("images.idx", p, split, gz, images, sizeof images) != 0 ||
        write_payload("labels.idx", p + split, n - split, gz, labels, sizeof labels) != 0) {
        snprintf(why, why_cap, "cannot write the scratch IDX files");
        return 1;
    }
    Dataset d;
    QtError err = {0};
    QtStatus st = dataset_load_idx(&d, images, labels, 10, &err);
    int bad = fuzz_check_status("dataset_load_idx", st, &err, why, why_cap);
    for (int i = 0; !bad && st == QT_OK && i < d.n; i++)
        if (d.labels[i] < 0 || d.labels[i] >= d.n_classes) {
            snprintf(why, why_cap, "dataset_load_idx accepted label %d of example %d", (int)d.labels[i], i);
            bad = 1;
        }
    if (st == QT_OK) dataset_free(&d);
    return bad;
}

int fuzz_idx_one(const uint8_t *data, size_t size, char *why, size_t why_cap) {
    uint8_t hdr[HEADER] = {0};
    memcpy(hdr, data, size < HEADER ? size : HEADER);
    const uint8_t *p = size > HEADER ? data + HEADER : data;
    size_t n = size > HEADER ? size - HEADER : 0;
    if (hdr[0] & FLAG_DATASET) return load_dataset(hdr, p, n, why, why_cap);
    char plain_path[512], path[512];
    if (write_payload("plain.idx", p, n, false, plain_path, sizeof plain_path) != 0 ||
        write_payload("input.idx", p, n, hdr[0] & FLAG_GZIP, path, sizeof path) != 0) {
        snprintf(why, why_cap, "cannot write the scratch IDX files");
        return 1;
    }
    IdxArray plain, a;
    QtError perr = {0}, err = {0};
    QtStatus pst = idx_read(plain_path, &plain, &perr);
    int bad = fuzz_check_status("idx_read", pst, &perr, why, why_cap);
    if (!bad && pst == QT_OK) bad = check_array("idx_read", &plain, why, why_cap);
    if (!bad && (hdr[0] & FLAG_GZIP)) {
        QtStatus st = idx_read(path, &a, &err);
        bad = fuzz_check_status("idx_read (gzip)", st, &err, why, why_cap);
        if (!bad) bad = check_same("idx_read of the gzip'd bytes", pst, &plain, st, &a, &err, why, why_cap);
        idx_free(&a);
    }
    if (!bad && (hdr[0] & FLAG_CACHE)) bad = read_cached(path, hdr, pst, &plain, why, why_cap);
    idx_free(&plain);
    return bad;
}
