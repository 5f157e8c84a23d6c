/* test_lora_bn.c - batch norm under adapters and in QT mode, end to end on
 * the mini data set: lora.batchnorm frozen (the base's running statistics,
 * never updated, affine frozen) and train (as a float run, kept in
 * adapters.h5), a batch norm listed in lora.trainable, the rules table,
 * adapters.h5 reloading to the same model, merge, resume; QT training of a
 * batch-norm CNN and a residual one with the batch norms in float. */
#include <CUnit/CUnit.h>
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_runs.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "base/h5io.h"
#include "trainer/net.h"
#include "trainer/tools.h"
#include "trainer/train.h"

static TestRuns lbn;            /* the suite's directory; base_ckpt set per config (cfg) */
static char bn_base[1024];      /* tiny-bn.yaml trained in float: a base with one batch norm */
static char res_base[1024];     /* tiny-res.yaml trained in float: three batch norms, a residual add */

#define BN_LORA "lora.rules=[{module_path: conv1, rank: 4}]"
#define RES_LORA "lora.rules=[{module_path: \"conv.\", rank: 2}]"
#define SHIFTED "data.transform=[transpose, invert, {limit: 512}]" /* a new task: other batch statistics */
#define QT_RULES "quant.rules=[{module_path: \".*\", weight_qtype: int8, act_qtype: int8, bwd_qtype: int8, " \
                 "bwd_stochastic_rounding: uniform}]"

static int train_base(const char *path, const char *sub, char *out, size_t cap) {
    Config *c = test_runs_config(&lbn, path, sub, NULL, 0);
    TrainResult r;
    QtError err = {0};
    QtStatus st = c ? test_runs_train(c, NULL, 0, &r, &err) : QT_ERR_CONFIG;
    if (c && st != QT_OK) fprintf(stderr, "\n  %s: %s\n", path, err.msg);
    snprintf(out, cap, "%s/%s/final.h5", lbn.root, sub);
    free(c);
    return st == QT_OK ? 0 : -1;
}

static int lbn_init(void) {
    lbn.base_ckpt[0] = '\0';
    lbn.root = test_tmpdir_new();
    if (!lbn.root) return -1;
    return train_base("tests/configs/tiny-bn.yaml", "bn-base", bn_base, sizeof bn_base) ||
           train_base("tests/configs/tiny-res.yaml", "res-base", res_base, sizeof res_base) ? -1 : 0;
}

static int lbn_cleanup(void) { return test_runs_cleanup(&lbn); }

/* path under lbn.root/sub, from `base` (NULL: none), with the overrides; the test stops if it does not load. */
static Config *cfg(const char *base, const char *path, const char *sub, const char *const *extra, int n) {
    int len = snprintf(lbn.base_ckpt, sizeof lbn.base_ckpt, "%s", base ? base : "");
    CU_ASSERT_FATAL(len >= 0 && (size_t)len < sizeof lbn.base_ckpt);
    Config *c = test_runs_config(&lbn, path, sub, extra, n);
    lbn.base_ckpt[0] = '\0';
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    return c;
}

