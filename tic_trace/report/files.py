"""Writing a report where asked: the JSON file and the HTML page, through symlinks, atomically for a regular
file, in place for a character device or pipe."""
from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console

from .text import text


def write_reports(report: dict, console: Console, json_path: str | None = None, html_path: str | None = None) -> None:
    """Write the JSON and/or HTML report where asked, and say where."""
    if json_path:
        write_json(report, json_path)
        console.print(text(f"JSON report: {json_path}"))
    if html_path:
        from .html import render_html
        write_output(html_path, render_html(report).encode("utf-8"))
        console.print(text(f"HTML report: {html_path}"))


def write_json(report: dict, path: os.PathLike | str) -> None:
    """Write atomically (store.format.atomic_write): a failed write leaves neither a partial report nor a temporary file."""
    write_output(path, json.dumps(report, indent=1).encode("utf-8"))


def write_output(path: os.PathLike | str, data: bytes) -> None:
    """A report file: through a symlink to its target (the link stays a link, pointing where it did), atomically
    for a regular file or a new name (a hard link to another file is never written into), and in place for a
    character device or pipe (/dev/stdout, /dev/null), where no rename can land."""
    import stat

    from ..store.format import atomic_write
    try:
        mode = os.stat(path).st_mode      # the link's target (a pipe behind /dev/fd/N has no path to resolve)
    except FileNotFoundError:
        mode = None
    if mode is not None and (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        with open(path, "wb") as f:
            f.write(data)
        return
    atomic_write(Path(os.path.realpath(path)), data)
