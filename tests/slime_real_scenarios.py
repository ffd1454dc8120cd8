"""Scenarios on slime's own code, one per process: ``python tests/slime_real_scenarios.py NAME OUT_DIR``.

Run by tests/test_slime_real.py. Each scenario puts the vendored Megatron-LM and slime first on the path
(tic_trace.testing.slime_vendor.activate), runs slime's code with the --tic-trace integration, and writes
what it observed to ``OUT_DIR/result.json`` (the test asserts on it; traces go under ``OUT_DIR``).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tic_trace.testing import slime_vendor

slime_vendor.activate()

import torch  # noqa: E402

from tic_trace.testing import slime_real as sr  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model, tiny_qwen3_config  # noqa: E402

INTEGRATION = "tic_trace.integrations.slime"


def _integration():
    import importlib
    return importlib.import_module(INTEGRATION)


def _flow_argv(out: Path, ckpt, config, rollout_ids: str, max_samples: int) -> list[str]:
    """slime's arguments of a traced flow (rollout, reference and log-prob passes on Megatron, a constant reward),
    tracing `rollout_ids` with `max_samples` samples each into out/traces; the reference model in out/ref."""
    (out / "ref").mkdir()
    return sr.base_argv(ckpt, config) + [
        "--tic-trace", "--tic-trace-dir", str(out / "traces"), "--tic-trace-rollout-ids", rollout_ids,
        "--tic-trace-max-samples", str(max_samples), "--kl-coef", "0.01", "--ref-load", str(out / "ref"),
        "--lr", "0.0", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--custom-rm-path",
        "tic_trace.testing.slime_real.constant_reward", "--sglang-server-concurrency", "4"]


def _checkpoint(out: Path):
    hf = build_hf_model(tiny_qwen3_config(moe=True), seed=0)
    return hf, sr.write_checkpoint(hf.config, out / "hf")


def _plain(v):
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return repr(v)


# ================================================================== parse_args

def scenario_args(out: Path) -> dict:
    """slime's parse_args with and without our add_custom_arguments, then configure(); and the version check
    against slime's own modules."""
    ts = _integration()
    from tic_trace.integrations.slime.version import check_megatron_side, check_rollout_side
    check_rollout_side()
    check_megatron_side()
    hf, ckpt = _checkpoint(out)
    argv = sr.base_argv(ckpt, hf.config) + ["--debug-train-only"]
    plain = vars(sr.parse_args(argv))
    ours_off = vars(ts.configure(sr.parse_args(argv, ts.add_arguments)))
    on = ts.configure(sr.parse_args(argv + ["--tic-trace", "--tic-trace-dir", str(out / "t"),
                                            "--tic-trace-rollout-ids", "0,3"], ts.add_arguments))
    cfg = out / "trace.yaml"
    cfg.write_text(f"tic_trace: true\ntic_trace_dir: {out / 'y'}\ntic_trace_rollout_ids: [2]\n"
                   "tic_trace_max_samples: 1\n")
    yaml_on = ts.configure(sr.parse_args(argv + ["--custom-config-path", str(cfg)], ts.add_arguments))
    # the rollout side (SGLang server arguments) needs the sglang phase of parse_args
    argv_rollout = [a for a in argv if a != "--debug-train-only"]
    rollout_on = ts.configure(sr.parse_args(argv_rollout + ["--tic-trace"], ts.add_arguments))
    try:
        ts.configure(sr.parse_args(argv_rollout + ["--tic-trace", "--rollout-function-path",
                                                   "slime.rollout.fully_async_rollout.generate_rollout_fully_async"],
                                   ts.add_arguments))
        fully_async = None
    except ValueError as e:
        fully_async = str(e)
    return {
        "fully_async_refused": fully_async,
        "plain": {k: _plain(v) for k, v in plain.items()},
        "ours_off": {k: _plain(v) for k, v in ours_off.items()},
        "on": {k: _plain(getattr(on, k, None)) for k in (*ts.HOOK_PATHS, "tic_trace_rollout_ids", "tic_trace_dir")},
        "yaml": {k: _plain(getattr(yaml_on, k, None)) for k in (*ts.HOOK_PATHS, "tic_trace_rollout_ids",
                                                                "tic_trace_dir", "tic_trace_max_samples")},
        "rollout": {k: _plain(getattr(rollout_on, k, None)) for k in
                    ("sglang_disable_cuda_graph", "sglang_disable_radix_cache", "sglang_forward_hooks",
                     "sglang_enforce_disable_flashinfer_allreduce_fusion",
                     "custom_generate_function_path")},
        "hook_paths": dict(ts.HOOK_PATHS),
        "server_args_in_slime_parser": {k: k in vars(sr.parse_args(argv_rollout)) for k in ts.SERVER_ARGS},
    }


