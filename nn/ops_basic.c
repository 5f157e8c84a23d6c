/* ops_basic.c - matrix products, elementwise ops, dropout and reshapes. */
#include <math.h>
#include <string.h>

#include "gemm.h"
#include "ops.h"
#include "base/parallel.h"

#define SHAPE_STR(v, buf) tensor_shape_str(&(v)->value, (buf), sizeof(buf))

/* ---- matmul ------------------------------------------------------------- */

typedef struct {
    bool trans_a, trans_b;
    int M, N, K;
} MatmulCtx;

static void matmul_backward(Tape *t, const TapeNode *node) {
    const MatmulCtx *c = node->ctx;
    Var *a = node->in[0], *b = node->in[1];
    const float *dy = node->out->grad; /* (M, N) */
    int lda = a->value.shape[1], ldb = b->value.shape[1];
    if (a->requires_grad) {
        float *da = tape_grad(t, a);
        if (!da) return;
        /* dA = dY op(B)^T, laid out like A (transposed if A was). */
        if (!c->trans_a)
            gemm_f32(false, !c->trans_b, c->M, c->K, c->N, 1.0f, dy, c->N, b->value.data, ldb, 1.0f, da, lda);
        else
            gemm_f32(c->trans_b, true, c->K, c->M, c->N, 1.0f, b->value.data, ldb, dy, c->N, 1.0f, da, lda);
    }
    if (b->requires_grad) {
        float *db = tape_grad(t, b);
        if (!db) return;
        /* dB = op(A)^T dY, laid out like B. */
        if (!c->trans_b)
            gemm_f32(!c->trans_a, false, c->K, c->N, c->M, 1.0f, a->value.data, lda, dy, c->N, 1.0f, db, ldb);
        else
            gemm_f32(true, c->trans_a, c->N, c->K, c->M, 1.0f, dy, c->N, a->value.data, lda, 1.0f, db, ldb);
    }
}

Var *nn_matmul(Tape *t, Var *a, Var *b, bool trans_a, bool trans_b) {
    if (!a || !b) return NULL;
    char sa[64], sb[64];
    if (a->value.ndim != 2 || b->value.ndim != 2) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "matmul: both operands must be 2-D, got %s and %s", SHAPE_STR(a, sa),
                     SHAPE_STR(b, sb));
        return NULL;
    }
    int M = a->value.shape[trans_a ? 1 : 0], K = a->value.shape[trans_a ? 0 : 1];
    int Kb = b->value.shape[trans_b ? 1 : 0], N = b->value.shape[trans_b ? 0 : 1];
    if (K != Kb) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "matmul: inner dimensions differ: %s%s @ %s%s (%d vs %d)",
                     SHAPE_STR(a, sa), trans_a ? "^T" : "", SHAPE_STR(b, sb), trans_b ? "^T" : "", K, Kb);
        return NULL;
    }
    Var *y = tape_new_var(t, 2, (int[]){M, N});
    MatmulCtx *c = tape_alloc(t, sizeof *c);
    if (!y || !c) return NULL;
    *c = (MatmulCtx){trans_a, trans_b, M, N, K};
    gemm_f32(trans_a, trans_b, M, N, K, 1.0f, a->value.data, a->value.shape[1], b->value.data, b->value.shape[1], 0.0f,
             y->value.data, N);
    return tape_record(t, "matmul", matmul_backward, y, (Var *[]){a, b}, 2, c) ? y : NULL;
}

/* ---- linear: y = x W^T + b ---------------------------------------------- */

static void linear_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0], *w = node->in[1], *bias = node->in[2];
    const float *dy = node->out->grad; /* (N, out) */
    int N = x->value.shape[0], in = x->value.shape[1], out = w->value.shape[0];
    if (x->requires_grad) {
        float *dx = tape_grad(t, x); /* (N, in) += dy (N, out) @ W (out, in) */
        if (!dx) return;
        gemm_f32(false, false, N, in, out, 1.0f, dy, out, w->value.data, in, 1.0f, dx, in);
    }
    if (w->requires_grad) {
        float *dw = tape_grad(t, w); /* (out, in) += dy^T (out, N) @ x (N, in) */
        if (!dw) return;
        gemm_f32(true, false, out, in, N, 1.0f, dy, out, x->value.data, in, 1.0f, dw, in);
    }
    if (bias && bias->requires_grad) {
        float *db = tape_grad(t, bias); /* (out,) += column sums of dy */
        if (!db) return;
        for (int n = 0; n < N; n++)
            for (int o = 0; o < out; o++) db[o] += dy[(size_t)n * out + o];
    }
}

