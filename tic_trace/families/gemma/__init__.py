"""Gemma 2 and Gemma 3 (text): pre-norm decoders with (1 + w) RMSNorms, the embedding scaled by sqrt(hidden),
sandwich norms (the attention and MLP branches normalised before their residual adds, the pre-MLP norm
`pre_feedforward_layernorm`), attention scaled by query_pre_attn_scalar^-1/2 over alternating sliding-window and
full layers, a GELU-tanh gated MLP; Gemma 2 soft-caps the attention scores and the final logits, Gemma 3 has a
per-head (1 + w) QK-norm and one RoPE per layer type (local / global base).

What is verified per framework:
- HF (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`): every point, and its exact replay (tests/test_supported_archs.py,
  tests/test_archs_gemma_phi3_gptoss.py; a real checkpoint, Gemma-3-270M: tests/test_real_checkpoint.py).
- SGLang (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`): every point the trace holds, prefill and decode rows at TP=1,
  against HF (tests/test_sglang_archs.py; the attention soft-cap through a CPU backend shim).
- Megatron: not verified (no Gemma structure in its table).
"""
from __future__ import annotations

from ..base import Family, lazy
from . import points, spec


FAMILY = Family(
    name="gemma",
    title="Gemma 2 / Gemma 3 (text)",
    model_types=spec.MODEL_TYPES,
    description="(1 + w) RMSNorms, sqrt(hidden) embedding scale, sandwich norms, scaled and (Gemma 2) soft-capped "
                "attention over sliding / full layers, GELU-tanh MLP, soft-capped logits (Gemma 2), QK-norm and a "
                "RoPE per layer type (Gemma 3)",
    verified={"hf": "Gemma 2, Gemma 3 (text): every point, replayed",
              "sglang": "Gemma 2, Gemma 3 (text): every point the trace holds (TP=1)"},
    points=points.POINTS,
    weight_points=spec.HF_WEIGHT_POINTS,
    facts=spec.facts,
    config_defaults=spec.config_defaults,
    ops=lazy(__name__, ".ops", "ops"),
    inputs_of=spec.inputs_of,
    op_of=spec.op_of,
    variants=lazy(__name__, ".variants", "variants", cache=True),
    op_words={"offset_rmsnorm": "RMSNorm (1 + w)", "softcapped_logits": "lm_head + soft-cap"},
    # SGLang's LogitsProcessor soft-caps a 16-bit lm_head's logits in fp32 (its fused cast + soft-cap kernel on
    # GPU, tanh in fp32 on CPU): fp32 values off the 16-bit grid with the GEMM's precision
    judged_in_compute=frozenset({"softcapped_logits"}),
    names=lazy(__name__, ".names", "names"),
)
