/* test_config_rules.c - the quant and lora sections of a config: rules
 * with their resolved settings and defaults, lora.trainable checked against
 * the model, errors with their place, the resolved YAML round trip, what a
 * resume may change, and --set on a rule. Registered into the config suite
 * by tests/test_config.c. */
#include <regex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/config.h"

#define NAME "r.yaml"

/* A model with a conv, two dense layers and a layernorm (lines 1-9). */
#define MODEL                                                        \
    "model:\n"                                                       \
    "  input: [1, 6, 6]\n"                                           \
    "  layers:\n"                                                    \
    "    - {name: conv1, type: conv2d, out_channels: 2, kernel: 3}\n" \
    "    - {type: relu}\n"                                           \
    "    - {type: flatten}\n"                                        \
    "    - {name: fc1, type: dense, units: 8}\n"                     \
    "    - {type: layernorm}\n"                                      \
    "    - {name: head, type: dense, units: 3}\n"

/* Both sections, every key somewhere, defaults elsewhere (lines 10-40). */
static const char *const RULES =
    MODEL
    "quant:\n"                                   /* 10 */
    "  mode: PTQ\n"
    "  calibration_batches: 4\n"
    "  rules:\n"
    "    - module_path: head\n"                  /* 14 */
    "      skip: true\n"
    "    - module_path: \"conv.*\"\n"            /* 16 */
    "      op_types: [conv2d]\n"
    "      weight_qtype: INT4\n"
    "      tile_size: 9\n"
    "      per_tensor: false\n"
    "      weight_calibration: percentile,99.9\n"
    "      symmetric: false\n"
    "      narrow_range: false\n"
    "      scale_type: bf16\n"
    "      double_quant: false\n"
    "      act_qtype: int8\n"
    "      act_symmetric: false\n"
    "    - {module_path: \".*\", weight_qtype: int8, rounding: half-away, allow_clip: yes}\n" /* 28 */
    "    - module_path: fc1\n"                   /* 29 */
    "      op_types: [dense, conv2d]\n"
    "      weight_qtype: none\n"
    "      narrow_range: true\n"
    "      act_qtype: fp8_e4m3\n"
    "      act_calibration: mse\n"
    "lora:\n"                                    /* 35 */
    "  rules:\n"
    "    - {module_path: conv1, skip: true}\n"   /* 37 */
    "    - {module_path: \"fc.*|head\", op_types: [dense], rank: 4, alpha: 8.5, dropout: 0.1, rslora: yes, "
    "init: Gaussian}\n"
    "    - {module_path: \".*\", rank: 2}\n"     /* 39 */
    "  trainable: [head]\n";

static QtStatus load(Config *c, const char *text, const char *const *ov, int n_ov) {
    QtError e = {0};
    QtStatus st = config_load_string(c, text, NAME, ov, n_ov, &e);
    if (st != QT_OK) fprintf(stderr, "\n  unexpected config error: %s\n", e.msg);
    return st;
}

/* Loads text (with at most one override) expecting QT_ERR_CONFIG and a message holding every needle. */
static void expect_error_at(int line, const char *text, const char *override, ...) {
    Config c;
    QtError e = {0};
    QtStatus st = config_load_string(&c, text, NAME, override ? &override : NULL, override ? 1 : 0, &e);
    bool ok = st == QT_ERR_CONFIG;
    va_list ap;
    va_start(ap, override);
    for (const char *needle; (needle = va_arg(ap, const char *)) != NULL;)
        if (!strstr(e.msg, needle)) {
            fprintf(stderr, "\n  %s:%d: no '%s' in: %s\n", __FILE__, line, needle, e.msg);
            ok = false;
        }
    va_end(ap);
    if (st != QT_ERR_CONFIG) fprintf(stderr, "\n  %s:%d: status %d, message: %s\n", __FILE__, line, st, e.msg);
    CU_assertImplementation(ok, (unsigned)line, "config error as expected", __FILE__, "", CU_FALSE);
}
#define EXPECT_ERR(text, ...) expect_error_at(__LINE__, text, NULL, __VA_ARGS__, (const char *)NULL)
#define EXPECT_SET_ERR(text, ov, ...) expect_error_at(__LINE__, text, ov, __VA_ARGS__, (const char *)NULL)

static bool calib_is(const CalibSpec *c, CalibKind kind, double s, double p) {
    return c->kind == kind && c->s == s && c->p == p && c->a == 0.0 && c->lo == 0.0 && c->hi == 0.0 &&
           !c->fixed_minmax;
}

/* ---- values ------------------------------------------------------------------- */

