"""Multi-process test runs on gloo: one fresh (spawned) process per rank. Test support only."""
from __future__ import annotations

import socket
import time
from typing import Callable


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (pick it in the parent and hand it to every rank)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn: Callable[..., None], world: int, args: tuple = (), timeout_s: float = 300.0) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` fresh processes (spawn context) and wait.

    ``fn`` must be a top-level, importable function; it initialises its framework's process groups itself
    on the port picked here. A failing rank raises ``torch.multiprocessing.ProcessRaisedException`` with
    the rank's traceback (the other ranks are terminated); ranks still running after ``timeout_s`` are
    killed and ``TimeoutError`` is raised. Hand results back through files, not tensors on a queue (a rank
    that exits before the parent unpickles breaks fd sharing).
    """
    import torch.multiprocessing as tmp

    port = free_port()
    ctx = tmp.start_processes(fn, args=(world, port, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=0.5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            for proc in ctx.processes:
                proc.join(5)
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world} ranks did not finish in {timeout_s}s")
