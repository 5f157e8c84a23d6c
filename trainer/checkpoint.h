/* checkpoint.h - HDF5 checkpoints: save, load, resume, inspect.
 *
 * Layout (format version 1; readable and writable from h5py):
 *   /                 attrs: format = "qtrain", version = 1 (int64),
 *                     qtrain_version (string), step, epoch (int64: whole epochs done),
 *                     config (string: the resolved YAML); optional: mode (string:
 *                     net_mode_name, a merge's base mode), and for a LoRA run
 *                     base_hash (CHECKPOINT_BASE_HASH), base_sha256, base_init_from,
 *                     lora_trainable, lora_batchnorm, for a merge merged_from, merged_from_base_sha256
 *   /params/<module>/<tensor>   float32, PyTorch layouts: dense weight (out, in),
 *                     conv weight (OC, C, KH, KW), biases (out,)
 *   /optim            attrs: optimizer ("adamw" | "sgd"), step (int64)
 *   /optim/<module>/<tensor>/m, v   float32, the parameter's shape; attrs step
 *                     (m: AdamW first moment or SGD momentum buffer, absent for
 *                     SGD without momentum; v: AdamW only)
 *   /rng/<name>       attrs seed, stream, counter (uint64): Philox state
 *   /data             attrs epoch, cursor (int64): position of the next batch;
 *                     seed (uint64), n_train (int64)
 *   /train            attrs loss_sum (double), correct, seen, steps (int64):
 *                     training metrics accumulated since the last log line;
 *                     run totals over all invocations: train_s, wall_s
 *                     (double, seconds), trained_examples (int64),
 *                     last_train_loss (double, NaN before the first log line)
 *   /quant/<module>/weight   a frozen quantized base weight (quant/qlayer.h):
 *                     qvalue (uint8: the codes packed exactly as in memory),
 *                     scale (float32, or uint16 float16/bfloat16 bits, or
 *                     uint8 e8m0 for pof2, or uint8 map codes with double
 *                     quantization; absent for MX formats, whose blocks carry
 *                     their scales), zero_point (int32 or float32; only when
 *                     asymmetric), scale_absmax (float32; double quantization);
 *                     attrs qtype, shape (the float weight's), tile (0 = per
 *                     output channel or per tensor, else elements per block of
 *                     the flattened weight), granularity ("per_channel",
 *                     "per_tensor", "block"), scale_type, symmetric,
 *                     narrow_range, double_quant, dq_block, dq_offset,
 *                     calibration, bits_per_weight
 *   /quant/<module>/input    static activation range: attrs qtype, calibration,
 *                     lo_mean, hi_mean (double), count (int64), scale,
 *                     zero_point (double)
 *   /quant/<module>/weight/state/<log2_t|step_size>, /quant/<module>/input/state/...
 *                     QAT: learned ranges (float32, one per channel or one), and
 *                     the input's running statistics as attrs of
 *                     /quant/<module>/input/state (calibration, lo_mean, hi_mean, count)
 *   /quant/<module>/grad/state   QT: attrs seed, stream, counter of the layer's
 *                     stochastic-rounding generator
 *   /lora/<module>    A (rank, in | rank, C, KH, KW), B (out, rank | OC, rank,
 *                     1, 1), float32; attrs rank, alpha, scale, rslora, dropout, init, dora
 *                     (pissa, loftq: also init_rel_error, init_default_rel_error);
 *                     a DoRA adapter's magnitude (out), float32
 * A released (quantized) weight is not under /params. /quant and /lora are
 * the hook layers' (trainer/hook.h), each kind writing and reading its own
 * part (trainer/hook_ptq.c, hook_lora.c, hook_qat.c, hook_fqt.c).
 *
 * Every file is written to "<name>.tmp.<pid>" in the same directory,
 * flushed, fsync'd, renamed over the real name and the directory fsync'd,
 * so a crash or a full disk never leaves a partial file under a real name
 * and never damages an existing good checkpoint. */
#ifndef QTRAIN_TRAINER_CHECKPOINT_H
#define QTRAIN_TRAINER_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/error.h"
#include "base/fsutil.h"
#include "nn/model.h"
#include "nn/optim.h"
#include "base/rng.h"
#include "trainer/guard.h"
#include "trainer/hook.h"
#include "trainer/sha256.h"

#define CHECKPOINT_FORMAT "qtrain"
#define CHECKPOINT_VERSION 1
#define CHECKPOINT_MAX_RNGS 4
#define CKPT_LIST_MAX 128 /* modules checkpoint_list_quant reports at most */

/* The parts of a model beyond its float parameters: its hook layers, a
 * set per kind (trainer/hook.h), each kind saving and loading its own
 * groups (/quant, /lora; any set may be empty). Loading fills them in place:
 * the layers must have their layout (a PTQ layer qlayer_init_empty or
 * quantized, an adapter its A/B allocated). */
typedef HookLayers CheckpointNet;

/* Everything besides parameters and optimizer state that decides the rest
 * of a run. */
