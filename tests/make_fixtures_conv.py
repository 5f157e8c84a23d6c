#!/usr/bin/python3
"""Writes the PyTorch references of the general convolution that tests/test_conv_general.c checks
nn_conv2d_general against.

Usage: /usr/bin/python3 tests/make_fixtures_conv.py tests/fixtures/torch_conv.h5

Needs Debian's python3-torch (1.13), python3-h5py and python3-numpy. float32, one thread, fixed seeds,
no timestamps: the same bytes on every run of the same torch version.

One group per case, /<case>/:
  geom   int32 (10,): stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, pad_h_extra, pad_w_extra,
         same (1: the case uses padding='same' and the reader derives the padding itself)
  x (N, C, H, W), w (OC, C/groups, KH, KW), bias (OC,) if the case has one
  y      F.conv2d(x, w, bias, ...)
  dy     a random upstream gradient; dx, dw, dbias: the gradients of sum(y * dy)
"""
import numpy as np
import torch
import torch.nn.functional as F

from make_fixtures import fixture_out, new_file, new_group, put, torch_deterministic  # the same file settings

# name: (N, C, H, W, OC, KH, KW, stride, padding ([h, w] or "same"), dilation, groups, bias)
CASES = {
    "grouped":       (2, 4, 7, 6, 6, 3, 3, [1, 1], [1, 1], [1, 1], 2, True),
    "depthwise_m1":  (2, 3, 8, 8, 3, 3, 3, [2, 2], [1, 1], [1, 1], 3, True),
    "depthwise_m2":  (2, 3, 7, 7, 6, 3, 3, [1, 1], "same", [2, 2], 3, False),
    "strided":       (2, 3, 9, 8, 4, 3, 2, [2, 3], [1, 0], [1, 1], 1, True),
    "padded_asym":   (2, 2, 5, 6, 4, 3, 5, [1, 1], [0, 2], [1, 1], 2, True),
    "same_even":     (1, 2, 6, 5, 3, 2, 4, [1, 1], "same", [1, 1], 1, True),
    "dilated":       (2, 4, 9, 9, 4, 3, 3, [1, 2], [2, 1], [2, 1], 2, True),
    "nonsquare_dw":  (2, 4, 6, 9, 4, 1, 5, [1, 1], [0, 2], [1, 1], 4, False),
}


def same_padding(k, dil):
    """PyTorch 1.13's padding='same' (stride 1): total dil*(k-1), the odd one at the bottom/right."""
    total = dil * (k - 1)
    return total // 2, total - 2 * (total // 2)


def write_case(f, name, case, seed):
    N, C, H, W, OC, KH, KW, stride, padding, dil, groups, has_bias = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, H, W, generator=g).requires_grad_()
    w = (torch.randn(OC, C // groups, KH, KW, generator=g) * 0.5).requires_grad_()
    b = torch.randn(OC, generator=g).requires_grad_() if has_bias else None
    y = F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dil, groups=groups)
    dy = torch.randn(y.shape, generator=g)
    (y * dy).sum().backward()
    if padding == "same":
        (ph, eh), (pw, ew) = same_padding(KH, dil[0]), same_padding(KW, dil[1])
    else:
        (ph, pw), eh, ew = padding, 0, 0
    grp = new_group(f, name)
    put(grp, "geom", [stride[0], stride[1], ph, pw, dil[0], dil[1], groups, eh, ew, padding == "same"],
        np.int32)
    put(grp, "x", x.detach())
    put(grp, "w", w.detach())
    put(grp, "y", y.detach())
    put(grp, "dy", dy)
    put(grp, "dx", x.grad)
    put(grp, "dw", w.grad)
    if has_bias:
        put(grp, "bias", b.detach())
        put(grp, "dbias", b.grad)


def main():
    out = fixture_out("tests/make_fixtures_conv.py", "tests/fixtures/torch_conv.h5")
    torch_deterministic()
    with new_file(out) as f:
        for i, (name, case) in enumerate(CASES.items()):
            write_case(f, name, case, 2000 + i)


if __name__ == "__main__":
    main()
