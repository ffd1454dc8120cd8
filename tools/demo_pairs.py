"""Cross-framework pairs for `tic-trace demo --pair ...`: the same tiny model traced by two frameworks.

`run_pair(pair, a, b, fault, layer, console)` writes side A's trace to `a` and side B's to `b` (the planted
fault, if any, goes into side B) and returns the two adapter names. Pairs live in `_PAIRS`.

Megatron runs on CPU through `tic_trace.testing.megatron_cpu` (test support: it monkeypatches megatron-core
for CPU/gloo while the demo runs and removes the patches afterwards). SGLang runs its real model code on CPU
through `tic_trace.testing.sglang_cpu` (a stand-in scheduler over SGLang's model, KV pools and torch-native
attention): side B of the `*-sglang` pairs is a rollout, a prefill of both prompts (different lengths) then
SGLANG_DECODE_STEPS decode steps fed with the sequences' own next tokens, so its rows meet side A's full
sequences per (request, position).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.text import Text

BATCH, SEQ = 2, 12
SAMPLE_KEYS = ["req-0", "req-1"]
SGLANG_PROMPT_LENS = (7, 5)       # prompt lengths of the two requests; the rest of each sequence is the response
SGLANG_DECODE_STEPS = 4


def _hf_model(fault: str | None = None, layer: int = 0):
    """The tiny model both sides start from, with the fault's both-sides setup (if it has one) applied."""
    from tic_trace.testing.faults import prepare
    from tic_trace.testing.hf_models import build_hf_model, tiny_qwen3_config
    cfg = tiny_qwen3_config(moe=True)
    model = build_hf_model(cfg, seed=0)
    prepare(model, "hf", fault, layer)
    return cfg, model


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
            console.print(Text.assemble("planted fault ", (fault, "bold"), f" in layer {layer} of the HF model: {f.what}"))
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
                console.print(Text.assemble("planted fault ", (fault, "bold"), f" in layer {layer} of the Megatron model: {f.what}"))
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
    cfg, hf = _hf_model(fault, layer)
    ids = _tokens(cfg)
    console.print(Text(f"tracing a tiny random Qwen3-MoE (HF transformers) as side A -> {a}"))
    trace_hf(a, hf, ids)
    console.print(Text(f"tracing the same weights in megatron-core GPTModel (local spec, TP1, CPU) as side B -> {b}"))
    trace_megatron_tp1(b, cfg, hf.state_dict(), ids, fault, layer, console)
    return "hf", "megatron"


def trace_sglang_rollout(out: Path, hf_model, ids, fault: str | None = None, layer: int = 0,
                         console: Console | None = None) -> None:
    """The HF weights in SGLang's own model class (TP1, one process, CPU), run as a rollout of the two
    requests (prefill, then SGLANG_DECODE_STEPS decode steps fed with the sequences' next tokens) and traced
    with the sglang adapter, one pass per forward; `fault` planted first."""
    import torch

    from tic_trace.adapters.sglang_server import trace_forwards
    from tic_trace.testing import sglang_cpu as sc
    from tic_trace.testing.faults import plant

    prompts = {k: ids[b, :n].tolist() for b, (k, n) in enumerate(zip(SAMPLE_KEYS, SGLANG_PROMPT_LENS))}
    forced = {k: ids[b, n:].tolist() for b, (k, n) in enumerate(zip(SAMPLE_KEYS, SGLANG_PROMPT_LENS))}
    sc.init_sglang_distributed(tp_size=1)
    try:
        model = sc.build_sglang_model(hf_model.config, hf_model)
        if fault:
            f = plant(model, "sglang", fault, layer)
            if console is not None:
                console.print(Text.assemble("planted fault ", (fault, "bold"), f" in layer {layer} of the SGLang model: {f.what}"))
        eng = sc.SGLangRollout(model)
        # one pass per model forward; the engine's KV bookkeeping between forwards is not traced
        with trace_forwards(model, out, points_mode="full") as t, torch.no_grad():
            eng.generate(prompts, SGLANG_DECODE_STEPS, forced_tokens=forced)
        if t.failed:
            raise RuntimeError(f"tracing SGLang failed: {t.failed}")
    finally:
        sc.destroy_sglang_distributed()


def _sglang_side(b: Path, hf, ids, fault, layer, console) -> None:
    console.print(Text(f"running the same weights as an SGLang rollout (real SGLang model code, CPU): prompts of "
                  f"{SGLANG_PROMPT_LENS[0]} and {SGLANG_PROMPT_LENS[1]} tokens, prefill + {SGLANG_DECODE_STEPS} "
                  f"decode steps, as side B -> {b}"))
    trace_sglang_rollout(b, hf, ids, fault, layer, console)


def _megatron_sglang(a: Path, b: Path, fault: str | None, layer: int, console: Console) -> tuple[str, str]:
    cfg, hf = _hf_model(fault, layer)
    ids = _tokens(cfg)
    console.print(Text(f"tracing a tiny random Qwen3-MoE in megatron-core GPTModel (local spec, TP1, CPU), one forward "
                  f"over the full sequences, as side A -> {a}"))
    trace_megatron_tp1(a, cfg, hf.state_dict(), ids)
    _sglang_side(b, hf, ids, fault, layer, console)
    return "megatron", "sglang"


def _hf_sglang(a: Path, b: Path, fault: str | None, layer: int, console: Console) -> tuple[str, str]:
    cfg, hf = _hf_model(fault, layer)
    ids = _tokens(cfg)
    console.print(Text(f"tracing a tiny random Qwen3-MoE (HF transformers), full sequences, as side A -> {a}"))
    trace_hf(a, hf, ids)
    _sglang_side(b, hf, ids, fault, layer, console)
    return "hf", "sglang"


_PAIRS: dict[str, Callable[[Path, Path, str | None, int, Console], tuple[str, str]]] = {
    "hf-megatron": _hf_megatron,
    "megatron-sglang": _megatron_sglang,
    "hf-sglang": _hf_sglang,
}


def run_pair(pair: str, a: Path, b: Path, fault: str | None, layer: int, console: Console) -> tuple[str, str]:
    """Trace side A and side B of `pair` into `a` and `b`; returns (adapter A, adapter B)."""
    try:
        fn = _PAIRS[pair]
    except KeyError:
        raise SystemExit(f"demo pair {pair!r} is not available here (have: {', '.join(sorted(_PAIRS))}, hf-hf)") from None
    return fn(Path(a), Path(b), fault, layer, console)
