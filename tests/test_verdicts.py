"""Verdicts you can trust, on real HF Qwen3-MoE pairs: routing flips are named (`routing`, with their layer,
margins and share of the output error), never excused into CONSISTENT; nothing compared is never
CONSISTENT; NaN/Inf are a cause, never a crash or a zero; re-judging a report with its own settings
reproduces it; the CLI never exits 1 unless it found a divergence.

Faults are planted in the computation (tic_trace/testing/faults.py). Routing faults that need two nearly
tied experts get the same setup (`prepare`) on both sides; the fault itself is on side B only.
"""
import json
import math

import numpy as np
import pytest
import torch

import tic_trace
from tic_trace.compare.metrics import compare_values
from tic_trace import find_divergence
from tic_trace.compare.diverge import rejudge
from tic_trace.compare.judge import FlipFacts, SettingsError, Tolerance, judge
from tic_trace.report.terminal import render_terminal
from tic_trace import Report
from tic_trace.report.schema import EXIT_ERROR, EXIT_NOT_COMPARABLE, encode, num
from tic_trace.testing.faults import FAULTS, plant, prepare
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
from tic_trace.tools.cli import main as cli

from conftest import trace_hf

IDS = sample_tokens(2, 10)
PROMPT = 6                    # decode traces: a prefill of 6 tokens, then one token per step


def _pair(tmp_path, fault, layer, *, decode=False):
    """Side A: the model (with the fault's setup); side B: the same model with the fault planted."""
    a = build_hf_model(tiny_qwen3_config(moe=True))
    prepare(a, "hf", fault, layer)
    trace_hf(a, tmp_path / "a", IDS)
    b = build_hf_model(tiny_qwen3_config(moe=True))
    prepare(b, "hf", fault, layer)
    plant(b, "hf", fault, layer)
    (_trace_decode if decode else trace_hf)(b, tmp_path / "b", IDS)
    return str(tmp_path / "a"), str(tmp_path / "b")


def _trace_decode(model, out, ids):
    """A prefill of PROMPT tokens, then one forward per further token with the KV cache (one pass each)."""
    with tic_trace.trace(model, out, adapter="hf", points_mode="full") as t, torch.no_grad():
        cache = model(ids[:, :PROMPT], use_cache=True).past_key_values
        for s in range(PROMPT, ids.shape[1]):
            t.step()
            cache = model(ids[:, s:s + 1], past_key_values=cache, cache_position=torch.tensor([s]),
                          use_cache=True).past_key_values
    assert t.failed is None, t.failed


def assert_round_trip(rep: Report) -> dict:
    """The JSON report re-judged with its own settings is the same report."""
    doc = json.loads(json.dumps(rep.to_json()))
    again = rejudge(doc)
    assert again == doc, [k for k in doc if again.get(k) != doc.get(k)]
    return doc


def _routing(rep, layer):
    return next(f for f in rep.findings if f.cause == "routing" and f.layer == layer)


# ------------------------------------------------------------------------------------------------ routing

@pytest.mark.parametrize("layer", [0, 1])
def test_near_tie_flip_is_a_routing_divergence(tmp_path, layer):
    rep = find_divergence(*_pair(tmp_path, "routing_near_tie", layer))
    assert rep.verdict == "divergent" and rep.exit_code == 1
    assert rep.first["key"] == f"L{layer}.moe.topk_ids" and rep.first["cause"] == "routing"
    f = _routing(rep, layer)
    assert f.divergent and not f.computational
    assert f.detail["flipped"] > 0 and f.detail["near_tie"] == f.detail["flipped"]
    assert f.detail["near_tie_to_output"] > 0
    for flip in f.detail["flips"]:          # each flip's margin is within twice its router-logit error
        assert flip["explained"] and flip["margin"] <= 2 * flip["logit_error"]
        assert flip["logit_error"] < 1e-4
    assert 0 < f.detail["dlogprob_share"] <= 1
    # the routed points are judged without the flipped tokens: no operator divergence anywhere
    assert not [p.key for p in rep.points if p.status == "divergent" and p.cause != "routing"]
    assert "routing" in rep.to_json()["findings"][0]["cause"]
    assert_round_trip(rep)
    # accepting near ties makes this pair consistent, the finding still shown
    acc = find_divergence(*_pair(tmp_path / "x", "routing_near_tie", layer), accept_near_tie=True)
    assert acc.verdict == "consistent" and acc.exit_code == 0
    assert _routing(acc, layer).detail["flipped"] == f.detail["flipped"] and not _routing(acc, layer).divergent
    assert_round_trip(acc)


