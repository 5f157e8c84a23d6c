/* safetensors.c - the safetensors reader (untrusted input) and the float32
 * writer; see safetensors.h for the rules the reader keeps.
 *
 * The JSON of the header is parsed by a small strict parser that knows the
 * header's shape (an object of objects; "__metadata__" an object of
 * strings) and nothing else, so nesting is bounded by construction. Strings
 * take every JSON escape (\uXXXX with surrogate pairs becomes UTF-8; a lone
 * surrogate is refused) and the header must be valid UTF-8; numbers must be
 * non-negative integers without sign, fraction or exponent. The writer is
 * in safetensors_write.c. */
#define _GNU_SOURCE /* qsort_r */
#include "safetensors.h"
#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const DTYPE_NAMES[ST_DTYPE_COUNT] = {"F64", "F32", "F16", "BF16", "I64",
                                                       "I32", "I16", "I8",  "U8",   "BOOL"};
static const size_t DTYPE_BYTES[ST_DTYPE_COUNT] = {8, 4, 2, 2, 8, 4, 2, 1, 1, 1};

/* Dtypes of the format that qtrain does not read, refused by name. */
static const char *const DTYPE_OTHER[] = {"U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3",
                                          "F6_E3M2", "F4", "C64", "C128"};

const char *st_dtype_name(StDtype d) { return (unsigned)d < ST_DTYPE_COUNT ? DTYPE_NAMES[d] : "?"; }

size_t st_dtype_bytes(StDtype d) { return (unsigned)d < ST_DTYPE_COUNT ? DTYPE_BYTES[d] : 0; }

/* ---- the parser ------------------------------------------------------------------------------------------------ */

typedef struct {
    const uint8_t *s;     /* the header's JSON [n] */
    size_t n, i;
    const char *what;     /* the file, for messages */
    QtError *err;
    StFile *f;
} Parser;

/* A header error: names the file and the byte of the header where it was found. */
static QtStatus perr(Parser *p, const char *fmt, const char *a, const char *b) {
    char msg[600];
    snprintf(msg, sizeof msg, fmt, a ? a : "", b ? b : "");
    return qt_error_set(p->err, QT_ERR_FORMAT,
                        "safetensors file '%s': the JSON header is invalid at byte %zu of %zu: %s; the file is "
                        "damaged or not a safetensors file (write it again with safetensors or qtrain export)",
                        p->what, p->i, p->n, msg);
}

static void skip_ws(Parser *p) {
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' || p->s[p->i] == '\r'))
        p->i++;
}

/* Expects character c after whitespace. */
static QtStatus expect(Parser *p, char c) {
    skip_ws(p);
    if (p->i >= p->n) {
        char want[2] = {c, 0};
        return perr(p, "it ends where '%s' was expected", want, NULL);
    }
    if (p->s[p->i] != (uint8_t)c) {
        char want[2] = {c, 0}, got[16];
        uint8_t g = p->s[p->i];
        if (g >= 0x20 && g < 0x7f) snprintf(got, sizeof got, "'%c'", g);
        else snprintf(got, sizeof got, "byte 0x%02x", g);
        return perr(p, "'%s' expected, found %s", want, got);
    }
    p->i++;
    return QT_OK;
}

/* After a member of an object or array: ',' (1) or the closing bracket (0); -1 on error. */
static int next_or_close(Parser *p, char close) {
    skip_ws(p);
    if (p->i < p->n && p->s[p->i] == ',') {
        p->i++;
        return 1;
    }
    if (p->i < p->n && p->s[p->i] == (uint8_t)close) {
        p->i++;
        return 0;
    }
    char want[2] = {close, 0};
    if (p->i >= p->n) perr(p, "it ends where ',' or '%s' was expected", want, NULL);
    else perr(p, "',' or '%s' expected after a value", want, NULL);
    return -1;
}

static int hexval(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static QtStatus read_hex4(Parser *p, unsigned *out) {
    if (p->n - p->i < 4) return perr(p, "a \\u escape needs 4 hex digits", NULL, NULL);
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        int h = hexval(p->s[p->i + (size_t)k]);
        if (h < 0) return perr(p, "a \\u escape needs 4 hex digits", NULL, NULL);
        v = v * 16 + (unsigned)h;
    }
    p->i += 4;
    *out = v;
    return QT_OK;
}

