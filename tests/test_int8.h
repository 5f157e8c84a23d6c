/* test_int8.h - the quant_int8 suite's two files. */
#ifndef QTRAIN_TESTS_TEST_INT8_H
#define QTRAIN_TESTS_TEST_INT8_H

#include <CUnit/CUnit.h>

/* test_qlayer_int8.c: the quantized layer's int8 path. */
int qlayer_int8_tests_add(CU_pSuite s);

#endif
