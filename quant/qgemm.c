/* qgemm.c - the integer GEMMs' dispatch, the weight packers, and the
 * portable kernels (qgemm.h); the AVX-512 VNNI kernels are in qgemm_x86.c
 * (the depthwise rows kernel in qgemm_dw_x86.c), the AVX-VNNI and AVX2 ones
 * in qgemm_avx2.c.
 *
 * The portable kernels follow the packed layouts exactly as the vector ones
 * do and sum in uint32 (wrapping like vpdpbusd), so both give the same int32
 * sums; float outputs are one fmaf in both.
 *
 * qgemm_s8's portable kernel (quantized training) widens a block of b rows
 * (QG_NB x QG_KB) and one a row to int16 on the stack, then computes four
 * dot products at a time, sharing each load of the a row. On int16 operands
 * of unknown range the int32 sum of products is the pattern GCC turns into
 * pmaddwd reductions; multiplying the int8 values directly, GCC proves the
 * products fit in int16 and emits pmullw plus widening adds, about three
 * times slower. |a b| <= 2^14, so K < 2^17 keeps every sum inside int32. */
#include <float.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <math.h>
#include <stdatomic.h>
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "nn/pool2x2.h"
#include "qgemm.h"
#include "qgemm_internal.h"
#include "fqt.h"

#define QG_KB 256 /* K per block */
#define QG_NB 32  /* rows of b per block: 16 KiB of int16, in L1 with the a row */

bool qgemm_force_portable = false;
int qgemm_force_isa = -1;

bool qgemm_cpu_has_vnni(void) { return qgemm_cpu_has_isa(QGEMM_ISA_AVX512_VNNI); }

/* AMX: CPUID leaf 7 EDX bits 24 (AMX-TILE) and 25 (AMX-INT8), and Linux's leave to use the tile data (XCR0 bit 18,
 * granted per process by arch_prctl(ARCH_REQ_XCOMP_PERM); without it the first tile instruction faults). */
static bool cpu_amx(void) {
#if defined(__x86_64__) && defined(__linux__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return false;
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
}

/* Bit isa of the families this CPU runs; every thread that races here computes the same answer. */
static int cpu_isas(void) {
    static atomic_int has = -1;
    if (atomic_load(&has) < 0) {
        int m = 1 << QGEMM_ISA_PORTABLE;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        /* libgcc checks that the OS saves the AVX and AVX-512 state (XCR0) before reporting these */
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
            m |= 1 << QGEMM_ISA_AVX2;
            /* AVX-VNNI: CPUID leaf 7 subleaf 1, EAX bit 4 (clang 14's __builtin_cpu_supports has no name for
             * it); the YMM state it needs is the one avx2 already required */
            unsigned a = 0, b = 0, c = 0, d = 0;
            if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1)) m |= 1 << QGEMM_ISA_AVXVNNI;
        }
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
            m |= 1 << QGEMM_ISA_AVX512_VNNI;
            if (cpu_amx()) m |= 1 << QGEMM_ISA_AMX;
        }
#endif
        atomic_store(&has, m);
    }
    return atomic_load(&has);
}

bool qgemm_cpu_has_isa(QGemmIsa isa) { return isa >= 0 && isa <= QGEMM_ISA_AMX && cpu_isas() >> isa & 1; }

QGemmIsa qgemm_isa(void) {
    if (qgemm_force_portable) return QGEMM_ISA_PORTABLE;
    if (qgemm_force_isa >= 0)
        return qgemm_cpu_has_isa(qgemm_force_isa) ? (QGemmIsa)qgemm_force_isa : QGEMM_ISA_PORTABLE;
    for (int isa = QGEMM_ISA_AMX; isa > QGEMM_ISA_PORTABLE; isa--)
        if (qgemm_cpu_has_isa(isa)) return (QGemmIsa)isa;
    return QGEMM_ISA_PORTABLE;
}

bool qgemm_use_vnni(void) { return qgemm_isa() >= QGEMM_ISA_AVX512_VNNI; }

const char *qgemm_kernel_name(void) {
    switch (qgemm_isa()) {
    case QGEMM_ISA_AMX: return "amx";
    case QGEMM_ISA_AVX512_VNNI: return "avx512-vnni";
    case QGEMM_ISA_AVXVNNI: return "avxvnni";
    case QGEMM_ISA_AVX2: return "avx2";
    default: return "portable";
    }
}

static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* ---- packing --------------------------------------------------------------------------------------------------- */

QtStatus qgemm_pack_b(QGemmPackedB *p, const int8_t *b, int n, int k, QtError *err) {
    memset(p, 0, sizeof *p);
    if (!b || n < 1 || k < 1 || k > QGEMM_K_MAX)
        return qt_error_set(err, QT_ERR_ARG, "qgemm_pack_b: a weight (%d, %d) cannot be packed (want n >= 1 and "
                            "1 <= k <= %d, and codes)", n, k, QGEMM_K_MAX);
    int kg = (k + 3) / 4, panels = (n + QGEMM_LANES - 1) / QGEMM_LANES;
    size_t bytes = (size_t)panels * kg * 64;
    p->data = alloc64(bytes);
    p->col_sum = alloc64((size_t)panels * QGEMM_LANES * sizeof *p->col_sum);
    if (!p->data || !p->col_sum) {
        qgemm_packed_b_free(p);
        return qt_error_set(err, QT_ERR_NOMEM, "qgemm_pack_b: out of memory for a packed weight of %zu bytes", bytes);
    }
    memset(p->data, 0, bytes);
    memset(p->col_sum, 0, (size_t)panels * QGEMM_LANES * sizeof *p->col_sum);
    for (int j = 0; j < n; j++) {
        int8_t *dst = p->data + (size_t)(j / QGEMM_LANES) * kg * 64 + (size_t)(j % QGEMM_LANES) * 4;
        const int8_t *src = b + (size_t)j * k;
        int32_t sum = 0;
        for (int kk = 0; kk < k; kk++) {
            dst[(size_t)(kk >> 2) * 64 + (kk & 3)] = src[kk];
            sum += src[kk];
        }
        p->col_sum[j] = sum;
    }
    *p = (QGemmPackedB){.n = n, .k = k, .k_groups = kg, .panels = panels, .data = p->data, .col_sum = p->col_sum};
    return QT_OK;
}

