/* h5io_internal.h - what h5io.c, h5io_attr.c and h5io_safe.c share; no
 * other file includes it. */
#ifndef QTRAIN_BASE_H5IO_INTERNAL_H
#define QTRAIN_BASE_H5IO_INTERNAL_H

#include "h5io.h"

/* The longest string attribute read (a config is a few KiB). */
#define H5IO_ATTR_STR_MAX ((size_t)16 << 20)

/* "<file>: cannot <what> /<obj> (<HDF5's reason>)"; call it right after the
 * failed HDF5 call, whose error stack it reads. */
QtStatus h5io_fail(QtError *err, QtStatus st, const H5ioFile *f, const char *what, const char *obj);
/* "<file>: cannot <what> attribute '<name>' of /<obj> (<HDF5's reason>)";
 * as h5io_fail, right after the failed HDF5 call. */
QtStatus h5io_fail_attr(QtError *err, QtStatus st, const H5ioFile *f, const char *what, const char *obj,
                        const char *name);
/* The file's name for messages. */
const char *h5io_fname(const H5ioFile *f);
/* An object path without its leading slashes (messages print a '/' before it). */
const char *h5io_show(const char *path);
/* The name HDF5 takes for path, relative to the file's root ("." for it). */
const char *h5io_h5name(const char *path);
/* Whether obj is a group or dataset reached through hard links only. */
bool h5io_reachable(const H5ioFile *f, const char *obj);
/* "floating-point", "integer", "string" or "non-numeric", for messages. */
const char *h5io_class_name(H5T_class_t c);

/* Whether open dataset d (at path) may be read: its data stored in this
 * file (contiguous, chunked or compact), written, through deflate, shuffle
 * and fletcher32 only, in chunks within the dataset that are stored no
 * larger than they need and inflate to at most their size. QT_ERR_FORMAT
 * "refusing dataset /<path>: ..." otherwise. */
QtStatus h5io_check_storage(const H5ioFile *f, const char *path, hid_t d, QtError *err);

/* Reads the variable-length string attribute `a` (memory type mt) of obj
 * in a child process into *v (malloc'd): a damaged global heap, on which
 * libhdf5 crashes or loops, becomes QT_ERR_FORMAT naming the attribute. */
QtStatus h5io_attr_read_vlen(const H5ioFile *f, const char *obj, const char *name, hid_t a, hid_t mt, char **v,
                             QtError *err);

#endif
