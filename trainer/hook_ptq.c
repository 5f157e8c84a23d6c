/* hook_ptq.c - the ptq hook kind: a frozen quantized base weight
 * (quant/qlayer.h) on each module a quant.mode ptq rule quantizes. A fresh
 * run takes it from model.init_from (quantized here from the float
 * weights, or read as a PTQ checkpoint stores it); its checkpoint state is
 * /quant/<module>/weight (the packed codes and scales) and, with an
 * act_qtype, /quant/<module>/input (the static input range). Between
 * loading and quantizing, batch norms fold into the layers before them
 * (quant.fold_bn). Loading checks
 * the stored scales, zero points and ranges before anything uses them: a
 * value no run writes would otherwise load and turn every logit into NaN. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint_internal.h"
#include "quant/fqt.h"
#include "quant/qarray_io.h"
#include "quant/qgemm.h"
#include "trainer/hook.h"
#include "trainer/interop.h"
#include "trainer/net.h"

_Static_assert(offsetof(QLayer, module) == 0, "a hook layer starts with its module (hook.h)");

/* ---- building ------------------------------------------------------------------------ */

static bool ptq_applies(const Net *n, int module) {
    return n->cfg->quant.mode == QUANT_MODE_PTQ && net_quant_spec(n, module);
}

static QtStatus ptq_check(const Net *n, int module, QtError *err) {
    return qlayer_spec_check(net_quant_spec(n, module), &n->model.modules[module], err);
}

/* The modules a PTQ init_from holds quantized must be exactly those this
 * run quantizes... or a subset, the rest being quantized here from the
 * float weights the file holds. A module stored quantized that this run
 * keeps float cannot be undone. */
static QtStatus ptq_check_stored(const Net *n, const char (*stored)[MODULE_NAME_MAX], int n_stored,
                                       QtError *err) {
    for (int s = 0; s < n_stored; s++) {
        const Module *m = model_find_module((Model *)&n->model, stored[s]);
        int idx = m ? (int)(m - n->model.modules) : -1;
        if (idx < 0 || !net_quant_spec(n, idx))
            return qt_error_set(err, QT_ERR_CONFIG, "%s: model.init_from %s holds module %s quantized, but this "
                                "config's quant rules keep it float; add a quant rule for it (the same format) or "
                                "start from the float checkpoint", n->cfg->source, n->cfg->model.init_from, stored[s]);
    }
    return QT_OK;
}

static bool name_listed(const char (*names)[MODULE_NAME_MAX], int n, const char *path) {
    for (int i = 0; i < n; i++)
        if (strcmp(names[i], path) == 0) return true;
    return false;
}

/* Folds the batch norms (quant.fold_bn, bn_fold.h) into the float weights
 * just loaded, then quantizes every base layer whose float weight is still
 * held (not filled as stored from a PTQ file) and releases the float
 * weight: the quantized weight is the folded one. A module whose adapter
 * starts as pissa or loftq gets the base that init fits, and the init's A
 * and B wait in the Net for the LoRA hook (net_lora_init_quantized). */
static QtStatus ptq_quantize_held(Net *n, HookSet *set, QtError *err) {
    QLayer *ql = set->layers;
    QtStatus st = QT_OK;
    net_fold_batchnorms(n);
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) { /* a batch norm held folded cannot train */
        const Module *b = &n->model.modules[i];
        if (b->bn_folded != BN_FOLD_NONE && net_bn_trains(n, i))
            st = qt_error_set(err, QT_ERR_CONFIG, "%s: model.init_from %s holds batch norm %s folded into %s, so it "
                              "cannot train (%s); start from the float checkpoint, or from one quantized with "
                              "quant.fold_bn: false", n->cfg->source, n->cfg->model.init_from, b->path,
                              n->model.modules[b->inputs[0]].path,
                              n->is_trainable[i] ? "lora.trainable" : "lora.batchnorm: train");
    }
    for (int i = 0; st == QT_OK && i < set->n; i++) {
        QLayer *q = &ql[i];
        if (q->module->weight->released) continue;
        QLayerSpec spec = q->spec;
        int mi = (int)(q->module - n->model.modules);
        Rng rng = qlayer_round_rng(n->cfg->run.seed, mi);
        const LoraSpec *ls = net_lora_spec(n, mi);
        if (ls && lora_init_is_svd(ls->init)) /* pissa / loftq: the base they fit, and their A, B staged */
            st = net_lora_init_quantized(n, q, &rng, err);
        else
            st = qlayer_init_quantize_rng(q, q->module, &spec, q->module->weight->var.value.data, &rng, err);
        if (st == QT_OK) param_release(q->module->weight);
    }
    return st;
}