static size_t put_utf8(unsigned c, char *o) {
    if (c < 0x80) {
        o[0] = (char)c;
        return 1;
    }
    if (c < 0x800) {
        o[0] = (char)(0xc0 | (c >> 6));
        o[1] = (char)(0x80 | (c & 0x3f));
        return 2;
    }
    if (c < 0x10000) {
        o[0] = (char)(0xe0 | (c >> 12));
        o[1] = (char)(0x80 | ((c >> 6) & 0x3f));
        o[2] = (char)(0x80 | (c & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | (c >> 18));
    o[1] = (char)(0x80 | ((c >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((c >> 6) & 0x3f));
    o[3] = (char)(0x80 | (c & 0x3f));
    return 4;
}

/* A JSON string into a malloc'd NUL-terminated *out (*len bytes, which may
 * hold a NUL from \u0000: the callers refuse that where a C string is kept). */
static QtStatus parse_string(Parser *p, char **out, size_t *len) {
    *out = NULL;
    QtStatus st = expect(p, '"');
    if (st != QT_OK) return st;
    /* the decoded string is never longer than its JSON text (\uXXXX: 6 bytes for at most 3; a pair 12 for 4) */
    size_t start = p->i, end = start;
    while (end < p->n && p->s[end] != '"') end += p->s[end] == '\\' ? 2 : 1;
    char *o = malloc(end - start + 1);
    if (!o) return qt_error_set(p->err, QT_ERR_NOMEM, "out of memory reading the header of '%s'", p->what);
    size_t k = 0;
    for (;;) {
        if (p->i >= p->n) {
            free(o);
            return perr(p, "a string is not closed", NULL, NULL);
        }
        uint8_t c = p->s[p->i];
        if (c == '"') break;
        if (c < 0x20) {
            free(o);
            return perr(p, "a control character inside a string (escape it)", NULL, NULL);
        }
        if (c != '\\') {
            o[k++] = (char)c;
            p->i++;
            continue;
        }
        if (++p->i >= p->n) {
            free(o);
            return perr(p, "a string ends inside an escape", NULL, NULL);
        }
        uint8_t e = p->s[p->i++];
        const char *simple = strchr("\"\\/bfnrt", e);
        if (e && simple) {
            static const char map[] = "\"\\/\b\f\n\r\t";
            o[k++] = map[simple - "\"\\/bfnrt"];
            continue;
        }
        if (e != 'u') {
            p->i--;
            free(o);
            return perr(p, "an unknown escape in a string (JSON knows \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)", NULL,
                        NULL);
        }
        unsigned cp;
        if ((st = read_hex4(p, &cp)) != QT_OK) {
            free(o);
            return st;
        }
        if (cp >= 0xdc00 && cp <= 0xdfff) {
            free(o);
            return perr(p, "a low surrogate \\u escape without a high one before it", NULL, NULL);
        }
        if (cp >= 0xd800 && cp <= 0xdbff) {
            unsigned lo;
            if (p->n - p->i < 2 || p->s[p->i] != '\\' || p->s[p->i + 1] != 'u') {
                free(o);
                return perr(p, "a high surrogate \\u escape not followed by a low one", NULL, NULL);
            }
            p->i += 2;
            if ((st = read_hex4(p, &lo)) != QT_OK) {
                free(o);
                return st;
            }
            if (lo < 0xdc00 || lo > 0xdfff) {
                free(o);
                return perr(p, "a high surrogate \\u escape not followed by a low one", NULL, NULL);
            }
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        }
        k += put_utf8(cp, o + k);
    }
    p->i++; /* the closing quote */
    o[k] = 0;
    *out = o;
    *len = k;
    return QT_OK;
}

/* A non-negative JSON integer (no sign, fraction, exponent or leading zero) up to max. */
static QtStatus parse_uint(Parser *p, uint64_t max, const char *field, const char *tensor, uint64_t *out) {
    skip_ws(p);
    size_t at = p->i;
    if (p->i < p->n && p->s[p->i] == '-')
        return perr(p, "%s of tensor '%s' holds a negative number; sizes and offsets are at least 0", field, tensor);
    if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9')
        return perr(p, "%s of tensor '%s' holds something other than a non-negative integer", field, tensor);
    uint64_t v = 0;
    bool big = false;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        unsigned d = (unsigned)(p->s[p->i] - '0');
        if (v > (max - d) / 10) big = true;
        else v = v * 10 + d;
        p->i++;
    }
    if (p->i < p->n && (p->s[p->i] == '.' || p->s[p->i] == 'e' || p->s[p->i] == 'E'))
        return perr(p, "%s of tensor '%s' holds a fraction or exponent; sizes and offsets are integers", field, tensor);
    if (p->i - at > 1 && p->s[at] == '0') {
        p->i = at;
        return perr(p, "%s of tensor '%s' holds a number with a leading zero (not JSON)", field, tensor);
    }
    if (big) {
        p->i = at;
        char lim[32];
        snprintf(lim, sizeof lim, "%" PRIu64, max);
        char f2[300];
        snprintf(f2, sizeof f2, "%s of tensor '%s'", field, tensor);
        return perr(p, "%s holds a number larger than %s", f2, lim);
    }
    *out = v;
    return QT_OK;
}

/* [a, b, ...] of non-negative integers: at most cap of them into v; *count. */
static QtStatus parse_uint_array(Parser *p, uint64_t *v, int cap, int *count, uint64_t max, const char *field,
                                 const char *tensor) {
    QtStatus st = expect(p, '[');
    if (st != QT_OK) return st;
    *count = 0;
    skip_ws(p);
    if (p->i < p->n && p->s[p->i] == ']') {
        p->i++;
        return QT_OK;
    }
    for (;;) {
        if (*count >= cap) {
            char c[16];
            snprintf(c, sizeof c, "%d", cap);
            char f2[300];
            snprintf(f2, sizeof f2, "%s of tensor '%s'", field, tensor);
            return perr(p, "%s has more than %s entries", f2, c);
        }
        if ((st = parse_uint(p, max, field, tensor, &v[*count])) != QT_OK) return st;
        (*count)++;
        int r = next_or_close(p, ']');
        if (r < 0) return p->err ? p->err->status : QT_ERR_FORMAT;
        if (r == 0) return QT_OK;
    }
}

bool st_utf8_valid(const uint8_t *s, size_t n, size_t *bad) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xe0) == 0xc0) len = 2, cp = c & 0x1f, min = 0x80;
        else if ((c & 0xf0) == 0xe0) len = 3, cp = c & 0x0f, min = 0x800;
        else if ((c & 0xf8) == 0xf0) len = 4, cp = c & 0x07, min = 0x10000;
        else break;
        if (n - i < len) break;
        size_t k = 1;
        for (; k < len && (s[i + k] & 0xc0) == 0x80; k++) cp = cp << 6 | (s[i + k] & 0x3f);
        if (k < len || cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) break;
        i += len;
    }
    *bad = i;
    return i == n;
}

