"""One layer's checkpoint tensors, shared by the sides being replayed.

The finder replays each point on side A, then on side B (`diverge.add_replay_facts`): both read the same
layer's weights, and where both sides held a tensor in the same dtype (the common case) they read the same
values. Each side's `ExactReference` (`for_view`) therefore reads through one store: a tensor is read from
the checkpoint, rounded, widened and checked for NaN/Inf once per layer, not once per side; a tied embedding
table is read once for both sides' `embed` and once for both sides' `logits`. The store holds one layer (or
the model-level tensors) at a time, so memory stays one layer's weights, as before. The clean variants' fp32
and bf16 copies of a weight (variants._gemm) are kept with it for the same reason.
"""
from __future__ import annotations

import math

import torch


class WeightStore:
    def __init__(self) -> None:
        self.layer: object = object()
        self._tensors: dict[tuple[str, str | None], tuple[torch.Tensor, int]] = {}
        self._casts: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def enter(self, layer: int | None) -> None:
        """Keep only `layer`'s tensors (None: the model-level ones: embedding, final norm, lm_head)."""
        if layer != self.layer:
            self.layer = layer
            self._tensors.clear()
            self._casts.clear()

    def get(self, key: tuple[str, str | None]) -> tuple[torch.Tensor, int] | None:
        """(float64 tensor, count of non-finite values) of a tensor read at this layer, or None."""
        return self._tensors.get(key)

    def put(self, key: tuple[str, str | None], t: torch.Tensor) -> tuple[torch.Tensor, int]:
        # A float64 sum of 16/32-bit values cannot overflow: it is finite exactly when every value is (one
        # pass, no mask); the non-finite values are counted only where there are some.
        bad = 0 if math.isfinite(float(t.sum())) else int((~torch.isfinite(t)).sum())
        got = self._tensors[key] = (t, bad)
        return got

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`t.to(dtype)`, computed once per tensor of this layer (the original kept alive with it, so its id
        stays its own while the copy is used)."""
        key = (id(t), dtype)
        hit = self._casts.get(key)
        if hit is None or hit[0] is not t:
            hit = self._casts[key] = (t, t.to(dtype))
        return hit[1]
