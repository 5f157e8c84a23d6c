/* conv_wino_kern.h - the body of F(2x2, 3x3)'s vector kernel (conv_wino.h), included once per ISA by
 * conv_wino_x86.c with its vector type and operations defined (WV, WL lanes, WRB rows per block, W_*), so the two
 * widths are one text. Each lane computes what conv_wino_forward_ref does for one tile: the same bits.
 *
 * Per call: the input planes split into even and odd padded columns; the input transform, a tile row's `lanes`
 * tiles at a time, into v [16][channels][ldv] (tile t = i TW + j at column t); per block of rb output rows the 16
 * products m [16][rb][ldv] (rb rows by 3 vectors of tiles in registers, the channels' chain), then the output
 * transform, which writes the block's rows of y. The 16 positions' arrays lie conv_wino_stride apart. W_NARROW, if
 * defined, names the narrower width's split and transforms, which take tile rows of at most half a vector. The
 * passes are kept out of line: each shows as itself in a profile, at the cost of a call per channel. */

/* Copies channels planes x (ldx apart) into the split layout: row pr of channel c (padded row pr holds x's row
 * pr - 1) at s + c splane + pr 2 ew: E[j] = x(., 2j - 1), then at + ew O[j] = x(., 2j), for every j the input
 * transform reads (j <= ceil(TW / lanes) lanes); zeros outside the plane. */
W_TARGET __attribute__((noinline)) static void W_NAME(split)(const ConvWino *p, float *s, const float *x, size_t ldx,
                                                            int channels) {
    const int W = p->W, ew = p->ew, jn = (p->TW + WL - 1) / WL * WL; /* O[jn], E[jn] the last read */
    const size_t span = (size_t)(channels - 1) * ldx + (size_t)p->H * W; /* x's floats the planes reach */
    for (int c = 0; c < channels; c++) {
        float *sc = s + (size_t)c * p->splane;
        const float *xc = x + (size_t)c * ldx;
        for (int pr = 0; pr < 2 * p->TH + 2; pr++) {
            float *e = sc + (size_t)pr * 2 * ew, *o = e + ew;
            const int h = pr - 1;
            if (h < 0 || h >= p->H) {
                for (int j = 0; j <= jn; j += WL) W_STOREU(e + j, W_ZERO()), W_STOREU(o + j, W_ZERO());
                continue;
            }
            const float *xr = xc + (size_t)h * W;
            e[0] = 0.0f;
            for (int k = 0; k < W; k += 2 * WL) { /* columns k .. k + 2 WL - 1: O[k / 2 ..], E[k / 2 + 1 ..] */
                WV lo, hi, ev, od;
                if (k + 2 * WL <= W) {
                    lo = W_LOADU(xr + k), hi = W_LOADU(xr + k + WL);
                } else if ((size_t)c * ldx + (size_t)h * W + (size_t)k + 2 * WL <= span) {
                    /* past the row, inside x: plain loads, the lanes past the row zeroed (a masked load costs
                     * several on AMD's cores) */
                    const int n = W - k;
                    W_MASK_DECL(m0, n < WL ? n : WL);
                    lo = W_MASK_KEEP(W_LOADU(xr + k), m0);
                    if (n > WL) {
                        W_MASK_DECL(m1, n - WL);
                        hi = W_MASK_KEEP(W_LOADU(xr + k + WL), m1);
                    } else {
                        hi = W_ZERO();
                    }
                } else { /* past the row and x: masked loads, zeros */
                    const int n = W - k;
                    W_MASK_DECL(m0, n < WL ? n : WL);
                    lo = W_MASK_LOAD(xr + k, m0);
                    if (n > WL) {
                        W_MASK_DECL(m1, n - WL);
                        hi = W_MASK_LOAD(xr + k + WL, m1);
                    } else {
                        hi = W_ZERO();
                    }
                }
                W_DEINTERLEAVE(ev, od, lo, hi);
                W_STOREU(o + k / 2, ev);
                W_STOREU(e + k / 2 + 1, od);
            }
            o[jn] = 0.0f; /* (W + 1) / 2 <= jn: past the stores, or a zero they wrote */
        }
    }
}

