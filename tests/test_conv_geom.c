/* test_conv_geom.c - conv2d's general geometry reached from a config: groups
 * (depthwise), [h, w] kernel/stride/padding, padding 'same', dilation; its
 * resolved YAML, weight shapes and init, errors at the layer's line, a
 * depthwise-separable CNN trained end to end and resumed; and the hooks on
 * it: PTQ (int8 declines grouped convs), QAT, QT's refusal, QLoRA on the
 * pointwise convs and the refusal of adapters on a depthwise one. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora/lora.h"
#include "nn/model.h"
#include "nn/ops.h"
#include "quant/qat.h"
#include "quant/qgemm.h"
#include "quant/qlayer.h"
#include "quant/qtype.h"
#include "test_proc.h"
#include "test_runs.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/tools.h"
#include "trainer/train.h"

static char *tmp_root; /* the suite's scratch directory */
static TestRuns runs;  /* its runs: root = tmp_root, no float base */

#define NAME "t.yaml"
#define GEO_HEAD               \
    "model:\n"                 \
    "  input: [4, 9, 8]\n"     \
    "  layers:\n"              \
    "    - {name: a, type: conv2d, out_channels: 4, kernel: 3, padding: 1}\n"

static QtStatus load_layers(Config *c, const char *tail, QtError *e) {
    char text[1024];
    snprintf(text, sizeof text, GEO_HEAD "%s    - {type: flatten}\n    - {type: dense, units: 3}\n", tail);
    return config_load_string(c, text, NAME, NULL, 0, e);
}

static void expect_geo_error(int line, const char *tail, const char *n1, const char *n2, const char *n3) {
    char text[1024];
    snprintf(text, sizeof text, GEO_HEAD "%s    - {type: flatten}\n    - {type: dense, units: 3}\n", tail);
    test_expect_config_error(__FILE__, line, text, n1, n2, n3);
}

/* The keys load, the resolved YAML writes [h, w] only where the axes differ
 * (a plain conv2d's line is as it always was) and loads back to itself. */
