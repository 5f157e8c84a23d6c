/* checkpoint_net.c - the /quant and /lora groups of a checkpoint (layout in
 * checkpoint.h): quantized base weights stored as their packed codes and
 * scales, static activation ranges, LoRA adapters, QAT ranges and QT
 * generator states; and the base's identity (checkpoint_base_sha256).
 * Loading checks the stored scales, zero points and ranges before anything
 * uses them: a value no run writes would otherwise load and turn every
 * logit into NaN. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint_internal.h"
#include "quant/qarray_io.h"
#include "trainer/sha256.h"

static const char *granularity_name(const QLayer *q) {
    if (q->spec.tile_size > 0 || qtype_is_block(q->spec.weight_qtype)) return "block";
    return q->spec.per_tensor ? "per_tensor" : "per_channel";
}

/* The block size the layer's layout uses (0 for per channel / per tensor). */
static int64_t layer_tile(const QLayer *q) {
    if (q->spec.tile_size > 0 || qtype_is_block(q->spec.weight_qtype)) return q->weight.ndim == 2 ? q->weight.shape[1]
                                                                                                   : 0;
    return 0;
}

static hid_t blob_memtype(QArrayBlobType t) {
    switch (t) {
    case QARRAY_BLOB_U8: return H5T_NATIVE_UINT8;
    case QARRAY_BLOB_U16: return H5T_NATIVE_UINT16;
    case QARRAY_BLOB_I32: return H5T_NATIVE_INT32;
    case QARRAY_BLOB_F32: return H5T_NATIVE_FLOAT;
    }
    return H5T_NATIVE_UINT8;
}

/* ---- writing ----------------------------------------------------------------------- */

static QtStatus write_weight_attrs(H5ioFile *f, const char *g, const QLayer *q, QtError *err) {
    int64_t shape[4];
    for (int d = 0; d < q->w_ndim; d++) shape[d] = q->w_shape[d];
    char calib[64];
    calib_format(&q->spec.weight_calib, calib, sizeof calib);
    QtStatus st = h5io_attr_write_str(f, g, "qtype", qtype_name(q->spec.weight_qtype), err);
    if (st == QT_OK) st = h5io_attr_write_i64s(f, g, "shape", shape, q->w_ndim, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, g, "tile", layer_tile(q), err);
    if (st == QT_OK) st = h5io_attr_write_str(f, g, "granularity", granularity_name(q), err);
    if (st == QT_OK) st = h5io_attr_write_str(f, g, "scale_type", qarray_scale_type_name(q->weight.scale_type), err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, g, "symmetric", q->spec.symmetric, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, g, "narrow_range", q->spec.narrow_range, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, g, "double_quant", q->weight.double_quant, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, g, "dq_block", q->weight.double_quant ? q->weight.dq.block : 0, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "dq_offset", q->weight.double_quant ? q->weight.dq.offset : 0, err);
    if (st == QT_OK) st = h5io_attr_write_str(f, g, "calibration", calib, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "bits_per_weight", qarray_bits_per_element(&q->weight), err);
    return st;
}

static QtStatus write_act(H5ioFile *f, const char *module, const QLayer *q, QtError *err) {
    char g[CKPT_OBJ_MAX], calib[64];
    QtStatus st = ckpt_obj_path(g, "quant", module, "input", err);
    calib_format(&q->act_stats.spec, calib, sizeof calib);
    if (st == QT_OK) st = h5io_group_create(f, g, err);
    if (st == QT_OK) st = h5io_attr_write_str(f, g, "qtype", qtype_name(q->spec.act_qtype), err);
    if (st == QT_OK) st = h5io_attr_write_str(f, g, "calibration", calib, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "lo_mean", q->act_stats.lo_mean, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "hi_mean", q->act_stats.hi_mean, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, g, "count", q->act_stats.count, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "scale", q->act_scale, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "zero_point", q->act_zero_point, err);
    return st;
}

