/* version.h - the version string, from include/qtrain.h's numbers (one place to change). */
#ifndef QTRAIN_TRAINER_VERSION_H
#define QTRAIN_TRAINER_VERSION_H
#include "include/qtrain.h"
#define QTRAIN_VERSION_STR_(x) #x
#define QTRAIN_VERSION_STR(x) QTRAIN_VERSION_STR_(x)
#define QTRAIN_VERSION                                                                                    \
    QTRAIN_VERSION_STR(QTRAIN_VERSION_MAJOR) "." QTRAIN_VERSION_STR(QTRAIN_VERSION_MINOR) "." QTRAIN_VERSION_STR( \
        QTRAIN_VERSION_PATCH)
#endif
