/* test_hostile_corpus.c - the committed hostile files of tests/hostile/:
 * their generator and their replay, in the hostile suite.
 *
 * QTRAIN_HOSTILE_WRITE=DIR run_tests hostile (`make hostile-corpus`) trains
 * the tiny model of tests/hostile/hostile.yaml for two steps, a LoRA run
 * over it (hostile-lora.yaml), and writes DIR/clean/ (the untouched files)
 * and one DIR/<kind>.h5 per hostile kind, crafted by test_hostile.c.
 *
 * Otherwise every *.h5 of tests/hostile/ (read from the directory, so a file
 * added later is replayed too) goes through the loaders its line of
 * tests/hostile/expect.txt names, each run with a timeout: refused (exit
 * status 1 or 2, not a signal), the message naming what the line says,
 * nothing written outside the temporary directory, the file unchanged. The
 * clean files made the same way load, so a refusal is the crafting's doing.
 * Files made with a FIFO cannot be committed: those stay in test_hostile.c. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_hostile.h"
#include "test_util.h"

#define CORPUS_DIR "tests/hostile"
#define CORPUS_CONFIG CORPUS_DIR "/hostile.yaml"
#define CORPUS_LORA_CONFIG CORPUS_DIR "/hostile-lora.yaml"
#define CORPUS_CLEAN_BASE CORPUS_DIR "/clean/base.h5"
#define CORPUS_EXPECT CORPUS_DIR "/expect.txt"
#define PATH_CAP 1024

/* ---- the generator ------------------------------------------------------------------------- */

typedef struct {
    Hostile kind;
    const char *src;       /* "base", "adapters" or "lora" (a LoRA run's checkpoint) */
    const char *ds;        /* where it is hostile */
    const char *elsewhere; /* an external link's or virtual source's target, relative to the file */
    const char *file;      /* written as DIR/<file> */
} CorpusKind;

static const CorpusKind CORPUS_KINDS[] = {
    {EXT_PASSWD, "base", "/params/fc/bias", NULL, "ext_passwd.h5"},
    {VDS_MISSING, "base", "/params/fc/bias", "missing-source.h5", "vds_missing.h5"},
    /* the target exists and holds the dataset: only not following the link refuses it */
    {ELINK_PARAM, "base", "/params/fc/bias", "clean/base.h5", "elink_param.h5"},
    {SOFT_LINK, "base", "/params/fc/bias", NULL, "soft_link.h5"},
    {FILTER, "base", "/params/fc/bias", NULL, "filter_scaleoffset.h5"},
    {CHUNK_HUGE_RAW, "base", "/params/fc/bias", NULL, "chunk_huge.h5"},
    {BOMB_SMALL, "base", "/params/fc/bias", NULL, "deflate_bomb.h5"},
    {UNALLOC, "base", "/params/fc/bias", NULL, "unalloc.h5"},
    {VLEN_DAMAGED, "base", "/params/fc/bias", NULL, "vlen_damaged.h5"},
    {NAN_VALUE, "base", "/params/fc/weight", NULL, "nan_param.h5"},
    {NEGATIVE_VALUE, "base", "/optim/fc/bias/v", NULL, "negative_v.h5"},
    {NAN_VALUE, "adapters", "/lora/fc/A", NULL, "adapters_nan_a.h5"},
    {NAN_VALUE, "lora", "/lora/fc/A", NULL, "lora_nan_a.h5"},
};

static bool run_ok(const char *const *args) {
    char *log = NULL;
    int rc = hostile_qtrain_run(args, &log);
    if (rc != 0) fprintf(stderr, "\n  %s %s ...: exit %d:\n%s\n", args[0], args[1], rc, log);
    free(log);
    return rc == 0;
}

/* Trains hostile-lora.yaml over base into <tmp>/<name>/ (adapters.h5, final.h5). */
static bool corpus_lora_run(const char *base, const char *name) {
    char out[2 * PATH_CAP], init[2 * PATH_CAP];
    snprintf(out, sizeof out, "run.out_dir=%s/%s", hostile_tmp(), name);
    snprintf(init, sizeof init, "model.init_from=%s", base);
    const char *lora[] = {"--config", CORPUS_LORA_CONFIG, "--set", out, "--set", init, "--quiet", NULL};
    return run_ok(lora);
}

