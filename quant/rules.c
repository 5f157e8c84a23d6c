/* rules.c - first-match rule lookup over module paths (rules.h). */
#include "rules.h"

#include <stdio.h>
#include <string.h>

static int rule_compile_one(regex_t *re, const char *pattern, char *msg, size_t cap) {
    char full[RULE_PATTERN_MAX + 8];
    /* Anchoring the group makes the match cover the whole path, as a full
       match should, whatever alternations the pattern holds. */
    snprintf(full, sizeof full, "^(%s)$", pattern);
    int rc = regcomp(re, full, REG_EXTENDED | REG_NOSUB);
    if (rc != 0) regerror(rc, re, msg, cap);
    return rc;
}

QtStatus rule_set_compile(RuleSet *s, const void *rules, int n, size_t stride, QtError *err) {
    memset(s, 0, sizeof *s);
    if (n < 0 || n > RULES_MAX)
        return qt_error_set(err, QT_ERR_CONFIG, "%d rules; at most %d are supported", n, RULES_MAX);
    for (int i = 0; i < n; i++) {
        const RuleMatch *r = (const RuleMatch *)((const char *)rules + (size_t)i * stride);
        char msg[160];
        if (rule_compile_one(&s->re[i], r->module_path, msg, sizeof msg) != 0) {
            rule_set_free(s);
            return qt_error_set(err, QT_ERR_CONFIG,
                                "%s: module_path \"%s\" is not a valid POSIX extended regular expression: %s",
                                r->where, r->module_path, msg);
        }
        s->compiled[i] = true;
        s->op_types[i] = r->op_types;
        s->n = i + 1;
    }
    return QT_OK;
}

void rule_set_free(RuleSet *s) {
    for (int i = 0; i < s->n; i++)
        if (s->compiled[i]) regfree(&s->re[i]);
    memset(s, 0, sizeof *s);
}

int rule_set_match(RuleSet *s, const Module *m) {
    for (int i = 0; i < s->n; i++) {
        if (s->op_types[i] && !(s->op_types[i] & (1u << m->spec.type))) continue;
        if (regexec(&s->re[i], m->path, 0, NULL, 0) == 0) {
            s->hits[i]++;
            return i;
        }
    }
    return -1;
}

int rule_pattern_matches(const char *pattern, const char *path) {
    regex_t re;
    char msg[8];
    if (rule_compile_one(&re, pattern, msg, sizeof msg) != 0) return -1;
    int hit = regexec(&re, path, 0, NULL, 0) == 0;
    regfree(&re);
    return hit;
}
