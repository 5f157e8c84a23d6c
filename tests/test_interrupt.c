/* test_interrupt.c - interruptions lose nothing: the qtrain binary
 * (QTRAIN_BIN) stopped by SIGINT/SIGTERM, by a second signal, and killed
 * with SIGKILL at random moments (some inside checkpoint writes), then
 * resumed with --resume auto, ends bit for bit where an uninterrupted run
 * of the same config ends. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/rng.h"
#include "test_proc.h"
#include "test_util.h"

#define CONFIG "tests/configs/tiny-mlp.yaml"
#define RUN_TIMEOUT_S 120.0
#define KILLS 10

static char *tmp_root;

static int suite_init(void) { return (tmp_root = test_tmpdir_new()) ? 0 : -1; }
static int suite_clean(void) { return test_tmpdir_remove(tmp_root) ? 0 : -1; }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The arguments of a training run of CONFIG into dir/name for `steps` steps
 * (checkpoint every 7: not a multiple of the logging or eval period);
 * `extra` (NULL-terminated, may be NULL) follows. Strings live in `a`. */
typedef struct {
    char out[512], steps[64], ckpt[64];
    const char *argv[24];
} RunArgs;

static const char *const *run_args(RunArgs *a, const char *dir, int steps, int ckpt_every, const char *const *extra) {
    snprintf(a->out, sizeof a->out, "run.out_dir=%s", dir);
    snprintf(a->steps, sizeof a->steps, "train.steps=%d", steps);
    snprintf(a->ckpt, sizeof a->ckpt, "train.checkpoint_every=%d", ckpt_every);
    const char *base[] = {"--config", CONFIG, "--set", a->out, "--set", a->steps, "--set", a->ckpt,
                          "--set", "train.eval_every=50", "--set", "train.log_every=20", "--set", "train.keep_last=2"};
    int n = 0;
    for (size_t i = 0; i < sizeof base / sizeof *base; i++) a->argv[n++] = base[i];
    for (int i = 0; extra && extra[i] && n < 23; i++) a->argv[n++] = extra[i];
    a->argv[n] = NULL;
    return a->argv;
}

/* An uninterrupted run's final.h5 (made once per step count). */
static const char *reference_final(int steps, double *wall) {
    static char path[2][600];
    static int made_steps[2];
    static double made_wall[2];
    for (int i = 0; i < 2; i++)
        if (made_steps[i] == steps) {
            if (wall) *wall = made_wall[i];
            return path[i];
        }
    int slot = made_steps[0] ? 1 : 0;
    char dir[512], log[600];
    snprintf(dir, sizeof dir, "%s/reference-%d", tmp_root, steps);
    snprintf(log, sizeof log, "%s.log", dir);
    RunArgs a;
    const char *quiet[] = {"--quiet", NULL};
    double t0 = now_s();
    if (test_proc_run(log, run_args(&a, dir, steps, 7, quiet), RUN_TIMEOUT_S) != 0) return NULL;
    made_wall[slot] = now_s() - t0;
    made_steps[slot] = steps;
    snprintf(path[slot], sizeof path[slot], "%s/final.h5", dir);
    if (wall) *wall = made_wall[slot];
    return path[slot];
}

/* Waits until `log` holds `what` (the child is running), at most timeout_s. */
static bool wait_for_text(const char *log, const char *what, double timeout_s) {
    double t0 = now_s();
    struct timespec nap = {0, 1000000};
    while (now_s() - t0 < timeout_s) {
        char *text = test_file_read(log, NULL);
        bool found = text && strstr(text, what);
        free(text);
        if (found) return true;
        nanosleep(&nap, NULL);
    }
    return false;
}

static void show_log(const char *log) {
    char *text = test_file_read(log, NULL);
    fprintf(stderr, "\n----- %s -----\n%s\n-----\n", log, text ? text : "(cannot read)");
    free(text);
}

/* The run resumed to its end matches the uninterrupted run: parameters and
 * optimizer state, bit for bit. */
