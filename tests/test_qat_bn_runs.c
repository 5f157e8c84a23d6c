/* test_qat_bn_runs.c - QAT of batch-norm models in the folded form, through
 * whole runs: which batch norms fold and the rules table's word on those that
 * do not; `qtrain convert` of tiny-bn, tiny-res and tiny-bn-fold evaluates
 * exactly as the QAT model; quant.freeze_bn_after stops the statistics; a
 * resumed run across the freeze is bit-exact; the folded_bn markers (a file
 * without them loads unfolded, as it trained). The layer-level tests are
 * test_qat_bn.c. */
#include <CUnit/CUnit.h>
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/qat.h"
#include "quant/qlayer.h"
#include "test_qarray.h"
#include "test_qat.h"
#include "test_runs.h"
#include "test_util.h"
#include "trainer/bn_fold.h"
#include "trainer/checkpoint.h"
#include "base/h5io.h"
#include "trainer/net.h"
#include "trainer/tools.h"

static TestRuns runs; /* root only: no float base */

/* ---- runs -------------------------------------------------------------------------------------------------------- */

static const char *const QAT_RULES[] = {
    "quant.mode=qat", "quant.calibration_batches=2",
    "quant.rules=[{module_path: \".*\", weight_qtype: int4, act_qtype: int8, scale_type: pof2, learn_amax: tqt, "
    "amax_init: 3sd, lr: 0.001}]"};
static const char *const QAT_STATIC[] = {
    "quant.mode=qat", "quant.calibration_batches=2",
    "quant.rules=[{module_path: \".*\", weight_qtype: int8, act_qtype: int8, act_static_scale: true}]"};

/* The batch norms of checkpoint ckpt, loaded into c's model with its QAT layers' weights held quantized, that are
 * folded. */
static int count_folded(const Config *c, const char *ckpt) {
    Net n;
    test_runs_load_net(&n, c, ckpt);
    int k = 0;
    for (int i = 0; i < n.model.n_modules; i++) k += n.model.modules[i].bn_folded != BN_FOLD_NONE;
    net_free(&n);
    return k;
}

/* Trains path (with the overrides) as QAT under sub, converts it, and asserts the converted checkpoint evaluates
 * exactly as the QAT one (test accuracy and loss) on the float path (fake quantization and sgemm, as QAT computes),
 * and within float rounding on the integer kernels (exact sums, rounded once: another order), with n_folded batch
 * norms folded into its quantized layers. */
