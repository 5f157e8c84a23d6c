/* ops_conv_lowrank.c - the convolution with a low-rank term on its weight,
 * w + scale * B A, as a LoRA adapter on a conv2d layer computes it, with
 * the relu / 2x2 max pool epilogues of nn_conv2d_fused.
 *
 * The forward and the input gradient run on the merged weight (formed once
 * per call) in ops_conv.c's chunks, so the adapter shares each chunk's
 * im2col with the base. A's and B's gradients take one of three routes
 * (ConvLowRankGrad), which conv_lowrank_grad_choose picks from the sizes;
 * the tests force each one through conv2d_lowrank_with_grad. */
#include "ops_conv_internal.h"

#include <string.h>

#include "gemm.h"
#include "base/parallel.h"

/* The saved state of one low-rank convolution, for its backward. */
typedef struct {
    Conv2dCtx conv;       /* the convolution's own: geometry, epilogue, pooling winners */
    int rank;
    float scale;
    ConvLowRankGrad grad; /* never CONV_LR_GRAD_AUTO */
    /* (OC + rank, C*KH*KW + rank): rows [0, OC) hold [w' | scale B] with
     * w' = w + scale B A, rows OC.. hold [A | 0]. The forward reads its
     * first C*KH*KW columns: w' for the output, A for the A col that dB
     * wants. The input gradient reads its first OC rows transposed,
     * [w' | scale B]^T, so one product gives dcol and dt = scale B^T dpre. */
    float *w_merged;
    int ldw;              /* w_merged's row length, C*KH*KW + rank */
    float *u;             /* (rank, N OH OW) A x, saved by the forward for dB; NULL when not wanted */
} ConvLowRankCtx;

/* A pass's work: the convolution's, plus the adapter's partials. */
typedef struct {
    ConvJob job;          /* w: w_merged, ldw: its row length */
    const ConvLowRankCtx *lc;
    /* (n_tasks, rank, C*KH*KW) per-task dA, or NULL; with CONV_LR_GRAD_DTCOL
     * (n_tasks, rank*KH*KW, C) with the kernel flipped (conv_da_from_dt_col) */
    float *da_part;
    float *dbb_part;      /* (n_tasks, OC, rank) per-task dB, or NULL */
} ConvLowRankJob;

/* Which is cheaper for A's and B's gradients: through the full weight
 * gradient G = dpre col^T (OC x C*KH*KW per output position), as dA =
 * scale B^T G and dB = scale G A^T once per pass, or through the adapter's
 * own products (A col, dB, B^T dpre, dA: 2 rank (C*KH*KW + OC) per
 * position). A first convolution's few input taps make it the full one:
 * the reference CNN's conv1 needs 288 multiply-adds a position that way
 * against 656. Otherwise the "same" stride-1 geometry, whose im2col rows
 * are shifted planes, takes dA from dt's im2col (conv_da_from_dt_col), the
 * rest from x's. */
ConvLowRankGrad conv_lowrank_grad_choose(const ConvDims *d, int rank, int stride, int padding) {
    if ((long long)d->OC * conv_ckk(d) <= 2LL * rank * (conv_ckk(d) + d->OC)) return CONV_LR_GRAD_FULL;
    return conv_same_stride1(d->H, d->W, d->KH, d->KW, stride, padding, d->OH, d->OW) ? CONV_LR_GRAD_DTCOL
                                                                                       : CONV_LR_GRAD_COL;
}

/* ---- forward ------------------------------------------------------------------------------------------------ */

