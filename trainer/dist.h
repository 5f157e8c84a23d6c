/* dist.h - data-parallel training over several processes (ranks): the
 * collectives a run needs, on a backend that moves bytes (Open MPI in
 * build/qtrain-mpi: mpi/dist_mpi.c; threads in the tests), and the sums
 * built on them.
 *
 * The backend only moves data (broadcast, all-gather, all-to-all): whatever
 * algorithm it picks, every rank receives the same bytes. The arithmetic is
 * here, in a fixed order: a sum over ranks is ((v0 + v1) + v2) + ... in
 * rank order, element by element, the same bits on every rank, for any
 * message size, any timing and any MPI tuning. That is what makes a run on
 * N ranks bit-reproducible and its stop + resume bit-exact. */
#ifndef QTRAIN_TRAINER_DIST_H
#define QTRAIN_TRAINER_DIST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

/* What a backend provides. Every rank calls the same operations in the same
 * order with the same sizes. A failure returns an error in err; the caller
 * then ends the job (abort): the other ranks may be waiting in a collective. */
typedef struct {
    const char *name; /* "mpi", "threads" */
    /* buf (bytes): root's bytes on every rank. */
    QtStatus (*bcast)(void *ctx, void *buf, size_t bytes, int root, QtError *err);
    /* all (world, bytes): every rank's mine, rank 0's first. */
    QtStatus (*allgather)(void *ctx, const void *mine, size_t bytes, void *all, QtError *err);
    /* send, recv (world, chunk): rank q's recv[p] is rank p's send[q]. */
    QtStatus (*alltoall)(void *ctx, const void *send, void *recv, size_t chunk_bytes, QtError *err);
    /* Ends every rank of the job with status code (a failure on one rank: the others may be blocked in a
       collective). Does not return. */
    void (*abort)(void *ctx, int code);
} DistOps;

typedef struct Dist {
    int rank, world;        /* 0 <= rank < world; world 1: one process, no backend */
    const DistOps *ops;     /* NULL when world is 1 */
    void *ctx;
    /* Counters of the collectives since dist_counters_reset: what a step sent and how long it waited. */
    uint64_t bytes_sent;    /* bytes this rank sent */
    double comm_s;          /* seconds inside collectives */
    /* How a failed run ends (train_run sets them): */
    bool agreed;            /* every rank returned this error (a decision taken together): exit normally */
    bool said_elsewhere;    /* another rank reported the error; say nothing more */
} Dist;

/* One process: rank 0 of 1. Every collective is then a copy or nothing. */
void dist_init_single(Dist *d);
/* A backend's ranks. */
void dist_init(Dist *d, int rank, int world, const DistOps *ops, void *ctx);
static inline bool dist_is_multi(const Dist *d) { return d && d->world > 1; }

QtStatus dist_bcast(Dist *d, void *buf, size_t bytes, int root, QtError *err);
QtStatus dist_allgather(Dist *d, const void *mine, size_t bytes, void *all, QtError *err);

/* buf[0..n) on every rank := the sum over ranks of their buf, in rank
 * order, in float (the same bits on every rank and for every split of the
 * work). Small vectors go by one all-gather (each rank sums all); large
 * ones by all-to-all + all-gather (each rank sums 1/world of the vector:
 * the bandwidth of a ring all-reduce) - the same bits either way. work:
 * dist_sum_work_floats(d, n) floats, the caller's (no allocation here). */
size_t dist_sum_work_floats(const Dist *d, size_t n);
QtStatus dist_sum_floats(Dist *d, float *buf, size_t n, float *work, QtError *err);
/* The same for doubles, by all-gather (small vectors: sums and counts). work: world * n doubles. */
QtStatus dist_sum_doubles(Dist *d, double *buf, size_t n, double *work, QtError *err);

/* The reference sum (tests): out[i] = ((v[0][i] + v[1][i]) + ...) over the world vectors v (world, n). */
void dist_sum_floats_ref(float *out, const float *v, int world, size_t n);

/* The bytes a dist_sum_floats of n floats sends from each rank (for summary.json's allreduce_bytes_per_step
 * and the bench's scaling model). */
uint64_t dist_sum_bytes_sent(const Dist *d, size_t n);

/* Ends every rank (a failure on this one). Returns only for world 1. */
void dist_abort(Dist *d, int code);

#endif
