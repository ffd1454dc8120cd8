"""Fused CPU kernels for the record path: the hash in one pass over the bits, no temporaries.

On the CPU, `stats.device_hash` written as torch ops makes six passes over int64 buffers per block (widen, xor
the index table, multiply, shift, xor, sum) and costs ~3.5 ns per element; the same arithmetic as one numba
loop reads each element once (~0.3 ns, vectorised by LLVM). Integer arithmetic wraps modulo 2**64 in both, and
the sum of int64 values is exact whatever the order, so the two give the same bits (tested against the torch
path and against `numpy_hash`).

numba is optional: `hash_kernel()` returns None when it is not installed (or fails to load), and the caller
takes the torch path. Imported lazily, on the first CPU hash: a job that hashes only accelerator tensors never
loads it. Compiled code is cached on disk by numba (`cache=True`) where the package directory is writable.
"""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("tic_trace")

# The hash's mixing constants, as signed int64 (the definition lives in stats.py; repeated here because the
# kernel must see them as compile-time globals).
K1 = 0x9E3779B97F4A7C15 - (1 << 64)
K2 = 0xBF58476D1CE4E5B9 - (1 << 64)

_KERNEL: Callable | None = None
_TRIED = False


def _build() -> Callable:
    import numba
    import numpy as np

    k1, k2 = np.int64(K1), np.int64(K2)

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def hash_bits(bits, start):
        """sum_i mix(int64(bits[i]) ^ ((start + i) * K1)), mix(v) = w ^ (w >> 31), w = v * K2; bits 1-D and
        contiguous (uint8 / int16 / int32 / int64: zero- or sign-extended exactly as torch and numpy widen)."""
        total = np.int64(0)
        idx = np.int64(start) * k1         # (start + i) * K1, advanced by one addition per element
        for i in range(bits.shape[0]):
            v = (np.int64(bits[i]) ^ idx) * k2
            total += v ^ (v >> 31)
            idx += k1
        return total

    return hash_bits


def hash_kernel() -> Callable | None:
    """The compiled `hash_bits(bits: np.ndarray, start: int) -> np.int64`, or None without numba."""
    global _KERNEL, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            _KERNEL = _build()
        except Exception as e:  # noqa: BLE001 - ImportError, or a numba that cannot compile here: torch path
            log.info("tic-trace: numba not usable (%s: %s); hashing CPU tensors with torch ops (slower, same "
                     "values)", type(e).__name__, e)
            _KERNEL = None
    return _KERNEL
