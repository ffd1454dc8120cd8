"""``tic-trace slime-report DIR --rollout-id N``: the first divergence of one rollout traced with ``--tic-trace``.

Megatron is the reference (side A), SGLang side B. See docs/slime.md.
"""
from __future__ import annotations

from pathlib import Path

from rich.text import Text

from tic_trace.text import error_line, text
from tic_trace.tools.options import count, output_file, positive, tol_item


def add_parser(sub) -> None:
    """Register the ``slime-report`` subcommand on the CLI's subparsers."""
    sp = sub.add_parser("slime-report", help="first-divergence report for one slime rollout traced with --tic-trace")
    sp.add_argument("dir", help="the --tic-trace-dir of the slime run")
    sp.add_argument("--rollout-id", type=count, required=True)
    sp.add_argument("--growth", type=positive, default=None)
    sp.add_argument("--tol", action="append", metavar="NAME=VALUE", type=tol_item)
    sp.add_argument("--worst-tokens", type=count, default=8)
    sp.add_argument("--json", type=output_file)
    sp.add_argument("--html", type=output_file)
    sp.set_defaults(fn=slime_report)


def slime_report(args, console) -> int:
    """``tic-trace slime-report DIR --rollout-id N``: Megatron (reference, side A) against SGLang (side B).

    Prints the tokens with the largest |Δ logprob| and where each one's divergence starts, then the first
    divergence and the rest. Exit codes as the CLI's: 0 consistent, 1 divergent, 2 error (a side is
    missing), 3 not comparable (no row in common)."""
    from tic_trace.align import CanonicalView
    from tic_trace.diverge import find_divergence
    from tic_trace.report import render_terminal, write_reports
    from tic_trace.report_schema import EXIT_ERROR, EXIT_NOT_COMPARABLE, VERDICT_EXIT
    from tic_trace.integrations.slime.config import rollout_dir
    from tic_trace.tools.options import tolerance

    base = Path(args.dir)
    rdir = rollout_dir(base, args.rollout_id)
    if not base.is_dir():
        console.print(error_line(f"{base} does not exist: give the --tic-trace-dir of the slime run "
                                 "(default {--save}/tic_trace)"), soft_wrap=True)
        return 2
    if not rdir.is_dir():
        have = sorted(p.name for p in base.glob("rollout_*") if p.is_dir())
        console.print(error_line(f"no traces of rollout {args.rollout_id}: {rdir} does not exist. "
                                 f"Traced rollouts here: {', '.join(have) or 'none'}. Check --tic-trace-rollout-ids "
                                 "and that the run reached that rollout."), soft_wrap=True)
        return 2
    sides = {"megatron": rdir / "megatron", "sglang": rdir / "sglang"}
    why = {
        "megatron": "the train ranks wrote nothing. Check that --tic-trace was on for the train actors (their "
                    "args carry custom_megatron_*_hook_path = tic_trace.integrations.slime.*), that tic_trace is "
                    "importable on the train nodes, that the rollout was trained, and that this directory is "
                    "shared by the train nodes.",
        "sglang": "the SGLang servers wrote nothing. Check that tic_trace is importable in the SGLang server "
                  "processes (Ray runtime env: PYTHONPATH or pip install on the rollout nodes), that the "
                  "engines got --sglang-forward-hooks (not external engines, no --sglang-config override), "
                  "that requests carried rid '<rollout>-<sample index>' (slime >= v0.3.1), and that this "
                  "directory is shared by the rollout nodes.",
    }
    for name, p in sides.items():
        if not (p / "manifest.msgpack").is_file():
            state = "does not exist" if not p.exists() else "holds no trace (no manifest.msgpack)"
            console.print(error_line(f"{name} side missing: {p} {state}: {why[name]}"), soft_wrap=True)
            return 2
    va, vb = CanonicalView(str(sides["megatron"])), CanonicalView(str(sides["sglang"]))
    rep = find_divergence(va, vb, tolerance=tolerance(args), worst_tokens=getattr(args, "worst_tokens", 8))
    report = rep.to_json()
    report["slime"] = {"dir": str(base), "rollout_id": int(args.rollout_id),
                       "a": str(sides["megatron"]), "b": str(sides["sglang"])}
    console.print(text(f"slime rollout {args.rollout_id}: A = Megatron {sides['megatron']}  B = SGLang {sides['sglang']}"))
    _print_worst(console, report)
    render_terminal({**report, "worst_tokens": []}, console)
    write_reports(report, console, getattr(args, "json", None), getattr(args, "html", None))
    if report["verdict"] == "not_comparable" or not (report.get("rows") or {}).get("matched"):
        console.print(Text("nothing compared: ", style="bold yellow") + Text("the two sides share no (sample, position) row. Rows are "
                      "keyed '<rollout>-<sample index>': check that SGLang requests carried that rid (tic_trace"
                      ".integrations.slime.generate is the --custom-generate-function-path) and the mode is not "
                      "'stats'."))
        return EXIT_NOT_COMPARABLE
    return VERDICT_EXIT.get(report["verdict"], EXIT_ERROR)


def _print_worst(console, report: dict) -> None:
    from rich.table import Table
    w = report.get("worst_tokens") or []
    if not w:
        console.print("no per-token log-probabilities on both sides (logits not traced on one side?)")
        return
    t = Table(title="tokens with the largest |Δ logprob| (A Megatron, B SGLang; logprob of the next token, "
                    "before temperature) and where each one's divergence starts",
              title_justify="left", show_edge=False)
    for col in ("sample", "pos", "|Δlogp|", "logp A", "logp B", "divergence starts", "routing flip"):
        t.add_column(col)
    for x in w:
        t.add_row(text(x["sample"]), text(x["position"]), _fmt(x["abs_dlogprob"], ".3e"), _fmt(x["logprob_a"], ".5f"),
                  _fmt(x["logprob_b"], ".5f"), text(x.get("divergence_starts") or "-"),
                  "yes" if x.get("routing_flip") else "")
    console.print(t)
    console.print()


def _fmt(x, spec: str) -> str:
    """A report number (NaN/Inf arrive encoded as strings) in `spec`, or '-'."""
    from tic_trace.report_schema import num
    v = num(x)
    return "-" if v is None else format(v, spec)
