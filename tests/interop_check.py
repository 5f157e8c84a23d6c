#!/usr/bin/python3
"""tests/interop_check.py - the PyTorch side of the interop suite: loads a
safetensors file `qtrain export` wrote into the config's model as PyTorch
builds it (bench/torch_model.py), evaluates the test split and compares the
outputs with `qtrain eval --dump-logits`. Prints "interop: ok" and the
largest relative difference, or fails naming the first mismatch."""
import argparse
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch_model  # noqa: E402

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64}


def read_safetensors(path):
    """A state_dict from a safetensors file (the format read by hand: no safetensors package here)."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(raw[base + a:base + b], dtype=DTYPES[t["dtype"]])
                                     .reshape(t["shape"]).copy())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for data.dir only")
    ap.add_argument("--safetensors", required=True)
    ap.add_argument("--logits", required=True)
    ap.add_argument("--rtol", type=float, default=1e-5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = torch_model.load_config(a.config)
    for kv in a.set:
        k, v = kv.split("=", 1)
        if k != "data.dir":
            sys.exit("interop: only data.dir can be set here")
        cfg["data"]["dir"] = v
    model, _, _ = torch_model.build_model(cfg)
    sd = read_safetensors(a.safetensors)
    want = model.state_dict()
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or extra:
        sys.exit("interop: the export does not fit the model: missing %s, extra %s" % (missing, extra))
    for k, v in want.items():  # dtypes as PyTorch's own (num_batches_tracked: int64)
        if sd[k].dtype != v.dtype:
            sys.exit("interop: %s is %s in the export, %s in PyTorch" % (k, sd[k].dtype, v.dtype))
    model.load_state_dict(sd)
    model.eval()
    data = torch_model.Data(cfg)
    x, _ = data.batch(data.test_x, data.test_y, np.arange(len(data.test_x)), cfg["model"]["input"])
    with torch.no_grad():
        out = model(x).numpy()
    compare(out, a.logits, a.rtol, "interop")


def compare(out, logits_path, rtol, label):
    """PyTorch's outputs against `qtrain eval --dump-logits`: exits naming the mismatch, or prints
    "<label>: ok" and the largest relative difference."""
    q = np.load(logits_path)
    if out.shape != q.shape:
        sys.exit("%s: PyTorch gives %s outputs, qtrain %s" % (label, out.shape, q.shape))
    rel = float(np.abs(out - q).max() / max(np.abs(q).max(), 1e-30))
    if not rel <= rtol:
        sys.exit("%s: largest relative difference %.3g > %g" % (label, rel, rtol))
    print("%s: ok, largest relative difference %.3g over %d outputs" % (label, rel, q.size))


if __name__ == "__main__":
    main()
