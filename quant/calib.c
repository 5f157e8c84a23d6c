#include "calib.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const KIND_NAMES[] = {
    [CALIB_ABSMAX] = "absmax",
    [CALIB_MINMAX] = "minmax",
    [CALIB_RMS] = "rms",
    [CALIB_FIXED] = "fixed",
    [CALIB_PERCENTILE] = "percentile",
    [CALIB_MSE] = "mse",
    [CALIB_ENTROPY] = "entropy",
    [CALIB_3SD] = "3sd",
    [CALIB_KL_J] = "kl_j",
    [CALIB_MEAN_ABS] = "mean_abs",
};

/* Every message about a malformed method lists these. */
#define CALIB_FORMS                                                                                               \
    "absmax, absmax,s, minmax, minmax,s, rms,s, fixed,a, fixed,min,max, percentile,p, mse, entropy, 3sd, kl_j, "   \
    "mean_abs"

/* The longest method string parse accepts; real ones are far shorter. */
#define CALIB_TEXT_MAX 128

const char *calib_kind_name(CalibKind kind) {
    return (int)kind >= 0 && (int)kind < CALIB_COUNT ? KIND_NAMES[kind] : "unknown";
}

/* ---- int quantizers ------------------------------------------------------- */

/* ctx of calib_quant_int points in here, so a CalibQuant owns no memory. */
static const int INT_BITS[17] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

static int quant_bits(const CalibQuant *q) {
    int b = q && q->ctx ? *(const int *)q->ctx : 8;
    return b < 2 ? 2 : b > 16 ? 16 : b;
}

float calib_quant_int_symmetric(float x, float lo, float hi, const CalibQuant *q) {
    int b = quant_bits(q);
    float qmax = (float)((1 << (b - 1)) - 1), qmin = -(float)(1 << (b - 1));
    float t = fmaxf(-lo, hi);
    float scale = t / (qmax + 0.5f);
    if (!(scale >= 1e-19f)) scale = 1.0f; /* also catches NaN */
    float v = rintf(x / scale);
    v = v < qmin ? qmin : v > qmax ? qmax : v;
    return v * scale;
}

float calib_quant_int_asymmetric(float x, float lo, float hi, const CalibQuant *q) {
    int b = quant_bits(q);
    float qmax = (float)((1 << b) - 1);
    float lo0 = fminf(lo, 0.0f), hi0 = fmaxf(hi, 0.0f);
    float scale = (hi0 - lo0) / qmax;
    if (!(scale >= 1e-19f)) scale = 1.0f;
    float zp = -rintf(lo0 / scale);
    zp = zp < 0.0f ? 0.0f : zp > qmax ? qmax : zp;
    float v = rintf(x / scale) + zp;
    v = v < 0.0f ? 0.0f : v > qmax ? qmax : v;
    return (v - zp) * scale;
}

CalibQuant calib_quant_int(int bits, bool asymmetric) {
    CalibQuant q = {0};
    q.asymmetric = asymmetric;
    if (bits < 2 || bits > 16) return q;
    q.fn = asymmetric ? calib_quant_int_asymmetric : calib_quant_int_symmetric;
    q.ctx = &INT_BITS[bits];
    q.levels = 1 << (bits - 1);
    return q;
}

static const CalibQuant DEFAULT_QUANT = {calib_quant_int_symmetric, &INT_BITS[8], 128, false};

/* ---- parse / format ------------------------------------------------------- */

/* What `kind` accepts after its name, for messages; min/max number count. */
static void kind_arity(CalibKind kind, int *min_args, int *max_args, const char **what) {
    *min_args = 0, *max_args = 0, *what = "no number";
    switch (kind) {
    case CALIB_ABSMAX:
    case CALIB_MINMAX: *max_args = 1, *what = "at most one number (the scale s)"; break;
    case CALIB_RMS: *min_args = *max_args = 1, *what = "one number (the scale s)"; break;
    case CALIB_FIXED: *min_args = 1, *max_args = 2, *what = "one number (a) or two (min,max)"; break;
    case CALIB_PERCENTILE: *min_args = *max_args = 1, *what = "one number (the percentile p)"; break;
    default: break;
    }
}

/* The range checks of parse and calib_spec_check; `text` names the spec.
 * Comparisons are written so that NaN fails them. */
