/* The CUnit runner: every suite of every area, in one executable.
 *   run_tests            all suites
 *   run_tests NAME...    only suites whose name contains one of NAME */
#include <CUnit/Basic.h>
#include <stdio.h>
#include <string.h>

#include "test_util.h"

/* Strong references: a suite listed here whose registration function is
 * missing (a file not linked, a renamed suite) is a link error naming it,
 * and the Makefile refuses a register_*_suite that is not listed here. */
#define SUITES(X) \
    X(nn_core)    \
    X(nn_ops)     \
    X(nn_conv)    \
    X(nn_conv_lowrank) \
    X(nn_batchnorm) \
    X(nn_conv_bn) \
    X(nn_bn_add_view) \
    X(bn_sync)    \
    X(nn_conv_general) \
    X(nn_kernels_fast) \
    X(nn_train_memory) \
    X(data_hdf5) \
    X(data_npy_sets) \
    X(interop) \
    X(device_export) \
    X(nn_conv_reuse) \
    X(nn_conv_s2) \
    X(nn_conv_taps) \
    X(nn_conv_wino) \
    X(nn_parallel) \
    X(nn_optim)   \
    X(nn_model)   \
    X(model_graph) \
    X(bn_fold)    \
    X(bn_fuse)    \
    X(conv_geom)  \
    X(nn_torch)   \
    X(graph_parity) \
    X(graph_checks) \
    X(data)       \
    X(data_cache) \
    X(augment)    \
    X(data_npy)   \
    X(safetensors) \
    X(quant_qtype) \
    X(quant_calib) \
    X(quant_qarray) \
    X(quant_fake) \
    X(quant_qlayer) \
    X(quant_defaults) \
    X(lora)       \
    X(lora_init)  \
    X(config)     \
    X(config_schema) \
    X(checkpoint) \
    X(trainer)    \
    X(commands)   \
    X(autoquant)  \
    X(shipped_configs) \
    X(qlora)      \
    X(dora)       \
    X(lora_bn)    \
    X(step_macs)  \
    X(quant_qat)  \
    X(quant_qat_bn) \
    X(quant_qat_bn_runs) \
    X(quant_qt)   \
    X(quant_qt_kern) \
    X(quant_qwino) \
    X(quant_int8) \
    X(quant_int8_dw) \
    X(quant_int8_dw_rows) \
    X(quant_taps_codes) \
    X(quant_int8_handoff) \
    X(device_rt)  \
    X(bench_cmd)  \
    X(fuzz_regress) \
    X(interrupt)  \
    X(diskfull)   \
    X(nonfinite)  \
    X(tasks)      \
    X(fssafe)     \
    X(decode_py)  \
    X(make_dataset) \
    X(hostile)    \
    X(runner)     \
    X(install)    \
    X(dist)       \
    X(mpi)

#define DECLARE(name) int register_##name##_suite(void);
SUITES(DECLARE)

int main(int argc, char **argv) {
    if (CU_initialize_registry() != CUE_SUCCESS) return 2;
    struct {
        const char *name;
        SuiteRegisterFn fn;
    } all[] = {
#define ENTRY(name) {#name, register_##name##_suite},
        SUITES(ENTRY)
    };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        int wanted = argc < 2;
        for (int a = 1; a < argc; a++) wanted |= strstr(all[i].name, argv[a]) != NULL;
        if (wanted && all[i].fn() != 0) {
            fprintf(stderr, "cannot register suite %s: %s\n", all[i].name, CU_get_error_msg());
            CU_cleanup_registry();
            return 2;
        }
    }
    CU_basic_set_mode(CU_BRM_VERBOSE);
    CU_basic_run_tests();
    unsigned failed = CU_get_number_of_failures() + CU_get_number_of_tests_failed();
    unsigned run = CU_get_number_of_tests_run();
    CU_cleanup_registry();
    test_skips_print(stdout); /* after CUnit's summary, so a skip is seen where the counts are */
    if (run == 0) {
        fprintf(stderr, "no test ran\n");
        return 1;
    }
    return failed ? 1 : 0;
}
