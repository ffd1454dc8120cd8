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

_KERNELS: "Kernels | None" = None
_TRIED = False


class Kernels:
    """The compiled kernels (numba dispatchers; first call per argument types compiles, or loads the cache)."""

    def __init__(self, hash_bits: Callable, float_block: Callable):
        self.hash_bits = hash_bits
        self.float_block = float_block


def _build() -> Kernels:
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

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def float_block(vals, bits, out, start, low):
        """One pass over a contiguous float32/float64 block `vals` (`bits`: the same memory as int32/int64):
        `out[:] = vals` widened to float64, the hash of the block at flat offset `start`, and the smallest and
        largest order key of the values (key = bits ^ (sign ? low : 0), low = 2**(width-1) - 1: ordered like
        the floats, and an integer min/max vectorises where a float one does not; NaN has keys beyond +-inf)."""
        total = np.int64(0)
        idx = np.int64(start) * k1
        b0 = np.int64(bits[0])
        kmin = b0 ^ ((b0 >> 63) & low)
        kmax = kmin
        for i in range(vals.shape[0]):
            out[i] = vals[i]
            b = np.int64(bits[i])
            key = b ^ ((b >> 63) & low)
            kmin = key if key < kmin else kmin
            kmax = key if key > kmax else kmax
            v = (b ^ idx) * k2
            total += v ^ (v >> 31)
            idx += k1
        return total, kmin, kmax

    return Kernels(hash_bits, float_block)


def kernels() -> Kernels | None:
    """The compiled kernels, or None without numba (the callers then take their torch-op paths)."""
    global _KERNELS, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            _KERNELS = _build()
        except Exception as e:  # noqa: BLE001 - ImportError, or a numba that cannot compile here: torch path
            log.info("tic-trace: numba not usable (%s: %s); CPU statistics and hashes use torch ops (slower, "
                     "same values)", type(e).__name__, e)
            _KERNELS = None
    return _KERNELS


def hash_kernel() -> Callable | None:
    """The compiled `hash_bits(bits: np.ndarray, start: int) -> np.int64`, or None without numba."""
    k = kernels()
    return k.hash_bits if k is not None else None
