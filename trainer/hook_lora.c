/* hook_lora.c - the lora hook kind: a LoRA adapter (lora/lora.h) over the
 * forward of each module a lora rule adapts, whatever that forward is (the
 * module's own op or a quantized base), so it installs after the kinds
 * that replace the op. Its checkpoint state is /lora/<module> (A, B and
 * the rule's settings as attributes); an adapters.h5 holds it too. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint_internal.h"
#include "lora/lora_dora.h"
#include "quant/qlayer.h"
#include "trainer/hook.h"
#include "trainer/net.h"

_Static_assert(offsetof(LoraAdapter, module) == 0, "a hook layer starts with its module (hook.h)");

/* ---- building ------------------------------------------------------------------------ */

static bool lora_applies(const Net *n, int module) { return net_lora_spec(n, module) != NULL; }

/* A depthwise conv's refusal names the pointwise conv that reads it (through
 * batch norm and activations), the one to adapt instead. */
static QtStatus lora_check(const Net *n, int module, QtError *err) {
    const LoraSpec *ls = net_lora_spec(n, module);
    QtStatus st = lora_spec_check(ls, &n->model.modules[module], err);
    const Module *m = &n->model.modules[module];
    const QLayerSpec *qs = n->cfg->quant.mode != QUANT_MODE_NONE ? net_quant_spec(n, module) : NULL;
    bool ptq_base = qs && n->cfg->quant.mode == QUANT_MODE_PTQ; /* qs: a format, not a float or skip rule */
    if (st == QT_OK && ls->init == LORA_INIT_LOFTQ && !ptq_base)
        st = qt_error_set(err, QT_ERR_CONFIG, "%s: lora init loftq fits the adapter to a quantized base, but no quant "
                          "rule quantizes module %s (quant.mode %s); use init pissa, or add a quant rule for it with "
                          "quant.mode: ptq", m->path, m->path, quant_mode_name(n->cfg->quant.mode));
    if (st == QT_OK && lora_init_is_svd(ls->init) && qs && !ptq_base)
        st = qt_error_set(err, QT_ERR_CONFIG, "%s: lora init %s changes the base weight, which quant.mode %s trains "
                          "quantized; use it over a float or ptq base, or init default", m->path,
                          lora_init_name(ls->init), quant_mode_name(n->cfg->quant.mode));
    if (st == QT_OK && net_lora_spec(n, module)->dora && (HOOK_QAT.applies(n, module) || HOOK_FQT.applies(n, module)))
        st = qt_error_set(err, QT_ERR_CONFIG, "%s: dora: true needs a float or a post-training-quantized base weight, "
                          "but this module is a %s layer (its fake-quantized weight trains); set dora: false, or use "
                          "quant.mode ptq (QLoRA) or none", m->path, HOOK_QAT.applies(n, module) ? "QAT" : "QT");
    if (st != QT_OK && m->spec.type == LAYER_CONV2D && m->spec.groups > 1 && m->spec.groups == m->in_shape[0]) {
        for (int i = module + 1; i < n->model.n_modules; i++) {
            const Module *c = &n->model.modules[i];
            if (c->spec.type == LAYER_CONV2D && c->spec.groups == 1) {
                size_t len = strlen(err->msg);
                snprintf(err->msg + len, sizeof err->msg - len, " ('%s')", c->path);
                break;
            }
            if (c->spec.type == LAYER_DENSE || c->spec.type == LAYER_CONV2D) break;
        }
    }
    return st;
}

/* ---- pissa and loftq (lora_svd.h) ------------------------------------------------------ */

/* The quantizer lora_svd_init alternates with: the PTQ hook's own call on the module's layer, so the base the last
 * call leaves is exactly what the hook would have stored for that weight. */
typedef struct {
    QLayer *q;
    Module *m;
    QLayerSpec spec;
    const Rng *rng;
} SvdQuant;

static QtStatus svd_quantize(void *ctx, const float *target, float *deq, QtError *err) {
    SvdQuant *c = ctx;
    qlayer_free(c->q); /* the previous iteration's codes */
    QtStatus st = qlayer_init_quantize_rng(c->q, c->m, &c->spec, target, c->rng, err);
    if (st == QT_OK) qlayer_dequantize_weight(c->q, deq);
    return st;
}

