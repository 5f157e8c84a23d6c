/* npy.c - NumPy .npy files from untrusted input (npy.h).
 *
 * The header is a Python dict literal. NumPy reads it with
 * ast.literal_eval; here a small parser accepts exactly the subset NumPy
 * and the other common writers produce: '...' or "..." keys and strings
 * without escapes, True/False, a tuple of non-negative decimal integers,
 * spaces between tokens, an optional trailing comma, and space padding up
 * to the final '\n'. Anything else is refused with the byte it stopped at,
 * so a damaged header never turns into a plausible shape. */
#include "npy.h"
#include "base/fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char NPY_MAGIC[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};
/* The descrs qtrain reads, for the messages that refuse another one. */
#define NPY_ACCEPTED "|u1 |i1 <u2 <i2 <u4 <i4 <u8 <i8 <f2 <f4 <f8 |b1"
/* Longest descr string looked at; NumPy's are at most a few characters. */
#define NPY_DESCR_MAX 32

static const struct {
    const char *name;
    int bytes;
    char kind; /* the descr's type character */
} NPY_DTYPES[NPY_DTYPE_COUNT] = {
    [NPY_U8] = {"uint8", 1, 'u'},     [NPY_I8] = {"int8", 1, 'i'},       [NPY_U16] = {"uint16", 2, 'u'},
    [NPY_I16] = {"int16", 2, 'i'},    [NPY_U32] = {"uint32", 4, 'u'},    [NPY_I32] = {"int32", 4, 'i'},
    [NPY_I64] = {"int64", 8, 'i'},    [NPY_U64] = {"uint64", 8, 'u'},    [NPY_F16] = {"float16", 2, 'f'},
    [NPY_F32] = {"float32", 4, 'f'},  [NPY_F64] = {"float64", 8, 'f'},   [NPY_BOOL] = {"bool", 1, 'b'},
};

const char *npy_dtype_name(NpyDtype dtype) {
    return (unsigned)dtype < NPY_DTYPE_COUNT ? NPY_DTYPES[dtype].name : "unknown";
}

int npy_dtype_bytes(NpyDtype dtype) { return (unsigned)dtype < NPY_DTYPE_COUNT ? NPY_DTYPES[dtype].bytes : 0; }

static void npy_shape_str(const NpyInfo *info, char *buf, size_t cap) {
    size_t at = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < info->ndim && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%" PRId64, i ? ", " : "", info->shape[i]);
    if (at < cap) snprintf(buf + at, cap - at, info->ndim == 1 ? ",)" : ")");
}

/* ---- the header dict -------------------------------------------------------------------------------------------- */

typedef struct {
    const char *s; /* the header without its final '\n' */
    size_t n, i;
    const char *what;
    QtError *err;
} NpyParser;

/* The header from byte at on, as a message shows it (ASCII only by then). */
static const char *npy_rest(const NpyParser *p, size_t at, char buf[QT_CLIP_BUF]) {
    char text[QT_CLIP_SHOW + 2];
    size_t k = p->n - at < QT_CLIP_SHOW + 1 ? p->n - at : QT_CLIP_SHOW + 1;
    memcpy(text, p->s + at, k);
    text[k] = '\0';
    return qt_clip(text, buf);
}

static QtStatus npy_syntax(NpyParser *p, const char *expected) {
    char rest[QT_CLIP_BUF];
    return qt_error_set(p->err, QT_ERR_FORMAT,
                        ".npy file '%s': its header is not the dict NumPy writes: expected %s at byte %zu of the "
                        "header, found \"%s\"; the header is damaged, save the array again with numpy.save",
                        p->what, expected, p->i, p->i < p->n ? npy_rest(p, p->i, rest) : "the end of the header");
}

static void npy_skip_spaces(NpyParser *p) {
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t')) p->i++;
}

static bool npy_accept(NpyParser *p, char c) {
    npy_skip_spaces(p);
    if (p->i < p->n && p->s[p->i] == c) {
        p->i++;
        return true;
    }
    return false;
}

