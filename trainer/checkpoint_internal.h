/* checkpoint_internal.h - what checkpoint.c, checkpoint_net.c,
 * checkpoint_dir.c and checkpoint_inspect.c share: the atomic write, the
 * finite-value check, object paths, and the /quant, /lora and QAT/QT state
 * of checkpoint_net.c (not a public interface: checkpoint.h is). */
#ifndef QTRAIN_TRAINER_CHECKPOINT_INTERNAL_H
#define QTRAIN_TRAINER_CHECKPOINT_INTERNAL_H

#include <stddef.h>

#include "base/error.h"
#include "quant/calib.h"
#include "quant/qarray.h"
#include "trainer/checkpoint.h"
#include "trainer/h5io.h"

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

/* ---- /quant and /lora (checkpoint_net.c) ---- */

/* What a load reads before anything is applied. */
typedef struct {
    QArray *weights;      /* [n_qlayers] new QArrays laid out like the layers' own */
    CalibRunning *act;    /* [n_qlayers] activation statistics (count 0 when the layer has none) */
    float *act_scale;     /* [2 * n_qlayers] the stored input scale and zero point (NaN: none stored) */
    float *lora;          /* A then B of every adapter, in order */
    float *qat_ranges;    /* learned range values of every QAT layer, weight then input, in order */
    CalibRunning *qat_act;/* [n_qat] input statistics */
    Rng *fqt_rngs;         /* [n_qt] */
    int n_weights;        /* QArrays allocated so far (for freeing) */
} CkptNetStaged;

QtStatus ckpt_write_quant(H5ioFile *f, const CheckpointNet *net, QtError *err);
QtStatus ckpt_write_lora(H5ioFile *f, const CheckpointNet *net, QtError *err);
QtStatus ckpt_write_qat(H5ioFile *f, const CheckpointNet *net, QtError *err);
QtStatus ckpt_read_qat(const H5ioFile *f, const CheckpointNet *net, CkptNetStaged *sg, QtError *err);
/* Checks every group net needs and reads it into sg (allocated here; free
 * with ckpt_staged_net_free). Either part of net may be empty. */
QtStatus ckpt_read_quant(const H5ioFile *f, const CheckpointNet *net, CkptNetStaged *sg, QtError *err);
QtStatus ckpt_read_lora(const H5ioFile *f, const CheckpointNet *net, CkptNetStaged *sg, QtError *err);
/* The stored rank, alpha and rslora attributes of each of net's adapters
 * against its spec (QT_ERR_CONFIG naming the module and both values). */
QtStatus ckpt_check_lora_specs(const H5ioFile *f, const CheckpointNet *net, QtError *err);
/* Moves the staged data into net's layers and adapters. */
void ckpt_commit_net(CkptNetStaged *sg, const CheckpointNet *net);
void ckpt_staged_net_free(CkptNetStaged *sg);
/* The names of the direct children of `group` (module paths), up to cap;
 * more is QT_ERR_FORMAT. */
QtStatus ckpt_list_group(const H5ioFile *f, const char *group, char (*names)[MODULE_NAME_MAX], int cap, int *n,
                         QtError *err);

#endif
