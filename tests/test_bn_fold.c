/* test_bn_fold.c - batch norm folding for PTQ (trainer/bn_fold.h): the
 * folded layers equal conv/dense + batch norm in eval mode; which batch
 * norms fold and the rules table's word on those that do not; PTQ int8 of
 * batch-norm models, folded or not, near float; the checkpoints of a folded
 * model (a PTQ run's final.h5, a `qtrain quantize` output) evaluate as the
 * run did, and an unfolded float checkpoint still loads. */
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "test_runs.h"
#include "test_util.h"
#include "trainer/bn_fold.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/net.h"
#include "trainer/tools.h"
#include "trainer/train.h"

static char *tmp_root;
static TestRuns runs; /* root = tmp_root, no float base */

static LayerSpec spec_of(LayerType type, const char *name) {
    LayerSpec s = {.type = type};
    snprintf(s.name, sizeof s.name, "%s", name);
    if (type == LAYER_BATCHNORM1D || type == LAYER_BATCHNORM2D) s.eps = 1e-5f, s.momentum = 0.1f;
    return s;
}

/* Running statistics and affine parameters far from their start, so folding has something to fold. */
static void randomize_bn(Model *m, uint64_t seed) {
    Rng r;
    rng_init(&r, seed, 3);
    for (int i = 0; i < m->n_modules; i++) {
        Module *b = &m->modules[i];
        if (!b->running_mean) continue;
        int C = b->in_shape[0];
        rng_fill_uniform(&r, b->running_mean, (size_t)C, -0.5f, 0.5f);
        rng_fill_uniform(&r, b->running_var, (size_t)C, 0.2f, 2.0f);
        if (b->weight) rng_fill_uniform(&r, b->weight->var.value.data, (size_t)C, 0.5f, 1.5f);
        if (b->bias) rng_fill_uniform(&r, b->bias->var.value.data, (size_t)C, -1.0f, 1.0f);
        b->num_batches_tracked = 7;
    }
}

/* The model's eval-mode output on x (n examples) into out. */
static void forward_eval(Model *m, const float *x, int n, float *out, size_t n_out) {
    Arena a;
    Tape t;
    Rng r;
    arena_init(&a, 1 << 16);
    rng_init(&r, 1, RNG_STREAM_DROPOUT);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, &r, NULL), QT_OK);
    t.training = false;
    int shape[4] = {n, m->input_shape[0], m->input_shape[1], m->input_shape[2]};
    Var *y = model_forward(m, &t, tape_wrap(&t, (float *)x, m->input_ndim + 1, shape));
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    CU_ASSERT_EQUAL_FATAL(var_numel(y), n_out);
    memcpy(out, y->value.data, n_out * sizeof(float));
    tape_free(&t);
    arena_free(&a);
}

/* conv2d without and with a bias, dense with and without: each + batch norm
 * folded equals the pair in eval mode within 1e-6 relative (the arithmetic
 * of the fold is in double; what is left is float rounding). */
