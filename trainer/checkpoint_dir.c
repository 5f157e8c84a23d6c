/* checkpoint_dir.c - checkpoints in a run's out_dir: ckpt-<step>.h5 names,
 * last.h5, rotation by train.keep_last, removal of temp files that crashed
 * saves left behind, and finding the checkpoint `--resume auto` takes. */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint_internal.h"
#include "base/fsutil.h"

static QtStatus path_join(char *out, size_t cap, const char *dir, const char *name, QtError *err) {
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap)
        return qt_error_set(err, QT_ERR_ARG, "the path %s/%s is too long (at most %zu bytes)", dir, name, cap - 1);
    return QT_OK;
}

/* "ckpt-<digits>.h5" -> its step. */
static bool parse_ckpt_name(const char *name, long long *step) {
    if (strncmp(name, "ckpt-", 5) != 0) return false;
    const char *p = name + 5, *q = p;
    while (*q >= '0' && *q <= '9') q++;
    if (q == p || q - p > 18 || strcmp(q, ".h5") != 0) return false;
    *step = strtoll(p, NULL, 10);
    return true;
}

/* Whether base is a file a run writes atomically as "<base>.tmp.<pid>":
 * checkpoints, adapters.h5 (beside each checkpoint of a LoRA run),
 * metrics.csv (rewritten at start), the closing JSON files and `own` (ctx). */
static bool run_owns_tmp(const char *base, void *ctx) {
    static const char *const fixed[] = {"last.h5", "final.h5", "adapters.h5", "metrics.csv", "summary.json",
                                        "eval.json"};
    long long step;
    bool known = parse_ckpt_name(base, &step) || strcmp(base, (const char *)ctx) == 0;
    for (size_t i = 0; !known && i < sizeof fixed / sizeof *fixed; i++) known = strcmp(base, fixed[i]) == 0;
    return known;
}

/* Removes temp files that a crashed save or run left behind: ours (no save of this
 * process is in flight now) and those of processes that no longer exist. */
static void remove_stale_tmps(const char *dir, const char *own) {
    fs_remove_stale_tmps(dir, run_owns_tmp, (void *)own, true, 0);
}

static QtStatus read_whole_file(const char *path, void **buf, size_t *len, QtError *err) {
    *buf = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        return qt_error_set(err, QT_ERR_IO, "cannot read %s: %s", path, strerror(e));
    }
    char *b = malloc(sb.st_size > 0 ? (size_t)sb.st_size : 1);
    size_t got = 0;
    while (b && got < (size_t)sb.st_size) {
        ssize_t r = read(fd, b + got, (size_t)sb.st_size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    int e = errno;
    close(fd);
    if (!b) return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %lld bytes to copy %s", (long long)sb.st_size,
                                path);
    if (got != (size_t)sb.st_size) {
        free(b);
        return qt_error_set(err, QT_ERR_IO, "cannot read %s: %s", path, got ? "it shrank while read" : strerror(e));
    }
    *buf = b;
    *len = got;
    return QT_OK;
}

/* Points <dir>/last.h5 at `saved`: a hard link renamed into place, or a copy
 * (also renamed into place) where the file system has no hard links. */
static QtStatus update_last(const char *dir, const char *saved, QtError *err) {
    char last[CKPT_PATH_MAX], tmp[CKPT_PATH_MAX + 32];
    QtStatus st = path_join(last, sizeof last, dir, "last.h5", err);
    if (st != QT_OK) return st;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", last, (long)getpid());
    unlink(tmp);
    if (link(saved, tmp) == 0) {
        /* rename() of two links to one file does nothing, so tmp may remain. */
        if (rename(tmp, last) == 0) {
            unlink(tmp);
            return ckpt_sync_parent_dir(last, err);
        }
        int e = errno;
        unlink(tmp);
        return ckpt_save_fail(err, last, "renaming", tmp, e);
    }
    int e = errno;
    if (e != EPERM && e != EXDEV && e != ENOTSUP && e != EOPNOTSUPP && e != EMLINK && e != ENOSYS)
        return ckpt_save_fail(err, last, "linking", tmp, e);
    void *buf = NULL;
    size_t len = 0;
    st = read_whole_file(saved, &buf, &len, err);
    if (st == QT_OK) st = ckpt_write_atomic(last, buf, len, FS_REPLACE_ANY, err);
    free(buf);
    return st;
}

typedef struct {
    long long step;
    char name[64];
} CkptEntry;

