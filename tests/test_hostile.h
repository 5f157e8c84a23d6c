/* test_hostile.h - the hostile suite's crafting and runs, shared by its
 * tests made at test time (test_hostile.c) and the committed corpus
 * tests/hostile/ (test_hostile_corpus.c: its generator and its replay). */
#ifndef QTRAIN_TESTS_TEST_HOSTILE_H
#define QTRAIN_TESTS_TEST_HOSTILE_H

#include <CUnit/CUnit.h>

typedef enum {
    EXT_PASSWD, EXT_FIFO, VDS_MISSING, VDS_FIFO, ELINK_PARAM, ELINK_GROUP, SOFT_LINK, FILTER, CHUNK_HUGE, UNALLOC,
    BOMB_SMALL, BOMB_BIG, VLEN_DAMAGED, NAN_VALUE, NEGATIVE_VALUE, CHUNK_HUGE_RAW
} Hostile;

extern const char *const HOSTILE_NAMES[]; /* [Hostile] */

/* The suite's temporary directory (made by its init, removed by its cleanup). */
const char *hostile_tmp(void);

/* Copies checkpoint src to <tmp>/<name>-<kind>.h5 and makes it hostile h at
 * dataset ds (NAN_VALUE, NEGATIVE_VALUE: its first element NaN or -1;
 * CHUNK_HUGE_RAW: CHUNK_HUGE with one short chunk written raw); an
 * external link or a virtual dataset's source names `elsewhere` (NULL: the
 * suite's FIFO or a missing file). Returns the path (static), or NULL. */
const char *hostile_craft(Hostile h, const char *src, const char *name, const char *ds, const char *elsewhere);

/* Runs the qtrain binary with args (timeout); its exit status (-1: killed
 * or a signal) and its output in *out (malloc'd). */
int hostile_qtrain_run(const char *const *args, char **out);

/* Adds the corpus tests to the hostile suite: with QTRAIN_HOSTILE_WRITE=DIR
 * only the generator (writes the corpus into DIR), else the replay. */
int hostile_corpus_add_tests(CU_pSuite s);

#endif
