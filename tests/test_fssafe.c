/* test_fssafe.c - the file system on a shared machine: --out writes only a
 * new file or (--force) a regular one, never through a FIFO, symlink,
 * directory or device; a run directory is locked while a run uses it; temp
 * files of dead writers are removed. The qtrain binary (QTRAIN_BIN) runs as
 * a child, so the lock of one process meets another. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/fsutil.h"
#include "test_proc.h"
#include "test_util.h"
#include "trainer/rundir.h"

#define CONFIG "tests/configs/tiny-mlp.yaml"
#define RUN_TIMEOUT_S 120.0

static char *tmp_root;
static char base_ckpt[600], lora_ckpt[600]; /* made by suite_init */

/* "<tmp_root>/<name>" in a static ring of 64 buffers (more than any one test uses). */
static const char *at(const char *name) {
    static char ring[64][700];
    static int next;
    char *p = ring[next++ % 64];
    snprintf(p, sizeof ring[0], "%s/%s", tmp_root, name);
    return p;
}

static void show_log(const char *log) {
    char *text = test_file_read(log, NULL);
    fprintf(stderr, "\n----- %s -----\n%s\n-----\n", log, text ? text : "(cannot read)");
    free(text);
}

static bool log_has(const char *log, const char *what) {
    char *text = test_file_read(log, NULL);
    bool found = text && strstr(text, what);
    if (!found) fprintf(stderr, "\n  %s lacks \"%s\": %s\n", log, what, text ? text : "(cannot read)");
    free(text);
    return found;
}

/* A short run of CONFIG into dir (steps, extra --set values, NULL-ended); its exit status. */
static int train(const char *dir, int steps, const char *log, const char *const *sets) {
    char out[700], st[64];
    snprintf(out, sizeof out, "run.out_dir=%s", dir);
    snprintf(st, sizeof st, "train.steps=%d", steps);
    const char *argv[32] = {"--config", CONFIG, "--quiet", "--set", out, "--set", st};
    int n = 7;
    for (int i = 0; sets && sets[i] && n < 30; i++) argv[n++] = "--set", argv[n++] = sets[i];
    argv[n] = NULL;
    return test_proc_run(log, argv, RUN_TIMEOUT_S);
}

/* A float run and a LoRA run on it, for merge and quantize to work on. */
static int suite_init(void) {
    if (!(tmp_root = test_tmpdir_new())) return -1;
    snprintf(base_ckpt, sizeof base_ckpt, "%s/base/final.h5", tmp_root);
    snprintf(lora_ckpt, sizeof lora_ckpt, "%s/lora/final.h5", tmp_root);
    char init[700];
    snprintf(init, sizeof init, "model.init_from=%s", base_ckpt);
    const char *lora[] = {init, "lora.rules=[{module_path: fc1, rank: 2, alpha: 4}]", NULL};
    if (train(at("base"), 4, at("base.log"), NULL) != 0) {
        show_log(at("base.log"));
        return -1;
    }
    if (train(at("lora"), 4, at("lora.log"), lora) != 0) {
        show_log(at("lora.log"));
        return -1;
    }
    return 0;
}

static int suite_clean(void) {
    if (getenv("QT_TEST_KEEP")) return 0;
    return test_tmpdir_remove(tmp_root) ? 0 : -1;
}

static int merge_to(const char *out, bool force, const char *log) {
    const char *argv[] = {"merge", "--checkpoint", lora_ckpt, "--out", out, force ? "--force" : NULL, NULL};
    return test_proc_run(log, argv, RUN_TIMEOUT_S);
}

static mode_t kind_of(const char *path) {
    struct stat sb;
    return lstat(path, &sb) == 0 ? sb.st_mode & S_IFMT : 0;
}

/* merge --out at a target of one kind: exit 2 naming the kind, the target as it was. */
static void check_refused(const char *target, mode_t kind, const char *named) {
    const char *log = at("refused.log");
    unlink(log);
    for (int force = 0; force < 2; force++) {
        int rc = merge_to(target, force, log);
        CU_ASSERT_EQUAL(rc, 2);
        CU_ASSERT(log_has(log, named));
        CU_ASSERT_EQUAL(kind_of(target), kind);
    }
}

