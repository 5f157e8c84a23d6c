/* h5io_safe.c - what h5io checks before it reads from an untrusted file:
 * a dataset's storage (h5io_check_storage) and variable-length strings,
 * read in a child process (h5io_attr_read_vlen). See
 * docs/SECURITY.md for what is refused and why. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "h5io.h"
#include "h5io_internal.h"

/* ---- what an untrusted file may hold ------------------------------------------------
 *
 * Before a dataset's data is read, its storage is checked: the bytes must
 * be in this file (no external storage, which names any file on the
 * machine, and no virtual dataset, whose missing sources read as zeros),
 * written (an unallocated dataset reads as its fill value), only through
 * filters qtrain or Debian's libhdf5 write (deflate, shuffle, fletcher32),
 * and in chunks no larger than the dataset (a 10-element dataset with a
 * chunk of 2^28 elements makes HDF5 allocate the whole chunk), each stored
 * no larger than it needs and inflating to at most its size. Opening a
 * dataset (H5Dopen2, before these checks) reads only its header in 1.10,
 * never an external or source file: the hostile suite's FIFO cases, which
 * would block, show it, so no file-prefix setting is needed on top. */

/* The filters of a chunked dataset that are accepted. */
static bool filter_allowed(H5Z_filter_t id) {
    return id == H5Z_FILTER_DEFLATE || id == H5Z_FILTER_SHUFFLE || id == H5Z_FILTER_FLETCHER32;
}