QtStatus ckpt_write_quant(H5ioFile *f, const CheckpointNet *net, QtError *err) {
    if (net->n_qlayers == 0) return QT_OK;
    QtStatus st = h5io_group_create(f, "quant", err);
    for (int i = 0; st == QT_OK && i < net->n_qlayers; i++) {
        const QLayer *q = &net->qlayers[i];
        const char *module = q->module->path;
        char g[CKPT_OBJ_MAX], ds[CKPT_OBJ_MAX + 16];
        if ((st = ckpt_obj_path(g, "quant", module, NULL, err)) == QT_OK) st = h5io_group_create(f, g, err);
        if (st == QT_OK && (st = ckpt_obj_path(g, "quant", module, "weight", err)) == QT_OK)
            st = h5io_group_create(f, g, err);
        QArrayBlob blobs[QARRAY_MAX_BLOBS];
        int nb = st == QT_OK ? qarray_blobs(&q->weight, blobs) : 0;
        for (int b = 0; st == QT_OK && b < nb; b++) {
            int count = (int)blobs[b].count;
            snprintf(ds, sizeof ds, "%s/%s", g, blobs[b].name);
            st = h5io_write(f, ds, blob_memtype(blobs[b].type), blobs[b].data, 1, &count, err);
        }
        if (st == QT_OK) st = write_weight_attrs(f, g, q, err);
        if (st == QT_OK && q->spec.act_qtype) st = write_act(f, module, q, err);
    }
    return st;
}

QtStatus ckpt_write_lora(H5ioFile *f, const CheckpointNet *net, QtError *err) {
    if (net->n_adapters == 0) return QT_OK;
    QtStatus st = h5io_group_create(f, "lora", err);
    for (int i = 0; st == QT_OK && i < net->n_adapters; i++) {
        const LoraAdapter *a = &net->adapters[i];
        char g[CKPT_OBJ_MAX], ds[CKPT_OBJ_MAX];
        if ((st = ckpt_obj_path(g, "lora", a->module->path, NULL, err)) == QT_OK) st = h5io_group_create(f, g, err);
        const Tensor *A = &a->A.var.value, *B = &a->B.var.value;
        if (st == QT_OK && (st = ckpt_obj_path(ds, "lora", a->module->path, "A", err)) == QT_OK)
            st = h5io_write_f32(f, ds, A->data, A->ndim, A->shape, err);
        if (st == QT_OK && (st = ckpt_obj_path(ds, "lora", a->module->path, "B", err)) == QT_OK)
            st = h5io_write_f32(f, ds, B->data, B->ndim, B->shape, err);
        if (st == QT_OK) st = h5io_attr_write_i64(f, g, "rank", a->spec.rank, err);
        if (st == QT_OK) st = h5io_attr_write_f64(f, g, "alpha", a->spec.alpha, err);
        if (st == QT_OK) st = h5io_attr_write_f64(f, g, "scale", a->scale, err);
        if (st == QT_OK) st = h5io_attr_write_i64(f, g, "rslora", a->spec.rslora, err);
        if (st == QT_OK) st = h5io_attr_write_f64(f, g, "dropout", a->spec.dropout, err);
        if (st == QT_OK) st = h5io_attr_write_str(f, g, "init", lora_init_name(a->spec.init), err);
    }
    return st;
}

/* ---- reading ----------------------------------------------------------------------- */

/* What to do about a value no run writes (a flipped bit, a file edited or written by another tool). */
#define DAMAGED_HINT "the checkpoint is damaged: resume from an earlier checkpoint, or write it again (qtrain " \
                     "quantize for a PTQ base, or the run that saved it)"

#define QUANT_HINT "the checkpoint's base was quantized with other settings; use the quant rules it was written " \
                   "with (qtrain inspect %s shows them) or quantize the float base again"

static QtStatus check_str_attr(const H5ioFile *f, const char *g, const char *name, const char *want, QtError *err) {
    char *got = NULL;
    QtStatus st = h5io_attr_read_str(f, g, name, &got, err);
    char shown[QT_CLIP_BUF];
    if (st == QT_OK && strcasecmp(got, want) != 0)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has %s '%.40s' but this run's rule gives '%s'; " QUANT_HINT,
                          f->path, g, name, qt_clip(got, shown), want, f->path);
    free(got);
    return st;
}

static QtStatus check_int_attr(const H5ioFile *f, const char *g, const char *name, int64_t want, QtError *err) {
    int64_t got = 0;
    QtStatus st = h5io_attr_read_i64(f, g, name, &got, err);
    if (st == QT_OK && got != want)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has %s %lld but this run's rule gives %lld; " QUANT_HINT,
                          f->path, g, name, (long long)got, (long long)want, f->path);
    return st;
}

