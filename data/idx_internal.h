/* idx_internal.h - the IDX header checks that the gzip reader (idx.c) and
 * the decompressed cache (idx_cache.c) share, so a cached copy is held to
 * exactly the rules the original file is. Not part of the public API. */
#ifndef QTRAIN_DATA_IDX_INTERNAL_H
#define QTRAIN_DATA_IDX_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dataset.h"

#define IDX_TYPE_UBYTE 0x08
#define IDX_MAX_ELEMS ((uint64_t)1 << 31)
/* The longest IDX header: the magic and IDX_MAX_DIMS dimensions. */
#define IDX_HEADER_MAX (4 + 4 * IDX_MAX_DIMS)

/* Checks the magic 00 00 08 <ndim> in magic[0..got-1] (got < 4: the file
 * ended there); *ndim gets the dimension count. QT_ERR_FORMAT naming path. */
QtStatus idx_check_magic(const uint8_t *magic, size_t got, const char *path, int *ndim, QtError *err);

/* Decodes ndim big-endian dimensions from raw[0..4*ndim-1] into out->dims
 * and out->ndim; *n_elems gets their product. Every dimension must be >= 1
 * and the product below 2^31. */
QtStatus idx_decode_dims(const uint8_t *raw, int ndim, const char *path, IdxArray *out, uint64_t *n_elems,
                         QtError *err);

/* The magic and big-endian dimensions of a into hdr [4 + 4 * a->ndim]. */
void idx_encode_header(const IdxArray *a, uint8_t *hdr);

/* Where idx_stream puts a file's contents. Either function returns false
 * to stop the stream (a problem of the sink, not of the file). */
typedef struct {
    /* the checked header: shape (dims, n_bytes; no data) and its bytes hdr[0..hdr_len-1] */
    bool (*begin)(void *ctx, const IdxArray *shape, const uint8_t *hdr, size_t hdr_len);
    bool (*data)(void *ctx, const uint8_t *p, size_t n); /* the next n payload bytes */
    void *ctx;
} IdxSink;

/* idx_read without holding the payload: the header, then the payload in
 * chunks of at most 1 MB, go to the sink as they are read, and the file is
 * held to exactly idx_read's rules, with its messages (a truncated or
 * over-long file fails after the sink got what there was). *refused is set
 * when the sink stopped the stream (QT_OK then). */
QtStatus idx_stream(const char *path, const IdxSink *sink, bool *refused, QtError *err);

#endif
