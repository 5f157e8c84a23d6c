/* checkpoint_internal.h - what checkpoint.c, checkpoint_net.c,
 * checkpoint_buffers.c, checkpoint_dir.c and checkpoint_inspect.c share: the atomic write, the
 * finite-value check, object paths, and the hook layers' part of
 * checkpoint_net.c, which the hook kinds' files (trainer/hook_*.c) use too
 * (not a public interface: checkpoint.h is). */
#ifndef QTRAIN_TRAINER_CHECKPOINT_INTERNAL_H
#define QTRAIN_TRAINER_CHECKPOINT_INTERNAL_H

#include <stddef.h>

#include "base/error.h"
#include "quant/calib.h"
#include "quant/qarray.h"
#include "trainer/checkpoint.h"
#include "base/h5io.h"

#define CKPT_OBJ_MAX 192      /* "optim/" + a param name + "/m" */
#define CKPT_MODULES_MAX CKPT_LIST_MAX

#define CKPT_PATH_MAX 4096

/* QT_ERR_IO "cannot save checkpoint <path>: <what> <file> failed: <errno
 * text>; <what to do about it>". */
QtStatus ckpt_save_fail(QtError *err, const char *path, const char *what, const char *file, int e);

/* fsync of the directory holding `path`, so a rename into it survives a crash. */
QtStatus ckpt_sync_parent_dir(const char *path, QtError *err);

/* buf[len] -> "<path>.tmp.<pid>" (fs_open_tmp: never through a symlink),
 * fsync, rename onto path as `how` allows, fsync the directory. Until the
 * rename, path is untouched; on failure the temp file is removed. */
QtStatus ckpt_write_atomic(const char *path, const void *buf, size_t len, FsReplace how, QtError *err);

/* QT_ERR_FORMAT naming file, dataset ds, index and value if x[n] holds a
 * NaN or an infinity. */
QtStatus ckpt_check_finite(const H5ioFile *f, const char *ds, const float *x, size_t n, QtError *err);

/* "a/b" or "a/b/c" into out[CKPT_OBJ_MAX]; QT_ERR_ARG if too long. */
QtStatus ckpt_obj_path(char *out, const char *a, const char *b, const char *c, QtError *err);

/* checkpoint_buffers.c: every batch norm's running statistics under /buffers/<module>/ (only: [n_modules] those
 * of the modules it marks, an adapters.h5's; NULL: all). */
QtStatus ckpt_write_buffers(H5ioFile *f, const Model *m, const bool *only, QtError *err);
/* Checks and reads them into staging: fbuf (2 C floats per batch-norm module, mean then variance) and ibuf (one
 * count and the folded attribute (BnFold, 0 if absent) per module), in module order. A missing dataset is an error naming the module; a negative or non-finite
 * statistic or a negative count is a damaged file. only (an adapters.h5): [n_modules] the modules to read if the
 * file has them; the others are staged as they are; NULL: all, each required. */
QtStatus ckpt_read_buffers(const H5ioFile *f, const Model *m, const bool *only, float *fbuf, int64_t *ibuf,
                           QtError *err);
/* Applies what ckpt_read_buffers staged. */
void ckpt_commit_buffers(Model *m, const float *fbuf, const int64_t *ibuf);

/* What to do about a value no run writes (a flipped bit, a file edited or written by another tool). */
#define DAMAGED_HINT "the checkpoint is damaged: resume from an earlier checkpoint, or write it again (qtrain " \
                     "quantize for a PTQ base, or the run that saved it)"

/* ---- the hook layers (checkpoint_net.c, through each kind: trainer/hook.h) ---- */

/* What a load reads before anything is applied: per set of the
 * CheckpointNet (same index), its kind's staged state of every layer
 * ([n] of staged_size bytes in layers). */
typedef struct {
    HookSet sets[HOOK_KINDS_MAX];
} CkptNetStaged;

/* Every layer of every kind, its top group made before its first layer. */
QtStatus ckpt_write_net(H5ioFile *f, const CheckpointNet *net, QtError *err);
/* Checks everything net's layers need and reads it into sg (allocated
 * here; free with ckpt_staged_net_free, also on error). */
QtStatus ckpt_read_net(const H5ioFile *f, const CheckpointNet *net, CkptNetStaged *sg, QtError *err);
/* Moves the staged state into net's layers. */
void ckpt_commit_net(CkptNetStaged *sg, const CheckpointNet *net);
void ckpt_staged_net_free(CkptNetStaged *sg);
/* CalibRunning stored as attributes of obj: calibration, lo_mean, hi_mean,
 * count; checked (QT_ERR_FORMAT naming file and object). */
QtStatus ckpt_read_running_stats(const H5ioFile *f, const char *obj, CalibRunning *out, QtError *err);
/* The names of the direct children of `group` (module paths), up to cap;
 * more is QT_ERR_FORMAT. */
QtStatus ckpt_list_group(const H5ioFile *f, const char *group, char (*names)[MODULE_NAME_MAX], int cap, int *n,
                         QtError *err);

#endif
