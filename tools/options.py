"""Command-line option parsing shared by the CLI's commands: each check is an argparse `type`, so a bad value
fails at parse time with one line naming the option (exit status 2)."""
from __future__ import annotations

import argparse
import math
import os
import re
import stat
import sys
from pathlib import Path

from tic_trace.report.text import visible



class Parser(argparse.ArgumentParser):
    """Usage errors as one line (`tic-trace inspect: error: argument --limit: ...`), exit status 2."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {visible(message)} (see {self.prog} --help)\n")
        sys.exit(2)


def _whole(s: str, minimum: int, expected: str = "a whole number") -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {s!r}") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {s!r}")
    return v


def count(s: str) -> int:
    return _whole(s, 0)


def at_least_one(s: str) -> int:
    """A budget that 0 would empty (--attribution-tokens): refused, never read as the default."""
    return _whole(s, 1)


def positive(s: str) -> float:
    return _finite(s, above_zero=True)


def nats(s: str) -> float:
    """A mean |Δ| in nats (--slime-metric): finite, 0 or more."""
    return _finite(s, above_zero=False, what="a number of nats")


def _finite(s: str, *, above_zero: bool, what: str = "a number") -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
    if not (math.isfinite(v) and (v > 0 if above_zero else v >= 0)):
        raise argparse.ArgumentTypeError(f"must be a finite number {'above 0' if above_zero else '0 or more'}, "
                                         f"got {s!r}")
    return v


def tol_item(item: str) -> tuple[str, float]:
    """NAME=VALUE, NAME a dtype (bfloat16) or a canonical point (attn.core, L3.mid)."""
    from tic_trace.store.dtypes import known_dtype
    from tic_trace.compare.judge import SettingsError, check_point_key
    name, eq, value = item.partition("=")
    if not eq or not name or not value:
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE (a dtype like bfloat16=0.02 or a point like L3.attn.core=1e-3), got {item!r}")
    if not known_dtype(name):
        try:
            check_point_key(name)
        except SettingsError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{item!r}: the tolerance must be a number") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{item!r}: the tolerance must be a finite number, 0 or more")
    return name, v


def accept_point(name: str) -> str:
    """A canonical point name (moe.topk_weights) or key (L1.moe.topk_weights) whose precision difference
    is accepted; anything else is refused naming the closest points."""
    from tic_trace.compare.judge import SettingsError, check_accept_precision
    try:
        return check_accept_precision([name])[0]
    except SettingsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


ACCEPT_PRECISION_HELP = ("accept a precision difference at this point (a point like moe.topk_weights or a key like "
                         "L1.moe.topk_weights; repeatable): shown as accepted, it does not decide the verdict. "
                         "Common: moe.topk_weights (megatron-core rounds the top-k weights to bf16, SGLang keeps "
                         "fp32)")
GROWTH_HELP = "a point diverges when its error exceeds its inputs' error by this factor (default 10)"
TOL_HELP = "relative-L2 tolerance for a dtype (bfloat16=0.02) or a point (attn.core=1e-4, L3.mid=1e-3); repeatable"
WORST_TOKENS_HELP = "how many tokens with the largest |Δ logprob| to report, with where each one's divergence starts (default 8)"
JSON_HELP = ("also write the JSON report here (every point and token, unbounded); '-': the JSON alone on stdout, "
             "the terminal report then goes to stderr")
HTML_HELP = "also write a self-contained HTML report here; '-': the page alone on stdout, the terminal report to stderr"

WORKERS_HELP = ("measure the points in N processes, or as Ray tasks with ray:N (on the cluster ray.init "
                "connects to, else a local Ray of N CPUs); the report is the same (default 1: in this process)")


def workers(s: str) -> tuple[str, int]:
    """--workers N (N processes) or ray:N (Ray tasks; a local Ray of N CPUs unless ray.init already ran)."""
    backend, colon, n = s.rpartition(":")
    backend = backend if colon else "processes"
    if backend not in ("processes", "ray"):
        raise argparse.ArgumentTypeError(f"expected N or ray:N (e.g. 4 or ray:8), got {s!r}")
    return backend, _whole(n, 1, f"a whole number of workers (N or ray:N) in {s!r}")


def record_pattern(s: str) -> str:
    if s.startswith("re:"):
        try:
            re.compile(s[3:])
        except re.error as e:
            raise argparse.ArgumentTypeError(f"{s!r} is not a regular expression: {e}") from None
    return s


def output_file(s: str) -> str:
    """A report file to write: `-` (stdout), a regular file or a new name in an existing writable directory, or a
    character device or pipe (/dev/stdout, /dev/null). A symlink is judged by its target, which gets the report
    (the link stays). Whether it lands on an input is checked once all arguments are known (tools/outputs.py)."""
    if s == "-":
        return s
    try:
        mode = os.stat(s).st_mode         # a symlink's target
    except FileNotFoundError:
        mode = None                       # a new name, or a link to one
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{s}: {e.strerror}") from None
    real = Path(os.path.realpath(s))
    if mode is not None:
        if stat.S_ISDIR(mode):
            raise argparse.ArgumentTypeError(f"{s} is a directory; give a file name, e.g. {Path(s) / 'report'}")
        if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
            return s                  # a stream: written in place (a pipe, /dev/stdout, /dev/null)
        if not stat.S_ISREG(mode):
            raise argparse.ArgumentTypeError(f"{s} is not a regular file, a character device or a pipe")
    parent = real.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{s}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{s}: directory {parent} is not writable")
    return s


def checkpoint_dir(s: str) -> str:
    """An HF checkpoint directory for --reference: a directory holding config.json (the weights are checked
    when it is opened)."""
    p = Path(s)
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"{s} is not a directory: give the HF checkpoint directory "
                                         "(config.json + *.safetensors), e.g. slime's --hf-checkpoint")
    if not (p / "config.json").exists():     # what kind of file it is, HFCheckpoint checks (without blocking)
        raise argparse.ArgumentTypeError(f"{s} has no config.json: give the HF checkpoint directory "
                                         "(config.json + *.safetensors)")
    return s


def layer_list(s: str) -> list[int]:
    """'0-3,7' -> [0, 1, 2, 3, 7]."""
    out: list[int] = []
    for part in s.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected layers like 0-3,7, got {s!r}") from None
        if a < 0 or b < a or b - a > 65536:
            raise argparse.ArgumentTypeError(f"{part.strip()!r}: give a range low-high with 0 <= low <= high")
        out.extend(range(a, b + 1))
    return out


def torch_device(s: str) -> str:
    """cpu, cuda, cuda:N, mps, xpu:N, ... (a torch device string) that this machine has, checked when the
    arguments are read, before any work: `meta` holds no values (nothing could be replayed), and a device
    this machine lacks would fail only after the whole comparison."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*(:\d+)?", s):
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu or cuda:0, got {s!r}")
    if s == "cpu":
        return s
    import torch
    try:
        dev = torch.device(s)
    except (RuntimeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{s!r} is not a torch device ({e}); use cpu or cuda:0") from None
    if dev.type == "meta":
        raise argparse.ArgumentTypeError("meta holds shapes, not values: the float64 replay needs a device that "
                                         "computes; use cpu or cuda:0")
    if dev.type == "cpu":
        return s
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if not callable(available) or not available():
        raise argparse.ArgumentTypeError(f"{s}: this machine has no {dev.type} device that torch can use; "
                                         "use cpu (the default), or run where the device is")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        raise argparse.ArgumentTypeError(f"{s}: this machine has {count()} {dev.type} device(s) "
                                         f"(0 to {count() - 1}); pick one of those")
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
    from tic_trace.store.dtypes import known_dtype
    from tic_trace.compare.judge import DEFAULT_GROWTH, Tolerance
    per_dtype, per_point = {}, {}
    for name, value in args.tol or []:
        (per_dtype if known_dtype(name) else per_point)[name] = value
    growth = args.growth if args.growth is not None else DEFAULT_GROWTH
    return Tolerance(growth=growth, per_dtype=per_dtype, per_point=per_point)
