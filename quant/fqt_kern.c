/* fqt_kern.c - QT's int quantizers (fqt_kern.h): the scalar _ref kernels,
 * the run-time choice between them and the x86 families (fqt_kern_x86.c,
 * called only where CPUID reports the family), and the drivers. */
#include "fqt_kern.h"
#include "fqt_kern_x86.h"

#include <float.h>
#include <math.h>

#include "base/parallel.h"

#include "qarray_plan.h"

/* ---- the scalar rules -------------------------------------------------------------------------------------------- */

bool fqt_absmax_ref(const float *x, size_t n, float *amax) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) return false;
        float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    *amax = m;
    return true;
}

bool fqt_masked_absmax_ref(const float *g, const float *y, size_t n, float *amax) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        const float v = y[i] > 0.0f ? g[i] : 0.0f;
        if (!isfinite(v)) return false;
        const float a = fabsf(v);
        m = a > m ? a : m;
    }
    *amax = m;
    return true;
}

bool fqt_col_absmax_ref(float *amax, const float *g, int rows, int out) {
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < out; o++) {
            float x = g[(size_t)r * out + o];
            if (!isfinite(x)) return false;
            float a = fabsf(x);
            amax[o] = a > amax[o] ? a : amax[o];
        }
    return true;
}

/* One element: qarray_plan_encode's clamp and rounding of a symmetric int plan. */
static inline float quant_one(float x, float s, float u, const FqtRound *r) {
    float v = fminf(fmaxf(x / s, r->qmin), r->qmax);
    return qarray_round_int(v, r->stochastic ? QROUND_STOCHASTIC : QROUND_RNE, u);
}

void fqt_quant_span_ref(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step, const float *u,
                        size_t u_step, const FqtRound *r) {
    for (size_t i = 0; i < n; i++) {
        float si = s[i * (size_t)s_step];
        int32_t c = (int32_t)quant_one(x[i], si, r->stochastic ? u[i * u_step] : 0.0f, r);
        if (q) q[i] = (int8_t)c;
        if (v) v[i] = (float)c * si;
    }
}

void fqt_ste_clip_ref(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi) {
    for (size_t i = 0; i < n; i++) {
        float q = v[i] / s;
        d[i] += q >= lo && q <= hi ? tmp[i] : 0.0f;
    }
}

void fqt_ste_clip_write_ref(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi) {
    for (size_t i = 0; i < n; i++) {
        float q = v[i] / s;
        d[i] = 0.0f + (q >= lo && q <= hi ? tmp[i] : 0.0f);
    }
}

bool fqt_plane_stats_ref(const float *x, size_t n, float *rowmax, float *amax, double *sum) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) return false;
        float a = fabsf(x[i]);
        m = a > m ? a : m;
        if (rowmax) rowmax[i] = a > rowmax[i] ? a : rowmax[i];
    }
    *amax = m;
    *sum = fqt_sum_f64_ref(x, n);
    return true;
}

void fqt_scale_i32_ref(float *y, const int32_t *x, size_t n, float s1, float s2, float b, bool add_b) {
    if (add_b)
        for (size_t i = 0; i < n; i++) y[i] = (float)x[i] * s1 * s2 + b;
    else
        for (size_t i = 0; i < n; i++) y[i] = (float)x[i] * s1 * s2;
}

double fqt_sum_f64_ref(const float *x, size_t n) {
    double a[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) a[k] += x[i + (size_t)k];
    for (int k = 0; i < n; i++, k++) a[k] += x[i];
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}


/* ---- the choice -------------------------------------------------------------------------------------------------- */

#if defined(__x86_64__) || defined(__i386__)
/* The widest family this CPU has (OS support included: __builtin_cpu_supports reads what the kernel enabled). */
static FqtKernFamily cpu_family(void) {
    static int has = -1;
    if (has < 0)
        has = __builtin_cpu_supports("avx512f") ? FQT_KERN_AVX512
              : __builtin_cpu_supports("avx2")  ? FQT_KERN_AVX2
                                                : FQT_KERN_PORTABLE;
    return (FqtKernFamily)has;
}
#else
static FqtKernFamily cpu_family(void) { return FQT_KERN_PORTABLE; }
#endif

static FqtKernFamily cap = FQT_KERN_AVX512;

static FqtKernFamily family(void) { return cpu_family() < cap ? cpu_family() : cap; }