/* A string kept as a C string: no NUL inside, shorter than ST_NAME_MAX when it is a name. */
static QtStatus check_cstr(Parser *p, const char *s, size_t len, size_t max, const char *what) {
    char shown[QT_CLIP_BUF];
    if (strlen(s) != len) return perr(p, "%s '%s' holds a NUL character (\\u0000)", what, qt_clip(s, shown));
    if (max && len >= max) {
        char m[32];
        snprintf(m, sizeof m, "%zu", max - 1);
        char w2[QT_CLIP_BUF + 64];
        snprintf(w2, sizeof w2, "%s '%s'", what, qt_clip(s, shown));
        return perr(p, "%s is longer than %s bytes", w2, m);
    }
    return QT_OK;
}

static QtStatus parse_metadata(Parser *p) {
    StFile *f = p->f;
    if (f->meta) return perr(p, "\"__metadata__\" appears twice", NULL, NULL);
    QtStatus st = expect(p, '{');
    if (st != QT_OK) return st;
    int cap = 4;
    f->meta = calloc((size_t)cap, sizeof *f->meta);
    if (!f->meta) return qt_error_set(p->err, QT_ERR_NOMEM, "out of memory reading the header of '%s'", p->what);
    skip_ws(p);
    if (p->i < p->n && p->s[p->i] == '}') {
        p->i++;
        return QT_OK;
    }
    for (;;) {
        char *key = NULL, *val = NULL;
        size_t klen, vlen;
        if ((st = parse_string(p, &key, &klen)) != QT_OK) return st;
        if ((st = check_cstr(p, key, klen, ST_NAME_MAX, "a \"__metadata__\" key")) != QT_OK ||
            (st = expect(p, ':')) != QT_OK) {
            free(key);
            return st;
        }
        for (int m = 0; m < f->n_meta; m++)
            if (strcmp(f->meta[m].key, key) == 0) {
                char shown[QT_CLIP_BUF];
                st = perr(p, "\"__metadata__\" key '%s' appears twice", qt_clip(key, shown), NULL);
                free(key);
                return st;
            }
        skip_ws(p);
        if (p->i < p->n && p->s[p->i] != '"') {
            char shown[QT_CLIP_BUF];
            st = perr(p, "the value of \"__metadata__\" key '%s' is not a string (metadata maps strings to strings)",
                      qt_clip(key, shown), NULL);
            free(key);
            return st;
        }
        if ((st = parse_string(p, &val, &vlen)) != QT_OK ||
            (st = check_cstr(p, val, vlen, 0, "a \"__metadata__\" value")) != QT_OK) {
            free(key);
            free(val);
            return st;
        }
        if (f->n_meta == cap) {
            StMeta *g = realloc(f->meta, (size_t)cap * 2 * sizeof *g);
            if (!g) {
                free(key);
                free(val);
                return qt_error_set(p->err, QT_ERR_NOMEM, "out of memory reading the header of '%s'", p->what);
            }
            f->meta = g;
            cap *= 2;
        }
        StMeta *m = &f->meta[f->n_meta++];
        memcpy(m->key, key, klen + 1);
        m->value = val;
        free(key);
        int r = next_or_close(p, '}');
        if (r < 0) return p->err ? p->err->status : QT_ERR_FORMAT;
        if (r == 0) return QT_OK;
    }
}