/* NET_FRESH: float parameters from init_from; modules the file holds
 * quantized are read as stored, the others quantized here. */
static QtStatus ptq_load_base(Net *n, HookSet *set, QtError *err) {
    const Config *c = n->cfg;
    QLayer *ql = set->layers;
    const char *from = c->model.init_from;
    char (*stored)[MODULE_NAME_MAX] = calloc(CKPT_LIST_MAX, MODULE_NAME_MAX);
    if (!stored) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    int n_stored = 0;
    QtError e = {0};
    if (interop_is_safetensors(from)) { /* a float state_dict: every weight is quantized here */
        free(stored);
        QtStatus st = interop_load_safetensors(from, &n->model, &e);
        if (st != QT_OK) return qt_error_set(err, e.status, "%s: model.init_from: %s", c->source, e.msg);
        return ptq_quantize_held(n, set, err);
    }
    QtStatus st = checkpoint_list_quant(from, stored, CKPT_LIST_MAX, &n_stored, &e);
    if (st == QT_OK) st = ptq_check_stored(n, (const char(*)[MODULE_NAME_MAX])stored, n_stored, err);
    /* Layouts for the stored ones; release every weight the file lacks in float. */
    QLayer *tmp = calloc((size_t)set->n + 1, sizeof *tmp);
    int n_tmp = 0;
    if (st == QT_OK && !tmp) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    for (int i = 0; st == QT_OK && i < set->n; i++) {
        QLayer *q = &ql[i];
        if (!name_listed((const char(*)[MODULE_NAME_MAX])stored, n_stored, q->module->path)) continue;
        QLayerSpec spec = q->spec; /* init starts by clearing q */
        st = qlayer_init_empty(q, q->module, &spec, err);
        if (st == QT_OK) {
            param_release(q->module->weight);
            tmp[n_tmp] = *q;
            tmp[n_tmp++].spec.act_qtype = NULL; /* static input ranges are calibrated afresh on this run's data */
        }
    }
    CheckpointNet parts = hook_layers_one(&HOOK_PTQ, tmp, n_tmp);
    if (st == QT_OK && e.status == QT_OK && checkpoint_load_model(from, &n->model, &parts, &e) != QT_OK)
        st = e.status;
    if (st == QT_OK && e.status != QT_OK) st = e.status;
    if (e.status != QT_OK) qt_error_set(err, e.status, "%s: model.init_from: %s", c->source, e.msg);
    /* Stored layers got new QArrays from the file: take them back. */
    for (int i = 0, k = 0; i < set->n && k < n_tmp; i++)
        if ((&ql[i])[0].module == tmp[k].module) {
            const QType *act = (&ql[i])[0].spec.act_qtype;
            (&ql[i])[0] = tmp[k++];
            (&ql[i])[0].spec.act_qtype = act;
        }
    if (st == QT_OK) st = ptq_quantize_held(n, set, err);
    free(tmp);
    free(stored);
    return st;
}

/* Layouts for the modules the rules quantize; fresh: the base from
 * model.init_from (or, NET_FRESH_TIMING, the seed's initialisation),
 * quantized. */
static QtStatus ptq_attach(Net *n, HookSet *set, bool fresh, QtError *err) {
    QLayer *ql = set->layers;
    QtStatus st = QT_OK;
    for (int i = 0, k = 0; st == QT_OK && i < n->model.n_modules; i++) {
        Module *m = &n->model.modules[i];
        const QLayerSpec *qs = ptq_applies(n, i) ? net_quant_spec(n, i) : NULL;
        if (qs) {
            QLayer *q = &ql[k++];
            q->module = m; /* what ptq_load_base needs to find it; init_* fill the rest */
            q->spec = *qs;
            if (!fresh && (st = qlayer_init_empty(q, m, qs, err)) == QT_OK) param_release(m->weight);
        }
    }
    if (st == QT_OK && fresh) {
        if (n->cfg->model.init_from[0]) st = ptq_load_base(n, set, err);
        else if (n->base_from_seed) st = ptq_quantize_held(n, set, err);
        else
            return qt_error_set(err, QT_ERR_CONFIG, "%s: quant.mode ptq quantizes a trained model, but model.init_from "
                                "is not set; point it at a float checkpoint (e.g. runs/pretrain/final.h5)",
                                n->cfg->source);
    }
    for (int i = 0; st == QT_OK && i < set->n; i++) qlayer_install(&ql[i]);
    return st;
}

