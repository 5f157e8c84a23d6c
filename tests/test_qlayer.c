#include <CUnit/CUnit.h>

int register_quant_qlayer_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qlayer", NULL, NULL);
    return s ? 0 : -1;
}
