/* fuzz_h5edit.h - edits of an HDF5 file driven by fuzz input, made through
 * the HDF5 API, so every edited file is one HDF5 itself wrote: the fuzzing
 * reaches qtrain's checks of structure, attributes, shapes and types, not
 * HDF5's own parser (which is not robust to arbitrary bytes).
 *
 * The script is a sequence of operations, each an opcode byte followed by
 * its argument bytes (missing bytes read as 0). Objects are picked by index
 * into the file's links in name order (index 0 is the root group), names
 * and string values from a vocabulary of qtrain's checkpoint layout. The
 * operations (opcode modulo their count):
 *   0 delete a link            1 move/rename a link      2 delete an attribute
 *   3 write an attribute (new or existing name; one of many types, shapes
 *     and values: scalars, arrays, null spaces, strings, compounds, ...)
 *   4 rewrite a dataset with another type, shape, layout and contents
 *   5 truncate a dataset       6 change one element of a dataset
 *   7 add a group, dataset, hard, soft or external link
 *   8 replace a group by a dataset or a dataset by a group
 *   9 put an object in another's place (a second hard link to it)
 *  10 rewrite an attribute's value with another shape
 * and, for opcode bytes from 0xf0 on (so that the ops above keep their
 * opcodes in older inputs):
 *  0xf0-0xf9 store a dataset another way: external storage, a virtual
 *     dataset, chunks larger than the dataset, a filter qtrain refuses or
 *     accepts, compact, never or partly written (external files, virtual
 *     sources and external links point at a FIFO in the scratch
 *     directory: a loader that opened one would block)
 *  0xfa-0xff negate one or all elements of a float dataset (an AdamW v) */
#ifndef QTRAIN_TESTS_FUZZ_H5EDIT_H
#define QTRAIN_TESTS_FUZZ_H5EDIT_H

#include <stddef.h>
#include <stdint.h>

#define FUZZ_H5EDIT_OPS 11
#define FUZZ_H5EDIT_STORAGE_OP 0xf0
#define FUZZ_H5EDIT_NEGATE_OP 0xfa

/* Applies script[size] to a copy of the HDF5 file image base[base_size];
 * *out gets the edited image (malloc'd; the caller frees), *out_size its
 * length. 0 on success; 1 if HDF5 could not open or give back the image. */
int fuzz_h5_edit(const void *base, size_t base_size, const uint8_t *script, size_t size, void **out,
                 size_t *out_size);

#endif
