/* qlayer_int8_conv.c - the plain conv2d's int8 forward (qlayer_int8.h, qlayer_int8_conv_fused): each image is one
 * task that builds its planes of codes (ch4, kw4, ph4 or cols, as qlayer_int8.c's opening comment describes), runs
 * the taps kernel with its epilogue, adds a residual, and hands its output off as codes or means (the kernel sums
 * the residual and makes the codes itself where its family does so in the epilogue: qgemm_taps_codes_direct). */
#include <stdlib.h>
#include <string.h>

#include "nn/ops.h"
#include "qlayer_int8_internal.h"
#include "qwino.h"

/* ---- conv2d ---------------------------------------------------------------------------------------------------- */

typedef struct {
    ConvShape c;
    int N, H, W, OC, OH, OW, stride, pad;
    int Hp, Wp;        /* the padded input's rows and row pitch (stride-1 groupings) */
    int Wq;            /* ph4: a phase's row pitch, (Wp + 1) / 2 */
    size_t phase;      /* ph4: dwords of a phase, (Hp + 1) / 2 rows of Wq */
    int pitch;         /* q per output row: Wp, Wq for ph4, or OW for cols */
    size_t plane;      /* dwords per group plane */
    size_t out_img;    /* floats of one image's output */
    size_t scratch;    /* bytes of one thread's scratch: cols' padded codes, the planes, kw4's bytes, the pool */
    size_t planes_at;  /* offset of the planes in it */
    size_t pool_at;    /* offset of the pool buffer in it */
    size_t out_at;     /* offset of the image's output in it, handing off */
    size_t wide_at;    /* offset of the taps kernel's widened codes in it (the AVX2 family; else 0 bytes) */
    const float *x;    /* (N, C, H, W), or NULL: */
    const uint8_t *xc; /* (N, C, H, W) the input's codes (Var.codes), or by channel quads: */
    size_t xc_plane;   /* their Var.codes plane */
    QGemmCodes ac;
    QGemmTaps g;       /* act and out set per image */
    const VarCodes *hand; /* or NULL: the output goes to yc as its reader's codes */
    bool keep;         /* handing off, the floats go to the output Var too (VarCodes.floats) */
    uint8_t *yc;       /* (N, OC, YH, YW) */
    float *means;      /* (N, OC) or NULL: the output as its planes' means (nn_plane_mean) */
    const float *res;  /* (N, OC, OH, OW) or NULL: summed into the output before res_relu */
    bool res_relu;
    uint8_t *work;     /* [pool threads * scratch] */
    const QWino *wino; /* the floats through the integer F(2x2, 3x3) (qwino.h) in place of the taps kernel, or NULL */
    const int32_t *wino_w;
    size_t wino_at;    /* offset of its scratch in the thread's */
    uint8_t *bad;      /* [N] 1: an input value not finite; 2: an output value, handing off */
} ConvJob;

/* ch4: planes (ceil(C/4), plane) of 4 channels per padded pixel, quantized straight from x (C, H, W): the
 * padding is filled around the image. False for a value that is not finite. */
static bool planes_ch4(uint32_t *pl, const float *x, const ConvJob *j) {
    const uint32_t fill = (uint32_t)j->ac.zero * 0x01010101u;
    const int C = j->c.C, H = j->H, W = j->W, pad = j->pad, Wp = j->Wp;
    bool ok = true;
    for (int g = 0; g < j->c.groups; g++) {
        uint32_t *p = pl + (size_t)g * j->plane;
        qlayer_int8_fill_dwords(p, (size_t)pad * Wp + pad, fill); /* the rows above and the first row's left */
        for (int h = 0; h + 1 < H; h++) qlayer_int8_fill_dwords(p + (size_t)(h + pad) * Wp + pad + W, (size_t)(Wp - W), fill);
        const size_t end = (size_t)(H - 1 + pad) * Wp + pad + W; /* the last row's right, the rows below, the tail */
        qlayer_int8_fill_dwords(p + end, j->plane - end, fill);
        const float *r[4];
        for (int k = 0; k < 4; k++) r[k] = 4 * g + k < C ? x + (size_t)(4 * g + k) * H * W : NULL;
        ok &= qgemm_quantize_u8x4(p + (size_t)pad * Wp + pad, (size_t)Wp, r, (size_t)W, H, W, &j->ac);
    }
    return ok;
}

