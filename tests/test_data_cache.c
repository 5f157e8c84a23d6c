/* test_data_cache.c - the decompressed IDX cache (data.cache_dir): writes,
 * hits, invalidation by a changed source, damaged copies rebuilt, unusable
 * directories, "none" and the default place, and the config key. Every
 * cache lives in a mkdtemp directory; none touches the user's real one. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "data/dataset.h"
#include "test_util.h"
#include "trainer/config.h"

#define MINI_DIR "data/fashion-mnist-mini"
#define CACHE_HEADER_FIXED 48 /* the cache file's fixed header, before the source path */

/* A mkdtemp directory and paths in it, all freed by dir_close. */
typedef struct {
    char *dir;
    char *paths[32];
    int n;
} Tmp;

static void tmp_open(Tmp *t) {
    memset(t, 0, sizeof *t);
    t->dir = test_tmpdir_new();
}

static const char *tmp_path(Tmp *t, const char *name) { return t->paths[t->n++] = test_path_join(t->dir, name); }

static void tmp_close(Tmp *t) {
    for (int i = 0; i < t->n; i++) free(t->paths[i]);
    CU_ASSERT(test_tmpdir_remove(t->dir));
}

/* Writes a gzip'd 1-D IDX file of n bytes, byte i = seed + 7 i. */
static void write_gz_idx(const char *path, uint32_t n, int seed) {
    uint8_t *buf = malloc(8 + n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(buf);
    buf[0] = 0, buf[1] = 0, buf[2] = 8, buf[3] = 1;
    buf[4] = (uint8_t)(n >> 24), buf[5] = (uint8_t)(n >> 16), buf[6] = (uint8_t)(n >> 8), buf[7] = (uint8_t)n;
    for (uint32_t i = 0; i < n; i++) buf[8 + i] = (uint8_t)(seed + 7 * i);
    gzFile f = gzopen(path, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    CU_ASSERT_EQUAL(gzwrite(f, buf, 8 + n), (int)(8 + n));
    CU_ASSERT_EQUAL(gzclose(f), Z_OK);
    free(buf);
}

static bool idx_equal(const IdxArray *a, const IdxArray *b) {
    return a->ndim == b->ndim && memcmp(a->dims, b->dims, sizeof a->dims) == 0 && a->n_bytes == b->n_bytes &&
           memcmp(a->data, b->data, a->n_bytes) == 0;
}

/* Whether a holds what write_gz_idx(n, seed) wrote. */
static bool idx_is(const IdxArray *a, uint32_t n, int seed) {
    if (a->ndim != 1 || a->dims[0] != (int)n || a->n_bytes != n) return false;
    for (uint32_t i = 0; i < n; i++)
        if (a->data[i] != (uint8_t)(seed + 7 * i)) return false;
    return true;
}

/* Entries of dir: how many, how many end in suffix; *first gets the first
 * such (malloc'd path) if first is non-NULL. */
static int count_entries(const char *dir, const char *suffix, int *with_suffix, char **first) {
    int n = 0;
    *with_suffix = 0;
    if (first) *first = NULL;
    DIR *d = opendir(dir);
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        n++;
        size_t len = strlen(e->d_name), sl = strlen(suffix);
        if (len < sl || strcmp(e->d_name + len - sl, suffix) != 0) continue;
        if (first && !*first) *first = test_path_join(dir, e->d_name);
        (*with_suffix)++;
    }
    closedir(d);
    return n;
}

/* The single .idx file in dir (malloc'd), failing the test if there is not exactly one. */
static char *only_cache_file(const char *dir) {
    int idx = 0;
    char *first = NULL;
    int n = count_entries(dir, ".idx", &idx, &first);
    CU_ASSERT(n == 1 && idx == 1);
    if (!first) CU_FAIL_FATAL("no cache file");
    return first;
}

static bool warning_has(const IdxCache *c, const char *what) {
    if (getenv("QT_TEST_SHOW_MSGS")) fprintf(stderr, "\n  [warning] %s\n", c->warning);
    if (strstr(c->warning, what)) return true;
    fprintf(stderr, "\n  cache warning lacks \"%s\": %s\n", what, c->warning);
    return false;
}

/* One idx_read_cached through a fresh IdxCache on dir. */
static QtStatus read_through(const char *dir, const char *path, IdxCache *c, IdxArray *a, QtError *err) {
    idx_cache_init(c, dir);
    qt_error_clear(err);
    return idx_read_cached(path, c, a, err);
}

/* ---- the mini data set -------------------------------------------------------- */

static bool datasets_equal(const Dataset *a, const Dataset *b) {
    return a->n == b->n && a->feat == b->feat && memcmp(a->shape, b->shape, sizeof a->shape) == 0 &&
           a->n_classes == b->n_classes && memcmp(a->pixels, b->pixels, (size_t)a->n * (size_t)a->feat) == 0 &&
           memcmp(a->labels, b->labels, (size_t)a->n * sizeof *a->labels) == 0;
}

static void test_cache_write_then_hit(void) {
    Tmp t;
    tmp_open(&t);
    const char *dir = tmp_path(&t, "cache/deeper"); /* made on first write */
    Dataset ref_tr, ref_te, tr, te;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist(&ref_tr, &ref_te, MINI_DIR, &err), QT_OK);
    for (int round = 0; round < 2; round++) {
        IdxCache c;
        idx_cache_init(&c, dir);
        CU_ASSERT_STRING_EQUAL(c.dir, dir);
        CU_ASSERT_EQUAL_FATAL(dataset_load_fashion_mnist_cached(&tr, &te, MINI_DIR, &c, &err), QT_OK);
        /* the first load inflates and writes the four files, the second reads them */
        CU_ASSERT_EQUAL(c.writes, round == 0 ? 4 : 0);
        CU_ASSERT_EQUAL(c.hits, round == 0 ? 0 : 4);
        CU_ASSERT_EQUAL(c.n_warnings, 0);
        CU_ASSERT_STRING_EQUAL(c.warning, "");
        CU_ASSERT(datasets_equal(&tr, &ref_tr));
        CU_ASSERT(datasets_equal(&te, &ref_te));
        dataset_free(&tr);
        dataset_free(&te);
        int idx = 0;
        CU_ASSERT_EQUAL(count_entries(dir, ".idx", &idx, NULL), 4); /* no temporary file is left */
        CU_ASSERT_EQUAL(idx, 4);
    }
    struct stat sb;
    CU_ASSERT(stat(dir, &sb) == 0 && (sb.st_mode & 0777) == 0700);
    /* A NULL cache is the plain loader. */
    CU_ASSERT_EQUAL(dataset_load_fashion_mnist_cached(&tr, NULL, MINI_DIR, NULL, &err), QT_OK);
    CU_ASSERT(datasets_equal(&tr, &ref_tr));
    dataset_free(&tr);
    dataset_free(&ref_tr);
    dataset_free(&ref_te);
    tmp_close(&t);
}

