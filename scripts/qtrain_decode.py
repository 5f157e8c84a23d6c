#!/usr/bin/python3
"""qtrain_decode.py - the quantized weights of a qtrain checkpoint, in numpy.

    qtrain_decode.py CHECKPOINT                  list /quant's modules and formats
    qtrain_decode.py CHECKPOINT MODULE           print MODULE's dequantized weight
    qtrain_decode.py CHECKPOINT MODULE --save W.npy   ... or save it (numpy's .npy)
    qtrain_decode.py CHECKPOINT MODULE --raw W.f32    ... or as raw float32, little-endian

Reads /quant/<module>/weight (docs/CHECKPOINT.md) with h5py and gives the
float32 weight qtrain itself computes, bit for bit: every element is
(value of its code - zero point) * scale in float32, two IEEE operations, as
quant/qarray_deq.c does; a double-quantized scale is rebuilt in float64 and
rounded to float32 once, as quant/qarray_dq.c does. Needs Debian's
python3-h5py and python3-numpy (run it with /usr/bin/python3).
Exit status: 0 done, 1 the file or module cannot be decoded, 2 usage.
"""
import argparse
import math
import re
import sys

import h5py
import numpy as np

# ---- element formats: the value of every code ---------------------------------------------------------------

# bitsandbytes' NF4 code book, float32, code 7 = 0 (quant/qtype.c).
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)


def lut_int(bits):
    """Signed two's complement codes (int2..int8; ternary is int2's -1, 0, 1)."""
    c = np.arange(1 << bits)
    return np.where(c >> (bits - 1), c - (1 << bits), c).astype(np.float32)


def lut_uint(bits):
    """Unsigned codes (uint4, uint8): the code itself."""
    return np.arange(1 << bits).astype(np.float32)


def lut_binary():
    """Binary: code 0 is -1, code 1 is +1."""
    return np.array([-1.0, 1.0], dtype=np.float32)


def lut_nf4():
    return NF4.copy()


def lut_float(e, m, has_inf=False, has_nan=False):
    """Sign, e exponent bits (bias 2^(e-1) - 1), m mantissa bits; exponent
    field 0 is subnormal. fp8_e4m3 (E4M3FN): S.1111.111 is NaN, no inf.
    fp8_e5m2: exponent all ones is inf (mantissa 0) or NaN. Others: all
    codes finite."""
    bias = (1 << (e - 1)) - 1
    out = np.empty(1 << (1 + e + m), dtype=np.float32)
    for code in range(out.size):
        ef, mf, neg = (code >> m) & ((1 << e) - 1), code & ((1 << m) - 1), code >> (e + m)
        if has_inf and ef == (1 << e) - 1:
            v = math.inf if mf == 0 else math.nan
        elif has_nan and not has_inf and (code & ((1 << (e + m)) - 1)) == (1 << (e + m)) - 1:
            v = math.nan
        elif ef == 0:
            v = math.ldexp(mf, 1 - bias - m)
        else:
            v = math.ldexp((1 << m) + mf, ef - bias - m)
        out[code] = -v if neg else v  # exact: every value fits float32; -0.0 for a negative zero
    return out


# name -> (kind, parameters); block formats: (kind, element lut, element bits, block, block bytes, ...)
NAMED_FLOATS = {"fp8_e4m3": (4, 3, False, True), "fp8_e5m2": (5, 2, True, True),
                "fp6_e3m2": (3, 2, False, False), "fp6_e2m3": (2, 3, False, False),
                "fp4_e2m1": (2, 1, False, False)}


def element_lut(qtype):
    """The value of each code of a non-block format, as qtype_decode gives it."""
    if re.fullmatch(r"int[2-8]", qtype):
        return lut_int(int(qtype[3:]))
    if qtype in ("uint4", "uint8"):
        return lut_uint(int(qtype[4:]))
    if qtype == "ternary":
        return lut_int(2)
    if qtype == "binary":
        return lut_binary()
    if qtype == "nf4":
        return lut_nf4()
    if qtype in NAMED_FLOATS:
        return lut_float(*NAMED_FLOATS[qtype])
    g = re.fullmatch(r"(?:fp[0-9]_)?e([1-7])m([0-7])", qtype)
    if g:
        return lut_float(int(g.group(1)), int(g.group(2)))
    raise ValueError(f"unknown element format {qtype!r}")


