/* qarray_deq.c - QArray dequantize: the row loop (scales fetched a chunk of
 * runs at a time, large ranges split over the step's thread pool), the
 * reference and portable element kernels and the choice among them. The
 * x86 kernels are in qarray_deq_x86.c. */
#include "qarray_deq.h"

#include <stdatomic.h>
#include <string.h>

#include "base/parallel.h"
#include "qarray.h"
#include "qarray_plan.h"

/* Runs per kernel call: the scale and zero-point buffers live on the stack. */
#define DEQ_CHUNK 256
/* Elements per pool task, at least: below it a range runs in the calling thread. */
#define DEQ_TASK_MIN ((size_t)1 << 15)

QDeqLevel qarray_deq_max_level = QDEQ_AVX512;

/* ---- kernels ------------------------------------------------------------------------------------------- */

/* Code i of an MSB-first stream of `bits`-bit codes (bits <= 8). */
static uint32_t code_get(const uint8_t *p, size_t i, int bits) {
    size_t off = i * (size_t)bits, b = off >> 3;
    int sh = (int)(off & 7), end = sh + bits;
    uint32_t w = end <= 8 ? (uint32_t)p[b] << 8 : ((uint32_t)p[b] << 8) | p[b + 1];
    return (w >> (16 - end)) & ((1u << bits) - 1u);
}

void qarray_deq_ref(const QDeqSpan *sp, float *y) {
    for (size_t k = 0; k < sp->n_groups; k++) {
        const float s = sp->scale[k], zp = sp->zp ? sp->zp[k] : 0.0f;
        const size_t e = sp->first + k * sp->glen;
        float *yk = y + k * sp->glen;
        for (size_t j = 0; j < sp->glen; j++) yk[j] = (sp->lut[code_get(sp->codes, e + j, sp->bits)] - zp) * s;
    }
}

/* One run of n codes from element e on, whole bytes at a time where the
 * codes allow it. sub: zp is subtracted; without it the value goes straight
 * into the product, which comes out the same: v - 0 is v for every v, -0
 * included, but a signalling NaN, and the product quiets that alike. */
static void run_portable(const uint8_t *codes, size_t e, size_t n, int bits, const float *lut, float s, float zp,
                         bool sub, float *y) {
    if (bits == 8) {
        const uint8_t *p = codes + e;
        if (sub)
            for (size_t j = 0; j < n; j++) y[j] = (lut[p[j]] - zp) * s;
        else
            for (size_t j = 0; j < n; j++) y[j] = lut[p[j]] * s;
        return;
    }
    if (bits == 4 && e % 2 == 0) {
        const uint8_t *p = codes + e / 2;
        const size_t pairs = n / 2;
        if (sub) {
            for (size_t j = 0; j < pairs; j++) {
                y[2 * j] = (lut[p[j] >> 4] - zp) * s;
                y[2 * j + 1] = (lut[p[j] & 15] - zp) * s;
            }
        } else {
            for (size_t j = 0; j < pairs; j++) {
                y[2 * j] = lut[p[j] >> 4] * s;
                y[2 * j + 1] = lut[p[j] & 15] * s;
            }
        }
        if (n % 2) y[n - 1] = (lut[p[pairs] >> 4] - zp) * s;
        return;
    }
    for (size_t j = 0; j < n; j++) y[j] = (lut[code_get(codes, e + j, bits)] - zp) * s;
}

void qarray_deq_portable(const QDeqSpan *sp, float *y) {
    for (size_t k = 0; k < sp->n_groups; k++)
        run_portable(sp->codes, sp->first + k * sp->glen, sp->glen, sp->bits, sp->lut, sp->scale[k],
                     sp->zp ? sp->zp[k] : 0.0f, sp->zp != NULL, y + k * sp->glen);
}

void qarray_deq_run_tail(const uint8_t *codes, size_t e, size_t n, int bits, const float *lut, float s, float zp,
                         bool sub, float *y) {
    run_portable(codes, e, n, bits, lut, s, zp, sub, y);
}

