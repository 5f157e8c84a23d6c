/* config_table.c - the config schema: one table per section.
 *
 * Each row is one key: its type, its field (offsetof into the section's
 * struct), its default, its range or valid names, what a resume may do
 * with it, and one line of doc. From these rows come the loader's
 * conversions and range checks (cfg_load_table), config_default,
 * config_to_yaml, the resume comparison (config_diff_for_resume), the
 * unknown-key check with its did-you-mean, and `qtrain config --doc`, which
 * writes docs/CONFIG.md.
 *
 * Adding a key is one row here plus its use. For example a hypothetical
 * train.print_every, an int64_t print_every field in TrainConfig
 * (trainer/config.h):
 *
 *     {.key = "print_every", .type = CFG_T_I64, F(TrainConfig, print_every), .imin = 0, .imax = INT64_MAX,
 *      .def = 0, .doc_default = "0 (off)", .doc = "print the loss every N steps"},
 *
 * in TRAIN_KEYS (its place there is its place in the resolved YAML), then
 * the code that reads cfg->train.print_every, then, after `make`,
 * `./build/qtrain config --doc > docs/CONFIG.md` (the config_schema suite
 * fails while docs/CONFIG.md and the tables disagree). A key whose change on
 * resume must be refused says .resume = CFG_RESUME_FIXED; one that is
 * reported, CFG_RESUME_REPORTED.
 *
 * What a row cannot express is a CFG_T_PART: a list or a value whose shape
 * depends on its content (model.input, model.layers, data.transform,
 * quant.rules, lora.rules, lora.trainable), loaded, written and compared by
 * hand. The rows of a layer and of a rule (CFG_LAYER_TABLE,
 * CFG_QUANT_RULE_TABLE, CFG_LORA_RULE_TABLE) give their keys, ranges and
 * docs; their loaders are hand-written (defaults that follow other keys). */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "config_schema.h"
#include "lora/lora_svd.h"

#define F(T, f) .offset = offsetof(T, f), .size = sizeof(((T *)0)->f)
#define O(T, f) .offset = offsetof(T, f) /* an enum: .size is the longest name read */
#define BIT(k) (1u << (k))
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define BATCH_MAX (1 << 20)
#define THREADS_MAX 4096
#define LAYER_SIZE_MAX (1 << 20) /* units, out_channels */
#define LAYER_WINDOW_MAX 4096    /* kernel, stride, padding */
#define FIXED .resume = CFG_RESUME_FIXED
#define REPORTED .resume = CFG_RESUME_REPORTED
#define FRACTION ((CfgRange){0.0, 1.0, false, true, false})

/* ---- names --------------------------------------------------------------------------------------------------- */

static const char *dataset_name(int k) { return CONFIG_DATASETS[k]; }
static const char *storage_name(int k) { return data_storage_name((DataStorage)k); }
static const char *nonfinite_name(int k) { return NONFINITE_ACTION_NAMES[k]; }
static const char *loss_name(int k) { return LOSS_KIND_NAMES[k]; }
static const char *target_name(int k) { return DATA_TARGET_NAMES[k]; }
static const char *lora_bn_name(int k) { return LORA_BATCHNORM_NAMES[k]; }
static const char *optim_name(int k) { return optim_kind_name((OptimKind)k); }
static const char *sched_name(int k) { return sched_kind_name((SchedKind)k); }
static const char *mode_name(int k) { return quant_mode_name((QuantMode)k); }
static const char *layer_name(int k) { return layer_type_name((LayerType)k); }
static const char *init_name(int k) { return init_kind_name((InitKind)k); }
static const char *lora_init(int k) { return lora_init_name((LoraInit)k); }
static const char *learn_name(int k) { return qat_learn_name((QatLearn)k); }

/* ---- checks of one key --------------------------------------------------------------------------------------- */

/* run.name names a directory; run.out_dir defaults to runs/<name>. */
static QtStatus check_run_name(QtError *err, const YNode *v, const char *path, void *section) {
    RunConfig *r = section;
    QtStatus st = v ? cfg_check_name(err, v, path, r->name, "it names the directory runs/<name>; no '/'") : QT_OK;
    char dir[CONFIG_PATH_MAX];
    snprintf(dir, sizeof dir, "runs/%s", r->name);
    cfg_set_str(r->out_dir, sizeof r->out_dir, dir);
    return st;
}

/* data.cache_dir: a directory, "" for the default place, or none. A plain
 * boolean is refused rather than taken as a directory named "false". */
static QtStatus check_cache_dir(QtError *err, const YNode *v, const char *path, void *section) {
    static const char *const bools[] = {"true", "false", "yes", "no", "on", "off"};
    DataConfig *d = section;
    if (!v) return QT_OK;
    for (int i = 0; v->kind == YNODE_SCALAR && v->plain && i < N_OF(bools); i++)
        if (strcasecmp(v->text, bools[i]) == 0)
            return cfg_fail(err, v, path,
                            "expected a directory, \"\" (the default, $XDG_CACHE_HOME/qtrain or ~/.cache/qtrain) "
                            "or none (no cache), got %s; write none to turn the cache off",
                            v->text);
    if (strcasecmp(d->cache_dir, "none") == 0) cfg_set_str(d->cache_dir, sizeof d->cache_dir, "none");
    return QT_OK;
}

static QtStatus check_divergence(QtError *err, const YNode *v, const char *path, void *section) {
    const TrainConfig *t = section;
    if (!(t->divergence_factor > 0.0f && t->divergence_factor <= 1.0f)) return QT_OK;
    return cfg_fail(err, v, path,
                    "%g would report every step whose loss is merely above its running mean; use 0 (off) or a "
                    "factor above 1, e.g. 2", (double)t->divergence_factor);
}

/* optim_config_default(kind), copied field by field (no stray padding bytes). */
void cfg_optim_defaults(OptimConfig *o, OptimKind kind) {
    OptimConfig d = optim_config_default(kind);
    o->kind = d.kind;
    o->lr = d.lr;
    o->weight_decay = d.weight_decay;
    o->beta1 = d.beta1;
    o->beta2 = d.beta2;
    o->eps = d.eps;
    o->momentum = d.momentum;
    o->dampening = d.dampening;
    o->nesterov = d.nesterov;
}

static void optim_kind_defaults(void *section, int kind) { cfg_optim_defaults(section, (OptimKind)kind); }

static QtStatus optim_after(QtError *err, const YNode *m, const YNode *parent_map, void *section, void *parent,
                            CfgCtx *ctx) {
    (void)parent_map, (void)parent, (void)ctx;
    const OptimConfig *o = section;
    if (o->kind == OPTIM_SGD && o->nesterov && (o->momentum <= 0.0f || o->dampening != 0.0f))
        return cfg_fail(err, cfg_field(m, "nesterov"), "train.optimizer.nesterov",
                        "needs momentum > 0 and dampening 0, got momentum %g and dampening %g", (double)o->momentum,
                        (double)o->dampening);
    return QT_OK;
}

