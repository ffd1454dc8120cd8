"""Clean implementations of GPT-OSS's own ops (`op_of` names them), on a side's own inputs, as
replay/variants.py does for the base transformer's: HF's eager experts round every step in the activations'
dtype; a fused kernel keeps fp32 and rounds once. Its attention with sinks is the core's `attention_ext`."""
from __future__ import annotations

import torch

from ...replay.variants import Variant, VariantInput, _gemm
from .ops import clamped_swiglu, oss_expert


def _router(v: VariantInput) -> torch.Tensor:
    return _gemm(v.feeds["mlp_norm"], v.w("mlp.router.weight"), v.dtype, v.w("mlp.router.bias", optional=True))


def _experts(fp32: bool):
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


def variants() -> dict[str, list[Variant]]:
    return {
        "router_bias_gemm": [Variant("fp32_accumulate", "fp32 accumulation", True, _router)],
        "clamped_swiglu_experts": [Variant("eager", "eager experts, every step rounded", True, _experts(False)),
                                   Variant("fp32", "each expert in fp32", True, _experts(True))],
    }
