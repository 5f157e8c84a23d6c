/* test_mpi.c - data-parallel training end to end: build/qtrain-mpi under
 * Open MPI's mpirun (QTRAIN_MPI_BIN, which `make test` sets when Open MPI
 * is installed; `make test MPI=1` installs it). Without it every test says
 * it is skipped and why.
 *
 * On the mini data set, float and QLoRA: reruns at 2 and 3 ranks give the
 * same bits, a stop and resume at the same world size gives the bits of
 * an uninterrupted run, N ranks match one process within float rounding,
 * a resume at another world size continues, a killed rank ends the job
 * with a message naming it, and batch norm with train.sync_bn matches one
 * process. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/h5io.h"
#include "test_proc.h"
#include "test_util.h"

static const char *mpi_bin(void) {
    const char *b = getenv("QTRAIN_MPI_BIN");
    return b && b[0] && access(b, X_OK) == 0 ? b : NULL;
}

/* Whether the suite can run; else one skip line says why. */
static bool mpi_ready(void) {
    if (!mpi_bin()) {
        test_skip("no build/qtrain-mpi (QTRAIN_MPI_BIN unset): Open MPI is not installed; `make test MPI=1` "
                  "installs libopenmpi-dev and openmpi-bin and runs this suite");
        return false;
    }
    if (system("command -v mpirun >/dev/null 2>&1") != 0) {
        test_skip("mpirun is not on PATH (Debian's openmpi-bin)");
        return false;
    }
    return true;
}

/* mpirun -np np qtrain-mpi --config cfg --set run.out_dir=out --set run.threads=1 [extra...] -q, its output
 * appended to out.log; the exit status (-1: a signal or the timeout). */