static void conv_lowrank_forward_task(void *ctx, int task, int n_tasks) {
    const ConvLowRankJob *lj = ctx;
    const ConvJob *j = &lj->job;
    const ConvLowRankCtx *lc = lj->lc;
    const ConvDims *d = &lc->conv.d;
    const int ckk = conv_ckk(d), r = lc->rank, chunk = lc->conv.chunk;
    const size_t plane = conv_plane(d);
    float *col = conv_thread_scratch(j), *prod = col + j->col_floats;
    int lo, hi;
    parallel_range_falling(d->N, task, n_tasks, &lo, &hi);
    for (int n0 = lo; n0 < hi; n0 += chunk) {
        const int nc = hi - n0 < chunk ? hi - n0 : chunk, cols = nc * (int)plane;
        /* col, or x itself (a pointwise sample); through the taps, u's A x made with the output (job.taps_u) */
        const float *xcol = conv_forward_chunk(j, col, prod, n0, nc);
        if (!lc->u || j->taps) continue;
        /* A col in a second product, not as r more rows of the first: sgemm
         * may take another kernel path for more rows, and the output must
         * not depend on whether A col is wanted (B = 0 gives the base's
         * output bit for bit). */
        gemm_f32(false, false, r, cols, ckk, 1.0f, j->w + (size_t)d->OC * j->ldw, j->ldw, xcol, cols, 0.0f,
                 prod + (size_t)d->OC * cols, cols);
        for (int i = 0; i < r; i++) /* kept for dB: row i of the chunk's samples, where it lies in u */
            memcpy(lc->u + (size_t)i * d->N * plane + (size_t)n0 * plane, prod + (size_t)(d->OC + i) * cols,
                   (size_t)cols * sizeof(float));
    }
}

/* ---- backward ----------------------------------------------------------------------------------------------- */

/* dB += scale dpre (A x)^T for the chunk of cols columns from sample n0, from the A x
 * the forward kept: one product over the chunk's columns (u holds them side
 * by side, as dpre does; a product per sample cost as long as its sums). */
static void conv_backward_db(const ConvLowRankJob *lj, const float *dpre, int n0, int cols, int task, bool first) {
    const ConvLowRankCtx *lc = lj->lc;
    const int OC = lc->conv.d.OC, r = lc->rank, N = lc->conv.d.N;
    const size_t plane = conv_plane(&lc->conv.d);
    gemm_f32(false, true, OC, r, cols, lc->scale, dpre, cols, lc->u + (size_t)n0 * plane, (int)((size_t)N * plane),
             first ? 0.0f : 1.0f, lj->dbb_part + (size_t)task * OC * r, r);
}

/* dA's share of chunk samples [n0, n0 + nc) in the "same" stride-1 case:
 *     dA[i, c, kh, kw] = sum_p dt[i, p] x[c, p + (kh - pad, kw - pad)]
 *                      = sum_p dt[i, p + (pad - kh, pad - kw)] x[c, p],
 * so with dtcol the im2col of dt (rank*KH*KW, OH*OW) it is dtcol x^T
 * (rank*KH*KW, C) with the kernel flipped (pad - kh = kh' - pad for
 * kh' = KH-1-kh). x needs no im2col, and the product's shape suits sgemm
 * far better than dt col^T's rank by C*KH*KW: for the reference CNN's conv2
 * (72 by 32 against 8 by 288, 196 long) OpenBLAS runs it ~2.7x faster. dt:
 * (rank, cols) for the chunk; dtcol: (rank*KH*KW, OH*OW) scratch. */
/* Floats of one task's dA partial: room for every form (with the taps kernels (C*KH*KW, conv_taps_oc_pad(rank)),
 * the transposed form conv_taps_dw writes). */
static size_t conv_da_part_floats(const ConvLowRankCtx *lc) {
    return (size_t)conv_ckk(&lc->conv.d) * conv_taps_oc_pad(lc->rank);
}

static void conv_da_from_dt_col(const ConvLowRankJob *lj, const float *dt, float *dtcol, int n0, int nc, int cols,
                                int task, bool first) {
    const ConvLowRankCtx *lc = lj->lc;
    const ConvDims *d = &lc->conv.d;
    const int r = lc->rank, kk = d->KH * d->KW, padding = lc->conv.padding;
    const size_t plane = conv_plane(d), x_sample = (size_t)d->C * plane;
    for (int s = 0; s < nc; s++) {
        for (int i = 0; i < r; i++)
            for (int kh = 0; kh < d->KH; kh++)
                for (int kw = 0; kw < d->KW; kw++)
                    conv_shift_plane(dtcol + ((size_t)i * kk + kh * d->KW + kw) * plane,
                                     dt + (size_t)i * cols + s * plane, d->H, d->W, kh - padding, kw - padding);
        gemm_f32(false, true, r * kk, d->C, (int)plane, 1.0f, dtcol, (int)plane,
                 lj->job.x + (size_t)(n0 + s) * x_sample, (int)plane, first && s == 0 ? 0.0f : 1.0f,
                 lj->da_part + (size_t)task * conv_da_part_floats(lc), d->C);
    }
}

