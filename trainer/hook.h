/* hook.h - hook layers: what the config's quant and lora rules attach to a
 * dense or conv2d module over its own op, one kind per file.
 *
 *   kind  file         layer        rules        what it is
 *   ptq   hook_ptq.c   QLayer       quant (ptq)  a frozen quantized base weight (quant/qlayer.h)
 *   lora  hook_lora.c  LoraAdapter  lora         a low-rank adapter over the module's forward (lora/lora.h)
 *   qat   hook_qat.c   QatLayer     quant (qat)  fake-quantized training, learned ranges (quant/qat.h)
 *   qt    hook_fqt.c   FqtLayer     quant (qt)   quantized-GEMM training (quant/fqt.h)
 *
 * A kind is a const HookKind: the functions that build its layers on a Net
 * (which modules, check, attach and install, free, trainable parameters),
 * report them (module table, formats, bytes) and keep them in a checkpoint
 * (save one layer; load one into a staging area; commit). A Net (net.h)
 * holds every kind's layers as one HookSet per kind, in hook_kinds order,
 * and a checkpoint's CheckpointNet is the same HookLayers: net.c,
 * checkpoint.c and checkpoint_net.c go over the kinds and name none.
 *
 * Order. hook_kinds[] is the order of the kinds' groups in a checkpoint and
 * of their parameters in the optimizer's list (after the model's own).
 * Per module, the kinds that replace the op (wraps false) are checked and
 * installed before those that wrap whatever forward is in place (an
 * adapter over a quantized base).
 *
 * Batch norm folding is no kind of its own: PTQ's attach folds each batch
 * norm into the float layer before it (bn_fold.h) between loading
 * model.init_from and quantizing, so the quantized weight is the folded one.
 *
 * Adding a kind (DoRA, ...) takes:
 *   1. trainer/hook_NAME.c: its layer struct, whose first member is
 *      `Module *module`; its functions; `const HookKind HOOK_NAME = {...}`
 *      with at least name, layer_size, rules, applies, check, attach and
 *      free, and for state in checkpoints group, save, staged_size, load and
 *      commit (every other entry may be NULL: the kind has no such thing; a
 *      layer has at most HOOK_PARAMS_MAX parameters; two kinds that replace
 *      the op on one module are a config error); and, if code elsewhere (tools,
 *      tests) works on its layers by their type, an accessor like
 *      net_qlayer.
 *   2. Here: `extern const HookKind HOOK_NAME;` (and the accessor).
 *   3. hook.c: &HOOK_NAME in hook_kinds[], where its checkpoint group and
 *      optimizer parameters go; at the end, every existing run and file
 *      stays exactly as it is.
 *   4. checkpoint.h: its groups in the layout comment.
 * Nothing else: net.c then builds, checks, frees, reports, calibrates and
 * steps its layers, and the checkpoint writer and reader save, stage,
 * check and restore them (with adapters.h5 when in_adapters_file). The
 * config rules that select it are quant.rules or lora.rules (HookRules);
 * a kind with rules of its own needs its keys in the config too. */
#ifndef QTRAIN_TRAINER_HOOK_H
#define QTRAIN_TRAINER_HOOK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/error.h"
#include "lora/lora.h"
#include "nn/model.h"
#include "quant/fqt.h"
#include "quant/qarray.h"
#include "quant/qat.h"
#include "quant/qlayer.h"

#define HOOK_KINDS_MAX 8  /* kinds hook_kinds may list */
#define HOOK_PARAMS_MAX 4 /* trainable parameters one layer may have (LoRA: A, B; DoRA would add a magnitude) */

typedef struct Net Net;             /* net.h */
typedef struct H5ioFile H5ioFile;   /* base/h5io.h */
typedef struct HookKind HookKind;

/* One kind's layers in a model, in module order. */
typedef struct {
    const HookKind *kind;
    void *layers; /* [n] of kind->layer_size bytes, each starting with its Module *module; owned by the Net */
    int n;
} HookSet;

/* Every hook layer of a model: one set per kind, in hook_kinds order (a
 * kind with no layers has n 0); a checkpoint's CheckpointNet. */
typedef struct {
    HookSet sets[HOOK_KINDS_MAX]; /* [n_sets] */
    int n_sets;
} HookLayers;

/* Whose rules attach a kind: quant.rules (the module table's quant column)
 * or lora.rules (its lora column). */
typedef enum { HOOK_RULES_QUANT, HOOK_RULES_LORA } HookRules;

struct HookKind {
    const char *name;    /* "ptq", "lora", "qat", "qt" */
    size_t layer_size;   /* sizeof its layer struct */
    HookRules rules;
    bool wraps;          /* installs over the module's forward as it stands (an adapter): after the kinds that
                            replace it */
    bool loads_init_from;   /* it reads model.init_from itself (a PTQ base); with layers of it the Net does not */
    bool trains_weight;     /* the module's float weight trains and is quantized on conversion (net_base_bits_per_param
                               then counts every parameter) */
    bool in_adapters_file;  /* an adapters.h5 holds it (checkpoint_save_adapters, model.adapters_from) */

