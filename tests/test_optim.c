/* test_optim.c - optimizers, gradient clipping and lr schedules against
 * values worked out by hand (never by calling the code under test).
 *
 * Most optimizer tests minimise f(p) = 0.5 * sum(a_i * p_i^2), whose grad is
 * a_i * p_i: the test writes that grad into the buffer before every step. */
#include <CUnit/CUnit.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nn/optim.h"
#include "nn/schedule.h"
#include "test_util.h"

/* A 1-D Param over caller-owned arrays; grad is NULL when frozen unless
 * `grad` is given anyway (a stale buffer the optimizer must not touch). */
static void make_param(Param *p, const char *name, float *value, float *grad, int n, bool trainable) {
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    int shape[1] = {n};
    tensor_set_shape(&p->var.value, 1, shape);
    p->var.value.data = value;
    p->var.grad = grad;
    p->var.requires_grad = trainable;
    p->var.is_param = true;
    p->trainable = trainable;
}

/* grad = a * p, the gradient of the quadratic. */
static void quad_grad(Param *p, const float *a) {
    for (size_t i = 0; i < var_numel(&p->var); i++) p->var.grad[i] = a[i] * p->var.value.data[i];
}

/* Runs 3 SGD steps (lr 0.1) from p0 = {1, -0.5} with a = {1, 2} and checks
 * p after each step against want[step][i]. */
static void run_sgd_quadratic(OptimConfig cfg, const double want[3][2]) {
    float a[2] = {1.0f, 2.0f}, value[2] = {1.0f, -0.5f}, grad[2];
    Param p;
    make_param(&p, "w", value, grad, 2, true);
    Param *params[1] = {&p};
    Optimizer o;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(optim_init(&o, &cfg, params, 1, &err), QT_OK);
    for (int t = 0; t < 3; t++) {
        quad_grad(&p, a);
        optim_step(&o, 0.1f);
        float w[2] = {(float)want[t][0], (float)want[t][1]};
        ASSERT_ALL_CLOSE(value, w, 2, 1e-6, 1e-6);
    }
    CU_ASSERT_EQUAL(o.step, 3);
    optim_free(&o);
}

static void test_sgd_plain(void) {
    /* p <- p - lr*a*p = (1 - 0.1a) p: factors 0.9 and 0.8. cfg.lr stays at
     * the default 0.01: the step's lr argument is what counts. */
    const double want[3][2] = {
        {0.9, -0.5 * 0.8},
        {0.9 * 0.9, -0.5 * 0.8 * 0.8},
        {0.9 * 0.9 * 0.9, -0.5 * 0.8 * 0.8 * 0.8},
    };
    OptimConfig cfg = optim_config_default(OPTIM_SGD);
    CU_ASSERT_DOUBLE_EQUAL(cfg.lr, 0.01, 1e-9);
    run_sgd_quadratic(cfg, want);
}

static void test_sgd_momentum(void) {
    /* mu = 0.9; buf = g on step 1, then 0.9*buf + g; p -= 0.1*buf.
     * a=1, p=1:    g=1,     buf=1,              p=1-0.1          = 0.9
     *              g=0.9,   buf=0.9*1+0.9=1.8,  p=0.9-0.18       = 0.72
     *              g=0.72,  buf=1.62+0.72=2.34, p=0.72-0.234     = 0.486
     * a=2, p=-0.5: g=-1,    buf=-1,             p=-0.5+0.1       = -0.4
     *              g=-0.8,  buf=-0.9-0.8=-1.7,  p=-0.4+0.17      = -0.23
     *              g=-0.46, buf=-1.53-0.46,     p=-0.23+0.199    = -0.031 */
    const double want[3][2] = {
        {1.0 - 0.1 * 1.0, -0.5 + 0.1},
        {0.9 - 0.1 * (0.9 * 1.0 + 0.9), -0.4 + 0.1 * 1.7},
        {0.72 - 0.1 * (0.9 * 1.8 + 0.72), -0.23 + 0.1 * (0.9 * 1.7 + 0.46)},
    };
    OptimConfig cfg = optim_config_default(OPTIM_SGD);
    cfg.momentum = 0.9f;
    run_sgd_quadratic(cfg, want);

    /* dampening 0.5 and wd 0.1: g = (a + 0.1) p. PyTorch does not damp the
     * first step (buf = g), only later ones: buf = 0.9*buf + 0.5*g.
     * a=1, p=1:    g=1.1,       buf=1.1,                     p=1-0.11
     *              g=0.89*1.1,  buf=0.99+0.5*0.979=1.4795,   p=0.89-0.14795
     *              g=0.74205*1.1=0.816255, buf=0.9*1.4795+0.5*0.816255=1.7396775
     * a=2, p=-0.5: g=-1.05,     buf=-1.05,                   p=-0.5+0.105
     *              g=-0.8295,   buf=-0.945-0.41475=-1.35975, p=-0.395+0.135975
     *              g=-0.5439525, buf=-1.223775-0.27197625=-1.49575125 */
    const double want_damp[3][2] = {
        {1.0 - 0.11, -0.5 + 0.105},
        {0.89 - 0.1 * (0.9 * 1.1 + 0.5 * 0.89 * 1.1), -0.395 - 0.1 * (0.9 * -1.05 + 0.5 * 2.1 * -0.395)},
        {0.74205 - 0.1 * 1.7396775, -0.259025 + 0.1 * 1.49575125},
    };
    cfg.dampening = 0.5f;
    cfg.weight_decay = 0.1f;
    run_sgd_quadratic(cfg, want_damp);
}

