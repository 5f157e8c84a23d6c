/* test_hook.c - hook layers (trainer/hook.h): every registered kind has
 * what the Net and the checkpoint code call; a Net holds one set per kind
 * in hook_kinds order, installs an adapter over the base it wraps and
 * hands the optimizer the kinds' parameters in that order; and a kind the
 * checkpoint code has never heard of (a toy one, defined here alone) is
 * saved, staged, checked and restored by checkpoint_save and
 * checkpoint_load_model without a line of them naming it. These tests
 * join the "checkpoint" suite through hook_tests_add. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/checkpoint.h"
#include "base/h5io.h"
#include "trainer/hook.h"
#include "trainer/net.h"

int hook_tests_add(CU_pSuite s);

static void test_kinds_complete(void) {
    CU_ASSERT_FATAL(hook_n_kinds >= 4 && hook_n_kinds <= HOOK_KINDS_MAX);
    for (int k = 0; k < hook_n_kinds; k++) {
        const HookKind *h = hook_kinds[k];
        CU_ASSERT_PTR_NOT_NULL(h->name);
        CU_ASSERT(h->layer_size >= sizeof(Module *));
        CU_ASSERT(h->applies && h->check && h->attach && h->free);
        CU_ASSERT(h->group && h->group[0] && h->save && h->load && h->commit && h->staged_size > 0);
        for (int j = 0; j < k; j++) CU_ASSERT(strcmp(h->name, hook_kinds[j]->name) != 0);
    }
    /* checkpoint and optimizer order: the PTQ base, then adapters, then the trained quantizers */
    CU_ASSERT(hook_kinds[0] == &HOOK_PTQ && hook_kinds[1] == &HOOK_LORA);
}

/* Each adapter of n (on conv1 and fc1, in module order) wraps the layer of `base` on its module, and the
 * optimizer's list goes on, after the model's own parameters, with each adapter's A and B. */
static void check_adapters_over(const Net *n, const HookKind *base, int n_model_params) {
    const HookSet *bs = hook_layers_find(&n->hooks, base);
    CU_ASSERT_EQUAL_FATAL(net_hook_count(n, &HOOK_LORA), 2);
    CU_ASSERT(net_adapter(n, 0)->module == model_find_module((Model *)&n->model, "conv1"));
    CU_ASSERT(net_adapter(n, 1)->module == model_find_module((Model *)&n->model, "fc1"));
    for (int i = 0; i < 2; i++) {
        LoraAdapter *a = net_adapter(n, i);
        void *under = hook_find(bs, a->module);
        CU_ASSERT_PTR_NOT_NULL(under);
        CU_ASSERT(a->module->hook_ctx == a); /* installed last, whatever the kinds' order */
        CU_ASSERT(a->base_ctx == under);
        CU_ASSERT(n->trainable[n_model_params + 2 * i] == &a->A && n->trainable[n_model_params + 2 * i + 1] == &a->B);
    }
}

static Net *build(const char *path, const char *const *ov, int n_ov, Config *c) {
    static Net n;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(config_load(c, path, ov, n_ov, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c, NET_SHELL, &err), QT_OK);
    CU_ASSERT_EQUAL(n.hooks.n_sets, hook_n_kinds);
    for (int k = 0; k < n.hooks.n_sets; k++) CU_ASSERT(n.hooks.sets[k].kind == hook_kinds[k]);
    return &n;
}

/* QLoRA: a PTQ base on conv1 and fc1 with adapters over it, the head
 * trained in full; QAT + LoRA: adapters over fake-quantized layers, whose
 * kind comes after LoRA's in hook_kinds. */
