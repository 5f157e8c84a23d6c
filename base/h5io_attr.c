/* h5io_attr.c - attributes: writing, reading, and their values as text. */
#include "h5io.h"
#include "h5io_internal.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- attributes ------------------------------------------------------------------- */

bool h5io_attr_exists(const H5ioFile *f, const char *obj, const char *name) {
    h5io_init();
    return h5io_reachable(f, obj) && H5Aexists_by_name(f->id, h5io_h5name(obj), name, H5P_DEFAULT) > 0;
}

/* Writes an attribute of file type `ftype` from memory type `mtype`: a
 * scalar (n < 0) or n values in one dimension. */
static QtStatus attr_write(H5ioFile *f, const char *obj, const char *name, hid_t ftype, hid_t mtype,
                           const void *buf, int n, QtError *err) {
    const char *o = h5io_h5name(obj);
    htri_t exists = H5Aexists_by_name(f->id, o, name, H5P_DEFAULT);
    if (exists < 0) return h5io_fail_attr(err, QT_ERR_IO, f, "write", obj, name);
    if (exists > 0 && H5Adelete_by_name(f->id, o, name, H5P_DEFAULT) < 0)
        return h5io_fail_attr(err, QT_ERR_IO, f, "replace", obj, name);
    QtStatus st = QT_OK;
    hsize_t dims[1] = {(hsize_t)(n < 0 ? 0 : n)};
    hid_t space = n < 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, dims, NULL);
    hid_t a = space < 0 ? H5I_INVALID_HID : H5Acreate_by_name(f->id, o, name, ftype, space, H5P_DEFAULT,
                                                               H5P_DEFAULT, H5P_DEFAULT);
    if (a < 0 || H5Awrite(a, mtype, buf) < 0) st = h5io_fail_attr(err, QT_ERR_IO, f, "write", obj, name);
    if (a >= 0) H5Aclose(a);
    if (space >= 0) H5Sclose(space);
    return st;
}

QtStatus h5io_attr_write_i64(H5ioFile *f, const char *obj, const char *name, int64_t v, QtError *err) {
    return attr_write(f, obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v, -1, err);
}

QtStatus h5io_attr_write_i64s(H5ioFile *f, const char *obj, const char *name, const int64_t *v, int n,
                              QtError *err) {
    return attr_write(f, obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, v, n, err);
}

QtStatus h5io_attr_write_u64(H5ioFile *f, const char *obj, const char *name, uint64_t v, QtError *err) {
    return attr_write(f, obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &v, -1, err);
}

QtStatus h5io_attr_write_f64(H5ioFile *f, const char *obj, const char *name, double v, QtError *err) {
    return attr_write(f, obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v, -1, err);
}

/* The longest fixed-length string attribute: an attribute lives in its
 * object's header, whose messages HDF5 limits to 64 KiB. */
#define ATTR_FIXED_MAX 60000

/* Fixed-length: the bytes sit in the attribute itself. A variable-length
 * string would be stored in the file's global heap, and reading one back
 * goes through code of libhdf5 that crashes or hangs on a damaged heap
 * (h5io_attr_read_str reads such strings in a child process). Only a
 * string too long for an object header (a config of 60 KB) is written
 * variable-length, as the one way to store it. */
QtStatus h5io_attr_write_str(H5ioFile *f, const char *obj, const char *name, const char *v, QtError *err) {
    if (!v) v = "";
    hid_t t = H5Tcopy(H5T_C_S1);
    size_t len = strlen(v);
    bool fixed = len <= ATTR_FIXED_MAX;
    herr_t ok = t < 0 ? -1 : H5Tset_cset(t, H5T_CSET_UTF8);
    if (ok >= 0) ok = H5Tset_size(t, !fixed ? H5T_VARIABLE : len ? len : 1);
    if (ok >= 0 && fixed) ok = H5Tset_strpad(t, H5T_STR_NULLPAD);
    QtStatus st = ok < 0 ? h5io_fail_attr(err, QT_ERR_IO, f, "prepare", obj, name)
                         : attr_write(f, obj, name, t, t, fixed ? (const void *)v : (const void *)&v, -1, err);
    if (t >= 0) H5Tclose(t);
    return st;
}

