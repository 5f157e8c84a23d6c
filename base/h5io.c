/* h5io.c - HDF5 helpers with messages that name the file and the object. */
#include "h5io.h"
#include "h5io_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Traversing an external link would open another file named by the file
 * being read (any path on the machine, a FIFO that blocks the open, a file
 * on a network mount). Checkpoints and adapter files come from anyone, so
 * no external link is ever followed: the built-in class is replaced by one
 * whose traversal fails. Creating and listing such links still works. */
static hid_t elink_refuse_traverse(const char *link_name, hid_t cur_group, const void *lnkdata, size_t lnkdata_size,
                                   hid_t lapl_id, hid_t dxpl_id) {
    (void)link_name, (void)cur_group, (void)lnkdata, (void)lnkdata_size, (void)lapl_id, (void)dxpl_id;
    return H5I_INVALID_HID;
}

static ssize_t elink_query(const char *link_name, const void *lnkdata, size_t lnkdata_size, void *buf,
                           size_t buf_size) {
    (void)link_name;
    if (buf) memcpy(buf, lnkdata, buf_size < lnkdata_size ? buf_size : lnkdata_size);
    return (ssize_t)lnkdata_size;
}

static const H5L_class_t ELINK_REFUSED = {
    .version = H5L_LINK_CLASS_T_VERS,
    .id = H5L_TYPE_EXTERNAL,
    .comment = "external link (never followed by qtrain)",
    .trav_func = elink_refuse_traverse,
    .query_func = elink_query,
};

void h5io_init(void) {
    static bool done = false;
    if (done) return;
    H5open();
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    H5Lregister(&ELINK_REFUSED);
    done = true;
}

/* ---- messages ---------------------------------------------------------------- */

typedef struct {
    char *buf;
    size_t cap;
    int errnum;
} ReasonCtx;

/* The innermost entry of the stack says what HDF5 saw first; an "errno = N"
 * anywhere in it is the system's reason, which users understand better. */
static herr_t reason_walk(unsigned n, const H5E_error2_t *e, void *data) {
    ReasonCtx *r = data;
    const char *desc = e->desc ? e->desc : "";
    const char *en = strstr(desc, "errno = ");
    if (en && r->errnum == 0) r->errnum = atoi(en + 8);
    if (n == 0) {
        size_t len = strcspn(desc, ",\n");
        snprintf(r->buf, r->cap, "%.*s", (int)len, desc);
    }
    return 0;
}

/* Why the last HDF5 call failed. Must run before any other HDF5 call, which
 * would clear the error stack. */
static const char *h5_reason(char *buf, size_t cap) {
    ReasonCtx r = {buf, cap, 0};
    buf[0] = '\0';
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, reason_walk, &r);
    if (r.errnum > 0) snprintf(buf, cap, "%s", strerror(r.errnum));
    if (!buf[0]) snprintf(buf, cap, "unknown HDF5 error");
    return buf;
}

/* The path without leading slashes; messages print it after a '/'. */
static const char *show(const char *path) {
    while (*path == '/') path++;
    return path;
}

/* The name HDF5 takes, relative to the file's root. */
static const char *h5name(const char *path) {
    const char *p = show(path);
    return *p ? p : ".";
}

static const char *fname(const H5ioFile *f) { return f->path ? f->path : "(closed file)"; }

/* "<file>: cannot <what> /<obj> (<reason>)", the reason read from HDF5;
 * without obj, the file itself is meant. */
static QtStatus h5_fail(QtError *err, QtStatus st, const H5ioFile *f, const char *what, const char *obj) {
    char reason[256];
    h5_reason(reason, sizeof reason);
    if (!obj) return qt_error_set(err, st, "%s: cannot %s (%s)", fname(f), what, reason);
    return qt_error_set(err, st, "%s: cannot %s /%s (%s)", fname(f), what, show(obj), reason);
}

