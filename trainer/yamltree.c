/* yamltree.c - libyaml events into a YNode tree; --set overrides on it. */
#include "yamltree.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#define YTREE_PATH_MAX 256

typedef struct {
    yaml_parser_t parser;
    const char *text; /* [len] */
    size_t len;
    const char *source;
    bool from_override;
    QtError *err;
    char path[YTREE_PATH_MAX]; /* key path of the node being built, for duplicate-key messages */
} Builder;

/* ---- nodes ----------------------------------------------------------------- */

static YNode *node_new(YNodeKind kind, const char *source, bool from_override, int line, int col) {
    YNode *n = calloc(1, sizeof *n);
    if (!n) return NULL;
    n->kind = kind;
    n->source = source;
    n->from_override = from_override;
    n->line = line;
    n->col = col;
    return n;
}

void ynode_free(YNode *node) {
    if (!node) return;
    for (int i = 0; i < node->n; i++) {
        ynode_free(node->items[i]);
        if (node->keys) ynode_free(node->keys[i]);
    }
    free(node->items);
    free(node->keys);
    free(node->text);
    free(node);
}

/* Appends item (and key, for a mapping); on failure the caller still owns both. */
static bool node_append(YNode *n, YNode *key, YNode *item) {
    if (n->n == n->cap) {
        int cap = n->cap ? 2 * n->cap : 4;
        YNode **items = realloc(n->items, (size_t)cap * sizeof *items);
        if (!items) return false;
        n->items = items;
        if (n->kind == YNODE_MAPPING) {
            YNode **keys = realloc(n->keys, (size_t)cap * sizeof *keys);
            if (!keys) return false;
            n->keys = keys;
        }
        n->cap = cap;
    }
    if (n->kind == YNODE_MAPPING) n->keys[n->n] = key;
    n->items[n->n++] = item;
    return true;
}

static int node_find_key(const YNode *map, const char *key) {
    if (!map || map->kind != YNODE_MAPPING) return -1;
    for (int i = 0; i < map->n; i++)
        if (strcmp(map->keys[i]->text, key) == 0) return i;
    return -1;
}

YNode *ynode_get(const YNode *map, const char *key) {
    int i = node_find_key(map, key);
    return i < 0 ? NULL : map->items[i];
}

bool ynode_is_null(const YNode *node) {
    return node && node->kind == YNODE_SCALAR && node->plain &&
           (node->text[0] == '\0' || strcmp(node->text, "~") == 0 || strcasecmp(node->text, "null") == 0);
}

const char *ynode_where(const YNode *node, char *buf, size_t size) {
    if (node->from_override)
        snprintf(buf, size, "--set %s", node->source);
    else
        snprintf(buf, size, "%s:%d:%d", node->source, node->line, node->col);
    return buf;
}

const char *ynode_describe(const YNode *node, char *buf, size_t size) {
    if (node->kind == YNODE_SEQUENCE) return "a sequence";
    if (node->kind == YNODE_MAPPING) return "a mapping";
    if (ynode_is_null(node)) return "nothing (null)";
    const int max = 48;
    int len = (int)strlen(node->text);
    snprintf(buf, size, "%s\"%.*s%s\"", node->plain ? "" : "the quoted string ", len > max ? max : len, node->text,
             len > max ? "..." : "");
    return buf;
}

/* ---- parsing ----------------------------------------------------------------- */

/* 1-based line and column (in bytes) of text[offset]. */
static void offset_position(const char *text, size_t len, size_t offset, int *line, int *col) {
    *line = *col = 1;
    for (size_t i = 0; i < offset && i < len; i++) {
        if (text[i] == '\n') ++*line, *col = 1;
        else ++*col;
    }
}

