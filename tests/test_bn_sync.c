/* test_bn_sync.c - batch norm over a global batch split across data-parallel ranks (Tape.bn_sync, PyTorch's
 * SyncBatchNorm): `world` threads, each with its own tape and arena and its slice of the batch, gather through
 * an allgather in shared memory (a pthread barrier); their outputs, input gradients, summed parameter
 * gradients and running statistics are held against one tape running the whole batch.
 *
 * Tolerance: the ranks' statistics are merged from per-rank float-lane sums, the whole batch's from one
 * sweep, so values differ by a few float32 roundings (within 1e-7 relative on these cases):
 * |got - want| <= 1e-5 (|want| + max |want|) per array. A missing gather moves the outputs by 1e-1 or more
 * (test_bn_sync_sanity), global sums in dgamma multiply it by the ranks, and the local count in the running
 * update moves running_var by 1e-3 relative or more. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/ops.h"
#include "test_util.h"

#define MAX_WORLD 4
#define MAX_C 8
#define SLOT_CAP 64 /* doubles a rank may gather at once: 1 + 2 * MAX_C */

/* ---- the harness ------------------------------------------------------------------------------------------ */

/* One gather in shared memory: every rank writes its n doubles into its slot, waits for all, copies every
 * slot, and waits again so that no rank's next gather overwrites a slot another is still reading. */
typedef struct {
    pthread_barrier_t barrier;
    int world;
    double slots[MAX_WORLD][SLOT_CAP];
    size_t n[MAX_WORLD];
    int fail_call;          /* 0, or every rank's gather number fail_call (1 = the first) fails, on every rank */
    int calls[MAX_WORLD];   /* gathers each rank made */
    bool mismatch;          /* ranks gathered different lengths, or one called from a pool task */
} SharedGather;

typedef struct {
    SharedGather *g;
    int rank;
} RankGather;

static QtStatus shared_allgather(void *ctx, const double *mine, size_t n, double *all, QtError *err) {
    RankGather *r = ctx;
    SharedGather *g = r->g;
    const int call = ++g->calls[r->rank];
    if (parallel_in_task()) g->mismatch = true; /* a collective inside a pool task */
    if (call == g->fail_call) return qt_error_set(err, QT_ERR_IO, "rank %d: the peer closed the connection", r->rank);
    if (n > SLOT_CAP) return qt_error_set(err, QT_ERR_ARG, "%zu doubles, the test's slots hold %d", n, SLOT_CAP);
    memcpy(g->slots[r->rank], mine, n * sizeof(double));
    g->n[r->rank] = n;
    pthread_barrier_wait(&g->barrier);
    for (int q = 0; q < g->world; q++) {
        if (g->n[q] != n) g->mismatch = true;
        memcpy(all + (size_t)q * n, g->slots[q], n * sizeof(double));
    }
    pthread_barrier_wait(&g->barrier);
    return QT_OK;
}

/* What to run: a batch of N examples of (C) or (C, H, W), split in rank order into parts. */
typedef struct {
    int N, C, H, W;         /* H = W = 0: (N, C) input */
    int world;
    int parts[MAX_WORLD];   /* examples per rank, summing to N */
    bool sync;              /* the ranks' tapes gather (else each normalises its own part) */
    bool training;
    bool frozen;
    bool no_running;        /* the batch norm keeps no running statistics */
    bool x_grad;            /* the input requires a gradient */
    bool relu_add;          /* the output is add(r, r), r = relu in place of the batch norm's */
    bool remake;            /* with relu_add: the batch norm's output dropped and made again for the backward */
    int fail_call;          /* SharedGather.fail_call */
} BnCase;

/* The inputs, shared by every run of a case: x and G (N, C, inner), gamma, beta, the running statistics. */
typedef struct {
    float *x, *G, *gamma, *beta, *rmean, *rvar;
} BnData;

/* What a run leaves: the output and dx of the whole batch (the ranks' slices side by side), per rank the
 * parameter gradients, running statistics, counter, gathers and status. */