static void test_geom_config(void) {
    Config c;
    QtError e = {0};
    const char *tail = "    - {name: dw, type: conv2d, out_channels: 8, kernel: [3, 1], padding: same, groups: 4, "
                       "dilation: [2, 1], bias: false}\n"
                       "    - {name: r, type: conv2d, out_channels: 8, kernel: 2, stride: [2, 1], padding: [1, 0]}\n";
    CU_ASSERT_EQUAL_FATAL(load_layers(&c, tail, &e), QT_OK);
    const LayerSpec *dw = &c.model.layers[1], *r = &c.model.layers[2];
    CU_ASSERT(dw->kernel == 3 && dw->kernel_w == 1 && dw->padding_same && dw->groups == 4 && dw->dilation == 2 &&
              dw->dilation_w == 1 && dw->stride == 1 && dw->stride_w == 1);
    CU_ASSERT(r->stride == 2 && r->stride_w == 1 && r->padding == 1 && r->padding_w == 0 && r->groups == 1);
    char *yaml = config_to_yaml(&c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(yaml);
    CU_ASSERT_PTR_NOT_NULL(strstr(yaml, "{name: a, type: conv2d, out_channels: 4, kernel: 3, stride: 1, padding: 1, "
                                        "bias: true, init: default}"));
    CU_ASSERT_PTR_NOT_NULL(strstr(yaml, "{name: dw, type: conv2d, out_channels: 8, kernel: [3, 1], stride: 1, "
                                        "padding: same, dilation: [2, 1], groups: 4, bias: false, init: default}"));
    CU_ASSERT_PTR_NOT_NULL(strstr(yaml, "{name: r, type: conv2d, out_channels: 8, kernel: 2, stride: [2, 1], "
                                        "padding: [1, 0], bias: true"));
    Config back;
    CU_ASSERT_EQUAL(config_load_string(&back, yaml, "resolved", NULL, 0, &e), QT_OK);
    char *again = config_to_yaml(&back);
    CU_ASSERT(again && strcmp(again, yaml) == 0);
    free(again);
    free(yaml);
    /* existing configs resolve as before: no groups or dilation keys, no lists */
    Config cnn;
    CU_ASSERT_EQUAL_FATAL(config_load(&cnn, "tests/configs/tiny-cnn.yaml", NULL, 0, &e), QT_OK);
    yaml = config_to_yaml(&cnn);
    CU_ASSERT(yaml && !strstr(yaml, "groups") && !strstr(yaml, "dilation") && !strstr(yaml, "kernel: ["));
    free(yaml);
}

/* Each bad geometry: a config error at the layer's line (5), saying what is wrong. */
static void test_geom_errors(void) {
    expect_geo_error(__LINE__, "    - {name: g, type: conv2d, out_channels: 6, kernel: 3, groups: 3}\n", "t.yaml:5:",
                     "'g'", "groups 3 must divide its 4 input channels");
    expect_geo_error(__LINE__, "    - {name: g, type: conv2d, out_channels: 6, kernel: 3, groups: 4}\n", "t.yaml:5:",
                     "groups 4", "6 out_channels");
    expect_geo_error(__LINE__, "    - {name: k, type: conv2d, out_channels: 4, kernel: [3, 9]}\n", "t.yaml:5:",
                     "'k'", "kernel 3x9 at dilation [1, 1] spans 3x9, larger than its input (4, 9, 8) padded to 9x8");
    expect_geo_error(__LINE__, "    - {name: k, type: conv2d, out_channels: 4, kernel: 3, dilation: 5}\n",
                     "t.yaml:5:", "spans 11x11", NULL);
    expect_geo_error(__LINE__, "    - {name: s, type: conv2d, out_channels: 4, kernel: 3, stride: 2, padding: same}\n",
                     "t.yaml:5:", "'s'", "padding 'same' needs stride 1");
    expect_geo_error(__LINE__, "    - {name: s, type: conv2d, out_channels: 4, kernel: [3, 3, 3]}\n", "t.yaml:5:",
                     "model.layers[1].kernel", "[h, w]");
    expect_geo_error(__LINE__, "    - {name: s, type: conv2d, out_channels: 4, kernel: 3, padding: valid}\n",
                     "t.yaml:5:", "model.layers[1].padding", "same");
    expect_geo_error(__LINE__, "    - {name: s, type: conv2d, out_channels: 4, kernel: [3, 0]}\n", "t.yaml:5:",
                     "model.layers[1].kernel[1]", NULL);
    expect_geo_error(__LINE__, "    - {name: s, type: conv2d, out_channels: 4, kernel: 3, groups: 0}\n", "t.yaml:5:",
                     "model.layers[1].groups", NULL);
}

/* Weight (OC, C/groups, KH, KW), init bound 1/sqrt(C/groups*KH*KW) as
 * PyTorch's, the forward is nn_conv2d_general's, the plain conv keeps its
 * geometry flag, and the FLOPs count C/groups. */
static void test_geom_model(void) {
    LayerSpec layers[] = {{.type = LAYER_CONV2D, .name = "plain", .out_channels = 4, .kernel = 3, .padding = 1},
                          {.type = LAYER_CONV2D, .name = "dw", .out_channels = 8, .kernel = 3, .kernel_w = 1,
                           .stride = 1, .stride_w = 2, .padding = 2, .padding_w = 0, .dilation = 2, .groups = 4}};
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){2, 7, 6}, layers, 2, &err), QT_OK);
    CU_ASSERT(m.modules[0].conv_plain);
    CU_ASSERT(!m.modules[1].conv_plain);
    const Tensor *w = &m.modules[1].weight->var.value;
    CU_ASSERT(w->ndim == 4 && w->shape[0] == 8 && w->shape[1] == 1 && w->shape[2] == 3 && w->shape[3] == 1);
    /* H: (7 + 4 - 2*2 - 1)/1 + 1 = 7; W: (6 - 1)/2 + 1 = 3 */
    CU_ASSERT(m.modules[1].out_shape[0] == 8 && m.modules[1].out_shape[1] == 7 && m.modules[1].out_shape[2] == 3);
    CU_ASSERT_DOUBLE_EQUAL(model_forward_flops(&m), 2.0 * 4 * 7 * 6 * 2 * 9 + 2.0 * 8 * 7 * 3 * 1 * 3, 1e-9);
    Rng rng;
    rng_init(&rng, 3, 0);
    model_init_params(&m, &rng);
    float mx = 0.0f, bound = 1.0f / sqrtf(3.0f); /* fan_in = C/groups*KH*KW = 1*3*1 */
    for (int i = 0; i < 24; i++) mx = fmaxf(mx, fabsf(w->data[i]));
    CU_ASSERT(mx <= bound && mx > 0.7f * bound);

    TestEnv e;
    test_env_init(&e, 1);
    float x[2 * 2 * 7 * 6];
    for (int i = 0; i < (int)(sizeof x / sizeof x[0]); i++) x[i] = sinf(0.37f * (float)i);
    Var *vx = test_var(&e, x, 4, (int[]){2, 2, 7, 6}, false);
    Var *y = model_forward(&m, &e.tape, vx);
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    Var *a = nn_conv2d(&e.tape, vx, &m.modules[0].weight->var, &m.modules[0].bias->var, 1, 1);
    Var *b = nn_conv2d_general(&e.tape, a, &m.modules[1].weight->var, &m.modules[1].bias->var, &m.modules[1].geom);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    CU_ASSERT(m.modules[1].geom.dil_h == 2 && m.modules[1].geom.dil_w == 2 && m.modules[1].geom.stride_w == 2);
    CU_ASSERT(memcmp(y->value.data, b->value.data, var_numel(b) * sizeof(float)) == 0);
    test_env_free(&e);
    model_free(&m);
}

