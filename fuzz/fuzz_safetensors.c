/* fuzz/fuzz_safetensors.c - the libFuzzer driver of the safetensors target; the work is
 * fuzz_safetensors_one (tests/fuzz_harness.h), which the fuzz_regress suite runs too. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tests/fuzz_harness.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char why[FUZZ_WHY_MAX];
    if (fuzz_safetensors_one(data, size, why, sizeof why) != 0) {
        fprintf(stderr, "fuzz_safetensors: %s\n", why);
        abort();
    }
    return 0;
}
