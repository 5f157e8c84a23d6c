/* eval_int.c - a checkpoint's integer program (intprog.h) made from its run's
 * data and evaluated example by example: `qtrain eval --integer`, and what
 * `qtrain export --format c` reports. */
#include "eval_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/parallel.h"
#include "data/npy.h"
#include "nn/gemm.h"
#include "trainer/checkpoint_internal.h"
#include "trainer/run.h"

QtStatus eval_int_load(Run *r, const char *checkpoint, IntProgram *p, bool low_ram, QtError *err) {
    r->plan.steps_per_epoch = 1; /* no plan: evaluation and calibration only */
    gemm_set_threads(r->cfg->run.threads);
    QtStatus st = run_load_data(r, err);
    if (st == QT_OK) st = run_build_model(r, false, err);
    CheckpointNet parts = net_checkpoint_parts(&r->model.net);
    if (st == QT_OK) st = checkpoint_load_model(checkpoint, &r->model.net.model, &parts, err);
    if (st == QT_OK) st = run_alloc(r, err);
    if (st != QT_OK) return st;
    if (r->cfg->quant.mode != QUANT_MODE_PTQ)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: a %s checkpoint; the integer program is made from a PTQ "
                            "checkpoint with int8 weights and static int8 input ranges (qtrain export --format c "
                            "converts a QAT checkpoint and merges adapters on the way)", checkpoint,
                            net_mode_name(&r->model.net));
    if (config_has_lora(r->cfg))
        return qt_error_set(err, QT_ERR_CONFIG, "%s: a %s checkpoint: its adapters are not in the integer program; "
                            "fold them in first (qtrain merge), or let qtrain export --format c merge them on the way",
                            checkpoint, net_mode_name(&r->model.net));
    const Net *n = &r->model.net;
    float (*range)[2] = malloc((size_t)n->model.n_modules * sizeof *range);
    if (!range) return qt_error_set(err, QT_ERR_NOMEM, "out of memory");
    st = intprog_calibrate(&r->model.net, &r->data.train, r->cfg->train.batch_size, r->cfg->quant.calibration_batches,
                           &r->work.tape, r->work.bx, range, err);
    if (st == QT_OK) st = intprog_build(p, n, (const float (*)[2])range, &r->data.test, low_ram, err);
    free(range);
    return st;
}

/* ---- evaluation ---------------------------------------------------------------------------------------------- */

enum { CHUNK = 256 };

typedef struct {
    const IntProgram *p;
    const int8_t *codes;   /* (n, in_size) */
    int8_t *out;           /* (n, out_size) */
    uint8_t *arenas;       /* [threads][arena_bytes] */
    size_t arena_pitch;
} RunJob;

static void run_task(void *ctx, int task, int n_tasks) {
    (void)n_tasks;
    RunJob *j = ctx;
    void *arena = j->arenas + (size_t)parallel_thread_index() * j->arena_pitch;
    intprog_run(j->p, arena, j->codes + (size_t)task * j->p->in_size, j->out + (size_t)task * j->p->out_size);
}

/* The codes of examples start..start+n-1: the table for bytes in memory, else the float pipeline quantized. */
static QtStatus chunk_codes(const IntProgram *p, const Dataset *d, int start, int n, float *x, int8_t *codes,
                            QtError *err) {
    if (p->in_table && d->pixels && d->elem == DATA_ELEM_U8) {
        for (int i = 0; i < n; i++)
            intprog_quantize_u8(p, d->pixels + (size_t)(start + i) * d->feat, codes + (size_t)i * p->in_size);
        return QT_OK;
    }
    QtStatus st = dataset_fill_range(d, start, n, x, NULL, err);
    for (int i = 0; st == QT_OK && i < n; i++)
        if (!intprog_quantize_f32(p, x + (size_t)i * p->in_size, codes + (size_t)i * p->in_size))
            st = qt_error_set(err, QT_ERR_VALUE, "test example %d holds a value that is not finite", start + i);
    return st;
}

/* Adds example i's loss and correctness (labels) or squared error (targets t [out_size], or NULL). */
static void score(const IntProgram *p, const int8_t *q, int32_t label, const float *t, IntEvalResult *res) {
    const size_t K = p->out_size;
    if (t) {
        double se = 0.0;
        for (size_t k = 0; k < K; k++) {
            const double z = (double)p->out_scale * (q[k] - p->out_zp), e = z - t[k];
            se += e * e;
        }
        res->loss += se / (double)K;
        return;
    }
    size_t best = 0;
    double mx = -INFINITY, sum = 0.0;
    for (size_t k = 0; k < K; k++) {
        if (q[k] > q[best]) best = k;
        const double z = (double)p->out_scale * (q[k] - p->out_zp);
        if (z > mx) mx = z;
    }
    for (size_t k = 0; k < K; k++) sum += exp((double)p->out_scale * (q[k] - p->out_zp) - mx);
    res->loss += mx + log(sum) - (double)p->out_scale * (q[label] - p->out_zp);
    res->correct += (int32_t)best == label;
}

