/* idx_cache.c - decompressed copies of gzip'd IDX files (IdxCache, dataset.h).
 *
 * A cache file is a header, then the IDX file exactly as inflated. Every
 * header field is little-endian:
 *    0  8  magic "qtidxc" 0x00 0x01 (the last byte is the format version)
 *    8  8  size of the source file in bytes
 *   16  8  the source's modification time: seconds
 *   24  4                                  nanoseconds
 *   28  4  CRC-32 (zlib's) of the IDX bytes
 *   32  8  length of the IDX bytes
 *   40  4  length p of the source's absolute path
 *   44  4  zero
 *   48  p  the path, without a NUL
 * 48 + p   the IDX bytes: magic, big-endian dimensions, payload
 *
 * The file name holds a hash of the source's absolute path, and the header
 * the path itself, so two sources never share a copy; size and time decide
 * whether the copy is still that source's. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "dataset.h"
#include "idx_internal.h"
#include "base/fsutil.h"

#define CACHE_MAGIC "qtidxc\0\1"
#define CACHE_MAGIC_STEM 6 /* bytes of the magic shared by every version */
#define CACHE_FIXED 48
#define CACHE_CHUNK ((size_t)1 << 20) /* read and CRC a chunk while it is in cache */
#define CACHE_NAME_MAX IDX_FILE_PATH_MAX
#define CACHE_DIR_MODE 0700 /* as the XDG base directory spec asks for directories it creates */
/* A temp file of a dead writer is removed once this old: processes of another pid namespace share the directory
 * and look dead from here, but a live writer touches its file every moment. */
#define CACHE_STALE_TMP_S 600

/* What identifies one version of a source file. */
typedef struct {
    char path[PATH_MAX]; /* absolute, symlinks resolved */
    uint64_t size;
    int64_t mtime_s;
    uint32_t mtime_ns;
    bool gzip;           /* starts with the gzip magic 1f 8b */
} SourceKey;

typedef enum { CACHE_MISS, CACHE_STALE, CACHE_DAMAGED, CACHE_NOMEM, CACHE_HIT } CacheOutcome;