/* A quoted string without escapes into out[cap] (clipped there; *len gets its full length). */
static QtStatus npy_parse_string(NpyParser *p, char *out, size_t cap, size_t *len, const char *expected) {
    npy_skip_spaces(p);
    if (p->i >= p->n || (p->s[p->i] != '\'' && p->s[p->i] != '"')) return npy_syntax(p, expected);
    char quote = p->s[p->i];
    size_t start = p->i + 1, j = start;
    while (j < p->n && p->s[j] != quote && p->s[j] != '\\') j++;
    if (j >= p->n || p->s[j] != quote) {
        p->i = j;
        return npy_syntax(p, "a closing quote without backslashes");
    }
    *len = j - start;
    size_t k = *len < cap - 1 ? *len : cap - 1;
    memcpy(out, p->s + start, k);
    out[k] = '\0';
    p->i = j + 1;
    return QT_OK;
}

static QtStatus npy_descr_refuse(NpyParser *p, const char *descr, const char *why) {
    char shown[QT_CLIP_BUF];
    return qt_error_set(p->err, QT_ERR_FORMAT,
                        ".npy file '%s' has dtype '%s' (%s); qtrain reads numbers of one of the dtypes " NPY_ACCEPTED
                        ": convert the array, e.g. np.save('%s', np.load('%s').astype('<f4'))",
                        p->what, qt_clip(descr, shown), why, p->what, p->what);
}

/* descr: a byte order ('<', '|', '=' or '>'), a type character and the size in bytes. */
static QtStatus npy_parse_descr(NpyParser *p, NpyInfo *info) {
    npy_skip_spaces(p);
    if (p->i < p->n && (p->s[p->i] == '[' || p->s[p->i] == '{')) {
        /* The descr up to its closing bracket, for the message. */
        size_t end = p->i;
        for (int depth = 0; end < p->n; end++) {
            char c = p->s[end];
            depth += (c == '[' || c == '(' || c == '{') - (c == ']' || c == ')' || c == '}');
            if (depth == 0) break;
        }
        NpyParser upto = *p;
        upto.n = end < p->n ? end + 1 : p->n;
        char rest[QT_CLIP_BUF];
        return qt_error_set(p->err, QT_ERR_FORMAT,
                            ".npy file '%s' holds a structured array (descr %s); qtrain reads plain arrays of "
                            "numbers: save each field as its own array, e.g. np.save('x.npy', a['x'])",
                            p->what, npy_rest(&upto, p->i, rest));
    }
    char descr[NPY_DESCR_MAX];
    size_t len = 0;
    QtStatus st = npy_parse_string(p, descr, sizeof descr, &len, "the descr string (e.g. '<f4')");
    if (st != QT_OK) return st;
    if (len >= sizeof descr) return npy_descr_refuse(p, descr, "not a NumPy type string");
    char order = descr[0], kind = len > 1 ? descr[1] : 0;
    if (kind == 'O') return npy_descr_refuse(p, descr, "Python objects");
    if (kind == 'U' || kind == 'S' || kind == 'a') return npy_descr_refuse(p, descr, "strings");
    if (kind == 'c') return npy_descr_refuse(p, descr, "complex numbers");
    if (kind == 'M' || kind == 'm') return npy_descr_refuse(p, descr, "dates or time deltas");
    if (kind == 'V') return npy_descr_refuse(p, descr, "raw void records");
    int size = 0;
    size_t j = 2;
    for (; j < len && j < 5 && descr[j] >= '0' && descr[j] <= '9'; j++) size = size * 10 + (descr[j] - '0');
    if (len < 3 || j != len || descr[2] == '0' || !strchr("<>|=", order))
        return npy_descr_refuse(p, descr, "not a NumPy type string qtrain knows");
    int found = -1;
    for (int d = 0; d < NPY_DTYPE_COUNT; d++)
        if (NPY_DTYPES[d].kind == kind && NPY_DTYPES[d].bytes == size) found = d;
    if (found < 0) return npy_descr_refuse(p, descr, "a type or size qtrain does not read");
    /* '|' (not applicable) and '=' (native) only mean something for one byte; a
     * multi-byte array NumPy writes always says '<' or '>'. qtrain runs on
     * little-endian machines, where native is little-endian. */
    if (order == '>' && size > 1)
        return qt_error_set(p->err, QT_ERR_FORMAT,
                            ".npy file '%s' is big-endian (dtype '%s'); qtrain reads little-endian data: convert "
                            "it with np.save('%s', np.load('%s').astype('<%c%d'))",
                            p->what, descr, p->what, p->what, kind, size);
    info->dtype = (NpyDtype)found;
    info->elem_bytes = size;
    return QT_OK;
}

