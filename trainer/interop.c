/* interop.c - models in and out of PyTorch: `qtrain export` (a checkpoint as
 * a PyTorch state_dict in safetensors, or as a float HDF5 checkpoint) and
 * model.init_from of a .safetensors file.
 *
 * Names are PyTorch's: a module path and the tensor, "conv1.weight",
 * "bn1.running_mean", the config's module names being the state_dict's.
 * Weights are float32 as qtrain evaluates them: quantized ones dequantized,
 * adapters folded in with --merge (tools_float_net). A batch norm folded
 * into the layer before it (PTQ) is written as the identity PyTorch's eval
 * computes exactly, plus the shift it carries: running_mean 0, running_var
 * such that running_var + eps is 1.0f, weight 1, bias the shift (or 0). */
#include "interop.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/fsutil.h"
#include "base/safetensors.h"
#include "trainer/tools.h"

bool interop_is_safetensors(const char *path) {
    const size_t n = strlen(path), k = strlen(".safetensors");
    return n > k && strcmp(path + n - k, ".safetensors") == 0;
}

/* "conv1/weight" -> "conv1.weight" (module paths have no '.' or '/'). */
static void torch_name(char *out, size_t cap, const char *param) {
    snprintf(out, cap, "%s", param);
    for (char *p = out; *p; p++)
        if (*p == '/') *p = '.';
}

/* The float that makes (float)(v + eps) exactly 1: PyTorch then divides by sqrt(1) = 1. */
static float unit_var(float eps) {
    float v = 1.0f - eps;
    for (int i = 0; i < 64 && v + eps != 1.0f; i++) v = nextafterf(v, v + eps < 1.0f ? 2.0f : 0.0f);
    return v;
}

/* Tensors of the float model m: parameters, then each batch norm's buffers; *bufs gets the floats it made
 * (freed by the caller). */
static QtStatus collect(const Model *m, StWrite **out, int *n_out, float **bufs, char (**names)[ST_NAME_MAX],
                        QtError *err) {
    int n_bn = 0;
    for (int i = 0; i < m->n_modules; i++) n_bn += m->modules[i].running_mean != NULL;
    const int cap = m->n_params + 5 * n_bn;
    StWrite *w = calloc((size_t)cap + 1, sizeof *w);
    char (*nm)[ST_NAME_MAX] = calloc((size_t)cap + 1, sizeof *nm);
    size_t floats = 0;
    for (int i = 0; i < m->n_modules; i++)
        if (m->modules[i].running_mean) floats += 5 * (size_t)m->modules[i].in_shape[0] + 1;
    float *b = malloc((floats + 1) * sizeof *b);
    if (!w || !nm || !b) {
        free(w), free(nm), free(b);
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory listing the model's tensors");
    }
    int k = 0;
    size_t at = 0;
    for (int i = 0; i < m->n_params; i++) {
        const Param *p = &m->params[i];
        const Module *mod = NULL;
        for (int j = 0; j < m->n_modules && !mod; j++)
            if (m->modules[j].weight == p || m->modules[j].bias == p) mod = &m->modules[j];
        if (mod && mod->running_mean && mod->bn_folded != BN_FOLD_NONE) continue; /* written below */
        torch_name(nm[k], sizeof nm[k], p->name);
        w[k].name = nm[k], w[k].data = p->var.value.data, w[k].ndim = p->var.value.ndim;
        for (int d = 0; d < w[k].ndim; d++) w[k].shape[d] = p->var.value.shape[d];
        k++;
    }
    for (int i = 0; i < m->n_modules; i++) {
        const Module *mod = &m->modules[i];
        if (!mod->running_mean) continue;
        const int C = mod->in_shape[0];
        const bool folded = mod->bn_folded != BN_FOLD_NONE;
        static const char *const tensors[5] = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"};
        /* a folded batch norm without affine parameters (affine: false) is written without them, as PyTorch's */
        for (int t = folded && !mod->spec.no_affine ? 0 : 2; t < 5; t++) {
            float *dst = b + at;
            const int len = t == 4 ? 1 : C;
            for (int c = 0; c < len && t < 4; c++) {
                float v;
                if (!folded) v = t == 2 ? mod->running_mean[c] : mod->running_var[c];
                else if (t == 0) v = 1.0f;
                else if (t == 1) v = mod->bn_folded == BN_FOLD_BIAS && mod->bias ? mod->bias->var.value.data[c] : 0.0f;
                else if (t == 2) v = 0.0f;
                else v = unit_var(mod->bn.eps);
                dst[c] = v;
            }
            snprintf(nm[k], sizeof nm[k], "%s.%s", mod->path, tensors[t]);
            w[k].name = nm[k], w[k].ndim = t == 4 ? 0 : 1, w[k].shape[0] = C;
            if (t == 4) w[k].data_i64 = &mod->num_batches_tracked; /* int64, as PyTorch's buffer */
            else w[k].data = dst;
            k++, at += t == 4 ? 0 : (size_t)len;
        }
    }
    *out = w, *n_out = k, *bufs = b, *names = nm;
    return QT_OK;
}