static QtStatus spec_check_numbers(const CalibSpec *s, const char *text, QtError *err) {
    switch (s->kind) {
    case CALIB_ABSMAX:
    case CALIB_MINMAX:
    case CALIB_RMS:
        if (!(s->s > 0.0) || isinf(s->s))
            return qt_error_set(err, QT_ERR_CONFIG,
                                "calibration '%s': the scale s = %g must be a finite number > 0", text, s->s);
        break;
    case CALIB_FIXED:
        if (!s->fixed_minmax && (!(s->a > 0.0) || isinf(s->a)))
            return qt_error_set(err, QT_ERR_CONFIG,
                                "calibration '%s': the range a = %g of fixed,a must be a finite number > 0", text,
                                s->a);
        if (s->fixed_minmax && !(isfinite(s->lo) && isfinite(s->hi) && s->lo < s->hi))
            return qt_error_set(err, QT_ERR_CONFIG,
                                "calibration '%s': fixed,min,max needs finite min < max (got min = %g, max = %g)",
                                text, s->lo, s->hi);
        break;
    case CALIB_PERCENTILE:
        if (!(s->p > 0.0 && s->p <= 100.0))
            return qt_error_set(err, QT_ERR_CONFIG, "calibration '%s': the percentile p = %g must be in (0, 100]",
                                text, s->p);
        break;
    case CALIB_MSE:
    case CALIB_ENTROPY:
    case CALIB_3SD:
    case CALIB_KL_J:
    case CALIB_MEAN_ABS: break;
    default:
        return qt_error_set(err, QT_ERR_CONFIG, "calibration method %d is not one of: " CALIB_FORMS, (int)s->kind);
    }
    return QT_OK;
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    size_t len = strlen(s);
    while (len > 0 && (s[len - 1] == ' ' || s[len - 1] == '\t')) s[--len] = '\0';
    return s;
}

/* Splits buf at commas into at most max_parts trimmed parts; returns the
 * count, or max_parts + 1 if there are more. */
static int split_commas(char *buf, char **parts, int max_parts) {
    int n = 0;
    char *p = buf;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma) *comma = '\0';
        if (n == max_parts) return max_parts + 1;
        parts[n++] = trim(p);
        if (!comma) return n;
        p = comma + 1;
    }
}

static QtStatus parse_number(const char *part, const char *text, double *out, QtError *err) {
    char *end = NULL;
    double v = *part ? strtod(part, &end) : NAN;
    if (!*part || *end != '\0' || !isfinite(v))
        return qt_error_set(err, QT_ERR_CONFIG, "calibration '%s': '%s' is not a finite number (valid forms: %s)",
                            text, part, CALIB_FORMS);
    *out = v;
    return QT_OK;
}

QtStatus calib_parse(const char *text, CalibSpec *out, QtError *err) {
    if (!text || strspn(text, " \t") == strlen(text))
        return qt_error_set(err, QT_ERR_CONFIG, "calibration method is empty (valid forms: %s)", CALIB_FORMS);
    if (strlen(text) >= CALIB_TEXT_MAX)
        return qt_error_set(err, QT_ERR_CONFIG, "calibration method '%.40s...' is too long (valid forms: %s)", text,
                            CALIB_FORMS);
    char buf[CALIB_TEXT_MAX];
    snprintf(buf, sizeof buf, "%s", text);
    char *parts[3];
    int n_parts = split_commas(buf, parts, 3);
    int k = 0;
    if (qt_name_lookup("calibration method", parts[0], KIND_NAMES, CALIB_COUNT, &k, NULL) != QT_OK)
        return qt_error_set(err, QT_ERR_CONFIG, "unknown calibration method '%s' (valid forms: %s)", text,
                            CALIB_FORMS);
    CalibSpec s = {.kind = (CalibKind)k, .s = 1.0};
    int min_args, max_args, n_args = n_parts - 1;
    const char *what;
    kind_arity(s.kind, &min_args, &max_args, &what);
    if (n_args < min_args || n_args > max_args)
        return qt_error_set(err, QT_ERR_CONFIG, "calibration '%s': %s takes %s (valid forms: %s)", text,
                            KIND_NAMES[k], what, CALIB_FORMS);
    double v[2] = {0.0, 0.0};
    for (int i = 0; i < n_args; i++) {
        QtStatus st = parse_number(parts[i + 1], text, &v[i], err);
        if (st != QT_OK) return st;
    }
    switch (s.kind) {
    case CALIB_ABSMAX:
    case CALIB_MINMAX:
    case CALIB_RMS:
        if (n_args == 1) s.s = v[0];
        break;
    case CALIB_FIXED:
        s.fixed_minmax = n_args == 2;
        if (s.fixed_minmax) s.lo = v[0], s.hi = v[1];
        else s.a = v[0];
        break;
    case CALIB_PERCENTILE: s.p = v[0]; break;
    default: break;
    }
    QtStatus st = spec_check_numbers(&s, text, err);
    if (st == QT_OK) *out = s;
    return st;
}

