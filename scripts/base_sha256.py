#!/usr/bin/env python3
"""Recomputes the base identity (base_sha256, scheme qtrain-base-sha256-v2) of a
qtrain checkpoint or adapters.h5's base checkpoint, as trainer/checkpoint.h
defines it: SHA-256 over the frozen base's datasets -- every
/params/<module>/<tensor> of a module not in lora.trainable (nor, with
lora.batchnorm: train, of a batch norm: a module with /buffers), every
/buffers/<module>/<statistic> of a batch norm kept frozen (lora.batchnorm:
frozen, not in lora.trainable), and every dataset directly under
/quant/<module>/weight -- in bytewise order of their names
(without the leading '/'), each as

    name NUL dtype NUL shape NUL u64le(byte count) bytes

dtype numpy's name (float32, uint8, uint16, int32, int64), shape the dimensions in
decimal joined by ',', bytes the little-endian elements in row-major order.
Scheme qtrain-base-sha256-v1 (--v1; adapters.h5 files of older runs name it in
base_hash) is the same without the /buffers datasets.

usage: base_sha256.py CHECKPOINT [--trainable head,fc2] [--v1]
CHECKPOINT is any checkpoint of the LoRA run (ckpt-*.h5, final.h5): adapters.h5
holds no base. lora.trainable defaults to the file's lora_trainable attribute."""
import hashlib
import struct
import sys

import h5py


def base_sha256(path, trainable=None, v1=False):
    with h5py.File(path, "r") as f:
        contents = f.attrs.get("contents", "")
        if (contents.decode() if isinstance(contents, bytes) else contents) == "adapters":
            sys.exit(f"{path} is an adapters.h5: it holds no base; give a checkpoint of the run")
        if trainable is None:
            t = f.attrs.get("lora_trainable", "")
            t = t.decode() if isinstance(t, bytes) else t
            trainable = [m for m in t.split(",") if m]
        bn_mode = f.attrs.get("lora_batchnorm", "frozen")
        bn_trains = (bn_mode.decode() if isinstance(bn_mode, bytes) else bn_mode) == "train"
        batchnorms = list(f["buffers"].keys()) if "buffers" in f else []
        names = []

        def visit(name, obj):
            if not isinstance(obj, h5py.Dataset):
                return
            parts = name.split("/")
            frozen = parts[1] not in trainable and not (bn_trains and parts[1] in batchnorms)
            if parts[0] in ("params",) + (() if v1 else ("buffers",)) and len(parts) == 3 and frozen:
                names.append(name)
            elif parts[0] == "quant" and len(parts) == 4 and parts[2] == "weight":
                names.append(name)

        f.visititems(visit)
        h = hashlib.sha256()
        for name in sorted(names, key=lambda s: s.encode()):
            d = f[name]
            data = d[()].astype(d.dtype.newbyteorder("<")).tobytes()
            shape = ",".join(str(n) for n in d.shape)
            h.update(name.encode() + b"\0" + str(d.dtype).encode() + b"\0" + shape.encode() + b"\0")
            h.update(struct.pack("<Q", len(data)) + data)
        return h.hexdigest()


if __name__ == "__main__":
    args = sys.argv[1:]
    v1 = "--v1" in args
    args = [a for a in args if a != "--v1"]
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--trainable"):
        sys.exit(__doc__)
    print(base_sha256(args[0], args[2].split(",") if len(args) == 3 else None, v1))
