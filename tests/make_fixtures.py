#!/usr/bin/python3
"""Writes the PyTorch reference fixtures that tests/test_torch.c checks qtrain against.

Usage: /usr/bin/python3 tests/make_fixtures.py tests/fixtures/torch_ref.h5   (or: make fixtures)

Needs Debian's python3-torch (1.13), python3-h5py and python3-numpy. Everything is float32 on one thread
from fixed seeds, so the file is the same on every run of the same torch version.

Groups (parameter datasets are named like qtrain's params, "<module>/weight" and "<module>/bias",
in PyTorch layout: dense (out, in), conv (OC, C, KH, KW)):
  /mlp             x (4, 12) -> fc1 12->16 -> relu -> fc2 16->8 -> gelu(tanh) -> head 8->5
  /cnn             x (3, 1, 10, 10) -> conv1 1->4 k3 p1 -> relu -> maxpool k2 -> conv2 4->6 k3 p1 -> tanh
                   -> avgpool k2 s2 -> flatten (24) -> head 24->5
                   both with: labels, params/, logits, loss (mean softmax cross-entropy), grads/, grad_x
  /adamw, /sgd     the /mlp model trained 5 steps on its batch: losses (5,) before each step, params_final/
  /mlp_ce_extreme  logits of magnitude up to 80 with their cross-entropy loss and grad_logits
"""
import os
import sys

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from h5py import h5f, h5g, h5p

# A ReLU pre-activation or maxpool runner-up closer than this to the kink/max could flip between two float32
# implementations that sum in different orders (their differences are ~1e-6 here), so such draws are rejected.
KINK_MARGIN = 1e-3
# AdamW divides a gradient by its own RMS, so a gradient element that is nonzero but tiny is dominated by
# rounding noise and its update (~lr) would not be reproducible. Grads must be exactly 0 (dead ReLU) or above this.
MIN_GRAD = 1e-5
STEPS = 5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x, taps=None):
        h = self.fc1(x)
        if taps is not None:
            taps.append(("relu", h))
        h = F.gelu(self.fc2(F.relu(h)), approximate="tanh")
        return self.head(h)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1, stride=1)
        self.head = nn.Linear(6 * 2 * 2, 5)

    def forward(self, x, taps=None):
        h = self.conv1(x)
        if taps is not None:
            taps.append(("relu", h))
        h = F.relu(h)
        if taps is not None:
            taps.append(("maxpool", h))
        h = F.max_pool2d(h, 2)
        h = torch.tanh(self.conv2(h))
        h = F.avg_pool2d(h, 2, stride=2)
        return self.head(torch.flatten(h, 1))


def kinks_ok(taps):
    """True if no ReLU input is within KINK_MARGIN of 0 and every 2x2 maxpool window has a clear winner.

    Windows whose inputs are all 0 (ReLU'd away) may tie: whichever element takes the gradient, the ReLU
    before the pool multiplies it by 0, so the tie cannot change any result."""
    for kind, t in taps:
        t = t.detach()
        if kind == "relu" and t.abs().min().item() < KINK_MARGIN:
            return False
        if kind == "maxpool":
            n, c, h, w = t.shape
            win = t[:, :, : h // 2 * 2, : w // 2 * 2].reshape(n, c, h // 2, 2, w // 2, 2)
            win = win.permute(0, 1, 2, 4, 3, 5).reshape(-1, 4)
            top2 = win.topk(2, dim=1).values
            live = top2[:, 0] > 0
            if ((top2[:, 0] - top2[:, 1])[live] < KINK_MARGIN).any():
                return False
    return True


def grads_ok(model):
    for p in model.parameters():
        g = p.grad.abs()
        if ((g > 0) & (g < MIN_GRAD)).any():
            return False
    return True


def step_ok(taps, model):
    return kinks_ok(taps) and grads_ok(model)


# forward_backward() and train() run the model in train mode (batch statistics for batch norms) and hand each
# step's taps and the model to `ok`, whose False rejects the draw; generators with other kinks pass their own.
def forward_backward(model, x, labels, ok=step_ok):
    """logits, loss and grads (params and x) of one mean cross-entropy step; None if a kink is too close."""
    taps = []
    model.train().zero_grad()
    x = x.clone().requires_grad_(True)
    logits = model(x, taps)
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    if not ok(taps, model):
        return None
    return logits.detach(), loss.detach(), x.grad.detach()


def train(model, x, labels, make_opt, ok=step_ok):
    """STEPS optimizer steps on one batch: the loss before each, or None if a step came close to a kink."""
    opt = make_opt(model.parameters())
    model.train()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        taps = []
        loss = F.cross_entropy(model(x, taps), labels)
        loss.backward()
        if not ok(taps, model):
            return None
        losses.append(loss.item())
        opt.step()
    return np.array(losses, dtype=np.float32)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False)