@pytest.mark.parametrize("layer", [0, 1])
def test_changed_router_weight_is_routing_at_the_router(tmp_path, layer):
    rep = find_divergence(*_pair(tmp_path, "router_weight", layer))
    assert rep.first["key"] == f"L{layer}.moe.router_logits" and rep.first["cause"] == "routing"
    f = _routing(rep, layer)
    assert f.divergent and f.computational and f.detail["router_divergent"]
    assert f.detail["flipped"] > 0 and f.detail["unexplained"] == f.detail["flipped"]
    assert "router" in f.remedy
    assert_round_trip(rep)
    # near ties accepted or not, routers that compute differently are a divergence
    assert find_divergence(*_pair(tmp_path / "x", "router_weight", layer), accept_near_tie=True).verdict == "divergent"


@pytest.mark.parametrize("layer", [0, 1])
def test_selection_bias_flips_with_agreeing_router_logits(tmp_path, layer):
    """The router logits agree; the choice does not: flips with a margin over the router-logit error."""
    rep = find_divergence(*_pair(tmp_path, "expert_bias", layer))
    assert rep.first["key"] == f"L{layer}.moe.topk_ids" and rep.first["cause"] == "routing"
    router = next(p for p in rep.points if p.key == f"L{layer}.moe.router_logits")
    assert router.status == "ok"
    f = _routing(rep, layer)
    assert f.computational and f.detail["unexplained"] == f.detail["flipped"] > 0
    assert all(x["margin"] > 2 * x["logit_error"] for x in f.detail["flips"])
    assert_round_trip(rep)


@pytest.mark.parametrize("layer", [0, 1])
def test_flips_only_in_decode_steps(tmp_path, layer):
    """Side B's router changes its choice in decode steps only, on margins far over any rounding: the flips
    found are exactly decode rows. (Its prefill rows come from other GEMM shapes than side A's one forward, so
    they agree only to rounding; the fault is built so that no rounding can flip them.)"""
    rep = find_divergence(*_pair(tmp_path, "expert_bias_decode", layer, decode=True))
    assert rep.rows["matched"] == 20
    assert rep.first["key"] == f"L{layer}.moe.topk_ids" and rep.first["cause"] == "routing"
    f = _routing(rep, layer)
    assert f.detail["flipped"] > 0 and f.computational
    assert all(x["margin"] > 2 * x["logit_error"] for x in f.detail["flips"])
    assert all(int(x["row"].split("@")[1]) >= PROMPT for x in f.detail["flips"])
    assert_round_trip(rep)