/* ch4 from the input's codes xc (C, H, W): the same planes, the 4 channels' bytes interleaved (channels past C read
 * zrow, H W + 16 zero points). */
static void planes_ch4_codes(uint32_t *pl, const uint8_t *xc, const uint8_t *zrow, const ConvJob *j) {
    const uint32_t fill = (uint32_t)j->ac.zero * 0x01010101u;
    const int C = j->c.C, H = j->H, W = j->W, pad = j->pad, Wp = j->Wp;
    for (int g = 0; g < j->c.groups; g++) {
        uint32_t *p = pl + (size_t)g * j->plane;
        qlayer_int8_fill_dwords(p, (size_t)pad * Wp + pad, fill);
        for (int h = 0; h + 1 < H; h++) qlayer_int8_fill_dwords(p + (size_t)(h + pad) * Wp + pad + W, (size_t)(Wp - W), fill);
        const size_t end = (size_t)(H - 1 + pad) * Wp + pad + W;
        qlayer_int8_fill_dwords(p + end, j->plane - end, fill);
        const uint8_t *r[4];
        for (int k = 0; k < 4; k++) r[k] = 4 * g + k < C ? xc + (size_t)(4 * g + k) * H * W : zrow;
        if (Wp == W) qgemm_interleave_u8x4(p, 0, r, 0, 1, H * W); /* unpadded rows follow each other: one run */
        else qgemm_interleave_u8x4(p + (size_t)pad * Wp + pad, (size_t)Wp, r, (size_t)W, H, W);
    }
}

/* ch4 from codes by channel quads (xc_plane dwords a group, unpadded): each row copied into the padded planes. */
static void planes_ch4_quads(uint32_t *pl, const uint32_t *xq, const ConvJob *j) {
    const uint32_t fill = (uint32_t)j->ac.zero * 0x01010101u;
    const int H = j->H, W = j->W, pad = j->pad, Wp = j->Wp;
    for (int g = 0; g < j->c.groups; g++) {
        uint32_t *p = pl + (size_t)g * j->plane;
        const uint32_t *src = xq + (size_t)g * j->xc_plane;
        qlayer_int8_fill_dwords(p, (size_t)pad * Wp + pad, fill);
        for (int h = 0; h < H; h++) {
            memcpy(p + (size_t)(h + pad) * Wp + pad, src + (size_t)h * W, (size_t)W * 4);
            if (h + 1 < H) qlayer_int8_fill_dwords(p + (size_t)(h + pad) * Wp + pad + W, (size_t)(Wp - W), fill);
        }
        const size_t end = (size_t)(H - 1 + pad) * Wp + pad + W;
        qlayer_int8_fill_dwords(p + end, j->plane - end, fill);
    }
}

/* a[k] = s[2 k] for k < (n + 1) / 2, b[k] = s[2 k + 1] for k < n / 2: a row's dwords split by parity (vectorised
 * in the SIMD clones: the same copies). */
NN_SIMD_CLONES
static void split_parity(uint32_t *restrict a, uint32_t *restrict b, const uint32_t *restrict s, int n) {
    for (int k = 0; k < n / 2; k++) a[k] = s[2 * k], b[k] = s[2 * k + 1];
    if (n & 1) a[n / 2] = s[n - 1];
}