static QtStatus parser_fail(Builder *b) {
    const yaml_parser_t *p = &b->parser;
    const char *problem = p->problem ? p->problem : "unknown problem", *ov = b->from_override ? "--set " : "";
    if (p->error == YAML_MEMORY_ERROR)
        return qt_error_set(b->err, QT_ERR_NOMEM, "%s%s: out of memory while parsing YAML", ov, b->source);
    if (p->error == YAML_READER_ERROR) {
        int line, col;
        offset_position(b->text, b->len, p->problem_offset, &line, &col);
        if (b->from_override)
            return qt_error_set(b->err, QT_ERR_CONFIG, "--set %s: invalid text: %s; use UTF-8", b->source, problem);
        return qt_error_set(b->err, QT_ERR_CONFIG, "%s:%d:%d: invalid text: %s; save the file as UTF-8", b->source,
                            line, col, problem);
    }
    size_t at = p->problem_mark.index;
    const char *hint = at < b->len && b->text[at] == '\t' ? "; indent YAML with spaces, not tabs" : "";
    char ctx[128] = "";
    if (b->from_override) {
        /* Positions inside a one-line value would only confuse. */
        if (p->context) snprintf(ctx, sizeof ctx, " (%s)", p->context);
        return qt_error_set(b->err, QT_ERR_CONFIG, "--set %s: invalid YAML value: %s%s%s", b->source, problem, ctx,
                            hint);
    }
    if (p->context)
        snprintf(ctx, sizeof ctx, " (%s at %d:%d)", p->context, (int)p->context_mark.line + 1,
                 (int)p->context_mark.column + 1);
    return qt_error_set(b->err, QT_ERR_CONFIG, "%s:%d:%d: invalid YAML: %s%s%s", b->source,
                        (int)p->problem_mark.line + 1, (int)p->problem_mark.column + 1, problem, ctx, hint);
}

static QtStatus next_event(Builder *b, yaml_event_t *ev) {
    if (!yaml_parser_parse(&b->parser, ev)) return parser_fail(b);
    return QT_OK;
}

static QtStatus builder_fail_at(Builder *b, const yaml_mark_t *mark, const char *what) {
    if (b->from_override) return qt_error_set(b->err, QT_ERR_CONFIG, "--set %s: %s", b->source, what);
    return qt_error_set(b->err, QT_ERR_CONFIG, "%s:%d:%d: %s%s%s", b->source, (int)mark->line + 1,
                        (int)mark->column + 1, b->path, b->path[0] ? ": " : "", what);
}

/* Rejects what the tree does not represent: aliases, anchors, tags, depth. */
static QtStatus check_event(Builder *b, const yaml_event_t *ev, int depth) {
    const yaml_char_t *anchor = NULL, *tag = NULL;
    switch (ev->type) {
    case YAML_ALIAS_EVENT:
        return builder_fail_at(b, &ev->start_mark, "aliases (*name) are not supported; write the value out in full");
    case YAML_SCALAR_EVENT: anchor = ev->data.scalar.anchor, tag = ev->data.scalar.tag; break;
    case YAML_SEQUENCE_START_EVENT: anchor = ev->data.sequence_start.anchor, tag = ev->data.sequence_start.tag; break;
    case YAML_MAPPING_START_EVENT: anchor = ev->data.mapping_start.anchor, tag = ev->data.mapping_start.tag; break;
    default: return builder_fail_at(b, &ev->start_mark, "unexpected YAML event");
    }
    if (anchor)
        return builder_fail_at(b, &ev->start_mark, "anchors (&name) are not supported; write the value out in full");
    if (tag) return builder_fail_at(b, &ev->start_mark, "YAML tags (such as !!str) are not supported; remove the tag");
    if (depth > YTREE_MAX_DEPTH) return builder_fail_at(b, &ev->start_mark, "nesting is too deep");
    return QT_OK;
}

static QtStatus build_node(Builder *b, yaml_event_t *ev, int depth, YNode **out);

static QtStatus build_scalar(Builder *b, const yaml_event_t *ev, YNode *node) {
    size_t len = ev->data.scalar.length;
    if (memchr(ev->data.scalar.value, '\0', len))
        return builder_fail_at(b, &ev->start_mark, "a value contains a NUL character");
    node->text = malloc(len + 1);
    if (!node->text) return qt_error_set(b->err, QT_ERR_NOMEM, "%s: out of memory while parsing YAML", b->source);
    memcpy(node->text, ev->data.scalar.value, len);
    node->text[len] = '\0';
    node->plain = ev->data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
    return QT_OK;
}

static QtStatus build_sequence(Builder *b, YNode *node, int depth) {
    size_t base = strlen(b->path);
    for (;;) {
        yaml_event_t ev;
        QtStatus st = next_event(b, &ev);
        if (st != QT_OK) return st;
        if (ev.type == YAML_SEQUENCE_END_EVENT) {
            yaml_event_delete(&ev);
            return QT_OK;
        }
        snprintf(b->path + base, sizeof b->path - base, "[%d]", node->n);
        YNode *item = NULL;
        st = build_node(b, &ev, depth + 1, &item);
        b->path[base] = '\0';
        if (st != QT_OK) return st;
        if (!node_append(node, NULL, item)) {
            ynode_free(item);
            return qt_error_set(b->err, QT_ERR_NOMEM, "%s: out of memory while parsing YAML", b->source);
        }
    }
}