typedef struct {
    float *y, *dx;                          /* (N, C, inner) */
    float dgamma[MAX_WORLD][MAX_C], dbeta[MAX_WORLD][MAX_C];
    float rmean[MAX_WORLD][MAX_C], rvar[MAX_WORLD][MAX_C];
    int64_t nbt[MAX_WORLD];
    int calls[MAX_WORLD];
    bool mismatch;
    QtStatus status[MAX_WORLD];
    char msg[MAX_WORLD][QT_ERROR_MSG_MAX];
} BnResult;

typedef struct {
    const BnCase *k;
    const BnData *d;
    BnResult *res;
    RankGather rg;
    int n0; /* the rank's first example */
} RankArg;

static size_t bn_inner(const BnCase *k) { return k->H ? (size_t)k->H * k->W : 1; }

static Var *rank_var(Tape *t, const float *data, int ndim, const int *shape, bool grad) {
    Var *v = tape_new_var(t, ndim, shape);
    if (!v) return NULL;
    memcpy(v->value.data, data, var_numel(v) * sizeof(float));
    v->requires_grad = grad;
    return v;
}

/* One rank's step: its slice through the batch norm (and the remake chain), the backward from its slice of G. */
static void *rank_main(void *arg) {
    RankArg *a = arg;
    const BnCase *k = a->k;
    const BnData *d = a->d;
    const int r = a->rg.rank, nr = k->parts[r], C = k->C;
    const size_t per = (size_t)C * bn_inner(k), off = (size_t)a->n0 * per, len = (size_t)nr * per;
    BnResult *res = a->res;
    Arena arena;
    Tape t;
    arena_init(&arena, 1 << 20);
    tape_init(&t, &arena, NULL, NULL);
    t.training = k->training;
    const TapeSync sync = {.world = k->world, .allgather = shared_allgather, .ctx = &a->rg};
    if (k->sync) t.bn_sync = &sync;
    memcpy(res->rmean[r], d->rmean, (size_t)C * sizeof(float));
    memcpy(res->rvar[r], d->rvar, (size_t)C * sizeof(float));
    res->nbt[r] = 3;
    BatchNormState bn = {res->rmean[r], res->rvar[r], &res->nbt[r], 0.1f, 1e-5f, k->frozen};
    if (k->no_running) bn.running_mean = bn.running_var = NULL;
    const int shape[4] = {nr, C, k->H, k->W};
    Var *x = rank_var(&t, d->x + off, k->H ? 4 : 2, shape, k->x_grad);
    Var *gamma = rank_var(&t, d->gamma, 1, &C, true), *beta = rank_var(&t, d->beta, 1, &C, true);
    Var *out = x && gamma && beta ? nn_batchnorm(&t, x, gamma, beta, &bn) : NULL;
    if (out && k->relu_add) {
        Var *y = out, *relu = nn_relu_inplace(&t, y);
        if (relu && k->remake && !nn_batchnorm_remakeable(&t, y, relu))
            qt_error_set(&t.err, QT_ERR_ARG, "test: the batch norm's output cannot be made remakeable");
        out = tape_ok(&t) ? nn_add(&t, relu, relu) : NULL;
        if (k->remake) tape_drop(&t, relu); /* y's buffer: made again for the relu's backward */
    }
    if (out) memcpy(res->y + off, out->value.data, len * sizeof(float));
    if (out && t.grad_enabled) tape_backward_from(&t, out, d->G + off);
    if (tape_ok(&t) && x->grad) memcpy(res->dx + off, x->grad, len * sizeof(float));
    if (tape_ok(&t) && gamma->grad) memcpy(res->dgamma[r], gamma->grad, (size_t)C * sizeof(float));
    if (tape_ok(&t) && beta->grad) memcpy(res->dbeta[r], beta->grad, (size_t)C * sizeof(float));
    res->status[r] = t.err.status;
    snprintf(res->msg[r], sizeof res->msg[r], "%s", t.err.msg);
    tape_free(&t);
    arena_free(&arena);
    return NULL;
}