/* Writes the corpus into $QTRAIN_HOSTILE_WRITE: clean/base.h5 (a LoRA run's
 * adapters name their base, so adapters_from replays over this one) and the
 * crafted files; the LoRA files are crafted from a run over clean/base.h5. */
static void test_corpus_write(void) {
    const char *dir = getenv("QTRAIN_HOSTILE_WRITE"), *tmp = hostile_tmp();
    char out_b[PATH_CAP], clean[PATH_CAP], p[2 * PATH_CAP], src[2 * PATH_CAP];
    snprintf(clean, sizeof clean, "%s/clean", dir);
    mkdir(dir, 0755);
    mkdir(clean, 0755);
    snprintf(out_b, sizeof out_b, "run.out_dir=%s/corpus-base", tmp);
    const char *base[] = {"--config", CORPUS_CONFIG, "--set", out_b, "--quiet", NULL};
    CU_ASSERT_FATAL(run_ok(base));
    snprintf(src, sizeof src, "%s/corpus-base/final.h5", tmp);
    snprintf(p, sizeof p, "%s/base.h5", clean);
    CU_ASSERT_FATAL(test_file_copy(src, p));
    CU_ASSERT_FATAL(corpus_lora_run(p, "corpus-lora"));
    for (size_t i = 0; i < sizeof CORPUS_KINDS / sizeof CORPUS_KINDS[0]; i++) {
        const CorpusKind *k = &CORPUS_KINDS[i];
        if (strcmp(k->src, "base") == 0)
            snprintf(src, sizeof src, "%s/base.h5", clean);
        else
            snprintf(src, sizeof src, "%s/corpus-lora/%s.h5", tmp, strcmp(k->src, "lora") == 0 ? "final" : k->src);
        const char *made = hostile_craft(k->kind, src, k->src, k->ds, k->elsewhere);
        snprintf(p, sizeof p, "%s/%s", dir, k->file);
        CU_ASSERT(made && test_file_copy(made, p));
    }
}

/* ---- the replay ---------------------------------------------------------------------------- */

typedef enum { C_EVAL, C_INSPECT, C_RESUME, C_INIT_FROM, C_ADAPTERS_FROM, C_MERGE, C_N } CorpusLoader;

static const char *const CORPUS_LOADERS[C_N] = {"eval", "inspect", "resume", "init_from", "adapters_from", "merge"};

