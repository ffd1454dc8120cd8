"""Gemma 2 / Gemma 3's config facts (no torch), read from config.json with model_spec's typed reader into
`ModelSpec.extra` (absent keys: the base transformer's convention):

- `norm_offset`: every RMSNorm scales by (1 + weight);
- `embed_scale`: the embedding multiplied by sqrt(hidden_size);
- `sandwich`: norms of the attention and MLP branches before their residual adds;
- `attn_scale`: the attention scores' scale, query_pre_attn_scalar ** -0.5;
- `attn_softcap`, `final_softcap`: cap * tanh(x / cap) of the scores, of the logits (Gemma 2);
- `layer_types`, `sliding_window`: always read (`replay.layer_types.windows`): Gemma alternates sliding and full
  attention layers; Gemma 3's RoPE per layer type is the core's (`layer_ropes`).

Its activation (`ModelSpec.hidden_act`) is stated as `hidden_activation` (`config_defaults`).
"""
from __future__ import annotations

from typing import Any

from ...replay.layer_types import windows

MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")
# the checkpoint tensors only Gemma names, and the point whose op reads each (graph.weight_points): its
# post_attention_layernorm is its attn.post_norm, read as the base's mlp_norm (a dtype fallback)
HF_WEIGHT_POINTS = ((r"pre_feedforward_layernorm\.", "mlp_norm"), (r"post_feedforward_layernorm\.", "mlp.post_norm"))


def facts(c: Any, model_type: str, hidden: int) -> dict:
    """`extra` for a Gemma config (`c`: model_spec's typed reader of the text config)."""
    out: dict = dict(norm_offset=1.0, embed_scale=float(hidden) ** 0.5, sandwich=True,
                     attn_scale=c.num("query_pre_attn_scalar", 0.0, 1e9, default=256.0, lo_open=True) ** -0.5)
    out.update(attn_softcap=c.num("attn_logit_softcapping", 0.0, 1e9, default=None, lo_open=True),
               final_softcap=c.num("final_logit_softcapping", 0.0, 1e9, default=None, lo_open=True))
    out.update(windows(c, typed=True))
    return out


def config_defaults(c: Any, model_type: str) -> dict:
    """The activation a Gemma config names `hidden_activation` (where it states no `hidden_act`: model_spec)."""
    return {"hidden_act": c.str("hidden_activation", "silu")} if c.has("hidden_activation") else {}


# point -> the (1 + w) RMSNorm's weight (relative to model.layers.N, or the model's)
NORMS = {"attn_norm": "input_layernorm.weight", "attn.post_norm": "post_attention_layernorm.weight",
         "mlp_norm": "pre_feedforward_layernorm.weight", "mlp.post_norm": "post_feedforward_layernorm.weight",
         "final_norm": "model.norm.weight", "attn.q_norm": "self_attn.q_norm.weight",
         "attn.k_norm": "self_attn.k_norm.weight"}


def inputs_of(point: str, spec: Any) -> tuple[str, ...] | None:
    """The sandwich norms' residual adds read the norms (None: the base's feeds)."""
    if spec.extra.get("sandwich") and point in ("mid", "output"):
        return ("input", "attn.post_norm") if point == "mid" else ("mid", "mlp.post_norm")
    return None


def op_of(point: str, spec: Any) -> str:
    """The op replayed at `point` where Gemma makes it another (its variants: variants.py)."""
    if spec.extra.get("norm_offset") and point in NORMS:
        return "offset_rmsnorm"
    if point == "logits" and spec.extra.get("final_softcap"):
        return "softcapped_logits"
    return ""
