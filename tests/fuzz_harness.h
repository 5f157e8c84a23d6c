/* fuzz_harness.h - the entry functions of the fuzz targets (fuzz/fuzz_<target>.c) and
 * of the fuzz_regress suite, which replays the inputs the fuzzers found
 * through exactly the same code.
 *
 * Each *_one function feeds one input to qtrain's loaders of untrusted
 * input and checks what a loader must guarantee beyond not crashing: a
 * failure comes with a message, a success gives a usable result, and a
 * refused file leaves the run untouched. It returns 0 when all held, else 1
 * with the broken rule in why[why_cap] (the fuzz driver then aborts, so the
 * input is kept as a crash). Sanitizer reports and crashes happen inside.
 *
 * Inputs:
 *   config      a YAML config, loaded from a file as `qtrain --config` does;
 *               its comment lines "#@set key=value" are also --set overrides.
 *   idx         6 header bytes, then IDX (or gzip) bytes; see fuzz/README.md.
 *   npy         a whole .npy file.
 *   safetensors a whole .safetensors file.
 *   h5data      byte 0 picks one of four small HDF5 data files written at
 *               init, the rest is an edit script applied to it (fuzz_h5edit.h).
 *   checkpoint  an edit script applied to a small valid checkpoint written
 *               at init, or (starting with the HDF5 signature) a raw file;
 *               see fuzz/README.md. */
#ifndef QTRAIN_TESTS_FUZZ_HARNESS_H
#define QTRAIN_TESTS_FUZZ_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

#define FUZZ_WHY_MAX 1200

int fuzz_config_one(const uint8_t *data, size_t size, char *why, size_t why_cap);

int fuzz_idx_one(const uint8_t *data, size_t size, char *why, size_t why_cap);

int fuzz_npy_one(const uint8_t *data, size_t size, char *why, size_t why_cap);

int fuzz_safetensors_one(const uint8_t *data, size_t size, char *why, size_t why_cap);

/* Writes the base data files (once; fuzz_h5data_one calls it too). */
int fuzz_h5data_init(char *why, size_t why_cap);
int fuzz_h5data_one(const uint8_t *data, size_t size, char *why, size_t why_cap);
void fuzz_h5data_cleanup(void);

/* Builds the base checkpoints (a few tiny runs of tests/configs/, read
 * relative to the repository root, the working directory of `make fuzz` and
 * `make test`). 0 on success, else 1 with the reason in why. */
int fuzz_checkpoint_init(char *why, size_t why_cap);
int fuzz_checkpoint_one(const uint8_t *data, size_t size, char *why, size_t why_cap);
void fuzz_checkpoint_cleanup(void);

/* ---- shared by the entry functions ---------------------------------------------- */

/* A private scratch directory in $TMPDIR (else on tmpfs when /dev/shm
 * exists, else in /tmp), made on first use and removed with everything in
 * it at exit (a crash skips that: fuzz/run.sh runs each target in a
 * $TMPDIR of its own and removes it); NULL if it cannot be made. */
const char *fuzz_scratch_dir(void);
/* Removes the scratch directory now (a later fuzz_scratch_dir makes a new one). */
void fuzz_scratch_remove(void);
/* <scratch>/<name> into out[cap]; writes data[size] there. 0 on success. */
int fuzz_write_file(const char *name, const void *data, size_t size, char *out, size_t cap);
/* Removes every file in directory `dir` (not recursive). */
void fuzz_clear_dir(const char *dir);

/* The rule every loader keeps: a failure has a status and a message, and a
 * success leaves no error behind. 0 if it held, else 1 with why filled in,
 * naming `what`. With QTRAIN_FUZZ_VERBOSE set in the environment, every
 * loader's outcome is printed to stderr (to see what an input reaches). */
int fuzz_check_status(const char *what, QtStatus st, const QtError *err, char *why, size_t why_cap);

#endif
