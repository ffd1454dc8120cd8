"""Step 1 of the finder: measure one canonical point — load both sides, align rows, compute the metrics.

`measure_point` reads only that point of each side and returns a `PointMeasurement`, a plain picklable
record (no arrays, no open files): the finder may run it in worker processes, one point (or one block of
rows) at a time. Nothing here judges; the judge (`judge.py`) and the walk (`verdict.py`) decide from these
numbers, so everything they need per row is kept: the per-row errors (for the worst-row judgement, the
per-token walk and judging a routed point without the tokens whose experts flipped), the reference norm of each row (to
recombine a relative L2 over a subset of rows), side A's best router choice scores (the top-k margin
of a flip) and the values of one-number points (log-probs: |Δ logprob| per token).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..graph.canonical import BY_NAME, LOGPROBS, key_name, unit_of
from ..view.align import CanonicalView, RowId, align_rows
from ..view.rows import row_identity
from .choice import router_choice
from .inherited import logprob_inherited, norm_inherited
from .judge import coarser
from .metrics import compare_routing, compare_stats, compare_values, row_aggregate
from .mixture import mixture_scale

# Reference router-logit values kept per row: enough for the margin between the k-th and (k+1)-th expert
# for any k below this.
ROUTER_TOP = 33


@dataclass
class PointMeasurement:
    point: str
    layer: int | None
    dtype: str | None = None
    error: float | None = None            # row-relative error over the matched rows (metrics.row_aggregate;
                                          # ids: share of flipped rows);
                                          # None: nothing compared (see `reason`)
    nonfinite: int = 0
    rows: list[RowId] = field(default_factory=list)   # matched rows, side A's order
    only_a: int = 0
    only_b: int = 0
    metrics: dict | None = None
    stats: dict | None = None
    routing: dict | None = None           # ids points: RoutingMetrics (set agreement, flipped rows)
    flipped: list[RowId] = field(default_factory=list)
    per_row: np.ndarray | list = field(default_factory=list)      # per-row relative error (inf: NaN/Inf one side)
    per_row_abs: np.ndarray | list = field(default_factory=list)  # per-row max |a-b|
    per_row_judged: np.ndarray | None = None  # per_row with near-empty rows floored (compare.ROW_FLOOR);
                                              # None: no row under the floor, the judged errors are per_row
    per_row_carried: np.ndarray | None = None  # per row, the error later points inherit where it is not the
                                               # judged one: a point judged in the "mixture" unit passes its
                                               # rows' errors against their own norms (what a gemm of it
                                               # sees); None: the judged errors are passed on
    row_inherited: np.ndarray | None = None   # per row: the error the inputs' difference makes where the op
                                              # acts (compare/inherited.py: log-softmax in nats, a norm through
                                              # its gain); None: the feeds' own per-row errors are inherited
    row_ref_norm: np.ndarray | None = None                        # routed points: ||a_row||
    router_top: list[list[float]] | None = None             # router logits: side A's best choice scores,
                                                            # descending, in the space the top-k is taken in
                                                            # (compare/choice.py; plain logits for softmax)
    router_group_margin: np.ndarray | None = None           # group-limited routers: per row, the group margin
                                                            # per choice score (choice.RouterChoice.margins)
    router_score_error: np.ndarray | None = None            # per row: how far that row's logit error moves a
                                                            # choice score
    router_space: str = "logits"
    values_a: list[float] | None = None                     # one-number points (log-probs)
    values_b: list[float] | None = None
    reason: str | None = None
    derived: bool = False                 # computed by the reader (log-probs from logits), not recorded
    dtypes: dict | None = None            # {"a", "b"}: the effective dtypes, where the sides' differ
    sources: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return key_name(self.point, self.layer)

    @property
    def compared(self) -> bool:
        return self.error is not None

    @property
    def row_errors(self) -> np.ndarray:
        """The per-row errors the worst-row judgement reads (docs/report.md, "The worst rows")."""
        return np.asarray(self.per_row if self.per_row_judged is None else self.per_row_judged, dtype=np.float64)

    @property
    def carried_row_errors(self) -> np.ndarray:
        """The per-row errors later points inherit (docs/report.md, "Units": a mixture passes its own)."""
        return self.row_errors if self.per_row_carried is None else np.asarray(self.per_row_carried, dtype=np.float64)

    @property
    def carried_error(self) -> float | None:
        """The all-rows error later points inherit: the judged one, or a mixture's rows' own (same aggregate)."""
        if self.per_row_carried is None or self.error is None:
            return self.error
        return math.inf if self.nonfinite else row_aggregate(self.per_row_carried)


def measure_point(va: CanonicalView, vb: CanonicalView, point: str, layer: int | None) -> PointMeasurement:
    """Load `point` of both sides, align their rows and compare them."""
    ta, tb = va.load(point, layer), vb.load(point, layer)
    derived = point == LOGPROBS and ((LOGPROBS, None) not in va.entries or (LOGPROBS, None) not in vb.entries)
    m = PointMeasurement(point, layer, sources={"a": ta.sources[:4], "b": tb.sources[:4]}, derived=derived)
    # rows that are not the same rows on both sides (other tokens, named twice) are never compared
    exclude = row_identity(va, vb).exclude_for(point)
    if ta.values is None or tb.values is None:
        if exclude:
            # statistics cover every row of a record: they cannot leave the other rows out
            m.only_a, m.only_b = len(ta.rows), len(tb.rows)
            m.reason = (f"statistics only, and {len(exclude)} row(s) both sides have are not the same rows "
                        "(see the rows): re-trace with mode 'rows' or 'full' for these points")
            return m
        return _measure_stats(m, ta, tb)
    pair = align_rows(ta, tb, exclude)
    m.rows, m.only_a, m.only_b = pair.rows, pair.only_a, pair.only_b
    m.dtype = coarser(ta.dtype, tb.dtype)
    if not pair.rows:
        left_out = exclude and not set(ta.rows).isdisjoint(tb.rows)
        m.reason = (f"no row both sides have is the same row on both (A has {len(ta.rows)}, B has "
                    f"{len(tb.rows)}; other tokens or rows named twice, see the rows)" if left_out else
                    f"no rows in common (A has {len(ta.rows)}, B has {len(tb.rows)}): check that both sides "
                    "traced the same samples (sample keys) and positions")
        return m
    ids = BY_NAME[point].kind == "ids" and pair.a.ndim == pair.b.ndim == 2
    if pair.a.shape[1:] != pair.b.shape[1:] and not ids:     # ids of another top-k: every set differs
        m.rows = []
        m.reason = (f"the sides' rows differ in shape: A {list(pair.a.shape[1:])} ({', '.join(ta.sources[:2])}), "
                    f"B {list(pair.b.shape[1:])} ({', '.join(tb.sources[:2])}); check the two model configs "
                    "and the adapters' layout for this point")
        return m
    if BY_NAME[point].kind == "ids":
        rm = compare_routing(pair.a, pair.b)
        m.routing = {"rows": rm.rows, "k": rm.k, "set_agreement": rm.set_agreement, "flipped": rm.flipped_rows}
        if rm.k_b != rm.k:
            m.routing["k_b"] = rm.k_b
        m.flipped = [pair.rows[i] for i in rm.flipped_index]
        m.error = rm.error
        return m
    if ta.dtype != tb.dtype and not derived:      # a derived point's dtype is tic-trace's, not a side's
        m.dtypes = _effective_dtypes(ta.dtype, pair.a, tb.dtype, pair.b)
    # a point that mixes rows is measured against the norm they bound it to (docs/report.md, "Units")
    scale = (mixture_scale(va, point, layer, pair.rows, int(np.prod(pair.a.shape[1:], dtype=np.int64)))
             if unit_of(point) == "mixture" else None)
    met = compare_values(pair.a, pair.b, m.dtype, scale)
    m.metrics = met.to_json()
    m.error, m.nonfinite = met.error, met.nonfinite
    # arrays, not lists of Python floats: a trace has thousands of points of thousands of rows each
    m.per_row = np.asarray(met.per_row_rel, dtype=np.float64)
    m.per_row_abs = np.asarray(met.per_row_max, dtype=np.float64)
    if met.per_row_judged is not None:
        m.per_row_judged = np.asarray(met.per_row_judged, dtype=np.float64)
    if met.per_row_own is not None:
        m.per_row_carried = np.asarray(met.per_row_own, dtype=np.float64)
    n = len(pair.rows)
    if unit_of(point) == "nats":          # |Δ| itself, never over the value (docs/report.md, "Units")
        m.per_row, m.per_row_judged = m.per_row_abs.copy(), None
        m.error = math.inf if m.nonfinite else row_aggregate(m.per_row)
        derived_sides = tuple((LOGPROBS, None) not in v.entries for v in (va, vb))
        m.row_inherited = logprob_inherited(va, vb, pair.rows, pair.a, pair.b, (ta.dtype, tb.dtype), derived_sides)
    else:
        m.row_inherited = norm_inherited(va, vb, point, layer, pair.rows, pair.a)
    if BY_NAME[point].routed:
        m.row_ref_norm = _row_norms(pair.a.reshape(n, -1))
    if BY_NAME[point].role == "router_logits":
        choice = router_choice(va.config, layer)
        top, group_margin = choice.margins(pair.a.reshape(n, -1), ROUTER_TOP)
        m.router_top = top.tolist()
        m.router_group_margin = group_margin
        m.router_score_error = choice.score_error(m.per_row_abs, m.dtype)
        m.router_space = choice.space
    if pair.a.size == n:
        m.values_a = [float(x) for x in pair.a.reshape(-1)]
        m.values_b = [float(x) for x in pair.b.reshape(-1)]
    return m


_NORM_BLOCK = 1 << 18     # float64 elements widened at once


def _row_norms(a: np.ndarray) -> np.ndarray:
    """||a_row|| in float64 with NaN/Inf read as 0, a block of rows at a time (each row's norm is computed
    alone: the block size changes no number; the heap holds one block, not a float64 copy of the point)."""
    out = np.empty(a.shape[0])
    step = max(1, _NORM_BLOCK // max(a.shape[1], 1))
    for r in range(0, a.shape[0], step):
        x = np.nan_to_num(a[r:r + step].astype(np.float64), copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        out[r:r + step] = np.linalg.norm(x, axis=1)
    return out


def _effective_dtypes(da: str, a: np.ndarray, db: str, b: np.ndarray) -> dict | None:
    """The dtype each side computed in, where the records' dtypes differ: an fp32 record whose values all lie
    on the bf16 grid (an engine that upcasts its bf16 output) computed in bf16. None when they agree."""
    from ..replay.grid import effective_dtype
    ea, eb = effective_dtype(a, da), effective_dtype(b, db)
    return {"a": ea, "b": eb} if ea != eb else None


def _measure_stats(m: PointMeasurement, ta, tb) -> PointMeasurement:
    """Only statistics on at least one side: what the statistics can say (a lower bound on the error)."""
    m.only_a, m.only_b = len(ta.rows), len(tb.rows)
    missing = [s for s, t in (("A", ta), ("B", tb)) if not t.stats]
    if missing:
        m.reason = (f"no values on side {' and '.join(missing)}"
                    + (" (log-probs need the logits and the next tokens in the trace)" if m.derived else ""))
        return m
    st = compare_stats(ta.stats, tb.stats, ta.hashes, tb.hashes)
    m.stats = st
    if not st["comparable"] or not st["count"][0]:
        m.reason = ("only statistics recorded and the two sides cover different rows; "
                    "re-trace with mode 'rows' or 'full' for these points")
        return m
    m.dtype = coarser(ta.dtype, tb.dtype)
    nonf = st["nonfinite"][0] != st["nonfinite"][1]
    m.nonfinite = int(abs(st["nonfinite"][0] - st["nonfinite"][1]))
    m.error = math.inf if nonf else (0.0 if st["bitwise_equal"] else max(st["rel_rms"], st["rel_mean"]))
    m.reason = "statistics only: the error is a lower bound"
    return m


def subset_error(m: PointMeasurement, leave_out: set) -> float | None:
    """The row-relative error (`metrics.row_aggregate`) of a routed point over its rows minus `leave_out`
    (None when none is left)."""
    if m.row_ref_norm is None or not len(m.rows):
        return m.error
    keep = np.fromiter((r not in leave_out for r in m.rows), dtype=bool, count=len(m.rows))
    if not keep.any():
        return None
    e = m.row_errors[keep]
    return math.inf if not np.isfinite(e).all() else row_aggregate(e)
