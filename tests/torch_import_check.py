#!/usr/bin/python3
"""tests/torch_import_check.py - the PyTorch side of the interop suite's
torch_import test: evaluates the factory's model on the test split of the
config scripts/torch_import.py wrote (bench/torch_model.py's data loader)
and compares its outputs with `qtrain eval --dump-logits` of the imported
model. Prints "torch_import: ok" or fails naming the mismatch."""
import argparse
import importlib.util
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_model  # noqa: E402
from interop_check import compare  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("factory")
    ap.add_argument("--config", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--logits", required=True)
    ap.add_argument("--rtol", type=float, default=1e-5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    path, fn = a.factory.rsplit(":", 1)
    spec = importlib.util.spec_from_file_location("user_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = getattr(mod, fn)()
    model.eval()
    cfg = torch_model.load_config(a.config)
    cfg["data"]["dir"] = a.data_dir
    data = torch_model.Data(cfg)
    x, _ = data.batch(data.test_x, data.test_y, np.arange(len(data.test_x)), cfg["model"]["input"])
    with torch.no_grad():
        out = model(x).numpy()
    compare(out, a.logits, a.rtol, "torch_import")


if __name__ == "__main__":
    main()