/* The dtype named s, or a message for an unknown or unsupported one. */
static QtStatus parse_dtype(Parser *p, const char *tensor, StDtype *d) {
    char *s = NULL;
    size_t len;
    QtStatus st = parse_string(p, &s, &len);
    if (st != QT_OK) return st;
    for (int k = 0; k < ST_DTYPE_COUNT; k++)
        if (strcmp(s, DTYPE_NAMES[k]) == 0 && len == strlen(s)) {
            *d = (StDtype)k;
            free(s);
            return QT_OK;
        }
    bool known = false;
    for (size_t k = 0; k < sizeof DTYPE_OTHER / sizeof DTYPE_OTHER[0]; k++) known |= strcmp(s, DTYPE_OTHER[k]) == 0;
    char shown[QT_CLIP_BUF], t[QT_CLIP_BUF + 64];
    snprintf(t, sizeof t, "tensor '%s' has dtype '%s'", tensor, qt_clip(s, shown));
    st = qt_error_set(p->err, QT_ERR_FORMAT,
                      "safetensors file '%s': %s, which qtrain %s; qtrain reads F64, F32, F16, BF16, I64, I32, I16, "
                      "I8, U8 and BOOL: convert the tensor (e.g. to float32) before saving", p->what, t,
                      known ? "does not read" : "does not know");
    free(s);
    return st;
}

