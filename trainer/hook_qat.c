/* hook_qat.c - the qat hook kind: quantization-aware training
 * (quant/qat.h) of each module a quant.mode qat rule quantizes. The float
 * weight trains; the learned ranges are parameters of their own. Its
 * checkpoint state is under /quant/<module>/{weight,input}: the learned
 * ranges and the input's running statistics; a layer that trains with a
 * batch norm folded in says so in the attribute folded_bn of
 * /quant/<module> (the batch norm's path); a file without it loads with
 * the batch norm unfolded, as such a layer trained before QAT folded them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint_internal.h"
#include "quant/qarray_io.h"
#include "trainer/bn_fold.h"
#include "trainer/hook.h"
#include "trainer/net.h"

_Static_assert(offsetof(QatLayer, module) == 0, "a hook layer starts with its module (hook.h)");

/* ---- building ------------------------------------------------------------------------ */

static bool qat_applies(const Net *n, int module) {
    return n->cfg->quant.mode == QUANT_MODE_QAT && net_quant_spec(n, module);
}

static QtStatus qat_check(const Net *n, int module, QtError *err) {
    return qat_layer_check(net_quant_spec(n, module), &n->cfg->quant.rules[n->quant_rule[module]].qat,
                           &n->model.modules[module], err);
}

/* The QAT layer of module p among set's first k, or NULL. */
static QatLayer *qat_layer_of(QatLayer *ql, int k, const Module *p) {
    for (int j = 0; j < k; j++)
        if (ql[j].module == p) return &ql[j];
    return NULL;
}

/* Folds each batch norm the run can fold (bn_fold.h's rules) into the QAT layer before it, noting in n->bn_note
 * why the others stay float batch norms. */
static QtStatus qat_fold_batchnorms(Net *n, QatLayer *ql, int k, QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && n->bn_note && i < n->model.n_modules; i++) {
        Module *b = &n->model.modules[i];
        char *note = n->bn_note[i];
        if (!b->running_mean) continue;
        if (b->bn_folded != BN_FOLD_NONE) { /* model.init_from holds it folded: it stays so */
            snprintf(note, BN_NOTE_MAX, "%s: folded into %s (as model.init_from holds it)", b->path,
                     n->model.modules[b->inputs[0]].path);
            continue;
        }
        if (!net_bn_foldable(n, i, note)) continue;
        Module *p = &n->model.modules[b->inputs[0]];
        QatLayer *q = qat_layer_of(ql, k, p);
        if (!q)
            snprintf(note, BN_NOTE_MAX, "%s: not folded: %s is not quantized (no qat rule)", b->path, p->path);
        else if ((st = qat_layer_fold_bn(q, b, n->cfg->quant.freeze_bn_after, err)) == QT_OK)
            snprintf(note, BN_NOTE_MAX, "%s: folded into %s's QAT weight", b->path, p->path);
    }
    return st;
}

/* QAT layers over the (trainable) float weights, with the batch norms after them folded in; a fresh run
 * initialises learned weight ranges from the (folded) weights it starts with. */
static QtStatus qat_attach(Net *n, HookSet *set, bool fresh, QtError *err) {
    QatLayer *ql = set->layers;
    int k = 0;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) {
        if (!qat_applies(n, i)) continue;
        QatLayer *q = &ql[k++];
        st = qat_layer_init(q, &n->model.modules[i], net_quant_spec(n, i), &n->cfg->quant.rules[n->quant_rule[i]].qat,
                            err);
        if (st == QT_OK) q->round_rng = qlayer_round_rng(n->cfg->run.seed, i);
    }
    if (st == QT_OK) st = qat_fold_batchnorms(n, ql, k, err);
    for (int j = 0; st == QT_OK && j < k; j++) {
        if (fresh) st = qat_layer_init_ranges(&ql[j], err);
        if (st == QT_OK) qat_layer_install(&ql[j]);
    }
    return st;
}

static void qat_free(void *layer) { qat_layer_free(layer); }
static int qat_params(void *layer, Param **out) { return qat_layer_params(layer, out); }
static float qat_lr(const void *layer) { return ((const QatLayer *)layer)->qat.lr; }

