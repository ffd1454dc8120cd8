"""RoPE as the replay computes it, in float64: the inverse frequencies and cos/sin scale of each kind HF configs
state (default, linear, llama3, yarn: HF's `_compute_*_parameters`), at one layer (its layer type's RoPE), and the
rotate-half rotation. A leaf (no torch at import; nothing that dispatches through the families' registry), so
model_spec, reference, the variants and the families' ops read one RoPE.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .layer_types import rope_of_layer
from .not_replayable import CheckpointError, NotReplayable

if TYPE_CHECKING:
    import torch

ROPE_KINDS = ("default", "linear", "yarn", "llama3")      # HF rope_type values the replay computes


def rope_inv_freq(spec: Any, layer: int | None = None) -> tuple["torch.Tensor", float]:
    """Inverse frequencies (float64) and the cos/sin scale, for the RoPE kinds HF configs state (at `layer`:
    that layer type's RoPE where the config gives one per layer type, Gemma3)."""
    import torch
    r = rope_of_layer(spec, layer)
    dim = int(spec.head_dim * r.partial_rotary_factor)
    if r.kind not in ROPE_KINDS:
        raise NotReplayable(f"RoPE `rope_type: {r.kind}` is not replayed (replayed: {', '.join(ROPE_KINDS)}): the "
                            "A-B rule alone judges the RoPE points")
    if r.kind == "yarn":
        return yarn_inv_freq_and_scale(r, spec.head_dim, spec.max_position_embeddings)
    inv = 1.0 / (r.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if r.kind == "linear":
        inv = inv / r.factor
    elif r.kind == "llama3":
        inv = llama3_inv_freq(r, inv)
    return inv, 1.0


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: Any, layer: int | None = None) -> torch.Tensor:
    """Rotate-half RoPE of x [rows, heads, head_dim] at `positions` [rows] (partial rotary: first dims only)."""
    import torch
    inv, scale = rope_inv_freq(spec, layer)
    inv = inv.to(x.device)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = (emb.cos() * scale)[:, None, :], (emb.sin() * scale)[:, None, :]
    rot = emb.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def llama3_inv_freq(rope: Any, inv: "torch.Tensor") -> "torch.Tensor":
    """Llama 3's scaled inverse frequencies as HF's `_compute_llama3_parameters` states them (float64): long
    wavelengths divided by `factor`, short ones kept, a smooth ramp between (attention scale 1)."""
    import torch
    omax, lo, hi = rope.original_max_position_embeddings, rope.low_freq_factor, rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > omax / lo, inv / rope.factor, inv)
    smooth = (omax / wavelen - lo) / (hi - lo)
    medium = (wavelen >= omax / hi) & (wavelen <= omax / lo)
    return torch.where(medium, (1 - smooth) * scaled / rope.factor + smooth * scaled, scaled)


def yarn_inv_freq_and_scale(rope: Any, head_dim: int, max_pos: int | None):
    """YaRN's inverse frequencies and attention factor as HF's `_compute_yarn_parameters` states them, in
    float64 (HF computes them in float32: that rounding is shared by every side and measured as theirs)."""
    import torch
    dim = int(head_dim * rope.partial_rotary_factor)
    base, factor = rope.theta, rope.factor
    omax = rope.original_max_position_embeddings or max_pos
    if omax is None:       # model_spec refuses such a config; kept for a RopeSpec built by hand
        raise CheckpointError("config.json: yarn RoPE needs original_max_position_embeddings")

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rope.attention_factor
    if att is None:
        att = (mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
               if rope.mscale and rope.mscale_all_dim else mscale(factor))

    def corr_dim(rot):
        return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extra = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(att)