static void test_sgd_nesterov(void) {
    /* buf as with momentum, then d = g + 0.9*buf; p -= 0.1*d.
     * a=1, p=1:    g=1,       buf=1,                    d=1.9,                 p=0.81
     *              g=0.81,    buf=0.9+0.81=1.71,        d=0.81+1.539=2.349,    p=0.5751
     *              g=0.5751,  buf=1.539+0.5751=2.1141,  d=0.5751+1.90269,      p=0.327321
     * a=2, p=-0.5: g=-1,      buf=-1,                   d=-1.9,                p=-0.31
     *              g=-0.62,   buf=-0.9-0.62=-1.52,      d=-0.62-1.368=-1.988,  p=-0.1112
     *              g=-0.2224, buf=-1.368-0.2224=-1.5904, d=-0.2224-1.43136,    p=0.054176 */
    const double want[3][2] = {
        {1.0 - 0.1 * 1.9, -0.5 + 0.1 * 1.9},
        {0.81 - 0.1 * (0.81 + 0.9 * 1.71), -0.31 + 0.1 * (0.62 + 0.9 * 1.52)},
        {0.5751 - 0.1 * (0.5751 + 0.9 * 2.1141), -0.1112 + 0.1 * (0.2224 + 0.9 * 1.5904)},
    };
    OptimConfig cfg = optim_config_default(OPTIM_SGD);
    cfg.momentum = 0.9f;
    cfg.nesterov = true;
    run_sgd_quadratic(cfg, want);
}

static void test_sgd_weight_decay(void) {
    /* wd 0.1 adds 0.1*p to the grad: p <- (1 - 0.1*(a + 0.1)) p, factors
     * 0.89 (a=1) and 0.79 (a=2). */
    const double want[3][2] = {
        {0.89, -0.5 * 0.79},
        {0.89 * 0.89, -0.5 * 0.79 * 0.79},
        {0.89 * 0.89 * 0.89, -0.5 * 0.79 * 0.79 * 0.79},
    };
    OptimConfig cfg = optim_config_default(OPTIM_SGD);
    cfg.weight_decay = 0.1f;
    run_sgd_quadratic(cfg, want);
}