typedef struct {
    int64_t step;          /* optimizer steps done */
    int64_t epochs_done;   /* whole epochs completed (the root `epoch` attribute, for people) */
    int64_t epoch;         /* batcher position of the next batch (/data) */
    int64_t cursor;
    uint64_t seed;         /* run.seed */
    int64_t n_train;       /* training examples (a resume on other data is refused) */
    double log_loss_sum;   /* train metrics since the last log line */
    int64_t log_correct, log_seen, log_steps;
    double train_s;        /* seconds spent in training steps, over all invocations */
    double wall_s;         /* wall seconds of the run, over all invocations */
    int64_t trained_examples; /* training examples processed, over all invocations */
    double last_train_loss;   /* mean loss of the last logged window; NaN if none yet */
    int64_t nonfinite_skipped; /* steps whose update train.on_nonfinite: skip dropped */
    int64_t nonfinite_streak;  /* of them, the latest steps in a row */
    LossWatch loss_watch;     /* the divergence watch; absent from older files: all zero */
    int64_t world_size;       /* the ranks of a data-parallel run (dist.h) that wrote it; older files: 1 */
    struct {
        const char *name;  /* "dropout" */
        Rng *rng;          /* save: read from; load: restored into */
    } rngs[CHECKPOINT_MAX_RNGS];
    int n_rngs;
    const char *config_text; /* save: the resolved YAML (may be NULL -> "") */
    CheckpointNet net;       /* /quant and /lora, saved and restored with the rest */
    /* save only: what the model is and where it comes from (root attributes; NULL = not written) */
    const char *mode;           /* "float", "ptq", "lora", "qlora", ... (net_mode_name; a merge's: its base's) */
    const char *base_sha256;    /* a LoRA run's frozen base: checkpoint_base_sha256 */
    const char *base_init_from; /* ...and the model.init_from it came from ("" = none) */
    const char *lora_trainable; /* adapters: lora.trainable, comma-separated ("" = none) */
    const char *lora_batchnorm; /* a LoRA run: lora.batchnorm ("frozen", "train") */
    const bool *bn_trained;     /* adapters.h5: [n_modules] the batch norms the run trains, whose running
                                   statistics it keeps (net->bn_trained; NULL = none) */
    const char *merged_from;    /* qtrain merge: the checkpoint whose adapters were folded in */
    const char *merged_from_base_sha256; /* ...and the base hash of that checkpoint */
    FsReplace replace;       /* save: what may be at the path already (0: anything, a run's own file in its
                                locked out_dir; a user's --out: FS_REPLACE_NONE, or FS_REPLACE_REGULAR with --force) */
} CheckpointState;

#define CHECKPOINT_BASE_HASH "qtrain-base-sha256-v2" /* the root attribute base_hash names the scheme */
/* The scheme before frozen batch norms' statistics (/buffers) were hashed: adapters.h5 files of older runs carry
 * it, and net_check_adapters_base compares them by it. */
#define CHECKPOINT_BASE_HASH_V1 "qtrain-base-sha256-v1"
#define CHECKPOINT_PROV_PATH_MAX 4096

/* The provenance attributes of a file's root ("" when absent: a file
 * written before they existed, or not by a LoRA run or a merge). */
typedef struct {
    int64_t step, epoch;
    char base_hash[32];       /* the scheme of base_sha256 (CHECKPOINT_BASE_HASH or _V1) */
    char base_sha256[SHA256_HEX_CHARS];
    char base_init_from[CHECKPOINT_PROV_PATH_MAX];
    char lora_batchnorm[16];  /* "frozen", "train" */
    char merged_from[CHECKPOINT_PROV_PATH_MAX];
    char merged_from_base_sha256[SHA256_HEX_CHARS];
} CheckpointProvenance;

/* Writes a complete checkpoint to `path` atomically (see above). opt may be
 * NULL (no /optim group). On failure nothing is left under `path` that was
 * not there before, and the message says what failed (e.g. the disk is
 * full) and where. */
QtStatus checkpoint_save(const char *path, const Model *m, const Optimizer *opt, const CheckpointState *s,
                         QtError *err);

/* The bytes checkpoint_save would write (malloc'd, *image; the caller
 * frees it): a data-parallel run hands its state from rank 0 to the others
 * this way. `path` only names it in messages. */
QtStatus checkpoint_save_image(const char *path, const Model *m, const Optimizer *opt, const CheckpointState *s,
                               void **image, size_t *size, QtError *err);

/* Restores parameters, optimizer state (if opt != NULL) and state (if
 * s != NULL: scalar fields, and every rng named in s->rngs from /rng/<name>)
 * from `path`. Everything is checked before anything is written: a file
 * that is not HDF5, not a qtrain checkpoint, of another version, or of
 * another model (the first missing, extra or differently shaped parameter
 * is named, with both shapes), or whose optimizer differs, is an error and
 * leaves m, opt and s untouched. */
QtStatus checkpoint_load(const char *path, Model *m, Optimizer *opt, CheckpointState *s, QtError *err);

