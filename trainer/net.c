/* net.c - model + quantized base + adapters, attached by the config's rules. */
#include "net.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "quant/qarray_io.h"

static bool module_has_matrix_weight(const Module *m) {
    return m->weight && (m->spec.type == LAYER_DENSE || m->spec.type == LAYER_CONV2D);
}

void net_free(Net *n) {
    /* the counts come before the arrays (net_check_specs), so either may be NULL */
    for (int i = 0; n->adapters && i < n->n_adapters; i++) lora_adapter_free(&n->adapters[i]);
    for (int i = 0; n->qlayers && i < n->n_qlayers; i++) qlayer_free(&n->qlayers[i]);
    for (int i = 0; n->qat && i < n->n_qat; i++) qat_layer_free(&n->qat[i]);
    free(n->qat);
    free(n->qt);
    free(n->adapters);
    free(n->qlayers);
    free(n->trainable);
    free(n->quant_rule);
    free(n->lora_rule);
    free(n->is_trainable);
    model_free(&n->model);
    memset(n, 0, sizeof *n);
}

/* quant_rule / lora_rule per module: the first rule that applies (skip
 * rules included, so they shadow later ones), trainable modules excluded. */
static QtStatus net_resolve_rules(Net *n, QtError *err) {
    const Config *c = n->cfg;
    RuleSet qs, ls;
    int nq = c->quant.mode == QUANT_MODE_NONE ? 0 : c->quant.n_rules;
    QtStatus st = rule_set_compile(&qs, c->quant.rules, nq, sizeof c->quant.rules[0], err);
    if (st != QT_OK) return st;
    if ((st = rule_set_compile(&ls, c->lora.rules, c->lora.n_rules, sizeof c->lora.rules[0], err)) != QT_OK) {
        rule_set_free(&qs);
        return st;
    }
    for (int i = 0; i < n->model.n_modules; i++) {
        const Module *m = &n->model.modules[i];
        n->quant_rule[i] = n->lora_rule[i] = -1;
        for (int k = 0; k < c->lora.n_trainable; k++)
            if (strcmp(c->lora.trainable[k], m->path) == 0) n->is_trainable[i] = true;
        if (!module_has_matrix_weight(m) || n->is_trainable[i]) continue;
        n->quant_rule[i] = rule_set_match(&qs, m);
        n->lora_rule[i] = rule_set_match(&ls, m);
    }
    memcpy(n->quant_hits, qs.hits, sizeof n->quant_hits);
    memcpy(n->lora_hits, ls.hits, sizeof n->lora_hits);
    rule_set_free(&qs);
    rule_set_free(&ls);
    return QT_OK;
}

static const QLayerSpec *net_quant_spec(const Net *n, int module) {
    int r = n->quant_rule[module];
    if (r < 0 || n->cfg->quant.rules[r].skip || !n->cfg->quant.rules[r].spec.weight_qtype) return NULL;
    return &n->cfg->quant.rules[r].spec;
}

static const LoraSpec *net_lora_spec(const Net *n, int module) {
    int r = n->lora_rule[module];
    if (r < 0 || n->cfg->lora.rules[r].skip) return NULL;
    return &n->cfg->lora.rules[r].spec;
}

/* Every resolved setting against its module, before any value is read. */
static QtStatus net_check_specs(Net *n, QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) {
        const Module *m = &n->model.modules[i];
        const QLayerSpec *qs = net_quant_spec(n, i);
        const LoraSpec *ls = net_lora_spec(n, i);
        QtError e = {0};
        QuantMode mode = n->cfg->quant.mode;
        const QuantRule *rule = qs ? &n->cfg->quant.rules[n->quant_rule[i]] : NULL;
        QtStatus chk = !qs                     ? QT_OK
                       : mode == QUANT_MODE_QAT ? qat_layer_check(qs, &rule->qat, m, &e)
                       : mode == QUANT_MODE_QT  ? fqt_layer_check(&rule->qt, m, &e)
                                                : qlayer_spec_check(qs, m, &e);
        if (chk != QT_OK)
            st = qt_error_set(err, QT_ERR_CONFIG, "%s: %s", n->cfg->quant.rules[n->quant_rule[i]].match.where, e.msg);
        else if (ls && lora_spec_check(ls, m, &e) != QT_OK)
            st = qt_error_set(err, QT_ERR_CONFIG, "%s: %s", n->cfg->lora.rules[n->lora_rule[i]].match.where, e.msg);
        if (qs && mode == QUANT_MODE_QAT) n->n_qat++;
        else if (qs && mode == QUANT_MODE_QT) n->n_qt++;
        else if (qs) n->n_qlayers++;
        if (ls) n->n_adapters++;
    }
    return st;
}

