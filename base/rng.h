/* rng.h - counter-based random numbers (Philox4x32-10, Salmon et al. 2011).
 *
 * The whole state is (seed, stream, counter): three integers that a
 * checkpoint stores and a resumed run restores, so it draws exactly the same
 * numbers. Output depends only on that state, never on the machine, the
 * thread count or the order of earlier unrelated draws in another stream.
 * Separate uses (init, shuffling, dropout, stochastic rounding) take separate
 * streams of one seed with rng_fork(). */
#ifndef QTRAIN_NN_RNG_H
#define QTRAIN_NN_RNG_H

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct {
    uint64_t seed;    /* the key: 2 x 32 bits */
    uint64_t stream;  /* high 64 bits of the 128-bit counter */
    uint64_t counter; /* low 64 bits: blocks of 4 x 32 bits drawn so far */
} Rng;

/* Well-known stream numbers, so every part of qtrain draws from its own. */
enum {
    RNG_STREAM_INIT = 1,
    RNG_STREAM_SHUFFLE = 2,
    RNG_STREAM_DROPOUT = 3,
    RNG_STREAM_ROUNDING = 4,
    RNG_STREAM_LORA = 5,      /* adapter initialisation */
    RNG_STREAM_WEIGHT_ROUNDING = 6, /* stochastic rounding of PTQ / QAT weights, + (module << 40) */
    RNG_STREAM_AUGMENT = 7,   /* training-batch augmentation, + (epoch << 8) (data/augment.h) */
};

/* The raw block function: 4 x 32 random bits for a counter and a key. */
void philox4x32_10(uint32_t out[4], const uint32_t ctr[4], const uint32_t key[2]);

void rng_init(Rng *r, uint64_t seed, uint64_t stream);
/* A generator of the same seed on another stream, counter 0. */
Rng rng_fork(const Rng *r, uint64_t stream);

/* One block: 4 x 32 bits; advances the counter by one. */
void rng_next_block(Rng *r, uint32_t out[4]);
/* n x 32 bits; advances the counter by ceil(n/4) blocks. Eight blocks at a
 * time in AVX2 lanes where the CPU has it: the same words as the scalar
 * block function (rng_fill_u32_ref), which tests compare. */
void rng_fill_u32(Rng *r, uint32_t *out, size_t n);
void rng_fill_u32_ref(Rng *r, uint32_t *out, size_t n);
/* Tests: the scalar blocks only. */
extern bool rng_force_scalar;
/* Uniform floats in [lo, hi): 24 random bits each. */
void rng_fill_uniform(Rng *r, float *out, size_t n, float lo, float hi);
/* Normal floats (Box-Muller on pairs of uniforms). */
void rng_fill_normal(Rng *r, float *out, size_t n, float mean, float std);
/* A uniform integer in [0, n), unbiased (rejection); n >= 1. */
uint32_t rng_below(Rng *r, uint32_t n);
/* Fisher-Yates shuffle of idx[0..n-1]. */
void rng_shuffle_u32(Rng *r, uint32_t *idx, size_t n);

/* Uniform floats in [0, 1) handed out one at a time, drawn from the rng in
 * chunks: value i is word i of what a single rng_fill_u32(rng, .., n) call
 * would give (chunks are multiples of 4 words, whole Philox blocks), so the
 * chunking never changes the numbers and the rng ends exactly
 * ceil(n / 4) blocks further on. With rng NULL every value is 0. Stochastic
 * rounding takes its noise from here, element by element, without an
 * n-sized buffer. */
#define RNG_UNIFORMS_CHUNK 256
typedef struct {
    Rng *rng;                         /* NULL: every value is 0 */
    size_t left;                      /* words not yet drawn from rng */
    size_t pos, have;                 /* position in / fill of buf */
    uint32_t buf[RNG_UNIFORMS_CHUNK];
} RngUniforms;

void rng_uniforms_init(RngUniforms *u, Rng *rng, size_t n);
float rng_uniforms_next(RngUniforms *u);

/* 24 high bits of u as a float in [0, 1). */
static inline float rng_u32_to_unit(uint32_t u) { return (float)(u >> 8) * 0x1p-24f; }

/* out [n] = the uniforms of words [first, first + n) of what rng_uniforms_next draws from r's present counter
 * (first a multiple of 4: a block boundary), r untouched: Philox's blocks are independent, so threads may each
 * fill a part. The caller then advances r->counter by rng_blocks(total) once. */
void rng_fill_unit_at(const Rng *r, size_t first, float *out, size_t n);
/* The blocks that n words take (a last partial block is drawn whole). */
static inline uint64_t rng_blocks(size_t n) { return (uint64_t)(n / 4 + (n % 4 != 0)); }

#endif
