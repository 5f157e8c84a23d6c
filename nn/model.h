/* model.h - layers and the model of named modules.
 *
 * A model is a list of modules; each module's name is its path ("conv1",
 * "fc1", "head"), and its parameters are named "<path>/weight" and
 * "<path>/bias", the names checkpoints and quantization/LoRA rules use.
 * A module reads the previous module's output, or the outputs its spec
 * names (a DAG evaluated in list order, model_graph.c); the model's output
 * is the last module's. Shapes are inferred once at model_init, so a config
 * whose layers do not fit together is rejected before any data is touched. */
#ifndef QTRAIN_NN_MODEL_H
#define QTRAIN_NN_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/error.h"
#include "ops.h"
#include "param.h"
#include "base/rng.h"
#include "tape.h"

#define MODULE_NAME_MAX 32
#define LAYER_INPUTS_MAX 8
/* The name of the model's input in LayerSpec.inputs (unless a layer has that name). */
#define MODEL_INPUT_NAME "input"

typedef enum {
    LAYER_DENSE,
    LAYER_CONV2D,
    LAYER_RELU,
    LAYER_GELU,
    LAYER_TANH,
    LAYER_SIGMOID,
    LAYER_MAXPOOL2D,
    LAYER_AVGPOOL2D,
    LAYER_FLATTEN,
    LAYER_DROPOUT,
    LAYER_LAYERNORM,
    LAYER_BATCHNORM1D,
    LAYER_BATCHNORM2D,
    LAYER_GLOBALAVGPOOL,
    LAYER_ADD,    /* merge: the sum of two or more inputs of equal shape */
    LAYER_CONCAT, /* merge: two or more inputs joined along the channel axis (the features of a vector) */
    LAYER_COUNT
} LayerType;

typedef enum {
    INIT_DEFAULT,        /* PyTorch's: kaiming-uniform a=sqrt(5) (= U(+-1/sqrt(fan_in))), bias U(+-1/sqrt(fan_in)) */
    INIT_XAVIER_UNIFORM, /* U(+-sqrt(6/(fan_in+fan_out))), bias 0 */
    INIT_XAVIER_NORMAL,  /* N(0, 2/(fan_in+fan_out)), bias 0 */
    INIT_NORMAL,         /* N(0, init_std^2), bias 0 */
    INIT_COUNT
} InitKind;

typedef struct {
    LayerType type;
    char name[MODULE_NAME_MAX]; /* "" = automatic: "<type><index>", e.g. "relu2" */
    int units;                  /* dense: output features */
    int out_channels;           /* conv2d */
    int kernel;                 /* conv2d, pools */
    int stride;                 /* conv2d (default 1), pools (default kernel) */
    int padding;                /* conv2d */
    /* conv2d's width axis: kernel_w 0 (a spec built in code) means square, all
       three taken from kernel, stride, padding; the config always sets them. */
    int kernel_w, stride_w, padding_w;
    bool padding_same;          /* conv2d: PyTorch's padding='same' (stride 1); padding/padding_w unused */
    int dilation, dilation_w;   /* conv2d: 0 = 1; dilation_w 0 = dilation */
    int groups;                 /* conv2d: 0 = 1; = in channels: depthwise */
    float p;                    /* dropout probability */
    float eps;                  /* layernorm, batchnorm (default 1e-5) */
    float momentum;             /* batchnorm: the running statistics' update rate (default 0.1) */
    bool no_bias;               /* dense, conv2d: omit the bias */
    bool no_affine;             /* batchnorm: no weight and bias (PyTorch's affine=False) */
    InitKind init;
    float init_std;             /* INIT_NORMAL (default 0.02) */
    int n_inputs;               /* 0: the previous layer (the model's input for the first) */
    char inputs[LAYER_INPUTS_MAX][MODULE_NAME_MAX]; /* earlier layers' names, or MODEL_INPUT_NAME */
} LayerSpec;

