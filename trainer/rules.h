/* rules.h - which rule applies to which module.
 *
 * The quant and lora sections of a config are ordered lists of rules. A
 * rule applies to a module when its module_path, a POSIX extended regular
 * expression, matches the module's whole path ("conv1", "block2/fc"), and
 * its op_types (if any) include the module's layer type. The first rule
 * that applies wins; later ones are not consulted. A rule that applied to
 * no module is worth a warning: it is usually a typo. */
#ifndef QTRAIN_QUANT_RULES_H
#define QTRAIN_QUANT_RULES_H

#include <regex.h>
#include <stdbool.h>

#include "base/error.h"
#include "nn/model.h"

#define RULE_PATTERN_MAX 256
#define RULE_WHERE_MAX 160
#define RULES_MAX 32

/* What a rule matches on, as written in the config. */
typedef struct {
    char module_path[RULE_PATTERN_MAX]; /* POSIX ERE, matched against the whole path */
    unsigned op_types;                  /* bit (1u << LayerType) per allowed type; 0 = any */
    char where[RULE_WHERE_MAX];         /* "configs/x.yaml:12:7: quant.rules[0]", for messages */
} RuleMatch;

typedef struct {
    int n;                   /* rules */
    regex_t re[RULES_MAX];   /* [n] compiled "^(module_path)$" */
    unsigned op_types[RULES_MAX];
    int hits[RULES_MAX];     /* modules each rule was the first match for */
    bool compiled[RULES_MAX];
} RuleSet;

/* Compiles n rules (n <= RULES_MAX); rules[i] is at
 * (const char *)rules + i * stride, so the RuleMatch can sit inside a
 * bigger per-rule struct. A pattern that does not compile is
 * QT_ERR_CONFIG naming the rule (its `where`), the pattern and regerror's
 * message. On error nothing stays allocated. */
QtStatus rule_set_compile(RuleSet *s, const void *rules, int n, size_t stride, QtError *err);
void rule_set_free(RuleSet *s);

/* The index of the first rule applying to module m, or -1; counts the hit. */
int rule_set_match(RuleSet *s, const Module *m);
/* Whether pattern matches the whole of path (compiling it once; for
 * checks outside a RuleSet). -1 if it does not compile. */
int rule_pattern_matches(const char *pattern, const char *path);

#endif