/* pissa / loftq on module i's float weight w: A, B staged in n->lora_init[i], base [numel] the new base (the
 * residual, or the dequantized quantized base with q). */
static QtStatus svd_init_module(Net *n, int i, const float *w, QLayer *q, const Rng *round_rng, float *base,
                                QtError *err) {
    Module *m = &n->model.modules[i];
    const LoraSpec *ls = net_lora_spec(n, i);
    NetLoraInit *li = &n->lora_init[i];
    int out = m->weight->var.value.shape[0], fan_in = (int)(var_numel(&m->weight->var) / (size_t)out), r = ls->rank;
    free(li->ab);
    li->ab = malloc(((size_t)r * fan_in + (size_t)out * r) * sizeof *li->ab);
    if (!li->ab) return qt_error_set(err, QT_ERR_NOMEM, "out of memory for the lora init of %s", m->path);
    SvdQuant sq = {.q = q, .m = m, .spec = q ? q->spec : (QLayerSpec){0}, .rng = round_rng};
    int iters = ls->init == LORA_INIT_LOFTQ ? n->cfg->lora.loftq_iters : 0;
    QtError e = {0};
    QtStatus st = lora_svd_init(w, out, fan_in, r, lora_spec_scale(ls), iters, q ? svd_quantize : NULL, &sq, li->ab,
                                li->ab + (size_t)r * fan_in, base, &li->report, &e);
    if (st != QT_OK) {
        free(li->ab), li->ab = NULL;
        return qt_error_set(err, st, "%s: lora init %s: %s", m->path, lora_init_name(ls->init), e.msg);
    }
    li->ran = true;
    return QT_OK;
}

QtStatus net_lora_init_quantized(Net *n, QLayer *q, const Rng *round_rng, QtError *err) {
    int i = (int)(q->module - n->model.modules);
    size_t numel = var_numel(&q->module->weight->var);
    float *base = malloc(numel * sizeof *base);
    if (!base) return qt_error_set(err, QT_ERR_NOMEM, "out of memory for the lora init of %s", q->module->path);
    QtStatus st = svd_init_module(n, i, q->module->weight->var.value.data, q, round_rng, base, err);
    free(base);
    return st;
}

/* A fresh adapter with init pissa / loftq: A and B as the PTQ hook staged them, or (pissa on a float base) from the
 * module's weight, which becomes the residual. */
static QtStatus svd_init_adapter(Net *n, int i, LoraAdapter *a, QtError *err) {
    Module *m = a->module;
    NetLoraInit *li = &n->lora_init[i];
    QtStatus st = QT_OK;
    if (!li->ab && !m->weight->released && !hook_find(hook_layers_find(&n->hooks, &HOOK_PTQ), m)) {
        size_t numel = var_numel(&m->weight->var);
        float *w = malloc(numel * sizeof *w);
        if (!w) return qt_error_set(err, QT_ERR_NOMEM, "out of memory for the lora init of %s", m->path);
        memcpy(w, m->weight->var.value.data, numel * sizeof *w);
        st = svd_init_module(n, i, w, NULL, NULL, m->weight->var.value.data, err);
        free(w);
        if (st != QT_OK) return st;
    }
    if (!li->ab)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: %s: lora init %s needs the float weight of module %s, but "
                            "model.init_from holds it quantized; start from the float checkpoint, or give the module "
                            "init default", n->cfg->lora.rules[n->lora_rule[i]].match.where, m->path,
                            lora_init_name(a->spec.init), m->path);
    size_t na = var_numel(&a->A.var), nb = var_numel(&a->B.var);
    memcpy(a->A.var.value.data, li->ab, na * sizeof(float));
    memcpy(a->B.var.value.data, li->ab + na, nb * sizeof(float));
    free(li->ab), li->ab = NULL;
    a->init_reported = true;
    a->init_rel_error = li->report.rel_error;
    a->init_default_rel_error = li->report.default_rel_error;
    return QT_OK;
}

