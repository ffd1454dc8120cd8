"""Cross-framework pairs for `tic-trace demo --pair ...`: the same tiny model traced by two frameworks.

`run_pair(pair, a, b, fault, layer, console)` writes side A's trace to `a` and side B's to `b` (the planted
fault, if any, goes into side B) and returns the two adapter names. Pairs live in `_PAIRS`.

Megatron runs on CPU through `tic_trace.testing.megatron_cpu` (test support: it monkeypatches megatron-core
for CPU/gloo while the demo runs and removes the patches afterwards).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from rich.console import Console

BATCH, SEQ = 2, 12
SAMPLE_KEYS = ["req-0", "req-1"]


def _hf_model():
    from tic_trace.testing.hf_models import build_hf_model, tiny_qwen3_config
    cfg = tiny_qwen3_config(moe=True)
    return cfg, build_hf_model(cfg, seed=0)


def _tokens(cfg):
    from tic_trace.testing.hf_models import sample_tokens
    return sample_tokens(BATCH, SEQ, vocab=cfg.vocab_size)


def trace_hf(out: Path, model, ids, fault: str | None = None, layer: int = 0, console: Console | None = None):
    import torch

    import tic_trace
    from tic_trace.testing.faults import plant
    if fault:
        f = plant(model, "hf", fault, layer)
        if console is not None:
            console.print(f"planted fault [bold]{fault}[/] in layer {layer} of the HF model: {f.what}")
    with tic_trace.trace(model, out, adapter="hf", points_mode="full", sample_keys=SAMPLE_KEYS) as t, torch.no_grad():
        model(ids)
    if t.failed:
        raise RuntimeError(f"tracing HF failed: {t.failed}")


def trace_megatron_tp1(out: Path, hf_config, hf_state_dict, ids, fault: str | None = None, layer: int = 0,
                       console: Console | None = None) -> None:
    """The HF weights in a megatron-core GPTModel (local spec, TP1, one process, CPU), traced with the
    megatron adapter; `fault` planted first."""
    import torch

    import tic_trace
    from tic_trace.adapters.megatron import MegatronAdapter
    from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
    from tic_trace.testing import megatron_cpu as mc
    from tic_trace.testing.faults import plant

    mc.init_parallel(0, 1)
    try:
        model = mc.build_gpt_model(hf_config)
        load_into(model, hf_to_megatron_state_dict(hf_state_dict, hf_config))
        if fault:
            f = plant(model, "megatron", fault, layer)
            if console is not None:
                console.print(f"planted fault [bold]{fault}[/] in layer {layer} of the Megatron model: {f.what}")
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        adapter = MegatronAdapter(vocab_size=int(hf_config.vocab_size))
        with tic_trace.trace(model, out, adapter=adapter, points_mode="full", sample_keys=SAMPLE_KEYS) as t, \
                torch.no_grad():
            model(ids, positions, attention_mask=None)
        if t.failed:
            raise RuntimeError(f"tracing Megatron failed: {t.failed}")
    finally:
        mc.destroy(remove_patches=True)


def _hf_megatron(a: Path, b: Path, fault: str | None, layer: int, console: Console) -> tuple[str, str]:
    cfg, hf = _hf_model()
    ids = _tokens(cfg)
    console.print(f"tracing a tiny random Qwen3-MoE (HF transformers) as side A -> {a}")
    trace_hf(a, hf, ids)
    console.print(f"tracing the same weights in megatron-core GPTModel (local spec, TP1, CPU) as side B -> {b}")
    trace_megatron_tp1(b, cfg, hf.state_dict(), ids, fault, layer, console)
    return "hf", "megatron"


_PAIRS: dict[str, Callable[[Path, Path, str | None, int, Console], tuple[str, str]]] = {
    "hf-megatron": _hf_megatron,
}


def run_pair(pair: str, a: Path, b: Path, fault: str | None, layer: int, console: Console) -> tuple[str, str]:
    """Trace side A and side B of `pair` into `a` and `b`; returns (adapter A, adapter B)."""
    try:
        fn = _PAIRS[pair]
    except KeyError:
        raise SystemExit(f"demo pair {pair!r} is not available here (have: {', '.join(sorted(_PAIRS))}, hf-hf)") from None
    return fn(Path(a), Path(b), fault, layer, console)