static QtStatus npy_parse_bool(NpyParser *p, bool *out) {
    npy_skip_spaces(p);
    if (p->n - p->i >= 4 && memcmp(p->s + p->i, "True", 4) == 0) {
        *out = true;
        p->i += 4;
    } else if (p->n - p->i >= 5 && memcmp(p->s + p->i, "False", 5) == 0) {
        *out = false;
        p->i += 5;
    } else {
        return npy_syntax(p, "True or False for 'fortran_order'");
    }
    char c = p->i < p->n ? (char)(p->s[p->i] | 0x20) : ' ';
    if (c == '_' || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))
        return npy_syntax(p, "the end of True or False");
    return QT_OK;
}

/* One dimension: a non-negative decimal integer without leading zeros, at most NPY_MAX_ELEMS. */
static QtStatus npy_parse_dim(NpyParser *p, int64_t *out) {
    npy_skip_spaces(p);
    size_t start = p->i;
    if (p->i < p->n && p->s[p->i] == '-') {
        char rest[QT_CLIP_BUF];
        return qt_error_set(p->err, QT_ERR_FORMAT,
                            ".npy file '%s': its shape has a negative dimension (\"%s\"); the header is damaged, "
                            "save the array again with numpy.save",
                            p->what, npy_rest(p, start, rest));
    }
    uint64_t v = 0;
    bool big = false;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        if (v > NPY_MAX_ELEMS) big = true; /* stays past the limit; no overflow */
        else v = v * 10 + (uint64_t)(p->s[p->i] - '0');
        p->i++;
    }
    if (p->i == start) return npy_syntax(p, "a dimension (a non-negative integer)");
    if (p->i - start > 1 && p->s[start] == '0') {
        p->i = start;
        return npy_syntax(p, "a dimension without leading zeros");
    }
    if (big || v > NPY_MAX_ELEMS) {
        char rest[QT_CLIP_BUF];
        return qt_error_set(p->err, QT_ERR_FORMAT,
                            ".npy file '%s': its shape has a dimension of %s, more than the 2^40 elements qtrain "
                            "reads; the header is damaged or the array too large, split it into smaller files",
                            p->what, npy_rest(p, start, rest));
    }
    *out = (int64_t)v;
    return QT_OK;
}

/* A tuple: "()", "(3,)", "(2, 3)", "(2, 3,)". */
static QtStatus npy_parse_shape(NpyParser *p, NpyInfo *info) {
    if (!npy_accept(p, '(')) return npy_syntax(p, "a tuple for 'shape', e.g. (2, 3)");
    int n = 0;
    bool comma = false; /* whether the last dimension was followed by a comma */
    for (;;) {
        if (npy_accept(p, ')')) break;
        if (n > 0 && !comma) return npy_syntax(p, "',' or ')' in the shape");
        if (n == NPY_MAX_DIMS)
            return qt_error_set(p->err, QT_ERR_FORMAT,
                                ".npy file '%s' has more than %d dimensions; qtrain reads at most %d: reshape the "
                                "array (e.g. a.reshape(len(a), -1)) and save it again",
                                p->what, NPY_MAX_DIMS, NPY_MAX_DIMS);
        QtStatus st = npy_parse_dim(p, &info->shape[n]);
        if (st != QT_OK) return st;
        n++;
        comma = npy_accept(p, ',');
    }
    if (n == 1 && !comma) {
        p->i--;
        return npy_syntax(p, "',' after the only dimension (a tuple of one is written (N,))");
    }
    info->ndim = n;
    return QT_OK;
}

enum { NPY_KEY_DESCR, NPY_KEY_FORTRAN, NPY_KEY_SHAPE, NPY_KEY_COUNT };
static const char *const NPY_KEYS[NPY_KEY_COUNT] = {"descr", "fortran_order", "shape"};

