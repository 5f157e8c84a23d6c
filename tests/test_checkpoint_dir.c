/* test_checkpoint_dir.c - checkpoint files in the file system: saves that
 * fail (no directory, an unwritable one, a full disk) leave no temp file and
 * the old checkpoint intact; ckpt-<step>.h5 names, last.h5, rotation and
 * stale temp files in a run directory; and the file `--resume auto` takes.
 * These tests join the "checkpoint" suite through checkpoint_dir_tests_add,
 * called by test_checkpoint.c. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nn/model.h"
#include "nn/optim.h"
#include "test_util.h"
#include "trainer/checkpoint.h"

int checkpoint_dir_tests_add(CU_pSuite s);

/* ---- fixtures ---------------------------------------------------------------------------------- */

/* An MLP (8) -> fc1 16 -> relu -> fc2 4 with AdamW moments after `steps`
 * steps on random gradients. No generators in the state: these tests are
 * about files, test_checkpoint.c about what is in them. */
typedef struct {
    Model m;
    Optimizer opt;
    CheckpointState st;
} DirRun;

static void dirrun_init(DirRun *r, uint64_t seed, int steps) {
    memset(r, 0, sizeof *r);
    LayerSpec l[3] = {{.type = LAYER_DENSE, .name = "fc1", .units = 16}, {.type = LAYER_RELU},
                      {.type = LAYER_DENSE, .name = "fc2", .units = 4}};
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&r->m, 1, (int[]){8}, l, 3, &err), QT_OK);
    Rng rng;
    rng_init(&rng, seed, RNG_STREAM_INIT);
    model_init_params(&r->m, &rng);
    OptimConfig c = optim_config_default(OPTIM_ADAMW);
    CU_ASSERT_EQUAL_FATAL(optim_init(&r->opt, &c, r->m.param_list, r->m.n_params, &err), QT_OK);
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < r->m.n_params; i++)
            rng_fill_normal(&rng, r->m.params[i].var.grad, var_numel(&r->m.params[i].var), 0.0f, 1.0f);
        optim_step(&r->opt, 0.01f);
    }
    r->st = (CheckpointState){.step = r->opt.step, .seed = seed, .n_train = 600, .last_train_loss = NAN};
}

static void dirrun_free(DirRun *r) {
    optim_free(&r->opt);
    model_free(&r->m);
}

/* The step of the checkpoint at path, loaded into a fresh run; -1 if it does not load. */
static int64_t saved_step(const char *path) {
    DirRun r;
    dirrun_init(&r, 99, 0);
    QtError err = {0};
    int64_t step = checkpoint_load(path, &r.m, &r.opt, &r.st, &err) == QT_OK ? r.st.step : -1;
    dirrun_free(&r);
    return step;
}

/* ---- temporary directories -------------------------------------------------------------------- */

static int count_tmp_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
}

/* ---- failed saves ------------------------------------------------------------------------------- */

/* limit > 0: with the file size limit set to that many bytes during the
 * save (nothing is printed meanwhile: stderr may be a file too). */
static void expect_save_fails(const char *path, const DirRun *r, const char *dir_to_scan, const char *what,
                              size_t limit) {
    QtError err = {0};
    struct rlimit old, small;
    void (*prev)(int) = SIG_DFL;
    if (limit) {
        getrlimit(RLIMIT_FSIZE, &old);
        small = (struct rlimit){.rlim_cur = (rlim_t)limit, .rlim_max = old.rlim_max};
        prev = signal(SIGXFSZ, SIG_IGN);
        setrlimit(RLIMIT_FSIZE, &small);
    }
    QtStatus st = checkpoint_save(path, &r->m, &r->opt, &r->st, &err);
    if (limit) {
        setrlimit(RLIMIT_FSIZE, &old);
        signal(SIGXFSZ, prev);
    }
    CU_ASSERT_EQUAL(st, QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, path));
    CU_ASSERT(test_msg_has(&err, what));
    CU_ASSERT_EQUAL(count_tmp_files(dir_to_scan), 0);
    test_assert_hdf5_closed();
}

