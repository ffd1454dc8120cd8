"""Measuring a point's variants (variants.py) against one side: the rows they are measured on (`Frame`), the
sweep (`run_variants`; `undeclared_layouts` for the TP degrees the trace does not declare), and the side's
fingerprint and envelope (`fingerprint`). The variants themselves, what each engine computes, are variants.py's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .grid import round_to, row_relative_excess
from .reference import NotReplayable
from .variants import F64, TP_TRIED, TP_UNKNOWN, VARIANTS, Renderings, Variant, VariantInput, _RUN, _Run

STOP_AT_EXACT_CLEAN = True  # run_variants stops at a clean variant bit-equal to the side (False: every one, to
                            # measure each clean side against the worst: benchmarks/calibrate_variants.py)


@dataclass(frozen=True)
class VariantResult:
    name: str
    clean: bool
    what: str
    excess: float               # the variant's error against exact, in units of the rounding floor
    dist: float                 # the side's output's distance from the variant, same units
    equal: float                # share of the side's elements bit-equal to the variant's
    envelope: bool = True       # counts for the envelope (False: an implementation the trace does not declare)
    says: str = ""              # where not: what the trace declares instead ("TP 1"), for the verdict's words


@dataclass(frozen=True)
class Frame:
    """The rows variants are measured on: the exact value `r` and the side's output `yy` ([rows, m] float64),
    the correctly rounded value's error `f0` and its norm (computed once for every variant of a point)."""
    r: np.ndarray
    yy: np.ndarray
    f0: np.ndarray
    floor: float

    def excess(self, v: np.ndarray) -> float:
        """v's excess, as the side's own (IntrinsicError.excess): row-relative, else over all elements."""
        return row_relative_excess(v - self.r, self.f0) or float(np.sqrt(((v - self.r) ** 2).sum())) / self.floor

    def side_excess(self) -> float:
        """The side's own excess on these rows (0.0 where one of its values is not finite)."""
        return self.excess(self.yy) if np.isfinite(self.yy).all() else 0.0


def frame(y: np.ndarray, exact: np.ndarray, dtype: str) -> Frame | None:
    """The frame of these rows (None where the exact value or its rounding floor is 0: nothing to measure)."""
    n = exact.shape[0]
    r = exact.reshape(n, -1)
    f0 = round_to(r, dtype) - r
    floor = float(np.sqrt((f0 ** 2).sum()))
    if floor == 0 or float(np.sqrt((r ** 2).sum())) == 0:
        return None
    return Frame(r, np.asarray(y.reshape(n, -1), dtype=np.float64), f0, floor)


def run_variants(key: str, vin: VariantInput, fr: Frame | None, variants: list[Variant] | None = None,
                 envelope: bool = True, says: str = "") -> list[VariantResult]:
    """Every variant of `key` (a point, or the op replayed: `reference.op_of`) on these inputs, measured
    against the exact value and against the side's output (`fr`, both [rows, ...] of the same rows).
    `variants`: these instead of VARIANTS' (a family's own ops': its variants.py); `envelope`:
    False for results that may name the side but not set its envelope (`undeclared_layouts`), `says` then what
    the trace declares instead."""
    out: list[VariantResult] = []
    if fr is None:
        return out
    token = _RUN.set(_Run(getattr(vin.ref, "store", None)))
    try:
        for var in (variants if variants is not None else VARIANTS.get(key, ())):
            before = len(out)
            _measure(var, vin, fr, envelope, out, says)
            if STOP_AT_EXACT_CLEAN and envelope and any(r.clean and r.dist == 0 for r in out[before:]):
                break       # the side *is* this clean implementation: enough (the comment above _measure)
    finally:
        _RUN.reset(token)
    return out


# Why run_variants stops at the first clean variant that reproduces the side bit for bit (distance 0; HF's
# own ops come first in each list, and a side that runs them matches at the first try): the fingerprint is
# then that variant whatever the others give (nearest first, ties to the earlier: a fault variant can at best
# tie, and FAULT_SEPARATION needs a clean one twice further), and the side is within its envelope whatever the
# others give (its excess is that variant's, the envelope at least that, x VARIANT_OVER). The envelope saved
# is then that variant's excess, not the worst clean one's: the verdict is the same, at a fraction of the cost
# (a trace of a real model's width: benchmarks/bench_replay_real.py).