static void ptq_free(void *layer) { qlayer_free(layer); }

static void ptq_calib_begin(void *layer) { qlayer_calib_begin(layer); }
static QtStatus ptq_calib_end(void *layer, QtError *err) { return qlayer_calib_end(layer, err); }
static bool ptq_needs_calib(const void *layer) { return ((const QLayer *)layer)->spec.act_qtype != NULL; }

/* ---- reporting ------------------------------------------------------------------------ */

static void ptq_describe(const void *layer, char *buf, size_t cap) { qlayer_describe(layer, buf, cap); }

static void ptq_formats(const void *layer, char *w, size_t wcap, char *a, size_t acap) {
    const QLayerSpec *s = &((const QLayer *)layer)->spec;
    char g[16];
    if (s->tile_size > 0) snprintf(g, sizeof g, "%d", s->tile_size);
    else snprintf(g, sizeof g, "%s", qtype_is_block(s->weight_qtype) ? "mx" : s->per_tensor ? "t" : "ch");
    snprintf(w, wcap, "%s/%s%s", qtype_name(s->weight_qtype), g, s->double_quant ? "+dq" : "");
    snprintf(a, acap, "%s", s->act_qtype ? qtype_name(s->act_qtype) : "");
}

static size_t ptq_bytes(const void *layer) { return qlayer_bytes(layer); }
static double ptq_base_bytes(const void *layer) { return (double)qlayer_bytes(layer); }

static const char *ptq_int8_kernel(const HookSet *set) {
    for (int i = 0; set && i < set->n; i++)
        if (qlayer_int8_supported(&((const QLayer *)set->layers)[i])) return qlayer_int8_kernel();
    return "none";
}

const char *net_int8_kernel(const Net *n) {
    const char *k = ptq_int8_kernel(hook_layers_find(&n->hooks, &HOOK_PTQ));
    if (strcmp(k, "none") != 0) return k;
    /* QT: its integer GEMMs, which run whatever the family (QTRAIN_INT8_KERNEL=float concerns PTQ alone) */
    static const char *const QT_NAMES[] = {"portable", "avx2", "avxvnni", "vnni", "amx"}; /* by QGemmIsa */
    for (int i = 0, c = net_hook_count(n, &HOOK_FQT); i < c; i++)
        if (fqt_layer_integer(net_fqt_layer(n, i))) return qgemm_force_portable ? "portable" : QT_NAMES[qgemm_isa()];
    return k;
}

void net_int8_layers(const Net *n, int *on_kernel, int *with_int8) {
    const HookSet *set = hook_layers_find(&n->hooks, &HOOK_PTQ);
    *on_kernel = *with_int8 = 0;
    for (int i = 0; set && i < set->n; i++) {
        const QLayer *q = &((const QLayer *)set->layers)[i];
        *on_kernel += qlayer_int8_on_kernel(q);
        *with_int8 += qlayer_int8_formats(q);
    }
}

/* which path int8 x int8 layers evaluate on (a CPU without VNNI emulates them in float), and which of the layers
   with int8 weights and inputs cannot take it (dilated, grouped or per-axis convs run on their dequantized weights) */
static void ptq_table_note(const HookSet *set, FILE *out) {
    if (set->n <= 0) return;
    fprintf(out, "  int8_kernel: %s", ptq_int8_kernel(set));
    int on = 0, with = 0;
    for (int i = 0; i < set->n; i++) {
        const QLayer *q = &((const QLayer *)set->layers)[i];
        on += qlayer_int8_on_kernel(q), with += qlayer_int8_formats(q);
    }
    if (on < with) {
        int geometry = 0, strided = 0;
        for (int i = 0; i < set->n; i++) {
            const QLayer *q = &((const QLayer *)set->layers)[i];
            geometry += qlayer_int8_formats(q) && !qlayer_int8_supported(q);
            strided += qlayer_int8_supported(q) && !qlayer_int8_on_kernel(q);
        }
        fprintf(out, " on %d of %d int8 layers", on, with);
        if (geometry) {
            fprintf(out, "; dequantized float (dilated, grouped or per-axis conv2d):");
            for (int i = 0; i < set->n; i++) {
                const QLayer *q = &((const QLayer *)set->layers)[i];
                if (qlayer_int8_formats(q) && !qlayer_int8_supported(q)) fprintf(out, " %s", q->module->path);
            }
        }
        if (strided) {
            fprintf(out, "; float-emulated (a depthwise stride over 2 across on the %s kernels):",
                    ptq_int8_kernel(set));
            for (int i = 0; i < set->n; i++) {
                const QLayer *q = &((const QLayer *)set->layers)[i];
                if (qlayer_int8_supported(q) && !qlayer_int8_on_kernel(q)) fprintf(out, " %s", q->module->path);
            }
        }
    }
    fputc('\n', out);
}