Var *nn_linear(Tape *t, Var *x, Var *w, Var *bias) {
    if (!x || !w) return NULL;
    char sx[64], sw[64], sb[64];
    if (x->value.ndim != 2 || w->value.ndim != 2 || x->value.shape[1] != w->value.shape[1]) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "linear: input %s does not fit weight %s (want (N, in) and (out, in))",
                     SHAPE_STR(x, sx), SHAPE_STR(w, sw));
        return NULL;
    }
    int N = x->value.shape[0], in = x->value.shape[1], out = w->value.shape[0];
    if (bias && (bias->value.ndim != 1 || bias->value.shape[0] != out)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "linear: bias %s does not match weight %s (want (%d,))", SHAPE_STR(bias, sb),
                     SHAPE_STR(w, sw), out);
        return NULL;
    }
    Var *y = tape_new_var(t, 2, (int[]){N, out});
    if (!y) return NULL;
    /* Broadcast the bias into y first so the GEMM adds onto it (beta = 1):
     * one pass over y instead of two. */
    float beta = 0.0f;
    if (bias) {
        for (int n = 0; n < N; n++) memcpy(y->value.data + (size_t)n * out, bias->value.data, (size_t)out * sizeof(float));
        beta = 1.0f;
    }
    gemm_f32(false, true, N, out, in, 1.0f, x->value.data, in, w->value.data, in, beta, y->value.data, out);
    return tape_record(t, "linear", linear_backward, y, (Var *[]){x, w, bias}, 3, NULL) ? y : NULL;
}

/* ---- bias add, add, scale ------------------------------------------------ */

/* x viewed as (outer, C, inner): (N, C) has inner 1; (N, C, H, W) inner H*W. */
/* y[b][c][:] = x[b][c][:] + bias[c]: one bias value per (example, channel) plane, a vectorised inner loop with no
 * division per element (the folded batch-norm shift of a biasless conv runs through here on every PTQ eval
 * batch). y, x: (N, C, inner). */
NN_SIMD_CLONES static void bias_add_planes(float *y, const float *x, const float *bias, int N, int C, size_t inner) {
    for (int b = 0; b < N; b++)
        for (int c = 0; c < C; c++) {
            const size_t off = ((size_t)b * C + c) * inner;
            const float bv = bias[c];
            for (size_t j = 0; j < inner; j++) y[off + j] = x[off + j] + bv;
        }
}

static void bias_add_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0], *bias = node->in[1];
    const float *dy = node->out->grad;
    size_t n = var_numel(x);
    if (x->requires_grad) {
        float *dx = tape_grad(t, x);
        if (!dx) return;
        for (size_t i = 0; i < n; i++) dx[i] += dy[i];
    }
    if (bias->requires_grad) {
        float *db = tape_grad(t, bias);
        if (!db) return;
        int N = x->value.shape[0], C = x->value.shape[1];
        size_t inner = n / ((size_t)N * C);
        /* per channel, the same additions in the same order as one pass over dy (so the same bits), without a
           division per element */
        for (int b = 0; b < N; b++)
            for (int c = 0; c < C; c++) {
                const float *src = dy + ((size_t)b * C + c) * inner;
                float acc = db[c];
                for (size_t j = 0; j < inner; j++) acc += src[j];
                db[c] = acc;
            }
    }
}

Var *nn_bias_add(Tape *t, Var *x, Var *bias) {
    if (!x || !bias) return NULL;
    char sx[64], sb[64];
    if (x->value.ndim < 2 || bias->value.ndim != 1 || bias->value.shape[0] != x->value.shape[1]) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "bias_add: bias %s does not match axis 1 of input %s", SHAPE_STR(bias, sb),
                     SHAPE_STR(x, sx));
        return NULL;
    }
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    if (!y) return NULL;
    size_t n = var_numel(x);
    int N = x->value.shape[0], C = x->value.shape[1];
    size_t inner = n / ((size_t)N * C);
    bias_add_planes(y->value.data, x->value.data, bias->value.data, N, C, inner);
    return tape_record(t, "bias_add", bias_add_backward, y, (Var *[]){x, bias}, 2, NULL) ? y : NULL;
}

