/* fuzz_harness.c - the scratch directory and the status rule shared by the
 * fuzz entry functions (fuzz_harness.h). */
#include "fuzz_harness.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char scratch[256];
static bool scratch_failed;

static void remove_tree(const char *path) {
    DIR *d = opendir(path);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
            char child[1024];
            snprintf(child, sizeof child, "%s/%s", path, e->d_name);
            struct stat sb;
            if (lstat(child, &sb) == 0 && S_ISDIR(sb.st_mode))
                remove_tree(child);
            else
                unlink(child);
        }
        closedir(d);
    }
    rmdir(path);
}

void fuzz_scratch_remove(void) {
    if (scratch[0]) remove_tree(scratch);
    scratch[0] = '\0';
}

const char *fuzz_scratch_dir(void) {
    if (scratch[0]) return scratch;
    if (scratch_failed) return NULL;
    struct stat sb;
    const char *base = getenv("TMPDIR");
    if (!base || !*base)
        base = stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) && access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(scratch, sizeof scratch, "%s/qtrain-fuzz-XXXXXX", base);
    if (!mkdtemp(scratch)) {
        scratch[0] = '\0';
        scratch_failed = true;
        return NULL;
    }
    static bool registered = false;
    if (!registered) atexit(fuzz_scratch_remove);
    registered = true;
    return scratch;
}

int fuzz_write_file(const char *name, const void *data, size_t size, char *out, size_t cap) {
    const char *dir = fuzz_scratch_dir();
    if (!dir || snprintf(out, cap, "%s/%s", dir, name) >= (int)cap) return 1;
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return 1;
    const uint8_t *p = data;
    while (size > 0) {
        ssize_t w = write(fd, p, size);
        if (w <= 0) {
            close(fd);
            return 1;
        }
        p += w;
        size -= (size_t)w;
    }
    return close(fd) != 0;
}

void fuzz_clear_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        char child[1024];
        snprintf(child, sizeof child, "%s/%s", dir, e->d_name);
        unlink(child);
    }
    closedir(d);
}

int fuzz_check_status(const char *what, QtStatus st, const QtError *err, char *why, size_t why_cap) {
    static int verbose = -1;
    if (verbose < 0) verbose = getenv("QTRAIN_FUZZ_VERBOSE") != NULL;
    if (verbose) fprintf(stderr, "%s: %s\n", what, st == QT_OK ? "ok" : err->msg);
    if (st != QT_OK && (err->status == QT_OK || err->msg[0] == '\0')) {
        snprintf(why, why_cap, "%s failed with status %d (%s) but left no error message", what, (int)st,
                 qt_status_name(st));
        return 1;
    }
    if (st == QT_OK && err->status != QT_OK) {
        snprintf(why, why_cap, "%s succeeded but left an error behind: %s", what, err->msg);
        return 1;
    }
    return 0;
}