static int mpi_run(int np, const char *cfg, const char *out, const char *const *extra, double timeout_s) {
    char npv[16], outset[1024], log[1100];
    snprintf(npv, sizeof npv, "%d", np);
    snprintf(outset, sizeof outset, "run.out_dir=%s", out);
    snprintf(log, sizeof log, "%s.log", out);
    const char *argv[64] = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", npv, mpi_bin(), "--config",
                            cfg, "--set", outset, "--set", "run.threads=1", "-q"};
    int n = 13;
    for (int i = 0; extra && extra[i] && n < 62; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = test_proc_spawn(log, argv, -1, 0);
    if (pid < 0) return -1;
    int status = test_proc_wait(pid, timeout_s);
    return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The same config in one process of the plain binary. */
static int one_run(const char *cfg, const char *out, const char *const *extra) {
    char outset[1024], log[1100];
    snprintf(outset, sizeof outset, "run.out_dir=%s", out);
    snprintf(log, sizeof log, "%s.log", out);
    const char *args[48] = {"--config", cfg, "--set", outset, "--set", "run.threads=1", "-q"};
    int n = 7;
    for (int i = 0; extra && extra[i] && n < 46; i++) args[n++] = extra[i];
    args[n] = NULL;
    return test_proc_run(log, args, 120);
}

static char *path_in(const char *dir, const char *name) { return test_path_join(dir, name); }

/* Whether `log` (the file) holds `what`; prints the file if not. */
static bool log_has(const char *log, const char *what) {
    size_t n = 0;
    char *text = test_file_read(log, &n);
    bool ok = text && strstr(text, what);
    if (!ok) fprintf(stderr, "\n  %s lacks '%s':\n%s\n", log, what, text ? text : "(unreadable)");
    free(text);
    return ok;
}

/* A number of summary.json: "key": value. NaN if absent. */
static double summary_number(const char *dir, const char *key) {
    char *p = path_in(dir, "summary.json"), pat[80];
    size_t n = 0;
    char *text = test_file_read(p, &n);
    free(p);
    double v = NAN;
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *at = text ? strstr(text, pat) : NULL;
    if (at) v = strtod(at + strlen(pat), NULL);
    free(text);
    return v;
}

static double ckpt_rel_diff(const char *a, const char *b, const char *group) {
    return test_ckpt_group_rel_diff(a, b, group);
}

static bool same_bits(const char *dir_a, const char *dir_b, const char *file, const char *group) {
    char *a = path_in(dir_a, file), *b = path_in(dir_b, file);
    bool ok = test_ckpt_group_within(a, b, group);
    free(a), free(b);
    return ok;
}

/* Two finished runs with the same final parameters, optimizer state and metrics.csv, bit for bit. */
static void assert_same_run(const char *a, const char *b) {
    CU_ASSERT(same_bits(a, b, "final.h5", "params"));
    CU_ASSERT(same_bits(a, b, "final.h5", "optim"));
    char *ma = test_metrics_rows(a), *mb = test_metrics_rows(b);
    CU_ASSERT(ma && mb && strcmp(ma, mb) == 0);
    free(ma), free(mb);
}

/* ---- the runs the tests share: made once ---- */

static char *tmp;          /* the suite's directory */
static char base_set[600]; /* "model.init_from=<tiny-base's final.h5>" for the QLoRA runs */

static int suite_init(void) {
    /* A sanitizer build of qtrain-mpi: Open MPI keeps memory until exit, in components it has unloaded by then, so
     * LeakSanitizer needs full stacks to see whose it is (tests/lsan-openmpi.supp names only Open MPI's). */
    char cwd[2048], opts[2300];
    if (getcwd(cwd, sizeof cwd)) {
        snprintf(opts, sizeof opts, "suppressions=%s/tests/lsan-openmpi.supp:fast_unwind_on_malloc=0", cwd);
        setenv("LSAN_OPTIONS", opts, 1);
    }
    tmp = test_tmpdir_new();
    return tmp ? 0 : 1;
}

static int suite_clean(void) {
    test_tmpdir_remove(tmp);
    return 0;
}

/* tiny-base's float model trained in one process: the QLoRA runs' base. */
static bool make_base(void) {
    if (base_set[0]) return true;
    char *out = path_in(tmp, "base");
    bool ok = one_run("tests/configs/tiny-base.yaml", out, (const char *[]){"--set", "train.steps=20", NULL}) == 0;
    if (ok) snprintf(base_set, sizeof base_set, "model.init_from=%s/final.h5", out);
    free(out);
    return ok;
}

#define FLOAT_CFG "tests/configs/tiny-base.yaml"
#define QLORA_CFG "tests/configs/tiny-qlora.yaml"
#define QAT_CFG "tests/configs/tiny-qat.yaml"
#define QT_CFG "tests/configs/tiny-qt.yaml"
#define RES_CFG "tests/configs/tiny-res.yaml"
#define BN_CFG "tests/configs/tiny-bn.yaml"
#define AE_CFG "tests/configs/tiny-ae.yaml"

/* 2 and 3 ranks against one process: the parameters within 1e-5 (per-tensor relative L2 norm) after 20 steps, the
 * test loss within 1e-5 and the accuracy within one example; summary.json's world_size and bytes per step. */
static void test_mpi_matches_one_process(void) {
    if (!mpi_ready()) return;
    const char *steps[] = {"--set", "train.steps=20", NULL};
    char *one = path_in(tmp, "f1");
    CU_ASSERT_EQUAL_FATAL(one_run(FLOAT_CFG, one, steps), 0);
    for (int np = 2; np <= 3; np++) {
        char name[16];
        snprintf(name, sizeof name, "f%d", np);
        char *out = path_in(tmp, name);
        CU_ASSERT_EQUAL(mpi_run(np, FLOAT_CFG, out, steps, 120), 0);
        char *a = path_in(one, "final.h5"), *b = path_in(out, "final.h5");
        double d = ckpt_rel_diff(a, b, "params");
        if (!(d <= 1e-5)) fprintf(stderr, "\n  %d ranks: parameters differ from one process by %g\n", np, d);
        CU_ASSERT(d <= 1e-5);
        CU_ASSERT(ckpt_rel_diff(a, b, "optim") <= 1e-5);
        double l1 = summary_number(one, "test_loss"), ln = summary_number(out, "test_loss");
        CU_ASSERT(fabs(l1 - ln) <= 1e-5 * fabs(l1));
        double n_test = summary_number(one, "test_examples");
        CU_ASSERT(fabs(summary_number(one, "test_accuracy") - summary_number(out, "test_accuracy")) * n_test <= 1.01);
        CU_ASSERT_EQUAL(summary_number(out, "world_size"), np);
        CU_ASSERT_EQUAL(summary_number(one, "world_size"), 1);
        CU_ASSERT_EQUAL(summary_number(one, "allreduce_bytes_per_step"), 0);
        /* tiny-base: 50,618 trainable values; 2 ranks send each value once, 3 ranks 2 x a third (and 8 + np
           doubles of loss, counts and flags to each other rank) */
        double want = np == 2 ? 50618.0 * 4 + 1 * (5 + 2) * 8 : 2.0 * 2 * 16873 * 4 + 2 * (5 + 3) * 8;
        CU_ASSERT_EQUAL(summary_number(out, "allreduce_bytes_per_step"), want);
        free(a), free(b), free(out);
    }
    free(one);
}

/* The same run twice at 2 and at 3 ranks: the same bits (float; QLoRA, whose adapters' dropout each rank draws;
 * QAT, whose input statistics follow rank 0's; QT, whose gradient-rounding noise each rank draws; a residual
 * batch-norm CNN with dropout, whose running statistics follow rank 0's). */
static void test_mpi_reruns_identical(void) {
    if (!mpi_ready() || !make_base()) return;
    const char *fsteps[] = {"--set", "train.steps=12", NULL};
    const char *qset[] = {"--set", base_set, "--set", "train.steps=12", NULL};
    const char *qat[] = {"--set", base_set, "--set", "train.steps=12", NULL};
    struct { const char *cfg, *tag; const char *const *extra; int np; } runs[] = {
        {FLOAT_CFG, "rf", fsteps, 3}, {QLORA_CFG, "rq", qset, 2}, {QLORA_CFG, "rq", qset, 3},
        {QAT_CFG, "ra", qat, 2}, {QT_CFG, "rt", fsteps, 2}, {RES_CFG, "rr", fsteps, 3}};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char na[32], nb[32];
        snprintf(na, sizeof na, "%s%da", runs[i].tag, runs[i].np);
        snprintf(nb, sizeof nb, "%s%db", runs[i].tag, runs[i].np);
        char *a = path_in(tmp, na), *b = path_in(tmp, nb);
        CU_ASSERT_EQUAL(mpi_run(runs[i].np, runs[i].cfg, a, runs[i].extra, 120), 0);
        CU_ASSERT_EQUAL(mpi_run(runs[i].np, runs[i].cfg, b, runs[i].extra, 120), 0);
        assert_same_run(a, b);
        free(a), free(b);
    }
}

