"""`tic-trace demo --fault rmsnorm_no_upcast --dtype bfloat16`: a bf16 pair with a precision fault, judged with
the exact reference.

The tiny model is saved as an HF checkpoint in the demo directory (`checkpoint/`), traced twice in bf16 (side
B with the precision fault of tic_trace/testing/precision_faults.py planted in its computation), and compared
with `find_divergence(..., reference=checkpoint)`: the report names the point, the side whose op is the less
exact one, and both sides' numbers against the exact op (docs/replay.md).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console

SEQ = 16


def wanted(args) -> bool:
    """Is this demo run a bf16 precision demo (a precision fault, or --dtype bfloat16)?"""
    from tic_trace.testing.precision_faults import PRECISION_FAULTS
    return args.fault in PRECISION_FAULTS or getattr(args, "dtype", "float32") == "bfloat16"


def _check(args) -> None:
    from tic_trace.testing.precision_faults import PRECISION_FAULTS
    from tic_trace.tools.demo import check_demo_layer
    if args.pair != "hf-hf":
        raise SystemExit(f"--pair {args.pair}: the bf16 precision demo runs hf-hf only")
    if args.fault != "none" and args.fault not in PRECISION_FAULTS:
        raise SystemExit(f"--fault {args.fault!r} with --dtype bfloat16: give a precision fault "
                         f"(none, {', '.join(sorted(PRECISION_FAULTS))})")
    check_demo_layer(args.layer)


def _trace(out: Path, fault: str | None, layer: int, ckpt: Path | None) -> None:
    import torch

    import tic_trace
    from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config
    from tic_trace.testing.precision_faults import PRECISION_FAULTS
    cfg = tiny_qwen3_config(moe=True)
    model = build_hf_model_stable(cfg, dtype=torch.bfloat16)
    if ckpt is not None:
        model.save_pretrained(ckpt)
    if fault:
        PRECISION_FAULTS[fault].plant(model, layer)
    ids = sample_tokens(2, SEQ, vocab=cfg.vocab_size)
    with tic_trace.trace(model, out, adapter="hf", points_mode="full", sample_keys=["req-0", "req-1"]) as t, \
            torch.no_grad():
        model(ids)
    if t.failed:
        raise RuntimeError(f"tracing failed: {t.failed}")


def run(args, console: Console) -> int:
    """Trace, compare with the reference, render; exit 0 when the report names what was planted (or, clean,
    nothing), 2 when it does not."""
    from tic_trace import find_divergence
    from tic_trace.report.html import render_html
    from tic_trace.report.files import write_json
    from tic_trace.report.terminal import render_terminal
    from tic_trace.report.schema import EXIT_ERROR
    from tic_trace.testing.precision_faults import PRECISION_FAULTS
    from tic_trace.report.text import text
    from tic_trace.tools.demo import demo_out_dir
    _check(args)
    out = demo_out_dir(args.out, console)
    ckpt, a, b = out / "checkpoint", out / "A", out / "B"
    if ckpt.is_dir() and not ckpt.is_symlink():      # inside a marked demo directory: the demo's own
        shutil.rmtree(ckpt)
    fault = None if args.fault == "none" else args.fault
    console.print(text(f"saving a tiny random Qwen3-MoE (bf16) as an HF checkpoint -> {ckpt}"))
    console.print(text(f"tracing it in bf16 as side A -> {a}"))
    _trace(a, None, args.layer, ckpt)
    if fault:
        console.print(text(f"planted precision fault {fault} in layer {args.layer} of side B: "
                           f"{PRECISION_FAULTS[fault].what}"))
    console.print(text(f"tracing side B -> {b}"))
    _trace(b, fault, args.layer, None)
    console.print(text(f"comparing with the exact reference: tic-trace first-divergence {a} {b} --reference {ckpt}"))
    console.print()
    report = find_divergence(str(a), str(b), reference=str(ckpt)).to_json()
    render_terminal(report, console)
    write_json(report, out / "report.json")
    (out / "report.html").write_text(render_html(report), encoding="utf-8")
    console.print(text(f"reports: {out / 'report.json'}  {out / 'report.html'}"))
    fd = report.get("first_divergence") or {}
    if fault is None:
        ok = not [f for f in report.get("findings") or [] if f.get("divergent") and f.get("cause") != "routing"]
    else:
        f = PRECISION_FAULTS[fault]
        key = f"L{args.layer}.{f.point}" if f.layered else f.point
        side = "B" if f.worse == "planted" else "A"
        ok = fd.get("key") == key and (fd.get("replay") or {}).get("side") == side
    if not ok:
        console.print(text(f"demo: planted {fault or 'nothing'}, the report says {report['verdict']} "
                           f"({fd.get('key', '-')} {fd.get('cause', '')})"))
    return 0 if ok else EXIT_ERROR
