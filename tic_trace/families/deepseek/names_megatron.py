"""Megatron's multi-latent attention rows (megatron-core 0.16.1 ``MLASelfAttention``, DeepSeek-V2/V3), strings
only: the same canonical points as HF's DeepSeek-V3 rows (``names_hf.py``), from megatron's modules.
adapters/megatron.py reads them through ``families.framework_names("megatron")``.

What ``MLASelfAttention.get_query_key_value_tensors`` (transformer/multi_latent_attention.py) computes, and the
record each point reads (``{A}`` = ``decoder.layers.i.self_attention``):

* ``attn.q_a`` = ``{A}.linear_q_down_proj`` output ``[0]`` ``[s, b, q_lora_rank]`` (column-parallel without a
  gather in the local spec: ``cat:-1``); ``attn.q_a_norm`` = ``{A}.q_layernorm`` output (after megatron's own
  gather: whole on every rank).
* ``attn.q`` = ``{A}.linear_q_up_proj`` (``linear_q_proj`` without a q latent) output ``[0]``, every head's
  ``[nope | rope]`` (heads column-parallel: ``cat:-1``), laid out ``[rows, heads, nope + rope]``.
* ``attn.kv_a`` = ``{A}.linear_kv_down_proj`` output ``[0]``, ``[kv latent | k_pe]``; ``attn.kv_a_norm`` =
  ``{A}.kv_layernorm`` output (the latent only); ``attn.kv_b`` = ``{A}.linear_kv_up_proj`` output ``[0]``,
  every head's ``[k_nope | v]``.
* RoPE is a function call inside the method; its outputs are concatenated into core attention's inputs:
  ``core_attention`` input 0 is ``[s, b, heads, nope + rope]`` = ``[q_nope | RoPE(q_rope)]``, input 1 is
  ``[k_nope | RoPE(k_pe)]`` with the one k_pe expanded to every head. ``attn.q_rope`` is input 0's rope dims,
  ``attn.k_rope`` input 1's rope dims of head 0 (``[rows, 1, rope]``, HF's shape). Megatron's MLA RoPE
  (``_apply_rotary_pos_emb_bshd(multi_latent_attention=True)``) reads interleaved pairs and writes them
  de-interleaved, as HF's ``apply_rotary_pos_emb_interleave``: the fact ``rope_interleave`` is True when
  ``rotary_interleaved`` is False. With ``rotary_interleaved`` it de-interleaves and then rotates pairs, a
  layout neither HF function computes: refused (``refusals.latent_refusal``).
* ``attn.core`` / ``attn.out``: adapters/megatron.py's rows (``core_attention`` output, ``[s, b, heads * v]``; and
  ``linear_proj``).

MLA has no ``linear_qkv``, no per-head q/k norms and no k/v of its own: the standard rows of those points never
apply to an MLA model, and its ``q_layernorm`` (the q latent's norm) is ``attn.q_a_norm``, not ``attn.q_norm``.
"""
from __future__ import annotations

from typing import Any

from ...graph.adapter import Architecture, PointMap
from . import transforms  # noqa: F401 - registers `latent_heads` and `megatron_mla_rope`, which the rows name
from .names_hf import STANDARD_ATTN
from .spec import HF_ROUTER_BIAS

# The standard rows an MLA model never reads.
_STANDARD_ROWS = STANDARD_ATTN + ("attn.q", "attn.q_rope", "attn.k_rope")


def latent_points(attn: str) -> tuple[PointMap, ...]:
    """MLA's rows, for the self-attention record prefix regex ``attn`` (adapters/megatron.py's)."""
    return (
        PointMap("attn.q_a", attn + r"\.linear_q_down_proj:out\[0\]", merge="cat:-1"),
        PointMap("attn.q_a_norm", attn + r"\.q_layernorm:out", merge="seq",
                 note="the q latent's norm, after megatron's gather of q_a (SP: scattered along s again)"),
        PointMap("attn.q", attn + r"\.linear_q_(up_)?proj:out\[0\]", "latent_heads", "cat:-1",
                 note="MLA: linear_q_up_proj (linear_q_proj without a q latent), every head's [nope | rope]"),
        PointMap("attn.kv_a", attn + r"\.linear_kv_down_proj:out\[0\]", merge="cat:-1",
                 note="the kv latent, then k_pe"),
        PointMap("attn.kv_a_norm", attn + r"\.kv_layernorm:out", merge="seq"),
        PointMap("attn.kv_b", attn + r"\.linear_kv_up_proj:out\[0\]", "latent_heads", "cat:-1",
                 note="every head's k_nope, then its v"),
        PointMap("attn.q_rope", attn + r"\.core_attention:in\[0\]", "megatron_mla_rope", "heads", opts={"part": "q"},
                 note="core_attention's query input [q_nope | RoPE(q_rope)]: its rope dims"),
        PointMap("attn.k_rope", attn + r"\.core_attention:in\[1\]", "megatron_mla_rope", "same", opts={"part": "k"},
                 note="core_attention's key input: the rope dims of head 0 (k_pe, expanded to every head)"),
    )


