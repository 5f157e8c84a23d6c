/* test_data.h - what the files of the data suite (test_data.c,
 * test_data_sets.c) share. */
#ifndef QTRAIN_TESTS_TEST_DATA_H
#define QTRAIN_TESTS_TEST_DATA_H

#include <CUnit/CUnit.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "nn/error.h"

/* Whether msg holds sub; a NULL sub is held by every message. */
static inline bool msg_has(const char *msg, const char *sub) { return !sub || strstr(msg, sub) != NULL; }

/* The status, the QtError's status and two substrings of its message. */
#define ASSERT_ERR(st, e, want, sub1, sub2)                                                                  \
    do {                                                                                                     \
        QtStatus st_ = (st);                                                                                 \
        bool ok_ = st_ == (want) && (e).status == (want) && msg_has((e).msg, sub1) && msg_has((e).msg, sub2); \
        if (!ok_)                                                                                            \
            fprintf(stderr, "\n  %s:%d: status %d (want %d), message: %s\n", __FILE__, __LINE__, (int)st_,  \
                    (int)(want), (e).msg);                                                                   \
        CU_ASSERT(ok_);                                                                                      \
    } while (0)

/* Adds the transform, split and batch tests (test_data_sets.c) to the data
 * suite s, after the others: 0, or -1 if CUnit cannot. */
int data_add_set_tests(CU_pSuite s);

#endif
