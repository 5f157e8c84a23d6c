/* test_qarray_io.c - a QArray's storage as named arrays (qarray_io.h): what a
 * checkpoint writes restores the array bit for bit. Part of the quant_qarray
 * suite. */
#include <CUnit/CUnit.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "quant/qarray_io.h"
#include "test_qarray.h"
#include "test_util.h"

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

/* A layer allocated empty and filled from another's blobs computes the same, bit for bit. */

int qarray_io_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "QArray blobs restore bit for bit", test_qarray_io);
}
