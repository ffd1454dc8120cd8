"""Per-row errors along the graph: each point's rows' own errors and what each row inherits from its inputs,
the facts of the worst-row judgement (`judge.judge_point`; docs/report.md, "The worst rows")."""
from __future__ import annotations

import numpy as np

from ..graph.canonical import is_ids, mixes_positions
from ..view.align import RowId
from .measure import PointMeasurement
from .metrics import row_aggregate

# The worst rows kept per point (docs/report.md, "The worst rows"): the rows no other row beats in both error
# and growth over its own inputs' error (whatever the tolerance and growth, some row diverges exactly when
# one of these does, so `rejudge` decides from them alone), at most WORST_FRONT of them, plus the WORST_TOP
# rows of largest error for readers.
WORST_FRONT = 16
WORST_TOP = 3


def row_label(row: RowId) -> str:
    return f"{row[0]}@{row[1]}"


class RowErrors:
    """The per-row errors of the points measured so far, read at another point's rows: the facts of the
    worst-row judgement (judge.judge_point). Row lists are interned (most points share one), so the index
    of a row list and its per-sample position order are built once."""

    def __init__(self):
        self.errors: dict[tuple, tuple[tuple, np.ndarray]] = {}   # (point, layer) -> (rows, per-row errors)
        self._rows: dict[tuple, tuple] = {}
        self._index: dict[int, dict] = {}
        self._samples: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def rows_of(self, m: PointMeasurement) -> tuple:
        t = tuple(m.rows)
        return self._rows.setdefault(t, t)

    @staticmethod
    def has(m: PointMeasurement) -> bool:
        return len(m.rows) > 0 and len(m.per_row) == len(m.rows)

    def add(self, m: PointMeasurement) -> None:
        self.errors[(m.point, m.layer)] = (self.rows_of(m), m.carried_row_errors)

    def worst(self, m: PointMeasurement, feeds: list, carried: dict, leave_out: set) -> tuple[list[dict], float | None]:
        """The worst rows of `m`, and the inherited error over all rows: `row_aggregate` of each judged row's
        own inherited error (None when no row is judged). A row's inherited error is the largest of its feeds'
        errors at that row, or, where the measurement says what the inputs' difference makes where the op acts
        (`m.row_inherited`: a log-softmax in nats, a norm through its gain), that. The same aggregate as the point's error, of the
        same rows, so the all-rows growth compares like with like (a norm that rescales every row shows no
        jump) and, the aggregate being monotone, exceeds `growth` only where some row's own growth does."""
        rows = self.rows_of(m)
        e = m.row_errors
        ie = np.zeros(len(rows))
        if m.row_inherited is not None:     # measured where the op acts on its input (compare/inherited.py)
            ie = np.asarray(m.row_inherited, dtype=np.float64)
        for f in feeds if m.row_inherited is None else ():
            if is_ids(f[0]) or f not in carried:
                continue
            np.maximum(ie, self.inherited(f, rows, carried[f], mixes_positions(m.point)), out=ie)
        keep = (np.fromiter((r not in leave_out for r in rows), dtype=bool, count=len(rows)) if leave_out
                else np.ones(len(rows), dtype=bool))
        worst = [{"row": row_label(rows[i]), "error": float(e[i]), "input_error": float(ie[i]),
                  "growth": float(g)} for i, g in _worst_rows(e, ie, keep)]
        return worst, (row_aggregate(ie[keep]) if keep.any() else None)

    def inherited(self, f: tuple, rows: tuple, whole: float, causal: bool) -> np.ndarray:
        """Feed `f`'s error at each of `rows`: the same row's, or through attention (`causal`) the largest over
        the row's sample at positions up to its own. A row the feed lacks, a feed without per-row errors
        (statistics only) and, through attention, a row whose earlier positions the feed does not all hold
        inherit the feed's error over all rows (`whole`), as the all-rows rule does."""
        src = self.errors.get(f)
        if src is None:
            return np.full(len(rows), whole)
        frows, ferr = src
        if causal:
            ferr = self._causal_max(frows, ferr, whole)
        if frows is rows:
            return ferr
        pos = self._index.get(id(frows))
        if pos is None:
            pos = self._index[id(frows)] = {r: i for i, r in enumerate(frows)}
        idx = np.fromiter((pos.get(r, -1) for r in rows), dtype=np.int64, count=len(rows))
        return np.where(idx >= 0, ferr[np.maximum(idx, 0)], whole)

    def _causal_max(self, frows: tuple, ferr: np.ndarray, whole: float) -> np.ndarray:
        groups = self._samples.get(id(frows))
        if groups is None:
            by: dict = {}
            for i, (sample, position) in enumerate(frows):
                by.setdefault(sample, []).append((position, i))
            groups = []
            for lst in by.values():
                lst.sort()
                order = np.array([i for _, i in lst], dtype=np.int64)
                # every position 0..p of the sample is present at its p-th row (positions are distinct)
                complete = np.array([p == k for k, (p, _) in enumerate(lst)], dtype=bool)
                groups.append((order, complete))
            self._samples[id(frows)] = groups
        out = np.empty_like(ferr)
        for order, complete in groups:
            run = np.maximum.accumulate(ferr[order])
            out[order] = np.where(complete, run, np.maximum(run, whole))
        return out


def _worst_rows(e: np.ndarray, ie: np.ndarray, keep: np.ndarray) -> list[tuple[int, float]]:
    """(row index, growth) of the worst rows, largest error first: the (error, growth) front (no other row
    has both a larger error and a larger growth; a row is divergent when error > tol and growth > `growth`,
    so some row diverges exactly when a front row does) thinned evenly to WORST_FRONT, plus the WORST_TOP
    largest errors. Rows without error are never shown (they cannot be over any tolerance)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.where(ie > 0, np.where(np.isinf(ie), np.where(np.isinf(e), 1.0, 0.0), e / ie),
                     np.where(e > 0, np.inf, 0.0))
    cand = np.flatnonzero(keep & (e > 0))
    if not cand.size:
        return []
    ec, gc = e[cand], g[cand]
    order = np.lexsort((-gc, -ec))                # error descending, then growth descending
    gs = gc[order]
    best_before = np.maximum.accumulate(np.concatenate(([-np.inf], gs[:-1])))
    front = np.flatnonzero(gs > best_before)      # positions in `order`
    if front.size > WORST_FRONT:
        front = front[np.unique(np.linspace(0, front.size - 1, WORST_FRONT).round().astype(np.int64))]
    chosen = np.union1d(front, np.arange(min(WORST_TOP, order.size)))   # sorted: largest error first
    return [(int(cand[order[k]]), float(gs[k])) for k in chosen]