static QtStatus h5_fail_attr(QtError *err, QtStatus st, const H5ioFile *f, const char *what, const char *obj,
                             const char *name) {
    char reason[256];
    h5_reason(reason, sizeof reason);
    return qt_error_set(err, st, "%s: cannot %s attribute '%s' of /%s (%s)", fname(f), what, name, show(obj),
                        reason);
}

/* For h5io_safe.c and h5io_attr.c (h5io_internal.h). */
QtStatus h5io_fail(QtError *err, QtStatus st, const H5ioFile *f, const char *what, const char *obj) {
    return h5_fail(err, st, f, what, obj);
}
QtStatus h5io_fail_attr(QtError *err, QtStatus st, const H5ioFile *f, const char *what, const char *obj,
                        const char *name) {
    return h5_fail_attr(err, st, f, what, obj, name);
}
const char *h5io_fname(const H5ioFile *f) { return fname(f); }
const char *h5io_show(const char *path) { return show(path); }
const char *h5io_h5name(const char *path) { return h5name(path); }

/* ---- files ----------------------------------------------------------------------- */

static QtStatus file_set_path(H5ioFile *f, const char *path, QtError *err) {
    f->id = H5I_INVALID_HID;
    f->writable = false;
    f->path = strdup(path);
    if (!f->path) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the name of %s", path);
    return QT_OK;
}

static void file_reset(H5ioFile *f) {
    free(f->path);
    f->path = NULL;
    f->id = H5I_INVALID_HID;
    f->writable = false;
}

QtStatus h5io_create_mem(H5ioFile *f, const char *path, size_t size_hint, QtError *err) {
    h5io_init();
    QtStatus st = file_set_path(f, path, err);
    if (st != QT_OK) return st;
    size_t step = size_hint < ((size_t)1 << 16) ? (size_t)1 << 16 : size_hint;
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl < 0 || H5Pset_fapl_core(fapl, step, 0) < 0) {
        st = h5_fail(err, QT_ERR_IO, f, "set up an in-memory HDF5 file", NULL);
    } else {
        f->id = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
        if (f->id < 0) st = h5_fail(err, QT_ERR_IO, f, "create an in-memory HDF5 file", NULL);
    }
    if (fapl >= 0) H5Pclose(fapl);
    if (st != QT_OK) {
        file_reset(f);
        return st;
    }
    f->writable = true;
    return QT_OK;
}

/* The system's view first, so a missing or unreadable file gets its own
 * message and not HDF5's guess. */
