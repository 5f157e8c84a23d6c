/* dataset.h - labelled image data sets: IDX files, transforms, split, batches.
 *
 * Images stay uint8, as the files store them (Fashion-MNIST's 60k x 784
 * pixels are 47 MB as bytes, 188 MB as floats); each batch is converted to
 * float32 when it is drawn. The bytes are held in one of two places
 * (DataStorage): in memory, read once at load, or in an uncompressed IDX
 * file (a plain IDX file, or the cache's inflated copy of a gzip'd one)
 * that stays open and is read with pread at every batch, so the process
 * holds only a batch of them. Both give the same floats, bit for bit.
 * Transforms are of three kinds and are applied in config order:
 *   - per pixel (scale to [0,1], normalize, invert): every composition of
 *     these is an affine map x = pixel_scale * p + pixel_shift of the byte p,
 *     folded into two floats and applied at batch time;
 *   - a fixed permutation of the pixels (transpose), applied to the bytes
 *     once at load (in memory) or to each example as it is read (file);
 *   - per example (classes, limit): drop/relabel examples once at load (a
 *     file-backed set keeps the list of file rows it uses).
 * Per-pixel maps commute with the other two kinds, so folding them keeps
 * the config's order exact. */
#ifndef QTRAIN_DATA_DATASET_H
#define QTRAIN_DATA_DATASET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

#define IDX_MAX_DIMS 4
#define DATASET_MAX_CLASSES 256
#define DATASET_MAX_CHANNELS 64 /* normalize's per-channel mean and std lists */

/* How a data set's examples are stored, each converted to float32 per batch. */
typedef enum {
    DATA_ELEM_U8,  /* 1 byte; loaded with the map x = p / 255 (as IDX images) */
    DATA_ELEM_I8,  /* 1 byte, signed; x = p */
    DATA_ELEM_F16, /* IEEE half, 2 bytes; x = p */
    DATA_ELEM_F32, /* 4 bytes; x = p */
    DATA_ELEM_COUNT
} DataElem;

/* Bytes per element; "uint8", "int8", "float16", "float32". */
size_t data_elem_bytes(DataElem e);
const char *data_elem_name(DataElem e);
/* The float of IEEE half h, exactly (subnormals, infinities and NaN too). */
float data_half_to_float(uint16_t h);

/* The contents of one IDX file (unsigned-byte element type only, 0x08). */
typedef struct {
    int ndim;                    /* 1 (labels) .. IDX_MAX_DIMS */
    int dims[IDX_MAX_DIMS];      /* dims[0] = item count */
    uint8_t *data;               /* [dims[0] * ... * dims[ndim-1]] */
    size_t n_bytes;
} IdxArray;

/* Reads a gzip'd or plain IDX file (zlib detects which). Validates the
 * magic (0x00 0x00 0x08 ndim), that every dimension is >= 1 and the total
 * fits in 2^31 elements, and that the payload is exactly that long (a
 * truncated or over-long file is QT_ERR_FORMAT). A missing file is
 * QT_ERR_IO. Messages name the file and say what to do. */
QtStatus idx_read(const char *path, IdxArray *out, QtError *err);
void idx_free(IdxArray *a);

/* A cache of decompressed IDX files (the config's data.cache_dir).
 * Inflating Fashion-MNIST's 30 MB of gzip takes about 0.2 s, every start;
 * reading the inflated copy takes a few ms. The first load of a gzip'd file
 * writes <dir>/<name without .gz>-<hash of its absolute path>.idx (to a
 * temporary name, fsync'd, then renamed, so a reader never sees half a
 * file; idx_open_cached writes it as the gzip is inflated, without holding
 * the data); later loads read that copy, or read from it in place. The copy's header records the source's
 * absolute path, size and modification time, the length of the IDX data and
 * its CRC-32: a source that changed is inflated and cached again, and a copy
 * that fails any of the checks idx_read makes (magic, dimensions, exact
 * payload length) or its CRC is reported, never used, and rebuilt. Plain
 * (not gzip'd) IDX files are read directly and not cached.
 *
 * Nothing about the cache is an error: when the directory cannot be created
 * or written, the data still loads from the gzip file and `warning` says
 * why, once (later loads through the same IdxCache do not try to write
 * again). The library never prints it; the caller decides. */