/* The fewest significant digits that read back as exactly v, without an
 * exponent where one is not needed ("100", not "1e+02"). buf holds 32
 * characters, more than %.17g of any double takes. */
static void format_number(char buf[32], double v) {
    int first = 0;
    for (int prec = 1; prec <= 17; prec++) {
        if (snprintf(buf, 32, "%.*g", prec, v) >= 32) continue;
        if (strtod(buf, NULL) != v) continue;
        if (!strchr(buf, 'e')) return;
        if (!first) first = prec;
    }
    if (snprintf(buf, 32, "%.*g", first ? first : 17, v) >= 32) buf[0] = '\0';
}

void calib_format(const CalibSpec *spec, char *buf, size_t cap) {
    if (!buf || cap == 0) return;
    char a[32] = "", b[32] = "";
    const char *name = calib_kind_name(spec->kind);
    switch (spec->kind) {
    case CALIB_ABSMAX:
    case CALIB_MINMAX:
        if (spec->s != 1.0) format_number(a, spec->s);
        break;
    case CALIB_RMS: format_number(a, spec->s); break;
    case CALIB_FIXED:
        if (spec->fixed_minmax) {
            format_number(a, spec->lo);
            format_number(b, spec->hi);
        } else {
            format_number(a, spec->a);
        }
        break;
    case CALIB_PERCENTILE: format_number(a, spec->p); break;
    default: break;
    }
    snprintf(buf, cap, "%s%s%s%s%s", name, *a ? "," : "", a, *b ? "," : "", b);
}

QtStatus calib_spec_check(const CalibSpec *spec, QtError *err) {
    if (!spec) return qt_error_set(err, QT_ERR_ARG, "calib_spec_check: no spec");
    char text[96];
    calib_format(spec, text, sizeof text);
    return spec_check_numbers(spec, text, err);
}

/* ---- workspace ------------------------------------------------------------ */

/* ceil(sqrt(n)) in integers: r*r < n is tested as r < ceil(n / r), which
 * cannot overflow. */
static size_t ceil_sqrt(size_t n) {
    if (n <= 1) return n;
    size_t r = (size_t)sqrt((double)n);
    if (r < 1) r = 1;
    while (r < n / r + (n % r != 0)) r++;
    while (r > 1 && r - 1 >= n / (r - 1) + (n % (r - 1) != 0)) r--;
    return r;
}

size_t calib_workspace_bytes(const CalibSpec *spec, size_t n) {
    if (!spec || n == 0) return 0;
    switch (spec->kind) {
    case CALIB_PERCENTILE: return n * sizeof(float);
    case CALIB_ENTROPY: return CALIB_ENTROPY_BINS * sizeof(double);
    case CALIB_KL_J: return 2 * ceil_sqrt(n) * sizeof(double);
    default: return 0;
    }
}

/* ---- the methods ---------------------------------------------------------- */

/* What one pass over the data finds; every method starts from it. */
typedef struct {
    const float *x; /* [n] */
    size_t n;
    float min, max, amax;
} CalibData;

/* Moves the k-th smallest of v[0..n-1] to v[k], with nothing larger before
 * it and nothing smaller after (Hoare partition, median-of-3 pivot):
 * average O(n), where sorting would be O(n log n). */