static void test_adamw_quadratic(void) {
    enum { N = 4 };
    const double lr = 0.01, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
    float a[N] = {1.0f, 2.0f, 0.5f, 3.0f}, value[N] = {1.0f, -2.0f, 3.0f, 0.25f}, grad[N];
    Param p;
    make_param(&p, "w", value, grad, N, true);
    Param *params[1] = {&p};
    OptimConfig cfg = optim_config_default(OPTIM_ADAMW);
    cfg.weight_decay = (float)wd;
    Optimizer o;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(optim_init(&o, &cfg, params, 1, &err), QT_OK);
    CU_ASSERT_EQUAL(optim_state_bytes(&o), 2 * N * sizeof(float));

    /* The textbook recurrence in double (Loshchilov & Hutter, as PyTorch):
     * p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
     * p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps). */
    double rp[N], rm[N] = {0}, rv[N] = {0};
    for (int i = 0; i < N; i++) rp[i] = value[i];
    for (int t = 1; t <= 3; t++) {
        quad_grad(&p, a);
        optim_step(&o, (float)lr);
        float want[N];
        for (int i = 0; i < N; i++) {
            double g = (double)a[i] * rp[i];
            rp[i] *= 1.0 - lr * wd;
            rm[i] = b1 * rm[i] + (1.0 - b1) * g;
            rv[i] = b2 * rv[i] + (1.0 - b2) * g * g;
            double mhat = rm[i] / (1.0 - pow(b1, t)), vhat = rv[i] / (1.0 - pow(b2, t));
            rp[i] -= lr * mhat / (sqrt(vhat) + eps);
            want[i] = (float)rp[i];
        }
        ASSERT_ALL_CLOSE(value, want, N, 1e-6, 1e-5);
        if (t == 1) {
            /* By hand for p=1, a=1: decay to 0.999, mhat = g = 1, vhat = 1,
             * so p = 0.999 - 0.01 / (1 + 1e-8). */
            CU_ASSERT_DOUBLE_EQUAL(value[0], 0.999 - 0.01 / (1.0 + 1e-8), 1e-6);
        }
    }
    CU_ASSERT_EQUAL(o.step, 3);
    optim_free(&o);
}

static void test_adamw_first_step_sign(void) {
    /* Step 1: m/(1-b1) = g and sqrt(v/(1-b2)) = |g|, so without weight decay
     * every param moves by lr * g / (|g| + eps) ~ lr * sign(g), whatever |g|. */
    enum { N = 5 };
    const float lr = 1e-3f;
    float value[N] = {0.3f, -1.0f, 2.0f, 0.0f, 0.5f}, grad[N] = {1e-2f, 5.0f, -300.0f, 0.25f, -1e-3f};
    float before[N];
    memcpy(before, value, sizeof before);
    Param p;
    make_param(&p, "w", value, grad, N, true);
    Param *params[1] = {&p};
    OptimConfig cfg = optim_config_default(OPTIM_ADAMW);
    cfg.weight_decay = 0.0f;
    Optimizer o;
    CU_ASSERT_EQUAL_FATAL(optim_init(&o, &cfg, params, 1, NULL), QT_OK);
    optim_step(&o, lr);
    for (int i = 0; i < N; i++) {
        double moved = (double)value[i] - (double)before[i];
        double want = grad[i] > 0 ? -(double)lr : (double)lr;
        /* float rounding of p (ulp 2.4e-7 at 2) dominates the eps term. */
        CU_ASSERT_DOUBLE_EQUAL(moved, want, 1e-6);
    }
    optim_free(&o);
}