/* step_size for the step schedule, and the checks that involve the optimizer's lr. */
static QtStatus sched_after(QtError *err, const YNode *m, const YNode *train, void *section, void *parent,
                            CfgCtx *ctx) {
    (void)ctx;
    const LrSchedule *s = section;
    const TrainConfig *t = parent;
    if (s->kind == SCHED_STEP && !cfg_field(m, "step_size"))
        return cfg_fail(err, m ? m : train, "train.schedule.step_size",
                        "missing; the step schedule needs step_size (optimizer steps between lr drops)");
    if (s->kind == SCHED_COSINE && s->min_lr > t->optim.lr)
        return cfg_fail(err, cfg_field(m, "min_lr"), "train.schedule.min_lr",
                        "expected at most train.optimizer.lr = %g for a cosine schedule, got %g", (double)t->optim.lr,
                        (double)s->min_lr);
    /* The library's own check as a backstop. A warmup longer than the run is not an error: the run clamps it
       (run_plan_steps), as only then is the run's length known. */
    LrSchedule probe = *s;
    probe.base_lr = t->optim.lr;
    probe.total_steps = s->warmup_steps;
    QtError inner = {0};
    if (lr_schedule_validate(&probe, &inner) == QT_OK) return QT_OK;
    const YNode *at = m ? m : train;
    if (!at) return qt_error_set(err, QT_ERR_CONFIG, "train.schedule: %s", inner.msg);
    return cfg_fail(err, at, "train.schedule", "%s", inner.msg);
}

/* ---- parts ------------------------------------------------------------------------------------------------- */

const CfgPart CFG_PART_TRANSFORMS = {cfg_part_load_transforms, cfg_emit_transforms, cfg_diff_transforms};
const CfgPart CFG_PART_AUGMENT = {cfg_part_load_augment, cfg_emit_augment, cfg_diff_augment};
const CfgPart CFG_PART_INPUT = {cfg_part_load_input, cfg_emit_input, cfg_diff_input};
const CfgPart CFG_PART_LAYERS = {cfg_part_load_layers, cfg_emit_layers, cfg_diff_layers};
const CfgPart CFG_PART_QUANT_RULES = {cfg_part_load_quant_rules, cfg_emit_quant_rules, cfg_diff_quant_rules};
const CfgPart CFG_PART_LORA_RULES = {cfg_part_load_lora_rules, cfg_emit_lora_rules, cfg_diff_lora_rules};
const CfgPart CFG_PART_TRAINABLE = {cfg_part_load_trainable, cfg_emit_trainable, cfg_diff_trainable};
const CfgPart CFG_PART_ANOMALY = {cfg_part_load_anomaly, cfg_emit_anomaly, cfg_diff_anomaly};

/* ---- run, data, model ------------------------------------------------------------------------------------------ */

static const CfgKey RUN_KEYS[] = {
    {.key = "name", .type = CFG_T_STR, F(RunConfig, name), .def_str = "run", .check = check_run_name,
     .doc_values = "letters, digits, `_`, `-`, `.`; not starting with `.` or `-`",
     .doc = "name of the run (it names `runs/<name>`; `..` or `my run` is a config error)"},
    {.key = "out_dir", .type = CFG_T_PATH, F(RunConfig, out_dir), .def_str = "runs/run",
     .doc_default = "`runs/<name>`",
     .doc = "where everything the run writes goes (any path without control characters; the same holds for "
            "`data.dir`, `data.cache_dir`, `model.init_from`, `model.adapters_from`)"},
    {.key = "seed", .type = CFG_T_U64, F(RunConfig, seed), .def = 1, FIXED,
     .doc = "one seed for init, shuffling and dropout (separate Philox streams)"},
    {.key = "threads", .type = CFG_T_INT, F(RunConfig, threads), .imin = 0, .imax = THREADS_MAX, .def = 0,
     .doc_default = "0 (all cores)",
     .doc = "threads of the step: qtrain's own pool (OpenBLAS itself runs single-threaded)"},
};

static const CfgKey FILES_KEYS[] = {
    {.key = "train_x", .type = CFG_T_PATH, F(DataFiles, train_x), .empty_ok = true, .def_str = "",
     .doc_default = "none", .doc = "the training examples"},
    {.key = "train_y", .type = CFG_T_PATH, F(DataFiles, train_y), .empty_ok = true, .def_str = "",
     .doc_default = "none", .doc = "the training labels or targets"},
    {.key = "test_x", .type = CFG_T_PATH, F(DataFiles, test_x), .empty_ok = true, .def_str = "",
     .doc_default = "none", .doc = "the test examples"},
    {.key = "test_y", .type = CFG_T_PATH, F(DataFiles, test_y), .empty_ok = true, .def_str = "",
     .doc_default = "none", .doc = "the test labels or targets"},
};

static const CfgTable FILES_TABLE = {
    .path = "data.files", .owner = "data.files", .keys = FILES_KEYS, .n = N_OF(FILES_KEYS), .kind_key = -1,
    .doc = "The four files of `data.dataset: npy` (NumPy `.npy`) or `idx` (IDX, `.gz` or plain): all four are "
           "needed; see docs/DATA.md."};

static QtStatus data_after(QtError *err, const YNode *m, const YNode *parent_map, void *section, void *parent,
                           CfgCtx *ctx) {
    (void)parent_map, (void)parent, (void)ctx;
    const DataConfig *d = section;
    const DataFiles *f = &d->files;
    const bool fm = strcmp(d->dataset, "fashion-mnist") == 0, h5 = strcmp(d->dataset, "hdf5") == 0;
    const bool any_file = f->train_x[0] || f->train_y[0] || f->test_x[0] || f->test_y[0];
    const YNode *at = m ? cfg_field(m, "dataset") : NULL;
    if (h5 && !d->path[0])
        return cfg_fail(err, at ? at : m, "data.path", "data.dataset: hdf5 needs data.path, the HDF5 file to read");
    if (!h5 && d->path[0])
        return cfg_fail(err, cfg_field(m, "path"), "data.path",
                        "is read by data.dataset: hdf5 only; this data set is %s (use data.%s)", d->dataset,
                        fm ? "dir" : "files");
    if ((fm || h5) && any_file)
        return cfg_fail(err, cfg_field(m, "files"), "data.files", "is read by data.dataset: npy or idx only; this "
                        "data set is %s (use data.%s)", d->dataset, fm ? "dir" : "path");
    if (!fm && !h5 && !(f->train_x[0] && f->train_y[0] && f->test_x[0] && f->test_y[0]))
        return cfg_fail(err, at ? at : m, "data.files",
                        "data.dataset: %s needs data.files with train_x, train_y, test_x and test_y", d->dataset);
    return QT_OK;
}

