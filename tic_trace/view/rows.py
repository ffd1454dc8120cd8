"""Row identity: what two sides' row tables say about each other before any tensor is read.

A row is a (sample key, position) pair; each side's view records the token it held and how often the side
named it. `row_identity` pairs two views' tables: rows named twice, rows whose tokens differ (and the causal
rows after them), rows of one side that match nothing on the other. Where both traces kept their rows by the same row subset
(graph/row_subset.py, `tracer.row_subset` in both manifests), a row one side alone names that the rule drops is
no unmatched row: its side wrote nothing for a pass that held no kept row (SGLang's decode steps, docs/drift.md),
and nothing of it would be compared anyway; a row the rule keeps that one side lacks is still unmatched. The finder leaves the excluded rows out of
every point and turns the rest into the report's row notes (compare/verdict.py; docs/report.md "Rows").
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from ..graph.canonical import LOGPROBS
from ..graph.row_subset import RowSubset, shared_subset
from .align import CanonicalView, RowId
from .passes import pass_label, split_key

ROWS_NAMED = 8          # rows listed by name in the report (the counts cover all of them)


def _sample_order(key: str) -> tuple:
    """Sample keys in a natural order (s2 before s10)."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", str(key)) if t)


def _row_order(row: RowId) -> tuple:
    return (_sample_order(row[0]), row[1])


@dataclass
class RowIdentity:
    """What the two sides' row tables say about each other, before any tensor: which rows are the same
    rows (same sample key, position and token), which are not, and why.

    A row is compared only if both sides name it once and it holds the same token on both, and so does every
    earlier position of its sample that both sides have: a causal model's row at position p is computed from
    the tokens at 0..p, so after a differing token the sample's later rows are other rows too."""
    excluded: frozenset = frozenset()      # rows both sides have that are not compared (tokens, duplicates)
    # [(row, token A, token B)] where the tokens differ: each sample's first, then the rest
    different: list = field(default_factory=list)
    n_different: int = 0                   # rows both have whose own token differs
    duplicates: dict = field(default_factory=dict)  # "a"/"b" -> {row: times named}
    # "a"/"b" -> {"count", "other_samples", "outside", "inside", "first"} (see _unmatched)
    unmatched: dict = field(default_factory=dict)
    # "a"/"b" -> rows of that side alone that the row subset both sides recorded drops (not unmatched)
    dropped: dict = field(default_factory=dict)
    # passes over the same rows (view/passes.py): {"by", "a": {label: rows}, "b": {...}, "matched": {label: rows
    # both sides have and compare}}; empty where each side traced every row once
    passes: dict = field(default_factory=dict)

    def exclude_for(self, point: str) -> frozenset:
        """The rows not to compare at `point`. A log-prob row p scores the token at p+1: left out too when
        that row is."""
        if point != LOGPROBS or not self.excluded:
            return self.excluded
        return self.excluded | {(k, p - 1) for k, p in self.excluded}

    def counts(self) -> dict:
        """The counts the report's `rows` holds next to a, b and matched (docs/report.md)."""
        um = self.unmatched
        return {"unmatched_a": int((um.get("a") or {}).get("count", 0)),
                "unmatched_b": int((um.get("b") or {}).get("count", 0)),
                "excluded": len(self.excluded), "different_tokens": self.n_different,
                "duplicates_a": len(self.duplicates.get("a") or {}),
                "duplicates_b": len(self.duplicates.get("b") or {})}

    def to_json(self) -> dict:
        """The report's `identity`: the rows behind the counts, the first few by name (docs/report.md)."""
        def named(rows: dict) -> list[dict]:
            return [{"sample": k, "position": p, "times": n}
                    for (k, p), n in sorted(rows.items(), key=lambda kv: _row_order(kv[0]))[:ROWS_NAMED]]
        empty = {"count": 0, "other_samples": 0, "outside": 0, "inside": 0, "first": []}
        extra = {"passes": self.passes} if self.passes else {}
        return {**extra, "unmatched": {s: dict(self.unmatched.get(s) or empty) for s in ("a", "b")},
                "different_tokens": [{"sample": r[0], "position": r[1], "token_a": ta, "token_b": tb}
                                     for r, ta, tb in self.different[:ROWS_NAMED]],
                "duplicates": {s: named(self.duplicates.get(s) or {}) for s in ("a", "b")}}


