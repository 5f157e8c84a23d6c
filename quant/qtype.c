/* qtype.c - the format table, name lookup, element encode/decode and bit
 * packing. The block formats' quantizers live in qtype_block.c. */
#include "qtype.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

/* bitsandbytes' NF4 code book (Dettmers et al. 2023), float32 values as
 * bitsandbytes defines them; code 7 is the exact zero. */
static const float NF4_VALUES[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

/* Symmetric element ranges of the block formats: mxint8 (two's complement,
 * -128 never produced) and mx9 / mx6 (a sign over a 7- or 4-bit magnitude,
 * stored sign-magnitude in the block). */
static const QType INT8_SYM = {
    .name = "int8_sym", .kind = QTYPE_KIND_INT, .bits = 8, .bits_per_elem = 8, .max = 127, .qmin = -127,
    .qmax = 127};
static const QType INT5_SYM = {
    .name = "int5_sym", .kind = QTYPE_KIND_INT, .bits = 5, .bits_per_elem = 5, .max = 15, .qmin = -15,
    .qmax = 15};

enum {
    Q_INT2, Q_INT3, Q_INT4, Q_INT5, Q_INT6, Q_INT7, Q_INT8, Q_UINT4, Q_UINT8, Q_TERNARY, Q_BINARY, Q_NF4,
    Q_FP8_E4M3, Q_FP8_E5M2, Q_FP6_E3M2, Q_FP6_E2M3, Q_FP4_E2M1,
    Q_MXFP8_E4M3, Q_MXFP6_E3M2, Q_MXFP4, Q_MXINT8, Q_MX6, Q_MX9,
    Q_COUNT
};

#define QINT(nm, b) {.name = nm, .kind = QTYPE_KIND_INT, .bits = b, .bits_per_elem = b, \
                     .max = (float)((1 << (b - 1)) - 1), .qmin = -(1 << (b - 1)), .qmax = (1 << (b - 1)) - 1}
#define QUINT(nm, b) {.name = nm, .kind = QTYPE_KIND_UINT, .bits = b, .bits_per_elem = b, \
                      .max = (float)((1 << b) - 1), .qmin = 0, .qmax = (1 << b) - 1}
/* bias 2^(E-1) - 1 for every float here. */
#define QFLOAT(nm, e, m, mx, inf, nan) {.name = nm, .kind = QTYPE_KIND_FLOAT, .bits = 1 + e + m,       \
                                        .bits_per_elem = 1 + e + m, .max = mx, .exp_bits = e, .man_bits = m, \
                                        .bias = (1 << (e - 1)) - 1, .has_inf = inf, .has_nan = nan}
/* OCP MX v1.0: 32 elements + one e8m0 scale: element bits + 8/32 per element. */
#define QMX(nm, el, b, mx, blk, emax, slog2) {.name = nm, .kind = QTYPE_KIND_MX, .bits = b,                    \
                                            .bits_per_elem = b + 8.0 / 32, .max = mx, .block = 32,             \
                                            .scale_bits = 8, .block_bytes = sizeof(blk), .elem = el,          \
                                            .elem_emax = emax, .elem_scale_log2 = slog2}