static void train_ok(const Config *c, const char *resume, int64_t stop_at, TrainResult *r) {
    QtError err = {0};
    QtStatus st = test_runs_train(c, resume, stop_at, r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", c->run.out_dir, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

static const Module *find(const Net *n, const char *path) {
    const Module *m = model_find_module((Model *)&n->model, path);
    CU_ASSERT_PTR_NOT_NULL_FATAL(m);
    return m;
}

static bool same_floats(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

/* Batch norm `path` of nets a and b: the same running statistics and count, bit for bit. */
static bool same_stats(const Net *a, const Net *b, const char *path) {
    const Module *x = find(a, path), *y = find(b, path);
    size_t c = (size_t)x->in_shape[0];
    return same_floats(x->running_mean, y->running_mean, c) && same_floats(x->running_var, y->running_var, c) &&
           x->num_batches_tracked == y->num_batches_tracked;
}

static bool same_param(const Net *a, const Net *b, const char *name) {
    const Param *p = model_find_param((Model *)&a->model, name), *q = model_find_param((Model *)&b->model, name);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    CU_ASSERT_PTR_NOT_NULL_FATAL(q);
    return same_floats(p->var.value.data, q->var.value.data, var_numel(&p->var));
}

/* Everything that decides an evaluation: every float parameter, every trained tensor (adapters included) and
 * every batch norm's statistics, bit for bit. */
static void assert_same_net(const Net *a, const Net *b) {
    CU_ASSERT_EQUAL_FATAL(a->model.n_params, b->model.n_params);
    for (int i = 0; i < a->model.n_params; i++) {
        const Param *p = &a->model.params[i], *q = &b->model.params[i];
        if (p->released || q->released) continue;
        if (!same_floats(p->var.value.data, q->var.value.data, var_numel(&p->var))) {
            fprintf(stderr, "\n  %s differs\n", p->name);
            CU_FAIL("a parameter differs");
        }
    }
    CU_ASSERT_EQUAL_FATAL(a->n_trainable, b->n_trainable);
    for (int i = 0; i < a->n_trainable; i++) {
        const Param *p = a->trainable[i], *q = b->trainable[i];
        CU_ASSERT_STRING_EQUAL(p->name, q->name);
        if (!same_floats(p->var.value.data, q->var.value.data, var_numel(&p->var))) {
            fprintf(stderr, "\n  trained %s differs\n", p->name);
            CU_FAIL("a trained tensor differs");
        }
    }
    for (int i = 0; i < a->model.n_modules; i++)
        if (a->model.modules[i].running_mean && !same_stats(a, b, a->model.modules[i].path)) {
            fprintf(stderr, "\n  the running statistics of %s differ\n", a->model.modules[i].path);
            CU_FAIL("running statistics differ");
        }
}

/* The base checkpoint's model as a plain float net (the config `c` without its lora section). */
static void load_base(Net *n, const Config *c, const char *base) {
    Config *f = malloc(sizeof *f);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    *f = *c;
    f->lora.n_rules = f->lora.n_trainable = 0;
    f->model.init_from[0] = f->model.adapters_from[0] = '\0';
    test_runs_load_net(n, f, base);
    free(f);
}

/* c's net with model.adapters_from = the run's adapters.h5, over its init_from base. */
static void build_from_adapters(Net *n, const Config *c) {
    Config *f = malloc(sizeof *f);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    *f = *c;
    int len = snprintf(f->model.adapters_from, sizeof f->model.adapters_from, "%s/adapters.h5", c->run.out_dir);
    CU_ASSERT_FATAL(len > 0 && (size_t)len < sizeof f->model.adapters_from);
    QtError err = {0};
    QtStatus st = net_build(n, f, NET_FRESH, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    free(f);
}

/* The rules table of n (malloc'd). */
static char *table_of(const Net *n) {
    char *text = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&text, &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    net_print_table(n, out);
    fclose(out);
    return text;
}

/* The table's line of module `path` holds `what`. */
static bool row_has(const char *table, const char *path, const char *what) {
    char key[64];
    snprintf(key, sizeof key, "\n  %s ", path);
    const char *row = strstr(table, key);
    if (!row) return false;
    const char *end = strchr(row + 1, '\n');
    const char *hit = strstr(row, what);
    bool ok = hit && (!end || hit < end);
    if (!ok) fprintf(stderr, "\n  no '%s' in the row of %s:\n%s", what, path, table);
    return ok;
}

static char *path_in(const Config *c, const char *name) {
    static char buf[2][1200];
    static int k;
    k ^= 1;
    snprintf(buf[k], sizeof buf[k], "%s/%s", c->run.out_dir, name);
    return buf[k];
}

/* The base c started from (its base_path) and the run's final.h5. */
static void load_base_and_final(Net *base, Net *run, const Config *c, const char *base_path) {
    load_base(base, c, base_path);
    test_runs_load_net(run, c, path_in(c, "final.h5"));
}

/* Trains c from scratch (to a finite test loss), then load_base_and_final(). */
static void train_and_load(Net *base, Net *run, const Config *c, const char *base_path) {
    TrainResult r;
    train_ok(c, NULL, 0, &r);
    CU_ASSERT(isfinite(r.test_loss));
    load_base_and_final(base, run, c, base_path);
}

/* ---- lora.batchnorm: frozen ---------------------------------------------------- */

/* The default: the base's batch norm is part of the frozen base. The run leaves its statistics and affine
 * parameters bit for bit as the base has them, normalises with the running statistics in training too (a
 * training forward equals an eval forward), and adapters.h5 over the base is the run's model. */
static void test_frozen_is_the_base(void) {
    const char *ov[] = {BN_LORA, SHIFTED, "train.steps=20", "train.optimizer.lr=0.01"};
    Config *c = cfg(bn_base, "tests/configs/tiny-bn.yaml", "frozen", ov, 4);
    CU_ASSERT_EQUAL(c->lora.batchnorm, LORA_BN_FROZEN);
    Net base, run, from;
    train_and_load(&base, &run, c, bn_base);
    CU_ASSERT(same_stats(&base, &run, "bn1"));
    CU_ASSERT(same_param(&base, &run, "bn1/weight"));
    CU_ASSERT(same_param(&base, &run, "bn1/bias"));
    CU_ASSERT(find(&run, "bn1")->num_batches_tracked == 40); /* the base's 40 steps, none of the run's 20 */
    build_from_adapters(&from, c);
    assert_same_net(&run, &from);
    char *t = table_of(&run);
    CU_ASSERT(row_has(t, "bn1", "float (frozen), lora.batchnorm: frozen "));
    free(t);

    /* a training forward of the built net equals an eval forward: the running statistics, not the batch's */
    Module *bn = model_find_module(&from.model, "bn1");
    CU_ASSERT(bn->bn.frozen);
    CU_ASSERT(!bn->weight->trainable && !bn->bias->trainable);
    Arena arena;
    Tape tape;
    Rng rng;
    rng_init(&rng, 1, 0);
    CU_ASSERT_FATAL(arena_init(&arena, 1 << 20) == 0);
    CU_ASSERT_FATAL(tape_init(&tape, &arena, &rng, NULL) == QT_OK);
    const int shape[4] = {6, 1, 28, 28};
    float *out[2] = {NULL, NULL};
    size_t numel = 0;
    for (int mode = 0; mode < 2; mode++) {
        tape_reset(&tape);
        tape.training = mode == 0;
        Var *x = tape_new_var(&tape, 4, shape);
        CU_ASSERT_PTR_NOT_NULL_FATAL(x);
        for (size_t i = 0; i < var_numel(x); i++) x->value.data[i] = (float)((i * 37) % 101) / 101.0f;
        Var *y = model_forward(&from.model, &tape, x);
        CU_ASSERT_PTR_NOT_NULL_FATAL(y);
        numel = var_numel(y);
        out[mode] = malloc(numel * sizeof(float));
        memcpy(out[mode], y->value.data, numel * sizeof(float));
    }
    CU_ASSERT(same_floats(out[0], out[1], numel));
    CU_ASSERT(find(&from, "bn1")->num_batches_tracked == 40);
    free(out[0]), free(out[1]);
    tape_free(&tape);
    arena_free(&arena);
    net_free(&base), net_free(&run), net_free(&from);
    free(c);
}

/* ---- lora.batchnorm: train -------------------------------------------------------- */

/* The batch norms train as in a float run (statistics updated once a step, weight and bias by the optimizer),
 * are not folded under a quantized base, and adapters.h5 holds them, so the adapters over the base are the
 * run's model bit for bit. */
static void test_train_is_kept_in_adapters(void) {
    const char *ov[] = {RES_LORA, SHIFTED, "train.steps=20", "train.checkpoint_every=0", "lora.batchnorm=train"};
    Config *c = cfg(res_base, "tests/configs/tiny-res.yaml", "train", ov, 5);
    Net base, run, from;
    train_and_load(&base, &run, c, res_base);
    const char *bns[] = {"stem_bn", "bn1", "bn2"};
    for (int i = 0; i < 3; i++) {
        char w[64];
        snprintf(w, sizeof w, "%s/weight", bns[i]);
        CU_ASSERT(!same_stats(&base, &run, bns[i]));
        CU_ASSERT(!same_param(&base, &run, w));
        CU_ASSERT_EQUAL(find(&run, bns[i])->num_batches_tracked, find(&base, bns[i])->num_batches_tracked + 20);
        CU_ASSERT(!find(&run, bns[i])->bn.frozen);
    }
    CU_ASSERT(same_param(&base, &run, "stem/weight")); /* the rest of the base stays frozen */
    CU_ASSERT(same_param(&base, &run, "conv1/weight"));
    char *t = table_of(&run);
    CU_ASSERT(row_has(t, "bn2", "float (trained), lora.batchnorm: train "));
    free(t);
    /* adapters.h5: the batch norms' weights and statistics beside the adapters */
    H5ioFile f = H5IO_FILE_INIT;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(h5io_open(&f, path_in(c, "adapters.h5"), &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_kind(&f, "buffers/bn2/running_var"), H5IO_DATASET);
    CU_ASSERT_EQUAL(h5io_kind(&f, "params/stem_bn/bias"), H5IO_DATASET);
    CU_ASSERT_EQUAL(h5io_kind(&f, "params/stem/weight"), H5IO_MISSING);
    h5io_close(&f, NULL);
    build_from_adapters(&from, c);
    assert_same_net(&run, &from);
    net_free(&from);

    /* an adapters.h5 is continued under the lora.batchnorm it was written with */
    Config *g = cfg(res_base, "tests/configs/tiny-res.yaml", "train-frozen", ov, 4);
    snprintf(g->model.adapters_from, sizeof g->model.adapters_from, "%s", path_in(c, "adapters.h5"));
    CU_ASSERT_EQUAL(g->lora.batchnorm, LORA_BN_FROZEN);
    CU_ASSERT_EQUAL(net_build(&from, g, NET_FRESH, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "written with lora.batchnorm: train but this run has lora.batchnorm: frozen"));
    CU_ASSERT(test_msg_has(&err, "set lora.batchnorm: train"));

    /* under a quantized base (QLoRA) a batch norm that trains is not folded into the layer before it */
    const char *q[] = {"lora.rules=[{module_path: conv2, rank: 2}]", SHIFTED, "lora.batchnorm=train", "quant.mode=ptq",
                       "quant.rules=[{module_path: \".*\", weight_qtype: int8}]"};
    Config *p = cfg(res_base, "tests/configs/tiny-res.yaml", "qlora-train", q, 5);
    CU_ASSERT_EQUAL_FATAL(net_build(&from, p, NET_FRESH, &err), QT_OK);
    CU_ASSERT_EQUAL(find(&from, "bn1")->bn_folded, BN_FOLD_NONE);
    CU_ASSERT(!find(&from, "bn1")->bn.frozen);
    t = table_of(&from);
    CU_ASSERT(row_has(t, "bn1", "not folded: it trains (lora.batchnorm: train)"));
    free(t);
    net_free(&from);
    p->lora.batchnorm = LORA_BN_FROZEN; /* frozen, the same batch norm folds into conv1 */
    CU_ASSERT_EQUAL_FATAL(net_build(&from, p, NET_FRESH, &err), QT_OK);
    CU_ASSERT_NOT_EQUAL(find(&from, "bn1")->bn_folded, BN_FOLD_NONE);
    t = table_of(&from);
    CU_ASSERT(row_has(t, "bn2", "(frozen)")); /* conv2 has an adapter: bn2 stays, frozen */
    free(t);
    net_free(&from);
    net_free(&base), net_free(&run);
    free(c), free(g), free(p);
}

/* ---- a batch norm in lora.trainable ---------------------------------------------- */

/* lora.trainable means "train this module in full", so a batch norm listed there trains as in a float run
 * (batch statistics, running statistics updated, weight and bias) whatever lora.batchnorm says; the others stay
 * frozen. adapters.h5 keeps its statistics with its weights. */
static void test_trainable_bn_trains(void) {
    const char *ov[] = {RES_LORA, SHIFTED, "lora.trainable=[bn1]", "train.steps=20", "train.checkpoint_every=0"};
    Config *c = cfg(res_base, "tests/configs/tiny-res.yaml", "trainable", ov, 5);
    CU_ASSERT_EQUAL(c->lora.batchnorm, LORA_BN_FROZEN);
    Net base, run, from;
    train_and_load(&base, &run, c, res_base);
    CU_ASSERT(!same_stats(&base, &run, "bn1"));
    CU_ASSERT(!same_param(&base, &run, "bn1/weight"));
    CU_ASSERT(same_stats(&base, &run, "stem_bn"));
    CU_ASSERT(same_stats(&base, &run, "bn2"));
    CU_ASSERT(same_param(&base, &run, "bn2/weight"));
    char *t = table_of(&run);
    CU_ASSERT(row_has(t, "bn1", "float, trained in full (lora.trainable)"));
    CU_ASSERT(row_has(t, "bn2", "float (frozen), lora.batchnorm: frozen "));
    free(t);
    build_from_adapters(&from, c);
    assert_same_net(&run, &from);
    net_free(&base), net_free(&run), net_free(&from);
    free(c);
}

/* ---- resume and merge ------------------------------------------------------------- */

/* Stopped mid-epoch (16 steps an epoch on tiny-bn, ~21 on tiny-res) and resumed: the same model bit for bit
 * as a straight run, and the same metrics. */
static void assert_resume_exact(const char *base, const char *path, const char *sub, const char *const *ov, int n,
                                int64_t stop_at) {
    char straight[64], split[64];
    snprintf(straight, sizeof straight, "%s-straight", sub);
    snprintf(split, sizeof split, "%s-split", sub);
    Config *a = cfg(base, path, straight, ov, n), *b = cfg(base, path, split, ov, n);
    TrainResult ra, rb;
    train_ok(a, NULL, 0, &ra);
    train_ok(b, NULL, stop_at, &rb);
    CU_ASSERT(rb.stopped && rb.steps == stop_at);
    train_ok(b, "auto", 0, &rb);
    CU_ASSERT_EQUAL(rb.steps, ra.steps);
    CU_ASSERT_EQUAL(rb.test_loss, ra.test_loss);
    CU_ASSERT_EQUAL(rb.test_accuracy, ra.test_accuracy);
    char *ma = test_metrics_rows(a->run.out_dir), *mb = test_metrics_rows(b->run.out_dir);
    CU_ASSERT(ma && mb && strcmp(ma, mb) == 0);
    free(ma), free(mb);
    Net x, y;
    test_runs_load_net(&x, a, path_in(a, "final.h5"));
    test_runs_load_net(&y, b, path_in(b, "final.h5"));
    assert_same_net(&x, &y);
    net_free(&x), net_free(&y);
    free(a), free(b);
}

static void test_resume_exact(void) {
    const char *frozen[] = {BN_LORA, SHIFTED, "train.steps=24", "train.optimizer.lr=0.01"};
    assert_resume_exact(bn_base, "tests/configs/tiny-bn.yaml", "resume-frozen", frozen, 4, 11);
    /* the resumed half kept the batch norm frozen too: the base's statistics */
    Config *c = cfg(bn_base, "tests/configs/tiny-bn.yaml", "resume-frozen-split", frozen, 4);
    Net base, run;
    load_base_and_final(&base, &run, c, bn_base);
    CU_ASSERT(same_stats(&base, &run, "bn1"));
    net_free(&base), net_free(&run);
    free(c);
    const char *train[] = {RES_LORA, SHIFTED, "lora.batchnorm=train", "train.steps=30"};
    assert_resume_exact(res_base, "tests/configs/tiny-res.yaml", "resume-train", train, 4, 11);
}

/* qtrain merge folds the adapters into the convs; the batch norms (trained or frozen) go into the merged
 * checkpoint as the run has them, so it evaluates as the unmerged run up to float rounding. */
static void check_merge(const Config *c) {
    MergeReport rep;
    QtError err = {0};
    QtStatus st = tools_merge(path_in(c, "final.h5"), path_in(c, "merged.h5"), false, false, NULL, &rep, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT_EQUAL(rep.weight_rel_rmse, 0.0);
    CU_ASSERT(fabs(rep.test_loss_after - rep.test_loss_before) < 1e-4);
    CU_ASSERT(fabs(rep.test_accuracy_after - rep.test_accuracy_before) <= 0.002);
    Model a, b;
    CU_ASSERT_EQUAL_FATAL(model_init(&a, c->model.input_ndim, c->model.input_shape, c->model.layers,
                                     c->model.n_layers, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(model_init(&b, c->model.input_ndim, c->model.input_shape, c->model.layers,
                                     c->model.n_layers, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(path_in(c, "final.h5"), &a, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(path_in(c, "merged.h5"), &b, &err), QT_OK);
    for (int i = 0; i < a.n_modules; i++) {
        const Module *x = &a.modules[i], *y = &b.modules[i];
        if (!x->running_mean) continue;
        CU_ASSERT(same_floats(x->running_mean, y->running_mean, (size_t)x->in_shape[0]));
        CU_ASSERT(same_floats(x->running_var, y->running_var, (size_t)x->in_shape[0]));
        CU_ASSERT(same_floats(x->weight->var.value.data, y->weight->var.value.data, (size_t)x->in_shape[0]));
    }
    model_free(&a), model_free(&b);
}

static void test_merge_equals_unmerged(void) {
    const char *ov[] = {RES_LORA, SHIFTED, "train.steps=20", "train.checkpoint_every=0", "lora.batchnorm=train"};
    Config *c = cfg(res_base, "tests/configs/tiny-res.yaml", "merge-train", ov, 5);
    TrainResult r;
    train_ok(c, NULL, 0, &r);
    check_merge(c);
    Config *f = cfg(res_base, "tests/configs/tiny-res.yaml", "merge-frozen", ov, 4);
    train_ok(f, NULL, 0, &r);
    check_merge(f);
    free(c), free(f);
}

/* ---- the base identity ------------------------------------------------------------ */

/* scripts/base_sha256.py's hash of checkpoint `path` into hex; false (the test skipped) without Debian's python3
 * and h5py. */
static bool script_sha256(const char *path, const char *flags, char hex[SHA256_HEX_CHARS]) {
    if (system("/usr/bin/python3 -c 'import h5py, numpy' >/dev/null 2>&1") != 0) {
        test_skip("/usr/bin/python3 cannot import h5py and numpy (install python3-h5py python3-numpy): "
                  "scripts/base_sha256.py not checked");
        return false;
    }
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 scripts/base_sha256.py '%s'%s", path, flags);
    FILE *p = popen(cmd, "r");
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    bool ok = fgets(hex, SHA256_HEX_CHARS, p) != NULL;
    char rest[64];
    while (fgets(rest, sizeof rest, p)) { /* the newline: read to the end, so the script never writes to a closed pipe */
    }
    CU_ASSERT_EQUAL(pclose(p), 0);
    return ok;
}

/* A copy of adapters.h5 `src` at `dst` as an older qtrain wrote it: base_hash `scheme`, base_sha256 `hex`. */
static void write_old_adapters(const char *src, const char *dst, const char *scheme, const char *hex) {
    size_t size = 0;
    char *bytes = test_file_read(src, &size);
    CU_ASSERT_PTR_NOT_NULL_FATAL(bytes);
    test_file_write(dst, bytes, size);
    free(bytes);
    H5ioFile f = {H5Fopen(dst, H5F_ACC_RDWR, H5P_DEFAULT), (char *)dst, true};
    CU_ASSERT_FATAL(f.id >= 0);
    CU_ASSERT(H5Adelete_by_name(f.id, "/", "base_hash", H5P_DEFAULT) >= 0);
    CU_ASSERT(H5Adelete_by_name(f.id, "/", "base_sha256", H5P_DEFAULT) >= 0);
    QtError err = {0};
    CU_ASSERT_EQUAL(h5io_attr_write_str(&f, "", "base_hash", scheme, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_attr_write_str(&f, "", "base_sha256", hex, &err), QT_OK);
    CU_ASSERT(H5Fclose(f.id) >= 0);
}

/* What net_check_adapters_base says about `path` over n (malloc'd; "" when nothing). */
static char *adapters_check_says(const Net *n, const char *path) {
    FILE *w = tmpfile();
    CU_ASSERT_PTR_NOT_NULL_FATAL(w);
    QtError err = {0};
    CU_ASSERT_EQUAL(net_check_adapters_base(n, path, w, &err), QT_OK);
    char *out = calloc(4096, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    rewind(w);
    size_t got = fread(out, 1, 4095, w);
    out[got] = '\0';
    fclose(w);
    return out;
}

/* adapters.h5 of an older qtrain names scheme v1, whose hash leaves out the frozen batch norms' statistics: over
 * the very same base it loads without a word; a v1 hash under the v2 name is another base. */
static void check_v1_adapters(const Config *c, const Net *n) {
    char v1[SHA256_HEX_CHARS], v2[SHA256_HEX_CHARS];
    CheckpointNet parts = net_checkpoint_parts(n);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_base_sha256_v1(&n->model, &parts, v1, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(checkpoint_base_sha256(&n->model, &parts, v2, &err), QT_OK);
    CU_ASSERT_STRING_NOT_EQUAL(v1, v2); /* the batch norm's statistics are in v2 only */
    char script[SHA256_HEX_CHARS];
    if (script_sha256(path_in(c, "final.h5"), " --v1", script)) CU_ASSERT_STRING_EQUAL(script, v1);
    char old[1200], src[1200];
    snprintf(old, sizeof old, "%s", path_in(c, "v1-adapters.h5"));
    snprintf(src, sizeof src, "%s", path_in(c, "adapters.h5"));
    write_old_adapters(src, old, CHECKPOINT_BASE_HASH_V1, v1);
    char *said = adapters_check_says(n, old);
    CU_ASSERT_STRING_EQUAL(said, "");
    free(said);
    write_old_adapters(src, old, CHECKPOINT_BASE_HASH, v1);
    said = adapters_check_says(n, old);
    CU_ASSERT(strstr(said, "another base") && strstr(said, v1) && strstr(said, v2));
    free(said);
}

/* A frozen batch norm's running statistics belong to the frozen base, so its identity covers them (adapters
 * over a base with other statistics are found out); a trained one's are the run's, as its weights are. The
 * script recomputes the identity from the file either way. */
static void test_base_identity(void) {
    const char *f_ov[] = {BN_LORA, SHIFTED, "train.steps=8"};
    const char *t_ov[] = {RES_LORA, SHIFTED, "train.steps=8", "train.checkpoint_every=0", "lora.batchnorm=train"};
    Config *f = cfg(bn_base, "tests/configs/tiny-bn.yaml", "id-frozen", f_ov, 3);
    Config *t = cfg(res_base, "tests/configs/tiny-res.yaml", "id-train", t_ov, 5);
    const Config *cs[2] = {f, t};
    const char *bn_of[2] = {"bn1", "bn2"};
    for (int k = 0; k < 2; k++) {
        TrainResult r;
        train_ok(cs[k], NULL, 0, &r);
        CheckpointProvenance *p = malloc(sizeof *p);
        CU_ASSERT_PTR_NOT_NULL_FATAL(p);
        QtError err = {0};
        CU_ASSERT_EQUAL_FATAL(checkpoint_read_provenance(path_in(cs[k], "final.h5"), p, &err), QT_OK);
        Net n;
        test_runs_load_net(&n, cs[k], path_in(cs[k], "final.h5"));
        CheckpointNet parts = net_checkpoint_parts(&n);
        char mine[SHA256_HEX_CHARS], other[SHA256_HEX_CHARS], script[SHA256_HEX_CHARS];
        CU_ASSERT_EQUAL(checkpoint_base_sha256(&n.model, &parts, mine, &err), QT_OK);
        CU_ASSERT_STRING_EQUAL(mine, p->base_sha256);
        if (script_sha256(path_in(cs[k], "final.h5"), "", script)) CU_ASSERT_STRING_EQUAL(script, mine);
        if (k == 0) check_v1_adapters(cs[k], &n);
        model_find_module(&n.model, bn_of[k])->running_var[0] *= 2.0f;
        CU_ASSERT_EQUAL(checkpoint_base_sha256(&n.model, &parts, other, &err), QT_OK);
        if (k == 0) CU_ASSERT_STRING_NOT_EQUAL(other, mine); /* frozen: part of the base */
        if (k == 1) CU_ASSERT_STRING_EQUAL(other, mine);     /* trained: the run's */
        net_free(&n);
        free(p);
    }
    free(f), free(t);
}

/* ---- QT: batch norm in float between quantized GEMMs --------------------------- */

/* The train rows' losses of a run's metrics.csv: first and last, all finite. */
static void train_losses(const char *dir, double *first, double *last) {
    char path[1200];
    snprintf(path, sizeof path, "%s/metrics.csv", dir);
    char *text = test_file_read(path, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    int n = 0;
    *first = *last = NAN;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        long step;
        double epoch, loss;
        if (sscanf(line, "train,%ld,%lf,%lf", &step, &epoch, &loss) != 3) continue;
        CU_ASSERT(isfinite(loss));
        if (n++ == 0) *first = loss;
        *last = loss;
    }
    CU_ASSERT(n >= 3);
    free(text);
}

static void check_qt(const char *path, const char *sub, const char *const *bns, int n_bn, const char *conv) {
    const char *ov[] = {"quant.mode=qt", QT_RULES};
    Config *c = cfg(NULL, path, sub, ov, 2);
    TrainResult r;
    train_ok(c, NULL, 0, &r);
    CU_ASSERT_STRING_EQUAL(r.mode, "qt");
    double first, last;
    train_losses(c->run.out_dir, &first, &last);
    CU_ASSERT(last < first);
    CU_ASSERT(isfinite(r.test_loss) && r.test_loss < 2.3);
    Net n;
    test_runs_load_net(&n, c, path_in(c, "final.h5"));
    char *t = table_of(&n);
    for (int i = 0; i < n_bn; i++) {
        CU_ASSERT(row_has(t, bns[i], "float (trained)"));
        CU_ASSERT(find(&n, bns[i])->num_batches_tracked == 40);
    }
    CU_ASSERT(row_has(t, conv, "qt int8"));
    free(t);
    net_free(&n);
    free(c);
    char rsub[64];
    snprintf(rsub, sizeof rsub, "%s-resume", sub);
    assert_resume_exact(NULL, path, rsub, ov, 2, 11);
}

static void test_qt_bn(void) {
    const char *bns[] = {"bn1"};
    check_qt("tests/configs/tiny-bn.yaml", "qt-bn", bns, 1, "conv1");
}

static void test_qt_residual(void) {
    const char *bns[] = {"stem_bn", "bn1", "bn2"};
    check_qt("tests/configs/tiny-res.yaml", "qt-res", bns, 3, "conv2");
}

int register_lora_bn_suite(void) {
    CU_pSuite s = CU_add_suite("lora_bn", lbn_init, lbn_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "lora.batchnorm frozen: the base's statistics, never updated; adapters.h5 reloads",
                        test_frozen_is_the_base) ||
           !CU_add_test(s, "lora.batchnorm train: statistics and affine trained, kept in adapters.h5, not folded",
                        test_train_is_kept_in_adapters) ||
           !CU_add_test(s, "a batch norm in lora.trainable trains in full", test_trainable_bn_trains) ||
           !CU_add_test(s, "resume mid-epoch bit-exact, frozen and train", test_resume_exact) ||
           !CU_add_test(s, "merge evaluates as unmerged, frozen and train", test_merge_equals_unmerged) ||
           !CU_add_test(s, "base identity: a frozen batch norm's statistics in, a trained one's out; the script "
                        "agrees", test_base_identity) ||
           !CU_add_test(s, "qt: batch-norm CNN trains, float batch norm, resume exact", test_qt_bn) ||
           !CU_add_test(s, "qt: residual CNN trains, float batch norms, resume exact", test_qt_residual);
}
