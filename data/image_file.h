/* image_file.h - the images of a data set read in place from an
 * uncompressed IDX file (data.storage: file), a batch at a time. Not part
 * of the public API: dataset.c is the only user.
 *
 * The file's rows stay where they are; a data set keeps the list of rows it
 * uses (after classes, limit and the validation split) and whether its
 * images are transposed, and reads the rows of each batch with pread into
 * a buffer allocated once. Rows that follow each other in the file are
 * read with one pread, up to the buffer's size. */
#ifndef QTRAIN_DATA_IMAGE_FILE_H
#define QTRAIN_DATA_IMAGE_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dataset.h"
#include "base/h5io.h"

/* The read buffer holds at most this many bytes of rows (at least one row). */
#define IMAGE_FILE_BUF_BYTES ((size_t)256 << 10)

struct DatasetFile {
    int fd;
    char path[IDX_FILE_PATH_MAX];
    uint64_t offset;          /* file offset of row 0's first byte */
    size_t row_bytes;         /* bytes per example (the data set's feat) */
    int n_rows;               /* examples the file holds */
    uint64_t size;            /* the file's size and modification time when it was opened; */
    int64_t mtime_s;          /* a change seen later is an error */
    long mtime_ns;
    uint32_t *rows;           /* [n]: file row of the data set's example i; NULL: first + i */
    int first;
    bool transpose;           /* each (side, side) channel is transposed as it is read */
    int channels, side;
    uint8_t *buf;             /* [cap][row_bytes]: the read buffer */
    int cap;                  /* rows the buffer holds */
    H5ioFile *h5;             /* an HDF5 data set: rows read from h5ds by hyperslab (fd only watches for
                                 changes); NULL: rows read from fd with pread */
    H5ioDataset h5ds;
    hid_t h5type;             /* the memory type h5ds's rows are read as (owned when h5type_owned) */
    bool h5type_owned;
    char h5path[256];         /* the dataset's path in the file, to open it again for a split */
};

/* Called for each run of k rows read: examples i0..i0+k-1 of the request,
 * their bytes px [k][row_bytes] (untransposed, as the file holds them). */
typedef void (*ImageRunFn)(void *ctx, int i0, const uint8_t *px, int k);

/* A data set's file over f's rows (N, H, W): one channel of H x W. Takes
 * f's descriptor (f->fd is -1 afterwards), also on failure. */
QtStatus image_file_open(DatasetFile **out, IdxFile *f, QtError *err);
void image_file_free(DatasetFile *f);
/* A data set's file over rows of row_bytes from byte `offset` of the
 * uncompressed file at path (a .npy file's data): opened here. */
QtStatus image_file_open_rows(DatasetFile **out, const char *path, uint64_t offset, int n_rows, size_t row_bytes,
                              QtError *err);
/* A data set's file over dataset `dset` of HDF5 file `path` (n_rows, then
 * row_bytes per row as memtype gives them; memtype owned by the file when
 * own_type). Rows are read by hyperslab; the dataset passed h5io's checks. */
QtStatus image_file_open_hdf5(DatasetFile **out, const char *path, const char *dset, int n_rows, size_t row_bytes,
                              hid_t memtype, bool own_type, QtError *err);

static inline uint32_t image_file_row(const DatasetFile *f, uint32_t i) {
    return f->rows ? f->rows[i] : (uint32_t)f->first + i;
}

/* Keeps examples keep[0..cnt-1] (increasing indices into the current
 * examples), in that order. Returns true if it took keep as its row list
 * (the caller must then not free it); never fails. */
bool image_file_keep(DatasetFile *f, uint32_t *keep, int cnt);

/* A new file over examples first..first+k-1 of f (its own descriptor and
 * buffer); f keeps examples 0..first-1. */
QtStatus image_file_split(DatasetFile *f, int first, int k, DatasetFile **tail, QtError *err);

/* Reads examples idx[0..n-1] (idx NULL: start..start+n-1) and hands them
 * to fn run by run, in request order. QT_ERR_IO if the file changed since
 * it was opened or a read fails or comes up short. */
QtStatus image_file_read(const DatasetFile *f, const uint32_t *idx, int start, int n, ImageRunFn fn, void *ctx,
                         QtError *err);

#endif
