/* fuzz_entry_checkpoint.c - the checkpoint target: a checkpoint, edited as
 * the input says (fuzz_h5edit.h), through every loader qtrain runs on a
 * checkpoint file, each as its command does:
 *   resume   net_build(NET_SHELL) + checkpoint_load of model, optimizer,
 *            run state, quantized base, adapters and QAT/QT state; then the
 *            resume's own checks (data position) and one training step;
 *   eval     checkpoint_load_model into a fresh shell; then a forward pass;
 *   fresh    net_build(NET_FRESH) with model.init_from (and adapters_from,
 *            for a LoRA run) naming the file; then a forward pass;
 *   config   checkpoint_read_config + config_load_string (qtrain eval);
 *   inspect  checkpoint_inspect, and checkpoint_list_quant.
 * A refused file must leave the run as it was; a loaded one must give a
 * model that runs; every HDF5 object opened must be closed again.
 *
 * Input: byte 0 picks the base checkpoint, the rest is the edit script. An
 * input that starts with the HDF5 signature is the raw file instead (see
 * FUZZ_RAW_HDF5 below). */
#include <hdf5.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_h5edit.h"
#include "fuzz_harness.h"
#include "base/arena.h"
#include "nn/gemm.h"
#include "nn/ops.h"
#include "nn/tape.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "base/h5io.h"
#include "trainer/net.h"
#include "trainer/train.h"

/* libhdf5's own parser crashes on some damaged files (see fuzz/README.md),
 * so raw files are fed only when this is 1. */
#ifndef FUZZ_RAW_HDF5
#define FUZZ_RAW_HDF5 0
#endif

#define MAX_SET 8
#define RAW_BASE 2 /* a raw file is loaded as a checkpoint of the qlora run: the one with the most parts */

/* A base checkpoint: a tiny run of a tests/configs/ file, as written by train_run. */
typedef struct {
    const char *name;
    const char *config;          /* tests/configs/... */
    int init_from;               /* index of the base whose final.h5 it starts from, -1 none */
    const char *file;            /* which file of its out_dir: "final.h5" or "adapters.h5" */
    const char *set[MAX_SET];    /* overrides, NULL-terminated */
} BaseSpec;

/* Small models keep every edit and load fast: fc1 has 4 units. */
static const BaseSpec SPECS[] = {
    {"float", "tests/configs/tiny-base.yaml", -1, "final.h5", {"train.steps=2", "model.layers.4.units=4"}},
    {"sgd", "tests/configs/tiny-cnn.yaml", -1, "final.h5",
     {"train.steps=3", "train.eval_every=0", "train.checkpoint_every=0"}},
    {"qlora", "tests/configs/tiny-qlora.yaml", 0, "final.h5",
     {"train.steps=2", "model.layers.4.units=4", "train.checkpoint_every=0"}},
    {"qat", "tests/configs/tiny-qat.yaml", 0, "final.h5",
     {"train.steps=2", "model.layers.4.units=4", "train.checkpoint_every=0", "quant.calibration_batches=1"}},
    {"qt", "tests/configs/tiny-qt.yaml", -1, "final.h5",
     {"train.steps=2", "model.layers.4.units=4", "train.checkpoint_every=0"}},
    {"ptq", "tests/configs/tiny-qlora.yaml", 0, "final.h5",
     {"train.steps=0", "train.epochs=0", "model.layers.4.units=4", "lora.rules=[]", "lora.trainable=[]",
      "quant.calibration_batches=1",
      "quant.rules=[{module_path: conv1, weight_qtype: int4, symmetric: false, act_qtype: int8}, "
      "{module_path: fc1, weight_qtype: mxfp4}, "
      "{module_path: head, weight_qtype: fp8_e4m3, scale_type: float16, act_qtype: int8}]"}},
    {"adapters", "tests/configs/tiny-qlora.yaml", 0, "adapters.h5",
     {"train.steps=2", "model.layers.4.units=4", "train.checkpoint_every=0"}},
};
#define N_BASES ((int)(sizeof SPECS / sizeof SPECS[0]))