static QtStatus check_readable(const char *path, QtError *err) {
    struct stat sb;
    if (stat(path, &sb) != 0) return qt_error_set(err, QT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    if (S_ISDIR(sb.st_mode)) return qt_error_set(err, QT_ERR_IO, "cannot open %s: it is a directory", path);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return qt_error_set(err, QT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    close(fd);
    return QT_OK;
}

QtStatus h5io_open(H5ioFile *f, const char *path, QtError *err) {
    h5io_init();
    f->id = H5I_INVALID_HID;
    f->path = NULL;
    f->writable = false;
    QtStatus st = check_readable(path, err);
    if (st != QT_OK) return st;
    htri_t is = H5Fis_hdf5(path);
    char reason[256];
    if (is == 0)
        return qt_error_set(err, QT_ERR_FORMAT, "%s is not an HDF5 file (it lacks the HDF5 signature)", path);
    if (is < 0)
        return qt_error_set(err, QT_ERR_IO, "cannot read %s (%s)", path, h5_reason(reason, sizeof reason));
    if ((st = file_set_path(f, path, err)) != QT_OK) return st;
    /* No lock: files are only read here, and ours are replaced by rename,
     * never modified in place; locks fail on some network file systems. */
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
#if H5_VERSION_GE(1, 10, 7)
    if (fapl >= 0) H5Pset_file_locking(fapl, 0, 1);
#endif
    f->id = H5Fopen(path, H5F_ACC_RDONLY, fapl >= 0 ? fapl : H5P_DEFAULT);
    if (f->id < 0) {
        h5_reason(reason, sizeof reason);
        st = qt_error_set(err, QT_ERR_FORMAT, "%s is an HDF5 file that cannot be opened (%s); it is truncated or "
                          "damaged", path, reason);
    }
    if (fapl >= 0) H5Pclose(fapl);
    if (st != QT_OK) file_reset(f);
    return st;
}

QtStatus h5io_image(H5ioFile *f, void **image, size_t *size, QtError *err) {
    *image = NULL;
    *size = 0;
    /* The image is taken from the driver's memory: without the flush, the
     * metadata still in HDF5's cache would be missing from it. */
    if (H5Fflush(f->id, H5F_SCOPE_GLOBAL) < 0) return h5_fail(err, QT_ERR_IO, f, "flush the file", NULL);
    ssize_t n = H5Fget_file_image(f->id, NULL, 0);
    if (n <= 0) return h5_fail(err, QT_ERR_IO, f, "get the file image", NULL);
    void *buf = malloc((size_t)n);
    if (!buf) return qt_error_set(err, QT_ERR_NOMEM, "%s: cannot allocate %zd bytes for the file image", fname(f), n);
    if (H5Fget_file_image(f->id, buf, (size_t)n) != n) {
        free(buf);
        return h5_fail(err, QT_ERR_IO, f, "get the file image", NULL);
    }
    *image = buf;
    *size = (size_t)n;
    return QT_OK;
}

QtStatus h5io_close(H5ioFile *f, QtError *err) {
    if (f->id < 0) {
        file_reset(f);
        return QT_OK;
    }
    QtStatus st = QT_OK;
    ssize_t open_objs = H5Fget_obj_count(f->id, H5F_OBJ_DATASET | H5F_OBJ_GROUP | H5F_OBJ_DATATYPE | H5F_OBJ_ATTR |
                                                    H5F_OBJ_LOCAL);
    if (open_objs > 0)
        st = qt_error_set(err, QT_ERR_IO, "%s: %zd HDF5 objects are still open at close (a bug in qtrain)", fname(f),
                          open_objs);
    if (H5Fclose(f->id) < 0) st = h5_fail(err, QT_ERR_IO, f, "close the file", NULL);
    file_reset(f);
    return st;
}

/* ---- objects ------------------------------------------------------------------- */

static H5ioKind kind_of_open(hid_t obj) {
    switch (H5Iget_type(obj)) {
    case H5I_GROUP: return H5IO_GROUP;
    case H5I_DATASET: return H5IO_DATASET;
    default: return H5IO_OTHER;
    }
}

/* The kind of the object a hard link `name` in `loc` points to. */
static H5ioKind link_kind(hid_t loc, const char *name) {
    H5L_info_t li;
    if (H5Lget_info(loc, name, &li, H5P_DEFAULT) < 0) return H5IO_MISSING;
    if (li.type != H5L_TYPE_HARD) return H5IO_OTHER;
    hid_t o = H5Oopen(loc, name, H5P_DEFAULT);
    if (o < 0) return H5IO_MISSING;
    H5ioKind k = kind_of_open(o);
    H5Oclose(o);
    return k;
}

H5ioKind h5io_kind(const H5ioFile *f, const char *path) {
    h5io_init();
    const char *p = show(path);
    if (!*p) return H5IO_GROUP;
    char *buf = strdup(p);
    if (!buf) return H5IO_MISSING;
    H5ioKind k = H5IO_MISSING;
    /* H5Lexists fails, rather than saying no, when a parent is missing, so
     * each prefix is checked in turn. */
    for (char *slash = buf;; slash++) {
        slash = strchr(slash, '/');
        if (slash) *slash = '\0';
        k = H5Lexists(f->id, buf, H5P_DEFAULT) > 0 ? link_kind(f->id, buf) : H5IO_MISSING;
        if (!slash || k != H5IO_GROUP) {
            if (slash) k = H5IO_MISSING; /* a parent that is not a group */
            break;
        }
        *slash = '/';
    }
    free(buf);
    return k;
}

/* A group or dataset reached through hard links only. */
bool h5io_reachable(const H5ioFile *f, const char *obj) {
    H5ioKind k = h5io_kind(f, obj);
    return k == H5IO_GROUP || k == H5IO_DATASET;
}

QtStatus h5io_group_create(H5ioFile *f, const char *path, QtError *err) {
    const char *p = show(path);
    if (!*p) return QT_OK;
    char *buf = strdup(p);
    if (!buf) return qt_error_set(err, QT_ERR_NOMEM, "%s: cannot allocate a group path", fname(f));
    QtStatus st = QT_OK;
    for (char *slash = buf; st == QT_OK; slash++) {
        slash = strchr(slash, '/');
        if (slash) *slash = '\0';
        H5ioKind k = h5io_kind(f, buf);
        if (k == H5IO_MISSING) {
            hid_t g = H5Gcreate2(f->id, buf, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
            if (g < 0)
                st = h5_fail(err, QT_ERR_IO, f, "create group", buf);
            else
                H5Gclose(g);
        } else if (k != H5IO_GROUP) {
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: cannot create group /%s: /%s exists and is not a group",
                              fname(f), p, buf);
        }
        if (!slash) break;
        *slash = '/';
    }
    free(buf);
    return st;
}

/* ---- datasets -------------------------------------------------------------------- */

static QtStatus info_from(const H5ioFile *f, const char *path, hid_t space, hid_t type, H5ioInfo *info,
                          QtError *err) {
    memset(info, 0, sizeof *info);
    int rank = H5Sget_simple_extent_ndims(space);
    if (rank < 0) return h5_fail(err, QT_ERR_FORMAT, f, "read the shape of", path);
    if (rank > H5IO_MAX_RANK)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has %d dimensions; at most %d are supported", fname(f),
                            show(path), rank, H5IO_MAX_RANK);
    info->rank = rank;
    if (rank > 0 && H5Sget_simple_extent_dims(space, info->dims, NULL) < 0)
        return h5_fail(err, QT_ERR_FORMAT, f, "read the shape of", path);
    hssize_t np = H5Sget_simple_extent_npoints(space);
    info->numel = np > 0 ? (uint64_t)np : 0;
    info->cls = H5Tget_class(type);
    info->size = H5Tget_size(type);
    if (info->cls == H5T_INTEGER) info->is_signed = H5Tget_sign(type) == H5T_SGN_2;
    if (info->cls == H5T_STRING) info->is_vlen_str = H5Tis_variable_str(type) > 0;
    return QT_OK;
}

/* Opens dataset `path` after checking that every component of the path is
 * a hard link (no soft or external link is followed) and that its storage
 * may be read (h5io_check_storage, h5io_safe.c). */
static QtStatus dataset_open(const H5ioFile *f, const char *path, hid_t *d, QtError *err) {
    *d = H5I_INVALID_HID;
    H5ioKind k = h5io_kind(f, path);
    if (k != H5IO_DATASET) {
        char shown[QT_CLIP_BUF];
        if (k == H5IO_OTHER)
            return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s is a soft or external link or a named type, not a dataset "
                                "(qtrain follows no links in a file)", fname(f), qt_clip(show(path), shown));
        return qt_error_set(err, QT_ERR_FORMAT, "%s: no dataset /%s (a missing object, a group, or a path through a "
                            "link, which qtrain does not follow)", fname(f), qt_clip(show(path), shown));
    }
    hid_t id = H5Dopen2(f->id, h5name(path), H5P_DEFAULT);
    if (id < 0) return h5_fail(err, QT_ERR_FORMAT, f, "open dataset", path);
    QtStatus st = h5io_check_storage(f, path, id, err);
    if (st != QT_OK) {
        H5Dclose(id);
        return st;
    }
    *d = id;
    return QT_OK;
}