static void select_kth(float *v, size_t n, size_t k) {
    ptrdiff_t left = 0, right = (ptrdiff_t)n - 1, kk = (ptrdiff_t)k;
    while (right > left) {
        float a = v[left], b = v[left + (right - left) / 2], c = v[right];
        float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        ptrdiff_t i = left, j = right;
        while (i <= j) {
            while (v[i] < pivot) i++;
            while (v[j] > pivot) j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        /* Now v[left..j] <= pivot <= v[i..right], and anything in between
         * equals the pivot. */
        if (kk <= j) right = j;
        else if (kk >= i) left = i;
        else return;
    }
}

/* numpy's linear percentile of v[0..n-1] (reordered in place), n >= 1. */
static double percentile_of(float *v, size_t n, double p) {
    double h = (double)(n - 1) * p / 100.0;
    size_t k = (size_t)floor(h);
    if (k > n - 1) k = n - 1;
    select_kth(v, n, k);
    double frac = h - (double)k, lo = v[k];
    if (frac <= 0.0 || k + 1 >= n) return lo;
    float next = v[k + 1]; /* the (k+1)-th smallest is the least of v[k+1..] */
    for (size_t i = k + 2; i < n; i++)
        if (v[i] < next) next = v[i];
    return lo + frac * ((double)next - lo);
}

static void calib_percentile(const CalibData *d, double p, bool asymmetric, float *work, double *lo, double *hi) {
    if (!asymmetric) {
        for (size_t i = 0; i < d->n; i++) work[i] = fabsf(d->x[i]);
        *hi = percentile_of(work, d->n, p);
        *lo = -*hi;
        return;
    }
    memcpy(work, d->x, d->n * sizeof(float));
    double a = percentile_of(work, d->n, 100.0 - p), b = percentile_of(work, d->n, p);
    *lo = fmin(a, b);
    *hi = fmax(a, b);
}

static void mse_candidate(const CalibData *d, bool asymmetric, double f, float *lo, float *hi) {
    if (asymmetric) {
        *lo = (float)(f * d->min);
        *hi = (float)(f * d->max);
    } else {
        *hi = (float)(f * d->amax);
        *lo = -*hi;
    }
}

/* Sum of squared round-trip errors for the candidate of fraction f. A NaN
 * from the quantizer makes the candidate lose every comparison. */
static double mse_error(const CalibData *d, const CalibQuant *q, double f) {
    float lo, hi;
    mse_candidate(d, q->asymmetric, f, &lo, &hi);
    double e = 0.0;
    for (size_t i = 0; i < d->n; i++) {
        double diff = (double)d->x[i] - (double)q->fn(d->x[i], lo, hi, q);
        e += diff * diff;
    }
    return e;
}

static void calib_mse(const CalibData *d, const CalibQuant *q, double *lo, double *hi) {
    double best_f = 1.0, best_e = INFINITY;
    for (int k = 1; k <= 100; k++) {
        double f = k / 100.0, e = mse_error(d, q, f);
        if (e <= best_e) best_e = e, best_f = f;
    }
    double coarse = best_f;
    for (int j = -9; j <= 9; j++) {
        double f = coarse + j / 1000.0;
        if (j == 0 || f <= 0.0 || f > 1.0) continue;
        double e = mse_error(d, q, f);
        if (e < best_e || (e == best_e && f > best_f)) best_e = e, best_f = f;
    }
    float l, h;
    mse_candidate(d, q->asymmetric, best_f, &l, &h);
    *lo = l, *hi = h;
}

/* hist[0..bins-1]: counts of |x| over [0, amax] (amax > 0), the last bin
 * closed on the right. */
static void histogram_abs(const CalibData *d, double *hist, size_t bins) {
    memset(hist, 0, bins * sizeof(double));
    double per = (double)bins / (double)d->amax;
    for (size_t i = 0; i < d->n; i++) {
        size_t b = (size_t)(fabs((double)d->x[i]) * per);
        hist[b < bins ? b : bins - 1] += 1.0;
    }
}

/* KL(P || Q) of entropy's candidate i (see calib.h); INFINITY if Q misses
 * mass that P has. kept = sum(hist[0..i-1]), tail = the rest, total = n. */
static double entropy_kl(const double *hist, int i, int levels, double kept, double tail, double total) {
    if (kept <= 0.0 || (tail > 0.0 && hist[i - 1] == 0.0)) return INFINITY;
    double kl = 0.0;
    int k = 0;
    while (k < i) {
        /* One level: the bins k with the same k * levels / i. */
        int g = (int)((int64_t)k * levels / i), start = k;
        double sum = 0.0, nonzero = 0.0;
        for (; k < i && (int)((int64_t)k * levels / i) == g; k++)
            if (hist[k] > 0.0) sum += hist[k], nonzero += 1.0;
        if (nonzero == 0.0) continue;
        double qk = sum / nonzero / kept;
        for (int j = start; j < k; j++) {
            if (hist[j] <= 0.0) continue;
            double pk = (hist[j] + (j == i - 1 ? tail : 0.0)) / total;
            kl += pk * log(pk / qk);
        }
    }
    return kl;
}

static double calib_entropy(const CalibData *d, int levels, double *hist) {
    histogram_abs(d, hist, CALIB_ENTROPY_BINS);
    double total = (double)d->n, kept = 0.0;
    for (int k = 0; k < levels; k++) kept += hist[k];
    double best_kl = INFINITY;
    int best_i = CALIB_ENTROPY_BINS;
    for (int i = levels; i <= CALIB_ENTROPY_BINS; i++) {
        if (i > levels) kept += hist[i - 1];
        double kl = entropy_kl(hist, i, levels, kept, total - kept, total);
        if (kl <= best_kl) best_kl = kl, best_i = i;
    }
    return (double)d->amax * best_i / CALIB_ENTROPY_BINS;
}

/* v[0..len-1] sampled at evenly spaced points 0..len-1 and read, by linear
 * interpolation, at position pos in [0, len - 1]. */
static double interp_at(const double *v, int len, double pos) {
    if (len <= 1 || pos <= 0.0) return v[0];
    int k = (int)pos;
    if (k >= len - 1) return v[len - 1];
    return v[k] + (pos - k) * (v[k + 1] - v[k]);
}

/* d of kl_j's candidate i (see calib.h): cdf[0..bins-1], r[0..levels-1]. */
static double kl_j_divergence(const double *cdf, int bins, int i, int levels, double *r) {
    /* p is cdf with 1 from bin i-1 on; r = p[0..i-1] resampled at levels points. */
    for (int j = 0; j < levels; j++) {
        double pos = levels > 1 ? (double)j * (i - 1) / (levels - 1) : 0.0;
        int k = (int)pos;
        double pk = k >= i - 1 ? 1.0 : cdf[k], pk1 = k + 1 >= i - 1 ? 1.0 : cdf[k + 1];
        r[j] = k >= i - 1 ? 1.0 : pk + (pos - k) * (pk1 - pk);
    }
    double dist = 0.0;
    for (int k = 0; k < bins; k++) {
        double c = cdf[k];
        if (c <= 0.0) continue;
        double qk = k >= i ? 1.0 : interp_at(r, levels, (double)k * (levels - 1) / (i - 1));
        if (qk <= 0.0) return INFINITY;
        dist += (c - qk) * log2(c / qk);
    }
    return dist;
}

static double calib_kl_j(const CalibData *d, int levels, double *work) {
    size_t nb = ceil_sqrt(d->n);
    if (nb < (size_t)levels + 1 || nb > INT32_MAX) return d->amax;
    int bins = (int)nb;
    double *cdf = work, *r = work + bins;
    histogram_abs(d, cdf, nb);
    double run = 0.0;
    for (int k = 0; k < bins; k++) {
        run += cdf[k];
        cdf[k] = run / (double)d->n;
    }
    double best = INFINITY;
    int best_i = bins;
    for (int i = levels + 1; i <= bins; i++) {
        double dist = kl_j_divergence(cdf, bins, i, levels, r);
        if (dist < best) best = dist, best_i = i;
    }
    return (double)d->amax * best_i / bins;
}

static double calib_3sd(const CalibData *d) {
    double sum = 0.0;
    for (size_t i = 0; i < d->n; i++) sum += d->x[i];
    double mean = sum / (double)d->n, var = 0.0;
    for (size_t i = 0; i < d->n; i++) {
        double c = (double)d->x[i] - mean;
        var += c * c;
    }
    return fabs(mean) + 3.0 * sqrt(var / (double)d->n);
}

/* The sum in double, as qarray's ternary/binary default sums it, so both give the same float. */
static double calib_mean_abs(const CalibData *d) {
    double sum = 0.0;
    for (size_t i = 0; i < d->n; i++) sum += fabsf(d->x[i]);
    return sum / (double)d->n;
}

static double calib_rms(const CalibData *d) {
    double sq = 0.0;
    for (size_t i = 0; i < d->n; i++) sq += (double)d->x[i] * d->x[i];
    return sqrt(sq / (double)d->n);
}

/* ---- calib_compute -------------------------------------------------------- */

/* Finds min, max and amax, or the first NaN/Inf. */
static QtStatus scan_data(const CalibSpec *spec, const float *x, size_t n, CalibData *d, QtError *err) {
    *d = (CalibData){.x = x, .n = n};
    if (n == 0) return QT_OK;
    float lo = x[0], hi = x[0];
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) {
            char name[96];
            calib_format(spec, name, sizeof name);
            return qt_error_set(err, QT_ERR_VALUE,
                                "calibration '%s': x[%zu] of %zu values is %s; calibration needs finite data "
                                "(check the inputs, or the run for a divergence)",
                                name, i, n, isnan(x[i]) ? "NaN" : "Inf");
        }
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    d->min = lo, d->max = hi, d->amax = fmaxf(-lo, hi);
    return QT_OK;
}