static const QType QTYPES[Q_COUNT] = {
    [Q_INT2] = QINT("int2", 2),    /* 2 bits/elem */
    [Q_INT3] = QINT("int3", 3),    /* 3 */
    [Q_INT4] = QINT("int4", 4),    /* 4 */
    [Q_INT5] = QINT("int5", 5),    /* 5 */
    [Q_INT6] = QINT("int6", 6),    /* 6 */
    [Q_INT7] = QINT("int7", 7),    /* 7 */
    [Q_INT8] = QINT("int8", 8),    /* 8 */
    [Q_UINT4] = QUINT("uint4", 4), /* 4 */
    [Q_UINT8] = QUINT("uint8", 8), /* 8 */
    /* 2 bits: int2 codes restricted to -1..1 */
    [Q_TERNARY] = {.name = "ternary", .kind = QTYPE_KIND_TERNARY, .bits = 2, .bits_per_elem = 2, .max = 1,
                   .qmin = -1, .qmax = 1},
    /* 1 bit: 0 = -1, 1 = +1 */
    [Q_BINARY] = {.name = "binary", .kind = QTYPE_KIND_BINARY, .bits = 1, .bits_per_elem = 1, .max = 1,
                  .qmin = -1, .qmax = 1},
    /* 4 bits (the absmax block scale belongs to the quantizer, not the format) */
    [Q_NF4] = {.name = "nf4", .kind = QTYPE_KIND_LUT, .bits = 4, .bits_per_elem = 4, .max = 1, .lut = NF4_VALUES},
    [Q_FP8_E4M3] = QFLOAT("fp8_e4m3", 4, 3, 448.0f, false, true),     /* 8: OCP E4M3FN */
    [Q_FP8_E5M2] = QFLOAT("fp8_e5m2", 5, 2, 57344.0f, true, true),    /* 8: IEEE-like */
    [Q_FP6_E3M2] = QFLOAT("fp6_e3m2", 3, 2, 28.0f, false, false),     /* 6 */
    [Q_FP6_E2M3] = QFLOAT("fp6_e2m3", 2, 3, 7.5f, false, false),      /* 6 */
    [Q_FP4_E2M1] = QFLOAT("fp4_e2m1", 2, 1, 6.0f, false, false),      /* 4 */
    /* emax_elem = floor(log2(element max)): 448 -> 8, 28 -> 4, 6 -> 2 */
    [Q_MXFP8_E4M3] = QMX("mxfp8_e4m3", &QTYPES[Q_FP8_E4M3], 8, 448.0f, QMxBlock8, 8, 0), /* 8.25 */
    [Q_MXFP6_E3M2] = QMX("mxfp6_e3m2", &QTYPES[Q_FP6_E3M2], 6, 28.0f, QMxBlock6, 4, 0),  /* 6.25 */
    [Q_MXFP4] = QMX("mxfp4", &QTYPES[Q_FP4_E2M1], 4, 6.0f, QMxBlock4, 2, 0),             /* 4.25 */
    /* 8.25: OCP MXINT8 elements are int8 codes * 2^-6 (max 127/64, emax_elem 0); encode keeps them
     * symmetric (-127..127), code -128 decodes to -2 */
    [Q_MXINT8] = QMX("mxint8", &INT8_SYM, 8, 127.0f / 64, QMxBlock8, 0, -6),
    /* Rouhani et al. 2023, "With Shared Microexponents, A Little Shifting Goes a Long Way" (arXiv
     * 2302.08007): blocks of k1 = 16 with a d1 = 8-bit shared exponent, sub-blocks of k2 = 2 with a
     * d2 = 1-bit micro-exponent, sign + m-bit magnitude per element (MX6: m = 4, MX9: m = 7).
     * mx6: 1 + 4 + 8/16 + 1/2 = 6 bits/elem; mx9: 1 + 7 + 8/16 + 1/2 = 9. */
    [Q_MX6] = {.name = "mx6", .kind = QTYPE_KIND_MX_SHARED, .bits = 5, .bits_per_elem = 6, .max = 15.0f / 8,
               .block = 16, .scale_bits = 8, .block_bytes = sizeof(QMx6Block), .elem = &INT5_SYM, .sub_block = 2,
               .micro_bits = 1, .mant_bits = 4},
    [Q_MX9] = {.name = "mx9", .kind = QTYPE_KIND_MX_SHARED, .bits = 8, .bits_per_elem = 9, .max = 127.0f / 64,
               .block = 16, .scale_bits = 8, .block_bytes = sizeof(QMx9Block), .elem = &INT8_SYM, .sub_block = 2,
               .micro_bits = 1, .mant_bits = 7},
};

/* ---- generic small floats ------------------------------------------------- */

