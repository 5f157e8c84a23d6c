/* test_int8_handoff.c - the int8 hand-off between layers (qlayer_int8.h: an int8 conv2d whose output one int8
 * conv2d alone reads makes that reader's input codes itself): a model whose every conv-to-conv edge hands off
 * (into a depthwise conv as bytes; into 1x1 convs on channel quads as their planes, taken as they are or copied
 * into wider ones; into a padded 3x3 conv and a stride-2 conv's phases as channel quads, or as bytes interleaved;
 * into a two-channel conv's column quads; from plain convs, a conv with relu + max pool, a depthwise conv; and a
 * conv's planes' means for the global average pool that reads it) gives logits
 * bit for bit those without the hand-off, on every kernel family the CPU has, the portable kernels, 1 and 2
 * threads; which outputs are codes; the arena in the steady state; a NaN bias in a producer named in the error;
 * qgemm_interleave_u8x4 against its portable loop; and two residual blocks whose sums join the convs before them
 * and whose outputs' codes two readers share, against the model run module by module. The quant_int8_handoff
 * suite. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lora/lora.h"
#include "nn/gemm.h"
#include "quant/qgemm.h"
#include "quant/qlayer.h"
#include "quant/qlayer_int8.h"
#include "test_qarray.h"
#include "test_util.h"

/* ---- qgemm_interleave_u8x4 ----------------------------------------------------------------------------------- */

/* Rows n + 5 bytes apart (the sources overlapping, one given twice), written n + 3 dwords apart: the vector loop
 * equals the portable one, the dwords between rows and past the last untouched. */
static void test_interleave(void) {
    static const int NS[] = {1, 7, 14, 16, 17, 31, 33, 196};
    Rng r;
    rng_init(&r, 5100, 0);
    for (size_t c = 0; c < sizeof NS / sizeof *NS; c++)
        for (int rows = 1; rows <= 3; rows++) {
            const int n = NS[c];
            const size_t len = (size_t)rows * (n + 5) + 16; /* the 15 bytes a row's last vector may read past it */
            uint8_t *src = malloc(4 * len);
            for (size_t i = 0; i < 4 * len; i++) src[i] = (uint8_t)rng_below(&r, 256);
            const uint8_t *s[4] = {src, src + len, src + 2 * len + 3, src + len};
            const size_t ld = (size_t)n + 3, nd = (size_t)rows * ld + 16;
            uint32_t *iw = malloc(nd * 4), *ig = malloc(nd * 4);
            memset(iw, 0xCD, nd * 4), memset(ig, 0xCD, nd * 4);
            qgemm_interleave_u8x4_portable(iw, ld, s, (size_t)n + 5, rows, n);
            qgemm_interleave_u8x4(ig, ld, s, (size_t)n + 5, rows, n);
            CU_ASSERT(!memcmp(iw, ig, nd * 4));
            free(src), free(iw), free(ig);
        }
}

/* ---- a model of hand-offs ------------------------------------------------------------------------------------ */

enum { N = 3, C = 3, H = 12, W = 14, CLASSES = 5, N_Q = 8 };

/* c1 -> dw (depthwise: bytes) -> pw (1x1: channel quads, its planes as they are) -> c4 (3x3 padded: channel
 * quads copied by row into its padded planes; without qlayer_int8_handoff_quads, bytes interleaved) -> pq (1x1 with
 * relu + max pool: channel quads, copied into its wider planes) -> c5 (stride 2: channel quads dealt to phases, or
 * bytes interleaved first) -> c6 (two input channels, 5x5: bytes to column quads) -> pool -> fc. Every conv has a
 * relu, and a bias that keeps some of its outputs above 0. */