static void test_net_sets_and_order(void) {
    Config *c = malloc(sizeof *c);
    CU_ASSERT_FATAL(c != NULL);
    Net *n = build("tests/configs/tiny-qlora.yaml", NULL, 0, c);
    CU_ASSERT_EQUAL_FATAL(net_hook_count(n, &HOOK_PTQ), 2);
    CU_ASSERT(net_qlayer(n, 1)->module == model_find_module(&n->model, "fc1"));
    CU_ASSERT_EQUAL(net_hook_count(n, &HOOK_QAT) + net_hook_count(n, &HOOK_FQT), 0);
    CU_ASSERT_EQUAL(n->n_trainable, 6); /* the head's weight and bias, each adapter's A and B */
    check_adapters_over(n, &HOOK_PTQ, 2);
    CheckpointNet parts = net_checkpoint_parts(n), ptq = hook_layers_only(&n->hooks, &HOOK_PTQ);
    CU_ASSERT(parts.n_sets == n->hooks.n_sets && hook_layers_count(&parts, &HOOK_LORA) == 2);
    CU_ASSERT(ptq.n_sets == 1 && ptq.sets[0].layers == net_qlayer(n, 0) && ptq.sets[0].n == 2);
    net_free(n);

    const char *ov[] = {"lora.rules=[{module_path: \"conv1|fc1\", rank: 2}]"};
    n = build("tests/configs/tiny-qat.yaml", ov, 1, c);
    CU_ASSERT_EQUAL_FATAL(net_hook_count(n, &HOOK_QAT), 3);
    check_adapters_over(n, &HOOK_QAT, 0);
    /* then the learned ranges (tqt on conv1 and fc1: weight and input each; none on the head) */
    Param *ps[HOOK_PARAMS_MAX];
    CU_ASSERT_EQUAL_FATAL(qat_layer_params(net_qat_layer(n, 0), ps), 2);
    CU_ASSERT_EQUAL(n->n_trainable, 8);
    CU_ASSERT(n->trainable[4] == ps[0] && n->trainable[5] == ps[1]);
    net_free(n);
    free(c);
}

/* The module table names each module's layer by its kind: a qt model's modules train quantized, not float. */
static void test_table_describes_every_kind(void) {
    static const struct {
        const char *config, *want;
    } cases[] = {
        {"tests/configs/tiny-qlora.yaml", "[1] nf4"},
        {"tests/configs/tiny-qat.yaml", "[1] qat int4"},
        {"tests/configs/tiny-qt.yaml", "[0] qt int8 per-channel, act int8, bwd int8 sr"},
    };
    Config *c = malloc(sizeof *c);
    CU_ASSERT_FATAL(c != NULL);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        Net *n = build(cases[i].config, NULL, 0, c);
        char *text = NULL;
        size_t len = 0;
        FILE *out = open_memstream(&text, &len);
        CU_ASSERT_FATAL(out != NULL);
        net_print_table(n, out);
        fclose(out);
        CU_ASSERT_PTR_NOT_NULL(strstr(text, cases[i].want));
        CU_ASSERT_PTR_NULL(strstr(text, "weight_qtype none")); /* every rule of these sets a weight_qtype */
        if (!strstr(text, cases[i].want) || strstr(text, "weight_qtype none")) fprintf(stderr, "\n%s", text);
        free(text);
        net_free(n);
    }
    free(c);
}

/* A module no rule hooks says whether it trains: a QT run's batch norm does, a QLoRA run's frozen base does not. */
static void test_table_unhooked_modules(void) {
    static const struct {
        const char *config, *set, *want, *not;
    } cases[] = {
        {"tests/configs/tiny-bn.yaml",
         "quant={mode: qt, rules: [{module_path: \"conv1|head\", weight_qtype: int8, act_qtype: int8, "
         "bwd_qtype: int8}]}",
         "float (trained)", "float (frozen)"},
        {"tests/configs/tiny-bn.yaml", "lora={rules: [{module_path: head, rank: 2}]}", "float (frozen)",
         "float (trained)"},
    };
    Config *c = malloc(sizeof *c);
    CU_ASSERT_FATAL(c != NULL);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *ov[] = {cases[i].set};
        Net *n = build(cases[i].config, ov, 1, c);
        char *text = NULL;
        size_t len = 0;
        FILE *out = open_memstream(&text, &len);
        CU_ASSERT_FATAL(out != NULL);
        net_print_table(n, out);
        fclose(out);
        const char *bn = strstr(text, "  bn1 ");
        CU_ASSERT_PTR_NOT_NULL(bn);
        const char *eol = bn ? strchr(bn, '\n') : NULL;
        bool ok = bn && eol && strstr(bn, cases[i].want) && strstr(bn, cases[i].want) < eol &&
                  !(strstr(bn, cases[i].not) && strstr(bn, cases[i].not) < eol);
        if (!ok) fprintf(stderr, "\n%s", text);
        CU_ASSERT(ok);
        free(text);
        net_free(n);
    }
    free(c);
}

/* ---- a toy kind: a gain per module, kept as an attribute of /toy/<module> ---- */

typedef struct {
    Module *module;
    float gain;
} ToyLayer;

static int toy_staged_freed;

