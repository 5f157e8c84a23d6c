/* intprog.h - a quantized model lowered to an integer program: the ops of
 * device/qtrain_rt.h in order, their constants, and one arena planned by
 * lifetimes. `qtrain export --format c` writes it out as C (export_c.c);
 * `qtrain eval --integer` runs it here on the same runtime, so both compute
 * the same integers (docs/DEVICE.md).
 *
 * Lowering (intprog_build), per module of a PTQ model:
 *   conv2d, dense   a qrt conv/dense: int8 or int4 symmetric weight, one
 *                   scale per output channel or per tensor; the input's
 *                   static range is the rule's act_qtype (int8 or uint8);
 *                   a batch norm folded after it gives its bias;
 *   relu            the clamp of the op before it (act_min = zero point)
 *                   when it is that op's only reader, else qrt_relu in
 *                   place when nothing else reads the values back to that
 *                   op, else a requantized copy with the clamp;
 *   maxpool2d, flatten, dropout, a folded batch norm
 *                   keep the scale and zero point (flatten, dropout and the
 *                   batch norm write nothing);
 *   avgpool2d, globalavgpool, add (two inputs), concat
 *                   requantize into their output's range.
 * A value read by quantized layers takes their (equal) static input range;
 * any other (an add's operands, a pool's output read by no layer, the
 * logits) takes the min/max of its float values over the calibration
 * batches (intprog_calibrate), widened to hold 0. */
#ifndef QTRAIN_TRAINER_INTPROG_H
#define QTRAIN_TRAINER_INTPROG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"
#include "data/dataset.h"
#include "device/qtrain_rt.h"
#include "trainer/net.h"

typedef enum {
    IOP_CONV,
    IOP_DENSE,
    IOP_MAXPOOL,
    IOP_AVGPOOL,   /* also globalavgpool */
    IOP_ADD,
    IOP_REQUANT,   /* one input of a concat, or a relu whose input something else reads too (with the clamp) */
    IOP_RELU,
} IntOpKind;

typedef struct {
    IntOpKind kind;
    int module;               /* the module it computes (model index) */
    int in[2];                /* buffers read (in[1]: add only; -1: none) */
    int out;                  /* buffer written */
    size_t out_at;            /* bytes into out where it writes (a concat's later inputs) */
    int scratch;              /* conv: scratch buffer, or -1 */
    union {
        qrt_conv2d_t conv;
        qrt_dense_t dense;
        qrt_maxpool2d_t maxpool;
        qrt_avgpool2d_t avgpool;
        qrt_add_t add;
        qrt_requant_t requant;
        struct {
            int n;
            int32_t lo;
        } relu;
    } p;
    double macs;              /* multiply-accumulates per inference */
    float out_scale;          /* the written value's scale and zero point (real = scale * (code - zero point)) */
    int32_t out_zero_point;
} IntOp;

typedef struct {
    size_t bytes;
    size_t offset;            /* in the arena */
    int first, last;          /* live from op first (-1: the input) to op last (n_ops: the output) */
} IntBuf;

typedef struct {
    IntOp *ops;               /* [n_ops] */
    int n_ops;
    IntBuf *bufs;             /* [n_bufs] */
    int n_bufs;
    size_t arena_bytes;
    /* the input: codes in buffer in_buf */
    int in_ndim, in_shape[3];
    size_t in_size;
    int in_buf;
    float in_scale;           /* real = in_scale * (code - in_zp) */
    int32_t in_zp;
    int8_t *in_table;         /* (in_table_c, 256) codes of the stored bytes; NULL when the data is not uint8 */
    int in_table_c;           /* the table's maps: 1 (one for every value) or in_shape[0] (per channel) */
    float in_fq_s, in_fq_lo, in_fq_hi; /* the input's range as qgemm_quantize_u8 takes it (uint8 code = int8 + 128) */
    int in_fq_zero;
    /* the output */
    int out_buf;
    int out_ndim, out_shape[3];
    size_t out_size;
    float out_scale;
    int32_t out_zp;
    /* constants, owned */
    void **owned;
    int n_owned, cap_owned;
    size_t weight_bytes;      /* weights as stored (int4 packed) */
    size_t const_bytes;       /* biases, multipliers, shifts, the input table */
    double macs;
    int conv_layers, dense_layers, int4_layers;
} IntProgram;

/* Observed float ranges of every module's output: [n_modules][2] (lo, hi), over the first
 * quant.calibration_batches training batches, the model evaluated module by module as qtrain evaluates it. */
QtStatus intprog_calibrate(Net *n, const Dataset *train, int batch_size, int batches, Tape *t, float *x,
                           float (*range)[2], QtError *err);

/* Lowers n (a PTQ model) to p. range: intprog_calibrate's. data: the data set the input table is built for
 * (its element type, pixel map and shape). low_ram: the convs get no scratch (qrt_conv2d's direct loop: a
 * smaller arena, slower, the same integers). Anything the integer runtime cannot express is QT_ERR_CONFIG naming
 * the module and what to change. */
QtStatus intprog_build(IntProgram *p, const Net *n, const float (*range)[2], const Dataset *data, bool low_ram,
                       QtError *err);
void intprog_free(IntProgram *p);

/* One example: codes (in_size) -> out codes (out_size). arena: arena_bytes, 16-byte aligned. */
void intprog_run(const IntProgram *p, void *arena, const int8_t *codes, int8_t *out);
/* Input codes of one example stored as bytes, through the table. */
void intprog_quantize_u8(const IntProgram *p, const uint8_t *bytes, int8_t *codes);
/* Input codes of one example's float values (the data pipeline's), as qtrain's int8 path quantizes them; false
 * for a value that is not finite. */
bool intprog_quantize_f32(const IntProgram *p, const float *x, int8_t *codes);

#endif
