"""The exact ops of multi-latent attention (DeepSeek-V2/V3 MLA), in float64, as HF's `DeepseekV3Attention`
computes them (transformers 5.24):

    q_a = q_a_proj(x); q_a_norm = rms(q_a); q = q_b_proj(q_a_norm)            [H, nope + rope]
    kv_a = kv_a_proj_with_mqa(x)                                              [kv_lora_rank + rope]
    kv_a_norm = rms(kv_a[:kv_lora_rank]); kv_b = kv_b_proj(kv_a_norm)         [H, nope + v]
    q_rope = RoPE(q[..., nope:]); k_rope = RoPE(kv_a[kv_lora_rank:])          (k_pe: one head, shared)
    core = softmax((q_nope.k_nope + q_rope.k_rope) * scale) v                 [H * v]

RoPE is over interleaved pairs (x0, x1), (x2, x3)... with the output written de-interleaved (the rotated
even dims, then the rotated odd dims: HF's `apply_rotary_pos_emb_interleave`) when `rope_interleave`, else
rotate-half. The latent norms are built with HF's default eps (1e-6), not the config's `rms_norm_eps`
(spec.py: which points each op reads, the tensors' shapes). The ops are built on the replay's float64 helpers
(`LatentOps(f)`: reference.py's, handed over with its op table, since a family may not import it; RoPE's are
replay/rope.py's).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ...replay.not_replayable import NotReplayable
from .spec import LATENT_NORM_EPS, latent, softmax_scale

if TYPE_CHECKING:      # torch loads with the replay's ops
    import torch


def absorbed_queries(rows, kv_rows: dict, present: "torch.Tensor", dev) -> "torch.Tensor":
    """Per query row, whether it ran an absorbed path: a query whose keys 0..p all have a recorded kv_b ran
    the MHA path (its attention read that kv_b); any other read the latent cache, up-projected inside its
    weights (kv_b never materialised, for any of its keys)."""
    import torch
    from ...replay.attention_ops import each_sample
    out = torch.zeros(len(rows), dtype=torch.bool, device=dev)
    for qi, qpos, kidx, _ in each_sample(rows, kv_rows, dev):
        upto = torch.cumprod(present[kidx].to(torch.int64), 0).bool()      # kv_b at every key 0..p
        out[torch.tensor(qi, device=dev)] = ~upto[qpos]
    return out


def key_values(ref, layer, feeds: dict, proj) -> tuple:
    """(kv_b as recorded [keys, H, nope + v] (NaN where not), kv_b up-projected exactly from the recorded
    latent or None when every key has one, which keys have a recorded one). `proj(ref, layer, x, name)`:
    the float64 projection."""
    s = ref.spec
    kv_b = heads(feeds["attn.kv_b"], s)
    present = kv_b_present(feeds)
    if bool(present.all()):
        return kv_b, None, present
    if "attn.kv_a_norm" not in feeds:
        raise NotReplayable("kv_b of some key rows not recorded (an absorbed path), nor the kv latent")
    return kv_b, heads(proj(ref, layer, feeds["attn.kv_a_norm"], "kv_b_proj"), s), present


def latent_kv_rows(feeds: dict, common_rows, tensor) -> dict | None:
    """MLA's key/value rows for its attention (`Family.kv_rows`; all passes): k_pe, and kv_b where the side
    materialised it (NaN where it did not: an absorbed path), with the normed latent those rows were up-projected
    from (`LatentOps.core` reads it where kv_b is NaN). Without the latent, the rows that have a kv_b. None
    without a recorded kv_b: the base's k_rope / v rows serve."""
    kv_b, k_pe, latent = feeds.get("attn.kv_b"), feeds.get("attn.k_rope"), feeds.get("attn.kv_a_norm")
    if kv_b is None:
        return None
    if any(t is not None and t.values is None for t in (k_pe, kv_b, latent)):
        raise NotReplayable("attn.k_rope, attn.kv_b or attn.kv_a_norm has no values")
    rows, idx = common_rows(k_pe, [latent if latent is not None else kv_b])
    at = {r: i for i, r in enumerate(kv_b.rows)}
    vb = np.full((len(rows),) + kv_b.values.shape[1:], np.nan)
    for n, r in enumerate(rows):
        if r in at:
            vb[n] = kv_b.values[at[r]]
    out = {"attn.k_rope": tensor(k_pe.values[idx[0]]), "attn.kv_b": tensor(vb),
           "__kv_rows__": {r: i for i, r in enumerate(rows)}}
    if latent is not None:
        out["attn.kv_a_norm"] = tensor(latent.values[idx[1]])
    return out


def kv_b_present(feeds: dict) -> "torch.Tensor":
    """Which key rows hold a recorded kv_b (the rest are NaN: see `latent_kv_rows`)."""
    kv_b = feeds["attn.kv_b"]
    return ~kv_b.reshape(kv_b.shape[0], -1).isnan().any(dim=1)