static void test_rules_values(void) {
    Config c;
    CU_ASSERT_EQUAL_FATAL(load(&c, RULES, NULL, 0), QT_OK);
    const QuantConfig *q = &c.quant;
    CU_ASSERT(q->mode == QUANT_MODE_PTQ && q->calibration_batches == 4);
    CU_ASSERT_EQUAL_FATAL(q->n_rules, 4);
    const QuantRule *r = q->rules;
    CU_ASSERT(r[0].skip && strcmp(r[0].match.module_path, "head") == 0 && r[0].match.op_types == 0);
    CU_ASSERT_STRING_EQUAL(r[0].match.where, NAME ":14:7: quant.rules[0]");
    CU_ASSERT(r[0].spec.weight_qtype == NULL && r[0].spec.tile_size == 0); /* a skip rule's spec stays zero */

    const QLayerSpec *s = &r[1].spec;
    CU_ASSERT(!r[1].skip && strcmp(r[1].match.module_path, "conv.*") == 0);
    CU_ASSERT_EQUAL(r[1].match.op_types, 1u << LAYER_CONV2D);
    CU_ASSERT_STRING_EQUAL(r[1].match.where, NAME ":16:7: quant.rules[1]");
    CU_ASSERT(s->weight_qtype == qtype_find("int4", NULL) && s->tile_size == 9 && !s->per_tensor);
    CU_ASSERT(calib_is(&s->weight_calib, CALIB_PERCENTILE, 1.0, 99.9));
    CU_ASSERT(!s->symmetric && !s->narrow_range && s->scale_type == QARRAY_SCALE_BF16 && !s->double_quant);
    CU_ASSERT(s->act_qtype == qtype_find("int8", NULL) && !s->act_symmetric);
    CU_ASSERT(calib_is(&s->act_calib, CALIB_MINMAX, 1.0, 0.0)); /* the asymmetric default */

    s = &r[2].spec; /* only the required keys: every default */
    CU_ASSERT_STRING_EQUAL(r[2].match.where, NAME ":28:7: quant.rules[2]");
    CU_ASSERT(!r[2].skip && r[2].match.op_types == 0 && s->weight_qtype == qtype_find("int8", NULL));
    CU_ASSERT(s->tile_size == 0 && !s->per_tensor && s->symmetric && !s->narrow_range && !s->double_quant);
    CU_ASSERT(calib_is(&s->weight_calib, CALIB_ABSMAX, 1.0, 0.0) && s->scale_type == QARRAY_SCALE_F32);
    CU_ASSERT(s->act_qtype == NULL && s->act_symmetric && calib_is(&s->act_calib, CALIB_ABSMAX, 1.0, 0.0));
    CU_ASSERT(s->rounding == QROUND_HALF_AWAY && r[2].allow_clip);
    CU_ASSERT(r[1].spec.rounding == QROUND_RNE && !r[1].allow_clip);

    s = &r[3].spec;
    CU_ASSERT_EQUAL(r[3].match.op_types, (1u << LAYER_DENSE) | (1u << LAYER_CONV2D));
    CU_ASSERT(s->weight_qtype == NULL && s->narrow_range && s->act_qtype == qtype_find("fp8_e4m3", NULL));
    CU_ASSERT(calib_is(&s->act_calib, CALIB_MSE, 1.0, 0.0));

    const LoraConfig *l = &c.lora;
    CU_ASSERT_EQUAL_FATAL(l->n_rules, 3);
    CU_ASSERT(l->rules[0].skip && strcmp(l->rules[0].match.module_path, "conv1") == 0);
    CU_ASSERT(l->rules[0].spec.rank == 0);
    CU_ASSERT_STRING_EQUAL(l->rules[0].match.where, NAME ":37:7: lora.rules[0]");
    const LoraSpec *a = &l->rules[1].spec;
    CU_ASSERT(strcmp(l->rules[1].match.module_path, "fc.*|head") == 0 && l->rules[1].match.op_types == 1u);
    CU_ASSERT(a->rank == 4 && a->alpha == 8.5f && a->dropout == 0.1f && a->rslora && a->init == LORA_INIT_GAUSSIAN);
    a = &l->rules[2].spec;
    CU_ASSERT(a->rank == 2 && a->alpha == 2.0f && a->dropout == 0.0f && !a->rslora && a->init == LORA_INIT_DEFAULT);
    CU_ASSERT(l->n_trainable == 1 && strcmp(l->trainable[0], "head") == 0);
    CU_ASSERT(config_has_lora(&c));
}

