/* qtrain.h - qtrain as a library: train, quantize and fine-tune small
 * networks on a CPU from your own program.
 *
 * This is the one public header of libqtrain (docs/LIBRARY.md: install,
 * pkg-config, the example). Everything else under the source tree is
 * internal and may change between versions; this header follows the
 * version numbers below.
 *
 * THE IDEA
 *
 * A run is described by a config: the same YAML file the qtrain command
 * reads (docs/CONFIG.md lists every key). The config says which data, which
 * model, how to train, and two sets of rules that pick modules by path or
 * type:
 *   quant.rules  how each layer is quantized (quant.mode ptq: a frozen
 *                post-training-quantized base; qat, qt: quantized training)
 *   lora.rules   which layers get LoRA adapters, of what rank
 * and model.init_from names a checkpoint whose parameters start the run
 * (a pretrained float model to quantize and fine-tune).
 *
 * From a config you make a run: building it loads the data, builds the
 * model, loads model.init_from, quantizes the base as quant.rules say,
 * attaches the adapters lora.rules ask for, sets up the optimizer over
 * what trains, and calibrates static activation ranges. Then you step it,
 * evaluate it and save checkpoints, which the qtrain command (and h5py)
 * reads: `qtrain eval --checkpoint F`, `qtrain merge`, `qtrain inspect`.
 *
 * A WORKED EXAMPLE: QLoRA on a pretrained model
 *
 *     #include <qtrain.h>
 *
 *     // 1. the config: a file, with overrides as `qtrain --set` takes them
 *     const char *sets[] = {"model.init_from=runs/pretrain/final.h5", "train.epochs=1"};
 *     qtrain_config *cfg = NULL;
 *     if (qtrain_config_load(&cfg, "configs/qlora.yaml", sets, 2) != QTRAIN_OK) {
 *         fprintf(stderr, "%s\n", qtrain_last_error());
 *         return 1;
 *     }
 *
 *     // 2. the run: loads init_from, quantizes it to NF4 (quant.rules),
 *     //    attaches rank-8 adapters (lora.rules)
 *     qtrain_run *run = NULL;
 *     if (qtrain_run_new(&run, cfg) != QTRAIN_OK) { ... qtrain_last_error() ... }
 *
 *     // 3. train: one optimizer step per call, as many as the config plans
 *     while (qtrain_run_steps_left(run) > 0) {
 *         double loss;
 *         if (qtrain_run_step(run, &loss) != QTRAIN_OK) { ... }
 *     }
 *
 *     // 4. evaluate on the test split (and the validation split, if any)
 *     qtrain_metrics m;
 *     qtrain_run_evaluate(run, &m);
 *     printf("test accuracy %.4f, loss %.4f\n", m.test_accuracy, m.test_loss);
 *
 *     // 5. save: a checkpoint `qtrain eval` and `qtrain merge` read
 *     qtrain_run_save(run, "runs/qlora/final.h5");
 *     qtrain_run_free(run);
 *     qtrain_config_free(cfg);
 *
 * The same steps, with an empty quant and lora section, pretrain a float
 * model; examples/finetune.c is this example as a complete program. Its
 * result is the qtrain command's on the same config, to the last digit:
 * both run the same code (on the same OpenBLAS kernels: docs/LIBRARY.md).
 *
 * ERRORS
 *
 * Every function that can fail returns a qtrain_status; on failure
 * qtrain_last_error() holds a sentence saying what went wrong, where
 * (file, key, module) and what to do. Nothing in the library exits or
 * aborts. The message is per thread; a handle is used by one thread at a
 * time. The library prints warnings (a rule that matches no module, a
 * data-cache problem) on stderr, as the qtrain command does.
 *
 * THREADS
 *
 * run.threads in the config sets the threads of the matrix products
 * (OpenBLAS) and of qtrain's own kernels, for the whole process: the run
 * built last decides. Two runs may live side by side, stepped in turn.
 */
