"""Plain-text forms of a report's `attribution` (which difference explains how much of the log-prob gap),
printed by the terminal and the HTML page alike. Renderers get any report: malformed parts are skipped."""
from __future__ import annotations

import math
from typing import Any

from .schema import num

SHOWN = 5          # contributors listed (the JSON has all of them)


def _pct(x: Any) -> str:
    v = num(x) if isinstance(x, str) else x
    return "?" if not isinstance(v, (int, float)) else f"{100 * v:.0f}%"


def attribution_of(report: dict) -> dict | None:
    a = report.get("attribution") if isinstance(report, dict) else None
    return a if isinstance(a, dict) else None


def attribution_lines(report: dict) -> list[str]:
    """The answer line, the top contributors, the groups by op and the self-check, as text lines."""
    att = attribution_of(report)
    if att is None:
        return []
    if "unavailable" in att:
        return [f"attribution: not made — {att.get('unavailable')}"]
    gap, tokens = num(att.get("gap")), att.get("tokens")
    head = f"attribution of Σ|Δ logprob| = {gap:.3g} over {tokens} tokens" if isinstance(gap, float) else "attribution"
    head += _within(att, gap)
    if isinstance(att.get("withheld"), str) and att["withheld"]:
        return [f"{head}: shares withheld — {att['withheld']}",
                f"  explained {_pct(att.get('explained'))} of the gap at first order (the measured terms are in "
                "the JSON's by_point, for reading)"]
    shares = {s.get("key"): s for s in _shares(att)}
    first = att.get("first")
    out = []
    if first in shares:
        s = shares[first]
        out.append(f"{head}: {first} explains {_pct(s.get('share_total'))} — measured: its own error "
                   f"{_pct(s.get('share'))}; credited by a heuristic: the clean ops after it "
                   f"{_pct(s.get('share_downstream'))} — the first significant difference in dataflow order")
        own, total = _val(s.get("share")), _val(s.get("share_total"))
        if own is not None and total and abs(own) < 0.5 * abs(total):
            out.append(f"  note: {first}'s own measured share is {_pct(own)}: most of what it is credited is the "
                       "clean ops after it, by the heuristic, not measured at it")
    else:
        out.append(f"{head}: no finding explains {_pct(att.get('threshold'))} or more; clean ops' rounding noise "
                   f"{_pct(att.get('noise'))}")
    routed = {s.get("key") for s in att.get("routing") or [] if isinstance(s, dict)}
    for k in [k for k in att.get("top") or [] if k in shares][:SHOWN]:
        s = shares[k]
        why = (f"{s.get('rows')} token(s) on other experts, their layer recomputed with each side's choice"
               if k in routed else f"measured own {_pct(s.get('share'))}: A {_pct(s.get('share_a'))}, "
                                   f"B {_pct(s.get('share_b'))} of the own-error terms")
        out.append(f"  {k:<24} {_pct(s.get('share_total')):>5}  ({why})")
    kinds = [k for k in att.get("by_kind") or [] if isinstance(k, dict)][:SHOWN]
    if kinds:
        out.append("  by op: " + ", ".join(f"{k.get('kind')} {_pct(k.get('share'))}" for k in kinds))
    out.append(f"  explained {_pct(att.get('explained'))} of the gap at first order, residual {_pct(att.get('residual'))}"
               + (f"; {len(att.get('not_attributed') or [])} point(s) not attributed" if att.get("not_attributed") else ""))
    if isinstance(att.get("credit"), str):
        out.append(f"  credited: {att['credit']}")
    out.append("  clean-implementation noise of this model: " + _clean_noise(att, gap))
    out += [f"  note: {n}" for n in att.get("notes") or [] if isinstance(n, str)]
    return out


def _val(x: Any) -> float | None:
    v = num(x) if isinstance(x, str) else x
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _noise_of(att: dict, gap: Any) -> float | None:
    """The measured clean-implementation noise (`clean_noise.gap`), where the report has one and a gap."""
    cn = att.get("clean_noise") if isinstance(att.get("clean_noise"), dict) else {}
    est = _val(cn.get("gap"))
    ok = est is not None and math.isfinite(est) and est >= 0          # a saved report is read untrusted
    return est if cn.get("measured") is True and ok and isinstance(gap, float) else None


def _within(att: dict, gap: Any) -> str:
    """The answer line's words on the clean noise: '' where it was not measured."""
    est = _noise_of(att, gap)
    if est is None:
        return ""
    return (f", within this model's clean-implementation noise ({est:.3g})" if gap <= est
            else f", above this model's clean-implementation noise ({est:.3g})")


def _clean_noise(att: dict, gap: Any) -> str:
    """Whether the gap is within this model's clean-implementation noise: from a measured estimate where the
    report has one (`clean_noise.gap`), else said to be not measured."""
    cn = att.get("clean_noise") if isinstance(att.get("clean_noise"), dict) else {}
    est = _noise_of(att, gap)
    if est is not None:
        how = f" ({cn['how']})" if isinstance(cn.get("how"), str) else ""
        if gap <= est:
            return (f"a clean pair's Σ|Δ logprob| on these tokens is {est:.3g}: this gap ({gap:.3g}) is within it — "
                    f"its size alone does not tell a fault from a change between clean implementations{how}")
        return f"a clean pair's Σ|Δ logprob| on these tokens is {est:.3g}: this gap ({gap:.3g}) is above it{how}"
    why = cn.get("why") if isinstance(cn.get("why"), str) else "not measured"
    return why


def _shares(att: dict) -> list[dict]:
    return [s for s in (att.get("by_point") or []) + (att.get("routing") or []) if isinstance(s, dict)]


def kind_layer_bars(att: dict) -> dict[str, dict]:
    """share per op kind per layer ({kind: {layer label: share}}), for the HTML page's bars."""
    from ..graph.canonical import BY_NAME
    out: dict[str, dict] = {}
    for s in _shares(att):
        spec = BY_NAME.get(s.get("point"))
        kind = "routing" if s in (att.get("routing") or []) else (spec.op if spec is not None else str(s.get("point")))
        layer = s.get("layer")
        label = "global" if layer is None else f"L{layer}"
        v = num(s.get("share")) if isinstance(s.get("share"), str) else s.get("share")
        if isinstance(v, (int, float)):
            out.setdefault(kind, {})
            out[kind][label] = out[kind].get(label, 0.0) + float(v)
    return out