static void test_rules_defaults(void) {
    Config c, d;
    CU_ASSERT_EQUAL_FATAL(load(&c, MODEL, NULL, 0), QT_OK);
    CU_ASSERT(c.quant.mode == QUANT_MODE_NONE && c.quant.calibration_batches == 16 && c.quant.n_rules == 0);
    CU_ASSERT(c.lora.n_rules == 0 && c.lora.n_trainable == 0 && !config_has_lora(&c));
    CU_ASSERT_STRING_EQUAL(c.model.adapters_from, "");
    config_default(&d);
    CU_ASSERT(d.quant.calibration_batches == 16 && d.quant.mode == QUANT_MODE_NONE);
    /* Empty and null sections and lists are the defaults too. */
    CU_ASSERT_EQUAL_FATAL(load(&d, MODEL "quant: {rules: []}\nlora: {rules: [], trainable: []}\n", NULL, 0), QT_OK);
    CU_ASSERT_EQUAL(memcmp(&c, &d, sizeof c), 0);
    CU_ASSERT_EQUAL_FATAL(load(&d, MODEL "quant:\n  mode:\nlora:\n  rules:\n", NULL, 0), QT_OK);
    CU_ASSERT_EQUAL(memcmp(&c, &d, sizeof c), 0);
    /* Trainable modules alone make a LoRA run; a skip rule takes null settings; adapters_from is a path. */
    const char *text = MODEL "  adapters_from: runs/a/adapters.h5\n"
                             "lora:\n"
                             "  rules: [{module_path: fc1, skip: on, rank: ~}]\n"
                             "  trainable: [fc1, layernorm4]\n";
    CU_ASSERT_EQUAL_FATAL(load(&c, text, NULL, 0), QT_OK);
    CU_ASSERT(config_has_lora(&c) && c.lora.n_trainable == 2 && strcmp(c.lora.trainable[1], "layernorm4") == 0);
    CU_ASSERT(c.lora.n_rules == 1 && c.lora.rules[0].skip);
    CU_ASSERT_STRING_EQUAL(c.model.adapters_from, "runs/a/adapters.h5");
}

/* ---- errors --------------------------------------------------------------------- */

#define PTQ MODEL "quant:\n  mode: ptq\n  rules:\n" /* rules from line 13 */
#define LORA MODEL "lora:\n  rules:\n"             /* rules from line 12 */

static void test_rules_regex_error(void) {
    regex_t re;
    char want[160];
    int rc = regcomp(&re, "^(fc[)$", REG_EXTENDED | REG_NOSUB); /* as rules.h compiles module_path */
    CU_ASSERT_NOT_EQUAL_FATAL(rc, 0);
    regerror(rc, &re, want, sizeof want);
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8}\n    - {module_path: \"fc[\", weight_qtype: int8}\n",
               NAME ":14:7: quant.rules[1]", "module_path \"fc[\"", "regular expression", want);
    EXPECT_ERR(LORA "    - module_path: \"(head\"\n      rank: 4\n", NAME ":12:7: lora.rules[0]", "\"(head\"",
               "regular expression");
    /* patterns that would make regcomp copy their parts exponentially (gigabytes) */
    EXPECT_ERR(PTQ "    - {module_path: \"fc++++++++++++++++++++++++++++++++++++++1\", weight_qtype: int8}\n",
               NAME ":13:7: quant.rules[0]", "two repetition operators in a row", "use one");
    EXPECT_ERR(PTQ "    - {module_path: \"((((((((((((((f+)+)+)+)+)+)+)+)+)+)+)+)+)+)\", weight_qtype: int8}\n",
               NAME ":13:7: quant.rules[0]", "more than 4096 times", "use *");
    EXPECT_ERR(PTQ "    - {module_path: \"fc{1,5000}\", weight_qtype: int8}\n", NAME ":13:7: quant.rules[0]",
               "more than 4096 times", "fc{1,5000}");
}

