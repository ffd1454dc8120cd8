"""Each point judged in its own units, and a norm's inherited error measured through its gain (issue 33 items 1, 2;
docs/report.md, "Units" and "Where the op acts").

A confident trained-like bf16 Llama: peaked next-token distributions (its own greedy tokens have log-probs near 0),
a massive residual channel of the first token (3000x the median) muted by a 4e-4 post-attention norm gain, norm
gains spread log-normally. Log-probs judged relatively (|Δ| / |logprob|) called every clean pair of it divergent at
`logprobs`, and the first token's rows made 40-50x "jumps" at every muted `mlp_norm`. Here clean pairs are
consistent with and without the reference, faults are found at their layer and never at `logprobs`, and a
log-softmax whose sum of exponentials is rounded to bf16 is found at `logprobs` from the recorded log-probs.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers as T

import tic_trace
from tic_trace import find_divergence
from tic_trace.compare.diverge import rejudge
from tic_trace.adapters.hf import HFAdapter
from tic_trace.compare.inherited import logsoftmax_rounding
from tic_trace.compare.judge import DIVERGENT, OVER, judge
from tic_trace.graph.adapter import PointMap, register_adapter
from tic_trace.testing import clean_variants as cv
from tic_trace.testing import trained_like as tl
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens
from tic_trace.testing.precision_faults import PRECISION_FAULTS

from conftest import trace_hf

CFG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
           tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAULT_LAYER = 2


def _model():
    cfg = T.LlamaConfig(**CFG)
    cfg._attn_implementation = "eager"
    model = build_hf_model_stable(cfg, seed=1, dtype=torch.bfloat16)
    with torch.no_grad():
        massive = tl.massive_activations(model, seed=1, channels=1, scale=3000.0)
        tl.lognormal_norm_gains(model, low=0.05, high=8.0)
    tl.mute_channels(model, massive)         # every layer but the first
    tl.confident_head(model, 8.0)
    return model


@pytest.fixture(scope="module")
def side_a(tmp_path_factory):
    """(directory with the checkpoint `ck` and side A's eager trace `a`, the token ids): prompts of 5 tokens
    followed by the model's own greedy answer, 20 positions."""
    d = tmp_path_factory.mktemp("confident")
    model = _model()
    ids = tl.greedy_continuation(model, tl.bos_first(sample_tokens(3, 5)), 20)
    model.save_pretrained(d / "ck")
    trace_hf(model, d / "a", ids)
    return d, ids


def _reports(side_a, tmp_path, plant=None, context=None):
    """{reference used: report} of side A against a side B built from the same weights with `plant(model)`
    applied (or traced inside `context(model)`)."""
    d, ids = side_a
    model = _model()
    if plant is not None:
        plant(model)
    if context is not None:
        with context(model):
            trace_hf(model, tmp_path / "b", ids)
    else:
        trace_hf(model, tmp_path / "b", ids)
    return {ref: find_divergence(str(d / "a"), str(tmp_path / "b"), reference=str(d / "ck") if ref else None)
            for ref in (False, True)}


def _answer_logprobs(side_a) -> torch.Tensor:
    """The model's log-probs of its own answer tokens."""
    _, ids = side_a
    with torch.no_grad():
        return torch.log_softmax(_model()(ids).logits.float(), -1)[:, 4:-1].gather(-1, ids[:, 5:, None]).flatten()


CLEAN = {
    "eager_vs_sdpa": dict(plant=lambda m: m.set_attn_implementation("sdpa")),
    "rope_fp32_tables": dict(context=cv.rope_fp32_tables),
    "fused_add_norm_fp32": dict(plant=cv.fused_norm),
    "tp2_row_parallel": dict(plant=cv.tp_row_parallel(2)),
}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_pairs_of_a_confident_model_are_consistent(side_a, tmp_path, name):
    lp = _answer_logprobs(side_a)             # the premise: a confident model, its answer's log-probs near 0
    assert float(lp.median()) > -0.25 and float((lp > -0.05).float().mean()) > 0.25
    for ref, rep in _reports(side_a, tmp_path, **CLEAN[name]).items():
        lp = next(p for p in rep.points if p.key == "logprobs")
        assert lp.status != DIVERGENT, (ref, lp.error, lp.input_error, lp.worst_rows)
        assert rep.verdict == "consistent", (ref, [(f.key, f.cause, f.summary) for f in rep.findings if f.divergent])


def test_a_massive_channel_muted_by_its_gain_makes_no_jump(side_a, tmp_path):
    """The first token's row is its massive channel at the norm's input and the other channels at its output;
    through the fitted gain, no row of a muted mlp_norm grows (relatively: 40-50x for the first tokens)."""
    rep = _reports(side_a, tmp_path, plant=cv.tp_row_parallel(2))[False]
    muted = [p for p in rep.points if p.point == "mlp_norm" and p.layer >= 1]
    assert len(muted) == CFG["num_hidden_layers"] - 1
    for p in muted:
        grown = [(r["row"], r["growth"]) for r in p.worst_rows or [] if r["growth"] > 3.0]
        assert not grown, (p.key, grown)


def _silu_bf16_mlp(model, layer: int) -> None:
    """One dense MLP's SiLU as gate * sigmoid(gate) in bf16: one more rounding than torch's silu."""
    mlp = model.model.layers[layer].mlp

    def forward(x):
        g = mlp.gate_proj(x)
        return mlp.down_proj((g * torch.sigmoid(g)) * mlp.up_proj(x))
    mlp.forward = forward


FAULTS = {
    "softmax_bf16": ("attn.core", lambda m: PRECISION_FAULTS["softmax_bf16"].plant(m, FAULT_LAYER)),
    "silu_bf16_mlp": ("mlp.out", lambda m: _silu_bf16_mlp(m, FAULT_LAYER)),
    "mlp_norm_no_upcast": ("mlp_norm", lambda m: PRECISION_FAULTS["mlp_norm_no_upcast"].plant(m, FAULT_LAYER)),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_faults_are_found_at_their_layer_not_at_the_logprobs(side_a, tmp_path, name):
    point, plant = FAULTS[name]
    want = f"L{FAULT_LAYER}.{point}"
    reps = _reports(side_a, tmp_path, plant=plant)
    for ref, rep in reps.items():
        lp = next(p for p in rep.points if p.key == "logprobs")
        assert lp.status != DIVERGENT, (ref, lp.error, lp.input_error)
        assert not [f for f in rep.findings if f.divergent and f.key == "logprobs"]
        if rep.first is not None:                 # without the reference the A-B rule may see nothing
            assert rep.first.key == want, (ref, rep.first.summary)
    first = reps[True].to_json()["first_divergence"]
    assert (first["key"], first["replay"]["side"]) == (want, "B"), first["summary"]


# ------------------------------------------------------------------------------------------------ recorded log-probs

class LogprobHead(torch.nn.Module):
    """log p(next token) at every position from the logits, as an engine returning log-probs computes it:
    "fp32" torch's log_softmax in fp32, "fp32_lse" z - logsumexp(z) in fp32 (another clean order), "bf16_sum" the
    sum of exponentials rounded to bf16 (a kernel accumulating the softmax denominator in bf16)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.next_ids = how, None

    def forward(self, logits):
        z = logits.float()
        if self.how == "fp32":
            lp = torch.log_softmax(z, dim=-1)
        elif self.how == "fp32_lse":
            lp = z - torch.logsumexp(z, dim=-1, keepdim=True)
        else:
            zs = z - z.amax(-1, keepdim=True)
            lp = zs - torch.log(torch.exp(zs).sum(-1, keepdim=True).to(torch.bfloat16).float())
        return lp.gather(-1, self.next_ids[..., None])


@register_adapter
class HFWithLogprobs(HFAdapter):
    """HF's table plus the log-probs a `logprob_head` module records (an HF model has none of its own)."""
    name = "hf_with_logprobs_test"
    points = HFAdapter.points + (PointMap("logprobs", r"logprob_head:out"),)


def _trace_with_logprobs(model, out, ids, how: str) -> None:
    model.logprob_head = LogprobHead(how)
    model.logprob_head.next_ids = torch.roll(ids, -1, dims=1)    # the last position's is no token: not judged

    def hook(module, args, logits):          # called inside the traced forward: its output is recorded
        model.logprob_head(logits)
    model.lm_head.register_forward_hook(hook)
    with tic_trace.trace(model, out, adapter=HFWithLogprobs.name, points_mode="full") as t, torch.no_grad():
        model(ids)
    assert t.failed is None, t.failed


@pytest.mark.parametrize("how_b, divergent", [("fp32_lse", False), ("bf16_sum", True)])
def test_recorded_logprobs_are_judged_in_nats(side_a, tmp_path, how_b, divergent):
    """Both sides record their log-probs in fp32; B also runs SDPA attention (its logits differ by a clean
    pair's amount). A clean log-softmax in another order is consistent; one whose denominator is rounded to
    bf16 adds up to ~0.004 nats where |logprob| is near 0, past what B's logits imply: found at `logprobs`."""
    _, ids = side_a
    a, b = _model(), _model()
    b.set_attn_implementation("sdpa")
    _trace_with_logprobs(a, tmp_path / "a", ids, "fp32")
    _trace_with_logprobs(b, tmp_path / "b", ids, how_b)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    lp = next(p for p in rep.points if p.key == "logprobs")
    assert "logprob_head" in lp.sources["a"][0] and lp.dtype == "float32"
    if divergent:
        assert (rep.first.key, rep.first.cause) == ("logprobs", "operator"), rep.first.summary
        assert "nats" in rep.first.summary
    else:
        assert rep.verdict == "consistent", [(f.key, f.cause, f.summary) for f in rep.findings if f.divergent]
    doc = json.loads(json.dumps(rep.to_json()))      # re-judged from the saved numbers: the same report
    assert rejudge(doc) == doc


def test_logsoftmax_rounding_bounds_clean_kernels_and_not_a_bf16_sum():
    """The clean log-softmax bound (compare/inherited.py) against torch's own kernels on bf16 logits of a
    confident head: fp32 inside and out, and fp32 inside with a bf16 output, are within it at every row; the
    sum of exponentials rounded to bf16 is not, where the log-prob is near 0."""
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(256, 128, generator=g) * 6.0).to(torch.bfloat16)
    tok = z.float().argmax(-1)                      # the model's own token: log-probs near 0
    tok[::2] = torch.randint(0, 128, (128,), generator=g)
    exact = torch.log_softmax(z.double(), -1).gather(-1, tok[:, None])[:, 0].numpy()

    def err(lp: torch.Tensor) -> np.ndarray:
        return np.abs(lp.gather(-1, tok[:, None])[:, 0].double().numpy() - exact)
    fp32 = torch.log_softmax(z.float(), -1)
    assert (err(fp32) <= logsoftmax_rounding(exact, "float32", 128)).all()
    bf16 = torch.log_softmax(z, -1)
    assert bf16.dtype == torch.bfloat16
    assert (err(bf16) <= logsoftmax_rounding(exact, "bfloat16", 128)).all()
    zs = z.float() - z.float().amax(-1, keepdim=True)
    summed = zs - torch.log(torch.exp(zs).sum(-1, keepdim=True).to(torch.bfloat16).float())
    over = err(summed) > logsoftmax_rounding(exact, "float32", 128)
    assert over[exact > -0.5].mean() > 0.5


def test_judge_reads_each_unit():
    """In nats the inherited error bounds what a clean op adds (no growth factor); relatively it needs growth."""
    assert judge(0.02, 0.01, 1e-5, 10.0, unit="nats").status == DIVERGENT
    assert judge(0.02, 0.01, 1e-5, 10.0).status == OVER
    assert judge(0.009, 0.01, 1e-5, 10.0, unit="nats").status == OVER
    assert judge(0.02, math.inf, 1e-5, 10.0, unit="nats").status == OVER
