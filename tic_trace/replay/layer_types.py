"""Which kind of attention each layer runs, from config.json: the layers that attend to the last
`sliding_window` keys only, and the RoPE of one layer (Gemma3 gives sliding and full attention layers one each).
Any family may have windows (Mistral, Mixtral, the Qwen families, Gemma, GPT-OSS), so this is the core's; a
family's `facts` hook (tic_trace/families/base.py) decides whether its config's `layer_types` name these kinds.
No torch.

The keys of `ModelSpec.extra` read here: `layer_types`, `sliding_window` (`windows`), `layer_ropes`
({layer type: RopeSpec}, model_spec's `layer_rope_specs`).
"""
from __future__ import annotations

from typing import Any

ATTENTION_KINDS = ("full_attention", "sliding_attention")


def windows(c: Any, typed: bool) -> dict:
    """Which layers attend to the last `sliding_window` keys only, as transformers reads the config (`c`:
    model_spec's typed reader): the layers `layer_types` calls sliding (always read where `typed`: Gemma,
    GPT-OSS; and wherever the config gives layer_types: Qwen2/3 from `use_sliding_window` and
    `max_window_layers`), or every layer where the config gives a window and no types (Mistral, Mixtral,
    Qwen3-MoE). A window of 0 or null is none (Qwen2-MoE writes 0 when `use_sliding_window` is off)."""
    window = c.int("sliding_window", 0, 1 << 31, default=None) or None
    if typed or (c.has("layer_types") and c.raw("layer_types") != []):
        return {"layer_types": _layer_types(c), "sliding_window": window}
    if window is None:
        return {}
    return {"layer_types": ["sliding_attention"] * c.int("num_hidden_layers", 1, 1 << 16), "sliding_window": window}


def _layer_types(c: Any) -> list[str]:
    v = c.raw("layer_types")
    n = c.int("num_hidden_layers", 1, 1 << 16)
    if v is None or (isinstance(v, list) and not v):
        return ["full_attention"] * n
    if not isinstance(v, list) or len(v) != n or not all(x in ATTENTION_KINDS for x in v):
        raise c.error("layer_types", f"a list of {n} 'full_attention' / 'sliding_attention' entries", v)
    return list(v)


def layer_type(spec: Any, layer: int | None) -> str:
    types = spec.extra.get("layer_types") or []
    return types[layer] if layer is not None and 0 <= layer < len(types) else "full_attention"


def sliding_window(spec: Any, layer: int | None) -> int | None:
    """The keys a query of `layer` sees: the last `sliding_window` positions (None: every earlier one)."""
    return spec.extra.get("sliding_window") if layer_type(spec, layer) == "sliding_attention" else None


def rope_of_layer(spec: Any, layer: int | None):
    """The RopeSpec of `layer`: its layer type's where the config gives one per type, else the model's."""
    ropes = spec.extra.get("layer_ropes") or {}
    return ropes.get(layer_type(spec, layer), spec.rope) if ropes else spec.rope
