"""The slime flag (`--tic-trace`): default off, both sides of one rollout traced and compared.

slime itself cannot be installed here, so the parts of slime our code touches are stood in for by small
modules registered under slime's own module names, each modeled on the named function of THUDM/slime
624b824a and keeping exactly the call sites, signatures and attribute names our code relies on:

* ``slime.utils.misc.load_function`` (dotted ``pkg.module.attr``, cached),
* ``slime.utils.http_utils.post`` and ``slime.rollout.sglang_rollout`` (``post`` imported by name,
  ``generate(args, sample, sampling_params)`` building the ``/generate`` payload without a rid,
  ``generate_and_rm``'s dispatch to ``--custom-generate-function-path`` with ``evaluation=`` when accepted),
* ``slime.rollout.sample_hooks.set_current_rollout_id`` (called by ``RolloutManager.generate``),
* ``slime.backends.megatron_utils.data`` (``DataIterator``: ``rollout_data``, ``micro_batch_indices``,
  ``offset``, ``get_next``; ``get_batch``: samples concatenated, padded with token 0 to a multiple of
  ``tp * data_pad_size_multiplier`` as one extra pseudo-sequence, ``PackedSeqParams(qkv_format="thd")``),
* ``slime.backends.megatron_utils.model`` (``forward_only``: eval, before-log-prob hook
  ``(args, model, store_prefix)``, then per micro-batch ``get_batch`` -- looked up on the module at call
  time -- and ``model(input_ids=..., position_ids=None, attention_mask=None, labels=None,
  packed_seq_params=..., loss_mask=...)``; ``train_one_step``: before-train-step hook
  ``(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)`` then forward/backward),
* ``slime.backends.megatron_utils.actor.MegatronTrainRayActor`` (``train`` -> ``self.train_actor``: ref pass
  ``store_prefix="ref_"``, actor pass ``""`` unless the log-prob recompute is skipped, then training).

Everything else is real: megatron-core ``GPTModel`` chunks (local spec, inside megatron's own
``DistributedDataParallel``) with HF weights, running packed THD micro-batches (megatron's local attention
rejects THD, so a per-segment stand-in runs the core attention kernel, as in tests/test_megatron_adapter.py),
the SGLang model on the CPU harness with the hook spec our ``configure`` put into ``sglang_forward_hooks``
registered by SGLang's own ``register_forward_hooks``, and ``tic-trace slime-report``.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import functools
import importlib
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tic_trace.adapters.slime as ts
from tic_trace.tools.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


# ================================================================== slime's argument parsing

def slime_like_parser(add_custom_arguments=None) -> argparse.ArgumentParser:
    """The slime arguments these tests touch, with slime's defaults (slime/utils/arguments.py,
    slime/backends/sglang_utils/arguments.py at SLIME_COMMIT). ``add_custom_arguments(parser) -> parser``
    is applied first, as ``get_slime_extra_args_provider`` does; megatron's parser has allow_abbrev=False."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    if add_custom_arguments is not None:
        p = add_custom_arguments(p)
    a = p.add_argument
    a("--rollout-batch-size", type=int, required=True)
    a("--n-samples-per-prompt", type=int, default=1)
    a("--rollout-temperature", type=float, default=1.0)
    a("--rollout-max-response-len", type=int, default=None)
    a("--rollout-function-path", type=str, default="slime.rollout.sglang_rollout.generate_rollout")
    a("--custom-generate-function-path", type=str, default=None)
    a("--custom-megatron-init-path", type=str, default=None)
    a("--custom-megatron-before-log-prob-hook-path", type=str, default=None)
    a("--custom-megatron-before-train-step-hook-path", type=str, default=None)
    a("--custom-config-path", type=str, default=None)
    a("--save", type=str, default=None)
    a("--data-pad-size-multiplier", type=int, default=128)
    a("--allgather-cp", action="store_true", default=False)
    a("--context-parallel-size", type=int, default=1)
    a("--update-weights-interval", type=int, default=1)
    a("--keep-old-actor", action="store_true", default=False)
    a("--use-rollout-logprobs", action="store_true", default=False)
    a("--kl-coef", type=float, default=0.0)
    # pre-parsed by _pre_parse_mode
    a("--debug-rollout-only", action="store_true", default=False)
    a("--debug-train-only", action="store_true", default=False)
    # phase 1: SGLang's ServerArgs flags, each `--foo` as `--sglang-foo` -> args.sglang_foo (ServerArgs defaults)
    a("--sglang-router-ip", type=str, default=None)
    a("--sglang-router-port", type=int, default=None)
    a("--sglang-disable-cuda-graph", action="store_true", default=False)
    a("--sglang-disable-radix-cache", action="store_true", default=False)
    a("--sglang-forward-hooks", type=json.loads, default=None)
    a("--sglang-config", type=str, default=None)
    return p