/* The stored layout must be the one the run's rule gives this module. */
static QtStatus check_weight_attrs(const H5ioFile *f, const char *g, const QLayer *q, QtError *err) {
    int64_t shape[8];
    int n = 0;
    QtStatus st = check_str_attr(f, g, "qtype", qtype_name(q->spec.weight_qtype), err);
    if (st == QT_OK) st = h5io_attr_read_i64s(f, g, "shape", shape, 8, &n, err);
    bool same = st == QT_OK && n == q->w_ndim;
    for (int d = 0; same && d < n; d++) same = shape[d] == q->w_shape[d];
    if (st == QT_OK && !same)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s holds a weight of another shape than module %s's; the "
                          "checkpoint was written for a different model (qtrain inspect %s)", f->path, g,
                          q->module->path, f->path);
    if (st == QT_OK) st = check_int_attr(f, g, "tile", layer_tile(q), err);
    if (st == QT_OK) st = check_str_attr(f, g, "granularity", granularity_name(q), err);
    if (st == QT_OK) st = check_str_attr(f, g, "scale_type", qarray_scale_type_name(q->weight.scale_type), err);
    if (st == QT_OK) st = check_int_attr(f, g, "symmetric", q->spec.symmetric, err);
    if (st == QT_OK) st = check_int_attr(f, g, "narrow_range", q->spec.narrow_range, err);
    if (st == QT_OK) st = check_int_attr(f, g, "double_quant", q->weight.double_quant, err);
    return st;
}

static QtStatus read_blobs(const H5ioFile *f, const char *g, QArray *w, QtError *err) {
    QArrayBlob blobs[QARRAY_MAX_BLOBS];
    int nb = qarray_blobs(w, blobs);
    QtStatus st = QT_OK;
    for (int b = 0; st == QT_OK && b < nb; b++) {
        char ds[CKPT_OBJ_MAX + 16];
        snprintf(ds, sizeof ds, "%s/%s", g, blobs[b].name);
        H5ioInfo info;
        int count = (int)blobs[b].count;
        if (h5io_kind(f, ds) != H5IO_DATASET)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s is missing; the quantized weight is incomplete", f->path,
                              ds);
        else if ((st = h5io_dataset_info(f, ds, &info, err)) == QT_OK && (info.rank != 1 || info.numel != blobs[b].count))
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has %llu values, the layout needs %zu; " QUANT_HINT,
                              f->path, ds, (unsigned long long)info.numel, blobs[b].count, f->path);
        if (st == QT_OK) st = h5io_read(f, ds, blob_memtype(blobs[b].type), blobs[b].data, 1, &count, err);
    }
    if (st == QT_OK && w->double_quant) {
        double offset = 0.0;
        int64_t block = 0;
        st = h5io_attr_read_f64(f, g, "dq_offset", &offset, err);
        if (st == QT_OK) st = h5io_attr_read_i64(f, g, "dq_block", &block, err);
        if (st == QT_OK && block != w->dq.block)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has dq_block %lld, the layout uses %d", f->path, g,
                              (long long)block, w->dq.block);
        w->dq.offset = (float)offset;
        if (st == QT_OK && !isfinite(w->dq.offset))
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has dq_offset %g; the mean of the double-quantized "
                              "scales is finite; " DAMAGED_HINT, f->path, g, offset);
    }
    QtError e = {0};
    if (st == QT_OK && qarray_check_stored(w, &e) != QT_OK)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s/%s; " DAMAGED_HINT, f->path, g, e.msg);
    return st;
}

/* CalibRunning stored as attributes of obj: calibration, lo_mean, hi_mean, count. */
static QtStatus read_running_stats(const H5ioFile *f, const char *obj, CalibRunning *out, QtError *err) {
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

/* The static input scale and zero point, held to what the layer's forward (fake quantization and the int8
 * path alike) accepts: a finite scale > 0 (qlayer_act_from_stats and a converted learned range write at least
 * 1e-19; a smaller one acts as 1), and for an asymmetric range a zero point that is a whole code of the
 * format's range; a symmetric layer stores 0 and never reads it. A scale <= 0 or NaN would otherwise leave the
 * input unquantized without a word (act_ready is act_scale > 0). */
static QtStatus check_act_range(const H5ioFile *f, const char *g, const QLayer *q, double s, double zp,
                                QtError *err) {
    const QType *t = q->spec.act_qtype;
    float sf = (float)s; /* as the layer will hold it */
    if (!(sf > 0.0f) || isinf(sf))
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has scale %g (the static input range of module %s); a "
                            "static activation scale must be finite and > 0; " DAMAGED_HINT, f->path, g, s,
                            q->module->path);
    bool asym = !q->spec.act_symmetric;
    if (!isfinite(zp) || (asym && (zp < t->qmin || zp > t->qmax || zp != nearbyint(zp))))
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has zero_point %g (the static input range of module %s); "
                            "it must be %s %s's code range [%d, %d]; " DAMAGED_HINT, f->path, g, zp, q->module->path,
                            asym ? "a whole number in" : "finite (0 when symmetric), and asymmetric a whole number in",
                            t->name, t->qmin, t->qmax);
    return QT_OK;
}

