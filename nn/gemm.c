#include "gemm.h"

#include <cblas.h>
#include <time.h>

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

void gemm_set_threads(int threads) { openblas_set_num_threads(threads < 1 ? 1 : threads); }
int gemm_get_threads(void) { return openblas_get_num_threads(); }

void gemm_stats_enable(bool on) { stats_on = on; }
void gemm_stats_reset(void) { stats = (GemmStats){0}; }
GemmStats gemm_stats_get(void) { return stats; }