#ifndef QTRAIN_H
#define QTRAIN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- version ---------------------------------------------------------------------------------------------- */

/* The shared library's soname carries MAJOR (libqtrain.so.0). */
#define QTRAIN_VERSION_MAJOR 0
#define QTRAIN_VERSION_MINOR 1
#define QTRAIN_VERSION_PATCH 0

/* The library's version as "MAJOR.MINOR.PATCH": the one linked, which may
 * differ from the macros of the header compiled against. */
const char *qtrain_version(void);

/* ---- errors ----------------------------------------------------------------------------------------------- */

typedef enum {
    QTRAIN_OK = 0,
    QTRAIN_ERR_ARG,    /* a bad argument: NULL, an unknown name, a path that may not be written */
    QTRAIN_ERR_SHAPE,  /* shapes that do not fit together (a model whose input does not match the data) */
    QTRAIN_ERR_VALUE,  /* a bad value: NaN or Inf in the loss or the parameters, a label out of range */
    QTRAIN_ERR_NOMEM,  /* out of memory */
    QTRAIN_ERR_IO,     /* a file could not be read or written */
    QTRAIN_ERR_FORMAT, /* a file's contents are not what they should be */
    QTRAIN_ERR_CONFIG  /* the config asks for what cannot be done */
} qtrain_status;

/* The message of the last failed call in this thread ("" if none failed). */
const char *qtrain_last_error(void);
/* A short name for a status: "ok", "config error", ... */
const char *qtrain_status_name(qtrain_status status);

/* ---- 1. the config ---------------------------------------------------------------------------------------- */

typedef struct qtrain_config qtrain_config;

/* Reads the YAML config at path into *cfg (NULL on failure), then applies
 * overrides[0..n_overrides) in order, each "key.path=value" as `qtrain
 * --set` takes it ("train.optimizer.lr=3e-4", "model.layers.3.units=64",
 * "model.init_from=base.h5"), then checks it all. A mistyped key is an
 * error with a did-you-mean. */
qtrain_status qtrain_config_load(qtrain_config **cfg, const char *path, const char *const *overrides,
                                 int n_overrides);
/* The same from YAML text in memory; name stands for the file in messages. */
qtrain_status qtrain_config_parse(qtrain_config **cfg, const char *yaml, const char *name,
                                  const char *const *overrides, int n_overrides);
/* The config a checkpoint was trained with (stored in it), with overrides. */
qtrain_status qtrain_config_from_checkpoint(qtrain_config **cfg, const char *checkpoint,
                                            const char *const *overrides, int n_overrides);
/* The resolved config (every default filled in) as YAML, what checkpoints
 * store; malloc'd, the caller frees it. NULL if memory runs out. */
char *qtrain_config_yaml(const qtrain_config *cfg);
void qtrain_config_free(qtrain_config *cfg);

/* ---- quantizing a checkpoint, without a run ---------------------------------------------------------------- */

/* Post-training quantization of the float checkpoint `checkpoint` by cfg's
 * quant.rules, weight-only, without data (`qtrain quantize`): writes out, a
 * checkpoint to start a run from (model.init_from) or to evaluate. out is
 * a new file or a regular file it replaces. */
qtrain_status qtrain_quantize_checkpoint(const qtrain_config *cfg, const char *checkpoint, const char *out);

/* ---- 2. the run: a model and its training ------------------------------------------------------------------ */

typedef struct qtrain_run qtrain_run;

/* Builds a run from cfg (copied: cfg may be freed after): loads the data;
 * builds the model from run.seed; loads model.init_from (a float
 * checkpoint, or a PTQ one as stored); quantizes the base per quant.rules
 * (quant.mode ptq: frozen quantized weights; qat, qt: quantized training);
 * attaches the LoRA adapters of lora.rules (and loads model.adapters_from);
 * makes the optimizer over what trains; calibrates static activation
 * ranges. Writes no run files: run.out_dir is the qtrain command's, not
 * used here. All it may write is the data cache: inflated copies
 * of gzip'd data in data.cache_dir (by default ~/.cache/qtrain; none: off). */