/* Runs the case, one thread per rank (the pool held at one thread: its jobs are one caller's at a time). */
static void bn_run(const BnCase *k, const BnData *d, BnResult *res) {
    const size_t n = (size_t)k->N * k->C * bn_inner(k);
    memset(res, 0, sizeof *res);
    res->y = calloc(n, sizeof(float));
    res->dx = calloc(n, sizeof(float));
    CU_ASSERT_FATAL(res->y && res->dx && k->C <= MAX_C && k->world <= MAX_WORLD);
    SharedGather *g = calloc(1, sizeof *g);
    CU_ASSERT_FATAL(g != NULL);
    g->world = k->world;
    g->fail_call = k->fail_call;
    CU_ASSERT_FATAL(pthread_barrier_init(&g->barrier, NULL, (unsigned)k->world) == 0);
    const int threads_before = parallel_get_threads();
    parallel_set_threads(1);
    RankArg args[MAX_WORLD];
    pthread_t tid[MAX_WORLD];
    int n0 = 0;
    for (int r = 0; r < k->world; r++) {
        args[r] = (RankArg){k, d, res, {g, r}, n0};
        n0 += k->parts[r];
    }
    CU_ASSERT_FATAL(n0 == k->N);
    if (k->world == 1) {
        rank_main(&args[0]);
    } else {
        for (int r = 0; r < k->world; r++) CU_ASSERT_FATAL(pthread_create(&tid[r], NULL, rank_main, &args[r]) == 0);
        for (int r = 0; r < k->world; r++) pthread_join(tid[r], NULL);
    }
    parallel_set_threads(threads_before);
    memcpy(res->calls, g->calls, sizeof res->calls);
    res->mismatch = g->mismatch;
    pthread_barrier_destroy(&g->barrier);
    free(g);
}

static void bn_result_free(BnResult *res) {
    free(res->y);
    free(res->dx);
}

static void bn_data_init(BnData *d, const BnCase *k, uint64_t seed) {
    const size_t n = (size_t)k->N * k->C * bn_inner(k);
    d->x = test_random_uniform(n, seed, -1.0f, 3.0f);
    d->G = test_random_uniform(n, seed + 1, -1.0f, 1.0f);
    d->gamma = test_random_uniform((size_t)k->C, seed + 2, 0.5f, 1.5f);
    d->beta = test_random_uniform((size_t)k->C, seed + 3, -1.0f, 1.0f);
    d->rmean = test_random_uniform((size_t)k->C, seed + 4, -0.5f, 0.5f);
    d->rvar = test_random_uniform((size_t)k->C, seed + 5, 0.5f, 2.0f);
    /* channels on different scales and offsets, so a local mean or variance is far from the global one */
    for (size_t i = 0; i < n; i++) {
        const size_t ex = i / ((size_t)k->C * bn_inner(k));
        d->x[i] = d->x[i] * (1.0f + 0.5f * (float)(ex % 3)) + 0.7f * (float)ex;
    }
}

static void bn_data_free(BnData *d) {
    free(d->x);
    free(d->G);
    free(d->gamma);
    free(d->beta);
    free(d->rmean);
    free(d->rvar);
}

/* |a - b| <= 1e-5 (|b| + max |b|) elementwise: 1e-5 relative to each value and to the array's scale. */
#define ASSERT_REL_CLOSE(a, b, n)                                                \
    do {                                                                         \
        double m_ = 0.0;                                                         \
        for (size_t i_ = 0; i_ < (size_t)(n); i_++)                              \
            if (fabs((double)(b)[i_]) > m_) m_ = fabs((double)(b)[i_]);         \
        ASSERT_ALL_CLOSE((a), (b), (n), 1e-5 * m_ + 1e-30, 1e-5);               \
    } while (0)

/* ---- the tests -------------------------------------------------------------------------------------------- */

/* The split run with gathers against the whole batch on one tape: outputs, dx, the ranks' summed dgamma
 * and dbeta, the running statistics and counter (the same bits on every rank), one gather in the forward
 * and one in the backward per rank; then the split run again, bit for bit. */