static void assert_same_as_reference(const char *dir, int steps) {
    const char *ref = reference_final(steps, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(ref);
    char final[600];
    snprintf(final, sizeof final, "%s/final.h5", dir);
    CU_ASSERT(test_ckpt_group_within(ref, final, "params") && test_ckpt_group_within(final, ref, "params"));
    CU_ASSERT(test_ckpt_group_within(ref, final, "optim") && test_ckpt_group_within(final, ref, "optim"));
    CU_ASSERT(test_file_exists(dir, "summary.json"));
}

/* SIGINT or SIGTERM mid-run: the step finishes, a checkpoint of it is
 * written, exit status 130; --resume auto then ends where an uninterrupted
 * run ends. */
static void check_stop_signal(int sig, const char *name) {
    enum { STEPS = 3000 };
    unsigned failures = CU_get_number_of_failures();
    char dir[512], log[600], want[64];
    snprintf(dir, sizeof dir, "%s/%s", tmp_root, name);
    snprintf(log, sizeof log, "%s.log", dir);
    RunArgs a;
    pid_t pid = test_proc_start(log, run_args(&a, dir, STEPS, 7, NULL));
    CU_ASSERT_FATAL(pid > 0);
    bool running = wait_for_text(log, "step:100 ", RUN_TIMEOUT_S);
    kill(pid, sig);
    int status = test_proc_wait(pid, RUN_TIMEOUT_S);
    CU_ASSERT(running);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 130);
    snprintf(want, sizeof want, "interrupted: %s at step:", name);
    char *text = test_file_read(log, NULL);
    const char *at = text ? strstr(text, want) : NULL;
    CU_ASSERT_PTR_NOT_NULL(at);
    long step = at ? strtol(at + strlen(want), NULL, 10) : -1;
    CU_ASSERT(step >= 100 && step < STEPS); /* else the signal came after the end: nothing was tested */
    free(text);
    char ckpt[64];
    snprintf(ckpt, sizeof ckpt, "ckpt-%08ld.h5", step);
    CU_ASSERT(test_file_exists(dir, ckpt));
    CU_ASSERT(!test_file_exists(dir, "final.h5"));
    const char *resume[] = {"--resume", "auto", "--quiet", NULL};
    CU_ASSERT_EQUAL(test_proc_run(log, run_args(&a, dir, STEPS, 7, resume), RUN_TIMEOUT_S), 0);
    assert_same_as_reference(dir, STEPS);
    if (CU_get_number_of_failures() > failures) show_log(log);
}

static void test_sigint_stops_with_checkpoint(void) { check_stop_signal(SIGINT, "SIGINT"); }
static void test_sigterm_stops_with_checkpoint(void) { check_stop_signal(SIGTERM, "SIGTERM"); }

/* A second signal exits at once: no checkpoint is written. Both signals are
 * queued while the child is stopped (two different ones, as a second SIGINT
 * would merge with the first), so both land within the same step. */
static void test_second_signal_exits_at_once(void) {
    char dir[512], log[600];
    snprintf(dir, sizeof dir, "%s/twice", tmp_root);
    snprintf(log, sizeof log, "%s.log", dir);
    RunArgs a;
    pid_t pid = test_proc_start(log, run_args(&a, dir, 3000, 0, NULL)); /* checkpoint_every 0: none periodic */
    CU_ASSERT_FATAL(pid > 0);
    bool running = wait_for_text(log, "step:100 ", RUN_TIMEOUT_S);
    kill(pid, SIGSTOP);
    kill(pid, SIGINT);
    kill(pid, SIGTERM);
    kill(pid, SIGCONT);
    int status = test_proc_wait(pid, RUN_TIMEOUT_S);
    CU_ASSERT(running);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 130);
    char *text = test_file_read(log, NULL);
    CU_ASSERT(text && strstr(text, "second stop signal: exiting now"));
    CU_ASSERT(text && !strstr(text, "interrupted:"));
    free(text);
    CU_ASSERT(!test_file_exists(dir, "last.h5"));
    CU_ASSERT(!test_file_exists(dir, "final.h5"));
}