#define GEN_EXP_MAX 7  /* 2^(2^8 - 1 - 127) would overflow float */
#define GEN_BITS_MAX 8

static QType generic_table[GEN_EXP_MAX + 1][GEN_BITS_MAX];
static char generic_names[GEN_EXP_MAX + 1][GEN_BITS_MAX][9];
static pthread_once_t generic_once = PTHREAD_ONCE_INIT;

/* Every (E, M) entry is built once, up front, so lookups never write and
 * concurrent qtype_find calls need no lock. */
static void generic_build(void) {
    for (int e = 1; e <= GEN_EXP_MAX; e++) {
        for (int m = 0; 1 + e + m <= GEN_BITS_MAX; m++) {
            /* "fpN_eXmY": every number is a single digit */
            char *nm = generic_names[e][m];
            const char name[9] = {'f', 'p', (char)('1' + e + m), '_', 'e', (char)('0' + e), 'm', (char)('0' + m), 0};
            memcpy(nm, name, sizeof name);
            int bias = (1 << (e - 1)) - 1;
            generic_table[e][m] = (QType){
                .name = nm, .kind = QTYPE_KIND_FLOAT, .bits = 1 + e + m, .bits_per_elem = 1 + e + m,
                .max = ldexpf(2.0f - ldexpf(1.0f, -m), (1 << e) - 1 - bias), .exp_bits = e, .man_bits = m,
                .bias = bias};
        }
    }
}

/* Reads a decimal of 1-2 digits at *s; -1 if there is none. */
static int parse_small_uint(const char **s) {
    const char *p = *s;
    if (!isdigit((unsigned char)p[0])) return -1;
    int v = p[0] - '0';
    p++;
    if (isdigit((unsigned char)p[0])) v = v * 10 + (*p++ - '0');
    if (isdigit((unsigned char)p[0])) return -1;
    *s = p;
    return v;
}

/* "eXmY" or "fpN_eXmY". Returns false if `name` is not of that form;
 * otherwise sets *out (NULL with an error for an invalid format). */
static bool generic_find(const char *name, const QType **out, QtError *err) {
    const char *p = name;
    int n = -1;
    if (strncasecmp(p, "fp", 2) == 0) {
        p += 2;
        if ((n = parse_small_uint(&p)) < 0 || *p != '_') return false;
        p++;
    }
    if (tolower((unsigned char)*p) != 'e') return false;
    p++;
    int e = parse_small_uint(&p);
    if (e < 0 || tolower((unsigned char)*p) != 'm') return false;
    p++;
    int m = parse_small_uint(&p);
    if (m < 0 || *p != '\0') return false;

    *out = NULL;
    if (n >= 0 && n != 1 + e + m) {
        qt_error_set(err, QT_ERR_ARG, "qtype '%s': 1 sign + %d exponent + %d mantissa bits make %d bits, not %d; "
                     "write fp%d_e%dm%d or e%dm%d", name, e, m, 1 + e + m, n, 1 + e + m, e, m, e, m);
        return true;
    }
    for (int i = 0; i < Q_COUNT; i++) {
        if (QTYPES[i].kind == QTYPE_KIND_FLOAT && QTYPES[i].exp_bits == e && QTYPES[i].man_bits == m) {
            *out = &QTYPES[i];
            return true;
        }
    }
    if (e < 1 || e > GEN_EXP_MAX || 1 + e + m > GEN_BITS_MAX) {
        qt_error_set(err, QT_ERR_ARG, "qtype '%s': a small float eXmY needs 1 <= X <= %d exponent bits and "
                     "1 + X + Y <= %d bits in all (e.g. e3m4)", name, GEN_EXP_MAX, GEN_BITS_MAX);
        return true;
    }
    pthread_once(&generic_once, generic_build);
    *out = &generic_table[e][m];
    return true;
}

/* ---- lookup ---------------------------------------------------------------- */

