"""The Megatron adapter's multi-latent attention rows (megatron-core 0.16.1 ``MLASelfAttention``, DeepSeek-V2/V3):
the same canonical points as the HF adapter's DeepSeek-V3 rows (``hf_deepseek.py``), from megatron's modules.

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
  layout neither HF function computes: refused (:func:`latent_refusal`).
* ``attn.core`` / ``attn.out``: megatron.py's rows (``core_attention`` output, ``[s, b, heads * v]``; and
  ``linear_proj``).

MLA has no ``linear_qkv``, no per-head q/k norms and no k/v of its own: the standard rows of those points never
apply to an MLA model, and its ``q_layernorm`` (the q latent's norm) is ``attn.q_a_norm``, not ``attn.q_norm``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tic_trace.adapters import hf_deepseek  # noqa: F401 - registers the `latent_heads` transform the rows use
from tic_trace.graph.adapter import PointMap, TransformContext, register_transform

# The points MLA lacks (the architecture rows' `lacks`) and the standard rows an MLA model never reads.
STANDARD_ATTN = ("attn.k", "attn.v", "attn.q_norm", "attn.k_norm")
_STANDARD_ROWS = STANDARD_ATTN + ("attn.q", "attn.q_rope", "attn.k_rope")


@register_transform("megatron_mla_rope")
def _mla_rope_dims(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """Core attention's q or k input ``[..rows.., heads, nope + rope]`` -> its rope dims: q ``[rows, heads, rope]``,
    k ``[rows, 1, rope]`` (head 0: k_pe is one tensor expanded to every head)."""
    nope = int(ctx.config["qk_nope_head_dim"])
    x = a.reshape(ctx.n_rows, a.shape[-2], a.shape[-1])[..., nope:]
    return np.ascontiguousarray(x if ctx.opts.get("part", "q") == "q" else x[:, :1])


def latent_points(attn: str) -> tuple[PointMap, ...]:
    """MLA's rows, for the self-attention record prefix regex ``attn`` (megatron.py's)."""
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


def latent_facts(cfg: Any) -> dict:
    """MLA's config facts for the manifest, in the HF adapter's spelling (none without MLA), and what
    :func:`latent_refusal` reads."""
    if not getattr(cfg, "multi_latent_attention", False):
        return {}
    return {"q_lora_rank": getattr(cfg, "q_lora_rank", None), "kv_lora_rank": int(cfg.kv_lora_rank),
            "qk_nope_head_dim": int(cfg.qk_head_dim), "qk_rope_head_dim": int(cfg.qk_pos_emb_head_dim),
            "v_head_dim": int(cfg.v_head_dim), "rope_interleave": not bool(getattr(cfg, "rotary_interleaved", False)),
            "head_dim": int(cfg.qk_pos_emb_head_dim),       # HF DeepseekV3Config's head_dim: the rope dims
            "mla_rope_fusion": bool(getattr(cfg, "apply_rope_fusion", False)),
            "mla_rope_type": getattr(cfg, "rope_type", None)}


def latent_refusal(config: dict) -> str | None:
    """Why an MLA trace's setup is not the one the tests verify (None: it is, or the model is not MLA)."""
    if not config.get("kv_lora_rank"):
        return None
    why = []
    if not config.get("rope_interleave", True):
        why.append("`rotary_interleaved=True`: megatron's MLA RoPE then rotates pairs of the de-interleaved dims, "
                   "a layout no reference computes")
    if config.get("mla_rope_fusion"):
        why.append("`apply_rope_fusion` (TE's fused MLA YaRN RoPE): not run in the tests")
    if config.get("mla_rope_type") not in (None, "rope"):
        why.append(f"MLA RoPE `{config.get('mla_rope_type')}` (YaRN): not run against a reference in the tests")
    if config.get("spec") == "te":
        why.append("the Transformer Engine spec (latent norms fused into `linear_q_up_proj` / `linear_kv_up_proj`): "
                   "not run in the tests")
    if int(config.get("tensor_model_parallel_size") or 1) > 2 or config.get("sequence_parallel"):
        why.append(f"`tensor_model_parallel_size` {config.get('tensor_model_parallel_size')}"
                   f"{' with sequence parallelism' if config.get('sequence_parallel') else ''}: the tests run MLA "
                   "at TP 1 and 2, without sequence parallelism")
    for k in ("context_parallel_size", "pipeline_model_parallel_size"):
        if int(config.get(k) or 1) > 1:
            why.append(f"`{k}` {config.get(k)}: not run with MLA in the tests")
    if int(config.get("expert_model_parallel_size") or 1) > 1:
        why.append("expert parallelism with MLA: not run in the tests")
    return "MLA: " + "; ".join(why) if why else None
