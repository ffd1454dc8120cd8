"""DeepSeek-V2/V3 and the models built on their MoE (GLM-4.5): multi-latent attention (MLA: q and kv pass through
low-rank latents with their own RMSNorms; every head's k_nope and v decompressed from the kv latent; RoPE on q's
rope dims and on one k_pe shared by every head, interleaved or rotate-half) and a sigmoid router with a
selection-only score-correction bias, group-limited top-k (`n_group` / `topk_group`), routed scaling, ungated
shared experts and dense first layers (`first_k_dense_replace`). GLM-4.5 (`glm4_moe`) shares the MoE and
computes the base's attention (partial RoPE, q/k/v bias, optional QK-norm). The group-limited top-k, the routed
scale and the dense first layers are `ModelSpec` facts the core computes for any model that states them
(replay/grouped_topk.py, replay/reference.py); what is this family's is that its routers are sigmoid in code
while its configs do not say so, MLA's ops, shapes, variants and name tables.

What is verified per framework:
- HF: `DeepseekV3ForCausalLM` and `Glm4MoeForCausalLM`, every point, replayed in float64 (tests/test_archs_mla.py,
  tests/test_supported_archs.py, tests/test_router_choice.py, tests/test_dense_moe_layers.py).
- Megatron: `MLASelfAttention` with the sigmoid group-limited router, shared experts and a dense first layer
  (local spec, TP 1 and 2) against HF DeepSeek-V3, and GLM-4.5's MoE on one rank (tests/test_megatron_mla.py);
  the TE spec, SP, EP, CP, PP, fused or YaRN MLA RoPE refused.
- SGLang: `DeepseekV3ForCausalLM` (prefill, the absorbed decode path, TP 1 and 2) and `Glm4MoeForCausalLM`
  (TP 1) against HF and Megatron (tests/test_sglang_mla.py); `DeepseekV2ForCausalLM` with V2's softmax routing
  refused.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..base import Family, lazy
from . import points
from .spec import (OPTIONAL_INPUTS, derived_weight, facts, is_latent as _is_latent, latent_inputs, latent_op, shapes,
                   states_latent)

_SIGMOID = {"scoring_func": "sigmoid"}      # DeepSeek-V3 and GLM-4.5 routers are sigmoid in code, not in config


_latent_ops = lazy(__name__, ".ops", "LatentOps")


def _ops(spec: Any, base: Mapping[str, Callable]) -> dict[str, Callable]:
    """MLA's ops (its own points and its op at attn.q, the RoPE points and attn.core); none without a kv latent."""
    if not _is_latent(spec):
        return {}
    own, overrides = _latent_ops(base.f64).tables()
    return {**own, **overrides}


FAMILY = Family(
    name="deepseek",
    title="DeepSeek-V2/V3, GLM-4.5",
    model_types=("deepseek_v2", "deepseek_v3", "glm4_moe"),
    description="multi-latent attention (DeepSeek-V2/V3) and the sigmoid group-limited MoE with a score-correction "
                "bias, routed scaling, shared experts and dense first layers (DeepSeek-V3, GLM-4.5)",
    verified={"hf": "DeepSeek-V3, GLM-4.5: every point, replayed",
              "megatron": "DeepSeek-V3 (MLASelfAttention, local spec, TP 1 and 2), GLM-4.5 (one rank): every point",
              "sglang": "DeepSeek-V3 (TP 1 and 2, absorbed decode), GLM-4.5 (TP 1): every point the trace holds"},
    # a model_type no family owns whose config states a kv latent (Kimi-K2's kimi_k2) reads and replays as MLA
    claims_config=states_latent,
    claims=_is_latent,
    defaults={"deepseek_v3": _SIGMOID, "glm4_moe": _SIGMOID},
    facts=facts,
    points=points.POINTS,
    remarks=points.REMARKS,
    shapes=shapes,
    ops=_ops,
    inputs_of=latent_inputs,
    op_of=latent_op,
    derived_weight=derived_weight,
    variants=lazy(__name__, ".variants", "latent_variants"),
    optional_inputs=OPTIONAL_INPUTS,
    kv_points=("attn.kv_b", "attn.kv_a_norm"),      # MLA's attention reads every key's kv_b (or its latent)
    kv_rows=lazy(__name__, ".ops", "latent_kv_rows"),
    # the same roundings as the standard ops they stand for (RMSNorm, RoPE's bf16 tables, eager attention)
    envelopes={"latent_rmsnorm": 1.50, "latent_rope": 1.67, "latent_attention": 2.00},
    names=lazy(__name__, ".names", "names"),
)