QtStatus interop_write_state_dict(const char *out, const Model *m, const char *checkpoint, bool merge, QtError *err) {
    StWrite *w = NULL;
    float *bufs = NULL;
    char (*names)[ST_NAME_MAX] = NULL;
    int n = 0;
    QtStatus st = collect(m, &w, &n, &bufs, &names, err);
    const char *const meta[3][2] = {{"format", "pt"},
                                    {"qtrain_checkpoint", checkpoint},
                                    {"qtrain_merged", merge ? "true" : "false"}};
    if (st == QT_OK) st = st_write_f32(out, w, n, meta, 3, err);
    free(w), free(bufs), free(names);
    return st;
}

QtStatus interop_export(const char *checkpoint, const char *format, const char *out, bool merge, bool force,
                        FILE *log, QtError *err) {
    const bool st_fmt = strcmp(format, "safetensors") == 0, h5 = strcmp(format, "h5") == 0;
    if (strcmp(format, "peft") == 0) {
        if (merge)
            return qt_error_set(err, QT_ERR_ARG, "qtrain export: --format peft writes the adapters apart from the "
                                "base; --merge does not apply (use --format safetensors --merge for a merged model)");
        return interop_export_peft(checkpoint, out, force, log, err);
    }
    if (!st_fmt && !h5)
        return qt_error_set(err, QT_ERR_ARG, "qtrain export: unknown --format '%s'; use safetensors, peft, h5 or c",
                            format);
    QtStatus st = fs_check_out_path(out, force, "--out", err);
    if (st != QT_OK) return st;
    Config *c = malloc(sizeof *c);
    if (!c) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (!merge && (st = tools_load_config(checkpoint, c, err)) == QT_OK) /* the base alone must be a model */
        for (int i = 0; st == QT_OK && i < c->lora.n_rules; i++)
            if (!c->lora.rules[i].skip && lora_init_is_svd(c->lora.rules[i].spec.init))
                st = qt_error_set(err, QT_ERR_CONFIG, "%s: its lora rule %d has init %s, so its base is the residual "
                                  "that init fitted, not a model without the adapters; export with --merge (the "
                                  "trained model) or --format peft (that base and the adapters)", checkpoint, i,
                                  lora_init_name(c->lora.rules[i].spec.init));
    if (st != QT_OK) {
        free(c);
        return st;
    }
    Net fl;
    st = tools_float_net(checkpoint, merge, c, &fl, log, err);
    if (st == QT_OK) {
        st = st_fmt ? interop_write_state_dict(out, &fl.model, checkpoint, merge, err)
                    : tools_save_float(out, force, &fl, checkpoint, err);
        if (st == QT_OK && log)
            fprintf(log, "exported %s%s as %s -> %s\n", checkpoint, merge ? " (adapters merged)" : "", format, out);
        net_free(&fl);
    }
    free(c);
    return st;
}

/* ---- model.init_from: a .safetensors file ---------------------------------------------------------------------- */

/* "a, b, c" of up to 8 names, then "and N more". */
static void name_list(char *buf, size_t cap, const char *const *names, int n) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && i < 8 && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%s", i ? ", " : "", names[i]);
    if (n > 8 && at < cap) snprintf(buf + at, cap - at, " and %d more", n - 8);
}

/* The tensor a model slot reads: its name, destination, element count and shape. */
typedef struct {
    char name[ST_NAME_MAX];
    float *dst;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    bool optional; /* num_batches_tracked */
    int64_t *count; /* num_batches_tracked's destination */
} Slot;

static int model_slots(Model *m, Slot *s, int cap) {
    int k = 0;
    for (int i = 0; i < m->n_params && k < cap; i++, k++) {
        Param *p = &m->params[i];
        torch_name(s[k].name, sizeof s[k].name, p->name);
        s[k].dst = p->var.value.data, s[k].ndim = p->var.value.ndim;
        for (int d = 0; d < s[k].ndim; d++) s[k].shape[d] = p->var.value.shape[d];
    }
    for (int i = 0; i < m->n_modules; i++) {
        Module *mod = &m->modules[i];
        if (!mod->running_mean || k + 3 > cap) continue;
        snprintf(s[k].name, sizeof s[k].name, "%s.running_mean", mod->path);
        s[k].dst = mod->running_mean, s[k].ndim = 1, s[k].shape[0] = mod->in_shape[0], k++;
        snprintf(s[k].name, sizeof s[k].name, "%s.running_var", mod->path);
        s[k].dst = mod->running_var, s[k].ndim = 1, s[k].shape[0] = mod->in_shape[0], k++;
        snprintf(s[k].name, sizeof s[k].name, "%s.num_batches_tracked", mod->path);
        s[k].ndim = 0, s[k].optional = true, s[k].count = &mod->num_batches_tracked, k++;
    }
    return k;
}

