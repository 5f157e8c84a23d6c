/* fsutil.h - writing files safely on a shared machine: what an output path
 * may be, temp files that never follow a symlink, and removing the temp
 * files that dead writers left behind.
 *
 * Every file qtrain writes is written as "<name>.tmp.<pid>" (the IDX cache:
 * "<name>.tmp.<pid>.<nanoseconds>") in the directory of <name> and renamed
 * over it. rename() replaces whatever is at <name> (a symlink itself, not
 * its target; a device node or FIFO too), so a path the user names is
 * checked first with fs_check_out_path. Lives in nn/ beside error.h because
 * data/ (the IDX cache) and trainer/ both use it. */
#ifndef QTRAIN_NN_FSUTIL_H
#define QTRAIN_NN_FSUTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/error.h"

/* What the final rename may replace. */
typedef enum {
    FS_REPLACE_ANY = 0, /* a run's own file in its locked out_dir: whatever is there */
    FS_REPLACE_REGULAR, /* nothing, or a regular file (--force) */
    FS_REPLACE_NONE     /* nothing: the rename fails with EEXIST if something appeared meanwhile */
} FsReplace;

/* Whether `path` may be written as an output file: nothing exists under that
 * name, or (only with force) a regular file does. A directory, symlink,
 * device, FIFO or socket is refused by kind whatever force says, and so is
 * an empty path. QT_ERR_ARG: `what` names the option ("--out"). */
QtStatus fs_check_out_path(const char *path, bool force, const char *what, QtError *err);

/* Creates "<path>.tmp.<pid>" for writing: a leftover of that name is
 * unlinked first, then it is opened with O_CREAT|O_EXCL|O_NOFOLLOW, so a
 * symlink or file planted under the temp name is never followed or
 * reused. Writes the name into tmp[cap]. Returns the descriptor, or -1 with
 * errno set (ENAMETOOLONG if the name does not fit). */
int fs_open_tmp(const char *path, char *tmp, size_t cap);

/* Renames the finished temp file onto path as `how` allows (FS_REPLACE_NONE
 * uses renameat2(RENAME_NOREPLACE), or link+unlink where the file system
 * lacks it). Returns 0, or -1 with errno set (EEXIST: something is at path
 * that `how` does not let us replace); the temp file stays on failure. */
int fs_rename_tmp(const char *tmp, const char *path, FsReplace how);

/* fs_open_tmp as a stdio stream; NULL with errno set (no temp file left). */
FILE *fs_fopen_tmp(const char *path, char *tmp, size_t cap);

/* Flushes, fsyncs and closes f (from fs_fopen_tmp) and renames tmp onto
 * path as fs_rename_tmp does. Returns 0, or -1 with errno set; f is closed
 * and the temp file removed either way. */
int fs_fcommit_tmp(FILE *f, const char *tmp, const char *path, FsReplace how);

/* "<base>.tmp.<pid>" or "<base>.tmp.<pid>.<digits>" -> base (into
 * base[cap]) and pid. False for any other name. */
bool fs_parse_tmp_name(const char *name, char *base, size_t cap, long *pid);

/* Whether a temp file's base name is one the caller writes. */
typedef bool (*FsTmpOwner)(const char *base, void *ctx);

/* Removes the temp files in dir whose base `owns` claims and whose writer
 * is gone: its pid no longer exists (kill(pid, 0) fails with ESRCH), or it
 * is this process and own_pid_is_stale (no write of ours is in flight), and
 * the file was last changed at least min_age_s seconds ago (a writer in
 * another pid namespace shows as a dead pid; the age spares it). Only
 * regular files are removed; errors are ignored (best effort). */
void fs_remove_stale_tmps(const char *dir, FsTmpOwner owns, void *ctx, bool own_pid_is_stale, long min_age_s);

/* The directory holding `path` into dir[cap]: "." for a bare name, "/" for
 * a file at the root. False (dir untouched) when it does not fit. */
bool fs_parent_dir(const char *path, char *dir, size_t cap);

/* fs_remove_stale_tmps for the temp files of one output file `path`, in its
 * directory; this process's own are left alone. */
void fs_remove_stale_tmps_of(const char *path, long min_age_s);

/* pread of exactly len bytes at off (EINTR retried): 0, with *got the bytes read before the end of the file;
 * -1 (errno set) on a read error. */
int fs_pread_full(int fd, void *buf, size_t len, uint64_t off, size_t *got);

#endif