def draw(seed, make_model, x_shape, classes):
    torch.manual_seed(seed)
    model = make_model()
    x = torch.randn(*x_shape)
    labels = torch.randint(0, classes, (x_shape[0],))
    return model, x, labels


def first_good_mlp(seed):
    """The first seed from `seed` on whose MLP stays clear of every kink, also while it trains."""
    for s in range(seed, seed + 1000):
        model, x, labels = draw(s, MLP, (4, 12), 5)
        fb = forward_backward(model, x, labels)
        if fb is None:
            continue
        runs = {}
        for name, make_opt in (("adamw", adamw), ("sgd", sgd)):
            m2 = MLP()
            m2.load_state_dict(model.state_dict())
            losses = train(m2, x, labels, make_opt)
            if losses is None:
                break
            runs[name] = (losses, m2)
        else:
            return s, model, x, labels, fb, runs
    raise SystemExit("no MLP seed clear of the ReLU kink in 1000 tries")


def first_good_cnn(seed):
    for s in range(seed, seed + 1000):
        model, x, labels = draw(s, CNN, (3, 1, 10, 10), 5)
        fb = forward_backward(model, x, labels)
        if fb is not None:
            return s, model, x, labels, fb
    raise SystemExit("no CNN seed clear of the ReLU/maxpool kinks in 1000 tries")


