/* tools.c - quantize a float checkpoint; merge adapters into their base. */
#include "tools.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/fsutil.h"
#include "trainer/bn_fold.h"
#include "trainer/checkpoint.h"
#include "trainer/net.h"
#include "trainer/rundir.h"
#include "trainer/train.h"

/* Writes a tool's output checkpoint: only where nothing is, or (force) over
 * a regular file; in a run directory under its lock; stale temp files of
 * dead writers of `out` removed first. */
static QtStatus save_out(const char *out, bool force, const Model *m, CheckpointState *s, QtError *err) {
    RunDirLock lock;
    s->replace = force ? FS_REPLACE_REGULAR : FS_REPLACE_NONE;
    QtStatus st = fs_check_out_path(out, force, "--out", err);
    if (st == QT_OK) st = rundir_lock_if_run(out, &lock, err);
    if (st != QT_OK) return st;
    fs_remove_stale_tmps_of(out, 0);
    st = checkpoint_save(out, m, NULL, s, err);
    rundir_unlock(&lock, false);
    return st;
}

QtStatus tools_quantize(const Config *cfg, const char *checkpoint, const char *out, bool force, FILE *log,
                        QtError *err) {
    QtStatus out_st = fs_check_out_path(out, force, "--out", err); /* before the work, not only before the write */
    if (out_st != QT_OK) return out_st;
    if (cfg->quant.mode != QUANT_MODE_PTQ)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: qtrain quantize needs quant.mode: ptq and quant rules (the mode "
                            "is %s)", cfg->source, quant_mode_name(cfg->quant.mode));
    for (int i = 0; i < cfg->quant.n_rules; i++)
        if (cfg->quant.rules[i].spec.act_qtype && !cfg->quant.rules[i].skip)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: act_qtype is set, and static activation ranges need "
                                "calibration data; qtrain quantize handles weight-only rules: drop act_qtype, or "
                                "run qtrain --config with train.epochs: 0 for a calibrated PTQ checkpoint",
                                cfg->quant.rules[i].match.where);
    Config *c = malloc(sizeof *c);
    if (!c) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    *c = *cfg;
    snprintf(c->model.init_from, sizeof c->model.init_from, "%s", checkpoint);
    c->model.adapters_from[0] = '\0';
    c->lora.n_rules = 0; /* only the base; lora.trainable modules stay float */
    memset(c->lora.rules, 0, sizeof c->lora.rules);
    Net n;
    QtStatus st = net_build(&n, c, NET_FRESH, err);
    char *text = st == QT_OK ? config_to_yaml(c) : NULL;
    if (st == QT_OK && !text) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK) {
        CheckpointState s = {.last_train_loss = NAN, .config_text = text, .net = net_checkpoint_parts(&n)};
        st = save_out(out, force, &n.model, &s, err);
    }
    if (st == QT_OK && log) {
        net_print_table(&n, log);
        net_print_unused_rules(&n, log);
        fprintf(log, "quantized %d modules: base %.3f bits/param, model %.1f KiB (float: %.1f KiB) -> %s\n",
                net_hook_count(&n, &HOOK_PTQ), net_base_bits_per_param(&n), (double)net_model_bytes(&n) / 1024.0,
                (double)model_param_count(&n.model, false) * 4.0 / 1024.0, out);
    }
    if (st == QT_OK || n.cfg) net_free(&n);
    /* lora rules with pissa / loftq: what those inits would make of this base, reported (the file keeps the plain
       quantized base: a fitted base belongs with its adapters, which a training run makes) */
    bool svd = false;
    for (int i = 0; i < cfg->lora.n_rules; i++) svd |= !cfg->lora.rules[i].skip && lora_init_is_svd(cfg->lora.rules[i].spec.init);
    if (st == QT_OK && svd && log) {
        c->lora = cfg->lora;
        if ((st = net_build(&n, c, NET_FRESH, err)) == QT_OK) {
            net_print_lora_init(&n, log);
            net_free(&n);
        }
    }
    free(text);
    free(c);
    return st;
}

QtStatus tools_load_config(const char *path, Config *c, QtError *err) {
    char *text = NULL, name[CONFIG_PATH_MAX + 16];
    snprintf(name, sizeof name, "%s:/config", path);
    QtStatus st = checkpoint_read_config(path, &text, err);
    if (st == QT_OK) st = config_load_string(c, text, name, NULL, 0, err);
    free(text);
    return st;
}

