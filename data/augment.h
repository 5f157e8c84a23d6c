/* augment.h - random image augmentation of training batches.
 *
 * Applied to a batch of floats x (n, C, H, W) after conversion and the
 * transforms, in place, in training only. Each example's augmentation is a
 * pure function of (seed, epoch, index of the example in the data set):
 * its random numbers come from Philox on stream
 * RNG_STREAM_AUGMENT + (epoch << 8) with the counter starting at
 * (index << 32) + (k << 24) for the k-th augmentation of the list. So a
 * resumed run augments every example exactly as an uninterrupted one, two
 * runs of one seed agree, the batch an example lands in does not matter, and
 * adding an augmentation to the list does not change what the ones before it
 * draw. The semantics follow torchvision's RandomCrop (constant zero
 * padding), RandomHorizontalFlip and RandomErasing (a constant value).
 * Nothing here allocates. */
#ifndef QTRAIN_DATA_AUGMENT_H
#define QTRAIN_DATA_AUGMENT_H

#include <stdint.h>

#include "base/error.h"

#define AUGMENT_MAX 8

typedef enum {
    AUGMENT_RANDOM_CROP,  /* pad every border with `padding` zeros, then crop size_h x size_w at a random place */
    AUGMENT_HFLIP,        /* mirror left-right with probability p */
    AUGMENT_RANDOM_ERASE, /* with probability p, set a random rectangle (all channels) to value */
    AUGMENT_COUNT
} AugmentKind;

typedef struct {
    AugmentKind kind;
    int size_h, size_w;   /* random_crop: the crop's size; must equal the image's (H, W) */
    int padding;          /* random_crop: zeros added on each border, >= 0 */
    float p;              /* hflip, random_erase: probability in [0, 1] */
    float scale[2];       /* random_erase: [min, max] of the erased area as a fraction of H * W, 0 < min <= max <= 1 */
    float ratio[2];       /* random_erase: [min, max] of the rectangle's aspect ratio h / w, 0 < min <= max */
    float value;          /* random_erase: the value written */
} AugmentSpec;

/* The config's data.augment: applied in order. */
typedef struct {
    AugmentSpec items[AUGMENT_MAX];
    int n;
} AugmentList;

/* "random_crop", "hflip", "random_erase". */
const char *augment_kind_name(AugmentKind kind);
QtStatus augment_kind_parse(const char *name, AugmentKind *out, QtError *err);
/* A spec of `kind` with torchvision's defaults (hflip p 0.5; random_erase p 0.5, scale [0.02, 0.33], ratio
 * [0.3, 3.3], value 0; random_crop padding 0, size 0 = not set). Every byte is set, so specs compare bytewise. */
void augment_spec_default(AugmentSpec *s, AugmentKind kind);

/* Whether the list fits training examples of shape[0..ndim-1]: they must be
 * images (ndim 3: C, H, W), and a crop must keep their size (size == (H, W);
 * a larger one than the padded image is named as such). QT_ERR_CONFIG with a
 * message naming data.augment[i] and what to change. */
QtStatus augment_check(const AugmentList *list, int ndim, const int *shape, QtError *err);

/* Augments examples x (n, shape[0], shape[1], shape[2]) in place; idx[i] is
 * example i's index in its data set, epoch the epoch of the batch. The list
 * must have passed augment_check for this shape. */
void augment_batch(const AugmentList *list, uint64_t seed, int64_t epoch, const uint32_t *idx, int n,
                   const int *shape, float *x);

#endif