static QtStatus check_quant(const CalibSpec *spec, const CalibQuant *q, QtError *err) {
    const char *name = calib_kind_name(spec->kind);
    if (spec->kind == CALIB_MSE && !q->fn)
        return qt_error_set(err, QT_ERR_ARG,
                            "calibration 'mse' needs the format's quantize-dequantize function, and the quantizer "
                            "given has none (CalibQuant.fn is NULL; calib_quant_int takes 2..16 bits)");
    if ((spec->kind == CALIB_ENTROPY && (q->levels < 1 || q->levels > CALIB_ENTROPY_BINS)) ||
        (spec->kind == CALIB_KL_J && q->levels < 1))
        return qt_error_set(err, QT_ERR_ARG,
                            "calibration '%s' needs the format's number of levels of |x| in 1..%d (got %d; "
                            "2^(bits-1) for a signed int)",
                            name, spec->kind == CALIB_ENTROPY ? CALIB_ENTROPY_BINS : INT32_MAX, q->levels);
    return QT_OK;
}

/* The method's range of non-degenerate data (n > 0, amax > 0). */
static void compute_range(const CalibSpec *spec, const CalibData *d, const CalibQuant *q, void *work, double *lo,
                          double *hi) {
    double t = 0.0;
    switch (spec->kind) {
    case CALIB_MINMAX:
        *lo = spec->s * d->min, *hi = spec->s * d->max;
        return;
    case CALIB_PERCENTILE: calib_percentile(d, spec->p, q->asymmetric, work, lo, hi); return;
    case CALIB_MSE: calib_mse(d, q, lo, hi); return;
    case CALIB_ABSMAX: t = spec->s * d->amax; break;
    case CALIB_RMS: t = spec->s * calib_rms(d); break;
    case CALIB_ENTROPY: t = calib_entropy(d, q->levels, work); break;
    case CALIB_3SD: t = calib_3sd(d); break;
    case CALIB_KL_J: t = calib_kl_j(d, q->levels, work); break;
    case CALIB_MEAN_ABS: t = calib_mean_abs(d); break;
    default: break;
    }
    *lo = -t, *hi = t;
}

