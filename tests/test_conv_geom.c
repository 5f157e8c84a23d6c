/* test_conv_geom.c - conv2d's general geometry reached from a config: groups
 * (depthwise), [h, w] kernel/stride/padding, padding 'same', dilation; its
 * resolved YAML, weight shapes and init, errors at the layer's line, and a
 * depthwise-separable CNN trained end to end and resumed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "nn/ops.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/train.h"

static char *tmp_root; /* the suite's scratch directory */

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
    Config c;
    QtError e = {0};
    QtStatus st = load_layers(&c, tail, &e);
    bool ok = st == QT_ERR_CONFIG && strstr(e.msg, n1) && (!n2 || strstr(e.msg, n2)) && (!n3 || strstr(e.msg, n3));
    if (!ok) fprintf(stderr, "\n  %s:%d: status %d, message: %s\n", __FILE__, line, st, e.msg);
    CU_assertImplementation(ok, (unsigned)line, "config error as expected", __FILE__, "", CU_FALSE);
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
    tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int geom_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

static Config *load_run_config(const char *path, const char *sub) {
    char out_dir[512];
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/%s", tmp_root, sub);
    const char *ov[] = {out_dir};
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    if (c && config_load(c, path, ov, 1, &err) != QT_OK) {
        fprintf(stderr, "\n  config %s: %s\n", path, err.msg);
        free(c);
        return NULL;
    }
    return c;
}

static bool model_from(const Config *c, Model *m) {
    QtError err = {0};
    return model_init(m, c->model.input_ndim, c->model.input_shape, c->model.layers, c->model.n_layers, &err) == QT_OK;
}

/* The depthwise-separable CNN learns; 40 steps straight equal 13 (mid-epoch),
 * stop, resume, 27, bit for bit in every parameter. */
static void test_dw_cnn_trains_and_resumes(void) {
    Config *a = load_run_config("tests/configs/tiny-dw.yaml", "dw-straight");
    Config *b = load_run_config("tests/configs/tiny-dw.yaml", "dw-split");
    CU_ASSERT_FATAL(a && b);
    QtError err = {0};
    TrainResult ra, rb;
    TrainOptions o = {.quiet = true}, stop = {.quiet = true, .stop_at_step = 13}, resume = {.quiet = true,
                                                                                           .resume = "auto"};
    CU_ASSERT_EQUAL_FATAL(train_run(a, &o, &ra, &err), QT_OK);
    printf("(test accuracy %.3f) ", ra.test_accuracy);
    CU_ASSERT(ra.test_accuracy > 0.2); /* 40 steps: well above chance (0.1) */
    CU_ASSERT_EQUAL_FATAL(train_run(b, &stop, &rb, &err), QT_OK);
    CU_ASSERT_EQUAL(rb.steps, 13);
    CU_ASSERT_EQUAL_FATAL(train_run(b, &resume, &rb, &err), QT_OK);
    CU_ASSERT_EQUAL(rb.steps, ra.steps);
    CU_ASSERT_EQUAL(rb.test_accuracy, ra.test_accuracy);
    CU_ASSERT_EQUAL(rb.test_loss, ra.test_loss);
    char fa[1100], fb[1100];
    snprintf(fa, sizeof fa, "%s/final.h5", a->run.out_dir);
    snprintf(fb, sizeof fb, "%s/final.h5", b->run.out_dir);
    Model ma, mb;
    CU_ASSERT_FATAL(model_from(a, &ma) && model_from(a, &mb));
    CU_ASSERT_EQUAL(checkpoint_load_params(fa, &ma, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(fb, &mb, &err), QT_OK);
    Param *dw = model_find_param(&ma, "dw/weight");
    CU_ASSERT(dw && dw->var.value.shape[0] == 8 && dw->var.value.shape[1] == 1);
    for (int i = 0; i < ma.n_params; i++)
        CU_ASSERT(memcmp(ma.params[i].var.value.data, mb.params[i].var.value.data,
                         var_numel(&ma.params[i].var) * sizeof(float)) == 0);
    model_free(&ma), model_free(&mb);
    free(a), free(b);
}

int register_conv_geom_suite(void) {
    CU_pSuite s = CU_add_suite("conv_geom", geom_suite_init, geom_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "conv2d geometry keys, resolved YAML ([h, w] only where the axes differ)",
                        test_geom_config) ||
           !CU_add_test(s, "conv2d geometry errors at the layer's line", test_geom_errors) ||
           !CU_add_test(s, "grouped/dilated conv2d: weight shape, init, forward, FLOPs", test_geom_model) ||
           !CU_add_test(s, "depthwise-separable CNN trains end to end; resume is bit-identical",
                        test_dw_cnn_trains_and_resumes);
}