/* The modules a PTQ init_from holds quantized must be exactly those this
 * run quantizes... or a subset, the rest being quantized here from the
 * float weights the file holds. A module stored quantized that this run
 * keeps float cannot be undone. */
static QtStatus net_check_stored_quant(const Net *n, const char (*stored)[MODULE_NAME_MAX], int n_stored,
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

/* Quantizes every base layer whose float weight is still held (not
 * filled as stored from a PTQ file) and releases the float weight. */
static QtStatus net_quantize_held(Net *n, QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->n_qlayers; i++) {
        QLayer *q = &n->qlayers[i];
        if (q->module->weight->released) continue;
        QLayerSpec spec = q->spec;
        Rng rng = qlayer_round_rng(n->cfg->run.seed, (int)(q->module - n->model.modules));
        st = qlayer_init_quantize_rng(q, q->module, &spec, q->module->weight->var.value.data, &rng, err);
        if (st == QT_OK) param_release(q->module->weight);
    }
    return st;
}

/* NET_FRESH: float parameters from init_from; modules the file holds
 * quantized are read as stored, the others quantized here. */
static QtStatus net_load_base(Net *n, QtError *err) {
    const Config *c = n->cfg;
    const char *from = c->model.init_from;
    char (*stored)[MODULE_NAME_MAX] = calloc(CKPT_LIST_MAX, MODULE_NAME_MAX);
    if (!stored) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    int n_stored = 0;
    QtError e = {0};
    QtStatus st = checkpoint_list_quant(from, stored, CKPT_LIST_MAX, &n_stored, &e);
    if (st == QT_OK) st = net_check_stored_quant(n, (const char(*)[MODULE_NAME_MAX])stored, n_stored, err);
    /* Layouts for the stored ones; release every weight the file lacks in float. */
    QLayer *tmp = calloc((size_t)n->n_qlayers + 1, sizeof *tmp);
    int n_tmp = 0;
    if (st == QT_OK && !tmp) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    for (int i = 0; st == QT_OK && i < n->n_qlayers; i++) {
        QLayer *q = &n->qlayers[i];
        if (!name_listed((const char(*)[MODULE_NAME_MAX])stored, n_stored, q->module->path)) continue;
        QLayerSpec spec = q->spec; /* init starts by clearing q */
        st = qlayer_init_empty(q, q->module, &spec, err);
        if (st == QT_OK) {
            param_release(q->module->weight);
            tmp[n_tmp] = *q;
            tmp[n_tmp++].spec.act_qtype = NULL; /* static input ranges are calibrated afresh on this run's data */
        }
    }
    CheckpointNet parts = {.qlayers = tmp, .n_qlayers = n_tmp};
    if (st == QT_OK && e.status == QT_OK && checkpoint_load_model(from, &n->model, &parts, &e) != QT_OK)
        st = e.status;
    if (st == QT_OK && e.status != QT_OK) st = e.status;
    if (e.status != QT_OK) qt_error_set(err, e.status, "%s: model.init_from: %s", c->source, e.msg);
    /* Stored layers got new QArrays from the file: take them back. */
    for (int i = 0, k = 0; i < n->n_qlayers && k < n_tmp; i++)
        if (n->qlayers[i].module == tmp[k].module) {
            const QType *act = n->qlayers[i].spec.act_qtype;
            n->qlayers[i] = tmp[k++];
            n->qlayers[i].spec.act_qtype = act;
        }
    if (st == QT_OK) st = net_quantize_held(n, err);
    free(tmp);
    free(stored);
    return st;
}

/* QAT layers over the (trainable) float weights; a fresh run initialises
 * learned weight ranges from the weights it starts with. */
