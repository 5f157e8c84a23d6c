/* interop_peft.c - `qtrain export --format peft`: a LoRA or QLoRA run's
 * adapters as the directory PEFT's PeftModel.from_pretrained loads.
 *
 *   adapter_config.json        peft_type LORA, r and lora_alpha (PEFT's
 *                              scale, lora_alpha / r or / sqrt(r) with
 *                              use_rslora, equals qtrain's; modules of
 *                              other ranks in rank_pattern / alpha_pattern),
 *                              lora_dropout, target_modules (the adapted
 *                              modules' names), modules_to_save
 *                              (lora.trainable), bias "none", use_dora
 *   adapter_model.safetensors  base_model.model.<module>.lora_A.weight
 *                              (r, in) or (r, C, kh, kw), .lora_B.weight
 *                              (out, r) or (out, r, 1, 1); DoRA's
 *                              .lora_magnitude_vector (out) or (1, OC, 1,
 *                              1), the key and shapes PEFT saves; for each
 *                              module to save its parameters and
 *                              batch-norm buffers as base_model.model.<module>.<tensor>
 *   base_model.safetensors     the base the adapters were trained on, float32
 *                              (a quantized base dequantized), without them:
 *                              a QLoRA adapter belongs to its quantized base. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/safetensors.h"
#include "interop.h"
#include "lora/lora.h"
#include "trainer/checkpoint_internal.h"
#include "trainer/hook.h"
#include "trainer/tools.h"
#include "trainer/train.h"
#include "trainer/yamltree.h"

#define PEFT_PREFIX "base_model.model."

/* Appends s to the growing text t (a JSON string with escapes when quoted). */
typedef struct {
    char *buf;
    size_t len, cap;
    bool oom;
} Text;

static void put(Text *t, const char *s, size_t n) {
    if (t->oom) return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 1024;
        while (cap < t->len + n + 1) cap *= 2;
        char *b = realloc(t->buf, cap);
        if (!b) {
            t->oom = true;
            return;
        }
        t->buf = b, t->cap = cap;
    }
    memcpy(t->buf + t->len, s, n);
    t->len += n;
    t->buf[t->len] = '\0';
}

static void puts_(Text *t, const char *s) { put(t, s, strlen(s)); }

static void put_str(Text *t, const char *s) {
    puts_(t, "\"");
    for (const char *p = s; *p; p++) {
        char e[8];
        if (*p == '"' || *p == '\\') snprintf(e, sizeof e, "\\%c", *p);
        else if ((unsigned char)*p < 0x20) snprintf(e, sizeof e, "\\u%04x", (unsigned char)*p);
        else e[0] = *p, e[1] = '\0';
        puts_(t, e);
    }
    puts_(t, "\"");
}

/* The shortest decimal that reads back as the same float (JSON readers parse a double; PEFT's float of it is
 * then this one). */
static void put_num(Text *t, double v) {
    char b[40];
    for (int digits = 6; digits <= 17; digits++) {
        snprintf(b, sizeof b, "%.*g", digits, v);
        if ((float)strtod(b, NULL) == (float)v) break;
    }
    puts_(t, b);
}

/* Whether module i is one of PEFT's modules_to_save: trained in full (lora.trainable), or a batch norm that
 * lora.batchnorm: train trains. */
static bool peft_saved(const Net *n, int i) { return n->is_trainable[i] || (n->bn_trained && n->bn_trained[i]); }

/* PEFT's lora_alpha for adapter a: the alpha whose scale (alpha / r, or / sqrt(r)) is a's. */
static double peft_alpha(const LoraAdapter *a) {
    return a->spec.rslora ? (double)a->scale * sqrt((double)a->spec.rank) : (double)a->scale * a->spec.rank;
}