static void put_le(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static void cache_warn(IdxCache *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void cache_warn(IdxCache *c, const char *fmt, ...) {
    if (c->n_warnings++ > 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->warning, sizeof c->warning, fmt, ap);
    va_end(ap);
}

void idx_cache_init(IdxCache *cache, const char *setting) {
    memset(cache, 0, sizeof *cache);
    if (!setting || strcasecmp(setting, "none") == 0) return;
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int len;
    if (setting[0]) len = snprintf(cache->dir, sizeof cache->dir, "%s", setting);
    else if (xdg && xdg[0] == '/') len = snprintf(cache->dir, sizeof cache->dir, "%s/qtrain", xdg);
    else if (home && home[0]) len = snprintf(cache->dir, sizeof cache->dir, "%s/.cache/qtrain", home);
    else {
        cache_warn(cache, "data.cache_dir: neither XDG_CACHE_HOME nor HOME is set, so there is no default cache "
                   "directory and every start inflates the gzip'd data again; set data.cache_dir to a directory "
                   "(or to none)");
        return;
    }
    if (len < 0 || (size_t)len >= sizeof cache->dir) {
        cache_warn(cache, "data.cache_dir: the cache directory '%.200s...' is longer than %d bytes, so decompressed "
                   "data is not cached; set data.cache_dir to a shorter path", cache->dir, IDX_CACHE_PATH_MAX - 1);
        cache->dir[0] = '\0';
    }
}

/* ---- keys and names -------------------------------------------------------- */

/* The source's identity; false if it cannot be opened (idx_read then says why). */
static bool source_key(const char *path, SourceKey *k) {
    memset(k, 0, sizeof *k);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    struct stat sb;
    uint8_t magic[2] = {0};
    bool ok = fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode);
    ok = ok && pread(fd, magic, 2, 0) >= 0;
    close(fd);
    if (!ok) return false;
    k->size = (uint64_t)sb.st_size;
    k->mtime_s = (int64_t)sb.st_mtim.tv_sec;
    k->mtime_ns = (uint32_t)sb.st_mtim.tv_nsec;
    k->gzip = magic[0] == 0x1f && magic[1] == 0x8b;
    if (!realpath(path, k->path)) snprintf(k->path, sizeof k->path, "%s", path);
    return true;
}

static uint64_t fnv1a64(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* <dir>/<basename without .gz>-<hash>.idx; false if that does not fit. */
static bool cache_file_name(const IdxCache *c, const SourceKey *k, char *out, size_t cap) {
    const char *base = strrchr(k->path, '/');
    base = base ? base + 1 : k->path;
    size_t n = strlen(base);
    if (n > 3 && strcmp(base + n - 3, ".gz") == 0) n -= 3;
    if (n > 200) n = 200;
    int len = snprintf(out, cap, "%s/%.*s-%016llx.idx", c->dir, (int)n, base, (unsigned long long)fnv1a64(k->path));
    return len > 0 && (size_t)len < cap;
}

/* ---- reading ------------------------------------------------------------------ */

/* Reads exactly len bytes at off; false on an error or an early end. */
static bool read_at(int fd, void *buf, size_t len, uint64_t off) {
    size_t done = 0;
    while (done < len) {
        ssize_t r = pread(fd, (uint8_t *)buf + done, len - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        done += (size_t)r;
    }
    return true;
}

/* Checks the IDX header at `off` exactly as idx_read checks a file's, and
 * that header and payload make exactly idx_len bytes. why gets the reason
 * for a damaged copy. */
static CacheOutcome cache_check_idx_header(int fd, const char *name, uint64_t off, uint64_t idx_len, IdxArray *out,
                                           uint8_t *hdr, size_t *hdr_len, char *why, size_t why_cap) {
    size_t got = idx_len < IDX_HEADER_MAX ? (size_t)idx_len : IDX_HEADER_MAX;
    errno = 0;
    if (!read_at(fd, hdr, got, off)) {
        snprintf(why, why_cap, "cannot read its IDX header: %s", errno ? strerror(errno) : "it ends early");
        return CACHE_DAMAGED;
    }
    QtError e = {0};
    int ndim = 0;
    uint64_t n_elems = 0;
    if (idx_check_magic(hdr, got, name, &ndim, &e) != QT_OK) {
        snprintf(why, why_cap, "%s", e.msg);
        return CACHE_DAMAGED;
    }
    *hdr_len = 4 + 4 * (size_t)ndim;
    if (got < *hdr_len) {
        snprintf(why, why_cap, "its IDX data of %llu bytes ends inside the IDX header", (unsigned long long)idx_len);
        return CACHE_DAMAGED;
    }
    if (idx_decode_dims(hdr + 4, ndim, name, out, &n_elems, &e) != QT_OK) {
        snprintf(why, why_cap, "%s", e.msg);
        return CACHE_DAMAGED;
    }
    if (*hdr_len + n_elems != idx_len) {
        snprintf(why, why_cap, "its IDX header announces %llu bytes of data, but %llu follow",
                 (unsigned long long)n_elems, (unsigned long long)(idx_len - *hdr_len));
        return CACHE_DAMAGED;
    }
    out->n_bytes = (size_t)n_elems;
    return CACHE_HIT;
}

/* Reads the payload in chunks, each CRC'd while it is still in the CPU's
 * cache: into out->data, or (in_place) through one chunk-sized buffer that
 * is freed again, only to check the CRC. CACHE_NOMEM if a buffer cannot be
 * allocated. */
static CacheOutcome cache_read_payload(int fd, uint64_t off, uint32_t crc_want, const uint8_t *hdr, size_t hdr_len,
                                       bool in_place, IdxArray *out, char *why, size_t why_cap) {
    size_t cap = in_place ? (out->n_bytes < CACHE_CHUNK ? out->n_bytes : CACHE_CHUNK) : out->n_bytes;
    uint8_t *buf = malloc(cap > 0 ? cap : 1);
    if (!buf) return CACHE_NOMEM;
    if (!in_place) out->data = buf;
    CacheOutcome o = CACHE_HIT;
    uLong crc = crc32(crc32(0L, Z_NULL, 0), hdr, (uInt)hdr_len);
    for (size_t done = 0; done < out->n_bytes;) {
        size_t n = out->n_bytes - done < CACHE_CHUNK ? out->n_bytes - done : CACHE_CHUNK;
        uint8_t *dst = in_place ? buf : buf + done;
        errno = 0;
        if (!read_at(fd, dst, n, off + done)) {
            snprintf(why, why_cap, "reading it failed after %zu of %zu data bytes: %s", done, out->n_bytes,
                     errno ? strerror(errno) : "it ended early");
            o = CACHE_DAMAGED;
            break;
        }
        crc = crc32(crc, dst, (uInt)n);
        done += n;
    }
    if (in_place) free(buf);
    if (o == CACHE_HIT && (uint32_t)crc != crc_want) {
        snprintf(why, why_cap, "its CRC-32 is %08lx, its header says %08x", crc, crc_want);
        o = CACHE_DAMAGED;
    }
    return o;
}

/* What the open cache file holds for source k; CACHE_NOMEM when the
 * payload cannot be allocated. in_place: only check it (out->data stays
 * NULL); *data_off gets the file offset of the payload. */
static CacheOutcome cache_read_file(int fd, const char *name, const SourceKey *k, bool in_place, IdxArray *out,
                                    uint64_t *data_off, char *why, size_t why_cap) {
    struct stat sb;
    uint8_t fixed[CACHE_FIXED], hdr[IDX_HEADER_MAX];
    char stored[PATH_MAX];
    uint64_t file_len = 0, plen = 0, idx_len = 0;
    size_t hdr_len = 0;
    errno = 0;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        snprintf(why, why_cap, "it is not a regular file");
        return CACHE_DAMAGED;
    }
    file_len = (uint64_t)sb.st_size;
    if (file_len < CACHE_FIXED || !read_at(fd, fixed, CACHE_FIXED, 0) || memcmp(fixed, CACHE_MAGIC, CACHE_MAGIC_STEM)) {
        snprintf(why, why_cap, "it does not start with a qtrain cache header");
        return CACHE_DAMAGED;
    }
    if (memcmp(fixed, CACHE_MAGIC, sizeof CACHE_MAGIC - 1) != 0) return CACHE_STALE; /* another format version */
    plen = get_le(fixed + 40, 4);
    idx_len = get_le(fixed + 32, 8);
    if (plen >= sizeof stored) {
        snprintf(why, why_cap, "its header gives the source path a length of %llu bytes", (unsigned long long)plen);
        return CACHE_DAMAGED;
    }
    if (CACHE_FIXED + plen > file_len || !read_at(fd, stored, (size_t)plen, CACHE_FIXED)) {
        snprintf(why, why_cap, "it is truncated inside its header (%llu bytes)", (unsigned long long)file_len);
        return CACHE_DAMAGED;
    }
    stored[plen] = '\0';
    if (strcmp(stored, k->path) != 0 || get_le(fixed + 8, 8) != k->size ||
        (int64_t)get_le(fixed + 16, 8) != k->mtime_s || get_le(fixed + 24, 4) != k->mtime_ns)
        return CACHE_STALE;
    uint64_t want = CACHE_FIXED + plen + idx_len;
    if (file_len != want) {
        snprintf(why, why_cap, "it is %s: %llu bytes long, its header announces %llu",
                 file_len < want ? "truncated" : "too long", (unsigned long long)file_len, (unsigned long long)want);
        return CACHE_DAMAGED;
    }
    CacheOutcome o = cache_check_idx_header(fd, name, CACHE_FIXED + plen, idx_len, out, hdr, &hdr_len, why, why_cap);
    if (o != CACHE_HIT) return o;
    *data_off = CACHE_FIXED + plen + hdr_len;
    return cache_read_payload(fd, *data_off, (uint32_t)get_le(fixed + 28, 4), hdr, hdr_len, in_place, out, why,
                              why_cap);
}

/* What the cache file holds for source k in *o: a hit fills out (owned by
 * the caller); a damaged copy gets its reason in why. QT_ERR_NOMEM is the
 * only error. */
static QtStatus cache_read(const char *name, const SourceKey *k, IdxArray *out, CacheOutcome *o, char *why,
                           size_t why_cap, QtError *err) {
    memset(out, 0, sizeof *out);
    *o = CACHE_MISS;
    int fd = open(name, O_RDONLY | O_CLOEXEC);
    if (fd < 0 && (errno == ENOENT || errno == ENOTDIR)) return QT_OK;
    *o = CACHE_DAMAGED;
    if (fd < 0) {
        snprintf(why, why_cap, "it cannot be opened: %s", strerror(errno));
        return QT_OK;
    }
    uint64_t data_off = 0;
    *o = cache_read_file(fd, name, k, false, out, &data_off, why, why_cap);
    close(fd);
    if (*o == CACHE_HIT) return QT_OK;
    QtStatus st = QT_OK;
    if (*o == CACHE_NOMEM)
        st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %zu bytes for the IDX data of '%s'", out->n_bytes,
                          k->path);
    idx_free(out);
    return st;
}

/* ---- writing ------------------------------------------------------------------ */

/* mkdir -p with CACHE_DIR_MODE; on failure what[] says which directory. */
static int make_dirs(const char *path, char *what, size_t cap) {
    char buf[IDX_CACHE_PATH_MAX];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1;; p++) {
        char c = *p;
        if (c != '/' && c != '\0') continue;
        *p = '\0';
        if (mkdir(buf, CACHE_DIR_MODE) != 0 && errno != EEXIST) {
            snprintf(what, cap, "creating '%s'", buf);
            return -1;
        }
        *p = c;
        if (c == '\0') break;
    }
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) return 0;
    if (errno == 0 || errno == EEXIST) errno = ENOTDIR;
    snprintf(what, cap, "creating '%s'", path);
    return -1;
}