static const CfgKey DATA_KEYS[] = {
    {.key = "dataset", .type = CFG_T_NAME, F(DataConfig, dataset), .name_of = dataset_name,
     .n_names = CONFIG_N_DATASETS, .names_what = "dataset", .def_str = "fashion-mnist", FIXED,
     .doc = "`fashion-mnist` (the IDX files in data.dir), `hdf5` (one file: data.path), `npy` or `idx` (four "
            "files: data.files); docs/DATA.md"},
    {.key = "dir", .type = CFG_T_PATH, F(DataConfig, dir), .def_str = "/usr/share/datasets/fashion-mnist",
     .doc = "`fashion-mnist`: directory of the four IDX files (`.gz` or plain)"},
    {.key = "path", .type = CFG_T_PATH, F(DataConfig, path), .empty_ok = true, .def_str = "",
     .doc_default = "none", .doc = "`hdf5`: the data file (/train, /test, optional /val; docs/DATA.md)"},
    {.key = "files", .type = CFG_T_SECTION, F(DataConfig, files), .sub = &FILES_TABLE,
     .doc = "`npy`, `idx`: `{train_x, train_y, test_x, test_y}`"},
    {.key = "max_memory_mb", .type = CFG_T_INT, F(DataConfig, max_memory_mb), .imin = 1, .imax = 1 << 24,
     .def = 512,
     .doc = "`hdf5` with `storage: auto`: examples taking more than this are read from the file per batch "
            "(hyperslabs), else read once"},
    {.key = "cache_dir", .type = CFG_T_PATH, F(DataConfig, cache_dir), .empty_ok = true, .def_str = "",
     .check = check_cache_dir, .doc_default = "`\"\"` = $XDG_CACHE_HOME/qtrain, else ~/.cache/qtrain",
     .doc_values = "a directory, `\"\"` or `none`",
     .doc = "where inflated copies of the `.gz` IDX files are kept, so later starts skip gunzip; `none` turns it off "
            "(more above)"},
    {.key = "storage", .type = CFG_T_ENUM, O(DataConfig, storage), .size = 64, .name_of = storage_name,
     .n_names = DATA_STORAGE_COUNT, .names_what = "data storage", .def_str = "auto",
     .doc = "where the image bytes are held: `memory` (read at the start), `file` (each batch read from the "
            "uncompressed IDX file) or `auto` (`file` when there is one); the results are the same bit for bit "
            "(more above)"},
    {.key = "transform", .type = CFG_T_PART, .part = &CFG_PART_TRANSFORMS, FIXED, .doc_default = "`[]`",
     .doc_values = "`normalize`, `{normalize: {mean: m, std: s}}`, `transpose`, `invert`, `{classes: [a, ...]}`, "
                   "`{limit: N}`",
     .doc = "list of transforms, applied in order after scaling pixels to [0, 1]"},
    {.key = "augment", .type = CFG_T_PART, .part = &CFG_PART_AUGMENT, FIXED, .doc_default = "`[]`",
     .doc_values = "`{random_crop: {size: s, padding: p}}`, `hflip`, `{hflip: {p: x}}`, `random_erase`, "
                   "`{random_erase: {p, scale, ratio, value}}`",
     .doc = "random augmentation of training batches (never evaluation), applied in order after the transforms; "
            "see docs/TRAINING.md"},
    {.key = "val_fraction", .type = CFG_T_DOUBLE, F(DataConfig, val_fraction), .range = FRACTION, .def = 0, FIXED,
     .doc = "last fraction of the training set held out for validation"},
    {.key = "shuffle", .type = CFG_T_BOOL, F(DataConfig, shuffle), .def = 1, FIXED,
     .doc = "reshuffle the training set every epoch"},
    {.key = "drop_last", .type = CFG_T_BOOL, F(DataConfig, drop_last), .def = 0, FIXED,
     .doc = "drop an epoch's last partial batch"},
    {.key = "target", .type = CFG_T_ENUM, O(DataConfig, target), .size = 32, .name_of = target_name,
     .n_names = DATA_TARGET_COUNT, .names_what = "data.target", .def_str = "label", FIXED,
     .doc = "what the model learns to output: `label` (class labels, or the data set's value targets) or `input` "
            "(the normalized input: an autoencoder; needs `train.loss: mse` and one output per input value)"},
    {.key = "anomaly_classes", .type = CFG_T_PART, .part = &CFG_PART_ANOMALY, FIXED, .doc_default = "`[]`",
     .doc_values = "class labels, each once",
     .doc = "with `target: input`: examples of these classes are dropped from train and val and kept in test, "
            "where `qtrain eval` reports `test_auc`, the ROC AUC of the reconstruction error with them as the "
            "positives"},
};

static const CfgKey MODEL_KEYS[] = {
    {.key = "input", .type = CFG_T_PART, .part = &CFG_PART_INPUT, FIXED, .doc_default = "(required)",
     .doc_values = "1 or 3 integers in [1, 65536]", .doc = "`[C, H, W]` or `[features]` per example"},
    {.key = "layers", .type = CFG_T_PART, .part = &CFG_PART_LAYERS, .sub = &CFG_LAYER_TABLE, FIXED,
     .doc_default = "(required)", .doc_values = "1 to 64 layers", .doc = "the layers, in order (model.layers[] below)"},
    {.key = "init_from", .type = CFG_T_PATH, F(ModelConfig, init_from), .empty_ok = true, .def_str = "",
     .doc_default = "none",
     .doc = "load `/params` (and a batch norm's `/buffers`) from a checkpoint, or a PyTorch state_dict from a "
            "`.safetensors` file (docs/INTEROP.md); shapes must match"},
    {.key = "adapters_from", .type = CFG_T_PATH, F(ModelConfig, adapters_from), .empty_ok = true, .def_str = "",
     .doc_default = "none",
     .doc = "start a fresh run's LoRA adapters (and `lora.trainable` modules) from a checkpoint, an "
            "`adapters.h5` or a PEFT adapter directory (docs/INTEROP.md); ranks and scales must be the run's"},
};

/* ---- train --------------------------------------------------------------------------------------------------- */

