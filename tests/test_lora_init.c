/* test_lora_init.c - the SVD adapter inits (lora/lora_svd.h): the truncated
 * SVD on known matrices, PiSSA's split and residual, LoftQ's iterations;
 * then end to end on the mini data set: loftq and pissa over float and
 * quantized bases, the report, resume, merge, and the config errors. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <CUnit/CUnit.h>

#include "lora/lora_svd.h"
#include "quant/qarray.h"
#include "quant/qarray_io.h"
#include "quant/qtype.h"
#include "test_proc.h"
#include "test_runs.h"
#include "test_util.h"
#include "base/safetensors.h"
#include "trainer/checkpoint.h"
#include "trainer/interop.h"
#include "trainer/net.h"
#include "trainer/tools.h"
#include "trainer/train.h"

/* ---- helpers ------------------------------------------------------------------------------------------------- */

static float *gaussian(size_t n, uint64_t seed) {
    float *x = malloc(n * sizeof *x);
    Rng r;
    rng_init(&r, seed, 11);
    rng_fill_normal(&r, x, n, 0.0f, 1.0f);
    return x;
}

/* A random orthogonal n x n matrix (row-major): the product of three Householder reflections. */
static void orthogonal(double *q, int n, uint64_t seed) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) q[i * n + j] = i == j;
    float *v = gaussian((size_t)n * 3, seed);
    for (int h = 0; h < 3; h++) {
        const float *vh = v + h * n;
        double vv = 0;
        for (int i = 0; i < n; i++) vv += (double)vh[i] * vh[i];
        for (int i = 0; i < n; i++) { /* q = q (I - 2 v v^T / v^T v), row by row */
            double d = 0;
            for (int k = 0; k < n; k++) d += q[i * n + k] * vh[k];
            for (int k = 0; k < n; k++) q[i * n + k] -= 2.0 * d * vh[k] / vv;
        }
    }
    free(v);
}

/* m [rows * cols] = U[:, :k] diag(s) V[:, :k]^T with random orthogonal U, V; returns U (rows x rows) and V. */
static float *known_matrix(int rows, int cols, const double *s, int k, double *u, double *v) {
    orthogonal(u, rows, 3);
    orthogonal(v, cols, 4);
    float *m = malloc((size_t)rows * cols * sizeof *m);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            double x = 0;
            for (int t = 0; t < k; t++) x += u[i * rows + t] * s[t] * v[j * cols + t];
            m[i * cols + j] = (float)x;
        }
    return m;
}

/* ||x - y|| / ||y|| */
static double rel_diff(const double *x, const double *y, size_t n) {
    double e = 0, w = 0;
    for (size_t i = 0; i < n; i++) e += (x[i] - y[i]) * (x[i] - y[i]), w += y[i] * y[i];
    return sqrt(e / w);
}

static void check_known(int rows, int cols, const double *s, int k, int r) {
    double *u = malloc((size_t)rows * rows * sizeof *u), *v = malloc((size_t)cols * cols * sizeof *v);
    float *m = known_matrix(rows, cols, s, k, u, v);
    double *uu = malloc((size_t)rows * r * sizeof *uu), *ss = malloc((size_t)r * sizeof *ss),
           *vt = malloc((size_t)r * cols * sizeof *vt);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(lora_svd_truncated(m, rows, cols, r, uu, ss, vt, &err), QT_OK);
    for (int t = 0; t < r; t++) {
        double want = t < k ? s[t] : 0.0;
        CU_ASSERT(fabs(ss[t] - want) < 1e-5 * s[0]);
        if (t > 0) CU_ASSERT(ss[t] <= ss[t - 1]);
        if (t >= k || (t + 1 < k && s[t + 1] == s[t])) continue;
        /* a distinct singular value: its vectors are U's and V's column, up to a shared sign */
        double du = 0, dv = 0;
        for (int i = 0; i < rows; i++) du += uu[i * r + t] * u[i * rows + t];
        for (int j = 0; j < cols; j++) dv += vt[t * cols + j] * v[j * cols + t];
        CU_ASSERT(fabs(fabs(du) - 1.0) < 1e-5);
        CU_ASSERT(fabs(du * dv - 1.0) < 1e-5);
    }
    /* rank r >= k: U_r S_r V_r^T gives the matrix back */
    if (r >= k) {
        double *back = calloc((size_t)rows * cols, sizeof *back), *md = malloc((size_t)rows * cols * sizeof *md);
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < cols; j++) {
                for (int t = 0; t < r; t++) back[i * cols + j] += uu[i * r + t] * ss[t] * vt[t * cols + j];
                md[i * cols + j] = m[i * cols + j];
            }
        CU_ASSERT(rel_diff(back, md, (size_t)rows * cols) < 1e-6);
        free(back), free(md);
    }
    free(u), free(v), free(m), free(uu), free(ss), free(vt);
}

