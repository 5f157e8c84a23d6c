#include "rng.h"

#include <math.h>
#include <stdbool.h>

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

void rng_fill_u32_ref(Rng *r, uint32_t *out, size_t n) {
    uint32_t b[4];
    size_t i = 0;
    for (; i + 4 <= n; i += 4) rng_next_block(r, out + i);
    if (i < n) {
        rng_next_block(r, b);
        for (size_t j = 0; i < n; i++, j++) out[i] = b[j];
    }
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define RNG_AVX2 __attribute__((target("avx2")))

/* The high 32 bits of m * x in each 32-bit lane (vpmuludq takes the even lanes; the odd ones shifted down). */
RNG_AVX2 static inline __m256i mulhi_epu32(__m256i x, __m256i m) {
    const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(x, m), 32);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);
    return _mm256_blend_epi32(even, odd, 0xAA); /* odd lanes: the high halves, already in place */
}

/* 8 blocks (32 words) from counter r->counter on, in the order of 8 rng_next_block calls: philox4x32_10 in 8
 * lanes, then a 4 x 8 transpose. */
RNG_AVX2 static void philox_x8(Rng *r, uint32_t *out) {
    uint32_t lo[8], hi[8];
    for (int i = 0; i < 8; i++) {
        const uint64_t c = r->counter + (uint64_t)i;
        lo[i] = (uint32_t)c, hi[i] = (uint32_t)(c >> 32);
    }
    __m256i c0 = _mm256_loadu_si256((const __m256i *)lo), c1 = _mm256_loadu_si256((const __m256i *)hi);
    __m256i c2 = _mm256_set1_epi32((int)(uint32_t)r->stream), c3 = _mm256_set1_epi32((int)(uint32_t)(r->stream >> 32));
    uint32_t k0 = (uint32_t)r->seed, k1 = (uint32_t)(r->seed >> 32);
    const __m256i m0 = _mm256_set1_epi32((int)PHILOX_M0), m1 = _mm256_set1_epi32((int)PHILOX_M1);
    for (int round = 0; round < 10; round++) {
        const __m256i hi0 = mulhi_epu32(c0, m0), lo0 = _mm256_mullo_epi32(c0, m0);
        const __m256i hi1 = mulhi_epu32(c2, m1), lo1 = _mm256_mullo_epi32(c2, m1);
        const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32((int)k0));
        const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32((int)k1));
        c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    /* lanes b of c0..c3 are words 4b .. 4b + 3 */
    const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    const __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    const __m256i b0 = _mm256_unpacklo_epi64(t0, t2), b1 = _mm256_unpackhi_epi64(t0, t2); /* blocks 0, 1 | 4, 5 */
    const __m256i b2 = _mm256_unpacklo_epi64(t1, t3), b3 = _mm256_unpackhi_epi64(t1, t3); /* blocks 2, 3 | 6, 7 */
    _mm256_storeu_si256((__m256i *)out, _mm256_permute2x128_si256(b0, b1, 0x20));
    _mm256_storeu_si256((__m256i *)(out + 8), _mm256_permute2x128_si256(b2, b3, 0x20));
    _mm256_storeu_si256((__m256i *)(out + 16), _mm256_permute2x128_si256(b0, b1, 0x31));
    _mm256_storeu_si256((__m256i *)(out + 24), _mm256_permute2x128_si256(b2, b3, 0x31));
    r->counter += 8;
}

static bool rng_avx2(void) {
    static int has = -1;
    if (has < 0) has = __builtin_cpu_supports("avx2");
    return has;
}
#endif

bool rng_force_scalar;

void rng_fill_u32(Rng *r, uint32_t *out, size_t n) {
    size_t i = 0;
#if defined(__x86_64__) || defined(__i386__)
    if (!rng_force_scalar && n >= 32 && rng_avx2())
        for (; i + 32 <= n; i += 32) philox_x8(r, out + i);
#endif
    rng_fill_u32_ref(r, out + i, n - i);
}

/* The words through rng_fill_u32 (8 blocks at a time in AVX2) in chunks of whole blocks: the same words and the
 * same counter at the end as one block per 4 values (a last partial block is used in part, as there). */
void rng_fill_uniform(Rng *r, float *out, size_t n, float lo, float hi) {
    uint32_t b[256];
    const float span = hi - lo;
    for (size_t i = 0; i < n; i += 256) {
        const size_t m = n - i < 256 ? n - i : 256;
        rng_fill_u32(r, b, m);
        for (size_t j = 0; j < m; j++) out[i + j] = lo + span * rng_u32_to_unit(b[j]);
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

void rng_fill_unit_at(const Rng *r, size_t first, float *out, size_t n) {
    Rng at = *r;
    at.counter += first / 4;
    uint32_t b[256];
    for (size_t i = 0; i < n; i += 256) {
        const size_t m = n - i < 256 ? n - i : 256;
        rng_fill_u32(&at, b, m);
        for (size_t j = 0; j < m; j++) out[i + j] = rng_u32_to_unit(b[j]);
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
