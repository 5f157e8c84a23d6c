/* config_schema.h - the config schema's types and the helpers shared by
 * the config loader's files (not a public interface: config.h is). The
 * tables themselves, and how to add a key (one row plus its use), are in
 * config_table.c. Every function reports errors as
 * "<where>: <key.path>: <what>" through cfg_fail and returns QT_ERR_CONFIG. */
#ifndef QTRAIN_TRAINER_CONFIG_SCHEMA_H
#define QTRAIN_TRAINER_CONFIG_SCHEMA_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "config.h"
#include "yamltree.h"

#define CONFIG_N_DATASETS 4
extern const char *const CONFIG_DATASETS[CONFIG_N_DATASETS];

/* Allowed values of a number: lo/hi (+-INFINITY for none), open or closed
 * ends; is_float adds the check that the value fits a float. */
typedef struct {
    double lo, hi;
    bool lo_open, hi_open, is_float;
} CfgRange;
#define CFG_NONNEG ((CfgRange){0.0, INFINITY, false, false, false})
#define CFG_POSITIVE ((CfgRange){0.0, INFINITY, true, false, false})
#define CFG_ANY ((CfgRange){-INFINITY, INFINITY, false, false, false})

/* ---- the schema: one table per section (rows in config_table.c) ------------------------------------------------
 *
 * A row says everything about one key: its type and field, its default, its
 * allowed values, what a resume may do with it and one line of doc. The
 * loader (cfg_load_table), config_default, config_to_yaml, the resume
 * comparison, the unknown-key check with its did-you-mean and
 * `qtrain config --doc` (docs/CONFIG.md) all read the rows. */

typedef enum {
    CFG_T_STR,     /* char[size] at offset */
    CFG_T_PATH,    /* the same, a file or directory: no control characters */
    CFG_T_BOOL,    /* bool */
    CFG_T_INT,     /* int, in [imin, imax] */
    CFG_T_I64,     /* int64_t, in [imin, imax] */
    CFG_T_U64,     /* uint64_t, any */
    CFG_T_FLOAT,   /* float, in range */
    CFG_T_DOUBLE,  /* double, in range */
    CFG_T_ENUM,    /* an enum (int-sized) field: the index of one of the names */
    CFG_T_NAME,    /* char[size] holding one of the names, in its canonical spelling */
    CFG_T_FLOAT2,  /* two floats (offset, offset2) written as [a, b], each in range */
    CFG_T_SECTION, /* a nested mapping at offset with its own table (sub) */
    CFG_T_PART     /* a value the table cannot express: loaded, written and compared by part (or, in a rule or
                      layer table, by the hand-written loader) */
} CfgType;

/* What resuming a checkpoint under a config that changes the key does. */
typedef enum {
    CFG_RESUME_FREE = 0, /* nothing: it changes no value of the run (where files live, logging) */
    CFG_RESUME_FIXED,    /* refused: it decides the data order or the model */
    CFG_RESUME_REPORTED  /* a warning: legitimate, but the run no longer matches an uninterrupted one */
} CfgResume;

typedef struct CfgKey CfgKey;
typedef struct CfgTable CfgTable;

/* What the loader carries between sections: the dry model (built after
 * model.layers, needed by lora.trainable). */
typedef struct {
    Model dry;
    bool have_dry;
} CfgCtx;

/* A value at `v` (NULL when absent or null) of the mapping `map` (NULL when
 * the section is absent) into the section struct `section`. */
typedef QtStatus (*CfgLoadFn)(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx);
/* Writes "<indent><key>: ...\n" (and any lines under it). */
typedef void (*CfgEmitFn)(FILE *f, const char *indent, const void *section);
/* -1: equal; -2: different; i >= 0: different first at item i. */
typedef int (*CfgDiffFn)(const void *a, const void *b);
/* A row's extra check, after its value is converted (v NULL when absent). */
typedef QtStatus (*CfgCheckFn)(QtError *err, const YNode *v, const char *path, void *section);
/* A table's checks across its keys, after every row; parent is the enclosing section's struct. */
typedef QtStatus (*CfgAfterFn)(QtError *err, const YNode *map, const YNode *parent_map, void *section, void *parent,
                               CfgCtx *ctx);

typedef struct {
    CfgLoadFn load;
    CfgEmitFn emit;
    CfgDiffFn diff;
} CfgPart;