const QType *qtype_find(const char *name, QtError *err) {
    for (int i = 0; name && i < Q_COUNT; i++)
        if (strcasecmp(name, QTYPES[i].name) == 0) return &QTYPES[i];
    const QType *t = NULL;
    if (name && generic_find(name, &t, err)) return t;
    char valid[512] = "";
    for (int i = 0; i < Q_COUNT; i++) {
        size_t len = strlen(valid);
        snprintf(valid + len, sizeof valid - len, "%s%s", len ? ", " : "", QTYPES[i].name);
    }
    qt_error_set(err, QT_ERR_ARG, "unknown qtype '%s' (valid: %s; or any small float as eXmY or fpN_eXmY, "
                 "e.g. e3m4 or fp8_e3m4)", name ? name : "(none)", valid);
    return NULL;
}

const char *qtype_name(const QType *t) { return t ? t->name : "(none)"; }

int qtype_count(void) { return Q_COUNT; }

const QType *qtype_at(int i) { return i >= 0 && i < Q_COUNT ? &QTYPES[i] : NULL; }

static const char *const ROUND_NAMES[QROUND_COUNT] = {
    [QROUND_RNE] = "rne",
    [QROUND_HALF_AWAY] = "half_away",
    [QROUND_FLOOR] = "floor",
    [QROUND_STOCHASTIC] = "stochastic",
};

const char *qround_name(QRound mode) {
    return (int)mode >= 0 && mode < QROUND_COUNT ? ROUND_NAMES[mode] : "unknown";
}

QtStatus qround_parse(const char *name, QRound *out, QtError *err) {
    char buf[32];
    const char *key = name;
    size_t len = name ? strlen(name) : sizeof buf;
    if (len < sizeof buf) {
        /* DESIGN.md writes "half-away". */
        for (size_t i = 0; i <= len; i++) buf[i] = name[i] == '-' ? '_' : name[i];
        key = buf;
    }
    int k = 0;
    QtStatus st = qt_name_lookup("rounding mode", key, ROUND_NAMES, QROUND_COUNT, &k, err);
    if (st == QT_OK) *out = (QRound)k;
    return st;
}

/* ---- element encode / decode ---------------------------------------------- */

static uint32_t mask_bits(int bits) { return bits >= 32 ? 0xffffffffu : (1u << bits) - 1u; }

bool qtype_has_nan(const QType *t) { return t && t->kind == QTYPE_KIND_FLOAT && t->has_nan; }

bool qtype_is_block(const QType *t) { return t && (t->kind == QTYPE_KIND_MX || t->kind == QTYPE_KIND_MX_SHARED); }

bool qtype_code_valid(const QType *t, uint32_t code) {
    if (!t || qtype_is_block(t) || code > mask_bits(t->bits)) return false;
    return !(t->kind == QTYPE_KIND_TERNARY && code == 2);
}

bool qtype_code_is_nan(const QType *t, uint32_t code) {
    if (!qtype_has_nan(t)) return false;
    int e = t->exp_bits, m = t->man_bits;
    uint32_t mag = code & mask_bits(e + m);
    if (t->has_inf) return (mag >> m) == mask_bits(e) && (mag & mask_bits(m)) != 0;
    return mag == mask_bits(e + m);
}

/* Whether a magnitude `frac` (in [0, 1)) of the way from its lower grid
 * neighbour to its upper one moves up to the upper one. Floor and
 * stochastic act on the signed value, so for a negative value "down" is the
 * larger magnitude. tie_up: RNE's choice at an exact half. */
static bool round_mag_up(float frac, bool neg, QRound mode, float u, bool tie_up) {
    if (!(frac > 0.0f)) return false;
    switch (mode) {
    case QROUND_FLOOR: return neg;
    /* floor(v + u) on the signed grid; 1 - frac is exact for frac from a float grid position. */
    case QROUND_STOCHASTIC: return neg ? u < frac : u >= 1.0f - frac;
    case QROUND_HALF_AWAY: return frac >= 0.5f;
    default: return frac > 0.5f || (frac == 0.5f && tie_up);
    }
}

