/* qlayer_ops.h - a knob of the quantized layer's float path (qlayer_ops.c).
 * Internal to quant/ and its tests. */
#ifndef QTRAIN_QUANT_QLAYER_OPS_H
#define QTRAIN_QUANT_QLAYER_OPS_H

#include <stddef.h>

/* A dense layer whose float weight takes at most this many bytes (16 MiB by
 * default) is dequantized whole, once per step, and the backward reads that
 * copy; a larger one is dequantized band by band (QLAYER_TILE_BYTES) in the
 * forward and again in the backward. Tests set 0 to run the bands. */
extern size_t qlayer_dense_whole_bytes;

#endif
