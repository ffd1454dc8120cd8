"""HF's DeepSeek-V3 and GLM-4.5 (`Glm4Moe`) rows (transformers 5.24), strings only: sigmoid routers with a
score-correction bias, shared experts, dense first layers, and (DeepSeek-V3) multi-latent attention.

adapters/hf.py reads them through `families.framework_names("hf")` (the `describe` and `applies` tables); the
routers' live selection bias is read by adapters/router_facts.py (trace-time mechanics).

What transformers 5.24's modeling files compute, and where the table reads it:
- `mlp.gate` (`DeepseekV3TopkRouter` / `Glm4MoeTopkRouter`) returns (router logits before the sigmoid, the
  top-k weights, the top-k ids), Qwen's order: the base transformer's rows map them. The ids are chosen on
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

from ...graph.adapter import Architecture, PointMap
from . import transforms  # noqa: F401 - registers `latent_heads`, which the rows name

_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
_T = "`tests/test_archs_mla.py`, `tests/test_supported_archs.py`"
_SIGMOID = {"router_scoring": "sigmoid"}       # in the router's code, not in the config
#: The points MLA lacks (the architecture rows' `lacks`): MLA has no k/v projection of its own, no per-head QK-norm.
STANDARD_ATTN = ("attn.k", "attn.v", "attn.q_norm", "attn.k_norm")

# MLA's rows: the latent projections and norms, q from q_b_proj (or q_proj, without a q latent) per head, and RoPE
# over interleaved pairs (q's rope dims and the one shared k_pe); without `rope_interleave` the base transformer's
# RoPE rows read `apply_rotary_pos_emb`.
#: The modeling module's functions tapped where a module `self_attn` is (adapters/hf.py's `taps` table).
TAPPED = ("apply_rotary_pos_emb_interleave",)
HF_POINTS = (
    PointMap("attn.q_a", _A + r"\.q_a_proj:out"),
    PointMap("attn.q_a_norm", _A + r"\.q_a_layernorm:out"),
    PointMap("attn.q", _A + r"\.q_(b_)?proj:out", "latent_heads", note="MLA: q_b_proj (q_proj without a q latent)"),
    PointMap("attn.kv_a", _A + r"\.kv_a_proj_with_mqa:out", note="the kv latent, then k_pe"),
    PointMap("attn.kv_a_norm", _A + r"\.kv_a_layernorm:out"),
    PointMap("attn.kv_b", _A + r"\.kv_b_proj:out", "latent_heads", note="every head's k_nope, then its v"),
    PointMap("attn.q_rope", _A + r"/fn:apply_rotary_pos_emb_interleave:out\[0\]", "bhsd"),
    PointMap("attn.k_rope", _A + r"/fn:apply_rotary_pos_emb_interleave:out\[1\]", "bhsd"),
)


def latent_applies(pm: PointMap, config: dict) -> bool | None:
    """Whether a row applies, where MLA decides it (None: MLA does not): the MLA rows only to an MLA model
    (the config states `kv_lora_rank`; the q latent's rows where it states `q_lora_rank`), the base's standard q row
    never to one."""
    mla = bool(config.get("kv_lora_rank"))
    if pm in HF_POINTS:     # without a q latent (q_lora_rank null) q is one projection, q_proj
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


HF_ARCHITECTURES = (
    Architecture("Glm4MoeForCausalLM", ("GLM-4.5 (MoE)",),
                 "MoE: sigmoid router with a score-correction bias (selection only), group-limited top-k, "
                 "routed scaling, ungated `shared_experts`, dense first layers; partial RoPE, q/k/v bias, "
                 "optional QK-norm", "every point", _T, defaults=_SIGMOID),
    Architecture("DeepseekV3ForCausalLM", ("DeepSeek-V3 (MLA, MoE)",),
                 "multi-latent attention (q and kv latents, their norms, the decompressed k_nope/v, RoPE on q's "
                 "rope dims and the shared k_pe, interleaved or not); MoE as GLM-4.5's",
                 "every point", _T, lacks=STANDARD_ATTN, defaults=_SIGMOID),
)