/* y = a + b (b NULL: y += a) over [0, n), in contiguous ranges over the pool from ADD_PARALLEL_MIN elements
 * on (the same values however they are split): a residual block's add is a pass over a whole activation. */
#define ADD_PARALLEL_MIN (1 << 16)

typedef struct {
    float *y;
    const float *a, *b;
    size_t n;
    bool copy; /* y = a (b NULL) */
    bool relu; /* y = relu(a + b) (b not NULL): v > 0 ? v : 0, as nn_relu_inplace */
} AddJob;

/* y may be a (x + x: the backward's dy buffer is the first input's gradient, then added to): no restrict. */
static void add_range(float *y, const float *a, const float *b, size_t n, bool copy, bool relu) {
    if (copy) memcpy(y, a, n * sizeof *y);
    else if (b && relu)
        for (size_t i = 0; i < n; i++) {
            const float v = a[i] + b[i];
            y[i] = v > 0.0f ? v : 0.0f;
        }
    else if (b)
        for (size_t i = 0; i < n; i++) y[i] = a[i] + b[i];
    else
        for (size_t i = 0; i < n; i++) y[i] += a[i];
}

static void add_task(void *ctx, int task, int n_tasks) {
    const AddJob *j = ctx;
    const size_t lo = j->n * (size_t)task / (size_t)n_tasks, hi = j->n * (size_t)(task + 1) / (size_t)n_tasks;
    add_range(j->y + lo, j->a + lo, j->b ? j->b + lo : NULL, hi - lo, j->copy, j->relu);
}

/* y = a + b (relu'd with relu), y += a (b NULL), or with copy y = a: over the pool from ADD_PARALLEL_MIN elements
 * (a copy of a batch's activations on one thread left the other waiting). */
static void add_run_as(float *y, const float *a, const float *b, size_t n, bool copy, bool relu) {
    if (n < ADD_PARALLEL_MIN || parallel_get_threads() == 1) {
        add_range(y, a, b, n, copy, relu);
        return;
    }
    AddJob j = {y, a, b, n, copy, relu};
    parallel_run(parallel_get_threads(), add_task, &j);
}

/* The first input without a gradient yet takes dy's buffer as its own (no
 * copy), a second one gets a copy, and an input that has one adds dy in. */
static void add_backward(Tape *t, const TapeNode *node) {
    const float *dy = node->out->grad;
    size_t n = var_numel(node->out);
    bool taken = false; /* dy's buffer has one owner at most */
    for (int k = 0; k < 2; k++) {
        Var *v = node->in[k];
        if (!v->requires_grad) continue;
        if (!taken && tape_grad_take(t, v, node->out)) {
            taken = true;
            continue;
        }
        bool fresh;
        float *dv = tape_grad_to_write(t, v, &fresh);
        if (!dv) return;
        add_run_as(dv, dy, NULL, n, fresh, false);
    }
}

/* y = a + b where a or b is a batch norm's view (nn_batchnorm_view): plane by plane (sample, channel), each made
 * through its view as it is added (batchnorm_view_add), over the pool in ranges of planes. Both views: y = view a,
 * then y = view b + y, the same sum (a + b == b + a in floats). */
typedef struct {
    float *y;         /* (N, C, inner) */
    const Var *a, *b; /* (N, C, inner), one or both with a view */
    bool relu;        /* y = relu(a + b) */
    int C;
    size_t inner;
    int planes;       /* N C */
} AddViewJob;

static void add_view_task(void *ctx, int task, int n_tasks) {
    const AddViewJob *j = ctx;
    int p0, p1;
    parallel_range(j->planes, task, n_tasks, &p0, &p1);
    for (int p = p0; p < p1; p++) {
        const int c = p % j->C;
        const size_t off = (size_t)p * j->inner;
        float *y = j->y + off;
        const Var *u = j->a->view ? j->a : j->b, *other = j->a->view ? j->b : j->a; /* u: a view */
        const NnAffineRelu *v = u->view;
        const float *s = other->view ? NULL : other->value.data + off;
        batchnorm_view_add(y, v->x->value.data + off, s, j->inner, v->mean[c], v->scale[c], v->beta ? v->beta[c] : 0.0f,
                           !v->affine_only, j->relu && s);
        if (!other->view) continue;
        v = other->view;
        batchnorm_view_add(y, v->x->value.data + off, y, j->inner, v->mean[c], v->scale[c], v->beta ? v->beta[c] : 0.0f,
                           !v->affine_only, j->relu);
    }
}