def latent_applies(pm: PointMap, rows: tuple[PointMap, ...], config: dict) -> bool | None:
    """Whether a row applies where MLA decides it (None: MLA does not): MLA's rows (``rows``) only to an MLA
    model (the q latent's only with ``q_lora_rank``), the standard attention rows never to one."""
    mla = bool(config.get("kv_lora_rank"))
    if pm in rows:
        return mla and (bool(config.get("q_lora_rank")) or pm.point not in ("attn.q_a", "attn.q_a_norm"))
    if mla and pm.point in _STANDARD_ROWS:
        return False
    return None


#: The TransformerConfig switch that builds ``MLASelfAttention`` instead of ``SelfAttention``.
MLA_SWITCH = "multi_latent_attention"


def latent_facts(cfg: Any) -> dict:
    """MLA's config facts for the manifest, in the HF adapter's spelling (none without MLA), and what
    ``refusals.latent_refusal`` reads."""
    if not getattr(cfg, MLA_SWITCH, False):
        return {}
    return {"q_lora_rank": getattr(cfg, "q_lora_rank", None), "kv_lora_rank": int(cfg.kv_lora_rank),
            "qk_nope_head_dim": int(cfg.qk_head_dim), "qk_rope_head_dim": int(cfg.qk_pos_emb_head_dim),
            "v_head_dim": int(cfg.v_head_dim), "rope_interleave": not bool(getattr(cfg, "rotary_interleaved", False)),
            "head_dim": int(cfg.qk_pos_emb_head_dim),       # HF DeepseekV3Config's head_dim: the rope dims
            "mla_rope_fusion": bool(getattr(cfg, "apply_rope_fusion", False)),
            "mla_rope_type": getattr(cfg, "rope_type", None)}


#: HF DeepseekV3Attention -> megatron MLASelfAttention (local spec) parameter names, under the layer's attention
#: prefix: the same row layouts (q per head [nope | rope], kv_a [latent | k_pe], kv_b per head [k_nope | v]; RoPE
#: reads the rope dims as interleaved pairs on both), so adapters/megatron_weights.py copies every tensor. `marker`:
#: the tensor that says a layer's attention is MLA.
MLA_WEIGHTS = {"marker": "kv_a_proj_with_mqa.weight",
               "column": (("q_a_proj", "linear_q_down_proj"), ("q_b_proj", "linear_q_up_proj"),
                          ("q_proj", "linear_q_proj"), ("kv_a_proj_with_mqa", "linear_kv_down_proj"),
                          ("kv_b_proj", "linear_kv_up_proj")),
               "norms": (("q_a_layernorm", "q_layernorm"), ("kv_a_layernorm", "kv_layernorm"))}

#: The router's selection-only bias: HF's name -> megatron's, under each layer's `mlp.` (kept in fp32, as megatron
#: keeps it; adapters/megatron_weights.py).
ROUTER_BIAS = (HF_ROUTER_BIAS.removeprefix("mlp."), "router.expert_bias")

# The structure its rows verify (adapters/megatron.py's ARCHITECTURES: structures, the HF or SGLang side of a
# pair names the family).
MEGATRON_ARCHITECTURES = (
    Architecture("GPTModel/TransformerLayer/MLASelfAttention/MLP+MoELayer", ("DeepSeek-V3 (MLA, MoE)",),
                 "multi-latent attention (q and kv latents, their norms, the decompressed k_nope/v, RoPE of q's rope "
                 "dims and the shared k_pe); sigmoid router with an expert bias, group-limited top-k, routed "
                 "scaling, shared experts, dense first layers; local spec, TP 1 and 2 (TP > 2, SP, EP, CP, PP, the "
                 "TE spec, fused or YaRN RoPE refused)", "every point (TP 1)", "`tests/test_megatron_mla.py`",
                 lacks=STANDARD_ATTN),
)