def parse(argv, custom=True):
    """parse_args(add_custom_arguments=...) then slime_validate_args' --custom-config-path handling (every
    top-level YAML key is setattr on args)."""
    import yaml
    args = slime_like_parser(ts.add_arguments if custom else None).parse_args(argv)
    if args.custom_config_path:
        with open(args.custom_config_path) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(args, k, v)
    return args


BASE_ARGV = ["--rollout-batch-size", "2", "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "30000"]


def _has_sglang_spec() -> bool:
    try:
        return hasattr(importlib.import_module("tic_trace.adapters.sglang"), "forward_hooks_spec")
    except Exception:  # noqa: BLE001
        return False


needs_sglang_adapter = pytest.mark.skipif(not _has_sglang_spec(),
                                          reason="tic_trace.adapters.sglang.forward_hooks_spec not available")


# ================================================================== stand-ins for slime's modules

@dataclasses.dataclass
class Sample:
    """The fields of slime.utils.types.Sample that generate / the train-data conversion use."""
    index: int | None = None
    group_index: int | None = None
    prompt: str = ""
    tokens: list = dataclasses.field(default_factory=list)
    response_length: int = 0
    rollout_log_probs: list | None = None
    loss_mask: list | None = None
    status: str = "pending"


def _mod(name):
    return sys.modules[name]


@functools.cache
def _load_function(path):
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


async def _post(url, payload, max_retries=60, headers=None):
    return await _mod("slime.utils.http_utils").ROUTER(url, payload)


async def _default_generate(args, sample, sampling_params):
    """slime.rollout.sglang_rollout.generate: token-in payload, no rid; appends the response."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    payload = {"sampling_params": sampling_params, "return_logprob": True, "input_ids": list(sample.tokens)}
    output = await _mod("slime.rollout.sglang_rollout").post(url, payload, headers=None)  # module global `post`
    lps = output["meta_info"]["output_token_logprobs"]
    sample.tokens = list(sample.tokens) + [t for _, t, _ in lps]
    sample.response_length += len(lps)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [lp for lp, _, _ in lps]
    sample.loss_mask = [1] * sample.response_length
    sample.status = "completed"
    return sample


async def _generate_and_rm(args, sample, sampling_params, evaluation=False):
    """sglang_rollout.generate_and_rm's dispatch (the reward model part left out)."""
    path = args.custom_generate_function_path
    if path is not None:
        fn = _mod("slime.utils.misc").load_function(path)
        import inspect
        if "evaluation" in inspect.signature(fn).parameters:
            return await fn(args, sample, sampling_params, evaluation=evaluation)
        return await fn(args, sample, sampling_params)
    return await _mod("slime.rollout.sglang_rollout").generate(args, sample, sampling_params)


def rollout(args, rollout_id, samples, max_new_tokens=4, evaluation=False):
    """RolloutManager.generate -> set_current_rollout_id -> the rollout function -> generate_and_rm per
    sample, concurrently."""
    _mod("slime.rollout.sample_hooks").set_current_rollout_id(rollout_id)

    async def run():
        return await asyncio.gather(*[_generate_and_rm(args, s, {"max_new_tokens": max_new_tokens,
                                                                 "temperature": args.rollout_temperature},
                                                       evaluation=evaluation) for s in samples])
    return asyncio.run(run())


class DataIterator:
    """slime.backends.megatron_utils.data.DataIterator."""

    def __init__(self, rollout_data, micro_batch_indices):
        self.rollout_data = rollout_data
        self.micro_batch_indices = micro_batch_indices
        self.offset = 0

    def get_next(self, keys):
        indices = self.micro_batch_indices[self.offset]
        batch = {k: (None if self.rollout_data.get(k) is None else [self.rollout_data[k][i] for i in indices])
                 for k in keys}
        self.offset += 1
        return batch

    def reset(self):
        self.offset = 0
        return self


def _get_batch(data_iterator, keys, pad_multiplier=128, allgather_cp=False):
    """slime.backends.megatron_utils.data.get_batch at context-parallel size 1."""
    from megatron.core import mpu
    from megatron.core.packed_seq_params import PackedSeqParams
    batch = data_iterator.get_next(keys)
    tokens = batch["tokens"]
    batch["unconcat_tokens"] = tokens
    cu = [0]
    for t in tokens:
        cu.append(cu[-1] + t.numel())
    flat = torch.cat(tokens)
    pad_size = mpu.get_tensor_model_parallel_world_size() * pad_multiplier
    pad = (pad_size - flat.numel() % pad_size) % pad_size
    if pad:
        flat = F.pad(flat, (0, pad), value=0)
        cu.append(cu[-1] + pad)
    cu = torch.tensor(cu, dtype=torch.int)
    mx = int((cu[1:] - cu[:-1]).max())
    batch["tokens"] = flat.unsqueeze(0)
    batch["packed_seq_params"] = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx,
                                                 max_seqlen_kv=mx, qkv_format="thd")
    masks = [F.pad(m, (L - R - 1, 1), value=0) for m, L, R in
             zip(batch["loss_masks"], batch["total_lengths"], batch["response_lengths"])]
    batch["full_loss_masks"] = F.pad(torch.cat(masks), (0, pad), value=0).unsqueeze(0)
    return batch