/* g (rank, C, KH, KW) += the per-task partials of conv_da_from_dt_col
 * (n_tasks, rank*KH*KW, C), unflipped, summed in task order. */
static void conv_add_da_flipped(float *g, const float *parts, const ConvDims *d, int r, int n_tasks, size_t stride) {
    const int kk = d->KH * d->KW;
    for (int k = 0; k < n_tasks; k++) {
        const float *p = parts + (size_t)k * stride;
        for (int i = 0; i < r; i++)
            for (int ch = 0; ch < d->C; ch++)
                for (int kh = 0; kh < d->KH; kh++)
                    for (int kw = 0; kw < d->KW; kw++)
                        g[(((size_t)i * d->C + ch) * d->KH + kh) * d->KW + kw] +=
                            p[((size_t)i * kk + (d->KH - 1 - kh) * d->KW + (d->KW - 1 - kw)) * d->C + ch];
    }
}

/* conv_lowrank_backward_task on the taps (job.taps): per chunk, dpre; the chunk's padded inputs; the weight
 * gradient from them; dB from the A x the forward kept; dt = scale B^T dpre and dA from dt and the padded inputs
 * (the weight gradient's kernel with rank rows); dx from each sample's padded dpre with the merged weight
 * transposed. The weight gradient's and dA's partials are transposed (C*KH*KW, conv_taps_oc_pad(rows)), whatever
 * lc->grad; dt and its transpose lie after dpre. */
static void conv_lowrank_backward_taps(const ConvLowRankJob *lj, int task, int n_tasks) {
    const ConvJob *j = &lj->job;
    const ConvLowRankCtx *lc = lj->lc;
    const ConvDims *d = &lc->conv.d;
    const ConvTaps *p = j->taps;
    const int ckk = conv_ckk(d), r = lc->rank, chunk = conv_job_chunk(j);
    const size_t plane = conv_plane(d), x_sample = (size_t)d->C * plane;
    float *col = conv_thread_scratch(j), *dpre = col + j->col_floats, *dt = dpre + j->prod_floats;
    float *dpt = conv_taps_dpt(j, col);                                    /* one sample's dpre transposed */
    float *dtt = lj->da_part ? dt + (size_t)r * chunk * plane : NULL;       /* and its dt (only with dA: room) */
    float *dw = j->dw_part ? j->dw_part + (size_t)task * conv_dw_part_floats(d) : NULL; /* (C*KH*KW, ldd) */
    ConvTaps pa = *p; /* dA: the weight gradient of rank rows */
    pa.OC = r;
    int lo, hi;
    parallel_range_falling(d->N, task, n_tasks, &lo, &hi);
    for (int n0 = lo; n0 < hi; n0 += chunk) {
        const int nc = hi - n0 < chunk ? hi - n0 : chunk, cols = nc * (int)plane;
        const double flops = 2.0 * ckk * (double)cols;
        conv_pre_grads(j, dpre, n0, nc, task);
        double t0 = gemm_stats_start();
        if (dw || lj->da_part) conv_taps_pad_rows(p, col, j->x + (size_t)n0 * x_sample, d->C, nc, x_sample, plane);
        for (int s = 0; dw && s < nc; s++) {
            conv_taps_dp_t(p, j->taps_level, dpt, dpre + (size_t)s * plane, (size_t)cols, 0, d->OC, 1);
            conv_taps_dw(p, j->taps_level, dw, dpt, col + (size_t)s * d->C * p->pplane, 1, n0 != lo || s > 0);
        }
        gemm_stats_add(t0, dw ? d->OC * flops : 0.0);
        if (lj->dbb_part) conv_backward_db(lj, dpre, n0, cols, task, n0 == lo);
        if (lj->da_part) {
            gemm_f32(true, false, r, cols, d->OC, 1.0f, j->w + ckk, j->ldw, dpre, cols, 0.0f, dt, cols);
            t0 = gemm_stats_start();
            for (int s = 0; s < nc; s++) {
                conv_taps_dp_t(&pa, j->taps_level, dtt, dt + (size_t)s * plane, (size_t)cols, 0, r, 1);
                conv_taps_dw(&pa, j->taps_level, lj->da_part + (size_t)task * conv_da_part_floats(lc), dtt,
                             col + (size_t)s * d->C * p->pplane, 1, n0 != lo || s > 0);
            }
            gemm_stats_add(t0, r * flops);
        }
        if (j->dx)
            conv_taps_dx_chunk(j, col + conv_taps_padded_rows_floats(p, d->C, nc), dpre, (size_t)cols, plane, n0, nc);
    }
}