/* The model a checkpoint holds, built from its stored config c: parameters,
 * quantized base, adapters and quantizer state. On error n is freed. */
static QtStatus load_checkpoint_net(const char *checkpoint, const Config *c, Net *n, QtError *err) {
    QtStatus st = net_build(n, c, NET_SHELL, err);
    if (st != QT_OK) return st;
    CheckpointNet parts = net_checkpoint_parts(n);
    if ((st = checkpoint_load_model(checkpoint, &n->model, &parts, err)) != QT_OK) net_free(n);
    return st;
}

/* The hook layers a merged model keeps: every kind's but the adapters' (HookKind.in_adapters_file), which are in
 * the weights now: a quantized base, a QAT model's learned ranges and input statistics. */
static CheckpointNet merged_parts(const Net *n) {
    CheckpointNet p = {0};
    for (int k = 0; k < n->hooks.n_sets; k++)
        if (!n->hooks.sets[k].kind->in_adapters_file) p.sets[p.n_sets++] = n->hooks.sets[k];
    return p;
}

static const QLayer *find_qlayer(const Net *n, const Module *m) {
    return hook_find(hook_layers_find(&n->hooks, &HOOK_PTQ), m);
}

/* Folds one adapter; for a quantized base adds the squared error of the
 * re-quantization and of the merged weight to *err2 / *norm2. */
static QtStatus merge_one(Net *n, const LoraAdapter *a, double *err2, double *norm2, FILE *log, QtError *err) {
    Module *m = a->module;
    QLayer *q = (QLayer *)find_qlayer(n, m);
    if (!q) {
        lora_adapter_merge(a, m->weight->var.value.data);
        if (log) fprintf(log, "  %-12s float base: W %s %g * B A%s\n", m->path, a->spec.dora ? "= m * dir(W +" : "+=",
                         (double)a->scale, a->spec.dora ? ") (DoRA)" : "");
        return QT_OK;
    }
    size_t numel = (size_t)q->out * (size_t)q->fan_in;
    float *w = malloc(numel * sizeof(float)), *back = malloc(numel * sizeof(float));
    QtStatus st = w && back ? QT_OK : qt_error_set(err, QT_ERR_NOMEM, "out of memory merging %s", m->path);
    if (st == QT_OK) {
        qlayer_dequantize_weight(q, w);
        lora_adapter_merge(a, w);
        QLayerSpec spec = q->spec;
        QLayer fresh;
        st = qlayer_init_quantize(&fresh, m, &spec, w, err);
        if (st == QT_OK) {
            bool ready = q->act_ready;
            CalibRunning stats = q->act_stats;
            float s = q->act_scale, zp = q->act_zero_point;
            qlayer_free(q);
            *q = fresh;
            /* the options point at the layer's own spec: re-aim them after the move */
            if (q->options.calib) q->options.calib = &q->spec.weight_calib;
            q->act_stats = stats, q->act_scale = s, q->act_zero_point = zp, q->act_ready = ready;
            qlayer_install(q);
        }
    }
    if (st == QT_OK) {
        qlayer_dequantize_weight(q, back);
        double e = 0.0, nn = 0.0;
        for (size_t i = 0; i < numel; i++) {
            double d = (double)back[i] - (double)w[i];
            e += d * d, nn += (double)w[i] * w[i];
        }
        *err2 += e, *norm2 += nn;
        if (log) fprintf(log, "  %-12s %s base: dequantize, %s, re-quantize: relative RMSE %.3g\n", m->path,
                         qtype_name(q->spec.weight_qtype), a->spec.dora ? "fold the DoRA adapter" : "add",
                         nn > 0 ? sqrt(e / nn) : 0.0);
    }
    free(w);
    free(back);
    return st;
}

/* The merged model's float parameters must be finite before anything is
 * written: a huge adapter (or a damaged one) overflows W + s B A, and a
 * merged checkpoint holding inf would not load again. */
static QtStatus merge_check_finite(const Net *n, const char *checkpoint, QtError *err) {
    for (int i = 0; i < n->model.n_params; i++) {
        const Param *p = &n->model.params[i];
        size_t numel = var_numel(&p->var), bad = p->released ? numel : floats_first_nonfinite(p->var.value.data, numel);
        if (bad < numel)
            return qt_error_set(err, QT_ERR_VALUE, "merging the adapters of %s gives %s = %g at index %zu: the merged "
                                "weight is not finite (the adapters are too large for float32); nothing was written",
                                checkpoint, p->name, (double)p->var.value.data[bad], bad);
    }
    return QT_OK;
}

