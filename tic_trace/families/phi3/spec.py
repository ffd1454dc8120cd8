"""Phi-3's config facts and shapes (no torch): its config facts are the base transformer's (a `sliding_window`
without `layer_types` windows every layer, as for Mistral); its checkpoint fuses q/k/v into `qkv_proj`
([q | k | v] rows) and gate/up into `gate_up_proj` ([gate | up] rows)."""
from __future__ import annotations

from typing import Any

from ...replay.layer_types import windows

MODEL_TYPES = ("phi3",)
# the fused q/k/v tensor, and the point whose op reads it first (graph.weight_points)
HF_WEIGHT_POINTS = ((r"self_attn\.qkv_proj\.", "attn.q"),)


def facts(c: Any, model_type: str, hidden: int) -> dict:
    """`extra` of a Phi-3 config: which layers attend within a window (none: {})."""
    return windows(c, typed=False)


def shapes(rest: str, spec: Any) -> list | None:
    """The shape config.json gives the fused tensors (`rest`: a name under model.layers.N; None: another)."""
    H = spec.hidden_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    f = spec.intermediate_size or None
    return {"self_attn.qkv_proj.weight": [q + 2 * kv, H], "mlp.gate_up_proj.weight": [2 * f if f else None, H]
            }.get(rest)
