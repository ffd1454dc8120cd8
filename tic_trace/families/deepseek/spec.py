"""DeepSeek-V2/V3's multi-latent attention (MLA) as config facts, with no torch: the latent ranks and per-head
splits config.json states (`facts`: `ModelSpec.extra["latent"]`, a `Latent`), which recorded points each MLA
op reads, the op each point is measured as (its clean variants' key), the checkpoint shapes of MLA's tensors,
the latent norms' eps and the softmax scale. A model of this family without a kv latent (GLM-4.5) computes the
base's attention; a model whose model_type no family owns but whose config states a kv latent (Kimi-K2's
`kimi_k2`: DeepSeek-V3's architecture) is this family's (`states_latent`, `is_latent`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
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


#: The model_types whose code rotates interleaved pairs unless config.json says `rope_interleave: false`
#: (HF's DeepseekV3Attention; V2's does not, nor a model_type this family does not own).
INTERLEAVED_BY_DEFAULT = ("deepseek_v3",)


@dataclass(frozen=True)
class Latent:
    """MLA's ranks and per-head splits, as config.json states them."""
    q_lora_rank: int | None          # q down-projection width (None: one q projection)
    kv_lora_rank: int                # the kv latent's width
    qk_nope_head_dim: int            # per-head q/k dims without RoPE
    qk_rope_head_dim: int            # per-head q/k dims with RoPE (k's shared by every head)
    v_head_dim: int                  # per-head v dims
    rope_interleave: bool            # RoPE over interleaved pairs, output de-interleaved (HF)


def states_latent(c: Any) -> bool:
    """Whether config.json (`c`: model_spec's typed reader) states a kv latent: what makes a model_type no
    family owns this family's (`Family.claims_config`)."""
    return c.has("kv_lora_rank")


def facts(c: Any, model_type: str, hidden: int) -> dict:
    """`ModelSpec.extra` of this family's config: the kv latent's facts where it states one (none: {})."""
    if not states_latent(c):
        return {}
    return {"latent": Latent(q_lora_rank=c.int("q_lora_rank", 1, 1 << 20, default=None),
                             kv_lora_rank=c.int("kv_lora_rank", 1, 1 << 20),
                             qk_nope_head_dim=c.int("qk_nope_head_dim", 0, 1 << 16),
                             qk_rope_head_dim=c.int("qk_rope_head_dim", 1, 1 << 16),
                             v_head_dim=c.int("v_head_dim", 1, 1 << 16),
                             rope_interleave=c.bool("rope_interleave", model_type in INTERLEAVED_BY_DEFAULT))}


def latent(spec: Any) -> Latent | None:
    """The spec's kv latent facts (None: not an MLA model)."""
    return spec.extra.get("latent")


def is_latent(spec: Any) -> bool:
    return latent(spec) is not None


def latent_inputs(point: str, spec: Any) -> tuple[str, ...] | None:
    """The points the MLA op producing `point` reads (None: not an MLA model, or the base's feeds)."""
    m = latent(spec)
    if m is None:
        return None
    return {"attn.q": ("attn.q_a_norm",) if m.q_lora_rank else ("attn_norm",),
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
    m = latent(spec)
    if m is None:
        return None
    H, n = spec.hidden_size, spec.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    return {"self_attn.q_a_proj.weight": [m.q_lora_rank, H], "self_attn.q_a_proj.bias": [m.q_lora_rank],
            "self_attn.q_a_layernorm.weight": [m.q_lora_rank],
            "self_attn.q_b_proj.weight": [n * qk, m.q_lora_rank], "self_attn.q_proj.weight": [n * qk, H],
            "self_attn.kv_a_proj_with_mqa.weight": [m.kv_lora_rank + m.qk_rope_head_dim, H],
            "self_attn.kv_a_proj_with_mqa.bias": [m.kv_lora_rank + m.qk_rope_head_dim],
            "self_attn.kv_a_layernorm.weight": [m.kv_lora_rank],
            "self_attn.kv_b_proj.weight": [n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
            "self_attn.o_proj.weight": [H, n * m.v_head_dim], "self_attn.o_proj.bias": [H]}.get(rest)


def softmax_scale(spec: Any) -> float:
    """1/sqrt(qk head dim), x YaRN's mscale(factor, mscale_all_dim)^2 (HF's `yarn_apply_mscale`)."""
    m = latent(spec)
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    r = spec.rope
    if r.kind != "default" and r.mscale_all_dim:
        m = 1.0 if r.factor <= 1 else 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
        scale *= m * m
    return scale