FqtKernFamily fqt_kern_cap(FqtKernFamily max) {
    cap = max;
    return family();
}

const char *fqt_kern_name(void) {
    static const char *const names[] = {"portable", "avx2", "avx512"};
    return names[family()];
}

#if defined(__x86_64__) || defined(__i386__)
#define AT_LEAST(f) (family() >= (f))
#else
#define AT_LEAST(f) false
#endif

bool fqt_absmax(const float *x, size_t n, float *amax) {
    if (AT_LEAST(FQT_KERN_AVX512)) return fqt_absmax_avx512(x, n, amax);
    if (AT_LEAST(FQT_KERN_AVX2)) return fqt_absmax_avx2(x, n, amax);
    return fqt_absmax_ref(x, n, amax);
}

bool fqt_masked_absmax(const float *g, const float *y, size_t n, float *amax) {
    if (AT_LEAST(FQT_KERN_AVX2)) return fqt_masked_absmax_avx2(g, y, n, amax); /* its 8 lanes serve AVX-512 too */
    return fqt_masked_absmax_ref(g, y, n, amax);
}

bool fqt_col_absmax(float *amax, const float *g, int rows, int out) {
    if (AT_LEAST(FQT_KERN_AVX2)) return fqt_col_absmax_avx2(amax, g, rows, out);
    return fqt_col_absmax_ref(amax, g, rows, out);
}

bool fqt_plane_stats(const float *x, size_t n, float *rowmax, float *amax, double *sum) {
    if (AT_LEAST(FQT_KERN_AVX2)) return fqt_plane_stats_avx2(x, n, rowmax, amax, sum);
    return fqt_plane_stats_ref(x, n, rowmax, amax, sum);
}

void fqt_scale_i32(float *y, const int32_t *x, size_t n, float s1, float s2, float b, bool add_b) {
    if (AT_LEAST(FQT_KERN_AVX512)) fqt_scale_i32_avx512(y, x, n, s1, s2, b, add_b);
    else if (AT_LEAST(FQT_KERN_AVX2)) fqt_scale_i32_avx2(y, x, n, s1, s2, b, add_b);
    else fqt_scale_i32_ref(y, x, n, s1, s2, b, add_b);
}

double fqt_sum_f64(const float *x, size_t n) {
    if (AT_LEAST(FQT_KERN_AVX2)) return fqt_sum_f64_avx2(x, n);
    return fqt_sum_f64_ref(x, n);
}

void fqt_ste_clip(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi) {
    if (AT_LEAST(FQT_KERN_AVX512)) fqt_ste_clip_avx512(d, v, tmp, n, s, lo, hi, false);
    else if (AT_LEAST(FQT_KERN_AVX2)) fqt_ste_clip_avx2(d, v, tmp, n, s, lo, hi, false);
    else fqt_ste_clip_ref(d, v, tmp, n, s, lo, hi);
}

void fqt_ste_clip_write(float *d, const float *v, const float *tmp, size_t n, float s, float lo, float hi) {
    if (AT_LEAST(FQT_KERN_AVX512)) fqt_ste_clip_avx512(d, v, tmp, n, s, lo, hi, true);
    else if (AT_LEAST(FQT_KERN_AVX2)) fqt_ste_clip_avx2(d, v, tmp, n, s, lo, hi, true);
    else fqt_ste_clip_write_ref(d, v, tmp, n, s, lo, hi);
}

void fqt_quant_span(int8_t *q, float *v, const float *x, size_t n, const float *s, int s_step, const float *u,
                    size_t u_step, const FqtRound *r) {
    if (AT_LEAST(FQT_KERN_AVX512)) fqt_quant_span_avx512(q, v, x, n, s, s_step, u, u_step, r);
    else if (AT_LEAST(FQT_KERN_AVX2)) fqt_quant_span_avx2(q, v, x, n, s, s_step, u, u_step, r);
    else fqt_quant_span_ref(q, v, x, n, s, s_step, u, u_step, r);
}

/* ---- the drivers ------------------------------------------------------------------------------------------------- */

bool fqt_plan_fast(const QArrayPlan *p) {
    return p->t->kind == QTYPE_KIND_INT && p->t->bits >= 2 && p->t->bits <= 8 && !p->asym && !p->zp_float &&
           !p->mean_abs && p->calib.kind == CALIB_ABSMAX && p->scale_type == QARRAY_SCALE_F32;
}