/* ---- invalidation ------------------------------------------------------------- */

static void set_mtime(const char *path, time_t sec, long nsec) {
    struct timespec ts[2] = {{sec, nsec}, {sec, nsec}};
    CU_ASSERT_EQUAL(utimensat(AT_FDCWD, path, ts, 0), 0);
}

/* A temp file of a killed writer stayed forever. Now a write removes those of its own file whose writer is dead and
 * that are old enough (pid namespaces sharing the directory show live writers as dead): a fresh one, one of a live
 * pid and one of another file stay. */
static void test_cache_stale_tmps_removed(void) {
    Tmp t;
    tmp_open(&t);
    const char *dir = tmp_path(&t, "cache"), *src = tmp_path(&t, "a.gz");
    write_gz_idx(src, 100, 1);
    IdxCache c;
    IdxArray a;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src, &c, &a, &err), QT_OK);
    idx_free(&a);
    char *name = only_cache_file(dir), planted[4][1200];
    snprintf(planted[0], sizeof planted[0], "%s.tmp.999999999.123456789", name); /* dead, old: removed */
    snprintf(planted[1], sizeof planted[1], "%s.tmp.999999999.1", name);         /* dead, fresh: kept */
    snprintf(planted[2], sizeof planted[2], "%s.tmp.%ld.2", name, (long)getppid()); /* alive, old: kept */
    snprintf(planted[3], sizeof planted[3], "%s/other.idx.tmp.999999999.3", dir);  /* not this file's: kept */
    for (int i = 0; i < 4; i++) {
        int fd = open(planted[i], O_WRONLY | O_CREAT | O_EXCL, 0600);
        CU_ASSERT_FATAL(fd >= 0);
        close(fd);
        if (i != 1) set_mtime(planted[i], time(NULL) - 3600, 0);
    }
    CU_ASSERT_EQUAL(unlink(name), 0); /* so the next read writes the copy again */
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src, &c, &a, &err), QT_OK);
    CU_ASSERT_EQUAL(c.writes, 1);
    idx_free(&a);
    CU_ASSERT_NOT_EQUAL(access(planted[0], F_OK), 0);
    for (int i = 1; i < 4; i++) CU_ASSERT_EQUAL(access(planted[i], F_OK), 0);
    for (int i = 1; i < 4; i++) unlink(planted[i]);
    free(name);
    tmp_close(&t);
}

