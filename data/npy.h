/* npy.h - NumPy .npy files (format versions 1.0, 2.0 and 3.0), read from
 * untrusted input.
 *
 * Layout: the magic "\x93NUMPY", the version (major, minor), the header's
 * length (2 bytes little-endian in 1.0, 4 bytes in 2.0 and 3.0), the header
 * (a Python dict literal with exactly the keys 'descr', 'fortran_order' and
 * 'shape', padded with spaces and ended by '\n'), then the elements.
 *
 * Accepted: little-endian (or one-byte) integers of 8-64 bits, float16/32/64
 * and bool, in C order, of at most NPY_MAX_DIMS dimensions and
 * NPY_MAX_ELEMS elements. The header is parsed by a small strict parser,
 * never evaluated. The file must hold exactly the bytes its header
 * announces. Everything else (big-endian, Fortran order, structured,
 * object, string or complex dtypes, a file shorter or longer than its
 * header says) is an error naming the file, what is wrong and what to do. */
#ifndef QTRAIN_DATA_NPY_H
#define QTRAIN_DATA_NPY_H

#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

#define NPY_MAX_DIMS 8
/* More elements than this (a terabyte of uint8) is refused as a damaged header. */
#define NPY_MAX_ELEMS ((uint64_t)1 << 40)
/* NumPy writes headers of a few hundred bytes; a longer one is refused before it is read. */
#define NPY_HEADER_MAX 65536
/* The magic, version and a 2.0/3.0 header length: the bytes before the header. */
#define NPY_PREAMBLE_MAX 12
#define NPY_PATH_MAX 1024

typedef enum {
    NPY_U8,
    NPY_I8,
    NPY_U16,
    NPY_I16,
    NPY_U32,
    NPY_I32,
    NPY_I64,
    NPY_U64,
    NPY_F16,
    NPY_F32,
    NPY_F64,
    NPY_BOOL,
    NPY_DTYPE_COUNT
} NpyDtype;

typedef struct {
    NpyDtype dtype;
    int elem_bytes;
    int version;                  /* the format's major version: 1, 2 or 3 */
    int ndim;                     /* 0 = a scalar (one element) */
    int64_t shape[NPY_MAX_DIMS];  /* [ndim], each >= 0; unused entries 0 */
    uint64_t data_offset;         /* file offset of the first element */
    uint64_t n_elems, n_bytes;    /* the product of shape; n_elems * elem_bytes */
} NpyInfo;

/* An open .npy file whose rows (along axis 0) are read on demand. */
typedef struct {
    int fd;                       /* -1 when closed */
    char path[NPY_PATH_MAX];
    NpyInfo info;
    uint64_t row_elems;           /* elements per row: the product of shape[1..ndim) */
    uint64_t row_bytes;
} NpyFile;

/* The header of the file at path, and the check that the file holds
 * exactly data_offset + n_bytes bytes. Reads at most the preamble and the
 * header. */
QtStatus npy_read_info(const char *path, NpyInfo *info, QtError *err);

/* The parser on memory: buf[len] holds at least the preamble and the header
 * of a file of file_size bytes (a whole file: len == file_size). `what`
 * names the file in messages. A header that runs past buf but not past
 * file_size is QT_ERR_ARG (the caller read too little). */
QtStatus npy_read_header_bytes(const uint8_t *buf, size_t len, uint64_t file_size, NpyInfo *info, const char *what,
                               QtError *err);

/* Opens path and reads its header (npy_read_info's checks); f->fd stays
 * open for npy_file_read_rows. npy_file_close on success only. */
QtStatus npy_file_open(NpyFile *f, const char *path, QtError *err);
/* Rows [start, start + n) of f (an array of ndim >= 1 in C order) into
 * buf[cap] bytes, as the file holds them (little-endian). A file that
 * became shorter since it was opened is an error. */
QtStatus npy_file_read_rows(const NpyFile *f, uint64_t start, uint64_t n, void *buf, size_t cap, QtError *err);
void npy_file_close(NpyFile *f);

/* A version 1.0 .npy file of float32 ('<f4', C order) data of shape[ndim]
 * in memory: *buf (malloc'd; the caller frees and writes it), *len. The
 * header is padded to 64 bytes as NumPy does. */
QtStatus npy_encode_f32(const float *data, int ndim, const int64_t *shape, void **buf, size_t *len, QtError *err);
/* The same for int8 data ('|i1'). */
QtStatus npy_encode_i8(const int8_t *data, int ndim, const int64_t *shape, void **buf, size_t *len, QtError *err);

/* NumPy's name of the dtype ("float32", "uint8", ...). */
const char *npy_dtype_name(NpyDtype dtype);
/* Bytes per element of the dtype, 0 for an unknown one. */
int npy_dtype_bytes(NpyDtype dtype);

#endif
