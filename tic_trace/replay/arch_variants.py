"""Clean implementations (and a known fault) of the ops `arch_ops.arch_op_of` names for Gemma2/3 and GPT-OSS,
on a side's own inputs, as variants.py does for the Llama/Qwen family's: each rounds where that
implementation rounds (HF's eager code rounds every elementwise step of a bf16 tensor; fused kernels keep
fp32 and round once), so a point's envelope is what those implementations give on these inputs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .arch_ops import _GEMMA_NORMS, attention_mask, attention_scale, clamped_swiglu, each_sample, oss_expert, sinks_of
from .arch_spec import sliding_window
from .attention_kernels import scaled_gemm
from .act_bf16 import gated_forms
from .variants import Renderings, Variant, VariantInput, _gemm, _norm_variants, _row_parallel, _tp_worst


def _offset_weight(v: VariantInput) -> torch.Tensor:
    return v.spec.extra["norm_offset"] + v.w(_GEMMA_NORMS[v.point])


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


# ---------------------------------------------------------------- MLPs, logits, GPT-OSS's router and experts

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


def _capped_logits(fp32: bool):
    def run(v: VariantInput) -> torch.Tensor:
        head = v.w("lm_head.weight", optional=True)
        head = head if head is not None else v.w("model.embed_tokens.weight")
        cap = v.spec.extra["final_softcap"]
        y = v.feeds["final_norm"].float() @ head.float().T
        y = (torch.tanh(y / cap) * cap).to(v.dtype) if fp32 else torch.tanh(y.to(v.dtype) / cap) * cap
        return y[:, :v.spec.vocab_size]
    return run


def _router(v: VariantInput) -> torch.Tensor:
    return _gemm(v.feeds["mlp_norm"], v.w("mlp.router.weight"), v.dtype, v.w("mlp.router.bias", optional=True))


def _oss_experts(fp32: bool):
    """HF's eager experts in dt (every step rounded, outputs summed in dt), or each expert in fp32 rounded once."""
    def run(v: VariantInput) -> torch.Tensor:
        x, ids, wts, dt = v.feeds["mlp_norm"], v.feeds["moe.topk_ids"].long(), v.feeds["moe.topk_weights"], v.dtype
        a, lim = v.spec.extra["swiglu_alpha"], v.spec.extra["swiglu_limit"]
        lw = v.ref.weights(v.layer)
        out = torch.zeros(x.shape, dtype=dt, device=x.device)
        for e in torch.unique(ids).tolist():
            r, slot = torch.nonzero(ids == e, as_tuple=True)
            gu, gub, dn, dnb = oss_expert(lw, e)
            w = wts[r, slot, None]
            if fp32:
                h = clamped_swiglu(x[r].float() @ gu.float() + gub.float(), a, lim)
                y = ((h @ dn.float() + dnb.float()) * w.float()).to(dt)
            else:
                g = (x[r].to(dt) @ gu.to(dt)) + gub.to(dt)
                h = clamped_swiglu(g, a, lim)
                y = ((h @ dn.to(dt)) + dnb.to(dt)) * w.to(dt)
            out.index_add_(0, r, y)
        return out
    return run


def _arch_variants() -> dict[str, list[Variant]]:
    return {
        "offset_rmsnorm": _norm_variants(None, _offset_weight),
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
        "softcapped_logits": [Variant("eager_cap", "bf16 soft-cap steps", True, _capped_logits(False)),
                              Variant("fp32_cap", "fp32 soft-cap, one rounding", True, _capped_logits(True))],
        "router_bias_gemm": [Variant("fp32_accumulate", "fp32 accumulation", True, _router)],
        "clamped_swiglu_experts": [Variant("eager", "eager experts, every step rounded", True, _oss_experts(False)),
                                   Variant("fp32", "each expert in fp32", True, _oss_experts(True))],
    }


ARCH_VARIANTS: dict[str, list[Variant]] = _arch_variants()