static void check_against_whole(const BnCase *k, uint64_t seed) {
    BnData d;
    bn_data_init(&d, k, seed);
    BnCase whole = *k;
    whole.world = 1, whole.sync = false, whole.parts[0] = k->N;
    for (int r = 1; r < MAX_WORLD; r++) whole.parts[r] = 0;
    BnResult ref, got, again;
    bn_run(&whole, &d, &ref);
    bn_run(k, &d, &got);
    bn_run(k, &d, &again);
    const size_t n = (size_t)k->N * k->C * bn_inner(k), C = (size_t)k->C;
    CU_ASSERT_EQUAL_FATAL(ref.status[0], QT_OK);
    for (int r = 0; r < k->world; r++) {
        if (got.status[r] != QT_OK) fprintf(stderr, "\n  rank %d: %s\n", r, got.msg[r]);
        CU_ASSERT_EQUAL_FATAL(got.status[r], QT_OK);
        CU_ASSERT_EQUAL(got.calls[r], k->x_grad ? 2 : 1); /* no backward gather without dx */
    }
    CU_ASSERT(!got.mismatch);
    ASSERT_REL_CLOSE(got.y, ref.y, n);
    if (k->x_grad) ASSERT_REL_CLOSE(got.dx, ref.dx, n);
    float dg[MAX_C] = {0}, db[MAX_C] = {0};
    for (int r = 0; r < k->world; r++)
        for (size_t c = 0; c < C; c++) dg[c] += got.dgamma[r][c], db[c] += got.dbeta[r][c];
    ASSERT_REL_CLOSE(dg, ref.dgamma[0], C);
    ASSERT_REL_CLOSE(db, ref.dbeta[0], C);
    for (int r = 0; r < k->world; r++) {
        ASSERT_REL_CLOSE(got.rmean[r], ref.rmean[0], C);
        ASSERT_REL_CLOSE(got.rvar[r], ref.rvar[0], C);
        CU_ASSERT(memcmp(got.rmean[r], got.rmean[0], C * sizeof(float)) == 0);
        CU_ASSERT(memcmp(got.rvar[r], got.rvar[0], C * sizeof(float)) == 0);
        CU_ASSERT_EQUAL(got.nbt[r], 4);
    }
    CU_ASSERT_EQUAL(ref.nbt[0], 4);
    CU_ASSERT(memcmp(got.y, again.y, n * sizeof(float)) == 0);
    CU_ASSERT(memcmp(got.dx, again.dx, n * sizeof(float)) == 0);
    CU_ASSERT(memcmp(got.dgamma, again.dgamma, sizeof got.dgamma) == 0);
    CU_ASSERT(memcmp(got.dbeta, again.dbeta, sizeof got.dbeta) == 0);
    CU_ASSERT(memcmp(got.rvar, again.rvar, sizeof got.rvar) == 0);
    bn_result_free(&ref);
    bn_result_free(&got);
    bn_result_free(&again);
    bn_data_free(&d);
}

static void test_bn_sync_2d(void) {
    /* (N, C, H, W): 2 ranks even, 3 ranks 3/2/2; 5x5 takes the scalar kernels, 6x6 the lane ones */
    check_against_whole(&(BnCase){.N = 4, .C = 3, .H = 5, .W = 5, .world = 2, .parts = {2, 2}, .sync = true,
                                  .training = true, .x_grad = true}, 10);
    check_against_whole(&(BnCase){.N = 7, .C = 3, .H = 6, .W = 6, .world = 3, .parts = {3, 2, 2}, .sync = true,
                                  .training = true, .x_grad = true}, 20);
    check_against_whole(&(BnCase){.N = 7, .C = 5, .H = 4, .W = 4, .world = 3, .parts = {2, 4, 1}, .sync = true,
                                  .training = true, .x_grad = true}, 30);
}