static QtStatus net_attach_qat(Net *n, NetInit how, QtError *err) {
    if (n->n_qat == 0) return QT_OK;
    n->qat = calloc((size_t)n->n_qat, sizeof *n->qat);
    if (!n->qat) return qt_error_set(err, QT_ERR_NOMEM, "out of memory building the model");
    int k = 0;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) {
        const QLayerSpec *qs = net_quant_spec(n, i);
        if (!qs) continue;
        QatLayer *q = &n->qat[k++];
        st = qat_layer_init(q, &n->model.modules[i], qs, &n->cfg->quant.rules[n->quant_rule[i]].qat, err);
        if (st == QT_OK) q->round_rng = qlayer_round_rng(n->cfg->run.seed, i);
        if (st == QT_OK && how == NET_FRESH) st = qat_layer_init_ranges(q, err);
        if (st == QT_OK) qat_layer_install(q);
    }
    return st;
}

/* QT layers over the (trainable) float weights, each with its own noise
 * stream for stochastic rounding of gradients. */
static QtStatus net_attach_qt(Net *n, QtError *err) {
    if (n->n_qt == 0) return QT_OK;
    n->qt = calloc((size_t)n->n_qt, sizeof *n->qt);
    if (!n->qt) return qt_error_set(err, QT_ERR_NOMEM, "out of memory building the model");
    int k = 0;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) {
        if (!net_quant_spec(n, i)) continue;
        FqtLayer *q = &n->qt[k++];
        uint64_t stream = RNG_STREAM_ROUNDING + ((uint64_t)k << 40); /* apart from the shuffle's 2 + (epoch << 8) */
        st = fqt_layer_init(q, &n->model.modules[i], &n->cfg->quant.rules[n->quant_rule[i]].qt, n->cfg->run.seed,
                           stream, err);
        if (st == QT_OK) fqt_layer_install(q);
    }
    return st;
}

/* Makes the qlayers and adapters with their layouts (values to come). */
static QtStatus net_attach(Net *n, NetInit how, QtError *err) {
    n->qlayers = calloc((size_t)n->n_qlayers + 1, sizeof *n->qlayers);
    n->adapters = calloc((size_t)n->n_adapters + 1, sizeof *n->adapters);
    if (!n->qlayers || !n->adapters) return qt_error_set(err, QT_ERR_NOMEM, "out of memory building the model");
    int nq = 0, na = 0;
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && n->cfg->quant.mode == QUANT_MODE_PTQ && i < n->model.n_modules; i++) {
        Module *m = &n->model.modules[i];
        const QLayerSpec *qs = net_quant_spec(n, i);
        if (qs) {
            QLayer *q = &n->qlayers[nq++];
            q->module = m; /* what net_load_base needs to find it; init_* fill the rest */
            q->spec = *qs;
            if (how == NET_SHELL && (st = qlayer_init_empty(q, m, qs, err)) == QT_OK) param_release(m->weight);
        }
    }
    if (st == QT_OK && how == NET_FRESH && n->n_qlayers > 0) {
        if (n->cfg->model.init_from[0]) st = net_load_base(n, err);
        else if (n->base_from_seed) st = net_quantize_held(n, err);
        else
            return qt_error_set(err, QT_ERR_CONFIG, "%s: quant.mode ptq quantizes a trained model, but model.init_from "
                                "is not set; point it at a float checkpoint (e.g. runs/pretrain/final.h5)",
                                n->cfg->source);
    }
    for (int i = 0; st == QT_OK && i < n->n_qlayers; i++) qlayer_install(&n->qlayers[i]);
    if (st == QT_OK) st = net_attach_qat(n, how, err);
    if (st == QT_OK) st = net_attach_qt(n, err);
    Rng rng;
    rng_init(&rng, n->cfg->run.seed, RNG_STREAM_LORA);
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) {
        const LoraSpec *ls = net_lora_spec(n, i);
        if (!ls) continue;
        LoraAdapter *a = &n->adapters[na];
        if ((st = lora_adapter_init(a, &n->model.modules[i], ls, err)) != QT_OK) break;
        na++;
        lora_adapter_init_params(a, &rng);
        lora_adapter_install(a);
    }
    n->n_adapters = na;
    return st;
}

