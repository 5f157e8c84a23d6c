#!/usr/bin/python3
"""mpi_scaling.py - what bench/mpi_bench.sh measured on this machine, and a model of data-parallel training on
N such machines over 10 and 25 Gb/s Ethernet, fed by those figures (standard library only).

    /usr/bin/python3 bench/mpi_scaling.py build/bench/mpi/mpi_measured.txt

The input holds the script's greppable lines: `mpi:cpu`, one `mpi:config` per config, the `bench:allreduce`
lines of allreduce_bench. The model (bench/README.md, "Data-parallel training"):

- every node is this machine, one process with 2 threads, training at the measured one-process samples/s S1
  whatever its share of the batch (optimistic for small shares: GEMMs on few rows run slower);
- compute per step t_c = batch per node / S1; weak scaling keeps the config's batch (128) on every node (the
  global batch grows to N x 128: train.batch_size = N x 128), strong scaling splits the config's global batch
  of 128 over the N nodes (the config as it is);
- the gradient sum as a ring all-reduce: t_comm(N) = 2 (N-1)/N * bytes / bandwidth + 2 (N-1) * latency, bytes =
  4 x trainable values. qtrain's sum has the same cost terms: at N > 2 and more than 64 KB it is an all-to-all
  (N-1 exchanges of bytes/N) and an all-gather of the summed chunks (N-1 more); at N = 2 one all-gather, the
  same bytes. Every reference gradient is above 64 KB (below it qtrain sends all bytes to every rank);
- plus the step's own small all-gather (loss, counts, flags: a few doubles), (N-1) * latency; the broadcast of
  batch norm statistics (ResNet-8: 1.2 KB, ceil(log2 N) latencies) is left out;
- bandwidth: the line rate x 1448/1538, TCP's payload in a 1500-byte-MTU frame on the wire;
- latency per message: 30 us, the middle of the 20-50 us that MPI over TCP on 10/25 GbE takes per message
  (kernel network stack both ends, interrupt moderation), or the measured loopback latency if that is higher;
- no overlap of the sum with the backward pass (qtrain sums after the backward);
- predicted samples/s = N * batch per node / (t_c + t_comm + t_small).
"""
import math
import sys

LINK_GBPS = (10, 25)
NODES = (1, 2, 4, 8, 16, 32, 64)
NET_LATENCY_S = 30e-6
TCP_EFFICIENCY = 1448.0 / 1538.0
ROWS = (("cnn", "CNN full fine-tuning"), ("cnn-lora", "CNN LoRA"), ("cnn-qlora", "CNN QLoRA"),
        ("resnet8", "ResNet-8 full fine-tuning"), ("resnet8-lora", "ResNet-8 LoRA"), ("resnet8-qlora", "ResNet-8 QLoRA"))
CROSS_MAX = 100000


def parse(path):
    cpu, configs, sums, skipped = {}, {}, [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            words = line.split()
            if not words:
                continue
            kind = words[0]
            if kind == "mpi:cpu":
                head, _, model = line.partition(" model:")
                cpu = dict(w.split(":", 1) for w in head.split()[1:])
                cpu["model"] = model.strip()
                continue
            kv = dict(w.split(":", 1) for w in words[1:] if ":" in w)
            if kind == "mpi:config":
                configs[kv["name"]] = kv
            elif kind == "mpi:skipped":
                skipped.append(kv)
            elif kind == "bench:allreduce":
                sums.append(kv)
    return cpu, configs, sums, skipped


def num(kv, key):
    try:
        return float(kv.get(key, "nan"))
    except ValueError:
        return math.nan


def fmt(v, digits=0):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                         for i, (c, w) in enumerate(zip(r, widths))) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


def sum_at(sums, label):
    for s in sums:
        if s.get("label") == label:
            return s
    return None


def measured(cpu, configs, sums):
    print(f"Measured on this machine: {cpu.get('model', '?')}, {cpu.get('vcpus', '?')} vCPUs "
          f"({cpu.get('isa', '?').replace(',', ', ')}); 2 ranks share its vCPUs, the sum goes through shared memory")
    rows = []
    for name, _ in ROWS:
        c = configs.get(name)
        if not c:
            continue
        one, two = num(c, "one_proc_2t"), num(c, "two_ranks_1t")
        s = sum_at(sums, name)
        step_ms = 1e3 * num(c, "batch") / two if two > 0 else math.nan
        sum_ms = num(s, "latency_us") / 1e3 if s else math.nan
        med = 1e3 * num(c, "batch") / num(c, "one_proc_2t_step_ms_median")
        rows.append([name, c.get("mode", "?"), fmt(num(c, "params")), fmt(4 * num(c, "params") / 1e6, 3),
                     fmt(one), fmt(med), fmt(two), fmt(two / one, 2) if one > 0 else "-", fmt(num(c, "comm_pct")) + " %",
                     fmt(sum_ms, 3), fmt(100 * sum_ms / step_ms, 1) + " %"])
    table(["config", "mode", "trainable", "gradient MB", "1 proc x 2 thr samples/s", "(from its median step)",
           "2 ranks x 1 thr samples/s",
           "2x1 / 1x2", "comm share (step lines)", "sum alone ms", "sum / step"], rows)
    print("(samples/s: 2 ranks from the step lines after the first window; comm share: time inside the collectives, "
          "waiting for the other rank included; sum alone: allreduce_bench's median at the gradient's size)")
    print()
    print("dist_sum_floats on 2 ranks over the loopback (shared memory), allreduce_bench:")
    rows = [[s["label"], fmt(num(s, "bytes")), fmt(num(s, "latency_us"), 1), fmt(num(s, "mb_per_s"))] for s in sums]
    table(["size", "bytes", "median us", "MB/s sent per rank"], rows)
    print()