/* One chunk's backward with the adapter's own products (CONV_LR_GRAD_COL,
 * CONV_LR_GRAD_DTCOL): dpre, then the weight gradient and dB, then one
 * product for the input gradient's dcol and (with A's gradient wanted) dt =
 * scale B^T dpre, dA from dt, and col2im. */
static void conv_lowrank_backward_task(void *ctx, int task, int n_tasks) {
    const ConvLowRankJob *lj = ctx;
    const ConvJob *j = &lj->job;
    const ConvLowRankCtx *lc = lj->lc;
    const Conv2dCtx *c = &lc->conv;
    const ConvDims *d = &c->d;
    const int ckk = conv_ckk(d), r = lc->rank;
    const size_t plane = conv_plane(d), x_sample = (size_t)d->C * d->H * d->W;
    if (j->taps) {
        conv_lowrank_backward_taps(lj, task, n_tasks);
        return;
    }
    const bool want_dt = lj->da_part, dtcol_da = lc->grad == CONV_LR_GRAD_DTCOL;
    float *col = conv_thread_scratch(j), *dpre = col + j->col_floats, *after = dpre + j->prod_floats;
    float *dcol = want_dt && !dtcol_da ? after : col, *dtcol = after; /* dcol replaces col unless dA reads col */
    float *dw = j->dw_part ? j->dw_part + (size_t)task * conv_dw_part_floats(d) : NULL; /* (OC, C*KH*KW) */
    const bool need_col = dw || (want_dt && !dtcol_da);
    /* rows of w_merged^T to multiply: dcol's (for dx), then dt's */
    const int row_lo = j->dx ? 0 : ckk, row_hi = want_dt ? ckk + r : (j->dx ? ckk : 0);
    int lo, hi;
    parallel_range_falling(d->N, task, n_tasks, &lo, &hi);
    for (int n0 = lo; n0 < hi; n0 += c->chunk) {
        const int nc = hi - n0 < c->chunk ? hi - n0 : c->chunk, cols = nc * (int)plane;
        conv_pre_grads(j, dpre, n0, nc, task);
        if (need_col)
            im2col(col, j->x + (size_t)n0 * x_sample, nc, d->C, d->H, d->W, d->KH, d->KW, c->stride, c->padding,
                   d->OH, d->OW);
        if (dw) gemm_f32(false, true, d->OC, ckk, cols, 1.0f, dpre, cols, col, cols, n0 == lo ? 0.0f : 1.0f, dw, ckk);
        if (lj->dbb_part) conv_backward_db(lj, dpre, n0, cols, task, n0 == lo);
        if (row_hi > row_lo)
            gemm_f32(true, false, row_hi - row_lo, cols, d->OC, 1.0f, j->w + row_lo, j->ldw, dpre, cols, 0.0f,
                     dcol + (size_t)row_lo * cols, cols);
        if (want_dt) {
            const float *dt = dcol + (size_t)ckk * cols; /* (rank, cols) */
            if (dtcol_da) conv_da_from_dt_col(lj, dt, dtcol, n0, nc, cols, task, n0 == lo);
            else
                gemm_f32(false, true, r, ckk, cols, 1.0f, dt, cols, col, cols, n0 == lo ? 0.0f : 1.0f,
                         lj->da_part + (size_t)task * conv_da_part_floats(lc), ckk);
        }
        if (j->dx)
            col2im_consume(j->dx + (size_t)n0 * x_sample, dcol, nc, d->C, d->H, d->W, d->KH, d->KW, c->stride,
                           c->padding, d->OH, d->OW, j->dx_fresh);
    }
}

