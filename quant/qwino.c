/* qwino.c - the int8 F(2x2, 3x3) (qwino.h): which convs take it, the weight transform, the definition and the
 * dispatch to the AVX2 kernel (qwino_avx2.c). */
#include "qwino.h"

#include <math.h>
#include <string.h>

#include "nn/conv_wino.h"
#include "qgemm.h"

bool qwino_fits(int C, int out, int KH, int KW, int stride, int padding) {
    return conv_wino_enabled && qgemm_isa() == QGEMM_ISA_AVX2 && KH == 3 && KW == 3 && stride == 1 &&
           padding == 1 && C >= 8 && C <= QWINO_C_MAX && out >= 4;
}

bool qwino_u8_fits(int C, int out, int KH, int KW, int stride, int padding) {
    return qwino_fits(C, out, KH, KW, stride, padding) && C <= QWINO_U8_C_MAX;
}

void qwino_plan(QWino *p, int C, int H, int W) {
    *p = (QWino){.C = C, .H = H, .W = W, .TH = (H + 1) / 2, .TW = (W + 1) / 2};
    p->T = p->TH * p->TW;
    p->tv = (p->T + 7) / 8;
    p->ldv = (size_t)(p->tv + 2) * 8;
    p->ew = (p->TW + 1 + 15) / 16 * 16 + 16;
    p->splane = (size_t)(2 * p->TH + 2) * 2 * p->ew;
}

static size_t pairs(const QWino *p) { return ((size_t)p->C + 1) / 2; }

size_t qwino_packed_words(const QWino *p, int out) { return 16 * (((size_t)out + 3) / 4) * pairs(p) * 4; }

size_t qwino_scratch_bytes(const QWino *p) {
    /* the split planes (int16), the channel pairs' transforms (int16 x 2), 4 rows' products */
    const size_t words = ((size_t)p->C * p->splane + 1) / 2 + 16 * conv_wino_stride(pairs(p) * p->ldv) +
                         16 * conv_wino_stride(4 * p->ldv);
    return words * sizeof(int32_t);
}

/* u (16) = (2G) g (2G)^T of one 3x3 kernel of codes: first the columns, then the rows. */
static void qwino_weight(int32_t u[16], const int8_t *g) {
    int32_t t[4][3];
    for (int k = 0; k < 3; k++) {
        t[0][k] = 2 * g[k];
        t[1][k] = g[k] + g[3 + k] + g[6 + k];
        t[2][k] = g[k] - g[3 + k] + g[6 + k];
        t[3][k] = 2 * g[6 + k];
    }
    for (int a = 0; a < 4; a++) {
        u[4 * a + 0] = 2 * t[a][0];
        u[4 * a + 1] = t[a][0] + t[a][1] + t[a][2];
        u[4 * a + 2] = t[a][0] - t[a][1] + t[a][2];
        u[4 * a + 3] = 2 * t[a][2];
    }
}

void qwino_pack(const QWino *p, int32_t *dst, const int8_t *w, int out) {
    const size_t np = pairs(p), per_q = ((size_t)out + 3) / 4 * np * 4;
    memset(dst, 0, qwino_packed_words(p, out) * sizeof *dst);
    int32_t u[16];
    for (int r = 0; r < out; r++)
        for (int c = 0; c < p->C; c++) {
            qwino_weight(u, w + ((size_t)r * p->C + c) * 9);
            for (int q = 0; q < 16; q++) { /* the channel's half of its pair's int32 */
                uint32_t *d = (uint32_t *)dst + q * per_q + ((size_t)(r / 4) * np + (size_t)c / 2) * 4 + r % 4;
                *d |= (uint32_t)(uint16_t)(int16_t)u[q] << (c % 2 ? 16 : 0);
            }
        }
}

/* u[q] of row r, channel c from the packed weights. */
static int32_t qwino_u(const QWino *p, const int32_t *wp, int out, int r, int c, int q) {
    const size_t np = pairs(p), per_q = ((size_t)out + 3) / 4 * np * 4;
    const uint32_t v = (uint32_t)wp[q * per_q + ((size_t)(r / 4) * np + (size_t)c / 2) * 4 + r % 4];
    return (int16_t)(uint16_t)(c % 2 ? v >> 16 : v);
}

/* The sums of tile (i, j) of row r (before the output transform's division: y4, 4 times the sums) of the image
 * whose value at (c, h, w) inside the plane xv gives. */
typedef int32_t (*QwValue)(const void *x, int c, int h, int w);

