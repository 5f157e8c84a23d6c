/* safetensors_write.c - st_write_f32: a safetensors file of float32
 * tensors, written as the reference implementation writes one (see
 * safetensors.h); the reader is safetensors.c. */
#include "safetensors.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fsutil.h"

typedef struct {
    char *s;
    size_t n, cap;
    bool oom;
} Buf;

static void buf_put(Buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + n + 1) c *= 2;
        char *g = realloc(b->s, c);
        if (!g) {
            b->oom = true;
            return;
        }
        b->s = g, b->cap = c;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void buf_puts(Buf *b, const char *s) { buf_put(b, s, strlen(s)); }

static void buf_printf(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(Buf *b, const char *fmt, ...) {
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k > 0) buf_put(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

/* s as a JSON string: quotes, backslashes and control characters escaped, other bytes (UTF-8) as they are. */
static void buf_json_string(Buf *b, const char *s) {
    buf_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            buf_put(b, e, 2);
        } else if (c < 0x20) buf_printf(b, "\\u%04x", c);
        else buf_put(b, (const char *)&c, 1);
    }
    buf_put(b, "\"", 1);
}

/* Whether the writer may use s as a key: valid UTF-8 (the reader, and every JSON reader, refuses anything else). */
static QtStatus check_write_str(const char *path, const char *s, const char *what, bool name, QtError *err) {
    char shown[QT_CLIP_BUF];
    size_t bad;
    if (!s) return qt_error_set(err, QT_ERR_ARG, "st_write_f32 '%s': a %s is NULL", path, what);
    size_t len = strlen(s);
    if (!st_utf8_valid((const uint8_t *)s, len, &bad))
        return qt_error_set(err, QT_ERR_ARG, "cannot write safetensors file '%s': %s '%s' is not valid UTF-8 (byte "
                            "%zu)", path, what, qt_clip(s, shown), bad);
    if (name && (len == 0 || len >= ST_NAME_MAX))
        return qt_error_set(err, QT_ERR_ARG, "cannot write safetensors file '%s': %s '%s' is %s", path, what,
                            qt_clip(s, shown), len ? "longer than 255 bytes" : "empty");
    return QT_OK;
}

static int by_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* Whether some two of the n strings s[] are equal; *dup the one. */
static QtStatus find_dup(const char **s, int n, const char **dup, QtError *err) {
    *dup = NULL;
    if (n < 2) return QT_OK;
    const char **c = malloc((size_t)n * sizeof *c);
    if (!c) return qt_error_set(err, QT_ERR_NOMEM, "out of memory writing a safetensors file");
    memcpy(c, s, (size_t)n * sizeof *c);
    qsort(c, (size_t)n, sizeof *c, by_str);
    for (int k = 1; k < n && !*dup; k++)
        if (strcmp(c[k - 1], c[k]) == 0) *dup = c[k];
    free(c);
    return QT_OK;
}