static bool write_all(int fd, const uint8_t *buf, size_t len) {
    while (len > 0) {
        ssize_t w = write(fd, buf, len);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        buf += w, len -= (size_t)w;
    }
    return true;
}

/* The cache file's header for source k and IDX data of shape a, its IDX
 * header hdr[0..hdr_len-1] included, CRC field 0; *len gets its length. */
static void cache_header(const SourceKey *k, const IdxArray *a, const uint8_t *hdr, size_t hdr_len, uint8_t *buf,
                         size_t *len) {
    size_t plen = strlen(k->path);
    memset(buf, 0, CACHE_FIXED);
    memcpy(buf, CACHE_MAGIC, sizeof CACHE_MAGIC - 1);
    put_le(buf + 8, k->size, 8);
    put_le(buf + 16, (uint64_t)k->mtime_s, 8);
    put_le(buf + 24, k->mtime_ns, 4);
    put_le(buf + 32, hdr_len + a->n_bytes, 8);
    put_le(buf + 40, plen, 4);
    memcpy(buf + CACHE_FIXED, k->path, plen);
    memcpy(buf + CACHE_FIXED + plen, hdr, hdr_len);
    *len = CACHE_FIXED + plen + hdr_len;
}

/* A cache file being written, to a temporary name that is renamed once the
 * file is complete and fsync'd. On failure what[] says which step failed
 * and err_no why. */
