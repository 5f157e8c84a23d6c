#include "test_util.h"

#include <dirent.h>
#include <hdf5.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_int8.h"
#include "trainer/config.h"

void test_env_init(TestEnv *e, uint64_t seed) {
    memset(e, 0, sizeof *e);
    arena_init(&e->arena, 1 << 20);
    rng_init(&e->rng, seed, RNG_STREAM_DROPOUT);
    tape_init(&e->tape, &e->arena, &e->rng, NULL);
}

void test_env_free(TestEnv *e) {
    tape_free(&e->tape);
    arena_free(&e->arena);
}

Var *test_var(TestEnv *e, const float *data, int ndim, const int *shape, bool requires_grad) {
    Var *v = tape_new_var(&e->tape, ndim, shape);
    if (!v) return NULL;
    memcpy(v->value.data, data, var_numel(v) * sizeof(float));
    v->requires_grad = requires_grad;
    return v;
}

double test_close_ratio(const float *a, const float *b, size_t n, double atol, double rtol, size_t *worst) {
    double max_ratio = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        double r = d / (atol + rtol * fabs((double)b[i]));
        if (isnan(d)) r = INFINITY;
        if (r > max_ratio || (i == 0 && worst)) {
            if (r > max_ratio) max_ratio = r;
            if (worst) *worst = i;
        }
    }
    return max_ratio;
}

/* Runs the forward on a fresh tape and returns sum(out * R) in double, or NAN. */
static double projected_output(TestEnv *e, GradcheckFn fn, void *ctx, const GradcheckInput *inputs,
                               float *const *values, int n_inputs, float **proj, size_t *out_n,
                               Var ***vars_out, bool with_grad) {
    tape_reset(&e->tape);
    rng_init(&e->rng, 1234, RNG_STREAM_DROPOUT);
    e->tape.grad_enabled = with_grad;
    Var **vars = tape_alloc(&e->tape, (size_t)n_inputs * sizeof *vars);
    for (int i = 0; i < n_inputs; i++)
        vars[i] = test_var(e, values[i], inputs[i].ndim, inputs[i].shape, inputs[i].check);
    Var *out = fn(&e->tape, vars, ctx);
    if (!out) {
        fprintf(stderr, "\n  gradcheck: forward failed: %s\n", e->tape.err.msg);
        return NAN;
    }
    size_t n = var_numel(out);
    if (!*proj) {
        Rng r;
        rng_init(&r, 99, 7);
        *proj = malloc(n * sizeof(float));
        rng_fill_uniform(&r, *proj, n, -1.0f, 1.0f);
    }
    double acc = 0.0;
    for (size_t i = 0; i < n; i++) acc += (double)out->value.data[i] * (*proj)[i];
    if (out_n) *out_n = n;
    if (vars_out) *vars_out = vars;
    if (with_grad && tape_backward_from(&e->tape, out, *proj) != QT_OK) {
        fprintf(stderr, "\n  gradcheck: backward failed: %s\n", e->tape.err.msg);
        return NAN;
    }
    return acc;
}

bool gradcheck(const char *name, GradcheckFn fn, void *ctx, const GradcheckInput *inputs, int n_inputs,
               double eps, double atol, double rtol) {
    TestEnv e;
    test_env_init(&e, 1234);
    float *values[8] = {0};
    float *analytic[8] = {0};
    float *proj = NULL;
    bool ok = n_inputs <= 8;
    for (int i = 0; ok && i < n_inputs; i++) {
        Tensor t = {0};
        tensor_set_shape(&t, inputs[i].ndim, inputs[i].shape);
        size_t n = tensor_numel(&t);
        values[i] = malloc(n * sizeof(float));
        memcpy(values[i], inputs[i].data, n * sizeof(float));
    }
    /* Analytic gradients. */
    Var **vars = NULL;
    if (ok && isnan(projected_output(&e, fn, ctx, inputs, values, n_inputs, &proj, NULL, &vars, true))) ok = false;
    for (int i = 0; ok && i < n_inputs; i++) {
        if (!inputs[i].check) continue;
        size_t n = var_numel(vars[i]);
        analytic[i] = calloc(n, sizeof(float));
        if (vars[i]->grad) memcpy(analytic[i], vars[i]->grad, n * sizeof(float));
    }
    /* Numeric gradients, one element at a time. */
    for (int i = 0; ok && i < n_inputs; i++) {
        if (!inputs[i].check) continue;
        Tensor t = {0};
        tensor_set_shape(&t, inputs[i].ndim, inputs[i].shape);
        size_t n = tensor_numel(&t);
        for (size_t j = 0; j < n && ok; j++) {
            float x0 = values[i][j];
            values[i][j] = (float)(x0 + eps);
            double fp = projected_output(&e, fn, ctx, inputs, values, n_inputs, &proj, NULL, NULL, false);
            values[i][j] = (float)(x0 - eps);
            double fm = projected_output(&e, fn, ctx, inputs, values, n_inputs, &proj, NULL, NULL, false);
            values[i][j] = x0;
            /* The actual step taken in float, not the nominal 2*eps. */
            double h = (double)(float)(x0 + eps) - (double)(float)(x0 - eps);
            double num = (fp - fm) / h;
            double diff = fabs(num - analytic[i][j]);
            if (!(diff <= atol + rtol * fabs(num))) {
                fprintf(stderr, "\n  gradcheck %s: input %d element %zu: analytic %.7g numeric %.7g\n", name, i, j,
                        (double)analytic[i][j], num);
                ok = false;
            }
        }
    }
    for (int i = 0; i < n_inputs && i < 8; i++) {
        free(values[i]);
        free(analytic[i]);
    }
    free(proj);
    test_env_free(&e);
    return ok;
}