static void test_cache_changed_source(void) {
    Tmp t;
    tmp_open(&t);
    const char *dir = tmp_path(&t, "cache"), *src = tmp_path(&t, "a-idx1-ubyte.gz");
    IdxCache c;
    IdxArray a;
    QtError err = {0};
    write_gz_idx(src, 3000, 1);
    set_mtime(src, 1600000000, 5);
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src, &c, &a, &err), QT_OK);
    CU_ASSERT(c.writes == 1 && c.hits == 0 && idx_is(&a, 3000, 1));
    idx_free(&a);
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src, &c, &a, &err), QT_OK);
    CU_ASSERT(c.writes == 0 && c.hits == 1 && idx_is(&a, 3000, 1));
    idx_free(&a);

    /* Touched (only the nanoseconds differ): inflated and cached again, quietly. */
    set_mtime(src, 1600000000, 6);
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src, &c, &a, &err), QT_OK);
    CU_ASSERT(c.writes == 1 && c.hits == 0 && c.n_warnings == 0 && idx_is(&a, 3000, 1));
    idx_free(&a);

    /* New contents of another size under the very same time stamp. */
    write_gz_idx(src, 2500, 9);
    set_mtime(src, 1600000000, 6);
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src, &c, &a, &err), QT_OK);
    CU_ASSERT(c.writes == 1 && c.hits == 0 && c.n_warnings == 0 && idx_is(&a, 2500, 9));
    idx_free(&a);
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src, &c, &a, &err), QT_OK);
    CU_ASSERT(c.hits == 1 && idx_is(&a, 2500, 9));
    idx_free(&a);
    char *only = only_cache_file(dir); /* the same file was replaced each time */
    free(only);

    /* The same name in another directory is another source: its own copy. */
    const char *sub = tmp_path(&t, "other");
    CU_ASSERT_EQUAL_FATAL(mkdir(sub, 0700), 0);
    const char *src2 = tmp_path(&t, "other/a-idx1-ubyte.gz");
    write_gz_idx(src2, 100, 4);
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src2, &c, &a, &err), QT_OK);
    CU_ASSERT(c.writes == 1 && idx_is(&a, 100, 4));
    idx_free(&a);
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src, &c, &a, &err), QT_OK);
    CU_ASSERT(c.hits == 1 && idx_is(&a, 2500, 9));
    idx_free(&a);
    int idx = 0;
    CU_ASSERT_EQUAL(count_entries(dir, ".idx", &idx, NULL), 2);
    tmp_close(&t);
}

/* ---- damaged copies ------------------------------------------------------------- */

typedef enum { CUT, EXTEND, FLIP_PAYLOAD, IDX_TYPE, IDX_DIM, BAD_MAGIC, EMPTY, CUT_HEADER } Damage;

