/* metrics.c - metrics.csv, the progress bar, and a small JSON writer. */
#include "metrics.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/fsutil.h"

#define METRICS_HEADER "split,step,epoch,loss,accuracy,lr,samples_per_s,wall_s\n"

double metrics_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void format_duration(char *buf, size_t cap, double seconds) {
    long s = seconds > 0 && seconds < 1e9 ? (long)(seconds + 0.5) : 0;
    if (s >= 3600) snprintf(buf, cap, "%ldh%02ldm", s / 3600, s / 60 % 60);
    else if (s >= 60) snprintf(buf, cap, "%ldm%02lds", s / 60, s % 60);
    else snprintf(buf, cap, "%lds", s);
}

/* Copies the rows of an existing metrics.csv with step <= keep into `out`.
 * A missing file is not an error: the resumed run may use a new out_dir. A
 * last line without its newline is a row cut short (the disk filled up or
 * the run was killed while appending it): its step may be cut short too, so
 * it is dropped rather than kept as a bogus row that the next one would
 * continue. */
static bool metrics_copy_rows(FILE *out, const char *path, int64_t keep) {
    FILE *in = fopen(path, "r");
    bool test_at_keep = false;
    if (!in) return false;
    char line[512];
    bool header = true;
    while (fgets(line, sizeof line, in)) {
        size_t len = strlen(line);
        if (header || len == 0 || line[len - 1] != '\n') {
            header = false;
            continue;
        }
        const char *comma = strchr(line, ',');
        char *end = NULL;
        long long step = comma ? strtoll(comma + 1, &end, 10) : -1;
        if (comma && end != comma + 1 && step <= keep) fputs(line, out);
        test_at_keep |= comma && end != comma + 1 && step == keep && strncmp(line, "test,", 5) == 0;
    }
    fclose(in);
    return test_at_keep;
}

/* What a user can do about a failed write, by errno. */
static const char *write_hint(int e) {
    static _Thread_local char big[160];
    if (e == EFBIG) return qt_file_too_large_hint(big, sizeof big);
    if (e == ENOSPC || e == EDQUOT) return "free disk space or change run.out_dir";
    if (e == EACCES || e == EPERM || e == EROFS || e == ENOENT || e == ENOTDIR)
        return "make run.out_dir a writable directory";
    return "check the disk and run.out_dir";
}

QtStatus metrics_open(MetricsLog *ml, const char *dir, int64_t keep_through_step, QtError *err) {
    memset(ml, 0, sizeof *ml);
    snprintf(ml->path, sizeof ml->path, "%s/metrics.csv", dir);
    char tmp[sizeof ml->path + 32];
    FILE *f = fs_fopen_tmp(ml->path, tmp, sizeof tmp); /* never through a symlink planted under the temp name */
    if (!f) {
        int e = errno;
        return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; %s", tmp, strerror(e), write_hint(e));
    }
    fputs(METRICS_HEADER, f);
    if (keep_through_step >= 0) ml->kept_test_row = metrics_copy_rows(f, ml->path, keep_through_step);
    /* ferror: a write that failed while copying, before this flush, is sticky. */
    errno = 0;
    if (fflush(f) != 0 || ferror(f) || rename(tmp, ml->path) != 0) {
        int e = errno ? errno : EIO;
        fclose(f);
        remove(tmp);
        return qt_error_set(err, QT_ERR_IO, "cannot write %s: %s; %s", ml->path, strerror(e), write_hint(e));
    }
    /* The renamed file stays open: rows are appended to the real name. */
    ml->csv = f;
    return QT_OK;
}

QtStatus metrics_write(MetricsLog *ml, const char *split, int64_t step, double epoch, double loss, double accuracy,
                       double lr, double samples_per_s, double wall_s, QtError *err) {
    if (!ml->csv) return QT_OK;
    char acc[32] = ""; /* empty for an mse run: pandas reads it as NaN, and no reader of the file takes "nan" */
    if (!isnan(accuracy)) snprintf(acc, sizeof acc, "%.9g", accuracy);
    int n = fprintf(ml->csv, "%s,%" PRId64 ",%.4f,%.9g,%s,%.9g,%.1f,%.3f\n", split, step, epoch, loss, acc, lr,
                    samples_per_s, wall_s);
    if (n >= 0 && fflush(ml->csv) == 0) return QT_OK;
    int e = errno;
    return qt_error_set(err, QT_ERR_IO, "cannot append to %s: %s; %s", ml->path, strerror(e), write_hint(e));
}

