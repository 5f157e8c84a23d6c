/* yamltree.h - a YAML document as a small tree of scalars, sequences and
 * mappings, each node remembering where it came from.
 *
 * The config schema walks this tree rather than libyaml events so that keys
 * can be read in any order and `--set` overrides can edit the document before
 * it is checked. Every node keeps its 1-based line and column and the name of
 * its source, so an error about any value can point at it.
 *
 * Deliberately unsupported (each is a clear error, not a silent surprise):
 * anchors and aliases (&a, *a), explicit tags (!!str), non-scalar mapping
 * keys, more than one document in a stream, and duplicate keys. */
#ifndef QTRAIN_TRAINER_YAMLTREE_H
#define QTRAIN_TRAINER_YAMLTREE_H

#include <stdbool.h>
#include <stddef.h>

#include "base/error.h"

#define YTREE_MAX_DEPTH 64

typedef enum { YNODE_SCALAR, YNODE_SEQUENCE, YNODE_MAPPING } YNodeKind;

typedef struct YNode YNode;
struct YNode {
    YNodeKind kind;
    int line, col;          /* 1-based start of the node in its source; 0 for override nodes */
    const char *source;     /* file name, or the whole override text "key.path=value"; borrowed from the caller of
                               ytree_parse / ytree_set, which must keep it alive as long as the tree */
    bool from_override;     /* source is a --set override rather than a file */
    char *text;             /* scalar: its value (NUL-terminated, no embedded NUL) */
    bool plain;             /* scalar written without quotes or block style: only these are numbers, bools, null */
    int n, cap;             /* sequence items / mapping pairs */
    YNode **items;          /* [n]: sequence items, or mapping values */
    YNode **keys;           /* [n]: mapping keys (scalars), in file order; NULL for sequences */
};

/* Parses text[0..len-1] as one YAML document. *root is NULL for a stream
 * with no document at all (an empty file, or only comments). Syntax errors
 * are QT_ERR_CONFIG with libyaml's problem at "<source>:<line>:<col>" (or
 * "--set <source>" when from_override). */
QtStatus ytree_parse(const char *text, size_t len, const char *source, bool from_override, YNode **root,
                     QtError *err);
void ynode_free(YNode *node);

/* Applies one "key.path=value" override to a mapping root: '.' separates
 * segments, a numeric segment indexes a sequence, a missing mapping key is
 * created (a null value is replaced by a new mapping when the path goes
 * through it), and the value is parsed as YAML. `override` must outlive the
 * tree (its nodes point at it for messages). QT_ERR_CONFIG for a malformed
 * override, an index out of range, or a path through a scalar. */
QtStatus ytree_set(YNode *root, const char *override, QtError *err);

/* The value of `key` in a mapping, or NULL (also when map is not a mapping). */
YNode *ynode_get(const YNode *map, const char *key);
/* A plain empty, "~" or "null" (any case) scalar. */
bool ynode_is_null(const YNode *node);
/* "file:line:col" or "--set key.path=value", for the start of messages. */
const char *ynode_where(const YNode *node, char *buf, size_t size);
/* The node for "got ..." in messages: "\"text\"" for a plain scalar, "the quoted string \"3\"", "a sequence",
 * "a mapping", "nothing (null)". Long scalars are cut. */
const char *ynode_describe(const YNode *node, char *buf, size_t size);

#endif