/* One tensor's object {"dtype": ..., "shape": [...], "data_offsets": [b, e]}; name is malloc'd and taken over. */
static QtStatus parse_tensor(Parser *p, char *name, size_t name_len, int *cap) {
    StFile *f = p->f;
    char shown[QT_CLIP_BUF];
    const char *nm = qt_clip(name, shown);
    QtStatus st = check_cstr(p, name, name_len, ST_NAME_MAX, "tensor name");
    if (st == QT_OK && name_len == 0) st = perr(p, "a tensor has an empty name", NULL, NULL);
    if (st == QT_OK && f->n == *cap) {
        int nc = *cap ? *cap * 2 : 16;
        StTensor *g = realloc(f->tensors, (size_t)nc * sizeof *g);
        if (!g) st = qt_error_set(p->err, QT_ERR_NOMEM, "out of memory reading the header of '%s'", p->what);
        else f->tensors = g, *cap = nc;
    }
    if (st != QT_OK) {
        free(name);
        return st;
    }
    StTensor *t = &f->tensors[f->n];
    memset(t, 0, sizeof *t);
    memcpy(t->name, name, name_len + 1);
    free(name);
    nm = qt_clip(t->name, shown);
    if ((st = expect(p, '{')) != QT_OK) return st;
    bool have[3] = {false, false, false};
    static const char *const FIELDS[3] = {"dtype", "shape", "data_offsets"};
    skip_ws(p);
    if (p->i < p->n && p->s[p->i] == '}') p->i++;
    else
        for (;;) {
            char *key = NULL;
            size_t klen;
            if ((st = parse_string(p, &key, &klen)) != QT_OK) return st;
            int k = 0;
            while (k < 3 && !(strlen(FIELDS[k]) == klen && memcmp(key, FIELDS[k], klen) == 0)) k++;
            if (k == 3) {
                char ks[QT_CLIP_BUF];
                char t2[2 * QT_CLIP_BUF + 32];
                snprintf(t2, sizeof t2, "'%s' in tensor '%s'", qt_clip(key, ks), nm);
                free(key);
                return perr(p, "an unknown field %s (a tensor has dtype, shape and data_offsets)", t2, NULL);
            }
            free(key);
            if (have[k]) return perr(p, "field '%s' of tensor '%s' appears twice", FIELDS[k], nm);
            have[k] = true;
            if ((st = expect(p, ':')) != QT_OK) return st;
            if (k == 0) st = parse_dtype(p, nm, &t->dtype);
            else if (k == 1) {
                uint64_t v[ST_MAX_DIMS];
                st = parse_uint_array(p, v, ST_MAX_DIMS, &t->ndim, (uint64_t)INT64_MAX, "shape", nm);
                for (int d = 0; st == QT_OK && d < t->ndim; d++) t->shape[d] = (int64_t)v[d];
            } else {
                uint64_t v[2];
                int c = 0;
                st = parse_uint_array(p, v, 2, &c, UINT64_MAX, "data_offsets", nm);
                if (st == QT_OK && c != 2)
                    st = perr(p, "data_offsets of tensor '%s' must hold 2 numbers [begin, end]", nm, NULL);
                t->begin = v[0], t->end = v[1];
            }
            if (st != QT_OK) return st;
            int r = next_or_close(p, '}');
            if (r < 0) return p->err ? p->err->status : QT_ERR_FORMAT;
            if (r == 0) break;
        }
    for (int k = 0; k < 3; k++)
        if (!have[k]) return perr(p, "tensor '%s' has no field '%s' (it needs dtype, shape and data_offsets)", nm,
                                  FIELDS[k]);
    f->n++;
    return QT_OK;
}

static QtStatus parse_header(Parser *p) {
    size_t bad;
    if (!st_utf8_valid(p->s, p->n, &bad)) {
        p->i = bad;
        return perr(p, "a byte that is not valid UTF-8 (JSON text is UTF-8)", NULL, NULL);
    }
    QtStatus st = expect(p, '{');
    if (st != QT_OK) return st;
    int cap = 0;
    skip_ws(p);
    if (p->i < p->n && p->s[p->i] == '}') p->i++;
    else
        for (;;) {
            char *key = NULL;
            size_t klen;
            if ((st = parse_string(p, &key, &klen)) != QT_OK) return st;
            if ((st = expect(p, ':')) != QT_OK) {
                free(key);
                return st;
            }
            if (klen == 12 && memcmp(key, "__metadata__", 12) == 0) {
                free(key);
                st = parse_metadata(p);
            } else st = parse_tensor(p, key, klen, &cap);
            if (st != QT_OK) return st;
            int r = next_or_close(p, '}');
            if (r < 0) return p->err ? p->err->status : QT_ERR_FORMAT;
            if (r == 0) break;
        }
    skip_ws(p);
    if (p->i < p->n) return perr(p, "something other than spaces after the header's closing '}'", NULL, NULL);
    return QT_OK;
}

/* ---- the checks of the parsed header ---------------------------------------------------------------------------- */

/* qsort_r comparators of indices into the StFile's tensors (a context, not a global: files may be opened from
 * several threads). */
static int by_name(const void *a, const void *b, void *ctx) {
    const StFile *f = ctx;
    return strcmp(f->tensors[*(const int *)a].name, f->tensors[*(const int *)b].name);
}

static int by_offset(const void *a, const void *b, void *ctx) {
    const StFile *f = ctx;
    const StTensor *x = &f->tensors[*(const int *)a], *y = &f->tensors[*(const int *)b];
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return *(const int *)a - *(const int *)b;
}

/* Names unique; each tensor's range matches its shape and lies in the data; the ranges, sorted, tile the data
 * exactly (as the reference implementation requires: no overlap, no gap, no trailing bytes). */
