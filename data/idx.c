/* idx.c - IDX files (the MNIST format), gzip'd or plain.
 *
 * Layout: magic 0x00 0x00 <type> <ndim>, then ndim big-endian uint32
 * dimensions, then the elements in row-major order. zlib's gz* functions
 * read a plain file as-is, so one reader serves both. */
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <zlib.h>

#include "dataset.h"
#include "idx_internal.h"

/* The first allocation is at most this; the buffer then doubles as data
 * actually arrives, so a header that lies about its size costs nothing. */
#define IDX_FIRST_ALLOC ((size_t)1 << 20)
#define IDX_READ_CHUNK ((unsigned)1 << 20)
/* How far past the payload to count trailing bytes before saying "at least". */
#define IDX_TRAILING_COUNT_MAX ((uint64_t)1 << 26)
/* A gzip'd IDX file may declare at most this many times its own size, once
 * the declared data is past IDX_RATIO_FREE bytes. Image and label data
 * compresses 2-5x (Fashion-MNIST 1.8x, MNIST 4.7x); only constant filler
 * reaches deflate's ~1000x, and a header declaring that much is a
 * decompression bomb (or damaged): it is refused before anything is
 * inflated. Small files are exempt, so tiny test data of zeros still loads. */
#define IDX_GZIP_RATIO_MAX 200
#define IDX_RATIO_FREE ((uint64_t)64 << 20)

static const char *idx_type_name(int type) {
    switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "16-bit integer";
    case 0x0C: return "32-bit integer";
    case 0x0D: return "32-bit float";
    case 0x0E: return "64-bit float";
    }
    return "unknown";
}

/* Turns the state of a gz stream that stopped short into an error. Returns
 * QT_OK if the stream simply ended (the caller then judges the length). */
static QtStatus idx_check_stream(gzFile f, const char *path, size_t got, size_t expect, QtError *err) {
    int zerr = Z_OK;
    const char *zmsg = gzerror(f, &zerr);
    if (zerr == Z_OK) return QT_OK;
    /* zlib prefixes its message with "<path>: "; the path is in ours already. */
    size_t plen = strlen(path);
    if (strncmp(zmsg, path, plen) == 0 && zmsg[plen] == ':') zmsg += plen + (zmsg[plen + 1] == ' ' ? 2 : 1);
    if (zerr == Z_ERRNO)
        return qt_error_set(err, QT_ERR_IO, "cannot read IDX file '%s' after %zu bytes: %s", path, got,
                            strerror(errno));
    if (zerr == Z_BUF_ERROR && expect > 0)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "IDX file '%s' is truncated: its gzip stream ends after %zu of the %zu bytes its header "
                            "announces (zlib: %s); the file is incomplete, fetch it again",
                            path, got, expect, zmsg);
    if (zerr == Z_BUF_ERROR)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "IDX file '%s' is truncated: its gzip stream ends after %zu bytes (zlib: %s); the file is "
                            "incomplete, fetch it again",
                            path, got, zmsg);
    if (zerr == Z_MEM_ERROR)
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory while decompressing IDX file '%s'", path);
    /* zlib inflates ahead of what was asked, so the position of the damage is not known here. */
    return qt_error_set(err, QT_ERR_FORMAT,
                        "IDX file '%s' is not a valid gzip stream (zlib: %s); the file is damaged, fetch it again",
                        path, zmsg);
}

/* Reads up to len bytes, looping over gzread's short reads; *got gets the
 * count. Fails only on a stream error, not at the end of the data. For
 * messages: `done` bytes of the (decompressed) file came before, and the
 * whole file should be `expect` bytes long (0 = not known yet). */
static QtStatus idx_read_bytes(gzFile f, const char *path, uint8_t *buf, size_t len, size_t done, size_t expect,
                               size_t *got, QtError *err) {
    *got = 0;
    while (*got < len) {
        size_t want = len - *got;
        unsigned n = want < IDX_READ_CHUNK ? (unsigned)want : IDX_READ_CHUNK;
        int r = gzread(f, buf + *got, n);
        if (r <= 0) return idx_check_stream(f, path, done + *got, expect, err);
        *got += (size_t)r;
    }
    return QT_OK;
}