/* --stop-at-step and --resume auto at the same world size: the uninterrupted run's bits (QLoRA at 2 ranks, float
 * at 3). */
static void test_mpi_resume_exact(void) {
    if (!mpi_ready() || !make_base()) return;
    const char *qset[] = {"--set", base_set, "--set", "train.steps=12", NULL};
    const char *qstop[] = {"--set", base_set, "--set", "train.steps=12", "--stop-at-step", "5", NULL};
    const char *qres[] = {"--set", base_set, "--set", "train.steps=12", "--resume", "auto", NULL};
    const char *fset[] = {"--set", "train.steps=12", NULL};
    const char *fstop[] = {"--set", "train.steps=12", "--stop-at-step", "7", NULL};
    const char *fres[] = {"--set", "train.steps=12", "--resume", "auto", NULL};
    struct { const char *cfg; const char *const *full; const char *const *stop; const char *const *res; int np;
             const char *tag; } runs[] = {
        {QLORA_CFG, qset, qstop, qres, 2, "xq"}, {FLOAT_CFG, fset, fstop, fres, 3, "xf"},
        {QT_CFG, fset, fstop, fres, 2, "xt"}, {RES_CFG, fset, fstop, fres, 2, "xr"}};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char na[32], nb[32];
        snprintf(na, sizeof na, "%s-full", runs[i].tag);
        snprintf(nb, sizeof nb, "%s-resumed", runs[i].tag);
        char *a = path_in(tmp, na), *b = path_in(tmp, nb);
        CU_ASSERT_EQUAL(mpi_run(runs[i].np, runs[i].cfg, a, runs[i].full, 120), 0);
        CU_ASSERT_EQUAL(mpi_run(runs[i].np, runs[i].cfg, b, runs[i].stop, 120), 0);
        CU_ASSERT_FALSE(test_file_exists(b, "final.h5"));
        CU_ASSERT_EQUAL(mpi_run(runs[i].np, runs[i].cfg, b, runs[i].res, 120), 0);
        assert_same_run(a, b);
        free(a), free(b);
    }
}

