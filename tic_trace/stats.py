"""Summary statistics and a bit-exact hash, computed where the tensor lives.

`device_stats` returns small tensors on the tensor's own device; the tracer stacks them and fetches them to
the host once per pass, so recording never forces a host sync per op. `numpy_stats` computes the same
numbers from stored bits, so the two can be checked against each other and stats can be computed for
records read back from disk.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .dtypes import to_float

# Hash mixing constants (odd 64-bit multipliers from splitmix64), as signed int64.
_K1 = 0x9E3779B97F4A7C15 - (1 << 64)
_K2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_CHUNK = 1 << 24  # elements per hashing chunk: bounds the temporary int64 memory on the device
_TABLE_MAX = 1 << 22  # longest cached `arange(n) * K1` per device (32 MiB of int64)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_VIEW = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
# Floating dtypes reductions handle natively; others (fp8, ...) are widened to float32 first (exactly).
_NATIVE_FLOAT = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_IDX_TABLE: dict[torch.device, torch.Tensor] = {}
_SCRATCH = threading.local()   # CPU only: reusable int64 buffers, so a record costs no fresh allocation


def _bits_int64(flat: torch.Tensor) -> torch.Tensor:
    if flat.dtype == torch.bool:
        return flat.to(torch.int64)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)


def _wrap64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= (1 << 63) else v


def _idx_k1(start: int, n: int, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """`arange(start, start + n) * K1` (wrapping), for n <= _TABLE_MAX: a slice of a per-device table of
    `arange * K1` (no arange and no multiply per record), plus `start * K1` for chunks after the first."""
    if n > _TABLE_MAX:
        return torch.arange(start, start + n, dtype=torch.int64, device=device) * _K1
    table = _IDX_TABLE.get(device)
    if table is None or table.numel() < n:
        size = min(_TABLE_MAX, max(n, 1 << 16, 2 * (table.numel() if table is not None else 0)))
        with torch.inference_mode(False):   # a normal tensor, usable in and out of inference mode
            table = torch.arange(size, dtype=torch.int64, device=device) * _K1
        _IDX_TABLE[device] = table
    if start == 0:
        return table[:n]
    shift = _wrap64(start * _K1)            # (start + j) * K1 == start * K1 + j * K1 (mod 2**64)
    return table[:n] + shift if out is None else torch.add(table[:n], shift, out=out)


def _scratch(n: int, which: int) -> torch.Tensor | None:
    """Reusable CPU int64 buffer `which` (0 or 1) of this thread, n elements; None when n is too large.
    On CPU a fresh multi-MB buffer per record costs page faults comparable to the arithmetic itself."""
    if n > _TABLE_MAX:
        return None
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = [None, None]
    b = bufs[which]
    if b is None or b.numel() < n:
        size = min(_TABLE_MAX, max(n, 1 << 16, 2 * (b.numel() if b is not None else 0)))
        with torch.inference_mode(False):
            b = bufs[which] = torch.empty(size, dtype=torch.int64)
    return b[:n]


def device_hash(t: torch.Tensor) -> torch.Tensor:
    """Order-sensitive hash of the exact bits, as an int64 scalar on t's device (wrapping arithmetic).

    sum_i mix((bits_i as int64) ^ (i * K1)), mix(v) = w ^ (w >> 31) with w = v * K2: the same definition as
    `numpy_hash`. Chunks of at most _TABLE_MAX elements, five elementwise passes each, in place where the
    buffer is our own (on CPU: reused scratch buffers, no allocation per record)."""
    with torch._C._DisableTorchDispatch():   # our own kernels are not the model's: no dispatch-mode overhead
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        total = torch.zeros((), dtype=torch.int64, device=t.device)
        cpu = t.device.type == "cpu"
        step = max(1, min(_CHUNK, _TABLE_MAX))
        for start in range(0, flat.numel(), step):
            chunk = flat[start:start + step]
            m = chunk.numel()
            v = _scratch(m, 0) if cpu else None
            if v is not None:
                tmp = _scratch(m, 1)
                # Same integers as _bits_int64: copy_ widens the signed int view exactly (bool -> 0/1).
                v.copy_(chunk if chunk.dtype == torch.bool else chunk.view(_INT_VIEW[chunk.element_size()]))
                v.bitwise_xor_(_idx_k1(start, m, t.device, out=tmp))
                v.mul_(_K2)
                v.bitwise_xor_(torch.bitwise_right_shift(v, 31, out=tmp))
            else:
                v = torch.bitwise_xor(_bits_int64(chunk), _idx_k1(start, m, t.device))   # a new buffer: ours
                v.mul_(_K2)
                v.bitwise_xor_(v >> 31)
            total = total + v.sum()
        return total


def device_stats(t: torch.Tensor) -> torch.Tensor:
    """[count, sum, sumsq, absmax, min, max, nan, inf] as float64 on t's device (non-finite values excluded
    from the moments, counted instead): the definition of `numpy_stats`.

    A handful of kernels per record: min and max in one reduction, the moments from one float64 copy (sum and
    a dot product). Non-finite values need masking; on a CPU tensor the min/max just computed tell whether
    there are any (reading a CPU scalar is not a device sync), so the masking passes only run when needed. On
    an accelerator the masked path always runs, branch free, so no host sync happens per record."""
    with torch._C._DisableTorchDispatch():
        x = t.detach()
        n = x.numel()
        dev = x.device
        if n == 0:
            return torch.zeros(8, dtype=torch.float64, device=dev)
        if x.is_complex():
            x = torch.view_as_real(x)          # real and imaginary parts count as values
        flat = x.reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        count = torch.full((), float(flat.numel()), dtype=torch.float64, device=dev)
        if not flat.is_floating_point():
            mn, mx = torch.aminmax(flat)
            mn, mx = mn.to(torch.float64), mx.to(torch.float64)
            xd = flat.to(torch.float64)
            zero = torch.zeros((), dtype=torch.float64, device=dev)
            return torch.stack([count, xd.sum(), _sumsq(xd), torch.maximum(-mn, mx), mn, mx, zero, zero])
        if flat.dtype not in _NATIVE_FLOAT:
            flat = flat.to(torch.float32)
        if dev.type == "cpu":
            mn, mx = torch.aminmax(flat)          # NaN propagates; +-inf show as the extremes
            if math.isfinite(mn.item()) and math.isfinite(mx.item()):
                s = ss = None
                step = max(1, _TABLE_MAX)
                for start in range(0, flat.numel(), step):     # float64 copies into a reused buffer
                    c = flat[start:start + step]
                    xd = _scratch(c.numel(), 0).view(torch.float64).copy_(c)
                    s = xd.sum() if s is None else s + xd.sum()
                    ss = _sumsq(xd) if ss is None else ss + _sumsq(xd)
                mn, mx = mn.to(torch.float64), mx.to(torch.float64)
                zero = torch.zeros((), dtype=torch.float64, device=dev)
                return torch.stack([count, s, ss, torch.maximum(-mn, mx), mn, mx, zero, zero])
        return _masked_stats(flat, count)


def _sumsq(xd: torch.Tensor) -> torch.Tensor:
    if xd.numel() < (1 << 31):
        return torch.dot(xd, xd)              # one pass, no temporary
    return (xd * xd).sum()


def _masked_stats(flat: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The general path (NaN/Inf possibly present), without data-dependent control flow."""
    inf = float("inf")
    z = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)         # non-finite -> 0 for the moments
    zd = z.to(torch.float64)
    nonfinite = torch.count_nonzero(flat - flat)                       # x - x is NaN exactly when x is not finite
    nan = torch.count_nonzero(torch.isnan(flat))
    mn = torch.nan_to_num(flat, nan=inf, posinf=inf, neginf=inf).amin().to(torch.float64)
    mx = torch.nan_to_num(flat, nan=-inf, posinf=-inf, neginf=-inf).amax().to(torch.float64)
    # absmax of the zero-filled values: max(-min, max) over the finite ones (>= 0), or 0 when there are none.
    amax = torch.clamp_min(torch.maximum(-mn, mx), 0.0)
    nan_f = nan.to(torch.float64)
    return torch.stack([count, zd.sum(), _sumsq(zd), amax, mn, mx, nan_f, nonfinite.to(torch.float64) - nan_f])


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