#define IDX_CACHE_PATH_MAX 4096
typedef struct {
    char dir[IDX_CACHE_PATH_MAX];   /* the cache directory; "" = no caching */
    bool write_failed;              /* a write failed: later loads do not try again */
    int hits;                       /* files read from the cache */
    int writes;                     /* files inflated and written into the cache (first loads, changed sources,
                                       damaged copies replaced) */
    int n_warnings;                 /* problems met; only the first is in `warning` */
    char warning[QT_ERROR_MSG_MAX]; /* "" or the first problem, one sentence naming the file or directory */
} IdxCache;

/* Sets up a cache from the data.cache_dir setting: NULL or "none" (any case)
 * turns caching off; "" means the default, $XDG_CACHE_HOME/qtrain (when
 * XDG_CACHE_HOME is an absolute path), else $HOME/.cache/qtrain; anything
 * else is the directory (created on first write, mode 0700). Without
 * either variable, or with a path too long, caching is off and `warning`
 * says so. Never fails. */
void idx_cache_init(IdxCache *cache, const char *setting);

/* idx_read through the cache (NULL, or an IdxCache with dir "": idx_read
 * itself). Errors are those of idx_read on the source file; cache problems
 * only add to cache->warning. */
QtStatus idx_read_cached(const char *path, IdxCache *cache, IdxArray *out, QtError *err);

/* Where a data set's image bytes are held (the config's data.storage). */
typedef enum {
    DATA_STORAGE_AUTO,   /* file when an uncompressed copy can be had (a plain IDX file, or the cache's copy of a
                            gzip'd one), else memory */
    DATA_STORAGE_MEMORY, /* read into memory at load */
    DATA_STORAGE_FILE,   /* read from the uncompressed file at every batch; an error if there is none */
    DATA_STORAGE_COUNT
} DataStorage;

/* "auto", "memory", "file". */
const char *data_storage_name(DataStorage storage);
QtStatus data_storage_parse(const char *name, DataStorage *out, QtError *err);

/* An uncompressed IDX file held open, to be read in place. */
#define IDX_FILE_PATH_MAX (IDX_CACHE_PATH_MAX + 320)
typedef struct {
    int fd;                      /* -1: not open */
    char path[IDX_FILE_PATH_MAX]; /* the file read: the source itself or its cached copy */
    int ndim;
    int dims[IDX_MAX_DIMS];      /* dims[0] = item count */
    uint64_t offset;             /* file offset of the first element */
    size_t n_bytes;              /* elements (bytes) from offset on */
} IdxFile;

/* idx_read_cached, but without reading the elements into memory when they
 * are on disk uncompressed: a plain IDX file is opened itself, a gzip'd
 * one's cached copy is opened (inflated and written first when the cache
 * has none, or a stale or damaged one). Either file is held to idx_read's
 * rules (magic, dimensions, exact length) and a cached copy to its CRC,
 * which is checked here by reading it once in chunks. On success exactly
 * one of the outputs is filled: *file (file->fd >= 0), or, when no
 * uncompressed copy can be had (a gzip'd file with caching off or failing,
 * a source that is not a regular file), *mem as idx_read_cached fills it;
 * with require_file that case is a QT_ERR_CONFIG error instead, saying
 * why and what to do. Errors are otherwise those of idx_read_cached. */
QtStatus idx_open_cached(const char *path, IdxCache *cache, bool require_file, IdxFile *file, IdxArray *mem,
                         QtError *err);
void idx_file_close(IdxFile *f);

/* A file the images of a data set are read from (data/image_file.h). */
typedef struct DatasetFile DatasetFile;