static uint32_t int_encode(const QType *t, float v, QRound mode, float u) {
    if (isnan(v)) v = 0.0f;
    float c = fminf(fmaxf(v, (float)t->qmin), (float)t->qmax);
    bool neg = c < 0.0f;
    float a = fabsf(c), lo = floorf(a);
    int32_t q = (int32_t)lo;
    q += round_mag_up(a - lo, neg, mode, u, (q & 1) != 0);
    return (uint32_t)(neg ? -q : q) & mask_bits(t->bits);
}

static float int_decode(const QType *t, uint32_t code) {
    code &= mask_bits(t->bits);
    if (t->kind == QTYPE_KIND_UINT) return (float)code;
    int32_t q = (int32_t)code;
    if (code >> (t->bits - 1)) q -= (int32_t)1 << t->bits; /* sign-extend */
    return (float)q;
}

/* Grid {-1, +1}: the tie is v == 0, which goes to +1 (sign binarisation). */
static uint32_t binary_encode(float v, QRound mode, float u) {
    if (isnan(v)) v = 0.0f;
    float c = fminf(fmaxf(v, -1.0f), 1.0f);
    switch (mode) {
    case QROUND_FLOOR: return c >= 1.0f;
    case QROUND_STOCHASTIC: return u >= (1.0f - c) * 0.5f;
    default: return c >= 0.0f;
    }
}

/* Nearest table value; an exact tie goes to the lower code under RNE, as
 * bitsandbytes' NF4 quantizer does. */
static uint32_t lut_encode(const QType *t, float v, QRound mode, float u) {
    const float *g = t->lut;
    int n = 1 << t->bits;
    if (isnan(v)) v = 0.0f;
    if (v <= g[0]) return 0;
    if (v >= g[n - 1]) return (uint32_t)(n - 1);
    int lo = 0, hi = n - 1; /* g[lo] <= v < g[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (g[mid] <= v) lo = mid;
        else hi = mid;
    }
    if (g[lo] == v) return (uint32_t)lo;
    double d_lo = (double)v - g[lo], d_hi = (double)g[hi] - v; /* exact */
    bool up;
    switch (mode) {
    case QROUND_FLOOR: up = false; break;
    case QROUND_STOCHASTIC: up = u >= d_hi / ((double)g[hi] - g[lo]); break;
    case QROUND_HALF_AWAY: up = d_hi < d_lo || (d_hi == d_lo && v > 0.0f); break;
    default: up = d_hi < d_lo; break;
    }
    return (uint32_t)(up ? hi : lo);
}

static uint32_t float_nan_code(const QType *t) {
    int e = t->exp_bits, m = t->man_bits;
    if (t->has_inf) return (mask_bits(e) << m) | (1u << (m - 1)); /* quiet NaN: top mantissa bit */
    return mask_bits(e + m);
}

/* The magnitude is located in its binade (the subnormal range shares the
 * smallest normal binade's spacing), scaled to q = |v| / spacing exactly,
 * and the lower neighbour's magnitude code is ((e + bias - 1) << M) + floor(q)
 * for normals and subnormals alike. Magnitude codes increase with the value,
 * so the upper neighbour is that code + 1. */
static uint32_t float_encode(const QType *t, float v, QRound mode, float u) {
    int m = t->man_bits;
    uint32_t sign = signbit(v) ? 1u << (t->exp_bits + m) : 0;
    if (isnan(v)) return t->has_nan ? float_nan_code(t) : 0;
    if (isinf(v) && t->has_inf) return sign | (mask_bits(t->exp_bits) << m);
    float a = fminf(fabsf(v), t->max);
    int emin = 1 - t->bias, e = emin;
    if (a > 0.0f) {
        frexpf(a, &e);
        e = e - 1 > emin ? e - 1 : emin;
    }
    float q = ldexpf(a, m - e), ql = floorf(q);
    uint32_t mag = ((uint32_t)(e + t->bias - 1) << m) + (uint32_t)ql;
    mag += round_mag_up(q - ql, sign != 0, mode, u, (mag & 1) != 0);
    return sign | mag;
}