static QtStatus refuse(QtError *err, const H5ioFile *f, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* "<file>: refusing dataset /<path>: <why> (... see SECURITY ...)" */
static QtStatus refuse(QtError *err, const H5ioFile *f, const char *path, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    char shown[QT_CLIP_BUF];
    return qt_error_set(err, QT_ERR_FORMAT, "%s: refusing dataset /%s: %s (every HDF5 file qtrain reads, checkpoint, "
                        "adapters or data set, is untrusted input: see docs/SECURITY.md)", h5io_fname(f),
                        qt_clip(h5io_show(path), shown), why);
}

static QtStatus unwritten(QtError *err, const H5ioFile *f, const char *path, bool partly) {
    return refuse(err, f, path, "its data was %s written (it would read as zeros)", partly ? "only partly" : "never");
}

/* Inflates src[n] into out[cap]: 1 if it is one whole deflate stream of
 * at most cap bytes, 0 if it is longer (it stops there) or damaged. */
static int inflate_within(const unsigned char *src, size_t n, unsigned char *out, size_t cap) {
    z_stream z;
    memset(&z, 0, sizeof z);
    if (inflateInit(&z) != Z_OK) return 0;
    z.next_in = (unsigned char *)src;
    z.avail_in = (uInt)n;
    z.next_out = out;
    z.avail_out = (uInt)cap;
    int r = inflate(&z, Z_FINISH);
    inflateEnd(&z);
    return r == Z_STREAM_END;
}

/* Deflate expands up to ~1000-fold, and libhdf5 1.10 inflates a chunk into
 * a buffer it doubles until the stream ends, whatever the chunk's size: a
 * 1 MB stream in a 40-byte chunk would take 1 GB. So every stored chunk is
 * checked first: no larger than its data could need compressed (deflate
 * adds at most ~0.1% to incompressible data, fletcher32 4 bytes), and a
 * deflated one is inflated here into at most the chunk's own size.
 * kd, kf: the pipeline positions of deflate and fletcher32 (-1: none).
 * *n_stored: how many chunks are stored. */
static QtStatus check_stored_chunks(const H5ioFile *f, const char *path, hid_t d, int rank, const hsize_t *chunk,
                                    int kd, int kf, hsize_t *n_stored, QtError *err) {
    hid_t type = H5Dget_type(d);
    size_t raw = type >= 0 ? H5Tget_size(type) : 0;
    if (type >= 0) H5Tclose(type);
    for (int i = 0; i < rank; i++) raw *= (size_t)chunk[i];
    if (raw == 0 || raw > ((size_t)1 << 32)) return refuse(err, f, path, "its chunks hold %zu bytes", raw);
    size_t max_stored = raw + raw / 500 + 64;
    hsize_t n = 0;
    hid_t fs = H5Dget_space(d);
    if (fs < 0 || H5Dget_num_chunks(d, fs, &n) < 0) {
        if (fs >= 0) H5Sclose(fs);
        return h5io_fail(err, QT_ERR_FORMAT, f, "count the chunks of", path);
    }
    unsigned char *in = kd >= 0 ? malloc(max_stored) : NULL, *out = kd >= 0 ? malloc(raw) : NULL;
    QtStatus st = kd >= 0 && (!in || !out) ? qt_error_set(err, QT_ERR_NOMEM, "%s: cannot allocate a chunk of /%s",
                                                           h5io_fname(f), h5io_show(path))
                                           : QT_OK;
    for (hsize_t i = 0; st == QT_OK && i < n; i++) {
        hsize_t off[H5IO_MAX_RANK] = {0}, size = 0;
        unsigned mask = 0;
        haddr_t addr = 0;
        uint32_t mask32 = 0;
        if (H5Dget_chunk_info(d, fs, i, off, &mask, &addr, &size) < 0) {
            st = h5io_fail(err, QT_ERR_FORMAT, f, "read the chunk index of", path);
        } else if (size > max_stored) {
            st = refuse(err, f, path, "chunk %llu is stored in %llu bytes, more than its %zu bytes of data can need "
                        "(a decompression bomb?)", (unsigned long long)i, (unsigned long long)size, raw);
        } else if (kd >= 0 && !(mask & (1u << kd))) {
            size_t len = (size_t)size;
            if (H5Dread_chunk(d, H5P_DEFAULT, off, &mask32, in) < 0) {
                st = h5io_fail(err, QT_ERR_FORMAT, f, "read a chunk of", path);
            } else {
                if (kf > kd && !(mask & (1u << kf))) len = len >= 4 ? len - 4 : 0; /* fletcher32's checksum */
                if (!inflate_within(in, len, out, raw))
                    st = refuse(err, f, path, "chunk %llu does not inflate to at most its %zu bytes (damaged, or a "
                                "decompression bomb)", (unsigned long long)i, raw);
            }
        }
    }
    free(in);
    free(out);
    H5Sclose(fs);
    *n_stored = n;
    return st;
}

/* The chunk shape, filters, stored chunks and their count of chunked dataset d. */
static QtStatus check_chunks(const H5ioFile *f, const char *path, hid_t d, hid_t dcpl, QtError *err) {
    hsize_t chunk[H5IO_MAX_RANK], dims[H5IO_MAX_RANK];
    hid_t space = H5Dget_space(d);
    int rank = space >= 0 ? H5Sget_simple_extent_ndims(space) : -1;
    if (rank < 0 || rank > H5IO_MAX_RANK || (rank > 0 && H5Sget_simple_extent_dims(space, dims, NULL) < 0)) {
        if (space >= 0) H5Sclose(space);
        return h5io_fail(err, QT_ERR_FORMAT, f, "read the shape of", path);
    }
    H5Sclose(space);
    int crank = H5Pget_chunk(dcpl, H5IO_MAX_RANK, chunk);
    if (crank != rank) return refuse(err, f, path, "its chunks have %d dimensions, the dataset %d", crank, rank);
    for (int i = 0; i < rank; i++) {
        /* A dimension of 0 still has chunks of at least 1. */
        if (chunk[i] == 0) return refuse(err, f, path, "its chunks have a dimension of 0");
        if (chunk[i] > (dims[i] ? dims[i] : 1))
            return refuse(err, f, path, "its chunks are larger than the dataset (%llu > %llu in dimension %d), "
                          "which makes HDF5 allocate memory for the whole chunk", (unsigned long long)chunk[i],
                          (unsigned long long)dims[i], i);
    }
    int nf = H5Pget_nfilters(dcpl), kd = -1, kf = -1;
    if (nf < 0) return h5io_fail(err, QT_ERR_FORMAT, f, "read the filters of", path);
    if (nf > 30) return refuse(err, f, path, "it is stored through %d filters", nf);
    for (int i = 0; i < nf; i++) {
        unsigned flags = 0, config = 0, cd[8];
        size_t ncd = sizeof cd / sizeof cd[0];
        char fname_[64] = "";
        H5Z_filter_t id = H5Pget_filter2(dcpl, (unsigned)i, &flags, &ncd, cd, sizeof fname_, fname_, &config);
        if (id < 0) return h5io_fail(err, QT_ERR_FORMAT, f, "read the filters of", path);
        if (!filter_allowed(id)) {
            char shown[QT_CLIP_BUF];
            return refuse(err, f, path, "it is stored through filter %d ('%s'); only deflate (gzip), shuffle and "
                          "fletcher32 are accepted", (int)id, qt_clip(fname_, shown));
        }
        /* h5py and qtrain's tests write shuffle, deflate, fletcher32 in this order, each once */
        if ((id == H5Z_FILTER_DEFLATE && kd >= 0) || (id == H5Z_FILTER_FLETCHER32 && kf >= 0) ||
            (id == H5Z_FILTER_SHUFFLE && (kd >= 0 || kf >= 0)) || (id == H5Z_FILTER_DEFLATE && kf >= 0))
            return refuse(err, f, path, "its filters are not in the order shuffle, deflate, fletcher32");
        if (id == H5Z_FILTER_DEFLATE) kd = i;
        if (id == H5Z_FILTER_FLETCHER32) kf = i;
    }
    hsize_t have = 0, want = 1;
    QtStatus st = check_stored_chunks(f, path, d, rank, chunk, kd, kf, &have, err);
    if (st != QT_OK) return st;
    /* Every element written: a missing chunk reads as the fill value. (H5Dget_space_status compares the
     * compressed bytes with the raw size, so the chunks are counted instead.) No element: nothing to write. */
    for (int i = 0; i < rank; i++) want *= (dims[i] + chunk[i] - 1) / chunk[i];
    if (have < want) return unwritten(err, f, path, have > 0);
    return QT_OK;
}

/* Whether the contiguous or compact dataset d was written: unallocated
 * storage reads as the fill value. */
static QtStatus check_allocated(const H5ioFile *f, const char *path, hid_t d, QtError *err) {
    hid_t space = H5Dget_space(d);
    hssize_t np = space >= 0 ? H5Sget_simple_extent_npoints(space) : -1;
    if (space >= 0) H5Sclose(space);
    if (np < 0) return h5io_fail(err, QT_ERR_FORMAT, f, "read the shape of", path);
    if (np == 0) return QT_OK;
    H5D_space_status_t status = H5D_SPACE_STATUS_ERROR;
    if (H5Dget_space_status(d, &status) < 0) return h5io_fail(err, QT_ERR_FORMAT, f, "read the storage of", path);
    if (status != H5D_SPACE_STATUS_ALLOCATED) return unwritten(err, f, path, false);
    return QT_OK;
}

QtStatus h5io_check_storage(const H5ioFile *f, const char *path, hid_t d, QtError *err) {
    hid_t dcpl = H5Dget_create_plist(d);
    if (dcpl < 0) return h5io_fail(err, QT_ERR_FORMAT, f, "read the storage layout of", path);
    QtStatus st = QT_OK;
    H5D_layout_t layout = H5Pget_layout(dcpl);
    int n_ext = layout == H5D_CONTIGUOUS ? H5Pget_external_count(dcpl) : 0;
    if (n_ext > 0) {
        char name[256] = "", shown[QT_CLIP_BUF];
        off_t off;
        hsize_t size;
        if (H5Pget_external(dcpl, 0, sizeof name, name, &off, &size) < 0) name[0] = '\0';
        name[sizeof name - 1] = '\0';
        st = refuse(err, f, path, "its data is stored in %d external file%s ('%s'%s)", n_ext, n_ext == 1 ? "" : "s",
                    qt_clip(name, shown), n_ext > 1 ? ", ..." : "");
    } else if (layout == H5D_VIRTUAL) {
        st = refuse(err, f, path, "it is a virtual dataset (its data would come from other files)");
    } else if (layout == H5D_CHUNKED) {
        st = check_chunks(f, path, d, dcpl, err);
    } else if (layout != H5D_CONTIGUOUS && layout != H5D_COMPACT) {
        st = refuse(err, f, path, "its storage layout (%d) is not contiguous, chunked or compact", (int)layout);
    } else if (n_ext < 0) {
        st = h5io_fail(err, QT_ERR_FORMAT, f, "read the storage layout of", path);
    } else {
        st = check_allocated(f, path, d, err);
    }
    H5Pclose(dcpl);
    return st;
}

/* How long the reading of one variable-length string may take. */
#define VLEN_READ_SECONDS 20

/* Reads all of fd (at most cap bytes) into buf until EOF or the deadline;
 * the byte count, or -1 on a timeout or error. */
static ssize_t read_until_eof(int fd, char *buf, size_t cap, time_t deadline) {
    size_t got = 0;
    for (;;) {
        time_t now = time(NULL);
        if (now >= deadline) return -1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)(deadline - now) * 1000);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t n = read(fd, buf + got, cap - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        if (n == 0) return (ssize_t)got;
        got += (size_t)n;
        if (got == cap) return (ssize_t)got;
    }
}

