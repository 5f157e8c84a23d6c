/* test_train_memory.c - what a training step keeps of its activations.
 *
 * The tape's free list (merging neighbours, splitting a larger buffer,
 * handing the arena's top back), values dropped in the forward and made
 * again for the backward, and the model's plan (model_graph_train_memory):
 * a ResNet-style, a DS-CNN-style and a batch-norm MLP step give the same
 * bits as a step that keeps every output (Model.keep_outputs), on 1 and 2
 * threads, in less arena memory. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "nn/ops.h"
#include "test_util.h"

/* ---- the free list ---------------------------------------------------------- */

static size_t rounded(size_t floats) { return (floats * sizeof(float) + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN; }

static void test_free_list_merges_splits_gives_back(void) {
    TestEnv e;
    test_env_init(&e, 1);
    Tape *t = &e.tape;
    enum { F = 2000 }; /* above TAPE_SMALL_BYTES: from the step arena proper */
    Var *a = tape_new_var(t, 1, (int[]){F}), *b = tape_new_var(t, 1, (int[]){F}), *c = tape_new_var(t, 1, (int[]){F});
    CU_ASSERT_FATAL(a && b && c);
    float *pa = a->value.data, *pc = c->value.data;
    CU_ASSERT((char *)b->value.data == (char *)pa + rounded(F)); /* the Vars live apart: the buffers touch */
    const size_t used = e.arena.used;
    tape_release(t, b);
    tape_release(t, a); /* a and b merge */
    Var *d = tape_new_var(t, 1, (int[]){2 * F});
    CU_ASSERT_FATAL(d != NULL);
    CU_ASSERT(d->value.data == pa);
    CU_ASSERT_EQUAL(e.arena.used, used);
    tape_release(t, d);
    Var *e1 = tape_new_var(t, 1, (int[]){F / 2}), *e2 = tape_new_var(t, 1, (int[]){F / 2});
    CU_ASSERT_FATAL(e1 && e2);
    CU_ASSERT(e1->value.data == pa); /* the front of the block; the rest stays listed */
    CU_ASSERT((char *)e2->value.data == (char *)pa + rounded(F / 2));
    CU_ASSERT_EQUAL(e.arena.used, used);
    /* c, the arena's top, merges with the free rest of a-b before it, and both go back to the arena */
    tape_release(t, c);
    CU_ASSERT_EQUAL(e.arena.used, used - rounded(F) - (2 * rounded(F) - 2 * rounded(F / 2)));
    Var *f = tape_new_var(t, 1, (int[]){F});
    CU_ASSERT_FATAL(f != NULL);
    CU_ASSERT((char *)f->value.data == (char *)pa + 2 * rounded(F / 2));
    CU_ASSERT((char *)f->value.data < (char *)pc);
    tape_release(t, e2);
    tape_release(t, e2); /* twice: listed once */
    Var *g = tape_new_var(t, 1, (int[]){F / 2}), *h = tape_new_var(t, 1, (int[]){F / 2});
    CU_ASSERT_FATAL(g && h);
    CU_ASSERT(g->value.data != h->value.data);
    /* the top handed back twice: the second time it is the arena's again, and is not listed a second time */
    Var *top = tape_new_var(t, 1, (int[]){F});
    CU_ASSERT_FATAL(top != NULL);
    float *ptop = top->value.data;
    tape_release(t, top);
    tape_release(t, top);
    Var *u = tape_new_var(t, 1, (int[]){F}), *w = tape_new_var(t, 1, (int[]){F});
    CU_ASSERT_FATAL(u && w);
    CU_ASSERT(u->value.data == ptop && w->value.data != ptop);
    test_env_free(&e);
}

/* Held releases (tape_hold_releases, nested): a buffer released meanwhile is not handed out again, so work deferred
 * on it reads what it held; after the last tape_release_held it is, once. */
static void test_held_releases(void) {
    TestEnv e;
    test_env_init(&e, 1);
    Tape *t = &e.tape;
    enum { F = 2000 };
    Var *a = tape_new_var(t, 1, (int[]){F}), *b = tape_new_var(t, 1, (int[]){F});
    CU_ASSERT_FATAL(a && b);
    float *pa = a->value.data;
    tape_hold_releases(t);
    tape_hold_releases(t);
    tape_release(t, a);
    tape_release(t, a);
    Var *c = tape_new_var(t, 1, (int[]){F});
    CU_ASSERT_FATAL(c != NULL);
    CU_ASSERT(c->value.data != pa);
    tape_release_held(t); /* one hold left */
    Var *d = tape_new_var(t, 1, (int[]){F});
    CU_ASSERT_FATAL(d != NULL);
    CU_ASSERT(d->value.data != pa);
    tape_release_held(t);
    Var *f = tape_new_var(t, 1, (int[]){F}), *g = tape_new_var(t, 1, (int[]){F});
    CU_ASSERT_FATAL(f && g);
    CU_ASSERT(f->value.data == pa && g->value.data != pa);
    tape_release_held(t); /* unbalanced: nothing */
    CU_ASSERT_EQUAL(t->hold, 0);
    test_env_free(&e);
}

/* ---- remade values ---------------------------------------------------------- */

enum { RV = 64 };
static int remakes;
static float seen_by_reader, seen_by_value_free;

static void remake_ramp(Tape *t, float *out, const void *ctx) {
    (void)t, (void)ctx;
    remakes++;
    for (int i = 0; i < RV; i++) out[i] = (float)i;
}

/* Reads its first input's values: their sum, and passes the gradient on to the second input. */
static void reader_backward(Tape *t, const TapeNode *node) {
    float s = 0.0f;
    for (int i = 0; i < RV; i++) s += node->in[0]->value.data[i];
    seen_by_reader = s;
    float *g = tape_grad(t, node->in[1]);
    if (g) g[0] += node->out->grad[0];
}

static void value_free_backward(Tape *t, const TapeNode *node) {
    seen_by_value_free = node->in[1]->value.data ? 1.0f : 0.0f; /* the dropped value: not made for this node */
    float *g = tape_grad(t, node->in[0]);
    if (g) g[0] += node->out->grad[0];
}

static void test_dropped_value_is_remade_for_its_readers(void) {
    TestEnv e;
    test_env_init(&e, 1);
    Tape *t = &e.tape;
    float one[1] = {1.0f};
    Var *p = test_var(&e, one, 1, (int[]){1}, true);
    Var *v = tape_new_var(t, 1, (int[]){RV});
    Var *o1 = tape_new_var(t, 1, (int[]){1}), *o2 = tape_new_var(t, 1, (int[]){1});
    CU_ASSERT_FATAL(p && v && o1 && o2);
    remake_ramp(t, v->value.data, NULL);
    remakes = 0;
    CU_ASSERT_FATAL(tape_record(t, "reader", reader_backward, o1, (Var *[]){v, p}, 2, NULL));
    CU_ASSERT_FATAL(tape_record_value_free(t, "value_free", value_free_backward, o2, (Var *[]){o1, v}, 2, NULL));
    CU_ASSERT_FATAL(tape_remake_set(t, v, NULL, remake_ramp, NULL));
    CU_ASSERT(tape_release_after(t, o1, v));
    CU_ASSERT(!tape_release_after(t, p, v)); /* p is no node's output */
    tape_drop(t, v);
    CU_ASSERT(v->value.data == NULL);
    seen_by_reader = seen_by_value_free = -1.0f;
    CU_ASSERT_FATAL(tape_backward_from(t, o2, one) == QT_OK);
    CU_ASSERT_EQUAL(seen_by_value_free, 0.0f);
    CU_ASSERT_EQUAL(remakes, 1);
    CU_ASSERT_EQUAL(seen_by_reader, (float)(RV * (RV - 1) / 2));
    CU_ASSERT(v->value.data == NULL); /* handed back after the reader's node */
    CU_ASSERT_EQUAL(p->grad[0], 1.0f);
    test_env_free(&e);
}

/* ---- whole models ----------------------------------------------------------- */

static LayerSpec spec(LayerType type, const char *name, int out, int kernel, int stride, const char *in0,
                      const char *in1) {
    LayerSpec s = {.type = type, .eps = 1e-5f, .momentum = 0.1f, .out_channels = out, .units = out,
                   .kernel = kernel, .stride = stride ? stride : 1, .padding = kernel / 2,
                   .no_bias = type == LAYER_CONV2D};
    if (name) snprintf(s.name, sizeof s.name, "%s", name); /* else automatic */
    if (in0) snprintf(s.inputs[s.n_inputs++], MODULE_NAME_MAX, "%s", in0);
    if (in1) snprintf(s.inputs[s.n_inputs++], MODULE_NAME_MAX, "%s", in1);
    return s;
}

enum { MODEL_RESNET, MODEL_DSCNN, MODEL_MLP, MODEL_END_RELU, MODEL_END_FLATTEN, MODEL_KINDS };

/* The model's layers into l; returns their count and the input shape in in[]. */
static int build(int kind, LayerSpec *l, int *in_ndim, int *in) {
    int n = 0;
    if (kind == MODEL_RESNET) { /* a 1-channel stem (remade), a residual block, a strided block with a 1x1 shortcut */
        *in_ndim = 3, in[0] = 1, in[1] = in[2] = 10;
        l[n++] = spec(LAYER_CONV2D, "stem_c", 6, 3, 1, NULL, NULL);
        l[n++] = spec(LAYER_BATCHNORM2D, "stem_b", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_RELU, "stem", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_CONV2D, "a_c1", 6, 3, 1, NULL, NULL);
        l[n++] = spec(LAYER_BATCHNORM2D, "a_b1", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_RELU, "a_r1", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_CONV2D, "a_c2", 6, 3, 1, NULL, NULL);
        l[n++] = spec(LAYER_BATCHNORM2D, "a_b2", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_ADD, "a_add", 0, 0, 0, "a_b2", "stem");
        l[n++] = spec(LAYER_RELU, "a_out", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_CONV2D, "b_c1", 8, 3, 2, NULL, NULL);
        l[n++] = spec(LAYER_BATCHNORM2D, "b_b1", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_RELU, "b_r1", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_CONV2D, "b_c2", 8, 3, 1, NULL, NULL);
        l[n++] = spec(LAYER_BATCHNORM2D, "b_b2", 0, 0, 0, NULL, NULL);
        l[n] = spec(LAYER_CONV2D, "b_sc", 8, 1, 2, "a_out", NULL);
        l[n++].no_bias = false;
        l[n++] = spec(LAYER_ADD, "b_add", 0, 0, 0, "b_b2", "b_sc");
        l[n++] = spec(LAYER_RELU, "b_out", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_GLOBALAVGPOOL, "gap", 0, 0, 0, NULL, NULL);
    } else if (kind == MODEL_DSCNN) { /* a strided stem, two depthwise-separable blocks */
        *in_ndim = 3, in[0] = 1, in[1] = in[2] = 12;
        l[n++] = spec(LAYER_CONV2D, "stem_c", 8, 3, 2, NULL, NULL);
        l[n++] = spec(LAYER_BATCHNORM2D, "stem_b", 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_RELU, "stem", 0, 0, 0, NULL, NULL);
        for (int b = 0; b < 2; b++) {
            char nm[4][16];
            for (int k = 0; k < 4; k++) snprintf(nm[k], sizeof nm[k], "%c%d", "dDpP"[k], b);
            l[n] = spec(LAYER_CONV2D, nm[0], 8, 3, 1, NULL, NULL);
            l[n++].groups = 8;
            l[n++] = spec(LAYER_BATCHNORM2D, nm[1], 0, 0, 0, NULL, NULL);
            l[n++] = spec(LAYER_RELU, NULL, 0, 0, 0, NULL, NULL);
            l[n++] = spec(LAYER_CONV2D, nm[2], 8, 1, 1, NULL, NULL);
            l[n++] = spec(LAYER_BATCHNORM2D, nm[3], 0, 0, 0, NULL, NULL);
            l[n++] = spec(LAYER_RELU, NULL, 0, 0, 0, NULL, NULL);
        }
        l[n++] = spec(LAYER_GLOBALAVGPOOL, "gap", 0, 0, 0, NULL, NULL);
    } else if (kind == MODEL_END_RELU) { /* the model's output is a relu in place over a batch norm */
        *in_ndim = 1, in[0] = 20;
        l[n++] = spec(LAYER_DENSE, NULL, 5, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_BATCHNORM1D, NULL, 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_RELU, NULL, 0, 0, 0, NULL, NULL);
        return n;
    } else if (kind == MODEL_END_FLATTEN) { /* ... or a view of one */
        *in_ndim = 3, in[0] = 2, in[1] = in[2] = 1;
        l[n++] = spec(LAYER_CONV2D, NULL, 5, 1, 1, NULL, NULL);
        l[n++] = spec(LAYER_BATCHNORM2D, NULL, 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_RELU, NULL, 0, 0, 0, NULL, NULL);
        l[n++] = spec(LAYER_FLATTEN, NULL, 0, 0, 0, NULL, NULL);
        return n;
    } else { /* dense -> batchnorm1d -> relu, twice */
        *in_ndim = 1, in[0] = 20;
        for (int b = 0; b < 2; b++) {
            l[n++] = spec(LAYER_DENSE, NULL, 16, 0, 0, NULL, NULL);
            l[n - 1].no_bias = true;
            l[n++] = spec(LAYER_BATCHNORM1D, NULL, 0, 0, 0, NULL, NULL);
            l[n++] = spec(LAYER_RELU, NULL, 0, 0, 0, NULL, NULL);
        }
    }
    l[n++] = spec(LAYER_DENSE, "head", 5, 0, 0, NULL, NULL);
    return n;
}

typedef struct {
    float out[64 * 5];
    float *grads;     /* every parameter's gradient, in order */
    float *stats;     /* every running mean and variance, in order */
    size_t n_grads, n_stats, high_water;
} StepResult;

/* One training step (forward, backward from a fixed output gradient) of a freshly initialised model. */
static void run_step(int kind, bool keep, int N, StepResult *r) {
    LayerSpec l[32];
    int in_ndim, in[3];
    const int n = build(kind, l, &in_ndim, in);
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, in_ndim, in, l, n, &err), QT_OK);
    Rng rng;
    rng_init(&rng, 21, RNG_STREAM_INIT);
    model_init_params(&m, &rng);
    m.keep_outputs = keep;
    size_t per = 1;
    for (int k = 0; k < in_ndim; k++) per *= (size_t)in[k];
    float *x = test_random_uniform((size_t)N * per, 7, -1.0f, 1.0f);
    TestEnv e;
    test_env_init(&e, 1);
    e.tape.training = true;
    int shape[4] = {N, in[0], in[1], in[2]};
    Var *vx = test_var(&e, x, in_ndim + 1, shape, false);
    Var *y = model_forward(&m, &e.tape, vx);
    CU_ASSERT_FATAL(y != NULL);
    CU_ASSERT_FATAL(var_numel(y) == (size_t)N * 5);
    float dy[64 * 5];
    for (int i = 0; i < N * 5; i++) dy[i] = (float)((i * 7) % 11) - 5.0f;
    CU_ASSERT_FATAL(tape_backward_from(&e.tape, y, dy) == QT_OK);
    /* read after the backward, as the trainer counts correct predictions: the output must still be there */
    CU_ASSERT_PTR_NOT_NULL_FATAL(y->value.data);
    memcpy(r->out, y->value.data, var_numel(y) * sizeof(float));
    r->high_water = e.arena.high_water;
    r->n_grads = r->n_stats = 0;
    for (int p = 0; p < m.n_params; p++) r->n_grads += var_numel(&m.params[p].var);
    for (int i = 0; i < m.n_modules; i++)
        if (m.modules[i].bn.running_mean) r->n_stats += 2 * (size_t)m.modules[i].out_shape[0];
    r->grads = malloc(r->n_grads * sizeof(float));
    r->stats = malloc((r->n_stats + 1) * sizeof(float));
    size_t at = 0;
    for (int p = 0; p < m.n_params; p++) {
        const size_t k = var_numel(&m.params[p].var);
        memcpy(r->grads + at, m.params[p].var.grad, k * sizeof(float));
        at += k;
    }
    at = 0;
    for (int i = 0; i < m.n_modules; i++) {
        const Module *mod = &m.modules[i];
        if (!mod->bn.running_mean) continue;
        const size_t C = (size_t)mod->out_shape[0];
        memcpy(r->stats + at, mod->bn.running_mean, C * sizeof(float));
        memcpy(r->stats + at + C, mod->bn.running_var, C * sizeof(float));
        at += 2 * C;
    }
    test_env_free(&e);
    free(x);
    model_free(&m);
}

