"""A trace's model description (`manifest["model"]`, the adapters' `describe()`) as people read it: in reports and
`tic-trace inspect`, long per-layer vectors are summarised rather than printed whole."""
from __future__ import annotations


def shown_model_facts(model: dict) -> dict:
    """A model description for people (reports, `inspect`): the per-layer selection biases, E numbers per MoE
    layer, summarised as their count, width and largest magnitude."""
    biases = model.get("router_selection_bias")
    if not isinstance(biases, dict) or not biases:
        return model
    rows = [v for v in biases.values() if isinstance(v, list)]
    peak = max((abs(float(x)) for r in rows for x in r if isinstance(x, (int, float))), default=0.0)
    width = len(rows[0]) if rows else 0
    return {**model, "router_selection_bias": f"{len(rows)} layers x {width} experts, max |bias| {peak:.4g}"}
