/* fuzz_h5edit_internal.h - what fuzz_h5edit.c (the script and most edits)
 * and fuzz_h5edit_storage.c (the storage edits) share; no other file
 * includes it. */
#ifndef QTRAIN_TESTS_FUZZ_H5EDIT_INTERNAL_H
#define QTRAIN_TESTS_FUZZ_H5EDIT_INTERNAL_H

#include <hdf5.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_LINKS 512
#define NAME_MAX_LEN 256

/* The script's bytes; reading past the end gives 0. */
typedef struct {
    const uint8_t *p;
    size_t n, i;
} Reader;

static inline uint8_t u8(Reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }

static inline uint16_t u16(Reader *r) {
    uint16_t hi = u8(r);
    return (uint16_t)(hi << 8 | u8(r));
}

/* The file's links in name order, "/" first. */
typedef struct {
    char names[MAX_LINKS][NAME_MAX_LEN];
    int n;
} Links;

static inline const char *pick(Reader *r, const Links *l) { return l->names[u8(r) % l->n]; }

/* Whether path is reached through hard links only and is of type want ("/" is a group). */
bool is_kind(hid_t f, const char *path, H5I_type_t want);

typedef struct {
    void *buf;      /* raw elements in the file type, or NULL */
    size_t numel, esize;
    hid_t type;     /* the file type (copy), or H5I_INVALID_HID */
    int rank;
    hsize_t dims[H5S_MAX_RANK];
} DsCopy;

void ds_copy_free(DsCopy *c);
/* The dataset's raw contents into *c (fixed-size types, at most 65536
 * elements, stored plainly in this file); false if it has none such. */
bool ds_read(hid_t f, const char *path, DsCopy *c);

/* A FIFO in the scratch directory (NULL if it cannot be made). */
const char *fifo_path(void);
/* Opcodes 0xf0-0xf9: one dataset stored another way. */
void op_storage(hid_t f, Reader *r, const Links *l);

#endif