def overlap(configs, sums):
    """Whether summing buckets during the backward pass (as PyTorch's DDP does) could pay on 2 ranks."""
    print("Overlapping the sum with the backward pass, 2 ranks (the most a bucketed overlap could hide is the "
          "smaller of the sum and the backward):")
    rows = []
    for name, _ in ROWS:
        c, s = configs.get(name), sum_at(sums, name)
        if not c or not s:
            continue
        step = 1e3 * num(c, "batch") / num(c, "two_ranks_1t")
        comm = step * num(c, "comm_pct") / 100
        alone = num(s, "latency_us") / 1e3
        bwd = num(c, "part_step_ms") - num(c, "part_fwd_ms")
        hide = min(alone, bwd)
        rows.append([name, fmt(step, 1), fmt(comm, 1), fmt(alone, 2), fmt(bwd, 1), fmt(100 * hide / step, 1) + " %"])
    table(["config", "step ms (2 ranks)", "in collectives ms", "sum alone ms", "backward + optimizer ms (64 ex., 1 thr)",
           "overlap could save at most"], rows)
    print("(in collectives - sum alone = waiting for the slower rank, which an overlap does not remove; on this "
          "machine both ranks' threads already fill both vCPUs, so a shared-memory copy in parallel with the "
          "backward competes with it for a core)")
    print()


def crossover(t_c_of, t_comm_of):
    for n in range(2, CROSS_MAX + 1):
        if t_comm_of(n) > t_c_of(n):
            return n
    return None


def model(cpu, configs, sums, skipped):
    tiny = sum_at(sums, "tiny")
    floor = num(tiny, "latency_us") * 1e-6 / 2 if tiny else 0.0  # one all-gather at N = 2: the ring's 2 terms
    lat = max(NET_LATENCY_S, floor if not math.isnan(floor) else 0.0)
    print(f"Scaling model: every node is this machine ({cpu.get('model', '?')}, one process x 2 threads at the "
          f"measured samples/s); latency {lat * 1e6:.0f} us per message (typical MPI over TCP on 10/25 GbE, 20-50 us; "
          f"loopback floor measured: {floor * 1e6:.2f} us); bandwidth = line rate x {TCP_EFFICIENCY:.3f} (TCP "
          "payload at MTU 1500); ring all-reduce of the gradient + one small all-gather per step; no overlap.")
    for gbps in LINK_GBPS:
        bw = gbps * 1e9 / 8 * TCP_EFFICIENCY
        print()
        print(f"{gbps} Gb/s, weak scaling (batch 128 per node), predicted samples/s:")
        rows = []
        for name, what in ROWS:
            c = configs.get(name)
            if not c:
                continue
            s1, batch, grad = num(c, "one_proc_2t"), num(c, "batch"), 4 * num(c, "params")

            def t_comm(n):
                if n == 1:
                    return 0.0
                return 2 * (n - 1) / n * grad / bw + 2 * (n - 1) * lat + (n - 1) * lat

            weak = lambda n: batch / s1
            strong = lambda n: batch / n / s1
            row = [what, fmt(grad / 1e6, 3), fmt(1e3 * batch / s1, 1)]
            row += [fmt(n * batch / (weak(n) + t_comm(n))) for n in NODES]
            if math.isnan(s1 + batch + grad):  # a figure missing from the config's line
                row += ["-", "-"]
            else:
                cw, cs = crossover(weak, t_comm), crossover(strong, t_comm)
                row += [str(cw) if cw else f"> {CROSS_MAX}", str(cs) if cs else f"> {CROSS_MAX}"]
            rows.append(row)
        table(["run", "gradient MB", "t_c ms"] + [f"N={n}" for n in NODES] +
              ["comm > compute from N (weak)", "(strong: global batch 128)"], rows)
    missing = [what for name, what in ROWS if name not in configs]
    if missing:
        print(f"(not measured here: {', '.join(missing)}"
              + (f"; skipped: {', '.join(s.get('name', '?') + ' (' + s.get('reason', '?') + ')' for s in skipped)}"
                 if skipped else "") + ")")


def main():
    if len(sys.argv) != 2:
        print("usage: /usr/bin/python3 bench/mpi_scaling.py MEASURED_FILE (bench/mpi_bench.sh writes it)",
              file=sys.stderr)
        return 2
    try:
        cpu, configs, sums, skipped = parse(sys.argv[1])
    except (OSError, KeyError, ValueError) as e:
        print(f"mpi_scaling.py: cannot read {sys.argv[1]}: {e}; run bench/mpi_bench.sh to write it",
              file=sys.stderr)
        return 1
    if not configs:
        print(f"mpi_scaling.py: {sys.argv[1]} has no mpi:config line (every config skipped or failed): no model",
              file=sys.stderr)
        return 1
    measured(cpu, configs, sums)
    overlap(configs, sums)
    model(cpu, configs, sums, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