QtStatus calib_compute(const CalibSpec *spec, const float *x, size_t n, const CalibQuant *q, void *work,
                       size_t work_bytes, CalibRange *out, QtError *err) {
    if (!spec || !out || (!x && n > 0))
        return qt_error_set(err, QT_ERR_ARG, "calib_compute: no %s", !spec ? "spec" : !out ? "output" : "data");
    QtStatus st = calib_spec_check(spec, err);
    if (st != QT_OK) return st;
    if (!q) q = &DEFAULT_QUANT;
    if ((st = check_quant(spec, q, err)) != QT_OK) return st;
    CalibData d;
    if ((st = scan_data(spec, x, n, &d, err)) != QT_OK) return st;

    double lo = 0.0, hi = 0.0;
    if (spec->kind == CALIB_FIXED) {
        lo = spec->fixed_minmax ? spec->lo : -spec->a;
        hi = spec->fixed_minmax ? spec->hi : spec->a;
    } else if (n > 0 && d.amax > 0.0f) {
        size_t need = calib_workspace_bytes(spec, n);
        void *own = NULL;
        if (need > 0 && !work) {
            if (!(work = own = malloc(need)))
                return qt_error_set(err, QT_ERR_NOMEM, "calibration '%s': cannot allocate %zu bytes of workspace",
                                    calib_kind_name(spec->kind), need);
        } else if (need > 0 && (need > work_bytes || (uintptr_t)work % _Alignof(double) != 0)) {
            return qt_error_set(err, QT_ERR_ARG,
                                "calibration '%s' of %zu values needs %zu bytes of workspace aligned for a double "
                                "(got %zu bytes at %p); size it with calib_workspace_bytes",
                                calib_kind_name(spec->kind), n, need, work_bytes, work);
        }
        compute_range(spec, &d, q, work, &lo, &hi);
        free(own);
    }
    if (!(fabs(lo) <= FLT_MAX && fabs(hi) <= FLT_MAX)) {
        char name[96];
        calib_format(spec, name, sizeof name);
        return qt_error_set(err, QT_ERR_VALUE,
                            "calibration '%s': the range (%g, %g) does not fit in float32; use a smaller scale",
                            name, lo, hi);
    }
    *out = (CalibRange){(float)lo, (float)hi};
    return QT_OK;
}