static void qwino_tile_ref(const QWino *p, int32_t y4[2][2], QwValue xv, const void *x, const int32_t *wp, int out,
                           int r, int i, int j) {
    const int H = p->H, W = p->W;
    int32_t m[16] = {0};
    for (int c = 0; c < p->C; c++) {
        int32_t d[4][4], h[4][4];
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 4; b++) {
                const int hh = 2 * i - 1 + a, ww = 2 * j - 1 + b;
                d[a][b] = hh < 0 || ww < 0 || hh >= H || ww >= W ? 0 : xv(x, c, hh, ww);
            }
        for (int a = 0; a < 4; a++)
            h[a][0] = d[a][0] - d[a][2], h[a][1] = d[a][1] + d[a][2], h[a][2] = d[a][2] - d[a][1],
            h[a][3] = d[a][1] - d[a][3];
        for (int b = 0; b < 4; b++) {
            const int32_t v[4] = {h[0][b] - h[2][b], h[1][b] + h[2][b], h[2][b] - h[1][b], h[1][b] - h[3][b]};
            for (int a = 0; a < 4; a++) m[4 * a + b] += qwino_u(p, wp, out, r, c, 4 * a + b) * v[a];
        }
    }
    int32_t s[2][4];
    for (int b = 0; b < 4; b++) s[0][b] = m[b] + m[4 + b] + m[8 + b], s[1][b] = m[4 + b] - m[8 + b] - m[12 + b];
    for (int a = 0; a < 2; a++) y4[a][0] = s[a][0] + s[a][1] + s[a][2], y4[a][1] = s[a][1] - s[a][2] - s[a][3];
}

typedef struct {
    QWino p;
    const int8_t *codes;
} S8Image;

static int32_t value_s8(const void *x, int c, int h, int w) {
    const S8Image *im = x;
    return im->codes[((size_t)c * im->p.H + h) * im->p.W + w];
}

typedef struct {
    QWino p;
    const QWinoCh4 *a;
} Ch4Image;

static int32_t value_ch4(const void *x, int c, int h, int w) {
    const Ch4Image *im = x;
    const QWinoCh4 *a = im->a;
    const int o = a->origin; /* (h, w) inside the image; its padding's zero points are 0 here either way */
    const uint32_t d = a->planes[(size_t)(c / 4) * a->plane + (size_t)(h + 1 - o) * a->Wp + (w + 1 - o)];
    return (int32_t)(d >> (8 * (c % 4)) & 0xffu) - a->zero;
}

void qwino_forward_ref(const QWino *p, int32_t *acc, size_t ldc, const int8_t *x, const int32_t *wp, int out) {
    const S8Image im = {*p, x};
    for (int i = 0; i < p->TH; i++)
        for (int j = 0; j < p->TW; j++)
            for (int r = 0; r < out; r++) {
                int32_t y4[2][2];
                qwino_tile_ref(p, y4, value_s8, &im, wp, out, r, i, j);
                for (int a = 0; a < 2; a++)
                    for (int b = 0; b < 2; b++)
                        if (2 * i + a < p->H && 2 * j + b < p->W) /* exact: y4 is 4 times the sum */
                            acc[(size_t)r * ldc + (size_t)(2 * i + a) * p->W + 2 * j + b] = y4[a][b] / 4;
            }
}

void qwino_floats_ref(const QWino *p, const QWinoFloats *f, const QWinoCh4 *a, const int32_t *wp, int out) {
    const Ch4Image im = {*p, a};
    for (int i = 0; i < p->TH; i++)
        for (int j = 0; j < p->TW; j++)
            for (int r = 0; r < out; r++) {
                int32_t y4[2][2];
                qwino_tile_ref(p, y4, value_ch4, &im, wp, out, r, i, j);
                float y[2][2], mx = 0.0f;
                for (int u = 0; u < 2; u++)
                    for (int b = 0; b < 2; b++) {
                        y[u][b] = fmaf((float)(y4[u][b] / 4), f->scale[r], f->bias ? f->bias[r] : 0.0f);
                        if (f->relu) y[u][b] = y[u][b] > 0.0f ? y[u][b] : 0.0f;
                        mx = y[u][b] > mx ? y[u][b] : mx;
                    }
                if (f->pool) {
                    if (i < p->H / 2 && j < p->W / 2) f->out[(size_t)r * f->ldo + (size_t)i * (p->W / 2) + j] = mx;
                    continue;
                }
                for (int u = 0; u < 2; u++)
                    for (int b = 0; b < 2; b++)
                        if (2 * i + u < p->H && 2 * j + b < p->W)
                            f->out[(size_t)r * f->ldo + (size_t)(2 * i + u) * p->W + 2 * j + b] = y[u][b];
            }
}

void qwino_floats(const QWino *p, const QWinoFloats *f, const QWinoCh4 *a, const int32_t *wp, int out,
                  void *scratch) {
    __atomic_fetch_add(&qwino_floats_calls, 1, __ATOMIC_RELAXED); /* the pool's threads call it */
    if (qgemm_isa() >= QGEMM_ISA_AVX2) qwino_floats_avx2(p, f, a, wp, out, scratch);
    else qwino_floats_ref(p, f, a, wp, out);
}

unsigned long qwino_forward_calls, qwino_floats_calls;

void qwino_forward(const QWino *p, int32_t *acc, size_t ldc, const int8_t *x, const int32_t *wp, int out,
                   void *scratch) {
    __atomic_fetch_add(&qwino_forward_calls, 1, __ATOMIC_RELAXED); /* the pool's threads call it */
    if (qgemm_isa() >= QGEMM_ISA_AVX2) qwino_forward_avx2(p, acc, ldc, x, wp, out, scratch);
    else qwino_forward_ref(p, acc, ldc, x, wp, out);
}
