"""`tic-trace`: thin command-line front end over the library.

Exit codes: 0 consistent (or command succeeded), 1 divergence found, 2 error: no answer (bad input,
unreadable trace, a crash), 3 not comparable (nothing, or not every point both sides record, could be
compared). A failure prints one line naming what failed (the traceback with --debug) and never exits 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from tic_trace.text import visible
from tic_trace.tools.options import Parser as _Parser
from tic_trace.tools.options import checkpoint_dir as _checkpoint_dir
from tic_trace.tools.options import count as _count
from tic_trace.tools.options import input_file as _input_file
from tic_trace.tools.options import output_file as _output_file
from tic_trace.tools.options import positive as _positive
from tic_trace.tools.options import record_pattern as _record_pattern
from tic_trace.tools.options import tol_item as _tol_item
from tic_trace.tools.options import tolerance as _tolerance
from tic_trace.tools.options import torch_device as _torch_device
from tic_trace.tools.options import WORKERS_HELP as _WORKERS_HELP
from tic_trace.tools.options import workers as _workers


_MAX_REPORT_BYTES = 256 << 20


def _load_report(path: str) -> dict:
    """A saved JSON report, checked against the report schema before anything renders it."""
    from tic_trace.format import TraceFormatError, read_bounded
    from tic_trace.schema import ReportDoc, validate
    p = Path(path)
    try:
        raw = read_bounded(p, p.parent, _MAX_REPORT_BYTES, "JSON report")
        doc = json.loads(raw.decode("utf-8"))
        return validate(doc, ReportDoc, p, "not a tic-trace JSON report")
    except TraceFormatError as e:
        raise ValueError(str(e)) from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None


def _views(args, console):
    from tic_trace.align import CanonicalView
    va = CanonicalView(args.a, args.adapter_a)
    vb = CanonicalView(args.b, args.adapter_b)
    return va, vb


def _run_compare(args, console: Console) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tic_trace.diverge import find_divergence
    va, vb = _views(args, console)
    reference = None
    if getattr(args, "reference", None):
        from tic_trace.reference import ExactReference
        reference = ExactReference(args.reference, device=args.reference_device)
    total = len(set(va.points()) & set(vb.points())) * (2 if reference is not None else 1)
    with Progress(TextColumn("comparing {task.fields[key]:<24}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                  disable=not sys.stderr.isatty()) as prog:
        task = prog.add_task("cmp", total=total, key="")
        rep = find_divergence(va, vb, tolerance=_tolerance(args), worst_tokens=args.worst_tokens,
                              progress=lambda k: prog.update(task, advance=1, key=k),
                              accept_near_tie=args.accept_near_tie_routing, reference=reference,
                              backend=args.workers[0], workers=args.workers[1],
                              allow_unverified=getattr(args, "allow_unverified", False))
    return rep.to_json()


def _emit(report: dict, args, console: Console, all_points: bool) -> int:
    """Write the JSON/HTML first (a rendering failure must not lose them), then the terminal report."""
    from tic_trace.report import render_terminal, write_reports
    from tic_trace.report_schema import EXIT_ERROR, VERDICT_EXIT
    with open(os.devnull, "w") as devnull:
        try:
            write_reports(report, Console(file=devnull), getattr(args, "json", None), getattr(args, "html", None))
        except OSError as e:
            raise SystemExit(f"cannot write the report to {e.filename or 'its file'}: {e.strerror or e}") from None
    render_terminal(report, console, all_points=all_points)
    for what, path in (("JSON", getattr(args, "json", None)), ("HTML", getattr(args, "html", None))):
        if path:
            console.print(Text(f"{what} report: {visible(path)}"))
    return VERDICT_EXIT.get(report.get("verdict"), EXIT_ERROR)


def cmd_diff(args, console):
    return _emit(_run_compare(args, console), args, console, all_points=True)


def cmd_first(args, console):
    return _emit(_run_compare(args, console), args, console, all_points=False)


def cmd_report(args, console):
    if args.from_json:
        from tic_trace.diverge import rejudge
        report = _load_report(args.from_json)
        if args.tol or args.growth is not None or args.accept_near_tie_routing:
            report = rejudge(report, _tolerance(args) if args.tol or args.growth is not None else None,
                             accept_near_tie=True if args.accept_near_tie_routing else None)
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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tic-trace", description=__doc__.splitlines()[0],
                epilog="--debug (anywhere): print the traceback of a failure")
    sub = p.add_subparsers(dest="cmd", required=True)

    def compare_args(sp, two=True):
        sp.add_argument("a", help="reference trace directory (e.g. the training side)")
        sp.add_argument("b", nargs=None if two else "?", help="trace directory to check (e.g. the rollout side)")
        sp.add_argument("--adapter-a", help="adapter for A (default: the framework named in A's manifest)")
        sp.add_argument("--adapter-b", help="adapter for B (default: the framework named in B's manifest)")
        sp.add_argument("--growth", type=_positive, default=None,
                        help="a point diverges when its error exceeds its inputs' error by this factor (default 10)")
        sp.add_argument("--tol", action="append", metavar="NAME=VALUE", type=_tol_item,
                        help="relative-L2 tolerance for a dtype (bfloat16=0.02) or a point (attn.core=1e-4, L3.mid=1e-3)")
        sp.add_argument("--accept-near-tie-routing", action="store_true",
                        help="a pair whose only finding is near-tie routing flips is consistent (the flips are "
                             "still shown): for runs that replay routing or accept near ties")
        sp.add_argument("--reference", type=_checkpoint_dir, metavar="HF_DIR",
                        help="HF checkpoint (config.json + *.safetensors) both sides ran: replay every op exactly "
                             "from each side's own inputs and name the side whose op is less exact (docs/replay.md)")
        sp.add_argument("--reference-device", type=_torch_device, default="cpu",
                        help="torch device for the float64 replay (default cpu)")
        sp.add_argument("--allow-unverified", action="store_true",
                        help="compare a side whose architecture is not in its adapter's table (refused by "
                             "default, exit 3), every report marked UNVERIFIED MAPPING (README: supported "
                             "architectures)")
        sp.add_argument("--worst-tokens", type=_count, default=8)
        sp.add_argument("--workers", type=_workers, default=("processes", 1), metavar="N|ray:N",
                        help=_WORKERS_HELP)
        sp.add_argument("--json", type=_output_file, help="also write the JSON report here")
        sp.add_argument("--html", type=_output_file, help="also write a self-contained HTML report here")

    sp = sub.add_parser("diff", help="compare two traces over every canonical point")
    compare_args(sp)
    sp.set_defaults(fn=cmd_diff)
    sp = sub.add_parser("first-divergence", help="the first point where two traces stop agreeing (answer first)")
    compare_args(sp)
    sp.set_defaults(fn=cmd_first)
    sp = sub.add_parser("report", help="write JSON/HTML reports; re-judge a saved JSON with new tolerances")
    compare_args(sp, two=False)
    sp.add_argument("--from-json", type=_input_file, help="re-render (and with --tol/--growth re-judge) a saved JSON report; A is ignored")
    sp.add_argument("--all", action="store_true", help="print every point, not only the curve")
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("inspect", help="what a trace holds: passes, records, sizes, canonical points")
    sp.add_argument("trace")
    sp.add_argument("--rank", type=_count)
    sp.add_argument("--pass", dest="pass_index", type=_count)
    sp.add_argument("--filter", type=_record_pattern, help="glob (or re:regex) over record names")
    sp.add_argument("--records", action="store_true", help="list records")
    sp.add_argument("--points", action="store_true", help="list the canonical points the adapter finds")
    sp.add_argument("--limit", type=_count, default=200)
    sp.set_defaults(fn=cmd_inspect)

    sp = sub.add_parser("demo", help="trace a built-in tiny model twice (once with a planted fault) and find it")
    sp.add_argument("--pair", default="hf-hf", choices=["hf-hf", "hf-megatron", "megatron-sglang", "hf-sglang"],
                    help="which two implementations to compare (default hf-hf)")
    sp.add_argument("--fault", default="router_bf16",
                    help="planted fault (see tic_trace/testing/faults.py), e.g. routing_near_tie; 'none' for a clean pair")
    sp.add_argument("--layer", type=_count, default=1)
    sp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="bfloat16: a bf16 pair judged with the exact reference (a checkpoint saved in --out); "
                         "faults from tic_trace/testing/precision_faults.py, e.g. rmsnorm_no_upcast")
    sp.add_argument("--out", help="directory for the two traces and the reports: new, empty, or an earlier demo's "
                    "(default: a new temporary one)")
    sp.set_defaults(fn=cmd_demo)

    from tic_trace.tools.slime_report import add_parser as add_slime_report
    add_slime_report(sub)

    from tic_trace.tools import replay_cmd
    replay_cmd.add_parser(sub)
    return p


def _fail(console: Console, what: str, debug: bool) -> int:
    """One line naming what failed (plus the traceback under --debug); the no-answer exit code."""
    from rich.text import Text

    from tic_trace.report_schema import EXIT_ERROR
    line = Text("error: ", style="bold red") + Text(visible(what))
    if not debug:
        line += Text("  (--debug prints the traceback)", style="dim")
    console.print(line, soft_wrap=True)
    if debug:
        import traceback
        console.print(Text(traceback.format_exc()))
    return EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    from tic_trace.format import TraceFormatError
    from tic_trace.judge import SettingsError
    from tic_trace.parallel import ItemFailed
    from tic_trace.report_schema import EXIT_DIVERGENT, EXIT_ERROR
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:   # a usage error: _Parser printed its one line
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    # Reports are read in CI logs as often as in terminals: never squeeze tables into 80 columns.
    # emoji=False: a trace string like ":thumbs_up:" stays text; trace strings are printed as Text (text.py).
    console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 140)
    try:
        code = int(args.fn(args, console) or 0)
    except TraceFormatError as e:
        return _fail(console, f"unreadable trace: {e}", debug)
    except SettingsError as e:
        return _fail(console, f"bad setting: {e}", debug)
    except ItemFailed as e:     # a point failed in a worker: the message names it
        return _fail(console, f"{args.cmd}: {e}", debug)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return _fail(console, f"{args.cmd}: {type(e).__name__}: {e}", debug)
    except SystemExit as e:
        if isinstance(e.code, str):
            return _fail(console, e.code, debug)
        code = e.code if isinstance(e.code, int) else EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a crash is "no answer", never "divergence found"
        return _fail(console, f"{args.cmd} failed: {type(e).__name__}: {e}", debug)
    # 1 means "divergence found" and nothing else: a command that fails some other way has no answer.
    if code == EXIT_DIVERGENT and args.cmd not in ("diff", "first-divergence", "report", "slime-report", "demo", "replay"):
        return EXIT_ERROR
    return code


if __name__ == "__main__":
    sys.exit(main())