void qgemm_packed_b_free(QGemmPackedB *p) {
    if (!p) return;
    free(p->data), free(p->col_sum);
    memset(p, 0, sizeof *p);
}

QtStatus qgemm_pack_taps(QGemmPackedTaps *p, const uint32_t *w, int rows, int taps, QtError *err) {
    memset(p, 0, sizeof *p);
    if (!w || rows < 1 || taps < 1 || taps > QGEMM_K_MAX / 4)
        return qt_error_set(err, QT_ERR_ARG, "qgemm_pack_taps: a weight of %d rows and %d taps cannot be packed "
                            "(want rows >= 1 and 1 <= taps <= %d, and weights)", rows, taps, QGEMM_K_MAX / 4);
    int rb = (rows + QGEMM_ROWS - 1) / QGEMM_ROWS;
    size_t n = (size_t)rb * taps * QGEMM_ROWS;
    p->data = alloc64(n * sizeof *p->data);
    p->row_sum = alloc64((size_t)rb * QGEMM_ROWS * sizeof *p->row_sum);
    p->wide = alloc64(4 * n * sizeof *p->wide);
    if (!p->data || !p->row_sum || !p->wide) {
        qgemm_packed_taps_free(p);
        return qt_error_set(err, QT_ERR_NOMEM, "qgemm_pack_taps: out of memory for a packed weight of %zu bytes",
                            n * (sizeof(int32_t) + 4 * sizeof(int16_t)));
    }
    memset(p->data, 0, n * sizeof *p->data);
    memset(p->row_sum, 0, (size_t)rb * QGEMM_ROWS * sizeof *p->row_sum);
    for (int r = 0; r < rows; r++) {
        int32_t sum = 0;
        for (int t = 0; t < taps; t++) {
            uint32_t d = w[(size_t)r * taps + t];
            p->data[((size_t)(r / QGEMM_ROWS) * taps + t) * QGEMM_ROWS + r % QGEMM_ROWS] = (int32_t)d;
            for (int j = 0; j < 4; j++) sum += (int8_t)(uint8_t)(d >> (8 * j));
        }
        p->row_sum[r] = sum;
    }
    for (size_t i = 0; i < 4 * n; i++) p->wide[i] = (int8_t)(uint8_t)((uint32_t)p->data[i / 4] >> (8 * (i % 4)));
    if (taps % 16 == 0 && qgemm_cpu_has_isa(QGEMM_ISA_AMX)) { /* the AMX kernel's A tiles: w as it came, padded */
        const size_t rows16 = (size_t)rb * QGEMM_ROWS + 8; /* a 16-row tile from any row block's first row */
        if (!(p->tiles = alloc64(rows16 * taps * sizeof *p->tiles))) {
            qgemm_packed_taps_free(p);
            return qt_error_set(err, QT_ERR_NOMEM, "qgemm_pack_taps: out of memory for AMX tiles of %zu bytes",
                                rows16 * taps * sizeof(int32_t));
        }
        memset(p->tiles, 0, rows16 * taps * sizeof *p->tiles);
        memcpy(p->tiles, w, (size_t)rows * taps * sizeof *p->tiles);
    }
    p->rows = rows, p->taps = taps, p->row_blocks = rb;
    return QT_OK;
}

void qgemm_packed_taps_free(QGemmPackedTaps *p) {
    if (!p) return;
    free(p->data), free(p->row_sum), free(p->wide), free(p->tiles);
    memset(p, 0, sizeof *p);
}

/* ---- dense ----------------------------------------------------------------------------------------------------- */

