#!/usr/bin/python3
"""Writes the PyTorch references of QAT with a batch norm folded in (torch's ConvBn2d and LinearBn1d QAT modules,
_forward_approximate) that tests/test_qat_bn.c checks qtrain's folded QAT layers against.

Usage: /usr/bin/python3 tests/make_fixtures_qatbn.py tests/fixtures/torch_qatbn.h5

Needs Debian's python3-torch (1.13), python3-h5py and python3-numpy. float32, one thread, fixed seeds, no
timestamps: the same bytes on every run of the same torch version.

The weight's fake quant is int4 per output channel with fixed power-of-two scales (torch's
fake_quantize_per_channel_affine, zero point 0, codes -8..7: what a TQT range of log2 threshold log2(8 s) gives
in qtrain, x / s being exact for such s), chosen from the initial folded weight so that some weights clip.

One group per case, /<case>/ (attributes eps, momentum, steps, freeze_at, lr):
  params/<layer>/weight, bias (if any), params/bn/weight, bias: the initial values
  scale  (OC,) the weight fake quant's scales
  x, dy  (STEPS, ...) each step's batch and the upstream gradient of the output
  y, dx  (STEPS, ...) the module's output and the input's gradient in that step (train mode)
  dweight, dbias, dgamma, dbeta (STEPS, ...) the parameters' gradients in that step (before its update)
  running_mean, running_var (STEPS, OC) after the step
  num_batches_tracked int64
  x_eval, y_eval  eval mode after the last step
Each step: forward, backward of sum(y * dy), then SGD p -= lr * grad on every parameter. Steps from freeze_at on
(0-based) run with freeze_bn_stats(): running statistics used, not updated.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.intrinsic.qat as nniqat
from torch.ao.quantization import QConfig

from make_fixtures import fixture_out, new_group, open_fixture, put  # the same file and dataset settings

STEPS = 5
FREEZE_AT = 3
LR = 0.05
QMIN, QMAX = -8, 7


class FixedPerChannelFakeQuant(nn.Module):
    """int4 per output channel with scales set once (set_scale), the clipped straight-through gradient."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("zero_point", torch.zeros(1, dtype=torch.int32))

    def set_scale(self, s):
        self.scale = s.clone()
        self.zero_point = torch.zeros(s.numel(), dtype=torch.int32)

    def forward(self, w):
        return torch.fake_quantize_per_channel_affine(w, self.scale, self.zero_point, 0, QMIN, QMAX)


QCONFIG = QConfig(activation=nn.Identity, weight=FixedPerChannelFakeQuant)

# name: (kind, N, input shape per example, OC, stride, bias)
CASES = {
    "convbn": ("conv", 3, (3, 6, 6), 4, 1, True),
    "convbn_nobias": ("conv", 2, (2, 7, 7), 3, 2, False),
    "linearbn": ("linear", 6, (5,), 4, 1, True),
}


def randn(g, *shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, generator=g) * scale + shift


def make_module(kind, in_shape, oc, stride, bias):
    if kind == "conv":
        return nniqat.ConvBn2d(in_shape[0], oc, 3, stride=stride, padding=1, bias=bias, eps=1e-5, momentum=0.1,
                               qconfig=QCONFIG)
    return nniqat.LinearBn1d(in_shape[0], oc, bias=bias, eps=1e-5, momentum=0.1, qconfig=QCONFIG)


def write_case(f, name, seed):
    kind, n, in_shape, oc, stride, bias = CASES[name]
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    m = make_module(kind, in_shape, oc, stride, bias)
    with torch.no_grad():
        m.weight.copy_(randn(g, *m.weight.shape, scale=0.4))
        if bias:
            m.bias.copy_(randn(g, oc, scale=0.3))
        m.bn.weight.copy_(randn(g, oc, scale=0.3, shift=1.0))
        m.bn.bias.copy_(randn(g, oc, scale=0.5))
        m.bn.running_mean.copy_(randn(g, oc, scale=0.2))
        m.bn.running_var.copy_(torch.rand(oc, generator=g) + 0.5)
        # scales: a power of two per channel near amax / 6 of the initial folded weight, so the largest clip
        factor = m.bn.weight / torch.sqrt(m.bn.running_var + m.bn.eps)
        folded = m.weight * factor.reshape([-1] + [1] * (m.weight.dim() - 1))
        amax = folded.abs().reshape(oc, -1).max(dim=1).values
        scale = torch.pow(2.0, torch.round(torch.log2(amax / 6.0)))
    m.weight_fake_quant.set_scale(scale)
    grp = new_group(f, name)
    grp.attrs["eps"] = m.bn.eps
    grp.attrs["momentum"] = m.bn.momentum
    grp.attrs["steps"] = STEPS
    grp.attrs["freeze_at"] = FREEZE_AT
    grp.attrs["lr"] = LR
    params = new_group(grp, "params")
    layer = new_group(params, "layer")
    put(layer, "weight", m.weight.detach())
    if bias:
        put(layer, "bias", m.bias.detach())
    bnp = new_group(params, "bn")
    put(bnp, "weight", m.bn.weight.detach())
    put(bnp, "bias", m.bn.bias.detach())
    put(bnp, "running_mean", m.bn.running_mean)
    put(bnp, "running_var", m.bn.running_var)
    put(grp, "scale", scale)
    rec = {k: [] for k in ("x", "dy", "y", "dx", "dweight", "dbias", "dgamma", "dbeta", "running_mean",
                           "running_var")}
    m.train()
    for step in range(STEPS):
        if step == FREEZE_AT:
            m.freeze_bn_stats()  # what nniqat.freeze_bn_stats applies to ConvBn modules (1.13 skips LinearBn1d)
        x = randn(g, n, *in_shape).requires_grad_(True)
        m.zero_grad()
        y = m(x)
        dy = randn(g, *y.shape)
        y.backward(dy)
        rec["x"].append(x.detach())
        rec["dy"].append(dy)
        rec["y"].append(y.detach())
        rec["dx"].append(x.grad)
        rec["dweight"].append(m.weight.grad.clone())
        if bias:
            rec["dbias"].append(m.bias.grad.clone())
        rec["dgamma"].append(m.bn.weight.grad.clone())
        rec["dbeta"].append(m.bn.bias.grad.clone())
        rec["running_mean"].append(m.bn.running_mean.clone())
        rec["running_var"].append(m.bn.running_var.clone())
        with torch.no_grad():
            for p in m.parameters():
                p -= LR * p.grad
    for k, v in rec.items():
        if v:
            put(grp, k, torch.stack(v).numpy())
    put(grp, "num_batches_tracked", m.bn.num_batches_tracked.numpy(), np.int64)
    m.eval()
    x_eval = randn(g, n, *in_shape)
    with torch.no_grad():
        y_eval = m(x_eval)
    put(grp, "x_eval", x_eval)
    put(grp, "y_eval", y_eval)


def main():
    with open_fixture(fixture_out("tests/make_fixtures_qatbn.py", "tests/fixtures/torch_qatbn.h5")) as f:
        for k, name in enumerate(CASES):
            write_case(f, name, 500 + k)


if __name__ == "__main__":
    main()
