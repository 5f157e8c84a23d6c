/* fuzz_h5edit.c - the edit-script interpreter of fuzz_h5edit.h. Every HDF5
 * call may fail (an edit that makes no sense for the object picked); a
 * failed edit is simply skipped. */
#include "fuzz_h5edit.h"

#include <hdf5.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_h5edit_internal.h"

#define MAX_OPS 48
#define MAX_NUMEL 65536 /* elements of a rewritten dataset */
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static uint64_t u64(Reader *r) {
    uint64_t v = 0;
    for (int k = 0; k < 8; k++) v = v << 8 | u8(r);
    return v;
}

/* ---- vocabulary ------------------------------------------------------------------- */

static const char *const LINK_NAMES[] = {
    "params", "optim", "quant", "lora",  "rng",   "data",   "train",      "conv1",        "fc1",    "head",
    "weight", "bias",  "qvalue", "scale", "zero_point", "scale_absmax", "A", "B", "m", "v",
    "state",  "input", "grad",  "log2_t", "step_size", "dropout", "x",    "conv1/weight", "fc1/weight", "block/fc",
};

static const char *const ATTR_NAMES[] = {
    "format",  "version", "qtrain_version", "step",    "epoch",      "config",       "optimizer", "seed",
    "stream",  "counter", "cursor",         "n_train", "loss_sum",   "correct",      "seen",      "steps",
    "train_s", "wall_s",  "trained_examples", "last_train_loss", "qtype", "shape", "tile", "granularity",
    "scale_type", "symmetric", "narrow_range", "double_quant", "dq_block", "dq_offset", "calibration",
    "bits_per_weight", "lo_mean", "hi_mean", "count", "zero_point", "rank", "alpha", "rslora", "learn_amax",
    "contents",
};

static const char *const STRINGS[] = {
    "qtrain", "adamw", "sgd", "int8", "int4", "int2", "int3", "int5", "uint4", "uint8", "ternary", "binary", "nf4",
    "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "mxfp8_e4m3", "mxfp6_e3m2", "mxfp4", "mxint8",
    "mx6", "mx9", "per_channel", "per_tensor", "block", "float32", "float16", "bfloat16", "pof2", "absmax",
    "minmax", "percentile,99.9", "mse", "entropy", "3sd", "kl_j", "fixed,1", "fixed,-1,1", "rms,2", "none", "tqt",
    "lsq", "adapters", "", "x", "model:\n  input: [4]\n  layers: [{type: dense, units: 10}]\n",
    "\xff\xfe", "a/b", "0.1.0",
};

static const int64_t INTS[] = {0, 1, -1, 2, 3, 4, 7, 8, 9, 10, 16, 31, 32, 33, 63, 64, 127, 128, 255, 256, 512,
                               65535, 65536, INT32_MAX, INT32_MIN, (int64_t)1 << 31, (int64_t)1 << 32,
                               INT64_MAX, INT64_MIN, -2, 1000000000000LL, (int64_t)1 << 40};

static double special_double(uint8_t k) {
    static const double v[] = {0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e308, -1e308, 5e-324, 3.4e38, 3.5e38, 1e-45,
                               9.3e18, 1e19, -1e-30, 448.0, 57344.0, 1e10};
    switch (k % (N_OF(v) + 3)) {
    case 0: return NAN;
    case 1: return INFINITY;
    case 2: return -INFINITY;
    default: return v[k % (N_OF(v) + 3) - 3];
    }
}

/* ---- the file's links -------------------------------------------------------------- */

static herr_t collect_link(hid_t g, const char *name, const H5L_info_t *info, void *data) {
    (void)g;
    (void)info;
    Links *l = data;
    if (l->n == MAX_LINKS) return 1;
    snprintf(l->names[l->n++], NAME_MAX_LEN, "/%s", name);
    return 0;
}

static void list_links(hid_t f, Links *l) {
    l->n = 1;
    snprintf(l->names[0], NAME_MAX_LEN, "/");
    H5Lvisit(f, H5_INDEX_NAME, H5_ITER_INC, collect_link, l);
}

