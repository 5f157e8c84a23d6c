/* guard.h - a run's numerical guards: a non-finite loss or gradient
 * (train.on_nonfinite stops the run or drops the step's update) and the
 * divergence watch (train.divergence_factor). */
#ifndef QTRAIN_TRAINER_GUARD_H
#define QTRAIN_TRAINER_GUARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nn/model.h"
#include "nn/tape.h"

/* Exponential running means of the step loss: `fast` over ~10 steps, `slow`
 * over ~100. A divergence is the fast mean above factor x the slow one; it
 * is reported once when it starts and ends when the fast mean falls back. */
typedef struct {
    double fast, slow;     /* raw exponential means (bias-corrected when read) */
    int64_t steps;         /* losses fed */
    bool diverging;        /* inside an occurrence */
    int64_t occurrences;   /* occurrences so far */
} LossWatch;

/* train.on_nonfinite: skip gives up after this many non-finite steps in a
 * row: the model itself is broken then, and skipping cannot mend it. */
#define GUARD_MAX_SKIPS_IN_A_ROW 25

/* Losses before the watch may report: the slow mean must have settled. */
#define LOSS_WATCH_WARMUP 20

/* Feeds one finite step loss. Returns true if this step starts a divergence
 * (factor > 0), with the bias-corrected means in *fast_mean and *slow_mean. */
bool loss_watch_feed(LossWatch *w, double loss, double factor, double *fast_mean, double *slow_mean);

/* Whether every trainable parameter's gradient is finite. If not, `where`
 * (may be NULL)
 * names the parameter nearest the loss (last in model order) whose gradient
 * holds a NaN or infinity: its module, tensor, first bad index and value,
 * and how many of the n tensors are affected. ps: [n]. */
bool guard_grads_finite(Param *const *ps, int n, char *where, size_t cap);

/* Whether every trainable parameter's value is finite (ps: [n]); if not,
 * `where` (may be NULL) names the first one's module, tensor, index and
 * value. Run after each optimizer update: finite gradients can still give a
 * non-finite weight (an overflowing update, a damaged optimizer state), and
 * a ReLU after it can hide the NaN from every later loss and gradient. */
bool guard_params_finite(Param *const *ps, int n, char *where, size_t cap);

/* Runs the forward pass of m on x again, module by module in inference mode
 * (forward only), and names in `where` the first place a non-finite value
 * appears: the input batch, a trainable parameter (ps: [n]), a module's
 * parameter, or a module's output from finite inputs (an overflow). The
 * caller resets the tape before and after. x: (N, input...). */
void guard_locate_nonfinite_forward(Model *m, Tape *t, Var *x, Param *const *ps, int n, char *where, size_t cap);

#endif