static void test_quant_errors(void) {
    /* quant.mode and the rules belong together. */
    EXPECT_ERR(MODEL "quant:\n  rules:\n    - {module_path: fc1, weight_qtype: int8}\n", NAME ":12:5:",
               "quant.rules", "quant.mode is none", "set quant.mode: ptq");
    EXPECT_ERR(MODEL "quant:\n  mode: ptq\n", NAME ":11:9:", "quant.mode", "ptq needs quant.rules");
    EXPECT_ERR(MODEL "quant:\n  mode: int8\n", NAME ":11:9:", "quant.mode", "unknown quant mode 'int8'", "none, ptq, qat");
    EXPECT_ERR(MODEL "quant:\n  calibration_batches: 0\n", NAME ":11:24:", "quant.calibration_batches", ">= 1");
    EXPECT_ERR(MODEL "quant:\n  mode: ptq\n  rules: {module_path: fc1}\n", "quant.rules", "a sequence of rules");
    EXPECT_ERR(PTQ "    - fc1\n", NAME ":13:7:", "quant.rules[0]", "a rule mapping");
    /* Keys: misspelt, not a quant key, settings on a skip rule, required ones. */
    EXPECT_ERR(PTQ "    - {module_path: fc1, wieght_qtype: int8}\n", NAME ":13:26:", "quant.rules[0]",
               "unknown key 'wieght_qtype' (did you mean 'weight_qtype'?)");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, rank: 4}\n", "quant.rules[0]", "unknown key 'rank'",
               "valid keys: module_path, op_types, skip, weight_qtype");
    EXPECT_ERR(PTQ "    - module_path: fc1\n      skip: true\n      weight_qtype: int8\n", NAME ":15:7:",
               "quant.rules[0].weight_qtype", "skip: true takes no other settings");
    EXPECT_ERR(PTQ "    - {weight_qtype: int8}\n", NAME ":13:7:", "quant.rules[0].module_path", "missing");
    EXPECT_ERR(PTQ "    - {module_path: \"\", weight_qtype: int8}\n", "quant.rules[0].module_path", "non-empty");
    EXPECT_ERR(PTQ "    - {module_path: fc1}\n", NAME ":13:7:", "quant.rules[0].weight_qtype", "missing",
               "or none");
    /* Values. */
    EXPECT_ERR(PTQ "    - {module_path: fc1, op_types: [relu], weight_qtype: int8}\n", NAME ":13:37:",
               "quant.rules[0].op_types[0]", "unknown op type 'relu'", "dense, conv2d");
    EXPECT_ERR(PTQ "    - {module_path: fc1, op_types: [dense, Dense], weight_qtype: int8}\n",
               "quant.rules[0].op_types[1]", "listed twice");
    EXPECT_ERR(PTQ "    - {module_path: fc1, op_types: dense, weight_qtype: int8}\n", "quant.rules[0].op_types",
               "a sequence of layer types");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int9}\n", NAME ":13:40:", "quant.rules[0].weight_qtype",
               "int9", "or none");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, act_qtype: float7}\n", "quant.rules[0].act_qtype",
               "float7");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, weight_calibration: median}\n",
               "quant.rules[0].weight_calibration", "median");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, act_calibration: \"percentile,101\"}\n",
               "quant.rules[0].act_calibration", "percentile");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, scale_type: f8}\n", "quant.rules[0].scale_type",
               "'f8'", "float32");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, tile_size: -1}\n", "quant.rules[0].tile_size",
               ">= 0");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, tile_size: 4, per_tensor: true}\n",
               "quant.rules[0].per_tensor", "tile_size 0");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, symmetric: maybe}\n", "quant.rules[0].symmetric",
               "true or false");
}

