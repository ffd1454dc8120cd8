"""What a verdict covered, in one typed place: the report's `coverage` object (docs/report.md, "Coverage").

Built once, when the finder makes the report (`build`), from what it measured; kept as saved by the
re-judgement (the points and rows compared do not change with the tolerance); validated on reading back by
store/schema.py (`ReportCoverage`). Every renderer prints it with `coverage_line`: "points compared N of M",
"rows compared N of M", and with a reference "points replayed N of M", with attribution "tokens attributed
N of M". Names are bounded (`NAMED` per list, the rest counted), so the object stays small on any model."""
from __future__ import annotations

from typing import Any, Iterable

NAMED = 16          # names kept per list; the counts cover all of them


def _named(items: list[dict]) -> dict:
    return {"count": len(items), "first": items[:NAMED]}


def build(points: list, not_comparable: list[dict], rows: dict, *, only_a: Iterable[str] = (),
          only_b: Iterable[str] = (), replayed: bool = False, attribution: dict | None = None,
          attribution_budget: int | None = None) -> dict:
    """The `coverage` object of a report. `points` (report Points), `not_comparable` (the report's list),
    `only_a` / `only_b` the canonical point keys one side lacks the other has."""
    only_a, only_b = sorted(set(only_a)), sorted(set(only_b))
    one_sided = set(only_a) | set(only_b)
    compared = [p for p in points if p.status != "not_comparable"]
    judged = {p.key for p in points}
    nc = [{"key": str(d.get("key")), "reason": str(d.get("reason"))} for d in not_comparable
          if isinstance(d, dict) and d.get("key") not in one_sided and d.get("key") not in ("run", "architecture")
          and d.get("key") not in {p.key for p in compared}]
    keys = judged | one_sided | {d["key"] for d in nc}
    out: dict[str, Any] = {"points": {
        "compared": len(compared), "total": len(keys),
        "only_a": _named([{"key": k} for k in only_a]), "only_b": _named([{"key": k} for k in only_b]),
        "not_comparable": _named(nc)}}
    a, b, matched = (int(rows.get(k) or 0) for k in ("a", "b", "matched"))
    ua, ub = int(rows.get("unmatched_a") or 0), int(rows.get("unmatched_b") or 0)
    out["rows"] = {"compared": matched, "total": max(a + ub, b + ua, matched), "only_a": ua, "only_b": ub,
                   "different_tokens": int(rows.get("different_tokens") or 0)}
    if replayed:
        out["replay"] = _replay(compared)
    if attribution is not None:
        out["attribution"] = _attribution(attribution, attribution_budget)
    return out


def _replay(compared: list) -> dict:
    """Points replayed against the reference on both sides, of the compared points (a derived point, computed
    from others by the side's own arithmetic, is replayed through them and counted apart)."""
    done, missing, derived = 0, [], 0
    for p in compared:
        why = [f"{s.upper()}: {e['not_replayed']}" for s, e in sorted((p.intrinsic or {}).items())
               if isinstance(e, dict) and "not_replayed" in e]
        if not p.intrinsic:
            why = ["no replay facts"]
        if why and all(w.split(": ", 1)[-1].startswith("derived") for w in why):
            derived += 1
        elif why:
            missing.append({"key": p.key, "reason": "; ".join(why)})
        else:
            done += 1
    return {"replayed": done, "total": done + len(missing), "derived": derived, "not_replayed": _named(missing)}


def _attribution(att: dict, budget: int | None) -> dict:
    if "unavailable" in att:
        return {"tokens": 0, "total": None, "budget": budget, "unavailable": str(att["unavailable"])[:500]}
    return {"tokens": int(att.get("tokens") or 0), "total": int(att.get("tokens_total") or 0), "budget": budget}


# ------------------------------------------------------------------------------------------------ the line
# Renderers are handed any dict (the CLI checks a saved report first, the Python API does not): every value
# is read through `_n` / `_d` / `_s`, so a malformed one prints as "?" instead of breaking the page.

def _n(v: Any) -> str:
    return str(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else "?"


def _d(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _s(v: Any) -> str:
    return v[:500] if isinstance(v, str) else "?"


def _count(d: dict) -> int:
    c = d.get("count")
    return c if isinstance(c, int) and not isinstance(c, bool) and c > 0 else 0


def _names(d: dict, k: int = 3) -> str:
    first = d.get("first")
    names = [_s(x.get("key")) for x in first if isinstance(x, dict)][:k] if isinstance(first, list) else []
    more = _count(d) - len(names)
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")


def _points_text(p: dict) -> str:
    s = f"points compared {_n(p.get('compared'))} of {_n(p.get('total'))}"
    parts = [f"{_count(_d(p.get(k)))} {what}: {_names(_d(p.get(k)))}"
             for k, what in (("only_a", "only on side A"), ("only_b", "only on side B"),
                             ("not_comparable", "not comparable")) if _count(_d(p.get(k)))]
    return s + (f" ({'; '.join(parts)})" if parts else "")


def _rows_text(r: dict) -> str:
    parts = [f"{_n(r.get(k))} {what}" for k, what in (("only_a", "only side A has"), ("only_b", "only side B has"),
                                                      ("different_tokens", "with different tokens")) if r.get(k)]
    return (f"rows compared {_n(r.get('compared'))} of {_n(r.get('total'))}"
            + (f" ({', '.join(parts)})" if parts else ""))


def _replay_text(r: dict) -> str:
    nr = _d(r.get("not_replayed"))
    s = f"points replayed {_n(r.get('replayed'))} of {_n(r.get('total'))}"
    if _count(nr):
        s += f" (not replayed: {_names(nr)})"
    return s + (f", {_n(r['derived'])} derived" if r.get("derived") else "")


def _attribution_text(a: dict) -> str:
    budget = f"budget {_n(a['budget'])}" if a.get("budget") is not None else "the default budget"
    if a.get("unavailable"):
        return f"tokens attributed 0 ({budget}: {_s(a['unavailable'])})"
    return f"tokens attributed {_n(a.get('tokens'))} of {_n(a.get('total'))} ({budget})"


def coverage_line(report: Any) -> str | None:
    """The report's coverage as one plain-text line ("covered: points compared 30 of 32 (…); rows compared
    …"), or None for a report without one (saved before coverage was reported). Never raises."""
    cov = report.get("coverage") if isinstance(report, dict) else None
    if not isinstance(cov, dict):
        return None
    parts = [fn(cov[k]) for k, fn in (("points", _points_text), ("rows", _rows_text), ("replay", _replay_text),
                                      ("attribution", _attribution_text)) if isinstance(cov.get(k), dict)]
    return "covered: " + "; ".join(parts) if parts else None
