"""Attention and norms as any family may compute them, in float64, chosen by config facts (`ModelSpec.extra`), never
by model_type: causal attention over a sliding window (Mistral, Mixtral, Qwen, Gemma, GPT-OSS), with soft-capped
scores, a scale of its own and one learned sink logit per head where the config says so; RMSNorm by
(offset + weight); the per-sample query / key indices every attention replay walks; whether a QK-norm spans the
whole projection. The families' ops (tic_trace/families/) and the core's build on these.
"""
from __future__ import annotations

import math

import torch

from ..families.base import ATTENTION_SINKS
from .layer_types import sliding_window
from .not_replayable import NotReplayable

F64 = torch.float64


def offset_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * (offset + w)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if not cap else torch.tanh(x / cap) * cap


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Tq, Tk] True where query i sees key j: causal, and within the last `window` positions when given."""
    m = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        m = m & (k_pos[None, :] > q_pos[:, None] - window)
    return m


def attention_scale(spec) -> float:
    return spec.extra.get("attn_scale") or spec.head_dim ** -0.5


def exact_attention(q, k, v, mask, scale: float, cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One sample's attention in float64: q [Tq, H, d], k/v [Tk, KV, d], mask [Tq, Tk]; scores soft-capped,
    a sink logit per head added to the softmax's denominator."""
    rep = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = softcap(torch.einsum("qhd,khd->hqk", q, kx) * scale, cap)
    s = s.masked_fill(~mask[None], -math.inf)
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        m = torch.maximum(s.amax(-1, keepdim=True), sinks[:, None, None])
        e = torch.exp(s - m)
        p = e / (e.sum(-1, keepdim=True) + torch.exp(sinks[:, None, None] - m))
    return torch.einsum("hqk,khd->qhd", p, vx)


def each_sample(rows, kv_rows, dev):
    """Per sample: (query indices, query positions, key indices into k/v for positions 0..last, key positions)."""
    for sample in dict.fromkeys(s for s, _ in rows):
        qi = [i for i, (s, _) in enumerate(rows) if s == sample]
        qpos = torch.tensor([rows[i][1] for i in qi], device=dev)
        last = int(qpos.max())
        try:
            kidx = torch.tensor([kv_rows[(sample, p)] for p in range(last + 1)], device=dev)
        except KeyError as e:
            raise NotReplayable(f"sample {sample!r}: key/value row {e.args[0]} not recorded") from None
        yield qi, qpos, kidx, torch.arange(last + 1, device=dev)


def sinks_of(ref, layer) -> torch.Tensor | None:
    """The learned sink logits where the spec states them (the family's name for them: its derived_weight)."""
    return ref.weights(layer).get(ATTENTION_SINKS) if ref.spec.extra.get("sinks") else None


def windowed_attention(ref, layer, feeds, rows, tokens):
    """attn.core of any model with windows, soft-capped scores, a scale of its own or sinks (`ModelSpec.extra`)."""
    q, k, v = feeds["attn.q_rope"], feeds["attn.k_rope"], feeds["attn.v"]
    spec = ref.spec
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=F64, device=q.device)
    window, sinks = sliding_window(spec, layer), sinks_of(ref, layer)
    for qi, qpos, kidx, kpos in each_sample(rows, feeds["__kv_rows__"], q.device):
        o = exact_attention(q[qi], k[kidx], v[kidx], attention_mask(qpos, kpos, window), attention_scale(spec),
                            spec.extra.get("attn_softcap"), sinks)
        out[qi] = o.reshape(len(qi), -1)
    return out


def spans_heads(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a norm of per-head x [.., heads, d] normalises over the whole projection: its gain is heads x d
    wide (OLMoE's QK-norm), not d (Qwen3's, Gemma 3's)."""
    return x.dim() >= 2 and w.dim() == 1 and w.numel() != x.shape[-1] and w.numel() == x.shape[-2] * x.shape[-1]
