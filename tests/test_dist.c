/* test_dist.c - trainer/dist.c's sums over ranks on an in-process backend:
 * `world` threads, each a rank, moving bytes through shared memory. Every
 * path (one all-gather, all-to-all + all-gather) gives every rank the
 * rank-order sum of dist_sum_floats_ref, bit for bit, for sizes around the
 * chunking and the small/large switch. */
#include <CUnit/CUnit.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "test_util.h"
#include "trainer/dist.h"

#define MAX_WORLD 5

/* The shared memory of the threads' job. */
typedef struct {
    int world;
    pthread_barrier_t bar;
    const void *slot[MAX_WORLD]; /* each rank's send buffer, during a collective */
    bool fail_next;              /* the next collective fails on every rank */
} ThreadWorld;

typedef struct {
    ThreadWorld *w;
    int rank;
} ThreadRank;

static QtStatus th_fail(ThreadRank *t, const char *what, QtError *err) {
    pthread_barrier_wait(&t->w->bar);
    return qt_error_set(err, QT_ERR_IO, "rank %d: %s failed (test)", t->rank, what);
}

static QtStatus th_bcast(void *ctx, void *buf, size_t bytes, int root, QtError *err) {
    ThreadRank *t = ctx;
    if (t->w->fail_next) return th_fail(t, "bcast", err);
    if (t->rank == root) t->w->slot[root] = buf;
    pthread_barrier_wait(&t->w->bar);
    if (t->rank != root) memcpy(buf, t->w->slot[root], bytes);
    pthread_barrier_wait(&t->w->bar);
    return QT_OK;
}

static QtStatus th_allgather(void *ctx, const void *mine, size_t bytes, void *all, QtError *err) {
    ThreadRank *t = ctx;
    if (t->w->fail_next) return th_fail(t, "allgather", err);
    t->w->slot[t->rank] = mine;
    pthread_barrier_wait(&t->w->bar);
    for (int r = 0; r < t->w->world; r++) memcpy((char *)all + (size_t)r * bytes, t->w->slot[r], bytes);
    pthread_barrier_wait(&t->w->bar);
    return QT_OK;
}

static QtStatus th_alltoall(void *ctx, const void *send, void *recv, size_t chunk, QtError *err) {
    ThreadRank *t = ctx;
    if (t->w->fail_next) return th_fail(t, "alltoall", err);
    t->w->slot[t->rank] = send;
    pthread_barrier_wait(&t->w->bar);
    for (int p = 0; p < t->w->world; p++)
        memcpy((char *)recv + (size_t)p * chunk, (const char *)t->w->slot[p] + (size_t)t->rank * chunk, chunk);
    pthread_barrier_wait(&t->w->bar);
    return QT_OK;
}

static void th_abort(void *ctx, int code) {
    (void)ctx, (void)code;
    abort();
}

static const DistOps THREAD_OPS = {"threads", th_bcast, th_allgather, th_alltoall, th_abort};

/* One rank's job: sum its vector (rank r's values from the shared seed) and keep the result. */
typedef struct {
    ThreadRank tr;
    size_t n;
    float *in;    /* (world, n): every rank's vector, for the reference */
    float *out;   /* [n]: this rank's result */
    double dsum[3];
    QtStatus st;
    uint64_t bytes;
} RankJob;

static void *rank_main(void *arg) {
    RankJob *j = arg;
    Dist d;
    dist_init(&d, j->tr.rank, j->tr.w->world, &THREAD_OPS, &j->tr);
    float *work = malloc((dist_sum_work_floats(&d, j->n) + 1) * sizeof(float));
    memcpy(j->out, j->in + (size_t)j->tr.rank * j->n, j->n * sizeof(float));
    j->st = dist_sum_floats(&d, j->out, j->n, work, NULL);
    j->bytes = d.bytes_sent;
    if (j->bytes != dist_sum_bytes_sent(&d, j->n)) j->st = QT_ERR_ARG;
    double dwork[3 * MAX_WORLD];
    j->dsum[0] = 0.1 * (j->tr.rank + 1), j->dsum[1] = 1e16, j->dsum[2] = j->tr.rank == 1 ? 1.0 : 0.0;
    if (j->st == QT_OK) j->st = dist_sum_doubles(&d, j->dsum, 3, dwork, NULL);
    free(work);
    return NULL;
}

