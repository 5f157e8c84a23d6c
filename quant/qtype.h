/* qtype.h - quantized number formats: one table entry per format, element
 * encode/decode, rounding modes, bit packing and the block formats.
 *
 * A code is the stored bit pattern of one element, right-aligned in a
 * uint32_t. qtype_encode takes a value that has already been divided by its
 * scale (for the integer kinds a value in code units, for the float kinds
 * the element value itself) and returns the code; qtype_decode inverts it.
 * Block formats (MX, mx6/mx9) carry their own shared scale and are handled a
 * block at a time by qtype_block_quantize / qtype_block_dequantize.
 *
 * Float element conventions (every float kind):
 *   - sign bit, then E exponent bits, then M mantissa bits (MSB first);
 *   - exponent field 0 is subnormal: value = m * 2^(1 - bias - M);
 *   - otherwise value = (2^M + m) * 2^(e - bias - M);
 *   - fp8_e4m3 is OCP E4M3FN: no inf, S.1111.111 is NaN, max 448;
 *   - fp8_e5m2 is IEEE-like: exponent field 31 holds inf (m = 0) and NaN;
 *   - every other float, including the generic "eXmY" ones, has no inf or
 *     NaN: all codes are finite, bias = 2^(E-1) - 1 and
 *     max = (2 - 2^-M) * 2^(2^E - 1 - bias). That is ModelOpt's (E, M)
 *     fake-quant convention: its FP8 (E=4, M=3) is E4M3FN at 448 (hence the
 *     named entry), and its tables for the other (E, M) pairs (E3M2 28,
 *     E2M3 7.5, E2M1 6, E1M2 3.5, E3M0 16) are exactly this formula. */
#ifndef QTRAIN_QUANT_QTYPE_H
#define QTRAIN_QUANT_QTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

typedef enum {
    QTYPE_KIND_INT,       /* signed two's complement, code units */
    QTYPE_KIND_UINT,      /* unsigned, code units */
    QTYPE_KIND_TERNARY,   /* -1/0/+1 as 2-bit two's complement; code 0b10 is never produced */
    QTYPE_KIND_BINARY,    /* code 0 = -1, code 1 = +1 */
    QTYPE_KIND_LUT,       /* code indexes an ascending table of values (nf4) */
    QTYPE_KIND_FLOAT,     /* sign/exponent/mantissa minifloat */
    QTYPE_KIND_MX,        /* OCP MX v1.0: `block` elements of `elem` sharing an e8m0 scale */
    QTYPE_KIND_MX_SHARED  /* mx6/mx9: shared exponent + per-sub-block micro-exponents */
} QTypeKind;

/* Rounding modes of every quantizer in quant/. u is supplied by the caller
 * (from the counter-based RNG) so results are reproducible. */
typedef enum {
    QROUND_RNE = 0,    /* nearest, ties to the even code (nf4: ties to the lower code) */
    QROUND_HALF_AWAY,  /* nearest, ties away from zero */
    QROUND_FLOOR,      /* toward -inf on the format's grid */
    QROUND_STOCHASTIC, /* floor(v + u) on the grid, u in [0, 1): up with probability (v - lo) / (hi - lo) */
    QROUND_COUNT
} QRound;

typedef struct QType QType;