/* The type and shape of open dataset d (at path). */
static QtStatus dataset_info(const H5ioFile *f, const char *path, hid_t d, H5ioInfo *info, QtError *err) {
    hid_t space = H5Dget_space(d), type = H5Dget_type(d);
    QtStatus st = space < 0 || type < 0 ? h5_fail(err, QT_ERR_FORMAT, f, "read the type of", path)
                                        : info_from(f, path, space, type, info, err);
    if (type >= 0) H5Tclose(type);
    if (space >= 0) H5Sclose(space);
    return st;
}

QtStatus h5io_dataset_info(const H5ioFile *f, const char *path, H5ioInfo *info, QtError *err) {
    hid_t d;
    QtStatus st = dataset_open(f, path, &d, err);
    if (st != QT_OK) return st;
    st = dataset_info(f, path, d, info, err);
    H5Dclose(d);
    return st;
}

const char *h5io_dtype_str(const H5ioInfo *info, char *buf, size_t cap) {
    switch (info->cls) {
    case H5T_FLOAT: snprintf(buf, cap, "float%zu", info->size * 8); break;
    case H5T_INTEGER: snprintf(buf, cap, "%sint%zu", info->is_signed ? "" : "u", info->size * 8); break;
    case H5T_STRING:
        if (info->is_vlen_str)
            snprintf(buf, cap, "vlen string");
        else
            snprintf(buf, cap, "string%zu", info->size);
        break;
    case H5T_COMPOUND: snprintf(buf, cap, "compound"); break;
    case H5T_ENUM: snprintf(buf, cap, "enum"); break;
    case H5T_ARRAY: snprintf(buf, cap, "array"); break;
    case H5T_VLEN: snprintf(buf, cap, "vlen"); break;
    case H5T_OPAQUE: snprintf(buf, cap, "opaque"); break;
    case H5T_BITFIELD: snprintf(buf, cap, "bitfield"); break;
    case H5T_REFERENCE: snprintf(buf, cap, "reference"); break;
    default: snprintf(buf, cap, "unknown type"); break;
    }
    return buf;
}