def get_log_probs(logits, *, args, unconcat_tokens, total_lengths, response_lengths):
    """loss.get_log_probs_and_entropy: logits / temperature; for a sample of length L with R response
    tokens, response log-probs are rows [L-R-1, L-1) of its segment (rollout_log_probs[i] <-> row
    prompt_len-1+i)."""
    lp = torch.log_softmax(logits.squeeze(0).float() / args.rollout_temperature, dim=-1)
    out, off = [], 0
    for toks, L, R in zip(unconcat_tokens, total_lengths, response_lengths):
        rows = torch.arange(L - R - 1, L - 1)
        out.append(lp[off + rows, toks[L - R:]])
        off += L
    return {"log_probs": out}


_BATCH_KEYS = ["tokens", "loss_masks", "multimodal_train_inputs", "total_lengths", "response_lengths"]


def _forward_kwargs(batch):
    return {"input_ids": batch["tokens"], "position_ids": None, "attention_mask": None, "labels": None,
            "packed_seq_params": batch["packed_seq_params"], "loss_mask": batch["full_loss_masks"]}


@torch.no_grad()
def _forward_only(f, args, model, data_iterator, num_microbatches, store_prefix=""):
    """slime.backends.megatron_utils.model.forward_only (no pipeline parallelism)."""
    for it in data_iterator:
        it.reset()
    for m in model:
        m.eval()
    if args.custom_megatron_before_log_prob_hook_path:
        hook = _mod("slime.utils.misc").load_function(args.custom_megatron_before_log_prob_hook_path)
        hook(args, model, store_prefix)
    values = []
    for n in num_microbatches:
        for _ in range(n):
            batch = _mod("slime.backends.megatron_utils.model").get_batch(
                data_iterator[0], _BATCH_KEYS, args.data_pad_size_multiplier, args.allgather_cp)
            logits = model[0](**_forward_kwargs(batch))
            values += f(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                        total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"])["log_probs"]
    for m in model:
        m.train()
    return {f"{store_prefix}log_probs": values}


def _train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler,
                    num_microbatches):
    """slime.backends.megatron_utils.model.train_one_step (forward/backward; no optimizer step)."""
    for m in model:
        m.zero_grad()
    if args.custom_megatron_before_train_step_hook_path:
        hook = _mod("slime.utils.misc").load_function(args.custom_megatron_before_train_step_hook_path)
        hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)
    for _ in range(num_microbatches):
        batch = _mod("slime.backends.megatron_utils.model").get_batch(
            data_iterator[0], _BATCH_KEYS, args.data_pad_size_multiplier, args.allgather_cp)
        logits = model[0](**_forward_kwargs(batch))
        lp = get_log_probs(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                           total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"])
        (-torch.cat(lp["log_probs"]).mean()).backward()


def _train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches):
    for it in data_iterator:
        it.reset()
    for m in model:
        m.train()
    args = _mod("slime.backends.megatron_utils.actor").ARGS
    for step_id, n in enumerate(num_microbatches):
        _train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler, n)


class MegatronTrainRayActor:
    """slime.backends.megatron_utils.actor.MegatronTrainRayActor.train / train_actor (no ray, no weight
    swapping: ref and actor passes run the same modules, as slime's in-place weight switch does)."""

    def __init__(self, args, model, *, with_ref=False, skip_log_prob=False):
        self.args, self.model, self.with_ref, self.skip_log_prob = args, model, with_ref, skip_log_prob

    def train(self, rollout_id, rollout_data_ref, external_data=None):
        self.train_actor(rollout_id, rollout_data_ref, external_data=external_data)

    def train_actor(self, rollout_id, rollout_data, external_data=None):
        data_iterator = [DataIterator(rollout_data, rollout_data["micro_batch_indices"])]
        nmb = rollout_data["num_microbatches"]
        am = _mod("slime.backends.megatron_utils.actor")
        if self.with_ref:
            rollout_data.update(am.forward_only(get_log_probs, self.args, self.model, data_iterator, nmb,
                                                store_prefix="ref_"))
        if not self.skip_log_prob:   # can_reuse_log_probs_in_loss / --use-rollout-logprobs skip this pass
            rollout_data.update(am.forward_only(get_log_probs, self.args, self.model, data_iterator, nmb,
                                                store_prefix=""))
        am.train(rollout_id, self.model, types.SimpleNamespace(), types.SimpleNamespace(), data_iterator, nmb)


