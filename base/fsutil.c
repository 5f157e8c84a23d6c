/* fsutil.c - output paths, temp files and their cleanup (fsutil.h). */
#define _GNU_SOURCE /* renameat2 */
#include "fsutil.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FS_PATH_MAX 4096

static const char *file_kind(mode_t m) {
    if (S_ISDIR(m)) return "a directory";
    if (S_ISLNK(m)) return "a symbolic link";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISSOCK(m)) return "a socket";
    return "not a regular file";
}

QtStatus fs_check_out_path(const char *path, bool force, const char *what, QtError *err) {
    if (!path || !path[0]) return qt_error_set(err, QT_ERR_ARG, "%s: the path is empty", what);
    if (strlen(path) >= FS_PATH_MAX - 32)
        return qt_error_set(err, QT_ERR_ARG, "%s: the path is longer than %d bytes; give a shorter one", what,
                            FS_PATH_MAX - 32);
    size_t len = strlen(path);
    if (path[len - 1] == '/') return qt_error_set(err, QT_ERR_ARG, "%s %s names a directory; give a file name", what,
                                                  path);
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT) return QT_OK;
        return qt_error_set(err, QT_ERR_IO, "%s %s: %s", what, path, strerror(errno));
    }
    if (!S_ISREG(sb.st_mode))
        return qt_error_set(err, QT_ERR_ARG, "%s %s is %s; qtrain writes only a new file or replaces a regular one "
                            "(a write there would replace it by a file); give another path", what, path,
                            file_kind(sb.st_mode));
    if (!force)
        return qt_error_set(err, QT_ERR_ARG, "%s %s already exists; pass --force to replace it, or give another path",
                            what, path);
    return QT_OK;
}

int fs_open_tmp(const char *path, char *tmp, size_t cap) {
    int n = snprintf(tmp, cap, "%s.tmp.%ld", path, (long)getpid());
    if (n < 0 || (size_t)n >= cap) {
        errno = ENAMETOOLONG;
        return -1;
    }
    /* a leftover of an earlier process that had our pid; unlink never follows a symlink */
    unlink(tmp);
    return open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
}

int fs_rename_tmp(const char *tmp, const char *path, FsReplace how) {
    if (how == FS_REPLACE_ANY) return rename(tmp, path);
    if (how == FS_REPLACE_REGULAR) {
        struct stat sb;
        if (lstat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) {
            errno = EEXIST;
            return -1;
        }
        return rename(tmp, path);
    }
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, path, RENAME_NOREPLACE) == 0) return 0;
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) return -1;
    /* no RENAME_NOREPLACE here: link() fails with EEXIST just the same */
    if (link(tmp, path) != 0) return -1;
    unlink(tmp);
    return 0;
}

FILE *fs_fopen_tmp(const char *path, char *tmp, size_t cap) {
    int fd = fs_open_tmp(path, tmp, cap);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f && fd >= 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        errno = e;
    }
    return f;
}

int fs_fcommit_tmp(FILE *f, const char *tmp, const char *path, FsReplace how) {
    errno = 0;
    /* ferror: a write that failed before this flush is sticky */
    bool ok = fflush(f) == 0 && !ferror(f) && fsync(fileno(f)) == 0;
    int e = ok ? 0 : errno ? errno : EIO;
    if (fclose(f) != 0 && ok) ok = false, e = errno;
    if (ok && fs_rename_tmp(tmp, path, how) == 0) return 0;
    if (ok) e = errno;
    unlink(tmp);
    errno = e;
    return -1;
}

bool fs_parse_tmp_name(const char *name, char *base, size_t cap, long *pid) {
    const char *t = strstr(name, ".tmp.");
    if (!t) return false;
    for (const char *u; (u = strstr(t + 1, ".tmp."));) t = u; /* the last one: a base may hold ".tmp." itself */
    const char *digits = t + 5, *q = digits;
    while (*q >= '0' && *q <= '9') q++;
    if (q == digits || q - digits > 9) return false;
    if (*q == '.') { /* ".<nanoseconds>" */
        const char *r = ++q;
        while (*q >= '0' && *q <= '9') q++;
        if (q == r || q - r > 9) return false;
    }
    if (*q) return false;
    size_t base_len = (size_t)(t - name);
    if (base_len == 0 || base_len >= cap) return false;
    memcpy(base, name, base_len);
    base[base_len] = '\0';
    *pid = strtol(digits, NULL, 10);
    return true;
}

void fs_remove_stale_tmps(const char *dir, FsTmpOwner owns, void *ctx, bool own_pid_is_stale, long min_age_s) {
    DIR *d = opendir(dir);
    if (!d) return;
    time_t now = time(NULL);
    struct dirent *e;
    while ((e = readdir(d))) {
        char base[256], p[FS_PATH_MAX];
        long pid;
        if (!fs_parse_tmp_name(e->d_name, base, sizeof base, &pid) || !owns(base, ctx)) continue;
        bool gone = pid == (long)getpid() ? own_pid_is_stale : pid > 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH;
        if (!gone) continue;
        int n = snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat sb;
        if (n < 0 || (size_t)n >= sizeof p || lstat(p, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
        if (min_age_s > 0 && now - sb.st_mtime < min_age_s) continue;
        unlink(p);
    }
    closedir(d);
}

static bool owns_one(const char *base, void *ctx) { return strcmp(base, (const char *)ctx) == 0; }

bool fs_parent_dir(const char *path, char *dir, size_t cap) {
    const char *slash = strrchr(path, '/');
    size_t len = !slash ? 1 : slash == path ? 1 : (size_t)(slash - path);
    if (len >= cap) return false;
    if (!slash || slash == path) memcpy(dir, slash ? "/" : ".", 2);
    else {
        memcpy(dir, path, len);
        dir[len] = '\0';
    }
    return true;
}

void fs_remove_stale_tmps_of(const char *path, long min_age_s) {
    char dir[FS_PATH_MAX];
    if (!fs_parent_dir(path, dir, sizeof dir)) return;
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    if (!base[0]) return;
    fs_remove_stale_tmps(dir, owns_one, (void *)base, false, min_age_s);
}

int fs_pread_full(int fd, void *buf, size_t len, uint64_t off, size_t *got) {
    *got = 0;
    while (*got < len) {
        ssize_t r = pread(fd, (uint8_t *)buf + *got, len - *got, (off_t)(off + *got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        *got += (size_t)r;
    }
    return 0;
}
