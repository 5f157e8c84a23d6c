/* lora_svd.c - the truncated SVD (LAPACKE_dgesdd) and the PiSSA and LoftQ
 * adapter initialisations on it (lora_svd.h). */
#include "lora_svd.h"

#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

QtStatus lora_svd_truncated(const float *m, int rows, int cols, int r, double *u, double *s, double *vt,
                            QtError *err) {
    int k = rows < cols ? rows : cols;
    if (!m || !u || !s || !vt || rows < 1 || cols < 1 || r < 1 || r > k)
        return qt_error_set(err, QT_ERR_ARG, "lora_svd_truncated: a %dx%d matrix has no rank-%d truncation (rank in "
                            "1..%d)", rows, cols, r, k);
    size_t n = (size_t)rows * (size_t)cols;
    /* the thin SVD: a [rows * cols] (destroyed), uf [rows * k], sf [k], vtf [k * cols] */
    double *a = malloc(n * sizeof *a), *uf = malloc((size_t)rows * k * sizeof *uf), *sf = malloc((size_t)k * sizeof *sf),
           *vtf = malloc((size_t)k * cols * sizeof *vtf);
    QtStatus st = a && uf && sf && vtf ? QT_OK : qt_error_set(err, QT_ERR_NOMEM, "out of memory for a %dx%d SVD", rows,
                                                              cols);
    if (st == QT_OK) {
        for (size_t i = 0; i < n; i++) a[i] = m[i];
        lapack_int info = LAPACKE_dgesdd(LAPACK_ROW_MAJOR, 'S', rows, cols, a, cols, sf, uf, k, vtf, cols);
        if (info != 0)
            st = qt_error_set(err, QT_ERR_VALUE, "the SVD of a %dx%d matrix failed (LAPACK dgesdd info %d%s)", rows,
                              cols, (int)info, info < 0 ? ": a bad argument or a NaN in the matrix" :
                                                          ": no convergence");
    }
    if (st == QT_OK) {
        for (int i = 0; i < rows; i++) memcpy(u + (size_t)i * r, uf + (size_t)i * k, (size_t)r * sizeof *u);
        memcpy(s, sf, (size_t)r * sizeof *s);
        memcpy(vt, vtf, (size_t)r * cols * sizeof *vt);
    }
    free(a), free(uf), free(sf), free(vtf);
    return st;
}

/* a [r * fan_in], b [out * r] from the rank-r truncated SVD of m: s B A = U_r S_r V_r^T. */
static QtStatus factors_from_svd(const float *m, int out, int fan_in, int r, float scale, double *u, double *sv,
                                 double *vt, float *a, float *b, QtError *err) {
    QtStatus st = lora_svd_truncated(m, out, fan_in, r, u, sv, vt, err);
    if (st != QT_OK) return st;
    for (int k = 0; k < r; k++) {
        double f = sqrt(sv[k] / (double)scale);
        for (int j = 0; j < fan_in; j++) a[(size_t)k * fan_in + j] = (float)(f * vt[(size_t)k * fan_in + j]);
        for (int i = 0; i < out; i++) b[(size_t)i * r + k] = (float)(f * u[(size_t)i * r + k]);
    }
    return QT_OK;
}

/* lowrank [out * fan_in] = scale B A, in double from the float factors (what the adapter adds). */
static void lowrank_of(const float *a, const float *b, int out, int fan_in, int r, float scale, double *lowrank) {
    for (int i = 0; i < out; i++) {
        double *row = lowrank + (size_t)i * fan_in;
        for (int j = 0; j < fan_in; j++) row[j] = 0.0;
        for (int k = 0; k < r; k++) {
            double c = (double)scale * b[(size_t)i * r + k];
            const float *ak = a + (size_t)k * fan_in;
            for (int j = 0; j < fan_in; j++) row[j] += c * ak[j];
        }
    }
}

/* ||w - (q + lowrank)||_F / ||w||_F (lowrank NULL: 0); 0 for a zero w. */
static double rel_error(const float *w, const float *q, const double *lowrank, size_t n) {
    double e2 = 0.0, w2 = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)w[i] - (double)q[i] - (lowrank ? lowrank[i] : 0.0);
        e2 += d * d, w2 += (double)w[i] * w[i];
    }
    return w2 > 0.0 ? sqrt(e2 / w2) : 0.0;
}

