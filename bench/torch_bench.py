#!/usr/bin/python3
"""The PyTorch side of `make bench-torch`.

    torch_bench.py run --config bench/configs/cnn.yaml [--steps N] [--warmup N]
                       [--eval-batches N] [--since-ns NS] [--ptq auto|fx|eager]
    torch_bench.py train --config FILE [--epochs N] [--threads N]
    torch_bench.py table --qtrain DIR --torch DIR [--core NAME]

`run` measures one bench config the way `qtrain bench` does and prints the
same `bench:` lines: the model, data, optimizer, LoRA/QLoRA and PTQ setup
are read from the config itself (see bench/README.md for how each is made
equivalent). Run each measurement in its own process, so that peak RSS and
start-up are per measurement.

`train` trains the config's model as configured on its data and prints the
test accuracy after every epoch (`torch:eval`, `torch:final` lines): the
PyTorch reference an accuracy of qtrain's is compared with.

`table` reads the outputs of bench/run.sh (one <config>.txt per config in
each directory) and prints the side-by-side table with the targets.

Needs Debian's python3-torch (with numpy and yaml).
"""
import argparse
import gzip
import math
import os
import re
import resource
import sys
import time
from collections import OrderedDict

# Before torch loads OpenBLAS: PyTorch parallelises with its own threads
# (torch.set_num_threads); OpenBLAS threads on top would oversubscribe.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

EVAL_WARMUP = 2

# bitsandbytes' NF4 code book (the values of quant/qtype.c).
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def fail(msg):
    print("torch_bench: error: " + msg, file=sys.stderr)
    sys.exit(2)


# ---- config --------------------------------------------------------------------------------------------

def load_config(path):
    import yaml
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f)
    except OSError as e:
        fail("cannot read %s: %s" % (path, e))
    for key in ("run", "data", "model", "train"):
        cfg.setdefault(key, {})
    return cfg


def first_rule(rules, path, layer_type):
    """The first rule whose module_path fully matches and whose op_types (if any) list the type."""
    for r in rules or []:
        if not re.fullmatch(r["module_path"], path):
            continue
        if r.get("op_types") and layer_type not in r["op_types"]:
            continue
        return None if r.get("skip") else r
    return None


# ---- data: IDX files, kept as bytes, converted per batch ------------------------------------------------

def read_idx(path):
    import numpy as np
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


class Data:
    """Images as uint8 (N, 28, 28) and the affine pixel map x = scale * p + shift, as data/dataset.h keeps them."""

    def __init__(self, cfg):
        import numpy as np
        d = cfg["data"]
        root = d.get("dir", "/usr/share/datasets/fashion-mnist")

        def pair(prefix):
            paths = []
            for kind in ("images-idx3", "labels-idx1"):
                p = os.path.join(root, "%s-%s-ubyte.gz" % (prefix, kind))
                paths.append(p if os.path.exists(p) else p[:-3])
            return read_idx(paths[0]), read_idx(paths[1]).astype(np.int64)

        self.train_x, self.train_y = pair("train")
        self.test_x, self.test_y = pair("t10k")
        self.scale, self.shift = 1.0 / 255.0, 0.0
        for t in d.get("transform", []) or []:
            name, arg = (t, None) if isinstance(t, str) else next(iter(t.items()))
            if name == "normalize":
                if arg and ("mean" in arg or "std" in arg):
                    mean, std = float(arg["mean"]), float(arg["std"])
                else:  # measured on the training set as transformed so far: every pixel, population std
                    counts = np.bincount(self.train_x.reshape(-1), minlength=256).astype(np.float64)
                    v = np.arange(256, dtype=np.float64)
                    n = counts.sum()
                    mp = (counts * v).sum() / n
                    sp = math.sqrt(max((counts * (v - mp) ** 2).sum() / n, 0.0))
                    mean, std = self.scale * mp + self.shift, abs(self.scale) * sp
                self.scale /= std
                self.shift = (self.shift - mean) / std
            elif name == "invert":
                self.scale, self.shift = -self.scale, 1.0 - self.shift
            elif name == "transpose":
                self.train_x = np.ascontiguousarray(self.train_x.transpose(0, 2, 1))
                self.test_x = np.ascontiguousarray(self.test_x.transpose(0, 2, 1))
            elif name == "classes":  # keep these labels, relabelled 0..k-1 in the listed order
                keep = np.isin(self.train_y, arg), np.isin(self.test_y, arg)
                relabel = np.full(256, -1, dtype=np.int64)
                relabel[list(arg)] = np.arange(len(arg))
                self.train_x, self.train_y = self.train_x[keep[0]], relabel[self.train_y[keep[0]]]
                self.test_x, self.test_y = self.test_x[keep[1]], relabel[self.test_y[keep[1]]]
            elif name == "limit":
                self.train_x, self.train_y = self.train_x[:arg], self.train_y[:arg]
                self.test_x, self.test_y = self.test_x[:arg], self.test_y[:arg]
            else:
                fail("data transform %r is not supported here" % name)
        n_val = int(round(float(d.get("val_fraction", 0.0)) * len(self.train_x)))
        self.val_x, self.val_y = self.train_x[len(self.train_x) - n_val:], self.train_y[len(self.train_x) - n_val:]
        if n_val:
            self.train_x, self.train_y = self.train_x[:-n_val], self.train_y[:-n_val]

    def batch(self, images, labels, idx, input_shape):
        import torch
        x = torch.from_numpy(images[idx]).reshape((len(idx),) + tuple(input_shape))
        return x.float().mul_(self.scale).add_(self.shift), torch.from_numpy(labels[idx])


