"""The read side of the parameter hashes a trace records (`weights.ParameterHasher` writes them): which
canonical point each recorded parameter belongs to. numpy only, like every reader: the finder's contract
check calls it without loading torch."""
from __future__ import annotations

from typing import Any


def weight_hashes_by_point(view: Any) -> dict[tuple[str, int | None], dict[str, list]]:
    """{(point, layer): {parameter name: [hash, dtype, shape]}} from the first pass of rank 0 that recorded
    weights (the full map; later passes hold only parameters changed since). A parameter belongs to the
    point whose record its module writes (`module:out`)."""
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