/* A run stopped after its last step but before its final outputs (a signal
 * in the last step, a crash in the final save) is not complete: the resume
 * runs the final evaluation and writes final.h5 and summary.json. */
static void test_stop_after_last_step_finishes_on_resume(void) {
    char dir[512], log[600];
    snprintf(dir, sizeof dir, "%s/at-end", tmp_root);
    snprintf(log, sizeof log, "%s.log", dir);
    RunArgs a;
    const char *quiet[] = {"--quiet", NULL}, *resume[] = {"--resume", "auto", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, run_args(&a, dir, 40, 7, quiet), RUN_TIMEOUT_S), 0);
    char *summary = test_path_join(dir, "summary.json"), *final = test_path_join(dir, "final.h5");
    CU_ASSERT(unlink(summary) == 0 && unlink(final) == 0); /* last.h5, a link to final.h5, stays */
    CU_ASSERT_EQUAL(test_proc_run(log, run_args(&a, dir, 40, 7, resume), RUN_TIMEOUT_S), 0);
    assert_same_as_reference(dir, 40);
    char *text = test_file_read(log, NULL);
    const char *second = text ? strstr(text, "test_accuracy:") : NULL;
    CU_ASSERT(second && strstr(second + 1, "test_accuracy:")); /* evaluated again, not "already complete" */
    free(text), free(summary), free(final);
}

static void assert_same_metrics(const char *dir, const char *ref_dir) {
    char *got = test_metrics_rows(dir), *want = test_metrics_rows(ref_dir);
    CU_ASSERT_PTR_NOT_NULL(got);
    CU_ASSERT_PTR_NOT_NULL(want);
    CU_ASSERT(got && want && strcmp(got, want) == 0);
    if (got && want && strcmp(got, want) != 0)
        fprintf(stderr, "\n----- %s/metrics.csv -----\n%s\n----- %s/metrics.csv -----\n%s\n", dir, got, ref_dir,
                want);
    free(got), free(want);
}

/* A run stopped at an evaluation step (eval_every 50, stopped at 100)
 * whose evaluation rows are missing, as a stop signal landing in that step
 * used to leave them: the resume runs the evaluation again, so metrics.csv
 * ends row for row as an uninterrupted run's. */
static void test_eval_step_interrupted_metrics_complete(void) {
    enum { STEPS = 160 };
    char dir[512], ref[512], log[600];
    snprintf(dir, sizeof dir, "%s/eval-stop", tmp_root);
    snprintf(ref, sizeof ref, "%s/eval-ref", tmp_root);
    snprintf(log, sizeof log, "%s.log", dir);
    RunArgs a;
    const char *quiet[] = {"--quiet", NULL}, *stop[] = {"--stop-at-step", "100", "--quiet", NULL};
    const char *resume[] = {"--resume", "auto", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, run_args(&a, ref, STEPS, 7, quiet), RUN_TIMEOUT_S), 0);
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, run_args(&a, dir, STEPS, 7, stop), RUN_TIMEOUT_S), 0);
    char *path = test_path_join(dir, "metrics.csv"), *text = test_file_read(path, NULL);
    CU_ASSERT_FATAL(text && strstr(text, "\ntest,100,")); /* tiny-mlp has no validation split */
    FILE *f = fopen(path, "w");
    CU_ASSERT_FATAL(f != NULL);
    for (char *line = text, *next; line && *line; line = next) { /* drop step 100's evaluation rows */
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        if (strncmp(line, "val,100,", 8) != 0 && strncmp(line, "test,100,", 9) != 0) fprintf(f, "%s\n", line);
    }
    fclose(f);
    CU_ASSERT_EQUAL(test_proc_run(log, run_args(&a, dir, STEPS, 7, resume), RUN_TIMEOUT_S), 0);
    assert_same_metrics(dir, ref);
    free(path), free(text);
}

