/* test_qarray_io.c - a QArray's storage as named arrays (qarray_io.h): what a
 * checkpoint writes restores the array bit for bit, and a stored value no
 * quantization writes (a NaN or negative scale, a zero point out of range)
 * is refused, in memory and when a checkpoint holding it is loaded, with
 * static input ranges and learned QAT ranges alike. Part of the
 * quant_qarray suite. */
#include <CUnit/CUnit.h>
#include <hdf5.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "quant/qarray_io.h"
#include "test_qarray.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/net.h"

/* ---- QArray storage I/O ------------------------------------------------------------------------------------- */

#define CW0 .n_channelwise = 1, .channelwise_axes = {0}

typedef struct {
    const char *name, *qt;
    QArrayOptions o;
    int n_blobs;
} IoCase;

static const IoCase IO_CASES[] = {
    {"int8 per channel", "int8", {CW0}, 2},
    {"uint8 asymmetric, int32 zero points", "uint8", {CW0}, 3},
    {"int8 asymmetric, float zero points", "int8",
     {CW0, .range = QARRAY_RANGE_ASYMMETRIC, .zp_type = QARRAY_ZP_FLOAT}, 3},
    {"int4 blocks of 32", "int4", {CW0, .n_tiled = 1, .tiled_axes = {{1, 32}}}, 2},
    {"nf4 blocks of 64 + dq", "nf4", {.double_quant = true}, 3},
    {"nf4 blocks of 64 + dq in blocks of 16", "nf4", {.double_quant = true, .dq_block = 16}, 3},
    {"fp8_e4m3, float16 scales", "fp8_e4m3", {CW0, .scale_type = QARRAY_SCALE_F16}, 2},
    {"int4, bfloat16 scales", "int4", {CW0, .scale_type = QARRAY_SCALE_BF16}, 2},
    {"int8, pof2 scales", "int8", {CW0, .scale_type = QARRAY_SCALE_POF2}, 2},
    {"mxfp4", "mxfp4", {0}, 1},
    {"mx9", "mx9", {0}, 1},
};

static size_t blob_elem_bytes(QArrayBlobType t) {
    return t == QARRAY_BLOB_U8 ? 1 : t == QARRAY_BLOB_U16 ? 2 : 4;
}

static bool all_zero(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return false;
    return true;
}

/* Copies every blob of src into dst's (same layout) and the scalars the caller keeps. */
void qa_copy_blobs(QArray *dst, const QArray *src, int want) {
    QArrayBlob a[QARRAY_MAX_BLOBS], b[QARRAY_MAX_BLOBS];
    int na = qarray_blobs(src, a), nb = qarray_blobs(dst, b);
    CU_ASSERT_EQUAL(na, want);
    CU_ASSERT_EQUAL_FATAL(na, nb);
    for (int i = 0; i < na; i++) {
        CU_ASSERT_STRING_EQUAL(a[i].name, b[i].name);
        CU_ASSERT(a[i].type == b[i].type && a[i].count == b[i].count);
        CU_ASSERT_FATAL(a[i].data && b[i].data && a[i].data != b[i].data);
        size_t bytes = a[i].count * blob_elem_bytes(a[i].type);
        CU_ASSERT(all_zero(b[i].data, bytes));
        memcpy(b[i].data, a[i].data, bytes);
    }
    dst->dq.offset = src->dq.offset;
}

