"""The exact float64 ops of Qwen3-Next where they differ from the base transformer's (replay/reference.py); its
config facts, feeds and op names are spec.py's (no torch there).

What the model computes (our own statement of it, from the architecture's definition):
- every RMSNorm but the gated one scales by (1 + w): attn_norm, mlp_norm, final_norm, the per-head QK-norms;
- gated attention: q_proj's columns are, per head, the query then its gate; the attention output (GQA,
  causal softmax, head_dim^-1/2) times sigmoid(gate) is what o_proj reads (`attn.core`);
- Gated DeltaNet linear attention, per sample, with key heads Hk serving r = Hv / Hk value heads each:
    in_proj_qkvz columns per key head: q [dk] | k [dk] | v [r dv] | z [r dv]; in_proj_ba per key head: b [r] | a [r]
    conv: x = q | k | v (all heads, in that order), y_t = SiLU(sum_j w[c, j] x_{t-K+1+j}) (zeros before t = 0)
    delta rule, per value head h (key head h // r), state S [dk, dv] from zero:
        q_t, k_t L2-normalised (eps 1e-6 inside the root), q_t / sqrt(dk); beta_t = sigmoid(b_t),
        g_t = -exp(A_log) softplus(a_t + dt_bias)
        S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
    gated norm, per value head: RMSNorm(o_t) w * SiLU(z_t) (plain w, rms_norm_eps); out_proj is `attn.out`.
The recurrence is replayed in its sequential form: exact in float64 at any length, O(S) steps a sample.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from ...replay.attention_ops import offset_rms_norm
from ...replay.not_replayable import NotReplayable
from .spec import NORMS, linear_layer

L2_EPS = 1e-6       # inside the root of the q/k L2 normalisation


# ---------------------------------------------------------------- the ops

def _unit_norm(weight: str, feed: str | None) -> Callable:
    def op(ref, layer, feeds, rows, tokens):
        x = feeds[feed] if feed else next(iter(feeds.values()))
        return offset_rms_norm(x, ref.weights(layer).get(weight), ref.spec.rms_norm_eps, 1.0)
    return op


def _q_half(part: str) -> Callable:
    """q or the gate: q_proj's rows of each head's first or second head_dim block."""
    def op(ref, layer, feeds, rows, tokens):
        spec, w = ref.spec, ref.weights(layer)
        nq, hd = spec.num_attention_heads, spec.head_dim
        half = slice(0, hd) if part == "q" else slice(hd, 2 * hd)
        wq = w.get("self_attn.q_proj.weight").reshape(nq, 2 * hd, -1)[:, half].reshape(nq * hd, -1)
        y = feeds["attn_norm"] @ wq.T
        b = w.get("self_attn.q_proj.bias", optional=True)
        if b is not None:
            y = y + b.reshape(nq, 2 * hd)[:, half].reshape(-1)
        return y.reshape(len(rows), nq, hd)
    return op


def _gated_attention(attention: Callable) -> Callable:
    """The causal softmax attention (`attention`: the base's, per sample in query blocks) times sigmoid(gate)."""
    def op(ref, layer, feeds, rows, tokens):
        return attention(ref, layer, feeds, rows, tokens) * torch.sigmoid(feeds["attn.gate"].reshape(len(rows), -1))
    return op


def _gemm(weight: str, feed: str) -> Callable:
    def op(ref, layer, feeds, rows, tokens):
        return feeds[feed].reshape(len(rows), -1) @ ref.weights(layer).get(weight).T
    return op


def _attn_out(generic: Callable) -> Callable:
    """A linear-attention layer's out_proj, a softmax layer's o_proj (the generic op)."""
    linear = _gemm("linear_attn.out_proj.weight", "attn.linear_norm")

    def op(ref, layer, feeds, rows, tokens):
        return (linear if linear_layer(ref.spec, layer) else generic)(ref, layer, feeds, rows, tokens)
    return op


def ungroup_qkvz(qkvz: torch.Tensor, spec: Any) -> tuple[torch.Tensor, ...]:
    """in_proj_qkvz's output [rows, ...] (columns grouped by key head) -> q, k [rows, Hk, dk], v, z [rows, Hv, dv]."""
    (hk, hv), (dk, dv) = spec.extra["linear_heads"], spec.extra["linear_dims"]
    r = hv // hk
    g = qkvz.reshape(qkvz.shape[0], hk, 2 * dk + 2 * r * dv)
    q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=-1)
    return q, k, v.reshape(-1, hv, dv), z.reshape(-1, hv, dv)


