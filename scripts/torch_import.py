#!/usr/bin/python3
"""scripts/torch_import.py - a PyTorch model into qtrain: its config and its weights.

    /usr/bin/python3 scripts/torch_import.py MODULE.py:FACTORY --input C,H,W --out DIR

imports MODULE.py, calls FACTORY() for an nn.Module, traces it with torch.fx
(nn.Sequential and residual graphs alike), and writes

    DIR/config.yaml         model.input and model.layers with each layer named
                            after its PyTorch module ('layer1.0.conv1' becomes
                            layer1_0_conv1), inputs named where a layer does not
                            read the previous one; model.init_from the weights;
                            data and train sections to edit
    DIR/model.safetensors   the state_dict under those names (float32; the
                            batch norms' num_batches_tracked int64)

What qtrain cannot express (another layer type, a call it does not know, an
argument it has no key for) is reported by module name and type, and nothing
is written. Needs Debian's python3-torch (and numpy).
"""
import argparse
import importlib.util
import json
import operator
import os
import struct
import sys

import numpy as np
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F


class Unsupported(Exception):
    pass


def qname(target):
    """A qtrain module name from a PyTorch module path or an fx node name."""
    return str(target).replace(".", "_")


def pair(v):
    return list(v) if isinstance(v, (tuple, list)) else [v, v]


def conv_spec(m):
    if m.padding_mode != "zeros":
        raise Unsupported("padding_mode %r (qtrain pads with zeros)" % m.padding_mode)
    kh, kw = pair(m.kernel_size)
    s = {"type": "conv2d", "out_channels": m.out_channels, "kernel": [kh, kw], "stride": pair(m.stride)}
    if isinstance(m.padding, str):
        if m.padding != "same":
            raise Unsupported("padding %r" % m.padding)
        s["padding"] = "same"
    else:
        s["padding"] = pair(m.padding)
    if pair(m.dilation) != [1, 1]:
        s["dilation"] = pair(m.dilation)
    if m.groups != 1:
        s["groups"] = m.groups
    if m.bias is None:
        s["bias"] = False
    return s


def module_spec(m):
    """The qtrain layer of one leaf module, or raises Unsupported."""
    if isinstance(m, nn.Conv2d):
        return conv_spec(m)
    if isinstance(m, nn.Linear):
        s = {"type": "dense", "units": m.out_features}
        if m.bias is None:
            s["bias"] = False
        return s
    if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
        if not m.track_running_stats:
            raise Unsupported("a batch norm without running statistics")
        if m.momentum is None:
            raise Unsupported("momentum None (a cumulative average): qtrain's running statistics are an "
                              "exponential average; set a momentum")
        s = {"type": "batchnorm2d" if isinstance(m, nn.BatchNorm2d) else "batchnorm1d", "eps": m.eps,
             "momentum": m.momentum}
        if not m.affine:
            s["affine"] = False
        return s
    simple = {nn.ReLU: "relu", nn.GELU: "gelu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.Flatten: "flatten"}
    for cls, name in simple.items():
        if isinstance(m, cls):
            if isinstance(m, nn.Flatten) and (m.start_dim != 1 or m.end_dim != -1):
                raise Unsupported("flatten of dims %d..%d (qtrain flattens all but the batch)" % (m.start_dim,
                                                                                                   m.end_dim))
            if isinstance(m, nn.GELU) and m.approximate != "tanh":
                raise Unsupported("GELU(approximate=%r): qtrain's gelu is the tanh approximation" % m.approximate)
            return {"type": name}
    if isinstance(m, nn.Dropout):
        return {"type": "dropout", "p": m.p}
    if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
        k, st = pair(m.kernel_size), pair(m.stride if m.stride is not None else m.kernel_size)
        if getattr(m, "ceil_mode", False) or pair(getattr(m, "dilation", 1)) != [1, 1] or \
                getattr(m, "divisor_override", None) is not None or not getattr(m, "count_include_pad", True):
            raise Unsupported("ceil_mode, dilation, divisor_override or count_include_pad=False (qtrain pools "
                              "floor-sized, undilated windows)")
        if k[0] != k[1] or st[0] != st[1] or pair(m.padding) != [0, 0]:
            raise Unsupported("a pool of kernel %s, stride %s, padding %s (square, unpadded only)" %
                              (k, st, m.padding))
        return {"type": "maxpool2d" if isinstance(m, nn.MaxPool2d) else "avgpool2d", "kernel": k[0], "stride": st[0]}
    if isinstance(m, nn.AdaptiveAvgPool2d) and pair(m.output_size) == [1, 1]:
        return {"type": "globalavgpool"}
    if isinstance(m, nn.LayerNorm):
        return {"type": "layernorm", "eps": m.eps}
    raise Unsupported("no qtrain layer for %s" % type(m).__name__)


def function_spec(node):
    """The qtrain layer of a call_function / call_method node, or raises Unsupported."""
    t = node.target
    if t in (operator.add, torch.add) or t == "add":
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) > 2:
            raise Unsupported("add with alpha %s" % node.kwargs.get("alpha", node.args[2:]))
        if not all(isinstance(x, torch.fx.Node) for x in node.args[:2]):
            raise Unsupported("add of a constant (qtrain's add sums two layers' outputs)")
        return {"type": "add"}
    if t in (F.relu, torch.relu) or t == "relu":
        return {"type": "relu"}
    if t in (torch.flatten,) or t in ("flatten", "view", "reshape"):
        args = node.args[1:]
        if t in (torch.flatten, "flatten") and (args[:1] or [1])[0] == 1 and node.kwargs.get("end_dim", -1) == -1:
            return {"type": "flatten"}
        if t in ("view", "reshape") and len(args) == 2 and args[1] == -1:
            return {"type": "flatten"}  # x.view(n, -1), x.view(x.size(0), -1)
        raise Unsupported("%s with arguments %s" % (t, args))
    if t is torch.cat:
        if node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0) != 1:
            raise Unsupported("torch.cat along another axis than the channels")
        return {"type": "concat"}
    raise Unsupported("no qtrain layer for the call %s" % getattr(t, "__name__", t))


