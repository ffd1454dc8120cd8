"""Summary statistics and a bit-exact hash, computed where the tensor lives.

`device_stats` returns small tensors on the tensor's own device; the tracer stacks them and fetches them to
the host once per pass, so recording never forces a host sync per op. `numpy_stats` computes the same
numbers from stored bits, so the two can be checked against each other and stats can be computed for
records read back from disk.
"""
from __future__ import annotations

import numpy as np
import torch

from .dtypes import to_float

# Hash mixing constants (odd 64-bit multipliers from splitmix64), as signed int64.
_K1 = 0x9E3779B97F4A7C15 - (1 << 64)
_K2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_CHUNK = 1 << 24  # elements per hashing chunk: bounds the temporary int64 memory on the device

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_VIEW = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _bits_int64(flat: torch.Tensor) -> torch.Tensor:
    if flat.dtype == torch.bool:
        return flat.to(torch.int64)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)


def device_hash(t: torch.Tensor) -> torch.Tensor:
    """Order-sensitive hash of the exact bits, as an int64 scalar on t's device (wrapping arithmetic)."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, flat.numel(), _CHUNK):
        bits = _bits_int64(flat[start:start + _CHUNK])
        idx = torch.arange(start, start + bits.numel(), dtype=torch.int64, device=t.device)
        v = (bits ^ (idx * _K1)) * _K2
        v = v ^ (v >> 31)
        total = total + v.sum()
    return total


def device_stats(t: torch.Tensor) -> torch.Tensor:
    """[count, sum, sumsq, absmax, min, max, nan, inf] as float64 on t's device (non-finite values excluded
    from the moments, counted instead)."""
    x = t.detach()
    n = x.numel()
    if n == 0:
        return torch.zeros(8, dtype=torch.float64, device=x.device)
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_floating_point():
        xf = x.to(torch.float64)
        nan = inf = torch.zeros((), dtype=torch.float64, device=x.device)
        finite = None
    else:
        xf = x.to(torch.float64)
        finite = torch.isfinite(xf)
        nan = torch.isnan(xf).sum().to(torch.float64)
        inf = torch.isinf(xf).sum().to(torch.float64)
        xf = torch.where(finite, xf, torch.zeros((), dtype=torch.float64, device=x.device))
    s = xf.sum()
    ss = (xf * xf).sum()
    amax = xf.abs().max()
    if finite is None:
        mn, mx = xf.min(), xf.max()
    else:
        big = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
        mn = torch.where(finite, xf, big).min()
        mx = torch.where(finite, xf, -big).max()
    count = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    return torch.stack([count, s, ss, amax, mn, mx, nan, inf])


def stats_dict(row) -> dict:
    keys = ("count", "sum", "sumsq", "absmax", "min", "max", "nan", "inf")
    vals = [float(v) for v in row]
    d = dict(zip(keys, vals))
    d["count"], d["nan"], d["inf"] = int(d["count"]), int(d["nan"]), int(d["inf"])
    return d


def numpy_hash(raw: np.ndarray) -> int:
    """The same hash as `device_hash`, from stored bits (any of our storage dtypes)."""
    flat = np.ascontiguousarray(raw).reshape(-1)
    if flat.dtype == np.bool_:
        bits = flat.astype(np.int64)
    else:
        if flat.dtype.kind == "c":
            flat = flat.view(np.float32 if flat.dtype.itemsize == 8 else np.float64)
        bits = flat.view(_NP_INT_VIEW[flat.dtype.itemsize]).astype(np.int64)
    idx = np.arange(bits.size, dtype=np.int64)
    with np.errstate(over="ignore"):
        v = (bits ^ (idx * np.int64(_K1))) * np.int64(_K2)
        v = v ^ (v >> np.int64(31))
        return int(v.sum(dtype=np.int64))


def numpy_stats(raw: np.ndarray, dtype: str) -> dict:
    """Stats of stored bits, in the same definition as `device_stats`."""
    if raw.size == 0:
        return stats_dict([0] * 8)
    if dtype in ("complex64", "complex128"):
        x = raw.view(np.float32 if dtype == "complex64" else np.float64).astype(np.float64)
    else:
        x = to_float(raw, dtype).astype(np.float64)
    finite = np.isfinite(x)
    xz = np.where(finite, x, 0.0)
    return stats_dict([x.size, xz.sum(), (xz * xz).sum(), np.abs(xz).max(),
                       np.where(finite, x, np.inf).min(), np.where(finite, x, -np.inf).max(),
                       np.isnan(x).sum(), np.isinf(x).sum()])
