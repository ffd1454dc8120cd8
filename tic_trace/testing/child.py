"""A command run in a child process by a test, without a wall-clock deadline. Test support only.

`subprocess.run(..., timeout=300)` fails a test whose child is merely slow: on a loaded 2-core machine a CLI
run, a demo or a slime scenario can take several times its usual time. `run` waits for the child however long it
works, and kills it as hung only when its whole process tree (the child and every descendant, reaped ones
included) used no CPU time for `stall_s` seconds: a deadlock, or a read that never returns."""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from . import spawn
from .spawn import STALL_S, StallWatch

_POLL_S = 1.0


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU ticks of the process and of its reaped children); None when unreadable."""
    f = spawn.proc_stat(pid)
    return None if f is None else (f[0], sum(f[1:]))


def tree_ticks(root: int) -> int | None:
    """CPU ticks used by `root` and every process below it (None without /proc: nothing is ever called hung)."""
    if not os.path.isdir("/proc"):
        return None
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = _stat(int(name))
            if s is not None:
                stats[int(name)] = s
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)     # the child leads its own process group (start_new_session)
    except OSError:
        proc.kill()


def run(cmd: list[str], *, stall_s: float = STALL_S, **kw: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, **kw)` (`capture_output`, `text`, `cwd`, `env`, `input`, `check`...) with no deadline:
    the child is killed, and TimeoutError raised, only when its process tree used no CPU time for `stall_s`."""
    check = kw.pop("check", False)
    if kw.pop("capture_output", False):
        kw["stdout"], kw["stderr"] = subprocess.PIPE, subprocess.PIPE
    data = kw.pop("input", None)
    if data is not None:
        kw["stdin"] = subprocess.PIPE
    watch = StallWatch(stall_s, spawn._now)
    with subprocess.Popen(cmd, start_new_session=True, **kw) as proc:
        pending = data
        while True:
            try:
                out, err = proc.communicate(pending, timeout=_POLL_S)   # retried: no output is lost
                break
            except subprocess.TimeoutExpired:
                pending = None
            if watch.stalled((tree_ticks(proc.pid),)):
                _kill_tree(proc)
                proc.communicate()
                raise TimeoutError(f"{cmd[:3]} hung: its processes used no CPU time for {stall_s:g}s (killed)")
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