bool is_kind(hid_t f, const char *path, H5I_type_t want) {
    if (strcmp(path, "/") == 0) return want == H5I_GROUP;
    H5L_info_t li;
    if (H5Lget_info(f, path, &li, H5P_DEFAULT) < 0 || li.type != H5L_TYPE_HARD) return false;
    hid_t o = H5Oopen(f, path, H5P_DEFAULT);
    if (o < 0) return false;
    bool yes = H5Iget_type(o) == want;
    H5Oclose(o);
    return yes;
}

/* group/name into out[NAME_MAX_LEN]; a path too long becomes "" (which every edit refuses). */
static void join(char *out, const char *group, const char *name) {
    if (snprintf(out, NAME_MAX_LEN, "%s%s%s", group, strcmp(group, "/") == 0 ? "" : "/", name) >= NAME_MAX_LEN)
        out[0] = '\0';
}

/* ---- writing attributes ------------------------------------------------------------ */

static void put_attr(hid_t f, const char *obj, const char *name, hid_t type, hid_t space, const void *buf) {
    if (H5Aexists_by_name(f, obj, name, H5P_DEFAULT) > 0) H5Adelete_by_name(f, obj, name, H5P_DEFAULT);
    hid_t a = H5Acreate_by_name(f, obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (a < 0) return;
    if (buf) H5Awrite(a, type, buf);
    H5Aclose(a);
}

static void put_scalar(hid_t f, const char *obj, const char *name, hid_t type, const void *buf) {
    hid_t s = H5Screate(H5S_SCALAR);
    put_attr(f, obj, name, type, s, buf);
    H5Sclose(s);
}

static void put_array(hid_t f, const char *obj, const char *name, hid_t type, int rank, const hsize_t *dims,
                      const void *buf) {
    hid_t s = H5Screate_simple(rank, dims, NULL);
    if (s < 0) return;
    put_attr(f, obj, name, type, s, buf);
    H5Sclose(s);
}

static hid_t string_type(bool vlen, size_t len) {
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, vlen ? H5T_VARIABLE : (len ? len : 1));
    H5Tset_cset(t, H5T_CSET_UTF8);
    return t;
}

static void put_string(hid_t f, const char *obj, const char *name, const char *s, bool vlen) {
    hid_t t = string_type(vlen, strlen(s));
    put_scalar(f, obj, name, t, vlen ? (const void *)&s : (const void *)s);
    H5Tclose(t);
}

/* Raw bytes as a string: a vlen string stops at the first NUL, a fixed one keeps them. */
static void put_raw_string(hid_t f, const char *obj, const char *name, Reader *r, size_t len, bool vlen) {
    char *s = calloc(len + 1, 1);
    if (!s) return;
    for (size_t k = 0; k < len; k++) s[k] = (char)u8(r);
    hid_t t = string_type(vlen, len);
    put_scalar(f, obj, name, t, vlen ? (const void *)&s : (const void *)s);
    H5Tclose(t);
    free(s);
}

/* Numbers: scalars of several widths, small, extreme and special values. */
static void write_attr_number(hid_t f, const char *obj, const char *name, uint8_t kind, Reader *r) {
    switch (kind % 10) {
    case 0: {
        int64_t v = (int8_t)u8(r);
        put_scalar(f, obj, name, H5T_NATIVE_INT64, &v);
        break;
    }
    case 1: {
        int64_t v = INTS[u8(r) % N_OF(INTS)];
        put_scalar(f, obj, name, H5T_NATIVE_INT64, &v);
        break;
    }
    case 2: {
        int64_t v = (int64_t)u64(r);
        put_scalar(f, obj, name, H5T_NATIVE_INT64, &v);
        break;
    }
    case 3: {
        uint64_t v = u64(r);
        put_scalar(f, obj, name, H5T_NATIVE_UINT64, &v);
        break;
    }
    case 4: {
        double v = special_double(u8(r));
        put_scalar(f, obj, name, H5T_NATIVE_DOUBLE, &v);
        break;
    }
    case 5: {
        uint64_t bits = u64(r);
        double v;
        memcpy(&v, &bits, sizeof v);
        put_scalar(f, obj, name, H5T_NATIVE_DOUBLE, &v);
        break;
    }
    case 6: {
        float v = (float)special_double(u8(r));
        put_scalar(f, obj, name, H5T_NATIVE_FLOAT, &v);
        break;
    }
    case 7: {
        uint8_t v = u8(r);
        put_scalar(f, obj, name, H5T_NATIVE_UINT8, &v);
        break;
    }
    case 8: {
        int32_t v = (int32_t)INTS[u8(r) % N_OF(INTS)];
        put_scalar(f, obj, name, H5T_NATIVE_INT32, &v);
        break;
    }
    default: {
        uint64_t v = (uint64_t)INTS[u8(r) % N_OF(INTS)];
        put_scalar(f, obj, name, H5T_NATIVE_UINT64, &v);
        break;
    }
    }
}

