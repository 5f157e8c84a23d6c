/* bench.h - `qtrain bench`: how fast a config trains and evaluates, set up
 * exactly as a training run (data, model with its quantized base and
 * adapters, optimizer, arena), with nothing written to run.out_dir.
 *
 * Output: greppable lines, `key:value` separated by spaces (see
 * bench/README.md):
 *   bench:config   name, config file, model, mode, batch sizes, threads, params
 *   bench:blas     the OpenBLAS kernel family and thread count
 *   bench:sgemm    (a run that trains) the best rate of a 1024 cube through
 *                  gemm_f32 at the run's threads, timed after everything else
 *   bench:train    samples_per_s, step_ms (timed steps, batch loading included),
 *                  gemm_share (a separate pass with GEMM accounting on),
 *                  macs_per_sample (net_step_macs), bound_samples_per_s (the
 *                  sgemm rate / 2 macs_per_sample: the GEMM-bound limit) and
 *                  of_bound (samples_per_s / that limit)
 *   bench:eval     forward-only samples_per_s at train.eval_batch_size
 *   bench:mem      peak_rss_mb (getrusage), arena_mb (the step arena's capacity)
 *   bench:startup  first_step_s: process start to the start of the first step */
#ifndef QTRAIN_CLI_BENCH_H
#define QTRAIN_CLI_BENCH_H

#include <stdint.h>
#include <stdio.h>

#include "base/error.h"
#include "trainer/config.h"

#define BENCH_DEFAULT_STEPS 100
#define BENCH_DEFAULT_WARMUP 10
#define BENCH_DEFAULT_EVAL_BATCHES 40

typedef struct {
    int steps;          /* timed training steps (>= 1); a config with no training steps (train.epochs: 0)
                           skips the training part */
    int warmup;         /* untimed training steps before them (>= 0) */
    int eval_batches;   /* timed forward-only batches of the test split (>= 0; 0 = no eval part) */
    int64_t since_ns;   /* CLOCK_REALTIME nanoseconds taken by the caller right before starting the
                           process; 0 = take the start from /proc/self/stat (10 ms resolution) */
} BenchOptions;

/* BENCH_DEFAULT_* and since_ns 0. */
BenchOptions bench_options_default(void);

/* Sets cfg's run up as training would (for a fresh start), then runs
 * o->warmup + o->steps training steps and a GEMM-accounting pass of half as
 * many, then o->eval_batches evaluation batches, then (if it trained) times
 * the sgemm, and prints the bench: lines to out. Writes nothing to run.out_dir. A quant.mode ptq config
 * without model.init_from (which training refuses) is benchmarked on the
 * seed's fresh initialisation, written to a temporary checkpoint that is
 * removed again, with a note on out: the speed does not depend on the
 * weights' values. Errors as train_run: QT_ERR_CONFIG for the config's. */
QtStatus bench_run(const Config *cfg, const BenchOptions *o, FILE *out, QtError *err);

#endif