def trace(model):
    """(layers, state tensors {qtrain name: tensor}) of a model, or raises Unsupported naming what does not fit."""
    gm = torch.fx.symbolic_trace(model)
    mods = dict(gm.named_modules())
    layers, names, state, problems, used = [], {}, {}, [], set()
    prev = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            names[node.name] = "input"
            prev = node.name
            continue
        if node.op == "output":
            continue
        if node.op == "call_method" and node.target == "size" and all(
                u.op == "call_method" and u.target in ("view", "reshape") for u in node.users):
            continue  # x.size(0) feeding x.view(x.size(0), -1): the batch size, no layer
        if node.op == "get_attr":
            problems.append("%s: a tensor read from the model (get_attr %s)" % (node.name, node.target))
            continue
        try:
            if node.op == "call_module":
                m = mods[node.target]
                spec, name = module_spec(m), qname(node.target)
                if name in used and m.state_dict():
                    raise Unsupported("called twice: qtrain layers share no weights or statistics")
                for k, v in m.state_dict().items():
                    state[name + "." + k] = v
            else:
                spec, name = function_spec(node), qname(node.name)
        except Unsupported as e:
            label = node.target if node.op == "call_module" else node.name
            kind = type(mods[node.target]).__name__ if node.op == "call_module" else "call"
            problems.append("%s (%s): %s" % (label, kind, e))
            continue
        srcs = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if spec["type"] == "concat":
            srcs = list(node.args[0])
        elif spec["type"] != "add":
            srcs = srcs[:1]  # the data; a view's batch size (x.size(0)) is no layer's input
        ins = [names.get(s.name, qname(s.name)) for s in srcs]
        if len(ins) > 1 or (ins and (srcs[0].name != prev)):
            spec["inputs"] = ins
        base, k = name, 1
        while name in used:  # a module without weights called again (one ReLU for a whole block)
            k += 1
            name = "%s_%d" % (base, k)
        used.add(name)
        spec = dict(name=name, **spec)
        layers.append(spec)
        names[node.name] = name
        prev = node.name
    if problems:
        raise Unsupported("\n".join(problems))
    return layers, state


def flow(v):
    """YAML flow text of a value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(flow(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v) if not v.replace("_", "").isalnum() else v
    return str(v)


def write_safetensors(path, tensors):
    """tensors {name: torch tensor} as a safetensors file (float32; int64 kept)."""
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        a = t.detach().cpu().numpy()
        a = a.astype("<i8") if a.dtype == np.int64 else a.astype("<f4")
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": "I64" if a.dtype == np.dtype("<i8") else "F32", "shape": list(a.shape),
                        "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    header["__metadata__"] = {"format": "pt", "source": "scripts/torch_import.py"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("factory", help="MODULE.py:FACTORY, a function returning the nn.Module")
    ap.add_argument("--input", required=True, help="one example's shape, C,H,W or F")
    ap.add_argument("--out", required=True, help="the directory to write config.yaml and model.safetensors into")
    ap.add_argument("--name", default=None, help="run.name (default: FACTORY)")
    a = ap.parse_args()
    if ":" not in a.factory:
        sys.exit("torch_import: give MODULE.py:FACTORY")
    path, fn = a.factory.rsplit(":", 1)
    spec = importlib.util.spec_from_file_location("user_model", path)
    if spec is None:
        sys.exit("torch_import: cannot import %s" % path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = getattr(mod, fn)()
    model.eval()
    try:
        layers, state = trace(model)
    except Unsupported as e:
        sys.exit("torch_import: the model has what qtrain cannot express:\n  " + str(e).replace("\n", "\n  "))
    shape = [int(x) for x in a.input.split(",")]
    os.makedirs(a.out, exist_ok=True)
    weights = os.path.join(a.out, "model.safetensors")
    write_safetensors(weights, state)
    name = a.name or fn
    lines = ["# Written by scripts/torch_import.py from %s: the model's layers as PyTorch defines them." % a.factory,
             "# Edit data (and train) for your data set; the last layer must give one output per class.",
             "run:", "  name: %s" % name, "  out_dir: runs/%s" % name, "", "data:",
             "  dataset: fashion-mnist", "  dir: /usr/share/datasets/fashion-mnist", "", "model:",
             "  input: %s" % flow(shape), "  init_from: %s" % json.dumps(os.path.abspath(weights)), "  layers:"]
    for layer in layers:
        lines.append("    - {" + ", ".join("%s: %s" % (k, flow(v)) for k, v in layer.items()) + "}")
    lines += ["", "train:", "  epochs: 1", "  batch_size: 64", "  optimizer: {name: adamw, lr: 0.001}", ""]
    with open(os.path.join(a.out, "config.yaml"), "w") as f:
        f.write("\n".join(lines))
    print("torch_import: %d layers, %d tensors -> %s/config.yaml, %s" % (len(layers), len(state), a.out, weights))


if __name__ == "__main__":
    main()