/* Damages the cache file in place; plen is the length of the source path stored in it. */
static void damage(const char *path, Damage how, size_t plen) {
    size_t n = 0;
    char *b = test_file_read(path, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    size_t idx = CACHE_HEADER_FIXED + plen; /* the IDX bytes start here */
    switch (how) {
    case CUT: n -= 10; break;
    case EXTEND: break; /* appended below */
    case FLIP_PAYLOAD: b[n - 100] ^= 0x10; break;
    case IDX_TYPE: b[idx + 2] = 0x0D; break;
    case IDX_DIM: b[idx + 7] ^= 1; break; /* the count, so the payload no longer matches it */
    case BAD_MAGIC: memcpy(b, "GARBAGE!", 8); break;
    case EMPTY: n = 0; break;
    case CUT_HEADER: n = CACHE_HEADER_FIXED + 3; break;
    }
    test_file_write(path, b, n);
    if (how == EXTEND) { /* one more byte than the header allows */
        FILE *f = fopen(path, "ab");
        CU_ASSERT_PTR_NOT_NULL_FATAL(f);
        fputc(0, f);
        fclose(f);
    }
    free(b);
}

static void test_cache_damaged_rebuilt(void) {
    Tmp t;
    tmp_open(&t);
    const char *dir = tmp_path(&t, "cache"), *src = tmp_path(&t, "d-idx1-ubyte.gz");
    write_gz_idx(src, 5000, 3);
    char real[4096];
    CU_ASSERT_PTR_NOT_NULL_FATAL(realpath(src, real));
    const struct {
        Damage how;
        const char *why;
    } cases[] = {
        {CUT, "truncated"}, {EXTEND, "too long"}, {FLIP_PAYLOAD, "CRC-32"},
        {IDX_TYPE, "32-bit float"}, {IDX_DIM, "announces"}, {BAD_MAGIC, "qtrain cache header"},
        {EMPTY, "qtrain cache header"}, {CUT_HEADER, "truncated inside its header"},
    };
    IdxCache c;
    IdxArray a;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(read_through(dir, src, &c, &a, &err), QT_OK);
    idx_free(&a);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *file = only_cache_file(dir);
        damage(file, cases[i].how, strlen(real));
        /* The damage is reported and the copy not used; the data comes from the source and the copy is rebuilt. */
        CU_ASSERT_EQUAL(read_through(dir, src, &c, &a, &err), QT_OK);
        CU_ASSERT(idx_is(&a, 5000, 3));
        CU_ASSERT(c.hits == 0 && c.writes == 1 && c.n_warnings == 1);
        CU_ASSERT(warning_has(&c, cases[i].why));
        CU_ASSERT(warning_has(&c, "damaged") && warning_has(&c, "rebuilt") && warning_has(&c, file));
        idx_free(&a);
        CU_ASSERT_EQUAL(read_through(dir, src, &c, &a, &err), QT_OK);
        CU_ASSERT(c.hits == 1 && c.writes == 0 && c.n_warnings == 0 && idx_is(&a, 5000, 3));
        idx_free(&a);
        free(file);
    }
    tmp_close(&t);
}

/* ---- unusable directories, none, the default, plain files, errors --------------- */

