/* test_diskfull.c - the disk fills up while qtrain saves a checkpoint: the
 * run stops with exit status 1 and a message naming the file, the error and
 * what to do; no temp file stays behind; the previous checkpoint (last.h5,
 * the earlier ckpt-*.h5, a LoRA run's adapters.h5) still loads and holds
 * what an uninterrupted run saved at that step; and `--resume auto`, once
 * there is space again, finishes with the same parameters bit for bit.
 *
 * The disk is a tmpfs sized from an uninterrupted run's files, so that all
 * a run holds when the failing save starts fits and half of the file being
 * saved does not. Mounting it needs a mount namespace of our own (as root),
 * else a user namespace with one; the mount exists only there, so each
 * scenario runs in a forked child that mounts, runs qtrain as its children,
 * checks the files and reports through a pipe, and this process turns the
 * report into assertions. Where no namespace can be had the test is skipped,
 * saying why. The same is done for a full disk at metrics.csv, whose row cut
 * short must not survive the resume. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_proc.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "base/h5io.h"
#include "trainer/metrics.h"

#define CONFIG "tests/configs/tiny-mlp.yaml"
#define RUN_TIMEOUT_S 300.0 /* a sanitizer build is slow; a hung run is killed, never waited for */
#define EXIT_SKIP 77
#define PATH_CAP 1024

/* Where the disk fills up. */
typedef enum {
    FULL_AT_CKPT,     /* the second checkpoint does not fit */
    FULL_AT_ADAPTERS, /* it fits, and then adapters.h5 beside it does not */
    FULL_AT_METRICS,  /* after the first checkpoint metrics.csv needs a page more than there is */
} FullAt;

typedef struct {
    FullAt full_at;
    const char *extra[8];       /* --set values beyond out_dir and keep_last, NULL-terminated */
    int keep_last;
    bool lora;                  /* the run writes adapters.h5 after each checkpoint */
    const char *first_ckpt;     /* the first checkpoint: the disk is sized from it */
    const char *message;        /* how qtrain's message starts; %s: the out_dir */
    const char *after_failure;  /* the out_dir's files after the failed save, in name order */
    const char *after_resume;   /* ... and after the resumed run */
} Scenario;

/* The places of one scenario, all below a mkdtemp directory. ref and mnt
 * have names of the same length, so both runs store configs (run.out_dir)
 * of the same size and their files have the same sizes. */
typedef struct {
    char root[PATH_CAP];
    char ref[PATH_CAP];    /* the uninterrupted run's out_dir (a normal directory) */
    char mnt[PATH_CAP];    /* the tmpfs mount point */
    char out[PATH_CAP];    /* the run on the tmpfs */
    char eval[PATH_CAP];   /* <eval>.json: the `qtrain eval` runs' --out, off the tmpfs */
    char log[PATH_CAP];    /* the output of every qtrain run */
} Places;

/* ---- the child's report -------------------------------------------------------------------- */

/* Lines through the pipe: "fail <line> <message>", "skip <reason>", "note <text>". */
typedef struct {
    int fd;
    int fails;
} Report;