/* Strings: of the vocabulary or raw bytes, variable or fixed length, one or two. */
static void write_attr_string(hid_t f, const char *obj, const char *name, uint8_t kind, Reader *r) {
    switch (kind % 6) {
    case 0: put_string(f, obj, name, STRINGS[u8(r) % N_OF(STRINGS)], true); break;
    case 1: put_string(f, obj, name, STRINGS[u8(r) % N_OF(STRINGS)], false); break;
    case 2: put_raw_string(f, obj, name, r, u8(r), true); break;
    case 3: put_raw_string(f, obj, name, r, u8(r), false); break;
    case 4: put_raw_string(f, obj, name, r, u16(r) % 2048, true); break; /* a config text, say */
    default: {
        const char *v[2] = {STRINGS[u8(r) % N_OF(STRINGS)], STRINGS[u8(r) % N_OF(STRINGS)]};
        hsize_t n = 2;
        hid_t t = string_type(true, 0);
        put_array(f, obj, name, t, 1, &n, v);
        H5Tclose(t);
        break;
    }
    }
}

/* Arrays, null and empty dataspaces, and types no attribute of qtrain has. */
static void write_attr_other(hid_t f, const char *obj, const char *name, uint8_t kind, Reader *r) {
    switch (kind % 8) {
    case 0: {
        int64_t v[8];
        hsize_t n = u8(r) % 9;
        for (hsize_t k = 0; k < n; k++) v[k] = INTS[u8(r) % N_OF(INTS)];
        put_array(f, obj, name, H5T_NATIVE_INT64, 1, &n, v);
        break;
    }
    case 1: {
        hid_t s = H5Screate(H5S_NULL);
        put_attr(f, obj, name, u8(r) & 1 ? H5T_NATIVE_DOUBLE : H5T_NATIVE_INT64, s, NULL);
        H5Sclose(s);
        break;
    }
    case 2: {
        double v[2] = {special_double(u8(r)), special_double(u8(r))};
        hsize_t n = 2;
        put_array(f, obj, name, H5T_NATIVE_DOUBLE, 1, &n, v);
        break;
    }
    case 3: {
        struct {
            int64_t a;
            double b;
        } v = {(int8_t)u8(r), 1.0};
        hid_t t = H5Tcreate(H5T_COMPOUND, sizeof v);
        H5Tinsert(t, "a", 0, H5T_NATIVE_INT64);
        H5Tinsert(t, "b", sizeof(int64_t), H5T_NATIVE_DOUBLE);
        put_scalar(f, obj, name, t, &v);
        H5Tclose(t);
        break;
    }
    case 4: {
        int8_t v = (int8_t)(u8(r) & 1), no = 0, yes = 1;
        hid_t t = H5Tenum_create(H5T_NATIVE_INT8);
        H5Tenum_insert(t, "FALSE", &no);
        H5Tenum_insert(t, "TRUE", &yes);
        put_scalar(f, obj, name, t, &v);
        H5Tclose(t);
        break;
    }
    case 5: {
        uint8_t v[4] = {u8(r), u8(r), u8(r), u8(r)};
        hid_t t = H5Tcreate(H5T_OPAQUE, 4);
        H5Tset_tag(t, "bytes");
        put_scalar(f, obj, name, t, v);
        H5Tclose(t);
        break;
    }
    case 6: {
        hsize_t n = 0;
        put_array(f, obj, name, H5T_NATIVE_INT64, 1, &n, NULL);
        break;
    }
    default: {
        int64_t v[4] = {(int8_t)u8(r), (int8_t)u8(r), (int8_t)u8(r), (int8_t)u8(r)};
        hsize_t dims[2] = {2, 2};
        put_array(f, obj, name, H5T_NATIVE_INT64, 2, dims, v);
        break;
    }
    }
}

