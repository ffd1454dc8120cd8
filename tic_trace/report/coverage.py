"""What a verdict covered, printed: the report's `coverage` object (built by compare/coverage.py; docs/report.md,
"Coverage") as one line every renderer shows: "points compared N of M", "rows compared N of M", and with a
reference "points replayed N of M", with attribution "tokens attributed N of M"."""
from __future__ import annotations

from typing import Any

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
    rows, cols, sampled = _d(r.get("rows")), _d(r.get("columns")), []
    if rows.get("points_sampled"):      # the finder replays a sample of a long trace's rows (docs/replay.md)
        sampled.append(f"rows replayed {_n(rows.get('replayed'))} of {_n(rows.get('total'))} summed over the points")
    if cols:
        sampled.append(f"logits columns {_n(cols.get('replayed'))} of {_n(cols.get('total'))}")
    if sampled:
        s += f" ({'; '.join(sampled)})"
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
