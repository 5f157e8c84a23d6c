/* export_c.c - the integer program (intprog.h) written out as C99: the
 * constants as const arrays, the op sequence as calls into the runtime
 * (device/qtrain_rt.c, embedded at build time), one static arena at the
 * offsets intprog planned. Everything is written into a fresh directory
 * beside `out` and renamed into place at the end, so a failed export leaves
 * nothing behind. */
#define _GNU_SOURCE /* mkdtemp */
#include "export_c.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/fsutil.h"
#include "trainer/checkpoint.h"
#include "trainer/eval_int.h"
#include "trainer/tools.h"
#include "trainer/version.h"

static const char *const FASHION_NAMES[10] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                              "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

/* ---- writing files ------------------------------------------------------------------------------------------- */

typedef struct {
    FILE *f;
    const char *path;
    bool failed;
} Out;

static void put(Out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(Out *o, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (vfprintf(o->f, fmt, ap) < 0) o->failed = true;
    va_end(ap);
}

static QtStatus out_open(Out *o, const char *dir, const char *file, char *path, size_t cap, QtError *err) {
    snprintf(path, cap, "%s/%s", dir, file);
    o->path = path, o->failed = false;
    if (!(o->f = fopen(path, "w")))
        return qt_error_set(err, QT_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    return QT_OK;
}

static QtStatus out_close(Out *o, QtError *err) {
    const bool bad = o->failed || ferror(o->f);
    if (fclose(o->f) != 0 || bad)
        return qt_error_set(err, QT_ERR_IO, "%s: writing failed: %s (is the disk full?)", o->path, strerror(errno));
    return QT_OK;
}

static QtStatus write_text(const char *dir, const char *file, const char *text, QtError *err) {
    char path[4200];
    Out o;
    QtStatus st = out_open(&o, dir, file, path, sizeof path, err);
    if (st != QT_OK) return st;
    if (fputs(text, o.f) < 0) o.failed = true;
    return out_close(&o, err);
}

/* ---- C text of the program ------------------------------------------------------------------------------------- */

/* A C identifier for module path `path` (letters, digits, _). */
static void c_ident(char *out, size_t cap, const char *path) {
    size_t k = 0;
    for (const char *s = path; *s && k + 1 < cap; s++) out[k++] = isalnum((unsigned char)*s) ? *s : '_';
    out[k] = 0;
}

/* in as text for a C comment: control characters as '?', and no '*' directly before a '/'. */
static void comment_safe(char *out, size_t cap, const char *in) {
    size_t k = 0;
    for (const char *s = in; *s && k + 2 < cap; s++) {
        const unsigned char c = (unsigned char)*s;
        out[k++] = c < 0x20 || c == 0x7f ? '?' : (char)c;
        if (c == '*' && s[1] == '/') out[k++] = ' ';
    }
    out[k] = 0;
}

static void put_i8(Out *o, const char *type, const char *name, const int8_t *v, size_t n) {
    put(o, "static const %s %s[%zu] = {", type, name, n ? n : 1);
    for (size_t k = 0; k < n; k++) put(o, "%s%d,", k % 20 ? " " : "\n    ", (int)v[k]);
    put(o, "%s\n};\n", n ? "" : "0");
}

static void put_u8(Out *o, const char *name, const uint8_t *v, size_t n) {
    put(o, "static const uint8_t %s[%zu] = {", name, n);
    for (size_t k = 0; k < n; k++) put(o, "%s0x%02x,", k % 16 ? " " : "\n    ", v[k]);
    put(o, "\n};\n");
}

static void put_i32(Out *o, const char *name, const int32_t *v, size_t n) {
    put(o, "static const int32_t %s[%zu] = {", name, n);
    for (size_t k = 0; k < n; k++) put(o, "%s%ld,", k % 8 ? " " : "\n    ", (long)v[k]);
    put(o, "\n};\n");
}

/* The constants and the description of op k (a static const struct named <prefix><ident>). */
static void put_op_decl(Out *o, const IntProgram *p, int k, const char *id) {
    const IntOp *op = &p->ops[k];
    char a[160];
    if (op->kind == IOP_CONV || op->kind == IOP_DENSE) {
        const bool conv = op->kind == IOP_CONV;
        const int out = conv ? op->p.conv.out_c : op->p.dense.out;
        const int bits = conv ? op->p.conv.w_bits : op->p.dense.w_bits;
        const size_t nw = conv ? (size_t)out * (op->p.conv.in_c / op->p.conv.groups) * op->p.conv.k_h * op->p.conv.k_w
                               : (size_t)out * op->p.dense.in;
        const void *w = conv ? op->p.conv.weight : op->p.dense.weight;
        put(o, "\n/* %s: %s, %s weights */\n", id, conv ? "conv2d" : "dense", bits == 4 ? "int4 (two per byte)" : "int8");
        snprintf(a, sizeof a, "%s_w", id);
        if (bits == 4) put_u8(o, a, w, (nw + 1) / 2);
        else put_i8(o, "int8_t", a, w, nw);
        snprintf(a, sizeof a, "%s_b", id);
        put_i32(o, a, conv ? op->p.conv.bias : op->p.dense.bias, (size_t)out);
        snprintf(a, sizeof a, "%s_m", id);
        put_i32(o, a, conv ? op->p.conv.mult : op->p.dense.mult, (size_t)out);
        snprintf(a, sizeof a, "%s_s", id);
        put_i8(o, "int8_t", a, conv ? op->p.conv.shift : op->p.dense.shift, (size_t)out);
    }
    switch (op->kind) {
    case IOP_CONV: {
        const qrt_conv2d_t *c = &op->p.conv;
        put(o, "static const qrt_conv2d_t %s = {%d, %d, %d, %d, %d, %d, %d, %d, %d, %d, %d, %d, %d, %d, %d, %d,\n"
               "    %s_w, %s_b, %s_m, %s_s, %ld, %ld, %ld, %ld};\n", id, c->in_c, c->in_h, c->in_w, c->out_c,
            c->out_h, c->out_w, c->k_h, c->k_w, c->stride_h, c->stride_w, c->pad_t, c->pad_l, c->dil_h, c->dil_w,
            c->groups, c->w_bits, id, id, id, id, (long)c->in_zp, (long)c->out_zp, (long)c->act_min,
            (long)c->act_max);
        break;
    }
    case IOP_DENSE: {
        const qrt_dense_t *d = &op->p.dense;
        put(o, "static const qrt_dense_t %s = {%d, %d, %d, %s_w, %s_b, %s_m, %s_s, %ld, %ld, %ld, %ld};\n", id, d->in,
            d->out, d->w_bits, id, id, id, id, (long)d->in_zp, (long)d->out_zp, (long)d->act_min, (long)d->act_max);
        break;
    }
    case IOP_MAXPOOL: {
        const qrt_maxpool2d_t *m = &op->p.maxpool;
        put(o, "\nstatic const qrt_maxpool2d_t %s = {%d, %d, %d, %d, %d, %d, %d, %d, %d};\n", id, m->c, m->in_h,
            m->in_w, m->out_h, m->out_w, m->k_h, m->k_w, m->stride_h, m->stride_w);
        break;
    }
    case IOP_AVGPOOL: {
        const qrt_avgpool2d_t *m = &op->p.avgpool;
        put(o, "\nstatic const qrt_avgpool2d_t %s = {%d, %d, %d, %d, %d, %d, %d, %d, %d, %ld, %d, %ld, %ld, %ld, "
               "%ld};\n", id, m->c, m->in_h, m->in_w, m->out_h, m->out_w, m->k_h, m->k_w, m->stride_h, m->stride_w,
            (long)m->mult, m->shift, (long)m->in_zp, (long)m->out_zp, (long)m->act_min, (long)m->act_max);
        break;
    }
    case IOP_ADD: {
        const qrt_add_t *m = &op->p.add;
        put(o, "\nstatic const qrt_add_t %s = {%d, %ld, %ld, %ld, %ld, %d, %ld, %ld, %ld};\n", id, m->n, (long)m->a_zp,
            (long)m->b_zp, (long)m->a_mult, (long)m->b_mult, m->shift, (long)m->out_zp, (long)m->act_min,
            (long)m->act_max);
        break;
    }
    case IOP_REQUANT: {
        const qrt_requant_t *m = &op->p.requant;
        put(o, "\nstatic const qrt_requant_t %s = {%d, %ld, %ld, %d, %ld, %ld, %ld};\n", id, m->n, (long)m->in_zp,
            (long)m->mult, m->shift, (long)m->out_zp, (long)m->act_min, (long)m->act_max);
        break;
    }
    case IOP_RELU: break;
    }
}

static const char *op_name(IntOpKind k) {
    switch (k) {
    case IOP_CONV: return "conv2d";
    case IOP_DENSE: return "dense";
    case IOP_MAXPOOL: return "maxpool2d";
    case IOP_AVGPOOL: return "avgpool2d";
    case IOP_ADD: return "add";
    case IOP_REQUANT: return "requant";
    case IOP_RELU: return "relu";
    }
    return "?";
}

/* The op's identifier: NAME_op<k>_<module>, unique by k whatever the module names sanitise to. */
static void op_ident(char *id, size_t cap, const char *name, const Model *m, const IntProgram *p, int k) {
    char mod[MODULE_NAME_MAX + 1];
    c_ident(mod, sizeof mod, m->modules[p->ops[k].module].path);
    snprintf(id, cap, "%s_op%d_%s", name, k, mod);
}

typedef struct {
    const char *name, *upper;
    const char *checkpoint;      /* as given (export.json) */
    char checkpoint_c[1024];     /* for comments: no end of comment, no control characters (comment_safe) */
    bool transposed;             /* data.transform transposes the images: predict reads input[c][j][i] */
    bool relabel;                /* data.transform keeps and renumbers classes: label_map below */
    int label_map[256];          /* a stored label -> the model's, -1: not a class of the model */
    const IntProgram *p;
    const Model *m;
    const Dataset *data;
    const char *const *classes;
    int n_classes;
} Emit;

static void put_op_call(Out *o, const Emit *e, int k) {
    const IntProgram *p = e->p;
    const IntOp *op = &p->ops[k];
    char id[MODULE_NAME_MAX + 80];
    op_ident(id, sizeof id, e->name, e->m, p, k);
    const size_t x = p->bufs[op->in[0]].offset, y = p->bufs[op->out].offset + op->out_at;
    const Module *mod = &e->m->modules[op->module];
    put(o, "    /* %s (%s) */\n", mod->path, op_name(op->kind));
    switch (op->kind) {
    case IOP_CONV:
        if (op->scratch >= 0) put(o, "    qrt_conv2d(&%s, a + %zu, a + %zu, a + %zu);\n", id, x, y, p->bufs[op->scratch].offset);
        else put(o, "    qrt_conv2d(&%s, a + %zu, a + %zu, 0);\n", id, x, y);
        break;
    case IOP_DENSE: put(o, "    qrt_dense(&%s, a + %zu, a + %zu);\n", id, x, y); break;
    case IOP_MAXPOOL: put(o, "    qrt_maxpool2d(&%s, a + %zu, a + %zu);\n", id, x, y); break;
    case IOP_AVGPOOL: put(o, "    qrt_avgpool2d(&%s, a + %zu, a + %zu);\n", id, x, y); break;
    case IOP_ADD:
        put(o, "    qrt_add(&%s, a + %zu, a + %zu, a + %zu);\n", id, x, p->bufs[op->in[1]].offset, y);
        break;
    case IOP_REQUANT: put(o, "    qrt_requant_n(&%s, a + %zu, a + %zu);\n", id, x, y); break;
    case IOP_RELU: put(o, "    qrt_relu(%d, %ld, a + %zu, a + %zu);\n", op->p.relu.n, (long)op->p.relu.lo, x, y); break;
    }
}

static void shape_str(char *s, size_t cap, int ndim, const int *shape) {
    size_t k = (size_t)snprintf(s, cap, "(");
    for (int i = 0; i < ndim && k < cap; i++) k += (size_t)snprintf(s + k, cap - k, "%s%d", i ? ", " : "", shape[i]);
    if (k < cap) snprintf(s + k, cap - k, ndim == 1 ? ",)" : ")");
}

static QtStatus write_header(const char *dir, const Emit *e, QtError *err) {
    char path[4200], file[128], in_s[64], out_s[64];
    const IntProgram *p = e->p;
    snprintf(file, sizeof file, "%s.h", e->name);
    shape_str(in_s, sizeof in_s, p->in_ndim, p->in_shape);
    shape_str(out_s, sizeof out_s, p->out_ndim, p->out_shape);
    Out o;
    QtStatus st = out_open(&o, dir, file, path, sizeof path, err);
    if (st != QT_OK) return st;
    const char *N = e->name, *U = e->upper;
    put(&o, "/* %s.h - int8 inference of the model in %s, exported by qtrain %s\n"
            " * (qtrain export --format c). C99, no dependency beyond the C library: no\n"
            " * malloc, no libm, no threads. One static arena: the functions are not\n"
            " * reentrant (one inference at a time per program).\n *\n"
            " * Input %s, channels first: the stored bytes of one example (as in the\n"
            " * data set: IDX/uint8 pixels) for %s_predict, or their int8 codes for\n"
            " * %s_predict_codes. The data set's scaling and normalization are in the\n"
            " * input table: code = table[byte] for every value", N, e->checkpoint_c, QTRAIN_VERSION, in_s, N, N);
    if (p->in_table) {
        if (p->in_table_c == 1)
            put(&o, ",\n * x = %.9g * byte + %.9g, code = clamp(round(x / %s_INPUT_SCALE) + %s_INPUT_ZERO_POINT).\n",
                (double)e->data->pixel_scale, (double)e->data->pixel_shift, U, U);
        else put(&o, " of channel c (one\n * map per channel: x = a_c * byte + b_c, then as below).\n");
    } else {
        put(&o, " (the data are not\n * stored as bytes: quantize floats with %s_quantize_input).\n", N);
    }
    put(&o, " * Output %s: int8 codes; real value = %s_OUTPUT_SCALE * (code - %s_OUTPUT_ZERO_POINT).\n"
            " * The integer semantics: docs/DEVICE.md of qtrain, and qtrain_rt.h. */\n", out_s, U, U);
    put(&o, "#ifndef %s_EXPORT_H\n#define %s_EXPORT_H\n\n#include <stdint.h>\n\n#ifdef __cplusplus\nextern \"C\" {\n#endif\n\n", U, U);
    put(&o, "#define %s_INPUT_SIZE %zu\n#define %s_INPUT_NDIM %d\n", U, p->in_size, U, p->in_ndim);
    static const char *const axis[3] = {"C", "H", "W"};
    for (int i = 0; i < p->in_ndim; i++) put(&o, "#define %s_INPUT_%s %d\n", U, p->in_ndim == 3 ? axis[i] : "F", p->in_shape[i]);
    put(&o, "#define %s_INPUT_SCALE %.9ef\n#define %s_INPUT_ZERO_POINT %ld\n", U, (double)p->in_scale, U,
        (long)p->in_zp);
    put(&o, "#define %s_OUTPUT_SIZE %zu\n#define %s_OUTPUT_SCALE %.9ef\n#define %s_OUTPUT_ZERO_POINT %ld\n", U,
        p->out_size, U, (double)p->out_scale, U, (long)p->out_zp);
    put(&o, "/* The one static arena (activations planned by lifetime, scratch), in bytes. */\n");
    put(&o, "#define %s_ARENA_BYTES %zu\n", U, p->arena_bytes);
    put(&o, "#define %s_MACS %.0f /* multiply-accumulates per inference */\n", U, p->macs);
    if (p->in_table) put(&o, "#define %s_HAS_BYTE_INPUT 1\n", U);
    put(&o, "#define %s_NUM_CLASSES %d\n\n", U, e->n_classes);
    if (e->n_classes > 0)
        put(&o, "/* Class names by index (the labels' order). */\nextern const char *const %s_class_names[%s_NUM_CLASSES];\n\n",
            N, U);
    if (p->in_table)
        put(&o, "/* One example's stored bytes (%s_INPUT_SIZE) -> logits (%s_OUTPUT_SIZE int8 codes).\n"
                " * Returns the index of the largest logit (the first of equal ones). */\n"
                "int %s_predict(const uint8_t *input, int8_t *logits);\n", U, U, N);
    put(&o, "/* The same from the input's int8 codes (%s_INPUT_SIZE). */\n"
            "int %s_predict_codes(const int8_t *codes, int8_t *logits);\n", U, N);
    put(&o, "/* Float helpers: x (the normalized input, as the model saw it in training) -> codes, rounding half\n"
            " * away from zero (qtrain rounds half to even: a value exactly half-way may differ by one code); and\n"
            " * codes -> real values. */\n"
            "void %s_quantize_input(const float *x, int8_t *codes);\n"
            "void %s_dequantize_output(const int8_t *logits, float *out);\n\n", N, N);
    put(&o, "#ifdef __cplusplus\n}\n#endif\n\n#endif\n");
    return out_close(&o, err);
}

static QtStatus write_source(const char *dir, const Emit *e, QtError *err) {
    char path[4200], file[128], id[MODULE_NAME_MAX + 80];
    const IntProgram *p = e->p;
    const char *N = e->name, *U = e->upper;
    snprintf(file, sizeof file, "%s.c", N);
    Out o;
    QtStatus st = out_open(&o, dir, file, path, sizeof path, err);
    if (st != QT_OK) return st;
    put(&o, "/* %s.c - the model of %s as an integer program: its constants and its op\n"
            " * sequence over qtrain_rt.c's kernels. Generated by qtrain %s; see %s.h. */\n"
            "#include \"%s.h\"\n\n#include <string.h>\n\n#include \"qtrain_rt.h\"\n",
        N, e->checkpoint_c, QTRAIN_VERSION, N, N);
    if (e->n_classes > 0) {
        put(&o, "\nconst char *const %s_class_names[%s_NUM_CLASSES] = {", N, U);
        for (int c = 0; c < e->n_classes; c++) put(&o, "%s\"%s\"", c ? ", " : "", e->classes[c]);
        put(&o, "};\n");
    }
    if (p->in_table) {
        put(&o, "\n/* The input's codes of every stored byte value, per channel. */\n");
        snprintf(id, sizeof id, "%s_input_table", N);
        put_i8(&o, "int8_t", id, p->in_table, (size_t)p->in_table_c * 256);
    }
    for (int k = 0; k < p->n_ops; k++) {
        op_ident(id, sizeof id, N, e->m, p, k);
        put_op_decl(&o, p, k, id);
    }
    put(&o, "\n/* Activations live here at offsets planned from their lifetimes (16-byte aligned where the compiler\n"
            " * can say so; the kernels need no more than the alignment of an int64_t). */\n"
            "static union {\n    int64_t align;\n    int8_t bytes[%s_ARENA_BYTES];\n}\n#if defined(__GNUC__)\n"
            "__attribute__((aligned(16)))\n#endif\n%s_arena;\n\n", U, N);
    put(&o, "static int %s_run(int8_t *logits) {\n    int8_t *a = %s_arena.bytes;\n    int best = 0, k;\n", N, N);
    for (int k = 0; k < p->n_ops; k++) put_op_call(&o, e, k);
    put(&o, "    memcpy(logits, a + %zu, %s_OUTPUT_SIZE);\n", p->bufs[p->out_buf].offset, U);
    put(&o, "    for (k = 1; k < %s_OUTPUT_SIZE; k++)\n        if (logits[k] > logits[best]) best = k;\n"
            "    return best;\n}\n\n", U);
    if (p->in_table && !e->transposed)
        put(&o, "int %s_predict(const uint8_t *input, int8_t *logits) {\n"
                "    qrt_quantize_u8(%d, %zu, %s_input_table, input, %s_arena.bytes + %zu);\n"
                "    return %s_run(logits);\n}\n\n", N, p->in_table_c, p->in_size / (size_t)p->in_table_c, N, N,
            p->bufs[p->in_buf].offset, N);
    if (p->in_table && e->transposed) {
        const int C = p->in_shape[0], H = p->in_shape[1], W = p->in_shape[2];
        put(&o, "/* The model was trained on transposed images (data.transform: transpose): code[c][i][j] is\n"
                " * the code of input[c][j][i]. */\n"
                "int %s_predict(const uint8_t *input, int8_t *logits) {\n"
                "    int8_t *x = %s_arena.bytes + %zu;\n    int c, i, j;\n"
                "    for (c = 0; c < %d; c++)\n        for (i = 0; i < %d; i++)\n"
                "            for (j = 0; j < %d; j++)\n"
                "                x[(c * %d + i) * %d + j] = %s_input_table[%sinput[(c * %d + j) * %d + i]];\n"
                "    return %s_run(logits);\n}\n\n", N, N, p->bufs[p->in_buf].offset, C, H, W, H, W, N,
            p->in_table_c == 1 ? "" : "c * 256 + ", W, H, N);
    }
    put(&o, "int %s_predict_codes(const int8_t *codes, int8_t *logits) {\n"
            "    memcpy(%s_arena.bytes + %zu, codes, %s_INPUT_SIZE);\n    return %s_run(logits);\n}\n\n", N, N,
        p->bufs[p->in_buf].offset, U, N);
    put(&o, "void %s_quantize_input(const float *x, int8_t *codes) {\n    int k;\n"
            "    for (k = 0; k < %s_INPUT_SIZE; k++) {\n"
            "        float v = x[k] / %s_INPUT_SCALE;\n        long q;\n"
            "        if (!(v > -1000.0f)) v = -1000.0f; /* and NaN */\n        if (v > 1000.0f) v = 1000.0f;\n"
            "        q = (long)(v < 0.0f ? v - 0.5f : v + 0.5f) + %s_INPUT_ZERO_POINT;\n"
            "        codes[k] = (int8_t)(q < -128 ? -128 : q > 127 ? 127 : q);\n    }\n}\n\n", N, U, U, U);
    put(&o, "void %s_dequantize_output(const int8_t *logits, float *out) {\n    int k;\n"
            "    for (k = 0; k < %s_OUTPUT_SIZE; k++) out[k] = %s_OUTPUT_SCALE * (float)(logits[k] - %s_OUTPUT_ZERO_POINT);\n"
            "}\n", N, U, U, U);
    return out_close(&o, err);
}

/* main_example.c: the template, with @N@ the name and @U@ its upper case. */
static const char MAIN_EXAMPLE[] =
    "/* main_example.c - runs @N@ on a set of examples and prints its accuracy.\n"
    " *   ./@N@_example IMAGES [LABELS] [-o LOGITS]\n"
    " * IMAGES: an IDX file of uint8 examples (Fashion-MNIST's t10k-images-idx3-ubyte)\n"
    " * or a raw file of N * @U@_INPUT_SIZE bytes; LABELS: an IDX file of uint8\n"
    " * labels (or raw, one byte per example); -o: writes the int8 logits, N *\n"
    " * @U@_OUTPUT_SIZE bytes. Loading uses malloc; the inference does not. */\n"
    "#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n\n#include \"@N@.h\"\n\n"
    "/* The file's bytes (*n of them), after its IDX header if it has one (uint8 data: 00 00 08 dims). */\n"
    "static unsigned char *load(const char *path, long *n) {\n"
    "    FILE *f = fopen(path, \"rb\");\n    long size;\n    unsigned char *b;\n"
    "    if (!f) { perror(path); return NULL; }\n"
    "    if (fseek(f, 0, SEEK_END) != 0 || (size = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) { fclose(f); return NULL; }\n"
    "    b = malloc(size ? (size_t)size : 1);\n"
    "    if (!b || fread(b, 1, (size_t)size, f) != (size_t)size) { fprintf(stderr, \"%s: read failed\\n\", path); fclose(f); free(b); return NULL; }\n"
    "    fclose(f);\n"
    "    *n = size;\n"
    "    if (size >= 8 && b[0] == 0 && b[1] == 0 && b[2] == 0x08 && b[3] >= 1 && b[3] <= 4 && size >= 4 + 4 * b[3]) {\n"
    "        *n = size - 4 - 4 * b[3];\n        memmove(b, b + 4 + 4 * b[3], (size_t)*n);\n    }\n"
    "    return b;\n}\n\n"
    "@LABELMAP@\n"
    "int main(int argc, char **argv) {\n"
    "    const char *images = NULL, *labels = NULL, *logits_path = NULL;\n"
    "    unsigned char *x, *y = NULL;\n    long nx = 0, ny = 0, n, i, correct = 0, used = 0;\n    int8_t out[@U@_OUTPUT_SIZE];\n"
    "    FILE *lf = NULL;\n    int k;\n"
    "    for (k = 1; k < argc; k++) {\n"
    "        if (strcmp(argv[k], \"-o\") == 0 && k + 1 < argc) logits_path = argv[++k];\n"
    "        else if (!images) images = argv[k];\n        else if (!labels) labels = argv[k];\n"
    "        else { fprintf(stderr, \"usage: %s IMAGES [LABELS] [-o LOGITS]\\n\", argv[0]); return 2; }\n    }\n"
    "    if (!images) { fprintf(stderr, \"usage: %s IMAGES [LABELS] [-o LOGITS]\\n\", argv[0]); return 2; }\n"
    "    if (!(x = load(images, &nx))) return 1;\n"
    "    if (nx % @U@_INPUT_SIZE) { fprintf(stderr, \"%s: %ld bytes is no whole number of %d-byte examples\\n\", images, nx, @U@_INPUT_SIZE); return 1; }\n"
    "    n = nx / @U@_INPUT_SIZE;\n"
    "    if (labels && (!(y = load(labels, &ny)) || ny != n)) { fprintf(stderr, \"%s: not %ld labels\\n\", labels, n); return 1; }\n"
    "    if (logits_path && !(lf = fopen(logits_path, \"wb\"))) { perror(logits_path); return 1; }\n"
    "    for (i = 0; i < n; i++) {\n"
    "        int c;\n"
    "        if (y && label_map[y[i]] < 0) continue; /* a class the model was not trained on */\n"
    "        c = @PREDICT@;\n"
    "        used++;\n"
    "        if (y && c == label_map[y[i]]) correct++;\n"
    "        if (lf && fwrite(out, 1, sizeof out, lf) != sizeof out) { perror(logits_path); return 1; }\n"
    "    }\n"
    "    if (lf && fclose(lf) != 0) { perror(logits_path); return 1; }\n"
    "    if (y) printf(\"examples:%ld accuracy:%.4f\\n\", used, used ? (double)correct / (double)used : 0.0);\n"
    "    else printf(\"examples:%ld\\n\", n);\n"
    "    free(x);\n    free(y);\n    return 0;\n}\n";

static QtStatus write_template(const char *dir, const char *file, const char *tmpl, const Emit *e, QtError *err) {
    char path[4200];
    Out o;
    QtStatus st = out_open(&o, dir, file, path, sizeof path, err);
    if (st != QT_OK) return st;
    for (const char *s = tmpl; *s; s++) {
        if (strncmp(s, "@N@", 3) == 0) put(&o, "%s", e->name), s += 2;
        else if (strncmp(s, "@U@", 3) == 0) put(&o, "%s", e->upper), s += 2;
        else if (strncmp(s, "@PREDICT@", 9) == 0) {
            if (e->p->in_table) put(&o, "%s_predict(x + i * %s_INPUT_SIZE, out)", e->name, e->upper);
            else put(&o, "%s_predict_codes((const int8_t *)(x + i * %s_INPUT_SIZE), out)", e->name, e->upper);
            s += 8;
        } else if (strncmp(s, "@LABELMAP@", 10) == 0) {
            put(&o, "/* A stored label -> the model's class (-1: a class the model was not trained on%s). */\n"
                    "static const int label_map[256] = {", e->relabel ? "; data.transform: classes" : ": none");
            for (int k = 0; k < 256; k++) put(&o, "%s%d,", k % 16 ? " " : "\n    ", e->label_map[k]);
            put(&o, "\n};\n");
            s += 9;
        } else if (fputc(*s, o.f) == EOF) o.failed = true;
    }
    return out_close(&o, err);
}

static QtStatus write_makefile(const char *dir, const Emit *e, QtError *err) {
    char path[4200];
    Out o;
    QtStatus st = out_open(&o, dir, "Makefile", path, sizeof path, err);
    if (st != QT_OK) return st;
    const char *N = e->name;
    put(&o, "# Builds %s_example (main_example.c): make, or make CC=aarch64-linux-gnu-gcc.\n"
            "# Add -DQRT_PORTABLE to CFLAGS for the plain C kernels only (the SIMD paths,\n"
            "# AVX2 with -mavx2 and ARM NEON, give the same integers).\n"
            "CC ?= cc\nCFLAGS ?= -O2\nCFLAGS += -std=c99 -Wall -Wextra -Werror\n\n"
            "%s_example: main_example.c %s.c %s.h qtrain_rt.c qtrain_rt.h\n"
            "\t$(CC) $(CFLAGS) -o $@ main_example.c %s.c qtrain_rt.c $(LDFLAGS)\n\n"
            "clean:\n\trm -f %s_example\n\n.PHONY: clean\n", N, N, N, N, N, N);
    return out_close(&o, err);
}

/* ---- export.json ----------------------------------------------------------------------------------------------- */

static void json_str(Out *o, const char *s) {
    put(o, "\"");
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') put(o, "\\%c", *s);
        else if ((unsigned char)*s < 0x20) put(o, "\\u%04x", *s);
        else put(o, "%c", *s);
    }
    put(o, "\"");
}

static void json_num(Out *o, double v) {
    if (isfinite(v)) put(o, "%.9g", v);
    else put(o, "null");
}

static QtStatus write_json(const char *dir, const Emit *e, const ExportCReport *r, QtError *err) {
    char path[4200];
    Out o;
    QtStatus st = out_open(&o, dir, "export.json", path, sizeof path, err);
    if (st != QT_OK) return st;
    const IntProgram *p = e->p;
    put(&o, "{\n  \"name\": ");
    json_str(&o, e->name);
    put(&o, ",\n  \"checkpoint\": ");
    json_str(&o, e->checkpoint);
    put(&o, ",\n  \"qtrain_version\": \"%s\",\n", QTRAIN_VERSION);
    put(&o, "  \"input\": {\"shape\": [");
    for (int i = 0; i < p->in_ndim; i++) put(&o, "%s%d", i ? ", " : "", p->in_shape[i]);
    put(&o, "], \"scale\": ");
    json_num(&o, p->in_scale);
    put(&o, ", \"zero_point\": %ld, \"byte_input\": %s},\n", (long)p->in_zp, p->in_table ? "true" : "false");
    put(&o, "  \"output\": {\"shape\": [");
    for (int i = 0; i < p->out_ndim; i++) put(&o, "%s%d", i ? ", " : "", p->out_shape[i]);
    put(&o, "], \"scale\": ");
    json_num(&o, p->out_scale);
    put(&o, ", \"zero_point\": %ld},\n", (long)p->out_zp);
    put(&o, "  \"weight_bytes\": %zu,\n  \"const_bytes\": %zu,\n  \"arena_bytes\": %zu,\n  \"io_bytes\": %zu,\n",
        r->weight_bytes, r->const_bytes, r->arena_bytes, r->io_bytes);
    put(&o, "  \"ram_bytes\": %zu,\n  \"macs\": %.0f,\n", r->arena_bytes + r->io_bytes, r->macs);
    if (r->code_measured)
        put(&o, "  \"cortex_m4\": {\"text\": %ld, \"rodata\": %ld, \"data\": %ld, \"bss\": %ld},\n"
                "  \"flash_bytes\": %ld,\n", r->text_bytes, r->rodata_bytes, r->data_bytes, r->bss_bytes,
            r->text_bytes + r->rodata_bytes + r->data_bytes);
    else
        put(&o, "  \"cortex_m4\": null,\n  \"flash_bytes\": null,\n");
    put(&o, "  \"test_examples\": %d,\n  \"integer_test_accuracy\": ", r->test_examples);
    json_num(&o, r->test_accuracy);
    put(&o, ",\n  \"integer_test_loss\": ");
    json_num(&o, r->test_loss);
    put(&o, ",\n  \"ops\": [\n");
    for (int k = 0; k < p->n_ops; k++) {
        const IntOp *op = &p->ops[k];
        put(&o, "    {\"module\": ");
        json_str(&o, e->m->modules[op->module].path);
        put(&o, ", \"op\": \"%s\", \"macs\": %.0f, \"out_offset\": %zu, \"out_bytes\": %zu, \"out_scale\": ",
            op_name(op->kind), op->macs, p->bufs[op->out].offset + op->out_at, p->bufs[op->out].bytes);
        json_num(&o, op->out_scale);
        put(&o, ", \"out_zero_point\": %ld}%s\n", (long)op->out_zero_point, k + 1 < p->n_ops ? "," : "");
    }
    put(&o, "  ]\n}\n");
    return out_close(&o, err);
}

/* ---- Cortex-M4 sizes ------------------------------------------------------------------------------------------- */

/* s as one shell word: in single quotes, each ' written as '\'' (out: cap bytes, at least 4 |s| + 3). */
static void shell_quote(char *out, size_t cap, const char *s) {
    size_t k = 0;
    out[k++] = '\'';
    for (; *s && k + 6 < cap; s++) {
        if (*s == '\'') memcpy(out + k, "'\\''", 4), k += 4;
        else out[k++] = *s;
    }
    out[k++] = '\'';
    out[k] = 0;
}

/* Compiles NAME.c and qtrain_rt.c for a Cortex-M4 with arm-none-eabi-gcc, when it is installed, and reads the
 * sections' sizes; the objects go to a scratch directory. Not installed: the report says unmeasured. Installed
 * but the build fails: an error (the C qtrain wrote does not compile), with the compiler's messages. */
static QtStatus measure_m4(const char *dir, const char *name, ExportCReport *r, QtError *err) {
    r->code_measured = false;
    if (system("command -v arm-none-eabi-gcc >/dev/null 2>&1 && command -v arm-none-eabi-size >/dev/null 2>&1") != 0)
        return QT_OK;
    char tmp[] = "/tmp/qtrain-m4-XXXXXX", cmd[24000], qdir[17000];
    if (!mkdtemp(tmp)) return qt_error_set(err, QT_ERR_IO, "a scratch directory in /tmp: %s", strerror(errno));
    shell_quote(qdir, sizeof qdir, dir); /* the name is a C identifier and tmp is ours: no quoting needed */
    snprintf(cmd, sizeof cmd,
             "cd %s && arm-none-eabi-gcc -std=c99 -mcpu=cortex-m4 -mthumb -Os -ffunction-sections -fdata-sections "
             "-Wall -Wextra -Werror -c %s.c -o %s/m.o 2>%s/cc.txt && arm-none-eabi-gcc -std=c99 -mcpu=cortex-m4 "
             "-mthumb -Os -ffunction-sections -fdata-sections -Wall -Wextra -Werror -c qtrain_rt.c -o %s/r.o "
             "2>>%s/cc.txt && arm-none-eabi-size -A %s/m.o %s/r.o > %s/size.txt 2>>%s/cc.txt",
             qdir, name, tmp, tmp, tmp, tmp, tmp, tmp, tmp, tmp);
    char path[64];
    QtStatus st = QT_OK;
    if (system(cmd) == 0) {
        snprintf(path, sizeof path, "%s/size.txt", tmp);
        FILE *f = fopen(path, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            char sec[256];
            long size;
            if (sscanf(line, "%255s %ld", sec, &size) != 2) continue;
            if (strncmp(sec, ".text", 5) == 0) r->text_bytes += size;
            else if (strncmp(sec, ".rodata", 7) == 0) r->rodata_bytes += size;
            else if (strncmp(sec, ".bss", 4) == 0) r->bss_bytes += size;
            else if (strncmp(sec, ".data", 5) == 0) r->data_bytes += size;
        }
        if (f) fclose(f), r->code_measured = true;
    } else {
        snprintf(path, sizeof path, "%s/cc.txt", tmp);
        char *msg = NULL;
        size_t n = 0;
        FILE *f = fopen(path, "r");
        if (f) {
            msg = calloc(1, 1001);
            if (msg) n = fread(msg, 1, 1000, f);
            fclose(f);
        }
        st = qt_error_set(err, QT_ERR_VALUE, "the C written for %s does not compile for a Cortex-M4 (a qtrain bug; "
                          "please report it with the model's config): %.*s", name, (int)n, msg ? msg : "");
        free(msg);
    }
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    if (system(cmd) != 0) { /* a scratch directory left in /tmp harms nothing */
    }
    return st;
}

/* ---- the directory --------------------------------------------------------------------------------------------- */

/* Removes dir and the regular files in it (an export's: no subdirectories). */
static void remove_flat_dir(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *ent;
    char path[4200];
    while (d && (ent = readdir(d))) {
        if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, ent->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    rmdir(dir);
}

/* out may be created: it does not exist, or with force it is a directory holding an export.json and no
 * subdirectory (a former export). */
static QtStatus check_out_dir(const char *out, bool force, QtError *err) {
    struct stat s;
    if (lstat(out, &s) != 0) {
        if (errno == ENOENT) return QT_OK;
        return qt_error_set(err, QT_ERR_ARG, "--out %s: %s", out, strerror(errno));
    }
    if (!force)
        return qt_error_set(err, QT_ERR_ARG, "--out %s exists; give a new directory, or --force to replace a former "
                            "export there", out);
    char j[4200];
    snprintf(j, sizeof j, "%s/export.json", out);
    if (!S_ISDIR(s.st_mode) || access(j, F_OK) != 0)
        return qt_error_set(err, QT_ERR_ARG, "--out %s is not a former export (a directory with an export.json); "
                            "--force replaces only those: give a new directory", out);
    DIR *d = opendir(out);
    struct dirent *ent;
    bool sub = false;
    while (d && (ent = readdir(d))) {
        if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0) continue;
        snprintf(j, sizeof j, "%s/%s", out, ent->d_name);
        struct stat t;
        if (lstat(j, &t) != 0 || !S_ISREG(t.st_mode)) sub = true;
    }
    if (d) closedir(d);
    if (sub)
        return qt_error_set(err, QT_ERR_ARG, "--out %s holds more than an export's files (a subdirectory or link); "
                            "not replacing it", out);
    return QT_OK;
}

static QtStatus check_name(const char *name, QtError *err) {
    bool ok = name[0] && (isalpha((unsigned char)name[0]) || name[0] == '_') && strlen(name) <= 48;
    for (const char *s = name; ok && *s; s++) ok = isalnum((unsigned char)*s) || *s == '_';
    /* the runtime's names (qrt_*) and the files beside NAME.c, also on a case-insensitive file system */
    if (!ok || strncasecmp(name, "qrt", 3) == 0 || strcasecmp(name, "qtrain_rt") == 0 ||
        strcasecmp(name, "main_example") == 0)
        return qt_error_set(err, QT_ERR_ARG, "--name '%s' is not a C identifier of at most 48 characters "
                            "([A-Za-z_][A-Za-z0-9_]*, not starting with qrt, not qtrain_rt or main_example)", name);
    return QT_OK;
}

/* The PTQ checkpoint to lower: `checkpoint` itself, or a converted (QAT) / merged (LoRA) copy in scratch. */
static QtStatus ptq_source(const char *checkpoint, const char *scratch, char *path, size_t cap, FILE *log,
                           QtError *err) {
    char *text = NULL;
    Config *c = malloc(sizeof *c);
    if (!c) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    QtStatus st = checkpoint_read_config(checkpoint, &text, err);
    if (st == QT_OK) st = config_load_string(c, text, checkpoint, NULL, 0, err);
    free(text);
    snprintf(path, cap, "%s", checkpoint);
    if (st == QT_OK && config_has_lora(c)) {
        char merged[4400];
        snprintf(merged, sizeof merged, "%s/merged.h5", scratch);
        MergeReport mr;
        if (log) fprintf(log, "merging the LoRA adapters of %s into its base\n", checkpoint);
        st = tools_merge(path, merged, false, false, NULL, &mr, err);
        if (st == QT_OK) {
            snprintf(path, cap, "%s", merged);
            text = NULL;
            st = checkpoint_read_config(path, &text, err);
            if (st == QT_OK) st = config_load_string(c, text, path, NULL, 0, err);
            free(text);
        }
    }
    if (st == QT_OK && c->quant.mode == QUANT_MODE_QAT) {
        char conv[4400];
        snprintf(conv, sizeof conv, "%s/converted.h5", scratch);
        ConvertReport cr;
        if (log) fprintf(log, "converting the QAT checkpoint %s to PTQ\n", path);
        st = tools_convert(path, conv, false, NULL, &cr, err);
        if (st == QT_OK) snprintf(path, cap, "%s", conv);
    }
    free(c);
    return st;
}

static QtStatus write_all(const char *dir, const Emit *e, ExportCReport *rep, QtError *err) {
    char file[128];
    QtStatus st = write_header(dir, e, err);
    if (st == QT_OK) st = write_source(dir, e, err);
    if (st == QT_OK) st = write_text(dir, "qtrain_rt.h", export_rt_h, err);
    if (st == QT_OK) st = write_text(dir, "qtrain_rt.c", export_rt_c, err);
    if (st == QT_OK) st = write_template(dir, "main_example.c", MAIN_EXAMPLE, e, err);
    if (st == QT_OK) st = write_makefile(dir, e, err);
    snprintf(file, sizeof file, "%s.c", e->name);
    if (st == QT_OK) st = measure_m4(dir, e->name, rep, err);
    if (st == QT_OK) st = write_json(dir, e, rep, err);
    return st;
}

QtStatus export_c(const char *checkpoint, const char *out, const char *name, bool force, bool low_ram, FILE *log,
                  ExportCReport *rep, QtError *err) {
    memset(rep, 0, sizeof *rep);
    if (!name) name = "model";
    QtStatus st = check_name(name, err);
    if (st == QT_OK) st = check_out_dir(out, force, err);
    if (st != QT_OK) return st;
    char parent[4096], work[4160], scratch[4200], src[4400], outp[4096];
    snprintf(outp, sizeof outp, "%s", out);
    for (size_t n = strlen(outp); n > 1 && outp[n - 1] == '/'; n--) outp[n - 1] = 0; /* "dir/" is dir */
    out = outp;
    if (!fs_parent_dir(out, parent, sizeof parent)) snprintf(parent, sizeof parent, ".");
    snprintf(work, sizeof work, "%s/.qtrain-export-XXXXXX", parent);
    if (!mkdtemp(work))
        return qt_error_set(err, QT_ERR_IO, "--out %s: cannot create a directory in %s: %s", out, parent,
                            strerror(errno));
    const mode_t mask = umask(0);
    umask(mask);
    chmod(work, 0777 & ~mask); /* as mkdir would make it, not mkdtemp's 0700 */
    snprintf(scratch, sizeof scratch, "%s/.scratch", work);
    if (mkdir(scratch, 0700) != 0) {
        rmdir(work);
        return qt_error_set(err, QT_ERR_IO, "%s: %s", scratch, strerror(errno));
    }
    st = ptq_source(checkpoint, scratch, src, sizeof src, log, err);
    Config *cfg = calloc(1, sizeof *cfg);
    char *text = NULL;
    if (st == QT_OK && !cfg) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK) st = checkpoint_read_config(src, &text, err);
    if (st == QT_OK) st = config_load_string(cfg, text, src, NULL, 0, err);
    free(text);
    Run r;
    TrainOptions o = {.quiet = true};
    IntProgram p;
    memset(&p, 0, sizeof p);
    if (cfg) run_init(&r, cfg, &o);
    if (st == QT_OK) st = eval_int_load(&r, src, &p, low_ram, err);
    IntEvalResult ev = {0};
    if (st == QT_OK) st = eval_int_run(&p, &r.data.test, cfg->data.target == DATA_TARGET_INPUT, NULL, &ev, err);
    if (st == QT_OK) {
        char upper[64];
        size_t k = 0;
        for (; name[k] && k + 1 < sizeof upper; k++) upper[k] = (char)toupper((unsigned char)name[k]);
        upper[k] = 0;
        static char num_names[DATASET_MAX_CLASSES][8];
        const char *names[DATASET_MAX_CLASSES];
        const int nc = r.data.test.labels ? r.data.test.n_classes : 0;
        const bool fashion = strcmp(cfg->data.dataset, "fashion-mnist") == 0;
        for (int c = 0; c < nc && c < DATASET_MAX_CLASSES; c++) {
            snprintf(num_names[c], sizeof num_names[c], "%d", c);
            names[c] = fashion && nc == 10 ? FASHION_NAMES[c] : num_names[c];
        }
        Emit e = {.name = name, .upper = upper, .checkpoint = checkpoint, .p = &p, .m = &r.model.net.model,
                  .data = &r.data.test, .classes = names, .n_classes = nc};
        comment_safe(e.checkpoint_c, sizeof e.checkpoint_c, checkpoint);
        /* what the data transforms did to the stored images and labels, which the device sees as stored */
        for (int k = 0; k < 256; k++) e.label_map[k] = k;
        for (int t = 0; t < cfg->data.n_transforms; t++) {
            const Transform *tr = &cfg->data.transforms[t];
            if (tr->kind == TRANSFORM_TRANSPOSE) e.transposed = !e.transposed;
            if (tr->kind != TRANSFORM_CLASSES) continue;
            e.relabel = true;
            for (int k = 0; k < 256; k++) {
                int to = -1;
                for (int c = 0; e.label_map[k] >= 0 && c < tr->n_classes; c++)
                    if (tr->classes[c] == e.label_map[k]) to = c;
                e.label_map[k] = to;
            }
        }
        if (e.relabel)
            for (int c = 0; c < nc; c++) {
                names[c] = num_names[c];
                for (int k = 0; fashion && k < 10; k++)
                    if (e.label_map[k] == c) names[c] = FASHION_NAMES[k];
            }
        rep->weight_bytes = p.weight_bytes, rep->const_bytes = p.const_bytes, rep->arena_bytes = p.arena_bytes;
        rep->io_bytes = p.in_size + p.out_size, rep->macs = p.macs, rep->ops = p.n_ops;
        rep->conv_layers = p.conv_layers, rep->dense_layers = p.dense_layers, rep->int4_layers = p.int4_layers;
        rep->test_accuracy = ev.accuracy, rep->test_loss = ev.loss, rep->test_examples = ev.n;
        st = write_all(work, &e, rep, err);
    }
    intprog_free(&p);
    if (cfg) run_free(&r);
    free(cfg);
    remove_flat_dir(scratch);
    if (st == QT_OK) {
        char old[4300] = "";
        struct stat s;
        if (lstat(out, &s) == 0) { /* --force over a former export (checked above): move it aside first */
            snprintf(old, sizeof old, "%s/.qtrain-export-old-XXXXXX", parent);
            if (!mkdtemp(old) || rmdir(old) != 0 || rename(out, old) != 0)
                st = qt_error_set(err, QT_ERR_IO, "--out %s: cannot move the former export aside: %s", out,
                                  strerror(errno));
        }
        if (st == QT_OK && rename(work, out) != 0) {
            st = qt_error_set(err, QT_ERR_IO, "--out %s: %s", out, strerror(errno));
            if (old[0]) rename(old, out);
        }
        if (st == QT_OK && old[0]) remove_flat_dir(old);
    }
    if (st != QT_OK) {
        remove_flat_dir(work);
        return st;
    }
    if (log) fprintf(log, "exported %s as C -> %s/\n", checkpoint, out);
    return QT_OK;
}