# ================================================================== Megatron side


def _megatron_world():
    from tic_trace.testing import megatron_cpu as mc
    mc.init_parallel(0, 1)
    sr.install_cpu_accelerator()
    sr.install_cpu_shims()


def _samples(rollout_id: int, lengths, *, response_length=0, seed=0):
    from slime.utils.types import Sample
    g = torch.Generator().manual_seed(seed + rollout_id)
    out = []
    for j, n in enumerate(lengths):
        s = Sample(index=len(lengths) * rollout_id + j, group_index=len(lengths) * rollout_id + j,
                   tokens=torch.randint(2, 128, (n,), generator=g).tolist())
        if response_length:
            s.response_length = response_length
            s.loss_mask = [1] * response_length
            s.rollout_log_probs = [-0.5] * response_length
            s.status = Sample.Status.COMPLETED
            s.reward = 1.0
        out.append(s)
    return out


def _passes(d: Path) -> list[dict]:
    from tic_trace import open_trace
    tr = open_trace(d)
    out = []
    for r in tr.ranks:
        for i in tr.pass_indices(r):
            p = tr.open_pass(r, i)
            out.append({"tag": p.meta.get("tag"), "keys": list(p.rows["keys"]) if p.rows else None,
                        "phases": sorted({rec.phase for rec in p.records})})
    return out


def scenario_train_step0(out: Path) -> dict:
    """kl_coef 0, one train step: can_reuse_log_probs_in_loss skips the actor's log-prob pass; train step 0
    is traced instead (its forward only), through slime's train -> train_one_step."""
    from megatron.training.global_vars import set_args
    ts = _integration()
    hf, ckpt = _checkpoint(out)
    args = ts.configure(sr.parse_args(sr.base_argv(ckpt, hf.config) + [
        "--debug-train-only", "--tic-trace", "--tic-trace-dir", str(out / "traces"), "--tic-trace-max-samples",
        "1", "--lr", "0.0"], ts.add_arguments))
    _megatron_world()
    set_args(args)
    from slime.utils.misc import load_function
    load_function(args.custom_megatron_init_path)(args)          # what initialize.init does
    actor = sr.train_actor(args, sr.model_chunks(hf), with_ref=False)
    refs = sr.train_data_refs(args, _samples(0, (9, 7), response_length=3))
    actor.train(0, refs)
    return {"passes": _passes(out / "traces" / "rollout_00000" / "megatron"),
            "num_microbatches": refs[0].inner["num_microbatches"], "micro_batch_indices": refs[0].inner["micro_batch_indices"],
            "sample_indices": [int(i) for i in refs[0].inner["sample_indices"]]}


# ================================================================== the whole flow


def _start_engine_and_trainer(args) -> None:
    """One process holding both sides, as the flow scenarios run them: SGLang's distributed state, Megatron's
    CPU shims and model parallel state, slime's args set (undone by `_stop_engine_and_trainer`)."""
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.global_vars import set_args

    from tic_trace.testing import megatron_cpu as mc
    from tic_trace.testing import sglang_cpu as sc
    sc.init_sglang_distributed(tp_size=1)
    mc.apply_all()
    mps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)
    sr.install_cpu_accelerator()
    sr.install_cpu_shims()
    set_args(args)