/* A learned range that is not finite after an update. */
static QtStatus qat_check_step(const Net *n, const void *layer, int64_t step, QtError *err) {
    QatLayer *q = (QatLayer *)layer;
    Param *ps[2];
    int k = qat_layer_params(q, ps);
    for (int j = 0; j < k; j++) {
        size_t m = var_numel(&ps[j]->var);
        for (size_t e = 0; e < m; e++)
            if (!isfinite(ps[j]->var.value.data[e]))
                return qt_error_set(err, QT_ERR_VALUE, "step %lld: module %s: the learned range %s[%zu] is %g; "
                                    "lower its lr (quant.rules[%d].lr) or train.optimizer.lr, or set "
                                    "train.grad_clip", (long long)step, q->module->path, ps[j]->name, e,
                                    (double)ps[j]->var.value.data[e], n->quant_rule[q->module - n->model.modules]);
    }
    return QT_OK;
}

static void qat_set_step(void *layer, int64_t step) { qat_layer_set_step(layer, step); }
static void qat_calib_begin(void *layer) { qat_layer_calib_begin(layer); }
static QtStatus qat_calib_end(void *layer, QtError *err) { return qat_layer_calib_end(layer, err); }

static bool qat_needs_calib(const void *layer) {
    const QatLayer *q = layer;
    return q->spec.act_qtype && (q->qat.learn_amax || q->qat.act_static_scale);
}

/* ---- reporting ------------------------------------------------------------------------ */

static void qat_describe(const void *layer, char *buf, size_t cap) {
    const QatLayer *qa = layer;
    const QLayerSpec *sp = &qa->spec;
    char g[24];
    if (sp->tile_size > 0) snprintf(g, sizeof g, "block %d", sp->tile_size);
    else snprintf(g, sizeof g, "%s", sp->per_tensor ? "per-tensor" : "per-channel");
    snprintf(buf, cap, "qat %s %s, learn %s, act %s%s", qtype_name(sp->weight_qtype), g,
             qat_learn_name(qa->qat.learn_amax), sp->act_qtype ? qtype_name(sp->act_qtype) : "float",
             sp->act_qtype && !qa->qat.learn_amax ? (qa->qat.act_static_scale ? " static" : " dynamic") : "");
}

static void qat_formats(const void *layer, char *w, size_t wcap, char *a, size_t acap) {
    const QatLayer *q = layer;
    const QLayerSpec *s = &q->spec;
    snprintf(w, wcap, "%s/%s%s", qtype_name(s->weight_qtype), s->tile_size > 0 ? "blk" : s->per_tensor ? "t" : "ch",
             q->qat.learn_amax ? (q->qat.learn_amax == QAT_LEARN_TQT ? "+tqt" : "+lsq") : "");
    snprintf(a, acap, "%s", s->act_qtype ? qtype_name(s->act_qtype) : "");
}

/* The weight in the layout `qtrain convert` gives it. */
static double qat_base_bytes(const void *layer) {
    const QatLayer *q = layer;
    QArray tmp;
    double bytes = 0.0;
    if (qarray_alloc(&tmp, q->w_ndim, q->w_shape, q->spec.weight_qtype, &q->w_options, NULL) == QT_OK)
        bytes = (double)qarray_bytes(&tmp);
    qarray_free(&tmp);
    return bytes;
}

/* ---- checkpoints ---------------------------------------------------------------------- */

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

static QtStatus qat_save(H5ioFile *f, const void *layer, QtError *err) {
    const QatLayer *q = layer;
    const char *m = q->module->path;
    bool learned = q->qat.learn_amax != QAT_LEARN_NONE;
    char g[CKPT_OBJ_MAX], calib[64];
    QtStatus st = ckpt_obj_path(g, "quant", m, NULL, err);
    if (st == QT_OK) st = h5io_group_create(f, g, err);
    if (st == QT_OK && q->bn) st = h5io_attr_write_str(f, g, "folded_bn", q->bn->path, err);
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

/* The layer's batch norm folded in (q->bn) against the file's folded_bn marker on /quant/<module> (g). A file
 * without it was written before QAT folded batch norms: its layer trained with the batch norm after it unfolded, so
 * it loads so (*unfold) rather than as another model. A marker this run does not fold is refused. */
static QtStatus check_folded_bn(const H5ioFile *f, const char *g, const QatLayer *q, bool *unfold, QtError *err) {
    char *marked = NULL;
    QtStatus st = QT_OK;
    if (h5io_kind(f, g) == H5IO_GROUP && h5io_attr_exists(f, g, "folded_bn"))
        st = h5io_attr_read_str(f, g, "folded_bn", &marked, err);
    const char *want = q->bn ? q->bn->path : NULL;
    *unfold = st == QT_OK && want && !marked;
    if (st == QT_OK && marked && (!want || strcmp(marked, want) != 0))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: module %s was trained with batch norm %s folded into its QAT "
                          "weight (/%s attribute folded_bn), but this run %s%s; load it with the config it was "
                          "written with (quant.fold_bn: true)", f->path, q->module->path, marked, g,
                          want ? "folds " : "folds none into it", want ? want : "");
    free(marked);
    return st;
}