/* A batch norm folded into the layer that produces its input (its scale
 * into that layer's weight, its shift into a bias): the module then passes
 * its input on, adding its own bias when it carries the shift. */
typedef enum {
    BN_FOLD_NONE,  /* a batch norm of its own */
    BN_FOLD_INTO,  /* y = x: the producer's weight and bias hold it all */
    BN_FOLD_BIAS,  /* y = x + bias: the producer has no bias, so this module's bias holds the shift */
} BnFold;

typedef struct Module Module;

/* Replaces a module's own forward (quant/ and lora/ install these; nn/
 * knows nothing of them). x: (N, in_shape...). */
typedef Var *(*ModuleForwardFn)(Tape *t, Module *m, Var *x, void *ctx);
/* A conv2d hook's forward with the following relu (and 2x2 max pool)
 * folded in, as nn_conv2d_fused does for a plain conv2d; same ctx. bias:
 * (OC,) or NULL, the bias to add, which is the conv's own (m->bias) or,
 * for a conv without one, the shift of the batch norm folded after it
 * (BN_FOLD_BIAS). NULL with no error on the tape declines: model_forward
 * then runs the hook and the following layers one by one. */
typedef Var *(*ModuleFusedForwardFn)(Tape *t, Module *m, Var *x, void *ctx, Var *bias, ConvEpilogue epi);
/* The float weight a hooked module's forward computes with this step (a
 * quantized base's dequantized weight, in the tape's arena), for a hook
 * chained over it that wants to fold the layer into one op; NULL when the
 * hook cannot offer it (the caller then chains through forward_hook). */
typedef Var *(*ModuleWeightFn)(Tape *t, Module *m, void *ctx);

struct Module {
    LayerSpec spec;
    char path[MODULE_NAME_MAX];         /* module path = name */
    int in_ndim, in_shape[3];           /* per example, without the batch axis */
    int out_ndim, out_shape[3];
    int n_inputs;                       /* >= 1 */
    int inputs[LAYER_INPUTS_MAX];       /* earlier module indices, -1 = the model's input */
    int n_consumers;                    /* later modules reading its output (+1 for the last: the model's output) */
    ConvGeom2d geom;                    /* conv2d: its geometry (stride, padding, dilation, groups) */
    bool conv_plain;                    /* conv2d: square kernel, one group, dilation 1, the same stride and
                                           padding on both axes: nn_conv2d (and its fused forms) runs it */
    Param *weight;                      /* dense (out, in); conv (OC, C/groups, KH, KW); layernorm (D,); batchnorm (C,);
                                           else NULL */
    Param *bias;                        /* (out,) / (OC,) / (D,) / (C,), or NULL */
    /* batchnorm: its running statistics, buffers owned by the module
       (allocated in model_init, freed in model_free; no gradient), and the
       op's state pointing at them. */
    float *running_mean;                /* (C,), starts 0 */
    float *running_var;                 /* (C,), starts 1 */
    int64_t num_batches_tracked;
    BatchNormState bn;
    BnFold bn_folded;                   /* batchnorm: folded into the conv2d/dense before it (PTQ), whatever the
                                           tape's mode; kept in checkpoints */
    ModuleForwardFn forward_hook;       /* NULL = the layer's own op */
    ModuleFusedForwardFn fused_hook;    /* conv2d with a forward_hook: its fused form, or NULL (no fusing) */
    bool fused_residual;                /* fused_hook also takes a residual add before its epilogue (Tape.residual)
                                           in a forward without gradients; set with it by the hook's installer */
    ModuleWeightFn weight_hook;         /* set with forward_hook by a quantized base, or NULL */
    void *hook_ctx;
};