static QtStatus check_tensors(StFile *f, const char *what, QtError *err) {
    uint64_t data = f->file_size - f->data_start;
    char s1[QT_CLIP_BUF], s2[QT_CLIP_BUF];
    for (int k = 0; k < f->n; k++) {
        const StTensor *t = &f->tensors[k];
        uint64_t bytes = st_dtype_bytes(t->dtype), total = bytes;
        bool over = false;
        for (int d = 0; d < t->ndim; d++) {
            uint64_t s = (uint64_t)t->shape[d];
            if (s != 0 && total > UINT64_MAX / s) over = true;
            else total *= s;
        }
        for (int d = 0; over && d < t->ndim; d++) over = t->shape[d] != 0; /* a zero anywhere makes it empty */
        if (over) total = UINT64_MAX;
        char shape[ST_MAX_DIMS * 22 + 3] = "(";
        for (int d = 0; d < t->ndim; d++)
            snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "%s%" PRId64, d ? ", " : "", t->shape[d]);
        snprintf(shape + strlen(shape), sizeof shape - strlen(shape), t->ndim == 1 ? ",)" : ")");
        if (t->begin > t->end)
            return qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s': tensor '%s' has data_offsets [%" PRIu64
                                ", %" PRIu64 "], which end before they begin; the file is damaged", what,
                                qt_clip(t->name, s1), t->begin, t->end);
        if (over || t->end - t->begin != total)
            return qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s': tensor '%s' of shape %s and dtype %s "
                                "needs %s bytes but its data_offsets [%" PRIu64 ", %" PRIu64 "] hold %" PRIu64
                                "; the file is damaged", what, qt_clip(t->name, s1), shape, DTYPE_NAMES[t->dtype],
                                over ? "more than 2^64" : (snprintf(s2, sizeof s2, "%" PRIu64, total), s2),
                                t->begin, t->end, t->end - t->begin);
        if (t->end > data)
            return qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s': tensor '%s' has data_offsets [%" PRIu64
                                ", %" PRIu64 "] past the end of the data (%" PRIu64 " bytes after the header); the "
                                "file is truncated or damaged", what, qt_clip(t->name, s1), t->begin, t->end, data);
    }
    int *idx = malloc((size_t)(f->n ? f->n : 1) * sizeof *idx);
    if (!idx) return qt_error_set(err, QT_ERR_NOMEM, "out of memory checking the header of '%s'", what);
    for (int k = 0; k < f->n; k++) idx[k] = k;
    qsort_r(idx, (size_t)f->n, sizeof *idx, by_name, f);
    for (int k = 1; k < f->n; k++)
        if (strcmp(f->tensors[idx[k - 1]].name, f->tensors[idx[k]].name) == 0) {
            QtStatus st = qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s': tensor '%s' appears twice in "
                                       "the header; the file is damaged", what, qt_clip(f->tensors[idx[k]].name, s1));
            free(idx);
            return st;
        }
    qsort_r(idx, (size_t)f->n, sizeof *idx, by_offset, f);
    uint64_t at = 0;
    const StTensor *prev = NULL;
    for (int k = 0; k < f->n; k++) {
        const StTensor *t = &f->tensors[idx[k]];
        if (t->begin < at) {
            QtStatus st = qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s': the bytes [%" PRIu64 ", %" PRIu64
                                       ") of tensor '%s' overlap those of tensor '%s' [%" PRIu64 ", %" PRIu64 "); "
                                       "the file is damaged", what, t->begin, t->end, qt_clip(t->name, s1),
                                       qt_clip(prev->name, s2), prev->begin, prev->end);
            free(idx);
            return st;
        }
        if (t->begin > at) {
            QtStatus st = qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s': %" PRIu64 " bytes of the data "
                                       "before tensor '%s' (at %" PRIu64 ") belong to no tensor; safetensors files "
                                       "store the tensors back to back, so the file is damaged", what,
                                       t->begin - at, qt_clip(t->name, s1), t->begin);
            free(idx);
            return st;
        }
        if (t->end > at) prev = t;
        at = t->end;
    }
    free(idx);
    if (at != data)
        return qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s': the tensors end at byte %" PRIu64 " of the "
                            "data, but the file holds %" PRIu64 " bytes after the header; extra bytes at the end "
                            "(the file is damaged, or more than one file was written into it)", what, at, data);
    return QT_OK;
}

