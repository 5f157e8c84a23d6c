/* test_int8.h - the quant_int8 suite's two files, and what the int8 kernel tests share. */
#ifndef QTRAIN_TESTS_TEST_INT8_H
#define QTRAIN_TESTS_TEST_INT8_H

#include <CUnit/CUnit.h>
#include <stdbool.h>

#include "quant/qgemm.h"

/* The kernel family the qgemm dispatchers run: QGEMM_ISA_PORTABLE forces the portable kernels, another forces
 * that family (which the CPU must have); test_int8_family_off goes back to the CPU's choice. */
static inline void test_int8_family_on(QGemmIsa family) {
    qgemm_force_portable = family == QGEMM_ISA_PORTABLE;
    qgemm_force_isa = family == QGEMM_ISA_PORTABLE ? -1 : (int)family;
}

static inline void test_int8_family_off(void) { qgemm_force_portable = false, qgemm_force_isa = -1; }

/* run(family) for each of the n families the CPU has; for each it lacks, a visible skip: "<what> on <family>:
 * this CPU (or OS) has no <family>". */
void test_int8_on_families(void (*run)(QGemmIsa), const QGemmIsa *families, int n, const char *what);

/* test_qlayer_int8.c: the quantized layer's int8 path. */
int qlayer_int8_tests_add(CU_pSuite s);

#endif