/* One key of a mapping (its event in *ev, consumed) and its value. */
static QtStatus build_pair(Builder *b, YNode *node, yaml_event_t *ev, int depth) {
    size_t base = strlen(b->path);
    if (ev->type != YAML_SCALAR_EVENT) {
        QtStatus st = builder_fail_at(b, &ev->start_mark, "mapping keys must be plain words, not sequences or "
                                                          "mappings");
        yaml_event_delete(ev);
        return st;
    }
    YNode *key = NULL, *value = NULL;
    QtStatus st = build_node(b, ev, depth + 1, &key);
    if (st != QT_OK) return st;
    snprintf(b->path + base, sizeof b->path - base, "%s%s", base ? "." : "", key->text);
    int first = node_find_key(node, key->text);
    if (first >= 0) {
        char what[160];
        snprintf(what, sizeof what, "duplicate key (first given at %d:%d); give each key once",
                 node->keys[first]->line, node->keys[first]->col);
        yaml_mark_t mark = {.line = (size_t)key->line - 1, .column = (size_t)key->col - 1};
        st = builder_fail_at(b, &mark, what);
    }
    yaml_event_t vev;
    if (st == QT_OK) st = next_event(b, &vev);
    if (st == QT_OK) st = build_node(b, &vev, depth + 1, &value);
    b->path[base] = '\0';
    if (st == QT_OK && !node_append(node, key, value))
        st = qt_error_set(b->err, QT_ERR_NOMEM, "%s: out of memory while parsing YAML", b->source);
    if (st != QT_OK) {
        ynode_free(key);
        ynode_free(value);
    }
    return st;
}

static QtStatus build_mapping(Builder *b, YNode *node, int depth) {
    for (;;) {
        yaml_event_t ev;
        QtStatus st = next_event(b, &ev);
        if (st != QT_OK) return st;
        if (ev.type == YAML_MAPPING_END_EVENT) {
            yaml_event_delete(&ev);
            return QT_OK;
        }
        if ((st = build_pair(b, node, &ev, depth)) != QT_OK) return st;
    }
}

/* Builds the node that starts with *ev (consumed) and everything under it. */
static QtStatus build_node(Builder *b, yaml_event_t *ev, int depth, YNode **out) {
    *out = NULL;
    QtStatus st = check_event(b, ev, depth);
    if (st != QT_OK) {
        yaml_event_delete(ev);
        return st;
    }
    YNodeKind kind = ev->type == YAML_SCALAR_EVENT          ? YNODE_SCALAR
                     : ev->type == YAML_SEQUENCE_START_EVENT ? YNODE_SEQUENCE
                                                             : YNODE_MAPPING;
    YNode *node = node_new(kind, b->source, b->from_override, (int)ev->start_mark.line + 1,
                           (int)ev->start_mark.column + 1);
    if (!node) st = qt_error_set(b->err, QT_ERR_NOMEM, "%s: out of memory while parsing YAML", b->source);
    else if (kind == YNODE_SCALAR) st = build_scalar(b, ev, node);
    yaml_event_delete(ev);
    if (st == QT_OK && kind == YNODE_SEQUENCE) st = build_sequence(b, node, depth);
    if (st == QT_OK && kind == YNODE_MAPPING) st = build_mapping(b, node, depth);
    if (st != QT_OK) {
        ynode_free(node);
        return st;
    }
    *out = node;
    return QT_OK;
}

/* Reads the next event and checks it is of `type`. */
static QtStatus expect_event(Builder *b, yaml_event_type_t type, yaml_event_t *ev) {
    QtStatus st = next_event(b, ev);
    if (st == QT_OK && ev->type != type) {
        st = builder_fail_at(b, &ev->start_mark, "unexpected YAML structure");
        yaml_event_delete(ev);
    }
    return st;
}