static const LayerSpec LS[] = {
    {.type = LAYER_CONV2D, .name = "c1", .out_channels = 8, .kernel = 3, .stride = 1, .padding = 1},
    {.type = LAYER_RELU},
    {.type = LAYER_CONV2D, .name = "dw", .out_channels = 8, .kernel = 3, .padding = 1, .groups = 8},
    {.type = LAYER_RELU},
    {.type = LAYER_CONV2D, .name = "pw", .out_channels = 12, .kernel = 1},
    {.type = LAYER_RELU},
    {.type = LAYER_CONV2D, .name = "c4", .out_channels = 6, .kernel = 3, .padding = 1},
    {.type = LAYER_RELU},
    {.type = LAYER_CONV2D, .name = "pq", .out_channels = 8, .kernel = 1},
    {.type = LAYER_RELU},
    {.type = LAYER_MAXPOOL2D, .kernel = 2, .stride = 2},
    {.type = LAYER_CONV2D, .name = "c5", .out_channels = 2, .kernel = 3, .stride = 2, .padding = 1},
    {.type = LAYER_RELU},
    {.type = LAYER_CONV2D, .name = "c6", .out_channels = 4, .kernel = 5, .padding = 2},
    {.type = LAYER_RELU},
    {.type = LAYER_GLOBALAVGPOOL},
    {.type = LAYER_DENSE, .name = "fc", .units = CLASSES},
};
static const int QUANTIZED[N_Q] = {0, 2, 4, 6, 8, 11, 13, 16};
/* the outputs made as codes: the relus after c1, dw, pw, c4 and c5, the pool after pq (the modules' indices) */
static const int CODES[] = {1, 3, 5, 7, 10, 12};
/* of them, by channel quads: the outputs pw and pq read; and with qlayer_int8_handoff_quads, those c4 and c5 read */
static const int QUADS[] = {3, 7};
static const int QUADS_TOO[] = {5, 10};

typedef struct {
    Model m;
    QLayer q[N_Q];
    int n_q;
    Arena a;
    Tape t;
    float *x;
} Net;

/* The model of layers ls (n_ls) with its modules quantized[0 .. n_q) quantized, calibrated on x. */
static void net_init_with(Net *n, const LayerSpec *ls, int n_ls, const int *quantized, int n_q) {
    QtError err = {0};
    memset(n, 0, sizeof *n);
    n->n_q = n_q;
    CU_ASSERT_EQUAL_FATAL(model_init(&n->m, 3, (const int[]){C, H, W}, ls, n_ls, &err), QT_OK);
    Rng r;
    rng_init(&r, 5200, RNG_STREAM_INIT);
    model_init_params(&n->m, &r);
    for (int i = 0; i < n_q; i++) {
        Param *b = n->m.modules[quantized[i]].bias;
        for (int k = 0; b && k < b->var.value.shape[0]; k++) b->var.value.data[k] = 0.05f * (float)(k % 3) + 0.02f;
    }
    n->x = qa_normal_sample(5201, N * C * H * W);
    for (int i = 0; i < n_q; i++) {
        Module *mod = &n->m.modules[quantized[i]];
        QLayerSpec s = qlayer_spec_default();
        s.weight_qtype = qa_find("int8");
        s.act_qtype = qa_find(i % 2 ? "uint8" : "int8"); /* signed symmetric and unsigned with zero points */
        s.act_symmetric = i % 2 == 0;
        if (i % 2) s.act_calib = (CalibSpec){.kind = CALIB_MINMAX, .s = 1.0};
        CU_ASSERT_EQUAL_FATAL(qlayer_init_quantize(&n->q[i], mod, &s, mod->weight->var.value.data, &err), QT_OK);
        param_release(mod->weight);
        qlayer_install(&n->q[i]);
        qlayer_calib_begin(&n->q[i]);
    }
    CU_ASSERT_FATAL(arena_init(&n->a, 4096) == 0);
    CU_ASSERT_EQUAL_FATAL(tape_init(&n->t, &n->a, NULL, NULL), QT_OK);
    n->t.grad_enabled = false, n->t.training = false;
    CU_ASSERT_PTR_NOT_NULL_FATAL(model_forward(&n->m, &n->t, tape_wrap(&n->t, n->x, 4, (const int[]){N, C, H, W})));
    for (int i = 0; i < n_q; i++) CU_ASSERT_EQUAL_FATAL(qlayer_calib_end(&n->q[i], &err), QT_OK);
}

static void net_init(Net *n) { net_init_with(n, LS, sizeof LS / sizeof *LS, QUANTIZED, N_Q); }

static void net_free(Net *n) {
    free(n->x);
    tape_free(&n->t);
    arena_free(&n->a);
    for (int i = 0; i < n->n_q; i++) qlayer_free(&n->q[i]);
    model_free(&n->m);
}