/* The per-thread scratch of conv_lowrank_backward_task: with dt wanted,
 * CONV_LR_GRAD_DTCOL widens col to hold dcol and dt and adds dt's im2col
 * one sample at a time; CONV_LR_GRAD_COL keeps dcol and dt apart from col,
 * which dA reads after the product. */
static float *conv_lowrank_scratch(Tape *t, ConvLowRankJob *lj) {
    const ConvLowRankCtx *lc = lj->lc;
    const ConvDims *d = &lc->conv.d;
    const size_t ckk = (size_t)conv_ckk(d), r = (size_t)lc->rank;
    if (lj->job.taps) /* col: padded inputs, one padded dpre and dpre transposed; after dpre, dt and its transpose */
        return conv_scratch(t, &lj->job, conv_col_rows(&lj->job, true), (size_t)d->OC,
                            lj->da_part ? (r * conv_job_chunk(&lj->job) + conv_taps_oc_pad((int)r)) * conv_plane(d)
                                        : 0);
    if (!lj->da_part) return conv_scratch(t, &lj->job, ckk, (size_t)d->OC, 0);
    if (lc->grad == CONV_LR_GRAD_DTCOL)
        return conv_scratch(t, &lj->job, ckk + r, (size_t)d->OC, r * d->KH * d->KW * conv_plane(d));
    return conv_scratch(t, &lj->job, ckk, (size_t)d->OC, (ckk + r) * lc->conv.chunk * conv_plane(d));
}

/* dA += scale B^T G and dB += scale G A^T, G (OC, C*KH*KW) the full weight
 * gradient, each if wanted. */
static void conv_low_rank_grads_from_full(Tape *t, const ConvLowRankCtx *lc, Var *A, Var *B, const float *G) {
    const int ckk = conv_ckk(&lc->conv.d), OC = lc->conv.d.OC, r = lc->rank;
    float *g;
    if (A->requires_grad && (g = tape_grad(t, A)))
        gemm_f32(true, false, r, ckk, OC, lc->scale, B->value.data, r, G, ckk, 1.0f, g, ckk);
    if (B->requires_grad && (g = tape_grad(t, B)))
        gemm_f32(false, true, OC, r, ckk, lc->scale, G, ckk, A->value.data, ckk, 1.0f, g, r);
}

/* Adds the task partials into w's, A's and B's gradients; with via_full,
 * G = the summed dW partials gives w's gradient and A's and B's. */