def row_identity(va: CanonicalView, vb: CanonicalView) -> RowIdentity:
    """The RowIdentity of side A `va` against side B `vb`: computed once per pair of views, from the row
    tables the views indexed (no tensor), so that every point (in this process or a worker that reopened
    the views) leaves out the same rows."""
    got = va._identity
    if got is not None and got[0] is vb:
        return got[1]
    ident = _row_identity(va, vb)
    va._identity = (vb, ident)
    return ident


def _row_identity(va: CanonicalView, vb: CanonicalView) -> RowIdentity:
    ra, rb = va.row_ids, vb.row_ids
    common = ra & rb
    dup = {"a": dict(va.duplicate_rows), "b": dict(vb.duplicate_rows)}
    excluded = {r for r in common if r in dup["a"] or r in dup["b"]}
    by_sample: dict[str, list[int]] = defaultdict(list)
    for k, p in common:
        by_sample[k].append(p)
    different = []
    for k, positions in by_sample.items():
        first = None
        for p in sorted(positions):
            ta, tb = va.tokens.get((k, p)), vb.tokens.get((k, p))
            if ta is not None and tb is not None and ta != tb:
                different.append(((k, p), int(ta), int(tb)))
                if first is None:
                    first = p
        if first is not None:
            excluded.update((k, p) for p in positions if p >= first)
    # each sample's first differing row leads (where its rows stop being the same rows), then the others
    firsts = {}
    for d in different:
        k, pos = d[0]
        if k not in firsts or pos < firsts[k]:
            firsts[k] = pos
    different.sort(key=lambda d: (firsts[d[0][0]] != d[0][1], _row_order(d[0])))
    subset = shared_subset(va.trace.manifest, vb.trace.manifest)
    alone = {"a": _not_dropped(ra - common, subset), "b": _not_dropped(rb - common, subset)}
    return RowIdentity(frozenset(excluded), different, len(different), dup,
                       {"a": _unmatched(alone["a"], rb), "b": _unmatched(alone["b"], ra)},
                       {"a": len(ra - common) - len(alone["a"]), "b": len(rb - common) - len(alone["b"])},
                       _passes(va, vb, common - excluded))


def _passes(va: CanonicalView, vb: CanonicalView, compared: set) -> dict:
    """Per-pass coverage where a side traced the same rows more than once (or passes are matched by tag):
    each side's rows per pass, and the rows both have per pass (view/passes.py)."""
    if set(va.passes) <= {"1"} and set(vb.passes) <= {"1"} and va.passes_by == vb.passes_by == "order":
        return {}
    matched: dict[str, int] = {}
    for k, _p in compared:
        lab = pass_label(va.passes_by, k)
        matched[lab] = matched.get(lab, 0) + 1
    labels = sorted(set(va.passes) | set(vb.passes), key=_sample_order)
    return {"by": va.passes_by, "a": dict(va.passes), "b": dict(vb.passes),
            "matched": {lab: matched.get(lab, 0) for lab in labels}}


def _not_dropped(rows: set, subset: RowSubset | None) -> set:
    """Of one side's rows the other lacks, those the shared row subset keeps (all of them without one)."""
    if subset is None:
        return rows
    return {r for r in rows if subset.keeps(split_key(r[0])[0], r[1])}   # the key the tracer kept rows by


def _unmatched(mine: set, theirs: set) -> dict:
    """Rows of one side (`mine`: those no row of the other side has) by what that says: a sample the other side
    did not trace (`other_samples`); a position before or after every position the other side traced for the sample
    (`outside`: a cached prefix, a last token never fed back); a position inside that span (`inside`: the
    sides number this sample's rows differently)."""
    span: dict[str, tuple[int, int]] = {}
    for k, p in theirs:
        lo, hi = span.get(k, (p, p))
        span[k] = (min(lo, p), max(hi, p))
    out = {"count": 0, "other_samples": 0, "outside": 0, "inside": 0, "first": []}
    inside, outside = [], []
    for row in mine:
        out["count"] += 1
        s = span.get(row[0])
        if s is None:
            out["other_samples"] += 1
        elif s[0] <= row[1] <= s[1]:
            out["inside"] += 1
            inside.append(row)
        else:
            out["outside"] += 1
            outside.append(row)
    shown = sorted(inside, key=_row_order)[:ROWS_NAMED] or sorted(outside, key=_row_order)[:ROWS_NAMED]
    out["first"] = [f"{k}@{p}" for k, p in shown]
    return out
