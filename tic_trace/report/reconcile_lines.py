"""Plain-text form of a report's `reconciliation` (slime's train_rollout_logprob_abs_diff split into parts:
compare/reconcile.py, docs/reconcile.md), printed by the terminal and the HTML page alike. Renderers get any
report: malformed parts are skipped, never raised on."""
from __future__ import annotations

import math
from typing import Any

from .schema import num

METRIC = "train_rollout_logprob_abs_diff"
NOTES_SHOWN = 5
_LABEL = {"routing_replay": "routing replay"}


def reconciliation_of(report: Any) -> dict | None:
    r = report.get("reconciliation") if isinstance(report, dict) else None
    return r if isinstance(r, dict) else None


def _g(x: Any) -> str:
    v = num(x)
    return "-" if v is None else ("0" if v == 0 else f"{v:.3g}" if math.isfinite(v) else str(v))


def _pct(x: Any) -> str:
    v = num(x)
    if v is None or not math.isfinite(v):
        return "-"
    t = f"{100 * v:.0f}"
    return ("0" if t == "-0" else t) + "%"


def parts_of(rec: dict) -> list[dict]:
    return [p for p in rec.get("parts") or [] if isinstance(p, dict) and isinstance(p.get("name"), str)]


def headline(rec: dict) -> str:
    """The metric, where it was measured, and its causes (the significant parts with their shares)."""
    if "unavailable" in rec:
        return f"reconciliation of slime's {METRIC}: not made — {rec.get('unavailable')}"
    logged = num(rec.get("recorded"))
    head = (f"slime's {METRIC} = {_g(rec.get('metric'))} nats over {rec.get('samples')} traced samples "
            f"({rec.get('rows')} rows" + (f"; slime logged {_g(logged)}" if logged is not None else "") + ")")
    causes = [p for p in parts_of(rec) if p.get("significant")]
    if causes:
        return head + ": " + ", ".join(f"{_LABEL.get(p['name'], p['name'])} {_pct(p.get('share'))}" for p in causes)
    return head + f": no cause (every part under {_g(rec.get('tol'))} nats or 5% of the metric)"


def part_line(p: dict) -> str:
    name = _LABEL.get(p["name"], p["name"])
    line = f"  {name:<15} {_g(p.get('value')):>9} {_pct(p.get('share')):>5}  {p.get('rows')} rows"
    if p.get("significant"):
        line += f" — {p.get('summary')}"
    if p.get("state"):
        line += f" — {p.get('state')}"
    if p.get("missing"):
        line += f" — not measured: {p.get('missing')}"
    return line


def side_lines(rec: dict) -> list[str]:
    """Each side's fingerprint; a side whose samples state several sampling parameters, one line per group."""
    sides = rec.get("sides") if isinstance(rec.get("sides"), dict) else {}
    out = []
    for k, v in sorted(sides.items()):
        if not isinstance(v, dict) or not v.get("summary"):
            continue
        out.append(f"  {k.upper()}: {v.get('summary')}")
        groups = v.get("groups") if isinstance(v.get("groups"), list) else []
        out += [f"    {k.upper()} [{g.get('stated')}; {g.get('samples')} sample{'' if g.get('samples') == 1 else 's'}]: "
                f"{g.get('summary')}"
                for g in groups if isinstance(g, dict) and g.get("summary")]
    return out


def reconciliation_lines(report: dict) -> list[str]:
    """The headline, one line per part (its summary where it is a cause or could not be measured), each
    side's semantics fingerprint, and the notes on coverage."""
    rec = reconciliation_of(report)
    if rec is None:
        return []
    if "unavailable" in rec:
        return [headline(rec)]
    out = [headline(rec), *(part_line(p) for p in parts_of(rec)), *side_lines(rec)]
    notes = [str(n) for n in rec.get("notes") or []]
    out += [f"  note: {n}" for n in notes[:NOTES_SHOWN]]
    if len(notes) > NOTES_SHOWN:
        out.append(f"  … {len(notes) - NOTES_SHOWN} more notes in the JSON report")
    if rec.get("covered"):
        out.append(f"  ({rec['covered']})")
    return out