/* The scale of a slice with max |x| = amax: calib_compute's absmax range (lo = -hi, in double, then float), then
 * the plan's scale; false where calib_compute refuses the range (beyond float). */
static bool amax_scale(const QArrayPlan *p, float amax, float *s) {
    double t = amax > 0.0f ? p->calib.s * amax : 0.0;
    if (!(t <= FLT_MAX)) return false;
    *s = qarray_plan_scale(p, (float)-t, (float)t);
    return true;
}

bool fqt_scale_of_amax(const QArrayPlan *p, float amax, float *s) { return amax_scale(p, amax, s); }

bool fqt_scales_of_amax(const QArrayPlan *p, const float *amax, float *s, size_t n) {
    /* qarray_scale_for_range of a symmetric int plan, inlined: amax / qmax (narrow) or amax / (qmax + 1/2) */
    const float div = p->narrow ? p->qmax : p->qmax + 0.5f;
    const double c = p->calib.s;
    for (size_t i = 0; i < n; i++) {
        const double t = amax[i] > 0.0f ? c * amax[i] : 0.0;
        if (!(t <= FLT_MAX)) return false;
        const float v = (float)t / div;
        s[i] = v >= QARRAY_SCALE_MIN && isfinite(v) ? v : 1.0f;
    }
    return true;
}

static FqtRound plan_round(const QArrayPlan *p, const FqtNoise *z) {
    return (FqtRound){.qmin = p->qmin, .qmax = p->qmax, .stochastic = z && z->u};
}

/* A job over n items in contiguous shares: one task below ~32k elements of work, else one per thread. fn gets its
 * task index (for per-task partials) and its share [lo, hi); ok[task] says whether it met only finite values. */
typedef struct {
    void (*fn)(void *ctx, int task, int lo, int hi, bool *ok);
    void *ctx;
    int n;
    bool ok[PARALLEL_MAX_THREADS];
} Split;

static void split_task(void *arg, int task, int n_tasks) {
    Split *sp = arg;
    int lo, hi;
    parallel_range(sp->n, task, n_tasks, &lo, &hi);
    sp->ok[task] = true;
    if (lo < hi) sp->fn(sp->ctx, task, lo, hi, &sp->ok[task]);
}

static int split_tasks(int n, size_t work) {
    int tasks = work < ((size_t)1 << 15) ? 1 : parallel_get_threads();
    return tasks < n ? tasks : n > 0 ? n : 1;
}

/* Runs the job in `tasks` tasks; true if every task met only finite values. */
static bool split_run(int tasks, int n, void (*fn)(void *, int, int, int, bool *), void *ctx) {
    Split sp = {.fn = fn, .ctx = ctx, .n = n};
    if (tasks <= 1) {
        split_task(&sp, 0, 1);
    } else {
        parallel_run(tasks, split_task, &sp);
    }
    for (int i = 0; i < tasks; i++)
        if (!sp.ok[i]) return false;
    return true;
}

typedef struct {
    int8_t *q;
    float *v, *s, *part;
    const float *x;
    int rows, n;          /* rows: the rows' count; n: a row's length */
    const QArrayPlan *p;
    const FqtNoise *z;
    FqtRound r;
} QuantJob;

static void rows_task(void *ctx, int task, int lo, int hi, bool *ok) {
    (void)task;
    const QuantJob *j = ctx;
    const FqtNoise *z = j->z;
    for (int r = lo; r < hi; r++) {
        const size_t off = (size_t)r * j->n;
        float amax;
        if (!fqt_absmax(j->x + off, (size_t)j->n, &amax) || !amax_scale(j->p, amax, &j->s[r])) {
            *ok = false;
            return;
        }
        const float *u = j->r.stochastic ? z->u + (size_t)r * z->row_step : NULL;
        fqt_quant_span(j->q ? j->q + off : NULL, j->v ? j->v + off : NULL, j->x + off, (size_t)j->n, &j->s[r], 0, u,
                       j->r.stochastic ? z->col_step : 0, &j->r);
    }
}