static void test_failed_save_leaves_no_trace(void) {
    char *dir = test_tmpdir_new();
    char *good = test_path_join(dir, "good.h5"), *nodir = test_path_join(dir, "nope/x.h5");
    char *file = test_path_join(dir, "file"), *under_file = test_path_join(file, "x.h5");
    DirRun r, r2;
    dirrun_init(&r, 1, 2);
    dirrun_init(&r2, 9, 4);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(good, &r.m, &r.opt, &r.st, &err), QT_OK);
    size_t n0 = 0, n1 = 0;
    char *before = test_file_read(good, &n0);

    expect_save_fails(nodir, &r, dir, strerror(ENOENT), 0);
    test_file_write(file, "x", 1);
    expect_save_fails(under_file, &r, dir, strerror(ENOTDIR), 0);

    /* A full disk, as far as this process can tell: writes past the size
     * limit fail with EFBIG (root is bound by it too). The old file stays. */
    expect_save_fails(good, &r2, dir, "file too large: the file-size limit (ulimit -f) is", n0 / 2);

    /* An unwritable directory (root ignores permissions, so only as a user). */
    if (geteuid() != 0) {
        chmod(dir, 0500);
        expect_save_fails(good, &r2, dir, strerror(EACCES), 0);
        chmod(dir, 0700);
    }
    char *after = test_file_read(good, &n1);
    CU_ASSERT(before && after && n0 == n1 && memcmp(before, after, n0) == 0);
    /* ... and it still loads into a fresh run. */
    CU_ASSERT_EQUAL(checkpoint_load(good, &r2.m, &r2.opt, &r2.st, &err), QT_OK);
    CU_ASSERT(test_params_equal(&r.m, &r2.m));
    free(before);
    free(after);
    dirrun_free(&r);
    dirrun_free(&r2);
    free(good);
    free(nodir);
    free(file);
    free(under_file);
    test_tmpdir_remove(dir);
}

/* ---- run directories ---------------------------------------------------------------------------- */

static void test_save_in_dir_rotation(void) {
    char *dir = test_tmpdir_new();
    DirRun r;
    dirrun_init(&r, 1, 1);
    /* Files that are not ours, a temp file of a dead process and one of a live one. */
    const char *planted[] = {"notes.txt", "ckpt-abc.h5", "ckpt-00000001.h5.tmp.999999999", "ckpt-00000002.h5.tmp.1",
                             "metrics.csv.tmp.999999999", "summary.json.tmp.999999999", "notes.txt.tmp.999999999"};
    for (int i = 0; i < 7; i++) {
        char *p = test_path_join(dir, planted[i]);
        test_file_write(p, "x", 1);
        free(p);
    }
    QtError err = {0};
    char saved[4096];
    for (int64_t step = 10; step <= 40; step += 10) {
        r.st.step = step;
        CU_ASSERT_EQUAL(checkpoint_save_in_dir(dir, NULL, 2, &r.m, &r.opt, &r.st, saved, sizeof saved, &err), QT_OK);
    }
    char *want = test_path_join(dir, "ckpt-00000040.h5");
    CU_ASSERT_STRING_EQUAL(saved, want);
    CU_ASSERT_FALSE(test_file_exists(dir, "ckpt-00000010.h5"));
    CU_ASSERT_FALSE(test_file_exists(dir, "ckpt-00000020.h5"));
    CU_ASSERT(test_file_exists(dir, "ckpt-00000030.h5"));
    CU_ASSERT(test_file_exists(dir, "ckpt-00000040.h5"));
    CU_ASSERT(test_file_exists(dir, "notes.txt") && test_file_exists(dir, "ckpt-abc.h5"));
    CU_ASSERT_FALSE(test_file_exists(dir, "ckpt-00000001.h5.tmp.999999999"));
    CU_ASSERT(test_file_exists(dir, "ckpt-00000002.h5.tmp.1"));
    CU_ASSERT_FALSE(test_file_exists(dir, "metrics.csv.tmp.999999999")); /* a run killed at its start */
    CU_ASSERT_FALSE(test_file_exists(dir, "summary.json.tmp.999999999"));
    CU_ASSERT(test_file_exists(dir, "notes.txt.tmp.999999999")); /* not a file of ours */
    char *last = test_path_join(dir, "last.h5");
    CU_ASSERT_EQUAL(saved_step(last), 40);
    struct stat a, b;
    CU_ASSERT(stat(last, &a) == 0 && stat(want, &b) == 0 && a.st_ino == b.st_ino); /* a hard link */

    /* final.h5 by name: not rotated, becomes last.h5. */
    r.st.step = 45;
    CU_ASSERT_EQUAL(checkpoint_save_in_dir(dir, "final.h5", 2, &r.m, &r.opt, &r.st, NULL, 0, &err), QT_OK);
    CU_ASSERT(test_file_exists(dir, "final.h5") && test_file_exists(dir, "ckpt-00000030.h5"));
    CU_ASSERT_EQUAL(saved_step(last), 45);
    r.st.step = 50;
    CU_ASSERT_EQUAL(checkpoint_save_in_dir(dir, NULL, 1, &r.m, &r.opt, &r.st, NULL, 0, &err), QT_OK);
    CU_ASSERT(test_file_exists(dir, "final.h5") && test_file_exists(dir, "last.h5") &&
              test_file_exists(dir, "ckpt-00000050.h5"));
    CU_ASSERT_FALSE(test_file_exists(dir, "ckpt-00000040.h5"));
    CU_ASSERT_EQUAL(saved_step(last), 50);
    CU_ASSERT_EQUAL(checkpoint_save_in_dir(dir, NULL, -1, &r.m, &r.opt, &r.st, NULL, 0, &err), QT_ERR_ARG);
    test_assert_hdf5_closed();
    dirrun_free(&r);
    free(want);
    free(last);
    test_tmpdir_remove(dir);
}

