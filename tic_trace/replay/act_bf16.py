"""A gated MLP's activation evaluated op by op in 16 bits: a known precision fault, in the forms real code writes.

Every engine the replay knows evaluates the activation with one rounding: torch's `F.gelu` / `F.silu` on a bf16
tensor compute in fp32 and round once (HF's `gelu`, `gelu_pytorch_tanh`, `silu`; SGLang's `forward_native`;
megatron-core's unfused `glu`), and the fused act-and-mul kernels round once or twice (SGLang's jit kernel: the
activation in fp32, optionally rounded, times `up` in fp32, rounded; megatron-core's `bias_geglu` /
`bias_swiglu` under `torch.compile`, which keeps the whole expression in fp32). Those are the *clean* variants
(variants.py / fact_variants.py: unfused, fused). The fault is the same formula written as tensor ops and run in
bf16, every step rounded: HF's Python forms (`gelu_new`, `gelu_python_tanh`, `gelu_fast`, `gelu_python`),
SGLang's `NewGELU.forward_native`, megatron-core's fusion functions run without their fuser, a model ported with
the textbook formula. Where the config names one activation (say `gelu_pytorch_tanh`) and a side computes it
op by op, that side has an extra bf16 rounding per step: on a real checkpoint (Gemma-3-270M, layer 9) it sits
inside the clean envelope (1.09x the worst clean variant, docs/replay.md) and is found by this fingerprint.

The forms differ in their order of operations, so each is one rendering (`variants.Renderings`, chosen per row):
- GELU, tanh: `0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3))))` (HF gelu_new / gelu_python_tanh, SGLang
  NewGELU; torch's bf16 `pow(x, 3.0)` rounds like `x * x * x`); the textbook written left to right, `0.044715 *
  x * x * x` (the constant multiplied in first: another rounding order); and `0.5 * x * (1 + tanh(c * x * (1 +
  0.044715 * x * x)))` (HF gelu_fast, megatron-core's bias_gelu / geglu unfused). `x * 0.5` is `0.5 * x` exactly.
- GELU, exact: `x * 0.5 * (1 + erf(x / sqrt(2)))` (HF gelu_python) and `... erf(x * 0.70710678)` (megatron-core).
- SiLU: `x * sigmoid(x)` and `x / (1 + exp(-x))`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

_C = math.sqrt(2.0 / math.pi)


def _tanh_cubed(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * torch.pow(x, 3.0))))


def _tanh_left_to_right(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * x * x * x)))


def _tanh_factored(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_C * x * (1.0 + 0.044715 * x * x)))


def _erf_divided(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _erf_multiplied(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x * 0.70710678))


def _silu_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _silu_exp(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


FORMS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], ...]] = {
    "gelu_pytorch_tanh": (_tanh_cubed, _tanh_left_to_right, _tanh_factored),
    "gelu": (_erf_divided, _erf_multiplied),
    "silu": (_silu_sigmoid, _silu_exp), "swish": (_silu_sigmoid, _silu_exp),
}

WHAT = {"gelu_pytorch_tanh": "GELU (tanh)", "gelu": "GELU", "silu": "SiLU", "swish": "SiLU"}


def op_by_op(act: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """The op-by-op forms of activation `act` (a config's `hidden_act`), each run in its input's dtype; raises
    ValueError for an activation without such a fault (ReLU rounds nothing: the variant does not apply)."""
    forms = FORMS.get(act)
    if forms is None:
        raise ValueError(f"no op-by-op form of {act!r}")
    return forms


def gated_forms(act: str) -> tuple[Callable, ...]:
    """act(gate) * up for each op-by-op form, as `variants._act`'s functions (g, u, dt): the gate and up
    GEMMs' bf16 outputs in, the product rounded."""
    return tuple((lambda f: lambda g, u, dt: f(g.to(dt)) * u.to(dt))(f) for f in op_by_op(act))
