"""Facts read off SGLang's live modules at trace time for the manifest (never importing SGLang at load): where a
MoE block applies its routed scaling factor, how many shared experts it fused into the routed ones, and which
attention backend ran multi-latent attention's absorbed decode path. The rows that read these facts and the
setups they refuse are the families' (tic_trace/families/<name>/names*.py, refusals.py).
"""
from __future__ import annotations

import sys
from typing import Any


def _routed_scale_in_experts(mlp: Any, in_weights: bool | None) -> bool | None:
    """Whether the experts' output already carries the routed scale, by the flags the block's forward reads
    (None where they do not settle it: aiter on AMD, or a module without them)."""
    ns = sys.modules.get(type(mlp).__module__)
    if in_weights is None or ns is None or not hasattr(ns, "_is_cuda") or getattr(ns, "_use_aiter", False):
        return None
    if in_weights:
        return True
    runner_scales = any(bool(getattr(ns, flag, False)) for flag in ("_is_cuda", "_is_musa", "_is_xpu"))
    kt_wrapper = type(getattr(getattr(mlp, "experts", None), "quant_method", None)).__name__ == "KTEPWrapperMethod"
    return runner_scales and not kt_wrapper


def _first_moe_block(model: Any) -> Any:
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return next((lay.mlp for lay in layers if hasattr(getattr(lay, "mlp", None), "experts")), None)


def fused_shared_facts(model: Any) -> dict:
    """How many shared experts SGLang fused into the routed experts (``num_fused_shared_experts``, the default
    on GPU for DeepSeek-V3 / GLM-4.5 unless ``--disable-shared-experts-fusion``): the experts' output and the
    top-k then hold the shared expert too, and there is no ``shared_experts`` module."""
    mlp = _first_moe_block(model)
    n = getattr(mlp, "num_fused_shared_experts", None) if mlp is not None else None
    return {} if n is None else {"fused_shared_experts": int(n)}


def routed_scale_facts(model: Any, text: Any) -> dict:
    """The routed scale and where SGLang's first MoE block applies it (every block of a model is built alike)."""
    factor = getattr(text, "routed_scaling_factor", None)
    mlp = _first_moe_block(model)
    if factor is None or mlp is None:
        return {}
    cfg = getattr(getattr(mlp, "topk", None), "topk_config", None)
    in_weights = None if cfg is None else bool(getattr(cfg, "apply_routed_scaling_factor_on_output", False))
    return {"routed_scaling_factor": float(factor), "routed_scale_in_weights": in_weights,
            "routed_scale_in_experts": _routed_scale_in_experts(mlp, in_weights)}


def mla_path_facts() -> dict:
    """The attention backend MLA ran on and whether its absorbed path hands the RoPE dims to the kernel apart
    (``attn_mqa(q_nope_out, ..., q_rope=, k_rope=)``, the backends in ``deepseek_common/utils.py``'s
    ``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS``) instead of inside the attention's q and k inputs, where the
    rows read them. None where the trace cannot tell (no server arguments, or a version without that list)."""
    try:
        from sglang.srt.runtime_context import get_server_args
        sa = get_server_args()
    except Exception:  # noqa: BLE001 - outside a server (a model built directly) there are none
        sa = None
    backend = getattr(sa, "decode_attention_backend", None) or getattr(sa, "attention_backend", None)
    try:
        from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS as apart
    except Exception:  # noqa: BLE001 - another SGLang layout: unknown
        apart = None
    return {"mla_decode_backend": backend,
            "mla_rope_apart": None if backend is None or apart is None else backend in apart}
