#!/usr/bin/python3
"""The model, data and optimizer side of bench/torch_bench.py: a qtrain
config (its YAML) mapped to PyTorch as closely as bench/README.md describes:
the IDX data with the same affine pixel map, the batch order, the model as
an nn.Sequential or, with named inputs, a small FX-traceable graph module,
LoRA/QLoRA (nf4 with double quantization), the optimizer, and int8 PTQ
(eager mode for chains, FX mode with batch norms folded for the rest).

Needs Debian's python3-torch (with numpy and yaml).
"""
import gzip
import math
import os
import re
import sys
from collections import OrderedDict

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
        # data.anomaly_classes: training and validation never see them; the test set keeps them (qtrain's order)
        anomalies = list(d.get("anomaly_classes") or [])
        if anomalies:
            keep = ~np.isin(self.train_y, anomalies), ~np.isin(self.val_y, anomalies)
            self.train_x, self.train_y = self.train_x[keep[0]], self.train_y[keep[0]]
            self.val_x, self.val_y = self.val_x[keep[1]], self.val_y[keep[1]]
        self.anomalies = anomalies

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
