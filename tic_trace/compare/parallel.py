"""Run one picklable function over a list of work items in N worker processes, results in item order.

The comparator's unit of work is one canonical point: its two sides' values are read (memory-mapped) and
compared independently of every other point, so points spread over processes with nothing shared but the
file paths. `map_ordered(fn, items, workers)` is that split; the finder's measure step runs on top of it
(`--workers N`). `workers <= 1` runs in this process (no pool, no pickling). Workers are started with
`spawn` unless the caller asks for `fork` (`start_method`), which `fork_is_safe()` allows only in a process
with no other Python thread and no torch loaded: a tracer's writer thread or torch's pools would be copied
into the child in an undefined state. A forked worker starts in milliseconds and inherits what the caller
already built (imported modules, indexed traces); a spawned one imports and rebuilds it.

`backend="ray"` runs the same split as Ray tasks (slime's clusters already run Ray) on nodes that see the
traces (a shared filesystem): one task per item, results taken from the object refs in item order; each
task reads on the node that runs it, so traces larger than one node's disk bandwidth are compared at the
sum of the nodes' bandwidths. tic-trace does not depend on Ray (imported only for this backend); the tests
pin it (requirements/test.txt) and run the finder's split on a local Ray.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class ItemFailed(RuntimeError):
    """A work item raised in a worker: one line naming the item's position and the error (the worker's own
    traceback stays on the cause, for --debug). `others`: one line per other item already known to have
    failed when this one stopped the map (the rest were cancelled)."""
    others: tuple[str, ...] = ()


# Colour and cursor sequences (CSI, OSC) a remote traceback carries (Ray colours its task names): removed, not
# escaped, so that the one line stays readable; text.visible still escapes any other control character.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")


def one_line(message: str, limit: int = 600) -> str:
    """`message` as one readable line: escape sequences removed, only its first non-empty line (a remote
    error's traceback follows on the next ones), cut to `limit` characters."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(message)).splitlines() if ln.strip()]
    out = lines[0] if lines else ""
    if len(lines) > 1:
        out += " …"
    return out if len(out) <= limit else out[:limit - 1] + "…"


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


BACKENDS = ("processes", "ray")
START_METHODS = ("spawn", "fork")


def fork_is_safe() -> bool:
    """Whether worker processes may be forked from this one: a platform with fork, no Python thread but this
    one (a lock held by another thread would stay held in the child), and torch not loaded (its thread pools
    and device state are not fork-safe)."""
    return ("fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
            and "torch" not in sys.modules)


def map_ordered(fn: Callable[[T], R], items: Sequence[T] | Iterable[T], workers: int = 1,
                backend: str = "processes", start_method: str = "spawn") -> list[R]:
    """[fn(item) for item in items], computed by `workers` processes (or Ray tasks: `backend="ray"`, on the
    cluster `ray.init` connects to, or a local one of `workers` CPUs); `fn` and the items must pickle (a
    module-level function and plain data: paths, offsets, shapes)."""
    return list(imap_ordered(fn, items, workers, backend, start_method))


def imap_ordered(fn: Callable[[T], R], items: Sequence[T] | Iterable[T], workers: int = 1,
                 backend: str = "processes", start_method: str = "spawn") -> Iterator[R]:
    """`map_ordered`, yielding each result as soon as it and every earlier one are done (for progress).
    Closing the generator early (or an item failing) cancels the items not yet started. `start_method`
    "fork" (processes only) must be asked for only where `fork_is_safe()`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    items = list(items)
    if backend == "ray":
        yield from _imap_ray(fn, items, workers)
        return
    if workers <= 1 or len(items) <= 1:
        for i, item in enumerate(items):
            yield _call(fn, i, item)
        return
    ctx = multiprocessing.get_context(start_method)
    pool = ProcessPoolExecutor(max_workers=min(workers, len(items)), mp_context=ctx)
    futures = []
    try:
        futures = [pool.submit(_call, fn, i, item) for i, item in enumerate(items)]
        for f in futures:
            yield f.result()
    except ItemFailed as e:
        pool.shutdown(wait=True, cancel_futures=True)    # the running items end; their failures are known
        e.others = tuple(str(x) for f in futures if f.done() and not f.cancelled()
                         and isinstance(x := f.exception(), ItemFailed) and x is not e)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _imap_ray(fn: Callable[[T], R], items: list[T], workers: int) -> Iterator[R]:
    try:
        import ray
    except ImportError:
        raise RuntimeError("backend 'ray' needs the ray package (pip install ray); tic-trace does not depend on "
                           "it") from None
    if not ray.is_initialized():
        # Ray's own INFO/WARNING lines (a local instance started, token authentication) are not the report's
        import logging
        ray.init(num_cpus=max(1, workers), include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
    task = ray.remote(_call)
    refs = [task.remote(fn, i, item) for i, item in enumerate(items)]
    done = 0
    try:
        for ref in refs:      # in item order
            try:
                yield ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                # ray's error text is the worker's whole traceback; keep the item's one line, chain the rest
                failed = ItemFailed(_ray_line(e, done))
                failed.others = tuple(_drain_ray(ray, refs[done + 1:], done + 1))
                raise failed from e
            done += 1
    finally:
        for ref in refs[done + 1:]:
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - already finished or gone
                pass


def _ray_line(e, index: int) -> str:
    cause = getattr(e, "cause", None)
    return str(cause) if isinstance(cause, ItemFailed) else one_line(f"work item {index}: {e}")


def _drain_ray(ray, refs: list, first_index: int, wait_s: float = 10.0) -> list[str]:
    """Cancel the items after a failure and collect, one line each, the failures among them. Every failed
    ref is read here: one that is never read is printed by Ray, traceback and colours, when it is collected
    ("Unhandled error"), which would bury the one line naming the failure."""
    for ref in refs:
        try:
            ray.cancel(ref)
        except Exception:  # noqa: BLE001 - already finished
            pass
    others, deadline = [], time.monotonic() + wait_s
    for n, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=max(deadline - time.monotonic(), 0.01))
        except ray.exceptions.RayTaskError as e:
            others.append(_ray_line(e, first_index + n))
        except Exception:  # noqa: BLE001 - cancelled, timed out, worker gone: not an item's own failure
            pass
    return others


def _call(fn: Callable[[T], R], index: int, item: T) -> R:
    try:
        return fn(item)
    except Exception as e:  # noqa: BLE001 - re-raised with the item's position
        raise ItemFailed(one_line(f"work item {index} ({item!r:.200}) failed: {type(e).__name__}: {e}")) from e
