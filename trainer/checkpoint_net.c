/* checkpoint_net.c - the hook layers' part of a checkpoint (layout in
 * checkpoint.h): every kind's layers written, read, checked and restored
 * through their kind (trainer/hook.h); and the base's identity
 * (checkpoint_base_sha256). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint_internal.h"
#include "quant/qarray_io.h"
#include "trainer/sha256.h"

/* ---- writing ----------------------------------------------------------------------- */

QtStatus ckpt_write_net(H5ioFile *f, const CheckpointNet *net, QtError *err) {
    QtStatus st = QT_OK;
    for (int k = 0; st == QT_OK && k < net->n_sets; k++) {
        const HookSet *set = &net->sets[k];
        if (set->n == 0 || !set->kind->group) continue; /* no group: the kind keeps nothing in checkpoints */
        if (!h5io_exists(f, set->kind->group)) st = h5io_group_create(f, set->kind->group, err);
        for (int i = 0; st == QT_OK && i < set->n; i++) st = set->kind->save(f, hook_layer(set, i), err);
    }
    return st;
}

/* ---- reading ----------------------------------------------------------------------- */

/* CalibRunning stored as attributes of obj: calibration, lo_mean, hi_mean, count. */
QtStatus ckpt_read_running_stats(const H5ioFile *f, const char *obj, CalibRunning *out, QtError *err) {
    char *calib = NULL;
    QtStatus st = h5io_attr_read_str(f, obj, "calibration", &calib, err);
    char shown[QT_CLIP_BUF];
    if (st == QT_OK && strlen(calib) > 64) /* calib_parse's messages quote it whole */
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s: calibration '%s' is not one; " DAMAGED_HINT, f->path, obj,
                          qt_clip(calib, shown));
    if (st == QT_OK) st = calib_parse(calib, &out->spec, err);
    free(calib);
    if (st == QT_OK) st = h5io_attr_read_f64(f, obj, "lo_mean", &out->lo_mean, err);
    if (st == QT_OK) st = h5io_attr_read_f64(f, obj, "hi_mean", &out->hi_mean, err);
    if (st == QT_OK) st = h5io_attr_read_i64(f, obj, "count", &out->count, err);
    QtError e = {0};
    if (st == QT_OK && calib_running_check(out, &e) != QT_OK)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s: %s; " DAMAGED_HINT, f->path, obj, e.msg);
    return st;
}

QtStatus ckpt_read_net(const H5ioFile *f, const CheckpointNet *net, CkptNetStaged *sg, QtError *err) {
    memset(sg, 0, sizeof *sg);
    QtStatus st = QT_OK;
    for (int k = 0; st == QT_OK && k < net->n_sets; k++) {
        const HookSet *set = &net->sets[k];
        if (set->n == 0 || !set->kind->group) continue;
        if (set->kind->check_file && (st = set->kind->check_file(f, set, err)) != QT_OK) break;
        char *staged = calloc((size_t)set->n, set->kind->staged_size);
        if (!staged) return qt_error_set(err, QT_ERR_NOMEM, "out of memory loading %s", f->path);
        sg->sets[k] = (HookSet){.kind = set->kind, .layers = staged, .n = set->n};
        for (int i = 0; st == QT_OK && i < set->n; i++)
            st = set->kind->load(f, hook_layer(set, i), staged + (size_t)i * set->kind->staged_size, err);
    }
    return st;
}

void ckpt_commit_net(CkptNetStaged *sg, const CheckpointNet *net) {
    for (int k = 0; k < net->n_sets; k++) {
        const HookSet *set = &net->sets[k];
        char *staged = sg->sets[k].layers;
        for (int i = 0; staged && i < set->n; i++)
            set->kind->commit(hook_layer(set, i), staged + (size_t)i * set->kind->staged_size);
    }
}

void ckpt_staged_net_free(CkptNetStaged *sg) {
    for (int k = 0; k < HOOK_KINDS_MAX; k++) {
        HookSet *s = &sg->sets[k];
        for (int i = 0; s->layers && s->kind->staged_free && i < s->n; i++)
            s->kind->staged_free((char *)s->layers + (size_t)i * s->kind->staged_size);
        free(s->layers);
    }
    memset(sg, 0, sizeof *sg);
}

typedef struct {
    char (*names)[MODULE_NAME_MAX];
    int cap, n;
    bool overflow;
} ListCtx;

static int list_child(const char *path, H5ioKind kind, void *data) {
    ListCtx *c = data;
    (void)kind;
    const char *slash = strrchr(path, '/');
    const char *name = slash ? slash + 1 : path;
    if (c->n == c->cap || strlen(name) >= MODULE_NAME_MAX) {
        c->overflow = true;
        return 1;
    }
    snprintf(c->names[c->n++], MODULE_NAME_MAX, "%s", name);
    return 0;
}

QtStatus ckpt_list_group(const H5ioFile *f, const char *group, char (*names)[MODULE_NAME_MAX], int cap, int *n,
                         QtError *err) {
    ListCtx c = {.names = names, .cap = cap};
    bool stopped = false;
    *n = 0;
    QtStatus st = h5io_iterate(f, group, list_child, &c, &stopped, err);
    if (st == QT_OK && c.overflow)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has more than %d entries or a name longer than %d characters",
                          f->path, group, cap, MODULE_NAME_MAX - 1);
    if (st == QT_OK) *n = c.n;
    return st;
}

/* ---- the base's identity ---------------------------------------------------------------- */