static void test_bn_sync_1d(void) {
    check_against_whole(&(BnCase){.N = 6, .C = 4, .world = 2, .parts = {3, 3}, .sync = true, .training = true,
                                  .x_grad = true}, 40);
    check_against_whole(&(BnCase){.N = 7, .C = 4, .world = 3, .parts = {3, 2, 2}, .sync = true, .training = true,
                                  .x_grad = true}, 50);
    /* one example on a rank: one value per channel there, fine for the global batch of 4 */
    check_against_whole(&(BnCase){.N = 4, .C = 6, .world = 3, .parts = {2, 1, 1}, .sync = true, .training = true,
                                  .x_grad = true}, 60);
    /* an input without a gradient: dgamma and dbeta need no gather */
    check_against_whole(&(BnCase){.N = 5, .C = 4, .world = 2, .parts = {3, 2}, .sync = true, .training = true,
                                  .x_grad = false}, 70);
}

/* The harness itself: without the gathers each rank normalises its own part, far from the whole batch. */
static void test_bn_sync_sanity(void) {
    BnCase k = {.N = 7, .C = 3, .H = 4, .W = 4, .world = 3, .parts = {3, 2, 2}, .sync = false, .training = true,
                .x_grad = true};
    BnData d;
    bn_data_init(&d, &k, 80);
    BnCase whole = k;
    whole.world = 1, whole.parts[0] = k.N, whole.parts[1] = whole.parts[2] = 0;
    BnResult ref, got;
    bn_run(&whole, &d, &ref);
    bn_run(&k, &d, &got);
    const size_t n = (size_t)k.N * k.C * bn_inner(&k);
    for (int r = 0; r < k.world; r++) {
        CU_ASSERT_EQUAL(got.status[r], QT_OK);
        CU_ASSERT_EQUAL(got.calls[r], 0);
    }
    CU_ASSERT(test_close_ratio(got.y, ref.y, n, 1e-1, 0.0, NULL) > 1.0);
    CU_ASSERT(test_close_ratio(got.rmean[0], ref.rmean[0], (size_t)k.C, 1e-2, 0.0, NULL) > 1.0);
    bn_result_free(&ref);
    bn_result_free(&got);
    bn_data_free(&d);
}

/* Eval, frozen on a training tape, and eval without running statistics (local batch statistics, as
 * PyTorch's SyncBatchNorm in eval): no gather, the same bits as the ranks without bn_sync; with running
 * statistics also the whole batch's bits (the running affine map). */
static void test_bn_sync_eval_no_gather(void) {
    for (int form = 0; form < 3; form++) {
        BnCase k = {.N = 5, .C = 3, .H = 2, .W = 2, .world = 2, .parts = {2, 3}, .sync = true,
                    .training = form == 1, .frozen = form == 1, .no_running = form == 2, .x_grad = true};
        BnData d;
        bn_data_init(&d, &k, 90);
        BnCase whole = k, local = k;
        whole.world = 1, whole.sync = false, whole.parts[0] = k.N, whole.parts[1] = 0;
        local.sync = false;
        BnResult ref, loc, got;
        bn_run(&whole, &d, &ref);
        bn_run(&local, &d, &loc);
        bn_run(&k, &d, &got);
        const size_t n = (size_t)k.N * k.C * bn_inner(&k);
        for (int r = 0; r < k.world; r++) {
            CU_ASSERT_EQUAL(got.status[r], QT_OK);
            CU_ASSERT_EQUAL(got.calls[r], 0);
            CU_ASSERT_EQUAL(got.nbt[r], 3);
        }
        CU_ASSERT(memcmp(got.y, loc.y, n * sizeof(float)) == 0);
        CU_ASSERT(memcmp(got.dx, loc.dx, n * sizeof(float)) == 0);
        CU_ASSERT(memcmp(got.dgamma, loc.dgamma, sizeof got.dgamma) == 0);
        if (form < 2) {
            CU_ASSERT(memcmp(got.y, ref.y, n * sizeof(float)) == 0);
            CU_ASSERT(memcmp(got.dx, ref.dx, n * sizeof(float)) == 0);
        }
        bn_result_free(&ref);
        bn_result_free(&loc);
        bn_result_free(&got);
        bn_data_free(&d);
    }
}

