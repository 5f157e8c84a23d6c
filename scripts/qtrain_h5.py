#!/usr/bin/python3
"""qtrain_h5.py - a qtrain checkpoint as a PyTorch-style state_dict of numpy arrays.

    qtrain_h5.py CHECKPOINT                      print every name, dtype and shape
    qtrain_h5.py CHECKPOINT --list               the same
    qtrain_h5.py CHECKPOINT --save-npz OUT.npz   save them all (numpy.savez, one array a name)

As a module:

    import sys; sys.path.insert(0, "scripts")
    import qtrain_h5
    sd = qtrain_h5.load("runs/ptq/final.h5")   # {"conv1.weight": array, ...}

load() maps the layout of docs/CHECKPOINT.md to state_dict names:
/params/<module>/<tensor> -> "<module>.<tensor>" (weight, bias), /quant/<module>/weight
(a frozen quantized weight) -> "<module>.weight", dequantized bit for bit as qtrain does
(qtrain_decode.py's functions), /buffers/<module>/<statistic> -> "<module>.running_mean",
"running_var", "num_batches_tracked", /lora/<module>/A, B -> "<module>.lora_A", "lora_B"
(and a DoRA adapter's magnitude -> "<module>.lora_magnitude_vector", (out,)).
A module path's "/" becomes ".". Arrays are float32 in PyTorch's shapes, num_batches_tracked
an int64 scalar. Activation ranges, QAT's learned ranges, optimizer, RNG and data state are
not part of a state_dict and are left out. A file qtrain would refuse (a wrong shape or count,
an unknown format, NaN or inf) raises QtrainH5Error naming the dataset, never gives a wrong array.
Needs Debian's python3-h5py and python3-numpy (run it with /usr/bin/python3).
Exit status: 0 done, 1 the file cannot be read, 2 usage.
"""
import argparse
import math
import os
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qtrain_decode  # noqa: E402  (the per-format decode; this file only walks the layout)

BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
LORA = {"A": "lora_A", "B": "lora_B", "magnitude": "lora_magnitude_vector"}


class QtrainH5Error(ValueError):
    """A checkpoint that cannot be decoded: the message names the file and the dataset."""


def _fail(path, obj, what):
    raise QtrainH5Error(f"{path}: /{obj}: {what}")


def _attr_int(path, g, name):
    if name not in g.attrs:
        _fail(path, g.name.lstrip("/"), f"attribute {name!r} is missing")
    return int(np.asarray(g.attrs[name]).reshape(()))


def _float_array(path, ds, shape=None):
    """A float dataset as float32 (qtrain converts float16/float64 on read), refused if not finite."""
    name = ds.name.lstrip("/")
    if not isinstance(ds, h5py.Dataset):
        _fail(path, name, "is a group, not a dataset")
    if ds.dtype.kind != "f":
        _fail(path, name, f"is {ds.dtype}, not a float dataset")
    a = ds[()].astype(np.float32)
    if shape is not None and a.shape != tuple(shape):
        _fail(path, name, f"has shape {a.shape}, expected {tuple(shape)}")
    if not np.all(np.isfinite(a)):
        i = int(np.flatnonzero(~np.isfinite(a.reshape(-1)))[0])
        _fail(path, name, f"element {i} is {a.reshape(-1)[i]}; qtrain refuses NaN and inf")
    return a


def _modules(path, f, top):
    """(module path, group) of every group under /top holding datasets, the module path with '.' for '/'."""
    out = []
    if top not in f:
        return out
    if not isinstance(f[top], h5py.Group):
        _fail(path, top, "is a dataset, not a group")

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and "/" not in name:
            _fail(path, f"{top}/{name}", f"is a dataset directly under /{top}, not in a module's group")
        if isinstance(obj, h5py.Group) and any(isinstance(v, h5py.Dataset) for v in obj.values()):
            out.append((name.replace("/", "."), obj))
    f[top].visititems(visit)
    return out


# ---- /quant: a stored weight, checked as quant/qarray_io.c checks it, decoded by qtrain_decode ----------------

def _expected_scales(path, name, g, numel, shape):
    tile, gran = _attr_int(path, g, "tile"), qtrain_decode.attr_str(g, "granularity")
    if tile > 0:
        if numel % tile:
            _fail(path, name, f"tile {tile} does not divide the weight's {numel} elements")
        return numel // tile
    if gran == "per_tensor":
        return 1
    if gran == "per_channel":
        return shape[0]
    _fail(path, name, f"granularity {gran!r} with tile 0 is neither per_channel nor per_tensor")


