/* calib.h - calibration: the range [lo, hi] a slice of data is quantized over.
 *
 * A method is parsed from a config string (exact spellings, names
 * case-insensitive, spaces around the parts ignored):
 *
 *   absmax | absmax,s     symmetric, t = s * max|x|                    (s > 0, default 1)
 *   minmax | minmax,s     asymmetric, (s * min x, s * max x)           (s > 0, default 1)
 *   rms,s                 symmetric, t = s * sqrt(mean x^2)            (s > 0)
 *   fixed,a               symmetric, t = a, whatever the data          (a > 0)
 *   fixed,min,max         asymmetric (min, max), whatever the data     (min < max)
 *   percentile,p          p-th percentile, see below                   (0 < p <= 100)
 *   mse                   clipping range of least squared quantization error
 *   entropy               TensorRT-style histogram KL divergence
 *   3sd                   TQT initialiser: t = |mean x| + 3 * std x
 *   kl_j                  TQT initialiser: Settle et al. 2018, Algorithm 1
 *   mean_abs              symmetric, t = mean |x| (BitNet b1.58's absmean, XNOR-Net's alpha)
 *
 * Symmetric methods give lo = -t, hi = t. minmax returns the data's own
 * extremes (both may be negative); an asymmetric format widens them to
 * include 0 itself (DESIGN: min- = min(min, 0), max+ = max(max, 0)).
 *
 * The methods in detail (n values x[0..n-1], amax = max|x|, min/max of x):
 *
 * percentile: linear interpolation between order statistics, numpy's
 *   default: for sorted v[0..n-1], h = (n - 1) * p / 100,
 *   P(p) = v[floor(h)] + (h - floor(h)) * (v[floor(h) + 1] - v[floor(h)]).
 *   For a symmetric quantizer t = P(p) of |x|; for an asymmetric one
 *   (CalibQuant.asymmetric) lo = P(100 - p), hi = P(p) of x (the two
 *   swapped when p < 50, so lo <= hi). Needs n floats of workspace.
 *
 * mse: grid search over fractions f of the data's extent; the candidate is
 *   (-f * amax, f * amax) for a symmetric quantizer and (f * min, f * max)
 *   for an asymmetric one. Error = sum over x of (x - q->fn(x, lo, hi))^2,
 *   accumulated in double. Coarse grid f = k/100, k = 1..100, then a fine
 *   grid f* +- j/1000, j = 1..9 (kept within (0, 1]) around the coarse
 *   optimum f*: 118 passes over the data, one q->fn call per value and pass.
 *   Ties go to the larger f (less clipping). The range never exceeds the
 *   data's extent.
 *
 * entropy (TensorRT's entropy calibration, following the bin conventions of
 *   NVIDIA's histogram calibrator): a histogram h of |x| with 2048 bins of
 *   width w = amax / 2048 over [0, amax] (|x| = amax in the last bin).
 *   L = q->levels (128 for 8 bits). For each candidate i = L..2048:
 *     P = h[0..i-1] with the tail sum(h[i..2047]) added to bin i-1;
 *     Q: bins 0..i-1 are merged into L levels (bin k into level k*L/i,
 *        rounded down); each level's count (from h, without the tail) is
 *        spread evenly over its non-empty bins, empty bins stay 0;
 *     KL(P || Q) = sum over P_k > 0 of P_k ln(P_k / Q_k), P and Q each
 *        normalised to sum 1; a candidate with Q_k = 0 < P_k (an empty
 *        bin i-1 under a non-empty tail) has infinite KL and is never taken.
 *   t = i * w, the upper edge of the last kept bin, for the i of least KL;
 *   ties go to the larger i. No smoothing of Q, and bin 0 is used as
 *   counted (some tools overwrite it to damp the spike of ReLU zeros).
 *   Needs 2048 doubles of workspace.
 *
 * 3sd (Jain et al. 2019, TQT, Table 2): t = |mean| + 3 * std, std with
 *   divisor n (population), two passes in double.
 *
 * kl_j (Settle et al. 2018, Algorithm 1, as used to initialise TQT
 *   thresholds of activations): works on the CDF of |x|.
 *   A histogram of |x| over [0, amax] with B = ceil(sqrt(n)) bins (numpy's
 *   "sqrt" rule) of width w = amax / B; c[k] = fraction of values in bins
 *   0..k. L = q->levels. If B < L + 1 there is nothing to search: t = amax.
 *   Otherwise for each candidate i = L+1..B:
 *     p = c with p[k] = 1 for k >= i-1 (the tail clipped into bin i-1);
 *     r = p[0..i-1] resampled at L evenly spaced points (end points
 *        included, linear interpolation), then q[0..i-1] = r resampled
 *        back at i evenly spaced points, q[k] = 1 for k >= i;
 *     d = sum over c[k] > 0 of (c[k] - q[k]) * log2(c[k] / q[k]), the
 *        Jeffreys (symmetric KL) divergence of the two CDFs; a candidate
 *        with q[k] = 0 < c[k] has d = infinity.
 *   t = i * w for the i of least d, the first on ties; amax if no candidate
 *   is finite. (The Xilinx/AMD TQT code takes (i + 0.5) * w, half a bin
 *   more; the bin edge keeps t <= amax, as with entropy.) Needs 2 * B
 *   doubles of workspace.
 *
 * mean_abs: t = sum |x| / n, the sum in double, rounded to float once. The
 *   scale of ternary (BitNet b1.58's absmean, Ma et al. 2024) and binary
 *   (XNOR-Net's alpha = mean |x|, Rastegari et al. 2016), where t maps to
 *   the code +1; for an int format it clips most of the data.
 *
 * Degenerate data: n = 0, or amax = 0, give the range (0, 0) for every
 * method but fixed; callers turn the zero scale into 1 (DESIGN: a scale
 * below ~1e-19 becomes 1). A NaN or Inf in x is QT_ERR_VALUE naming the
 * index of the first one, whatever the method. */