typedef struct {
    Config *cfg;      /* the run's config (out_dir and init_from set to the scratch files) */
    void *image;      /* the checkpoint file's bytes */
    size_t size;
} Base;

static Base bases[N_BASES];
static bool ready;
static FILE *devnull;

/* ---- the bases ------------------------------------------------------------------------ */

static int read_whole(const char *path, void **buf, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return 1;
    int rc = 1;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        *buf = n > 0 ? malloc((size_t)n) : NULL;
        if (*buf && fseek(f, 0, SEEK_SET) == 0 && fread(*buf, 1, (size_t)n, f) == (size_t)n) {
            *size = (size_t)n;
            rc = 0;
        }
    }
    fclose(f);
    return rc;
}

static int make_base(int i, char *why, size_t why_cap) {
    const BaseSpec *s = &SPECS[i];
    char out_dir[512], init_from[600], set_out[600], set_init[700];
    const char *sets[MAX_SET + 2];
    int n = 0;
    snprintf(out_dir, sizeof out_dir, "%s/base-%s", fuzz_scratch_dir(), s->name);
    snprintf(set_out, sizeof set_out, "run.out_dir=%s", out_dir);
    sets[n++] = set_out;
    if (s->init_from >= 0) {
        snprintf(init_from, sizeof init_from, "%s/base-%s/final.h5", fuzz_scratch_dir(), SPECS[s->init_from].name);
        snprintf(set_init, sizeof set_init, "model.init_from=%s", init_from);
        sets[n++] = set_init;
    }
    for (int k = 0; k < MAX_SET && s->set[k]; k++) sets[n++] = s->set[k];
    Base *b = &bases[i];
    b->cfg = malloc(sizeof *b->cfg);
    QtError err = {0};
    TrainOptions o = {.quiet = true};
    TrainResult res;
    char file[700];
    snprintf(file, sizeof file, "%s/%s", out_dir, s->file);
    if (!b->cfg || config_load(b->cfg, s->config, sets, n, &err) != QT_OK ||
        train_run(b->cfg, &o, &res, &err) != QT_OK || read_whole(file, &b->image, &b->size) != 0) {
        snprintf(why, why_cap, "cannot make the base checkpoint '%s' from %s: %s", s->name, s->config,
                 err.msg[0] ? err.msg : "out of memory or unreadable file");
        return 1;
    }
    return 0;
}

int fuzz_checkpoint_init(char *why, size_t why_cap) {
    if (ready) return 0;
    h5io_init();
    gemm_set_threads(1);
    if (!fuzz_scratch_dir()) {
        snprintf(why, why_cap, "cannot make a scratch directory");
        return 1;
    }
    devnull = fopen("/dev/null", "w");
    for (int i = 0; i < N_BASES; i++)
        if (make_base(i, why, why_cap) != 0) {
            fuzz_checkpoint_cleanup();
            return 1;
        }
    gemm_set_threads(1); /* train_run took every core; one is faster for a tiny model */
    ready = true;
    return 0;
}

void fuzz_checkpoint_cleanup(void) {
    for (int i = 0; i < N_BASES; i++) {
        free(bases[i].cfg);
        free(bases[i].image);
        memset(&bases[i], 0, sizeof bases[i]);
    }
    if (devnull) fclose(devnull);
    devnull = NULL;
    ready = false;
}

/* ---- using what was loaded --------------------------------------------------------------- */

/* One forward pass of a fixed example (training: with backward and an
 * optimizer step, as a resumed run's first step). The model may refuse
 * (an error on the tape), but must not crash. */
