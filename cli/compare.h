/* compare.h - `qtrain compare DIR...`: runs side by side.
 *
 * Each run directory's summary.json and metrics.csv give one row (run,
 * mode, weight/activation/backward formats, bits per base parameter, model
 * bytes, test accuracy, its difference from the first float run, training
 * samples/s, wall time) and one training-loss curve. A train.loss: mse run
 * has no accuracy: its test mse stands in the accuracy's column (the header
 * says which), its difference is taken from the first float mse run, and
 * when every run is one the chart plots test mse instead of accuracy. The
 * table goes to a stream and, with the chart, into an output directory:
 *   compare.md    the table in Markdown, and a link to the chart
 *   compare.svg   accuracy (or mse) against bits per parameter (log2 axis),
 *                 and the training-loss curves of all runs against the step */
#ifndef QTRAIN_CLI_COMPARE_H
#define QTRAIN_CLI_COMPARE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "base/error.h"

#define COMPARE_MAX_RUNS 32

typedef struct {
    char dir[1024];
    char name[64], mode[16];
    char weights[256], acts[128], bwd[32]; /* formats, "float32" / "none" when absent */
    double bits_per_param;                 /* 32 for a float run */
    int64_t model_bytes;
    double test_accuracy;                  /* NaN if missing (and for an mse run) */
    bool mse;                              /* a train.loss: mse run: test_mse reports it */
    double test_mse;                       /* NaN if missing */
    double samples_per_s, wall_s;
    double *steps, *losses;                /* [n_points] the metrics.csv train rows */
    int n_points;
} CompareRun;

/* Reads dir/summary.json and dir/metrics.csv. A missing or malformed file
 * is QT_ERR_IO / QT_ERR_FORMAT naming it (a run that has not finished has
 * no summary.json). */
QtStatus compare_load_run(CompareRun *r, const char *dir, QtError *err);
void compare_run_free(CompareRun *r);

/* Prints the table to `table` (may be NULL) and writes out_dir/compare.md
 * and out_dir/compare.svg (out_dir is created if needed; a symlink there is
 * refused). Each file must be new or a regular file, which is replaced
 * (fs_check_out_path: never a symlink, device or FIFO); both are checked
 * before either is written. */
QtStatus compare_write(const CompareRun *runs, int n, const char *out_dir, FILE *table, QtError *err);

#endif