def _stop_engine_and_trainer(server) -> None:
    from megatron.core import parallel_state as mps

    from tic_trace.adapters.sglang_server import close_sessions
    from tic_trace.testing import megatron_cpu as mc
    from tic_trace.testing import sglang_cpu as sc
    close_sessions()
    if server is not None:
        server.stop()
    mps.destroy_model_parallel()
    mc.remove_shims()
    sc.destroy_sglang_distributed()


def scenario_flow(out: Path) -> dict:
    """Rollouts 0 and 1 (two samples each) through slime's generate_and_rm -> generate -> post over HTTP to
    SGLang's model code, train data built by slime's RolloutManager code, the actor's ref and log-prob
    passes through slime's train_actor -> compute_log_prob -> forward_only on Megatron's schedule.
    Rollout 1 runs with a fault planted in Megatron's layer-1 input RMSNorm."""
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    from tic_trace.testing import sglang_cpu as sc
    from tic_trace.testing.faults import plant
    ts = _integration()
    hf, ckpt = _checkpoint(out)
    argv = _flow_argv(out, ckpt, hf.config, "0,1", 2) + [
        # the user's own hooks: --tic-trace keeps them and calls them with slime's arguments
        "--custom-megatron-init-path", "tic_trace.testing.slime_real.user_init",
        "--custom-megatron-before-log-prob-hook-path", "tic_trace.testing.slime_real.user_before_log_prob",
        "--custom-megatron-before-train-step-hook-path", "tic_trace.testing.slime_real.user_before_train_step",
        "--custom-generate-function-path", "tic_trace.testing.slime_real.user_generate"]
    args = ts.configure(sr.parse_args(argv, ts.add_arguments))
    _start_engine_and_trainer(args)
    result = {"requests": {}, "passes": {}, "micro_batches": {}}
    server = None
    try:
        sg_model = sc.build_sglang_model(hf.config, hf)
        register_forward_hooks(sg_model, args.sglang_forward_hooks)    # what ModelRunner does with the spec
        server = sr.EngineServer(sc.SGLangRollout(sg_model), expected=2)
        args.sglang_router_port = server.start()
        from slime.utils.http_utils import init_http_client
        init_http_client(args)
        from slime.utils.misc import load_function
        load_function(args.custom_megatron_init_path)(args)
        model = sr.model_chunks(hf)
        actor = sr.train_actor(args, model, with_ref=True)
        for rollout_id in (0, 1):
            server.seen.clear()
            samples = sr.rollout(args, rollout_id, _samples(rollout_id, (9, 5), seed=11))
            result["requests"][rollout_id] = sorted(str(p.get("rid")) for p in server.seen)
            refs = sr.train_data_refs(args, samples)
            result["micro_batches"][rollout_id] = refs[0].inner["micro_batch_indices"]
            if rollout_id == 1:
                plant(model, "megatron", "rmsnorm_eps", 1)
            actor.train(rollout_id, refs)
    finally:
        _stop_engine_and_trainer(server)
    for rollout_id in (0, 1):
        result["passes"][rollout_id] = _passes(out / "traces" / f"rollout_{rollout_id:05d}" / "megatron")
    result["dir"] = str(out / "traces")
    result["user_calls"] = [list(c) for c in sr.USER_CALLS]
    return result


