"""`tic-trace`: thin command-line front end over the library.

Exit codes: 0 consistent (or command succeeded), 1 divergence found, 2 error: no answer (bad input,
unreadable trace, a crash), 3 not comparable (nothing, or not every point both sides record, could be
compared; or the --reference checkpoint is not the traces' model or weights). A failure prints one line
naming what failed (the traceback with --debug) and never exits 1.
`--json -` / `--html -` write that report alone to stdout; the terminal report then goes to stderr. A reader
that closes stdout early (`| head -1`) never changes the exit code. Outputs never land on inputs
(tools/outputs.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from tic_trace.report.text import visible
from tic_trace.tools.options import Parser as _Parser
from tic_trace.tools.options import accept_point as _accept_point
from tic_trace.tools.options import checkpoint_dir as _checkpoint_dir
from tic_trace.tools.options import at_least_one as _at_least_one
from tic_trace.tools.options import count as _count
from tic_trace.tools.options import input_file as _input_file
from tic_trace.tools.options import output_file as _output_file
from tic_trace.tools.options import positive as _positive
from tic_trace.tools.options import record_pattern as _record_pattern
from tic_trace.tools.options import tol_item as _tol_item
from tic_trace.tools.options import tolerance as _tolerance
from tic_trace.tools.options import torch_device as _torch_device
from tic_trace.tools.options import ACCEPT_PRECISION_HELP, GROWTH_HELP, HTML_HELP, JSON_HELP, TOL_HELP, WORST_TOKENS_HELP
from tic_trace.tools.options import WORKERS_HELP as _WORKERS_HELP
from tic_trace.tools.options import workers as _workers


_MAX_REPORT_BYTES = 256 << 20


def _load_report(path: str) -> dict:
    """A saved JSON report, checked against the report schema before anything renders it."""
    from tic_trace import TraceFormatError
    from tic_trace.store.format import read_bounded
    from tic_trace.store.report_doc import ReportDoc
    from tic_trace.store.schema import validate
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
    from tic_trace.view.align import CanonicalView
    by = getattr(args, "passes_by", "order")
    va = CanonicalView(args.a, args.adapter_a, passes_by=by)
    vb = CanonicalView(args.b, args.adapter_b, passes_by=by)
    return va, vb


def _run_compare(args, console: Console) -> dict:
    from tic_trace import find_divergence
    from tic_trace.tools.progress import progress
    va, vb = _views(args, console)
    reference = None
    if getattr(args, "reference", None):
        from tic_trace.replay.reference import ExactReference
        reference = ExactReference(args.reference, device=args.reference_device)
    total = len(set(va.points()) & set(vb.points())) * (2 if reference is not None else 1)
    with progress(total) as step:
        rep = find_divergence(va, vb, tolerance=_tolerance(args), worst_tokens=args.worst_tokens, progress=step,
                              accept_near_tie=args.accept_near_tie_routing, reference=reference,
                              backend=args.workers[0], workers=args.workers[1],
                              allow_unverified=getattr(args, "allow_unverified", False),
                              accept_precision=args.accept_precision or (),
                              attribution=getattr(args, "attribution", False),
                              attribution_tokens=getattr(args, "attribution_tokens", None))
    return rep.to_json()


def _emit(report: dict, args, console: Console, all_points: bool) -> int:
    """Write the JSON/HTML first (a rendering failure must not lose them), then the terminal report."""
    from tic_trace.report.terminal import render_terminal
    from tic_trace.report.schema import EXIT_ERROR, VERDICT_EXIT
    from tic_trace.tools.outputs import is_stdout, write_reports
    with open(os.devnull, "w") as devnull:
        write_reports(report, Console(file=devnull), getattr(args, "json", None), getattr(args, "html", None))
    render_terminal(report, console, all_points=all_points)
    for what, path in (("JSON", getattr(args, "json", None)), ("HTML", getattr(args, "html", None))):
        if path and not is_stdout(path):
            console.print(Text(f"{what} report: {visible(path)}"))
    return VERDICT_EXIT.get(report.get("verdict"), EXIT_ERROR)


def cmd_diff(args, console):
    return _emit(_run_compare(args, console), args, console, all_points=True)


def cmd_first(args, console):
    return _emit(_run_compare(args, console), args, console, all_points=False)


def _contradiction(saved: dict, again: dict) -> str | None:
    """How a saved report's judgement differs from its points' re-judgement with its own settings (None: it
    does not): the verdict, the first divergence, or the first point whose status differs."""
    def first(d):
        fd = d.get("first_divergence")
        return fd.get("key") if isinstance(fd, dict) else None

    def says(d):
        return f"{d.get('verdict')}" + (f" at {first(d)}" if first(d) else "")
    if saved.get("verdict") != again.get("verdict") or first(saved) != first(again):
        return f"its saved verdict is {says(saved)}, its own points say {says(again)}"
    for p, q in zip(saved.get("points") or [], again.get("points") or []):
        if p.get("status") != q.get("status"):
            return (f"point {p.get('key')} is saved as {p.get('status')}, its own numbers make it "
                    f"{q.get('status')} (the saved verdict {says(saved)} rests on it)")
    return None


def cmd_report(args, console):
    if args.from_json:
        from tic_trace.compare.diverge import rejudge
        from tic_trace.report.schema import EXIT_NOT_COMPARABLE
        from tic_trace.report.text import error_line
        saved = _load_report(args.from_json)
        # Never print a saved verdict on trust: re-judge the saved points with the saved settings first. A file
        # whose verdict its own points contradict was edited (or written by another judge): no answer from it.
        report = rejudge(saved)
        why = _contradiction(saved, report)
        if why is not None:
            console.print(error_line(f"{args.from_json}: {why}: the file was edited or written by another "
                                     "tic-trace; make the report again from the traces (tic-trace report A B "
                                     "--json FILE)"), soft_wrap=True)
            return EXIT_NOT_COMPARABLE
        if args.tol or args.growth is not None or args.accept_near_tie_routing or args.accept_precision:
            report = rejudge(saved, _tolerance(args) if args.tol or args.growth is not None else None,
                             accept_near_tie=True if args.accept_near_tie_routing else None,
                             accept_precision=args.accept_precision or None)
    else:
        if not args.b:
            raise SystemExit("report: give two traces A B, or --from-json saved.json")
        report = _run_compare(args, console)
    return _emit(report, args, console, all_points=args.all)


def cmd_inspect(args, console):
    from tic_trace.report.inspect import inspect_trace
    inspect_trace(args.trace, console, rank=args.rank, pass_index=args.pass_index, pattern=args.filter,
                  records=args.records, points=args.points, limit=args.limit)
    return 0


def cmd_demo(args, console):
    from tic_trace.tools.demo import run_demo
    return run_demo(args, console)


def build_parser() -> argparse.ArgumentParser:
    import tic_trace
    p = _Parser(prog="tic-trace", description=__doc__.splitlines()[0],
                epilog="--debug (anywhere): print the traceback of a failure")
    p.add_argument("--version", action="version", version=f"tic-trace {tic_trace.__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True)

    def compare_args(sp, two=True):
        sp.add_argument("a", help="reference trace directory (e.g. the training side)")
        sp.add_argument("b", nargs=None if two else "?", help="trace directory to check (e.g. the rollout side)")
        sp.add_argument("--adapter-a", help="adapter for A (default: the framework named in A's manifest)")
        sp.add_argument("--adapter-b", help="adapter for B (default: the framework named in B's manifest)")
        sp.add_argument("--growth", type=_positive, default=None, help=GROWTH_HELP)
        sp.add_argument("--tol", action="append", metavar="NAME=VALUE", type=_tol_item, help=TOL_HELP)
        sp.add_argument("--accept-near-tie-routing", action="store_true",
                        help="a pair whose only finding is near-tie routing flips is consistent (the flips are "
                             "still shown): for runs that replay routing or accept near ties")
        sp.add_argument("--accept-precision", action="append", metavar="POINT", type=_accept_point,
                        help=ACCEPT_PRECISION_HELP)
        sp.add_argument("--reference", type=_checkpoint_dir, metavar="HF_DIR",
                        help="HF checkpoint (config.json + *.safetensors) both sides ran: replay every op exactly "
                             "from each side's own inputs and name the side whose op is less exact (docs/replay.md)")
        sp.add_argument("--reference-device", type=_torch_device, default="cpu",
                        help="torch device for the float64 replay (default cpu)")
        sp.add_argument("--attribution", action="store_true",
                        help="with --reference: which difference explains how much of the log-prob gap (first-order "
                             "propagation through the exact model, on --reference-device; docs/attribution.md)")
        sp.add_argument("--attribution-tokens", type=_at_least_one, default=None, metavar="N",
                        help="at most N tokens (1 or more) through the exact model's forward and backward: the "
                             "worst samples first, the last one cut to the causal prefix that fits (default 1024)")
        sp.add_argument("--allow-unverified", action="store_true",
                        help="compare a side whose architecture is not in its adapter's table (refused by "
                             "default, exit 3), every report marked UNVERIFIED MAPPING (README: supported "
                             "architectures)")
        sp.add_argument("--passes-by", choices=("order", "tag"), default="order",
                        help="a side that traced the same rows in several passes (actor and reference model, two "
                             "steps) is compared pass with pass: in order (default: the k-th pass over a row with "
                             "the other side's k-th), or by the tag each pass was given (tracer.step(tag))")
        sp.add_argument("--worst-tokens", type=_count, default=8, help=WORST_TOKENS_HELP)
        sp.add_argument("--workers", type=_workers, default=("processes", 1), metavar="N|ray:N",
                        help=_WORKERS_HELP)
        sp.add_argument("--json", type=_output_file, metavar="FILE|-", help=JSON_HELP)
        sp.add_argument("--html", type=_output_file, metavar="FILE|-", help=HTML_HELP)

    sp = sub.add_parser("diff", help="compare two traces over every canonical point")
    compare_args(sp)
    sp.set_defaults(fn=cmd_diff)
    sp = sub.add_parser("first-divergence", help="the first point where two traces stop agreeing (answer first)")
    compare_args(sp)
    sp.set_defaults(fn=cmd_first)
    sp = sub.add_parser("report", help="write JSON/HTML reports; re-judge a saved JSON with new tolerances")
    compare_args(sp, two=False)
    sp.add_argument("--from-json", type=_input_file, metavar="FILE",
                    help="re-judge a saved JSON report from its points (with its own settings, or --tol/--growth/"
                         "--accept-near-tie-routing) and render it; a file whose verdict its own points contradict "
                         "is refused (exit 3); A is ignored")
    sp.add_argument("--all", action="store_true", help="print every point, not only the curve")
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("inspect", help="what a trace holds: passes, records, sizes, canonical points")
    sp.add_argument("trace", help="the trace directory to describe")
    sp.add_argument("--rank", type=_count, help="only this rank (default: every rank)")
    sp.add_argument("--pass", dest="pass_index", type=_count, help="only this pass (forward) of each rank")
    sp.add_argument("--filter", type=_record_pattern, help="glob (or re:regex) over record names")
    sp.add_argument("--records", action="store_true", help="list records")
    sp.add_argument("--points", action="store_true", help="list the canonical points the adapter finds")
    sp.add_argument("--limit", type=_count, default=200, help="list at most this many records or points (default 200)")
    sp.set_defaults(fn=cmd_inspect)

    sp = sub.add_parser("demo", help="trace a built-in tiny model twice (once with a planted fault) and find it")
    sp.add_argument("--pair", default="hf-hf", choices=["hf-hf", "hf-megatron", "megatron-sglang", "hf-sglang"],
                    help="which two implementations to compare (default hf-hf)")
    sp.add_argument("--fault", default="router_bf16",
                    help="planted fault (see tic_trace/testing/faults.py), e.g. routing_near_tie; 'none' for a clean pair")
    sp.add_argument("--layer", type=_count, default=1, help="the layer the fault is planted in (default 1)")
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

    from tic_trace.tools import drift_cmd
    drift_cmd.add_parser(sub)
    for name, sp in sub.choices.items():     # every command's --help ends with its exit codes
        sp.epilog = f"exit codes: {EXIT_CODES[name]}; 130 interrupted"
    return p


_VERDICT_CODES = ("0 consistent, 1 divergent, 2 error: no answer (bad arguments, an unreadable trace, a crash), "
                  "3 not comparable (not every point both sides record could be compared, or the --reference "
                  "checkpoint is not the traces' model or weights)")
#: each command's exit codes (docs/report.md, "Exit codes of every command"): its --help prints them
EXIT_CODES = {
    "diff": _VERDICT_CODES,
    "first-divergence": _VERDICT_CODES,
    "report": _VERDICT_CODES + "; with --from-json also 3 when the file's verdict contradicts its own points",
    "slime-report": _VERDICT_CODES,
    "inspect": "0 described, 2 error (an unreadable trace, bad arguments)",
    "demo": "0 the report found what was planted (with --fault none: nothing), 2 error: it did not, or a failure",
    "replay": "0 every replayed point within its envelope, 1 some point abnormal, 2 error (an unreadable trace or "
              "checkpoint, bad arguments), 3 not comparable (the checkpoint is not the trace's model or weights, "
              "or an unverified architecture)",
    "drift": "0 no onset, no weight-sync finding and the last compared rollout not divergent; 1 an onset, a "
             "weight-sync finding, or a run divergent since rollout N; 2 error (the run directory is missing, "
             "holds no numbered entry or names one rollout twice; bad arguments); 3 nothing compared (every "
             "rollout skipped)",
}


def _fail(console: Console, what: str, debug: bool, label: str = "error: ") -> int:
    """One line naming what failed (plus the traceback under --debug); the no-answer exit code."""
    from rich.text import Text

    from tic_trace.report.schema import EXIT_ERROR
    line = Text(label, style="bold red") + Text(visible(what))
    if not debug:
        line += Text("  (--debug prints the traceback)", style="dim")
    console.print(line, soft_wrap=True)
    if debug:
        import traceback
        console.print(Text(traceback.format_exc()))
    return EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    from tic_trace.replay.checkpoint import ReferenceMismatch
    from tic_trace import TraceFormatError
    from tic_trace.compare.judge import SettingsError
    from tic_trace.compare.parallel import ItemFailed
    from tic_trace.report.schema import EXIT_DIVERGENT, EXIT_ERROR
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    from tic_trace.tools.outputs import OutputRefused, PipeSafe, check_outputs, wants_stdout
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:   # a usage error: _Parser printed its one line (or --help / --version their text)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    try:
        check_outputs(args)
    except OutputRefused as e:
        sys.stderr.write(f"tic-trace {args.cmd}: error: {visible(e)}\n")
        return EXIT_ERROR
    # A report on stdout (--json -) leaves stdout to it: the terminal report goes to stderr. Either stream may be
    # closed by its reader (| head -1): PipeSafe drops what is left, and the verdict's exit code stands.
    stream = PipeSafe(sys.stderr if wants_stdout(args) else sys.stdout)
    # Reports are read in CI logs as often as in terminals: never squeeze tables into 80 columns.
    # emoji=False: a trace string like ":thumbs_up:" stays text; trace strings are printed as Text (text.py).
    console = Console(file=stream, highlight=False, emoji=False, width=None if stream.isatty() else 140)
    try:
        code = int(args.fn(args, console) or 0)
    except TraceFormatError as e:
        return _fail(console, f"unreadable trace: {e}", debug)
    except ReferenceMismatch as e:      # the checkpoint is not the traces' model or weights: no exact answer
        from tic_trace.report.schema import EXIT_NOT_COMPARABLE
        _fail(console, f"{e}", debug, label="NOT COMPARABLE with the reference: ")
        return EXIT_NOT_COMPARABLE
    except SettingsError as e:
        return _fail(console, f"bad setting: {e}", debug)
    except ItemFailed as e:     # a point failed in a worker: one line names it; others are counted, listed with --debug
        more = f" ({len(e.others)} more work item(s) failed too; --debug lists them)" if e.others and not debug else ""
        code = _fail(console, f"{args.cmd}: {e}{more}", debug)
        for other in e.others if debug else ():
            console.print(Text("error: also: ", style="bold red") + Text(visible(other)), soft_wrap=True)
        return code
    except OutputRefused as e:  # an output found to land on an input once the command knew all its inputs
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
    if code == EXIT_DIVERGENT and args.cmd not in ("diff", "first-divergence", "report", "slime-report", "demo", "replay",
                                                 "drift"):
        return EXIT_ERROR
    return code


if __name__ == "__main__":
    sys.exit(main())