static QtStatus npy_parse_dict(NpyParser *p, NpyInfo *info, bool *fortran) {
    bool seen[NPY_KEY_COUNT] = {false};
    if (!npy_accept(p, '{')) return npy_syntax(p, "'{' (the header is a Python dict)");
    bool first = true;
    for (;;) {
        if (npy_accept(p, '}')) break;
        if (!first && !npy_accept(p, ',')) return npy_syntax(p, "',' or '}' after a value");
        if (!first && npy_accept(p, '}')) break; /* a trailing comma */
        first = false;
        char key[32];
        size_t len = 0;
        size_t at = p->i;
        QtStatus st = npy_parse_string(p, key, sizeof key, &len, "a quoted key");
        if (st != QT_OK) return st;
        int k = 0;
        while (k < NPY_KEY_COUNT && (len >= sizeof key || strcmp(key, NPY_KEYS[k]) != 0)) k++;
        if (k == NPY_KEY_COUNT || seen[k]) {
            char shown[QT_CLIP_BUF];
            p->i = at;
            return qt_error_set(p->err, QT_ERR_FORMAT,
                                ".npy file '%s': its header has %s key '%s' (a .npy header has exactly 'descr', "
                                "'fortran_order' and 'shape'); the header is damaged or not NumPy's, save the "
                                "array again with numpy.save",
                                p->what, k == NPY_KEY_COUNT ? "an unexpected" : "a repeated", qt_clip(key, shown));
        }
        seen[k] = true;
        if (!npy_accept(p, ':')) return npy_syntax(p, "':' after the key");
        if (k == NPY_KEY_DESCR) st = npy_parse_descr(p, info);
        else if (k == NPY_KEY_FORTRAN) st = npy_parse_bool(p, fortran);
        else st = npy_parse_shape(p, info);
        if (st != QT_OK) return st;
    }
    npy_skip_spaces(p);
    if (p->i != p->n) return npy_syntax(p, "only spaces after the dict");
    for (int k = 0; k < NPY_KEY_COUNT; k++)
        if (!seen[k])
            return qt_error_set(p->err, QT_ERR_FORMAT,
                                ".npy file '%s': its header has no '%s' key (a .npy header has 'descr', "
                                "'fortran_order' and 'shape'); the header is damaged or not NumPy's, save the "
                                "array again with numpy.save",
                                p->what, NPY_KEYS[k]);
    return QT_OK;
}

/* ---- the preamble, the sizes -------------------------------------------------------------------------------------- */

static QtStatus npy_check_sizes(NpyInfo *info, uint64_t file_size, const char *what, QtError *err) {
    uint64_t n = 1;
    bool zero = false;
    for (int i = 0; i < info->ndim; i++) zero |= info->shape[i] == 0;
    for (int i = 0; !zero && i < info->ndim; i++) {
        uint64_t d = (uint64_t)info->shape[i];
        if (n > NPY_MAX_ELEMS / d) {
            char shape[NPY_MAX_DIMS * 24 + 8];
            npy_shape_str(info, shape, sizeof shape);
            return qt_error_set(err, QT_ERR_FORMAT,
                                ".npy file '%s' has shape %s, more than the 2^40 elements qtrain reads; the header "
                                "is damaged or the array too large, split it into smaller files",
                                what, shape);
        }
        n *= d;
    }
    info->n_elems = zero ? 0 : n;
    info->n_bytes = info->n_elems * (uint64_t)info->elem_bytes; /* at most 2^43: no overflow */
    uint64_t want = info->data_offset + info->n_bytes;
    if (file_size == want) return QT_OK;
    char shape[NPY_MAX_DIMS * 24 + 8];
    npy_shape_str(info, shape, sizeof shape);
    if (file_size < want)
        return qt_error_set(err, QT_ERR_FORMAT,
                            ".npy file '%s' is truncated: its header announces shape %s of %s, %" PRIu64
                            " bytes of data, so the file should be %" PRIu64 " bytes, but it is %" PRIu64
                            " bytes; the file is incomplete, copy or save it again",
                            what, shape, npy_dtype_name(info->dtype), info->n_bytes, want, file_size);
    return qt_error_set(err, QT_ERR_FORMAT,
                        ".npy file '%s' is %" PRIu64 " bytes, but its header announces shape %s of %s, so it "
                        "should be %" PRIu64 " bytes: %" PRIu64 " bytes follow the data (the header does not "
                        "describe the file); save the array again with numpy.save",
                        what, file_size, shape, npy_dtype_name(info->dtype), want, file_size - want);
}

/* The magic, the version and the header's length, checked against the file's size; sets info->version and
 * info->data_offset. */
