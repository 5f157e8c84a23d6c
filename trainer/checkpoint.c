/* checkpoint.c - HDF5 checkpoints (layout in checkpoint.h).
 *
 * A checkpoint is built in memory (h5io), then written with write(2) to a
 * temporary name, fsync'd, renamed and its directory fsync'd. Loading checks
 * the whole file against the model, optimizer and state first and reads into
 * a staging buffer, so a bad file never leaves a half-restored run. A run's
 * directory (ckpt-<step>.h5, last.h5, rotation) is checkpoint_dir.c's, the
 * `qtrain inspect` listing checkpoint_inspect.c's. */
#include "checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint_internal.h"
#include "base/h5io.h"
#include "version.h"

/* ---- small helpers -------------------------------------------------------------- */

QtStatus ckpt_obj_path(char *out, const char *a, const char *b, const char *c, QtError *err) {
    int n = snprintf(out, CKPT_OBJ_MAX, "%s/%s%s%s", a, b, c ? "/" : "", c ? c : "");
    if (n < 0 || n >= CKPT_OBJ_MAX)
        return qt_error_set(err, QT_ERR_ARG, "checkpoint object name %s/%s is too long", a, b);
    return QT_OK;
}

/* What a user can do about a failed write, by errno (buf[cap]: room for the file-size limit's hint). */
static const char *save_hint(int e, char *buf, size_t cap) {
    switch (e) {
    case EFBIG: return qt_file_too_large_hint(buf, cap);
    case ENOSPC:
    case EDQUOT: return "free disk space or change run.out_dir";
    case ENOENT:
    case ENOTDIR: return "create the directory or change run.out_dir";
    case EACCES:
    case EPERM:
    case EROFS: return "make the directory writable or change run.out_dir";
    default: return "check the disk and run.out_dir";
    }
}

QtStatus ckpt_save_fail(QtError *err, const char *path, const char *what, const char *file, int e) {
    char hint[160];
    return qt_error_set(err, QT_ERR_IO, "cannot save checkpoint %s: %s %s failed: %s; %s", path, what, file,
                        strerror(e), save_hint(e, hint, sizeof hint));
}

/* fsync of the directory holding `path`, so a rename survives a crash.
 * File systems that cannot sync directories (EINVAL) are accepted. */
QtStatus ckpt_sync_parent_dir(const char *path, QtError *err) {
    char dir[CKPT_PATH_MAX];
    if (!fs_parent_dir(path, dir, sizeof dir))
        return ckpt_save_fail(err, path, "finding the directory of", path, ENAMETOOLONG);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ckpt_save_fail(err, path, "opening directory", dir, errno);
    int rc = fsync(fd), e = errno;
    close(fd);
    if (rc != 0 && e != EINVAL && e != ENOTSUP)
        return qt_error_set(err, QT_ERR_IO, "checkpoint %s was written but syncing its directory %s failed: %s; it "
                            "may not survive a crash; check the disk", path, dir, strerror(e));
    return QT_OK;
}

static QtStatus write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return QT_ERR_IO;
        if (w == 0) {
            errno = ENOSPC;
            return QT_ERR_IO;
        }
        p += w;
        len -= (size_t)w;
    }
    return QT_OK;
}

/* buf -> "<path>.tmp.<pid>", fsync, rename onto path, fsync the directory.
 * Until the rename, path is untouched; on failure the temp file is removed. */
QtStatus ckpt_write_atomic(const char *path, const void *buf, size_t len, FsReplace how, QtError *err) {
    char tmp[CKPT_PATH_MAX];
    int fd = fs_open_tmp(path, tmp, sizeof tmp);
    if (fd < 0 && errno == ENAMETOOLONG)
        return qt_error_set(err, QT_ERR_ARG, "checkpoint path %s is too long; give a shorter run.out_dir or --out",
                            path);
    if (fd < 0) return ckpt_save_fail(err, path, "creating", tmp, errno);
    const char *what = "writing";
    if (write_all(fd, buf, len) != QT_OK) goto fail;
    what = "syncing";
    if (fsync(fd) != 0) goto fail;
    what = "closing";
    int rc = close(fd);
    fd = -1;
    if (rc != 0) goto fail;
    what = "renaming";
    if (fs_rename_tmp(tmp, path, how) != 0) goto fail;
    return ckpt_sync_parent_dir(path, err);
fail:;
    int e = errno;
    if (fd >= 0) close(fd);
    unlink(tmp);
    if (e == EEXIST && how == FS_REPLACE_NONE)
        return qt_error_set(err, QT_ERR_IO, "cannot save %s: something appeared under that name while it was written; "
                            "nothing was replaced; pass --force to replace a regular file, or give another path", path);
    if (e == EEXIST && how == FS_REPLACE_REGULAR)
        return qt_error_set(err, QT_ERR_IO, "cannot save %s: it is no longer a regular file; nothing was replaced; "
                            "give another path", path);
    return ckpt_save_fail(err, path, what, tmp, e);
}

/* ---- writing ------------------------------------------------------------------------ */

