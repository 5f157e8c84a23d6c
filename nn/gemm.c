#include "gemm.h"

#include <cblas.h>
#include <stdlib.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "base/parallel.h"

static bool stats_on;
/* One slot per pool thread (parallel_thread_index), a cache line apart. */
static struct {
    _Alignas(64) GemmStats s;
} stats[PARALLEL_MAX_THREADS];

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Below this many FLOPs a product runs whole in the calling thread: a
 * second thread's hand-off costs more than it saves (heads with N = 10,
 * K = 9 first convolutions, rank-8 LoRA projections). */
#define GEMM_SPLIT_MIN_FLOPS 4.0e6
#define GEMM_SPLIT_MIN_ROWS 32 /* rows or columns per part, at least */

typedef struct {
    bool trans_a, trans_b;
    int M, N, K;
    float alpha, beta;
    const float *A, *B;
    float *C;
    int lda, ldb, ldc;
    bool split_rows; /* parts are bands of C's rows; else of its columns */
} GemmJob;

static void sgemm_call(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, float *C, int ldc) {
    double t0 = stats_on ? now_s() : 0.0;
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                alpha, A, lda, B, ldb, beta, C, ldc);
    if (stats_on) {
        GemmStats *st = &stats[parallel_thread_index()].s;
        st->seconds += now_s() - t0;
        st->flops += 2.0 * M * N * K;
        st->calls++;
    }
}

static void gemm_part(void *ctx, int task, int n_tasks) {
    const GemmJob *j = ctx;
    int lo, hi;
    if (j->split_rows) {
        parallel_range(j->M, task, n_tasks, &lo, &hi);
        const float *a = j->trans_a ? j->A + lo : j->A + (size_t)lo * j->lda;
        sgemm_call(j->trans_a, j->trans_b, hi - lo, j->N, j->K, j->alpha, a, j->lda, j->B, j->ldb, j->beta,
                   j->C + (size_t)lo * j->ldc, j->ldc);
    } else {
        parallel_range(j->N, task, n_tasks, &lo, &hi);
        const float *b = j->trans_b ? j->B + (size_t)lo * j->ldb : j->B + lo;
        sgemm_call(j->trans_a, j->trans_b, j->M, hi - lo, j->K, j->alpha, j->A, j->lda, b, j->ldb, j->beta,
                   j->C + lo, j->ldc);
    }
}

void gemm_f32(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
              const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    const double flops = 2.0 * M * N * K;
    int parts = parallel_get_threads();
    if (parallel_in_task() || flops < GEMM_SPLIT_MIN_FLOPS) parts = 1;
    /* Split the longer side: each part then keeps a kind shape. */
    bool rows = M >= N;
    int side = rows ? M : N;
    if (parts > side / GEMM_SPLIT_MIN_ROWS) parts = side / GEMM_SPLIT_MIN_ROWS;
    if (parts <= 1) {
        sgemm_call(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else {
        GemmJob j = {trans_a, trans_b, M, N, K, alpha, beta, A, B, C, lda, ldb, ldc, rows};
        parallel_run(parts, gemm_part, &j);
    }
}

void gemm_f32_ref(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                  const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            double acc = 0.0;
            for (int k = 0; k < K; k++) {
                float a = trans_a ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                float b = trans_b ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
                acc += (double)a * b;
            }
            float *c = &C[(size_t)i * ldc + j];
            /* beta == 0 overwrites, as BLAS does (C may hold garbage). */
            *c = (float)(alpha * acc + (beta == 0.0f ? 0.0 : (double)beta * *c));
        }
    }
}

const char *gemm_blas_core(void) { return openblas_get_corename(); }

const char *gemm_blas_core_upgrade(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    /* libgcc's checks include the OS's XCR0 bits, so zmm state is known saved. */
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl"))
        return NULL;
    static const char *const avx2_families[] = {"Haswell", "Zen", "Sandybridge", "Excavator", "Steamroller",
                                                "Piledriver", "Bulldozer", "Nehalem", "Prescott", "Core2"};
    const char *core = openblas_get_corename();
    for (size_t i = 0; core && i < sizeof avx2_families / sizeof *avx2_families; i++)
        if (strcasecmp(core, avx2_families[i]) == 0) return "SkylakeX";
#endif
    return NULL;
}

void gemm_blas_upgrade_and_exec(char **argv) {
    const char *core = gemm_blas_core_upgrade();
    if (!core || getenv("OPENBLAS_CORETYPE")) return;
    /* Set before the exec, so the new image sees it and never loops. */
    if (setenv("OPENBLAS_CORETYPE", core, 1) != 0) return;
    execv("/proc/self/exe", argv);
    unsetenv("OPENBLAS_CORETYPE"); /* exec failed: nothing changed */
}

/* Debian's OpenBLAS 0.3 (x86_64) maps 128 MiB per buffer (seen in its
 * mmap calls). Measured on tests/configs/tiny-mlp.yaml (2 cores): a run
 * needs 203 MB of address space with OPENBLAS_NUM_THREADS=1 and 351 MB with
 * its default of 2; below, it spins in blas_memory_alloc (or, near 340 MB,
 * HDF5 crashes on a failed allocation). The base covers the libraries,
 * thread stacks and a small run's data with some margin. */
#define GEMM_BASE_MB 112

size_t gemm_address_space_needed_mb(void) {
    int n = openblas_get_num_threads();
    return GEMM_BASE_MB + GEMM_BLAS_BUFFER_MB * (size_t)(n > 1 ? n : 1);
}

void gemm_set_threads(int threads) {
    if (threads <= 0) threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    openblas_set_num_threads(1); /* see parallel.h: the pool splits the work */
    parallel_set_threads(threads);
}
int gemm_get_threads(void) { return parallel_get_threads(); }

void gemm_stats_enable(bool on) { stats_on = on; }
double gemm_stats_start(void) { return stats_on ? now_s() : 0.0; }
void gemm_stats_add(double t0, double flops) {
    if (!stats_on) return;
    GemmStats *st = &stats[parallel_thread_index()].s;
    st->seconds += now_s() - t0;
    st->flops += flops;
    st->calls++;
}
void gemm_stats_reset(void) {
    for (int i = 0; i < PARALLEL_MAX_THREADS; i++) stats[i].s = (GemmStats){0};
}
GemmStats gemm_stats_get(void) {
    GemmStats sum = {0};
    for (int i = 0; i < PARALLEL_MAX_THREADS; i++) {
        sum.calls += stats[i].s.calls;
        sum.seconds += stats[i].s.seconds;
        sum.flops += stats[i].s.flops;
    }
    sum.core_seconds = sum.seconds / (double)parallel_get_threads();
    return sum;
}
