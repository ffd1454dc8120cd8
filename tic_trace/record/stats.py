"""Summary statistics and a bit-exact hash, computed where the tensor lives.

`device_stats` returns small tensors on the tensor's own device; the tracer stacks them and fetches them to
the host once per pass, so recording never forces a host sync per op. `numpy_stats` computes the same
numbers from stored bits, so the two can be checked against each other and stats can be computed for
records read back from disk.

Memory: both walk the tensor in blocks of at most `_CHUNK` elements in logical order (a strided tensor is
cut along its leading dimensions, never copied whole), so the transient memory of one record is bounded by
a few buffers of `_CHUNK` int64/float64 elements (`TRANSIENT_BYTES_MAX`, tested), whatever the tensor's size.
"""
from __future__ import annotations

import math
import threading
from typing import Iterator

import numpy as np
import torch

from ..store.dtypes import to_float
from .host_kernels import hash_kernel, kernels

# Hash mixing constants (odd 64-bit multipliers from splitmix64), as signed int64.
_K1 = 0x9E3779B97F4A7C15 - (1 << 64)
_K2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_CHUNK = 1 << 20  # elements per block on an accelerator: 8 MiB per int64/float64 temporary (peak measured 56 MiB)
# Elements per block on the CPU: 1 MiB int64 buffers stay in cache across the hash's passes (measured: the
# hash costs ~4.6 ns/element with 128 Ki blocks, ~8.6 with 2 Mi blocks, one thread).
_HOST_CHUNK = 1 << 17
_TABLE_MAX = 1 << 21  # longest cached `arange(n) * K1` per device (16 MiB of int64)
# The bound the tests measure: two int64 hash buffers, or a float64 copy plus one temporary of the input's
# dtype (<= 8 bytes), plus a non-contiguous block's copy, per block; caches (index table, CPU scratch) aside.
TRANSIENT_BYTES_MAX = 64 << 20
# Hash CPU tensors with the fused numba kernel when numba is installed (same bits as the torch ops; tests
# switch it off to compare the two).
USE_HOST_KERNELS = True
# Test-only switch: take the accelerator code path (fresh buffers, branch-free masked statistics) on CPU.
FORCE_DEVICE_PATH = False

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_VIEW = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
# Floating dtypes reductions handle natively; others (fp8, ...) are widened to float32 first (exactly).
_NATIVE_FLOAT = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_IDX_TABLE: dict[torch.device, torch.Tensor] = {}
_SCRATCH = threading.local()   # CPU only: reusable int64 buffers, so a record costs no fresh allocation


def _host_path(dev: torch.device) -> bool:
    return dev.type == "cpu" and not FORCE_DEVICE_PATH


def _step(dev: torch.device) -> int:
    return min(_HOST_CHUNK, _CHUNK) if _host_path(dev) else _CHUNK


def _bits_view(x: torch.Tensor) -> torch.Tensor:
    """x's bits as a signed integer tensor of the same width (bool stays bool: 0/1); no copy, any strides."""
    if x.dtype == torch.bool:
        return x
    if x.is_complex():
        x = torch.view_as_real(x)
    return x.view(_INT_VIEW[x.element_size()])


def _logical(t: torch.Tensor) -> torch.Tensor:
    """t with complex values as (real, imag) pairs: the values statistics and hash see, in logical order (a
    lazily negated or conjugated view resolved: its memory does not hold its values)."""
    t = t.detach()
    if t.is_neg() or t.is_conj():
        t = t.resolve_conj().resolve_neg()
    return torch.view_as_real(t) if t.is_complex() else t