/* The logits into y, with or without the hand-off; false if the forward failed. */
static bool net_logits(Net *n, bool handoff, float *y);

/* The logits into y with the hand-off, with or without the chain of hand-offs; false if the forward failed. */
static bool net_logits_chain(Net *n, bool chain, float *y) {
    qlayer_int8_chain = chain;
    const bool ok = net_logits(n, true, y);
    qlayer_int8_chain = true;
    return ok;
}

/* The logits into y, with or without the hand-off; false if the forward failed. */
static bool net_logits(Net *n, bool handoff, float *y) {
    tape_reset(&n->t);
    qlayer_int8_handoff = handoff;
    Var *out = model_forward(&n->m, &n->t, tape_wrap(&n->t, n->x, 4, (const int[]){N, C, H, W}));
    qlayer_int8_handoff = true;
    if (out) memcpy(y, out->value.data, N * CLASSES * sizeof *y);
    return out != NULL;
}

/* Whether module i's output came as codes. */
static bool is_codes(const Net *n, int i) { return n->m.outs[1 + i] && n->m.outs[1 + i]->codes; }

static const QGemmIsa FAMILIES[] = {QGEMM_ISA_AMX, QGEMM_ISA_AVX512_VNNI, QGEMM_ISA_AVXVNNI, QGEMM_ISA_AVX2};
enum { N_SETTINGS = 10 };

/* Kernel setting k < N_SETTINGS: the portable kernels (k / 2 == 0) or FAMILIES[k / 2 - 1], on 1 + k % 2 threads
 * (on 2, every layer split); false for a family the CPU lacks. */
static bool kernels_set(int k) {
    const int f = k / 2 - 1, threads = 1 + k % 2;
    if (f >= 0 && !qgemm_cpu_has_isa(FAMILIES[f])) return false;
    qgemm_force_portable = f < 0, qgemm_force_isa = f < 0 ? -1 : (int)FAMILIES[f];
    gemm_set_threads(threads);
    qlayer_int8_parallel_min_macs = threads > 1 ? 0.0 : 4e6;
    return true;
}

static void kernels_reset(void) {
    qgemm_force_portable = false, qgemm_force_isa = -1;
    gemm_set_threads(1);
    qlayer_int8_parallel_min_macs = 4e6;
}

/* On each family and the portable kernels, 1 and 2 threads, with and without channel quads for c4 and c5: the same
 * logits with and without the hand-off, the expected outputs as codes (and none without it). */
static void test_handoff_same_logits(void) {
    Net n;
    net_init(&n);
    int ran = 0;
    for (int kq = 0; kq < 2 * N_SETTINGS; kq++) {
        const int ks = kq / 2;
        const bool quads = kq % 2 == 0;
        qlayer_int8_handoff_quads = quads;
        if (!kernels_set(ks)) continue;
        float with[N * CLASSES], without[N * CLASSES];
        CU_ASSERT_FATAL(net_logits(&n, false, without));
        for (size_t k = 0; k < sizeof CODES / sizeof *CODES; k++) CU_ASSERT(!is_codes(&n, CODES[k]));
        CU_ASSERT(n.m.outs[1 + 14]->means == NULL);
        CU_ASSERT_FATAL(net_logits(&n, true, with));
        for (size_t k = 0; k < sizeof CODES / sizeof *CODES; k++) CU_ASSERT(is_codes(&n, CODES[k]));
        for (size_t k = 0; k < sizeof QUADS / sizeof *QUADS; k++)
            CU_ASSERT(is_codes(&n, QUADS[k]) && n.m.outs[1 + QUADS[k]]->codes->plane > 0);
        for (size_t k = 0; k < sizeof QUADS_TOO / sizeof *QUADS_TOO; k++) /* c4 padded, c5 strided */
            CU_ASSERT(is_codes(&n, QUADS_TOO[k]) && (n.m.outs[1 + QUADS_TOO[k]]->codes->plane > 0) == quads);
        CU_ASSERT(!is_codes(&n, 14) && !is_codes(&n, 15)); /* c6's read by the pool, the pool's by fc */
        CU_ASSERT(n.m.outs[1 + 14]->means != NULL); /* c6 made the pool's means */
        const bool same = !memcmp(with, without, sizeof with);
        if (!same) fprintf(stderr, "\n  kernel setting %d: the hand-off changed the logits\n", ks);
        CU_ASSERT(same);
        /* without the chain (each layer over the batch, then the next), and with it: c1 .. c6 image by image */
        float unchained[N * CLASSES], chained[N * CLASSES];
        const unsigned long before = qlayer_int8_chained;
        CU_ASSERT_FATAL(net_logits_chain(&n, false, unchained));
        CU_ASSERT_EQUAL(qlayer_int8_chained, before);
        CU_ASSERT_FATAL(net_logits_chain(&n, true, chained));
        CU_ASSERT_EQUAL(qlayer_int8_chained - before, 7); /* all seven convs in one chain */
        CU_ASSERT(!memcmp(with, unchained, sizeof with) && !memcmp(with, chained, sizeof with));
        ran++;
    }
    kernels_reset();
    qlayer_int8_handoff_quads = true;
    CU_ASSERT(ran >= 4);
    /* the logits differ between images: the codes of every layer reach them */
    float y[N * CLASSES];
    CU_ASSERT_FATAL(net_logits(&n, true, y));
    CU_ASSERT(memcmp(y, y + CLASSES, CLASSES * sizeof *y) != 0 && memcmp(y, y + 2 * CLASSES, CLASSES * sizeof *y));
    /* the float path is another computation: the comparison above is not vacuous */
    float fl[N * CLASSES], i8[N * CLASSES];
    CU_ASSERT_FATAL(net_logits(&n, true, i8));
    qlayer_int8_disable = true;
    CU_ASSERT_FATAL(net_logits(&n, true, fl));
    qlayer_int8_disable = false;
    CU_ASSERT(memcmp(fl, i8, sizeof fl) != 0);
    ASSERT_ALL_CLOSE(i8, fl, (size_t)(N * CLASSES), 2e-3, 2e-3);
    net_free(&n);
}