/* kind: 0-9 numbers, 10-15 strings, 16-23 the rest (modulo 24). */
static void write_attr_value(hid_t f, const char *obj, const char *name, Reader *r) {
    uint8_t kind = u8(r) % 24;
    if (kind < 10) write_attr_number(f, obj, name, kind, r);
    else if (kind < 16) write_attr_string(f, obj, name, kind - 10, r);
    else write_attr_other(f, obj, name, kind - 16, r);
}

/* The name of attribute idx (modulo the count) of obj into out; false if it has none. */
static bool attr_name_at(hid_t f, const char *obj, uint8_t idx, char *out) {
    H5O_info_t oi;
    if (H5Oget_info_by_name(f, obj, &oi, H5P_DEFAULT) < 0 || oi.num_attrs == 0) return false;
    hsize_t k = idx % oi.num_attrs;
    return H5Aget_name_by_idx(f, obj, H5_INDEX_NAME, H5_ITER_INC, k, out, NAME_MAX_LEN, H5P_DEFAULT) > 0;
}

static void op_set_attr(hid_t f, Reader *r, const Links *l) {
    const char *obj = pick(r, l);
    uint8_t sel = u8(r);
    char name[NAME_MAX_LEN];
    if (!(sel < 160 && attr_name_at(f, obj, sel, name)))
        snprintf(name, sizeof name, "%s", ATTR_NAMES[sel % N_OF(ATTR_NAMES)]);
    write_attr_value(f, obj, name, r);
}

static void op_del_attr(hid_t f, Reader *r, const Links *l) {
    const char *obj = pick(r, l);
    char name[NAME_MAX_LEN];
    if (attr_name_at(f, obj, u8(r), name)) H5Adelete_by_name(f, obj, name, H5P_DEFAULT);
}

/* An existing attribute rewritten with its own type in another dataspace. */
static void op_attr_space(hid_t f, Reader *r, const Links *l) {
    const char *obj = pick(r, l);
    char name[NAME_MAX_LEN];
    if (!attr_name_at(f, obj, u8(r), name)) return;
    hid_t a = H5Aopen_by_name(f, obj, name, H5P_DEFAULT, H5P_DEFAULT);
    hid_t t = a >= 0 ? H5Aget_type(a) : H5I_INVALID_HID;
    if (a >= 0) H5Aclose(a);
    if (t < 0) return;
    uint8_t how = u8(r);
    hsize_t dims[2] = {u8(r) % 5, 1 + u8(r) % 3};
    size_t bytes = H5Tget_size(t) * dims[0] * dims[1] + 16;
    void *zero = H5Tis_variable_str(t) > 0 || H5Tdetect_class(t, H5T_VLEN) > 0 ? NULL : calloc(bytes, 1);
    if (how % 3 == 0) {
        hid_t s = H5Screate(H5S_NULL);
        put_attr(f, obj, name, t, s, NULL);
        H5Sclose(s);
    } else if (zero) {
        put_array(f, obj, name, t, how % 3 == 1 ? 1 : 2, dims, zero);
    }
    free(zero);
    H5Tclose(t);
}

/* ---- datasets ---------------------------------------------------------------------- */

void ds_copy_free(DsCopy *c) {
    free(c->buf);
    if (c->type >= 0) H5Tclose(c->type);
    memset(c, 0, sizeof *c);
    c->type = H5I_INVALID_HID;
}

/* Whether d's data is in this file, in chunks of at most 2^20 elements:
 * the editor never reads what op_storage made (a FIFO blocks its reader). */
static bool storage_plain(hid_t d) {
    hid_t dcpl = H5Dget_create_plist(d);
    if (dcpl < 0) return false;
    H5D_layout_t layout = H5Pget_layout(dcpl);
    bool ok = layout == H5D_COMPACT || (layout == H5D_CONTIGUOUS && H5Pget_external_count(dcpl) == 0);
    if (layout == H5D_CHUNKED) {
        hsize_t chunk[H5S_MAX_RANK], n = 1;
        int rank = H5Pget_chunk(dcpl, H5S_MAX_RANK, chunk);
        for (int k = 0; k < rank; k++) n *= chunk[k];
        ok = rank > 0 && n <= ((hsize_t)1 << 20);
    }
    H5Pclose(dcpl);
    return ok;
}

