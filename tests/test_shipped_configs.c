/* test_shipped_configs.c - every config in configs/ runs.
 *
 * The configs are what a user starts from, and the documents quote their
 * results; a config that a schema change breaks would only show when someone
 * runs it on the full data. Here each one runs as the binary for two steps on
 * the mini data set (an evaluate-only config just evaluates). A config whose
 * model.init_from is runs/<name>/final.h5 starts from the two-step result of
 * the config that writes runs/<name>, so the chains (pretrain -> ptq/qlora/qat,
 * resnet8 -> resnet8-ptq/resnet8-qlora) are exercised as documented. The list
 * is read from the directory, so a new config is covered without a line here.
 */
#include <CUnit/CUnit.h>
#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "test_proc.h"
#include "test_util.h"

enum { SHIPPED_MAX = 64 };

typedef struct {
    char name[128];     /* file name without .yaml */
    char out_dir[256];  /* run.out_dir as written, e.g. runs/resnet8 */
    char init_from[256];/* model.init_from as written, or "" */
    int eval_only;      /* train.epochs: 0 */
    int done;           /* 1 ran and passed, -1 failed */
} Shipped;

static char *tmp_root;

static int shipped_suite_init(void) {
    tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int shipped_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

/* The value after `key:` on the first line that holds it (indented keys included), up to a comment or the end
 * of the line, trimmed; "" when absent. The configs are plain block YAML; this reads nothing nested further. */
static void yaml_value(const char *text, const char *key, char *out, size_t n) {
    out[0] = '\0';
    size_t klen = strlen(key);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        const char *q = p;
        while (*q == ' ') q++;
        if (strncmp(q, key, klen) != 0 || q[klen] != ':') continue;
        q += klen + 1;
        while (*q == ' ') q++;
        size_t len = strcspn(q, "#\n");
        while (len && q[len - 1] == ' ') len--;
        snprintf(out, n, "%.*s", (int)len, q);
        return;
    }
}

static int shipped_list(Shipped *list) {
    DIR *d = opendir("configs");
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < SHIPPED_MAX) {
        size_t len = strlen(e->d_name);
        if (len < 6 || strcmp(e->d_name + len - 5, ".yaml") != 0) continue;
        char path[PATH_MAX], epochs[32];
        snprintf(path, sizeof path, "configs/%s", e->d_name);
        char *text = test_file_read(path, NULL);
        if (!text) continue;
        Shipped *s = &list[n++];
        memset(s, 0, sizeof *s);
        snprintf(s->name, sizeof s->name, "%.*s", (int)(len - 5), e->d_name);
        yaml_value(text, "out_dir", s->out_dir, sizeof s->out_dir);
        yaml_value(text, "init_from", s->init_from, sizeof s->init_from);
        yaml_value(text, "epochs", epochs, sizeof epochs);
        s->eval_only = strcmp(epochs, "0") == 0;
        free(text);
    }
    closedir(d);
    return n;
}

/* Runs one config (after the one its init_from names); returns 1 if it passed. */
static int shipped_run(Shipped *list, int n, Shipped *s, int depth) {
    if (s->done) return s->done > 0;
    char base[PATH_MAX] = "";
    if (s->init_from[0]) {
        Shipped *from = NULL;
        for (int i = 0; i < n; i++) {
            size_t l = strlen(list[i].out_dir);
            if (l && strncmp(s->init_from, list[i].out_dir, l) == 0 && strcmp(s->init_from + l, "/final.h5") == 0)
                from = &list[i];
        }
        if (!from || from == s || depth > 4) {
            fprintf(stderr, "\n  configs/%s.yaml: model.init_from %s is no shipped config's final.h5\n", s->name,
                    s->init_from);
            s->done = -1;
            return 0;
        }
        if (!shipped_run(list, n, from, depth + 1)) {
            s->done = -1;
            return 0;
        }
        snprintf(base, sizeof base, "--set model.init_from=%s/%s/final.h5", tmp_root, from->name);
    }
    char cmd[4 * PATH_MAX], log[PATH_MAX];
    snprintf(log, sizeof log, "%s/%s.log", tmp_root, s->name);
    snprintf(cmd, sizeof cmd,
             "OPENBLAS_NUM_THREADS=1 %s --config configs/%s.yaml --quiet --set data.dir=data/fashion-mnist-mini "
             "--set data.cache_dir=none --set run.threads=1 --set run.out_dir=%s/%s %s %s >%s 2>&1",
             test_qtrain_bin(), s->name, tmp_root, s->name, s->eval_only ? "" : "--set train.steps=2", base, log);
    fflush(NULL);
    int st = system(cmd);
    int ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
    if (!ok) {
        char *text = test_file_read(log, NULL);
        fprintf(stderr, "\n  configs/%s.yaml failed on the mini data:\n%s\n", s->name, text ? text : "(no output)");
        free(text);
    }
    s->done = ok ? 1 : -1;
    return ok;
}

static void test_every_config_runs(void) {
    static Shipped list[SHIPPED_MAX];
    int n = shipped_list(list);
    CU_ASSERT_FATAL(n > 0);
    int names = 0;
    for (int i = 0; i < n; i++) {
        CU_ASSERT(shipped_run(list, n, &list[i], 0));
        /* the ones the documents quote are among them */
        if (!strcmp(list[i].name, "pretrain") || !strcmp(list[i].name, "resnet8") || !strcmp(list[i].name, "dscnn") ||
            !strcmp(list[i].name, "resnet8-qlora"))
            names++;
    }
    CU_ASSERT_EQUAL(names, 4);
}

int register_shipped_configs_suite(void) {
    CU_pSuite s = CU_add_suite("shipped_configs", shipped_suite_init, shipped_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "every configs/*.yaml runs two steps on the mini data, chained by init_from",
                        test_every_config_runs);
}