static QtStatus write_header(H5ioFile *f, const CheckpointState *s, QtError *err) {
    QtStatus st = h5io_attr_write_str(f, "", "format", CHECKPOINT_FORMAT, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "", "version", CHECKPOINT_VERSION, err);
    if (st == QT_OK) st = h5io_attr_write_str(f, "", "qtrain_version", QTRAIN_VERSION, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "", "step", s->step, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "", "epoch", s->epochs_done, err);
    if (st == QT_OK) st = h5io_attr_write_str(f, "", "config", s->config_text ? s->config_text : "", err);
    if (st == QT_OK && s->mode) st = h5io_attr_write_str(f, "", "mode", s->mode, err);
    if (st == QT_OK && s->base_sha256) st = h5io_attr_write_str(f, "", "base_hash", CHECKPOINT_BASE_HASH, err);
    if (st == QT_OK && s->base_sha256) st = h5io_attr_write_str(f, "", "base_sha256", s->base_sha256, err);
    if (st == QT_OK && s->base_sha256)
        st = h5io_attr_write_str(f, "", "base_init_from", s->base_init_from ? s->base_init_from : "", err);
    if (st == QT_OK && s->lora_trainable) st = h5io_attr_write_str(f, "", "lora_trainable", s->lora_trainable, err);
    if (st == QT_OK && s->lora_batchnorm) st = h5io_attr_write_str(f, "", "lora_batchnorm", s->lora_batchnorm, err);
    if (st == QT_OK && s->merged_from) st = h5io_attr_write_str(f, "", "merged_from", s->merged_from, err);
    if (st == QT_OK && s->merged_from)
        st = h5io_attr_write_str(f, "", "merged_from_base_sha256",
                                 s->merged_from_base_sha256 ? s->merged_from_base_sha256 : "", err);
    return st;
}

/* trainable_only: adapters.h5 keeps only the parameters a LoRA run trains. */
static QtStatus write_params(H5ioFile *f, const Model *m, bool trainable_only, QtError *err) {
    QtStatus st = h5io_group_create(f, "params", err);
    for (int i = 0; st == QT_OK && i < m->n_params; i++) {
        const Param *p = &m->params[i];
        if (p->released || (trainable_only && !p->trainable)) continue; /* a quantized weight lives in /quant */
        char ds[CKPT_OBJ_MAX];
        st = ckpt_obj_path(ds, "params", p->name, NULL, err);
        if (st == QT_OK) st = h5io_write_f32(f, ds, p->var.value.data, p->var.value.ndim, p->var.value.shape, err);
    }
    return st;
}

static QtStatus write_optim(H5ioFile *f, const Optimizer *o, QtError *err) {
    QtStatus st = h5io_group_create(f, "optim", err);
    if (st == QT_OK) st = h5io_attr_write_str(f, "optim", "optimizer", optim_kind_name(o->cfg.kind), err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "optim", "step", o->step, err);
    for (int i = 0; st == QT_OK && i < o->n_params; i++) {
        const Tensor *t = &o->params[i]->var.value;
        char g[CKPT_OBJ_MAX], ds[CKPT_OBJ_MAX];
        st = ckpt_obj_path(g, "optim", o->params[i]->name, NULL, err);
        if (st == QT_OK) st = h5io_group_create(f, g, err);
        if (st == QT_OK) st = h5io_attr_write_i64(f, g, "step", o->step, err);
        if (st == QT_OK && o->m && (st = ckpt_obj_path(ds, "optim", o->params[i]->name, "m", err)) == QT_OK)
            st = h5io_write_f32(f, ds, o->m[i], t->ndim, t->shape, err);
        if (st == QT_OK && o->v && (st = ckpt_obj_path(ds, "optim", o->params[i]->name, "v", err)) == QT_OK)
            st = h5io_write_f32(f, ds, o->v[i], t->ndim, t->shape, err);
    }
    return st;
}

static QtStatus check_rng_names(const CheckpointState *s, QtError *err) {
    if (s->n_rngs < 0 || s->n_rngs > CHECKPOINT_MAX_RNGS)
        return qt_error_set(err, QT_ERR_ARG, "checkpoint state: n_rngs = %d is not in 0..%d", s->n_rngs,
                            CHECKPOINT_MAX_RNGS);
    for (int i = 0; i < s->n_rngs; i++) {
        const char *name = s->rngs[i].name;
        if (!name || !name[0] || strchr(name, '/') || strlen(name) > 64 || !s->rngs[i].rng)
            return qt_error_set(err, QT_ERR_ARG, "checkpoint state: rng %d needs a generator and a name of 1..64 "
                                "characters without '/' (got '%s')", i, name ? name : "(null)");
    }
    return QT_OK;
}

/* The numerical guards' state (trainer/guard.h), so a resumed run counts
 * and reports as an uninterrupted one would. */
static QtStatus write_guards(H5ioFile *f, const CheckpointState *s, QtError *err) {
    const LossWatch *w = &s->loss_watch;
    QtStatus st = h5io_attr_write_i64(f, "train", "nonfinite_skipped", s->nonfinite_skipped, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "train", "nonfinite_streak", s->nonfinite_streak, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, "train", "loss_mean_fast", w->fast, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, "train", "loss_mean_slow", w->slow, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "train", "loss_mean_steps", w->steps, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "train", "diverging", w->diverging, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "train", "divergences", w->occurrences, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "train", "world_size", s->world_size > 0 ? s->world_size : 1, err);
    return st;
}

