"""What the finder replays of each point: a bounded, deterministic set of rows (and of the logits' vocabulary
columns), the same on both sides, chosen where the judge looks (docs/replay.md, "Rows replayed").

The exact op, its clean variants and the metrics each cost O(rows x weights) per point and side, while one
traced forward costs O(rows x weights) for the whole model: replayed in full, a model's 394 points cost ~6x the
two traced forwards (benchmarks/bench_replay_real.py). The judge needs less. Each point's rule compares a side's
excess with its clean variants' on the *same* rows, and a side's fingerprint is bit-equality with a variant on
those rows; what the rows must hold is where a fault or a clean kernel's error shows:

- the `WORST_ROWS` rows with the largest A-B error at the point: a side that computes this op otherwise moves
  its output there first;
- the `LARGEST_ROWS` rows largest against the median row, in side A's output or in the op's first input: a
  trained model's massive rows (the first token, attention sinks), where its rounding error gathers;
- evenly spaced rows over the rest, up to `REPLAY_ROWS`.

The logits' rows are as wide as the vocabulary (262144 on Gemma 3): there `COLUMNS` evenly spaced columns are
replayed, with each replayed row's `TOP_COLUMNS` largest logits (the tokens that carry its probability), its
`TOP_COLUMNS` largest |A-B| and its next token. A point with at most `REPLAY_ROWS` rows is replayed on every
row; an op over each sample's earlier rows (a linear attention's recurrence) on every row too. What was
replayed is in each side's facts (`IntrinsicError.rows` of `rows_total`, `columns` of `columns_total`) and in
the report's coverage ("rows replayed N of M").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

REPLAY_ROWS = 48        # rows a point is replayed on, at most (per side; the same rows on both)
WORST_ROWS = 12         # of them: the largest A-B error at the point
LARGEST_ROWS = 12       # of them: the largest against the median row (side A's output or first input)
WIDE = 16384            # a row wider than this (the logits' vocabulary) is replayed on a set of columns
COLUMNS = 2048          # evenly spaced columns of a wide row
TOP_COLUMNS = 8         # and per replayed row: its largest values, its largest |A-B|

RowId = tuple[str, int]


@dataclass(frozen=True)
class Sample:
    """The part of one point both sides replay: `rows` (None: every row), `columns` (sorted column indices of
    a wide point's rows; None: every column), and `columns_total` (the rows' width when sampled)."""
    rows: frozenset | None = None
    columns: np.ndarray | None = None
    columns_total: int = 0

    def keep(self, rows: list[RowId], idx: list[list[int]]) -> tuple[list[RowId], list[list[int]], int]:
        """Of a side's rows (and each of its tensors' indices of them), those this sample replays, and of how
        many rows (0: every one kept)."""
        if self.rows is None:
            return rows, idx, 0
        keep = [i for i, r in enumerate(rows) if r in self.rows]
        if len(keep) == len(rows):
            return rows, idx, 0
        return [rows[i] for i in keep], [[ix[i] for i in keep] for ix in idx], len(rows)


EVERYTHING = Sample()


def top(values: np.ndarray, k: int) -> list[int]:
    """Indices of the k largest values, ties to the earlier index; NaN counts as the largest (a NaN/Inf row)."""
    if k <= 0 or not len(values):
        return []
    v = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=np.inf)
    return [int(i) for i in np.argsort(-v, kind="stable")[:k]]


def choose_rows(n: int, error: np.ndarray | None, size: np.ndarray | None, budget: int | None = None) -> list[int]:
    """At most `budget` (REPLAY_ROWS) of n row indices, sorted: the WORST_ROWS largest `error`, the LARGEST_ROWS
    largest `size` (either may be None), then evenly spaced ones over the rest. Every row where n <= budget."""
    budget = REPLAY_ROWS if budget is None else budget
    if n <= budget:
        return list(range(n))
    chosen = set(top(error, WORST_ROWS) if error is not None else [])
    chosen.update(top(size, LARGEST_ROWS) if size is not None else [])
    rest = np.setdiff1d(np.arange(n), np.fromiter(chosen, dtype=np.int64, count=len(chosen)))
    k = budget - len(chosen)
    if k > 0 and len(rest):
        chosen.update(rest[np.unique(np.linspace(0, len(rest) - 1, k).round().astype(np.int64))].tolist())
    return sorted(chosen)


def choose_columns(a: np.ndarray, b: np.ndarray | None, extra: Iterable[int] = ()) -> np.ndarray:
    """Sorted columns of wide rows a [rows, width] (side A's values at the replayed rows; b: side B's at the same
    rows, or None): COLUMNS evenly spaced, each row's TOP_COLUMNS largest values and largest |a - b|, `extra`."""
    width = a.shape[1]
    k = min(TOP_COLUMNS, width)
    parts = [np.linspace(0, width - 1, min(COLUMNS, width)).round().astype(np.int64),
             np.array([c for c in extra if 0 <= c < width], dtype=np.int64)]
    ta = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    parts.append(_top(ta, k))
    if b is not None and b.shape == a.shape:
        parts.append(_top((ta - torch.from_numpy(np.ascontiguousarray(b, dtype=np.float32))).abs(), k))
    return np.unique(np.concatenate(parts))