typedef struct {
    int input_ndim, input_shape[3];     /* per example: (C, H, W) or (F,) */
    Module *modules;                    /* [n_modules] */
    int n_modules;
    Param *params;                      /* [n_params], in module order */
    Param **param_list;                 /* [n_params] pointers into params, as optimizers take them */
    int n_params;
    Var **outs;                         /* [n_modules + 1] model_forward's outputs of this pass: [0] the input,
                                           [1 + i] module i's (tape Vars, in the tape's arena) */
    bool keep_outputs;                  /* model_forward leaves every output as computed (no relu in place,
                                           nothing handed back in a pass without gradients): for a caller that
                                           reads outs afterwards. Default false. */
} Model;

const char *layer_type_name(LayerType type);
QtStatus layer_type_parse(const char *name, LayerType *out, QtError *err);
const char *init_kind_name(InitKind kind);
QtStatus init_kind_parse(const char *name, InitKind *out, QtError *err);

/* Infers every module's shapes, names modules and allocates parameters
 * (values and grads, zeroed). Errors name the module and the shapes. */
QtStatus model_init(Model *m, int input_ndim, const int *input_shape, const LayerSpec *layers, int n_layers,
                    QtError *err);
void model_free(Model *m);
/* Initialises every parameter per its layer's InitKind, from rng. */
void model_init_params(Model *m, Rng *rng);

/* x: (N, input_shape...) -> logits (N, out_shape of the last module). */
Var *model_forward(Model *m, Tape *t, Var *x);
/* The module's own layer op on x, ignoring any forward_hook: what a hook
 * that wraps the layer (a LoRA adapter over a float base) calls for the
 * base. x: (N, in_shape...) -> (N, out_shape...). */
Var *model_module_forward(Tape *t, Module *m, Var *x);
/* Runs module i alone (its hook, its own op, or the merge) on the outputs
 * so far, outs[0] the model's input and outs[1 + j] module j's, and stores
 * its output in outs[1 + i]. What model_forward does per module when it
 * does not fuse, and how a caller re-runs a model module by module. */
Var *model_step(Model *m, Tape *t, int i, Var **outs);
/* The module's merge (add, concat) of xs[0..m->n_inputs); relu: an add's last sum relu'd (nn_add_relu). */
Var *model_merge_forward(Tape *t, Module *m, Var *const *xs, bool relu);
/* Whether module i reads the previous module alone: a chain's step. */
bool model_reads_previous(const Model *m, int i);
/* model_graph.c: resolves module i's inputs (its spec's names; none = the
 * previous module) to indices and sets its in_shape (for a merge, the merged
 * shape). layers: the whole list, for the error of a forward reference. */
QtStatus model_graph_resolve(Model *m, int i, const LayerSpec *layers, int n_layers, QtError *err);
/* model_graph.c: counts every module's consumers once all are resolved. */
void model_graph_count_consumers(Model *m);
/* model_graph.c: the last module reading module j's output (n_modules for
 * the last module: the model's output), or -1 if none does. */
int model_graph_last_reader(const Model *m, int j);
/* model_graph.c: whether module i, a relu, may overwrite its input: the
 * input is a batch norm's or an add's own output (neither backward reads
 * it) that only this relu reads. */
bool model_graph_relu_in_place(const Model *m, int i);
/* model_graph.c: whether module j, a relu in place (above), reads a batch norm that runs as nn_batchnorm (no
 * hook, not folded): the two then run as nn_batchnorm_relu and nn_batchnorm_relu_inplace, the relu applied in
 * the batch norm's pass and its mask in the batch norm's backward. model_graph_bn_relu_producer: whether module
 * i is the batch norm of such a pair. */
bool model_graph_bn_relu(const Model *m, int j);
bool model_graph_bn_relu_producer(const Model *m, int i);
/* model_graph.c: whether module i is an unhooked conv2d whose only reader is a batch norm that runs as
 * nn_batchnorm: it then runs as nn_conv2d_bn / nn_conv2d_general_bn, making the batch statistics' plane moments
 * while its output planes are in cache. */