static QtStatus write_state(H5ioFile *f, const CheckpointState *s, QtError *err) {
    QtStatus st = h5io_group_create(f, "data", err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "data", "epoch", s->epoch, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "data", "cursor", s->cursor, err);
    if (st == QT_OK) st = h5io_attr_write_u64(f, "data", "seed", s->seed, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "data", "n_train", s->n_train, err);
    if (st == QT_OK) st = h5io_group_create(f, "train", err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, "train", "loss_sum", s->log_loss_sum, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "train", "correct", s->log_correct, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "train", "seen", s->log_seen, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "train", "steps", s->log_steps, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, "train", "train_s", s->train_s, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, "train", "wall_s", s->wall_s, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, "train", "trained_examples", s->trained_examples, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, "train", "last_train_loss", s->last_train_loss, err);
    if (st == QT_OK) st = write_guards(f, s, err);
    if (st == QT_OK) st = h5io_group_create(f, "rng", err);
    for (int i = 0; st == QT_OK && i < s->n_rngs; i++) {
        const Rng *r = s->rngs[i].rng;
        char g[CKPT_OBJ_MAX];
        st = ckpt_obj_path(g, "rng", s->rngs[i].name, NULL, err);
        if (st == QT_OK) st = h5io_group_create(f, g, err);
        if (st == QT_OK) st = h5io_attr_write_u64(f, g, "seed", r->seed, err);
        if (st == QT_OK) st = h5io_attr_write_u64(f, g, "stream", r->stream, err);
        if (st == QT_OK) st = h5io_attr_write_u64(f, g, "counter", r->counter, err);
    }
    return st;
}

/* The whole checkpoint as the bytes of an HDF5 file. */
static QtStatus build_image(const char *path, const Model *m, const Optimizer *opt, const CheckpointState *s,
                            void **image, size_t *size, QtError *err) {
    H5ioFile f = H5IO_FILE_INIT;
    size_t hint = model_param_bytes(m) + (opt ? optim_state_bytes(opt) : 0) + ((size_t)1 << 16);
    QtStatus st = h5io_create_mem(&f, path, hint, err);
    if (st == QT_OK) st = write_header(&f, s, err);
    if (st == QT_OK) st = write_params(&f, m, false, err);
    if (st == QT_OK) st = ckpt_write_buffers(&f, m, NULL, err);
    if (st == QT_OK) st = ckpt_write_net(&f, &s->net, err);
    if (st == QT_OK && opt) st = write_optim(&f, opt, err);
    if (st == QT_OK) st = write_state(&f, s, err);
    if (st == QT_OK) st = h5io_image(&f, image, size, err);
    QtStatus cst = h5io_close(&f, err);
    if (st == QT_OK && cst != QT_OK) {
        free(*image);
        *image = NULL;
        st = cst;
    }
    return st;
}

QtStatus checkpoint_save_image(const char *path, const Model *m, const Optimizer *opt, const CheckpointState *s,
                               void **image, size_t *size, QtError *err) {
    *image = NULL, *size = 0;
    QtStatus st = check_rng_names(s, err);
    return st == QT_OK ? build_image(path, m, opt, s, image, size, err) : st;
}

QtStatus checkpoint_save(const char *path, const Model *m, const Optimizer *opt, const CheckpointState *s,
                         QtError *err) {
    if (!path || !path[0] || !m) return qt_error_set(err, QT_ERR_ARG, "checkpoint_save: no path or no model");
    CheckpointState none = {.step = opt ? opt->step : 0, .last_train_loss = NAN};
    if (!s) s = &none;
    QtStatus st = check_rng_names(s, err);
    if (st != QT_OK) return st;
    void *image = NULL;
    size_t size = 0;
    st = build_image(path, m, opt, s, &image, &size, err);
    if (st == QT_OK) st = ckpt_write_atomic(path, image, size, s->replace, err);
    free(image);
    return st;
}

/* ---- checking a file against the run -------------------------------------------------- */

#define MODEL_HINT "the checkpoint was written for a different model; check model.layers against the checkpoint's " \
                   "config (qtrain inspect %s)"

static QtStatus check_header(const H5ioFile *f, QtError *err) {
    if (!h5io_attr_exists(f, "", "format"))
        return qt_error_set(err, QT_ERR_FORMAT,
                            "%s is an HDF5 file but not a qtrain checkpoint (no 'format' attribute)", f->path);
    char *fmt = NULL;
    QtStatus st = h5io_attr_read_str(f, "", "format", &fmt, err);
    char shown[QT_CLIP_BUF];
    if (st == QT_OK && strcmp(fmt, CHECKPOINT_FORMAT) != 0)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s is an HDF5 file but not a qtrain checkpoint (its format is '%s')",
                          f->path, qt_clip(fmt, shown));
    free(fmt);
    int64_t version = 0;
    if (st == QT_OK) st = h5io_attr_read_i64(f, "", "version", &version, err);
    if (st == QT_OK && version != CHECKPOINT_VERSION)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s is a qtrain checkpoint of format version %lld, but this qtrain (%s) "
                          "reads version %d; use the qtrain release that wrote it", f->path, (long long)version,
                          QTRAIN_VERSION, CHECKPOINT_VERSION);
    return st;
}

/* A float dataset `ds` (float32 for optimizer state) of exactly t's shape, or an error naming what
 * `what` is ("parameter conv1/weight") and both shapes. */