QDeqCodes qarray_deq_codes_of(const float *lut) {
    bool u8 = true, s8 = true;
    for (int c = 0; c < 256; c++) {
        float u = (float)c, v = (float)(int8_t)(uint8_t)c;
        u8 &= memcmp(&lut[c], &u, sizeof u) == 0;
        s8 &= memcmp(&lut[c], &v, sizeof v) == 0;
    }
    return u8 ? QDEQ_CODES_U8 : s8 ? QDEQ_CODES_S8 : QDEQ_CODES_TABLE;
}

/* ---- choice ------------------------------------------------------------------------------------------- */

QDeqLevel qarray_deq_cpu(void) {
    static atomic_int level = -1; /* every thread that races here computes the same answer */
    if (atomic_load(&level) < 0) {
        int l = QDEQ_PORTABLE;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        /* libgcc checks that the OS saves the ymm / zmm state (XCR0) before reporting these */
        if (__builtin_cpu_supports("avx512f")) l = QDEQ_AVX512;
        else if (__builtin_cpu_supports("avx2")) l = QDEQ_AVX2;
#endif
        atomic_store(&level, l);
    }
    return (QDeqLevel)atomic_load(&level);
}

QDeqLevel qarray_deq_level(void) {
    QDeqLevel cpu = qarray_deq_cpu();
    return qarray_deq_max_level < cpu ? qarray_deq_max_level : cpu;
}

const char *qarray_deq_level_name(QDeqLevel level) {
    static const char *const names[QDEQ_LEVEL_COUNT] = {"ref", "portable", "avx2", "avx512"};
    return (int)level >= 0 && level < QDEQ_LEVEL_COUNT ? names[level] : "unknown";
}

void qarray_deq_run(const QDeqSpan *sp, float *y) {
    switch (qarray_deq_level()) {
    case QDEQ_AVX512: qarray_deq_avx512(sp, y); break;
    case QDEQ_AVX2: qarray_deq_avx2(sp, y); break;
    case QDEQ_PORTABLE: qarray_deq_portable(sp, y); break;
    default: qarray_deq_ref(sp, y); break;
    }
}

/* ---- the row loop ------------------------------------------------------------------------------------- */

typedef struct {
    const QArray *q;
    QArrayLayout L;
    float lut[256];   /* [1 << bits] */
    const float *map; /* the double-quantization map, or NULL */
    QDeqCodes codes_are;
    bool runs_in_order; /* every axis but the last has one scale per index: the runs' scales are 0, 1, 2, ... */
    size_t row0, n_rows;
    float *out;       /* [n_rows * last dim] */
} DeqJob;

/* Scales g .. g + n - 1 -> s [n] and, when asymmetric, zero points -> zp [n]:
 * qarray_scale_at's values, a double-quantized one by the same expression as
 * qarray_dq_scale (so the same bits) with the map looked up once per job. */
static void job_scales(const DeqJob *j, size_t g, size_t n, float *s, float *zp) {
    const QArray *q = j->q;
    if (j->map) {
        const size_t block = (size_t)q->dq.block;
        const double off = q->dq.offset;
        for (size_t i = 0; i < n;) {
            size_t b = (g + i) / block, end = (b + 1) * block - g;
            double a = q->dq.absmax[b];
            for (end = end < n ? end : n; i < end; i++) s[i] = (float)((double)j->map[q->dq.codes[g + i]] * a + off);
        }
    } else if (q->scale_type == QARRAY_SCALE_F32 && q->scale.f32) {
        memcpy(s, q->scale.f32 + g, n * sizeof *s);
    } else {
        for (size_t i = 0; i < n; i++) s[i] = qarray_scale_at(q, g + i);
    }
    for (size_t i = 0; q->asymmetric && i < n; i++) zp[i] = qarray_zero_point_at(q, g + i);
}

static void deq_blocks(const DeqJob *j, size_t r0, size_t r1) {
    const QType *t = j->q->qtype;
    const size_t per_row = j->L.dim[3] / (size_t)t->block, base = j->row0 * per_row;
    for (size_t b = r0 * per_row; b < r1 * per_row; b++)
        qtype_block_dequantize(t, j->q->codes + b * t->block_bytes, t->block, j->out + (b - base) * (size_t)t->block);
}

/* Rows [r0, r1) of the array (absolute indices) into their place in out,
 * DEQ_CHUNK runs per kernel call. */