static void conv_lowrank_add_grads(Tape *t, const ConvLowRankJob *lj, Var *w, Var *A, Var *B, bool via_full,
                                   int tasks) {
    const ConvLowRankCtx *lc = lj->lc;
    const ConvDims *d = &lc->conv.d;
    const size_t nw = (size_t)d->OC * conv_ckk(d), na = (size_t)lc->rank * conv_ckk(d), nb = (size_t)d->OC * lc->rank;
    float *g;
    if (via_full) { /* the full gradient, summed in task order, then A's and B's from it */
        float *G = conv_buffer_take(t, nw * sizeof *G);
        if (!G) return;
        memset(G, 0, nw * sizeof *G);
        conv_add_dw_parts(&lj->job, G, tasks);
        if (w->requires_grad && (g = tape_grad(t, w)))
            for (size_t i = 0; i < nw; i++) g[i] += G[i];
        conv_low_rank_grads_from_full(t, lc, A, B, G);
        tape_release_buffer(t, G, nw * sizeof *G);
    } else if (lj->job.dw_part && (g = tape_grad(t, w))) {
        conv_add_dw_parts(&lj->job, g, tasks);
    }
    if (lj->da_part && (g = tape_grad(t, A))) {
        const size_t stride = conv_da_part_floats(lc);
        if (lj->job.taps) {
            ConvTaps pa = *lj->job.taps;
            pa.OC = lc->rank;
            conv_taps_dw_add_parts(&pa, g, lj->da_part, tasks);
        } else if (lc->grad == CONV_LR_GRAD_DTCOL) {
            conv_add_da_flipped(g, lj->da_part, d, lc->rank, tasks, stride);
        } else {
            conv_add_partials_apart(g, lj->da_part, tasks, na, stride);
        }
    }
    if (lj->dbb_part && (g = tape_grad(t, B))) conv_add_partials(g, lj->dbb_part, tasks, nb);
}

/* With A and B frozen, or their gradients through the full one, the pass
 * is the plain convolution's backward on the merged weight. */
static void conv_lowrank_backward(Tape *t, const TapeNode *node) {
    Var *x = node->in[0], *w = node->in[1], *bias = node->in[2], *A = node->in[3], *B = node->in[4];
    const ConvLowRankCtx *lc = node->ctx;
    const ConvDims *d = &lc->conv.d;
    const int tasks = conv_tasks(d);
    const bool via_full = (A->requires_grad || B->requires_grad) && lc->grad == CONV_LR_GRAD_FULL;
    ConvLowRankJob lj = {.job = {.c = &lc->conv, .x = x->value.data, .w = lc->w_merged, .ldw = lc->ldw,
                                 .y = node->out->value.data, .dy = node->out->grad},
                         .lc = lc};
    if (!conv_backward_alloc(t, &lj.job, x, w->requires_grad || via_full, bias, tasks)) return;
    if (!via_full) {
        lj.da_part = conv_partials(t, A, tasks, conv_da_part_floats(lc));
        lj.dbb_part = conv_partials(t, B, tasks, (size_t)d->OC * lc->rank);
    }
    if (!tape_ok(t) || !conv_taps_setup(t, &lj.job, lc->conv.stride, lc->conv.padding, false, lj.job.dx != NULL))
        return;
    if (lj.da_part || lj.dbb_part) lj.job.wino_dw = false; /* conv_lowrank_backward_taps: the taps' weight gradients */
    if (!conv_lowrank_scratch(t, &lj)) return;
    if (lj.da_part || lj.dbb_part) {
        parallel_run(tasks, conv_lowrank_backward_task, &lj);
    } else {
        lj.job.dw_t = !lj.job.taps; /* as conv2d_backward's: the same weight gradient, bit for bit */
        parallel_run(tasks, conv_backward_task, &lj.job);
    }
    conv_lowrank_add_grads(t, &lj, w, A, B, via_full, tasks);
    conv_add_bias_grad(t, &lj.job, bias, tasks);
    conv_job_release(t, &lj.job, tasks);
    tape_release_buffer(t, lj.da_part, (size_t)tasks * conv_da_part_floats(lc) * sizeof(float));
    tape_release_buffer(t, lj.dbb_part, (size_t)tasks * d->OC * lc->rank * sizeof(float));
}

ConvLowRankGrad conv_lowrank_node_grad(const TapeNode *node) {
    return node->backward == conv_lowrank_backward ? ((const ConvLowRankCtx *)node->ctx)->grad : CONV_LR_GRAD_AUTO;
}

/* ---- the op ------------------------------------------------------------------------------------------------- */

