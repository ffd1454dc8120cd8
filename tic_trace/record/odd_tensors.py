"""Tensors that are not plain dense strided tensors: what the tracer records for them, or the note that names
them. None of them may disable tracing for a pass or make a trace unreadable (issue 10, item 4).

| tensor | recorded as | note |
|---|---|---|
| zero-size (an expert that got no tokens) | itself: statistics of nothing, an empty value | — |
| complex | its real view `[..., 2]` (statistics and hash were always taken over (re, im) pairs); `extra.complex` names the dtype | yes |
| quantized (`quint8`, ...) | its integer representation; `extra` holds the dtype, scheme and per-tensor scale/zero point | yes |
| subclass without its own `__torch_dispatch__` | the plain tensor it is (same storage) | yes |
| wrapper subclass (DTensor, float8 wrappers, ...) | not recorded; the ops on its inner tensors are | yes |
| sparse, sparse CSR/CSC/BSR, nested, meta | not recorded (no dense values to compare; densifying could exceed memory) | yes |
| lazily negated or conjugated view (`c.conj().imag`, `c.conj()`) | a resolved copy: the values it reads as (its bits are not) | — |
"""
from __future__ import annotations

import torch

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)


def recordable(t: torch.Tensor) -> tuple[torch.Tensor | None, str | None, dict]:
    """(tensor to record or None, note for the pass or None, extras for the record)."""
    if type(t) in _PLAIN_TYPES and t.layout == torch.strided and not t.is_nested and not t.is_quantized \
            and not t.is_complex() and t.device.type != "meta" and not t.is_neg():
        return t, None, {}                     # the common case, in seven attribute reads
    kind = type(t).__name__
    if type(t) not in _PLAIN_TYPES:
        if getattr(type(t), "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
            return None, (f"tensor subclass {kind} not recorded (a wrapper subclass: the ops on its inner "
                          "tensors are recorded)"), {}
        with torch._C.DisableTorchFunctionSubclass():
            t = t.as_subclass(torch.Tensor)
        inner, note, extra = recordable(t)
        return inner, note or f"tensor subclass {kind} recorded as the plain tensor it holds", extra
    if t.is_nested or t.layout != torch.strided:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        return None, (f"{layout} tensors not recorded (no dense values; densify before the module returns "
                      "to trace them)"), {}
    if t.device.type == "meta":
        return None, "meta tensors not recorded (they have no values)", {}
    if t.is_quantized:
        return _quantized(t)
    if t.is_neg() or t.is_conj():
        # Its memory holds the values before the lazy negation: neither a bit view nor numpy can read it.
        t = t.resolve_conj().resolve_neg()
        if not t.is_complex():
            return t, None, {}
    name = str(t.dtype).removeprefix("torch.")
    return torch.view_as_real(t), f"{name} tensors recorded as their real view [..., 2] (extra.complex)", \
        {"complex": name}


def _quantized(t: torch.Tensor) -> tuple[torch.Tensor, str, dict]:
    name = str(t.dtype).removeprefix("torch.")
    scheme = t.qscheme()
    extra: dict = {"quantized": name, "qscheme": str(scheme).removeprefix("torch.")}
    if scheme in _PER_TENSOR:
        extra.update(scale=float(t.q_scale()), zero_point=int(t.q_zero_point()))   # host-side values
    return t.int_repr(), f"quantized tensors ({name}) recorded as their integer representation (extra)", extra