/* The header JSON (padded with spaces so the data starts at a multiple of 8) into b; the checks of the arguments. */
static QtStatus build_header(const char *path, const StWrite *t, int n, const char *const (*meta)[2], int n_meta,
                             Buf *b, QtError *err) {
    char shown[QT_CLIP_BUF];
    const char **names = malloc((size_t)(n + n_meta + 1) * sizeof *names);
    if (!names) return qt_error_set(err, QT_ERR_NOMEM, "out of memory writing safetensors file '%s'", path);
    QtStatus st = QT_OK;
    const char *dup = NULL;
    for (int k = 0; st == QT_OK && k < n_meta; k++) {
        st = check_write_str(path, meta[k][0], "metadata key", false, err);
        if (st == QT_OK) st = check_write_str(path, meta[k][1], "metadata value", false, err);
        names[k] = meta[k][0];
    }
    if (st == QT_OK) st = find_dup(names, n_meta, &dup, err);
    if (st == QT_OK && dup)
        st = qt_error_set(err, QT_ERR_ARG, "cannot write safetensors file '%s': metadata key '%s' given twice", path,
                          qt_clip(dup, shown));
    for (int k = 0; st == QT_OK && k < n; k++) {
        st = check_write_str(path, t[k].name, "tensor name", true, err);
        if (st == QT_OK && strcmp(t[k].name, "__metadata__") == 0)
            st = qt_error_set(err, QT_ERR_ARG, "cannot write safetensors file '%s': '__metadata__' is not a tensor "
                              "name (the format reserves it)", path);
        names[k] = t[k].name;
    }
    if (st == QT_OK) st = find_dup(names, n, &dup, err);
    if (st == QT_OK && dup)
        st = qt_error_set(err, QT_ERR_ARG, "cannot write safetensors file '%s': tensor '%s' given twice", path,
                          qt_clip(dup, shown));
    free(names);
    if (st != QT_OK) return st;
    buf_put(b, "{", 1);
    if (n_meta > 0) {
        buf_put(b, "\"__metadata__\":{", 16);
        for (int k = 0; k < n_meta; k++) {
            if (k) buf_put(b, ",", 1);
            buf_json_string(b, meta[k][0]);
            buf_put(b, ":", 1);
            buf_json_string(b, meta[k][1]);
        }
        buf_put(b, "}", 1);
    }
    uint64_t at = 0;
    for (int k = 0; k < n; k++) {
        const StWrite *w = &t[k];
        if (w->ndim < 0 || w->ndim > ST_MAX_DIMS)
            return qt_error_set(err, QT_ERR_ARG, "cannot write safetensors file '%s': tensor '%s' has %d dimensions "
                                "(0 to %d)", path, qt_clip(w->name, shown), w->ndim, ST_MAX_DIMS);
        uint64_t elems = 1;
        for (int d = 0; d < w->ndim; d++) {
            if (w->shape[d] < 0 || (w->shape[d] > 0 && elems > (UINT64_MAX / 8 - at) / (uint64_t)w->shape[d]))
                return qt_error_set(err, QT_ERR_ARG, "cannot write safetensors file '%s': tensor '%s' has a "
                                    "negative or too large dimension %" PRId64, path, qt_clip(w->name, shown),
                                    w->shape[d]);
            elems *= (uint64_t)w->shape[d];
        }
        const uint64_t size = w->data_i64 ? 8 : 4;
        if (elems > 0 && !w->data && !w->data_i64)
            return qt_error_set(err, QT_ERR_ARG, "cannot write safetensors file '%s': tensor '%s' has no data", path,
                                qt_clip(w->name, shown));
        buf_put(b, n_meta > 0 || k > 0 ? "," : "", n_meta > 0 || k > 0);
        buf_json_string(b, w->name);
        buf_puts(b, w->data_i64 ? ":{\"dtype\":\"I64\",\"shape\":[" : ":{\"dtype\":\"F32\",\"shape\":[");
        for (int d = 0; d < w->ndim; d++) buf_printf(b, "%s%" PRId64, d ? "," : "", w->shape[d]);
        buf_printf(b, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", at, at + elems * size);
        at += elems * size;
    }
    buf_put(b, "}", 1);
    while (!b->oom && b->n % 8) buf_put(b, " ", 1);
    if (b->oom) return qt_error_set(err, QT_ERR_NOMEM, "out of memory writing safetensors file '%s'", path);
    if (b->n > ST_HEADER_MAX)
        return qt_error_set(err, QT_ERR_ARG, "cannot write safetensors file '%s': its header would be %zu bytes, "
                            "more than readers accept (%" PRIu64 ")", path, b->n, ST_HEADER_MAX);
    return QT_OK;
}

static QtStatus write_error(const char *path, int e, QtError *err) {
    char hint[256] = "";
    if (e == EFBIG) qt_file_too_large_hint(hint, sizeof hint);
    return qt_error_set(err, QT_ERR_IO, "cannot write safetensors file '%s': %s%s%s", path, strerror(e),
                        *hint ? "; " : "", hint);
}

QtStatus st_write_f32(const char *path, const StWrite *t, int n, const char *const (*meta)[2], int n_meta,
                      QtError *err) {
    if (!path || !*path || n < 0 || n_meta < 0 || (n > 0 && !t) || (n_meta > 0 && !meta))
        return qt_error_set(err, QT_ERR_ARG, "st_write_f32: no path, or no tensors or metadata where counted");
    Buf b = {0};
    QtStatus st = build_header(path, t, n, meta, n_meta, &b, err);
    if (st != QT_OK) {
        free(b.s);
        return st;
    }
    char tmp[ST_PATH_MAX + 64];
    FILE *fp = fs_fopen_tmp(path, tmp, sizeof tmp);
    if (!fp) {
        free(b.s);
        return write_error(path, errno, err);
    }
    uint8_t len[8];
    for (int k = 0; k < 8; k++) len[k] = (uint8_t)((uint64_t)b.n >> (8 * k));
    bool ok = fwrite(len, 1, 8, fp) == 8 && fwrite(b.s, 1, b.n, fp) == b.n;
    free(b.s);
    uint8_t chunk[4096];
    for (int k = 0; ok && k < n; k++) {
        size_t elems = 1;
        for (int d = 0; d < t[k].ndim; d++) elems *= (size_t)t[k].shape[d];
        const size_t size = t[k].data_i64 ? 8 : 4; /* little-endian whatever the host */
        for (size_t i = 0; ok && i < elems;) {
            size_t m = elems - i < sizeof chunk / size ? elems - i : sizeof chunk / size;
            for (size_t j = 0; j < m; j++) {
                uint64_t u;
                if (t[k].data_i64) memcpy(&u, &t[k].data_i64[i + j], 8);
                else {
                    uint32_t v;
                    memcpy(&v, &t[k].data[i + j], 4);
                    u = v;
                }
                for (size_t q = 0; q < size; q++) chunk[size * j + q] = (uint8_t)(u >> (8 * q));
            }
            ok = fwrite(chunk, 1, m * size, fp) == m * size;
            i += m;
        }
    }
    int e = ok ? 0 : errno ? errno : EIO;
    if (!ok) {
        fclose(fp);
        unlink(tmp);
        return write_error(path, e, err);
    }
    if (fs_fcommit_tmp(fp, tmp, path, FS_REPLACE_REGULAR) != 0) return write_error(path, errno, err);
    return QT_OK;
}