static int clip(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Row i, panel p of the product from its 16 wrapped sums. */
static void dense_store(const QGemmDense *d, int i, int p, const uint32_t *acc) {
    const QGemmPackedB *b = d->b;
    for (int l = 0; l < QGEMM_LANES && QGEMM_LANES * p + l < b->n; l++) {
        int j = QGEMM_LANES * p + l;
        int32_t s = (int32_t)(acc[l] - (uint32_t)d->a_zero * (uint32_t)b->col_sum[j]);
        if (d->c_i32) d->c_i32[(size_t)i * d->ldc + j] = s;
        else d->c_f32[(size_t)i * d->ldc + j] = fmaf((float)s, d->scale[j], d->bias ? d->bias[j] : 0.0f);
    }
}

void qgemm_dense_portable(const QGemmDense *d, int row0, int row1, int p0, int p1) {
    const QGemmPackedB *b = d->b;
    row0 = clip(row0, 0, d->m), row1 = clip(row1, row0, d->m);
    p0 = clip(p0, 0, b->panels), p1 = clip(p1, p0, b->panels);
    const int full = b->k / 4, rest = b->k % 4;
    for (int i = row0; i < row1; i++) {
        const uint8_t *ar = d->a + (size_t)i * d->lda; /* [k] */
        for (int p = p0; p < p1; p++) {
            const int8_t *bp = b->data + (size_t)p * b->k_groups * 64; /* [k_groups][16][4] */
            uint32_t acc[QGEMM_LANES] = {0};
            for (int g = 0; g < b->k_groups; g++) {
                uint32_t x[4] = {0, 0, 0, 0};
                for (int j = 0; j < (g < full ? 4 : rest); j++) x[j] = ar[4 * g + j];
                const int8_t *bg = bp + (size_t)g * 64;
                for (int l = 0; l < QGEMM_LANES; l++)
                    acc[l] += x[0] * (uint32_t)bg[4 * l] + x[1] * (uint32_t)bg[4 * l + 1] +
                              x[2] * (uint32_t)bg[4 * l + 2] + x[3] * (uint32_t)bg[4 * l + 3];
            }
            dense_store(d, i, p, acc);
        }
    }
}

void qgemm_dense(const QGemmDense *d, int row0, int row1, int p0, int p1) {
    switch (qgemm_isa()) {
    case QGEMM_ISA_AMX:
    case QGEMM_ISA_AVX512_VNNI: qgemm_dense_vnni(d, row0, row1, p0, p1); break;
    case QGEMM_ISA_AVXVNNI: qgemm_dense_avxvnni(d, row0, row1, p0, p1); break;
    case QGEMM_ISA_AVX2: qgemm_dense_avx2(d, row0, row1, p0, p1); break;
    default: qgemm_dense_portable(d, row0, row1, p0, p1); break;
    }
}

void qgemm_u8s8(int32_t *c, const uint8_t *a, int a_zero, const QGemmPackedB *b, int m) {
    QGemmDense d = {.a = a, .lda = b->k, .m = m, .a_zero = a_zero, .b = b, .c_i32 = c, .ldc = b->n};
    qgemm_dense(&d, 0, m, 0, b->panels);
}

void qgemm_u8s8_ref(int32_t *c, const uint8_t *a, int a_zero, const int8_t *b, int m, int n, int k) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            int64_t acc = 0;
            for (int kk = 0; kk < k; kk++) acc += ((int64_t)a[(size_t)i * k + kk] - a_zero) * b[(size_t)j * k + kk];
            c[(size_t)i * n + j] = (int32_t)acc;
        }
}

/* ---- taps ------------------------------------------------------------------------------------------------------ */

/* Output y of row r from its wrapped sum, after the epilogue's relu if any. */
static float taps_value(const QGemmTaps *g, int r, uint32_t acc) {
    const int32_t corr = (int32_t)((uint32_t)g->a_zero * (uint32_t)g->w->row_sum[r]);
    const float y = fmaf((float)(int32_t)(acc - (uint32_t)corr), g->scale[r], g->bias ? g->bias[r] : 0.0f);
    return g->epi == QGEMM_EPI_NONE || y > 0.0f ? y : 0.0f;
}

/* y + the residual at out index o, relu'd if res_relu (nn_add's sum, nn_relu's relu); y without res. */
static float taps_sum(const QGemmTaps *g, float y, size_t o) {
    if (!g->res) return y;
    const float v = y + g->res[o];
    return !g->res_relu || v > 0.0f ? v : 0.0f;
}

static uint8_t code_u8(float x, float s, float lo, float hi, int zero, int *bad);
static uint8_t *code_at(const QGemmCodesOut *co, int i, size_t P, size_t p);

/* Row r, vector v from its 16 wrapped sums: the masked lanes, in order, as floats or codes; or, pooling, all 16
 * lanes into row s of the pool buffer. */
static void taps_store(const QGemmTaps *g, int r, int s, int v, const uint32_t *acc, int *bad) {
    if (g->epi == QGEMM_EPI_RELU_POOL2) {
        float *dst = g->pool_buf + ((size_t)s * g->n_vec + v) * QGEMM_LANES;
        for (int l = 0; l < QGEMM_LANES; l++) dst[l] = taps_value(g, r, acc[l]);
        return;
    }
    const QGemmCodesOut *co = g->codes;
    const size_t pos = (size_t)g->vec_pos[v];
    for (int l = 0, at = 0; l < QGEMM_LANES; l++) {
        if (!(g->vec_mask[v] >> l & 1)) continue;
        const size_t p = pos + (size_t)at++;
        const float y = taps_sum(g, taps_value(g, r, acc[l]), (size_t)r * g->ldo + p);
        if (co) *code_at(co, r, g->ldo, p) = code_u8(y, co->q.s, co->q.lo, co->q.hi, co->q.zero, bad);
        if (!co || g->floats_too) g->out[(size_t)r * g->ldo + p] = y;
    }
}

/* Codes by quads: the zero point in the bytes of the last quad's channels past rows, at the vectors' pixels. */
static void taps_quad_tail(const QGemmTaps *g, int v0, int v1) {
    const QGemmCodesOut *co = g->codes;
    for (int r = g->w->rows; r % 4; r++)
        for (int v = v0; v < v1; v++)
            for (int k = 0; k < __builtin_popcount(g->vec_mask[v]); k++)
                *code_at(co, r, g->ldo, (size_t)g->vec_pos[v] + (size_t)k) = (uint8_t)co->q.zero;
}