static const CfgKey OPTIM_KEYS[] = {
    {.key = "name", .type = CFG_T_ENUM, O(OptimConfig, kind), .size = 64, .name_of = optim_name, .n_names = 2,
     .names_what = "optimizer", .def_str = "adamw", REPORTED, .doc = "PyTorch 1.13 update rules"},
    {.key = "lr", .type = CFG_T_FLOAT, F(OptimConfig, lr), .range = CFG_NONNEG, .def_by_kind = true, REPORTED,
     .doc_default = "1e-3 (adamw), 0.01 (sgd)", .doc = "base learning rate"},
    {.key = "weight_decay", .type = CFG_T_FLOAT, F(OptimConfig, weight_decay), .range = CFG_NONNEG,
     .def_by_kind = true, REPORTED, .doc_default = "0.01 (adamw), 0 (sgd)", .doc = "decoupled (AdamW) or L2 (SGD)"},
    {.key = "betas", .type = CFG_T_FLOAT2, F(OptimConfig, beta1), .offset2 = offsetof(OptimConfig, beta2),
     .range = FRACTION, .names_what = "a sequence of two numbers [beta1, beta2]", .def_by_kind = true,
     .kinds = BIT(OPTIM_ADAMW), REPORTED,
     .resume_as = "train.optimizer.betas/eps", .doc_default = "[0.9, 0.999]", .doc = "the moments' decay rates"},
    {.key = "eps", .type = CFG_T_FLOAT, F(OptimConfig, eps), .range = CFG_POSITIVE, .def_by_kind = true,
     .kinds = BIT(OPTIM_ADAMW), REPORTED, .resume_as = "train.optimizer.betas/eps", .doc_default = "1e-8",
     .doc = "added to the denominator"},
    {.key = "momentum", .type = CFG_T_FLOAT, F(OptimConfig, momentum), .range = CFG_NONNEG, .def_by_kind = true,
     .kinds = BIT(OPTIM_SGD), REPORTED, .resume_as = "train.optimizer.momentum/dampening/nesterov",
     .doc_default = "0", .doc = "momentum"},
    {.key = "dampening", .type = CFG_T_FLOAT, F(OptimConfig, dampening), .range = CFG_ANY, .def_by_kind = true,
     .kinds = BIT(OPTIM_SGD), REPORTED, .resume_as = "train.optimizer.momentum/dampening/nesterov",
     .doc_default = "0", .doc = "dampening of the momentum"},
    {.key = "nesterov", .type = CFG_T_BOOL, F(OptimConfig, nesterov), .def_by_kind = true, .kinds = BIT(OPTIM_SGD),
     REPORTED, .resume_as = "train.optimizer.momentum/dampening/nesterov", .doc_default = "false",
     .doc = "Nesterov momentum (needs momentum > 0 and dampening 0)"},
};

static const CfgKey SCHED_KEYS[] = {
    {.key = "name", .type = CFG_T_ENUM, O(LrSchedule, kind), .size = 64, .name_of = sched_name, .n_names = 3,
     .names_what = "lr schedule", .def_str = "constant", REPORTED, .resume_as = "train.schedule",
     .doc = "`constant`, `cosine` (to `min_lr` at the last step) or `step` (times `gamma` every `step_size` steps)"},
    {.key = "warmup_steps", .type = CFG_T_I64, F(LrSchedule, warmup_steps), .imin = 0, .imax = INT64_MAX, .def = 0,
     REPORTED, .resume_as = "train.schedule",
     .doc = "linear warmup, for every kind; a warmup longer than the run is clamped to the run's steps with one "
            "warning line, so the lr reaches `train.optimizer.lr` at the last step; the stored config keeps the "
            "value as written, and a resumed run clamps alike"},
    {.key = "min_lr", .type = CFG_T_FLOAT, F(LrSchedule, min_lr), .range = CFG_NONNEG, .def = 0,
     .kinds = BIT(SCHED_COSINE), REPORTED, .resume_as = "train.schedule",
     .doc = "the lr at the last step, at most `train.optimizer.lr`"},
    {.key = "step_size", .type = CFG_T_I64, F(LrSchedule, step_size), .imin = 1, .imax = INT64_MAX, .def = 0,
     .kinds = BIT(SCHED_STEP), REPORTED, .resume_as = "train.schedule", .doc_default = "(required)",
     .doc = "optimizer steps between lr drops"},
    {.key = "gamma", .type = CFG_T_FLOAT, F(LrSchedule, gamma), .range = CFG_POSITIVE, .def = 0.1,
     .kinds = BIT(SCHED_STEP), REPORTED, .resume_as = "train.schedule", .doc = "the factor of each drop"},
};

static const CfgTable OPTIM_TABLE = {
    .path = "train.optimizer", .owner = "the %s optimizer", .keys = OPTIM_KEYS, .n = N_OF(OPTIM_KEYS), .kind_key = 0,
    .kind_defaults = optim_kind_defaults, .after = optim_after,
    .doc = "The optimizer's name comes first: its kind's defaults fill the keys not given, and a key of the other "
           "kind is an error."};

static const CfgTable SCHED_TABLE = {
    .path = "train.schedule", .owner = "the %s schedule", .keys = SCHED_KEYS, .n = N_OF(SCHED_KEYS), .kind_key = 0,
    .after = sched_after, .doc = "A key of another schedule kind is an error."};

static const CfgKey TRAIN_KEYS[] = {
    {.key = "epochs", .type = CFG_T_I64, F(TrainConfig, epochs), .imin = 0, .imax = 1000000, .def = 1, REPORTED,
     .resume_as = "train.epochs/steps", .doc = "epochs; 0 = evaluate only"},
    {.key = "steps", .type = CFG_T_I64, F(TrainConfig, steps), .imin = 0, .imax = 1000000000000LL, .def = 0,
     REPORTED, .resume_as = "train.epochs/steps", .doc = "optimizer steps; when > 0 it overrides `epochs`"},
    {.key = "batch_size", .type = CFG_T_INT, F(TrainConfig, batch_size), .imin = 1, .imax = BATCH_MAX, .def = 64,
     FIXED, .doc = "training batch"},
    {.key = "eval_batch_size", .type = CFG_T_INT, F(TrainConfig, eval_batch_size), .imin = 1, .imax = BATCH_MAX,
     .def = 256, .doc = "evaluation batch"},
    {.key = "loss", .type = CFG_T_ENUM, O(TrainConfig, loss), .size = 32, .name_of = loss_name,
     .n_names = LOSS_COUNT, .names_what = "train.loss", .def_str = "cross_entropy", FIXED,
     .doc = "`cross_entropy` (softmax, against class labels; reports accuracy) or `mse` (mean squared error over "
            "every output value, against value targets or, with `data.target: input`, the input; reports "
            "`test_mse` and `test_mae`)"},
    {.key = "optimizer", .type = CFG_T_SECTION, F(TrainConfig, optim), .sub = &OPTIM_TABLE,
     .doc = "the optimizer"},
    {.key = "schedule", .type = CFG_T_SECTION, F(TrainConfig, schedule), .sub = &SCHED_TABLE,
     .doc = "the learning-rate schedule"},
    {.key = "grad_clip", .type = CFG_T_FLOAT, F(TrainConfig, grad_clip), .range = CFG_NONNEG, .def = 0, REPORTED,
     .doc_default = "0 (off)", .doc = "clip the global gradient L2 norm"},
    {.key = "sync_bn", .type = CFG_T_BOOL, F(TrainConfig, sync_bn), .def = 0, REPORTED,
     .doc = "`mpirun -np N qtrain-mpi`: batch norms use the whole global batch's statistics, gathered from every rank "
            "(PyTorch's SyncBatchNorm); `false`: each rank's own part, as DDP. No effect in one process"},
    {.key = "eval_every", .type = CFG_T_I64, F(TrainConfig, eval_every), .imin = 0, .imax = INT64_MAX, .def = 0,
     .doc_default = "0 (end only)", .doc = "evaluate validation and test every N steps"},
    {.key = "log_every", .type = CFG_T_I64, F(TrainConfig, log_every), .imin = 0, .imax = INT64_MAX, .def = 50,
     .doc = "one log line and metrics row per N steps (0 = the last step only)"},
    {.key = "checkpoint_every", .type = CFG_T_I64, F(TrainConfig, checkpoint_every), .imin = 0, .imax = INT64_MAX,
     .def = 0, .doc_default = "0 (final only)", .doc = "write `ckpt-<step>.h5` every N steps"},
    {.key = "keep_last", .type = CFG_T_INT, F(TrainConfig, keep_last), .imin = 0, .imax = INT_MAX, .def = 3,
     .doc = "keep the newest N `ckpt-*.h5` (0 = all)"},
    {.key = "on_nonfinite", .type = CFG_T_ENUM, O(TrainConfig, on_nonfinite), .size = 32, .name_of = nonfinite_name,
     .n_names = NONFINITE_COUNT, .names_what = "train.on_nonfinite", .def_str = "stop",
     .doc = "a NaN/inf loss or gradient: `stop` (naming step, module and tensor) or `skip` (drop that step's "
            "update, count it)"},
    {.key = "divergence_factor", .type = CFG_T_FLOAT, F(TrainConfig, divergence_factor), .range = CFG_NONNEG,
     .def = 2, .check = check_divergence, .doc_values = "0, or a finite number > 1",
     .doc = "warn once when the loss's ~10-step mean passes this factor × its ~100-step mean (0 = off)"},
};

