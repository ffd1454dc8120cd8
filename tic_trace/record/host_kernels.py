"""Fused CPU kernels for the record path: the hash (`hash_bits`), and for float32/float64 tensors the hash
with every statistic (`float_stats_hash`), in one pass over the bits, no temporaries.

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
import threading
from typing import Callable

log = logging.getLogger("tic_trace")

# The hash's mixing constants, as signed int64 (the definition lives in stats.py; repeated here because the
# kernel must see them as compile-time globals).
K1 = 0x9E3779B97F4A7C15 - (1 << 64)
K2 = 0xBF58476D1CE4E5B9 - (1 << 64)

_KERNELS: "Kernels | None" = None
_TRIED = False
_LOCK = threading.Lock()


class Kernels:
    """The compiled kernels (numba dispatchers; first call per argument types compiles, or loads the cache)."""

    def __init__(self, hash_bits: Callable, float_stats_hash: Callable):
        self.hash_bits = hash_bits
        self.float_stats_hash = float_stats_hash


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

    # Only the float64 sums may be reassociated (LLVM then vectorises them); the integer arithmetic of the hash
    # and of the order keys is exact whatever the order, and no flag lets LLVM assume values are finite.
    @numba.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})
    def _float_part(vals, bits, start, low):
        """Statistics + hash of a contiguous float32/float64 run (`bits`: the same memory as int32/int64) at
        flat offset `start`, every value included: the hash, the smallest and largest order key (key = bits ^
        (sign ? low : 0), low = the magnitude mask: ordered like the floats, NaN beyond +-inf, and an integer
        min/max vectorises where a float one does not), the sum and sum of squares."""
        total = np.int64(0)
        idx = np.int64(start) * k1
        b0 = np.int64(bits[0])
        kmin = b0 ^ ((b0 >> 63) & low)
        kmax = kmin
        s, q = 0.0, 0.0
        for i in range(vals.shape[0]):
            a = np.float64(vals[i])
            s += a
            q += a * a
            b = np.int64(bits[i])
            key = b ^ ((b >> 63) & low)
            kmin = min(kmin, key)
            kmax = max(kmax, key)
            v = (b ^ idx) * k2
            total += v ^ (v >> 31)
            idx += k1
        return total, kmin, kmax, s, q

    @numba.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})
    def _masked_part(vals, bits, low, expo, key_pinf, key_ninf):
        """`_float_part`'s statistics of a run that holds non-finite values (rare: slower, no hash): those
        excluded from the extremes and sums, counted (|bits| >= the exponent mask `expo`: not finite; above
        it: NaN). No finite value: the keys of +inf and -inf, as the masked torch path gives."""
        kmin, kmax = np.int64(key_pinf), np.int64(key_ninf)
        s, q = 0.0, 0.0
        nan, nonfinite = np.int64(0), np.int64(0)
        for i in range(vals.shape[0]):
            b = np.int64(bits[i])
            mag = b & low
            if mag >= expo:
                nonfinite += 1
                nan += mag > expo
                continue
            a = np.float64(vals[i])
            s += a
            q += a * a
            key = b ^ ((b >> 63) & low)
            kmin = min(kmin, key)
            kmax = max(kmax, key)
        return kmin, kmax, s, q, nan, nonfinite

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _key_value(key, low, vals, bits):
        """The float (as float64) whose order key is `key`: the key is its own inverse."""
        b = key ^ low if key < 0 else key
        tmp = np.empty(1, bits.dtype)
        tmp[0] = b
        return np.float64(tmp.view(vals.dtype)[0])

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def float_stats_hash(vals, bits, start, low, expo, key_pinf, key_ninf, block, row):
        """Statistics + hash of a contiguous float32/float64 array at flat offset `start`, in `block`-element
        runs whose sums are added in order (the rounding error of a float64 sum then grows with the block,
        not the tensor). Writes `row` = [count, sum, sumsq, absmax, min, max, nan, inf] (non-finite values
        excluded from all but the counts; min +inf and max -inf when no value is finite) and returns the hash.
        One call per tensor, no temporaries."""
        total, kmin, kmax = np.int64(0), np.int64(key_pinf), np.int64(key_ninf)
        s, q, nan, nonfinite = 0.0, 0.0, np.int64(0), np.int64(0)
        n = vals.shape[0]
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            h, bmin, bmax, bs, bq = _float_part(vals[lo:hi], bits[lo:hi], start + lo, low)
            total += h
            if bmin <= key_ninf or bmax >= key_pinf:    # an infinity or a NaN (keys beyond them) in this run
                bmin, bmax, bs, bq, bnan, bnf = _masked_part(vals[lo:hi], bits[lo:hi], low, expo, key_pinf,
                                                             key_ninf)
                nan += bnan
                nonfinite += bnf
            kmin, kmax = min(kmin, bmin), max(kmax, bmax)
            s += bs
            q += bq
        mn, mx = _key_value(kmin, low, vals, bits), _key_value(kmax, low, vals, bits)
        row[0], row[1], row[2], row[3] = n, s, q, max(-mn, mx, 0.0)
        row[4], row[5], row[6], row[7] = mn, mx, nan, nonfinite - nan
        return total

    return Kernels(hash_bits, float_stats_hash)


def kernels() -> Kernels | None:
    """The compiled kernels, or None without numba (the callers then take their torch-op paths). Threads that
    ask while another is loading them wait for it (the weight-hash thread often loads them first)."""
    global _KERNELS, _TRIED
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                try:
                    _KERNELS = _build()
                except Exception as e:  # noqa: BLE001 - ImportError, or a numba that cannot compile: torch path
                    log.info("tic-trace: numba not usable (%s: %s); CPU statistics and hashes use torch ops "
                             "(slower, same values)", type(e).__name__, e)
                    _KERNELS = None
                _TRIED = True
    return _KERNELS


def hash_kernel() -> Callable | None:
    """The compiled `hash_bits(bits: np.ndarray, start: int) -> np.int64`, or None without numba."""
    k = kernels()
    return k.hash_bits if k is not None else None