/* SIGINT with an evaluation at every step: the signal lands in a step
 * whose evaluation is due (or in the evaluation itself); the evaluation
 * finishes before the stop, and after the resume metrics.csv is row for
 * row an uninterrupted run's. */
static void test_sigint_at_eval_step_keeps_metrics_row(void) {
    enum { STEPS = 400 };
    char dir[512], ref[512], log[600];
    snprintf(dir, sizeof dir, "%s/eval-sigint", tmp_root);
    snprintf(ref, sizeof ref, "%s/eval-sigint-ref", tmp_root);
    snprintf(log, sizeof log, "%s.log", dir);
    RunArgs a;
    const char *quiet[] = {"--quiet", "--set", "train.eval_every=1", NULL};
    const char *loud[] = {"--set", "train.eval_every=1", NULL};
    const char *resume[] = {"--resume", "auto", "--quiet", "--set", "train.eval_every=1", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, run_args(&a, ref, STEPS, 7, quiet), RUN_TIMEOUT_S), 0);
    pid_t pid = test_proc_start(log, run_args(&a, dir, STEPS, 7, loud));
    CU_ASSERT_FATAL(pid > 0);
    bool running = wait_for_text(log, "step:100 ", RUN_TIMEOUT_S);
    kill(pid, SIGINT);
    int status = test_proc_wait(pid, RUN_TIMEOUT_S);
    CU_ASSERT(running);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 130);
    CU_ASSERT(!test_file_exists(dir, "final.h5")); /* else the signal came after the end: nothing was tested */
    CU_ASSERT_EQUAL(test_proc_run(log, run_args(&a, dir, STEPS, 7, resume), RUN_TIMEOUT_S), 0);
    assert_same_metrics(dir, ref);
}

/* The first SIGTERM ends a run stuck before its first step: here reading
 * its training images from a FIFO that never delivers (as a hung file
 * system or library would). It used to only ask for a stop after the
 * current step, which never came. Opening the FIFO's write end succeeds
 * only once qtrain has it open for reading: loading data, after the
 * handlers are installed. */
static bool child_ended(pid_t pid);

static void test_sigterm_before_first_step_exits(void) {
    char data[512], log[600], set_dir[600], set_out[600];
    snprintf(data, sizeof data, "%s/fifo-data", tmp_root);
    snprintf(log, sizeof log, "%s/fifo.log", tmp_root);
    snprintf(set_dir, sizeof set_dir, "data.dir=%s", data);
    snprintf(set_out, sizeof set_out, "run.out_dir=%s/fifo-run", tmp_root);
    CU_ASSERT_FATAL(mkdir(data, 0777) == 0);
    char *images = test_path_join(data, "train-images-idx3-ubyte"), *labels = test_path_join(data, "train-labels-idx1-ubyte");
    CU_ASSERT_FATAL(mkfifo(images, 0600) == 0 && mkfifo(labels, 0600) == 0);
    const char *args[] = {"--config", CONFIG, "--set", set_dir, "--set", set_out, "--set", "data.storage=memory",
                          "--quiet", NULL};
    pid_t pid = test_proc_start(log, args);
    CU_ASSERT_FATAL(pid > 0);
    int w = -1;
    double t0 = now_s();
    struct timespec nap = {0, 1000000};
    while (w < 0 && now_s() - t0 < RUN_TIMEOUT_S && !child_ended(pid)) {
        w = open(images, O_WRONLY | O_NONBLOCK | O_CLOEXEC); /* ENXIO until a reader has it open */
        if (w < 0) nanosleep(&nap, NULL);
    }
    CU_ASSERT(w >= 0);
    kill(pid, SIGTERM);
    int status = test_proc_wait(pid, 60.0);
    if (w >= 0) close(w);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 130);
    char *text = test_file_read(log, NULL);
    CU_ASSERT(text && strstr(text, "qtrain: SIGTERM before the first step: exiting now; nothing to save"));
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 130)) show_log(log);
    free(text), free(images), free(labels);
}