/* ---- quant, lora --------------------------------------------------------------------------------------------- */

static const CfgKey QUANT_KEYS[] = {
    {.key = "mode", .type = CFG_T_ENUM, O(QuantConfig, mode), .size = 64, .name_of = mode_name,
     .n_names = QUANT_MODE_COUNT, .names_what = "quant mode", .def_str = "none", FIXED,
     .doc = "`none` (float32), `ptq` (weights quantized once and frozen, per `quant.rules`), `qat` (weights and "
            "inputs fake-quantized in training) or `qt` (quantized forward and backward GEMMs)"},
    {.key = "calibration_batches", .type = CFG_T_INT, F(QuantConfig, calibration_batches), .imin = 1,
     .imax = INT_MAX, .def = 16, FIXED,
     .doc = "training batches that calibrate static activation ranges (`act_qtype`)"},
    {.key = "fold_bn", .type = CFG_T_BOOL, F(QuantConfig, fold_bn), .def = 1, FIXED,
     .doc = "`ptq` and `qtrain quantize` fold each batch norm into the conv2d or dense layer whose output it alone "
            "reads, then quantize the folded weight (`qat`: trains it folded, as torch.ao's ConvBn); one that cannot "
            "fold stays float, the rules table says why"},
    {.key = "freeze_bn_after", .type = CFG_T_INT, F(QuantConfig, freeze_bn_after), .imin = 0, .imax = INT_MAX,
     .def = 0, FIXED,
     .doc = "`qat`: after this many training steps the batch norms folded into QAT layers use their running "
            "statistics and stop updating them (torch's freeze_bn_stats); 0 = never"},
    {.key = "rules", .type = CFG_T_PART, .part = &CFG_PART_QUANT_RULES, .sub = &CFG_QUANT_RULE_TABLE, FIXED,
     .doc_default = "`[]`", .doc_values = "at most 32 rules",
     .doc = "ordered rules, the first that matches a module wins; `ptq`, `qat` and `qt` need at least one, `none` "
            "none (quant.rules[] below)"},
};

static const CfgKey LORA_KEYS[] = {
    {.key = "rules", .type = CFG_T_PART, .part = &CFG_PART_LORA_RULES, .sub = &CFG_LORA_RULE_TABLE, FIXED,
     .doc_default = "`[]`", .doc_values = "at most 32 rules",
     .doc = "ordered rules giving modules adapters, the first that matches wins (lora.rules[] below)"},
    {.key = "trainable", .type = CFG_T_PART, .part = &CFG_PART_TRAINABLE, FIXED, .doc_default = "`[]`",
     .doc_values = "modules of the model with parameters",
     .doc = "modules of the model trained in full (float, unquantized, no adapter), e.g. a new head"},
    {.key = "strict_base", .type = CFG_T_BOOL, F(LoraConfig, strict_base), .def = 0,
     .doc = "`model.adapters_from` written over another base (its `base_sha256` differs from this run's) is an "
            "error instead of a warning"},
    {.key = "batchnorm", .type = CFG_T_ENUM, O(LoraConfig, batchnorm), .size = 32, .name_of = lora_bn_name,
     .n_names = LORA_BN_COUNT, .names_what = "lora.batchnorm", .def_str = "frozen", FIXED,
     .doc = "a LoRA run's base batch norms: `frozen` (running statistics, never updated; weight, bias frozen) or "
            "`train` (as a float run; weights and statistics kept in adapters.h5); one in `lora.trainable` trains "
            "either way"},
    {.key = "init", .type = CFG_T_ENUM, O(LoraConfig, init), .size = 64, .name_of = lora_init,
     .n_names = LORA_INIT_COUNT, .names_what = "lora init", .def_str = "default", FIXED,
     .doc = "the adapters' init for the rules that give no `init` of their own: `default`, `gaussian`, `pissa` or "
            "`loftq` (lora.rules[] below; docs/TRAINING.md)"},
    {.key = "loftq_iters", .type = CFG_T_INT, F(LoraConfig, loftq_iters), .imin = 1, .imax = LORA_LOFTQ_ITERS_MAX,
     .def = 5, FIXED,
     .doc = "`loftq`: alternations of quantizing W − s·B·A and taking B, A from the SVD of W − Q"},
};

/* A rule without an init of its own takes lora.init (load_lora_rule leaves it -1). */
static QtStatus lora_after(QtError *err, const YNode *map, const YNode *parent_map, void *section, void *parent,
                           CfgCtx *ctx) {
    (void)err, (void)map, (void)parent_map, (void)parent, (void)ctx;
    LoraConfig *l = section;
    for (int i = 0; i < l->n_rules; i++)
        if ((int)l->rules[i].spec.init == -1) l->rules[i].spec.init = l->init;
    return QT_OK;
}

static const CfgTable RUN_TABLE = {.path = "run", .owner = "run", .keys = RUN_KEYS, .n = N_OF(RUN_KEYS),
                                   .kind_key = -1};