def _check_quant(path, name, g):
    """Everything dequantize_group trusts: the format, the byte and scale counts, finite scales."""
    for a in ("qtype", "shape", "tile", "granularity", "scale_type", "double_quant"):
        if a not in g.attrs:
            _fail(path, name, f"attribute {a!r} is missing")
    qtype = qtrain_decode.attr_str(g, "qtype")
    shape = tuple(int(d) for d in np.asarray(g.attrs["shape"]).reshape(-1))
    if not shape or min(shape) <= 0:
        _fail(path, name, f"attribute shape {shape} is not a weight's shape")
    numel = int(np.prod(shape))
    if "qvalue" not in g or not isinstance(g["qvalue"], h5py.Dataset) or g["qvalue"].dtype != np.uint8:
        _fail(path, name + "/qvalue", "is missing or not uint8")
    qvalue = g["qvalue"][()]
    if qtype in qtrain_decode.MX or qtype in qtrain_decode.MX_SHARED:
        per_block, block_bytes = (32, qtrain_decode.MX[qtype][2]) if qtype in qtrain_decode.MX else \
            (16, qtrain_decode.MX_SHARED[qtype][1])
        want = -(-numel // per_block) * block_bytes
        if qvalue.shape != (want,):
            _fail(path, name + "/qvalue", f"holds {qvalue.size} bytes; {numel} elements of {qtype} take {want}")
        bad = np.flatnonzero(qvalue.reshape(-1, block_bytes)[:, 0] == 255)
        if bad.size:
            _fail(path, name + "/qvalue", f"byte {int(bad[0]) * block_bytes} = 255, the shared scale of "
                  f"{qtype} block {int(bad[0])}, is the NaN code")
        return
    try:
        lut = qtrain_decode.element_lut(qtype)
    except ValueError as e:
        _fail(path, name, f"attribute qtype: {e}")
    bits = int(round(math.log2(lut.size)))
    want = -(-numel * bits // 8)
    if qvalue.shape != (want,):
        _fail(path, name + "/qvalue", f"holds {qvalue.size} bytes; {numel} codes of {qtype} take {want}")
    n = _expected_scales(path, name, g, numel, shape)
    if "scale" not in g or g["scale"].shape != (n,):
        _fail(path, name + "/scale", f"is missing or not of shape ({n},) (tile {int(g.attrs['tile'])}, "
              f"{qtrain_decode.attr_str(g, 'granularity')}, shape {shape})")
    if "zero_point" in g and g["zero_point"].shape != (n,):
        _fail(path, name + "/zero_point", f"has shape {g['zero_point'].shape}, expected ({n},)")
    dq = _attr_int(path, g, "double_quant")
    if dq:
        block = _attr_int(path, g, "dq_block")
        if block <= 0 or "dq_offset" not in g.attrs:
            _fail(path, name, f"double_quant with dq_block {block} or without dq_offset")
        absmax = _float_array(path, g["scale_absmax"], (-(-n // block),)) if "scale_absmax" in g else \
            _fail(path, name + "/scale_absmax", "is missing (double_quant is 1)")
        if not np.all(absmax > 0):
            _fail(path, name + "/scale_absmax", "holds a value <= 0; qtrain stores every absmax > 0")
        if g["scale"].dtype != np.uint8:
            _fail(path, name + "/scale", f"is {g['scale'].dtype}, not the uint8 codes of double quantization")
    else:
        stype = qtrain_decode.attr_str(g, "scale_type")
        want_dt = {"float32": "f", "float16": np.uint16, "bfloat16": np.uint16, "pof2": np.uint8}.get(stype)
        if want_dt is None:
            _fail(path, name, f"attribute scale_type {stype!r} is not float32, float16, bfloat16 or pof2")
        dt = g["scale"].dtype
        if (dt.kind != "f") if want_dt == "f" else (dt != want_dt):
            _fail(path, name + "/scale", f"is {dt}, which does not hold {stype} scales")
    s = qtrain_decode.group_scales(g)
    bad = np.flatnonzero(~np.isfinite(s) | ((s <= 0) if not dq else False))
    if bad.size:
        _fail(path, name + "/scale", f"scale[{int(bad[0])}] decodes to {s[bad[0]]}; a scale must be finite"
              + ("" if dq else " and > 0"))
    if "zero_point" in g:
        # in the format's code range, narrow range applied, as quant/qarray_io.c checks it (NaN fails too)
        zp = g["zero_point"][()].astype(np.float64)
        hi = float(np.nanmax(lut))
        lo = -hi if int(g.attrs.get("narrow_range", 0)) else float(np.nanmin(lut))
        bad = np.flatnonzero(~((zp >= lo) & (zp <= hi)))
        if bad.size:
            _fail(path, name + "/zero_point", f"zero_point[{int(bad[0])}] = {zp[bad[0]]} is outside {qtype}'s "
                  f"code range [{lo:g}, {hi:g}]")


def _quant_weight(path, name, g):
    _check_quant(path, name, g)
    try:
        w = qtrain_decode.dequantize_group(g)
    except (KeyError, ValueError) as e:
        _fail(path, name, f"cannot be decoded: {e}")
    bad = np.flatnonzero(~np.isfinite(w.reshape(-1)))
    if bad.size:
        _fail(path, name + "/qvalue", f"element {int(bad[0])} decodes to {w.reshape(-1)[bad[0]]} (a NaN or inf "
              "code, which quantization never stores)")
    return w


# ---- the whole file --------------------------------------------------------------------------------------------

def _put(path, out, key, obj, value):
    if key in out:
        _fail(path, obj, f"gives {key!r} a second time")
    out[key] = value


def load(path):
    """CHECKPOINT -> {state_dict name: numpy array}, quantized weights dequantized as qtrain does."""
    out = {}
    with h5py.File(path, "r") as f:
        fmt = f.attrs.get("format", b"")
        if (fmt.decode() if isinstance(fmt, bytes) else str(fmt)) != "qtrain":
            raise QtrainH5Error(f"{path}: not a qtrain checkpoint (root attribute format is {fmt!r})")
        if int(np.asarray(f.attrs.get("version", -1)).reshape(())) != 1:
            raise QtrainH5Error(f"{path}: checkpoint version {f.attrs.get('version')!r}; this script reads 1")
        for module, g in _modules(path, f, "params"):
            for t, ds in g.items():
                if isinstance(ds, h5py.Dataset):
                    _put(path, out, f"{module}.{t}", ds.name[1:], _float_array(path, ds))
        for module, g in _modules(path, f, "quant"):
            if not g.name.endswith("/weight") or "qvalue" not in g:
                continue  # activation ranges (/input), QAT's learned ranges (.../state): no state_dict entry
            module = module[: -len(".weight")]
            _put(path, out, f"{module}.weight", g.name[1:], _quant_weight(path, g.name[1:], g))
        for module, g in _modules(path, f, "buffers"):
            for t, ds in g.items():
                name = ds.name[1:]
                if t not in BUFFERS or not isinstance(ds, h5py.Dataset):
                    _fail(path, name, f"is not a batch norm statistic ({', '.join(BUFFERS)})")
                if t == "num_batches_tracked":
                    if ds.dtype.kind not in "iu" or ds.shape != ():
                        _fail(path, name, f"is {ds.dtype} {ds.shape}, not an integer scalar")
                    v = np.array(ds[()], dtype=np.int64)
                    if v < 0:
                        _fail(path, name, f"is {int(v)}; a count is never negative")
                else:
                    v = _float_array(path, ds)
                    if v.ndim != 1:
                        _fail(path, name, f"has shape {v.shape}, not (C,)")
                    if t == "running_var" and np.any(v < 0):
                        _fail(path, name, "holds a negative variance")
                _put(path, out, f"{module}.{t}", name, v)
        for module, g in _modules(path, f, "lora"):
            for t, ds in g.items():
                if t not in LORA:
                    _fail(path, ds.name[1:], "is not an adapter matrix (A or B) or a DoRA magnitude")
                _put(path, out, f"{module}.{LORA[t]}", ds.name[1:], _float_array(path, ds))
    return dict(sorted(out.items()))  # each module's tensors together


def main(argv):
    ap = argparse.ArgumentParser(description="a qtrain checkpoint as a state_dict of numpy arrays")
    ap.add_argument("checkpoint")
    ap.add_argument("--list", action="store_true", help="print every name, dtype and shape (the default)")
    ap.add_argument("--save-npz", metavar="OUT.npz", help="save every array with numpy.savez under its name")
    a = ap.parse_args(argv)
    try:
        sd = load(a.checkpoint)
    except (OSError, KeyError, ValueError) as e:
        print(f"qtrain_h5: {e}", file=sys.stderr)
        return 1
    if a.save_npz:
        np.savez(a.save_npz, **sd)
    if a.list or not a.save_npz:
        for k, v in sd.items():
            print(f"{k:32s} {str(v.dtype):8s} {tuple(v.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
