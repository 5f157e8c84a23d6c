/* qlayer_int8_dw.c - the depthwise conv2d's int8 forward (qlayer_int8.h, qlayer_int8_conv_dw): every output
 * channel reads one input channel; each image is one task, its codes quantized in one pass (or as handed over),
 * then qgemm_dw, which pads itself: for all channels at once where each output channel reads its own, writing
 * the reader's codes itself when handing off; else per input channel, the relu in the kernel, a 2x2 max pool
 * over an input channel's outputs in scratch, and handing off the image's output in scratch to its reader's
 * codes. A pool's means come from the floats in scratch (qlayer_int8.c, "Hand-off"). */
#include <string.h>

#include "nn/pool2x2.h"
#include "qlayer_int8_internal.h"

/* ---- depthwise conv2d ------------------------------------------------------------------------------------------ */

typedef struct {
    int N, C, H, W, M;   /* M: output channels per input channel (OC = M C) */
    int OH, OW, YH, YW;  /* the conv's output; y's (pooled or not) */
    size_t scratch;      /* bytes of one thread's scratch: the image's codes, the kernel's dwords, the pool buffer,
                          * the image's output (handing off) */
    size_t dwords_at, pool_at, out_at;
    const float *x;      /* (N, C, H, W), or NULL: */
    const uint8_t *xc;   /* (N, C, H, W) the input's codes (Var.codes) */
    float *y;            /* (N, OC, YH, YW) */
    const VarCodes *hand; /* or NULL: y's buffer takes the output as its reader's codes */
    float *means;        /* (N, OC) or NULL: the output as its planes' means (nn_plane_mean) */
    QGemmCodes ac;
    QGemmDw d;           /* act, out, oc0, scratch set per channel */
    bool pool;
    uint8_t *work;       /* [pool threads * scratch] */
    uint8_t *bad;        /* [N] as ConvJob's */
} DwJob;

/* y (M, OH/2, OW/2) = the 2x2 maxima of r (M, OH, OW), as nn_maxpool2d(2, 2). */
static void dw_pool(float *y, const float *r, const DwJob *j) {
    for (int m = 0; m < j->M; m++, r += (size_t)j->OH * j->OW, y += (size_t)j->YH * j->YW)
        for (int i = 0; i < j->YH; i++) {
            const float *a = r + (size_t)2 * i * j->OW, *b = a + j->OW;
            for (int k = 0, win; k < j->YW; k++)
                y[(size_t)i * j->YW + k] = pool2x2_window(a[2 * k], a[2 * k + 1], b[2 * k], b[2 * k + 1], &win);
        }
}

/* One image: its codes in one pass (or as handed over), then the kernel, which pads: one call for all channels
 * where each output channel reads its own input channel and no pool follows (handing off, the kernel writes the
 * reader's codes itself), else a call per input channel for its M output channels (handing off, the image's
 * output in scratch, then its codes). */
static void dw_task(void *ctx, int n, int n_tasks) {
    (void)n_tasks;
    DwJob *j = ctx;
    const size_t plane = (size_t)j->H * j->W, out_img = (size_t)j->C * j->M * j->YH * j->YW;
    uint8_t *work = j->work + (size_t)parallel_thread_index() * j->scratch;
    float *pooled = (float *)(work + j->pool_at); /* pooling: (M, OH, OW) */
    const QGemmCodes *a = &j->ac;
    const uint8_t *codes = j->xc ? j->xc + (size_t)n * j->C * plane : work; /* (C, H, W) */
    const bool in_ok = j->xc || qgemm_quantize_u8(work, j->x + (size_t)n * j->C * plane, (size_t)j->C * plane, a->s,
                                                  a->lo, a->hi, a->zero);
    float *y = j->hand || j->means ? (float *)(work + j->out_at) : j->y + (size_t)n * out_img; /* (OC, YH, YW) */
    QGemmDw d = j->d;
    d.scratch = (uint32_t *)(work + j->dwords_at);
    const int OC = j->C * j->M;
    const size_t P = (size_t)j->YH * j->YW;
    bool out_ok = true;
    if (j->M == 1 && !j->pool) { /* one call for every channel, handing off as codes straight from the kernel */
        const VarCodes *h = j->hand;
        QGemmCodesOut co = {0};
        if (h) co = qlayer_int8_codes_out(h, (uint8_t *)j->y + n * qlayer_int8_handoff_image_bytes(h, OC, P));
        d.act = codes, d.in_plane = plane, d.oc0 = 0, d.n_oc = j->C, d.out = y, d.codes = h ? &co : NULL;
        out_ok = qgemm_dw(&d);
        if (h) qlayer_int8_handoff_tails(h, co.dst, OC, P);
    } else {
        for (int c = 0; c < j->C; c++) {
            float *yc = y + (size_t)c * j->M * j->YH * j->YW; /* (M, YH, YW) */
            d.act = codes + (size_t)c * plane, d.oc0 = c * j->M, d.out = j->pool ? pooled : yc;
            (void)qgemm_dw(&d); /* floats alone: true */
            if (j->pool) dw_pool(yc, pooled, j);
        }
        out_ok = !j->hand || qlayer_int8_handoff_image(j->hand, (uint8_t *)j->y + n * qlayer_int8_handoff_image_bytes(
                                                                     j->hand, OC, P), y, OC, P);
    }
    if (j->means) nn_plane_means(j->means + (size_t)n * OC, y, (size_t)OC, P);
    j->bad[n] = (uint8_t)((in_ok ? 0 : 1) | (out_ok ? 0 : 2));
}