static const CfgTable DATA_TABLE = {
    .path = "data", .owner = "data", .keys = DATA_KEYS, .n = N_OF(DATA_KEYS), .kind_key = -1, .after = data_after,
    .doc = "Transforms apply to training and test data alike, in the order listed: `normalize` (x = (x − mean) / "
           "std; without values they are measured on the training set as transformed so far, before the "
           "validation split: the population mean and std over every pixel, in double), `transpose` (x[c][i][j] "
           "→ x[c][j][i]), `invert` (x → 1 − x), `{classes: [a, b, ...]}` (keep only these labels, relabelled "
           "0..k−1 in the listed order), `{limit: N}` (keep the first N examples of each of train and test).\n\n"
           "`data.cache_dir` spares later starts ~0.16 s of gunzip (they read ~55 MB instead). A copy whose source "
           "changed (path, size, mtime) is rebuilt; a damaged or truncated one (CRC, IDX header, length) is reported "
           "and rebuilt; an unwritable directory only warns. Deleting the directory is always safe.\n\n"
           "`data.storage: file` keeps the uncompressed IDX file (a plain `.idx`/`-ubyte` file in `data.dir`, or the "
           "copy in `data.cache_dir`) open and reads each batch's images with `pread`, so the run never holds the "
           "data set. Both storages give the same batches and results bit for bit, so a resume may switch. With "
           "`file`, gzip'd data without a cache is an error, and so is a file changed or truncated during the run."};
static const CfgTable MODEL_TABLE = {
    .path = "model", .owner = "model", .keys = MODEL_KEYS, .n = N_OF(MODEL_KEYS), .kind_key = -1,
    .after = cfg_model_after,
    .missing = "missing; a config needs model.input and model.layers (see tests/configs/tiny-mlp.yaml)",
    .doc = "The whole model is checked before any data is read: the layers' shapes must chain."};
static const CfgTable TRAIN_TABLE = {.path = "train", .owner = "train", .keys = TRAIN_KEYS, .n = N_OF(TRAIN_KEYS),
                                     .kind_key = -1, .after = cfg_train_after};
static const CfgTable QUANT_TABLE = {.path = "quant", .owner = "quant", .keys = QUANT_KEYS, .n = N_OF(QUANT_KEYS),
                                     .kind_key = -1, .after = cfg_quant_after};
static const CfgTable LORA_TABLE = {.path = "lora", .owner = "lora", .keys = LORA_KEYS, .n = N_OF(LORA_KEYS),
                                    .kind_key = -1, .after = lora_after};

static const CfgKey ROOT_KEYS[] = {
    {.key = "run", .type = CFG_T_SECTION, F(Config, run), .sub = &RUN_TABLE},
    {.key = "data", .type = CFG_T_SECTION, F(Config, data), .sub = &DATA_TABLE},
    {.key = "model", .type = CFG_T_SECTION, F(Config, model), .sub = &MODEL_TABLE},
    {.key = "train", .type = CFG_T_SECTION, F(Config, train), .sub = &TRAIN_TABLE},
    {.key = "quant", .type = CFG_T_SECTION, F(Config, quant), .sub = &QUANT_TABLE},
    {.key = "lora", .type = CFG_T_SECTION, F(Config, lora), .sub = &LORA_TABLE},
};

const CfgTable CFG_ROOT = {.path = "", .owner = "the top level", .keys = ROOT_KEYS, .n = N_OF(ROOT_KEYS),
                           .kind_key = -1};

/* ---- a layer ------------------------------------------------------------------------------------------------- */

#define WEIGHTED (BIT(LAYER_DENSE) | BIT(LAYER_CONV2D))
#define WINDOWED (BIT(LAYER_CONV2D) | BIT(LAYER_MAXPOOL2D) | BIT(LAYER_AVGPOOL2D))
#define BATCHNORM (BIT(LAYER_BATCHNORM1D) | BIT(LAYER_BATCHNORM2D))

/* The kinds are layer types; the loader is cfg_load_layer (config_parts.c), whose defaults and required keys
 * follow the type. The order is the order of a layer's keys in the resolved YAML. */
static const CfgKey LAYER_KEYS[] = {
    {.key = "name", .type = CFG_T_STR, F(LayerSpec, name), .doc_default = "`<type><index>`, e.g. `relu1`",
     .doc_values = "like `run.name`", .doc = "the module path used in checkpoints and rules"},
    {.key = "type", .type = CFG_T_ENUM, O(LayerSpec, type), .size = 64, .name_of = layer_name,
     .n_names = LAYER_COUNT, .names_what = "layer type", .doc_default = "(required)", .doc = "the layer"},
    {.key = "inputs", .type = CFG_T_PART, .doc_default = "the previous layer (the model's input for the first)",
     .doc_values = "1 to 8 names of earlier layers, or `input` (the model's input, unless a layer is named so)",
     .doc = "the outputs the layer reads: one, or two or more for `add` and `concat` (more below)"},
    {.key = "units", .type = CFG_T_INT, F(LayerSpec, units), .imin = 1, .imax = LAYER_SIZE_MAX,
     .kinds = BIT(LAYER_DENSE), .doc_default = "(required)", .doc = "its outputs"},
    {.key = "out_channels", .type = CFG_T_INT, F(LayerSpec, out_channels), .imin = 1, .imax = LAYER_SIZE_MAX,
     .kinds = BIT(LAYER_CONV2D), .doc_default = "(required)", .doc = "its output channels"},
    {.key = "kernel", .type = CFG_T_INT, F(LayerSpec, kernel), .imin = 1, .imax = LAYER_WINDOW_MAX,
     .kinds = WINDOWED, .doc_default = "(required)", .doc_values = "1 to 4096; conv2d: or [h, w]",
     .doc = "the window's size"},
    {.key = "stride", .type = CFG_T_INT, F(LayerSpec, stride), .imin = 1, .imax = LAYER_WINDOW_MAX,
     .kinds = WINDOWED, .doc_default = "1 (conv2d), = kernel (pools)", .doc_values = "1 to 4096; conv2d: or [h, w]",
     .doc = "the window's step"},
    {.key = "padding", .type = CFG_T_INT, F(LayerSpec, padding), .imin = 0, .imax = LAYER_WINDOW_MAX,
     .kinds = BIT(LAYER_CONV2D), .doc_values = "0 to 4096, [h, w], or `same` (stride 1; PyTorch's, an odd total "
     "padding has its extra row and column at the bottom and right)",
     .doc = "zeros around the input"},
    {.key = "dilation", .type = CFG_T_INT, F(LayerSpec, dilation), .imin = 1, .imax = LAYER_WINDOW_MAX, .def = 1,
     .kinds = BIT(LAYER_CONV2D), .doc_values = "1 to 4096, or [h, w]",
     .doc = "the spacing of the kernel's taps (written in the resolved YAML only when not 1)"},
    {.key = "groups", .type = CFG_T_INT, F(LayerSpec, groups), .imin = 1, .imax = LAYER_SIZE_MAX, .def = 1,
     .kinds = BIT(LAYER_CONV2D),
     .doc = "input and output channels split into this many groups, each convolved alone; it must divide both. "
            "= the input channels: depthwise (written in the resolved YAML only when not 1)"},
    {.key = "p", .type = CFG_T_FLOAT, F(LayerSpec, p), .range = FRACTION, .def = 0.5, .kinds = BIT(LAYER_DROPOUT),
     .doc = "the probability of zeroing an input"},
    {.key = "eps", .type = CFG_T_FLOAT, F(LayerSpec, eps), .range = CFG_POSITIVE, .def = 1e-5, .doc_default = "1e-5",
     .kinds = BIT(LAYER_LAYERNORM) | BATCHNORM, .doc = "added to the variance"},
    {.key = "momentum", .type = CFG_T_FLOAT, F(LayerSpec, momentum), .range = FRACTION, .def = 0.1, .kinds = BATCHNORM,
     .doc = "the running statistics' update: running = (1 - momentum) running + momentum batch (PyTorch's)"},
    {.key = "affine", .type = CFG_T_PART, .kinds = BATCHNORM, .doc_default = "true", .doc_values = "true, false",
     .doc = "whether the layer has a weight (starts 1) and a bias (starts 0)"},
    {.key = "bias", .type = CFG_T_PART, .kinds = WEIGHTED, .doc_default = "true", .doc_values = "true, false",
     .doc = "whether the layer has a bias"},
    {.key = "init", .type = CFG_T_ENUM, O(LayerSpec, init), .size = 64, .name_of = init_name, .n_names = INIT_COUNT,
     .names_what = "init", .kinds = WEIGHTED, .doc_default = "`default`",
     .doc_values = "`default` (PyTorch's), `xavier_uniform`, `xavier_normal`, `normal`",
     .doc = "how the weight starts"},
    {.key = "init_std", .type = CFG_T_FLOAT, F(LayerSpec, init_std), .range = CFG_POSITIVE, .def = 0.02,
     .kinds = WEIGHTED, .doc = "the std of `init: normal` (only with it)"},
};