/* a[k] = s[2 k] for k < (n + 1) / 2: split_parity's even half alone. */
NN_SIMD_CLONES
static void take_even(uint32_t *restrict a, const uint32_t *restrict s, int n) {
    for (int k = 0; k < (n + 1) / 2; k++) a[k] = s[2 * k];
}

/* ph4: planes (C / 4, plane) of 4 channels per padded pixel as ch4, each split into the image's four phases (row
 * parity a, column parity b: phase 2 a + b, (Hp + 1) / 2 rows of Wq), so that a stride-2 tap (kh, kw) reads phase
 * (kh % 2, kw % 2) shifted by (kh / 2, kw / 2) as a stride-1 tap reads its plane. The group's channels are
 * quantized from x (or interleaved from the codes xc) into tmp (H W dwords) in one call, then dealt to the
 * phases; channel quads handed over (xc_plane) are dealt from where they are. False for a value of x that is not
 * finite. */
static bool planes_ph4(uint32_t *pl, uint32_t *tmp, const float *x, const uint8_t *xc, const ConvJob *j) {
    const uint32_t fill = (uint32_t)j->ac.zero * 0x01010101u;
    const int H = j->H, W = j->W, pad = j->pad;
    const size_t HW = (size_t)H * W, PS = j->phase;
    bool ok = true;
    for (int g = 0; g < j->c.groups; g++) {
        uint32_t *p = pl + (size_t)g * j->plane;
        qlayer_int8_fill_dwords(p, j->plane, fill); /* the padding, and what the taps read past the last phase */
        const uint32_t *src = tmp;
        if (xc && j->xc_plane) {
            src = (const uint32_t *)(const void *)xc + (size_t)g * j->xc_plane;
        } else if (xc) {
            const uint8_t *r[4];
            for (int k = 0; k < 4; k++) r[k] = xc + (size_t)(4 * g + k) * HW;
            qgemm_interleave_u8x4(tmp, 0, r, 0, 1, (int)HW);
        } else {
            const float *r[4];
            for (int k = 0; k < 4; k++) r[k] = x + (size_t)(4 * g + k) * HW;
            ok &= qgemm_quantize_u8x4(tmp, 0, r, 0, 1, (int)HW, &j->ac);
        }
        /* an unpadded 1x1 conv (ResNet's strided shortcut) reads phase (0, 0) alone: the even rows' even columns */
        const bool even_only = pad == 0 && j->c.KH == 1 && j->c.KW == 1;
        for (int h = 0; h < H; h += even_only ? 2 : 1) {
            const int rr = h + pad; /* the padded row */
            uint32_t *row = p + (size_t)(2 * (rr & 1)) * PS + (size_t)(rr >> 1) * j->Wq; /* phase (rr % 2, 0) */
            if (even_only) {
                take_even(row, src + (size_t)h * W, W);
                continue;
            }
            /* column w is padded column w + pad: the even w go to phase b = pad % 2 from pad / 2 on, the odd ones
             * to the other from (pad + 1) / 2 on */
            uint32_t *a = row + (size_t)(pad & 1) * PS + (pad >> 1);
            uint32_t *b = row + (size_t)(~pad & 1) * PS + ((pad + 1) >> 1);
            split_parity(a, b, src + (size_t)h * W, W);
        }
    }
    return ok;
}

/* kw4: planes (C, plane), dword q = padded pixels q..q+3 of one channel; bytes: scratch of plane + 4. False for
 * a value of x (C, H, W) that is not finite. */
static bool planes_kw4(uint32_t *pl, uint8_t *bytes, const float *x, const uint8_t *xc, const ConvJob *j) {
    const QGemmCodes *a = &j->ac;
    bool ok = true;
    for (int c = 0; c < j->c.C; c++) {
        memset(bytes, a->zero, j->plane + 4);
        for (int h = 0; h < j->H; h++) {
            uint8_t *row = bytes + (size_t)(h + j->pad) * j->Wp + j->pad;
            const size_t at = ((size_t)c * j->H + h) * j->W;
            if (xc) memcpy(row, xc + at, (size_t)j->W); /* codes handed over */
            else ok &= qgemm_quantize_u8(row, x + at, (size_t)j->W, a->s, a->lo, a->hi, a->zero);
        }
        uint32_t *p = pl + (size_t)c * j->plane;
        for (size_t q = 0; q < j->plane; q++) memcpy(p + q, bytes + q, 4); /* the kernels read the bytes in order */
    }
    return ok;
}