/* One dataset of the frozen base, as checkpoint.h's hash definition sees it. */
typedef struct {
    char name[CKPT_OBJ_MAX + 16]; /* "params/fc1/bias", "quant/fc1/weight/qvalue" */
    const char *dtype;            /* "float32", "uint8", "uint16", "int32" (numpy's names) */
    char shape[64];               /* "32", "8,1,3,3" */
    const void *data;             /* little-endian elements, as stored */
    size_t bytes;
} BaseRecord;

static int base_record_cmp(const void *a, const void *b) {
    return strcmp(((const BaseRecord *)a)->name, ((const BaseRecord *)b)->name);
}

static const char *blob_dtype(QArrayBlobType t) {
    switch (t) {
    case QARRAY_BLOB_U8: return "uint8";
    case QARRAY_BLOB_U16: return "uint16";
    case QARRAY_BLOB_I32: return "int32";
    case QARRAY_BLOB_F32: return "float32";
    }
    return "uint8";
}

static size_t blob_elem_size(QArrayBlobType t) { return t == QARRAY_BLOB_U8 ? 1 : t == QARRAY_BLOB_U16 ? 2 : 4; }

static void hash_u64le(Sha256 *s, uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
    sha256_update(s, b, sizeof b);
}

/* with_buffers: scheme v2 (CHECKPOINT_BASE_HASH) hashes the frozen batch norms' statistics, v1 does not. */
static QtStatus base_sha256(const Model *m, const CheckpointNet *net, bool with_buffers, char hex[SHA256_HEX_CHARS],
                            QtError *err) {
    size_t cap = (size_t)m->n_params + 3 * (size_t)m->n_modules + 1, n = 0;
    for (int k = 0; k < net->n_sets; k++)
        if (net->sets[k].kind->frozen_weight) cap += (size_t)net->sets[k].n * QARRAY_MAX_BLOBS;
    BaseRecord *r = calloc(cap, sizeof *r);
    if (!r) return qt_error_set(err, QT_ERR_NOMEM, "out of memory hashing the base");
    for (int i = 0; i < m->n_params; i++) {
        const Param *p = &m->params[i];
        if (p->trainable || p->released) continue;
        const Tensor *t = &p->var.value;
        snprintf(r[n].name, sizeof r[n].name, "params/%s", p->name);
        r[n].dtype = "float32";
        size_t len = 0;
        for (int d = 0; d < t->ndim; d++)
            len += (size_t)snprintf(r[n].shape + len, sizeof r[n].shape - len, "%s%d", d ? "," : "", t->shape[d]);
        r[n].data = t->data;
        r[n++].bytes = tensor_numel(t) * sizeof(float);
    }
    /* a frozen batch norm's running statistics are the base's too */
    for (int i = 0; with_buffers && i < m->n_modules; i++) {
        const Module *b = &m->modules[i];
        if (!b->running_mean || !b->bn.frozen) continue;
        const char *names[3] = {"running_mean", "running_var", "num_batches_tracked"};
        const void *data[3] = {b->running_mean, b->running_var, &b->num_batches_tracked};
        for (int k = 0; k < 3; k++) {
            snprintf(r[n].name, sizeof r[n].name, "buffers/%s/%s", b->path, names[k]);
            r[n].dtype = k < 2 ? "float32" : "int64";
            if (k < 2) snprintf(r[n].shape, sizeof r[n].shape, "%d", b->in_shape[0]);
            r[n].data = data[k];
            r[n++].bytes = k < 2 ? (size_t)b->in_shape[0] * sizeof(float) : sizeof(int64_t);
        }
    }
    for (int k = 0; k < net->n_sets; k++) {
        const HookSet *set = &net->sets[k];
        for (int i = 0; set->kind->frozen_weight && i < set->n; i++) {
            const void *layer = hook_layer(set, i);
            QArrayBlob blobs[QARRAY_MAX_BLOBS];
            int nb = qarray_blobs(set->kind->frozen_weight(layer), blobs);
            for (int b = 0; b < nb; b++) {
                snprintf(r[n].name, sizeof r[n].name, "%s/%s/weight/%s", set->kind->group,
                         hook_layer_module(layer)->path, blobs[b].name);
                r[n].dtype = blob_dtype(blobs[b].type);
                snprintf(r[n].shape, sizeof r[n].shape, "%zu", blobs[b].count);
                r[n].data = blobs[b].data;
                r[n++].bytes = blobs[b].count * blob_elem_size(blobs[b].type);
            }
        }
    }
    qsort(r, n, sizeof *r, base_record_cmp);
    Sha256 s;
    sha256_init(&s);
    for (size_t i = 0; i < n; i++) {
        sha256_update(&s, r[i].name, strlen(r[i].name) + 1);
        sha256_update(&s, r[i].dtype, strlen(r[i].dtype) + 1);
        sha256_update(&s, r[i].shape, strlen(r[i].shape) + 1);
        hash_u64le(&s, r[i].bytes);
        sha256_update(&s, r[i].data, r[i].bytes);
    }
    uint8_t digest[SHA256_DIGEST_BYTES];
    sha256_final(&s, digest);
    sha256_hex(digest, hex);
    free(r);
    return QT_OK;
}

QtStatus checkpoint_base_sha256(const Model *m, const CheckpointNet *net, char hex[SHA256_HEX_CHARS], QtError *err) {
    return base_sha256(m, net, true, hex, err);
}

QtStatus checkpoint_base_sha256_v1(const Model *m, const CheckpointNet *net, char hex[SHA256_HEX_CHARS],
                                   QtError *err) {
    return base_sha256(m, net, false, hex, err);
}