static void test_cache_unwritable(void) {
    Tmp t;
    tmp_open(&t);
    const char *blocker = tmp_path(&t, "file"), *src = tmp_path(&t, "u-idx1-ubyte.gz");
    const char *src2 = tmp_path(&t, "v-idx1-ubyte.gz");
    test_file_write(blocker, "x", 1);
    write_gz_idx(src, 700, 2);
    write_gz_idx(src2, 800, 5);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/sub/cache", blocker); /* under a regular file: cannot be made, even by root */
    IdxCache c;
    idx_cache_init(&c, dir);
    IdxArray a, b;
    QtError err = {0};
    CU_ASSERT_EQUAL(idx_read_cached(src, &c, &a, &err), QT_OK);
    CU_ASSERT_EQUAL(idx_read_cached(src2, &c, &b, &err), QT_OK);
    CU_ASSERT(idx_is(&a, 700, 2) && idx_is(&b, 800, 5));
    /* one warning: the second load does not try again */
    CU_ASSERT(c.write_failed && c.writes == 0 && c.hits == 0 && c.n_warnings == 1);
    CU_ASSERT(warning_has(&c, "cannot cache") && warning_has(&c, dir) && warning_has(&c, "Not a directory"));
    CU_ASSERT(warning_has(&c, "data.cache_dir"));
    idx_free(&a);
    idx_free(&b);

    /* A full disk (a file-size limit): the write fails halfway and leaves no temporary file. */
    const char *full = tmp_path(&t, "full");
    struct rlimit old, small;
    getrlimit(RLIMIT_FSIZE, &old);
    small = (struct rlimit){.rlim_cur = 300, .rlim_max = old.rlim_max};
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &small);
    QtStatus st = read_through(full, src, &c, &a, &err);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    CU_ASSERT(st == QT_OK && idx_is(&a, 700, 2));
    CU_ASSERT(c.write_failed && c.writes == 0 && warning_has(&c, "File too large") && warning_has(&c, "writing"));
    idx_free(&a);
    int entries = 0;
    CU_ASSERT_EQUAL(count_entries(full, ".idx", &entries, NULL), 0);

    /* A directory without write permission (root writes anyway, so only as another user). */
    if (geteuid() != 0) {
        const char *ro = tmp_path(&t, "ro");
        CU_ASSERT_EQUAL_FATAL(mkdir(ro, 0500), 0);
        CU_ASSERT_EQUAL(read_through(ro, src, &c, &a, &err), QT_OK);
        CU_ASSERT(idx_is(&a, 700, 2) && c.n_warnings == 1 && warning_has(&c, "Permission denied"));
        idx_free(&a);
        int idx = 0;
        CU_ASSERT_EQUAL(count_entries(ro, ".idx", &idx, NULL), 0); /* no temporary file either */
    }
    tmp_close(&t);
}