/* cols: the image's codes padded by pad on every side with the zero point, (C, H + 2 pad, W + 2 pad), then a row
 * of zero points that a k past K reads (cols_zero_at). x (C, H, W) is quantized in one call into codes (the
 * quantizer's start-up per call cost more than the copy when it ran row by row), then copied row by row. False for
 * a value that is not finite. */
static size_t cols_zero_at(const ConvJob *j) {
    return (size_t)j->c.C * (j->H + 2 * j->pad) * (j->W + 2 * j->pad);
}

static size_t cols_padded_bytes(const ConvJob *j) { /* with the slack qgemm_gather_u8x4 may read */
    return cols_zero_at(j) + (size_t)j->OW * j->stride + 1 + QGEMM_GATHER_SLACK;
}

static bool cols_pad(uint8_t *padded, uint8_t *codes, const float *x, const uint8_t *xc, const ConvJob *j) {
    const QGemmCodes *a = &j->ac;
    const int PW = j->W + 2 * j->pad;
    const bool ok = xc || qgemm_quantize_u8(codes, x, (size_t)j->c.C * j->H * j->W, a->s, a->lo, a->hi, a->zero);
    if (xc) codes = (uint8_t *)(uintptr_t)xc; /* codes handed over: only read */
    memset(padded, a->zero, cols_padded_bytes(j));
    for (int c = 0; c < j->c.C; c++)
        for (int h = 0; h < j->H; h++)
            memcpy(padded + ((size_t)c * (j->H + 2 * j->pad) + h + j->pad) * PW + j->pad,
                   codes + ((size_t)c * j->H + h) * j->W, (size_t)j->W);
    return ok;
}

/* cols: planes (ceil(K/4), plane), dword q = the 4 k of output pixel q (k = (c, kh, kw)), from the padded codes:
 * every read lands inside them, so the loop over pixels has no tests (a k past K reads the zero row). */
static void planes_cols(uint32_t *pl, const uint8_t *padded, const ConvJob *j) {
    const int KH = j->c.KH, KW = j->c.KW, K = j->c.C * KH * KW, P = j->OH * j->OW, S = j->stride;
    const size_t PW = (size_t)j->W + 2 * (size_t)j->pad, img = (size_t)(j->H + 2 * j->pad) * PW;
    const uint32_t fill = (uint32_t)j->ac.zero * 0x01010101u;
    for (int g = 0; g < j->c.groups; g++) {
        uint32_t *p = pl + (size_t)g * j->plane;
        const uint8_t *src[4];
        size_t step[4]; /* bytes from one output row's sources to the next's */
        for (int b = 0; b < 4; b++) {
            const int k = 4 * g + b, c = k / (KH * KW), kh = k / KW % KH, kw = k % KW;
            src[b] = k < K ? padded + (size_t)c * img + (size_t)kh * PW + (size_t)kw : padded + cols_zero_at(j);
            step[b] = k < K ? (size_t)S * PW : 0;
        }
        qgemm_gather_u8x4(p, src, step, j->OH, j->OW, S);
        for (size_t q = (size_t)P; q < j->plane; q++) p[q] = fill;
    }
}

/* out (n) += res, nn_add's sum (commutative, so the same bits whichever input the add names first), then nn_relu's
 * y > 0 ? y : 0 if relu; for one image while its output is in cache. */