def train_data(samples, micro_batches):
    """RolloutManager._convert_samples_to_train_data + _split_train_data_by_dp at DP=1 (tensorized)."""
    return {
        "partition": list(range(len(samples))),
        "tokens": [torch.tensor(s.tokens, dtype=torch.long) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "total_lengths": [len(s.tokens) for s in samples],
        "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.int) for s in samples],
        "sample_indices": [s.index for s in samples],
        "rollout_log_probs": [torch.tensor(s.rollout_log_probs) for s in samples],
        "micro_batch_indices": micro_batches,
        "num_microbatches": [len(micro_batches)],
    }


_PACKAGES = {"slime", "slime.utils", "slime.rollout", "slime.backends", "slime.backends.megatron_utils"}


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    if name in _PACKAGES:
        m.__path__ = []          # a package: its submodules are found in sys.modules
    return m


@pytest.fixture
def fake_slime(monkeypatch):
    """slime's modules (stand-ins, see the module docstring) and fresh per-process state of our adapter."""
    sample_hooks = _module("slime.rollout.sample_hooks", _current_rollout_id=None)

    def set_current_rollout_id(rollout_id):
        sample_hooks._current_rollout_id = rollout_id
    sample_hooks.set_current_rollout_id = set_current_rollout_id
    http = _module("slime.utils.http_utils", post=_post, ROUTER=None)
    mods = [
        _module("slime"), _module("slime.utils"), _module("slime.rollout"), _module("slime.backends"),
        _module("slime.backends.megatron_utils"),
        _module("slime.utils.misc", load_function=functools.cache(_load_function.__wrapped__)),
        http, sample_hooks,
        # `from slime.utils.http_utils import post`: a name bound at import
        _module("slime.rollout.sglang_rollout", post=http.post, generate=_default_generate,
                generate_and_rm=_generate_and_rm),
        _module("slime.backends.megatron_utils.data", DataIterator=DataIterator, get_batch=_get_batch),
        _module("slime.backends.megatron_utils.model", get_batch=_get_batch, forward_only=_forward_only,
                train_one_step=_train_one_step, train=_train),
        _module("slime.backends.megatron_utils.actor", MegatronTrainRayActor=type(
            "MegatronTrainRayActor", (MegatronTrainRayActor,), {}), forward_only=_forward_only, train=_train,
            ARGS=None),
    ]
    for m in mods:
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(ts, "_S", ts._State())
    monkeypatch.setattr(ts, "_PATCHED", set())
    return types.SimpleNamespace(**{m.__name__.rsplit(".", 1)[-1]: m for m in mods})


class RecordingRouter:
    """A router that records every request and answers with fixed tokens (no model)."""

    def __init__(self):
        self.requests = []

    async def __call__(self, url, payload):
        self.requests.append((url, payload))
        n = payload["sampling_params"]["max_new_tokens"]
        return {"text": "", "meta_info": {"output_token_logprobs": [(-1.0, 7, None)] * n}}


# ================================================================== off means off

def test_flags_off_leave_slime_defaults_and_import_nothing():
    import yaml  # noqa: F401 - parse() imports it; not part of what the flag may import
    plain = vars(parse(BASE_ARGV, custom=False))
    before = set(sys.modules)
    args = parse(BASE_ARGV)
    snap = copy.deepcopy(vars(args))
    out = ts.configure(args)
    assert out is args and vars(args) == snap
    assert set(sys.modules) == before, sorted(set(sys.modules) - before)
    ours = {k: v for k, v in vars(args).items() if k.startswith("tic_trace")}
    assert ours == {"tic_trace": False, "tic_trace_dir": None, "tic_trace_rollout_ids": "0",
                    "tic_trace_max_samples": 4, "tic_trace_mode": "rows", "tic_trace_filter": None}
    assert {k: v for k, v in vars(args).items() if not k.startswith("tic_trace")} == plain
    assert ts.MODES == __import__("tic_trace.filters", fromlist=["MODES"]).MODES
    # importing the flag module pulls in no framework adapter and no framework
    code = ("import sys; import tic_trace.adapters.slime; "
            "bad = [m for m in ('tic_trace.adapters.megatron', 'tic_trace.adapters.sglang', 'megatron', 'sglang', "
            "'tic_trace.align', 'tic_trace.diverge') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_sglang_adapter
def test_configure_sets_hooks_server_args_and_chains_user_hooks(tmp_path):
    user_spec = [{"name": "mine", "target_modules": ["model.norm"], "hook_factory": "mypkg.hooks:factory"}]
    args = parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path / "t"), "--tic-trace-rollout-ids",
                              "3,0", "--tic-trace-filter", "*layers.0*", "*layers.1*",
                              "--custom-megatron-before-log-prob-hook-path", "mypkg.hooks.before_log_prob",
                              "--custom-generate-function-path", "mypkg.rollout.generate",
                              "--sglang-forward-hooks", json.dumps(user_spec)])
    ts.configure(args)
    assert args.tic_trace_rollout_ids == [0, 3] and args.tic_trace_dir == str(tmp_path / "t")
    assert args.tic_trace_filter == ["*layers.0*", "*layers.1*"]
    for attr, path in ts.HOOK_PATHS.items():
        assert getattr(args, attr) == path
        mod, _, fn = path.rpartition(".")          # slime's load_function: dotted pkg.module.attr
        assert callable(getattr(importlib.import_module(mod), fn))
    assert args.tic_trace_chained_hooks == {
        "custom_megatron_before_log_prob_hook_path": "mypkg.hooks.before_log_prob",
        "custom_generate_function_path": "mypkg.rollout.generate"}
    assert args.sglang_disable_cuda_graph is True and args.sglang_disable_radix_cache is True
    hooks = args.sglang_forward_hooks
    assert hooks[0] == user_spec[0] and len(hooks) > 1
    assert all(h["hook_factory"].startswith("tic_trace.adapters.sglang") for h in hooks[1:])
    json.dumps(hooks)                               # ServerArgs(forward_hooks=...) gets plain JSON data
    snap = copy.deepcopy(vars(args))
    ts.configure(args)                              # idempotent: no self-chaining, no duplicate specs
    assert vars(args) == snap