static Var *add_forward(Tape *t, Var *a, Var *b, bool relu) {
    if (!a || !b) return NULL;
    char sa[64], sb[64];
    if (!tensor_same_shape(&a->value, &b->value)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "add: shapes differ: %s and %s", SHAPE_STR(a, sa), SHAPE_STR(b, sb));
        return NULL;
    }
    if ((a->view || b->view) && a->value.ndim < 2) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "add: a batch norm's view %s must be (N, C, ...)", SHAPE_STR(a, sa));
        return NULL;
    }
    Var *y = tape_new_var(t, a->value.ndim, a->value.shape);
    if (!y) return NULL;
    if (a->view || b->view) {
        const int N = a->value.shape[0], C = a->value.shape[1];
        AddViewJob j = {y->value.data, a, b, relu, C, N && C ? var_numel(a) / ((size_t)N * C) : 0, N * C};
        /* 4 tasks a thread over a whole activation, as the batch norm's passes */
        parallel_run(var_numel(a) >= ADD_PARALLEL_MIN ? 4 * parallel_get_threads() : 1, add_view_task, &j);
    } else {
        add_run_as(y->value.data, a->value.data, b->value.data, var_numel(a), false, relu);
    }
    return tape_record_value_free(t, "add", add_backward, y, (Var *[]){a, b}, 2, NULL) ? y : NULL;
}

Var *nn_add(Tape *t, Var *a, Var *b) { return add_forward(t, a, b, false); }

Var *nn_add_relu(Tape *t, Var *a, Var *b) { return add_forward(t, a, b, true); }

/* ---- concat along the channel axis ---------------------------------------- */

/* Every input, as a tape node holds at most TAPE_MAX_INPUTS of them: the node
 * records one representative input (one that needs a gradient, if any, so
 * tape_record decides as it would on the whole list), and the backward
 * accumulates into every input listed here. */
typedef struct {
    Var **xs;     /* [n] */
    int n;
    int N;        /* outer size: shape[0] */
    size_t inner; /* product of the dims after axis 1 */
    int C_out;    /* sum of the inputs' channels */
} ConcatCtx;

/* Sample s of input k is a block of Ck*inner floats at channel offset ck of
 * the output's sample s. */
static void concat_backward(Tape *t, const TapeNode *node) {
    const ConcatCtx *c = node->ctx;
    const float *dy = node->out->grad;
    size_t off = 0; /* channel offset * inner */
    for (int k = 0; k < c->n; k++) {
        Var *v = c->xs[k];
        const size_t block = (size_t)v->value.shape[1] * c->inner;
        if (v->requires_grad) {
            bool fresh;
            float *dv = tape_grad_to_write(t, v, &fresh);
            if (!dv) return;
            for (int s = 0; s < c->N; s++) {
                const float *src = dy + (size_t)s * c->C_out * c->inner + off;
                float *dst = dv + (size_t)s * block;
                if (fresh)
                    memcpy(dst, src, block * sizeof *dst);
                else
                    for (size_t i = 0; i < block; i++) dst[i] += src[i];
            }
        }
        off += block;
    }
}

