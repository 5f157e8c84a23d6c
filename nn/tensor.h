/* tensor.h - contiguous float32 tensors (row-major, up to 4 dims) and the
 * autodiff variable that pairs a value with its gradient.
 *
 * Layouts follow PyTorch so checkpoints compare directly: images NCHW, dense
 * weights (out, in), conv weights (out, in, kh, kw). */
#ifndef QTRAIN_NN_TENSOR_H
#define QTRAIN_NN_TENSOR_H

#include <stdbool.h>
#include <stddef.h>

#define TENSOR_MAX_DIMS 4
#define TENSOR_MAX_NUMEL ((size_t)1 << 31) /* 8 GiB of float32 */

typedef struct {
    float *data;                  /* [numel], row-major, contiguous */
    int ndim;                     /* 1..TENSOR_MAX_DIMS */
    int shape[TENSOR_MAX_DIMS];   /* shape[0..ndim-1]; unused dims are 1 */
} Tensor;

/* The int8 hand-off (quant/qlayer_int8.c): an output made only as the input codes of its one reader, an int8
 * layer, u = rint(clamp(x / s, lo, hi)) + zero for every value x (N, C, H, W), one byte each: plane 0, in the
 * value's layout; plane > 0, a dword of 4 channels' codes a pixel, (N, ceil(C/4), plane) dwords, pixel p of
 * channels 4g .. 4g + 3 at [n][g][p] (zero in the channels past C and the pixels past H W): channel quads, which
 * the readers use as their planes or copy into theirs. */
typedef struct VarCodes {
    const unsigned char *data; /* the Var's own value buffer (4 bytes a value), or with floats a buffer of its own
                                * as large, which leaves at least 3 numel bytes after the codes that a vector loop
                                * may read (plane 0) */
    float s, lo, hi;
    int zero;
    size_t plane;
    bool floats;               /* the Var's value holds its floats too (another reader takes them: a residual add),
                                * and data is a buffer of its own, as large */
} VarCodes;

/* A node of the autodiff graph. Parameters own their value and grad for the
 * whole run; every other Var lives in the step arena. */
typedef struct Var {
    Tensor value;          /* shape of the variable */
    float *grad;           /* [numel] like value; NULL until first needed */
    bool requires_grad;    /* grads flow into this Var */
    bool is_param;         /* grad is a persistent buffer (not the arena's) */
    struct TapeRemake *remake; /* how to make value again once the forward dropped it (tape.h), or NULL */
    const float *moments;  /* (N, C, 3) or NULL: each (sample, channel) plane's batch-norm block moments, made with
                            * value by the op that wrote it (batchnorm_plane_moments) for the batch norm reading it */
    const struct NnAffineRelu *view; /* or NULL: value.data is never written (NULL); the value is relu(an affine map
                            * of another Var), which the one reader that knows computes as it reads (nn/ops.h) */
    const VarCodes *codes; /* or NULL: value.data holds the codes' bytes, not floats (unless codes->floats); only
                            * the readers whose input quantizer they are read them (a forward without gradients,
                            * Tape.handoff) */
    const float *means;    /* (N, C) or NULL: each plane's mean as nn_globalavgpool makes it (nn_plane_mean),
                            * made by the op that wrote this Var for a globalavgpool that alone reads it; value.data
                            * is then never written (a forward without gradients, Tape.handoff) */
} Var;

size_t tensor_numel(const Tensor *t);
/* "(128, 1, 28, 28)" into buf; returns buf. */
char *tensor_shape_str(const Tensor *t, char *buf, size_t size);
bool tensor_same_shape(const Tensor *a, const Tensor *b);
/* Fills shape/ndim from a list; returns false if ndim is out of range, a
 * dimension is not positive or the tensor exceeds TENSOR_MAX_NUMEL. */
bool tensor_set_shape(Tensor *t, int ndim, const int *shape);

static inline size_t var_numel(const Var *v) { return tensor_numel(&v->value); }
/* The index of the first NaN or infinity of x[0..n), or n if every value is
 * finite. One pass of integer exponent tests, which vectorise. */
size_t floats_first_nonfinite(const float *x, size_t n);

#endif