/* Resolved defaults that follow the format, and the keys that guard them. */
static void test_quant_format_defaults(void) {
    Config c;
    /* unsigned formats: asymmetric (minmax) unless told otherwise; a symmetric uint clips negatives to 0 */
    CU_ASSERT_EQUAL_FATAL(load(&c, PTQ "    - {module_path: fc1, weight_qtype: uint8, act_qtype: uint8}\n"
                                   "    - {module_path: head, weight_qtype: uint4, symmetric: true, allow_clip: on}\n",
                               NULL, 0), QT_OK);
    const QLayerSpec *s = &c.quant.rules[0].spec;
    CU_ASSERT(!s->symmetric && calib_is(&s->weight_calib, CALIB_MINMAX, 1.0, 0.0));
    CU_ASSERT(!s->act_symmetric && calib_is(&s->act_calib, CALIB_MINMAX, 1.0, 0.0));
    CU_ASSERT(c.quant.rules[1].allow_clip && c.quant.rules[1].spec.symmetric);
    CU_ASSERT(calib_is(&c.quant.rules[1].spec.weight_calib, CALIB_ABSMAX, 1.0, 0.0));
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: uint8, symmetric: true}\n", NAME ":13:58:",
               "quant.rules[0].symmetric", "uint8", "clips to 0", "allow_clip: true");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, act_qtype: uint8, act_symmetric: true}\n",
               "quant.rules[0].act_symmetric", "uint8", "allow_clip: true");
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, allow_clip: 2}\n", "quant.rules[0].allow_clip",
               "true or false");
    /* ternary and binary: mean |x| (BitNet b1.58's absmean, XNOR-Net); an explicit method stays */
    CU_ASSERT_EQUAL_FATAL(load(&c, PTQ "    - {module_path: fc1, weight_qtype: ternary}\n"
                                   "    - {module_path: head, weight_qtype: binary}\n"
                                   "    - {module_path: conv1, weight_qtype: ternary, weight_calibration: absmax}\n",
                               NULL, 0), QT_OK);
    CU_ASSERT(calib_is(&c.quant.rules[0].spec.weight_calib, CALIB_MEAN_ABS, 1.0, 0.0));
    CU_ASSERT(calib_is(&c.quant.rules[1].spec.weight_calib, CALIB_MEAN_ABS, 1.0, 0.0));
    CU_ASSERT(calib_is(&c.quant.rules[2].spec.weight_calib, CALIB_ABSMAX, 1.0, 0.0));
    /* entropy is for activations only */
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, weight_calibration: entropy}\n",
               "quant.rules[0].weight_calibration", "activations", "absmax", "mse", "kl_j", "mean_abs");
    CU_ASSERT_EQUAL(load(&c, PTQ "    - {module_path: fc1, weight_qtype: int8, act_qtype: int8, "
                             "act_calibration: entropy, weight_calibration: kl_j}\n", NULL, 0), QT_OK);
    /* nf4: blocks of 64 unless tile_size (0: per channel) or per_tensor says otherwise */
    CU_ASSERT_EQUAL_FATAL(load(&c, PTQ "    - {module_path: fc1, weight_qtype: nf4}\n"
                                   "    - {module_path: head, weight_qtype: nf4, tile_size: 0}\n"
                                   "    - {module_path: conv1, weight_qtype: nf4, per_tensor: true}\n"
                                   "    - {module_path: x, weight_qtype: int4}\n",
                               NULL, 0), QT_OK);
    CU_ASSERT_EQUAL(c.quant.rules[0].spec.tile_size, 64);
    CU_ASSERT_EQUAL(c.quant.rules[1].spec.tile_size, 0);
    CU_ASSERT(c.quant.rules[2].spec.tile_size == 0 && c.quant.rules[2].spec.per_tensor);
    CU_ASSERT_EQUAL(c.quant.rules[3].spec.tile_size, 0);
    /* rounding: every mode by name; not in qt; not with a learned range */
    const char *names[] = {"rne", "half_away", "floor", "stochastic"};
    for (int k = 0; k < 4; k++) {
        char text[1024];
        snprintf(text, sizeof text, PTQ "    - {module_path: fc1, weight_qtype: int8, rounding: %s}\n", names[k]);
        CU_ASSERT_EQUAL_FATAL(load(&c, text, NULL, 0), QT_OK);
        CU_ASSERT_EQUAL(c.quant.rules[0].spec.rounding, (QRound)k);
    }
    EXPECT_ERR(PTQ "    - {module_path: fc1, weight_qtype: int8, rounding: up}\n", "quant.rules[0].rounding", "'up'",
               "rne, half_away, floor, stochastic");
    EXPECT_ERR(MODEL "quant:\n  mode: qt\n  rules:\n    - {module_path: fc1, weight_qtype: int8, rounding: floor}\n",
               "quant.rules[0].rounding", "ptq and qat");
    EXPECT_ERR(MODEL "quant:\n  mode: qat\n  rules:\n    - {module_path: fc1, weight_qtype: int8, learn_amax: lsq, "
                     "rounding: stochastic}\n", "quant.rules[0].rounding", "learn_amax lsq");
}