typedef struct {
    const IdxCache *c;
    const char *name;
    const SourceKey *k;
    char tmp[CACHE_NAME_MAX + 48];
    int fd;                         /* -1 before begin */
    uint8_t head[CACHE_FIXED + PATH_MAX + IDX_HEADER_MAX];
    size_t head_len;
    uLong crc;                      /* of the IDX bytes so far */
    char what[CACHE_NAME_MAX + 80];
    int err_no;
} CacheWriter;

/* Drops a file that will not be finished. */
static void writer_abort(CacheWriter *w) {
    if (w->fd < 0) return;
    close(w->fd);
    unlink(w->tmp);
    w->fd = -1;
}

static bool writer_fail(CacheWriter *w, const char *step) {
    w->err_no = errno;
    snprintf(w->what, sizeof w->what, "%s '%s'", step, w->tmp);
    writer_abort(w);
    return false;
}

static bool writer_begin(void *ctx, const IdxArray *shape, const uint8_t *hdr, size_t hdr_len) {
    CacheWriter *w = ctx;
    if (make_dirs(w->c->dir, w->what, sizeof w->what) != 0) {
        w->err_no = errno;
        return false;
    }
    fs_remove_stale_tmps_of(w->name, CACHE_STALE_TMP_S); /* those of writers that crashed or were killed */
    /* pid and clock: unique even among processes of different pid namespaces sharing the directory */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(w->tmp, sizeof w->tmp, "%s.tmp.%ld.%09ld", w->name, (long)getpid(), (long)ts.tv_nsec);
    cache_header(w->k, shape, hdr, hdr_len, w->head, &w->head_len);
    /* The inflated copy must fit in the free space: else it is not begun
     * (the data is then read into memory), rather than filling the disk. */
    struct statvfs fs;
    uint64_t need = w->head_len + shape->n_bytes;
    if (statvfs(w->c->dir, &fs) == 0 && (uint64_t)fs.f_bavail * fs.f_frsize < need) {
        w->err_no = ENOSPC;
        snprintf(w->what, sizeof w->what, "the inflated copy of '%.300s' needs %llu bytes, the file system of the "
                 "cache directory has %llu free", w->k->path, (unsigned long long)need,
                 (unsigned long long)fs.f_bavail * fs.f_frsize);
        return false;
    }
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (w->fd < 0) return writer_fail(w, "creating");
    w->crc = crc32(crc32(0L, Z_NULL, 0), hdr, (uInt)hdr_len);
    return write_all(w->fd, w->head, w->head_len) || writer_fail(w, "writing");
}