struct CfgKey {
    const char *key;
    CfgType type;
    size_t offset, size;         /* the field in the section's struct; size for strings (for CFG_T_ENUM: the
                                    longest name read, plus 1) */
    bool empty_ok;               /* CFG_T_STR, CFG_T_PATH: "" is a value */
    size_t offset2;              /* CFG_T_FLOAT2: the second float */
    int64_t imin, imax;          /* CFG_T_INT, CFG_T_I64 */
    CfgRange range;              /* CFG_T_FLOAT, CFG_T_DOUBLE, CFG_T_FLOAT2 */
    const char *(*name_of)(int); /* CFG_T_ENUM, CFG_T_NAME: the valid names, 0 .. n_names-1 */
    int n_names;
    const char *names_what;      /* what an unknown name is called in the message ("optimizer"); CFG_T_FLOAT2:
                                    what the pair is expected to be */
    double def;                  /* the default of a number or bool */
    const char *def_str;         /* the default of a string, or an enum's name */
    bool def_by_kind;            /* the default comes from the table's kind_defaults */
    unsigned kinds;              /* the kinds (of the table's kind row) the key applies to; 0 = all */
    CfgResume resume;
    const char *resume_as;       /* the name a reported change goes by (keys grouped), NULL = the key path */
    CfgCheckFn check;
    const CfgTable *sub;         /* CFG_T_SECTION */
    const CfgPart *part;         /* CFG_T_PART */
    const char *doc_default;     /* the default as docs/CONFIG.md says it, NULL = written from the default */
    const char *doc_values;      /* the allowed values as docs/CONFIG.md says them, NULL = from the range/names */
    const char *doc;             /* one line */
};

struct CfgTable {
    const char *path;            /* "train.optimizer"; "" for the top level */
    const char *owner;           /* for "does not apply to <owner>": "the %s optimizer" takes the kind's name */
    const CfgKey *keys;
    int n;                       /* at most 32 (the key check's bit mask) */
    int kind_key;                /* the row whose enum value selects which rows apply (kinds); -1: none */
    void (*kind_defaults)(void *section, int kind); /* resets the kind's defaults once its name is read */
    CfgAfterFn after;
    const char *(*kind_name)(int); /* the names of the rows' kinds, for the docs (else the kind row's names) */
    int n_kinds;
    const char *missing;         /* a required section: the message when it is absent; NULL = optional */
    const char *doc;             /* a paragraph for docs/CONFIG.md */
};

/* The tables (config_table.c). CFG_ROOT's rows are the sections of Config. Both rule tables start with
 * RULE_MATCH_KEYS rows: module_path, op_types and skip. */
enum { RULE_MATCH_KEYS = 3 };
extern const CfgTable CFG_ROOT;
extern const CfgTable CFG_LAYER_TABLE, CFG_QUANT_RULE_TABLE, CFG_LORA_RULE_TABLE;

/* The row of `key` in t, or NULL. */
const CfgKey *cfg_table_row(const CfgTable *t, const char *key);
/* Whether row applies to kind (its table's kind row value). */
bool cfg_row_applies(const CfgKey *row, int kind);
/* The table's kind in section (its kind row's value), or -1 without a kind row. */
int cfg_table_kind(const CfgTable *t, const void *section);
/* cfg_check_keys over the rows of t that apply to kind (-1: all); owner NULL = t->owner. */
QtStatus cfg_check_table_keys(QtError *err, const YNode *map, const CfgTable *t, const char *path, int kind,
                              const char *owner);
/* Converts map[row->key] into row's field of section (absent or null: the field keeps its value), with the
 * row's range or names and its check. */
QtStatus cfg_load_row(QtError *err, const YNode *map, const char *path, const CfgKey *row, void *section);
/* cfg_load_row of the row named key in t (which must have it). */
QtStatus cfg_load_key(QtError *err, const YNode *map, const char *path, const CfgTable *t, const char *key,
                      void *section);
/* Every row's default into section (nested tables too). */
void cfg_table_defaults(const CfgTable *t, void *section);
/* A whole section: the mapping parent[key] by t into section. */
QtStatus cfg_load_table(QtError *err, const YNode *parent, const char *key, const CfgTable *t, void *section,
                        void *parent_section, CfgCtx *ctx);
/* The section's keys as YAML at indent (config_emit.c). */
void cfg_emit_table(FILE *f, const CfgTable *t, const char *indent, const void *section);