/* adapter_config.json's text for the net's adapters and lora.trainable. */
static char *config_json(const Net *n, QtError *err) {
    const int na = net_hook_count(n, &HOOK_LORA);
    const LoraAdapter *a0 = net_adapter(n, 0);
    Text t = {0};
    puts_(&t, "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": null,\n  \"base_model_name_or_path\": null,\n");
    puts_(&t, "  \"r\": ");
    put_num(&t, a0->spec.rank);
    puts_(&t, ",\n  \"lora_alpha\": ");
    put_num(&t, peft_alpha(a0));
    puts_(&t, ",\n  \"use_rslora\": ");
    puts_(&t, a0->spec.rslora ? "true" : "false");
    puts_(&t, ",\n  \"lora_dropout\": ");
    put_num(&t, a0->spec.dropout);
    puts_(&t, ",\n  \"bias\": \"none\",\n  \"fan_in_fan_out\": false,\n  \"inference_mode\": true,\n"
              "  \"init_lora_weights\": true,\n  \"use_dora\": ");
    puts_(&t, a0->spec.dora ? "true" : "false");
    puts_(&t, ",\n  \"target_modules\": [");
    for (int i = 0; i < na; i++) {
        if (i) puts_(&t, ", ");
        put_str(&t, net_adapter(n, i)->module->path);
    }
    puts_(&t, "],\n  \"rank_pattern\": {");
    for (int i = 0, k = 0; i < na; i++) {
        const LoraAdapter *a = net_adapter(n, i);
        if (a->spec.rank == a0->spec.rank) continue;
        if (k++) puts_(&t, ", ");
        put_str(&t, a->module->path), puts_(&t, ": "), put_num(&t, a->spec.rank);
    }
    puts_(&t, "},\n  \"alpha_pattern\": {");
    for (int i = 0, k = 0; i < na; i++) {
        const LoraAdapter *a = net_adapter(n, i);
        if (peft_alpha(a) == peft_alpha(a0)) continue;
        if (k++) puts_(&t, ", ");
        put_str(&t, a->module->path), puts_(&t, ": "), put_num(&t, peft_alpha(a));
    }
    puts_(&t, "},\n  \"modules_to_save\": ");
    int saved = 0;
    for (int i = 0; i < n->model.n_modules; i++) {
        if (!peft_saved(n, i)) continue;
        puts_(&t, saved++ ? ", " : "[");
        put_str(&t, n->model.modules[i].path);
    }
    puts_(&t, saved ? "]" : "null");
    puts_(&t, "\n}\n");
    if (t.oom) {
        free(t.buf);
        qt_error_set(err, QT_ERR_NOMEM, "out of memory writing adapter_config.json");
        return NULL;
    }
    return t.buf;
}

