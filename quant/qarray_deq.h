/* qarray_deq.h - the element kernels behind qarray_dequantize_rows.
 * Internal to quant/ (and its tests).
 *
 * A span is n_groups runs of glen consecutive codes of a packed stream
 * (qtype_pack's layout), run k with its own scale and zero point:
 *   y[k * glen + j] = (lut[code(first + k * glen + j)] - zp[k]) * scale[k]
 * lut maps every code of the format to its value (qtype_decode), so one
 * kernel serves every element format of 1 to 8 bits. Dequantization is
 * exact: the subtraction and the product are single IEEE operations, never
 * fused, so every kernel gives the same bits as qarray_deq_ref (NaN
 * included). The fast kernels take the common cases (4- and 8-bit codes,
 * runs starting on a byte) and leave the rest to the reference loop.
 *
 * Kernels: _ref decodes code by code; _portable reads whole bytes in plain
 * C; _avx2 and _avx512 (qarray_deq_x86.c) are built with target attributes
 * and may only be called when qarray_deq_cpu() reports them. qarray_deq_run picks the best one the CPU has, capped by
 * qarray_deq_max_level (tests and benchmarks lower it). */
#ifndef QTRAIN_QUANT_QARRAY_DEQ_H
#define QTRAIN_QUANT_QARRAY_DEQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    QDEQ_CODES_TABLE = 0, /* only lut gives the values */
    QDEQ_CODES_U8,        /* lut[c] == (float)c for every 8-bit c: the vectors convert instead of looking up */
    QDEQ_CODES_S8         /* lut[c] == (float)(int8_t)c */
} QDeqCodes;

typedef struct {
    const uint8_t *codes;  /* the packed stream */
    size_t first;          /* element index of the first code */
    size_t n_groups, glen; /* n_groups runs of glen codes each */
    int bits;              /* 1..8 */
    const float *lut;      /* [1 << bits] the value of each code */
    const float *scale;    /* [n_groups] */
    const float *zp;       /* [n_groups] in code units, or NULL: all zero (symmetric) */
    QDeqCodes codes_are;   /* 8-bit codes: whether lut[c] is c itself, as an unsigned or signed byte */
} QDeqSpan;

typedef enum { QDEQ_REF = 0, QDEQ_PORTABLE, QDEQ_AVX2, QDEQ_AVX512, QDEQ_LEVEL_COUNT } QDeqLevel;

/* The most capable kernel qarray_deq_run may use; QDEQ_AVX512 (no cap) by default. */
extern QDeqLevel qarray_deq_max_level;

/* The best level this CPU supports (QDEQ_PORTABLE off x86). */
QDeqLevel qarray_deq_cpu(void);
/* The level qarray_deq_run uses: the CPU's, capped by qarray_deq_max_level. */
QDeqLevel qarray_deq_level(void);
const char *qarray_deq_level_name(QDeqLevel level);

/* y [n_groups * glen] from the span. */
void qarray_deq_ref(const QDeqSpan *sp, float *y);
void qarray_deq_portable(const QDeqSpan *sp, float *y);
void qarray_deq_avx2(const QDeqSpan *sp, float *y);
void qarray_deq_avx512(const QDeqSpan *sp, float *y);
/* The kernel of qarray_deq_level(). */
void qarray_deq_run(const QDeqSpan *sp, float *y);

/* What the 256-entry table lut of an 8-bit format holds (checked value by value). */
QDeqCodes qarray_deq_codes_of(const float *lut);

/* One run of n codes from element e on, byte by byte where the codes
 * allow it (the portable kernel's loop): the x86 kernels finish their runs
 * with it. sub: subtract zp; without it zp must be 0. */
void qarray_deq_run_tail(const uint8_t *codes, size_t e, size_t n, int bits, const float *lut, float s, float zp,
                         bool sub, float *y);

#endif
