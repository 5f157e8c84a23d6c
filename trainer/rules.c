/* rules.c - first-match rule lookup over module paths (rules.h). */
#include "rules.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* glibc's regcomp copies the operand of every + and {n,m} (n, m copies),
 * and nested ones multiply: "a+++...+" with 40 pluses asks for gigabytes.
 * The product of the copy counts over the whole pattern bounds the nested
 * product, so a pattern is refused when it passes RULE_COPIES_MAX. Adjacent
 * repetition operators ("a++", "a*{2}") are undefined in POSIX and refused
 * too. Returns 0, or -1 with msg filled. */
#define RULE_COPIES_MAX 4096.0

static int rule_check_repetition(const char *p, char *msg, size_t cap) {
    double copies = 1.0;
    bool after_rep = false;
    for (size_t i = 0; p[i]; i++) {
        char c = p[i];
        if (c == '\\' && p[i + 1]) { /* an escaped character is a literal */
            i++, after_rep = false;
            continue;
        }
        if (c == '[') { /* a bracket expression: its ']' first or after '^' is literal */
            size_t j = i + 1;
            if (p[j] == '^') j++;
            if (p[j] == ']') j++;
            while (p[j] && p[j] != ']') j++;
            i = p[j] ? j : i;
            after_rep = false;
            continue;
        }
        bool rep = c == '+' || c == '*' || c == '?' || c == '{';
        if (rep && after_rep) {
            snprintf(msg, cap, "two repetition operators in a row at character %zu (undefined in POSIX); use one", i + 1);
            return -1;
        }
        if (c == '+') copies *= 2.0;
        if (c == '{') {
            char *end;
            double lo = strtod(p + i + 1, &end), hi = lo;
            if (*end == ',') hi = end[1] == '}' ? lo + 1.0 : strtod(end + 1, &end);
            copies *= (hi > lo ? hi : lo) + 1.0;
            while (p[i] && p[i] != '}') i++;
            if (!p[i]) break; /* regcomp reports the unclosed brace */
        }
        after_rep = rep;
        if (copies > RULE_COPIES_MAX) {
            snprintf(msg, cap, "its + and {n,m} repetitions would make regcomp copy parts of it more than %.0f times "
                     "(each + doubles, {n,m} multiplies by m); use * or fewer repetitions", RULE_COPIES_MAX);
            return -1;
        }
    }
    return 0;
}

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
        char msg[200];
        if (rule_check_repetition(r->module_path, msg, sizeof msg) != 0) {
            rule_set_free(s);
            return qt_error_set(err, QT_ERR_CONFIG, "%s: module_path \"%s\" is refused: %s", r->where,
                                r->module_path, msg);
        }
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