/* The adapters' and saved modules' tensors under PEFT's names; *names holds the name strings. */
static QtStatus adapter_tensors(const Net *n, StWrite **out, int *n_out, char (**names)[ST_NAME_MAX],
                                float **bufs, QtError *err) {
    const int na = net_hook_count(n, &HOOK_LORA);
    const Model *m = &n->model;
    int cap = 3 * na;
    size_t floats = 0;
    for (int i = 0; i < m->n_modules; i++)
        if (peft_saved(n, i))
            cap += 5, floats += m->modules[i].running_mean ? 2 * (size_t)m->modules[i].in_shape[0] + 1 : 0;
    StWrite *w = calloc((size_t)cap + 1, sizeof *w);
    char (*nm)[ST_NAME_MAX] = calloc((size_t)cap + 1, sizeof *nm);
    float *b = malloc((floats + 1) * sizeof *b);
    if (!w || !nm || !b) {
        free(w), free(nm), free(b);
        return qt_error_set(err, QT_ERR_NOMEM, "out of memory listing the adapters");
    }
    int k = 0;
    for (int i = 0; i < na; i++) {
        const LoraAdapter *a = net_adapter(n, i);
        const Param *ab[2] = {&a->A, &a->B};
        for (int j = 0; j < 2; j++, k++) {
            snprintf(nm[k], sizeof nm[k], PEFT_PREFIX "%s.lora_%c.weight", a->module->path, j ? 'B' : 'A');
            w[k].name = nm[k], w[k].data = ab[j]->var.value.data, w[k].ndim = ab[j]->var.value.ndim;
            for (int d = 0; d < w[k].ndim; d++) w[k].shape[d] = ab[j]->var.value.shape[d];
        }
        if (!a->spec.dora) continue;
        /* PEFT's magnitude: (out,) for a linear layer, (1, OC, 1, 1) for a conv (DoraConv2dLayer keeps the norm's
           keepdim shape) */
        snprintf(nm[k], sizeof nm[k], PEFT_PREFIX "%s.lora_magnitude_vector", a->module->path);
        w[k].name = nm[k], w[k].data = a->M.var.value.data;
        if (a->module->spec.type == LAYER_CONV2D) w[k].ndim = 4, w[k].shape[0] = 1, w[k].shape[1] = a->out,
                                                  w[k].shape[2] = w[k].shape[3] = 1;
        else w[k].ndim = 1, w[k].shape[0] = a->out;
        k++;
    }
    size_t at = 0;
    for (int i = 0; i < m->n_modules; i++) {
        const Module *mod = &m->modules[i];
        if (!peft_saved(n, i)) continue;
        const Param *ps[2] = {mod->weight, mod->bias};
        static const char *const pn[2] = {"weight", "bias"};
        for (int j = 0; j < 2; j++) {
            if (!ps[j]) continue;
            snprintf(nm[k], sizeof nm[k], PEFT_PREFIX "%s.%s", mod->path, pn[j]);
            w[k].name = nm[k], w[k].data = ps[j]->var.value.data, w[k].ndim = ps[j]->var.value.ndim;
            for (int d = 0; d < w[k].ndim; d++) w[k].shape[d] = ps[j]->var.value.shape[d];
            k++;
        }
        if (!mod->running_mean) continue;
        const int C = mod->in_shape[0];
        static const char *const bn[3] = {"running_mean", "running_var", "num_batches_tracked"};
        for (int j = 0; j < 3; j++, k++) {
            snprintf(nm[k], sizeof nm[k], PEFT_PREFIX "%s.%s", mod->path, bn[j]);
            w[k].name = nm[k], w[k].ndim = j == 2 ? 0 : 1, w[k].shape[0] = C;
            if (j == 2) { /* int64, as PyTorch's buffer */
                w[k].data_i64 = &mod->num_batches_tracked;
                continue;
            }
            float *dst = b + at;
            for (int c = 0; c < C; c++) dst[c] = j == 0 ? mod->running_mean[c] : mod->running_var[c];
            w[k].data = dst;
            at += (size_t)C;
        }
    }
    *out = w, *n_out = k, *names = nm, *bufs = b;
    return QT_OK;
}

