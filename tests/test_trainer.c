/* test_trainer.c - end to end: the demo run trains and generalises. */
#include <stdio.h>

#include "test_util.h"
#include "trainer/demo.h"

static void test_demo_learns_spirals(void) {
    DemoOptions o = demo_options_default();
    o.steps = 300;
    o.quiet = true;
    QtError err = {0};
    double acc = 0.0;
    /* stdout carries the demo's report; the CUnit log stays readable. */
    fflush(stdout);
    CU_ASSERT_EQUAL_FATAL(demo_run(&o, &acc, &err), QT_OK);
    /* A linear model gets ~1/3 on interleaved spirals; the MLP separates them. */
    CU_ASSERT(acc > 0.95);
    o.batch_size = 0;
    CU_ASSERT_EQUAL(demo_run(&o, &acc, &err), QT_ERR_ARG);
}

int register_trainer_suite(void) {
    CU_pSuite s = CU_add_suite("trainer", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "demo run learns 3-class spirals", test_demo_learns_spirals);
}
