"""Gemma's exact float64 ops where they differ from the base transformer's (replay/reference.py): the embedding
times sqrt(hidden) (rounded to the weight's dtype, as HF's `embed_scale` is), every RMSNorm by (1 + weight),
sandwich norms (`attn.post_norm` / `mlp.post_norm` feed the residual adds), attention scaled by
query_pre_attn_scalar^-1/2 with soft-capped scores (Gemma 2) over a sliding window on sliding layers
(`replay.attention_ops`), soft-capped final logits (Gemma 2: `logits` is the model's output). Its GELU-tanh gated
MLP is the core's (`gated_mlp_act`: any dense MLP whose activation is not SiLU)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ...replay.attention_ops import offset_rms_norm, softcap, windowed_attention
from .spec import NORMS

F64 = torch.float64


def _offset_norm(weight: str, feed: str | None = None) -> Callable:
    def op(ref, layer, feeds, rows, tokens):
        x = feeds[feed] if feed else next(iter(feeds.values()))
        return offset_rms_norm(x, ref.weights(layer).get(weight), ref.spec.rms_norm_eps, ref.spec.extra["norm_offset"])
    return op


def scale_in(ref: Any, name: str, scale: float) -> float:
    """A constant as the side holds it: HF rounds `embed_scale` to the embedding weight's dtype."""
    dt = getattr(torch, ref.weight_dtype(name) or ref.ckpt.info[name].dtype, None)
    return float(torch.tensor(scale, dtype=dt if isinstance(dt, torch.dtype) else F64).to(F64))


def _scaled_embed(embed: Callable) -> Callable:
    def op(ref, layer, feeds, rows, tokens):
        name = "model.embed_tokens.weight"
        return embed(ref, layer, feeds, rows, tokens) * scale_in(ref, name, ref.spec.extra["embed_scale"])
    return op


def _capped_logits(logits: Callable) -> Callable:
    def op(ref, layer, feeds, rows, tokens):
        return softcap(logits(ref, layer, feeds, rows, tokens), ref.spec.extra.get("final_softcap"))
    return op


def ops(spec: Any, base: Mapping[str, Callable]) -> dict[str, Callable]:
    """The ops replacing the base's (`base`: reference._OPS)."""
    out: dict[str, Callable] = {
        p: _offset_norm(w, "attn.q" if p == "attn.q_norm" else "attn.k" if p == "attn.k_norm" else None)
        for p, w in NORMS.items()}
    out.update({"embed": _scaled_embed(base["embed"]), "attn.core": windowed_attention,
                "logits": _capped_logits(base["logits"])})
    return out