static bool toy_applies(const Net *n, int module) { return (void)n, (void)module, false; }
static QtStatus toy_check(const Net *n, int module, QtError *err) { return (void)n, (void)module, (void)err, QT_OK; }
static QtStatus toy_attach(Net *n, HookSet *set, bool fresh, QtError *err) {
    return (void)n, (void)set, (void)fresh, (void)err, QT_OK;
}
static void toy_free(void *layer) { (void)layer; }

static QtStatus toy_save(H5ioFile *f, const void *layer, QtError *err) {
    const ToyLayer *t = layer;
    char g[256];
    snprintf(g, sizeof g, "toy/%s", t->module->path);
    QtStatus st = h5io_group_create(f, g, err);
    if (st == QT_OK) st = h5io_attr_write_f64(f, g, "gain", t->gain, err);
    return st;
}

static QtStatus toy_load(const H5ioFile *f, const void *layer, void *staged, QtError *err) {
    const ToyLayer *t = layer;
    char g[256];
    snprintf(g, sizeof g, "toy/%s", t->module->path);
    if (h5io_kind(f, g) != H5IO_GROUP)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: /%s is missing", f->path, g);
    double v = 0.0;
    QtStatus st = h5io_attr_read_f64(f, g, "gain", &v, err);
    *(float *)staged = (float)v;
    return st;
}

static void toy_commit(void *layer, void *staged) { ((ToyLayer *)layer)->gain = *(float *)staged; }
static void toy_staged_free(void *staged) { (void)staged, toy_staged_freed++; }

static const HookKind TOY = {
    .name = "toy", .layer_size = sizeof(ToyLayer), .applies = toy_applies, .check = toy_check,
    .attach = toy_attach, .free = toy_free, .group = "toy", .save = toy_save, .staged_size = sizeof(float),
    .load = toy_load, .commit = toy_commit, .staged_free = toy_staged_free,
};

static void test_new_kind_through_checkpoints(void) {
    LayerSpec l[3] = {{.type = LAYER_FLATTEN}, {.type = LAYER_DENSE, .units = 4}, {.type = LAYER_DENSE, .units = 3}};
    snprintf(l[1].name, sizeof l[1].name, "a");
    snprintf(l[2].name, sizeof l[2].name, "b");
    int shape[1] = {5};
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, shape, l, 3, &err), QT_OK);
    Module *a = model_find_module(&m, "a"), *b = model_find_module(&m, "b");
    ToyLayer saved[2] = {{a, 1.5f}, {b, -2.25f}}, got[2] = {{a, 0.0f}, {b, 0.0f}};
    char *dir = test_tmpdir_new(), *full = test_path_join(dir, "full.h5"), *part = test_path_join(dir, "part.h5");
    CheckpointState s = {.last_train_loss = NAN, .net = hook_layers_one(&TOY, saved, 2)};
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(full, &m, NULL, &s, &err), QT_OK);
    s.net = hook_layers_one(&TOY, saved, 1); /* /toy/b missing */
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(part, &m, NULL, &s, &err), QT_OK);

    CheckpointNet net = hook_layers_one(&TOY, got, 2);
    toy_staged_freed = 0;
    CU_ASSERT_EQUAL(checkpoint_load_model(part, &m, &net, &err), QT_ERR_FORMAT);
    CU_ASSERT(strstr(err.msg, "/toy/b is missing") != NULL);
    CU_ASSERT(got[0].gain == 0.0f && got[1].gain == 0.0f); /* staged, never half-applied */
    CU_ASSERT_EQUAL(toy_staged_freed, 2);
    toy_staged_freed = 0;
    CU_ASSERT_EQUAL(checkpoint_load_model(full, &m, &net, &err), QT_OK);
    CU_ASSERT(got[0].gain == 1.5f && got[1].gain == -2.25f);
    CU_ASSERT_EQUAL(toy_staged_freed, 2);

    model_free(&m);
    free(full), free(part);
    test_tmpdir_remove(dir);
}

/* ---- kinds the Net checks: one that replaces every dense/conv module's op, one without checkpoint state ---- */

static bool dense_or_conv(const Net *n, int module) {
    LayerType t = n->model.modules[module].spec.type;
    return t == LAYER_DENSE || t == LAYER_CONV2D;
}
static QtStatus refuse(const Net *n, int module, QtError *err) {
    return qt_error_set(err, QT_ERR_CONFIG, "%s: refused by the test", n->model.modules[module].path);
}
static const HookKind REPLACER = {.name = "replacer", .layer_size = sizeof(ToyLayer), .applies = dense_or_conv,
                                  .check = toy_check, .attach = toy_attach, .free = toy_free};