/* Whether the child has ended (it is left for test_proc_wait to reap). */
static bool child_ended(pid_t pid) {
    siginfo_t info;
    memset(&info, 0, sizeof info);
    return waitid(P_PID, (id_t)pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid;
}

/* Waits for the creation of a checkpoint temp file ("*.h5.tmp.<pid>") in
 * the watched directory, skipping `skip` of them; false if none came before
 * the child ended or timeout_s passed. */
static bool wait_for_ckpt_write(int ino, pid_t pid, int skip, double timeout_s) {
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    double t0 = now_s();
    while (now_s() - t0 < timeout_s) {
        if (child_ended(pid)) return false;
        struct pollfd p = {.fd = ino, .events = POLLIN};
        if (poll(&p, 1, 5) <= 0) continue;
        ssize_t len = read(ino, buf, sizeof buf);
        for (ssize_t off = 0; len > 0 && off < len;) {
            const struct inotify_event *ev = (const void *)(buf + off);
            off += (ssize_t)(sizeof *ev + ev->len);
            if (ev->len && strstr(ev->name, ".h5.tmp.") && skip-- == 0) return true;
        }
    }
    return false;
}

static void spin_for(double seconds) {
    double t0 = now_s();
    while (now_s() - t0 < seconds) {
    }
}

/* One attempt: start (resuming), SIGKILL at a random moment: a random time
 * after the start, or (odd attempts) inside a random checkpoint write
 * (*in_write says whether one was caught). Returns 1 if the kill landed, 0
 * if the run ended first (status in *status), -1 on a failure to start. */
static int attempt_and_kill(const char *dir, const char *log, int steps, int attempt, Rng *rng, double max_delay_s,
                            int *status, bool *in_write) {
    *in_write = false;
    int ino = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (ino < 0 || inotify_add_watch(ino, dir, IN_CREATE) < 0) {
        fprintf(stderr, "\n  inotify on %s: %s\n", dir, strerror(errno));
        if (ino >= 0) close(ino);
        return -1;
    }
    RunArgs a;
    const char *resume[] = {"--resume", "auto", "--quiet", NULL};
    pid_t pid = test_proc_start(log, run_args(&a, dir, steps, 7, resume));
    if (pid < 0) {
        close(ino);
        return -1;
    }
    if (attempt % 2 == 1) {
        int skip = (int)(rng_below(rng, 3));
        if ((*in_write = wait_for_ckpt_write(ino, pid, skip, RUN_TIMEOUT_S)))
            spin_for(1e-6 * (double)rng_below(rng, 3000)); /* in the write, sync, rename or rotation */
    } else {
        double until = now_s() + max_delay_s * (double)(rng_below(rng, 1000)) / 1000.0;
        while (now_s() < until && !child_ended(pid)) spin_for(1e-4);
    }
    kill(pid, SIGKILL);
    close(ino);
    *status = test_proc_wait(pid, RUN_TIMEOUT_S);
    return WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL ? 1 : 0;
}

static bool dir_has_tmp(const char *dir) {
    DIR *d = opendir(dir);
    bool found = false;
    for (struct dirent *e; d && (e = readdir(d));) found |= strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return found;
}

/* SIGKILL at KILLS random moments, each followed by --resume auto; the
 * run's end matches an uninterrupted run bit for bit. QTRAIN_KILL_SEED
 * repeats a sequence of moments. */
static void test_sigkill_at_random_moments_then_resume(void) {
    enum { STEPS = 600 };
    unsigned failures = CU_get_number_of_failures();
    double wall = 0.0;
    CU_ASSERT_PTR_NOT_NULL_FATAL(reference_final(STEPS, &wall));
    uint64_t seed = getenv("QTRAIN_KILL_SEED") ? strtoull(getenv("QTRAIN_KILL_SEED"), NULL, 10)
                                               : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    Rng rng;
    rng_init(&rng, seed, 0);
    /* Each timed kill lands within a twelfth of a whole run, so ten of them
     * rarely reach the end; if a run does end first, it starts over in a new
     * directory with shorter delays. */
    double max_delay = wall / 12.0;
    char dir[512], log[600];
    int kills = 0, in_write = 0;
    for (int round = 0; round < 4 && kills < KILLS; round++, max_delay /= 2) {
        snprintf(dir, sizeof dir, "%s/killed-%d", tmp_root, round);
        snprintf(log, sizeof log, "%s.log", dir);
        CU_ASSERT_FATAL(mkdir(dir, 0777) == 0);
        kills = in_write = 0;
        for (int attempt = 0; kills < KILLS && attempt < 3 * KILLS; attempt++) {
            int status = 0;
            bool caught_write = false;
            int r = attempt_and_kill(dir, log, STEPS, attempt, &rng, max_delay, &status, &caught_write);
            CU_ASSERT_FATAL(r >= 0);
            if (r == 0) {
                /* not killed: it must have finished cleanly (a failed resume is the bug this looks for) */
                if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
                    fprintf(stderr, "\n  attempt %d (seed %llu) ended with status %#x\n", attempt,
                            (unsigned long long)seed, status);
                    show_log(log);
                    CU_FAIL_FATAL("a resumed run failed");
                }
                if (test_file_exists(dir, "summary.json")) break; /* the run ended: start over */
                continue;
            }
            kills++;
            in_write += caught_write;
        }
    }
    if (kills < KILLS) fprintf(stderr, "\n  only %d kills landed (seed %llu)\n", kills, (unsigned long long)seed);
    CU_ASSERT_EQUAL_FATAL(kills, KILLS);
    const char *resume[] = {"--resume", "auto", "--quiet", NULL};
    RunArgs a;
    int rc = test_proc_run(log, run_args(&a, dir, STEPS, 7, resume), RUN_TIMEOUT_S);
    CU_ASSERT_EQUAL(rc, 0);
    assert_same_as_reference(dir, STEPS);
    CU_ASSERT(in_write >= KILLS / 2 - 1); /* most odd attempts caught a checkpoint write */
    CU_ASSERT(!dir_has_tmp(dir)); /* the temp files of killed saves were removed by later saves */
    if (CU_get_number_of_failures() > failures) {
        fprintf(stderr, "\n  seed %llu (QTRAIN_KILL_SEED=%llu repeats it), %d kills inside writes\n",
                (unsigned long long)seed, (unsigned long long)seed, in_write);
        show_log(log);
    }
}

