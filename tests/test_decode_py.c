/* test_decode_py.c - scripts/qtrain_decode.py, the Python decode that
 * docs/CHECKPOINT.md prints, against qtrain's own dequantization: the binary
 * writes a quantized checkpoint of tiny-base.yaml's model for every stored
 * format (`qtrain quantize`), each module's /quant/<module>/weight is loaded
 * into a QArray as the checkpoint loader does (qarray_alloc + qarray_blobs)
 * and dequantized by qarray_dequantize, and the script's float32 output
 * must equal it bit for bit. Needs Debian's /usr/bin/python3 with h5py and
 * numpy; without them the test says it is skipped and why. */
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "quant/qarray.h"
#include "quant/qarray_io.h"
#include "test_proc.h"
#include "test_util.h"
#include "base/h5io.h"

#define PYTHON "/usr/bin/python3"

static char *tmp_root;
static char bin[PATH_MAX];

static int decode_suite_init(void) {
    tmp_root = test_tmpdir_new();
    if (!realpath(test_qtrain_bin(), bin)) snprintf(bin, sizeof bin, "%s", test_qtrain_bin());
    return tmp_root ? 0 : -1;
}

static int decode_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

/* Runs a shell command (printf-style) with its output in log; the exit status, -1 if it did not exit. */
static int sh(const char *log, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int sh(const char *log, const char *fmt, ...) {
    char args[4096], cmd[4096 + PATH_MAX + 16];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "%s >%s 2>&1", args, log);
    fflush(NULL);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void show_log(const char *log) {
    char *text = test_file_read(log, NULL);
    fprintf(stderr, "\n%s\n", text ? text : "(no output)");
    free(text);
}

/* ---- qtrain's side: the stored weight as the checkpoint loader reads it --------------------------------------- */

/* The QArray layout of a stored weight from its attributes (quant/qlayer.h's weight layout, as qlayer_layout
 * makes it): blocks of `tile` elements of the flattened weight, else (out, fan_in) per channel or per tensor. */
static QtStatus layout_from_attrs(const H5ioFile *f, const char *g, const QType **qt, int *ndim, int shape[2],
                                  QArrayOptions *o, int64_t wshape[4], int *wdims, QtError *err) {
    char *qtype = NULL, *gran = NULL, *stype = NULL;
    int64_t tile = 0, sym = 1, narrow = 0, dq = 0, dq_block = 0;
    QtStatus st = h5io_attr_read_str(f, g, "qtype", &qtype, err);
    if (st == QT_OK) st = h5io_attr_read_str(f, g, "granularity", &gran, err);
    if (st == QT_OK) st = h5io_attr_read_str(f, g, "scale_type", &stype, err);
    if (st == QT_OK) st = h5io_attr_read_i64s(f, g, "shape", wshape, 4, wdims, err);
    if (st == QT_OK) st = h5io_attr_read_i64(f, g, "tile", &tile, err);
    if (st == QT_OK) st = h5io_attr_read_i64(f, g, "symmetric", &sym, err);
    if (st == QT_OK) st = h5io_attr_read_i64(f, g, "narrow_range", &narrow, err);
    if (st == QT_OK) st = h5io_attr_read_i64(f, g, "double_quant", &dq, err);
    if (st == QT_OK) st = h5io_attr_read_i64(f, g, "dq_block", &dq_block, err);
    if (st == QT_OK) *qt = qtype_find(qtype, err);
    if (st == QT_OK && !*qt) st = QT_ERR_FORMAT;
    *o = (QArrayOptions){0};
    if (st == QT_OK) st = qarray_scale_type_parse(stype, &o->scale_type, err);
    if (st == QT_OK) {
        int64_t numel = 1;
        for (int d = 0; d < *wdims; d++) numel *= wshape[d];
        int out = (int)wshape[0], fan_in = (int)(numel / wshape[0]);
        *ndim = 2;
        if (tile > 0) {
            shape[0] = (int)(numel / tile), shape[1] = (int)tile;
            if (!qtype_is_block(*qt)) o->n_channelwise = 1, o->channelwise_axes[0] = 0;
        } else {
            shape[0] = out, shape[1] = fan_in;
            if (strcmp(gran, "per_tensor") != 0) {
                o->n_channelwise = 1, o->channelwise_axes[0] = 0;
            } else if ((*qt)->kind == QTYPE_KIND_LUT) {
                o->n_tiled = 1, o->tiled_axes[0] = (QArrayTiledAxis){1, fan_in};
            }
        }
        o->range = sym ? QARRAY_RANGE_SYMMETRIC : QARRAY_RANGE_ASYMMETRIC;
        o->narrow_range = narrow;
        o->double_quant = dq;
        o->dq_block = (int)dq_block;
        char zp[300];
        snprintf(zp, sizeof zp, "%s/zero_point", g);
        H5ioInfo info;
        if (h5io_kind(f, zp) == H5IO_DATASET && h5io_dataset_info(f, zp, &info, err) == QT_OK && info.cls == H5T_FLOAT)
            o->zp_type = QARRAY_ZP_FLOAT;
    }
    free(qtype), free(gran), free(stype);
    return st;
}

static hid_t blob_memtype(QArrayBlobType t) {
    return t == QARRAY_BLOB_U8 ? H5T_NATIVE_UINT8 : t == QARRAY_BLOB_U16 ? H5T_NATIVE_UINT16
                                                 : t == QARRAY_BLOB_I32 ? H5T_NATIVE_INT32 : H5T_NATIVE_FLOAT;
}

/* /quant/<module>/weight of path -> *w [*numel] (malloc'd) through qarray_dequantize; its format -> qtype. */
static QtStatus c_dequantize(const char *path, const char *module, float **w, size_t *numel, char *qtype, size_t cap,
                             QtError *err) {
    H5ioFile f = H5IO_FILE_INIT;
    char g[256];
    snprintf(g, sizeof g, "quant/%s/weight", module);
    QArray q = {0};
    const QType *qt = NULL;
    QArrayOptions o;
    int ndim = 0, shape[2] = {0}, wdims = 0;
    int64_t wshape[4];
    QtStatus st = h5io_open(&f, path, err);
    if (st == QT_OK) st = layout_from_attrs(&f, g, &qt, &ndim, shape, &o, wshape, &wdims, err);
    if (st == QT_OK) st = qarray_alloc(&q, ndim, shape, qt, &o, err);
    QArrayBlob blobs[QARRAY_MAX_BLOBS];
    int nb = st == QT_OK ? qarray_blobs(&q, blobs) : 0;
    for (int b = 0; st == QT_OK && b < nb; b++) {
        char ds[300];
        int count = (int)blobs[b].count;
        snprintf(ds, sizeof ds, "%s/%s", g, blobs[b].name);
        st = h5io_read(&f, ds, blob_memtype(blobs[b].type), blobs[b].data, 1, &count, err);
    }
    if (st == QT_OK && q.double_quant) {
        double off = 0;
        st = h5io_attr_read_f64(&f, g, "dq_offset", &off, err);
        q.dq.offset = (float)off;
    }
    if (st == QT_OK) st = qarray_check_stored(&q, err);
    if (st == QT_OK) {
        *numel = q.numel;
        *w = malloc(q.numel * sizeof **w);
        if (!*w) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    }
    if (st == QT_OK) {
        qarray_dequantize(&q, *w);
        snprintf(qtype, cap, "%s", qtype_name(qt));
    }
    qarray_free(&q);
    QtError e2 = {0};
    h5io_close(&f, &e2);
    return st;
}

/* ---- the cases ---------------------------------------------------------------------------------------------- */

/* tiny-base.yaml's modules: conv1 (8, 1, 3, 3), fc1 (32, 1568), head (10, 32). Block formats go on fc1 and head
 * (their sizes are multiples of 32); together the cases store every format of quant/qtype.c's table, a generic
 * eXmY float, every scale type, zero points, per-tensor and per-channel scales, blocks, and double quantization. */
static const struct {
    const char *name, *rules;
} CASES[] = {
    {"int", "[{module_path: conv1, weight_qtype: int8}, {module_path: fc1, weight_qtype: int4, tile_size: 32}, "
            "{module_path: head, weight_qtype: int2}]"},
    {"int-odd", "[{module_path: conv1, weight_qtype: int3}, {module_path: fc1, weight_qtype: int5, narrow_range: "
                "true}, {module_path: head, weight_qtype: int6, per_tensor: true}]"},
    {"uint", "[{module_path: conv1, weight_qtype: int7}, {module_path: fc1, weight_qtype: uint8}, "
             "{module_path: head, weight_qtype: uint4, tile_size: 32}]"},
    {"asym-tern-bin", "[{module_path: conv1, weight_qtype: int8, symmetric: false}, {module_path: fc1, weight_qtype: "
                      "ternary}, {module_path: head, weight_qtype: binary}]"},
    {"nf4", "[{module_path: conv1, weight_qtype: nf4, tile_size: 0}, {module_path: fc1, weight_qtype: nf4, "
            "double_quant: true}, {module_path: head, weight_qtype: nf4, tile_size: 0, per_tensor: true}]"},
    {"fp", "[{module_path: conv1, weight_qtype: fp8_e4m3}, {module_path: fc1, weight_qtype: fp8_e5m2}, "
           "{module_path: head, weight_qtype: fp6_e3m2}]"},
    {"fp-small", "[{module_path: conv1, weight_qtype: fp6_e2m3}, {module_path: fc1, weight_qtype: fp4_e2m1, "
                 "tile_size: 32}, {module_path: head, weight_qtype: e3m4}]"},
    {"mx-a", "[{module_path: conv1, weight_qtype: int8, scale_type: float16}, {module_path: fc1, weight_qtype: "
             "mxfp8_e4m3}, {module_path: head, weight_qtype: mxfp4}]"},
    {"mx-b", "[{module_path: conv1, weight_qtype: int8, scale_type: bfloat16}, {module_path: fc1, weight_qtype: "
             "mxfp6_e3m2}, {module_path: head, weight_qtype: mxint8}]"},
    {"mx-shared", "[{module_path: conv1, weight_qtype: int4, scale_type: pof2}, {module_path: fc1, weight_qtype: "
                  "mx6}, {module_path: head, weight_qtype: mx9}]"},
    {"dq-int", "[{module_path: conv1, weight_qtype: uint8, narrow_range: false}, {module_path: fc1, weight_qtype: "
               "int4, tile_size: 64, double_quant: true}, {module_path: head, weight_qtype: int8, per_tensor: true}]"},
};

static const char *const MODULES[] = {"conv1", "fc1", "head"};

/* The formats the cases must store between them: every entry of quant/qtype.c's table (a new format fails here
 * until a case stores it), and a generic eXmY float. */
#define N_WANT_MAX 64
static int want_formats(const char *formats[N_WANT_MAX]) {
    int n = 0;
    for (int i = 0; i < qtype_count() && n < N_WANT_MAX - 1; i++) formats[n++] = qtype_at(i)->name;
    formats[n++] = "fp8_e3m4";
    return n;
}

static void test_python_decode_equals_qtrain(void) {
    char log[PATH_MAX];
    snprintf(log, sizeof log, "%s/python.log", tmp_root);
    if (access(PYTHON, X_OK) != 0) {
        test_skip(PYTHON " is missing (Debian's python3)");
        return;
    }
    if (sh(log, PYTHON " -c 'import h5py, numpy'") != 0) {
        char *text = test_file_read(log, NULL);
        size_t len = text ? strlen(text) : 0;
        while (len && text[len - 1] == '\n') text[--len] = 0;
        const char *last = text ? strrchr(text, '\n') : NULL; /* the exception's line */
        test_skip(PYTHON " cannot import h5py and numpy (install python3-h5py python3-numpy): %s",
                  last ? last + 1 : text && *text ? text : "no output");
        free(text);
        return;
    }
    if (access("scripts/qtrain_decode.py", R_OK) != 0) {
        CU_FAIL("scripts/qtrain_decode.py is missing");
        return;
    }
    snprintf(log, sizeof log, "%s/base.log", tmp_root);
    int code = sh(log, "OPENBLAS_NUM_THREADS=1 %s --config tests/configs/tiny-base.yaml --set run.out_dir=%s/base",
                  bin, tmp_root);
    if (code != 0) show_log(log);
    CU_ASSERT_EQUAL_FATAL(code, 0);
    const char *formats[N_WANT_MAX];
    int n_want = want_formats(formats);
    bool seen[N_WANT_MAX] = {false};
    int compared = 0;
    for (size_t c = 0; c < sizeof CASES / sizeof CASES[0]; c++) {
        snprintf(log, sizeof log, "%s/%s.log", tmp_root, CASES[c].name);
        code = sh(log, "OPENBLAS_NUM_THREADS=1 %s quantize --config tests/configs/tiny-base.yaml --checkpoint "
                  "%s/base/final.h5 --out %s/%s.h5 --set quant.mode=ptq --set 'quant.rules=%s'", bin, tmp_root,
                  tmp_root, CASES[c].name, CASES[c].rules);
        if (code != 0) show_log(log);
        CU_ASSERT_EQUAL(code, 0);
        if (code != 0) continue;
        for (size_t m = 0; m < sizeof MODULES / sizeof MODULES[0]; m++) {
            char ckpt[PATH_MAX], raw[PATH_MAX], qtype[64];
            snprintf(ckpt, sizeof ckpt, "%s/%s.h5", tmp_root, CASES[c].name);
            snprintf(raw, sizeof raw, "%s/%s-%s.f32", tmp_root, CASES[c].name, MODULES[m]);
            float *want = NULL;
            size_t n = 0;
            QtError err = {0};
            QtStatus st = c_dequantize(ckpt, MODULES[m], &want, &n, qtype, sizeof qtype, &err);
            if (st != QT_OK) fprintf(stderr, "\n  %s %s: %s\n", CASES[c].name, MODULES[m], err.msg);
            CU_ASSERT_EQUAL(st, QT_OK);
            if (st != QT_OK) continue;
            code = sh(log, PYTHON " scripts/qtrain_decode.py %s %s --raw %s", ckpt, MODULES[m], raw);
            if (code != 0) show_log(log);
            CU_ASSERT_EQUAL(code, 0);
            size_t len = 0;
            char *got = code == 0 ? test_file_read(raw, &len) : NULL;
            bool same = got && len == n * sizeof(float) && memcmp(got, want, len) == 0;
            if (!same) {
                size_t i = 0;
                while (got && len == n * sizeof(float) && i < n && memcmp(got + i * 4, want + i, 4) == 0) i++;
                float g = 0;
                if (got && i < n && len == n * sizeof(float)) memcpy(&g, got + i * 4, 4);
                fprintf(stderr, "\n  %s %s (%s): the Python decode differs from qtrain's: %zu bytes for %zu "
                        "floats, first difference at %zu: %.9g, qtrain %.9g\n", CASES[c].name, MODULES[m], qtype,
                        len, n, i, (double)g, i < n ? (double)want[i] : 0.0);
            }
            CU_ASSERT(same);
            compared += same;
            for (int k = 0; k < n_want; k++) seen[k] |= strcmp(formats[k], qtype) == 0;
            free(got);
            free(want);
        }
    }
    for (int k = 0; k < n_want; k++)
        if (!seen[k]) fprintf(stderr, "\n  decode_py: no case stored %s\n", formats[k]);
    for (int k = 0; k < n_want; k++) CU_ASSERT(seen[k]);
    CU_ASSERT(n_want >= 24);
    CU_ASSERT_EQUAL(compared, (int)(sizeof CASES / sizeof CASES[0] * 3));
}

/* The decode in docs/CHECKPOINT.md is the script's: the excerpt between the doc's markers appears in it verbatim. */
static void test_doc_excerpt_matches_script(void) {
    char *doc = test_file_read("docs/CHECKPOINT.md", NULL), *py = test_file_read("scripts/qtrain_decode.py", NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(doc);
    CU_ASSERT_PTR_NOT_NULL_FATAL(py);
    const char *open = "<!-- qtrain_decode.py excerpt: begin -->\n```python\n", *close = "```\n<!-- qtrain_decode.py "
                                                                                        "excerpt: end -->";
    int found = 0;
    for (char *p = strstr(doc, open); p; p = strstr(p, open)) {
        p += strlen(open);
        char *e = strstr(p, close);
        CU_ASSERT_PTR_NOT_NULL_FATAL(e);
        *e = 0;
        bool in = strstr(py, p) != NULL;
        if (!in) fprintf(stderr, "\n  docs/CHECKPOINT.md's excerpt is not in scripts/qtrain_decode.py:\n%s\n", p);
        CU_ASSERT(in);
        found++;
        p = e + 1;
    }
    CU_ASSERT(found >= 1);
    free(doc);
    free(py);
}

int register_decode_py_suite(void) {
    CU_pSuite s = CU_add_suite("decode_py", decode_suite_init, decode_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "qtrain_decode.py dequantizes every stored format as qtrain does",
                        test_python_decode_equals_qtrain) ||
           !CU_add_test(s, "docs/CHECKPOINT.md's decode is the script's", test_doc_excerpt_matches_script);
}