def test_terminal_and_html_show_the_cause_first(tmp_path, capsys):
    a, b = _pair(tmp_path, "routing_near_tie", 1)
    assert cli(["first-divergence", a, b, "--html", str(tmp_path / "r.html")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FIRST DIVERGENCE at L1.moe.topk_ids [routing]")
    assert lines[1].strip().startswith("cause [routing] at L1.moe.topk_ids")
    assert "what removes it" in lines[2] or "what removes it" in " ".join(lines[2:5])
    page = (tmp_path / "r.html").read_text()
    assert page.index('class="causes"') < page.index('id="growth"')
    assert cli(["first-divergence", a, b, "--accept-near-tie-routing"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CONSISTENT") and "cause [routing] (not counted)" in out


# ------------------------------------------------------------------------------------------------ nothing compared

def test_no_rows_in_common_is_not_comparable(tmp_path):
    model = build_hf_model(tiny_qwen3_config(moe=True))
    trace_hf(model, tmp_path / "a", IDS, sample_keys=["req-0", "req-1"])
    trace_hf(model, tmp_path / "b", IDS, sample_keys=["other-0", "other-1"])
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "not_comparable" and rep.exit_code == EXIT_NOT_COMPARABLE == 3
    assert rep.rows["matched"] == 0 and rep.first is None
    assert all(p.status == "not_comparable" for p in rep.points)
    assert any("no rows in common" in (x["reason"] or "") for x in rep.not_comparable)
    assert_round_trip(rep)
    assert cli(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 3


def test_empty_side_is_not_comparable(tmp_path, capsys):
    model = build_hf_model(tiny_qwen3_config(moe=True))
    trace_hf(model, tmp_path / "a", IDS)
    with tic_trace.trace(model, tmp_path / "b", adapter="hf", points_mode="full") as t:
        pass                                  # traced, but the model never ran
    assert t.failed is None
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "not_comparable" and rep.exit_code == 3
    assert cli(["first-divergence", str(tmp_path / "a"), str(tmp_path / "b")]) == 3
    assert capsys.readouterr().out.startswith("NOT COMPARABLE")


# ------------------------------------------------------------------------------------------------ NaN / Inf

def test_nan_on_one_side_is_a_cause_not_a_crash(tmp_path, capsys):
    a, b = _pair(tmp_path, "final_norm_nan", 1)
    rep = find_divergence(a, b)
    assert rep.first["key"] == "final_norm" and rep.first["cause"] == "nonfinite"
    assert [f.cause for f in rep.findings if f.divergent] == ["nonfinite"]
    # the NaN was planted in a weight: the contract says so (shown, not counted)
    assert [(f.cause, f.key) for f in rep.findings if not f.divergent] == [("weights", "final_norm")]
    # downstream points carry the NaN: "over", never a second divergence
    assert [p.status for p in rep.points if p.key in ("logits", "logprobs")] == ["over", "over"]
    # per-token: NaN rows are never 0
    assert all(rep.token_errors[w.label]["final_norm"] == math.inf for w in rep.worst_tokens)
    assert {w.divergence_starts for w in rep.worst_tokens} == {"final_norm"}
    doc = assert_round_trip(rep)
    assert json.dumps(doc, allow_nan=False)        # strict JSON
    render_terminal(doc)                           # NaN in the report renders
    assert cli(["first-divergence", a, b, "--json", str(tmp_path / "r.json")]) == 1
    assert json.loads((tmp_path / "r.json").read_text())["first_divergence"]["cause"] == "nonfinite"


def test_nan_inside_a_moe_layer(tmp_path):
    """NaN in a layer's norm weight: nonfinite at that point; the NaN router logits downstream flip experts,
    shown as routing that follows the earlier difference, not counted before it."""
    model = build_hf_model(tiny_qwen3_config(moe=True))
    trace_hf(model, tmp_path / "a", IDS)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[5] = float("nan")
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.first["key"] == "L1.mlp_norm" and rep.first["cause"] == "nonfinite"
    assert all(p.status != "divergent" or p.cause == "routing" for p in rep.points if p.key != "L1.mlp_norm")
    assert_round_trip(rep)


def test_per_row_errors_of_nan_rows_are_infinite():
    a = np.ones((3, 4), np.float32)
    b = a.copy()
    b[1, 2] = np.nan
    m = compare_values(a, b, "float32")
    assert m.per_row_rel[0] == 0 and m.per_row_rel[1] == math.inf and m.per_row_max[1] == math.inf
    assert m.nonfinite == 1 and m.error == math.inf


def test_codec_round_trips_non_finite_numbers():
    x = {"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": np.float32(2.0)}
    doc = json.loads(json.dumps(encode(x), allow_nan=False))
    assert doc == {"a": "nan", "b": ["inf", "-inf", 1.5], "c": 2.0}
    assert math.isnan(num(doc["a"])) and num(doc["b"][0]) == math.inf and num(doc["b"][1]) == -math.inf


# ------------------------------------------------------------------------------------------------ the judge, settings

def test_one_judge_rules():
    assert judge(2e-5, 0.0, 1e-5, 10).status == "divergent"
    assert judge(2e-5, 1e-5, 1e-5, 10).status == "over"
    assert judge(5e-6, 0.0, 1e-5, 10).status == "ok"
    assert judge(math.inf, 0.0, 1e-5, 10, nonfinite=True).cause == "nonfinite"
    assert judge(math.inf, math.inf, 1e-5, 10, nonfinite=True).status == "over"
    assert judge(math.nan, 0.0, 1e-5, 10).status == "divergent"        # NaN error is never "within tolerance"
    near = FlipFacts(flipped=3, near_tie_to_output=2)
    assert judge(0.1, 0, 0, 10, "ids", flips=near).cause == "routing"
    assert judge(0.1, 0, 0, 10, "ids", flips=FlipFacts(3, 0, 2, accept_near_tie=True)).status == "over"
    assert judge(0.1, 0, 0, 10, "ids", flips=FlipFacts(3, 1, 0, accept_near_tie=True)).status == "divergent"
    assert judge(0.1, 0, 0, 10, "ids", flips=FlipFacts(3, 0, 0)).status == "over"


@pytest.mark.parametrize("bad", [dict(growth=math.nan), dict(growth=-1), dict(growth=0.5),
                                 dict(per_dtype={"float32": math.nan}), dict(per_dtype={"float32": -1e-5}),
                                 dict(per_point={"attn.cor": 1e-3}), dict(per_point={"L3.attn.cor": 1e-3}),
                                 dict(per_point={"L3.embed": 1e-3}), dict(per_dtype={"bfloat17": 1e-2})])
def test_settings_reject_nan_negative_and_unknown_keys(bad):
    with pytest.raises(SettingsError):
        Tolerance(**bad)


def test_cli_settings_errors(tmp_path, capsys):
    model = build_hf_model(tiny_qwen3_config(moe=True))
    trace_hf(model, tmp_path / "a", IDS)
    a = str(tmp_path / "a")
    for args in (["--tol", "float32=nan"], ["--growth", "nan"], ["--tol", "attn.cor=1e-3"], ["--tol", "float32=-1"]):
        assert cli(["diff", a, a, *args]) == EXIT_ERROR
        cap = capsys.readouterr()
        out = (cap.out + cap.err).strip()
        assert len(out.splitlines()) == 1 and "error" in out and ("--tol" in out or "--growth" in out), out
    with pytest.raises(SettingsError, match="attn.core"):
        Tolerance(per_point={"attn.cor": 1e-3})
    # --accept-precision names a canonical point or key; anything else is refused with the closest names
    for bad in ("moe.topk_weight", "L1.moe.topk_weight", "float32"):
        assert cli(["first-divergence", a, a, "--accept-precision", bad]) == EXIT_ERROR
        out = capsys.readouterr()
        line = (out.out + out.err).strip()
        assert len(line.splitlines()) == 1 and "--accept-precision" in line and repr(bad) in line, line
    assert "moe.topk_weights" in line or "did you mean" in line
    with pytest.raises(SettingsError, match="did you mean moe.topk_weights"):
        find_divergence(a, a, accept_precision=["moe.topk_weight"])
    assert cli(["first-divergence", a, a, "--accept-precision", "moe.topk_weights",
                "--accept-precision", "L1.moe.topk_weights", "--json", str(tmp_path / "r.json")]) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["settings"]["accept_precision"] == ["L1.moe.topk_weights", "moe.topk_weights"]
    capsys.readouterr()


# ------------------------------------------------------------------------------------------------ CLI failures

def test_cli_crash_is_no_answer_never_divergence(tmp_path, capsys, monkeypatch):
    model = build_hf_model(tiny_qwen3_config(moe=True))
    trace_hf(model, tmp_path / "a", IDS)
    a = str(tmp_path / "a")

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash in the finder")
    monkeypatch.setattr("tic_trace.compare.diverge.find_divergence", boom)
    assert cli(["first-divergence", a, a]) == EXIT_ERROR == 2
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("error: first-divergence failed: RuntimeError: simulated crash in the finder")
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out
    assert cli(["first-divergence", a, a, "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().out


def test_rejudge_changes_only_with_settings(tmp_path):
    """Same settings: the same report; a looser tolerance at the faulty point: the answer moves on."""
    a, b = _pair(tmp_path, "o_proj_weight", 1)
    rep = find_divergence(a, b)
    doc = assert_round_trip(rep)
    loose = rejudge(doc, Tolerance(per_point={"attn.out": 1.0}))
    assert loose["first_divergence"] is None or loose["first_divergence"]["key"] != "L1.attn.out"
    assert rejudge(doc, Tolerance()) == doc
    assert FAULTS["o_proj_weight"].cause == "operator" and doc["first_divergence"]["cause"] == "operator"


def test_demo_shows_a_routing_cause(tmp_path, capsys):
    assert cli(["demo", "--fault", "routing_near_tie", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "FIRST DIVERGENCE at L1.moe.topk_ids [routing]" in out
    doc = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert doc["first_divergence"]["cause"] == "routing" and doc["exit_code"] == 1
