"""Command-line option parsing shared by the CLI's commands."""
from __future__ import annotations


def tolerance(args):
    """``--tol NAME=VALUE`` (a dtype or a point) and ``--growth`` as a :class:`tic_trace.diverge.Tolerance`."""
    from tic_trace.diverge import Tolerance
    from tic_trace.dtypes import known_dtype
    per_dtype, per_point = {}, {}
    for item in args.tol or []:
        k, _, v = item.partition("=")
        if not v:
            raise SystemExit(f"--tol expects NAME=VALUE (a dtype like bfloat16 or a point like L3.attn.core), got {item!r}")
        (per_dtype if known_dtype(k) else per_point)[k] = float(v)
    return Tolerance(growth=args.growth, per_dtype=per_dtype, per_point=per_point)
