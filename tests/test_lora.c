#include <CUnit/CUnit.h>

int register_lora_suite(void) {
    CU_pSuite s = CU_add_suite("lora", NULL, NULL);
    return s ? 0 : -1;
}