/* The input transform of channel c (split planes sc) into v. */
W_TARGET __attribute__((noinline)) static void W_NAME(input)(const ConvWino *p, float *v, const float *sc, int c,
                                                            int channels) {
    const size_t ldq = conv_wino_stride((size_t)channels * p->ldv);
    const int ew = p->ew;
    float *vc = v + (size_t)c * p->ldv;
    for (int i = 0; i < p->TH; i++) {
        const float *r0 = sc + (size_t)(2 * i) * 2 * ew;
        for (int j = 0; j < p->TW; j += WL) {
            WV h[4][4];
#pragma GCC unroll 4
            for (int a = 0; a < 4; a++) {
                const float *e = r0 + (size_t)a * 2 * ew + j, *o = e + ew;
                const WV e0 = W_LOADU(e), e1 = W_LOADU(e + 1), o0 = W_LOADU(o), o1 = W_LOADU(o + 1);
                h[a][0] = W_SUB(e0, e1), h[a][1] = W_ADD(o0, e1), h[a][2] = W_SUB(e1, o0), h[a][3] = W_SUB(o0, o1);
            }
            float *dst = vc + (size_t)i * p->TW + j; /* lanes past the row: the next row's, written after */
#pragma GCC unroll 4
            for (int b = 0; b < 4; b++) {
                W_STOREU(dst + (0 + b) * ldq, W_SUB(h[0][b], h[2][b]));
                W_STOREU(dst + (4 + b) * ldq, W_ADD(h[1][b], h[2][b]));
                W_STOREU(dst + (8 + b) * ldq, W_SUB(h[2][b], h[1][b]));
                W_STOREU(dst + (12 + b) * ldq, W_SUB(h[1][b], h[3][b]));
            }
        }
    }
    for (int q = 0; q < 16; q++) /* the products' last vector's lanes past T: zeros, not what the last row left */
        for (int t = p->T; t < p->tv * p->lanes; t += WL) W_STOREU(vc + q * ldq + t, W_ZERO());
}

/* m[q] (rb, ldv) for q = 0 .. 15: block wb's rows times v. Tiles of rb rows by NV vectors. */
W_TARGET static inline __attribute__((always_inline)) void W_NAME(gemm_tile)(float *m, size_t ldv, const float *vq,
                                                                            size_t ldc, const float *wq,
                                                                            int channels, int t0, const int NV) {
    WV acc[WRB][3];
#pragma GCC unroll 8
    for (int r = 0; r < WRB; r++)
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++) acc[r][n] = W_ZERO();
    const float *vt = vq + (size_t)t0 * WL;
    for (int c = 0; c < channels; c++, vt += ldc, wq += WRB) {
        WV b[3];
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++) b[n] = n < NV ? W_LOADU(vt + n * WL) : W_ZERO();
#pragma GCC unroll 8
        for (int r = 0; r < WRB; r++) {
            const WV a = W_SET1(wq[r]);
#pragma GCC unroll 3
            for (int n = 0; n < 3; n++)
                if (n < NV) acc[r][n] = W_FMA(a, b[n], acc[r][n]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < WRB; r++)
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++)
            if (n < NV) W_STOREU(m + (size_t)r * ldv + (size_t)(t0 + n) * WL, acc[r][n]);
}

/* Stores n (1 .. WL) outputs at o: o + 0.0f, or added to what is there. */
W_TARGET static inline __attribute__((always_inline)) void W_NAME(put)(float *o, WV v, int n, bool add) {
    if (n >= WL) {
        W_STOREU(o, W_ADD(add ? W_LOADU(o) : W_ZERO(), v));
    } else {
        W_MASK_DECL(mk, n);
        W_MASK_STORE(o, mk, W_ADD(add ? W_MASK_LOAD(o, mk) : W_ZERO(), v));
    }
}