def ungroup_ba(ba: torch.Tensor, spec: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_ba's output [rows, 2 Hv] (grouped by key head: b [r] | a [r]) -> b, a [rows, Hv]."""
    hk, hv = spec.extra["linear_heads"]
    b, a = torch.split(ba.reshape(ba.shape[0], hk, 2 * (hv // hk)), hv // hk, dim=-1)
    return b.reshape(-1, hv), a.reshape(-1, hv)


def whole_samples(rows: list) -> list[list[int]]:
    """Per sample, the indices of its rows by position; every position from 0 must be there (the conv and the
    recurrence read all earlier positions of a sample)."""
    by: dict[str, dict[int, int]] = {}
    for i, (s, p) in enumerate(rows):
        by.setdefault(s, {})[p] = i
    out = []
    for s, at in by.items():
        if sorted(at) != list(range(len(at))):
            raise NotReplayable(f"sample {s!r}: the linear attention reads every earlier position, the rows hold "
                                f"positions {min(at)}..{max(at)} with gaps")
        out.append([at[p] for p in range(len(at))])
    return out


def _conv(ref, layer, feeds, rows, tokens):
    """SiLU of the causal depthwise conv1d over each sample's q | k | v channels."""
    q, k, v, _ = ungroup_qkvz(feeds["attn.linear_qkvz"], ref.spec)
    x = torch.cat([q.reshape(len(rows), -1), k.reshape(len(rows), -1), v.reshape(len(rows), -1)], dim=-1)
    w = ref.weights(layer).get("linear_attn.conv1d.weight")[:, 0]          # [channels, K]
    kk = w.shape[1]
    out = torch.empty_like(x)
    for idx in whole_samples(rows):
        xs = torch.cat([x.new_zeros(kk - 1, x.shape[1]), x[idx]])           # zeros before position 0
        y = sum(xs[j:j + len(idx)] * w[:, j] for j in range(kk))
        out[idx] = y * torch.sigmoid(y)
    return out


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (the delta rule's q, k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def delta_rule(q, k, v, beta, g) -> torch.Tensor:
    """One sample's gated delta rule, sequentially: q, k [T, H, dk] (normalised, q scaled), v [T, H, dv],
    beta, g [T, H] -> o [T, H, dv]."""
    state = v.new_zeros(v.shape[1], q.shape[2], v.shape[2])                 # [H, dk, dv]
    outs = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, None, None]
        pred = torch.einsum("hkv,hk->hv", state, k[t])
        state = state + k[t][:, :, None] * ((v[t] - pred) * beta[t][:, None])[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outs)


def _core(ref, layer, feeds, rows, tokens):
    spec, w = ref.spec, ref.weights(layer)
    (hk, hv), (dk, dv) = spec.extra["linear_heads"], spec.extra["linear_dims"]
    x, n = feeds["attn.linear_conv"], len(rows)
    q, k = (x[:, :hk * dk].reshape(n, hk, dk), x[:, hk * dk:2 * hk * dk].reshape(n, hk, dk))
    v = x[:, 2 * hk * dk:].reshape(n, hv, dv)
    q, k = (l2_normalise(t).repeat_interleave(hv // hk, dim=1) for t in (q, k))
    q = q / math.sqrt(dk)
    b, a = ungroup_ba(feeds["attn.linear_ba"], spec)
    g = -torch.exp(w.get("linear_attn.A_log")) * torch.nn.functional.softplus(a + w.get("linear_attn.dt_bias"))
    beta = torch.sigmoid(b)
    out = torch.empty_like(v)
    for idx in whole_samples(rows):
        out[idx] = delta_rule(q[idx], k[idx], v[idx], beta[idx], g[idx])
    return out


def _gated_norm(ref, layer, feeds, rows, tokens):
    """Each value head's RMSNorm (plain weight) times SiLU(z)."""
    x = feeds["attn.linear_core"].reshape(len(rows), ref.spec.extra["linear_heads"][1], -1)
    z = ungroup_qkvz(feeds["attn.linear_qkvz"], ref.spec)[3]
    w = ref.weights(layer).get("linear_attn.norm.weight")
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + ref.spec.rms_norm_eps) * w
    return y * (z * torch.sigmoid(z))


def ops(spec: Any, base: Mapping[str, Callable]) -> dict[str, Callable]:
    """The ops replacing reference._OPS's (`base`) for Qwen3-Next (the same for every spec of it)."""
    ops: dict[str, Callable] = {p: _unit_norm(w, f) for p, (w, f) in NORMS.items()}
    ops.update({"attn.q": _q_half("q"), "attn.gate": _q_half("gate"),
                "attn.core": _gated_attention(base["attn.core"]),
                "attn.out": _attn_out(base["attn.out"]),
                "attn.linear_qkvz": _gemm("linear_attn.in_proj_qkvz.weight", "attn_norm"),
                "attn.linear_ba": _gemm("linear_attn.in_proj_ba.weight", "attn_norm"),
                "attn.linear_conv": _conv, "attn.linear_core": _core, "attn.linear_norm": _gated_norm})
    return ops
