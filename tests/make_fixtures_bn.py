#!/usr/bin/python3
"""Writes the PyTorch references for batch norm, global average pooling, channel concat and a residual block,
which tests/test_batchnorm.c checks qtrain's ops against.

Usage: /usr/bin/python3 tests/make_fixtures_bn.py tests/fixtures/torch_bn.h5

Needs Debian's python3-torch (1.13), python3-h5py and python3-numpy. Everything is float32 on one thread from
fixed seeds, so the file is the same on every run of the same torch version. Parameter datasets are named like
qtrain's params ("<module>/weight", "<module>/bias"), running statistics like PyTorch's buffers.

Groups:
  /bn1d, /bn2d, /bn2d_plain   BatchNorm1d(6) on (8, 6); BatchNorm2d(4) on (3, 4, 4, 4); BatchNorm2d(3,
                 affine=False, momentum=0.3) on (2, 3, 3, 3). Train mode, STEPS steps of forward + backward on
                 different batches: x, dy, y, dx, and for affine ones weight/bias, dweight/dbias (each (STEPS,
                 ...), the grads of that step alone), running_mean, running_var (STEPS, C) after each step,
                 num_batches_tracked (int64) at the end; eval mode: x_eval, y_eval with the final statistics.
                 Attributes eps, momentum.
  /gap           x (2, 3, 4, 5), y = adaptive_avg_pool2d(x, 1) flattened (2, 3), dy, dx
  /cat           a (2, 2, 3, 3), b (2, 3, 3, 3), c (2, 1, 3, 3), y = cat([a, b, c], 1), dy, da, db, dc
  /resblock      x (2, 3, 6, 6) -> conv1 3->3 k3 p1 (no bias) -> bn1 -> relu -> conv2 3->3 k3 p1 (no bias) -> bn2
                 -> + x -> relu, in train mode: params/, y, dy, dx, grads/, running stats of bn1 and bn2 after it
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from make_fixtures import fixture_out, new_group, open_fixture, put

STEPS = 5
# A ReLU pre-activation closer than this to 0 could flip between two float32 implementations.
KINK_MARGIN = 1e-3


def put_path(group, path, value, dtype=np.float32):
    """put() at "a/b/name", making the groups on the way as new_group does (no timestamps: a reproducible file)."""
    *dirs, name = path.split("/")
    for d in dirs:
        group = new_group(group, d)
    return put(group, name, value, dtype)


def randn(g, *shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, generator=g) * scale + shift


def write_bn(f, name, bn, x_shape, seed):
    g = torch.Generator().manual_seed(seed)
    C = x_shape[1]
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(randn(g, C, scale=0.5, shift=1.0))
            bn.bias.copy_(randn(g, C, scale=0.5))
    grp = new_group(f, name)
    grp.attrs["eps"] = bn.eps
    grp.attrs["momentum"] = bn.momentum
    if bn.affine:
        put(grp, "weight", bn.weight.detach())
        put(grp, "bias", bn.bias.detach())
    # Per-channel offsets and scales, so the statistics are far from 0 and 1.
    view = (1, C) + (1,) * (len(x_shape) - 2)
    shift = randn(g, C, scale=3.0).reshape(view)
    scale = (torch.rand(C, generator=g) * 2 + 0.5).reshape(view)
    rec = {k: [] for k in ("x", "dy", "y", "dx", "dweight", "dbias", "running_mean", "running_var")}
    bn.train()
    for _ in range(STEPS):
        x = (randn(g, *x_shape) * scale + shift).requires_grad_(True)
        dy = randn(g, *x_shape)
        bn.zero_grad()
        y = bn(x)
        y.backward(dy)
        rec["x"].append(x.detach())
        rec["dy"].append(dy)
        rec["y"].append(y.detach())
        rec["dx"].append(x.grad)
        if bn.affine:
            rec["dweight"].append(bn.weight.grad.clone())
            rec["dbias"].append(bn.bias.grad.clone())
        rec["running_mean"].append(bn.running_mean.clone())
        rec["running_var"].append(bn.running_var.clone())
    for k, v in rec.items():
        if v:
            put(grp, k, torch.stack(v))
    put(grp, "num_batches_tracked", bn.num_batches_tracked, dtype=np.int64)
    bn.eval()
    x_eval = randn(g, *x_shape) * scale + shift
    with torch.no_grad():
        put(grp, "x_eval", x_eval)
        put(grp, "y_eval", bn(x_eval))


def write_gap_cat(f):
    g = torch.Generator().manual_seed(7)
    grp = new_group(f, "gap")
    x = randn(g, 2, 3, 4, 5).requires_grad_(True)
    y = F.adaptive_avg_pool2d(x, 1).flatten(1)
    dy = randn(g, 2, 3)
    y.backward(dy)
    for k, v in (("x", x), ("y", y), ("dy", dy), ("dx", x.grad)):
        put(grp, k, v.detach())
    grp = new_group(f, "cat")
    ins = [randn(g, 2, c, 3, 3).requires_grad_(True) for c in (2, 3, 1)]
    y = torch.cat(ins, 1)
    dy = randn(g, *y.shape)
    y.backward(dy)
    for k, v in zip("abc", ins):
        put(grp, k, v.detach())
        put(grp, "d" + k, v.grad)
    put(grp, "y", y.detach())
    put(grp, "dy", dy)


class ResBlock(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.conv1 = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(C)
        self.conv2 = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(C)

    def forward(self, x, taps):
        h = self.bn1(self.conv1(x))
        taps.append(h)
        h = self.bn2(self.conv2(F.relu(h))) + x
        taps.append(h)
        return F.relu(h)


def write_resblock(f):
    for seed in range(300, 400):
        torch.manual_seed(seed)
        block = ResBlock(3)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for bn in (block.bn1, block.bn2):
                bn.weight.copy_(randn(g, 3, scale=0.5, shift=1.0))
                bn.bias.copy_(randn(g, 3, scale=0.5))
        x = randn(g, 2, 3, 6, 6).requires_grad_(True)
        dy = randn(g, 2, 3, 6, 6)
        taps = []
        y = block.train()(x, taps)
        if all(t.abs().min().item() > KINK_MARGIN for t in taps):
            break
    else:
        raise SystemExit("no seed in 300..399 keeps the ReLU inputs away from 0")
    y.backward(dy)
    grp = new_group(f, "resblock")
    grp.attrs["seed"] = seed
    for k, v in (("x", x), ("y", y), ("dy", dy), ("dx", x.grad)):
        put(grp, k, v.detach())
    for name, p in block.named_parameters():
        put_path(grp, "params/" + name.replace(".", "/"), p.detach())
        put_path(grp, "grads/" + name.replace(".", "/"), p.grad)
    for bn_name in ("bn1", "bn2"):
        bn = getattr(block, bn_name)
        put_path(grp, f"{bn_name}/running_mean", bn.running_mean)
        put_path(grp, f"{bn_name}/running_var", bn.running_var)


def main():
    out = fixture_out("tests/make_fixtures_bn.py", "tests/fixtures/torch_bn.h5")
    with open_fixture(out, "tests/make_fixtures_bn.py",
                      "PyTorch float32 references for tests/test_batchnorm.c (see the generator's docstring).") as f:
        write_bn(f, "bn1d", nn.BatchNorm1d(6), (8, 6), 1)
        write_bn(f, "bn2d", nn.BatchNorm2d(4), (3, 4, 4, 4), 2)
        write_bn(f, "bn2d_plain", nn.BatchNorm2d(3, affine=False, momentum=0.3), (2, 3, 3, 3), 3)
        write_gap_cat(f)
        write_resblock(f)


if __name__ == "__main__":
    main()
