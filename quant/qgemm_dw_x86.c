/* qgemm_dw_x86.c - the AVX-512 VNNI depthwise kernel with its rows in registers (qgemm.h, QGemmDw;
 * qgemm_dw_rows_fit): 3-row kernels of up to 4 columns at stride 1, one output channel per input channel, the
 * 3x3 depthwise convs of the MLPerf Tiny models.
 *
 * Why: the general kernel (qgemm_x86.c) gathers each padded row's sliding windows into scratch, then reads them
 * back once per kernel row, a channel at a time; for a 3x3 conv on 14x14 planes that round trip and the loop
 * overhead cost three times the multiply-adds. Here each input row's windows are gathered once into a register
 * (one masked load, a dword spread and a byte shuffle), kept for the three output rows that read them, and four
 * channels run side by side, so their chains overlap. Their outputs go out as floats, or quantized in registers
 * as the codes their reader takes (plain, or the 4 channels' codes as one dword: the taps kernels' channel
 * quads), so no float output reaches memory. The sums, the one fmaf and the codes are those of
 * qgemm_dw_portable bit for bit. */
#include <stdbool.h>
#include <stdint.h>

#include "qgemm.h"
#include "qgemm_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include "qgemm_x86_inline.h"

/* What one call writes: the epilogue, a constant in each instantiation. */
enum { DW_FLOATS, DW_PLAIN, DW_QUADS };

/* One input row's sliding windows for 16 output columns: dword l of the result holds the codes of input columns
 * c4 + l .. c4 + l + 3 (c4 the first column the vector reads), a_zero outside the row or the image. The masked
 * load reads the 19 bytes from c4 that lie inside the row; 128-bit lane j takes dwords j .. j + 3 of them and the
 * byte shuffle makes its dword l of bytes l .. l + 3. */
QG_TARGET QG_INLINE __m512i dw_row(const uint8_t *act, int ih, int in_h, int in_w, int c4, __mmask64 m, __m512i fill) {
    if (ih < 0 || ih >= in_h) return fill;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5, 3, 4, 5, 6);
    const __m512i win = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5, 3, 4, 5, 6));
    const __m512i x = _mm512_mask_loadu_epi8(fill, m, act + (size_t)ih * in_w + c4);
    return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(lanes, x), win);
}

/* Channels c .. c + NC - 1 (NC <= 4, c a multiple of 4 for quads), every output row of 16 columns from v. */
QG_TARGET QG_INLINE bool dw_rows(const QGemmDw *d, const CodeRegs *k, int c, int v, const int NC, const int mode) {
    const int in_h = d->in_h, in_w = d->in_w, c4 = v - d->pad_l;
    const size_t P = (size_t)d->oh_n * d->ow_n;
    const __mmask64 m = (__mmask64)dw_cols_mask(c4, in_w, 32);
    const __mmask16 om = lane_mask(d->ow_n - v);
    const __m512i fill = _mm512_set1_epi8((char)d->a_zero);
    const uint8_t *act[4];
    __m512i w[4][3], r0[4], r1[4], corr[4];
    __m512 sc[4], bi[4];
#pragma GCC unroll 4
    for (int i = 0; i < NC; i++) {
        const int oc = d->oc0 + c + i;
        const int32_t *wc = d->w->data + (size_t)oc * 3; /* [3][1] */
        act[i] = d->act + (size_t)(c + i) * d->in_plane;
        w[i][0] = _mm512_set1_epi32(wc[0]), w[i][1] = _mm512_set1_epi32(wc[1]), w[i][2] = _mm512_set1_epi32(wc[2]);
        corr[i] = _mm512_set1_epi32((int32_t)(0u - (uint32_t)d->a_zero * (uint32_t)d->w->sum[oc]));
        sc[i] = _mm512_set1_ps(d->scale[oc]), bi[i] = _mm512_set1_ps(d->bias ? d->bias[oc] : 0.0f);
        r0[i] = dw_row(act[i], -d->pad_t, in_h, in_w, c4, m, fill);
        r1[i] = dw_row(act[i], 1 - d->pad_t, in_h, in_w, c4, m, fill);
    }
    __mmask16 bad = 0;
    for (int oh = 0; oh < d->oh_n; oh++) {
        const size_t p = (size_t)oh * d->ow_n + (size_t)v; /* the row's first output */
        __m512i quad = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < NC; i++) {
            const __m512i r2 = dw_row(act[i], oh + 2 - d->pad_t, in_h, in_w, c4, m, fill);
            /* two chains, the first from minus the zero point's correction: the corrected sum (wrapping alike) */
            const __m512i a = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(corr[i], r0[i], w[i][0]), r2, w[i][2]);
            const __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), r1[i], w[i][1]);
            __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, b)), sc[i], bi[i]);
            if (d->relu) y = _mm512_max_ps(y, _mm512_setzero_ps()); /* nn's relu: see taps_y */
            r0[i] = r1[i], r1[i] = r2;
            if (mode == DW_FLOATS) {
                _mm512_mask_storeu_ps(d->out + (size_t)(c + i) * P + p, om, y);
            } else if (mode == DW_PLAIN) {
                _mm512_mask_cvtepi32_storeu_epi8(d->codes->dst + (size_t)(c + i) * P + p, om,
                                                 codes_fast16(k, y, om, &bad));
            } else {
                quad = _mm512_or_si512(quad, _mm512_slli_epi32(codes_fast16(k, y, om, &bad), 8 * i));
            }
        }
        if (mode == DW_QUADS) {
#pragma GCC unroll 4
            for (int i = NC; i < 4; i++) quad = _mm512_or_si512(quad, _mm512_slli_epi32(k->zero, 8 * i));
            uint32_t *dst = (uint32_t *)(void *)d->codes->dst + (size_t)(c / 4) * d->codes->quad_plane + p;
            _mm512_mask_storeu_epi32(dst, om, quad);
        }
    }
    return bad == 0;
}

/* Every column vector of channels c .. c + NC - 1. */
QG_TARGET QG_INLINE bool dw_channels(const QGemmDw *d, const CodeRegs *k, int c, const int NC, const int mode) {
    bool ok = true;
    for (int v = 0; v < d->ow_n; v += QGEMM_LANES) ok &= dw_rows(d, k, c, v, NC, mode);
    return ok;
}

/* All channels in fours, then the rest (for quads: the last quad, its missing channels the zero point). */
QG_TARGET QG_INLINE bool dw_run(const QGemmDw *d, const CodeRegs *k, const int mode) {
    bool ok = true;
    int c = 0;
    for (; c + 4 <= d->n_oc; c += 4) ok &= dw_channels(d, k, c, 4, mode);
    switch (d->n_oc - c) {
    case 3: ok &= dw_channels(d, k, c, 3, mode); break;
    case 2: ok &= dw_channels(d, k, c, 2, mode); break;
    case 1: ok &= dw_channels(d, k, c, 1, mode); break;
    default: break;
    }
    return ok;
}

QG_TARGET bool qgemm_dw_rows_vnni(const QGemmDw *d) {
    const QGemmCodesOut *co = d->codes;
    const CodeRegs k = co ? code_regs(co->q.s, co->q.lo, co->q.hi, co->q.zero) : code_regs(1.0f, 0.0f, 0.0f, 0);
    if (!co) return dw_run(d, &k, DW_FLOATS);
    return co->quad_plane ? dw_run(d, &k, DW_QUADS) : dw_run(d, &k, DW_PLAIN);
}

#else /* not x86: qgemm_use_vnni() is always false, so this is never called */

bool qgemm_dw_rows_vnni(const QGemmDw *d) { return qgemm_dw_portable(d); }

#endif
