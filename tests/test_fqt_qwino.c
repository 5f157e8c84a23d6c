/* test_fqt_qwino.c - part of the quant_qt suite: QT's conv forward through the integer F(2x2, 3x3) (quant/qwino.h)
 * on the AVX2 int8 family gives the bits of the direct int8 product. */
#include <CUnit/CUnit.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/conv_taps.h"
#include "nn/conv_wino.h"
#include "quant/qgemm.h"
#include "quant/qwino.h"
#include "test_fqt.h"
#include "test_qarray.h"
#include "test_util.h"

static bool same(const float *a, const float *b, size_t n) { return n == 0 || memcmp(a, b, n * sizeof *a) == 0; }

/* On the AVX2 int8 family (no VNNI) a 3x3 stride-1 conv's forward sums come from the integer F(2x2, 3x3)
 * (quant/qwino.h) instead of qgemm_s8_nn, once an image (counted): exactly the same sums, so the output and every
 * gradient keep their bits (the float input gradient held to im2col + sgemm both times), fused epilogues, 2
 * threads, odd planes. */
void fqtest_qwino_same_bits(void) {
    if (!qgemm_cpu_has_isa(QGEMM_ISA_AVX2)) {
        test_skip("QT forward through qwino: this CPU has no AVX2 with FMA");
        return;
    }
    static const int geo[][3] = {{16, 10, 9}, {9, 7, 12}}; /* C, H, W */
    const ConvTapsLevel taps = conv_taps_max_level;
    const bool saved = conv_wino_enabled;
    qgemm_force_isa = QGEMM_ISA_AVX2, conv_taps_max_level = CONV_TAPS_OFF;
    CU_ASSERT_FATAL(parallel_set_threads(2) == 2);
    for (size_t g = 0; g < 2; g++) {
        Model m;
        qtest_conv_model(&m, geo[g][0], geo[g][1], geo[g][2], 12, 3, 1, 1, 360 + g);
        FqtLayer q;
        fqtest_init_int8(&q, &m.modules[0], 15);
        CU_ASSERT(qwino_fits(geo[g][0], 12, 3, 3, 1, 1));
        float *x = qa_normal_sample(370 + g, qtest_input_numel(&m.modules[0], 5));
        for (int e = CONV_EPI_NONE; e <= CONV_EPI_RELU_MAXPOOL2; e++) {
            const Rng start = q.rng;
            QtestRun r[2];
            for (int wino = 0; wino < 2; wino++) {
                conv_wino_enabled = wino;
                q.rng = start;
                const unsigned long calls = qwino_forward_calls;
                fqtest_run_fused(&q, x, 5, (ConvEpilogue)e, &r[wino]);
                CU_ASSERT_EQUAL(qwino_forward_calls - calls, wino ? 5u : 0u); /* one an image, when on */
            }
            conv_wino_enabled = saved;
            CU_ASSERT(same(r[1].y, r[0].y, r[0].ny) && same(r[1].dx, r[0].dx, r[0].nx));
            CU_ASSERT(same(r[1].dw, r[0].dw, r[0].nw) && same(r[1].db, r[0].db, r[0].nb));
            /* without gradients (eval: no X^T gathered), the same outputs */
            TestEnv ev;
            test_env_init(&ev, 5);
            ev.tape.grad_enabled = false;
            int xs[4];
            const int xnd = qtest_input_shape(&m.modules[0], 5, xs);
            Var *y = m.modules[0].fused_hook(&ev.tape, &m.modules[0], test_var(&ev, x, xnd, xs, false), &q,
                                             m.modules[0].bias ? &m.modules[0].bias->var : NULL, (ConvEpilogue)e);
            CU_ASSERT(y && var_numel(y) == r[0].ny && same(y->value.data, r[0].y, r[0].ny));
            test_env_free(&ev);
            qtest_run_free(&r[0]), qtest_run_free(&r[1]);
        }
        free(x);
        model_free(&m);
    }
    parallel_set_threads(1);
    qgemm_force_isa = -1, conv_taps_max_level = taps;
}