static QtStatus parse_stream(Builder *b, YNode **root) {
    yaml_event_t ev;
    QtStatus st = expect_event(b, YAML_STREAM_START_EVENT, &ev);
    if (st != QT_OK) return st;
    yaml_event_delete(&ev);
    if ((st = next_event(b, &ev)) != QT_OK) return st;
    yaml_event_type_t type = ev.type;
    yaml_event_delete(&ev);
    if (type == YAML_STREAM_END_EVENT) return QT_OK;
    if ((st = next_event(b, &ev)) != QT_OK) return st;
    if ((st = build_node(b, &ev, 0, root)) != QT_OK) return st;
    if ((st = expect_event(b, YAML_DOCUMENT_END_EVENT, &ev)) != QT_OK) return st;
    yaml_event_delete(&ev);
    if ((st = next_event(b, &ev)) != QT_OK) return st;
    if (ev.type == YAML_DOCUMENT_START_EVENT)
        st = builder_fail_at(b, &ev.start_mark,
                             "a second YAML document (---) follows the first; a config is a single document");
    yaml_event_delete(&ev);
    return st;
}

QtStatus ytree_parse(const char *text, size_t len, const char *source, bool from_override, YNode **root,
                     QtError *err) {
    *root = NULL;
    Builder b = {.text = text, .len = len, .source = source, .from_override = from_override, .err = err};
    if (!yaml_parser_initialize(&b.parser))
        return qt_error_set(err, QT_ERR_NOMEM, "%s: cannot allocate a YAML parser", source);
    yaml_parser_set_input_string(&b.parser, (const unsigned char *)text, len);
    QtStatus st = parse_stream(&b, root);
    yaml_parser_delete(&b.parser);
    if (st != QT_OK) {
        ynode_free(*root);
        *root = NULL;
    }
    return st;
}

/* ---- overrides ------------------------------------------------------------------- */

/* A sequence index: 1 to 9 decimal digits (so no overflow); -1 if s is not one. */
static int parse_index(const char *s) {
    if (!*s || strlen(s) > 9) return -1;
    for (const char *p = s; *p; p++)
        if (*p < '0' || *p > '9') return -1;
    return atoi(s);
}

/* Places `value` at the last segment `seg` under `cur` (a mapping or sequence). */
static QtStatus override_store(YNode *cur, const char *seg, const char *path, YNode *value, const char *ov,
                               QtError *err) {
    if (cur->kind == YNODE_SEQUENCE) {
        int idx = parse_index(seg);
        if (idx < cur->n) {
            ynode_free(cur->items[idx]);
            cur->items[idx] = value;
            return QT_OK;
        }
        if (node_append(cur, NULL, value)) return QT_OK; /* idx == n (override_step checked): a new last item */
        ynode_free(value);
        return qt_error_set(err, QT_ERR_NOMEM, "--set %s: out of memory adding %s[%d]", ov, path, idx);
    }
    int i = node_find_key(cur, seg);
    if (i >= 0) {
        ynode_free(cur->items[i]);
        cur->items[i] = value;
        return QT_OK;
    }
    YNode *key = node_new(YNODE_SCALAR, ov, true, 0, 0);
    if (key) {
        key->plain = true;
        key->text = strdup(seg);
    }
    if (!key || !key->text || !node_append(cur, key, value)) {
        ynode_free(key);
        ynode_free(value);
        return qt_error_set(err, QT_ERR_NOMEM, "--set %s: out of memory adding %s", ov, path);
    }
    return QT_OK;
}

/* Moves from `cur` to its child `seg`, creating a mapping for a missing key.
 * *next is NULL after an error. `last` only checks the step is possible. */