void net_print_lora_init(const Net *n, FILE *out) {
    for (int i = 0; n->lora_init && i < n->model.n_modules; i++) {
        const NetLoraInit *li = &n->lora_init[i];
        if (!li->ran) continue;
        const LoraSpec *ls = net_lora_spec(n, i);
        fprintf(out, "lora_init: module=%s init=%s iters=%d rel_error=%.6g default_rel_error=%.6g",
                n->model.modules[i].path, lora_init_name(ls->init), li->report.iters, li->report.rel_error,
                li->report.default_rel_error);
        for (int t = 0; t < li->report.iters; t++)
            fprintf(out, "%s%.6g", t ? "," : " iter_errors=", li->report.iter_error[t]);
        if (li->report.stopped) fprintf(out, " stopped=error_rose"); /* iteration iters + 1 was undone */
        fputc('\n', out);
    }
}

static void dora_dequantize(const void *ctx, float *w) { qlayer_dequantize_weight(ctx, w); }

/* A DoRA adapter's base weight: the module's float weight, or a quantized
 * base's dequantized (the dequantizer kept for every forward); its
 * magnitude starts at the norms of W + scale B A, so this runs after
 * anything that sets W, A or B at attach. A base of another kind
 * (QAT's or QT's fake-quantized weight, which trains) has no fixed W to
 * normalise and is refused. */
static QtStatus dora_attach(Net *n, LoraAdapter *a, QtError *err) {
    Module *m = a->module;
    const QLayer *q = hook_find(hook_layers_find(&n->hooks, &HOOK_PTQ), m);
    if (!q && (m->forward_hook || !m->weight || m->weight->released))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: dora: true needs a float or a post-training-quantized base "
                            "weight, but this module's forward is %s; set dora: false in the lora rule matching %s, or "
                            "use quant.mode ptq (QLoRA) or none", m->path,
                            m->forward_hook ? "a QAT or QT layer's (its fake-quantized weight trains)" : "weightless",
                            m->path);
    if (!q) return lora_dora_init_magnitude(a, m->weight->var.value.data, err);
    a->base_weight = dora_dequantize;
    a->base_weight_ctx = q;
    float *w = malloc((size_t)a->out * a->fan_in * sizeof(float));
    if (!w) return qt_error_set(err, QT_ERR_NOMEM, "out of memory initialising the DoRA adapter of %s", m->path);
    qlayer_dequantize_weight(q, w);
    QtStatus st = lora_dora_init_magnitude(a, w, err);
    free(w);
    return st;
}

/* Every adapter draws its A from one generator of the run's seed, in module order (pissa and loftq too, then
 * overwritten, so the others' draws do not depend on them). */
static QtStatus lora_attach(Net *n, HookSet *set, bool fresh, QtError *err) {
    LoraAdapter *ad = set->layers;
    Rng rng;
    rng_init(&rng, n->cfg->run.seed, RNG_STREAM_LORA);
    int na = 0;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) {
        const LoraSpec *ls = net_lora_spec(n, i);
        if (!ls) continue;
        LoraAdapter *a = &ad[na];
        if ((st = lora_adapter_init(a, &n->model.modules[i], ls, err)) != QT_OK) break;
        na++;
        lora_adapter_init_params(a, &rng);
        if (fresh && lora_init_is_svd(ls->init) && (st = svd_init_adapter(n, i, a, err)) != QT_OK) break;
        if (ls->dora && (st = dora_attach(n, a, err)) != QT_OK) break;
        lora_adapter_install(a);
    }
    set->n = na;
    return st;
}

static void lora_free(void *layer) { lora_adapter_free(layer); }

static int lora_params(void *layer, Param **out) {
    LoraAdapter *a = layer;
    out[0] = &a->A;
    out[1] = &a->B;
    if (!a->spec.dora) return 2;
    out[2] = &a->M;
    return 3;
}

/* ---- reporting ------------------------------------------------------------------------ */

static void lora_describe(const void *layer, char *buf, size_t cap) {
    const LoraAdapter *a = layer;
    snprintf(buf, cap, "rank %d alpha %g (scale %g)%s%s%s", a->spec.rank, (double)a->spec.alpha, (double)a->scale,
             a->spec.rslora ? " rslora" : "", a->spec.dropout > 0 ? " dropout" : "", a->spec.dora ? " dora" : "");
}

