/* test_qgemm.c - the int8 GEMM of quantized training against its scalar
 * twin, bit for bit. Part of the quant_qt suite. */
#include <CUnit/CUnit.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "quant/fqt.h"
#include "test_fqt.h"

/* ---- the integer GEMM -------------------------------------------------------------------------------------------- */

static void qgemm_case(int M, int N, int K, uint64_t seed, bool extremes) {
    size_t na = (size_t)M * K, nb = (size_t)N * K, nc = (size_t)M * N;
    int8_t *a = malloc(na ? na : 1), *b = malloc(nb ? nb : 1);
    int32_t *c = malloc((nc ? nc : 1) * sizeof *c), *ref = malloc((nc ? nc : 1) * sizeof *ref);
    CU_ASSERT_FATAL(a && b && c && ref);
    Rng r;
    rng_init(&r, seed, 1);
    for (size_t i = 0; i < na; i++) a[i] = extremes ? -128 : (int8_t)(rng_below(&r, 256) - 128);
    for (size_t i = 0; i < nb; i++) b[i] = extremes ? (i % 3 ? -128 : 127) : (int8_t)(rng_below(&r, 256) - 128);
    memset(c, 0x5a, (nc ? nc : 1) * sizeof *c); /* garbage the kernel must overwrite */
    qgemm_s8(c, a, b, M, N, K);
    qgemm_s8_ref(ref, a, b, M, N, K);
    bool same = memcmp(c, ref, nc * sizeof *c) == 0;
    if (!same) fprintf(stderr, "\n  qgemm_s8 (%d, %d, %d)%s differs from the reference\n", M, N, K,
                       extremes ? " at the extremes" : "");
    CU_ASSERT(same);
    free(a), free(b), free(c), free(ref);
}

static void test_qgemm(void) {
    static const int SIZES[] = {1, 3, 17, 64, 129};
    uint64_t seed = 1;
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 5; j++)
            for (int k = 0; k < 5; k++) qgemm_case(SIZES[i], SIZES[j], SIZES[k], seed++, false);
    qgemm_case(129, 17, 129, 7, true);  /* -128 * -128 summed */
    qgemm_case(5, 70, 600, 8, false);   /* several K blocks and column blocks */
    qgemm_case(3, 5, 0, 9, false);      /* no terms: zeros */
    qgemm_case(2, 3, 1 << 16, 10, true); /* sums near the int32 limit */
}

int qgemm_tests_add(CU_pSuite s) { return !CU_add_test(s, "qgemm_s8 equals its reference", test_qgemm); }
