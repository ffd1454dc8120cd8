"""One side's semantics fingerprint per group of rows sharing the side's own stated sampling parameters
(compare/reconcile.py, issue 37; docs/reconcile.md).

A side whose samples state different parameters (requests at two temperatures, some with top-p) used different
semantics on different rows: one fit over all of them would match neither. Each group is fingerprinted on its own
rows against the candidates its own statement and the other side's statements for the same samples make, and the
split uses, per row, the semantics of that row's group. A side with one group reads exactly as one fingerprint.
numpy only (tests/test_architecture.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..store.used_logprobs import Sampling
from .logprob_semantics import Semantics, SemanticsMatch, fingerprint

_WORST = ("none", "ambiguous", "not_measured", "match")     # a side's verdict is its worst group's


def stated_key(s: Sampling) -> tuple:
    """The parameters a statement makes (off values in one form: top_k -1 and 0 are both off)."""
    k = None if s.top_k is None else max(int(s.top_k), 0)
    return (s.temperature if s.temperature is None else float(s.temperature),
            s.top_p if s.top_p is None else float(s.top_p), k, s.min_p if s.min_p is None else float(s.min_p))


def stated_words(s: Sampling) -> str:
    """"T = 0.7, top-p 0.9" for the report: the parameters that are on (or unknown)."""
    t, p, k, m = stated_key(s)
    out = ["T unknown" if t is None else f"T = {t:g}"]
    out += ["top-p unknown" if p is None else f"top-p {p:g}"] if p is None or p < 1.0 else []
    out += ["top-k unknown" if k is None else f"top-k {k}"] if k is None or k > 0 else []
    out += ["min-p unknown" if m is None else f"min-p {m:g}"] if m is None or m > 0.0 else []
    return ", ".join(out)


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


@dataclass
class Group:
    """The rows of one side whose samples state the same parameters, and their fingerprint."""
    stated: Sampling
    match: SemanticsMatch
    rows: np.ndarray                 # bool over the joined rows: this group's
    samples: int

    def to_json(self) -> dict:
        return {"stated": stated_words(self.stated), "samples": self.samples, **self.match.to_json()}


@dataclass
class SideFit:
    """A side's fingerprint: one group per distinct stated parameters (in order of first row)."""
    side: str
    groups: list[Group]

    def per_row(self, n: int) -> list[Semantics | None]:
        """The semantics the split uses for each joined row: its group's (None: not measured)."""
        out: list[Semantics | None] = [None] * n
        for g in self.groups:
            for i in np.nonzero(g.rows)[0]:
                out[i] = g.match.semantics
        return out

    def verdict_of(self, n: int) -> list[str]:
        out = ["not_measured"] * n
        for g in self.groups:
            for i in np.nonzero(g.rows)[0]:
                out[i] = g.match.verdict
        return out

    @property
    def single(self) -> SemanticsMatch | None:
        return self.groups[0].match if len(self.groups) == 1 else None

    @property
    def verdict(self) -> str:
        return min((g.match.verdict for g in self.groups), key=_WORST.index) if self.groups else "not_measured"

    @property
    def measured(self) -> bool:
        return any(g.match.semantics is not None for g in self.groups)

    @property
    def missing(self) -> int:
        return sum(g.match.missing for g in self.groups)

    @property
    def notes(self) -> list[str]:
        out = [n for g in self.groups for n in g.match.notes]
        if len(self.groups) > 1:
            out.append(f"{self.side}'s samples state {len(self.groups)} different sampling parameters: each group "
                       "fingerprinted on its own rows, and its rows split under its own semantics")
        return list(dict.fromkeys(out))

    def fit(self) -> tuple[float, float] | None:
        """Mean (over the measured rows) and max |Δ| of the side's used log-probs under its groups' semantics."""
        fits = [(g.match.best, g.match.rows) for g in self.groups if g.match.best is not None]
        n = sum(r for _, r in fits)
        if not n:
            return None
        return sum(b.mean * r for b, r in fits) / n, max(b.max for b, _ in fits)

    def describe(self) -> str:
        """"over the full distribution (...)", or one phrase per group: "… on the samples stating T = 0.7"."""
        if self.single is not None:
            return self.single.semantics.describe() if self.single.semantics else "not measured"
        return ", ".join(f"{g.match.semantics.describe() if g.match.semantics else 'not measured'} on the "
                         f"{_n(g.samples, 'sample')} stating {stated_words(g.stated)} ({g.match.rows} rows)"
                         for g in self.groups)

    @property
    def summary(self) -> str:
        if self.single is not None:
            return self.single.summary
        return (f"{self.side}'s samples state {len(self.groups)} different sampling parameters, fingerprinted "
                f"each on its own rows: " + "; ".join(f"{stated_words(g.stated)}: {g.match.verdict}"
                                                       for g in self.groups))

    def to_json(self) -> dict:
        if self.single is not None:
            return self.single.to_json()
        return {"side": self.side, "verdict": self.verdict, "summary": self.summary,
                "rows": sum(g.match.rows for g in self.groups), "missing": self.missing, "best": None,
                "runner_up": None, "candidates": [], "notes": self.notes,
                "groups": [g.to_json() for g in self.groups]}


def fit_side(name: str, side: Any, other: Any, rows: Any, s: str, mask: np.ndarray, tol: float) -> SideFit:
    """Fingerprint `side` (letter `s` in `rows`, compare/reconcile._Rows) per group of its samples' own stated
    parameters, each on the group's rows in `mask`."""
    own = {u.sample: u.sampling for u in side.used}
    theirs: dict[str, list[Sampling]] = {}
    for u in other.used:
        theirs.setdefault(u.sample, []).append(u.sampling)
    keys = list(dict.fromkeys(stated_key(own[k[0]]) for k in rows.keys))
    groups = []
    for gk in keys:
        in_group = np.array([stated_key(own[k[0]]) == gk for k in rows.keys], dtype=bool)
        samples = {k[0] for k, g in zip(rows.keys, in_group) if g}
        first = next(own[x] for x in sorted(samples))
        others = ([v for x in sorted(samples) for v in theirs.get(x, [])] if len(keys) > 1
                  else [u.sampling for u in other.used])
        match = _fit(name, first, others, rows, s, mask & in_group, in_group, tol, single=len(keys) == 1, side=side)
        groups.append(Group(first, match, in_group, len(samples)))
    return SideFit(name, groups)


def _fit(name: str, stated: Sampling, others: Sequence[Sampling], rows: Any, s: str, mask: np.ndarray,
         in_group: np.ndarray, tol: float, *, single: bool, side: Any) -> SemanticsMatch:
    idx = np.nonzero(mask)[0]
    z = np.stack([rows.z[s][i] for i in idx]) if len(idx) else np.zeros((0, 1))
    statements = {}
    # each distinct statement once (extra is a dict: not hashable); one group: every statement of the side
    for x in ([u.sampling for u in side.used] if single else [stated]) + list(others):
        statements.setdefault(stated_key(x), x)
    m = fingerprint(name, z, rows.tok[s][idx], rows.u[s][idx], list(statements.values()),
                    missing=int(sum(rows.z[s][i] is None for i in np.nonzero(in_group)[0])), tol=tol)
    if stated.temperature is not None:    # the request states its temperature: a match at another is worth saying
        t = float(stated.temperature)
        m.stated_temperatures = (None if t == 1.0 else t,)
    return m