/* With quant or lora in use, only adapters and lora.trainable modules train. */
static QtStatus net_collect_trainable(Net *n, QtError *err) {
    bool adapted = n->cfg->quant.mode == QUANT_MODE_PTQ || config_has_lora(n->cfg);
    n->trainable = calloc((size_t)n->model.n_params + 2 * (size_t)(n->n_adapters + n->n_qat) + 1,
                          sizeof *n->trainable);
    if (!n->trainable) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n->model.n_modules; i++) {
        Module *m = &n->model.modules[i];
        Param *ps[2] = {m->weight, m->bias};
        for (int k = 0; k < 2; k++) {
            if (!ps[k]) continue;
            if (adapted && !n->is_trainable[i]) param_freeze(ps[k]);
            if (ps[k]->trainable) n->trainable[n->n_trainable++] = ps[k];
        }
    }
    for (int i = 0; i < n->n_adapters; i++) {
        n->trainable[n->n_trainable++] = &n->adapters[i].A;
        n->trainable[n->n_trainable++] = &n->adapters[i].B;
    }
    for (int i = 0; i < n->n_qat; i++) n->n_trainable += qat_layer_params(&n->qat[i], n->trainable + n->n_trainable);
    return QT_OK;
}

QtStatus net_build(Net *n, const Config *c, NetInit how, QtError *err) {
    memset(n, 0, sizeof *n);
    n->cfg = c;
    n->base_from_seed = how == NET_FRESH_TIMING;
    if (n->base_from_seed) how = NET_FRESH;
    QtStatus st = model_init(&n->model, c->model.input_ndim, c->model.input_shape, c->model.layers, c->model.n_layers,
                             err);
    if (st != QT_OK) return st;
    int nm = n->model.n_modules;
    n->quant_rule = calloc((size_t)nm, sizeof *n->quant_rule);
    n->lora_rule = calloc((size_t)nm, sizeof *n->lora_rule);
    n->is_trainable = calloc((size_t)nm, sizeof *n->is_trainable);
    if (!n->quant_rule || !n->lora_rule || !n->is_trainable)
        st = qt_error_set(err, QT_ERR_NOMEM, "out of memory building the model");
    if (st == QT_OK && c->quant.mode == QUANT_MODE_QT && config_has_lora(c))
        st = qt_error_set(err, QT_ERR_CONFIG, "%s: LoRA adapters over a quant.mode qt model are not supported yet; "
                          "use quant.mode qat or ptq under lora rules, or train the QT model in full", c->source);
    if (st == QT_OK) st = net_resolve_rules(n, err);
    if (st == QT_OK) st = net_check_specs(n, err);
    if (st == QT_OK) {
        Rng init;
        rng_init(&init, c->run.seed, RNG_STREAM_INIT);
        model_init_params(&n->model, &init);
        if (how == NET_FRESH && c->model.init_from[0] && n->n_qlayers == 0) {
            QtError e = {0};
            if (checkpoint_load_params(c->model.init_from, &n->model, &e) != QT_OK)
                st = qt_error_set(err, e.status, "%s: model.init_from: %s", c->source, e.msg);
        }
    }
    if (st == QT_OK) st = net_attach(n, how, err);
    if (st == QT_OK) st = net_collect_trainable(n, err);
    if (st == QT_OK && how == NET_FRESH && c->model.adapters_from[0]) {
        CheckpointNet parts = net_checkpoint_parts(n);
        QtError e = {0};
        if (net_check_adapters_base(n, c->model.adapters_from, stderr, &e) != QT_OK ||
            checkpoint_load_adapters(c->model.adapters_from, &n->model, &parts, &e) != QT_OK)
            st = qt_error_set(err, e.status, "%s: model.adapters_from: %s", c->source, e.msg);
    }
    if (st != QT_OK) net_free(n);
    return st;
}

QtStatus net_check_adapters_base(const Net *n, const char *path, FILE *warn, QtError *err) {
    CheckpointProvenance *p = malloc(sizeof *p);
    if (!p) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    char mine[SHA256_HEX_CHARS];
    CheckpointNet parts = net_checkpoint_parts(n);
    QtStatus st = checkpoint_read_provenance(path, p, err);
    if (st == QT_OK) st = checkpoint_base_sha256(&n->model, &parts, mine, err);
    if (st == QT_OK && !p->base_sha256[0]) {
        fprintf(warn, "qtrain: warning: %s records no base identity (base_sha256; written by an older qtrain?): "
                "whether its adapters were trained on this run's base (sha256 %s) cannot be checked\n", path, mine);
    } else if (st == QT_OK && strcmp(p->base_sha256, mine) != 0) {
        const char *from = p->base_init_from[0] ? p->base_init_from : "no init_from";
        if (n->cfg->lora.strict_base)
            st = qt_error_set(err, QT_ERR_CONFIG, "%s was trained on another base (sha256 %s, from %s) than this "
                              "run's (sha256 %s, from %s), and lora.strict_base is true; point model.init_from at "
                              "the base it was trained on", path, p->base_sha256, from, mine,
                              n->cfg->model.init_from[0] ? n->cfg->model.init_from : "no init_from");
        else
            fprintf(warn, "qtrain: warning: %s was trained on another base (sha256 %s, from %s) than this run's "
                    "(sha256 %s, from %s); its adapters may not fit this base (lora.strict_base: true makes this an "
                    "error)\n", path, p->base_sha256, from, mine,
                    n->cfg->model.init_from[0] ? n->cfg->model.init_from : "no init_from");
    }
    free(p);
    return st;
}