@needs_sglang_adapter
def test_custom_config_yaml_keys_are_normalised(tmp_path):
    cfg = tmp_path / "trace.yaml"
    cfg.write_text("tic_trace: true\ntic_trace_dir: traces\ntic_trace_rollout_ids: [3, 0]\n"
                   "tic_trace_max_samples: '2'\ntic_trace_mode: FULL\ntic_trace_filter: '*layers.0*,*norm*'\n")
    args = ts.configure(parse(BASE_ARGV + ["--custom-config-path", str(cfg), "--save", str(tmp_path / "ck")]))
    assert args.tic_trace is True and args.tic_trace_rollout_ids == [0, 3] and args.tic_trace_max_samples == 2
    assert args.tic_trace_mode == "full" and args.tic_trace_filter == ["*layers.0*", "*norm*"]
    assert Path(args.tic_trace_dir).is_absolute() and args.tic_trace_dir.endswith("traces")
    assert args.custom_megatron_init_path == ts.HOOK_PATHS["custom_megatron_init_path"]
    # default directory: under --save
    a2 = ts.configure(parse(BASE_ARGV + ["--tic-trace", "--save", str(tmp_path / "ck")]))
    assert a2.tic_trace_dir == str(tmp_path / "ck" / "tic_trace")
    for bad in ("tic_trace_rollout_ids: [a]", "tic_trace_max_samples: 0", "tic_trace_mode: everything"):
        cfg.write_text(f"tic_trace: true\n{bad}\n")
        with pytest.raises(ValueError, match=bad.split(":")[0]):
            ts.configure(parse(BASE_ARGV + ["--custom-config-path", str(cfg)]))


# ================================================================== rollout side: rid

def test_generate_tags_traced_samples_through_slimes_default_generate(fake_slime, tmp_path):
    args = parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path), "--tic-trace-rollout-ids", "0,3",
                              "--tic-trace-max-samples", "1", "--debug-train-only"])
    ts.configure(args)                      # debug-train-only: no SGLang spec needed for this unit test
    router = fake_slime.http_utils.ROUTER = RecordingRouter()
    # rollout 3 of a run with 2 samples per rollout: indices 6, 7 (slime's sample index runs on)
    samples = [Sample(index=6, tokens=[1, 2, 3]), Sample(index=7, tokens=[4, 5])]
    out = rollout(args, 3, samples, max_new_tokens=2)
    rids = {p["input_ids"][0]: p.get("rid") for _, p in router.requests}
    assert rids == {1: "3-6", 4: None}     # 6 % 2 == 0 < max_samples 1; 7 % 2 == 1 is not traced
    assert out[0].tokens == [1, 2, 3, 7, 7] and out[0].rollout_log_probs == [-1.0, -1.0]
    assert fake_slime.sglang_rollout.post is not _post     # slime's name-bound `post` was wrapped
    router.requests.clear()
    rollout(args, 1, [Sample(index=2, tokens=[1])])        # rollout not traced
    rollout(args, 0, [Sample(index=0, tokens=[1])], evaluation=True)  # evaluation never tagged
    assert [p.get("rid") for _, p in router.requests] == [None, None]
    assert ts._RID.get() is None


