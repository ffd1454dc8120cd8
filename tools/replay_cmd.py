"""`tic-trace replay TRACE --reference HF_DIR`: one trace against the exact reference, no second side needed.

Per canonical point: the side's intrinsic error (mean/max ULP in its dtype, share of elements equal to the
correctly rounded exact value, relative L2, excess over the rounding floor) and whether it is abnormal for
that op (over the envelope clean implementations show; docs/replay.md). Exit 0: every replayed point within
its envelope; 1: some point abnormal; 2: an error (unreadable trace or checkpoint).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table


def parse_layers(text: str | None) -> list[int] | None:
    """'0-3,7' -> [0, 1, 2, 3, 7]; None -> None (every layer and the global points)."""
    if not text:
        return None
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            out.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise SystemExit(f"--layers expects e.g. 0-3,7, got {text!r}") from None
    return out


def add_parser(sub) -> None:
    sp = sub.add_parser("replay", help="replay every canonical op of one trace exactly (float64) against an HF "
                                       "checkpoint: is each op correctly rounded?")
    sp.add_argument("trace")
    sp.add_argument("--reference", required=True, metavar="HF_DIR",
                    help="HF checkpoint directory (config.json + *.safetensors) with the weights the trace ran")
    sp.add_argument("--adapter", help="adapter (default: the framework named in the trace's manifest)")
    sp.add_argument("--layers", help="only these layers, e.g. 0-3,7 (default: all layers and the global points)")
    sp.add_argument("--device", default="cpu", help="torch device for the float64 reference (default cpu)")
    sp.add_argument("--json", help="also write the per-point numbers here")
    sp.set_defaults(fn=run)


def _row(r) -> list[str]:
    from tic_trace.intrinsic import NotReplayed
    from tic_trace.intrinsic_verdict import DEFAULT_MARGINS, abnormal
    if isinstance(r, NotReplayed):
        return [r.key, "", "", "", "", "", "", "", f"[dim]not replayed: {r.reason}[/]"]
    if r.kind == "ids":
        flag = "[bold red]ABNORMAL[/]" if abnormal(r) else "ok"
        return [r.key, r.dtype, str(r.rows), "", "", f"{r.share_rounded:.1%} rows", "", "", flag]
    limit = DEFAULT_MARGINS.limit(r.point, r.dtype)
    flag = "[bold red]ABNORMAL[/]" if abnormal(r) else ("ok" if math.isfinite(limit) else "ok (no envelope)")
    return [r.key, r.dtype, str(r.rows), f"{r.mean_ulp:.3f}", f"{r.max_ulp:.3g}", f"{r.share_rounded:.1%}",
            f"{r.rel_l2:.2e}", f"{r.excess:.2f}" + (f" / {limit:.2f}" if math.isfinite(limit) else ""), flag]


def run(args, console: Console) -> int:
    from tic_trace.align import CanonicalView
    from tic_trace.intrinsic import IntrinsicError, replay_side
    from tic_trace.intrinsic_verdict import abnormal
    from tic_trace.reference import ExactReference
    ref = ExactReference(args.reference, device=args.device)
    results = replay_side(CanonicalView(args.trace, args.adapter), ref, parse_layers(args.layers))
    table = Table(title=f"intrinsic error of {args.trace} against the exact ops of {args.reference}")
    for col in ("point", "dtype", "rows", "mean ULP", "max ULP", "correctly rounded", "rel L2",
                "excess / limit", ""):
        table.add_column(col, justify="left" if col in ("point", "") else "right")
    for r in results:
        table.add_row(*_row(r))
    console.print(table)
    bad = [r for r in results if isinstance(r, IntrinsicError) and abnormal(r)]
    done = sum(isinstance(r, IntrinsicError) for r in results)
    if args.json:
        Path(args.json).write_text(json.dumps([{"key": r.key, **_json(r)} for r in results], indent=1))
    if not done:
        console.print("[bold red]error:[/] no point could be replayed (see the reasons above)")
        return 2
    if bad:
        console.print(f"[bold red]ABNORMAL[/] at {', '.join(r.key for r in bad)}: the op's output is further "
                      "from exact than clean implementations of it are (excess over the rounding floor)")
        return 1
    console.print(f"ok: {done} points replayed, every one within its op's envelope")
    return 0


def _json(r) -> dict:
    d = dict(vars(r))
    if hasattr(r, "excess"):
        d["excess"] = r.excess
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            d[k] = None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return d