Var *nn_concat(Tape *t, Var *const *xs, int n) {
    if (!xs || n < 1) {
        qt_error_set(&t->err, QT_ERR_ARG, "concat: needs at least one input, got %d", n);
        return NULL;
    }
    for (int k = 0; k < n; k++)
        if (!xs[k]) return NULL;
    const Tensor *x0 = &xs[0]->value;
    char s0[64], sk[64];
    if (x0->ndim < 2) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "concat: input 0 %s has no channel axis (want (N, C, ...))",
                     SHAPE_STR(xs[0], s0));
        return NULL;
    }
    int C_out = 0;
    Var *rep = xs[0]; /* an input that needs a gradient, if any: decides whether a node is recorded */
    for (int k = 0; k < n; k++) {
        const Tensor *xk = &xs[k]->value;
        bool fits = xk->ndim == x0->ndim && xk->shape[0] == x0->shape[0];
        for (int d = 2; fits && d < x0->ndim; d++) fits = xk->shape[d] == x0->shape[d];
        if (!fits) {
            qt_error_set(&t->err, QT_ERR_SHAPE, "concat: input %d %s does not fit input 0 %s: all dims but the "
                         "channel axis 1 must be equal", k, SHAPE_STR(xs[k], sk), SHAPE_STR(xs[0], s0));
            return NULL;
        }
        C_out += xk->shape[1];
        if (xs[k]->requires_grad && !rep->requires_grad) rep = xs[k];
    }
    int shape[TENSOR_MAX_DIMS];
    memcpy(shape, x0->shape, sizeof shape);
    shape[1] = C_out;
    Var *y = tape_new_var(t, x0->ndim, shape);
    ConcatCtx *c = tape_alloc(t, sizeof *c);
    Var **list = tape_alloc(t, (size_t)n * sizeof *list);
    if (!y || !c || !list) return NULL;
    memcpy(list, xs, (size_t)n * sizeof *list);
    const size_t inner = var_numel(xs[0]) / ((size_t)x0->shape[0] * x0->shape[1]);
    *c = (ConcatCtx){list, n, x0->shape[0], inner, C_out};
    size_t off = 0;
    for (int k = 0; k < n; k++) {
        const size_t block = (size_t)xs[k]->value.shape[1] * inner;
        for (int s = 0; s < c->N; s++)
            memcpy(y->value.data + (size_t)s * C_out * inner + off, xs[k]->value.data + (size_t)s * block,
                   block * sizeof(float));
        off += block;
    }
    return tape_record_value_free(t, "concat", concat_backward, y, (Var *[]){rep}, 1, c) ? y : NULL;
}

static void scale_backward(Tape *t, const TapeNode *node) {
    float s = *(const float *)node->ctx;
    float *dx = tape_grad(t, node->in[0]);
    if (!dx) return;
    const float *dy = node->out->grad;
    for (size_t i = 0, n = var_numel(node->out); i < n; i++) dx[i] += s * dy[i];
}

Var *nn_scale(Tape *t, Var *x, float s) {
    if (!x) return NULL;
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    float *ctx = tape_alloc(t, sizeof *ctx);
    if (!y || !ctx) return NULL;
    *ctx = s;
    for (size_t i = 0, n = var_numel(x); i < n; i++) y->value.data[i] = s * x->value.data[i];
    return tape_record(t, "scale", scale_backward, y, (Var *[]){x}, 1, ctx) ? y : NULL;
}

/* ---- activations: kernels ------------------------------------------------ */

NN_SIMD_CLONES
void relu_forward(float *restrict y, const float *restrict x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}
NN_SIMD_CLONES
void relu_backward(float *restrict dx, const float *restrict dy, const float *restrict y, size_t n) {
    /* dy is loaded unconditionally so the select needs no branch. */
    for (size_t i = 0; i < n; i++) {
        float g = dy[i];
        dx[i] += y[i] > 0.0f ? g : 0.0f;
    }
}
NN_SIMD_CLONES
void relu_backward_write(float *dx, const float *dy, const float *restrict y, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float g = dy[i];
        dx[i] = y[i] > 0.0f ? g : 0.0f;
    }
}

#define GELU_K0 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_K1 0.044715f

void gelu_forward(float *restrict y, const float *restrict x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        y[i] = 0.5f * v * (1.0f + tanhf(GELU_K0 * (v + GELU_K1 * v * v * v)));
    }
}
void gelu_backward(float *restrict dx, const float *restrict dy, const float *restrict x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        float th = tanhf(GELU_K0 * (v + GELU_K1 * v * v * v));
        float dinner = GELU_K0 * (1.0f + 3.0f * GELU_K1 * v * v);
        dx[i] += dy[i] * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * dinner);
    }
}

void tanh_forward(float *restrict y, const float *restrict x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = tanhf(x[i]);
}
void tanh_backward(float *restrict dx, const float *restrict dy, const float *restrict y, size_t n) {
    for (size_t i = 0; i < n; i++) dx[i] += dy[i] * (1.0f - y[i] * y[i]);
}

void sigmoid_forward(float *restrict y, const float *restrict x, size_t n) {
    /* Two branches so exp never overflows. */
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        if (v >= 0.0f) {
            y[i] = 1.0f / (1.0f + expf(-v));
        } else {
            float e = expf(v);
            y[i] = e / (1.0f + e);
        }
    }
}
void sigmoid_backward(float *restrict dx, const float *restrict dy, const float *restrict y, size_t n) {
    for (size_t i = 0; i < n; i++) dx[i] += dy[i] * y[i] * (1.0f - y[i]);
}