/* ---- end to end ---------------------------------------------------------------------- */

static int geom_suite_init(void) {
    runs.root = tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int geom_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    runs.root = tmp_root = NULL;
    return ok ? 0 : -1;
}

static bool model_from(const Config *c, Model *m) {
    QtError err = {0};
    return model_init(m, c->model.input_ndim, c->model.input_shape, c->model.layers, c->model.n_layers, &err) == QT_OK;
}

/* The depthwise-separable CNN learns; 40 steps straight equal 13 (mid-epoch),
 * stop, resume, 27, bit for bit in every parameter. */
static void test_dw_cnn_trains_and_resumes(void) {
    int n_bn = 0;
    double acc = test_runs_resume_exact(&runs, "tests/configs/tiny-dw.yaml", "dw", 13, &n_bn);
    printf("(test accuracy %.3f) ", acc);
    CU_ASSERT(acc > 0.2); /* 40 steps: well above chance (0.1) */
    CU_ASSERT_EQUAL(n_bn, 3);
    Config *c = test_runs_config(&runs, "tests/configs/tiny-dw.yaml", "dw-straight", NULL, 0);
    CU_ASSERT_FATAL(c != NULL);
    Model m;
    QtError err = {0};
    char path[1100];
    snprintf(path, sizeof path, "%s/final.h5", c->run.out_dir);
    CU_ASSERT_FATAL(model_from(c, &m));
    CU_ASSERT_EQUAL(checkpoint_load_params(path, &m, &err), QT_OK);
    Param *dw = model_find_param(&m, "dw/weight");
    CU_ASSERT(dw && dw->var.value.shape[0] == 8 && dw->var.value.shape[1] == 1); /* (OC, C/groups, KH, KW) */
    model_free(&m);
    free(c);
}

/* ---- the hooks on grouped convolutions ----------------------------------------------- */

/* A depthwise, dilated conv quantized to int8 per output channel: one scale
 * per channel over (OC, C/groups*KH*KW); its forward is the general
 * convolution on the dequantized weight, bit for bit; the int8 kernels
 * decline it (and take the same layer's plain twin). */
