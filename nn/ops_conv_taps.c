/* ops_conv_taps.c - the plain convolution's passes (ops_conv.c) on the taps kernels (conv_taps.h): which
 * convolutions take them, their packed weights and scratch, and a chunk's forward and backward. */
#include "gemm.h"
#include "ops_conv_internal.h"

/* The taps backward's chunk (conv_taps_setup): as many samples' padded inputs and dpre as fit, no im2col (several
 * samples where im2col fits one: fewer calls; the weight gradient adds each sample's sums in turn, so the chunk
 * does not change its bits). */
#define CONV_TAPS_CHUNK_BUDGET (256u << 10)

bool conv_taps_setup(Tape *t, ConvJob *j, int stride, int padding, bool fwd, bool dx) {
    const ConvDims *d = &j->c->d;
    const ConvTapsLevel level = conv_taps_level();
    j->taps = NULL;
    if (!conv_taps_fits(level, d->H, d->W, d->KH, d->KW, stride, padding)) return true;
    ConvTaps *p = tape_alloc(t, sizeof *p);
    float *tables = tape_alloc(t, conv_taps_table_floats(d->H, d->W, conv_taps_lanes(level)) * sizeof(float));
    if (!p || !tables) return false;
    conv_taps_plan(p, level, d->C, d->OC, d->H, d->W, d->KH, d->KW, tables);
    j->wino = NULL, j->wino_w = j->wino_wt = j->wino_a = NULL, j->wino_dw = false;
    if (conv_wino_fits(level, d->KH, d->KW, stride, padding, d->C, d->OC)) {
        ConvWino *q = tape_alloc(t, sizeof *q);
        if (!q) return false;
        conv_wino_plan(q, level, d->H, d->W);
        j->wino_dw = !fwd && conv_wino_dw_pays(q, d->C, d->OC); /* a backward pass's */
        float *w = NULL, *wt = NULL;
        if (fwd && !(w = tape_alloc(t, conv_wino_packed_floats(q, d->OC, d->C) * sizeof(float)))) return false;
        if (dx && !(wt = tape_alloc(t, conv_wino_packed_floats(q, d->C, d->OC) * sizeof(float)))) return false;
        if (w) conv_wino_pack(q, w, j->w, j->ldw, d->OC, d->C);
        if (wt) conv_wino_pack_t(q, wt, j->w, j->ldw, d->C, d->OC);
        j->wino = q, j->wino_w = w, j->wino_wt = wt;
        fwd = dx = false; /* the taps' packed weights not wanted */
    }
    float *w = NULL, *wt = NULL;
    if (fwd && !(w = tape_alloc(t, conv_taps_packed_floats(p, d->OC, d->C) * sizeof(float)))) return false;
    if (dx && !(wt = tape_alloc(t, conv_taps_packed_floats(p, d->C, d->OC) * sizeof(float)))) return false;
    if (w) conv_taps_pack(p, w, j->w, j->ldw, d->OC);
    if (wt) conv_taps_pack_t(p, wt, j->w, j->ldw);
    j->taps = p, j->taps_level = level, j->taps_w = w, j->taps_wt = wt;
    if (!fwd && !j->wino_w) { /* as many samples as fit */
        const size_t per = (d->C * p->pplane + (size_t)d->OC * conv_plane(d)) * sizeof(float);
        const size_t n = CONV_TAPS_CHUNK_BUDGET / per;
        j->chunk = n > (size_t)d->N ? d->N : n > (size_t)j->c->chunk ? (int)n : j->c->chunk;
    }
    return true;
}

size_t conv_col_rows(const ConvJob *j, bool backward) {
    const ConvDims *d = &j->c->d;
    const size_t ckk = (size_t)conv_ckk(d), cols = (size_t)conv_job_chunk(j) * conv_plane(d);
    if (!j->taps) return ckk;
    /* the forward: one padded image; the backward: the chunk's, one padded dpre, then one sample's dpre transposed */
    size_t need = backward ? conv_taps_padded_rows_floats(j->taps, d->C, conv_job_chunk(j))
                           : conv_taps_padded_floats(j->taps, d->C, 1);
    if (j->wino_w) { /* F(2x2, 3x3)'s scratch in place of the padded image (then A's, if low-rank) */
        const size_t wino = conv_wino_scratch_floats(j->wino, d->C);
        need = wino > need ? wino : need;
    }
    if (backward) { /* past the chunk's padded inputs (or unused, under F(2x2, 3x3)'s weight gradient) */
        size_t dx = conv_taps_padded_floats(j->taps, d->OC, 1) + conv_taps_dpt_floats(j, d->OC);
        if (j->wino_dw) dx += conv_wino_dw_scratch_floats(j->wino, d->C, d->OC); /* after dpt */
        const size_t wino = j->wino_wt ? conv_wino_scratch_floats(j->wino, d->OC) : 0; /* over dpt, used before */
        need += wino > dx ? wino : dx;
    }
    const size_t rows = (need + cols - 1) / cols;
    return rows > ckk ? rows : ckk;
}

