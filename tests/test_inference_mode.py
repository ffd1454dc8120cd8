"""Tracing under `torch.inference_mode()` (how inference engines run their forwards)."""
from __future__ import annotations

import torch

import tic_trace
from tic_trace import open_trace
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config

from conftest import trace_hf


def _records(d):
    return {r.name: r for r in next(open_trace(d).passes()).records}


def test_a_forward_in_inference_mode_is_traced_like_one_in_no_grad(tmp_path):
    """Inference tensors have no version counter: the tracer must not fail on them (alias reuse is off for
    them: nothing could prove their bits unchanged), and every module output and input record equals the
    no_grad trace's (op records may differ: inference mode dispatches some ops differently)."""
    model = build_hf_model(tiny_qwen3_config(moe=True))
    ids = sample_tokens(2, 10)
    ref, _ = trace_hf(model, tmp_path / "no_grad", ids)
    with tic_trace.trace(model, tmp_path / "inference", adapter="hf", points_mode="full") as t, \
            torch.inference_mode():
        out = model(ids).logits
    assert t.failed is None, t.failed
    assert torch.equal(out, ref)
    a, b = ({n: r for n, r in _records(d).items() if r.kind != "op"} for d in (tmp_path / "no_grad",
                                                                               tmp_path / "inference"))
    assert a.keys() == b.keys() and len(a) > 30
    for name in a:
        assert (a[name].hash, a[name].stats) == (b[name].hash, b[name].stats), name
