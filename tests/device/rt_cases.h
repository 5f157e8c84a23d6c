/* rt_cases.h - random cases for device/qtrain_rt.c and a straightforward
 * int64 reference of every kernel, shared by the device_rt suite (the
 * library's build of the runtime) and tests/device/rt_check.c (the same
 * cases in every cross build: portable, AVX2, aarch64 and armhf NEON).
 *
 * rtc_run(seed, n, &res) draws n cases of every kernel from seed, runs each
 * through the runtime and the reference, counts the output values that
 * differ and hashes (FNV-1a 64) every output and every conv scratch size, so
 * two builds that print the same hash wrote the same bytes. Plain C99 with
 * malloc: it runs on a host or under qemu, not on the device. */
#ifndef QTRAIN_TESTS_DEVICE_RT_CASES_H
#define QTRAIN_TESTS_DEVICE_RT_CASES_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/qtrain_rt.h"

/* The fixed set the cross builds run (and the suite compares against its own build). */
#define RTC_CHECK_SEED 0x5eed0de71ce5ULL
#define RTC_CHECK_CASES 400

#define RTC_GUARD 16 /* bytes checked after each output buffer */

typedef struct {
    uint64_t hash;   /* FNV-1a 64 of all outputs and scratch sizes */
    long cases;      /* kernel calls */
    long mismatches; /* output values that differ from the reference, or guard bytes overwritten */
    char first[512]; /* the first mismatch, for the failure's message */
} RtcResult;

typedef struct {
    uint64_t s;
} RtcRng;

static uint64_t rtc_next(RtcRng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi]. */
static int64_t rtc_int(RtcRng *r, int64_t lo, int64_t hi) {
    return lo + (int64_t)(rtc_next(r) % (uint64_t)(hi - lo + 1));
}

static void rtc_hash(RtcResult *res, const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n; i++) res->hash = (res->hash ^ b[i]) * 0x100000001b3ULL;
}

static void *rtc_alloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "rt_cases: out of memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

/* ---- the reference --------------------------------------------------------------------------------------- */

/* floor((v + 2^(n-1)) / 2^n) by division, independent of the runtime's shifts. */
static int64_t rtc_ref_rshift(int64_t v, int n) {
    int64_t d = (int64_t)1 << n, r = v + d / 2;
    int64_t q = r / d;
    if (r % d != 0 && r < 0) q--;
    return q;
}

static int8_t rtc_ref_requant(int64_t v, int n, int32_t zp, int32_t lo, int32_t hi) {
    int64_t y = zp + rtc_ref_rshift(v, n);
    if (y < lo) y = lo;
    if (y > hi) y = hi;
    return (int8_t)y;
}

static int rtc_ref_weight(int bits, const void *w, size_t i) {
    if (bits == 8) return ((const int8_t *)w)[i];
    int nib = (((const uint8_t *)w)[i / 2] >> (i % 2 ? 4 : 0)) & 15;
    return nib >= 8 ? nib - 16 : nib;
}

static void rtc_ref_conv2d(const qrt_conv2d_t *p, const int8_t *x, int8_t *y) {
    int cin_g = p->in_c / p->groups, cout_g = p->out_c / p->groups;
    for (int o = 0; o < p->out_c; o++) {
        int g = o / cout_g;
        for (int oh = 0; oh < p->out_h; oh++)
            for (int ow = 0; ow < p->out_w; ow++) {
                int64_t acc = p->bias[o];
                for (int ic = 0; ic < cin_g; ic++)
                    for (int kh = 0; kh < p->k_h; kh++)
                        for (int kw = 0; kw < p->k_w; kw++) {
                            int ih = oh * p->stride_h - p->pad_t + kh * p->dil_h;
                            int iw = ow * p->stride_w - p->pad_l + kw * p->dil_w;
                            int64_t xv = p->in_zp;
                            if (ih >= 0 && ih < p->in_h && iw >= 0 && iw < p->in_w)
                                xv = x[((size_t)(g * cin_g + ic) * p->in_h + ih) * p->in_w + iw];
                            size_t wi = (((size_t)o * cin_g + ic) * p->k_h + kh) * p->k_w + kw;
                            acc += (xv - p->in_zp) * rtc_ref_weight(p->w_bits, p->weight, wi);
                        }
                y[((size_t)o * p->out_h + oh) * p->out_w + ow] =
                    rtc_ref_requant(acc * p->mult[o], p->shift[o], p->out_zp, p->act_min, p->act_max);
            }
    }
}