static QtStatus override_step(YNode *cur, const char *seg, const char *path, bool last, const char *ov, YNode **next,
                              QtError *err) {
    *next = NULL;
    if (ynode_is_null(cur) && parse_index(seg) < 0) {
        /* `lora:` (null) followed by --set lora.rank=4: the null becomes the mapping the path needs. */
        free(cur->text);
        cur->text = NULL;
        cur->kind = YNODE_MAPPING;
    }
    if (cur->kind == YNODE_SCALAR) {
        char got[96];
        return qt_error_set(err, QT_ERR_CONFIG, "--set %s: %s is a single value (%s), so it has no '%s' inside it", ov,
                            path[0] ? path : "the top level", ynode_describe(cur, got, sizeof got), seg);
    }
    if (cur->kind == YNODE_SEQUENCE) {
        int idx = parse_index(seg);
        if (idx < 0)
            return qt_error_set(err, QT_ERR_CONFIG,
                                "--set %s: %s is a sequence, so '%s' must be an item index (0 to %d)", ov, path, seg,
                                cur->n - 1);
        if (idx > cur->n)
            return qt_error_set(err, QT_ERR_CONFIG, "--set %s: %s[%d]: index out of range; %s has %d item%s (index %d "
                                "adds one at the end)", ov, path, idx, path, cur->n, cur->n == 1 ? "" : "s", cur->n);
        if (last || idx < cur->n) {
            *next = last ? cur : cur->items[idx];
            return QT_OK;
        }
        /* one past the end, with keys below it (quant.rules.2.module_path=x): a new mapping item */
        YNode *item = node_new(YNODE_MAPPING, ov, true, 0, 0);
        if (!item) return qt_error_set(err, QT_ERR_NOMEM, "--set %s: out of memory", ov);
        QtStatus st = override_store(cur, seg, path, item, ov, err);
        if (st == QT_OK) *next = item;
        return st;
    }
    YNode *child = ynode_get(cur, seg);
    if (last || child) {
        *next = last ? cur : child;
        return QT_OK;
    }
    child = node_new(YNODE_MAPPING, ov, true, 0, 0);
    if (!child) return qt_error_set(err, QT_ERR_NOMEM, "--set %s: out of memory", ov);
    QtStatus st = override_store(cur, seg, path, child, ov, err);
    if (st == QT_OK) *next = child;
    return st;
}

/* Splits "a.b.0.c" (in place) into segments; false if one is empty. */
static bool split_path(char *key, char **segs, int max, int *n) {
    *n = 0;
    for (char *s = key;;) {
        char *dot = strchr(s, '.');
        if (dot) *dot = '\0';
        if (!*s || *n == max) return false;
        segs[(*n)++] = s;
        if (!dot) return true;
        s = dot + 1;
    }
}

QtStatus ytree_set(YNode *root, const char *ov, QtError *err) {
    const char *eq = strchr(ov, '=');
    if (!eq) return qt_error_set(err, QT_ERR_CONFIG, "--set %s: expected key.path=value, e.g. train.batch_size=32", ov);
    const char *k0 = ov, *k1 = eq;
    while (k0 < k1 && (*k0 == ' ' || *k0 == '\t')) k0++;
    while (k1 > k0 && (k1[-1] == ' ' || k1[-1] == '\t')) k1--;
    char key[YTREE_PATH_MAX];
    if (k1 == k0) return qt_error_set(err, QT_ERR_CONFIG, "--set %s: the key path before '=' is empty", ov);
    if ((size_t)(k1 - k0) >= sizeof key) return qt_error_set(err, QT_ERR_CONFIG, "--set %s: key path too long", ov);
    memcpy(key, k0, (size_t)(k1 - k0));
    key[k1 - k0] = '\0';
    char *segs[YTREE_MAX_DEPTH];
    int n_segs = 0;
    if (!split_path(key, segs, YTREE_MAX_DEPTH, &n_segs))
        return qt_error_set(err, QT_ERR_CONFIG,
                            "--set %s: the key path has an empty segment; write segments separated by single dots", ov);
    YNode *value = NULL;
    QtStatus st = ytree_parse(eq + 1, strlen(eq + 1), ov, true, &value, err);
    if (st != QT_OK) return st;
    if (!value) {
        /* "--set key=" or a value that is only a comment: null, as in a file. */
        value = node_new(YNODE_SCALAR, ov, true, 0, 0);
        if (value) value->plain = true, value->text = strdup("");
        if (!value || !value->text) {
            ynode_free(value);
            return qt_error_set(err, QT_ERR_NOMEM, "--set %s: out of memory", ov);
        }
    }
    char path[YTREE_PATH_MAX * 2] = "";
    YNode *cur = root;
    for (int i = 0; i < n_segs && st == QT_OK; i++) {
        bool last = i == n_segs - 1;
        YNode *next = NULL;
        st = override_step(cur, segs[i], path, last, ov, &next, err);
        if (st == QT_OK && last) {
            st = override_store(cur, segs[i], path, value, ov, err);
            value = NULL; /* owned by the tree now, or freed on failure */
        }
        size_t len = strlen(path);
        if (cur->kind == YNODE_SEQUENCE)
            snprintf(path + len, sizeof path - len, "[%s]", segs[i]);
        else
            snprintf(path + len, sizeof path - len, "%s%s", len ? "." : "", segs[i]);
        cur = next;
    }
    ynode_free(value);
    return st;
}
