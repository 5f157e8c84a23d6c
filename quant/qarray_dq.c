/* qarray_dq.c - scale types (float16, bfloat16 bits) and double
 * quantization of block scales (bitsandbytes' compress_statistics). */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "qarray.h"

/* ---- float16 / bfloat16 ---------------------------------------------------- */

static uint32_t f32_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static float bits_f32(uint32_t u) {
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. The magnitude
 * is rounded on the binary16 grid of its binade (the subnormal range has the
 * spacing 2^-24 of the smallest binade) with rintf, which rounds ties to
 * even; the scaling by powers of two is exact. */
uint16_t qarray_f32_to_f16(float v) {
    uint16_t sign = signbit(v) ? 0x8000u : 0;
    float a = fabsf(v);
    if (isnan(v)) return 0x7e00u;
    if (a >= 65520.0f) return sign | 0x7c00u; /* 65520 = 65504 + half a step: ties go to inf's even code */
    int e;
    frexpf(a, &e);                     /* a = f * 2^e, f in [0.5, 1) */
    int ex = e - 1 < -14 ? -14 : e - 1; /* binade exponent, subnormals share -14 */
    float m = rintf(ldexpf(a, 10 - ex)); /* significand in units of 2^(ex - 10) */
    if (m >= 2048.0f) m *= 0.5f, ex++; /* rounded up into the next binade */
    uint32_t mi = (uint32_t)m;
    if (mi < 1024u) return sign | (uint16_t)mi; /* subnormal (or zero) */
    return sign | (uint16_t)(((uint32_t)(ex + 15) << 10) | (mi - 1024u));
}

float qarray_f16_to_f32(uint16_t h) {
    float sign = h & 0x8000u ? -1.0f : 1.0f;
    int ef = (h >> 10) & 0x1f, mf = h & 0x3ff;
    if (ef == 0x1f) return mf ? NAN : sign * INFINITY;
    if (ef == 0) return sign * ldexpf((float)mf, -24);
    return sign * ldexpf((float)(1024 + mf), ef - 25);
}

uint16_t qarray_f32_to_bf16(float v) {
    uint32_t u = f32_bits(v);
    if (isnan(v)) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* ties to even; a carry moves into the exponent (up to inf) */
    return (uint16_t)(u >> 16);
}

float qarray_bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

/* ---- the dynamic map ---------------------------------------------------------- */

static float dyn_map[256];
static pthread_once_t dyn_once = PTHREAD_ONCE_INIT;

/* Signed, 7 exponent steps: for k = 0..6, 2^k values at 10^(k-6) times the
 * midpoints of 2^k equal parts of [0.1, 1]; their negatives; 0 and 1. */
static void dyn_build(void) {
    float v[256];
    int n = 0;
    for (int k = 0; k <= 6; k++) {
        int parts = 1 << k;
        for (int j = 0; j < parts; j++) {
            double mid = 0.1 + (j + 0.5) * 0.9 / parts;
            float p = (float)(pow(10.0, k - 6) * mid);
            v[n++] = p;
            v[n++] = -p;
        }
    }
    v[n++] = 0.0f;
    v[n++] = 1.0f;
    /* insertion sort: 256 values once */
    for (int i = 1; i < n; i++) {
        float t = v[i];
        int j = i - 1;
        for (; j >= 0 && v[j] > t; j--) v[j + 1] = v[j];
        v[j + 1] = t;
    }
    memcpy(dyn_map, v, sizeof dyn_map);
}

const float *qarray_dq_map(void) {
    pthread_once(&dyn_once, dyn_build);
    return dyn_map;
}

/* The map as a LUT format, so qtype_encode finds the nearest entry (ties to
 * the lower code). */
static QType dyn_qtype(void) {
    return (QType){.name = "dq_dynamic8", .kind = QTYPE_KIND_LUT, .bits = 8, .bits_per_elem = 8, .max = 1.0f,
                   .lut = qarray_dq_map()};
}

/* ---- double quantization ----------------------------------------------------- */

void qarray_dq_free(QArrayDq *dq) {
    if (!dq) return;
    free(dq->codes);
    free(dq->absmax);
    memset(dq, 0, sizeof *dq);
}

float qarray_dq_scale(const QArrayDq *dq, size_t i) {
    const float *map = qarray_dq_map();
    double a = dq->absmax[i / (size_t)dq->block];
    return (float)((double)map[dq->codes[i]] * a + (double)dq->offset);
}

QtStatus qarray_dq_compress(QArrayDq *dq, const float *scales, size_t n, int block, float *rebuilt, QtError *err) {
    memset(dq, 0, sizeof *dq);
    if (block < 1) return qt_error_set(err, QT_ERR_ARG, "double quantization: block %d must be >= 1", block);
    size_t nb = (n + (size_t)block - 1) / (size_t)block;
    dq->block = block;
    dq->n_blocks = nb;
    dq->codes = malloc(n ? n : 1);
    dq->absmax = malloc((nb ? nb : 1) * sizeof *dq->absmax);
    if (!dq->codes || !dq->absmax) {
        qarray_dq_free(dq);
        return qt_error_set(err, QT_ERR_NOMEM, "double quantization: out of memory for %zu scales", n);
    }
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += scales[i];
    dq->offset = n ? (float)(sum / (double)n) : 0.0f;
    QType map = dyn_qtype();
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * (size_t)block, hi = lo + (size_t)block < n ? lo + (size_t)block : n;
        float a = 0.0f;
        for (size_t i = lo; i < hi; i++) a = fmaxf(a, fabsf(scales[i] - dq->offset));
        if (!(a >= QARRAY_SCALE_MIN)) a = 1.0f; /* every scale equals the offset: code of 0, exact */
        dq->absmax[b] = a;
        for (size_t i = lo; i < hi; i++) {
            dq->codes[i] = (uint8_t)qtype_encode(&map, (scales[i] - dq->offset) / a, QROUND_RNE, 0.0f);
            rebuilt[i] = qarray_dq_scale(dq, i);
        }
    }
    return QT_OK;
}