static void rtc_ref_dense(const qrt_dense_t *p, const int8_t *x, int8_t *y) {
    for (int o = 0; o < p->out; o++) {
        int64_t acc = p->bias[o];
        for (int k = 0; k < p->in; k++)
            acc += (int64_t)(x[k] - p->in_zp) * rtc_ref_weight(p->w_bits, p->weight, (size_t)o * p->in + k);
        y[o] = rtc_ref_requant(acc * p->mult[o], p->shift[o], p->out_zp, p->act_min, p->act_max);
    }
}

static void rtc_ref_pool(const qrt_maxpool2d_t *m, const qrt_avgpool2d_t *a, const int8_t *x, int8_t *y) {
    int c = m ? m->c : a->c, in_h = m ? m->in_h : a->in_h, in_w = m ? m->in_w : a->in_w;
    int out_h = m ? m->out_h : a->out_h, out_w = m ? m->out_w : a->out_w, k_h = m ? m->k_h : a->k_h;
    int k_w = m ? m->k_w : a->k_w, s_h = m ? m->stride_h : a->stride_h, s_w = m ? m->stride_w : a->stride_w;
    for (int ch = 0; ch < c; ch++)
        for (int oh = 0; oh < out_h; oh++)
            for (int ow = 0; ow < out_w; ow++) {
                int64_t mx = -1000, sum = 0;
                for (int kh = 0; kh < k_h; kh++)
                    for (int kw = 0; kw < k_w; kw++) {
                        int v = x[((size_t)ch * in_h + oh * s_h + kh) * in_w + ow * s_w + kw];
                        mx = v > mx ? v : mx;
                        sum += v;
                    }
                int8_t *o = &y[((size_t)ch * out_h + oh) * out_w + ow];
                if (m)
                    *o = (int8_t)mx;
                else
                    *o = rtc_ref_requant((sum - (int64_t)k_h * k_w * a->in_zp) * a->mult, a->shift, a->out_zp,
                                         a->act_min, a->act_max);
            }
}

/* ---- random parameters ----------------------------------------------------------------------------------- */

/* bits(v): the number of bits of |v| (0 for 0). */
static int rtc_bits(int64_t v) {
    int b = 0;
    for (v = v < 0 ? -v : v; v; v >>= 1) b++;
    return b;
}

/* A multiplier and shift for accumulators of about amax: usually ones that bring them to about +-100, sometimes
 * extremes (shift 1 or 62, multiplier 0, 1 or 2^31 - 1) and powers of two with small shifts, where exact .5 ties
 * (round half up, also of negative values) are frequent. */
static void rtc_mult_shift(RtcRng *r, int64_t amax, int32_t *mult, int *shift) {
    int kind = (int)rtc_int(r, 0, 9);
    if (kind <= 5) {
        *mult = (int32_t)rtc_int(r, (int64_t)1 << 30, ((int64_t)1 << 31) - 1);
        int s = 31 + rtc_bits(amax) - 7 + (int)rtc_int(r, -2, 2);
        *shift = s < 1 ? 1 : s > 62 ? 62 : s;
    } else if (kind <= 7) {
        int e = (int)rtc_int(r, 0, 8);
        *mult = (int32_t)1 << e;
        *shift = (int)rtc_int(r, 1, e + rtc_bits(amax) > 8 ? e + rtc_bits(amax) - 5 : 3);
        if (*shift > 62) *shift = 62;
    } else {
        static const int32_t mults[] = {0, 1, 2147483647, 1073741824, 3};
        *mult = mults[rtc_int(r, 0, 4)];
        *shift = rtc_int(r, 0, 1) ? 1 : rtc_int(r, 0, 1) ? 62 : (int)rtc_int(r, 1, 62);
    }
}