static int run_model(Net *n, Optimizer *opt, const char *what, char *why, size_t why_cap) {
    const Model *m = &n->model;
    int shape[4] = {1}, feat = 1;
    for (int i = 0; i < m->input_ndim; i++) shape[1 + i] = m->input_shape[i], feat *= m->input_shape[i];
    float *x = malloc((size_t)feat * sizeof *x);
    int32_t y[1] = {7};
    Arena arena;
    Tape t;
    Rng rng;
    rng_init(&rng, 11, RNG_STREAM_DROPOUT);
    QtError err = {0};
    if (!x || arena_init(&arena, (size_t)1 << 20) != 0) {
        free(x);
        snprintf(why, why_cap, "out of memory");
        return 1;
    }
    for (int i = 0; i < feat; i++) x[i] = (float)((i * 37) % 255) / 255.0f;
    int bad = 0;
    if (tape_init(&t, &arena, &rng, &err) == QT_OK) {
        t.training = opt != NULL;
        t.grad_enabled = opt != NULL;
        Var *logits = model_forward(&n->model, &t, tape_wrap(&t, x, 1 + m->input_ndim, shape));
        Var *loss = logits ? nn_softmax_cross_entropy(&t, logits, y) : NULL;
        QtStatus bst = loss && opt ? tape_backward(&t, loss) : QT_OK;
        if (loss && opt && bst == QT_OK) {
            optim_step(opt, 1e-3f);
            optim_zero_grad(opt);
            QtError e = {0};
            QtStatus st = net_check_ranges(n, opt->step, &e);
            bad = fuzz_check_status("net_check_ranges after a step", st, &e, why, why_cap);
        }
        /* A refusal on the tape (no loss, or no backward) must say why. */
        if (!bad && (!loss || bst != QT_OK) && t.err.status == QT_OK) {
            snprintf(why, why_cap, "%s failed without an error on the tape", what);
            bad = 1;
        }
        tape_free(&t);
    }
    arena_free(&arena);
    free(x);
    return bad;
}

/* ---- the run a refused file must leave alone ---------------------------------------------- */

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static uint64_t hash_param(uint64_t h, const Param *p) {
    if (p->var.value.data) h = hash_bytes(h, p->var.value.data, var_numel(&p->var) * sizeof(float));
    return h;
}

/* Everything checkpoint_load may change, hashed. */
static uint64_t hash_run(const Net *n, const Optimizer *opt, const Rng *dropout, const CheckpointState *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < n->model.n_params; i++) h = hash_param(h, &n->model.params[i]);
    for (int i = 0; i < net_hook_count(n, &HOOK_LORA); i++)
        h = hash_param(hash_param(h, &net_adapter(n, i)->A), &net_adapter(n, i)->B);
    for (int i = 0; i < net_hook_count(n, &HOOK_PTQ); i++) {
        const QLayer *q = net_qlayer(n, i);
        h = hash_bytes(h, &q->weight, sizeof q->weight); /* a replaced QArray has other buffers */
        h = hash_bytes(h, &q->act_scale, sizeof q->act_scale);
        h = hash_bytes(h, &q->act_stats, sizeof q->act_stats);
    }
    for (int i = 0; i < net_hook_count(n, &HOOK_QAT); i++) {
        Param *ps[2];
        int k = qat_layer_params(net_qat_layer(n, i), ps);
        for (int j = 0; j < k; j++) h = hash_param(h, ps[j]);
        h = hash_bytes(h, &net_qat_layer(n, i)->act_stats, sizeof(CalibRunning));
    }
    for (int i = 0; i < net_hook_count(n, &HOOK_FQT); i++) h = hash_bytes(h, &net_fqt_layer(n, i)->rng, sizeof(Rng));
    for (int i = 0; opt && i < opt->n_params; i++) {
        size_t k = var_numel(&opt->params[i]->var) * sizeof(float);
        if (opt->m) h = hash_bytes(h, opt->m[i], k);
        if (opt->v) h = hash_bytes(h, opt->v[i], k);
    }
    if (opt) h = hash_bytes(h, &opt->step, sizeof opt->step);
    h = hash_bytes(h, dropout, sizeof *dropout);
    h = hash_bytes(h, &s->step, offsetof(CheckpointState, rngs) - offsetof(CheckpointState, step));
    return h;
}

/* ---- the loaders --------------------------------------------------------------------------- */

static int build_shell(const Base *b, Net *n, char *why, size_t why_cap) {
    QtError err = {0};
    if (net_build(n, b->cfg, NET_SHELL, &err) == QT_OK) return 0;
    snprintf(why, why_cap, "net_build of the base config failed: %s", err.msg);
    return 1;
}

