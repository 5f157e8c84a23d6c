/* test_fakequant.h - helpers shared by the fake-quantization test files. */
#ifndef QTRAIN_TESTS_TEST_FAKEQUANT_H
#define QTRAIN_TESTS_TEST_FAKEQUANT_H

#include <CUnit/CUnit.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define LN2 0.69314718055994530942

/* a[i] and b[i] bit for bit; prints the first difference, labelled `what`. */
bool fq_test_same_bits(const float *a, const float *b, size_t n, const char *what);
/* n values in [-lim, lim], each moved at least `gap` away from edges[]. */
float *fq_test_spread_away(size_t n, uint64_t seed, float lim, const float *edges, int n_edges, float gap);
/* Registers the learned-range gradient tests (test_fakequant_learned.c). */
int fq_learned_tests_add(CU_pSuite s);
/* Registers the per-block and block-format tests (test_fakequant_blocks.c). */
int fq_block_tests_add(CU_pSuite s);

#endif
