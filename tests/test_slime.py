"""Unit tests of the slime integration's own logic (flags, configure, request tagging, slime-report errors, the
entry point), in this process, without slime.

slime's real code paths (parse_args with Megatron-LM's parser, the train actor on Megatron's schedule,
generate_and_rm over HTTP, and the reports on those traces) are exercised by tests/test_slime_real.py on the
vendored snapshots. Here slime's argument parser is a small argparse stand-in with slime's defaults for the
arguments configure() touches, and the rollout-side modules are stand-ins registered under slime's module
names (``slime.utils.misc.load_function``, ``slime.utils.http_utils.post``, ``slime.rollout.sglang_rollout``
with ``post`` imported by name and ``generate_and_rm``'s dispatch, ``slime.rollout.sample_hooks``), modeled
on THUDM/slime 624b824a, so the tagging rules can be checked request by request.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import functools
import importlib
import json
import sys
import types
from pathlib import Path

import pytest

import tic_trace.integrations.slime as ts
import tic_trace.integrations.slime.config as config
import tic_trace.integrations.slime.megatron_hooks as mh
import tic_trace.integrations.slime.rollout_hooks as rh
from tic_trace.testing import child
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


_PACKAGES = {"slime", "slime.utils", "slime.rollout"}


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
        _module("slime"), _module("slime.utils"), _module("slime.rollout"),
        _module("slime.utils.misc", load_function=functools.cache(_load_function.__wrapped__)),
        http, sample_hooks,
        # `from slime.utils.http_utils import post`: a name bound at import
        _module("slime.rollout.sglang_rollout", post=http.post, generate=_default_generate,
                generate_and_rm=_generate_and_rm),
    ]
    for m in mods:
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(mh, "_S", mh._State())
    monkeypatch.setattr(mh, "_PATCHED", set())
    monkeypatch.setattr(config, "_WARNED", set())
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
    # tic_trace_mode None: rows for --tic-trace-rollout-ids, subset for --tic-trace-every (configure resolves it)
    assert ours == {"tic_trace": False, "tic_trace_dir": None, "tic_trace_rollout_ids": "0",
                    "tic_trace_max_samples": 4, "tic_trace_mode": None, "tic_trace_filter": None,
                    "tic_trace_every": 0, "tic_trace_disk_budget": None}
    assert {k: v for k, v in vars(args).items() if not k.startswith("tic_trace")} == plain
    # the tracer's modes, and `subset` (rows mode with the identity row subset)
    assert ts.MODES == (*__import__("tic_trace.record.filters", fromlist=["MODES"]).MODES, "subset")
    # importing the flag module pulls in no framework adapter and no framework
    code = ("import sys; import tic_trace.integrations.slime; "
            "bad = [m for m in ('tic_trace.adapters.megatron', 'tic_trace.adapters.sglang', 'megatron', 'sglang', "
            "'tic_trace.view.align', 'tic_trace.compare.diverge') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = child.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
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
    assert rh._RID.get() is None


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
    from tic_trace.integrations.slime import train as slime_train
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


def test_fully_async_worker_requests_are_not_tagged(fake_slime, tmp_path):
    """slime's fully-async worker generates from its own thread across rollout boundaries: the module-global
    rollout id does not say which rollout a request is trained in, so such requests are never tagged."""
    import threading
    args = parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path), "--debug-train-only"])
    ts.configure(args)
    router = fake_slime.http_utils.ROUTER = RecordingRouter()
    out = {}
    t = threading.Thread(target=lambda: out.update(r=rollout(args, 0, [Sample(index=0, tokens=[1, 2])])),
                         name=rh.FULLY_ASYNC_THREAD)
    t.start()
    t.join()
    assert [p.get("rid") for _, p in router.requests] == [None]
    rollout(args, 0, [Sample(index=0, tokens=[1, 2])])              # the same request from the rollout call
    assert router.requests[-1][1]["rid"] == "0-0"


def test_fully_async_rollout_function_is_refused(tmp_path):
    args = parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path), "--rollout-function-path",
                              config.FULLY_ASYNC_ROLLOUT])
    with pytest.raises(ValueError, match="fully_async_rollout.*--debug-train-only"):
        ts.configure(args)
    args = parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path), "--debug-train-only",
                              "--rollout-function-path", config.FULLY_ASYNC_ROLLOUT])
    assert ts.configure(args).custom_megatron_init_path == ts.HOOK_PATHS["custom_megatron_init_path"]


def test_old_slime_is_refused(monkeypatch):
    """Before v0.3.0 DataIterator's micro_batch_indices could be None (nothing named, nothing traced) and
    before v0.2.0 there was no train_actor; before v0.3.1 no set_current_rollout_id."""
    from tic_trace.integrations.slime import version

    class OldDataIterator:
        def __init__(self, rollout_data, micro_batch_size=None, micro_batch_indices=None):
            pass

    class Actor:
        def train_actor(self, rollout_id, rollout_data):
            pass
    for name, mod in {"slime": _module("slime"), "slime.backends": _module("slime.backends"),
                      "slime.backends.megatron_utils": _module("slime.backends.megatron_utils"),
                      "slime.backends.megatron_utils.actor": _module("slime.backends.megatron_utils.actor",
                                                                     MegatronTrainRayActor=Actor),
                      "slime.backends.megatron_utils.data": _module("slime.backends.megatron_utils.data",
                                                                    DataIterator=OldDataIterator),
                      "slime.rollout": _module("slime.rollout"),
                      "slime.rollout.sample_hooks": _module("slime.rollout.sample_hooks")}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    with pytest.raises(version.UnsupportedSlime, match="v0.3.0"):
        version.check_megatron_side()
    with pytest.raises(version.UnsupportedSlime, match="v0.3.1.*set_current_rollout_id"):
        version.check_rollout_side()
    del Actor.train_actor
    with pytest.raises(version.UnsupportedSlime, match="train_actor"):
        version.check_megatron_side()


def test_async_training_is_warned_about(tmp_path, caplog):
    """train_async.py generates rollout N+1 with the weights from before training N: said at configure time."""
    args = parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path), "--debug-train-only"])
    args.tic_trace_entry = "train_async.py"          # what `python -m tic_trace.integrations.slime.train` records
    with caplog.at_level("WARNING", logger="tic_trace.slime"):
        ts.configure(args)
    assert "train_async.py" in caplog.text and "only rollout 0" in caplog.text


# ================================================================== periodic tracing and the disk budget

def test_every_n_selects_rollouts_and_their_mode():
    args = ts.configure(parse(BASE_ARGV + ["--tic-trace", "--tic-trace-rollout-ids", "3", "--tic-trace-every", "5",
                                           "--debug-train-only"]))
    from tic_trace.integrations.slime.config import mode_for, traced
    assert [r for r in range(16) if traced(args, r)] == [0, 3, 5, 10, 15]
    assert (mode_for(args, 3), mode_for(args, 5)) == ("rows", "subset")
    ts.configure(args)                                 # idempotent
    assert (mode_for(args, 3), mode_for(args, 5)) == ("rows", "subset")
    from tic_trace.integrations.slime.config import tracer_points_mode
    from tic_trace.graph.row_subset import RowSubset
    assert tracer_points_mode("subset") == ("rows", RowSubset()) and tracer_points_mode("rows") == ("rows", None)
    stats = ts.configure(parse(BASE_ARGV + ["--tic-trace", "--tic-trace-every", "2", "--tic-trace-mode", "stats",
                                            "--debug-train-only"]))
    assert (mode_for(stats, 0), mode_for(stats, 2)) == ("stats", "stats")
    full = ts.configure(parse(BASE_ARGV + ["--tic-trace", "--tic-trace-every", "2", "--tic-trace-mode", "full",
                                           "--debug-train-only"]))
    assert (mode_for(full, 0), mode_for(full, 2)) == ("full", "full")
    for bad in (["--tic-trace-every", "-1"], ["--tic-trace-disk-budget", "lots"], ["--tic-trace-disk-budget", "0"]):
        with pytest.raises(ValueError, match="tic_trace_every|tic_trace_disk_budget"):
            ts.configure(parse(BASE_ARGV + ["--tic-trace", "--debug-train-only", *bad]))
    from tic_trace.integrations.slime.config import parse_size
    assert (parse_size("500M"), parse_size("2GiB"), parse_size(1024)) == (500 << 20, 2 << 30, 1024)


def test_disk_budget_prunes_oldest_value_traces_and_keeps_statistics(tmp_path, caplog):
    from tic_trace.integrations.slime.budget import after_rollout_traced
    args = ts.configure(parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path), "--tic-trace-rollout-ids",
                                           "1,2,3", "--tic-trace-every", "4", "--tic-trace-disk-budget", "2500",
                                           "--debug-train-only"]))
    sizes = {0: 100, 1: 1000, 2: 1000, 3: 1000, 4: 100}       # 0 and 4 are periodic (subset)
    for rid, n in sizes.items():
        for side in ("megatron", "sglang"):
            d = tmp_path / f"rollout_{rid:05d}" / side
            d.mkdir(parents=True)
            (d / "pass00000.bin").write_bytes(b"x" * (n // 2))
    with caplog.at_level("WARNING", logger="tic_trace.slime"):
        after_rollout_traced(args, 4)
    assert (tmp_path / "rollout_00001" / "PRUNED").is_file() and not (tmp_path / "rollout_00001" / "megatron").exists()
    assert (tmp_path / "rollout_00002" / "megatron").is_dir() and (tmp_path / "rollout_00000" / "megatron").is_dir()
    assert "rollout 4 traced (subset): megatron " in caplog.text and "50 B" in caplog.text
    assert "removed the traces of rollouts 1" in caplog.text


def _fill(base, sizes: dict) -> None:
    for rid, n in sizes.items():
        for side in ("megatron", "sglang"):
            d = base / f"rollout_{rid:05d}" / side
            d.mkdir(parents=True)
            (d / "pass00000.bin").write_bytes(b"x" * (n // 2))


def test_disk_budget_removes_periodic_subset_traces_after_the_value_traces(tmp_path):
    """The periodic default (`subset`) holds values too: when removing every `rows` rollout is not enough, the
    oldest subset rollouts go next (never the one just traced); `stats` periodic rollouts are never removed."""
    from tic_trace.integrations.slime.budget import PRUNED_MARK, prune
    sub = ts.configure(parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path / "sub"),
                                          "--tic-trace-rollout-ids", "1", "--tic-trace-every", "2",
                                          "--tic-trace-disk-budget", "300", "--debug-train-only"]))
    _fill(tmp_path / "sub", {0: 200, 1: 1000, 2: 200, 4: 200, 6: 200})   # 1 listed (rows); 0, 2, 4, 6 subset
    assert prune(sub, 6) == [1, 0, 2, 4]            # rows first (1), then subset oldest first (0, 2, 4); 6 kept
    assert (tmp_path / "sub" / "rollout_00006" / "megatron").is_dir()
    assert all((tmp_path / "sub" / f"rollout_{r:05d}" / PRUNED_MARK).is_file() for r in (0, 1, 2, 4))
    stats = ts.configure(parse(BASE_ARGV + ["--tic-trace", "--tic-trace-dir", str(tmp_path / "st"),
                                            "--tic-trace-rollout-ids", "1", "--tic-trace-every", "2",
                                            "--tic-trace-mode", "stats", "--tic-trace-disk-budget", "100",
                                            "--debug-train-only"]))
    _fill(tmp_path / "st", {2: 200, 4: 200})
    assert prune(stats, 4) == []                    # statistics-only rollouts are kept, whatever the budget