/* A depthwise conv's planes' means for the pool that alone reads it: the same logits, on the kernels and portable. */
static void test_handoff_dw_means(void) {
    static const LayerSpec DS[] = {
        {.type = LAYER_CONV2D, .name = "c1", .out_channels = 8, .kernel = 3, .stride = 2, .padding = 1},
        {.type = LAYER_RELU},
        {.type = LAYER_CONV2D, .name = "dw", .out_channels = 8, .kernel = 3, .padding = 1, .groups = 8},
        {.type = LAYER_RELU},
        {.type = LAYER_GLOBALAVGPOOL},
        {.type = LAYER_DENSE, .name = "fc", .units = CLASSES},
    };
    static const int DQ[] = {0, 2, 5};
    Net n;
    net_init_with(&n, DS, 6, DQ, 3);
    for (int portable = 0; portable < 2; portable++) {
        qgemm_force_portable = portable;
        float with[N * CLASSES], without[N * CLASSES];
        CU_ASSERT_FATAL(net_logits(&n, false, without));
        CU_ASSERT(n.m.outs[1 + 3]->means == NULL);
        CU_ASSERT_FATAL(net_logits(&n, true, with));
        CU_ASSERT(n.m.outs[1 + 3]->means != NULL && is_codes(&n, 1));
        CU_ASSERT(!memcmp(with, without, sizeof with));
    }
    qgemm_force_portable = false;
    net_free(&n);
}

/* Steps with the hand-off take no more arena than the first. */
static void test_handoff_steady_state(void) {
    Net n;
    net_init(&n);
    float first[N * CLASSES], y[N * CLASSES];
    CU_ASSERT_FATAL(net_logits(&n, true, first));
    const size_t grown = n.a.grow_count;
    for (int step = 0; step < 3; step++) {
        CU_ASSERT_FATAL(net_logits(&n, true, y));
        CU_ASSERT(!memcmp(first, y, sizeof y));
    }
    CU_ASSERT_EQUAL(n.a.grow_count, grown);
    net_free(&n);
}

/* A producer whose output is not finite (an infinite bias in pw: its relu keeps it, as a NaN it would make 0): the
 * forward fails, with the hand-off naming pw, without it where the reader quantizes, and works again with the
 * bias restored. */