CheckpointNet net_checkpoint_parts(const Net *n) {
    CheckpointNet p = {.qlayers = n->qlayers, .n_qlayers = n->n_qlayers, .adapters = n->adapters,
                       .n_adapters = n->n_adapters, .qat = n->qat, .n_qat = n->n_qat,
                       .qt = n->qt, .n_qt = n->n_qt};
    return p;
}

QtStatus net_set_range_lrs(const Net *n, Optimizer *o, float base_lr, QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->n_qat; i++) {
        if (!(n->qat[i].qat.lr > 0.0f)) continue;
        Param *ps[2];
        int k = qat_layer_params(&n->qat[i], ps);
        for (int j = 0; st == QT_OK && j < k; j++)
            st = optim_set_lr_scale(o, ps[j], base_lr > 0 ? n->qat[i].qat.lr / base_lr : 1.0f, err);
    }
    return st;
}

QtStatus net_check_ranges(const Net *n, int64_t step, QtError *err) {
    for (int i = 0; i < n->n_qat; i++) {
        Param *ps[2];
        int k = qat_layer_params(&n->qat[i], ps);
        for (int j = 0; j < k; j++) {
            size_t m = var_numel(&ps[j]->var);
            for (size_t e = 0; e < m; e++)
                if (!isfinite(ps[j]->var.value.data[e]))
                    return qt_error_set(err, QT_ERR_VALUE, "step %lld: module %s: the learned range %s[%zu] is %g; "
                                        "lower its lr (quant.rules[%d].lr) or train.optimizer.lr, or set "
                                        "train.grad_clip", (long long)step, n->qat[i].module->path, ps[j]->name, e,
                                        (double)ps[j]->var.value.data[e], n->quant_rule[n->qat[i].module -
                                                                                          n->model.modules]);
        }
    }
    return QT_OK;
}

const char *net_mode_name(const Net *n) {
    bool lora = config_has_lora(n->cfg);
    if (n->cfg->quant.mode == QUANT_MODE_QAT) return lora ? "qat-lora" : "qat";
    if (n->cfg->quant.mode == QUANT_MODE_QT) return "qt";
    if (n->cfg->quant.mode == QUANT_MODE_PTQ) return lora ? "qlora" : "ptq";
    return lora ? "lora" : "float";
}

size_t net_params_trainable(const Net *n) {
    size_t k = 0;
    for (int i = 0; i < n->n_trainable; i++) k += var_numel(&n->trainable[i]->var);
    return k;
}

size_t net_params_frozen(const Net *n) {
    size_t k = 0;
    for (int i = 0; i < n->model.n_params; i++)
        if (!n->model.params[i].trainable) k += var_numel(&n->model.params[i].var);
    return k;
}

size_t net_model_bytes(const Net *n) {
    size_t b = model_param_bytes(&n->model);
    for (int i = 0; i < n->n_qlayers; i++) b += qlayer_bytes(&n->qlayers[i]);
    for (int i = 0; i < n->n_adapters; i++) b += lora_adapter_param_count(&n->adapters[i]) * sizeof(float);
    return b;
}

/* A QAT model's bits per parameter once converted: its quantized weights in
 * the layout `qtrain convert` gives them, the other parameters float. */