void st_close(StFile *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
    for (int m = 0; m < f->n_meta; m++) free(f->meta[m].value);
    free(f->meta);
    free(f->tensors);
    f->meta = NULL;
    f->tensors = NULL;
    f->n = f->n_meta = 0;
}

static uint64_t load_u64le(const uint8_t *b) {
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--) v = v << 8 | b[k];
    return v;
}

QtStatus st_parse(StFile *f, const uint8_t *buf, size_t len, uint64_t file_size, const char *what, QtError *err) {
    if (!f) return qt_error_set(err, QT_ERR_ARG, "st_parse: no StFile");
    memset(f, 0, sizeof *f);
    f->fd = -1;
    if (!what) what = "(memory)";
    f->file_size = file_size;
    if (file_size < 8)
        return qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s' is %" PRIu64 " bytes, shorter than the 8 bytes "
                            "of its header length: it is truncated or not a safetensors file", what, file_size);
    if (!buf || len < 8) return qt_error_set(err, QT_ERR_ARG, "st_parse: the first 8 bytes of '%s' are needed", what);
    uint64_t n = load_u64le(buf);
    if (n > ST_HEADER_MAX)
        return qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s' has a header of %" PRIu64 " bytes, more than "
                            "the %" PRIu64 " qtrain (like the reference implementation) reads; the file is damaged "
                            "or not a safetensors file", what, n, ST_HEADER_MAX);
    if (n > file_size - 8)
        return qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s' has a header of %" PRIu64 " bytes, but the "
                            "file holds only %" PRIu64 " after the 8-byte length; the file is truncated or not a "
                            "safetensors file", what, n, file_size - 8);
    if (len - 8 < n)
        return qt_error_set(err, QT_ERR_ARG, "st_parse: the header of '%s' is %" PRIu64 " bytes, %zu given", what, n,
                            len - 8);
    f->data_start = 8 + n;
    Parser p = {.s = buf + 8, .n = (size_t)n, .i = 0, .what = what, .err = err, .f = f};
    QtStatus st = parse_header(&p);
    if (st == QT_OK) st = check_tensors(f, what, err);
    if (st != QT_OK) {
        st_close(f);
        return st;
    }
    snprintf(f->path, sizeof f->path, "%s", what);
    return QT_OK;
}

QtStatus st_open(StFile *f, const char *path, QtError *err) {
    if (!f) return qt_error_set(err, QT_ERR_ARG, "st_open: no StFile");
    memset(f, 0, sizeof *f);
    f->fd = -1;
    if (!path || !*path) return qt_error_set(err, QT_ERR_ARG, "st_open: no file name");
    if (strlen(path) >= ST_PATH_MAX)
        return qt_error_set(err, QT_ERR_ARG, "cannot open safetensors file '%.200s...': its path is longer than %d "
                            "bytes", path, ST_PATH_MAX - 1);
    /* O_NONBLOCK: a FIFO does not block; it is refused as not a regular file */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return qt_error_set(err, QT_ERR_IO, "cannot open safetensors file '%s': %s; check the path", path,
                            strerror(errno));
    struct stat sb = {0};
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        int e = errno;
        bool reg = S_ISREG(sb.st_mode);
        close(fd);
        return qt_error_set(err, QT_ERR_IO, "cannot read safetensors file '%s': %s", path,
                            reg ? strerror(e) : "not a regular file; give the path of a .safetensors file");
    }
    uint64_t size = (uint64_t)sb.st_size;
    uint8_t head[8];
    size_t got = 0;
    if (fs_pread_full(fd, head, 8, 0, &got) != 0) {
        int e = errno;
        close(fd);
        return qt_error_set(err, QT_ERR_IO, "cannot read safetensors file '%s': %s", path, strerror(e));
    }
    uint8_t *buf = NULL;
    size_t want = 8;
    if (got == 8) {
        uint64_t n = load_u64le(head);
        if (n <= ST_HEADER_MAX && n <= size - 8) want = 8 + (size_t)n;
    }
    buf = malloc(want);
    if (!buf) {
        close(fd);
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory reading the header of safetensors file '%s'", path);
    }
    if (fs_pread_full(fd, buf, want, 0, &got) != 0) {
        int e = errno;
        free(buf);
        close(fd);
        return qt_error_set(err, QT_ERR_IO, "cannot read safetensors file '%s': %s", path, strerror(e));
    }
    /* a file that shrank meanwhile is judged by what could be read */
    QtStatus st = st_parse(f, buf, got, got < want ? got : size, path, err);
    free(buf);
    if (st != QT_OK) {
        close(fd);
        return st;
    }
    f->fd = fd;
    return QT_OK;
}