/* The 2x2 windows of row block rb's relu'd outputs in the pool buffer -> out. */
static void taps_pool(const QGemmTaps *g, int rb) {
    for (int s = 0; s < QGEMM_ROWS && rb * QGEMM_ROWS + s < g->w->rows; s++) {
        const float *src = g->pool_buf + (size_t)s * g->n_vec * QGEMM_LANES; /* (pixels) */
        float *dst = g->out + (size_t)(rb * QGEMM_ROWS + s) * g->ldo;         /* (pool_h, pool_w) */
        for (int i = 0; i < g->pool_h; i++) {
            const float *a = src + (size_t)2 * i * g->pitch, *b = a + g->pitch;
            for (int j = 0, k; j < g->pool_w; j++)
                dst[i * g->pool_w + j] = pool2x2_window(a[2 * j], a[2 * j + 1], b[2 * j], b[2 * j + 1], &k);
        }
    }
}

bool qgemm_taps_portable(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    const QGemmPackedTaps *w = g->w;
    const bool pool = g->epi == QGEMM_EPI_RELU_POOL2;
    int bad = 0;
    rb0 = clip(rb0, 0, w->row_blocks), rb1 = clip(rb1, rb0, w->row_blocks);
    v0 = pool ? 0 : clip(v0, 0, g->n_vec), v1 = pool ? g->n_vec : clip(v1, v0, g->n_vec);
    for (int rb = rb0; rb < rb1; rb++) {
        for (int v = v0; v < v1; v++)
            for (int s = 0; s < QGEMM_ROWS && rb * QGEMM_ROWS + s < w->rows; s++) {
                uint32_t acc[QGEMM_LANES] = {0};
                for (int t = 0; t < w->taps; t++) {
                    uint32_t wd = (uint32_t)w->data[((size_t)rb * w->taps + t) * QGEMM_ROWS + s];
                    uint32_t w0 = (uint32_t)(int8_t)wd, w1 = (uint32_t)(int8_t)(wd >> 8);
                    uint32_t w2 = (uint32_t)(int8_t)(wd >> 16), w3 = (uint32_t)(int8_t)(wd >> 24);
                    const uint8_t *src = g->act + 4 * ((size_t)g->tap_off[t] + (size_t)v * QGEMM_LANES); /* [16][4] */
                    for (int l = 0; l < QGEMM_LANES; l++)
                        acc[l] += src[4 * l] * w0 + src[4 * l + 1] * w1 + src[4 * l + 2] * w2 + src[4 * l + 3] * w3;
                }
                taps_store(g, rb * QGEMM_ROWS + s, s, v, acc, &bad);
            }
        if (pool) taps_pool(g, rb);
    }
    if (!pool && g->codes && g->codes->quad_plane && rb1 == w->row_blocks && rb0 < rb1) taps_quad_tail(g, v0, v1);
    return !bad;
}

/* Whether the AMX kernel takes g (qgemm_taps): tiles packed, no pool, one strided operand. */
static bool taps_amx_applies(const QGemmTaps *g) {
    const int T = g->w->taps;
    if (!g->w->tiles || g->epi == QGEMM_EPI_RELU_POOL2 || T % 16) return false;
    const int32_t d = T > 1 ? g->tap_off[1] - g->tap_off[0] : 0;
    if (d < 0) return false;
    for (int t = 2; t < T; t++)
        if (g->tap_off[t] - g->tap_off[t - 1] != d) return false;
    return true;
}

size_t qgemm_taps_act_wide_bytes(const QGemmTaps *g) {
    if (qgemm_isa() != QGEMM_ISA_AVX2) return 0;
    int32_t hi = 0;
    for (int t = 0; t < g->w->taps; t++) hi = g->tap_off[t] > hi ? g->tap_off[t] : hi;
    return 8 * ((size_t)hi + (size_t)g->n_vec * QGEMM_LANES);
}

/* The floats of rows [r0, r1) at vectors [v0, v1) in out plus res (relu'd if res_relu), then their codes
 * (qgemm_taps with res or codes, on a family that makes the floats first). Quads take whole quads: r0 and r1
 * multiples of QGEMM_ROWS (a multiple of 4), or r1 = rows. */
static bool taps_finish_out(const QGemmTaps *g, int r0, int r1, int v0, int v1) {
    const QGemmCodesOut *co = g->codes;
    bool ok = true;
    for (int v = v0; v < v1; v++) {
        const int n = __builtin_popcount(g->vec_mask[v]);
        const size_t pos = (size_t)g->vec_pos[v];
        if (!n) continue;
        if (g->res)
            for (int r = r0; r < r1; r++)
                for (size_t i = 0; i < (size_t)n; i++) {
                    float *o = g->out + (size_t)r * g->ldo + pos + i;
                    *o = taps_sum(g, *o, (size_t)(o - g->out));
                }
        if (!co) continue;
        if (!co->quad_plane) {
            for (int r = r0; r < r1; r++)
                ok &= qgemm_quantize_u8(co->dst + (size_t)r * g->ldo + pos, g->out + (size_t)r * g->ldo + pos,
                                        (size_t)n, co->q.s, co->q.lo, co->q.hi, co->q.zero);
            continue;
        }
        for (int r = r0; r < r1; r += 4) {
            const float *x[4];
            for (int k = 0; k < 4; k++) x[k] = r + k < r1 ? g->out + (size_t)(r + k) * g->ldo + pos : NULL;
            uint32_t *dst = (uint32_t *)(void *)co->dst + (size_t)(r / 4) * co->quad_plane + pos;
            ok &= qgemm_quantize_u8x4(dst, 0, x, 0, 1, n, &co->q);
        }
    }
    return ok;
}

bool qgemm_taps_codes_direct(const QGemmTaps *g) {
    const QGemmIsa isa = qgemm_isa();
    if (g->epi == QGEMM_EPI_RELU_POOL2) return false;
    return isa == QGEMM_ISA_PORTABLE || isa == QGEMM_ISA_AVX512_VNNI || (isa == QGEMM_ISA_AMX && !taps_amx_applies(g));
}

