"""The clean-implementation noise of a model's log-probs: the gap two clean implementations of the same model
give on the same tokens, for the attribution to say whether a pair's gap is within it (issue 34 item 5).

Two clean forwards of the exact model (`exact_model.run_exact`, side A's weights, its routing), each point's
output replaced before the next point reads it:
- **correctly rounded**: the exact op on this run's own inputs, rounded to the dtype side A computed the point
  in (the ideal implementation of that dtype);
- **the envelope's worst clean**: at every point with clean variants (variants.py: eager / SDPA / flash
  attention, HF / Megatron norms, fp32 / bf16 top-k weights, TP splits, ...), the clean variant on this run's
  own inputs farthest from the correctly rounded value; elsewhere the correctly rounded value.
The noise is Σ_t |lp_2,t − lp_1,t| over the tokens the gap sums: the same sum, the same tokens. It is a finite
step, not first order: every later op rounds its differing inputs differently, as a real clean pair does.
Limits (docs/attribution.md): one pair of clean implementations, not the worst pair; routing is held at side
A's choice (a clean pair can also route a token differently); ops between canonical points run exactly.
"""
from __future__ import annotations

from typing import Callable

import torch

from .exact_model import Key, RowId, run_exact
from .intrinsic import SideReplayer
from .reference import F64, NotReplayable
from .fact_variants import FACT_VARIANTS
from .variants import DTYPES, Renderings, VariantInput, VARIANTS

HOW = ("two clean forwards of the exact model on these tokens (side A's weights and routing): every point "
       "correctly rounded to side A's dtype, against every point by the clean variant farthest from that "
       "(eager/SDPA attention, HF/Megatron norms, ...); Σ|Δ logprob| between them, a finite step")
_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def clean_noise(side: SideReplayer, points: list[Key], rows: list[RowId], tokens: dict[RowId, int],
                n_layers: int, routing: dict, lp_rows: list[RowId], dtypes: dict[Key, str]) -> dict:
    """`{measured: true, gap, how}`, or `{measured: false, why}` where the two forwards cannot be run.
    `dtypes`: the dtype side A computed each point in (a point absent runs exactly in both forwards)."""
    try:
        with torch.no_grad():
            lp = [_logprobs(run_exact(side.ref, points, rows, tokens, n_layers, routing, side.has_qk_norm,
                                      post=_post(side, dtypes, worst, rows)), lp_rows) for worst in (False, True)]
    except Exception as e:  # noqa: BLE001 - an estimate beside the answer never breaks the attribution
        return {"measured": False, "why": f"not measured: the clean forwards failed ({type(e).__name__}: "
                                          f"{str(e)[:200]})"}
    gap = float((lp[1] - lp[0]).abs().sum())
    return {"measured": True, "gap": gap, "how": HOW}


def _logprobs(run, lp_rows: list[RowId]) -> torch.Tensor:
    where = {r: i for i, r in enumerate(run.logprob_rows)}
    lp = run.values[("logprobs", None)].reshape(-1)
    return lp[torch.tensor([where[r] for r in lp_rows if r in where], dtype=torch.long, device=lp.device)]


def _post(side: SideReplayer, dtypes: dict[Key, str], worst: bool, rows: list[RowId]) -> Callable:
    def post(key: Key, feeds: dict, y: torch.Tensor) -> torch.Tensor:
        dt = dtypes.get(key)
        if dt not in _TORCH or not y.is_floating_point():
            return y
        rounded = y.to(_TORCH[dt]).to(F64)
        if not worst or dt not in DTYPES:
            return rounded
        return _worst_clean(side, key, feeds, rows, rounded, dt)
    return post


def _worst_clean(side: SideReplayer, key: Key, feeds: dict, rows: list[RowId], rounded: torch.Tensor,
                 dt: str) -> torch.Tensor:
    """The clean variant of the op at `key` on these inputs farthest from the correctly rounded value (that
    value where the op has none, or none applies to these inputs)."""
    point, layer = key
    op = side.ref.op_of(point, layer) or point
    variants = [v for v in (side.ref.family.variants().get(op) or FACT_VARIANTS.get(op) or VARIANTS.get(op) or ())
                if v.clean]
    vin = VariantInput(side.ref, layer, feeds, rows, DTYPES[dt], side.tp, point=point)
    best, far = rounded, 0.0
    for var in variants:
        try:
            got = var.fn(vin)
        except (NotReplayable, NotImplementedError, RuntimeError, ValueError, KeyError, IndexError):
            continue
        if isinstance(got, Renderings):
            continue
        for t in (got.values() if isinstance(got, dict) else (got,)):
            v = t.to(F64).reshape(rounded.shape) if t.numel() == rounded.numel() else None
            if v is None or not bool(torch.isfinite(v).all()):
                continue
            d = float(((v - rounded) ** 2).sum())
            if d > far:
                best, far = v, d
    return best