# ================================================================== Megatron on CPU

def megatron_chunks(hf):
    """[DDP(GPTModel)] with `role` on chunk 0, as slime's initialize_model_and_optimizer returns them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
    from tic_trace.testing import megatron_cpu as mc
    gpt = mc.build_gpt_model(hf.config)
    load_into(gpt, hf_to_megatron_state_dict(hf.state_dict(), hf.config))
    mc.per_segment_thd_attention(gpt)
    chunk = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
    chunk.role = "actor"
    return [chunk]


@pytest.fixture(scope="module")
def hf_model():
    import megatron.core  # noqa: F401 - required
    from tic_trace.testing.hf_models import build_hf_model, tiny_qwen3_config
    return build_hf_model(tiny_qwen3_config(moe=True), seed=0)


def _init_megatron():
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tic_trace.testing import megatron_cpu as mc
    mc.apply_all()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)


def _passes(d: Path):
    from tic_trace.format import open_trace
    tr = open_trace(d)
    return [tr.open_pass(r, i) for r in tr.ranks for i in tr.pass_indices(r)]


def test_skipped_log_prob_pass_traces_train_step0(fake_slime, hf_model, tmp_path):
    """can_reuse_log_probs_in_loss: no actor log-prob pass -> train step 0 is traced (forward only: the
    backward's recompute is not), step 1 is not; a ref pass is never traced; the critic is never traced."""
    from tic_trace.testing import megatron_cpu as mc
    mc.init_parallel(0, 1)
    try:
        args = parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path), "--debug-train-only",
                                  "--tic-trace-max-samples", "2", "--data-pad-size-multiplier", "16"])
        ts.configure(args)
        fake_slime.actor.ARGS = args
        _mod("slime.utils.misc").load_function(args.custom_megatron_init_path)(args)   # initialize.init
        model = megatron_chunks(hf_model)
        g = torch.Generator().manual_seed(3)
        samples = [Sample(index=i, tokens=torch.randint(1, 128, (n,), generator=g).tolist(), response_length=3,
                          loss_mask=[1] * 3, rollout_log_probs=[0.0] * 3) for i, n in ((0, 9), (1, 7))]
        data = train_data(samples, [[0], [1]])
        data["num_microbatches"] = [1, 1]            # two train steps of one micro-batch each
        actor = fake_slime.actor.MegatronTrainRayActor(args, model, with_ref=True, skip_log_prob=True)
        actor.train(0, data)
        ps = _passes(tmp_path / "rollout_00000" / "megatron")
        assert [(p.meta["tag"], p.rows["keys"][0]) for p in ps] == [("train_step0", "0-0")]
        assert {r.phase for r in ps[0].records} == {"forward"}
        assert ts._S.session is None
        # an actor pass starts tracing; a teacher pass ends it and is not traced; nor is the critic's values
        # pass ("" prefix on a critic model)
        ts._S.rollout_id = 0
        ts.before_log_prob_hook(args, model, "")
        assert ts._S.session is not None
        ts.before_log_prob_hook(args, model, "teacher_")
        assert ts._S.session is None
        model[0].role = "critic"
        ts.before_log_prob_hook(args, model, "")
        assert ts._S.session is None
    finally:
        mc.destroy(remove_patches=True)


# ================================================================== the whole flow: rollout -> train -> report

class EngineRouter:
    """Batches the concurrent /generate requests of one rollout into one SGLang prefill + decode run on
    the CPU harness (like the scheduler batching them) and answers each with its output token log-probs."""

    def __init__(self, engine, expected):
        self.engine, self.expected, self.pending, self.seen = engine, expected, [], []

    async def __call__(self, url, payload):
        fut = asyncio.get_running_loop().create_future()
        rid = payload.get("rid") or f"auto-{len(self.seen)}"
        self.seen.append(payload)
        self.pending.append((rid, payload, fut))
        if len(self.pending) == self.expected:
            batch, self.pending = self.pending, []
            n = batch[0][1]["sampling_params"]["max_new_tokens"]
            res = self.engine.generate({r: p["input_ids"] for r, p, _ in batch}, n - 1)
            logits = res.next_token_logits_by_position()
            for r, p, f in batch:
                out, P = res.outputs[r], len(p["input_ids"])
                lps = [float(torch.log_softmax(logits[(r, P - 1 + j)].float(), -1)[t]) for j, t in enumerate(out)]
                f.set_result({"text": "", "meta_info": {"output_token_logprobs": list(zip(lps, out, [None] * n))}})
        return await fut


