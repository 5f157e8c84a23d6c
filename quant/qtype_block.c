/* qtype_block.c - one block of an MX (OCP MX v1.0) or shared-microexponent
 * (mx6/mx9, Rouhani et al. 2023) format: shared scale, element codes and
 * the packed layout of qtype.h's block structs. */
#include <math.h>
#include <stddef.h>

#include "qtype.h"

#define BLOCK_MAX 32 /* the largest block of the table */
#define E8M0_NAN 255u
#define E8M0_ONE 127u /* 2^0: the scale code of an all-zero block */

/* The MX layouts differ only in the size of elems; mx6 and mx9 likewise. */
_Static_assert(offsetof(QMxBlock8, elems) == 1 && offsetof(QMxBlock6, elems) == 1 && offsetof(QMxBlock4, elems) == 1,
               "MX blocks: scale byte, then elements");
_Static_assert(offsetof(QMx9Block, micro_exp) == 1 && offsetof(QMx9Block, elems) == 2 &&
                   offsetof(QMx6Block, micro_exp) == 1 && offsetof(QMx6Block, elems) == 2,
               "mx9/mx6 blocks: shared exponent, micro-exponents, elements");

/* floor(log2(a)) for a finite a > 0, subnormals included. */
static int floor_log2(float a) {
    int e;
    frexpf(a, &e);
    return e - 1;
}

static int clamp_int(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Largest |x| over x[0..n); *bad if any x is NaN or infinite. */
static float block_amax(const float *x, int n, bool *bad) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        if (!isfinite(x[i])) *bad = true;
        else amax = fmaxf(amax, fabsf(x[i]));
    }
    return amax;
}

static QtStatus mx_quantize(const QType *t, const float *x, int n, uint8_t *out, QRound mode, const float *u) {
    uint32_t codes[BLOCK_MAX];
    uint32_t zero = qtype_encode(t->elem, 0.0f, QROUND_RNE, 0.0f);
    for (int i = 0; i < t->block; i++) codes[i] = zero;
    bool bad = false;
    float amax = block_amax(x, n, &bad);
    uint32_t scale = E8M0_ONE;
    if (bad) {
        scale = E8M0_NAN; /* element codes are meaningless under a NaN scale; keep them zero */
    } else if (amax > 0.0f) {
        int X = clamp_int(floor_log2(amax) - t->elem_emax, -127, 127);
        scale = (uint32_t)(X + 127);
        for (int i = 0; i < n; i++)
            codes[i] = qtype_encode(t->elem, ldexpf(x[i], -X - t->elem_scale_log2), mode, u ? u[i] : 0.0f);
    }
    out[offsetof(QMxBlock8, scale)] = (uint8_t)scale;
    return qtype_pack(t->elem, codes, (size_t)t->block, out + offsetof(QMxBlock8, elems));
}

static QtStatus mx_dequantize(const QType *t, const uint8_t *in, int n, float *y) {
    uint32_t codes[BLOCK_MAX];
    QtStatus st = qtype_unpack(t->elem, in + offsetof(QMxBlock8, elems), (size_t)n, codes);
    if (st != QT_OK) return st;
    uint32_t scale = in[offsetof(QMxBlock8, scale)];
    int X = (int)scale - 127 + t->elem_scale_log2;
    for (int i = 0; i < n; i++) y[i] = scale == E8M0_NAN ? NAN : ldexpf(qtype_decode(t->elem, codes[i]), X);
    return QT_OK;
}

/* Micro-exponents are packed like unsigned codes of micro_bits bits. */
static QType micro_qtype(const QType *t) {
    return (QType){.name = "micro-exponent", .kind = QTYPE_KIND_UINT, .bits = t->micro_bits, .qmin = 0,
                   .qmax = (1 << t->micro_bits) - 1};
}

