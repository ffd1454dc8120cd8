"""Bit-exact hashes of the parameters behind each traced module, so a report can say "side B's weights at
L3.attn.q differ from side A's / from the checkpoint" (the weight-sync bug: the weights pushed to the engine
after a training step are not the trainer's).

`ParameterHasher` hashes every parameter once (stats.device_hash, all hashes fetched in one host sync) and
again only when the parameter's storage or in-place version counter changed, so hashing per pass costs
almost nothing after the first. Read side (numpy only): `weight_map.weight_hashes_by_point` groups a trace's
recorded hashes by the canonical point whose module owns them, through the adapter's table.
"""
from __future__ import annotations

import torch

from .stats import device_hash


class ParameterHasher:
    """Called once per pass. The first call returns every parameter's hash; later calls only those whose
    storage, dtype or in-place version changed since (None when nothing did), so a long decode loop does
    not repeat the whole map in every pass's index."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int, str, int]] = {}   # name -> (data_ptr, version, dtype, hash)
        self._emitted = False

    def __call__(self, models: list) -> dict[str, list] | None:
        """{parameter name: [hash, dtype, shape]} (first model's names unprefixed; further models' as
        `i:name`)."""
        params: dict[str, torch.Tensor] = {}
        for i, model in enumerate(models):
            for name, p in model.named_parameters():
                params[name if i == 0 else f"{i}:{name}"] = p
        todo = [(k, p) for k, p in params.items()
                if self._seen.get(k, (None,))[:3] != (p.data_ptr(), p._version, str(p.dtype))]
        if todo:
            with torch.no_grad():
                hs = torch.stack([device_hash(p.detach()).cpu() for _, p in todo]).tolist()
            for (k, p), h in zip(todo, hs):
                self._seen[k] = (p.data_ptr(), p._version, str(p.dtype), int(h))
        keys = params if not self._emitted else [k for k, _ in todo]
        self._emitted = True
        if not keys:
            return None
        return {k: [self._seen[k][3], self._seen[k][2].removeprefix("torch."), list(params[k].shape)] for k in keys}


# The read side lives in weight_map.py (numpy only: the finder reads weight hashes without loading torch).
from .weight_map import weight_hashes_by_point  # noqa: E402,F401
