"""``tic-trace slime-report DIR --rollout-id N``: the first divergence of one rollout traced with ``--tic-trace``.

Megatron is the reference (side A), SGLang side B. See docs/slime.md.
"""
from __future__ import annotations

from pathlib import Path

from rich.text import Text

from tic_trace.report.text import error_line, text
from tic_trace.tools.options import (GROWTH_HELP, HTML_HELP, JSON_HELP, TOL_HELP, WORKERS_HELP, WORST_TOKENS_HELP,
                                     checkpoint_dir, count, nats, output_file, positive, tol_item, torch_device,
                                     workers)


def add_parser(sub) -> None:
    """Register the ``slime-report`` subcommand on the CLI's subparsers."""
    sp = sub.add_parser("slime-report", help="first-divergence report for one slime rollout traced with --tic-trace")
    sp.add_argument("dir", help="the --tic-trace-dir of the slime run")
    sp.add_argument("--rollout-id", type=count, required=True,
                    help="the rollout to report (one of the run's --tic-trace-rollout-ids)")
    sp.add_argument("--growth", type=positive, default=None, help=GROWTH_HELP)
    sp.add_argument("--tol", action="append", metavar="NAME=VALUE", type=tol_item, help=TOL_HELP)
    sp.add_argument("--worst-tokens", type=count, default=8, help=WORST_TOKENS_HELP)
    sp.add_argument("--workers", type=workers, default=("processes", 1), metavar="N|ray:N",
                    help=WORKERS_HELP)
    sp.add_argument("--json", type=output_file, metavar="FILE|-", help=JSON_HELP)
    sp.add_argument("--html", type=output_file, metavar="FILE|-", help=HTML_HELP)
    sp.add_argument("--reference", type=checkpoint_dir, metavar="HF_DIR",
                    help="HF checkpoint to replay both sides against (default: the run's --hf-checkpoint, as the "
                         "Megatron side recorded it; docs/replay.md)")
    sp.add_argument("--no-reference", action="store_true", help="do not replay, even if the run names a checkpoint")
    sp.add_argument("--reference-device", type=torch_device, default="cpu",
                    help="torch device for the float64 replay (default cpu)")
    sp.add_argument("--allow-unverified", action="store_true",
                    help="compare a side whose architecture is not in its adapter's table (refused by default)")
    sp.add_argument("--slime-metric", type=nats, default=None, metavar="NATS",
                    help="slime's logged train/train_rollout_logprob_abs_diff for this rollout, shown beside the "
                         "reconciliation of the traced samples (which recomputes it from the recorded log-probs)")
    sp.set_defaults(fn=slime_report)


def slime_report(args, console) -> int:
    """``tic-trace slime-report DIR --rollout-id N``: Megatron (reference, side A) against SGLang (side B).

    Prints the tokens with the largest |Δ logprob| and where each one's divergence starts, then the first
    divergence and the rest. Exit codes as the CLI's: 0 consistent, 1 divergent, 2 error (a side is
    missing), 3 not comparable (no row in common)."""
    from tic_trace.view.align import CanonicalView
    from tic_trace import find_divergence
    from tic_trace.report.terminal import render_terminal
    from tic_trace.tools.outputs import refuse_inside, write_reports
    from tic_trace.tools.progress import progress
    from tic_trace.tools.options import tolerance

    found = _rollout_sides(args, console)
    if isinstance(found, int):
        return found
    base, rdir, sides = found
    va, vb = CanonicalView(str(sides["megatron"])), CanonicalView(str(sides["sglang"]))
    ref_dir, ref_note = _reference_dir(args, va)
    # the run's own checkpoint is an input too (the CLI checked the inputs named on the command line)
    refuse_inside([(o, getattr(args, a, None)) for a, o in (("json", "--json"), ("html", "--html"))],
                  [("the run's --hf-checkpoint", ref_dir)])
    reference = None
    if ref_dir is not None:
        from tic_trace.replay.checkpoint import ReferenceMismatch
        from tic_trace.compare.contract import check_reference
        from tic_trace.replay.reference import ExactReference
        reference = ExactReference(ref_dir, device=getattr(args, "reference_device", "cpu"))
        try:
            check_reference(reference.ckpt, {"A": va, "B": vb})
        except ReferenceMismatch as e:
            if getattr(args, "reference", None):     # named by the user: not comparable (the CLI: exit 3)
                raise
            # the run's --hf-checkpoint holds the initial weights: a later rollout ran trained ones
            reference, ref_dir = None, None
            ref_note = (f"exact replay: off (the run's --hf-checkpoint is not the weights this rollout ran: {e}; "
                        "pass --reference HF_DIR with this step's weights)")
    backend, n = getattr(args, "workers", ("processes", 1))
    from tic_trace.view.align import common_points
    steps = len(common_points(va, vb)[0]) * (2 if reference is not None else 1)
    with progress(steps) as step:
        rep = find_divergence(va, vb, tolerance=tolerance(args), worst_tokens=getattr(args, "worst_tokens", 8),
                              reference=reference, workers=n, backend=backend, progress=step,
                              allow_unverified=getattr(args, "allow_unverified", False))
    # slime's own metric split into its parts (issue 37); those outside the forward are the used-log-prob stage's
    from tic_trace.compare.used_logprob_stage import judge_used_logprobs
    from tic_trace.tools.slime_reconcile import reconciliation
    rep.reconciliation = reconciliation(rdir, sides, {"megatron": va, "sglang": vb}, rep.to_json(),
                                        getattr(args, "slime_metric", None))
    judge_used_logprobs(rep)
    report = rep.to_json()
    report["slime"] = {"dir": str(base), "rollout_id": int(args.rollout_id),
                       "a": str(sides["megatron"]), "b": str(sides["sglang"]), "reference": ref_dir}
    console.print(text(f"slime rollout {args.rollout_id}: A = Megatron {sides['megatron']}  B = SGLang {sides['sglang']}"))
    console.print(text(ref_note, style="dim"))
    _print_worst(console, report)
    render_terminal({**report, "worst_tokens": []}, console)
    write_reports(report, console, getattr(args, "json", None), getattr(args, "html", None))
    return _exit_code(report, console)


