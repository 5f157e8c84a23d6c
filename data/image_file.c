/* image_file.c - images read in place from an uncompressed IDX file
 * (image_file.h). */
#include "image_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* What to do about a file that changed under the run, for every message. */
#define IMAGE_FILE_ADVICE                                                                                           \
    "data.storage: file reads it at every batch, so it must stay as it was; restore it (a copy in data.cache_dir " \
    "may simply be deleted, the next start rebuilds it) and resume from the last checkpoint, or set "             \
    "data.storage: memory to read the images once at the start"

static QtStatus image_file_alloc_buf(DatasetFile *f, QtError *err) {
    size_t cap = IMAGE_FILE_BUF_BYTES / f->row_bytes;
    if (cap > (size_t)f->n_rows) cap = (size_t)f->n_rows;
    f->cap = cap > 0 ? (int)cap : 1;
    f->buf = malloc((size_t)f->cap * f->row_bytes);
    if (!f->buf)
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate a read buffer of %d images for '%s'", f->cap, f->path);
    return QT_OK;
}

QtStatus image_file_open(DatasetFile **out, IdxFile *f, QtError *err) {
    struct stat sb;
    int fd = f->fd;
    f->fd = -1;
    *out = NULL;
    QtStatus st = QT_OK;
    if (f->ndim != 3)
        st = qt_error_set(err, QT_ERR_ARG, "image_file_open: '%s' is not a 3-D IDX file", f->path);
    else if (fstat(fd, &sb) != 0)
        st = qt_error_set(err, QT_ERR_IO, "cannot stat images file '%s': %s", f->path, strerror(errno));
    else if (!(*out = calloc(1, sizeof **out)))
        st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the reader of images file '%s'", f->path);
    if (st != QT_OK) {
        close(fd);
        return st;
    }
    DatasetFile *d = *out;
    d->fd = fd;
    snprintf(d->path, sizeof d->path, "%s", f->path);
    d->offset = f->offset;
    d->row_bytes = (size_t)f->dims[1] * (size_t)f->dims[2];
    d->n_rows = f->dims[0];
    d->size = (uint64_t)sb.st_size;
    d->mtime_s = (int64_t)sb.st_mtim.tv_sec;
    d->mtime_ns = sb.st_mtim.tv_nsec;
    d->channels = 1;
    d->side = f->dims[1];
    if ((st = image_file_alloc_buf(d, err)) != QT_OK) {
        image_file_free(d);
        *out = NULL;
    }
    return st;
}

/* The size and modification time of d's open file (d->fd, or -1: it could not be opened), which every read
 * checks again (image_file_check_unchanged). */
static QtStatus image_file_watch(DatasetFile *d, QtError *err) {
    struct stat sb;
    if (d->fd < 0 || fstat(d->fd, &sb) != 0)
        return qt_error_set(err, QT_ERR_IO, "cannot open data file '%s': %s", d->path, strerror(errno));
    d->size = (uint64_t)sb.st_size;
    d->mtime_s = (int64_t)sb.st_mtim.tv_sec;
    d->mtime_ns = sb.st_mtim.tv_nsec;
    return QT_OK;
}

QtStatus image_file_open_rows(DatasetFile **out, const char *path, uint64_t offset, int n_rows, size_t row_bytes,
                              QtError *err) {
    *out = NULL;
    DatasetFile *d = calloc(1, sizeof *d);
    if (!d) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the reader of '%s'", path);
    d->fd = open(path, O_RDONLY | O_CLOEXEC);
    snprintf(d->path, sizeof d->path, "%s", path);
    d->offset = offset, d->row_bytes = row_bytes, d->n_rows = n_rows, d->channels = 1;
    QtStatus st = image_file_watch(d, err);
    if (st == QT_OK) st = image_file_alloc_buf(d, err);
    if (st != QT_OK) {
        image_file_free(d);
        return st;
    }
    *out = d;
    return QT_OK;
}