static void test_fold_equals_conv_bn(void) {
    LayerSpec l[] = {spec_of(LAYER_CONV2D, "c1"), spec_of(LAYER_BATCHNORM2D, "b1"), spec_of(LAYER_CONV2D, "c2"),
                     spec_of(LAYER_BATCHNORM2D, "b2"), spec_of(LAYER_FLATTEN, "flat"), spec_of(LAYER_DENSE, "d1"),
                     spec_of(LAYER_BATCHNORM1D, "b3"), spec_of(LAYER_DENSE, "d2"), spec_of(LAYER_BATCHNORM1D, "b4")};
    l[0].out_channels = 5, l[0].kernel = 3, l[0].stride = 1, l[0].padding = 1, l[0].no_bias = true;
    l[2].out_channels = 4, l[2].kernel = 3, l[2].stride = 2, l[2].padding = 1;
    l[5].units = 12;
    l[7].units = 6, l[7].no_bias = true;
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){2, 6, 6}, l, 9, &err), QT_OK);
    Rng r;
    rng_init(&r, 11, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    randomize_bn(&m, 12);
    float x[4 * 72], ref[4 * 6], got[4 * 6];
    rng_fill_normal(&r, x, 4 * 72, 0, 1);
    forward_eval(&m, x, 4, ref, 24);
    const int bns[] = {1, 3, 6, 8};
    const BnFold want[] = {BN_FOLD_BIAS, BN_FOLD_INTO, BN_FOLD_INTO, BN_FOLD_BIAS};
    for (int k = 0; k < 4; k++) {
        char why[BN_NOTE_MAX];
        CU_ASSERT(bn_fold_check(&m, bns[k], why, sizeof why));
        Module *b = &m.modules[bns[k]];
        bn_fold_into(&m.modules[b->inputs[0]], b);
        CU_ASSERT_EQUAL(b->bn_folded, want[k]);
    }
    forward_eval(&m, x, 4, got, 24);
    double dmax = 0, rmax = 0;
    for (int i = 0; i < 24; i++) dmax = fmax(dmax, fabs((double)got[i] - ref[i])), rmax = fmax(rmax, fabs(ref[i]));
    printf("(max |diff| / max |y| = %.2e) ", dmax / rmax);
    CU_ASSERT(rmax > 0.1);
    CU_ASSERT(dmax <= 1e-6 * rmax);
    /* folded batch norms pass their input on in training too: no batch statistics, none updated */
    Arena a;
    Tape t;
    arena_init(&a, 1 << 16);
    CU_ASSERT_EQUAL_FATAL(tape_init(&t, &a, &r, NULL), QT_OK);
    t.training = true;
    Var *y = model_forward(&m, &t, tape_wrap(&t, x, 4, (int[]){4, 2, 6, 6}));
    CU_ASSERT_PTR_NOT_NULL(y);
    for (int i = 0; y && i < 24; i++) CU_ASSERT_EQUAL(y->value.data[i], got[i]);
    CU_ASSERT_EQUAL(m.modules[1].num_batches_tracked, 7);
    tape_free(&t);
    arena_free(&a);
    model_free(&m);
}

static Config *load_config(const char *path, const char *sub, const char *const *extra, int n_extra) {
    return test_runs_config(&runs, path, sub, extra, n_extra);
}

/* A PTQ int8 config of path over init_from, folding batch norms or not. */
static Config *ptq_config(const char *path, const char *sub, const char *init_from, bool fold) {
    char from[1200];
    snprintf(from, sizeof from, "model.init_from=%s", init_from);
    const char *ov[] = {"quant.mode=ptq", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]",
                        "train.steps=0", "train.epochs=0", from, fold ? "quant.fold_bn=true" : "quant.fold_bn=false"};
    return load_config(path, sub, ov, 6);
}

