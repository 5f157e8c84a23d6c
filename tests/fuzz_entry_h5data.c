/* fuzz_entry_h5data.c - the h5data target: an HDF5 data file (data.dataset:
 * hdf5), edited as the input says (fuzz_h5edit.h), loaded as a run loads it.
 *
 * Input: byte 0 picks one of four small valid data files written at init
 * (uint8 images with class labels and a `classes` attribute; float32
 * vectors with (N, 2) float targets and a /val split; float16 images in
 * gzip'd chunks with mean/std attributes; int8 vectors), the rest is the
 * edit script. The edited file is loaded with its examples in memory and
 * read per batch. What must hold besides not crashing:
 *   - every failure has a status and a message (fuzz_check_status);
 *   - a file loaded in memory gives labels below its class count, finite
 *     targets and examples, and survives a measured per-channel normalize;
 *   - read per batch, the same file loads too and gives the same floats,
 *     labels and targets, batch by batch, unless a batch names a
 *     non-finite value (which the load in memory found at once);
 *   - no HDF5 object stays open. */
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/dataset.h"
#include "fuzz_h5edit.h"
#include "fuzz_harness.h"

#define N_BASES 4

typedef struct {
    void *image;
    size_t size;
} Base;

static Base bases[N_BASES];

/* A dataset of shape dims[rank] in file type ft from data in memory type mt, under parents made as needed;
 * gzip'd chunks of two rows when chunked. */
static bool put(hid_t f, const char *path, hid_t ft, hid_t mt, int rank, const hsize_t *dims, const void *data,
                bool chunked) {
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE), dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    if (chunked) {
        hsize_t c[4];
        memcpy(c, dims, (size_t)rank * sizeof *c);
        c[0] = 2;
        H5Pset_chunk(dcpl, rank, c);
        H5Pset_deflate(dcpl, 1);
    }
    hid_t sp = H5Screate_simple(rank, dims, NULL);
    hid_t d = H5Dcreate2(f, path, ft, sp, lcpl, dcpl, H5P_DEFAULT);
    bool ok = d >= 0 && H5Dwrite(d, mt, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0;
    if (d >= 0) H5Dclose(d);
    H5Sclose(sp), H5Pclose(dcpl), H5Pclose(lcpl);
    return ok;
}

static bool put_attr(hid_t f, const char *name, hid_t mt, hsize_t n, const void *v) {
    hid_t sp = H5Screate_simple(1, &n, NULL);
    hid_t a = H5Acreate2(f, name, mt == H5T_NATIVE_DOUBLE ? H5T_IEEE_F64LE : H5T_STD_I64LE, sp, H5P_DEFAULT,
                         H5P_DEFAULT);
    bool ok = a >= 0 && H5Awrite(a, mt, v) >= 0;
    if (a >= 0) H5Aclose(a);
    H5Sclose(sp);
    return ok;
}

