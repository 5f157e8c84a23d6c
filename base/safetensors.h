/* safetensors.h - the safetensors file format, read from untrusted input and
 * written (safetensors.c reads, safetensors_write.c writes).
 *
 * Layout: an 8-byte little-endian header length N, then N bytes of UTF-8
 * JSON: an object mapping each tensor name to {"dtype": "F32", "shape":
 * [d0, ...], "data_offsets": [begin, end]} (offsets relative to the byte
 * after the header), and an optional "__metadata__" object of string to
 * string; then the tensor bytes, little-endian, C order. The reader checks
 * everything before trusting it: the header length against the file, the
 * JSON (a strict parser, never evaluated; nesting, string escapes, number
 * ranges bounded), every dtype known, every shape's product times the
 * dtype's size equal to its byte range, ranges inside the data and not
 * overlapping, names unique and non-empty. As the reference implementation
 * does, the ranges, sorted, must also tile the data exactly: no gap between
 * tensors and no bytes after the last one. A tensor object may hold only
 * dtype, shape and data_offsets; no key may repeat. Every error names the
 * file (or `what`), the tensor and what to do. docs/INTEROP.md lists what is
 * read and refused. */
#ifndef QTRAIN_BASE_SAFETENSORS_H
#define QTRAIN_BASE_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"

#define ST_MAX_DIMS 8
#define ST_NAME_MAX 256
#define ST_HEADER_MAX ((uint64_t)100 << 20) /* a longer header is refused before it is read */
#define ST_PATH_MAX 1024

typedef enum {
    ST_F64,
    ST_F32,
    ST_F16,
    ST_BF16,
    ST_I64,
    ST_I32,
    ST_I16,
    ST_I8,
    ST_U8,
    ST_BOOL,
    ST_DTYPE_COUNT
} StDtype;

typedef struct {
    char name[ST_NAME_MAX];
    StDtype dtype;
    int ndim;                    /* 0 = a scalar */
    int64_t shape[ST_MAX_DIMS];
    uint64_t begin, end;         /* byte range relative to the data's start */
} StTensor;

typedef struct {
    char key[ST_NAME_MAX];
    char *value;                 /* malloc'd */
} StMeta;

/* An open safetensors file (or a parsed header). */
typedef struct {
    int fd;                      /* -1 for a header parsed from memory */
    char path[ST_PATH_MAX];
    StTensor *tensors;           /* [n], in the header's order */
    int n;
    StMeta *meta;                /* [n_meta]: "__metadata__" */
    int n_meta;
    uint64_t data_start;         /* file offset of the data: 8 + header length */
    uint64_t file_size;
} StFile;

/* Whether the n bytes of s are valid UTF-8 (no overlong forms, surrogates
 * or code points past U+10FFFF), as JSON text must be; *bad gets the offset
 * of the first invalid byte (n when valid). */
bool st_utf8_valid(const uint8_t *s, size_t n, size_t *bad);

/* "F32", "F16", ...; its size in bytes. */
const char *st_dtype_name(StDtype d);
size_t st_dtype_bytes(StDtype d);

/* Opens path and parses and checks its header; the file stays open for
 * st_read_f32. QT_ERR_IO for a missing or unreadable file, QT_ERR_FORMAT for
 * anything wrong in it. st_close after success only. */
QtStatus st_open(StFile *f, const char *path, QtError *err);
/* The parser on memory: buf[len] holds at least the 8 bytes and the header
 * of a file of file_size bytes; `what` names it in messages. A header
 * running past buf but not past file_size is QT_ERR_ARG (read more). */
QtStatus st_parse(StFile *f, const uint8_t *buf, size_t len, uint64_t file_size, const char *what, QtError *err);
void st_close(StFile *f);

/* The tensor named name, or NULL. */
const StTensor *st_find(const StFile *f, const char *name);
/* The value of metadata key, or NULL. */
const char *st_meta(const StFile *f, const char *key);
/* Tensor t's elements as float32 into out[n] (n = the product of its
 * shape): F32 as is, F16 and BF16 exactly, F64 rounded to nearest; an
 * integer or bool tensor is QT_ERR_FORMAT naming it. A file that changed
 * size since st_open is QT_ERR_IO. */
QtStatus st_read_f32(const StFile *f, const StTensor *t, float *out, size_t n, QtError *err);

/* One tensor to write: float32 data of shape[ndim], or int64 data (I64:
 * a count PyTorch keeps as int64, such as num_batches_tracked) when data_i64
 * is set. */
typedef struct {
    const char *name;
    const float *data;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const int64_t *data_i64; /* instead of data */
} StWrite;

/* Writes a safetensors file of F32 (and I64) tensors t[0..n) (in that order, the data
 * 8-byte aligned as the reference implementation pads the header with
 * spaces) and metadata pairs meta[0..n_meta) (key, value: strings), to a
 * temporary name in path's directory, fsync'd and renamed over path (which
 * may be nothing or a regular file: fs_rename_tmp's FS_REPLACE_REGULAR), so
 * a reader never sees half a file. Names and metadata must be valid UTF-8. Names must be unique, non-empty, at most
 * ST_NAME_MAX - 1 bytes, and not "__metadata__". */
QtStatus st_write_f32(const char *path, const StWrite *t, int n, const char *const (*meta)[2], int n_meta,
                      QtError *err);

#endif
