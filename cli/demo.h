/* demo.h - `qtrain demo`: an end-to-end training run on a synthetic problem
 * that needs no data files, exercising the whole engine (model, tape,
 * AdamW, warmup + cosine schedule, clipping, dropout, eval). */
#ifndef QTRAIN_CLI_DEMO_H
#define QTRAIN_CLI_DEMO_H

#include <stdbool.h>

#include "base/error.h"

typedef struct {
    int steps;      /* optimizer steps */
    int batch_size;
    int log_every;
    unsigned long long seed;
    int threads;    /* OpenBLAS threads */
    bool quiet;     /* no per-step lines */
} DemoOptions;

DemoOptions demo_options_default(void);
/* Returns QT_OK and the final test accuracy in *accuracy. */
QtStatus demo_run(const DemoOptions *opt, double *accuracy, QtError *err);

#endif
