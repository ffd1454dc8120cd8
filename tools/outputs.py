"""Where the CLI's reports go: never onto what it reads, through symlinks, `-` for stdout, a closed pipe harmless.

Rules (docs/security.md, "What the CLI writes"):
- an output (`--json`, `--html`) is refused, before any work, when it is, or resolves (through symlinks) to, a
  path inside a trace directory, the slime run directory or the reference checkpoint named on the command
  line, or the `--from-json` file itself; two outputs may not name one file;
- `-` (or a path that is this process's stdout, such as /dev/stdout) writes that report alone to stdout; the
  terminal report then goes to stderr, so `tic-trace diff A B --json - | jq` reads pure JSON;
- a symlink is written through: its target gets the report, the link stays (report.files.write_output);
- stdout or stderr closed by its reader (`| head -1`) ends the printing, never the command: the verdict's
  exit code stands (`PipeSafe`).
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Any

STDOUT = "-"

# (attribute of the parsed arguments, what it is) for every input a command may name.
_INPUT_DIRS = (("a", "side A's trace"), ("b", "side B's trace"), ("trace", "the trace"),
               ("dir", "the slime run directory"), ("reference", "the reference checkpoint"))
_INPUT_FILES = (("from_json", "the saved report read by --from-json"),)
OUTPUTS = (("json", "--json"), ("html", "--html"))


class OutputRefused(Exception):
    """An output that would land on an input: the message names the path and why (the CLI: one line, exit 2)."""


def is_stdout(path: Any) -> bool:
    """`-`, or a path naming the very file this process's stdout is (/dev/stdout, /proc/self/fd/1)."""
    if path is None:
        return False
    if path == STDOUT:
        return True
    try:
        fd = sys.stdout.fileno()
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except (OSError, ValueError, AttributeError):   # no such file, or stdout is no file (a test's capture)
        return False


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def refuse_inside(outputs: list[tuple[str, str]], inputs: list[tuple[str, str]]) -> None:
    """Raise OutputRefused when an output (option, path) is or lies under an input (what, path), after symlinks."""
    for opt, out in outputs:
        if out is None or is_stdout(out):
            continue
        real_out = os.path.realpath(out)
        for what, inp in inputs:
            if inp is None:
                continue
            real_in = os.path.realpath(inp)
            if _inside(real_out, real_in):
                where = "is" if real_out == real_in else "is inside"
                via = "" if os.path.abspath(out) == real_out else f" (it resolves to {real_out})"
                raise OutputRefused(f"{opt} {out}{via} {where} {what} {inp}: a report written there would replace "
                                    "or mix with what this command reads; write it outside the inputs, "
                                    "e.g. ./report" + (".json" if opt == "--json" else ".html"))


def check_outputs(args) -> None:
    """The command's outputs against its inputs, and against each other (see the module docstring)."""
    outs = [(opt, getattr(args, attr, None)) for attr, opt in OUTPUTS if getattr(args, attr, None) is not None]
    ins = [(what, getattr(args, attr, None)) for attr, what in _INPUT_DIRS + _INPUT_FILES]
    refuse_inside(outs, ins)
    if len(outs) == 2:
        (o1, p1), (o2, p2) = outs
        if is_stdout(p1) and is_stdout(p2):
            raise OutputRefused(f"{o1} and {o2} both name stdout ({p1}, {p2}): stdout can carry one of them; "
                                "write the other to a file")
        if not is_stdout(p1) and os.path.realpath(p1) == os.path.realpath(p2):
            raise OutputRefused(f"{o1} {p1} and {o2} {p2} are one file: the second would replace the first; "
                                "give each its own file")


def wants_stdout(args) -> bool:
    return any(is_stdout(getattr(args, attr, None)) for attr, _ in OUTPUTS)


def write_reports(report: dict, console, json_path: str | None, html_path: str | None) -> None:
    """The JSON and/or HTML report where asked; a file's path is said on `console`, stdout gets the report alone."""
    from tic_trace.report.text import text
    for what, path in (("JSON", json_path), ("HTML", html_path)):
        if not path:
            continue
        data = _render(report, what)
        if is_stdout(path):
            out = PipeSafe(sys.stdout)
            out.write(data if data.endswith("\n") else data + "\n")
            out.flush()
            continue
        from tic_trace.report.files import write_output
        try:
            write_output(path, data.encode("utf-8"))
        except OSError as e:
            raise SystemExit(f"cannot write the {what} report to {path}: {e.strerror or e}") from None
        console.print(text(f"{what} report: {path}"))


def _render(report: dict, what: str) -> str:
    if what == "JSON":
        import json
        return json.dumps(report, indent=1)
    from tic_trace.report.html import render_html
    return render_html(report)


class PipeSafe:
    """A text stream whose reader may go away: the first write or flush that meets a closed pipe (EPIPE)
    turns the stream into a sink, and the file descriptor is pointed at /dev/null so that nothing later
    (the interpreter's final flush included) fails on it. Everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._s = stream
        self.broken = False

    def _closed(self) -> None:
        self.broken = True
        try:
            fd = self._s.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass

    def _call(self, fn, *args):
        """`fn(*args)` on the stream; a closed pipe (EPIPE) ends all further output instead of raising."""
        if self.broken:
            return None
        try:
            return fn(*args)
        except BrokenPipeError:
            pass
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
        self._closed()
        return None

    def write(self, s: str) -> int:
        n = self._call(self._s.write, s)
        return len(s) if n is None else n

    def flush(self) -> None:
        self._call(self._s.flush)

    def __getattr__(self, name: str):
        return getattr(self._s, name)

