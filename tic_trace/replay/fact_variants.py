"""Clean implementations (and known faults) of the ops any family computes by its config facts, not by its
model_type (`reference._generic_op_of` names them): attention over sliding windows, with soft-capped scores, a
scale of its own or learned sinks (`attention_ext`: Mistral, the Qwen families' windows, Gemma, GPT-OSS), and a
gated MLP whose activation is not SiLU (`gated_mlp_act`: Gemma's GELU-tanh). As variants.py does for the base
transformer's ops, each rounds where that implementation rounds (HF's eager code rounds every elementwise step of
a bf16 tensor; fused kernels keep fp32 and round once), so a point's envelope is what those implementations give
on these inputs. The replay looks an op up in its family's variants, then here (FACT_VARIANTS), then in
variants.VARIANTS.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .act_bf16 import gated_forms
from .attention_kernels import scaled_gemm
from .attention_ops import attention_mask, attention_scale, each_sample, sinks_of
from .layer_types import sliding_window
from .variants import Renderings, Variant, VariantInput, _gemm, _row_parallel, _tp_worst


# ---------------------------------------------------------------- attention with caps, windows, sinks

def _eager(q, k, v, mask, scale, cap, sinks, dt):
    """HF's eager code in dt: scores, scale and cap each rounded; softmax in fp32 (bf16 with sinks, as
    GPT-OSS's eager code runs it)."""
    s = (q @ k.transpose(-1, -2)) * scale
    if cap:
        s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask, -math.inf)
    if sinks is None:
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(dt) @ v
    sk = sinks.to(dt).reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    c = torch.cat([s, sk], dim=-1)
    c = c - c.amax(-1, keepdim=True)
    return torch.softmax(c, dim=-1, dtype=c.dtype)[..., :-1].to(dt) @ v


def _softmax_bf16(q, k, v, mask, scale, cap, sinks, dt):
    """The fault: the softmax evaluated step by step in dt (max-shift, exp, sum and divide each rounded)."""
    s = (q @ k.transpose(-1, -2)) * scale
    if cap:
        s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(dt).reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)], dim=-1)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    p = e / e.sum(-1, keepdim=True)
    return (p[..., :-1] if sinks is not None else p) @ v


def _fp32(q, k, v, mask, scale, cap, sinks, dt):
    """A fused kernel: scores, cap and softmax statistics in fp32, probabilities rounded before P.V."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if cap:
        s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask, -math.inf)
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float().reshape(1, -1, 1, 1))
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks.float().reshape(1, -1, 1, 1) - m)
    return ((p.to(dt).float() @ v.float()) / den).to(dt)


def _scaled_gemm(q, k, v, mask, scale, cap, sinks, dt):
    return scaled_gemm(q, k, v, mask, scale, dt, cap, sinks)


def _attention(kernel):
    def run(v: VariantInput) -> torch.Tensor:
        q, kk, vv = v.feeds["attn.q_rope"], v.feeds["attn.k_rope"], v.feeds["attn.v"]
        dt, spec = v.dtype, v.spec
        rep = q.shape[1] // kk.shape[1]
        window, sinks = sliding_window(spec, v.layer), sinks_of(v.ref, v.layer)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=dt, device=q.device)
        for qi, qpos, kidx, kpos in each_sample(v.rows, v.feeds["__kv_rows__"], q.device):
            qs = q[qi].to(dt).transpose(0, 1)[None]
            ks = kk[kidx].to(dt).repeat_interleave(rep, dim=1).transpose(0, 1)[None]
            vs = vv[kidx].to(dt).repeat_interleave(rep, dim=1).transpose(0, 1)[None]
            mask = attention_mask(qpos, kpos, window)[None, None]
            o = kernel(qs, ks, vs, mask, attention_scale(spec), spec.extra.get("attn_softcap"), sinks, dt)[0]
            out[qi] = o.transpose(0, 1).reshape(len(qi), -1).to(dt)
        return out
    return run


# ---------------------------------------------------------------- a gated MLP with another activation

_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": torch.relu}


def _gated_act(fused: bool, tp: bool = False):
    """Gemma's GELU MLP: act x up unfused (each rounded) or fused in fp32; `tp`: unfused with a row-parallel
    down_proj at each TP degree the trace allows (variants._tp_worst)."""
    def run(v: VariantInput):
        act = _ACTS[v.spec.hidden_act]
        x, dt = v.feeds["mlp_norm"], v.dtype
        g, u = _gemm(x, v.w("mlp.gate_proj.weight"), dt), _gemm(x, v.w("mlp.up_proj.weight"), dt)
        h = (act(g.float()) * u.float()).to(dt) if fused else act(g) * u
        wd = v.w("mlp.down_proj.weight")
        if tp:
            return _tp_worst(v, lambda k: _row_parallel(h, wd, dt, k))
        return _gemm(h, wd, dt)
    return run


def _gated_act_bf16(v: VariantInput) -> Renderings:
    """The known fault: the activation evaluated op by op in dt, every step rounded (act_bf16.py), one
    rendering per form real code writes it in; x up and down_proj as the unfused MLP."""
    x, dt = v.feeds["mlp_norm"], v.dtype
    g, u = _gemm(x, v.w("mlp.gate_proj.weight"), dt), _gemm(x, v.w("mlp.up_proj.weight"), dt)
    wd = v.w("mlp.down_proj.weight")
    outs = tuple(_gemm(form(g, u, dt), wd, dt) for form in gated_forms(v.spec.hidden_act))
    return Renderings(outs, outs[0].shape[-1])



def _fact_variants() -> dict[str, list[Variant]]:
    return {
        "attention_ext": [Variant("eager", "eager attention", True, _attention(_eager)),
                          Variant("fp32_scores", "fp32 scores and softmax (fused kernel)", True, _attention(_fp32)),
                          Variant("scaled_gemm", "scale inside the score GEMM, fp32 softmax (megatron-core local)",
                                  True, _attention(_scaled_gemm)),
                          Variant("softmax_bf16", "bf16 softmax", False, _attention(_softmax_bf16))],
        "gated_mlp_act": [Variant("unfused", "unfused act x up", True, _gated_act(False)),
                          Variant("fused_act_up", "fused act x up", True, _gated_act(True)),
                          Variant("row_parallel", "row-parallel down_proj", True, _gated_act(False, tp=True),
                                  layouts=True),
                          Variant("act_bf16", "activation evaluated op by op in bf16 (an extra rounding per step)",
                                  False, _gated_act_bf16)],
    }


FACT_VARIANTS: dict[str, list[Variant]] = _fact_variants()