static void test_lora_errors(void) {
    EXPECT_ERR(LORA "    - module_path: fc1\n      rank: 0\n", NAME ":13:13:", "lora.rules[0].rank", ">= 1", "\"0\"");
    EXPECT_ERR(LORA "    - {module_path: fc1, rank: -3}\n", NAME ":12:32:", "lora.rules[0].rank", ">= 1");
    EXPECT_ERR(LORA "    - {module_path: fc1}\n", NAME ":12:7:", "lora.rules[0].rank", "missing");
    EXPECT_ERR(LORA "    - {module_path: fc1, rnak: 4}\n", NAME ":12:26:", "lora.rules[0]",
               "unknown key 'rnak' (did you mean 'rank'?)");
    EXPECT_ERR(LORA "    - {module_path: fc1, rank: 4, weight_qtype: int8}\n", "lora.rules[0]",
               "unknown key 'weight_qtype'");
    EXPECT_ERR(LORA "    - {module_path: fc1, skip: true, rank: 4}\n", "lora.rules[0].rank",
               "skip: true takes no other settings");
    EXPECT_ERR(LORA "    - {module_path: fc1, rank: 4, alpha: 0}\n", "lora.rules[0].alpha", "> 0");
    EXPECT_ERR(LORA "    - {module_path: fc1, rank: 4, alpha: 1e-60}\n", "lora.rules[0].alpha", "rounds to 0");
    EXPECT_ERR(LORA "    - {module_path: fc1, rank: 4, dropout: 1}\n", "lora.rules[0].dropout", "[0, 1)");
    EXPECT_ERR(LORA "    - {module_path: fc1, rank: 4, dora: 3}\n", NAME ":12:41:", "lora.rules[0].dora", "true or false");
    EXPECT_ERR(LORA "    - {module_path: fc1, rank: 4, dropout: 0.999999999}\n", "lora.rules[0].dropout",
               "rounds to 1");
    EXPECT_ERR(LORA "    - {module_path: fc1, rank: 4, init: kaiming}\n", "lora.rules[0].init", "kaiming",
               "default, gaussian");
    EXPECT_ERR(MODEL "lora:\n  rank: 4\n", NAME ":11:3:", "lora", "unknown key 'rank'");

    /* lora.trainable names modules of this model that have parameters, once each. */
    EXPECT_ERR(MODEL "lora:\n  trainable: [fc1, haed]\n", NAME ":11:20:", "lora.trainable[1]", "no module 'haed'",
               "modules with parameters: conv1, fc1, layernorm4, head");
    EXPECT_ERR(MODEL "lora:\n  trainable: [relu1]\n", "lora.trainable[0]", "'relu1' has no parameters",
               "conv1, fc1, layernorm4, head");
    EXPECT_ERR(MODEL "lora:\n  trainable: [head, fc1, head]\n", NAME ":11:26:", "lora.trainable[2]",
               "'head' is listed twice (first as item 0)");
    EXPECT_ERR(MODEL "lora:\n  trainable: head\n", "lora.trainable", "a sequence of module names");

    /* At most RULES_MAX rules. */
    char text[4096];
    int len = snprintf(text, sizeof text, "%s", LORA);
    for (int i = 0; i <= RULES_MAX; i++)
        len += snprintf(text + len, sizeof text - (size_t)len, "    - {module_path: fc1, rank: 1}\n");
    EXPECT_ERR(text, "lora.rules", "at most 32 rules, got 33");
}

/* ---- the resolved YAML ------------------------------------------------------------ */

/* What the config does: `where` names the text a rule came from. */
static void clear_where(Config *c) {
    for (int i = 0; i < RULES_MAX; i++) {
        memset(c->quant.rules[i].match.where, 0, RULE_WHERE_MAX);
        memset(c->lora.rules[i].match.where, 0, RULE_WHERE_MAX);
    }
}

