"""Writing a report where asked: the JSON file (atomically) and the HTML page."""
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
        Path(html_path).write_text(render_html(report), encoding="utf-8")
        console.print(text(f"HTML report: {html_path}"))


def write_json(report: dict, path: os.PathLike | str) -> None:
    """Write atomically (store.format.atomic_write): a failed write leaves neither a partial report nor a temporary file."""
    from ..store.format import atomic_write
    atomic_write(Path(path), json.dumps(report, indent=1).encode("utf-8"))