#ifndef QTRAIN_QUANT_CALIB_H
#define QTRAIN_QUANT_CALIB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

typedef enum {
    CALIB_ABSMAX,
    CALIB_MINMAX,
    CALIB_RMS,
    CALIB_FIXED,
    CALIB_PERCENTILE,
    CALIB_MSE,
    CALIB_ENTROPY,
    CALIB_3SD,
    CALIB_KL_J,
    CALIB_MEAN_ABS,
    CALIB_COUNT
} CalibKind;

/* Bins of entropy's histogram of |x|. */
#define CALIB_ENTROPY_BINS 2048

/* A parsed method. Fields a kind does not use stay 0 (s stays 1), so two
 * specs of one string compare equal field by field. */
typedef struct {
    CalibKind kind;
    double s;          /* absmax, minmax, rms: scale of the range, > 0 */
    double a;          /* fixed,a: the range is (-a, a) */
    double lo, hi;     /* fixed,min,max: the range is (lo, hi) */
    double p;          /* percentile: in (0, 100] */
    bool fixed_minmax; /* fixed given as min,max (lo, hi) rather than a */
} CalibSpec;

/* symmetric methods give lo = -hi */
typedef struct {
    float lo, hi;
} CalibRange;

typedef struct CalibQuant CalibQuant;

/* Quantizes x over the candidate range [lo, hi] and dequantizes it again:
 * the value the format would store for x. Symmetric quantizers get
 * lo = -hi. Must not fail; the range may be (0, 0). */
typedef float (*CalibQuantFn)(float x, float lo, float hi, const CalibQuant *q);

/* How the target format quantizes, for the methods that need to know.
 * A NULL CalibQuant* anywhere means calib_quant_int(8, false). */
struct CalibQuant {
    CalibQuantFn fn;  /* mse: the round trip of one value */
    const void *ctx;  /* whatever fn needs; the int helpers read an int (the bits) here */
    int levels;       /* entropy, kl_j: levels of |x| over [0, t], e.g. 2^(bits-1) for signed int */
    bool asymmetric;  /* percentile and mse calibrate lo and hi separately */
};

/* A quantizer of DESIGN's int formats, b = bits in 2..16 (fn = NULL, which
 * mse rejects, outside that): symmetric, or asymmetric over 2^b codes;
 * levels = 2^(b-1) either way (set 2^b for non-negative data quantized
 * unsigned). ctx points at static storage, so the value can be copied and
 * kept freely. Both helpers read b from *(const int *)q->ctx (8 if q or
 * ctx is NULL) and clamp it to 2..16. */
CalibQuant calib_quant_int(int bits, bool asymmetric);

/* DESIGN's symmetric signed int of b bits:
 * t = max(-lo, hi), scale = t / (2^(b-1) - 0.5) (1 if below 1e-19),
 * returns clamp(rne(x / scale), -2^(b-1), 2^(b-1) - 1) * scale. */