/* Which batch norms of tiny-bn-fold.yaml fold, and the rules table of its PTQ model says why the others do not. */
static void test_fold_table(void) {
    Config *c = load_config("tests/configs/tiny-bn-fold.yaml", "table-float", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, c->model.input_ndim, c->model.input_shape, c->model.layers,
                                     c->model.n_layers, &err), QT_OK);
    Rng r;
    rng_init(&r, 5, RNG_STREAM_INIT);
    model_init_params(&m, &r);
    randomize_bn(&m, 6);
    char why[BN_NOTE_MAX];
    int bn2 = (int)(model_find_module(&m, "bn2") - m.modules), bn3 = (int)(model_find_module(&m, "bn3") - m.modules);
    CU_ASSERT(!bn_fold_check(&m, bn2, why, sizeof why));
    CU_ASSERT_STRING_EQUAL(why, "bn2: not folded: conv2's output also feeds sum");
    CU_ASSERT(!bn_fold_check(&m, bn3, why, sizeof why));
    CU_ASSERT(strstr(why, "bn3: not folded: it reads relu") == why);
    char path[1100];
    snprintf(path, sizeof path, "%s/bn-fold-float.h5", tmp_root);
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(path, &m, NULL, NULL, &err), QT_OK);
    Config *p = ptq_config("tests/configs/tiny-bn-fold.yaml", "table-ptq", path, true);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    Net n;
    CU_ASSERT_EQUAL_FATAL(net_build(&n, p, NET_FRESH, &err), QT_OK);
    char *text = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&text, &len);
    net_print_table(&n, out);
    fclose(out);
    CU_ASSERT(strstr(text, "folded into conv1") != NULL);
    CU_ASSERT(strstr(text, "not folded: conv2's output also feeds sum") != NULL);
    CU_ASSERT(strstr(text, "not folded: it reads relu") != NULL);
    CU_ASSERT(strstr(text, "folded into fc1") != NULL);
    CU_ASSERT_EQUAL(model_find_module(&n.model, "bn1")->bn_folded, BN_FOLD_BIAS);
    CU_ASSERT_EQUAL(model_find_module(&n.model, "bn2")->bn_folded, BN_FOLD_NONE);
    CU_ASSERT_EQUAL(model_find_module(&n.model, "bn4")->bn_folded, BN_FOLD_INTO);
    free(text);
    net_free(&n);
    /* a LoRA adapter on the producer: its output is normalised too, so the batch norm stays */
    char from[1200];
    snprintf(from, sizeof from, "model.init_from=%s", path);
    const char *ov[] = {"quant.mode=ptq", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]", from,
                        "lora.rules=[{module_path: conv1, rank: 2}]"};
    Config *l = load_config("tests/configs/tiny-bn-fold.yaml", "table-lora", ov, 4);
    CU_ASSERT_PTR_NOT_NULL_FATAL(l);
    CU_ASSERT_EQUAL_FATAL(net_build(&n, l, NET_FRESH, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(n.bn_note[1], "bn1: not folded: conv1 has a LoRA adapter, whose output it normalises too");
    CU_ASSERT_EQUAL(model_find_module(&n.model, "bn1")->bn_folded, BN_FOLD_NONE);
    CU_ASSERT_EQUAL(model_find_module(&n.model, "bn4")->bn_folded, BN_FOLD_INTO);
    net_free(&n);
    free(l);
    model_free(&m);
    free(p);
    free(c);
}

/* The batch norms of checkpoint path as loaded into c's model (every weight quantized: its float weights
 * released, as a PTQ base holds them): how many are folded. */
static int count_folded(const Config *c, const char *path, bool quantized) {
    Model m;
    QtError err = {0};
    if (model_init(&m, c->model.input_ndim, c->model.input_shape, c->model.layers, c->model.n_layers, &err) != QT_OK)
        return -1;
    for (int i = 0; quantized && i < m.n_modules; i++)
        if (m.modules[i].spec.type == LAYER_CONV2D || m.modules[i].spec.type == LAYER_DENSE)
            param_release(m.modules[i].weight);
    int k = 0;
    if (checkpoint_load_params(path, &m, &err) != QT_OK) {
        fprintf(stderr, "\n  %s: %s\n", path, err.msg);
        k = -1;
    }
    for (int i = 0; k >= 0 && i < m.n_modules; i++) k += m.modules[i].bn_folded != BN_FOLD_NONE;
    model_free(&m);
    return k;
}

/* A model trained in float, then PTQ int8 with and without folding: both
 * near float; the folded run's final.h5 and `qtrain quantize` of the float
 * checkpoint evaluate exactly as the run did, and both hold the batch norms
 * folded; the float checkpoint (unfolded) still evaluates as trained. */
static void check_ptq_model(const char *yaml, const char *tag, int n_bn) {
    char sub[64], float_ckpt[1100], ptq_ckpt[1100], quantized[1100];
    snprintf(sub, sizeof sub, "%s-float", tag);
    Config *c = load_config(yaml, sub, NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    TrainResult rf, rp, rn, ev;
    TrainOptions quiet = {.quiet = true};
    CU_ASSERT_EQUAL_FATAL(train_run(c, &quiet, &rf, &err), QT_OK);
    snprintf(float_ckpt, sizeof float_ckpt, "%s/final.h5", c->run.out_dir);
    snprintf(sub, sizeof sub, "%s-ptq", tag);
    Config *p = ptq_config(yaml, sub, float_ckpt, true);
    snprintf(sub, sizeof sub, "%s-ptq-nofold", tag);
    Config *q = ptq_config(yaml, sub, float_ckpt, false);
    CU_ASSERT_FATAL(p && q);
    CU_ASSERT_EQUAL_FATAL(train_run(p, &quiet, &rp, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(train_run(q, &quiet, &rn, &err), QT_OK);
    printf("(%s: float %.4f / %.4f, int8 folded %.4f / %.4f, int8 unfolded %.4f / %.4f) ", tag, rf.test_accuracy,
           rf.test_loss, rp.test_accuracy, rp.test_loss, rn.test_accuracy, rn.test_loss);
    CU_ASSERT(fabs(rp.test_accuracy - rf.test_accuracy) <= 0.02);
    CU_ASSERT(fabs(rn.test_accuracy - rf.test_accuracy) <= 0.02);
    CU_ASSERT(fabs(rp.test_loss - rf.test_loss) <= 0.02 * rf.test_loss);
    CU_ASSERT(fabs(rn.test_loss - rf.test_loss) <= 0.02 * rf.test_loss);
    snprintf(ptq_ckpt, sizeof ptq_ckpt, "%s/final.h5", p->run.out_dir);
    CU_ASSERT_EQUAL(count_folded(c, ptq_ckpt, true), n_bn);
    CU_ASSERT_EQUAL(train_eval_checkpoint(p, ptq_ckpt, false, &ev, &err), QT_OK);
    CU_ASSERT_EQUAL(ev.test_accuracy, rp.test_accuracy);
    CU_ASSERT_EQUAL(ev.test_loss, rp.test_loss);
    char nofold[1100];
    snprintf(nofold, sizeof nofold, "%s/final.h5", q->run.out_dir);
    CU_ASSERT_EQUAL(count_folded(c, nofold, true), 0);
    CU_ASSERT_EQUAL(train_eval_checkpoint(q, nofold, false, &ev, &err), QT_OK);
    CU_ASSERT_EQUAL(ev.test_loss, rn.test_loss);
    snprintf(quantized, sizeof quantized, "%s/%s-int8.h5", tmp_root, tag);
    CU_ASSERT_EQUAL_FATAL(tools_quantize(p, float_ckpt, quantized, false, NULL, &err), QT_OK);
    CU_ASSERT_EQUAL(count_folded(c, quantized, true), n_bn);
    CU_ASSERT_EQUAL(train_eval_checkpoint(p, quantized, false, &ev, &err), QT_OK);
    CU_ASSERT_EQUAL(ev.test_accuracy, rp.test_accuracy);
    CU_ASSERT_EQUAL(ev.test_loss, rp.test_loss);
    /* the folded PTQ checkpoint as model.init_from: read as stored, not folded twice */
    snprintf(sub, sizeof sub, "%s-ptq-again", tag);
    Config *again = ptq_config(yaml, sub, ptq_ckpt, true);
    CU_ASSERT_PTR_NOT_NULL_FATAL(again);
    CU_ASSERT_EQUAL(train_run(again, &quiet, &ev, &err), QT_OK);
    CU_ASSERT_EQUAL(ev.test_accuracy, rp.test_accuracy);
    CU_ASSERT_EQUAL(ev.test_loss, rp.test_loss);
    free(again);
    CU_ASSERT_EQUAL(count_folded(c, float_ckpt, false), 0);
    CU_ASSERT_EQUAL(train_eval_checkpoint(c, float_ckpt, false, &ev, &err), QT_OK);
    CU_ASSERT_EQUAL(ev.test_loss, rf.test_loss);
    free(c), free(p), free(q);
}

/* Sets the int64 attribute folded on /buffers/<bn> of path to v (replacing it). */
static void set_folded_attr(const char *path, const char *bn, int64_t v) {
    char g[64];
    snprintf(g, sizeof g, "/buffers/%s", bn);
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    CU_ASSERT_FATAL(f >= 0);
    if (H5Aexists_by_name(f, g, "folded", H5P_DEFAULT) > 0) H5Adelete_by_name(f, g, "folded", H5P_DEFAULT);
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate_by_name(f, g, "folded", H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    CU_ASSERT(a >= 0 && H5Awrite(a, H5T_NATIVE_INT64, &v) >= 0);
    H5Aclose(a), H5Sclose(sp), H5Fclose(f);
}

/* A folded attribute no run writes is a damaged file, named; 2 (the batch norm's bias holds the shift) on a batch
 * norm without affine parameters is another model's. */
static void test_folded_attr_checked(void) {
    LayerSpec l[] = {spec_of(LAYER_CONV2D, "c1"), spec_of(LAYER_BATCHNORM2D, "b1"), spec_of(LAYER_CONV2D, "c2"),
                     spec_of(LAYER_BATCHNORM2D, "b2")};
    l[0].out_channels = 3, l[0].kernel = 1, l[0].stride = 1;
    l[2] = l[0], snprintf(l[2].name, sizeof l[2].name, "c2");
    l[3].no_affine = true;
    Model m, back;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){2, 4, 4}, l, 4, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(model_init(&back, 3, (int[]){2, 4, 4}, l, 4, &err), QT_OK);
    m.modules[1].bn_folded = BN_FOLD_BIAS;
    m.modules[3].bn_folded = BN_FOLD_INTO;
    char path[1100];
    snprintf(path, sizeof path, "%s/folded-attr.h5", tmp_root);
    CU_ASSERT_EQUAL_FATAL(checkpoint_save(path, &m, NULL, NULL, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(path, &back, &err), QT_OK);
    CU_ASSERT_EQUAL(back.modules[1].bn_folded, BN_FOLD_BIAS);
    CU_ASSERT_EQUAL(back.modules[3].bn_folded, BN_FOLD_INTO);
    set_folded_attr(path, "b1", 5);
    CU_ASSERT_EQUAL(checkpoint_load_params(path, &back, &err), QT_ERR_FORMAT);
    CU_ASSERT(strstr(err.msg, "/buffers/b1 has folded 5") != NULL);
    set_folded_attr(path, "b1", 1);
    set_folded_attr(path, "b2", 2);
    err = (QtError){0};
    CU_ASSERT_EQUAL(checkpoint_load_params(path, &back, &err), QT_ERR_FORMAT);
    CU_ASSERT(strstr(err.msg, "module 'b2' has no bias") != NULL);
    model_free(&m), model_free(&back);
}

static void test_ptq_bn(void) { check_ptq_model("tests/configs/tiny-bn.yaml", "bn", 1); }

/* QLoRA over a folded base (an adapter on the head alone: conv1 -> bn1 folds), then `qtrain merge`, quantized
 * again and dequantized: the merged models keep bn1 folded and evaluate as the adapters over the base did. */
static void test_merge_folded(void) {
    Config *c = load_config("tests/configs/tiny-bn.yaml", "merge-float", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    TrainResult r;
    TrainOptions quiet = {.quiet = true};
    CU_ASSERT_EQUAL_FATAL(train_run(c, &quiet, &r, &err), QT_OK);
    char from[1200], final[1100], merged[1100], deq[1100];
    snprintf(from, sizeof from, "model.init_from=%s/final.h5", c->run.out_dir);
    const char *ov[] = {"quant.mode=ptq", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]", from,
                        "lora.rules=[{module_path: head, rank: 2}]", "train.steps=10"};
    Config *q = load_config("tests/configs/tiny-bn.yaml", "merge-qlora", ov, 5);
    CU_ASSERT_PTR_NOT_NULL_FATAL(q);
    CU_ASSERT_EQUAL_FATAL(train_run(q, &quiet, &r, &err), QT_OK);
    snprintf(final, sizeof final, "%s/final.h5", q->run.out_dir);
    snprintf(merged, sizeof merged, "%s/merged.h5", q->run.out_dir);
    snprintf(deq, sizeof deq, "%s/merged-float.h5", q->run.out_dir);
    CU_ASSERT_EQUAL(count_folded(c, final, true), 1);
    MergeReport rep, rd;
    CU_ASSERT_EQUAL_FATAL(tools_merge(final, merged, false, false, NULL, &rep, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(tools_merge(final, deq, true, false, NULL, &rd, &err), QT_OK);
    printf("(before %.4f / %.4f, merged %.4f / %.4f, dequantized %.4f / %.4f) ", rep.test_accuracy_before,
           rep.test_loss_before, rep.test_accuracy_after, rep.test_loss_after, rd.test_accuracy_after,
           rd.test_loss_after);
    CU_ASSERT(fabs(rep.test_accuracy_after - rep.test_accuracy_before) <= 0.02);
    CU_ASSERT(fabs(rd.test_accuracy_after - rd.test_accuracy_before) <= 0.002);
    CU_ASSERT(fabs(rd.test_loss_after - rd.test_loss_before) < 1e-3);
    CU_ASSERT_EQUAL(count_folded(c, deq, false), 1);
    free(c), free(q);
}
static void test_ptq_res(void) { check_ptq_model("tests/configs/tiny-res.yaml", "res", 3); }

static int fold_suite_init(void) {
    runs.root = tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int fold_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    runs.root = tmp_root = NULL;
    return ok ? 0 : -1;
}

int register_bn_fold_suite(void) {
    CU_pSuite s = CU_add_suite("bn_fold", fold_suite_init, fold_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "folded conv2d/dense equals the layer + batch norm in eval mode", test_fold_equals_conv_bn) ||
           !CU_add_test(s, "which batch norms fold; the rules table says why not", test_fold_table) ||
           !CU_add_test(s, "PTQ int8 of a batch-norm CNN, folded or not; its checkpoints", test_ptq_bn) ||
           !CU_add_test(s, "PTQ int8 of a residual CNN, folded or not; its checkpoints", test_ptq_res) ||
           !CU_add_test(s, "/buffers folded attribute: round trip, damaged values refused", test_folded_attr_checked) ||
           !CU_add_test(s, "qtrain merge of QLoRA over a folded base keeps it folded", test_merge_folded);
}