static QtStatus read_act(const H5ioFile *f, const QLayer *q, CalibRunning *out, float *scale_zp, QtError *err) {
    char g[CKPT_OBJ_MAX];
    QtStatus st = ckpt_obj_path(g, "quant", q->module->path, "input", err);
    if (st == QT_OK && h5io_kind(f, g) != H5IO_GROUP)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s (the static input range of %s) is missing; the checkpoint "
                            "was written without act_qtype for it", f->path, g, q->module->path);
    if (st == QT_OK) st = check_str_attr(f, g, "qtype", qtype_name(q->spec.act_qtype), err);
    if (st == QT_OK) st = read_running_stats(f, g, out, err);
    /* The scale itself, exactly as used (a converted QAT layer's came from a learned range, not the statistics). */
    double s = NAN, zp = 0.0;
    if (st == QT_OK) st = h5io_attr_read_f64(f, g, "scale", &s, err);
    if (st == QT_OK) st = h5io_attr_read_f64(f, g, "zero_point", &zp, err);
    if (st == QT_OK) st = check_act_range(f, g, q, s, zp, err);
    scale_zp[0] = (float)s, scale_zp[1] = (float)zp;
    return st;
}

QtStatus ckpt_read_quant(const H5ioFile *f, const CheckpointNet *net, CkptNetStaged *sg, QtError *err) {
    if (net->n_qlayers == 0) return QT_OK;
    sg->weights = calloc((size_t)net->n_qlayers, sizeof *sg->weights);
    sg->act = calloc((size_t)net->n_qlayers, sizeof *sg->act);
    sg->act_scale = calloc(2 * (size_t)net->n_qlayers, sizeof *sg->act_scale);
    if (!sg->weights || !sg->act || !sg->act_scale) return qt_error_set(err, QT_ERR_NOMEM, "out of memory loading %s", f->path);
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < net->n_qlayers; i++) {
        const QLayer *q = &net->qlayers[i];
        char g[CKPT_OBJ_MAX];
        st = ckpt_obj_path(g, "quant", q->module->path, "weight", err);
        if (st == QT_OK && h5io_kind(f, g) != H5IO_GROUP)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: the quantized weight of module %s (/%s) is missing; the "
                              "checkpoint was written with module %s in float or without quantization", f->path,
                              q->module->path, g, q->module->path);
        if (st == QT_OK) st = check_weight_attrs(f, g, q, err);
        if (st == QT_OK)
            st = qarray_alloc(&sg->weights[i], q->weight.ndim, q->weight.shape, q->weight.qtype, &q->options, err);
        if (st == QT_OK) sg->n_weights = i + 1;
        if (st == QT_OK) st = read_blobs(f, g, &sg->weights[i], err);
        if (st == QT_OK && q->spec.act_qtype) st = read_act(f, q, &sg->act[i], &sg->act_scale[2 * i], err);
    }
    return st;
}

