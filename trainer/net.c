/* net.c - model + hook layers (quantized base, adapters, trained
 * quantizers: trainer/hook.h), attached by the config's rules. */
#include "net.h"
#include "interop.h"
#include "lora/lora_dora.h"

#include <stdlib.h>
#include <string.h>

static bool module_has_matrix_weight(const Module *m) {
    return m->weight && (m->spec.type == LAYER_DENSE || m->spec.type == LAYER_CONV2D);
}

void net_free(Net *n) {
    /* the counts come before the layers (net_check_specs), so layers may be NULL */
    for (int k = 0; k < n->hooks.n_sets; k++) {
        HookSet *set = &n->hooks.sets[k];
        for (int i = 0; set->layers && i < set->n; i++) set->kind->free(hook_layer(set, i));
        free(set->layers);
    }
    free(n->trainable);
    free(n->quant_rule);
    free(n->lora_rule);
    free(n->is_trainable);
    free(n->bn_trained);
    free(n->bn_note);
    for (int i = 0; n->lora_init && i < n->model.n_modules; i++) free(n->lora_init[i].ab);
    free(n->lora_init);
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

const QLayerSpec *net_quant_spec(const Net *n, int module) {
    int r = n->quant_rule[module];
    if (r < 0 || n->cfg->quant.rules[r].skip || !n->cfg->quant.rules[r].spec.weight_qtype) return NULL;
    return &n->cfg->quant.rules[r].spec;
}

const LoraSpec *net_lora_spec(const Net *n, int module) {
    int r = n->lora_rule[module];
    if (r < 0 || n->cfg->lora.rules[r].skip) return NULL;
    return &n->cfg->lora.rules[r].spec;
}

/* Where in the config the rule that gave module `module` its layer of `kind` is. */
static const char *net_rule_where(const Net *n, const HookKind *kind, int module) {
    int r = kind->rules == HOOK_RULES_LORA ? n->lora_rule[module] : n->quant_rule[module];
    if (r < 0) return n->cfg->source; /* a kind that applies without a rule */
    return kind->rules == HOOK_RULES_LORA ? n->cfg->lora.rules[r].match.where : n->cfg->quant.rules[r].match.where;
}

/* Every resolved setting against its module, before any value is read;
 * counts each kind's layers. Per module, the kinds that replace the op
 * come first (hook.h), and only one of them may: the second would install
 * over the first unseen. */
QtStatus net_check_specs(Net *n, QtError *err) {
    QtStatus st = QT_OK;
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) {
        const HookKind *replaces = NULL;
        for (int wraps = 0; wraps < 2; wraps++)
            for (int k = 0; k < n->hooks.n_sets; k++) {
                HookSet *set = &n->hooks.sets[k];
                if (set->kind->wraps != (wraps == 1) || !set->kind->applies(n, i)) continue;
                QtError e = {0};
                if (st == QT_OK && !set->kind->wraps && replaces)
                    st = qt_error_set(err, QT_ERR_CONFIG, "%s: module %s would be both a %s and a %s layer, and "
                                      "each replaces its op; let one rule apply to it", n->cfg->source,
                                      n->model.modules[i].path, replaces->name, set->kind->name);
                if (!set->kind->wraps) replaces = set->kind;
                if (st == QT_OK && set->kind->check(n, i, &e) != QT_OK)
                    st = qt_error_set(err, QT_ERR_CONFIG, "%s: %s", net_rule_where(n, set->kind, i), e.msg);
                set->n++;
            }
    }
    return st;
}

/* Makes every kind's layers with their layouts (values as `fresh` says)
 * and installs them: the kinds that replace a module's op, then those that
 * wrap it. */