const CfgTable CFG_LAYER_TABLE = {
    .path = "model.layers[]", .owner = "a %s layer", .keys = LAYER_KEYS, .n = N_OF(LAYER_KEYS), .kind_key = 1,
    .doc = "Layers are mappings with a `type`; a key that does not apply to the layer's type (`units` on a "
           "conv2d) is an error. Types: dense, conv2d, relu, gelu, tanh, sigmoid, maxpool2d, avgpool2d, flatten, "
           "dropout, layernorm, batchnorm1d, batchnorm2d, globalavgpool, add, concat. A layer reads the previous "
           "layer's output unless it names its `inputs`; the layers run in the order listed, so an input must be an "
           "earlier layer (a later or unknown name is an error at the layer, and there are no cycles), and the "
           "model's output is the last layer's. `add` sums two or more inputs of equal shape; `concat` joins two or "
           "more along the channel axis (the features of a vector), their other dimensions equal. A batchnorm "
           "normalizes with the batch's statistics in training and with its running statistics (kept per module) in evaluation, as PyTorch's "
           "BatchNorm1d/2d; globalavgpool is the mean over H and W, (C, H, W) -> (C,)."};

/* ---- a rule -------------------------------------------------------------------------------------------------- */

#define QAT_ONLY .kinds = BIT(QUANT_MODE_QAT)
#define QT_ONLY .kinds = BIT(QUANT_MODE_QT)

/* The order is the order of the valid keys in messages; the first CFG_RULE_MATCH_KEYS are the match and skip,
 * and open both rule tables alike. The kinds are quant modes; the loader is config_rules.c's. */