const char *h5io_shape_str(const H5ioInfo *info, char *buf, size_t cap) {
    size_t len = 0;
    if (cap == 0) return buf;
    len += (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < info->rank && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%llu", i ? ", " : "", (unsigned long long)info->dims[i]);
    if (len < cap) snprintf(buf + len, cap - len, "%s)", info->rank == 1 ? "," : "");
    return buf;
}

bool h5io_shape_equals(const H5ioInfo *info, int ndim, const int *shape) {
    if (info->rank != ndim) return false;
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0 || info->dims[i] != (hsize_t)shape[i]) return false;
    return true;
}

static QtStatus check_shape_arg(const H5ioFile *f, const char *path, int ndim, const int *shape, hsize_t *dims,
                                QtError *err) {
    if (ndim < 0 || ndim > H5IO_MAX_RANK || (ndim > 0 && !shape))
        return qt_error_set(err, QT_ERR_ARG, "%s: /%s: rank %d is not in 0..%d", fname(f), show(path), ndim,
                            H5IO_MAX_RANK);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return qt_error_set(err, QT_ERR_ARG, "%s: /%s: dimension %d is %d", fname(f), show(path), i, shape[i]);
        dims[i] = (hsize_t)shape[i];
    }
    return QT_OK;
}

QtStatus h5io_write(H5ioFile *f, const char *path, hid_t memtype, const void *data, int ndim, const int *shape,
                    QtError *err) {
    hsize_t dims[H5IO_MAX_RANK];
    QtStatus st = check_shape_arg(f, path, ndim, shape, dims, err);
    if (st != QT_OK) return st;
    hid_t space = H5Screate_simple(ndim, dims, NULL);
    hid_t ftype = H5Tcopy(memtype);
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    hid_t d = H5I_INVALID_HID;
    if (space < 0 || ftype < 0 || lcpl < 0 || H5Tset_order(ftype, H5T_ORDER_LE) < 0 ||
        H5Pset_create_intermediate_group(lcpl, 1) < 0) {
        st = h5_fail(err, QT_ERR_IO, f, "prepare dataset", path);
    } else if ((d = H5Dcreate2(f->id, h5name(path), ftype, space, lcpl, H5P_DEFAULT, H5P_DEFAULT)) < 0) {
        st = h5_fail(err, QT_ERR_IO, f, "create dataset", path);
    } else if (H5Dwrite(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
        st = h5_fail(err, QT_ERR_IO, f, "write dataset", path);
    }
    if (d >= 0 && H5Dclose(d) < 0) st = h5_fail(err, QT_ERR_IO, f, "write dataset", path);
    if (lcpl >= 0) H5Pclose(lcpl);
    if (ftype >= 0) H5Tclose(ftype);
    if (space >= 0) H5Sclose(space);
    return st;
}

const char *h5io_class_name(H5T_class_t c) {
    switch (c) {
    case H5T_FLOAT: return "floating-point";
    case H5T_INTEGER: return "integer";
    case H5T_STRING: return "string";
    default: return "non-numeric";
    }
}

QtStatus h5io_read(const H5ioFile *f, const char *path, hid_t memtype, void *data, int ndim, const int *shape,
                   QtError *err) {
    hsize_t dims[H5IO_MAX_RANK];
    H5ioInfo info;
    hid_t d = H5I_INVALID_HID;
    /* one open: its storage check inflates every compressed chunk */
    QtStatus st = check_shape_arg(f, path, ndim, shape, dims, err);
    if (st == QT_OK) st = dataset_open(f, path, &d, err);
    if (st == QT_OK) st = dataset_info(f, path, d, &info, err);
    H5T_class_t want = H5Tget_class(memtype);
    char got[128], exp[128];
    if (st == QT_OK && info.cls != want) {
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s is %s data, expected %s", fname(f), show(path),
                          h5io_dtype_str(&info, got, sizeof got), h5io_class_name(want));
    } else if (st == QT_OK && !h5io_shape_equals(&info, ndim, shape)) {
        H5ioInfo e = {.rank = ndim};
        memcpy(e.dims, dims, (size_t)ndim * sizeof dims[0]);
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has shape %s, expected %s", fname(f), show(path),
                          h5io_shape_str(&info, got, sizeof got), h5io_shape_str(&e, exp, sizeof exp));
    } else if (st == QT_OK && H5Dread(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
        st = h5_fail(err, QT_ERR_FORMAT, f, "read dataset", path);
    }
    if (d >= 0) H5Dclose(d);
    return st;
}