const StTensor *st_find(const StFile *f, const char *name) {
    if (!f || !name) return NULL;
    for (int k = 0; k < f->n; k++)
        if (strcmp(f->tensors[k].name, name) == 0) return &f->tensors[k];
    return NULL;
}

const char *st_meta(const StFile *f, const char *key) {
    if (!f || !key) return NULL;
    for (int k = 0; k < f->n_meta; k++)
        if (strcmp(f->meta[k].key, key) == 0) return f->meta[k].value;
    return NULL;
}

/* ---- reading tensors ------------------------------------------------------------------------------------------- */

/* IEEE binary16 to float, exactly (subnormals, infinities, NaN payloads kept). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        float v = ldexpf((float)m, -24); /* exact: m < 2^10 */
        return sign ? -v : v;
    }
    if (e == 31) bits = sign | 0x7f800000u | m << 13;
    else bits = sign | (e - 15 + 127) << 23 | m << 13;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

static float decode(StDtype d, const uint8_t *b) {
    switch (d) {
    case ST_F32: {
        uint32_t u = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
        float v;
        memcpy(&v, &u, 4);
        return v;
    }
    case ST_F16: return half_to_float((uint16_t)(b[0] | b[1] << 8));
    case ST_BF16: {
        uint32_t u = (uint32_t)(b[0] | b[1] << 8) << 16;
        float v;
        memcpy(&v, &u, 4);
        return v;
    }
    default: {
        uint64_t u = load_u64le(b);
        double v;
        memcpy(&v, &u, 8);
        return (float)v; /* round to nearest (the default rounding mode) */
    }
    }
}

QtStatus st_read_f32(const StFile *f, const StTensor *t, float *out, size_t n, QtError *err) {
    if (!f || !t) return qt_error_set(err, QT_ERR_ARG, "st_read_f32: no file or tensor");
    char s1[QT_CLIP_BUF];
    if (f->fd < 0)
        return qt_error_set(err, QT_ERR_ARG, "st_read_f32: '%s' is a header parsed from memory, not an open file",
                            f->path);
    if (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16 && t->dtype != ST_F64)
        return qt_error_set(err, QT_ERR_FORMAT, "safetensors file '%s': tensor '%s' is %s, not a float type, where "
                            "floating-point weights are expected (F32, F16, BF16 or F64); convert it before saving",
                            f->path, qt_clip(t->name, s1), st_dtype_name(t->dtype));
    size_t bytes = st_dtype_bytes(t->dtype);
    uint64_t len = t->end - t->begin;
    if (len / bytes != n || (n > 0 && !out))
        return qt_error_set(err, QT_ERR_ARG, "st_read_f32: tensor '%s' of '%s' holds %" PRIu64 " elements, %zu asked",
                            qt_clip(t->name, s1), f->path, len / bytes, n);
    struct stat sb = {0};
    if (fstat(f->fd, &sb) != 0 || (uint64_t)sb.st_size != f->file_size)
        return qt_error_set(err, QT_ERR_IO, "safetensors file '%s' changed while in use: it was %" PRIu64 " bytes "
                            "when opened, it is %lld now; do not rewrite a file while qtrain reads it", f->path,
                            f->file_size, (long long)sb.st_size);
    uint8_t chunk[16384];
    uint64_t off = f->data_start + t->begin;
    size_t done = 0, per = sizeof chunk / bytes;
    while (done < n) {
        size_t k = n - done < per ? n - done : per, got;
        if (fs_pread_full(f->fd, chunk, k * bytes, off + done * bytes, &got) != 0)
            return qt_error_set(err, QT_ERR_IO, "cannot read tensor '%s' of safetensors file '%s': %s",
                                qt_clip(t->name, s1), f->path, strerror(errno));
        if (got < k * bytes)
            return qt_error_set(err, QT_ERR_IO, "safetensors file '%s' became shorter while in use (reading tensor "
                                "'%s'); do not rewrite a file while qtrain reads it", f->path, qt_clip(t->name, s1));
        for (size_t j = 0; j < k; j++) out[done + j] = decode(t->dtype, chunk + j * bytes);
        done += k;
    }
    return QT_OK;
}