/* The dataset's raw contents (fixed-size types only; small ones). */
bool ds_read(hid_t f, const char *path, DsCopy *c) {
    memset(c, 0, sizeof *c);
    c->type = H5I_INVALID_HID;
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    if (d < 0) return false;
    if (!storage_plain(d)) {
        H5Dclose(d);
        return false;
    }
    hid_t s = H5Dget_space(d);
    c->type = H5Dget_type(d);
    bool ok = s >= 0 && c->type >= 0 && H5Tis_variable_str(c->type) == 0 && H5Tdetect_class(c->type, H5T_VLEN) == 0;
    if (ok) {
        c->rank = H5Sget_simple_extent_ndims(s);
        hssize_t np = H5Sget_simple_extent_npoints(s);
        ok = c->rank >= 0 && np >= 0 && np <= MAX_NUMEL;
        if (ok && c->rank > 0) H5Sget_simple_extent_dims(s, c->dims, NULL);
        c->numel = ok ? (size_t)np : 0;
        c->esize = H5Tget_size(c->type);
    }
    if (ok) {
        c->buf = calloc(c->numel * c->esize + 1, 1);
        ok = c->buf && (c->numel == 0 || H5Dread(d, c->type, H5S_ALL, H5S_ALL, H5P_DEFAULT, c->buf) >= 0);
    }
    if (s >= 0) H5Sclose(s);
    H5Dclose(d);
    if (!ok) ds_copy_free(c);
    return ok;
}

/* Creates dataset path of type t, dataspace s, from buf (NULL: never written, so it reads as fill values). */
static void ds_create(hid_t f, const char *path, hid_t t, hid_t s, const void *buf, bool chunked, int rank,
                      const hsize_t *dims) {
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    bool can_chunk = chunked && rank > 0;
    for (int k = 0; can_chunk && k < rank; k++) can_chunk = dims[k] > 0;
    if (can_chunk) {
        hsize_t chunk[H5S_MAX_RANK];
        for (int k = 0; k < rank; k++) chunk[k] = dims[k] > 4 ? dims[k] / 2 : dims[k];
        H5Pset_chunk(dcpl, rank, chunk);
        H5Pset_deflate(dcpl, 1);
    }
    hid_t d = H5Dcreate2(f, path, t, s, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    if (d >= 0 && buf) H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf);
    if (d >= 0) H5Dclose(d);
    H5Pclose(dcpl);
}

static hid_t pick_type(uint8_t k) {
    static const hid_t *const types[] = {&H5T_IEEE_F32LE_g, &H5T_IEEE_F64LE_g, &H5T_IEEE_F32BE_g, &H5T_STD_U8LE_g,
                                         &H5T_STD_I8LE_g,   &H5T_STD_U16LE_g,  &H5T_STD_I16LE_g,  &H5T_STD_I32LE_g,
                                         &H5T_STD_U32LE_g,  &H5T_STD_I64LE_g,  &H5T_STD_U64LE_g,  &H5T_STD_I32BE_g};
    int n = N_OF(types);
    if (k % (n + 3) < n) return H5Tcopy(*types[k % (n + 3)]);
    if (k % (n + 3) == n) return string_type(false, 4);
    if (k % (n + 3) == n + 1) {
        hid_t t = H5Tcreate(H5T_COMPOUND, 8);
        H5Tinsert(t, "a", 0, H5T_NATIVE_INT32);
        H5Tinsert(t, "b", 4, H5T_NATIVE_FLOAT);
        return t;
    }
    hid_t t = H5Tcreate(H5T_OPAQUE, 2);
    H5Tset_tag(t, "raw");
    return t;
}

