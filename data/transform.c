/* transform.c - names of the data transforms and storage kinds, as configs
 * spell them. */
#include "dataset.h"

static const char *const transform_names[TRANSFORM_COUNT] = {
    [TRANSFORM_NORMALIZE] = "normalize", [TRANSFORM_TRANSPOSE] = "transpose", [TRANSFORM_INVERT] = "invert",
    [TRANSFORM_CLASSES] = "classes",     [TRANSFORM_LIMIT] = "limit",
};

const char *transform_kind_name(TransformKind kind) {
    return (unsigned)kind < TRANSFORM_COUNT ? transform_names[kind] : "unknown";
}

QtStatus transform_kind_parse(const char *name, TransformKind *out, QtError *err) {
    int v = 0;
    QtStatus st = qt_name_lookup("transform", name, transform_names, TRANSFORM_COUNT, &v, err);
    if (st == QT_OK) *out = (TransformKind)v;
    return st;
}

static const char *const storage_names[DATA_STORAGE_COUNT] = {
    [DATA_STORAGE_AUTO] = "auto", [DATA_STORAGE_MEMORY] = "memory", [DATA_STORAGE_FILE] = "file",
};

const char *data_storage_name(DataStorage storage) {
    return (unsigned)storage < DATA_STORAGE_COUNT ? storage_names[storage] : "unknown";
}

QtStatus data_storage_parse(const char *name, DataStorage *out, QtError *err) {
    int v = 0;
    QtStatus st = qt_name_lookup("data storage", name, storage_names, DATA_STORAGE_COUNT, &v, err);
    if (st == QT_OK) *out = (DataStorage)v;
    return st;
}
