"""A test-support timer: fail with TimeoutError instead of hanging (a FIFO read without O_NONBLOCK waits for a
writer forever; the reader must never do that)."""
from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def deadline(seconds: int, what: str = "still running"):
    def boom(*_):
        raise TimeoutError(f"{what} after {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