static QtStatus check_dataset(const H5ioFile *f, const char *ds, const char *what, const Tensor *t, bool model_hint,
                              QtError *err) {
    char want[64], got[128], ty[32], hint[CKPT_PATH_MAX + 160] = "";
    tensor_shape_str(t, want, sizeof want);
    if (model_hint) snprintf(hint, sizeof hint, "; " MODEL_HINT, f->path);
    const char *against = model_hint ? "the model" : "the optimizer";
    H5ioKind k = h5io_kind(f, ds);
    if (k == H5IO_MISSING)
        return qt_error_set(err, QT_ERR_FORMAT, "%s does not match %s: %s %s is missing from the checkpoint (/%s)%s",
                            f->path, against, what, want, ds, hint);
    if (k == H5IO_OTHER)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s (%s) is a soft or external link, which qtrain does not "
                            "follow (see docs/SECURITY.md)", f->path, ds, what);
    if (k != H5IO_DATASET)
        return qt_error_set(err, QT_ERR_FORMAT, "%s does not match %s: /%s (%s) is not a dataset%s", f->path, against,
                            ds, what, hint);
    H5ioInfo info;
    QtStatus st = h5io_dataset_info(f, ds, &info, err);
    if (st != QT_OK) return st;
    /* A parameter may be any float type (numpy and h5py write float64 by default): HDF5 converts it to float32
       on read. Optimizer state is only ever written by qtrain, as float32. */
    bool any_float = info.cls == H5T_FLOAT && (info.size == 2 || info.size == 4 || info.size == 8);
    if (model_hint ? !any_float : !h5io_is_f32(&info))
        return qt_error_set(err, QT_ERR_FORMAT, "%s does not match %s: %s is %s in the checkpoint, expected %s%s",
                            f->path, against, what, h5io_dtype_str(&info, ty, sizeof ty),
                            model_hint ? "float16, float32 or float64" : "float32", hint);
    if (!h5io_shape_equals(&info, t->ndim, t->shape))
        return qt_error_set(err, QT_ERR_FORMAT, "%s does not match %s: %s has shape %s in the checkpoint but %s in "
                            "the model%s", f->path, against, what, h5io_shape_str(&info, got, sizeof got), want, hint);
    return QT_OK;
}

typedef struct {
    const Model *m;
    char extra[CKPT_OBJ_MAX];
    H5ioKind extra_kind;
} ExtraCtx;

/* Stops at the first object under /params that no model parameter explains. */
static int find_extra(const char *path, H5ioKind kind, void *data) {
    ExtraCtx *c = data;
    size_t len = strlen(path);
    bool known = false;
    for (int i = 0; !known && i < c->m->n_params; i++) {
        const char *name = c->m->params[i].name;
        if (kind == H5IO_DATASET)
            known = strcmp(name, path) == 0;
        else if (kind == H5IO_GROUP)
            known = strncmp(name, path, len) == 0 && name[len] == '/';
    }
    if (known) return 0;
    snprintf(c->extra, sizeof c->extra, "%s", path);
    c->extra_kind = kind;
    return 1;
}

static QtStatus check_params(const H5ioFile *f, const Model *m, QtError *err) {
    if (h5io_kind(f, "params") != H5IO_GROUP)
        return qt_error_set(err, QT_ERR_FORMAT, "%s has no /params group; it is not a complete qtrain checkpoint",
                            f->path);
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < m->n_params; i++) {
        if (m->params[i].released) continue; /* held quantized: checked under /quant */
        char ds[CKPT_OBJ_MAX], what[PARAM_NAME_MAX + 16];
        snprintf(what, sizeof what, "parameter %s", m->params[i].name);
        st = ckpt_obj_path(ds, "params", m->params[i].name, NULL, err);
        if (st == QT_OK) st = check_dataset(f, ds, what, &m->params[i].var.value, true, err);
    }
    if (st != QT_OK) return st;
    ExtraCtx c = {.m = m};
    bool stopped = false;
    st = h5io_visit(f, "params", find_extra, &c, &stopped, err);
    if (st != QT_OK || !stopped) return st;
    char desc[160] = "";
    H5ioInfo info;
    char ds[CKPT_OBJ_MAX + 8], shape[128];
    snprintf(ds, sizeof ds, "params/%s", c.extra);
    if (c.extra_kind == H5IO_DATASET && h5io_dataset_info(f, ds, &info, NULL) == QT_OK)
        snprintf(desc, sizeof desc, " %s", h5io_shape_str(&info, shape, sizeof shape));
    char shown[QT_CLIP_BUF];
    return qt_error_set(err, QT_ERR_FORMAT, "%s does not match the model: the checkpoint has %s %s%s that the model "
                        "does not have; " MODEL_HINT, f->path, c.extra_kind == H5IO_DATASET ? "parameter" : "module",
                        qt_clip(c.extra, shown), desc, f->path);
}

static QtStatus check_optim(const H5ioFile *f, const Optimizer *o, QtError *err) {
    const char *want = optim_kind_name(o->cfg.kind);
    if (h5io_kind(f, "optim") != H5IO_GROUP)
        return qt_error_set(err, QT_ERR_FORMAT, "%s has no optimizer state (/optim); it was saved without one; start "
                            "a new run from its parameters (model.init_from) instead of resuming", f->path);
    char *name = NULL;
    QtStatus st = h5io_attr_read_str(f, "optim", "optimizer", &name, err);
    char shown[QT_CLIP_BUF];
    if (st == QT_OK && strcmp(name, want) != 0)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s was written by optimizer '%.32s' but this run uses '%s'; resume with "
                          "train.optimizer.name: %.32s, or start a new run from its parameters (model.init_from)",
                          f->path, qt_clip(name, shown), want, shown);
    free(name);
    for (int i = 0; st == QT_OK && i < o->n_params; i++) {
        const Param *p = o->params[i];
        const char *bufs[2] = {o->m ? "m" : NULL, o->v ? "v" : NULL};
        const char *labels[2] = {o->v ? "first moment" : "momentum buffer", "second moment"};
        for (int k = 0; st == QT_OK && k < 2; k++) {
            if (!bufs[k]) continue;
            char ds[CKPT_OBJ_MAX], what[PARAM_NAME_MAX + 64];
            snprintf(what, sizeof what, "the %s %s of %s", want, labels[k], p->name);
            st = ckpt_obj_path(ds, "optim", p->name, bufs[k], err);
            if (st == QT_OK && !h5io_exists(f, ds))
                st = qt_error_set(err, QT_ERR_FORMAT, "%s lacks %s (/%s); it was saved with other trainable "
                                  "parameters or optimizer settings (e.g. without momentum); resume with the same "
                                  "settings or start from its parameters (model.init_from)", f->path, what, ds);
            if (st == QT_OK) st = check_dataset(f, ds, what, &p->var.value, false, err);
        }
    }
    return st;
}

