"""The read side of the parameter hashes a trace records (`weights.ParameterHasher` writes them): which
canonical point each recorded parameter belongs to, and which dtype a side held each checkpoint tensor in (the
exact reference rounds the checkpoint's weights to it). numpy only, like every reader: the finder's contract
check calls it without loading torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..graph.weight_points import hf_point_of


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
                if not (isinstance(name, str) and _entry_ok(val)):    # a trace is untrusted: skip, never crash
                    continue
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


def recorded_weights(view: Any) -> dict[str, list]:
    """{parameter name: [hash, dtype, shape]} of the first pass of rank 0 that recorded weights (the full map),
    {} when the trace recorded none. Malformed entries (a trace is untrusted input) are left out."""
    for rank in view.trace.ranks[:1]:
        for pidx in view.trace.pass_indices(rank):
            weights = view._pass(rank, pidx).meta.get("weights")
            if isinstance(weights, dict):
                return {k: v for k, v in weights.items() if isinstance(k, str) and _entry_ok(v)}
    return {}


def _entry_ok(v: Any) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) >= 3 and isinstance(v[0], int) and isinstance(v[1], str)
            and isinstance(v[2], (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                         for d in v[2]))


FLOATS = ("bfloat16", "float16", "float32", "float64")


@dataclass(frozen=True)
class SideWeightDtypes:
    """The dtype one side held each checkpoint tensor in, and how that is known (the exact replay rounds each
    tensor to it: the weights that side ran). In order: the side's hash of a parameter of the same name and
    shape; the one dtype of the parameters it recorded at the point that reads the tensor (another naming, as
    Megatron's); the side's model dtype (its manifest); else none (the tensor is used as stored)."""
    by_name: dict = field(default_factory=dict)      # checkpoint tensor -> dtype, from the side's hashes
    by_point: dict = field(default_factory=dict)     # (point, layer) -> the dtype of the side's parameters there
    model: str | None = None                         # the side's model dtype

    def source(self, name: str) -> tuple[str | None, str]:
        """(dtype, how it is known) for checkpoint tensor `name`."""
        if name in self.by_name:
            return self.by_name[name], "its parameter hashes"
        key = hf_point_of(name)
        if key is not None and key in self.by_point:
            return self.by_point[key], "the parameters it recorded at that point"
        if self.model is not None:
            return self.model, "its model dtype"
        return None, "not known"

    def of(self, name: str) -> str | None:
        return self.source(name)[0]


def side_weight_dtypes(view: Any, ckpt: Any) -> SideWeightDtypes:
    """The dtypes one side (a CanonicalView) held the checkpoint's tensors in, from what its trace recorded."""
    recorded = recorded_weights(view)
    by_name = {}
    for n, v in recorded.items():
        # a parameter of the checkpoint's shape: the dtype of every checkpoint tensor it holds (fused experts)
        if v[1] in FLOATS and hasattr(ckpt, "parts") and list(v[2]) == list(ckpt.shape(n) or ()):
            by_name.update(dict.fromkeys(ckpt.parts(n), v[1]))
    by_point = {}
    for key, params in weight_hashes_by_point(view).items():
        kinds = {v[1] for v in params.values() if isinstance(v, (list, tuple)) and len(v) > 1}
        if len(kinds) == 1 and next(iter(kinds)) in FLOATS:
            by_point[key] = next(iter(kinds))
    model = (view.config or {}).get("dtype") if isinstance(view.config, dict) else None
    return SideWeightDtypes(by_name, by_point, model if model in FLOATS else None)