QtStatus ckpt_read_lora(const H5ioFile *f, const CheckpointNet *net, CkptNetStaged *sg, QtError *err) {
    size_t total = 0;
    for (int i = 0; i < net->n_adapters; i++) total += lora_adapter_param_count(&net->adapters[i]);
    if (net->n_adapters == 0) return QT_OK;
    if (h5io_kind(f, "lora") != H5IO_GROUP)
        return qt_error_set(err, QT_ERR_FORMAT, "%s has no LoRA adapters (/lora) but this run has %d; point at a "
                            "checkpoint or adapters.h5 of a LoRA run with the same lora rules", f->path,
                            net->n_adapters);
    sg->lora = malloc(total * sizeof(float));
    if (!sg->lora) return qt_error_set(err, QT_ERR_NOMEM, "out of memory loading the adapters of %s", f->path);
    float *dst = sg->lora;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < net->n_adapters; i++) {
        const LoraAdapter *a = &net->adapters[i];
        const Param *ps[2] = {&a->A, &a->B};
        const char *names[2] = {"A", "B"};
        for (int k = 0; st == QT_OK && k < 2; k++) {
            const Tensor *t = &ps[k]->var.value;
            char ds[CKPT_OBJ_MAX], want[64], got[96];
            H5ioInfo info;
            st = ckpt_obj_path(ds, "lora", a->module->path, names[k], err);
            if (st == QT_OK && h5io_kind(f, ds) != H5IO_DATASET)
                st = qt_error_set(err, QT_ERR_FORMAT, "%s does not match the run's adapters: /%s (LoRA %s of module "
                                  "%s) is missing; the file was written with other lora rules or another model",
                                  f->path, ds, names[k], a->module->path);
            if (st == QT_OK) st = h5io_dataset_info(f, ds, &info, err);
            if (st == QT_OK && !h5io_shape_equals(&info, t->ndim, t->shape))
                st = qt_error_set(err, QT_ERR_FORMAT, "%s does not match the run's adapters: LoRA %s of module %s has "
                                  "shape %s in the file but %s in this run (rank %d); use the lora rules it was "
                                  "written with", f->path, names[k], a->module->path,
                                  h5io_shape_str(&info, got, sizeof got), tensor_shape_str(t, want, sizeof want),
                                  a->spec.rank);
            if (st == QT_OK) st = h5io_read_f32(f, ds, dst, t->ndim, t->shape, err);
            if (st == QT_OK) st = ckpt_check_finite(f, ds, dst, tensor_numel(t), err);
            dst += tensor_numel(t);
        }
    }
    return st;
}

/* The stored rank, alpha and rslora of each adapter against the run's rule:
 * loading B A under another scale would change the model silently. A file
 * without these attributes (not written by qtrain) is taken by shape only. */
QtStatus ckpt_check_lora_specs(const H5ioFile *f, const CheckpointNet *net, QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < net->n_adapters; i++) {
        const LoraAdapter *a = &net->adapters[i];
        char g[CKPT_OBJ_MAX];
        if ((st = ckpt_obj_path(g, "lora", a->module->path, NULL, err)) != QT_OK) break;
        if (h5io_kind(f, g) != H5IO_GROUP || !h5io_attr_exists(f, g, "rank") || !h5io_attr_exists(f, g, "alpha") ||
            !h5io_attr_exists(f, g, "rslora"))
            continue;
        int64_t rank = 0, rslora = 0;
        double alpha = 0.0;
        st = h5io_attr_read_i64(f, g, "rank", &rank, err);
        if (st == QT_OK) st = h5io_attr_read_f64(f, g, "alpha", &alpha, err);
        if (st == QT_OK) st = h5io_attr_read_i64(f, g, "rslora", &rslora, err);
        if (st != QT_OK) break;
        if (rank == a->spec.rank && (float)alpha == a->spec.alpha && (rslora != 0) == a->spec.rslora) continue;
        st = qt_error_set(err, QT_ERR_CONFIG, "%s: the adapter of module %s was trained with rank %lld, alpha %g, "
                          "rslora %s, but this run's lora rule for %s gives rank %d, alpha %g, rslora %s; set that "
                          "rule's rank, alpha and rslora to the stored values (a rule of its own for %s if other "
                          "modules differ), or the adapter's scale would change", f->path, a->module->path,
                          (long long)rank, alpha, rslora ? "true" : "false", a->module->path, a->spec.rank,
                          (double)a->spec.alpha, a->spec.rslora ? "true" : "false", a->module->path);
    }
    return st;
}

/* ---- QAT state ---------------------------------------------------------------------------- */

/* The dataset name of a learned range: the last part of its param name. */
static const char *range_leaf(const FqRange *r) {
    const char *slash = strrchr(r->param.name, '/');
    return slash ? slash + 1 : r->param.name;
}