bool qgemm_taps(const QGemmTaps *g, int rb0, int rb1, int v0, int v1) {
    if ((g->codes || g->res) && g->epi != QGEMM_EPI_RELU_POOL2 && !qgemm_taps_codes_direct(g)) {
        QGemmTaps f = *g;
        f.codes = NULL, f.res = NULL;
        (void)qgemm_taps(&f, rb0, rb1, v0, v1); /* floats alone: true */
        const int rbs = g->w->row_blocks;
        rb0 = clip(rb0, 0, rbs), rb1 = clip(rb1, rb0, rbs), v0 = clip(v0, 0, g->n_vec), v1 = clip(v1, v0, g->n_vec);
        const int r1 = rb1 * QGEMM_ROWS < g->w->rows ? rb1 * QGEMM_ROWS : g->w->rows;
        return taps_finish_out(g, rb0 * QGEMM_ROWS, r1, v0, v1);
    }
    switch (qgemm_isa()) {
    case QGEMM_ISA_AMX:
        if (taps_amx_applies(g)) qgemm_taps_amx(g, rb0, rb1, v0, v1);
        else return qgemm_taps_vnni(g, rb0, rb1, v0, v1);
        return true;
    case QGEMM_ISA_AVX512_VNNI: return qgemm_taps_vnni(g, rb0, rb1, v0, v1);
    case QGEMM_ISA_AVXVNNI: qgemm_taps_avxvnni(g, rb0, rb1, v0, v1); return true;
    case QGEMM_ISA_AVX2: qgemm_taps_avx2(g, rb0, rb1, v0, v1); return true;
    default: return qgemm_taps_portable(g, rb0, rb1, v0, v1);
    }
}

/* ---- depthwise ------------------------------------------------------------------------------------------------- */

QtStatus qgemm_pack_dw(QGemmPackedDw *p, const int8_t *w, int channels, int kh, int kw, QtError *err) {
    memset(p, 0, sizeof *p);
    if (!w || channels < 1 || kh < 1 || kw < 1 || (long long)kh * kw > QGEMM_K_MAX)
        return qt_error_set(err, QT_ERR_ARG, "qgemm_pack_dw: a depthwise weight of %d channels and a %dx%d kernel "
                            "cannot be packed (want channels >= 1 and 1 <= kh * kw <= %d, and weights)", channels, kh,
                            kw, QGEMM_K_MAX);
    const int kq = (kw + 3) / 4;
    const size_t n = (size_t)channels * kh * kq;
    p->data = alloc64(n * sizeof *p->data);
    p->sum = alloc64((size_t)channels * sizeof *p->sum);
    if (!p->data || !p->sum) {
        qgemm_packed_dw_free(p);
        return qt_error_set(err, QT_ERR_NOMEM, "qgemm_pack_dw: out of memory for a packed weight of %zu bytes",
                            n * sizeof(int32_t));
    }
    for (int c = 0; c < channels; c++) {
        int32_t sum = 0;
        for (int r = 0; r < kh; r++)
            for (int q = 0; q < kq; q++) {
                uint32_t d = 0;
                for (int j = 0; j < 4 && 4 * q + j < kw; j++) {
                    const int8_t v = w[((size_t)c * kh + r) * kw + 4 * q + j];
                    d |= (uint32_t)(uint8_t)v << (8 * j);
                    sum += v;
                }
                p->data[((size_t)c * kh + r) * kq + q] = (int32_t)d;
            }
        p->sum[c] = sum;
    }
    p->channels = channels, p->kh = kh, p->kw = kw, p->kq = kq;
    return QT_OK;
}

void qgemm_packed_dw_free(QGemmPackedDw *p) {
    if (!p) return;
    free(p->data), free(p->sum);
    memset(p, 0, sizeof *p);
}

size_t qgemm_dw_avx2_width(const QGemmPackedDw *w, int ow_n, int sw) {
    /* the furthest a load of 16 values reaches: o0 + 2 p + 1 + 15 at stride 1 (o0 < cols, a multiple of 16), 2 o0 +
     * 2 p + 15 at stride 2 (o0 a multiple of 8), p < (kw + 1) / 2; whole chunks of 16 */
    const size_t cols = ((size_t)ow_n + QGEMM_LANES - 1) / QGEMM_LANES * QGEMM_LANES;
    return ((size_t)(sw > 1 ? 2 : 1) * cols + 2 * (((size_t)w->kw + 1) / 2) + 15) / 16 * 16;
}

size_t qgemm_dw_scratch(const QGemmPackedDw *w, int oh_n, int ow_n, int sh) {
    const size_t rows = (size_t)(oh_n - 1) * sh + (size_t)w->kh;
    const size_t cols = ((size_t)ow_n + QGEMM_LANES - 1) / QGEMM_LANES * QGEMM_LANES; /* whole vectors */
    const size_t vnni = (size_t)w->kq * rows * cols * sizeof(uint32_t); /* the gathered dwords */
    const size_t w16 = qgemm_dw_avx2_width(w, ow_n, 2);                 /* AVX2: int16 rows, weight pairs */
    const size_t avx2 = rows * w16 * sizeof(int16_t) + (size_t)w->kh * ((w->kw + 1) / 2) * 4;
    return ((vnni > avx2 ? vnni : avx2) + 63) / 64 * 64;
}

/* ---- quantizing ------------------------------------------------------------------------------------------------ */

