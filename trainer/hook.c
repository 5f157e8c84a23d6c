/* hook.c - the hook kinds and what every kind's layers share. */
#include "hook.h"

#include <string.h>

#include "trainer/net.h"

/* Checkpoint and optimizer order (hook.h): a PTQ base's /quant, then
 * adapters, then the trained quantizers' state. */
const HookKind *const hook_kinds[] = {&HOOK_PTQ, &HOOK_LORA, &HOOK_QAT, &HOOK_FQT};
const int hook_n_kinds = (int)(sizeof hook_kinds / sizeof hook_kinds[0]);
_Static_assert(sizeof hook_kinds / sizeof hook_kinds[0] <= HOOK_KINDS_MAX, "raise HOOK_KINDS_MAX");

void *hook_layer(const HookSet *set, int i) { return (char *)set->layers + (size_t)i * set->kind->layer_size; }

/* Every layer struct starts with its Module * (hook.h). */
Module *hook_layer_module(const void *layer) { return *(Module *const *)layer; }

void *hook_find(const HookSet *set, const Module *m) {
    for (int i = 0; set && i < set->n; i++)
        if (hook_layer_module(hook_layer(set, i)) == m) return hook_layer(set, i);
    return NULL;
}

const HookSet *hook_layers_find(const HookLayers *h, const HookKind *kind) {
    for (int k = 0; k < h->n_sets; k++)
        if (h->sets[k].kind == kind) return &h->sets[k];
    return NULL;
}

int hook_layers_count(const HookLayers *h, const HookKind *kind) {
    const HookSet *s = hook_layers_find(h, kind);
    return s ? s->n : 0;
}

HookLayers hook_layers_one(const HookKind *kind, void *layers, int n) {
    HookLayers h = {.n_sets = 1};
    h.sets[0] = (HookSet){.kind = kind, .layers = layers, .n = n};
    return h;
}

HookLayers hook_layers_only(const HookLayers *h, const HookKind *kind) {
    const HookSet *s = hook_layers_find(h, kind);
    return hook_layers_one(kind, s ? s->layers : NULL, s ? s->n : 0);
}

int net_hook_count(const Net *n, const HookKind *kind) { return hook_layers_count(&n->hooks, kind); }

void *net_hook_layer(const Net *n, const HookKind *kind, int i) {
    return hook_layer(hook_layers_find(&n->hooks, kind), i);
}