static void test_ptq_grouped_layer(void) {
    LayerSpec layers[] = {{.type = LAYER_CONV2D, .name = "dw", .out_channels = 4, .kernel = 3, .padding = 2,
                           .dilation = 2, .groups = 4},
                          {.type = LAYER_CONV2D, .name = "plain", .out_channels = 4, .kernel = 3, .padding = 1}};
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){4, 6, 6}, layers, 2, &err), QT_OK);
    Rng rng;
    rng_init(&rng, 9, 0);
    model_init_params(&m, &rng);
    QLayerSpec spec = qlayer_spec_default();
    spec.weight_qtype = qtype_find("int8", NULL);
    spec.act_qtype = qtype_find("int8", NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(spec.weight_qtype);
    QLayer q[2];
    for (int i = 0; i < 2; i++)
        CU_ASSERT_EQUAL_FATAL(qlayer_init_quantize(&q[i], &m.modules[i], &spec, m.modules[i].weight->var.value.data,
                                                   &err), QT_OK);
    CU_ASSERT_EQUAL(q[0].weight.n_scales, 4); /* one per channel of the depthwise weight (4, 1, 3, 3) */
    CU_ASSERT_EQUAL(q[0].fan_in, 9);
    CU_ASSERT(!qlayer_int8_supported(&q[0]));
    CU_ASSERT(qlayer_int8_supported(&q[1]));
    /* both have int8 weights and inputs: the depthwise one counts among a run's int8 layers, not on the kernels */
    CU_ASSERT(qlayer_int8_formats(&q[0]));
    CU_ASSERT(qlayer_int8_formats(&q[1]));
    float wdq[36];
    qlayer_dequantize_weight(&q[0], wdq);
    TestEnv e;
    test_env_init(&e, 2);
    float x[2 * 4 * 6 * 6];
    for (int i = 0; i < (int)(sizeof x / sizeof x[0]); i++) x[i] = cosf(0.21f * (float)i);
    Var *vx = test_var(&e, x, 4, (int[]){2, 4, 6, 6}, false);
    Var *vw = test_var(&e, wdq, 4, (int[]){4, 1, 3, 3}, false);
    Var *want = nn_conv2d_general(&e.tape, vx, vw, &m.modules[0].bias->var, &m.modules[0].geom);
    qlayer_install(&q[0]);
    Var *got = model_step(&m, &e.tape, 0, (Var *[]){vx, NULL, NULL});
    CU_ASSERT_FATAL(want && got);
    CU_ASSERT(memcmp(want->value.data, got->value.data, var_numel(want) * sizeof(float)) == 0);
    test_env_free(&e);
    for (int i = 0; i < 2; i++) qlayer_free(&q[i]);
    model_free(&m);
}

/* The float depthwise-separable CNN, trained once for the tests below. */
static TrainResult dw_base_result;

static const char *dw_base(void) {
    static char path[1100];
    if (path[0]) return path;
    Config *c = test_runs_config(&runs, "tests/configs/tiny-dw.yaml", "dw-base", NULL, 0);
    QtError err = {0};
    TrainOptions o = {.quiet = true};
    if (!c || train_run(c, &o, &dw_base_result, &err) != QT_OK) {
        fprintf(stderr, "\n  dw-base: %s\n", err.msg);
        free(c);
        return NULL;
    }
    snprintf(path, sizeof path, "%s/final.h5", c->run.out_dir);
    free(c);
    return path;
}

static Config *dw_config(const char *sub, const char *const *ov, int n) {
    char out_dir[512];
    const char *all[8];
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/%s", tmp_root, sub);
    all[0] = out_dir;
    for (int i = 0; i < n; i++) all[1 + i] = ov[i];
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    if (c && config_load(c, "tests/configs/tiny-dw.yaml", all, n + 1, &err) != QT_OK) {
        fprintf(stderr, "\n  tiny-dw (%s): %s\n", sub, err.msg);
        free(c);
        return NULL;
    }
    return c;
}

/* PTQ int8 (weights per channel, inputs calibrated) of the trained depthwise
 * model evaluates close to float, on the int8 kernels where they apply; and
 * `qtrain quantize` writes it and `qtrain eval` reads it back. */