static void test_qarray_io(void) {
    const int shape[2] = {24, 128};
    const size_t n = 24 * 128;
    float *x = qa_normal_sample(91, n), *ya = qa_alloc_floats(n), *yb = qa_alloc_floats(n);
    for (size_t i = 0; i < n; i++) x[i] *= 1.0f + (float)(i % 97) / 16.0f;
    for (size_t c = 0; c < sizeof IO_CASES / sizeof IO_CASES[0]; c++) {
        const IoCase *ic = &IO_CASES[c];
        QArray q, r;
        QtError err = {0};
        qa_quant_ok(&q, x, 2, shape, ic->qt, &ic->o);
        QtStatus st = qarray_alloc(&r, 2, shape, qa_find(ic->qt), &ic->o, &err);
        if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", ic->name, err.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        CU_ASSERT(r.qtype == q.qtype && r.ndim == q.ndim && r.numel == q.numel && r.n_scales == q.n_scales);
        CU_ASSERT(memcmp(r.shape, q.shape, sizeof q.shape) == 0 && memcmp(r.tile, q.tile, sizeof q.tile) == 0);
        CU_ASSERT(memcmp(r.scale_shape, q.scale_shape, sizeof q.scale_shape) == 0);
        CU_ASSERT(r.code_bytes == q.code_bytes && r.scale_type == q.scale_type && r.asymmetric == q.asymmetric);
        CU_ASSERT(r.zp_type == q.zp_type && r.double_quant == q.double_quant && r.narrow_range == q.narrow_range);
        CU_ASSERT(r.dq.block == q.dq.block && r.dq.n_blocks == q.dq.n_blocks && r.round == q.round);
        if (ic->o.dq_block) CU_ASSERT(r.dq.n_blocks > 1);
        qa_copy_blobs(&r, &q, ic->n_blobs);
        qarray_dequantize(&q, ya);
        qarray_dequantize(&r, yb);
        if (memcmp(ya, yb, n * sizeof *ya) != 0) fprintf(stderr, "\n  %s: restored values differ\n", ic->name);
        CU_ASSERT(memcmp(ya, yb, n * sizeof *ya) == 0);
        CU_ASSERT_EQUAL(qarray_bytes(&r), qarray_bytes(&q));
        qarray_free(&q);
        qarray_free(&r);
    }
    /* what qarray_quantize would refuse, qarray_alloc refuses alike, leaving the QArray empty */
    QArray r;
    QtError err = {0};
    QArrayOptions bad = {CW0, .n_tiled = 1, .tiled_axes = {{1, 48}}};
    CU_ASSERT_EQUAL(qarray_alloc(&r, 2, shape, qa_find("int4"), &bad, &err), QT_ERR_SHAPE);
    CU_ASSERT(r.codes == NULL && r.qtype == NULL);
    free(x), free(ya), free(yb);
}

/* ---- checking stored values ----------------------------------------------------------------------------------- */

/* (8, 64) normal values with the slices quantize treats specially: row 2 all zero (scale 1), row 5 an outlier
 * (double quantization then rebuilds small rows' scales coarsely, down to 0 or below), row 6 tiny. */
static float *stored_sample(void) {
    float *x = qa_normal_sample(17, 8 * 64);
    for (int j = 0; j < 64; j++) x[2 * 64 + j] = 0.0f, x[5 * 64 + j] *= 3e4f, x[6 * 64 + j] *= 1e-6f;
    return x;
}

static const IoCase STORED_OK[] = {
    {"int8 per channel", "int8", {CW0}, 0},
    {"int8 narrow, asymmetric", "int8", {CW0, .range = QARRAY_RANGE_ASYMMETRIC, .narrow_range = true}, 0},
    {"int4 asymmetric, float zero points, float16 scales", "int4",
     {CW0, .range = QARRAY_RANGE_ASYMMETRIC, .zp_type = QARRAY_ZP_FLOAT, .scale_type = QARRAY_SCALE_F16}, 0},
    {"uint8 asymmetric", "uint8", {CW0}, 0},
    {"uint4 symmetric", "uint4", {CW0, .range = QARRAY_RANGE_SYMMETRIC}, 0},
    {"ternary", "ternary", {CW0}, 0},
    {"fp8_e4m3, bfloat16 scales", "fp8_e4m3", {CW0, .scale_type = QARRAY_SCALE_BF16}, 0},
    {"fp8_e5m2, pof2 scales", "fp8_e5m2", {CW0, .scale_type = QARRAY_SCALE_POF2}, 0},
    {"nf4 + dq in blocks of 4", "nf4", {.double_quant = true, .dq_block = 4}, 0},
    {"int8 per channel + dq", "int8", {CW0, .double_quant = true}, 0},
    {"mxfp8_e4m3", "mxfp8_e4m3", {0}, 0},
    {"mx6", "mx6", {0}, 0},
};

/* What quantize stores always passes, an all-zero row and double quantization's rebuilt scales of 0 or below
 * included. */
static void test_stored_ok(void) {
    const int shape[2] = {8, 64};
    float *x = stored_sample();
    bool dq_nonpositive = false;
    for (size_t c = 0; c < sizeof STORED_OK / sizeof STORED_OK[0]; c++) {
        QArray q;
        QtError err = {0};
        qa_quant_ok(&q, x, 2, shape, STORED_OK[c].qt, &STORED_OK[c].o);
        QtStatus st = qarray_check_stored(&q, &err);
        if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", STORED_OK[c].name, err.msg);
        CU_ASSERT_EQUAL(st, QT_OK);
        for (size_t i = 0; q.double_quant && i < q.n_scales; i++) dq_nonpositive |= !(qarray_scale_at(&q, i) > 0);
        qarray_free(&q);
    }
    CU_ASSERT(dq_nonpositive); /* the data does reach that case */
    CU_ASSERT_EQUAL(qarray_check_stored(NULL, NULL), QT_ERR_ARG);
    free(x);
}