/* --dequantize: the merged model in float (PEFT's merge_and_unload). out is
 * built from the merged config (quant.mode none) and every parameter taken
 * from n: a quantized weight dequantized, then every adapter's delta added. */
static QtStatus merge_to_float(const Net *n, const Config *merged, Net *out, bool adapters, FILE *log,
                               QtError *err) {
    QtStatus st = net_build(out, merged, NET_SHELL, err);
    for (int i = 0; st == QT_OK && i < out->model.n_params; i++) {
        Param *p = &out->model.params[i];
        const Param *src = model_find_param((Model *)&n->model, p->name);
        if (!src || var_numel(&src->var) != var_numel(&p->var)) {
            st = qt_error_set(err, QT_ERR_FORMAT, "merging: parameter %s of the float model has no counterpart of "
                              "its size in the checkpoint's model", p->name);
            break;
        }
        const QLayer *q = NULL;
        for (int k = 0; src->released && k < net_hook_count(n, &HOOK_PTQ); k++)
            if (net_qlayer(n, k)->module->weight == src) q = net_qlayer(n, k);
        if (q) qlayer_dequantize_weight(q, p->var.value.data);
        else memcpy(p->var.value.data, src->var.value.data, var_numel(&p->var) * sizeof(float));
    }
    /* batch norms: their running statistics and whether they are folded (the folded weights came above) */
    for (int i = 0; st == QT_OK && i < out->model.n_modules; i++) {
        Module *m = &out->model.modules[i];
        const Module *src = &n->model.modules[i];
        if (!m->running_mean || !src->running_mean) continue;
        memcpy(m->running_mean, src->running_mean, (size_t)m->in_shape[0] * sizeof(float));
        memcpy(m->running_var, src->running_var, (size_t)m->in_shape[0] * sizeof(float));
        m->num_batches_tracked = src->num_batches_tracked;
        m->bn_folded = src->bn_folded;
    }
    for (int i = 0; st == QT_OK && adapters && i < net_hook_count(n, &HOOK_LORA); i++) {
        const LoraAdapter *a = net_adapter(n, i);
        Module *m = model_find_module(&out->model, a->module->path);
        lora_adapter_merge(a, m->weight->var.value.data);
        const QLayer *q = find_qlayer(n, a->module);
        if (log) fprintf(log, "  %-12s %s base: %sW %s %g * B A%s, stored float32\n", m->path,
                         q ? qtype_name(q->spec.weight_qtype) : "float", q ? "dequantize, " : "",
                         a->spec.dora ? "= m * dir(W +" : "+=", (double)a->scale, a->spec.dora ? ") (DoRA)" : "");
    }
    return st;
}

