#include "tensor.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

size_t tensor_numel(const Tensor *t) {
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

char *tensor_shape_str(const Tensor *t, char *buf, size_t size) {
    size_t off = 0;
    off += (size_t)snprintf(buf + off, size - off, "(");
    for (int i = 0; i < t->ndim && off < size; i++)
        off += (size_t)snprintf(buf + off, size - off, i ? ", %d" : "%d", t->shape[i]);
    if (off < size) snprintf(buf + off, size - off, t->ndim == 1 ? ",)" : ")");
    return buf;
}

bool tensor_same_shape(const Tensor *a, const Tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

bool tensor_set_shape(Tensor *t, int ndim, const int *shape) {
    if (ndim < 1 || ndim > TENSOR_MAX_DIMS) return false;
    t->ndim = ndim;
    for (int i = 0; i < TENSOR_MAX_DIMS; i++) t->shape[i] = 1;
    size_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] <= 0) return false;
        t->shape[i] = shape[i];
        numel *= (size_t)shape[i];
        /* Kernels index with int dims and size_t offsets: cap the element
         * count where neither a byte count nor a GEMM dimension overflows. */
        if (numel > TENSOR_MAX_NUMEL) return false;
    }
    return true;
}

/* A float is NaN or infinite exactly when its exponent bits are all ones.
 * Blocks are screened with an OR of the tests, which compilers vectorise
 * (a float sum would not be reassociated), and only a block that holds a
 * bad value is searched element by element. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) /* clang links no resolver for it here */
/* It runs over every gradient of every step: with AVX2 where the CPU has it
 * (chosen once, at load), a few percent of a small MLP's step less. */
__attribute__((target_clones("avx2", "default")))
#endif
size_t floats_first_nonfinite(const float *x, size_t n) {
    enum { BLOCK = 1024 };
    for (size_t b = 0; b < n; b += BLOCK) {
        size_t e = n - b < BLOCK ? n : b + BLOCK;
        uint32_t bad = 0;
        for (size_t i = b; i < e; i++) {
            uint32_t u;
            memcpy(&u, &x[i], sizeof u);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        }
        if (!bad) continue;
        for (size_t i = b; i < e; i++)
            if (!isfinite(x[i])) return i;
    }
    return n;
}