QtStatus cfg_fail(QtError *err, const YNode *at, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* "expected <expected>, got <node><extra>", with a hint for quoted numbers. */
QtStatus cfg_fail_expected(QtError *err, const YNode *v, const char *path, const char *expected, const char *extra);
/* "path.key" (or "key" for an empty path) in buf. */
const char *cfg_join(char *buf, size_t size, const char *path, const char *key);

/* Every key of map must be one of keys[i] with bit i set in `allowed`.
 * A key of the schema that is not allowed "does not apply to <owner>";
 * another is unknown, with the closest allowed key suggested. */
QtStatus cfg_check_keys(QtError *err, const YNode *map, const char *path, const char *const *keys, int n,
                        unsigned allowed, const char *owner);

/* The value of key in map; NULL when absent or null (meaning: the default). */
const YNode *cfg_field(const YNode *map, const char *key);

/* Conversions of one node, `path` being its full key path. */
QtStatus cfg_to_int(QtError *err, const YNode *v, const char *path, int64_t lo, int64_t hi, int64_t *out);
QtStatus cfg_to_number(QtError *err, const YNode *v, const char *path, CfgRange r, double *out);
QtStatus cfg_to_bool(QtError *err, const YNode *v, const char *path, bool *out);
QtStatus cfg_to_str(QtError *err, const YNode *v, const char *path, bool allow_empty, char *out, size_t size);
/* A name that becomes a file or group name (run.name, a layer's name):
 * letters, digits, '_', '-' and '.', not starting with '.' or '-', so never
 * ".", "..", a hidden file or an option. `why` ends the message. */
QtStatus cfg_check_name(QtError *err, const YNode *v, const char *path, const char *name, const char *why);
/* A path value (run.out_dir, data.dir, ...): no control characters (a NUL
 * the YAML reader refuses already; the length cfg_to_str checks). */
QtStatus cfg_check_path(QtError *err, const YNode *v, const char *path, const char *value);
/* Copies s into out[size] with the rest zeroed, so Configs compare bytewise. */
void cfg_set_str(char *out, size_t size, const char *s);

/* Conversions of map[key] (path is the map's); absent or null leaves *out as it is. */
QtStatus cfg_get_float(QtError *err, const YNode *map, const char *path, const char *key, CfgRange r, float *out);
QtStatus cfg_get_bool(QtError *err, const YNode *map, const char *path, const char *key, bool *out);
/* Wraps a failed name lookup's message (which lists the valid names) with the location. */
QtStatus cfg_lookup_fail(QtError *err, const YNode *at, const char *path, QtStatus st, const QtError *inner);

/* The parts of the tables that a row cannot express (their load in config.c, config_parts.c and
 * config_rules.c, their emit in config_emit.c, their diff in config_compare.c). */
extern const CfgPart CFG_PART_TRANSFORMS, CFG_PART_INPUT, CFG_PART_LAYERS, CFG_PART_QUANT_RULES, CFG_PART_LORA_RULES,
    CFG_PART_TRAINABLE, CFG_PART_ANOMALY;
extern const CfgPart CFG_PART_AUGMENT;
QtStatus cfg_part_load_transforms(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx);
QtStatus cfg_part_load_augment(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx);
QtStatus cfg_part_load_input(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx);
QtStatus cfg_part_load_layers(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx);
QtStatus cfg_part_load_quant_rules(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx);
QtStatus cfg_part_load_lora_rules(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx);
QtStatus cfg_part_load_trainable(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx);
void cfg_emit_transforms(FILE *f, const char *indent, const void *section);
void cfg_emit_augment(FILE *f, const char *indent, const void *section);
void cfg_emit_input(FILE *f, const char *indent, const void *section);
void cfg_emit_layers(FILE *f, const char *indent, const void *section);
void cfg_emit_quant_rules(FILE *f, const char *indent, const void *section);
void cfg_emit_lora_rules(FILE *f, const char *indent, const void *section);
void cfg_emit_trainable(FILE *f, const char *indent, const void *section);
int cfg_diff_transforms(const void *a, const void *b);
int cfg_diff_augment(const void *a, const void *b);
int cfg_diff_input(const void *a, const void *b);
int cfg_diff_layers(const void *a, const void *b);
int cfg_diff_quant_rules(const void *a, const void *b);
int cfg_diff_lora_rules(const void *a, const void *b);
int cfg_diff_trainable(const void *a, const void *b);
/* data.anomaly_classes (config_parts.c, config_emit.c, config_compare.c). */
QtStatus cfg_part_load_anomaly(QtError *err, const YNode *v, const YNode *map, void *section, CfgCtx *ctx);
void cfg_emit_anomaly(FILE *f, const char *indent, const void *section);
int cfg_diff_anomaly(const void *a, const void *b);
/* The tables' checks across keys that need more than the table (config.c, config_rules.c). */
QtStatus cfg_model_after(QtError *err, const YNode *map, const YNode *parent_map, void *section, void *parent,
                         CfgCtx *ctx);
QtStatus cfg_quant_after(QtError *err, const YNode *map, const YNode *parent_map, void *section, void *parent,
                         CfgCtx *ctx);
/* train.loss against data.target and data.anomaly_classes (the data section is loaded first). */
QtStatus cfg_train_after(QtError *err, const YNode *map, const YNode *parent_map, void *section, void *parent,
                         CfgCtx *ctx);

/* config_parts.c */
QtStatus cfg_load_layer(QtError *err, const YNode *v, const char *path, int index, LayerSpec *s);
/* optim_config_default(kind), copied field by field (no stray padding bytes); config_table.c. */
void cfg_optim_defaults(OptimConfig *o, OptimKind kind);

#endif
