/* parallel.h - the step's worker threads.
 *
 * qtrain owns its threading: OpenBLAS runs single-threaded and the work of a
 * step is split here, over a fixed pool created once per process
 * (parallel_set_threads). A job is n_tasks calls fn(ctx, task, n_tasks);
 * tasks are handed out dynamically, but each task's work and outputs are a
 * pure function of its index, so results never depend on which thread ran
 * what: a job that reduces writes one partial per task and sums them in task
 * order afterwards. Results do depend on n_tasks; callers derive it from
 * parallel_get_threads() so a fixed thread count gives bit-identical runs.
 *
 * Why not OpenBLAS's own threads: they parallelise only the GEMMs, and
 * between GEMMs its idle worker spins in sched_yield (high system time)
 * while the elementwise work, im2col and pooling run on one core.
 *
 * A job started from inside a task runs serially in the calling thread, so
 * kernels may call parallel code without knowing where they run. */
#ifndef QTRAIN_NN_PARALLEL_H
#define QTRAIN_NN_PARALLEL_H

#include <stdbool.h>

#define PARALLEL_MAX_THREADS 64

typedef void (*ParallelFn)(void *ctx, int task, int n_tasks);

/* Threads of the pool, the caller included (1 = serial, clamped to
 * 1..PARALLEL_MAX_THREADS). Joins the old workers and starts new ones; call
 * it at set-up, never inside a job. Returns the count in effect (fewer if a
 * thread could not be started). */
int parallel_set_threads(int threads);
int parallel_get_threads(void);

/* Runs fn(ctx, i, n_tasks) for every i in [0, n_tasks) and returns when all
 * are done. The caller runs tasks too. */
void parallel_run(int n_tasks, ParallelFn fn, void *ctx);

/* The calling thread's index in the pool: 0 for the thread that called
 * parallel_run (and outside jobs), 1.. for the workers. Per-thread scratch
 * is indexed by it. */
int parallel_thread_index(void);
/* True inside a task: a nested parallel_run would run serially. */
bool parallel_in_task(void);

/* [*lo, *hi): task `task`'s share of n items split into n_tasks nearly equal
 * contiguous ranges. */
void parallel_range(int n, int task, int n_tasks, int *lo, int *hi);
/* The same with falling sizes, for jobs of several tasks per thread: each task
 * one item, and the other n - n_tasks in parts 2 n_tasks - 1, ..., 3, 1 of
 * n_tasks^2, rounded down (n_tasks <= n: no task is empty; at small n the
 * rounding may give a task one item more than the one before). The pool
 * hands tasks out in order, so a job ends on short tasks: the thread that
 * finishes first waits for a small one, not for a whole even share. */
void parallel_range_falling(int n, int task, int n_tasks, int *lo, int *hi);

#endif
