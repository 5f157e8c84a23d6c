#!/usr/bin/python3
"""PyTorch's int8 inference of a PTQ config's model on one core: the PyTorch
rows of bench/export_bench.sh.

    export_torch.py --config configs/ptq-w8a8.yaml --init-from FLOAT.h5 [--seconds S] [--warmup S]

The config's model (bench/torch_model.py's build_model) with the float
weights of --init-from (the checkpoint the PTQ run quantized), statically
quantized as bench/torch_model.py's quantize_int8 does it (the onednn
engine, observers on the config's calibration batches, eager mode for a
conv/dense chain), on one thread (torch.set_num_threads(1), one interop
thread, OMP and OpenBLAS threads 1). Timed at batch 1 and batch 128 over the
test images in file order, already converted to normalized floats (the
conversion is not timed; the quantization of the input is, inside the
model): untimed for --warmup seconds, then for --seconds. Lines:

    export:torch impl:pytorch-1.13.0 engine:onednn engines:qnnpack,onednn threads:1 accuracy:0.7136
    export:torch_eval batch:1 images:N seconds:S images_per_s:X ms_per_batch:M ms_per_batch_min:M0

accuracy: the quantized model over the whole test set (a sanity check).
Needs Debian's python3-torch (with numpy, yaml and h5py).
"""
import argparse
import os
import sys
import time

# Before torch loads: one core, no OpenMP or OpenBLAS threads on top.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch_bench import load_init_from  # noqa: E402
from torch_model import Data, build_model, fail, load_config, quantize_int8  # noqa: E402


def timed(model, x_all, bs, warmup, seconds):
    """(images, seconds, per-batch seconds min) of model over consecutive batches of x_all, cycling."""
    import torch
    n = len(x_all) - len(x_all) % bs
    pos = [0]

    def one():
        x = x_all[pos[0]:pos[0] + bs]
        pos[0] = (pos[0] + bs) % n
        return int(model(x).argmax(1)[0])

    with torch.inference_mode():
        t0 = time.perf_counter()
        k = 0
        while time.perf_counter() - t0 < warmup or k < 3:
            one()
            k += 1
        count, best = 0, float("inf")
        start = last = time.perf_counter()
        while True:
            one()
            count += 1
            t = time.perf_counter()
            best = min(best, t - last)
            last = t
            if t - start >= seconds and count >= 3:
                break
    return count * bs, last - start, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--init-from", required=True, help="the float checkpoint the PTQ run quantized")
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--warmup", type=float, default=0.3)
    ap.add_argument("--batches", default="1,128", help="batch sizes, comma-separated")
    args = ap.parse_args()
    import numpy as np
    import torch
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only before any inter-op work; nothing ran yet, but older builds may refuse
        pass
    cfg = load_config(args.config)
    if ((cfg.get("quant") or {}).get("mode")) != "ptq":
        fail("%s: quant.mode: ptq expected" % args.config)
    torch.manual_seed(int(cfg["run"].get("seed", 1)))
    data = Data(cfg)
    input_shape = list(cfg["model"]["input"])
    model, types, _ = build_model(cfg)
    load_init_from(model, args.init_from)
    model = quantize_int8(model, types, data, cfg, input_shape)
    model.eval()
    x_all, y_all = data.batch(data.test_x, data.test_y, np.arange(len(data.test_x)), input_shape)
    x_all = x_all.contiguous()
    with torch.inference_mode():
        correct = sum(int((model(x_all[a:a + 128]).argmax(1) == y_all[a:a + 128]).sum())
                      for a in range(0, len(x_all), 128))
    print("export:torch impl:pytorch-%s engine:%s engines:%s threads:%d interop_threads:%d accuracy:%.4f" % (
        torch.__version__, torch.backends.quantized.engine,
        ",".join(e for e in torch.backends.quantized.supported_engines if e != "none"), torch.get_num_threads(),
        torch.get_num_interop_threads(), correct / len(x_all)))
    sys.stdout.flush()
    for bs in (int(b) for b in args.batches.split(",")):
        if not 1 <= bs <= len(x_all):
            fail("--batches: %d is not in [1, %d]" % (bs, len(x_all)))
        images, secs, best = timed(model, x_all, bs, args.warmup, args.seconds)
        print("export:torch_eval batch:%d images:%d seconds:%.3f images_per_s:%.1f ms_per_batch:%.4f "
              "ms_per_batch_min:%.4f" % (bs, images, secs, images / secs, secs * 1e3 * bs / images, best * 1e3))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