static void test_handoff_nonfinite(void) {
    Net n;
    net_init(&n);
    Param *b = n.m.modules[4].bias; /* pw */
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    const float keep = b->var.value.data[1];
    b->var.value.data[1] = INFINITY;
    float y[N * CLASSES];
    CU_ASSERT_FALSE(net_logits(&n, true, y));
    CU_ASSERT_PTR_NOT_NULL(strstr(n.t.err.msg, "pw"));
    CU_ASSERT_PTR_NOT_NULL(strstr(n.t.err.msg, "not finite"));
    CU_ASSERT_FALSE(net_logits(&n, false, y)); /* the reader's quantizer finds it */
    CU_ASSERT_PTR_NOT_NULL(strstr(n.t.err.msg, "holds inf"));
    b->var.value.data[1] = keep;
    CU_ASSERT(net_logits(&n, true, y));
    net_free(&n);
}

/* ---- residual blocks ------------------------------------------------------------------------------------------ */

/* Two residual blocks as ResNet-8 has them: c0 -> stem (relu) read by c1 and by sum1 = stem + c2, then a relu read by
 * two convs (c3, 3x3 stride s, and the shortcut sc, 1x1 stride s), sum2 = c4 + sc without a relu, the pool, fc. The
 * conv before each add takes the add (and the relu) as its epilogue; stem goes to c1 as codes and to sum1 as
 * floats, both made by c0 (VarCodes.floats); out1 goes to c3 and sc as one set of codes
 * where their quantizers agree (channel quads, which c3 and sc copy or deal to phases or, sc at stride 1, take as
 * its planes; bytes without qlayer_int8_handoff_quads); sc makes the pool's means. */
enum { R_C2 = 4, R_SUM1 = 5, R_OUT1 = 6, R_SC = 10, R_SUM2 = 11, R_N = 14 };

static void residual_layers(LayerSpec *ls, int stride) {
    int n = 0;
    ls[n++] = test_layer(LAYER_CONV2D, "c0", NULL, NULL);
    ls[n++] = test_layer(LAYER_RELU, "stem", NULL, NULL);
    ls[n++] = test_layer(LAYER_CONV2D, "c1", NULL, NULL);
    ls[n++] = test_layer(LAYER_RELU, "r1", NULL, NULL);
    ls[n++] = test_layer(LAYER_CONV2D, "c2", NULL, NULL);
    ls[n++] = test_layer(LAYER_ADD, "sum1", "stem", "c2"); /* the residual first */
    ls[n++] = test_layer(LAYER_RELU, "out1", NULL, NULL);
    ls[n++] = test_layer(LAYER_CONV2D, "c3", NULL, NULL);
    ls[n++] = test_layer(LAYER_RELU, "r3", NULL, NULL);
    ls[n++] = test_layer(LAYER_CONV2D, "c4", NULL, NULL);
    ls[n++] = test_layer(LAYER_CONV2D, "sc", "out1", NULL);
    ls[n++] = test_layer(LAYER_ADD, "sum2", "c4", "sc"); /* the residual second */
    ls[n++] = test_layer(LAYER_GLOBALAVGPOOL, "gap", NULL, NULL);
    ls[n++] = test_layer(LAYER_DENSE, "fc", NULL, NULL);
    for (int i = 0; i < n; i++) ls[i].out_channels = i < 7 ? 8 : 12, ls[i].no_bias = i == 4; /* c2 as before a BN */
    ls[7].stride = stride, ls[10].stride = stride, ls[10].kernel = 1, ls[10].padding = 0;
    ls[13].units = CLASSES;
}

/* With the convs' inputs quantized in the order q (net_init_with: c3's and sc's alike or not), on each family and
 * the portable kernels, 1 and 2 threads: the logits with the sums fused equal those of the model run with its
 * outputs kept (every module on its own), and those of the float path too. */
