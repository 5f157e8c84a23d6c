/* test_qlora_qat.c - the qlora suite's QAT and QT runs over its float base
 * (tests/configs/tiny-qat.yaml, tiny-qt.yaml): exact resume, convert, LoRA
 * over a QAT model, and the mode and field combinations refused. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/fqt_kern.h"
#include "quant/qgemm.h"
#include "test_qlora.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/net.h"
#include "trainer/tools.h"
#include "trainer/train.h"

/* ---- QAT ------------------------------------------------------------------------------ */

static void test_qat_resume_and_convert(void) {
    Config *c = load_cfg("tests/configs/tiny-qat.yaml", "qat-a", NULL, 0);
    Config *s = load_cfg("tests/configs/tiny-qat.yaml", "qat-b", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(s);
    TrainResult r;
    QtError err = {0};
    run_ok(c, NULL, 0, &r);
    CU_ASSERT_STRING_EQUAL(r.mode, "qat");
    CU_ASSERT(r.base_bits_per_param < 8.0);
    CU_ASSERT_EQUAL_FATAL(run(s, NULL, 7, &r, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(run(s, "auto", 0, &r, &err), QT_OK);
    Net a, b;
    test_runs_load_net(&a, c, path_in("qat-a", "final.h5"));
    test_runs_load_net(&b, s, path_in("qat-b", "final.h5"));
    CU_ASSERT(test_params_equal(&a.model, &b.model));
    CU_ASSERT_EQUAL_FATAL(a.n_trainable, b.n_trainable);
    for (int i = 0; i < a.n_trainable; i++)
        CU_ASSERT(memcmp(a.trainable[i]->var.value.data, b.trainable[i]->var.value.data,
                         var_numel(&a.trainable[i]->var) * sizeof(float)) == 0);
    /* a range gone non-finite stops the run naming the module and the step */
    CU_ASSERT_EQUAL(net_check_ranges(&a, 5, &err), QT_OK);
    net_qat_layer(&a, 1)->w_range.param.var.value.data[3] = NAN;
    CU_ASSERT_EQUAL(net_check_ranges(&a, 5, &err), QT_ERR_VALUE);
    CU_ASSERT(test_msg_has(&err, "step 5") && test_msg_has(&err, "fc1") && test_msg_has(&err, "log2_t"));
    net_free(&a);
    net_free(&b);
    /* convert: the PTQ checkpoint evaluates as the QAT one, to the last example */
    ConvertReport rep;
    QtStatus st = tools_convert(path_in("qat-a", "final.h5"), path_in("qat-a", "ptq.h5"), false, NULL, &rep, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT_EQUAL(rep.modules, 3);
    CU_ASSERT_EQUAL(rep.test_accuracy_ptq, rep.test_accuracy_qat);
    CU_ASSERT(fabs(rep.test_loss_ptq - rep.test_loss_qat) < 1e-5);
    free(c);
    free(s);
}

/* QT: the run learns, and stop + resume is bit-identical (the gradient
 * noise generators are restored with everything else). */
static void test_qt_run_and_resume(void) {
    const char *none[] = {"train.steps=0", "train.epochs=0"};
    Config *c0 = load_cfg("tests/configs/tiny-qt.yaml", "qt-0", none, 2);
    Config *c = load_cfg("tests/configs/tiny-qt.yaml", "qt-a", NULL, 0);
    Config *s = load_cfg("tests/configs/tiny-qt.yaml", "qt-b", NULL, 0);
    CU_ASSERT_FATAL(c0 && c && s);
    TrainResult r0, r;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(run(c0, NULL, 0, &r0, &err), QT_OK);
    run_ok(c, NULL, 0, &r);
    CU_ASSERT_STRING_EQUAL(r.mode, "qt");
    CU_ASSERT(r.test_loss < r0.test_loss); /* from the tiny base (init_from): further down */
    CU_ASSERT_EQUAL_FATAL(run(s, NULL, 11, &r, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(run(s, "auto", 0, &r, &err), QT_OK);
    Net a, b;
    test_runs_load_net(&a, c, path_in("qt-a", "final.h5"));
    test_runs_load_net(&b, s, path_in("qt-b", "final.h5"));
    CU_ASSERT(test_params_equal(&a.model, &b.model));
    for (int i = 0; i < net_hook_count(&a, &HOOK_FQT); i++)
        CU_ASSERT(net_fqt_layer(&a, i)->rng.counter == net_fqt_layer(&b, i)->rng.counter &&
                  net_fqt_layer(&a, i)->rng.counter > 0);
    net_free(&a);
    net_free(&b);
    free(c0);
    free(c);
    free(s);
}

/* QT's integer GEMMs are exact and its quantizers' vector kernels are twins of the scalar ones, so a QT run is
 * the same bits on every int8 kernel family the CPU runs and on the portable quantizers; int8_kernel names the
 * family. */
static void test_qt_kernel_families(void) {
    static const char *const NAMES[] = {"portable", "avx2", "avxvnni", "vnni", "amx"};
    const char *ov[] = {"train.steps=6"};
    Net ref;
    bool have_ref = false;
    for (int isa = QGEMM_ISA_PORTABLE; isa <= QGEMM_ISA_AMX + 1; isa++) {
        const bool portable_quant = isa > QGEMM_ISA_AMX; /* last: the best family, scalar quantizers */
        if (!portable_quant && !qgemm_cpu_has_isa((QGemmIsa)isa)) {
            test_skip("qt on the %s int8 kernels: this CPU (or OS) lacks them", NAMES[isa]);
            continue;
        }
        char name[32];
        snprintf(name, sizeof name, "qt-isa-%d", isa);
        Config *c = load_cfg("tests/configs/tiny-qt.yaml", name, ov, 1);
        CU_ASSERT_PTR_NOT_NULL_FATAL(c);
        qgemm_force_isa = portable_quant ? -1 : isa;
        fqt_kern_cap(portable_quant ? FQT_KERN_PORTABLE : FQT_KERN_AVX512);
        TrainResult r;
        run_ok(c, NULL, 0, &r);
        Net n;
        test_runs_load_net(&n, c, path_in(name, "final.h5"));
        if (!portable_quant) CU_ASSERT_STRING_EQUAL(net_int8_kernel(&n), NAMES[isa]);
        qgemm_force_isa = -1;
        fqt_kern_cap(FQT_KERN_AVX512);
        if (!have_ref) {
            ref = n, have_ref = true;
        } else {
            const bool same = test_params_equal(&ref.model, &n.model);
            if (!same) fprintf(stderr, "\n  qt on %s differs from portable\n", portable_quant ? "scalar quantizers" : NAMES[isa]);
            CU_ASSERT(same);
            net_free(&n);
        }
        free(c);
    }
    if (have_ref) net_free(&ref);
}

/* LoRA over a QAT model: the base is frozen (and fake-quantized in every
 * forward), the adapters, the head and the learned ranges train. */
static void test_qat_lora(void) {
    const char *ov[] = {"lora.rules=[{module_path: \"conv1|fc1\", rank: 2}]", "lora.trainable=[head]"};
    Config *c = load_cfg("tests/configs/tiny-qat.yaml", "qat-lora", ov, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainResult r;
    QtError err = {0};
    run_ok(c, NULL, 0, &r);
    CU_ASSERT_STRING_EQUAL(r.mode, "qat-lora");
    Net a, base;
    test_runs_load_net(&a, c, path_in("qat-lora", "final.h5"));
    Config *b = load_cfg("tests/configs/tiny-base.yaml", "unused", NULL, 0);
    CU_ASSERT_EQUAL_FATAL(net_build(&base, b, NET_SHELL, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(checkpoint_load_params(qlora_runs.base_ckpt, &base.model, &err), QT_OK);
    const char *frozen[] = {"conv1/weight", "fc1/weight", "fc1/bias"};
    for (int i = 0; i < 3; i++) {
        const Param *p = model_find_param(&a.model, frozen[i]), *q = model_find_param(&base.model, frozen[i]);
        CU_ASSERT(memcmp(p->var.value.data, q->var.value.data, var_numel(&p->var) * sizeof(float)) == 0);
    }
    const Param *h = model_find_param(&a.model, "head/weight"), *h0 = model_find_param(&base.model, "head/weight");
    CU_ASSERT(memcmp(h->var.value.data, h0->var.value.data, var_numel(&h->var) * sizeof(float)) != 0);
    CU_ASSERT_EQUAL(net_hook_count(&a, &HOOK_LORA), 2);
    /* merged: the adapters in the float weights, the QAT layers' learned ranges kept (mode qat); the merged
       checkpoint loads under its stored config, the QAT state with it */
    MergeReport rep;
    QtStatus st = tools_merge(path_in("qat-lora", "final.h5"), path_in("qat-lora", "merged.h5"), false, false, NULL,
                              &rep, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT_EQUAL(rep.modules, 2);
    CU_ASSERT_STRING_EQUAL(rep.mode, "qat");
    Config *mc = malloc(sizeof *mc);
    char *text = NULL;
    CU_ASSERT_FATAL(mc != NULL);
    CU_ASSERT_EQUAL_FATAL(checkpoint_read_config(path_in("qat-lora", "merged.h5"), &text, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(config_load_string(mc, text, "merged", NULL, 0, &err), QT_OK);
    Net m;
    test_runs_load_net(&m, mc, path_in("qat-lora", "merged.h5"));
    CU_ASSERT_EQUAL(net_hook_count(&m, &HOOK_LORA), 0);
    CU_ASSERT_EQUAL_FATAL(net_hook_count(&m, &HOOK_QAT), net_hook_count(&a, &HOOK_QAT));
    for (int i = 0; i < net_hook_count(&m, &HOOK_QAT); i++) {
        Param *pa[HOOK_PARAMS_MAX], *pm[HOOK_PARAMS_MAX];
        int k = qat_layer_params(net_qat_layer(&a, i), pa);
        CU_ASSERT_EQUAL_FATAL(qat_layer_params(net_qat_layer(&m, i), pm), k);
        for (int j = 0; j < k; j++)
            CU_ASSERT(memcmp(pa[j]->var.value.data, pm[j]->var.value.data, var_numel(&pa[j]->var) * sizeof(float)) ==
                      0);
    }
    net_free(&m);
    free(text);
    free(mc);
    net_free(&a);
    net_free(&base);
    free(b);
    free(c);
}

static void test_qat_config_errors(void) {
    static const struct {
        const char *ov[2];
        const char *a, *b;
    } cases[] = {
        {{"quant.mode=ptq", NULL}, "act_static_scale", "quant.mode is ptq"},
        {{"quant.rules.1.weight_qtype=fp8_e4m3", NULL}, "learn_amax", "weight_qtype"},
        {{"quant.rules.1.double_quant=true", NULL}, "double_quant", "qat"},
        {{"quant.rules.0.learn_amax=lsq", NULL}, "act_static_scale", "learn_amax"},
        {{"quant.rules.1.bwd_qtype=int8", NULL}, "bwd_qtype", "quant.mode is qat"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char out_dir[512];
        snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/qat-err", qlora_runs.root);
        const char *ov[2] = {out_dir, cases[i].ov[0]};
        Config *c = malloc(sizeof *c);
        QtError err = {0};
        CU_ASSERT_EQUAL(config_load(c, "tests/configs/tiny-qat.yaml", ov, 2, &err), QT_ERR_CONFIG);
        if (!test_msg_has(&err, cases[i].a) || !test_msg_has(&err, cases[i].b)) {
            fprintf(stderr, "\n  case %zu: %s\n", i, err.msg);
            CU_FAIL("message");
        }
        free(c);
    }
}

int qlora_add_qat_tests(CU_pSuite s) {
    bool ok = CU_add_test(s, "qat: exact resume; convert evaluates as trained", test_qat_resume_and_convert) &&
              CU_add_test(s, "qat: mode and field combinations", test_qat_config_errors) &&
              CU_add_test(s, "qt: learns; exact resume with gradient noise", test_qt_run_and_resume) &&
              CU_add_test(s, "qt: the same bits on every int8 kernel family", test_qt_kernel_families) &&
              CU_add_test(s, "qat + lora: frozen fake-quantized base, adapters train", test_qat_lora);
    return ok ? 0 : -1;
}