def _rollout_sides(args, console) -> tuple[Path, Path, dict[str, Path]] | int:
    """The run directory, the rollout's directory and its two sides' trace directories; or, printed, what is
    missing and what to check, and the exit code 2."""
    from tic_trace.integrations.slime.config import rollout_dir
    from tic_trace.report.schema import EXIT_ERROR
    base = Path(args.dir)
    rdir = rollout_dir(base, args.rollout_id)
    if not base.is_dir():
        console.print(error_line(f"{base} does not exist: give the --tic-trace-dir of the slime run "
                                 "(default {--save}/tic_trace)"), soft_wrap=True)
        return EXIT_ERROR
    if not rdir.is_dir():
        have = sorted(p.name for p in base.glob("rollout_*") if p.is_dir())
        console.print(error_line(f"no traces of rollout {args.rollout_id}: {rdir} does not exist. "
                                 f"Traced rollouts here: {', '.join(have) or 'none'}. Check --tic-trace-rollout-ids "
                                 "and that the run reached that rollout."), soft_wrap=True)
        return EXIT_ERROR
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
            return EXIT_ERROR
    return base, rdir, sides


def _exit_code(report: dict, console) -> int:
    """The CLI's exit code for the report; a rollout whose sides share no row says what to check."""
    from tic_trace.report.schema import EXIT_ERROR, EXIT_NOT_COMPARABLE, VERDICT_EXIT, architecture_refusal
    if report["verdict"] == "not_comparable" and architecture_refusal(report):
        return EXIT_NOT_COMPARABLE           # the headline names the architecture
    if report["verdict"] == "not_comparable" or not (report.get("rows") or {}).get("matched"):
        console.print(Text("nothing compared: ", style="bold yellow") + Text("the two sides share no (sample, position) row. Rows are "
                      "keyed '<rollout>-<sample index>': check that SGLang requests carried that rid (tic_trace"
                      ".integrations.slime.generate is the --custom-generate-function-path) and the mode is not "
                      "'stats'."))
        return EXIT_NOT_COMPARABLE
    return VERDICT_EXIT.get(report["verdict"], EXIT_ERROR)


def _reference_dir(args, megatron_view) -> tuple[str | None, str]:
    """The checkpoint to replay against: --reference, else the run's --hf-checkpoint as the Megatron side's
    manifest records it (when that directory is readable here), else none; and a line saying which."""
    if getattr(args, "no_reference", False):
        return None, "exact replay: off (--no-reference)"
    if getattr(args, "reference", None):
        return args.reference, f"exact replay against {args.reference} (--reference)"
    slime = megatron_view.trace.manifest.get("slime")
    recorded = slime.get("hf_checkpoint") if isinstance(slime, dict) else None
    if not isinstance(recorded, str) or not recorded:
        return None, ("exact replay: off (the run recorded no --hf-checkpoint; pass --reference HF_DIR to name "
                      "the side whose op is less exact)")
    from tic_trace.replay.checkpoint import CheckpointError, HFCheckpoint
    try:
        HFCheckpoint(recorded)      # regular files only: a FIFO named there cannot hang the report
    except (CheckpointError, OSError) as e:
        return None, (f"exact replay: off (the run's --hf-checkpoint {recorded} cannot serve as the reference "
                      f"here: {e}; pass --reference HF_DIR)")
    return recorded, f"exact replay against the run's --hf-checkpoint {recorded}"


def _print_worst(console, report: dict) -> None:
    from tic_trace.report.terminal import render_worst_tokens
    if not render_worst_tokens(console, report, "tokens with the largest |Δ logprob| (A Megatron, B SGLang; logprob "
                                                "of the next token, before temperature) and where each one's "
                                                "divergence starts"):
        console.print("no per-token log-probabilities on both sides (logits not traced on one side?)")