/* Opens attribute `name` of `obj` as *a and reads its class and element
 * count; a missing object or attribute is QT_ERR_FORMAT naming both. */
static QtStatus attr_open(const H5ioFile *f, const char *obj, const char *name, hid_t *a, H5T_class_t *cls,
                          hssize_t *n, QtError *err) {
    h5io_init();
    *a = H5I_INVALID_HID;
    if (!h5io_reachable(f, obj))
        return qt_error_set(err, QT_ERR_FORMAT, "%s: no group or dataset /%s (looking for its attribute '%s'; "
                            "qtrain follows no links in a file)", h5io_fname(f), h5io_show(obj), name);
    if (H5Aexists_by_name(f->id, h5io_h5name(obj), name, H5P_DEFAULT) <= 0)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has no attribute '%s'", h5io_fname(f), h5io_show(obj), name);
    hid_t id = H5Aopen_by_name(f->id, h5io_h5name(obj), name, H5P_DEFAULT, H5P_DEFAULT);
    hid_t t = id >= 0 ? H5Aget_type(id) : H5I_INVALID_HID;
    hid_t s = id >= 0 ? H5Aget_space(id) : H5I_INVALID_HID;
    QtStatus st = QT_OK;
    if (id < 0 || t < 0 || s < 0) {
        st = h5io_fail_attr(err, QT_ERR_FORMAT, f, "open", obj, name);
    } else {
        *cls = H5Tget_class(t);
        *n = H5Sget_simple_extent_npoints(s);
    }
    if (t >= 0) H5Tclose(t);
    if (s >= 0) H5Sclose(s);
    if (st != QT_OK && id >= 0) H5Aclose(id);
    if (st == QT_OK) *a = id;
    return st;
}

/* Up to cap numbers of attribute `name` into v as mtype: integers, or (floats_too) integers or floats. */
static QtStatus attr_read_array(const H5ioFile *f, const char *obj, const char *name, bool floats_too, hid_t mtype,
                                void *v, int cap, int *n, QtError *err) {
    H5T_class_t cls = H5T_NO_CLASS;
    hssize_t count = 0;
    hid_t a;
    QtStatus st = attr_open(f, obj, name, &a, &cls, &count, err);
    if (st != QT_OK) return st;
    if (!(cls == H5T_INTEGER || (floats_too && cls == H5T_FLOAT)))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s holds %s data, expected %s", h5io_fname(f),
                          name, h5io_show(obj), h5io_class_name(cls), floats_too ? "numbers" : "integers");
    else if (count < 0 || count > cap)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s has %lld values, expected at most %d",
                          h5io_fname(f), name, h5io_show(obj), (long long)count, cap);
    else if (H5Aread(a, mtype, v) < 0)
        st = h5io_fail_attr(err, QT_ERR_FORMAT, f, "read", obj, name);
    else
        *n = (int)count;
    H5Aclose(a);
    return st;
}

QtStatus h5io_attr_read_i64s(const H5ioFile *f, const char *obj, const char *name, int64_t *v, int cap, int *n,
                             QtError *err) {
    return attr_read_array(f, obj, name, false, H5T_NATIVE_INT64, v, cap, n, err);
}

QtStatus h5io_attr_read_f64s(const H5ioFile *f, const char *obj, const char *name, double *v, int cap, int *n,
                             QtError *err) {
    return attr_read_array(f, obj, name, true, H5T_NATIVE_DOUBLE, v, cap, n, err);
}

QtStatus h5io_attr_numel(const H5ioFile *f, const char *obj, const char *name, int64_t *n, QtError *err) {
    H5T_class_t cls = H5T_NO_CLASS;
    hssize_t count = 0;
    hid_t a;
    QtStatus st = attr_open(f, obj, name, &a, &cls, &count, err);
    if (st != QT_OK) return st;
    *n = count;
    H5Aclose(a);
    return QT_OK;
}

