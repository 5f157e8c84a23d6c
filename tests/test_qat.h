/* test_qat.h - helpers the QAT suite's two files share (test_qat.c). */
#ifndef QTRAIN_TESTS_TEST_QAT_H
#define QTRAIN_TESTS_TEST_QAT_H

#include <CUnit/CUnit.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nn/model.h"
#include "quant/qarray.h"
#include "quant/qat.h"

/* One pass: y and every gradient, copied out. */
typedef struct {
    float *y, *dx, *dw, *db, *dlw, *dla;
    size_t ny, nx, nw, nb, nlw;
} QtestRun;

typedef struct {
    const float *w;    /* [numel] in the layer's QArray view w_shape */
    const FqRange *wr; /* or NULL */
    const float *x;    /* [N * in] */
    const FqRange *ar; /* or NULL */
} QtestRef;

/* Models, specs and layers for the tests; one forward (and backward) of a
 * QAT layer, and the float reference it is checked against (test_qat.c). */
void qtest_one_layer_model(Model *m, int ndim, const int *in_shape, const LayerSpec *l, uint64_t seed);
void qtest_dense_model(Model *m, int in, int out, uint64_t seed);
void qtest_conv_model(Model *m, int C, int H, int W, int OC, int k, int stride, int pad, uint64_t seed);
QLayerSpec qtest_wspec(const char *qt, int tile, QArrayScaleType scale_type);
QatSpec qtest_qspec(QatLearn learn, bool act_static);
void qtest_init_ok(QatLayer *q, Module *mod, const QLayerSpec *spec, const QatSpec *qs);
size_t qtest_input_numel(const Module *mod, int N);
int qtest_input_shape(const Module *mod, int N, int xs[4]);
float *qtest_copy_floats(const float *src, size_t n);
void qtest_zero(float *g, size_t n);
void qtest_zero_grads(QatLayer *q);
void qtest_run_free(QtestRun *r);
/* A whole model on x (N examples), training or eval; y copied into out[n_out] when out is given; with R, the
 * backward of sum(y * R) into the parameters' grads (zeroed first) and x's into dx. */
void qtest_run_model(Model *m, const float *x, int N, bool training, const float *R, float *out, size_t n_out,
                     float *dx);
const float *qtest_range_values(const FqRange *r);
void qtest_run_qat(QatLayer *q, const float *x, int N, bool training, bool backward, QtestRun *r);
void qtest_run_ref(const QatLayer *q, const QtestRef *ref, int N, QtestRun *r);
float *qtest_qarray_round_trip(const float *x, int ndim, const int *shape, const QType *t, const QArrayOptions *o,
                                QArray *qa);
void qtest_apply_mask(float *g, const float *x, size_t n, const QArray *qa);

/* Learned ranges ready: weights from the layer's weight, input over one calibration pass on x. */
void qtest_ranges_ok(QatLayer *q, const float *x, int N);

/* test_qat_convert.c: conversion to a QLayer, the input ops, the arena's steady state. */
int qat_convert_tests_add(CU_pSuite s);

#endif
