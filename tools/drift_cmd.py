"""``tic-trace drift RUN_DIR``: drift over a training run, every traced rollout's pair compared, the weight
sync judged first, then the onset (docs/drift.md). A thin command over ``tic_trace.drift``.

Exit codes (tools/cli.py EXIT_CODES, printed by --help): 0 no onset, no weight-sync finding and the last compared
rollout not divergent; 1 an onset, a weight-sync finding or a run divergent since rollout N; 2 error (bad input);
3 nothing compared (every rollout skipped)."""
from __future__ import annotations

import argparse
import json
import sys

from tic_trace.tools.options import (HTML_HELP, JSON_HELP, TOL_HELP, WORKERS_HELP, output_file, positive, tol_item,
                                     workers)


def _sides(s: str) -> tuple[str, str]:
    parts = [p.strip() for p in s.split(",")]
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1] or any("/" in p or p in (".", "..") for p in parts):
        raise argparse.ArgumentTypeError(f"expected two different side directory names A,B (e.g. megatron,sglang), "
                                         f"got {s!r}")
    return parts[0], parts[1]


def _floor(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {s!r}")
    return v


def add_parser(sub) -> None:
    sp = sub.add_parser("drift", help="where and when the two sides' mismatch starts to grow over a training run")
    sp.add_argument("dir", help="the run directory: slime's --tic-trace-dir (rollout_NNNNN/{megatron,sglang}/), "
                                "or any directory of numbered entries holding the two sides (--sides)")
    sp.add_argument("--sides", type=_sides, default=("megatron", "sglang"), metavar="A,B",
                    help="the two side directories inside each numbered entry; A is the reference "
                         "(default megatron,sglang)")
    sp.add_argument("--factor", type=positive, default=None,
                    help="onset rule: a point departs when its error exceeds max(earlier) x FACTOR (default 3)")
    sp.add_argument("--floor", type=_floor, default=None,
                    help="onset rule: ... and this noise floor (relative error, default 1e-5)")
    sp.add_argument("--tol", action="append", metavar="NAME=VALUE", type=tol_item, help=TOL_HELP)
    sp.add_argument("--growth", type=positive, default=None, help="growth factor of each rollout's judge")
    sp.add_argument("--workers", type=workers, default=("processes", 1), metavar="N|ray:N", help=WORKERS_HELP)
    sp.add_argument("--json", type=output_file, metavar="FILE|-", help=JSON_HELP)
    sp.add_argument("--html", type=output_file, metavar="FILE|-", help=HTML_HELP)
    sp.set_defaults(fn=drift)


def drift(args, console) -> int:
    from tic_trace.drift.html import render_drift_html
    from tic_trace.drift.schema import EXIT_ERROR, validate
    from tic_trace.drift.terminal import render_drift
    from tic_trace.drift.timeline import RunDirError, build_drift, finder
    from tic_trace.report.text import error_line
    from tic_trace.tools.options import tolerance
    from tic_trace.tools.outputs import PipeSafe, is_stdout
    backend, n = args.workers
    compare = finder(tolerance=tolerance(args), workers=n, backend=backend)
    try:
        doc = build_drift(args.dir, args.sides, compare, factor=args.factor, floor=args.floor).to_json()
    except RunDirError as e:
        console.print(error_line(str(e)), soft_wrap=True)
        return EXIT_ERROR
    validate(doc)
    render_drift(doc, console)
    for path, data in ((args.json, lambda: json.dumps(doc, indent=1)), (args.html, lambda: render_drift_html(doc))):
        if not path:
            continue
        if is_stdout(path):
            out = PipeSafe(sys.stdout)
            out.write(data() + "\n")
            out.flush()
            continue
        from tic_trace.report.files import write_output
        write_output(path, data().encode("utf-8"))
        from tic_trace.report.text import text
        console.print(text(f"written: {path}"))
    return int(doc["exit_code"])