typedef struct {
    const char *qt;
    QArrayOptions o;
    const char *blob; /* the blob to change */
    size_t index;
    double v;         /* written in the blob's type: a float, an int32, or u16 / u8 bits */
    const char *want; /* the message starts with this */
} BadStored;

#define ASYM .range = QARRAY_RANGE_ASYMMETRIC
#define BF16 .scale_type = QARRAY_SCALE_BF16

static const BadStored BAD_STORED[] = {
    {"int8", {CW0}, "scale", 3, NAN, "scale[3] = nan; a float32 scale must be finite and > 0"},
    {"int8", {CW0}, "scale", 7, INFINITY, "scale[7] = inf"},
    {"int8", {CW0}, "scale", 0, -0.25, "scale[0] = -0.25"},
    {"int8", {CW0}, "scale", 2, 0.0, "scale[2] = 0;"},
    {"int4", {CW0, BF16}, "scale", 4, 0x7fc0, "scale[4] = 0x7fc0, the bfloat16 bits of nan"},
    {"int4", {CW0, BF16}, "scale", 1, 0xbf80, "scale[1] = 0xbf80, the bfloat16 bits of -1"},
    {"fp8_e4m3", {CW0, .scale_type = QARRAY_SCALE_F16}, "scale", 6, 0xfc00,
     "scale[6] = 0xfc00, the float16 bits of -inf"},
    {"int8", {CW0, .scale_type = QARRAY_SCALE_POF2}, "scale", 5, 255, "scale[5] = 255, an e8m0 code (255 is NaN"},
    {"nf4", {.double_quant = true, .dq_block = 4}, "scale_absmax", 1, NAN, "scale_absmax[1] = nan"},
    {"nf4", {.double_quant = true, .dq_block = 4}, "scale_absmax", 0, 0.0, "scale_absmax[0] = 0"},
    {"uint8", {CW0}, "zero_point", 3, 256, "zero_point[3] = 256 is outside uint8's code range [0, 255]"},
    {"int4", {CW0, ASYM, .narrow_range = true}, "zero_point", 1, -8,
     "zero_point[1] = -8 is outside int4's code range [-7, 7]"},
    {"int8", {CW0, ASYM, .zp_type = QARRAY_ZP_FLOAT}, "zero_point", 2, NAN,
     "zero_point[2] = nan is not finite, so not within int8's"},
    {"mxfp4", {0}, "qvalue", 17 * 3, 255, "qvalue[51] = 255, the shared e8m0 scale of mxfp4 block 3"},
    {"mx9", {0}, "qvalue", 18 * 1, 255, "qvalue[18] = 255, the shared e8m0 scale of mx9 block 1"},
    {"fp8_e4m3", {CW0}, "qvalue", 9, 0x7f, "qvalue[9] = 0x7f is a NaN code of fp8_e4m3"},
    {"fp8_e5m2", {CW0}, "qvalue", 9, 0xfd, "qvalue[9] = 0xfd is a NaN code of fp8_e5m2"},
    {"mxfp8_e4m3", {0}, "qvalue", 33 + 4, 0xff, "qvalue[37] = 0xff is a NaN code of fp8_e4m3"},
};

/* Sets element i of blob `name` of q to v in the blob's type. */
static void poke_blob(QArray *q, const char *name, size_t i, double v) {
    QArrayBlob b[QARRAY_MAX_BLOBS];
    int n = qarray_blobs(q, b), k = 0;
    while (k < n && strcmp(b[k].name, name) != 0) k++;
    CU_ASSERT_FATAL(k < n && i < b[k].count);
    switch (b[k].type) {
    case QARRAY_BLOB_U8: ((uint8_t *)b[k].data)[i] = (uint8_t)v; break;
    case QARRAY_BLOB_U16: ((uint16_t *)b[k].data)[i] = (uint16_t)v; break;
    case QARRAY_BLOB_I32: ((int32_t *)b[k].data)[i] = (int32_t)v; break;
    case QARRAY_BLOB_F32: ((float *)b[k].data)[i] = (float)v; break;
    }
}

