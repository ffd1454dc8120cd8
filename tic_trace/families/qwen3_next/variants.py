"""Clean implementations (and known faults) of Qwen3-Next's own ops (ops.py), on a side's own inputs, as
replay/variants.py does for the base transformer's: each rounds where that implementation rounds, so a point's
envelope is what those implementations give on these inputs.

- gated attention: each attention kernel of replay/variants.py, then the gate as HF's eager code applies it
  (sigmoid rounded, the product rounded) or fused (fp32 gate and product, one rounding);
- the causal conv: HF's torch fallback (the conv rounded, then SiLU rounded) or a fused conv + SiLU kernel;
- the delta rule: an fp32 state from the 16-bit q, k, v, with beta = sigmoid(b) rounded (HF, and the FLA
  kernels it calls, read beta as the model computed it) or in fp32 (a fused gating kernel); the decay in fp32;
- the gated RMSNorm: HF's (normalised in fp32 and rounded, x weight rounded, x SiLU(z) in fp32, rounded), a
  fused fp32 kernel (one rounding), and the fault without the fp32 upcast.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...replay.variants import Variant, VariantInput, _attention_variants
from .ops import delta_rule, l2_normalise, ungroup_ba, ungroup_qkvz, whole_samples


def _gated(att: Variant, fused: bool) -> Variant:
    def run(v: VariantInput) -> torch.Tensor:
        o, dt = att.fn(v), v.dtype
        gate = v.feeds["attn.gate"].reshape(o.shape[0], -1)
        if fused:
            return (o.float() * torch.sigmoid(gate.float())).to(dt)
        return o.to(dt) * torch.sigmoid(gate.to(dt))
    how = "fp32 gate" if fused else "eager gate"
    return Variant(f"{att.name}_{'fused' if fused else 'eager'}_gate", f"{att.what}, {how}", att.clean, run)


def _gated_attention_variants() -> list[Variant]:
    out = []
    for att in _attention_variants():
        out.append(_gated(att, False))
        if att.clean:
            out.append(_gated(att, True))
    return out


def _conv(fused: bool):
    def run(v: VariantInput) -> torch.Tensor:
        dt, rows = v.dtype, v.rows
        q, k, vv, _ = ungroup_qkvz(v.feeds["attn.linear_qkvz"].to(dt), v.spec)
        x = torch.cat([t.reshape(len(rows), -1) for t in (q, k, vv)], dim=-1).float()
        w = v.w("linear_attn.conv1d.weight")[:, 0].to(dt).float()
        out = torch.empty(x.shape, dtype=dt, device=x.device)
        for idx in whole_samples(rows):
            xs = torch.cat([x.new_zeros(w.shape[1] - 1, x.shape[1]), x[idx]])
            y = F.conv1d(xs.T[None], w[:, None, :], groups=w.shape[0])[0].T     # fp32 accumulation
            out[idx] = F.silu(y).to(dt) if fused else F.silu(y.to(dt).float()).to(dt)
        return out
    return run


def _core(fp32_beta: bool):
    def run(v: VariantInput) -> torch.Tensor:
        spec, dt, n = v.spec, v.dtype, len(v.rows)
        (hk, hv), (dk, dv) = spec.extra["linear_heads"], spec.extra["linear_dims"]
        x = v.feeds["attn.linear_conv"].to(dt).float()
        q, k = x[:, :hk * dk].reshape(n, hk, dk), x[:, hk * dk:2 * hk * dk].reshape(n, hk, dk)
        vv = x[:, 2 * hk * dk:].reshape(n, hv, dv)
        q, k = (l2_normalise(t).repeat_interleave(hv // hk, dim=1) for t in (q, k))
        q = q / math.sqrt(dk)
        b, a = (t.to(dt) for t in ungroup_ba(v.feeds["attn.linear_ba"], spec))
        beta = torch.sigmoid(b.float()) if fp32_beta else torch.sigmoid(b).float()
        g = -torch.exp(v.w("linear_attn.A_log").float()) * F.softplus(a.float() + v.w("linear_attn.dt_bias").to(dt))
        out = torch.empty(vv.shape, dtype=dt, device=x.device)
        for idx in whole_samples(v.rows):
            out[idx] = delta_rule(q[idx], k[idx], vv[idx], beta[idx], g[idx]).to(dt)
        return out
    return run


def _gated_norm(kind: str):
    def run(v: VariantInput) -> torch.Tensor:
        dt, spec, n = v.dtype, v.spec, len(v.rows)
        x = v.feeds["attn.linear_core"].reshape(n, spec.extra["linear_heads"][1], -1).to(dt)
        z = ungroup_qkvz(v.feeds["attn.linear_qkvz"], spec)[3].to(dt)
        w, eps = v.w("linear_attn.norm.weight").to(dt), spec.rms_norm_eps
        if kind == "no_upcast":
            h = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
            return h * F.silu(z)
        xf = x.float()
        h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if kind == "fused":
            return (h * w.float() * F.silu(z.float())).to(dt)
        return ((w * h.to(dt)).float() * F.silu(z.float())).to(dt)
    return run


def variants() -> dict[str, list[Variant]]:
    """By the op's name (`spec.op_of`) or the point's."""
    return {
        "gated_attention": _gated_attention_variants(),
        "attn.linear_conv": [Variant("eager", "conv rounded, then SiLU", True, _conv(False)),
                             Variant("fused", "fused conv + SiLU, one rounding", True, _conv(True))],
        "attn.linear_core": [Variant("fp32_state", "fp32 state, 16-bit beta", True, _core(False)),
                             Variant("fp32_beta", "fp32 state and beta", True, _core(True))],
        "attn.linear_norm": [Variant("eager", "HF: normalised in fp32, x weight rounded, x SiLU(z)", True,
                                     _gated_norm("eager")),
                             Variant("fused", "fused fp32 gated norm, one rounding", True, _gated_norm("fused")),
                             Variant("no_upcast", "no fp32 upcast", False, _gated_norm("no_upcast"))],
    }