QtStatus lora_svd_init(const float *w, int out, int fan_in, int r, float scale, int iters, LoraQuantizeFn quantize,
                       void *qctx, float *a, float *b, float *base, LoraInitReport *rep, QtError *err) {
    LoraInitReport local;
    if (!rep) rep = &local;
    memset(rep, 0, sizeof *rep);
    if (iters < 0 || iters > LORA_LOFTQ_ITERS_MAX || (iters > 0 && !quantize) || !(scale > 0.0f))
        return qt_error_set(err, QT_ERR_ARG, "lora_svd_init: %d LoftQ iterations (0..%d, a quantized base for "
                            "any), scale %g", iters, LORA_LOFTQ_ITERS_MAX, (double)scale);
    size_t n = (size_t)out * (size_t)fan_in;
    int k = out < fan_in ? out : fan_in;
    double *u = malloc((size_t)out * r * sizeof *u), *sv = malloc((size_t)r * sizeof *sv),
           *vt = malloc((size_t)r * fan_in * sizeof *vt), *lowrank = malloc(n * sizeof *lowrank);
    float *target = malloc(n * sizeof *target);
    QtStatus st = u && sv && vt && lowrank && target && r <= k
                      ? QT_OK
                      : qt_error_set(err, r > k ? QT_ERR_ARG : QT_ERR_NOMEM,
                                     r > k ? "lora_svd_init: rank %d of a %dx%d weight" : "out of memory (rank %d, "
                                     "%dx%d weight)", r, out, fan_in);
    /* the default's error: B = 0 over quantize(W) (W itself on a float base) */
    if (st == QT_OK && quantize && (st = quantize(qctx, w, base, err)) == QT_OK)
        rep->default_rel_error = rel_error(w, base, NULL, n);
    if (st == QT_OK && iters == 0) { /* PiSSA: the top-r triplets of W; the base is what remains */
        st = factors_from_svd(w, out, fan_in, r, scale, u, sv, vt, a, b, err);
        if (st == QT_OK) {
            lowrank_of(a, b, out, fan_in, r, scale, lowrank);
            for (size_t i = 0; i < n; i++) target[i] = (float)((double)w[i] - lowrank[i]);
            if (quantize) st = quantize(qctx, target, base, err);
            else memcpy(base, target, n * sizeof *base);
        }
    }
    /* LoftQ: base holds Q_1 = quantize(W) already. Each iteration minimises ||W - Q - L|| over Q with L fixed, then
       over L with Q fixed: L exactly (the truncated SVD of W - Q), Q only roughly (quantize(W - L): its scales follow
       the input's range, so it is no exact projection), so an iteration can raise the error. Such an iteration is
       undone and ends the loop: the last Q made again from its own input (the quantizer is deterministic, so the
       base left behind is the kept one) and its A, B. The error never rises from one iteration to the next. */
    size_t nab = (size_t)r * fan_in + (size_t)out * r;
    float *qin = iters > 0 ? malloc(n * sizeof *qin) : NULL, *prev_in = iters > 0 ? malloc(n * sizeof *prev_in) : NULL;
    float *prev_ab = iters > 0 ? malloc(nab * sizeof *prev_ab) : NULL;
    if (st == QT_OK && iters > 0 && (!qin || !prev_in || !prev_ab))
        st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK && iters > 0) memcpy(prev_in, w, n * sizeof *prev_in);
    for (int t = 0; st == QT_OK && t < iters; t++) {
        if (t > 0) {
            for (size_t i = 0; i < n; i++) qin[i] = (float)((double)w[i] - lowrank[i]);
            memcpy(prev_ab, a, (size_t)r * fan_in * sizeof *a);
            memcpy(prev_ab + (size_t)r * fan_in, b, (size_t)out * r * sizeof *b);
            if ((st = quantize(qctx, qin, base, err)) != QT_OK) break;
        }
        for (size_t i = 0; i < n; i++) target[i] = w[i] - base[i];
        if ((st = factors_from_svd(target, out, fan_in, r, scale, u, sv, vt, a, b, err)) != QT_OK) break;
        lowrank_of(a, b, out, fan_in, r, scale, lowrank);
        double e = rel_error(w, base, lowrank, n);
        if (t > 0 && e > rep->iter_error[t - 1]) { /* undone: the last iterate stays */
            memcpy(a, prev_ab, (size_t)r * fan_in * sizeof *a);
            memcpy(b, prev_ab + (size_t)r * fan_in, (size_t)out * r * sizeof *b);
            st = quantize(qctx, prev_in, base, err);
            rep->stopped = true;
            break;
        }
        if (t > 0) memcpy(prev_in, qin, n * sizeof *qin);
        rep->iter_error[t] = e;
        rep->iters = t + 1;
    }
    free(qin), free(prev_in), free(prev_ab);
    if (st == QT_OK) {
        lowrank_of(a, b, out, fan_in, r, scale, lowrank);
        rep->rel_error = rel_error(w, base, lowrank, n);
    }
    free(u), free(sv), free(vt), free(lowrank), free(target);
    return st;
}
