/* config_schema.h - helpers shared by the config loader's files (not a
 * public interface: config.h is). Every function reports errors as
 * "<where>: <key.path>: <what>" through cfg_fail and returns QT_ERR_CONFIG. */
#ifndef QTRAIN_TRAINER_CONFIG_SCHEMA_H
#define QTRAIN_TRAINER_CONFIG_SCHEMA_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "yamltree.h"

#define CONFIG_N_DATASETS 1
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
/* A child mapping of parent: NULL when absent or null; any other kind is an error. */
QtStatus cfg_section(QtError *err, const YNode *parent, const char *path, const char *key, const YNode **out);

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
QtStatus cfg_get_i64(QtError *err, const YNode *map, const char *path, const char *key, int64_t lo, int64_t hi,
                     int64_t *out);
QtStatus cfg_get_int(QtError *err, const YNode *map, const char *path, const char *key, int lo, int hi, int *out);
QtStatus cfg_get_float(QtError *err, const YNode *map, const char *path, const char *key, CfgRange r, float *out);
QtStatus cfg_get_bool(QtError *err, const YNode *map, const char *path, const char *key, bool *out);
QtStatus cfg_get_str(QtError *err, const YNode *map, const char *path, const char *key, bool allow_empty, char *out,
                     size_t size);
/* Wraps a failed name lookup's message (which lists the valid names) with the location. */
QtStatus cfg_lookup_fail(QtError *err, const YNode *at, const char *path, QtStatus st, const QtError *inner);

/* config_parts.c */
QtStatus cfg_load_transforms(QtError *err, const YNode *v, DataConfig *d);
QtStatus cfg_load_layer(QtError *err, const YNode *v, const char *path, int index, LayerSpec *s);
QtStatus cfg_load_optimizer(QtError *err, const YNode *train, OptimConfig *o);
QtStatus cfg_load_schedule(QtError *err, const YNode *train, TrainConfig *t);
/* optim_config_default(kind), copied field by field (no stray padding bytes). */
void cfg_optim_defaults(OptimConfig *o, OptimKind kind);

/* config_rules.c: the quant and lora sections. lora.trainable is checked
 * against dry, the model the config builds. */
QtStatus cfg_load_quant(QtError *err, const YNode *root, QuantConfig *q);
QtStatus cfg_load_lora(QtError *err, const YNode *root, const Model *dry, LoraConfig *l);

#endif
