/* fqt_shares.c - QT's work over the step's threads (fqt_internal.h): a job of n shares split into tasks, and the
 * int8 products of the forward and the backward (qgemm_s8, qgemm_s8_nn) split so that each task packs its own
 * part of the shared operand. Internal to quant/. */
#include "base/parallel.h"
#include "fqt_internal.h"
#include "qgemm.h"

typedef struct {
    FqtShareFn fn;
    const void *ctx;
    int n;
    bool falling; /* several shares a thread: parallel_range_falling's, which end a job on short ones */
} Shares;

static void share_task(void *arg, int task, int n_tasks) {
    const Shares *sh = arg;
    int lo, hi;
    if (sh->falling) parallel_range_falling(sh->n, task, n_tasks, &lo, &hi);
    else parallel_range(sh->n, task, n_tasks, &lo, &hi);
    if (lo < hi) sh->fn(sh->ctx, lo, hi);
}

/* Shares per thread. The pool hands tasks out as threads free up, so a thread slowed for a while (a busy sibling
 * or a descheduled vCPU) holds a job up by a quarter of its share, not by all of it; the CNN's QT step
 * (bench/configs/cnn-qt.yaml, 2 threads) ran 2-3 % shorter with 4 or 8 than with 1. A product that packs its
 * shared operand once per task (fqt_qgemm_s8's rows or columns) keeps one share per thread. */
#define FQT_SHARES_PER_THREAD 4

static void shares_run_n(int n, size_t work, FqtShareFn fn, const void *ctx, int per_thread) {
    const int threads = parallel_get_threads();
    int tasks = work < ((size_t)1 << 15) ? 1 : threads > 1 ? threads * per_thread : 1;
    if (tasks > n) tasks = n;
    if (tasks <= 1) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    Shares sh = {fn, ctx, n, per_thread > 1};
    parallel_run(tasks, share_task, &sh);
}

void fqt_shares_run(int n, size_t work, FqtShareFn fn, const void *ctx) {
    shares_run_n(n, work, fn, ctx, FQT_SHARES_PER_THREAD);
}

/* c (M, N) = a (M, K) b (N, K)^T in int8, rows [lo, hi) of a and c. */
typedef struct {
    int32_t *c;
    const int8_t *a, *b;
    int N, K, M;
} S8Job;

static void s8_part(const void *ctx, int lo, int hi) {
    const S8Job *j = ctx;
    qgemm_s8(j->c + (size_t)lo * j->N, j->a + (size_t)lo * j->K, j->b, hi - lo, j->N, j->K);
}

/* Columns [lo * S8_COLS, hi * S8_COLS) of b and c: the task packs only its own columns of b. */
#define S8_COLS 16 /* a panel of the VNNI kernels (two of the AVX2 ones); the split changes no sum */

static void s8_cols_part(const void *ctx, int lo, int hi) {
    const S8Job *j = ctx;
    const int j0 = lo * S8_COLS, j1 = hi * S8_COLS < j->N ? hi * S8_COLS : j->N;
    qgemm_s8_ldc(j->c + j0, j->N, j->a, j->b + (size_t)j0 * j->K, j->M, j1 - j0, j->K);
}

void fqt_qgemm_s8(int32_t *c, const int8_t *a, const int8_t *b, int M, int N, int K) {
    S8Job j = {c, a, b, N, K, M};
    /* the work in units that make a split worth it at about 2^20 multiply-adds. Split by rows, each share packs
     * all of b; by columns, each packs its own part and streams all of a. With 64 columns or more on the 512-bit
     * families, the columns: a 32-column share is one pass of their 48-column blocks where 64 columns took two,
     * so a is streamed as often as before and b packed once instead of once a thread (the QT weight gradient's
     * g, the dense forward's weight): the CNN's QT step 0.974 paired on a Zen 5. The 256-bit families pack 8
     * columns at a time and gained nothing (1.010), so they keep the rows. */
    const QGemmIsa isa = qgemm_isa();
    if (N >= 64 && (isa == QGEMM_ISA_AVX512_VNNI || isa == QGEMM_ISA_AMX))
        shares_run_n((N + S8_COLS - 1) / S8_COLS, (size_t)M * N * K >> 5, s8_cols_part, &j, 1);
    else shares_run_n(M, (size_t)M * N * K >> 5, s8_part, &j, 1);
}

/* c (M, N) = a (M, K) b (K, N) in int8, columns [lo * S8_NN_COLS, hi * S8_NN_COLS) of b and c: each thread packs
 * only its own columns of b. */
#define S8_NN_COLS 48 /* whole panels of the VNNI kernels (16) and the AVX2 ones (8); the split changes no sum */

typedef struct {
    int32_t *c;
    const int8_t *a, *b;
    int ldc, ldb, M, N, K;
} S8NnJob;

static void s8_nn_part(const void *ctx, int lo, int hi) {
    const S8NnJob *j = ctx;
    const int j0 = lo * S8_NN_COLS, j1 = hi * S8_NN_COLS < j->N ? hi * S8_NN_COLS : j->N;
    qgemm_s8_nn(j->c + j0, j->ldc, j->a, j->b + j0, j->ldb, j->M, j1 - j0, j->K);
}

void fqt_qgemm_s8_nn(int32_t *c, int ldc, const int8_t *a, const int8_t *b, int ldb, int M, int N, int K) {
    S8NnJob j = {c, a, b, ldc, ldb, M, N, K};
    fqt_shares_run((N + S8_NN_COLS - 1) / S8_NN_COLS, (size_t)M * N * K >> 5, s8_nn_part, &j);
}