/* Stopped at 2 ranks, resumed at 3: a warning, the same global batches (the run ends at its step count having
 * seen steps x batch examples), and without dropout the uninterrupted 2-rank run's result within rounding. */
static void test_mpi_resume_other_world(void) {
    if (!mpi_ready()) return;
    const char *full[] = {"--set", "train.steps=20", NULL};
    const char *stop[] = {"--set", "train.steps=20", "--stop-at-step", "8", NULL};
    const char *res[] = {"--set", "train.steps=20", "--resume", "auto", NULL};
    char *a = path_in(tmp, "w-full"), *b = path_in(tmp, "w-2to3"), log[1100];
    CU_ASSERT_EQUAL(mpi_run(2, FLOAT_CFG, a, full, 120), 0);
    CU_ASSERT_EQUAL(mpi_run(2, FLOAT_CFG, b, stop, 120), 0);
    CU_ASSERT_EQUAL(mpi_run(3, FLOAT_CFG, b, res, 120), 0);
    snprintf(log, sizeof log, "%s.log", b);
    CU_ASSERT(log_has(log, "was written by a run on 2 ranks, this one runs on 3"));
    CU_ASSERT_EQUAL(summary_number(b, "world_size"), 3);
    CU_ASSERT_EQUAL(summary_number(b, "steps"), 20);
    char *fa = path_in(a, "final.h5"), *fb = path_in(b, "final.h5");
    CU_ASSERT(ckpt_rel_diff(fa, fb, "params") <= 1e-5);
    free(fa), free(fb), free(a), free(b);
}

/* Batch norm with train.sync_bn: 2 and 3 ranks normalise with the global batch's statistics, so they match one
 * process within rounding (parameters and running statistics); with each rank's own statistics they do not. */
static void test_mpi_sync_bn(void) {
    if (!mpi_ready()) return;
    const char *steps[] = {"--set", "train.steps=20", NULL};
    const char *sync[] = {"--set", "train.steps=20", "--set", "train.sync_bn=true", NULL};
    char *one = path_in(tmp, "bn1"), *a = path_in(one, "final.h5");
    CU_ASSERT_EQUAL_FATAL(one_run(BN_CFG, one, sync), 0); /* no effect in one process */
    for (int np = 2; np <= 3; np++) {
        char name[16];
        snprintf(name, sizeof name, "bnsync%d", np);
        char *out = path_in(tmp, name), *b = path_in(out, "final.h5");
        CU_ASSERT_EQUAL(mpi_run(np, BN_CFG, out, sync, 120), 0);
        double dp = ckpt_rel_diff(a, b, "params"), db = ckpt_rel_diff(a, b, "buffers");
        if (!(dp <= 1e-5 && db <= 1e-5)) fprintf(stderr, "\n  sync_bn, %d ranks: params %g, buffers %g\n", np, dp, db);
        CU_ASSERT(dp <= 1e-5);
        CU_ASSERT(db <= 1e-5);
        free(out), free(b);
    }
    char *local = path_in(tmp, "bnlocal2"), *c = path_in(local, "final.h5");
    CU_ASSERT_EQUAL(mpi_run(2, BN_CFG, local, steps, 120), 0);
    CU_ASSERT(ckpt_rel_diff(a, c, "params") > 1e-3);
    free(local), free(c), free(one), free(a);
}

/* The pid of rank `rank` of the job that mpirun `job` runs on this machine (its children, by their
 * OMPI_COMM_WORLD_RANK: no other process is looked at), or -1. */
