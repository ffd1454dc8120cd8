"""Command-line option parsing shared by the CLI's commands: each check is an argparse `type`, so a bad value
fails at parse time with one line naming the option (exit status 2)."""
from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import stat
import sys
from pathlib import Path

from tic_trace.text import visible



class Parser(argparse.ArgumentParser):
    """Usage errors as one line (`tic-trace inspect: error: argument --limit: ...`), exit status 2."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {visible(message)} (see {self.prog} --help)\n")
        sys.exit(2)


def count(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {v}")
    return v


def positive(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {s!r}")
    return v


def tol_item(item: str) -> tuple[str, float]:
    """NAME=VALUE, NAME a dtype (bfloat16) or a canonical point (attn.core, L3.mid)."""
    from tic_trace.canonical import BY_NAME, parse_key
    from tic_trace.dtypes import known_dtype
    name, eq, value = item.partition("=")
    if not eq or not name or not value:
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE (a dtype like bfloat16=0.02 or a point like L3.attn.core=1e-3), got {item!r}")
    point, _ = parse_key(name)
    if not known_dtype(name) and point not in BY_NAME:
        close = difflib.get_close_matches(point, list(BY_NAME), n=3)
        raise argparse.ArgumentTypeError(f"{name!r} is neither a dtype nor a canonical point"
                                         + (f" (did you mean {', '.join(close)}?)" if close else ""))
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{item!r}: the tolerance must be a number") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{item!r}: the tolerance must be a finite number, 0 or more")
    return name, v


def record_pattern(s: str) -> str:
    if s.startswith("re:"):
        try:
            re.compile(s[3:])
        except re.error as e:
            raise argparse.ArgumentTypeError(f"{s!r} is not a regular expression: {e}") from None
    return s


def output_file(s: str) -> str:
    """A report file to write: a regular file or a new name, in an existing writable directory."""
    p = Path(s)
    if p.exists() or p.is_symlink():
        try:
            mode = p.stat().st_mode
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{s}: {e.strerror}") from None
        if stat.S_ISDIR(mode):
            raise argparse.ArgumentTypeError(f"{s} is a directory; give a file name, e.g. {p / 'report'}")
        if not stat.S_ISREG(mode):
            raise argparse.ArgumentTypeError(f"{s} is not a regular file (a device or pipe)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{s}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{s}: directory {parent} is not writable")
    return s


def input_file(s: str) -> str:
    p = Path(s)
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{s}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise argparse.ArgumentTypeError(f"{s} is not a regular file")
    return s


def tolerance(args):
    """The Tolerance of --tol/--growth (parsed by tol_item/positive); Tolerance refuses what it cannot judge with."""
    from tic_trace.dtypes import known_dtype
    from tic_trace.judge import DEFAULT_GROWTH, Tolerance
    per_dtype, per_point = {}, {}
    for name, value in args.tol or []:
        (per_dtype if known_dtype(name) else per_point)[name] = value
    growth = args.growth if args.growth is not None else DEFAULT_GROWTH
    return Tolerance(growth=growth, per_dtype=per_dtype, per_point=per_point)
