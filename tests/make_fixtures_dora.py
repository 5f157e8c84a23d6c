#!/usr/bin/python3
"""Writes the PyTorch references of DoRA adapters (lora/lora_dora.h) that tests/test_dora.c checks qtrain's
forward and its exact backward against.

Usage: /usr/bin/python3 tests/make_fixtures_dora.py tests/fixtures/torch_dora.h5

Needs Debian's python3-torch (1.13), python3-h5py and python3-numpy (not the peft package: the forward is
written out here as PEFT's DoraLinearLayer / DoraConv2dLayer compute it, without dropout). float32, one thread,
fixed seeds, no timestamps: the same bytes on every run of the same torch version.

One group per case, /<case>/ (dense, conv, conv_grouped); attributes rank, scale, and for convs stride, padding,
groups:
  x (N, in) or (N, C, H, W); W (out, in) or (OC, C/groups, KH, KW); b (out,); A (rank, in) or
  (rank, C/groups, KH, KW); B (out, rank) or (OC, rank/groups, 1, 1); m (out,)
  y      base(x) + (g - 1) * base_nobias(x) + g * scale * B(A(x)), g = m / |W + scale B A|_c (not detached)
  dy     a random upstream gradient; dx, dA, dB, dm: the gradients of sum(y * dy)
"""
import numpy as np
import torch
import torch.nn.functional as F

from make_fixtures import fixture_out, new_group, open_fixture, put

# name: (N, C, H, W, OC, K, stride, padding, groups, rank); H = W = 0: dense with C inputs
CASES = {
    "dense":        (3, 7, 0, 0, 5, 0, 1, 0, 1, 2),
    "conv":         (2, 3, 6, 6, 4, 3, 2, 1, 1, 2),
    "conv_grouped": (2, 4, 5, 5, 6, 3, 1, 1, 2, 4),
}
SCALE = 1.5


def delta(B, A, groups):
    """scale-free B A in the weight's (out, fan) layout, block-diagonal over the groups."""
    out, rank = B.shape[0], A.shape[0]
    Af, Bf = A.reshape(rank, -1), B.reshape(out, -1)
    og, rg = out // groups, rank // groups
    return torch.cat([Bf[k * og:(k + 1) * og] @ Af[k * rg:(k + 1) * rg] for k in range(groups)], 0)


def write_case(f, name, case, seed):
    N, C, H, W_, OC, K, stride, padding, groups, rank = case
    g = torch.Generator().manual_seed(seed)
    conv = H > 0
    if conv:
        x = torch.randn(N, C, H, W_, generator=g)
        W = torch.randn(OC, C // groups, K, K, generator=g) * 0.4
        A = torch.randn(rank, C // groups, K, K, generator=g) * 0.4
        B = torch.randn(OC, rank // groups, 1, 1, generator=g) * 0.4
    else:
        x = torch.randn(N, C, generator=g)
        W = torch.randn(OC, C, generator=g) * 0.4
        A = torch.randn(rank, C, generator=g) * 0.4
        B = torch.randn(OC, rank, generator=g) * 0.4
    b = torch.randn(OC, generator=g) * 0.1
    V0 = (W.reshape(OC, -1) + SCALE * delta(B, A, groups)).norm(dim=1)
    m = V0 * (1.0 + 0.3 * torch.randn(OC, generator=g))  # off the initial magnitude, so g != 1
    for t in (x, A, B, m):
        t.requires_grad_(True)
    norm = (W.reshape(OC, -1) + SCALE * delta(B, A, groups)).norm(dim=1)  # differentiated: the exact gradient
    gain = m / norm
    if conv:
        base_nobias = F.conv2d(x, W, None, stride, padding, 1, groups)
        branch = F.conv2d(F.conv2d(x, A, None, stride, padding, 1, groups), B, None, 1, 0, 1, groups)
        gv = gain.view(1, -1, 1, 1)
        y = base_nobias + b.view(1, -1, 1, 1) + (gv - 1) * base_nobias + gv * SCALE * branch
    else:
        base_nobias = x @ W.T
        branch = (x @ A.T) @ B.T
        gv = gain.view(1, -1)
        y = base_nobias + b + (gv - 1) * base_nobias + gv * SCALE * branch
    dy = torch.randn(*y.shape, generator=g)
    (y * dy).sum().backward()
    grp = new_group(f, name)
    grp.attrs["rank"] = rank
    grp.attrs["scale"] = SCALE
    if conv:
        grp.attrs["stride"] = stride
        grp.attrs["padding"] = padding
        grp.attrs["groups"] = groups
    for key, t in (("x", x), ("W", W), ("b", b), ("A", A), ("B", B), ("m", m), ("y", y), ("dy", dy),
                   ("dx", x.grad), ("dA", A.grad), ("dB", B.grad), ("dm", m.grad)):
        put(grp, key, t.detach().numpy())


def main():
    out = fixture_out("tests/make_fixtures_dora.py", "tests/fixtures/torch_dora.h5")
    with open_fixture(out, "tests/make_fixtures_dora.py",
                      "PyTorch float32 references for tests/test_dora.c (see the generator's docstring).") as f:
        for i, (name, case) in enumerate(CASES.items()):
            write_case(f, name, case, 100 + i)


if __name__ == "__main__":
    main()
