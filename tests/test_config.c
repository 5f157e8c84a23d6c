/* test_config.c - the YAML config loader: values and defaults, --set
 * overrides, the resolved YAML round trip, and one test per class of error,
 * each checking that the message names the place (line:col or --set) and
 * the key path. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/config.h"

#define NAME "t.yaml"

/* A valid model (lines 1-5) that error tests append their section to. */
#define MLP                 \
    "model:\n"              \
    "  input: [1, 4, 4]\n"  \
    "  layers:\n"           \
    "    - {type: flatten}\n" \
    "    - {type: dense, units: 3}\n"

static QtStatus load(Config *c, const char *text, const char *const *ov, int n_ov, QtError *e) {
    qt_error_clear(e);
    QtStatus st = config_load_string(c, text, NAME, ov, n_ov, e);
    if (st != QT_OK) fprintf(stderr, "\n  unexpected config error: %s\n", e->msg);
    return st;
}

/* Loads text with overrides expecting status `want` and a message holding every needle (NULL-terminated). */
static void expect_error_at(int line, const char *text, const char *const *ov, int n_ov, QtStatus want, ...) {
    Config c;
    QtError e = {0};
    QtStatus st = config_load_string(&c, text, NAME, ov, n_ov, &e);
    bool ok = st == want;
    va_list ap;
    va_start(ap, want);
    for (const char *needle; (needle = va_arg(ap, const char *)) != NULL;)
        ok = ok && strstr(e.msg, needle) != NULL;
    va_end(ap);
    if (!ok) fprintf(stderr, "\n  %s:%d: status %d (want %d), message: %s\n", __FILE__, line, st, want, e.msg);
    CU_assertImplementation(ok, (unsigned)line, "config error as expected", __FILE__, "", CU_FALSE);
}
#define EXPECT_ERR(text, ...) expect_error_at(__LINE__, text, NULL, 0, QT_ERR_CONFIG, __VA_ARGS__, (const char *)NULL)
#define EXPECT_SET_ERR(text, ov, ...) \
    expect_error_at(__LINE__, text, (const char *const[]){ov}, 1, QT_ERR_CONFIG, __VA_ARGS__, (const char *)NULL)

/* ---- values ------------------------------------------------------------------- */

static const char *const FULL =
    "run:\n"
    "  name: full\n"
    "  out_dir: /tmp/qtrain-full\n"
    "  seed: 18446744073709551615\n"
    "  threads: 2\n"
    "data:\n"
    "  dataset: Fashion-MNIST\n"
    "  dir: /data/fm\n"
    "  transform:\n"
    "    - transpose\n"
    "    - invert\n"
    "    - normalize\n"
    "    - {normalize: {mean: 0.286, std: 0.353}}\n"
    "    - {classes: [0, 2, 4]}\n"
    "    - {limit: 1000}\n"
    "  val_fraction: 0.1\n"
    "  shuffle: no\n"
    "  drop_last: On\n"
    "model:\n"
    "  input: [3, 8, 8]\n"
    "  layers:\n"
    "    - {name: conv1, type: conv2d, out_channels: 4, kernel: 3, stride: 1, padding: 1, bias: false,\n"
    "       init: normal, init_std: 0.05}\n"
    "    - {type: gelu}\n"
    "    - {name: pool, type: avgpool2d, kernel: 2, stride: 2}\n"
    "    - {type: flatten}\n"
    "    - {type: layernorm, eps: 1e-6}\n"
    "    - {type: dropout, p: 0.25}\n"
    "    - {name: head, type: dense, units: 5, bias: true, init: xavier_uniform}\n"
    "  init_from: runs/pre/ckpt.h5\n"
    "train:\n"
    "  epochs: 3\n"
    "  steps: 100\n"
    "  batch_size: 8\n"
    "  eval_batch_size: 128\n"
    "  optimizer:\n"
    "    name: adamw\n"
    "    lr: 3e-4\n"
    "    weight_decay: 0.05\n"
    "    betas: [0.8, 0.95]\n"
    "    eps: 1e-7\n"
    "  schedule:\n"
    "    name: step\n"
    "    warmup_steps: 10\n"
    "    step_size: 30\n"
    "    gamma: 0.5\n"
    "  grad_clip: 2.5\n"
    "  eval_every: 25\n"
    "  log_every: 10\n"
    "  checkpoint_every: 50\n"
    "  keep_last: 0\n"
    "quant:\n"
    "  mode: none\n"
    "lora:\n";

