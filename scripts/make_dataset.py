#!/usr/bin/python3
"""make_dataset.py - write a data set in qtrain's HDF5 layout (docs/DATA.md).

    make_dataset.py npy  --train-x X.npy --train-y Y.npy --test-x X.npy --test-y Y.npy
                         [--val-x X.npy --val-y Y.npy] [--npz ALL.npz] -o OUT.h5
    make_dataset.py csv  --train TRAIN.csv --test TEST.csv [--val VAL.csv]
                         (--label COLUMN | --target COL1,COL2,...) -o OUT.h5
    make_dataset.py images --train DIR --test DIR [--val DIR] [--size H W] [--grayscale] -o OUT.h5

Common options: --gzip (chunked datasets, gzip level 4), --mean-std (the
root attributes mean and std: per channel, of the training examples in the
units qtrain loads them in, uint8 as p / 255, the other types as stored),
--dtype uint8|int8|float16|float32 (the examples' element type), --classes
NAME... (the class names; with string labels, their order).

Writes /train/x, /train/y, /test/x, /test/y and optionally /val/x, /val/y:
examples (N, C, H, W), (N, H, W) or (N, F) of uint8, int8, float16 or
float32; class labels int64 (N,), or float32 targets (N,) or (N, K). An
.npz's arrays are named train_x, train_y, test_x, test_y, val_x, val_y;
--train-x and the like override them. In a CSV file (header row required)
every column but the label or target columns is a float32 feature; a label
column of strings maps them to 0..K-1 in sorted order (or --classes order)
and writes their names as the `classes` attribute; numeric labels stay as
they are. An image folder holds one subfolder per class (sorted names are
the classes); images are read with PIL as RGB (or grayscale) and stored
uint8 (N, C, H, W), resized to --size H W when given, else all must have
one size.

Needs Debian's python3-numpy and python3-h5py (python3-pil for image
folders); run it with /usr/bin/python3.
Exit status: 0 written, 1 the input is refused (the message says why and
what to do), 2 usage.
"""
import argparse
import csv
import math
import os
import sys

import numpy as np

MAX_CLASSES = 256      # qtrain's DATASET_MAX_CLASSES
MAX_STAT_CHANNELS = 64  # qtrain's DATASET_MAX_CHANNELS: more channels get one mean and std over all values
ELEM_TYPES = ("uint8", "int8", "float16", "float32")
SPLITS = ("train", "val", "test")


class InputError(Exception):
    """An input qtrain's layout cannot hold; the message names the file and what to do."""


# ---- checks shared by every input kind ----------------------------------------------------------------------


def check_finite(name, a, what):
    """A NaN or infinity in float array a is an error naming its first index."""
    if a.dtype.kind != "f":
        return
    bad = ~np.isfinite(a)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InputError("%s: %s at index %s is %s; qtrain refuses NaN and infinity: drop or fix that example" %
                         (name, what, idx[0] if len(idx) == 1 else idx, a[idx]))


def convert_examples(name, x, dtype):
    """x in a stored element type: its own when it is one, else dtype (--dtype); integer targets are range-checked."""
    if dtype is None:
        if x.dtype.name not in ELEM_TYPES:
            raise InputError("%s: the examples are %s; qtrain stores uint8, int8, float16 or float32: convert them "
                             "(x.astype('float32')) or pass --dtype float32" % (name, x.dtype.name))
        return x
    target = np.dtype(dtype)
    if x.dtype == target:
        return x
    if target.kind in "iu":
        if x.dtype.kind not in "iub":
            check_finite(name, x, "an example value")
            if not np.array_equal(x, np.round(x)):
                raise InputError("%s: --dtype %s needs whole numbers, but the examples hold fractions; scale and "
                                 "round them first, or use --dtype float32" % (name, dtype))
        info = np.iinfo(target)
        if x.size and (x.min() < info.min or x.max() > info.max):
            raise InputError("%s: --dtype %s holds %d..%d, but the examples range over %s..%s; rescale them first, "
                             "or use --dtype float32" % (name, dtype, info.min, info.max, x.min(), x.max()))
        return x.astype(target)
    if x.dtype.kind == "f":
        check_finite(name, x, "an example value")
    y = x.astype(target)
    check_finite(name, y, "an example value as %s (too large for it)" % dtype)
    return y


