/* test_data.h - what the files of the data suites share: ASSERT_ERR
 * (test_data.c, test_data_sets.c) and transform lists (test_data_sets.c,
 * test_data_file.c). */
#ifndef QTRAIN_TESTS_TEST_DATA_H
#define QTRAIN_TESTS_TEST_DATA_H

#include <CUnit/CUnit.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "data/dataset.h"
#include "base/error.h"

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

/* One data.transforms entry of each kind the tests build. */
static inline Transform tf(TransformKind kind) { return (Transform){.kind = kind}; }

static inline Transform tf_classes(int n, const int *classes) {
    Transform t = {.kind = TRANSFORM_CLASSES, .n_classes = n};
    memcpy(t.classes, classes, (size_t)n * sizeof *classes);
    return t;
}

static inline Transform tf_limit(int limit) { return (Transform){.kind = TRANSFORM_LIMIT, .limit = limit}; }

/* Adds the transform, split and batch tests (test_data_sets.c) to the data
 * suite s, after the others: 0, or -1 if CUnit cannot. */
int data_add_set_tests(CU_pSuite s);

#endif
