/* checkpoint_buffers.c - a batch norm's running statistics in a checkpoint:
 * /buffers/<module>/running_mean, running_var (float32, (C,)) and
 * num_batches_tracked (int64 scalar), as PyTorch's state_dict names them. No
 * /buffers group without a batch norm (in an adapters.h5: without one the
 * run trains). A batch norm folded into the layer
 * before it (PTQ) has the attribute folded on /buffers/<module> (1: into the
 * producer's weight and bias, 2: its own bias carries the shift; nn/model.h
 * BnFold); without it the module is a batch norm of its own. */
#include <string.h>

#include "checkpoint_internal.h"

QtStatus ckpt_write_buffers(H5ioFile *f, const Model *m, const bool *only, QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < m->n_modules; i++) {
        const Module *mod = &m->modules[i];
        if (!mod->running_mean || (only && !only[i])) continue;
        const int c = mod->in_shape[0];
        char a[CKPT_OBJ_MAX], b[CKPT_OBJ_MAX], n[CKPT_OBJ_MAX];
        st = ckpt_obj_path(a, "buffers", mod->path, "running_mean", err);
        if (st == QT_OK) st = ckpt_obj_path(b, "buffers", mod->path, "running_var", err);
        if (st == QT_OK) st = ckpt_obj_path(n, "buffers", mod->path, "num_batches_tracked", err);
        if (st == QT_OK) st = h5io_write_f32(f, a, mod->running_mean, 1, &c, err);
        if (st == QT_OK) st = h5io_write_f32(f, b, mod->running_var, 1, &c, err);
        if (st == QT_OK) st = h5io_write(f, n, H5T_NATIVE_INT64, &mod->num_batches_tracked, 0, NULL, err);
        if (st == QT_OK && mod->bn_folded != BN_FOLD_NONE && (st = ckpt_obj_path(a, "buffers", mod->path, NULL, err))
            == QT_OK)
            st = h5io_attr_write_i64(f, a, "folded", (int64_t)mod->bn_folded, err);
    }
    return st;
}

/* A batch norm ckpt_read_buffers leaves as it is: its current state staged, so the commit keeps it. */
static void stage_current(const Module *mod, float *fbuf, int64_t *ibuf) {
    const size_t c = (size_t)mod->in_shape[0];
    memcpy(fbuf, mod->running_mean, c * sizeof(float));
    memcpy(fbuf + c, mod->running_var, c * sizeof(float));
    ibuf[0] = mod->num_batches_tracked;
    ibuf[1] = mod->bn_folded;
}

QtStatus ckpt_read_buffers(const H5ioFile *f, const Model *m, const bool *only, float *fbuf, int64_t *ibuf,
                           QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < m->n_modules; i++) {
        const Module *mod = &m->modules[i];
        if (!mod->running_mean) continue;
        const int c = mod->in_shape[0];
        char grp[CKPT_OBJ_MAX];
        if (only && (!only[i] || ckpt_obj_path(grp, "buffers", mod->path, NULL, err) != QT_OK ||
                     h5io_kind(f, grp) != H5IO_GROUP)) {
            stage_current(mod, fbuf, ibuf);
            fbuf += 2 * c;
            ibuf += 2;
            continue;
        }
        const char *names[3] = {"running_mean", "running_var", "num_batches_tracked"};
        char ds[3][CKPT_OBJ_MAX];
        for (int k = 0; st == QT_OK && k < 3; k++) {
            st = ckpt_obj_path(ds[k], "buffers", mod->path, names[k], err);
            if (st == QT_OK && h5io_kind(f, ds[k]) != H5IO_DATASET)
                st = qt_error_set(err, QT_ERR_FORMAT, "%s has no dataset /%s: module '%s' (%s) needs its running "
                                  "statistics under /buffers/%s (running_mean, running_var, num_batches_tracked); "
                                  "a checkpoint written before batch norm was in the model, or without its buffers, "
                                  "cannot be resumed, evaluated or used as model.init_from for it", f->path, ds[k],
                                  mod->path, layer_type_name(mod->spec.type), mod->path);
        }
        if (st == QT_OK) st = h5io_read_f32(f, ds[0], fbuf, 1, &c, err);
        if (st == QT_OK) st = ckpt_check_finite(f, ds[0], fbuf, (size_t)c, err);
        if (st == QT_OK) st = h5io_read_f32(f, ds[1], fbuf + c, 1, &c, err);
        if (st == QT_OK) st = ckpt_check_finite(f, ds[1], fbuf + c, (size_t)c, err);
        for (int k = 0; st == QT_OK && k < c; k++)
            if (fbuf[c + k] < 0.0f)
                st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s holds %g at index %d; a running variance is never "
                                  "negative, so this checkpoint is damaged; use an earlier checkpoint", f->path, ds[1],
                                  (double)fbuf[c + k], k);
        if (st == QT_OK) st = h5io_read(f, ds[2], H5T_NATIVE_INT64, ibuf, 0, NULL, err);
        if (st == QT_OK && *ibuf < 0)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s is %lld; a count of batches is never negative, so this "
                              "checkpoint is damaged", f->path, ds[2], (long long)*ibuf);
        char g[CKPT_OBJ_MAX];
        ibuf[1] = BN_FOLD_NONE;
        if (st == QT_OK) st = ckpt_obj_path(g, "buffers", mod->path, NULL, err);
        if (st == QT_OK && h5io_attr_exists(f, g, "folded")) st = h5io_attr_read_i64(f, g, "folded", &ibuf[1], err);
        if (st == QT_OK && ibuf[1] != BN_FOLD_NONE && ibuf[1] != BN_FOLD_INTO && ibuf[1] != BN_FOLD_BIAS)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has folded %lld; a folded batch norm is 1 (into the layer "
                              "before it) or 2 (its bias holds the shift), so this checkpoint is damaged", f->path, g,
                              (long long)ibuf[1]);
        if (st == QT_OK && ibuf[1] == BN_FOLD_BIAS && !mod->bias)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has folded 2 (its bias holds the folded shift) but module "
                              "'%s' has no bias (affine: false); the checkpoint was written for another model",
                              f->path, g, mod->path);
        fbuf += 2 * c;
        ibuf += 2;
    }
    return st;
}

void ckpt_commit_buffers(Model *m, const float *fbuf, const int64_t *ibuf) {
    for (int i = 0; i < m->n_modules; i++) {
        Module *mod = &m->modules[i];
        if (!mod->running_mean) continue;
        const size_t c = (size_t)mod->in_shape[0];
        memcpy(mod->running_mean, fbuf, c * sizeof(float));
        memcpy(mod->running_var, fbuf + c, c * sizeof(float));
        mod->num_batches_tracked = ibuf[0];
        mod->bn_folded = (BnFold)ibuf[1];
        ibuf += 2;
        fbuf += 2 * c;
    }
}