static QtStatus net_attach(Net *n, bool fresh, QtError *err) {
    QtStatus st = QT_OK;
    for (int wraps = 0; wraps < 2; wraps++)
        for (int k = 0; st == QT_OK && k < n->hooks.n_sets; k++) {
            HookSet *set = &n->hooks.sets[k];
            if (set->kind->wraps != (wraps == 1) || set->n == 0) continue;
            set->layers = calloc((size_t)set->n, set->kind->layer_size);
            if (!set->layers) return qt_error_set(err, QT_ERR_NOMEM, "out of memory building the model");
            st = set->kind->attach(n, set, fresh, err);
        }
    return st;
}

/* A frozen base: a PTQ base or adapters (lora.rules, lora.trainable). */
static bool net_base_frozen(const Net *n) { return n->cfg->quant.mode == QUANT_MODE_PTQ || config_has_lora(n->cfg); }

bool net_bn_trains(const Net *n, int module) {
    if (!n->model.modules[module].running_mean) return false;
    if (!net_base_frozen(n) || n->is_trainable[module]) return true;
    return config_has_lora(n->cfg) && n->cfg->lora.batchnorm == LORA_BN_TRAIN;
}

/* With quant or lora in use, only adapters, lora.trainable modules and
 * (lora.batchnorm: train) batch norms train; then every hook layer's
 * parameters, in hook_kinds order. A batch norm that does not train is
 * frozen whole: its running statistics normalise in training too and are
 * never updated (BatchNormState.frozen). */
static QtStatus net_collect_trainable(Net *n, QtError *err) {
    bool adapted = net_base_frozen(n);
    size_t cap = (size_t)n->model.n_params + 1;
    for (int k = 0; k < n->hooks.n_sets; k++) cap += HOOK_PARAMS_MAX * (size_t)n->hooks.sets[k].n;
    n->trainable = calloc(cap, sizeof *n->trainable);
    if (!n->trainable) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n->model.n_modules; i++) {
        Module *m = &n->model.modules[i];
        bool trains = m->running_mean ? net_bn_trains(n, i) : !adapted || n->is_trainable[i];
        if (m->running_mean) m->bn.frozen = !trains, n->bn_trained[i] = trains;
        Param *ps[2] = {m->weight, m->bias};
        for (int k = 0; k < 2; k++) {
            if (!ps[k]) continue;
            if (!trains) param_freeze(ps[k]);
            if (ps[k]->trainable) n->trainable[n->n_trainable++] = ps[k];
        }
    }
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; set->kind->params && i < set->n; i++) {
            Param *ps[HOOK_PARAMS_MAX + 1] = {0}; /* one spare: a kind that gives too many is refused, not obeyed */
            int np = set->kind->params(hook_layer(set, i), ps);
            if (np < 0 || np > HOOK_PARAMS_MAX)
                return qt_error_set(err, QT_ERR_ARG, "hook kind %s gives %d parameters for module %s; at most "
                                    "HOOK_PARAMS_MAX (%d) fit (trainer/hook.h)", set->kind->name, np,
                                    hook_layer_module(hook_layer(set, i))->path, HOOK_PARAMS_MAX);
            for (int p = 0; p < np; p++) n->trainable[n->n_trainable++] = ps[p];
        }
    }
    return QT_OK;
}

/* Whether a kind with layers here reads model.init_from itself (a PTQ base). */
static bool net_hooks_load_init_from(const Net *n) {
    for (int k = 0; k < n->hooks.n_sets; k++)
        if (n->hooks.sets[k].kind->loads_init_from && n->hooks.sets[k].n > 0) return true;
    return false;
}

/* pissa / loftq build new adapters and a new base from model.init_from: with model.adapters_from (trained adapters,
 * which belong to the base they were trained on) that is refused rather than silently skipped. */