def blocks(x: torch.Tensor, step: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(flat start, block) pairs covering x in logical (row-major) order, each block a view of at most `step`
    elements: slices of the flat view when x is contiguous, else slabs along the leading dimensions."""
    step = max(1, step or _CHUNK)
    if x.dim() == 0:
        yield 0, x.reshape(1)
        return
    if x.numel() == 0:
        return
    if x.is_contiguous():
        flat = x.view(-1)
        for s in range(0, flat.numel(), step):
            yield s, flat[s:s + step]
        return
    yield from _slabs(x, 0, step)


def _slabs(x: torch.Tensor, base: int, step: int) -> Iterator[tuple[int, torch.Tensor]]:
    inner = x.numel() // x.shape[0]
    if inner <= step:
        rows = max(1, step // max(inner, 1))
        for r in range(0, x.shape[0], rows):
            yield base + r * inner, x[r:r + rows]
    else:
        for r in range(x.shape[0]):
            yield from _slabs(x[r], base + r * inner, step)


def _wrap(v: int, width: int = 64) -> int:
    """v modulo 2**width as a signed `width`-bit integer (two's complement)."""
    v &= (1 << width) - 1
    return v - (1 << width) if v >= (1 << (width - 1)) else v


def _idx_k1(start: int, n: int, device: torch.device, out: torch.Tensor) -> torch.Tensor:
    """`arange(start, start + n) * K1` (wrapping), n <= _TABLE_MAX: a slice of a per-device table of
    `arange * K1` (no arange and no multiply per record), plus `start * K1` (into `out`) after the first block."""
    table = _IDX_TABLE.get(device)
    if table is None or table.numel() < min(start + n, _TABLE_MAX):
        size = min(_TABLE_MAX, max(start + n, 1 << 16, 2 * (table.numel() if table is not None else 0)))
        with torch.inference_mode(False):   # a normal tensor, usable in and out of inference mode
            table = torch.arange(size, dtype=torch.int64, device=device) * _K1
        _IDX_TABLE[device] = table
    if start + n <= table.numel():
        return table[start:start + n]        # within the table: a slice, no pass
    return torch.add(table[:n], _wrap(start * _K1), out=out)   # (start+j)*K1 == start*K1 + j*K1 mod 2**64


def _scratch(n: int, which: int) -> torch.Tensor:
    """Reusable CPU int64 buffer `which` (0 or 1) of this thread, n <= _TABLE_MAX elements. On CPU a fresh
    multi-MB buffer per record costs page faults comparable to the arithmetic itself."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = [None, None]
    b = bufs[which]
    if b is None or b.numel() < n:
        size = min(_TABLE_MAX, max(n, 1 << 16, 2 * (b.numel() if b is not None else 0)))
        with torch.inference_mode(False):
            b = bufs[which] = torch.empty(size, dtype=torch.int64)
    return b[:n]


def _buffers(m: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two int64 buffers of m elements: this thread's scratch on CPU; fresh ones (the caching allocator's,
    stream-safe) on an accelerator."""
    if _host_path(dev):
        return _scratch(m, 0), _scratch(m, 1)
    return (torch.empty(m, dtype=torch.int64, device=dev), torch.empty(m, dtype=torch.int64, device=dev))


def device_hash(t: torch.Tensor) -> torch.Tensor:
    """Order-sensitive hash of the exact bits, as an int64 scalar on t's device (wrapping arithmetic).

    sum_i mix((bits_i as int64) ^ (i * K1)), mix(v) = w ^ (w >> 31) with w = v * K2: the same definition as
    `numpy_hash`. Per block, in place in two int64 buffers: widen, xor the index table, multiply, shift, xor,
    sum (on an accelerator the widening is fused into the xor: type promotion into an int64 `out`)."""
    with torch._C._DisableTorchDispatch():   # our own kernels are not the model's: no dispatch-mode overhead
        return _hash_logical(_logical(t))


def _hash_logical(x: torch.Tensor) -> torch.Tensor:
    """`device_hash` of x already in logical form (`_logical`)."""
    if _host_path(x.device) and USE_HOST_KERNELS:
        kernel = hash_kernel()
        if kernel is not None:
            return _fused_host_hash(x, kernel)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for start, blk in blocks(x, min(_step(x.device), _TABLE_MAX)):
        m = blk.numel()
        v, tmp = _buffers(m, x.device)
        v, tmp = v.view(blk.shape), tmp.view(blk.shape)
        idx = _idx_k1(start, m, x.device, out=tmp.view(-1)).view(blk.shape)
        if _host_path(x.device):
            # CPU: widen, then xor in place (a mixed-dtype xor takes a slow casting loop, 2x the two
            # passes); numpy's int64 multiply is vectorised where torch's is not (measured 0.27 vs 0.65 ns)
            v.copy_(_bits_view(blk))
            v.bitwise_xor_(idx)
            np.multiply(v.numpy(), np.int64(_K2), out=v.numpy())
        else:
            torch.bitwise_xor(_bits_view(blk), idx, out=v)  # widening fused into the xor: one pass less
            v.mul_(_K2)
        torch.bitwise_right_shift(v, 31, out=tmp)
        v.bitwise_xor_(tmp)
        total += v.sum()
        del v, tmp, idx     # before the next block's buffers exist: one block's worth at a time
    return total


def _fused_host_hash(x: torch.Tensor, kernel) -> torch.Tensor:
    """device_hash of a CPU tensor with the fused kernel (host_kernels.py): one pass over the bits, no
    temporaries: a contiguous tensor in one call; a strided one in logical-order blocks, each copied
    contiguous (at most one block's bytes)."""
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    if x.is_contiguous():
        return torch.tensor(int(kernel(_bits_view(x).reshape(-1).numpy(), 0)), dtype=torch.int64)
    total = 0
    for start, blk in blocks(x, _step(x.device)):
        total += int(kernel(_bits_view(blk.contiguous()).view(-1).numpy(), start))
    return torch.tensor(_wrap(total), dtype=torch.int64)


def device_stats(t: torch.Tensor) -> torch.Tensor:
    """[count, sum, sumsq, absmax, min, max, nan, inf] as float64 on t's device (non-finite values excluded
    from the moments, counted instead): the definition of `numpy_stats`.

    Per block of at most _CHUNK elements: min and max in one reduction, the moments from one float64 copy
    (sum and a dot product). Non-finite values need masking; on a CPU tensor the min/max just computed tell
    whether there are any (reading a CPU scalar is not a device sync), so the masking passes only run when
    needed. On an accelerator the masked path always runs, branch free, so no host sync happens per record.
    A float32/float64 CPU tensor, with numba, takes the fused pass of `stats_and_hash` instead."""
    with torch._C._DisableTorchDispatch():
        x = _logical(t)
        kernel = _fused_kernel(x)
        if kernel is not None:
            return _fused_host_stats_hash(x, kernel)[0]
        return _stats_by_ops(x)


def stats_and_hash(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`device_stats(t)` and `device_hash(t)`, both on t's device: what the tracer takes of every record. A
    float32/float64 CPU tensor, with numba, is read once for both (host_kernels.float_stats_hash)."""
    with torch._C._DisableTorchDispatch():
        x = _logical(t)
        kernel = _fused_kernel(x)
        if kernel is not None:
            return _fused_host_stats_hash(x, kernel)
        return _stats_by_ops(x), _hash_logical(x)


def _stats_by_ops(x: torch.Tensor) -> torch.Tensor:
    dev = x.device
    if x.numel() == 0:
        return torch.zeros(8, dtype=torch.float64, device=dev)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    count = torch.full((), float(x.numel()), dtype=torch.float64, device=dev)
    step = _step(dev)
    if not x.is_floating_point():
        parts = [_int_block(b) for _, b in blocks(x, step)]
    elif _host_path(dev):
        parts = [_host_float_block(b) for _, b in blocks(x, step)]
    else:
        parts = [_masked_block(b) for _, b in blocks(x, step)]
    return _combine(count, parts)


class _FusedDtype:
    """What the fused kernel needs of a dtype: its integer view, the magnitude and exponent masks, and the
    order keys (host_kernels: bits ^ (sign ? magnitude mask : 0)) of +inf and -inf."""

    def __init__(self, ints: torch.dtype, width: int, mantissa: int):
        self.ints = ints
        self.low = (1 << (width - 1)) - 1
        self.expo = self.low ^ ((1 << mantissa) - 1)     # +inf's bits
        self.key_pinf = self.expo
        self.key_ninf = _wrap(self.expo | (1 << (width - 1)), width) ^ self.low


_FUSED_FLOAT = {torch.float32: _FusedDtype(torch.int32, 32, 23), torch.float64: _FusedDtype(torch.int64, 64, 52)}


def _fused_kernel(x: torch.Tensor):
    """The fused CPU statistics + hash kernel for x, or None (another dtype or device, no numba)."""
    if x.dtype in _FUSED_FLOAT and x.numel() and _host_path(x.device) and USE_HOST_KERNELS:
        k = kernels()
        return k.float_stats_hash if k is not None else None
    return None


def _ordered_min(a: float, b: float) -> float:
    """min with -0.0 below 0.0, as the kernel's order keys have it (never NaN here)."""
    return b if b < a or (b == a and math.copysign(1.0, b) < 0) else a


def _contiguous_copy(b: torch.Tensor) -> torch.Tensor:
    """A CPU block (at most `_HOST_CHUNK` elements) copied into this thread's scratch buffer, flat: a fresh
    block per record would be allocated and freed by the C heap at every strided record (page faults)."""
    n_words = -(-b.numel() * b.element_size() // 8)
    flat = _scratch(n_words, 1).view(b.dtype)[:b.numel()]
    flat.view(b.shape).copy_(b)
    return flat


def host_stats_hash_into(t: torch.Tensor, row: np.ndarray) -> int | None:
    """For a float32/float64 CPU tensor with numba: its statistics written into `row` (float64, 8 entries)
    and its hash returned, from one read and no allocation that outlives the call; otherwise None (the
    caller takes `stats_and_hash`). The tracer keeps a pass's rows in one preallocated array: small
    long-lived allocations per record split the freed blocks of the model's large tensors in the C heap,
    which then grows and is trimmed back at every layer (measured: ~30 000 page faults per pass, +45 ms)."""
    if not _host_path(t.device):
        return None
    with torch._C._DisableTorchDispatch():
        x = _logical(t)
        kernel = _fused_kernel(x)
        if kernel is None:
            return None
        return _fused_host_into(x, kernel, row)


def _fused_host_stats_hash(x: torch.Tensor, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    row = np.empty(8, dtype=np.float64)
    h = _fused_host_into(x, kernel, row)
    return torch.from_numpy(row), torch.from_numpy(np.array(h, dtype=np.int64))


def _fused_host_into(x: torch.Tensor, kernel, row: np.ndarray) -> int:
    """Statistics (into `row`) and hash of a float32/float64 CPU tensor from one read: a contiguous tensor in
    one kernel call; a strided one in logical-order blocks, each copied contiguous (at most one block's
    bytes), their rows combined as `_combine` does. The sums are float64 in the kernel's order (runs of
    `_HOST_CHUNK`, each vectorised), not torch's: they agree with the torch path and `numpy_stats` to float64
    rounding; extremes, counts and the hash exactly."""
    fd = _FUSED_FLOAT[x.dtype]
    step = _step(x.device)
    if x.is_contiguous():
        flat = x.reshape(-1)
        return int(kernel(flat.numpy(), flat.view(fd.ints).numpy(), 0, fd.low, fd.expo, fd.key_pinf,
                          fd.key_ninf, step, row))     # an int64: already wrapped
    total, part = 0, np.empty(8, dtype=np.float64)
    for i, (start, blk) in enumerate(blocks(x, step)):
        flat = _contiguous_copy(blk)
        total += int(kernel(flat.numpy(), flat.view(fd.ints).numpy(), start, fd.low, fd.expo, fd.key_pinf,
                            fd.key_ninf, step, row if i == 0 else part))
        if i:
            row[[0, 1, 2, 6, 7]] += part[[0, 1, 2, 6, 7]]
            row[4], row[5] = _ordered_min(row[4], part[4]), -_ordered_min(-row[5], -part[5])
    row[3] = max(-row[4], row[5], 0.0)
    return _wrap(total)


def _native(b: torch.Tensor) -> torch.Tensor:
    return b if b.dtype in _NATIVE_FLOAT else b.to(torch.float32)   # fp8 & co: widened exactly, per block


def _float64_copy(b: torch.Tensor) -> torch.Tensor:
    """b as a contiguous float64 tensor: into this thread's scratch buffer on the CPU path."""
    if _host_path(b.device):
        return _scratch(b.numel(), 0).view(torch.float64).view(b.shape).copy_(b)
    return torch.empty(b.shape, dtype=torch.float64, device=b.device).copy_(b)   # always a copy: ours


def _int_block(b: torch.Tensor) -> tuple:
    mn, mx = torch.aminmax(b)
    xd = _float64_copy(b).view(-1)
    return xd.sum(), _sumsq(xd), mn.to(torch.float64), mx.to(torch.float64), 0, 0


def _host_float_block(b: torch.Tensor) -> tuple:
    b = _native(b)
    mn, mx = torch.aminmax(b)                # NaN propagates; +-inf show as the extremes
    if not (math.isfinite(mn.item()) and math.isfinite(mx.item())):
        return _masked_block(b)
    xd = _float64_copy(b).view(-1)
    return xd.sum(), _sumsq(xd), mn.to(torch.float64), mx.to(torch.float64), 0, 0


def _masked_block(b: torch.Tensor) -> tuple:
    """The general path (NaN/Inf possibly present), without data-dependent control flow. One temporary at a
    time: the largest is the float64 copy."""
    inf = float("inf")
    b = _native(b)
    nonfinite = torch.count_nonzero(b - b)                            # x - x is NaN exactly when x is not finite
    nan = torch.count_nonzero(torch.isnan(b))
    mn = torch.nan_to_num(b, nan=inf, posinf=inf, neginf=inf).amin().to(torch.float64)
    mx = torch.nan_to_num(b, nan=-inf, posinf=-inf, neginf=-inf).amax().to(torch.float64)
    # Non-finite -> 0, in place in a float64 copy that is ours (never `.to`, which may return b itself).
    zd = torch.empty(b.shape, dtype=torch.float64, device=b.device).copy_(b)
    zd = zd.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).view(-1)
    return zd.sum(), _sumsq(zd), mn, mx, nan, nonfinite


def _masked_stats(flat: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The accelerator path's statistics of `flat` (any device): kept for tests that compare paths."""
    with torch._C._DisableTorchDispatch():
        return _combine(count, [_masked_block(b) for _, b in blocks(flat, _step(flat.device))])


def _combine(count: torch.Tensor, parts: list[tuple]) -> torch.Tensor:
    s, ss, mn, mx, nan, nonfinite = parts[0]
    for ps, pss, pmn, pmx, pnan, pnf in parts[1:]:
        s, ss, nan, nonfinite = s + ps, ss + pss, nan + pnan, nonfinite + pnf
        mn, mx = torch.minimum(mn, pmn), torch.maximum(mx, pmx)
    # absmax of the zero-filled values: max(-min, max) over the finite ones (>= 0), or 0 when there are none.
    amax = torch.clamp_min(torch.maximum(-mn, mx), 0.0)
    if isinstance(nan, int):                 # every block finite (CPU fast path): no counts to convert
        zero = torch.zeros((), dtype=torch.float64, device=count.device)
        return torch.stack([count, s, ss, amax, mn, mx, zero, zero])
    nan_f = torch.as_tensor(nan, dtype=torch.float64, device=count.device)
    nonf_f = torch.as_tensor(nonfinite, dtype=torch.float64, device=count.device)
    return torch.stack([count, s, ss, amax, mn, mx, nan_f, nonf_f - nan_f])


def _sumsq(xd: torch.Tensor) -> torch.Tensor:
    return torch.dot(xd, xd)              # one pass, no temporary (blocks are far below dot's 2**31 limit)


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
    with np.errstate(over="ignore"):    # the sum of squares of float64 near its max is inf, as on the device
        return stats_dict([x.size, xz.sum(), (xz * xz).sum(), np.abs(xz).max(),
                           np.where(finite, x, np.inf).min(), np.where(finite, x, -np.inf).max(),
                           np.isnan(x).sum(), np.isinf(x).sum()])
