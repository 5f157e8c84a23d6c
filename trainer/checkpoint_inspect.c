/* checkpoint_inspect.c - `qtrain inspect`: a listing of any HDF5 file's
 * groups, datasets and attributes, read without a model or a run. */
#include <stdio.h>

#include "checkpoint.h"
#include "checkpoint_internal.h"
#include "base/h5io.h"

#define INSPECT_STR_MAX 60    /* string attributes longer than this are cut in listings */

typedef struct {
    const H5ioFile *f;
    FILE *out;
    const char *obj;        /* the object whose attributes are being listed */
    QtError *err;
    QtStatus st;
    long long n_datasets;
    unsigned long long bytes;
} InspectCtx;

static int inspect_attr(const char *name, void *data) {
    InspectCtx *c = data;
    char value[512];
    c->st = h5io_attr_format(c->f, c->obj, name, INSPECT_STR_MAX, value, sizeof value, c->err);
    if (c->st != QT_OK) return 1;
    /* names and values come from the file: no control characters (terminal escapes) reach the terminal */
    char shown_name[QT_CLIP_BUF], shown_value[QT_CLIP_BUF];
    fprintf(c->out, "    @%s = %s\n", qt_clip(name, shown_name), qt_clip(value, shown_value));
    return 0;
}

static int inspect_object(const char *path, H5ioKind kind, void *data) {
    InspectCtx *c = data;
    char full[CKPT_OBJ_MAX * 4], shown[QT_CLIP_BUF];
    snprintf(full, sizeof full, "/%s", qt_clip(path, shown));
    if (kind == H5IO_DATASET) {
        H5ioInfo info;
        char ty[32], shape[128];
        if ((c->st = h5io_dataset_info(c->f, path, &info, c->err)) != QT_OK) return 1;
        unsigned long long bytes = info.is_vlen_str ? 0 : (unsigned long long)info.numel * info.size;
        fprintf(c->out, "%-36s %-8s %-16s %llu bytes\n", full, h5io_dtype_str(&info, ty, sizeof ty),
                h5io_shape_str(&info, shape, sizeof shape), bytes);
        c->n_datasets++;
        c->bytes += bytes;
    } else {
        fprintf(c->out, "%-36s %s\n", full, kind == H5IO_GROUP ? "group" : "(link or named type, not followed)");
        if (kind != H5IO_GROUP) return 0;
    }
    c->obj = path;
    /* inspect_attr stops the iteration with its error in c->st, which the
     * iteration's own QT_OK must not overwrite. */
    QtStatus st = h5io_attr_iterate(c->f, path, inspect_attr, c, c->err);
    if (c->st == QT_OK) c->st = st;
    return c->st != QT_OK;
}

QtStatus checkpoint_inspect(const char *path, FILE *out, QtError *err) {
    if (!path || !out) return qt_error_set(err, QT_ERR_ARG, "checkpoint_inspect: no path or no output");
    H5ioFile f = H5IO_FILE_INIT;
    QtStatus st = h5io_open(&f, path, err);
    if (st != QT_OK) return st;
    InspectCtx c = {.f = &f, .out = out, .err = err};
    fprintf(out, "%s\n", path);
    if (inspect_object("", H5IO_GROUP, &c) == 0) st = h5io_visit(&f, "", inspect_object, &c, NULL, err);
    if (c.st != QT_OK) st = c.st;
    if (st == QT_OK)
        fprintf(out, "total: %lld datasets, %llu bytes of data\n", c.n_datasets, c.bytes);
    QtStatus cst = h5io_close(&f, err);
    return st != QT_OK ? st : cst;
}