/* Runs loader l on file; returns the exit status, the output in *log. */
static int corpus_load(CorpusLoader l, const char *file, char **log) {
    static int serial;
    const char *tmp = hostile_tmp();
    char out[PATH_CAP], from[PATH_CAP], merged[PATH_CAP];
    snprintf(out, sizeof out, "run.out_dir=%s/replay-%d", tmp, ++serial);
    snprintf(merged, sizeof merged, "%s/replay-%d-%s", tmp, serial, l == C_EVAL ? "eval.json" : "merged.h5");
    const char *args[24] = {0};
    switch (l) {
    case C_EVAL: {
        /* eval.json would go beside the checkpoint */
        const char *a[] = {"eval", "--config", CORPUS_CONFIG, "--checkpoint", file, "--out", merged, "--set", out,
                           "--quiet", NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case C_INSPECT: {
        const char *a[] = {"inspect", file, NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case C_RESUME: {
        const char *a[] = {"--config", CORPUS_CONFIG, "--set", out, "--set", "train.steps=3", "--resume", file,
                           "--quiet", NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case C_INIT_FROM: {
        snprintf(from, sizeof from, "model.init_from=%s", file);
        const char *a[] = {"--config", CORPUS_CONFIG, "--set", out, "--set", from, "--set", "train.steps=1",
                           "--quiet", NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case C_ADAPTERS_FROM: {
        snprintf(from, sizeof from, "model.adapters_from=%s", file);
        const char *a[] = {"--config", CORPUS_LORA_CONFIG, "--set", out, "--set", "model.init_from=" CORPUS_CLEAN_BASE,
                           "--set", from, "--set", "train.steps=1", "--quiet", NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case C_MERGE: {
        const char *a[] = {"merge", "--checkpoint", file, "--out", merged, NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case C_N: break;
    }
    return hostile_qtrain_run(args, log);
}

/* What a run may not change outside the temporary directory: the names in
 * the working directory and the corpus, and the config's default run
 * directories (absent). malloc'd. */
static char *outside_snapshot(void) {
    static const char *const dirs[] = {".", CORPUS_DIR, CORPUS_DIR "/clean"};
    size_t cap = 1 << 16, n = 0;
    char *s = calloc(1, cap);
    for (size_t i = 0; s && i < sizeof dirs / sizeof dirs[0]; i++) {
        struct dirent **names = NULL;
        int k = scandir(dirs[i], &names, NULL, alphasort);
        for (int j = 0; j < k; j++) {
            if (n + strlen(names[j]->d_name) + strlen(dirs[i]) + 3 < cap)
                n += (size_t)snprintf(s + n, cap - n, "%s/%s\n", dirs[i], names[j]->d_name);
            free(names[j]);
        }
        free(names);
    }
    if (s && access("runs/hostile", F_OK) == 0) n += (size_t)snprintf(s + n, cap - n, "runs/hostile exists\n");
    if (s && access("runs/hostile-lora", F_OK) == 0) snprintf(s + n, cap - n, "runs/hostile-lora exists\n");
    return s;
}

typedef struct {
    char file[128];
    bool loaders[C_N];
    char what[256];
    bool seen;
} Expect;

/* Reads tests/hostile/expect.txt: "file | loader,loader,... | text the message holds" a line. */
static int expect_read(Expect *e, int cap) {
    FILE *f = fopen(CORPUS_EXPECT, "r");
    if (!f) return -1;
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, f) && n < cap) {
        line[strcspn(line, "\n")] = '\0';
        char *bar1 = strchr(line, '|'), *bar2 = bar1 ? strchr(bar1 + 1, '|') : NULL;
        if (line[0] == '#' || !bar2) continue;
        *bar1 = *bar2 = '\0';
        Expect *x = &e[n++];
        memset(x, 0, sizeof *x);
        sscanf(line, "%127s", x->file);
        for (char *tok = strtok(bar1 + 1, ", "); tok; tok = strtok(NULL, ", "))
            for (int l = 0; l < C_N; l++)
                if (strcmp(tok, CORPUS_LOADERS[l]) == 0) x->loaders[l] = true;
        char *w = bar2 + 1;
        while (*w == ' ') w++;
        snprintf(x->what, sizeof x->what, "%s", w);
        for (size_t k = strlen(x->what); k > 0 && x->what[k - 1] == ' '; k--) x->what[k - 1] = '\0';
    }
    fclose(f);
    return n;
}

static void replay_one(const Expect *x, const char *path) {
    size_t n0 = 0, n1 = 0;
    char *before = test_file_read(path, &n0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(before);
    bool any = false;
    for (int l = 0; l < C_N; l++) {
        if (!x->loaders[l]) continue;
        any = true;
        char *snap = outside_snapshot(), *log = NULL;
        int rc = corpus_load((CorpusLoader)l, path, &log);
        char *snap_after = outside_snapshot();
        bool named = strstr(log, x->what) != NULL, leaked = strstr(log, "root:") != NULL;
        bool kept = snap && snap_after && strcmp(snap, snap_after) == 0;
        if (getenv("QTRAIN_TEST_VERBOSE")) /* every output, to read the messages */
            fprintf(stderr, "\n  %s on %s: exit %d:\n%s\n", CORPUS_LOADERS[l], path, rc, log);
        if (rc != 1 && rc != 2)
            fprintf(stderr, "\n  %s on %s: exit status %d (-1: killed, a hang?), expected a refusal; output:\n%s\n",
                    CORPUS_LOADERS[l], path, rc, log);
        else if (!named || leaked)
            fprintf(stderr, "\n  %s on %s: the message does not hold \"%s\"%s:\n%s\n", CORPUS_LOADERS[l], path, x->what,
                    leaked ? " (and shows /etc/passwd)" : "", log);
        if (!kept) fprintf(stderr, "\n  %s on %s wrote outside its temporary directory:\nbefore:\n%s\nafter:\n%s\n",
                           CORPUS_LOADERS[l], path, snap, snap_after);
        CU_ASSERT(rc == 1 || rc == 2);
        CU_ASSERT(named && !leaked);
        CU_ASSERT(kept);
        free(log);
        free(snap);
        free(snap_after);
    }
    if (!any) fprintf(stderr, "\n  %s: no loader named in " CORPUS_EXPECT "\n", x->file);
    CU_ASSERT(any);
    char *after = test_file_read(path, &n1);
    bool same = after && n0 == n1 && memcmp(before, after, n0) == 0;
    if (!same) fprintf(stderr, "\n  %s changed while it was loaded\n", path);
    CU_ASSERT(same);
    free(before);
    free(after);
}

/* Every *.h5 of tests/hostile/ through the loaders of its line in expect.txt. */
static void test_corpus_replay(void) {
    Expect e[64];
    int n = expect_read(e, 64);
    CU_ASSERT_FATAL(n > 0);
    struct dirent **names = NULL;
    int k = scandir(CORPUS_DIR, &names, NULL, alphasort), replayed = 0;
    CU_ASSERT_FATAL(k > 0);
    for (int j = 0; j < k; j++) {
        const char *name = names[j]->d_name;
        size_t len = strlen(name);
        char path[PATH_CAP];
        snprintf(path, sizeof path, CORPUS_DIR "/%s", name);
        struct stat st;
        if (len > 3 && strcmp(name + len - 3, ".h5") == 0 && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
            Expect *x = NULL;
            for (int i = 0; i < n && !x; i++)
                if (strcmp(e[i].file, name) == 0) x = &e[i];
            if (!x) fprintf(stderr, "\n  %s has no line in " CORPUS_EXPECT "\n", path);
            CU_ASSERT_PTR_NOT_NULL(x);
            if (x) {
                x->seen = true;
                replay_one(x, path);
                replayed++;
            }
        }
        free(names[j]);
    }
    free(names);
    for (int i = 0; i < n; i++) {
        if (!e[i].seen) fprintf(stderr, "\n  " CORPUS_EXPECT " names %s, which is not in " CORPUS_DIR "\n", e[i].file);
        CU_ASSERT(e[i].seen);
    }
    CU_ASSERT(replayed > 0);
}

/* The files the corpus was crafted from load through the same loaders:
 * clean/base.h5, and a LoRA run over it made as the generator makes it. */
static void test_corpus_clean(void) {
    char adapters[PATH_CAP], lora[PATH_CAP];
    snprintf(adapters, sizeof adapters, "%s/clean-lora/adapters.h5", hostile_tmp());
    snprintf(lora, sizeof lora, "%s/clean-lora/final.h5", hostile_tmp());
    CU_ASSERT_FATAL(corpus_lora_run(CORPUS_CLEAN_BASE, "clean-lora"));
    const struct {
        const char *file;
        CorpusLoader l;
    } runs[] = {
        {CORPUS_CLEAN_BASE, C_EVAL},   {CORPUS_CLEAN_BASE, C_INSPECT}, {CORPUS_CLEAN_BASE, C_RESUME},
        {CORPUS_CLEAN_BASE, C_INIT_FROM}, {adapters, C_ADAPTERS_FROM},  {adapters, C_INSPECT},
        {lora, C_MERGE},
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char *snap = outside_snapshot(), *log = NULL;
        int rc = corpus_load(runs[i].l, runs[i].file, &log);
        char *snap_after = outside_snapshot();
        if (rc != 0) fprintf(stderr, "\n  %s on %s: exit %d:\n%s\n", CORPUS_LOADERS[runs[i].l], runs[i].file, rc, log);
        CU_ASSERT_EQUAL(rc, 0);
        CU_ASSERT(snap && snap_after && strcmp(snap, snap_after) == 0); /* a loaded file's outputs go to --out too */
        free(log);
        free(snap);
        free(snap_after);
    }
}

int hostile_corpus_add_tests(CU_pSuite s) {
    if (getenv("QTRAIN_HOSTILE_WRITE"))
        return !CU_add_test(s, "writes the corpus into $QTRAIN_HOSTILE_WRITE", test_corpus_write);
    return !CU_add_test(s, "corpus tests/hostile/: every file refused by its loaders, unchanged", test_corpus_replay) ||
           !CU_add_test(s, "corpus tests/hostile/clean/: the files it was made from load", test_corpus_clean);
}