struct QType {
    const char *name;      /* as configs spell it */
    QTypeKind kind;
    int bits;              /* bits of one element code (block kinds: of one element) */
    double bits_per_elem;  /* storage per element, shared scales included */
    float max;             /* largest finite element value (int kinds: qmax; block kinds: the element's) */
    /* INT, UINT, TERNARY, BINARY: the value range in code units */
    int qmin, qmax;
    /* FLOAT */
    int exp_bits, man_bits, bias;
    bool has_inf, has_nan; /* inf: IEEE-style exponent field all ones; nan without inf: only S.1..1 */
    /* LUT: [1 << bits] values, ascending, indexed by code */
    const float *lut;
    /* MX, MX_SHARED */
    int block;             /* elements per block */
    int scale_bits;        /* bits of the shared exponent (e8m0: 8) */
    size_t block_bytes;    /* packed bytes of one block, scale included */
    const QType *elem;     /* MX: the element format. MX_SHARED: the element's integer
                              range (stored sign-magnitude, see qtype_block_quantize) */
    int elem_emax;         /* MX: floor(log2(largest element value)), OCP's emax_elem */
    int elem_scale_log2;   /* MX: element value = decode(code) * 2^elem_scale_log2 (mxint8: -6) */
    int sub_block;         /* MX_SHARED: elements per micro-exponent */
    int micro_bits;        /* MX_SHARED: bits of one micro-exponent */
    int mant_bits;         /* MX_SHARED: magnitude bits of an element (the sign is extra) */
};

/* Packed block layouts. Byte 0 is the shared scale; element codes follow,
 * bit-packed as qtype_pack does (MSB first, element 0 first).
 * e8m0 scale code s: 2^(s - 127); s = 255 is NaN (the whole block is NaN). */
typedef struct {
    uint8_t scale;     /* e8m0 */
    uint8_t elems[32]; /* 32 x 8-bit codes */
} QMxBlock8;           /* mxfp8_e4m3, mxint8 */
typedef struct {
    uint8_t scale;
    uint8_t elems[24]; /* 32 x 6-bit codes */
} QMxBlock6;           /* mxfp6_e3m2 */
typedef struct {
    uint8_t scale;
    uint8_t elems[16]; /* 32 x 4-bit codes, element 2k in the high nibble */
} QMxBlock4;           /* mxfp4 */
/* mx9 / mx6 (Rouhani et al. 2023): 16 elements, 8-bit shared exponent E
 * (bias 127, 255 = NaN), 8 sub-blocks of 2 with a 1-bit micro-exponent t_j
 * each (sub-block j in bit 7 - j of micro_exp), and per element a sign bit
 * above an m-bit magnitude M (m = 7 for mx9, 4 for mx6):
 * value = (-1)^s * M * 2^(E - 127 - t_j + 1 - m). */
typedef struct {
    uint8_t shared_exp;
    uint8_t micro_exp;
    uint8_t elems[16]; /* 16 x 8-bit sign-magnitude codes */
} QMx9Block;
typedef struct {
    uint8_t shared_exp;
    uint8_t micro_exp;
    uint8_t elems[10]; /* 16 x 5-bit sign-magnitude codes */
} QMx6Block;

_Static_assert(sizeof(QMxBlock8) == 33, "mxfp8/mxint8 block: 1 + 32 bytes");
_Static_assert(sizeof(QMxBlock6) == 25, "mxfp6 block: 1 + 32 * 6 / 8 bytes");
_Static_assert(sizeof(QMxBlock4) == 17, "mxfp4 block: 1 + 32 * 4 / 8 bytes");
_Static_assert(sizeof(QMx9Block) == 18, "mx9 block: 16 elements x 9 bits");
_Static_assert(sizeof(QMx6Block) == 12, "mx6 block: 16 elements x 6 bits");

/* ---- lookup -------------------------------------------------------------- */

/* The entry for `name`, case-insensitive: a table name, or a small float
 * "eXmY" / "fpN_eXmY" (1 <= X <= 7, Y >= 0, N = 1 + X + Y <= 8). An eXmY
 * that matches a named float (e4m3, e5m2, e3m2, e2m3, e2m1) returns that
 * entry; others come from an internal cache, so the pointer stays valid for
 * the life of the program and equal names give equal pointers. NULL with
 * QT_ERR_ARG and a message listing the valid names otherwise. */
const QType *qtype_find(const char *name, QtError *err);
/* t's name; "(none)" for NULL. */
const char *qtype_name(const QType *t);
/* The named table (generic eXmY entries are not listed): entries 0..count-1. */
int qtype_count(void);
const QType *qtype_at(int i);

const char *qround_name(QRound mode);
/* "rne", "half_away" (or "half-away"), "floor", "stochastic"; case-insensitive. */
QtStatus qround_parse(const char *name, QRound *out, QtError *err);