QtStatus interop_export_peft(const char *checkpoint, const char *dir, bool force, FILE *log, QtError *err) {
    struct stat sb;
    if (lstat(dir, &sb) == 0 && !(force && S_ISDIR(sb.st_mode)))
        return qt_error_set(err, QT_ERR_IO, "--out %s exists; a PEFT adapter directory is written into a new "
                            "directory (or an existing one with --force)", dir);
    Config *c = malloc(sizeof *c), *fc = malloc(sizeof *fc);
    Net n, base;
    memset(&n, 0, sizeof n), memset(&base, 0, sizeof base);
    QtStatus st = c && fc ? tools_load_net(checkpoint, c, &n, err) : qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    if (st == QT_OK && net_hook_count(&n, &HOOK_LORA) == 0)
        st = qt_error_set(err, QT_ERR_CONFIG, "%s has no LoRA adapters: nothing for PEFT (export the model with "
                          "--format safetensors)", checkpoint);
    for (int i = 0; st == QT_OK && i < net_hook_count(&n, &HOOK_LORA); i++)
        if (net_adapter(&n, i)->module->spec.groups > 1)
            st = qt_error_set(err, QT_ERR_CONFIG, "%s: module %s is a grouped conv; qtrain's adapter there is grouped "
                              "like the conv (lora_A of %d input channels per group), PEFT's lora_A is not, so the two "
                              "compute different functions: export the merged model instead (--format safetensors "
                              "--merge)", checkpoint, net_adapter(&n, i)->module->path,
                              net_adapter(&n, i)->module->in_shape[0] / net_adapter(&n, i)->module->spec.groups);
    for (int i = 0; st == QT_OK && i < net_hook_count(&n, &HOOK_LORA); i++)
        if (net_adapter(&n, i)->spec.rslora != net_adapter(&n, 0)->spec.rslora ||
            net_adapter(&n, i)->spec.dropout != net_adapter(&n, 0)->spec.dropout ||
            net_adapter(&n, i)->spec.dora != net_adapter(&n, 0)->spec.dora)
            st = qt_error_set(err, QT_ERR_CONFIG, "%s: module %s's adapter differs from %s's in rslora, dropout or "
                              "dora, which PEFT's adapter_config.json holds once for all modules", checkpoint,
                              net_adapter(&n, i)->module->path, net_adapter(&n, 0)->module->path);
    char *json = st == QT_OK ? config_json(&n, err) : NULL;
    if (st == QT_OK && !json) st = QT_ERR_NOMEM;
    if (st == QT_OK) st = train_make_dirs(dir, "--out", NULL, 0, err);
    char path[4096];
    if (st == QT_OK) {
        snprintf(path, sizeof path, "%s/adapter_config.json", dir);
        st = ckpt_write_atomic(path, json, strlen(json), FS_REPLACE_REGULAR, err);
    }
    StWrite *w = NULL;
    char (*names)[ST_NAME_MAX] = NULL;
    float *bufs = NULL;
    int nw = 0;
    if (st == QT_OK) st = adapter_tensors(&n, &w, &nw, &names, &bufs, err);
    const char *const meta[2][2] = {{"format", "pt"}, {"qtrain_checkpoint", checkpoint}};
    if (st == QT_OK) {
        snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
        st = st_write_f32(path, w, nw, meta, 2, err);
    }
    if (st == QT_OK) st = tools_float_net(checkpoint, false, fc, &base, NULL, err);
    if (st == QT_OK) {
        snprintf(path, sizeof path, "%s/base_model.safetensors", dir);
        st = interop_write_state_dict(path, &base.model, checkpoint, false, err);
    }
    if (st == QT_OK && log)
        fprintf(log, "exported %d adapters of %s for PEFT -> %s (adapter_config.json, adapter_model.safetensors, "
                "base_model.safetensors)\n", net_hook_count(&n, &HOOK_LORA), checkpoint, dir);
    if (base.cfg) net_free(&base);
    if (n.cfg) net_free(&n);
    free(w), free(names), free(bufs), free(json), free(c), free(fc);
    return st;
}

/* ---- in: model.adapters_from of a PEFT adapter directory ------------------------------------------------------ */

bool interop_is_peft_dir(const char *path) {
    char p[4096];
    struct stat sb;
    snprintf(p, sizeof p, "%s/adapter_config.json", path);
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode) && access(p, R_OK) == 0;
}

/* The whole file at path as text (NUL-terminated), at most 1 MB. */
static char *read_text(const char *path, size_t *len, QtError *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        qt_error_set(err, QT_ERR_IO, "cannot open %s", path);
        return NULL;
    }
    char *b = malloc((1u << 20) + 1);
    size_t n = b ? fread(b, 1, 1u << 20, f) : 0;
    const bool more = b && fgetc(f) != EOF;
    fclose(f);
    if (!b || more) {
        free(b);
        qt_error_set(err, b ? QT_ERR_FORMAT : QT_ERR_NOMEM, "%s is %s", path, b ? "larger than 1 MB" : "unreadable");
        return NULL;
    }
    b[n] = '\0', *len = n;
    return b;
}

