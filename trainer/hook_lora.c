/* hook_lora.c - the lora hook kind: a LoRA adapter (lora/lora.h) over the
 * forward of each module a lora rule adapts, whatever that forward is (the
 * module's own op or a quantized base), so it installs after the kinds
 * that replace the op. Its checkpoint state is /lora/<module> (A, B and
 * the rule's settings as attributes); an adapters.h5 holds it too. */
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
    QtStatus st = lora_spec_check(net_lora_spec(n, module), &n->model.modules[module], err);
    const Module *m = &n->model.modules[module];
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

/* Every adapter draws its A from one generator of the run's seed, in module order. */
static QtStatus lora_attach(Net *n, HookSet *set, bool fresh, QtError *err) {
    (void)fresh; /* a checkpoint overwrites the values of a shell */
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
    return st;
}

static void lora_commit(void *layer, void *staged) {
    LoraAdapter *a = layer;
    const float *src = ((LoraStaged *)staged)->ab;
    size_t na = var_numel(&a->A.var), nb = var_numel(&a->B.var);
    memcpy(a->A.var.value.data, src, na * sizeof(float));
    memcpy(a->B.var.value.data, src + na, nb * sizeof(float));
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