/* One value no quantization stores, in each storage form, is refused naming its blob and index. */
static void test_stored_bad(void) {
    const int shape[2] = {8, 64};
    float *x = stored_sample();
    for (size_t c = 0; c < sizeof BAD_STORED / sizeof BAD_STORED[0]; c++) {
        const BadStored *b = &BAD_STORED[c];
        QArray q;
        QtError err = {0};
        qa_quant_ok(&q, x, 2, shape, b->qt, &b->o);
        CU_ASSERT_EQUAL(qarray_check_stored(&q, &err), QT_OK);
        poke_blob(&q, b->blob, b->index, b->v);
        CU_ASSERT_EQUAL(qarray_check_stored(&q, &err), QT_ERR_FORMAT);
        bool starts = strncmp(err.msg, b->want, strlen(b->want)) == 0;
        if (!starts)
            fprintf(stderr, "\n  %s %s[%zu]: '%s', want '%s...'\n", b->qt, b->blob, b->index, err.msg, b->want);
        CU_ASSERT(starts);
        qarray_free(&q);
    }
    /* a non-finite offset shows in the rebuilt scales */
    QArray q;
    QtError err = {0};
    qa_quant_ok(&q, x, 2, shape, "nf4", &(QArrayOptions){.double_quant = true});
    q.dq.offset = NAN;
    CU_ASSERT_EQUAL(qarray_check_stored(&q, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "scale[0] = ") && test_msg_has(&err, "dq_offset nan gives the scale nan"));
    qarray_free(&q);
    free(x);
}

/* ---- checkpoints holding such values -------------------------------------------------------------------------- */

/* tiny-qlora.yaml's and tiny-qat.yaml's model in layouts that store every form a loader reads. */
typedef struct {
    const char *config;
    const char *set[3];
} CkptLayout;

static const CkptLayout CKPT_LAYOUTS[] = {
    /* 0: PTQ, int32 zero points, double quantization, bfloat16 scales, static input ranges (one asymmetric) */
    {"tests/configs/tiny-qlora.yaml",
     {"quant.rules=[{module_path: conv1, weight_qtype: int4, symmetric: false, act_qtype: int8, "
      "act_symmetric: false}, {module_path: fc1, weight_qtype: nf4, tile_size: 64, double_quant: true}, "
      "{module_path: head, weight_qtype: int8, scale_type: bfloat16, act_qtype: int8}]",
      "lora.rules=[]", "lora.trainable=[]"}},
    /* 1: PTQ, pof2 scales, MX blocks, fp8 codes with float32 scales */
    {"tests/configs/tiny-qlora.yaml",
     {"quant.rules=[{module_path: conv1, weight_qtype: int8, scale_type: pof2}, {module_path: fc1, weight_qtype: "
      "mxfp4}, {module_path: head, weight_qtype: fp8_e4m3, act_qtype: int8}]",
      "lora.rules=[]", "lora.trainable=[]"}},
    /* 2: QAT, tqt learned ranges (log2_t) */
    {"tests/configs/tiny-qat.yaml", {NULL}},
    /* 3: QAT, lsq learned ranges (step_size) */
    {"tests/configs/tiny-qat.yaml", {"quant.rules.1.learn_amax=lsq", "quant.rules.1.scale_type=float32"}},
};
#define N_CKPT_LAYOUTS ((int)(sizeof CKPT_LAYOUTS / sizeof CKPT_LAYOUTS[0]))