int register_interrupt_suite(void) {
    CU_pSuite s = CU_add_suite("interrupt", suite_init, suite_clean);
    if (!s) return -1;
    return !CU_add_test(s, "SIGINT: finish the step, checkpoint, exit 130, resume exactly",
                        test_sigint_stops_with_checkpoint) ||
           !CU_add_test(s, "SIGTERM: finish the step, checkpoint, exit 130, resume exactly",
                        test_sigterm_stops_with_checkpoint) ||
           !CU_add_test(s, "a second signal exits at once without a checkpoint", test_second_signal_exits_at_once) ||
           !CU_add_test(s, "stopped after the last step: the resume writes the final outputs",
                        test_stop_after_last_step_finishes_on_resume) ||
           !CU_add_test(s, "eval step interrupted: the resume rewrites its missing metrics rows",
                        test_eval_step_interrupted_metrics_complete) ||
           !CU_add_test(s, "SIGINT at an eval step: the evaluation finishes, metrics.csv matches",
                        test_sigint_at_eval_step_keeps_metrics_row) ||
           !CU_add_test(s, "SIGTERM before the first step (stuck loading data) exits at once",
                        test_sigterm_before_first_step_exits) ||
           !CU_add_test(s, "SIGKILL at 10 random moments (half inside checkpoint writes), resume: bit-identical",
                        test_sigkill_at_random_moments_then_resume);
}
