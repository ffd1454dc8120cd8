import os
import tempfile

# torch.compile's on-disk cache (slime compiles its PPO loss with inductor) does not key its compiled CPU
# kernels by the ATen code path: a kernel built under ATEN_CPU_CAPABILITY=avx2 and loaded by a later AVX-512 run
# corrupted the heap ("free(): invalid next size", torch 2.14.1, in slime's compute_policy_loss). One cache per
# code path, set before anything imports torch; subprocesses inherit it.
_CODE_PATH = "-".join(os.environ.get(k, "native").lower() for k in
                      ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"tic-trace-inductor-{_CODE_PATH}"))

import pytest  # noqa: E402
import torch  # noqa: E402

# Single-threaded intra-op by default (2 cores are shared by multi-process tests); tests that vary threads do so
# explicitly. TIC_TRACE_TEST_THREADS=2 runs the suite on another reduction split: every assertion must hold there
# too (docs/testing.md).
torch.set_num_threads(int(os.environ.get("TIC_TRACE_TEST_THREADS", "1")))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def in_ci() -> bool:
    """CI runs with every vendored source present: there a missing source is a failure, never a skip."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_report_header(config):
    from tic_trace.testing import slime_vendor
    paths = ", ".join(f"{k}={os.environ[k]}" for k in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA") if k in os.environ)
    return [f"cpu kernels: ATen {torch.backends.cpu.get_cpu_capability()}{', ' + paths if paths else ''}; "
            f"{torch.get_num_threads()} intra-op thread(s)",
            f"vendored sources (slime tests): {slime_vendor.describe()}"]


# scripts/test.sh names a file here: the test running now is written to it, so that a process that ends
# pytest from inside a test (Ray's driver exits with 1 when its GCS dies; a native crash) is named in CI's
# output instead of leaving a line of dots that stops.
_RUNNING_FILE = os.environ.get("TIC_TRACE_TEST_RUNNING_FILE")


def pytest_runtest_logstart(nodeid, location):
    if _RUNNING_FILE:
        with open(_RUNNING_FILE, "w") as f:
            f.write(nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _RUNNING_FILE and os.path.exists(_RUNNING_FILE):
        os.remove(_RUNNING_FILE)


def require_vendored_sources() -> None:
    """Skip (outside CI) or fail (with CI=true) a test that runs slime's own code when its sources are absent."""
    from tic_trace.testing import slime_vendor
    reason = slime_vendor.missing_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def hf_moe_config():
    from tic_trace.testing.hf_models import tiny_qwen3_config
    return tiny_qwen3_config(moe=True)


@pytest.fixture(scope="session")
def hf_dense_config():
    from tic_trace.testing.hf_models import tiny_qwen3_config
    return tiny_qwen3_config(moe=False)


def trace_hf(model, out_dir, ids, **kw):
    """Trace one HF forward with canonical points in full; returns (logits, tracer)."""
    import tic_trace
    kw.setdefault("points_mode", "full")
    with tic_trace.trace(model, out_dir, adapter="hf", **kw) as t, torch.no_grad():
        logits = model(ids).logits
    assert t.failed is None, t.failed
    return logits, t


@pytest.fixture(scope="module")
def megatron_rank():
    """One megatron rank (world size 1) in this process for the module."""
    from tic_trace.testing import megatron_cpu as mc
    with mc.single_rank():
        yield


def checkpointed_sides(tmp_path_factory, build, ids, **trace_kw):
    """get(name, dtype) -> (checkpoint dir, HF trace dir, HF state dict) of `build(name, dtype)`, saved and
    traced once per (name, dtype) for the module that holds it."""
    cache: dict = {}

    def get(name: str, dtype: torch.dtype):
        if (name, dtype) not in cache:
            d = tmp_path_factory.mktemp(f"{name}_{str(dtype).removeprefix('torch.')}")
            hf = build(name, dtype)
            hf.save_pretrained(d / "ck")
            trace_hf(hf, d / "hf", ids, **trace_kw)
            cache[name, dtype] = (d / "ck", d / "hf", hf.state_dict())
        return cache[name, dtype]
    return get


def assert_every_point_is_its_exact_op(view, checkpoint) -> list:
    """The float64 replay of every point of `view` on its own inputs, from `checkpoint`, agrees to fp32 accuracy
    (ids exactly) and leaves no point unreplayed but logprobs: each canonical point is the op its name says.
    Returns the replay's results."""
    from tic_trace.replay.intrinsic import IntrinsicError, replay_side
    from tic_trace.replay.reference import ExactReference
    results = replay_side(view, ExactReference(str(checkpoint)))
    skipped = [(r.key, r.reason) for r in results if not isinstance(r, IntrinsicError) and r.point != "logprobs"]
    assert skipped == [], skipped
    off = [(r.key, r.rel_l2) for r in results
           if isinstance(r, IntrinsicError) and r.rel_l2 > (0 if r.kind == "ids" else 1e-5)]
    assert not off, off
    return results