static void test_full_config(void) {
    Config c;
    QtError e;
    CU_ASSERT_EQUAL_FATAL(load(&c, FULL, NULL, 0, &e), QT_OK);
    CU_ASSERT_STRING_EQUAL(c.source, NAME);
    CU_ASSERT_STRING_EQUAL(c.run.name, "full");
    CU_ASSERT_STRING_EQUAL(c.run.out_dir, "/tmp/qtrain-full");
    CU_ASSERT_EQUAL(c.run.seed, UINT64_MAX);
    CU_ASSERT_EQUAL(c.run.threads, 2);
    CU_ASSERT_STRING_EQUAL(c.data.dataset, "fashion-mnist"); /* the canonical spelling */
    CU_ASSERT_STRING_EQUAL(c.data.dir, "/data/fm");
    CU_ASSERT_EQUAL_FATAL(c.data.n_transforms, 6);
    const Transform *t = c.data.transforms;
    CU_ASSERT_EQUAL(t[0].kind, TRANSFORM_TRANSPOSE);
    CU_ASSERT_EQUAL(t[1].kind, TRANSFORM_INVERT);
    CU_ASSERT(t[2].kind == TRANSFORM_NORMALIZE && !t[2].stats_given);
    CU_ASSERT(t[3].kind == TRANSFORM_NORMALIZE && t[3].stats_given);
    CU_ASSERT(t[3].mean == 0.286f && t[3].std == 0.353f);
    CU_ASSERT(t[4].kind == TRANSFORM_CLASSES && t[4].n_classes == 3);
    CU_ASSERT(t[4].classes[0] == 0 && t[4].classes[1] == 2 && t[4].classes[2] == 4);
    CU_ASSERT(t[5].kind == TRANSFORM_LIMIT && t[5].limit == 1000);
    CU_ASSERT_EQUAL(c.data.val_fraction, 0.1);
    CU_ASSERT(!c.data.shuffle && c.data.drop_last);

    CU_ASSERT(c.model.input_ndim == 3 && c.model.input_shape[0] == 3 && c.model.input_shape[2] == 8);
    CU_ASSERT_EQUAL_FATAL(c.model.n_layers, 7);
    const LayerSpec *l = c.model.layers;
    CU_ASSERT(l[0].type == LAYER_CONV2D && strcmp(l[0].name, "conv1") == 0);
    CU_ASSERT(l[0].out_channels == 4 && l[0].kernel == 3 && l[0].stride == 1 && l[0].padding == 1);
    CU_ASSERT(l[0].no_bias && l[0].init == INIT_NORMAL && l[0].init_std == 0.05f);
    CU_ASSERT(l[1].type == LAYER_GELU && strcmp(l[1].name, "gelu1") == 0); /* automatic name, written down */
    CU_ASSERT(l[2].type == LAYER_AVGPOOL2D && l[2].kernel == 2 && l[2].stride == 2);
    CU_ASSERT(l[4].type == LAYER_LAYERNORM && l[4].eps == 1e-6f);
    CU_ASSERT(l[5].type == LAYER_DROPOUT && l[5].p == 0.25f);
    CU_ASSERT(l[6].units == 5 && !l[6].no_bias && l[6].init == INIT_XAVIER_UNIFORM);
    CU_ASSERT_STRING_EQUAL(c.model.init_from, "runs/pre/ckpt.h5");

    const TrainConfig *tr = &c.train;
    CU_ASSERT(tr->epochs == 3 && tr->steps == 100 && tr->batch_size == 8 && tr->eval_batch_size == 128);
    CU_ASSERT(tr->optim.kind == OPTIM_ADAMW && tr->optim.lr == 3e-4f && tr->optim.weight_decay == 0.05f);
    CU_ASSERT(tr->optim.beta1 == 0.8f && tr->optim.beta2 == 0.95f && tr->optim.eps == 1e-7f);
    CU_ASSERT(tr->schedule.kind == SCHED_STEP && tr->schedule.warmup_steps == 10);
    CU_ASSERT(tr->schedule.step_size == 30 && tr->schedule.gamma == 0.5f);
    CU_ASSERT(tr->schedule.base_lr == 0.0f && tr->schedule.total_steps == 0); /* the trainer's to fill */
    CU_ASSERT(tr->grad_clip == 2.5f && tr->eval_every == 25 && tr->log_every == 10);
    CU_ASSERT(tr->checkpoint_every == 50 && tr->keep_last == 0);
}

static void test_defaults(void) {
    Config c, d;
    QtError e;
    CU_ASSERT_EQUAL_FATAL(load(&c, "model: {input: [784], layers: [{type: dense, units: 10}]}\n", NULL, 0, &e),
                          QT_OK);
    CU_ASSERT_STRING_EQUAL(c.run.name, "run");
    CU_ASSERT_STRING_EQUAL(c.run.out_dir, "runs/run");
    CU_ASSERT(c.run.seed == 1 && c.run.threads == 0);
    CU_ASSERT_STRING_EQUAL(c.data.dataset, "fashion-mnist");
    CU_ASSERT_STRING_EQUAL(c.data.dir, "/usr/share/datasets/fashion-mnist");
    CU_ASSERT(c.data.n_transforms == 0 && c.data.val_fraction == 0.0 && c.data.shuffle && !c.data.drop_last);
    CU_ASSERT(c.model.input_ndim == 1 && c.model.input_shape[0] == 784 && c.model.init_from[0] == '\0');
    CU_ASSERT_STRING_EQUAL(c.model.layers[0].name, "dense0");
    CU_ASSERT(!c.model.layers[0].no_bias && c.model.layers[0].init == INIT_DEFAULT);
    const TrainConfig *t = &c.train;
    CU_ASSERT(t->epochs == 1 && t->steps == 0 && t->batch_size == 64 && t->eval_batch_size == 256);
    OptimConfig od = optim_config_default(OPTIM_ADAMW);
    CU_ASSERT(t->optim.kind == OPTIM_ADAMW && t->optim.lr == od.lr && t->optim.weight_decay == od.weight_decay);
    CU_ASSERT(t->optim.beta1 == od.beta1 && t->optim.beta2 == od.beta2 && t->optim.eps == od.eps);
    CU_ASSERT(t->schedule.kind == SCHED_CONSTANT && t->schedule.warmup_steps == 0 && t->schedule.min_lr == 0.0f);
    CU_ASSERT(t->schedule.gamma == 0.1f && t->schedule.step_size == 0);
    CU_ASSERT(t->grad_clip == 0.0f && t->eval_every == 0 && t->log_every == 50 && t->checkpoint_every == 0);
    CU_ASSERT_EQUAL(t->keep_last, 3);

    /* out_dir follows the name; layer defaults are resolved into the struct. */
    const char *text = "run: {name: exp7}\n"
                       "model:\n"
                       "  input: [2, 8, 8]\n"
                       "  layers:\n"
                       "    - {type: conv2d, out_channels: 2, kernel: 3, init: normal}\n"
                       "    - {type: maxpool2d, kernel: 2}\n"
                       "    - {type: flatten}\n"
                       "    - {type: layernorm}\n"
                       "    - {type: dropout}\n";
    CU_ASSERT_EQUAL_FATAL(load(&c, text, NULL, 0, &e), QT_OK);
    CU_ASSERT_STRING_EQUAL(c.run.out_dir, "runs/exp7");
    const LayerSpec *l = c.model.layers;
    CU_ASSERT(l[0].stride == 1 && l[0].padding == 0 && l[0].init_std == 0.02f);
    CU_ASSERT(l[1].stride == 2 && strcmp(l[1].name, "maxpool2d1") == 0);
    CU_ASSERT(l[3].eps == 1e-5f && l[4].p == 0.5f);

    /* config_default is the loader's starting point, byte for byte. */
    config_default(&d);
    CU_ASSERT_STRING_EQUAL(d.run.out_dir, "runs/run");
    CU_ASSERT(d.train.optim.lr == od.lr && d.train.log_every == 50 && d.model.n_layers == 0);
}