/* `merge --out /dev/null` as root turned the device into a regular file, and a FIFO or symlink went the same way. */
static void test_out_refuses_special_files(void) {
    const char *fifo = at("out.fifo"), *link = at("out.link"), *victim = at("victim.txt"), *dir = at("out.dir");
    test_file_write(victim, "precious\n", 9);
    CU_ASSERT_EQUAL_FATAL(mkfifo(fifo, 0600), 0);
    CU_ASSERT_EQUAL_FATAL(symlink(victim, link), 0);
    CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0700), 0);
    check_refused(fifo, S_IFIFO, "a FIFO");
    check_refused(link, S_IFLNK, "a symbolic link");
    check_refused(dir, S_IFDIR, "a directory");
    char *text = test_file_read(victim, NULL);
    CU_ASSERT(text && strcmp(text, "precious\n") == 0);
    free(text);
    /* a dangling symlink is refused too: the write would have created its target */
    const char *dangling = at("dangling.link");
    CU_ASSERT_EQUAL_FATAL(symlink(at("nowhere.h5"), dangling), 0);
    check_refused(dangling, S_IFLNK, "a symbolic link");
    CU_ASSERT_NOT_EQUAL(access(at("nowhere.h5"), F_OK), 0);
    const char *dev = at("null.dev");
    if (mknod(dev, S_IFCHR | 0666, makedev(1, 3)) != 0) {
        test_skip("the device node case: mknod: %s (needs root)", strerror(errno));
    } else {
        check_refused(dev, S_IFCHR, "a character device");
        unlink(dev);
    }
    /* quantize, convert and compare check the same way (one each) */
    const char *log = at("others.log");
    const char *q[] = {"quantize", "--config", CONFIG, "--checkpoint", base_ckpt, "--out", fifo, "--set",
                       "quant.mode=ptq", "--set", "quant.rules=[{module_path: fc1, weight_qtype: int8}]", NULL};
    CU_ASSERT_EQUAL(test_proc_run(log, q, RUN_TIMEOUT_S), 2);
    const char *c[] = {"convert", "--checkpoint", base_ckpt, "--out", link, "--force", NULL};
    CU_ASSERT_EQUAL(test_proc_run(log, c, RUN_TIMEOUT_S), 2);
    const char *cmp_dir = at("cmp");
    CU_ASSERT_EQUAL_FATAL(mkdir(cmp_dir, 0700), 0);
    const char *md = at("cmp/compare.md");
    CU_ASSERT_EQUAL_FATAL(symlink(victim, md), 0);
    const char *cmp[] = {"compare", at("base"), "--out", cmp_dir, NULL};
    CU_ASSERT_EQUAL(test_proc_run(log, cmp, RUN_TIMEOUT_S), 2);
    CU_ASSERT_EQUAL(kind_of(fifo), S_IFIFO);
    CU_ASSERT_EQUAL(kind_of(link), S_IFLNK);
    CU_ASSERT_EQUAL(kind_of(md), S_IFLNK);
    CU_ASSERT(log_has(log, "compare.md is a symbolic link"));
    /* eval.json planted as a symlink in the run directory */
    const char *ej = at("base/eval.json");
    CU_ASSERT_EQUAL_FATAL(symlink(victim, ej), 0);
    const char *ev[] = {"eval", "--checkpoint", base_ckpt, NULL};
    CU_ASSERT_EQUAL(test_proc_run(log, ev, RUN_TIMEOUT_S), 2);
    CU_ASSERT(log_has(log, "eval.json is a symbolic link"));
    CU_ASSERT_EQUAL(kind_of(ej), S_IFLNK);
    unlink(ej);
    text = test_file_read(victim, NULL);
    CU_ASSERT(text && strcmp(text, "precious\n") == 0);
    free(text);
}

