"""Bit-exact hashes of the parameters behind each traced module, so a report can say "side B's weights at
L3.attn.q differ from side A's / from the checkpoint" (the weight-sync bug: the weights pushed to the engine
after a training step are not the trainer's).

`ParameterHasher` hashes every parameter once (stats.device_hash, all hashes fetched in one host sync) and
again only when the parameter's storage or in-place version counter changed, so hashing per pass costs
almost nothing after the first. Read side: `weight_hashes_by_point` groups a trace's recorded hashes by the
canonical point whose module owns them, through the adapter's table.
"""
from __future__ import annotations

from typing import Any

import torch

from .stats import device_hash


class ParameterHasher:
    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int, str, int]] = {}   # name -> (data_ptr, version, dtype, hash)

    def __call__(self, models: list) -> dict[str, list]:
        """{parameter name: [hash, dtype, shape]} for every parameter of `models` (first model's names
        unprefixed; further models' prefixed with their index, as `1:name`)."""
        todo: list[tuple[str, torch.Tensor]] = []
        for i, model in enumerate(models):
            for name, p in model.named_parameters():
                key = name if i == 0 else f"{i}:{name}"
                mark = (p.data_ptr(), p._version, str(p.dtype))
                old = self._seen.get(key)
                if old is None or old[:3] != mark:
                    todo.append((key, p))
        if todo:
            with torch.no_grad():
                hs = torch.stack([device_hash(p.detach()).to("cpu", non_blocking=False) for _, p in todo]).tolist()
            for (key, p), h in zip(todo, hs):
                self._seen[key] = (p.data_ptr(), p._version, str(p.dtype), int(h))
        shapes = {}
        for i, model in enumerate(models):
            for name, p in model.named_parameters():
                shapes[name if i == 0 else f"{i}:{name}"] = list(p.shape)
        return {k: [v[3], v[2].removeprefix("torch."), shapes.get(k, [])] for k, v in self._seen.items()
                if k in shapes}


def weight_hashes_by_point(view: Any) -> dict[tuple[str, int | None], dict[str, list]]:
    """{(point, layer): {parameter name: [hash, dtype, shape]}} from the first pass of each rank group
    that recorded weights. A parameter belongs to the point whose record its module writes (`module:out`)."""
    adapter, config = view.adapter, view.config
    compiled = [(pm, pm.regex()) for pm in adapter.points if adapter.applies(pm, config)]
    info = view.trace.rank_info(view.trace.ranks[0]) if view.trace.ranks else {}
    out: dict[tuple[str, int | None], dict[str, list]] = {}
    for rank in view.trace.ranks[:1]:
        for pidx in view.trace.pass_indices(rank):
            weights = view._pass(rank, pidx).meta.get("weights")
            if not isinstance(weights, dict):
                continue
            for name, val in weights.items():
                key = _point_of(name.rsplit(".", 1)[0], compiled, adapter, info, config)
                if key is not None:
                    out.setdefault(key, {})[name] = val
            return out
    return out


def _point_of(module: str, compiled, adapter, info: dict, config: dict) -> tuple[str, int | None] | None:
    for suffix in (":out", ":out[0]"):
        for pm, rx in compiled:
            m = rx.match(module + suffix)
            if m is None:
                continue
            layer = None
            if "layer" in rx.groupindex and m.group("layer") is not None:
                layer = adapter.global_layer(int(m.group("layer")), info, config)
            return pm.point, layer
    return None