static QtStatus mxs_quantize(const QType *t, const float *x, int n, uint8_t *out, QRound mode, const float *u) {
    uint32_t codes[BLOCK_MAX] = {0}, micro[BLOCK_MAX] = {0};
    int m = t->mant_bits, n_sub = t->block / t->sub_block, t_max = (1 << t->micro_bits) - 1;
    bool bad = false;
    float amax = block_amax(x, n, &bad);
    uint32_t shared = E8M0_ONE;
    if (bad) {
        shared = E8M0_NAN;
    } else if (amax > 0.0f) {
        int E = clamp_int(floor_log2(amax), -127, 127);
        shared = (uint32_t)(E + 127);
        for (int j = 0; j < n_sub; j++) {
            int lo = j * t->sub_block, hi = lo + t->sub_block < n ? lo + t->sub_block : n;
            float sub_amax = lo < n ? block_amax(x + lo, hi - lo, &bad) : 0.0f;
            /* An all-zero sub-block takes the finest step: its codes are 0 either way. */
            int shift = sub_amax > 0.0f ? clamp_int(E - floor_log2(sub_amax), 0, t_max) : t_max;
            micro[j] = (uint32_t)shift;
            for (int i = lo; i < hi; i++) {
                float v = ldexpf(x[i], -(E - shift + 1 - m));
                int q = (int)qtype_decode(t->elem, qtype_encode(t->elem, v, mode, u ? u[i] : 0.0f));
                codes[i] = q < 0 ? (1u << m) | (uint32_t)-q : (uint32_t)q; /* sign-magnitude */
            }
        }
    }
    QType mt = micro_qtype(t);
    out[offsetof(QMx9Block, shared_exp)] = (uint8_t)shared;
    QtStatus st = qtype_pack(&mt, micro, (size_t)n_sub, out + offsetof(QMx9Block, micro_exp));
    if (st != QT_OK) return st;
    return qtype_pack(t->elem, codes, (size_t)t->block, out + offsetof(QMx9Block, elems));
}

static QtStatus mxs_dequantize(const QType *t, const uint8_t *in, int n, float *y) {
    uint32_t codes[BLOCK_MAX], micro[BLOCK_MAX];
    int m = t->mant_bits, n_sub = t->block / t->sub_block;
    QType mt = micro_qtype(t);
    QtStatus st = qtype_unpack(&mt, in + offsetof(QMx9Block, micro_exp), (size_t)n_sub, micro);
    if (st == QT_OK) st = qtype_unpack(t->elem, in + offsetof(QMx9Block, elems), (size_t)n, codes);
    if (st != QT_OK) return st;
    uint32_t shared = in[offsetof(QMx9Block, shared_exp)];
    int E = (int)shared - 127;
    for (int i = 0; i < n; i++) {
        float mag = (float)(codes[i] & ((1u << m) - 1));
        float v = ldexpf(mag, E - (int)micro[i / t->sub_block] + 1 - m);
        y[i] = shared == E8M0_NAN ? NAN : codes[i] >> m ? -v : v;
    }
    return QT_OK;
}

QtStatus qtype_block_quantize(const QType *t, const float *x, int n, uint8_t *out, QRound mode, const float *u) {
    if (!qtype_is_block(t) || t->block > BLOCK_MAX || n < 1 || n > t->block || !x || !out) return QT_ERR_ARG;
    if (mode == QROUND_STOCHASTIC && !u) return QT_ERR_ARG;
    return t->kind == QTYPE_KIND_MX ? mx_quantize(t, x, n, out, mode, u) : mxs_quantize(t, x, n, out, mode, u);
}

QtStatus qtype_block_dequantize(const QType *t, const uint8_t *in, int n, float *y) {
    if (!qtype_is_block(t) || t->block > BLOCK_MAX || n < 1 || n > t->block || !in || !y) return QT_ERR_ARG;
    return t->kind == QTYPE_KIND_MX ? mx_dequantize(t, in, n, y) : mxs_dequantize(t, in, n, y);
}
