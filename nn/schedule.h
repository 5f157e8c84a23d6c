/* schedule.h - learning-rate schedules: the lr for each optimizer step.
 *
 * Every kind starts with an optional linear warmup,
 *   lr = base_lr * (step + 1) / warmup_steps    for step < warmup_steps,
 * so the first step already moves (PyTorch's LinearLR with start 1/warmup),
 * then continues as:
 *   constant: base_lr
 *   cosine:   min_lr + (base_lr - min_lr) * (1 + cos(pi * p)) / 2, with
 *             p = (step - warmup) / (total - warmup) clamped to [0, 1]
 *   step:     base_lr * gamma^floor((step - warmup) / step_size)
 * The value depends only on the step number, so a resumed run needs no
 * schedule state. */
#ifndef QTRAIN_NN_SCHEDULE_H
#define QTRAIN_NN_SCHEDULE_H

#include <stdint.h>

#include "base/error.h"

typedef enum { SCHED_CONSTANT, SCHED_COSINE, SCHED_STEP } SchedKind;

typedef struct {
    SchedKind kind;
    float base_lr;
    int64_t warmup_steps;  /* linear warmup: lr = base_lr * (step+1)/warmup_steps for step < warmup_steps;
                              applies to every kind; 0 = none */
    int64_t total_steps;   /* cosine: decays from base_lr at step=warmup to min_lr at step=total_steps */
    float min_lr;          /* cosine floor */
    int64_t step_size;     /* step: multiply by gamma every step_size steps after warmup */
    float gamma;
} LrSchedule;

/* "constant", "cosine", "step"; "unknown" outside the enum. */
const char *sched_kind_name(SchedKind kind);
/* Case-insensitive. QT_ERR_ARG, with the valid names in the message, if
 * `name` is not one of them. */
QtStatus sched_kind_parse(const char *name, SchedKind *out, QtError *err);

/* QT_ERR_CONFIG with a message naming the field: base_lr must be finite and
 * >= 0, warmup_steps >= 0; cosine needs total_steps >= warmup_steps (equal:
 * the whole run warms up, the cosine part is empty) and
 * 0 <= min_lr <= base_lr; step needs step_size >= 1 and gamma > 0. */
QtStatus lr_schedule_validate(const LrSchedule *s, QtError *err);

/* The lr of optimizer step `step` (counting from 0; negative counts as 0).
 * Call on a validated schedule. */
float lr_schedule_at(const LrSchedule *s, int64_t step);

#endif
