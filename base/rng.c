#include "rng.h"

#include <math.h>

/* Constants of the Philox4x32 family (Random123). */
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u /* golden ratio */
#define PHILOX_W1 0xBB67AE85u /* sqrt(3) - 1 */

void philox4x32_10(uint32_t out[4], const uint32_t ctr[4], const uint32_t key[2]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = (uint32_t)p0;
        c0 = n0, c1 = n1, c2 = n2, c3 = n3;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

void rng_init(Rng *r, uint64_t seed, uint64_t stream) {
    r->seed = seed;
    r->stream = stream;
    r->counter = 0;
}

Rng rng_fork(const Rng *r, uint64_t stream) {
    Rng f;
    rng_init(&f, r->seed, stream);
    return f;
}

void rng_next_block(Rng *r, uint32_t out[4]) {
    const uint32_t ctr[4] = {(uint32_t)r->counter, (uint32_t)(r->counter >> 32), (uint32_t)r->stream,
                             (uint32_t)(r->stream >> 32)};
    const uint32_t key[2] = {(uint32_t)r->seed, (uint32_t)(r->seed >> 32)};
    philox4x32_10(out, ctr, key);
    r->counter++;
}

void rng_fill_u32(Rng *r, uint32_t *out, size_t n) {
    uint32_t b[4];
    size_t i = 0;
    for (; i + 4 <= n; i += 4) rng_next_block(r, out + i);
    if (i < n) {
        rng_next_block(r, b);
        for (size_t j = 0; i < n; i++, j++) out[i] = b[j];
    }
}

void rng_fill_uniform(Rng *r, float *out, size_t n, float lo, float hi) {
    uint32_t b[4];
    float span = hi - lo;
    for (size_t i = 0; i < n; i += 4) {
        rng_next_block(r, b);
        for (size_t j = 0; j < 4 && i + j < n; j++) out[i + j] = lo + span * rng_u32_to_unit(b[j]);
    }
}

void rng_fill_normal(Rng *r, float *out, size_t n, float mean, float std) {
    uint32_t b[4];
    const double two_pi = 6.283185307179586;
    for (size_t i = 0; i < n; i += 4) {
        rng_next_block(r, b);
        for (size_t j = 0; j < 4; j += 2) {
            /* u1 in (0, 1] so log(u1) is finite. */
            double u1 = ((double)(b[j] >> 8) + 1.0) * 0x1p-24;
            double u2 = (double)(b[j + 1] >> 8) * 0x1p-24;
            double rad = sqrt(-2.0 * log(u1));
            if (i + j < n) out[i + j] = mean + std * (float)(rad * cos(two_pi * u2));
            if (i + j + 1 < n) out[i + j + 1] = mean + std * (float)(rad * sin(two_pi * u2));
        }
    }
}

uint32_t rng_below(Rng *r, uint32_t n) {
    /* Reject the top partial range of 2^32 so every residue is equally likely. */
    uint32_t limit = (uint32_t)(0x100000000ull - (0x100000000ull % n));
    uint32_t b[4];
    for (;;) {
        rng_next_block(r, b);
        for (int j = 0; j < 4; j++)
            if (limit == 0 || b[j] < limit) return b[j] % n;
    }
}

void rng_shuffle_u32(Rng *r, uint32_t *idx, size_t n) {
    for (size_t i = n; i > 1; i--) {
        uint32_t j = rng_below(r, (uint32_t)i);
        uint32_t tmp = idx[i - 1];
        idx[i - 1] = idx[j];
        idx[j] = tmp;
    }
}

void rng_uniforms_init(RngUniforms *u, Rng *rng, size_t n) {
    u->rng = rng, u->left = n, u->pos = 0, u->have = 0;
}

float rng_uniforms_next(RngUniforms *u) {
    if (!u->rng) return 0.0f;
    if (u->pos == u->have) {
        u->have = u->left < RNG_UNIFORMS_CHUNK ? u->left : RNG_UNIFORMS_CHUNK;
        rng_fill_u32(u->rng, u->buf, u->have);
        u->left -= u->have;
        u->pos = 0;
    }
    return rng_u32_to_unit(u->buf[u->pos++]);
}
