"""Run one picklable function over a list of work items in N worker processes, results in item order.

The comparator's unit of work is one canonical point: its two sides' values are read (memory-mapped) and
compared independently of every other point, so points spread over processes with nothing shared but the
file paths. `map_ordered(fn, items, workers)` is that split; the finder's measure step runs on top of it
(`--workers N`). `workers <= 1` runs in this process (no pool, no pickling). Workers are started with
`spawn`: the caller may hold threads (a tracer's writer, torch's pools), which `fork` would copy in an
undefined state.

`backend="ray"` runs the same split as Ray tasks (slime's clusters already run Ray) on nodes that see the
traces (a shared filesystem): one task per item, `ray.get` on the list of object refs keeps the order;
each task reads on the node that runs it, so traces larger than one node's disk bandwidth are compared at
the sum of the nodes' bandwidths. Ray is optional: tic-trace does not depend on it (benchmarks/README.md
has the install time and a measured run).
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class ItemFailed(RuntimeError):
    """A work item raised in a worker: names the item's position, keeps the worker's error as the cause."""


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


BACKENDS = ("processes", "ray")


def map_ordered(fn: Callable[[T], R], items: Sequence[T] | Iterable[T], workers: int = 1,
                backend: str = "processes") -> list[R]:
    """[fn(item) for item in items], computed by `workers` processes (or Ray tasks: `backend="ray"`, on the
    cluster `ray.init` connects to, or a local one of `workers` CPUs); `fn` and the items must pickle (a
    module-level function and plain data: paths, offsets, shapes)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    items = list(items)
    if backend == "ray":
        return _map_ray(fn, items, workers)
    if workers <= 1 or len(items) <= 1:
        return [_call(fn, i, item) for i, item in enumerate(items)]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(items)), mp_context=ctx) as pool:
        futures = [pool.submit(_call, fn, i, item) for i, item in enumerate(items)]
        return [f.result() for f in futures]


def _map_ray(fn: Callable[[T], R], items: list[T], workers: int) -> list[R]:
    try:
        import ray
    except ImportError:
        raise RuntimeError("backend 'ray' needs the ray package (pip install ray); tic-trace does not depend on "
                           "it") from None
    if not ray.is_initialized():
        ray.init(num_cpus=max(1, workers), include_dashboard=False, log_to_driver=False)
    task = ray.remote(_call)
    return ray.get([task.remote(fn, i, item) for i, item in enumerate(items)])   # refs in item order


def _call(fn: Callable[[T], R], index: int, item: T) -> R:
    try:
        return fn(item)
    except Exception as e:  # noqa: BLE001 - re-raised with the item's position
        raise ItemFailed(f"work item {index} ({item!r:.200}) failed: {type(e).__name__}: {e}") from e
