/* test_lora.h - a gradcheck function shared by the LoRA and QLoRA suites. */
#ifndef QTRAIN_TESTS_TEST_LORA_H
#define QTRAIN_TESTS_TEST_LORA_H

#include "lora/lora.h"
#include "nn/model.h"

typedef struct {
    Model *model;
    LoraAdapter *a;
} LoraGradCtx;

/* GradcheckFn over inputs x, A, B of ctx (a LoraGradCtx): the adapter's
 * own A and B take the inputs' values, and the inputs' grads point at A's
 * and B's persistent grad buffers, so gradcheck reads what the backward
 * accumulated into the parameters. Returns the model's output. */
Var *lora_test_model_fn(Tape *t, Var **in, void *ctx);

#endif
