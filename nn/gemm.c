#include "gemm.h"

#include <cblas.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static bool stats_on;
static GemmStats stats;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void gemm_f32(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
              const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    double t0 = stats_on ? now_s() : 0.0;
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                alpha, A, lda, B, ldb, beta, C, ldc);
    if (stats_on) {
        stats.seconds += now_s() - t0;
        stats.flops += 2.0 * M * N * K;
        stats.calls++;
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

void gemm_set_threads(int threads) { openblas_set_num_threads(threads < 1 ? 1 : threads); }
int gemm_get_threads(void) { return openblas_get_num_threads(); }

void gemm_stats_enable(bool on) { stats_on = on; }
void gemm_stats_reset(void) { stats = (GemmStats){0}; }
GemmStats gemm_stats_get(void) { return stats; }
