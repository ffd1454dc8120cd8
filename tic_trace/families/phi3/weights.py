"""Phi-3's q/k/v and gate/up weights read as rows of the fused tensors its checkpoint stores, so every base op
(replay/reference.py) reads them under the base transformer's names unchanged."""
from __future__ import annotations

import re
from typing import Any

_QKV = re.compile(r"self_attn\.([qkv])_proj\.weight")
_GATE_UP = re.compile(r"mlp\.(gate|up)_proj\.weight")


def derived_weight(w: Any, name: str) -> Any:
    """q/k/v rows of `qkv_proj` ([q | k | v]) and gate/up halves of `gate_up_proj` ([gate | up]) for the base's
    names (`w`: reference._LayerWeights of one layer); None for any other name."""
    spec = w.ref.spec
    m = _QKV.fullmatch(name)
    if m is not None:
        qkv = w.get("self_attn.qkv_proj.weight", optional=True)
        if qkv is None:
            return None
        nq, nkv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        lo, n = {"q": (0, nq), "k": (nq, nkv), "v": (nq + nkv, nkv)}[m.group(1)]
        return qkv[lo:lo + n]
    m = _GATE_UP.fullmatch(name)
    if m is not None:
        gu = w.get("mlp.gate_up_proj.weight", optional=True)
        if gu is None:
            return None
        half = gu.shape[0] // 2
        return gu[:half] if m.group(1) == "gate" else gu[half:]
    return None
