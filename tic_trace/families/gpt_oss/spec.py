"""GPT-OSS's config facts (no torch): `ModelSpec.extra` keys `sinks` (one learned logit per head in the softmax's
denominator), `swiglu_alpha` and `swiglu_limit` (its clamped SwiGLU with biases), and its sliding windows (always
read: GPT-OSS alternates sliding and full attention layers); the shapes of the checkpoint tensors it stores
otherwise than the base transformer (fused experts [E, H, 2F] with biases, a router with a bias, the sinks)."""
from __future__ import annotations

from typing import Any

from ...replay.layer_types import windows
from ..base import ATTENTION_SINKS

MODEL_TYPES = ("gpt_oss",)
#: its learned sink logits as its checkpoint names them (the base's ATTENTION_SINKS: `derived_weight`)
HF_SINKS = "self_attn.sinks"
# the checkpoint tensors only GPT-OSS names, and the point whose op reads each (graph.weight_points)
HF_WEIGHT_POINTS = ((r"self_attn\.sinks", "attn.core"), (r"mlp\.router\.", "moe.router_logits"))


def facts(c: Any, model_type: str, hidden: int) -> dict:
    """`extra` for a GPT-OSS config (`c`: model_spec's typed reader)."""
    out: dict = dict(sinks=True, swiglu_alpha=c.num("swiglu_alpha", -1e6, 1e6, default=1.702),
                     swiglu_limit=c.num("swiglu_limit", 0.0, 1e9, default=7.0, lo_open=True))
    out.update(windows(c, typed=True))
    return out


def shapes(rest: str, spec: Any) -> list | None:
    """The shape config.json gives a layer tensor (`rest`: its name under model.layers.N) that GPT-OSS stores
    otherwise than the base transformer (None: not one of them)."""
    H = spec.hidden_size
    e, f = spec.num_experts or None, spec.intermediate_size or None
    return {"mlp.experts.gate_up_proj": [e, H, 2 * f if f else None], "mlp.experts.gate_up_proj_bias":
            [e, 2 * f if f else None], "mlp.experts.down_proj": [e, f, H], "mlp.experts.down_proj_bias": [e, H],
            "mlp.router.weight": [e, H], "mlp.router.bias": [e], "self_attn.sinks": [spec.num_attention_heads]
            }.get(rest)


def derived_weight(w: Any, name: str) -> Any:
    """The sink logits (the base's name) under GPT-OSS's checkpoint name (`w`: reference._LayerWeights of one
    layer); None for any other name."""
    return w.get(HF_SINKS) if name == ATTENTION_SINKS else None


def op_of(point: str, spec: Any) -> str:
    """The ops GPT-OSS computes otherwise (its variants: variants.py); its attention with sinks is the core's
    `attention_ext`."""
    return {"moe.router_logits": "router_bias_gemm", "moe.experts_out": "clamped_swiglu_experts"}.get(point, "")