static void residual_case(const int *q, int stride, bool shared) {
    LayerSpec ls[R_N];
    residual_layers(ls, stride);
    Net n;
    net_init_with(&n, ls, R_N, q, 7);
    for (int kq = 0; kq < 2 * N_SETTINGS; kq++) {
        const int ks = kq / 2;
        const bool quads = kq % 2 == 0;
        qlayer_int8_handoff_quads = quads;
        if (!kernels_set(ks)) continue;
        float fused[N * CLASSES], each[N * CLASSES];
        n.m.keep_outputs = true;
        CU_ASSERT_FATAL(net_logits(&n, true, each));
        CU_ASSERT(n.m.outs[1 + R_SUM1] && n.m.outs[1 + R_SUM2] && !is_codes(&n, R_OUT1));
        n.m.keep_outputs = false;
        const unsigned long before = qlayer_int8_chained, chains = qlayer_int8_chains;
        CU_ASSERT_FATAL(net_logits(&n, true, fused));
        /* every conv in a chain: c0 (codes and floats), c1, c2 (its codes to c3 and sc alike: one chain to sc, which
         * makes the means; readers with their own codes: no hand-off, so c2 ends a first chain), c3, c4 (its floats
         * to the sum alone), sc */
        CU_ASSERT_EQUAL(qlayer_int8_chained - before, 6);
        CU_ASSERT_EQUAL(qlayer_int8_chains - chains, shared ? 1 : 2);
        CU_ASSERT(!n.m.outs[1 + R_C2] && !n.m.outs[1 + R_SUM1] && !n.m.outs[1 + R_SC]); /* never made */
        CU_ASSERT(is_codes(&n, R_OUT1) == shared);
        CU_ASSERT(!shared || (is_codes(&n, R_OUT1) && (n.m.outs[1 + R_OUT1]->codes->plane > 0) == quads));
        /* stem: codes for c1 and its floats for the sum (VarCodes.floats); r1: codes alone */
        CU_ASSERT(is_codes(&n, R_OUT1 - 5) && n.m.outs[1 + R_OUT1 - 5]->codes->floats);
        CU_ASSERT(is_codes(&n, R_OUT1 - 3) && !n.m.outs[1 + R_OUT1 - 3]->codes->floats);
        CU_ASSERT(n.m.outs[1 + R_SUM2] && n.m.outs[1 + R_SUM2]->means);
        const bool same = !memcmp(fused, each, sizeof fused);
        if (!same) fprintf(stderr, "\n  kernel setting %d: the fused sums changed the logits\n", ks);
        CU_ASSERT(same);
    }
    kernels_reset();
    qlayer_int8_handoff_quads = true;
    /* the float path declines the sums: the adds run, the same logits */
    float fused[N * CLASSES], each[N * CLASSES], i8[N * CLASSES];
    CU_ASSERT_FATAL(net_logits(&n, true, i8));
    qlayer_int8_disable = true;
    n.m.keep_outputs = true;
    CU_ASSERT_FATAL(net_logits(&n, true, each));
    n.m.keep_outputs = false;
    CU_ASSERT_FATAL(net_logits(&n, true, fused));
    CU_ASSERT(n.m.outs[1 + R_SUM1] != NULL);
    qlayer_int8_disable = false;
    CU_ASSERT(!memcmp(fused, each, sizeof fused));
    CU_ASSERT(memcmp(fused, i8, sizeof fused) != 0); /* another computation: the comparisons above are not vacuous */
    ASSERT_ALL_CLOSE(i8, fused, (size_t)(N * CLASSES), 5e-3, 5e-3);
    net_free(&n);
}

static void test_residual_shared_codes(void) {
    residual_case((const int[]){0, 2, 4, 7, 9, 10, 13}, 2, true);
    residual_case((const int[]){0, 2, 4, 7, 9, 10, 13}, 1, true);
}

/* sc's input quantizer signed and symmetric, c3's unsigned: out1 stays float, each quantizes it */
static void test_residual_own_codes(void) { residual_case((const int[]){0, 2, 4, 7, 10, 9, 13}, 2, false); }

/* The logits of n with its input scaled by 3 first, so that the buffers the next run takes hold other values (a
 * read before a write then shows), then with the input as it is; with the hand-off and the chain. */
static bool net_logits_after_other(Net *n, float *y) {
    for (int i = 0; i < N * C * H * W; i++) n->x[i] *= 3.0f;
    float other[N * CLASSES];
    const bool ok = net_logits(n, true, other);
    for (int i = 0; i < N * C * H * W; i++) n->x[i] /= 3.0f;
    return ok && net_logits(n, true, y);
}

/* The chain of hand-offs past a merge that no conv takes: c0 (relu) goes to c1 as codes and to a concat as floats,
 * c1's output to the concat alone, so both wait in the chain; the concat is no conv's epilogue, so model_forward runs
 * the chain before it. On each family and the portable kernels: the two convs ran as one chain, and the logits equal
 * those of the model run module by module and of the hand-off without the chain. */