/* Base k into a file of the scratch directory, then into memory. */
static int make_base(int k, Base *b) {
    char path[512];
    if (fuzz_write_file("base.h5", "", 0, path, sizeof path)) return 1;
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    if (f < 0) return 1;
    uint8_t u8[6 * 16];
    int8_t i8[6 * 5];
    float f32[6 * 6], tg[6 * 2];
    uint16_t f16[6 * 18];
    int64_t lab[6] = {0, 2, 1, 2, 0, 1}, lab_i8[6] = {3, 0, 1, 2, 3, 0};
    for (int i = 0; i < 96; i++) u8[i] = (uint8_t)(i * 29 + 3);
    for (int i = 0; i < 30; i++) i8[i] = (int8_t)(i * 11 - 100);
    for (int i = 0; i < 36; i++) f32[i] = (float)i * 0.25f - 3.0f;
    for (int i = 0; i < 12; i++) tg[i] = (float)(i % 5) - 2.0f;
    for (int i = 0; i < 108; i++) f16[i] = (uint16_t)(0x3000 + 37 * i); /* 0.125 .. ~2, finite */
    bool ok = true;
    const char *split[2] = {"train", "test"};
    for (int s = 0; s < 2 && ok; s++) {
        char px[16], py[16];
        snprintf(px, sizeof px, "%s/x", split[s]);
        snprintf(py, sizeof py, "%s/y", split[s]);
        if (k == 0) {
            ok = put(f, px, H5T_STD_U8LE, H5T_NATIVE_UINT8, 4, (hsize_t[]){6, 1, 4, 4}, u8, false) &&
                 put(f, py, H5T_STD_I64LE, H5T_NATIVE_INT64, 1, (hsize_t[]){6}, lab, false);
        } else if (k == 1) {
            ok = put(f, px, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 2, (hsize_t[]){6, 6}, f32, false) &&
                 put(f, py, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 2, (hsize_t[]){6, 2}, tg, false);
        } else if (k == 2) {
            hid_t half = H5Tcopy(H5T_IEEE_F32LE);
            H5Tset_fields(half, 15, 10, 5, 0, 10), H5Tset_precision(half, 16), H5Tset_size(half, 2),
                H5Tset_ebias(half, 15);
            ok = put(f, px, half, half, 4, (hsize_t[]){6, 2, 3, 3}, f16, true) &&
                 put(f, py, H5T_STD_U8LE, H5T_NATIVE_INT64, 1, (hsize_t[]){6}, lab, true);
            H5Tclose(half);
        } else {
            ok = put(f, px, H5T_STD_I8LE, H5T_NATIVE_INT8, 2, (hsize_t[]){6, 5}, i8, false) &&
                 put(f, py, H5T_STD_I32LE, H5T_NATIVE_INT64, 1, (hsize_t[]){6}, lab_i8, false);
        }
    }
    if (ok && k == 0) ok = put_attr(f, "classes", H5T_NATIVE_INT64, 3, lab);
    if (ok && k == 1)
        ok = put(f, "val/x", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 2, (hsize_t[]){3, 6}, f32, false) &&
             put(f, "val/y", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 2, (hsize_t[]){3, 2}, tg, false);
    if (ok && k == 2) {
        const double mean[2] = {0.5, 1.0}, std[2] = {0.25, 0.5};
        ok = put_attr(f, "mean", H5T_NATIVE_DOUBLE, 2, mean) && put_attr(f, "std", H5T_NATIVE_DOUBLE, 2, std);
    }
    ok = H5Fclose(f) >= 0 && ok;
    FILE *in = ok ? fopen(path, "rb") : NULL;
    if (!in) return 1;
    fseek(in, 0, SEEK_END);
    long n = ftell(in);
    fseek(in, 0, SEEK_SET);
    b->image = malloc((size_t)n);
    b->size = (size_t)n;
    ok = b->image && fread(b->image, 1, (size_t)n, in) == (size_t)n;
    fclose(in);
    return ok ? 0 : 1;
}

int fuzz_h5data_init(char *why, size_t why_cap) {
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    for (int k = 0; k < N_BASES; k++)
        if (!bases[k].image && make_base(k, &bases[k])) {
            snprintf(why, why_cap, "h5data: cannot write base data file %d", k);
            return 1;
        }
    return 0;
}

void fuzz_h5data_cleanup(void) {
    for (int k = 0; k < N_BASES; k++) free(bases[k].image), bases[k].image = NULL;
}

/* Every example of d as floats into x (n, feat), its labels or targets into y / t. */
static QtStatus fill_all(const Dataset *d, float *x, int32_t *y, float *t, QtError *err) {
    for (int a = 0; a < d->n; a += 4) {
        const int k = d->n - a < 4 ? d->n - a : 4;
        QtStatus st = dataset_fill_range(d, a, k, x + (size_t)a * d->feat, y ? y + a : NULL, err);
        if (st != QT_OK) return st;
    }
    if (t) dataset_fill_targets_range(d, 0, d->n, t);
    return QT_OK;
}

