#!/usr/bin/python3
"""Writes data/fashion-mnist-mini/: the first N_TRAIN training and N_TEST test
examples of Fashion-MNIST, in the original IDX format and file names, small
enough to ship with the sources for the tests.

    /usr/bin/python3 data/make_fashion_mnist_mini.py [/usr/share/datasets/fashion-mnist]

Standard library only. The output is byte-for-byte reproducible: gzip level 9,
no file name and mtime 0 in the gzip header.
"""
import argparse
import gzip
import os
import struct
import sys

N_TRAIN = 2400
N_TEST = 1000
N_CLASSES = 10

SETS = (("train", N_TRAIN), ("t10k", N_TEST))


def read_idx(path):
    """(dims, payload bytes) of an unsigned-byte IDX file, gzip'd or plain."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        sys.exit(f"{path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    payload = raw[4 + 4 * ndim:]
    size = 1
    for d in dims:
        size *= d
    if len(payload) != size:
        sys.exit(f"{path}: header says {size} bytes of data, file has {len(payload)}")
    return dims, payload


def find(src, name):
    for candidate in (os.path.join(src, name + ".gz"), os.path.join(src, name)):
        if os.path.exists(candidate):
            return candidate
    sys.exit(f"{src}: neither {name}.gz nor {name} exists "
             "(install the Debian package dataset-fashion-mnist)")


def write_idx_gz(path, dims, payload):
    header = bytes([0, 0, 0x08, len(dims)]) + struct.pack(f">{len(dims)}I", *dims)
    with open(path, "wb") as raw:
        # filename="" keeps the name out of the gzip header; mtime=0 keeps the
        # time out, so the same input always gives the same bytes.
        with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=raw, mtime=0) as f:
            f.write(header + payload)
    return os.path.getsize(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", nargs="?", default="/usr/share/datasets/fashion-mnist",
                    help="directory with the full Fashion-MNIST IDX files")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fashion-mnist-mini"),
                    help="output directory (default: fashion-mnist-mini next to this script)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    total = 0
    for prefix, n in SETS:
        img_name = f"{prefix}-images-idx3-ubyte"
        lab_name = f"{prefix}-labels-idx1-ubyte"
        img_dims, img = read_idx(find(args.src, img_name))
        lab_dims, lab = read_idx(find(args.src, lab_name))
        if len(img_dims) != 3 or len(lab_dims) != 1 or img_dims[0] != lab_dims[0]:
            sys.exit(f"{args.src}: {prefix} files have dims {img_dims} and {lab_dims}")
        if n > img_dims[0]:
            sys.exit(f"{args.src}: {prefix} has only {img_dims[0]} examples, {n} wanted")
        feat = img_dims[1] * img_dims[2]
        img_size = write_idx_gz(os.path.join(args.out, img_name + ".gz"), (n,) + tuple(img_dims[1:]),
                                img[:n * feat])
        lab_size = write_idx_gz(os.path.join(args.out, lab_name + ".gz"), (n,), lab[:n])
        counts = [0] * N_CLASSES
        for v in lab[:n]:
            counts[v] += 1
        total += img_size + lab_size
        print(f"{prefix}: {n} of {img_dims[0]} examples, {img_dims[1]}x{img_dims[2]}")
        print(f"  per class: {' '.join(str(c) for c in counts)}")
        print(f"  {img_name}.gz: {img_size} bytes ({img_size / n:.0f} per image), {lab_name}.gz: {lab_size} bytes")
    print(f"total: {total} bytes in {args.out}")


if __name__ == "__main__":
    main()