# Objects are created without timestamps, so regenerating the file gives the same bytes.
def new_group(parent, name):
    if name in parent:
        return parent[name]
    gcpl = h5p.create(h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    return h5py.Group(h5g.create(parent.id, name.encode(), gcpl=gcpl))


def new_file(path):
    # v108: compact object headers (a smaller file) that any HDF5 >= 1.8 still reads.
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_V18, h5f.LIBVER_V18)
    fcpl = h5p.create(h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)
    return h5py.File(h5f.create(path.encode(), h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


def torch_deterministic():
    """float32 on one thread with deterministic kernels: what makes a fixture the same on every run."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)


def fixture_out(script, default_out):
    """The output path, the only command-line argument of every generator."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: /usr/bin/python3 {script} {default_out}")
    return sys.argv[1]


def open_fixture(out, generator=None, comment=None):
    """new_file(out) (its directory made first) with torch deterministic and the attributes every fixture file
    carries: torch_version, then generator and comment when given (in this order, which the file's bytes keep)."""
    torch_deterministic()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    f = new_file(out)
    f.attrs["torch_version"] = f"{torch.__version__}"
    if generator is not None:
        f.attrs["generator"] = generator
    if comment is not None:
        f.attrs["comment"] = comment
    return f


def put(group, name, value, dtype=np.float32):
    return group.create_dataset(name, data=np.asarray(value, dtype=dtype), track_times=False)


def put_params(group, model, grads=False):
    for name, p in model.named_parameters():
        module, tensor = name.rsplit(".", 1)
        put(new_group(group, module), tensor, (p.grad if grads else p).detach().numpy())


def put_step(g, model, x, labels, fb):
    """The batch, the initial params/ and what forward_backward() returned (fb) of it: logits, loss, grads/, grad_x."""
    logits, loss, grad_x = fb
    put(g, "x", x.numpy())
    put(g, "labels", labels.numpy(), np.int32)
    put_params(new_group(g, "params"), model)
    put(g, "logits", logits.numpy())
    put(g, "loss", loss.numpy())
    put_params(new_group(g, "grads"), model, grads=True)
    put(g, "grad_x", grad_x.numpy())


def write_model(f, name, comment, seed, model, x, labels, fb):
    g = new_group(f, name)
    g.attrs["comment"] = comment
    g.attrs["seed"] = seed
    put_step(g, model, x, labels, fb)


def write_run(f, name, comment, losses, model):
    g = new_group(f, name)
    g.attrs["comment"] = comment
    put(g, "losses", losses)
    put_params(new_group(g, "params_final"), model)


def write_ce_extreme(f):
    # Rows: label logit far above the rest (loss ~ 0, other probs underflow), far below (loss ~ 160), two
    # logits tied at the top, and a row mixing +-80 with O(1) values. Naive exp() overflows on all of them.
    logits = torch.tensor([[80.0, -80.0, 3.0, -1.5, 79.0],
                           [-80.0, 80.0, 0.5, -79.5, 2.0],
                           [80.0, 80.0, -80.0, 0.0, 1.0],
                           [-1.0, 0.25, 80.0, -80.0, 40.0]], requires_grad=True)
    labels = torch.tensor([0, 0, 1, 4])
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    g = new_group(f, "mlp_ce_extreme")
    g.attrs["comment"] = "mean softmax cross-entropy of logits up to +-80: loss and d loss / d logits"
    put(g, "logits", logits.detach().numpy())
    put(g, "labels", labels.numpy(), np.int32)
    put(g, "loss", loss.detach().numpy())
    put(g, "grad_logits", logits.grad.numpy())


def main():
    out = fixture_out("tests/make_fixtures.py", "tests/fixtures/torch_ref.h5")
    torch_deterministic()
    mlp_seed, mlp, x, labels, fb, runs = first_good_mlp(1)
    cnn_seed, cnn, cx, clabels, cfb = first_good_cnn(101)

    with open_fixture(out, "tests/make_fixtures.py (make fixtures)",
                      "PyTorch float32 references for tests/test_torch.c. Params are named "
                      "<module>/weight|bias in PyTorch layout; loss is the mean softmax cross-entropy.") as f:
        write_model(f, "mlp", "x(4,12) -> fc1 12->16 -> relu -> fc2 16->8 -> gelu(approximate='tanh') -> head 8->5; "
                    "logits, loss, grads of params and of x", mlp_seed, mlp, x, labels, fb)
        write_model(f, "cnn", "x(3,1,10,10) -> conv1 1->4 k3 p1 -> relu -> maxpool2d k2 -> conv2 4->6 k3 p1 s1 -> "
                    "tanh -> avgpool2d k2 s2 -> flatten(24) -> head 24->5; logits, loss, grads of params and of x",
                    cnn_seed, cnn, cx, clabels, cfb)
        write_run(f, "adamw", "the /mlp params after 5 torch.optim.AdamW steps (lr 1e-2, betas (0.9, 0.999), eps 1e-8, "
                  "weight_decay 0.1, foreach=False) on the /mlp batch; losses[i] is the loss before step i",
                  *runs["adamw"])
        write_run(f, "sgd", "the /mlp params after 5 torch.optim.SGD steps (lr 0.05, momentum 0.9, nesterov, "
                  "weight_decay 0.01, foreach=False) on the /mlp batch; losses[i] is the loss before step i",
                  *runs["sgd"])
        write_ce_extreme(f)
    print(f"{out}: mlp seed {mlp_seed}, cnn seed {cnn_seed}, {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    main()