static double net_qat_bits_per_param(const Net *n) {
    double bytes = 0.0, count = 0.0;
    for (int i = 0; i < n->model.n_params; i++) {
        const Param *p = &n->model.params[i];
        bool quantized = false;
        for (int k = 0; k < n->n_qat && !quantized; k++) quantized = n->qat[k].module->weight == p;
        for (int k = 0; k < n->n_qt && !quantized; k++) quantized = n->qt[k].module->weight == p;
        count += (double)var_numel(&p->var);
        if (!quantized) bytes += (double)var_numel(&p->var) * sizeof(float);
    }
    for (int k = 0; k < n->n_qt; k++) { /* per output channel, float32 scales */
        const FqtLayer *q = &n->qt[k];
        bytes += (double)q->out * ((double)q->fan_in * q->spec.weight_qtype->bits / 8.0 + sizeof(float));
    }
    for (int k = 0; k < n->n_qat; k++) {
        QArray tmp;
        const QatLayer *q = &n->qat[k];
        if (qarray_alloc(&tmp, q->w_ndim, q->w_shape, q->spec.weight_qtype, &q->w_options, NULL) == QT_OK)
            bytes += (double)qarray_bytes(&tmp);
        qarray_free(&tmp);
    }
    return count > 0 ? bytes * 8.0 / count : 32.0;
}

double net_base_bits_per_param(const Net *n) {
    double bytes = 0.0, count = 0.0;
    for (int i = 0; i < n->model.n_params; i++) {
        const Param *p = &n->model.params[i];
        if (p->trainable) continue;
        count += (double)var_numel(&p->var);
        if (!p->released) bytes += (double)var_numel(&p->var) * sizeof(float);
    }
    for (int i = 0; i < n->n_qlayers; i++) bytes += (double)qlayer_bytes(&n->qlayers[i]);
    if (n->n_qat > 0 || n->n_qt > 0) return net_qat_bits_per_param(n);
    return count > 0 ? bytes * 8.0 / count : 32.0;
}

/* Appends item to the comma-separated list buf unless it is there already. */
static void list_add_unique(char *buf, size_t cap, const char *item) {
    size_t len = strlen(item);
    for (const char *p = buf; (p = strstr(p, item)) != NULL; p += len)
        if ((p == buf || p[-1] == ',') && (p[len] == ',' || p[len] == '\0')) return;
    size_t used = strlen(buf);
    snprintf(buf + used, cap - used, "%s%s", used ? "," : "", item);
}

void net_format_summary(const Net *n, char *weights, size_t wcap, char *acts, size_t acap) {
    weights[0] = acts[0] = '\0';
    for (int i = 0; i < n->n_qlayers; i++) {
        const QLayerSpec *s = &n->qlayers[i].spec;
        char f[64], g[16];
        if (s->tile_size > 0) snprintf(g, sizeof g, "%d", s->tile_size);
        else snprintf(g, sizeof g, "%s", qtype_is_block(s->weight_qtype) ? "mx" : s->per_tensor ? "t" : "ch");
        snprintf(f, sizeof f, "%s/%s%s", qtype_name(s->weight_qtype), g, s->double_quant ? "+dq" : "");
        list_add_unique(weights, wcap, f);
        if (s->act_qtype) list_add_unique(acts, acap, qtype_name(s->act_qtype));
    }
    for (int i = 0; i < n->n_qat; i++) {
        const QLayerSpec *s = &n->qat[i].spec;
        char f[80];
        snprintf(f, sizeof f, "%s/%s%s", qtype_name(s->weight_qtype), s->tile_size > 0 ? "blk" : s->per_tensor ? "t" : "ch",
                 n->qat[i].qat.learn_amax ? (n->qat[i].qat.learn_amax == QAT_LEARN_TQT ? "+tqt" : "+lsq") : "");
        list_add_unique(weights, wcap, f);
        if (s->act_qtype) list_add_unique(acts, acap, qtype_name(s->act_qtype));
    }
    for (int i = 0; i < n->n_qt; i++) {
        const FqtSpec *s = &n->qt[i].spec;
        char f[64];
        snprintf(f, sizeof f, "%s/ch", qtype_name(s->weight_qtype));
        list_add_unique(weights, wcap, f);
        list_add_unique(acts, acap, qtype_name(s->act_qtype ? s->act_qtype : s->weight_qtype));
    }
    if (!weights[0]) snprintf(weights, wcap, "float32");
    if (!acts[0]) snprintf(acts, acap, "none");
}

