#!/usr/bin/python3
"""tests/peft_check.py - the PyTorch side of the interop suite's PEFT test:
reads a directory `qtrain export --format peft` wrote with PEFT's
conventions (adapter_config.json: r, lora_alpha, use_rslora, rank_pattern,
alpha_pattern, target_modules, modules_to_save; adapter_model.safetensors:
base_model.model.<module>.lora_A/lora_B.weight and the saved modules'
tensors), puts base_model.safetensors into the config's model as PyTorch
builds it (bench/torch_model.py), adds scale * B A to every target weight
(scale = lora_alpha / r, or / sqrt(r) with use_rslora; with use_dora the
weight becomes PEFT's DoRA merge m * V / |V|_c, V = W + scale B A, m its
lora_magnitude_vector, the norm per output channel), loads the saved
modules, evaluates the test split and compares with `qtrain eval
--dump-logits`. Prints "peft: ok" or fails naming the mismatch."""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
sys.path.insert(0, HERE)
import torch_model  # noqa: E402
from interop_check import compare, read_safetensors  # noqa: E402

PREFIX = "base_model.model."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--adapter", required=True, help="the directory qtrain export --format peft wrote")
    ap.add_argument("--logits", required=True)
    ap.add_argument("--rtol", type=float, default=1e-5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = torch_model.load_config(a.config)
    cfg["data"]["dir"] = a.data_dir
    conf = json.load(open(os.path.join(a.adapter, "adapter_config.json")))
    if conf.get("peft_type") != "LORA" or conf.get("bias", "none") != "none":
        sys.exit("peft: not a plain LoRA adapter: %s" % conf)
    model, _, _ = torch_model.build_model(cfg)
    base = read_safetensors(os.path.join(a.adapter, "base_model.safetensors"))
    want = model.state_dict()
    for k, v in want.items():  # dtypes as PyTorch's own (num_batches_tracked: int64)
        if base[k].dtype != v.dtype:
            sys.exit("peft: %s is %s in base_model.safetensors, %s in PyTorch" % (k, base[k].dtype, v.dtype))
    model.load_state_dict(base)
    ad = read_safetensors(os.path.join(a.adapter, "adapter_model.safetensors"))
    sd = model.state_dict()
    for name in conf["target_modules"]:
        r = conf.get("rank_pattern", {}).get(name, conf["r"])
        alpha = conf.get("alpha_pattern", {}).get(name, conf["lora_alpha"])
        scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
        A, B = ad[PREFIX + name + ".lora_A.weight"], ad[PREFIX + name + ".lora_B.weight"]
        W = sd[name + ".weight"]
        delta = (B.reshape(B.shape[0], -1).double() @ A.reshape(A.shape[0], -1).double()).reshape(W.shape)
        V = W.double() + scale * delta
        if conf.get("use_dora"):
            m = ad[PREFIX + name + ".lora_magnitude_vector"].double().reshape(-1)
            norm = V.reshape(V.shape[0], -1).norm(dim=1)
            V = V * (m / norm).reshape([-1] + [1] * (V.dim() - 1))
        sd[name + ".weight"] = V.float()
    for name in conf.get("modules_to_save") or []:
        for k in list(sd):
            if k.startswith(name + "."):
                sd[k] = ad[PREFIX + k].to(sd[k].dtype)
    model.load_state_dict(sd)
    model.eval()
    data = torch_model.Data(cfg)
    x, _ = data.batch(data.test_x, data.test_y, np.arange(len(data.test_x)), cfg["model"]["input"])
    with torch.no_grad():
        out = model(x).numpy()
    compare(out, a.logits, a.rtol, "peft")


if __name__ == "__main__":
    main()