QtStatus idx_check_magic(const uint8_t *magic, size_t got, const char *path, int *ndim, QtError *err) {
    if (got == 0) return qt_error_set(err, QT_ERR_FORMAT, "IDX file '%s' is empty; fetch it again", path);
    if (got < 4)
        return qt_error_set(err, QT_ERR_FORMAT, "IDX file '%s' is only %zu bytes long, too short for an IDX header",
                            path, got);
    if (magic[0] != 0 || magic[1] != 0)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "'%s' is not an IDX file: it starts with bytes %02x %02x %02x %02x, not 00 00 08 <ndim>",
                            path, magic[0], magic[1], magic[2], magic[3]);
    if (magic[2] != IDX_TYPE_UBYTE)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "IDX file '%s' holds elements of type 0x%02x (%s); only unsigned-byte IDX (0x08) is "
                            "supported",
                            path, magic[2], idx_type_name(magic[2]));
    *ndim = magic[3];
    if (*ndim < 1 || *ndim > IDX_MAX_DIMS)
        return qt_error_set(err, QT_ERR_FORMAT, "IDX file '%s' has %d dimensions; 1 to %d are supported", path, *ndim,
                            IDX_MAX_DIMS);
    return QT_OK;
}

QtStatus idx_decode_dims(const uint8_t *raw, int ndim, const char *path, IdxArray *out, uint64_t *n_elems,
                         QtError *err) {
    uint64_t total = 1;
    for (int i = 0; i < ndim; i++) {
        const uint8_t *b = raw + 4 * i;
        uint32_t dim = (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
        if (dim == 0)
            return qt_error_set(err, QT_ERR_FORMAT, "IDX file '%s': dimension %d is 0; every dimension must be >= 1",
                                path, i);
        /* Both factors are below 2^32, so the product cannot overflow 64 bits. */
        total *= dim;
        if (total >= IDX_MAX_ELEMS)
            return qt_error_set(err, QT_ERR_FORMAT,
                                "IDX file '%s': its dimensions (dimension %d is %u) make 2^31 elements or more, which "
                                "is not supported; the header is probably damaged",
                                path, i, dim);
        out->dims[i] = (int)dim;
    }
    out->ndim = ndim;
    *n_elems = total;
    return QT_OK;
}

/* Reads and checks the magic and dimensions; *n_elems gets their product. */
static QtStatus idx_read_header(gzFile f, const char *path, IdxArray *out, uint64_t *n_elems, QtError *err) {
    uint8_t magic[4];
    size_t got = 0;
    int ndim = 0;
    QtStatus st = idx_read_bytes(f, path, magic, 4, 0, 0, &got, err);
    if (st == QT_OK) st = idx_check_magic(magic, got, path, &ndim, err);
    if (st != QT_OK) return st;
    uint8_t raw[4 * IDX_MAX_DIMS];
    size_t need = 4 * (size_t)ndim;
    if ((st = idx_read_bytes(f, path, raw, need, 4, 0, &got, err)) != QT_OK) return st;
    if (got < need)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "IDX file '%s' ends inside its header: %zu bytes of dimensions expected, %zu found", path,
                            need, got);
    return idx_decode_dims(raw, ndim, path, out, n_elems, err);
}

/* "60000 x 28 x 28" into buf. */
static void idx_dims_str(const IdxArray *a, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = '\0';
    for (int i = 0; i < a->ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%d", i ? " x " : "", a->dims[i]);
}

/* The memory this process may still take, in bytes: MemAvailable, and
 * below it the address-space limit (ulimit -v); UINT64_MAX if not known. */
static uint64_t idx_memory_available(void) {
    uint64_t avail = UINT64_MAX;
    FILE *f = fopen("/proc/meminfo", "r");
    char line[128];
    unsigned long long kb;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
            avail = (uint64_t)kb * 1024u;
            break;
        }
    if (f) fclose(f);
    struct rlimit lim;
    if (getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY && (uint64_t)lim.rlim_cur < avail)
        avail = (uint64_t)lim.rlim_cur;
    return avail;
}

/* Bounds what the header makes the reader inflate, before any of it is:
 * a gzip'd file declaring far more than its compressed size can honestly
 * hold, and (in_memory) a payload larger than the memory left. A stream
 * yielding more than declared is caught after the payload
 * (idx_check_no_trailing), a shorter one as truncated. */