static QtStatus net_check_svd_inits(Net *n, QtError *err) {
    bool any = false;
    for (int i = 0; i < n->model.n_modules; i++) {
        const LoraSpec *ls = net_lora_spec(n, i);
        if (!ls || !lora_init_is_svd(ls->init)) continue;
        any = true;
        if (n->cfg->model.adapters_from[0])
            return qt_error_set(err, QT_ERR_CONFIG, "%s: lora init %s builds new adapters and changes the base of "
                                "module %s, but model.adapters_from loads trained ones; to continue them, set init "
                                "default and model.init_from to the checkpoint of the run that trained them (it holds "
                                "their base), or drop model.adapters_from", n->cfg->lora.rules[n->lora_rule[i]].match.where,
                                lora_init_name(ls->init), n->model.modules[i].path);
    }
    if (any && !(n->lora_init = calloc((size_t)n->model.n_modules, sizeof *n->lora_init)))
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    return QT_OK;
}

QtStatus net_build(Net *n, const Config *c, NetInit how, QtError *err) {
    memset(n, 0, sizeof *n);
    n->cfg = c;
    n->base_from_seed = how == NET_FRESH_TIMING;
    if (n->base_from_seed) how = NET_FRESH;
    n->hooks.n_sets = hook_n_kinds;
    for (int k = 0; k < hook_n_kinds; k++) n->hooks.sets[k].kind = hook_kinds[k];
    QtStatus st = model_init(&n->model, c->model.input_ndim, c->model.input_shape, c->model.layers, c->model.n_layers,
                             err);
    if (st != QT_OK) return st;
    int nm = n->model.n_modules;
    n->quant_rule = calloc((size_t)nm, sizeof *n->quant_rule);
    n->lora_rule = calloc((size_t)nm, sizeof *n->lora_rule);
    n->is_trainable = calloc((size_t)nm, sizeof *n->is_trainable);
    n->bn_note = calloc((size_t)nm, sizeof *n->bn_note);
    n->bn_trained = calloc((size_t)nm, sizeof *n->bn_trained);
    if (!n->quant_rule || !n->lora_rule || !n->is_trainable || !n->bn_note || !n->bn_trained)
        st = qt_error_set(err, QT_ERR_NOMEM, "out of memory building the model");
    if (st == QT_OK && c->quant.mode == QUANT_MODE_QT && config_has_lora(c))
        st = qt_error_set(err, QT_ERR_CONFIG, "%s: LoRA adapters over a quant.mode qt model are not supported yet; "
                          "use quant.mode qat or ptq under lora rules, or train the QT model in full", c->source);
    if (st == QT_OK) st = net_resolve_rules(n, err);
    if (st == QT_OK) st = net_check_specs(n, err);
    if (st == QT_OK && how == NET_FRESH) st = net_check_svd_inits(n, err);
    if (st == QT_OK) {
        Rng init;
        rng_init(&init, c->run.seed, RNG_STREAM_INIT);
        model_init_params(&n->model, &init);
        if (how == NET_FRESH && c->model.init_from[0] && !net_hooks_load_init_from(n)) {
            QtError e = {0};
            const QtStatus ls = interop_is_safetensors(c->model.init_from)
                                    ? interop_load_safetensors(c->model.init_from, &n->model, &e)
                                    : checkpoint_load_params(c->model.init_from, &n->model, &e);
            if (ls != QT_OK) st = qt_error_set(err, e.status, "%s: model.init_from: %s", c->source, e.msg);
        }
    }
    if (st == QT_OK) st = net_attach(n, how == NET_FRESH, err);
    if (st == QT_OK) st = net_collect_trainable(n, err);
    if (st == QT_OK && how == NET_FRESH && c->model.adapters_from[0]) {
        CheckpointNet parts = net_checkpoint_parts(n);
        QtError e = {0};
        if (interop_is_peft_dir(c->model.adapters_from)) { /* a PEFT adapter directory: no base identity in it */
            if (interop_load_peft(c->model.adapters_from, n, &e) != QT_OK)
                st = qt_error_set(err, e.status, "%s: model.adapters_from: %s", c->source, e.msg);
        } else if (net_check_adapters_base(n, c->model.adapters_from, stderr, &e) != QT_OK ||
                   checkpoint_load_adapters(c->model.adapters_from, &n->model, &parts, n->bn_trained, &e) != QT_OK) {
            st = qt_error_set(err, e.status, "%s: model.adapters_from: %s", c->source, e.msg);
        }
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
    const char *bn_mode = LORA_BATCHNORM_NAMES[n->cfg->lora.batchnorm];
    if (st == QT_OK && p->lora_batchnorm[0] && strcmp(p->lora_batchnorm, bn_mode) != 0 &&
        model_has_batchnorm(&n->model))
        st = qt_error_set(err, QT_ERR_CONFIG, "%s was written with lora.batchnorm: %s but this run has "
                          "lora.batchnorm: %s; its batch norms %s, so continuing it needs the same: set "
                          "lora.batchnorm: %s", path, p->lora_batchnorm, bn_mode,
                          strcmp(p->lora_batchnorm, "train") == 0
                              ? "were trained with the adapters (it holds their weights and statistics)"
                              : "are the base's (it holds none of their weights or statistics)",
                          p->lora_batchnorm);
    /* a file of an older qtrain names scheme v1: compare by its definition */
    bool v1 = strcmp(p->base_hash, CHECKPOINT_BASE_HASH_V1) == 0;
    if (st == QT_OK) st = (v1 ? checkpoint_base_sha256_v1 : checkpoint_base_sha256)(&n->model, &parts, mine, err);
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

CheckpointNet net_checkpoint_parts(const Net *n) { return n->hooks; }

QtStatus net_set_range_lrs(const Net *n, Optimizer *o, float base_lr, QtError *err) {
    QtStatus st = QT_OK;
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; st == QT_OK && set->kind->lr && set->kind->params && i < set->n; i++) {
            void *layer = hook_layer(set, i);
            float lr = set->kind->lr(layer);
            if (!(lr > 0.0f)) continue;
            Param *ps[HOOK_PARAMS_MAX];
            int np = set->kind->params(layer, ps);
            for (int j = 0; st == QT_OK && j < np; j++)
                st = optim_set_lr_scale(o, ps[j], base_lr > 0 ? lr / base_lr : 1.0f, err);
        }
    }
    return st;
}