/* ---- checkpoints ---------------------------------------------------------------------- */

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

static QtStatus ptq_save(H5ioFile *f, const void *layer, QtError *err) {
    const QLayer *q = layer;
    const char *module = q->module->path;
    char g[CKPT_OBJ_MAX], ds[CKPT_OBJ_MAX + 16];
    QtStatus st = ckpt_obj_path(g, "quant", module, NULL, err);
    if (st == QT_OK) st = h5io_group_create(f, g, err);
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
    return st;
}

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
    if (st == QT_OK) st = ckpt_read_running_stats(f, g, out, err);
    /* The scale itself, exactly as used (a converted QAT layer's came from a learned range, not the statistics). */
    double s = NAN, zp = 0.0;
    if (st == QT_OK) st = h5io_attr_read_f64(f, g, "scale", &s, err);
    if (st == QT_OK) st = h5io_attr_read_f64(f, g, "zero_point", &zp, err);
    if (st == QT_OK) st = check_act_range(f, g, q, s, zp, err);
    scale_zp[0] = (float)s, scale_zp[1] = (float)zp;
    return st;
}

/* What a load reads before anything is applied. */
typedef struct {
    QArray weight;         /* a new QArray laid out like the layer's own */
    CalibRunning act;      /* activation statistics (count 0 when the layer has none) */
    float act_scale[2];    /* the stored input scale and zero point */
} PtqStaged;

static QtStatus ptq_load(const H5ioFile *f, const void *layer, void *staged, QtError *err) {
    const QLayer *q = layer;
    PtqStaged *sg = staged;
    char g[CKPT_OBJ_MAX];
    QtStatus st = ckpt_obj_path(g, "quant", q->module->path, "weight", err);
    if (st == QT_OK && h5io_kind(f, g) != H5IO_GROUP)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: the quantized weight of module %s (/%s) is missing; the "
                          "checkpoint was written with module %s in float or without quantization", f->path,
                          q->module->path, g, q->module->path);
    if (st == QT_OK) st = check_weight_attrs(f, g, q, err);
    if (st == QT_OK) st = qarray_alloc(&sg->weight, q->weight.ndim, q->weight.shape, q->weight.qtype, &q->options, err);
    if (st == QT_OK) st = read_blobs(f, g, &sg->weight, err);
    if (st == QT_OK && q->spec.act_qtype) st = read_act(f, q, &sg->act, sg->act_scale, err);
    return st;
}

static void ptq_commit(void *layer, void *staged) {
    QLayer *q = layer;
    PtqStaged *sg = staged;
    qlayer_int8_release(q); /* its packed copy is of the codes being replaced */
    qarray_free(&q->weight);
    q->weight = sg->weight;
    memset(&sg->weight, 0, sizeof sg->weight);
    if (q->spec.act_qtype) {
        q->act_stats = sg->act;
        q->act_scale = sg->act_scale[0], q->act_zero_point = sg->act_scale[1];
        q->act_ready = q->act_scale > 0.0f;
    }
}

static void ptq_staged_free(void *staged) { qarray_free(&((PtqStaged *)staged)->weight); }

static const QArray *ptq_frozen_weight(const void *layer) { return &((const QLayer *)layer)->weight; }

const HookKind HOOK_PTQ = {
    .name = "ptq",
    .layer_size = sizeof(QLayer),
    .rules = HOOK_RULES_QUANT,
    .loads_init_from = true,
    .applies = ptq_applies,
    .check = ptq_check,
    .attach = ptq_attach,
    .free = ptq_free,
    .calib_begin = ptq_calib_begin,
    .calib_end = ptq_calib_end,
    .needs_calib = ptq_needs_calib,
    .describe = ptq_describe,
    .formats = ptq_formats,
    .bytes = ptq_bytes,
    .base_bytes = ptq_base_bytes,
    .table_note = ptq_table_note,
    .group = "quant",
    .save = ptq_save,
    .staged_size = sizeof(PtqStaged),
    .load = ptq_load,
    .commit = ptq_commit,
    .staged_free = ptq_staged_free,
    .frozen_weight = ptq_frozen_weight,
};

QLayer *net_qlayer(const Net *n, int i) { return net_hook_layer(n, &HOOK_PTQ, i); }
