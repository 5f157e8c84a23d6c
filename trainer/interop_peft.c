/* interop_peft.c - `qtrain export --format peft`: a LoRA or QLoRA run's
 * adapters as the directory PEFT's PeftModel.from_pretrained loads.
 *
 *   adapter_config.json        peft_type LORA, r and lora_alpha (PEFT's
 *                              scale, lora_alpha / r or / sqrt(r) with
 *                              use_rslora, equals qtrain's; modules of
 *                              other ranks in rank_pattern / alpha_pattern),
 *                              lora_dropout, target_modules (the adapted
 *                              modules' names), modules_to_save
 *                              (lora.trainable), bias "none"
 *   adapter_model.safetensors  base_model.model.<module>.lora_A.weight
 *                              (r, in) or (r, C, kh, kw), .lora_B.weight
 *                              (out, r) or (out, r, 1, 1); for each
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

#include "base/safetensors.h"
#include "interop.h"
#include "lora/lora.h"
#include "trainer/checkpoint_internal.h"
#include "trainer/hook.h"
#include "trainer/tools.h"
#include "trainer/train.h"

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
              "  \"init_lora_weights\": true,\n  \"use_dora\": false,\n  \"target_modules\": [");
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
    const LoraConfig *lc = &n->cfg->lora;
    if (lc->n_trainable == 0) puts_(&t, "null");
    for (int i = 0; i < lc->n_trainable; i++) {
        puts_(&t, i ? ", " : "[");
        put_str(&t, lc->trainable[i]);
    }
    if (lc->n_trainable) puts_(&t, "]");
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
    int cap = 2 * na;
    size_t floats = 0;
    for (int i = 0; i < m->n_modules; i++)
        if (n->is_trainable[i])
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
    }
    size_t at = 0;
    for (int i = 0; i < m->n_modules; i++) {
        const Module *mod = &m->modules[i];
        if (!n->is_trainable[i]) continue;
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
            float *dst = b + at;
            const int len = j == 2 ? 1 : C;
            for (int c = 0; c < len; c++)
                dst[c] = j == 0 ? mod->running_mean[c] : j == 1 ? mod->running_var[c] : (float)mod->num_batches_tracked;
            snprintf(nm[k], sizeof nm[k], PEFT_PREFIX "%s.%s", mod->path, bn[j]);
            w[k].name = nm[k], w[k].data = dst, w[k].ndim = j == 2 ? 0 : 1, w[k].shape[0] = C;
            at += (size_t)len;
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
        if (net_adapter(&n, i)->spec.rslora != net_adapter(&n, 0)->spec.rslora ||
            net_adapter(&n, i)->spec.dropout != net_adapter(&n, 0)->spec.dropout)
            st = qt_error_set(err, QT_ERR_CONFIG, "%s: module %s's adapter differs from %s's in rslora or dropout, "
                              "which PEFT's adapter_config.json holds once for all modules", checkpoint,
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