def assert_replayed_within_envelopes(rep) -> None:
    """A pair replayed against its checkpoint: no model-config contract difference, every point replayed, and
    no side over its clean envelope at any point."""
    assert [d for d in rep.contract if d["section"] == "config"] == []
    assert not [n for n in rep.notes if n.kind == "not_replayed"]
    far = [(p.key, s, e["excess"], e["limit"]) for p in rep.points for s, e in (p.intrinsic or {}).items()
           if isinstance(e, dict) and isinstance(e.get("limit"), float) and e["excess"] > e["limit"]]
    assert not far, far


def trace_megatron(model, out, vocab_size: int, ids=None, *, sequences: dict | None = None) -> str:
    """Trace a megatron GPTModel into `out` (canonical points in full): one forward over `ids` [b, s], or one per
    entry of `sequences` ({sample key: token ids}), each its own sample (as HF's and Megatron's side of an SGLang
    pair). Returns the trace directory."""
    import tic_trace
    from tic_trace.adapters.megatron import MegatronAdapter

    def run(tokens):
        model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens), attention_mask=None)
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=vocab_size), points_mode="full") as t, \
            torch.no_grad():
        if sequences is None:
            run(ids)
        for key, seq in (sequences or {}).items():
            t.sample_keys = [key]
            run(torch.tensor([seq]))
            t.step()
    assert t.failed is None, t.failed
    return str(out)


def first_divergence_of_plant(model, plant, tmp_path, ids):
    """(point, layer) of the first divergence between `model` traced clean (A) and after `plant(model)` (B)."""
    from tic_trace import find_divergence
    from tic_trace.graph.canonical import parse_key
    trace_hf(model, tmp_path / "a", ids)
    plant(model)
    trace_hf(model, tmp_path / "b", ids)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "divergent", (rep.verdict, [(f.key, f.cause) for f in rep.findings])
    return parse_key(rep.first["key"])


def assert_planted_fault_found(rep, point: str, layer: int | None) -> None:
    """The report's first divergence is exactly the planted fault's point and layer; a routing change is a
    routing finding, not an MLP operator's."""
    assert rep.verdict == "divergent"
    assert (rep.first.point, rep.first.layer) == (point, layer), (rep.first.key, rep.first.summary)
    if point == "moe.topk_ids":
        assert rep.findings[0].cause == "routing", rep.findings[0]


def bf16_model(moe=True, seed=0, **cfg):
    """The tiny Qwen3 in bf16, its weights a function of (config, seed) only: the contract and replay suites'
    model, the same whether built directly or loaded back from its checkpoint."""
    from tic_trace.testing.hf_models import build_hf_model_stable, tiny_qwen3_config
    return build_hf_model_stable(tiny_qwen3_config(moe=moe, **cfg), seed=seed, dtype=torch.bfloat16)


# What Ray prints when its own processes or its C++ core (not a task) ended the driver: without its GCS Ray
# exits the driver with 1 after 60 s; a failed internal CHECK aborts it. Neither is tic-trace's code, which is
# why the Ray tests run Ray in a child and retry it.
RAY_ENDED_IT = ("Failed to connect to GCS", "GCS may have been killed", "LocalRayletDiedError",
                "Raylet is terminated", "raylet died", "You have likely discovered a bug in Ray")


def ray_said_it_ended(r) -> bool:
    """A child that failed with one of Ray's own messages about its processes or its core (RAY_ENDED_IT)."""
    return r.returncode != 0 and any(m in r.stdout + r.stderr for m in RAY_ENDED_IT)


def ray_ended_the_driver(r) -> bool:
    """The child ended by Ray's own processes, not by tic-trace: Ray said so, or the child exited 1 with no
    Python traceback (a failure of the code under test raises in Python and prints one; a crash ends it by a
    signal; Ray's C++ core exits its driver with 1 and no traceback). Only for a child that should exit 0."""
    return ray_said_it_ended(r) or (r.returncode == 1 and "Traceback" not in r.stderr)


def changed_pair(d, dtype, moe, change, ids):
    """(A trace, B trace, checkpoint) as paths in `d`: A the tiny Qwen3 (seed 0) saved and traced, B the same
    weights with `change(model)` applied to its computation."""
    from tic_trace.testing.hf_models import build_hf_model_stable, tiny_qwen3_config
    a = build_hf_model_stable(tiny_qwen3_config(moe=moe), seed=0, dtype=dtype)
    ck, ta = checkpointed_trace(d, a, ids)
    b = build_hf_model_stable(tiny_qwen3_config(moe=moe), seed=0, dtype=dtype)
    change(b)
    trace_hf(b, d / "b", ids)
    return str(ta), str(d / "b"), str(ck)


def checkpointed_trace(d, model, ids):
    """`model` saved as an HF checkpoint in `d/ck` and traced into `d/a`: (checkpoint dir, trace dir)."""
    model.save_pretrained(d / "ck")
    trace_hf(model, d / "a", ids)
    return d / "ck", d / "a"
