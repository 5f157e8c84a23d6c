/* bn_fold.c - batch norm folding into the layer before it (bn_fold.h). */
#include "bn_fold.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nn/ops_chscale.h"
#include "trainer/hook.h"
#include "trainer/net.h"

void bn_fold_into(Module *producer, Module *bn) {
    const int C = bn->in_shape[0];
    float *w = producer->weight->var.value.data;     /* (C, per...) */
    float *b = producer->bias ? producer->bias->var.value.data : NULL; /* (C,) or NULL */
    float *gamma = bn->weight ? bn->weight->var.value.data : NULL;      /* (C,) or NULL (affine: false) */
    float *beta = bn->bias ? bn->bias->var.value.data : NULL;
    const size_t per = var_numel(&producer->weight->var) / (size_t)C;
    /* in place: the shift goes to the producer's bias, or (none) to bn's */
    bn_fold_values(w, b ? b : beta, w, b, gamma, beta, bn->running_mean, bn->running_var, bn->bn.eps, C, per);
    for (int c = 0; c < C; c++) {
        if (b && beta) beta[c] = 0.0f;
        if (gamma) gamma[c] = 1.0f;
        bn->running_mean[c] = 0.0f;
        bn->running_var[c] = 1.0f;
    }
    bn->bn_folded = b ? BN_FOLD_INTO : BN_FOLD_BIAS;
}

/* A module that reads module p other than `except`, or NULL. */
static const Module *other_consumer(const Model *m, int p, int except) {
    for (int j = p + 1; j < m->n_modules; j++)
        for (int k = 0; j != except && k < m->modules[j].n_inputs; k++)
            if (m->modules[j].inputs[k] == p) return &m->modules[j];
    return NULL;
}

bool bn_fold_check(const Model *m, int bn, char *why, size_t cap) {
    const Module *b = &m->modules[bn];
    const char *name = b->path;
    int p = b->n_inputs == 1 ? b->inputs[0] : -1;
    if (p < 0) {
        snprintf(why, cap, "%s: not folded: it reads the model's input, not a conv2d or dense", name);
        return false;
    }
    const Module *pm = &m->modules[p];
    if (pm->spec.type != LAYER_CONV2D && pm->spec.type != LAYER_DENSE) {
        snprintf(why, cap, "%s: not folded: it reads %s, a %s, not a conv2d or dense", name, pm->path,
                 layer_type_name(pm->spec.type));
        return false;
    }
    const Module *o = other_consumer(m, p, bn);
    if (pm->n_consumers != 1 || o) {
        snprintf(why, cap, "%s: not folded: %s's output also feeds %s", name, pm->path, o ? o->path : "the output");
        return false;
    }
    if (!pm->bias && !b->bias) {
        snprintf(why, cap, "%s: not folded: neither %s nor it (affine: false) has a bias to hold the shift", name,
                 pm->path);
        return false;
    }
    snprintf(why, cap, "%s: folded into %s", name, pm->path);
    return true;
}

/* Why the run keeps producer p or batch norm i as they are, or NULL. */
static const char *run_keeps(const Net *n, int p, int i, char *buf, size_t cap) {
    const Module *pm = &n->model.modules[p], *b = &n->model.modules[i];
    if (n->is_trainable[p] || n->is_trainable[i])
        snprintf(buf, cap, "%s: not folded: %s trains in full (lora.trainable)", b->path,
                 n->is_trainable[p] ? pm->path : b->path);
    /* a frozen quantized weight cannot follow a batch norm that trains; QAT's folded form can (it refolds the
       statistics every step) */
    else if (n->cfg->quant.mode != QUANT_MODE_QAT && net_bn_trains(n, i))
        snprintf(buf, cap, "%s: not folded: it trains (lora.batchnorm: train)", b->path);
    else if (net_lora_spec(n, p))
        snprintf(buf, cap, "%s: not folded: %s has a LoRA adapter, whose output it normalises too", b->path, pm->path);
    else if (pm->weight->released)
        snprintf(buf, cap, "%s: not folded: model.init_from holds %s quantized without it", b->path, pm->path);
    else
        return NULL;
    return buf;
}

bool net_bn_foldable(const Net *n, int i, char *note) {
    const Module *b = &n->model.modules[i];
    if (!n->cfg->quant.fold_bn) {
        snprintf(note, BN_NOTE_MAX, "%s: not folded (quant.fold_bn: false)", b->path);
        return false;
    }
    if (!bn_fold_check(&n->model, i, note, BN_NOTE_MAX)) return false;
    char buf[BN_NOTE_MAX];
    const char *keep = run_keeps(n, b->inputs[0], i, buf, sizeof buf);
    if (keep) snprintf(note, BN_NOTE_MAX, "%s", keep);
    return !keep;
}

void net_fold_batchnorms(Net *n) {
    if (!n->bn_note) return;
    for (int i = 0; i < n->model.n_modules; i++) {
        Module *b = &n->model.modules[i];
        char *note = n->bn_note[i];
        if (!b->running_mean) continue;
        if (b->bn_folded != BN_FOLD_NONE) {
            snprintf(note, BN_NOTE_MAX, "%s: folded into %s (as model.init_from holds it)", b->path,
                     n->model.modules[b->inputs[0]].path);
            continue;
        }
        if (net_bn_foldable(n, i, note)) bn_fold_into(&n->model.modules[b->inputs[0]], b);
    }
}