static void test_svd_known(void) {
    const double s[] = {5.0, 3.0, 2.0, 1.0};
    check_known(6, 6, s, 4, 4);  /* square, full rank of its construction */
    check_known(9, 4, s, 4, 4);  /* tall */
    check_known(4, 9, s, 4, 3);  /* wide, truncated */
    const double low[] = {4.0, 1.0};
    check_known(7, 5, low, 2, 4); /* rank-deficient: singular values 3 and 4 are 0 */
    check_known(5, 8, low, 2, 2);
    /* sizes outside 1..min(rows, cols) */
    float m[6] = {1, 2, 3, 4, 5, 6};
    double u[6], sv[3], vt[9];
    QtError err = {0};
    CU_ASSERT_EQUAL(lora_svd_truncated(m, 2, 3, 3, u, sv, vt, &err), QT_ERR_ARG);
    CU_ASSERT_EQUAL(lora_svd_truncated(m, 2, 3, 0, u, sv, vt, &err), QT_ERR_ARG);
}

/* s B A in double */
static void lowrank(const float *a, const float *b, int out, int fan_in, int r, float scale, double *l) {
    for (int i = 0; i < out; i++)
        for (int j = 0; j < fan_in; j++) {
            double x = 0;
            for (int k = 0; k < r; k++) x += (double)b[i * r + k] * a[k * fan_in + j];
            l[i * fan_in + j] = scale * x;
        }
}

static void test_pissa_float(void) {
    const int out = 12, fan_in = 20, r = 3;
    const float scale = 2.0f;
    float *w = gaussian((size_t)out * fan_in, 21), *a = malloc(r * fan_in * sizeof *a),
          *b = malloc(out * r * sizeof *b), *base = malloc(out * fan_in * sizeof *base);
    LoraInitReport rep;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(lora_svd_init(w, out, fan_in, r, scale, 0, NULL, NULL, a, b, base, &rep, &err), QT_OK);
    /* s B A is the rank-r truncated SVD of W */
    double u[12 * 3], sv[3], vt[3 * 20], svd[12 * 20], l[12 * 20];
    CU_ASSERT_EQUAL_FATAL(lora_svd_truncated(w, out, fan_in, r, u, sv, vt, &err), QT_OK);
    for (int i = 0; i < out; i++)
        for (int j = 0; j < fan_in; j++) {
            svd[i * fan_in + j] = 0;
            for (int k = 0; k < r; k++) svd[i * fan_in + j] += u[i * r + k] * sv[k] * vt[k * fan_in + j];
        }
    lowrank(a, b, out, fan_in, r, scale, l);
    CU_ASSERT(rel_diff(l, svd, (size_t)out * fan_in) < 1e-6);
    /* the split is symmetric: A A^T = B^T B = S_r / s */
    for (int p = 0; p < r; p++)
        for (int q = 0; q < r; q++) {
            double aa = 0, bb = 0;
            for (int j = 0; j < fan_in; j++) aa += (double)a[p * fan_in + j] * a[q * fan_in + j];
            for (int i = 0; i < out; i++) bb += (double)b[i * r + p] * b[i * r + q];
            double want = p == q ? sv[p] / scale : 0.0;
            CU_ASSERT(fabs(aa - want) < 1e-5 * sv[0] && fabs(bb - want) < 1e-5 * sv[0]);
        }
    /* base + s B A = W up to rounding; the default's error is 0 on a float base */
    double back[12 * 20], wd[12 * 20];
    for (int i = 0; i < out * fan_in; i++) back[i] = base[i] + l[i], wd[i] = w[i];
    CU_ASSERT(rel_diff(back, wd, (size_t)out * fan_in) < 1e-5);
    CU_ASSERT(rep.rel_error < 1e-6);
    CU_ASSERT_EQUAL(rep.default_rel_error, 0.0);
    CU_ASSERT_EQUAL(rep.iters, 0);
    /* LoftQ needs a quantizer */
    CU_ASSERT_EQUAL(lora_svd_init(w, out, fan_in, r, scale, 2, NULL, NULL, a, b, base, &rep, &err), QT_ERR_ARG);
    free(w), free(a), free(b), free(base);
}

/* A per-row quantizer of an (out, fan_in) matrix in one format, keeping its last result (the "stored base"). */
typedef struct {
    const QType *qt;
    int out, fan_in;
    QArray last;
    int calls;
} RowQuant;

static QtStatus row_quantize(void *ctx, const float *target, float *deq, QtError *err) {
    RowQuant *q = ctx;
    qarray_free(&q->last);
    QArrayOptions o = {.n_channelwise = 1, .channelwise_axes = {0}};
    QtStatus st = qarray_quantize(&q->last, target, 2, (const int[]){q->out, q->fan_in}, q->qt, &o, err);
    if (st == QT_OK) qarray_dequantize(&q->last, deq);
    q->calls++;
    return st;
}