QtStatus net_check_ranges(const Net *n, int64_t step, QtError *err) {
    QtStatus st = QT_OK;
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; st == QT_OK && set->kind->check_step && i < set->n; i++)
            st = set->kind->check_step(n, hook_layer(set, i), step, err);
    }
    return st;
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

/* Whether a hook layer on m has parameters that train (an adapter's A and B, a learned range). */
static bool net_module_hook_trains(const Net *n, const Module *m) {
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        void *layer = set->kind->params ? hook_find(set, m) : NULL;
        Param *ps[HOOK_PARAMS_MAX + 1];
        if (layer && set->kind->params(layer, ps) > 0) return true;
    }
    return false;
}

QtStatus net_step_macs(const Net *n, StepMacs *macs, QtError *err) {
    const Model *md = &n->model;
    *macs = (StepMacs){0};
    bool *grad = calloc((size_t)md->n_modules + 1, sizeof *grad); /* [n_modules] module i's output has a gradient */
    if (!grad) return qt_error_set(err, QT_ERR_NOMEM, "out of memory counting the step's multiply-adds");
    const HookSet *lora = hook_layers_find(&n->hooks, &HOOK_LORA);
    for (int i = 0; i < md->n_modules; i++) {
        const Module *m = &md->modules[i];
        bool input_grad = false;
        for (int k = 0; k < m->n_inputs; k++) input_grad |= m->inputs[k] >= 0 && grad[m->inputs[k]];
        bool weight_grad = m->weight && m->weight->trainable;
        grad[i] = input_grad || weight_grad || (m->bias && m->bias->trainable) || net_module_hook_trains(n, m);
        double mm = model_module_macs(m);
        macs->forward += mm;
        if (input_grad) macs->backward_dx += mm;
        if (weight_grad) macs->backward_dw += mm;
        const LoraAdapter *a = hook_find(lora, m);
        if (a) lora_adapter_macs(a, input_grad, weight_grad, macs);
        if (a && a->spec.dora) lora_dora_batch_macs(a, n->cfg->train.batch_size, macs);
    }
    free(grad);
    return QT_OK;
}