static void test_frozen_and_zero_grad(void) {
    float fa_val[3] = {1, 2, 3}, t_val[2] = {0.5f, -0.5f}, t_grad[2] = {1, -1};
    float fb_val[2] = {4, 5}, fb_grad[2] = {7, 7};
    Param frozen_a, train, frozen_b;
    make_param(&frozen_a, "base/weight", fa_val, NULL, 3, false);
    make_param(&train, "lora/A", t_val, t_grad, 2, true);
    make_param(&frozen_b, "base/bias", fb_val, fb_grad, 2, false);
    Param *params[3] = {&frozen_a, &train, &frozen_b};

    Optimizer o;
    OptimConfig cfg = optim_config_default(OPTIM_ADAMW);
    CU_ASSERT_EQUAL_FATAL(optim_init(&o, &cfg, params, 3, NULL), QT_OK);
    CU_ASSERT_EQUAL(o.n_params, 1);
    CU_ASSERT_PTR_EQUAL(o.params[0], &train);
    CU_ASSERT_EQUAL(optim_state_bytes(&o), 2 * 2 * sizeof(float)); /* m and v for 2 floats only */
    for (int s = 0; s < 3; s++) optim_step(&o, 0.1f);
    CU_ASSERT(t_val[0] < 0.5f && t_val[1] > -0.5f); /* the trainable one moved against its grad */
    const float fa_want[3] = {1, 2, 3}, fb_want[2] = {4, 5}, fb_grad_want[2] = {7, 7}, zero[2] = {0, 0};
    CU_ASSERT_EQUAL(memcmp(fa_val, fa_want, sizeof fa_val), 0);
    CU_ASSERT_EQUAL(memcmp(fb_val, fb_want, sizeof fb_val), 0);
    optim_zero_grad(&o);
    CU_ASSERT_EQUAL(memcmp(t_grad, zero, sizeof t_grad), 0);
    CU_ASSERT_EQUAL(memcmp(fb_grad, fb_grad_want, sizeof fb_grad), 0); /* not ours to zero */
    optim_free(&o);
    CU_ASSERT_PTR_NULL(o.params);

    /* SGD keeps a momentum buffer only when it has momentum, like PyTorch. */
    cfg = optim_config_default(OPTIM_SGD);
    CU_ASSERT_EQUAL_FATAL(optim_init(&o, &cfg, params, 3, NULL), QT_OK);
    CU_ASSERT(o.m == NULL && o.v == NULL && optim_state_bytes(&o) == 0);
    optim_free(&o);
    cfg.momentum = 0.5f;
    CU_ASSERT_EQUAL_FATAL(optim_init(&o, &cfg, params, 3, NULL), QT_OK);
    CU_ASSERT(o.m != NULL && o.v == NULL && optim_state_bytes(&o) == 2 * sizeof(float));
    CU_ASSERT(o.m[0][0] == 0.0f && o.m[0][1] == 0.0f);
    optim_free(&o);

    /* Nothing trainable is an error, not a silent no-op. */
    Param *only_frozen[2] = {&frozen_a, &frozen_b};
    QtError err = {0};
    CU_ASSERT_EQUAL(optim_init(&o, &cfg, only_frozen, 2, &err), QT_ERR_ARG);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "trainable"));
    optim_free(&o);
}

static void test_clip_grad_norm(void) {
    float v1[1] = {0}, g1[1] = {3}, v2[1] = {0}, g2[1] = {4}, v3[2] = {0}, v4[1] = {0}, g4[1] = {100};
    Param p1, p2, p3, p4;
    make_param(&p1, "a", v1, g1, 1, true);
    make_param(&p2, "b", v2, g2, 1, true);
    make_param(&p3, "frozen", v3, NULL, 2, false);
    make_param(&p4, "frozen_stale", v4, g4, 1, false); /* a frozen grad is not part of the norm */
    Param *params[4] = {&p1, &p3, &p2, &p4};

    /* sqrt(3^2 + 4^2) = 5 <= 10, and max_norm 0 means "do not clip": no change. */
    CU_ASSERT_DOUBLE_EQUAL(optim_clip_grad_norm(params, 4, 10.0f), 5.0, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(optim_clip_grad_norm(params, 4, 0.0f), 5.0, 1e-12);
    CU_ASSERT(g1[0] == 3.0f && g2[0] == 4.0f && g4[0] == 100.0f);

    /* max 1: grads scaled by 1 / (5 + 1e-6) -> 0.6, 0.8 (less 1.2e-7 / 1.6e-7). */
    CU_ASSERT_DOUBLE_EQUAL(optim_clip_grad_norm(params, 4, 1.0f), 5.0, 1e-12);
    const float want[2] = {(float)(3.0 / (5.0 + 1e-6)), (float)(4.0 / (5.0 + 1e-6))};
    const float got[2] = {g1[0], g2[0]};
    ASSERT_ALL_CLOSE(got, want, 2, 0.0, 1e-6);
    CU_ASSERT(got[0] < 0.6f); /* really the 1e-6: 3/5 would round to 0.6f */
    CU_ASSERT_EQUAL(g4[0], 100.0f);
    CU_ASSERT_DOUBLE_EQUAL(optim_clip_grad_norm(params, 4, 1.0f), 1.0, 1e-6); /* now the norm is ~1 */

    /* As in torch, a norm equal to max_norm is still scaled by max/(max+1e-6). */
    g1[0] = 3.0f;
    g2[0] = 4.0f;
    optim_clip_grad_norm(params, 4, 5.0f);
    const float want5[2] = {(float)(3.0 * 5.0 / (5.0 + 1e-6)), (float)(4.0 * 5.0 / (5.0 + 1e-6))};
    const float got5[2] = {g1[0], g2[0]};
    ASSERT_ALL_CLOSE(got5, want5, 2, 0.0, 5e-7);
    CU_ASSERT(got5[0] < 3.0f);

    /* the two halves give the same bits as the whole */
    g1[0] = 3.0f, g2[0] = 4.0f;
    double norm = optim_grad_norm(params, 4);
    optim_clip_grads_to_norm(params, 4, norm, 1.0f);
    float h1 = g1[0], h2 = g2[0];
    g1[0] = 3.0f, g2[0] = 4.0f;
    CU_ASSERT_EQUAL(optim_clip_grad_norm(params, 4, 1.0f), norm);
    CU_ASSERT(h1 == g1[0] && h2 == g2[0]);
    /* a non-finite grad makes the norm non-finite (the trainer's guard relies on it) */
    g1[0] = INFINITY;
    CU_ASSERT(!isfinite(optim_grad_norm(params, 4)));
    g1[0] = NAN;
    CU_ASSERT(!isfinite(optim_grad_norm(params, 4)));
    g1[0] = 3.4e38f, g2[0] = -3.4e38f; /* the largest finite grads: the double sum stays finite */
    CU_ASSERT(isfinite(optim_grad_norm(params, 4)));
}

static void test_schedule_constant_warmup(void) {
    LrSchedule s = {.kind = SCHED_CONSTANT, .base_lr = 0.1f, .warmup_steps = 4};
    CU_ASSERT_EQUAL(lr_schedule_validate(&s, NULL), QT_OK);
    /* 0.1 * (step+1)/4 during warmup, then 0.1. */
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 0), 0.025, 1e-8);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 1), 0.05, 1e-8);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 2), 0.075, 1e-8);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 3), 0.1, 1e-8);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 4), 0.1, 1e-8);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 100000), 0.1, 1e-8);
    s.warmup_steps = 0;
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 0), 0.1, 1e-8);
}

