"""`tic-trace`: thin command-line front end over the library.

Exit codes: 0 consistent (or command succeeded), 1 divergence found, 2 error (bad input, unreadable trace).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console


def _tolerance(args):
    from tic_trace.diverge import Tolerance
    per_dtype, per_point = {}, {}
    for item in args.tol or []:
        k, _, v = item.partition("=")
        if not v:
            raise SystemExit(f"--tol expects NAME=VALUE (a dtype like bfloat16 or a point like L3.attn.core), got {item!r}")
        from tic_trace.dtypes import known_dtype
        (per_dtype if known_dtype(k) else per_point)[k] = float(v)
    return Tolerance(growth=args.growth, per_dtype=per_dtype, per_point=per_point)


def _views(args, console):
    from tic_trace.align import CanonicalView
    va = CanonicalView(args.a, args.adapter_a)
    vb = CanonicalView(args.b, args.adapter_b)
    return va, vb


def _run_compare(args, console: Console) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tic_trace.diverge import find_divergence
    va, vb = _views(args, console)
    total = len(set(va.points()) & set(vb.points()))
    with Progress(TextColumn("comparing {task.fields[key]:<24}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                  disable=not sys.stderr.isatty()) as prog:
        task = prog.add_task("cmp", total=total, key="")
        rep = find_divergence(va, vb, tolerance=_tolerance(args), worst_tokens=args.worst_tokens,
                              progress=lambda k: prog.update(task, advance=1, key=k))
    return rep.to_json()


def _emit(report: dict, args, console: Console, all_points: bool) -> int:
    from tic_trace.report import render_terminal, write_reports
    render_terminal(report, console, all_points=all_points)
    write_reports(report, console, getattr(args, "json", None), getattr(args, "html", None))
    return 1 if report["verdict"] == "divergent" else 0


def cmd_diff(args, console):
    return _emit(_run_compare(args, console), args, console, all_points=True)


def cmd_first(args, console):
    return _emit(_run_compare(args, console), args, console, all_points=False)


def cmd_report(args, console):
    if args.from_json:
        from tic_trace.diverge import rejudge
        report = json.loads(Path(args.from_json).read_text())
        if args.tol or args.growth != 10.0:
            report = rejudge(report, _tolerance(args))
    else:
        if not args.b:
            raise SystemExit("report: give two traces A B, or --from-json saved.json")
        report = _run_compare(args, console)
    return _emit(report, args, console, all_points=args.all)


def cmd_inspect(args, console):
    from tic_trace.inspect import inspect_trace
    inspect_trace(args.trace, console, rank=args.rank, pass_index=args.pass_index, pattern=args.filter,
                  records=args.records, points=args.points, limit=args.limit)
    return 0


def cmd_demo(args, console):
    from tic_trace.tools.demo import run_demo
    return run_demo(args, console)


def cmd_slime_report(args, console):
    from tic_trace.adapters.slime import slime_report
    return slime_report(args, console)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tic-trace", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def compare_args(sp, two=True):
        sp.add_argument("a", help="reference trace directory (e.g. the training side)")
        sp.add_argument("b", nargs=None if two else "?", help="trace directory to check (e.g. the rollout side)")
        sp.add_argument("--adapter-a", help="adapter for A (default: the framework named in A's manifest)")
        sp.add_argument("--adapter-b", help="adapter for B (default: the framework named in B's manifest)")
        sp.add_argument("--growth", type=float, default=10.0,
                        help="a point diverges when its error exceeds its inputs' error by this factor (default 10)")
        sp.add_argument("--tol", action="append", metavar="NAME=VALUE",
                        help="relative-L2 tolerance for a dtype (bfloat16=0.02) or a point (attn.core=1e-4, L3.mid=1e-3)")
        sp.add_argument("--worst-tokens", type=int, default=8)
        sp.add_argument("--json", help="also write the JSON report here")
        sp.add_argument("--html", help="also write a self-contained HTML report here")

    sp = sub.add_parser("diff", help="compare two traces over every canonical point")
    compare_args(sp)
    sp.set_defaults(fn=cmd_diff)
    sp = sub.add_parser("first-divergence", help="the first point where two traces stop agreeing (answer first)")
    compare_args(sp)
    sp.set_defaults(fn=cmd_first)
    sp = sub.add_parser("report", help="write JSON/HTML reports; re-judge a saved JSON with new tolerances")
    compare_args(sp, two=False)
    sp.add_argument("--from-json", help="re-render (and with --tol/--growth re-judge) a saved JSON report; A is ignored")
    sp.add_argument("--all", action="store_true", help="print every point, not only the curve")
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("inspect", help="what a trace holds: passes, records, sizes, canonical points")
    sp.add_argument("trace")
    sp.add_argument("--rank", type=int)
    sp.add_argument("--pass", dest="pass_index", type=int)
    sp.add_argument("--filter", help="glob (or re:regex) over record names")
    sp.add_argument("--records", action="store_true", help="list records")
    sp.add_argument("--points", action="store_true", help="list the canonical points the adapter finds")
    sp.add_argument("--limit", type=int, default=200)
    sp.set_defaults(fn=cmd_inspect)

    sp = sub.add_parser("demo", help="trace a built-in tiny model twice (once with a planted fault) and find it")
    sp.add_argument("--pair", default="hf-hf", choices=["hf-hf", "hf-megatron", "megatron-sglang", "hf-sglang"],
                    help="which two implementations to compare (default hf-hf)")
    sp.add_argument("--fault", default="router_bf16", help="planted fault (see tic_trace/testing/faults.py); 'none' for a clean pair")
    sp.add_argument("--layer", type=int, default=1)
    sp.add_argument("--out", help="directory for the two traces and the reports (default: a new temporary one)")
    sp.set_defaults(fn=cmd_demo)

    sp = sub.add_parser("slime-report", help="first-divergence report for one slime rollout traced with --tic-trace")
    sp.add_argument("dir", help="the --tic-trace-dir of the slime run")
    sp.add_argument("--rollout-id", type=int, required=True)
    sp.add_argument("--growth", type=float, default=10.0)
    sp.add_argument("--tol", action="append", metavar="NAME=VALUE")
    sp.add_argument("--worst-tokens", type=int, default=8)
    sp.add_argument("--json")
    sp.add_argument("--html")
    sp.set_defaults(fn=cmd_slime_report)
    return p


def main(argv: list[str] | None = None) -> int:
    from tic_trace.format import TraceFormatError
    args = build_parser().parse_args(argv)
    # Reports are read in CI logs as often as in terminals: never squeeze tables into 80 columns.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
    try:
        return int(args.fn(args, console) or 0)
    except TraceFormatError as e:
        console.print(f"[bold red]error:[/] unreadable trace: {e}")
        return 2
    except (FileNotFoundError, ValueError, KeyError) as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    except SystemExit as e:
        if isinstance(e.code, str):
            console.print(f"[bold red]error:[/] {e.code}")
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