QtStatus eval_int_run(const IntProgram *p, const Dataset *d, bool target_input, int8_t *logits, IntEvalResult *res,
                      QtError *err) {
    memset(res, 0, sizeof *res);
    res->n = d->n;
    res->mse = target_input || !d->labels;
    const int threads = parallel_get_threads();
    RunJob j = {.p = p, .arena_pitch = (p->arena_bytes + 63) / 64 * 64};
    int8_t *codes = malloc((size_t)CHUNK * p->in_size), *out = malloc((size_t)CHUNK * p->out_size);
    float *x = malloc((size_t)CHUNK * (p->in_size > p->out_size ? p->in_size : p->out_size) * sizeof *x);
    float *t = res->mse ? malloc((size_t)CHUNK * p->out_size * sizeof *t) : NULL;
    int32_t *y = malloc((size_t)CHUNK * sizeof *y);
    j.arenas = aligned_alloc(64, (size_t)threads * j.arena_pitch + 64);
    QtStatus st = codes && out && x && y && j.arenas && (!res->mse || t) ? QT_OK
                  : qt_error_set(err, QT_ERR_NOMEM, "out of memory for the integer evaluation");
    if (st == QT_OK && res->mse && !target_input && (size_t)d->n_targets != p->out_size)
        st = qt_error_set(err, QT_ERR_CONFIG, "the test targets have %d values, the model's output %zu",
                          d->n_targets, p->out_size);
    j.codes = codes, j.out = out;
    for (int s = 0; st == QT_OK && s < d->n; s += CHUNK) {
        const int n = d->n - s < CHUNK ? d->n - s : CHUNK;
        st = chunk_codes(p, d, s, n, x, codes, err);
        if (st == QT_OK && res->mse) {
            if (target_input) st = dataset_fill_range(d, s, n, t, NULL, err);
            else if (!dataset_fill_targets_range(d, s, n, t))
                st = qt_error_set(err, QT_ERR_IO, "reading the test targets %d..%d failed", s, s + n - 1);
        }
        if (st != QT_OK) break;
        if (d->labels) memcpy(y, d->labels + s, (size_t)n * sizeof *y);
        if (threads > 1) parallel_run(n, run_task, &j);
        else for (int i = 0; i < n; i++) run_task(&j, i, n);
        for (int i = 0; i < n; i++)
            score(p, out + (size_t)i * p->out_size, d->labels ? y[i] : 0, res->mse ? t + (size_t)i * p->out_size : NULL,
                  res);
        if (logits) memcpy(logits + (size_t)s * p->out_size, out, (size_t)n * p->out_size);
    }
    if (st == QT_OK && d->n > 0) {
        res->loss /= d->n;
        res->accuracy = res->mse ? NAN : (double)res->correct / d->n;
    }
    free(codes), free(out), free(x), free(t), free(y), free(j.arenas);
    return st;
}

QtStatus eval_int_checkpoint(const Config *cfg, const char *checkpoint, const char *logits_path, IntEvalResult *res,
                             QtError *err) {
    Run r;
    TrainOptions o = {.quiet = true};
    run_init(&r, cfg, &o);
    IntProgram p;
    memset(&p, 0, sizeof p);
    QtStatus st = eval_int_load(&r, checkpoint, &p, false, err);
    int8_t *logits = NULL;
    if (st == QT_OK && logits_path && !(logits = malloc((size_t)r.data.test.n * p.out_size + 1)))
        st = qt_error_set(err, QT_ERR_NOMEM, "out of memory for the test logits");
    if (st == QT_OK)
        st = eval_int_run(&p, &r.data.test, cfg->data.target == DATA_TARGET_INPUT, logits, res, err);
    if (st == QT_OK && logits_path) {
        void *buf = NULL;
        size_t len = 0;
        const int64_t shape[2] = {r.data.test.n, (int64_t)p.out_size};
        st = npy_encode_i8(logits, 2, shape, &buf, &len, err);
        if (st == QT_OK) st = ckpt_write_atomic(logits_path, buf, len, FS_REPLACE_REGULAR, err);
        free(buf);
    }
    if (st == QT_OK) {
        res->out_scale = p.out_scale, res->out_zp = p.out_zp;
        res->arena_bytes = p.arena_bytes, res->macs = p.macs;
    }
    free(logits);
    intprog_free(&p);
    run_free(&r);
    return st;
}
