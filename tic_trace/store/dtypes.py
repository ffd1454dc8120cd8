"""How each torch dtype is stored on disk and turned back into numbers.

Blobs hold raw little-endian bytes. dtypes numpy has no type for (bf16, fp8) are stored as their bit
pattern in an unsigned integer of the same width, so a round trip is bit exact and needs no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str            # canonical name, as written in traces ("bfloat16", "float8_e4m3fn", ...)
    storage: str         # numpy dtype string of the stored bits, little-endian
    is_float: bool
    mantissa_bits: int   # explicit mantissa bits (0 for non-floats): the ULP of 1.0 is 2**-mantissa_bits
    eps: float           # torch.finfo(...).eps, 0 for non-floats


_DTYPES = {
    d.name: d
    for d in [
        DType("float64", "<f8", True, 52, 2.0**-52),
        DType("float32", "<f4", True, 23, 2.0**-23),
        DType("float16", "<f2", True, 10, 2.0**-10),
        DType("bfloat16", "<u2", True, 7, 2.0**-7),
        DType("float8_e4m3fn", "<u1", True, 3, 2.0**-3),
        DType("float8_e4m3fnuz", "<u1", True, 3, 2.0**-3),
        DType("float8_e5m2", "<u1", True, 2, 2.0**-2),
        DType("float8_e5m2fnuz", "<u1", True, 2, 2.0**-2),
        DType("int64", "<i8", False, 0, 0.0),
        DType("int32", "<i4", False, 0, 0.0),
        DType("int16", "<i2", False, 0, 0.0),
        DType("int8", "<i1", False, 0, 0.0),
        DType("uint8", "<u1", False, 0, 0.0),
        DType("uint16", "<u2", False, 0, 0.0),
        DType("uint32", "<u4", False, 0, 0.0),
        DType("uint64", "<u8", False, 0, 0.0),
        DType("bool", "|b1", False, 0, 0.0),
        DType("complex64", "<c8", True, 23, 2.0**-23),
        DType("complex128", "<c16", True, 52, 2.0**-52),
    ]
}


def dtype_info(name: str) -> DType:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def known_dtype(name: str) -> bool:
    return name in _DTYPES


def torch_dtype_name(dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def storage_itemsize(name: str) -> int:
    return np.dtype(dtype_info(name).storage).itemsize


# fp8 decoding tables: 256 entries each, built from the format definitions (not from torch) so a trace
# can be read on a machine whose torch lacks fp8.
def _fp8_table(exp_bits: int, man_bits: int, bias: int, fnuz: bool, e4m3fn: bool) -> np.ndarray:
    out = np.empty(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e = (b >> man_bits) & ((1 << exp_bits) - 1)
        m = b & ((1 << man_bits) - 1)
        if fnuz and b == 0x80:
            out[b] = np.nan
            continue
        if e4m3fn and e == 0xF and m == 0x7:
            out[b] = np.nan
            continue
        if not fnuz and not e4m3fn and e == (1 << exp_bits) - 1:
            out[b] = sign * np.inf if m == 0 else np.nan
            continue
        if e == 0:
            val = (m / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            val = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        out[b] = sign * val
    return out


_FP8 = {
    "float8_e4m3fn": _fp8_table(4, 3, 7, fnuz=False, e4m3fn=True),
    "float8_e4m3fnuz": _fp8_table(4, 3, 8, fnuz=True, e4m3fn=False),
    "float8_e5m2": _fp8_table(5, 2, 15, fnuz=False, e4m3fn=False),
    "float8_e5m2fnuz": _fp8_table(5, 2, 16, fnuz=True, e4m3fn=False),
}


def to_float(raw: np.ndarray, name: str) -> np.ndarray:
    """Decode stored bits to a float array (float64 for float64, float32 otherwise)."""
    if name == "bfloat16":          # the bits widened and shifted in one pass (every point is read this way)
        return np.left_shift(raw, 16, dtype=np.uint32).view(np.float32)
    if name in _FP8:
        return _FP8[name][raw]
    if name == "float64":
        return np.asarray(raw)
    if name in ("complex64", "complex128"):
        raise ValueError("complex tensors cannot be compared as real floats; compare their real/imag views")
    if name in ("float32", "float16"):
        return np.asarray(raw, dtype=np.float32)
    return np.asarray(raw).astype(np.float64)  # ints and bools: float64 holds every id exactly