static pid_t rank_pid(pid_t job, int rank) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "for p in $(pgrep -P %ld); do tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null | "
             "grep -qx OMPI_COMM_WORLD_RANK=%d && echo $p; done", (long)job, rank);
    FILE *f = popen(cmd, "r");
    long pid = -1;
    if (f) {
        if (fscanf(f, "%ld", &pid) != 1) pid = -1;
        pclose(f);
    }
    return (pid_t)pid;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The newest ckpt-<step>.h5 in dir: its step, or -1. */
static long newest_ckpt_step(const char *dir) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "ls '%s' 2>/dev/null | sed -n 's/^ckpt-0*\\([0-9][0-9]*\\)\\.h5$/\\1/p' | sort -n | "
             "tail -1", dir);
    FILE *f = popen(cmd, "r");
    long step = -1;
    if (f) {
        if (fscanf(f, "%ld", &step) != 1) step = -1;
        pclose(f);
    }
    return step;
}

/* Waits (at most timeout_s) until file `path` holds `what`. */
static bool wait_for_text(const char *path, const char *what, double timeout_s) {
    double t0 = now_s();
    for (;;) {
        size_t n = 0;
        char *text = test_file_read(path, &n);
        bool ok = text && strstr(text, what);
        free(text);
        if (ok) return true;
        if (now_s() - t0 > timeout_s) return false;
        usleep(20000);
    }
}

/* A long run of np ranks in the background, logging every 20 steps (so a test sees it is in its step loop). */
static pid_t start_long_run(const char *launcher, int np, const char *out, const char *log, const char *const *extra,
                            int kill_after_s) {
    static char npv[16], outset[1024], after[16];
    snprintf(npv, sizeof npv, "%d", np);
    snprintf(after, sizeof after, "%d", kill_after_s);
    snprintf(outset, sizeof outset, "run.out_dir=%s", out);
    const char *argv[40] = {launcher, "--allow-run-as-root", "--oversubscribe", "--mca", "odls_base_sigkill_timeout",
                            after, "-np", npv, mpi_bin(), "--config", FLOAT_CFG, "--set", outset, "--set",
                            "run.threads=1", "--set", "train.steps=200000", "--set", "train.log_every=20"};
    int n = 19;
    for (int i = 0; extra && extra[i] && n < 38; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    return test_proc_spawn(log, argv, -1, 0);
}

/* A rank killed (SIGKILL) in the middle of a run: the job ends within 30 s with a message naming the rank, and
 * --resume auto (at 2 ranks) continues from the newest checkpoint. */
static void test_mpi_killed_rank(void) {
    if (!mpi_ready()) return;
    char *out = path_in(tmp, "killed"), log[1100];
    snprintf(log, sizeof log, "%s.log", out);
    pid_t job = start_long_run("mpirun", 3, out, log, (const char *[]){"--set", "train.checkpoint_every=20", NULL}, 1);
    CU_ASSERT_FATAL(job > 0);
    char *ck = path_in(out, "ckpt-00000020.h5");
    double t0 = now_s();
    while (access(ck, F_OK) != 0 && now_s() - t0 < 60) usleep(20000);
    pid_t victim = rank_pid(job, 1);
    CU_ASSERT(victim > 0);
    if (victim > 0) kill(victim, SIGKILL);
    double t1 = now_s();
    int status = test_proc_wait(job, 60);
    double took = now_s() - t1;
    CU_ASSERT(status != -1 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0));
    CU_ASSERT(took < 30);
    if (took >= 30) fprintf(stderr, "\n  the job took %.1f s to end after rank 1 was killed\n", took);
    CU_ASSERT(log_has(log, "rank 1"));
    long saved = newest_ckpt_step(out);
    CU_ASSERT(saved >= 20);
    char stop[32], want[48];
    snprintf(stop, sizeof stop, "%ld", saved + 3);
    snprintf(want, sizeof want, "ckpt-%08ld.h5", saved + 3);
    const char *more[] = {"--set", "train.steps=200000", "--set", "train.checkpoint_every=20", "--resume", "auto",
                          "--stop-at-step", stop, NULL};
    CU_ASSERT_EQUAL(mpi_run(2, FLOAT_CFG, out, more, 120), 0);
    CU_ASSERT(test_file_exists(out, want));
    free(ck), free(out);
}