static void report_line(Report *r, const char *kind, int line, const char *fmt, va_list ap) {
    char msg[2048];
    int n = snprintf(msg, sizeof msg, "%s %d ", kind, line);
    vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
    for (size_t len = strlen(msg); len > 0 && msg[len - 1] == '\n';) msg[--len] = '\0';
    for (char *p = msg; *p; p++)
        if (*p == '\n') *p = '|';
    size_t len = strlen(msg);
    msg[len++] = '\n';
    for (size_t done = 0; done < len;) {
        ssize_t w = write(r->fd, msg + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        done += (size_t)w;
    }
}

__attribute__((format(printf, 3, 4))) static void report_fail(Report *r, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report_line(r, "fail", line, fmt, ap);
    va_end(ap);
    r->fails++;
}

__attribute__((format(printf, 2, 3))) static void report_note(Report *r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report_line(r, "note", 0, fmt, ap);
    va_end(ap);
}

__attribute__((format(printf, 2, 3))) static void report_skip(Report *r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report_line(r, "skip", 0, fmt, ap);
    va_end(ap);
}

#define EXPECT(r, cond, ...) ((cond) ? true : (report_fail((r), __LINE__, __VA_ARGS__), false))

/* ---- running qtrain ------------------------------------------------------------------------- */

typedef struct {
    const char *argv[40];
    int n;
    char sets[4][PATH_CAP + 32];
} Args;

static void args_add(Args *a, const char *s) {
    if (a->n < (int)(sizeof a->argv / sizeof a->argv[0]) - 1) a->argv[a->n++] = s;
    a->argv[a->n] = NULL;
}

/* The training command line of the scenario with out_dir and keep_last. */
static void args_train(Args *a, const Scenario *sc, const char *out_dir, int keep_last, bool resume) {
    a->n = 0;
    snprintf(a->sets[0], sizeof a->sets[0], "run.out_dir=%s", out_dir);
    snprintf(a->sets[1], sizeof a->sets[1], "train.keep_last=%d", keep_last);
    const char *fixed[] = {"--config", CONFIG, "--set", a->sets[0], "--set", a->sets[1]};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) args_add(a, fixed[i]);
    for (int i = 0; sc->extra[i]; i++) args_add(a, "--set"), args_add(a, sc->extra[i]);
    args_add(a, "--quiet");
    if (resume) args_add(a, "--resume"), args_add(a, "auto");
}

/* Runs qtrain with a fresh log; returns its exit status (-1: no normal exit)
 * and the log in *out (malloc'd, "" if unreadable). */
static int qtrain_run(const Places *p, const char *const *args, char **out) {
    unlink(p->log);
    int rc = test_proc_run(p->log, args, RUN_TIMEOUT_S);
    char *text = test_file_read(p->log, NULL);
    *out = text ? text : calloc(1, 1);
    return rc;
}

/* Runs qtrain and reports a failure unless it exits 0. */
static void expect_run_ok(Report *r, const Places *p, const char *what, const char *const *args) {
    char *log = NULL;
    int rc = qtrain_run(p, args, &log);
    EXPECT(r, rc == 0, "%s: exit status %d, expected 0; output: %s", what, rc, log ? log : "");
    free(log);
}

static void expect_loads(Report *r, const Places *p, const char *path) {
    char set[PATH_CAP + 32], what[PATH_CAP + 32];
    snprintf(set, sizeof set, "%s.json", p->eval); /* off the tmpfs: eval.json beside the checkpoint would not fit */
    snprintf(what, sizeof what, "qtrain eval %s", path);
    const char *args[] = {"eval", "--checkpoint", path, "--out", set, "--quiet", NULL};
    expect_run_ok(r, p, what, args);
}

/* ---- files ----------------------------------------------------------------------------------- */

static int name_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The names in dir, sorted and joined by spaces, into buf; false if dir cannot be read. */
static bool dir_listing(const char *dir, char *buf, size_t cap) {
    buf[0] = '\0';
    DIR *d = opendir(dir);
    if (!d) return false;
    char *names[64];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) names[n++] = strdup(e->d_name);
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], name_cmp);
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        if (names[i] && len < cap) len += (size_t)snprintf(buf + len, cap - len, "%s%s", i ? " " : "", names[i]);
        free(names[i]);
    }
    return true;
}

/* No "<name>.tmp.<pid>" in dir, and exactly the files `want`. */
static void expect_listing(Report *r, const char *dir, const char *want, const char *when) {
    char have[2048];
    if (!EXPECT(r, dir_listing(dir, have, sizeof have), "%s: cannot list %s: %s", when, dir, strerror(errno)))
        return;
    EXPECT(r, !strstr(have, ".tmp."), "%s: a temp file was left behind in %s: %s", when, dir, have);
    EXPECT(r, strcmp(have, want) == 0, "%s: %s holds \"%s\", expected \"%s\"", when, dir, have, want);
}

static void expect_same_bytes(Report *r, const char *a, const char *b) {
    size_t na = 0, nb = 0;
    char *da = test_file_read(a, &na), *db = test_file_read(b, &nb);
    if (EXPECT(r, da && db, "cannot read %s or %s", a, b))
        EXPECT(r, na == nb && memcmp(da, db, na) == 0, "%s (%zu bytes) and %s (%zu bytes) differ", a, na, b, nb);
    free(da), free(db);
}