static QtStatus write_range(H5ioFile *f, const char *g, const FqRange *r, QtError *err) {
    char ds[CKPT_OBJ_MAX + 32];
    snprintf(ds, sizeof ds, "%s/%s", g, range_leaf(r));
    const Tensor *t = &r->param.var.value;
    return h5io_write_f32(f, ds, t->data, t->ndim, t->shape, err);
}

static QtStatus write_qat_one(H5ioFile *f, const QatLayer *q, QtError *err) {
    const char *m = q->module->path;
    bool learned = q->qat.learn_amax != QAT_LEARN_NONE;
    char g[CKPT_OBJ_MAX], calib[64];
    QtStatus st = ckpt_obj_path(g, "quant", m, NULL, err);
    if (st == QT_OK) st = h5io_group_create(f, g, err);
    const char *tensors[2] = {"weight", q->spec.act_qtype ? "input" : NULL};
    for (int k = 0; st == QT_OK && k < 2 && tensors[k]; k++) {
        char t[CKPT_OBJ_MAX], state[CKPT_OBJ_MAX + 8];
        st = ckpt_obj_path(t, "quant", m, tensors[k], err);
        snprintf(state, sizeof state, "%s/state", t);
        if (st == QT_OK) st = h5io_group_create(f, t, err);
        if (st == QT_OK) st = h5io_group_create(f, state, err);
        if (st == QT_OK)
            st = h5io_attr_write_str(f, t, "qtype", qtype_name(k ? q->spec.act_qtype : q->spec.weight_qtype), err);
        if (st == QT_OK) st = h5io_attr_write_str(f, t, "learn_amax", qat_learn_name(q->qat.learn_amax), err);
        if (st == QT_OK && learned) st = write_range(f, state, k ? &q->a_range : &q->w_range, err);
        if (st == QT_OK && k == 1) {
            calib_format(&q->act_stats.spec, calib, sizeof calib);
            st = h5io_attr_write_str(f, state, "calibration", calib, err);
            if (st == QT_OK) st = h5io_attr_write_f64(f, state, "lo_mean", q->act_stats.lo_mean, err);
            if (st == QT_OK) st = h5io_attr_write_f64(f, state, "hi_mean", q->act_stats.hi_mean, err);
            if (st == QT_OK) st = h5io_attr_write_i64(f, state, "count", q->act_stats.count, err);
        }
    }
    return st;
}

static QtStatus write_qt_one(H5ioFile *f, const FqtLayer *q, QtError *err) {
    char g[CKPT_OBJ_MAX], t[CKPT_OBJ_MAX], state[CKPT_OBJ_MAX + 8];
    QtStatus st = ckpt_obj_path(g, "quant", q->module->path, NULL, err);
    if (st == QT_OK) st = ckpt_obj_path(t, "quant", q->module->path, "grad", err);
    snprintf(state, sizeof state, "%s/state", t);
    if (st == QT_OK) st = h5io_group_create(f, g, err);
    if (st == QT_OK) st = h5io_group_create(f, t, err);
    if (st == QT_OK) st = h5io_group_create(f, state, err);
    if (st == QT_OK) st = h5io_attr_write_u64(f, state, "seed", q->rng.seed, err);
    if (st == QT_OK) st = h5io_attr_write_u64(f, state, "stream", q->rng.stream, err);
    if (st == QT_OK) st = h5io_attr_write_u64(f, state, "counter", q->rng.counter, err);
    return st;
}

QtStatus ckpt_write_qat(H5ioFile *f, const CheckpointNet *net, QtError *err) {
    if (net->n_qat == 0 && net->n_qt == 0) return QT_OK;
    QtStatus st = h5io_exists(f, "quant") ? QT_OK : h5io_group_create(f, "quant", err);
    for (int i = 0; st == QT_OK && i < net->n_qat; i++) st = write_qat_one(f, &net->qat[i], err);
    for (int i = 0; st == QT_OK && i < net->n_qt; i++) st = write_qt_one(f, &net->qt[i], err);
    return st;
}

