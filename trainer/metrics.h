/* metrics.h - what a run reports: metrics.csv, the progress bar, JSON.
 *
 * metrics.csv has one row per logged training window and per evaluation:
 *   split,step,epoch,loss,accuracy,lr,samples_per_s,wall_s
 * split is train, val or test. A train.loss: mse run's loss is the mean
 * squared error and its accuracy cell is empty (there are no classes).
 * Every column but the last two is a pure
 * function of the run's state, so a resumed run writes the same rows as an
 * uninterrupted one (samples_per_s and wall_s are timings). */
#ifndef QTRAIN_TRAINER_METRICS_H
#define QTRAIN_TRAINER_METRICS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "base/error.h"

typedef struct {
    FILE *csv;
    char path[1100];
    bool kept_test_row; /* a resume kept a "test" row of step keep_through_step (its evaluation is done) */
} MetricsLog;

/* Opens <dir>/metrics.csv. keep_through_step < 0 starts a new file; >= 0
 * (a resume) keeps the existing rows with step <= keep_through_step and
 * drops later ones (written after the checkpoint by the run that stopped),
 * telling in kept_test_row whether that step's evaluation is among them. */
QtStatus metrics_open(MetricsLog *ml, const char *dir, int64_t keep_through_step, QtError *err);
/* Appends a row and flushes it; QT_ERR_IO (e.g. a full disk) if it fails.
 * A NaN accuracy (an mse run) is written as an empty cell. */
QtStatus metrics_write(MetricsLog *ml, const char *split, int64_t step, double epoch, double loss, double accuracy,
                       double lr, double samples_per_s, double wall_s, QtError *err);
void metrics_close(MetricsLog *ml);

/* One example of a scored set: its anomaly score and whether it is an anomaly. */
typedef struct {
    float score;
    bool positive;
} AucItem;

/* The ROC AUC of items[0..n-1] with the positives as the class a higher
 * score should pick out: the Mann-Whitney statistic U / (P * N), where a
 * positive scored above a negative counts 1 and a tie counts 1/2 (ranks of
 * tied scores averaged). Sorts items in place (no allocation). NaN when
 * the set has no positive or no negative (the AUC is undefined) or a score
 * is not finite. */
double metrics_roc_auc(AucItem *items, int n);

/* A one-line progress bar redrawn in place on a terminal. */
typedef struct {
    FILE *out;          /* NULL = disabled */
    int64_t first_step; /* step the bar's rate is measured from (a resumed run starts mid-way) */
    double t_start, t_last_draw;
    bool drawn;
} Progress;

void progress_init(Progress *p, FILE *out, int64_t first_step, double now);
/* Redraws at most 10 times a second: bar, percent, step/total, rate, ETA, loss. */
void progress_update(Progress *p, int64_t step, int64_t total, double loss, double now);
/* Erases the bar, so a log line can be printed on a clean line. */
void progress_clear(Progress *p);

/* A minimal JSON object writer for summary.json and eval.json: keys in
 * insertion order, numbers printed to round-trip (%.17g), NaN/Inf as null. */
typedef struct {
    FILE *f;
    int n;
} JsonWriter;

void json_begin(JsonWriter *w, FILE *f);
void json_number(JsonWriter *w, const char *key, double v);
void json_int(JsonWriter *w, const char *key, int64_t v);
void json_string(JsonWriter *w, const char *key, const char *v);
void json_end(JsonWriter *w);

/* Monotonic seconds. */
double metrics_now(void);
/* "1h02m", "3m05s", "42s". */
void format_duration(char *buf, size_t cap, double seconds);

#endif
