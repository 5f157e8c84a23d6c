/* demo.c - three interleaved spirals, a 2-64-64-3 MLP, AdamW. */
#include "demo.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nn/gemm.h"
#include "nn/model.h"
#include "nn/ops.h"
#include "nn/optim.h"
#include "nn/schedule.h"

#define DEMO_CLASSES 3
#define DEMO_TRAIN 3072
#define DEMO_TEST 768

DemoOptions demo_options_default(void) {
    return (DemoOptions){.steps = 600, .batch_size = 128, .log_every = 50, .seed = 1, .threads = 1, .quiet = false};
}

/* n points of DEMO_CLASSES spirals with Gaussian noise; x: (n, 2), y: [n]. */
static void make_spirals(float *x, int32_t *y, int n, Rng *rng) {
    float noise[2];
    for (int i = 0; i < n; i++) {
        int c = i % DEMO_CLASSES;
        float u;
        rng_fill_uniform(rng, &u, 1, 0.0f, 1.0f);
        rng_fill_normal(rng, noise, 2, 0.0f, 0.05f);
        float r = 0.1f + 0.9f * u, theta = 4.0f * u + 2.0943951f * (float)c; /* 2 pi / 3 apart */
        x[2 * i] = r * cosf(theta) + noise[0];
        x[2 * i + 1] = r * sinf(theta) + noise[1];
        y[i] = c;
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Accuracy of the model on (x, y), forward only, in batches. */
static QtStatus evaluate(Model *m, Tape *t, float *x, const int32_t *y, int n, int batch, double *accuracy,
                         QtError *err) {
    int correct = 0;
    bool was_training = t->training, had_grad = t->grad_enabled;
    QtStatus st = QT_OK;
    t->training = false;
    t->grad_enabled = false;
    for (int start = 0; start < n && st == QT_OK; start += batch) {
        int b = n - start < batch ? n - start : batch;
        Var *logits = model_forward(m, t, tape_wrap(t, x + 2 * start, 2, (int[]){b, 2}));
        if (!logits) st = qt_error_set(err, t->err.status, "demo: evaluation: %s", t->err.msg);
        for (int i = 0; logits && i < b; i++) {
            const float *z = logits->value.data + (size_t)i * DEMO_CLASSES;
            int best = 0;
            for (int c = 1; c < DEMO_CLASSES; c++) best = z[c] > z[best] ? c : best;
            correct += best == y[start + i];
        }
        tape_reset(t);
    }
    t->training = was_training;
    t->grad_enabled = had_grad;
    *accuracy = (double)correct / n;
    return st;
}

typedef struct {
    Model model;
    Optimizer opt;
    Arena arena;
    Tape tape;
    Rng init, shuffle, dropout;
    float *x;   /* (DEMO_TRAIN + DEMO_TEST, 2) */
    int32_t *y; /* [DEMO_TRAIN + DEMO_TEST] */
    uint32_t *order; /* [DEMO_TRAIN] shuffled indices */
    float *bx;  /* (batch, 2) */
    int32_t *by;
} Demo;

static void demo_free(Demo *d) {
    optim_free(&d->opt);
    model_free(&d->model);
    tape_free(&d->tape);
    arena_free(&d->arena);
    free(d->x), free(d->y), free(d->order), free(d->bx), free(d->by);
}

static QtStatus demo_setup(Demo *d, const DemoOptions *o, QtError *err) {
    LayerSpec layers[] = {
        {.type = LAYER_DENSE, .name = "fc1", .units = 64}, {.type = LAYER_RELU},
        {.type = LAYER_DENSE, .name = "fc2", .units = 64}, {.type = LAYER_RELU},
        {.type = LAYER_DROPOUT, .p = 0.05f},               {.type = LAYER_DENSE, .name = "head", .units = DEMO_CLASSES},
    };
    QtStatus st = model_init(&d->model, 1, (int[]){2}, layers, (int)(sizeof layers / sizeof layers[0]), err);
    if (st != QT_OK) return st;
    rng_init(&d->init, o->seed, RNG_STREAM_INIT);
    d->shuffle = rng_fork(&d->init, RNG_STREAM_SHUFFLE);
    d->dropout = rng_fork(&d->init, RNG_STREAM_DROPOUT);
    model_init_params(&d->model, &d->init);
    OptimConfig oc = optim_config_default(OPTIM_ADAMW);
    oc.lr = 1e-2f;
    oc.weight_decay = 1e-4f;
    if ((st = optim_init(&d->opt, &oc, d->model.param_list, d->model.n_params, err)) != QT_OK) return st;
    if (arena_init(&d->arena, 1 << 20) != 0) return qt_error_set(err, QT_ERR_NOMEM, "demo: cannot allocate the arena");
    if ((st = tape_init(&d->tape, &d->arena, &d->dropout, err)) != QT_OK) return st;
    int n = DEMO_TRAIN + DEMO_TEST;
    d->x = malloc((size_t)n * 2 * sizeof(float));
    d->y = malloc((size_t)n * sizeof(int32_t));
    d->order = malloc(DEMO_TRAIN * sizeof(uint32_t));
    d->bx = malloc((size_t)o->batch_size * 2 * sizeof(float));
    d->by = malloc((size_t)o->batch_size * sizeof(int32_t));
    if (!d->x || !d->y || !d->order || !d->bx || !d->by)
        return qt_error_set(err, QT_ERR_NOMEM, "demo: cannot allocate the data set");
    Rng data = rng_fork(&d->init, 100);
    make_spirals(d->x, d->y, n, &data);
    for (uint32_t i = 0; i < DEMO_TRAIN; i++) d->order[i] = i;
    return QT_OK;
}

QtStatus demo_run(const DemoOptions *o, double *accuracy, QtError *err) {
    if (o->steps < 1 || o->batch_size < 1 || o->batch_size > DEMO_TRAIN)
        return qt_error_set(err, QT_ERR_ARG, "demo: steps must be >= 1 and batch size in 1..%d", DEMO_TRAIN);
    gemm_set_threads(o->threads);
    Demo d;
    memset(&d, 0, sizeof d);
    QtStatus st = demo_setup(&d, o, err);
    LrSchedule sched = {.kind = SCHED_COSINE, .base_lr = d.opt.cfg.lr, .warmup_steps = o->steps / 20,
                        .total_steps = o->steps, .min_lr = 0.0f};
    if (!o->quiet) {
        printf("qtrain demo: 3-class spirals, %d train / %d test points, seed %llu\n", DEMO_TRAIN, DEMO_TEST, o->seed);
        printf("  steps %d, batch %d, adamw lr %g wd %g, cosine schedule with %lld warmup steps, grad clip 1.0\n",
               o->steps, o->batch_size, (double)sched.base_lr, (double)d.opt.cfg.weight_decay,
               (long long)sched.warmup_steps);
        if (st == QT_OK) model_print(&d.model, stdout);
    }
    int per_epoch = DEMO_TRAIN / o->batch_size, cursor = per_epoch;
    double t0 = now_s();
    for (int step = 0; st == QT_OK && step < o->steps; step++) {
        if (cursor == per_epoch) rng_shuffle_u32(&d.shuffle, d.order, DEMO_TRAIN), cursor = 0;
        for (int i = 0; i < o->batch_size; i++) {
            uint32_t k = d.order[cursor * o->batch_size + i];
            d.bx[2 * i] = d.x[2 * k], d.bx[2 * i + 1] = d.x[2 * k + 1], d.by[i] = d.y[k];
        }
        cursor++;
        Var *x = tape_wrap(&d.tape, d.bx, 2, (int[]){o->batch_size, 2});
        Var *loss = nn_softmax_cross_entropy(&d.tape, model_forward(&d.model, &d.tape, x), d.by);
        if (tape_backward(&d.tape, loss) != QT_OK) {
            st = qt_error_set(err, d.tape.err.status, "demo: step %d: %s", step, d.tape.err.msg);
            break;
        }
        double gnorm = optim_clip_grad_norm(d.model.param_list, d.model.n_params, 1.0f);
        float lr = lr_schedule_at(&sched, step);
        optim_step(&d.opt, lr);
        optim_zero_grad(&d.opt);
        if (!o->quiet && ((step + 1) % o->log_every == 0 || step == 0))
            printf("step:%d loss:%.4f lr:%.6f grad_norm:%.4f samples/s:%.0f\n", step + 1, (double)loss->value.data[0],
                   (double)lr, gnorm, (step + 1) * o->batch_size / (now_s() - t0));
        tape_reset(&d.tape);
    }
    if (st == QT_OK) {
        double wall = now_s() - t0;
        double train_acc = 0.0;
        st = evaluate(&d.model, &d.tape, d.x, d.y, DEMO_TRAIN, 256, &train_acc, err);
        if (st == QT_OK)
            st = evaluate(&d.model, &d.tape, d.x + 2 * DEMO_TRAIN, d.y + DEMO_TRAIN, DEMO_TEST, 256, accuracy, err);
        if (st == QT_OK && !o->quiet)
            printf("done: steps:%d wall_s:%.2f train_accuracy:%.4f test_accuracy:%.4f arena_bytes:%zu\n", o->steps,
                   wall, train_acc, *accuracy, arena_capacity(&d.arena));
    }
    demo_free(&d);
    return st;
}