static QtStatus npy_read_preamble(const uint8_t *buf, size_t len, uint64_t file_size, NpyInfo *info,
                                  const char *what, QtError *err) {
    uint64_t avail = len < file_size ? len : file_size;
    size_t cmp = avail < sizeof NPY_MAGIC ? (size_t)avail : sizeof NPY_MAGIC;
    if (memcmp(buf ? (const void *)buf : "", NPY_MAGIC, cmp) != 0) {
        char start[4 * sizeof NPY_MAGIC + 1];
        size_t at = 0;
        for (size_t i = 0; i < cmp; i++) {
            unsigned char c = buf[i];
            at += (size_t)snprintf(start + at, sizeof start - at, c >= 0x20 && c < 0x7f && c != '\\' ? "%c" : "\\x%02x",
                                   c);
        }
        return qt_error_set(err, QT_ERR_FORMAT,
                            "'%s' is not a NumPy .npy file: it starts with \"%s\", not \"\\x93NUMPY\"; write the "
                            "array with numpy.save (np.save('file.npy', a))",
                            what, start);
    }
    if (avail == 0)
        return qt_error_set(err, QT_ERR_FORMAT,
                            ".npy file '%s' is empty (0 bytes); write the array with numpy.save (np.save('file.npy', "
                            "a))",
                            what);
    if (avail < 8)
        return qt_error_set(err, QT_ERR_FORMAT,
                            ".npy file '%s' is truncated: it is %" PRIu64 " bytes, shorter than the magic and "
                            "version; the file is incomplete, copy or save it again",
                            what, avail);
    int major = buf[6], minor = buf[7];
    if (major < 1 || major > 3 || minor != 0)
        return qt_error_set(err, QT_ERR_FORMAT,
                            ".npy file '%s' has format version %d.%d; qtrain reads versions 1.0, 2.0 and 3.0: save "
                            "the array with a NumPy that writes those (np.save)",
                            what, major, minor);
    size_t preamble = major == 1 ? 10 : 12;
    if (avail < preamble)
        return qt_error_set(err, QT_ERR_FORMAT,
                            ".npy file '%s' is truncated: it is %" PRIu64 " bytes, shorter than the %zu bytes before "
                            "a version %d.0 header; the file is incomplete, copy or save it again",
                            what, avail, preamble, major);
    uint64_t hlen = major == 1 ? (uint64_t)buf[8] | (uint64_t)buf[9] << 8
                               : (uint64_t)buf[8] | (uint64_t)buf[9] << 8 | (uint64_t)buf[10] << 16 |
                                     (uint64_t)buf[11] << 24;
    info->version = major;
    info->data_offset = preamble + hlen;
    if (hlen > NPY_HEADER_MAX)
        return qt_error_set(err, QT_ERR_FORMAT,
                            ".npy file '%s' declares a header of %" PRIu64 " bytes, more than the %d qtrain reads "
                            "(NumPy's are a few hundred); the file is damaged, save the array again with numpy.save",
                            what, hlen, NPY_HEADER_MAX);
    if (info->data_offset > file_size)
        return qt_error_set(err, QT_ERR_FORMAT,
                            ".npy file '%s' declares a header of %" PRIu64 " bytes but the file is %" PRIu64
                            " bytes, only %" PRIu64 " of them after the preamble; the file is truncated or "
                            "damaged, copy or save it again",
                            what, hlen, file_size, file_size - preamble);
    if (info->data_offset > len)
        return qt_error_set(err, QT_ERR_ARG,
                            "npy_read_header_bytes: '%s': %zu bytes given, the header needs %" PRIu64, what, len,
                            info->data_offset);
    return QT_OK;
}