/* The data position a resumed run seeks to (train.c's run_resume_from). */
static int check_position(const Base *b, const CheckpointState *s, char *why, size_t why_cap) {
    if (s->n_train < 1 || s->n_train > 4096 || s->cursor > s->n_train) return 0; /* refused by the run */
    Dataset d = {.n = (int)s->n_train};
    Batcher bt;
    QtError err = {0};
    const Config *c = b->cfg;
    QtStatus st = batcher_init(&bt, &d, c->train.batch_size, c->data.shuffle, c->data.drop_last, c->run.seed, &err);
    if (st == QT_OK) st = batcher_seek(&bt, s->epoch, (int)s->cursor, &err);
    int bad = fuzz_check_status("batcher_seek to the loaded position", st, &err, why, why_cap);
    batcher_free(&bt);
    return bad;
}

static int load_resume(const Base *b, const char *path, char *why, size_t why_cap) {
    Net n;
    if (build_shell(b, &n, why, why_cap) != 0) return 1;
    Optimizer opt;
    memset(&opt, 0, sizeof opt);
    bool has_opt = n.n_trainable > 0;
    QtError err = {0};
    int bad = 0;
    if (has_opt && (optim_init(&opt, &b->cfg->train.optim, n.trainable, n.n_trainable, &err) != QT_OK ||
                    net_set_range_lrs(&n, &opt, b->cfg->train.optim.lr, &err) != QT_OK)) {
        snprintf(why, why_cap, "optim_init of the base config failed: %s", err.msg);
        bad = 1;
    }
    Rng dropout;
    rng_init(&dropout, b->cfg->run.seed, RNG_STREAM_DROPOUT);
    CheckpointState s = {.n_rngs = 1, .last_train_loss = NAN, .net = net_checkpoint_parts(&n)};
    s.rngs[0].name = "dropout";
    s.rngs[0].rng = &dropout;
    uint64_t before = hash_run(&n, has_opt ? &opt : NULL, &dropout, &s);
    QtStatus st = bad ? QT_OK : checkpoint_load(path, &n.model, has_opt ? &opt : NULL, &s, &err);
    if (!bad) bad = fuzz_check_status("checkpoint_load", st, &err, why, why_cap);
    if (!bad && st != QT_OK && hash_run(&n, has_opt ? &opt : NULL, &dropout, &s) != before) {
        snprintf(why, why_cap, "checkpoint_load refused the file (%s) but changed the run", err.msg);
        bad = 1;
    }
    if (!bad && st == QT_OK) bad = check_position(b, &s, why, why_cap);
    if (!bad && st == QT_OK) bad = run_model(&n, has_opt ? &opt : NULL, "a training step after a resume", why, why_cap);
    optim_free(&opt);
    net_free(&n);
    return bad;
}

static int load_eval(const Base *b, const char *path, char *why, size_t why_cap) {
    Net n;
    if (build_shell(b, &n, why, why_cap) != 0) return 1;
    CheckpointNet parts = net_checkpoint_parts(&n);
    QtError err = {0};
    QtStatus st = checkpoint_load_model(path, &n.model, &parts, &err);
    int bad = fuzz_check_status("checkpoint_load_model", st, &err, why, why_cap);
    if (!bad && st == QT_OK) bad = run_model(&n, NULL, "a forward pass after checkpoint_load_model", why, why_cap);
    net_free(&n);
    return bad;
}

static int load_fresh(const Base *b, const char *path, char *why, size_t why_cap) {
    Config *c = malloc(sizeof *c);
    if (!c) {
        snprintf(why, why_cap, "out of memory");
        return 1;
    }
    *c = *b->cfg;
    /* adapters.h5 holds no base: the run's own init_from stays */
    if (strcmp(SPECS[b - bases].file, "adapters.h5") != 0)
        snprintf(c->model.init_from, sizeof c->model.init_from, "%s", path);
    if (config_has_lora(c)) snprintf(c->model.adapters_from, sizeof c->model.adapters_from, "%s", path);
    Net n;
    QtError err = {0};
    QtStatus st = net_build(&n, c, NET_FRESH, &err);
    int bad = fuzz_check_status("net_build from model.init_from", st, &err, why, why_cap);
    if (!bad && st == QT_OK) bad = run_model(&n, NULL, "a forward pass after model.init_from", why, why_cap);
    if (st == QT_OK) net_free(&n);
    free(c);
    return bad;
}

