"""DeepSeek-V2/V3's multi-latent attention (MLA) as config facts, with no torch: which recorded points each MLA
op reads, the op each point is measured as (its clean variants' key), the checkpoint shapes of MLA's tensors,
the latent norms' eps and the softmax scale. The MLA ranks and per-head splits themselves (`kv_lora_rank`,
`q_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`) are `ModelSpec` fields
(replay/model_spec.py); a model of this family without a kv latent (GLM-4.5) computes the base's attention.
"""
from __future__ import annotations

import math
from typing import Any

from ..base import ROUTER_SELECTION_BIAS

#: The router's selection-only bias as DeepSeek-V3's and GLM-4.5's checkpoints name it (the base's
#: ROUTER_SELECTION_BIAS: `derived_weight`).
HF_ROUTER_BIAS = "mlp.gate.e_score_correction_bias"
LATENT_NORM_EPS = 1e-6       # DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): the class default, not the config's

#: The op each point's replay is measured as (its clean envelope, intrinsic_verdict.ENVELOPE): not the variants
#: of the standard attention's points, which read q_proj / the full-head q and k.
LATENT_OP_KEYS = {"attn.q_a_norm": "latent_rmsnorm", "attn.kv_a_norm": "latent_rmsnorm", "attn.q": "latent_gemm",
                  "attn.q_rope": "latent_rope", "attn.k_rope": "latent_rope", "attn.core": "latent_attention"}

#: Inputs an op reads only where the trace holds them: MLA's core reads the normed kv latent for the keys whose
#: kv_b was never materialised (the absorbed path); a trace without the latent is replayed from kv_b alone.
OPTIONAL_INPUTS = {"attn.core": ("attn.kv_a_norm",)}


def is_latent(spec: Any) -> bool:
    return spec.kv_lora_rank > 0


def latent_inputs(point: str, spec: Any) -> tuple[str, ...] | None:
    """The points the MLA op producing `point` reads (None: not an MLA model, or the base's feeds)."""
    if not is_latent(spec):
        return None
    return {"attn.q": ("attn.q_a_norm",) if spec.q_lora_rank else ("attn_norm",),
            "attn.q_rope": ("attn.q",), "attn.k_rope": ("attn.kv_a",),
            "attn.core": ("attn.q", "attn.q_rope", "attn.k_rope", "attn.kv_b", "attn.kv_a_norm")}.get(point)


def latent_op(point: str, spec: Any) -> str:
    """The op replayed at `point` in an MLA model ("": the base's)."""
    return LATENT_OP_KEYS.get(point, "") if is_latent(spec) else ""


def shapes(rest: str, spec: Any) -> list[int | None] | None:
    """The shape config.json gives this family's layer tensor `rest`: the router's bias, MLA's attention."""
    if rest == HF_ROUTER_BIAS:
        return [spec.num_experts or None]
    return latent_shape(rest, spec)


def derived_weight(w: Any, name: str) -> Any:
    """The router's selection bias (the base's name) under this family's checkpoint name, where it has one (`w`:
    reference._LayerWeights of one layer); None for any other name."""
    return w.get(HF_ROUTER_BIAS, optional=True) if name == ROUTER_SELECTION_BIAS else None


def latent_shape(rest: str, spec: Any) -> list[int | None] | None:
    """The shape config.json gives an MLA model's attention tensor `rest` (relative to its layer)."""
    if not is_latent(spec):
        return None
    H, n = spec.hidden_size, spec.num_attention_heads
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    return {"self_attn.q_a_proj.weight": [spec.q_lora_rank, H], "self_attn.q_a_proj.bias": [spec.q_lora_rank],
            "self_attn.q_a_layernorm.weight": [spec.q_lora_rank],
            "self_attn.q_b_proj.weight": [n * qk, spec.q_lora_rank], "self_attn.q_proj.weight": [n * qk, H],
            "self_attn.kv_a_proj_with_mqa.weight": [spec.kv_lora_rank + spec.qk_rope_head_dim, H],
            "self_attn.kv_a_proj_with_mqa.bias": [spec.kv_lora_rank + spec.qk_rope_head_dim],
            "self_attn.kv_a_layernorm.weight": [spec.kv_lora_rank],
            "self_attn.kv_b_proj.weight": [n * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank],
            "self_attn.o_proj.weight": [H, n * spec.v_head_dim], "self_attn.o_proj.bias": [H]}.get(rest)


def softmax_scale(spec: Any) -> float:
    """1/sqrt(qk head dim), x YaRN's mscale(factor, mscale_all_dim)^2 (HF's `yarn_apply_mscale`)."""
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    r = spec.rope
    if r.kind != "default" and r.mscale_all_dim:
        m = 1.0 if r.factor <= 1 else 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
        scale *= m * m
    return scale