/* ---- files and messages -------------------------------------------------- */

char *test_tmpdir_new(void) {
    char *d = strdup("/tmp/qtrain-test-XXXXXX");
    if (d && mkdtemp(d)) return d;
    free(d);
    if (CU_get_current_test()) CU_FAIL_FATAL("mkdtemp /tmp/qtrain-test-XXXXXX failed");
    return NULL;
}

/* Depth first; lstat, so a link to a directory is removed, not followed. */
static bool remove_tree(const char *dir) {
    chmod(dir, 0700);
    DIR *dh = opendir(dir);
    bool ok = dh != NULL;
    struct dirent *e;
    while (dh && (e = readdir(dh))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        char *p = test_path_join(dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) ok = remove_tree(p) && ok;
        else ok = unlink(p) == 0 && ok;
        free(p);
    }
    if (dh) closedir(dh);
    return rmdir(dir) == 0 && ok;
}

bool test_tmpdir_remove(char *dir) {
    if (!dir) return true;
    bool ok = remove_tree(dir);
    free(dir);
    return ok;
}

char *test_path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

void test_file_write(const char *path, const void *buf, size_t n) {
    FILE *f = fopen(path, "wb");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    CU_ASSERT_EQUAL(fwrite(buf, 1, n, f), n);
    fclose(f);
}

char *test_file_read(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char *b = malloc(cap);
    for (size_t got; b && (got = fread(b + len, 1, cap - len - 1, f)) > 0;) {
        len += got;
        if (cap - len > 1) continue;
        char *nb = realloc(b, cap * 2);
        if (!nb) free(b);
        b = nb, cap *= 2;
    }
    fclose(f);
    if (!b) return NULL;
    b[len] = '\0';
    if (n) *n = len;
    return b;
}

bool test_file_copy(const char *src, const char *dst) {
    size_t n = 0;
    char *bytes = test_file_read(src, &n);
    if (bytes) test_file_write(dst, bytes, n);
    free(bytes);
    return bytes != NULL;
}

char *test_metrics_rows(const char *dir) {
    char *p = test_path_join(dir, "metrics.csv");
    char *text = p ? test_file_read(p, NULL) : NULL;
    free(p);
    if (!text) return NULL;
    char *o = text; /* in place: the rows only get shorter */
    int commas = 0;
    for (const char *s = text; *s; s++) {
        if (*s == '\n') commas = 0;
        else if (*s == ',' && ++commas >= 6) continue;
        if (commas < 6) *o++ = *s;
    }
    *o = '\0';
    return text;
}

bool test_file_exists(const char *dir, const char *name) {
    char *p = test_path_join(dir, name);
    bool ok = p && access(p, F_OK) == 0;
    free(p);
    return ok;
}

bool test_msg_has(const QtError *e, const char *what) {
    if (getenv("QT_TEST_SHOW_MSGS")) fprintf(stderr, "\n  [msg] %s\n", e->msg);
    if (strstr(e->msg, what)) return true;
    fprintf(stderr, "\n  message lacks \"%s\": %s\n", what, e->msg);
    return false;
}

void test_assert_hdf5_closed(void) {
    ssize_t n = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
    if (n != 0) fprintf(stderr, "\n  %zd HDF5 objects left open\n", n);
    CU_ASSERT_EQUAL(n, 0);
}

bool test_params_equal(const Model *a, const Model *b) {
    if (a->n_params != b->n_params) return false;
    for (int i = 0; i < a->n_params; i++) {
        size_t n = var_numel(&a->params[i].var);
        if (n != var_numel(&b->params[i].var) ||
            memcmp(a->params[i].var.value.data, b->params[i].var.value.data, n * sizeof(float)) != 0)
            return false;
    }
    return true;
}