/* The output dropped after a relu in place and made again for the backward: the forward's statistics
 * reused (no third gather), the same bits as keeping it. */
static void test_bn_sync_remake(void) {
    BnCase k = {.N = 7, .C = 3, .H = 4, .W = 4, .world = 3, .parts = {3, 2, 2}, .sync = true, .training = true,
                .x_grad = true, .relu_add = true};
    BnData d;
    bn_data_init(&d, &k, 100);
    BnCase kr = k;
    kr.remake = true;
    BnResult keep, remade;
    bn_run(&k, &d, &keep);
    bn_run(&kr, &d, &remade);
    const size_t n = (size_t)k.N * k.C * bn_inner(&k);
    for (int r = 0; r < k.world; r++) {
        CU_ASSERT_EQUAL_FATAL(keep.status[r], QT_OK);
        if (remade.status[r] != QT_OK) fprintf(stderr, "\n  rank %d: %s\n", r, remade.msg[r]);
        CU_ASSERT_EQUAL_FATAL(remade.status[r], QT_OK);
        CU_ASSERT_EQUAL(keep.calls[r], 2);
        CU_ASSERT_EQUAL(remade.calls[r], 2);
    }
    CU_ASSERT(memcmp(remade.y, keep.y, n * sizeof(float)) == 0);
    CU_ASSERT(memcmp(remade.dx, keep.dx, n * sizeof(float)) == 0);
    CU_ASSERT(memcmp(remade.dgamma, keep.dgamma, sizeof keep.dgamma) == 0);
    CU_ASSERT(memcmp(remade.dbeta, keep.dbeta, sizeof keep.dbeta) == 0);
    bn_result_free(&keep);
    bn_result_free(&remade);
    bn_data_free(&d);
}

/* A gather that fails: in the forward nn_batchnorm returns NULL with the tape error naming batchnorm, its
 * channels and the gather's own message; in the backward the backward stops with it. */
static void test_bn_sync_gather_error(void) {
    for (int call = 1; call <= 2; call++) {
        BnCase k = {.N = 5, .C = 3, .H = 4, .W = 4, .world = 2, .parts = {3, 2}, .sync = true, .training = true,
                    .x_grad = true, .fail_call = call};
        BnData d;
        bn_data_init(&d, &k, 110);
        BnResult got;
        bn_run(&k, &d, &got);
        for (int r = 0; r < k.world; r++) {
            CU_ASSERT_EQUAL(got.status[r], QT_ERR_IO);
            CU_ASSERT(strstr(got.msg[r], "batchnorm (3 channels)") != NULL);
            CU_ASSERT(strstr(got.msg[r], call == 1 ? "batch statistics" : "gradient sums") != NULL);
            CU_ASSERT(strstr(got.msg[r], "the peer closed the connection") != NULL);
            CU_ASSERT_EQUAL(got.calls[r], call);
        }
        if (call == 1) { /* nothing normalised, nothing counted */
            CU_ASSERT_EQUAL(got.nbt[0], 3);
            CU_ASSERT(memcmp(got.rmean[0], d.rmean, 3 * sizeof(float)) == 0);
        }
        bn_result_free(&got);
        bn_data_free(&d);
    }
}

/* ---- the pool ----------------------------------------------------------------------------------------------- */

/* One rank whose gather returns `copies` copies of its own contribution (a global batch of identical parts),
 * checking it runs on the calling thread. */
typedef struct {
    int calls;
    bool in_task;
} MirrorGather;

static QtStatus mirror_allgather(void *ctx, const double *mine, size_t n, double *all, QtError *err) {
    (void)err;
    MirrorGather *m = ctx;
    m->calls++;
    m->in_task |= parallel_in_task() || parallel_thread_index() != 0;
    for (int q = 0; q < 2; q++) memcpy(all + (size_t)q * n, mine, n * sizeof(double));
    return QT_OK;
}