/* SIGUSR1 to mpirun (which passes it on to every rank as it is): every rank finishes its step, rank 0 writes the
 * checkpoint, all exit 130 and so does mpirun; run on to a later step, the resumed run has the bits of a run that
 * was never stopped. */
static void test_mpi_signal_stop(void) {
    if (!mpi_ready()) return;
    char *out = path_in(tmp, "usr1"), *ref = path_in(tmp, "usr1-ref"), log[1100];
    snprintf(log, sizeof log, "%s.log", out);
    pid_t job = start_long_run("mpirun", 2, out, log, NULL, 1);
    CU_ASSERT_FATAL(job > 0);
    CU_ASSERT(wait_for_text(log, "step:20 ", 60));
    kill(job, SIGUSR1);
    int status = test_proc_wait(job, 60);
    CU_ASSERT(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 130);
    CU_ASSERT(log_has(log, "interrupted: SIGUSR1 at step:"));
    CU_ASSERT(log_has(log, " comm:")); /* the step line's share of time in the ranks' sums */
    long saved = newest_ckpt_step(out);
    CU_ASSERT_FATAL(saved >= 20);
    char stop[32], name[48];
    snprintf(stop, sizeof stop, "%ld", saved + 5);
    snprintf(name, sizeof name, "ckpt-%08ld.h5", saved + 5);
    const char *more[] = {"--set", "train.steps=200000", "--resume", "auto", "--stop-at-step", stop, NULL};
    const char *straight[] = {"--set", "train.steps=200000", "--stop-at-step", stop, NULL};
    CU_ASSERT_EQUAL(mpi_run(2, FLOAT_CFG, out, more, 120), 0);
    CU_ASSERT_EQUAL(mpi_run(2, FLOAT_CFG, ref, straight, 120), 0);
    CU_ASSERT(same_bits(out, ref, name, "params"));
    CU_ASSERT(same_bits(out, ref, name, "optim"));
    /* Ctrl-C (SIGINT) and SIGTERM to scripts/qtrain-mpirun, which hands mpirun SIGUSR1 for them (mpirun itself
     * would end the job on its own terms): the same clean stop, exit 130 */
    const int sigs[2] = {SIGINT, SIGTERM};
    for (int k = 0; k < 2; k++) {
        char name2[32], log2[1100];
        snprintf(name2, sizeof name2, "wrapped-%d", sigs[k]);
        char *out2 = path_in(tmp, name2);
        snprintf(log2, sizeof log2, "%s.log", out2);
        pid_t job2 = start_long_run("scripts/qtrain-mpirun", 2, out2, log2, NULL, 1);
        CU_ASSERT_FATAL(job2 > 0);
        CU_ASSERT(wait_for_text(log2, "step:20 ", 60));
        kill(job2, sigs[k]);
        status = test_proc_wait(job2, 60);
        CU_ASSERT(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 130);
        CU_ASSERT(log_has(log2, "interrupted: SIGUSR1 at step:"));
        CU_ASSERT(newest_ckpt_step(out2) >= 20);
        free(out2);
    }
    free(out), free(ref);
}

/* An autoencoder (mse against the input, per-example scores split over the ranks, the anomaly AUC) with a
 * batchnorm1d under train.sync_bn at 3 ranks: one process's test_mse, test_mae and AUC within 1e-5. With SGD:
 * the bias of the dense layer before the batch norm has no true gradient, only rounding noise, which AdamW would
 * turn into full-size steps in either run (docs/DISTRIBUTED.md). */
static void test_mpi_autoencoder(void) {
    if (!mpi_ready()) return;
    const char *sync[] = {"--set", "train.steps=20", "--set", "train.sync_bn=true", "--set",
                          "train.optimizer.name=sgd", "--set", "train.optimizer.lr=0.1", NULL};
    char *one = path_in(tmp, "ae1"), *three = path_in(tmp, "ae3");
    CU_ASSERT_EQUAL_FATAL(one_run(AE_CFG, one, sync), 0);
    CU_ASSERT_EQUAL(mpi_run(3, AE_CFG, three, sync, 120), 0);
    const char *keys[] = {"test_mse", "test_mae", "test_auc"};
    for (int k = 0; k < 3; k++) {
        double a = summary_number(one, keys[k]), b = summary_number(three, keys[k]);
        if (!(fabs(a - b) <= 1e-5 * fabs(a))) fprintf(stderr, "\n  %s: one process %.9g, 3 ranks %.9g\n", keys[k], a, b);
        CU_ASSERT(isfinite(a) && fabs(a - b) <= 1e-5 * fabs(a));
    }
    free(one), free(three);
}

