"""Clean implementations of Gemma's own ops (`op_of` names them), on a side's own inputs, as replay/variants.py
does for the base transformer's: each rounds where that implementation rounds (HF's eager code rounds every
elementwise step of a bf16 tensor; fused kernels keep fp32 and round once). Its attention (soft-caps, windows)
and GELU MLP are the core's `attention_ext` / `gated_mlp_act` variants."""
from __future__ import annotations

import torch

from ...replay.variants import Variant, VariantInput, _norm_variants
from .spec import NORMS


def _offset_weight(v: VariantInput) -> torch.Tensor:
    return v.spec.extra["norm_offset"] + v.w(NORMS[v.point])


def _capped_logits(fp32: bool):
    def run(v: VariantInput) -> torch.Tensor:
        head = v.w("lm_head.weight", optional=True)
        head = head if head is not None else v.w("model.embed_tokens.weight")
        cap = v.spec.extra["final_softcap"]
        y = v.feeds["final_norm"].float() @ head.float().T
        y = (torch.tanh(y / cap) * cap).to(v.dtype) if fp32 else torch.tanh(y.to(v.dtype) / cap) * cap
        return y[:, :v.spec.vocab_size]
    return run


def variants() -> dict[str, list[Variant]]:
    return {
        "offset_rmsnorm": _norm_variants(None, _offset_weight),
        "softcapped_logits": [Variant("eager_cap", "bf16 soft-cap steps", True, _capped_logits(False)),
                              Variant("fp32_cap", "fp32 soft-cap, one rounding", True, _capped_logits(True))],
    }
