/* test_decode_py.c - scripts/qtrain_decode.py, the Python decode that
 * docs/CHECKPOINT.md prints, against qtrain's own dequantization: the binary
 * writes a quantized checkpoint of tiny-base.yaml's model for every stored
 * format (`qtrain quantize`), each module's /quant/<module>/weight is loaded
 * into a QArray as the checkpoint loader does (qarray_alloc + qarray_blobs)
 * and dequantized by qarray_dequantize, and the script's float32 output
 * must equal it bit for bit. scripts/qtrain_h5.py's load() must give, for
 * those checkpoints, the float base, a batch-norm run and a QLoRA run, every
 * state_dict name of the model once, with qtrain's bytes, dtype and shape,
 * and refuse damaged copies naming the dataset. Needs Debian's
 * /usr/bin/python3 with h5py and numpy; without them each test says it is
 * skipped and why. */
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

/* Whether Debian's python3 with h5py and numpy is there; if not, the test is reported skipped with the reason. */
static bool python_ready(void) {
    char log[PATH_MAX];
    snprintf(log, sizeof log, "%s/python.log", tmp_root);
    if (access(PYTHON, X_OK) != 0) {
        test_skip(PYTHON " is missing (Debian's python3)");
        return false;
    }
    if (sh(log, PYTHON " -c 'import h5py, numpy'") != 0) {
        char *text = test_file_read(log, NULL);
        size_t len = text ? strlen(text) : 0;
        while (len && text[len - 1] == '\n') text[--len] = 0;
        const char *last = text ? strrchr(text, '\n') : NULL; /* the exception's line */
        test_skip(PYTHON " cannot import h5py and numpy (install python3-h5py python3-numpy): %s",
                  last ? last + 1 : text && *text ? text : "no output");
        free(text);
        return false;
    }
    return true;
}

/* Trains tiny-base.yaml's float base and quantizes it by every case into tmp_root/<case>.h5, once for the
 * suite; case_ok[c] says whether case c's checkpoint was written. */
static bool cases_made, case_ok[sizeof CASES / sizeof CASES[0]];

static bool make_cases(void) {
    if (cases_made) return true;
    char log[PATH_MAX];
    snprintf(log, sizeof log, "%s/base.log", tmp_root);
    int code = sh(log, "OPENBLAS_NUM_THREADS=1 %s --config tests/configs/tiny-base.yaml --set run.out_dir=%s/base",
                  bin, tmp_root);
    if (code != 0) show_log(log);
    CU_ASSERT_EQUAL(code, 0);
    if (code != 0) return false;
    for (size_t c = 0; c < sizeof CASES / sizeof CASES[0]; c++) {
        snprintf(log, sizeof log, "%s/%s.log", tmp_root, CASES[c].name);
        code = sh(log, "OPENBLAS_NUM_THREADS=1 %s quantize --config tests/configs/tiny-base.yaml --checkpoint "
                  "%s/base/final.h5 --out %s/%s.h5 --set quant.mode=ptq --set 'quant.rules=%s'", bin, tmp_root,
                  tmp_root, CASES[c].name, CASES[c].rules);
        if (code != 0) show_log(log);
        CU_ASSERT_EQUAL(code, 0);
        case_ok[c] = code == 0;
    }
    cases_made = true;
    return true;
}

