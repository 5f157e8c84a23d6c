#include <CUnit/CUnit.h>

int register_quant_qt_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qt", NULL, NULL);
    return s ? 0 : -1;
}