static void test_optimizer_key_order(void) {
    const char *lr_first = MLP "train:\n  optimizer:\n    lr: 0.5\n    momentum: 0.9\n    name: sgd\n";
    const char *name_first = MLP "train:\n  optimizer: {name: SGD, momentum: 0.9, lr: 0.5}\n";
    Config a, b;
    QtError e;
    CU_ASSERT_EQUAL_FATAL(load(&a, lr_first, NULL, 0, &e), QT_OK);
    CU_ASSERT_EQUAL_FATAL(load(&b, name_first, NULL, 0, &e), QT_OK);
    CU_ASSERT_EQUAL(memcmp(&a, &b, sizeof a), 0);
    OptimConfig sgd = optim_config_default(OPTIM_SGD);
    CU_ASSERT(a.train.optim.kind == OPTIM_SGD && a.train.optim.lr == 0.5f && a.train.optim.momentum == 0.9f);
    CU_ASSERT(a.train.optim.weight_decay == sgd.weight_decay && a.train.optim.dampening == sgd.dampening);
    CU_ASSERT(!a.train.optim.nesterov);
    /* lr's default is the chosen kind's, not adamw's. */
    CU_ASSERT_EQUAL_FATAL(load(&a, MLP "train: {optimizer: {name: sgd}}\n", NULL, 0, &e), QT_OK);
    CU_ASSERT_EQUAL(a.train.optim.lr, sgd.lr);
}

static void test_steps_and_epochs(void) {
    Config c;
    QtError e;
    CU_ASSERT_EQUAL_FATAL(load(&c, MLP "train: {epochs: 5, steps: 300}\n", NULL, 0, &e), QT_OK);
    CU_ASSERT(c.train.epochs == 5 && c.train.steps == 300);
    CU_ASSERT_EQUAL_FATAL(load(&c, MLP "train: {epochs: 0}\n", NULL, 0, &e), QT_OK);
    CU_ASSERT(c.train.epochs == 0 && c.train.steps == 0);
}

static void test_booleans_and_nulls(void) {
    const char *yes[] = {"true", "True", "YES", "on"}, *no[] = {"false", "No", "OFF", "no"};
    for (int i = 0; i < 4; i++) {
        char text[256];
        Config c;
        QtError e;
        snprintf(text, sizeof text, MLP "data: {shuffle: %s, drop_last: %s}\n", no[i], yes[i]);
        CU_ASSERT_EQUAL_FATAL(load(&c, text, NULL, 0, &e), QT_OK);
        CU_ASSERT(!c.data.shuffle && c.data.drop_last);
    }
    EXPECT_ERR(MLP "data:\n  shuffle: y\n", NAME ":7:12:", "data.shuffle", "true or false", "\"y\"");
    EXPECT_ERR(MLP "data:\n  shuffle: \"true\"\n", ":7:12:", "data.shuffle", "quoted string");
    /* null keeps the default, for keys and whole sections. */
    Config c;
    QtError e;
    CU_ASSERT_EQUAL_FATAL(load(&c, MLP "run:\ntrain:\n  batch_size: ~\n  keep_last: null\n", NULL, 0, &e), QT_OK);
    CU_ASSERT(c.train.batch_size == 64 && c.train.keep_last == 3);
}

/* ---- the resolved YAML ------------------------------------------------------------ */

static void check_round_trip(const Config *a) {
    char *text = config_to_yaml(a);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    Config b;
    QtError e = {0};
    QtStatus st = config_load_string(&b, text, a->source, NULL, 0, &e);
    if (st != QT_OK) fprintf(stderr, "\n  reloading the resolved YAML: %s\n%s", e.msg, text);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT_EQUAL(memcmp(a, &b, sizeof b), 0);
    char *again = config_to_yaml(&b);
    CU_ASSERT_PTR_NOT_NULL_FATAL(again);
    CU_ASSERT_STRING_EQUAL(text, again);
    free(again);
    free(text);
}

