import os

import pytest
import torch

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


def bf16_model(moe=True, seed=0, **cfg):
    """The tiny Qwen3 in bf16, its weights a function of (config, seed) only: the contract and replay suites'
    model, the same whether built directly or loaded back from its checkpoint."""
    from tic_trace.testing.hf_models import build_hf_model_stable, tiny_qwen3_config
    return build_hf_model_stable(tiny_qwen3_config(moe=moe, **cfg), seed=seed, dtype=torch.bfloat16)


def checkpointed_trace(d, model, ids):
    """`model` saved as an HF checkpoint in `d/ck` and traced into `d/a`: (checkpoint dir, trace dir)."""
    model.save_pretrained(d / "ck")
    trace_hf(model, d / "a", ids)
    return d / "ck", d / "a"