/* A number field of the config (or def when absent or null). */
static QtStatus json_number(const YNode *root, const char *key, double def, double *out, const char *path,
                            QtError *err) {
    const YNode *v = ynode_get(root, key);
    *out = def;
    if (!v || ynode_is_null(v)) return QT_OK;
    char *end = NULL;
    double x = v->kind == YNODE_SCALAR ? strtod(v->text, &end) : NAN;
    if (!end || *end || !isfinite(x))
        return qt_error_set(err, QT_ERR_FORMAT, "%s: \"%s\" must be a number", path, key);
    *out = x;
    return QT_OK;
}

static bool json_true(const YNode *root, const char *key) {
    const YNode *v = ynode_get(root, key);
    return v && v->kind == YNODE_SCALAR && strcmp(v->text, "true") == 0;
}

/* The rank and PEFT scale adapter config `root` gives module `name`. */
static QtStatus peft_rank_scale(const YNode *root, const char *name, int *rank, double *scale, const char *path,
                                QtError *err) {
    double r = 0, alpha = 0;
    QtStatus st = json_number(root, "r", 8, &r, path, err);
    if (st == QT_OK) st = json_number(root, "lora_alpha", 8, &alpha, path, err);
    const YNode *rp = ynode_get(root, "rank_pattern"), *ap = ynode_get(root, "alpha_pattern");
    if (st == QT_OK && rp && rp->kind == YNODE_MAPPING && ynode_get(rp, name))
        st = json_number(rp, name, r, &r, path, err);
    if (st == QT_OK && ap && ap->kind == YNODE_MAPPING && ynode_get(ap, name))
        st = json_number(ap, name, alpha, &alpha, path, err);
    if (st == QT_OK && !(r >= 1 && r == floor(r) && alpha > 0))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: module %s has r = %g, lora_alpha = %g; r must be a positive integer "
                          "and lora_alpha > 0", path, name, r, alpha);
    *rank = (int)r;
    *scale = json_true(root, "use_rslora") ? alpha / sqrt(r) : alpha / r;
    return st;
}

/* Every name in the JSON list `key` of root is in names[0..n) and the other way round: else an error. */
static QtStatus same_modules(const YNode *root, const char *key, const char *const *names, int n, const char *path,
                             const char *what, QtError *err) {
    const YNode *v = ynode_get(root, key);
    const int m = v && v->kind == YNODE_SEQUENCE ? v->n : 0;
    if (v && !ynode_is_null(v) && v->kind != YNODE_SEQUENCE)
        return qt_error_set(err, QT_ERR_FORMAT, "%s: \"%s\" must be a list of module names (a regex string is "
                            "not read by qtrain; list the modules)", path, key);
    for (int i = 0; i < m; i++) {
        bool found = false;
        for (int j = 0; j < n && !found; j++) found = strcmp(v->items[i]->text ? v->items[i]->text : "", names[j]) == 0;
        if (!found)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: its %s lists module %s, which this run's %s does not", path,
                                key, v->items[i]->text ? v->items[i]->text : "?", what);
    }
    for (int j = 0; j < n; j++) {
        bool found = false;
        for (int i = 0; i < m && !found; i++) found = v->items[i]->text && strcmp(v->items[i]->text, names[j]) == 0;
        if (!found)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: this run's %s has module %s, which its %s does not list",
                                path, what, names[j], key);
    }
    return QT_OK;
}

