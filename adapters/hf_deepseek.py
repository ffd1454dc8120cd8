"""The HF adapter's DeepSeek-V3 and GLM-4.5 (`Glm4Moe`) rows: sigmoid routers with a score-correction bias,
shared experts, dense first layers, and (DeepSeek-V3) multi-latent attention.

Kept apart from hf.py's table of the Llama/Qwen families: these architectures add their own points (MLA's
latent projections) and their own facts (a router whose scoring the config does not state).

What transformers 5.24's modeling files compute, and where the table reads it:
- `mlp.gate` (`DeepseekV3TopkRouter` / `Glm4MoeTopkRouter`) returns (router logits before the sigmoid, the
  top-k weights, the top-k ids), Qwen's order: the rows of hf.py map them. The ids are chosen on
  sigmoid(logits) + `e_score_correction_bias` (group-limited by `n_group`/`topk_group`), the weights are the
  sigmoid scores of those ids without the bias, renormalised (`norm_topk_prob`) and x `routed_scaling_factor`.
- `mlp.shared_experts` (plural) is the ungated shared MLP; `mlp.out` = experts + shared.
- layers below `first_k_dense_replace` hold a dense `mlp` (no gate, no experts): the `moe.*` points are
  absent there, and the point is still promised for the model (the MoE layers record it).
- GLM-4.5's attention is standard (q/k/v, partial RoPE through `apply_rotary_pos_emb`, optional QK-norm).
- DeepSeek-V3's attention is MLA: `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (every head's q, nope then rope
  dims), `kv_a_proj_with_mqa` (the kv latent, then the one k_pe shared by all heads) -> `kv_a_layernorm` (on
  the latent only) -> `kv_b_proj` (every head's k_nope then v); RoPE on q's rope dims and k_pe, through
  `apply_rotary_pos_emb_interleave` (config `rope_interleave`, the default) or `apply_rotary_pos_emb`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tic_trace.adapters.router_facts import router_facts
from tic_trace.graph.adapter import Architecture, PointMap, TransformContext, register_transform

_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
_T = "`tests/test_archs_mla.py`, `tests/test_supported_archs.py`"
_SIGMOID = {"router_scoring": "sigmoid"}       # in the router's code, not in the config
_STANDARD_ATTN = ("attn.k", "attn.v", "attn.q_norm", "attn.k_norm")   # MLA has no k/v projection of its own


@register_transform("latent_heads")
def _latent_heads(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """[..rows.., heads * d] -> [rows, heads, d]: MLA's per-head widths (nope + rope for q, nope + v for kv_b)
    are not the config's `head_dim` (the rope dims)."""
    return a.reshape(ctx.n_rows, int(ctx.config["num_attention_heads"]), -1)


# MLA's rows: the latent projections and norms, and q from q_b_proj (or q_proj, without a q latent) per head.
# The RoPE rows of hf.py read `apply_rotary_pos_emb(_interleave)`: q's rope dims and the one shared k_pe.
LATENT_POINTS = (
    PointMap("attn.q_a", _A + r"\.q_a_proj:out"),
    PointMap("attn.q_a_norm", _A + r"\.q_a_layernorm:out"),
    PointMap("attn.q", _A + r"\.q_(b_)?proj:out", "latent_heads", note="MLA: q_b_proj (q_proj without a q latent)"),
    PointMap("attn.kv_a", _A + r"\.kv_a_proj_with_mqa:out", note="the kv latent, then k_pe"),
    PointMap("attn.kv_a_norm", _A + r"\.kv_a_layernorm:out"),
    PointMap("attn.kv_b", _A + r"\.kv_b_proj:out", "latent_heads", note="every head's k_nope, then its v"),
)


def latent_applies(pm: PointMap, config: dict) -> bool | None:
    """Whether a row applies, where MLA decides it (None: MLA does not): the MLA rows only to an MLA model
    (the config states `kv_lora_rank`; the q latent's rows where it states `q_lora_rank`), hf.py's standard q row
    never to one."""
    mla = bool(config.get("kv_lora_rank"))
    if pm in LATENT_POINTS:     # without a q latent (q_lora_rank null) q is one projection, q_proj
        return mla and (bool(config.get("q_lora_rank")) or pm.point not in ("attn.q_a", "attn.q_a_norm"))
    if mla and pm.point == "attn.q":
        return False
    return None


_LATENT_FACTS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")


def latent_facts(text: Any) -> dict:
    """MLA's config facts for the manifest (none for a model without a kv latent)."""
    if not getattr(text, "kv_lora_rank", None):
        return {}
    return {k: getattr(text, k, None) for k in _LATENT_FACTS}


def selection_facts(model: Any, text: Any) -> dict:
    """The routers' score-correction bias per MoE layer (`mlp.gate.e_score_correction_bias`) and the group
    limit (`n_group`/`topk_group`; a group scored by its best two choice scores), for the flip margins."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []    # the table's model.layers.N
    biases = [(i, getattr(getattr(lay.mlp, "gate", None), "e_score_correction_bias", None))
              for i, lay in enumerate(layers) if hasattr(lay, "mlp")]
    n_group = getattr(text, "n_group", None)
    return router_facts(biases, n_group=n_group, topk_group=getattr(text, "topk_group", None),
                        group_top=2 if isinstance(n_group, int) and n_group > 1 else None)


SIGMOID_ROUTED = (
    Architecture("Glm4MoeForCausalLM", ("GLM-4.5 (MoE)",),
                 "MoE: sigmoid router with a score-correction bias (selection only), group-limited top-k, "
                 "routed scaling, ungated `shared_experts`, dense first layers; partial RoPE, q/k/v bias, "
                 "optional QK-norm", "every point", _T, defaults=_SIGMOID),
    Architecture("DeepseekV3ForCausalLM", ("DeepSeek-V3 (MLA, MoE)",),
                 "multi-latent attention (q and kv latents, their norms, the decompressed k_nope/v, RoPE on q's "
                 "rope dims and the shared k_pe, interleaved or not); MoE as GLM-4.5's",
                 "every point", _T, lacks=_STANDARD_ATTN, defaults=_SIGMOID),
)
