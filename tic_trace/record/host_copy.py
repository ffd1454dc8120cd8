"""Copies of recorded tensors to host memory, bounded, written to disk by a writer thread.

In `full` and `rows` modes every stored value of a device tensor is copied into pinned host memory with a
non-blocking copy on the current stream (the value as produced: stream order puts the copy before any later
in-place op), and an event is recorded after it. A writer thread waits on that event — the forward thread
never waits on the device per op — then appends the bytes to the pass's blob and frees the memory. CPU
tensors take the same ring with a plain memcpy (`STAGE_CPU`): cheaper for the forward than writing itself.

All copies live in one ring buffer of at most `cap_bytes` (allocated lazily, grown only while empty), so
the pinned memory the tracer holds is bounded whatever a pass records. When a copy does not fit:
`on_cap="wait"` (default) blocks the forward until the writer has freed enough (the forward runs at disk
speed for a while; counted and noted in the pass); `on_cap="stats"`, or a single device value larger than
the cap, keeps the record's statistics and hash only and names it in the pass notes (a CPU value larger than
the cap under "wait" is written by the forward thread). Never an out-of-memory, never a silent loss.
"""
from __future__ import annotations

import collections
import queue
import threading
from typing import Any

import numpy as np
import torch

from ..store.format import Record
from ..store.writer import PassWriter
from .stats import blocks

DEFAULT_CAP_BYTES = 4 << 30
ON_CAP = ("wait", "stats")
_ALIGN = 64
_MIN_RING = 64 << 20
# CPU tensors are staged too: a memcpy into the ring instead of a write() by the forward thread (3-4x cheaper
# per byte once the ring's pages exist), the write left to the writer thread. False: written synchronously.
STAGE_CPU = True
# A pageable ring up to this size outlives its tracer for the next one in the process (a fresh buffer's page
# faults cost as much as the write it saves); `release_host_memory()` drops it. Pinned rings are never kept.
SPARE_RING_MAX = 256 << 20
_SPARE: list[torch.Tensor] = []
_SPARE_LOCK = threading.Lock()


def release_host_memory() -> None:
    """Free the pageable host-copy buffer kept for the next tracer of this process (at most SPARE_RING_MAX)."""
    with _SPARE_LOCK:
        _SPARE.clear()


def _take_spare(need: int, cap: int) -> torch.Tensor | None:
    with _SPARE_LOCK:
        if _SPARE and need <= _SPARE[0].numel() <= cap:
            return _SPARE.pop()
    return None


def _keep_spare(buf: torch.Tensor) -> None:
    with _SPARE_LOCK:
        if buf.numel() <= SPARE_RING_MAX and (not _SPARE or _SPARE[0].numel() < buf.numel()):
            _SPARE[:] = [buf]


