#!/usr/bin/python3
"""The PyTorch side of `make bench-torch`.

    torch_bench.py run --config bench/configs/cnn.yaml [--steps N] [--warmup N]
                       [--eval-batches N] [--since-ns NS] [--ptq auto|fx|eager]
    torch_bench.py train --config FILE [--epochs N] [--threads N]
    torch_bench.py table --qtrain DIR --torch DIR [--core NAME]
    torch_bench.py agree --config FILE [--batches N]

`run` measures one bench config the way `qtrain bench` does and prints the
same `bench:` lines: the model, data, optimizer, LoRA/QLoRA and PTQ setup
are read from the config itself (see bench/README.md for how each is made
equivalent). Run each measurement in its own process, so that peak RSS and
start-up are per measurement.

`train` trains the config's model as configured on its data and prints the
test accuracy after every epoch (`torch:eval`, `torch:final` lines): the
PyTorch reference an accuracy of qtrain's is compared with.

`agree` compares the int8 model `run` times for a PTQ config with the
float model it came from, on the first test batches: how often their
top-1 classes agree and the RMS of the logits' difference relative to
the float logits' RMS. Run it with and without the AVX2 cap
(DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2) to see whether the
capped int8 model computes what the uncapped one does.

`table` reads the outputs of bench/run.sh (one <config>.txt per config in
each directory) and prints the side-by-side table with the targets.

Needs Debian's python3-torch (with numpy and yaml).
"""
import argparse
import math
import os
import resource
import sys
import time

# Before torch loads OpenBLAS: PyTorch parallelises with its own threads
# (torch.set_num_threads); OpenBLAS threads on top would oversubscribe.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

EVAL_WARMUP = 2

from torch_model import Batcher, Data, apply_lora, build_model, fail, load_config, make_optimizer, quantize_int8  # noqa: E402


# ---- measurements ------------------------------------------------------------------------------------

def startup_s(first_ns, since_ns):
    if since_ns:
        return (first_ns - since_ns) * 1e-9, "since-ns"
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - (time.time_ns() - first_ns) * 1e-9 - start, "proc-stat"


def is_mse(cfg):
    """train.loss: mse (qtrain's default is cross_entropy); with data.target: input the batch is its own target."""
    return (cfg["train"].get("loss") or "cross_entropy") == "mse"


def objective(out, x, y, mse, reduction="mean"):
    """The training loss: cross-entropy on the labels, or the mean squared error against the input itself."""
    import torch.nn.functional as F
    if mse:
        return F.mse_loss(out, x.reshape(out.shape), reduction=reduction)
    return F.cross_entropy(out, y, reduction=reduction)