void test_small_cnn(Model *m, uint64_t seed) {
    LayerSpec ls[3] = {{.type = LAYER_CONV2D, .out_channels = 4, .kernel = 3, .padding = 1},
                       {.type = LAYER_FLATTEN},
                       {.type = LAYER_DENSE, .units = 10}};
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(m, 3, (const int[]){2, 6, 6}, ls, 3, &err), QT_OK);
    Rng r;
    rng_init(&r, seed, RNG_STREAM_INIT);
    model_init_params(m, &r);
}

void test_assert_steady_steps(Model *m, Tape *t, Arena *a, const float *x, const float *dy, int steps) {
    const int xs[4] = {4, 2, 6, 6};
    size_t grows = 0, cap = 0;
    for (int step = 0; step < steps; step++) {
        tape_reset(t);
        Var *vx = tape_new_var(t, 4, xs);
        CU_ASSERT_FATAL(vx != NULL);
        memcpy(vx->value.data, x, sizeof(float) * 4 * 2 * 6 * 6);
        vx->requires_grad = true;
        Var *y = model_forward(m, t, vx);
        if (!y) fprintf(stderr, "\n  model_forward: %s\n", t->err.msg);
        CU_ASSERT_FATAL(y != NULL);
        CU_ASSERT_EQUAL_FATAL(tape_backward_from(t, y, dy), QT_OK);
        CU_ASSERT_PTR_NOT_NULL(vx->grad);
        if (step == 1) grows = a->grow_count, cap = t->cap_nodes;
    }
    CU_ASSERT(grows > 0);
    CU_ASSERT_EQUAL(a->grow_count, grows);
    CU_ASSERT_EQUAL(t->cap_nodes, cap);
}

/* ---- skipped tests ------------------------------------------------------- */

#define TEST_SKIPS_MAX 64

static char test_skips[TEST_SKIPS_MAX][512];
static int test_n_skips; /* may exceed TEST_SKIPS_MAX: the count stays right, the list keeps the first ones */

