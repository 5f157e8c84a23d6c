#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>

QtStatus qt_error_set(QtError *err, QtStatus status, const char *fmt, ...) {
    if (!err || err->status != QT_OK) return status;
    err->status = status;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof err->msg) memcpy(err->msg + sizeof err->msg - 4, "...", 4); /* cut: say so */
    return status;
}

void qt_error_clear(QtError *err) {
    if (!err) return;
    err->status = QT_OK;
    err->msg[0] = '\0';
}

const char *qt_clip(const char *s, char buf[QT_CLIP_BUF]) {
    if (!s) s = "(null)";
    size_t len = strlen(s), n = len < QT_CLIP_SHOW ? len : QT_CLIP_SHOW;
    while (n < len && n > 0 && ((unsigned char)s[n] & 0xc0) == 0x80) n--; /* not inside a UTF-8 character */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        buf[i] = c < 0x20 || c == 0x7f ? '?' : (char)c;
    }
    buf[n] = '\0';
    if (n < len) snprintf(buf + n, QT_CLIP_BUF - n, "...(%zu bytes)", len);
    return buf;
}

const char *qt_status_name(QtStatus status) {
    switch (status) {
    case QT_OK: return "ok";
    case QT_ERR_ARG: return "invalid argument";
    case QT_ERR_SHAPE: return "shape error";
    case QT_ERR_VALUE: return "bad value";
    case QT_ERR_NOMEM: return "out of memory";
    case QT_ERR_IO: return "I/O error";
    case QT_ERR_FORMAT: return "format error";
    case QT_ERR_CONFIG: return "config error";
    }
    return "unknown error";
}

QtStatus qt_name_lookup(const char *what, const char *name, const char *const *names, int n_names, int *index,
                        QtError *err) {
    for (int i = 0; name && i < n_names; i++) {
        if (names[i] && strcasecmp(name, names[i]) == 0) {
            *index = i;
            return QT_OK;
        }
    }
    char valid[512] = "";
    for (int i = 0; i < n_names; i++) {
        if (!names[i]) continue;
        size_t len = strlen(valid);
        snprintf(valid + len, sizeof valid - len, "%s%s", len ? ", " : "", names[i]);
    }
    char shown[QT_CLIP_BUF];
    return qt_error_set(err, QT_ERR_ARG, "unknown %s '%s' (valid: %s)", what, name ? qt_clip(name, shown) : "(none)",
                        valid);
}

const char *qt_file_too_large_hint(char *buf, size_t cap) {
    struct rlimit lim;
    if (getrlimit(RLIMIT_FSIZE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
        snprintf(buf, cap, "file too large: the file-size limit (ulimit -f) is %llu bytes; raise it (ulimit -f "
                 "unlimited)", (unsigned long long)lim.rlim_cur);
    else
        snprintf(buf, cap, "file too large for the file system; put the output on another file system");
    return buf;
}