static size_t file_size(const char *dir, const char *name) {
    char *p = test_path_join(dir, name);
    struct stat sb;
    size_t n = p && stat(p, &sb) == 0 ? (size_t)sb.st_size : 0;
    free(p);
    return n;
}

/* ---- checkpoint contents ------------------------------------------------------------------- */

/* Every dataset under /params, /lora and /optim of got is in want, bit for
 * bit (test_ckpt_group_within prints the first difference); got must have
 * parameters. */
static void expect_same_data(Report *r, const char *got, const char *want) {
    static const char *const groups[] = {"params", "lora", "optim"};
    H5ioFile f = H5IO_FILE_INIT;
    QtError err = {0};
    bool has[3] = {false, false, false};
    if (!EXPECT(r, h5io_open(&f, got, &err) == QT_OK, "%s", err.msg)) return;
    for (int i = 0; i < 3; i++) has[i] = h5io_exists(&f, groups[i]);
    h5io_close(&f, &err);
    EXPECT(r, has[0], "%s has no parameters", got);
    for (int i = 0; i < 3; i++)
        if (has[i]) EXPECT(r, test_ckpt_group_within(got, want, groups[i]), "/%s of %s differs from %s", groups[i], got,
                           want);
}

/* ---- the tmpfs --------------------------------------------------------------------------------- */

static bool write_proc_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return false;
    ssize_t n = write(fd, text, strlen(text));
    int e = errno;
    close(fd);
    errno = e;
    return n == (ssize_t)strlen(text);
}

/* Makes every mount of this process's (new) mount namespace private, so
 * nothing reaches the rest of the system, then mounts the tmpfs. */
static bool mount_private_tmpfs(const char *mnt, const char *opts) {
    return mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0 &&
           mount("tmpfs", mnt, "tmpfs", MS_NOSUID | MS_NODEV, opts) == 0;
}

/* A new user namespace (with a mount namespace) that maps only our own uid
 * and gid, which gives the right to mount without privileges. On failure
 * *step names what failed (errno says how). */
static bool enter_user_namespace(const char **step) {
    uid_t uid = getuid();
    gid_t gid = getgid();
    char map[64];
    *step = "unshare(CLONE_NEWUSER | CLONE_NEWNS)";
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
    *step = "/proc/self/setgroups"; /* gid_map needs it denied; kernels before 3.19 lack it */
    if (!write_proc_file("/proc/self/setgroups", "deny") && errno != ENOENT) return false;
    *step = "/proc/self/uid_map";
    snprintf(map, sizeof map, "%ld %ld 1", (long)uid, (long)uid);
    if (!write_proc_file("/proc/self/uid_map", map)) return false;
    *step = "/proc/self/gid_map";
    snprintf(map, sizeof map, "%ld %ld 1", (long)gid, (long)gid);
    return write_proc_file("/proc/self/gid_map", map);
}

/* Mounts a tmpfs of `bytes` on mnt in a mount namespace of this process's
 * own: as root CLONE_NEWNS alone does, else through a user namespace.
 * *route names the way that worked; on failure why says what failed. */
static bool tmpfs_mount(const char *mnt, size_t bytes, const char **route, char *why, size_t cap) {
    char opts[64];
    snprintf(opts, sizeof opts, "size=%zu,mode=0700", bytes);
    const char *step = "unshare(CLONE_NEWNS)";
    if (unshare(CLONE_NEWNS) == 0) {
        step = "mount";
        if (mount_private_tmpfs(mnt, opts)) {
            *route = "a private mount namespace";
            return true;
        }
    }
    int n = snprintf(why, cap, "%s: %s", step, strerror(errno));
    if (enter_user_namespace(&step)) {
        step = "mount";
        if (mount_private_tmpfs(mnt, opts)) {
            *route = "a user namespace with a mount namespace";
            return true;
        }
    }
    int e = errno;
    snprintf(why + n, cap - (size_t)n, "; %s: %s%s", step, strerror(e),
             e == ENOSPC && step[0] == 'u' ? " (the limit in /proc/sys/user/max_user_namespaces)" : "");
    return false;
}

/* ---- one scenario, in the namespace's child --------------------------------------------------- */

/* The run that fills the disk: exit status 1 and a message naming the file
 * that could not be written, the error and what to do. */