def scenario_logprobs(out: Path) -> dict:
    """The log-probs each side used (issue 37), through slime's own flow as scenario_flow, at
    --rollout-temperature 0.9: rollout 0's actor log-prob pass (compute_log_prob -> forward_only) with one of its
    two samples traced; rollout 1's train step 0 (kl_coef 0: slime's can_reuse_log_probs_in_loss skips the pass,
    policy_loss_function computes them) with both traced, the engine returning the log-probs of the original
    logits (SGLANG_RETURN_ORIGINAL_LOGPROB=1: before temperature, while the trainer divides by it) and the user's
    generate function masking each sample's first token out of the loss; rollout 2
    with tracing switched off (the hooks still installed); rollout 3's log-prob pass, both samples traced, generated
    by slime's streaming generate function (sglang_streaming_rollout.generate_streaming: SSE, not post). What
    slime itself holds is returned beside: each sample's rollout_log_probs, the log-prob pass's
    rollout_data["log_probs"] (through the actor's rollout_data_postprocess, called after compute_log_prob) and the
    train_rollout_logprob_abs_diff it logs."""
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    from tic_trace.testing import sglang_cpu as sc
    ts = _integration()
    hf, ckpt = _checkpoint(out)
    argv = _flow_argv(out, ckpt, hf.config, "0,1,2,3", 1) + ["--rollout-temperature", "0.9"]
    args = ts.configure(sr.parse_args(argv, ts.add_arguments))
    _start_engine_and_trainer(args)
    result = {"samples": {}, "trainer_log_probs": {}, "logged": _logged_metric(), "requests": {}}
    server = None
    try:
        sg_model = sc.build_sglang_model(hf.config, hf)
        register_forward_hooks(sg_model, args.sglang_forward_hooks)
        server = sr.EngineServer(sc.SGLangRollout(sg_model), expected=2)
        args.sglang_router_port = server.start()
        from slime.utils.http_utils import init_http_client
        init_http_client(args)
        from slime.utils.misc import load_function
        load_function(args.custom_megatron_init_path)(args)
        actor = sr.train_actor(args, sr.model_chunks(hf), with_ref=True)

        def keep(args_, rollout_id, rollout_data):       # slime's rollout_data_postprocess signature
            if "log_probs" in rollout_data:
                result["trainer_log_probs"][rollout_id] = {
                    str(int(i)): [float(x) for x in lp] for i, lp in
                    zip(rollout_data["sample_indices"], rollout_data["log_probs"])}
        actor.rollout_data_postprocess = keep
        for rollout_id in (0, 1, 2, 3):
            args.kl_coef = 0.01 if rollout_id in (0, 3) else 0.0
            args.tic_trace = rollout_id != 2
            args.tic_trace_max_samples = 1 if rollout_id == 0 else 2
            if rollout_id == 1:
                os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
                # the user's generate function masks each sample's first token out of the loss
                args.tic_trace_chained_hooks["custom_generate_function_path"] = \
                    "tic_trace.testing.slime_real.mask_first_token"
            if rollout_id == 3:             # slime's streaming generate: SSE through http_utils' client, not post
                args.tic_trace_chained_hooks["custom_generate_function_path"] = \
                    "slime.rollout.sglang_streaming_rollout.generate_streaming"
            server.seen.clear()
            samples = sr.rollout(args, rollout_id, _samples(rollout_id, (9, 5), seed=11))
            os.environ.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
            result["requests"][rollout_id] = sorted(str(p.get("rid")) for p in server.seen)
            result["samples"][rollout_id] = [
                {"index": s.index, "tokens": list(s.tokens), "response_length": s.response_length,
                 "rollout_log_probs": list(s.rollout_log_probs), "loss_mask": list(s.loss_mask)} for s in samples]
            actor.train(rollout_id, sr.train_data_refs(args, samples))
    finally:
        _stop_engine_and_trainer(server)
    result["dir"] = str(out / "traces")
    return result


def _logged_metric() -> list[float]:
    """slime's train_rollout_logprob_abs_diff as its train loop logs it (model.py: ``logger.info(f"{role_tag}step
    {accumulated_step_id}: {log_dict}")``), one value per train step, appended as they are logged."""
    import logging
    import re
    got: list[float] = []
    pat = re.compile(r"'train/train_rollout_logprob_abs_diff': ([-+0-9.eE]+)")

    class _Keep(logging.Handler):
        def emit(self, record):
            m = pat.search(record.getMessage())
            if m:
                got.append(float(m.group(1)))
    logging.getLogger("slime.backends.megatron_utils.model").addHandler(_Keep())
    return got


DRIFT_ROLLOUTS = 7       # rollouts 0-5 listed (rows), rollout 6 traced by --tic-trace-every 6 only (subset)
DRIFT_STALE_FROM = 3     # from this rollout on the engine keeps the weights it had