static Config *ckpt_layout_config(int k) {
    const CkptLayout *l = &CKPT_LAYOUTS[k];
    int n = 0;
    while (n < 3 && l->set[n]) n++;
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtStatus st = config_load(c, l->config, l->set, n, &err);
    if (st != QT_OK) fprintf(stderr, "\n  layout %d: %s\n", k, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    return c;
}

/* A checkpoint of layout k at path, as a run writes it: a PTQ base quantized from the seed's parameters with its
 * static input ranges calibrated, or a fresh QAT model. */
static void ckpt_layout_save(int k, const char *path) {
    Config *c = ckpt_layout_config(k);
    Net n;
    QtError err = {0};
    bool ptq = c->quant.mode == QUANT_MODE_PTQ;
    QtStatus st = net_build(&n, c, ptq ? NET_FRESH_TIMING : NET_FRESH, &err);
    for (int i = 0; st == QT_OK && i < net_hook_count(&n, &HOOK_PTQ); i++) {
        QLayer *q = net_qlayer(&n, i);
        if (!q->spec.act_qtype) continue;
        calib_running_init(&q->act_stats, &q->spec.act_calib);
        q->act_stats.count = 3, q->act_stats.lo_mean = -1.5, q->act_stats.hi_mean = 2.5;
        st = qlayer_act_from_stats(q, &err);
    }
    CheckpointState cs = {.last_train_loss = NAN, .net = net_checkpoint_parts(&n)};
    if (st == QT_OK) st = checkpoint_save(path, &n.model, NULL, &cs, &err);
    if (st != QT_OK) fprintf(stderr, "\n  layout %d: %s\n", k, err.msg);
    CU_ASSERT_EQUAL(st, QT_OK);
    if (n.cfg) net_free(&n);
    free(c);
}

/* checkpoint_load_model of path into a shell of layout k. */
static QtStatus ckpt_layout_load(int k, const char *path, QtError *err) {
    Config *c = ckpt_layout_config(k);
    Net n;
    QtStatus st = net_build(&n, c, NET_SHELL, err);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CheckpointNet parts = net_checkpoint_parts(&n);
    st = checkpoint_load_model(path, &n.model, &parts, err);
    net_free(&n);
    free(c);
    return st;
}

/* Element i of dataset ds, or attribute attr of object ds, set to v through the HDF5 API (converted to the
 * stored type: a float, or the integer holding a code or the bits of a float16/bfloat16). */
static void h5_poke(const char *path, const char *ds, const char *attr, size_t i, double v) {
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    CU_ASSERT_FATAL(f >= 0);
    if (attr) { /* rewritten in place, HDF5 1.10 cannot find the attribute again: a new one as the file had */
        hid_t sp = H5Screate(H5S_SCALAR);
        CU_ASSERT(H5Adelete_by_name(f, ds, attr, H5P_DEFAULT) >= 0);
        hid_t a = H5Acreate_by_name(f, ds, attr, H5T_IEEE_F64LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        CU_ASSERT(a >= 0 && H5Awrite(a, H5T_NATIVE_DOUBLE, &v) >= 0);
        if (a >= 0) H5Aclose(a);
        H5Sclose(sp);
    } else {
        hid_t d = H5Dopen2(f, ds, H5P_DEFAULT), sp = d >= 0 ? H5Dget_space(d) : H5I_INVALID_HID;
        hssize_t n = sp >= 0 ? H5Sget_simple_extent_npoints(sp) : 0;
        double *buf = n > 0 ? malloc((size_t)n * sizeof *buf) : NULL;
        CU_ASSERT_FATAL(buf && i < (size_t)n);
        CU_ASSERT(H5Dread(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
        buf[i] = v;
        CU_ASSERT(H5Dwrite(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
        free(buf);
        H5Sclose(sp);
        H5Dclose(d);
    }
    H5Fclose(f);
}

typedef struct {
    int layout;
    const char *obj;  /* a dataset, or with attr the object holding it */
    const char *attr; /* NULL: element `index` of dataset obj */
    size_t index;
    double v;
    const char *want; /* the message holds "<file>: <want>" */
} BadCkpt;

static const BadCkpt BAD_CKPTS[] = {
    {1, "quant/head/weight/scale", NULL, 3, NAN, "/quant/head/weight/scale[3] = nan; a float32 scale must be"},
    {1, "quant/head/weight/scale", NULL, 9, INFINITY, "/quant/head/weight/scale[9] = inf"},
    {1, "quant/head/weight/scale", NULL, 0, -0.5, "/quant/head/weight/scale[0] = -0.5"},
    {0, "quant/head/weight/scale", NULL, 2, 0x7fc0, "/quant/head/weight/scale[2] = 0x7fc0, the bfloat16 bits of nan"},
    {1, "quant/conv1/weight/scale", NULL, 5, 255, "/quant/conv1/weight/scale[5] = 255, an e8m0 code (255 is NaN"},
    {1, "quant/fc1/weight/qvalue", NULL, 17 * 2, 255, "/quant/fc1/weight/qvalue[34] = 255, the shared e8m0 scale"},
    {1, "quant/head/weight/qvalue", NULL, 7, 0x7f, "/quant/head/weight/qvalue[7] = 0x7f is a NaN code of fp8_e4m3"},
    {0, "quant/fc1/weight/scale_absmax", NULL, 0, NAN, "/quant/fc1/weight/scale_absmax[0] = nan"},
    {0, "quant/fc1/weight", "dq_offset", 0, INFINITY, "/quant/fc1/weight has dq_offset inf"},
    {0, "quant/conv1/weight/zero_point", NULL, 4, 8, "/quant/conv1/weight/zero_point[4] = 8 is outside int4's code "
                                                     "range [-8, 7]"},
    {0, "quant/conv1/input", "scale", 0, 0.0, "/quant/conv1/input has scale 0 (the static input range of module "
                                              "conv1); a static activation scale must be finite and > 0"},
    {0, "quant/head/input", "scale", 0, NAN, "/quant/head/input has scale nan"},
    {0, "quant/conv1/input", "zero_point", 0, 128, "/quant/conv1/input has zero_point 128"},
    {0, "quant/conv1/input", "zero_point", 0, 2.5, "/quant/conv1/input has zero_point 2.5"},
    {0, "quant/head/input", "hi_mean", 0, NAN, "/quant/head/input: running calibration statistics: lo_mean = -1.5, "
                                               "hi_mean = nan"},
    {2, "quant/fc1/weight/state/log2_t", NULL, 3, NAN, "/quant/fc1/weight/state/log2_t[3] = nan; a learned log2 "
                                                        "threshold must be finite"},
    {2, "quant/conv1/input/state/log2_t", NULL, 0, 200, "/quant/conv1/input/state/log2_t[0] = 200"},
    {3, "quant/fc1/weight/state/step_size", NULL, 2, 0.0, "/quant/fc1/weight/state/step_size[2] = 0; a learned "
                                                           "step size must be"},
    {3, "quant/conv1/weight/state/step_size", NULL, 1, -0.01, "/quant/conv1/weight/state/step_size[1] = -0.01"},
    {3, "quant/fc1/input/state/step_size", NULL, 0, NAN, "/quant/fc1/input/state/step_size[0] = nan"},
};

/* Each damaged value of a checkpoint is refused as damage, naming the file, the dataset, the element and the
 * value; the file as written loads, and so does a tqt log2_t of 0 (threshold 1, a fresh range's value). */
static void test_ckpt_bad_values(void) {
    char *dir = test_tmpdir_new();
    char clean[N_CKPT_LAYOUTS][600], path[640];
    QtError err = {0};
    for (int k = 0; k < N_CKPT_LAYOUTS; k++) {
        snprintf(clean[k], sizeof clean[k], "%s/layout%d.h5", dir, k);
        ckpt_layout_save(k, clean[k]);
        QtStatus st = ckpt_layout_load(k, clean[k], &err);
        if (st != QT_OK) fprintf(stderr, "\n  layout %d: %s\n", k, err.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    }
    snprintf(path, sizeof path, "%s/damaged.h5", dir);
    for (size_t c = 0; c < sizeof BAD_CKPTS / sizeof BAD_CKPTS[0]; c++) {
        const BadCkpt *b = &BAD_CKPTS[c];
        size_t n = 0;
        char *bytes = test_file_read(clean[b->layout], &n), want[900];
        CU_ASSERT_PTR_NOT_NULL_FATAL(bytes);
        test_file_write(path, bytes, n);
        free(bytes);
        h5_poke(path, b->obj, b->attr, b->index, b->v);
        QtError e = {0};
        CU_ASSERT_EQUAL(ckpt_layout_load(b->layout, path, &e), QT_ERR_FORMAT);
        snprintf(want, sizeof want, "%s: %s", path, b->want);
        CU_ASSERT(test_msg_has(&e, want));
        CU_ASSERT(test_msg_has(&e, "resume from an earlier checkpoint"));
        test_assert_hdf5_closed();
    }
    h5_poke(clean[2], "quant/fc1/weight/state/log2_t", NULL, 3, 0.0);
    CU_ASSERT_EQUAL(ckpt_layout_load(2, clean[2], &err), QT_OK);
    CU_ASSERT(test_tmpdir_remove(dir));
}

int qarray_io_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "QArray blobs restore bit for bit", test_qarray_io) ||
           !CU_add_test(s, "stored values: what quantize writes passes", test_stored_ok) ||
           !CU_add_test(s, "stored values: bad scales, zero points, codes refused", test_stored_bad) ||
           !CU_add_test(s, "stored values: a damaged checkpoint is refused", test_ckpt_bad_values);
}