/* Opens f's HDF5 file and dataset (f->path, f->h5path). */
static QtStatus image_file_h5_attach(DatasetFile *f, QtError *err) {
    f->h5ds.id = H5I_INVALID_HID;
    if (!(f->h5 = malloc(sizeof *f->h5)))
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the reader of '%s'", f->path);
    *f->h5 = (H5ioFile)H5IO_FILE_INIT;
    QtStatus st = h5io_open(f->h5, f->path, err);
    if (st == QT_OK) st = h5io_dataset_open(f->h5, f->h5path, &f->h5ds, err);
    return st;
}

QtStatus image_file_open_hdf5(DatasetFile **out, const char *path, const char *dset, int n_rows, size_t row_bytes,
                              hid_t memtype, bool own_type, QtError *err) {
    *out = NULL;
    DatasetFile *d = calloc(1, sizeof *d);
    if (!d) {
        if (own_type) H5Tclose(memtype);
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the reader of '%s'", path);
    }
    d->h5type = memtype, d->h5type_owned = own_type;
    d->fd = open(path, O_RDONLY | O_CLOEXEC);
    snprintf(d->path, sizeof d->path, "%s", path);
    snprintf(d->h5path, sizeof d->h5path, "%s", dset);
    d->row_bytes = row_bytes;
    d->n_rows = n_rows;
    d->channels = 1;
    QtStatus st = image_file_watch(d, err);
    if (st == QT_OK) st = image_file_h5_attach(d, err);
    if (st == QT_OK) st = image_file_alloc_buf(d, err);
    if (st != QT_OK) {
        image_file_free(d);
        return st;
    }
    *out = d;
    return QT_OK;
}

void image_file_free(DatasetFile *f) {
    if (!f) return;
    if (f->h5) {
        h5io_dataset_close(&f->h5ds);
        h5io_close(f->h5, NULL);
        free(f->h5);
    }
    if (f->h5type_owned) H5Tclose(f->h5type);
    if (f->fd >= 0) close(f->fd);
    free(f->rows);
    free(f->buf);
    free(f);
}

bool image_file_keep(DatasetFile *f, uint32_t *keep, int cnt) {
    bool identity = !f->rows;
    for (int i = 0; i < cnt && identity; i++) identity = keep[i] == (uint32_t)i;
    if (identity) return false; /* the first cnt examples: rows (or first) already say so */
    /* keep[i] >= i and rows is another array, so this can work in place */
    for (int i = 0; i < cnt; i++) keep[i] = image_file_row(f, keep[i]);
    free(f->rows);
    /* keep was sized for every example; giving back the rest is harmless to skip if that fails */
    uint32_t *shrunk = realloc(keep, (size_t)(cnt > 0 ? cnt : 1) * sizeof *keep);
    f->rows = shrunk ? shrunk : keep;
    return true;
}

QtStatus image_file_split(DatasetFile *f, int first, int k, DatasetFile **tail, QtError *err) {
    DatasetFile *t = malloc(sizeof *t);
    *tail = NULL;
    if (!t) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the reader of the validation images");
    *t = *f;
    t->rows = NULL, t->buf = NULL, t->h5 = NULL;
    if (f->h5type_owned && (t->h5type = H5Tcopy(f->h5type)) < 0) t->h5type_owned = false, t->h5type = f->h5type;
    t->fd = fcntl(f->fd, F_DUPFD_CLOEXEC, 0);
    QtStatus st = QT_OK;
    if (t->fd >= 0 && f->h5) st = image_file_h5_attach(t, err);
    if (st != QT_OK) {
        image_file_free(t);
        return st;
    }
    if (t->fd < 0)
        st = qt_error_set(err, QT_ERR_IO, "cannot open images file '%s' a second time for the validation set: %s",
                          f->path, strerror(errno));
    else if (f->rows && !(t->rows = malloc((size_t)k * sizeof *t->rows)))
        st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the row list of %d validation examples", k);
    if (st == QT_OK) st = image_file_alloc_buf(t, err);
    if (st != QT_OK) {
        image_file_free(t);
        return st;
    }
    if (f->rows) {
        memcpy(t->rows, f->rows + first, (size_t)k * sizeof *t->rows);
        /* give the tail's entries back; keeping them is harmless if that fails */
        uint32_t *r = realloc(f->rows, (size_t)(first > 0 ? first : 1) * sizeof *r);
        if (r) f->rows = r;
    } else {
        t->first = f->first + first;
    }
    *tail = t;
    return QT_OK;
}