def _push_weights(hf, states_r, actor, sg_model, *, engine: bool) -> None:
    """The weight update after a training step: the trainer's new weights into Megatron's GPTModel (and into
    the actor's weight backup, which slime's train restores the model from, as its own train step leaves it),
    and (unless the sync is stale) into the engine's SGLang model through SGLang's own loader."""
    import torch as _t
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
    from tic_trace.testing import sglang_cpu as sc
    hf.load_state_dict(states_r)
    load_into(actor.model[0].module, hf_to_megatron_state_dict(hf.state_dict(), hf.config))
    actor.weights_backuper.backup("actor")
    if engine:
        DefaultModelLoader.load_weights_and_postprocess(sg_model, iter(sc.hf_checkpoint_weights(hf)), _t.device("cpu"))


def scenario_drift(out: Path, fault: str = "stale_sync") -> dict:
    """Seven rollouts through slime's own flow (as scenario_flow: generate_and_rm -> generate -> post over HTTP
    to SGLang's model code; train_actor -> compute_log_prob -> forward_only on Megatron's schedule) with
    --tic-trace-rollout-ids 0,1,2,3,4,5 --tic-trace-every 6: every rollout traced, rollout 6 in the periodic
    default mode. Between rollouts a training step moves the weights (tic_trace.testing.drift_runs.training_steps:
    slime's optimizer runs at lr 0 here, the step is applied to the weights directly) and the update is pushed to
    both sides. From rollout DRIFT_STALE_FROM on, `fault` acts in the engine: "stale_sync" skips the push to it,
    "precision" / "routing" plant tic_trace.testing.drift_runs' engine faults (a bf16 residual add, a top-k bias)
    in its SGLang model."""
    from tic_trace.testing.drift_runs import training_steps
    ts = _integration()
    hf, ckpt = _checkpoint(out)
    states = training_steps(hf, DRIFT_ROLLOUTS)
    lines = _keep_log_lines()
    argv = sr.base_argv(ckpt, hf.config) + [
        "--tic-trace", "--tic-trace-dir", str(out / "traces"), "--tic-trace-rollout-ids", "0,1,2,3,4,5",
        "--tic-trace-every", str(DRIFT_ROLLOUTS - 1), *DRIFT_ARGV]
    args = ts.configure(sr.parse_args(argv, ts.add_arguments))
    _start_engine_and_trainer(args)
    server = None
    try:
        server = sr.EngineServer(None, expected=2)
        args.sglang_router_port = server.start()
        _drift_rollouts(args, hf, states, server, fault, DRIFT_STALE_FROM)
    finally:
        _stop_engine_and_trainer(server)
    return {"dir": str(out / "traces"), "log": [ln for ln in lines if " traced (" in ln],
            "stale_from": DRIFT_STALE_FROM, "rollouts": DRIFT_ROLLOUTS}


#: What every drift scenario adds to slime's command line (besides which rollouts are traced).
DRIFT_ARGV = ["--tic-trace-max-samples", "2", "--lr", "0.0", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
              "64", "--custom-rm-path", "tic_trace.testing.slime_real.constant_reward",
              "--sglang-server-concurrency", "4"]


def _keep_log_lines() -> list[str]:
    """The integration's log lines (the one line per traced rollout), as they are logged."""
    import logging
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    logging.getLogger("tic_trace.slime").addHandler(_Keep())
    return lines


