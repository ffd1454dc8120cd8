"""GPT-OSS: a MoE decoder whose router has a bias (`mlp.router`, returning logits, top-k weights and ids; the
top-k weights a softmax over the top-k logits), whose experts have biases and a clamped SwiGLU
(`(clamp(up) + 1) * g * sigmoid(alpha * g)`, gate and up interleaved in one fused `gate_up_proj`), and whose
attention adds one learned sink logit per head to the softmax's denominator, over alternating sliding-window and
full layers, with YaRN RoPE.

What is verified per framework:
- HF (`GptOssForCausalLM`): every point, and its exact replay (tests/test_supported_archs.py,
  tests/test_archs_gemma_phi3_gptoss.py).
- Megatron (the GPTModel MoE structure with GPT-OSS's switches: learnable sinks, windows, the clamped GLU with
  its offset, biases, YaRN) on one rank, against HF (tests/test_megatron_gptoss.py).
- SGLang (`GptOssForCausalLM`): every point the trace holds, prefill and decode rows at TP=1, against HF and
  Megatron (tests/test_sglang_archs.py, tests/test_sglang_megatron_archs.py; the sinks through a CPU backend
  shim).
"""
from __future__ import annotations

from ..base import Family, lazy
from . import spec


FAMILY = Family(
    name="gpt_oss",
    title="GPT-OSS",
    model_types=spec.MODEL_TYPES,
    description="MoE with a biased router, clamped-SwiGLU experts with biases, attention with learned sinks over "
                "sliding / full layers, YaRN RoPE",
    verified={"hf": "GPT-OSS: every point, replayed",
              "megatron": "GPT-OSS's switches on the GPTModel MoE structure: every point (one rank)",
              "sglang": "GPT-OSS: every point the trace holds (TP=1)"},
    # the router's softmax over the top-k logits renormalises the top-k weights, whatever the config says
    fixed={"gpt_oss": {"norm_topk_prob": True}},
    weight_points=spec.HF_WEIGHT_POINTS,
    facts=spec.facts,
    shapes=spec.shapes,
    ops=lazy(__name__, ".ops", "ops"),
    op_of=spec.op_of,
    derived_weight=spec.derived_weight,
    variants=lazy(__name__, ".variants", "variants", cache=True),
    op_words={"router_bias_gemm": "router GEMM", "clamped_swiglu_experts": "experts"},
    names=lazy(__name__, ".names", "names"),
)