NN_SIMD_CLONES
static void add_residual(float *out, const float *res, size_t n, bool relu) {
    if (relu)
        for (size_t i = 0; i < n; i++) {
            const float v = out[i] + res[i];
            out[i] = v > 0.0f ? v : 0.0f;
        }
    else
        for (size_t i = 0; i < n; i++) out[i] += res[i];
}

static void conv_task(void *ctx, int n, int n_tasks) {
    (void)n_tasks;
    ConvJob *j = ctx;
    const size_t in_img = (size_t)j->c.C * j->H * j->W;
    const float *x = j->x ? j->x + (size_t)n * in_img : NULL; /* (C, H, W), or its codes: */
    const uint8_t *xc = !j->xc ? NULL : j->xc + n * (j->xc_plane ? (size_t)j->c.groups * j->xc_plane * 4 : in_img);
    uint8_t *codes = j->work + (size_t)parallel_thread_index() * j->scratch; /* cols: the padded codes */
    uint32_t *planes = (uint32_t *)(codes + j->planes_at);                   /* (groups, plane) */
    uint8_t *bytes = (uint8_t *)(planes + (size_t)j->c.groups * j->plane);   /* kw4: [plane + 4]; cols: (C, H, W);
                                                                              * ch4 from codes: a row of zero points */
    float *pool = (float *)(codes + j->pool_at);                             /* pooling: [8][16 n_vec] */
    bool ok = true;
    if (j->c.mode == CONV_CH4 && xc && j->xc_plane == j->plane && j->Wp == j->W) {
        planes = (uint32_t *)(uintptr_t)xc; /* the producer made them: only read */
    } else if (j->c.mode == CONV_CH4 && xc && j->xc_plane) {
        if (!j->wino) planes_ch4_quads(planes, (const uint32_t *)(const void *)xc, j); /* F(2x2, 3x3) reads them */
    } else if (j->c.mode == CONV_CH4 && xc) {
        memset(bytes, j->ac.zero, (size_t)j->H * j->W + 16);
        planes_ch4_codes(planes, xc, bytes, j);
    } else if (j->c.mode == CONV_CH4) {
        ok = planes_ch4(planes, x, j);
    } else if (j->c.mode == CONV_KW4) {
        ok = planes_kw4(planes, bytes, x, xc, j);
    } else if (j->c.mode == CONV_PH4) {
        ok = planes_ph4(planes, (uint32_t *)(void *)bytes, x, xc, j);
    } else {
        ok = cols_pad(codes, bytes, x, xc, j);
        planes_cols(planes, codes, j);
    }
    QGemmTaps g = j->g;
    g.act = (const uint8_t *)planes;
    g.out = (j->hand && !j->keep) || j->means ? (float *)(codes + j->out_at) : g.out + (size_t)n * j->out_img;
    g.pool_buf = pool;
    g.act_wide = (int16_t *)(void *)(codes + j->wide_at);
    const size_t P = j->out_img / (size_t)j->OC;
    const VarCodes *h = j->hand;
    uint8_t *yc = h ? j->yc + n * qlayer_int8_handoff_image_bytes(h, j->OC, P) : NULL;
    /* handing off, the kernel writes the reader's codes itself where its family can */
    const QGemmCodesOut co = h ? qlayer_int8_codes_out(h, yc) : (QGemmCodesOut){0};
    const bool direct = qgemm_taps_codes_direct(&g); /* the kernel sums the residual and makes the codes itself */
    if (direct) {
        g.codes = h ? &co : NULL, g.floats_too = j->keep;
        g.res = j->res ? j->res + (size_t)n * j->out_img : NULL, g.res_relu = j->res_relu;
    }
    bool out_ok = true;
    if (j->wino) { /* the same sums, so the same floats, from the padded planes or the producer's quads (the AVX2
                    * family: never direct) */
        const bool quads = xc && j->xc_plane; /* the producer's codes where they lie, unpadded */
        const QWinoCh4 a = {.planes = quads ? (const uint32_t *)(const void *)xc : planes,
                            .plane = quads ? j->xc_plane : j->plane, .Wp = quads ? j->W : j->Wp,
                            .zero = j->ac.zero, .origin = quads};
        const QWinoFloats f = {.out = g.out, .ldo = g.ldo, .scale = g.scale, .bias = g.bias,
                               .relu = g.epi != QGEMM_EPI_NONE, .pool = g.epi == QGEMM_EPI_RELU_POOL2};
        qwino_floats(j->wino, &f, &a, j->wino_w, j->OC, codes + j->wino_at);
    } else {
        out_ok = qgemm_taps(&g, 0, g.w->row_blocks, 0, g.n_vec);
    }
    if (!direct && j->res) add_residual(g.out, j->res + (size_t)n * j->out_img, j->out_img, j->res_relu);
    if (h && direct) qlayer_int8_handoff_tails(h, yc, j->OC, P);
    else if (h) out_ok = qlayer_int8_handoff_image(h, yc, g.out, j->OC, P);
    if (j->means) nn_plane_means(j->means + (size_t)n * j->OC, g.out, (size_t)j->OC, P);
    j->bad[n] = (uint8_t)((ok ? 0 : 1) | (out_ok ? 0 : 2));
}