/* A (rank, C, KH, KW) and B (OC, rank, 1, 1) against x and w. */
static bool conv_low_rank_check(Tape *t, const ConvLowRank *lr, const Var *w) {
    const Var *A = lr->A, *B = lr->B;
    const int *ws = w->value.shape;
    bool ok = A && B && A->value.ndim == 4 && B->value.ndim == 4 && A->value.shape[1] == ws[1] &&
              A->value.shape[2] == ws[2] && A->value.shape[3] == ws[3] && B->value.shape[0] == ws[0] &&
              B->value.shape[1] == A->value.shape[0] && B->value.shape[2] == 1 && B->value.shape[3] == 1;
    if (!ok) {
        char as[SHAPE_STR_MAX] = "NULL", bs[SHAPE_STR_MAX] = "NULL", wss[SHAPE_STR_MAX];
        if (A) tensor_shape_str(&A->value, as, sizeof as);
        if (B) tensor_shape_str(&B->value, bs, sizeof bs);
        tensor_shape_str(&w->value, wss, sizeof wss);
        qt_error_set(&t->err, QT_ERR_SHAPE, "conv2d low-rank term: A %s and B %s do not fit weight %s: want A "
                     "(rank, C, KH, KW) and B (OC, rank, 1, 1)", as, bs, wss);
    }
    return ok;
}

/* ConvLowRankCtx.w_merged for w and lr in the arena, or NULL (error on the
 * tape). The forward and the input gradient run on this one weight: per
 * sample, the separate terms A col and B (A col) in the forward and A^T dt
 * in the backward cost more than the whole product B A does once per pass
 * (by a factor of the batch's output positions over the rank, with OC and
 * C*KH*KW rows). */
static float *conv_merge_low_rank(Tape *t, const Var *w, const ConvLowRank *lr) {
    const int OC = w->value.shape[0], ckk = (int)(var_numel(w) / (size_t)OC), r = lr->A->value.shape[0];
    const int ldw = ckk + r;
    const float *wv = w->value.data, *A = lr->A->value.data, *B = lr->B->value.data;
    float *wm = tape_alloc(t, (size_t)(OC + r) * ldw * sizeof *wm);
    if (!wm) return NULL;
    for (int oc = 0; oc < OC; oc++) {
        memcpy(wm + (size_t)oc * ldw, wv + (size_t)oc * ckk, (size_t)ckk * sizeof *wm);
        for (int i = 0; i < r; i++) wm[(size_t)oc * ldw + ckk + i] = lr->scale * B[(size_t)oc * r + i];
    }
    for (int i = 0; i < r; i++) {
        memcpy(wm + (size_t)(OC + i) * ldw, A + (size_t)i * ckk, (size_t)ckk * sizeof *wm);
        memset(wm + (size_t)(OC + i) * ldw + ckk, 0, (size_t)r * sizeof *wm);
    }
    gemm_f32(false, false, OC, ckk, r, lr->scale, B, r, A, ckk, 1.0f, wm, ldw);
    return wm;
}

/* grad resolved against the geometry: AUTO chosen, DTCOL off its geometry
 * refused (QT_ERR_ARG on the tape, CONV_LR_GRAD_AUTO returned). */
static ConvLowRankGrad conv_lowrank_grad_resolve(Tape *t, const ConvDims *d, int rank, int stride, int padding,
                                                 ConvLowRankGrad grad) {
    if (grad == CONV_LR_GRAD_AUTO) return conv_lowrank_grad_choose(d, rank, stride, padding);
    if (grad == CONV_LR_GRAD_DTCOL && !conv_same_stride1(d->H, d->W, d->KH, d->KW, stride, padding, d->OH, d->OW)) {
        qt_error_set(&t->err, QT_ERR_ARG, "conv2d low-rank term: the dt-im2col gradient needs a \"same\" stride-1 "
                     "convolution (stride 1, padding (K-1)/2), not stride %d, padding %d, kernel %dx%d", stride,
                     padding, d->KH, d->KW);
        return CONV_LR_GRAD_AUTO;
    }
    return grad;
}