class LatentOps:
    """MLA's ops, with the replay's float64 helpers (`f`: reference.py's `linear`, `rms_norm`, `attend_by_sample`,
    handed over as its op table's `f64`: a family never imports reference, no import circle) and its op signature
    (ref, layer, feeds, rows, tokens)."""

    def __init__(self, f):
        self.f = f

    def tables(self) -> tuple[dict, dict]:
        """(MLA's own points, MLA's op at points every architecture has) -> op."""
        return ({"attn.q_a": self.q_a, "attn.q_a_norm": self.q_a_norm, "attn.kv_a": self.kv_a,
                 "attn.kv_a_norm": self.kv_a_norm, "attn.kv_b": self.kv_b},
                {"attn.q": self.q, "attn.q_rope": self.q_rope, "attn.k_rope": self.k_rope, "attn.core": self.core})

    def rope(self, x: torch.Tensor, positions: torch.Tensor, spec: Any) -> torch.Tensor:
        """RoPE of MLA's rope dims x [rows, heads, rope_dim] at `positions` [rows]."""
        import torch
        from ...replay.rope import apply_rope, rope_inv_freq
        m = latent(spec)
        rspec = replace(spec, head_dim=m.qk_rope_head_dim)
        if not m.rope_interleave:
            return apply_rope(x, positions, rspec)
        inv, scale = rope_inv_freq(rspec)
        ang = positions.to(torch.float64)[:, None] * inv.to(x.device)[None, :]
        cos, sin = (ang.cos() * scale)[:, None, :], (ang.sin() * scale)[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _proj(self, ref, layer, x: torch.Tensor, name: str) -> torch.Tensor:
        w = ref.weights(layer)
        return self.f.linear(x, w.get(f"self_attn.{name}.weight"), w.get(f"self_attn.{name}.bias", optional=True))

    def q_a(self, ref, layer, feeds, rows, tokens):
        return self._proj(ref, layer, feeds["attn_norm"], "q_a_proj")

    def kv_a(self, ref, layer, feeds, rows, tokens):
        return self._proj(ref, layer, feeds["attn_norm"], "kv_a_proj_with_mqa")

    def q_a_norm(self, ref, layer, feeds, rows, tokens):
        w = ref.weights(layer).get("self_attn.q_a_layernorm.weight")
        return self.f.rms_norm(feeds["attn.q_a"], w, LATENT_NORM_EPS)

    def kv_a_norm(self, ref, layer, feeds, rows, tokens):
        kv = feeds["attn.kv_a"][:, :latent(ref.spec).kv_lora_rank]       # k_pe is not normalised
        return self.f.rms_norm(kv, ref.weights(layer).get("self_attn.kv_a_layernorm.weight"), LATENT_NORM_EPS)

    def kv_b(self, ref, layer, feeds, rows, tokens):
        return heads(self._proj(ref, layer, feeds["attn.kv_a_norm"], "kv_b_proj"), ref.spec)

    def q(self, ref, layer, feeds, rows, tokens):
        if latent(ref.spec).q_lora_rank:
            return heads(self._proj(ref, layer, feeds["attn.q_a_norm"], "q_b_proj"), ref.spec)
        return heads(self._proj(ref, layer, feeds["attn_norm"], "q_proj"), ref.spec)

    def q_rope(self, ref, layer, feeds, rows, tokens):
        q = feeds["attn.q"]
        return self.rope(heads(q, ref.spec)[..., latent(ref.spec).qk_nope_head_dim:], _positions(rows, q), ref.spec)

    def k_rope(self, ref, layer, feeds, rows, tokens):
        kv = feeds["attn.kv_a"]
        return self.rope(kv[:, latent(ref.spec).kv_lora_rank:][:, None, :], _positions(rows, kv), ref.spec)

    def core(self, ref, layer, feeds, rows, tokens):
        """Per sample, every query row over the keys at positions 0..p (reference.attend_by_sample, in query
        blocks): q = [q_nope, q_rope], k = [k_nope, k_pe] (k_pe the same for every head), v from kv_b. A query
        that ran an absorbed path (an engine's decode: kv_b never materialised) reads k_nope and v up-projected
        exactly from the recorded latent, for every key: in exact arithmetic the absorbed attention is this."""
        import torch
        s, m = ref.spec, latent(ref.spec)
        nope = m.qk_nope_head_dim
        q = torch.cat([heads(feeds["attn.q"], s)[..., :nope], heads(feeds["attn.q_rope"], s)], dim=-1)
        kv_b, up, present = key_values(ref, layer, feeds, self._proj)
        k_pe = feeds["attn.k_rope"].reshape(kv_b.shape[0], 1, -1).expand(-1, s.num_attention_heads, -1)
        absorbed = (absorbed_queries(rows, feeds["__kv_rows__"], present, q.device) if up is not None
                    else torch.zeros(len(rows), dtype=torch.bool))
        out = torch.empty(q.shape[0], s.num_attention_heads * m.v_head_dim, dtype=q.dtype, device=q.device)
        for sel, kv in ((~absorbed, kv_b), (absorbed, up)):
            idx = sel.nonzero().flatten().tolist()
            if idx:
                k, v = torch.cat([kv[..., :nope], k_pe], dim=-1), kv[..., nope:]
                out[idx] = self.f.attend_by_sample(q[idx], k, v, [rows[i] for i in idx], feeds["__kv_rows__"],
                                                   softmax_scale(s))
        return out


def heads(y: torch.Tensor, spec: Any) -> torch.Tensor:
    """[rows, H * d] -> [rows, H, d]."""
    return y.reshape(y.shape[0], spec.num_attention_heads, -1)


def _positions(rows, x: "torch.Tensor") -> "torch.Tensor":
    import torch
    return torch.tensor([p for _, p in rows], dtype=torch.float64, device=x.device)