/* ---- a dataset held open -------------------------------------------------------------- */

QtStatus h5io_dataset_open(const H5ioFile *f, const char *path, H5ioDataset *d, QtError *err) {
    memset(d, 0, sizeof *d);
    d->id = H5I_INVALID_HID;
    hid_t id;
    QtStatus st = dataset_open(f, path, &id, err);
    if (st != QT_OK) return st;
    if ((st = dataset_info(f, path, id, &d->info, err)) != QT_OK) {
        H5Dclose(id);
        return st;
    }
    d->id = id, d->f = f;
    snprintf(d->path, sizeof d->path, "%s", path);
    d->row_elems = 1;
    for (int i = 1; i < d->info.rank; i++) d->row_elems *= d->info.dims[i];
    return QT_OK;
}

QtStatus h5io_dataset_read_rows(const H5ioDataset *d, hid_t memtype, uint64_t row0, uint64_t k, void *out,
                                QtError *err) {
    const H5ioInfo *in = &d->info;
    if (in->rank < 1 || row0 > in->dims[0] || k > in->dims[0] - row0)
        return qt_error_set(err, QT_ERR_ARG, "%s: rows %llu..%llu of /%s, which has %llu", fname(d->f),
                            (unsigned long long)row0, (unsigned long long)(row0 + k), show(d->path),
                            (unsigned long long)(in->rank >= 1 ? in->dims[0] : 0));
    if (k == 0) return QT_OK;
    hsize_t start[H5IO_MAX_RANK] = {0}, count[H5IO_MAX_RANK];
    for (int i = 0; i < in->rank; i++) count[i] = in->dims[i];
    start[0] = row0, count[0] = k;
    hid_t fspace = H5Dget_space(d->id), mspace = H5Screate_simple(in->rank, count, NULL);
    QtStatus st = QT_OK;
    if (fspace < 0 || mspace < 0 || H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, count, NULL) < 0 ||
        H5Dread(d->id, memtype, mspace, fspace, H5P_DEFAULT, out) < 0)
        st = h5_fail(err, QT_ERR_FORMAT, d->f, "read rows of dataset", d->path);
    if (mspace >= 0) H5Sclose(mspace);
    if (fspace >= 0) H5Sclose(fspace);
    return st;
}