static void test_python_decode_equals_qtrain(void) {
    char log[PATH_MAX];
    if (!python_ready()) return;
    if (access("scripts/qtrain_decode.py", R_OK) != 0) {
        CU_FAIL("scripts/qtrain_decode.py is missing");
        return;
    }
    CU_ASSERT_FATAL(make_cases());
    int code;
    const char *formats[N_WANT_MAX];
    int n_want = want_formats(formats);
    bool seen[N_WANT_MAX] = {false};
    int compared = 0;
    for (size_t c = 0; c < sizeof CASES / sizeof CASES[0]; c++) {
        snprintf(log, sizeof log, "%s/%s.log", tmp_root, CASES[c].name);
        if (!case_ok[c]) continue;
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

/* ---- scripts/qtrain_h5.py: a whole checkpoint as a state_dict -------------------------------------------------- */

/* Trains tiny-bn.yaml (batch norm) and tiny-qlora.yaml (an nf4 base with double quantization, adapters) for 2
 * steps on the mini set, into tmp_root/bn and tmp_root/qlora, once for the suite (the QLoRA run starts from
 * make_cases' base). */
static bool runs_made, runs_ok;

static bool make_runs(void) {
    if (runs_made) return runs_ok;
    runs_made = true;
    if (!make_cases()) return false;
    char log[PATH_MAX];
    snprintf(log, sizeof log, "%s/bn.log", tmp_root);
    int code = sh(log, "OPENBLAS_NUM_THREADS=1 %s --config tests/configs/tiny-bn.yaml --set run.out_dir=%s/bn "
                  "--set train.steps=2", bin, tmp_root);
    if (code != 0) show_log(log);
    CU_ASSERT_EQUAL(code, 0);
    snprintf(log, sizeof log, "%s/qlora.log", tmp_root);
    int code2 = sh(log, "OPENBLAS_NUM_THREADS=1 %s --config tests/configs/tiny-qlora.yaml --set run.out_dir=%s/qlora "
                   "--set train.steps=2 --set model.init_from=%s/base/final.h5", bin, tmp_root, tmp_root);
    if (code2 != 0) show_log(log);
    CU_ASSERT_EQUAL(code2, 0);
    runs_ok = code == 0 && code2 == 0;
    return runs_ok;
}

/* Writes every array of qtrain_h5.load(ckpt) to dir/<name>.bin and "name dtype d0,d1,..." lines to dir/names.txt. */
static const char DUMP_PY[] =
    "import sys\n"
    "sys.path.insert(0, 'scripts')\n"
    "import qtrain_h5\n"
    "d = qtrain_h5.load(sys.argv[1])\n"
    "with open(sys.argv[2] + '/names.txt', 'w') as m:\n"
    "    for k, v in d.items():\n"
    "        v.astype(v.dtype.newbyteorder('<')).tofile(f'{sys.argv[2]}/{k}.bin')\n"
    "        m.write(f\"{k} {v.dtype} {','.join(map(str, v.shape))}\\n\")\n";

/* qtrain's value of state_dict entry `name` of ckpt: the dequantized /quant weight (c_dequantize), else the
 * /params, /buffers or /lora dataset as qtrain's h5io reads it; its bytes (malloc'd), dtype and shape "d0,d1". */
static QtStatus qtrain_entry(const char *ckpt, const char *name, char **bytes, size_t *len, const char **dtype,
                             char *shape, size_t cap, QtError *err) {
    char module[200], ds[300];
    const char *dot = strrchr(name, '.');
    if (!dot || dot - name >= (int)sizeof module) return qt_error_set(err, QT_ERR_ARG, "name %s has no module", name);
    snprintf(module, sizeof module, "%.*s", (int)(dot - name), name);
    for (char *p = module; *p; p++)
        if (*p == '.') *p = '/';
    const char *t = dot + 1;
    H5ioFile f = H5IO_FILE_INIT;
    QtStatus st = h5io_open(&f, ckpt, err);
    if (st != QT_OK) return st;
    snprintf(ds, sizeof ds, "quant/%s/weight/qvalue", module);
    bool quant = strcmp(t, "weight") == 0 && h5io_kind(&f, ds) == H5IO_DATASET;
    int64_t wshape[4];
    int wdims = 0;
    *dtype = strcmp(t, "num_batches_tracked") == 0 ? "int64" : "float32";
    shape[0] = 0;
    if (quant) {
        snprintf(ds, sizeof ds, "quant/%s/weight", module);
        st = h5io_attr_read_i64s(&f, ds, "shape", wshape, 4, &wdims, err);
        for (int d = 0; st == QT_OK && d < wdims; d++)
            snprintf(shape + strlen(shape), cap - strlen(shape), "%s%lld", d ? "," : "", (long long)wshape[d]);
        QtError e2 = {0};
        h5io_close(&f, &e2);
        float *w = NULL;
        size_t n = 0;
        char qtype[64];
        if (st == QT_OK) st = c_dequantize(ckpt, module, &w, &n, qtype, sizeof qtype, err);
        *bytes = (char *)w, *len = n * sizeof(float);
        return st;
    }
    const char *top = strcmp(t, "weight") == 0 || strcmp(t, "bias") == 0 ? "params"
                      : strncmp(t, "lora_", 5) == 0                        ? "lora"
                                                                           : "buffers";
    snprintf(ds, sizeof ds, "%s/%s/%s", top, module, strncmp(t, "lora_", 5) == 0 ? t + 5 : t);
    H5ioInfo info;
    st = h5io_dataset_info(&f, ds, &info, err);
    int dims[H5IO_MAX_RANK];
    for (int d = 0; st == QT_OK && d < info.rank; d++) {
        dims[d] = (int)info.dims[d];
        snprintf(shape + strlen(shape), cap - strlen(shape), "%s%d", d ? "," : "", dims[d]);
    }
    size_t esize = strcmp(*dtype, "int64") == 0 ? 8 : 4;
    *len = st == QT_OK ? (size_t)info.numel * esize : 0;
    *bytes = st == QT_OK ? malloc(*len ? *len : 1) : NULL;
    if (st == QT_OK && !*bytes) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK)
        st = h5io_read(&f, ds, esize == 8 ? H5T_NATIVE_INT64 : H5T_NATIVE_FLOAT, *bytes, info.rank, dims, err);
    QtError e2 = {0};
    h5io_close(&f, &e2);
    return st;
}

/* qtrain_h5.load(ckpt) holds exactly the names `want` (each once) with qtrain's bytes, dtype and shape. */
static void check_load(const char *ckpt, const char *label, const char *const *want, int n_want) {
    char dir[PATH_MAX], log[PATH_MAX], py[PATH_MAX], path[PATH_MAX + 300];
    snprintf(dir, sizeof dir, "%s/dump-%s", tmp_root, label);
    snprintf(log, sizeof log, "%s/dump-%s.log", tmp_root, label);
    snprintf(py, sizeof py, "%s/dump.py", tmp_root);
    test_file_write(py, DUMP_PY, strlen(DUMP_PY));
    int code = sh(log, "mkdir -p %s && " PYTHON " %s %s %s", dir, py, ckpt, dir);
    if (code != 0) show_log(log);
    CU_ASSERT_EQUAL_FATAL(code, 0);
    snprintf(path, sizeof path, "%s/names.txt", dir);
    char *names = test_file_read(path, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(names);
    int seen[32] = {0}, lines = 0;
    for (char *save = NULL, *line = strtok_r(names, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char name[200], dtype[32], shape[64] = "";
        lines++;
        if (sscanf(line, "%199s %31s %63s", name, dtype, shape) < 2) {
            fprintf(stderr, "\n  %s: bad line in names.txt: %s\n", label, line);
            CU_FAIL("names.txt");
            continue;
        }
        int k = 0;
        while (k < n_want && strcmp(want[k], name) != 0) k++;
        if (k == n_want) fprintf(stderr, "\n  %s: qtrain_h5.load gives %s, which the model does not have\n", label,
                                 name);
        CU_ASSERT(k < n_want);
        if (k == n_want) continue;
        seen[k]++;
        char *want_bytes = NULL, want_shape[64] = "";
        const char *want_dtype = "";
        size_t want_len = 0, got_len = 0;
        QtError err = {0};
        QtStatus st = qtrain_entry(ckpt, name, &want_bytes, &want_len, &want_dtype, want_shape, sizeof want_shape,
                                   &err);
        if (st != QT_OK) fprintf(stderr, "\n  %s %s: %s\n", label, name, err.msg);
        CU_ASSERT_EQUAL(st, QT_OK);
        snprintf(path, sizeof path, "%s/%s.bin", dir, name);
        char *got = test_file_read(path, &got_len);
        bool same = st == QT_OK && got && got_len == want_len && memcmp(got, want_bytes, want_len) == 0 &&
                    strcmp(dtype, want_dtype) == 0 && strcmp(shape, want_shape) == 0;
        if (!same)
            fprintf(stderr, "\n  %s %s: qtrain_h5 gives %s (%s), %zu bytes; qtrain %s (%s), %zu bytes%s\n", label,
                    name, dtype, shape, got_len, want_dtype, want_shape, want_len,
                    got_len == want_len ? ", the values differ" : "");
        CU_ASSERT(same);
        free(got);
        free(want_bytes);
    }
    for (int k = 0; k < n_want; k++) {
        if (seen[k] != 1) fprintf(stderr, "\n  %s: %s appears %d times\n", label, want[k], seen[k]);
        CU_ASSERT_EQUAL(seen[k], 1);
    }
    CU_ASSERT_EQUAL(lines, n_want);
    free(names);
}

static void test_h5_load_equals_qtrain(void) {
    if (!python_ready()) return;
    CU_ASSERT_FATAL(access("scripts/qtrain_h5.py", R_OK) == 0);
    CU_ASSERT_FATAL(make_runs());
    static const char *const base[] = {"conv1.weight", "conv1.bias", "fc1.weight", "fc1.bias", "head.weight",
                                       "head.bias"};
    static const char *const bn[] = {"conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean",
                                     "bn1.running_var", "bn1.num_batches_tracked", "head.weight", "head.bias"};
    static const char *const qlora[] = {"conv1.weight", "conv1.bias", "fc1.weight", "fc1.bias", "head.weight",
                                        "head.bias", "conv1.lora_A", "conv1.lora_B", "fc1.lora_A", "fc1.lora_B"};
    char ckpt[PATH_MAX];
    for (size_t c = 0; c < sizeof CASES / sizeof CASES[0]; c++) {
        if (!case_ok[c]) continue;
        snprintf(ckpt, sizeof ckpt, "%s/%s.h5", tmp_root, CASES[c].name);
        check_load(ckpt, CASES[c].name, base, 6);
    }
    snprintf(ckpt, sizeof ckpt, "%s/base/final.h5", tmp_root);
    check_load(ckpt, "float", base, 6);
    snprintf(ckpt, sizeof ckpt, "%s/bn/final.h5", tmp_root);
    check_load(ckpt, "bn", bn, 8);
    snprintf(ckpt, sizeof ckpt, "%s/qlora/final.h5", tmp_root);
    check_load(ckpt, "qlora", qlora, 10);
}

/* Damaged copies of the suite's checkpoints, each edited with h5py: qtrain_h5.load raises QtrainH5Error naming
 * the dataset (the command exits 1); --save-npz saves what load gives. */
static const char DAMAGE_PY[] =
    "import shutil, sys\n"
    "import h5py, numpy as np\n"
    "sys.path.insert(0, 'scripts')\n"
    "import qtrain_h5\n"
    "root, bad = sys.argv[1], 0\n"
    "def case(src, what, edit, want):\n"
    "    global bad\n"
    "    dst = f'{root}/damaged.h5'\n"
    "    shutil.copy(f'{root}/{src}', dst)\n"
    "    with h5py.File(dst, 'r+') as f:\n"
    "        edit(f)\n"
    "    try:\n"
    "        qtrain_h5.load(dst)\n"
    "        print(f'FAIL {what}: loaded without an error')\n"
    "    except qtrain_h5.QtrainH5Error as e:\n"
    "        if want in str(e):\n"
    "            print(f'ok {what}: {e}')\n"
    "            return\n"
    "        print(f'FAIL {what}: the message does not name {want}: {e}')\n"
    "    bad += 1\n"
    "def replace(f, name, data):\n"
    "    del f[name]\n"
    "    f[name] = data\n"
    "def poke(f, name, i, v):\n"
    "    a = f[name][()]\n"
    "    a.reshape(-1)[i] = v\n"
    "    f[name][...] = a\n"
    "def attr(f, name, key, v):\n"
    "    f[name].attrs[key] = v\n"
    "Q = 'quant/%s/weight'\n"
    "case('nf4.h5', 'short qvalue', lambda f: replace(f, Q % 'fc1' + '/qvalue', f[Q % 'fc1' + '/qvalue'][:-1]),\n"
    "     '/quant/fc1/weight/qvalue')\n"
    "case('int.h5', 'unknown qtype', lambda f: attr(f, Q % 'conv1', 'qtype', np.bytes_('int9')),\n"
    "     \"/quant/conv1/weight: attribute qtype: unknown element format 'int9'\")\n"
    "case('int.h5', 'unknown scale_type', lambda f: attr(f, Q % 'head', 'scale_type', np.bytes_('float8')),\n"
    "     \"/quant/head/weight: attribute scale_type 'float8'\")\n"
    "case('int.h5', 'scale count', lambda f: replace(f, Q % 'head' + '/scale', f[Q % 'head' + '/scale'][:-1]),\n"
    "     '/quant/head/weight/scale')\n"
    "case('int.h5', 'shape attribute', lambda f: attr(f, Q % 'conv1', 'shape', np.array([8, 1, 3, 4])),\n"
    "     '/quant/conv1/weight/qvalue')\n"
    "case('int.h5', 'zero scale', lambda f: poke(f, Q % 'conv1' + '/scale', 0, 0.0), '/quant/conv1/weight/scale')\n"
    "case('mx-a.h5', 'MX NaN scale', lambda f: poke(f, Q % 'fc1' + '/qvalue', 33, 255), '/quant/fc1/weight/qvalue')\n"
    "case('mx-a.h5', 'float16 scales as float32',\n"
    "     lambda f: replace(f, Q % 'conv1' + '/scale', np.ones(8, np.float32)), '/quant/conv1/weight/scale')\n"
    "case('mx-shared.h5', 'pof2 NaN scale', lambda f: poke(f, Q % 'conv1' + '/scale', 3, 255),\n"
    "     '/quant/conv1/weight/scale')\n"
    "case('fp.h5', 'fp8 NaN code', lambda f: poke(f, Q % 'conv1' + '/qvalue', 5, 0x7f), '/quant/conv1/weight/qvalue')\n"
    "case('nf4.h5', 'no scale_absmax', lambda f: f.__delitem__(Q % 'fc1' + '/scale_absmax'),\n"
    "     '/quant/fc1/weight/scale_absmax')\n"
    "case('asym-tern-bin.h5', 'zero_point count',\n"
    "     lambda f: replace(f, Q % 'conv1' + '/zero_point', f[Q % 'conv1' + '/zero_point'][1:]),\n"
    "     '/quant/conv1/weight/zero_point')\n"
    "case('asym-tern-bin.h5', 'zero_point range', lambda f: poke(f, Q % 'conv1' + '/zero_point', 2, 300),\n"
    "     '/quant/conv1/weight/zero_point')\n"
    "case('int.h5', 'dataset outside a module', lambda f: f.create_dataset('params/w', data=np.ones(2, np.float32)),\n"
    "     '/params/w')\n"
    "case('int.h5', 'NaN bias', lambda f: poke(f, 'params/conv1/bias', 2, np.nan), '/params/conv1/bias')\n"
    "case('int.h5', 'weight twice', lambda f: f.create_dataset('params/conv1/weight', data=np.zeros((8, 1, 3, 3),\n"
    "     np.float32)), \"gives 'conv1.weight' a second time\")\n"
    "case('bn/final.h5', 'unknown buffer', lambda f: f.create_dataset('buffers/bn1/running_std', data=np.ones(16)),\n"
    "     '/buffers/bn1/running_std')\n"
    "case('bn/final.h5', 'negative variance', lambda f: poke(f, 'buffers/bn1/running_var', 0, -1.0),\n"
    "     '/buffers/bn1/running_var')\n"
    "case('bn/final.h5', 'float count', lambda f: replace(f, 'buffers/bn1/num_batches_tracked', np.float32(2)),\n"
    "     '/buffers/bn1/num_batches_tracked')\n"
    "case('qlora/final.h5', 'unknown adapter', lambda f: f.create_dataset('lora/fc1/C', data=np.ones(4, np.float32)),\n"
    "     '/lora/fc1/C')\n"
    "case('base/final.h5', 'not qtrain', lambda f: attr(f, '/', 'format', np.bytes_('other')),\n"
    "     'not a qtrain checkpoint')\n"
    "code = qtrain_h5.main([f'{root}/damaged.h5'])\n"
    "print(f'{\"ok\" if code == 1 else \"FAIL\"} the command exits {code} on a damaged file')\n"
    "bad += code != 1\n"
    "sd, out = qtrain_h5.load(f'{root}/bn/final.h5'), f'{root}/bn.npz'\n"
    "code = qtrain_h5.main([f'{root}/bn/final.h5', '--save-npz', out])\n"
    "z = np.load(out)\n"
    "same = code == 0 and sorted(z.files) == sorted(sd) and all(z[k].dtype == v.dtype and z[k].shape == v.shape\n"
    "    and z[k].tobytes() == v.tobytes() for k, v in sd.items())\n"
    "print(f'{\"ok\" if same else \"FAIL\"} --save-npz saves what load gives')\n"
    "bad += not same\n"
    "sys.exit(1 if bad else 0)\n";

static void test_h5_refuses_damage(void) {
    if (!python_ready()) return;
    CU_ASSERT_FATAL(access("scripts/qtrain_h5.py", R_OK) == 0);
    CU_ASSERT_FATAL(make_runs());
    char py[PATH_MAX], log[PATH_MAX];
    snprintf(py, sizeof py, "%s/damage.py", tmp_root);
    snprintf(log, sizeof log, "%s/damage.log", tmp_root);
    test_file_write(py, DAMAGE_PY, strlen(DAMAGE_PY));
    int code = sh(log, PYTHON " %s %s", py, tmp_root);
    char *text = test_file_read(log, NULL);
    int ok = 0;
    for (const char *p = text; p && (p = strstr(p, "ok ")); p += 3) ok += p == text || p[-1] == '\n';
    if (code != 0 || getenv("QT_TEST_SHOW_MSGS")) show_log(log);
    CU_ASSERT_EQUAL(code, 0);
    CU_ASSERT_EQUAL(ok, 23);
    free(text);
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
           !CU_add_test(s, "docs/CHECKPOINT.md's decode is the script's", test_doc_excerpt_matches_script) ||
           !CU_add_test(s, "qtrain_h5.load gives qtrain's arrays under every state_dict name once",
                        test_h5_load_equals_qtrain) ||
           !CU_add_test(s, "qtrain_h5.load refuses damaged content naming the dataset", test_h5_refuses_damage);
}