typedef struct {
    float *ranges;      /* the learned ranges' values, weight then input */
    CalibRunning act;   /* the input's statistics */
    bool unfold;        /* the file's layer trained with its batch norm unfolded (check_folded_bn) */
} QatStaged;

static QtStatus qat_load(const H5ioFile *f, const void *layer, void *staged, QtError *err) {
    const QatLayer *q = layer;
    QatStaged *sg = staged;
    size_t total = 0;
    Param *ps[2];
    int np = qat_layer_params((QatLayer *)q, ps);
    for (int j = 0; j < np; j++) total += var_numel(&ps[j]->var);
    sg->ranges = malloc((total ? total : 1) * sizeof(float));
    if (!sg->ranges) return qt_error_set(err, QT_ERR_NOMEM, "out of memory loading %s", f->path);
    float *dst = sg->ranges;
    char t[CKPT_OBJ_MAX], state[CKPT_OBJ_MAX + 8];
    bool learned = q->qat.learn_amax != QAT_LEARN_NONE;
    QtStatus st = ckpt_obj_path(t, "quant", q->module->path, NULL, err);
    if (st == QT_OK) st = check_folded_bn(f, t, q, &sg->unfold, err);
    if (st == QT_OK) st = ckpt_obj_path(t, "quant", q->module->path, "weight", err);
    snprintf(state, sizeof state, "%s/state", t);
    if (st == QT_OK && h5io_kind(f, state) != H5IO_GROUP)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: the QAT state of module %s (/%s) is missing; the checkpoint "
                          "was not written by a qat run with these rules", f->path, q->module->path, state);
    if (st == QT_OK && learned && (st = read_range(f, state, &q->w_range, dst, err)) == QT_OK)
        dst += var_numel(&q->w_range.param.var);
    if (st != QT_OK || !q->spec.act_qtype) return st;
    st = ckpt_obj_path(t, "quant", q->module->path, "input", err);
    snprintf(state, sizeof state, "%s/state", t);
    if (st == QT_OK && learned && (st = read_range(f, state, &q->a_range, dst, err)) == QT_OK)
        dst += var_numel(&q->a_range.param.var);
    if (st == QT_OK) st = ckpt_read_running_stats(f, state, &sg->act, err);
    return st;
}

static void qat_commit(void *layer, void *staged) {
    QatLayer *q = layer;
    QatStaged *sg = staged;
    const float *r = sg->ranges;
    Param *ps[2];
    int k = qat_layer_params(q, ps);
    for (int j = 0; j < k; j++) {
        size_t n = var_numel(&ps[j]->var);
        memcpy(ps[j]->var.value.data, r, n * sizeof(float));
        r += n;
    }
    if (q->spec.act_qtype) q->act_stats = sg->act;
    q->ranges_ready = true;
    if (sg->unfold) qat_layer_unfold_bn(q);
}

static void qat_staged_free(void *staged) { free(((QatStaged *)staged)->ranges); }

const HookKind HOOK_QAT = {
    .name = "qat",
    .layer_size = sizeof(QatLayer),
    .rules = HOOK_RULES_QUANT,
    .trains_weight = true,
    .applies = qat_applies,
    .check = qat_check,
    .attach = qat_attach,
    .free = qat_free,
    .params = qat_params,
    .lr = qat_lr,
    .check_step = qat_check_step,
    .set_step = qat_set_step,
    .calib_begin = qat_calib_begin,
    .calib_end = qat_calib_end,
    .needs_calib = qat_needs_calib,
    .describe = qat_describe,
    .formats = qat_formats,
    .base_bytes = qat_base_bytes,
    .group = "quant",
    .save = qat_save,
    .staged_size = sizeof(QatStaged),
    .load = qat_load,
    .commit = qat_commit,
    .staged_free = qat_staged_free,
};

QatLayer *net_qat_layer(const Net *n, int i) { return net_hook_layer(n, &HOOK_QAT, i); }
