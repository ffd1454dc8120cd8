"""Facts read off SGLang's live modules at trace time for the manifest (never importing SGLang at load): where a
MoE block applies its routed scaling factor, how many shared experts it fused into the routed ones, and what a
family says of its own attention (MLA's: which backend ran its absorbed decode path). The rows that read these
facts and the setups they refuse are the families' (tic_trace/families/<name>/names*.py, refusals.py).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Mapping

from tic_trace.families import framework_names


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


def _server_args() -> Any:
    """The running server's arguments (None outside a server: a model built directly has none)."""
    try:
        from sglang.srt.runtime_context import get_server_args
        return get_server_args()
    except Exception:  # noqa: BLE001 - outside a server (a model built directly) there are none
        return None


def _constant_reader(constants: Mapping[str, tuple[str, str]]):
    """A family's reader of the SGLang constants its table names (key -> (module, name)): the value, or None
    where this SGLang lays them out otherwise. Only SGLang's own modules are imported."""
    def constant(key: str) -> Any:
        module, name = constants[key]
        if not module.startswith("sglang."):
            raise ValueError(f"a family's `constants` table names {module!r}: only SGLang's modules are read")
        try:
            return getattr(importlib.import_module(module), name)
        except Exception:  # noqa: BLE001 - another SGLang layout: unknown
            return None
    return constant


def attention_facts(attn: Any) -> dict:
    """What the first family whose attention a layer's live ``self_attn`` module is says of it (the families'
    ``attention_facts`` tables: its ``attention`` kind and the facts its rows and refusals read); {}: the base's
    multi-head attention."""
    for n in framework_names("sglang"):
        hook = n.tables.get("attention_facts")
        facts = hook(attn, _server_args, _constant_reader(n.tables.get("constants", {}))) if hook else {}
        if facts:
            return facts
    return {}