/* ---- reading ------------------------------------------------------------------------------ */

/* Everything read from the file before any of it is applied. */
typedef struct {
    float *buf;                        /* params, then m, then v, each in order */
    size_t n_param_floats, n_opt_floats; /* n_opt_floats: per buffer (m or v) */
    int64_t opt_step;
    CheckpointState state;
    Rng rngs[CHECKPOINT_MAX_RNGS];
} Staged;

/* A NaN or infinity in a stored tensor would train (or evaluate) to NaN
 * without a word; a run never saves one (trainer/guard.h stops it first). */
QtStatus ckpt_check_finite(const H5ioFile *f, const char *ds, const float *x, size_t n, QtError *err) {
    size_t bad = floats_first_nonfinite(x, n);
    if (bad == n) return QT_OK;
    return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s holds %g at index %zu; a checkpoint holds only finite values, "
                        "so this one is damaged; resume from an earlier checkpoint", f->path, ds, (double)x[bad], bad);
}

/* AdamW's second moment is a running mean of squared gradients: never
 * negative. A negative one loads without complaint and the next update
 * takes its square root, turning the weight into NaN. */
static QtStatus check_second_moment(const H5ioFile *f, const char *ds, const float *v, size_t n, QtError *err) {
    for (size_t i = 0; i < n; i++)
        if (v[i] < 0.0f)
            return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s holds %g at index %zu; AdamW's second moment v is a "
                                "mean of squared gradients and never negative, so this checkpoint is damaged; resume "
                                "from an earlier checkpoint", f->path, ds, (double)v[i], i);
    return QT_OK;
}

static QtStatus read_params(const H5ioFile *f, const Model *m, float *dst, QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < m->n_params; i++) {
        const Tensor *t = &m->params[i].var.value;
        char ds[CKPT_OBJ_MAX];
        st = ckpt_obj_path(ds, "params", m->params[i].name, NULL, err);
        if (st == QT_OK && !m->params[i].released) st = h5io_read_f32(f, ds, dst, t->ndim, t->shape, err);
        if (st == QT_OK && !m->params[i].released) st = ckpt_check_finite(f, ds, dst, tensor_numel(t), err);
        dst += tensor_numel(t);
    }
    return st;
}

/* The counts of a run (steps, epochs, positions, examples) are at most 2^53:
 * past that a double, which the schedule and the metrics count in, is no
 * longer exact, and no run gets there. A negative or larger count is a
 * damaged file, refused here rather than overflowing the step counter. */
#define CKPT_COUNT_MAX ((int64_t)1 << 53)

static QtStatus read_count(const H5ioFile *f, const char *obj, const char *name, int64_t *v, QtError *err) {
    QtStatus st = h5io_attr_read_i64(f, obj, name, v, err);
    if (st == QT_OK && (*v < 0 || *v > CKPT_COUNT_MAX))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: attribute '%s' of /%s is %lld, which is not a count of a run (0 "
                          "to 2^53); the checkpoint is damaged", f->path, name, obj, (long long)*v);
    return st;
}

static QtStatus read_optim(const H5ioFile *f, const Optimizer *o, Staged *sg, QtError *err) {
    QtStatus st = read_count(f, "optim", "step", &sg->opt_step, err);
    float *m = sg->buf + sg->n_param_floats, *v = m + sg->n_opt_floats;
    for (int i = 0; st == QT_OK && i < o->n_params; i++) {
        const Tensor *t = &o->params[i]->var.value;
        char ds[CKPT_OBJ_MAX];
        size_t n = tensor_numel(t);
        if (o->m && (st = ckpt_obj_path(ds, "optim", o->params[i]->name, "m", err)) == QT_OK &&
            (st = h5io_read_f32(f, ds, m, t->ndim, t->shape, err)) == QT_OK)
            st = ckpt_check_finite(f, ds, m, n, err);
        if (st == QT_OK && o->v && (st = ckpt_obj_path(ds, "optim", o->params[i]->name, "v", err)) == QT_OK &&
            (st = h5io_read_f32(f, ds, v, t->ndim, t->shape, err)) == QT_OK)
            st = ckpt_check_finite(f, ds, v, n, err);
        if (st == QT_OK && o->v) st = check_second_moment(f, ds, v, n, err);
        m += tensor_numel(t);
        v += tensor_numel(t);
    }
    return st;
}

/* The run totals of /train. A file without them is incomplete (or from a
 * qtrain that did not keep them): the message says which one is missing and
 * how to carry on, instead of h5io's bare "no attribute". */
