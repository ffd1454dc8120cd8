"""The finder's MEASURE step over every point: in this process, or split over worker processes / Ray tasks.

Points are independent (each reads only its own records of the two traces), so the split is one work item
per point, handed out one at a time to whichever worker is free. Nothing big crosses a process boundary.
Where the caller may fork (`parallel.fork_is_safe`: the CLI, any process without other threads or torch),
workers are forked after the caller indexed both traces: they inherit the two views (`_INHERITED`) and an
item is only the point. Otherwise (spawned processes, Ray tasks) an item names the two traces (directory,
adapter, the manifest's modification time) and the point, and each worker opens the two views itself,
once per process (`_VIEWS`). Either way a worker sends back the point's `PointMeasurement` — per-row
numbers (errors, norms, router top values, row ids), never a tensor. Results come back in point order, so
the report is the same whatever the number of workers or how they start
(`tests/test_finder.py::test_workers_give_the_same_report`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable

from ..graph.adapter import Adapter, UnknownAdapter, get_adapter
from ..graph.canonical import key_name
from ..view.align import CanonicalView
from .measure import PointMeasurement, measure_point
from .parallel import BACKENDS, fork_is_safe, imap_ordered


@dataclass(frozen=True)
class SideRef:
    """How a worker reopens one side: enough to rebuild the same CanonicalView, and a stamp so that a
    long-lived worker (Ray) never reuses a view of a trace rewritten in place."""
    path: str
    adapter: str
    include_recompute: bool
    manifest_mtime_ns: int
    passes_by: str = "order"

    @classmethod
    def of(cls, v: CanonicalView) -> "SideRef":
        path = os.path.abspath(str(v.trace.path))
        try:
            stamp = os.stat(os.path.join(path, "manifest.msgpack")).st_mtime_ns
        except OSError:
            stamp = 0
        return cls(path, adapter_spec(v.adapter), bool(v.include_recompute), stamp, v.passes_by)

    def open(self) -> CanonicalView:
        return CanonicalView(self.path, self.adapter, include_recompute=self.include_recompute,
                             passes_by=self.passes_by)


@dataclass(frozen=True)
class PointJob:
    a: SideRef
    b: SideRef
    point: str
    layer: int | None

    def __repr__(self) -> str:   # what an error of this item is called (parallel.ItemFailed)
        return f"point {key_name(self.point, self.layer)}"


def adapter_spec(adapter: Adapter) -> str:
    """A name `load_adapter` turns back into this adapter in another process."""
    try:
        if get_adapter(adapter.name) is adapter:
            return adapter.name
    except UnknownAdapter:
        pass
    cls = type(adapter)
    if cls.__module__ != "__main__" and "." not in cls.__qualname__ and "<" not in cls.__qualname__:
        return f"{cls.__module__}:{cls.__qualname__}"
    raise ValueError(f"workers reopen each trace with its adapter, and adapter {adapter.name!r} "
                     f"({cls.__module__}.{cls.__qualname__}) is neither registered nor importable by name: register "
                     "it (tic_trace.graph.adapter.register_adapter), define it at module level, or use one worker")


_VIEWS: dict[SideRef, CanonicalView] = {}   # per worker process
_VIEWS_KEPT = 4


def _view(ref: SideRef) -> CanonicalView:
    v = _VIEWS.get(ref)
    if v is None:
        if len(_VIEWS) >= _VIEWS_KEPT:
            _VIEWS.clear()
        v = _VIEWS[ref] = ref.open()
    return v


def measure_job(job: PointJob) -> PointMeasurement:
    """One point, in a worker: the work item of `measure_all`."""
    return measure_point(_view(job.a), _view(job.b), job.point, job.layer)


@dataclass(frozen=True)
class InheritedJob:
    """A point of the two views a forked worker inherited from the caller (`_INHERITED`)."""
    point: str
    layer: int | None

    def __repr__(self) -> str:
        return f"point {key_name(self.point, self.layer)}"


_INHERITED: tuple[CanonicalView, CanonicalView] | None = None   # set in the caller just before forking


def measure_inherited(job: InheritedJob) -> PointMeasurement:
    """One point, in a forked worker, with the caller's views."""
    if _INHERITED is None:
        raise RuntimeError("measure_inherited runs only in a worker forked by measure_all")
    return measure_point(_INHERITED[0], _INHERITED[1], job.point, job.layer)


def measure_all(va: CanonicalView, vb: CanonicalView, points: Iterable[tuple[str, int | None]], *,
                workers: int = 1, backend: str = "processes",
                progress: Callable[[str], None] | None = None,
                start_method: str | None = None) -> list[PointMeasurement]:
    """`measure_point` for every (point, layer), in order. One worker (the default, processes backend) measures
    here with the caller's views, before each point calling `progress(key)`; more run the points in
    `workers` processes (or Ray tasks) and call `progress(key)` as each result arrives, in point order.
    `start_method` (processes): "fork" or "spawn"; None forks where `parallel.fork_is_safe()`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a whole number, 1 or more, got {workers!r}")
    points = list(points)
    if workers == 1 and backend == "processes":
        out = []
        for point, layer in points:
            if progress:
                progress(key_name(point, layer))
            out.append(measure_point(va, vb, point, layer))
        return out
    global _INHERITED
    fork = backend == "processes" and fork_is_safe() if start_method is None else start_method == "fork"
    if fork:
        fn, items, _INHERITED = measure_inherited, [InheritedJob(p, l) for p, l in points], (va, vb)
    else:
        ra, rb = SideRef.of(va), SideRef.of(vb)
        fn, items = measure_job, [PointJob(ra, rb, p, l) for p, l in points]
    out = []
    try:
        for m in imap_ordered(fn, items, workers, backend, "fork" if fork else "spawn"):
            if progress:
                progress(m.key)
            out.append(m)
    finally:
        _INHERITED = None
    return out