void net_calib_begin(Net *n) {
    for (int i = 0; i < n->n_qlayers; i++) qlayer_calib_begin(&n->qlayers[i]);
    for (int i = 0; i < n->n_qat; i++) qat_layer_calib_begin(&n->qat[i]);
}

QtStatus net_calib_end(Net *n, QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->n_qlayers; i++) st = qlayer_calib_end(&n->qlayers[i], err);
    for (int i = 0; st == QT_OK && i < n->n_qat; i++) st = qat_layer_calib_end(&n->qat[i], err);
    return st;
}

bool net_needs_act_calibration(const Net *n) {
    for (int i = 0; i < n->n_qlayers; i++)
        if (n->qlayers[i].spec.act_qtype) return true;
    for (int i = 0; i < n->n_qat; i++)
        if (n->qat[i].spec.act_qtype && (n->qat[i].qat.learn_amax || n->qat[i].qat.act_static_scale)) return true;
    return false;
}

static const QLayer *net_find_qlayer(const Net *n, const Module *m) {
    for (int i = 0; i < n->n_qlayers; i++)
        if (n->qlayers[i].module == m) return &n->qlayers[i];
    return NULL;
}

static const QatLayer *net_find_qat(const Net *n, const Module *m) {
    for (int i = 0; i < n->n_qat; i++)
        if (n->qat[i].module == m) return &n->qat[i];
    return NULL;
}

static const LoraAdapter *net_find_adapter(const Net *n, const Module *m) {
    for (int i = 0; i < n->n_adapters; i++)
        if (n->adapters[i].module == m) return &n->adapters[i];
    return NULL;
}

const char *net_int8_kernel(const Net *n) {
    for (int i = 0; i < n->n_qlayers; i++)
        if (qlayer_int8_supported(&n->qlayers[i])) return qlayer_int8_kernel();
    return "none";
}

void net_print_table(const Net *n, FILE *out) {
    bool any_quant = n->cfg->quant.mode != QUANT_MODE_NONE, any_lora = config_has_lora(n->cfg);
    if (!any_quant && !any_lora) return;
    fprintf(out, "rules:\n  %-12s %-8s %-52s %s\n", "module", "type", "quant", "lora");
    for (int i = 0; i < n->model.n_modules; i++) {
        const Module *m = &n->model.modules[i];
        if (!m->weight) continue;
        char qd[160] = "float (frozen)", ld[96] = "-";
        const QLayer *q = net_find_qlayer(n, m);
        const QatLayer *qa = net_find_qat(n, m);
        const LoraAdapter *a = net_find_adapter(n, m);
        if (n->is_trainable[i]) {
            snprintf(qd, sizeof qd, "float, trained in full (lora.trainable)");
        } else if (qa) {
            const QLayerSpec *sp = &qa->spec;
            char g[24];
            if (sp->tile_size > 0) snprintf(g, sizeof g, "block %d", sp->tile_size);
            else snprintf(g, sizeof g, "%s", sp->per_tensor ? "per-tensor" : "per-channel");
            snprintf(qd, sizeof qd, "[%d] qat %s %s, learn %s, act %s%s", n->quant_rule[i], qtype_name(sp->weight_qtype),
                     g, qat_learn_name(qa->qat.learn_amax), sp->act_qtype ? qtype_name(sp->act_qtype) : "float",
                     sp->act_qtype && !qa->qat.learn_amax ? (qa->qat.act_static_scale ? " static" : " dynamic") : "");
        } else if (q) {
            char d[128];
            qlayer_describe(q, d, sizeof d);
            snprintf(qd, sizeof qd, "[%d] %s", n->quant_rule[i], d);
        } else if (n->quant_rule[i] >= 0) {
            snprintf(qd, sizeof qd, "[%d] float (%s)", n->quant_rule[i],
                     n->cfg->quant.rules[n->quant_rule[i]].skip ? "skip" : "weight_qtype none");
        } else if (!any_quant && !any_lora) {
            snprintf(qd, sizeof qd, "float");
        }
        if (a)
            snprintf(ld, sizeof ld, "[%d] rank %d alpha %g (scale %g)%s%s", n->lora_rule[i], a->spec.rank,
                     (double)a->spec.alpha, (double)a->scale, a->spec.rslora ? " rslora" : "",
                     a->spec.dropout > 0 ? " dropout" : "");
        else if (n->lora_rule[i] >= 0)
            snprintf(ld, sizeof ld, "[%d] skip", n->lora_rule[i]);
        fprintf(out, "  %-12s %-8s %-52s %s\n", m->path, layer_type_name(m->spec.type), qd, ld);
    }
    /* which path int8 x int8 layers evaluate on: a CPU without VNNI emulates them in float */
    if (n->n_qlayers > 0) fprintf(out, "  int8_kernel: %s\n", net_int8_kernel(n));
}