static bool writer_data(void *ctx, const uint8_t *p, size_t n) {
    CacheWriter *w = ctx;
    for (size_t done = 0; done < n; done += CACHE_CHUNK)
        w->crc = crc32(w->crc, p + done, (uInt)(n - done < CACHE_CHUNK ? n - done : CACHE_CHUNK));
    return write_all(w->fd, p, n) || writer_fail(w, "writing");
}

/* The CRC into the header, fsync, rename. */
static bool writer_finish(CacheWriter *w) {
    put_le(w->head + 28, (uint32_t)w->crc, 4);
    if (pwrite(w->fd, w->head, CACHE_FIXED, 0) != CACHE_FIXED || fsync(w->fd) != 0) return writer_fail(w, "writing");
    int fd = w->fd;
    w->fd = -1;
    const char *step = close(fd) != 0 ? "writing" : rename(w->tmp, w->name) != 0 ? "renaming" : NULL;
    if (!step) return true;
    w->err_no = errno;
    snprintf(w->what, sizeof w->what, "%s '%s'", step, w->tmp);
    unlink(w->tmp);
    return false;
}

static void writer_init(CacheWriter *w, const IdxCache *c, const char *name, const SourceKey *k) {
    memset(w, 0, sizeof *w);
    w->c = c, w->name = name, w->k = k, w->fd = -1;
}

/* Writes a to `name` through a temporary file, fsync and rename. */
static bool cache_write(CacheWriter *w, const IdxArray *a) {
    uint8_t hdr[IDX_HEADER_MAX];
    idx_encode_header(a, hdr);
    return writer_begin(w, a, hdr, 4 + 4 * (size_t)a->ndim) && writer_data(w, a->data, a->n_bytes) &&
           writer_finish(w);
}

/* Counts a written copy, or warns (once) that writing failed; `damage` is
 * the reason the old copy was not used, if it was damaged. */
static void cache_note_store(IdxCache *c, const CacheWriter *w, bool written, const char *damage) {
    if (written) {
        c->writes++;
        if (damage)
            cache_warn(c, "data.cache_dir: the cached copy '%s' of '%s' was damaged (%s), so it was not used; it has "
                       "been rebuilt from the gzip file", w->name, w->k->path, damage);
        return;
    }
    const char *reason = strerror(w->err_no);
    c->write_failed = true;
    if (damage)
        cache_warn(c, "data.cache_dir: the cached copy '%s' of '%s' was damaged (%s), so it was not used, and it "
                   "cannot be rebuilt (%s: %s); every start inflates the gzip'd data again until data.cache_dir is "
                   "writable (or set to none)", w->name, w->k->path, damage, w->what, reason);
    else
        cache_warn(c, "data.cache_dir: cannot cache the decompressed data in '%s' (%s: %s), so every start inflates "
                   "the gzip'd data again; make that directory writable (or free disk space), or set data.cache_dir "
                   "to a writable directory or to none", c->dir, w->what, reason);
}