Var *qlayer_int8_conv_dw(Tape *t, QLayer *q, Var *x, Var *bias, ConvEpilogue epi, const VarCodes *hand, bool means) {
    const Module *m = q->module;
    const ConvGeom2d *g = &m->geom;
    const int KH = q->w_shape[2], KW = q->w_shape[3];
    char sx[64];
    if (!qlayer_int8_conv_is_dw(q)) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: qlayer_int8_conv_dw: not a conv2d of one input channel per group",
                     m->path);
        return NULL;
    }
    if (x->value.ndim != 4 || x->value.shape[1] != g->groups || q->out % g->groups) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "%s: input %s does not fit the quantized conv2d layer (want (N, %d, H, W))",
                     m->path, tensor_shape_str(&x->value, sx, sizeof sx), g->groups);
        return NULL;
    }
    if (t->handoff_keep) hand = NULL; /* its floats are read too: no hand-off */
    DwJob j = {.N = x->value.shape[0], .C = g->groups, .H = x->value.shape[2], .W = x->value.shape[3],
               .M = q->out / g->groups, .pool = epi == CONV_EPI_RELU_MAXPOOL2, .hand = hand};
    j.OH = conv_general_out_size(j.H, KH, g->stride_h, g->pad_h, g->pad_h + g->pad_h_extra, 1);
    j.OW = conv_general_out_size(j.W, KW, g->stride_w, g->pad_w, g->pad_w + g->pad_w_extra, 1);
    if (j.OH < (j.pool ? 2 : 1) || j.OW < (j.pool ? 2 : 1)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "%s: kernel %dx%d (stride [%d, %d], padding [%d, %d]) does not fit input "
                     "%s%s", m->path, KH, KW, g->stride_h, g->stride_w, g->pad_h, g->pad_w,
                     tensor_shape_str(&x->value, sx, sizeof sx), j.pool ? " with a 2x2 max pool after it" : "");
        return NULL;
    }
    if (!qlayer_int8_ensure_packed(t, q) || !qlayer_int8_act_codes(t, q, &j.ac)) return NULL;
    if (x->codes && !(j.xc = qlayer_int8_input_codes(t, q, x, &j.ac, false))) return NULL;
    if (!x->codes) j.x = x->value.data;
    const QGemmPackedDw *pw = &q->int8->dw;
    j.YH = j.pool ? j.OH / 2 : j.OH, j.YW = j.pool ? j.OW / 2 : j.OW;
    j.dwords_at = ((size_t)j.C * j.H * j.W + 63) / 64 * 64;
    j.pool_at = j.dwords_at + qgemm_dw_scratch(pw, j.OH, j.OW, g->stride_h);
    j.out_at = j.pool_at + (j.pool ? ((size_t)j.M * j.OH * j.OW * sizeof(float) + 63) / 64 * 64 : 0);
    j.scratch = j.out_at + (hand || means ? ((size_t)q->out * j.YH * j.YW * sizeof(float) + 63) / 64 * 64 : 0);
    const int shape[4] = {j.N, q->out, j.YH, j.YW};
    if ((size_t)j.N * q->out * j.YH * j.YW < 16) j.hand = hand = NULL; /* as in qlayer_int8_conv_fused */
    Var *y = hand ? qlayer_int8_handoff_var(t, 4, shape, hand) : tape_new_var(t, 4, shape);
    if (y && hand) j.hand = y->codes; /* the arena's copy: the tasks may run after the caller's hand is gone */
    float *scale = qlayer_int8_out_scales(t, q, j.ac.s);
    if (y && !hand && means && !(y->means = j.means = tape_alloc(t, (size_t)j.N * q->out * sizeof *j.means)))
        return NULL;
    j.work = tape_alloc(t, (size_t)parallel_get_threads() * j.scratch);
    j.bad = tape_alloc(t, (size_t)j.N);
    if (!y || !scale || !j.work || !j.bad) return NULL;
    j.y = y->value.data;
    j.d = (QGemmDw){.in_h = j.H, .in_w = j.W, .pad_t = g->pad_h, .pad_l = g->pad_w, .oh_n = j.OH, .ow_n = j.OW,
                    .sh = g->stride_h, .sw = g->stride_w, .w = pw, .n_oc = j.M, .a_zero = j.ac.zero, .scale = scale,
                    .bias = bias ? bias->value.data : NULL, .relu = epi != CONV_EPI_NONE};
    DwJob *jp = tape_alloc(t, sizeof *jp); /* the tasks may run later, in the chain (qlayer_int8_launch) */
    if (!jp) return NULL;
    *jp = j;
    const QLayerInt8Job job = {.fn = dw_task, .ctx = jp, .n = j.N, .q = q, .x = x, .bad = j.bad,
                               .threads = qlayer_int8_threads_for((double)j.N * j.OH * j.OW * q->out * q->fan_in)};
    return qlayer_int8_launch(t, &job, j.hand && t->n_handoff == 1) ? y : NULL;
}