static const CfgKey QUANT_RULE_KEYS[] = {
    {.key = "module_path", .type = CFG_T_PART, .doc_default = "(required)", .doc_values = "a POSIX extended regex",
     .doc = "matched against the whole module path (`\".*\"` = all); two repetition operators in a row, or "
            "`+`/`{n,m}` multiplying past 4096 copies, are refused"},
    {.key = "op_types", .type = CFG_T_PART, .doc_default = "`[]` (any)", .doc_values = "`dense`, `conv2d`",
     .doc = "the layer types the rule applies to"},
    {.key = "skip", .type = CFG_T_BOOL, F(QuantRule, skip), .def = 0,
     .doc = "`true`: matched modules stay float; a skip rule takes no other keys"},
    {.key = "weight_qtype", .type = CFG_T_PART, .doc_default = "(required unless `skip`)",
     .doc_values = "a format, or `none`", .doc = "the weight's format (`none`: the weight stays float)"},
    {.key = "tile_size", .type = CFG_T_INT, F(QuantRule, spec.tile_size), .imin = 0, .imax = INT_MAX,
     .doc_default = "0 (nf4: 64)",
     .doc = "0: one scale per output channel; T: blocks of T elements. nf4 without `tile_size` takes "
            "bitsandbytes' blocks of 64; `tile_size: 0` keeps nf4 per channel"},
    {.key = "per_tensor", .type = CFG_T_BOOL, F(QuantRule, spec.per_tensor),
     .doc = "one scale for the whole weight (`tile_size` 0 only)"},
    {.key = "weight_calibration", .type = CFG_T_PART,
     .doc_default = "`absmax` (`minmax` when not `symmetric`; `mean_abs` for `ternary`, `binary`)",
     .doc_values = "a calibration method, e.g. `percentile,99.9`; not `entropy`",
     .doc = "how the weight's range is calibrated (`entropy`, an activation method, collapses a weight channel's "
            "range)"},
    {.key = "symmetric", .type = CFG_T_PART, .doc_default = "true (false for `uint4`, `uint8`)",
     .doc_values = "true, false",
     .doc = "false: asymmetric, with zero points. `true` with an unsigned format has no negative codes: an error "
            "unless `allow_clip: true`"},
    {.key = "narrow_range", .type = CFG_T_BOOL, F(QuantRule, spec.narrow_range),
     .doc = "signed int codes −qmax … qmax"},
    {.key = "scale_type", .type = CFG_T_PART, .doc_default = "`float32`",
     .doc_values = "`float32`, `float16`, `bfloat16`, `pof2`", .doc = "the type of the stored scales"},
    {.key = "double_quant", .type = CFG_T_BOOL, F(QuantRule, spec.double_quant),
     .doc = "compress the block scales (QLoRA); not in qat or qt"},
    {.key = "act_qtype", .type = CFG_T_PART, .doc_default = "`none`", .doc_values = "a format, or `none`",
     .doc = "fake-quantize the layer's input per tensor with a calibrated static range"},
    {.key = "act_calibration", .type = CFG_T_PART, .doc_default = "`absmax` (`minmax` when not `act_symmetric`)",
     .doc_values = "a calibration method", .doc = "how the input's range is calibrated"},
    {.key = "act_symmetric", .type = CFG_T_PART, .doc_default = "true (false for `uint4`, `uint8`)",
     .doc_values = "true, false", .doc = "a symmetric input range; `true` with an unsigned format needs `allow_clip`"},
    {.key = "learn_amax", .type = CFG_T_ENUM, O(QuantRule, qat.learn_amax), .size = 64, .name_of = learn_name,
     .n_names = QAT_LEARN_COUNT, .names_what = "learn_amax", .def_str = "none", QAT_ONLY,
     .doc = "`tqt` (log2 of the range learned, power-of-two scales: needs `scale_type: pof2`) or `lsq` (step "
            "size learned); int/uint formats, no `tile_size`"},
    {.key = "amax_init", .type = CFG_T_PART, QAT_ONLY, .doc_default = "`absmax`",
     .doc_values = "a calibration method", .doc = "how learned ranges start (TQT's `3sd`, `kl_j`)"},
    {.key = "act_static_scale", .type = CFG_T_BOOL, F(QuantRule, qat.act_static_scale), QAT_ONLY,
     .doc = "without learned ranges: the input's range is the running mean of per-batch ranges (else "
            "calibrated on every batch)"},
    {.key = "lr", .type = CFG_T_FLOAT, F(QuantRule, qat.lr), .range = CFG_NONNEG, QAT_ONLY,
     .doc = "the learned ranges' own learning rate (0: the optimizer's)"},
    {.key = "disable_channelwise_axes", .type = CFG_T_PART, .doc_default = "false", .doc_values = "true, false",
     .doc = "the same as `per_tensor`"},
    {.key = "bwd_qtype", .type = CFG_T_PART, QT_ONLY, .doc_default = "`none`",
     .doc_values = "an int or float format, or `none`",
     .doc = "the format of the incoming gradient in both backward GEMMs; `none`: QAT's float backward"},
    {.key = "bwd_calibration", .type = CFG_T_PART, QT_ONLY, .doc_default = "`absmax`",
     .doc_values = "a calibration method", .doc = "the gradient's range per row (dX) / per column (dW)"},
    {.key = "bwd_weight_grad_tile_size", .type = CFG_T_INT, F(QuantRule, qt.bwd_weight_grad_tile_size), .imin = 0,
     .imax = INT_MAX, QT_ONLY,
     .doc = "rows of the gradient per scale in the weight-gradient GEMM (0: all)"},
    {.key = "bwd_stochastic_rounding", .type = CFG_T_PART, QT_ONLY, .doc_default = "`none`",
     .doc_values = "`none`, `uniform`", .doc = "`uniform`: floor(v + u), u ~ U[0, 1), unbiased"},
    {.key = "channelwise_noise_axes", .type = CFG_T_PART, QT_ONLY, .doc_default = "`[0]`",
     .doc_values = "`[0]`, `[1]`, `[0, 1]`",
     .doc = "the gradient axes the noise varies along (0: rows, 1: columns); shared along the others"},
    {.key = "rounding", .type = CFG_T_PART, .doc_default = "`rne`",
     .doc_values = "`rne`, `half_away`, `floor`, `stochastic`",
     .doc = "how the weight's codes round (stochastic: floor(v + u), u from the run's seed on a stream per "
            "module); ptq and qat, not with `learn_amax`"},
    {.key = "allow_clip", .type = CFG_T_BOOL, F(QuantRule, allow_clip),
     .doc = "`true`: accept `symmetric: true` / `act_symmetric: true` with an unsigned format (data known to be "
            "non-negative, e.g. after a ReLU); the run warns"},
};

const CfgTable CFG_QUANT_RULE_TABLE = {
    .path = "quant.rules[]", .owner = "a quant rule", .keys = QUANT_RULE_KEYS, .n = N_OF(QUANT_RULE_KEYS),
    .kind_key = -1, .kind_name = mode_name, .n_kinds = QUANT_MODE_COUNT,
    .doc = "A rule's settings are stored resolved (defaults that follow the format filled in). Keys marked qat or "
           "qt apply only in that `quant.mode`."};

/* After the match and skip, the order is the order of a rule's keys in the resolved YAML. */
static const CfgKey LORA_RULE_KEYS[] = {
    {.key = "module_path", .type = CFG_T_PART, .doc_default = "(required)", .doc_values = "a POSIX extended regex",
     .doc = "as in `quant.rules`"},
    {.key = "op_types", .type = CFG_T_PART, .doc_default = "`[]` (any)", .doc_values = "`dense`, `conv2d`",
     .doc = "as in `quant.rules`"},
    {.key = "skip", .type = CFG_T_BOOL, F(LoraRule, skip), .def = 0,
     .doc = "`true`: matched modules get no adapter; a skip rule takes no other keys"},
    {.key = "rank", .type = CFG_T_INT, F(LoraRule, spec.rank), .imin = 1, .imax = INT_MAX,
     .doc_default = "(required unless `skip`)", .doc = "adapter rank"},
    {.key = "alpha", .type = CFG_T_FLOAT, F(LoraRule, spec.alpha), .range = CFG_POSITIVE, .doc_default = "= rank",
     .doc = "the adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with `rslora`)"},
    {.key = "dropout", .type = CFG_T_FLOAT, F(LoraRule, spec.dropout), .range = FRACTION, .def = 0,
     .doc = "dropout on the adapter's input"},
    {.key = "rslora", .type = CFG_T_BOOL, F(LoraRule, spec.rslora), .def = 0, .doc = "rank-stabilized scale"},
    {.key = "init", .type = CFG_T_ENUM, O(LoraRule, spec.init), .size = 64, .name_of = lora_init,
     .n_names = LORA_INIT_COUNT, .names_what = "lora init", .def_str = "default",
     .doc_default = "`lora.init`",
     .doc = "`default` (A kaiming-uniform, B = 0), `gaussian` (A ~ N(0, 1/rank²), B = 0), `pissa` (B A the top "
            "singular triplets of W, the base the rest) or `loftq` (a ptq base and B A fitted to W in turns); not on "
            "grouped conv2d"},
    {.key = "dora", .type = CFG_T_BOOL, F(LoraRule, spec.dora), .def = 0,
     .doc = "DoRA: a learned magnitude per output channel times the direction of W + scale B A (docs/TRAINING.md)"},
};

const CfgTable CFG_LORA_RULE_TABLE = {.path = "lora.rules[]", .owner = "a lora rule", .keys = LORA_RULE_KEYS,
                                      .n = N_OF(LORA_RULE_KEYS), .kind_key = -1};
