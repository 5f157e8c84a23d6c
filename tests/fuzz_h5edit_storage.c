/* fuzz_h5edit_storage.c - the storage edits of fuzz_h5edit.h (opcodes
 * 0xf0-0xf9): a dataset's contents kept, stored in a way a loader must
 * refuse or may accept. */
#include <errno.h>
#include <hdf5.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_h5edit_internal.h"
#include "fuzz_harness.h"

/* A FIFO nobody writes, in the scratch directory: external storage, virtual
 * sources and external links point at it, so a loader that opened one would
 * block until libFuzzer's timeout reports it. NULL if it cannot be made. */
const char *fifo_path(void) {
    static char path[512];
    static bool tried = false;
    if (tried) return path[0] ? path : NULL;
    tried = true;
    const char *dir = fuzz_scratch_dir();
    if (!dir || snprintf(path, sizeof path, "%s/fifo", dir) >= (int)sizeof path ||
        (mkfifo(path, 0600) != 0 && errno != EEXIST))
        path[0] = '\0';
    return path[0] ? path : NULL;
}

/* The same dataset (type, shape, contents) stored another way: external
 * (in the FIFO), virtual (from the FIFO or a missing file), chunked beyond
 * its extent, through a filter qtrain refuses (scale-offset, n-bit, an
 * unregistered optional one) or one it accepts (shuffle, fletcher32,
 * deflate in chunks within the dataset, compact), or never written. */
void op_storage(hid_t f, Reader *r, const Links *l) {
    const char *path = pick(r, l);
    DsCopy old;
    if (!is_kind(f, path, H5I_DATASET) || !ds_read(f, path, &old)) return;
    uint8_t how = u8(r) % 11, grow = u8(r);
    const char *fifo = fifo_path();
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    hsize_t max[H5S_MAX_RANK], chunk[H5S_MAX_RANK];
    bool unlimited = false, write = true, ok = old.rank > 0 && old.numel > 0 && dcpl >= 0;
    for (int k = 0; k < old.rank; k++) chunk[k] = old.dims[k];
    hid_t s = H5I_INVALID_HID;
    switch (ok ? how : 255) {
    case 0:
        ok = fifo && H5Pset_external(dcpl, fifo, 0, H5F_UNLIMITED) >= 0;
        write = false;
        break;
    case 1:
    case 2:
        s = H5Screate_simple(old.rank, old.dims, NULL);
        ok = s >= 0 && (how == 2 || fifo) &&
             H5Pset_virtual(dcpl, s, how == 1 ? fifo : "qtrain-fuzz-missing.h5", "/x", s) >= 0;
        write = false;
        break;
    case 3: { /* chunks larger than the dataset, of at most about 2^20 elements */
        hsize_t rest = 1;
        for (int k = 1; k < old.rank; k++) rest *= old.dims[k];
        chunk[0] = old.dims[0] + 1 + grow % (1 + ((hsize_t)1 << 20) / (rest ? rest : 1));
        unlimited = true;
        ok = H5Pset_chunk(dcpl, old.rank, chunk) >= 0 && H5Pset_deflate(dcpl, 1) >= 0;
        break;
    }
    case 4:
        ok = H5Pset_chunk(dcpl, old.rank, chunk) >= 0 &&
             (H5Tget_class(old.type) == H5T_FLOAT ? H5Pset_scaleoffset(dcpl, H5Z_SO_FLOAT_DSCALE, 2)
                                                  : H5Pset_scaleoffset(dcpl, H5Z_SO_INT, 0)) >= 0;
        break;
    case 5: ok = H5Pset_chunk(dcpl, old.rank, chunk) >= 0 && H5Pset_nbit(dcpl) >= 0; break;
    case 6:
        ok = H5Pset_chunk(dcpl, old.rank, chunk) >= 0 &&
             H5Pset_filter(dcpl, (H5Z_filter_t)(32000 + grow % 8), H5Z_FLAG_OPTIONAL, 0, NULL) >= 0;
        break;
    case 7: /* accepted: shuffle, deflate and fletcher32 in chunks within the dataset */
        chunk[0] = 1 + grow % old.dims[0];
        ok = H5Pset_chunk(dcpl, old.rank, chunk) >= 0 && H5Pset_shuffle(dcpl) >= 0 && H5Pset_deflate(dcpl, 6) >= 0 &&
             H5Pset_fletcher32(dcpl) >= 0;
        break;
    case 8: ok = old.numel * old.esize < 32768 && H5Pset_layout(dcpl, H5D_COMPACT) >= 0; break; /* accepted */
    case 9: write = false; break; /* never written */
    default: /* only partly written: chunks of one row, the first written */
        chunk[0] = 1;
        ok = old.dims[0] > 1 && H5Pset_chunk(dcpl, old.rank, chunk) >= 0;
        write = false;
        break;
    }
    for (int k = 0; k < old.rank; k++) max[k] = unlimited ? H5S_UNLIMITED : old.dims[k];
    if (s >= 0) H5Sclose(s);
    s = ok ? H5Screate_simple(old.rank, old.dims, max) : H5I_INVALID_HID;
    hid_t d = s >= 0 && H5Ldelete(f, path, H5P_DEFAULT) >= 0
                  ? H5Dcreate2(f, path, old.type, s, H5P_DEFAULT, dcpl, H5P_DEFAULT) : H5I_INVALID_HID;
    if (d >= 0 && write) H5Dwrite(d, old.type, H5S_ALL, H5S_ALL, H5P_DEFAULT, old.buf);
    if (d >= 0 && how == 10) { /* the first row only */
        hsize_t start[H5S_MAX_RANK] = {0}, count[H5S_MAX_RANK];
        memcpy(count, old.dims, sizeof count);
        count[0] = 1;
        hid_t fs = H5Dget_space(d), ms = H5Screate_simple(old.rank, count, NULL);
        if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
            H5Dwrite(d, old.type, ms, fs, H5P_DEFAULT, old.buf);
        if (ms >= 0) H5Sclose(ms);
        if (fs >= 0) H5Sclose(fs);
    }
    if (d >= 0) H5Dclose(d);
    if (s >= 0) H5Sclose(s);
    if (dcpl >= 0) H5Pclose(dcpl);
    ds_copy_free(&old);
}