static void test_ptq_int8_dw_model(void) {
    const char *base = dw_base();
    CU_ASSERT_PTR_NOT_NULL_FATAL(base);
    char init[1200];
    snprintf(init, sizeof init, "model.init_from=%s", base);
    const char *ov[] = {init, "quant.mode=ptq",
                        "quant.rules=[{module_path: \".*\", weight_qtype: int8, act_qtype: int8}]", "train.steps=0",
                        "train.epochs=0"};
    Config *q = dw_config("dw-ptq", ov, 5);
    CU_ASSERT_FATAL(q != NULL);
    bool portable = qgemm_force_portable;
    qgemm_force_portable = !qgemm_cpu_has_vnni(); /* the int8 kernels run here either way */
    QtError err = {0};
    TrainResult rq, rf = dw_base_result;
    TrainOptions o = {.quiet = true};
    QtStatus st = train_run(q, &o, &rq, &err);
    if (st != QT_OK) fprintf(stderr, "\n  ptq eval: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    printf("(float %.3f, int8 %.3f) ", rf.test_accuracy, rq.test_accuracy);
    CU_ASSERT(fabs(rq.test_accuracy - rf.test_accuracy) <= 0.03);
    CU_ASSERT(fabs(rq.test_loss - rf.test_loss) <= 0.05 * rf.test_loss);
    CU_ASSERT(rq.test_loss != rf.test_loss); /* it did quantize */
    qgemm_force_portable = portable;
    /* summary.json counts the int8 layers and those on the kernels: all four, the depthwise dw too */
    char sum[1100];
    snprintf(sum, sizeof sum, "%s/dw-ptq/summary.json", tmp_root);
    char *js = test_file_read(sum, NULL);
    CU_ASSERT(js && strstr(js, "\"int8_layers\": 4,") && strstr(js, "\"int8_kernel_layers\": 4,"));
    if (js && !strstr(js, "\"int8_kernel_layers\": 4,")) fprintf(stderr, "\n%s\n", js);
    free(js);
    /* and the rules table printed at the start names no layer that falls back */
    char tdir[1100], tlog[1100], w8a8[] = "quant.rules=[{module_path: \".*\", weight_qtype: int8, act_qtype: int8}]";
    snprintf(tdir, sizeof tdir, "run.out_dir=%s/dw-table", tmp_root);
    snprintf(tlog, sizeof tlog, "%s/dw-table.log", tmp_root);
    const char *targs[] = {"--config", "tests/configs/tiny-dw.yaml", "--set", tdir, "--set", init, "--set",
                           "quant.mode=ptq", "--set", w8a8, "--set", "train.epochs=0", "--set", "train.steps=0", NULL};
    CU_ASSERT_EQUAL(test_proc_run(tlog, targs, 120.0), 0);
    char *table = test_file_read(tlog, NULL);
    const bool listed = table && strstr(table, "  int8_kernel: ") && !strstr(table, "dequantized float");
    CU_ASSERT(listed);
    if (!listed) fprintf(stderr, "\n%s\n", table ? table : "(no output)");
    free(table);
    char out[1100], log[1100], rules[] = "quant.rules=[{module_path: \".*\", weight_qtype: int8}]";
    snprintf(out, sizeof out, "%s/dw-int8.h5", tmp_root);
    snprintf(log, sizeof log, "%s/dw-quantize.log", tmp_root);
    const char *qargs[] = {"quantize", "--config", "tests/configs/tiny-dw.yaml", "--checkpoint",
                           base, "--out", out, "--set", "quant.mode=ptq", "--set", rules, NULL};
    CU_ASSERT_EQUAL(test_proc_run(log, qargs, 120.0), 0);
    const char *eargs[] = {"eval", "--checkpoint", out, "--quiet", NULL};
    CU_ASSERT_EQUAL(test_proc_run(log, eargs, 120.0), 0);
    char *text = test_file_read(log, NULL);
    bool ok = text && strstr(text, "test_accuracy:");
    if (!ok) fprintf(stderr, "\n  %s:\n%s\n", log, text ? text : "(none)");
    CU_ASSERT(ok);
    free(text);
    free(q);
}

/* QAT (int8 weights per channel and int8 inputs) trains the depthwise
 * model, and `convert` to PTQ evaluates exactly as the QAT model did. At
 * the config's lr of 0.05 the 40 QAT steps ended anywhere from 0.14 to 0.42
 * test accuracy with the thread count and the BLAS kernels (sums that differ
 * in their last bits); at 0.01, from 0.27 to 0.31. */
static void test_qat_dw_trains(void) {
    const char *ov[] = {"quant.mode=qat", "quant.rules=[{module_path: \".*\", weight_qtype: int8, act_qtype: int8, "
                                          "act_static_scale: true}]", "train.optimizer.lr=0.01"};
    Config *c = dw_config("dw-qat", ov, 3);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    TrainResult r;
    TrainOptions o = {.quiet = true};
    QtStatus st = train_run(c, &o, &r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  qat: %s\n", err.msg);
    CU_ASSERT_EQUAL(st, QT_OK);
    printf("(test accuracy %.3f) ", r.test_accuracy);
    CU_ASSERT(r.test_accuracy > 0.2);
    char ckpt[1100], out[1100];
    snprintf(ckpt, sizeof ckpt, "%s/final.h5", c->run.out_dir);
    snprintf(out, sizeof out, "%s/dw-qat-int8.h5", tmp_root);
    ConvertReport rep = {0};
    st = tools_convert(ckpt, out, false, NULL, &rep, &err);
    if (st != QT_OK) fprintf(stderr, "\n  convert: %s\n", err.msg);
    CU_ASSERT_EQUAL(st, QT_OK);
    CU_ASSERT_EQUAL(rep.modules, 4);
    CU_ASSERT_EQUAL(rep.test_loss_ptq, rep.test_loss_qat);
    CU_ASSERT_EQUAL(rep.test_accuracy_ptq, rep.test_accuracy_qat);
    /* its weight is one row per output channel: a depthwise conv gets one scale per channel */
    Model m;
    CU_ASSERT_FATAL(model_from(c, &m));
    QLayerSpec spec = qlayer_spec_default();
    spec.weight_qtype = qtype_find("int8", NULL);
    QatSpec qs = qat_spec_default();
    QatLayer ql;
    Module *dw = model_find_module(&m, "dw");
    CU_ASSERT_EQUAL_FATAL(qat_layer_init(&ql, dw, &spec, &qs, &err), QT_OK);
    CU_ASSERT(ql.w_ndim == 2 && ql.w_shape[0] == 8 && ql.w_shape[1] == 9);
    qat_layer_free(&ql);
    model_free(&m);
    free(c);
}

/* QT refuses the depthwise conv, naming it; QLoRA (nf4 base) with adapters
 * on the pointwise conv trains from the float model; adapters on the
 * depthwise conv are refused naming it and the pointwise conv to adapt. */
static void test_qt_and_lora_on_dw(void) {
    const char *qt[] = {"quant.mode=qt", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]"};
    Config *c = dw_config("dw-qt", qt, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    TrainResult r;
    TrainOptions o = {.quiet = true};
    CU_ASSERT_EQUAL(train_run(c, &o, &r, &err), QT_ERR_CONFIG);
    CU_ASSERT(strstr(err.msg, "dw") && strstr(err.msg, "grouped"));
    free(c);

    const char *base = dw_base();
    CU_ASSERT_PTR_NOT_NULL_FATAL(base);
    char init[1200];
    snprintf(init, sizeof init, "model.init_from=%s", base);
    const char *ql[] = {init, "quant.mode=ptq",
                        "quant.rules=[{module_path: \"conv1|dw|pw\", weight_qtype: nf4, tile_size: 8}]",
                        "lora.rules=[{module_path: pw, rank: 4, alpha: 8}]", "lora.trainable=[head]"};
    c = dw_config("dw-qlora", ql, 5);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtStatus st = train_run(c, &o, &r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  qlora: %s\n", err.msg);
    CU_ASSERT_EQUAL(st, QT_OK);
    printf("(qlora test accuracy %.3f) ", r.test_accuracy);
    CU_ASSERT(r.test_accuracy > 0.2);
    free(c);

    /* a config error at the rule */
    const char *bad[] = {"lora.rules=[{module_path: \"dw|pw\", rank: 2}]"};
    c = dw_config("dw-lora-bad", bad, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    memset(&err, 0, sizeof err);
    st = train_run(c, &o, &r, &err);
    CU_ASSERT_EQUAL(st, QT_ERR_CONFIG);
    bool ok = strstr(err.msg, "dw") && strstr(err.msg, "depthwise") && strstr(err.msg, "pointwise") &&
              strstr(err.msg, "'pw'");
    if (!ok) fprintf(stderr, "\n  message: %s\n", err.msg);
    CU_ASSERT(ok);
    free(c);
}

/* m.modules[i] with an adapter of rank 4 (A, B filled) equals its merged
 * weight's forward, within float rounding. */
static void check_lora_merge(Model *m, int i, const int *x_shape) {
    Module *mod = &m->modules[i];
    LoraSpec spec = {.rank = 4, .alpha = 2.0f};
    LoraAdapter a;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, mod, &spec, &err), QT_OK);
    const Tensor *A = &a.A.var.value, *B = &a.B.var.value, *W = &mod->weight->var.value;
    int g = mod->spec.groups;
    CU_ASSERT(A->shape[0] == 4 && A->shape[1] == W->shape[1] && A->shape[2] == W->shape[2] &&
              A->shape[3] == W->shape[3]);
    CU_ASSERT(B->shape[0] == W->shape[0] && B->shape[1] == 4 / g && B->shape[2] == 1 && B->shape[3] == 1);
    for (size_t k = 0; k < tensor_numel(A); k++) A->data[k] = 0.3f * sinf((float)k);
    for (size_t k = 0; k < tensor_numel(B); k++) B->data[k] = 0.2f * cosf((float)k);
    TestEnv e;
    test_env_init(&e, 5);
    size_t n = (size_t)x_shape[0] * x_shape[1] * x_shape[2] * x_shape[3];
    float *x = malloc(n * sizeof *x), *merged = malloc(tensor_numel(W) * sizeof *merged);
    for (size_t k = 0; k < n; k++) x[k] = sinf(0.13f * (float)k);
    Var *vx = test_var(&e, x, 4, x_shape, false);
    lora_adapter_install(&a);
    Var *outs[8] = {0};
    outs[1 + mod->inputs[0]] = vx;
    Var *got = model_step(m, &e.tape, i, outs);
    memcpy(merged, W->data, tensor_numel(W) * sizeof *merged);
    lora_adapter_merge(&a, merged);
    Var *vw = test_var(&e, merged, 4, W->shape, false);
    Var *want = model_conv_forward(&e.tape, mod, vx, vw, mod->bias ? &mod->bias->var : NULL);
    CU_ASSERT_FATAL(got && want);
    CU_ASSERT(test_close_ratio(got->value.data, want->value.data, var_numel(want), 1e-5, 1e-4, NULL) <= 1.0);
    test_env_free(&e);
    mod->forward_hook = NULL, mod->fused_hook = NULL;
    lora_adapter_free(&a);
    free(x), free(merged);
}

/* Adapters at a conv's geometry: a one-group conv with [h, w] kernel, 'same'
 * padding and dilation, and a grouped conv with PEFT's shapes, each equal to
 * its merge; a rank not a multiple of groups is refused, and a depthwise conv
 * points at the pointwise conv. */
static void test_lora_geometry(void) {
    LayerSpec layers[] = {{.type = LAYER_CONV2D, .name = "c", .out_channels = 6, .kernel = 3, .kernel_w = 1,
                           .stride = 1, .stride_w = 1, .padding_same = true, .dilation = 2, .dilation_w = 1},
                          {.type = LAYER_CONV2D, .name = "g", .out_channels = 6, .kernel = 3, .stride = 2,
                           .padding = 1, .groups = 2},
                          {.type = LAYER_CONV2D, .name = "d", .out_channels = 6, .kernel = 3, .padding = 1,
                           .groups = 6}};
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, 3, (int[]){4, 7, 5}, layers, 3, &err), QT_OK);
    Rng rng;
    rng_init(&rng, 4, 0);
    model_init_params(&m, &rng);
    LoraSpec spec = {.rank = 3, .alpha = 2.0f};
    CU_ASSERT_EQUAL(lora_spec_check(&spec, &m.modules[1], &err), QT_ERR_CONFIG);
    CU_ASSERT(strstr(err.msg, "g:") && strstr(err.msg, "multiple of the conv2d's groups 2"));
    memset(&err, 0, sizeof err);
    spec.rank = 2;
    CU_ASSERT_EQUAL(lora_spec_check(&spec, &m.modules[2], &err), QT_ERR_CONFIG);
    CU_ASSERT(strstr(err.msg, "d:") && strstr(err.msg, "depthwise") && strstr(err.msg, "pointwise"));
    check_lora_merge(&m, 0, (int[]){2, 4, 7, 5});
    check_lora_merge(&m, 1, (int[]){2, 6, 7, 5});
    model_free(&m);
}

/* LoRA with PEFT's grouped shapes on a grouped pointwise conv (groups 2)
 * over a float base: trains, resumes bit for bit after a stop, and merges
 * into the conv with the same test loss. */
static void test_grouped_lora_run(void) {
    const char *g2 = "model.layers.6.groups=2";
    Config *base = dw_config("g-base", &g2, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(base);
    QtError err = {0};
    TrainResult r, rs;
    TrainOptions o = {.quiet = true}, stop = {.quiet = true, .stop_at_step = 13}, resume = {.quiet = true,
                                                                                           .resume = "auto"};
    CU_ASSERT_EQUAL_FATAL(train_run(base, &o, &r, &err), QT_OK);
    char init[1200];
    snprintf(init, sizeof init, "model.init_from=%s/final.h5", base->run.out_dir);
    const char *ov[] = {g2, init, "lora.rules=[{module_path: pw, rank: 4}]", "lora.trainable=[head]",
                        "train.checkpoint_every=5"};
    Config *a = dw_config("g-lora", ov, 5), *b = dw_config("g-lora-split", ov, 5);
    CU_ASSERT_FATAL(a && b);
    QtStatus st = train_run(a, &o, &r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  grouped lora: %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    printf("(test accuracy %.3f) ", r.test_accuracy);
    CU_ASSERT(r.test_accuracy > 0.2);
    CU_ASSERT_EQUAL_FATAL(train_run(b, &stop, &rs, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(train_run(b, &resume, &rs, &err), QT_OK);
    CU_ASSERT_EQUAL(rs.test_loss, r.test_loss);
    CU_ASSERT_EQUAL(rs.test_accuracy, r.test_accuracy);
    char ckpt[1100], out[1100];
    snprintf(ckpt, sizeof ckpt, "%s/final.h5", a->run.out_dir);
    snprintf(out, sizeof out, "%s/g-merged.h5", tmp_root);
    MergeReport rep = {0};
    st = tools_merge(ckpt, out, false, false, NULL, &rep, &err);
    if (st != QT_OK) fprintf(stderr, "\n  merge: %s\n", err.msg);
    CU_ASSERT_EQUAL(st, QT_OK);
    CU_ASSERT_EQUAL(rep.modules, 1);
    CU_ASSERT(fabs(rep.test_loss_after - rep.test_loss_before) <= 1e-5 * rep.test_loss_before);
    CU_ASSERT_EQUAL(rep.test_accuracy_after, rep.test_accuracy_before);
    free(base), free(a), free(b);
}

int register_conv_geom_suite(void) {
    CU_pSuite s = CU_add_suite("conv_geom", geom_suite_init, geom_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "conv2d geometry keys, resolved YAML ([h, w] only where the axes differ)",
                        test_geom_config) ||
           !CU_add_test(s, "conv2d geometry errors at the layer's line", test_geom_errors) ||
           !CU_add_test(s, "grouped/dilated conv2d: weight shape, init, forward, FLOPs", test_geom_model) ||
           !CU_add_test(s, "depthwise-separable CNN trains end to end; resume is bit-identical",
                        test_dw_cnn_trains_and_resumes) ||
           !CU_add_test(s, "PTQ of a grouped, dilated conv: per-channel scales, exact forward, no int8 kernel",
                        test_ptq_grouped_layer) ||
           !CU_add_test(s, "PTQ int8 of the depthwise model is close to float; quantize and eval run",
                        test_ptq_int8_dw_model) ||
           !CU_add_test(s, "QAT trains the depthwise model, one weight scale per channel; convert is exact",
                        test_qat_dw_trains) ||
           !CU_add_test(s, "QT refuses the depthwise conv; QLoRA on the pointwise conv trains; adapters on the "
                        "depthwise conv are refused", test_qt_and_lora_on_dw) ||
           !CU_add_test(s, "LoRA at a conv's geometry and groups (PEFT's shapes) equals its merge; bad ranks, depthwise refused", test_lora_geometry) ||
           !CU_add_test(s, "grouped LoRA on a grouped pointwise conv trains, resumes exactly, merges",
                        test_grouped_lora_run);
}
