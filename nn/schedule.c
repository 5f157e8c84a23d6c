#include "schedule.h"

#include <inttypes.h>
#include <math.h>

static const char *const KIND_NAMES[] = {
    [SCHED_CONSTANT] = "constant",
    [SCHED_COSINE] = "cosine",
    [SCHED_STEP] = "step",
};
#define N_KINDS ((int)(sizeof KIND_NAMES / sizeof KIND_NAMES[0]))

const char *sched_kind_name(SchedKind kind) {
    return (int)kind >= 0 && (int)kind < N_KINDS ? KIND_NAMES[kind] : "unknown";
}

QtStatus sched_kind_parse(const char *name, SchedKind *out, QtError *err) {
    int k = 0;
    QtStatus st = qt_name_lookup("lr schedule", name, KIND_NAMES, N_KINDS, &k, err);
    if (st == QT_OK) *out = (SchedKind)k;
    return st;
}

/* Comparisons are written so that NaN fails them. */
QtStatus lr_schedule_validate(const LrSchedule *s, QtError *err) {
    if (!s) return qt_error_set(err, QT_ERR_ARG, "lr_schedule_validate: no schedule");
    const char *k = sched_kind_name(s->kind);
    if (s->kind != SCHED_CONSTANT && s->kind != SCHED_COSINE && s->kind != SCHED_STEP)
        return qt_error_set(err, QT_ERR_CONFIG, "lr schedule: kind %d is not constant, cosine or step", (int)s->kind);
    if (!(s->base_lr >= 0.0f) || isinf(s->base_lr))
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s lr schedule: base_lr = %g is invalid; it must be a finite number >= 0", k,
                            (double)s->base_lr);
    if (s->warmup_steps < 0)
        return qt_error_set(err, QT_ERR_CONFIG, "%s lr schedule: warmup_steps = %" PRId64 " must be >= 0", k,
                            s->warmup_steps);
    if (s->kind == SCHED_COSINE) {
        if (s->total_steps < s->warmup_steps)
            return qt_error_set(err, QT_ERR_CONFIG,
                                "cosine lr schedule: total_steps = %" PRId64
                                " must be at least warmup_steps = %" PRId64,
                                s->total_steps, s->warmup_steps);
        if (!(s->min_lr >= 0.0f && s->min_lr <= s->base_lr))
            return qt_error_set(err, QT_ERR_CONFIG, "cosine lr schedule: min_lr = %g must be in [0, base_lr = %g]",
                                (double)s->min_lr, (double)s->base_lr);
    }
    if (s->kind == SCHED_STEP) {
        if (s->step_size < 1)
            return qt_error_set(err, QT_ERR_CONFIG, "step lr schedule: step_size = %" PRId64 " must be >= 1",
                                s->step_size);
        if (!(s->gamma > 0.0f) || isinf(s->gamma))
            return qt_error_set(err, QT_ERR_CONFIG, "step lr schedule: gamma = %g must be a finite number > 0",
                                (double)s->gamma);
    }
    return QT_OK;
}

/* Computed in double from the step number alone, then rounded once. */
float lr_schedule_at(const LrSchedule *s, int64_t step) {
    if (step < 0) step = 0;
    double base = (double)s->base_lr;
    if (step < s->warmup_steps) return (float)(base * (double)(step + 1) / (double)s->warmup_steps);
    int64_t after = step - s->warmup_steps;
    switch (s->kind) {
    case SCHED_CONSTANT: break;
    case SCHED_COSINE: {
        double span = (double)(s->total_steps - s->warmup_steps);
        double p = span > 0.0 ? (double)after / span : 1.0;
        if (p > 1.0) p = 1.0;
        double lo = (double)s->min_lr;
        return (float)(lo + 0.5 * (base - lo) * (1.0 + cos(M_PI * p)));
    }
    case SCHED_STEP:
        if (s->step_size >= 1) return (float)(base * pow((double)s->gamma, (double)(after / s->step_size)));
        break;
    }
    return (float)base;
}