QtStatus npy_read_header_bytes(const uint8_t *buf, size_t len, uint64_t file_size, NpyInfo *info, const char *what,
                               QtError *err) {
    if (!info) return qt_error_set(err, QT_ERR_ARG, "npy_read_header_bytes: no NpyInfo");
    memset(info, 0, sizeof *info);
    if (!what) what = "(memory)";
    if (!buf && len > 0) return qt_error_set(err, QT_ERR_ARG, "npy_read_header_bytes: no buffer for '%s'", what);
    QtStatus st = npy_read_preamble(buf, len, file_size, info, what, err);
    if (st != QT_OK) return st;
    size_t preamble = info->version == 1 ? 10 : 12;
    uint64_t hlen = info->data_offset - preamble;
    const char *h = (const char *)buf + preamble;
    if (hlen == 0 || h[hlen - 1] != '\n')
        return qt_error_set(err, QT_ERR_FORMAT,
                            ".npy file '%s': its %" PRIu64 "-byte header does not end with a newline as NumPy's "
                            "do; the header is damaged, save the array again with numpy.save",
                            what, hlen);
    for (uint64_t i = 0; i + 1 < hlen; i++) {
        unsigned char c = (unsigned char)h[i];
        if (c < 0x20 || c > 0x7e)
            return qt_error_set(err, QT_ERR_FORMAT,
                                ".npy file '%s': byte %" PRIu64 " of its header is 0x%02x, not ASCII text (the "
                                "header is a Python dict such as {'descr': '<f4', 'fortran_order': False, 'shape': "
                                "(3,)}); the header is damaged, save the array again with numpy.save",
                                what, i, c);
    }
    NpyParser p = {.s = h, .n = (size_t)hlen - 1, .i = 0, .what = what, .err = err};
    bool fortran = false;
    st = npy_parse_dict(&p, info, &fortran);
    if (st != QT_OK) return st;
    /* One dimension (or none) is laid out the same in both orders. */
    if (fortran && info->ndim > 1)
        return qt_error_set(err, QT_ERR_FORMAT,
                            ".npy file '%s' is in Fortran order (fortran_order: True); qtrain reads C order: convert "
                            "it with np.save('%s', np.ascontiguousarray(np.load('%s')))",
                            what, what, what);
    return npy_check_sizes(info, file_size, what, err);
}

/* ---- files -------------------------------------------------------------------------------------------------------- */

/* Opens path (O_NONBLOCK, so a FIFO does not block: it is then refused as
 * not a regular file) and reads its header into info; *fd_out keeps the
 * descriptor on success. */
static QtStatus npy_open_info(const char *path, NpyInfo *info, int *fd_out, QtError *err) {
    if (!info) return qt_error_set(err, QT_ERR_ARG, "npy_read_info: no NpyInfo");
    memset(info, 0, sizeof *info);
    if (!path || !*path) return qt_error_set(err, QT_ERR_ARG, "npy_read_info: no file name");
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return qt_error_set(err, QT_ERR_IO, "cannot open .npy file '%s': %s; check the path", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return qt_error_set(err, QT_ERR_IO, "cannot read .npy file '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return qt_error_set(err, QT_ERR_IO, "cannot read .npy file '%s': not a regular file; give the path of a "
                            ".npy file", path);
    }
    uint64_t size = (uint64_t)sb.st_size;
    size_t want = size < NPY_PREAMBLE_MAX + NPY_HEADER_MAX ? (size_t)size : NPY_PREAMBLE_MAX + NPY_HEADER_MAX;
    size_t got = 0;
    uint8_t *head = malloc(want ? want : 1);
    if (!head) {
        close(fd);
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory reading the header of .npy file '%s'", path);
    }
    if (fs_pread_full(fd, head, want, 0, &got) != 0) {
        int e = errno;
        free(head);
        close(fd);
        return qt_error_set(err, QT_ERR_IO, "cannot read .npy file '%s': %s", path, strerror(e));
    }
    /* A file that shrank meanwhile is judged by what could be read. */
    QtStatus st = npy_read_header_bytes(head, got, got < want ? got : size, info, path, err);
    free(head);
    if (st != QT_OK) {
        close(fd);
        return st;
    }
    *fd_out = fd;
    return QT_OK;
}

QtStatus npy_read_info(const char *path, NpyInfo *info, QtError *err) {
    int fd = -1;
    QtStatus st = npy_open_info(path, info, &fd, err);
    if (st == QT_OK) close(fd);
    return st;
}

QtStatus npy_file_open(NpyFile *f, const char *path, QtError *err) {
    if (!f) return qt_error_set(err, QT_ERR_ARG, "npy_file_open: no NpyFile");
    memset(f, 0, sizeof *f);
    f->fd = -1;
    if (path && strlen(path) >= sizeof f->path)
        return qt_error_set(err, QT_ERR_ARG, "cannot open .npy file '%.200s...': its path is longer than %zu bytes",
                            path, sizeof f->path - 1);
    QtStatus st = npy_open_info(path, &f->info, &f->fd, err);
    if (st != QT_OK) return st;
    snprintf(f->path, sizeof f->path, "%s", path);
    f->row_elems = 1;
    for (int i = 1; i < f->info.ndim; i++) f->row_elems *= (uint64_t)f->info.shape[i];
    f->row_bytes = f->row_elems * (uint64_t)f->info.elem_bytes;
    return QT_OK;
}

