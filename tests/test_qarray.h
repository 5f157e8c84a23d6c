/* test_qarray.h - helpers shared by the QArray test files. */
#ifndef QTRAIN_TESTS_TEST_QARRAY_H
#define QTRAIN_TESTS_TEST_QARRAY_H

#include <CUnit/CUnit.h>
#include <stdint.h>

#include "quant/qarray.h"

#define N_BIG 65536 /* 256 x 256 */
extern const int BIG_SHAPE[2];

const QType *qa_find(const char *name);
/* Quantizes and fails the test (printing the message) on any error. */
void qa_quant_ok(QArray *q, const float *x, int ndim, const int *shape, const char *qt, const QArrayOptions *o);
/* Quantizing must fail with `want`, and the message must hold every string
 * of `has` (NULL-terminated); the output is left empty. */
void qa_quant_fails(const float *x, int ndim, const int *shape, const char *qt, const QArrayOptions *o,
                    QtStatus want, const char *const *has);
float *qa_normal_sample(uint64_t seed, size_t n);
float *qa_alloc_floats(size_t n);
/* Every code of q, unpacked with qtype_unpack (not QArray's own reader). */
uint32_t *qa_codes_of(const QArray *q);
double qa_rmse(const float *a, const float *b, size_t n);
float qa_abs_max(const float *x, size_t n);
QArrayOptions qa_channelwise(int axis);
/* One scale per row (axis 0) and per `tile` of axis 1: subchannel blocks. */
QArrayOptions qa_row_blocks(double tile);
/* DESIGN's symmetric int code, written out in the tests. */
int32_t qa_int_code(float x, float scale, int bits);

/* Registers the numerics tests (test_qarray_numerics.c) into the suite. */
int qarray_numerics_tests_add(CU_pSuite s);
/* test_qarray_deq.c: the dequantize kernels, levels and threads. */
int qarray_deq_tests_add(CU_pSuite s);
/* test_qarray_io.c: the storage round trip. */
int qarray_io_tests_add(CU_pSuite s);
/* Copies the first `want` blobs of src into dst's buffers (same layout) and dq.offset. */
void qa_copy_blobs(QArray *dst, const QArray *src, int want);

#endif