typedef struct {
    int n;                       /* examples */
    int ndim, shape[3];          /* per example: (C, H, W), IDX images (1, H, W); or (F,) feature vectors */
    int feat;                    /* elements per example = product of shape */
    DataElem elem;               /* how the elements are stored (DATA_ELEM_U8 = 0 for IDX) */
    uint8_t *pixels;             /* [n][feat * data_elem_bytes(elem)], owned; NULL when `file` holds them */
    DatasetFile *file;           /* NULL: the images are in pixels; else they are read from this file at every
                                    batch (owned) */
    int32_t *labels;             /* [n], in 0..n_classes-1, owned; NULL when the targets are values */
    int n_classes;               /* 1 + largest label the data set can have (10 for Fashion-MNIST); 0 when the
                                    targets are values */
    float *targets;              /* [n][n_targets] continuous targets (regression), owned; NULL for class labels */
    int n_targets;               /* values per example's target; 0 for class labels */
    float pixel_scale, pixel_shift; /* x = pixel_scale * p + pixel_shift (p the stored value) */
    float *chan_scale, *chan_shift; /* [shape[0]]: per channel (feature, for (F,) vectors) instead, once a
                                       per-channel normalize made them differ; NULL: pixel_scale/shift for all */
    int n_stats;                 /* > 0: the file gives the mean and std of its stored values (one, or one per
                                    channel), which a normalize without values uses instead of measuring */
    double stats_mean[DATASET_MAX_CHANNELS], stats_std[DATASET_MAX_CHANNELS];
} Dataset;

typedef enum {
    TRANSFORM_NORMALIZE, /* x = (x - mean) / std */
    TRANSFORM_TRANSPOSE, /* x[c][i][j] -> x[c][j][i] (H == W) */
    TRANSFORM_INVERT,    /* x = 1 - x */
    TRANSFORM_CLASSES,   /* keep only these labels, relabelled 0..k-1 in listed order */
    TRANSFORM_LIMIT,     /* keep the first `limit` examples */
    TRANSFORM_COUNT
} TransformKind;

typedef struct {
    TransformKind kind;
    bool stats_given;            /* normalize: mean/std given; if not, they are measured on
                                    the training set as it is at that point of the list */
    float mean, std;             /* normalize, one for every value */
    int n_stats;                 /* normalize: > 0: means/stds per channel (axis 0 of an example) instead */
    float means[DATASET_MAX_CHANNELS], stds[DATASET_MAX_CHANNELS];
    bool per_channel;            /* normalize without stats: measure them per channel (else over all values) */
    int classes[DATASET_MAX_CLASSES]; /* classes: the labels to keep, in their new order */
    int n_classes;
    int limit;                   /* limit: >= 1 */
} Transform;

/* "normalize", "transpose", "invert", "classes", "limit". */
const char *transform_kind_name(TransformKind kind);
QtStatus transform_kind_parse(const char *name, TransformKind *out, QtError *err);

/* Loads an images file (N, H, W) and a labels file (N,) into a data set of
 * shape (1, H, W), pixel_scale 1/255, shift 0 (the "scale to [0,1]" step
 * that always comes first). Counts must agree; labels must be below
 * n_classes (the error names the first bad index and value). */
QtStatus dataset_load_idx(Dataset *d, const char *images_path, const char *labels_path, int n_classes,
                          QtError *err);
/* The same through a decompressed cache (may be NULL: none), with the
 * images held as `storage` says (the labels are always in memory). */
QtStatus dataset_load_idx_stored(Dataset *d, const char *images_path, const char *labels_path, int n_classes,
                                 IdxCache *cache, DataStorage storage, QtError *err);
/* <dir>/train-images-idx3-ubyte.gz + train-labels-idx1-ubyte.gz and
 * t10k-*.gz (falls back to the same names without .gz). test may be NULL. */
QtStatus dataset_load_fashion_mnist(Dataset *train, Dataset *test, const char *dir, QtError *err);
/* The same through a decompressed cache (may be NULL: none). */
QtStatus dataset_load_fashion_mnist_cached(Dataset *train, Dataset *test, const char *dir, IdxCache *cache,
                                           QtError *err);
