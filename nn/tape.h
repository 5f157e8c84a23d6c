/* tape.h - the reverse-mode autodiff tape.
 *
 * Ops run eagerly: each computes its output at once and, if any input needs
 * a gradient, appends a node with its backward function and what it saved.
 * tape_backward() walks the nodes in reverse; every backward accumulates
 * (+=) into the grads of its inputs. Once a node's backward has run, its
 * output's gradient is dead (every consumer ran before it): tape_backward
 * hands the buffer to the next gradient allocated, so the step holds a few
 * live gradients instead of one per op. An intermediate Var's grad is
 * therefore not readable after tape_backward; inputs' and parameters' are.
 *
 * Errors poison instead of crashing: an op that fails returns NULL and
 * records the first error in tape->err; an op given a NULL input returns
 * NULL at once. A forward pass can therefore be written straight through and
 * checked once, with the message naming the op that failed and its shapes.
 *
 * Ops never write into their inputs' values: an output may share its
 * input's buffer (reshape; dropout in eval returns x itself), and inputs are
 * often parameters or the caller's batch. */
#ifndef QTRAIN_NN_TAPE_H
#define QTRAIN_NN_TAPE_H

#include <stdbool.h>
#include <stddef.h>

#include "base/arena.h"
#include "base/error.h"
#include "base/rng.h"
#include "tensor.h"

#define TAPE_SMALL_BYTES 4096
#define TAPE_MAX_INPUTS 6 /* e.g. x, w, bias, scale, zero point of a quantized op */
#define TAPE_HANDOFF_MAX 4 /* readers of one output that can share its int8 codes (Tape.handoff) */
#define TAPE_HELD_MAX 32   /* released buffers held while work on them is deferred (Tape.hold) */

typedef struct Tape Tape;
typedef struct TapeNode TapeNode;

/* Reads node->out->grad and accumulates into the grads of node->in[] that
 * require them (get them with tape_grad). */
typedef void (*TapeBackwardFn)(Tape *tape, const TapeNode *node);

#define TAPE_NODE_RELEASES 2

struct TapeNode {
    const char *op;                 /* op name, for messages */
    TapeBackwardFn backward;
    Var *out;
    Var *in[TAPE_MAX_INPUTS];       /* NULL where unused */
    void *ctx;                      /* op-specific saved state (arena) */
    Var *release[TAPE_NODE_RELEASES]; /* values no backward reads once this node's has run (tape_release_after) */
    bool value_free;                /* the backward reads no input's value (tape_record_value_free) */
};

/* Writes the value of a dropped Var again: out [numel] from what ctx keeps;
 * an input that was dropped too is made first (tape_value_ready). Errors go
 * to the tape. */
typedef void (*TapeRemakeFn)(Tape *t, float *out, const void *ctx);

/* A value the forward may drop after its last forward reader and the
 * backward makes again where a node reads it. Up to two Vars share the
 * buffer (a batch norm's output and the relu applied to it in place). */
typedef struct TapeRemake {
    TapeRemakeFn fn;
    const void *ctx;
    Var *vars[2];   /* vars[1] may be NULL */
    size_t bytes;
} TapeRemake;

/* Data-parallel training (trainer/dist.h): the ops that need statistics of
 * the whole global batch, not of this process's part of it (batch norm with
 * train.sync_bn), gather them from every rank through this. Each rank's tape
 * makes the same calls in the same order; a rank's part never is empty. */
typedef struct {
    int world;          /* ranks taking part, >= 2 */
    /* all (world, n): every rank's mine (n doubles), rank 0's first. QT_OK,
     * or an error in err (the step then fails on every rank). */
    QtStatus (*allgather)(void *ctx, const double *mine, size_t n, double *all, QtError *err);
    void *ctx;
} TapeSync;