QtStatus tools_merge(const char *checkpoint, const char *out, bool dequantize, bool force, FILE *log, MergeReport *rep,
                     QtError *err) {
    memset(rep, 0, sizeof *rep);
    QtStatus out_st = fs_check_out_path(out, force, "--out", err); /* before the work, not only before the write */
    if (out_st != QT_OK) return out_st;
    Config *c = malloc(sizeof *c), *merged = malloc(sizeof *merged);
    Net n, fl;
    memset(&n, 0, sizeof n);
    memset(&fl, 0, sizeof fl);
    QtStatus st = c && merged ? QT_OK : qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK) st = tools_load_config(checkpoint, c, err);
    if (st == QT_OK && c->lora.n_rules == 0)
        st = qt_error_set(err, QT_ERR_CONFIG, "%s has no LoRA adapters (its config has no lora rules): nothing to "
                          "merge", checkpoint);
    if (st == QT_OK) st = load_checkpoint_net(checkpoint, c, &n, err);
    char base[SHA256_HEX_CHARS] = "";
    CheckpointNet src = net_checkpoint_parts(&n);
    if (st == QT_OK) st = checkpoint_base_sha256(&n.model, &src, base, err); /* before the base changes */
    if (st == QT_OK) {
        *merged = *c;
        merged->lora.n_rules = 0; /* the adapters are in the weights now; trainable modules stay as they are */
        memset(merged->lora.rules, 0, sizeof merged->lora.rules);
        merged->model.adapters_from[0] = '\0';
        if (dequantize) { /* a float model: no quantized base, no QAT/QT state */
            merged->quant.mode = QUANT_MODE_NONE;
            merged->quant.n_rules = 0;
            memset(merged->quant.rules, 0, sizeof merged->quant.rules);
        }
    }
    double err2 = 0.0, norm2 = 0.0;
    if (st == QT_OK && log) fprintf(log, "merging %d adapters of %s%s:\n", net_hook_count(&n, &HOOK_LORA), checkpoint,
                                    dequantize ? " into a float model" : "");
    if (st == QT_OK && dequantize) st = merge_to_float(&n, merged, &fl, true, log, err);
    for (int i = 0; st == QT_OK && !dequantize && i < net_hook_count(&n, &HOOK_LORA); i++)
        st = merge_one(&n, net_adapter(&n, i), &err2, &norm2, log, err);
    if (st == QT_OK) st = merge_check_finite(dequantize ? &fl : &n, checkpoint, err);
    char *text = NULL;
    if (st == QT_OK) {
        text = config_to_yaml(merged);
        if (!text) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    }
    const char *mode = merged->quant.mode == QUANT_MODE_NONE ? "float" : quant_mode_name(merged->quant.mode);
    if (st == QT_OK) {
        CheckpointState s = {.last_train_loss = NAN, .config_text = text, .mode = mode, .merged_from = checkpoint,
                             .merged_from_base_sha256 = base};
        if (!dequantize) s.net = merged_parts(&n);
        st = save_out(out, force, dequantize ? &fl.model : &n.model, &s, err);
    }
    if (st == QT_OK) {
        rep->modules = net_hook_count(&n, &HOOK_LORA);
        rep->dequantized = dequantize;
        rep->weight_rel_rmse = norm2 > 0 ? sqrt(err2 / norm2) : 0.0;
        rep->mode = mode;
    }
    TrainResult before, after;
    if (st == QT_OK) st = train_eval_checkpoint(c, checkpoint, false, &before, err);
    if (st == QT_OK) st = train_eval_checkpoint(merged, out, false, &after, err);
    if (st == QT_OK) {
        rep->test_accuracy_before = before.test_accuracy, rep->test_loss_before = before.test_loss;
        rep->test_accuracy_after = after.test_accuracy, rep->test_loss_after = after.test_loss;
    }
    if (n.cfg) net_free(&n);
    if (fl.cfg) net_free(&fl);
    free(text);
    free(c);
    free(merged);
    return st;
}

/* The converted model: the QAT net's float parameters, its converted layers
 * as the PTQ base, under a ptq config. */
static QtStatus convert_save(Net *n, const Config *ptq, const char *out, bool force, QtError *err) {
    int n_qat = net_hook_count(n, &HOOK_QAT);
    QLayer *ql = calloc((size_t)n_qat + 1, sizeof *ql);
    if (!ql) return qt_error_set(err, QT_ERR_NOMEM, "out of memory converting");
    int k = 0;
    QtStatus st = QT_OK;
    for (; st == QT_OK && k < n_qat; k++) {
        QatLayer *q = net_qat_layer(n, k);
        if (q->bn && q->bn->bn_folded == BN_FOLD_NONE) /* the QAT eval form's folded weight and shift, bit for bit */
            bn_fold_into(q->module, q->bn);
        if ((st = qat_layer_convert(q, &ql[k], err)) != QT_OK) break;
    }
    char *text = st == QT_OK ? config_to_yaml(ptq) : NULL;
    if (st == QT_OK && !text) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK) {
        /* the float weights are now in the QLayers: released, they are not written under /params */
        for (int i = 0; i < n_qat; i++) param_release(net_qat_layer(n, i)->module->weight);
        CheckpointState s = {.last_train_loss = NAN, .config_text = text, .net = hook_layers_one(&HOOK_PTQ, ql, k)};
        st = save_out(out, force, &n->model, &s, err);
    }
    for (int i = 0; i < k; i++) qlayer_free(&ql[i]);
    free(ql);
    free(text);
    return st;
}

