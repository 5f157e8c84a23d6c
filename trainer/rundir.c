/* rundir.c - the exclusive lock of a run directory (rundir.h). */
#include "rundir.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/fsutil.h"

/* The pid that holds fd's lock: the kernel's answer, else what the file says. */
static long lock_holder(int fd) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    if (fcntl(fd, F_GETLK, &fl) == 0 && fl.l_type != F_UNLCK && fl.l_pid > 0) return (long)fl.l_pid;
    char buf[32] = "";
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    return n > 0 ? strtol(buf, NULL, 10) : 0;
}

QtStatus rundir_lock(const char *out_dir, RunDirLock *lk, QtError *err) {
    memset(lk, 0, sizeof *lk);
    int n = snprintf(lk->path, sizeof lk->path, "%s/%s", out_dir, RUNDIR_LOCK_NAME);
    if (n < 0 || (size_t)n >= sizeof lk->path)
        return qt_error_set(err, QT_ERR_ARG, "the path %s/%s is too long; give a shorter directory", out_dir,
                            RUNDIR_LOCK_NAME);
    /* A holder that removes .lock (rundir_unlock(.., true)) may do so after we opened it: then we would lock
     * an unlinked file while another process locks the new one. Locking again catches that. */
    for (int attempt = 0; attempt < 8; attempt++) {
        int fd = open(lk->path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0666);
        if (fd < 0)
            return qt_error_set(err, QT_ERR_IO, "cannot open the lock file %s: %s; %s", lk->path, strerror(errno),
                                errno == ELOOP ? "it is a symbolic link; remove it" :
                                "make the directory writable or choose another one");
        struct stat a, b;
        if (fstat(fd, &a) != 0 || !S_ISREG(a.st_mode)) {
            close(fd);
            return qt_error_set(err, QT_ERR_IO, "the lock file %s is not a regular file; remove it", lk->path);
        }
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
        if (fcntl(fd, F_SETLK, &fl) != 0) {
            int e = errno;
            long pid = e == EACCES || e == EAGAIN ? lock_holder(fd) : 0;
            close(fd);
            if (e == EACCES || e == EAGAIN)
                return qt_error_set(err, QT_ERR_IO, "%s is in use by another qtrain process (pid %ld holds %s); wait "
                                    "for it to end, or use another directory", out_dir, pid, lk->path);
            return qt_error_set(err, QT_ERR_IO, "cannot lock %s: %s", lk->path, strerror(e));
        }
        if (stat(lk->path, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
            close(fd); /* unlinked or replaced meanwhile: lock the file that is there now */
            continue;
        }
        char pid[32];
        int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
        if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len) {
            /* the pid is for people (cat .lock); without it the lock holds all the same */
        }
        lk->fd = fd;
        lk->held = true;
        return QT_OK;
    }
    return qt_error_set(err, QT_ERR_IO, "cannot lock %s: it keeps being replaced; check who removes it", lk->path);
}

QtStatus rundir_lock_if_run(const char *file, RunDirLock *lk, QtError *err) {
    memset(lk, 0, sizeof *lk);
    char dir[4096], probe[4096 + 8];
    if (!fs_parent_dir(file, dir, sizeof dir))
        return qt_error_set(err, QT_ERR_ARG, "the path %s is too long; give a shorter path", file);
    snprintf(probe, sizeof probe, "%s/%s", dir, RUNDIR_LOCK_NAME);
    struct stat sb;
    if (lstat(probe, &sb) != 0) return QT_OK; /* not a run directory */
    return rundir_lock(dir, lk, err);
}

void rundir_unlock(RunDirLock *lk, bool remove_file) {
    if (!lk->held) return;
    if (remove_file) unlink(lk->path);
    close(lk->fd);
    lk->held = false;
    lk->fd = -1;
}