/* A dataset of the same name with another type, shape, layout and contents. */
static void op_rewrite_ds(hid_t f, Reader *r, const Links *l) {
    const char *path = pick(r, l);
    DsCopy old;
    if (!is_kind(f, path, H5I_DATASET) || !ds_read(f, path, &old)) return;
    uint8_t tsel = u8(r), shape = u8(r), fill = u8(r), layout = u8(r);
    int rank = old.rank;
    hsize_t dims[H5S_MAX_RANK];
    memcpy(dims, old.dims, sizeof dims);
    bool null_space = false;
    switch (shape % 4) {
    case 0:
        if (rank > 0) {
            int k = u8(r) % rank;
            int64_t d = (int64_t)dims[k] + (int8_t)u8(r);
            dims[k] = d < 0 ? 0 : (hsize_t)d;
        }
        break;
    case 1: {
        int64_t n = (int64_t)old.numel + (int8_t)u8(r);
        rank = 1;
        dims[0] = n < 0 ? 0 : (hsize_t)n;
        break;
    }
    case 2:
        rank = u8(r) % 5;
        for (int k = 0; k < rank; k++) dims[k] = u8(r) % 40;
        break;
    default: null_space = true; break;
    }
    size_t numel = 1;
    for (int k = 0; k < rank; k++) {
        if (dims[k] > 0 && numel > MAX_NUMEL / dims[k]) dims[k] = MAX_NUMEL / numel;
        numel *= dims[k];
    }
    hid_t t = tsel & 0x80 ? H5Tcopy(old.type) : pick_type(tsel);
    size_t esize = H5Tget_size(t);
    uint8_t *buf = calloc(numel * esize + 1, 1);
    uint8_t pat[4] = {u8(r), u8(r), u8(r), u8(r)};
    for (size_t b = 0; buf && b < numel * esize; b++) {
        switch (fill % 4) {
        case 0: break;
        case 1: buf[b] = b < old.numel * old.esize ? ((uint8_t *)old.buf)[b] : 0; break;
        default: buf[b] = pat[b % 4]; break;
        }
    }
    hid_t s = null_space ? H5Screate(H5S_NULL) : rank == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(rank, dims, NULL);
    if (buf && s >= 0 && H5Ldelete(f, path, H5P_DEFAULT) >= 0)
        ds_create(f, path, t, s, fill % 4 == 3 || null_space ? NULL : buf, layout & 1, null_space ? 0 : rank, dims);
    if (s >= 0) H5Sclose(s);
    H5Tclose(t);
    free(buf);
    ds_copy_free(&old);
}

/* The same type and contents, fewer elements (a cut-off tail). */
static void op_truncate_ds(hid_t f, Reader *r, const Links *l) {
    const char *path = pick(r, l);
    DsCopy old;
    if (!is_kind(f, path, H5I_DATASET) || !ds_read(f, path, &old)) return;
    uint16_t cut = u16(r);
    if (old.numel > 0) {
        hsize_t keep = old.numel - 1 - cut % old.numel;
        bool same_rank = old.rank > 1 && (cut & 1) && old.dims[0] > 1;
        hsize_t dims[H5S_MAX_RANK];
        memcpy(dims, old.dims, sizeof dims);
        if (same_rank) dims[0] -= 1 + cut % (old.dims[0] - 1);
        else dims[0] = keep;
        hid_t s = H5Screate_simple(same_rank ? old.rank : 1, dims, NULL);
        if (s >= 0 && H5Ldelete(f, path, H5P_DEFAULT) >= 0)
            ds_create(f, path, old.type, s, old.buf, false, same_rank ? old.rank : 1, dims);
        if (s >= 0) H5Sclose(s);
    }
    ds_copy_free(&old);
}

