#!/usr/bin/python3
"""Writes the PyTorch references of two whole models with merges, a residual network (add) and a two-branch
network (concat), which tests/test_graph_parity.c builds from a config and checks qtrain against.

Usage: /usr/bin/python3 tests/make_fixtures_graph.py tests/fixtures/torch_graph.h5   (or: make fixtures)

Needs Debian's python3-torch (1.13), python3-h5py and python3-numpy. float32, one thread, fixed seeds, no
timestamps: the same bytes on every run of the same torch version. The torch modules carry the qtrain layer
names, so parameters are "<layer>/weight|bias" as qtrain names them (PyTorch layout).

Models (input (4, 3, 7, 7), 5 classes; batch norms eps 1e-5, momentum 0.1; their weight and bias drawn away
from 1 and 0 so a dropped gamma or beta shows):
  /resnet  stem conv 3->4 k3 p1 -> bn -> relu -> block 1: conv-bn-relu-conv-bn + the block's input -> relu
           -> block 2: conv 4->8 k3 s2 p1 -> bn -> relu -> conv 8->8 k3 p1 -> bn, plus a strided 1x1 shortcut
           conv 4->8 s2 (with bias) of the block's input -> relu -> globalavgpool -> dense 8->5
  /catnet  stem conv 3->4 k3 p1 -> bn -> relu, then two branches of it: depthwise conv k3 p1 (groups 4) -> bn
           -> relu -> pointwise conv 4->6; and a grouped dilated conv 4->4 k3 p2 d2 (groups 2); concatenated
           on the channel axis (10) -> bn -> relu -> globalavgpool -> dense 10->5
Each group (attributes: seed, optimizer, and config: the qtrain model config the test builds, which must equal its own):
  x, labels, params/       the batch and the initial parameters (running statistics start at 0 and 1)
  logits, loss, grads/, grad_x
                           one forward in train mode (batch statistics) and the backward of the mean softmax
                           cross-entropy
  losses (STEPS,)          training from the initial parameters with the group's optimizer (attribute
                           "optimizer"): the loss before each step
  params_final/, buffers/<bn>/running_mean|running_var|num_batches_tracked (int64)
                           parameters and running statistics after the STEPS steps
  x_eval, logits_eval      eval mode (running statistics) of the trained model on another batch
"""
import copy
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# the same file and dataset settings, and the same train-mode step and training (STEPS steps, gradients 0 or
# above make_fixtures.py's MIN_GRAD)
from make_fixtures import fixture_out, forward_backward, grads_ok, new_group, open_fixture, put, put_params, put_step
from make_fixtures import train

BATCH, IN_SHAPE, CLASSES = 4, (3, 7, 7), 5
# A ReLU input closer than this to 0 could fall on the other side in a float32 implementation that sums in
# another order (outputs of batch norm differ by a few 1e-7 between the two), flipping that element's gradient;
# such draws are rejected. 1e-3 as in make_fixtures.py would reject nearly every draw of these ~3000 elements.
KINK_MARGIN = 1e-4


def conv(cin, cout, k, **kw):
    return nn.Conv2d(cin, cout, k, **kw)