Var *conv2d_lowrank_with_grad(Tape *t, Var *x, Var *w, Var *bias, const ConvLowRank *lr, int stride, int padding,
                              ConvEpilogue epi, ConvLowRankGrad grad) {
    if (!t || !x || !w || !lr) return NULL;
    ConvDims d = {0}; /* zeroed only to quiet gcc: it cannot see that every error path returns */
    if (conv2d_check(t, x, w, bias, stride, padding, &d) != QT_OK || !conv_low_rank_check(t, lr, w)) return NULL;
    const int rank = lr->A->value.shape[0];
    if ((grad = conv_lowrank_grad_resolve(t, &d, rank, stride, padding, grad)) == CONV_LR_GRAD_AUTO) return NULL;
    Var *y = conv2d_new_output(t, &d, epi);
    ConvLowRankCtx *lc = y ? tape_alloc(t, sizeof *lc) : NULL;
    if (!lc || !conv2d_ctx_init(t, &lc->conv, &d, stride, padding, epi, y)) return NULL;
    lc->rank = rank;
    lc->scale = lr->scale;
    lc->grad = grad;
    lc->ldw = conv_ckk(&d) + rank;
    lc->u = NULL;
    if (!(lc->w_merged = conv_merge_low_rank(t, w, lr))) return NULL;
    /* dB wants A x; the forward's product gives it for rank more rows */
    if (t->grad_enabled && lr->B->requires_grad && grad != CONV_LR_GRAD_FULL &&
        !(lc->u = tape_alloc(t, (size_t)d.N * rank * conv_plane(&d) * sizeof(float))))
        return NULL;
    ConvLowRankJob lj = {.job = {.c = &lc->conv, .x = x->value.data, .w = lc->w_merged, .ldw = lc->ldw,
                                 .bias = bias ? bias->value.data : NULL, .y = y->value.data},
                         .lc = lc};
    /* the forward through the taps where the plain conv's runs there (B = 0: the base's output bit for bit) */
    if (!conv_taps_setup(t, &lj.job, stride, padding, true, false)) return NULL;
    if (lj.job.taps && lc->u) { /* A x with the output: through F(2x2, 3x3) too where it takes A */
        const float *wa = lc->w_merged + (size_t)d.OC * lc->ldw;
        const bool wino = lj.job.wino_w && conv_wino_fits(lj.job.taps_level, d.KH, d.KW, stride, padding, d.C, rank);
        float *a = tape_alloc(t, (wino ? conv_wino_packed_floats(lj.job.wino, rank, d.C)
                                       : conv_taps_packed_floats(lj.job.taps, rank, d.C)) * sizeof *a);
        if (!a) return NULL;
        if (wino) conv_wino_pack(lj.job.wino, a, wa, lc->ldw, rank, d.C), lj.job.wino_a = a;
        else conv_taps_pack(lj.job.taps, a, wa, lc->ldw, rank), lj.job.taps_a = a;
        lj.job.taps_u = lc->u, lj.job.taps_rank = rank;
    }
    if (!conv_scratch(t, &lj.job, conv_col_rows(&lj.job, false), (size_t)d.OC + (lc->u ? (size_t)rank : 0), 0))
        return NULL;
    parallel_run(conv_tasks(&d), conv_lowrank_forward_task, &lj);
    conv_job_release(t, &lj.job, conv_tasks(&d));
    Var *in[5] = {x, w, bias, lr->A, lr->B};
    return tape_record(t, conv2d_op_name(epi), conv_lowrank_backward, y, in, 5, lc) ? y : NULL;
}

Var *nn_conv2d_fused_lowrank(Tape *t, Var *x, Var *w, Var *bias, const ConvLowRank *lr, int stride, int padding,
                             ConvEpilogue epi) {
    if (!lr) return nn_conv2d_fused(t, x, w, bias, stride, padding, epi);
    if (t && x && x->view) {
        qt_error_set(&t->err, QT_ERR_ARG, "conv2d with a low-rank term: its input is a batch norm's view "
                     "(nn_batchnorm_relu_view or nn_batchnorm_view), which it does not read");
        return NULL;
    }
    return conv2d_lowrank_with_grad(t, x, w, bias, lr, stride, padding, epi, CONV_LR_GRAD_AUTO);
}