/* One element changed: a flipped byte, a special float, or an extreme integer. */
static void op_poke_ds(hid_t f, Reader *r, const Links *l) {
    const char *path = pick(r, l);
    DsCopy c;
    if (!is_kind(f, path, H5I_DATASET) || !ds_read(f, path, &c)) return;
    uint16_t at = u16(r);
    uint8_t how = u8(r), v = u8(r);
    if (c.numel > 0 && c.esize > 0) {
        uint8_t *e = (uint8_t *)c.buf + (at % c.numel) * c.esize;
        H5T_class_t cls = H5Tget_class(c.type);
        bool le = H5Tget_order(c.type) != H5T_ORDER_BE;
        if (how % 3 == 0) {
            e[v % c.esize] ^= (uint8_t)(1 + u8(r));
        } else if (how % 3 == 1 && cls == H5T_FLOAT && c.esize == 4 && le) {
            float x = (float)special_double(v);
            memcpy(e, &x, 4);
        } else if (how % 3 == 1 && cls == H5T_FLOAT && c.esize == 8 && le) {
            double x = special_double(v);
            memcpy(e, &x, 8);
        } else {
            memset(e, v & 1 ? 0xff : 0x00, c.esize);
            if (v & 2) e[le ? c.esize - 1 : 0] ^= 0x80;
        }
        hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
        if (d >= 0) {
            H5Dwrite(d, c.type, H5S_ALL, H5S_ALL, H5P_DEFAULT, c.buf);
            H5Dclose(d);
        }
    }
    ds_copy_free(&c);
}

/* ---- links and objects --------------------------------------------------------------- */

static void op_move(hid_t f, Reader *r, const Links *l) {
    const char *src = pick(r, l), *group = pick(r, l);
    char dst[NAME_MAX_LEN];
    join(dst, group, LINK_NAMES[u8(r) % N_OF(LINK_NAMES)]);
    if (strcmp(src, "/") != 0 && is_kind(f, group, H5I_GROUP)) H5Lmove(f, src, f, dst, H5P_DEFAULT, H5P_DEFAULT);
}