static void test_schedule_cosine(void) {
    /* base 1, floor 0.1, over 10 steps: lr = 0.1 + 0.45 * (1 + cos(pi * step/10)). */
    LrSchedule s = {.kind = SCHED_COSINE, .base_lr = 1.0f, .min_lr = 0.1f, .total_steps = 10};
    CU_ASSERT_EQUAL(lr_schedule_validate(&s, NULL), QT_OK);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 0), 1.0, 1e-7);                                   /* cos 0 = 1 */
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 2), 0.1 + 0.45 * (1.0 + (1.0 + sqrt(5.0)) / 4.0), 1e-7); /* cos pi/5 */
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 5), 0.55, 1e-7);                                  /* cos pi/2 = 0 */
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 10), 0.1, 1e-7);                                  /* cos pi = -1 */
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 50), 0.1, 1e-7);                                  /* stays at the floor */

    /* With 2 warmup steps and total 12: 0.5, 1.0, then the same curve shifted by 2. */
    s.warmup_steps = 2;
    s.total_steps = 12;
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 0), 0.5, 1e-7);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 1), 1.0, 1e-7);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 2), 1.0, 1e-7);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 7), 0.55, 1e-7);
    CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, 12), 0.1, 1e-7);
}

static void test_schedule_step(void) {
    /* base 0.1, halved every 3 steps after 2 warmup steps (0.05, 0.1). */
    LrSchedule s = {.kind = SCHED_STEP, .base_lr = 0.1f, .warmup_steps = 2, .step_size = 3, .gamma = 0.5f};
    CU_ASSERT_EQUAL(lr_schedule_validate(&s, NULL), QT_OK);
    const double want[12] = {0.05, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.0125};
    for (int i = 0; i < 12; i++) CU_ASSERT_DOUBLE_EQUAL(lr_schedule_at(&s, i), want[i], 1e-8);
}