def _drift_rollouts(args, hf, states, server, fault: str | None, fault_from: int, actor=None):
    """One rollout per entry of `states` (the trainer's weights at each), one run into ``args.tic_trace_dir``,
    in the world `_start_engine_and_trainer` set up: a fresh engine model (its hooks from
    ``args.sglang_forward_hooks``) behind `server` and the trainer (`actor`, reset to ``states[0]``; None: a new
    one), both from ``states[0]``; `fault` (None: none) from rollout `fault_from` on. Returns the trainer."""
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    from slime.utils.http_utils import init_http_client
    from slime.utils.misc import load_function

    from tic_trace.testing import sglang_cpu as sc
    from tic_trace.testing.drift_runs import plant_engine_fault
    hf.load_state_dict(states[0])
    sg_model = sc.build_sglang_model(hf.config, hf)
    register_forward_hooks(sg_model, args.sglang_forward_hooks)
    server.engine = sc.SGLangRollout(sg_model)
    init_http_client(args)
    load_function(args.custom_megatron_init_path)(args)
    if actor is None:
        actor = sr.train_actor(args, sr.model_chunks(hf), with_ref=False)
    else:                               # slime's train actor is made once per job: the next run's start weights
        _push_weights(hf, states[0], actor, sg_model, engine=False)
    for rollout_id in range(len(states)):
        if rollout_id:
            _push_weights(hf, states[rollout_id], actor, sg_model,
                          engine=fault != "stale_sync" or rollout_id < fault_from)
        if rollout_id == fault_from and fault in ("precision", "routing"):
            plant_engine_fault(sg_model, fault)
        server.seen.clear()
        samples = sr.rollout(args, rollout_id, _samples(rollout_id, (9, 5), seed=11))
        actor.train(rollout_id, sr.train_data_refs(args, samples))
    return actor


DEFAULT_MODE_RUNS = {"clean": None, "precision": "precision", "routing": "routing"}
DEFAULT_MODE_ROLLOUTS = 5     # rollout 0 listed (rows), 1-4 periodic in the default mode
DEFAULT_MODE_FAULT_FROM = 3


def scenario_drift_default_mode(out: Path) -> dict:
    """Three runs in one engine+trainer world, each of DEFAULT_MODE_ROLLOUTS rollouts through slime's own flow
    with --tic-trace-every 1 and no --tic-trace-mode: rollout 0 (the default --tic-trace-rollout-ids) in rows,
    every other one in the periodic default mode. The weights move between rollouts and reach both sides; from
    rollout DEFAULT_MODE_FAULT_FROM on the engine runs a bf16 residual add ("precision") or a top-k bias
    ("routing"); "clean" has no fault. Each run into OUT/<run>/traces."""
    from tic_trace.adapters.sglang_server import close_sessions
    from tic_trace.testing.drift_runs import training_steps
    ts = _integration()
    hf, ckpt = _checkpoint(out)
    states = training_steps(hf, DEFAULT_MODE_ROLLOUTS)     # every run on the same weights over time
    lines = _keep_log_lines()
    argv = sr.base_argv(ckpt, hf.config) + ["--tic-trace", "--tic-trace-every", "1", *DRIFT_ARGV]
    args = ts.configure(sr.parse_args(argv + ["--tic-trace-dir", str(out / "clean" / "traces")], ts.add_arguments))
    result = {"runs": {}, "fault_from": DEFAULT_MODE_FAULT_FROM, "rollouts": DEFAULT_MODE_ROLLOUTS,
              "periodic_mode": args.tic_trace_periodic_mode}
    _start_engine_and_trainer(args)
    server = None
    try:
        server = sr.EngineServer(None, expected=2)
        port = server.start()
        actor = None
        for run, fault in DEFAULT_MODE_RUNS.items():
            args.tic_trace_dir = str(out / run / "traces")
            ts.configure(args)              # idempotent: the SGLang hook spec now names this run's directory
            args.sglang_router_port = port
            del lines[:]
            actor = _drift_rollouts(args, hf, states, server, fault, DEFAULT_MODE_FAULT_FROM, actor)
            close_sessions()                # the engine model's tracers end with the run
            result["runs"][run] = {"dir": args.tic_trace_dir, "log": [ln for ln in lines if " traced (" in ln]}
    finally:
        _stop_engine_and_trainer(server)
    return result


SCENARIOS = {"args": scenario_args, "train_step0": scenario_train_step0, "flow": scenario_flow,
             "logprobs": scenario_logprobs,
             "drift": scenario_drift,
             "drift_precision": lambda out: scenario_drift(out, "precision"),
             "drift_routing": lambda out: scenario_drift(out, "routing"),
             "drift_default_mode": scenario_drift_default_mode}


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    res = SCENARIOS[name](out)
    (out / "result.json").write_text(json.dumps(res, default=repr))
    os._exit(0)       # slime's background event-loop thread and gloo groups: no slow interpreter teardown


if __name__ == "__main__":
    main()