bool fqt_quant_rows(int8_t *q, float *v, float *s, const float *x, int rows, int n, const QArrayPlan *p,
                    const FqtNoise *z) {
    QuantJob j = {.q = q, .v = v, .s = s, .x = x, .rows = rows, .n = n, .p = p, .z = z, .r = plan_round(p, z)};
    return split_run(split_tasks(rows, (size_t)rows * n), rows, rows_task, &j);
}

/* Column maxima of rows [lo, hi) of the current tile (j->x points at its first row) into part [task][out]. */
static void col_amax_task(void *ctx, int task, int lo, int hi, bool *ok) {
    const QuantJob *j = ctx;
    float *m = j->part + (size_t)task * j->n;
    for (int o = 0; o < j->n; o++) m[o] = 0.0f;
    *ok = fqt_col_absmax(m, j->x + (size_t)lo * j->n, hi - lo, j->n);
}

/* Rows [lo, hi) of the current tile with the tile's column scales j->s [out]; j->rows is the tile's first row
 * in the whole of g (the noise's row index). */
static void cols_quant_task(void *ctx, int task, int lo, int hi, bool *ok) {
    (void)task, (void)ok;
    const QuantJob *j = ctx;
    const FqtNoise *z = j->z;
    for (int r = lo; r < hi; r++) {
        const size_t off = (size_t)r * j->n;
        const float *u = j->r.stochastic ? z->u + (size_t)(j->rows + r) * z->row_step : NULL;
        fqt_quant_span(j->q ? j->q + off : NULL, j->v ? j->v + off : NULL, j->x + off, (size_t)j->n, j->s, 1, u,
                       j->r.stochastic ? z->col_step : 0, &j->r);
    }
}

bool fqt_quant_cols(int8_t *q, float *v, float *s, float *part, const float *x, int rows, int out, int tile,
                    const QArrayPlan *p, const FqtNoise *z) {
    if (tile < 1 || tile > rows) tile = rows > 0 ? rows : 1;
    for (int r0 = 0, t = 0; r0 < rows; r0 += tile, t++) {
        const int n = rows - r0 < tile ? rows - r0 : tile;
        const size_t off = (size_t)r0 * out;
        float *st = s + (size_t)t * out;
        QuantJob j = {.q = q ? q + off : NULL, .v = v ? v + off : NULL, .s = st, .part = part, .x = x + off,
                      .rows = r0, .n = out, .p = p, .z = z, .r = plan_round(p, z)};
        const int tasks = split_tasks(n, (size_t)n * out);
        if (!split_run(tasks, n, col_amax_task, &j)) return false;
        for (int o = 0; o < out; o++) {
            float m = 0.0f;
            for (int k = 0; k < tasks; k++) m = part[(size_t)k * out + o] > m ? part[(size_t)k * out + o] : m;
            if (!amax_scale(p, m, &st[o])) return false;
        }
        split_run(tasks, n, cols_quant_task, &j);
    }
    return true;
}

/* A tensor in chunks of TENSOR_CHUNK elements (the last shorter). */
#define TENSOR_CHUNK 4096

typedef struct {
    int8_t *q;
    float *v, *part, s;
    const float *x;
    size_t n;
    FqtRound r;
} TensorJob;

static void chunk_bounds(const TensorJob *j, int lo, int hi, size_t *a, size_t *b) {
    *a = (size_t)lo * TENSOR_CHUNK;
    *b = (size_t)hi * TENSOR_CHUNK < j->n ? (size_t)hi * TENSOR_CHUNK : j->n;
}

static void tensor_amax_task(void *ctx, int task, int lo, int hi, bool *ok) {
    TensorJob *j = ctx;
    size_t a, b;
    chunk_bounds(j, lo, hi, &a, &b);
    *ok = fqt_absmax(j->x + a, b - a, &j->part[task]);
}

static void tensor_quant_task(void *ctx, int task, int lo, int hi, bool *ok) {
    (void)task, (void)ok;
    const TensorJob *j = ctx;
    size_t a, b;
    chunk_bounds(j, lo, hi, &a, &b);
    fqt_quant_span(j->q ? j->q + a : NULL, j->v ? j->v + a : NULL, j->x + a, b - a, &j->s, 0, NULL, 0, &j->r);
}