/* What every rank sees alike is said once, by rank 0: a loss that is not finite (exit 1). The checkpoint records
 * the world size; a finished run resumed at another world size has nothing to do (exit 0). */
static void test_mpi_said_once(void) {
    if (!mpi_ready()) return;
    char *out = path_in(tmp, "nan"), log[1100];
    snprintf(log, sizeof log, "%s.log", out);
    const char *huge[] = {"--set", "train.steps=20", "--set", "train.optimizer.lr=1e30", NULL};
    CU_ASSERT_EQUAL(mpi_run(3, FLOAT_CFG, out, huge, 120), 1);
    size_t n = 0;
    char *text = test_file_read(log, &n);
    const char *first = text ? strstr(text, "qtrain: error: ") : NULL;
    CU_ASSERT(first && strstr(first, "finite") && !strstr(first + 1, "qtrain: error: "));
    CU_ASSERT(text && !strstr(text, "MPI_ABORT"));
    free(text);
    char *done = path_in(tmp, "done3");
    const char *steps[] = {"--set", "train.steps=6", NULL};
    const char *again[] = {"--set", "train.steps=6", "--resume", "auto", NULL};
    CU_ASSERT_EQUAL(mpi_run(3, FLOAT_CFG, done, steps, 120), 0);
    char *final = path_in(done, "final.h5");
    H5ioFile f;
    QtError e = {0};
    int64_t world = 0;
    CU_ASSERT(h5io_open(&f, final, &e) == QT_OK && h5io_attr_read_i64(&f, "train", "world_size", &world, &e) == QT_OK);
    h5io_close(&f, &e);
    CU_ASSERT_EQUAL(world, 3);
    CU_ASSERT_EQUAL(mpi_run(2, FLOAT_CFG, done, again, 120), 0);
    snprintf(log, sizeof log, "%s.log", done);
    CU_ASSERT(log_has(log, "already complete"));
    free(final), free(done), free(out);
}

/* A rank > 0 that cannot set up (no TMPDIR for rank 0's state): every rank exits 1, the failing ranks say so, and a
 * fresh run leaves no out_dir behind. */
static void test_mpi_setup_failure(void) {
    if (!mpi_ready()) return;
    char *out = path_in(tmp, "nosetup"), log[1100];
    snprintf(log, sizeof log, "%s.log", out);
    /* mpirun makes TMPDIR for its session files (as root, anywhere): it keeps them in /tmp here, and TMPDIR is a
       directory nobody can make */
    const char *old = getenv("TMPDIR");
    char *keep = old ? strdup(old) : NULL;
    setenv("TMPDIR", "/proc/qtrain-test-none", 1);
    setenv("OMPI_MCA_orte_tmpdir_base", "/tmp", 1);
    int st = mpi_run(2, FLOAT_CFG, out, (const char *[]){"--set", "train.steps=6", NULL}, 120);
    if (keep) setenv("TMPDIR", keep, 1);
    else unsetenv("TMPDIR");
    unsetenv("OMPI_MCA_orte_tmpdir_base");
    free(keep);
    CU_ASSERT_EQUAL(st, 1);
    CU_ASSERT(log_has(log, "qtrain: error: rank 1 of 2: cannot create a temporary file"));
    CU_ASSERT(access(out, F_OK) != 0);
    free(out);
}

/* Refusals: a batch too small for the ranks (a config error, said once by rank 0, exit 2, no MPI abort); a command
 * other than training under mpirun. */