/* ---- running statistics --------------------------------------------------- */

void calib_running_init(CalibRunning *r, const CalibSpec *spec) {
    *r = (CalibRunning){.spec = *spec};
}

QtStatus calib_running_update(CalibRunning *r, CalibRange batch, QtError *err) {
    if (!isfinite(batch.lo) || !isfinite(batch.hi) || batch.lo > batch.hi)
        return qt_error_set(err, QT_ERR_VALUE,
                            "running calibration statistics: batch range (%g, %g) is not a finite lo <= hi; "
                            "it was not added",
                            (double)batch.lo, (double)batch.hi);
    r->count++;
    r->lo_mean += ((double)batch.lo - r->lo_mean) / (double)r->count;
    r->hi_mean += ((double)batch.hi - r->hi_mean) / (double)r->count;
    return QT_OK;
}

QtStatus calib_running_observe(CalibRunning *r, const float *x, size_t n, const CalibQuant *q, void *work,
                               size_t work_bytes, QtError *err) {
    if (n == 0) return QT_OK;
    CalibRange batch;
    QtStatus st = calib_compute(&r->spec, x, n, q, work, work_bytes, &batch, err);
    return st != QT_OK ? st : calib_running_update(r, batch, err);
}

CalibRange calib_running_range(const CalibRunning *r) {
    if (r->count <= 0) return (CalibRange){0.0f, 0.0f};
    return (CalibRange){(float)r->lo_mean, (float)r->hi_mean};
}

QtStatus calib_running_check(const CalibRunning *r, QtError *err) {
    if (!r) return qt_error_set(err, QT_ERR_ARG, "calib_running_check: no statistics");
    QtError spec_err = {0};
    if (calib_spec_check(&r->spec, &spec_err) != QT_OK)
        return qt_error_set(err, QT_ERR_FORMAT, "running calibration statistics: %s", spec_err.msg);
    if (r->count < 0)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "running calibration statistics: count = %lld must be >= 0", (long long)r->count);
    if (!isfinite(r->lo_mean) || !isfinite(r->hi_mean) || r->lo_mean > r->hi_mean)
        return qt_error_set(err, QT_ERR_FORMAT,
                            "running calibration statistics: lo_mean = %g, hi_mean = %g must be finite with "
                            "lo_mean <= hi_mean",
                            r->lo_mean, r->hi_mean);
    if (r->count == 0 && (r->lo_mean != 0.0 || r->hi_mean != 0.0))
        return qt_error_set(err, QT_ERR_FORMAT,
                            "running calibration statistics: count = 0 but lo_mean = %g, hi_mean = %g (must be 0)",
                            r->lo_mean, r->hi_mean);
    return QT_OK;
}
