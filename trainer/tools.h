/* tools.h - `qtrain quantize` and `qtrain merge`: checkpoints in, checkpoints out. */
#ifndef QTRAIN_TRAINER_TOOLS_H
#define QTRAIN_TRAINER_TOOLS_H

#include <stdbool.h>
#include <stdio.h>

#include "base/error.h"
#include "trainer/config.h"
#include "trainer/net.h"

/* `out`, in every tool: a new file, or with force a regular file to replace;
 * anything else (a directory, symlink, device, FIFO) is refused with
 * QT_ERR_ARG before any work (base/fsutil.h: fs_check_out_path). In a run
 * directory the write takes its lock (trainer/rundir.h). */

/* PTQ of the float checkpoint `checkpoint` by cfg's weight-only quant rules,
 * without data (Qwix's quantize_params): writes `out`, a checkpoint whose
 * quantized modules are under /quant and whose other parameters are under
 * /params, with cfg (init_from = checkpoint) as its config. A rule with an
 * act_qtype is refused: static activation ranges need calibration data.
 * The rule table and the sizes go to log (NULL: silent). */
QtStatus tools_quantize(const Config *cfg, const char *checkpoint, const char *out, bool force, FILE *log,
                        QtError *err);

typedef struct {
    int modules;                 /* adapters folded */
    double weight_rel_rmse;      /* quantized base: ||requant(W + dW) - (W + dW)|| / ||W + dW|| over all merged
                                    weights; 0 for a float base */
    double test_accuracy_before; /* the checkpoint with its adapters */
    double test_accuracy_after;  /* the merged checkpoint */
    double test_loss_before, test_loss_after;
    bool dequantized;            /* --dequantize: a float model */
    const char *mode;            /* the merged checkpoint's: "float", "ptq", "qat" (its base's) */
} MergeReport;

/* Folds the LoRA adapters of `checkpoint` into its base and writes `out`
 * (no /lora; the config keeps lora.trainable but no rules; root attributes
 * mode = the base's, merged_from = checkpoint and merged_from_base_sha256 =
 * its base identity). A float base gets W + scale*B*A; a quantized base is
 * dequantized, added to and quantized again with the same rule, or with
 * dequantize stored as float32 (quant.mode none: no re-quantization error;
 * PEFT's merge_and_unload). Both checkpoints are evaluated on the test
 * split of the stored config's data. Per-module errors go to log. */
QtStatus tools_merge(const char *checkpoint, const char *out, bool dequantize, bool force, FILE *log, MergeReport *rep,
                     QtError *err);

typedef struct {
    int modules;                 /* QAT layers converted */
    double test_accuracy_qat;    /* the QAT checkpoint evaluated as it trained */
    double test_accuracy_ptq;    /* the converted checkpoint */
    double test_loss_qat, test_loss_ptq;
} ConvertReport;

/* `qtrain convert`: turns the QAT checkpoint `checkpoint` into a PTQ
 * checkpoint `out` whose base holds real QArrays: each QAT layer's weight
 * quantized with its learned (or calibrated) range and its input's static
 * scale (qat_layer_convert), the config's quant.mode set to ptq. Both are
 * evaluated on the stored config's test split. */
/* The float model of a checkpoint, as qtrain evaluates it: quantized weights
 * dequantized (qlayer_dequantize_weight), batch norms as they are (folded
 * ones marked), QAT/QT models' float weights; with merge, every LoRA
 * adapter folded into its weight (a checkpoint without adapters is then an
 * error), else the adapters left out. *cfg gets the float config (cfg must
 * outlive out, which points at it); net_free(out) after success. */
QtStatus tools_float_net(const char *checkpoint, bool merge, Config *cfg, Net *out, FILE *log, QtError *err);

/* A checkpoint's stored config (its /config text) into *c. */
QtStatus tools_load_config(const char *checkpoint, Config *c, QtError *err);

/* The model a checkpoint holds as it trained (parameters, quantized base, adapters, quantizer state) under its
 * stored config *c (c must outlive n); net_free(n) after success. */
QtStatus tools_load_net(const char *checkpoint, Config *c, Net *n, QtError *err);

/* n (a float model, tools_float_net) as a float checkpoint at out, recording `from` as its source. */
QtStatus tools_save_float(const char *out, bool force, const Net *n, const char *from, QtError *err);

QtStatus tools_convert(const char *checkpoint, const char *out, bool force, FILE *log, ConvertReport *rep,
                       QtError *err);

#endif
