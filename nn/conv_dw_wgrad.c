/* conv_dw_wgrad.c - the stride-1 depthwise conv's weight-gradient dot products (nn/ops_conv_general.c's backward)
 * at each vector width, chosen by the taps level (conv_taps.h), so QTRAIN_CONV_KERNEL caps them as it caps the
 * taps: the 16 lanes as one AVX-512 vector, or as two of 8 (AVX2, and plain C below it). gcc 12's AVX2 copy of one
 * 16-float accumulator carried across the loop went through the stack in pieces, which made DS-CNN's step twice as
 * long on AVX2 as on AVX-512. Every lane is the same chain at every width (a multiply and an add in q's order,
 * never one FMA): the same bits. */
#include "ops_conv_internal.h"

#include <string.h>

typedef float DwgVec16 __attribute__((vector_size(16 * sizeof(float))));
typedef float DwgVec8 __attribute__((vector_size(8 * sizeof(float))));

_Static_assert(CONV_DW_LANES == 16, "the lanes are one vector of 16, or two of 8");

/* tap (kh, kw): its run s and its 16 sums o */
#define DWG_TAPS(BODY)                                                                                             \
    for (int kh = 0; kh < KH; kh++)                                                                                \
        for (int kw = 0; kw < KW; kw++) {                                                                          \
            const float *restrict s = xp + (size_t)kh * step_h + (size_t)kw * step_w;                              \
            float *o = acc + (size_t)(kh * KW + kw) * CONV_DW_LANES;                                               \
            BODY                                                                                                   \
        }
#define DWG_V16                                                                                                    \
    DwgVec16 a = {0}, u, v;                                                                                        \
    for (size_t q0 = 0; q0 < L; q0 += CONV_DW_LANES) {                                                             \
        memcpy(&u, dy + q0, sizeof u), memcpy(&v, s + q0, sizeof v);                                               \
        a += u * v;                                                                                                \
    }                                                                                                              \
    memcpy(o, &a, sizeof a);
#define DWG_V8                                                                                                     \
    DwgVec8 a0 = {0}, a1 = {0}, u0, u1, v0, v1;                                                                    \
    for (size_t q0 = 0; q0 < L; q0 += CONV_DW_LANES) {                                                             \
        memcpy(&u0, dy + q0, sizeof u0), memcpy(&u1, dy + q0 + 8, sizeof u1);                                     \
        memcpy(&v0, s + q0, sizeof v0), memcpy(&v1, s + q0 + 8, sizeof v1);                                       \
        a0 += u0 * v0, a1 += u1 * v1;                                                                              \
    }                                                                                                              \
    memcpy(o, &a0, sizeof a0), memcpy(o + 8, &a1, sizeof a1);

#define DWG_ARGS                                                                                                   \
    float *restrict acc, const float *restrict dy, const float *restrict xp, size_t L, int KH, int KW,             \
        size_t step_h, size_t step_w

/* fp-contract off in each, as in NN_SIMD_CLONES (clang, which builds the fuzz targets, has no optimize attribute:
 * its plain copy contracts as its flags say, as the clones did) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("avx512f"), optimize("fp-contract=off"))) static void wgrad_v16(DWG_ARGS) { DWG_TAPS(DWG_V16) }
__attribute__((target("avx2"), optimize("fp-contract=off"))) static void wgrad_v8(DWG_ARGS) { DWG_TAPS(DWG_V8) }
#endif
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void wgrad_plain(DWG_ARGS) {
    DWG_TAPS(DWG_V8)
}

void conv_dw_wgrad_lanes(ConvTapsLevel level, float *restrict acc, const float *restrict dy, const float *restrict xp,
                         size_t L, int KH, int KW, size_t step_h, size_t step_w) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    if (level >= CONV_TAPS_AVX512) {
        wgrad_v16(acc, dy, xp, L, KH, KW, step_h, step_w);
        return;
    }
    if (level >= CONV_TAPS_AVX2) {
        wgrad_v8(acc, dy, xp, L, KH, KW, step_h, step_w);
        return;
    }
#else
    (void)level;
#endif
    wgrad_plain(acc, dy, xp, L, KH, KW, step_h, step_w);
}