bool model_graph_conv_bn(const Model *m, int i);
/* model_graph.c: whether module i is the batch norm of such a pair (model_graph_bn_relu_producer) whose relu's
 * only reader is an unhooked conv2d of the plain geometry or a depthwise stride-1 one: in training the batch
 * norm then runs as nn_batchnorm_relu_view, its output never written, and the conv reads it through the view. */
bool model_graph_bn_relu_view(const Model *m, int i);
/* model_graph.c: whether module i is a batch norm that runs as nn_batchnorm whose only reader is an unhooked add (a
 * residual block's second batch norm), keep_outputs off: in training it then runs as nn_batchnorm_view, its output
 * never written, and the add makes it as it adds. */
bool model_graph_bn_add_view(const Model *m, int i);
/* model_graph.c: whether module i is an add whose only reader is a relu in place (model_graph_relu_in_place), the
 * next module: the add then runs as nn_add_relu (its last sum relu'd in its pass) and the relu as
 * nn_relu_inplace_applied. (A relu further on is left to run: a conv group fused with the add as its residual in
 * a forward without gradients would skip the add's step.) */
bool model_graph_add_relu(const Model *m, int i);
/* model_graph.c: in a forward without gradients, after modules first..last
 * (a fused group) ran, hands the outputs no later module reads back to the
 * tape for the next outputs (tape_release), so an eval pass holds a few
 * activations instead of all of them. */
void model_graph_release_dead(Model *m, Tape *t, int first, int last);
/* model_graph.c: in a training forward (gradients recorded, keep_outputs
 * off), after module i's op (fused: the head of a fused run, whose output
 * is not a module's): drops the values no backward reads and lets batch
 * norm outputs be made again in the backward (tape_remake_set). */
void model_graph_train_memory(Model *m, Tape *t, int i, bool fused);
/* The Var of a parameter for use on a tape (its value and persistent grad). */
static inline Var *param_var(Param *p) { return &p->var; }

Module *model_find_module(Model *m, const char *path);
Param *model_find_param(Model *m, const char *name);
/* Freezing drops the grad buffer: a frozen parameter costs its value only. */
void param_freeze(Param *p);
QtStatus param_unfreeze(Param *p, QtError *err);
/* Freezes p and frees its value: for a weight whose storage has moved
 * elsewhere (a quantized base). The shape is kept, so counts still see it;
 * the module then needs a forward_hook that does not read it. */
void param_release(Param *p);

size_t model_param_count(const Model *m, bool trainable_only);
/* Whether a module is a batchnorm1d/2d (it holds running statistics). */
bool model_has_batchnorm(const Model *m);
/* Bytes of parameter values (float32) actually held: released params
 * count 0. */
size_t model_param_bytes(const Model *m);
/* Forward FLOPs per example (multiply-adds x 2) of dense and conv layers. */
double model_forward_flops(const Model *m);
/* Multiply-adds per example of a module's forward product: out * in for a
 * dense, OC * OH * OW * (C / groups) * KH * KW for a conv2d (depthwise and
 * grouped alike), 0 for every other layer (their work is elementwise, not
 * a product). The same count for the module's input gradient and weight
 * gradient products. */
double model_module_macs(const Module *m);
/* Multiply-adds per example of a training step's products, by pass. */
typedef struct {
    double forward;     /* every product of the forward */
    double backward_dx; /* input gradients (those of inputs that need one) */
    double backward_dw; /* weight gradients (those of weights that train) */
} StepMacs;
static inline double step_macs_total(const StepMacs *s) { return s->forward + s->backward_dx + s->backward_dw; }
/* A conv2d module's forward from its spec on a given weight w (OC, C/groups,
 * KH, KW): nn_conv2d for the plain geometry, else nn_conv2d_general. What a
 * hook that computes its own weight (quantized, fake-quantized) calls. */
Var *model_conv_forward(Tape *t, const Module *m, Var *x, Var *w, Var *bias);
/* A few lines: one per module with its path, type, output shape, params. */
void model_print(const Model *m, FILE *out);

#endif
