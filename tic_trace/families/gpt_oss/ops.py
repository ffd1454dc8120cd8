"""GPT-OSS's exact float64 ops where they differ from the base transformer's (replay/reference.py): a router GEMM
with a bias, attention with one learned sink logit per head over sliding windows (`replay.attention_ops`), and
experts with biases and the clamped SwiGLU `(clamp(up) + 1) * g * sigmoid(alpha * g)`, g = clamp(gate,
max=limit), gate and up interleaved in `gate_up_proj` [E, H, 2F]."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ...replay.attention_ops import windowed_attention
from ...replay.not_replayable import NotReplayable


def _router(ref, layer, feeds, rows, tokens):
    w = ref.weights(layer)
    return feeds["mlp_norm"] @ w.get("mlp.router.weight").T + w.get("mlp.router.bias")


def clamped_swiglu(gu: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gu[..., ::2].clamp(max=limit), gu[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def oss_expert(w, e: int) -> tuple[torch.Tensor, ...]:
    """(gate_up [H, 2F], its bias, down [F, H], its bias) of expert e."""
    return (w.get("mlp.experts.gate_up_proj")[e], w.get("mlp.experts.gate_up_proj_bias")[e],
            w.get("mlp.experts.down_proj")[e], w.get("mlp.experts.down_proj_bias")[e])


def _experts(ref, layer, feeds, rows, tokens):
    x, ids, wts = feeds["mlp_norm"], feeds["moe.topk_ids"].long(), feeds["moe.topk_weights"]
    w, spec = ref.weights(layer), ref.spec
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < spec.num_experts:
            raise NotReplayable(f"expert id {e} outside 0..{spec.num_experts - 1}")
        r, slot = torch.nonzero(ids == e, as_tuple=True)
        gu, gub, dn, dnb = oss_expert(w, e)
        h = clamped_swiglu(x[r] @ gu + gub, spec.extra["swiglu_alpha"], spec.extra["swiglu_limit"])
        out.index_add_(0, r, wts[r, slot, None] * (h @ dn + dnb))
    return out


def ops(spec: Any, base: Mapping[str, Callable]) -> dict[str, Callable]:
    """The ops replacing the base's (`base`: reference._OPS)."""
    return {"attn.core": windowed_attention, "moe.router_logits": _router, "moe.experts_out": _experts}