static void expect_disk_full_stop(Report *r, const Scenario *sc, const Places *p) {
    Args a;
    args_train(&a, sc, p->out, sc->keep_last, false);
    char *log = NULL;
    int rc = qtrain_run(p, a.argv, &log);
    char want[PATH_CAP + 128];
    snprintf(want, sizeof want, sc->message, p->out);
    EXPECT(r, rc == 1, "the run on a full disk: exit status %d, expected 1; output: %s", rc, log);
    EXPECT(r, strstr(log, want) != NULL, "the message lacks \"%s\": %s", want, log);
    EXPECT(r, strstr(log, "No space left on device") != NULL, "the failure was not ENOSPC: %s", log);
    EXPECT(r, strstr(log, "free disk space") != NULL, "the message does not say what to do: %s", log);
    report_note(r, "qtrain said: %s", log);
    free(log);
}

/* What the failed write left: the earlier checkpoints as the uninterrupted
 * run saved them, last.h5 the newest of them, each loadable. */
static void expect_previous_intact(Report *r, const Scenario *sc, const Places *p) {
    expect_listing(r, p->out, sc->after_failure, "after the failed write");
    char names[512], newest[64] = "";
    snprintf(names, sizeof names, "%s", sc->after_failure);
    for (char *save = NULL, *name = strtok_r(names, " ", &save); name; name = strtok_r(NULL, " ", &save)) {
        if (strncmp(name, "ckpt-", 5) != 0 || !test_file_exists(p->out, name)) continue;
        char *got = test_path_join(p->out, name), *want = test_path_join(p->ref, name);
        expect_same_data(r, got, want);
        expect_loads(r, p, got);
        free(got), free(want);
        snprintf(newest, sizeof newest, "%s", name);
    }
    if (!EXPECT(r, newest[0], "no ckpt-*.h5 is left in %s", p->out)) return;
    char *last = test_path_join(p->out, "last.h5"), *newest_path = test_path_join(p->out, newest);
    expect_same_bytes(r, last, newest_path);
    expect_loads(r, p, last);
    free(last), free(newest_path);
    if (sc->lora) { /* still the one saved beside the first checkpoint */
        char *got = test_path_join(p->out, "adapters.h5"), *want = test_path_join(p->ref, sc->first_ckpt);
        expect_same_data(r, got, want);
        const char *args[] = {"inspect", got, NULL};
        expect_run_ok(r, p, "qtrain inspect adapters.h5", args);
        free(got), free(want);
    }
}