/* A variable-length string (h5py writes str attributes so) lives in the
 * file's global heap, and libhdf5 1.10 reads it without checking the heap:
 * a damaged byte there crashes the process or makes it loop. So the read
 * runs in a child process: it sends back a status byte and the string, and
 * a child that dies or takes longer than VLEN_READ_SECONDS means a damaged
 * file, not a crash of qtrain. */
QtStatus h5io_attr_read_vlen(const H5ioFile *f, const char *obj, const char *name, hid_t a, hid_t mt, char **v,
                               QtError *err) {
    int fds[2];
    if (pipe(fds) != 0)
        return qt_error_set(err, QT_ERR_IO, "%s: cannot read attribute '%s' of /%s (pipe: %s)", h5io_fname(f), name,
                            h5io_show(obj), strerror(errno));
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return qt_error_set(err, QT_ERR_IO, "%s: cannot read attribute '%s' of /%s (fork: %s)", h5io_fname(f), name,
                            h5io_show(obj), strerror(errno));
    }
    if (pid == 0) {
        close(fds[0]);
        setrlimit(RLIMIT_CORE, &(struct rlimit){0, 0}); /* a crash here is expected on a damaged file: no core */
        char *s = NULL;
        char ok = H5Aread(a, mt, &s) >= 0 ? 1 : 0;
        uint64_t len = ok && s ? strnlen(s, H5IO_ATTR_STR_MAX + 1) : 0;
        if (write(fds[1], &ok, 1) == 1 && write(fds[1], &len, sizeof len) == sizeof len)
            for (size_t done = 0; done < len;) {
                ssize_t n = write(fds[1], s + done, len - done);
                if (n <= 0) break;
                done += (size_t)n;
            }
        _exit(0); /* no exit handlers: the parent's HDF5 state is the parent's */
    }
    close(fds[1]);
    /* status byte, length, bytes: a child that died while writing sent fewer */
    const size_t head = 1 + sizeof(uint64_t), cap = head + H5IO_ATTR_STR_MAX + 1;
    char *buf = malloc(cap);
    ssize_t n = buf ? read_until_eof(fds[0], buf, cap, time(NULL) + VLEN_READ_SECONDS) : -1;
    close(fds[0]);
    kill(pid, SIGKILL); /* a child still reading (a loop on a damaged heap) */
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
    uint64_t len = 0;
    if (n >= (ssize_t)head) memcpy(&len, buf + 1, sizeof len);
    QtStatus st = QT_OK;
    if (!buf) {
        st = qt_error_set(err, QT_ERR_NOMEM, "%s: out of memory reading attribute '%s' of /%s", h5io_fname(f), name,
                          h5io_show(obj));
    } else if (n < (ssize_t)head || (buf[0] == 1 && len != (uint64_t)n - head)) {
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s is a variable-length string that cannot be "
                          "read (libhdf5 %s on it): the file is damaged", h5io_fname(f), name, h5io_show(obj),
                          n < 0 ? "did not finish" : "crashed");
    } else if (buf[0] != 1) {
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: cannot read attribute '%s' of /%s (a damaged variable-length "
                          "string)", h5io_fname(f), name, h5io_show(obj));
    } else if (len > H5IO_ATTR_STR_MAX) {
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s is a string of more than %zu bytes",
                          h5io_fname(f), name, h5io_show(obj), H5IO_ATTR_STR_MAX);
    } else {
        memmove(buf, buf + head, (size_t)len);
        buf[len] = '\0';
        char *shrunk = realloc(buf, (size_t)len + 1);
        *v = shrunk ? shrunk : buf;
        buf = NULL;
    }
    free(buf);
    return st;
}

