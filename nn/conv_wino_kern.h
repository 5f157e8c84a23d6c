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
                } else { /* past the row: zeros */
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

W_TARGET void W_NAME(forward)(const ConvWino *p, float *y, size_t ldy, const float *x, size_t ldx, const float *wp,
                              int rows, int channels, bool add, float *scratch) {
    const size_t ldq = conv_wino_stride((size_t)channels * p->ldv);
    float *s = scratch, *v = s + (size_t)channels * p->splane, *m = v + 16 * ldq;
    for (int q = 0; q < 16; q++) /* lanes past the products' vectors, read by the last output vectors */
        for (int r = 0; r < WRB; r++) W_STOREU(m + q * p->ldm + (size_t)r * p->ldv + p->tv * WL, W_ZERO());
#ifdef W_NARROW
    /* tile rows of at most half a vector: the transforms at the narrower width, which wastes fewer lanes */
    const bool narrow = p->TW <= WL / 2;
#else
    const bool narrow = false;
#endif
    if (narrow) {
#ifdef W_NARROW
        W_NARROW(split)(p, s, x, ldx, channels);
        for (int c = 0; c < channels; c++) W_NARROW(input)(p, v, s + (size_t)c * p->splane, c, channels);
#endif
    } else {
        W_NAME(split)(p, s, x, ldx, channels);
        for (int c = 0; c < channels; c++) W_NAME(input)(p, v, s + (size_t)c * p->splane, c, channels);
    }
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
        if (narrow) {
            W_NARROW(output)(p, y + b * WRB * ldy, ldy, m, rb, add);
            continue;
        }
#endif
        W_NAME(output)(p, y + b * WRB * ldy, ldy, m, rb, add);
    }
}
