#include "arena.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct ArenaChunk {
    ArenaChunk *next; /* older chunk */
    size_t cap;       /* usable bytes in data[] */
    size_t off;       /* bytes used in data[] */
    _Alignas(ARENA_ALIGN) unsigned char data[];
};

static size_t align_up(size_t n) { return (n + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1); }

static ArenaChunk *chunk_new(size_t cap) {
    cap = align_up(cap ? cap : ARENA_ALIGN);
    ArenaChunk *c = aligned_alloc(ARENA_ALIGN, align_up(sizeof(ArenaChunk) + cap));
    if (!c) return NULL;
    c->next = NULL;
    c->cap = cap;
    c->off = 0;
    return c;
}

int arena_init(Arena *a, size_t capacity_bytes) {
    memset(a, 0, sizeof *a);
    a->head = chunk_new(capacity_bytes);
    return a->head ? 0 : -1;
}

void arena_free(Arena *a) {
    ArenaChunk *c = a->head;
    while (c) {
        ArenaChunk *next = c->next;
        free(c);
        c = next;
    }
    memset(a, 0, sizeof *a);
}

void *arena_alloc(Arena *a, size_t bytes) {
    size_t need = align_up(bytes ? bytes : 1);
    ArenaChunk *c = a->head;
    if (!c || c->cap - c->off < need) {
        /* Overflow: grow by at least the request, and by half of what the
         * step has used so far so a long step does not chain many chunks. */
        size_t cap = need > a->used / 2 ? need : a->used / 2;
        ArenaChunk *n = chunk_new(cap);
        if (!n) return NULL;
        n->next = c;
        a->head = n;
        a->grow_count++;
        c = n;
    }
    void *p = c->data + c->off;
    c->off += need;
    a->used += need;
    if (a->used > a->high_water) a->high_water = a->used;
    return p;
}

void *arena_calloc(Arena *a, size_t bytes) {
    void *p = arena_alloc(a, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

bool arena_give_back(Arena *a, void *p, size_t bytes) {
    ArenaChunk *c = a->head;
    if (!c || bytes > c->off || (unsigned char *)p != c->data + c->off - bytes) return false;
    c->off -= bytes;
    a->used -= bytes;
    return true;
}

bool arena_is_unused(const Arena *a, const void *p) {
    const ArenaChunk *c = a->head;
    return c && (const unsigned char *)p >= c->data + c->off && (const unsigned char *)p < c->data + c->cap;
}

void arena_reset(Arena *a) {
    if (a->head && a->head->next) {
        /* More than one chunk: replace them by one block that fits the
         * largest step seen, so the steady state never grows. */
        size_t cap = a->high_water;
        ArenaChunk *c = a->head;
        while (c) {
            ArenaChunk *next = c->next;
            free(c);
            c = next;
        }
        a->head = chunk_new(cap);
    }
    if (a->head) a->head->off = 0;
    a->used = 0;
}

size_t arena_capacity(const Arena *a) {
    size_t cap = 0;
    for (const ArenaChunk *c = a->head; c; c = c->next) cap += c->cap;
    return cap;
}