/* The checks of one loaded split (memory m, file f) of the same file. */
static int check_split(const char *name, const Dataset *m, const Dataset *f, char *why, size_t why_cap) {
    if (m->n != f->n || m->feat != f->feat || m->n_classes != f->n_classes || m->n_targets != f->n_targets) {
        snprintf(why, why_cap, "h5data: the %s split loads as %d x %d in memory but %d x %d per batch", name, m->n,
                 m->feat, f->n, f->feat);
        return 1;
    }
    for (int i = 0; m->labels && i < m->n; i++)
        if (m->labels[i] < 0 || m->labels[i] >= m->n_classes) {
            snprintf(why, why_cap, "h5data: %s label %d of example %d is outside the %d classes", name,
                     (int)m->labels[i], i, m->n_classes);
            return 1;
        }
    const size_t nx = (size_t)m->n * m->feat, nt = (size_t)m->n * m->n_targets;
    float *xm = malloc(nx * sizeof *xm + 1), *xf = malloc(nx * sizeof *xf + 1);
    float *tm = malloc(nt * sizeof *tm + 1), *tf = malloc(nt * sizeof *tf + 1);
    int32_t *ym = malloc((size_t)m->n * 4 + 1), *yf = malloc((size_t)m->n * 4 + 1);
    QtError e1 = {0}, e2 = {0};
    int bad = 0;
    QtStatus s1 = fill_all(m, xm, m->labels ? ym : NULL, m->targets ? tm : NULL, &e1);
    QtStatus s2 = fill_all(f, xf, f->labels ? yf : NULL, f->targets ? tf : NULL, &e2);
    if (s1 != QT_OK || s2 != QT_OK) {
        snprintf(why, why_cap, "h5data: a %s batch failed after a clean load: %s%s", name, e1.msg, e2.msg);
        bad = 1;
    }
    for (size_t i = 0; !bad && i < nx; i++)
        if (!isfinite(xm[i])) snprintf(why, why_cap, "h5data: %s value %zu is %g after loading", name, i,
                                       (double)xm[i]), bad = 1;
    for (size_t i = 0; !bad && i < nt; i++)
        if (!isfinite(tm[i])) snprintf(why, why_cap, "h5data: %s target %zu is %g", name, i, (double)tm[i]), bad = 1;
    if (!bad && (memcmp(xm, xf, nx * sizeof *xm) != 0 || (m->labels && memcmp(ym, yf, (size_t)m->n * 4) != 0) ||
                 (m->targets && memcmp(tm, tf, nt * sizeof *tm) != 0))) {
        snprintf(why, why_cap, "h5data: the %s split reads differently in memory and per batch", name);
        bad = 1;
    }
    free(xm), free(xf), free(tm), free(tf), free(ym), free(yf);
    return bad;
}

int fuzz_h5data_one(const uint8_t *data, size_t size, char *why, size_t why_cap) {
    if (fuzz_h5data_init(why, why_cap)) return 1;
    const Base *b = &bases[size ? data[0] % N_BASES : 0];
    void *image = NULL;
    size_t image_size = 0;
    if (fuzz_h5_edit(b->image, b->size, size ? data + 1 : data, size ? size - 1 : 0, &image, &image_size)) {
        snprintf(why, why_cap, "h5data: HDF5 could not apply the edits to a base data file");
        return 1;
    }
    char path[512];
    int bad = fuzz_write_file("data.h5", image, image_size, path, sizeof path);
    free(image);
    Dataset m[3], f[3];
    memset(m, 0, sizeof m), memset(f, 0, sizeof f);
    QtError em = {0}, ef = {0};
    QtStatus sm = bad ? QT_ERR_IO : dataset_load_hdf5(&m[0], &m[1], &m[2], path, DATA_STORAGE_MEMORY, 1u << 30, &em);
    bad = bad || fuzz_check_status("dataset_load_hdf5 (memory)", sm, &em, why, why_cap);
    QtStatus sf = bad ? QT_ERR_IO : dataset_load_hdf5(&f[0], &f[1], &f[2], path, DATA_STORAGE_FILE, 1u << 30, &ef);
    bad = bad || fuzz_check_status("dataset_load_hdf5 (per batch)", sf, &ef, why, why_cap);
    if (!bad && sm == QT_OK && sf != QT_OK) {
        snprintf(why, why_cap, "h5data: the file loads in memory but not per batch: %s", ef.msg);
        bad = 1;
    }
    static const char *const names[3] = {"train", "val", "test"};
    for (int s = 0; !bad && sm == QT_OK && s < 3; s++) bad = check_split(names[s], &m[s], &f[s], why, why_cap);
    if (!bad && sm == QT_OK) { /* the transforms on what loaded: a measured per-channel normalize */
        Transform t = {.kind = TRANSFORM_NORMALIZE, .per_channel = true};
        QtError et = {0};
        QtStatus st = dataset_apply_transforms3(&m[0], m[1].n ? &m[1] : NULL, &m[2], &t, 1, &et);
        bad = fuzz_check_status("dataset_apply_transforms3", st, &et, why, why_cap);
    }
    for (int s = 0; s < 3; s++) dataset_free(&m[s]), dataset_free(&f[s]);
    ssize_t open_ids = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
    if (!bad && open_ids > 0) {
        snprintf(why, why_cap, "h5data: %zd HDF5 objects are still open after the loaders returned", open_ids);
        bad = 1;
    }
    return bad;
}