static int entry_cmp(const void *a, const void *b) {
    const CkptEntry *x = a, *y = b;
    if (x->step != y->step) return x->step < y->step ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* The ckpt-<step>.h5 regular files of dir, sorted by step (malloc'd). */
static QtStatus list_ckpts(const char *dir, CkptEntry **out, int *n_out, QtError *err) {
    *out = NULL;
    *n_out = 0;
    DIR *d = opendir(dir);
    if (!d) return qt_error_set(err, QT_ERR_IO, "cannot list %s: %s", dir, strerror(errno));
    CkptEntry *v = NULL;
    int n = 0, cap = 0;
    QtStatus st = QT_OK;
    struct dirent *e;
    while (st == QT_OK && (e = readdir(d))) {
        long long step;
        char p[CKPT_PATH_MAX];
        struct stat sb;
        if (strlen(e->d_name) >= sizeof v->name || !parse_ckpt_name(e->d_name, &step)) continue;
        if (path_join(p, sizeof p, dir, e->d_name, NULL) != QT_OK || stat(p, &sb) != 0 || !S_ISREG(sb.st_mode))
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            CkptEntry *nv = realloc(v, (size_t)cap * sizeof *v);
            if (!nv) {
                st = qt_error_set(err, QT_ERR_NOMEM, "cannot allocate the checkpoint list of %s", dir);
                break;
            }
            v = nv;
        }
        v[n].step = step;
        snprintf(v[n].name, sizeof v[n].name, "%s", e->d_name);
        n++;
    }
    closedir(d);
    if (st != QT_OK) {
        free(v);
        return st;
    }
    if (n > 1) qsort(v, (size_t)n, sizeof *v, entry_cmp);
    *out = v;
    *n_out = n;
    return QT_OK;
}

/* Deletes the oldest ckpt-*.h5 beyond keep_last, never the one just saved. */
static QtStatus rotate(const char *dir, int keep_last, const char *saved_name, QtError *err) {
    if (keep_last == 0) return QT_OK;
    CkptEntry *v = NULL;
    int n = 0;
    QtStatus st = list_ckpts(dir, &v, &n, err);
    for (int i = 0; st == QT_OK && i < n - keep_last; i++) {
        char p[CKPT_PATH_MAX];
        if (strcmp(v[i].name, saved_name) == 0) continue;
        st = path_join(p, sizeof p, dir, v[i].name, err);
        if (st == QT_OK && unlink(p) != 0 && errno != ENOENT)
            st = qt_error_set(err, QT_ERR_IO, "cannot delete old checkpoint %s (train.keep_last = %d): %s; delete it "
                              "by hand or set train.keep_last: 0", p, keep_last, strerror(errno));
    }
    free(v);
    return st;
}

QtStatus checkpoint_save_in_dir(const char *dir, const char *name, int keep_last, const Model *m,
                                const Optimizer *opt, const CheckpointState *s, char *saved, size_t saved_cap,
                                QtError *err) {
    if (!dir || !dir[0] || !m) return qt_error_set(err, QT_ERR_ARG, "checkpoint_save_in_dir: no directory or model");
    if (keep_last < 0) return qt_error_set(err, QT_ERR_ARG, "train.keep_last = %d; it must be >= 0", keep_last);
    if (name && (!name[0] || strchr(name, '/') || strlen(name) > 200))
        return qt_error_set(err, QT_ERR_ARG, "checkpoint name '%s' must be a file name of 1..200 characters", name);
    char fname[256], path[CKPT_PATH_MAX];
    long long step = s ? (long long)s->step : opt ? (long long)opt->step : 0;
    if (name)
        snprintf(fname, sizeof fname, "%s", name);
    else
        snprintf(fname, sizeof fname, "ckpt-%08lld.h5", step);
    QtStatus st = path_join(path, sizeof path, dir, fname, err);
    if (st != QT_OK) return st;
    if (saved && strlen(path) >= saved_cap)
        return qt_error_set(err, QT_ERR_ARG, "checkpoint path %s does not fit in %zu bytes", path, saved_cap);
    remove_stale_tmps(dir, fname);
    if ((st = checkpoint_save(path, m, opt, s, err)) != QT_OK) return st;
    if (saved) snprintf(saved, saved_cap, "%s", path);
    if (strcmp(fname, "last.h5") != 0) st = update_last(dir, path, err);
    if (st == QT_OK) st = rotate(dir, keep_last, fname, err);
    return st;
}

QtStatus checkpoint_find_latest(const char *dir, char *path, size_t cap, QtError *err) {
    if (!dir || !path || cap == 0) return qt_error_set(err, QT_ERR_ARG, "checkpoint_find_latest: no dir or buffer");
    path[0] = '\0';
    char p[CKPT_PATH_MAX];
    struct stat sb;
    QtStatus st = path_join(p, sizeof p, dir, "last.h5", err);
    if (st != QT_OK) return st;
    if (stat(p, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        CkptEntry *v = NULL;
        int n = 0;
        QtError list_err = {0};
        if (list_ckpts(dir, &v, &n, &list_err) != QT_OK || n == 0) {
            free(v);
            if (list_err.status != QT_OK)
                return qt_error_set(err, QT_ERR_IO, "no checkpoint in %s (%s)", dir, list_err.msg);
            return qt_error_set(err, QT_ERR_IO, "no checkpoint in %s (neither last.h5 nor ckpt-*.h5)", dir);
        }
        st = path_join(p, sizeof p, dir, v[n - 1].name, err);
        free(v);
        if (st != QT_OK) return st;
    }
    if (strlen(p) >= cap)
        return qt_error_set(err, QT_ERR_ARG, "checkpoint path %s does not fit in %zu bytes", p, cap);
    snprintf(path, cap, "%s", p);
    return QT_OK;
}
