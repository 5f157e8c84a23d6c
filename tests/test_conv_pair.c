/* test_conv_pair.c - test_conv_pair.h. */
#include "test_conv_pair.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

bool test_conv_pair_run(int N, int C, int H, int W, int OC, int KH, int KW, int pad, ConvEpilogue epi,
                        ConvPairOut *out) {
    TestEnv e;
    test_env_init(&e, 77);
    const size_t nx = (size_t)N * C * H * W, nw = (size_t)OC * C * KH * KW;
    float *x = test_random_uniform(nx, 5, -1.0f, 1.0f), *w = test_random_uniform(2 * nw, 6, -1.0f, 1.0f);
    float *b = test_random_uniform((size_t)OC, 7, -0.5f, 0.5f);
    Var *vx = test_var(&e, x, 4, (const int[]){N, C, H, W}, true);
    Var *w1 = test_var(&e, w, 4, (const int[]){OC, C, KH, KW}, true);
    Var *w2 = test_var(&e, w + nw, 4, (const int[]){OC, C, KH, KW}, true);
    Var *vb = test_var(&e, b, 1, &OC, true);
    Var *y1 = nn_conv2d_fused(&e.tape, vx, w1, vb, 1, pad, epi);
    Var *y2 = y1 ? nn_conv2d_fused(&e.tape, vx, w2, NULL, 1, pad, epi) : NULL;
    Var *y = y2 ? nn_add(&e.tape, y1, y2) : NULL;
    bool ok = y != NULL;
    if (ok) {
        const size_t ny = var_numel(y);
        float *dy = test_random_uniform(ny, 8, -1.0f, 1.0f);
        ok = tape_backward_from(&e.tape, y, dy) == QT_OK && vx->grad && w1->grad && w2->grad && vb->grad;
        free(dy);
        if (ok) {
            *out = (ConvPairOut){.ny = ny, .nx = nx, .nw = 2 * nw};
            out->y = malloc(ny * sizeof(float)), out->dx = malloc(nx * sizeof(float));
            out->dw = malloc(2 * nw * sizeof(float)), out->db = malloc((size_t)OC * sizeof(float));
            memcpy(out->y, y->value.data, ny * sizeof(float));
            memcpy(out->dx, vx->grad, nx * sizeof(float));
            memcpy(out->dw, w1->grad, nw * sizeof(float));
            memcpy(out->dw + nw, w2->grad, nw * sizeof(float));
            memcpy(out->db, vb->grad, (size_t)OC * sizeof(float));
        }
    }
    if (!ok) fprintf(stderr, "\n  test_conv_pair_run: %s", e.tape.err.msg);
    free(x), free(w), free(b);
    test_env_free(&e);
    return ok;
}

void test_conv_pair_free(ConvPairOut *o) { free(o->y), free(o->dx), free(o->dw), free(o->db); }