void metrics_close(MetricsLog *ml) {
    if (ml->csv) fclose(ml->csv);
    ml->csv = NULL;
}

static int auc_item_cmp(const void *a, const void *b) {
    float x = ((const AucItem *)a)->score, y = ((const AucItem *)b)->score;
    return (x > y) - (x < y);
}

double metrics_roc_auc(AucItem *items, int n) {
    int64_t pos = 0;
    for (int i = 0; i < n; i++) {
        if (!isfinite(items[i].score)) return NAN;
        pos += items[i].positive;
    }
    int64_t neg = n - pos;
    if (pos == 0 || neg == 0) return NAN;
    qsort(items, (size_t)n, sizeof *items, auc_item_cmp);
    /* The positives' rank sum (ranks 1..n, a tie's ranks averaged), in halves to stay integral. */
    int64_t rank2_sum = 0;
    for (int i = 0; i < n;) {
        int j = i, tied_pos = 0;
        while (j < n && items[j].score == items[i].score) tied_pos += items[j++].positive;
        rank2_sum += (int64_t)tied_pos * (int64_t)(i + 1 + j); /* twice the mean rank (i+1 + j) / 2 */
        i = j;
    }
    double u = (double)rank2_sum / 2.0 - (double)pos * (double)(pos + 1) / 2.0;
    return u / ((double)pos * (double)neg);
}

void progress_init(Progress *p, FILE *out, int64_t first_step, double now) {
    *p = (Progress){.out = out, .first_step = first_step, .t_start = now, .t_last_draw = -1.0};
}

void progress_update(Progress *p, int64_t step, int64_t total, double loss, double now) {
    if (!p->out || total <= 0 || (now - p->t_last_draw < 0.1 && step < total)) return;
    enum { WIDTH = 30 };
    double frac = (double)step / (double)total;
    int filled = (int)(frac * WIDTH);
    char bar[WIDTH + 1];
    for (int i = 0; i < WIDTH; i++) bar[i] = i < filled ? '=' : (i == filled ? '>' : ' ');
    bar[WIDTH] = '\0';
    double rate = (double)(step - p->first_step) / (now - p->t_start + 1e-9);
    char eta[32] = "?";
    if (rate > 0) format_duration(eta, sizeof eta, (double)(total - step) / rate);
    fprintf(p->out, "\r\033[K[%s] %3d%% %" PRId64 "/%" PRId64 " %.1f steps/s ETA %s loss %.4f", bar,
            (int)(100.0 * frac), step, total, rate, eta, loss);
    fflush(p->out);
    p->t_last_draw = now;
    p->drawn = true;
}

void progress_clear(Progress *p) {
    if (!p->out || !p->drawn) return;
    fputs("\r\033[K", p->out);
    fflush(p->out);
    p->drawn = false;
}

void json_begin(JsonWriter *w, FILE *f) {
    w->f = f;
    w->n = 0;
    fputs("{", f);
}

static void json_key(JsonWriter *w, const char *key) {
    fprintf(w->f, "%s\n  \"%s\": ", w->n++ ? "," : "", key);
}

void json_number(JsonWriter *w, const char *key, double v) {
    json_key(w, key);
    if (isfinite(v)) fprintf(w->f, "%.17g", v);
    else fputs("null", w->f);
}

void json_int(JsonWriter *w, const char *key, int64_t v) {
    json_key(w, key);
    fprintf(w->f, "%" PRId64, v);
}

void json_string(JsonWriter *w, const char *key, const char *v) {
    json_key(w, key);
    if (!v) {
        fputs("null", w->f);
        return;
    }
    fputc('"', w->f);
    for (const unsigned char *c = (const unsigned char *)v; *c; c++) {
        if (*c == '"' || *c == '\\') fprintf(w->f, "\\%c", *c);
        else if (*c < 0x20) fprintf(w->f, "\\u%04x", *c);
        else fputc(*c, w->f);
    }
    fputc('"', w->f);
}

void json_end(JsonWriter *w) { fputs("\n}\n", w->f); }