/* The byte of x: adding and subtracting 1.5 * 2^23 rounds |v| < 2^22 to the nearest integer, ties to even, in plain
 * SSE2 (rintf would be a library call there); the clamped v is within +-255. *bad is set for a NaN or infinity. */
static inline uint8_t code_u8(float x, float s, float lo, float hi, int zero, int *bad) {
    const float magic = 12582912.0f;
    *bad |= !(fabsf(x) <= FLT_MAX);
    float v = x / s;
    v = v >= lo ? v : lo; /* NaN -> lo, as fmaxf would */
    v = v <= hi ? v : hi;
    return (uint8_t)((int)((v + magic) - magic) + zero);
}

bool qgemm_quantize_u8_portable(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero) {
    int bad = 0;
    for (size_t i = 0; i < n; i++) dst[i] = code_u8(x[i], s, lo, hi, zero, &bad);
    return !bad;
}

bool qgemm_quantize_u8(uint8_t *dst, const float *x, size_t n, float s, float lo, float hi, int zero) {
    if (qgemm_use_vnni()) return qgemm_quantize_u8_vnni(dst, x, n, s, lo, hi, zero);
    if (qgemm_isa() != QGEMM_ISA_PORTABLE) return qgemm_quantize_u8_avx2(dst, x, n, s, lo, hi, zero);
    return qgemm_quantize_u8_portable(dst, x, n, s, lo, hi, zero);
}

bool qgemm_quantize_u8x4_portable(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows, int n,
                                  const QGemmCodes *c) {
    int bad = 0;
    for (int h = 0; h < rows; h++)
        for (int i = 0; i < n; i++) {
            uint32_t d = 0;
            for (int k = 0; k < 4; k++) {
                const size_t at = (size_t)h * ldx + (size_t)i;
                const uint32_t u = x[k] ? code_u8(x[k][at], c->s, c->lo, c->hi, c->zero, &bad) : (uint32_t)c->zero;
                d |= u << (8 * k);
            }
            dst[(size_t)h * ldd + (size_t)i] = d;
        }
    return !bad;
}

bool qgemm_quantize_u8x4(uint32_t *dst, size_t ldd, const float *const x[4], size_t ldx, int rows, int n,
                         const QGemmCodes *c) {
    if (qgemm_use_vnni()) return qgemm_quantize_u8x4_vnni(dst, ldd, x, ldx, rows, n, c);
    if (qgemm_isa() != QGEMM_ISA_PORTABLE) return qgemm_quantize_u8x4_avx2(dst, ldd, x, ldx, rows, n, c);
    return qgemm_quantize_u8x4_portable(dst, ldd, x, ldx, rows, n, c);
}

/* ---- depthwise ------------------------------------------------------------------------------------------------- */

/* Output i's code p (qgemm.h, QGemmCodesOut). */
static uint8_t *code_at(const QGemmCodesOut *co, int i, size_t P, size_t p) {
    if (!co->quad_plane) return co->dst + (size_t)i * P + p;
    return co->dst + 4 * ((size_t)(i / 4) * co->quad_plane + p) + (size_t)(i % 4);
}

bool qgemm_dw_portable(const QGemmDw *d) {
    const QGemmPackedDw *w = d->w;
    const QGemmCodesOut *co = d->codes;
    const size_t P = (size_t)d->oh_n * d->ow_n;
    int bad = 0;
    for (int i = 0; i < d->n_oc; i++) {
        const int oc = d->oc0 + i;
        const uint8_t *act = d->act + (size_t)i * d->in_plane;   /* (in_h, in_w) */
        const int32_t *wc = w->data + (size_t)oc * w->kh * w->kq; /* [kh][kq] */
        const float scale = d->scale[oc], bias = d->bias ? d->bias[oc] : 0.0f;
        for (int oh = 0; oh < d->oh_n; oh++)
            for (int ow = 0; ow < d->ow_n; ow++) {
                /* |u - a_zero| <= 255, |w| <= 128 and kh * kw <= QGEMM_K_MAX: the sum fits in int32 */
                int32_t s = 0;
                for (int r = 0; r < w->kh; r++) {
                    const int ih = oh * d->sh + r - d->pad_t;
                    if (ih < 0 || ih >= d->in_h) continue; /* padding: u = a_zero */
                    for (int c = 0; c < w->kw; c++) {
                        const int iw = ow * d->sw + c - d->pad_l;
                        if (iw < 0 || iw >= d->in_w) continue;
                        const int8_t wt = (int8_t)(uint8_t)((uint32_t)wc[r * w->kq + c / 4] >> (8 * (c % 4)));
                        s += ((int32_t)act[(size_t)ih * d->in_w + iw] - d->a_zero) * wt;
                    }
                }
                float y = fmaf((float)s, scale, bias);
                y = !d->relu || y > 0.0f ? y : 0.0f;
                const size_t p = (size_t)oh * d->ow_n + ow;
                if (co) *code_at(co, i, P, p) = code_u8(y, co->q.s, co->q.lo, co->q.hi, co->q.zero, &bad);
                else d->out[(size_t)i * P + p] = y;
            }
    }
    if (co && co->quad_plane) /* the last quad's channels past n_oc */
        for (int i = d->n_oc; i % 4; i++)
            for (size_t p = 0; p < P; p++) *code_at(co, i, P, p) = (uint8_t)co->q.zero;
    return !bad;
}

/* The ISA's float kernel on output channels that all read act (in_plane 0, codes NULL). */
static void dw_floats(const QGemmDw *d) {
    switch (qgemm_isa()) {
    case QGEMM_ISA_AMX:
    case QGEMM_ISA_AVX512_VNNI: qgemm_dw_vnni(d); break;
    case QGEMM_ISA_AVXVNNI:
    case QGEMM_ISA_AVX2: qgemm_dw_avx2(d); break;
    default: qgemm_dw_portable(d); break;
    }
}

