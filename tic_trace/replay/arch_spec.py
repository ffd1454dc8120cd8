"""The config facts of the architectures whose ops differ from the Llama/Qwen family's (Gemma2/3, Phi-3,
GPT-OSS), read from config.json with model_spec's typed reads into `ModelSpec.extra` (the layers' attention
kinds and RoPEs: layer_types.py).

The keys of `extra` (absent: the Llama/Qwen convention):
- `norm_offset`: RMSNorm scales by (offset + weight) — Gemma's (1 + w);
- `embed_scale`: the embedding multiplied by sqrt(hidden_size) (Gemma);
- `sandwich`: norms of the attention and MLP branches before their residual adds (Gemma);
- `attn_scale`: the attention scores' scale (Gemma: query_pre_attn_scalar ** -0.5);
- `attn_softcap`, `final_softcap`: cap * tanh(x / cap) of the scores, of the logits (Gemma2);
- `layer_types`, `sliding_window`: which layers attend to the last `sliding_window` keys only (any
  architecture whose config gives a window: Mistral, Mixtral and the Qwen families too);
- `layer_ropes`: {layer type: RopeSpec} (Gemma3);
- `sinks`: one learned logit per head in the softmax's denominator (GPT-OSS);
- `swiglu_alpha`, `swiglu_limit`: GPT-OSS's clamped SwiGLU with biases;
"""
from __future__ import annotations

from typing import Any

from .layer_types import sliding_window, windows  # noqa: F401 - sliding_window: arch_variants' until it moves (issue 36)

GEMMA = ("gemma2", "gemma3_text", "gemma3")


def arch_facts(c: Any, model_type: str, hidden: int, ropes: dict) -> dict:
    """`extra` for a config (`c`: model_spec._Config of the text config; `ropes`: its RoPE per layer type)."""
    out: dict = {}
    if model_type in GEMMA:
        out.update(norm_offset=1.0, embed_scale=float(hidden) ** 0.5, sandwich=True,
                   attn_scale=c.num("query_pre_attn_scalar", 0.0, 1e9, default=256.0, lo_open=True) ** -0.5)
        out.update(attn_softcap=c.num("attn_logit_softcapping", 0.0, 1e9, default=None, lo_open=True),
                   final_softcap=c.num("final_logit_softcapping", 0.0, 1e9, default=None, lo_open=True))
    if model_type == "gpt_oss":
        out.update(sinks=True, swiglu_alpha=c.num("swiglu_alpha", -1e6, 1e6, default=1.702),
                   swiglu_limit=c.num("swiglu_limit", 0.0, 1e9, default=7.0, lo_open=True))
    out.update(windows(c, typed=model_type in GEMMA + ("gpt_oss",)))
    if ropes:
        out["layer_ropes"] = ropes
    return out


def arch_shapes(rest: str, spec: Any) -> list | None:
    """The shape config.json gives a layer tensor (`rest`: its name under model.layers.N) that these
    architectures store otherwise than the Llama/Qwen family (None: not one of them)."""
    H, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    if spec.model_type == "phi3":
        f = spec.intermediate_size or None
        return {"self_attn.qkv_proj.weight": [q + 2 * kv, H], "mlp.gate_up_proj.weight": [2 * f if f else None, H]
                }.get(rest)
    if spec.model_type == "gpt_oss":
        e, f = spec.num_experts or None, spec.intermediate_size or None
        return {"mlp.experts.gate_up_proj": [e, H, 2 * f if f else None], "mlp.experts.gate_up_proj_bias":
                [e, 2 * f if f else None], "mlp.experts.down_proj": [e, f, H], "mlp.experts.down_proj_bias": [e, H],
                "mlp.router.weight": [e, H], "mlp.router.bias": [e], "self_attn.sinks": [spec.num_attention_heads]
                }.get(rest)
    return None