/* Zero points and the output clamp: the full int8 range, a relu (act_min = out_zp) or a narrower range. */
static void rtc_zps(RtcRng *r, int32_t *in_zp, int32_t *out_zp, int32_t *lo, int32_t *hi) {
    *in_zp = (int32_t)(rtc_int(r, 0, 3) == 0 ? rtc_int(r, -128, 127) : rtc_int(r, -8, 8));
    if (rtc_int(r, 0, 7) == 0) *in_zp = rtc_int(r, 0, 1) ? -128 : 127;
    *out_zp = (int32_t)rtc_int(r, -128, 127);
    int kind = (int)rtc_int(r, 0, 2);
    *lo = -128;
    *hi = 127;
    if (kind == 1) *lo = *out_zp;
    if (kind == 2) {
        *lo = (int32_t)rtc_int(r, -128, 127);
        *hi = (int32_t)rtc_int(r, *lo, 127);
    }
}

/* n weights of w_bits (int8 full range, int4 in [-8, 7]), packed. */
static void *rtc_weights(RtcRng *r, int bits, size_t n) {
    if (bits == 8) {
        int8_t *w = (int8_t *)rtc_alloc(n);
        for (size_t i = 0; i < n; i++) w[i] = (int8_t)rtc_int(r, -128, 127);
        return w;
    }
    uint8_t *w = (uint8_t *)rtc_alloc((n + 1) / 2);
    memset(w, 0, (n + 1) / 2);
    for (size_t i = 0; i < n; i++) w[i / 2] |= (uint8_t)((rtc_int(r, -8, 7) & 15) << (i % 2 ? 4 : 0));
    return w;
}

static void rtc_fill(RtcRng *r, int8_t *x, size_t n) {
    int narrow = rtc_int(r, 0, 3) == 0; /* sometimes only extremes */
    for (size_t i = 0; i < n; i++)
        x[i] = (int8_t)(narrow ? (rtc_int(r, 0, 1) ? 127 : -128) : rtc_int(r, -128, 127));
}

/* Compares n outputs (and the guard bytes after them, set to 0x5a) with the reference; hashes the outputs. */
static void rtc_compare(RtcResult *res, const char *what, const int8_t *got, const int8_t *want, size_t n) {
    long bad = 0;
    size_t first = 0;
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i] && bad++ == 0) first = i;
    for (size_t i = 0; i < RTC_GUARD; i++)
        if ((unsigned char)got[n + i] != 0x5a && bad++ == 0) first = n + i;
    if (bad && res->mismatches == 0)
        snprintf(res->first, sizeof res->first, "case %ld (%s): %ld of %zu values differ, first [%zu]: %d, want %d",
                 res->cases, what, bad, n, first, first < n ? got[first] : (int)(unsigned char)got[first],
                 first < n ? want[first] : 0x5a);
    res->mismatches += bad;
    res->cases++;
    rtc_hash(res, got, n);
}

static int8_t *rtc_out(size_t n) {
    int8_t *y = (int8_t *)rtc_alloc(n + RTC_GUARD);
    memset(y, 0x5a, n + RTC_GUARD);
    return y;
}

/* ---- the cases ------------------------------------------------------------------------------------------- */