static void test_find_latest(void) {
    char *dir = test_tmpdir_new();
    char path[4096];
    QtError err = {0};
    strcpy(path, "junk");
    CU_ASSERT_EQUAL(checkpoint_find_latest(dir, path, sizeof path, &err), QT_ERR_IO);
    CU_ASSERT_EQUAL(path[0], '\0');
    CU_ASSERT(test_msg_has(&err, "no checkpoint in"));
    qt_error_clear(&err);
    char *missing = test_path_join(dir, "missing");
    CU_ASSERT_EQUAL(checkpoint_find_latest(missing, path, sizeof path, &err), QT_ERR_IO);
    CU_ASSERT_EQUAL(path[0], '\0');
    qt_error_clear(&err);

    DirRun r;
    dirrun_init(&r, 1, 1);
    for (int64_t step = 5; step <= 300; step *= 4) { /* 5, 20, 80: the numeric order, not the names', decides */
        r.st.step = step;
        CU_ASSERT_EQUAL(checkpoint_save_in_dir(dir, NULL, 0, &r.m, &r.opt, &r.st, NULL, 0, &err), QT_OK);
    }
    char *p = test_path_join(dir, "ckpt-100.h5"); /* fewer digits but a higher step than ckpt-00000080.h5 */
    char *p80 = test_path_join(dir, "ckpt-00000080.h5");
    CU_ASSERT_EQUAL(count_tmp_files(dir), 0); /* neither the saves nor last.h5 left one */
    CU_ASSERT_EQUAL(link(p80, p), 0);
    char *last = test_path_join(dir, "last.h5");
    CU_ASSERT_EQUAL(checkpoint_find_latest(dir, path, sizeof path, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(path, last);
    unlink(last);
    CU_ASSERT_EQUAL(checkpoint_find_latest(dir, path, sizeof path, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(path, p);
    char tiny[8];
    CU_ASSERT_EQUAL(checkpoint_find_latest(dir, tiny, sizeof tiny, &err), QT_ERR_ARG);
    dirrun_free(&r);
    free(p);
    free(p80);
    free(last);
    free(missing);
    test_tmpdir_remove(dir);
}

/* Adds this file's tests to the suite register_checkpoint_suite made;
 * nonzero if CUnit refused one. */
int checkpoint_dir_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "failed save leaves no trace", test_failed_save_leaves_no_trace) ||
           !CU_add_test(s, "save_in_dir: last.h5, rotation, stale temps", test_save_in_dir_rotation) ||
           !CU_add_test(s, "find_latest", test_find_latest);
}