/* The output transform of rows [0, rows) of m into y. */
W_TARGET __attribute__((noinline)) static void W_NAME(output)(const ConvWino *p, float *y, size_t ldy, const float *m,
                                                             int rows, bool add) {
    const int W = p->W;
    for (int r = 0; r < rows; r++) {
        const float *mr = m + (size_t)r * p->ldv;
        const size_t ldq = p->ldm;
        for (int i = 0; i < p->TH; i++)
            for (int j = 0; j < p->TW; j += WL) {
                const float *mt = mr + (size_t)i * p->TW + j;
                WV s0[4], s1[4];
#pragma GCC unroll 4
                for (int b = 0; b < 4; b++) {
                    const WV m0 = W_LOADU(mt + (0 + b) * ldq), m1 = W_LOADU(mt + (4 + b) * ldq);
                    const WV m2 = W_LOADU(mt + (8 + b) * ldq), m3 = W_LOADU(mt + (12 + b) * ldq);
                    s0[b] = W_ADD(W_ADD(m0, m1), m2);
                    s1[b] = W_SUB(W_SUB(m1, m2), m3);
                }
                const int cols = W - 2 * j; /* of this row, from column 2j */
                for (int a = 0; a < 2; a++) {
                    if (2 * i + a >= p->H) break;
                    const WV *s = a ? s1 : s0;
                    const WV ev = W_ADD(W_ADD(s[0], s[1]), s[2]), od = W_SUB(W_SUB(s[1], s[2]), s[3]);
                    WV lo, hi;
                    W_INTERLEAVE(lo, hi, ev, od);
                    float *o = y + (size_t)r * ldy + (size_t)(2 * i + a) * W + 2 * j;
                    W_NAME(put)(o, lo, cols, add);
                    if (cols > WL) W_NAME(put)(o + WL, hi, cols - WL, add);
                }
            }
    }
}

/* v = the input transform of channels planes x (split at s first); true if at the narrower width (W_NARROW): tile
 * rows of at most half a vector, which waste fewer lanes there. */
W_TARGET static bool W_NAME(inputs)(const ConvWino *p, float *s, float *v, const float *x, size_t ldx, int channels) {
#ifdef W_NARROW
    if (p->TW <= WL / 2) {
        W_NARROW(split)(p, s, x, ldx, channels);
        for (int c = 0; c < channels; c++) W_NARROW(input)(p, v, s + (size_t)c * p->splane, c, channels);
        return true;
    }
#endif
    W_NAME(split)(p, s, x, ldx, channels);
    for (int c = 0; c < channels; c++) W_NAME(input)(p, v, s + (size_t)c * p->splane, c, channels);
    return false;
}

/* y = the products of wp with the transform v in scratch, and the output transform; narrow: v was made at the
 * narrower width, whose output transform then serves too. */
W_TARGET static void W_NAME(products)(const ConvWino *p, float *y, size_t ldy, const float *wp, int rows,
                                      int channels, bool add, float *scratch, bool narrow) {
    const size_t ldq = conv_wino_stride((size_t)channels * p->ldv);
    float *v = scratch + (size_t)channels * p->splane, *m = v + 16 * ldq;
    for (int q = 0; q < 16; q++) /* lanes past the products' vectors, read by the last output vectors */
        for (int r = 0; r < WRB; r++) W_STOREU(m + q * p->ldm + (size_t)r * p->ldv + p->tv * WL, W_ZERO());
    (void)narrow;
    const size_t blocks = (size_t)(rows + WRB - 1) / WRB, per_q = blocks * channels * WRB;
    const size_t ldc = p->ldv;
    for (size_t b = 0; b < blocks; b++) {
        for (int q = 0; q < 16; q++) {
            const float *wq = wp + q * per_q + b * channels * WRB, *vq = v + q * ldq;
            float *mq = m + (size_t)q * p->ldm;
            int t = 0;
            for (; t + 3 <= p->tv; t += 3) W_NAME(gemm_tile)(mq, p->ldv, vq, ldc, wq, channels, t, 3);
            if (p->tv - t == 2) W_NAME(gemm_tile)(mq, p->ldv, vq, ldc, wq, channels, t, 2);
            else if (p->tv - t == 1) W_NAME(gemm_tile)(mq, p->ldv, vq, ldc, wq, channels, t, 1);
        }
        const int rb = rows - (int)b * WRB < WRB ? rows - (int)b * WRB : WRB;
#ifdef W_NARROW
        if (narrow) W_NARROW(output)(p, y + b * WRB * ldy, ldy, m, rb, add);
        else
#endif
            W_NAME(output)(p, y + b * WRB * ldy, ldy, m, rb, add);
    }
}

