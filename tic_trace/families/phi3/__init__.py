"""Phi-3: a Llama-style dense decoder whose checkpoint fuses q/k/v into `qkv_proj` ([q | k | v] rows) and
gate/up into `gate_up_proj` ([gate | up] rows); its RoPE may be partial, or `longrope` (not replayed: the RoPE
points are then judged by the A-B rule alone).

What is verified per framework:
- HF (`Phi3ForCausalLM`): every point (q, k, v split from the fused `qkv_proj` output), and its exact replay
  (q/k/v and gate/up read as rows of the fused weights; tests/test_supported_archs.py,
  tests/test_archs_gemma_phi3_gptoss.py).
- Megatron (the GPTModel dense structure; the fused weights split by the weight conversion): every point
  (tests/test_megatron_families.py).
- SGLang (`Phi3ForCausalLM`, SGLang's Llama model code): every point the trace holds, prefill and decode rows at
  TP=1 and 2 (tests/test_sglang_tp2_archs.py, tests/test_sglang_megatron_archs.py).
"""
from __future__ import annotations

from ..base import Family, lazy
from . import spec


FAMILY = Family(
    name="phi3",
    title="Phi-3",
    model_types=spec.MODEL_TYPES,
    description="a Llama-style dense decoder with fused qkv_proj and gate_up_proj weights",
    verified={"hf": "Phi-3: every point, replayed",
              "megatron": "Phi-3 on the GPTModel dense structure: every point",
              "sglang": "Phi-3 (Llama model code): every point the trace holds (TP=1 and 2)"},
    weight_points=spec.HF_WEIGHT_POINTS,
    facts=spec.facts,
    shapes=spec.shapes,
    derived_weight=lazy(__name__, ".weights", "derived_weight"),
    names=lazy(__name__, ".names", "names"),
)