static void test_chain_before_merge(void) {
    LayerSpec ls[6];
    ls[0] = test_layer(LAYER_CONV2D, "c0", NULL, NULL);
    ls[1] = test_layer(LAYER_RELU, "r0", NULL, NULL);
    ls[2] = test_layer(LAYER_CONV2D, "c1", NULL, NULL);
    ls[3] = test_layer(LAYER_CONCAT, "cat", "c1", "r0");
    ls[4] = test_layer(LAYER_GLOBALAVGPOOL, "gap", NULL, NULL);
    ls[5] = test_layer(LAYER_DENSE, "fc", NULL, NULL);
    ls[0].out_channels = 8, ls[2].out_channels = 4, ls[5].units = CLASSES;
    Net n;
    net_init_with(&n, ls, 6, (const int[]){0, 2, 5}, 3);
    for (int ks = 0; ks < N_SETTINGS; ks++) {
        if (!kernels_set(ks)) continue;
        float each[N * CLASSES], unchained[N * CLASSES], chained[N * CLASSES];
        n.m.keep_outputs = true;
        CU_ASSERT_FATAL(net_logits(&n, true, each));
        n.m.keep_outputs = false;
        CU_ASSERT_FATAL(net_logits_chain(&n, false, unchained));
        const unsigned long before = qlayer_int8_chained;
        CU_ASSERT_FATAL(net_logits_after_other(&n, chained));
        CU_ASSERT_EQUAL(qlayer_int8_chained - before, 4); /* c0 and c1 twice, run by the concat */
        CU_ASSERT(is_codes(&n, 1) && n.m.outs[2]->codes->floats); /* r0: codes for c1, floats for the concat */
        const bool same = !memcmp(each, unchained, sizeof each) && !memcmp(each, chained, sizeof each);
        if (!same) fprintf(stderr, "\n  kernel setting %d: the chain changed the logits\n", ks);
        CU_ASSERT(same);
    }
    kernels_reset();
    net_free(&n);
}

/* A residual sum that the int8 conv before it takes into its epilogue, whose relu is not the next module (a conv
 * between): the relu runs on its own, not as nn_add_relu's pass-free record (model_graph_add_relu holds only for a
 * relu right after its add, which a fused group takes with the add). On each family and the portable kernels: the
 * sum fused away, and the logits of the model run module by module. */
static void test_residual_relu_apart(void) {
    LayerSpec ls[9];
    ls[0] = test_layer(LAYER_CONV2D, "c0", NULL, NULL);
    ls[1] = test_layer(LAYER_RELU, "stem", NULL, NULL);
    ls[2] = test_layer(LAYER_CONV2D, "c2", NULL, NULL);      /* int8: takes sum1 as its residual */
    ls[3] = test_layer(LAYER_ADD, "sum1", "stem", "c2");
    ls[4] = test_layer(LAYER_CONV2D, "cx", "stem", NULL);    /* between the sum and its relu */
    ls[5] = test_layer(LAYER_RELU, "out1", "sum1", NULL);
    ls[6] = test_layer(LAYER_ADD, "sum2", "out1", "cx");
    ls[7] = test_layer(LAYER_GLOBALAVGPOOL, "gap", NULL, NULL);
    ls[8] = test_layer(LAYER_DENSE, "fc", NULL, NULL);
    ls[8].units = CLASSES;
    Net n;
    net_init_with(&n, ls, 9, (const int[]){2}, 1);
    CU_ASSERT(!model_graph_add_relu(&n.m, 3));
    for (int ks = 0; ks < N_SETTINGS; ks++) {
        if (!kernels_set(ks)) continue;
        float each[N * CLASSES], fused[N * CLASSES];
        n.m.keep_outputs = true;
        CU_ASSERT_FATAL(net_logits(&n, true, each));
        n.m.keep_outputs = false;
        CU_ASSERT_FATAL(net_logits(&n, true, fused));
        CU_ASSERT(!n.m.outs[1 + 2] && n.m.outs[1 + 3]); /* c2's output never made: its epilogue made the sum */
        const bool same = !memcmp(each, fused, sizeof each);
        if (!same) fprintf(stderr, "\n  kernel setting %d: a sum's relu apart changed the logits\n", ks);
        CU_ASSERT(same);
    }
    kernels_reset();
    net_free(&n);
}

