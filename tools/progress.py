"""A progress bar on stderr while a command measures or replays, only when stderr is a terminal: a pipe or a
CI log gets nothing (its bytes are the report's, or nobody's)."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def progress(total: int, what: str = "comparing") -> Iterator[Callable[[str], None]]:
    """`with progress(n, "replaying") as step: ... step(point_key)`: one step per point, shown on a TTY only."""
    if not sys.stderr.isatty():
        yield lambda key: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    # markup=False: a point key is shown as it is, never parsed as rich markup
    with Progress(TextColumn(f"{what} {{task.fields[key]:<24}}", markup=False), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task(what, total=total, key="")
        yield lambda key: prog.update(task, advance=1, key=key)