def labels_from_array(name, y):
    """Integer class labels (N,) as int64, checked to 0..MAX_CLASSES-1."""
    if y.ndim != 1:
        raise InputError("%s: class labels have shape %s; they must be one integer per example (N,)" %
                         (name, y.shape))
    y = y.astype(np.int64)
    if y.size and y.min() < 0:
        i = int(np.argmax(y < 0))
        raise InputError("%s: label %d at index %d is negative; class labels are 0..K-1: renumber them" %
                         (name, int(y[i]), i))
    if y.size and y.max() >= MAX_CLASSES:
        i = int(np.argmax(y >= MAX_CLASSES))
        raise InputError("%s: label %d at index %d; qtrain reads at most %d classes (labels 0..%d)" %
                         (name, int(y[i]), i, MAX_CLASSES, MAX_CLASSES - 1))
    return y


def targets_from_array(name, y):
    """Float targets (N,) or (N, K) as float32, checked finite."""
    if y.ndim not in (1, 2):
        raise InputError("%s: float targets have shape %s; they must be (N,) or (N, K)" % (name, y.shape))
    t = y.astype(np.float32)
    check_finite(name, y, "a target")
    check_finite(name, t, "a target as float32 (too large for it)")
    return t


def check_splits(splits, classes):
    """Every split: N examples in x and y, at least one; the same example shape, type and kind of target."""
    ref = None
    for s, (x, y, src) in splits.items():
        if x.ndim < 2 or x.ndim > 4:
            raise InputError("%s: %s examples have shape %s; they must be (N, C, H, W), (N, H, W) or (N, F)" %
                             (src, s, x.shape))
        if x.shape[0] != y.shape[0]:
            raise InputError("%s: %s has %d examples but %d labels or targets; x and y need one row per example" %
                             (src, s, x.shape[0], y.shape[0]))
        if x.shape[0] == 0:
            raise InputError("%s: the %s split is empty; give it at least one example" % (src, s))
        kind = (x.shape[1:], x.dtype, y.dtype.kind, y.shape[1:])
        if ref is None:
            ref = (s, kind)
        elif kind[:2] != ref[1][:2]:
            raise InputError("%s: %s examples are %s %s but %s examples %s %s; every split must hold the same shape "
                             "and type" % (src, s, kind[1], kind[0], ref[0], ref[1][1], ref[1][0]))
        elif kind[2:] != ref[1][2:]:
            raise InputError("%s: %s has %s but %s has %s; every split needs the same kind of targets" %
                             (src, s, describe_y(y), ref[0], describe_y(splits[ref[0]][1])))
    if classes is not None:
        for s, (x, y, src) in splits.items():
            if y.dtype.kind == "f":
                raise InputError("--classes names classes, but the targets are floats; leave --classes out")
            if y.size and y.max() >= len(classes):
                raise InputError("%s: a %s label is %d, but --classes names %d classes (labels 0..%d); name them all" %
                                 (src, s, int(y.max()), len(classes), len(classes) - 1))


def describe_y(y):
    return "class labels" if y.dtype.kind in "iu" else "float targets of shape %s per example" % (y.shape[1:],)


# ---- the written file -------------------------------------------------------------------------------------------


def channel_stats(x):
    """Per-channel mean and std (float64) of x in the units qtrain loads it in: uint8 p / 255, others as stored.
    The channel is axis 1 of (N, C, H, W) and (N, F); (N, H, W) is one channel."""
    def units(v):
        v = v.astype(np.float64)
        return v / 255.0 if x.dtype == np.uint8 else v
    if x.ndim == 3:
        v = units(x)
        return [v.mean()], [v.std()]
    means, stds = [], []
    for c in range(x.shape[1]):
        v = units(x[:, c])
        means.append(v.mean())
        stds.append(v.std())
    return means, stds


