/* transform.c - names of the data transforms, as configs spell them. */
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
