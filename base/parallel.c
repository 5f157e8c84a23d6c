/* parallel.c - a fixed pool; see parallel.h.
 *
 * A job is published by bumping `generation` under the lock. Idle workers
 * spin on it briefly (a step starts jobs every few hundred microseconds, and
 * a futex wake-up costs tens of them), then sleep on the condition variable.
 * Tasks are claimed from `claim`, which packs the job's generation with the
 * next task index, so a worker that wakes late can never claim a task of a
 * later job: its compare-and-swap carries the generation it saw. The caller
 * runs tasks too and returns once `completed` reaches the task count; it
 * never waits for a worker that has not woken (a busy or descheduled core
 * then only means the caller does more of the work). Job descriptions
 * alternate between two slots, so the one a running task reads is never
 * rewritten under it. */
#include "parallel.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define SPIN_NS 200000 /* how long an idle worker polls before sleeping */

typedef struct {
    _Atomic(ParallelFn) fn;
    _Atomic(void *) ctx;
    atomic_int n_tasks;
} Job;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_uint generation;   /* bumped once per job */
    _Atomic uint64_t claim;   /* generation << 32 | next unclaimed task */
    atomic_int completed;     /* tasks of the current job finished */
    Job jobs[2];              /* the job of generation g is jobs[g & 1] */
    bool stop;                /* under lock: workers exit */
    unsigned start_generation;/* generation when the workers were started: any later one is a job for them */
    int n_workers;            /* threads besides the caller */
    pthread_t workers[PARALLEL_MAX_THREADS];
} Pool;

static Pool pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};
static _Thread_local int thread_index;
static _Thread_local bool in_task;
static bool exit_hook_set;

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e9 * (double)ts.tv_sec + (double)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claims and runs tasks of job `gen` until none is left (or a later job
 * has started, for a worker that woke late). */
static void run_tasks(Pool *p, unsigned gen) {
    const Job *j = &p->jobs[gen & 1];
    ParallelFn fn = atomic_load(&j->fn);
    void *ctx = atomic_load(&j->ctx);
    const int n = atomic_load(&j->n_tasks);
    in_task = true;
    uint64_t c = atomic_load(&p->claim);
    while ((unsigned)(c >> 32) == gen && (int)(uint32_t)c < n) {
        if (!atomic_compare_exchange_weak(&p->claim, &c, c + 1)) continue; /* c reloaded */
        fn(ctx, (int)(uint32_t)c, n);
        atomic_fetch_add(&p->completed, 1);
        c = atomic_load(&p->claim);
    }
    in_task = false;
}

/* The next generation after `seen`, or seen itself if the pool is stopping. */
static unsigned wait_for_job(Pool *p, unsigned seen) {
    double t0 = now_ns();
    for (int spins = 0;; spins++) {
        unsigned g = atomic_load(&p->generation);
        if (g != seen) return g;
        if ((spins & 63) == 63 && now_ns() - t0 > SPIN_NS) break;
        cpu_relax();
    }
    pthread_mutex_lock(&p->lock);
    unsigned g;
    while ((g = atomic_load(&p->generation)) == seen && !p->stop) pthread_cond_wait(&p->wake, &p->lock);
    pthread_mutex_unlock(&p->lock);
    return g;
}

static void *worker_main(void *arg) {
    thread_index = (int)(size_t)arg;
    /* Not the current generation: a job may have been published before this
     * thread got to run, and it may still take part in it. */
    unsigned seen = pool.start_generation;
    for (;;) {
        unsigned g = wait_for_job(&pool, seen);
        if (g == seen) return NULL; /* stopping */
        seen = g;
        run_tasks(&pool, g);
    }
}

static void pool_stop(void) {
    if (pool.n_workers == 0) return;
    pthread_mutex_lock(&pool.lock);
    pool.stop = true;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < pool.n_workers; i++) pthread_join(pool.workers[i], NULL);
    pool.n_workers = 0;
    pool.stop = false;
}

int parallel_set_threads(int threads) {
    if (threads < 1) threads = 1;
    if (threads > PARALLEL_MAX_THREADS) threads = PARALLEL_MAX_THREADS;
    if (threads == pool.n_workers + 1) return threads;
    pool_stop();
    if (!exit_hook_set) exit_hook_set = atexit(pool_stop) == 0;
    pool.start_generation = atomic_load(&pool.generation);
    for (int i = 0; i < threads - 1; i++) {
        if (pthread_create(&pool.workers[i], NULL, worker_main, (void *)(size_t)(i + 1)) != 0) break;
        pool.n_workers++;
    }
    return pool.n_workers + 1;
}

int parallel_get_threads(void) { return pool.n_workers + 1; }
int parallel_thread_index(void) { return thread_index; }
bool parallel_in_task(void) { return in_task; }

static int falling_start(int n, int task, int n_tasks) {
    const long long sq = (long long)n_tasks * n_tasks, rest = n > n_tasks ? n - n_tasks : 0;
    return task + (int)(rest * ((long long)task * (2 * n_tasks - task)) / sq);
}

void parallel_range_falling(int n, int task, int n_tasks, int *lo, int *hi) {
    *lo = falling_start(n, task, n_tasks);
    *hi = falling_start(n, task + 1, n_tasks);
}

void parallel_range(int n, int task, int n_tasks, int *lo, int *hi) {
    long long a = (long long)n * task / n_tasks, b = (long long)n * (task + 1) / n_tasks;
    *lo = (int)a;
    *hi = (int)b;
}

void parallel_run(int n_tasks, ParallelFn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (pool.n_workers == 0 || in_task || n_tasks == 1) {
        bool outer = in_task;
        in_task = true;
        for (int i = 0; i < n_tasks; i++) fn(ctx, i, n_tasks);
        in_task = outer;
        return;
    }
    const unsigned gen = atomic_load(&pool.generation) + 1;
    Job *j = &pool.jobs[gen & 1];
    atomic_store(&j->fn, fn);
    atomic_store(&j->ctx, ctx);
    atomic_store(&j->n_tasks, n_tasks);
    atomic_store(&pool.completed, 0);
    atomic_store(&pool.claim, (uint64_t)gen << 32);
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.generation, gen);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_tasks(&pool, gen);
    while (atomic_load(&pool.completed) < n_tasks) cpu_relax();
}