static void rtc_case_conv(RtcRng *r, RtcResult *res, int big) {
    qrt_conv2d_t p;
    char what[256];
    int pad_b, pad_r;
    memset(&p, 0, sizeof p);
    do {
        int kind = (int)rtc_int(r, 0, 3); /* 0: groups 1, 1: depthwise, 2: grouped, 3: depthwise multiplier */
        int cin_g = kind == 1 || kind == 3 ? 1 : (int)rtc_int(r, 1, big ? 40 : 9);
        int cout_g = kind == 1 ? 1 : (int)rtc_int(r, 1, big ? 40 : 6);
        p.groups = kind == 0 ? 1 : (int)rtc_int(r, 1, big ? 16 : 5);
        if (kind == 0 && rtc_int(r, 0, 3) == 0) cin_g = 1; /* a first layer on one channel */
        p.in_c = cin_g * p.groups;
        p.out_c = cout_g * p.groups;
        p.in_h = (int)rtc_int(r, 1, big ? 16 : 11);
        p.in_w = rtc_int(r, 0, 2) ? p.in_h : (int)rtc_int(r, 1, big ? 30 : 11);
        if (big && rtc_int(r, 0, 3) == 0) /* rows longer than the kernels' accumulator blocks */
            p.in_h = (int)rtc_int(r, 1, 3), p.in_w = (int)rtc_int(r, 200, 600);
        p.k_h = rtc_int(r, 0, 1) ? 3 : (int)rtc_int(r, 1, 5);
        p.k_w = rtc_int(r, 0, 2) ? p.k_h : (int)rtc_int(r, 1, 5);
        p.stride_h = rtc_int(r, 0, 1) ? 1 : (int)rtc_int(r, 1, 3);
        p.stride_w = rtc_int(r, 0, 2) ? p.stride_h : (int)rtc_int(r, 1, 3);
        p.dil_h = rtc_int(r, 0, 3) ? 1 : (int)rtc_int(r, 1, 3);
        p.dil_w = rtc_int(r, 0, 2) ? p.dil_h : (int)rtc_int(r, 1, 3);
        p.pad_t = (int)rtc_int(r, 0, 2);
        p.pad_l = rtc_int(r, 0, 2) ? p.pad_t : (int)rtc_int(r, 0, 3);
        pad_b = rtc_int(r, 0, 2) ? p.pad_t : (int)rtc_int(r, 0, 2);
        pad_r = rtc_int(r, 0, 2) ? p.pad_l : (int)rtc_int(r, 0, 2);
        p.out_h = (p.in_h + p.pad_t + pad_b - p.dil_h * (p.k_h - 1) - 1) / p.stride_h + 1;
        p.out_w = (p.in_w + p.pad_l + pad_r - p.dil_w * (p.k_w - 1) - 1) / p.stride_w + 1;
    } while (p.in_h + p.pad_t + pad_b < p.dil_h * (p.k_h - 1) + 1 ||
             p.in_w + p.pad_l + pad_r < p.dil_w * (p.k_w - 1) + 1);
    p.w_bits = rtc_int(r, 0, 2) ? 8 : 4;
    rtc_zps(r, &p.in_zp, &p.out_zp, &p.act_min, &p.act_max);
    size_t k = (size_t)(p.in_c / p.groups) * p.k_h * p.k_w, nx = (size_t)p.in_c * p.in_h * p.in_w;
    size_t ny = (size_t)p.out_c * p.out_h * p.out_w;
    int8_t *x = (int8_t *)rtc_alloc(nx), *y = rtc_out(ny), *want = (int8_t *)rtc_alloc(ny);
    void *w = rtc_weights(r, p.w_bits, (size_t)p.out_c * k);
    int32_t *bias = (int32_t *)rtc_alloc(sizeof(int32_t) * p.out_c);
    int32_t *mult = (int32_t *)rtc_alloc(sizeof(int32_t) * p.out_c);
    int8_t *shift = (int8_t *)rtc_alloc((size_t)p.out_c);
    rtc_fill(r, x, nx);
    int64_t amax = (int64_t)k * 128 * (p.w_bits == 8 ? 64 : 4) / 4 + 1;
    for (int o = 0; o < p.out_c; o++) {
        int s;
        bias[o] = (int32_t)rtc_int(r, -amax, amax);
        rtc_mult_shift(r, amax, &mult[o], &s);
        shift[o] = (int8_t)s;
    }
    p.weight = w;
    p.bias = bias;
    p.mult = mult;
    p.shift = shift;
    /* The scratch at an odd address and exactly as large as asked: the kernel aligns it itself. */
    size_t ns = qrt_conv2d_scratch(&p);
    uint64_t ns64 = ns;
    rtc_hash(res, &ns64, sizeof ns64);
    unsigned char *scratch = (unsigned char *)rtc_alloc(ns + 1);
    int odd = (int)rtc_int(r, 0, 1);
    /* a quarter of the cases without scratch: the direct loop a device short of RAM runs */
    const int direct = rtc_int(r, 0, 3) == 0;
    qrt_conv2d(&p, x, y, ns && !direct ? scratch + odd : NULL);
    rtc_ref_conv2d(&p, x, want);
    snprintf(what, sizeof what,
             "conv2d in %dx%dx%d out %dx%dx%d k %dx%d s %d,%d pad %d,%d dil %d,%d groups %d w%d zp %d->%d [%d,%d]",
             p.in_c, p.in_h, p.in_w, p.out_c, p.out_h, p.out_w, p.k_h, p.k_w, p.stride_h, p.stride_w, p.pad_t,
             p.pad_l, p.dil_h, p.dil_w, p.groups, p.w_bits, p.in_zp, p.out_zp, p.act_min, p.act_max);
    rtc_compare(res, what, y, want, ny);
    free(x), free(y), free(want), free(w), free(bias), free(mult), free(shift), free(scratch);
}

