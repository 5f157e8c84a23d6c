/* error.h - status codes and error messages shared by every library layer.
 *
 * Library code (nn/, quant/, lora/, data/) never exits: it returns a QtStatus
 * and, where the caller passed one, fills a QtError with a sentence that says
 * what went wrong, where, and what to do about it. Only trainer/ decides to
 * stop the program. */
#ifndef QTRAIN_NN_ERROR_H
#define QTRAIN_NN_ERROR_H

#include <stddef.h>

typedef enum {
    QT_OK = 0,
    QT_ERR_ARG,    /* a bad argument: NULL, zero size, unknown name */
    QT_ERR_SHAPE,  /* shapes that do not fit together */
    QT_ERR_VALUE,  /* a bad value in the data: NaN, Inf, label out of range */
    QT_ERR_NOMEM,  /* an allocation failed */
    QT_ERR_IO,     /* a file could not be read or written */
    QT_ERR_FORMAT, /* a file's contents are not what they should be */
    QT_ERR_CONFIG  /* a configuration error */
} QtStatus;

#define QT_ERROR_MSG_MAX 1024

typedef struct {
    QtStatus status;
    char msg[QT_ERROR_MSG_MAX];
} QtError;

/* Records the first error only: later calls leave an existing error alone,
 * so the message a user sees names the root cause, not its consequences.
 * Returns `status`, so callers can write `return qt_error_set(...)`.
 * `err` may be NULL (the status is still returned). */
QtStatus qt_error_set(QtError *err, QtStatus status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

void qt_error_clear(QtError *err);

/* A string from a file (an attribute's value, a name, a config line) as a
 * message shows it: its first QT_CLIP_SHOW bytes, then "...(N bytes)" if it
 * is longer, with control characters (newlines, terminal escapes) as '?'.
 * Returns buf. A file can hold megabytes in one attribute. */
#define QT_CLIP_SHOW 200
#define QT_CLIP_BUF (QT_CLIP_SHOW + 32)
const char *qt_clip(const char *s, char buf[QT_CLIP_BUF]);

/* Finds `name` (case-insensitive) in names[0..n_names-1] and sets *index.
 * Otherwise QT_ERR_ARG with "unknown <what> '<name>' (valid: a, b, c)".
 * Every option parsed from a config goes through here, so every message
 * about a bad name lists the good ones. */
QtStatus qt_name_lookup(const char *what, const char *name, const char *const *names, int n_names, int *index,
                        QtError *err);

/* What to do about a write that failed with EFBIG, into buf: the
 * file-size limit (ulimit -f) and how to raise it, or, without a limit,
 * the file system's largest file. Returns buf. */
const char *qt_file_too_large_hint(char *buf, size_t cap);

/* A short name for a status ("shape error"). */
const char *qt_status_name(QtStatus status);

#endif
