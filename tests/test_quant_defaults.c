/* test_quant_defaults.c - what a quant rule resolves to when a key is left
 * out, checked on real runs of tiny-base.yaml's model over the shipped mini
 * data set: unsigned formats (asymmetric by default), ternary/binary scales
 * (mean |w|), nf4 blocks of 64, the weight's rounding modes (by hand, and
 * stochastic rounding's reproducibility in PTQ and across a QAT resume),
 * and the int8 path a run reports (int8_kernel). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "quant/qat.h"
#include "quant/qgemm.h"
#include "quant/qlayer.h"
#include "test_runs.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/net.h"
#include "trainer/tools.h"
#include "trainer/train.h"

static TestRuns runs; /* the suite's directory and float base */

static Config *load_cfg(const char *path, const char *sub, const char *const *extra, int n_extra) {
    return test_runs_config(&runs, path, sub, extra, n_extra);
}

static QtStatus run(const Config *c, const char *resume, int64_t stop_at, TrainResult *r, QtError *err) {
    QtStatus st = test_runs_train(c, resume, stop_at, r, err);
    if (st != QT_OK) fprintf(stderr, "\n  run: %s\n", err->msg);
    return st;
}

/* A pure PTQ evaluation of the base with one rule list. */
static QtStatus ptq_eval(const char *sub, const char *rules, TrainResult *r) {
    const char *ov[] = {"quant.mode=ptq", rules, "train.steps=0", "train.epochs=0"};
    Config *c = load_cfg("tests/configs/tiny-base.yaml", sub, ov, 4);
    QtError err = {0};
    QtStatus st = c ? run(c, NULL, 0, r, &err) : QT_ERR_CONFIG;
    free(c);
    return st;
}

static int defaults_suite_init(void) { return test_runs_init(&runs); }

static int defaults_suite_cleanup(void) { return test_runs_cleanup(&runs); }

static char *path_in(const char *sub, const char *name) { return test_runs_path(&runs, sub, name); }

/* ---- unsigned formats -------------------------------------------------------------------------------------- */

/* uint8 weights default to an asymmetric range: PTQ as good as int8 (a symmetric uint8 clipped every negative
 * weight to 0 and fell to chance). */
static void test_uint8_matches_int8(void) {
    TrainResult i8, u8, u8c;
    CU_ASSERT_EQUAL_FATAL(ptq_eval("u-i8", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]", &i8), QT_OK);
    CU_ASSERT_EQUAL_FATAL(ptq_eval("u-u8", "quant.rules=[{module_path: \".*\", weight_qtype: uint8}]", &u8), QT_OK);
    CU_ASSERT(fabs(u8.test_accuracy - i8.test_accuracy) <= 0.005);
    /* asked for explicitly, the clipping shows */
    CU_ASSERT_EQUAL_FATAL(ptq_eval("u-u8c", "quant.rules=[{module_path: \".*\", weight_qtype: uint8, symmetric: true, "
                                            "allow_clip: true}]", &u8c), QT_OK);
    CU_ASSERT(u8c.test_accuracy < i8.test_accuracy - 0.1);
    if (getenv("QT_TEST_SHOW_MSGS"))
        fprintf(stderr, "\n  test accuracy: int8 %.4f, uint8 %.4f, uint8 symmetric %.4f\n", i8.test_accuracy,
                u8.test_accuracy, u8c.test_accuracy);
    /* and the run warns about it */
    const char *ov[] = {"quant.mode=ptq", "quant.rules=[{module_path: \".*\", weight_qtype: uint8, symmetric: true, "
                        "allow_clip: true}]"};
    Config *c = load_cfg("tests/configs/tiny-base.yaml", "u-warn", ov, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    Net n;
    int count = 0;
    char *text = test_runs_net_warnings(&n, c, NET_FRESH, &count);
    CU_ASSERT_EQUAL(count, 1);
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "quant.rules[0]: symmetric: true with uint8 clips every negative weight to 0"));
    free(text);
    net_free(&n);
    free(c);
}

/* ---- ternary and binary: mean |w| ---------------------------------------------------------------------------- */