static bool same_shape(const Slot *s, const StTensor *t) {
    if (s->ndim != t->ndim) return false;
    for (int d = 0; d < s->ndim; d++)
        if (s->shape[d] != t->shape[d]) return false;
    return true;
}

static void shape_text(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t at = (size_t)snprintf(buf, cap, "(");
    for (int d = 0; d < ndim && at < cap; d++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (at < cap) snprintf(buf + at, cap - at, "%s)", ndim == 1 ? "," : "");
}

/* A scalar count (num_batches_tracked): I64 or I32 read as stored, a float tensor rounded. */
static QtStatus read_count(const StFile *f, const StTensor *t, int64_t *out, QtError *err) {
    if (t->dtype != ST_I64 && t->dtype != ST_I32) {
        float v = 0.0f;
        QtStatus st = st_read_f32(f, t, &v, 1, err);
        if (st == QT_OK && !(v >= 0.0f && v < 9.2e18f))
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: %s is %g; a count must be a non-negative number", f->path,
                              t->name, (double)v);
        if (st == QT_OK) *out = (int64_t)v;
        return st;
    }
    uint8_t b[8] = {0};
    const size_t len = t->dtype == ST_I64 ? 8 : 4;
    if (pread(f->fd, b, len, (off_t)(f->data_start + t->begin)) != (ssize_t)len)
        return qt_error_set(err, QT_ERR_IO, "%s: cannot read %s", f->path, t->name);
    int64_t v = 0;
    if (len == 8) {
        for (int i = 7; i >= 0; i--) v = (int64_t)((uint64_t)v << 8 | b[i]);
    } else {
        int32_t w = (int32_t)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24);
        v = w;
    }
    if (v < 0) return qt_error_set(err, QT_ERR_FORMAT, "%s: %s is %lld; a count must be >= 0", f->path, t->name,
                                   (long long)v);
    *out = v;
    return QT_OK;
}

QtStatus interop_load_safetensors(const char *path, Model *m, QtError *err) {
    StFile f;
    QtStatus st = st_open(&f, path, err);
    if (st != QT_OK) return st;
    const int cap = m->n_params + 3 * m->n_modules + 1;
    Slot *slots = calloc((size_t)cap, sizeof *slots);
    const char **missing = calloc((size_t)cap + (size_t)f.n + 1, sizeof *missing), **extra = missing + cap;
    bool *used = calloc((size_t)f.n + 1, 1);
    if (!slots || !missing || !used) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory reading '%s'", path);
    const int n = st == QT_OK ? model_slots(m, slots, cap) : 0;
    int n_missing = 0, n_extra = 0;
    for (int i = 0; st == QT_OK && i < n; i++) { /* which tensors are there at all, before any is read */
        const StTensor *t = st_find(&f, slots[i].name);
        if (t) used[t - f.tensors] = true;
        else if (!slots[i].optional) missing[n_missing++] = slots[i].name;
    }
    for (int j = 0; st == QT_OK && j < f.n; j++)
        if (!used[j]) extra[n_extra++] = f.tensors[j].name;
    char list[1024], list2[1024];
    if (st == QT_OK && (n_missing || n_extra)) {
        name_list(list, sizeof list, missing, n_missing);
        name_list(list2, sizeof list2, extra, n_extra);
        st = qt_error_set(err, QT_ERR_FORMAT, "%s does not hold the config's model: it lacks %d tensor%s the model "
                          "needs (%s) and holds %d it does not have (%s); names are PyTorch's state_dict keys, "
                          "<module>.<tensor>, with the config's module names", path, n_missing,
                          n_missing == 1 ? "" : "s", n_missing ? list : "none", n_extra, n_extra ? list2 : "none");
    }
    for (int i = 0; st == QT_OK && i < n; i++) {
        const StTensor *t = st_find(&f, slots[i].name);
        if (!t) continue;
        char a[128], b[128];
        if (!same_shape(&slots[i], t)) {
            shape_text(a, sizeof a, t->ndim, t->shape), shape_text(b, sizeof b, slots[i].ndim, slots[i].shape);
            st = qt_error_set(err, QT_ERR_FORMAT, "%s: tensor %s has shape %s, but the config's model needs %s; the "
                              "file is of another model (check model.layers)", path, slots[i].name, a, b);
            break;
        }
        if (slots[i].count) { /* num_batches_tracked: int64 as PyTorch writes it, or a float */
            st = read_count(&f, t, slots[i].count, err);
            continue;
        }
        size_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= (size_t)t->shape[d];
        st = st_read_f32(&f, t, slots[i].dst, numel, err);
    }
    free(slots), free(missing), free(used);
    st_close(&f);
    return st;
}