static size_t lora_bytes(const void *layer) { return lora_adapter_param_count(layer) * sizeof(float); }

/* ---- checkpoints ---------------------------------------------------------------------- */

static QtStatus lora_save(H5ioFile *f, const void *layer, QtError *err) {
    const LoraAdapter *a = layer;
    char g[CKPT_OBJ_MAX], ds[CKPT_OBJ_MAX];
    QtStatus st = ckpt_obj_path(g, "lora", a->module->path, NULL, err);
    if (st == QT_OK) st = h5io_group_create(f, g, err);
    const Tensor *A = &a->A.var.value, *B = &a->B.var.value;
    if (st == QT_OK && (st = ckpt_obj_path(ds, "lora", a->module->path, "A", err)) == QT_OK)
        st = h5io_write_f32(f, ds, A->data, A->ndim, A->shape, err);
    if (st == QT_OK && (st = ckpt_obj_path(ds, "lora", a->module->path, "B", err)) == QT_OK)
        st = h5io_write_f32(f, ds, B->data, B->ndim, B->shape, err);
    const Tensor *M = &a->M.var.value;
    if (st == QT_OK && a->spec.dora && (st = ckpt_obj_path(ds, "lora", a->module->path, "magnitude", err)) == QT_OK)
        st = h5io_write_f32(f, ds, M->data, M->ndim, M->shape, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, g, "rank", a->spec.rank, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "alpha", a->spec.alpha, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "scale", a->scale, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, g, "rslora", a->spec.rslora, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "dropout", a->spec.dropout, err);
    if (st == QT_OK) st = h5io_attr_write_str(f, g, "init", lora_init_name(a->spec.init), err);
    if (st == QT_OK && a->init_reported) st = h5io_attr_write_f64(f, g, "init_rel_error", a->init_rel_error, err);
    if (st == QT_OK && a->init_reported)
        st = h5io_attr_write_f64(f, g, "init_default_rel_error", a->init_default_rel_error, err);
    if (st == QT_OK) st = h5io_attr_write_i64(f, g, "dora", a->spec.dora, err);
    return st;
}

static QtStatus lora_check_file(const H5ioFile *f, const HookSet *set, QtError *err) {
    if (set->n > 0 && h5io_kind(f, "lora") != H5IO_GROUP)
        return qt_error_set(err, QT_ERR_FORMAT, "%s has no LoRA adapters (/lora) but this run has %d; point at a "
                            "checkpoint or adapters.h5 of a LoRA run with the same lora rules", f->path, set->n);
    return QT_OK;
}

typedef struct {
    float *ab; /* A then B (then a DoRA magnitude) */
    bool init_reported;
    double init_rel_error, init_default_rel_error;
} LoraStaged;

/* A DoRA adapter's file must hold its magnitude, a plain one's none: a
 * magnitude dropped or ignored would change the model silently. */
static QtStatus dora_check_file(const H5ioFile *f, const LoraAdapter *a, QtError *err) {
    char ds[CKPT_OBJ_MAX];
    QtStatus st = ckpt_obj_path(ds, "lora", a->module->path, "magnitude", err);
    if (st != QT_OK) return st;
    bool has = h5io_kind(f, ds) == H5IO_DATASET;
    if (a->spec.dora && !has)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the adapter of module %s is a plain LoRA adapter (no /%s), but "
                            "this run's lora rule for %s has dora: true; set dora: false in that rule, or point at the "
                            "adapters of a DoRA run", f->path, a->module->path, ds, a->module->path);
    if (!a->spec.dora && has)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: the adapter of module %s is a DoRA adapter (it has /%s), but "
                            "this run's lora rule for %s has dora: false; set dora: true in that rule", f->path,
                            a->module->path, ds, a->module->path);
    return QT_OK;
}