def _top(t: torch.Tensor, k: int) -> np.ndarray:
    """Each row's k largest columns (torch's topk: NaN counts as the largest)."""
    return torch.topk(t, k, dim=1).indices.reshape(-1).numpy().astype(np.int64)


def row_norms(values: np.ndarray) -> np.ndarray:
    """Each row's L2 norm of an [n, ...] array (in its own dtype: a choice of rows, not a measurement)."""
    x = values.reshape(values.shape[0], -1)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)
    return np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64))


def relative(norms: np.ndarray) -> np.ndarray:
    """Row norms over their median (as they are where the median is 0)."""
    med = float(np.median(norms)) if len(norms) else 0.0
    return norms / med if med > 0 else norms


class RowSampler:
    """The finder's choice of what to replay at each point (`of`), for sides `a`, `b` (`SideReplayer`s) and the
    A-B measurements `measured` (PointMeasurements: rows and per-row errors). Each record's row sizes are
    computed once (a point's output is the next point's input)."""

    def __init__(self, a, b, measured=()) -> None:
        self.a, self.b = a, b
        self.measured = {(m.point, m.layer): m for m in measured or ()}
        self._sizes: dict = {}

    def of(self, point: str, layer: int | None) -> Sample:
        """What both sides replay at (point, layer). Every row of an ids point (cheap, and its rule counts
        rows) and of an op over each sample's earlier rows (a linear attention's recurrence)."""
        from ..graph.canonical import BY_NAME
        a = self.a
        if (BY_NAME[point].kind != "float" or a.derived(point, layer)
                or a.ref.op_of(point, layer) in a.ref.family.whole_sample_ops):
            return EVERYTHING
        out = a.recorded(point, layer)
        if out is None or not len(out.rows):
            return EVERYTHING
        rows, n = list(out.rows), len(out.rows)
        keep = list(range(n))
        if n > REPLAY_ROWS:
            keep = choose_rows(n, _by_row(rows, self.measured.get((point, layer))), self._size(point, layer, rows))
        chosen = [rows[i] for i in keep]
        sample = Sample(rows=frozenset(chosen) if len(keep) < n else None)
        width = int(np.prod(out.values.shape[1:]))
        if point != "logits" or out.values.ndim != 2 or width <= WIDE:
            return sample
        other = self.b.recorded(point, layer)
        vb = _aligned(other, chosen) if other is not None and other.values.shape == out.values.shape else None
        nxt = [a.view.tokens.get((s, p + 1)) for s, p in chosen]
        cols = choose_columns(out.values[keep], vb, [t for t in nxt if t is not None])
        return Sample(rows=sample.rows, columns=cols if len(cols) < width else None, columns_total=width)

    def _size(self, point: str, layer: int | None, rows: list) -> np.ndarray:
        """Per row of `rows`: the larger of its output's and its first input's norm over their median."""
        from .exact_model import feed_key
        a = self.a
        feeds = a.ref.inputs_of(point, a.has_qk_norm, layer)
        keys = [(point, layer)] + ([feed_key(feeds[0], layer, a.view.n_layers)] if feeds else [])
        size = np.zeros(len(rows))
        for k in keys:
            if k not in self._sizes:
                t = a.recorded(*k)
                self._sizes[k] = (t.rows, relative(row_norms(t.values))) if t is not None else ([], np.zeros(0))
            at_rows, rel = self._sizes[k]
            if at_rows != rows:         # another row order (most points share one: compared as lists, at C speed)
                at = dict(zip(at_rows, rel.tolist()))
                rel = np.array([at.get(r, 0.0) for r in rows])
            size = np.maximum(size, rel)
        return size


def _by_row(rows: list, measured) -> np.ndarray | None:
    """The A-B per-row errors of `measured` in `rows`' order (-inf where it has none)."""
    if measured is None or not len(getattr(measured, "per_row", ())) or len(measured.per_row) != len(measured.rows):
        return None
    at = dict(zip(measured.rows, np.asarray(measured.per_row, dtype=np.float64).tolist()))
    return np.array([at.get(r, -np.inf) for r in rows])


def _aligned(t, rows: list) -> np.ndarray | None:
    """t's values at `rows` (None where it lacks one)."""
    at = {r: i for i, r in enumerate(t.rows)}
    if any(r not in at for r in rows):
        return None
    return t.values[[at[r] for r in rows]]
