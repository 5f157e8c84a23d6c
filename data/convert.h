/* convert.h - a data set's stored values to the floats of a batch (convert.c).
 * Internal to data/: dataset.c is its user. */
#ifndef QTRAIN_DATA_CONVERT_H
#define QTRAIN_DATA_CONVERT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dataset.h"

/* x (k, feat) from k stored examples raw [k][feat * elem bytes], through the
 * data set's pixel map (per channel when it has one); transpose: each
 * (side, side) channel of raw is read transposed (a file-backed set's
 * transpose). The one place the map is applied, so memory- and file-backed
 * sets give the same floats. */
void convert_rows(float *x, const uint8_t *raw, int k, const Dataset *d, bool transpose);

/* The stored value i of raw as a float, before the map. */
float convert_value(const uint8_t *raw, size_t i, DataElem e);

/* The index of the first NaN or infinity among n stored values of raw, or n. */
size_t convert_first_nonfinite(const uint8_t *raw, size_t n, DataElem e);

/* Transposes each (side, side) channel of n examples of `channels` channels in place. */
void convert_transpose_rows(uint8_t *raw, int n, int channels, int side, DataElem e);

#endif