/* A regular file is replaced only with --force; a new file needs none. */
static void test_out_force(void) {
    const char *out = at("merged.h5"), *log = at("force.log");
    test_file_write(out, "old\n", 4);
    CU_ASSERT_EQUAL(merge_to(out, false, log), 2);
    CU_ASSERT(log_has(log, "already exists; pass --force"));
    char *text = test_file_read(out, NULL);
    CU_ASSERT(text && strcmp(text, "old\n") == 0);
    free(text);
    int rc = merge_to(out, true, log);
    CU_ASSERT_EQUAL(rc, 0);
    if (rc != 0) show_log(log);
    struct stat sb;
    CU_ASSERT(stat(out, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 1000);
    const char *fresh = at("merged-new.h5");
    CU_ASSERT_EQUAL(merge_to(fresh, false, log), 0);
    CU_ASSERT_EQUAL(kind_of(fresh), S_IFREG);
}

/* The temp files of a killed merge stayed beside its output forever. */
static void test_stale_merge_tmps_removed(void) {
    const char *out = at("stale-merged.h5"), *log = at("stale.log");
    char dead[700], alive[700], other[700];
    snprintf(dead, sizeof dead, "%s.tmp.999999999", out);
    snprintf(alive, sizeof alive, "%s.tmp.%ld", out, (long)getpid()); /* a live writer's */
    snprintf(other, sizeof other, "%s/unrelated.h5.tmp.999999999", tmp_root);
    test_file_write(dead, "x", 1);
    test_file_write(alive, "x", 1);
    test_file_write(other, "x", 1);
    int rc = merge_to(out, false, log);
    CU_ASSERT_EQUAL(rc, 0);
    if (rc != 0) show_log(log);
    CU_ASSERT_NOT_EQUAL(access(dead, F_OK), 0);
    CU_ASSERT_EQUAL(access(alive, F_OK), 0);
    CU_ASSERT_EQUAL(access(other, F_OK), 0);
    unlink(alive);
    unlink(other);
}

/* Waits until dir/.lock holds pid (the child took the lock); false if the child ends first. */
static bool wait_for_lock(const char *dir, pid_t pid) {
    char lock[700], want[32];
    snprintf(lock, sizeof lock, "%s/.lock", dir);
    snprintf(want, sizeof want, "%ld\n", (long)pid);
    struct timespec nap = {0, 2000000};
    for (;;) {
        char *text = test_file_read(lock, NULL);
        bool held = text && strcmp(text, want) == 0;
        free(text);
        if (held) return true;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) return false;
        nanosleep(&nap, NULL);
    }
}

/* Starts a long run in dir (it would take minutes: it is always stopped by a signal). */
static pid_t start_long_run(const char *dir, const char *log) {
    char out[700];
    snprintf(out, sizeof out, "run.out_dir=%s", dir);
    const char *argv[] = {"--config", CONFIG, "--quiet", "--set", out, "--set", "train.steps=1000000", "--set",
                          "train.checkpoint_every=0", "--set", "train.eval_every=0", NULL};
    return test_proc_start(log, argv);
}

/* Two runs started 50 ms apart in one out_dir both ran, and the directory ended with one's checkpoints and the
 * other's metrics. The first holds the lock (stopped with SIGSTOP while the second tries, so nothing depends on
 * timing); the second, and eval and merge writing there, are refused naming its pid. */
static void test_second_run_refused(void) {
    const char *dir = at("shared"), *log_a = at("shared-a.log"), *log_b = at("shared-b.log");
    pid_t a = start_long_run(dir, log_a);
    CU_ASSERT_FATAL(a > 0);
    bool locked = wait_for_lock(dir, a);
    CU_ASSERT(locked);
    if (!locked) {
        show_log(log_a);
        test_proc_wait(a, 1);
        return;
    }
    CU_ASSERT_EQUAL(kill(a, SIGSTOP), 0);
    char pid_text[64];
    snprintf(pid_text, sizeof pid_text, "pid %ld", (long)a);
    CU_ASSERT_EQUAL(train(dir, 4, log_b, NULL), 1);
    CU_ASSERT(log_has(log_b, pid_text));
    CU_ASSERT(log_has(log_b, "in use by another qtrain process"));
    const char *resume[] = {"--config", CONFIG, "--quiet", "--resume", "auto", "--set", NULL, NULL};
    char out[700];
    snprintf(out, sizeof out, "run.out_dir=%s", dir);
    resume[6] = out;
    CU_ASSERT_EQUAL(test_proc_run(log_b, resume, RUN_TIMEOUT_S), 1);
    const char *ev[] = {"eval", "--checkpoint", base_ckpt, "--out", dir, NULL}; /* eval.json into the held dir */
    CU_ASSERT_EQUAL(test_proc_run(log_b, ev, RUN_TIMEOUT_S), 1);
    char merged[700];
    snprintf(merged, sizeof merged, "%s/merged.h5", dir);
    CU_ASSERT_EQUAL(merge_to(merged, false, log_b), 1);
    CU_ASSERT_NOT_EQUAL(access(merged, F_OK), 0);
    CU_ASSERT_FALSE(test_file_exists(dir, "eval.json"));
    CU_ASSERT_EQUAL(kill(a, SIGCONT), 0);
    CU_ASSERT_EQUAL(kill(a, SIGTERM), 0);
    int status = test_proc_wait(a, RUN_TIMEOUT_S);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 130); /* stopped by SIGTERM, not refused */
}