/* Only /params, for model.init_from: the same checks as checkpoint_load. */
QtStatus checkpoint_load_params(const char *path, Model *m, QtError *err);
/* /params, /quant and /lora into m and net (either part of net may be
 * empty), without optimizer or run state: for evaluation and merging. */
QtStatus checkpoint_load_model(const char *path, Model *m, const CheckpointNet *net, QtError *err);

/* adapters.h5: the header (s: step, epochs_done, config_text and the
 * provenance fields base_sha256, base_init_from, lora_trainable,
 * lora_batchnorm), /params of the trainable model parameters only (the
 * lora.trainable modules, batch norms with lora.batchnorm: train), /buffers
 * of the batch norms s->bn_trained marks, and /lora. */
QtStatus checkpoint_save_adapters(const char *path, const Model *m, const CheckpointState *s, QtError *err);
/* model.adapters_from: /lora for every adapter of s->net and /params for
 * every trainable model parameter, from an adapters.h5 or a full
 * checkpoint, and /buffers for the batch norms bn_trained ([n_modules] or
 * NULL) marks where the file has them (the others keep the base's
 * statistics). An adapter the file lacks, one it has that the run does not,
 * a shape that differs, or stored rank, alpha or rslora attributes that
 * differ from the run's rule for that module are errors naming the first
 * such module. */
QtStatus checkpoint_load_adapters(const char *path, Model *m, const CheckpointNet *net, const bool *bn_trained,
                                  QtError *err);

/* The identity of a LoRA run's frozen base (CHECKPOINT_BASE_HASH), as 64
 * hex digits: SHA-256 over the datasets of the frozen base as a checkpoint
 * stores them -- every /params/<module>/<tensor> of a parameter the run does
 * not train (all but the adapters, the lora.trainable modules and with
 * lora.batchnorm: train the batch norms), every
 * /buffers/<module>/<statistic> of a frozen batch norm (BatchNormState.frozen:
 * num_batches_tracked as dtype "int64", shape ""), and every dataset
 * directly under /quant/<module>/weight (qvalue, scale,
 * zero_point, scale_absmax: the packed codes and scales) -- taken in
 * bytewise order of their names without the leading '/', each as
 *   name NUL dtype NUL shape NUL u64le(byte count) bytes
 * with dtype numpy's name ("float32", "uint8", "uint16", "int32"), shape
 * the dimensions in decimal joined by ',' ("8,1,3,3"; "72"), and the bytes
 * the little-endian elements in row-major order, as stored. Attributes
 * (quantization formats, activation ranges) are not hashed.
 * scripts/base_sha256.py recomputes it from a checkpoint. */
QtStatus checkpoint_base_sha256(const Model *m, const CheckpointNet *net, char hex[SHA256_HEX_CHARS], QtError *err);
/* The same by scheme CHECKPOINT_BASE_HASH_V1: without the frozen batch norms' /buffers. */
QtStatus checkpoint_base_sha256_v1(const Model *m, const CheckpointNet *net, char hex[SHA256_HEX_CHARS],
                                   QtError *err);
/* The root provenance attributes of path (see CheckpointProvenance). */
QtStatus checkpoint_read_provenance(const char *path, CheckpointProvenance *p, QtError *err);
/* The module paths under /quant of a checkpoint (a PTQ base from `qtrain
 * quantize`), up to cap of them, into paths[i][MODULE_NAME_MAX]; *n = the
 * count (0 for a float checkpoint). */
QtStatus checkpoint_list_quant(const char *path, char (*paths)[MODULE_NAME_MAX], int cap, int *n, QtError *err);

/* The root `config` attribute (malloc'd; the caller frees). */
QtStatus checkpoint_read_config(const char *path, char **config_text, QtError *err);

/* `qtrain inspect`: every group and dataset (shape, dtype, bytes) and every
 * attribute (value; long strings abbreviated to their first line), then the
 * total bytes of data. Works on any HDF5 file, not only checkpoints. */
QtStatus checkpoint_inspect(const char *path, FILE *out, QtError *err);

/* Rotation in a run's out_dir.
 * checkpoint_save_in_dir(dir, name, keep_last, ...) saves <dir>/<name>
 * (name NULL = "ckpt-<step, 8 digits>.h5"), then points <dir>/last.h5 at
 * it (a hard link renamed into place, or a copy where links are not
 * supported), then deletes the oldest ckpt-*.h5 beyond keep_last (0 = keep
 * all; final.h5 and last.h5 are never deleted). saved (may be NULL) gets
 * the path written. */
QtStatus checkpoint_save_in_dir(const char *dir, const char *name, int keep_last, const Model *m,
                                const Optimizer *opt, const CheckpointState *s, char *saved, size_t saved_cap,
                                QtError *err);
/* The checkpoint `--resume auto` takes: <dir>/last.h5 if present, else the
 * ckpt-*.h5 with the highest step. QT_ERR_IO with path[0] = 0 if there is
 * none (the trainer then starts from scratch). */
QtStatus checkpoint_find_latest(const char *dir, char *path, size_t cap, QtError *err);

#endif