static void check_convert(const char *path, const char *sub, const char *const *ov, int n_ov, int n_folded) {
    Config *c = test_runs_config(&runs, path, sub, ov, n_ov);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainResult r;
    QtError err = {0};
    QtStatus st = test_runs_train(c, NULL, 0, &r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", path, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    ConvertReport rep, on_kernels;
    char *ckpt = test_runs_path(&runs, sub, "final.h5"), *out = test_runs_path(&runs, sub, "ptq.h5");
    st = tools_convert(ckpt, out, true, NULL, &on_kernels, &err);
    if (st != QT_OK) fprintf(stderr, "\n  convert %s: %s\n", path, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    qlayer_int8_disable = true;
    st = tools_convert(ckpt, out, true, NULL, &rep, &err);
    qlayer_int8_disable = false;
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    printf("(%s: %.4f / %.6f) ", sub, rep.test_accuracy_qat, rep.test_loss_qat);
    CU_ASSERT_EQUAL(rep.test_accuracy_ptq, rep.test_accuracy_qat);
    CU_ASSERT_EQUAL(rep.test_loss_ptq, rep.test_loss_qat);
    CU_ASSERT(rep.test_accuracy_qat > 0.15);
    CU_ASSERT_EQUAL(on_kernels.test_loss_qat, rep.test_loss_qat);
    CU_ASSERT(fabs(on_kernels.test_accuracy_ptq - rep.test_accuracy_qat) <= 1.0 / 512); /* a tie may flip */
    CU_ASSERT(fabs(on_kernels.test_loss_ptq - rep.test_loss_qat) <= 1e-5 * fabs(rep.test_loss_qat));
    Config *p = malloc(sizeof *p);
    char *text = NULL;
    CU_ASSERT_EQUAL_FATAL(checkpoint_read_config(out, &text, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(config_load_string(p, text, out, NULL, 0, &err), QT_OK);
    free(text);
    CU_ASSERT_EQUAL(p->quant.mode, QUANT_MODE_PTQ);
    CU_ASSERT_EQUAL(count_folded(p, out), n_folded);
    CU_ASSERT_EQUAL(count_folded(c, ckpt), 0); /* the QAT checkpoint keeps its batch norms as they trained */
    free(p);
    free(c);
}

static void test_convert_bn(void) {
    check_convert("tests/configs/tiny-bn.yaml", "bn-tqt", QAT_RULES, 3, 1);
    check_convert("tests/configs/tiny-bn.yaml", "bn-static", QAT_STATIC, 3, 1);
}

static void test_convert_res(void) {
    check_convert("tests/configs/tiny-res.yaml", "res-tqt", QAT_RULES, 3, 3);
    check_convert("tests/configs/tiny-res-qat.yaml", "res-qat", NULL, 0, 3);
}

/* tiny-bn-fold.yaml under QAT: bn1 and bn4 fold (bn1 keeping the shift as its bias), bn2 and bn3 stay float batch
 * norms and the rules table says why; a producer no qat rule quantizes keeps its batch norm too. Convert is exact
 * with two folded. */
static void test_fold_table_and_convert(void) {
    Config *c = test_runs_config(&runs, "tests/configs/tiny-bn-fold.yaml", "fold-table", QAT_STATIC, 3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    Net n;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c, NET_FRESH, &err), QT_OK);
    char *text = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&text, &len);
    net_print_table(&n, out);
    fclose(out);
    CU_ASSERT(strstr(text, "folded into conv1's QAT weight") != NULL);
    CU_ASSERT(strstr(text, "not folded: conv2's output also feeds sum") != NULL);
    CU_ASSERT(strstr(text, "not folded: it reads relu") != NULL);
    CU_ASSERT(strstr(text, "folded into fc1's QAT weight") != NULL);
    if (!strstr(text, "fc1's QAT")) fprintf(stderr, "\n%s\n", text);
    CU_ASSERT(net_qat_layer(&n, 0)->bn == model_find_module(&n.model, "bn1"));
    CU_ASSERT(net_qat_layer(&n, 1)->bn == NULL); /* conv2 */
    CU_ASSERT(net_qat_layer(&n, 2)->bn == model_find_module(&n.model, "bn4"));
    free(text);
    net_free(&n);
    free(c);
    /* conv1 left float by the rules: bn1 stays a batch norm */
    const char *ov[] = {"quant.mode=qat", "quant.calibration_batches=2",
                        "quant.rules=[{module_path: conv1, skip: true}, {module_path: \".*\", weight_qtype: int8}]"};
    c = test_runs_config(&runs, "tests/configs/tiny-bn-fold.yaml", "fold-skip", ov, 3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c, NET_FRESH, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(n.bn_note[1], "bn1: not folded: conv1 is not quantized (no qat rule)");
    net_free(&n);
    free(c);
    /* quant.fold_bn: false folds none */
    const char *nf[] = {QAT_STATIC[0], QAT_STATIC[1], QAT_STATIC[2], "quant.fold_bn=false"};
    c = test_runs_config(&runs, "tests/configs/tiny-bn-fold.yaml", "fold-off", nf, 4);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c, NET_FRESH, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(n.bn_note[1], "bn1: not folded (quant.fold_bn: false)");
    for (int i = 0; i < net_hook_count(&n, &HOOK_QAT); i++) CU_ASSERT_PTR_NULL(net_qat_layer(&n, i)->bn);
    net_free(&n);
    free(c);
    check_convert("tests/configs/tiny-bn-fold.yaml", "fold-convert", QAT_STATIC, 3, 2);
}

/* The running statistics of module name in checkpoint ckpt (c's model): mean then var, [2 C], malloc'd; *count
 * gets num_batches_tracked. */
static float *stats_at(const Config *c, const char *ckpt, const char *name, int64_t *count) {
    Net n;
    test_runs_load_net(&n, c, ckpt);
    const Module *b = model_find_module(&n.model, name);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    size_t C = (size_t)b->in_shape[0];
    float *s = qa_alloc_floats(2 * C);
    memcpy(s, b->running_mean, C * sizeof(float));
    memcpy(s + C, b->running_var, C * sizeof(float));
    *count = b->num_batches_tracked;
    net_free(&n);
    return s;
}

/* quant.freeze_bn_after 25 (tiny-res-qat.yaml): the statistics move between the checkpoints of steps 10 and 20,
 * and not after step 25 (steps 30 and 40 hold the same, counted 25 batches); without it they move to the end. */
static void test_freeze_after(void) {
    const char *names[] = {"stem_bn", "bn1", "bn2"};
    for (int run = 0; run < 2; run++) {
        const char *sub = run ? "freeze-never" : "freeze-25";
        const char *ov[] = {"quant.freeze_bn_after=0"};
        Config *c = test_runs_config(&runs, "tests/configs/tiny-res-qat.yaml", sub, ov, run);
        CU_ASSERT_PTR_NOT_NULL_FATAL(c);
        CU_ASSERT_EQUAL(c->quant.freeze_bn_after, run ? 0 : 25);
        TrainResult r;
        QtError err = {0};
        QtStatus st = test_runs_train(c, NULL, 0, &r, &err);
        if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        for (int k = 0; k < 3; k++) {
            int64_t n10, n20, n30, n40;
            float *s10 = stats_at(c, test_runs_path(&runs, sub, "ckpt-00000010.h5"), names[k], &n10);
            float *s20 = stats_at(c, test_runs_path(&runs, sub, "ckpt-00000020.h5"), names[k], &n20);
            float *s30 = stats_at(c, test_runs_path(&runs, sub, "ckpt-00000030.h5"), names[k], &n30);
            float *s40 = stats_at(c, test_runs_path(&runs, sub, "final.h5"), names[k], &n40);
            size_t bytes = 2 * 8 * sizeof(float);
            CU_ASSERT(memcmp(s10, s20, bytes) != 0);
            CU_ASSERT_EQUAL(n10, 10);
            CU_ASSERT_EQUAL(n20, 20);
            if (run == 0) {
                CU_ASSERT(memcmp(s30, s40, bytes) == 0);
                CU_ASSERT(memcmp(s20, s30, bytes) != 0);
                CU_ASSERT(n30 == 25 && n40 == 25);
            } else {
                CU_ASSERT(memcmp(s30, s40, bytes) != 0);
                CU_ASSERT(n30 == 30 && n40 == 40);
            }
            free(s10), free(s20), free(s30), free(s40);
        }
        free(c);
    }
}

/* Stopped before the freeze (step 20) or after it (step 30) and resumed: the same run bit for bit. */
static void test_resume_across_freeze(void) {
    int n_bn = 0;
    double a = test_runs_resume_exact(&runs, "tests/configs/tiny-res-qat.yaml", "resume-20", 20, &n_bn);
    CU_ASSERT(a > 0.0);
    CU_ASSERT_EQUAL(n_bn, 3);
    double b = test_runs_resume_exact(&runs, "tests/configs/tiny-res-qat.yaml", "resume-30", 30, &n_bn);
    CU_ASSERT_EQUAL(a, b);
}

/* The folded_bn marker of /quant/<module> in file path into out[cap] ("" without one). */
static void marker_of(const char *path, const char *module, char *out, size_t cap) {
    H5ioFile f = H5IO_FILE_INIT;
    QtError err = {0};
    char g[128], *v = NULL;
    snprintf(g, sizeof g, "quant/%s", module);
    out[0] = '\0';
    CU_ASSERT_EQUAL_FATAL(h5io_open(&f, path, &err), QT_OK);
    if (h5io_attr_exists(&f, g, "folded_bn")) CU_ASSERT_EQUAL(h5io_attr_read_str(&f, g, "folded_bn", &v, &err), QT_OK);
    if (v) snprintf(out, cap, "%s", v);
    free(v);
    CU_ASSERT_EQUAL(h5io_close(&f, &err), QT_OK);
}

/* Loading checkpoint ckpt into c's net: its status, the message in err; with out, the net's eval output on a fixed
 * input (N 4, 10 classes) and *unfolded the number of c's batch norms that run as modules of their own. */
static QtStatus try_load(const Config *c, const char *ckpt, float *out, int *unfolded, QtError *err) {
    Net n;
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c, NET_SHELL, err), QT_OK);
    CheckpointNet p = net_checkpoint_parts(&n);
    QtStatus st = checkpoint_load_model(ckpt, &n.model, &p, err);
    if (st == QT_OK && out) {
        size_t nx = qtest_input_numel(&n.model.modules[0], 4);
        float *x = qa_alloc_floats(nx);
        for (size_t i = 0; i < nx; i++) x[i] = (float)((i * 37) % 101) / 101.0f;
        qtest_run_model(&n.model, x, 4, false, NULL, out, 40, NULL);
        free(x);
        *unfolded = 0;
        for (int i = 0; i < n.model.n_modules; i++)
            *unfolded += n.model.modules[i].running_mean && !n.model.modules[i].forward_hook;
        for (int i = 0; i < net_hook_count(&n, &HOOK_QAT); i++)
            if (net_qat_layer(&n, i)->bn) CU_ASSERT(net_qat_layer(&n, i)->bn->forward_hook != NULL);
    }
    net_free(&n);
    return st;
}

/* A QAT layer trained with a batch norm folded in names it in /quant/<module> folded_bn. A file without the marker
 * (as qtrain wrote them before QAT folded batch norms, training the batch norm unfolded) loads unfolded, as it
 * trained: the model quant.fold_bn: false builds, and it converts exactly; a marker this run does not fold is
 * refused. The fresh run's file loads folded and converts exactly. */
static void test_fold_marker(void) {
    const char *ov[] = {"train.steps=10", "train.checkpoint_every=0"};
    Config *c = test_runs_config(&runs, "tests/configs/tiny-res-qat.yaml", "marker", ov, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainResult r;
    QtError err = {0};
    QtStatus st = test_runs_train(c, NULL, 0, &r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    char ckpt[1024], old[1024], conv[1024], m[64];
    snprintf(ckpt, sizeof ckpt, "%s", test_runs_path(&runs, "marker", "final.h5"));
    snprintf(old, sizeof old, "%s", test_runs_path(&runs, "marker", "old.h5"));
    snprintf(conv, sizeof conv, "%s", test_runs_path(&runs, "marker", "ptq.h5"));
    const char *mods[4] = {"stem", "conv1", "conv2", "head"}, *bns[4] = {"stem_bn", "bn1", "bn2", ""};
    for (int k = 0; k < 4; k++) {
        marker_of(ckpt, mods[k], m, sizeof m);
        CU_ASSERT_STRING_EQUAL(m, bns[k]);
    }
    float folded[40], unfolded[40], as_off[40];
    int n_unf = -1;
    CU_ASSERT_EQUAL(try_load(c, ckpt, folded, &n_unf, &err), QT_OK);
    CU_ASSERT_EQUAL(n_unf, 0);
    ConvertReport rep;
    CU_ASSERT_EQUAL_FATAL(tools_convert(ckpt, conv, false, NULL, &rep, &err), QT_OK);
    CU_ASSERT_EQUAL(rep.test_accuracy_ptq, rep.test_accuracy_qat);
    CU_ASSERT_EQUAL(rep.test_loss_ptq, rep.test_loss_qat);

    /* the markers removed: an older qtrain's file */
    size_t size = 0;
    char *bytes = test_file_read(ckpt, &size);
    CU_ASSERT_PTR_NOT_NULL_FATAL(bytes);
    test_file_write(old, bytes, size);
    free(bytes);
    hid_t h = H5Fopen(old, H5F_ACC_RDWR, H5P_DEFAULT);
    CU_ASSERT_FATAL(h >= 0);
    for (int k = 0; k < 3; k++) {
        char g[64];
        snprintf(g, sizeof g, "/quant/%s", mods[k]);
        CU_ASSERT(H5Adelete_by_name(h, g, "folded_bn", H5P_DEFAULT) >= 0);
    }
    H5Fclose(h);
    CU_ASSERT_EQUAL(try_load(c, old, unfolded, &n_unf, &err), QT_OK);
    CU_ASSERT_EQUAL(n_unf, 3);
    CU_ASSERT(memcmp(unfolded, folded, sizeof folded) != 0);
    CU_ASSERT_EQUAL(tools_convert(old, conv, true, NULL, &rep, &err), QT_OK);
    CU_ASSERT_EQUAL(rep.test_accuracy_ptq, rep.test_accuracy_qat);
    CU_ASSERT_EQUAL(rep.test_loss_ptq, rep.test_loss_qat);
    /* ...the model quant.fold_bn: false builds from it, bit for bit; that run refuses the marked file */
    c->quant.fold_bn = false;
    CU_ASSERT_EQUAL(try_load(c, old, as_off, &n_unf, &err), QT_OK);
    CU_ASSERT_EQUAL(n_unf, 3);
    CU_ASSERT(memcmp(as_off, unfolded, sizeof as_off) == 0);
    CU_ASSERT_EQUAL(try_load(c, ckpt, NULL, NULL, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, ckpt) && test_msg_has(&err, "module stem") && test_msg_has(&err, "stem_bn") &&
              test_msg_has(&err, "folded_bn") && test_msg_has(&err, "fold_bn"));
    free(c);
}

static int qat_bn_runs_init(void) {
    runs.root = test_tmpdir_new();
    return runs.root ? 0 : -1;
}

static int qat_bn_runs_cleanup(void) { return test_runs_cleanup(&runs); }

int register_quant_qat_bn_runs_suite(void) {
    CU_pSuite s = CU_add_suite("quant_qat_bn_runs", qat_bn_runs_init, qat_bn_runs_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "which batch norms fold; the rules table; convert", test_fold_table_and_convert) ||
           !CU_add_test(s, "convert of tiny-bn is exact, its batch norm folded", test_convert_bn) ||
           !CU_add_test(s, "convert of tiny-res is exact, its batch norms folded", test_convert_res) ||
           !CU_add_test(s, "quant.freeze_bn_after stops the statistics", test_freeze_after) ||
           !CU_add_test(s, "resume across the freeze is bit-exact", test_resume_across_freeze) ||
           !CU_add_test(s, "folded_bn marks a folded QAT layer; a file without it loads unfolded, as it trained",
                        test_fold_marker);
}