bool qgemm_dw(const QGemmDw *d) {
    if (qgemm_isa() == QGEMM_ISA_PORTABLE) return qgemm_dw_portable(d);
    if (qgemm_use_vnni() && qgemm_dw_rows_fit(d)) return qgemm_dw_rows_vnni(d);
    const size_t P = (size_t)d->oh_n * d->ow_n;
    QGemmDw one = *d;
    one.codes = NULL, one.in_plane = 0;
    const QGemmIsa isa = qgemm_isa();
    if (!d->in_plane) {
        dw_floats(&one);
    } else if (isa == QGEMM_ISA_AVX2 || isa == QGEMM_ISA_AVXVNNI) { /* every channel in one call: the padding once */
        one.in_plane = d->in_plane;
        qgemm_dw_avx2(&one);
    } else {
        for (int i = 0; i < d->n_oc; i++) {
            one.act = d->act + (size_t)i * d->in_plane, one.oc0 = d->oc0 + i, one.n_oc = 1;
            one.out = d->out + (size_t)i * P;
            dw_floats(&one);
        }
    }
    const QGemmCodesOut *co = d->codes;
    if (!co) return true;
    if (!co->quad_plane) return qgemm_quantize_u8(co->dst, d->out, (size_t)d->n_oc * P, co->q.s, co->q.lo, co->q.hi,
                                                  co->q.zero);
    bool ok = true;
    for (int g = 0; 4 * g < d->n_oc; g++) {
        const float *r[4];
        for (int k = 0; k < 4; k++) r[k] = 4 * g + k < d->n_oc ? d->out + (size_t)(4 * g + k) * P : NULL;
        ok &= qgemm_quantize_u8x4((uint32_t *)(void *)co->dst + (size_t)g * co->quad_plane, 0, r, 0, 1, (int)P, &co->q);
    }
    return ok;
}

void qgemm_gather_u8x4_portable(uint32_t *dst, const uint8_t *const src[4], const size_t step[4], int rows, int n,
                                int stride) {
    for (int h = 0; h < rows; h++) {
        const uint8_t *s0 = src[0] + h * step[0], *s1 = src[1] + h * step[1];
        const uint8_t *s2 = src[2] + h * step[2], *s3 = src[3] + h * step[3];
        uint32_t *d = dst + (size_t)h * n;
        for (int i = 0; i < n; i++) {
            const size_t at = (size_t)i * (size_t)stride;
            d[i] = (uint32_t)s0[at] | (uint32_t)s1[at] << 8 | (uint32_t)s2[at] << 16 | (uint32_t)s3[at] << 24;
        }
    }
}

void qgemm_interleave_u8x4_portable(uint32_t *dst, size_t ldd, const uint8_t *const src[4], size_t lds, int rows,
                                    int n) {
    for (int h = 0; h < rows; h++)
        for (int i = 0; i < n; i++) {
            const size_t at = (size_t)h * lds + (size_t)i;
            dst[(size_t)h * ldd + (size_t)i] = (uint32_t)src[0][at] | (uint32_t)src[1][at] << 8 |
                                               (uint32_t)src[2][at] << 16 | (uint32_t)src[3][at] << 24;
        }
}

void qgemm_interleave_u8x4(uint32_t *dst, size_t ldd, const uint8_t *const src[4], size_t lds, int rows, int n) {
    if (qgemm_isa() != QGEMM_ISA_PORTABLE) qgemm_interleave_u8x4_avx2(dst, ldd, src, lds, rows, n);
    else qgemm_interleave_u8x4_portable(dst, ldd, src, lds, rows, n);
}

void qgemm_gather_u8x4(uint32_t *dst, const uint8_t *const src[4], const size_t step[4], int rows, int n, int stride) {
    if (stride == 2 && qgemm_isa() != QGEMM_ISA_PORTABLE) qgemm_gather_u8x4_s2_avx2(dst, src, step, rows, n);
    else qgemm_gather_u8x4_portable(dst, src, step, rows, n, stride);
}

/* ---- int8 x int8 (quantized training) -------------------------------------------------------------------------- */

void qgemm_s8_ref_ldc(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            int32_t acc = 0;
            for (int k = 0; k < K; k++) acc += (int32_t)a[(size_t)i * K + k] * (int32_t)b[(size_t)j * K + k];
            c[(size_t)i * ldc + j] = acc;
        }
}

void qgemm_s8_ref(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K) {
    qgemm_s8_ref_ldc(c, N, a, b, M, N, K);
}

/* a [n] . b [n]. */
static int32_t dot1_s16(const int16_t *restrict a, const int16_t *restrict b, int n) {
    int32_t s = 0;
    for (int k = 0; k < n; k++) s += (int32_t)a[k] * b[k];
    return s;
}

/* out [4] += a [n] . the four rows of b, QG_KB apart. */
static void dot4_s16(int32_t *restrict out, const int16_t *restrict a, const int16_t *restrict b, int n) {
    const int16_t *restrict b0 = b, *restrict b1 = b + QG_KB;
    const int16_t *restrict b2 = b + 2 * QG_KB, *restrict b3 = b + 3 * QG_KB;
    int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int k = 0; k < n; k++) {
        int32_t x = a[k];
        s0 += x * b0[k];
        s1 += x * b1[k];
        s2 += x * b2[k];
        s3 += x * b3[k];
    }
    out[0] += s0, out[1] += s1, out[2] += s2, out[3] += s3;
}