static void test_to_yaml_round_trip(void) {
    const char *files[] = {"tests/configs/tiny-cnn.yaml", "tests/configs/tiny-mlp.yaml"};
    for (int i = 0; i < 2; i++) {
        Config c;
        QtError e = {0};
        QtStatus st = config_load(&c, files[i], NULL, 0, &e);
        if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        check_round_trip(&c);
    }
    Config c;
    QtError e;
    CU_ASSERT_EQUAL_FATAL(load(&c, FULL, NULL, 0, &e), QT_OK);
    check_round_trip(&c);
    /* Strings that need quoting, an sgd and a cosine schedule, odd floats. */
    const char *odd = "run: {name: odd, out_dir: 'my run: #1 \"q\" \\\\'}\n"
                      "data: {dir: 'yes', val_fraction: 0.3}\n"
                      "model:\n"
                      "  input: [16]\n"
                      "  layers:\n"
                      "    - {name: '123', type: dense, units: 3, init: normal, init_std: 0.1}\n"
                      "  init_from: 'true'\n"
                      "train:\n"
                      "  steps: 50\n"
                      "  optimizer: {name: sgd, lr: 0.1, momentum: 0.9, dampening: 0.1, weight_decay: 1e-5}\n"
                      "  schedule: {name: cosine, warmup_steps: 5, min_lr: 1.17549435e-38}\n"
                      "  grad_clip: 3.40282347e38\n";
    CU_ASSERT_EQUAL_FATAL(load(&c, odd, NULL, 0, &e), QT_OK);
    CU_ASSERT_STRING_EQUAL(c.run.out_dir, "my run: #1 \"q\" \\\\");
    CU_ASSERT_STRING_EQUAL(c.model.layers[0].name, "123");
    check_round_trip(&c);
    /* The text itself: every section and key, defaults filled in, readable. */
    char *text = config_to_yaml(&c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    const char *want[] = {
        "  out_dir: \"my run: #1 \\\"q\\\" \\\\\\\\\"\n",
        "  seed: 1\n",
        "  dir: \"yes\"\n",
        "  transform: []\n",
        "  val_fraction: 0.3\n",
        "    - {name: \"123\", type: dense, units: 3, bias: true, init: normal, init_std: 0.1}\n",
        "  init_from: \"true\"\n",
        "    lr: 0.1\n",
        "    weight_decay: 1e-05\n",
        "    nesterov: false\n",
        "    min_lr: 1.1754944e-38\n", /* the shortest text that reads back exactly */
        "  grad_clip: 3.4028235e+38\n",
        "  keep_last: 3\n",
        "quant:\n  mode: none\n  calibration_batches: 16\n  fold_bn: true\n  freeze_bn_after: 0\n  rules: []\nlora:\n"
        "  rules: []\n  trainable: []\n"
        "  strict_base: false\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        if (!strstr(text, want[i])) fprintf(stderr, "\n  missing %s in:\n%s", want[i], text);
        CU_ASSERT_PTR_NOT_NULL(strstr(text, want[i]));
    }
    free(text);
}

/* ---- errors: YAML ----------------------------------------------------------------- */

static void test_yaml_errors(void) {
    EXPECT_ERR("model:\n  input: [1, 2\n  layers: []\n", NAME ":3:9:", "invalid YAML", "flow sequence");
    EXPECT_ERR("model:\n  input: [1]\n   layers: x\n", NAME ":3:4:", "invalid YAML");
    EXPECT_ERR("model:\n\tinput: [1]\n", NAME ":2:1:", "tabs");
    EXPECT_ERR(MLP "train:\n  batch_size: 3\n  steps: 4\n  batch_size: 4\n", NAME ":9:3:", "train.batch_size",
               "duplicate key", "7:3");
    EXPECT_ERR("", NAME ":1:1:", "empty");
    EXPECT_ERR("# nothing but a comment\n\n", "empty");
    EXPECT_ERR(MLP "---\n" MLP, NAME ":6:1:", "second YAML document");
    EXPECT_ERR("- model\n- train\n", NAME ":1:1:", "mapping of sections", "got a sequence");
    EXPECT_ERR("just words\n", NAME ":1:1:", "mapping of sections");
    EXPECT_ERR(MLP "train: &t {steps: 3}\n", NAME ":6:8:", "train", "anchors");
    EXPECT_ERR(MLP "run: {name: !!str x}\n", NAME ":6:13:", "run.name", "tags");
    EXPECT_ERR(MLP "train:\n  ? [a, b]\n  : 1\n", NAME ":7:5:", "train", "mapping keys");
    EXPECT_ERR(MLP "run: {name: \"a\xc3\x28\"}\n", NAME ":6:", "UTF-8");
}

/* ---- errors: values --------------------------------------------------------------- */

static void test_type_errors(void) {
    EXPECT_ERR(MLP "train:\n  optimizer:\n    lr: fast\n", NAME ":8:9:", "train.optimizer.lr",
               "expected a finite number >= 0", "got \"fast\"");
    EXPECT_ERR(MLP "train:\n  batch_size: 1.5\n", NAME ":7:15:", "train.batch_size", "expected an integer",
               "\"1.5\"");
    EXPECT_ERR(MLP "train:\n  batch_size: \"32\"\n", NAME ":7:15:", "train.batch_size", "quoted string \"32\"");
    EXPECT_ERR(MLP "train:\n  epochs: [1, 2]\n", NAME ":7:11:", "train.epochs", "got a sequence");
    EXPECT_ERR(MLP "run:\n  name: {a: 1}\n", NAME ":7:9:", "run.name", "expected a string", "got a mapping");
    EXPECT_ERR(MLP "train: 5\n", NAME ":6:8:", "train", "expected a mapping");
    EXPECT_ERR(MLP "train:\n  steps: 99999999999999999999\n", NAME ":7:10:", "train.steps", "too large");
    EXPECT_ERR(MLP "run:\n  threads: 3000000000\n", NAME ":7:12:", "run.threads", "in [0, 4096]");
    EXPECT_ERR(MLP "run:\n  seed: -1\n", NAME ":7:9:", "run.seed", "an integer in [0, 18446744073709551615]");
    EXPECT_ERR(MLP "run:\n  seed: 18446744073709551616\n", NAME ":7:9:", "run.seed");
    EXPECT_ERR(MLP "train:\n  grad_clip: 1e39\n", NAME ":7:14:", "train.grad_clip", "too large for a float");
    EXPECT_ERR(MLP "train:\n  optimizer:\n    betas: [0.9]\n", NAME ":8:12:", "train.optimizer.betas",
               "two numbers");
    EXPECT_ERR(MLP "train:\n  optimizer:\n    betas: [0.9, x]\n", NAME ":8:18:", "train.optimizer.betas[1]");
    EXPECT_ERR("model:\n  input: [1, 28]\n  layers: [{type: flatten}]\n", NAME ":2:10:", "model.input",
               "1 or 3 integers", "sequence of 2");
    EXPECT_ERR("model:\n  input: [1, 0, 28]\n  layers: [{type: flatten}]\n", NAME ":2:14:", "model.input[1]",
               "an integer in [1, 65536]");
}

static void test_range_errors(void) {
    EXPECT_ERR(MLP "train:\n  batch_size: 0\n", NAME ":7:15:", "train.batch_size", "in [1, 1048576]", "got \"0\"");
    EXPECT_ERR(MLP "train:\n  eval_batch_size: -4\n", NAME ":7:20:", "train.eval_batch_size");
    EXPECT_ERR(MLP "train:\n  optimizer: {lr: -0.1}\n", NAME ":7:19:", "train.optimizer.lr", ">= 0");
    EXPECT_ERR(MLP "train:\n  optimizer: {lr: .nan}\n", NAME ":7:19:", "train.optimizer.lr", "finite");
    EXPECT_ERR(MLP "train:\n  optimizer: {lr: .inf}\n", NAME ":7:19:", "train.optimizer.lr", "finite");
    EXPECT_ERR(MLP "train:\n  optimizer: {eps: 0}\n", NAME ":7:20:", "train.optimizer.eps", "> 0");
    EXPECT_ERR(MLP "train:\n  optimizer: {betas: [0.9, 1]}\n", NAME ":7:28:", "train.optimizer.betas[1]",
               "in [0, 1)");
    EXPECT_ERR(MLP "data:\n  val_fraction: 1\n", NAME ":7:17:", "data.val_fraction", "in [0, 1)");
    EXPECT_ERR(MLP "train:\n  keep_last: -1\n", NAME ":7:14:", "train.keep_last", ">= 0");
    EXPECT_ERR(MLP "train:\n  log_every: -5\n", NAME ":7:14:", "train.log_every");
    EXPECT_ERR(MLP "train:\n  grad_clip: -1\n", NAME ":7:14:", "train.grad_clip");
    EXPECT_ERR(MLP "train:\n  optimizer: {name: sgd, nesterov: true}\n", NAME ":7:36:", "train.optimizer.nesterov",
               "momentum > 0");
    EXPECT_ERR(MLP "run: {name: a/b}\n", NAME ":6:13:", "run.name", "'/'");
    EXPECT_ERR(MLP "run: {name: ''}\n", NAME ":6:13:", "run.name", "non-empty");
}

/* run.name names runs/<name> and a layer's name an HDF5 group: ".", ".." and whatever is not an identifier broke a
 * run late (trained, then nothing saved, or files outside runs/); now the config is refused, naming key and line. */
static void test_name_rules(void) {
    EXPECT_ERR(MLP "run: {name: '..'}\n", NAME ":6:13:", "run.name", "not starting with '.'", "\"..\"");
    EXPECT_ERR(MLP "run: {name: .}\n", NAME ":6:13:", "run.name", "\".\"");
    EXPECT_ERR(MLP "run: {name: .hidden}\n", NAME ":6:13:", "run.name");
    EXPECT_ERR(MLP "run: {name: -x}\n", NAME ":6:13:", "run.name", "'-'");
    EXPECT_ERR(MLP "run: {name: 'my run'}\n", NAME ":6:13:", "run.name", "letters, digits");
    EXPECT_SET_ERR(MLP, "run.name=..", "--set run.name=..", "run.name");
    const char *dot_layer = "model:\n  input: [1, 4, 4]\n  layers:\n    - {type: flatten, name: .}\n"
                            "    - {type: dense, units: 3}\n";
    EXPECT_ERR(dot_layer, NAME ":4:29:", "model.layers[0].name", "\".\"");
    const char *dash_layer = "model:\n  input: [1, 4, 4]\n  layers:\n    - {type: flatten}\n"
                             "    - {type: dense, units: 3, name: '-fc'}\n";
    EXPECT_ERR(dash_layer, NAME ":5:", "model.layers[1].name", "'-'");
    EXPECT_ERR(MLP "run: {out_dir: \"runs/a\\nb\"}\n", NAME ":6:16:", "run.out_dir", "control character");
    EXPECT_ERR(MLP "data: {dir: \"d\\tx\"}\n", NAME ":6:13:", "data.dir", "control character");
    /* what stays allowed: dots and dashes inside, digits first */
    Config c;
    QtError e = {0};
    const char *ok = "run: {name: v1.2_lr-3}\nmodel:\n  input: [1, 4, 4]\n  layers:\n    - {type: flatten}\n"
                     "    - {type: dense, units: 3, name: 1fc.out-x}\n";
    QtStatus st = load(&c, ok, NULL, 0, &e);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
    CU_ASSERT_EQUAL(st, QT_OK);
}

static void test_unknown_keys(void) {
    EXPECT_ERR(MLP "train:\n  batchsize: 32\n", NAME ":7:3:", "train: unknown key 'batchsize'",
               "(did you mean 'batch_size'?)");
    EXPECT_ERR(MLP "trian:\n  steps: 3\n", NAME ":6:1:", "unknown top-level key 'trian'", "did you mean 'train'");
    EXPECT_ERR(MLP "train:\n  optimizer: {learning_rate: 0.1}\n", NAME ":7:15:",
               "train.optimizer: unknown key 'learning_rate'", "valid keys: name, lr, weight_decay, betas, eps");
    EXPECT_ERR(MLP "data:\n  transforms: []\n", NAME ":7:3:", "did you mean 'transform'");
    /* A real key in the wrong place says so instead of "unknown". */
    EXPECT_ERR("model:\n  input: [1, 8, 8]\n  layers:\n    - {type: conv2d, out_channels: 2, kernel: 3, units: 4}\n",
               NAME ":4:50:", "model.layers[0].units", "does not apply to a conv2d layer");
    EXPECT_ERR(MLP "train:\n  optimizer: {momentum: 0.9}\n", NAME ":7:15:", "train.optimizer.momentum",
               "does not apply to the adamw optimizer");
    EXPECT_ERR(MLP "train:\n  schedule: {name: cosine, gamma: 0.5}\n", NAME ":7:28:", "train.schedule.gamma",
               "does not apply to the cosine schedule");
}

static void test_enum_errors(void) {
    EXPECT_ERR("model:\n  input: [4]\n  layers:\n    - {type: dense, units: 2}\n    - {type: softmax}\n",
               NAME ":5:14:", "model.layers[1].type", "unknown layer type 'softmax'",
               "valid: dense, conv2d, relu, gelu, tanh, sigmoid, maxpool2d, avgpool2d, flatten, dropout, layernorm");
    EXPECT_ERR(MLP "train:\n  optimizer:\n    name: adam\n", NAME ":8:11:", "train.optimizer.name",
               "unknown optimizer 'adam'", "sgd, adamw");
    EXPECT_ERR(MLP "train:\n  schedule: {name: linear}\n", NAME ":7:20:", "train.schedule.name",
               "constant, cosine, step");
    EXPECT_ERR("model:\n  input: [4]\n  layers: [{type: dense, units: 2, init: he}]\n", NAME ":3:42:",
               "model.layers[0].init", "unknown init 'he'", "xavier_uniform");
    EXPECT_ERR(MLP "data:\n  transform: [invert, crop]\n", NAME ":7:23:", "data.transform[1]",
               "unknown transform 'crop'", "normalize, transpose, invert, classes, limit");
    EXPECT_ERR(MLP "data:\n  dataset: mnist\n", NAME ":7:12:", "data.dataset", "unknown dataset 'mnist'",
               "fashion-mnist");
}

static void test_layer_errors(void) {
    EXPECT_ERR("model:\n  input: [4]\n  layers:\n    - {units: 3}\n", NAME ":4:7:", "model.layers[0].type", "missing",
               "dense, conv2d");
    EXPECT_ERR("model:\n  input: [4]\n  layers:\n    - {typ: dense, units: 3}\n", NAME ":4:8:", "model.layers[0]",
               "unknown key 'typ' (did you mean 'type'?)");
    EXPECT_ERR("model:\n  input: [4]\n  layers:\n    - {type: dense}\n", NAME ":4:7:", "model.layers[0].units",
               "missing; a dense layer needs units");
    EXPECT_ERR("model:\n  input: [1, 8, 8]\n  layers:\n    - {type: conv2d, kernel: 3}\n", NAME ":4:7:",
               "model.layers[0].out_channels", "missing");
    EXPECT_ERR("model:\n  input: [1, 8, 8]\n  layers:\n    - {type: avgpool2d}\n", "model.layers[0].kernel",
               "missing");
    EXPECT_ERR("model:\n  input: [4]\n  layers:\n    - {type: dropout, p: 1}\n", NAME ":4:26:", "model.layers[0].p",
               "in [0, 1)");
    EXPECT_ERR("model:\n  input: [4]\n  layers:\n    - dense\n", NAME ":4:7:", "model.layers[0]", "layer mapping");
    EXPECT_ERR("model:\n  input: [4]\n  layers: []\n", NAME ":3:11:", "model.layers", "non-empty");
    EXPECT_ERR("model:\n  input: [4]\n", NAME ":2:3:", "model.layers", "missing");
    EXPECT_ERR("model:\n  layers: [{type: relu}]\n", NAME ":2:3:", "model.input", "missing");
    EXPECT_ERR("run: {seed: 3}\n", NAME ":1:1:", "model", "missing");
    EXPECT_ERR("model:\n  input: [4]\n  layers: [{type: relu, name: 'a b'}]\n", NAME ":3:31:",
               "model.layers[0].name", "letters, digits");
    EXPECT_ERR("model:\n  input: [4]\n  layers: [{type: relu, name: abcdefghijklmnopqrstuvwxyz0123456}]\n",
               "model.layers[0].name", "at most 31 characters");
    EXPECT_ERR("model:\n  input: [4]\n  layers: [{type: dense, units: 2, init_std: 0.1}]\n", NAME ":3:46:",
               "model.layers[0].init_std", "init: normal");
    /* More layers than a Config holds. */
    char text[4096] = "model:\n  input: [4]\n  layers:\n";
    for (int i = 0; i <= CONFIG_MAX_LAYERS; i++) strcat(text, "    - {type: relu}\n");
    EXPECT_ERR(text, NAME ":4:5:", "model.layers", "at most 64 layers, got 65");
}

static void test_shape_errors(void) {
    /* dense straight after a conv: model_init wants a flatten in between. */
    EXPECT_ERR("model:\n  input: [1, 8, 8]\n  layers:\n    - {type: conv2d, out_channels: 2, kernel: 3}\n"
               "    - {type: dense, units: 10}\n",
               NAME ":5:7:", "model.layers[1]", "(2, 6, 6)", "add a flatten layer");
    EXPECT_ERR("model:\n  input: [1, 4, 4]\n  layers:\n    - {type: maxpool2d, kernel: 5}\n    - {type: flatten}\n",
               NAME ":4:7:", "model.layers[0]", "kernel 5 is larger than its input");
    EXPECT_ERR("model:\n  input: [16]\n  layers:\n    - {type: conv2d, out_channels: 2, kernel: 3}\n", NAME ":4:7:",
               "model.layers[0]", "(C, H, W)");
    EXPECT_ERR("model:\n  input: [4]\n  layers:\n    - {type: relu, name: a}\n    - {type: tanh, name: a}\n",
               NAME ":5:7:", "model.layers[1]", "two layers are named 'a'");
}

static void test_transform_errors(void) {
    EXPECT_ERR(MLP "data:\n  transform: [{limit: 0}]\n", NAME ":7:23:", "data.transform[0].limit", ">= 1");
    EXPECT_ERR(MLP "data:\n  transform: [limit]\n", NAME ":7:15:", "data.transform[0].limit", "missing");
    EXPECT_ERR(MLP "data:\n  transform: [{classes: [1, 1]}]\n", NAME ":7:29:", "data.transform[0].classes[1]",
               "listed twice");
    EXPECT_ERR(MLP "data:\n  transform: [{classes: [256]}]\n", "data.transform[0].classes[0]", "[0, 255]");
    EXPECT_ERR(MLP "data:\n  transform: [{normalize: {mean: 0.5}}]\n", NAME ":7:27:",
               "data.transform[0].normalize", "both mean and std");
    EXPECT_ERR(MLP "data:\n  transform: [{normalize: {mean: 0.5, std: 0}}]\n", "data.transform[0].normalize.std",
               "> 0");
    EXPECT_ERR(MLP "data:\n  transform: [{invert: 1}]\n", NAME ":7:24:", "data.transform[0].invert", "no value");
    EXPECT_ERR(MLP "data:\n  transform: [{limit: 5, invert: null}]\n", NAME ":7:15:", "data.transform[0]",
               "single-key mapping");
    EXPECT_ERR(MLP "data:\n  transform: invert\n", NAME ":7:14:", "data.transform", "a sequence of transforms");
}

static void test_schedule_errors(void) {
    EXPECT_ERR(MLP "train:\n  schedule: {name: step}\n", NAME ":7:13:", "train.schedule.step_size", "missing");
    EXPECT_ERR(MLP "train:\n  schedule: {name: step, step_size: 0}\n", "train.schedule.step_size", ">= 1");
    EXPECT_ERR(MLP "train:\n  schedule: {name: step, step_size: 5, gamma: 0}\n", "train.schedule.gamma", "> 0");
    EXPECT_ERR(MLP "train:\n  optimizer: {lr: 0.01}\n  schedule: {name: cosine, min_lr: 0.1}\n", NAME ":8:36:",
               "train.schedule.min_lr", "at most train.optimizer.lr");
    EXPECT_ERR(MLP "train:\n  schedule: {warmup_steps: -1}\n", "train.schedule.warmup_steps", ">= 0");
}

/* A warmup as long as or longer than train.steps loads as written: the run clamps it (and says so). */
static void test_long_warmup_loads(void) {
    Config c;
    QtError e = {0};
    CU_ASSERT_EQUAL(load(&c, MLP "train:\n  steps: 10\n  schedule: {name: cosine, warmup_steps: 100}\n", NULL, 0, &e),
                    QT_OK);
    CU_ASSERT_EQUAL(c.train.schedule.warmup_steps, 100);
}

static void test_later_modes(void) {
    Config c;
    QtError e;
    CU_ASSERT_EQUAL(load(&c, MLP "quant: {mode: none}\nlora: {}\n", NULL, 0, &e), QT_OK);
    CU_ASSERT_EQUAL(load(&c, MLP "quant:\nlora:\n", NULL, 0, &e), QT_OK);
    EXPECT_ERR(MLP "quant:\n  mode: int8\n", NAME ":7:9:", "quant.mode", "unknown quant mode 'int8'");
    CU_ASSERT_EQUAL(load(&c, MLP "quant:\n  mode: none\n  rules: []\n", NULL, 0, &e), QT_OK);
    EXPECT_ERR(MLP "lora:\n  rank: 4\n", NAME ":7:3:", "lora", "unknown key 'rank'");
    EXPECT_ERR(MLP "lora: [1]\n", NAME ":6:7:", "lora", "expected a mapping");
}

/* ---- overrides ------------------------------------------------------------------ */

static void test_overrides(void) {
    Config c;
    QtError e;
    const char *ov1[] = {"train.batch_size=16", "model.layers.1.units=7", "train.optimizer.betas=[0.5, 0.6]",
                         "run.out_dir=a=b", "data.transform=[invert, {limit: 9}]", "train.batch_size=24"};
    CU_ASSERT_EQUAL_FATAL(load(&c, MLP "train:\n  batch_size: 8\n", ov1, 6, &e), QT_OK);
    CU_ASSERT_EQUAL(c.train.batch_size, 24); /* in order: the last one wins */
    CU_ASSERT_EQUAL(c.model.layers[1].units, 7);
    CU_ASSERT(c.train.optim.beta1 == 0.5f && c.train.optim.beta2 == 0.6f);
    CU_ASSERT_STRING_EQUAL(c.run.out_dir, "a=b");
    CU_ASSERT(c.data.n_transforms == 2 && c.data.transforms[1].limit == 9);
    /* New keys and whole sections are created on the way. */
    const char *ov2[] = {"train.optimizer.name=sgd", "train.optimizer.momentum=0.9", "train.schedule.name=cosine",
                         "train.steps=100", "model.input=[16]"};
    CU_ASSERT_EQUAL_FATAL(load(&c, MLP, ov2, 5, &e), QT_OK);
    CU_ASSERT(c.train.optim.kind == OPTIM_SGD && c.train.optim.momentum == 0.9f);
    CU_ASSERT(c.train.schedule.kind == SCHED_COSINE && c.train.steps == 100 && c.model.input_shape[0] == 16);
    /* Index == length appends an item: a whole value, or a new mapping item built key by key. */
    const char *ov4[] = {"data.transform.0=invert", "data.transform.1={limit: 9}", "model.layers.2.type=relu",
                         "model.layers.3.name=out", "model.layers.3.type=dense", "model.layers.3.units=10"};
    CU_ASSERT_EQUAL_FATAL(load(&c, MLP "data:\n  transform: []\n", ov4, 6, &e), QT_OK);
    CU_ASSERT(c.data.n_transforms == 2 && c.data.transforms[1].limit == 9);
    CU_ASSERT(c.model.n_layers == 4 && c.model.layers[3].units == 10);
    /* An empty value is null: the default again. */
    const char *ov3[] = {"train.batch_size="};
    CU_ASSERT_EQUAL_FATAL(load(&c, MLP "train:\n  batch_size: 8\n", ov3, 1, &e), QT_OK);
    CU_ASSERT_EQUAL(c.train.batch_size, 64);

    EXPECT_SET_ERR(MLP, "train.optimizer.lr=abc", "--set train.optimizer.lr=abc: train.optimizer.lr:",
                   "expected a finite number >= 0");
    EXPECT_SET_ERR(MLP, "train.batchsize=3", "--set train.batchsize=3: train: unknown key 'batchsize'",
                   "did you mean 'batch_size'");
    EXPECT_SET_ERR(MLP, "model.layers.5.units=1", "--set model.layers.5.units=1", "model.layers[5]", "out of range",
                   "2 items", "index 2 adds one");
    EXPECT_SET_ERR(MLP, "model.layers.1.units.deep=1", "--set model.layers.1.units.deep=1",
                   "model.layers[1].units is a single value");
    EXPECT_SET_ERR(MLP, "model.layers.first.units=1", "model.layers is a sequence", "'first'");
    EXPECT_SET_ERR(MLP, "model.input=[1, 2", "--set model.input=[1, 2", "invalid YAML value");
    EXPECT_SET_ERR(MLP, "train.batch_size", "--set train.batch_size:", "key.path=value");
    EXPECT_SET_ERR(MLP, "=5", "--set =5", "empty");
    EXPECT_SET_ERR(MLP, "train..steps=5", "empty segment");
    EXPECT_SET_ERR(MLP, "model.layers.1.type=conv2d", NAME ":5:21:", "model.layers[1].units", "does not apply");
    EXPECT_SET_ERR(MLP "lora:\n", "lora.rank=4", "--set lora.rank=4", "unknown key 'rank'");
}

/* ---- files ------------------------------------------------------------------------ */

static void test_files(void) {
    char *dir = test_tmpdir_new();
    char *good = test_path_join(dir, "good.yaml"), *bad = test_path_join(dir, "bad.yaml");
    char *missing = test_path_join(dir, "missing.yaml");
    const char *bad_text = MLP "train:\n  steps: [\n";
    test_file_write(good, MLP, strlen(MLP));
    test_file_write(bad, bad_text, strlen(bad_text));

    Config c;
    QtError e = {0};
    CU_ASSERT_EQUAL(config_load(&c, good, (const char *const[]){"train.steps=3"}, 1, &e), QT_OK);
    CU_ASSERT_STRING_EQUAL(c.source, good);
    CU_ASSERT_EQUAL(c.train.steps, 3);

    qt_error_clear(&e);
    CU_ASSERT_EQUAL(config_load(&c, bad, NULL, 0, &e), QT_ERR_CONFIG);
    char where[300];
    snprintf(where, sizeof where, "%s:8:1:", bad);
    CU_ASSERT_PTR_NOT_NULL(strstr(e.msg, where));

    qt_error_clear(&e);
    CU_ASSERT_EQUAL(config_load(&c, missing, NULL, 0, &e), QT_ERR_IO);
    CU_ASSERT_PTR_NOT_NULL(strstr(e.msg, missing));
    CU_ASSERT_PTR_NOT_NULL(strstr(e.msg, strerror(ENOENT)));

    qt_error_clear(&e);
    CU_ASSERT_EQUAL(config_load(&c, dir, NULL, 0, &e), QT_ERR_IO); /* a directory cannot be read */
    CU_ASSERT_PTR_NOT_NULL(strstr(e.msg, dir));

    free(good);
    free(bad);
    free(missing);
    test_tmpdir_remove(dir);
}

static void test_edit_distance(void) {
    CU_ASSERT_EQUAL(config_edit_distance("", ""), 0);
    CU_ASSERT_EQUAL(config_edit_distance("abc", ""), 3);
    CU_ASSERT_EQUAL(config_edit_distance("", "ab"), 2);
    CU_ASSERT_EQUAL(config_edit_distance("kitten", "sitting"), 3);
    CU_ASSERT_EQUAL(config_edit_distance("batchsize", "batch_size"), 1);
    CU_ASSERT_EQUAL(config_edit_distance("flaw", "lawn"), 2);
    CU_ASSERT_EQUAL(config_edit_distance("lr", "lr"), 0);
}

void config_rules_tests_add(CU_pSuite s);

int register_config_suite(void) {
    CU_pSuite s = CU_add_suite("config", NULL, NULL);
    if (!s) return -1;
    config_rules_tests_add(s);
    return !CU_add_test(s, "full config: every key", test_full_config) ||
           !CU_add_test(s, "defaults for omitted keys", test_defaults) ||
           !CU_add_test(s, "optimizer keys in any order", test_optimizer_key_order) ||
           !CU_add_test(s, "steps and epochs both kept", test_steps_and_epochs) ||
           !CU_add_test(s, "booleans and nulls", test_booleans_and_nulls) ||
           !CU_add_test(s, "to_yaml round trip", test_to_yaml_round_trip) ||
           !CU_add_test(s, "YAML errors", test_yaml_errors) ||
           !CU_add_test(s, "type errors", test_type_errors) ||
           !CU_add_test(s, "range errors", test_range_errors) ||
           !CU_add_test(s, "unknown keys, did you mean", test_unknown_keys) ||
           !CU_add_test(s, "run.name '..' and a layer named '.' are refused", test_name_rules) ||
           !CU_add_test(s, "unknown names list the valid ones", test_enum_errors) ||
           !CU_add_test(s, "layer errors", test_layer_errors) ||
           !CU_add_test(s, "shapes that do not chain", test_shape_errors) ||
           !CU_add_test(s, "transform errors", test_transform_errors) ||
           !CU_add_test(s, "schedule errors", test_schedule_errors) ||
           !CU_add_test(s, "a warmup longer than train.steps loads (the run clamps it)", test_long_warmup_loads) ||
           !CU_add_test(s, "quant and lora sections", test_later_modes) ||
           !CU_add_test(s, "--set overrides", test_overrides) ||
           !CU_add_test(s, "files: names, I/O errors", test_files) ||
           !CU_add_test(s, "edit distance", test_edit_distance);
}