USER_CALLS: list = []


def user_init(args):
    USER_CALLS.append(("init",))


def user_before_log_prob(args, model_chunks, store_prefix):
    USER_CALLS.append(("log_prob", store_prefix, type(model_chunks).__name__))


def user_before_train_step(args, rollout_id, step_id, model_chunks, optimizer, opt_param_scheduler):
    USER_CALLS.append(("train_step", rollout_id, step_id))


async def user_generate(args, sample, sampling_params, evaluation=False):
    """A user's custom generate: sends its own request through slime's http_utils.post."""
    USER_CALLS.append(("generate", sample.index, evaluation))
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    out = await _mod("slime.utils.http_utils").post(url, {"input_ids": list(sample.tokens),
                                                          "sampling_params": dict(sampling_params),
                                                          "return_logprob": True})
    lps = out["meta_info"]["output_token_logprobs"]
    sample.tokens = list(sample.tokens) + [t for _, t, _ in lps]
    sample.response_length = len(lps)
    sample.rollout_log_probs = [lp for lp, _, _ in lps]
    sample.loss_mask = [1] * len(lps)
    return sample


@needs_sglang_adapter
def test_rollout_train_report_two_rollouts(fake_slime, hf_model, tmp_path):
    """Rollouts 0 and 1, two samples each (indices 0,1 and 2,3): SGLang prefill + decode with the rids our
    generate sets, then the actor's log-prob pass over one packed THD micro-batch (after a ref pass that
    must not be traced), then `tic-trace slime-report`: rollout 0 clean -> consistent; rollout 1 with a
    fault planted in Megatron's layer-1 input RMSNorm -> the report names that point."""
    import sglang  # noqa: F401 - required
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    from tic_trace.testing import sglang_cpu as sc
    from tic_trace.testing.faults import FAULTS, plant

    here = __name__
    USER_CALLS.clear()
    out = tmp_path / "traces"
    args = parse(BASE_ARGV + [
        "--tic-trace", "--tic-trace-dir", str(out), "--tic-trace-rollout-ids", "0,1",
        "--tic-trace-max-samples", "2", "--data-pad-size-multiplier", "16", "--kl-coef", "0.01",
        "--custom-megatron-init-path", f"{here}.user_init",
        "--custom-megatron-before-log-prob-hook-path", f"{here}.user_before_log_prob",
        "--custom-megatron-before-train-step-hook-path", f"{here}.user_before_train_step",
        "--custom-generate-function-path", f"{here}.user_generate"])
    ts.configure(args)
    fake_slime.actor.ARGS = args

    sc.init_sglang_distributed(tp_size=1)
    try:
        _init_megatron()                        # megatron's groups on the same one-process world
        # SGLang server: the model, with the --forward-hooks spec registered the way ModelRunner does
        sg_model = sc.build_sglang_model(hf_model.config, hf_model)
        register_forward_hooks(sg_model, args.sglang_forward_hooks)
        engine = sc.SGLangRollout(sg_model)
        # train actor: initialize.init -> custom init, then the model chunks
        _mod("slime.utils.misc").load_function(args.custom_megatron_init_path)(args)
        model = megatron_chunks(hf_model)
        actor = fake_slime.actor.MegatronTrainRayActor(args, model, with_ref=True)

        g = torch.Generator().manual_seed(11)
        prompts = {0: [9, 5], 1: [6, 8]}        # prompt lengths per rollout
        for rollout_id in (0, 1):
            samples = [Sample(index=2 * rollout_id + j, tokens=torch.randint(1, 128, (n,), generator=g).tolist())
                       for j, n in enumerate(prompts[rollout_id])]
            fake_slime.http_utils.ROUTER = router = EngineRouter(engine, expected=2)
            samples = rollout(args, rollout_id, samples, max_new_tokens=4)
            assert sorted(p["rid"] for p in router.seen) == [f"{rollout_id}-{s.index}" for s in samples]
            if rollout_id == 1:
                plant(model, "megatron", "rmsnorm_eps", 1)
            data = train_data(samples, [[0, 1]])
            actor.train(rollout_id, data)
            if rollout_id == 0:   # rollout_log_probs[i] <-> logits row prompt_len-1+i, same on both sides
                for a, b in zip(data["log_probs"], data["rollout_log_probs"]):
                    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    finally:
        from megatron.core import parallel_state as mps

        from tic_trace.adapters.sglang import close_sessions
        from tic_trace.testing import megatron_cpu as mc
        close_sessions()                        # the server's hook sessions: tracers stopped, forward restored
        mps.destroy_model_parallel()
        mc.remove_shims()
        sc.destroy_sglang_distributed()

    # user hooks were chained, with slime's arguments
    assert USER_CALLS[0] == ("init",)
    assert [c for c in USER_CALLS if c[0] == "log_prob"] == [("log_prob", "ref_", "list"), ("log_prob", "", "list")] * 2
    assert [c for c in USER_CALLS if c[0] == "train_step"] == [("train_step", 0, 0), ("train_step", 1, 0)]
    assert sorted(c[1] for c in USER_CALLS if c[0] == "generate") == [0, 1, 2, 3]

    for rollout_id in (0, 1):
        mg = _passes(out / f"rollout_{rollout_id:05d}" / "megatron")
        # one pass: the actor's log-prob micro-batch (the ref pass and the training step are not traced)
        assert [p.meta["tag"] for p in mg] == ["logprob"]
        keys = mg[0].rows["keys"]
        assert sorted(set(keys) - {None}) == [f"{rollout_id}-{2 * rollout_id}", f"{rollout_id}-{2 * rollout_id + 1}"]
        assert keys[-1] is None                 # the padding pseudo-sequence
        assert (out / f"rollout_{rollout_id:05d}" / "sglang").is_dir()

    clean = tmp_path / "r0.json"
    assert cli_main(["slime-report", str(out), "--rollout-id", "0", "--json", str(clean)]) == 0
    rep0 = json.loads(clean.read_text())
    assert rep0["verdict"] == "consistent" and rep0["rows"]["matched"] > 0
    assert rep0["worst_tokens"], "per-token log-prob differences are reported"
    bad = tmp_path / "r1.json"
    html = tmp_path / "r1.html"
    assert cli_main(["slime-report", str(out), "--rollout-id", "1", "--json", str(bad), "--html", str(html)]) == 1
    rep1 = json.loads(bad.read_text())
    fd = rep1["first_divergence"]
    assert (fd["point"], fd["layer"]) == (FAULTS["rmsnorm_eps"].point, 1)
    assert rep1["worst_tokens"][0]["divergence_starts"] is not None
    assert html.read_text().startswith("<!")


