/* checkpoint_internal.h - the atomic-write helpers checkpoint.c shares with
 * checkpoint_dir.c (not a public interface: checkpoint.h is). */
#ifndef QTRAIN_TRAINER_CHECKPOINT_INTERNAL_H
#define QTRAIN_TRAINER_CHECKPOINT_INTERNAL_H

#include <stddef.h>

#include "nn/error.h"

#define CKPT_PATH_MAX 4096

/* QT_ERR_IO "cannot save checkpoint <path>: <what> <file> failed: <errno
 * text>; <what to do about it>". */
QtStatus ckpt_save_fail(QtError *err, const char *path, const char *what, const char *file, int e);

/* fsync of the directory holding `path`, so a rename into it survives a crash. */
QtStatus ckpt_sync_parent_dir(const char *path, QtError *err);

/* buf[len] -> "<path>.tmp.<pid>", fsync, rename over path, fsync the
 * directory. Until the rename, path is untouched; on failure the temp file
 * is removed. */
QtStatus ckpt_write_atomic(const char *path, const void *buf, size_t len, QtError *err);

#endif