static QtStatus attr_read_scalar(const H5ioFile *f, const char *obj, const char *name, bool allow_float,
                                 hid_t mtype, void *out, QtError *err) {
    H5T_class_t cls = H5T_NO_CLASS;
    hssize_t n = 0;
    hid_t a;
    QtStatus st = attr_open(f, obj, name, &a, &cls, &n, err);
    if (st != QT_OK) return st;
    if (!(cls == H5T_INTEGER || (allow_float && cls == H5T_FLOAT)))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s holds %s data, expected %s", h5io_fname(f),
                          name, h5io_show(obj), h5io_class_name(cls), allow_float ? "a number" : "an integer");
    else if (n != 1)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s has %lld values, expected one", h5io_fname(f),
                          name, h5io_show(obj), (long long)n);
    else if (H5Aread(a, mtype, out) < 0)
        st = h5io_fail_attr(err, QT_ERR_FORMAT, f, "read", obj, name);
    H5Aclose(a);
    return st;
}

QtStatus h5io_attr_read_i64(const H5ioFile *f, const char *obj, const char *name, int64_t *v, QtError *err) {
    return attr_read_scalar(f, obj, name, false, H5T_NATIVE_INT64, v, err);
}

QtStatus h5io_attr_read_u64(const H5ioFile *f, const char *obj, const char *name, uint64_t *v, QtError *err) {
    return attr_read_scalar(f, obj, name, false, H5T_NATIVE_UINT64, v, err);
}

QtStatus h5io_attr_read_f64(const H5ioFile *f, const char *obj, const char *name, double *v, QtError *err) {
    return attr_read_scalar(f, obj, name, true, H5T_NATIVE_DOUBLE, v, err);
}

/* Reads a scalar string attribute already open as `a` into a malloc'd copy. */
static QtStatus attr_read_open_str(const H5ioFile *f, const char *obj, const char *name, hid_t a, char **v,
                                   QtError *err) {
    hid_t ft = H5Aget_type(a);
    hid_t mt = ft >= 0 ? H5Tcopy(ft) : H5I_INVALID_HID;
    QtStatus st = QT_OK;
    htri_t vlen = mt >= 0 ? H5Tis_variable_str(mt) : -1;
    size_t size = ft >= 0 ? H5Tget_size(ft) : 0;
    if (vlen == 0 && size > H5IO_ATTR_STR_MAX) {
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s is a string of %zu bytes, more than %zu",
                          h5io_fname(f), name, h5io_show(obj), size, H5IO_ATTR_STR_MAX);
    } else if (vlen < 0 ||
               (vlen == 0 && (H5Tset_size(mt, size + 1) < 0 || H5Tset_strpad(mt, H5T_STR_NULLTERM) < 0))) {
        st = h5io_fail_attr(err, QT_ERR_FORMAT, f, "read", obj, name);
    } else if (vlen) {
        st = h5io_attr_read_vlen(f, obj, name, a, mt, v, err);
    } else {
        *v = calloc(size + 1, 1);
        if (*v && H5Aread(a, mt, *v) < 0) {
            st = h5io_fail_attr(err, QT_ERR_FORMAT, f, "read", obj, name);
            free(*v);
            *v = NULL;
        }
    }
    if (st == QT_OK && !*v)
        st = qt_error_set(err, QT_ERR_NOMEM, "%s: cannot allocate attribute '%s'", h5io_fname(f), name);
    if (mt >= 0) H5Tclose(mt);
    if (ft >= 0) H5Tclose(ft);
    return st;
}

QtStatus h5io_attr_read_str(const H5ioFile *f, const char *obj, const char *name, char **v, QtError *err) {
    *v = NULL;
    H5T_class_t cls = H5T_NO_CLASS;
    hssize_t n = 0;
    hid_t a;
    QtStatus st = attr_open(f, obj, name, &a, &cls, &n, err);
    if (st != QT_OK) return st;
    if (cls != H5T_STRING)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s holds %s data, expected a string",
                          h5io_fname(f), name, h5io_show(obj), h5io_class_name(cls));
    else if (n != 1)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s has %lld strings, expected one", h5io_fname(f),
                          name, h5io_show(obj), (long long)n);
    else
        st = attr_read_open_str(f, obj, name, a, v, err);
    H5Aclose(a);
    return st;
}