def write_h5(path, splits, classes, gzip, mean_std):
    import h5py
    attrs = {}
    if mean_std:
        x = splits["train"][0]
        if x.ndim != 3 and x.shape[1] > MAX_STAT_CHANNELS:
            v = x.astype(np.float64) / (255.0 if x.dtype == np.uint8 else 1.0)
            mean, std = [v.mean()], [v.std()]
            print("make_dataset.py: %d channels, more than qtrain's %d per-channel statistics: mean and std are one "
                  "value each, over all values" % (x.shape[1], MAX_STAT_CHANNELS), file=sys.stderr)
        else:
            mean, std = channel_stats(x)
        for c, (m, s) in enumerate(zip(mean, std)):
            if not s > 0:
                raise InputError("--mean-std: channel %d of the training examples is constant (std 0), so it cannot "
                                 "be normalized by it; drop that feature or leave --mean-std out" % c)
        attrs["mean"] = np.asarray(mean, dtype=np.float64)
        attrs["std"] = np.asarray(std, dtype=np.float64)
    tmp = path + ".tmp"
    try:
        with h5py.File(tmp, "w") as f:
            for s in SPLITS:
                if s not in splits:
                    continue
                x, y, _ = splits[s]
                g = f.create_group(s)
                for name, a in (("x", x), ("y", y)):
                    opts = {}
                    if gzip:
                        row = max(1, a[0].nbytes if a.ndim > 1 else a.itemsize)
                        rows = max(1, min(a.shape[0], (1 << 18) // row))
                        opts = dict(chunks=(rows,) + a.shape[1:], compression="gzip", compression_opts=4)
                    g.create_dataset(name, data=a, **opts)
            if classes is not None:
                f.attrs["classes"] = [str(c) for c in classes]
            for k, v in attrs.items():
                f.attrs[k] = v
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ---- NumPy arrays -----------------------------------------------------------------------------------------------


def load_npy(path):
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise InputError("%s: cannot be read as a NumPy array (%s); write it with numpy.save" % (path, e))


def from_npy(args):
    arrays = {}
    if args.npz:
        z = load_npy(args.npz)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise InputError("%s: a single array, not an .npz archive; give it as --train-x or the like, or write "
                             "the archive with numpy.savez" % args.npz)
        with z:
            for key in z.files:
                arrays[key] = (z[key], "%s:%s" % (args.npz, key))
    for s in SPLITS:
        for part in ("x", "y"):
            p = getattr(args, "%s_%s" % (s, part))
            if p:
                arrays["%s_%s" % (s, part)] = (load_npy(p), p)
    splits = {}
    for s in SPLITS:
        have = ["%s_%s" % (s, part) in arrays for part in ("x", "y")]
        if not any(have):
            if s != "val":
                raise InputError("no %s split: give --%s-x and --%s-y (or an --npz with %s_x and %s_y)" %
                                 (s, s, s, s, s))
            continue
        if not all(have):
            missing = "%s_%s" % (s, "y" if have[0] else "x")
            raise InputError("the %s split has no %s: give --%s (or an --npz array named %s)" %
                             (s, missing, missing.replace("_", "-"), missing))
        x, xsrc = arrays["%s_x" % s]
        y, ysrc = arrays["%s_y" % s]
        x = convert_examples(xsrc, x, args.dtype)
        check_finite(xsrc, x, "an example value")
        if y.dtype.kind in "iu":
            y = labels_from_array(ysrc, y)
        elif y.dtype.kind == "f":
            y = targets_from_array(ysrc, y)
        else:
            raise InputError("%s: labels are %s; give integer class labels or float targets (y.astype('int64') or "
                             "y.astype('float32'))" % (ysrc, y.dtype.name))
        splits[s] = (x, y, xsrc)
    return splits, args.classes


# ---- CSV files --------------------------------------------------------------------------------------------------


def parse_float(path, line, col, cell, what):
    try:
        v = float(cell)
    except ValueError:
        raise InputError("%s, line %d, column '%s': %r is not a number; every column but the label is a float32 "
                         "%s: fix the cell or remove the column" % (path, line, col, cell, what))
    if not math.isfinite(v):
        raise InputError("%s, line %d, column '%s': %s; qtrain refuses NaN and infinity: fix or drop the row" %
                         (path, line, col, cell))
    return v


def read_csv(path, label, targets):
    """(header, feature columns, rows of feature floats, label cells or target rows) of one CSV file."""
    try:
        f = open(path, newline="", encoding="utf-8-sig")  # a byte-order mark is not part of the first name
    except OSError as e:
        raise InputError("%s: cannot be read (%s)" % (path, e.strerror))
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise InputError("%s: empty; a CSV file needs a header row naming its columns" % path)
        header = [h.strip() for h in header]
        wanted = [label] if label is not None else targets
        for w in wanted:
            if w not in header:
                raise InputError("%s: no column '%s' in the header row (%s); the first row must name the columns" %
                                 (path, w, ", ".join(header)))
        feats = [h for h in header if h not in wanted]
        if not feats:
            raise InputError("%s: no feature columns; every column but the label or targets is a feature" % path)
        fi = [header.index(h) for h in feats]
        wi = [header.index(w) for w in wanted]
        rows, ys = [], []
        for row in reader:
            line = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # a blank line
            if len(row) != len(header):
                raise InputError("%s, line %d: %d cells, but the header has %d columns; every row needs one cell per "
                                 "column" % (path, line, len(row), len(header)))
            rows.append([parse_float(path, line, header[i], row[i].strip(), "feature") for i in fi])
            if label is not None:
                if not row[wi[0]].strip():
                    raise InputError("%s, line %d, column '%s': the label is empty; give every row its class" %
                                     (path, line, label))
                ys.append((line, row[wi[0]].strip()))
            else:
                ys.append([parse_float(path, line, header[i], row[i].strip(), "target") for i in wi])
    if not rows:
        raise InputError("%s: no rows after the header; give at least one example" % path)
    return feats, rows, ys


def label_numbers(path, cells):
    """Integer labels when every cell is a whole number, else None (string labels)."""
    out = []
    for line, c in cells:
        try:
            v = float(c)
        except ValueError:
            return None
        if not math.isfinite(v) or v != int(v):
            raise InputError("%s, line %d: label %r is not a class number; class labels are whole numbers 0..K-1 "
                             "or names (for float targets use --target)" % (path, line, c))
        if v < 0:
            raise InputError("%s, line %d: label %s is negative; class labels are 0..K-1: renumber them" %
                             (path, line, c))
        out.append(int(v))
    return out


def from_csv(args):
    if (args.label is None) == (args.target is None):
        raise InputError("csv: give --label COLUMN (class labels) or --target COL1,COL2 (float targets), one of them")
    targets = [t.strip() for t in args.target.split(",")] if args.target else None
    if targets is not None and args.classes:
        raise InputError("--classes names classes, but --target makes float targets; leave --classes out")
    files = {s: getattr(args, s) for s in SPLITS if getattr(args, s)}
    read = {s: read_csv(p, args.label, targets) for s, p in files.items()}
    feats = read["train"][0]
    for s, (fs, _, _) in read.items():
        if sorted(fs) != sorted(feats):
            raise InputError("%s: feature columns %s, but %s has %s; every file needs the same columns" %
                             (files[s], ", ".join(fs), files["train"], ", ".join(feats)))
    classes = args.classes
    numbers = {}
    if targets is None:
        numbers = {s: label_numbers(files[s], r[2]) for s, r in read.items()}
        if any(n is None for n in numbers.values()):
            names = sorted({c for r in read.values() for _, c in r[2]}) if classes is None else classes
            index = {c: i for i, c in enumerate(names)}
            for s, r in read.items():
                for line, c in r[2]:
                    if c not in index:
                        raise InputError("%s, line %d: label %r is not one of --classes (%s)" %
                                         (files[s], line, c, ", ".join(names)))
            numbers = {s: [index[c] for _, c in r[2]] for s, r in read.items()}
            classes = names
    splits = {}
    for s, (fs, rows, ys) in read.items():
        order = [fs.index(c) for c in feats]
        x = np.asarray(rows, dtype=np.float64)[:, order]
        x = convert_examples(files[s], x, args.dtype or "float32")
        if targets is None:
            y = labels_from_array(files[s], np.asarray(numbers[s], dtype=np.int64))
        else:
            t = np.asarray(ys, dtype=np.float64)
            y = targets_from_array(files[s], t[:, 0] if len(targets) == 1 else t)
        splits[s] = (x, y, files[s])
    return splits, classes


# ---- image folders ----------------------------------------------------------------------------------------------


def from_images(args):
    try:
        from PIL import Image
    except ImportError:
        raise InputError("images: needs PIL (Debian's python3-pil: apt-get install python3-pil)")
    if args.dtype not in (None, "uint8"):
        raise InputError("images are stored uint8; leave --dtype out (normalize in the config instead)")
    dirs = {s: getattr(args, s) for s in SPLITS if getattr(args, s)}
    for s, d in dirs.items():
        if not os.path.isdir(d):
            raise InputError("%s: not a directory; --%s takes a folder with one subfolder per class" % (d, s))
    def subdirs(d):
        return sorted(e for e in os.listdir(d) if not e.startswith(".") and os.path.isdir(os.path.join(d, e)))
    classes = args.classes or subdirs(dirs["train"])
    if not classes:
        raise InputError("%s: no class subfolders; put each class's images in a folder named after it" %
                         dirs["train"])
    mode = "L" if args.grayscale else "RGB"
    size = None if args.size is None else (args.size[0], args.size[1])  # (H, W)
    first = None  # (path, (H, W)) of the first image, when every image must share its size
    splits = {}
    for s, d in dirs.items():
        xs, ys = [], []
        for name in subdirs(d):
            if name not in classes:
                raise InputError("%s: class folder '%s' is not a class of %s (%s); use the same class folders in "
                                 "every split" % (os.path.join(d, name), name, dirs["train"], ", ".join(classes)))
        for k, name in enumerate(classes):
            cd = os.path.join(d, name)
            if not os.path.isdir(cd):
                if s == "train":
                    raise InputError("%s: missing; --classes names class '%s'" % (cd, name))
                continue
            files = sorted(e for e in os.listdir(cd) if not e.startswith(".") and
                           os.path.isfile(os.path.join(cd, e)))
            if not files:
                raise InputError("%s: an empty class folder; put its images in it or remove it" % cd)
            for fn in files:
                p = os.path.join(cd, fn)
                try:
                    with Image.open(p) as im:
                        im = im.convert(mode)
                        if size is not None:
                            im = im.resize((size[1], size[0]), Image.BILINEAR)
                        a = np.asarray(im, dtype=np.uint8)
                except OSError as e:
                    raise InputError("%s: cannot be read as an image (%s); remove it from the class folder" % (p, e))
                if size is None:
                    if first is None:
                        first = (p, a.shape[:2])
                    elif a.shape[:2] != first[1]:
                        raise InputError("%s: %dx%d pixels, but %s is %dx%d; give --size H W to resize them all" %
                                         (p, a.shape[1], a.shape[0], first[0], first[1][1], first[1][0]))
                xs.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
                ys.append(k)
        if not xs:
            raise InputError("%s: no images in any class folder" % d)
        splits[s] = (np.stack(xs), np.asarray(ys, dtype=np.int64), d)
    return splits, classes


# ---- command line -----------------------------------------------------------------------------------------------


def main(argv):
    p = argparse.ArgumentParser(prog="make_dataset.py", description="Write a data set in qtrain's HDF5 layout "
                                "(docs/DATA.md) from NumPy arrays, CSV files or image folders.")
    sub = p.add_subparsers(dest="kind", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--output", required=True, help="the HDF5 file to write")
    common.add_argument("--gzip", action="store_true", help="chunked datasets, gzip level 4")
    common.add_argument("--mean-std", action="store_true",
                        help="write the root attributes mean and std of the training examples, per channel")
    common.add_argument("--dtype", choices=ELEM_TYPES, help="the examples' stored element type")
    common.add_argument("--classes", nargs="+", metavar="NAME", help="the class names (with string labels: "
                        "their order)")
    n = sub.add_parser("npy", parents=[common], help="from .npy files or an .npz")
    n.add_argument("--npz", help="an .npz with arrays train_x, train_y, test_x, test_y[, val_x, val_y]")
    for s in SPLITS:
        n.add_argument("--%s-x" % s, dest="%s_x" % s, metavar="X.npy")
        n.add_argument("--%s-y" % s, dest="%s_y" % s, metavar="Y.npy")
    c = sub.add_parser("csv", parents=[common], help="from CSV files with a header row")
    c.add_argument("--train", required=True)
    c.add_argument("--test", required=True)
    c.add_argument("--val")
    c.add_argument("--label", metavar="COLUMN", help="the class label column (numbers or names)")
    c.add_argument("--target", metavar="COL1,COL2", help="float target columns instead of a class label")
    i = sub.add_parser("images", parents=[common], help="from folders with one subfolder per class")
    i.add_argument("--train", required=True)
    i.add_argument("--test", required=True)
    i.add_argument("--val")
    i.add_argument("--size", nargs=2, type=int, metavar=("H", "W"), help="resize every image to H x W")
    i.add_argument("--grayscale", action="store_true", help="one channel instead of RGB's three")
    args = p.parse_args(argv)
    if getattr(args, "size", None) is not None and min(args.size) < 1:
        p.error("--size takes two positive numbers, H and W")
    try:
        splits, classes = {"npy": from_npy, "csv": from_csv, "images": from_images}[args.kind](args)
        if classes is not None and not 1 <= len(classes) <= MAX_CLASSES:
            raise InputError("%d classes; qtrain reads 1 to %d" % (len(classes), MAX_CLASSES))
        check_splits(splits, classes)
        write_h5(args.output, splits, classes, args.gzip, args.mean_std)
    except InputError as e:
        print("make_dataset.py: %s" % e, file=sys.stderr)
        return 1
    except OSError as e:
        print("make_dataset.py: %s: %s" % (e.filename or args.output, e.strerror or e), file=sys.stderr)
        return 1
    x, y, _ = splits["train"]
    what = "%d classes" % (len(classes) if classes else int(max(s[1].max() for s in splits.values())) + 1) \
        if y.dtype.kind in "iu" else "targets %s" % (y.shape[1:] or (1,),)
    print("%s: %s, examples %s %s, %s" % (args.output, ", ".join("%s %d" % (s, splits[s][0].shape[0])
          for s in SPLITS if s in splits), x.dtype, x.shape[1:], what))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