struct Tape {
    Arena *arena;       /* step arena: values, saved tensors, non-param grads */
    Arena small;        /* the step's allocations of at most TAPE_SMALL_BYTES (Vars, op contexts, per-channel
                           scratch): apart, so the large buffers the step frees lie side by side and merge */
    TapeNode *nodes;    /* [cap_nodes]; kept across steps, so no malloc in
                           the steady state */
    size_t n_nodes;
    size_t cap_nodes;
    bool training;      /* dropout active, batch norm on batch statistics (and, later, quantizer statistics) */
    bool grad_enabled;  /* false: ops run forward only and record nothing */
    bool backward_done; /* set by tape_backward until the next reset */
    Rng *rng;           /* dropout masks; may be NULL if no op needs it */
    const TapeSync *bn_sync; /* NULL: batch norm's batch statistics are this process's batch's; else the global
                                batch's, gathered from every rank (train.sync_bn) */
    void *free_grads;   /* arena float buffers no one reads any more (dead gradients in the backward,
                           dead activations of a pass without gradients), for the next tape_grad or
                           tape_new_var to take: a list threaded through the buffers themselves */
    const struct Module *handoff[TAPE_HANDOFF_MAX]; /* set by model_forward while an op runs whose output modules
                                     of one input read (a forward without gradients, at most TAPE_HANDOFF_MAX of
                                     them; any other reader a merge: handoff_keep): those modules, whose hooks may
                                     take the output as their input codes (Var.codes), when they all take the same
                                     ones */
    int n_handoff;      /* 0: no hand-off */
    bool handoff_keep;  /* with a hand-off: the output's floats are read too, by a merge (a residual add) */
    bool handoff_merges; /* no hand-off, the output's every reader a merge (a residual add, a concat): a hook
                            may defer its work (Tape.deferred), for model_forward runs the deferred work before any
                            op that is not a conv hook's, so a merge that does not fuse into a later conv still
                            reads it made */
    const Var *residual; /* set by model_forward while a fused_residual hook runs a conv whose output an add then
                            sums with this earlier output (same shape) before the epilogue: y = epi(conv + residual);
                            else NULL */
    void *deferred;     /* a hook's work deferred to the op that reads its output (quant's int8 chain), or NULL;
                           owned by that hook's code, in the arena */
    bool (*run_deferred)(struct Tape *t); /* set with deferred by that code: runs what waits now (false: the error
                           set); tape_run_deferred calls it */
    int hold;           /* > 0: tape_release holds buffers back (a deferred op still reads them) until
                           tape_release_held brings hold back to 0 */
    int n_held;
    struct { void *p; size_t bytes; } held[TAPE_HELD_MAX]; /* past TAPE_HELD_MAX, freed only by tape_reset */
    QtError err;        /* first error since the last reset */
};

QtStatus tape_init(Tape *t, Arena *arena, Rng *rng, QtError *err);
void tape_free(Tape *t);
/* Forgets the recorded ops and the error, and resets the arena: call after
 * the optimizer step. Every Var from the arena is invalid afterwards. */
void tape_reset(Tape *t);

/* A new Var from the arena, value uninitialised, grad NULL. NULL on error. */
Var *tape_new_var(Tape *t, int ndim, const int *shape);
/* A Var whose value is the caller's buffer (not copied; must outlive the
 * step), e.g. a batch of inputs. No gradient. */
Var *tape_wrap(Tape *t, float *data, int ndim, const int *shape);
/* Hands v's value buffer back for the next tape_new_var or gradient of this
 * step: the caller knows nothing reads v's values any more (a forward
 * without gradients, past v's last reader). v must come from tape_new_var. */
void tape_release(Tape *t, Var *v);
/* The same for an op's scratch (tape_alloc'd, `bytes` long) once the op is
 * done with it. */
void tape_release_buffer(Tape *t, void *p, size_t bytes);
/* Holds back every release until the matching tape_release_held (nested), which makes the held ones: for a hook
 * that defers reading its input to a later op (Tape.deferred) while model_forward releases what it thinks dead. */