/* The scales stored in a PTQ checkpoint are mean |w| of each output channel of the float base. */
static void test_ternary_binary_scales(void) {
    const char *ov[] = {"quant.mode=ptq", "quant.rules=[{module_path: fc1, weight_qtype: binary}, "
                                          "{module_path: \".*\", weight_qtype: ternary}]"};
    Config *c = load_cfg("tests/configs/tiny-base.yaml", "tb", ov, 2);
    Config *fc = load_cfg("tests/configs/tiny-base.yaml", "tb-float", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(fc);
    QtError err = {0};
    char *out = path_in("tb", "ptq.h5");
    char dir[1100];
    snprintf(dir, sizeof dir, "%s/tb", runs.root);
    CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0777), 0);
    CU_ASSERT_EQUAL_FATAL(tools_quantize(c, runs.base_ckpt, out, false, NULL, &err), QT_OK);
    Net q, f;
    CU_ASSERT_EQUAL_FATAL(net_build(&q, c, NET_SHELL, &err), QT_OK);
    CheckpointNet parts = net_checkpoint_parts(&q);
    CU_ASSERT_EQUAL_FATAL(checkpoint_load_model(out, &q.model, &parts, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(&f, fc, NET_SHELL, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(checkpoint_load_params(runs.base_ckpt, &f.model, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_hook_count(&q, &HOOK_PTQ), 3);
    for (int i = 0; i < net_hook_count(&q, &HOOK_PTQ); i++) {
        const QLayer *l = net_qlayer(&q, i);
        const Param *w = model_find_param(&f.model, strcmp(l->module->path, "fc1") == 0   ? "fc1/weight"
                                                    : strcmp(l->module->path, "head") == 0 ? "head/weight"
                                                                                            : "conv1/weight");
        CU_ASSERT_PTR_NOT_NULL_FATAL(w);
        CU_ASSERT_EQUAL(l->spec.weight_calib.kind, CALIB_MEAN_ABS);
        CU_ASSERT_EQUAL_FATAL(l->weight.n_scales, (size_t)l->out);
        int bad = 0;
        for (int oc = 0; oc < l->out; oc++) {
            double sum = 0.0;
            for (int j = 0; j < l->fan_in; j++) sum += fabsf(w->var.value.data[(size_t)oc * l->fan_in + j]);
            float want = (float)(sum / l->fan_in), absmax = 0.0f;
            for (int j = 0; j < l->fan_in; j++)
                absmax = fmaxf(absmax, fabsf(w->var.value.data[(size_t)oc * l->fan_in + j]));
            if (qarray_scale_at(&l->weight, (size_t)oc) != want && bad++ == 0)
                fprintf(stderr, "\n  %s channel %d: scale %.9g, mean |w| %.9g (absmax %.9g)\n", l->module->path, oc,
                        (double)qarray_scale_at(&l->weight, (size_t)oc), (double)want, (double)absmax);
            CU_ASSERT(want < absmax); /* what makes the two defaults distinguishable */
        }
        CU_ASSERT_EQUAL(bad, 0);
    }
    CU_ASSERT(strcmp(net_qlayer(&q, 1)->weight.qtype->name, "binary") == 0);
    net_free(&q);
    net_free(&f);
    free(c);
    free(fc);
}

/* ---- nf4: blocks of 64 -------------------------------------------------------------------------------------- */

static void test_nf4_default_blocks(void) {
    const char *all[] = {"quant.mode=ptq", "quant.rules=[{module_path: \".*\", weight_qtype: nf4}]"};
    Config *c = load_cfg("tests/configs/tiny-base.yaml", "nf4", all, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    Net n;
    QtError err = {0};
    /* conv1 has 8 x 9 = 72 weights: 64 does not divide them, and the message says what to write */
    CU_ASSERT_EQUAL(net_build(&n, c, NET_FRESH, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "quant.rules[0]") && test_msg_has(&err, "conv1") &&
              test_msg_has(&err, "tile_size 64") && test_msg_has(&err, "(e.g. 36)") &&
              test_msg_has(&err, "tile_size: 0"));
    free(c);
    const char *split[] = {"quant.mode=ptq", "quant.rules=[{module_path: conv1, weight_qtype: nf4, tile_size: 0}, "
                                             "{module_path: \".*\", weight_qtype: nf4}]"};
    c = load_cfg("tests/configs/tiny-base.yaml", "nf4", split, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c, NET_FRESH, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_hook_count(&n, &HOOK_PTQ), 3);
    const QArray *conv = &net_qlayer(&n, 0)->weight, *fc = &net_qlayer(&n, 1)->weight;
    CU_ASSERT(conv->shape[0] == 8 && conv->shape[1] == 9 && conv->n_scales == 8); /* per channel */
    CU_ASSERT(fc->shape[0] == 1568 * 32 / 64 && fc->shape[1] == 64 && fc->n_scales == 1568 * 32 / 64);
    net_free(&n);
    free(c);
}

/* ---- rounding ------------------------------------------------------------------------------------------------- */

/* One dense layer 8 -> 1 whose weight row is given; int8 per channel, absmax 127.5, so the scale is
 * 127.5 / (127 + 1/2) = 1 and each code is the rounded weight itself. */
static const float ROW[8] = {127.5f, 2.5f, -2.5f, 1.5f, 0.3f, -0.7f, -1.5f, 0.5f};

/* That layer in m (its module returned) and its spec in s: int8, rounded by mode. */
static Module *row_layer(Model *m, QRound mode, QLayerSpec *s) {
    QtError err = {0};
    LayerSpec l = {.type = LAYER_DENSE, .units = 1, .name = "fc1"};
    CU_ASSERT_EQUAL_FATAL(model_init(m, 1, (const int[]){8}, &l, 1, &err), QT_OK);
    Module *mod = &m->modules[0];
    memcpy(mod->weight->var.value.data, ROW, sizeof ROW);
    *s = qlayer_spec_default();
    s->weight_qtype = qtype_find("int8", NULL);
    s->rounding = mode;
    return mod;
}

static void codes_for(QRound mode, const Rng *rng, float codes[8]) {
    Model m;
    QLayerSpec s;
    Module *mod = row_layer(&m, mode, &s);
    QtError err = {0};
    QLayer q;
    QtStatus st = qlayer_init_quantize_rng(&q, mod, &s, ROW, rng, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT_EQUAL(qarray_scale_at(&q.weight, 0), 1.0f);
    qlayer_dequantize_weight(&q, codes);
    qlayer_free(&q);
    model_free(&m);
}

static void expect_codes(int line, const char *what, const float got[8], const float want[8]) {
    bool ok = memcmp(got, want, 8 * sizeof(float)) == 0;
    if (!ok) {
        fprintf(stderr, "\n  %s:%d: %s: got", __FILE__, line, what);
        for (int i = 0; i < 8; i++) fprintf(stderr, " %g", (double)got[i]);
        fprintf(stderr, ", want");
        for (int i = 0; i < 8; i++) fprintf(stderr, " %g", (double)want[i]);
        fprintf(stderr, "\n");
    }
    CU_assertImplementation(ok, (unsigned)line, what, __FILE__, "", CU_FALSE);
}

static void test_rounding_by_hand(void) {
    float got[8];
    /* 127.5 lands past the top code under every mode (rne and half-away round it up to 128) and clamps */
    codes_for(QROUND_RNE, NULL, got);
    expect_codes(__LINE__, "rne", got, (const float[8]){127, 2, -2, 2, 0, -1, -2, 0});
    codes_for(QROUND_HALF_AWAY, NULL, got);
    expect_codes(__LINE__, "half_away", got, (const float[8]){127, 3, -3, 2, 0, -1, -2, 1});
    codes_for(QROUND_FLOOR, NULL, got);
    expect_codes(__LINE__, "floor", got, (const float[8]){127, 2, -3, 1, 0, -1, -2, 0});
    /* stochastic: floor(v + u_i), u_i from word i of the generator given */
    Rng r = qlayer_round_rng(11, 3), copy = r;
    uint32_t words[8];
    rng_fill_u32(&copy, words, 8);
    float want[8];
    for (int i = 0; i < 8; i++) want[i] = fminf(fmaxf(floorf(ROW[i] + rng_u32_to_unit(words[i])), -128.0f), 127.0f);
    codes_for(QROUND_STOCHASTIC, &r, got);
    expect_codes(__LINE__, "stochastic", got, want);
    CU_ASSERT(r.seed == 11 && r.stream == RNG_STREAM_WEIGHT_ROUNDING + (3ull << 40) && r.counter == 0);
    /* without a generator: qlayer_round_rng(0, 0) */
    Rng d = qlayer_round_rng(0, 0);
    copy = d;
    rng_fill_u32(&copy, words, 8);
    for (int i = 0; i < 8; i++) want[i] = fminf(fmaxf(floorf(ROW[i] + rng_u32_to_unit(words[i])), -128.0f), 127.0f);
    codes_for(QROUND_STOCHASTIC, NULL, got);
    expect_codes(__LINE__, "stochastic, default generator", got, want);
}

/* The QAT layer's fake-quantized weight row, read through its forward: x = I (8 x 8), bias 0, so y[j] = w_q[j]. */
static void qat_row(QRound mode, bool training, int64_t step, float out[8]) {
    Model m;
    QLayerSpec s;
    Module *mod = row_layer(&m, mode, &s);
    mod->bias->var.value.data[0] = 0.0f;
    QtError err = {0};
    QatLayer q;
    CU_ASSERT_EQUAL_FATAL(qat_layer_init(&q, mod, &s, &(QatSpec){.amax_init = {.kind = CALIB_ABSMAX, .s = 1.0}}, &err),
                          QT_OK);
    q.round_rng = qlayer_round_rng(11, 3);
    qat_layer_set_step(&q, step);
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.training = training;
    float eye[64] = {0};
    for (int i = 0; i < 8; i++) eye[i * 9] = 1.0f;
    Var *y = qat_layer_forward(&e.tape, &q, test_var(&e, eye, 2, (const int[]){8, 8}, false));
    CU_ASSERT_PTR_NOT_NULL_FATAL(y);
    memcpy(out, y->value.data, 8 * sizeof(float));
    test_env_free(&e);
    qat_layer_free(&q);
    model_free(&m);
}

/* floor(ROW[i] + u_i), u_i from word i at the generator's counter `counter`. */
static void stochastic_codes(Rng r, uint64_t counter, float want[8]) {
    uint32_t words[8];
    r.counter = counter;
    rng_fill_u32(&r, words, 8);
    for (int i = 0; i < 8; i++) want[i] = fminf(fmaxf(floorf(ROW[i] + rng_u32_to_unit(words[i])), -128.0f), 127.0f);
}

static void test_qat_rounding_by_hand(void) {
    float got[8], want[8];
    qat_row(QROUND_RNE, true, 0, got);
    expect_codes(__LINE__, "qat rne", got, (const float[8]){127, 2, -2, 2, 0, -1, -2, 0});
    qat_row(QROUND_HALF_AWAY, true, 0, got);
    expect_codes(__LINE__, "qat half_away", got, (const float[8]){127, 3, -3, 2, 0, -1, -2, 1});
    qat_row(QROUND_FLOOR, true, 0, got);
    expect_codes(__LINE__, "qat floor", got, (const float[8]){127, 2, -3, 1, 0, -1, -2, 0});
    /* training step 3 draws at counter 3 * ceil(8 / 4) = 6; evaluation at counter 0 whatever the step */
    Rng r = qlayer_round_rng(11, 3);
    stochastic_codes(r, 6, want);
    qat_row(QROUND_STOCHASTIC, true, 3, got);
    expect_codes(__LINE__, "qat stochastic, training step 3", got, want);
    float step0[8];
    stochastic_codes(r, 0, step0);
    CU_ASSERT(memcmp(step0, want, sizeof want) != 0); /* the two draws tell the counters apart */
    memcpy(want, step0, sizeof want);
    qat_row(QROUND_STOCHASTIC, false, 3, got);
    expect_codes(__LINE__, "qat stochastic, evaluation", got, want);
}

static bool qlayers_same_codes(const Net *a, const Net *b) {
    if (net_hook_count(a, &HOOK_PTQ) != net_hook_count(b, &HOOK_PTQ)) return false;
    for (int i = 0; i < net_hook_count(a, &HOOK_PTQ); i++)
        if (net_qlayer(a, i)->weight.code_bytes != net_qlayer(b, i)->weight.code_bytes ||
            memcmp(net_qlayer(a, i)->weight.codes, net_qlayer(b, i)->weight.codes, net_qlayer(b, i)->weight.code_bytes))
            return false;
    return true;
}

/* PTQ's stochastic rounding: the run's seed on a stream per module, so a run repeats its codes. */
static void test_ptq_stochastic_reproducible(void) {
    const char *ov[] = {"quant.mode=ptq", "quant.rules=[{module_path: \".*\", weight_qtype: int4, rounding: "
                                          "stochastic}]", "run.seed=5"};
    Config *a = load_cfg("tests/configs/tiny-base.yaml", "sr", ov, 3), *b = load_cfg("tests/configs/tiny-base.yaml",
                                                                                    "sr", ov, 3);
    ov[2] = "run.seed=6";
    Config *other = load_cfg("tests/configs/tiny-base.yaml", "sr", ov, 3);
    const char *rne[] = {"quant.mode=ptq", "quant.rules=[{module_path: \".*\", weight_qtype: int4}]", "run.seed=5"};
    Config *near = load_cfg("tests/configs/tiny-base.yaml", "sr", rne, 3);
    CU_ASSERT_FATAL(a && b && other && near);
    Net na, nb, no, nn;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(net_build(&na, a, NET_FRESH, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(&nb, b, NET_FRESH, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(&no, other, NET_FRESH, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(&nn, near, NET_FRESH, &err), QT_OK);
    CU_ASSERT(qlayers_same_codes(&na, &nb));
    CU_ASSERT(!qlayers_same_codes(&na, &no));
    CU_ASSERT(!qlayers_same_codes(&na, &nn));
    /* fc1 (module 4) drew from qlayer_round_rng(5, 4) */
    Net f;
    Config *fl = load_cfg("tests/configs/tiny-base.yaml", "sr", NULL, 0);
    CU_ASSERT_EQUAL_FATAL(net_build(&f, fl, NET_SHELL, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(checkpoint_load_params(runs.base_ckpt, &f.model, &err), QT_OK);
    QLayer q;
    Rng r = qlayer_round_rng(5, 4);
    CU_ASSERT_STRING_EQUAL_FATAL(f.model.modules[4].path, "fc1");
    CU_ASSERT_EQUAL_FATAL(qlayer_init_quantize_rng(&q, &f.model.modules[4], &net_qlayer(&na, 1)->spec,
                                                   f.model.modules[4].weight->var.value.data, &r, &err), QT_OK);
    CU_ASSERT(memcmp(q.weight.codes, net_qlayer(&na, 1)->weight.codes, q.weight.code_bytes) == 0);
    qlayer_free(&q);
    net_free(&f);
    net_free(&na);
    net_free(&nb);
    net_free(&no);
    net_free(&nn);
    free(a);
    free(b);
    free(other);
    free(near);
    free(fl);
}

/* QAT with stochastic weight rounding: stop + resume gives the straight run's weights bit for bit (each step's
 * noise follows from the step), the noise is really drawn (rne trains to other weights), and convert stores the
 * codes evaluation uses. */
static void test_qat_stochastic_resume(void) {
    const char *sr[] = {"quant.rules=[{module_path: \".*\", weight_qtype: int4, act_qtype: int8, "
                        "act_static_scale: true, rounding: stochastic}]"};
    const char *rne[] = {"quant.rules=[{module_path: \".*\", weight_qtype: int4, act_qtype: int8, "
                         "act_static_scale: true}]"};
    Config *c = load_cfg("tests/configs/tiny-qat.yaml", "qsr-a", sr, 1);
    Config *s = load_cfg("tests/configs/tiny-qat.yaml", "qsr-b", sr, 1);
    Config *r0 = load_cfg("tests/configs/tiny-qat.yaml", "qsr-rne", rne, 1);
    CU_ASSERT_FATAL(c && s && r0);
    TrainResult r;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(run(c, NULL, 0, &r, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(run(s, NULL, 7, &r, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(run(s, "auto", 0, &r, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(run(r0, NULL, 0, &r, &err), QT_OK);
    Net a, b, n;
    test_runs_load_net(&a, c, path_in("qsr-a", "final.h5"));
    test_runs_load_net(&b, s, path_in("qsr-b", "final.h5"));
    test_runs_load_net(&n, r0, path_in("qsr-rne", "final.h5"));
    CU_ASSERT(test_params_equal(&a.model, &b.model));
    CU_ASSERT(!test_params_equal(&a.model, &n.model));
    CU_ASSERT_EQUAL(net_qat_layer(&a, 0)->round_rng.stream, RNG_STREAM_WEIGHT_ROUNDING); /* conv1: module 0 */
    CU_ASSERT_EQUAL(net_qat_layer(&a, 1)->round_rng.stream, RNG_STREAM_WEIGHT_ROUNDING + (4ull << 40)); /* fc1 */
    /* evaluation draws one fixed noise, the one convert stores: the PTQ model evaluates as the QAT one */
    ConvertReport rep;
    CU_ASSERT_EQUAL_FATAL(tools_convert(path_in("qsr-a", "final.h5"), path_in("qsr-a", "ptq.h5"), false, NULL, &rep, &err),
                          QT_OK);
    CU_ASSERT_EQUAL(rep.test_accuracy_ptq, rep.test_accuracy_qat);
    CU_ASSERT(fabs(rep.test_loss_ptq - rep.test_loss_qat) < 1e-5);
    net_free(&a);
    net_free(&b);
    net_free(&n);
    free(c);
    free(s);
    free(r0);
}

/* ---- int8_kernel ------------------------------------------------------------------------------------------------ */

/* The "int8_kernel" value of a run's summary.json, or "" */
static void summary_kernel(const char *sub, char *out, size_t cap) {
    out[0] = '\0';
    char *text = test_file_read(path_in(sub, "summary.json"), NULL);
    const char *k = text ? strstr(text, "\"int8_kernel\": \"") : NULL;
    if (k) {
        k += strlen("\"int8_kernel\": \"");
        size_t n = strcspn(k, "\"");
        snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), k);
    }
    free(text);
}

static void test_int8_kernel_reported(void) {
    const char *w8a8 = "quant.rules=[{module_path: \".*\", weight_qtype: int8, act_qtype: uint8}]";
    struct {
        const char *env, *sub, *want, *needs;
        QGemmIsa isa;
    } paths[] = {{"vnni", "k-vnni", "vnni", "AVX-512 VNNI", QGEMM_ISA_AVX512_VNNI},
                 {"portable", "k-portable", "portable", NULL, QGEMM_ISA_PORTABLE},
                 {"float", "k-float", "float-emulated", NULL, QGEMM_ISA_PORTABLE},
                 {"avxvnni", "k-avxvnni", "avxvnni", "AVX-VNNI", QGEMM_ISA_AVXVNNI},
                 {"avx2", "k-avx2", "avx2", "AVX2 and FMA", QGEMM_ISA_AVX2},
                 {"amx", "k-amx", "amx", "AMX-INT8", QGEMM_ISA_AMX}};
    enum { NP = sizeof paths / sizeof *paths };
    TrainResult res[NP];
    bool ran[NP] = {false};
    for (int i = 0; i < NP; i++) {
        if (paths[i].needs && !qgemm_cpu_has_isa(paths[i].isa)) {
            test_skip("int8_kernel %s: this CPU has no %s", paths[i].env, paths[i].needs);
            QtError kerr = {0};
            CU_ASSERT_EQUAL(qlayer_int8_kernel_select(paths[i].env, "test", &kerr), QT_ERR_CONFIG);
            CU_ASSERT(test_msg_has(&kerr, paths[i].needs));
            continue;
        }
        QtError kerr = {0};
        CU_ASSERT_EQUAL(qlayer_int8_kernel_select(paths[i].env, "test", &kerr), QT_OK); /* as QTRAIN_INT8_KERNEL */
        CU_ASSERT_EQUAL(ptq_eval(paths[i].sub, w8a8, &res[i]), QT_OK);
        ran[i] = true;
        char got[32];
        summary_kernel(paths[i].sub, got, sizeof got);
        if (strcmp(got, paths[i].want) != 0) fprintf(stderr, "\n  %s: int8_kernel '%s'\n", paths[i].env, got);
        CU_ASSERT_STRING_EQUAL(got, paths[i].want);
    }
    /* the integer kernels agree bit for bit; float emulation up to float rounding */
    for (int i = 0; i < NP; i++)
        if (ran[i] && i != 1 && i != 2)
            CU_ASSERT(res[i].test_accuracy == res[1].test_accuracy && res[i].test_loss == res[1].test_loss);
    CU_ASSERT(fabs(res[2].test_loss - res[1].test_loss) < 1e-3);
    /* the rules table says it too */
    const char *ov[] = {"quant.mode=ptq", w8a8};
    Config *c = load_cfg("tests/configs/tiny-base.yaml", "k-table", ov, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    Net n;
    QtError err = {0};
    CU_ASSERT_EQUAL(qlayer_int8_kernel_select("float", "test", &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c, NET_FRESH, &err), QT_OK);
    char *log = path_in("k-float", "table.txt");
    FILE *f = fopen(log, "w+");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    net_print_table(&n, f);
    fclose(f);
    char *text = test_file_read(log, NULL);
    CU_ASSERT(text && strstr(text, "\n  int8_kernel: float-emulated\n"));
    free(text);
    net_free(&n);
    /* a wrong name is refused, naming the variable (the binary's start: tests/test_bench_cmd.c) */
    CU_ASSERT_EQUAL(qlayer_int8_kernel_select("sse4", "QTRAIN_INT8_KERNEL", &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "QTRAIN_INT8_KERNEL") && test_msg_has(&err, "'sse4'") &&
              test_msg_has(&err, "amx, vnni, avxvnni, avx2, portable, float or auto"));
    CU_ASSERT_EQUAL(qlayer_int8_kernel_select("auto", "test", &err), QT_OK);
    const char *best = qgemm_cpu_has_isa(QGEMM_ISA_AMX)           ? "amx"
                       : qgemm_cpu_has_vnni()                      ? "vnni"
                       : qgemm_cpu_has_isa(QGEMM_ISA_AVXVNNI) ? "avxvnni"
                       : qgemm_cpu_has_isa(QGEMM_ISA_AVX2)    ? "avx2"
                                                               : "float-emulated";
    CU_ASSERT_STRING_EQUAL(qlayer_int8_kernel(), best);
    free(c);
    /* weight-only int8 has no integer path */
    TrainResult wo;
    CU_ASSERT_EQUAL(ptq_eval("k-none", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]", &wo), QT_OK);
    char got[32];
    summary_kernel("k-none", got, sizeof got);
    CU_ASSERT_STRING_EQUAL(got, "none");
}

int register_quant_defaults_suite(void) {
    CU_pSuite s = CU_add_suite("quant_defaults", defaults_suite_init, defaults_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "uint8 defaults to asymmetric: PTQ as good as int8", test_uint8_matches_int8) ||
           !CU_add_test(s, "ternary and binary scales are mean |w|", test_ternary_binary_scales) ||
           !CU_add_test(s, "nf4 defaults to blocks of 64", test_nf4_default_blocks) ||
           !CU_add_test(s, "rounding modes against codes by hand", test_rounding_by_hand) ||
           !CU_add_test(s, "qat rounding modes against codes by hand", test_qat_rounding_by_hand) ||
           !CU_add_test(s, "ptq stochastic rounding: reproducible, per module", test_ptq_stochastic_reproducible) ||
           !CU_add_test(s, "qat stochastic rounding: exact resume", test_qat_stochastic_resume) ||
           !CU_add_test(s, "int8_kernel in summary.json and the rules table", test_int8_kernel_reported)
               ? -1
               : 0;
}
