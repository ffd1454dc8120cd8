"""The clean-implementation noise of a model's log-probs (tic_trace/replay/clean_noise.py), measured with the
attribution when a reference is given, and said beside its answer (issue 34 item 5: "L2.attn_norm explains
65%" on a bf16 pair whose gap was smaller than the same model's clean eager <-> SDPA gap).

Real transformers Qwen3-MoE models in bf16, faults planted in side B's computation. The margins are the
measured ratios (1.8x below, 2.7x above the noise on this model and these tokens), not bitwise values: any
CPU's kernels keep them.
"""
from __future__ import annotations

import html
import json

import pytest
import torch

from tic_trace import find_divergence
from tic_trace.compare.diverge import rejudge
from tic_trace.report.attribution_lines import attribution_lines
from tic_trace.report.html import render_html
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config
from tic_trace.testing.precision_faults import PRECISION_FAULTS

from conftest import trace_hf

IDS = sample_tokens(2, 16)


def _model():
    return build_hf_model_stable(tiny_qwen3_config(moe=True), seed=0, dtype=torch.bfloat16)


def _report(tmp, fault: str, layer: int) -> dict:
    """The attributed report of a bf16 pair: A the model as saved, B with `fault` planted at `layer`."""
    a = _model()
    a.save_pretrained(tmp / "ck")
    trace_hf(a, tmp / "a", IDS)
    b = _model()
    PRECISION_FAULTS[fault].plant(b, layer)
    trace_hf(b, tmp / "b", IDS)
    doc = json.loads(json.dumps(find_divergence(str(tmp / "a"), str(tmp / "b"), reference=str(tmp / "ck"),
                                                attribution=True).to_json()))
    assert "unavailable" not in doc["attribution"] and not doc["attribution"]["withheld"], doc["attribution"]
    assert rejudge(doc) == doc          # the measured noise survives a saved report read back
    return doc


@pytest.mark.parametrize("fault,layer,within", [("rmsnorm_no_upcast", 1, True), ("kv_fp8", 0, False)])
def test_the_answer_says_whether_the_gap_is_within_clean_noise(tmp_path, fault, layer, within):
    """A small early precision fault (RMSNorm without its upcast: the issue's case) has a gap within the
    model's clean noise, and the answer says so while still naming the finding; a large one (an fp8 KV
    cache) is above it."""
    doc = _report(tmp_path, fault, layer)
    att = doc["attribution"]
    cn = att["clean_noise"]
    assert cn["measured"] is True and cn["gap"] > 0 and "clean forwards" in cn["how"], cn
    assert cn["within"] is within
    assert (att["gap"] < 0.8 * cn["gap"]) if within else (att["gap"] > 1.5 * cn["gap"]), (att["gap"], cn)
    word = "within" if within else "above"
    lines = attribution_lines(doc)
    assert f"{word} this model's clean-implementation noise ({cn['gap']:.3g})" in lines[0], lines[0]
    assert att["first"] and f"{att['first']} explains" in lines[0]
    noise_line = next(ln for ln in lines if ln.startswith("  clean-implementation noise of this model:"))
    assert f"is {word} it" in noise_line and "not measured" not in noise_line
    assert html.escape(f"{word} this model's clean-implementation noise ({cn['gap']:.3g})") in render_html(doc)


def test_clean_forwards_that_fail_leave_the_attribution_and_say_not_measured(tmp_path, monkeypatch):
    """The clean-noise estimate never breaks the attribution it stands beside: where its forwards fail, the
    answer is made and the noise is said to be not measured, with why."""
    import tic_trace.replay.clean_noise as cn_mod

    def broken(*_a, **_k):
        raise TypeError("planted: an op the clean forwards cannot run")
    monkeypatch.setattr(cn_mod, "run_exact", broken)
    doc = _report(tmp_path, "rmsnorm_no_upcast", 1)
    att = doc["attribution"]
    assert att["first"] == "L1.attn_norm"
    assert att["clean_noise"]["measured"] is False and "TypeError" in att["clean_noise"]["why"]
    lines = attribution_lines(doc)
    assert "clean-implementation noise (" not in lines[0]
    assert any(ln.startswith("  clean-implementation noise of this model: not measured: the clean forwards failed")
               for ln in lines)
