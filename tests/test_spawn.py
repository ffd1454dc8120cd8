"""Multi-process test runs have no wall-clock deadline (tic_trace/testing/spawn.py): ranks that work finish
however long a loaded machine makes them take; only ranks that use no CPU time at all for `stall_s` (a
deadlock) are killed, named as hung. Real spawned processes; the clock is made to run fast where a test must
show that no deadline of the clock ends a working run."""
from __future__ import annotations

import itertools
import sys
import time

import pytest

from tic_trace.testing import spawn


def _work(rank: int, world: int, port: int, out: str) -> None:
    """Compute for 0.3 s of this process's own CPU time (however long the machine takes to give it), then say so."""
    start = time.process_time()
    x = 0
    while time.process_time() - start < 0.3:
        x += 1
    with open(f"{out}.{rank}", "w") as f:
        f.write("done")


def _hang(rank: int, world: int, port: int) -> None:
    time.sleep(3600)          # waits like a rank in a collective whose peer never comes: no CPU time


def test_working_ranks_finish_past_any_deadline_of_the_clock(tmp_path, monkeypatch):
    """The watch's clock advances 100 s at every poll: the run lasts hours by it (the old 300 s deadline failed
    the TP=2 test on a loaded machine), and finishes, because the ranks keep using CPU time."""
    fake = itertools.count(0, 100)
    monkeypatch.setattr(spawn, "_now", lambda: float(next(fake)))
    spawn.spawn_ranks(_work, 2, args=(str(tmp_path / "r"),))
    assert [(tmp_path / f"r.{r}").read_text() for r in (0, 1)] == ["done", "done"]


def test_ranks_using_no_cpu_time_are_killed_as_hung():
    with pytest.raises(TimeoutError, match="_hang on 1 ranks hung: no rank used any CPU time for 3s"):
        spawn.spawn_ranks(_hang, 1, stall_s=3)


def test_the_watch_resets_on_any_progress():
    clock = itertools.count(0, 250)
    watch = spawn.StallWatch(600, lambda: float(next(clock)))
    assert not any(watch.stalled((i, 7)) for i in range(100))      # 25,000 s of the clock, progressing
    assert [watch.stalled((99, 7)) for _ in range(4)] == [False, False, True, True]
    assert not watch.stalled((99, None))                            # unreadable: never taken as a hang


_BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\nprint('done')"


def test_a_working_child_finishes_past_any_deadline_of_the_clock(monkeypatch):
    """tic_trace.testing.child.run, what tests run their CLI and scripts with: no deadline either."""
    from tic_trace.testing import child
    fake = itertools.count(0, 100)
    monkeypatch.setattr(spawn, "_now", lambda: float(next(fake)))
    r = child.run([sys.executable, "-c", _BUSY], capture_output=True, text=True)
    assert (r.returncode, r.stdout) == (0, "done\n")


def test_a_child_tree_using_no_cpu_time_is_killed_as_hung():
    from tic_trace.testing import child
    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)']); time.sleep(3600)"
    with pytest.raises(TimeoutError, match="hung: its processes used no CPU time for 2s"):
        child.run([sys.executable, "-c", sleeper], capture_output=True, stall_s=2)