class StemNet(nn.Module):
    """What both models start with: stem conv 3->4 k3 p1 (no bias) -> stem_bn -> relu, built first so that the
    seeded initialization and the parameter order begin with it. relu() records each ReLU input in taps. A model's
    CONFIG is STEM_CONFIG, its own layers and HEAD_CONFIG (globalavgpool -> dense to the classes)."""
    STEM_CONFIG = """\
model:
  input: [3, 7, 7]
  layers:
    - {name: stem, type: conv2d, out_channels: 4, kernel: 3, padding: 1, bias: false}
    - {name: stem_bn, type: batchnorm2d}
    - {name: stem_relu, type: relu}
"""
    HEAD_CONFIG = """\
    - {name: gap, type: globalavgpool}
    - {name: head, type: dense, units: 5}
"""

    def __init__(self):
        super().__init__()
        self.stem = conv(3, 4, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(4)

    @staticmethod
    def relu(h, taps):
        taps.append(h)
        return F.relu(h)

    def stem_relu(self, x, taps):
        return self.relu(self.stem_bn(self.stem(x)), taps)


class ResNet(StemNet):
    CONFIG = StemNet.STEM_CONFIG + """\
    - {name: b1_conv1, type: conv2d, out_channels: 4, kernel: 3, padding: 1, bias: false}
    - {name: b1_bn1, type: batchnorm2d}
    - {name: b1_relu1, type: relu}
    - {name: b1_conv2, type: conv2d, out_channels: 4, kernel: 3, padding: 1, bias: false}
    - {name: b1_bn2, type: batchnorm2d}
    - {name: b1_add, type: add, inputs: [b1_bn2, stem_relu]}
    - {name: b1_relu2, type: relu}
    - {name: b2_conv1, type: conv2d, out_channels: 8, kernel: 3, stride: 2, padding: 1, bias: false}
    - {name: b2_bn1, type: batchnorm2d}
    - {name: b2_relu1, type: relu}
    - {name: b2_conv2, type: conv2d, out_channels: 8, kernel: 3, padding: 1, bias: false}
    - {name: b2_bn2, type: batchnorm2d}
    - {name: b2_short, type: conv2d, out_channels: 8, kernel: 1, stride: 2, inputs: [b1_relu2]}
    - {name: b2_add, type: add, inputs: [b2_bn2, b2_short]}
    - {name: b2_relu2, type: relu}
""" + StemNet.HEAD_CONFIG

    def __init__(self):
        super().__init__()
        self.b1_conv1 = conv(4, 4, 3, padding=1, bias=False)
        self.b1_bn1 = nn.BatchNorm2d(4)
        self.b1_conv2 = conv(4, 4, 3, padding=1, bias=False)
        self.b1_bn2 = nn.BatchNorm2d(4)
        self.b2_conv1 = conv(4, 8, 3, stride=2, padding=1, bias=False)
        self.b2_bn1 = nn.BatchNorm2d(8)
        self.b2_conv2 = conv(8, 8, 3, padding=1, bias=False)
        self.b2_bn2 = nn.BatchNorm2d(8)
        self.b2_short = conv(4, 8, 1, stride=2)
        self.head = nn.Linear(8, 5)

    def forward(self, x, taps):
        s = self.stem_relu(x, taps)
        h = self.relu(self.b1_bn1(self.b1_conv1(s)), taps)
        b1 = self.relu(self.b1_bn2(self.b1_conv2(h)) + s, taps)
        h = self.relu(self.b2_bn1(self.b2_conv1(b1)), taps)
        h = self.relu(self.b2_bn2(self.b2_conv2(h)) + self.b2_short(b1), taps)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


class CatNet(StemNet):
    CONFIG = StemNet.STEM_CONFIG + """\
    - {name: dw, type: conv2d, out_channels: 4, kernel: 3, padding: 1, groups: 4, bias: false}
    - {name: dw_bn, type: batchnorm2d}
    - {name: dw_relu, type: relu}
    - {name: pw, type: conv2d, out_channels: 6, kernel: 1, bias: false}
    - {name: gc, type: conv2d, out_channels: 4, kernel: 3, padding: 2, dilation: 2, groups: 2, bias: false,
       inputs: [stem_relu]}
    - {name: cat, type: concat, inputs: [pw, gc]}
    - {name: cat_bn, type: batchnorm2d}
    - {name: cat_relu, type: relu}
""" + StemNet.HEAD_CONFIG

    def __init__(self):
        super().__init__()
        self.dw = conv(4, 4, 3, padding=1, groups=4, bias=False)
        self.dw_bn = nn.BatchNorm2d(4)
        self.pw = conv(4, 6, 1, bias=False)
        self.gc = conv(4, 4, 3, padding=2, dilation=2, groups=2, bias=False)
        self.cat_bn = nn.BatchNorm2d(10)
        self.head = nn.Linear(10, 5)

    def forward(self, x, taps):
        s = self.stem_relu(x, taps)
        a = self.pw(self.relu(self.dw_bn(self.dw(s)), taps))
        h = self.relu(self.cat_bn(torch.cat([a, self.gc(s)], 1)), taps)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4, foreach=False)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, foreach=False)