/* ---- activations: tape ops ----------------------------------------------- */

typedef void (*UnaryForward)(float *y, const float *x, size_t n);

/* Elementwise forwards of at least this many elements run over the pool in
 * contiguous ranges (the same values however they are split). */
#define UNARY_PARALLEL_MIN (1 << 17)

typedef struct {
    UnaryForward fn;
    float *y;
    const float *x;
    size_t n;
} UnaryJob;

static void unary_range_task(void *ctx, int task, int n_tasks) {
    const UnaryJob *j = ctx;
    size_t lo = j->n * (size_t)task / (size_t)n_tasks, hi = j->n * (size_t)(task + 1) / (size_t)n_tasks;
    j->fn(j->y + lo, j->x + lo, hi - lo);
}

static void unary_forward(UnaryForward fn, float *y, const float *x, size_t n) {
    if (n < UNARY_PARALLEL_MIN || parallel_get_threads() == 1) {
        fn(y, x, n);
        return;
    }
    UnaryJob j = {fn, y, x, n};
    parallel_run(parallel_get_threads(), unary_range_task, &j);
}

/* Backward from the output (relu, tanh, sigmoid) or from the input (gelu). */
#define DEFINE_UNARY(name, save_input)                                                     \
    static void name##_tape_backward(Tape *t, const TapeNode *node) {                      \
        float *dx = tape_grad(t, node->in[0]);                                             \
        if (!dx) return;                                                                   \
        const float *saved = (save_input) ? node->in[0]->value.data : node->out->value.data; \
        name##_backward(dx, node->out->grad, saved, var_numel(node->out));                 \
    }                                                                                      \
    Var *nn_##name(Tape *t, Var *x) {                                                      \
        if (!x) return NULL;                                                               \
        Var *y = tape_new_var(t, x->value.ndim, x->value.shape);                           \
        if (!y) return NULL;                                                               \
        unary_forward(name##_forward, y->value.data, x->value.data, var_numel(x));         \
        return tape_record(t, #name, name##_tape_backward, y, (Var *[]){x}, 1, NULL) ? y : NULL; \
    }

typedef struct {
    float *dx;
    const float *dy, *y;
    size_t n;
    bool write;
} ReluBackJob;

static void relu_back_task(void *ctx, int task, int n_tasks) {
    const ReluBackJob *j = ctx;
    const size_t lo = j->n * (size_t)task / (size_t)n_tasks, hi = j->n * (size_t)(task + 1) / (size_t)n_tasks;
    if (j->write) relu_backward_write(j->dx + lo, j->dy + lo, j->y + lo, hi - lo);
    else relu_backward(j->dx + lo, j->dy + lo, j->y + lo, hi - lo);
}

/* relu_backward_write (write) or relu_backward over the pool in contiguous ranges, as the forwards run: the same
 * values however they are split. dx may be dy (in place: each range reads its own floats before writing them). */
static void relu_backward_run(float *dx, const float *dy, const float *y, size_t n, bool write) {
    ReluBackJob j = {dx, dy, y, n, write};
    if (n < UNARY_PARALLEL_MIN || parallel_get_threads() == 1) relu_back_task(&j, 0, 1);
    else parallel_run(parallel_get_threads(), relu_back_task, &j);
}

/* relu's: in place in dy's buffer when x has no gradient yet (the common
 * case: x feeds only this relu), else written or added (relu_backward*). */
void nn_relu_tape_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0];
    const size_t n = var_numel(node->out);
    const float *y = node->out->value.data, *dy = node->out->grad;
    if (tape_grad_take(t, x, node->out)) {
        relu_backward_run(x->grad, dy, y, n, true);
        return;
    }
    bool fresh;
    float *dx = tape_grad_to_write(t, x, &fresh);
    if (!dx) return;
    relu_backward_run(dx, dy, y, n, fresh);
}

Var *nn_relu(Tape *t, Var *x) {
    if (!x) return NULL;
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    if (!y) return NULL;
    unary_forward(relu_forward, y->value.data, x->value.data, var_numel(x));
    return tape_record(t, "relu", nn_relu_tape_backward, y, (Var *[]){x}, 1, NULL) ? y : NULL;
}