/* With space again, --resume auto finishes as the uninterrupted run did. */
static void expect_resume_exact(Report *r, const Scenario *sc, const Places *p, size_t big) {
    char opts[64];
    snprintf(opts, sizeof opts, "size=%zu,mode=0700", big);
    if (!EXPECT(r, mount("tmpfs", p->mnt, "tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV, opts) == 0,
                "cannot grow the tmpfs on %s: %s", p->mnt, strerror(errno)))
        return;
    Args a;
    args_train(&a, sc, p->out, sc->keep_last, true);
    expect_run_ok(r, p, "the resumed run", a.argv);
    expect_listing(r, p->out, sc->after_resume, "after the resumed run");
    char *got = test_path_join(p->out, "final.h5"), *want = test_path_join(p->ref, "final.h5");
    expect_same_data(r, got, want);
    free(got), free(want);
    if (sc->lora) {
        got = test_path_join(p->out, "adapters.h5"), want = test_path_join(p->ref, "adapters.h5");
        expect_same_data(r, got, want);
        free(got), free(want);
    }
    char *mg = test_metrics_rows(p->out), *mw = test_metrics_rows(p->ref);
    if (EXPECT(r, mg && mw, "cannot read metrics.csv in %s or %s", p->out, p->ref))
        EXPECT(r, strcmp(mg, mw) == 0, "metrics.csv rows differ from the uninterrupted run's: %s -- vs -- %s", mg, mw);
    free(mg), free(mw);
}

/* The child's whole scenario; its exit status: 0 done (failures reported), EXIT_SKIP. */
static int scenario_child(Report *r, const Scenario *sc, const Places *p, size_t disk, size_t big) {
    const char *route = NULL;
    char why[512];
    if (!tmpfs_mount(p->mnt, disk, &route, why, sizeof why)) {
        report_skip(r, "cannot mount a tmpfs (%s)", why);
        return EXIT_SKIP;
    }
    report_note(r, "a tmpfs of %zu bytes on %s through %s", disk, p->mnt, route);
    expect_disk_full_stop(r, sc, p);
    expect_previous_intact(r, sc, p);
    expect_resume_exact(r, sc, p, big);
    return 0;
}

/* ---- the test side ------------------------------------------------------------------------------ */

/* Turns the child's report into assertions. */
static void apply_report(char *text, int status) {
    bool show = getenv("QT_TEST_SHOW_MSGS") != NULL, skipped = false;
    for (char *line = text, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        char kind[8] = "";
        int at = 0, used = 0;
        if (sscanf(line, "%7s %d %n", kind, &at, &used) < 2) continue;
        const char *msg = line + used;
        if (strcmp(kind, "fail") == 0) {
            fprintf(stderr, "\n  diskfull: %s\n", msg);
            CU_assertImplementation(CU_FALSE, (unsigned)at, msg, __FILE__, "", CU_FALSE);
        } else if (strcmp(kind, "skip") == 0) {
            test_skip("%s", msg);
            skipped = true;
        } else if (show) {
            fprintf(stderr, "\n  [diskfull] %s\n", msg);
        }
    }
    bool clean = WIFEXITED(status) && (WEXITSTATUS(status) == 0 || (skipped && WEXITSTATUS(status) == EXIT_SKIP));
    if (!clean) fprintf(stderr, "\n  diskfull: the namespace child ended with wait status %#x\n", status);
    CU_ASSERT(clean);
}

/* Forks the child that runs the scenario in its namespace and collects its report. */
static void run_in_namespace(const Scenario *sc, const Places *p, size_t disk, size_t big) {
    int fds[2];
    CU_ASSERT_FATAL(pipe2(fds, O_CLOEXEC) == 0);
    fflush(NULL); /* the child must not flush this process's buffers a second time */
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        Report r = {fds[1], 0};
        _exit(scenario_child(&r, sc, p, disk, big));
    }
    close(fds[1]);
    if (pid < 0) close(fds[0]);
    CU_ASSERT_FATAL(pid > 0);
    size_t cap = 4096, len = 0;
    char *text = malloc(cap);
    for (ssize_t got; text;) {
        if (len + 1 == cap) {
            char *t = realloc(text, cap *= 2);
            if (!t) free(text);
            text = t;
            if (!text) break;
        }
        got = read(fds[0], text + len, cap - len - 1);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        len += (size_t)got;
    }
    close(fds[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (text) text[len] = '\0';
    CU_ASSERT_PTR_NOT_NULL(text);
    if (text) apply_report(text, status);
    free(text);
}

static void places_init(Places *p, const char *root) {
    snprintf(p->root, sizeof p->root, "%s", root);
    snprintf(p->ref, sizeof p->ref, "%s/ref/run", root);
    snprintf(p->mnt, sizeof p->mnt, "%s/mnt", root);
    snprintf(p->out, sizeof p->out, "%s/mnt/run", root);
    snprintf(p->eval, sizeof p->eval, "%s/eval", root);
    snprintf(p->log, sizeof p->log, "%s/qtrain.log", root);
}

/* The uninterrupted run on a normal directory, keeping every checkpoint,
 * then the scenario on a tmpfs sized from its files: what the run holds
 * when the failing write starts (checkpoints, adapters.h5, a page of
 * metrics.csv, a page of .lock) plus half of the file that write makes, so
 * the failure comes mid-file; for metrics.csv, appended to, nothing more. */
static void check_disk_full(const Scenario *sc) {
    char *root = test_tmpdir_new();
    Places p;
    places_init(&p, root);
    Args a;
    args_train(&a, sc, p.ref, 0, false);
    char *log = NULL;
    int rc = qtrain_run(&p, a.argv, &log);
    if (rc != 0) fprintf(stderr, "\n  the uninterrupted run: exit status %d: %s\n", rc, log);
    free(log);
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_FATAL(mkdir(p.mnt, 0700) == 0);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t ckpt = (file_size(p.ref, sc->first_ckpt) + page - 1) / page;
    size_t adapters = sc->lora ? (file_size(p.ref, "adapters.h5") + page - 1) / page : 0;
    CU_ASSERT_FATAL(ckpt > 0 && (adapters > 0 || !sc->lora));
    size_t held = ckpt + adapters + 1 + 1 /* .lock */, half = 0;
    if (sc->full_at == FULL_AT_CKPT) half = ckpt / 2;
    if (sc->full_at == FULL_AT_ADAPTERS) held += ckpt, half = adapters / 2;
    size_t disk = (held + half) * page;
    run_in_namespace(sc, &p, disk, 8 * disk);
    test_tmpdir_remove(root);
}

/* 30 steps, checkpoints at 10 and 20: the one at 20 does not fit. keep_last
 * 1: the old checkpoint may only go once the new one is there. */
static void test_full_disk_at_checkpoint(void) {
    Scenario sc = {.full_at = FULL_AT_CKPT,
                   .extra = {"train.steps=30", "train.checkpoint_every=10", NULL},
                   .keep_last = 1,
                   .first_ckpt = "ckpt-00000010.h5",
                   .message = "qtrain: error: cannot save checkpoint %s/ckpt-00000020.h5: ",
                   .after_failure = ".lock ckpt-00000010.h5 last.h5 metrics.csv",
                   .after_resume = ".lock ckpt-00000020.h5 final.h5 last.h5 metrics.csv summary.json"};
    check_disk_full(&sc);
}

/* The same with LoRA adapters: ckpt-20 fits, adapters.h5 after it does not. */
static void test_full_disk_at_lora_adapters(void) {
    Scenario sc = {.full_at = FULL_AT_ADAPTERS,
                   .extra = {"train.steps=30", "train.checkpoint_every=10",
                             "lora.rules=[{module_path: fc1, rank: 4, alpha: 8}]", "lora.trainable=[head]", NULL},
                   .keep_last = 2,
                   .lora = true,
                   .first_ckpt = "ckpt-00000010.h5",
                   .message = "qtrain: error: cannot save checkpoint %s/adapters.h5: ",
                   .after_failure = ".lock adapters.h5 ckpt-00000010.h5 ckpt-00000020.h5 last.h5 metrics.csv",
                   .after_resume = ".lock adapters.h5 ckpt-00000010.h5 ckpt-00000020.h5 final.h5 last.h5 metrics.csv "
                                   "summary.json"};
    check_disk_full(&sc);
}

/* A row a step: metrics.csv (about 60 bytes a row) outgrows its first page
 * some 65 steps in, after the checkpoint at 50 and well before the one at
 * 100; the row cut short there must not survive the resume. */
static void test_full_disk_at_metrics(void) {
    Scenario sc = {.full_at = FULL_AT_METRICS,
                   .extra = {"train.steps=120", "train.checkpoint_every=50", "train.log_every=1",
                             "train.eval_every=0", NULL},
                   .keep_last = 1,
                   .first_ckpt = "ckpt-00000050.h5",
                   .message = "qtrain: error: cannot append to %s/metrics.csv: ",
                   .after_failure = ".lock ckpt-00000050.h5 last.h5 metrics.csv",
                   .after_resume = ".lock ckpt-00000100.h5 final.h5 last.h5 metrics.csv summary.json"};
    check_disk_full(&sc);
}

/* A resume keeps the rows up to its checkpoint's step, but not a last row
 * cut short: "train,1" may be what is left of step 123's row. */
static void test_metrics_cut_row_dropped(void) {
    char *dir = test_tmpdir_new(), *path = test_path_join(dir, "metrics.csv");
    const char rows[] = "split,step,epoch,loss,accuracy,lr,samples_per_s,wall_s\n"
                        "train,1,0.0625,2.3,0.1,0.001,100.0,0.010\n"
                        "train,2,0.1250,2.2,0.2,0.001,100.0,0.020\n"
                        "train,3,0.1875,2.1,0.3,0.001,100.0,0.030\n"
                        "train,1";
    test_file_write(path, rows, sizeof rows - 1);
    MetricsLog ml;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(metrics_open(&ml, dir, 2, &err), QT_OK);
    CU_ASSERT_EQUAL(metrics_write(&ml, "train", 3, 0.1875, 2.0, 0.4, 0.001, 100.0, 0.04, &err), QT_OK);
    metrics_close(&ml);
    char *text = test_file_read(path, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    const char want[] = "split,step,epoch,loss,accuracy,lr,samples_per_s,wall_s\n"
                        "train,1,0.0625,2.3,0.1,0.001,100.0,0.010\n"
                        "train,2,0.1250,2.2,0.2,0.001,100.0,0.020\n"
                        "train,3,0.1875,2,0.4,0.001,100.0,0.040\n";
    if (strcmp(text, want) != 0) fprintf(stderr, "\n  metrics.csv after the resume:\n%s", text);
    CU_ASSERT_STRING_EQUAL(text, want);
    free(text), free(path);
    test_tmpdir_remove(dir);
}

/* A run killed while writing adapters.h5 leaves its temp file; the next
 * save in the directory removes it, as it does those of checkpoints. */
static void test_stale_adapters_tmp_removed(void) {
    char *dir = test_tmpdir_new(), *stale = test_path_join(dir, "adapters.h5.tmp.999999999");
    Model m;
    LayerSpec l[1] = {{.type = LAYER_DENSE, .name = "fc", .units = 2}};
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, (int[]){3}, l, 1, &err), QT_OK);
    test_file_write(stale, "x", 1);
    CU_ASSERT_EQUAL(checkpoint_save_in_dir(dir, NULL, 0, &m, NULL, NULL, NULL, 0, &err), QT_OK);
    CU_ASSERT_FALSE(test_file_exists(dir, "adapters.h5.tmp.999999999"));
    CU_ASSERT(test_file_exists(dir, "ckpt-00000000.h5"));
    model_free(&m);
    free(stale);
    test_tmpdir_remove(dir);
}

/* ---- resource limits (ulimit -v, ulimit -f) -------------------------------------------------- */

#if defined(__SANITIZE_ADDRESS__)
#define BUILT_WITH_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define BUILT_WITH_ASAN 1
#endif
#endif

/* Under an address-space limit (ulimit -v) too small for OpenBLAS's
 * buffers, qtrain used to spin forever in OpenBLAS's allocator (and ignore
 * SIGTERM) or crash in HDF5; it now refuses at once, saying how much it
 * needs. A hang is killed after the timeout and fails the test. */
static void test_resource_limit_address_space(void) {
#ifdef BUILT_WITH_ASAN
    test_skip("AddressSanitizer reserves terabytes of address space, so a ulimit -v build cannot start at all");
    return;
#endif
    char *root = test_tmpdir_new(), out[PATH_CAP + 32], log[PATH_CAP + 32];
    CU_ASSERT_PTR_NOT_NULL_FATAL(root);
    snprintf(log, sizeof log, "%s/as.log", root);
    /* both far below what qtrain needs; under about 90 MB OpenBLAS's own constructor cannot start its thread,
       before main, and it raises SIGINT itself (Debian's 0.3.21 with liblapack mapped beside it) */
    const unsigned long long mb[] = {120, 200};
    for (size_t i = 0; i < sizeof mb / sizeof *mb; i++) {
        snprintf(out, sizeof out, "run.out_dir=%s/as-%llu", root, mb[i]);
        const char *args[] = {"--config", CONFIG, "--set", out, "--quiet", NULL};
        pid_t pid = test_proc_start_limited(log, args, RLIMIT_AS, mb[i] << 20);
        CU_ASSERT_FATAL(pid > 0);
        int status = test_proc_wait(pid, 60.0);
        CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 1);
        char *text = test_file_read(log, NULL), want[96];
        snprintf(want, sizeof want, "of address space (OpenBLAS maps a 128 MB buffer");
        CU_ASSERT(text && strstr(text, "qtrain: error: qtrain needs at least ") && strstr(text, want));
        snprintf(want, sizeof want, "ulimit -v is %llu MB: raise it", mb[i]);
        CU_ASSERT(text && strstr(text, want));
        if (!(WIFEXITED(status) && WEXITSTATUS(status) == 1)) fprintf(stderr, "\n  status %#x: %s\n", status, text);
        free(text);
    }
    /* a roomy limit runs as usual */
    snprintf(out, sizeof out, "run.out_dir=%s/as-roomy", root);
    const char *args[] = {"--config", CONFIG, "--set", out, "--quiet", NULL};
    pid_t pid = test_proc_start_limited(log, args, RLIMIT_AS, 2048ull << 20);
    CU_ASSERT_FATAL(pid > 0);
    int status = test_proc_wait(pid, RUN_TIMEOUT_S);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CU_ASSERT(test_tmpdir_remove(root));
}