void tape_hold_releases(Tape *t);
void tape_release_held(Tape *t);
/* Runs the deferred work (Tape.deferred) now, if any waits: for an op about to read what it writes. False: the
 * tape's error is set. */
bool tape_run_deferred(Tape *t);
/* Arena memory for an op's saved state; sets the tape error on failure. */
void *tape_alloc(Tape *t, size_t bytes);
/* The grad of v, allocated zeroed from the arena on first use (params have
 * theirs already). NULL, with the tape error set, if memory runs out. */
float *tape_grad(Tape *t, Var *v);

/* For an elementwise backward that can compute v's gradient in place of
 * its output's: if v has no grad yet, v takes over from->grad (the node's
 * output gradient, which no one reads after this node) and true is
 * returned; the caller then overwrites it in place. Otherwise false. */
bool tape_grad_take(Tape *t, Var *v, Var *from);

/* The same for a backward that writes its whole gradient for v at once: if
 * v has no grad yet, it is allocated uninitialised and *fresh set, and the
 * caller must write (=) every element instead of adding into it (no zeroing
 * pass, no read of zeros). Otherwise as tape_grad, *fresh false. */
float *tape_grad_to_write(Tape *t, Var *v, bool *fresh);

/* ---- activation memory -----------------------------------------------------
 * The forward of a training step keeps what the backward reads; these let
 * the caller, who knows the graph, keep less. Each sets the buffer's Vars'
 * value.data to NULL once it is handed back, so a read that should not
 * happen fails at once instead of reading a reused buffer. */

/* Lets v (and `also`, a Var sharing v's buffer, or NULL) be dropped and made
 * again by fn(ctx). fn's inputs must be kept, or be remakeable, until the
 * backward reads of v are over: the caller hands them back no earlier than
 * the node that made v. false (tape error set) if out of memory. */
bool tape_remake_set(Tape *t, Var *v, Var *also, TapeRemakeFn fn, const void *ctx);
/* Hands v's buffer back now: its last forward reader has run. If v has a
 * remake, the backward makes it again before a node that has it as an input
 * (and is not value_free) runs; if not, no backward may read it (the caller
 * knows its readers' backwards read no values). A node's own output is not
 * made again for it: an op whose backward reads its output (relu in place)
 * shares the buffer with its input. */
void tape_drop(Tape *t, Var *v);
/* Hands v's buffer back once the backward has passed the latest node whose
 * output is `out` (run or skipped): no earlier node's backward reads v. false
 * if there is no such node among the last few (then v is kept). */
bool tape_release_after(Tape *t, Var *out, Var *v);
/* v's value, made again if it was dropped (for a remake reading another
 * dropped value). false (tape error set) if that fails. */
bool tape_value_ready(Tape *t, Var *v);

/* Appends a node if gradients are enabled and any input requires them, and
 * marks out->requires_grad accordingly. Returns false (tape error set) only
 * if the node array cannot grow. */
bool tape_record(Tape *t, const char *op, TapeBackwardFn backward, Var *out,
                 Var *const *in, int n_in, void *ctx);

/* tape_record for an op whose backward reads gradients only (add, concat,
 * global average pool): a dropped input is not made again for it. */
bool tape_record_value_free(Tape *t, const char *op, TapeBackwardFn backward, Var *out, Var *const *in, int n_in,
                            void *ctx);

/* Seeds d(loss)/d(loss) = 1 and runs every node's backward in reverse.
 * `loss` must have exactly one element. */
QtStatus tape_backward(Tape *t, Var *loss);
/* The same from any output: seeds out's grad with dout ([numel(out)]) and
 * runs the backward. For tests and for callers with their own loss. */
QtStatus tape_backward_from(Tape *t, Var *out, const float *dout);

static inline bool tape_ok(const Tape *t) { return t->err.status == QT_OK; }

#endif
