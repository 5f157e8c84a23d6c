/* h5io.h - small HDF5 helpers: files, nested groups, numeric datasets,
 * scalar attributes and listings, with every failure turned into a QtError
 * that names the file and the object.
 *
 * Object paths are relative to the file's root ("params/conv1/weight"; a
 * leading '/' is allowed; "" or "/" is the root). HDF5's own error printing
 * is switched off the first time any function here runs, so the library
 * never writes to stderr; its error stack is read instead, to explain a
 * failure (e.g. "No space left on device").
 *
 * Files are written in memory (HDF5's core driver) and handed out as an
 * image, which the caller writes to disk itself. HDF5 1.10 does not recover
 * from a failed H5Fclose of a file on disk (a full disk at close leaves an
 * ID that crashes the library's exit handler), and writing the bytes with
 * write(2) gives exact errors and control over fsync and rename. */
#ifndef QTRAIN_BASE_H5IO_H
#define QTRAIN_BASE_H5IO_H

#include <hdf5.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

#define H5IO_MAX_RANK 8

typedef struct H5ioFile {
    hid_t id;       /* the open file; H5I_INVALID_HID when closed */
    char *path;     /* for messages (malloc'd copy); NULL when closed */
    bool writable;
} H5ioFile;

/* A closed file: safe to pass to h5io_close. */
#define H5IO_FILE_INIT {H5I_INVALID_HID, NULL, false}

/* Switches off HDF5's automatic error printing (once; every function below
 * calls it, so callers using the HDF5 API directly may call it first). */
void h5io_init(void);

/* A new, empty file in memory; `path` only names it in messages. size_hint:
 * the expected size in bytes (the memory grows in steps of about this). */
QtStatus h5io_create_mem(H5ioFile *f, const char *path, size_t size_hint, QtError *err);
/* Opens `path` read-only. QT_ERR_IO if it cannot be read (missing,
 * unreadable, a directory), QT_ERR_FORMAT if it is not HDF5 ("not an HDF5
 * file") or HDF5 cannot open it (truncated or damaged). */
QtStatus h5io_open(H5ioFile *f, const char *path, QtError *err);
/* The bytes of a file made by h5io_create_mem, after flushing it: *image is
 * malloc'd (the caller frees), *size its length. Close every object first. */
QtStatus h5io_image(H5ioFile *f, void **image, size_t *size, QtError *err);
/* Closes the file (no-op if closed). Objects still open in it are an error:
 * they would keep the file open behind the caller's back. */
QtStatus h5io_close(H5ioFile *f, QtError *err);

/* ---- objects ------------------------------------------------------------- */

typedef enum { H5IO_MISSING, H5IO_GROUP, H5IO_DATASET, H5IO_OTHER } H5ioKind;

/* What `path` is; H5IO_MISSING if any component does not exist. Soft and
 * external links are H5IO_OTHER and are not followed. */
H5ioKind h5io_kind(const H5ioFile *f, const char *path);
static inline bool h5io_exists(const H5ioFile *f, const char *path) { return h5io_kind(f, path) != H5IO_MISSING; }
/* Creates group `path` and any missing parents; an existing group is fine. */
QtStatus h5io_group_create(H5ioFile *f, const char *path, QtError *err);

/* A dataset's shape and element type. */
typedef struct {
    int rank;                      /* 0 = scalar */
    hsize_t dims[H5IO_MAX_RANK];   /* dims[0..rank-1] */
    uint64_t numel;
    H5T_class_t cls;               /* H5T_FLOAT, H5T_INTEGER, H5T_STRING, ... */
    size_t size;                   /* bytes per element (H5T_VARIABLE-sized strings: pointer size) */
    bool is_signed;                /* integers */
    bool is_vlen_str;
} H5ioInfo;

QtStatus h5io_dataset_info(const H5ioFile *f, const char *path, H5ioInfo *info, QtError *err);
/* "float32", "int64", "uint8", "string", "vlen string", "compound", ... */
const char *h5io_dtype_str(const H5ioInfo *info, char *buf, size_t cap);
/* "(3, 1, 3, 3)"; "()" for a scalar. */
const char *h5io_shape_str(const H5ioInfo *info, char *buf, size_t cap);
bool h5io_shape_equals(const H5ioInfo *info, int ndim, const int *shape);
static inline bool h5io_is_f32(const H5ioInfo *info) { return info->cls == H5T_FLOAT && info->size == 4; }

/* Writes a new dataset `path` (parents created) of shape (ndim, shape),
 * from data in memtype (e.g. H5T_NATIVE_FLOAT, H5T_NATIVE_UINT8), stored as
 * the little-endian type of the same class and size. */
QtStatus h5io_write(H5ioFile *f, const char *path, hid_t memtype, const void *data, int ndim, const int *shape,
                    QtError *err);
static inline QtStatus h5io_write_f32(H5ioFile *f, const char *path, const float *data, int ndim, const int *shape,
                                      QtError *err) {
    return h5io_write(f, path, H5T_NATIVE_FLOAT, data, ndim, shape, err);
}
/* Every function that opens a dataset (h5io_dataset_info, h5io_read)
 * first checks that each component of its path is a hard link (no soft or
 * external link is followed; external links cannot be traversed at all
 * once h5io_init ran) and that its data may be read: stored in this file
 * (contiguous, chunked or compact; no external storage, no virtual
 * dataset), written (its storage allocated, unless it has no elements),
 * filtered only by deflate, shuffle or fletcher32, in chunks no larger
 * than the dataset, each stored no larger than it needs and inflating to at
 * most its size (h5io_safe.c). Otherwise QT_ERR_FORMAT "refusing dataset
 * /<path>: ...". */

