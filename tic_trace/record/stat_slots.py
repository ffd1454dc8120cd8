"""The statistics rows and hashes of one pass: one slot per distinct tensor (aliases share a slot).

A float32/float64 CPU tensor's row and hash are written by the fused kernel straight into arrays kept for the
tracer's life (grown by doubling, never shrunk): recording it allocates nothing that outlives the call.
That matters more than it seems: per-record objects living until the pass's end (a row array, a hash
scalar, their tensor wrappers) land in the C heap between the model's large transient tensors, split the
blocks those free, and make the heap grow and be trimmed back at every layer — on the benchmark model
~30 000 page faults per pass, +45 ms on a 145 ms forward (benchmarks/README.md).

Any other tensor (an accelerator's, another dtype, no numba) keeps its row and hash as small tensors on its
own device until `fetch`, the pass's one host sync.
"""
from __future__ import annotations

import numpy as np
import torch

from .stats import host_stats_hash_into, stats_and_hash


class StatSlots:
    def __init__(self, capacity: int = 1024):
        self._rows = np.empty((capacity, 8), dtype=np.float64)
        self._hashes = np.empty(capacity, dtype=np.int64)
        self._n = 0
        self._on_device: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self._n

    def add(self, x: torch.Tensor) -> int:
        """A new slot holding x's statistics and hash (no host sync)."""
        slot = self._n
        if slot == len(self._hashes):
            self._grow()
        self._n = slot + 1        # taken before the kernel runs (it releases the GIL)
        h = host_stats_hash_into(x, self._rows[slot])
        if h is None:
            self._on_device[slot] = stats_and_hash(x)
        else:
            self._hashes[slot] = h
        return slot

    def _grow(self) -> None:
        n = len(self._hashes)
        rows, hashes = np.empty((2 * n, 8), dtype=np.float64), np.empty(2 * n, dtype=np.int64)
        rows[:n], hashes[:n] = self._rows, self._hashes
        self._rows, self._hashes = rows, hashes

    def fetch(self) -> tuple[np.ndarray, np.ndarray]:
        """Every slot's (row, hash) on the host, indexed by slot (views, valid until the next `add`): the
        ones on a device fetched in one transfer per device."""
        by_device: dict[torch.device, list[int]] = {}
        for slot, (row, _) in self._on_device.items():
            by_device.setdefault(row.device, []).append(slot)
        for slots in by_device.values():
            self._rows[slots] = torch.stack([self._on_device[s][0] for s in slots]).cpu().numpy()
            self._hashes[slots] = torch.stack([self._on_device[s][1] for s in slots]).cpu().numpy()
        self._on_device.clear()
        return self._rows[:self._n], self._hashes[:self._n]

    def clear(self) -> None:
        self._n = 0
        self._on_device.clear()
