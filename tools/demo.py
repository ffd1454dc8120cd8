"""`tic-trace demo`: trace a built-in tiny model twice, once with a planted fault, and find the fault."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rich.console import Console


def _trace_hf(out: Path, fault: str | None, layer: int, console: Console):
    import torch

    import tic_trace
    from tic_trace.testing.faults import plant
    from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
    cfg = tiny_qwen3_config(moe=True)
    model = build_hf_model(cfg, seed=0)
    if fault:
        f = plant(model, "hf", fault, layer)
        console.print(f"planted fault [bold]{fault}[/] in layer {layer} of side B: {f.what}")
    ids = sample_tokens(2, 12, vocab=cfg.vocab_size)
    with tic_trace.trace(model, out, adapter="hf", points_mode="full", sample_keys=["req-0", "req-1"]) as t, \
            torch.no_grad():
        model(ids)
    if t.failed:
        raise RuntimeError(f"tracing failed: {t.failed}")


_PAIRS = {"hf-hf": ("hf", "hf")}


def demo_out_dir(out: str | None, console: Console) -> Path:
    """Where the demo writes: ``--out``, or a new temporary directory (so a checkout stays clean); says which."""
    path = Path(out) if out else Path(tempfile.mkdtemp(prefix="tic-trace-demo-"))
    # Unwrapped and without markup: a path to copy, whatever its length or characters.
    console.print(f"the demo writes its traces and reports under {path}", soft_wrap=True, markup=False)
    return path


def run_demo(args, console: Console) -> int:
    from tic_trace.diverge import find_divergence
    from tic_trace.html import render_html
    from tic_trace.inspect import inspect_trace
    from tic_trace.report import render_terminal, write_json

    out = demo_out_dir(args.out, console)
    a, b = out / "A", out / "B"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
    fault = None if args.fault == "none" else args.fault
    side_a, side_b = _PAIRS.get(args.pair, (None, None))
    if side_a is None:
        from tic_trace.tools import demo_pairs
        side_a, side_b = demo_pairs.run_pair(args.pair, a, b, fault, args.layer, console)
    else:
        console.print(f"tracing a tiny random Qwen3-MoE (HF transformers) as side A -> {a}")
        _trace_hf(a, None, args.layer, console)
        console.print(f"tracing the same model as side B -> {b}")
        _trace_hf(b, fault, args.layer, console)
    console.print()
    inspect_trace(str(b), console)
    console.print()
    report = find_divergence(str(a), str(b)).to_json()
    render_terminal(report, console)
    write_json(report, out / "report.json")
    (out / "report.html").write_text(render_html(report), encoding="utf-8")
    console.print(f"reports: {out / 'report.json'}  {out / 'report.html'}")
    expected_bad = fault is not None
    found = report["verdict"] == "divergent"
    return 0 if found == expected_bad else 1