/* LoftQ on a random W: below the default from iteration 1, never rising, and the base the quantizer's last result. */
static void check_loftq(const char *qtype, int iters) {
    const int out = 32, fan_in = 48, r = 4;
    const float scale = 2.0f;
    QtError err = {0};
    RowQuant q = {.qt = qtype_find(qtype, &err), .out = out, .fan_in = fan_in};
    CU_ASSERT_PTR_NOT_NULL_FATAL(q.qt);
    float *w = gaussian((size_t)out * fan_in, 31), *a = malloc(r * fan_in * sizeof *a),
          *b = malloc(out * r * sizeof *b), *base = malloc(out * fan_in * sizeof *base),
          *stored = malloc(out * fan_in * sizeof *stored);
    LoraInitReport rep;
    CU_ASSERT_EQUAL_FATAL(lora_svd_init(w, out, fan_in, r, scale, iters, row_quantize, &q, a, b, base, &rep, &err),
                          QT_OK);
    CU_ASSERT(rep.iters >= 1 && rep.iters <= iters);
    /* the first iteration is already below the default (B = 0 over quantize(W)), by the SVD of the residual */
    CU_ASSERT(rep.iter_error[0] < rep.default_rel_error);
    for (int t = 1; t < rep.iters; t++) CU_ASSERT(rep.iter_error[t] <= rep.iter_error[t - 1]);
    CU_ASSERT_EQUAL(rep.rel_error, rep.iter_error[rep.iters - 1]);
    /* the base left is the quantizer's last result (what a layer would store), and the error is of it */
    qarray_dequantize(&q.last, stored);
    CU_ASSERT(memcmp(stored, base, (size_t)out * fan_in * sizeof *base) == 0);
    double *l = malloc((size_t)out * fan_in * sizeof *l), e = 0, n = 0;
    lowrank(a, b, out, fan_in, r, scale, l);
    for (int i = 0; i < out * fan_in; i++) {
        double d = w[i] - stored[i] - l[i];
        e += d * d, n += (double)w[i] * w[i];
    }
    CU_ASSERT(fabs(sqrt(e / n) - rep.rel_error) < 1e-9);
    qarray_free(&q.last);
    free(w), free(a), free(b), free(base), free(stored), free(l);
}

static void test_loftq_iterations(void) {
    check_loftq("int4", 5);
    check_loftq("int2", 5);
    check_loftq("int2", 1);
    check_loftq("int3", 8);
}

/* ---- end to end --------------------------------------------------------------------------------------------- */

static TestRuns runs;

static int suite_init(void) { return test_runs_init(&runs); }
static int suite_cleanup(void) { return test_runs_cleanup(&runs); }

/* tiny-qlora.yaml (nf4 conv1 blocks of 8, fc1 blocks of 64 double-quantized, rank 4) with an int4 base in the same
 * blocks, lora.init `init` */
#define COUNT(a) ((int)(sizeof(a) / sizeof *(a)))
#define INT4 "quant.rules.0.weight_qtype=int4", "quant.rules.1.weight_qtype=int4"
#define FLOAT_BASE "quant.mode=none", "quant.rules=[]"

static Config *cfg(const char *sub, const char *const *extra, int n) {
    return test_runs_config(&runs, "tests/configs/tiny-qlora.yaml", sub, extra, n);
}