W_TARGET void W_NAME(forward)(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                              int rows, int channels, bool add, float *scratch) {
    const bool narrow = W_NAME(inputs)(p, scratch, scratch + (size_t)channels * p->splane, x, ldx, channels);
    W_NAME(products)(p, y, ldy, wp, rows, channels, add, scratch, narrow);
}

/* W_NAME(products) of the transform a W_NAME(forward) left in scratch. */
W_TARGET void W_NAME(again)(const ConvWino *p, float *y, size_t ldy, const float *wp, int rows, int channels,
                            bool add, float *scratch) {
#ifdef W_NARROW
    const bool narrow = p->TW <= WL / 2; /* as W_NAME(inputs) chose */
#else
    const bool narrow = false;
#endif
    W_NAME(products)(p, y, ldy, wp, rows, channels, add, scratch, narrow);
}

/* ---- the weight gradient (conv_wino_dw) ---- */

/* dm (16 positions ldm apart; tile t at t ldd) = the transform of each tile's output gradient, ldd / WL vectors of
 * output channels at a time, from dpt (H W, ldd). */
W_TARGET __attribute__((noinline)) static void W_NAME(grad)(const ConvWino *p, float *dm, size_t ldm, const float *dpt,
                                                           size_t ldd) {
    const int W = p->W, nv = (int)(ldd / WL);
    for (int i = 0; i < p->TH; i++)
        for (int j = 0; j < p->TW; j++) {
            const bool down = 2 * i + 1 < p->H, right = 2 * j + 1 < W; /* the tile's second row, column */
            const float *d0 = dpt + ((size_t)(2 * i) * W + 2 * j) * ldd, *d1 = d0 + (size_t)W * ldd;
            float *o = dm + (size_t)(i * p->TW + j) * ldd;
            for (int v = 0; v < nv; v++) {
                const WV d00 = W_LOADU(d0 + v * WL), d01 = right ? W_LOADU(d0 + ldd + v * WL) : W_ZERO();
                const WV d10 = down ? W_LOADU(d1 + v * WL) : W_ZERO();
                const WV d11 = down && right ? W_LOADU(d1 + ldd + v * WL) : W_ZERO();
                const WV r[4][2] = {{d00, d01},
                                    {W_ADD(d00, d10), W_ADD(d01, d11)},
                                    {W_SUB(d00, d10), W_SUB(d01, d11)},
                                    {W_NEG(d10), W_NEG(d11)}};
#pragma GCC unroll 4
                for (int a = 0; a < 4; a++) {
                    float *oa = o + v * WL + (size_t)(4 * a) * ldm;
                    W_STOREU(oa, r[a][0]);
                    W_STOREU(oa + ldm, W_ADD(r[a][0], r[a][1]));
                    W_STOREU(oa + 2 * ldm, W_SUB(r[a][0], r[a][1]));
                    W_STOREU(oa + 3 * ldm, W_NEG(r[a][1]));
                }
            }
        }
}

/* du rows [c0, c0 + rows) (rows <= WRB), output channel vectors v0 .. v0 + NV - 1, of one position: the chains
 * over the T tiles of vq (rows ldv apart, tiles along) times dmq (tile t at t ldd). */