qtrain_status qtrain_run_new(qtrain_run **run, const qtrain_config *cfg);

/* Builds the run of cfg and loads everything from `checkpoint`, a
 * checkpoint of the same config (qtrain_run_save's, or the qtrain
 * command's ckpt-*.h5, last.h5, final.h5): parameters, quantized base,
 * adapters, optimizer state, the step and the data position. Training
 * then continues exactly as the saved run would have. */
qtrain_status qtrain_run_load(qtrain_run **run, const qtrain_config *cfg, const char *checkpoint);

/* Whether the run prints what the qtrain command prints: its evaluation
 * lines. Off after qtrain_run_new and qtrain_run_load. */
void qtrain_run_set_verbose(qtrain_run *run, int verbose);

/* Optimizer steps done, and the steps of the config's plan (train.epochs
 * or train.steps over the training data, at train.batch_size). */
int64_t qtrain_run_steps_done(const qtrain_run *run);
int64_t qtrain_run_steps_total(const qtrain_run *run);
/* steps_total - steps_done. */
int64_t qtrain_run_steps_left(const qtrain_run *run);

/* ---- 3. training ------------------------------------------------------------------------------------------ */

/* One optimizer step on the next training batch: forward, loss, backward,
 * gradient clipping, the learning rate of the schedule, the update. *loss
 * (may be NULL) gets the batch's mean loss. A non-finite loss or gradient
 * stops with QTRAIN_ERR_VALUE (or with train.on_nonfinite: skip drops the
 * step, *loss NaN). QTRAIN_ERR_ARG when the plan is done: raise
 * train.steps or train.epochs for more. */
qtrain_status qtrain_run_step(qtrain_run *run, double *loss);

/* ---- 4. evaluation ---------------------------------------------------------------------------------------- */

typedef struct {
    int64_t step;          /* optimizer steps done */
    double test_loss;      /* mean cross-entropy over the test split (train.loss: mse: the mean squared error) */
    double test_accuracy;  /* in [0, 1]; NaN for a train.loss: mse run, which has no classes */
    double val_loss, val_accuracy; /* -1 without a validation split (data.val_fraction); accuracy NaN as above */
    int64_t params_trainable, params_frozen;
    int64_t model_bytes;   /* float parameters, quantized weights and adapters */
    double base_bits_per_param; /* 32 for a float base, about 4.1 for NF4 with double quantization */
} qtrain_metrics;

/* Evaluates the model as it is now on the validation (if any) and test
 * splits. Training may continue after it: evaluation changes nothing. */
qtrain_status qtrain_run_evaluate(qtrain_run *run, qtrain_metrics *metrics);

/* Evaluates the checkpoint at path (parameters, quantized base, adapters)
 * on cfg's data, as `qtrain eval --config` does; cfg NULL: the config
 * stored in the checkpoint. Writes nothing but the data cache, as
 * qtrain_run_new. */
qtrain_status qtrain_evaluate_checkpoint(const qtrain_config *cfg, const char *checkpoint, qtrain_metrics *metrics);

/* ---- 5. saving -------------------------------------------------------------------------------------------- */

/* Writes a complete checkpoint of the run to path (new, or a regular file
 * it replaces; atomically: a crash or a full disk never leaves half a
 * file): everything qtrain_run_load and `qtrain train --resume`, `eval`,
 * `merge`, `convert` and `inspect` read (docs/CHECKPOINT.md). */
qtrain_status qtrain_run_save(qtrain_run *run, const char *path);

/* Frees the run (NULL does nothing). */
void qtrain_run_free(qtrain_run *run);

#ifdef __cplusplus
}
#endif

#endif