/* Reads one tensor of the adapter file into dst after checking its shape against v's. */
static QtStatus read_into(const StFile *f, const char *name, Var *v, const char *path, QtError *err) {
    const StTensor *t = st_find(f, name);
    if (!t) return qt_error_set(err, QT_ERR_FORMAT, "%s: adapter_model.safetensors lacks %s", path, name);
    bool same = t->ndim == v->value.ndim;
    for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == v->value.shape[d];
    if (!same) {
        char want[64];
        tensor_shape_str(&v->value, want, sizeof want);
        return qt_error_set(err, QT_ERR_FORMAT, "%s: %s has %d dimensions of other sizes than this run's %s", path,
                            name, t->ndim, want);
    }
    return st_read_f32(f, t, v->value.data, var_numel(v), err);
}

/* A saved batch norm's running statistics (and its count, when the file has it). */
static QtStatus read_bn_stats(const StFile *f, Module *mod, const char *path, int *n_read, QtError *err) {
    const int C = mod->in_shape[0];
    Var v = {.value = {.data = mod->running_mean, .ndim = 1, .shape = {C, 1, 1, 1}}};
    char name[ST_NAME_MAX];
    snprintf(name, sizeof name, PEFT_PREFIX "%s.running_mean", mod->path);
    QtStatus st = read_into(f, name, &v, path, err);
    v.value.data = mod->running_var;
    snprintf(name, sizeof name, PEFT_PREFIX "%s.running_var", mod->path);
    if (st == QT_OK) st = read_into(f, name, &v, path, err);
    *n_read += 2;
    snprintf(name, sizeof name, PEFT_PREFIX "%s.num_batches_tracked", mod->path);
    const StTensor *t = st_find(f, name);
    if (st == QT_OK && t) {
        float c = 0.0f;
        if (t->dtype != ST_I64 && t->dtype != ST_I32) {
            st = st_read_f32(f, t, &c, 1, err);
            if (st == QT_OK) mod->num_batches_tracked = c >= 0.0f ? (int64_t)c : 0;
        }
        (*n_read)++;
    }
    return st;
}