/* The integer F(2x2, 3x3) where it takes the conv (qwino_u8_fits: the AVX2 family; ch4 planes), its weight's
 * transform packed on first use (the forward runs on the calling thread). False: out of memory. */
static bool conv_wino_setup(Tape *t, QLayer *q, ConvJob *j) {
    const ConvShape *c = &j->c;
    j->wino = NULL;
    if (c->mode != CONV_CH4 || j->stride != 1 || j->OH != j->H || j->OW != j->W ||
        !qwino_u8_fits(c->C, j->OC, c->KH, c->KW, j->stride, j->pad))
        return true;
    QWino *p = tape_alloc(t, sizeof *p);
    if (!p) return false;
    qwino_plan(p, c->C, j->H, j->W);
    if (!q->int8->wino_w) {
        int32_t *w = malloc(qwino_packed_words(p, j->OC) * sizeof *w);
        if (!w) {
            qt_error_set(&t->err, QT_ERR_NOMEM, "%s: out of memory packing the weight's transform for int8",
                         q->module->path);
            return false;
        }
        qwino_pack(p, w, (const int8_t *)q->weight.codes, j->OC);
        q->int8->wino_w = w;
    }
    j->wino = p, j->wino_w = q->int8->wino_w;
    return true;
}

/* Tap offsets, the output lanes of each vector and the scratch size. */
static bool conv_plan(Tape *t, ConvJob *j) {
    const ConvShape *c = &j->c;
    const bool cols = c->mode == CONV_COLS, ph = c->mode == CONV_PH4;
    j->Hp = j->H + 2 * j->pad, j->Wp = j->W + 2 * j->pad;
    /* pooled rows of up to 3 whole vectors pool in registers (qgemm.h): a few columns more of padding for that */
    const int wide = (j->Wp + QGEMM_LANES - 1) / QGEMM_LANES * QGEMM_LANES;
    if (j->g.epi == QGEMM_EPI_RELU_POOL2 && wide <= 3 * QGEMM_LANES && !ph) j->Wp = wide;
    j->Wq = (j->Wp + 1) / 2, j->phase = (size_t)(j->Hp + 1) / 2 * j->Wq;
    j->pitch = cols ? j->OW : ph ? j->Wq : j->Wp;
    const int nq = j->OH * j->pitch, n_vec = (nq + QGEMM_LANES - 1) / QGEMM_LANES;
    /* the last vector reads 15 lanes past the last pixel, shifted by at most (KH-1) rows and KW+3 columns; ph4's,
     * of the last phase, 15 past its row OH - 1 + (KH - 1) / 2 <= (Hp + 1) / 2, shifted (KW - 1) / 2 */
    if (cols) j->plane = (size_t)n_vec * QGEMM_LANES; /* n_vec vectors: whole */
    else if (ph) j->plane = (4 * j->phase + (size_t)j->Wq + (size_t)c->KW / 2 + 16 + 15) / 16 * 16;
    else j->plane = qlayer_int8_ch4_plane(j->Hp, j->Wp, c->KW);
    j->planes_at = cols ? (cols_padded_bytes(j) + 63) / 64 * 64 : 0;
    size_t bytes = cols ? (size_t)c->C * j->H * j->W : ph ? 4 * (size_t)j->H * j->W + 64 : j->plane + 4;
    if (j->xc && c->mode == CONV_CH4 && bytes < (size_t)j->H * j->W + 16) bytes = (size_t)j->H * j->W + 16;
    j->pool_at = (j->planes_at + (size_t)c->groups * j->plane * 4 + bytes + 63) / 64 * 64;
    j->out_at = j->pool_at + (j->g.epi == QGEMM_EPI_RELU_POOL2 ? (size_t)QGEMM_ROWS * n_vec * QGEMM_LANES * 4 : 0);
    j->wide_at = j->out_at + ((j->hand && !j->keep) || j->means ? (j->out_img * sizeof(float) + 63) / 64 * 64 : 0);
    int32_t *off = tape_alloc(t, (size_t)c->taps * sizeof *off);
    uint16_t *mask = tape_alloc(t, (size_t)n_vec * sizeof *mask);
    int32_t *pos = tape_alloc(t, (size_t)n_vec * sizeof *pos);
    j->bad = tape_alloc(t, (size_t)j->N);
    if (!off || !mask || !pos || !j->bad) return false;
    for (int tp = 0; tp < c->taps; tp++) {
        int g, kh, kw;
        qlayer_int8_tap_at(c, tp, &g, &kh, &kw);
        if (ph) /* phase (kh % 2, kw % 2), shifted by (kh / 2, kw / 2) */
            off[tp] = (int32_t)((size_t)g * j->plane + (size_t)(2 * (kh & 1) + (kw & 1)) * j->phase +
                                (size_t)(kh >> 1) * j->Wq + (size_t)(kw >> 1));
        else off[tp] = (int32_t)((size_t)g * j->plane + (size_t)kh * j->Wp + (size_t)kw);
    }
    for (int v = 0; v < n_vec; v++) {
        mask[v] = 0, pos[v] = 0;
        for (int l = QGEMM_LANES - 1; l >= 0; l--) { /* downwards: pos ends at the first output lane */
            const int q = v * QGEMM_LANES + l;
            if (q >= nq || q % j->pitch >= j->OW) continue;
            mask[v] |= (uint16_t)(1u << l);
            pos[v] = q / j->pitch * j->OW + q % j->pitch;
        }
    }
    j->g.tap_off = off, j->g.vec_mask = mask, j->g.vec_pos = pos, j->g.n_vec = n_vec; /* g.w is set */
    j->scratch = j->wide_at + (qgemm_taps_act_wide_bytes(&j->g) + 63) / 64 * 64;
    j->wino_at = j->scratch;
    if (j->wino) j->scratch += (qwino_scratch_bytes(j->wino) + 63) / 64 * 64;
    j->work = tape_alloc(t, (size_t)parallel_get_threads() * j->scratch);
    return j->work != NULL;
}

