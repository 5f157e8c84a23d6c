/* fuzz_entry_npy.c - the npy target: the input is a whole .npy file, read
 * from memory (npy_read_header_bytes) and as a file (npy_read_info, then
 * npy_file_open and npy_file_read_rows of every row).
 *
 * Checked besides crashes: both reads agree (status, message, NpyInfo); an
 * accepted header is consistent (shape product, sizes, dtype) and
 * describes exactly this file: the same header alone reads the same, a
 * file one byte longer or shorter is refused, and the rows read back are
 * the file's bytes after data_offset. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/npy.h"
#include "fuzz_harness.h"

/* Whether an accepted info is consistent with a file of size bytes. */
static int check_info(const NpyInfo *in, size_t size, char *why, size_t why_cap) {
    const char *bad = NULL;
    uint64_t n = 1;
    if (in->version < 1 || in->version > 3) bad = "version";
    else if ((unsigned)in->dtype >= NPY_DTYPE_COUNT || in->elem_bytes != npy_dtype_bytes(in->dtype)) bad = "dtype";
    else if (in->ndim < 0 || in->ndim > NPY_MAX_DIMS) bad = "ndim";
    for (int i = 0; !bad && i < NPY_MAX_DIMS; i++) {
        if (i >= in->ndim ? in->shape[i] != 0 : in->shape[i] < 0 || (uint64_t)in->shape[i] > NPY_MAX_ELEMS)
            bad = "shape";
        else if (i < in->ndim)
            n = in->shape[i] == 0 || n == 0 ? 0 : n * (uint64_t)in->shape[i]; /* n <= 2^40 before, d <= 2^40 */
    }
    if (!bad && (n != in->n_elems || n > NPY_MAX_ELEMS)) bad = "n_elems";
    else if (!bad && in->n_bytes != in->n_elems * (uint64_t)in->elem_bytes) bad = "n_bytes";
    else if (!bad && (in->data_offset > NPY_PREAMBLE_MAX + NPY_HEADER_MAX || in->data_offset + in->n_bytes != size))
        bad = "data_offset + n_bytes != the file's size";
    if (!bad) return 0;
    snprintf(why, why_cap, "npy_read_header_bytes accepted an inconsistent header (%s): version %d, dtype %d, ndim %d, "
             "n_elems %" PRIu64 ", n_bytes %" PRIu64 ", data_offset %" PRIu64 ", file %zu bytes",
             bad, in->version, (int)in->dtype, in->ndim, in->n_elems, in->n_bytes, in->data_offset, size);
    return 1;
}

/* The accepted header describes exactly this file: alone it reads the same, one byte more or less is refused. */
static int check_exact(const uint8_t *data, size_t size, const NpyInfo *in, char *why, size_t why_cap) {
    NpyInfo alone;
    QtError err = {0};
    QtStatus st = npy_read_header_bytes(data, (size_t)in->data_offset, size, &alone, "input.npy", &err);
    if (st != QT_OK || memcmp(&alone, in, sizeof alone) != 0) {
        snprintf(why, why_cap, "the header alone does not read as the whole file: status %d (%s)", (int)st, err.msg);
        return 1;
    }
    uint64_t other[2] = {(uint64_t)size + 1, (uint64_t)size - 1};
    for (int k = 0; k < 2; k++) {
        if (k == 1 && in->n_bytes == 0) break; /* one byte less cuts into the header */
        qt_error_clear(&err);
        st = npy_read_header_bytes(data, (size_t)in->data_offset, other[k], &alone, "input.npy", &err);
        if (fuzz_check_status("npy_read_header_bytes (another size)", st, &err, why, why_cap)) return 1;
        if (st != QT_ERR_FORMAT) {
            snprintf(why, why_cap, "a file of %" PRIu64 " bytes with the header of one of %zu was not refused "
                     "(status %d)", other[k], size, (int)st);
            return 1;
        }
    }
    return 0;
}

/* Every row read back by npy_file_read_rows, equal to the bytes after the header. */
static int check_rows(const char *path, const uint8_t *data, const NpyInfo *in, char *why, size_t why_cap) {
    NpyFile f;
    QtError err = {0};
    QtStatus st = npy_file_open(&f, path, &err);
    if (fuzz_check_status("npy_file_open", st, &err, why, why_cap)) return 1;
    if (st != QT_OK || memcmp(&f.info, in, sizeof *in) != 0) {
        snprintf(why, why_cap, "npy_file_open disagrees with npy_read_info: status %d (%s)", (int)st, err.msg);
        if (st == QT_OK) npy_file_close(&f);
        return 1;
    }
    int bad = 0;
    if (in->ndim >= 1) {
        uint8_t *buf = malloc(in->n_bytes ? (size_t)in->n_bytes : 1);
        if (!buf) {
            npy_file_close(&f);
            snprintf(why, why_cap, "out of memory");
            return 1;
        }
        uint64_t rows = (uint64_t)in->shape[0];
        st = npy_file_read_rows(&f, 0, rows, buf, (size_t)in->n_bytes, &err);
        bad = fuzz_check_status("npy_file_read_rows", st, &err, why, why_cap);
        if (!bad && (st != QT_OK || memcmp(buf, data + in->data_offset, (size_t)in->n_bytes) != 0)) {
            snprintf(why, why_cap, "npy_file_read_rows of all %" PRIu64 " rows differs from the file: status %d (%s)",
                     rows, (int)st, err.msg);
            bad = 1;
        }
        qt_error_clear(&err);
        st = npy_file_read_rows(&f, rows, 1, buf, (size_t)in->n_bytes, &err);
        if (!bad && st != QT_ERR_ARG) {
            snprintf(why, why_cap, "npy_file_read_rows past the last row was not refused (status %d)", (int)st);
            bad = 1;
        }
        free(buf);
    }
    npy_file_close(&f);
    return bad;
}

int fuzz_npy_one(const uint8_t *data, size_t size, char *why, size_t why_cap) {
    char path[512];
    if (fuzz_write_file("input.npy", data, size, path, sizeof path) != 0) {
        snprintf(why, why_cap, "cannot write the scratch .npy file");
        return 1;
    }
    NpyInfo mem, file;
    QtError merr = {0}, ferr = {0};
    QtStatus mst = npy_read_header_bytes(data, size, size, &mem, path, &merr);
    if (fuzz_check_status("npy_read_header_bytes", mst, &merr, why, why_cap)) return 1;
    if (mst == QT_ERR_ARG) {
        snprintf(why, why_cap, "npy_read_header_bytes of a whole file blamed its caller: %s", merr.msg);
        return 1;
    }
    QtStatus fst = npy_read_info(path, &file, &ferr);
    if (fuzz_check_status("npy_read_info", fst, &ferr, why, why_cap)) return 1;
    if (fst != mst || strcmp(ferr.msg, merr.msg) != 0 || (mst == QT_OK && memcmp(&mem, &file, sizeof mem) != 0)) {
        snprintf(why, why_cap, "npy_read_info disagrees with npy_read_header_bytes: status %d vs %d (%s | %s)",
                 (int)fst, (int)mst, ferr.msg, merr.msg);
        return 1;
    }
    if (mst != QT_OK) return 0;
    if (check_info(&mem, size, why, why_cap) || check_exact(data, size, &mem, why, why_cap)) return 1;
    return check_rows(path, data, &mem, why, why_cap);
}
