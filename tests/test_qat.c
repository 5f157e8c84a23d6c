#include <CUnit/CUnit.h>

int register_quant_qat_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qat", NULL, NULL);
    return s ? 0 : -1;
}
