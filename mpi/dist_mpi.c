/* dist_mpi.c - trainer/dist.h's backend on MPI_COMM_WORLD. It moves bytes
 * only (MPI_Bcast, MPI_Allgather, MPI_Alltoall of MPI_BYTE): whatever
 * algorithm Open MPI picks, every rank receives the same bytes, and
 * dist.c's sums stay in rank order. */
#include "mpi/dist_mpi.h"

#include <limits.h>
#include <mpi.h>
#include <stdio.h>

/* MPI counts are ints: larger messages go in pieces of at most this. */
#define DIST_MPI_PIECE ((size_t)1 << 30)

static QtStatus mpi_failed(int rc, const char *what, size_t bytes, QtError *err) {
    char text[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(rc, text, &len);
    return qt_error_set(err, QT_ERR_IO, "MPI_%s of %zu bytes failed: %s (a rank died, or the network between the "
                        "ranks failed)", what, bytes, text);
}

static QtStatus mpi_bcast(void *ctx, void *buf, size_t bytes, int root, QtError *err) {
    (void)ctx;
    for (size_t off = 0; off < bytes; off += DIST_MPI_PIECE) {
        size_t k = bytes - off < DIST_MPI_PIECE ? bytes - off : DIST_MPI_PIECE;
        int rc = MPI_Bcast((char *)buf + off, (int)k, MPI_BYTE, root, MPI_COMM_WORLD);
        if (rc != MPI_SUCCESS) return mpi_failed(rc, "Bcast", bytes, err);
    }
    return QT_OK;
}

static QtStatus mpi_too_large(const char *what, size_t bytes, QtError *err) {
    return qt_error_set(err, QT_ERR_ARG, "MPI_%s of %zu bytes per rank: more than MPI's int count (%d) allows",
                        what, bytes, INT_MAX);
}

static QtStatus mpi_allgather(void *ctx, const void *mine, size_t bytes, void *all, QtError *err) {
    (void)ctx;
    if (bytes > INT_MAX) return mpi_too_large("Allgather", bytes, err);
    int rc = MPI_Allgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, MPI_COMM_WORLD);
    return rc == MPI_SUCCESS ? QT_OK : mpi_failed(rc, "Allgather", bytes, err);
}

static QtStatus mpi_alltoall(void *ctx, const void *send, void *recv, size_t chunk_bytes, QtError *err) {
    (void)ctx;
    if (chunk_bytes > INT_MAX) return mpi_too_large("Alltoall", chunk_bytes, err);
    int rc = MPI_Alltoall(send, (int)chunk_bytes, MPI_BYTE, recv, (int)chunk_bytes, MPI_BYTE, MPI_COMM_WORLD);
    return rc == MPI_SUCCESS ? QT_OK : mpi_failed(rc, "Alltoall", chunk_bytes, err);
}

static bool started;

static void mpi_abort(void *ctx, int code) {
    (void)ctx;
    started = false; /* no MPI_Finalize after this (dist_mpi_stop runs at exit) */
    fflush(NULL);
    MPI_Abort(MPI_COMM_WORLD, code);
}

static const DistOps DIST_MPI_OPS = {
    .name = "mpi",
    .bcast = mpi_bcast,
    .allgather = mpi_allgather,
    .alltoall = mpi_alltoall,
    .abort = mpi_abort,
};

QtStatus dist_mpi_start(int *argc, char ***argv, Dist *d, QtError *err) {
    int provided = 0;
    /* Only the main thread calls MPI; the thread pool and OpenBLAS never do. */
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return qt_error_set(err, QT_ERR_IO, "MPI_Init failed: run qtrain-mpi under mpirun (Open MPI)");
    started = true;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int rank = 0, world = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    dist_init(d, rank, world, &DIST_MPI_OPS, NULL);
    return QT_OK;
}

void dist_mpi_stop(void) {
    if (started) MPI_Finalize();
    started = false;
}