static QtStatus idx_check_declared(gzFile f, const char *path, const IdxArray *shape, uint64_t n_elems, bool in_memory,
                                   QtError *err) {
    char dims[96];
    idx_dims_str(shape, dims, sizeof dims);
    struct stat sb;
    if (!gzdirect(f) && n_elems > IDX_RATIO_FREE && stat(path, &sb) == 0 && sb.st_size > 0 &&
        n_elems / (uint64_t)sb.st_size >= IDX_GZIP_RATIO_MAX)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "IDX file '%s' declares %" PRIu64 " bytes of data (%s) in %lld gzip'd bytes, %" PRIu64
                            " times its size; image and label data does not compress beyond a few times, so this is "
                            "a decompression bomb or a damaged header, and it is not inflated; fetch the file again",
                            path, n_elems, dims, (long long)sb.st_size, n_elems / (uint64_t)sb.st_size);
    uint64_t avail = in_memory ? idx_memory_available() : UINT64_MAX;
    if (n_elems > avail)
        return qt_error_set(err, QT_ERR_NOMEM,
                            "IDX file '%s' declares %" PRIu64 " bytes of data (%s), more than the %" PRIu64 " bytes "
                            "of memory available (MemAvailable, ulimit -v); free memory, or keep an uninflated copy "
                            "out of memory (data.storage: auto with a plain IDX file or a data.cache_dir)",
                            path, n_elems, dims, avail);
    return QT_OK;
}

/* Counts what follows the payload; *extra gets 0 for a file of the right length. */
static QtStatus idx_count_trailing(gzFile f, const char *path, size_t done, uint64_t *extra, QtError *err) {
    uint8_t scratch[4096];
    *extra = 0;
    for (;;) {
        size_t got = 0;
        QtStatus st = idx_read_bytes(f, path, scratch, sizeof scratch, (size_t)(done + *extra), 0, &got, err);
        if (st != QT_OK) return st;
        *extra += got;
        if (got < sizeof scratch || *extra >= IDX_TRAILING_COUNT_MAX) return QT_OK;
    }
}

static QtStatus idx_fail_truncated(const char *path, size_t expect, size_t have, QtError *err) {
    return qt_error_set(err, QT_ERR_FORMAT,
                        "IDX file '%s' is truncated: its header promises %zu bytes of data, only %zu follow; the file "
                        "is incomplete, fetch it again",
                        path, expect, have);
}

/* After the payload: nothing may follow it. */
static QtStatus idx_check_no_trailing(gzFile f, const char *path, size_t done, size_t expect, QtError *err) {
    uint64_t extra = 0;
    QtStatus st = idx_count_trailing(f, path, done, &extra, err);
    if (st != QT_OK || extra == 0) return st;
    return qt_error_set(err, QT_ERR_FORMAT,
                        "IDX file '%s' has %s%llu byte%s after the %zu bytes of data its header announces; the "
                        "header or the file is damaged",
                        path, extra >= IDX_TRAILING_COUNT_MAX ? "at least " : "", (unsigned long long)extra,
                        extra == 1 ? "" : "s", expect);
}

/* Reads exactly `expect` payload bytes into a buffer that grows with the
 * data, then checks that nothing follows them. */
static QtStatus idx_read_payload(gzFile f, const char *path, size_t header_len, size_t expect, uint8_t **data_out,
                                 QtError *err) {
    size_t cap = expect < IDX_FIRST_ALLOC ? expect : IDX_FIRST_ALLOC;
    uint8_t *data = malloc(cap);
    if (!data) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %zu bytes for IDX file '%s'", cap, path);
    size_t have = 0;
    QtStatus st = QT_OK;
    while (have < expect) {
        if (have == cap) {
            size_t grown = cap > expect / 2 ? expect : 2 * cap;
            uint8_t *p = realloc(data, grown);
            if (!p) {
                st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %zu bytes for IDX file '%s'", grown, path);
                goto fail;
            }
            data = p, cap = grown;
        }
        size_t got = 0;
        st = idx_read_bytes(f, path, data + have, cap - have, header_len + have, header_len + expect, &got, err);
        if (st != QT_OK) goto fail;
        have += got;
        if (have < cap) break; /* the data ended */
    }
    if (have < expect) {
        st = idx_fail_truncated(path, expect, have, err);
        goto fail;
    }
    if ((st = idx_check_no_trailing(f, path, header_len + have, expect, err)) != QT_OK) goto fail;
    *data_out = data;
    return QT_OK;
fail:
    free(data);
    return st;
}

