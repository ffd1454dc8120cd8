"""Writing a trace: one rank's share of one run (`TraceWriter`), one pass streamed as it is recorded
(`PassWriter`: tensor bytes to the blob as they arrive, the index at `close`), the claim that a directory holds
one run (`claim_run_directory`), and the background fsync of closed passes' blobs (`wait_for_disk`).

Files are written under a temporary name and renamed, blob before index, so the presence of an index means its
pass was written whole (format.py describes the layout and the reader).
"""
from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

from .errors import TraceFormatError
from .format import (KIND_INDEX, KIND_MANIFEST, KIND_RANK, SCHEMA_VERSION, USED_LOGPROBS_DIR, Record, crc32,
                     list_passes, new_temp_file, pass_index_name, pass_stem, rank_dir_name, read_framed, write_framed)


class TraceDirectoryInUse(FileExistsError):
    """`trace()` into a directory that already holds another run's passes for this rank."""


_IDLE_EXIT_S = 0.5     # the fsync thread ends after this long with nothing to do


class _BackgroundSync:
    """One daemon thread per process that fsyncs, then closes, the blobs of closed passes, so closing a pass
    does not wait for the disk (`durable=False`, the default). Readers see the bytes at once through the page
    cache; what a machine crash (not a process crash) can cost is the last passes, whose CRCs then name the
    damage. `wait()` returns when everything handed over is on disk."""

    def __init__(self) -> None:
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _after_fork_in_child(self) -> None:
        # A forked child inherits `_thread` set but not the thread itself: its blobs would never be fsynced
        # or closed and `wait()` would never return. The parent's queued files are the parent's to sync.
        self.__init__()

    def fsync_and_close(self, f) -> None:
        with self._lock:
            self._queue.put(f)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tic-trace-fsync", daemon=True)
                self._thread.start()

    def wait(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        # The thread ends once idle: a process that traced and then compares may fork its workers again
        # (parallel.fork_is_safe wants no other thread).
        while True:
            try:
                f = self._queue.get(timeout=_IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                os.fsync(f.fileno())
                f.close()
            except OSError:
                # Durability is best effort here: the bytes are already written and readable, and a write the
                # file system failed to keep shows as a CRC mismatch when read. A close that raises (NFS
                # reports write errors there) must neither end this thread nor leave `wait()` blocked.
                _close_quietly(f)
            finally:
                self._queue.task_done()


def _close_quietly(f) -> None:
    try:
        f.close()
    except OSError:
        pass


_BACKGROUND_SYNC = _BackgroundSync()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_BACKGROUND_SYNC._after_fork_in_child)


def wait_for_disk() -> None:
    """Block until every pass closed with `durable=False` in this process has been fsynced."""
    _BACKGROUND_SYNC.wait()


class PassWriter:
    """Streams one pass: tensor bytes go to the blob as they arrive, the index is written at `close`. The blob
    is fsynced before `close` returns when `durable`, else by a background thread (`_BackgroundSync`)."""

    def __init__(self, rank_dir: Path, index: int, meta: dict, durable: bool = False):
        self.rank_dir = rank_dir
        self.index = index
        self.meta = dict(meta)
        self.durable = durable
        self.records: list[Record] = []
        self._blob_path = rank_dir / f"{pass_stem(index)}.bin"
        fd, self._tmp = new_temp_file(rank_dir, pass_stem(index), ".bin.tmp")
        self._blob = os.fdopen(fd, "wb")
        self._size = 0

    def write_bytes(self, data) -> tuple[int, int, int]:
        """Append `data` (bytes-like) to the blob; returns (offset, nbytes, crc32)."""
        mv = memoryview(data).cast("B")
        offset = self._size
        self._blob.write(mv)
        self._size += mv.nbytes
        return offset, mv.nbytes, crc32(mv)

    def add(self, rec: Record) -> None:
        self.records.append(rec)

    def close(self, incomplete: str | None = None) -> Path:
        """Write the index. `incomplete`: why the pass is not a whole forward (its forward raised, or it
        ended inside one); such a pass is kept for a post-mortem under a name readers skip."""
        self._blob.flush()
        if self.durable:
            os.fsync(self._blob.fileno())
            self._blob.close()
        else:
            _BACKGROUND_SYNC.fsync_and_close(self._blob)   # readable now (page cache); on disk shortly after
        os.replace(self._tmp, self._blob_path)
        payload = dict(self.meta)
        payload.update(index=self.index, blob=self._blob_path.name, blob_nbytes=self._size,
                       complete=incomplete is None, incomplete=incomplete,
                       records=[r.to_wire() for r in self.records])
        idx = self.rank_dir / pass_index_name(self.index, complete=incomplete is None)
        write_framed(idx, KIND_INDEX, payload)
        return idx

    def abort(self) -> None:
        try:
            self._blob.close()
        finally:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass


class TraceWriter:
    """Writes one rank's share of one run into a trace directory. The ranks of a job share the directory;
    a directory is written by one run (docs/security.md): the writer refuses a directory that already holds
    passes of another run for its rank, or files that are not a trace, before it writes anything."""

    def __init__(self, out_dir: os.PathLike | str, rank: int, manifest: dict, rank_info: dict, run: str):
        self.root = Path(out_dir)
        self.rank = rank
        self.run = run
        self.rank_dir = self.root / rank_dir_name(rank)
        existing = claim_run_directory(self.root, rank, run)
        self.root.mkdir(parents=True, exist_ok=True)
        m = {"schema": SCHEMA_VERSION, "format": "tic-trace", **manifest, "run": run}
        # Every rank writes the same shared manifest atomically, before its rank directory (a rank that starts
        # later sees a trace, not a stray directory); rank-specific facts live in rank.msgpack.
        write_framed(self.root / "manifest.msgpack", KIND_MANIFEST, m)
        self.rank_dir.mkdir(exist_ok=True)
        self._rank_info = {"rank": rank, **rank_info, "run": run}
        earlier = _incomplete_of_run(self.rank_dir, run) if existing else None
        # A later tracer of the same run (one per micro-batch) must not erase an earlier one's failure.
        write_framed(self.rank_dir / "rank.msgpack", KIND_RANK,
                     self._rank_info if earlier is None else {**self._rank_info, "incomplete": earlier})
        self.next_index = max(existing) + 1 if existing else 0

    def mark_incomplete(self, incomplete: dict) -> bool:
        """Say in `rank.msgpack` that this rank's run ended early (`schema.RunIncomplete`). On a full disk the
        old rank file is removed first (its blocks are the room the new one needs); if even then the new one
        cannot be written, the rank is left without a rank file, which readers report as incomplete
        (`Trace.incomplete_runs`): never a rank file that says nothing went wrong. False in that case."""
        path = self.rank_dir / "rank.msgpack"
        doc = {**self._rank_info, "incomplete": incomplete}
        try:
            write_framed(path, KIND_RANK, doc)
            return True
        except OSError:
            pass
        try:
            os.unlink(path)
        except OSError:     # already gone, or the directory with it: the retry below says which
            pass
        try:
            write_framed(path, KIND_RANK, doc)
            return True
        except OSError:
            return False

    def begin_pass(self, meta: dict, durable: bool = False) -> PassWriter:
        w = PassWriter(self.rank_dir, self.next_index, {**meta, "run": self.run}, durable)
        self.next_index += 1
        return w


def _incomplete_of_run(rank_dir: Path, run: str) -> dict | None:
    """The `incomplete` facts an earlier tracer of `run` left in this rank's file, if any."""
    try:
        info = read_framed(rank_dir / "rank.msgpack", KIND_RANK, rank_dir.parent)
    except (TraceFormatError, OSError):
        return None
    got = info.get("incomplete") if isinstance(info, dict) and info.get("run") == run else None
    return got if isinstance(got, dict) else None


def claim_run_directory(root: Path, rank: int, run: str) -> list[int]:
    """The pass indices `run` already wrote for `rank` in `root` (to continue after them); raises
    TraceDirectoryInUse if `root` holds another run's passes for this rank, or is a non-empty directory that
    is not a trace."""
    if not root.exists():
        return []
    if not root.is_dir():
        raise TraceDirectoryInUse(f"{root} exists and is not a directory: trace into a new directory")
    # the used log-probs may be written before the first pass (another process records them: docs/slime.md)
    visible = [n for n in os.listdir(root) if not n.startswith(".") and n != USED_LOGPROBS_DIR]
    if visible and "manifest.msgpack" not in visible:
        raise TraceDirectoryInUse(f"{root} is not empty and holds no trace ({', '.join(sorted(visible)[:3])}...): "
                                  "trace into a new or empty directory")
    rank_dir = root / rank_dir_name(rank)
    passes, _ = list_passes(rank_dir)
    if not passes:
        return []
    try:
        info = read_framed(rank_dir / "rank.msgpack", KIND_RANK, root)
    except TraceFormatError:
        info = None
    if isinstance(info, dict) and info.get("run") == run:
        return sorted(passes)
    who = f" (written by {info.get('hostname')!r:.60} pid {info.get('pid')!r:.20})" if isinstance(info, dict) else ""
    raise TraceDirectoryInUse(
        f"{rank_dir} already holds {len(passes)} passes of another run{who}. A trace directory holds one run, "
        "so that a reader never mixes old and new passes: trace into a new directory, or delete this one")