def roc_auc(scores, positive):
    """ROC AUC as the Mann-Whitney statistic: ties count one half (average ranks); NaN without both kinds."""
    import numpy as np
    s = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def train_step(model, opt, params, x, y, grad_clip, mse=False):
    """One optimizer step of the mean cross-entropy on (x, y) (or, mse, the mean squared error against x),
    gradients clipped to norm grad_clip if > 0 (as qtrain's train.grad_clip); returns the loss before the step
    (a tensor)."""
    import torch
    loss = objective(model(x), x, y, mse)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def bench_train(model, opt, batcher, grad_clip, args, desc, mode, state):
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()

    def step():
        x, y = batcher.next()
        return float(train_step(model, opt, params, x, y, grad_clip))

    for _ in range(args.warmup):
        state.setdefault("first_ns", time.time_ns())
        step()
    ms = []
    t_begin = time.perf_counter()
    loss = float("nan")
    for _ in range(args.steps):
        state.setdefault("first_ns", time.time_ns())
        t0 = time.perf_counter()
        loss = step()
        ms.append((time.perf_counter() - t0) * 1e3)
    timed = time.perf_counter() - t_begin
    ms.sort()
    print("bench:train model:%s mode:%s batch:%d steps:%d warmup:%d samples_per_s:%.1f step_ms:%.3f "
          "step_ms_median:%.3f step_ms_min:%.3f loss:%.4f" % (desc, mode, batcher.bs, args.steps, args.warmup,
                                                               args.steps * batcher.bs / timed,
                                                               timed * 1e3 / args.steps, ms[len(ms) // 2], ms[0],
                                                               loss))


def bench_eval(model, data, bs, args, desc, mode, input_shape, state):
    import numpy as np
    import torch
    import torch.nn.functional as F
    model.eval()
    bs = min(bs, len(data.test_x))
    pos = [0]

    def batch():
        if pos[0] + bs > len(data.test_x):
            pos[0] = 0
        x, y = data.batch(data.test_x, data.test_y, np.arange(pos[0], pos[0] + bs), input_shape)
        pos[0] += bs
        logits = model(x)
        return float(F.cross_entropy(logits, y)) * bs, int((logits.argmax(1) == y).sum())

    with torch.inference_mode():
        for _ in range(EVAL_WARMUP):
            state.setdefault("first_ns", time.time_ns())
            batch()
        ms = []
        t_begin = time.perf_counter()
        for _ in range(args.eval_batches):
            t0 = time.perf_counter()
            batch()
            ms.append((time.perf_counter() - t0) * 1e3)
        timed = time.perf_counter() - t_begin
    ms.sort()
    print("bench:eval model:%s mode:%s batch:%d batches:%d samples_per_s:%.1f batch_ms:%.3f batch_ms_median:%.3f "
          "batch_ms_min:%.3f" % (desc, mode, bs, args.eval_batches, args.eval_batches * bs / timed,
                                 timed * 1e3 / args.eval_batches, ms[len(ms) // 2], ms[0]))


def cmd_run(args):
    import torch
    cfg = load_config(args.config)
    threads = int(cfg["run"].get("threads", 0)) or os.cpu_count()
    torch.set_num_threads(threads)
    torch.manual_seed(int(cfg["run"].get("seed", 1)))
    data = Data(cfg)
    input_shape = list(cfg["model"]["input"])
    model, types, desc = build_model(cfg)
    quant = (cfg.get("quant") or {}).get("mode", "none")
    has_lora = bool((cfg.get("lora") or {}).get("rules") or (cfg.get("lora") or {}).get("trainable"))
    epochs = int(cfg["train"].get("epochs", 1))
    trains = int(cfg["train"].get("steps", 0)) > 0 or epochs > 0
    if quant == "ptq" and not has_lora:
        mode, trains = "ptq", False
        model = quantize_int8(model, types, data, cfg, input_shape, {"fx": True, "eager": False}.get(args.ptq))
        for p in model.parameters():  # inference only (a batch norm that cannot fold keeps float parameters)
            p.requires_grad_(False)
    elif quant in ("none", None):
        mode = "lora" if has_lora else "float"
        if has_lora:
            apply_lora(model, types, cfg)
    elif quant == "ptq":
        mode = "qlora"
        apply_lora(model, types, cfg)
    else:
        fail("quant.mode %s is not supported here" % quant)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print("bench:config name:%s config:%s model:%s mode:%s batch:%d eval_batch:%d threads:%d params_trainable:%d "
          "impl:pytorch-%s" % (cfg["run"].get("name", "run"), args.config, desc, mode,
                               int(cfg["train"].get("batch_size", 64)), int(cfg["train"].get("eval_batch_size", 256)),
                               torch.get_num_threads(), trainable, torch.__version__))
    print("bench:blas core:%s threads:%s" % (os.environ.get("OPENBLAS_CORETYPE", "auto"),
                                             os.environ.get("OPENBLAS_NUM_THREADS")))
    sys.stdout.flush()
    state = {}
    if trains:
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
        bench_train(model, opt, Batcher(data, cfg, input_shape), float(cfg["train"].get("grad_clip", 0.0)), args,
                    desc, mode, state)
    if args.eval_batches > 0:
        bench_eval(model, data, int(cfg["train"].get("eval_batch_size", 256)), args, desc, mode, input_shape, state)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print("bench:mem peak_rss_mb:%.1f" % rss)
    if "first_ns" in state:
        s, clock = startup_s(state["first_ns"], args.since_ns)
        print("bench:startup first_step_s:%.3f first:%s clock:%s" % (s, "train" if trains else "eval", clock))


# ---- reference training ------------------------------------------------------------------------------

def lr_at(cfg, step, total):
    """train.schedule's lr at optimizer step `step` (0-based) of `total`, as nn/schedule.c computes it."""
    o = cfg["train"].get("optimizer", {}) or {}
    base = float(o.get("lr", 1e-3 if o.get("name", "adamw") == "adamw" else 0.01))
    s = cfg["train"].get("schedule", {}) or {}
    kind = s.get("name", "constant")
    warmup = min(int(s.get("warmup_steps", 0)), total)  # clamped to the run, as qtrain does
    if step < warmup:
        return base * (step + 1) / warmup
    after = step - warmup
    if kind == "cosine":
        span = total - warmup
        p = min(after / span, 1.0) if span > 0 else 1.0
        lo = float(s.get("min_lr", 0.0))
        return lo + 0.5 * (base - lo) * (1.0 + math.cos(math.pi * p))
    if kind == "step":
        return base * float(s.get("gamma", 0.1)) ** (after // int(s["step_size"]))
    if kind != "constant":
        fail("lr schedule %r is not supported here" % kind)
    return base


def load_init_from(model, path):
    """model.init_from: /params/<module>/<weight|bias> and a batch norm's /buffers/<module>/<statistic>."""
    import h5py
    import torch
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        fail("model.init_from %s: %s" % (path, e))
    with f:
        for key, t in list(model.state_dict(keep_vars=True).items()):
            mod, leaf = key.rsplit(".", 1)
            group = "buffers" if leaf in ("running_mean", "running_var", "num_batches_tracked") else "params"
            name = "/%s/%s/%s" % (group, mod, leaf)
            if name not in f or not isinstance(f[name], h5py.Dataset):
                fail("model.init_from %s: no dataset %s (a float checkpoint of this model expected)" % (path, name))
            v = torch.as_tensor(f[name][()]).reshape(t.shape).to(t.dtype)
            with torch.no_grad():
                t.copy_(v)


def evaluate(model, data, x_all, y_all, bs, input_shape, mse=False):
    """(accuracy, mean loss) over a whole split, in eval mode; with mse, (mean absolute error, mean squared
    error, ROC AUC of the per-example squared error against data.anomaly_classes, NaN without them)."""
    import numpy as np
    import torch
    model.eval()
    loss, correct, abs_sum, scores = 0.0, 0, 0.0, []
    with torch.inference_mode():
        for a in range(0, len(x_all), bs):
            x, y = data.batch(x_all, y_all, np.arange(a, min(a + bs, len(x_all))), input_shape)
            out = model(x)
            if mse:
                d = out - x.reshape(out.shape)
                per = (d * d).reshape(len(y), -1).mean(1)
                scores.append(per.double().numpy())
                loss += float(per.double().sum())
                abs_sum += float(d.abs().reshape(len(y), -1).mean(1).double().sum())
            else:
                loss += float(objective(out, x, y, False, reduction="sum"))
                correct += int((out.argmax(1) == y).sum())
    model.train()
    n = max(len(x_all), 1)
    if mse:
        auc = float("nan")
        if data.anomalies and scores:
            auc = roc_auc(np.concatenate(scores), np.isin(y_all, data.anomalies))
        return abs_sum / n, loss / n, auc
    return correct / n, loss / n


def cmd_train(args):
    """Trains the config's model as configured (optimizer, schedule, batch, epochs or steps, seed, transforms,
    grad clipping, dropout) on the config's data and prints the test accuracy after every epoch."""
    import numpy as np
    import torch
    cfg = load_config(args.config)
    if args.epochs is not None:
        cfg["train"]["epochs"], cfg["train"]["steps"] = args.epochs, 0
    threads = args.threads or int(cfg["run"].get("threads", 0)) or os.cpu_count()
    torch.set_num_threads(threads)
    seed = int(cfg["run"].get("seed", 1))
    torch.manual_seed(seed)
    data = Data(cfg)
    input_shape = list(cfg["model"]["input"])
    model, types, desc = build_model(cfg)
    if cfg["model"].get("init_from"):
        load_init_from(model, cfg["model"]["init_from"])
    quant = (cfg.get("quant") or {}).get("mode", "none") or "none"
    lora = cfg.get("lora") or {}
    has_lora = bool(lora.get("rules") or lora.get("trainable"))
    if quant not in ("none", "ptq") or (quant == "ptq" and not has_lora):
        fail("train: quant.mode %s is not trained here (float, LoRA and QLoRA configs are)" % quant)
    mode = ("qlora" if quant == "ptq" else "lora") if has_lora else "float"
    if has_lora:
        apply_lora(model, types, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg)
    bs = int(cfg["train"].get("batch_size", 64))
    ebs = int(cfg["train"].get("eval_batch_size", 256))
    shuffle = bool(cfg["data"].get("shuffle", True))
    drop_last = bool(cfg["data"].get("drop_last", False))
    grad_clip = float(cfg["train"].get("grad_clip", 0.0))
    n = len(data.train_x)
    per_epoch = n // bs if drop_last else (n + bs - 1) // bs
    if per_epoch < 1:
        fail("train: %d training examples make no batch of %d" % (n, bs))
    steps = int(cfg["train"].get("steps", 0))
    total = steps if steps > 0 else int(cfg["train"].get("epochs", 1)) * per_epoch
    print("torch:config name:%s config:%s model:%s mode:%s train:%d val:%d test:%d batch:%d steps:%d "
          "steps_per_epoch:%d threads:%d params_trainable:%d impl:pytorch-%s" %
          (cfg["run"].get("name", "run"), args.config, desc, mode, n, len(data.val_x), len(data.test_x), bs, total,
           per_epoch, torch.get_num_threads(), sum(p.numel() for p in params), torch.__version__))
    sys.stdout.flush()
    log_every = int(cfg["train"].get("log_every", 50))
    rng = np.random.default_rng(seed)
    model.train()
    step, epoch, train_s, seen = 0, 0, 0.0, 0
    mse = is_mse(cfg)
    te = (float("nan"),) * (3 if mse else 2)
    while step < total:
        order = rng.permutation(n) if shuffle else np.arange(n)
        epoch += 1
        t0 = time.perf_counter()
        loss_sum, loss_n = 0.0, 0
        for b in range(per_epoch):
            if step >= total:
                break
            x, y = data.batch(data.train_x, data.train_y, order[b * bs:(b + 1) * bs], input_shape)
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step, total)
            loss = train_step(model, opt, params, x, y, grad_clip, mse)
            loss_sum += float(loss) * len(y)
            loss_n += len(y)
            seen += len(y)
            step += 1
            if log_every and step % log_every == 0:
                print("torch:step step:%d/%d epoch:%d loss:%.4f lr:%.6g elapsed_s:%.1f" %
                      (step, total, epoch, float(loss), opt.param_groups[0]["lr"], train_s + time.perf_counter() - t0))
                sys.stdout.flush()
        train_s += time.perf_counter() - t0
        val = ""
        if len(data.val_x):
            ve = evaluate(model, data, data.val_x, data.val_y, ebs, input_shape, mse)
            val = (" val_mse:%.4f val_mae:%.4f" % (ve[1], ve[0])) if mse else (" val_acc:%.4f val_loss:%.4f" % ve)
        te = evaluate(model, data, data.test_x, data.test_y, ebs, input_shape, mse)
        print("torch:eval epoch:%d step:%d train_loss:%.4f%s %s" %
              (epoch, step, loss_sum / max(loss_n, 1), val, test_words(te, mse)))
        sys.stdout.flush()
    if total == 0:  # train.epochs 0: evaluate only
        te = evaluate(model, data, data.test_x, data.test_y, ebs, input_shape, mse)
        print("torch:eval epoch:0 step:0 %s" % test_words(te, mse))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print("torch:final model:%s epochs:%d steps:%d %s samples_per_s:%.1f train_s:%.1f peak_rss_mb:%.1f" %
          (desc, epoch, step, test_words(te, mse), seen / train_s if train_s else 0.0, train_s, rss))


def test_words(te, mse):
    """The test figures of evaluate()'s result, as qtrain names them."""
    if mse:
        return "test_mse:%.4f test_mae:%.4f test_auc:%.4f" % (te[1], te[0], te[2])
    return "test_acc:%.4f test_loss:%.4f" % te


# ---- the side-by-side table ---------------------------------------------------------------------------

def parse_bench(path):
    """{line kind: {key: value}} of a bench output file; {} if it is missing."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("bench:"):
                    kind, *rest = line.split()
                    out[kind[6:]] = dict(kv.split(":", 1) for kv in rest if ":" in kv)
    except OSError:
        pass
    return out


def num(d, kind, key):
    try:
        return float(d[kind][key])
    except (KeyError, ValueError):
        return None


def fmt(v, unit=""):
    if v is None:
        return "-"
    if unit == "s":
        return "%.3f" % v
    if unit == "share":
        return "%.2f" % v
    return "%.0f" % v if v >= 100 else "%.1f" % v


# A figure whose mean step is this much above its median step was pulled
# down by a few slow steps (on a shared machine, usually other processes).
NOISY = 1.25


def noisy(d, kind):
    mean_key = {"train": "step_ms", "eval": "batch_ms"}.get(kind)
    mean, median = (num(d, kind, mean_key), num(d, kind, mean_key + "_median")) if mean_key else (None, None)
    return mean is not None and median and mean > NOISY * median


def cpu_name():
    """This CPU's model name and the vector ISA that decides the kernels (from /proc/cpuinfo), e.g.
    "AMD EPYC (avx2 avx512f avx512_vnni avx_vnni)": the table's figures hold for that CPU."""
    model, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and model == "?":
                    model = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    isa = [x for x in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if x in flags]
    return "%s (%s)" % (model, " ".join(isa) if isa else "no AVX2")


def cmd_table(args):
    q = {n: parse_bench(os.path.join(args.qtrain, n + ".txt")) for n in CONFIGS}
    t = {n: parse_bench(os.path.join(args.torch, n + ".txt")) for n in CONFIGS}
    rows = []

    def ratio(a, b):
        return a / b if a is not None and b else None

    def row(what, model, cfg, kind, key, unit="", target="", met=None):
        a, b = num(q[cfg], kind, key), num(t[cfg], kind, key)
        r = ratio(a, b)
        mark = key == "samples_per_s"
        fa = fmt(a, unit) + ("*" if mark and a is not None and noisy(q[cfg], kind) else "")
        fb = fmt(b, unit) + ("*" if mark and b is not None and noisy(t[cfg], kind) else "")
        rows.append((what, model, fa, fb, "-" if r is None else "%.2fx" % r, target,
                     "" if met is None else ("yes" if met(a, b, r) else "NO")))

    def ge(x):
        return lambda a, b, r: r is not None and r >= x

    def step_ratio(cfg_a, cfg_b):
        return ratio(num(q[cfg_a], "train", "step_ms"), num(q[cfg_b], "train", "step_ms"))

    for m in MODELS:
        row("train samples/s", m, m, "train", "samples_per_s", target=">= 2.0x PyTorch", met=ge(2.0))
    for m in MODELS:
        row("eval samples/s", m, m, "eval", "samples_per_s")
    for m in ("mlp", "cnn"):
        # against the LoRA bound: the LoRA step's multiply-adds per sample over the full step's (qtrain's count)
        r = step_ratio(m + "-lora", m)
        bound = ratio(num(q[m + "-lora"], "train", "macs_per_sample"), num(q[m], "train", "macs_per_sample"))
        tgt = "LoRA/full step %s (<= 1.05x bound %s)" % ("-" if r is None else "%.2f" % r,
                                                          "-" if bound is None else "%.2f" % bound)
        row("LoRA step samples/s", m, m + "-lora", "train", "samples_per_s", target=tgt if m == "cnn" else "",
            met=(lambda a, b, _r, r=r, bound=bound: r is not None and bound is not None and r <= 1.05 * bound)
            if m == "cnn" else None)
    for m in ("mlp", "cnn"):
        r = step_ratio(m + "-qlora", m + "-lora")
        row("QLoRA step samples/s", m, m + "-qlora", "train", "samples_per_s",
            target="QLoRA/LoRA step %s (<= 1.15)" % ("-" if r is None else "%.2f" % r),
            met=lambda a, b, _r, r=r: r is not None and r <= 1.15)
    for m in MODELS:
        row("PTQ int8 eval samples/s", m, m + "-ptq-int8", "eval", "samples_per_s", target=">= 1.0x PyTorch",
            met=ge(1.0))
    for m in MODELS:
        row("peak RSS MB (training)", m, m, "mem", "peak_rss_mb", target="<= 0.15x PyTorch" if m != "mlp" else "",
            met=(lambda a, b, r: r is not None and r <= 0.15) if m != "mlp" else None)
    for m in MODELS:
        row("start-up to 1st step s", m, m, "startup", "first_step_s", unit="s", target="<= 0.2 s (qtrain)",
            met=lambda a, b, r: a is not None and a <= 0.2)
    for m in MODELS:
        row("GEMM share of a step", m, m, "train", "gemm_share", unit="share")
    for m in MODELS:
        row("step / GEMM-bound limit", m, m, "train", "of_bound", unit="share",
            target=">= 0.75 (qtrain)" if m == "cnn" else "",
            met=(lambda a, b, r: a is not None and a >= 0.75) if m == "cnn" else None)
    # QT has no PyTorch counterpart: its step against qtrain's own float step, the bound by the int8 kernels it ran
    qt = parse_bench(os.path.join(args.qtrain, "cnn-qt.txt"))
    r = ratio(num(qt, "train", "step_ms"), num(q["cnn"], "train", "step_ms"))
    kern = qt.get("config", {}).get("int8_kernel", "")
    lim = 1.0 if kern in ("vnni", "avxvnni", "amx") else 1.3 if kern == "avx2" else None  # none for portable C
    rows.append(("QT step / float step", "cnn", "-" if r is None else "%.2f" % r, "-", "-",
                 "%s (%s int8 kernels)" % ("none" if lim is None else "<= %.1f" % lim, kern or "?"),
                 "" if r is None or lim is None else "yes" if r <= lim else "NO"))
    head = ("measurement", "model", "qtrain", "PyTorch", "qtrain/PyTorch", "target", "met")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    version = next((v["config"]["impl"][8:] for v in t.values() if "impl" in v.get("config", {})), "?")
    print("qtrain vs PyTorch %s: batch 128, 2 threads, OpenBLAS %s kernels on both sides; %s" %
          (version, args.core or "?", cpu_name()))
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    if any("*" in r[2] + r[3] for r in rows):
        print("* the mean step (batch) is over %.2fx the median: a few slow steps, usually other processes on the "
              "machine, pull this figure down; the medians are in the raw outputs" % NOISY)
    missing = [n for n in CONFIGS if not t[n] or not q[n]]
    if missing:
        print("missing measurements (see the outputs in %s and %s): %s" % (args.qtrain, args.torch,
                                                                           ", ".join(missing)))


MODELS = ("mlp", "cnn", "resnet8", "dscnn")
def cmd_agree(args):
    import copy
    import numpy as np
    import torch
    cfg = load_config(args.config)
    if (cfg.get("quant") or {}).get("mode") != "ptq" or (cfg.get("lora") or {}).get("rules"):
        fail("%s: agree compares a PTQ config's int8 model (quant.mode: ptq, no LoRA)" % args.config)
    torch.set_num_threads(int(cfg["run"].get("threads", 0)) or os.cpu_count())
    torch.manual_seed(int(cfg["run"].get("seed", 1)))
    data = Data(cfg)
    input_shape = list(cfg["model"]["input"])
    model, types, desc = build_model(cfg)
    if cfg["model"].get("init_from"):
        load_init_from(model, cfg["model"]["init_from"])
    model.eval()
    ref = copy.deepcopy(model)
    q = quantize_int8(model, types, data, cfg, input_shape, {"fx": True, "eager": False}.get(args.ptq))
    bs = int(cfg["train"].get("eval_batch_size", cfg["train"].get("batch_size", 64)))
    n = min(args.batches, len(data.test_x) // bs)
    if n < 1:
        fail("%s: fewer test images than one batch of %d" % (args.config, bs))
    yq, yf = [], []
    with torch.inference_mode():
        for b in range(n):
            x, _ = data.batch(data.test_x, data.test_y, np.arange(b * bs, (b + 1) * bs), input_shape)
            yq.append(q(x).numpy())
            yf.append(ref(x).numpy())
    yq, yf = np.concatenate(yq), np.concatenate(yf)
    agree = float((yq.argmax(1) == yf.argmax(1)).mean())
    rel = float(np.sqrt(((yq - yf) ** 2).mean() / (yf ** 2).mean()))
    print("bench:agree config:%s model:%s impl:pytorch-%s dnnl_max_cpu_isa:%s images:%d top1_agreement:%.4f "
          "rms_rel:%.4f" % (args.config, desc, torch.__version__, os.environ.get("DNNL_MAX_CPU_ISA", "-"), n * bs,
                            agree, rel))


CONFIGS = ["mlp", "cnn", "resnet8", "dscnn", "mlp-lora", "cnn-lora", "mlp-qlora", "cnn-qlora", "mlp-ptq-int8",
           "cnn-ptq-int8", "resnet8-ptq-int8", "dscnn-ptq-int8"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one measurement of one bench config")
    r.add_argument("--config", required=True)
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--eval-batches", type=int, default=40)
    r.add_argument("--ptq", choices=("auto", "fx", "eager"), default="auto",
                   help="PyTorch's PTQ mode (auto: eager for the old layer set, FX for the rest)")
    r.add_argument("--since-ns", type=int, default=0, help="CLOCK_REALTIME ns at process start ($(date +%%s%%N))")
    tr = sub.add_parser("train", help="train the config's model as configured; the test accuracy per epoch")
    tr.add_argument("--config", required=True)
    tr.add_argument("--epochs", type=int, default=None, help="train this many epochs (overrides train.epochs/steps)")
    tr.add_argument("--threads", type=int, default=0, help="PyTorch threads (default run.threads)")
    t = sub.add_parser("table", help="the side-by-side table of bench/run.sh's outputs")
    t.add_argument("--qtrain", required=True, help="directory of qtrain's <config>.txt outputs")
    t.add_argument("--torch", required=True, help="directory of this script's <config>.txt outputs")
    t.add_argument("--core", default="", help="the OpenBLAS kernel family both sides ran")
    a = sub.add_parser("agree", help="a PTQ config's int8 model against its float model on test batches")
    a.add_argument("--config", required=True)
    a.add_argument("--batches", type=int, default=40)
    a.add_argument("--ptq", choices=("auto", "fx", "eager"), default="auto")
    args = ap.parse_args()
    if args.cmd == "agree":
        if args.batches < 1:
            fail("--batches must be >= 1")
        cmd_agree(args)
    elif args.cmd == "run":
        if args.steps < 1 or args.warmup < 0 or args.eval_batches < 0:
            fail("--steps must be >= 1, --warmup and --eval-batches >= 0")
        cmd_run(args)
    elif args.cmd == "train":
        if args.epochs is not None and args.epochs < 0:
            fail("--epochs must be >= 0")
        cmd_train(args)
    else:
        cmd_table(args)


if __name__ == "__main__":
    main()