static void test_cache_off_and_plain(void) {
    Tmp t;
    tmp_open(&t);
    const char *dir = tmp_path(&t, "cache"), *src = tmp_path(&t, "p-idx1-ubyte.gz");
    write_gz_idx(src, 300, 8);
    IdxCache c;
    IdxArray a, ref;
    QtError err = {0};
    const char *off[] = {"none", "None", NULL};
    for (int i = 0; i < 3; i++) {
        idx_cache_init(&c, off[i]);
        CU_ASSERT(c.dir[0] == '\0' && c.n_warnings == 0);
        CU_ASSERT_EQUAL(idx_read_cached(src, &c, &a, &err), QT_OK);
        CU_ASSERT(idx_is(&a, 300, 8) && c.writes == 0 && c.hits == 0);
        idx_free(&a);
    }
    CU_ASSERT_EQUAL(idx_read_cached(src, NULL, &a, &err), QT_OK);
    CU_ASSERT(idx_is(&a, 300, 8));
    idx_free(&a);
    struct stat sb;
    CU_ASSERT(stat(dir, &sb) != 0); /* nothing was made */

    /* A plain IDX file is read as it is, not cached. */
    const char *plain = tmp_path(&t, "p-plain");
    gzFile g = gzopen(src, "rb");
    uint8_t buf[400];
    int len = gzread(g, buf, sizeof buf);
    gzclose(g);
    CU_ASSERT_EQUAL_FATAL(len, 308);
    test_file_write(plain, buf, (size_t)len);
    CU_ASSERT_EQUAL(read_through(dir, plain, &c, &a, &err), QT_OK);
    CU_ASSERT_EQUAL(idx_read(plain, &ref, &err), QT_OK);
    CU_ASSERT(idx_equal(&a, &ref) && c.writes == 0 && c.hits == 0 && c.n_warnings == 0);
    CU_ASSERT(stat(dir, &sb) != 0);
    idx_free(&a);
    idx_free(&ref);

    /* Errors are the source's, as without a cache, and nothing is cached. */
    const char *missing = tmp_path(&t, "missing.gz"), *cut = tmp_path(&t, "cut.gz");
    CU_ASSERT_EQUAL(read_through(dir, missing, &c, &a, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, "cannot open IDX file") && test_msg_has(&err, missing));
    size_t n = 0;
    char *gz = test_file_read(src, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(gz);
    test_file_write(cut, gz, n / 2);
    free(gz);
    CU_ASSERT_EQUAL(read_through(dir, cut, &c, &a, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "truncated") && a.data == NULL && c.writes == 0);
    CU_ASSERT(stat(dir, &sb) != 0);
    tmp_close(&t);
}

/* Sets or unsets (value NULL) an environment variable. */
static void env_set(const char *name, const char *value) {
    if (value) setenv(name, value, 1);
    else unsetenv(name);
}

static char *env_save(const char *name) {
    const char *v = getenv(name);
    return v ? strdup(v) : NULL;
}

static void test_cache_default_dir(void) {
    char *xdg = env_save("XDG_CACHE_HOME"), *home = env_save("HOME");
    IdxCache c;
    env_set("XDG_CACHE_HOME", "/x/cache");
    env_set("HOME", "/h/me");
    idx_cache_init(&c, "");
    CU_ASSERT_STRING_EQUAL(c.dir, "/x/cache/qtrain");
    env_set("XDG_CACHE_HOME", "relative/cache"); /* the XDG spec says to ignore a relative one */
    idx_cache_init(&c, "");
    CU_ASSERT_STRING_EQUAL(c.dir, "/h/me/.cache/qtrain");
    env_set("XDG_CACHE_HOME", "");
    idx_cache_init(&c, "");
    CU_ASSERT_STRING_EQUAL(c.dir, "/h/me/.cache/qtrain");
    idx_cache_init(&c, "my/cache"); /* an explicit directory wins */
    CU_ASSERT_STRING_EQUAL(c.dir, "my/cache");
    env_set("XDG_CACHE_HOME", NULL);
    env_set("HOME", NULL);
    idx_cache_init(&c, "");
    CU_ASSERT(c.dir[0] == '\0' && c.n_warnings == 1 && warning_has(&c, "neither XDG_CACHE_HOME nor HOME"));
    env_set("XDG_CACHE_HOME", xdg);
    env_set("HOME", home);
    free(xdg);
    free(home);
    char *longdir = malloc(IDX_CACHE_PATH_MAX + 10);
    memset(longdir, 'a', IDX_CACHE_PATH_MAX + 9);
    longdir[IDX_CACHE_PATH_MAX + 9] = '\0';
    idx_cache_init(&c, longdir);
    CU_ASSERT(c.dir[0] == '\0' && c.n_warnings == 1 && warning_has(&c, "longer than"));
    free(longdir);
}

/* ---- the config key ------------------------------------------------------------- */

#define CFG_MODEL "model: {input: [4], layers: [{type: dense, units: 2}]}\n"

static void test_config_cache_dir(void) {
    Config *c = malloc(sizeof *c), *d = malloc(sizeof *d);
    CU_ASSERT_FATAL(c && d);
    QtError e = {0};
    const struct {
        const char *yaml, *want;
    } ok[] = {
        {CFG_MODEL, ""},
        {"data: {cache_dir: /var/cache/q}\n" CFG_MODEL, "/var/cache/q"},
        {"data: {cache_dir: none}\n" CFG_MODEL, "none"},
        {"data: {cache_dir: NONE}\n" CFG_MODEL, "none"},
        {"data: {cache_dir: \"\"}\n" CFG_MODEL, ""},
        {"data: {cache_dir: null}\n" CFG_MODEL, ""},
        {"data: {cache_dir: 'a dir: \"x\"'}\n" CFG_MODEL, "a dir: \"x\""},
        {"data: {cache_dir: 'false'}\n" CFG_MODEL, "false"}, /* quoted: a name, as YAML says */
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        qt_error_clear(&e);
        QtStatus st = config_load_string(c, ok[i].yaml, "t.yaml", NULL, 0, &e);
        if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
        CU_ASSERT_EQUAL_FATAL(st, QT_OK);
        CU_ASSERT_STRING_EQUAL(c->data.cache_dir, ok[i].want);
        /* round trip: the resolved YAML loads back to the same value and the same text */
        char *text = config_to_yaml(c);
        CU_ASSERT_PTR_NOT_NULL_FATAL(text);
        CU_ASSERT_PTR_NOT_NULL(strstr(text, "  cache_dir: "));
        CU_ASSERT_EQUAL_FATAL(config_load_string(d, text, "emitted", NULL, 0, &e), QT_OK);
        CU_ASSERT_STRING_EQUAL(d->data.cache_dir, ok[i].want);
        char *again = config_to_yaml(d);
        CU_ASSERT(again && strcmp(text, again) == 0);
        free(text);
        free(again);
    }
    const char *ov[] = {"data.cache_dir=/tmp/over"};
    CU_ASSERT_EQUAL(config_load_string(c, CFG_MODEL, "t.yaml", ov, 1, &e), QT_OK);
    CU_ASSERT_STRING_EQUAL(c->data.cache_dir, "/tmp/over");

    /* errors name the place and the key */
    const struct {
        const char *yaml, *override, *sub1, *sub2;
    } bad[] = {
        {"data: {cache_dir: false}\n" CFG_MODEL, NULL, "t.yaml:1:19: data.cache_dir", "write none"},
        {"data: {cache_dir: [a, b]}\n" CFG_MODEL, NULL, "t.yaml:1:19: data.cache_dir", "a string"},
        {CFG_MODEL, "data.cache_dir=off", "--set data.cache_dir=off", "none"},
        {"data: {cachedir: /x}\n" CFG_MODEL, NULL, "unknown key 'cachedir'", "cache_dir"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        qt_error_clear(&e);
        const char *o[1] = {bad[i].override};
        CU_ASSERT_EQUAL(config_load_string(c, bad[i].yaml, "t.yaml", o, bad[i].override ? 1 : 0, &e), QT_ERR_CONFIG);
        CU_ASSERT(test_msg_has(&e, bad[i].sub1) && test_msg_has(&e, bad[i].sub2));
    }
    free(c);
    free(d);
}

/* The test configs turn the cache off, so test runs never write into the user's cache directory. */
static void test_test_configs_no_cache(void) {
    DIR *dir = opendir("tests/configs");
    CU_ASSERT_PTR_NOT_NULL_FATAL(dir);
    Config *c = malloc(sizeof *c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    int n = 0;
    for (struct dirent *e; (e = readdir(dir)) != NULL;) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 5, ".yaml") != 0) continue;
        char path[512];
        snprintf(path, sizeof path, "tests/configs/%s", e->d_name);
        QtError err = {0};
        CU_ASSERT_EQUAL(config_load(c, path, NULL, 0, &err), QT_OK);
        if (strcmp(c->data.cache_dir, "none") != 0) fprintf(stderr, "\n  %s: data.cache_dir is not none\n", path);
        CU_ASSERT_STRING_EQUAL(c->data.cache_dir, "none");
        n++;
    }
    closedir(dir);
    CU_ASSERT(n >= 6);
    free(c);
}

void data_file_add_tests(CU_pSuite s, int *failed); /* test_data_file.c: data.storage */

int register_data_cache_suite(void) {
    CU_pSuite s = CU_add_suite("data_cache", NULL, NULL);
    if (!s) return -1;
    int failed = !CU_add_test(s, "first load writes, second reads: same data", test_cache_write_then_hit) ||
           !CU_add_test(s, "a changed source is inflated again", test_cache_changed_source) ||
           !CU_add_test(s, "stale IDX cache temp files are removed", test_cache_stale_tmps_removed) ||
           !CU_add_test(s, "damaged copies are reported and rebuilt", test_cache_damaged_rebuilt) ||
           !CU_add_test(s, "unwritable directory: one warning, data loads", test_cache_unwritable) ||
           !CU_add_test(s, "none, plain files, source errors", test_cache_off_and_plain) ||
           !CU_add_test(s, "default directory from XDG_CACHE_HOME / HOME", test_cache_default_dir) ||
           !CU_add_test(s, "data.cache_dir: values, errors, round trip", test_config_cache_dir) ||
           !CU_add_test(s, "test configs do not cache", test_test_configs_no_cache);
    if (!failed) data_file_add_tests(s, &failed);
    return failed;
}