static const HookKind REFUSER = {.name = "refuser", .layer_size = sizeof(ToyLayer), .wraps = true,
                                 .applies = dense_or_conv, .check = refuse, .attach = toy_attach, .free = toy_free};

/* n's sets plus one of `extra`, every count zero: what net_check_specs sees when a kind joins hook_kinds. */
static Net with_kind(const Net *n, const HookKind *extra) {
    Net t = *n;
    for (int k = 0; k < t.hooks.n_sets; k++) t.hooks.sets[k].n = 0;
    t.hooks.sets[t.hooks.n_sets++] = (HookSet){.kind = extra};
    return t;
}

/* Two kinds that replace one module's op are refused, naming both; a
 * kind that applies where no rule does reports the config's place, not a
 * rule's (there is none to index). */
static void test_specs_checked_per_module(void) {
    Config *c = malloc(sizeof *c);
    CU_ASSERT_FATAL(c != NULL);
    Net *n = build("tests/configs/tiny-qlora.yaml", NULL, 0, c);
    QtError err = {0};
    Net t = with_kind(n, &REPLACER);
    CU_ASSERT_EQUAL(net_check_specs(&t, &err), QT_ERR_CONFIG);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "module conv1 would be both a ptq and a replacer layer"));
    net_free(n);

    n = build("tests/configs/tiny-cnn.yaml", NULL, 0, c); /* no quant or lora rules */
    t = with_kind(n, &REPLACER);
    CU_ASSERT_EQUAL(net_check_specs(&t, &err), QT_OK);
    CU_ASSERT(t.hooks.sets[t.hooks.n_sets - 1].n >= 2); /* every dense and conv module */
    t = with_kind(n, &REFUSER);
    err = (QtError){0};
    CU_ASSERT_EQUAL(net_check_specs(&t, &err), QT_ERR_CONFIG);
    CU_ASSERT(strncmp(err.msg, c->source, strlen(c->source)) == 0 && strstr(err.msg, "refused by the test"));
    net_free(n);
    free(c);
}

/* A kind without checkpoint state (group NULL) is neither written nor read. */
static void test_stateless_kind_skipped_by_checkpoints(void) {
    static const HookKind STATELESS = {.name = "stateless", .layer_size = sizeof(ToyLayer), .applies = toy_applies,
                                       .check = toy_check, .attach = toy_attach, .free = toy_free};
    LayerSpec l[2] = {{.type = LAYER_FLATTEN}, {.type = LAYER_DENSE, .units = 3}};
    snprintf(l[1].name, sizeof l[1].name, "a");
    int shape[1] = {5};
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 1, shape, l, 2, &err), QT_OK);
    ToyLayer layers[1] = {{model_find_module(&m, "a"), 1.0f}};
    char *dir = test_tmpdir_new(), *path = test_path_join(dir, "s.h5");
    CheckpointState s = {.last_train_loss = NAN, .net = hook_layers_one(&STATELESS, layers, 1)};
    CU_ASSERT_EQUAL(checkpoint_save(path, &m, NULL, &s, &err), QT_OK);
    CheckpointNet net = hook_layers_one(&STATELESS, layers, 1);
    CU_ASSERT_EQUAL(checkpoint_load_model(path, &m, &net, &err), QT_OK);
    model_free(&m);
    free(path);
    test_tmpdir_remove(dir);
}

int hook_tests_add(CU_pSuite s) {
    return !CU_add_test(s, "hook kinds: every kind has the required entries", test_kinds_complete) ||
           !CU_add_test(s, "hook layers: a set per kind, adapters over the base, parameter order",
                        test_net_sets_and_order) ||
           !CU_add_test(s, "hook layers: the module table describes every kind's layers",
                        test_table_describes_every_kind) ||
           !CU_add_test(s, "hook layers: the module table says whether an unhooked module trains",
                        test_table_unhooked_modules) ||
           !CU_add_test(s, "hook layers: a new kind is saved, staged and restored unnamed",
                        test_new_kind_through_checkpoints) ||
           !CU_add_test(s, "hook layers: one kind replaces a module's op; a kind without a rule is placed",
                        test_specs_checked_per_module) ||
           !CU_add_test(s, "hook layers: a kind without checkpoint state is skipped by checkpoints",
                        test_stateless_kind_skipped_by_checkpoints);
}