static QtStatus read_qt(const H5ioFile *f, const CheckpointNet *net, CkptNetStaged *sg, QtError *err) {
    if (net->n_qt == 0) return QT_OK;
    sg->fqt_rngs = calloc((size_t)net->n_qt, sizeof *sg->fqt_rngs);
    if (!sg->fqt_rngs) return qt_error_set(err, QT_ERR_NOMEM, "out of memory loading %s", f->path);
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < net->n_qt; i++) {
        char t[CKPT_OBJ_MAX], state[CKPT_OBJ_MAX + 8];
        st = ckpt_obj_path(t, "quant", net->qt[i].module->path, "grad", err);
        snprintf(state, sizeof state, "%s/state", t);
        if (st == QT_OK && h5io_kind(f, state) != H5IO_GROUP)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: the gradient-rounding state of module %s (/%s) is missing; "
                              "the checkpoint was not written by a qt run with these rules", f->path,
                              net->qt[i].module->path, state);
        if (st == QT_OK) st = h5io_attr_read_u64(f, state, "seed", &sg->fqt_rngs[i].seed, err);
        if (st == QT_OK) st = h5io_attr_read_u64(f, state, "stream", &sg->fqt_rngs[i].stream, err);
        if (st == QT_OK) st = h5io_attr_read_u64(f, state, "counter", &sg->fqt_rngs[i].counter, err);
    }
    return st;
}

/* v [n] of a learned range, held to what the fake-quant op accepts: a tqt log2_t of either sign (a fresh range
 * holds 0, threshold 1) and an lsq step size, each giving a scale in [1e-19, 3.4e38], so an lsq value <= 0 is
 * refused. Training stops on a non-finite value (net_check_ranges) and the op on a scale outside that range, so
 * a run could not go on from a checkpoint holding either. */
static QtStatus check_range_values(const H5ioFile *f, const char *ds, const FqRange *r, const float *v, size_t n,
                                   QtError *err) {
    for (size_t i = 0; i < n; i++) {
        float s = fq_range_scale(&r->spec, v[i]);
        if (isfinite(v[i]) && s >= QARRAY_SCALE_MIN && !isinf(s)) continue;
        bool lsq = r->spec.kind == FQ_RANGE_LSQ;
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s[%zu] = %g; a learned %s must be finite and give a scale "
                            "in [1e-19, 3.4e38]%s; the checkpoint is damaged or the range diverged before it was "
                            "saved: resume from an earlier checkpoint (with a lower quant.rules lr)", f->path, ds,
                            i, (double)v[i], lsq ? "step size" : "log2 threshold", lsq ? " (it is the scale)" : "");
    }
    return QT_OK;
}

static QtStatus read_range(const H5ioFile *f, const char *state, const FqRange *r, float *dst, QtError *err) {
    char ds[CKPT_OBJ_MAX + 32], got[96], want[64];
    snprintf(ds, sizeof ds, "%s/%s", state, range_leaf(r));
    const Tensor *t = &r->param.var.value;
    H5ioInfo info;
    if (h5io_kind(f, ds) != H5IO_DATASET)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: the learned range /%s is missing; the checkpoint was written "
                            "with another learn_amax", f->path, ds);
    QtStatus st = h5io_dataset_info(f, ds, &info, err);
    if (st == QT_OK && !h5io_shape_equals(&info, t->ndim, t->shape))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: /%s has shape %s, this run's range %s", f->path, ds,
                          h5io_shape_str(&info, got, sizeof got), tensor_shape_str(t, want, sizeof want));
    if (st == QT_OK) st = h5io_read_f32(f, ds, dst, t->ndim, t->shape, err);
    if (st == QT_OK) st = check_range_values(f, ds, r, dst, tensor_numel(t), err);
    return st;
}