QtStatus interop_load_peft(const char *dir, Net *n, QtError *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    size_t len = 0;
    char *text = read_text(path, &len, err);
    if (!text) return err->status;
    YNode *root = NULL;
    QtStatus st = ytree_parse(text, len, path, false, &root, err);
    if (st == QT_OK && (!root || root->kind != YNODE_MAPPING))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s is not a JSON object", path);
    const YNode *pt = st == QT_OK ? ynode_get(root, "peft_type") : NULL;
    const YNode *bias = st == QT_OK ? ynode_get(root, "bias") : NULL;
    if (st == QT_OK && (!pt || !pt->text || strcmp(pt->text, "LORA") != 0))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: peft_type is %s; qtrain reads LORA adapters only", path,
                          pt && pt->text ? pt->text : "missing");
    const bool dora = st == QT_OK && json_true(root, "use_dora");
    if (st == QT_OK && bias && bias->text && strcmp(bias->text, "none") != 0)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: bias is \"%s\"; qtrain's adapters train no biases (bias \"none\")",
                          path, bias->text);
    if (st == QT_OK && json_true(root, "lora_bias"))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: lora_bias is true; qtrain's adapters have no bias on lora_B", path);
    if (st == QT_OK && json_true(root, "fan_in_fan_out"))
        st = qt_error_set(err, QT_ERR_FORMAT, "%s: fan_in_fan_out is true (GPT-2's Conv1D layout); qtrain's dense "
                          "weights are (out, in): not supported", path);
    const int na = net_hook_count(n, &HOOK_LORA);
    const char **names = calloc((size_t)na + (size_t)n->model.n_modules + 1, sizeof *names);
    if (st == QT_OK && !names) st = qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    for (int i = 0; names && i < na; i++) names[i] = net_adapter(n, i)->module->path;
    if (st == QT_OK) st = same_modules(root, "target_modules", names, na, path, "lora rules", err);
    int nt = 0;
    for (int i = 0; names && i < n->model.n_modules; i++)
        if (peft_saved(n, i)) names[nt++] = n->model.modules[i].path;
    if (st == QT_OK)
        st = same_modules(root, "modules_to_save", names, nt, path, "lora.trainable (and lora.batchnorm: train)", err);
    for (int i = 0; st == QT_OK && i < na; i++) {
        const LoraAdapter *a = net_adapter(n, i);
        if (a->spec.dora != dora)
            st = qt_error_set(err, QT_ERR_CONFIG, "%s: use_dora is %s but this run's lora rule for module %s has dora: "
                              "%s; set dora: %s in that rule", path, dora ? "true" : "false", a->module->path,
                              a->spec.dora ? "true" : "false", dora ? "true" : "false");
        int r = 0;
        if (st != QT_OK) break;
        double scale = 0;
        st = peft_rank_scale(root, a->module->path, &r, &scale, path, err);
        if (st == QT_OK && (r != a->spec.rank || fabs(scale - a->scale) > 1e-6 * a->scale))
            st = qt_error_set(err, QT_ERR_CONFIG, "%s: module %s's adapter has rank %d and scale %g, this run's rank "
                              "%d and scale %g; set the lora rule's rank, alpha and rslora to match", path,
                              a->module->path, r, scale, a->spec.rank, (double)a->scale);
    }
    StFile f;
    bool open = false;
    if (st == QT_OK) {
        snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
        open = (st = st_open(&f, path, err)) == QT_OK;
    }
    for (int i = 0; st == QT_OK && i < na; i++) {
        LoraAdapter *a = net_adapter(n, i);
        char name[ST_NAME_MAX];
        snprintf(name, sizeof name, PEFT_PREFIX "%s.lora_A.weight", a->module->path);
        st = read_into(&f, name, &a->A.var, path, err);
        snprintf(name, sizeof name, PEFT_PREFIX "%s.lora_B.weight", a->module->path);
        if (st == QT_OK) st = read_into(&f, name, &a->B.var, path, err);
        if (st != QT_OK || !a->spec.dora) continue;
        /* (out,), or a conv's (1, OC, 1, 1) */
        snprintf(name, sizeof name, PEFT_PREFIX "%s.lora_magnitude_vector", a->module->path);
        Var mv = {.value = {.data = a->M.var.value.data, .ndim = 1, .shape = {a->out, 1, 1, 1}}};
        if (a->module->spec.type == LAYER_CONV2D)
            mv.value.ndim = 4, mv.value.shape[0] = 1, mv.value.shape[1] = a->out;
        st = read_into(&f, name, &mv, path, err);
    }
    int n_read = 2 * na;
    for (int i = 0; i < na; i++) n_read += net_adapter(n, i)->spec.dora;
    for (int i = 0; st == QT_OK && i < n->model.n_modules; i++) {
        Module *mod = &n->model.modules[i];
        if (!peft_saved(n, i)) continue;
        Param *ps[2] = {mod->weight, mod->bias};
        static const char *const pn[2] = {"weight", "bias"};
        for (int j = 0; st == QT_OK && j < 2; j++) {
            char name[ST_NAME_MAX];
            snprintf(name, sizeof name, PEFT_PREFIX "%s.%s", mod->path, pn[j]);
            if (ps[j]) st = read_into(&f, name, &ps[j]->var, path, err), n_read++;
        }
        if (st == QT_OK && mod->running_mean) st = read_bn_stats(&f, mod, path, &n_read, err);
    }
    if (st == QT_OK && n_read != f.n)
        st = qt_error_set(err, QT_ERR_FORMAT, "%s holds %d tensors, but this run reads %d (each adapter's lora_A and "
                          "lora_B (and DoRA's lora_magnitude_vector), each saved module's parameters and batch-norm "
                          "buffers): a lora_B bias or a tensor of another module is not read", path, f.n, n_read);
    if (open) st_close(&f);
    free(names);
    ynode_free(root);
    free(text);
    return st;
}