static void test_models_step_same_bits_in_less_memory(void) {
    const int before = parallel_get_threads();
    static const char *names[MODEL_KINDS] = {"resnet", "dscnn", "mlp", "end-relu", "end-flatten"};
    for (int threads = 1; threads <= 2; threads++) {
        parallel_set_threads(threads);
        for (int kind = 0; kind < MODEL_KINDS; kind++) {
            const int N = kind == MODEL_MLP || kind >= MODEL_END_RELU ? 64 : 16;
            StepResult keep = {0}, plan = {0};
            run_step(kind, true, N, &keep);
            run_step(kind, false, N, &plan);
            CU_ASSERT_EQUAL_FATAL(keep.n_grads, plan.n_grads);
            CU_ASSERT(memcmp(keep.out, plan.out, (size_t)N * 5 * sizeof(float)) == 0);
            CU_ASSERT(memcmp(keep.grads, plan.grads, keep.n_grads * sizeof(float)) == 0);
            CU_ASSERT(memcmp(keep.stats, plan.stats, keep.n_stats * sizeof(float)) == 0);
            CU_ASSERT(keep.n_stats > 0);
            if (plan.high_water >= keep.high_water)
                fprintf(stderr, "\n    %s, %d thread(s): arena %zu bytes with the plan, %zu keeping every output\n",
                        names[kind], threads, plan.high_water, keep.high_water);
            if (kind < MODEL_END_RELU) CU_ASSERT(plan.high_water < keep.high_water);
            free(keep.grads), free(keep.stats), free(plan.grads), free(plan.stats);
        }
    }
    parallel_set_threads(before);
}

int register_nn_train_memory_suite(void) {
    CU_pSuite s = CU_add_suite("nn_train_memory", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "free list: neighbours merge, a larger buffer splits, the top goes back",
                        test_free_list_merges_splits_gives_back) ||
           !CU_add_test(s, "releases held while work on them is deferred", test_held_releases) ||
           !CU_add_test(s, "a dropped value is made again for its readers, not for value-free ones",
                        test_dropped_value_is_remade_for_its_readers) ||
           !CU_add_test(s, "resnet, dscnn, batch-norm mlp steps, and outputs that are a relu'd batch norm (or its view): "
                           "same bits as keeping every output, the output kept, less memory",
                        test_models_step_same_bits_in_less_memory)
               ? -1
               : 0;
}
