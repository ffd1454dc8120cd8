"""`tic-trace replay TRACE --reference HF_DIR`: one trace against the exact reference, no second side needed.

Per canonical point: the side's intrinsic error (mean/max ULP in its dtype, share of elements equal to the
correctly rounded exact value, relative L2, excess over the rounding floor) and whether it is abnormal for
that op (over the envelope clean implementations show; docs/replay.md). Exit 0: every replayed point within
its envelope; 1: some point abnormal; 2: an error (unreadable trace or checkpoint); 3: not comparable (the
checkpoint is not the trace's model or weights: `contract.check_reference`; or the trace's architecture is not
in its adapter's table: `--allow-unverified` replays it anyway). Strings from the trace
(point keys, reasons naming records) are printed as text, never as markup (docs/security.md).
"""
from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tic_trace.report.text import text
from tic_trace.tools.options import checkpoint_dir, layer_list, output_file, torch_device

_ABNORMAL = ("ABNORMAL", "bold red")


def add_parser(sub) -> None:
    sp = sub.add_parser("replay", help="replay every canonical op of one trace exactly (float64) against an HF "
                                       "checkpoint: is each op correctly rounded?")
    sp.add_argument("trace", help="the trace directory to replay")
    sp.add_argument("--reference", required=True, metavar="HF_DIR", type=checkpoint_dir,
                    help="HF checkpoint directory (config.json + *.safetensors) with the weights the trace ran")
    sp.add_argument("--adapter", help="adapter (default: the framework named in the trace's manifest)")
    sp.add_argument("--layers", type=layer_list,
                    help="only these layers, e.g. 0-3,7 (default: all layers and the global points)")
    sp.add_argument("--device", default="cpu", type=torch_device,
                    help="torch device for the float64 reference (default cpu)")
    sp.add_argument("--json", type=output_file, metavar="FILE|-",
                    help="also write the per-point numbers here as JSON ('-': to stdout, the table then goes to "
                         "stderr)")
    sp.add_argument("--allow-unverified", action="store_true",
                    help="replay a trace whose architecture is not in its adapter's table (refused by default, "
                         "exit 3), marked UNVERIFIED MAPPING")
    sp.set_defaults(fn=run)


def _row(r) -> list:
    from tic_trace.replay.intrinsic import NotReplayed
    from tic_trace.replay.intrinsic_verdict import DEFAULT_MARGINS, abnormal
    if isinstance(r, NotReplayed):
        return [text(r.key), "", "", "", "", "", "", "", text(f"not replayed: {r.reason}", style="dim")]
    if r.kind == "ids":
        flag = Text(*_ABNORMAL) if abnormal(r) else "ok"
        return [text(r.key), text(r.dtype), str(r.rows), "", "", f"{r.share_rounded:.1%} rows", "", "", flag]
    limit = DEFAULT_MARGINS.limit_of(r)
    flag = Text(*_ABNORMAL) if abnormal(r) else ("ok" if math.isfinite(limit) else "ok (no envelope)")
    return [text(r.key), text(r.dtype), str(r.rows), f"{r.mean_ulp:.3f}", f"{r.max_ulp:.3g}", f"{r.share_rounded:.1%}",
            f"{r.rel_l2:.2e}", f"{r.excess:.2f}" + (f" / {limit:.2f}" if math.isfinite(limit) else ""), flag]


def run(args, console: Console) -> int:
    from tic_trace.view.align import CanonicalView
    from tic_trace.replay.intrinsic import IntrinsicError
    from tic_trace.replay.intrinsic_verdict import abnormal
    from tic_trace.replay.reference import ExactReference
    from tic_trace.graph.canonical import key_name, order_key
    from tic_trace.replay.intrinsic import SideReplayer
    from tic_trace.tools.progress import progress
    from tic_trace.compare.contract import check_reference
    ref_view = CanonicalView(args.trace, args.adapter)
    check = ref_view.adapter.check_architecture(ref_view.config)
    if not check.verified:        # an unverified table may feed the replay another op's records
        if not getattr(args, "allow_unverified", False):
            console.print(Text.assemble(("not comparable: ", "bold yellow"), text(
                f"unverified architecture mapping: {check.describe()}; --allow-unverified replays it anyway")),
                soft_wrap=True)
            return 3
        console.print(text(f"UNVERIFIED MAPPING: {check.describe()}; replayed anyway (--allow-unverified): any "
                           "point may be a different op than its name says", style="bold red"), soft_wrap=True)
    ref = ExactReference(args.reference, device=args.device)
    check_reference(ref.ckpt, {"the trace": ref_view})   # raises ReferenceMismatch: not this trace's model
    keep = set(args.layers) if args.layers is not None else None
    points = [(p, lay) for p, lay in ref_view.points() if keep is None or lay in keep]   # as replay_side picks them
    replayer, results = SideReplayer(ref_view, ref), []
    with progress(len(points), "replaying") as step:
        for p, lay in points:
            step(key_name(p, lay))
            results.append(replayer.replay(p, lay))
    results.sort(key=lambda r: order_key(r.point, r.layer))
    table = Table(title=text(f"intrinsic error of {args.trace} against the exact ops of {args.reference}"))
    for col in ("point", "dtype", "rows", "mean ULP", "max ULP", "correctly rounded", "rel L2",
                "excess / limit", ""):
        table.add_column(col, justify="left" if col in ("point", "") else "right")
    for r in results:
        table.add_row(*_row(r))
    console.print(table)
    from tic_trace.compare.contract import reference_entries
    for d in reference_entries("the trace", ref_view, ref.ckpt):    # what of the checkpoint the replay used
        console.print(text(f"reference: {d.note}", style="dim"), soft_wrap=True)
    bad = [r for r in results if isinstance(r, IntrinsicError) and abnormal(r)]
    done = sum(isinstance(r, IntrinsicError) for r in results)
    if args.json:
        from tic_trace.compare.judge import encode_intrinsic
        from tic_trace.report.schema import encode
        from tic_trace.tools.outputs import write_reports
        write_reports(encode([{"key": r.key, **encode_intrinsic(r)} for r in results]), console, args.json, None)
    if not done:
        console.print(Text.assemble(("error:", "bold red"), " no point could be replayed (see the reasons above)"))
        return 2
    if bad:
        console.print(Text.assemble(_ABNORMAL, text(f" at {', '.join(r.key for r in bad)}: the op's output is "
                                                    "further from exact than clean implementations of it are "
                                                    "(excess over the rounding floor)")))
        return 1
    console.print(text(f"ok: {done} points replayed, every one within its op's envelope"))
    return 0