static void test_names(void) {
    OptimKind ok = OPTIM_SGD;
    SchedKind sk = SCHED_CONSTANT;
    CU_ASSERT_STRING_EQUAL(optim_kind_name(OPTIM_SGD), "sgd");
    CU_ASSERT_STRING_EQUAL(optim_kind_name(OPTIM_ADAMW), "adamw");
    CU_ASSERT_EQUAL(optim_kind_parse("AdamW", &ok, NULL), QT_OK);
    CU_ASSERT_EQUAL(ok, OPTIM_ADAMW);
    CU_ASSERT_STRING_EQUAL(sched_kind_name(SCHED_COSINE), "cosine");
    CU_ASSERT_EQUAL(sched_kind_parse("step", &sk, NULL), QT_OK);
    CU_ASSERT_EQUAL(sk, SCHED_STEP);

    /* PyTorch's defaults. */
    OptimConfig c = optim_config_default(OPTIM_ADAMW);
    CU_ASSERT(c.lr == 1e-3f && c.beta1 == 0.9f && c.beta2 == 0.999f && c.eps == 1e-8f && c.weight_decay == 0.01f);
    c = optim_config_default(OPTIM_SGD);
    CU_ASSERT(c.lr == 0.01f && c.momentum == 0.0f && c.dampening == 0.0f && c.weight_decay == 0.0f && !c.nesterov);
}

/* optim_init must fail with `status` and a message containing `needle`. */
static void expect_bad_config(const OptimConfig *cfg, QtStatus status, const char *needle) {
    float value[1] = {1}, grad[1] = {1};
    Param p;
    make_param(&p, "w", value, grad, 1, true);
    Param *params[1] = {&p};
    Optimizer o;
    QtError err = {0};
    CU_ASSERT_EQUAL(optim_init(&o, cfg, params, 1, &err), status);
    CU_ASSERT_EQUAL(err.status, status);
    if (!strstr(err.msg, needle)) fprintf(stderr, "\n  message '%s' does not name '%s'\n", err.msg, needle);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, needle));
    CU_ASSERT_PTR_NULL(o.params);
    optim_free(&o); /* safe after a failed init */
}

static void test_bad_config(void) {
    OptimConfig c = optim_config_default(OPTIM_ADAMW);
    c.lr = -0.1f;
    expect_bad_config(&c, QT_ERR_CONFIG, "lr = ");
    c = optim_config_default(OPTIM_ADAMW);
    c.beta1 = 1.0f;
    expect_bad_config(&c, QT_ERR_CONFIG, "beta1");
    c = optim_config_default(OPTIM_ADAMW);
    c.eps = 0.0f;
    expect_bad_config(&c, QT_ERR_CONFIG, "eps");
    c = optim_config_default(OPTIM_SGD);
    c.nesterov = true;
    expect_bad_config(&c, QT_ERR_CONFIG, "nesterov");
    c.momentum = 0.9f;
    c.dampening = 0.1f;
    expect_bad_config(&c, QT_ERR_CONFIG, "dampening");
    c = optim_config_default(OPTIM_SGD);
    c.momentum = -1.0f;
    expect_bad_config(&c, QT_ERR_CONFIG, "momentum");

    OptimKind k = OPTIM_SGD;
    QtError err = {0};
    CU_ASSERT_EQUAL(optim_kind_parse("adam", &k, &err), QT_ERR_ARG);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "'adam'"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "sgd, adamw"));
    CU_ASSERT_EQUAL(k, OPTIM_SGD);

    SchedKind sk;
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(sched_kind_parse("linear", &sk, &err), QT_ERR_ARG);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, "constant, cosine, step"));
}

/* lr_schedule_validate must fail with QT_ERR_CONFIG naming `field`. */
static void expect_bad_schedule(const LrSchedule *s, const char *field) {
    QtError err = {0};
    CU_ASSERT_EQUAL(lr_schedule_validate(s, &err), QT_ERR_CONFIG);
    if (!strstr(err.msg, field)) fprintf(stderr, "\n  message '%s' does not name '%s'\n", err.msg, field);
    CU_ASSERT_PTR_NOT_NULL(strstr(err.msg, field));
}

