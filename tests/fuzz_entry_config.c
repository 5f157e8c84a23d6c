/* fuzz_entry_config.c - the config target: a YAML file through config_load
 * (the parse, the schema, the dry model build), as `qtrain --config` runs
 * it, with the file's "#@set key=value" comment lines as --set overrides.
 * An accepted config must print (config_to_yaml) as text that loads back
 * to the same Config, bytewise, and prints the same again. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_harness.h"
#include "trainer/config.h"

#define MAX_OVERRIDES 8
#define OVERRIDE_MARK "#@set "

/* The overrides named by "#@set " lines of text[size], as malloc'd strings. */
static int collect_overrides(const uint8_t *text, size_t size, char **out) {
    size_t mark = strlen(OVERRIDE_MARK);
    int n = 0;
    for (size_t i = 0; i < size && n < MAX_OVERRIDES;) {
        size_t end = i;
        while (end < size && text[end] != '\n') end++;
        if (end - i >= mark && memcmp(text + i, OVERRIDE_MARK, mark) == 0) {
            size_t len = strnlen((const char *)text + i + mark, end - i - mark);
            char *s = malloc(len + 1);
            if (!s) break;
            memcpy(s, text + i + mark, len);
            s[len] = '\0';
            out[n++] = s;
        }
        i = end + 1;
    }
    return n;
}

/* The round trip an accepted config must survive. */
static int check_round_trip(const Config *c, char *why, size_t why_cap) {
    char *text = config_to_yaml(c);
    if (!text) {
        snprintf(why, why_cap, "config_to_yaml returned NULL for an accepted config");
        return 1;
    }
    Config *back = malloc(sizeof *back);
    char *again = NULL;
    QtError err = {0};
    int bad = 0;
    if (!back) {
        snprintf(why, why_cap, "out of memory");
        bad = 1;
    } else if (config_load_string(back, text, "<resolved>", NULL, 0, &err) != QT_OK) {
        snprintf(why, why_cap, "the resolved text of an accepted config does not load: %s\n--- text:\n%.600s", err.msg,
                 text);
        bad = 1;
    } else {
        /* Where the config and its rules were written is not part of what it says. */
        memcpy(back->source, c->source, sizeof back->source);
        for (int i = 0; i < RULES_MAX; i++) {
            memcpy(back->quant.rules[i].match.where, c->quant.rules[i].match.where, RULE_WHERE_MAX);
            memcpy(back->lora.rules[i].match.where, c->lora.rules[i].match.where, RULE_WHERE_MAX);
        }
        if (memcmp(back, c, sizeof *c) != 0) {
            size_t at = 0;
            while (((const uint8_t *)back)[at] == ((const uint8_t *)c)[at]) at++;
            snprintf(why, why_cap, "the resolved text loads to another Config (first difference at byte %zu of %zu)",
                     at, sizeof *c);
            bad = 1;
        } else if (!(again = config_to_yaml(back)) || strcmp(again, text) != 0) {
            snprintf(why, why_cap, "the resolved text prints differently after a round trip");
            bad = 1;
        }
    }
    free(again);
    free(back);
    free(text);
    return bad;
}

int fuzz_config_one(const uint8_t *data, size_t size, char *why, size_t why_cap) {
    char path[512];
    if (fuzz_write_file("config.yaml", data, size, path, sizeof path) != 0) {
        snprintf(why, why_cap, "cannot write the scratch config file");
        return 1;
    }
    char *overrides[MAX_OVERRIDES];
    int n = collect_overrides(data, size, overrides);
    Config *c = malloc(sizeof *c);
    if (!c) {
        snprintf(why, why_cap, "out of memory");
        return 1;
    }
    QtError err = {0};
    QtStatus st = config_load(c, path, (const char *const *)overrides, n, &err);
    int bad = fuzz_check_status("config_load", st, &err, why, why_cap);
    if (!bad && st == QT_OK) bad = check_round_trip(c, why, why_cap);
    free(c);
    for (int i = 0; i < n; i++) free(overrides[i]);
    return bad;
}
