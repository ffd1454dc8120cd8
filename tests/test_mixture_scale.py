"""Attention's output judged against the rows it mixes (issue 33 item 1; docs/report.md, "Units", the "mixture"
unit; compare/mixture.py).

A tiny bf16 Llama whose value rows cancel: one embedding channel is +-20x the median by token parity, the value
projection reads it almost alone, and the ids alternate even and odd tokens, so each attention output is a
near-cancelling sum of +v and -v rows and its norm is a few percent of theirs. Eager attention rounds its
probabilities to bf16 before P·V, SDPA keeps them in fp32: on identical inputs their outputs differ by 1e-2 to
3e-2 of the output's own norm (judged relatively: DIVERGENT at L0.attn.core, as on Gemma-3-270M), and by
~2e-3 of the norm the mixed rows bound it to. Faults in the attention are still found without the reference.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers as T

from tic_trace import find_divergence
from tic_trace.compare.judge import DEFAULT_TOL
from tic_trace.compare.measure import measure_point
from tic_trace.compare.mixture import mixture_scale
from tic_trace.testing import clean_variants as cv
from tic_trace.testing.hf_models import build_hf_model_stable
from tic_trace.testing.precision_faults import PRECISION_FAULTS
from tic_trace.view.align import CanonicalView

from conftest import trace_hf

CFG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
           head_dim=32, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
           tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SIGN_CHANNEL = 5
BF16_TOL = DEFAULT_TOL["bfloat16"]


def _model():
    cfg = T.LlamaConfig(**CFG)
    cfg._attn_implementation = "eager"
    m = build_hf_model_stable(cfg, seed=1, dtype=torch.bfloat16)
    with torch.no_grad():
        e = m.model.embed_tokens.weight
        sign = torch.tensor([1.0 if t % 2 == 0 else -1.0 for t in range(e.shape[0])])
        e[:, SIGN_CHANNEL] = (sign * 20 * float(e.float().abs().median())).to(e.dtype)
        for lay in m.model.layers:
            v = lay.self_attn.v_proj.weight
            big = float(v.float().abs().mean()) * 10
            v.mul_(0.05)
            v[:, SIGN_CHANNEL] = big
    return m


def _ids() -> torch.Tensor:
    ids = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(3))
    ids[:, 0::2] = (ids[:, 0::2] // 2) * 2          # even tokens at even positions, odd at odd: v alternates sign
    ids[:, 1::2] = (ids[:, 1::2] // 2) * 2 + 1
    return ids


@pytest.fixture(scope="module")
def side_a(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixture")
    trace_hf(_model(), d / "a", _ids())
    return d


def _side_b(tmp_path, plant):
    model = _model()
    plant(model)
    trace_hf(model, tmp_path / "b", _ids())
    return tmp_path / "b"


CLEAN = {"eager_vs_sdpa": lambda m: m.set_attn_implementation("sdpa"),
         "eager_vs_flash": cv.attention("flash")}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_attention_kernels_are_consistent_against_the_rows_they_mix(side_a, tmp_path, name):
    b = _side_b(tmp_path, CLEAN[name])
    m = measure_point(CanonicalView(str(side_a / "a")), CanonicalView(str(b)), "attn.core", 0)
    own, judged = m.carried_row_errors, m.row_errors
    # the premise: on identical inputs, against its own norm some row is far over bf16's tolerance (what the
    # relative unit judged DIVERGENT); against the mixed rows' bound every row is well within it
    assert float(own.max()) > 2 * BF16_TOL, float(own.max())
    assert float(judged.max()) < BF16_TOL / 2, float(judged.max())
    assert np.all(judged <= own + 1e-12)
    rep = find_divergence(str(side_a / "a"), str(b))
    core = next(p for p in rep.points if p.key == "L0.attn.core")
    assert core.input_error == 0.0 and core.carried_error > core.error
    assert rep.verdict == "consistent", [(f.key, f.summary) for f in rep.findings if f.divergent]


def _wrong_scale(model):
    """Layer 1's softmax scale doubled (a wrong 1/sqrt(d)): every later position's weights change."""
    model.model.layers[1].self_attn.scaling *= 2.0


FAULTS = {"wrong_scale": _wrong_scale,
          "kv_fp8": lambda m: PRECISION_FAULTS["kv_fp8"].plant(m, 1)}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_attention_faults_are_still_found_without_the_reference(side_a, tmp_path, name):
    rep = find_divergence(str(side_a / "a"), str(_side_b(tmp_path, FAULTS[name])))
    assert rep.verdict == "divergent" and rep.first.key == "L1.attn.core", \
        (rep.verdict, rep.first.summary if rep.first else None)


class _View:
    """The little of a CanonicalView that mixture_scale reads."""

    def __init__(self, feed: str, values: np.ndarray, rows: list, config: dict):
        self.entries = {(feed, 0): [object()]}
        self.config = config
        self._t = type("T", (), {"values": values, "rows": rows})()

    def load(self, point, layer):
        return self._t


def test_mixture_scale_is_the_bound_of_each_head_over_its_sample_prefix():
    # 2 KV heads of width 2, 4 query heads (2 per KV head); sample s0 at positions 0..2, s1 at 1 only (no 0)
    v = np.array([[[3, 4], [0, 1]], [[0, 1], [6, 8]], [[1, 0], [0, 2]], [[9, 9], [9, 9]]], dtype=np.float32)
    rows = [("s0", 0), ("s0", 1), ("s0", 2), ("s1", 1)]
    view = _View("attn.v", v, rows, {"num_attention_heads": 4, "num_key_value_heads": 2})
    s = mixture_scale(view, "attn.core", 0, [("s0", 2), ("s0", 0), ("s1", 1), ("s2", 0)], 8)
    assert s[0] == pytest.approx(math.sqrt(2 * (5 ** 2 + 10 ** 2)))    # max over positions 0..2, per KV head
    assert s[1] == pytest.approx(math.sqrt(2 * (5 ** 2 + 1 ** 2)))
    assert math.isnan(s[2]) and math.isnan(s[3])                       # a prefix not held; a row V lacks
    # MLA: kv_b holds every head's k_nope then its v (the last columns: 1 of 3 here); one head per value head
    kv_b = np.array([[[100, 100, 2], [100, 100, -3]]], dtype=np.float32)
    view = _View("attn.kv_b", kv_b, [("s0", 0)], {"num_attention_heads": 2})
    assert mixture_scale(view, "attn.core", 0, [("s0", 0)], 2)[0] == pytest.approx(math.sqrt(13))
    assert mixture_scale(view, "attn.out", 0, [("s0", 0)], 2) is None  # a point that mixes nothing