/* ---- elements -------------------------------------------------------------- */

/* Whether the format has a NaN code. Where there is none, encode treats NaN
 * as 0: callers reject NaN first when this is false. */
bool qtype_has_nan(const QType *t);
/* MX or MX_SHARED: codes only exist inside packed blocks. */
bool qtype_is_block(const QType *t);
/* A code encode can produce (fits in bits; not ternary's 0b10). */
bool qtype_code_valid(const QType *t, uint32_t code);
bool qtype_code_is_nan(const QType *t, uint32_t code);

/* v -> code. Saturates: values beyond the range clamp to the extreme code;
 * floats clamp to +-max before rounding (subnormals included), and an
 * infinity gives the inf code where the format has one (fp8_e5m2), +-max
 * otherwise. NaN gives the format's NaN code (e4m3 0x7F, e5m2 0x7E); where
 * there is none it is encoded as 0 would be. A negative float that rounds
 * to zero keeps its sign (code of -0). Binary: v == 0 is a tie and gives +1
 * under RNE and half-away. u is used by QROUND_STOCHASTIC only. Block kinds
 * return 0. */
uint32_t qtype_encode(const QType *t, float v, QRound mode, float u);
/* code -> value (code units for the integer kinds). Block kinds: NaN. */
float qtype_decode(const QType *t, uint32_t code);

/* ---- packing --------------------------------------------------------------- */

/* Codes are packed as one MSB-first bit stream: element i takes bits
 * [i*bits, (i+1)*bits) counted from the top bit of byte 0, its own top bit
 * first. So 4-bit element 2k is the high nibble of byte k, 2-bit element 4k
 * the top two bits, 1-bit element 8k bit 7; 3/5/6/7-bit codes straddle
 * bytes. Unused low bits of the last byte are zero. */
size_t qtype_packed_bytes(const QType *t, size_t n); /* block kinds: whole blocks, ceil(n / block) */
/* codes [n] -> out [qtype_packed_bytes]. Codes are masked to `bits`.
 * QT_ERR_ARG for block kinds (use the block functions) or NULL pointers. */
QtStatus qtype_pack(const QType *t, const uint32_t *codes, size_t n, uint8_t *out);
/* in [qtype_packed_bytes] -> codes [n]. */
QtStatus qtype_unpack(const QType *t, const uint8_t *in, size_t n, uint32_t *codes);

/* ---- blocks ---------------------------------------------------------------- */

/* One block: x [n] (1 <= n <= t->block; missing elements count as zeros)
 * -> out [t->block_bytes], the layout of the structs above. u [n] are the
 * stochastic-rounding uniforms in [0, 1), needed only for QROUND_STOCHASTIC.
 *
 * MX (OCP MX v1.0): X = floor(log2(amax)) - elem_emax clamped to [-127, 127],
 * scale code X + 127; elements are x / 2^(X + elem_scale_log2) encoded with
 * saturation (elem_scale_log2 is 0 but for mxint8's -6). A block
 * with a NaN or an infinity gets scale code 255 (NaN). An all-zero block gets
 * scale code 127 (2^0) and zero codes.
 * MX_SHARED: E = max floor(log2 |x|) over the block (clamped to
 * [-127, 127]; all-zero block: 127, NaN/inf: 255); per sub-block
 * t = min(E - max floor(log2 |x|) over the sub-block, 2^micro_bits - 1);
 * magnitudes x / 2^(E - t + 1 - m) rounded and clamped to 2^m - 1.
 * QT_ERR_ARG for a non-block kind, bad n, NULL pointers, or no u when stochastic. */
QtStatus qtype_block_quantize(const QType *t, const float *x, int n, uint8_t *out, QRound mode, const float *u);
/* in [t->block_bytes] -> y [n], 1 <= n <= t->block. */
QtStatus qtype_block_dequantize(const QType *t, const uint8_t *in, int n, float *y);

#endif