    /* ---- building (net.c) ---- */
    /* Whether the kind has a layer on module `module` (an index into n->model.modules), by the run's rules. */
    bool (*applies)(const Net *n, int module);
    /* The resolved setting against the module; the message starts with the module path (the Net adds the
       rule's place in the config). */
    QtStatus (*check)(const Net *n, int module, QtError *err);
    /* Fills set->layers ([set->n], zeroed) for the modules `applies` took, in module order, and installs them.
       fresh: values from the seed or model.init_from (NET_FRESH); else layouts for a checkpoint to fill. On
       error set->n may be lowered to the layers that need freeing. */
    QtStatus (*attach)(Net *n, HookSet *set, bool fresh, QtError *err);
    void (*free)(void *layer);
    /* Its trainable parameters into out[HOOK_PARAMS_MAX]; the count. */
    int (*params)(void *layer, Param **out);
    float (*lr)(const void *layer); /* its parameters' own learning rate, 0 = the optimizer's */
    /* After an optimizer step: the layer's state is usable (QT_ERR_VALUE naming module and step). */
    QtStatus (*check_step)(const Net *n, const void *layer, int64_t step, QtError *err);
    void (*set_step)(void *layer, int64_t step); /* the training step the next forward belongs to */
    /* Static activation calibration: begin, forward passes, end; needs_calib: it has a range to calibrate. */
    void (*calib_begin)(void *layer);
    QtStatus (*calib_end)(void *layer, QtError *err);
    bool (*needs_calib)(const void *layer);

    /* ---- reporting (net.c) ---- */
    /* Its cell of the module table, after "[rule] ". */
    void (*describe)(const void *layer, char *buf, size_t cap);
    /* Its weight format ("nf4/64+dq") and quantized input format ("" for none), for net_format_summary. */
    void (*formats)(const void *layer, char *w, size_t wcap, char *a, size_t acap);
    size_t (*bytes)(const void *layer);        /* memory it holds beyond the model's parameters */
    double (*base_bytes)(const void *layer);   /* the module's weight in the quantized model: as held, or once
                                                  converted (trains_weight) */
    void (*table_note)(const HookSet *set, FILE *out); /* lines after the module table */

    /* ---- checkpoints (checkpoint_net.c; layout in checkpoint.h) ---- */
    const char *group;   /* its top group ("quant", "lora"), made by the writer before the first layer; NULL: the
                            kind keeps no state in checkpoints (save, load, commit and staged_size then unused) */
    QtStatus (*save)(H5ioFile *f, const void *layer, QtError *err);
    /* Before any layer is read: what the file must hold for the whole set. */
    QtStatus (*check_file)(const H5ioFile *f, const HookSet *set, QtError *err);
    /* Reads and checks one layer's state into staged (staged_size bytes, zeroed); nothing of the layer changes. */
    size_t staged_size;
    QtStatus (*load)(const H5ioFile *f, const void *layer, void *staged, QtError *err);
    void (*commit)(void *layer, void *staged);  /* moves the staged state into the layer */
    void (*staged_free)(void *staged);          /* what load allocated and commit did not take */
    /* model.adapters_from (in_adapters_file): the file's layers of this kind against the run's, before loading
       (one the run lacks, settings that differ). */
    QtStatus (*check_adapters)(const H5ioFile *f, const HookSet *set, QtError *err);
    /* The quantized weight standing for the module's released float weight in a frozen base: part of the base's
       identity (checkpoint_base_sha256), as the datasets under /<group>/<module>/weight. */
    const QArray *(*frozen_weight)(const void *layer);
};

/* The kinds, in checkpoint and optimizer order (hook.c). */
extern const HookKind *const hook_kinds[];
extern const int hook_n_kinds;

extern const HookKind HOOK_PTQ, HOOK_LORA, HOOK_QAT, HOOK_FQT;

/* Layer i of a set; its module. */
void *hook_layer(const HookSet *set, int i);
Module *hook_layer_module(const void *layer);
/* The layer of set on module m, or NULL. */
void *hook_find(const HookSet *set, const Module *m);
/* kind's set in h, or NULL; the count of its layers (0 if absent). */
const HookSet *hook_layers_find(const HookLayers *h, const HookKind *kind);
int hook_layers_count(const HookLayers *h, const HookKind *kind);
/* A HookLayers holding one kind's layers alone (a PTQ base being written); h's layers of kind alone (an empty
 * set if h has none). */
HookLayers hook_layers_one(const HookKind *kind, void *layers, int n);
HookLayers hook_layers_only(const HookLayers *h, const HookKind *kind);

/* ---- what the kinds read of a Net (net.c) ---- */

/* The resolved quant / lora rule setting of module `module`, NULL if none applies (or it is a skip rule). */
const QLayerSpec *net_quant_spec(const Net *n, int module);
const LoraSpec *net_lora_spec(const Net *n, int module);
/* Every kind's resolved setting against its modules (kind->check), and at
 * most one kind that replaces a module's op per module; counts each set's
 * layers (sets' n, zero on entry). net_build runs it; tests run it on sets
 * of their own kinds. */
QtStatus net_check_specs(Net *n, QtError *err);

/* ---- typed views of one kind's layers, for code that works on that kind (tools, tests) ---- */

int net_hook_count(const Net *n, const HookKind *kind);
void *net_hook_layer(const Net *n, const HookKind *kind, int i); /* i < net_hook_count */
/* Each defined in its kind's file. */
QLayer *net_qlayer(const Net *n, int i);       /* HOOK_PTQ */
LoraAdapter *net_adapter(const Net *n, int i); /* HOOK_LORA */
QatLayer *net_qat_layer(const Net *n, int i);  /* HOOK_QAT */
FqtLayer *net_fqt_layer(const Net *n, int i);  /* HOOK_FQT */

#endif