class Batcher:
    """Shuffled batches of the training set, a new order every epoch."""

    def __init__(self, data, cfg, input_shape):
        import numpy as np
        self.data, self.input_shape = data, input_shape
        self.bs = int(cfg["train"].get("batch_size", 64))
        self.shuffle = bool(cfg["data"].get("shuffle", True))
        self.drop_last = bool(cfg["data"].get("drop_last", False))
        self.rng = np.random.default_rng(int(cfg["run"].get("seed", 1)))
        self.order, self.cursor = None, len(data.train_x)

    def next(self):
        import numpy as np
        n = len(self.data.train_x)
        left = n - self.cursor
        if left <= 0 or (self.drop_last and left < self.bs):
            self.order = self.rng.permutation(n) if self.shuffle else np.arange(n)
            self.cursor = 0
        idx = self.order[self.cursor:self.cursor + self.bs]
        self.cursor += len(idx)
        return self.data.batch(self.data.train_x, self.data.train_y, idx, self.input_shape)


# ---- model -------------------------------------------------------------------------------------------

def pair_hw(v, key):
    """An int or [h, w] of a conv2d key as (h, w)."""
    if isinstance(v, int):
        return v, v
    if isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v):
        return v[0], v[1]
    fail("conv2d %s %r: an integer or [h, w] expected" % (key, v))


def layer_name(spec, i):
    return spec.get("name") or "%s%d" % (spec["type"], i)


def init_weight(mod, spec):
    """model.layers[].init: default (PyTorch's, already applied), xavier_uniform, xavier_normal, normal."""
    import torch.nn as nn
    kind = spec.get("init", "default")
    if kind == "xavier_uniform":
        nn.init.xavier_uniform_(mod.weight)
    elif kind == "xavier_normal":
        nn.init.xavier_normal_(mod.weight)
    elif kind == "normal":
        nn.init.normal_(mod.weight, std=float(spec.get("init_std", 0.02)))
    elif kind != "default":
        fail("init %r is not supported here" % kind)


def make_graph_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class GlobalAvgPool(nn.Module):
        """(N, C, H, W) -> (N, C): the mean over H and W, as qtrain's globalavgpool (traced through by FX)."""

        def forward(self, x):
            return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)

    class Graph(nn.Module):
        """The config's layers evaluated in config order, each reading the named outputs it lists (default: the
        previous layer's, the model's input for the first). The plan is a fixed Python list, so FX traces the
        forward into a flat graph of the modules (named as qtrain names them), adds and concatenations."""

        def __init__(self, plan, modules):
            super().__init__()
            self.plan = plan  # [(name, type, [input index, -1 = the model's input])]
            for name, mod in modules.items():
                self.add_module(name, mod)

        def forward(self, x):
            outs = []
            for name, t, inputs in self.plan:
                xs = [x if k < 0 else outs[k] for k in inputs]
                if t == "add":
                    y = xs[0]
                    for z in xs[1:]:
                        y = y + z
                elif t == "concat":
                    y = torch.cat(xs, 1)
                else:
                    y = getattr(self, name)(xs[0])
                outs.append(y)
            return outs[-1]

    return GlobalAvgPool, Graph