static void rtc_case_dense(RtcRng *r, RtcResult *res, int big) {
    qrt_dense_t p;
    char what[160];
    memset(&p, 0, sizeof p);
    p.in = (int)(big ? rtc_int(r, 200, 3200) : rtc_int(r, 1, 80));
    p.out = (int)rtc_int(r, 1, big ? 40 : 13);
    p.w_bits = rtc_int(r, 0, 2) ? 8 : 4;
    rtc_zps(r, &p.in_zp, &p.out_zp, &p.act_min, &p.act_max);
    int8_t *x = (int8_t *)rtc_alloc((size_t)p.in), *y = rtc_out((size_t)p.out);
    int8_t *want = (int8_t *)rtc_alloc((size_t)p.out);
    void *w = rtc_weights(r, p.w_bits, (size_t)p.out * p.in);
    int32_t *bias = (int32_t *)rtc_alloc(sizeof(int32_t) * p.out);
    int32_t *mult = (int32_t *)rtc_alloc(sizeof(int32_t) * p.out);
    int8_t *shift = (int8_t *)rtc_alloc((size_t)p.out);
    rtc_fill(r, x, (size_t)p.in);
    int64_t amax = (int64_t)p.in * 128 * (p.w_bits == 8 ? 64 : 4) / 4 + 1;
    for (int o = 0; o < p.out; o++) {
        int s;
        bias[o] = (int32_t)rtc_int(r, -amax, amax);
        rtc_mult_shift(r, amax, &mult[o], &s);
        shift[o] = (int8_t)s;
    }
    p.weight = w;
    p.bias = bias;
    p.mult = mult;
    p.shift = shift;
    qrt_dense(&p, x, y);
    rtc_ref_dense(&p, x, want);
    snprintf(what, sizeof what, "dense %d->%d w%d zp %d->%d [%d,%d]", p.in, p.out, p.w_bits, p.in_zp, p.out_zp,
             p.act_min, p.act_max);
    rtc_compare(res, what, y, want, (size_t)p.out);
    free(x), free(y), free(want), free(w), free(bias), free(mult), free(shift);
}

/* Max pool, average pool and global average pool. */
static void rtc_case_pool(RtcRng *r, RtcResult *res) {
    qrt_maxpool2d_t m;
    qrt_avgpool2d_t a;
    int avg = (int)rtc_int(r, 0, 1), global = avg && rtc_int(r, 0, 2) == 0;
    char what[160];
    memset(&m, 0, sizeof m);
    memset(&a, 0, sizeof a);
    m.c = (int)rtc_int(r, 1, 6);
    m.in_h = (int)rtc_int(r, 1, 12);
    m.in_w = (int)rtc_int(r, 1, 12);
    m.k_h = global ? m.in_h : (int)rtc_int(r, 1, m.in_h < 4 ? m.in_h : 4);
    m.k_w = global ? m.in_w : (int)rtc_int(r, 1, m.in_w < 4 ? m.in_w : 4);
    m.stride_h = global ? 1 : (int)rtc_int(r, 1, 3);
    m.stride_w = global ? 1 : (int)rtc_int(r, 1, 3);
    m.out_h = (m.in_h - m.k_h) / m.stride_h + 1;
    m.out_w = (m.in_w - m.k_w) / m.stride_w + 1;
    a.c = m.c, a.in_h = m.in_h, a.in_w = m.in_w, a.out_h = m.out_h, a.out_w = m.out_w;
    a.k_h = m.k_h, a.k_w = m.k_w, a.stride_h = m.stride_h, a.stride_w = m.stride_w;
    rtc_zps(r, &a.in_zp, &a.out_zp, &a.act_min, &a.act_max);
    rtc_mult_shift(r, (int64_t)255 * a.k_h * a.k_w, &a.mult, &a.shift);
    size_t nx = (size_t)m.c * m.in_h * m.in_w, ny = (size_t)m.c * m.out_h * m.out_w;
    int8_t *x = (int8_t *)rtc_alloc(nx), *y = rtc_out(ny), *want = (int8_t *)rtc_alloc(ny);
    rtc_fill(r, x, nx);
    if (avg)
        qrt_avgpool2d(&a, x, y);
    else
        qrt_maxpool2d(&m, x, y);
    rtc_ref_pool(avg ? NULL : &m, avg ? &a : NULL, x, want);
    snprintf(what, sizeof what, "%s %dx%dx%d k %dx%d s %d,%d", avg ? "avgpool2d" : "maxpool2d", m.c, m.in_h, m.in_w,
             m.k_h, m.k_w, m.stride_h, m.stride_w);
    rtc_compare(res, what, y, want, ny);
    free(x), free(y), free(want);
}