/* fcntl locks die with their process: the .lock of a SIGKILLed run stays, naming it, and is taken over silently. */
static void test_stale_lock_not_an_error(void) {
    const char *dir = at("killed"), *log_a = at("killed-a.log"), *log_b = at("killed-b.log");
    pid_t a = start_long_run(dir, log_a);
    CU_ASSERT_FATAL(a > 0);
    bool locked = wait_for_lock(dir, a);
    CU_ASSERT_EQUAL(kill(a, SIGKILL), 0);
    test_proc_wait(a, RUN_TIMEOUT_S);
    CU_ASSERT_FATAL(locked);
    CU_ASSERT(test_file_exists(dir, ".lock"));
    int rc = train(dir, 4, log_b, NULL);
    CU_ASSERT_EQUAL(rc, 0);
    if (rc != 0) show_log(log_b);
    CU_ASSERT(test_file_exists(dir, "final.h5"));
    /* a .lock naming a pid that never ran here is no obstacle either */
    const char *dir2 = at("planted");
    CU_ASSERT_EQUAL_FATAL(mkdir(dir2, 0700), 0);
    test_file_write(at("planted/.lock"), "999999999\n", 10);
    rc = train(dir2, 4, log_b, NULL);
    CU_ASSERT_EQUAL(rc, 0);
}

/* The lock's own contract, in process: the holder's pid in the error; a .lock symlink refused; released on unlock
 * (a child then takes it). Tools and eval outside a run directory take no lock. */
static void test_rundir_lock_contract(void) {
    const char *dir = at("contract"), *log = at("contract.log");
    CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0700), 0);
    RunDirLock lk;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(rundir_lock(dir, &lk, &err), QT_OK);
    CU_ASSERT(lk.held);
    CU_ASSERT_EQUAL(train(dir, 4, log, NULL), 1);
    char pid_text[64];
    snprintf(pid_text, sizeof pid_text, "pid %ld holds", (long)getpid());
    CU_ASSERT(log_has(log, pid_text));
    CU_ASSERT_FALSE(test_file_exists(dir, "metrics.csv")); /* refused before touching anything */
    rundir_unlock(&lk, false);
    CU_ASSERT_FALSE(lk.held);
    CU_ASSERT(test_file_exists(dir, ".lock"));
    CU_ASSERT_EQUAL(train(dir, 4, log, NULL), 0);
    /* removing it with the lock (a caller about to remove the directory it created) */
    CU_ASSERT_EQUAL_FATAL(rundir_lock(dir, &lk, &err), QT_OK);
    rundir_unlock(&lk, true);
    CU_ASSERT_FALSE(test_file_exists(dir, ".lock"));
    /* a symlink planted as .lock is not followed */
    const char *sdir = at("symlock");
    CU_ASSERT_EQUAL_FATAL(mkdir(sdir, 0700), 0);
    CU_ASSERT_EQUAL_FATAL(symlink(at("victim2"), at("symlock/.lock")), 0);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(rundir_lock(sdir, &lk, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, "symbolic link"));
    CU_ASSERT_NOT_EQUAL(access(at("victim2"), F_OK), 0);
    /* no .lock: not a run directory, nothing to take */
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(rundir_lock_if_run(at("nolock/x.h5"), &lk, &err), QT_OK);
    CU_ASSERT_FALSE(lk.held);
}

/* fs_check_out_path and the temp-name parser, directly. */
static void test_fsutil_units(void) {
    QtError err = {0};
    CU_ASSERT_EQUAL(fs_check_out_path(at("new.h5"), false, "--out", &err), QT_OK);
    CU_ASSERT_EQUAL(fs_check_out_path("", true, "--out", &err), QT_ERR_ARG);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(fs_check_out_path(at("sub/"), true, "--out", &err), QT_ERR_ARG);
    char base[64];
    long pid = 0;
    CU_ASSERT(fs_parse_tmp_name("a.h5.tmp.123", base, sizeof base, &pid) && strcmp(base, "a.h5") == 0 && pid == 123);
    CU_ASSERT(fs_parse_tmp_name("x.idx.tmp.7.000000123", base, sizeof base, &pid) && strcmp(base, "x.idx") == 0 &&
              pid == 7);
    CU_ASSERT_FALSE(fs_parse_tmp_name("a.h5.tmp.", base, sizeof base, &pid));
    CU_ASSERT_FALSE(fs_parse_tmp_name("a.h5.tmp.12x", base, sizeof base, &pid));
    CU_ASSERT_FALSE(fs_parse_tmp_name(".tmp.12", base, sizeof base, &pid));
    CU_ASSERT_FALSE(fs_parse_tmp_name("a.h5", base, sizeof base, &pid));
    /* fs_open_tmp never writes through a symlink planted under the temp name */
    const char *path = at("target.h5"), *victim = at("victim3");
    char tmp[800];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    test_file_write(victim, "keep", 4);
    CU_ASSERT_EQUAL_FATAL(symlink(victim, tmp), 0);
    char got[800];
    int fd = fs_open_tmp(path, got, sizeof got);
    CU_ASSERT(fd >= 0);
    CU_ASSERT_STRING_EQUAL(got, tmp);
    if (fd >= 0) {
        CU_ASSERT_EQUAL(write(fd, "new", 3), 3);
        close(fd);
    }
    CU_ASSERT_EQUAL(kind_of(tmp), S_IFREG);
    char *text = test_file_read(victim, NULL);
    CU_ASSERT(text && strcmp(text, "keep") == 0);
    free(text);
    /* FS_REPLACE_NONE renames onto nothing only */
    test_file_write(path, "old", 3);
    errno = 0;
    CU_ASSERT_EQUAL(fs_rename_tmp(tmp, path, FS_REPLACE_NONE), -1);
    CU_ASSERT_EQUAL(errno, EEXIST);
    CU_ASSERT_EQUAL(fs_rename_tmp(tmp, path, FS_REPLACE_REGULAR), 0);
    text = test_file_read(path, NULL);
    CU_ASSERT(text && strcmp(text, "new") == 0);
    free(text);
}