static QtStatus idx_open_gz(const char *path, gzFile *f, QtError *err) {
    if (!path || !*path) return qt_error_set(err, QT_ERR_ARG, "idx_read: no file name");
    errno = 0;
    *f = gzopen(path, "rb");
    if (!*f) {
        int e = errno;
        return qt_error_set(err, QT_ERR_IO,
                            "cannot open IDX file '%s': %s; check the path (for Fashion-MNIST, install the Debian "
                            "package dataset-fashion-mnist or set data.dir to the directory holding its files)",
                            path, e ? strerror(e) : "zlib could not open it");
    }
    gzbuffer(*f, 1u << 17);
    return QT_OK;
}

QtStatus idx_read(const char *path, IdxArray *out, QtError *err) {
    memset(out, 0, sizeof *out);
    gzFile f = NULL;
    QtStatus st = idx_open_gz(path, &f, err);
    if (st != QT_OK) return st;
    uint64_t n_elems = 0;
    st = idx_read_header(f, path, out, &n_elems, err);
    if (st == QT_OK) st = idx_check_declared(f, path, out, n_elems, true, err);
    if (st == QT_OK) {
        size_t header_len = 4 + 4 * (size_t)out->ndim;
        st = idx_read_payload(f, path, header_len, (size_t)n_elems, &out->data, err);
    }
    gzclose_r(f);
    if (st != QT_OK) {
        memset(out, 0, sizeof *out);
        return st;
    }
    out->n_bytes = (size_t)n_elems;
    return QT_OK;
}

/* The payload in chunks of IDX_READ_CHUNK through the sink, then the check that nothing follows. */
static QtStatus idx_stream_payload(gzFile f, const char *path, size_t header_len, size_t expect, const IdxSink *sink,
                                   bool *refused, QtError *err) {
    uint8_t *chunk = malloc(IDX_READ_CHUNK);
    if (!chunk) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate a read buffer for IDX file '%s'", path);
    QtStatus st = QT_OK;
    size_t have = 0;
    while (have < expect && st == QT_OK && !*refused) {
        size_t want = expect - have < IDX_READ_CHUNK ? expect - have : IDX_READ_CHUNK, got = 0;
        st = idx_read_bytes(f, path, chunk, want, header_len + have, header_len + expect, &got, err);
        if (st == QT_OK && got > 0) *refused = !sink->data(sink->ctx, chunk, got);
        have += got;
        if (st == QT_OK && got < want) break; /* the data ended */
    }
    free(chunk);
    if (st != QT_OK || *refused) return st;
    if (have < expect) return idx_fail_truncated(path, expect, have, err);
    return idx_check_no_trailing(f, path, header_len + have, expect, err);
}

QtStatus idx_stream(const char *path, const IdxSink *sink, bool *refused, QtError *err) {
    *refused = false;
    gzFile f = NULL;
    QtStatus st = idx_open_gz(path, &f, err);
    if (st != QT_OK) return st;
    IdxArray shape;
    memset(&shape, 0, sizeof shape);
    uint64_t n_elems = 0;
    st = idx_read_header(f, path, &shape, &n_elems, err);
    if (st == QT_OK) st = idx_check_declared(f, path, &shape, n_elems, false, err);
    if (st == QT_OK) {
        uint8_t hdr[IDX_HEADER_MAX];
        size_t header_len = 4 + 4 * (size_t)shape.ndim;
        shape.n_bytes = (size_t)n_elems;
        idx_encode_header(&shape, hdr);
        *refused = !sink->begin(sink->ctx, &shape, hdr, header_len);
        if (!*refused) st = idx_stream_payload(f, path, header_len, (size_t)n_elems, sink, refused, err);
    }
    gzclose_r(f);
    return st;
}

void idx_encode_header(const IdxArray *a, uint8_t *hdr) {
    hdr[0] = 0, hdr[1] = 0, hdr[2] = IDX_TYPE_UBYTE, hdr[3] = (uint8_t)a->ndim;
    for (int i = 0; i < a->ndim; i++) {
        uint32_t d = (uint32_t)a->dims[i];
        hdr[4 + 4 * i] = (uint8_t)(d >> 24), hdr[5 + 4 * i] = (uint8_t)(d >> 16);
        hdr[6 + 4 * i] = (uint8_t)(d >> 8), hdr[7 + 4 * i] = (uint8_t)d;
    }
}

void idx_free(IdxArray *a) {
    if (!a) return;
    free(a->data);
    memset(a, 0, sizeof *a);
}