/* The same with the images held as `storage` says. */
QtStatus dataset_load_fashion_mnist_stored(Dataset *train, Dataset *test, const char *dir, IdxCache *cache,
                                           DataStorage storage, QtError *err);
/* An HDF5 data file (docs/DATA.md's layout): /train and /test, /val when
 * the file has it (val->n = 0 otherwise), each x (N, C, H, W), (N, H, W) or
 * (N, F) of uint8, int8, float16 or float32 and y of integer class labels
 * (N,) or float targets (N,) or (N, K). Classes: the root attribute
 * `classes`' length, else 1 + the largest label; root attributes mean/std
 * become train->stats_*. uint8 examples get the map p / 255, the others
 * none. The examples stay in the file, read by hyperslab per batch, when
 * storage is file, or auto and they take more than max_memory_bytes.
 * Every error names the file and dataset and says what to do. */
QtStatus dataset_load_hdf5(Dataset *train, Dataset *val, Dataset *test, const char *path, DataStorage storage,
                           size_t max_memory_bytes, QtError *err);
/* data.dataset: npy: four .npy files (data/npy.h's reader): x (N, C, H, W),
 * (N, H, W) or (N, F) of uint8, int8, float16 or float32; y (N,) integer
 * labels or (N,) / (N, K) float targets (float64 rounded to float32). The
 * classes are 1 + the largest label of either split; the examples are read
 * per batch under the same rule as dataset_load_hdf5. */
QtStatus dataset_load_npy(Dataset *train, Dataset *test, const char *train_x, const char *train_y,
                          const char *test_x, const char *test_y, DataStorage storage, size_t max_memory_bytes,
                          QtError *err);
/* data.dataset: idx: an images and a labels IDX file for each of train and
 * test (any IDX set: MNIST, KMNIST, EMNIST, your own); the classes are 1 +
 * the largest label of either. */
QtStatus dataset_load_idx_pairs(Dataset *train, Dataset *test, const char *train_x, const char *train_y,
                                const char *test_x, const char *test_y, IdxCache *cache, DataStorage storage,
                                QtError *err);
void dataset_free(Dataset *d);
/* The file the images are read from, or NULL when they are in memory. */
const char *dataset_image_file(const Dataset *d);

/* Applies transforms[0..n-1] in order to train and (identically) test,
 * which may be NULL. A normalize without stats measures mean/std of train's
 * current pixel values (in double) and uses them for both (a file-backed
 * training set is read through once for it). Errors: classes naming a label
 * out of range or twice, limit < 1, transpose of a non-square image,
 * std <= 0, a set left empty, a read error of a file-backed set. On an
 * error both sets are left as they were. */
QtStatus dataset_apply_transforms(Dataset *train, Dataset *test, const Transform *transforms, int n,
                                  QtError *err);
/* The same with a validation set loaded with them (an HDF5 file's /val; may
 * be NULL), transformed as test is. */
QtStatus dataset_apply_transforms3(Dataset *train, Dataset *val, Dataset *test, const Transform *transforms, int n,
                                   QtError *err);

/* Moves the last round(fraction * n) examples of `train` into `val` (a new
 * data set with the same shape and pixel map; for a file-backed `train`, one
 * reading the same file through its own descriptor and buffer). fraction in
 * [0, 1); 0 leaves val empty (n = 0). Fashion-MNIST's training file is already in random
 * order, so the tail is a fair sample and the split does not depend on the
 * seed. */
QtStatus dataset_split_tail(Dataset *train, Dataset *val, double fraction, QtError *err);

/* Converts examples idx[0..n-1] to floats: x (n, feat), y [n] (may be
 * NULL). Never allocates. A file-backed set reads the examples here, runs of
 * consecutive file rows in one pread each; a file that was changed or
 * shrank since it was opened is QT_ERR_IO naming it and saying what to do.
 * A data set's read buffer is its own: do not fill from one set in two
 * threads at once. */