/* add, requant_n, relu and quantize_u8, each out of place and (but quantize_u8) in place. */
static void rtc_case_elementwise(RtcRng *r, RtcResult *res) {
    int n = (int)rtc_int(r, 1, 300), in_place = (int)rtc_int(r, 0, 1), kind = (int)rtc_int(r, 0, 3);
    int8_t *a = rtc_out((size_t)n), *b = (int8_t *)rtc_alloc((size_t)n), *want = (int8_t *)rtc_alloc((size_t)n);
    int8_t *y = in_place ? a : rtc_out((size_t)n);
    char what[160];
    rtc_fill(r, a, (size_t)n);
    rtc_fill(r, b, (size_t)n);
    if (kind == 0) {
        qrt_add_t p;
        memset(&p, 0, sizeof p);
        int32_t dummy;
        p.n = n;
        rtc_zps(r, &p.a_zp, &p.out_zp, &p.act_min, &p.act_max);
        rtc_zps(r, &p.b_zp, &dummy, &dummy, &dummy);
        rtc_mult_shift(r, 255, &p.a_mult, &p.shift);
        p.b_mult = rtc_int(r, 0, 3) ? (int32_t)rtc_int(r, 0, ((int64_t)1 << 31) - 1) : p.a_mult;
        for (int i = 0; i < n; i++)
            want[i] = rtc_ref_requant((int64_t)(a[i] - p.a_zp) * p.a_mult + (int64_t)(b[i] - p.b_zp) * p.b_mult,
                                      p.shift, p.out_zp, p.act_min, p.act_max);
        qrt_add(&p, a, b, y);
        snprintf(what, sizeof what, "add n %d mult %d,%d shift %d%s", n, (int)p.a_mult, (int)p.b_mult, p.shift,
                 in_place ? " in place" : "");
    } else if (kind == 1) {
        qrt_requant_t p;
        memset(&p, 0, sizeof p);
        p.n = n;
        rtc_zps(r, &p.in_zp, &p.out_zp, &p.act_min, &p.act_max);
        rtc_mult_shift(r, 255, &p.mult, &p.shift);
        for (int i = 0; i < n; i++)
            want[i] = rtc_ref_requant((int64_t)(a[i] - p.in_zp) * p.mult, p.shift, p.out_zp, p.act_min, p.act_max);
        qrt_requant_n(&p, a, y);
        snprintf(what, sizeof what, "requant_n n %d mult %d shift %d%s", n, (int)p.mult, p.shift,
                 in_place ? " in place" : "");
    } else if (kind == 2) {
        int32_t lo = (int32_t)rtc_int(r, -128, 127);
        for (int i = 0; i < n; i++) want[i] = a[i] < lo ? (int8_t)lo : a[i];
        qrt_relu(n, lo, a, y);
        snprintf(what, sizeof what, "relu n %d lo %d%s", n, (int)lo, in_place ? " in place" : "");
    } else {
        int c = (int)rtc_int(r, 1, 3), hw = (int)rtc_int(r, 1, 100);
        int8_t *table = (int8_t *)rtc_alloc((size_t)c * 256);
        uint8_t *xu = (uint8_t *)rtc_alloc((size_t)c * hw);
        rtc_fill(r, table, (size_t)c * 256);
        for (int i = 0; i < c * hw; i++) xu[i] = (uint8_t)rtc_int(r, 0, 255);
        int8_t *yq = rtc_out((size_t)c * hw), *wq = (int8_t *)rtc_alloc((size_t)c * hw);
        for (int i = 0; i < c * hw; i++) wq[i] = table[(size_t)(i / hw) * 256 + xu[i]];
        qrt_quantize_u8(c, hw, table, xu, yq);
        snprintf(what, sizeof what, "quantize_u8 %d x %d", c, hw);
        rtc_compare(res, what, yq, wq, (size_t)c * hw);
        free(table), free(xu), free(yq), free(wq);
        if (!in_place) free(y);
        free(a), free(b), free(want);
        return;
    }
    rtc_compare(res, what, y, want, (size_t)n);
    if (!in_place) free(y);
    free(a), free(b), free(want);
}