/* A checkpoint larger than the file-size limit (ulimit -f): the save fails
 * with EFBIG (SIGXFSZ used to kill the run without a word, leaving a
 * partial temp file), the message says what to raise, no temp file stays,
 * and the previous checkpoint is byte for byte as it was. */
static void test_resource_limit_file_size(void) {
    char *root = test_tmpdir_new(), dir[PATH_CAP], out[PATH_CAP + 32], log[PATH_CAP + 32];
    CU_ASSERT_PTR_NOT_NULL_FATAL(root);
    snprintf(dir, sizeof dir, "%s/fsize", root);
    snprintf(out, sizeof out, "run.out_dir=%s", dir);
    snprintf(log, sizeof log, "%s/fsize.log", root);
    const char *first[] = {"--config", CONFIG, "--set", out, "--set", "train.steps=30", "--stop-at-step", "10",
                           "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, first, RUN_TIMEOUT_S), 0);
    char *ckpt = test_path_join(dir, "ckpt-00000010.h5");
    size_t len = 0;
    char *before = test_file_read(ckpt, &len);
    CU_ASSERT_FATAL(before && len > (100u << 10)); /* the limit below is smaller than a checkpoint */
    const char *resume[] = {"--config", CONFIG, "--set", out, "--set", "train.steps=30", "--resume", "auto",
                            "--quiet", NULL};
    pid_t pid = test_proc_start_limited(log, resume, RLIMIT_FSIZE, 100u << 10);
    CU_ASSERT_FATAL(pid > 0);
    int status = test_proc_wait(pid, RUN_TIMEOUT_S);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 1); /* not killed by SIGXFSZ */
    char *text = test_file_read(log, NULL);
    CU_ASSERT(text && strstr(text, "cannot save checkpoint ") && strstr(text, "File too large"));
    CU_ASSERT(text && strstr(text, "file too large: the file-size limit (ulimit -f) is 102400 bytes; raise it"));
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 1)) fprintf(stderr, "\n  status %#x: %s\n", status, text);
    DIR *d = opendir(dir);
    bool tmp_left = false;
    for (struct dirent *e; d && (e = readdir(d));) tmp_left |= strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    CU_ASSERT(!tmp_left);
    size_t len_after = 0;
    char *after = test_file_read(ckpt, &len_after);
    CU_ASSERT(after && len_after == len && memcmp(before, after, len) == 0);
    char *config = NULL;
    QtError err = {0};
    CU_ASSERT_EQUAL(checkpoint_read_config(ckpt, &config, &err), QT_OK);
    free(config), free(text), free(before), free(after), free(ckpt);
    CU_ASSERT(test_tmpdir_remove(root));
}

int register_diskfull_suite(void) {
    CU_pSuite s = CU_add_suite("diskfull", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "a full disk at a checkpoint stops the run, keeps the last one, resumes exactly",
                        test_full_disk_at_checkpoint) ||
           !CU_add_test(s, "a full disk at a LoRA run's adapters.h5 keeps the checkpoints, resumes exactly",
                        test_full_disk_at_lora_adapters) ||
           !CU_add_test(s, "a full disk at metrics.csv stops the run, resumes exactly", test_full_disk_at_metrics) ||
           !CU_add_test(s, "metrics.csv: a row cut short is dropped on resume", test_metrics_cut_row_dropped) ||
           !CU_add_test(s, "a dead writer's adapters.h5 temp file goes at the next save",
                        test_stale_adapters_tmp_removed) ||
           !CU_add_test(s, "resource limits: ulimit -v too small is refused at once, not a hang",
                        test_resource_limit_address_space) ||
           !CU_add_test(s, "resource limits: ulimit -f gives EFBIG, the previous checkpoint intact, no temp file",
                        test_resource_limit_file_size);
}
