"""The config facts of the architectures whose ops differ from the Llama/Qwen family's (Gemma2/3, Phi-3,
GPT-OSS), read from config.json with model_spec's typed reads into `ModelSpec.extra`, and the RoPE of one
layer (Gemma3 gives sliding and full attention layers a RoPE each).

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
- Qwen3-Next's (gated attention, linear-attention layers and sizes, dense layers): qwen3next_spec.py.
"""
from __future__ import annotations

from typing import Any

from .qwen3next_spec import MODEL_TYPE as QWEN3NEXT, qwen3next_facts, qwen3next_shapes

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
    if model_type == QWEN3NEXT:      # its layer_types name linear-attention layers: qwen3next_spec reads them
        out.update(qwen3next_facts(c))
    else:
        out.update(_windows(c, model_type))
    if ropes:
        out["layer_ropes"] = ropes
    return out


def _windows(c: Any, model_type: str) -> dict:
    """Which layers attend to the last `sliding_window` keys only, as transformers reads the config: the
    layers `layer_types` calls sliding (Gemma, GPT-OSS, Qwen2/3 from `use_sliding_window` and
    `max_window_layers`), or every layer where the config gives a window and no types (Mistral, Mixtral,
    Qwen3-MoE). A window of 0 or null is none (Qwen2-MoE writes 0 when `use_sliding_window` is off)."""
    window = c.int("sliding_window", 0, 1 << 31, default=None) or None
    if model_type in GEMMA + ("gpt_oss",) or (c.has("layer_types") and c.raw("layer_types") != []):
        return {"layer_types": _layer_types(c), "sliding_window": window}
    if window is None:
        return {}
    return {"layer_types": ["sliding_attention"] * c.int("num_hidden_layers", 1, 1 << 16), "sliding_window": window}


def _layer_types(c: Any) -> list[str]:
    v = c.raw("layer_types")
    n = c.int("num_hidden_layers", 1, 1 << 16)
    if v is None or (isinstance(v, list) and not v):
        return ["full_attention"] * n
    if not isinstance(v, list) or len(v) != n or not all(x in ("full_attention", "sliding_attention") for x in v):
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


def arch_shapes(rest: str, spec: Any) -> list | None:
    """The shape config.json gives a layer tensor (`rest`: its name under model.layers.N) that these
    architectures store otherwise than the Llama/Qwen family (None: not one of them)."""
    H, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    if spec.model_type == "phi3":
        f = spec.intermediate_size or None
        return {"self_attn.qkv_proj.weight": [q + 2 * kv, H], "mlp.gate_up_proj.weight": [2 * f if f else None, H]
                }.get(rest)
    if spec.model_type == QWEN3NEXT:
        return qwen3next_shapes(rest, spec)
    if spec.model_type == "gpt_oss":
        e, f = spec.num_experts or None, spec.intermediate_size or None
        return {"mlp.experts.gate_up_proj": [e, H, 2 * f if f else None], "mlp.experts.gate_up_proj_bias":
                [e, 2 * f if f else None], "mlp.experts.down_proj": [e, f, H], "mlp.experts.down_proj_bias": [e, H],
                "mlp.router.weight": [e, H], "mlp.router.bias": [e], "self_attn.sinks": [spec.num_attention_heads]
                }.get(rest)
    return None
