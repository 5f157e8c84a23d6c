/* arena.h - bump allocator for memory that lives for one training step.
 *
 * Activations, saved tensors and the grads of non-parameters are taken from
 * an arena and released all at once by arena_reset() after the optimizer
 * step. The arena starts with a capacity sized from the model; if a step
 * needs more it chains an overflow chunk (one malloc), and the next reset
 * folds everything into a single block of the high-water size. From the
 * second step on, a training loop therefore never calls malloc. */
#ifndef QTRAIN_NN_ARENA_H
#define QTRAIN_NN_ARENA_H

#include <stdbool.h>
#include <stddef.h>

#define ARENA_ALIGN 64 /* cache line; also what AVX-512 loads like */

typedef struct ArenaChunk ArenaChunk;

typedef struct {
    ArenaChunk *head;     /* current chunk (newest first) */
    size_t used;          /* bytes handed out since the last reset */
    size_t high_water;    /* largest `used` seen over the arena's life */
    size_t grow_count;    /* chunks malloc'ed after init: tests check this
                             stays constant in the steady state */
} Arena;

/* Returns 0 on success, -1 if the first block cannot be allocated. */
int arena_init(Arena *a, size_t capacity_bytes);
void arena_free(Arena *a);

/* 64-byte aligned, uninitialised; NULL only if malloc fails. */
void *arena_alloc(Arena *a, size_t bytes);
/* Same, zero-filled. */
void *arena_calloc(Arena *a, size_t bytes);
/* Releases everything; coalesces chunks into one block of the high-water
 * size so the next step fits without growing. */
void arena_reset(Arena *a);
/* Takes back the newest bytes handed out: true if p..p+bytes (bytes a
 * multiple of ARENA_ALIGN) ends where the next allocation would start. */
bool arena_give_back(Arena *a, void *p, size_t bytes);
/* Whether p lies in the newest chunk past what is handed out (given back, or never handed out). */
bool arena_is_unused(const Arena *a, const void *p);
/* Bytes the arena currently holds from the system. */
size_t arena_capacity(const Arena *a);

#endif