void test_skip(const char *fmt, ...) {
    CU_pTest t = CU_get_current_test();
    char reason[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    size_t n = strlen(reason);
    while (n > 0 && reason[n - 1] == '\n') reason[--n] = '\0';
    const char *name = t && t->pName ? t->pName : "(outside a test)";
    fprintf(stderr, "\n  %s: skipped: %s\n", name, reason);
    if (test_n_skips < TEST_SKIPS_MAX)
        snprintf(test_skips[test_n_skips], sizeof test_skips[0], "%s: %s", name, reason);
    test_n_skips++;
}

int test_skips_print(FILE *out) {
    if (test_n_skips == 0) return 0;
    fprintf(out, "\nskipped: %d (cannot run on this machine or in this build)\n", test_n_skips);
    for (int i = 0; i < test_n_skips && i < TEST_SKIPS_MAX; i++) fprintf(out, "  %s\n", test_skips[i]);
    if (test_n_skips > TEST_SKIPS_MAX) fprintf(out, "  ... and %d more\n", test_n_skips - TEST_SKIPS_MAX);
    return test_n_skips;
}

void test_int8_on_families(void (*run)(QGemmIsa), const QGemmIsa *families, int n, const char *what) {
    for (int i = 0; i < n; i++) {
        const QGemmIsa f = families[i];
        const char *name = f == QGEMM_ISA_AMX             ? "AMX"
                           : f == QGEMM_ISA_AVX512_VNNI ? "AVX-512 VNNI"
                           : f == QGEMM_ISA_AVXVNNI     ? "AVX-VNNI"
                           : f == QGEMM_ISA_AVX2        ? "AVX2"
                                                        : "portable C";
        if (f != QGEMM_ISA_PORTABLE && !qgemm_cpu_has_isa(f)) {
            test_skip("%s on %s: this CPU (or OS) has no %s", what, name, name);
            continue;
        }
        run(f);
    }
}

void test_expect_config_error(const char *file, int line, const char *yaml, const char *n1, const char *n2,
                              const char *n3) {
    Config *c = malloc(sizeof *c);
    QtError e = {0};
    QtStatus st = c ? config_load_string(c, yaml, "t.yaml", NULL, 0, &e) : QT_ERR_NOMEM;
    bool ok = st == QT_ERR_CONFIG && strstr(e.msg, n1) && (!n2 || strstr(e.msg, n2)) && (!n3 || strstr(e.msg, n3));
    if (!ok) fprintf(stderr, "\n  %s:%d: status %d, message: %s\n", file, line, st, e.msg);
    CU_assertImplementation(ok, (unsigned)line, "config error as expected", file, "", CU_FALSE);
    free(c);
}

float *test_random_uniform(size_t n, uint64_t seed, float lo, float hi) {
    float *x = malloc(n * sizeof(float));
    if (!x) return NULL;
    Rng r;
    rng_init(&r, seed, 7);
    rng_fill_uniform(&r, x, n, lo, hi);
    return x;
}

static char cli_log[PATH_MAX + 32];

int test_cli(const char *bin, const char *dir, const char *fmt, ...) {
    static int n;
    char args[4096], cmd[4096 + 2 * PATH_MAX + 64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cli_log, sizeof cli_log, "%s/cli-%d.log", dir, n++);
    snprintf(cmd, sizeof cmd, "OPENBLAS_NUM_THREADS=1 %s %s >%s 2>&1", bin, args, cli_log);
    fflush(NULL);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

const char *test_cli_log(void) { return cli_log; }

bool test_cli_log_has(const char *what) {
    char *text = test_file_read(cli_log, NULL);
    bool has = text && strstr(text, what);
    if (!has) fprintf(stderr, "\n  expected '%s' in the output of the command:\n%s\n", what, text ? text : "(none)");
    free(text);
    return has;
}

size_t test_forward_copy(Model *m, TestEnv *e, const float *x, int ndim, const int *shape, bool training, float *y,
                         size_t cap) {
    tape_reset(&e->tape);
    e->tape.training = training;
    e->tape.grad_enabled = false;
    Var *out = model_forward(m, &e->tape, test_var(e, x, ndim, shape, false));
    if (!out) fprintf(stderr, "\n  forward: %s\n", e->tape.err.msg);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    size_t n = var_numel(out);
    CU_ASSERT_FATAL(n <= cap);
    memcpy(y, out->value.data, n * sizeof(float));
    return n;
}

void test_model_step_reset(Model *m) {
    for (int i = 0; i < m->n_params; i++)
        memset(m->params[i].var.grad, 0, var_numel(&m->params[i].var) * sizeof(float));
    for (int i = 0; i < m->n_modules; i++)
        if (m->modules[i].bn.running_mean) {
            memset(m->modules[i].bn.running_mean, 0, (size_t)m->modules[i].out_shape[0] * sizeof(float));
            for (int ch = 0; ch < m->modules[i].out_shape[0]; ch++) m->modules[i].bn.running_var[ch] = 1.0f;
        }
}

static void step_result_add(TestStepResults *r, const float *src, size_t n) {
    CU_ASSERT_FATAL(r->count < TEST_STEP_RESULTS_MAX);
    r->n[r->count] = n;
    r->v[r->count] = malloc(n * sizeof(float));
    CU_ASSERT_PTR_NOT_NULL_FATAL(r->v[r->count]);
    memcpy(r->v[r->count++], src, n * sizeof(float));
}

void test_model_step_take(Model *m, TestEnv *e, Var *y, TestStepResults *r) {
    const size_t ny = var_numel(y);
    float *dy = malloc(ny * sizeof(float));
    CU_ASSERT_PTR_NOT_NULL_FATAL(dy);
    for (size_t i = 0; i < ny; i++) dy[i] = (float)(i % 5) - 2.0f;
    CU_ASSERT_FATAL(tape_backward_from(&e->tape, y, dy) == QT_OK);
    free(dy);
    r->count = 0;
    step_result_add(r, y->value.data, ny);
    for (int i = 0; i < m->n_params; i++) step_result_add(r, m->params[i].var.grad, var_numel(&m->params[i].var));
    for (int i = 0; i < m->n_modules; i++)
        if (m->modules[i].bn.running_var) {
            step_result_add(r, m->modules[i].bn.running_mean, (size_t)m->modules[i].out_shape[0]);
            step_result_add(r, m->modules[i].bn.running_var, (size_t)m->modules[i].out_shape[0]);
        }
}

void test_model_step_same(TestStepResults *a, TestStepResults *b, const char *what) {
    CU_ASSERT_EQUAL(a->count, b->count);
    for (int q = 0; q < a->count && q < b->count; q++) {
        const bool same = a->n[q] == b->n[q] && !memcmp(a->v[q], b->v[q], a->n[q] * sizeof(float));
        if (!same) fprintf(stderr, "\n  %s: result %d differs\n", what, q);
        CU_ASSERT(same);
    }
    for (int q = 0; q < a->count; q++) free(a->v[q]);
    for (int q = 0; q < b->count; q++) free(b->v[q]);
    a->count = b->count = 0;
}

LayerSpec test_layer(LayerType type, const char *name, const char *in0, const char *in1) {
    LayerSpec s = {.type = type, .eps = 1e-5f, .momentum = 0.1f, .out_channels = 4, .kernel = 3, .stride = 1,
                   .padding = 1, .no_bias = type == LAYER_CONV2D};
    snprintf(s.name, sizeof s.name, "%s", name);
    if (in0) snprintf(s.inputs[s.n_inputs++], MODULE_NAME_MAX, "%s", in0);
    if (in1) snprintf(s.inputs[s.n_inputs++], MODULE_NAME_MAX, "%s", in1);
    return s;
}