float calib_quant_int_symmetric(float x, float lo, float hi, const CalibQuant *q);

/* DESIGN's asymmetric int over codes 0..2^b - 1: lo- = min(lo, 0),
 * hi+ = max(hi, 0), scale = (hi+ - lo-) / (2^b - 1) (1 if below 1e-19),
 * zp = clamp(-rne(lo- / scale), 0, 2^b - 1), returns
 * (clamp(rne(x / scale) + zp, 0, 2^b - 1) - zp) * scale. */
float calib_quant_int_asymmetric(float x, float lo, float hi, const CalibQuant *q);

/* "absmax", "minmax", "rms", "fixed", "percentile", "mse", "entropy", "3sd",
 * "kl_j", "mean_abs"; "unknown" outside the enum. */
const char *calib_kind_name(CalibKind kind);

/* Parses one of the forms above into *out. QT_ERR_CONFIG with a message
 * that names the string: an unknown method or a wrong count of numbers
 * lists every valid form; a bad number says which and what it must be. */
QtStatus calib_parse(const char *text, CalibSpec *out, QtError *err);

/* The canonical string of a spec: lower case, no spaces, defaults left out
 * ("absmax", not "absmax,1"), numbers in the fewest digits that parse back
 * to the same double, so calib_parse(calib_format(spec)) == spec. Truncated
 * to cap - 1 characters (64 always suffice). */
void calib_format(const CalibSpec *spec, char *buf, size_t cap);

/* The same checks calib_parse makes, for a spec built in code. */
QtStatus calib_spec_check(const CalibSpec *spec, QtError *err);

/* Bytes of workspace calib_compute needs for this spec and n values:
 * percentile n floats, entropy 2048 doubles, kl_j 2 * ceil(sqrt(n))
 * doubles, 0 for the others. */
size_t calib_workspace_bytes(const CalibSpec *spec, size_t n);

/* The range of x[0..n-1] (one slice: the caller splits tensors per channel
 * or block). q describes the target format (NULL: int8 symmetric).
 * work[0..work_bytes) is scratch of at least calib_workspace_bytes(spec, n)
 * bytes, aligned for a double; with work = NULL a method that needs scratch
 * allocates it for this call and frees it again, which suits one-off
 * calibration but not a per-step path. x may be NULL when n = 0.
 * Errors: QT_ERR_CONFIG for a bad spec (calib_spec_check), QT_ERR_ARG for
 * a NULL argument, a quantizer the method cannot use or too small a
 * workspace, QT_ERR_VALUE for a NaN/Inf in x (the index of the first) or a
 * range that overflows float, QT_ERR_NOMEM. *out is written only on
 * success. */
QtStatus calib_compute(const CalibSpec *spec, const float *x, size_t n, const CalibQuant *q, void *work,
                       size_t work_bytes, CalibRange *out, QtError *err);

/* Static activation ranges: the running mean of per-batch ranges.
 * A checkpoint stores exactly these fields, as plain numbers: the spec as
 * its calib_format string, lo_mean and hi_mean as float64 and count as
 * int64; a resumed run continues the same means bit for bit. */
typedef struct {
    CalibSpec spec;  /* how each batch's range is computed */
    double lo_mean;  /* mean of the per-batch lo over count batches */
    double hi_mean;  /* mean of the per-batch hi */
    int64_t count;   /* batches seen; 0 = no statistics yet */
} CalibRunning;

/* Empty statistics for spec. */
void calib_running_init(CalibRunning *r, const CalibSpec *spec);

/* Adds one batch's range: mean += (v - mean) / count, in double.
 * QT_ERR_VALUE (and no change) for a non-finite range or lo > hi. */
QtStatus calib_running_update(CalibRunning *r, CalibRange batch, QtError *err);

/* calib_compute with r->spec, then calib_running_update. An empty batch
 * (n = 0) adds nothing. Same arguments and errors as calib_compute. */
QtStatus calib_running_observe(CalibRunning *r, const float *x, size_t n, const CalibQuant *q, void *work,
                               size_t work_bytes, QtError *err);

/* The mean range so far; (0, 0) before the first batch. */
CalibRange calib_running_range(const CalibRunning *r);

/* Checks statistics restored from a checkpoint: a valid spec, count >= 0,
 * finite means with lo_mean <= hi_mean, both 0 when count = 0.
 * QT_ERR_FORMAT naming the field otherwise. */
QtStatus calib_running_check(const CalibRunning *r, QtError *err);

#endif