QtStatus ckpt_read_qat(const H5ioFile *f, const CheckpointNet *net, CkptNetStaged *sg, QtError *err) {
    QtStatus qst = read_qt(f, net, sg, err);
    if (qst != QT_OK || net->n_qat == 0) return qst;
    size_t total = 0;
    for (int i = 0; i < net->n_qat; i++) {
        Param *ps[2];
        int k = qat_layer_params(&net->qat[i], ps);
        for (int j = 0; j < k; j++) total += var_numel(&ps[j]->var);
    }
    sg->qat_ranges = malloc((total ? total : 1) * sizeof(float));
    sg->qat_act = calloc((size_t)net->n_qat, sizeof *sg->qat_act);
    if (!sg->qat_ranges || !sg->qat_act) return qt_error_set(err, QT_ERR_NOMEM, "out of memory loading %s", f->path);
    float *dst = sg->qat_ranges;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < net->n_qat; i++) {
        const QatLayer *q = &net->qat[i];
        char t[CKPT_OBJ_MAX], state[CKPT_OBJ_MAX + 8];
        bool learned = q->qat.learn_amax != QAT_LEARN_NONE;
        st = ckpt_obj_path(t, "quant", q->module->path, "weight", err);
        snprintf(state, sizeof state, "%s/state", t);
        if (st == QT_OK && h5io_kind(f, state) != H5IO_GROUP)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: the QAT state of module %s (/%s) is missing; the checkpoint "
                              "was not written by a qat run with these rules", f->path, q->module->path, state);
        if (st == QT_OK && learned && (st = read_range(f, state, &q->w_range, dst, err)) == QT_OK)
            dst += var_numel(&q->w_range.param.var);
        if (st != QT_OK || !q->spec.act_qtype) continue;
        st = ckpt_obj_path(t, "quant", q->module->path, "input", err);
        snprintf(state, sizeof state, "%s/state", t);
        if (st == QT_OK && learned && (st = read_range(f, state, &q->a_range, dst, err)) == QT_OK)
            dst += var_numel(&q->a_range.param.var);
        if (st == QT_OK) st = read_running_stats(f, state, &sg->qat_act[i], err);
    }
    return st;
}

void ckpt_commit_net(CkptNetStaged *sg, const CheckpointNet *net) {
    for (int i = 0; sg->fqt_rngs && i < net->n_qt; i++) net->qt[i].rng = sg->fqt_rngs[i];
    const float *r = sg->qat_ranges;
    for (int i = 0; r && i < net->n_qat; i++) {
        QatLayer *q = &net->qat[i];
        Param *ps[2];
        int k = qat_layer_params(q, ps);
        for (int j = 0; j < k; j++) {
            size_t n = var_numel(&ps[j]->var);
            memcpy(ps[j]->var.value.data, r, n * sizeof(float));
            r += n;
        }
        if (q->spec.act_qtype) q->act_stats = sg->qat_act[i];
        q->ranges_ready = true;
    }
    for (int i = 0; sg->weights && i < net->n_qlayers; i++) {
        QLayer *q = &net->qlayers[i];
        qlayer_int8_release(q); /* its packed copy is of the codes being replaced */
        qarray_free(&q->weight);
        q->weight = sg->weights[i];
        memset(&sg->weights[i], 0, sizeof sg->weights[i]);
        if (q->spec.act_qtype) {
            q->act_stats = sg->act[i];
            q->act_scale = sg->act_scale[2 * i], q->act_zero_point = sg->act_scale[2 * i + 1];
            q->act_ready = q->act_scale > 0.0f;
        }
    }
    sg->n_weights = 0;
    const float *src = sg->lora;
    for (int i = 0; src && i < net->n_adapters; i++) {
        LoraAdapter *a = &net->adapters[i];
        size_t na = var_numel(&a->A.var), nb = var_numel(&a->B.var);
        memcpy(a->A.var.value.data, src, na * sizeof(float));
        memcpy(a->B.var.value.data, src + na, nb * sizeof(float));
        src += na + nb;
    }
}

void ckpt_staged_net_free(CkptNetStaged *sg) {
    for (int i = 0; sg->weights && i < sg->n_weights; i++) qarray_free(&sg->weights[i]);
    free(sg->weights);
    free(sg->act);
    free(sg->act_scale);
    free(sg->lora);
    free(sg->qat_ranges);
    free(sg->qat_act);
    free(sg->fqt_rngs);
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

QtStatus checkpoint_base_sha256(const Model *m, const CheckpointNet *net, char hex[SHA256_HEX_CHARS], QtError *err) {
    size_t cap = (size_t)m->n_params + (size_t)net->n_qlayers * QARRAY_MAX_BLOBS + 1, n = 0;
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
    for (int i = 0; i < net->n_qlayers; i++) {
        QArrayBlob blobs[QARRAY_MAX_BLOBS];
        int nb = qarray_blobs(&net->qlayers[i].weight, blobs);
        for (int b = 0; b < nb; b++) {
            snprintf(r[n].name, sizeof r[n].name, "quant/%s/weight/%s", net->qlayers[i].module->path, blobs[b].name);
            r[n].dtype = blob_dtype(blobs[b].type);
            snprintf(r[n].shape, sizeof r[n].shape, "%zu", blobs[b].count);
            r[n].data = blobs[b].data;
            r[n++].bytes = blobs[b].count * blob_elem_size(blobs[b].type);
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
