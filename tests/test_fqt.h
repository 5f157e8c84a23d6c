/* test_fqt.h - the quant_qt suite's parts in other files. */
#ifndef QTRAIN_TESTS_TEST_QT_H
#define QTRAIN_TESTS_TEST_QT_H

#include <CUnit/CUnit.h>

/* test_qgemm.c: qgemm_s8 against qgemm_s8_ref. */
int qgemm_tests_add(CU_pSuite s);

#endif