void conv_taps_forward_chunk(const ConvJob *j, float *prod, size_t ldc, size_t lds, float *col, const float *xc,
                             int n0, int nc) {
    const ConvDims *d = &j->c->d;
    const size_t plane = conv_plane(d);
    const int rows = d->OC + (j->taps_u ? j->taps_rank : 0);
    for (int s = 0; s < nc; s++) { /* col: one padded image, or F(2x2, 3x3)'s scratch */
        const double t0 = gemm_stats_start();
        const float *xs = xc + (size_t)s * d->C * plane;
        float *u = j->taps_u ? j->taps_u + (size_t)(n0 + s) * plane : NULL, *ps = prod + (size_t)s * lds;
        const size_t ldu = (size_t)d->N * plane;
        /* A x: a second product, not rank more rows: B = 0 gives the base's output bit for bit */
        if (j->wino_w) {
            conv_wino_forward(j->wino, j->taps_level, ps, ldc, xs, plane, j->wino_w, d->OC, d->C, false, col);
            if (u && j->wino_a)
                conv_wino_forward_again(j->wino, j->taps_level, u, ldu, xs, plane, j->wino_a, j->taps_rank, d->C,
                                        false, col);
        }
        if (!j->wino_w || (u && !j->wino_a)) { /* the taps' products, on the padded image */
            conv_taps_pad(j->taps, col, xs, d->C, 1, 0, plane);
            if (!j->wino_w) conv_taps_forward(j->taps, j->taps_level, ps, ldc, col, j->taps_w, d->OC, d->C, false);
            if (u) conv_taps_forward(j->taps, j->taps_level, u, ldu, col, j->taps_a, j->taps_rank, d->C, false);
        }
        gemm_stats_add(t0, 2.0 * rows * conv_ckk(d) * (double)plane);
    }
}

void conv_taps_dx_chunk(const ConvJob *j, float *dpad, const float *dp, size_t ldc, size_t lds, int n0, int nc) {
    const ConvDims *d = &j->c->d;
    const size_t plane = conv_plane(d), x_sample = (size_t)d->C * plane;
    for (int s = 0; s < nc; s++) {
        const double t0 = gemm_stats_start();
        float *dxs = j->dx + (size_t)(n0 + s) * x_sample;
        if (j->wino_wt) {
            conv_wino_forward(j->wino, j->taps_level, dxs, plane, dp + (size_t)s * lds, ldc, j->wino_wt, d->C, d->OC,
                              !j->dx_fresh, dpad);
        } else {
            conv_taps_pad(j->taps, dpad, dp + (size_t)s * lds, d->OC, 1, 0, ldc);
            conv_taps_forward(j->taps, j->taps_level, dxs, plane, dpad, j->taps_wt, d->C, d->OC, !j->dx_fresh);
        }
        gemm_stats_add(t0, 2.0 * d->OC * conv_ckk(d) * (double)plane);
    }
}

size_t conv_taps_dpt_floats(const ConvJob *j, int rows) {
    return conv_plane(&j->c->d) * conv_taps_oc_pad(rows);
}

float *conv_taps_dpt(const ConvJob *j, float *col) {
    const ConvDims *d = &j->c->d;
    return col + conv_taps_padded_rows_floats(j->taps, d->C, conv_job_chunk(j)) +
           conv_taps_padded_floats(j->taps, d->OC, 1);
}

void conv_taps_backward_chunk(const ConvJob *j, float *dwt, float *col, const float *dp, size_t ldc, size_t lds,
                              int n0, int nc, bool add) {
    const ConvDims *d = &j->c->d;
    const ConvTaps *p = j->taps;
    const size_t plane = conv_plane(d), x_sample = (size_t)d->C * plane;
    const double flops = 2.0 * d->OC * conv_ckk(d) * (double)plane;
    if (dwt) {
        const double t0 = gemm_stats_start();
        float *dpt = conv_taps_dpt(j, col);
        const float *xc = conv_chunk_input(j, n0, nc);
        if (!j->wino_dw) conv_taps_pad_rows(p, col, xc, d->C, nc, x_sample, plane);
        for (int s = 0; s < nc; s++) { /* one sample's dp transposed at a time: it stays in cache for the sums */
            conv_taps_dp_t(p, j->taps_level, dpt, dp + (size_t)s * lds, ldc, 0, d->OC, 1);
            if (j->wino_dw)
                conv_wino_dw(j->wino, j->taps_level, dwt, dpt, xc + (size_t)s * x_sample, plane, d->C, d->OC,
                             add || s > 0, dpt + conv_taps_dpt_floats(j, d->OC));
            else conv_taps_dw(p, j->taps_level, dwt, dpt, col + (size_t)s * d->C * p->pplane, 1, add || s > 0);
        }
        gemm_stats_add(t0, nc * flops);
    }
    if (j->dx) /* past x */
        conv_taps_dx_chunk(j, col + conv_taps_padded_rows_floats(p, d->C, nc), dp, ldc, lds, n0, nc);
}
