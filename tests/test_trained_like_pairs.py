"""Clean HF pairs on trained-like weights (massive BOS channels ~3000x the rest, norm gains log-normal over
0.002-40): one side runs HF's eager attention, the other torch's SDPA, and the pair is replayed against the
checkpoint. Attention over such scores turns the two clean kernels' roundings into an A-B difference far past the
fixed tolerance on identical inputs; the replay finds each side as exact as clean implementations, so no point
is a divergence and no side is blamed (verdict._carried). Faults planted on the same weights are still found,
at their point, their side blamed.
"""
from __future__ import annotations

import pytest
import torch

from tic_trace import find_divergence
from tic_trace.testing import trained_like as tl
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens
from tic_trace.testing.precision_faults import PRECISION_FAULTS

from conftest import trace_hf
from test_supported_archs import VERIFIED

# every HF table class whose attention has an SDPA path in transformers 5.24 (Gemma2's soft-cap and GPT-OSS's sinks
# have none)
SDPA = sorted(n for n in VERIFIED if n not in ("Gemma2ForCausalLM", "GptOssForCausalLM"))


def _model(name: str):
    cfg = VERIFIED[name]()
    cfg._attn_implementation = "eager"
    model = build_hf_model_stable(cfg, seed=1, dtype=torch.bfloat16)
    with torch.no_grad():
        tl.massive_activations(model, seed=1)
        tl.lognormal_norm_gains(model)
    return model, tl.bos_first(sample_tokens(2, 12))


def _pair(tmp_path, name: str, plant=None, sdpa: bool = True):
    """(report) A: eager; B: SDPA (or eager) with `plant(model)` applied; replayed against the checkpoint."""
    model, ids = _model(name)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", ids)
    if sdpa:
        model.set_attn_implementation("sdpa")
    if plant is not None:
        plant(model)
    trace_hf(model, tmp_path / "b", ids)
    return find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))


@pytest.mark.parametrize("name", SDPA)
def test_eager_vs_sdpa_on_trained_like_weights_is_no_divergence(tmp_path, name):
    rep = _pair(tmp_path, name)
    assert {f.cause for f in rep.findings if f.divergent} <= {"routing"}, [(f.key, f.cause) for f in rep.findings]
    assert not [p.key for p in rep.points if (p.replay or {}).get("side")]
    assert all(f.detail["unexplained"] == 0 for f in rep.findings if f.cause == "routing")
    by_key = {p.key: p for p in rep.points}
    for n in rep.notes:
        if n.kind == "carried":         # each such point is shown over tolerance, not hidden
            assert all(by_key[k].status == "over" and by_key[k].replay["carried"] for k in n.detail["points"])


@pytest.mark.parametrize("fault, layer", [("softmax_bf16", 0), ("rmsnorm_no_upcast", 1)])
def test_precision_fault_on_trained_like_weights_is_found_and_blamed(tmp_path, fault, layer):
    """On the same weights: a bf16 softmax where the attention amplifies everything, and a norm without upcast
    downstream of an attention whose eager/SDPA difference is carried: found at their point, B blamed."""
    f = PRECISION_FAULTS[fault]
    rep = _pair(tmp_path, "LlamaForCausalLM", lambda m: f.plant(m, layer), sdpa=fault != "softmax_bf16")
    first = rep.to_json()["first_divergence"]
    assert (first["key"], first["replay"]["side"]) == (f"L{layer}.{f.point}", "B"), first["summary"]