/* ---- attribute values as text ---------------------------------------------------------- */

static void append(char *buf, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void append(char *buf, size_t cap, const char *fmt, ...) {
    size_t len = strlen(buf);
    if (len + 1 >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, cap - len, fmt, ap);
    va_end(ap);
}

/* Up to 8 numbers of an integer or float attribute. */
static QtStatus format_numbers(const H5ioFile *f, const char *obj, const char *name, hid_t a, H5T_class_t cls,
                               hssize_t n, char *buf, size_t cap, QtError *err) {
    hid_t ft = H5Aget_type(a);
    bool is_unsigned = ft >= 0 && cls == H5T_INTEGER && H5Tget_sign(ft) == H5T_SGN_NONE;
    if (ft >= 0) H5Tclose(ft);
    hid_t mt = cls == H5T_FLOAT ? H5T_NATIVE_DOUBLE : is_unsigned ? H5T_NATIVE_UINT64 : H5T_NATIVE_INT64;
    union {
        double d;
        int64_t i;
        uint64_t u;
    } *vals = malloc((size_t)(n > 0 ? n : 1) * sizeof *vals);
    if (!vals) return qt_error_set(err, QT_ERR_NOMEM, "%s: cannot allocate attribute '%s'", h5io_fname(f), name);
    QtStatus st = QT_OK;
    if (n > 0 && H5Aread(a, mt, vals) < 0) {
        st = h5io_fail_attr(err, QT_ERR_FORMAT, f, "read", obj, name);
    } else {
        buf[0] = '\0';
        if (n != 1) append(buf, cap, "[");
        for (hssize_t i = 0; i < n && i < 8; i++) {
            if (i) append(buf, cap, ", ");
            if (cls == H5T_FLOAT)
                append(buf, cap, "%.10g", vals[i].d);
            else if (is_unsigned)
                append(buf, cap, "%" PRIu64, vals[i].u);
            else
                append(buf, cap, "%" PRId64, vals[i].i);
        }
        if (n > 8) append(buf, cap, ", ... (%lld values)", (long long)n);
        if (n != 1) append(buf, cap, "]");
    }
    free(vals);
    return st;
}

/* A quoted string cut to its first line and max_str characters. */
static void format_string(const char *s, size_t max_str, char *buf, size_t cap) {
    size_t len = strlen(s), line = strcspn(s, "\n"), lines = 1;
    for (const char *p = s; *p; p++) lines += *p == '\n' && p[1];
    size_t shown = line < max_str ? line : max_str;
    snprintf(buf, cap, "\"%.*s%s\"", (int)shown, s, shown < len ? "..." : "");
    if (shown < len) append(buf, cap, " (%zu chars, %zu line%s)", len, lines, lines == 1 ? "" : "s");
}

QtStatus h5io_attr_format(const H5ioFile *f, const char *obj, const char *name, size_t max_str, char *buf,
                          size_t cap, QtError *err) {
    H5T_class_t cls = H5T_NO_CLASS;
    hssize_t n = 0;
    if (cap) buf[0] = '\0';
    hid_t a;
    QtStatus st = attr_open(f, obj, name, &a, &cls, &n, err);
    if (st != QT_OK) return st;
    if (cls == H5T_INTEGER || cls == H5T_FLOAT) {
        st = format_numbers(f, obj, name, a, cls, n, buf, cap, err);
    } else if (cls == H5T_STRING && n == 1) {
        char *s = NULL;
        st = attr_read_open_str(f, obj, name, a, &s, err);
        if (st == QT_OK) format_string(s, max_str, buf, cap);
        free(s);
    } else {
        hid_t t = H5Aget_type(a);
        H5ioInfo info = {.cls = cls, .size = t >= 0 ? H5Tget_size(t) : 0};
        if (t >= 0) H5Tclose(t);
        char ty[32];
        snprintf(buf, cap, "<%lld x %s>", (long long)n, h5io_dtype_str(&info, ty, sizeof ty));
    }
    H5Aclose(a);
    return st;
}
