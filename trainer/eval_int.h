/* eval_int.h - a checkpoint's integer program (trainer/intprog.h), made
 * from the run's data and evaluated example by example on the runtime the
 * C export ships (device/qtrain_rt.c): `qtrain eval --integer`. */
#ifndef QTRAIN_TRAINER_EVAL_INT_H
#define QTRAIN_TRAINER_EVAL_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "base/error.h"
#include "trainer/config.h"
#include "trainer/intprog.h"
#include "trainer/run.h"

typedef struct {
    int n;                 /* test examples */
    bool mse;              /* value targets (or data.target: input): loss is the mean squared error */
    int64_t correct;
    double accuracy;       /* NaN for mse */
    double loss;           /* mean cross-entropy of the dequantized logits, or mean squared error */
    float out_scale;       /* the logits' scale and zero point */
    int32_t out_zp;
    size_t arena_bytes;
    double macs;
} IntEvalResult;

/* r (run_init'ed with the checkpoint's config): its data, the checkpoint's model, the output ranges calibrated on
 * quant.calibration_batches training batches, and the program p built from them. run_free(r) and intprog_free(p)
 * afterwards, on success or not. low_ram: as intprog_build's. */
QtStatus eval_int_load(Run *r, const char *checkpoint, IntProgram *p, bool low_ram, QtError *err);
/* Runs p on every example of d (threads: the pool's), scoring against the labels, or with target_input against
 * the float input, or the value targets. logits: (d->n, out_size) int8 output codes, or NULL. */
QtStatus eval_int_run(const IntProgram *p, const Dataset *d, bool target_input, int8_t *logits, IntEvalResult *res,
                      QtError *err);
/* `qtrain eval --integer`: eval_int_load + eval_int_run on the test split; logits_path (or NULL): the int8 output
 * codes (N, out_size) as an int8 .npy file, replacing a regular file. */
QtStatus eval_int_checkpoint(const Config *cfg, const char *checkpoint, const char *logits_path, IntEvalResult *res,
                             QtError *err);

#endif