/* An (N, C, L) tensor large enough for the pool: the gathers stay on the calling thread between the
 * per-channel phases, and 1 and 2 threads give the same bits. 320 channels: the gathers' scratch (15 KB)
 * comes from the step arena and goes back to the tape's free list. */
static void test_bn_sync_pool(void) {
    enum { N = 4, C = 320, L = 32 };
    const size_t n = (size_t)N * C * L;
    float *x = test_random_uniform(n, 120, -1.0f, 3.0f), *G = test_random_uniform(n, 121, -1.0f, 1.0f);
    float *gm = test_random_uniform(C, 122, 0.5f, 1.5f), *bt = test_random_uniform(C, 123, -1.0f, 1.0f);
    float *out[2][3];
    float rv[2][C];
    const int before = parallel_get_threads();
    for (int th = 0; th < 2; th++) {
        if (parallel_set_threads(th + 1) != th + 1) {
            parallel_set_threads(before);
            test_skip("bn_sync pool: cannot start a second pool thread");
            for (int k = 0; k < 3; k++) free(th ? out[0][k] : NULL);
            free(x), free(G), free(gm), free(bt);
            return;
        }
        TestEnv e;
        test_env_init(&e, 1);
        MirrorGather mg = {0};
        const TapeSync sync = {.world = 2, .allgather = mirror_allgather, .ctx = &mg};
        e.tape.bn_sync = &sync;
        float rmean[C] = {0};
        int64_t nbt = 0;
        for (int c = 0; c < C; c++) rv[th][c] = 1.0f;
        BatchNormState bn = {rmean, rv[th], &nbt, 0.1f, 1e-5f, false};
        Var *xv = test_var(&e, x, 3, (int[]){N, C, L}, true);
        Var *gv = test_var(&e, gm, 1, (int[]){C}, true), *bv = test_var(&e, bt, 1, (int[]){C}, true);
        Var *y = nn_batchnorm(&e.tape, xv, gv, bv, &bn);
        CU_ASSERT_FATAL(y && tape_backward_from(&e.tape, y, G) == QT_OK);
        CU_ASSERT_EQUAL(mg.calls, 2);
        CU_ASSERT(!mg.in_task);
        const float *src[3] = {y->value.data, xv->grad, gv->grad};
        const size_t len[3] = {n, n, C};
        for (int k = 0; k < 3; k++) {
            out[th][k] = malloc(len[k] * sizeof(float));
            memcpy(out[th][k], src[k], len[k] * sizeof(float));
        }
        test_env_free(&e);
    }
    parallel_set_threads(before);
    const size_t len[3] = {n, n, C};
    for (int k = 0; k < 3; k++) {
        CU_ASSERT(memcmp(out[0][k], out[1][k], len[k] * sizeof(float)) == 0);
        free(out[0][k]);
        free(out[1][k]);
    }
    CU_ASSERT(memcmp(rv[0], rv[1], sizeof rv[0]) == 0);
    free(x), free(G), free(gm), free(bt);
}

int register_bn_sync_suite(void) {
    CU_pSuite s = CU_add_suite("bn_sync", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "synced (N, C, H, W) over 2 and 3 ranks = the whole batch", test_bn_sync_2d) ||
           !CU_add_test(s, "synced (N, C) over 2 and 3 ranks = the whole batch", test_bn_sync_1d) ||
           !CU_add_test(s, "unsynced ranks differ from the whole batch", test_bn_sync_sanity) ||
           !CU_add_test(s, "eval and frozen: no gather", test_bn_sync_eval_no_gather) ||
           !CU_add_test(s, "remade output after relu: no gather, same values", test_bn_sync_remake) ||
           !CU_add_test(s, "a failed gather: NULL or a stopped backward, the error named", test_bn_sync_gather_error) ||
           !CU_add_test(s, "on the pool: gathers on the calling thread, 1 and 2 threads agree", test_bn_sync_pool);
}