static void run_ok(const Config *c, const char *resume, int64_t stop_at, TrainResult *r) {
    QtError err = {0};
    QtStatus st = test_runs_train(c, resume, stop_at, r, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s: %s\n", c->source, err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
}

static bool qarrays_equal(const QArray *a, const QArray *b) {
    QArrayBlob ba[QARRAY_MAX_BLOBS], bb[QARRAY_MAX_BLOBS];
    int na = qarray_blobs(a, ba), nb = qarray_blobs(b, bb);
    if (na != nb) return false;
    for (int i = 0; i < na; i++) {
        size_t size = ba[i].type == QARRAY_BLOB_U8 ? 1 : ba[i].type == QARRAY_BLOB_U16 ? 2 : 4;
        if (ba[i].count != bb[i].count || memcmp(ba[i].data, bb[i].data, ba[i].count * size) != 0) return false;
    }
    return true;
}

/* Every model parameter, adapter and quantized base weight of two checkpoints equal bit for bit. */
static void assert_same_run(const Config *c, const char *x, const char *y) {
    Net a, b;
    test_runs_load_net(&a, c, x);
    test_runs_load_net(&b, c, y);
    for (int i = 0; i < a.model.n_params; i++) { /* the float ones: a float base, biases, the head */
        const Param *p = &a.model.params[i], *q = &b.model.params[i];
        if (p->released) continue;
        CU_ASSERT(memcmp(p->var.value.data, q->var.value.data, var_numel(&p->var) * 4) == 0);
    }
    CU_ASSERT(net_hook_count(&a, &HOOK_LORA) == 2);
    for (int i = 0; i < net_hook_count(&a, &HOOK_LORA); i++) {
        const LoraAdapter *p = net_adapter(&a, i), *q = net_adapter(&b, i);
        CU_ASSERT(memcmp(p->A.var.value.data, q->A.var.value.data, var_numel(&p->A.var) * 4) == 0);
        CU_ASSERT(memcmp(p->B.var.value.data, q->B.var.value.data, var_numel(&p->B.var) * 4) == 0);
        CU_ASSERT(p->init_reported && q->init_reported && p->init_rel_error == q->init_rel_error);
    }
    for (int i = 0; i < net_hook_count(&a, &HOOK_PTQ); i++)
        CU_ASSERT(qarrays_equal(&net_qlayer(&a, i)->weight, &net_qlayer(&b, i)->weight));
    net_free(&a), net_free(&b);
}

/* Straight through, and stopped at step 11 then resumed: the same final state. */
static void check_resume(const char *sub, const char *const *extra, int n) {
    char straight[64], split[64];
    snprintf(straight, sizeof straight, "%s-straight", sub);
    snprintf(split, sizeof split, "%s-split", sub);
    Config *a = cfg(straight, extra, n), *b = cfg(split, extra, n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(a);
    CU_ASSERT_PTR_NOT_NULL_FATAL(b);
    TrainResult ra, rb;
    run_ok(a, NULL, 0, &ra);
    run_ok(b, NULL, 11, &rb);
    run_ok(b, "auto", 0, &rb);
    CU_ASSERT_EQUAL(ra.test_accuracy, rb.test_accuracy);
    CU_ASSERT_EQUAL(ra.test_loss, rb.test_loss);
    char pa[1200], pb[1200];
    snprintf(pa, sizeof pa, "%s", test_runs_path(&runs, straight, "final.h5"));
    snprintf(pb, sizeof pb, "%s", test_runs_path(&runs, split, "final.h5"));
    assert_same_run(a, pa, pb);
    free(a), free(b);
}

static void test_resume_loftq_qlora(void) {
    const char *ov[] = {INT4, "lora.init=loftq", "lora.loftq_iters=3"};
    check_resume("rl", ov, COUNT(ov));
}

static void test_resume_pissa_float(void) {
    const char *ov[] = {FLOAT_BASE, "lora.init=pissa"};
    check_resume("rp", ov, COUNT(ov));
}

/* LoftQ adapters go on from their run's checkpoint (their base) with init default: the same model, the same base
 * identity (lora.strict_base would refuse another). */
static void test_continue_loftq(void) {
    char init[1300], from[1300], ck[1200];
    snprintf(ck, sizeof ck, "%s", test_runs_path(&runs, "rl-straight", "final.h5"));
    snprintf(init, sizeof init, "model.init_from=%s", ck);
    snprintf(from, sizeof from, "model.adapters_from=%s", test_runs_path(&runs, "rl-straight", "adapters.h5"));
    const char *ov[] = {INT4, init, from, "lora.strict_base=true"};
    Config *c = cfg("cont", ov, COUNT(ov));
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    Net a, b;
    QtError err = {0};
    QtStatus st = net_build(&a, c, NET_FRESH, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    test_runs_load_net(&b, c, ck);
    for (int i = 0; i < net_hook_count(&a, &HOOK_LORA); i++) {
        const LoraAdapter *p = net_adapter(&a, i), *q = net_adapter(&b, i);
        CU_ASSERT(memcmp(p->A.var.value.data, q->A.var.value.data, var_numel(&p->A.var) * 4) == 0);
        CU_ASSERT(memcmp(p->B.var.value.data, q->B.var.value.data, var_numel(&p->B.var) * 4) == 0);
        CU_ASSERT(!p->init_reported); /* this run's init is default: no loftq residuals under its name */
    }
    for (int i = 0; i < net_hook_count(&a, &HOOK_PTQ); i++)
        CU_ASSERT(qarrays_equal(&net_qlayer(&a, i)->weight, &net_qlayer(&b, i)->weight));
    net_free(&a), net_free(&b);
    free(c);
}

/* The value after `key` in text, or NAN. */
static double value_after(const char *text, const char *key) {
    const char *p = text ? strstr(text, key) : NULL;
    return p ? strtod(p + strlen(key), NULL) : NAN;
}

/* The binary: the report line per module at the start, in summary.json; rel_error below the default's. */
static void test_report_loftq_and_pissa(void) {
    static const char *const inits[] = {"loftq", "pissa"};
    for (int k = 0; k < 2; k++) {
        char sub[32], out[1200], init_from[1200], init[64];
        snprintf(sub, sizeof sub, "report-%s", inits[k]);
        snprintf(out, sizeof out, "run.out_dir=%s", test_runs_path(&runs, sub, ""));
        snprintf(init_from, sizeof init_from, "model.init_from=%s", runs.base_ckpt);
        snprintf(init, sizeof init, "lora.init=%s", inits[k]);
        char log[1200];
        snprintf(log, sizeof log, "%s.log", test_runs_path(&runs, "", sub));
        const char *args[] = {"--config", "tests/configs/tiny-qlora.yaml", "--set", out, "--set", init_from, "--set",
                              "quant.rules.0.weight_qtype=int4", "--set", "quant.rules.1.weight_qtype=int4", "--set",
                              init, "--set", "lora.loftq_iters=4", "--set", "train.steps=8", NULL};
        CU_ASSERT_EQUAL_FATAL(test_proc_run(log, args, 120.0), 0);
        char *text = test_file_read(log, NULL);
        CU_ASSERT_PTR_NOT_NULL_FATAL(text);
        char want[128];
        snprintf(want, sizeof want, "lora_init: module=fc1 init=%s iters=", inits[k]);
        const char *line = strstr(text, want);
        CU_ASSERT_PTR_NOT_NULL_FATAL(line);
        int iters = (int)value_after(line, "iters=");
        CU_ASSERT(k == 0 ? iters >= 1 && iters <= 4 : iters == 0);
        CU_ASSERT(strstr(text, "lora_init: module=conv1 init=") != NULL);
        double e = value_after(line, " rel_error="), d = value_after(line, "default_rel_error=");
        CU_ASSERT(e > 0.0 && d > 0.0 && e < d);
        if (k == 0) CU_ASSERT(strstr(line, " iter_errors=") != NULL);
        char *summary = test_file_read(test_runs_path(&runs, sub, "summary.json"), NULL);
        CU_ASSERT_PTR_NOT_NULL_FATAL(summary);
        snprintf(want, sizeof want, "\"lora_init_fc1\": \"%s\"", inits[k]);
        CU_ASSERT(strstr(summary, want) != NULL);
        double se = value_after(summary, "\"lora_init_rel_error_fc1\": ");
        CU_ASSERT(fabs(se - e) <= 1e-5 * e);
        free(text), free(summary);
    }
    /* qtrain quantize reports what the inits would make of the base it writes */
    char log[1200], qout[1200];
    snprintf(log, sizeof log, "%s", test_runs_path(&runs, "", "quantize.log"));
    snprintf(qout, sizeof qout, "%s", test_runs_path(&runs, "", "quantized.h5"));
    const char *args[] = {"quantize", "--config", "tests/configs/tiny-qlora.yaml", "--checkpoint", runs.base_ckpt,
                          "--out", qout, "--set", "quant.rules.0.weight_qtype=int4", "--set",
                          "quant.rules.1.weight_qtype=int4", "--set", "lora.init=loftq", NULL};
    CU_ASSERT_EQUAL_FATAL(test_proc_run(log, args, 120.0), 0);
    char *text = test_file_read(log, NULL);
    CU_ASSERT(text && strstr(text, "lora_init: module=conv1 init=loftq iters=") &&
              strstr(text, "lora_init: module=fc1 init=loftq iters="));
    free(text);
}

/* A PiSSA base is the residual: its checkpoint's base differs from the default run's, and so does its identity. */
static void test_pissa_base_identity(void) {
    const char *steps0[] = {FLOAT_BASE, "train.steps=0", "train.epochs=0", "lora.init=pissa"};
    const char *dflt[] = {FLOAT_BASE, "train.steps=0", "train.epochs=0"};
    Config *p = cfg("id-pissa", steps0, COUNT(steps0)), *d = cfg("id-default", dflt, COUNT(dflt));
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    CU_ASSERT_PTR_NOT_NULL_FATAL(d);
    TrainResult r;
    run_ok(p, NULL, 0, &r);
    run_ok(d, NULL, 0, &r);
    CheckpointProvenance *a = malloc(sizeof *a), *b = malloc(sizeof *b);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_read_provenance(test_runs_path(&runs, "id-pissa", "adapters.h5"), a, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(checkpoint_read_provenance(test_runs_path(&runs, "id-default", "adapters.h5"), b, &err),
                          QT_OK);
    CU_ASSERT(a->base_sha256[0] && b->base_sha256[0] && strcmp(a->base_sha256, b->base_sha256) != 0);
    free(a), free(b), free(p), free(d);
}

/* Float-base PiSSA: merging before training gives W back; after training, the merged model is the unmerged one. */
static void test_pissa_merge(void) {
    const char *steps0[] = {FLOAT_BASE, "train.steps=0", "train.epochs=0", "lora.init=pissa"};
    const char *trained[] = {FLOAT_BASE, "lora.init=pissa"};
    Config *c0 = cfg("m-pissa0", steps0, COUNT(steps0)), *c = cfg("m-pissa", trained, COUNT(trained));
    CU_ASSERT_PTR_NOT_NULL_FATAL(c0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainResult r;
    run_ok(c0, NULL, 0, &r);
    MergeReport rep;
    QtError err = {0};
    char merged[1200];
    snprintf(merged, sizeof merged, "%s", test_runs_path(&runs, "m-pissa0", "merged.h5"));
    CU_ASSERT_EQUAL_FATAL(tools_merge(test_runs_path(&runs, "m-pissa0", "final.h5"), merged, false, false, NULL, &rep,
                                      &err), QT_OK);
    CU_ASSERT_EQUAL(rep.modules, 2);
    /* the merged weights are the original base's within float rounding; the residual alone is not */
    Model w, m, res;
    const LayerSpec *L = c0->model.layers;
    CU_ASSERT_EQUAL_FATAL(model_init(&w, c0->model.input_ndim, c0->model.input_shape, L, c0->model.n_layers, &err),
                          QT_OK);
    CU_ASSERT_EQUAL_FATAL(model_init(&m, c0->model.input_ndim, c0->model.input_shape, L, c0->model.n_layers, &err),
                          QT_OK);
    CU_ASSERT_EQUAL_FATAL(model_init(&res, c0->model.input_ndim, c0->model.input_shape, L, c0->model.n_layers, &err),
                          QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(runs.base_ckpt, &w, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(merged, &m, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(test_runs_path(&runs, "m-pissa0", "final.h5"), &res, &err), QT_OK);
    const char *names[] = {"conv1/weight", "fc1/weight"};
    for (int k = 0; k < 2; k++) {
        const Param *pw = model_find_param(&w, names[k]), *pm = model_find_param(&m, names[k]),
                    *pr = model_find_param(&res, names[k]);
        size_t n = var_numel(&pw->var);
        double *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y), *z = malloc(n * sizeof *z);
        for (size_t i = 0; i < n; i++)
            x[i] = pm->var.value.data[i], y[i] = pw->var.value.data[i], z[i] = pr->var.value.data[i];
        CU_ASSERT(rel_diff(x, y, n) < 1e-5);
        CU_ASSERT(rel_diff(z, y, n) > 0.1);
        free(x), free(y), free(z);
    }
    model_free(&w), model_free(&m), model_free(&res);
    /* trained: merged = unmerged up to float rounding */
    run_ok(c, NULL, 0, &r);
    snprintf(merged, sizeof merged, "%s", test_runs_path(&runs, "m-pissa", "merged.h5"));
    CU_ASSERT_EQUAL_FATAL(tools_merge(test_runs_path(&runs, "m-pissa", "final.h5"), merged, false, false, NULL, &rep,
                                      &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(rep.mode, "float");
    CU_ASSERT_EQUAL(rep.weight_rel_rmse, 0.0);
    CU_ASSERT(fabs(rep.test_accuracy_after - rep.test_accuracy_before) <= 0.002);
    CU_ASSERT(fabs(rep.test_loss_after - rep.test_loss_before) < 1e-3);
    /* the PEFT export's base is the residual the adapters belong to: base + s B A is the merged weight */
    char dir[1200], final[1200];
    snprintf(dir, sizeof dir, "%s", test_runs_path(&runs, "m-pissa", "peft"));
    snprintf(final, sizeof final, "%s", test_runs_path(&runs, "m-pissa", "final.h5"));
    CU_ASSERT_EQUAL_FATAL(interop_export_peft(final, dir, false, NULL, &err), QT_OK);
    Model fm, mm;
    CU_ASSERT_EQUAL_FATAL(model_init(&fm, c->model.input_ndim, c->model.input_shape, L, c->model.n_layers, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(model_init(&mm, c->model.input_ndim, c->model.input_shape, L, c->model.n_layers, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(final, &fm, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(merged, &mm, &err), QT_OK);
    StFile bf, af;
    char path[1300];
    snprintf(path, sizeof path, "%s/base_model.safetensors", dir);
    CU_ASSERT_EQUAL_FATAL(st_open(&bf, path, &err), QT_OK);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    CU_ASSERT_EQUAL_FATAL(st_open(&af, path, &err), QT_OK);
    const Param *res_w = model_find_param(&fm, "fc1/weight"), *mer_w = model_find_param(&mm, "fc1/weight");
    const int out = 32, fan_in = 1568, rk = 4;
    float *bw = malloc((size_t)out * fan_in * sizeof *bw), *a = malloc((size_t)rk * fan_in * sizeof *a),
          *b = malloc((size_t)out * rk * sizeof *b);
    const StTensor *tw = st_find(&bf, "fc1.weight"), *ta = st_find(&af, "base_model.model.fc1.lora_A.weight"),
                   *tb = st_find(&af, "base_model.model.fc1.lora_B.weight");
    CU_ASSERT_FATAL(tw && ta && tb);
    CU_ASSERT_EQUAL(st_read_f32(&bf, tw, bw, (size_t)out * fan_in, &err), QT_OK);
    CU_ASSERT_EQUAL(st_read_f32(&af, ta, a, (size_t)rk * fan_in, &err), QT_OK);
    CU_ASSERT_EQUAL(st_read_f32(&af, tb, b, (size_t)out * rk, &err), QT_OK);
    CU_ASSERT(memcmp(bw, res_w->var.value.data, (size_t)out * fan_in * sizeof *bw) == 0);
    double *l = malloc((size_t)out * fan_in * sizeof *l), *want = malloc((size_t)out * fan_in * sizeof *want);
    lowrank(a, b, out, fan_in, rk, 8.0f / 4.0f, l); /* tiny-qlora.yaml: alpha 8, rank 4 */
    for (int i = 0; i < out * fan_in; i++) l[i] += bw[i], want[i] = mer_w->var.value.data[i];
    CU_ASSERT(rel_diff(l, want, (size_t)out * fan_in) < 1e-6);
    st_close(&bf), st_close(&af);
    free(bw), free(a), free(b), free(l), free(want);
    model_free(&fm), model_free(&mm);
    /* a float export of the base alone (no --merge) would be the residual, no model: refused, naming the ways out */
    snprintf(path, sizeof path, "%s", test_runs_path(&runs, "m-pissa", "base.safetensors"));
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(interop_export(final, "safetensors", path, false, false, NULL, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "init pissa") && test_msg_has(&err, "--merge") && test_msg_has(&err, "peft"));
    CU_ASSERT(access(path, F_OK) != 0);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(interop_export(final, "safetensors", path, true, false, NULL, &err), QT_OK);
    free(c0), free(c);
}

/* PiSSA over a quantized base trains, and its base is not the plain quantized one. */
static void test_pissa_qlora(void) {
    const char *ov[] = {INT4, "lora.init=pissa", "train.steps=8"};
    const char *dflt[] = {INT4, "train.steps=0", "train.epochs=0"};
    Config *c = cfg("pq", ov, COUNT(ov)), *d = cfg("pq-default", dflt, COUNT(dflt));
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(d);
    TrainResult r;
    run_ok(c, NULL, 0, &r);
    CU_ASSERT_STRING_EQUAL(r.mode, "qlora");
    CU_ASSERT(isfinite(r.test_loss));
    run_ok(d, NULL, 0, &r);
    Net a, b;
    test_runs_load_net(&a, c, test_runs_path(&runs, "pq", "final.h5"));
    test_runs_load_net(&b, d, test_runs_path(&runs, "pq-default", "final.h5"));
    for (int i = 0; i < net_hook_count(&a, &HOOK_PTQ); i++)
        CU_ASSERT(!qarrays_equal(&net_qlayer(&a, i)->weight, &net_qlayer(&b, i)->weight));
    net_free(&a), net_free(&b);
    free(c), free(d);
}

/* DoRA over a pissa or loftq init: its magnitude starts at the norms of the fitted W + s B A, so the gain is 1; on
 * a float base pissa's base + s B A is W, so the fresh model evaluates as the default init's (float rounding); over
 * int4, loftq's start is nearer the float model than the default's. */
static void test_dora_with_svd_inits(void) {
    const char *pf[] = {FLOAT_BASE, "lora.rules.0.dora=true", "lora.init=pissa", "train.steps=0", "train.epochs=0"};
    const char *df[] = {FLOAT_BASE, "lora.rules.0.dora=true", "train.steps=0", "train.epochs=0"};
    const char *lq[] = {INT4, "lora.rules.0.dora=true", "lora.init=loftq", "train.steps=0", "train.epochs=0"};
    const char *dq[] = {INT4, "lora.rules.0.dora=true", "train.steps=0", "train.epochs=0"};
    const char *const *ovs[4] = {pf, df, lq, dq};
    const int ns[4] = {COUNT(pf), COUNT(df), COUNT(lq), COUNT(dq)};
    const char *subs[4] = {"dora-pissa", "dora-default", "dora-loftq", "dora-int4"};
    TrainResult r[4];
    for (int k = 0; k < 4; k++) {
        Config *c = cfg(subs[k], ovs[k], ns[k]);
        CU_ASSERT_PTR_NOT_NULL_FATAL(c);
        run_ok(c, NULL, 0, &r[k]);
        free(c);
    }
    CU_ASSERT(fabs(r[0].test_loss - r[1].test_loss) <= 1e-5 * fabs(r[1].test_loss));
    CU_ASSERT_DOUBLE_EQUAL(r[0].test_accuracy, r[1].test_accuracy, 1e-9);
    CU_ASSERT(fabs(r[2].test_loss - r[1].test_loss) < fabs(r[3].test_loss - r[1].test_loss));
}

static void expect_error(const char *sub, const char *const *ov, int n, const char *a, const char *b) {
    Config *c = cfg(sub, ov, n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainResult r;
    QtError err = {0};
    CU_ASSERT_EQUAL(test_runs_train(c, NULL, 0, &r, &err), QT_ERR_CONFIG);
    if (!test_msg_has(&err, a) || !test_msg_has(&err, b)) {
        fprintf(stderr, "\n  unexpected message: %s\n", err.msg);
        CU_FAIL("message");
    }
    free(c);
}

#define LORA_YAML(extra, rule)                                                                                      \
    "model:\n  input: [4, 8, 8]\n  layers:\n    - {name: c, type: conv2d, out_channels: 4, kernel: 3, groups: 2}\n" \
    "    - {type: flatten}\n    - {name: fc, type: dense, units: 3}\n"                                               \
    "lora:\n" extra "  rules:\n    - {module_path: " rule "}\n"

static void test_bad_inputs(void) {
    /* loftq without a quantized base: at the rule, naming the module and the way out */
    const char *float_loftq[] = {FLOAT_BASE, "lora.init=loftq"};
    expect_error("e-loftq", float_loftq, COUNT(float_loftq), "tiny-qlora.yaml:33:7: lora.rules[0]: conv1: lora init loftq",
                 "use init pissa, or add a quant rule");
    /* pissa / loftq with model.adapters_from: refused, not silently skipped */
    char from[1200];
    snprintf(from, sizeof from, "model.adapters_from=%s", test_runs_path(&runs, "rl-split", "adapters.h5"));
    const char *with_from[] = {INT4, from, "lora.init=loftq"};
    expect_error("e-from", with_from, COUNT(with_from), "tiny-qlora.yaml:33:7", "model.adapters_from loads trained ones");
    /* a base model.init_from holds quantized (qtrain quantize's file, written by the report test): no float W */
    char qfrom[1300];
    snprintf(qfrom, sizeof qfrom, "model.init_from=%s", test_runs_path(&runs, "", "quantized.h5"));
    const char *stored[] = {INT4, qfrom, "lora.init=loftq"};
    expect_error("e-stored", stored, COUNT(stored), "tiny-qlora.yaml:33:7: lora.rules[0]: conv1: lora init loftq needs the float",
                 "model.init_from holds it quantized");
    /* qat: the base weight trains quantized */
    const char *qat[] = {"quant.mode=qat", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]",
                         "lora.init=pissa"};
    expect_error("e-qat", qat, COUNT(qat), "lora.rules[0]: conv1: lora init pissa changes the base weight",
                 "quant.mode qat");
    /* the config: iterations, names, file:line */
    test_expect_config_error(__FILE__, __LINE__, LORA_YAML("  loftq_iters: 0\n", "fc, rank: 2"), "t.yaml:8:",
                             "lora.loftq_iters", "[1, 100]");
    test_expect_config_error(__FILE__, __LINE__, LORA_YAML("  init: lofq\n", "fc, rank: 2"), "t.yaml:8:",
                             "lora.init", "loftq");
    test_expect_config_error(__FILE__, __LINE__, LORA_YAML("", "fc, rank: 2, init: pisa"), "t.yaml:9:",
                             "lora.rules[0].init", "pissa");
    /* a grouped conv: refused at the rule (the section's init reaches the rule) */
    Config *c = malloc(sizeof *c);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(config_load_string(c, LORA_YAML("  init: pissa\n", "c, rank: 2"), "t.yaml", NULL, 0, &err),
                          QT_OK);
    CU_ASSERT_EQUAL(c->lora.rules[0].spec.init, LORA_INIT_PISSA);
    Net n;
    CU_ASSERT_EQUAL(net_build(&n, c, NET_FRESH, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "t.yaml:10:") && test_msg_has(&err, "lora init pissa") &&
              test_msg_has(&err, "2 groups"));
    /* a rule's own init wins over lora.init */
    CU_ASSERT_EQUAL_FATAL(config_load_string(c, LORA_YAML("  init: pissa\n", "fc, rank: 2, init: gaussian"), "t.yaml",
                                             NULL, 0, &err), QT_OK);
    CU_ASSERT_EQUAL(c->lora.rules[0].spec.init, LORA_INIT_GAUSSIAN);
    CU_ASSERT_EQUAL(c->lora.loftq_iters, 5);
    free(c);
}

int register_lora_init_suite(void) {
    CU_pSuite s = CU_add_suite("lora_init", suite_init, suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "svd: known, tall, wide, rank-deficient matrices", test_svd_known) ||
           !CU_add_test(s, "pissa: s B A the truncated SVD, symmetric split, base + s B A = W", test_pissa_float) ||
           !CU_add_test(s, "loftq: below the default from iteration 1, never rising, the base stored",
                        test_loftq_iterations) ||
           !CU_add_test(s, "resume exact: loftq over int4", test_resume_loftq_qlora) ||
           !CU_add_test(s, "resume exact: pissa over a float base", test_resume_pissa_float) ||
           !CU_add_test(s, "loftq adapters go on from their run's checkpoint with init default", test_continue_loftq) ||
           !CU_add_test(s, "report: the start's lines, summary.json, qtrain quantize", test_report_loftq_and_pissa) ||
           !CU_add_test(s, "pissa base identity differs from the default's", test_pissa_base_identity) ||
           !CU_add_test(s, "pissa float base: merge gives W back, merged = unmerged, PEFT export", test_pissa_merge) ||
           !CU_add_test(s, "pissa over a quantized base", test_pissa_qlora) ||
           !CU_add_test(s, "dora over pissa and loftq starts from the fitted base", test_dora_with_svd_inits) ||
           !CU_add_test(s, "errors: loftq without a quant rule, adapters_from, iters, names, groups",
                        test_bad_inputs);
}
