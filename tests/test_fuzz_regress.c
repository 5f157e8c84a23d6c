/* test_fuzz_regress.c - the fuzz_regress suite: every input the fuzzers
 * found a bug with (tests/fuzz_regressions/<target>/), and the committed
 * seeds (fuzz/corpus/<target>/), replayed through the fuzz targets' own
 * entry functions (fuzz_harness.h). Each must run without a crash or a
 * sanitizer report and keep the loaders' rules. */
#include <CUnit/CUnit.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz_harness.h"
#include "test_util.h"

typedef int (*EntryFn)(const uint8_t *data, size_t size, char *why, size_t why_cap);

static int read_input(const char *path, uint8_t **data, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return 1;
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        uint8_t *grown = realloc(buf, cap * 2);
        if (!grown) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = grown;
        cap *= 2;
    }
    int rc = ferror(f) || !buf;
    fclose(f);
    if (rc) {
        free(buf);
        return 1;
    }
    *data = buf;
    *size = n;
    return 0;
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Replays every file of dir (in name order) through fn; returns how many
 * ran. Each failure is printed with the file and the broken rule. */
static int replay_dir(const char *dir, EntryFn fn) {
    DIR *d = opendir(dir);
    CU_ASSERT_PTR_NOT_NULL_FATAL(d);
    char *names[512];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL && n < 512)
        if (e->d_name[0] != '.') names[n++] = strdup(e->d_name);
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], by_name);
    for (int i = 0; i < n; i++) {
        char path[1024], why[FUZZ_WHY_MAX] = "";
        uint8_t *data = NULL;
        size_t size = 0;
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        CU_ASSERT_EQUAL_FATAL(read_input(path, &data, &size), 0);
        int rc = fn(data, size, why, sizeof why);
        if (rc != 0) fprintf(stderr, "\n  %s: %s\n", path, why);
        CU_ASSERT_EQUAL(rc, 0);
        free(data);
        free(names[i]);
    }
    return n;
}

static void test_config_inputs(void) {
    CU_ASSERT(replay_dir("tests/fuzz_regressions/config", fuzz_config_one) > 0);
    CU_ASSERT(replay_dir("fuzz/corpus/config", fuzz_config_one) > 0);
}

static void test_idx_inputs(void) {
    CU_ASSERT(replay_dir("tests/fuzz_regressions/idx", fuzz_idx_one) > 0);
    CU_ASSERT(replay_dir("fuzz/corpus/idx", fuzz_idx_one) > 0);
}

/* No npy input has found a bug yet: tests/fuzz_regressions/npy/ is replayed once it exists. */
static void test_npy_inputs(void) {
    if (access("tests/fuzz_regressions/npy", F_OK) == 0) replay_dir("tests/fuzz_regressions/npy", fuzz_npy_one);
    CU_ASSERT(replay_dir("fuzz/corpus/npy", fuzz_npy_one) > 0);
}

/* No safetensors input has found a bug yet: tests/fuzz_regressions/safetensors/ is replayed once it exists. */
static void test_safetensors_inputs(void) {
    if (access("tests/fuzz_regressions/safetensors", F_OK) == 0)
        replay_dir("tests/fuzz_regressions/safetensors", fuzz_safetensors_one);
    CU_ASSERT(replay_dir("fuzz/corpus/safetensors", fuzz_safetensors_one) > 0);
}

/* No h5data input has found a bug yet: tests/fuzz_regressions/h5data/ is replayed once it exists. */
static void test_h5data_inputs(void) {
    char why[FUZZ_WHY_MAX] = "";
    int rc = fuzz_h5data_init(why, sizeof why);
    if (rc != 0) fprintf(stderr, "\n  %s\n", why);
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    if (access("tests/fuzz_regressions/h5data", F_OK) == 0)
        replay_dir("tests/fuzz_regressions/h5data", fuzz_h5data_one);
    CU_ASSERT(replay_dir("fuzz/corpus/h5data", fuzz_h5data_one) > 0);
}

static void test_checkpoint_inputs(void) {
    char why[FUZZ_WHY_MAX] = "";
    int rc = fuzz_checkpoint_init(why, sizeof why);
    if (rc != 0) fprintf(stderr, "\n  %s\n", why);
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT(replay_dir("tests/fuzz_regressions/checkpoint", fuzz_checkpoint_one) > 0);
    CU_ASSERT(replay_dir("fuzz/corpus/checkpoint", fuzz_checkpoint_one) > 0);
}

static int suite_cleanup(void) {
    fuzz_checkpoint_cleanup();
    fuzz_h5data_cleanup();
    fuzz_scratch_remove();
    return 0;
}

int register_fuzz_regress_suite(void) {
    CU_pSuite s = CU_add_suite("fuzz_regress", NULL, suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "config: found inputs and seeds", test_config_inputs) ||
           !CU_add_test(s, "idx: found inputs and seeds", test_idx_inputs) ||
           !CU_add_test(s, "npy: found inputs and seeds", test_npy_inputs) ||
           !CU_add_test(s, "safetensors: found inputs and seeds", test_safetensors_inputs) ||
           !CU_add_test(s, "h5data: seeds", test_h5data_inputs) ||
           !CU_add_test(s, "checkpoint: found inputs and seeds", test_checkpoint_inputs);
}
