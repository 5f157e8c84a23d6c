/* ops_loss.c - softmax cross-entropy and mean squared error.
 * Both reject NaN/Inf inputs: a loss of NaN would otherwise spread through
 * every gradient and parameter before anyone noticed. */
#include <math.h>
#include <string.h>

#include "ops.h"

/* Index of the first non-finite value, or n. */
static size_t find_nonfinite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return i;
    return n;
}

double softmax_cross_entropy_forward(float *probs, const float *logits, const int32_t *labels, int N, int C) {
    double total = 0.0;
    for (int n = 0; n < N; n++) {
        const float *z = logits + (size_t)n * C;
        float *p = probs + (size_t)n * C;
        float zmax = z[0];
        for (int c = 1; c < C; c++) zmax = z[c] > zmax ? z[c] : zmax;
        double sum = 0.0;
        for (int c = 0; c < C; c++) {
            p[c] = expf(z[c] - zmax);
            sum += p[c];
        }
        float inv = (float)(1.0 / sum);
        for (int c = 0; c < C; c++) p[c] *= inv;
        /* -log p[label] = logsumexp(z) - z[label], without log(0). */
        total += log(sum) + zmax - z[labels[n]];
    }
    return total / N;
}

void softmax_cross_entropy_backward(float *dlogits, float dloss, const float *probs, const int32_t *labels,
                                    int N, int C) {
    float s = dloss / (float)N;
    for (int n = 0; n < N; n++) {
        const float *p = probs + (size_t)n * C;
        float *d = dlogits + (size_t)n * C;
        for (int c = 0; c < C; c++) d[c] += s * p[c];
        d[labels[n]] -= s;
    }
}

typedef struct {
    float *probs;    /* (N, C) */
    int32_t *labels; /* [N] */
    int N, C;
} CrossEntropyCtx;

static void cross_entropy_tape_backward(Tape *t, const TapeNode *node) {
    const CrossEntropyCtx *c = node->ctx;
    float *dz = tape_grad(t, node->in[0]);
    if (!dz) return;
    softmax_cross_entropy_backward(dz, node->out->grad[0], c->probs, c->labels, c->N, c->C);
}

Var *nn_softmax_cross_entropy(Tape *t, Var *logits, const int32_t *labels) {
    if (!logits) return NULL;
    char s[64];
    if (!labels) {
        qt_error_set(&t->err, QT_ERR_ARG, "softmax_cross_entropy: labels are NULL");
        return NULL;
    }
    if (logits->value.ndim != 2) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "softmax_cross_entropy: logits must be (N, C), got %s",
                     tensor_shape_str(&logits->value, s, sizeof s));
        return NULL;
    }
    int N = logits->value.shape[0], C = logits->value.shape[1];
    size_t bad = find_nonfinite(logits->value.data, var_numel(logits));
    if (bad < var_numel(logits)) {
        qt_error_set(&t->err, QT_ERR_VALUE,
                     "softmax_cross_entropy: logits %s hold %g at [%zu, %zu]; the model diverged or its input "
                     "has NaN/Inf (lower the learning rate, or check the data)",
                     tensor_shape_str(&logits->value, s, sizeof s), (double)logits->value.data[bad], bad / (size_t)C,
                     bad % (size_t)C);
        return NULL;
    }
    for (int n = 0; n < N; n++) {
        if (labels[n] < 0 || labels[n] >= C) {
            qt_error_set(&t->err, QT_ERR_VALUE, "softmax_cross_entropy: label %d of example %d is outside 0..%d",
                         (int)labels[n], n, C - 1);
            return NULL;
        }
    }
    Var *loss = tape_new_var(t, 1, (int[]){1});
    CrossEntropyCtx *c = tape_alloc(t, sizeof *c);
    if (!loss || !c) return NULL;
    c->probs = tape_alloc(t, var_numel(logits) * sizeof(float));
    c->labels = tape_alloc(t, (size_t)N * sizeof(int32_t));
    if (!c->probs || !c->labels) return NULL;
    memcpy(c->labels, labels, (size_t)N * sizeof(int32_t)); /* the caller's batch may be reused */
    c->N = N;
    c->C = C;
    loss->value.data[0] = (float)softmax_cross_entropy_forward(c->probs, logits->value.data, c->labels, N, C);
    return tape_record(t, "softmax_cross_entropy", cross_entropy_tape_backward, loss, (Var *[]){logits}, 1, c) ? loss
                                                                                                              : NULL;
}

static void mse_tape_backward(Tape *t, const TapeNode *node) {
    Var *pred = node->in[0], *target = node->in[1];
    if (!pred->requires_grad) return;
    float *dp = tape_grad(t, pred);
    if (!dp) return;
    size_t n = var_numel(pred);
    float s = 2.0f * node->out->grad[0] / (float)n;
    for (size_t i = 0; i < n; i++) dp[i] += s * (pred->value.data[i] - target->value.data[i]);
}

Var *nn_mse(Tape *t, Var *pred, Var *target) {
    if (!pred || !target) return NULL;
    char sp[64], st[64];
    if (!tensor_same_shape(&pred->value, &target->value)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "mse: prediction %s and target %s differ in shape",
                     tensor_shape_str(&pred->value, sp, sizeof sp), tensor_shape_str(&target->value, st, sizeof st));
        return NULL;
    }
    size_t n = var_numel(pred);
    for (int k = 0; k < 2; k++) {
        const Var *v = k ? target : pred;
        size_t bad = find_nonfinite(v->value.data, n);
        if (bad < n) {
            qt_error_set(&t->err, QT_ERR_VALUE, "mse: %s %s holds %g at flat index %zu", k ? "target" : "prediction",
                         tensor_shape_str(&v->value, sp, sizeof sp), (double)v->value.data[bad], bad);
            return NULL;
        }
    }
    Var *loss = tape_new_var(t, 1, (int[]){1});
    if (!loss) return NULL;
    double acc = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)pred->value.data[i] - target->value.data[i];
        acc += d * d;
    }
    loss->value.data[0] = (float)(acc / (double)n);
    /* The target is data: only the prediction receives a gradient. */
    return tape_record(t, "mse", mse_tape_backward, loss, (Var *[]){pred, target}, 2, NULL) ? loss : NULL;
}