/* Writes the cache file from a. True if written. */
static bool cache_store(IdxCache *c, const char *name, const SourceKey *k, const IdxArray *a, const char *damage) {
    if (c->write_failed) return false;
    CacheWriter w;
    writer_init(&w, c, name, k);
    bool ok = cache_write(&w, a);
    cache_note_store(c, &w, ok, damage);
    return ok;
}

/* Writes the cache file straight from the source as it is inflated, never
 * holding its data. The source's errors are errors (as idx_read's); a
 * write that fails only warns and leaves *written false. */
static QtStatus cache_store_streamed(IdxCache *c, const char *name, const SourceKey *k, const char *path,
                                     const char *damage, bool *written, QtError *err) {
    *written = false;
    if (c->write_failed) return QT_OK;
    CacheWriter *w = malloc(sizeof *w);
    if (!w) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the cache writer for '%s'", path);
    writer_init(w, c, name, k);
    IdxSink sink = {writer_begin, writer_data, w};
    bool refused = false;
    QtStatus st = idx_stream(path, &sink, &refused, err);
    if (st != QT_OK) writer_abort(w);
    else {
        *written = !refused && writer_finish(w);
        cache_note_store(c, w, *written, damage);
    }
    free(w);
    return st;
}

QtStatus idx_read_cached(const char *path, IdxCache *cache, IdxArray *out, QtError *err) {
    SourceKey k;
    char name[CACHE_NAME_MAX], why[QT_ERROR_MSG_MAX] = "";
    if (!cache || !cache->dir[0] || !path || !source_key(path, &k) || !k.gzip) return idx_read(path, out, err);
    if (!cache_file_name(cache, &k, name, sizeof name)) {
        cache_warn(cache, "data.cache_dir: the cache file name for '%s' in '%s' is too long a path; that file is not "
                   "cached", k.path, cache->dir);
        return idx_read(path, out, err);
    }
    CacheOutcome o;
    QtStatus st = cache_read(name, &k, out, &o, why, sizeof why, err);
    if (st != QT_OK) return st;
    if (o == CACHE_HIT) {
        cache->hits++;
        return QT_OK;
    }
    if ((st = idx_read(path, out, err)) == QT_OK) cache_store(cache, name, &k, out, o == CACHE_DAMAGED ? why : NULL);
    return st;
}

/* ---- reading in place ------------------------------------------------------------ */

void idx_file_close(IdxFile *f) {
    if (!f) return;
    if (f->fd >= 0 && f->path[0]) close(f->fd); /* a path: opened by idx_open_cached, not a zeroed struct */
    memset(f, 0, sizeof *f);
    f->fd = -1;
}

static void idx_file_set(IdxFile *f, int fd, const char *path, const IdxArray *a, uint64_t offset) {
    f->fd = fd;
    snprintf(f->path, sizeof f->path, "%s", path);
    f->ndim = a->ndim;
    memcpy(f->dims, a->dims, sizeof f->dims);
    f->offset = offset;
    f->n_bytes = a->n_bytes;
}

/* A plain IDX file opened in place after the checks idx_read makes; false
 * (nothing open) if it is not a regular file or fails one of them, and
 * idx_read then says why. */
static bool plain_open_in_place(const char *path, IdxFile *file) {
    if (strlen(path) >= sizeof file->path) return false;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    struct stat sb;
    IdxArray a = {0};
    uint8_t hdr[IDX_HEADER_MAX];
    size_t hdr_len = 0;
    char why[QT_ERROR_MSG_MAX];
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) ||
        cache_check_idx_header(fd, path, 0, (uint64_t)sb.st_size, &a, hdr, &hdr_len, why, sizeof why) != CACHE_HIT) {
        close(fd);
        return false;
    }
    idx_file_set(file, fd, path, &a, hdr_len);
    return true;
}

/* Opens the cache file `name` in place if it holds source k's data, checked
 * as cache_read checks it (the CRC too); *o says what it holds. */
