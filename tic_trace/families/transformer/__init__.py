"""The plain transformer: pre-norm decoders with RMSNorm, RoPE, grouped-query attention and a gated MLP or a
softmax-routed MoE block — Llama, Mistral, Qwen2/3 (dense), Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE. It is the base
every other family states its differences from: the core's exact ops (replay/reference.py) compute it, and a
model_type no family owns is replayed as it.

What is verified per framework (README, "Supported architectures"; tests/test_supported_archs.py,
tests/test_megatron_families.py, tests/test_sglang_archs.py, tests/test_sglang_moe_families.py...):
- HF: every point of Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE, and their exact replay.
- Megatron: the GPTModel structures of Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE and Mixtral (not OLMoE: no
  whole-projection QK-norm in megatron-core).
- SGLang: the model classes of all seven, against HF and (but OLMoE) Megatron.
Mistral's config (sliding windows) is replayed; its HF class is not in the adapters' tables (refused unless
--allow-unverified).

Folder: spec.py (config facts: its windows), ops.py (Mixtral's checkpoint names), names.py (HF and SGLang
rows: the base rows every family's rows override, and its architectures').
"""
from __future__ import annotations

from ..base import Family, lazy
from .spec import facts


FAMILY = Family(
    name="transformer",
    title="Plain dense / MoE transformer",
    model_types=("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe"),
    description="pre-norm decoders (RMSNorm, RoPE, GQA, gated MLP or softmax-routed MoE): Llama, Mistral, "
                "Qwen2/3, Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE; the base the other families differ from",
    verified={"hf": "Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: every point, replayed",
              "megatron": "Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral: every point (GPTModel structures)",
              "sglang": "Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: every point the trace holds"},
    # Qwen2's attention has a q/k/v bias in code; its configs do not say so
    defaults={"qwen2": {"attention_bias": True}},
    # Mixtral's router renormalises the top-k weights always; its configs have no norm_topk_prob
    fixed={"mixtral": {"norm_topk_prob": True}},
    facts=facts,
    derived_weight=lazy(__name__, ".ops", "derived_weight"),
    names=lazy(__name__, ".names", "names"),
)