MODELS = {
    # name: (class, optimizer, its description, first seed)
    "resnet": (ResNet, sgd, "torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=5e-4)", 1),
    "catnet": (CatNet, adam, "torch.optim.Adam(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)", 1001),
}


def kinks_ok(taps):
    return all(t.detach().abs().min().item() >= KINK_MARGIN for t in taps)


def step_ok(taps, model):
    """The taps are the ReLU inputs (plain tensors); Adam divides a gradient by its own RMS, so a nonzero but tiny
    gradient would be rounding noise whose update (~lr) is not reproducible: grads_ok rejects it."""
    return kinks_ok(taps) and grads_ok(model)


def draw(cls, seed):
    torch.manual_seed(seed)
    model = cls()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=g) - 0.5)
    x = torch.randn(BATCH, *IN_SHAPE, generator=g)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
    x_eval = torch.randn(BATCH, *IN_SHAPE, generator=g)
    return model, x, labels, x_eval


def eval_logits(model, x_eval):
    model.eval()
    taps = []
    with torch.no_grad():
        logits = model(x_eval, taps)
    return logits if kinks_ok(taps) else None


def first_good(cls, make_opt, seed):
    """The first seed from `seed` on whose draw stays clear of every kink in the step, the training and eval."""
    for s in range(seed, seed + 1000):
        model, x, labels, x_eval = draw(cls, s)
        init = copy.deepcopy(model.state_dict())
        fb = forward_backward(model, x, labels, step_ok)
        if fb is None:
            continue
        trained = cls()
        trained.load_state_dict(init)
        losses = train(trained, x, labels, make_opt, step_ok)
        if losses is None:
            continue
        logits_eval = eval_logits(trained, x_eval)
        if logits_eval is None:
            continue
        model.load_state_dict(init)  # the forward above moved the running statistics; params/ are unchanged
        return s, model, x, labels, fb, trained, losses, x_eval, logits_eval
    raise SystemExit(f"no {cls.__name__} seed in {seed}..{seed + 999} keeps the ReLU inputs and grads clear")


def write_model(f, name, cls, make_opt, opt_desc, seed):
    s, model, x, labels, fb, trained, losses, x_eval, logits_eval = first_good(cls, make_opt, seed)
    g = new_group(f, name)
    g.attrs["seed"] = s
    g.attrs["optimizer"] = opt_desc
    g.attrs["config"] = cls.CONFIG
    put_step(g, model, x, labels, fb)
    put(g, "losses", losses)
    put_params(new_group(g, "params_final"), trained)
    buffers = new_group(g, "buffers")
    for mname, m in trained.named_modules():
        if isinstance(m, nn.BatchNorm2d):
            b = new_group(buffers, mname)
            put(b, "running_mean", m.running_mean.numpy())
            put(b, "running_var", m.running_var.numpy())
            put(b, "num_batches_tracked", m.num_batches_tracked.numpy(), np.int64)
    put(g, "x_eval", x_eval.numpy())
    put(g, "logits_eval", logits_eval.numpy())
    return s


def main():
    out = fixture_out("tests/make_fixtures_graph.py", "tests/fixtures/torch_graph.h5")
    with open_fixture(out, "tests/make_fixtures_graph.py (make fixtures)",
                      "PyTorch float32 references for tests/test_graph_parity.c (see the generator's docstring).") as f:
        seeds = [write_model(f, name, *spec) for name, spec in MODELS.items()]
    print(f"{out}: seeds {seeds}, {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    main()
