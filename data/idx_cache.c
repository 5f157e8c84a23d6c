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
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "dataset.h"
#include "idx_internal.h"

#define CACHE_MAGIC "qtidxc\0\1"
#define CACHE_MAGIC_STEM 6 /* bytes of the magic shared by every version */
#define CACHE_FIXED 48
#define CACHE_CHUNK ((size_t)1 << 20) /* read and CRC a chunk while it is in cache */
#define CACHE_NAME_MAX (IDX_CACHE_PATH_MAX + 320)
#define CACHE_DIR_MODE 0700 /* as the XDG base directory spec asks for directories it creates */

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
 * cache. out->data is NULL only if it cannot be allocated. */
static CacheOutcome cache_read_payload(int fd, uint64_t off, uint32_t crc_want, const uint8_t *hdr, size_t hdr_len,
                                       IdxArray *out, char *why, size_t why_cap) {
    out->data = malloc(out->n_bytes);
    if (!out->data) return CACHE_NOMEM;
    uLong crc = crc32(crc32(0L, Z_NULL, 0), hdr, (uInt)hdr_len);
    for (size_t done = 0; done < out->n_bytes;) {
        size_t n = out->n_bytes - done < CACHE_CHUNK ? out->n_bytes - done : CACHE_CHUNK;
        errno = 0;
        if (!read_at(fd, out->data + done, n, off + done)) {
            snprintf(why, why_cap, "reading it failed after %zu of %zu data bytes: %s", done, out->n_bytes,
                     errno ? strerror(errno) : "it ended early");
            return CACHE_DAMAGED;
        }
        crc = crc32(crc, out->data + done, (uInt)n);
        done += n;
    }
    if ((uint32_t)crc != crc_want) {
        snprintf(why, why_cap, "its CRC-32 is %08lx, its header says %08x", crc, crc_want);
        return CACHE_DAMAGED;
    }
    return CACHE_HIT;
}

/* What the open cache file holds for source k; CACHE_NOMEM when the
 * payload cannot be allocated. */
static CacheOutcome cache_read_file(int fd, const char *name, const SourceKey *k, IdxArray *out, char *why,
                                    size_t why_cap) {
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
    return cache_read_payload(fd, CACHE_FIXED + plen + hdr_len, (uint32_t)get_le(fixed + 28, 4), hdr, hdr_len, out,
                              why, why_cap);
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
    *o = cache_read_file(fd, name, k, out, why, why_cap);
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

/* The cache file's header and IDX header for a; *len gets their length. */
static void cache_header(const SourceKey *k, const IdxArray *a, uint8_t *buf, size_t *len) {
    uint8_t *idx = buf + CACHE_FIXED + strlen(k->path);
    size_t idx_hdr = 4 + 4 * (size_t)a->ndim;
    idx[0] = 0, idx[1] = 0, idx[2] = IDX_TYPE_UBYTE, idx[3] = (uint8_t)a->ndim;
    for (int i = 0; i < a->ndim; i++) {
        uint32_t d = (uint32_t)a->dims[i];
        idx[4 + 4 * i] = (uint8_t)(d >> 24), idx[5 + 4 * i] = (uint8_t)(d >> 16);
        idx[6 + 4 * i] = (uint8_t)(d >> 8), idx[7 + 4 * i] = (uint8_t)d;
    }
    uLong crc = crc32(crc32(0L, Z_NULL, 0), idx, (uInt)idx_hdr);
    for (size_t done = 0; done < a->n_bytes; done += CACHE_CHUNK)
        crc = crc32(crc, a->data + done, (uInt)(a->n_bytes - done < CACHE_CHUNK ? a->n_bytes - done : CACHE_CHUNK));
    memset(buf, 0, CACHE_FIXED);
    memcpy(buf, CACHE_MAGIC, sizeof CACHE_MAGIC - 1);
    put_le(buf + 8, k->size, 8);
    put_le(buf + 16, (uint64_t)k->mtime_s, 8);
    put_le(buf + 24, k->mtime_ns, 4);
    put_le(buf + 28, (uint32_t)crc, 4);
    put_le(buf + 32, idx_hdr + a->n_bytes, 8);
    put_le(buf + 40, strlen(k->path), 4);
    memcpy(buf + CACHE_FIXED, k->path, strlen(k->path));
    *len = CACHE_FIXED + strlen(k->path) + idx_hdr;
}

/* Writes a to `name` through a temporary file, fsync and rename. On failure
 * the temporary file is removed, what[] says which step failed and errno
 * why. */
static bool cache_write(const IdxCache *c, const char *name, const SourceKey *k, const IdxArray *a, char *what,
                        size_t cap) {
    char tmp[CACHE_NAME_MAX + 48];
    if (make_dirs(c->dir, what, cap) != 0) return false;
    /* pid and clock: unique even among processes of different pid namespaces sharing the directory */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%09ld", name, (long)getpid(), (long)ts.tv_nsec);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) {
        snprintf(what, cap, "creating '%s'", tmp);
        return false;
    }
    uint8_t *head = malloc(CACHE_FIXED + sizeof k->path + IDX_HEADER_MAX);
    size_t head_len = 0;
    if (head) cache_header(k, a, head, &head_len);
    else errno = ENOMEM;
    bool ok = head && write_all(fd, head, head_len) && write_all(fd, a->data, a->n_bytes) && fsync(fd) == 0;
    int e = errno;
    free(head);
    ok = close(fd) == 0 && ok;
    if (ok && rename(tmp, name) == 0) return true;
    if (ok) e = errno;
    snprintf(what, cap, "%s '%s'", ok ? "renaming" : "writing", tmp);
    unlink(tmp);
    errno = e;
    return false;
}

/* Writes the cache file, warning (once) if that fails; `damage` is the
 * reason the old copy was not used, if it was damaged. */
static void cache_store(IdxCache *c, const char *name, const SourceKey *k, const IdxArray *a, const char *damage) {
    char what[CACHE_NAME_MAX + 80];
    if (c->write_failed) return;
    if (cache_write(c, name, k, a, what, sizeof what)) {
        c->writes++;
        if (damage)
            cache_warn(c, "data.cache_dir: the cached copy '%s' of '%s' was damaged (%s), so it was not used; it has "
                       "been rebuilt from the gzip file", name, k->path, damage);
        return;
    }
    const char *reason = strerror(errno);
    c->write_failed = true;
    if (damage)
        cache_warn(c, "data.cache_dir: the cached copy '%s' of '%s' was damaged (%s), so it was not used, and it "
                   "cannot be rebuilt (%s: %s); every start inflates the gzip'd data again until data.cache_dir is "
                   "writable (or set to none)", name, k->path, damage, what, reason);
    else
        cache_warn(c, "data.cache_dir: cannot cache the decompressed data in '%s' (%s: %s), so every start inflates "
                   "the gzip'd data again; make that directory writable (or free disk space), or set data.cache_dir "
                   "to a writable directory or to none", c->dir, what, reason);
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