/* world ranks summing n floats; every rank must hold dist_sum_floats_ref's bits. */
static void check_sum(int world, size_t n) {
    ThreadWorld w = {.world = world};
    pthread_barrier_init(&w.bar, NULL, (unsigned)world);
    float *in = malloc((size_t)world * n * sizeof(float) + 4), *want = malloc(n * sizeof(float) + 4);
    Rng rng;
    rng_init(&rng, 11, (uint64_t)world * 1000003u + n);
    /* values of mixed magnitude, so the order of the sum shows in the bits */
    rng_fill_normal(&rng, in, (size_t)world * n, 0.0f, 1.0f);
    for (size_t i = 0; i < (size_t)world * n; i += 7) in[i] *= 1e4f;
    dist_sum_floats_ref(want, in, world, n);
    RankJob jobs[MAX_WORLD];
    pthread_t th[MAX_WORLD];
    for (int r = 0; r < world; r++) {
        jobs[r] = (RankJob){.tr = {&w, r}, .n = n, .in = in, .out = malloc(n * sizeof(float) + 4)};
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < world; r++) {
        CU_ASSERT_EQUAL(jobs[r].st, QT_OK);
        bool same = memcmp(jobs[r].out, want, n * sizeof(float)) == 0;
        if (!same) fprintf(stderr, "\n  world %d, n %zu: rank %d differs from the rank-order sum\n", world, n, r);
        CU_ASSERT(same);
        double s = 0.0;
        for (int k = 0; k < world; k++) s += 0.1 * (k + 1);
        CU_ASSERT_EQUAL(jobs[r].dsum[0], s);
        CU_ASSERT_EQUAL(jobs[r].dsum[1], 1e16 * world);
        CU_ASSERT_EQUAL(jobs[r].dsum[2], world > 1 ? 1.0 : 0.0);
        free(jobs[r].out);
    }
    pthread_barrier_destroy(&w.bar);
    free(in), free(want);
}

static void test_dist_sum_every_path(void) {
    /* around the chunking (n not a multiple of world), the 64 KiB switch (16384 floats), and large */
    const size_t sizes[] = {1, 2, 3, 7, 100, 16383, 16384, 16385, 50618, 100003};
    for (int world = 1; world <= MAX_WORLD; world++)
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) check_sum(world, sizes[i]);
}

/* The ordering is the point: a different order (rank 2 first) gives other bits for these values, so a sum
 * that ignored the rank order would be caught. */
static void test_dist_sum_order_matters(void) {
    float v[3] = {1e8f, 1.0f, -1e8f}, a, b;
    dist_sum_floats_ref(&a, v, 3, 1);
    float w[3] = {v[2], v[0], v[1]};
    dist_sum_floats_ref(&b, w, 3, 1);
    CU_ASSERT_NOT_EQUAL(a, b);
}

static void test_dist_single(void) {
    Dist d;
    dist_init_single(&d);
    float x[3] = {1, 2, 3};
    CU_ASSERT_EQUAL(dist_sum_work_floats(&d, 3), 0);
    CU_ASSERT_EQUAL(dist_sum_floats(&d, x, 3, NULL, NULL), QT_OK);
    CU_ASSERT(x[0] == 1 && x[1] == 2 && x[2] == 3);
    CU_ASSERT_EQUAL(dist_sum_bytes_sent(&d, 1000), 0);
    CU_ASSERT_EQUAL(d.bytes_sent, 0);
    dist_abort(&d, 1); /* returns in one process */
}

/* A failing collective returns its error on every rank. */
static void *rank_fail(void *arg) {
    RankJob *j = arg;
    Dist d;
    dist_init(&d, j->tr.rank, j->tr.w->world, &THREAD_OPS, &j->tr);
    float x[4] = {0}, work[64];
    QtError e = {0};
    j->st = dist_sum_floats(&d, x, 4, work, &e);
    return NULL;
}

static void test_dist_failure(void) {
    ThreadWorld w = {.world = 3, .fail_next = true};
    pthread_barrier_init(&w.bar, NULL, 3);
    RankJob jobs[3];
    pthread_t th[3];
    for (int r = 0; r < 3; r++) {
        jobs[r] = (RankJob){.tr = {&w, r}};
        pthread_create(&th[r], NULL, rank_fail, &jobs[r]);
    }
    for (int r = 0; r < 3; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < 3; r++) CU_ASSERT_EQUAL(jobs[r].st, QT_ERR_IO);
    pthread_barrier_destroy(&w.bar);
}

int register_dist_suite(void) {
    CU_pSuite s = CU_add_suite("dist", NULL, NULL);
    if (!s) return -1;
    return CU_add_test(s, "sums over 1-5 ranks: every path = the rank-order sum, bit for bit, on every rank",
                       test_dist_sum_every_path) &&
                   CU_add_test(s, "the rank order shows in the bits", test_dist_sum_order_matters) &&
                   CU_add_test(s, "one process: no backend, nothing sent", test_dist_single) &&
                   CU_add_test(s, "a failed collective: the error on every rank", test_dist_failure)
               ? 0
               : -1;
}
