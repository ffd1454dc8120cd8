"""The plain transformer's checkpoint names that differ from the base's (reference.py reads the base's names):
Mixtral checkpoints keep the original layout, router and experts under `block_sparse_moe`, an expert's gate,
down and up projections as w1, w2, w3 (transformers 5 loads them into `mlp` and writes them back so)."""
from __future__ import annotations

import re
from typing import Any

_MIXTRAL_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_MIXTRAL_W = {"gate": "w1", "down": "w2", "up": "w3"}


def derived_weight(w: Any, name: str) -> Any:
    """Mixtral's router and experts under `block_sparse_moe` for the base's `mlp.gate` / `mlp.experts.E.*`
    names (`w`: reference._LayerWeights of one layer); None for any other name or model."""
    if w.ref.spec.model_type != "mixtral":
        return None
    if name == "mlp.gate.weight":
        return w.get("block_sparse_moe.gate.weight", optional=True)
    m = _MIXTRAL_EXPERT.fullmatch(name)
    if m is not None:
        return w.get(f"block_sparse_moe.experts.{m.group(1)}.{_MIXTRAL_W[m.group(2)]}.weight", optional=True)
    return None
