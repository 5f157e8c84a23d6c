/* test_fqt.h - the quant_qt suite's parts in other files. */
#ifndef QTRAIN_TESTS_TEST_QT_H
#define QTRAIN_TESTS_TEST_QT_H

#include <CUnit/CUnit.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/fqt.h"
#include "quant/qarray.h"
#include "test_qat.h"

/* test_qgemm.c: qgemm_s8 against qgemm_s8_ref. */
int qgemm_tests_add(CU_pSuite s);

/* test_fqt.c: the QT layer on x (batch N) and its backward from dy (NULL: the dy qtest_run_qat uses), copied out. */
void fqtest_run_qt(FqtLayer *q, const float *x, int N, const float *dy, QtestRun *r);

/* test_fqt.c: the layer (int8 weights, inputs and stochastic int8 backward, installed) and its fused hook's run
 * (forward with epi, backward from the dy fqtest_run_qt draws), copied out. */
void fqtest_init_int8(FqtLayer *q, Module *mod, uint64_t stream);
void fqtest_run_fused(FqtLayer *q, const float *x, int N, ConvEpilogue epi, QtestRun *r);
/* test_fqt_qwino.c: the integer F(2x2, 3x3) forward on the AVX2 family keeps every bit. */
void fqtest_qwino_same_bits(void);

/* test_fqt_ref.c: a and b agree to 1e-5 of b's largest magnitude (and 1e-5 relative), else a message naming what. */
bool fqtest_close_to(const float *a, const float *b, size_t n, const char *what);
/* The scale of an int slice of the given bits whose max |x| is amax. */
float fqtest_int_slice_scale(float amax, int bits);
/* The forward's operands as QArray round trips: w per output channel, x per tensor (symmetric). */
typedef struct {
    QArray qw, qx;
    float *wq, *xq;
} FqtestOperands;
void fqtest_operands_of(const FqtLayer *q, const float *x, size_t nx, FqtestOperands *op);
void fqtest_operands_free(FqtestOperands *op);
/* The layer's quantized backward (int formats of bwd_bits) and its forward against the hand reference for one x
 * and dy drawn from seed; the noise is what the layer's rng draws from its state before the step. */
void fqtest_check_against_ref(FqtLayer *q, int N, uint64_t seed, int bwd_bits, const char *what);

#endif