/* A LoRA adapter over quantized conv `at` of n (rank 2, B not zero), installed. */
static void lora_over(LoraAdapter *a, Net *n, int at) {
    memset(a, 0, sizeof *a);
    QtError err = {0};
    const LoraSpec sp = {.rank = 2, .alpha = 2.0f, .init = LORA_INIT_DEFAULT};
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(a, &n->m.modules[at], &sp, &err), QT_OK);
    Rng r;
    rng_init(&r, 77, 0);
    lora_adapter_init_params(a, &r);
    for (size_t i = 0; i < var_numel(&a->B.var); i++) a->B.var.value.data[i] = 0.01f * (float)(i % 5);
    lora_adapter_install(a);
}

/* An adapter reads its base's output at once, so a quantized conv under one neither hands its output off nor waits
 * in the chain, whatever reads the module: c4 under LoRA in the residual blocks (the sum alone reads it), and c0
 * under LoRA read by an int8 conv. On each family and the portable kernels, 1 and 2 threads, with other values left
 * in the buffers first: the logits of the model run module by module. */
static void test_adapter_over_int8(void) {
    LayerSpec ls[R_N];
    residual_layers(ls, 1);
    Net n;
    net_init_with(&n, ls, R_N, (const int[]){0, 2, 4, 7, 9, 10, 13}, 7);
    LoraAdapter a;
    lora_over(&a, &n, 9);
    LayerSpec two[4] = {test_layer(LAYER_CONV2D, "c0", NULL, NULL), test_layer(LAYER_CONV2D, "c1", NULL, NULL),
                        test_layer(LAYER_GLOBALAVGPOOL, "gap", NULL, NULL), test_layer(LAYER_DENSE, "fc", NULL, NULL)};
    two[0].out_channels = 8, two[1].out_channels = 4, two[3].units = CLASSES;
    Net n2;
    net_init_with(&n2, two, 4, (const int[]){0, 1, 3}, 3);
    LoraAdapter a2;
    lora_over(&a2, &n2, 0);
    Net *nets[2] = {&n, &n2};
    for (int ks = 0; ks < N_SETTINGS; ks++) {
        if (!kernels_set(ks)) continue;
        for (int k = 0; k < 2; k++) {
            float each[N * CLASSES], fused[N * CLASSES];
            nets[k]->m.keep_outputs = true;
            CU_ASSERT_FATAL(net_logits(nets[k], true, each));
            nets[k]->m.keep_outputs = false;
            CU_ASSERT_FATAL(net_logits_after_other(nets[k], fused));
            const bool same = !memcmp(each, fused, sizeof each);
            if (!same) fprintf(stderr, "\n  kernel setting %d, model %d: the adapter's logits changed\n", ks, k);
            CU_ASSERT(same);
        }
    }
    kernels_reset();
    lora_adapter_free(&a), lora_adapter_free(&a2);
    net_free(&n), net_free(&n2);
}

int register_quant_int8_handoff_suite(void) {
    CU_pSuite s = CU_add_suite("quant_int8_handoff", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "qgemm_interleave_u8x4 equals its portable loop", test_interleave) ||
           !CU_add_test(s, "the hand-off leaves the logits bit for bit", test_handoff_same_logits) ||
           !CU_add_test(s, "a depthwise conv's means for the pool that reads it", test_handoff_dw_means) ||
           !CU_add_test(s, "the hand-off in the steady state", test_handoff_steady_state) ||
           !CU_add_test(s, "a producer's non-finite output is an error naming it", test_handoff_nonfinite) ||
           !CU_add_test(s, "residual sums fused, codes shared by two readers", test_residual_shared_codes) ||
           !CU_add_test(s, "residual sums fused, readers with their own codes", test_residual_own_codes) ||
           !CU_add_test(s, "the chain runs before a merge that no conv takes", test_chain_before_merge) ||
           !CU_add_test(s, "a residual sum fused, its relu a module apart", test_residual_relu_apart) ||
           !CU_add_test(s, "a quantized conv under an adapter hands nothing off and never waits",
                        test_adapter_over_int8);
}