def test_slime_report_names_the_missing_side(tmp_path, capsys):
    assert cli_main(["slime-report", str(tmp_path / "nope"), "--rollout-id", "0"]) == 2
    assert "does not exist" in capsys.readouterr().out
    (tmp_path / "rollout_00003").mkdir()
    assert cli_main(["slime-report", str(tmp_path), "--rollout-id", "0"]) == 2
    out = capsys.readouterr().out
    assert "rollout_00000" in out and "rollout_00003" in out
    (tmp_path / "rollout_00000" / "sglang").mkdir(parents=True)
    assert cli_main(["slime-report", str(tmp_path), "--rollout-id", "0"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "megatron side missing" in out and "rollout_00000/megatron" in out


def test_slime_train_entry_point(tmp_path, monkeypatch, capsys):
    from tic_trace.adapters import slime_train
    monkeypatch.setitem(sys.modules, "slime", None)          # not installed
    assert slime_train.main(["--tic-trace"]) == 2
    assert "git clone https://github.com/THUDM/slime" in capsys.readouterr().err
    # installed: parse_args(add_custom_arguments=add_arguments) -> configure -> train.py's train(args)
    seen = {}

    def parse_args(add_custom_arguments=None):
        seen["custom"] = add_custom_arguments
        return parse(sys.argv[1:])
    monkeypatch.setitem(sys.modules, "slime", _module("slime", __file__=str(tmp_path / "slime" / "__init__.py")))
    monkeypatch.setitem(sys.modules, "slime.utils", _module("slime.utils"))
    monkeypatch.setitem(sys.modules, "slime.utils.arguments", _module("slime.utils.arguments", parse_args=parse_args))
    (tmp_path / "train.py").write_text("RAN = []\ndef train(args):\n    RAN.append(args)\n"
                                       "if __name__ == '__main__':\n    raise SystemExit('must not run')\n")
    assert slime_train.main(BASE_ARGV) == 0
    assert seen["custom"] is ts.add_arguments
    monkeypatch.setenv("TIC_TRACE_SLIME_ENTRY", "missing.py")
    assert slime_train.main(BASE_ARGV) == 2
    assert "missing.py" in capsys.readouterr().err
