"""Training runs for the drift tests, made of real traced forwards (test support only).

`build_run(out, n_rollouts, fault, start)` writes slime's layout `out/rollout_NNNNN/{megatron,sglang}/`: each
"rollout" traces the same two sequences through megatron-core's GPTModel (the trainer's log-prob forward, one
forward over the full sequences) and through SGLang's own Qwen3-MoE model code (the engine: prefill plus decode
steps), both on the weights of that step. Between rollouts a deterministic "training step" moves every weight
(~1% of its spread), the trainer loads the new weights (`load_into`) and the engine gets them through SGLang's
own loader (`DefaultModelLoader.load_weights_and_postprocess`, what its weight-update path ends in).

Faults start at rollout `start` and stay, planted in the engine's computation, never in a trace:
  * "stale_sync": the engine stops receiving the weight update (it keeps the weights of rollout start-1);
  * "precision": the post-attention residual add of layer LAYER runs in bf16 (faults.residual_bf16);
  * "routing": a +0.2 selection bias on one expert in layer LAYER's top-k (faults.expert_bias).
The real slime run (tests/slime_real_scenarios.py "drift") covers the flag on slime's own code path; this
builder makes the other runs cheap enough for 2 cores. Megatron traces are all made first, then SGLang's (the
two frameworks' process groups must not meet in one process: tests/test_replay_finder_mgsg.py)."""
from __future__ import annotations

from pathlib import Path

import torch

FAULTS = ("stale_sync", "precision", "routing")
LAYER = 1
IDS = [[3, 5, 7, 9, 11, 13, 15, 17, 19, 21], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]]
PROMPT_LENS = (6, 4)
KEYS = ["req-0", "req-1"]
DECODE_STEPS = 4
STEP_SCALE = 0.01


def training_steps(hf_model, n: int) -> list[dict[str, torch.Tensor]]:
    """The trainer's weights at each of `n` rollouts (rollout 0: the initial ones)."""
    states = []
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for r in range(n):
            if r:
                for p in hf_model.parameters():
                    if p.is_floating_point() and p.numel() > 1:
                        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * STEP_SCALE * float(p.std()))
            states.append({k: v.detach().clone() for k, v in hf_model.state_dict().items()})
    return states


def _rollout_dir(out: Path, r: int) -> Path:
    return out / f"rollout_{r:05d}"


def trace_trainer(out: Path, cfg, states: list[dict]) -> None:
    from tic_trace.tools.demo_pairs import trace_megatron_tp1
    ids = torch.tensor(IDS)
    for r, sd in enumerate(states):
        trace_megatron_tp1(_rollout_dir(out, r) / "megatron", cfg, sd, ids)


def plant_engine_fault(sglang_model, fault: str) -> None:
    """Plant "precision" (faults.residual_bf16) or "routing" (faults.expert_bias) in layer LAYER of an SGLang model."""
    from tic_trace.testing.faults import plant
    plant(sglang_model, "sglang", {"precision": "residual_bf16", "routing": "expert_bias"}[fault], LAYER)


def trace_engine(out: Path, hf_model, states: list[dict], fault: str | None, start: int) -> None:
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from tic_trace.adapters.sglang_server import trace_forwards
    from tic_trace.testing import sglang_cpu as sc
    prompts = {k: IDS[b][:n] for b, (k, n) in enumerate(zip(KEYS, PROMPT_LENS))}
    forced = {k: IDS[b][n:] for b, (k, n) in enumerate(zip(KEYS, PROMPT_LENS))}
    sc.init_sglang_distributed(tp_size=1)
    try:
        hf_model.load_state_dict(states[0])
        model = sc.build_sglang_model(hf_model.config, hf_model)
        for r, sd in enumerate(states):
            if r and not (fault == "stale_sync" and r >= start):
                hf_model.load_state_dict(sd)
                DefaultModelLoader.load_weights_and_postprocess(model, iter(sc.hf_checkpoint_weights(hf_model)),
                                                                torch.device("cpu"))
            if r == start and fault in ("precision", "routing"):
                plant_engine_fault(model, fault)
            with trace_forwards(model, _rollout_dir(out, r) / "sglang", points_mode="full") as t, torch.no_grad():
                sc.SGLangRollout(model).generate(prompts, DECODE_STEPS, forced_tokens=forced)
            if t.failed:
                raise RuntimeError(f"tracing SGLang failed at rollout {r}: {t.failed}")
    finally:
        sc.destroy_sglang_distributed()


def build_runs(base: Path, specs: dict[str, tuple[str | None, int]], n_rollouts: int = 6) -> dict[str, Path]:
    """{name: run dir} for each `name -> (fault or None, start rollout)`, all on the same weights over time."""
    from tic_trace.testing.hf_models import build_hf_model, tiny_qwen3_config
    cfg = tiny_qwen3_config(moe=True)
    hf = build_hf_model(cfg, seed=0)
    states = training_steps(hf, n_rollouts)
    import shutil
    runs = {name: Path(base) / name for name in specs}
    trainer = Path(base) / "_trainer"
    trace_trainer(trainer, cfg, states)           # the trainer is the same in every run: traced once
    for d in runs.values():
        for r in range(n_rollouts):
            shutil.copytree(_rollout_dir(trainer, r) / "megatron", _rollout_dir(d, r) / "megatron")
    shutil.rmtree(trainer)
    for name, (fault, start) in specs.items():
        trace_engine(runs[name], hf, states, fault, start)
    return runs
