/* train_dirs.c - a run's directories: run.out_dir (and eval's --out) made
 * with its parents and locked (the run's RunDir part), taken back after a
 * failed start, and where eval.json goes. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "trainer/run.h"

QtStatus train_make_dirs(const char *path, const char *what, char *created, size_t cap, QtError *err) {
    char buf[CONFIG_PATH_MAX];
    if (created && cap) created[0] = '\0';
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: path too long (%zu characters)", what, strlen(path));
    for (char *p = buf + 1;; p++) {
        char c = *p;
        if (c != '/' && c != '\0') continue;
        *p = '\0';
        if (mkdir(buf, 0777) == 0) {
            if (created && cap && !created[0]) snprintf(created, cap, "%s", buf);
        } else if (errno != EEXIST)
            return qt_error_set(err, QT_ERR_IO, "cannot create the output directory %s: %s; set %s to a "
                                "writable place", buf, strerror(errno), what);
        *p = c;
        if (c == '\0') break;
    }
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return qt_error_set(err, QT_ERR_IO, "%s %s exists but is not a directory", what, path);
    if (access(path, W_OK | X_OK) != 0)
        return qt_error_set(err, QT_ERR_IO, "%s %s is not writable: %s", what, path, strerror(errno));
    return QT_OK;
}

/* Removes path and its parents up to `created`, each only if empty. */
static void remove_created_dirs(const char *path, const char *created) {
    char buf[CONFIG_PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return;
    size_t top = strlen(created);
    /* rmdir removes only an empty directory: whatever the run did write stays */
    for (;;) {
        size_t n = strlen(buf);
        while (n > 1 && buf[n - 1] == '/') buf[--n] = '\0';
        if (n < top || rmdir(buf) != 0 || n == top) return;
        char *slash = strrchr(buf, '/');
        if (!slash) return;
        *slash = '\0';
    }
}

/* Whether dir holds nothing but our .lock: a failed start that wrote nothing. */
static bool dir_holds_only_lock(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return false;
    bool only = true;
    for (struct dirent *e; only && (e = readdir(d));)
        only = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, RUNDIR_LOCK_NAME);
    closedir(d);
    return only;
}

QtStatus run_dir_open(Run *r, char *created, size_t cap, QtError *err) {
    QtStatus st = train_make_dirs(r->cfg->run.out_dir, "run.out_dir", created, cap, err);
    return st == QT_OK ? rundir_lock(r->cfg->run.out_dir, &r->dir.lock, err) : st;
}

void run_dir_close(RunDir *d) {
    free(d->config_text);
    free(d->lora_trainable);
    rundir_unlock(&d->lock, false);
    memset(d, 0, sizeof *d);
}

void run_undo_failed_start(Run *r, const char *created) {
    if (!created[0]) return;
    const char *out = r->cfg->run.out_dir;
    if (dir_holds_only_lock(out)) rundir_unlock(&r->dir.lock, true); /* the .lock goes first, while still held */
    remove_created_dirs(out, created);
}

QtStatus train_eval_json_path(const char *checkpoint, const char *out, char *path, size_t cap, QtError *err) {
    struct stat sb;
    int n;
    if (out && stat(out, &sb) == 0 && S_ISDIR(sb.st_mode)) n = snprintf(path, cap, "%s/eval.json", out);
    else if (out) n = snprintf(path, cap, "%s", out);
    else {
        const char *slash = strrchr(checkpoint, '/');
        n = slash ? snprintf(path, cap, "%.*s/eval.json", (int)(slash - checkpoint), checkpoint)
                  : snprintf(path, cap, "eval.json");
    }
    if (n < 0 || (size_t)n >= cap)
        return qt_error_set(err, QT_ERR_ARG, "the path of eval.json is too long (%s has %zu characters)",
                            out ? "--out" : "the checkpoint path", strlen(out ? out : checkpoint));
    return QT_OK;
}