/* dst (rows, QG_KB) int16 = src (rows, ld) int8, columns [0, n). */
static void widen_rows(int16_t *restrict dst, const int8_t *restrict src, size_t ld, int rows, int n) {
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < n; k++) dst[(size_t)r * QG_KB + k] = src[(size_t)r * ld + k];
}

static void qgemm_s8_portable(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    _Alignas(64) int16_t bw[QG_NB * QG_KB]; /* (QG_NB, QG_KB) the current block of b */
    _Alignas(64) int16_t aw[QG_KB];         /* one row of a over the block's K */
    for (int i = 0; i < M; i++) memset(c + (size_t)i * ldc, 0, (size_t)N * sizeof *c);
    for (int k0 = 0; k0 < K; k0 += QG_KB) {
        int kn = K - k0 < QG_KB ? K - k0 : QG_KB;
        for (int j0 = 0; j0 < N; j0 += QG_NB) {
            int jn = N - j0 < QG_NB ? N - j0 : QG_NB;
            widen_rows(bw, b + (size_t)j0 * K + k0, (size_t)K, jn, kn);
            for (int i = 0; i < M; i++) {
                const int8_t *ar = a + (size_t)i * K + k0; /* [kn] */
                for (int k = 0; k < kn; k++) aw[k] = ar[k];
                int32_t *cr = c + (size_t)i * ldc + j0; /* [jn] */
                int j = 0;
                for (; j + 4 <= jn; j += 4) dot4_s16(cr + j, aw, bw + (size_t)j * QG_KB, kn);
                for (; j < jn; j++) cr[j] += dot1_s16(aw, bw + (size_t)j * QG_KB, kn);
            }
        }
    }
}

void qgemm_s8_nn_ref(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            int32_t acc = 0;
            for (int k = 0; k < K; k++) acc += (int32_t)a[(size_t)i * K + k] * (int32_t)b[(size_t)k * ldb + j];
            c[(size_t)i * ldc + j] = acc;
        }
}

/* The portable qgemm_s8_nn: a block of QG_NB columns of b widened and transposed into the layout of
 * qgemm_s8_portable's, then the same dot products. */
static void qgemm_s8_nn_portable(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N,
                                 int K) {
    _Alignas(64) int16_t bw[QG_NB * QG_KB]; /* (QG_NB, QG_KB) the current block of b, transposed */
    _Alignas(64) int16_t aw[QG_KB];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) c[(size_t)i * ldc + j] = 0;
    for (int k0 = 0; k0 < K; k0 += QG_KB) {
        int kn = K - k0 < QG_KB ? K - k0 : QG_KB;
        for (int j0 = 0; j0 < N; j0 += QG_NB) {
            int jn = N - j0 < QG_NB ? N - j0 : QG_NB;
            for (int k = 0; k < kn; k++)
                for (int j = 0; j < jn; j++) bw[(size_t)j * QG_KB + k] = b[(size_t)(k0 + k) * ldb + j0 + j];
            for (int i = 0; i < M; i++) {
                const int8_t *ar = a + (size_t)i * K + k0; /* [kn] */
                for (int k = 0; k < kn; k++) aw[k] = ar[k];
                int32_t *cr = c + (size_t)i * ldc + j0; /* [jn] */
                int j = 0;
                for (; j + 4 <= jn; j += 4) dot4_s16(cr + j, aw, bw + (size_t)j * QG_KB, kn);
                for (; j < jn; j++) cr[j] += dot1_s16(aw, bw + (size_t)j * QG_KB, kn);
            }
        }
    }
}

void qgemm_s8_nn(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    if (M <= 0 || N <= 0) return;
    const QGemmIsa isa = K > 0 ? qgemm_isa() : QGEMM_ISA_PORTABLE; /* K = 0: the portable loop writes the zeros */
    switch (isa) {
    case QGEMM_ISA_AMX: qgemm_s8_nn_amx(c, ldc, a, b, ldb, M, N, K); break;
    case QGEMM_ISA_AVX512_VNNI: qgemm_s8_nn_vnni(c, ldc, a, b, ldb, M, N, K); break;
    case QGEMM_ISA_AVXVNNI: qgemm_s8_nn_avxvnni(c, ldc, a, b, ldb, M, N, K); break;
    case QGEMM_ISA_AVX2: qgemm_s8_nn_avx2(c, ldc, a, b, ldb, M, N, K); break;
    default: qgemm_s8_nn_portable(c, ldc, a, b, ldb, M, N, K); break;
    }
}

void qgemm_s8_ldc(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int M, int N, int K) {
    if (M <= 0 || N <= 0) return;
    const QGemmIsa isa = K > 0 ? qgemm_isa() : QGEMM_ISA_PORTABLE; /* K = 0: the portable loop writes the zeros */
    switch (isa) {
    case QGEMM_ISA_AMX: qgemm_s8_amx(c, ldc, a, b, M, N, K); break;
    case QGEMM_ISA_AVX512_VNNI: qgemm_s8_vnni(c, ldc, a, b, M, N, K); break;
    case QGEMM_ISA_AVXVNNI: qgemm_s8_avxvnni(c, ldc, a, b, M, N, K); break;
    case QGEMM_ISA_AVX2: qgemm_s8_avx2(c, ldc, a, b, M, N, K); break;
    default: qgemm_s8_portable(c, ldc, a, b, M, N, K); break;
    }
}

void qgemm_s8(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K) {
    qgemm_s8_ldc(c, N, a, b, M, N, K);
}