/* unary_forward's form of relu over y's own values (x is y). */
NN_SIMD_CLONES
static void relu_forward_self(float *y, const float *x, size_t n) {
    (void)x;
    for (size_t i = 0; i < n; i++) y[i] = y[i] > 0.0f ? y[i] : 0.0f;
}

static Var *relu_inplace(Tape *t, Var *x, bool applied) {
    if (!x) return NULL;
    Var *y = tape_wrap(t, x->value.data, x->value.ndim, x->value.shape);
    if (!y) return NULL;
    if (!applied) unary_forward(relu_forward_self, y->value.data, y->value.data, var_numel(y));
    return tape_record(t, "relu", nn_relu_tape_backward, y, (Var *[]){x}, 1, NULL) ? y : NULL;
}

Var *nn_relu_inplace(Tape *t, Var *x) { return relu_inplace(t, x, false); }

Var *nn_relu_inplace_applied(Tape *t, Var *x) { return relu_inplace(t, x, true); }

DEFINE_UNARY(gelu, true)
DEFINE_UNARY(tanh, false)
DEFINE_UNARY(sigmoid, false)

/* ---- dropout -------------------------------------------------------------- */

/* The scaled mask (0 or 1/(1-p)) is saved; backward is dy * mask. */
static void dropout_backward(Tape *t, const TapeNode *node) {
    const float *mask = node->ctx;
    float *dx = tape_grad(t, node->in[0]);
    if (!dx) return;
    const float *dy = node->out->grad;
    for (size_t i = 0, n = var_numel(node->out); i < n; i++) dx[i] += dy[i] * mask[i];
}

Var *nn_dropout(Tape *t, Var *x, float p) {
    if (!x) return NULL;
    if (!(p >= 0.0f && p < 1.0f)) {
        qt_error_set(&t->err, QT_ERR_ARG, "dropout: p must be in [0, 1), got %g", (double)p);
        return NULL;
    }
    if (!t->training || p == 0.0f) return x;
    if (!t->rng) {
        qt_error_set(&t->err, QT_ERR_ARG, "dropout: the tape has no RNG (give tape_init one)");
        return NULL;
    }
    size_t n = var_numel(x);
    Var *y = tape_new_var(t, x->value.ndim, x->value.shape);
    float *mask = tape_alloc(t, n * sizeof(float));
    if (!y || !mask) return NULL;
    rng_fill_uniform(t->rng, mask, n, 0.0f, 1.0f);
    const float keep_scale = 1.0f / (1.0f - p);
    for (size_t i = 0; i < n; i++) {
        mask[i] = mask[i] >= p ? keep_scale : 0.0f;
        y->value.data[i] = x->value.data[i] * mask[i];
    }
    return tape_record(t, "dropout", dropout_backward, y, (Var *[]){x}, 1, mask) ? y : NULL;
}

/* ---- reshape / flatten ----------------------------------------------------- */

static void reshape_backward(Tape *t, const TapeNode *node) {
    float *dx = tape_grad(t, node->in[0]);
    if (!dx) return;
    const float *dy = node->out->grad;
    for (size_t i = 0, n = var_numel(node->out); i < n; i++) dx[i] += dy[i];
}

Var *nn_reshape(Tape *t, Var *x, int ndim, const int *shape) {
    if (!x) return NULL;
    Tensor want = {0};
    char sx[64], sw[64];
    if (!tensor_set_shape(&want, ndim, shape)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "reshape: invalid target shape for input %s (ndim %d, dims must be >= 1)",
                     SHAPE_STR(x, sx), ndim);
        return NULL;
    }
    if (tensor_numel(&want) != var_numel(x)) {
        qt_error_set(&t->err, QT_ERR_SHAPE, "reshape: cannot view %s (%zu elements) as %s (%zu elements)",
                     SHAPE_STR(x, sx), var_numel(x), tensor_shape_str(&want, sw, sizeof sw), tensor_numel(&want));
        return NULL;
    }
    Var *y = tape_wrap(t, x->value.data, ndim, shape); /* shares the values */
    if (!y) return NULL;
    return tape_record(t, "reshape", reshape_backward, y, (Var *[]){x}, 1, NULL) ? y : NULL;
}

Var *nn_flatten(Tape *t, Var *x) {
    if (!x) return NULL;
    int n = x->value.shape[0];
    return nn_reshape(t, x, 2, (int[]){n, (int)(var_numel(x) / (size_t)n)});
}
