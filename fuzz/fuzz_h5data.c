/* fuzz/fuzz_h5data.c - the libFuzzer driver of the h5data target; the work is
 * fuzz_h5data_one (tests/fuzz_harness.h), which the fuzz_regress suite runs too. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tests/fuzz_harness.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    char why[FUZZ_WHY_MAX];
    if (fuzz_h5data_init(why, sizeof why) != 0) {
        fprintf(stderr, "fuzz_h5data: %s\n", why);
        exit(1);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char why[FUZZ_WHY_MAX];
    if (fuzz_h5data_one(data, size, why, sizeof why) != 0) {
        fprintf(stderr, "fuzz_h5data: %s\n", why);
        abort();
    }
    return 0;
}