QtStatus tools_convert(const char *checkpoint, const char *out, bool force, FILE *log, ConvertReport *rep,
                       QtError *err) {
    memset(rep, 0, sizeof *rep);
    QtStatus out_st = fs_check_out_path(out, force, "--out", err); /* before the work, not only before the write */
    if (out_st != QT_OK) return out_st;
    Config *c = malloc(sizeof *c), *ptq = malloc(sizeof *ptq);
    Net n;
    memset(&n, 0, sizeof n);
    QtStatus st = c && ptq ? QT_OK : qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK) st = tools_load_config(checkpoint, c, err);
    if (st == QT_OK && c->quant.mode != QUANT_MODE_QAT)
        st = qt_error_set(err, QT_ERR_CONFIG, "%s was written by a quant.mode %s run; qtrain convert turns a qat "
                          "checkpoint into a ptq one", checkpoint, quant_mode_name(c->quant.mode));
    if (st == QT_OK && c->lora.n_rules > 0)
        st = qt_error_set(err, QT_ERR_CONFIG, "%s has LoRA adapters over its QAT base; qtrain convert converts a QAT "
                          "model trained in full (its adapters would be lost)", checkpoint);
    if (st == QT_OK) st = load_checkpoint_net(checkpoint, c, &n, err);
    if (st == QT_OK) {
        *ptq = *c;
        ptq->quant.mode = QUANT_MODE_PTQ;
        ptq->model.init_from[0] = '\0';
        st = convert_save(&n, ptq, out, force, err);
    }
    if (st == QT_OK) rep->modules = net_hook_count(&n, &HOOK_QAT);
    TrainResult a, b;
    if (st == QT_OK) st = train_eval_checkpoint(c, checkpoint, false, &a, err);
    if (st == QT_OK) st = train_eval_checkpoint(ptq, out, false, &b, err);
    if (st == QT_OK) {
        rep->test_accuracy_qat = a.test_accuracy, rep->test_loss_qat = a.test_loss;
        rep->test_accuracy_ptq = b.test_accuracy, rep->test_loss_ptq = b.test_loss;
        if (log) fprintf(log, "converted %d QAT layers of %s into %s (%.3f bits/param)\n", rep->modules, checkpoint, out,
                         b.base_bits_per_param);
    }
    if (n.cfg) net_free(&n);
    free(c);
    free(ptq);
    return st;
}

QtStatus tools_float_net(const char *checkpoint, bool merge, Config *cfg, Net *out, FILE *log, QtError *err) {
    memset(out, 0, sizeof *out);
    Config *c = malloc(sizeof *c);
    Net n;
    memset(&n, 0, sizeof n);
    QtStatus st = c ? tools_load_config(checkpoint, c, err) : qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK && merge && c->lora.n_rules == 0)
        st = qt_error_set(err, QT_ERR_CONFIG, "%s has no LoRA adapters (its config has no lora rules): nothing to "
                          "merge; leave out --merge", checkpoint);
    if (st == QT_OK) st = load_checkpoint_net(checkpoint, c, &n, err);
    if (st == QT_OK) {
        *cfg = *c; /* a float model: no adapters, no quantized base, no QAT/QT state */
        cfg->lora.n_rules = 0;
        memset(cfg->lora.rules, 0, sizeof cfg->lora.rules);
        cfg->model.adapters_from[0] = '\0';
        cfg->model.init_from[0] = '\0';
        cfg->quant.mode = QUANT_MODE_NONE;
        cfg->quant.n_rules = 0;
        memset(cfg->quant.rules, 0, sizeof cfg->quant.rules);
        st = merge_to_float(&n, cfg, out, merge, log, err);
        if (st == QT_OK) st = merge_check_finite(out, checkpoint, err);
    }
    if (n.cfg) net_free(&n);
    if (st != QT_OK && out->cfg) net_free(out);
    free(c);
    return st;
}

QtStatus tools_save_float(const char *out, bool force, const Net *n, const char *from, QtError *err) {
    char *text = config_to_yaml(n->cfg);
    if (!text) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    CheckpointState s = {.last_train_loss = NAN, .config_text = text, .mode = "float", .merged_from = from};
    QtStatus st = save_out(out, force, &n->model, &s, err);
    free(text);
    return st;
}

QtStatus tools_load_net(const char *checkpoint, Config *c, Net *n, QtError *err) {
    memset(n, 0, sizeof *n);
    QtStatus st = tools_load_config(checkpoint, c, err);
    return st == QT_OK ? load_checkpoint_net(checkpoint, c, n, err) : st;
}
