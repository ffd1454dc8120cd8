"""The read-time transforms the DeepSeek family's rows name (names.py): numpy only, registered with
`graph.adapter.register_transform` when this module loads (names.py imports it).

- `latent_heads` (every framework): MLA's per-head widths (nope + rope for q, nope + v for kv_b) are not the
  config's `head_dim` (the rope dims).
- `megatron_mla_rope`: the rope dims of megatron's core-attention q / k inputs.
- `sgl_qkv_a`, `sgl_mla_rope`: SGLang's fused q/kv down-projection split, and the rope dims of its attention
  inputs (de-interleaved where the pairs are interleaved, the layout the other frameworks write).
- `sgl_routed_weights`, `sgl_routed_experts`: the routed scale multiplied into what SGLang's MoE block lacks it
  in (HF and Megatron fold it into the top-k weights).
"""
from __future__ import annotations

import numpy as np

from ...graph.adapter import TransformContext, register_transform, transform
from ...replay.grid import round_to


@register_transform("latent_heads")
def _latent_heads(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """[..rows.., heads * d] -> [rows, heads, d]: MLA's per-head widths (nope + rope for q, nope + v for kv_b)
    are not the config's `head_dim` (the rope dims)."""
    return a.reshape(ctx.n_rows, int(ctx.config["num_attention_heads"]), -1)


@register_transform("megatron_mla_rope")
def _megatron_mla_rope(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """Core attention's q or k input ``[..rows.., heads, nope + rope]`` -> its rope dims: q ``[rows, heads, rope]``,
    k ``[rows, 1, rope]`` (head 0: k_pe is one tensor expanded to every head)."""
    nope = int(ctx.config["qk_nope_head_dim"])
    x = a.reshape(ctx.n_rows, a.shape[-2], a.shape[-1])[..., nope:]
    return np.ascontiguousarray(x if ctx.opts.get("part", "q") == "q" else x[:, :1])


@register_transform("sgl_qkv_a")
def _sgl_qkv_a(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """``[rows, q_lora + kv_lora + rope]`` -> the q latent (opts ``part`` "q") or ``[kv latent | k_pe]``."""
    x = a.reshape(ctx.n_rows, -1)
    q_lora = int(ctx.config["q_lora_rank"])
    return np.ascontiguousarray(x[:, :q_lora] if ctx.opts.get("part") == "q" else x[:, q_lora:])


@register_transform("sgl_mla_rope")
def _sgl_mla_rope(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """An MLA attention input ``[T, heads, d]`` (MHA: ``d = nope + rope``; absorbed: ``kv_lora + rope``) -> its
    RoPE dims, the last ``qk_rope_head_dim``: q ``[rows, heads, rope]``, k ``[rows, 1, rope]`` (head 0), in the
    de-interleaved layout the other adapters read when the pairs are interleaved (``rope_interleave``)."""
    rope = int(ctx.config["qk_rope_head_dim"])
    x = a.reshape(ctx.n_rows, a.shape[-2], a.shape[-1])[..., -rope:]
    x = x if ctx.opts.get("part") == "q" else x[:, :1]
    if ctx.config.get("rope_interleave", True):
        # SGLang rotates interleaved pairs in place (is_neox_style False); HF's
        # apply_rotary_pos_emb_interleave (and Megatron's MLA RoPE) write them de-interleaved: evens, then odds
        x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return np.ascontiguousarray(x)


def _times_missing_scale(a: np.ndarray, ctx: TransformContext, fact: str, onto: str | None) -> np.ndarray:
    """`a` times the routed scale unless the trace says it carries it; the product rounded onto the dtype
    `onto` where SGLang materialises it in that dtype (None: kept exact)."""
    if ctx.config.get(fact):
        return a
    scaled = a.astype(np.float64) * float(ctx.config["routed_scaling_factor"])
    return (round_to(scaled, onto) if onto else scaled).astype(a.dtype)


@register_transform("sgl_routed_weights")
def _sgl_routed_weights(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """The top-k weights by sorted id (as every router's), times the routed scale where SGLang's lack it (they
    then never meet the scale in SGLang: the exact product)."""
    return _times_missing_scale(transform("weights_by_sorted_ids")(a, ctx), ctx, "routed_scale_in_weights", None)


@register_transform("sgl_routed_experts")
def _sgl_routed_experts(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """The routed experts' combination, times the routed scale where SGLang's block applies it afterwards: as
    the block's in-place ``*=`` computes it, rounded onto the activations' dtype (a second rounding of the
    routed output that a scale inside the experts, HF's and Megatron's, does not have)."""
    return _times_missing_scale(transform("tokens")(a, ctx), ctx, "routed_scale_in_experts",
                                str(ctx.config.get("dtype") or "float32"))
