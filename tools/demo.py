"""`tic-trace demo`: trace a built-in tiny model twice, once with a planted fault, and find the fault."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rich.console import Console
from rich.text import Text


def _trace_hf(out: Path, fault: str | None, layer: int, console: Console, setup: str | None = None):
    import torch

    import tic_trace
    from tic_trace.testing.faults import plant, prepare
    from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
    cfg = tiny_qwen3_config(moe=True)
    model = build_hf_model(cfg, seed=0)
    prepare(model, "hf", setup, layer)            # what both sides need (e.g. two nearly tied experts)
    if fault:
        f = plant(model, "hf", fault, layer)
        console.print(Text.assemble("planted fault ", (fault, "bold"), f" in layer {layer} of side B: {f.what}"))
    ids = sample_tokens(2, 12, vocab=cfg.vocab_size)
    with tic_trace.trace(model, out, adapter="hf", points_mode="full", sample_keys=["req-0", "req-1"]) as t, \
            torch.no_grad():
        model(ids)
    if t.failed:
        raise RuntimeError(f"tracing failed: {t.failed}")


_PAIRS = {"hf-hf": ("hf", "hf")}
# Marks a directory as the demo's own output: only such a directory (or an empty one) is reused, and only the
# demo's own entries in it are replaced. The demo never deletes what it did not create.
MARKER = ".tic-trace-demo"


def check_demo_args(args) -> None:
    """Fault and layer against what the demo's tiny models have (one line naming the problem, exit 2)."""
    from tic_trace.testing.faults import FAULTS
    if args.fault != "none" and args.fault not in FAULTS:
        raise SystemExit(f"--fault {args.fault!r}: no such fault (have: none, {', '.join(sorted(FAULTS))})")
    check_demo_layer(args.layer)


def check_demo_layer(layer: int) -> None:
    """--layer against the demo's tiny model (every pair and dtype uses the same one)."""
    from tic_trace.testing.hf_models import tiny_qwen3_config
    n = tiny_qwen3_config(moe=True).num_hidden_layers
    if not 0 <= layer < n:
        raise SystemExit(f"--layer {layer}: the demo's model has layers 0 to {n - 1}")


def prepare_out(out: Path) -> None:
    """Make `out` ready: a new or empty directory, or an earlier demo's (marked), whose A/ and B/ go."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out}: exists and is not a directory")
    if out.is_dir():
        names = {p.name for p in out.iterdir()}
        if names and MARKER not in names:
            raise SystemExit(f"--out {out}: not empty and not an earlier demo's output (no {MARKER} in it); "
                             "give a new or empty directory")
        for name in ("A", "B"):
            d = out / name
            if d.is_symlink() or d.is_file():
                d.unlink()
            elif d.is_dir():
                shutil.rmtree(d)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `tic-trace demo`: the next demo run here replaces A/, B/ and report.*\n")


def demo_out_dir(out: str | None, console: Console) -> Path:
    """Where the demo writes, made ready: ``--out``, or a new temporary directory (so a checkout stays clean);
    says which."""
    from tic_trace.report.text import text
    path = Path(out) if out else Path(tempfile.mkdtemp(prefix="tic-trace-demo-"))
    prepare_out(path)
    console.print(text(f"the demo writes its traces and reports under {path}"), soft_wrap=True)  # a path to copy
    return path


def run_demo(args, console: Console) -> int:
    from tic_trace import find_divergence
    from tic_trace.report.html import render_html
    from tic_trace.report.inspect import inspect_trace
    from tic_trace.report.files import write_json
    from tic_trace.report.terminal import render_terminal
    from tic_trace.report.text import text
    from tic_trace.tools import demo_precision
    if demo_precision.wanted(args):           # bf16 with the exact reference (docs/replay.md)
        return demo_precision.run(args, console)

    check_demo_args(args)
    out = demo_out_dir(args.out, console)
    a, b = out / "A", out / "B"
    fault = None if args.fault == "none" else args.fault
    side_a, side_b = _PAIRS.get(args.pair, (None, None))
    if side_a is None:
        from tic_trace.tools import demo_pairs
        side_a, side_b = demo_pairs.run_pair(args.pair, a, b, fault, args.layer, console)
    else:
        console.print(text(f"tracing a tiny random Qwen3-MoE (HF transformers) as side A -> {a}"))
        _trace_hf(a, None, args.layer, console, setup=fault)
        console.print(text(f"tracing the same model as side B -> {b}"))
        _trace_hf(b, fault, args.layer, console, setup=fault)
    console.print()
    inspect_trace(str(b), console)
    console.print()
    report = find_divergence(str(a), str(b)).to_json()
    render_terminal(report, console)
    write_json(report, out / "report.json")
    (out / "report.html").write_text(render_html(report), encoding="utf-8")
    console.print(text(f"reports: {out / 'report.json'}  {out / 'report.html'}"))
    # the demo's own exit code: 0 when it found what it planted (or, clean, nothing), 2 when it did not
    from tic_trace.report.schema import EXIT_ERROR
    from tic_trace.testing.faults import FAULTS
    expected = FAULTS[fault].cause if fault in FAULTS else None
    got = (report.get("first_divergence") or {}).get("cause") if report["verdict"] == "divergent" else None
    ok = (got is None) if fault is None else (got is not None and (expected is None or got == expected
                                                                    or (expected == "operator" and got == "routing")))
    if not ok:
        console.print(text(f"demo: planted {fault or 'nothing'}, the report says {report['verdict']} ({got or '-'})"))
    return 0 if ok else EXIT_ERROR