/* fs_parent_dir: the one place that derives the directory a rename or lock lives in. */
static void test_fs_parent_dir(void) {
    char d[8];
    CU_ASSERT(fs_parent_dir("a.h5", d, sizeof d) && strcmp(d, ".") == 0);
    CU_ASSERT(fs_parent_dir("/a.h5", d, sizeof d) && strcmp(d, "/") == 0);
    CU_ASSERT(fs_parent_dir("x/y/a.h5", d, sizeof d) && strcmp(d, "x/y") == 0);
    CU_ASSERT(fs_parent_dir("1234567/a", d, sizeof d) && strcmp(d, "1234567") == 0);
    strcpy(d, "keep");
    CU_ASSERT_FALSE(fs_parent_dir("12345678/a", d, sizeof d)); /* does not fit: untouched */
    CU_ASSERT_STRING_EQUAL(d, "keep");
}

/* fs_fopen_tmp / fs_fcommit_tmp: the stream's bytes land under path; a
 * refused rename leaves path as it was and no temp file behind. */
static void test_fs_fcommit_tmp(void) {
    const char *path = at("commit.txt");
    char tmp[4200];
    unlink(path);
    FILE *f = fs_fopen_tmp(path, tmp, sizeof tmp);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fputs("one", f);
    CU_ASSERT_EQUAL(fs_fcommit_tmp(f, tmp, path, FS_REPLACE_NONE), 0);
    char *text = test_file_read(path, NULL);
    CU_ASSERT(text && strcmp(text, "one") == 0);
    free(text);
    f = fs_fopen_tmp(path, tmp, sizeof tmp);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fputs("two", f);
    errno = 0;
    CU_ASSERT_EQUAL(fs_fcommit_tmp(f, tmp, path, FS_REPLACE_NONE), -1);
    CU_ASSERT_EQUAL(errno, EEXIST);
    CU_ASSERT_EQUAL(access(tmp, F_OK), -1);
    text = test_file_read(path, NULL);
    CU_ASSERT(text && strcmp(text, "one") == 0);
    free(text);
}

int register_fssafe_suite(void) {
    CU_pSuite s = CU_add_suite("fssafe", suite_init, suite_clean);
    if (!s) return -1;
    int failed = !CU_add_test(s, "fs_check_out_path, temp names, no symlink followed", test_fsutil_units) ||
                 !CU_add_test(s, "fs_parent_dir", test_fs_parent_dir) ||
                 !CU_add_test(s, "fs_fopen_tmp, fs_fcommit_tmp", test_fs_fcommit_tmp) ||
                 !CU_add_test(s, "--out refuses a device, FIFO, directory and symlink", test_out_refuses_special_files) ||
                 !CU_add_test(s, "--out replaces a regular file only with --force", test_out_force) ||
                 !CU_add_test(s, "stale merge temp files are removed", test_stale_merge_tmps_removed) ||
                 !CU_add_test(s, "a second run in the same out_dir is refused naming the PID",
                              test_second_run_refused) ||
                 !CU_add_test(s, "a stale lock from a dead process is not an error", test_stale_lock_not_an_error) ||
                 !CU_add_test(s, "run directory lock: contract", test_rundir_lock_contract);
    return failed ? -1 : 0;
}
