"""What a verdict covered: the report's `coverage` object, built once when the finder makes the report
(docs/report.md, "Coverage"); `report/coverage.py` prints it.

Built from what the finder measured; kept as saved by the re-judgement (the points and rows compared do not
change with the tolerance); validated on reading back by store/report_doc.py (`ReportCoverage`). Names are
bounded (`NAMED` per list, the rest counted), so the object stays small on any model."""
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
    from others by the side's own arithmetic, is replayed through them and counted apart); the rows they were
    replayed on, of the rows they have, summed over them (the finder replays a sample of a long trace's rows:
    replay/replay_rows.py), and the logits' vocabulary columns where a sample of them was replayed."""
    done, missing, derived = 0, [], 0
    rows, columns = {"replayed": 0, "total": 0, "points_sampled": 0}, {"replayed": 0, "total": 0}
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
            _add_sampled(rows, columns, [e for e in p.intrinsic.values() if isinstance(e, dict)])
    out = {"replayed": done, "total": done + len(missing), "derived": derived, "not_replayed": _named(missing),
           "rows": rows}
    if columns["total"]:
        out["columns"] = columns
    return out


def _count(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _add_sampled(rows: dict, columns: dict, sides: list[dict]) -> None:
    """One replayed point's rows (and sampled columns), both sides': the fewer replayed, of the more there were."""
    got = [_count(e.get("rows")) for e in sides]
    had = [_count(e.get("rows_total")) or _count(e.get("rows")) for e in sides]
    rows["replayed"] += min(got, default=0)
    rows["total"] += max(had, default=0)
    rows["points_sampled"] += any(_count(e.get("rows_total")) for e in sides)
    cols = [(_count(e.get("columns")), _count(e.get("columns_total"))) for e in sides if _count(e.get("columns"))]
    if cols:
        columns["replayed"] += min(c for c, _ in cols)
        columns["total"] += max(t for _, t in cols)


def _attribution(att: dict, budget: int | None) -> dict:
    if "unavailable" in att:
        return {"tokens": 0, "total": None, "budget": budget, "unavailable": str(att["unavailable"])[:500]}
    return {"tokens": int(att.get("tokens") or 0), "total": int(att.get("tokens_total") or 0), "budget": budget}