static void test_rules_round_trip(void) {
    const char *texts[] = {RULES, MODEL "  adapters_from: \"a b.h5\"\nquant: {calibration_batches: 2}\n"
                                        "lora:\n  rules: [{module_path: \"(conv|fc)\\\\.[0-9]+\", skip: yes}]\n"
                                        "  trainable: [conv1, head]\n"};
    for (int k = 0; k < 2; k++) {
        Config a, b, again;
        CU_ASSERT_EQUAL_FATAL(load(&a, texts[k], NULL, 0), QT_OK);
        char *text = config_to_yaml(&a);
        CU_ASSERT_PTR_NOT_NULL_FATAL(text);
        CU_ASSERT_EQUAL_FATAL(load(&b, text, NULL, 0), QT_OK);
        /* The same Config but for the rules' line numbers, which the emitted text has its own of ... */
        Config a0 = a, b0 = b;
        clear_where(&a0);
        clear_where(&b0);
        CU_ASSERT_EQUAL(memcmp(&a0, &b0, sizeof a0), 0);
        /* ... and from the emitted text on, byte for byte the same Config and text. */
        char *text2 = config_to_yaml(&b);
        CU_ASSERT_PTR_NOT_NULL_FATAL(text2);
        CU_ASSERT_STRING_EQUAL(text, text2);
        CU_ASSERT_EQUAL_FATAL(load(&again, text2, NULL, 0), QT_OK);
        CU_ASSERT_EQUAL(memcmp(&b, &again, sizeof b), 0);
        char fixed[64], changed[256];
        config_diff_for_resume(&a, &b, fixed, sizeof fixed, changed, sizeof changed);
        CU_ASSERT(fixed[0] == '\0' && changed[0] == '\0');
        if (k == 1) CU_ASSERT_STRING_EQUAL(b.lora.rules[0].match.module_path, "(conv|fc)\\.[0-9]+");
        free(text);
        free(text2);
    }
    /* The text itself: every key of every rule, resolved. */
    Config c;
    CU_ASSERT_EQUAL_FATAL(load(&c, RULES, NULL, 0), QT_OK);
    char *text = config_to_yaml(&c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    const char *want[] = {
        "  init_from: \"\"\n  adapters_from: \"\"\n",
        "quant:\n  mode: ptq\n  calibration_batches: 4\n  fold_bn: true\n  freeze_bn_after: 0\n  rules:\n"
        "    - module_path: head\n      op_types: []\n      skip: true\n"
        "    - module_path: \"conv.*\"\n      op_types: [conv2d]\n      skip: false\n      weight_qtype: int4\n"
        "      tile_size: 9\n      per_tensor: false\n      weight_calibration: \"percentile,99.9\"\n"
        "      symmetric: false\n      narrow_range: false\n      scale_type: bfloat16\n      double_quant: false\n"
        "      rounding: rne\n      allow_clip: false\n"
        "      act_qtype: int8\n      act_calibration: minmax\n      act_symmetric: false\n",
        "      rounding: half_away\n      allow_clip: true\n",
        "    - module_path: fc1\n      op_types: [dense, conv2d]\n      skip: false\n      weight_qtype: none\n",
        "      act_qtype: fp8_e4m3\n      act_calibration: mse\n",
        "lora:\n  rules:\n    - module_path: conv1\n      op_types: []\n      skip: true\n"
        "    - module_path: \"fc.*|head\"\n      op_types: [dense]\n      skip: false\n      rank: 4\n"
        "      alpha: 8.5\n      dropout: 0.1\n      rslora: true\n      init: gaussian\n      dora: false\n"
        "    - module_path: \".*\"\n      op_types: []\n      skip: false\n      rank: 2\n      alpha: 2\n"
        "      dropout: 0\n      rslora: false\n      init: default\n      dora: false\n  trainable: [head]\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        if (!strstr(text, want[i])) fprintf(stderr, "\n  missing %s in:\n%s", want[i], text);
        CU_ASSERT_PTR_NOT_NULL(strstr(text, want[i]));
    }
    free(text);
}

/* ---- resume ------------------------------------------------------------------------- */

static void expect_fixed_at(int line, const char *override, const char *want) {
    Config a, b;
    CU_ASSERT_EQUAL_FATAL(load(&a, RULES, NULL, 0), QT_OK);
    CU_ASSERT_EQUAL_FATAL(load(&b, RULES, &override, 1), QT_OK);
    char fixed[64], changed[256];
    config_diff_for_resume(&a, &b, fixed, sizeof fixed, changed, sizeof changed);
    bool ok = strcmp(fixed, want) == 0 && changed[0] == '\0';
    if (!ok)
        fprintf(stderr, "\n  %s:%d: --set %s: fixed '%s', changed '%s'\n", __FILE__, line, override, fixed, changed);
    CU_assertImplementation(ok, (unsigned)line, "fixed key as expected", __FILE__, "", CU_FALSE);
}
#define EXPECT_FIXED(override, want) expect_fixed_at(__LINE__, override, want)

static void test_rules_resume(void) {
    EXPECT_FIXED("quant.calibration_batches=8", "quant.calibration_batches");
    EXPECT_FIXED("quant.rules.1.tile_size=0", "quant.rules[1]");
    EXPECT_FIXED("quant.rules.1.act_calibration=absmax", "quant.rules[1]");
    EXPECT_FIXED("quant.rules.1.rounding=stochastic", "quant.rules[1]");
    EXPECT_FIXED("quant.rules.1.allow_clip=true", "quant.rules[1]");
    EXPECT_FIXED("quant.rules.3.op_types=[dense]", "quant.rules[3]");
    EXPECT_FIXED("quant.rules.0.module_path=fc1", "quant.rules[0]");
    EXPECT_FIXED("quant.rules=[{module_path: head, skip: true}]", "quant.rules[1]"); /* rules removed */
    EXPECT_FIXED("lora.rules.1.alpha=3", "lora.rules[1]");
    EXPECT_FIXED("lora.rules.2.module_path=fc1", "lora.rules[2]");
    EXPECT_FIXED("lora.trainable=[fc1]", "lora.trainable");
    EXPECT_FIXED("lora.trainable=[]", "lora.trainable");
    /* Where the adapters or parameters of a fresh run come from is not read by a resume. */
    EXPECT_FIXED("model.adapters_from=runs/x/adapters.h5", "");
    EXPECT_FIXED("model.init_from=runs/x/ckpt.h5", "");
    /* The mode, which also needs the rules gone. */
    Config a, b;
    CU_ASSERT_EQUAL_FATAL(load(&a, RULES, NULL, 0), QT_OK);
    const char *none[] = {"quant.mode=none", "quant.rules=[]"};
    CU_ASSERT_EQUAL_FATAL(load(&b, RULES, none, 2), QT_OK);
    char fixed[64], changed[256];
    config_diff_for_resume(&a, &b, fixed, sizeof fixed, changed, sizeof changed);
    CU_ASSERT_STRING_EQUAL(fixed, "quant.mode");
    /* The same rules written elsewhere in the file are the same rules. */
    char *moved = malloc(strlen(RULES) + 32);
    CU_ASSERT_PTR_NOT_NULL_FATAL(moved);
    sprintf(moved, "# moved down a line\n%s", RULES);
    CU_ASSERT_EQUAL_FATAL(load(&b, moved, NULL, 0), QT_OK);
    CU_ASSERT_STRING_EQUAL(b.quant.rules[1].match.where, NAME ":17:7: quant.rules[1]");
    config_diff_for_resume(&a, &b, fixed, sizeof fixed, changed, sizeof changed);
    CU_ASSERT(fixed[0] == '\0' && changed[0] == '\0');
    free(moved);
}

/* ---- overrides ------------------------------------------------------------------ */

static void test_rules_overrides(void) {
    Config c;
    const char *ov[] = {"quant.rules.2.weight_qtype=int4", "quant.rules.1.symmetric=true", "lora.rules.2.rank=16",
                        "lora.trainable=[fc1, head]"};
    CU_ASSERT_EQUAL_FATAL(load(&c, RULES, ov, 4), QT_OK);
    CU_ASSERT(c.quant.rules[2].spec.weight_qtype == qtype_find("int4", NULL));
    CU_ASSERT_STRING_EQUAL(c.quant.rules[2].match.where, NAME ":28:7: quant.rules[2]"); /* the rule's own place */
    /* weight_calibration was given, so symmetric leaves it alone; the act default follows act_symmetric. */
    CU_ASSERT(c.quant.rules[1].spec.symmetric && c.quant.rules[1].spec.weight_calib.kind == CALIB_PERCENTILE);
    CU_ASSERT(c.lora.rules[2].spec.rank == 16 && c.lora.rules[2].spec.alpha == 16.0f);
    CU_ASSERT(c.lora.n_trainable == 2 && strcmp(c.lora.trainable[0], "fc1") == 0);

    /* Whole sections from the command line. */
    const char *whole[] = {"quant.mode=ptq", "quant.rules=[{module_path: \"fc.*\", weight_qtype: nf4, tile_size: 64}]",
                           "lora.rules=[{module_path: \".*\", rank: 8}]"};
    CU_ASSERT_EQUAL_FATAL(load(&c, MODEL, whole, 3), QT_OK);
    CU_ASSERT(c.quant.mode == QUANT_MODE_PTQ && c.quant.n_rules == 1 && c.quant.rules[0].spec.tile_size == 64);
    CU_ASSERT_PTR_NOT_NULL(strstr(c.quant.rules[0].match.where, "--set quant.rules=[{module_path"));
    CU_ASSERT_PTR_NOT_NULL(strstr(c.quant.rules[0].match.where, ": quant.rules[0]"));
    CU_ASSERT(c.lora.n_rules == 1 && c.lora.rules[0].spec.rank == 8);

    EXPECT_SET_ERR(RULES, "quant.rules.1.rank=3", "--set quant.rules.1.rank=3: quant.rules[1]: unknown key 'rank'");
    EXPECT_SET_ERR(RULES, "lora.rules.1.rank=0", "--set lora.rules.1.rank=0: lora.rules[1].rank", ">= 1");
    EXPECT_SET_ERR(RULES, "quant.rules.0.weight_qtype=int8", "--set quant.rules.0.weight_qtype=int8",
                   "skip: true takes no other settings");
    EXPECT_SET_ERR(RULES, "lora.trainable=[fc2]", "--set lora.trainable=[fc2]: lora.trainable[0]", "no module 'fc2'");
    EXPECT_SET_ERR(RULES, "quant.mode=none", NAME ":14:5:", "quant.rules", "set quant.mode: ptq");
}

void config_rules_tests_add(CU_pSuite s);

void config_rules_tests_add(CU_pSuite s) {
    CU_add_test(s, "quant and lora rules: every key", test_rules_values);
    CU_add_test(s, "quant and lora: defaults, empty sections", test_rules_defaults);
    CU_add_test(s, "rules: a bad regex names rule, pattern, regerror", test_rules_regex_error);
    CU_add_test(s, "quant: errors with their place", test_quant_errors);
    CU_add_test(s, "quant: defaults that follow the format", test_quant_format_defaults);
    CU_add_test(s, "lora: errors with their place", test_lora_errors);
    CU_add_test(s, "rules: to_yaml round trip", test_rules_round_trip);
    CU_add_test(s, "rules: diff for resume", test_rules_resume);
    CU_add_test(s, "rules: --set overrides", test_rules_overrides);
}