size_t net_model_bytes(const Net *n) {
    size_t b = model_param_bytes(&n->model);
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; set->kind->bytes && i < set->n; i++) b += set->kind->bytes(hook_layer(set, i));
    }
    return b;
}

/* Whether param p is a module weight a quantized model holds quantized (a layer of a kind with base_bytes). */
static bool net_weight_quantized(const Net *n, const Param *p) {
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; set->kind->base_bytes && i < set->n; i++)
            if (hook_layer_module(hook_layer(set, i))->weight == p) return true;
    }
    return false;
}

/* A frozen base: its frozen parameters, float or quantized as held. A
 * model whose quantized weights train (qat, qt): every parameter, the
 * quantized weights in the layout `qtrain convert` gives them. */
double net_base_bits_per_param(const Net *n) {
    bool all = false;
    for (int k = 0; k < n->hooks.n_sets; k++) all |= n->hooks.sets[k].kind->trains_weight && n->hooks.sets[k].n > 0;
    double bytes = 0.0, count = 0.0;
    for (int i = 0; i < n->model.n_params; i++) {
        const Param *p = &n->model.params[i];
        if (p->trainable && !all) continue;
        count += (double)var_numel(&p->var);
        if (!p->released && !net_weight_quantized(n, p)) bytes += (double)var_numel(&p->var) * sizeof(float);
    }
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; set->kind->base_bytes && i < set->n; i++) bytes += set->kind->base_bytes(hook_layer(set, i));
    }
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
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; set->kind->formats && i < set->n; i++) {
            char w[96], a[96];
            set->kind->formats(hook_layer(set, i), w, sizeof w, a, sizeof a);
            list_add_unique(weights, wcap, w);
            if (a[0]) list_add_unique(acts, acap, a);
        }
    }
    if (!weights[0]) snprintf(weights, wcap, "float32");
    if (!acts[0]) snprintf(acts, acap, "none");
}

void net_calib_begin(Net *n) {
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; set->kind->calib_begin && i < set->n; i++) set->kind->calib_begin(hook_layer(set, i));
    }
}

QtStatus net_calib_end(Net *n, QtError *err) {
    QtStatus st = QT_OK;
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; st == QT_OK && set->kind->calib_end && i < set->n; i++)
            st = set->kind->calib_end(hook_layer(set, i), err);
    }
    return st;
}

bool net_needs_act_calibration(const Net *n) {
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; set->kind->needs_calib && i < set->n; i++)
            if (set->kind->needs_calib(hook_layer(set, i))) return true;
    }
    return false;
}

/* The table cell of the layer of a kind attached by `rules` on module i: "[rule] description"; false if none. */
static bool net_describe(const Net *n, HookRules rules, int i, char *buf, size_t cap) {
    const Module *m = &n->model.modules[i];
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        const void *layer = set->kind->rules == rules && set->kind->describe ? hook_find(set, m) : NULL;
        if (!layer) continue;
        char d[128];
        set->kind->describe(layer, d, sizeof d);
        snprintf(buf, cap, "[%d] %s", rules == HOOK_RULES_LORA ? n->lora_rule[i] : n->quant_rule[i], d);
        return true;
    }
    return false;
}

/* A batch norm's quant cell in a ptq or qat model: what net_fold_batchnorms or qat's attach noted, or (a model read
 * from a checkpoint) its state as read. */