static QtStatus read_totals(const H5ioFile *f, CheckpointState *t, QtError *err) {
    static const char *const names[] = {"train_s", "wall_s", "trained_examples", "last_train_loss"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!h5io_attr_exists(f, "train", names[i]))
            return qt_error_set(err, QT_ERR_FORMAT, "%s lacks the run total '%s' (an attribute of /train); it is not "
                                "a complete qtrain checkpoint of this version; start a new run from its parameters "
                                "(model.init_from)", f->path, names[i]);
    QtStatus st = h5io_attr_read_f64(f, "train", "train_s", &t->train_s, err);
    if (st == QT_OK) st = h5io_attr_read_f64(f, "train", "wall_s", &t->wall_s, err);
    if (st == QT_OK) st = read_count(f, "train", "trained_examples", &t->trained_examples, err);
    if (st == QT_OK) st = h5io_attr_read_f64(f, "train", "last_train_loss", &t->last_train_loss, err);
    return st;
}

/* The guards' state; a file written before they existed has none (zeros). */
static QtStatus read_guards(const H5ioFile *f, CheckpointState *t, QtError *err) {
    LossWatch *w = &t->loss_watch;
    memset(w, 0, sizeof *w);
    t->nonfinite_skipped = t->nonfinite_streak = 0;
    t->world_size = 1;
    if (h5io_attr_exists(f, "train", "world_size")) {
        QtStatus st = read_count(f, "train", "world_size", &t->world_size, err);
        if (st != QT_OK) return st;
        if (t->world_size < 1)
            return qt_error_set(err, QT_ERR_FORMAT, "%s: /train world_size is %lld, not a number of ranks; the "
                                "checkpoint is damaged", f->path, (long long)t->world_size);
    }
    if (!h5io_attr_exists(f, "train", "loss_mean_steps")) return QT_OK;
    int64_t diverging = 0;
    QtStatus st = read_count(f, "train", "nonfinite_skipped", &t->nonfinite_skipped, err);
    if (st == QT_OK) st = read_count(f, "train", "nonfinite_streak", &t->nonfinite_streak, err);
    if (st == QT_OK) st = h5io_attr_read_f64(f, "train", "loss_mean_fast", &w->fast, err);
    if (st == QT_OK) st = h5io_attr_read_f64(f, "train", "loss_mean_slow", &w->slow, err);
    if (st == QT_OK) st = read_count(f, "train", "loss_mean_steps", &w->steps, err);
    if (st == QT_OK) st = read_count(f, "train", "diverging", &diverging, err);
    if (st == QT_OK) st = read_count(f, "train", "divergences", &w->occurrences, err);
    if (st == QT_OK && (!isfinite(w->fast) || !isfinite(w->slow) || w->fast < 0 || w->slow < 0 || diverging > 1))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: the loss running means of /train (%g, %g) or its 'diverging' flag "
                          "(%lld) are out of range; the checkpoint is damaged", f->path, w->fast, w->slow,
                          (long long)diverging);
    w->diverging = diverging == 1;
    return st;
}

static QtStatus read_state(const H5ioFile *f, const CheckpointState *s, Staged *sg, QtError *err) {
    CheckpointState *t = &sg->state;
    *t = *s;
    QtStatus st = read_count(f, "", "step", &t->step, err);
    if (st == QT_OK) st = read_count(f, "data", "epoch", &t->epoch, err);
    if (st == QT_OK) st = read_count(f, "data", "cursor", &t->cursor, err);
    if (st == QT_OK) st = h5io_attr_read_u64(f, "data", "seed", &t->seed, err);
    if (st == QT_OK) st = read_count(f, "data", "n_train", &t->n_train, err);
    if (st == QT_OK) st = h5io_attr_read_f64(f, "train", "loss_sum", &t->log_loss_sum, err);
    if (st == QT_OK) st = read_count(f, "train", "correct", &t->log_correct, err);
    if (st == QT_OK) st = read_count(f, "train", "seen", &t->log_seen, err);
    if (st == QT_OK) st = read_count(f, "train", "steps", &t->log_steps, err);
    if (st == QT_OK) st = read_totals(f, t, err);
    if (st == QT_OK) st = read_guards(f, t, err);
    for (int i = 0; st == QT_OK && i < s->n_rngs; i++) {
        char g[CKPT_OBJ_MAX];
        Rng *r = &sg->rngs[i];
        st = ckpt_obj_path(g, "rng", s->rngs[i].name, NULL, err);
        if (st == QT_OK && h5io_kind(f, g) != H5IO_GROUP)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s has no state for the random generator '%s' (/%s); it was "
                              "saved by a run without it", f->path, s->rngs[i].name, g);
        if (st == QT_OK) st = h5io_attr_read_u64(f, g, "seed", &r->seed, err);
        if (st == QT_OK) st = h5io_attr_read_u64(f, g, "stream", &r->stream, err);
        if (st == QT_OK) st = h5io_attr_read_u64(f, g, "counter", &r->counter, err);
    }
    return st;
}

