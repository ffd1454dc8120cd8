"""Multi-process test runs on gloo: one fresh (spawned) process per rank. Test support only.

No wall-clock deadline: on a loaded 2-core machine a TP=2 forward took longer than the 300 s it was given and
the test failed with nothing wrong. What is bounded instead is *no progress*: the ranks are killed as hung only
when none of them has used any CPU time for `stall_s` seconds (a deadlock: every rank waiting on a collective
or a lock). A rank that computes, however slowly the machine lets it, keeps its run alive; a rank that dies
ends the run at once with its traceback."""
from __future__ import annotations

import socket
import time
from typing import Callable

#: seconds without any CPU time used by any rank after which a run is taken as hung (a hang detector only: a
#: rank that works uses CPU time every second it is scheduled, on a loaded machine too)
STALL_S = 600.0
_POLL_S = 0.5
_now = time.monotonic          # the clock the watch reads (a test makes it run fast)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (pick it in the parent and hand it to every rank)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stat(pid: int) -> tuple[int, int, int, int, int] | None:
    """(ppid, utime, stime, cutime, cstime) of process `pid` from /proc (CPU times in clock ticks); None when it
    cannot be read (the process is gone, or no /proc: then no stall can be seen and nothing is killed)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()      # after the command name, which may hold spaces
    try:
        return int(fields[1]), int(fields[11]), int(fields[12]), int(fields[13]), int(fields[14])
    except (IndexError, ValueError):
        return None


def cpu_ticks(pid: int) -> int | None:
    """CPU time (user + system, in clock ticks) of process `pid` and its threads; None when it cannot be read."""
    f = proc_stat(pid)
    return None if f is None else f[1] + f[2]


class StallWatch:
    """Whether a set of processes made no progress (used no CPU time) for `stall_s` seconds of `clock`."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic):
        self.stall_s, self.clock = stall_s, clock
        self.last: tuple | None = None
        self.since = clock()

    def stalled(self, ticks: tuple) -> bool:
        """`ticks`: each process's CPU time now (None where unreadable). True when none changed for stall_s."""
        now = self.clock()
        if ticks != self.last or any(t is None for t in ticks):
            self.last, self.since = ticks, now
            return False
        return now - self.since > self.stall_s


def spawn_ranks(fn: Callable[..., None], world: int, args: tuple = (), stall_s: float = STALL_S) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` fresh processes (spawn context) and wait.

    ``fn`` must be a top-level, importable function; it initialises its framework's process groups itself
    on the port picked here. A failing rank raises ``torch.multiprocessing.ProcessRaisedException`` with
    the rank's traceback (the other ranks are terminated). There is no deadline: ranks are killed and
    ``TimeoutError`` is raised only when none of them used CPU time for ``stall_s`` seconds (hung). Hand
    results back through files, not tensors on a queue (a rank that exits before the parent unpickles breaks
    fd sharing).
    """
    import torch.multiprocessing as tmp

    port = free_port()
    ctx = tmp.start_processes(fn, args=(world, port, *args), nprocs=world, join=False, start_method="spawn")
    watch = StallWatch(stall_s, _now)
    while not ctx.join(timeout=_POLL_S):
        if watch.stalled(tuple(cpu_ticks(p.pid) for p in ctx.processes if p.is_alive())):
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            for proc in ctx.processes:
                proc.join(5)
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world} ranks hung: no rank used any CPU time "
                               f"for {stall_s:g}s (a deadlock; a slow machine still shows CPU time)")