QtStatus dataset_fill_batch(const Dataset *d, const uint32_t *idx, int n, float *x, int32_t *y, QtError *err);
/* The same for the contiguous examples start..start+n-1. */
QtStatus dataset_fill_range(const Dataset *d, int start, int n, float *x, int32_t *y, QtError *err);
/* The continuous targets of examples idx[0..n-1]: t (n, n_targets). A data
 * set without them (class labels) leaves t alone and returns false. */
bool dataset_fill_targets(const Dataset *d, const uint32_t *idx, int n, float *t);
/* The same for the contiguous examples start..start+n-1. */
bool dataset_fill_targets_range(const Dataset *d, int start, int n, float *t);

/* Mini-batches over a data set for training. The order of epoch e is a
 * pure function of (seed, e): identity shuffled by Philox on stream
 * RNG_STREAM_SHUFFLE + (e << 8). So the whole iteration state is
 * (epoch, cursor): a checkpoint stores those two numbers and a resumed run
 * calls batcher_seek() to continue with exactly the same batches. */
typedef struct {
    const Dataset *d;            /* not owned */
    int batch_size;
    bool shuffle, drop_last;
    uint64_t seed;
    uint32_t *order;             /* [d->n]: this epoch's order */
    int64_t epoch;               /* 0-based epoch of the last batch drawn (of the next one,
                                    unless this epoch is used up: then the next call moves on) */
    int cursor;                  /* position in order of the next batch's first example (n = used up) */
} Batcher;

QtStatus batcher_init(Batcher *b, const Dataset *d, int batch_size, bool shuffle, bool drop_last, uint64_t seed,
                      QtError *err);
void batcher_free(Batcher *b);
/* Batches per epoch: n / bs with drop_last, else ceil(n / bs). */
int64_t batcher_steps_per_epoch(const Batcher *b);
/* Positions the batcher at (epoch, cursor), recomputing that epoch's order.
 * QT_ERR_VALUE if the cursor is outside 0..n. */
QtStatus batcher_seek(Batcher *b, int64_t epoch, int cursor, QtError *err);
/* Fills the next batch (x (bs, feat), y [bs]); *n gets its size (the last
 * batch of an epoch may be short unless drop_last). When the epoch has no
 * batch left it first moves to the next epoch (epoch + 1, cursor 0, new
 * order). *epoch_of_batch (may be NULL) gets the epoch the batch belongs
 * to. Never allocates. Errors are dataset_fill_batch's; the cursor then
 * stays on the batch that failed. */
QtStatus batcher_next(Batcher *b, float *x, int32_t *y, int *n, int64_t *epoch_of_batch, QtError *err);
/* Data-parallel training: the global batch batcher_next would give, of m
 * examples, split in `parts` contiguous parts in order (the first m % parts
 * one example longer); x, y get only part `part`, [*lo, *lo + *n) of the
 * batch (n_batch: m). Only that part's examples are read (file-backed
 * storage reads no other row); the position moves on by the whole batch. */
QtStatus batcher_next_part(Batcher *b, int part, int parts, float *x, int32_t *y, int *n_batch, int *lo, int *n,
                           QtError *err);
/* Part `part` of `parts` of a batch of m: [*lo, *lo + *n). */
void batcher_part(int m, int part, int parts, int *lo, int *n);
/* The batch batcher_next just gave (n its size): *idx gets its examples'
 * indices in the data set (idx[0..n-1], valid until the next call) and
 * *epoch its epoch, what a per-example augmentation depends on. */
void batcher_last_batch(const Batcher *b, int n, const uint32_t **idx, int64_t *epoch);

/* ---- dropping classes --------------------------------------------------------------------------------------- */

/* Drops the examples whose label is one of classes[0..n_drop-1], keeping
 * the others in their order with their labels (no relabelling; n_classes
 * stays). *dropped (may be NULL) gets how many went. A set without class
 * labels is QT_ERR_CONFIG (unless n_drop is 0). The memory of the dropped
 * examples is kept until dataset_free. */
QtStatus dataset_drop_classes(Dataset *d, const int *classes, int n_drop, int *dropped, QtError *err);

#endif