static void commit(const Staged *sg, Model *m, Optimizer *opt, CheckpointState *s) {
    const float *src = sg->buf;
    for (int i = 0; i < m->n_params; i++) {
        size_t n = var_numel(&m->params[i].var);
        if (!m->params[i].released) memcpy(m->params[i].var.value.data, src, n * sizeof(float));
        src += n;
    }
    if (opt) {
        const float *mm = sg->buf + sg->n_param_floats, *vv = mm + sg->n_opt_floats;
        for (int i = 0; i < opt->n_params; i++) {
            size_t n = var_numel(&opt->params[i]->var);
            if (opt->m) memcpy(opt->m[i], mm, n * sizeof(float));
            if (opt->v) memcpy(opt->v[i], vv, n * sizeof(float));
            mm += n;
            vv += n;
        }
        opt->step = sg->opt_step;
    }
    if (s) {
        const char *config_text = s->config_text;
        int n_rngs = s->n_rngs;
        *s = sg->state;
        s->config_text = config_text;
        for (int i = 0; i < n_rngs; i++) *s->rngs[i].rng = sg->rngs[i];
    }
}

static QtStatus stage_alloc(Staged *sg, const Model *m, const Optimizer *opt, QtError *err) {
    memset(sg, 0, sizeof *sg);
    sg->n_param_floats = model_param_count(m, false);
    for (int i = 0; opt && i < opt->n_params; i++) sg->n_opt_floats += var_numel(&opt->params[i]->var);
    size_t total = sg->n_param_floats + 2 * sg->n_opt_floats;
    sg->buf = malloc((total ? total : 1) * sizeof(float));
    if (!sg->buf)
        return qt_error_set(err, QT_ERR_NOMEM, "cannot allocate %zu floats to load a checkpoint", total);
    return QT_OK;
}

/* The common path of every load: check, stage, then apply. params: read
 * /params (all of the model's, or only its trainable ones). */
static QtStatus load_parts(const char *path, Model *m, Optimizer *opt, CheckpointState *s, const CheckpointNet *net,
                           bool trainable_only, const bool *bn_trained, QtError *err) {
    if (!path || !m) return qt_error_set(err, QT_ERR_ARG, "checkpoint_load: no path or no model");
    QtStatus st = s ? check_rng_names(s, err) : QT_OK;
    if (st != QT_OK) return st;
    H5ioFile f = H5IO_FILE_INIT;
    if ((st = h5io_open(&f, path, err)) != QT_OK) return st;
    /* Only the trainable parameters: the rest are marked released for the
       check and read, then restored. */
    bool *hidden = calloc((size_t)m->n_params + 1, sizeof *hidden);
    if (!hidden) {
        h5io_close(&f, NULL);
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory loading %s", path);
    }
    for (int i = 0; trainable_only && i < m->n_params; i++)
        if (!m->params[i].trainable && !m->params[i].released) hidden[i] = m->params[i].released = true;
    Staged sg = {0};
    CkptNetStaged ns = {0};
    /* Batch norm statistics: in an adapters file only those of the batch norms the run trains (bn_trained; the
       others are the base's, from the base checkpoint). */
    size_t n_bn_floats = 0, n_bn = 0;
    for (int i = 0; i < m->n_modules; i++)
        if (m->modules[i].running_mean) n_bn_floats += 2 * (size_t)m->modules[i].in_shape[0], n_bn++;
    if (trainable_only && !bn_trained) n_bn = 0;
    float *bn_f = malloc((n_bn_floats + 1) * sizeof *bn_f);
    int64_t *bn_i = malloc((2 * n_bn + 1) * sizeof *bn_i); /* num_batches_tracked, folded */
    st = bn_f && bn_i ? QT_OK : qt_error_set(err, QT_ERR_NOMEM, "out of memory loading %s", path);
    if (st == QT_OK) st = check_header(&f, err);
    if (st == QT_OK) st = check_params(&f, m, err);
    if (st == QT_OK && opt) st = check_optim(&f, opt, err);
    if (st == QT_OK && net) st = ckpt_read_net(&f, net, &ns, err);
    if (st == QT_OK) st = stage_alloc(&sg, m, opt, err);
    if (st == QT_OK) st = read_params(&f, m, sg.buf, err);
    if (st == QT_OK && n_bn) st = ckpt_read_buffers(&f, m, trainable_only ? bn_trained : NULL, bn_f, bn_i, err);
    if (st == QT_OK && opt) st = read_optim(&f, opt, &sg, err);
    if (st == QT_OK && s) st = read_state(&f, s, &sg, err);
    QtStatus cst = h5io_close(&f, err);
    if (st == QT_OK) st = cst;
    if (st == QT_OK) commit(&sg, m, opt, s);
    if (st == QT_OK && n_bn) ckpt_commit_buffers(m, bn_f, bn_i);
    if (st == QT_OK && net) ckpt_commit_net(&ns, net);
    for (int i = 0; i < m->n_params; i++)
        if (hidden[i]) m->params[i].released = false;
    free(hidden);
    ckpt_staged_net_free(&ns);
    free(sg.buf);
    free(bn_f);
    free(bn_i);
    return st;
}

QtStatus checkpoint_load(const char *path, Model *m, Optimizer *opt, CheckpointState *s, QtError *err) {
    return load_parts(path, m, opt, s, s ? &s->net : NULL, false, NULL, err);
}

QtStatus checkpoint_load_params(const char *path, Model *m, QtError *err) {
    return load_parts(path, m, NULL, NULL, NULL, false, NULL, err);
}

QtStatus checkpoint_load_model(const char *path, Model *m, const CheckpointNet *net, QtError *err) {
    return load_parts(path, m, NULL, NULL, net, false, NULL, err);
}

/* The layers of net's kinds that an adapters.h5 holds (HookKind.in_adapters_file). */
static CheckpointNet adapters_part(const CheckpointNet *net) {
    CheckpointNet a = {0};
    for (int k = 0; k < net->n_sets; k++)
        if (net->sets[k].kind->in_adapters_file) a.sets[a.n_sets++] = net->sets[k];
    return a;
}

