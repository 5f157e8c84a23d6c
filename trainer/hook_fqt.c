/* hook_fqt.c - the qt hook kind: quantized training (quant/fqt.h) of each
 * module a quant.mode qt rule quantizes, the forward and backward GEMMs on
 * quantized operands. The float weight trains. Its checkpoint state is
 * /quant/<module>/grad/state: the layer's stochastic-rounding generator. */
#include <string.h>

#include "checkpoint_internal.h"
#include "trainer/hook.h"
#include "trainer/net.h"

_Static_assert(offsetof(FqtLayer, module) == 0, "a hook layer starts with its module (hook.h)");

/* ---- building ------------------------------------------------------------------------ */

static bool fqt_applies(const Net *n, int module) {
    return n->cfg->quant.mode == QUANT_MODE_QT && net_quant_spec(n, module);
}

static QtStatus fqt_check(const Net *n, int module, QtError *err) {
    return fqt_layer_check(&n->cfg->quant.rules[n->quant_rule[module]].qt, &n->model.modules[module], err);
}

/* QT layers over the (trainable) float weights, each with its own noise
 * stream for stochastic rounding of gradients. */
static QtStatus fqt_attach(Net *n, HookSet *set, bool fresh, QtError *err) {
    (void)fresh; /* the generators start from the seed; a checkpoint restores them */
    FqtLayer *ql = set->layers;
    int k = 0;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) {
        if (!fqt_applies(n, i)) continue;
        FqtLayer *q = &ql[k++];
        uint64_t stream = RNG_STREAM_ROUNDING + ((uint64_t)k << 40); /* apart from the shuffle's 2 + (epoch << 8) */
        st = fqt_layer_init(q, &n->model.modules[i], &n->cfg->quant.rules[n->quant_rule[i]].qt, n->cfg->run.seed,
                           stream, err);
        if (st == QT_OK) fqt_layer_install(q);
    }
    return st;
}

static void fqt_free(void *layer) { memset(layer, 0, sizeof(FqtLayer)); /* it owns nothing */ }

/* ---- reporting ------------------------------------------------------------------------ */

/* Its cell of the module table: without one the table took the module's rule for a float one. */
static void fqt_describe(const void *layer, char *buf, size_t cap) {
    const FqtSpec *s = &((const FqtLayer *)layer)->spec;
    const QType *a = s->act_qtype ? s->act_qtype : s->weight_qtype;
    snprintf(buf, cap, "qt %s per-channel, act %s, bwd %s%s", qtype_name(s->weight_qtype), qtype_name(a),
             s->bwd_qtype ? qtype_name(s->bwd_qtype) : "float", s->bwd_qtype && s->bwd_stochastic ? " sr" : "");
}

static void fqt_formats(const void *layer, char *w, size_t wcap, char *a, size_t acap) {
    const FqtSpec *s = &((const FqtLayer *)layer)->spec;
    snprintf(w, wcap, "%s/ch", qtype_name(s->weight_qtype));
    snprintf(a, acap, "%s", qtype_name(s->act_qtype ? s->act_qtype : s->weight_qtype));
}

/* Once converted: per output channel, float32 scales. */
static double fqt_base_bytes(const void *layer) {
    const FqtLayer *q = layer;
    return (double)q->out * ((double)q->fan_in * q->spec.weight_qtype->bits / 8.0 + sizeof(float));
}

/* ---- checkpoints ---------------------------------------------------------------------- */

static QtStatus fqt_save(H5ioFile *f, const void *layer, QtError *err) {
    const FqtLayer *q = layer;
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

static QtStatus fqt_load(const H5ioFile *f, const void *layer, void *staged, QtError *err) {
    const FqtLayer *q = layer;
    Rng *rng = staged;
    char t[CKPT_OBJ_MAX], state[CKPT_OBJ_MAX + 8];
    QtStatus st = ckpt_obj_path(t, "quant", q->module->path, "grad", err);
    snprintf(state, sizeof state, "%s/state", t);
    if (st == QT_OK && h5io_kind(f, state) != H5IO_GROUP)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: the gradient-rounding state of module %s (/%s) is missing; "
                          "the checkpoint was not written by a qt run with these rules", f->path, q->module->path,
                          state);
    if (st == QT_OK) st = h5io_attr_read_u64(f, state, "seed", &rng->seed, err);
    if (st == QT_OK) st = h5io_attr_read_u64(f, state, "stream", &rng->stream, err);
    if (st == QT_OK) st = h5io_attr_read_u64(f, state, "counter", &rng->counter, err);
    return st;
}

static void fqt_commit(void *layer, void *staged) { ((FqtLayer *)layer)->rng = *(Rng *)staged; }

const HookKind HOOK_FQT = {
    .name = "qt",
    .layer_size = sizeof(FqtLayer),
    .rules = HOOK_RULES_QUANT,
    .trains_weight = true,
    .applies = fqt_applies,
    .check = fqt_check,
    .attach = fqt_attach,
    .free = fqt_free,
    .describe = fqt_describe,
    .formats = fqt_formats,
    .base_bytes = fqt_base_bytes,
    .group = "quant",
    .save = fqt_save,
    .staged_size = sizeof(Rng),
    .load = fqt_load,
    .commit = fqt_commit,
};

FqtLayer *net_fqt_layer(const Net *n, int i) { return net_hook_layer(n, &HOOK_FQT, i); }