def build_model(cfg):
    """The config's model, its modules named as qtrain names them ("<type><index>" unless named): an
    nn.Sequential when every layer reads the one before (as the mlp and cnn configs), else a Graph.
    Returns (model, {name: type}, desc) with desc as qtrain bench names the model, e.g. "conv32-conv64-dense10"."""
    import torch.nn as nn
    GlobalAvgPool, Graph = make_graph_classes()
    m = cfg["model"]
    in_shape = list(m["input"])
    specs = m["layers"]
    names = [layer_name(s, i) for i, s in enumerate(specs)]
    shapes, plan, modules, types, desc = [], [], OrderedDict(), OrderedDict(), []
    chain = True
    for i, spec in enumerate(specs):
        t, name = spec["type"], names[i]
        if "inputs" in spec:
            chain = False
            inputs = []
            for n in spec["inputs"]:
                if n in names[:i]:
                    inputs.append(names.index(n))
                elif n == "input" and n not in names:
                    inputs.append(-1)
                else:
                    fail("layer %s reads %r, which is no earlier layer" % (name, n))
        else:
            inputs = [i - 1]
        ins = [in_shape if k < 0 else shapes[k] for k in inputs]
        shape = list(ins[0])
        mod = None
        bias = spec.get("bias", True)
        if t == "conv2d":
            kh, kw = pair_hw(spec["kernel"], "kernel")
            sh, sw = pair_hw(spec.get("stride", 1), "stride")
            dh, dw = pair_hw(spec.get("dilation", 1), "dilation")
            groups = int(spec.get("groups", 1))
            if spec.get("padding", 0) == "same":
                # an even total padding as explicit numbers (the same result; PyTorch's quantized conv2d takes
                # only numbers), an odd one as "same" (its extra row and column at the bottom and right)
                ext_h, ext_w = dh * (kh - 1), dw * (kw - 1)
                padding = (ext_h // 2, ext_w // 2) if ext_h % 2 == 0 and ext_w % 2 == 0 else "same"
            else:
                ph, pw = pair_hw(spec.get("padding", 0), "padding")
                padding = (ph, pw)
                ext_h, ext_w = dh * (kh - 1) - 2 * ph, dw * (kw - 1) - 2 * pw
            oc = spec["out_channels"]
            mod = nn.Conv2d(shape[0], oc, (kh, kw), stride=(sh, sw), padding=padding, dilation=(dh, dw),
                            groups=groups, bias=bias)
            init_weight(mod, spec)
            if spec.get("padding", 0) == "same":
                shape = [oc, shape[1], shape[2]]
            else:
                shape = [oc, (shape[1] - ext_h - 1) // sh + 1, (shape[2] - ext_w - 1) // sw + 1]
            desc.append("conv%d" % oc)
        elif t == "dense":
            mod = nn.Linear(shape[0], spec["units"], bias=bias)
            init_weight(mod, spec)
            shape = [spec["units"]]
            desc.append("dense%d" % spec["units"])
        elif t in ("relu", "gelu", "tanh", "sigmoid"):
            mod = {"relu": nn.ReLU, "gelu": lambda: nn.GELU(approximate="tanh"), "tanh": nn.Tanh,
                   "sigmoid": nn.Sigmoid}[t]()
        elif t in ("maxpool2d", "avgpool2d"):
            k = spec["kernel"]
            s = spec.get("stride", k)
            mod = (nn.MaxPool2d if t == "maxpool2d" else nn.AvgPool2d)(k, stride=s)
            shape = [shape[0], (shape[1] - k) // s + 1, (shape[2] - k) // s + 1]
        elif t == "flatten":
            mod = nn.Flatten()
            shape = [math.prod(shape)]
        elif t == "dropout":
            mod = nn.Dropout(spec.get("p", 0.5))
        elif t == "layernorm":
            mod = nn.LayerNorm(shape[-1], eps=float(spec.get("eps", 1e-5)))
        elif t in ("batchnorm1d", "batchnorm2d"):
            mod = (nn.BatchNorm1d if t == "batchnorm1d" else nn.BatchNorm2d)(
                shape[0], eps=float(spec.get("eps", 1e-5)), momentum=float(spec.get("momentum", 0.1)),
                affine=bool(spec.get("affine", True)))
        elif t == "globalavgpool":
            mod = GlobalAvgPool()
            shape = [shape[0]]
        elif t == "add":
            pass
        elif t == "concat":
            shape[0] = sum(s[0] for s in ins)
        else:
            fail("layer type %r is not supported here" % t)
        if mod is not None:
            if "." in name:
                fail("layer name %r: a '.' cannot name a PyTorch module" % name)
            modules[name] = mod
        shapes.append(shape)
        plan.append((name, t, inputs))
        types[name] = t
    model = nn.Sequential(modules) if chain and len(modules) == len(specs) else Graph(plan, modules)
    return model, types, "-".join(desc) or "none"


def make_lora_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class NF4Weight(nn.Module):
        """A frozen weight as nf4 codes, two per byte (element 2k in the high nibble), with a float absmax per
        block of `block` consecutive elements; with double quantization those absmaxes are 8-bit codes into a
        256-entry table, times a float per 256 of them, plus their mean. Dequantized on every forward."""

        def __init__(self, w, block, double_quant):
            super().__init__()
            self.shape, self.block = tuple(w.shape), block
            flat = w.detach().reshape(-1, block)
            absmax = flat.abs().amax(1).clamp_min(1e-12)
            table = torch.tensor(NF4)
            codes = (flat / absmax[:, None]).unsqueeze(-1).sub(table).abs().argmin(-1).to(torch.uint8).reshape(-1)
            self.register_buffer("table", table)
            self.register_buffer("packed", (codes[0::2] << 4) | codes[1::2])
            self.double_quant = double_quant
            if double_quant:
                dyn = dynamic_map()
                self.register_buffer("dyn", dyn)
                self.offset = float(absmax.mean())
                c = absmax - self.offset
                nb = (len(c) + 255) // 256
                pad = torch.zeros(nb * 256 - len(c))
                cb = torch.cat([c, pad]).reshape(nb, 256)
                amax = cb.abs().amax(1).clamp_min(1e-12)
                q = (cb / amax[:, None]).unsqueeze(-1).sub(dyn).abs().argmin(-1).to(torch.uint8)
                self.register_buffer("absmax_codes", q.reshape(-1)[:len(c)])
                self.register_buffer("absmax_scale", amax)
                self.n_blocks = len(c)
            else:
                self.register_buffer("absmax", absmax)

        def forward(self):
            codes = torch.stack((self.packed >> 4, self.packed & 15), -1).reshape(-1).long()
            if self.double_quant:
                scale = self.absmax_scale.repeat_interleave(256)[:self.n_blocks]
                absmax = self.dyn[self.absmax_codes.long()] * scale + self.offset
            else:
                absmax = self.absmax
            return (self.table[codes].reshape(-1, self.block) * absmax[:, None]).reshape(self.shape)

    class LoraLayer(nn.Module):
        """y = base(x) + alpha/rank * B(A(x)) over a frozen base (float, or nf4 with qweight)."""

        def __init__(self, base, rank, alpha, qweight=None):
            super().__init__()
            self.base, self.scale, self.qweight = base, alpha / rank, qweight
            for p in base.parameters():
                p.requires_grad_(False)
            self.conv = isinstance(base, nn.Conv2d)
            if self.conv:
                # PEFT's grouped shapes: A [r, C_in/groups, kh, kw] and B [C_out, r/groups, 1, 1], both grouped
                oc, c, kh, kw = base.weight.shape
                g = base.groups
                if g > 1 and g == base.in_channels:
                    fail("LoRA on a depthwise conv2d is not supported (adapt the pointwise conv after it)")
                if rank % g:
                    fail("LoRA rank %d is not divisible by the conv2d's groups %d" % (rank, g))
                a = torch.empty(rank, c, kh, kw)
                self.B = nn.Parameter(torch.zeros(oc, rank // g, 1, 1))
            else:
                a = torch.empty(rank, base.in_features)
                self.B = nn.Parameter(torch.zeros(base.out_features, rank))
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # U(+-1/sqrt(fan_in)), as qtrain and PEFT
            self.A = nn.Parameter(a)
            if qweight is not None:
                base.weight = None  # the base keeps only its bias; the weight lives as nf4

        def forward(self, x):
            b = self.base
            w = self.qweight() if self.qweight is not None else b.weight
            if self.conv:
                y = F.conv2d(x, w, b.bias, b.stride, b.padding, b.dilation, b.groups)
                a = F.conv2d(x, self.A, None, b.stride, b.padding, b.dilation, b.groups)
                return y + self.scale * F.conv2d(a, self.B, None, 1, 0, 1, b.groups)
            return F.linear(x, w, b.bias) + self.scale * F.linear(F.linear(x, self.A), self.B)

    return NF4Weight, LoraLayer


def dynamic_map():
    """The 256-entry signed table of double quantization (quant/qarray_dq.c builds the same values)."""
    import torch
    v = []
    for k in range(7):
        parts = 1 << k
        for j in range(parts):
            p = 10.0 ** (k - 6) * (0.1 + (j + 0.5) * 0.9 / parts)
            v += [p, -p]
    v += [0.0, 1.0]
    return torch.tensor(sorted(v), dtype=torch.float32)


def apply_lora(model, types, cfg):
    """Adapters per lora.rules, the quant.rules' nf4 base under them, lora.trainable modules trained in full."""
    lora = cfg.get("lora") or {}
    quant = cfg.get("quant") or {}
    ptq = quant.get("mode") == "ptq"
    trainable = set(lora.get("trainable") or [])
    NF4Weight, LoraLayer = make_lora_classes()
    for name, mod in list(model.named_children()):
        for p in mod.parameters():
            p.requires_grad_(name in trainable)
        if types[name] not in ("dense", "conv2d") or name in trainable:
            continue
        qrule = first_rule(quant.get("rules"), name, types[name]) if ptq else None
        qweight = None
        if qrule and qrule.get("weight_qtype", "none") != "none":
            if qrule["weight_qtype"] != "nf4":
                fail("%s: only nf4 bases are emulated under LoRA here" % name)
            qweight = NF4Weight(mod.weight, int(qrule.get("tile_size", 64)), bool(qrule.get("double_quant")))
        rule = first_rule(lora.get("rules"), name, types[name])
        if rule:
            if float(rule.get("dropout", 0.0)) > 0:
                fail("%s: LoRA dropout is not supported here" % name)
            setattr(model, name, LoraLayer(mod, int(rule["rank"]), float(rule.get("alpha", rule["rank"])), qweight))
        elif qweight is not None:
            fail("%s: a quantized module without an adapter is not supported here" % name)


def make_optimizer(params, cfg):
    import torch
    o = cfg["train"].get("optimizer", {}) or {}
    name = o.get("name", "adamw")
    lr = float(o.get("lr", 1e-3 if name == "adamw" else 0.01))  # qtrain's defaults per optimizer
    if name == "adamw":
        betas = tuple(o.get("betas", (0.9, 0.999)))
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=float(o.get("eps", 1e-8)),
                                 weight_decay=float(o.get("weight_decay", 0.01)))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(o.get("momentum", 0.0)),
                               dampening=float(o.get("dampening", 0.0)), weight_decay=float(o.get("weight_decay", 0.0)),
                               nesterov=bool(o.get("nesterov", False)))
    fail("optimizer %r is not supported here" % name)


def quantize_int8(model, types, data, cfg, input_shape, fx=None):
    """Static post-training quantization (onednn), observers calibrated on the first quant.calibration_batches
    training batches in file order. The models of the old layer set (a chain of conv2d/dense/relu/pools/flatten/
    dropout, as the mlp and cnn configs) go through eager mode: conv/dense + relu fused, the chain between a
    QuantStub and a DeQuantStub. The others (batch norm, globalavgpool, add/concat; or fx=True) through FX graph
    mode: prepare_fx folds each batch norm into the conv before it (conv + bn (+ relu) fused), quantizes the adds
    and concatenations and the pools between them, convert_fx makes the int8 modules."""
    import numpy as np
    import torch
    import torch.ao.quantization as tq
    quant = cfg.get("quant") or {}
    for name, t in types.items():
        if t in ("dense", "conv2d"):
            r = first_rule(quant.get("rules"), name, t)
            if not r or r.get("weight_qtype") != "int8" or r.get("act_qtype") not in ("int8", "uint8"):
                fail("%s: PTQ here is int8 weights and int8 activations on every conv/dense" % name)
    if not quant.get("fold_bn", True):
        fail("quant.fold_bn: false is not emulated here (PyTorch's PTQ folds every batch norm)")
    torch.backends.quantized.engine = "onednn"
    if fx is None:
        fx = not isinstance(model, torch.nn.Sequential) or any(
            t not in ("dense", "conv2d", "relu", "maxpool2d", "flatten", "dropout") for t in types.values())
    model.eval()
    bs = int(cfg["train"].get("batch_size", 64))
    batches = min(int(quant.get("calibration_batches", 16)), len(data.train_x) // bs)

    def calibrate(m):
        with torch.inference_mode():
            for b in range(batches):
                x, _ = data.batch(data.train_x, data.train_y, np.arange(b * bs, (b + 1) * bs), input_shape)
                m(x)

    if fx:
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
        kw = {}
        try:
            from torch.ao.quantization.backend_config import get_onednn_backend_config
            kw["backend_config"] = get_onednn_backend_config()
        except ImportError:
            pass
        # onednn's FX patterns have no nn.Flatten (it would dequantize around it); torch.flatten shares its
        # input's quantization, as eager mode's nn.Flatten does
        class Flatten(torch.nn.Module):
            def forward(self, x):
                return torch.flatten(x, 1)

        for name, mod in list(model.named_children()):
            if isinstance(mod, torch.nn.Flatten):
                setattr(model, name, Flatten())
        example = torch.zeros((1,) + tuple(input_shape))
        prepared = prepare_fx(model, tq.get_default_qconfig_mapping("onednn"), (example,), **kw)
        calibrate(prepared)
        return convert_fx(prepared, **kw)
    names = list(types)
    fuse = [[a, b] for a, b in zip(names, names[1:]) if types[a] in ("dense", "conv2d") and types[b] == "relu"]
    tq.fuse_modules(model, fuse, inplace=True)
    wrapped = torch.nn.Sequential(OrderedDict([("quant", tq.QuantStub()), ("net", model),
                                               ("dequant", tq.DeQuantStub())]))
    wrapped.qconfig = tq.get_default_qconfig("onednn")
    tq.prepare(wrapped, inplace=True)
    calibrate(wrapped)
    tq.convert(wrapped, inplace=True)
    return wrapped


# ---- measurements ------------------------------------------------------------------------------------

def startup_s(first_ns, since_ns):
    if since_ns:
        return (first_ns - since_ns) * 1e-9, "since-ns"
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - (time.time_ns() - first_ns) * 1e-9 - start, "proc-stat"


def train_step(model, opt, params, x, y, grad_clip):
    """One optimizer step of the mean cross-entropy on (x, y), gradients clipped to norm grad_clip if > 0 (as
    qtrain's train.grad_clip); returns the loss before the step (a tensor)."""
    import torch
    import torch.nn.functional as F
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def bench_train(model, opt, batcher, grad_clip, args, desc, mode, state):
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()

    def step():
        x, y = batcher.next()
        return float(train_step(model, opt, params, x, y, grad_clip))

    for _ in range(args.warmup):
        state.setdefault("first_ns", time.time_ns())
        step()
    ms = []
    t_begin = time.perf_counter()
    loss = float("nan")
    for _ in range(args.steps):
        state.setdefault("first_ns", time.time_ns())
        t0 = time.perf_counter()
        loss = step()
        ms.append((time.perf_counter() - t0) * 1e3)
    timed = time.perf_counter() - t_begin
    ms.sort()
    print("bench:train model:%s mode:%s batch:%d steps:%d warmup:%d samples_per_s:%.1f step_ms:%.3f "
          "step_ms_median:%.3f step_ms_min:%.3f loss:%.4f" % (desc, mode, batcher.bs, args.steps, args.warmup,
                                                               args.steps * batcher.bs / timed,
                                                               timed * 1e3 / args.steps, ms[len(ms) // 2], ms[0],
                                                               loss))


def bench_eval(model, data, bs, args, desc, mode, input_shape, state):
    import numpy as np
    import torch
    import torch.nn.functional as F
    model.eval()
    bs = min(bs, len(data.test_x))
    pos = [0]

    def batch():
        if pos[0] + bs > len(data.test_x):
            pos[0] = 0
        x, y = data.batch(data.test_x, data.test_y, np.arange(pos[0], pos[0] + bs), input_shape)
        pos[0] += bs
        logits = model(x)
        return float(F.cross_entropy(logits, y)) * bs, int((logits.argmax(1) == y).sum())

    with torch.inference_mode():
        for _ in range(EVAL_WARMUP):
            state.setdefault("first_ns", time.time_ns())
            batch()
        ms = []
        t_begin = time.perf_counter()
        for _ in range(args.eval_batches):
            t0 = time.perf_counter()
            batch()
            ms.append((time.perf_counter() - t0) * 1e3)
        timed = time.perf_counter() - t_begin
    ms.sort()
    print("bench:eval model:%s mode:%s batch:%d batches:%d samples_per_s:%.1f batch_ms:%.3f batch_ms_median:%.3f "
          "batch_ms_min:%.3f" % (desc, mode, bs, args.eval_batches, args.eval_batches * bs / timed,
                                 timed * 1e3 / args.eval_batches, ms[len(ms) // 2], ms[0]))


def cmd_run(args):
    import torch
    cfg = load_config(args.config)
    threads = int(cfg["run"].get("threads", 0)) or os.cpu_count()
    torch.set_num_threads(threads)
    torch.manual_seed(int(cfg["run"].get("seed", 1)))
    data = Data(cfg)
    input_shape = list(cfg["model"]["input"])
    model, types, desc = build_model(cfg)
    quant = (cfg.get("quant") or {}).get("mode", "none")
    has_lora = bool((cfg.get("lora") or {}).get("rules") or (cfg.get("lora") or {}).get("trainable"))
    epochs = int(cfg["train"].get("epochs", 1))
    trains = int(cfg["train"].get("steps", 0)) > 0 or epochs > 0
    if quant == "ptq" and not has_lora:
        mode, trains = "ptq", False
        model = quantize_int8(model, types, data, cfg, input_shape, {"fx": True, "eager": False}.get(args.ptq))
        for p in model.parameters():  # inference only (a batch norm that cannot fold keeps float parameters)
            p.requires_grad_(False)
    elif quant in ("none", None):
        mode = "lora" if has_lora else "float"
        if has_lora:
            apply_lora(model, types, cfg)
    elif quant == "ptq":
        mode = "qlora"
        apply_lora(model, types, cfg)
    else:
        fail("quant.mode %s is not supported here" % quant)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print("bench:config name:%s config:%s model:%s mode:%s batch:%d eval_batch:%d threads:%d params_trainable:%d "
          "impl:pytorch-%s" % (cfg["run"].get("name", "run"), args.config, desc, mode,
                               int(cfg["train"].get("batch_size", 64)), int(cfg["train"].get("eval_batch_size", 256)),
                               torch.get_num_threads(), trainable, torch.__version__))
    print("bench:blas core:%s threads:%s" % (os.environ.get("OPENBLAS_CORETYPE", "auto"),
                                             os.environ.get("OPENBLAS_NUM_THREADS")))
    sys.stdout.flush()
    state = {}
    if trains:
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
        bench_train(model, opt, Batcher(data, cfg, input_shape), float(cfg["train"].get("grad_clip", 0.0)), args,
                    desc, mode, state)
    if args.eval_batches > 0:
        bench_eval(model, data, int(cfg["train"].get("eval_batch_size", 256)), args, desc, mode, input_shape, state)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print("bench:mem peak_rss_mb:%.1f" % rss)
    if "first_ns" in state:
        s, clock = startup_s(state["first_ns"], args.since_ns)
        print("bench:startup first_step_s:%.3f first:%s clock:%s" % (s, "train" if trains else "eval", clock))


# ---- reference training ------------------------------------------------------------------------------

def lr_at(cfg, step, total):
    """train.schedule's lr at optimizer step `step` (0-based) of `total`, as nn/schedule.c computes it."""
    o = cfg["train"].get("optimizer", {}) or {}
    base = float(o.get("lr", 1e-3 if o.get("name", "adamw") == "adamw" else 0.01))
    s = cfg["train"].get("schedule", {}) or {}
    kind = s.get("name", "constant")
    warmup = min(int(s.get("warmup_steps", 0)), total)  # clamped to the run, as qtrain does
    if step < warmup:
        return base * (step + 1) / warmup
    after = step - warmup
    if kind == "cosine":
        span = total - warmup
        p = min(after / span, 1.0) if span > 0 else 1.0
        lo = float(s.get("min_lr", 0.0))
        return lo + 0.5 * (base - lo) * (1.0 + math.cos(math.pi * p))
    if kind == "step":
        return base * float(s.get("gamma", 0.1)) ** (after // int(s["step_size"]))
    if kind != "constant":
        fail("lr schedule %r is not supported here" % kind)
    return base


def load_init_from(model, path):
    """model.init_from: /params/<module>/<weight|bias> and a batch norm's /buffers/<module>/<statistic>."""
    import h5py
    import torch
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        fail("model.init_from %s: %s" % (path, e))
    with f:
        for key, t in list(model.state_dict(keep_vars=True).items()):
            mod, leaf = key.rsplit(".", 1)
            group = "buffers" if leaf in ("running_mean", "running_var", "num_batches_tracked") else "params"
            name = "/%s/%s/%s" % (group, mod, leaf)
            if name not in f or not isinstance(f[name], h5py.Dataset):
                fail("model.init_from %s: no dataset %s (a float checkpoint of this model expected)" % (path, name))
            v = torch.as_tensor(f[name][()]).reshape(t.shape).to(t.dtype)
            with torch.no_grad():
                t.copy_(v)


def evaluate(model, data, x_all, y_all, bs, input_shape):
    """(accuracy, mean loss) over a whole split, in eval mode."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    model.eval()
    loss, correct = 0.0, 0
    with torch.inference_mode():
        for a in range(0, len(x_all), bs):
            x, y = data.batch(x_all, y_all, np.arange(a, min(a + bs, len(x_all))), input_shape)
            logits = model(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
    model.train()
    n = max(len(x_all), 1)
    return correct / n, loss / n


def cmd_train(args):
    """Trains the config's model as configured (optimizer, schedule, batch, epochs or steps, seed, transforms,
    grad clipping, dropout) on the config's data and prints the test accuracy after every epoch."""
    import numpy as np
    import torch
    cfg = load_config(args.config)
    if args.epochs is not None:
        cfg["train"]["epochs"], cfg["train"]["steps"] = args.epochs, 0
    threads = args.threads or int(cfg["run"].get("threads", 0)) or os.cpu_count()
    torch.set_num_threads(threads)
    seed = int(cfg["run"].get("seed", 1))
    torch.manual_seed(seed)
    data = Data(cfg)
    input_shape = list(cfg["model"]["input"])
    model, types, desc = build_model(cfg)
    if cfg["model"].get("init_from"):
        load_init_from(model, cfg["model"]["init_from"])
    quant = (cfg.get("quant") or {}).get("mode", "none") or "none"
    lora = cfg.get("lora") or {}
    has_lora = bool(lora.get("rules") or lora.get("trainable"))
    if quant not in ("none", "ptq") or (quant == "ptq" and not has_lora):
        fail("train: quant.mode %s is not trained here (float, LoRA and QLoRA configs are)" % quant)
    mode = ("qlora" if quant == "ptq" else "lora") if has_lora else "float"
    if has_lora:
        apply_lora(model, types, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg)
    bs = int(cfg["train"].get("batch_size", 64))
    ebs = int(cfg["train"].get("eval_batch_size", 256))
    shuffle = bool(cfg["data"].get("shuffle", True))
    drop_last = bool(cfg["data"].get("drop_last", False))
    grad_clip = float(cfg["train"].get("grad_clip", 0.0))
    n = len(data.train_x)
    per_epoch = n // bs if drop_last else (n + bs - 1) // bs
    if per_epoch < 1:
        fail("train: %d training examples make no batch of %d" % (n, bs))
    steps = int(cfg["train"].get("steps", 0))
    total = steps if steps > 0 else int(cfg["train"].get("epochs", 1)) * per_epoch
    print("torch:config name:%s config:%s model:%s mode:%s train:%d val:%d test:%d batch:%d steps:%d "
          "steps_per_epoch:%d threads:%d params_trainable:%d impl:pytorch-%s" %
          (cfg["run"].get("name", "run"), args.config, desc, mode, n, len(data.val_x), len(data.test_x), bs, total,
           per_epoch, torch.get_num_threads(), sum(p.numel() for p in params), torch.__version__))
    sys.stdout.flush()
    log_every = int(cfg["train"].get("log_every", 50))
    rng = np.random.default_rng(seed)
    model.train()
    step, epoch, train_s, seen = 0, 0, 0.0, 0
    test_acc = test_loss = float("nan")
    while step < total:
        order = rng.permutation(n) if shuffle else np.arange(n)
        epoch += 1
        t0 = time.perf_counter()
        loss_sum, loss_n = 0.0, 0
        for b in range(per_epoch):
            if step >= total:
                break
            x, y = data.batch(data.train_x, data.train_y, order[b * bs:(b + 1) * bs], input_shape)
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step, total)
            loss = train_step(model, opt, params, x, y, grad_clip)
            loss_sum += float(loss) * len(y)
            loss_n += len(y)
            seen += len(y)
            step += 1
            if log_every and step % log_every == 0:
                print("torch:step step:%d/%d epoch:%d loss:%.4f lr:%.6g elapsed_s:%.1f" %
                      (step, total, epoch, float(loss), opt.param_groups[0]["lr"], train_s + time.perf_counter() - t0))
                sys.stdout.flush()
        train_s += time.perf_counter() - t0
        val = ""
        if len(data.val_x):
            va, vl = evaluate(model, data, data.val_x, data.val_y, ebs, input_shape)
            val = " val_acc:%.4f val_loss:%.4f" % (va, vl)
        test_acc, test_loss = evaluate(model, data, data.test_x, data.test_y, ebs, input_shape)
        print("torch:eval epoch:%d step:%d train_loss:%.4f%s test_acc:%.4f test_loss:%.4f" %
              (epoch, step, loss_sum / max(loss_n, 1), val, test_acc, test_loss))
        sys.stdout.flush()
    if total == 0:  # train.epochs 0: evaluate only
        test_acc, test_loss = evaluate(model, data, data.test_x, data.test_y, ebs, input_shape)
        print("torch:eval epoch:0 step:0 test_acc:%.4f test_loss:%.4f" % (test_acc, test_loss))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print("torch:final model:%s epochs:%d steps:%d test_acc:%.4f test_loss:%.4f samples_per_s:%.1f train_s:%.1f "
          "peak_rss_mb:%.1f" % (desc, epoch, step, test_acc, test_loss, seen / train_s if train_s else 0.0, train_s,
                                rss))


# ---- the side-by-side table ---------------------------------------------------------------------------

def parse_bench(path):
    """{line kind: {key: value}} of a bench output file; {} if it is missing."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("bench:"):
                    kind, *rest = line.split()
                    out[kind[6:]] = dict(kv.split(":", 1) for kv in rest if ":" in kv)
    except OSError:
        pass
    return out


def num(d, kind, key):
    try:
        return float(d[kind][key])
    except (KeyError, ValueError):
        return None


def fmt(v, unit=""):
    if v is None:
        return "-"
    if unit == "s":
        return "%.3f" % v
    if unit == "share":
        return "%.2f" % v
    return "%.0f" % v if v >= 100 else "%.1f" % v


# A figure whose mean step is this much above its median step was pulled
# down by a few slow steps (on a shared machine, usually other processes).
NOISY = 1.25


def noisy(d, kind):
    mean_key = {"train": "step_ms", "eval": "batch_ms"}.get(kind)
    mean, median = (num(d, kind, mean_key), num(d, kind, mean_key + "_median")) if mean_key else (None, None)
    return mean is not None and median and mean > NOISY * median


def cmd_table(args):
    q = {n: parse_bench(os.path.join(args.qtrain, n + ".txt")) for n in CONFIGS}
    t = {n: parse_bench(os.path.join(args.torch, n + ".txt")) for n in CONFIGS}
    rows = []

    def ratio(a, b):
        return a / b if a is not None and b else None

    def row(what, model, cfg, kind, key, unit="", target="", met=None):
        a, b = num(q[cfg], kind, key), num(t[cfg], kind, key)
        r = ratio(a, b)
        mark = key == "samples_per_s"
        fa = fmt(a, unit) + ("*" if mark and a is not None and noisy(q[cfg], kind) else "")
        fb = fmt(b, unit) + ("*" if mark and b is not None and noisy(t[cfg], kind) else "")
        rows.append((what, model, fa, fb, "-" if r is None else "%.2fx" % r, target,
                     "" if met is None else ("yes" if met(a, b, r) else "NO")))

    def ge(x):
        return lambda a, b, r: r is not None and r >= x

    def step_ratio(cfg_a, cfg_b):
        return ratio(num(q[cfg_a], "train", "step_ms"), num(q[cfg_b], "train", "step_ms"))

    for m in MODELS:
        row("train samples/s", m, m, "train", "samples_per_s", target=">= 2.0x PyTorch", met=ge(2.0))
    for m in MODELS:
        row("eval samples/s", m, m, "eval", "samples_per_s")
    for m in ("mlp", "cnn"):
        r = step_ratio(m + "-lora", m)
        tgt = "LoRA/full step %s (<= 0.75)" % ("-" if r is None else "%.2f" % r)
        row("LoRA step samples/s", m, m + "-lora", "train", "samples_per_s", target=tgt if m == "cnn" else "",
            met=(lambda a, b, _r, r=r: r is not None and r <= 0.75) if m == "cnn" else None)
    for m in ("mlp", "cnn"):
        r = step_ratio(m + "-qlora", m + "-lora")
        row("QLoRA step samples/s", m, m + "-qlora", "train", "samples_per_s",
            target="QLoRA/LoRA step %s (<= 1.15)" % ("-" if r is None else "%.2f" % r),
            met=lambda a, b, _r, r=r: r is not None and r <= 1.15)
    for m in MODELS:
        row("PTQ int8 eval samples/s", m, m + "-ptq-int8", "eval", "samples_per_s", target=">= 1.0x PyTorch",
            met=ge(1.0))
    for m in MODELS:
        row("peak RSS MB (training)", m, m, "mem", "peak_rss_mb", target="<= 0.15x PyTorch" if m != "mlp" else "",
            met=(lambda a, b, r: r is not None and r <= 0.15) if m != "mlp" else None)
    for m in MODELS:
        row("start-up to 1st step s", m, m, "startup", "first_step_s", unit="s", target="<= 0.2 s (qtrain)",
            met=lambda a, b, r: a is not None and a <= 0.2)
    for m in MODELS:
        row("GEMM share of a step", m, m, "train", "gemm_share", unit="share")
    head = ("measurement", "model", "qtrain", "PyTorch", "qtrain/PyTorch", "target", "met")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    version = next((v["config"]["impl"][8:] for v in t.values() if "impl" in v.get("config", {})), "?")
    print("qtrain vs PyTorch %s: batch 128, 2 threads, OpenBLAS %s kernels on both sides" %
          (version, args.core or "?"))
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    if any("*" in r[2] + r[3] for r in rows):
        print("* the mean step (batch) is over %.2fx the median: a few slow steps, usually other processes on the "
              "machine, pull this figure down; the medians are in the raw outputs" % NOISY)
    missing = [n for n in CONFIGS if not t[n] or not q[n]]
    if missing:
        print("missing measurements (see the outputs in %s and %s): %s" % (args.qtrain, args.torch,
                                                                           ", ".join(missing)))


MODELS = ("mlp", "cnn", "resnet8", "dscnn")
CONFIGS = ["mlp", "cnn", "resnet8", "dscnn", "mlp-lora", "cnn-lora", "mlp-qlora", "cnn-qlora", "mlp-ptq-int8",
           "cnn-ptq-int8", "resnet8-ptq-int8", "dscnn-ptq-int8"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one measurement of one bench config")
    r.add_argument("--config", required=True)
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--eval-batches", type=int, default=40)
    r.add_argument("--ptq", choices=("auto", "fx", "eager"), default="auto",
                   help="PyTorch's PTQ mode (auto: eager for the old layer set, FX for the rest)")
    r.add_argument("--since-ns", type=int, default=0, help="CLOCK_REALTIME ns at process start ($(date +%%s%%N))")
    tr = sub.add_parser("train", help="train the config's model as configured; the test accuracy per epoch")
    tr.add_argument("--config", required=True)
    tr.add_argument("--epochs", type=int, default=None, help="train this many epochs (overrides train.epochs/steps)")
    tr.add_argument("--threads", type=int, default=0, help="PyTorch threads (default run.threads)")
    t = sub.add_parser("table", help="the side-by-side table of bench/run.sh's outputs")
    t.add_argument("--qtrain", required=True, help="directory of qtrain's <config>.txt outputs")
    t.add_argument("--torch", required=True, help="directory of this script's <config>.txt outputs")
    t.add_argument("--core", default="", help="the OpenBLAS kernel family both sides ran")
    args = ap.parse_args()
    if args.cmd == "run":
        if args.steps < 1 or args.warmup < 0 or args.eval_batches < 0:
            fail("--steps must be >= 1, --warmup and --eval-batches >= 0")
        cmd_run(args)
    elif args.cmd == "train":
        if args.epochs is not None and args.epochs < 0:
            fail("--epochs must be >= 0")
        cmd_train(args)
    else:
        cmd_table(args)


if __name__ == "__main__":
    main()