static float float_decode(const QType *t, uint32_t code) {
    int e = t->exp_bits, m = t->man_bits;
    uint32_t ef = (code >> m) & mask_bits(e), mf = code & mask_bits(m);
    float sign = (code >> (e + m)) & 1 ? -1.0f : 1.0f;
    if (qtype_code_is_nan(t, code)) return NAN;
    if (t->has_inf && ef == mask_bits(e)) return sign * INFINITY;
    if (ef == 0) return sign * ldexpf((float)mf, 1 - t->bias - m);
    return sign * ldexpf((float)((1u << m) + mf), (int)ef - t->bias - m);
}

uint32_t qtype_encode(const QType *t, float v, QRound mode, float u) {
    if (!t) return 0;
    switch (t->kind) {
    case QTYPE_KIND_INT:
    case QTYPE_KIND_UINT:
    case QTYPE_KIND_TERNARY: return int_encode(t, v, mode, u);
    case QTYPE_KIND_BINARY: return binary_encode(v, mode, u);
    case QTYPE_KIND_LUT: return lut_encode(t, v, mode, u);
    case QTYPE_KIND_FLOAT: return float_encode(t, v, mode, u);
    default: return 0;
    }
}

float qtype_decode(const QType *t, uint32_t code) {
    if (!t) return NAN;
    switch (t->kind) {
    case QTYPE_KIND_INT:
    case QTYPE_KIND_UINT:
    case QTYPE_KIND_TERNARY: return int_decode(t, code);
    case QTYPE_KIND_BINARY: return code & 1 ? 1.0f : -1.0f;
    case QTYPE_KIND_LUT: return t->lut[code & mask_bits(t->bits)];
    case QTYPE_KIND_FLOAT: return float_decode(t, code);
    default: return NAN;
    }
}

/* ---- packing --------------------------------------------------------------- */

size_t qtype_packed_bytes(const QType *t, size_t n) {
    if (!t) return 0;
    if (qtype_is_block(t)) return (n + (size_t)t->block - 1) / (size_t)t->block * t->block_bytes;
    return (n * (size_t)t->bits + 7) / 8;
}

/* A bit accumulator: whole bytes leave it as soon as they are complete, so
 * it never holds more than 7 + bits <= 39 bits. */
QtStatus qtype_pack(const QType *t, const uint32_t *codes, size_t n, uint8_t *out) {
    if (!t || qtype_is_block(t) || t->bits < 1 || t->bits > 32 || (n && (!codes || !out))) return QT_ERR_ARG;
    int w = t->bits;
    uint32_t mask = mask_bits(w);
    uint64_t acc = 0;
    int have = 0;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        acc = (acc << w) | (codes[i] & mask);
        have += w;
        while (have >= 8) {
            have -= 8;
            out[o++] = (uint8_t)(acc >> have);
        }
        acc &= ((uint64_t)1 << have) - 1;
    }
    if (have) out[o] = (uint8_t)(acc << (8 - have));
    return QT_OK;
}

QtStatus qtype_unpack(const QType *t, const uint8_t *in, size_t n, uint32_t *codes) {
    if (!t || qtype_is_block(t) || t->bits < 1 || t->bits > 32 || (n && (!codes || !in))) return QT_ERR_ARG;
    int w = t->bits;
    uint32_t mask = mask_bits(w);
    uint64_t acc = 0;
    int have = 0;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        while (have < w) {
            acc = (acc << 8) | in[k++];
            have += 8;
        }
        have -= w;
        codes[i] = (uint32_t)(acc >> have) & mask;
        acc &= ((uint64_t)1 << have) - 1;
    }
    return QT_OK;
}