static void test_bad_schedule(void) {
    LrSchedule s = {.kind = SCHED_COSINE, .base_lr = 0.1f, .warmup_steps = 10, .total_steps = 9};
    expect_bad_schedule(&s, "total_steps");
    /* a run that is all warmup (the trainer clamps a longer warmup to the run): the lr reaches base_lr at the
       last step */
    s.total_steps = 10;
    QtError err = {0};
    CU_ASSERT_EQUAL(lr_schedule_validate(&s, &err), QT_OK);
    CU_ASSERT_EQUAL(lr_schedule_at(&s, 9), 0.1f);
    CU_ASSERT_EQUAL(lr_schedule_at(&s, 4), (float)(0.1 * 5 / 10));
    s.total_steps = 20;
    s.min_lr = 0.5f;
    expect_bad_schedule(&s, "min_lr");
    s = (LrSchedule){.kind = SCHED_STEP, .base_lr = 0.1f, .step_size = 0, .gamma = 0.5f};
    expect_bad_schedule(&s, "step_size");
    s.step_size = 5;
    s.gamma = 0.0f;
    expect_bad_schedule(&s, "gamma");
    s = (LrSchedule){.kind = SCHED_CONSTANT, .base_lr = -1.0f};
    expect_bad_schedule(&s, "base_lr");
    s = (LrSchedule){.kind = SCHED_CONSTANT, .base_lr = 0.1f, .warmup_steps = -1};
    expect_bad_schedule(&s, "warmup_steps");
}

/* A param with its own lr factor moves exactly as a run with that lr would;
 * the others are untouched by the factor. */
static void test_lr_scale(void) {
    for (int kind = 0; kind < 2; kind++) {
        float va[2] = {1.0f, -2.0f}, vb[2] = {1.0f, -2.0f}, vr[2] = {1.0f, -2.0f};
        float ga[2] = {0.5f, 0.25f}, gb[2] = {0.5f, 0.25f}, gr[2] = {0.5f, 0.25f};
        Param a, b, r;
        make_param(&a, "a", va, ga, 2, true);
        make_param(&b, "b", vb, gb, 2, true);
        make_param(&r, "ref", vr, gr, 2, true);
        OptimConfig c = optim_config_default(kind ? OPTIM_ADAMW : OPTIM_SGD);
        Param *ab[2] = {&a, &b}, *ref[1] = {&r};
        Optimizer o, oref;
        QtError err = {0};
        CU_ASSERT_EQUAL_FATAL(optim_init(&o, &c, ab, 2, &err), QT_OK);
        CU_ASSERT_EQUAL_FATAL(optim_init(&oref, &c, ref, 1, &err), QT_OK);
        CU_ASSERT_EQUAL(optim_set_lr_scale(&o, &b, 0.25f, &err), QT_OK);
        CU_ASSERT_EQUAL(optim_set_lr_scale(&o, &r, 2.0f, &err), QT_ERR_ARG);
        CU_ASSERT_EQUAL(optim_set_lr_scale(&o, &a, -1.0f, &err), QT_ERR_ARG);
        for (int step = 0; step < 3; step++) {
            optim_step(&o, 0.1f);
            optim_step(&oref, 0.025f);
        }
        CU_ASSERT(va[0] != vb[0]);
        CU_ASSERT_EQUAL(memcmp(vb, vr, sizeof vb), 0);
        optim_free(&o);
        optim_free(&oref);
    }
}

int register_nn_optim_suite(void) {
    CU_pSuite s = CU_add_suite("nn_optim", NULL, NULL);
    if (!s) return -1;
    struct {
        const char *name;
        CU_TestFunc fn;
    } tests[] = {
        {"sgd plain", test_sgd_plain},
        {"sgd momentum and dampening", test_sgd_momentum},
        {"sgd nesterov", test_sgd_nesterov},
        {"sgd weight decay", test_sgd_weight_decay},
        {"adamw quadratic, 3 steps", test_adamw_quadratic},
        {"adamw first step ~ lr*sign(g)", test_adamw_first_step_sign},
        {"frozen params and zero_grad", test_frozen_and_zero_grad},
        {"clip_grad_norm", test_clip_grad_norm},
        {"per-parameter lr factor", test_lr_scale},
        {"schedule constant + warmup", test_schedule_constant_warmup},
        {"schedule cosine", test_schedule_cosine},
        {"schedule step", test_schedule_step},
        {"names and defaults", test_names},
        {"bad optimizer config", test_bad_config},
        {"bad schedule", test_bad_schedule},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!CU_add_test(s, tests[i].name, tests[i].fn)) return -1;
    return 0;
}