/* Exact .5 ties, negative ones too, on every kernel that requantizes an accumulator: dense (acc = its bias, every
 * value in [-128, 127]), a 1x1 conv and a 1x1 depthwise conv on a 16x16 image of every int8 value (acc = x), each
 * with multiplier 1 and shift 1, and multiplier 3 and shift 2. */
static void rtc_case_ties(RtcResult *res) {
    static int8_t x[2 * 256], y[2 * 256 + RTC_GUARD], want[2 * 256], w[4];
    static int32_t bias[256], mult[256];
    static int8_t shift[256];
    for (int i = 0; i < 256; i++) {
        x[i] = x[256 + i] = (int8_t)(i - 128);
        bias[i] = i - 128;
        mult[i] = i % 2 ? 3 : 1;
        shift[i] = (int8_t)(i % 2 ? 2 : 1);
    }
    qrt_dense_t d;
    memset(&d, 0, sizeof d);
    d.in = 1, d.out = 256, d.w_bits = 8, d.act_min = -128, d.act_max = 127;
    int8_t *ones = (int8_t *)rtc_alloc(256), zero = 0;
    memset(ones, 1, 256);
    d.weight = ones, d.bias = bias, d.mult = mult, d.shift = shift;
    memset(y, 0x5a, sizeof y);
    qrt_dense(&d, &zero, y);
    rtc_ref_dense(&d, &zero, want);
    rtc_compare(res, "dense ties", y, want, 256);
    free(ones);
    for (int dw = 0; dw < 2; dw++) {
        static const int32_t zeros[2] = {0, 0}, mults[2] = {1, 3};
        static const int8_t shifts[2] = {1, 2};
        qrt_conv2d_t p;
        memset(&p, 0, sizeof p);
        p.in_c = p.out_c = 2, p.in_h = p.in_w = p.out_h = p.out_w = 16, p.groups = dw ? 2 : 1;
        p.k_h = p.k_w = p.stride_h = p.stride_w = p.dil_h = p.dil_w = 1, p.w_bits = 8;
        p.act_min = -128, p.act_max = 127;
        w[0] = 1, w[1] = dw ? 1 : 0, w[2] = 0, w[3] = 1; /* depthwise: (1, 1); else (1, 0), (0, 1) */
        p.weight = w, p.bias = zeros, p.mult = mults, p.shift = shifts;
        unsigned char scratch[4096 + 64];
        memset(y, 0x5a, sizeof y);
        qrt_conv2d(&p, x, y, qrt_conv2d_scratch(&p) <= sizeof scratch ? scratch : NULL);
        rtc_ref_conv2d(&p, x, want);
        rtc_compare(res, dw ? "depthwise ties" : "conv2d ties", y, want, 512);
    }
}

/* n cases of each kind from seed (one in eight conv and dense cases a larger one, as small CNNs have). */
static void rtc_run(uint64_t seed, int n, RtcResult *res) {
    RtcRng r;
    r.s = seed;
    memset(res, 0, sizeof *res);
    res->hash = 0xcbf29ce484222325ULL;
    rtc_case_ties(res);
    for (int i = 0; i < n; i++) {
        rtc_case_conv(&r, res, i % 8 == 7);
        rtc_case_dense(&r, res, i % 8 == 3);
        rtc_case_pool(&r, res);
        rtc_case_elementwise(&r, res);
    }
}

#endif