def unpack_codes(packed, bits, n):
    """n codes of `bits` bits from an MSB-first bit stream (qtype_pack):
    4-bit element 2k is the high nibble of byte k; 3/5/6/7-bit codes
    straddle bytes."""
    stream = np.unpackbits(np.asarray(packed, dtype=np.uint8))[: n * bits].reshape(n, bits)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.uint32)
    return stream.astype(np.uint32) @ weights


# ---- scales --------------------------------------------------------------------------------------------------

def scales_float32(s):
    return np.asarray(s, dtype=np.float32)


def scales_float16(bits):
    """uint16 IEEE binary16 bit patterns; every one is exact in float32."""
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def scales_bfloat16(bits):
    """uint16 bfloat16 bit patterns: the top half of a float32."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def scales_pof2(e8m0):
    """uint8 e8m0 codes: 2^(code - 127) (255 would be NaN; qtrain refuses it at load)."""
    e = np.asarray(e8m0, dtype=np.int64)
    return np.where(e == 255, np.nan, np.ldexp(1.0, e - 127)).astype(np.float32)


def dq_map():
    """Double quantization's signed 8-bit dynamic map (bitsandbytes'
    create_dynamic_map(signed=True)), as quant/qarray_dq.c builds it: for
    k = 0..6 the 2^k midpoints of [0.1, 1] times 10^(k-6), computed in
    double and rounded to float32, their negatives, 0 and 1, ascending."""
    v = []
    for k in range(7):
        parts = 1 << k
        for j in range(parts):
            mid = 0.1 + (j + 0.5) * 0.9 / parts
            p = float(np.float32(math.pow(10.0, k - 6) * mid))
            v += [p, -p]
    v += [0.0, 1.0]
    return np.array(sorted(v), dtype=np.float32)


def scales_double_quant(codes, absmax, offset, block):
    """Scale i = float32(map[code_i] * absmax[i // block] + offset), the
    product and sum in float64; offset is the float32 mean of the scales."""
    codes = np.asarray(codes, dtype=np.uint8)
    a = np.repeat(np.asarray(absmax, dtype=np.float32).astype(np.float64), block)[: codes.size]
    off = np.float64(np.float32(offset))
    return (dq_map()[codes].astype(np.float64) * a + off).astype(np.float32)


# ---- block formats: codes and scales in one byte stream ------------------------------------------------------

# MX (OCP MX v1.0): 32 elements, byte 0 an e8m0 scale, then the packed element codes.
# name -> (element lut, element bits, block bytes, element scale log2)
MX = {"mxfp8_e4m3": (lambda: lut_float(4, 3, False, True), 8, 33, 0),
      "mxfp6_e3m2": (lambda: lut_float(3, 2), 6, 25, 0),
      "mxfp4": (lambda: lut_float(2, 1), 4, 17, 0),
      "mxint8": (lambda: lut_int(8), 8, 33, -6)}
# mx6 / mx9 (Rouhani et al. 2023): 16 elements, byte 0 the shared exponent E, byte 1 eight 1-bit
# micro-exponents (sub-block j of 2 elements in bit 7 - j), then sign + m-bit magnitude codes.
# name -> (magnitude bits m, block bytes)
MX_SHARED = {"mx6": (4, 12), "mx9": (7, 18)}


def dequantize_mx(qvalue, qtype, numel):
    """Element i of block b = decode(code) * 2^(scale_b - 127 + element scale log2)."""
    lut_fn, bits, block_bytes, slog2 = MX[qtype]
    blocks = np.asarray(qvalue, dtype=np.uint8).reshape(-1, block_bytes)
    codes = np.stack([unpack_codes(b[1:], bits, 32) for b in blocks])
    x = blocks[:, 0].astype(np.int64)[:, None] - 127 + slog2
    y = np.ldexp(lut_fn()[codes].astype(np.float64), x).astype(np.float32)  # one rounding, as ldexpf
    y[blocks[:, 0] == 255] = np.nan
    return y.reshape(-1)[:numel]


def dequantize_mx_shared(qvalue, qtype, numel):
    """Element i = (-1)^sign * magnitude * 2^(E - 127 - micro_(i // 2) + 1 - m)."""
    m, block_bytes = MX_SHARED[qtype]
    blocks = np.asarray(qvalue, dtype=np.uint8).reshape(-1, block_bytes)
    micro = np.unpackbits(blocks[:, 1:2], axis=1).astype(np.int64)          # (blocks, 8)
    codes = np.stack([unpack_codes(b[2:], m + 1, 16) for b in blocks])     # (blocks, 16)
    mag = (codes & ((1 << m) - 1)).astype(np.float64)
    x = blocks[:, 0].astype(np.int64)[:, None] - 127 - np.repeat(micro, 2, axis=1) + 1 - m
    v = np.ldexp(mag, x).astype(np.float32)
    y = np.where(codes >> m, -v, v)
    y[blocks[:, 0] == 255] = np.nan
    return y.reshape(-1)[:numel]


# ---- a stored weight -----------------------------------------------------------------------------------------

def attr_str(g, name):
    v = g.attrs[name]
    return v.decode() if isinstance(v, bytes) else str(v)


def group_scales(g, n_scales=None):
    """The float32 scales of a non-block weight group, whatever type they are stored in."""
    if int(g.attrs["double_quant"]):
        return scales_double_quant(g["scale"][:], g["scale_absmax"][:], g.attrs["dq_offset"],
                                   int(g.attrs["dq_block"]))
    kind = attr_str(g, "scale_type")
    s = g["scale"][:]
    return {"float32": scales_float32, "float16": scales_float16, "bfloat16": scales_bfloat16,
            "pof2": scales_pof2}[kind](s)


def dequantize_group(g):
    """/quant/<module>/weight -> the float32 weight in its stored shape.
    Element i uses scale i // (numel / n_scales): per output channel
    (tile 0) that is the row, for blocks (tile T) block i // T, per tensor
    scale 0."""
    qtype, shape = attr_str(g, "qtype"), tuple(int(d) for d in g.attrs["shape"])
    numel = int(np.prod(shape))
    qvalue = g["qvalue"][:]
    if qtype in MX:
        return dequantize_mx(qvalue, qtype, numel).reshape(shape)
    if qtype in MX_SHARED:
        return dequantize_mx_shared(qvalue, qtype, numel).reshape(shape)
    lut = element_lut(qtype)
    bits = int(round(math.log2(lut.size)))
    values = lut[unpack_codes(qvalue, bits, numel)]
    s = group_scales(g)
    per = numel // s.size
    values = values.reshape(s.size, per)
    if "zero_point" in g:
        zp = g["zero_point"][:].astype(np.float32)  # int32 codes are exact in float32
        w = (values - zp[:, None]) * s[:, None]
    else:
        w = values * s[:, None]
    return w.astype(np.float32).reshape(shape)


def dequantize(path, module):
    with h5py.File(path, "r") as f:
        if f"quant/{module}/weight" not in f:
            raise KeyError(f"{path} holds no /quant/{module}/weight")
        return dequantize_group(f[f"quant/{module}/weight"])


def modules(path):
    """(module, qtype, bits_per_weight, shape) of every quantized weight."""
    out = []
    with h5py.File(path, "r") as f:
        for name, grp in f.get("quant", {}).items():
            if "weight" in grp:
                g = grp["weight"]
                out.append((name, attr_str(g, "qtype"), float(g.attrs["bits_per_weight"]),
                            tuple(int(d) for d in g.attrs["shape"])))
    return out


def main(argv):
    ap = argparse.ArgumentParser(description="dequantize a qtrain checkpoint's quantized weights")
    ap.add_argument("checkpoint")
    ap.add_argument("module", nargs="?", help="module path, e.g. fc1 (none: list the quantized modules)")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--save", metavar="FILE.npy", help="save the weight with numpy.save")
    out.add_argument("--raw", metavar="FILE", help="write the weight as raw little-endian float32, row-major")
    a = ap.parse_args(argv)
    try:
        if a.module is None:
            for name, qtype, bits, shape in modules(a.checkpoint):
                print(f"{name:12s} {qtype:12s} {bits:7.3f} bits/weight  shape {shape}")
            return 0
        w = dequantize(a.checkpoint, a.module)
    except (OSError, KeyError, ValueError) as e:
        print(f"qtrain_decode: {a.checkpoint}: {e}", file=sys.stderr)
        return 1
    if a.save:
        np.save(a.save, w)
    elif a.raw:
        w.astype("<f4").tofile(a.raw)
    else:
        np.set_printoptions(threshold=64, edgeitems=4)
        print(f"{a.module}: shape {w.shape}")
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