/* Reads dataset `path` into data (memtype) after checking that it has
 * exactly the shape (ndim, shape) and the same type class as memtype
 * (QT_ERR_FORMAT naming both shapes or types otherwise). */
QtStatus h5io_read(const H5ioFile *f, const char *path, hid_t memtype, void *data, int ndim, const int *shape,
                   QtError *err);
static inline QtStatus h5io_read_f32(const H5ioFile *f, const char *path, float *data, int ndim, const int *shape,
                                     QtError *err) {
    return h5io_read(f, path, H5T_NATIVE_FLOAT, data, ndim, shape, err);
}

/* ---- a dataset held open, read in slices along its first axis ----------------- */

/* An open dataset of an untrusted file, checked as h5io_read checks it. */
typedef struct {
    hid_t id;           /* H5I_INVALID_HID when closed */
    const H5ioFile *f;  /* the file it is in (must stay open) */
    char path[256];     /* for messages */
    H5ioInfo info;
    uint64_t row_elems; /* elements per index of the first axis (1 for rank 1) */
} H5ioDataset;

QtStatus h5io_dataset_open(const H5ioFile *f, const char *path, H5ioDataset *d, QtError *err);
/* Rows row0..row0+k-1 (indices of the first axis) into out, converted to
 * memtype (HDF5's conversion: the same class, any size and byte order).
 * Rank >= 1. QT_ERR_ARG if the range is outside the dataset. */
QtStatus h5io_dataset_read_rows(const H5ioDataset *d, hid_t memtype, uint64_t row0, uint64_t k, void *out,
                                QtError *err);
void h5io_dataset_close(H5ioDataset *d);

/* ---- attributes (scalars, on the group or dataset `obj`) ---------------------- */

bool h5io_attr_exists(const H5ioFile *f, const char *obj, const char *name);
/* Each write replaces an existing attribute of the same name. */
QtStatus h5io_attr_write_i64(H5ioFile *f, const char *obj, const char *name, int64_t v, QtError *err);
/* A one-dimensional int64 attribute of n values (a shape). */
QtStatus h5io_attr_write_i64s(H5ioFile *f, const char *obj, const char *name, const int64_t *v, int n,
                              QtError *err);
/* Reads an integer attribute of at most cap values into v, its count into *n. */
QtStatus h5io_attr_read_i64s(const H5ioFile *f, const char *obj, const char *name, int64_t *v, int cap, int *n,
                             QtError *err);
/* Up to cap numbers (integer or float) as doubles; *n gets their count. */
QtStatus h5io_attr_read_f64s(const H5ioFile *f, const char *obj, const char *name, double *v, int cap, int *n,
                             QtError *err);
/* How many elements the attribute holds (a list of class names: its length), whatever their type. */
QtStatus h5io_attr_numel(const H5ioFile *f, const char *obj, const char *name, int64_t *n, QtError *err);
QtStatus h5io_attr_write_u64(H5ioFile *f, const char *obj, const char *name, uint64_t v, QtError *err);
QtStatus h5io_attr_write_f64(H5ioFile *f, const char *obj, const char *name, double v, QtError *err);
/* Fixed-length UTF-8, null-padded, of strlen(v) bytes (h5py reads bytes).
 * Variable-length strings live in the global heap, which libhdf5 reads
 * unchecked (see h5io_attr_read_str), so only a string of more than 60000
 * bytes, too long for an object header, is written variable-length. */
QtStatus h5io_attr_write_str(H5ioFile *f, const char *obj, const char *name, const char *v, QtError *err);

/* Reads need exactly one element. QT_ERR_FORMAT if the attribute is missing
 * ("has no attribute") or of another class (a string where an integer is
 * expected); integers of any width and sign are accepted. */
QtStatus h5io_attr_read_i64(const H5ioFile *f, const char *obj, const char *name, int64_t *v, QtError *err);
QtStatus h5io_attr_read_u64(const H5ioFile *f, const char *obj, const char *name, uint64_t *v, QtError *err);
/* From a float or an integer attribute. */
QtStatus h5io_attr_read_f64(const H5ioFile *f, const char *obj, const char *name, double *v, QtError *err);
/* Fixed- or variable-length, at most 16 MiB; *v is malloc'd (the caller
 * frees). A variable-length string (h5py's str) is read in a child process,
 * so a damaged global heap, on which libhdf5 crashes or loops, is a
 * QT_ERR_FORMAT naming the attribute and not a crash. */
QtStatus h5io_attr_read_str(const H5ioFile *f, const char *obj, const char *name, char **v, QtError *err);
/* Any attribute's value as text: numbers (up to 8 of an array, then "..."),
 * strings quoted and cut to their first line and `max_str` characters with
 * the full length noted. For listings. */
QtStatus h5io_attr_format(const H5ioFile *f, const char *obj, const char *name, size_t max_str, char *buf,
                          size_t cap, QtError *err);

/* ---- listing ------------------------------------------------------------------ */

/* Called with a path relative to the listed group; return 0 to go on, any
 * other value to stop (the listing function then returns QT_OK and
 * *stopped, if given, is set). */
typedef int (*H5ioVisitFn)(const char *path, H5ioKind kind, void *ctx);
typedef int (*H5ioAttrFn)(const char *name, void *ctx);

/* Every object below `group`, recursively, in name order, each group
 * followed by its contents. */
QtStatus h5io_visit(const H5ioFile *f, const char *group, H5ioVisitFn fn, void *ctx, bool *stopped, QtError *err);
/* The direct children of `group`, in name order. */
QtStatus h5io_iterate(const H5ioFile *f, const char *group, H5ioVisitFn fn, void *ctx, bool *stopped, QtError *err);
/* The attributes of `obj`, in name order. */
QtStatus h5io_attr_iterate(const H5ioFile *f, const char *obj, H5ioAttrFn fn, void *ctx, QtError *err);

#endif