static int load_other(const Base *b, const char *path, char *why, size_t why_cap) {
    (void)b;
    char *text = NULL;
    QtError err = {0};
    QtStatus st = checkpoint_read_config(path, &text, &err);
    int bad = fuzz_check_status("checkpoint_read_config", st, &err, why, why_cap);
    if (!bad && st == QT_OK) {
        Config *c = malloc(sizeof *c);
        QtError e = {0};
        if (c) bad = fuzz_check_status("config_load_string of the stored config",
                                       config_load_string(c, text, "stored", NULL, 0, &e), &e, why, why_cap);
        free(c);
    }
    free(text);
    QtError ierr = {0};
    if (!bad) bad = fuzz_check_status("checkpoint_inspect", checkpoint_inspect(path, devnull, &ierr), &ierr, why,
                                      why_cap);
    char(*names)[MODULE_NAME_MAX] = malloc(CKPT_LIST_MAX * sizeof *names);
    int n = 0;
    QtError lerr = {0};
    if (!bad && names)
        bad = fuzz_check_status("checkpoint_list_quant", checkpoint_list_quant(path, names, CKPT_LIST_MAX, &n, &lerr),
                                &lerr, why, why_cap);
    free(names);
    return bad;
}

int fuzz_checkpoint_one(const uint8_t *data, size_t size, char *why, size_t why_cap) {
    if (!ready && fuzz_checkpoint_init(why, why_cap) != 0) return 1;
    static const uint8_t sig[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
    bool raw = size >= sizeof sig && memcmp(data, sig, sizeof sig) == 0;
    if (raw && !FUZZ_RAW_HDF5) return 0;
    const Base *b = &bases[raw ? RAW_BASE : size ? data[0] % N_BASES : 0];
    void *image = NULL;
    size_t image_size = 0;
    if (!raw && fuzz_h5_edit(b->image, b->size, size ? data + 1 : data, size ? size - 1 : 0, &image, &image_size)) {
        snprintf(why, why_cap, "HDF5 could not apply the edits to base '%s'", SPECS[b - bases].name);
        return 1;
    }
    ssize_t left = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
    if (left > 0) {
        snprintf(why, why_cap, "the edit script left %zd HDF5 objects open (a bug in fuzz_h5edit.c or fuzz_h5edit_storage.c)", left);
        free(image);
        return 1;
    }
    char path[512];
    int bad = fuzz_write_file("checkpoint.h5", raw ? data : image, raw ? size : image_size, path, sizeof path);
    const char *keep = getenv("QTRAIN_FUZZ_KEEP"); /* a copy of the edited file, for `qtrain inspect` */
    FILE *kf = keep && !bad ? fopen(keep, "wb") : NULL;
    if (kf) {
        fwrite(raw ? data : image, 1, raw ? size : image_size, kf);
        fclose(kf);
    }
    free(image);
    if (bad) {
        snprintf(why, why_cap, "cannot write the scratch checkpoint");
        return 1;
    }
    static const struct {
        const char *name;
        int (*fn)(const Base *b, const char *path, char *why, size_t why_cap);
    } loaders[] = {{"resume", load_resume}, {"eval", load_eval}, {"fresh", load_fresh}, {"config/inspect", load_other}};
    for (size_t i = 0; !bad && i < sizeof loaders / sizeof loaders[0]; i++) {
        bad = loaders[i].fn(b, path, why, why_cap);
        ssize_t open_ids = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
        if (!bad && open_ids > 0) {
            snprintf(why, why_cap, "%zd HDF5 objects are still open after the %s loaders returned", open_ids,
                     loaders[i].name);
            bad = 1;
        }
    }
    return bad;
}
