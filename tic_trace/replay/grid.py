"""A float dtype's rounding grid in float64 numpy (no torch): the spacing (ULP) at a value, correct rounding
onto the grid, and the dtype a wider record's values actually lie on. Used by the replay's intrinsic error
and by the finder's measure step (in worker processes that import numpy only)."""
from __future__ import annotations

import numpy as np

from ..store.dtypes import dtype_info

# Smallest normal exponent per float dtype: below it the grid is uniform (subnormals).
_MIN_EXP = {"float64": -1022, "float32": -126, "bfloat16": -126, "float16": -14,
            "float8_e4m3fn": -6, "float8_e4m3fnuz": -7, "float8_e5m2": -14, "float8_e5m2fnuz": -15}


_EXP_BITS = np.int64(0x7FF0000000000000)


def grid_spacing(x: np.ndarray, dtype: str) -> np.ndarray:
    """Spacing of `dtype`'s grid at x (ULP), exact: |x| in [2^e, 2^(e+1)) -> 2^(e-mantissa), e read from the
    float64 exponent bits (what frexp gives, at a fifth of its cost: the replay measures every element of a
    trace); 0 and non-finite values take e = -1 as frexp's (0, 0) does. The result is a power of two built
    from its bits, exactly."""
    mant = dtype_info(dtype).mantissa_bits
    lo = _MIN_EXP.get(dtype, -126)
    if lo - mant + 1023 <= 0:           # spacings below float64's normal range (float64's own): frexp
        _, e = np.frexp(np.abs(x))
        return np.ldexp(1.0, np.maximum(e - 1, lo) - mant)
    b = np.ascontiguousarray(x, dtype=np.float64).view(np.int64)
    # |x| with its mantissa cleared is 2^e (0 for zeros and float64 subnormals, inf for inf/NaN): times
    # 2^-mantissa it is the spacing, exactly, floored at the dtype's subnormal spacing
    out = np.maximum((b & _EXP_BITS).view(np.float64) * 2.0 ** -mant, 2.0 ** (lo - mant)).reshape(np.shape(x))
    odd = ~np.isfinite(out) | (x == 0)
    if odd.any():                       # frexp's (0, 0) for zeros and non-finite values: e = -1
        out = np.where(odd, 2.0 ** (-1 - mant), out)
    return out[()] if out.ndim == 0 else out


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x (float64) correctly rounded (to nearest, ties to even) onto `dtype`'s grid; no overflow handling."""
    sp = grid_spacing(x, dtype)
    return np.rint(x / sp) * sp


def effective_dtype(y: np.ndarray, dtype: str, block: int = 1 << 18) -> str:
    """bfloat16 when a wider record holds only bf16 values (an engine that computes in bf16 and upcasts its
    output, e.g. logits, to fp32): its precision is that of bf16, and its ULPs must be bf16's. Read `block`
    elements at a time (widened to float64 one block at a time)."""
    if dtype not in ("float32", "float64"):
        return dtype
    flat, any_finite = y.reshape(-1), False
    for s in range(0, flat.size, block):
        x = flat[s:s + block].astype(np.float64)
        fin = x[np.isfinite(x)]
        if fin.size and not np.array_equal(fin, round_to(fin, "bfloat16")):
            return dtype
        any_finite |= fin.size > 0
    return "bfloat16" if any_finite else dtype


ROW_MIN = 16    # elements a row needs for its own rounding floor to be a stable yardstick


def row_relative_excess(d: np.ndarray, f: np.ndarray) -> float:
    """An error in units of the rounding floor, measured per row against that row's own floor and aggregated
    as the RMS over rows: each row counts once, whatever its scale. A few massive rows (a residual channel
    10^4 x the rest) then neither hide an error in the ordinary rows nor set the point's envelope.

    `d`: a side's (or an implementation's) error against the exact value, [rows, m]; `f`: the correctly
    rounded value's error, same shape. 0.0 when it does not apply (rows under ROW_MIN elements, a row whose
    floor is 0 while its error is not): the caller then uses the all-elements ratio."""
    if d.ndim != 2 or d.shape[0] == 0 or d.shape[1] < ROW_MIN:
        return 0.0
    return row_relative_excess_sq(row_sq(d), row_sq(f), d.shape[1])


def row_sq(a: np.ndarray) -> np.ndarray:
    """Each row's sum of squares of a [rows, m] float64 array, in one pass (no squared copy)."""
    return np.einsum("ij,ij->i", a, a)


def row_relative_excess_sq(dd: np.ndarray, ff: np.ndarray, m: int) -> float:
    """`row_relative_excess` from the rows' squared norms of the error (`dd`) and of the floor (`ff`), rows
    of `m` elements."""
    if dd.ndim != 1 or dd.shape[0] == 0 or m < ROW_MIN:
        return 0.0
    dn, fn = np.sqrt(dd), np.sqrt(ff)
    exact = fn == 0
    if (dn[exact] > 0).any():
        return 0.0
    if exact.all():
        return 1.0
    r = dn[~exact] / fn[~exact]
    return float(np.sqrt((r * r).mean()))
