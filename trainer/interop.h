/* interop.h - models in and out of PyTorch (interop.c): `qtrain export` and
 * model.init_from of a .safetensors file. docs/INTEROP.md. */
#ifndef QTRAIN_TRAINER_INTEROP_H
#define QTRAIN_TRAINER_INTEROP_H

#include <stdbool.h>
#include <stdio.h>

#include "base/error.h"
#include "nn/model.h"

typedef struct Net Net;

/* Whether path names a safetensors file (ends in ".safetensors"). */
bool interop_is_safetensors(const char *path);

/* `qtrain export`: the checkpoint's float model (quantized weights
 * dequantized; merge: LoRA adapters folded in) as format "safetensors" (a
 * PyTorch state_dict, float32) or "h5" (a float qtrain checkpoint), at out
 * (an existing regular file only with force). log (may be NULL) gets one
 * line. */
QtStatus interop_export(const char *checkpoint, const char *format, const char *out, bool merge, bool force,
                        FILE *log, QtError *err);

/* A float model's parameters and batch-norm buffers as a PyTorch state_dict in safetensors at out (replacing a
 * regular file), recording the source checkpoint and whether adapters were merged. */
QtStatus interop_write_state_dict(const char *out, const Model *m, const char *checkpoint, bool merge, QtError *err);

/* `qtrain export --format peft`: the checkpoint's LoRA adapters as a PEFT adapter directory at dir (new, or
 * existing with force): adapter_config.json, adapter_model.safetensors and base_model.safetensors (the float
 * base). interop_peft.c. */
QtStatus interop_export_peft(const char *checkpoint, const char *dir, bool force, FILE *log, QtError *err);

/* Whether path is a PEFT adapter directory (holds adapter_config.json). */
bool interop_is_peft_dir(const char *path);
/* model.adapters_from of a PEFT adapter directory: the run's adapters (its lora rules' modules, ranks and
 * scales must be the directory's target_modules, r / rank_pattern and lora_alpha / alpha_pattern / use_rslora)
 * and lora.trainable modules (modules_to_save) take the directory's tensors; use_dora must be the rules' dora (a
 * DoRA adapter reads lora_magnitude_vector too). Bias adapters and fan_in_fan_out are refused by name.
 * interop_peft.c. */
QtStatus interop_load_peft(const char *dir, Net *n, QtError *err);

/* model.init_from of a .safetensors file: every parameter and batch-norm
 * buffer of m by its state_dict name (num_batches_tracked optional), any
 * float dtype; a missing or extra tensor is an error listing them, a shape
 * mismatch names both shapes. */
QtStatus interop_load_safetensors(const char *path, Model *m, QtError *err);

#endif