W_TARGET static inline __attribute__((always_inline)) void W_NAME(dw_tile)(float *du, size_t ldd, const float *vq,
                                                                          size_t ldv, const float *dmq, int T,
                                                                          int rows, int v0, const int NV) {
    WV acc[WRB][3];
#pragma GCC unroll 8
    for (int r = 0; r < WRB; r++)
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++) acc[r][n] = W_ZERO();
    const float *dmt = dmq + (size_t)v0 * WL;
    for (int t = 0; t < T; t++, dmt += ldd) {
        WV b[3];
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++) b[n] = n < NV ? W_LOADU(dmt + n * WL) : W_ZERO();
#pragma GCC unroll 8
        for (int r = 0; r < WRB; r++) {
            const WV a = W_SET1(vq[(size_t)(r < rows ? r : 0) * ldv + t]); /* rows past: row 0 again, dropped */
#pragma GCC unroll 3
            for (int n = 0; n < 3; n++)
                if (n < NV) acc[r][n] = W_FMA(a, b[n], acc[r][n]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < WRB; r++) {
        if (r >= rows) break;
#pragma GCC unroll 3
        for (int n = 0; n < 3; n++)
            if (n < NV) W_STOREU(du + (size_t)r * ldd + (size_t)(v0 + n) * WL, acc[r][n]);
    }
}

/* dwt's 9 rows of channel c (=, or += if add) G^T du G, du's 16 positions ldu apart. */
W_TARGET __attribute__((noinline)) static void W_NAME(dw_out)(float *dwt, size_t ldd, const float *du, size_t ldu,
                                                             bool add) {
    const WV half = W_SET1(0.5f);
    for (size_t v = 0; v < ldd; v += WL) {
        WV e[3][4];
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) {
            const WV x0 = W_LOADU(du + (size_t)b * ldu + v), x1 = W_LOADU(du + (size_t)(4 + b) * ldu + v);
            const WV x2 = W_LOADU(du + (size_t)(8 + b) * ldu + v), x3 = W_LOADU(du + (size_t)(12 + b) * ldu + v);
            const WV h = W_MUL(W_ADD(x1, x2), half);
            e[0][b] = W_ADD(x0, h), e[1][b] = W_MUL(W_SUB(x1, x2), half), e[2][b] = W_ADD(h, x3);
        }
#pragma GCC unroll 3
        for (int k = 0; k < 3; k++) {
            const WV h = W_MUL(W_ADD(e[k][1], e[k][2]), half);
            const WV g[3] = {W_ADD(e[k][0], h), W_MUL(W_SUB(e[k][1], e[k][2]), half), W_ADD(h, e[k][3])};
#pragma GCC unroll 3
            for (int l = 0; l < 3; l++) {
                float *o = dwt + (size_t)(3 * k + l) * ldd + v;
                W_STOREU(o, add ? W_ADD(W_LOADU(o), g[l]) : g[l]);
            }
        }
    }
}

W_TARGET void W_NAME(dw)(const ConvWino *p, float *dwt, const float *dpt, const float *x, size_t ldx, int C, int OC,
                         bool add, float *scratch) {
    const size_t ldd = conv_taps_oc_pad(OC), ldq = conv_wino_stride((size_t)C * p->ldv);
    const size_t ldm = conv_wino_stride((size_t)p->T * ldd), ldu = (size_t)C * ldd;
    float *s = scratch, *v = s + (size_t)C * p->splane, *dm = v + 16 * ldq, *du = dm + 16 * ldm;
    W_NAME(inputs)(p, s, v, x, ldx, C);
    W_NAME(grad)(p, dm, ldm, dpt, ldd);
    const int nv = (int)(ldd / WL);
    for (int q = 0; q < 16; q++)
        for (int c0 = 0; c0 < C; c0 += WRB) {
            const int rows = C - c0 < WRB ? C - c0 : WRB;
            const float *vq = v + q * ldq + (size_t)c0 * p->ldv, *dmq = dm + q * ldm;
            float *duq = du + q * ldu + (size_t)c0 * ldd;
            int n = 0;
            for (; n + 3 <= nv; n += 3) W_NAME(dw_tile)(duq, ldd, vq, p->ldv, dmq, p->T, rows, n, 3);
            if (nv - n == 2) W_NAME(dw_tile)(duq, ldd, vq, p->ldv, dmq, p->T, rows, n, 2);
            else if (nv - n == 1) W_NAME(dw_tile)(duq, ldd, vq, p->ldv, dmq, p->T, rows, n, 1);
        }
    for (int c = 0; c < C; c++) W_NAME(dw_out)(dwt + (size_t)c * 9 * ldd, ldd, du + (size_t)c * ldd, ldu, add);
}
