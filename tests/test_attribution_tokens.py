"""The attribution's token budget is honoured (`--attribution-tokens N`, `find_divergence(attribution_tokens=N)`):
at most N rows run through the exact model, a causal prefix of the worst sample when it does not fit whole; a
budget that reaches no scored token is "unavailable" naming the limit; 0 is refused, never the default. On a
real transformers Qwen3 pair (fp32, a planted softmax-scale fault) and a checkpoint both ran."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tic_trace import find_divergence
from tic_trace.compare.judge import SettingsError
from tic_trace.replay.attribution import _budget
from tic_trace.replay.reference import NotReplayable
from tic_trace.testing.faults import plant
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config
from tic_trace.tools.cli import main as cli

from conftest import trace_hf

IDS = sample_tokens(2, 16)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("attribution-tokens")
    a = build_hf_model_stable(tiny_qwen3_config(moe=False), seed=0, dtype=torch.float32)
    a.save_pretrained(base / "ck")
    trace_hf(a, base / "a", IDS)
    b = build_hf_model_stable(tiny_qwen3_config(moe=False), seed=0, dtype=torch.float32)
    plant(b, "hf", "softmax_scale", 1)
    trace_hf(b, base / "b", IDS)
    return base / "a", base / "b", base / "ck"


def test_a_budget_of_4_attributes_a_causal_prefix_of_at_most_4_tokens(pair, tmp_path):
    a, b, ck = pair
    out = tmp_path / "r.json"
    code = cli(["first-divergence", str(a), str(b), "--reference", str(ck), "--attribution",
                "--attribution-tokens", "4", "--json", str(out)])
    att = json.loads(out.read_text())["attribution"]
    assert code == 1 and "unavailable" not in att, att
    # rows 0..3 of the worst sample, each scoring the next token: 4 of the pair's 30 scored tokens
    assert (att["tokens"], att["tokens_total"]) == (4, 30)


def test_a_budget_of_0_is_refused(pair, capsys):
    a, b, ck = pair
    assert cli(["first-divergence", str(a), str(b), "--reference", str(ck), "--attribution",
                "--attribution-tokens", "0"]) == 2
    assert "--attribution-tokens" in capsys.readouterr().err
    with pytest.raises(SettingsError, match="attribution_tokens"):
        find_divergence(str(a), str(b), reference=str(ck), attribution=True, attribution_tokens=0)


def test_a_budget_that_reaches_no_scored_token_is_unavailable_naming_the_limit():
    """A sample scored from position 8 on (its prompt unscored): a budget of 4 rows reaches none of them."""
    tokens = {("s", p): 7 for p in range(16)}
    view = SimpleNamespace(tokens=tokens)
    delta = {("s", p): 0.1 for p in range(8, 15)}
    with pytest.raises(NotReplayable, match=r"--attribution-tokens 4\).*a budget of 9 or more"):
        _budget(view, view, delta, 4)
    rows, _tokens, lp_rows = _budget(view, view, delta, 10)
    assert rows == [("s", p) for p in range(10)] and lp_rows == [("s", 8), ("s", 9)]
