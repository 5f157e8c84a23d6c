/* dist_mpi.h - the Open MPI backend of trainer/dist.h, linked into
 * build/qtrain-mpi only (make MPI=1): the library and build/qtrain never
 * need MPI. */
#ifndef QTRAIN_MPI_DIST_MPI_H
#define QTRAIN_MPI_DIST_MPI_H

#include "trainer/dist.h"

/* MPI_Init, then d over MPI_COMM_WORLD (its rank and size). Collective
 * failures then return an error to the caller, which ends the job with
 * dist_abort. QT_ERR_IO if MPI cannot start. */
QtStatus dist_mpi_start(int *argc, char ***argv, Dist *d, QtError *err);
/* MPI_Finalize, if dist_mpi_start ran. */
void dist_mpi_stop(void);

#endif