bool fqt_quant_tensor(int8_t *q, float *v, float *s, float *part, const float *x, size_t n, const QArrayPlan *p) {
    if (n / TENSOR_CHUNK >= (size_t)INT32_MAX) return false;
    const int chunks = (int)((n + TENSOR_CHUNK - 1) / TENSOR_CHUNK), tasks = split_tasks(chunks, n);
    TensorJob j = {.q = q, .v = v, .part = part, .x = x, .n = n, .r = plan_round(p, NULL)};
    for (int k = 0; k < tasks; k++) part[k] = 0.0f;
    if (chunks > 0 && !split_run(tasks, chunks, tensor_amax_task, &j)) return false;
    float m = 0.0f;
    for (int k = 0; k < tasks; k++) m = part[k] > m ? part[k] : m;
    if (!amax_scale(p, m, &j.s)) return false;
    if (chunks > 0) split_run(tasks, chunks, tensor_quant_task, &j);
    *s = j.s;
    return true;
}

/* ---- the gradient in its (N, OC, P) layout ----------------------------------------------------------------------- */

int fqt_dw_chunk_end(int r0, int rows, int tile) {
    if (tile < 1 || tile > rows) tile = rows;
    long long end = ((long long)r0 / tile + 1) * tile;
    if (end > (long long)r0 + FQT_DW_CHUNK) end = (long long)r0 + FQT_DW_CHUNK;
    return end < rows ? (int)end : rows;
}

typedef struct {
    float *s;
    int8_t *q;
    const float *g;
    int N, OC, P, tile;
    const QArrayPlan *p;
    const FqtNoise *z;
    FqtRound r;
} GradJob;

/* fn over the runs of rows [r0, r1) of column o: each run lies in one image's plane, contiguous in g. */
#define FOR_RUNS(j, o, r0, r1, BODY)                                                                              \
    for (int r_ = (r0); r_ < (r1);) {                                                                             \
        const int n_ = r_ / (j)->P, p_ = r_ % (j)->P;                                                             \
        const int len = (j)->P - p_ < (r1) - r_ ? (j)->P - p_ : (r1) - r_;                                        \
        const float *src = (j)->g + ((size_t)n_ * (j)->OC + (o)) * (j)->P + p_;                                   \
        const int r = r_;                                                                                         \
        BODY;                                                                                                     \
        r_ += len;                                                                                                \
    }

/* Channels [lo, hi): per tile, the column's maximum, then its codes chunk by chunk. */
static void grad_cols_task(void *ctx, int task, int lo, int hi, bool *ok) {
    (void)task;
    const GradJob *j = ctx;
    const int rows = j->N * j->P, tile = j->tile;
    const FqtNoise *z = j->z;
    for (int o = lo; o < hi; o++)
        for (int t0 = 0, t = 0; t0 < rows; t0 += tile, t++) {
            const int t1 = rows - t0 < tile ? rows : t0 + tile;
            float amax = 0.0f, *st = &j->s[(size_t)t * j->OC + o];
            FOR_RUNS(j, o, t0, t1, {
                float a;
                (void)r;
                if (!fqt_absmax(src, (size_t)len, &a)) {
                    *ok = false;
                    return;
                }
                amax = a > amax ? a : amax;
            })
            if (!amax_scale(j->p, amax, st)) {
                *ok = false;
                return;
            }
            for (int c0 = t0; c0 < t1;) {
                const int c1 = fqt_dw_chunk_end(c0, rows, tile), L = c1 - c0;
                int8_t *dst = j->q + (size_t)c0 * j->OC + (size_t)o * L; /* [L] */
                FOR_RUNS(j, o, c0, c1, {
                    const float *u = j->r.stochastic ? z->u + (size_t)r * z->row_step + o * z->col_step : NULL;
                    fqt_quant_span(dst + (r - c0), NULL, src, (size_t)len, st, 0, u,
                                   j->r.stochastic ? z->row_step : 0, &j->r);
                })
                c0 = c1;
            }
        }
}

bool fqt_quant_grad_cols(int8_t *q, float *s, const float *g, int N, int OC, int P, int tile, const QArrayPlan *p,
                         const FqtNoise *z) {
    const int rows = N * P;
    if (tile < 1 || tile > rows) tile = rows > 0 ? rows : 1;
    GradJob j = {.s = s, .q = q, .g = g, .N = N, .OC = OC, .P = P, .tile = tile, .p = p, .z = z,
                 .r = plan_round(p, z)};
    return split_run(split_tasks(OC, (size_t)rows * OC), OC, grad_cols_task, &j);
}