static QtStatus cache_open_in_place(const char *name, const SourceKey *k, IdxFile *file, CacheOutcome *o, char *why,
                                    size_t why_cap, QtError *err) {
    *o = CACHE_MISS;
    int fd = open(name, O_RDONLY | O_CLOEXEC);
    if (fd < 0 && (errno == ENOENT || errno == ENOTDIR)) return QT_OK;
    *o = CACHE_DAMAGED;
    if (fd < 0) {
        snprintf(why, why_cap, "it cannot be opened: %s", strerror(errno));
        return QT_OK;
    }
    IdxArray a = {0};
    uint64_t off = 0;
    *o = cache_read_file(fd, name, k, true, &a, &off, why, why_cap);
    if (*o == CACHE_HIT) {
        idx_file_set(file, fd, name, &a, off);
        return QT_OK;
    }
    close(fd);
    if (*o == CACHE_NOMEM) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate a read buffer for '%s'", name);
    return QT_OK;
}

static QtStatus require_file_fail(const char *path, const char *why, QtError *err) {
    return qt_error_set(err, QT_ERR_CONFIG,
                        "data.storage is file, but IDX file '%s' %s, so its images can only be held in memory; set "
                        "data.storage to auto or memory, or give the data uncompressed (gunzip the files, or let "
                        "data.cache_dir keep an inflated copy)",
                        path, why);
}

/* A gzip'd source with a cache: its copy, written first if need be. */
static QtStatus cache_open(const char *path, const SourceKey *k, IdxCache *cache, bool require_file, IdxFile *file,
                           IdxArray *mem, QtError *err) {
    char name[CACHE_NAME_MAX], why[QT_ERROR_MSG_MAX] = "";
    CacheOutcome o = CACHE_MISS;
    bool named = cache_file_name(cache, k, name, sizeof name);
    if (!named)
        cache_warn(cache, "data.cache_dir: the cache file name for '%s' in '%s' is too long a path; that file is not "
                   "cached", k->path, cache->dir);
    QtStatus st = named ? cache_open_in_place(name, k, file, &o, why, sizeof why, err) : QT_OK;
    if (st != QT_OK) return st;
    if (o == CACHE_HIT) {
        cache->hits++;
        return QT_OK;
    }
    bool written = false;
    if (named) {
        /* streamed, so the data is never held, not even on the first start */
        st = cache_store_streamed(cache, name, k, path, o == CACHE_DAMAGED ? why : NULL, &written, err);
        if (st != QT_OK) return st;
    }
    if (written) {
        /* read back as any later start would, so this run uses exactly what those will */
        st = cache_open_in_place(name, k, file, &o, why, sizeof why, err);
        if (st != QT_OK || o == CACHE_HIT) return st;
    }
    if (!require_file) return idx_read(path, mem, err);
    const char *w = cache->warning[0] ? cache->warning : why, *prefix = "data.cache_dir: ";
    if (strncmp(w, prefix, strlen(prefix)) == 0) w += strlen(prefix);
    char reason[QT_ERROR_MSG_MAX + 64];
    snprintf(reason, sizeof reason, "is gzip'd and no inflated copy of it could be kept in data.cache_dir (%.900s)", w);
    return require_file_fail(path, reason, err);
}

QtStatus idx_open_cached(const char *path, IdxCache *cache, bool require_file, IdxFile *file, IdxArray *mem,
                         QtError *err) {
    memset(file, 0, sizeof *file);
    file->fd = -1;
    memset(mem, 0, sizeof *mem);
    if (!path || !*path) return qt_error_set(err, QT_ERR_ARG, "idx_open_cached: no file name");
    SourceKey k;
    bool known = source_key(path, &k);
    if (known && k.gzip) {
        if (cache && cache->dir[0]) return cache_open(path, &k, cache, require_file, file, mem, err);
        if (require_file) return require_file_fail(path, "is gzip'd and data.cache_dir is none", err);
        return idx_read(path, mem, err);
    }
    if (known && plain_open_in_place(path, file)) return QT_OK;
    /* missing, not a regular file, or failing a check: idx_read says which */
    QtStatus st = idx_read(path, mem, err);
    if (st != QT_OK || !require_file) return st;
    idx_free(mem);
    return require_file_fail(path, "cannot be read in place (it is not a regular file)", err);
}