Var *qlayer_int8_conv_fused(Tape *t, QLayer *q, Var *x, Var *bias, int OH, int OW, ConvEpilogue epi, const Var *res,
                            const VarCodes *hand, bool means) {
    const int threads = qlayer_int8_threads_for((double)x->value.shape[0] * OH * OW * q->out * q->fan_in);
    ConvJob j = {.N = x->value.shape[0], .H = x->value.shape[2], .W = x->value.shape[3], .OC = q->out, .OH = OH,
                 .OW = OW, .stride = q->module->spec.stride, .pad = q->module->spec.padding, .hand = hand};
    if (!qlayer_int8_ensure_packed(t, q) || !qlayer_int8_act_codes(t, q, &j.ac)) return NULL;
    j.c = qlayer_int8_conv_shape(q);
    if (x->codes && !(j.xc = qlayer_int8_input_codes(t, q, x, &j.ac, qlayer_int8_conv_quads(&j.c)))) return NULL;
    if (!x->codes) j.x = x->value.data;
    j.xc_plane = x->codes ? x->codes->plane : 0;
    const bool pool = epi == CONV_EPI_RELU_MAXPOOL2;
    const int YH = pool ? OH / 2 : OH, YW = pool ? OW / 2 : OW;
    j.g.epi = pool ? QGEMM_EPI_RELU_POOL2 : epi == CONV_EPI_RELU ? QGEMM_EPI_RELU : QGEMM_EPI_NONE;
    if (res && pool) {
        qt_error_set(&t->err, QT_ERR_ARG, "%s: a residual sum before a max pool is not an int8 epilogue",
                     q->module->path);
        return NULL;
    }
    if (res) j.res = res->value.data, j.res_relu = epi == CONV_EPI_RELU, j.g.epi = QGEMM_EPI_NONE; /* relu after it */
    const int shape[4] = {j.N, q->out, YH, YW};
    if ((size_t)j.N * q->out * YH * YW < 16) j.hand = hand = NULL; /* the readers' vector loads need the slack */
    j.keep = hand && t->handoff_keep;
    Var *y = j.keep ? qlayer_int8_handoff_var_keep(t, 4, shape, hand)
             : hand ? qlayer_int8_handoff_var(t, 4, shape, hand)
                    : tape_new_var(t, 4, shape);
    if (y && hand) j.hand = y->codes; /* the arena's copy: the tasks may run after the caller's hand is gone */
    float *scale = qlayer_int8_out_scales(t, q, j.ac.s);
    j.out_img = (size_t)q->out * YH * YW;
    if (y && !hand && means && !(y->means = j.means = tape_alloc(t, (size_t)j.N * q->out * sizeof *j.means)))
        return NULL;
    j.g.w = &q->int8->taps;
    if (!y || !scale || !conv_wino_setup(t, q, &j) || !conv_plan(t, &j)) return NULL;
    j.g.a_zero = j.ac.zero, j.g.out = y->value.data, j.g.ldo = (size_t)YH * YW;
    j.g.scale = scale, j.g.bias = bias ? bias->value.data : NULL;
    j.g.pitch = j.pitch, j.g.pool_h = YH, j.g.pool_w = YW;
    j.yc = hand ? (uint8_t *)(uintptr_t)y->codes->data : NULL; /* the Var's value, or with keep a buffer of its own */
    ConvJob *jp = tape_alloc(t, sizeof *jp); /* the tasks may run later, in the chain (qlayer_int8_launch) */
    if (!jp) return NULL;
    *jp = j;
    const QLayerInt8Job job = {.fn = conv_task, .ctx = jp, .n = j.N, .threads = threads, .q = q, .x = x, .bad = j.bad};
    /* into the chain where its readers are int8 convs (codes, with a merge's floats) or merges alone;
     * the pool's means are read by an op that runs the chain first too, but it ends a chain anyway */
    const bool defer = (j.hand && t->n_handoff >= 1) || (!hand && !means && t->handoff_merges);
    return qlayer_int8_launch(t, &job, defer) ? y : NULL;
}

Var *qlayer_int8_conv(Tape *t, QLayer *q, Var *x, Var *bias, int OH, int OW) {
    return qlayer_int8_conv_fused(t, q, x, bias, OH, OW, CONV_EPI_NONE, NULL, NULL, false);
}
