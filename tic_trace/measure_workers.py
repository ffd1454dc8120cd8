"""The finder's MEASURE step over every point: in this process, or split over worker processes / Ray tasks.

Points are independent (each reads only its own records of the two traces), so the split is one work item
per point. Nothing big crosses a process boundary: an item names the two traces (directory, adapter, the
manifest's modification time) and the point; each worker opens the two views itself, once per process
(`_VIEWS`), and sends back the point's `PointMeasurement` — per-row numbers (errors, norms, router top
values, row ids), never a tensor. Results come back in point order, so the report is the same whatever the
number of workers (`tests/test_finder.py::test_workers_give_the_same_report`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable

from .adapter import Adapter, UnknownAdapter, get_adapter
from .align import CanonicalView
from .canonical import key_name
from .measure import PointMeasurement, measure_point
from .parallel import BACKENDS, imap_ordered


@dataclass(frozen=True)
class SideRef:
    """How a worker reopens one side: enough to rebuild the same CanonicalView, and a stamp so that a
    long-lived worker (Ray) never reuses a view of a trace rewritten in place."""
    path: str
    adapter: str
    include_recompute: bool
    manifest_mtime_ns: int

    @classmethod
    def of(cls, v: CanonicalView) -> "SideRef":
        path = os.path.abspath(str(v.trace.path))
        try:
            stamp = os.stat(os.path.join(path, "manifest.msgpack")).st_mtime_ns
        except OSError:
            stamp = 0
        return cls(path, adapter_spec(v.adapter), bool(v.include_recompute), stamp)

    def open(self) -> CanonicalView:
        return CanonicalView(self.path, self.adapter, include_recompute=self.include_recompute)


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
                     "it (tic_trace.adapter.register_adapter), define it at module level, or use one worker")


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


def measure_all(va: CanonicalView, vb: CanonicalView, points: Iterable[tuple[str, int | None]], *,
                workers: int = 1, backend: str = "processes",
                progress: Callable[[str], None] | None = None) -> list[PointMeasurement]:
    """`measure_point` for every (point, layer), in order. One worker (the default, processes backend) measures
    here with the caller's views, before each point calling `progress(key)`; more run the points in
    `workers` processes (or Ray tasks) and call `progress(key)` as each result arrives, in point order."""
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
    ra, rb = SideRef.of(va), SideRef.of(vb)
    out = []
    for m in imap_ordered(measure_job, [PointJob(ra, rb, p, l) for p, l in points], workers, backend):
        if progress:
            progress(m.key)
        out.append(m)
    return out