QtStatus checkpoint_load_adapters(const char *path, Model *m, const CheckpointNet *net, const bool *bn_trained,
                                  QtError *err) {
    /* First: the file's adapters against the run's (another model or other rules). */
    CheckpointNet adapters = adapters_part(net);
    H5ioFile f = H5IO_FILE_INIT;
    QtStatus st = h5io_open(&f, path, err);
    if (st != QT_OK) return st;
    st = check_header(&f, err);
    for (int k = 0; st == QT_OK && k < adapters.n_sets; k++) {
        const HookSet *set = &adapters.sets[k];
        if (set->kind->check_adapters) st = set->kind->check_adapters(&f, set, err);
    }
    QtStatus cst = h5io_close(&f, err);
    if (st == QT_OK) st = cst;
    if (st != QT_OK) return st;
    return load_parts(path, m, NULL, NULL, &adapters, true, bn_trained, err);
}

QtStatus checkpoint_save_adapters(const char *path, const Model *m, const CheckpointState *s, QtError *err) {
    H5ioFile f = H5IO_FILE_INIT;
    CheckpointNet adapters = adapters_part(&s->net);
    void *image = NULL;
    size_t size = 0;
    QtStatus st = h5io_create_mem(&f, path, (size_t)1 << 20, err);
    if (st == QT_OK) st = write_header(&f, s, err);
    if (st == QT_OK) st = h5io_attr_write_str(&f, "", "contents", "adapters", err);
    if (st == QT_OK) st = write_params(&f, m, true, err);
    if (st == QT_OK && s->bn_trained) st = ckpt_write_buffers(&f, m, s->bn_trained, err);
    if (st == QT_OK) st = ckpt_write_net(&f, &adapters, err);
    if (st == QT_OK) st = h5io_image(&f, &image, &size, err);
    QtStatus cst = h5io_close(&f, err);
    if (st == QT_OK) st = cst;
    if (st == QT_OK) st = ckpt_write_atomic(path, image, size, FS_REPLACE_ANY, err);
    free(image);
    return st;
}

/* A string attribute of the root into out[cap] ("" when absent). */
static QtStatus read_root_str(const H5ioFile *f, const char *name, char *out, size_t cap, QtError *err) {
    out[0] = '\0';
    if (!h5io_attr_exists(f, "", name)) return QT_OK;
    char *v = NULL;
    QtStatus st = h5io_attr_read_str(f, "", name, &v, err);
    if (st == QT_OK) snprintf(out, cap, "%s", v);
    free(v);
    return st;
}

QtStatus checkpoint_read_provenance(const char *path, CheckpointProvenance *p, QtError *err) {
    memset(p, 0, sizeof *p);
    H5ioFile f = H5IO_FILE_INIT;
    QtStatus st = h5io_open(&f, path, err);
    if (st != QT_OK) return st;
    st = check_header(&f, err);
    if (st == QT_OK) st = read_count(&f, "", "step", &p->step, err);
    if (st == QT_OK) st = read_count(&f, "", "epoch", &p->epoch, err);
    if (st == QT_OK) st = read_root_str(&f, "base_hash", p->base_hash, sizeof p->base_hash, err);
    if (st == QT_OK) st = read_root_str(&f, "base_sha256", p->base_sha256, sizeof p->base_sha256, err);
    if (st == QT_OK) st = read_root_str(&f, "base_init_from", p->base_init_from, sizeof p->base_init_from, err);
    if (st == QT_OK) st = read_root_str(&f, "lora_batchnorm", p->lora_batchnorm, sizeof p->lora_batchnorm, err);
    if (st == QT_OK) st = read_root_str(&f, "merged_from", p->merged_from, sizeof p->merged_from, err);
    if (st == QT_OK)
        st = read_root_str(&f, "merged_from_base_sha256", p->merged_from_base_sha256,
                           sizeof p->merged_from_base_sha256, err);
    QtStatus cst = h5io_close(&f, err);
    return st == QT_OK ? cst : st;
}

QtStatus checkpoint_list_quant(const char *path, char (*paths)[MODULE_NAME_MAX], int cap, int *n, QtError *err) {
    H5ioFile f = H5IO_FILE_INIT;
    *n = 0;
    QtStatus st = h5io_open(&f, path, err);
    if (st != QT_OK) return st;
    st = check_header(&f, err);
    if (st == QT_OK && h5io_kind(&f, "quant") == H5IO_GROUP) st = ckpt_list_group(&f, "quant", paths, cap, n, err);
    QtStatus cst = h5io_close(&f, err);
    return st == QT_OK ? cst : st;
}

QtStatus checkpoint_read_config(const char *path, char **config_text, QtError *err) {
    *config_text = NULL;
    H5ioFile f = H5IO_FILE_INIT;
    QtStatus st = h5io_open(&f, path, err);
    if (st != QT_OK) return st;
    st = check_header(&f, err);
    if (st == QT_OK && !h5io_attr_exists(&f, "", "config"))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s holds no stored config (no 'config' attribute on /)", path);
    if (st == QT_OK) st = h5io_attr_read_str(&f, "", "config", config_text, err);
    QtStatus cst = h5io_close(&f, err);
    if (st == QT_OK && cst != QT_OK) {
        free(*config_text);
        *config_text = NULL;
        st = cst;
    }
    return st;
}