QtStatus npy_file_read_rows(const NpyFile *f, uint64_t start, uint64_t n, void *buf, size_t cap, QtError *err) {
    if (!f || f->fd < 0) return qt_error_set(err, QT_ERR_ARG, "npy_file_read_rows: no open .npy file");
    if (f->info.ndim < 1)
        return qt_error_set(err, QT_ERR_SHAPE, ".npy file '%s' holds a scalar (shape ()), which has no rows; save "
                            "an array with a first axis", f->path);
    uint64_t rows = (uint64_t)f->info.shape[0];
    if (start > rows || n > rows - start)
        return qt_error_set(err, QT_ERR_ARG, "npy_file_read_rows: rows %" PRIu64 "..%" PRIu64 " of '%s', which has %"
                            PRIu64, start, start + n, f->path, rows);
    if (n > 0 && (!buf || f->row_bytes > cap / n))
        return qt_error_set(err, QT_ERR_ARG, "npy_file_read_rows: %" PRIu64 " rows of %" PRIu64 " bytes of '%s' do "
                            "not fit in %zu bytes", n, f->row_bytes, f->path, cap);
    size_t len = (size_t)(n * f->row_bytes), got = 0;
    uint64_t off = f->info.data_offset + start * f->row_bytes;
    if (fs_pread_full(f->fd, buf, len, off, &got) != 0)
        return qt_error_set(err, QT_ERR_IO, "cannot read rows %" PRIu64 "..%" PRIu64 " of .npy file '%s': %s", start,
                            start + n, f->path, strerror(errno));
    if (got < len) {
        struct stat sb;
        uint64_t now = fstat(f->fd, &sb) == 0 ? (uint64_t)sb.st_size : off + got;
        return qt_error_set(err, QT_ERR_IO,
                            ".npy file '%s' became shorter while in use: it is %" PRIu64 " bytes, it was %" PRIu64
                            " when opened; do not change data files during a run",
                            f->path, now, f->info.data_offset + f->info.n_bytes);
    }
    return QT_OK;
}

void npy_file_close(NpyFile *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
}

/* The .npy file of data (elements of esize bytes, NumPy's descr). */
static QtStatus npy_encode(const void *data, const char *descr, size_t esize, int ndim, const int64_t *shape,
                           void **buf, size_t *len, QtError *err) {
    *buf = NULL, *len = 0;
    if (ndim < 0 || ndim > NPY_MAX_DIMS)
        return qt_error_set(err, QT_ERR_ARG, "npy_encode: %d dimensions (0 to %d)", ndim, NPY_MAX_DIMS);
    char dims[NPY_MAX_DIMS * 24 + 8] = "", dict[NPY_MAX_DIMS * 24 + 96];
    size_t at = 0;
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        at += (size_t)snprintf(dims + at, sizeof dims - at, "%s%lld", i ? ", " : "", (long long)shape[i]);
        n *= (uint64_t)shape[i];
    }
    if (ndim == 1) snprintf(dims + at, sizeof dims - at, ",");
    const int d = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", descr,
                           dims);
    const size_t head = 10 + (size_t)d + 1, pad = (64 - head % 64) % 64, total = head + pad + n * esize;
    uint8_t *b = malloc(total);
    if (!b) return qt_error_set(err, QT_ERR_NOMEM, "out of memory for a .npy file of %zu bytes", total);
    const size_t hlen = (size_t)d + pad + 1;
    memcpy(b, "\x93NUMPY\x01\x00", 8);
    b[8] = (uint8_t)(hlen & 0xff), b[9] = (uint8_t)(hlen >> 8);
    memcpy(b + 10, dict, (size_t)d);
    memset(b + 10 + d, ' ', pad);
    b[head + pad - 1] = '\n';
    memcpy(b + head + pad, data, n * esize); /* little-endian hosts only, as the reader */
    *buf = b, *len = total;
    return QT_OK;
}

QtStatus npy_encode_f32(const float *data, int ndim, const int64_t *shape, void **buf, size_t *len, QtError *err) {
    return npy_encode(data, "<f4", sizeof(float), ndim, shape, buf, len, err);
}

QtStatus npy_encode_i8(const int8_t *data, int ndim, const int64_t *shape, void **buf, size_t *len, QtError *err) {
    return npy_encode(data, "|i1", 1, ndim, shape, buf, len, err);
}
