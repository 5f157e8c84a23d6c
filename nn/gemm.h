/* gemm.h - the one door to sgemm.
 *
 * Every float matrix product in qtrain goes through gemm_f32(), so the
 * benchmark can tell what share of a step is GEMM and the thread policy
 * lives in one place. gemm_f32_ref() is the naive triple loop tests compare
 * against. Row-major, like the rest of nn/. */
#ifndef QTRAIN_NN_GEMM_H
#define QTRAIN_NN_GEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* C (M, N) = alpha * op(A) * op(B) + beta * C.
 * op(A) is (M, K): A is (M, K) with lda >= K, or (K, M) with lda >= M if trans_a.
 * op(B) is (K, N): B is (K, N) with ldb >= N, or (N, K) with ldb >= K if trans_b. */
void gemm_f32(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
              const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);
void gemm_f32_ref(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                  const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);

/* OpenBLAS chooses its kernels once, when it is loaded, from the CPU it
 * recognises. A release older than the CPU falls back to its AVX2 kernels on
 * an AVX-512 machine (0.3.21 on AMD Zen 5 picks "Haswell": half the sgemm
 * throughput). Returns the kernel family to force through
 * OPENBLAS_CORETYPE ("SkylakeX") when the CPU and the OS support AVX-512
 * (F, BW, DQ, VL) but OpenBLAS runs an older family, else NULL. Only a
 * restarted process can act on it (gemm_blas_upgrade_and_exec). */
const char *gemm_blas_core_upgrade(void);
/* If gemm_blas_core_upgrade() names a family and OPENBLAS_CORETYPE is unset,
 * sets it and re-executes /proc/self/exe with argv; returns only when there
 * is nothing to do or the exec failed (the process then carries on with the
 * kernels it has). Set OPENBLAS_CORETYPE yourself to choose, or to opt out. */
void gemm_blas_upgrade_and_exec(char **argv);
/* The kernel family OpenBLAS runs, e.g. "Haswell", "SkylakeX". */
const char *gemm_blas_core(void);

/* The MB OpenBLAS maps per thread (Debian's 0.3, x86_64; gemm.c). */
#define GEMM_BLAS_BUFFER_MB 128
/* The address space (MB) below which OpenBLAS cannot run: it maps a
 * buffer for each of its threads (its own server threads take theirs as
 * they start, before main) and, when that fails, retries forever, so a
 * process under a lower `ulimit -v` spins and never returns, not even from
 * exit (which joins those threads). main refuses to start below it. */
size_t gemm_address_space_needed_mb(void);

/* Threads of the step (1 or more): OpenBLAS is set to one thread and
 * gemm_f32 splits a large product into bands run on the pool of
 * base/parallel.h; products under a few MFLOP run whole. 0 = one per online core. */
void gemm_set_threads(int threads);
int gemm_get_threads(void);

/* Time accounting for the benchmark: off by default (it costs two clock
 * reads per GEMM). Set it outside parallel jobs. */
typedef struct {
    uint64_t calls;  /* sgemm calls (a product split over the pool counts once per part) */
    double seconds;  /* thread-seconds inside sgemm, summed over the pool's threads: divide by
                        threads x wall seconds for the share of the cores' time */
    double flops;    /* 2*M*N*K summed */
    double core_seconds; /* seconds / the pool's threads: the wall time in sgemm if the threads ran their
                            GEMMs side by side (filled by gemm_stats_get) */
} GemmStats;

void gemm_stats_enable(bool on);
void gemm_stats_reset(void);
GemmStats gemm_stats_get(void);
/* The convolutions that multiply without sgemm (nn/conv_taps.h) count as products too: t0 = gemm_stats_start()
 * (0 when off) before one, gemm_stats_add(t0, flops) after it adds the calling thread's seconds, its flops and a
 * call. */
double gemm_stats_start(void);
void gemm_stats_add(double t0, double flops);

#endif
