/* dist.c - the sums of a data-parallel run in a fixed rank order, over a
 * backend that only moves bytes (dist.h). */
#include "trainer/dist.h"

#include <string.h>
#include <time.h>

/* Below this many bytes a sum goes by one all-gather: one collective's
 * latency instead of two, and on two ranks the same bytes on the wire. */
#define DIST_SMALL_BYTES (64u << 10)

static double dist_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void dist_init_single(Dist *d) {
    memset(d, 0, sizeof *d);
    d->world = 1;
}

void dist_init(Dist *d, int rank, int world, const DistOps *ops, void *ctx) {
    memset(d, 0, sizeof *d);
    d->rank = rank, d->world = world, d->ops = world > 1 ? ops : NULL, d->ctx = ctx;
}

QtStatus dist_bcast(Dist *d, void *buf, size_t bytes, int root, QtError *err) {
    if (!dist_is_multi(d) || bytes == 0) return QT_OK;
    double t0 = dist_now();
    QtStatus st = d->ops->bcast(d->ctx, buf, bytes, root, err);
    d->comm_s += dist_now() - t0;
    if (d->rank == root) d->bytes_sent += bytes;
    return st;
}

QtStatus dist_allgather(Dist *d, const void *mine, size_t bytes, void *all, QtError *err) {
    if (!dist_is_multi(d)) {
        if (all != mine) memmove(all, mine, bytes);
        return QT_OK;
    }
    double t0 = dist_now();
    QtStatus st = d->ops->allgather(d->ctx, mine, bytes, all, err);
    d->comm_s += dist_now() - t0;
    d->bytes_sent += (uint64_t)bytes * (uint64_t)(d->world - 1);
    return st;
}

static QtStatus dist_alltoall(Dist *d, const void *send, void *recv, size_t chunk_bytes, QtError *err) {
    double t0 = dist_now();
    QtStatus st = d->ops->alltoall(d->ctx, send, recv, chunk_bytes, err);
    d->comm_s += dist_now() - t0;
    d->bytes_sent += (uint64_t)chunk_bytes * (uint64_t)(d->world - 1);
    return st;
}

void dist_sum_floats_ref(float *out, const float *v, int world, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float s = v[i];
        for (int r = 1; r < world; r++) s += v[(size_t)r * n + i];
        out[i] = s;
    }
}

static bool dist_small(const Dist *d, size_t n) { return d->world <= 2 || n * sizeof(float) <= DIST_SMALL_BYTES; }

static size_t dist_chunk(const Dist *d, size_t n) { return (n + (size_t)d->world - 1) / (size_t)d->world; }

size_t dist_sum_work_floats(const Dist *d, size_t n) {
    if (!dist_is_multi(d)) return 0;
    return dist_small(d, n) ? (size_t)d->world * n : 2 * (size_t)d->world * dist_chunk(d, n);
}

uint64_t dist_sum_bytes_sent(const Dist *d, size_t n) {
    if (!dist_is_multi(d)) return 0;
    uint64_t others = (uint64_t)(d->world - 1);
    return dist_small(d, n) ? others * n * sizeof(float) : 2 * others * dist_chunk(d, n) * sizeof(float);
}

QtStatus dist_sum_floats(Dist *d, float *buf, size_t n, float *work, QtError *err) {
    if (!dist_is_multi(d) || n == 0) return QT_OK;
    QtStatus st;
    if (dist_small(d, n)) {
        if ((st = dist_allgather(d, buf, n * sizeof(float), work, err)) != QT_OK) return st;
        dist_sum_floats_ref(buf, work, d->world, n);
        return QT_OK;
    }
    /* Reduce-scatter by all-to-all: rank q gets chunk q of every rank and
     * sums it in rank order; then all-gather the summed chunks. */
    size_t chunk = dist_chunk(d, n), padded = chunk * (size_t)d->world;
    float *send = work, *recv = work + padded;
    memcpy(send, buf, n * sizeof(float));
    memset(send + n, 0, (padded - n) * sizeof(float));
    if ((st = dist_alltoall(d, send, recv, chunk * sizeof(float), err)) != QT_OK) return st;
    dist_sum_floats_ref(send, recv, d->world, chunk);
    if ((st = dist_allgather(d, send, chunk * sizeof(float), recv, err)) != QT_OK) return st;
    memcpy(buf, recv, n * sizeof(float));
    return QT_OK;
}

QtStatus dist_sum_doubles(Dist *d, double *buf, size_t n, double *work, QtError *err) {
    if (!dist_is_multi(d) || n == 0) return QT_OK;
    QtStatus st = dist_allgather(d, buf, n * sizeof(double), work, err);
    if (st != QT_OK) return st;
    for (size_t i = 0; i < n; i++) {
        double s = work[i];
        for (int r = 1; r < d->world; r++) s += work[(size_t)r * n + i];
        buf[i] = s;
    }
    return QT_OK;
}

void dist_abort(Dist *d, int code) {
    if (dist_is_multi(d)) d->ops->abort(d->ctx, code);
}