void h5io_dataset_close(H5ioDataset *d) {
    if (d && d->id >= 0) H5Dclose(d->id);
    if (d) d->id = H5I_INVALID_HID;
}

/* ---- listing ---------------------------------------------------------------------------- */

typedef struct {
    H5ioVisitFn fn;
    H5ioAttrFn attr_fn;
    void *ctx;
} ListCtx;

static herr_t list_cb(hid_t g, const char *name, const H5L_info_t *info, void *data) {
    ListCtx *c = data;
    H5ioKind k = info->type == H5L_TYPE_HARD ? link_kind(g, name) : H5IO_OTHER;
    return c->fn(name, k, c->ctx) ? 1 : 0;
}

static QtStatus list_group(const H5ioFile *f, const char *group, bool recursive, H5ioVisitFn fn, void *ctx,
                           bool *stopped, QtError *err) {
    h5io_init();
    if (stopped) *stopped = false;
    if (h5io_kind(f, group) != H5IO_GROUP)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: no group /%s (qtrain follows no links in a file)", fname(f),
                            show(group));
    hid_t g = H5Gopen2(f->id, h5name(group), H5P_DEFAULT);
    if (g < 0) return h5_fail(err, QT_ERR_FORMAT, f, "open group", group);
    ListCtx c = {.fn = fn, .ctx = ctx};
    herr_t r = recursive ? H5Lvisit(g, H5_INDEX_NAME, H5_ITER_INC, list_cb, &c)
                         : H5Literate(g, H5_INDEX_NAME, H5_ITER_INC, NULL, list_cb, &c);
    QtStatus st = r < 0 ? h5_fail(err, QT_ERR_FORMAT, f, "list group", group) : QT_OK;
    if (r > 0 && stopped) *stopped = true;
    H5Gclose(g);
    return st;
}

QtStatus h5io_visit(const H5ioFile *f, const char *group, H5ioVisitFn fn, void *ctx, bool *stopped, QtError *err) {
    return list_group(f, group, true, fn, ctx, stopped, err);
}

QtStatus h5io_iterate(const H5ioFile *f, const char *group, H5ioVisitFn fn, void *ctx, bool *stopped,
                      QtError *err) {
    return list_group(f, group, false, fn, ctx, stopped, err);
}

static herr_t attr_cb(hid_t loc, const char *name, const H5A_info_t *info, void *data) {
    (void)loc;
    (void)info;
    ListCtx *c = data;
    return c->attr_fn(name, c->ctx) ? 1 : 0;
}

QtStatus h5io_attr_iterate(const H5ioFile *f, const char *obj, H5ioAttrFn fn, void *ctx, QtError *err) {
    h5io_init();
    if (!h5io_reachable(f, obj))
        return qt_error_set(err, QT_ERR_FORMAT, "%s: no group or dataset /%s (qtrain follows no links in a file)",
                            fname(f), show(obj));
    hid_t o = H5Oopen(f->id, h5name(obj), H5P_DEFAULT);
    if (o < 0) return h5_fail(err, QT_ERR_FORMAT, f, "open", obj);
    ListCtx c = {.attr_fn = fn, .ctx = ctx};
    QtStatus st = QT_OK;
    if (H5Aiterate2(o, H5_INDEX_NAME, H5_ITER_INC, NULL, attr_cb, &c) < 0)
        st = h5_fail(err, QT_ERR_FORMAT, f, "list the attributes of", obj);
    H5Oclose(o);
    return st;
}
