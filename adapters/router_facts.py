"""The facts a DeepSeek-style router chooses by, for the model description (`describe()`): its selection-only
bias per MoE layer and its group limit. The finder takes a flip's margin on the scores the router's top-k
compares (tic_trace/compare/choice.py); without these the margin of a sigmoid router is read on the wrong scores.

The bias is a trained value that moves every step (aux-loss-free balancing): it is read as it is when the
trace begins, all layers in one host copy.
"""
from __future__ import annotations

from typing import Any, Iterable

from tic_trace.families import framework_names


def router_facts(biases: Iterable[tuple[int, Any]], *, n_group: int | None, topk_group: int | None,
                 group_top: int | None) -> dict:
    """`biases`: (layer, the router's selection bias tensor or None) per MoE layer of this stage. Trace time
    only: torch is imported here, never when an adapter module is loaded to read a trace."""
    import torch
    # a meta tensor (a module tree built without weights) holds no values to state
    got = [(layer, b) for layer, b in biases
           if isinstance(b, torch.Tensor) and b.dim() == 1 and b.numel() and not b.is_meta]
    out: dict = {}
    if got and len({b.numel() for _, b in got}) == 1:
        values = torch.stack([b.detach().to(torch.float64) for _, b in got]).cpu().tolist()
        out["router_selection_bias"] = {str(layer): row for (layer, _), row in zip(got, values)}
    for key, v in (("router_n_group", n_group), ("router_topk_group", topk_group), ("router_group_top", group_top)):
        if isinstance(v, int) and v >= 1:
            out[key] = v
    return out


def _attr(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def selection_facts(model: Any, text: Any, framework: str) -> dict:
    """The routers' selection bias per MoE layer (where a family's `router_bias` table names it in `framework`'s
    module tree, "hf" or "sglang") and the group limit (`n_group`/`topk_group`; a group scored by its best two
    choice scores), for the flip margins."""
    paths = [n.tables["router_bias"] for n in framework_names(framework) if "router_bias" in n.tables]
    layers = getattr(getattr(model, "model", None), "layers", None) or []    # the table's model.layers.N
    biases = [(i, next((b for b in (_attr(lay, p) for p in paths) if b is not None), None))
              for i, lay in enumerate(layers) if hasattr(lay, "mlp")]
    n_group = getattr(text, "n_group", None)
    return router_facts(biases, n_group=n_group, topk_group=getattr(text, "topk_group", None),
                        group_top=2 if isinstance(n_group, int) and n_group > 1 else None)
