/* qlayer_int8_internal.h - what the int8 forward's files share (qlayer_int8.c: eligibility, packing, the input's
 * codes, the hand-off, dense; qlayer_int8_conv.c: the plain conv2d; qlayer_int8_dw.c: the depthwise conv2d).
 * Internal to quant/. */
#ifndef QTRAIN_QUANT_QLAYER_INT8_INTERNAL_H
#define QTRAIN_QUANT_QLAYER_INT8_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/parallel.h"
#include "qgemm.h"
#include "qlayer_int8.h"

struct QLayerInt8 {
    QGemmPackedB dense;    /* dense: the weight (out, fan_in) */
    QGemmPackedTaps taps;  /* conv2d: the weight as (OC, taps) dwords, taps as conv_shape orders them */
    QGemmPackedDw dw;      /* depthwise conv2d (qlayer_int8_conv_is_dw): the weight (OC, 1, KH, KW) */
    float *w_scale;        /* [out] the weight's scale of each output channel */
    int32_t *wino_w;       /* conv2d through F(2x2, 3x3) (qwino.h): the weight's transform, packed on first use; or
                            * NULL */
};

/* How a plain conv2d's codes are laid out for the taps kernel (qlayer_int8.c's opening comment): ch4, 4 channels of
 * a padded pixel a dword; kw4, 4 pixels of a channel's padded row; cols, 4 im2col k; ph4, ch4 over the image's four
 * phases (stride 2). */
enum { CONV_CH4, CONV_KW4, CONV_COLS, CONV_PH4 };

typedef struct {
    int C, KH, KW;
    int mode, groups, taps; /* the layout; its plane groups; taps (dwords of k) per output */
    int kq;                 /* kw4: quads of kernel columns */
} ConvShape;

/* Whether a layout's planes are channel quads (ch4, ph4): the ones that take codes handed over by channel quads. */
static inline bool qlayer_int8_conv_quads(const ConvShape *c) { return c->mode == CONV_CH4 || c->mode == CONV_PH4; }

/* q's layout (plain conv2d). */
ConvShape qlayer_int8_conv_shape(const QLayer *q);
/* Tap t as (plane group, kh, first kernel column); cols: (group, 0, 0). */
void qlayer_int8_tap_at(const ConvShape *c, int t, int *g, int *kh, int *kw);
/* Dwords of a ch4 group plane over a padded image Hp x Wp for a KW-wide kernel: every tap of the last vector reads
 * inside it (15 lanes past the last pixel, shifted by up to KH - 1 rows and KW + 3 columns). */
size_t qlayer_int8_ch4_plane(int Hp, int Wp, int KW);

static inline void qlayer_int8_fill_dwords(uint32_t *p, size_t n, uint32_t v) {
    for (size_t i = 0; i < n; i++) p[i] = v;
}

/* Every output channel reads one input channel (w (OC, 1, KH, KW), no dilation): the depthwise kernel's. */
bool qlayer_int8_conv_is_dw(const QLayer *q);
/* q's static input range as the kernels' codes; false with the tape error set. */
bool qlayer_int8_act_codes(Tape *t, const QLayer *q, QGemmCodes *a);
/* Packs q's weight on first use; false with the tape error set. */
bool qlayer_int8_ensure_packed(Tape *t, QLayer *q);
/* s_x * s_w[o] for every output channel -> arena [out]. */
float *qlayer_int8_out_scales(Tape *t, const QLayer *q, float sx);
/* The threads a layer of this many multiply-adds uses, and n_tasks tasks on them (all in the caller for 1). */
int qlayer_int8_threads_for(double macs);
void qlayer_int8_run(int threads, int n_tasks, ParallelFn fn, void *ctx);
/* x's hand-off codes, checked to be q's own (quads: channel quads allowed); NULL with the tape error set. */
const uint8_t *qlayer_int8_input_codes(Tape *t, const QLayer *q, const Var *x, const QGemmCodes *a, bool quads);
/* A producer's output Var whose buffer takes the codes hand describes (Var.codes). */
Var *qlayer_int8_handoff_var(Tape *t, int ndim, const int *shape, const VarCodes *hand);
Var *qlayer_int8_handoff_var_keep(Tape *t, int ndim, const int *shape, const VarCodes *hand);
/* One image's output in scratch (C planes of P floats) to its codes at dst; false for a value not finite. */
bool qlayer_int8_handoff_image(const VarCodes *hand, uint8_t *dst, const float *y, int C, size_t P);
/* The bytes of one image's codes. */
size_t qlayer_int8_handoff_image_bytes(const VarCodes *hand, int C, size_t P);
/* The kernels' output as hand's codes at dst (QGemmCodesOut: the reader's quantizer and layout). */
QGemmCodesOut qlayer_int8_codes_out(const VarCodes *hand, uint8_t *dst);
/* The zero points past each channel quad's P codes of one image's codes at dst (hand->plane > 0; else nothing). */
void qlayer_int8_handoff_tails(const VarCodes *hand, uint8_t *dst, int C, size_t P);
/* After the tasks, bad[i] for image i: 1, an input value not finite; 2, an output value the reader's quantizer
 * cannot code; false with the error. */
bool qlayer_int8_checks_pass(Tape *t, const QLayer *q, const Var *x, const uint8_t *bad, int n);

/* A conv2d's forward as tasks, one an image: fn(ctx, image, n); ctx in the tape's arena (it may run later). */
typedef struct {
    ParallelFn fn;
    void *ctx;
    int n, threads;         /* images; threads as qlayer_int8_threads_for */
    const QLayer *q;
    const Var *x;           /* its input, for qlayer_int8_checks_pass */
    const uint8_t *bad;     /* [n] as the tasks leave it */
} QLayerInt8Job;

/* Runs j (with the jobs deferred before it, image by image: each image through every layer in one task) and checks
 * each in order; false with the first failing layer's error. defer (j's output goes to one int8 conv2d as its
 * codes): j waits for that reader instead, and true. */
bool qlayer_int8_launch(Tape *t, const QLayerInt8Job *j, bool defer);

#endif
