"""The log-prob semantics a side used, fingerprinted on its own traced logits (compare/logprob_semantics.py).

The used log-probs come from real code (tic_trace/testing/logprob_sides.py): the installed SGLang's
`Sampler.forward` (0.5.23; 0.5.15.post1 in the slime-stack lane: the same semantics, the same assertions) with its
default return and with its own SGLANG_RETURN_ORIGINAL_LOGPROB switch, SGLang's torch top-k/top-p/min-p filter, and
slime's `get_log_probs_and_entropy` with its rollout top-p replay.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tic_trace.compare.logprob_semantics import Semantics, bf16_round, candidates, fingerprint, recompute
from tic_trace.store.used_logprobs import Sampling
from tic_trace.testing.logprob_sides import SAMPLES, SPEC, SPEC_ORIGINAL, VOCAB, produce

from conftest import require_vendored_sources


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vendored_sources()
    return produce(SPEC, tmp_path_factory.getbasetemp() / "logprob_sides")


def _rows(arrays, run, samples=SAMPLES):
    """(logits rows, tokens, used log-probs) of a run's response tokens, all samples."""
    z, t, u = [], [], []
    for s in range(samples):
        seq, lp = arrays[f"{run}/{s}/tokens"], arrays[f"{run}/{s}/logprobs"]
        z.append(arrays[f"{run}/{s}/logits"])
        t.append(seq[len(seq) - len(lp):])
        u.append(lp)
    return np.concatenate(z), np.concatenate(t), np.concatenate(u)


def test_sglang_returns_the_full_distribution_after_temperature(runs):
    eng, _ = runs
    m = fingerprint("sglang", *_rows(eng, "t07"), [Sampling(0.7, 1.0, -1, 0.0)])
    assert m.verdict == "match" and m.best.semantics == Semantics(temperature=0.7), m.summary
    assert m.best.mean < 1e-5 and m.runner_up.mean > 10 * m.best.mean
    assert "T = 0.7" in m.summary and "next best" in m.summary


def test_sglang_original_logprobs_are_the_raw_distribution(tmp_path_factory):
    require_vendored_sources()
    eng, _ = produce(SPEC_ORIGINAL, tmp_path_factory.getbasetemp() / "logprob_sides_original", roles=("engine",))
    m = fingerprint("sglang", *_rows(eng, "original"), [Sampling(0.7, 1.0, -1, 0.0)])
    assert m.verdict == "match" and m.best.semantics.name == "raw", m.summary     # the request's T is not applied


def test_slime_top_p_replay_is_renormalised_over_sglangs_kept_set(runs):
    _, tr = runs
    m = fingerprint("megatron", *_rows(tr, "topp"), [Sampling(1.0, 0.9, -1, 0.0)])
    assert m.verdict == "match" and m.best.semantics.name == "raw+top_p", m.summary


def test_filters_follow_sglangs_sampler(runs):
    """recompute under T, top-k, top-p and min-p together gives SGLang's own filtered, renormalised
    probabilities for every token of every row: the same kept set (ties, inclusive/exclusive bounds), the same
    values."""
    eng, _ = runs
    z = eng["combo/0/logits"]
    sem = Semantics(temperature=0.8, top_k=5, top_p=0.8, min_p=0.1)
    toks = np.tile(np.arange(VOCAB), len(z))
    mine = recompute(np.repeat(z, VOCAB, axis=0), toks, sem).reshape(len(z), VOCAB)
    theirs = eng["combo/0/filtered"].astype(np.float64)
    assert np.array_equal(np.isfinite(mine), theirs > 0)
    kept = theirs > 0
    want = np.log(theirs / theirs.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(mine[kept], want[kept], atol=1e-5)
    assert 1 < kept.sum(axis=1).max() <= 5


def test_stated_parameters_that_make_candidates_equal_are_one_candidate():
    cands, _ = candidates([Sampling(1.0, 1.0, -1, 0.0), Sampling(1.0, 1.0, VOCAB, 0.0)], VOCAB)
    assert [c.name for c in cands] == ["raw", "raw_bf16"]
    cands, _ = candidates([Sampling(0.7, 0.9, 0, 0.0)], VOCAB)
    assert {c.name for c in cands} == {"raw", "raw+top_p", "temperature", "temperature+top_p", "temperature_bf16"}


def test_ambiguous_when_the_rows_cannot_tell_candidates_apart(runs):
    eng, _ = runs
    m = fingerprint("sglang", *_rows(eng, "clean"), [Sampling(1.0, 0.99999, -1, 0.0)])
    assert m.verdict == "ambiguous", m.summary
    assert {m.best.semantics.name, m.runner_up.semantics.name} == {"raw", "raw+top_p"}
    assert "do not tell them apart" in m.summary


def test_none_matches_when_the_stated_parameters_do_not_describe_the_side(runs):
    eng, _ = runs
    m = fingerprint("sglang", *_rows(eng, "t07"), [Sampling(1.0, 1.0, -1, 0.0)])   # it ran at T = 0.7
    assert m.verdict == "none" and m.best.mean > 1e-3, m.summary
    assert "match no known semantics" in m.summary
    unknown = fingerprint("sglang", *_rows(eng, "t07"), [Sampling(None, 1.0, -1, 0.0)])
    assert unknown.verdict == "none" and any("temperature not stated" in n for n in unknown.notes)
    empty = fingerprint("sglang", np.zeros((0, VOCAB)), np.zeros(0, np.int64), np.zeros(0), [Sampling()], missing=3)
    assert empty.verdict == "not_measured" and "not measured" in empty.summary


def test_bf16_rounding_is_torchs():
    x = np.random.default_rng(0).normal(size=4096).astype(np.float32) * 50
    want = torch.from_numpy(x).bfloat16().double().numpy()
    np.testing.assert_array_equal(bf16_round(x), want)