static void deq_rows(const DeqJob *j, size_t r0, size_t r1) {
    if (qtype_is_block(j->q->qtype)) {
        deq_blocks(j, r0, r1);
        return;
    }
    const QArray *q = j->q;
    const size_t d3 = j->L.dim[3], t3 = j->L.tile[3], per_row = d3 / t3;
    float s[DEQ_CHUNK], zp[DEQ_CHUNK];
    QDeqSpan sp = {.codes = q->codes, .first = r0 * d3, .glen = t3, .bits = q->qtype->bits, .lut = j->lut,
                   .scale = s, .zp = q->asymmetric ? zp : NULL, .codes_are = j->codes_are};
    float *y = j->out + (r0 - j->row0) * d3;
    if (j->runs_in_order) {
        /* run k of the range is scale r0 * per_row + k */
        const size_t g0 = r0 * per_row, n = (r1 - r0) * per_row;
        for (size_t k = 0; k < n; k += sp.n_groups) {
            sp.n_groups = n - k < DEQ_CHUNK ? n - k : DEQ_CHUNK;
            job_scales(j, g0 + k, sp.n_groups, s, zp);
            qarray_deq_run(&sp, y);
            sp.first += sp.n_groups * t3;
            y += sp.n_groups * t3;
        }
        return;
    }
    size_t k = 0;
    for (size_t r = r0; r < r1; r++) {
        size_t g0 = qarray_layout_row_group(&j->L, r);
        for (size_t a = 0; a < d3; a += t3) {
            job_scales(j, g0 + a / t3, 1, s + k, zp + k);
            if (++k < DEQ_CHUNK && (r + 1 < r1 || a + t3 < d3)) continue;
            sp.n_groups = k;
            qarray_deq_run(&sp, y);
            sp.first += k * t3;
            y += k * t3;
            k = 0;
        }
    }
}

static void deq_task(void *ctx, int task, int n_tasks) {
    const DeqJob *j = ctx;
    size_t lo = j->row0 + j->n_rows * (size_t)task / (size_t)n_tasks;
    size_t hi = j->row0 + j->n_rows * (size_t)(task + 1) / (size_t)n_tasks;
    deq_rows(j, lo, hi);
}

static size_t row_count(const QArray *q) {
    if (q->ndim == 0) return 1;
    size_t last = (size_t)q->shape[q->ndim - 1];
    return last ? q->numel / last : 0;
}

QtStatus qarray_dequantize_rows(const QArray *q, size_t row0, size_t n_rows, float *out) {
    size_t rows = q ? row_count(q) : 0;
    if (!q || !q->qtype || row0 > rows || n_rows > rows - row0 || (n_rows && !out)) return QT_ERR_ARG;
    if (!n_rows || !q->numel) return QT_OK;
    DeqJob j = {.q = q, .row0 = row0, .n_rows = n_rows, .out = out};
    qarray_layout_make(&j.L, q->ndim, q->shape, q->tile, q->scale_shape);
    if (!qtype_is_block(q->qtype))
        for (uint32_t c = 0; c < (1u << q->qtype->bits); c++) j.lut[c] = qtype_decode(q->qtype, c);
    if (q->double_quant && !qtype_is_block(q->qtype)) j.map = qarray_dq_map();
    if (q->qtype->bits == 8 && !qtype_is_block(q->qtype)) j.codes_are = qarray_deq_codes_of(j.lut);
    j.runs_in_order = true;
    for (int k = 0; k < 3; k++) j.runs_in_order &= j.L.sdim[k] == j.L.dim[k] && j.L.tile[k] == 1;
    /* every element's value is a function of its code and scale alone, so the split never shows in the result */
    size_t elems = n_rows * j.L.dim[3], tasks = elems / DEQ_TASK_MIN;
    size_t threads = parallel_in_task() ? 1 : (size_t)parallel_get_threads();
    if (tasks > threads) tasks = threads;
    if (tasks > n_rows) tasks = n_rows;
    if (tasks > 1) parallel_run((int)tasks, deq_task, &j);
    else deq_rows(&j, row0, row0 + n_rows);
    return QT_OK;
}

void qarray_dequantize(const QArray *q, float *out) {
    if (q) qarray_dequantize_rows(q, 0, row_count(q), out);
}
