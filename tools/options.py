"""Command-line option parsing shared by the CLI's commands."""
from __future__ import annotations


def tolerance(args):
    """The Tolerance of --tol/--growth; NaN, negative values and unknown names are refused (SettingsError)."""
    from tic_trace.dtypes import known_dtype
    from tic_trace.judge import SettingsError, Tolerance
    per_dtype, per_point = {}, {}
    for item in args.tol or []:
        k, _, v = item.partition("=")
        if not v:
            raise SystemExit(f"--tol expects NAME=VALUE (a dtype like bfloat16 or a point like L3.attn.core), got {item!r}")
        try:
            value = float(v)
        except ValueError:
            raise SettingsError(f"--tol {item!r}: {v!r} is not a number") from None
        (per_dtype if known_dtype(k) else per_point)[k] = value
    growth = args.growth if args.growth is not None else 10.0
    return Tolerance(growth=growth, per_dtype=per_dtype, per_point=per_point)