static void op_add(hid_t f, Reader *r, const Links *l) {
    const char *group = pick(r, l), *target = pick(r, l);
    char path[NAME_MAX_LEN];
    join(path, group, LINK_NAMES[u8(r) % N_OF(LINK_NAMES)]);
    uint8_t kind = u8(r), n = u8(r);
    switch (kind % 5) {
    case 0: {
        hid_t g = H5Gcreate2(f, path, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        if (g >= 0) H5Gclose(g);
        break;
    }
    case 1: {
        float buf[256];
        for (int k = 0; k < 256; k++) buf[k] = (float)k * 0.25f - 3.0f;
        hsize_t dims[1] = {n};
        hid_t s = H5Screate_simple(1, dims, NULL);
        if (s >= 0) ds_create(f, path, H5T_IEEE_F32LE, s, buf, false, 1, dims);
        if (s >= 0) H5Sclose(s);
        break;
    }
    case 2: H5Lcreate_hard(f, target, f, path, H5P_DEFAULT, H5P_DEFAULT); break;
    case 3: H5Lcreate_soft(n & 1 ? target : "/nowhere", f, path, H5P_DEFAULT, H5P_DEFAULT); break;
    default: {
        const char *file = n & 2 ? fifo_path() : NULL; /* opening the FIFO would block */
        H5Lcreate_external(file ? file : "qtrain-fuzz-missing.h5", n & 4 ? target : "/params", f, path, H5P_DEFAULT,
                           H5P_DEFAULT);
        break;
    }
    }
}

static void op_swap_kind(hid_t f, Reader *r, const Links *l) {
    const char *path = pick(r, l);
    if (strcmp(path, "/") == 0) return;
    bool was_group = is_kind(f, path, H5I_GROUP);
    if (H5Ldelete(f, path, H5P_DEFAULT) < 0) return;
    if (!was_group) {
        hid_t g = H5Gcreate2(f, path, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        if (g >= 0) H5Gclose(g);
        return;
    }
    float v = 1.0f;
    hid_t s = H5Screate(H5S_SCALAR);
    ds_create(f, path, H5T_IEEE_F32LE, s, &v, false, 0, NULL);
    H5Sclose(s);
}

/* The "copy" is a second hard link to the source: HDF5 1.10's H5Ocopy within
 * one file, mixed with deletions, can corrupt its metadata cache so that
 * H5Fclose fails and leaves the file open for good. The loaders see the
 * same thing either way: the source's contents under the other name. */
static void op_copy(hid_t f, Reader *r, const Links *l) {
    const char *src = pick(r, l), *dst = pick(r, l);
    if (strcmp(src, "/") == 0 || strcmp(dst, "/") == 0 || strcmp(src, dst) == 0) return;
    if (strncmp(dst, src, strlen(src)) == 0 && dst[strlen(src)] == '/') return; /* into itself */
    if (H5Ldelete(f, dst, H5P_DEFAULT) >= 0) H5Lcreate_hard(f, src, f, dst, H5P_DEFAULT, H5P_DEFAULT);
}

/* ---- values a loader must refuse -------------------------------------------------------- */

/* Float elements negated: one, or all (an AdamW second moment v below zero,
 * a negative scale, range or step size). */
static void op_negate(hid_t f, Reader *r, const Links *l) {
    const char *path = pick(r, l);
    DsCopy c;
    if (!is_kind(f, path, H5I_DATASET) || !ds_read(f, path, &c)) return;
    uint16_t at = u16(r);
    bool all = at & 1;
    if (c.numel > 0 && H5Tget_class(c.type) == H5T_FLOAT && H5Tget_order(c.type) != H5T_ORDER_BE &&
        (c.esize == 4 || c.esize == 8)) {
        for (size_t k = all ? 0 : at % c.numel; k < (all ? c.numel : at % c.numel + 1); k++) {
            uint8_t *e = (uint8_t *)c.buf + k * c.esize;
            e[c.esize - 1] ^= 0x80; /* the sign bit; a zero becomes -0 */
            if (!all && c.esize == 4) { /* a zero: a small negative number instead */
                float x;
                memcpy(&x, e, 4);
                if (x == 0.0f) x = -1e-3f;
                memcpy(e, &x, 4);
            }
        }
        hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
        if (d >= 0) {
            H5Dwrite(d, c.type, H5S_ALL, H5S_ALL, H5P_DEFAULT, c.buf);
            H5Dclose(d);
        }
    }
    ds_copy_free(&c);
}

/* ---- the script ------------------------------------------------------------------------ */

static void apply(hid_t f, Reader *r) {
    Links *l = malloc(sizeof *l);
    if (!l) return;
    for (int k = 0; k < MAX_OPS && r->i < r->n; k++) {
        list_links(f, l);
        uint8_t op = u8(r);
        if (op >= FUZZ_H5EDIT_STORAGE_OP) { /* opcodes added later: the older ones keep their meaning */
            if (op < FUZZ_H5EDIT_NEGATE_OP) op_storage(f, r, l);
            else op_negate(f, r, l);
            continue;
        }
        switch (op % FUZZ_H5EDIT_OPS) {
        case 0: {
            const char *path = pick(r, l);
            if (strcmp(path, "/") != 0) H5Ldelete(f, path, H5P_DEFAULT);
            break;
        }
        case 1: op_move(f, r, l); break;
        case 2: op_del_attr(f, r, l); break;
        case 3: op_set_attr(f, r, l); break;
        case 4: op_rewrite_ds(f, r, l); break;
        case 5: op_truncate_ds(f, r, l); break;
        case 6: op_poke_ds(f, r, l); break;
        case 7: op_add(f, r, l); break;
        case 8: op_swap_kind(f, r, l); break;
        case 9: op_copy(f, r, l); break;
        default: op_attr_space(f, r, l); break;
        }
    }
    free(l);
}

int fuzz_h5_edit(const void *base, size_t base_size, const uint8_t *script, size_t size, void **out,
                 size_t *out_size) {
    *out = NULL;
    *out_size = 0;
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl < 0) return 1;
    if (H5Pset_fapl_core(fapl, (size_t)1 << 16, 0) < 0 || H5Pset_file_image(fapl, (void *)base, base_size) < 0) {
        H5Pclose(fapl);
        return 1;
    }
    hid_t f = H5Fopen("qtrain-fuzz-edit.h5", H5F_ACC_RDWR, fapl);
    H5Pclose(fapl);
    if (f < 0) return 1;
    Reader r = {script, size, 0};
    apply(f, &r);
    int rc = 1;
    ssize_t n = H5Fflush(f, H5F_SCOPE_GLOBAL) >= 0 ? H5Fget_file_image(f, NULL, 0) : -1;
    if (n > 0 && (*out = malloc((size_t)n)) != NULL) {
        if (H5Fget_file_image(f, *out, (size_t)n) == n) {
            *out_size = (size_t)n;
            rc = 0;
        } else {
            free(*out);
            *out = NULL;
        }
    }
    if (H5Fclose(f) < 0) rc = 1;
    return rc;
}