void net_set_step(Net *n, int64_t step) {
    for (int i = 0; i < n->n_qat; i++) qat_layer_set_step(&n->qat[i], step);
}

/* Whether rule `match` applies to module m on its own (earlier rules aside). */
static bool rule_applies(const RuleMatch *match, const Module *m) {
    if (match->op_types && !(match->op_types & (1u << m->spec.type))) return false;
    return rule_pattern_matches(match->module_path, m->path) == 1;
}

/* The warning for a rule that is the first match for no module: when it does
 * match modules, the earlier rules (or lora.trainable) that took them are
 * named; "check the regex" only when it matches none at all. */
static void net_warn_unused_rule(const Net *n, FILE *out, const RuleMatch *match, const int *taken_by,
                                 const char *section) {
    char mods[256] = "", takers[256] = "";
    bool seen[RULES_MAX] = {false}, by_trainable = false;
    size_t ml = 0, tl = 0;
    for (int i = 0; i < n->model.n_modules; i++) {
        const Module *m = &n->model.modules[i];
        if (!module_has_matrix_weight(m) || !rule_applies(match, m)) continue;
        if (ml < sizeof mods) ml += (size_t)snprintf(mods + ml, sizeof mods - ml, "%s%s", ml ? ", " : "", m->path);
        if (n->is_trainable[i]) by_trainable = true;
        else if (taken_by[i] >= 0) seen[taken_by[i]] = true;
    }
    if (!mods[0]) {
        fprintf(out, "qtrain: warning: %s (module_path \"%s\") applies to no module; check the regex (it must "
                "match a whole module path) and its op_types\n", match->where, match->module_path);
        return;
    }
    for (int r = 0; r < RULES_MAX; r++)
        if (seen[r] && tl < sizeof takers)
            tl += (size_t)snprintf(takers + tl, sizeof takers - tl, "%s%s[%d]", tl ? ", " : "", section, r);
    if (by_trainable && tl < sizeof takers)
        snprintf(takers + tl, sizeof takers - tl, "%slora.trainable", tl ? ", " : "");
    fprintf(out, "qtrain: warning: %s (module_path \"%s\") applies to no module: it matches %s, but %s took them "
            "first (%s)\n", match->where, match->module_path, mods, takers,
            tl ? "the first rule that applies wins; move this rule earlier or narrow the one that took them"
               : "lora.trainable modules train in full and take no rule; drop the rule or the module from "
                 "lora.trainable");
}

int net_print_unused_rules(const Net *n, FILE *out) {
    int count = 0;
    int nq = n->cfg->quant.mode == QUANT_MODE_NONE ? 0 : n->cfg->quant.n_rules;
    for (int r = 0; r < nq; r++) {
        const QuantRule *q = &n->cfg->quant.rules[r];
        const QType *w = q->spec.weight_qtype, *a = q->spec.act_qtype;
        bool w_clip = w && w->kind == QTYPE_KIND_UINT && q->spec.symmetric;
        bool a_clip = a && a->kind == QTYPE_KIND_UINT && q->spec.act_symmetric;
        if (q->skip || !(w_clip || a_clip)) continue;
        fprintf(out, "qtrain: warning: %s: %s with %s clips every negative %s to 0 (allow_clip: true)\n",
                q->match.where, w_clip ? "symmetric: true" : "act_symmetric: true", qtype_name(w_clip ? w : a),
                w_clip ? "weight" : "input");
        count++;
    }
    for (int r = 0; r < nq; r++)
        if (n->quant_hits[r] == 0) {
            net_warn_unused_rule(n, out, &n->cfg->quant.rules[r].match, n->quant_rule, "quant.rules");
            count++;
        }
    for (int r = 0; r < n->cfg->lora.n_rules; r++)
        if (n->lora_hits[r] == 0) {
            net_warn_unused_rule(n, out, &n->cfg->lora.rules[r].match, n->lora_rule, "lora.rules");
            count++;
        }
    return count;
}