static void net_bn_cell(const Net *n, int i, char *buf, size_t cap) {
    const Module *m = &n->model.modules[i];
    const char *note = n->bn_note[i];
    size_t skip = strlen(m->path) + 2; /* the note starts "<path>: " */
    if (note[0] && strstr(note, "QAT weight") && !m->forward_hook) /* unfolded by a checkpoint (qat_layer_unfold_bn) */
        snprintf(buf, cap, "float (not folded: the checkpoint's QAT layer has no folded_bn)");
    else if (note[0] && strlen(note) >= skip) snprintf(buf, cap, "%s", note + skip);
    else if (m->bn_folded != BN_FOLD_NONE) snprintf(buf, cap, "folded into %s", n->model.modules[m->inputs[0]].path);
    else snprintf(buf, cap, "float (not folded)");
    size_t len = strlen(buf);
    if (m->bn_folded == BN_FOLD_NONE && m->bn.frozen && len < cap)
        snprintf(buf + len, cap - len, " (frozen)");
}

void net_print_table(const Net *n, FILE *out) {
    bool any_quant = n->cfg->quant.mode != QUANT_MODE_NONE, any_lora = config_has_lora(n->cfg);
    if (!any_quant && !any_lora) return;
    fprintf(out, "rules:\n  %-12s %-8s %-52s %s\n", "module", "type", "quant", "lora");
    for (int i = 0; i < n->model.n_modules; i++) {
        const Module *m = &n->model.modules[i];
        if (!m->weight && !m->running_mean) continue;
        /* a module no rule hooks: frozen under a frozen base (PTQ, LoRA), trained in QAT and QT runs; a batch
           norm (float in every mode) as lora.batchnorm says under adapters */
        bool trains = (m->weight && m->weight->trainable) || (m->bias && m->bias->trainable);
        char qd[160], ld[96] = "-";
        snprintf(qd, sizeof qd, "float (%s)", trains ? "trained" : "frozen");
        if (m->running_mean && any_lora && !n->is_trainable[i])
            snprintf(qd, sizeof qd, "float (%s), lora.batchnorm: %s", m->bn.frozen ? "frozen" : "trained",
                     LORA_BATCHNORM_NAMES[n->cfg->lora.batchnorm]);
        else if (m->running_mean)
            snprintf(qd, sizeof qd, "float (%s)", m->bn.frozen ? "frozen" : "trained");
        if (m->running_mean && (n->cfg->quant.mode == QUANT_MODE_PTQ || n->cfg->quant.mode == QUANT_MODE_QAT))
            net_bn_cell(n, i, qd, sizeof qd);
        else if (n->is_trainable[i])
            snprintf(qd, sizeof qd, "float, trained in full (lora.trainable)");
        else if (!net_describe(n, HOOK_RULES_QUANT, i, qd, sizeof qd) && n->quant_rule[i] >= 0)
            snprintf(qd, sizeof qd, "[%d] float (%s)", n->quant_rule[i],
                     n->cfg->quant.rules[n->quant_rule[i]].skip ? "skip" : "weight_qtype none");
        if (!net_describe(n, HOOK_RULES_LORA, i, ld, sizeof ld) && n->lora_rule[i] >= 0)
            snprintf(ld, sizeof ld, "[%d] skip", n->lora_rule[i]);
        fprintf(out, "  %-12s %-8s %-52s %s\n", m->path, layer_type_name(m->spec.type), qd, ld);
    }
    for (int k = 0; k < n->hooks.n_sets; k++)
        if (n->hooks.sets[k].kind->table_note) n->hooks.sets[k].kind->table_note(&n->hooks.sets[k], out);
}

void net_set_step(Net *n, int64_t step) {
    for (int k = 0; k < n->hooks.n_sets; k++) {
        const HookSet *set = &n->hooks.sets[k];
        for (int i = 0; set->kind->set_step && i < set->n; i++) set->kind->set_step(hook_layer(set, i), step);
    }
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