static QtStatus lora_load(const H5ioFile *f, const void *layer, void *staged, QtError *err) {
    const LoraAdapter *a = layer;
    LoraStaged *sg = staged;
    sg->ab = malloc(lora_adapter_param_count(a) * sizeof(float));
    if (!sg->ab) return qt_error_set(err, QT_ERR_NOMEM, "out of memory loading the adapters of %s", f->path);
    float *dst = sg->ab;
    const Param *ps[3] = {&a->A, &a->B, &a->M};
    const char *names[3] = {"A", "B", "magnitude"};
    QtStatus st = dora_check_file(f, a, err);
    for (int k = 0; st == QT_OK && k < (a->spec.dora ? 3 : 2); k++) {
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
    char g[CKPT_OBJ_MAX]; /* a pissa / loftq init's report, when the file has it */
    if (st == QT_OK && ckpt_obj_path(g, "lora", a->module->path, NULL, err) == QT_OK &&
        h5io_attr_exists(f, g, "init_rel_error") && h5io_attr_exists(f, g, "init_default_rel_error")) {
        st = h5io_attr_read_f64(f, g, "init_rel_error", &sg->init_rel_error, err);
        if (st == QT_OK) st = h5io_attr_read_f64(f, g, "init_default_rel_error", &sg->init_default_rel_error, err);
        sg->init_reported = st == QT_OK;
    }
    return st;
}

static void lora_commit(void *layer, void *staged) {
    LoraAdapter *a = layer;
    const float *src = ((LoraStaged *)staged)->ab;
    size_t na = var_numel(&a->A.var), nb = var_numel(&a->B.var);
    memcpy(a->A.var.value.data, src, na * sizeof(float));
    memcpy(a->B.var.value.data, src + na, nb * sizeof(float));
    const LoraStaged *sg = staged;
    /* the file's report belongs to the init that fitted its base: kept by a run of that init (a resume), not by one
       that goes on from its adapters with init default */
    a->init_reported = sg->init_reported && lora_init_is_svd(a->spec.init);
    a->init_rel_error = sg->init_rel_error, a->init_default_rel_error = sg->init_default_rel_error;
    if (a->spec.dora) memcpy(a->M.var.value.data, src + na + nb, var_numel(&a->M.var) * sizeof(float));
}

static void lora_staged_free(void *staged) { free(((LoraStaged *)staged)->ab); }

/* model.adapters_from: the file must not hold adapters this run lacks
 * (another model or other rules), and the stored rank, alpha and rslora of
 * each adapter must be the run's rule's: loading B A under another scale
 * would change the model silently. A file without these attributes (not
 * written by qtrain) is taken by shape only. */
static QtStatus lora_check_adapters(const H5ioFile *f, const HookSet *set, QtError *err) {
    char names[CKPT_MODULES_MAX][MODULE_NAME_MAX];
    int n = 0;
    QtStatus st = QT_OK;
    if (h5io_kind(f, "lora") == H5IO_GROUP) st = ckpt_list_group(f, "lora", names, CKPT_MODULES_MAX, &n, err);
    for (int i = 0; st == QT_OK && i < n; i++) {
        bool known = false;
        for (int k = 0; !known && k < set->n; k++)
            known = strcmp(names[i], hook_layer_module(hook_layer(set, k))->path) == 0;
        if (!known)
            st = qt_error_set(err, QT_ERR_FORMAT, "%s does not match the run's adapters: it has a LoRA adapter for "
                              "module %s, which this run's lora rules do not adapt", f->path, names[i]);
    }
    for (int i = 0; st == QT_OK && i < set->n; i++) {
        const LoraAdapter *a = hook_layer(set, i);
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

const HookKind HOOK_LORA = {
    .name = "lora",
    .layer_size = sizeof(LoraAdapter),
    .rules = HOOK_RULES_LORA,
    .wraps = true,
    .in_adapters_file = true,
    .applies = lora_applies,
    .check = lora_check,
    .attach = lora_attach,
    .free = lora_free,
    .params = lora_params,
    .describe = lora_describe,
    .bytes = lora_bytes,
    .group = "lora",
    .save = lora_save,
    .check_file = lora_check_file,
    .staged_size = sizeof(LoraStaged),
    .load = lora_load,
    .commit = lora_commit,
    .staged_free = lora_staged_free,
    .check_adapters = lora_check_adapters,
};

LoraAdapter *net_adapter(const Net *n, int i) { return net_hook_layer(n, &HOOK_LORA, i); }