def _measure(var: Variant, vin: VariantInput, fr: Frame, envelope: bool, out: list, says: str = "") -> None:
    """One variant's output(s) on these inputs, measured against exact and against the side."""
    try:
        got = var.fn(vin)
    except (NotReplayable, NotImplementedError, RuntimeError, ValueError, KeyError, IndexError):
        return              # this implementation does not apply to these inputs (a shape, a missing tensor)
    if isinstance(got, Renderings):
        got = got.nearest(fr.yy)
    n = fr.r.shape[0]
    for suffix, t in (got.items() if isinstance(got, dict) else (("", got),)):
        v = t.to(F64).cpu().numpy().reshape(n, -1)
        if v.shape != fr.r.shape or not np.isfinite(v).all():
            continue
        out.append(VariantResult(var.name + (f"_{suffix}" if suffix else ""), var.clean,
                                 var.what + (f" ({suffix.upper()})" if suffix else ""),
                                 fr.excess(v),
                                 float(np.sqrt(((fr.yy - v) ** 2).sum())) / fr.floor, float((fr.yy == v).mean()),
                                 envelope, says))


def undeclared_layouts(key: str, vin: VariantInput, fr: Frame | None,
                       variants: list[Variant] | None = None) -> list[VariantResult]:
    """The TP-dependent variants at the shard counts of TP_TRIED the trace does not declare: they may name a
    side ("matches row-parallel (TP2); the trace says TP 1") but never widen its envelope, which stays the
    declared degree's. Empty where the trace declares no degree (every one of TP_UNKNOWN is then allowed)."""
    if vin.tp == TP_UNKNOWN:
        return []
    others = tuple(k for k in TP_TRIED if k not in vin.tp)
    chosen = [v for v in (variants if variants is not None else VARIANTS.get(key, ())) if v.layouts]
    if not others or not chosen:
        return []
    return run_variants(key, dataclasses.replace(vin, tp=others), fr, chosen, envelope=False,
                        says=declared_tp(vin.tp))


def declared_tp(tp: tuple[int, ...]) -> str:
    """The degree a trace declares, in words, from `tp_degrees`'s answer."""
    return "TP 1" if not tp else ("no TP degree" if tp == TP_UNKNOWN else f"TP {tp[0]}")


# ---------------------------------------------------------------- the fingerprint

MATCH_DIST = 0.5            # a side "matches" a variant within this distance (rounding-floor units; measured)
FAULT_SEPARATION = 2.0      # a fault match counts only when every clean variant is this many times further


@dataclass(frozen=True)
class Fingerprint:
    clean_excess: float = 0.0   # worst excess of the clean variants on these inputs (0: none ran)
    clean_worst: str = ""       # which clean variant that is
    match: str = ""             # the variant closest to the side's output ("" when none ran)
    match_what: str = ""        # that variant in words
    match_kind: str = ""        # "clean" | "fault" | "none" (no variant within MATCH_DIST)
    match_equal: float = 0.0    # share of the side's elements bit-equal to it
    match_dist: float = 0.0     # the side's distance from it (rounding-floor units)
    clean_dist: float = 0.0     # the side's distance from the nearest clean variant
    match_layout: str = ""      # the match is a TP layout the trace does not declare: what it declares ("TP 1")


def fingerprint(results: list[VariantResult]) -> Fingerprint:
    """The envelope and the best match of one side's output among the variants run on its inputs; the
    envelope from the implementations the trace declares only (`VariantResult.envelope`); where the match is
    another, what the trace declares instead (`match_layout`)."""
    clean = [r for r in results if r.clean]
    if not [r for r in clean if r.envelope]:
        return Fingerprint()
    worst = max((r for r in clean if r.envelope), key=lambda r: r.excess)
    best = min(results, key=lambda r: (r.dist, -r.equal))
    near = min(clean, key=lambda r: (r.dist, -r.equal))
    kind = "none" if best.dist > MATCH_DIST else ("clean" if best.clean else "fault")
    if kind == "fault" and not near.dist > FAULT_SEPARATION * best.dist:
        # the fault and a clean variant are alike on these inputs: no signature, the nearest clean one is named
        best, kind = near, ("clean" if near.dist <= MATCH_DIST else "none")
    layout = (best.says or "another implementation") if kind == "clean" and not best.envelope else ""
    return Fingerprint(worst.excess, worst.name, best.name, best.what, kind, best.equal, best.dist, near.dist,
                       layout)