static void test_mpi_refusals(void) {
    if (!mpi_ready()) return;
    char *out = path_in(tmp, "refused"), log[1100];
    snprintf(log, sizeof log, "%s.log", out);
    CU_ASSERT_EQUAL(mpi_run(3, FLOAT_CFG, out, (const char *[]){"--set", "train.batch_size=2", NULL}, 60), 2);
    CU_ASSERT(log_has(log, "train.batch_size 2 over 3 ranks leaves a rank without examples"));
    size_t n = 0;
    char *text = test_file_read(log, &n);
    CU_ASSERT(text && !strstr(text, "MPI_ABORT"));
    const char *first = text ? strstr(text, "leaves a rank") : NULL;
    CU_ASSERT(first && !strstr(first + 1, "leaves a rank")); /* once */
    free(text);
    char *ae = path_in(tmp, "ae-bn1d"), aelog[1100];
    snprintf(aelog, sizeof aelog, "%s.log", ae);
    CU_ASSERT_EQUAL(mpi_run(3, AE_CFG, ae, (const char *[]){"--set", "train.batch_size=5", NULL}, 60), 2);
    CU_ASSERT(log_has(aelog, "batchnorm1d 'bn' normalises over each rank's part of the batch"));
    /* another command than training under mpirun */
    char evlog[1100];
    snprintf(evlog, sizeof evlog, "%s/eval-under-mpirun.log", tmp);
    const char *argv[] = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", mpi_bin(), "eval",
                          "--checkpoint", "none.h5", NULL};
    pid_t pid = test_proc_spawn(evlog, argv, -1, 0);
    int status = pid > 0 ? test_proc_wait(pid, 60) : -1;
    CU_ASSERT(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 2);
    CU_ASSERT(log_has(evlog, "under mpirun only training runs on several ranks"));
    /* build/qtrain (no MPI) under mpirun: refused before any rank trains alone */
    char plog[1100];
    snprintf(plog, sizeof plog, "%s/plain-under-mpirun.log", tmp);
    const char *plain[] = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", test_qtrain_bin(),
                           "--config", FLOAT_CFG, "--set", "run.out_dir=/nonexistent-never-made", NULL};
    pid = test_proc_spawn(plog, plain, -1, 0);
    status = pid > 0 ? test_proc_wait(pid, 60) : -1;
    CU_ASSERT(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 2);
    CU_ASSERT(log_has(plog, "this qtrain is built without MPI"));
    free(ae), free(out);
}

int register_mpi_suite(void) {
    CU_pSuite s = CU_add_suite("mpi", suite_init, suite_clean);
    if (!s) return -1;
    return CU_add_test(s, "2 and 3 ranks match one process within 1e-5; summary world_size, bytes per step",
                       test_mpi_matches_one_process) &&
                   CU_add_test(s, "reruns at 2 and 3 ranks are bit-identical (float, QLoRA, QAT, QT, residual BN)", test_mpi_reruns_identical) &&
                   CU_add_test(s, "stop + resume at the same world size is bit-exact", test_mpi_resume_exact) &&
                   CU_add_test(s, "resume at another world size continues, with a warning",
                               test_mpi_resume_other_world) &&
                   CU_add_test(s, "train.sync_bn: 2 and 3 ranks match one process; per-rank statistics do not",
                               test_mpi_sync_bn) &&
                   CU_add_test(s, "a killed rank ends the job within 30 s, naming it; resume works",
                               test_mpi_killed_rank) &&
                   CU_add_test(s, "SIGUSR1 to mpirun, SIGINT/SIGTERM to qtrain-mpirun: a step, a checkpoint, exit 130",
                               test_mpi_signal_stop) &&
                   CU_add_test(s, "an autoencoder with sync_bn: test mse, mae and AUC at 3 ranks = one process",
                               test_mpi_autoencoder) &&
                   CU_add_test(s, "an error every rank sees is said once; world_size stored; a finished run resumed",
                               test_mpi_said_once) &&
                   CU_add_test(s, "a rank that cannot set up: every rank exits 1, no out_dir left",
                               test_mpi_setup_failure) &&
                   CU_add_test(s, "refusals: a batch too small for the ranks or a batchnorm1d, eval under mpirun",
                               test_mpi_refusals)
               ? 0
               : -1;
}
