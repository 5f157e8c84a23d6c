/* export_c.h - `qtrain export --format c`: a PTQ checkpoint (or a QAT one,
 * converted, or a LoRA run, merged, on the way) as a dependency-free int8 C99
 * program: NAME.h, NAME.c, qtrain_rt.h, qtrain_rt.c, main_example.c,
 * Makefile and export.json in a new directory (docs/DEVICE.md). */
#ifndef QTRAIN_TRAINER_EXPORT_C_H
#define QTRAIN_TRAINER_EXPORT_C_H

#include <stdbool.h>
#include <stdio.h>

#include "base/error.h"

typedef struct {
    size_t weight_bytes;     /* weights as stored (int4 packed two per byte) */
    size_t const_bytes;      /* biases, requantization multipliers and shifts, the input table */
    size_t arena_bytes;      /* the one static arena */
    size_t io_bytes;         /* the caller's input and output */
    double macs;             /* multiply-accumulates per inference */
    int ops, conv_layers, dense_layers, int4_layers;
    double test_accuracy;    /* the integer program on the test split (NaN for an mse model) */
    double test_loss;
    int test_examples;
    bool code_measured;      /* arm-none-eabi-gcc was found: the Cortex-M4 sizes below are measured */
    long text_bytes, rodata_bytes, data_bytes, bss_bytes; /* NAME.c + qtrain_rt.c, -mcpu=cortex-m4 -mthumb -Os;
                                                             flash = text + rodata + data */
} ExportCReport;

/* The runtime's text (generated at build time from device/qtrain_rt.[ch] by scripts/embed.sh). */
extern const char export_rt_h[], export_rt_c[];

/* Writes the program of `checkpoint` into the new directory out (with force, an existing directory holding an
 * export.json is replaced; nothing else is). name: the C prefix (NULL: "model"), [A-Za-z_][A-Za-z0-9_]*.
 * low_ram: the convs run without scratch (a smaller arena, slower). On
 * error nothing is left at out. log: progress and the report (NULL: silent). */
QtStatus export_c(const char *checkpoint, const char *out, const char *name, bool force, bool low_ram, FILE *log,
                  ExportCReport *rep, QtError *err);

#endif