/* QT_ERR_IO if the file's size or modification time is not what it was at open. */
static QtStatus image_file_check_unchanged(const DatasetFile *f, QtError *err) {
    struct stat sb;
    if (fstat(f->fd, &sb) != 0)
        return qt_error_set(err, QT_ERR_IO, "cannot stat images file '%s': %s; " IMAGE_FILE_ADVICE, f->path,
                            strerror(errno));
    if ((uint64_t)sb.st_size == f->size && (int64_t)sb.st_mtim.tv_sec == f->mtime_s &&
        sb.st_mtim.tv_nsec == f->mtime_ns)
        return QT_OK;
    return qt_error_set(err, QT_ERR_IO,
                        "images file '%s' changed while the run was reading it (now %llu bytes, %llu when opened%s); "
                        IMAGE_FILE_ADVICE,
                        f->path, (unsigned long long)sb.st_size, (unsigned long long)f->size,
                        (uint64_t)sb.st_size == f->size ? ", and modified since" : "");
}

/* Reads the k rows from file row r0 on into the buffer. */
static QtStatus image_file_pread(const DatasetFile *f, uint32_t r0, int k, QtError *err) {
    if (f->h5) return h5io_dataset_read_rows(&f->h5ds, f->h5type, r0, (uint64_t)k, f->buf, err);
    size_t len = (size_t)k * f->row_bytes, done = 0;
    uint64_t off = f->offset + (uint64_t)r0 * f->row_bytes;
    while (done < len) {
        ssize_t r = pread(f->fd, f->buf + done, len - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0)
            return qt_error_set(err, QT_ERR_IO, "cannot read images %u..%u of '%s' (bytes %llu..%llu): %s; "
                                IMAGE_FILE_ADVICE, r0, r0 + (uint32_t)k - 1, f->path, (unsigned long long)off,
                                (unsigned long long)(off + len - 1), strerror(errno));
        if (r == 0) {
            struct stat sb;
            long long now = fstat(f->fd, &sb) == 0 ? (long long)sb.st_size : -1;
            return qt_error_set(err, QT_ERR_IO, "images file '%s' ends at byte %llu, but images %u..%u lie at bytes "
                                "%llu..%llu; it was %llu bytes when opened (now %lld), so it was truncated while the "
                                "run was reading it; " IMAGE_FILE_ADVICE, f->path,
                                (unsigned long long)(off + done), r0, r0 + (uint32_t)k - 1, (unsigned long long)off,
                                (unsigned long long)(off + len - 1), (unsigned long long)f->size, now);
        }
        done += (size_t)r;
    }
    return QT_OK;
}

/* The file row of the request's i-th example. */
static inline uint32_t request_row(const DatasetFile *f, const uint32_t *idx, int start, int i) {
    return image_file_row(f, idx ? idx[i] : (uint32_t)(start + i));
}

QtStatus image_file_read(const DatasetFile *f, const uint32_t *idx, int start, int n, ImageRunFn fn, void *ctx,
                         QtError *err) {
    QtStatus st = n > 0 ? image_file_check_unchanged(f, err) : QT_OK;
    for (int i = 0; i < n && st == QT_OK;) {
        uint32_t r0 = request_row(f, idx, start, i);
        int k = 1;
        while (i + k < n && k < f->cap && request_row(f, idx, start, i + k) == r0 + (uint32_t)k) k++;
        if ((st = image_file_pread(f, r0, k, err)) == QT_OK) fn(ctx, i, f->buf, k);
        i += k;
    }
    return st;
}