def as_storage(x: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's bits as the numpy array the trace format stores."""
    if x.dtype == torch.bool or x.is_complex() or x.dtype in (
            torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
            torch.uint8):
        return x.numpy()
    # bf16, fp8 and other dtypes numpy lacks: their bit patterns as unsigned ints of the same width
    return x.view({1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[x.element_size()]).numpy()


class _Ring:
    """FIFO allocator over one host buffer: slots are freed in the order they were taken."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.buf: torch.Tensor | None = None
        self.size = 0
        self.head = 0
        self.live: collections.deque[tuple[int, int]] = collections.deque()

    def alloc(self, n: int) -> int | None:
        n = -(-max(n, 1) // _ALIGN) * _ALIGN
        if n > self.size:
            return None
        if not self.live:
            off = 0
        else:
            tail = self.live[0][0]
            if self.head > tail:              # live bytes [tail, head): room at the end, else at the start
                if self.size - self.head >= n:
                    off = self.head
                elif tail >= n:
                    off = 0                   # wrap: the end of the buffer stays unused until freed
                else:
                    return None
            elif tail - self.head >= n:       # wrapped: room between head and tail
                off = self.head
            else:
                return None
        self.head = off + n
        self.live.append((off, off + n))
        return off

    def free_oldest(self) -> None:
        self.live.popleft()

    def grow(self, need: int, cap: int) -> bool:
        """Only when empty: a buffer of min(cap, max(2x, need)) bytes. False when already at the cap."""
        new = min(cap, max(2 * self.size, need + _ALIGN, _MIN_RING))
        if new <= self.size or self.live:
            return False
        self.buf = None
        if self.pinned and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()       # hand the old pinned block back, not to the caching allocator
        spare = None if self.pinned else _take_spare(new, cap)
        self.buf = spare if spare is not None else torch.empty(new, dtype=torch.uint8, pin_memory=self.pinned)
        self.size, self.head = self.buf.numel(), 0
        return True


class HostStager:
    """Bounded host copies of device tensors and the thread that writes them into a pass's blob."""

    def __init__(self, cap_bytes: int = DEFAULT_CAP_BYTES, on_cap: str = "wait"):
        if on_cap not in ON_CAP:
            raise ValueError(f"on_cap must be one of {ON_CAP}, got {on_cap!r}")
        if int(cap_bytes) <= 0:
            raise ValueError(f"pinned_cap_bytes must be positive, got {cap_bytes!r}")
        self.cap = int(cap_bytes)
        self.on_cap = on_cap
        self._ring: _Ring | None = None
        self._cv = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._inflight = 0
        self.write_lock = threading.Lock()
        self.error: BaseException | None = None
        self.waits = 0
        self.degraded: list[str] = []
        self.peak_ring_bytes = 0

    # ---------------------------------------------------------------- forward thread
    def wants(self, x: torch.Tensor) -> bool:
        return x.is_cuda or (STAGE_CPU and x.device.type == "cpu")

    def write_now(self, pw: PassWriter, rec: Record, arr: np.ndarray) -> None:
        with self.write_lock:   # a memoryview of an array with a zero in its shape cannot be cast to bytes
            rec.offset, rec.nbytes, rec.crc = pw.write_bytes(arr if arr.size else b"")

    def stage(self, pw: PassWriter, rec: Record, x: torch.Tensor) -> bool:
        """Queue x's value for the blob; False (and a note) when it was degraded to statistics."""
        if self.error is not None:
            raise self.error
        nbytes = x.numel() * x.element_size()
        # Pinned whenever CUDA is there: a ring first made for a CPU tensor must not turn later device copies
        # into synchronous ones.
        off = self._reserve(nbytes, pinned=x.is_cuda or torch.cuda.is_available())
        if off is None and self.on_cap == "wait" and x.device.type == "cpu":
            # Larger than the whole ring: a CPU value needs no host copy to be kept, so it is written by this
            # thread, as before CPU staging (only a device value must fit the cap to reach the disk).
            self.write_now(pw, rec, as_storage(x.contiguous()))
            return True
        if off is None:
            self.degraded.append(rec.name)
            return False
        assert self._ring is not None and self._ring.buf is not None
        host = self._ring.buf[off:off + nbytes].view(x.dtype).view(x.shape)
        _copy_bounded(host, x)
        event = None
        if x.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._start()
        self._queue.put((event, host, rec, pw))
        return True

    def _reserve(self, nbytes: int, pinned: bool) -> int | None:
        if nbytes + _ALIGN > self.cap:
            return None
        with self._cv:
            if self._ring is None:
                self._ring = _Ring(pinned)
            waited = False
            while True:
                off = self._ring.alloc(nbytes)
                if off is not None:
                    self._inflight += 1
                    self.peak_ring_bytes = max(self.peak_ring_bytes, self._ring.size)
                    return off
                if not self._ring.live and self._ring.grow(nbytes, self.cap):
                    continue
                if self.on_cap == "stats" and self._ring.size >= self.cap:
                    return None
                if not waited:
                    self.waits += 1
                    waited = True
                self._cv.wait()      # the writer frees slots in order; it always makes progress

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="tic-trace-writer", daemon=True)
            self._thread.start()

    def drain(self) -> None:
        """Wait until every queued copy is written; raise the writer's error, if any (then forget it)."""
        with self._cv:
            while self._inflight:
                self._cv.wait()
        err, self.error = self.error, None
        if err is not None:
            raise err

    def take_notes(self) -> list[str]:
        notes = []
        if self.degraded:
            notes.append(f"host copy cap ({self.cap} bytes, pinned_cap_bytes) reached: {len(self.degraded)} "
                         f"record(s) kept statistics and hash only, e.g. {self.degraded[0]}; raise the cap or "
                         "narrow the records (Filters, rows mode)")
        if self.waits:
            notes.append(f"host copy ring full {self.waits} time(s) (ring {self.peak_ring_bytes} bytes, cap "
                         f"{self.cap} bytes, pinned_cap_bytes): the forward waited for the disk writer")
        self.degraded, self.waits = [], 0
        return notes

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._thread is not None and self._thread.is_alive():
                self._queue.put(None)
                self._thread.join()
            self._thread = None
            if self._ring is not None and self._ring.buf is not None and not self._ring.pinned:
                _keep_spare(self._ring.buf)
            if self._ring is not None:
                self._ring.buf = None
            self._ring = None

    # ---------------------------------------------------------------- writer thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, host, rec, pw = item
            try:
                if event is not None:
                    event.synchronize()       # this thread waits for the copy; the forward does not
                if self.error is None:
                    self.write_now(pw, rec, as_storage(host))
            except BaseException as e:  # noqa: BLE001 - reported to the forward thread at drain()
                if self.error is None:
                    self.error = e
            finally:
                with self._cv:
                    self._ring.free_oldest()
                    self._inflight -= 1
                    self._cv.notify_all()


def _copy_bounded(host: torch.Tensor, x: torch.Tensor) -> None:
    """host <- x. A non-contiguous device tensor is copied slab by slab: a single copy_ would first make a
    contiguous device copy of the whole tensor."""
    nb = x.is_cuda
    if x.is_contiguous() or not x.is_cuda:
        host.copy_(x, non_blocking=nb)
        return
    flat = host.view(-1)
    for start, blk in blocks(x):
        flat[start:start + blk.numel()].view(blk.shape).copy_(blk, non_blocking=nb)


def stager_from(kwargs: dict[str, Any]) -> HostStager:
    return HostStager(kwargs.pop("pinned_cap_bytes", DEFAULT_CAP_BYTES), kwargs.pop("on_cap", "wait"))
