/* test_proc.c - the qtrain binary as a child process. */
#include "test_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/h5io.h"

const char *test_qtrain_bin(void) {
    const char *bin = getenv("QTRAIN_BIN");
    return bin && bin[0] ? bin : "build/qtrain";
}

pid_t test_proc_start(const char *log_path, const char *const *args) {
    return test_proc_start_limited(log_path, args, -1, 0);
}

pid_t test_proc_start_limited(const char *log_path, const char *const *args, int resource, unsigned long long limit) {
    const char *argv[64];
    int n = 0;
    argv[n++] = test_qtrain_bin();
    for (int i = 0; args[i] && n < 63; i++) argv[n++] = args[i];
    argv[n] = NULL;
    return test_proc_spawn(log_path, argv, resource, limit);
}

pid_t test_proc_spawn(const char *log_path, const char *const *argv, int resource, unsigned long long limit) {
    int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "\n  cannot open %s: %s\n", log_path, strerror(errno));
        return -1;
    }
    fflush(NULL); /* the child must not flush this process's buffers a second time */
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        /* a clean signal state whatever the runner inherited */
        signal(SIGINT, SIG_DFL), signal(SIGTERM, SIG_DFL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        struct rlimit lim = {(rlim_t)limit, (rlim_t)limit};
        if (resource >= 0 && setrlimit(resource, &lim) != 0) {
            fprintf(stderr, "setrlimit %d: %s\n", resource, strerror(errno));
            _exit(127);
        }
        execvp(argv[0], (char *const *)argv);
        fprintf(stderr, "cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fd);
    if (pid < 0) fprintf(stderr, "\n  fork: %s\n", strerror(errno));
    return pid;
}

int test_proc_wait(pid_t pid, double timeout_s) {
    struct timespec t0, now, nap = {0, 2000000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int status;
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) return status;
        if (r < 0 && errno != EINTR) return -1;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec - t0.tv_nsec) > timeout_s) {
            fprintf(stderr, "\n  %s (pid %ld) still running after %.0f s: killed\n", test_qtrain_bin(), (long)pid,
                    timeout_s);
            kill(pid, SIGKILL);
            return waitpid(pid, &status, 0) == pid ? status : -1;
        }
        nanosleep(&nap, NULL);
    }
}

int test_proc_run(const char *log_path, const char *const *args, double timeout_s) {
    pid_t pid = test_proc_start(log_path, args);
    if (pid < 0) return -1;
    int status = test_proc_wait(pid, timeout_s);
    return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* ---- comparing checkpoint files ---------------------------------------------------- */

typedef struct {
    const H5ioFile *a, *b;
    const char *group;
    int n;        /* datasets compared */
    bool equal;   /* the same bits so far (test_ckpt_group_within), or every pair read (rel_diff) */
    double worst; /* test_ckpt_group_rel_diff: the largest relative difference so far */
    bool bits;    /* compare bits (else relative L2 norms) */
} GroupCmp;

/* A float32 dataset `path` of both files: 1 with *va, *vb (malloc'd) and *n, 0 if a's is not float32, -1 if b's is
 * missing, shaped differently or unreadable (said on stderr). */
static int read_pair(const GroupCmp *c, const char *path, float **va, float **vb, size_t *n) {
    H5ioInfo ia, ib;
    QtError e = {0};
    *va = *vb = NULL;
    if (h5io_dataset_info(c->a, path, &ia, &e) != QT_OK || !h5io_is_f32(&ia)) return 0;
    if (h5io_dataset_info(c->b, path, &ib, &e) != QT_OK || ia.rank != ib.rank || ia.numel != ib.numel) {
        fprintf(stderr, "\n  %s: /%s missing or shaped differently in %s\n", c->a->path, path, c->b->path);
        return -1;
    }
    int shape[H5IO_MAX_RANK];
    for (int d = 0; d < ia.rank; d++) shape[d] = (int)ia.dims[d];
    *va = malloc(ia.numel * sizeof(float) + 1), *vb = malloc(ia.numel * sizeof(float) + 1);
    *n = ia.numel;
    if (*va && *vb && h5io_read_f32(c->a, path, *va, ia.rank, shape, &e) == QT_OK &&
        h5io_read_f32(c->b, path, *vb, ia.rank, shape, &e) == QT_OK)
        return 1;
    fprintf(stderr, "\n  /%s: cannot read %s or %s: %s\n", path, c->a->path, c->b->path, e.msg);
    free(*va), free(*vb);
    return -1;
}

static int compare_dataset(const char *rel, H5ioKind kind, void *ctx) {
    GroupCmp *c = ctx;
    if (kind != H5IO_DATASET) return 0;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", c->group, rel);
    float *va, *vb;
    size_t n = 0;
    int got = read_pair(c, path, &va, &vb, &n);
    if (got == 0) return 0;
    if (got < 0) {
        c->equal = false;
        return 1;
    }
    c->n++;
    if (c->bits) {
        bool same = memcmp(va, vb, n * sizeof(float)) == 0;
        if (!same) fprintf(stderr, "\n  /%s differs between %s and %s\n", path, c->a->path, c->b->path);
        c->equal &= same;
        free(va), free(vb);
        return same ? 0 : 1;
    }
    double dd = 0.0, aa = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)va[i] - (double)vb[i];
        dd += d * d, aa += (double)va[i] * (double)va[i];
    }
    double r = aa > 0.0 ? sqrt(dd / aa) : sqrt(dd);
    if (r > c->worst) c->worst = r;
    free(va), free(vb);
    return 0;
}

/* Visits group of a against b. */
static bool compare_group(const char *a, const char *b, GroupCmp *c) {
    H5ioFile fa, fb;
    QtError e = {0};
    if (h5io_open(&fa, a, &e) != QT_OK) {
        fprintf(stderr, "\n  %s\n", e.msg);
        return false;
    }
    if (h5io_open(&fb, b, &e) != QT_OK) {
        fprintf(stderr, "\n  %s\n", e.msg);
        h5io_close(&fa, &e);
        return false;
    }
    c->a = &fa, c->b = &fb, c->equal = true;
    bool ok = h5io_visit(&fa, c->group, compare_dataset, c, NULL, &e) == QT_OK && c->equal && c->n > 0;
    h5io_close(&fa, &e), h5io_close(&fb, &e);
    return ok;
}

bool test_ckpt_group_within(const char *a, const char *b, const char *group) {
    GroupCmp c = {.group = group, .bits = true};
    return compare_group(a, b, &c);
}

double test_ckpt_group_rel_diff(const char *a, const char *b, const char *group) {
    GroupCmp c = {.group = group};
    return compare_group(a, b, &c) ? c.worst : INFINITY;
}
